/* test_nn_cuda.c - the neural-network ops on cuda:0 against the same ops on the CPU: forward
 * values and the gradients of sum(y * W) for a fixed random W, in float64 and float32. Every test
 * skips when this process has no CUDA device (or the build has no CUDA backend). */
#include "nn_test_util.h"

static bool have_cuda(void) { return td_cuda_device_count() > 0; }

/* to_dev returns a copy of t on dev that is a leaf; it requires grad when t does. */
static td_tensor *to_dev(const td_tensor *t, td_device dev) {
  bool prev = td_autograd_set_enabled(false);
  td_tensor *c, *d;
  TD_ASSERT_OK(td_tensor_to(t, dev, &c));
  TD_ASSERT_OK(td_tensor_detach(c, &d));
  td_tensor_unref(c);
  td_autograd_set_enabled(prev);
  if (td_tensor_requires_grad(t)) {
    td_tensor *e;
    TD_ASSERT_OK(td_tensor_clone(d, &e)); /* own storage, so it can be a grad leaf */
    td_tensor_unref(d);
    d = e;
    TD_ASSERT_OK(td_tensor_set_requires_grad(d, true));
  }
  return d;
}

/* run computes fn(in) on the inputs' device, backpropagates sum(y * w) when any input requires
 * grad, and returns y; grads[i] receives each input's gradient (or NULL). */
static td_tensor *run(td_test_fn fn, void *ctx, td_tensor *const *in, int n, const td_tensor *w,
                      td_tensor **grads) {
  td_tensor *y, *p, *s;
  TD_ASSERT_OK(fn(ctx, in, n, &y));
  bool any = false;
  for (int i = 0; i < n; i++) any = any || td_tensor_requires_grad(in[i]);
  if (any) {
    TD_ASSERT_OK(td_tensor_mul(y, w, &p));
    TD_ASSERT_OK(td_tensor_sum_all(p, &s));
    TD_ASSERT_OK(td_tensor_backward(s));
    td_tensor_unref(p);
    td_tensor_unref(s);
  }
  for (int i = 0; i < n; i++)
    grads[i] = td_tensor_requires_grad(in[i]) ? td_tensor_grad(in[i]) : NULL;
  return y;
}

/* compare runs fn on the CPU inputs and on copies of them on cuda:0 and checks that forward
 * values and gradients agree to tol. */
static void compare(const char *what, td_test_fn fn, void *ctx, td_tensor *const *cpu, int n,
                    double tol) {
  td_device dev = td_device_cuda(0);
  td_tensor *gpu[8], *gc[8], *gg[8], *yc, *yg, *wc, *wg;
  assert_true(n <= 8);
  for (int i = 0; i < n; i++) {
    gpu[i] = to_dev(cpu[i], dev);
    if (td_tensor_requires_grad(cpu[i])) TD_ASSERT_OK(td_tensor_set_grad(cpu[i], NULL));
  }
  TD_ASSERT_OK(fn(ctx, cpu, n, &yc));
  wc = td_test_rand(td_tensor_shape(yc), td_tensor_ndim(yc), td_tensor_dtype(yc), 0.5, 1.5, 77,
                    false);
  wg = to_dev(wc, dev);
  td_tensor_unref(yc);
  yc = run(fn, ctx, cpu, n, wc, gc);
  yg = run(fn, ctx, gpu, n, wg, gg);
  assert_int_equal(td_tensor_device(yg).type, TD_DEVICE_CUDA);
  char buf[160];
  snprintf(buf, sizeof buf, "%s forward", what);
  td_test_assert_close(buf, yg, yc, tol, tol);
  for (int i = 0; i < n; i++) {
    if (!gc[i]) continue;
    assert_non_null(gg[i]);
    snprintf(buf, sizeof buf, "%s grad of input %d", what, i);
    td_test_assert_close(buf, gg[i], gc[i], tol, tol);
  }
  for (int i = 0; i < n; i++) {
    td_tensor_unref(gc[i]);
    td_tensor_unref(gg[i]);
    td_tensor_unref(gpu[i]);
  }
  td_tensor_unref(yc);
  td_tensor_unref(yg);
  td_tensor_unref(wc);
  td_tensor_unref(wg);
}

static double tol_for(td_dtype dt) { return dt == TD_DTYPE_F32 ? 2e-4 : 1e-10; }

/* ---- softmax family ---- */

typedef struct cfg {
  int a, b, c, d;
  td_reduction red;
  int64_t ignore;
} cfg;

static td_status softmax_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cfg *c = ctx;
  return c->b ? td_tensor_log_softmax(in[0], c->a, out) : td_tensor_softmax(in[0], c->a, out);
}

