/* test_nn_norm.c - layer_norm and dropout: forward values against PyTorch, gradients against
 * finite differences (float64), dropout mask statistics, and misuse.
 *
 * Expected numbers were produced with PyTorch 1.13 in float64:
 *   x = [[1, 2, 4], [-1, 0.5, 3]]; w = [0.5, 1, -2]; b = [0.1, 0.2, 0.3]
 *   F.layer_norm(x, (3,), w, b, 1e-5); F.layer_norm(x, (2, 3), None, None, 1e-5)
 */
#include "nn_test_util.h"

/* ---- layer_norm ---- */

static void test_layer_norm_forward_matches_torch(void **state) {
  (void)state;
  const double xv[] = {1, 2, 4, -1, 0.5, 3}, wv[] = {0.5, 1, -2}, bv[] = {0.1, 0.2, 0.3};
  const int64_t xs[] = {2, 3}, ps[] = {3};
  const double ln[] = {-0.43452076572514897, -0.067260382862574575, -2.3726038286257438,
                       -0.45558287904630379, -0.0020301378350195409, -2.3263917918552544};
  const double ln2[] = {-0.35491343168580414, 0.25350959406128859, 1.470355645555474,
                        -1.5717594831799895, -0.65912494455935056, 0.86193261980838132};
  for (int f32 = 0; f32 < 2; f32++) {
    td_dtype dt = f32 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    double tol = f32 ? 1e-5 : 1e-12;
    td_tensor *x = td_test_tensor(xv, xs, 2, dt, false), *w = td_test_tensor(wv, ps, 1, dt, false);
    td_tensor *b = td_test_tensor(bv, ps, 1, dt, false), *y;
    TD_ASSERT_OK(td_tensor_layer_norm(x, 1, w, b, 1e-5, &y));
    nn_expect_shape(y, xs, 2);
    assert_int_equal(td_tensor_dtype(y), dt);
    nn_expect("layer_norm last dim", y, ln, 6, tol);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_layer_norm(x, 2, NULL, NULL, 1e-5, &y));
    nn_expect("layer_norm 2 dims no affine", y, ln2, 6, tol);
    td_tensor_unref(y);
    td_tensor_unref(x);
    td_tensor_unref(w);
    td_tensor_unref(b);
  }
}

typedef struct ln_ctx {
  int nd;
  bool weight, bias, transpose;
} ln_ctx;

static td_status ln_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  ln_ctx *c = ctx;
  const td_tensor *w = c->weight ? in[1] : NULL;
  const td_tensor *b = c->bias ? in[c->weight ? 2 : 1] : NULL;
  if (!c->transpose) return td_tensor_layer_norm(in[0], c->nd, w, b, 1e-5, out);
  td_tensor *t;
  td_status st = td_tensor_transpose(in[0], 0, 1, &t);
  if (st != TD_OK) return st;
  st = td_tensor_layer_norm(t, c->nd, w, b, 1e-5, out);
  td_tensor_unref(t);
  return st;
}

