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
 *     launcher sees no progress, SIGUSR1s the workers, prints the report and exits with 3;
 *   - collectives in different orders on two groups; a SIGSTOPped rank; nested calls exhausting
 *     the callee's pool; an unconfirmed RRef at shutdown; an RRef fetch whose value's creation is
 *     stuck; a lost distributed backward hop; an optimizer step whose parameters' owner is
 *     SIGKILLed while it waits (explained by its peers' records);
 *   - a dump while the network thread is stuck; tdistrun --summary's waiting time and straggler
 *     scores.
 * The deadlines are the hangs under test: they do not scale (CONTRIBUTING, "Timing"). The matrix's
 * other cases (below, "the matrix's harness") run the job in the background and dump the stuck
 * workers from outside, as tdistrun --hang-timeout does. */
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

#include "core/flight_impl.h"
#include "flight_test_util.h"
#include "mp_util.h"
#include "proc_util.h"
#include "tdist/autograd.h"
#include "tdist/collectives.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/optim.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"
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

#define TRY(expr)                   \
  do {                              \
    td_status try_s_ = (expr);      \
    if (try_s_ != TD_OK) return try_s_; \
  } while (0)

/* ---- tdistrun --summary: waits and stragglers ---- */

/* The summary's row of rank (whitespace-separated columns) into cols; the number of columns. */
static int summary_row(const char *err, int rank, char cols[][64], int max) {
  const char *p = strstr(err, "summary of node 0");
  while (p && (p = strchr(p, '\n'))) {
    char line[512];
    p++;
    snprintf(line, sizeof line, "%.*s", (int)strcspn(p, "\n"), p);
    int n = 0;
    for (char *save = NULL, *w = strtok_r(line, " ", &save); w && n < max;
         w = strtok_r(NULL, " ", &save))
      snprintf(cols[n++], 64, "%s", w);
    if (n > 1 && cols[0][0] >= '0' && cols[0][0] <= '9' && atoi(cols[0]) == rank) return n;
  }
  return 0;
}

static void test_flight_tdistrun_summary_counts_every_wait_and_the_straggler(void **state) {
  (void)state;
  char run[] = TDISTRUN_PATH, worker[] = SUMMARY_WORKER_PATH;
  char *argv[] = {run, "--standalone", "--nproc-per-node", "2", "--summary", worker, NULL};
  td_proc p;
  assert_int_equal(td_proc_spawn(&p, run, argv, NULL, true), 0);
  assert_int_equal(td_proc_finish(&p, 60), 0);
  char r0[16][64], r1[16][64];
  int n0 = summary_row(p.err, 0, r0, 16), n1 = summary_row(p.err, 1, r1, 16);
  /* rank worker calls failed served sent recv handlers waiting coll straggler */
  bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0 && n0 == 11 && n1 == 11;
  /* rank 0 waited ~0.5 s in collectives and ~0.6 s on futures and an RRef fetch (no td_rpc_sync) */
  ok = ok && atof(r0[8]) >= 1.0;
  /* rank 1 came ~0.1 s late to each of 5 all_reduces: the others waited ~0.5 s for it */
  ok = ok && atof(r1[10]) >= 0.35 && atof(r0[10]) == 0.0;
  if (!ok || getenv("TD_FLIGHT_TEST_PRINT"))
    fprintf(stderr, "tdistrun status %#x\nstderr:\n%s\n", p.status, p.err);
  td_proc_free(&p);
  assert_true(ok);
}

/* ---- the matrix's harness: a job in the background, dumped as tdistrun would ----
 * The job runs in a child (td_mp_run there); this process waits for the deadline dumps of the
 * workers that wait (`waiters`), sends SIGUSR1 to the workers stuck in their own code (`stuck`,
 * pids from their .proc files), runs why-hung on the dumps, then lets the job end: it creates
 * DIR/release (what stalled user code polls for) and continues stopped workers. */

#define RELEASE_S 30 /* how long stalled user code waits for the release (scaled) */

static int proc_pid(const char *name) {
  char p[600], line[200];
  int pid = 0;
  snprintf(p, sizeof p, "%s/%s.proc", dir, name);
  FILE *f = fopen(p, "r");
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "pid %d", &pid) == 1) break;
  if (f) fclose(f);
  return pid;
}