static td_status nll_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cfg *c = ctx;
  return c->a ? td_tensor_cross_entropy(in[0], in[1], c->red, c->ignore, out)
              : td_tensor_nll_loss(in[0], in[1], c->red, c->ignore, out);
}

static td_status mse_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  return td_tensor_mse_loss(in[0], in[1], ((cfg *)ctx)->red, out);
}

static void test_cuda_softmax_and_losses(void **state) {
  (void)state;
  if (!have_cuda()) skip();
  for (int f = 0; f < 2; f++) {
    td_dtype dt = f ? TD_DTYPE_F32 : TD_DTYPE_F64;
    const int64_t s3[] = {4, 5, 6}, s2[] = {7, 5}, ts[] = {7};
    td_tensor *x = td_test_randn(s3, 3, dt, 1, true);
    for (int d = 0; d < 3; d++)
      for (int log = 0; log < 2; log++) {
        cfg c = {d, log, 0, 0, TD_REDUCTION_MEAN, -100};
        compare("softmax", softmax_fn, &c, &x, 1, tol_for(dt));
      }
    td_tensor_unref(x);

    const int64_t tv[] = {0, 4, 2, 2, 1, 3, 4};
    td_tensor *in[2] = {td_test_randn(s2, 2, dt, 2, true), nn_i64(tv, ts, 1)};
    for (int ce = 0; ce < 2; ce++)
      for (int r = 0; r < 3; r++) {
        cfg c = {ce, 0, 0, 0, (td_reduction)r, r == 0 ? 2 : -100};
        compare("nll / cross_entropy", nll_fn, &c, in, 2, tol_for(dt));
      }
    td_tensor *m[2] = {in[0], td_test_randn(s2, 2, dt, 3, true)};
    for (int r = 0; r < 3; r++) {
      cfg c = {0, 0, 0, 0, (td_reduction)r, 0};
      compare("mse_loss", mse_fn, &c, m, 2, tol_for(dt));
    }
    td_tensor_unref(m[1]);
    td_tensor_unref(in[0]);
    td_tensor_unref(in[1]);
  }
}

/* ---- conv2d / max_pool2d ---- */

static td_status conv_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cfg *c = ctx;
  return td_tensor_conv2d(in[0], in[1], n > 2 ? in[2] : NULL, c->a, c->b, c->c, c->d, out);
}

static td_status pool_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cfg *c = ctx;
  return td_tensor_max_pool2d(in[0], c->a, c->b, c->c, c->d, out);
}

static void test_cuda_conv_and_pool(void **state) {
  (void)state;
  if (!have_cuda()) skip();
  for (int f = 0; f < 2; f++) {
    td_dtype dt = f ? TD_DTYPE_F32 : TD_DTYPE_F64;
    const int64_t xs[] = {3, 4, 11, 9}, ws[] = {5, 4, 3, 2}, bs[] = {5};
    td_tensor *in[3] = {td_test_randn(xs, 4, dt, 4, true), td_test_randn(ws, 4, dt, 5, true),
                        td_test_randn(bs, 1, dt, 6, true)};
    cfg c1 = {1, 1, 0, 0, 0, 0}, c2 = {2, 3, 1, 2, 0, 0};
    compare("conv2d", conv_fn, &c1, in, 3, tol_for(dt) * 10);
    compare("conv2d stride pad", conv_fn, &c2, in, 2, tol_for(dt) * 10);
    cfg p1 = {2, 2, 2, 2, 0, 0}, p2 = {3, 2, 1, 3, 0, 0};
    compare("max_pool2d", pool_fn, &p1, in, 1, tol_for(dt));
    compare("max_pool2d overlapping", pool_fn, &p2, in, 1, tol_for(dt));
    for (int i = 0; i < 3; i++) td_tensor_unref(in[i]);
  }
}

/* ---- indexing, joining ---- */

static td_status emb_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  return td_tensor_embedding(in[0], in[1], out);
}

static td_status isel_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  return td_tensor_index_select(in[0], ((cfg *)ctx)->a, in[1], out);
}

static td_status cat_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cfg *c = ctx;
  return c->b ? td_tensor_stack(in, n, c->a, out) : td_tensor_cat(in, n, c->a, out);
}

