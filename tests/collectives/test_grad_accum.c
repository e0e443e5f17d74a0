/* test_grad_accum.c - gradient accumulation: K micro-batches per optimizer step with one
 * reduction equal one step on the K-times batch (float64, 1e-10, 3 AdamW steps with two
 * parameter groups and clipping), each micro-batch's loss divided by K by the caller:
 *   - one process: plain autograd accumulation of the K losses / K;
 *   - 3 processes, DDP: overlapped (with and without gradient_as_bucket_view) under
 *     td_ddp_no_sync, and after backward (td_ddp_sync_gradients under no_sync reduces nothing);
 *     the averaged .grads equal the reference's after every step, one reduction per step (bytes
 *     and passes counted), and with views the window's gradients live in the buckets (no .grad
 *     after a no_sync pass);
 *   - 3 processes, ZeRO stages 1 and 2 (after backward: .grads accumulate), 2 with overlap and
 *     3 (td_zero_no_sync: the gradients accumulate in the bucket buffers, the last pass reduces
 *     each bucket during its backward): parameters and global norms equal the reference's, one
 *     reduction per step (bytes_reduced is a step's shard layout, S x world elements, per step),
 *     no .grad kept between passes, stage 3's units freed after every pass's backward; a step
 *     under no_sync is refused; a window whose last pass was also no_sync is reduced by the step;
 *     td_zero_zero_grad drops an open window.
 * Micro-batch k of rank r is rows [(r K + k) B, (r K + k + 1) B) of the step's global batch of
 * world x K x B rows, which the reference takes whole. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

enum { WORLD = 3, K = 3, B = 2, STEPS = 3 };
#define LR 0.05
#define DECAY 0.1
#define MAX_NORM 0.1

/* 5 -> 7 -> tanh -> 3, float64: W1 35, b1 7, W2 21, b2 3 = 66 elements */
static td_module *build(uint64_t seed) {
  MP_CHECK_OK(td_nn_manual_seed(seed));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(5, 7, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_linear_create(7, 3, true, NULL, &l2));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  MP_CHECK_OK(td_sequential_append(seq, l2));
  td_module_unref(l1);
  td_module_unref(act);
  td_module_unref(l2);
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

/* Rows [first, first + n) of step `step`'s global batch (world x K x B rows). */
static void rows(int world, int step, int64_t first, int64_t n, td_tensor **x, td_tensor **y) {
  int64_t xs[2] = {(int64_t)world * K * B, 5}, ys[2] = {(int64_t)world * K * B, 3};
  td_tensor *ax = td_test_randn(xs, 2, TD_DTYPE_F64, 77 + (uint64_t)(100 * world + step), false);
  td_tensor *ay = td_test_randn(ys, 2, TD_DTYPE_F64, 99 + (uint64_t)(100 * world + step), false);
  td_tensor *vx = NULL, *vy = NULL;
  MP_CHECK_OK(td_tensor_narrow(ax, 0, first, n, &vx));
  MP_CHECK_OK(td_tensor_narrow(ay, 0, first, n, &vy));
  MP_CHECK_OK(td_tensor_clone(vx, x));
  MP_CHECK_OK(td_tensor_clone(vy, y));
  td_tensor_unref(ax), td_tensor_unref(ay), td_tensor_unref(vx), td_tensor_unref(vy);
}

/* Forward + backward of rows [first, first + n) with the loss multiplied by scale. */
static void backward_rows(td_module *m, int world, int step, int64_t first, int64_t n,
                          double scale) {
  td_tensor *x = NULL, *y = NULL, *out = NULL, *loss = NULL, *scaled = NULL;
  rows(world, step, first, n, &x, &y);
  MP_CHECK_OK(td_module_forward(m, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_mul_scalar(loss, scale, &scaled));
  MP_CHECK_OK(td_tensor_backward(scaled));
  td_tensor_unref(x), td_tensor_unref(y), td_tensor_unref(out), td_tensor_unref(loss);
  td_tensor_unref(scaled);
}

/* Micro-batch k of `rank`: its B rows, loss / K. */
static void micro_backward(td_module *m, int world, int rank, int step, int k) {
  backward_rows(m, world, step, ((int64_t)rank * K + k) * B, B, 1.0 / K);
}

/* weights (decay) and biases (none), as GPT recipes group them */
static void groups_of(td_tensor_list *p, td_tensor **w, td_tensor **b, td_optim_group g[2]) {
  w[0] = p->tensors[0], w[1] = p->tensors[2];
  b[0] = p->tensors[1], b[1] = p->tensors[3];
  td_optim_group_init(&g[0], w, 2);
  g[0].weight_decay = DECAY;
  td_optim_group_init(&g[1], b, 2);
  g[1].weight_decay = 0.0;
}

static td_optim_options adamw(void) {
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  o.lr = LR;
  return o;
}

static bool close_to(const td_tensor *a, const td_tensor *b) {
  bool ok = false;
  MP_CHECK_OK(td_tensor_allclose(a, b, 1e-10, 1e-12, &ok));
  return ok;
}

/* The reference: the module and its optimizer in one process. */
typedef struct ref {
  td_module *m;
  td_tensor_list p;
  td_tensor *w[2], *b[2];
  td_optim *opt;
  double norm;
  td_tensor *grads[4]; /* the last step's gradients, before clipping */
} ref;

static void ref_make(ref *r) {
  r->m = build(1000);
  td_tensor_list_init(&r->p);
  MP_CHECK_OK(td_module_parameters(r->m, &r->p));
  td_optim_group g[2];
  groups_of(&r->p, r->w, r->b, g);
  td_optim_options o = adamw();
  MP_CHECK_OK(td_optim_create_groups(&o, g, 2, &r->opt));
  memset(r->grads, 0, sizeof r->grads);
}

/* One step on the whole global batch of world x K x B rows. */
static void ref_step(ref *r, int world, int step) {
  td_optim_zero_grad(r->opt);
  backward_rows(r->m, world, step, 0, (int64_t)world * K * B, 1.0);
  for (size_t i = 0; i < 4; i++) {
    td_tensor_unref(r->grads[i]);
    td_tensor *g = td_tensor_grad(r->p.tensors[i]);
    MP_CHECK(g != NULL);
    MP_CHECK_OK(td_tensor_clone(g, &r->grads[i]));
    td_tensor_unref(g);
  }
  MP_CHECK_OK(td_optim_clip_grad_norm(r->opt, MAX_NORM, 2.0, &r->norm));
  MP_CHECK(r->norm > MAX_NORM); /* the clipping is exercised */
  MP_CHECK_OK(td_optim_step(r->opt));
}

static void ref_free(ref *r) {
  for (size_t i = 0; i < 4; i++) td_tensor_unref(r->grads[i]);
  td_optim_destroy(r->opt);
  td_tensor_list_fini(&r->p);
  td_module_unref(r->m);
}

/* Every parameter of pm equals the reference's (1e-10). */
static void same_params(td_tensor_list *pm, ref *r, const char *what, int rank, int step) {
  for (size_t i = 0; i < 4; i++)
    if (!close_to(pm->tensors[i], r->p.tensors[i])) {
      fprintf(stderr, "[rank %d] %s step %d: parameter %s differs from the K-times batch\n", rank,
              what, step, pm->names[i]);
      MP_CHECK(0);
    }
}

/* Parameters with a .grad. */
static int grads_held(td_tensor_list *p) {
  int n = 0;
  for (size_t i = 0; i < p->n; i++) {
    td_tensor *g = td_tensor_grad(p->tensors[i]);
    n += g != NULL;
    td_tensor_unref(g);
  }
  return n;
}

/* ---- one process ---- */

static void test_grad_accum_one_process_equals_k_times_batch(void **state) {
  (void)state;
  ref r;
  ref_make(&r);
  td_module *m = build(1000);
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  td_tensor *w[2], *b[2];
  td_optim_group g[2];
  groups_of(&pm, w, b, g);
  td_optim_options o = adamw();
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create_groups(&o, g, 2, &opt));
  for (int step = 0; step < STEPS; step++) {
    td_optim_zero_grad(opt);
    for (int k = 0; k < K; k++) micro_backward(m, 1, 0, step, k);
    ref_step(&r, 1, step);
    for (size_t i = 0; i < 4; i++) {
      td_tensor *gm = td_tensor_grad(pm.tensors[i]);
      assert_true(gm && close_to(gm, r.grads[i]));
      td_tensor_unref(gm);
    }
    double norm = 0;
    TD_ASSERT_OK(td_optim_clip_grad_norm(opt, MAX_NORM, 2.0, &norm));
    assert_true(fabs(norm - r.norm) <= 1e-10 * r.norm);
    TD_ASSERT_OK(td_optim_step(opt));
    same_params(&pm, &r, "one process", 0, step);
  }
  td_optim_destroy(opt);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  ref_free(&r);
}

/* ---- DDP ---- */

typedef enum ddp_mode { DDP_OVERLAP, DDP_VIEW, DDP_AFTER } ddp_mode;

static void run_ddp(td_process_group *pg, int rank, ddp_mode mode) {
  static const char *names[] = {"ddp overlap", "ddp gradient_as_bucket_view", "ddp after backward"};
  ref r;
  ref_make(&r);
  td_module *m = build(1000 + (uint64_t)rank); /* creation copies rank 0's: the reference's */
  td_ddp_options o;
  td_ddp_options_init(&o);
  o.overlap = mode != DDP_AFTER;
  o.gradient_as_bucket_view = mode == DDP_VIEW;
  o.bucket_bytes = o.first_bucket_bytes = 2 * 8 * 21; /* a few buckets */
  td_ddp *d = NULL;
  MP_CHECK_OK(td_ddp_create_ex(pg, m, &o, &d));
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  td_tensor *w[2], *b[2];
  td_optim_group g[2];
  groups_of(&pm, w, b, g);
  td_optim_options oo = adamw();
  td_optim *opt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&oo, g, 2, &opt));
  for (int step = 0; step < STEPS; step++) {
    td_optim_zero_grad(opt);
    for (int k = 0; k < K; k++) {
      td_ddp_no_sync(d, k < K - 1);
      if (mode != DDP_AFTER) MP_CHECK_OK(td_ddp_prepare(d));
      micro_backward(m, WORLD, rank, step, k);
      if (mode != DDP_AFTER) MP_CHECK_OK(td_ddp_finish(d));
      else MP_CHECK_OK(td_ddp_sync_gradients(d));
      /* no_sync passes: .grads keep the sums, or (views) the buckets do and no .grad exists */
      if (k < K - 1) MP_CHECK(grads_held(&pm) == (mode == DDP_VIEW ? 0 : 4));
    }
    ref_step(&r, WORLD, step);
    for (size_t i = 0; i < 4; i++) {
      td_tensor *gm = td_tensor_grad(pm.tensors[i]);
      if (!gm || !close_to(gm, r.grads[i])) {
        fprintf(stderr, "[rank %d] %s step %d: averaged gradient of %s differs\n", rank,
                names[mode], step, pm.names[i]);
        MP_CHECK(0);
      }
      td_tensor_unref(gm);
    }
    double norm = 0;
    MP_CHECK_OK(td_optim_clip_grad_norm(opt, MAX_NORM, 2.0, &norm));
    MP_CHECK(fabs(norm - r.norm) <= 1e-10 * r.norm);
    MP_CHECK_OK(td_optim_step(opt));
    same_params(&pm, &r, names[mode], rank, step);
  }
  td_ddp_stats s;
  MP_CHECK_OK(td_ddp_get_stats(d, &s));
  MP_CHECK(s.passes_accumulated == (uint64_t)(K - 1) * STEPS);
  if (mode != DDP_AFTER) {
    MP_CHECK(s.passes == STEPS && s.unused_parameters == 0);
    MP_CHECK(s.bytes_reduced == (uint64_t)STEPS * 66 * 8); /* one reduction per step */
    MP_CHECK(s.bytes_started_in_backward > 0);
  }
  td_ddp_destroy(d);
  td_optim_destroy(opt);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  ref_free(&r);
}

