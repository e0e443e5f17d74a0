/* test_numerics.c - numerics that must agree between the CPU backend, the CUDA backend and
 * PyTorch, checked against values computed here in long double: log_softmax of large logits,
 * long same-sign float32 sums (sum and softmax over a long dim), max / arg-max / softmax with NaN
 * and infinities, float -> int64 conversion of NaN, infinities and out-of-range values, and
 * copies between overlapping views of one tensor.
 *
 * Built twice from this file: test_numerics runs every case on the CPU (label unit);
 * test_numerics_cuda (TD_NUMERICS_CUDA, label gpu) runs the same cases on cuda:0 at sizes that
 * reach the GPU kernels' long paths, plus grids of more than 2^31 and 2^32 rows, and exits 77
 * (skipped) without a device. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static td_device dev;
static bool on_gpu;

#define require_device()                 \
  do {                                   \
    if (on_gpu) TD_TEST_REQUIRE_CUDA(1); \
  } while (0)

/* A tensor of shape from values (doubles converted to dt) on the test's device. */
static td_tensor *make(const double *v, const int64_t *shape, int ndim, td_dtype dt) {
  td_tensor *c = td_test_tensor(v, shape, ndim, dt, false), *d = NULL;
  TD_ASSERT_OK(td_tensor_to(c, dev, &d));
  td_tensor_unref(c);
  return d;
}

/* The values of t (any device) as doubles; free() the result. */
static double *values(const td_tensor *t) {
  td_tensor *h = NULL, *f = NULL;
  TD_ASSERT_OK(td_tensor_to(t, td_device_cpu(), &h));
  TD_ASSERT_OK(td_tensor_to_dtype(h, TD_DTYPE_F64, &f));
  int64_t n = td_tensor_numel(f);
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  TD_ASSERT_OK(td_tensor_copy_to_buffer(f, v, (size_t)n * sizeof *v));
  td_tensor_unref(h);
  td_tensor_unref(f);
  return v;
}

/* Fails unless every element of got matches want: NaN where want is NaN, equal infinities, else
 * |got - want| <= atol + rtol * |want|. */
static void expect(const char *what, const td_tensor *got, const double *want, int64_t n,
                   double rtol, double atol) {
  assert_int_equal(td_tensor_numel(got), n);
  double *g = values(got);
  for (int64_t i = 0; i < n; i++) {
    bool ok = isnan(want[i]) ? isnan(g[i])
              : isinf(want[i]) ? g[i] == want[i]
                               : fabs(g[i] - want[i]) <= atol + rtol * fabs(want[i]);
    if (!ok) {
      double gi = g[i];
      free(g);
      fail_msg("%s: element %lld is %.17g, expected %.17g", what, (long long)i, gi, want[i]);
    }
  }
  free(g);
}

/* (x - max) - log(sum exp(x - max)) over rows of length r, in long double. */
static void ref_log_softmax(const double *x, int64_t rows, int64_t r, double *out) {
  for (int64_t o = 0; o < rows; o++) {
    const double *xr = x + o * r;
    long double mx = xr[0], s = 0;
    for (int64_t k = 1; k < r; k++) mx = xr[k] > mx ? xr[k] : mx;
    for (int64_t k = 0; k < r; k++) s += expl((long double)xr[k] - mx);
    for (int64_t k = 0; k < r; k++) out[o * r + k] = (double)(((long double)xr[k] - mx) - logl(s));
  }
}

/* Transposes a [rows, cols] array. */
static double *transposed(const double *x, int64_t rows, int64_t cols) {
  double *t = malloc((size_t)(rows * cols) * sizeof *t);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) t[j * rows + i] = x[i * cols + j];
  return t;
}

/* Checks log_softmax of rows of x both along the last dim (block-per-row kernels) and along dim
 * 0 of the transposed tensor (thread-per-column kernels). */