static bool has_file(const char *name) {
  char p[600];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  return access(p, F_OK) == 0;
}

static void make_file(const char *name) {
  char p[600];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  if (f) fclose(f);
}

/* This process's flight recorder holds the arrival of a call of fn. */
static bool arrived(const char *fn) {
  static td__flight_rec snap[TD__FLIGHT_RING];
  size_t n = td__flight_snapshot(snap, TD__FLIGHT_RING);
  for (size_t i = 0; i < n; i++)
    if (snap[i].kind == TD__FL_RPC_RECV && strncmp(snap[i].name, fn, TD__FLIGHT_NAME) == 0)
      return true;
  return false;
}

/* User code stuck until the test has looked at the dumps (bounded). */
static void stall(const char *mark) {
  if (mark) make_file(mark);
  TD_TEST_POLL(has_file("release"), RELEASE_S);
}

/* ---- a dump never waits on the network thread ---- */

/* spin (worker1, TD_RPC_INLINE: it runs on the network thread): holds that thread, breaking the
 * inline contract on purpose, until the test has its dumps */
static td_status fn_spin(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  make_file("spinning");
  TD_TEST_POLL(has_file("unspin"), RELEASE_S);
  *res = td_value_none();
  return TD_OK;
}

static int worker_spin(int rank, int world, const char *im, void *arg) {
  (void)arg;
  MP_CHECK_OK(td_rpc_register_ex("spin", fn_spin, NULL, TD_RPC_INLINE));
  td_rpc_agent *a = join(rank, world, im, 2);
  td_future *f = NULL;
  if (rank == 1) make_file("ready"); /* its init needs the network thread: done first */
  if (rank == 0) {
    TD_TEST_POLL(has_file("ready"), 30);
    MP_CHECK_OK(td_rpc_async(a, "worker1", "spin", NULL, 0, NULL, &f));
  }
  if (rank == 1) {
    TD_TEST_POLL(has_file("spinning"), 30);
    MP_CHECK(has_file("spinning"));
    /* the network thread is stuck: SIGUSR1 and td_debug_dump still write dumps */
    MP_CHECK(raise(SIGUSR1) == 0);
    TD_TEST_POLL(own_dump(1), 10);
    MP_CHECK(own_dump(1));
    char p[600];
    snprintf(p, sizeof p, "%s/worker1.flight", dir);
    MP_CHECK(unlink(p) == 0);
    MP_CHECK_OK(td_debug_dump("while the network thread spins"));
    MP_CHECK(own_dump(1));
    MP_CHECK(has_file("spinning") && !has_file("unspin")); /* it was held all along */
    make_file("unspin");
  }
  if (rank == 0) {
    MP_CHECK_OK(td_future_wait(f, TD_TIMEOUT_INFINITE));
    td_future_unref(f);
  }
  td_mp_finish(a, 30);
  return 0;
}

static void test_flight_dumps_while_the_network_thread_is_stuck(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_spin, NULL, 60);
  char p[600];
  snprintf(p, sizeof p, "%s/worker1.flight", dir);
  FILE *f = fopen(p, "r");
  char text[1 << 16] = "";
  size_t got = f ? fread(text, 1, sizeof text - 1, f) : 0;
  if (f) fclose(f);
  text[got] = 0;
  assert_non_null(strstr(text, "reason while the network thread spins\n"));
  assert_non_null(strstr(text, " handler_start 0 ")); /* spin's open record (from rank 0) */
  assert_non_null(strstr(text, " spin\n"));
}

