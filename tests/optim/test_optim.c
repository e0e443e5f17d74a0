/* test_optim.c - optimizer API: defaults, validation, misuse, hand-computed updates, training a
 * small model, and concurrent steps serialised by the optimizer's mutex. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "test_util.h"

static td_tensor *vec(const double *v, int64_t n, td_dtype dt, bool rg) {
  return td_test_tensor(v, &n, 1, dt, rg);
}

static void test_optim_defaults(void **state) {
  (void)state;
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAM);
  assert_true(o.kind == TD_OPTIM_ADAM && o.lr == 1e-3 && o.beta1 == 0.9 && o.beta2 == 0.999 &&
              o.eps == 1e-8 && o.weight_decay == 0 && !o.amsgrad && !o.maximize);
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  assert_true(o.lr == 1e-3 && o.weight_decay == 1e-2 && o.eps == 1e-8);
  td_optim_options_init(&o, TD_OPTIM_ADAGRAD);
  assert_true(o.lr == 1e-2 && o.eps == 1e-10 && o.lr_decay == 0 &&
              o.initial_accumulator_value == 0);
  td_optim_options_init(&o, TD_OPTIM_RMSPROP);
  assert_true(o.lr == 1e-2 && o.alpha == 0.99 && o.eps == 1e-8 && o.momentum == 0 &&
              !o.centered);
  td_optim_options_init(&o, TD_OPTIM_SGD);
  assert_true(isnan(o.lr) && o.momentum == 0 && o.dampening == 0 && !o.nesterov);
  assert_string_equal(td_optim_kind_name(TD_OPTIM_RMSPROP), "RMSprop");
  assert_string_equal(td_optim_kind_name((td_optim_kind)42), "unknown");
}

static void test_optim_validation(void **state) {
  (void)state;
  double v[] = {1, 2};
  td_tensor *p = vec(v, 2, TD_DTYPE_F32, true), *q = vec(v, 2, TD_DTYPE_F32, true);
  td_optim *opt = NULL;
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_SGD);
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID); /* SGD needs lr */
  assert_non_null(strstr(td_last_error(), "lr"));
  o.lr = -1;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  o.lr = 0.1;
  o.nesterov = true;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  o.momentum = 0.9;
  o.dampening = 0.1;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  o.dampening = 0;
  o.weight_decay = -1;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  td_optim_options_init(&o, TD_OPTIM_ADAM);
  o.beta1 = 1.0;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "beta"));
  td_optim_options_init(&o, TD_OPTIM_ADAGRAD);
  o.initial_accumulator_value = -0.5;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  td_optim_options_init(&o, TD_OPTIM_RMSPROP);
  o.alpha = -0.1;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  td_optim_options_init(&o, TD_OPTIM_RMSPROP);
  td_tensor *dup[2] = {p, p};
  TD_ASSERT_STATUS(td_optim_create(&o, dup, 2, &opt), TD_ERR_INVALID);
  td_tensor *nul[1] = {NULL};
  TD_ASSERT_STATUS(td_optim_create(&o, nul, 1, &opt), TD_ERR_INVALID);
  int64_t iv[] = {1, 2};
  td_tensor *ip = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(iv, (int64_t[]){2}, 1, TD_DTYPE_I64, &ip));
  TD_ASSERT_STATUS(td_optim_create(&o, &ip, 1, &opt), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_optim_create(NULL, &p, 1, &opt), TD_ERR_INVALID);
  o.kind = (td_optim_kind)42;
  TD_ASSERT_STATUS(td_optim_create(&o, &p, 1, &opt), TD_ERR_INVALID);
  assert_null(opt);

  /* step misuse */
  td_optim_options_init(&o, TD_OPTIM_ADAM);
  td_tensor *pq[2] = {p, q};
  TD_ASSERT_OK(td_optim_create(&o, pq, 2, &opt));
  assert_int_equal(td_optim_num_params(opt), 2);
  assert_ptr_equal(td_optim_param(opt, 1), q);
  assert_null(td_optim_param(opt, 2));
  double gv[] = {0.5, 0.5, 0.5};
  td_tensor *g_ok = vec(gv, 2, TD_DTYPE_F32, false), *g_long = vec(gv, 3, TD_DTYPE_F32, false);
  td_tensor *g_f64 = vec(gv, 2, TD_DTYPE_F64, false);
  td_tensor *grads[2] = {g_ok, g_long};
  TD_ASSERT_STATUS(td_optim_step_grads(opt, grads, 1), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_step_grads(opt, grads, 2), TD_ERR_SHAPE);
  grads[1] = g_f64;
  TD_ASSERT_STATUS(td_optim_step_grads(opt, grads, 2), TD_ERR_DTYPE);
  /* nothing moved: validation happens before any update */
  td_tensor *orig = vec(v, 2, TD_DTYPE_F32, false);
  td_test_assert_close("p untouched", p, orig, 0, 0);
  assert_int_equal(td_optim_step_count(opt, 0), 0);
  TD_ASSERT_STATUS(td_optim_step_grads(NULL, grads, 2), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_step_grad_map(opt, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_set_lr(opt, -1), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_set_lr(opt, NAN), TD_ERR_INVALID);
  TD_ASSERT_OK(td_optim_set_lr(opt, 0.5));
  td_optim_options got;
  td_optim_options_get(opt, &got);
  assert_true(got.lr == 0.5);
  /* no gradients at all: a step is a no-op */
  TD_ASSERT_OK(td_optim_step(opt));
  td_test_assert_close("p without grad", p, orig, 0, 0);
  td_optim_destroy(opt);
  td_optim_destroy(NULL);

  td_tensor_unref(orig);
  td_tensor_unref(g_ok);
  td_tensor_unref(g_long);
  td_tensor_unref(g_f64);
  td_tensor_unref(ip);
  td_tensor_unref(p);
  td_tensor_unref(q);
}

