/* ft_test_util.h - what the fault-tolerance tests (test_ft_ddp, test_ft_zero) share: the injected
 * fault, the model (6 -> 16 -> tanh -> 3, float64, seeded), the data of a shard (drawn from the
 * step and the shard alone, so any member may compute any shard), and the files through which
 * the workers report to the test (start.<rank>: one pid line per start; report.<rank>;
 * params.<rank>). */
#ifndef TD_FT_TEST_UTIL_H
#define TD_FT_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

#define FT_SHARD_ROWS 6

/* One injected fault: what happens to rank at step, at which point of the step. */
typedef struct fault {
  int rank;
  int64_t step;
  td_ft_when when;
  td_ft_what what;
} fault;

#define KILL(r, s, w) {r, s, w, TD_FT_KILL}
#define CLOSE(r, s, w) {r, s, w, TD_FT_CLOSE}

/* True when one of the nf faults ends rank r's process (a close leaves it running). */
static inline bool ft_victim(const fault *f, int nf, int r) {
  for (int i = 0; i < nf; i++)
    if (f[i].rank == r && f[i].what != TD_FT_CLOSE) return true;
  return false;
}

static inline td_module *ft_build(void) {
  MP_CHECK_OK(td_nn_manual_seed(7));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(6, 16, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_linear_create(16, 3, true, NULL, &l2));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  MP_CHECK_OK(td_sequential_append(seq, l2));
  td_module_unref(l1);
  td_module_unref(act);
  td_module_unref(l2);
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

/* Shard s of step k: FT_SHARD_ROWS samples drawn from (k, s) alone; backward of scale times
 * their mean squared error. */
static inline td_status ft_shard_backward(td_module *m, int64_t step, int s, double scale) {
  int64_t xs[2] = {FT_SHARD_ROWS, 6}, ys[2] = {FT_SHARD_ROWS, 3};
  uint64_t seed = 1000 * (uint64_t)step + (uint64_t)s;
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 11 + 2 * seed, false);
  td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F64, 12 + 2 * seed, false);
  td_tensor *out = NULL, *loss = NULL, *scaled = NULL;
  td_status st = td_module_forward(m, x, &out);
  if (st == TD_OK) st = td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss);
  if (st == TD_OK && scale != 1.0) st = td_tensor_mul_scalar(loss, scale, &scaled);
  if (st == TD_OK) st = td_tensor_backward(scaled ? scaled : loss);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(out);
  td_tensor_unref(loss);
  td_tensor_unref(scaled);
  return st;
}

static inline void ft_write_file(const char *dir, const char *what, int rank, const void *p,
                                 size_t n, const char *mode) {
  char path[400];
  snprintf(path, sizeof path, "%s/%s.%d", dir, what, rank);
  FILE *f = fopen(path, mode);
  MP_CHECK(f && fwrite(p, 1, n, f) == n);
  fclose(f);
}

static inline size_t ft_read_file(const char *dir, const char *what, int rank, char *buf,
                                  size_t cap) {
  char path[400];
  snprintf(path, sizeof path, "%s/%s.%d", dir, what, rank);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, cap, f);
  fclose(f);
  return n;
}

/* In a worker, first: appends its pid to start.<rank>. */
static inline void ft_record_start(const char *dir, int rank) {
  char line[64];
  int k = snprintf(line, sizeof line, "%d\n", (int)getpid());
  ft_write_file(dir, "start", rank, line, (size_t)k, "a");
}

/* In the test: rank r's pid, asserting it started once (no restart). */
static inline int ft_started_once(const char *dir, int r) {
  char rep[256];
  size_t n = ft_read_file(dir, "start", r, rep, sizeof rep - 1);
  rep[n] = 0;
  assert_non_null(strchr(rep, '\n'));
  assert_true(strchr(rep, '\n')[1] == 0);
  return atoi(rep);
}

/* In the test, after a case: removes its directory of worker files. */
static inline void ft_remove_dir(const char *dir) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

#endif