typedef struct hang_case {
  int world;
  td_mp_fn fn;
  void *arg;
  const char *const *waiters; /* dump at their own deadline */
  const char *const *stuck;   /* dumped by SIGUSR1 */
  const char *stopped;        /* a worker that SIGSTOPs itself (continued at the end) */
  int killed;                 /* workers that end killed by a signal (not a failure) */
  const char *const *ready;   /* files in DIR the stuck workers make once stuck */
} hang_case;

static bool all_dumped(const char *const *names) {
  char f[200];
  for (int i = 0; names && names[i]; i++) {
    snprintf(f, sizeof f, "%s.flight", names[i]);
    if (!has_file(f)) return false;
  }
  return true;
}

/* Runs the case and its why-hung report, which must hold every word of words (the report is
 * returned in static storage); asserts the job then ended well. */
/* This worker's process is stopped (state T), as SIGSTOP leaves it. */
static bool is_stopped(const char *name) {
  char p[64], st[512] = "";
  snprintf(p, sizeof p, "/proc/%d/stat", proc_pid(name));
  FILE *f = fopen(p, "r");
  size_t got = f ? fread(st, 1, sizeof st - 1, f) : 0;
  if (f) fclose(f);
  st[got] = 0;
  const char *q = strrchr(st, ')');
  return q && q[1] == ' ' && q[2] == 'T';
}

/* Dumps the stuck workers (SIGUSR1, as tdistrun does) and runs why-hung into report; whether it
 * ran and holds every word (the missing one said on stderr when last is set). */
static bool dump_and_report(const hang_case *hc, const char *const *words, char *report,
                            size_t n, bool last) {
  char f[600];
  for (int i = 0; hc->stuck && hc->stuck[i]; i++) { /* a fresh dump from each */
    snprintf(f, sizeof f, "%s/%s.flight", dir, hc->stuck[i]);
    unlink(f);
  }
  bool ok = true;
  for (int i = 0; ok && hc->stuck && hc->stuck[i]; i++) {
    int pid = 0;
    TD_TEST_POLL((pid = proc_pid(hc->stuck[i])) > 0, 10);
    ok = pid > 0 && kill(pid, SIGUSR1) == 0;
  }
  TD_TEST_POLL(all_dumped(hc->stuck), 10);
  ok = ok && all_dumped(hc->stuck);
  char tool[] = TDIST_TRACE_PATH;
  char *argv[] = {tool, "why-hung", dir, NULL};
  td_proc p;
  report[0] = 0;
  if (ok && td_proc_spawn(&p, tool, argv, NULL, false) == 0 && td_proc_finish(&p, 30) == 0) {
    snprintf(report, n, "%s", p.out ? p.out : "");
    ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0;
    if (p.err && p.err[0]) fprintf(stderr, "%s", p.err);
    td_proc_free(&p);
  } else {
    ok = false;
  }
  for (int i = 0; ok && words[i]; i++)
    if (!strstr(report, words[i])) {
      if (last) fprintf(stderr, "why-hung report lacks: %s\n", words[i]);
      ok = false;
    }
  return ok;
}

/* Runs the case and its why-hung report, which must hold every word of words (the report is
 * returned in static storage); asserts the job then ended well. The stuck workers are dumped
 * once the case's ready marks exist; a worker a moment away from its stuck state (between its
 * mark and its wait) is dumped again, twice at most, as a person would run why-hung again. */