static void test_layer_norm_gradcheck(void **state) {
  (void)state;
  const int64_t xs[] = {2, 3, 4}, p1[] = {4}, p2[] = {3, 4};
  td_tensor *x = td_test_randn(xs, 3, TD_DTYPE_F64, 31, true);
  td_tensor *w1 = td_test_randn(p1, 1, TD_DTYPE_F64, 32, true);
  td_tensor *b1 = td_test_randn(p1, 1, TD_DTYPE_F64, 33, true);
  td_tensor *w2 = td_test_randn(p2, 2, TD_DTYPE_F64, 34, true);
  td_tensor *b2 = td_test_randn(p2, 2, TD_DTYPE_F64, 35, true);
  td_tensor *in1[3] = {x, w1, b1}, *in2[3] = {x, w2, b2};
  ln_ctx c = {1, true, true, false};
  td_test_gradcheck(ln_fn, &c, in1, 3, 1e-6, 1e-7, 1e-5);
  c = (ln_ctx){2, true, true, false};
  td_test_gradcheck(ln_fn, &c, in2, 3, 1e-6, 1e-7, 1e-5);
  c = (ln_ctx){3, false, false, false};
  td_test_gradcheck(ln_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
  td_tensor *xw[2] = {x, w1}, *xb[2] = {x, b1};
  c = (ln_ctx){1, true, false, false};
  td_test_gradcheck(ln_fn, &c, xw, 2, 1e-6, 1e-7, 1e-5);
  c = (ln_ctx){1, false, true, false};
  td_test_gradcheck(ln_fn, &c, xb, 2, 1e-6, 1e-7, 1e-5);
  /* Non-contiguous input: transpose(x, 0, 1) is [3, 2, 4]. */
  c = (ln_ctx){1, true, true, true};
  td_test_gradcheck(ln_fn, &c, in1, 3, 1e-6, 1e-7, 1e-5);
  /* Only the parameters require grad. */
  td_tensor *xd;
  TD_ASSERT_OK(td_tensor_detach(x, &xd));
  td_tensor *pin[3] = {xd, w1, b1};
  c = (ln_ctx){1, true, true, false};
  td_test_gradcheck(ln_fn, &c, pin, 3, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(xd);
  td_tensor_unref(x);
  td_tensor_unref(w1);
  td_tensor_unref(b1);
  td_tensor_unref(w2);
  td_tensor_unref(b2);
}

static void test_layer_norm_misuse(void **state) {
  (void)state;
  const int64_t xs[] = {2, 3}, p3[] = {3}, p2[] = {2};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 1, false);
  td_tensor *w = td_test_randn(p3, 1, TD_DTYPE_F64, 2, false);
  td_tensor *wbad = td_test_randn(p2, 1, TD_DTYPE_F64, 3, false);
  td_tensor *w32 = td_test_randn(p3, 1, TD_DTYPE_F32, 4, false), *xi, *y = NULL;
  TD_ASSERT_OK(td_tensor_zeros(xs, 2, TD_DTYPE_I64, td_device_cpu(), &xi));
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 0, NULL, NULL, 1e-5, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 3, NULL, NULL, 1e-5, &y), TD_ERR_INVALID);
  nn_expect_error("layer_norm", "[2, 3]");
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 1, wbad, NULL, 1e-5, &y), TD_ERR_SHAPE);
  nn_expect_error("weight", "[2]");
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 1, w, wbad, 1e-5, &y), TD_ERR_SHAPE);
  nn_expect_error("bias", NULL);
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 2, w, NULL, 1e-5, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 1, w32, NULL, 1e-5, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_layer_norm(xi, 1, NULL, NULL, 1e-5, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_layer_norm(NULL, 1, NULL, NULL, 1e-5, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_layer_norm(x, 1, NULL, NULL, 1e-5, NULL), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(xi);
  td_tensor_unref(w32);
  td_tensor_unref(wbad);
  td_tensor_unref(w);
  td_tensor_unref(x);
}

/* ---- dropout ---- */

static void test_dropout_identity_cases(void **state) {
  (void)state;
  const int64_t s[] = {4, 5};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F32, 1, true), *y;
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(7, &g));
  TD_ASSERT_OK(td_tensor_dropout(x, 0.5, false, g, &y)); /* eval mode */
  assert_ptr_equal(y, x);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_dropout(x, 0.0, true, g, &y)); /* p = 0 */
  assert_ptr_equal(y, x);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_dropout(x, 0.5, false, NULL, &y)); /* no generator needed */
  assert_ptr_equal(y, x);
  td_tensor_unref(y);

  /* p = 1 zeroes everything, and the gradient too. */
  td_tensor *s1, *z;
  TD_ASSERT_OK(td_tensor_dropout(x, 1.0, true, NULL, &y));
  TD_ASSERT_OK(td_tensor_zeros(s, 2, TD_DTYPE_F32, td_device_cpu(), &z));
  td_test_assert_close("dropout p=1", y, z, 0, 0);
  TD_ASSERT_OK(td_tensor_sum_all(y, &s1));
  TD_ASSERT_OK(td_tensor_backward(s1));
  td_tensor *gx = td_tensor_grad(x);
  td_test_assert_close("dropout p=1 grad", gx, z, 0, 0);
  td_tensor_unref(gx);
  td_tensor_unref(s1);
  td_tensor_unref(z);
  td_tensor_unref(y);
  td_generator_destroy(g);
  td_tensor_unref(x);
}

