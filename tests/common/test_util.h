/* test_util.h - helpers shared by the cmocka test programs.
 *
 * Include after <setjmp.h>, <stdarg.h>, <stddef.h> and <cmocka.h> (test_util.h includes them).
 */
#ifndef TD_TEST_UTIL_H
#define TD_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "mp_util.h"
#include "tdist/autograd.h"
#include "tdist/nn.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

/* TD_ASSERT_OK fails the test with the status name and td_last_error() unless expr is TD_OK. */
#define TD_ASSERT_OK(expr)                                                                     \
  do {                                                                                         \
    td_status td_s__ = (expr);                                                                 \
    if (td_s__ != TD_OK)                                                                       \
      fail_msg("%s returned %s: %s", #expr, td_status_name(td_s__), td_last_error());          \
  } while (0)

/* TD_ASSERT_STATUS fails unless expr returns the status want. */
#define TD_ASSERT_STATUS(expr, want)                                                           \
  do {                                                                                         \
    td_status td_s__ = (expr);                                                                 \
    if (td_s__ != (want))                                                                      \
      fail_msg("%s returned %s, expected %s (%s)", #expr, td_status_name(td_s__),              \
               td_status_name(want), td_last_error());                                         \
  } while (0)

/* td_test_fn builds an output tensor from inputs (any shape). Must return a new reference. */
typedef td_status (*td_test_fn)(void *ctx, td_tensor *const *inputs, int n, td_tensor **out);

/* td_test_gradcheck compares the analytic gradient of sum(fn(inputs) * W) (W a fixed random
 * weighting) with central finite differences, for every input that requires grad. Inputs should
 * be float64. Fails the test with the worst element on mismatch: |analytic - numeric| <= atol +
 * rtol * |numeric|. */
void td_test_gradcheck(td_test_fn fn, void *ctx, td_tensor *const *inputs, int n, double eps,
                       double atol, double rtol);

/* td_test_randn returns a new tensor of N(0,1) values from seed. */
td_tensor *td_test_randn(const int64_t *shape, int ndim, td_dtype dt, uint64_t seed,
                         bool requires_grad);
/* td_test_rand returns a new tensor of U[lo,hi) values from seed. */
td_tensor *td_test_rand(const int64_t *shape, int ndim, td_dtype dt, double lo, double hi,
                        uint64_t seed, bool requires_grad);
/* td_test_tensor returns a new CPU tensor holding the given doubles converted to dt. */
td_tensor *td_test_tensor(const double *values, const int64_t *shape, int ndim, td_dtype dt,
                          bool requires_grad);

/* td_test_assert_close fails with the worst element unless a and b have the same shape and
 * |a - b| <= atol + rtol * |b| everywhere. what names the comparison in the message. */
void td_test_assert_close(const char *what, const td_tensor *a, const td_tensor *b, double rtol,
                          double atol);

/* TD_TEST_REQUIRE_CUDA(k) skips the calling test, with a message naming it, unless the machine
 * has at least k CUDA devices (td_cuda_device_count, which never initialises CUDA here: the test
 * may fork CUDA workers afterwards). */
#define TD_TEST_REQUIRE_CUDA(k)                                                               \
  do {                                                                                        \
    int td_n__ = td_cuda_device_count();                                                      \
    if (td_n__ < (k)) {                                                                       \
      print_message("%s: needs %d CUDA device(s), found %d; skipped\n", __func__, (int)(k),   \
                    td_n__);                                                                  \
      skip();                                                                                 \
    }                                                                                         \
  } while (0)

/* td_test_same_bits returns true when a and b have the same dtype, shape and element bits (any
 * strides), false otherwise (also when either is NULL). */
bool td_test_same_bits(const td_tensor *a, const td_tensor *b);

/* td_test_tiny_gpt returns a new GPT (vocabulary 13, context 8, n_layer blocks of 2 heads, width
 * 16) initialised from a generator seeded with seed, converted to dt. Exits the process
 * (MP_CHECK) on failure: usable in workers. */
td_module *td_test_tiny_gpt(td_dtype dt, int n_layer, uint64_t seed);

/* td_test_count_nodes returns how many distinct nodes named name (td_node_name) the backward
 * graph of root reaches (root's grad_fn included). */
int td_test_count_nodes(const td_tensor *root, const char *name);

/* td_test_source_path writes TD_SOURCE_DIR/rel into buf and returns buf. */
const char *td_test_source_path(const char *rel, char *buf, size_t n);

/* TD_MP_RUN runs fn in world worker processes (td_mp_run, bounded by secs, scaled) and fails the
 * test naming the exit codes unless every worker exited 0. */
#define TD_MP_RUN(world, fn, arg, secs)                                                        \
  do {                                                                                         \
    int codes_[64] = {0};                                                                      \
    if ((world) > 64) fail_msg("TD_MP_RUN: at most 64 workers");                               \
    int fails_ = td_mp_run(world, fn, arg, secs, codes_);                                      \
    if (fails_)                                                                                \
      fail_msg("%d of %d workers failed (exit codes %d %d %d %d ...)", fails_, (int)(world),   \
               codes_[0], codes_[1], codes_[2], codes_[3]);                                    \
  } while (0)

#endif
