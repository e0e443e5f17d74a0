/* test_grad_scaler_dp.c - loss scaling across 3 real processes: an overflow (an inf in one
 * element of one rank's gradient) at step 2 of 6 makes every rank skip step 2 and only it, the
 * scale halves on every rank (and grows after 2 good steps alike: 1024, 2048, 1024, 1024, 2048,
 * 2048), the parameters stay identical across ranks (bit for bit) and equal a single process that
 * averages the ranks' gradients, clips and steps AdamW on every step but step 2 (float64, 1e-10):
 *   - DDP (overlapped, gradient_as_bucket_view) with td_grad_scaler_set_process_group: the inf is
 *     written into rank 1's averaged .grad after the reduction, so only rank 1 finds it locally;
 *   - ZeRO stages 1, 2 (after backward and overlapped) and 3 with td_zero_step_scaled: the inf
 *     enters rank 1's gradient before the reduction (a hook ahead of ZeRO's) in an element rank 0
 *     owns, so at stages 2 and 3 only rank 0 sees it (in its shard), not even rank 1.
 * The scalers' skip counters, each rank's list of skipped steps and the final scale are compared
 * across ranks through all_gathers. */
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

enum { WORLD = 3, STEPS = 6, BAD_STEP = 2 };
#define MAX_NORM 0.1

static const double scale_after[STEPS] = {1024, 2048, 1024, 1024, 2048, 2048};

/* 5 -> 7 -> tanh -> 3, float64 */
static td_module *build(void) {
  MP_CHECK_OK(td_nn_manual_seed(1000));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(5, 7, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_linear_create(7, 3, true, NULL, &l2));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  MP_CHECK_OK(td_sequential_append(seq, l2));
  td_module_unref(l1), td_module_unref(act), td_module_unref(l2);
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

/* Rank `rank`'s batch of step `step`: loss (times mult, times the scale when s) backward. */
static void backward_on(td_module *m, td_grad_scaler *s, int rank, int step, double mult) {
  int64_t xs[2] = {8, 5}, ys[2] = {8, 3};
  uint64_t seed = 1000 * (uint64_t)step + (uint64_t)rank;
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 77 + seed, false);
  td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F64, 99 + seed, false);
  td_tensor *out = NULL, *loss = NULL, *l2 = NULL, *scaled = NULL;
  MP_CHECK_OK(td_module_forward(m, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_mul_scalar(loss, mult, &l2));
  if (s) MP_CHECK_OK(td_grad_scaler_scale(s, l2, &scaled));
  MP_CHECK_OK(td_tensor_backward(s ? scaled : l2));
  td_tensor_unref(x), td_tensor_unref(y), td_tensor_unref(out), td_tensor_unref(loss);
  td_tensor_unref(l2), td_tensor_unref(scaled);
}

static td_optim_options adamw(void) {
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  o.lr = 0.05;
  return o;
}

/* The single-process reference: the ranks' mean gradient, clipped, AdamW; step BAD_STEP
 * skipped. */
typedef struct ref {
  td_module *m;
  td_tensor_list p;
  td_optim *opt;
} ref;

static void ref_make(ref *r) {
  r->m = build();
  td_tensor_list_init(&r->p);
  MP_CHECK_OK(td_module_parameters(r->m, &r->p));
  td_optim_options o = adamw();
  MP_CHECK_OK(td_optim_create(&o, r->p.tensors, r->p.n, &r->opt));
}

static void ref_step(ref *r, int step) {
  if (step == BAD_STEP) return;
  td_optim_zero_grad(r->opt);
  for (int d = 0; d < WORLD; d++) backward_on(r->m, NULL, d, step, 1.0 / WORLD);
  MP_CHECK_OK(td_optim_clip_grad_norm(r->opt, MAX_NORM, 2.0, NULL));
  MP_CHECK_OK(td_optim_step(r->opt));
}

static void ref_free(ref *r) {
  td_optim_destroy(r->opt);
  td_tensor_list_fini(&r->p);
  td_module_unref(r->m);
}