static void check_log_softmax(const char *what, const double *x, int64_t rows, int64_t r,
                              td_dtype dt, double tol) {
  double *want = malloc((size_t)(rows * r) * sizeof *want);
  ref_log_softmax(x, rows, r, want);
  int64_t shape[2] = {rows, r}, tshape[2] = {r, rows};
  td_tensor *t = make(x, shape, 2, dt), *y = NULL;
  TD_ASSERT_OK(td_tensor_log_softmax(t, 1, &y));
  expect(what, y, want, rows * r, 0, tol);
  td_tensor_unref(t);
  td_tensor_unref(y);
  double *xt = transposed(x, rows, r), *wt = transposed(want, rows, r);
  t = make(xt, tshape, 2, dt);
  TD_ASSERT_OK(td_tensor_log_softmax(t, 0, &y));
  expect(what, y, wt, rows * r, 0, tol);
  td_tensor_unref(t);
  td_tensor_unref(y);
  free(xt);
  free(wt);
  free(want);
}

/* ---- large logits ---- */

/* float32 logits near 1e5: ulp(1e5) is 0.0078, which x - (max + log(sum)) in float would add to
 * every log-probability. */
static void test_log_softmax_large_logits_f32(void **state) {
  (void)state;
  require_device();
  int64_t rows = 3, r = 300;
  double *x = malloc((size_t)(rows * r) * sizeof *x);
  for (int64_t i = 0; i < rows * r; i++) x[i] = 1e5 * (double)(1 + i / r) + (double)(i % 13) - 6;
  check_log_softmax("log_softmax f32 logits ~1e5", x, rows, r, TD_DTYPE_F32, 1e-5);
  free(x);
}

/* float64 logits near 1e15: ulp(1e15) is 0.125. */
static void test_log_softmax_large_logits_f64(void **state) {
  (void)state;
  require_device();
  int64_t rows = 2, r = 100;
  double x[200];
  for (int64_t i = 0; i < rows * r; i++) x[i] = 1e15 + (double)(i % 7) - 3 * (double)(i % 2);
  check_log_softmax("log_softmax f64 logits ~1e15", x, rows, r, TD_DTYPE_F64, 1e-12);
}

/* ---- long same-sign float32 sums ---- */

/* A column of R copies of 0.1f summed: exact R * 0.1f, rounded once. A float running sum of
 * 4096 of them is off by 4e-5 relative. On the GPU, 131072 columns make one thread add a whole
 * column. */
static void test_sum_long_same_sign_f32(void **state) {
  (void)state;
  require_device();
  int64_t rr = 4096, cols = on_gpu ? 131072 : 64, shape[2] = {rr, cols};
  td_tensor *t = NULL, *s = NULL, *tt = NULL, *st = NULL, *tc = NULL;
  TD_ASSERT_OK(td_tensor_full(shape, 2, 0.1, TD_DTYPE_F32, dev, &t));
  int dim0 = 0, dim1 = 1;
  TD_ASSERT_OK(td_tensor_sum(t, &dim0, 1, false, &s));
  double want1 = (double)(float)((double)rr * (double)0.1f);
  double *want = malloc((size_t)cols * sizeof *want);
  for (int64_t i = 0; i < cols; i++) want[i] = want1;
  expect("sum over 4096 rows", s, want, cols, 2.5e-7, 0);
  /* along rows: [cols, R] summed over dim 1 */
  TD_ASSERT_OK(td_tensor_transpose(t, 0, 1, &tt));
  TD_ASSERT_OK(td_tensor_contiguous(tt, &tc));
  TD_ASSERT_OK(td_tensor_sum(tc, &dim1, 1, false, &st));
  expect("sum along rows of 4096", st, want, cols, 2.5e-7, 0);
  free(want);
  td_tensor_unref(t);
  td_tensor_unref(s);
  td_tensor_unref(tt);
  td_tensor_unref(tc);
  td_tensor_unref(st);
}

