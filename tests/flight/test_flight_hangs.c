/* test_flight_hangs.c - injected hangs in real workers, each diagnosed by the flight recorder and
 * `tdist-trace why-hung`: every worker that waits hits a short deadline and dumps (TD_FLIGHT_DIR),
 * a worker stuck outside tdist is dumped by SIGUSR1 (as tdistrun would), and the report must name
 * the culprit worker and the operation:
 *   - a rank that skips an all_reduce (the others wait in it until the group's deadline);
 *   - mismatched element counts (every member fails at once);
 *   - a dead rank (exits before the all_reduce: no dump);
 *   - an RPC cycle through an exhausted pool: worker0 calls outer on worker1 (one handler thread),
 *     outer calls mid on worker0, mid calls inner on worker1, which waits behind outer;
 *   - tdistrun --hang-timeout on a job whose rank 1 never enters a barrier (deadline 60 s): the
 *     launcher sees no progress, SIGUSR1s the workers, prints the report and exits with 3.
 * The deadlines are the hangs under test: they do not scale (CONTRIBUTING, "Timing"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "flight_test_util.h"
#include "mp_util.h"
#include "proc_util.h"
#include "tdist/collectives.h"
#include "tdist/rpc.h"
#include "tdist/trace.h"
#include "test_util.h"

#define HANG_MS 1500 /* the deadline every waiting worker hits */

static char dir[256];

static int setup_dir(void **state) {
  (void)state;
  if (flight_test_mkdir(dir, sizeof dir, "td-hang") != 0) return -1;
  return setenv("TD_FLIGHT_DIR", dir, 1); /* the workers inherit it */
}

static int teardown_dir(void **state) {
  (void)state;
  td_proc_kill_all();
  flight_test_rmdir(dir);
  unsetenv("TD_FLIGHT_DIR");
  return 0;
}

/* Runs why-hung on the dumps; returns its report (static storage), failing the test when it does
 * not hold every one of the NULL-terminated words. */
static const char *why_hung(const char *const *words) {
  static char report[1 << 16];
  char tool[] = TDIST_TRACE_PATH;
  char *argv[] = {tool, "why-hung", dir, NULL};
  td_proc p;
  assert_int_equal(td_proc_spawn(&p, tool, argv, NULL, false), 0);
  assert_int_equal(td_proc_finish(&p, 30), 0);
  snprintf(report, sizeof report, "%s", p.out ? p.out : "");
  bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0;
  for (int i = 0; words[i]; i++) ok = ok && strstr(report, words[i]);
  if (!ok || getenv("TD_FLIGHT_TEST_PRINT")) /* by hand: see the reports */
    fprintf(stderr, "why-hung report:\n%s%s\n", report, p.err ? p.err : "");
  td_proc_free(&p);
  assert_true(ok);
  return report;
}

static td_rpc_agent *join(int rank, int world, const char *im, int threads) {
  td_rpc_options o = td_mp_rpc_options(im, threads);
  td_rpc_agent *a = NULL;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

static td_status all_reduce(td_process_group *pg, int64_t n) {
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_full(&n, 1, 1.0, TD_DTYPE_F32, td_device_cpu(), &t));
  td_status st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  td_tensor_unref(t);
  return st;
}

/* This worker's own dump exists (polled: the dumper thread writes it). */
static bool own_dump(int rank) {
  char p[600];
  snprintf(p, sizeof p, "%s/worker%d.flight", dir, rank);
  return access(p, F_OK) == 0;
}

/* ---- collectives ---- */

enum { SKIP, MISMATCH, DEAD };

static int worker_coll(int rank, int world, const char *im, void *arg) {
  int mode = *(int *)arg;
  td_rpc_agent *a = join(rank, world, im, 2);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, td_test_ms(30000), &pg));
  MP_CHECK_OK(td_process_group_barrier(pg)); /* #1: in step */
  /* the hang under test: a short deadline that does not scale (a mismatch fails at once) */
  if (mode != MISMATCH) MP_CHECK_OK(td_process_group_set_timeout(pg, HANG_MS));
  bool culprit = rank == 2 ? mode != MISMATCH : rank == 1 && mode == MISMATCH;
  if (culprit && mode == DEAD) _exit(0); /* gone without a word */
  if (culprit && mode == SKIP) {
    /* stuck in its own code; dumped from outside, as tdistrun --hang-timeout would */
    MP_CHECK(raise(SIGUSR1) == 0);
    TD_TEST_POLL(own_dump(rank), 10);
    MP_CHECK(own_dump(rank));
  } else {
    td_status st = all_reduce(pg, culprit ? 7 : 8); /* #2 */
    MP_CHECK(st != TD_OK);
    MP_CHECK(own_dump(rank)); /* written by the failing call, before it returned */
  }
  td_process_group_destroy(pg);
  if (mode == DEAD) {
    td_rpc_shutdown(a, false, td_test_ms(5000)); /* a dead member: not a graceful end */
    td_rpc_destroy(a);
  } else {
    td_mp_finish(a, 30);
  }
  return 0;
}

static void test_flight_names_the_rank_that_skipped_a_collective(void **state) {
  (void)state;
  int mode = SKIP;
  TD_MP_RUN(3, worker_coll, &mode, 60);
  why_hung((const char *const[]){
      "culprit: worker2 (rank 2) never entered all_reduce #2 (float32 x 8, 32 bytes, group",
      "its last operation on group", "barrier #1", "waits in nothing tdist records", NULL});
}