static const char *run_case(const hang_case *hc, const char *const *words) {
  static char report[1 << 16];
  report[0] = 0;
  fflush(NULL);
  pid_t job = fork();
  assert_true(job >= 0);
  if (job == 0) _exit(td_mp_run(hc->world, hc->fn, hc->arg, 60, NULL) == hc->killed ? 0 : 1);
  TD_TEST_POLL(all_dumped(hc->waiters), 30);
  double t_dumped = td_test_now_s(); /* the waiters' deadline has just passed */
  bool ok = all_dumped(hc->waiters);
  if (!ok) fprintf(stderr, "run_case: the waiting workers did not all dump\n");
  for (int i = 0; ok && hc->ready && hc->ready[i]; i++) {
    TD_TEST_POLL(has_file(hc->ready[i]), 30);
    ok = has_file(hc->ready[i]);
  }
  if (ok && hc->stopped) {
    TD_TEST_POLL(is_stopped(hc->stopped), 30);
    ok = is_stopped(hc->stopped);
  }
  bool found = false;
  for (int attempt = 0; ok && !found && attempt < 3; attempt++) {
    if (attempt) td_test_sleep_ms(200);
    found = dump_and_report(hc, words, report, sizeof report, attempt == 2 || !hc->stuck);
    if (!hc->stuck) break; /* nothing to dump again: the deadline dumps are what they are */
  }
  ok = ok && found;
  /* printed, not asserted (a figure, not a test): the report's delay after the deadline dumps */
  fprintf(stderr, "why-hung report %.3f s after the waiting workers' deadline dumps\n",
          td_test_now_s() - t_dumped);
  if (!ok || getenv("TD_FLIGHT_TEST_PRINT")) fprintf(stderr, "why-hung report:\n%s\n", report);
  make_file("release");
  if (hc->stopped) kill(proc_pid(hc->stopped), SIGCONT);
  int status = 0;
  double end = td_test_now_s() + td_test_s(60);
  pid_t r = 0;
  while ((r = waitpid(job, &status, WNOHANG)) == 0 && td_test_now_s() < end) td_test_sleep_ms(10);
  if (r == 0) {
    kill(job, SIGKILL); /* td_mp_run's children die with their own deadline */
    waitpid(job, &status, 0);
  }
  assert_true(ok);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return report;
}

static td_process_group *make_group(td_rpc_agent *a) {
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, td_test_ms(30000), &pg));
  MP_CHECK_OK(td_process_group_barrier(pg));
  return pg;
}

/* ---- collectives in different orders on two ranks ---- */

/* Two groups of the same two ranks; rank 0 reduces on A then B, rank 1 on B then A. */
static int worker_order(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_agent *a = join(rank, world, im, 2);
  td_process_group *ga = make_group(a), *gb = make_group(a);
  MP_CHECK_OK(td_process_group_set_timeout(ga, HANG_MS));
  MP_CHECK_OK(td_process_group_set_timeout(gb, HANG_MS));
  MP_CHECK(all_reduce(rank == 0 ? ga : gb, 4) != TD_OK); /* #2 on one, never entered by the other */
  td_process_group_destroy(ga);
  td_process_group_destroy(gb);
  td_rpc_shutdown(a, false, td_test_ms(5000)); /* the groups failed: not a graceful end */
  td_rpc_destroy(a);
  return 0;
}

static void test_flight_names_collectives_called_in_different_orders(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", "worker1", NULL};
  hang_case hc = {2, worker_order, NULL, waiters, NULL, NULL};
  run_case(&hc, (const char *const[]){
      "culprit: collectives called in different orders (a cycle): worker0 (rank 0) waits in "
      "all_reduce #2 (float32 x 4, 16 bytes, group ",
      "which worker1 (rank 1) never entered; worker1 (rank 1) waits in all_reduce #2 (float32 x 4",
      "which worker0 (rank 0) never entered", NULL});
}

/* ---- a SIGSTOPped rank ---- */

static int worker_stopped(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_agent *a = join(rank, world, im, 2);
  td_process_group *pg = make_group(a);
  MP_CHECK_OK(td_process_group_set_timeout(pg, HANG_MS));
  if (rank == 2) raise(SIGSTOP); /* continued by the test after the report */
  td_status st = all_reduce(pg, 8); /* #2: fails everywhere (rank 2 comes too late) */
  MP_CHECK(st != TD_OK);
  td_process_group_destroy(pg);
  td_rpc_shutdown(a, false, td_test_ms(5000));
  td_rpc_destroy(a);
  return 0;
}