static void test_cuda_index_and_join(void **state) {
  (void)state;
  if (!have_cuda()) skip();
  for (int f = 0; f < 2; f++) {
    td_dtype dt = f ? TD_DTYPE_F32 : TD_DTYPE_F64;
    const int64_t ws[] = {6, 4}, is[] = {2, 3}, xs[] = {5, 6, 4}, js[] = {4};
    const int64_t iv[] = {5, 0, 5, 2, 2, 1}, jv[] = {3, 0, 3, 1};
    td_tensor *e[2] = {td_test_randn(ws, 2, dt, 7, true), nn_i64(iv, is, 2)};
    compare("embedding", emb_fn, NULL, e, 2, tol_for(dt));
    td_tensor *s[2] = {td_test_randn(xs, 3, dt, 8, true), nn_i64(jv, js, 1)};
    for (int d = 0; d < 3; d++) {
      cfg c = {d, 0, 0, 0, 0, 0};
      compare("index_select", isel_fn, &c, s, 2, tol_for(dt));
    }
    td_tensor *j[3] = {s[0], td_test_randn(xs, 3, dt, 9, false),
                       td_test_randn(xs, 3, dt, 10, true)};
    for (int d = 0; d < 3; d++) {
      cfg c = {d, 0, 0, 0, 0, 0}, st = {d, 1, 0, 0, 0, 0};
      compare("cat", cat_fn, &c, j, 3, tol_for(dt));
      compare("stack", cat_fn, &st, j, 3, tol_for(dt));
    }
    td_tensor_unref(j[1]);
    td_tensor_unref(j[2]);
    for (int i = 0; i < 2; i++) {
      td_tensor_unref(e[i]);
      td_tensor_unref(s[i]);
    }
  }
}

/* ---- layer_norm, dropout ---- */

static td_status ln_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  return td_tensor_layer_norm(in[0], ((cfg *)ctx)->a, n > 1 ? in[1] : NULL, n > 2 ? in[2] : NULL,
                              1e-5, out);
}

static td_status dropout_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(5, &g)); /* the mask comes from the CPU: same on both */
  td_status st = td_tensor_dropout(in[0], 0.3, true, g, out);
  td_generator_destroy(g);
  return st;
}

static void test_cuda_layer_norm_and_dropout(void **state) {
  (void)state;
  if (!have_cuda()) skip();
  for (int f = 0; f < 2; f++) {
    td_dtype dt = f ? TD_DTYPE_F32 : TD_DTYPE_F64;
    const int64_t xs[] = {4, 3, 16}, p1[] = {16}, p2[] = {3, 16};
    td_tensor *in1[3] = {td_test_randn(xs, 3, dt, 11, true), td_test_randn(p1, 1, dt, 12, true),
                         td_test_randn(p1, 1, dt, 13, true)};
    td_tensor *in2[3] = {in1[0], td_test_randn(p2, 2, dt, 14, true),
                         td_test_randn(p2, 2, dt, 15, true)};
    cfg c1 = {1, 0, 0, 0, 0, 0}, c2 = {2, 0, 0, 0, 0, 0};
    compare("layer_norm", ln_fn, &c1, in1, 3, tol_for(dt));
    compare("layer_norm 2 dims", ln_fn, &c2, in2, 3, tol_for(dt));
    compare("layer_norm no affine", ln_fn, &c1, in1, 1, tol_for(dt));
    compare("dropout", dropout_fn, NULL, in1, 1, tol_for(dt));
    for (int i = 0; i < 3; i++) td_tensor_unref(in1[i]);
    td_tensor_unref(in2[1]);
    td_tensor_unref(in2[2]);
  }
}

/* An out-of-range index on the device is a clean error, not a device fault. */
static void test_cuda_bad_indices(void **state) {
  (void)state;
  if (!have_cuda()) skip();
  td_device dev = td_device_cuda(0);
  const int64_t ws[] = {3, 4}, is[] = {2}, bad[] = {1, 3};
  td_tensor *w = td_test_randn(ws, 2, TD_DTYPE_F32, 1, false), *i = nn_i64(bad, is, 1);
  td_tensor *wd = to_dev(w, dev), *id = to_dev(i, dev), *y = NULL;
  TD_ASSERT_STATUS(td_tensor_embedding(wd, id, &y), TD_ERR_INVALID);
  nn_expect_error("embedding", "index 3");
  TD_ASSERT_STATUS(td_tensor_nll_loss(wd, id, TD_REDUCTION_MEAN, -100, &y), TD_ERR_SHAPE);
  const int64_t tv[] = {1, 4, 0}, ts[] = {3};
  td_tensor *t = nn_i64(tv, ts, 1), *td = to_dev(t, dev);
  TD_ASSERT_STATUS(td_tensor_nll_loss(wd, td, TD_REDUCTION_MEAN, -100, &y), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(td);
  td_tensor_unref(t);
  td_tensor_unref(id);
  td_tensor_unref(wd);
  td_tensor_unref(i);
  td_tensor_unref(w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_softmax_and_losses),
      cmocka_unit_test(test_cuda_conv_and_pool),
      cmocka_unit_test(test_cuda_index_and_join),
      cmocka_unit_test(test_cuda_layer_norm_and_dropout),
      cmocka_unit_test(test_cuda_bad_indices),
  };
  return cmocka_run_group_tests_name("tensor_nn_cuda", tests, NULL, NULL);
}