/* Hand-computed first steps (independent of the fixtures). */
static void test_optim_first_step_by_hand(void **state) {
  (void)state;
  double pv[] = {1.0, -2.0}, gv[] = {0.5, -0.25};
  td_tensor *g = vec(gv, 2, TD_DTYPE_F64, false);
  td_optim_options o;
  struct {
    td_optim_kind kind;
    double lr;
    double e0, e1;
  } cases[] = {
      /* SGD: p - lr g */
      {TD_OPTIM_SGD, 0.1, 1.0 - 0.05, -2.0 + 0.025},
      /* Adam step 1: m = (1-b1) g, v = (1-b2) g^2, update = lr * g / (|g| + eps') ~ lr sign(g) */
      {TD_OPTIM_ADAM, 0.1, 1.0 - 0.1 * 0.5 / (0.5 + 1e-8), -2.0 + 0.1 * 0.25 / (0.25 + 1e-8)},
      /* Adagrad step 1: sum = g^2, update = lr g / (|g| + eps) */
      {TD_OPTIM_ADAGRAD, 0.1, 1.0 - 0.1 * 0.5 / (0.5 + 1e-10),
       -2.0 + 0.1 * 0.25 / (0.25 + 1e-10)},
      /* RMSprop step 1: v = (1 - alpha) g^2, update = lr g / (sqrt(v) + eps) */
      {TD_OPTIM_RMSPROP, 0.01, 1.0 - 0.01 * 0.5 / (sqrt(0.01) * 0.5 + 1e-8),
       -2.0 + 0.01 * 0.25 / (sqrt(0.01) * 0.25 + 1e-8)},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    td_tensor *p = vec(pv, 2, TD_DTYPE_F64, true);
    td_optim_options_init(&o, cases[c].kind);
    o.lr = cases[c].lr;
    td_optim *opt = NULL;
    TD_ASSERT_OK(td_optim_create(&o, &p, 1, &opt));
    TD_ASSERT_OK(td_optim_step_grads(opt, &g, 1));
    double ev[] = {cases[c].e0, cases[c].e1};
    td_tensor *e = vec(ev, 2, TD_DTYPE_F64, false);
    td_test_assert_close(td_optim_kind_name(cases[c].kind), p, e, 1e-12, 1e-14);
    td_tensor_unref(e);
    td_optim_destroy(opt);
    td_tensor_unref(p);
  }
  td_tensor_unref(g);
}

