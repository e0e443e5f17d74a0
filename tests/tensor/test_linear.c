/* test_linear.c - td_tensor_linear (F.linear fused with its bias): values against matmul + add,
 * gradients against finite differences (float64) for batched, 1-d and strided inputs, with and
 * without bias and with a weight that is a transposed view, and misuse. The Linear module's
 * PyTorch fixture (tests/modules, nn_linear) runs through this op too. */
#include "test_util.h"

typedef struct lin_ctx {
  bool bias, transpose_x, weight_view;
} lin_ctx;

/* in: x, w (or w^T stored as [in, out] when weight_view), b. */
static td_status lin_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  lin_ctx *c = ctx;
  td_tensor *x = NULL, *w = NULL;
  td_status st = TD_OK;
  if (c->transpose_x) st = td_tensor_transpose(in[0], 0, 1, &x);
  else x = td_tensor_ref(in[0]);
  if (st == TD_OK && c->weight_view) st = td_tensor_transpose(in[1], 0, 1, &w);
  else if (st == TD_OK) w = td_tensor_ref(in[1]);
  if (st == TD_OK) st = td_tensor_linear(x, w, c->bias ? in[2] : NULL, out);
  td_tensor_unref(x);
  td_tensor_unref(w);
  return st;
}

static td_tensor *reference(const td_tensor *x, const td_tensor *w, const td_tensor *b) {
  td_tensor *wt, *y, *yb;
  TD_ASSERT_OK(td_tensor_transpose(w, 0, 1, &wt));
  TD_ASSERT_OK(td_tensor_matmul(x, wt, &y));
  td_tensor_unref(wt);
  if (!b) return y;
  TD_ASSERT_OK(td_tensor_add(y, b, &yb));
  td_tensor_unref(y);
  return yb;
}

static void test_linear_matches_matmul_add(void **state) {
  (void)state;
  const int64_t xs[] = {2, 3, 5}, ws[] = {4, 5}, bs[] = {4}, x1[] = {5};
  for (int f64 = 0; f64 < 2; f64++) {
    td_dtype dt = f64 ? TD_DTYPE_F64 : TD_DTYPE_F32;
    double tol = f64 ? 1e-14 : 1e-6;
    td_tensor *x = td_test_randn(xs, 3, dt, 11, false), *w = td_test_randn(ws, 2, dt, 12, false);
    td_tensor *b = td_test_randn(bs, 1, dt, 13, false), *v = td_test_randn(x1, 1, dt, 14, false);
    td_tensor *y, *want;
    TD_ASSERT_OK(td_tensor_linear(x, w, b, &y));
    want = reference(x, w, b);
    td_test_assert_close("linear with bias", y, want, tol, tol);
    td_tensor_unref(y);
    td_tensor_unref(want);
    TD_ASSERT_OK(td_tensor_linear(x, w, NULL, &y));
    want = reference(x, w, NULL);
    td_test_assert_close("linear without bias", y, want, tol, tol);
    td_tensor_unref(y);
    td_tensor_unref(want);
    TD_ASSERT_OK(td_tensor_linear(v, w, b, &y)); /* 1-d input -> [out] */
    assert_int_equal(td_tensor_ndim(y), 1);
    assert_int_equal(td_tensor_size(y, 0), 4);
    want = reference(v, w, b);
    td_test_assert_close("linear of a vector", y, want, tol, tol);
    td_tensor_unref(y);
    td_tensor_unref(want);
    td_tensor *objs[] = {x, w, b, v};
    for (int i = 0; i < 4; i++) td_tensor_unref(objs[i]);
  }
}

static void test_linear_gradcheck(void **state) {
  (void)state;
  const int64_t xs[] = {3, 5}, ws[] = {4, 5}, wts[] = {5, 4}, bs[] = {4}, x3[] = {2, 3, 5};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 21, true);
  td_tensor *xt = td_test_randn((int64_t[]){5, 3}, 2, TD_DTYPE_F64, 22, true);
  td_tensor *xb = td_test_randn(x3, 3, TD_DTYPE_F64, 23, true);
  td_tensor *w = td_test_randn(ws, 2, TD_DTYPE_F64, 24, true);
  td_tensor *wt = td_test_randn(wts, 2, TD_DTYPE_F64, 25, true);
  td_tensor *b = td_test_randn(bs, 1, TD_DTYPE_F64, 26, true);
  lin_ctx c = {true, false, false};
  td_tensor *in1[3] = {x, w, b}, *in2[3] = {xb, w, b}, *in3[3] = {xt, wt, b};
  td_test_gradcheck(lin_fn, &c, in1, 3, 1e-6, 1e-8, 1e-6);
  td_test_gradcheck(lin_fn, &c, in2, 3, 1e-6, 1e-8, 1e-6);
  c.bias = false;
  td_test_gradcheck(lin_fn, &c, in2, 2, 1e-6, 1e-8, 1e-6);
  c = (lin_ctx){true, true, true}; /* strided x and a weight read through its transpose */
  td_test_gradcheck(lin_fn, &c, in3, 3, 1e-6, 1e-8, 1e-6);
  td_tensor *objs[] = {x, xt, xb, w, wt, b};
  for (int i = 0; i < 6; i++) td_tensor_unref(objs[i]);
}

static void test_linear_misuse(void **state) {
  (void)state;
  const int64_t xs[] = {3, 5}, ws[] = {4, 6}, bs[] = {3};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 1, false);
  td_tensor *w = td_test_randn(ws, 2, TD_DTYPE_F64, 2, false);
  td_tensor *b = td_test_randn(bs, 1, TD_DTYPE_F64, 3, false), *xf, *y = NULL;
  TD_ASSERT_STATUS(td_tensor_linear(x, w, NULL, &y), TD_ERR_SHAPE); /* in 5 vs 6 */
  TD_ASSERT_OK(td_tensor_to_dtype(x, TD_DTYPE_F32, &xf));
  TD_ASSERT_STATUS(td_tensor_linear(xf, w, NULL, &y), TD_ERR_DTYPE);
  td_tensor *w5 = td_test_randn((int64_t[]){4, 5}, 2, TD_DTYPE_F64, 4, false);
  TD_ASSERT_STATUS(td_tensor_linear(x, w5, b, &y), TD_ERR_SHAPE); /* bias 3 vs out 4 */
  TD_ASSERT_STATUS(td_tensor_linear(NULL, w5, NULL, &y), TD_ERR_INVALID);
  assert_null(y);
  td_tensor *objs[] = {x, w, b, xf, w5};
  for (int i = 0; i < 5; i++) td_tensor_unref(objs[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_matches_matmul_add),
      cmocka_unit_test(test_linear_gradcheck),
      cmocka_unit_test(test_linear_misuse),
  };
  return cmocka_run_group_tests_name("linear", tests, NULL, NULL);
}