static void test_flight_names_a_stopped_rank(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", "worker1", NULL};
  hang_case hc = {3, worker_stopped, NULL, waiters, NULL, "worker2"};
  const char *r = run_case(&hc, (const char *const[]){
      "culprit: worker2 (rank 2) never entered all_reduce #2 (float32 x 8, 32 bytes, group",
      "it left no dump: stopped: its process", "is stopped (SIGSTOP", NULL});
  assert_null(strstr(r, "culprit: worker0"));
  assert_null(strstr(r, "culprit: worker1"));
}

/* ---- nested calls exhausting the callee's pool ---- */

static td_status fn_inner_self(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  *res = td_value_none();
  return TD_OK;
}

/* nest (on worker1, 2 handler threads): a blocking call to worker1 itself from a handler, made
 * once both handler threads are in nest (so that no thread is left to run the nested calls,
 * whatever else the pool ran first); marks nest1 and nest2 say both are about to wait */
static td_status fn_nest(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)args, (void)n, (void)fut;
  static int count;
  int k = __atomic_add_fetch(&count, 1, __ATOMIC_RELAXED);
  char mark[16];
  snprintf(mark, sizeof mark, "in%d", k);
  make_file(mark);
  TD_TEST_POLL(has_file("in1") && has_file("in2"), RELEASE_S);
  snprintf(mark, sizeof mark, "nest%d", k);
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = NESTED_MS;
  td_future *f = NULL;
  TRY(td_rpc_async(td_rpc_ctx_agent(ctx), "worker1", "inner_self", NULL, 0, &o, &f));
  make_file(mark);
  td_status st = td_future_wait(f, TD_TIMEOUT_INFINITE);
  td_value *v = st == TD_OK ? td_future_value(f) : NULL;
  if (st == TD_OK) *res = v ? td_value_ref(v) : td_value_none();
  if (st != TD_OK) td_set_error(st, "%s", td_future_message(f));
  td_future_unref(f);
  return st;
}

static int worker_nested(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("nest", fn_nest, NULL);
  td_rpc_register("inner_self", fn_inner_self, NULL);
  td_rpc_agent *a = join(rank, world, im, 2);
  if (rank == 0) {
    td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
    o.timeout_ms = HANG_MS;
    td_future *fs[2];
    for (int i = 0; i < 2; i++) MP_CHECK_OK(td_rpc_async(a, "worker1", "nest", NULL, 0, &o, &fs[i]));
    td_status st = td_future_wait_all(fs, 2, TD_TIMEOUT_INFINITE);
    if (st != TD_ERR_TIMEOUT) fprintf(stderr, "nested: %s: %s\n", td_status_str(st), td_last_error());
    MP_CHECK(st == TD_ERR_TIMEOUT);
    for (int i = 0; i < 2; i++) td_future_unref(fs[i]);
  }
  td_mp_finish(a, 30);
  return 0;
}

static void test_flight_names_nested_calls_exhausting_a_pool(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", NULL}, *const stuck[] = {"worker1", NULL};
  const char *const ready[] = {"nest1", "nest2", NULL};
  hang_case hc = {2, worker_nested, NULL, waiters, stuck, NULL, 0, ready};
  run_case(&hc, (const char *const[]){
      "(td_future_wait_all of 2, first not done)",
      "culprit: worker1 (rank 1)'s handler pool is exhausted by nested calls: all 2 of its "
      "handler threads (handler nest (from worker0 (rank 0)), handler nest (from worker0 (rank "
      "0))) wait on calls to worker1 itself, which are queued behind them (inner_self #", NULL});
}

/* ---- an unconfirmed RRef at shutdown ---- */

static td_status fn_make(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  *res = td_value_int(7);
  return TD_OK;
}

static td_status fn_take(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  *res = td_value_none();
  return TD_OK;
}

/* stall: user code that holds a handler thread until the test has seen the dumps */
static td_status fn_stall(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  stall("stalling");
  *res = td_value_none();
  return TD_OK;
}

/* worker0 owns nothing: it creates an RRef on worker1 (one handler thread), and once worker2 has
 * worker1's only thread stuck in stall, sends the RRef to worker2: the fork waits behind stall,
 * worker2's take waits for the confirmation, and every graceful shutdown waits for them. */