static void test_optim_trains_a_model(void **state) {
  (void)state;
  /* fit y = 3 x0 - 2 x1 + 0.5 with a Linear(2, 1) and Adam */
  td_generator *gen = NULL;
  TD_ASSERT_OK(td_generator_create(11, &gen));
  td_module *m = NULL;
  TD_ASSERT_OK(td_linear_create(2, 1, true, gen, &m));
  td_tensor_list params;
  td_tensor_list_init(&params);
  TD_ASSERT_OK(td_module_parameters(m, &params));
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAM);
  o.lr = 0.05;
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create(&o, params.tensors, params.n, &opt));
  td_tensor *x = td_test_randn((int64_t[]){64, 2}, 2, TD_DTYPE_F32, 3, false);
  double wv[] = {3, -2};
  td_tensor *w = td_test_tensor(wv, (int64_t[]){2, 1}, 2, TD_DTYPE_F32, false);
  td_tensor *xw = NULL, *y = NULL;
  TD_ASSERT_OK(td_tensor_matmul(x, w, &xw));
  TD_ASSERT_OK(td_tensor_add_scalar(xw, 0.5, &y));
  double first = 0, last = 0;
  for (int it = 0; it < 300; it++) {
    td_tensor *pred = NULL, *loss = NULL;
    td_optim_zero_grad(opt);
    TD_ASSERT_OK(td_module_forward(m, x, &pred));
    TD_ASSERT_OK(td_tensor_mse_loss(pred, y, TD_REDUCTION_MEAN, &loss));
    TD_ASSERT_OK(td_tensor_backward(loss));
    TD_ASSERT_OK(td_optim_step(opt));
    TD_ASSERT_OK(td_tensor_item(loss, it == 0 ? &first : &last));
    td_tensor_unref(pred);
    td_tensor_unref(loss);
  }
  if (!(last < 1e-3 && last < first * 1e-3))
    fail_msg("loss went from %g to %g", first, last);
  double wb[2];
  td_tensor *w64 = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(td_module_param(m, "weight"), TD_DTYPE_F64, &w64));
  TD_ASSERT_OK(td_tensor_copy_to_buffer(w64, wb, 2 * sizeof(double)));
  assert_true(fabs(wb[0] - 3) < 0.05 && fabs(wb[1] + 2) < 0.05);
  td_tensor_unref(w64);
  td_tensor_unref(x);
  td_tensor_unref(w);
  td_tensor_unref(xw);
  td_tensor_unref(y);
  td_optim_destroy(opt);
  td_tensor_list_fini(&params);
  td_module_unref(m);
  td_generator_destroy(gen);
}

/* ---- concurrency ---- */

typedef struct thread_arg {
  td_optim *opt;
  td_tensor *grad;
  int iters;
  td_status st;
} thread_arg;

static void *stepper(void *p) {
  thread_arg *a = p;
  a->st = TD_OK;
  for (int i = 0; i < a->iters && a->st == TD_OK; i++)
    a->st = td_optim_step_grads(a->opt, &a->grad, 1);
  return NULL;
}