static int worker_ddp(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, td_test_ms(20000), &pg));
  run_ddp(pg, rank, DDP_OVERLAP);
  run_ddp(pg, rank, DDP_VIEW);
  run_ddp(pg, rank, DDP_AFTER);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_grad_accum_ddp_equals_k_times_batch(void **state) {
  (void)state;
  int codes[WORLD];
  int fails = td_mp_run(WORLD, worker_ddp, NULL, 90, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

/* ---- ZeRO ---- */

typedef enum zero_mode { Z1, Z2, Z2_OVERLAP, Z3 } zero_mode;

static void run_zero(td_process_group *pg, int rank, zero_mode mode) {
  static const char *names[] = {"zero1", "zero2", "zero2 overlap", "zero3"};
  ref r;
  ref_make(&r);
  td_module *m = build(1000 + (uint64_t)rank); /* creation copies rank 0's: the reference's */
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  td_tensor *w[2], *b[2], *rev[4];
  td_optim_group g[2];
  groups_of(&pm, w, b, g);
  for (size_t i = 0; i < 4; i++) rev[i] = pm.tensors[3 - i];
  td_optim_options o = adamw();
  td_module *units[2] = {td_module_child(m, "0"), td_module_child(m, "2")};
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = mode == Z1 ? 1 : mode == Z3 ? 3 : 2;
  zo.max_grad_norm = MAX_NORM;
  zo.overlap = mode == Z2_OVERLAP;
  zo.bucket_bytes = zo.first_bucket_bytes = 1; /* a bucket per parameter */
  if (mode == Z2_OVERLAP) zo.grad_order = rev, zo.n_grad_order = 4;
  if (mode == Z3) zo.units = units, zo.n_units = 2;
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &z));
  bool overlap = mode == Z2_OVERLAP || mode == Z3;
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  uint64_t reduction = (uint64_t)zs.shard_numel * WORLD * 8; /* bytes of one reduction */

  if (overlap) { /* a window dropped by td_zero_zero_grad leaves no trace */
    td_zero_no_sync(z, true);
    MP_CHECK_OK(td_zero_prepare(z));
    micro_backward(m, WORLD, rank, 99, 0);
    MP_CHECK(td_zero_step(z) == TD_ERR_STATE); /* under no_sync */
    MP_CHECK(strstr(td_last_error(), "td_zero_no_sync is set") != NULL);
  }
  for (int step = 0; step < STEPS; step++) {
    td_zero_zero_grad(z);
    /* zero2 overlap, step 1: every pass under no_sync, the step reduces the window */
    bool all_no_sync = mode == Z2_OVERLAP && step == 1;
    for (int k = 0; k < K; k++) {
      td_zero_no_sync(z, all_no_sync || k < K - 1);
      if (overlap) MP_CHECK_OK(td_zero_prepare(z));
      micro_backward(m, WORLD, rank, step, k);
      if (overlap) MP_CHECK(grads_held(&pm) <= 1); /* the last one hooked, until the next hook */
      if (mode == Z3)
        for (size_t i = 0; i < 4; i++) MP_CHECK(td_tensor_data(pm.tensors[i]) == NULL);
    }
    if (!overlap) MP_CHECK(grads_held(&pm) == 4); /* after backward: the sums in .grad */
    td_zero_no_sync(z, false);
    MP_CHECK_OK(td_zero_step(z));
    ref_step(&r, WORLD, step);
    MP_CHECK_OK(td_zero_get_stats(z, &zs));
    if (!(fabs(zs.last_grad_norm - r.norm) <= 1e-10 * r.norm)) {
      fprintf(stderr, "[rank %d] %s step %d: global norm %.17g, want %.17g\n", rank,
              names[mode], step, zs.last_grad_norm, r.norm);
      MP_CHECK(0);
    }
    MP_CHECK_OK(td_zero_gather_params(z)); /* stage 3; nothing to do otherwise */
    same_params(&pm, &r, names[mode], rank, step);
    MP_CHECK_OK(td_zero_release_params(z));
    MP_CHECK(zs.bytes_reduced == (uint64_t)(step + 1) * reduction); /* one reduction a step */
  }
  MP_CHECK(zs.steps == STEPS && zs.late_buckets == 0);
  if (overlap) {
    MP_CHECK(zs.passes_accumulated == (uint64_t)(K - 1) * STEPS + 1 + (mode == Z2_OVERLAP));
    MP_CHECK(zs.passes_overlapped == STEPS);
    /* the window's gradient lives in the buckets: all of them alive at once */
    MP_CHECK(zs.peak_bucket_bytes == reduction);
    /* the last pass started its buckets from the hooks (zero2 overlap's step 1 did not) */
    MP_CHECK(zs.bytes_started_in_backward ==
             (uint64_t)(mode == Z2_OVERLAP ? STEPS - 1 : STEPS) * reduction);
  }
  td_zero_destroy(z);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  ref_free(&r);
}

static int worker_zero(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, td_test_ms(20000), &pg));
  run_zero(pg, rank, Z1);
  run_zero(pg, rank, Z2);
  run_zero(pg, rank, Z2_OVERLAP);
  run_zero(pg, rank, Z3);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_grad_accum_zero_equals_k_times_batch(void **state) {
  (void)state;
  int codes[WORLD];
  int fails = td_mp_run(WORLD, worker_zero, NULL, 90, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grad_accum_one_process_equals_k_times_batch),
      cmocka_unit_test(test_grad_accum_ddp_equals_k_times_batch),
      cmocka_unit_test(test_grad_accum_zero_equals_k_times_batch),
  };
  return cmocka_run_group_tests_name("grad_accum", tests, NULL, NULL);
}
