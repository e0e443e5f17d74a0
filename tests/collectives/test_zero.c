/* test_zero.c - ZeRO stages 1 and 2 across 3 real processes: 10 AdamW steps with two parameter
 * groups (decay on the weights only) and gradient clipping give, on every member, the
 * parameters of a single process that averages the members' gradients, clips and steps the
 * same optimizer (float64, 1e-10); each member's optimizer holds only its shard (the shards
 * cut through parameters: 66 elements in 3 shards of 22); stage 1 leaves the group-average
 * gradients in .grad, stage 2 clears them; stage 2 overlapped with backward (buckets
 * reduce_scattered from gradient hooks) gives the parameters of stage 2 after backward (1e-10),
 * keeps at most one full gradient through backward, starts every bucket from a hook, and reduces
 * gradients that come after their bucket started (two backward passes) at the step; a member with
 * other parameters is refused on every member; invalid options are refused before any
 * collective. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

enum { WORLD = 3, STEPS = 10 };
#define LR 0.05
#define DECAY 0.1
#define MAX_NORM 0.1

/* 5 -> 7 -> tanh -> 3: W1 35, b1 7, W2 21, b2 3 = 66 elements */
static td_module *build(uint64_t seed, bool other) {
  MP_CHECK_OK(td_nn_manual_seed(seed));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(5, other ? 6 : 7, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_linear_create(other ? 6 : 7, 3, true, NULL, &l2));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  MP_CHECK_OK(td_sequential_append(seq, l2));
  td_module_unref(l1);
  td_module_unref(act);
  td_module_unref(l2);
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

static void backward_on(td_module *m, int data_rank, int step) {
  int64_t xs[2] = {8, 5}, ys[2] = {8, 3};
  uint64_t seed = 1000 * (uint64_t)step + (uint64_t)data_rank;
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 77 + seed, false);
  td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F64, 99 + seed, false);
  td_tensor *out = NULL, *loss = NULL;
  MP_CHECK_OK(td_module_forward(m, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(out);
  td_tensor_unref(loss);
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

static void adamw(td_optim_options *o) {
  td_optim_options_init(o, TD_OPTIM_ADAMW);
  o->lr = LR;
}

static bool close_to(const td_tensor *a, const td_tensor *b) {
  bool ok = false;
  MP_CHECK_OK(td_tensor_allclose(a, b, 1e-10, 1e-12, &ok));
  return ok;
}

/* One run of `stage` against the single-process reference. */
static void run_stage(td_process_group *pg, int rank, int stage) {
  td_module *m = build(1000 + (uint64_t)rank, false), *ref = build(1000, false);
  td_tensor_list pm, pr;
  td_tensor_list_init(&pm);
  td_tensor_list_init(&pr);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  MP_CHECK_OK(td_module_parameters(ref, &pr));
  MP_CHECK(pm.n == 4 && pr.n == 4);
  td_tensor *w[2], *b[2], *rw[2], *rb[2];
  td_optim_group g[2], rg[2];
  groups_of(&pm, w, b, g);
  groups_of(&pr, rw, rb, rg);
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = stage;
  zo.max_grad_norm = MAX_NORM;
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &z));
  td_optim *ropt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&o, rg, 2, &ropt));

  /* the flat order is the groups' order: W1 W2 | b1 b2 = 35 + 21 + 7 + 3; shards of 22 */
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.stage == stage && zs.numel == 66 && zs.shard_numel == 22 && zs.owned_numel == 22);
  static const size_t pieces[WORLD] = {1, 2, 3}; /* W1 | W1 W2 | W2 b1 b2 */
  if (zs.optim_params != pieces[rank]) {
    fprintf(stderr, "[rank %d] the local optimizer holds %zu pieces, want %zu\n", rank,
            zs.optim_params, pieces[rank]);
    MP_CHECK(0);
  }
  int64_t owned = zs.owned_numel, one = 1;
  td_tensor *sum = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(&owned, &one, 1, TD_DTYPE_I64, &sum));
  MP_CHECK_OK(td_process_group_all_reduce(pg, sum, TD_REDUCE_SUM));
  MP_CHECK(*(const int64_t *)td_tensor_data(sum) == 66); /* every element owned exactly once */
  td_tensor_unref(sum);

  for (int step = 0; step < STEPS; step++) {
    td_zero_zero_grad(z);
    backward_on(m, rank, step);
    MP_CHECK_OK(td_zero_step(z));

    /* the reference: average of every member's gradient, clipped, one optimizer step */
    td_optim_zero_grad(ropt);
    for (int d = 0; d < WORLD; d++) backward_on(ref, d, step);
    td_tensor *avg[4] = {0};
    for (size_t i = 0; i < 4; i++) {
      td_tensor *gr = td_tensor_grad(pr.tensors[i]);
      MP_CHECK(gr != NULL);
      MP_CHECK_OK(td_tensor_mul_scalar_(gr, 1.0 / WORLD));
      MP_CHECK_OK(td_tensor_clone(gr, &avg[i]));
      td_tensor_unref(gr);
    }
    double total = 0;
    MP_CHECK_OK(td_optim_clip_grad_norm(ropt, MAX_NORM, 2.0, &total));
    MP_CHECK(total > MAX_NORM); /* the clipping is exercised */
    MP_CHECK_OK(td_optim_step(ropt));
    MP_CHECK_OK(td_zero_get_stats(z, &zs));
    MP_CHECK(zs.steps == (uint64_t)step + 1);
    if (!(fabs(zs.last_grad_norm - total) <= 1e-10 * total)) {
      fprintf(stderr, "[rank %d] step %d: global norm %.17g, want %.17g\n", rank, step,
              zs.last_grad_norm, total);
      MP_CHECK(0);
    }
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(pm.tensors[i], pr.tensors[i])) {
        fprintf(stderr, "[rank %d] stage %d step %d: parameter %s differs from DDP + AdamW\n",
                rank, stage, step, pm.names[i]);
        MP_CHECK(0);
      }
      td_tensor *gm = td_tensor_grad(pm.tensors[i]);
      if (stage == 1) {
        MP_CHECK(gm != NULL && close_to(gm, avg[i])); /* the group average, before clipping */
      } else {
        MP_CHECK(gm == NULL); /* stage 2 keeps no full gradient */
      }
      td_tensor_unref(gm);
      td_tensor_unref(avg[i]);
    }
  }
  td_zero_destroy(z);
  td_optim_destroy(ropt);
  td_tensor_list_fini(&pm);
  td_tensor_list_fini(&pr);
  td_module_unref(m);
  td_module_unref(ref);
}

