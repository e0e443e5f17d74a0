/* test_ddp_overlap.c - the overlapping gradient reducer (td_ddp_options.overlap) across 3 real
 * processes: its gradients are bit-identical to the after-backward averaging of a second replica
 * fed the same data (before and after the buckets are rebuilt in arrival order), the buckets'
 * all-reduces start during backward (counters), no_sync accumulates locally and the next pass
 * averages the sums, a parameter without a gradient fails the pass naming it unless
 * find_unused_parameters (then it counts as zeros). All of it again with gradient_as_bucket_view:
 * the same bits, the .grads are views of the buckets (neighbours in memory), and a second
 * backward in one pass fails naming the parameter. A GPT with activation checkpointing (every
 * block, or every attention core), float64 and float32, under overlapped DDP with
 * gradient_as_bucket_view: the averaged gradients equal the plain GPT's bit for bit and the
 * buckets start during backward as they do without checkpointing (from the recompute's pass). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

enum { LAYERS = 6, WIDTH = 16 };

/* Linear(8, 16), Tanh, then LAYERS-1 Linear(16, 16) with Tanh, float64; the same on every rank
 * for a seed. */
static td_module *build(uint64_t seed) {
  MP_CHECK_OK(td_nn_manual_seed(seed));
  td_module *seq = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  for (int l = 0; l < LAYERS; l++) {
    td_module *lin = NULL, *act = NULL;
    MP_CHECK_OK(td_linear_create(l ? WIDTH : 8, WIDTH, true, NULL, &lin));
    MP_CHECK_OK(td_tanh_create(&act));
    MP_CHECK_OK(td_sequential_append(seq, lin));
    MP_CHECK_OK(td_sequential_append(seq, act));
    td_module_unref(lin);
    td_module_unref(act);
  }
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

/* Forward + backward of fwd (the whole model, or a part of it) on batch `seed`. */
static void backward_on(td_module *fwd, uint64_t seed) {
  int64_t xs[2] = {4, 8}, ys[2] = {4, WIDTH};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, seed, false);
  td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F64, seed + 1000, false);
  td_tensor *out = NULL, *loss = NULL;
  MP_CHECK_OK(td_module_forward(fwd, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(out);
  td_tensor_unref(loss);
}

/* Every parameter's .grad of a equals b's bit for bit. */
static void same_grads(td_module *a, td_module *b, const char *what) {
  td_tensor_list pa, pb;
  td_tensor_list_init(&pa);
  td_tensor_list_init(&pb);
  MP_CHECK_OK(td_module_parameters(a, &pa));
  MP_CHECK_OK(td_module_parameters(b, &pb));
  for (size_t i = 0; i < pa.n; i++) {
    td_tensor *ga = td_tensor_grad(pa.tensors[i]), *gb = td_tensor_grad(pb.tensors[i]);
    MP_CHECK(ga && gb);
    if (memcmp(td_tensor_data(ga), td_tensor_data(gb), td_tensor_nbytes(ga)) != 0) {
      fprintf(stderr, "%s: parameter %zu (%s): overlapped gradient differs\n", what, i,
              pa.names[i]);
      MP_CHECK(0);
    }
    td_tensor_unref(ga);
    td_tensor_unref(gb);
  }
  td_tensor_list_fini(&pa);
  td_tensor_list_fini(&pb);
}

/* Parameters whose .grad ends exactly where another one's begins: views of one bucket (separate
 * allocations never touch: the allocator puts a header before each block). */
static size_t grads_adjacent(td_module *m) {
  td_tensor_list p;
  td_tensor_list_init(&p);
  MP_CHECK_OK(td_module_parameters(m, &p));
  size_t n = 0;
  for (size_t i = 0; i < p.n; i++) {
    td_tensor *gi = td_tensor_grad(p.tensors[i]);
    for (size_t j = 0; gi && j < p.n; j++) {
      td_tensor *gj = td_tensor_grad(p.tensors[j]);
      if (gj && (const char *)td_tensor_data(gi) + td_tensor_nbytes(gi) == td_tensor_data(gj)) n++;
      td_tensor_unref(gj);
    }
    td_tensor_unref(gi);
  }
  td_tensor_list_fini(&p);
  return n;
}

static int worker_overlap(int rank, int world, const char *method, void *arg) {
  bool view = *(const bool *)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  /* two replicas from different seeds per rank; creation makes them rank 0's */
  td_module *over = build(10 + (uint64_t)rank), *plain = build(10 + (uint64_t)rank);
  td_ddp_options o;
  td_ddp_options_init(&o);
  o.overlap = true;
  o.bucket_bytes = 2 * (WIDTH * WIDTH + WIDTH) * 8; /* two layers a bucket */
  o.first_bucket_bytes = (WIDTH * WIDTH + WIDTH) * 8;
  o.gradient_as_bucket_view = view;
  td_ddp *dover = NULL, *dplain = NULL;
  MP_CHECK_OK(td_ddp_create_ex(pg, over, &o, &dover));
  MP_CHECK_OK(td_ddp_create(pg, plain, 0, &dplain));
  MP_CHECK(td_ddp_num_buckets(dover) >= 4);

  for (int step = 0; step < 3; step++) { /* step 0 rebuilds the buckets after it */
    uint64_t seed = 100 * (uint64_t)step + (uint64_t)rank;
    if (step != 2) { /* step 2 adds to the averages of step 1 (with views: into the buckets) */
      td_module_zero_grad(over);
      td_module_zero_grad(plain);
    }
    MP_CHECK_OK(td_ddp_prepare(dover));
    backward_on(over, seed);
    MP_CHECK_OK(td_ddp_finish(dover));
    backward_on(plain, seed);
    MP_CHECK_OK(td_ddp_sync_gradients(dplain));
    same_grads(over, plain, "pass");
    size_t adj = grads_adjacent(over), nb = (size_t)td_ddp_num_buckets(dover);
    MP_CHECK(view ? adj >= 2 * LAYERS - nb : adj == 0);
    MP_CHECK(grads_adjacent(plain) == 0);
  }
  td_ddp_stats s;
  MP_CHECK_OK(td_ddp_get_stats(dover, &s));
  fprintf(stderr, "rank %d: %llu passes, %llu of %llu bucket bytes started during backward\n",
          rank, (unsigned long long)s.passes, (unsigned long long)s.bytes_started_in_backward,
          (unsigned long long)s.bytes_reduced);
  MP_CHECK(s.passes == 3 && s.bytes_reduced > 0);
  MP_CHECK(s.bytes_started_in_backward * 2 >= s.bytes_reduced);

  /* gradient accumulation: two passes under no_sync, then one that averages the sums */
  td_module_zero_grad(over);
  td_module_zero_grad(plain);
  td_ddp_no_sync(dover, true);
  for (int k = 0; k < 2; k++) {
    MP_CHECK_OK(td_ddp_prepare(dover));
    backward_on(over, 500 + (uint64_t)(10 * k + rank));
    MP_CHECK_OK(td_ddp_finish(dover));
    backward_on(plain, 500 + (uint64_t)(10 * k + rank));
  }
  td_ddp_no_sync(dover, false);
  MP_CHECK_OK(td_ddp_prepare(dover));
  backward_on(over, 600 + (uint64_t)rank);
  MP_CHECK_OK(td_ddp_finish(dover));
  backward_on(plain, 600 + (uint64_t)rank);
  MP_CHECK_OK(td_ddp_sync_gradients(dplain));
  same_grads(over, plain, "no_sync");

  /* a pass through the first layer only: the other parameters get no gradient */
  td_module *first = td_module_child_at(over, 0, NULL);
  td_module_zero_grad(over);
  MP_CHECK_OK(td_ddp_prepare(dover));
  int64_t xs[2] = {4, 8};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 7, false), *y = NULL, *l = NULL;
  MP_CHECK_OK(td_module_forward(first, x, &y));
  MP_CHECK_OK(td_tensor_sum_all(y, &l));
  MP_CHECK_OK(td_tensor_backward(l));
  MP_CHECK(td_ddp_finish(dover) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "got no gradient") != NULL);
  MP_CHECK(strstr(td_last_error(), "find_unused_parameters") != NULL);
  td_tensor_unref(y);
  td_tensor_unref(l);
  td_tensor_unref(x);
  if (view) { /* two backwards in one pass: the second one's gradients find their buckets started */
    td_module_zero_grad(over);
    MP_CHECK_OK(td_ddp_prepare(dover));
    backward_on(over, 700);
    backward_on(over, 701);
    MP_CHECK(td_ddp_finish(dover) == TD_ERR_STATE);
    MP_CHECK(strstr(td_last_error(), "second gradient after its bucket's all_reduce started"));
  }
  td_ddp_destroy(dover);

  o.find_unused_parameters = true;
  MP_CHECK_OK(td_ddp_create_ex(pg, over, &o, &dover));
  td_module_zero_grad(over);
  MP_CHECK_OK(td_ddp_prepare(dover));
  x = td_test_randn(xs, 2, TD_DTYPE_F64, 7 + (uint64_t)rank, false);
  MP_CHECK_OK(td_module_forward(first, x, &y));
  MP_CHECK_OK(td_tensor_sum_all(y, &l));
  MP_CHECK_OK(td_tensor_backward(l));
  MP_CHECK_OK(td_ddp_finish(dover));
  MP_CHECK_OK(td_ddp_get_stats(dover, &s));
  MP_CHECK(s.unused_parameters == 2 * LAYERS - 2);
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  MP_CHECK_OK(td_module_parameters(over, &ps));
  td_tensor *g_last = td_tensor_grad(ps.tensors[ps.n - 1]);
  MP_CHECK(g_last != NULL); /* zeros, averaged */
  const double *gv = td_tensor_data(g_last);
  for (int64_t k = 0; k < td_tensor_numel(g_last); k++) MP_CHECK(gv[k] == 0);
  td_tensor_unref(g_last);
  td_tensor_list_fini(&ps);
  td_tensor_unref(y);
  td_tensor_unref(l);
  td_tensor_unref(x);

  td_ddp_destroy(dover);
  td_ddp_destroy(dplain);
  td_module_unref(over);
  td_module_unref(plain);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

