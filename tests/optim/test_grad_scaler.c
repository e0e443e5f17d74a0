/* test_grad_scaler.c - dynamic loss scaling (td_grad_scaler), PyTorch's GradScaler rule: defaults
 * and validation; unscaling divides the gradients and finds an inf or a NaN (float32, float64,
 * a strided gradient and float16 / bfloat16 ones through the tensor-op path); a step with one is skipped (parameters
 * untouched) and the scale halves, growth_interval good steps double it, a growth that would
 * overflow float32 is not taken; the agreement decides once per iteration (a replica's inf skips
 * a locally finite step); misuse in the iteration's order is refused; a constant scaler; the
 * state round trip (struct and PyTorch's state-dict names) resumes the rule where it was; a run
 * scaled by powers of two computes the unscaled run's numbers exactly. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "test_util.h"

static td_tensor *vec(const double *v, int64_t n, td_dtype dt, bool rg) {
  return td_test_tensor(v, &n, 1, dt, rg);
}

/* p gets the gradient g (a copy of v). */
static void give_grad(td_tensor *p, const double *v, int64_t n) {
  td_tensor *g = vec(v, n, td_tensor_dtype(p), false);
  TD_ASSERT_OK(td_tensor_set_grad(p, g));
  td_tensor_unref(g);
}

static double elem(const td_tensor *t, int64_t i) {
  double v = 0;
  TD_ASSERT_OK(td_tensor_get(t, &i, &v));
  return v;
}

static td_optim *sgd(td_tensor *p) {
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_SGD);
  o.lr = 0.5;
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create(&o, &p, 1, &opt));
  return opt;
}

static void test_grad_scaler_defaults_and_validation(void **state) {
  (void)state;
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  assert_true(o.init_scale == 65536.0 && o.growth_factor == 2.0 && o.backoff_factor == 0.5 &&
              o.growth_interval == 2000 && o.dynamic);
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(NULL, &s));
  assert_true(td_grad_scaler_get_scale(s) == 65536.0);
  td_grad_scaler_destroy(s);
  o.growth_factor = 1.0;
  TD_ASSERT_STATUS(td_grad_scaler_create(&o, &s), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "growth_factor"));
  td_grad_scaler_options_init(&o);
  o.backoff_factor = 1.0;
  TD_ASSERT_STATUS(td_grad_scaler_create(&o, &s), TD_ERR_INVALID);
  td_grad_scaler_options_init(&o);
  o.growth_interval = 0;
  TD_ASSERT_STATUS(td_grad_scaler_create(&o, &s), TD_ERR_INVALID);
  td_grad_scaler_options_init(&o);
  o.init_scale = 1e39; /* not a float32 */
  TD_ASSERT_STATUS(td_grad_scaler_create(&o, &s), TD_ERR_INVALID);
  o.init_scale = 0;
  TD_ASSERT_STATUS(td_grad_scaler_create(&o, &s), TD_ERR_INVALID);
  o.init_scale = 8;
  o.dynamic = false;
  o.growth_factor = 1.0; /* a constant scaler ignores the rule's factors */
  TD_ASSERT_OK(td_grad_scaler_create(&o, &s));
  td_grad_scaler_destroy(s);
  td_grad_scaler_destroy(NULL);
  assert_true(isnan(td_grad_scaler_get_scale(NULL)));
}

/* scale(loss) multiplies; unscale_ divides in place and finds infs and NaNs before dividing, in
 * float32 and float64, also through the tensor-op path (a strided gradient). */