/* softmax over a long dim 0: the denominator 1 + 4095 * exp(log 0.1) must not drift. */
static void test_softmax_long_dim_f32(void **state) {
  (void)state;
  require_device();
  int64_t rr = 4096, cols = on_gpu ? 131072 : 64, shape[2] = {rr, cols};
  float lo = (float)log(0.1);
  td_tensor *t = NULL, *first = NULL, *y = NULL, *y0 = NULL;
  TD_ASSERT_OK(td_tensor_full(shape, 2, lo, TD_DTYPE_F32, dev, &t));
  TD_ASSERT_OK(td_tensor_narrow(t, 0, 0, 1, &first));
  TD_ASSERT_OK(td_tensor_fill_(first, 0.0));
  TD_ASSERT_OK(td_tensor_softmax(t, 0, &y));
  TD_ASSERT_OK(td_tensor_narrow(y, 0, 0, 1, &y0));
  double e = exp((double)lo), p0 = 1.0 / (1.0 + (double)(rr - 1) * e);
  double *want = malloc((size_t)cols * sizeof *want);
  for (int64_t i = 0; i < cols; i++) want[i] = p0;
  expect("softmax over 4096 rows, first row", y0, want, cols, 1e-6, 0);
  free(want);
  td_tensor_unref(t);
  td_tensor_unref(first);
  td_tensor_unref(y);
  td_tensor_unref(y0);
}

/* ---- NaN and infinities ---- */

static void check_max(const char *what, const double *x, int64_t rows, int64_t r, td_dtype dt,
                      const double *want_v, const double *want_i) {
  int64_t shape[2] = {rows, r}, tshape[2] = {r, rows};
  for (int layout = 0; layout < 2; layout++) {
    double *xt = layout ? transposed(x, rows, r) : NULL;
    td_tensor *t = layout ? make(xt, tshape, 2, dt) : make(x, shape, 2, dt), *v = NULL, *i = NULL;
    TD_ASSERT_OK(td_tensor_max(t, layout ? 0 : 1, false, &v, &i));
    expect(what, v, want_v, rows, 0, 0);
    expect(what, i, want_i, rows, 0, 0);
    td_tensor_unref(t);
    td_tensor_unref(v);
    td_tensor_unref(i);
    free(xt);
  }
}

static void test_max_nan_inf(void **state) {
  (void)state;
  require_device();
  int64_t rows = 3, r = 100; /* r > 64: the GPU's block-per-row path */
  double x[300];
  for (int64_t k = 0; k < r; k++) {
    x[k] = (double)k;
    x[r + k] = -INFINITY;
    x[2 * r + k] = -1e300;
  }
  x[70] = NAN;
  x[90] = NAN;     /* NaN wins, first occurrence */
  x[r + 10] = INFINITY;
  x[2 * r + 99] = -INFINITY;
  double want_v[3] = {NAN, INFINITY, -1e300}, want_i[3] = {70, 10, 0};
  check_max("max f64 with NaN and inf", x, rows, r, TD_DTYPE_F64, want_v, want_i);
  want_v[2] = -INFINITY; /* -1e300 is -inf in float32: first occurrence */
  check_max("max f32 with NaN and inf", x, rows, r, TD_DTYPE_F32, want_v, want_i);
}

/* int64 extremes are compared exactly (they do not all fit a double). */
static void test_max_int64_extremes(void **state) {
  (void)state;
  require_device();
  int64_t v[3] = {INT64_MIN, INT64_MAX - 1, INT64_MAX}, shape[1] = {3};
  td_tensor *h = NULL, *t = NULL, *m = NULL, *i = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(v, shape, 1, TD_DTYPE_I64, &h));
  TD_ASSERT_OK(td_tensor_to(h, dev, &t));
  TD_ASSERT_OK(td_tensor_max(t, 0, false, &m, &i));
  int64_t got = 0, gi = -1;
  TD_ASSERT_OK(td_tensor_copy_to_buffer(m, &got, sizeof got));
  TD_ASSERT_OK(td_tensor_copy_to_buffer(i, &gi, sizeof gi));
  assert_true(got == INT64_MAX);
  assert_int_equal(gi, 2);
  td_tensor_unref(h);
  td_tensor_unref(t);
  td_tensor_unref(m);
  td_tensor_unref(i);
}

/* PyTorch 1.13: softmax([inf, 1]) = [nan, nan]; all -inf gives nan; [-inf, 1] gives [0, 1]
 * (log: [-inf, 0]); a NaN makes the whole row NaN. */
