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

/* In the test: makes a directory for the workers' files from tmpl (a mkdtemp template) into
 * dir (cap bytes), runs world workers fn(arg) for at most 120 s, prints label with the time they
 * took; returns td_mp_run's count of workers that failed, codes[] their exit statuses. */
static inline int ft_run_workers(char *dir, size_t cap, const char *tmpl, int world, td_mp_fn fn,
                                 void *arg, int *codes, const char *label) {
  snprintf(dir, cap, "%s", tmpl);
  assert_non_null(mkdtemp(dir));
  double t0 = td_test_now_s();
  int bad = td_mp_run(world, fn, arg, 120, codes);
  fprintf(stderr, "%s: %.2f s\n", label, td_test_now_s() - t0);
  return bad;
}

/* In the test, after a case: removes its directory of worker files. */
static inline void ft_remove_dir(const char *dir) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* ---- spares (4 members, ranks 0-3; spares 4 and 5) ---- */

#define FT_SPARE_WORLD 6
#define FT_SPARE_MEMBERS 4

/* What a spare case expects, as the spare tests give it. */
typedef struct ft_spare_want {
  const fault *f;
  int nf;
  const int *joined;   /* [2]: whether spare 4, spare 5 is admitted */
  uint64_t generation; /* the survivors' last generation */
  int lost;            /* members lost, as every original survivor counts them */
  int dies_joining;    /* a spare that kills itself once admitted (0: none) */
} ft_spare_want;

/* In the test, rank r's end (codes[r]): false when it was killed (counted in *killed) or, a
 * spare, released (its report "released <members lost> <pid>" checked); true when it trained to
 * the end: its report is in rep (cap bytes) and *pid0 its pid at the start. */
static inline bool ft_spare_trained(const char *dir, int r, const ft_spare_want *w,
                                    const int *codes, int *killed, char *rep, size_t cap,
                                    int *pid0) {
  if (ft_victim(w->f, w->nf, r) || (w->dies_joining > 0 && r == w->dies_joining)) {
    assert_int_equal(codes[r], 128 + 9 /* SIGKILL */);
    (*killed)++;
    return false;
  }
  assert_int_equal(codes[r], 0);
  *pid0 = ft_started_once(dir, r);
  size_t n = ft_read_file(dir, "report", r, rep, cap - 1);
  rep[n] = 0;
  fprintf(stderr, "  rank %d: %s", r, rep);
  if (r >= FT_SPARE_MEMBERS && !w->joined[r - FT_SPARE_MEMBERS]) {
    int members_lost = -1, pid1 = 0;
    assert_int_equal(sscanf(rep, "released %d %d", &members_lost, &pid1), 2);
    assert_int_equal(pid1, *pid0);
    assert_int_equal(members_lost, w->lost > 0);
    return false;
  }
  return true;
}

/* In the test, for rank r that trained to the end: the fields of its report every spare test
 * has, and its parameters bitwise equal to the failure-free run's (base, base_n bytes). */
static inline void ft_spare_check(const char *dir, int r, const ft_spare_want *w,
                                  const char *role, unsigned long long gen, int members,
                                  int lost, int joined, int pid0, int pid1, const char *base,
                                  size_t base_n) {
  assert_int_equal(pid1, pid0);
  assert_string_equal(role, r >= FT_SPARE_MEMBERS ? "joined" : "member");
  assert_int_equal(gen, w->generation);
  assert_int_equal(members, FT_SPARE_MEMBERS); /* made whole again by the spares */
  if (r < FT_SPARE_MEMBERS) {
    assert_int_equal(lost, w->lost);
    assert_int_equal(joined, w->joined[0] + w->joined[1]);
  }
  char buf[4096];
  size_t n = ft_read_file(dir, "params", r, buf, sizeof buf);
  assert_true(n > 0);
  assert_int_equal(n, base_n);
  assert_memory_equal(buf, base, n); /* bitwise the failure-free run of 4 */
}

#endif
