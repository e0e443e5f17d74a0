/* bench_util.h - helpers shared by the single-process benchmarks (train_step, gpt_gpu,
 * flight_record). Header-only (static functions): every C file under bench/ becomes a program.
 *
 * BENCH_PROG must be defined (the program's name, for messages) before including it.
 *   BENCH_CHECK(expr)    a td_status call that must succeed, else "PROG: expr failed: ..." and exit 1
 *   bench_now_s()        monotonic seconds
 *   bench_arg_int(n, v)  a non-negative integer option value, else "PROG: bad value" and exit 2
 */
#ifndef TD_BENCH_UTIL_H
#define TD_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "tdist/status.h"

#ifndef BENCH_PROG
#error "define BENCH_PROG before including bench_util.h"
#endif

#define BENCH_CHECK(expr)                                                                       \
  do {                                                                                          \
    td_status s_ = (expr);                                                                      \
    if (s_ != TD_OK) {                                                                          \
      fprintf(stderr, BENCH_PROG ": %s failed: %s: %s\n", #expr, td_status_name(s_),            \
              td_last_error());                                                                 \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static inline double bench_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline long long bench_arg_int(const char *name, const char *v) {
  char *end;
  long long x = strtoll(v, &end, 0);
  if (*end || end == v || x < 0) {
    fprintf(stderr, BENCH_PROG ": bad value '%s' for %s\n", v, name);
    exit(2);
  }
  return x;
}

#endif