/* Parameters with a .grad (overlap keeps at most the last one hooked until the step). */
static int grads_held(td_tensor_list *p) {
  int n = 0;
  for (size_t i = 0; i < p->n; i++) {
    td_tensor *g = td_tensor_grad(p->tensors[i]);
    n += g != NULL;
    td_tensor_unref(g);
  }
  return n;
}

/* Stage 2 with overlap against stage 2 after backward: the same parameters (1e-10) and global
 * norms at every step. twice: two backward passes per step (the second one's gradients all come
 * after their buckets started, so every bucket is reduced again at the step); else one pass with
 * the module's parameters reversed as the gradient order. One bucket per parameter. */
static void run_overlap(td_process_group *pg, int rank, bool twice) {
  td_module *ma = build(1000 + (uint64_t)rank, false), *mo = build(1000 + (uint64_t)rank, false);
  td_tensor_list pa, po;
  td_tensor_list_init(&pa);
  td_tensor_list_init(&po);
  MP_CHECK_OK(td_module_parameters(ma, &pa));
  MP_CHECK_OK(td_module_parameters(mo, &po));
  td_tensor *w[2], *b[2], *ow[2], *ob[2], *rev[4];
  td_optim_group g[2], og[2];
  groups_of(&pa, w, b, g);
  groups_of(&po, ow, ob, og);
  for (size_t i = 0; i < 4; i++) rev[i] = po.tensors[3 - i];
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.max_grad_norm = MAX_NORM;
  td_zero *za = NULL, *zv = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &za));
  MP_CHECK(td_zero_prepare(za) == TD_ERR_STATE); /* created without overlap */
  zo.overlap = true;
  zo.bucket_bytes = zo.first_bucket_bytes = 1; /* a bucket per parameter */
  if (!twice) zo.grad_order = rev, zo.n_grad_order = 4;
  MP_CHECK_OK(td_zero_create(pg, &o, og, 2, &zo, &zv));
  td_zero_stats sa, sv;
  MP_CHECK_OK(td_zero_get_stats(zv, &sv));
  /* W1 35, b1 7, W2 21, b2 3 elements in parts of 12 + 3 + 7 + 1 */
  MP_CHECK(sv.buckets == 4 && sv.numel == 66 && sv.shard_numel == 23);
  int64_t owned = sv.owned_numel, one = 1;
  td_tensor *sum = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(&owned, &one, 1, TD_DTYPE_I64, &sum));
  MP_CHECK_OK(td_process_group_all_reduce(pg, sum, TD_REDUCE_SUM));
  MP_CHECK(*(const int64_t *)td_tensor_data(sum) == 66); /* every element owned exactly once */
  td_tensor_unref(sum);
  for (int step = 0; step < STEPS; step++) {
    backward_on(ma, rank, step);
    if (twice) backward_on(ma, rank, step + 100);
    MP_CHECK_OK(td_zero_step(za));
    MP_CHECK_OK(td_zero_prepare(zv));
    MP_CHECK(td_zero_prepare(zv) == TD_ERR_STATE);
    backward_on(mo, rank, step);
    if (!twice) MP_CHECK(grads_held(&po) <= 1); /* no full gradient kept but the last one */
    if (twice) backward_on(mo, rank, step + 100);
    MP_CHECK_OK(td_zero_step(zv));
    MP_CHECK(grads_held(&po) == 0);
    MP_CHECK_OK(td_zero_get_stats(za, &sa));
    MP_CHECK_OK(td_zero_get_stats(zv, &sv));
    if (!(fabs(sa.last_grad_norm - sv.last_grad_norm) <= 1e-10 * sa.last_grad_norm)) {
      fprintf(stderr, "[rank %d] step %d: global norm %.17g with overlap, %.17g without\n", rank,
              step, sv.last_grad_norm, sa.last_grad_norm);
      MP_CHECK(0);
    }
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(po.tensors[i], pa.tensors[i])) {
        fprintf(stderr, "[rank %d] step %d%s: parameter %s differs with overlap\n", rank, step,
                twice ? " (two passes)" : "", po.names[i]);
        MP_CHECK(0);
      }
    }
  }
  MP_CHECK(sv.passes_overlapped == STEPS && sv.steps == STEPS);
  MP_CHECK(sv.bytes_reduced > 0);
  if (twice) {
    MP_CHECK(sv.late_buckets == 4 * STEPS);
  } else {
    MP_CHECK(sv.late_buckets == 0);
    MP_CHECK(sv.bytes_started_in_backward * 2 >= sv.bytes_reduced);
  }
  td_zero_destroy(za);
  td_zero_destroy(zv);
  td_tensor_list_fini(&pa);
  td_tensor_list_fini(&po);
  td_module_unref(ma);
  td_module_unref(mo);
}