static int worker_unconfirmed(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("make", fn_make, NULL);
  td_rpc_register("take", fn_take, NULL);
  td_rpc_register("stall", fn_stall, NULL);
  td_rpc_agent *a = join(rank, world, im, rank == 1 ? 1 : 2);
  td_future *f = NULL;
  td_rref *r = NULL;
  if (rank == 0) {
    MP_CHECK_OK(td_remote(a, "worker1", "make", NULL, 0, NULL, &r));
    td_value *v = NULL;
    MP_CHECK_OK(td_rref_to_here(r, TD_TIMEOUT_DEFAULT, &v)); /* created and confirmed */
    td_value_unref(v);
    make_file("made");
    TD_TEST_POLL(has_file("stalling"), 30);
    td_value *rv = td_value_rref(r);
    MP_CHECK_OK(td_rpc_async(a, "worker2", "take", &rv, 1, NULL, &f));
    td_value_unref(rv);
    make_file("sent");
  } else if (rank == 2) {
    TD_TEST_POLL(has_file("made"), 30);
    MP_CHECK_OK(td_rpc_async(a, "worker1", "stall", NULL, 0, NULL, &f));
  }
  TD_TEST_POLL(has_file("sent"), 30);
  /* the requests are where the hang needs them before the deadline starts */
  if (rank == 1) TD_TEST_POLL(arrived("__rref_fork"), 30);
  if (rank == 2) TD_TEST_POLL(arrived("take"), 30);
  MP_CHECK(td_rpc_shutdown(a, true, HANG_MS) == TD_ERR_TIMEOUT);
  td_future_unref(f);
  td_rref_unref(r);
  td_rpc_destroy(a);
  return 0;
}

static void test_flight_names_the_owner_of_an_unconfirmed_rref_at_shutdown(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", "worker1", "worker2", NULL};
  hang_case hc = {3, worker_unconfirmed, NULL, waiters, NULL, NULL};
  run_case(&hc, (const char *const[]){
      "worker0 (rank 0) thread", "is in rpc_shutdown:",
      "outstanding call __rref_fork #", "to worker1 (rank 1), about RRef 0:",
      "(owned by worker1 (rank 1))",
      "worker2 (rank 2) received take #",
      "but holds RRef 0:", "(from worker0 (rank 0)) that its owner worker1 (rank 1) never "
      "confirmed",
      "worker1 (rank 1) received __rref_fork #", "but never started it: its handler threads are "
      "busy with handler stall (from worker2 (rank 2))",
      "culprit: worker1 (rank 1) thread", "is in handler stall (call #",
      "unconfirmed: worker2 (rank 2) holds RRef 0:", NULL});
}

/* ---- an RRef fetch waiting on its value's creation ---- */

/* stall_make (worker1): the function creating an RRef's value, stuck in user code */
static td_status fn_stall_make(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  stall("making");
  *res = td_value_int(1);
  return TD_OK;
}

static int worker_fetch(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("stall_make", fn_stall_make, NULL);
  td_rpc_agent *a = join(rank, world, im, 2);
  if (rank == 0) {
    td_rref *r = NULL;
    td_future *f = NULL;
    MP_CHECK_OK(td_remote(a, "worker1", "stall_make", NULL, 0, NULL, &r));
    /* the fetch (the owner answers once the value exists) is what this thread waits on */
    MP_CHECK_OK(td_rref_to_here_async(r, HANG_MS, &f));
    MP_CHECK(td_future_wait(f, TD_TIMEOUT_INFINITE) == TD_ERR_TIMEOUT);
    td_future_unref(f);
    td_rref_unref(r);
  }
  td_mp_finish(a, 30);
  return 0;
}

