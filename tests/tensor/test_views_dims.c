/* test_views_dims.c - unbind, squeeze and unsqueeze: they are views for any layout (no copy of a
 * strided input), their values, and their gradients against finite differences (float64),
 * including unbind slices that are only partly used. */
#include <string.h>

#include "test_util.h"

typedef struct dims_ctx {
  int dim;
  int use; /* unbind: bit k set = slice k contributes to the output */
  bool transpose_first;
} dims_ctx;

/* unbind_fn: sum of (k + 1) * slice_k over the used slices, of t or of its transpose. */
static td_status unbind_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  dims_ctx *c = ctx;
  td_tensor *t = NULL, *parts[8] = {NULL}, *acc = NULL;
  td_status st = TD_OK;
  if (c->transpose_first) st = td_tensor_transpose(in[0], 0, 2, &t);
  else t = td_tensor_ref(in[0]);
  int64_t m = st == TD_OK ? td_tensor_size(t, c->dim) : 0;
  if (st == TD_OK) st = td_tensor_unbind(t, c->dim, parts);
  for (int64_t k = 0; k < m && st == TD_OK; k++) {
    if (!(c->use & (1 << k))) continue;
    td_tensor *w = NULL, *next = NULL;
    st = td_tensor_mul_scalar(parts[k], (double)(k + 1), &w);
    if (st == TD_OK && acc) st = td_tensor_add(acc, w, &next);
    else if (st == TD_OK) next = td_tensor_ref(w);
    td_tensor_unref(w);
    td_tensor_unref(acc);
    acc = next;
  }
  for (int64_t k = 0; k < m; k++) td_tensor_unref(parts[k]);
  td_tensor_unref(t);
  if (st == TD_OK) *out = acc;
  else td_tensor_unref(acc);
  return st;
}

static void test_unbind_values_and_views(void **state) {
  (void)state;
  const int64_t s[] = {2, 3, 4};
  td_tensor *x = td_test_randn(s, 3, TD_DTYPE_F64, 3, false), *xt, *parts[4];
  TD_ASSERT_OK(td_tensor_transpose(x, 0, 2, &xt)); /* [4, 3, 2], strided */
  TD_ASSERT_OK(td_tensor_unbind(xt, -1, parts));
  for (int k = 0; k < 2; k++) {
    assert_int_equal(td_tensor_ndim(parts[k]), 2);
    assert_int_equal(td_tensor_size(parts[k], 0), 4);
    assert_int_equal(td_tensor_size(parts[k], 1), 3);
    /* a view into x: element [i, j] of slice k is x[k, j, i] */
    assert_ptr_equal(td_tensor_data(parts[k]), (double *)td_tensor_data(x) + k * 12);
    for (int64_t i = 0; i < 4; i++)
      for (int64_t j = 0; j < 3; j++) {
        int64_t a[2] = {i, j}, b[3] = {k, j, i};
        double u, v;
        TD_ASSERT_OK(td_tensor_get(parts[k], a, &u));
        TD_ASSERT_OK(td_tensor_get(x, b, &v));
        assert_true(u == v);
      }
    td_tensor_unref(parts[k]);
  }
  TD_ASSERT_STATUS(td_tensor_unbind(x, 3, parts), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_unbind(NULL, 0, parts), TD_ERR_INVALID);
  td_tensor_unref(xt);
  td_tensor_unref(x);
}

static void test_unbind_gradcheck(void **state) {
  (void)state;
  const int64_t s[] = {3, 2, 4};
  td_tensor *x = td_test_randn(s, 3, TD_DTYPE_F64, 4, true);
  for (int dim = 0; dim < 3; dim++) {
    dims_ctx c = {dim, 0xff, false};
    td_test_gradcheck(unbind_fn, &c, &x, 1, 1e-6, 1e-8, 1e-6);
    c.use = 0x5; /* slices 0 and 2 only (dim 1 has two: slice 0 only): zeros for the rest */
    td_test_gradcheck(unbind_fn, &c, &x, 1, 1e-6, 1e-8, 1e-6);
    c.transpose_first = true;
    td_test_gradcheck(unbind_fn, &c, &x, 1, 1e-6, 1e-8, 1e-6);
  }
  td_tensor_unref(x);
}

typedef struct sq_ctx {
  int dim;
} sq_ctx;

/* squeeze_fn: unsqueeze at dim, transpose so the tensor is strided, squeeze it back, square. */
static td_status squeeze_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  sq_ctx *c = ctx;
  td_tensor *t = NULL, *u = NULL, *v = NULL, *w = NULL;
  td_status st = td_tensor_transpose(in[0], 0, 1, &t);
  if (st == TD_OK) st = td_tensor_unsqueeze(t, c->dim, &u);
  if (st == TD_OK) st = td_tensor_squeeze(u, c->dim, &v);
  if (st == TD_OK) st = td_tensor_mul(v, v, &w);
  td_tensor_unref(t);
  td_tensor_unref(u);
  td_tensor_unref(v);
  if (st == TD_OK) *out = w;
  return st;
}

static void test_squeeze_unsqueeze_are_views(void **state) {
  (void)state;
  const int64_t s[] = {3, 4};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F64, 5, true), *t, *u, *v;
  TD_ASSERT_OK(td_tensor_transpose(x, 0, 1, &t));
  for (int dim = -3; dim <= 2; dim++) {
    TD_ASSERT_OK(td_tensor_unsqueeze(t, dim, &u));
    assert_int_equal(td_tensor_ndim(u), 3);
    assert_ptr_equal(td_tensor_data(u), td_tensor_data(x)); /* no copy */
    int d = dim < 0 ? dim + 3 : dim;
    assert_int_equal(td_tensor_size(u, d), 1);
    TD_ASSERT_OK(td_tensor_squeeze(u, d, &v));
    assert_ptr_equal(td_tensor_data(v), td_tensor_data(x));
    td_test_assert_close("squeeze(unsqueeze(t))", v, t, 0, 0);
    td_tensor_unref(u);
    td_tensor_unref(v);
    sq_ctx c = {d};
    td_test_gradcheck(squeeze_fn, &c, &x, 1, 1e-6, 1e-8, 1e-6);
  }
  TD_ASSERT_STATUS(td_tensor_squeeze(t, 0, &v), TD_ERR_INVALID); /* size 4, not 1 */
  TD_ASSERT_STATUS(td_tensor_unsqueeze(t, 3, &v), TD_ERR_INVALID);
  td_tensor_unref(t);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_unbind_values_and_views),
      cmocka_unit_test(test_unbind_gradcheck),
      cmocka_unit_test(test_squeeze_unsqueeze_are_views),
  };
  return cmocka_run_group_tests_name("views_dims", tests, NULL, NULL);
}
