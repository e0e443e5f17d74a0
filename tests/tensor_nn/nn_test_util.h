/* nn_test_util.h - small helpers shared by the tensor_nn test programs (header-only).
 *
 * Reference numbers in these tests come from PyTorch 1.13 (torch.nn.functional in float64) run
 * on the same inputs; the inputs are either literal or built with nn_formula(), whose values are
 * exact binary fractions so the C and Python sides see identical numbers. The script is
 * reproduced in the comment at the top of each test file that uses such numbers.
 */
#ifndef TD_TESTS_NN_TEST_UTIL_H
#define TD_TESTS_NN_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* nn_formula returns a new CPU tensor with element i = ((i * a) % m) * s + o, the same as the
 * Python helper `formula(n, a, m, s, o)` used to produce the reference numbers. */
static inline td_tensor *nn_formula(const int64_t *shape, int ndim, int64_t a, int64_t m,
                                    double s, double o, td_dtype dt, bool requires_grad) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  double *v = malloc((size_t)(n ? n : 1) * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = (double)((i * a) % m) * s + o;
  td_tensor *t = td_test_tensor(v, shape, ndim, dt, requires_grad);
  free(v);
  return t;
}

/* nn_f64 returns a new float64 CPU tensor holding values. */
static inline td_tensor *nn_f64(const double *values, const int64_t *shape, int ndim,
                                bool requires_grad) {
  return td_test_tensor(values, shape, ndim, TD_DTYPE_F64, requires_grad);
}

/* nn_i64 returns a new int64 CPU tensor holding values. */
static inline td_tensor *nn_i64(const int64_t *values, const int64_t *shape, int ndim) {
  td_tensor *t;
  TD_ASSERT_OK(td_tensor_from_buffer(values, shape, ndim, TD_DTYPE_I64, &t));
  return t;
}

/* nn_expect fails unless got has got's shape filled with the n doubles of want (row-major) up to
 * tol (absolute and relative). */
static inline void nn_expect(const char *what, const td_tensor *got, const double *want,
                             int64_t n, double tol) {
  assert_int_equal(td_tensor_numel(got), n);
  td_tensor *w = td_test_tensor(want, td_tensor_shape(got), td_tensor_ndim(got), TD_DTYPE_F64,
                                false);
  td_test_assert_close(what, got, w, tol, tol);
  td_tensor_unref(w);
}

/* nn_expect_shape fails unless t has the given shape. */
static inline void nn_expect_shape(const td_tensor *t, const int64_t *shape, int ndim) {
  char buf[96];
  if (td_tensor_ndim(t) != ndim)
    fail_msg("expected %d dims, got %s", ndim, td_tensor_shape_str(t, buf, sizeof buf));
  for (int i = 0; i < ndim; i++)
    if (td_tensor_shape(t)[i] != shape[i])
      fail_msg("dim %d: expected %lld, got %s", i, (long long)shape[i],
               td_tensor_shape_str(t, buf, sizeof buf));
}

/* nn_expect_error fails unless td_last_error() contains each of the given fragments. */
static inline void nn_expect_error(const char *a, const char *b) {
  const char *e = td_last_error();
  if (a && !strstr(e, a)) fail_msg("error \"%s\" does not mention \"%s\"", e, a);
  if (b && !strstr(e, b)) fail_msg("error \"%s\" does not mention \"%s\"", e, b);
}

/* nn_item returns the value of a one-element tensor. */
static inline double nn_item(const td_tensor *t) {
  double v;
  TD_ASSERT_OK(td_tensor_item(t, &v));
  return v;
}

#endif
