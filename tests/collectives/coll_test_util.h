/* coll_test_util.h - helpers shared by the collectives tests: agent options, clocks, exact
 * comparisons, leak checks before _exit. */
#ifndef TD_COLL_TEST_UTIL_H
#define TD_COLL_TEST_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "mp_util.h"
#include "tdist/collectives.h"
#include "tdist/rpc.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define CHECK_NO_LEAKS() MP_CHECK(__lsan_do_recoverable_leak_check() == 0)
#else
#define CHECK_NO_LEAKS() ((void)0)
#endif

static inline td_rpc_options coll_opts(const char *init_method) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = init_method;
  o.num_worker_threads = 2;
  o.init_timeout_ms = 30000;
  o.rpc_timeout_ms = 30000;
  return o;
}

/* Joins the RPC group as rank of world (exits the child on failure). */
static inline td_rpc_agent *coll_join(int rank, int world, const char *method) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a = NULL;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

/* Shuts the agent down gracefully, frees it and checks for leaks. */
static inline void coll_leave(td_rpc_agent *a) {
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
}

static inline double coll_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double coll_scale(void) {
  const char *s = getenv("TD_TEST_TIMEOUT_SCALE");
  double v = s ? atof(s) : 1.0;
  return v > 0 ? v : 1.0;
}

/* Element i of a tensor of n doubles, converted to dt. */
static inline td_tensor *coll_tensor(const double *v, int64_t n, td_dtype dt) {
  td_tensor *t = NULL;
  if (dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16) { /* through float64: rounded to nearest */
    td_tensor *d = coll_tensor(v, n, TD_DTYPE_F64);
    MP_CHECK_OK(td_tensor_to_dtype(d, dt, &t));
    td_tensor_unref(d);
    return t;
  }
  MP_CHECK_OK(td_tensor_empty(&n, 1, dt, td_device_cpu(), &t));
  for (int64_t i = 0; i < n; i++) {
    if (dt == TD_DTYPE_F32) ((float *)td_tensor_data(t))[i] = (float)v[i];
    else if (dt == TD_DTYPE_F64) ((double *)td_tensor_data(t))[i] = v[i];
    else ((int64_t *)td_tensor_data(t))[i] = (int64_t)v[i];
  }
  return t;
}

/* Element i (row-major) of a contiguous tensor of any shape, as a double. */
static inline double coll_elem(const td_tensor *t, int64_t i) {
  const void *p = td_tensor_data(t);
  switch (td_tensor_dtype(t)) {
    case TD_DTYPE_F32: return (double)((const float *)p)[i];
    case TD_DTYPE_F64: return ((const double *)p)[i];
    case TD_DTYPE_BF16: {
      uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
      float f;
      memcpy(&f, &b, sizeof f);
      return (double)f;
    }
    default: return (double)((const int64_t *)p)[i];
  }
}

/* Exact (bitwise) comparison of a tensor with expected values; prints the first mismatch. */
static inline bool coll_equal(const char *what, const td_tensor *t, const td_tensor *want) {
  size_t nb = td_tensor_nbytes(want);
  if (td_tensor_dtype(t) != td_tensor_dtype(want) || td_tensor_nbytes(t) != nb) {
    fprintf(stderr, "[pid %d] %s: dtype or size differs\n", (int)getpid(), what);
    return false;
  }
  if (nb == 0 || memcmp(td_tensor_data(t), td_tensor_data(want), nb) == 0) return true;
  int64_t n = td_tensor_numel(want);
  for (int64_t i = 0; i < n; i++) {
    double a = coll_elem(t, i), b = coll_elem(want, i);
    if (memcmp(&a, &b, sizeof a) != 0) {
      fprintf(stderr, "[pid %d] %s: element %lld is %.17g, expected %.17g (of %lld)\n",
              (int)getpid(), what, (long long)i, a, b, (long long)n);
      break;
    }
  }
  return false;
}

#endif