static void test_softmax_nan_inf_like_pytorch(void **state) {
  (void)state;
  require_device();
  const double x[8] = {INFINITY, 1, -INFINITY, -INFINITY, -INFINITY, 1, NAN, 1};
  const double sm[8] = {NAN, NAN, NAN, NAN, 0, 1, NAN, NAN};
  const double lsm[8] = {NAN, NAN, NAN, NAN, -INFINITY, 0, NAN, NAN};
  int64_t shape[2] = {4, 2}, tshape[2] = {2, 4};
  double *xt = transposed(x, 4, 2), *smt = transposed(sm, 4, 2), *lsmt = transposed(lsm, 4, 2);
  for (int dt = 0; dt < 2; dt++) {
    for (int layout = 0; layout < 2; layout++) {
      td_tensor *t = layout ? make(xt, tshape, 2, (td_dtype)dt) : make(x, shape, 2, (td_dtype)dt);
      td_tensor *y = NULL, *ly = NULL;
      TD_ASSERT_OK(td_tensor_softmax(t, layout ? 0 : 1, &y));
      TD_ASSERT_OK(td_tensor_log_softmax(t, layout ? 0 : 1, &ly));
      expect("softmax with NaN/inf", y, layout ? smt : sm, 8, 0, 0);
      expect("log_softmax with NaN/inf", ly, layout ? lsmt : lsm, 8, 0, 0);
      td_tensor_unref(t);
      td_tensor_unref(y);
      td_tensor_unref(ly);
    }
  }
  free(xt);
  free(smt);
  free(lsmt);
}

/* ---- float -> int64 ---- */

/* Truncation toward zero; NaN, infinities and values outside int64 give INT64_MIN (PyTorch on
 * the CPU), on every device. */
static void test_float_to_int64(void **state) {
  (void)state;
  require_device();
  const double x[9] = {NAN, INFINITY, -INFINITY, 1e30, -1e30, 3.7, -3.7, 9.2e18, -9.3e18};
  const int64_t want[9] = {INT64_MIN, INT64_MIN, INT64_MIN, INT64_MIN, INT64_MIN, 3, -3,
                           (int64_t)9.2e18, INT64_MIN};
  int64_t shape[1] = {9}, got[9];
  for (int dt = 0; dt < 2; dt++) {
    td_tensor *t = make(x, shape, 1, (td_dtype)dt), *i = NULL;
    TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_I64, &i));
    TD_ASSERT_OK(td_tensor_copy_to_buffer(i, got, sizeof got));
    for (int k = 0; k < 9; k++)
      if (dt == 1 || k != 7) assert_true(got[k] == want[k]); /* 9.2e18 is not a float32 */
    /* strided: elements 0, 2, 4, 6 (a column of [4, 2]), through copy_ into int64 */
    td_tensor *eight = NULL, *pairs = NULL, *view = NULL, *dst = NULL;
    int64_t shape42[2] = {4, 2}, shape41[2] = {4, 1};
    TD_ASSERT_OK(td_tensor_narrow(t, 0, 0, 8, &eight));
    TD_ASSERT_OK(td_tensor_reshape(eight, shape42, 2, &pairs));
    TD_ASSERT_OK(td_tensor_narrow(pairs, 1, 0, 1, &view));
    TD_ASSERT_OK(td_tensor_zeros(shape41, 2, TD_DTYPE_I64, dev, &dst));
    TD_ASSERT_OK(td_tensor_copy_(dst, view));
    TD_ASSERT_OK(td_tensor_copy_to_buffer(dst, got, 4 * sizeof *got));
    for (int k = 0; k < 4; k++) assert_true(got[k] == want[2 * k]);
    td_tensor_unref(t);
    td_tensor_unref(i);
    td_tensor_unref(eight);
    td_tensor_unref(pairs);
    td_tensor_unref(view);
    td_tensor_unref(dst);
  }
  td_tensor *f = NULL;
  TD_ASSERT_OK(td_tensor_full(shape, 1, NAN, TD_DTYPE_I64, dev, &f));
  TD_ASSERT_OK(td_tensor_copy_to_buffer(f, got, sizeof got));
  for (int k = 0; k < 9; k++) assert_true(got[k] == INT64_MIN);
  td_tensor_unref(f);
}

/* ---- overlapping copies ---- */