static void test_flight_follows_an_rref_fetch_to_its_owner(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", NULL}, *const stuck[] = {"worker1", NULL};
  const char *const ready[] = {"making", NULL};
  hang_case hc = {2, worker_fetch, NULL, waiters, stuck, NULL, 0, ready};
  run_case(&hc, (const char *const[]){
      "waiting on call __rref_fetch #", "to worker1 (rank 1), about RRef 0:",
      "(owned by worker1 (rank 1))", "worker1 (rank 1) finished handler __rref_fetch #",
      "its reply waits on a future about RRef 0:",
      "culprit: worker1 (rank 1) thread", "is running stall_make for worker0 (rank 0), about RRef 0:",
      "and waits on no other worker", NULL});
}

/* ---- a lost distributed-autograd hop ---- */

static td_status stall_hook(void *ctx, const td_tensor *grad, td_tensor **replacement) {
  (void)ctx, (void)grad, (void)replacement;
  stall("hooked"); /* worker2's backward never ends (until the test has seen the dumps) */
  return TD_OK;
}

/* smul (worker2): x * 2, whose backward is stuck in a hook */
static td_status fn_smul(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)n, (void)fut;
  td_tensor *x, *y;
  TRY(td_value_as_tensor(args[0], &x));
  TRY(td_tensor_mul_scalar(x, 2.0, &y));
  int h;
  td_status st = td_tensor_register_hook(y, stall_hook, NULL, &h);
  if (st == TD_OK) *res = td_value_tensor(y);
  td_tensor_unref(y);
  return st;
}

/* relay (worker1): smul on worker2, inside the caller's context */
static td_status fn_relay(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)n, (void)fut;
  return td_rpc_sync(td_rpc_ctx_agent(ctx), "worker2", "smul", args, 1, NULL, res);
}

static int worker_backward(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("relay", fn_relay, NULL);
  td_rpc_register("smul", fn_smul, NULL);
  td_rpc_agent *a = join(rank, world, im, 2);
  if (rank == 0) {
    int64_t shape[1] = {4};
    td_tensor *x, *s;
    MP_CHECK_OK(td_tensor_ones(shape, 1, TD_DTYPE_F64, td_device_cpu(), &x));
    MP_CHECK_OK(td_tensor_set_requires_grad(x, true));
    td_dist_autograd_context *c;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &c));
    td_value *xv = td_value_tensor(x), *yv = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "relay", &xv, 1, NULL, &yv));
    td_tensor *y;
    MP_CHECK_OK(td_value_as_tensor(yv, &y));
    MP_CHECK_OK(td_tensor_sum_all(y, &s));
    MP_CHECK_OK(td_rpc_set_default_timeout(a, HANG_MS)); /* the backward hop's deadline */
    MP_CHECK(td_dist_autograd_backward(c, &s, 1, false) != TD_OK);
    MP_CHECK_OK(td_rpc_set_default_timeout(a, td_test_ms(30000)));
    td_tensor_unref(s);
    td_value_unref(yv);
    td_value_unref(xv);
    td_tensor_unref(x);
    td_dist_autograd_context_end(c);
  }
  td_mp_finish(a, 30);
  return 0;
}

static void test_flight_follows_a_lost_backward_hop(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", NULL}, *const stuck[] = {"worker1", "worker2", NULL};
  const char *const ready[] = {"hooked", NULL};
  hang_case hc = {3, worker_backward, NULL, waiters, stuck, NULL, 0, ready};
  run_case(&hc, (const char *const[]){
      "is in dist_backward, in context 0:",
      "its pending call: __dist_backward #", "to worker1 (rank 1), in context 0:",
      "worker1 (rank 1) finished handler __dist_backward #",
      "its reply waits on a future about context 0:",
      "worker1 (rank 1)'s call __dist_backward #", "to worker2 (rank 2), in context 0:",
      "culprit: worker2 (rank 2) thread", "is in handler __dist_backward (call #",
      "from worker1 (rank 1), in context 0:", "and waits on no other worker", NULL});
}

/* ---- an optimizer step waiting on a dead owner ---- */