static void test_grad_scaler_unscale_finds_inf_and_nan(void **state) {
  (void)state;
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  o.init_scale = 16.0;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = d ? TD_DTYPE_F64 : TD_DTYPE_F32;
    td_grad_scaler *s = NULL;
    TD_ASSERT_OK(td_grad_scaler_create(&o, &s));
    double l = 1.5, pv[3] = {1, 2, 3};
    td_tensor *loss = vec(&l, 1, dt, false), *scaled = NULL;
    TD_ASSERT_OK(td_grad_scaler_scale(s, loss, &scaled));
    assert_true(elem(scaled, 0) == 24.0);
    td_tensor *p = vec(pv, 3, dt, true);
    td_optim *opt = sgd(p);
    double g[3] = {8, -4, 2};
    give_grad(p, g, 3);
    TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt));
    td_tensor *pg = td_tensor_grad(p);
    assert_true(elem(pg, 0) == 0.5 && elem(pg, 1) == -0.25 && elem(pg, 2) == 0.125);
    td_tensor_unref(pg);
    bool found = true;
    TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found));
    assert_false(found);
    TD_ASSERT_OK(td_grad_scaler_update(s));
    for (int bad = 0; bad < 2; bad++) { /* an inf, then a NaN, in the last element */
      double gb[3] = {8, -4, bad ? NAN : -INFINITY};
      give_grad(p, gb, 3);
      TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt));
      TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found));
      assert_true(found);
      TD_ASSERT_OK(td_grad_scaler_update(s));
    }
    /* a strided (transposed) gradient goes through tensor ops: same division, same check */
    int64_t sh[2] = {2, 3};
    double m[6] = {4, 8, 12, 16, 20, INFINITY};
    td_tensor *a = td_test_tensor(m, sh, 2, dt, false), *at = NULL;
    TD_ASSERT_OK(td_tensor_transpose(a, 0, 1, &at));
    assert_false(td_tensor_is_contiguous(at));
    TD_ASSERT_OK(td_grad_scaler_unscale_grads_(s, &at, 1));
    TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found));
    assert_true(found);
    int64_t ix[2] = {0, 1};
    double a01 = 0;
    TD_ASSERT_OK(td_tensor_get(a, ix, &a01)); /* the view's elements are a's */
    assert_true(a01 * td_grad_scaler_get_scale(s) == 8 && td_grad_scaler_get_scale(s) == 4);
    td_tensor_unref(at);
    td_tensor_unref(a);
    /* 16-bit gradients (autocast's dtypes) go through the tensor ops too */
    for (int h = 0; h < 2; h++) {
      double hv[3] = {8, -4, h ? INFINITY : 2};
      td_tensor *g16 = vec(hv, 3, h ? TD_DTYPE_BF16 : TD_DTYPE_F16, false);
      TD_ASSERT_OK(td_grad_scaler_update(s));
      TD_ASSERT_OK(td_grad_scaler_unscale_grads_(s, &g16, 1));
      TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found));
      assert_true(found == (h == 1));
      double sc = td_grad_scaler_get_scale(s);
      assert_true(elem(g16, 0) == 8 / sc && elem(g16, 1) == -4 / sc);
      td_tensor_unref(g16);
    }
    td_optim_destroy(opt);
    td_tensor_unref(p);
    td_tensor_unref(loss);
    td_tensor_unref(scaled);
    td_grad_scaler_destroy(s);
  }
}

/* The rule: growth_interval good steps double the scale, an inf skips the step (the parameter
 * stays), halves the scale and restarts the count; the step uses the unscaled gradient once. */
static void test_grad_scaler_growth_backoff_and_skip(void **state) {
  (void)state;
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  o.init_scale = 1024;
  o.growth_interval = 3;
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(&o, &s));
  double pv = 10;
  td_tensor *p = vec(&pv, 1, TD_DTYPE_F64, true);
  td_optim *opt = sgd(p);
  /* step: good (1024), good, good -> 2048, inf -> 1024 skipped, good x3 -> 2048, good */
  const bool inf_at[8] = {false, false, false, true, false, false, false, false};
  const double scale_after[8] = {1024, 1024, 2048, 1024, 1024, 1024, 2048, 2048};
  double want = 10;
  for (int k = 0; k < 8; k++) {
    double sc = td_grad_scaler_get_scale(s);
    double g = inf_at[k] ? INFINITY : 2.0 * sc; /* the scaled gradient of 2 */
    give_grad(p, &g, 1);
    if (k % 2) TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt)); /* or step unscales */
    bool stepped = !inf_at[k];
    TD_ASSERT_OK(td_grad_scaler_step(s, opt, &stepped));
    assert_true(stepped == !inf_at[k]);
    if (!inf_at[k]) want -= 0.5 * 2.0; /* SGD lr 0.5 on the unscaled gradient */
    assert_true(elem(p, 0) == want);
    TD_ASSERT_OK(td_grad_scaler_update(s));
    if (td_grad_scaler_get_scale(s) != scale_after[k])
      fail_msg("step %d: scale %g, want %g", k, td_grad_scaler_get_scale(s), scale_after[k]);
  }
  td_grad_scaler_stats st;
  TD_ASSERT_OK(td_grad_scaler_get_stats(s, &st));
  assert_true(st.updates == 8 && st.skipped_steps == 1 && st.backoffs == 1 && st.growths == 2);
  td_grad_scaler_state gs;
  TD_ASSERT_OK(td_grad_scaler_get_state(s, &gs));
  assert_true(gs.scale == 2048 && gs.growth_tracker == 1);
  td_optim_destroy(opt);
  td_tensor_unref(p);
  td_grad_scaler_destroy(s);

  /* near FLT_MAX a growth that overflows float32 is not taken (the count still restarts) */
  o.init_scale = 0x1p127;
  o.growth_interval = 1;
  TD_ASSERT_OK(td_grad_scaler_create(&o, &s));
  double g = 1;
  td_tensor *q = vec(&g, 1, TD_DTYPE_F32, false);
  TD_ASSERT_OK(td_grad_scaler_unscale_grads_(s, &q, 1));
  TD_ASSERT_OK(td_grad_scaler_update(s));
  assert_true(td_grad_scaler_get_scale(s) == 0x1p127);
  td_tensor_unref(q);
  td_grad_scaler_destroy(s);
}