/* Every rank holds the same bits in every parameter, and they equal the reference's (1e-10). */
static void check_params(td_process_group *pg, td_tensor_list *pm, ref *r, const char *what,
                         int step) {
  int64_t n = 0;
  for (size_t i = 0; i < pm->n; i++) n += td_tensor_numel(pm->tensors[i]);
  int64_t all = n * WORLD;
  td_tensor *mine = NULL, *every = NULL;
  MP_CHECK_OK(td_tensor_empty(&n, 1, TD_DTYPE_F64, td_device_cpu(), &mine));
  MP_CHECK_OK(td_tensor_empty(&all, 1, TD_DTYPE_F64, td_device_cpu(), &every));
  double *v = td_tensor_data(mine);
  for (size_t i = 0, off = 0; i < pm->n; i++) {
    size_t nb = td_tensor_nbytes(pm->tensors[i]);
    memcpy((char *)v + off, td_tensor_data(pm->tensors[i]), nb);
    off += nb;
    bool ok = false;
    MP_CHECK_OK(td_tensor_allclose(pm->tensors[i], r->p.tensors[i], 1e-10, 1e-12, &ok));
    if (!ok) {
      fprintf(stderr, "[rank %d] %s step %d: parameter %s differs from the reference\n",
              td_process_group_rank(pg), what, step, pm->names[i]);
      MP_CHECK(0);
    }
  }
  MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, every, mine));
  const double *e = td_tensor_data(every);
  for (int k = 1; k < WORLD; k++)
    if (memcmp(e, e + k * n, (size_t)n * sizeof *e)) {
      fprintf(stderr, "%s step %d: rank %d's parameters differ from rank 0's\n", what, step, k);
      MP_CHECK(0);
    }
  td_tensor_unref(mine);
  td_tensor_unref(every);
}

/* Every rank skipped exactly step BAD_STEP and holds the expected scale after each step. */
static void check_skips(td_process_group *pg, td_grad_scaler *s, const bool *stepped,
                        const char *what) {
  int64_t n = STEPS + 2, all = n * WORLD;
  td_tensor *mine = NULL, *every = NULL;
  MP_CHECK_OK(td_tensor_empty(&n, 1, TD_DTYPE_F64, td_device_cpu(), &mine));
  MP_CHECK_OK(td_tensor_empty(&all, 1, TD_DTYPE_F64, td_device_cpu(), &every));
  double *v = td_tensor_data(mine);
  td_grad_scaler_stats st;
  MP_CHECK_OK(td_grad_scaler_get_stats(s, &st));
  for (int k = 0; k < STEPS; k++) v[k] = stepped[k];
  v[STEPS] = (double)st.skipped_steps;
  v[STEPS + 1] = td_grad_scaler_get_scale(s);
  MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, every, mine));
  const double *e = td_tensor_data(every);
  for (int r = 0; r < WORLD; r++)
    for (int k = 0; k < STEPS; k++)
      if (e[r * n + k] != (k != BAD_STEP)) {
        fprintf(stderr, "%s: rank %d %s step %d\n", what, r, e[r * n + k] ? "took" : "skipped", k);
        MP_CHECK(0);
      }
  for (int r = 0; r < WORLD; r++)
    MP_CHECK(e[r * n + STEPS] == 1 && e[r * n + STEPS + 1] == scale_after[STEPS - 1]);
  td_tensor_unref(mine);
  td_tensor_unref(every);
}

static td_grad_scaler *scaler(void) {
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  o.init_scale = 1024;
  o.growth_interval = 2;
  td_grad_scaler *s = NULL;
  MP_CHECK_OK(td_grad_scaler_create(&o, &s));
  return s;
}

/* Element 0 of t (contiguous float64) becomes +inf. */
static void poison(td_tensor *t) { ((double *)td_tensor_data(t))[0] = INFINITY; }

/* ---- DDP: the inf lands in rank 1's averaged gradient ---- */

static void run_ddp(td_process_group *pg, int rank) {
  ref r;
  ref_make(&r);
  td_module *m = build();
  td_ddp_options o;
  td_ddp_options_init(&o);
  o.overlap = true;
  o.gradient_as_bucket_view = true;
  td_ddp *d = NULL;
  MP_CHECK_OK(td_ddp_create_ex(pg, m, &o, &d));
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  td_optim_options oo = adamw();
  td_optim *opt = NULL;
  MP_CHECK_OK(td_optim_create(&oo, pm.tensors, pm.n, &opt));
  td_grad_scaler *s = scaler();
  MP_CHECK_OK(td_grad_scaler_set_process_group(s, pg));
  bool stepped[STEPS];
  for (int step = 0; step < STEPS; step++) {
    td_optim_zero_grad(opt);
    MP_CHECK_OK(td_ddp_prepare(d));
    backward_on(m, s, rank, step, 1.0);
    MP_CHECK_OK(td_ddp_finish(d));
    if (step == BAD_STEP && rank == 1) { /* after the reduction: rank 1 alone sees it */
      td_tensor *g = td_tensor_grad(pm.tensors[2]);
      poison(g);
      td_tensor_unref(g);
    }
    MP_CHECK_OK(td_grad_scaler_unscale_(s, opt)); /* before clipping */
    MP_CHECK_OK(td_optim_clip_grad_norm(opt, MAX_NORM, 2.0, NULL));
    MP_CHECK_OK(td_grad_scaler_step(s, opt, &stepped[step]));
    MP_CHECK_OK(td_grad_scaler_update(s));
    MP_CHECK(td_grad_scaler_get_scale(s) == scale_after[step]);
    ref_step(&r, step);
    check_params(pg, &pm, &r, "ddp", step);
  }
  check_skips(pg, s, stepped, "ddp");
  td_grad_scaler_destroy(s);
  td_optim_destroy(opt);
  td_ddp_destroy(d);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  ref_free(&r);
}