static td_status fn_param(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  int64_t shape[1] = {3};
  td_tensor *t;
  TRY(td_tensor_ones(shape, 1, TD_DTYPE_F64, td_device_cpu(), &t));
  td_status st = td_tensor_set_requires_grad(t, true);
  if (st == TD_OK) *res = td_value_tensor(t);
  td_tensor_unref(t);
  return st;
}


/* doom (worker1, one handler thread): holds the pool until an RRef call (the optimizer's step)
 * has arrived behind it, then the whole process is SIGKILLed: no dump, no word. The caller
 * waits on that call's future a moment after sending it: killed before, the call fails before
 * the step waits (the step returns its error with no dump, and the next wait, outside the step,
 * is the one dumped; seen once in 13 runs here), so the death waits a grace period. */
static td_status fn_doom(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)res, (void)fut;
  TD_TEST_POLL(arrived("__rref_call"), RELEASE_S);
  td_test_sleep_ms(td_test_ms(300));
  raise(SIGKILL);
  return TD_ERR_INTERNAL;
}

static int worker_optim(int rank, int world, const char *im, void *arg) {
  (void)arg;
  td_rpc_register("param", fn_param, NULL);
  td_rpc_register("doom", fn_doom, NULL);
  td_rpc_agent *a = join(rank, world, im, rank == 1 ? 1 : 2);
  if (rank == 1) {
    TD_TEST_POLL(false, RELEASE_S); /* until it is killed in doom */
    _exit(1);
  }
  td_rref *p;
  MP_CHECK_OK(td_remote(a, "worker1", "param", NULL, 0, NULL, &p));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = 0.1;
  td_dist_optimizer *opt;
  MP_CHECK_OK(td_dist_optimizer_create(a, &oo, &p, 1, &opt));
  td_future *f;
  MP_CHECK_OK(td_rpc_async(a, "worker1", "doom", NULL, 0, NULL, &f));
  td_dist_autograd_context *c;
  MP_CHECK_OK(td_dist_autograd_context_begin(a, &c));
  MP_CHECK(td_dist_optimizer_step(opt, c) != TD_OK); /* its owner dies while it waits */
  td_future_unref(f);
  td_dist_autograd_context_end(c);
  td_dist_optimizer_destroy(opt);
  td_rref_unref(p);
  td_rpc_shutdown(a, false, td_test_ms(5000));
  td_rpc_destroy(a);
  return 0;
}

static void test_flight_names_the_dead_owner_of_an_optimizer_step(void **state) {
  (void)state;
  const char *const waiters[] = {"worker0", NULL};
  hang_case hc = {2, worker_optim, NULL, waiters, NULL, NULL, 1};
  run_case(&hc, (const char *const[]){
      "worker1 (rank 1): no dump: dead: its process",
      "is in dist_optim_step, in context 0:", "waiting on call __rref_call #",
      "to worker1 (rank 1), about RRef 0:", "(owned by worker1 (rank 1))",
      "culprit: worker1 (rank 1) left no dump: dead: its process",
      "it never answered __rref_call #",
      /* what its peers recorded of it: when it was last heard from, the calls its death failed */
      "peers: last heard from at ", "to it failed with its connection lost", NULL});
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
      cmocka_unit_test_setup_teardown(test_flight_dumps_while_the_network_thread_is_stuck,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(
          test_flight_tdistrun_summary_counts_every_wait_and_the_straggler, setup_dir,
          teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_collectives_called_in_different_orders,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_a_stopped_rank, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_nested_calls_exhausting_a_pool, setup_dir,
                                      teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_the_owner_of_an_unconfirmed_rref_at_shutdown,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_follows_an_rref_fetch_to_its_owner, setup_dir,
                                      teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_follows_a_lost_backward_hop, setup_dir,
                                      teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_names_the_dead_owner_of_an_optimizer_step,
                                      setup_dir, teardown_dir),
  };
  if (getenv("TD_FLIGHT_TEST_FILTER")) /* by hand: one case, e.g. "*backward*" */
    cmocka_set_test_filter(getenv("TD_FLIGHT_TEST_FILTER"));
  return cmocka_run_group_tests(tests, NULL, NULL);
}