/* Calls out of the iteration's order are refused with TD_ERR_STATE. */
static void test_grad_scaler_refuses_misuse(void **state) {
  (void)state;
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(NULL, &s));
  double pv = 1, g = 65536;
  td_tensor *p = vec(&pv, 1, TD_DTYPE_F32, true);
  td_optim *opt = sgd(p);
  TD_ASSERT_STATUS(td_grad_scaler_update(s), TD_ERR_STATE); /* nothing unscaled */
  assert_non_null(strstr(td_last_error(), "no inf checks"));
  bool found;
  TD_ASSERT_STATUS(td_grad_scaler_found_inf(s, &found), TD_ERR_STATE);
  give_grad(p, &g, 1);
  TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt));
  TD_ASSERT_STATUS(td_grad_scaler_unscale_(s, opt), TD_ERR_STATE); /* twice */
  assert_non_null(strstr(td_last_error(), "already called"));
  TD_ASSERT_OK(td_grad_scaler_step(s, opt, NULL));
  TD_ASSERT_STATUS(td_grad_scaler_step(s, opt, NULL), TD_ERR_STATE);
  td_tensor *gp = td_tensor_grad(p);
  TD_ASSERT_STATUS(td_grad_scaler_unscale_grads_(s, &gp, 1), TD_ERR_STATE); /* decided */
  td_grad_scaler_state st = {4, 0};
  TD_ASSERT_STATUS(td_grad_scaler_set_state(s, &st), TD_ERR_STATE); /* mid-iteration */
  TD_ASSERT_OK(td_grad_scaler_update(s));
  TD_ASSERT_OK(td_grad_scaler_set_state(s, &st));
  st.scale = -1;
  TD_ASSERT_STATUS(td_grad_scaler_set_state(s, &st), TD_ERR_INVALID);
  td_tensor_unref(gp);
  td_optim_destroy(opt);
  td_tensor_unref(p);
  td_grad_scaler_destroy(s);
}

typedef struct fake_group {
  bool other_inf; /* what the other replicas found */
  int calls;
} fake_group;

static td_status fake_agree(void *ctx, bool *found) {
  fake_group *f = ctx;
  f->calls++;
  *found = *found || f->other_inf;
  return TD_OK;
}

static td_status failing_agree(void *ctx, bool *found) {
  (void)ctx, (void)found;
  return td_set_error(TD_ERR_UNAVAILABLE, "worker1 (rank 1) is gone");
}

/* The agreement decides once per iteration: another replica's inf skips this replica's finite
 * step and halves its scale; a failing agreement fails the step with its message. */
static void test_grad_scaler_agreement_decides_once(void **state) {
  (void)state;
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(NULL, &s));
  fake_group f = {true, 0};
  td_grad_scaler_set_agreement(s, fake_agree, &f);
  double pv = 1, g = 65536;
  td_tensor *p = vec(&pv, 1, TD_DTYPE_F64, true);
  td_optim *opt = sgd(p);
  give_grad(p, &g, 1);
  bool stepped = true, found = false;
  TD_ASSERT_OK(td_grad_scaler_step(s, opt, &stepped));
  assert_false(stepped);
  assert_true(elem(p, 0) == 1);
  TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found));
  assert_true(found);
  TD_ASSERT_OK(td_grad_scaler_update(s));
  assert_true(f.calls == 1 && td_grad_scaler_get_scale(s) == 32768);
  /* the _ex form with no agreement decides locally */
  give_grad(p, &g, 1);
  TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt));
  TD_ASSERT_OK(td_grad_scaler_found_inf_ex(s, NULL, NULL, &found));
  assert_false(found);
  TD_ASSERT_OK(td_grad_scaler_found_inf(s, &found)); /* decided: the set agreement is not run */
  assert_false(found);
  assert_true(f.calls == 1);
  TD_ASSERT_OK(td_grad_scaler_update(s));
  td_grad_scaler_set_agreement(s, failing_agree, NULL);
  give_grad(p, &g, 1);
  TD_ASSERT_STATUS(td_grad_scaler_step(s, opt, NULL), TD_ERR_UNAVAILABLE);
  assert_non_null(strstr(td_last_error(), "worker1 (rank 1) is gone"));
  td_optim_destroy(opt);
  td_tensor_unref(p);
  td_grad_scaler_destroy(s);
}