/* ---- ZeRO: the inf enters rank 1's gradient before the reduction ---- */

typedef struct inject {
  bool armed;
} inject;

/* Registered before td_zero_create, so it runs ahead of ZeRO's hook and replaces the gradient. */
static td_status inject_hook(void *ctx, const td_tensor *grad, td_tensor **replacement) {
  inject *in = ctx;
  if (!in->armed) return TD_OK;
  in->armed = false;
  td_status st = td_tensor_clone(grad, replacement);
  if (st == TD_OK) poison(*replacement);
  return st;
}

static void run_zero(td_process_group *pg, int rank, int stage, bool overlap) {
  char what[32];
  snprintf(what, sizeof what, "zero%d%s", stage, overlap && stage == 2 ? " overlap" : "");
  ref r;
  ref_make(&r);
  td_module *m = build();
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  inject in = {false};
  int handle = -1;
  /* W2's element 0 (of 21): with a bucket per parameter, in rank 0's part of W2's bucket */
  if (rank == 1) MP_CHECK_OK(td_tensor_register_hook(pm.tensors[2], inject_hook, &in, &handle));
  td_optim_options oo = adamw();
  td_optim_group g;
  td_optim_group_init(&g, pm.tensors, pm.n);
  td_module *units[2] = {td_module_child(m, "0"), td_module_child(m, "2")};
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = stage;
  zo.overlap = overlap && stage == 2;
  zo.max_grad_norm = MAX_NORM;
  zo.bucket_bytes = zo.first_bucket_bytes = 1;
  if (stage == 3) zo.units = units, zo.n_units = 2;
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &oo, &g, 1, &zo, &z));
  td_grad_scaler *s = scaler(); /* no process group: td_zero_step_scaled agrees over its own */
  bool stepped[STEPS];
  for (int step = 0; step < STEPS; step++) {
    td_zero_zero_grad(z);
    if (overlap) MP_CHECK_OK(td_zero_prepare(z));
    in.armed = rank == 1 && step == BAD_STEP;
    backward_on(m, s, rank, step, 1.0);
    MP_CHECK(!in.armed);
    MP_CHECK_OK(td_zero_step_scaled(z, s));
    bool found = true;
    MP_CHECK_OK(td_grad_scaler_found_inf(s, &found));
    stepped[step] = !found;
    td_zero_stats zs;
    MP_CHECK_OK(td_zero_get_stats(z, &zs));
    MP_CHECK(isnan(zs.last_grad_norm) == (step == BAD_STEP)); /* no clipping when skipped */
    MP_CHECK_OK(td_grad_scaler_update(s));
    MP_CHECK(td_grad_scaler_get_scale(s) == scale_after[step]);
    ref_step(&r, step);
    MP_CHECK_OK(td_zero_gather_params(z));
    check_params(pg, &pm, &r, what, step);
    MP_CHECK_OK(td_zero_release_params(z));
  }
  check_skips(pg, s, stepped, what);
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.steps == STEPS - 1 && zs.skipped_steps == 1);
  if (handle >= 0) MP_CHECK_OK(td_tensor_remove_hook(pm.tensors[2], handle));
  td_grad_scaler_destroy(s);
  td_zero_destroy(z);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  ref_free(&r);
}

static int worker(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, td_test_ms(20000), &pg));
  run_ddp(pg, rank);
  run_zero(pg, rank, 1, false);
  run_zero(pg, rank, 2, false);
  run_zero(pg, rank, 2, true);
  run_zero(pg, rank, 3, true);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_grad_scaler_every_rank_skips_the_overflowed_step(void **state) {
  (void)state;
  int codes[WORLD];
  int fails = td_mp_run(WORLD, worker, NULL, 90, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grad_scaler_every_rank_skips_the_overflowed_step),
  };
  return cmocka_run_group_tests_name("grad_scaler_dp", tests, NULL, NULL);
}