/* ---- activation checkpointing ---- */

static td_module *gpt(td_dtype dt, td_checkpoint_mode mode) {
  td_module *m = td_test_tiny_gpt(dt, 3, 3);
  MP_CHECK_OK(td_gpt_set_activation_checkpointing(m, mode));
  return m;
}

/* One DDP pass of m on this rank's batch `seed`; its graph holds `regions` checkpointed regions. */
static void gpt_pass(td_ddp *d, td_module *m, uint64_t seed, int regions) {
  int64_t s[2] = {2, 8}, v[16], t[16];
  for (int i = 0; i < 16; i++) {
    v[i] = (int64_t)((seed * 7 + (uint64_t)i * 5) % 13);
    t[i] = (v[i] + 1) % 13;
  }
  td_tensor *idx = NULL, *tgt = NULL, *logits = NULL, *loss = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(v, s, 2, TD_DTYPE_I64, &idx));
  MP_CHECK_OK(td_tensor_from_buffer(t, s, 2, TD_DTYPE_I64, &tgt));
  td_module_zero_grad(m);
  MP_CHECK_OK(td_ddp_prepare(d));
  MP_CHECK_OK(td_gpt_forward(m, idx, tgt, &logits, &loss));
  MP_CHECK(td_test_count_nodes(loss, "CheckpointBackward") == regions);
  MP_CHECK_OK(td_tensor_backward(loss));
  MP_CHECK_OK(td_ddp_finish(d));
  td_tensor_unref(idx), td_tensor_unref(tgt), td_tensor_unref(logits), td_tensor_unref(loss);
}