static td_tensor *arange_on(int64_t n, td_dtype dt) {
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_arange(0, (double)n, 1, dt, dev, &t));
  return t;
}

static void shift_copy(td_tensor *x, int64_t n, int64_t dst_start, int64_t src_start,
                       const double *want) {
  td_tensor *d = NULL, *s = NULL;
  TD_ASSERT_OK(td_tensor_narrow(x, 0, dst_start, n - 1, &d));
  TD_ASSERT_OK(td_tensor_narrow(x, 0, src_start, n - 1, &s));
  TD_ASSERT_OK(td_tensor_copy_(d, s));
  expect("overlapping shift", x, want, n, 0, 0);
  td_tensor_unref(d);
  td_tensor_unref(s);
}

/* The result is as if the source were read completely first. */
static void test_copy_overlapping_views(void **state) {
  (void)state;
  require_device();
  for (int dt = 0; dt < 3; dt++) {
    td_tensor *x = arange_on(6, (td_dtype)dt);
    shift_copy(x, 6, 1, 0, (const double[]){0, 0, 1, 2, 3, 4}); /* x[1:] = x[:-1] */
    td_tensor_unref(x);
    x = arange_on(6, (td_dtype)dt);
    shift_copy(x, 6, 0, 1, (const double[]){1, 2, 3, 4, 5, 5}); /* x[:-1] = x[1:] */
    td_tensor_unref(x);
  }
  /* in-place transpose of a square matrix, and a strided shift of its columns */
  int64_t sq[2] = {4, 4};
  td_tensor *a = arange_on(16, TD_DTYPE_F32), *m = NULL, *mt = NULL;
  TD_ASSERT_OK(td_tensor_reshape(a, sq, 2, &m));
  TD_ASSERT_OK(td_tensor_transpose(m, 0, 1, &mt));
  TD_ASSERT_OK(td_tensor_copy_(m, mt));
  double want[16];
  for (int i = 0; i < 16; i++) want[i] = (double)((i % 4) * 4 + i / 4);
  expect("in-place transpose", m, want, 16, 0, 0);
  td_tensor *cols_d = NULL, *cols_s = NULL;
  TD_ASSERT_OK(td_tensor_narrow(m, 1, 1, 3, &cols_d));
  TD_ASSERT_OK(td_tensor_narrow(m, 1, 0, 3, &cols_s));
  TD_ASSERT_OK(td_tensor_copy_(cols_d, cols_s)); /* m[:, 1:] = m[:, :-1] */
  for (int i = 0; i < 4; i++) {
    double row[4] = {want[i * 4], want[i * 4], want[i * 4 + 1], want[i * 4 + 2]};
    memcpy(want + i * 4, row, sizeof row);
  }
  expect("strided overlapping shift", m, want, 16, 0, 0);
  /* a view copied onto itself is left alone */
  TD_ASSERT_OK(td_tensor_copy_(m, m));
  expect("self copy", m, want, 16, 0, 0);
  /* a destination whose elements share memory is refused */
  td_tensor *one = NULL, *wide = NULL;
  TD_ASSERT_OK(td_tensor_narrow(a, 0, 0, 1, &one));
  TD_ASSERT_OK(td_tensor_expand(one, (int64_t[]){5}, 1, &wide));
  td_tensor *src5 = arange_on(5, TD_DTYPE_F32);
  TD_ASSERT_STATUS(td_tensor_copy_(wide, src5), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "share one memory location"));
  td_tensor_unref(src5);
  td_tensor_unref(one);
  td_tensor_unref(wide);
  td_tensor_unref(cols_d);
  td_tensor_unref(cols_s);
  td_tensor_unref(a);
  td_tensor_unref(m);
  td_tensor_unref(mt);
}

/* ---- more rows than a grid holds (GPU) ---- */

/* Skips the test when st says the device lacks the memory; fails on other errors. */
#define OK_OR_SKIP_NOMEM(st)                                                      \
  do {                                                                            \
    td_status st_ = (st);                                                         \
    if (st_ == TD_ERR_NOMEM) {                                                    \
      print_message("not enough device memory (%s); skipped\n", td_last_error()); \
      skip();                                                                     \
    }                                                                             \
    TD_ASSERT_OK(st_);                                                            \
  } while (0)