static void test_optim_concurrent_steps(void **state) {
  (void)state;
  /* SGD with lr 2^-4 and gradient 1: every step subtracts exactly 1/16, so the result is exact
   * only when no two steps interleave. */
  enum { THREADS = 4, ITERS = 200 };
  double pv[] = {0, 0, 0, 0}, gv[] = {1, 1, 1, 1};
  td_tensor *p = vec(pv, 4, TD_DTYPE_F64, true), *g = vec(gv, 4, TD_DTYPE_F64, false);
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_SGD);
  o.lr = 1.0 / 16;
  o.momentum = 0.5; /* the momentum buffer is shared state a race would corrupt */
  o.dampening = 0.5;
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create(&o, &p, 1, &opt));
  pthread_t th[THREADS];
  thread_arg args[THREADS];
  for (int i = 0; i < THREADS; i++) {
    args[i] = (thread_arg){opt, g, ITERS, TD_OK};
    assert_int_equal(pthread_create(&th[i], NULL, stepper, &args[i]), 0);
  }
  for (int i = 0; i < THREADS; i++) {
    pthread_join(th[i], NULL);
    TD_ASSERT_OK(args[i].st);
  }
  assert_int_equal(td_optim_step_count(opt, 0), THREADS * ITERS);
  /* buf_1 = 1, buf_k = 0.5 buf + 0.5 -> stays 1; each step subtracts lr */
  double want = -(double)(THREADS * ITERS) / 16.0;
  double ev[] = {want, want, want, want};
  td_tensor *e = vec(ev, 4, TD_DTYPE_F64, false);
  td_test_assert_close("concurrent SGD", p, e, 0, 0);
  td_tensor_unref(e);
  td_optim_destroy(opt);
  td_tensor_unref(p);
  td_tensor_unref(g);
}

/* The same Adam and RMSprop steps on CUDA and on the CPU agree (skipped without a GPU). */
static void test_optim_on_cuda(void **state) {
  (void)state;
  td_device cuda = td_device_cuda(0);
  if (!td_device_available(cuda)) skip();
  td_optim_kind kinds[] = {TD_OPTIM_SGD, TD_OPTIM_ADAM, TD_OPTIM_ADAGRAD, TD_OPTIM_RMSPROP};
  for (int k = 0; k < 4; k++) {
    td_tensor *pc = td_test_randn((int64_t[]){7, 5}, 2, TD_DTYPE_F32, 1, false), *pg = NULL;
    TD_ASSERT_OK(td_tensor_to(pc, cuda, &pg));
    TD_ASSERT_OK(td_tensor_set_requires_grad(pc, true));
    TD_ASSERT_OK(td_tensor_set_requires_grad(pg, true));
    td_optim_options o;
    td_optim_options_init(&o, kinds[k]);
    o.lr = 0.01;
    o.momentum = kinds[k] == TD_OPTIM_ADAM || kinds[k] == TD_OPTIM_ADAGRAD ? 0 : 0.9;
    o.weight_decay = 0.1;
    o.centered = true;
    o.amsgrad = true;
    td_optim *oc = NULL, *og = NULL;
    TD_ASSERT_OK(td_optim_create(&o, &pc, 1, &oc));
    TD_ASSERT_OK(td_optim_create(&o, &pg, 1, &og));
    for (int s = 0; s < 3; s++) {
      td_tensor *gc = td_test_randn((int64_t[]){7, 5}, 2, TD_DTYPE_F32, 10 + (uint64_t)s, false);
      td_tensor *gg = NULL;
      TD_ASSERT_OK(td_tensor_to(gc, cuda, &gg));
      TD_ASSERT_OK(td_optim_step_grads(oc, &gc, 1));
      TD_ASSERT_OK(td_optim_step_grads(og, &gg, 1));
      td_tensor_unref(gc);
      td_tensor_unref(gg);
    }
    assert_true(td_device_equal(td_tensor_device(pg), cuda));
    td_test_assert_close(td_optim_kind_name(kinds[k]), pg, pc, 1e-5, 1e-6);
    td_optim_destroy(oc);
    td_optim_destroy(og);
    td_tensor_unref(pc);
    td_tensor_unref(pg);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optim_defaults),
      cmocka_unit_test(test_optim_validation),
      cmocka_unit_test(test_optim_first_step_by_hand),
      cmocka_unit_test(test_optim_trains_a_model),
      cmocka_unit_test(test_optim_concurrent_steps),
      cmocka_unit_test(test_optim_on_cuda),
  };
  return cmocka_run_group_tests_name("optim", tests, NULL, NULL);
}