static void test_flight_names_the_rank_with_a_mismatched_count(void **state) {
  (void)state;
  int mode = MISMATCH;
  TD_MP_RUN(3, worker_coll, &mode, 60);
  const char *r = why_hung((const char *const[]){
      "culprit: worker1 (rank 1) entered all_reduce #2 (float32 x 7, 28 bytes",
      "where 2 other members entered all_reduce #2 (float32 x 8", "mismatched collectives", NULL});
  assert_null(strstr(r, "culprit: worker0"));
  assert_null(strstr(r, "culprit: worker2"));
}

static void test_flight_names_a_dead_rank(void **state) {
  (void)state;
  int mode = DEAD;
  TD_MP_RUN(3, worker_coll, &mode, 60);
  const char *r = why_hung((const char *const[]){
      "culprit: worker2 (rank 2) never entered all_reduce #2",
      "it left no dump: dead: its process", "worker2 (rank 2): no dump: dead", NULL});
  assert_null(strstr(r, "culprit: worker0"));
  assert_null(strstr(r, "culprit: worker1"));
}

/* ---- an RPC cycle through an exhausted pool ---- */

/* The handlers' calls outlive worker0's own (HANG_MS) by far, so that worker0 dumps first, with
 * the cycle whole, and no call of the cycle ends before worker1 has dumped too. */
#define NESTED_MS 4000

static td_status call_on(td_rpc_ctx *ctx, const char *to, const char *fn, td_value **res) {
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = NESTED_MS;
  return td_rpc_sync(td_rpc_ctx_agent(ctx), to, fn, NULL, 0, &o, res);
}

/* outer (worker1) -> mid (worker0) -> inner (worker1): blocking inside handlers on purpose. */
static td_status fn_outer(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)args, (void)n, (void)fut;
  return call_on(ctx, "worker0", "mid", res);
}

static td_status fn_mid(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)args, (void)n, (void)fut;
  return call_on(ctx, "worker1", "inner", res);
}

static td_status fn_inner(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  *res = td_value_none();
  return TD_OK;
}

static int worker_cycle(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("outer", fn_outer, NULL);
  td_rpc_register("mid", fn_mid, NULL);
  td_rpc_register("inner", fn_inner, NULL);
  td_rpc_agent *a = join(rank, world, im, rank == 1 ? 1 : 2); /* worker1: one handler thread */
  if (rank == 0) {
    td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
    o.timeout_ms = HANG_MS;
    td_value *res = NULL;
    MP_CHECK(td_rpc_sync(a, "worker1", "outer", NULL, 0, &o, &res) == TD_ERR_TIMEOUT);
    MP_CHECK(own_dump(rank));
  }
  td_mp_finish(a, 30);
  if (rank == 1) MP_CHECK(own_dump(rank)); /* outer's call to mid expired there */
  return 0;
}

static void test_flight_names_an_rpc_cycle_through_an_exhausted_pool(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_cycle, NULL, 60);
  why_hung((const char *const[]){
      "worker0 (rank 0) thread", "is waiting on call outer #",
      "worker1 (rank 1) received inner #", "but never started it: its handler threads are busy "
      "with handler outer (from worker0 (rank 0))",
      "culprit: a cycle of RPC waits: worker1 (rank 1) in handler outer waits on mid -> worker0 "
      "(rank 0) in handler mid waits on inner -> back to the start", NULL});
}

/* ---- tdistrun --hang-timeout ---- */

static void test_flight_tdistrun_hang_timeout_reports_and_stops(void **state) {
  (void)state;
  char run[] = TDISTRUN_PATH, worker[] = HANG_WORKER_PATH;
  /* the hang timeout also covers start-up (no progress file yet): stretched on slow machines */
  char hang[32];
  snprintf(hang, sizeof hang, "%g", td_test_s(3));
  char *argv[] = {run, "--standalone", "--nproc-per-node", "2", "--hang-timeout", hang,
                  "--stop-timeout", "2", worker, NULL};
  td_proc p;
  double t0 = td_test_now_s();
  assert_int_equal(td_proc_spawn(&p, run, argv, NULL, true), 0);
  assert_int_equal(td_proc_finish(&p, 50), 0);
  bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 3 &&
            strstr(p.out, "culprit: worker1 (rank 1) never entered barrier #2") &&
            strstr(p.out, "worker0 (rank 0), pid") && strstr(p.out, "(SIGUSR1)") &&
            strstr(p.err, "tdistrun: no worker made progress for ") &&
            strstr(p.err, "tdistrun: stopped the hung job (exit status 3, no restart)");
  if (!ok || getenv("TD_FLIGHT_TEST_PRINT"))
    fprintf(stderr, "tdistrun status %#x after %.1f s\nstdout:\n%s\nstderr:\n%s\n", p.status,
            td_test_now_s() - t0, p.out, p.err);
  td_proc_free(&p);
  assert_true(ok);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_flight_names_the_rank_that_skipped_a_collective,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_the_rank_with_a_mismatched_count,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_a_dead_rank, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_an_rpc_cycle_through_an_exhausted_pool,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_tdistrun_hang_timeout_reports_and_stops,
                                      setup_dir, teardown_dir),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