/* dynamic = false: the scale never moves, steps with an inf are still skipped. */
static void test_grad_scaler_constant(void **state) {
  (void)state;
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  o.dynamic = false;
  o.init_scale = 128;
  o.growth_interval = 1;
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(&o, &s));
  double pv = 1;
  td_tensor *p = vec(&pv, 1, TD_DTYPE_F64, true);
  td_optim *opt = sgd(p);
  for (int k = 0; k < 3; k++) {
    double g = k == 1 ? NAN : 128;
    give_grad(p, &g, 1);
    bool stepped;
    TD_ASSERT_OK(td_grad_scaler_step(s, opt, &stepped));
    assert_true(stepped == (k != 1));
    TD_ASSERT_OK(td_grad_scaler_update(s));
    assert_true(td_grad_scaler_get_scale(s) == 128);
  }
  assert_true(elem(p, 0) == 0); /* two steps of 0.5 */
  td_grad_scaler_stats st;
  TD_ASSERT_OK(td_grad_scaler_get_stats(s, &st));
  assert_true(st.skipped_steps == 1 && st.backoffs == 0 && st.growths == 0);
  td_optim_destroy(opt);
  td_tensor_unref(p);
  td_grad_scaler_destroy(s);
}

/* Runs `n` iterations of the rule on s from iteration `from` of a fixed pattern of infs. */
static void run_pattern(td_grad_scaler *s, int from, int n) {
  for (int k = from; k < from + n; k++) {
    double g = k % 5 == 4 ? INFINITY : 1;
    td_tensor *t = vec(&g, 1, TD_DTYPE_F64, false);
    TD_ASSERT_OK(td_grad_scaler_unscale_grads_(s, &t, 1));
    TD_ASSERT_OK(td_grad_scaler_update(s));
    td_tensor_unref(t);
  }
}

/* A scaler restored from a state dict (PyTorch's names, with a prefix) continues the rule where
 * the saved one was: after 7 more iterations both have the same scale and tracker. */
static void test_grad_scaler_state_dict_resumes(void **state) {
  (void)state;
  td_grad_scaler_options o;
  td_grad_scaler_options_init(&o);
  o.growth_interval = 3;
  o.init_scale = 256;
  td_grad_scaler *a = NULL, *b = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(&o, &a));
  run_pattern(a, 0, 7); /* 256 -> ... a backoff at 4, tracker 2 after 7 */
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_grad_scaler_state_dict(a, "scaler.", &sd));
  assert_true(sd.n == 5);
  assert_non_null(td_tensor_list_find(&sd, "scaler._growth_tracker"));
  td_grad_scaler_options_init(&o); /* other factors: the state dict brings them */
  TD_ASSERT_OK(td_grad_scaler_create(&o, &b));
  TD_ASSERT_STATUS(td_grad_scaler_load_state_dict(b, NULL, &sd), TD_ERR_INVALID); /* no prefix */
  TD_ASSERT_OK(td_grad_scaler_load_state_dict(b, "scaler.", &sd));
  td_grad_scaler_state sa, sb;
  TD_ASSERT_OK(td_grad_scaler_get_state(a, &sa));
  TD_ASSERT_OK(td_grad_scaler_get_state(b, &sb));
  assert_true(sa.scale == sb.scale && sa.growth_tracker == sb.growth_tracker);
  assert_true(sa.growth_tracker == 2);
  run_pattern(a, 7, 7);
  run_pattern(b, 7, 7);
  TD_ASSERT_OK(td_grad_scaler_get_state(a, &sa));
  TD_ASSERT_OK(td_grad_scaler_get_state(b, &sb));
  if (sa.scale != sb.scale || sa.growth_tracker != sb.growth_tracker)
    fail_msg("resumed: scale %g tracker %lld, uninterrupted %g %lld", sb.scale,
             (long long)sb.growth_tracker, sa.scale, (long long)sa.growth_tracker);
  td_tensor_list_fini(&sd);
  td_grad_scaler_destroy(a);
  td_grad_scaler_destroy(b);
}