/* Allocates shape on the device filled with value, or skips the test when the device lacks the
 * memory. */
static td_tensor *big_full(const int64_t *shape, int ndim, double value) {
  td_tensor *t = NULL;
  OK_OR_SKIP_NOMEM(td_tensor_full(shape, ndim, value, TD_DTYPE_F32, dev, &t));
  return t;
}

/* Expects value in the first and last k elements of 1-d-viewable t and around element mid. */
static void expect_edges(const char *what, td_tensor *t, int64_t mid, double value) {
  int64_t n = td_tensor_numel(t), k = 1024, all = -1;
  td_tensor *flat = NULL;
  TD_ASSERT_OK(td_tensor_reshape(t, &all, 1, &flat));
  int64_t m0 = mid - k / 2;
  if (m0 > n - k) m0 = n - k; /* mid near the end (a row of one element) */
  if (m0 < 0) m0 = 0;
  int64_t starts[3] = {0, m0, n - k};
  double *want = malloc((size_t)k * sizeof *want);
  for (int64_t i = 0; i < k; i++) want[i] = value;
  for (int s = 0; s < 3; s++) {
    td_tensor *part = NULL;
    TD_ASSERT_OK(td_tensor_narrow(flat, 0, starts[s], k, &part));
    expect(what, part, want, k, 0, 0);
    td_tensor_unref(part);
  }
  free(want);
  td_tensor_unref(flat);
}

static void test_rows_beyond_32_bits(void **state) {
  (void)state;
  if (!on_gpu) skip(); /* tens of GiB: only the GPU kernels have grid limits */
  require_device();
  /* softmax over 2^32 + 1024 rows of one element: every output is 1 */
  int64_t rows = ((int64_t)1 << 32) + 1024, shape[2] = {rows, 1};
  td_tensor *x = big_full(shape, 2, 0.5), *y = NULL;
  td_status st = td_tensor_softmax(x, 1, &y);
  td_tensor_unref(x);
  OK_OR_SKIP_NOMEM(st);
  expect_edges("softmax over 2^32 + 1024 rows", y, (int64_t)1 << 32, 1.0);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_cuda_empty_cache());
  /* layer norm over 2^31 + 7 rows of one element with bias 3: every output is 3 */
  int64_t lrows = ((int64_t)1 << 31) + 7, lshape[2] = {lrows, 1}, one = 1;
  td_tensor *lx = big_full(lshape, 2, 2.0), *b = NULL, *ly = NULL;
  TD_ASSERT_OK(td_tensor_full(&one, 1, 3.0, TD_DTYPE_F32, dev, &b));
  st = td_tensor_layer_norm(lx, 1, NULL, b, 1e-5, &ly);
  td_tensor_unref(lx);
  td_tensor_unref(b);
  OK_OR_SKIP_NOMEM(st);
  expect_edges("layer_norm over 2^31 + 7 rows", ly, (int64_t)1 << 31, 3.0);
  td_tensor_unref(ly);
  TD_ASSERT_OK(td_cuda_empty_cache());
}

int main(void) {
#ifdef TD_NUMERICS_CUDA
  on_gpu = true;
  dev = td_device_cuda(0);
  const char *name = "numerics_cuda";
#else
  dev = td_device_cpu();
  const char *name = "numerics_cpu";
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_log_softmax_large_logits_f32),
      cmocka_unit_test(test_log_softmax_large_logits_f64),
      cmocka_unit_test(test_sum_long_same_sign_f32),
      cmocka_unit_test(test_softmax_long_dim_f32),
      cmocka_unit_test(test_max_nan_inf),
      cmocka_unit_test(test_max_int64_extremes),
      cmocka_unit_test(test_softmax_nan_inf_like_pytorch),
      cmocka_unit_test(test_float_to_int64),
      cmocka_unit_test(test_copy_overlapping_views),
      cmocka_unit_test(test_rows_beyond_32_bits),
  };
  int failed = cmocka_run_group_tests_name(name, tests, NULL, NULL);
  if (failed) return 1;
  return on_gpu && td_cuda_device_count() == 0 ? 77 : 0;
}