static int worker_zero(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));

  /* options are checked before anything collective */
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  MP_CHECK(zo.stage == 2 && zo.max_grad_norm == 0);
  td_zero *z = NULL;
  zo.stage = 3;
  MP_CHECK(td_zero_create(pg, &o, NULL, 0, &zo, &z) == TD_ERR_INVALID && z == NULL);

  /* a member whose parameters differ is refused on every member */
  td_module *odd = build(5, rank == 2);
  td_tensor_list po;
  td_tensor_list_init(&po);
  MP_CHECK_OK(td_module_parameters(odd, &po));
  td_optim_group g;
  td_optim_group_init(&g, po.tensors, po.n);
  MP_CHECK(td_zero_create(pg, &o, &g, 1, NULL, &z) == TD_ERR_SHAPE && z == NULL);
  MP_CHECK(strstr(td_last_error(), "rank 2") != NULL);
  td_tensor_list_fini(&po);
  td_module_unref(odd);

  zo.stage = 1;
  zo.overlap = true; /* overlap is for stage 2 */
  MP_CHECK(td_zero_create(pg, &o, NULL, 0, &zo, &z) == TD_ERR_INVALID && z == NULL);

  run_stage(pg, rank, 1);
  run_stage(pg, rank, 2);
  run_overlap(pg, rank, false);
  run_overlap(pg, rank, true);
  td_process_group_destroy(pg);
  coll_leave(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_zero_stages_match_ddp_with_sharded_state(void **state) {
  (void)state;
  int codes[WORLD];
  int fails = td_mp_run(WORLD, worker_zero, NULL, 90, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zero_stages_match_ddp_with_sharded_state),
  };
  return cmocka_run_group_tests_name("zero", tests, NULL, NULL);
}