/* 5 AdamW steps of a small MLP with clipping, scaled by 2^16 (unscaled before the clipping) and
 * not scaled at all: the same parameters, bit for bit, in float32. */
static void test_grad_scaler_power_of_two_is_exact(void **state) {
  (void)state;
  td_tensor_list p[2];
  td_module *m[2];
  td_optim *opt[2];
  td_grad_scaler *s = NULL;
  TD_ASSERT_OK(td_grad_scaler_create(NULL, &s));
  for (int r = 0; r < 2; r++) {
    TD_ASSERT_OK(td_nn_manual_seed(3));
    td_module *l1 = NULL, *act = NULL, *l2 = NULL;
    TD_ASSERT_OK(td_sequential_create(&m[r]));
    TD_ASSERT_OK(td_linear_create(6, 8, true, NULL, &l1));
    TD_ASSERT_OK(td_tanh_create(&act));
    TD_ASSERT_OK(td_linear_create(8, 2, true, NULL, &l2));
    TD_ASSERT_OK(td_sequential_append(m[r], l1));
    TD_ASSERT_OK(td_sequential_append(m[r], act));
    TD_ASSERT_OK(td_sequential_append(m[r], l2));
    td_module_unref(l1), td_module_unref(act), td_module_unref(l2);
    td_tensor_list_init(&p[r]);
    TD_ASSERT_OK(td_module_parameters(m[r], &p[r]));
    td_optim_options oo;
    td_optim_options_init(&oo, TD_OPTIM_ADAMW);
    TD_ASSERT_OK(td_optim_create(&oo, p[r].tensors, p[r].n, &opt[r]));
  }
  for (int step = 0; step < 5; step++) {
    int64_t xs[2] = {16, 6}, ys[2] = {16, 2};
    td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F32, 10 + (uint64_t)step, false);
    td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F32, 50 + (uint64_t)step, false);
    for (int r = 0; r < 2; r++) {
      td_tensor *out = NULL, *loss = NULL, *scaled = NULL;
      td_optim_zero_grad(opt[r]);
      TD_ASSERT_OK(td_module_forward(m[r], x, &out));
      TD_ASSERT_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
      if (r) TD_ASSERT_OK(td_grad_scaler_scale(s, loss, &scaled));
      TD_ASSERT_OK(td_tensor_backward(r ? scaled : loss));
      if (r) TD_ASSERT_OK(td_grad_scaler_unscale_(s, opt[r]));
      TD_ASSERT_OK(td_optim_clip_grad_norm(opt[r], 0.05, 2.0, NULL));
      if (r) TD_ASSERT_OK(td_grad_scaler_step(s, opt[r], NULL));
      else TD_ASSERT_OK(td_optim_step(opt[r]));
      if (r) TD_ASSERT_OK(td_grad_scaler_update(s));
      td_tensor_unref(out), td_tensor_unref(loss), td_tensor_unref(scaled);
    }
    td_tensor_unref(x), td_tensor_unref(y);
  }
  for (size_t i = 0; i < p[0].n; i++) {
    td_tensor *a = p[0].tensors[i], *b = p[1].tensors[i];
    if (memcmp(td_tensor_data(a), td_tensor_data(b), td_tensor_nbytes(a)))
      fail_msg("parameter %s differs between the scaled and the unscaled run", p[0].names[i]);
  }
  for (int r = 0; r < 2; r++) {
    td_optim_destroy(opt[r]);
    td_tensor_list_fini(&p[r]);
    td_module_unref(m[r]);
  }
  td_grad_scaler_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grad_scaler_defaults_and_validation),
      cmocka_unit_test(test_grad_scaler_unscale_finds_inf_and_nan),
      cmocka_unit_test(test_grad_scaler_growth_backoff_and_skip),
      cmocka_unit_test(test_grad_scaler_refuses_misuse),
      cmocka_unit_test(test_grad_scaler_agreement_decides_once),
      cmocka_unit_test(test_grad_scaler_constant),
      cmocka_unit_test(test_grad_scaler_state_dict_resumes),
      cmocka_unit_test(test_grad_scaler_power_of_two_is_exact),
  };
  return cmocka_run_group_tests_name("grad_scaler", tests, NULL, NULL);
}