static int worker_checkpoint(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  td_dtype dts[2] = {TD_DTYPE_F64, TD_DTYPE_F32};
  td_checkpoint_mode modes[2] = {TD_CHECKPOINT_FULL, TD_CHECKPOINT_SELECTIVE};
  for (int k = 0; k < 4; k++) {
    td_module *ck = gpt(dts[k / 2], modes[k % 2]), *plain = gpt(dts[k / 2], TD_CHECKPOINT_NONE);
    td_ddp_options o;
    td_ddp_options_init(&o);
    o.overlap = true;
    o.gradient_as_bucket_view = true;
    o.bucket_bytes = 4096; /* several buckets */
    o.first_bucket_bytes = 2048;
    td_ddp *dck = NULL, *dplain = NULL;
    MP_CHECK_OK(td_ddp_create_ex(pg, ck, &o, &dck));
    MP_CHECK_OK(td_ddp_create_ex(pg, plain, &o, &dplain));
    MP_CHECK(td_ddp_num_buckets(dck) >= 3);
    for (int step = 0; step < 2; step++) { /* step 0 rebuilds the buckets after it */
      gpt_pass(dck, ck, 10 * (uint64_t)step + (uint64_t)rank, 3); /* one per block */
      gpt_pass(dplain, plain, 10 * (uint64_t)step + (uint64_t)rank, 0);
      same_grads(ck, plain, modes[k % 2] == TD_CHECKPOINT_FULL ? "checkpointed blocks"
                                                              : "checkpointed attention");
    }
    td_ddp_stats sc, sp;
    MP_CHECK_OK(td_ddp_get_stats(dck, &sc));
    MP_CHECK_OK(td_ddp_get_stats(dplain, &sp));
    MP_CHECK(sc.bytes_reduced == sp.bytes_reduced && sc.bytes_reduced > 0);
    MP_CHECK(sc.bytes_started_in_backward == sp.bytes_started_in_backward);
    MP_CHECK(sc.bytes_started_in_backward * 2 >= sc.bytes_reduced);
    td_ddp_destroy(dck), td_ddp_destroy(dplain);
    td_module_unref(ck), td_module_unref(plain);
  }
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_ddp_overlap_checkpointed_gpt_matches_plain(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_checkpoint, NULL, 120);
}

static void test_ddp_overlap_matches_after_backward(void **state) {
  (void)state;
  int codes[3];
  bool view = false;
  int fails = td_mp_run(3, worker_overlap, &view, 120, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

static void test_ddp_gradient_as_bucket_view_matches_after_backward(void **state) {
  (void)state;
  int codes[3];
  bool view = true;
  int fails = td_mp_run(3, worker_overlap, &view, 120, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ddp_overlap_matches_after_backward),
      cmocka_unit_test(test_ddp_gradient_as_bucket_view_matches_after_backward),
      cmocka_unit_test(test_ddp_overlap_checkpointed_gpt_matches_plain),
  };
  return cmocka_run_group_tests_name("ddp_overlap", tests, NULL, NULL);
}