static void test_dropout_mask_statistics_and_grad(void **state) {
  (void)state;
  const int64_t s[] = {100, 100};
  const double p = 0.3, keep = 1.0 / (1.0 - p);
  td_tensor *x, *y, *sum;
  TD_ASSERT_OK(td_tensor_ones(s, 2, TD_DTYPE_F64, td_device_cpu(), &x));
  TD_ASSERT_OK(td_tensor_set_requires_grad(x, true));
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(42, &g));
  TD_ASSERT_OK(td_tensor_dropout(x, p, true, g, &y));
  const double *yd = td_tensor_data(y);
  int64_t zeros = 0;
  for (int64_t i = 0; i < 10000; i++) {
    if (yd[i] == 0.0) {
      zeros++;
    } else if (fabs(yd[i] - keep) > 1e-12) {
      fail_msg("dropout element %lld is %g, expected 0 or %g", (long long)i, yd[i], keep);
    }
  }
  /* Binomial(10000, 0.3): mean 3000, sd ~46; allow 5 sd. */
  assert_in_range(zeros, 2770, 3230);
  /* With x = 1 the gradient of sum(y) is the scaled mask itself. */
  TD_ASSERT_OK(td_tensor_sum_all(y, &sum));
  TD_ASSERT_OK(td_tensor_backward(sum));
  td_tensor *gx = td_tensor_grad(x);
  td_test_assert_close("dropout grad = mask", gx, y, 0, 0);
  td_tensor_unref(gx);
  td_tensor_unref(sum);

  /* The same seed gives the same mask. */
  td_generator *g2;
  td_tensor *y2;
  TD_ASSERT_OK(td_generator_create(42, &g2));
  TD_ASSERT_OK(td_tensor_dropout(x, p, true, g2, &y2));
  td_test_assert_close("dropout same seed", y2, y, 0, 0);
  td_tensor_unref(y2);
  td_generator_destroy(g2);
  td_generator_destroy(g);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static td_status dropout_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(*(uint64_t *)ctx, &g)); /* same mask on every call */
  td_status st = td_tensor_dropout(in[0], 0.4, true, g, out);
  td_generator_destroy(g);
  return st;
}

static void test_dropout_gradcheck(void **state) {
  (void)state;
  const int64_t s[] = {3, 5};
  uint64_t seed = 9;
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F64, 2, true);
  td_test_gradcheck(dropout_fn, &seed, &x, 1, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(x);
}

static void test_dropout_misuse(void **state) {
  (void)state;
  const int64_t s[] = {2, 2};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F64, 1, false), *xi, *y = NULL;
  TD_ASSERT_OK(td_tensor_zeros(s, 2, TD_DTYPE_I64, td_device_cpu(), &xi));
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(1, &g));
  TD_ASSERT_STATUS(td_tensor_dropout(x, -0.1, true, g, &y), TD_ERR_INVALID);
  nn_expect_error("dropout", "-0.1");
  TD_ASSERT_STATUS(td_tensor_dropout(x, 1.5, true, g, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_dropout(x, NAN, true, g, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_dropout(x, 0.5, true, NULL, &y), TD_ERR_INVALID);
  nn_expect_error("dropout", "generator");
  TD_ASSERT_STATUS(td_tensor_dropout(xi, 0.5, true, g, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_dropout(NULL, 0.5, true, g, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_dropout(x, 0.5, true, g, NULL), TD_ERR_INVALID);
  assert_null(y);
  td_generator_destroy(g);
  td_tensor_unref(xi);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layer_norm_forward_matches_torch),
      cmocka_unit_test(test_layer_norm_gradcheck),
      cmocka_unit_test(test_layer_norm_misuse),
      cmocka_unit_test(test_dropout_identity_cases),
      cmocka_unit_test(test_dropout_mask_statistics_and_grad),
      cmocka_unit_test(test_dropout_gradcheck),
      cmocka_unit_test(test_dropout_misuse),
  };
  return cmocka_run_group_tests_name("tensor_nn_norm", tests, NULL, NULL);
}
