/* test_launcher.c - runs the tdistrun launcher on launcher_worker and checks what it does:
 * the environment it gives workers, the per-rank output prefixes, group stop on failure,
 * restarts, signal forwarding and escalation, --standalone port choice, argument checks.
 *
 * Each test starts tdistrun with posix_spawn, reads its stdout and stderr until EOF and reaps
 * it, under a deadline (30 s times TD_TEST_TIMEOUT_SCALE) after which it is SIGKILLed and the test
 * fails. Workers record their pids in a scratch directory so that a test can check none of them
 * survives. tdistrun runs in a process group of its own (its workers stay in it), so that when a
 * test fails half-way its teardown can SIGKILL whatever is left of that group; the tests
 * themselves signal tdistrun by pid only. Nothing here binds a fixed port: MASTER_PORT values are only passed around, and
 * --standalone asks the kernel for a free one.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <time.h>
#include <unistd.h>

#include "proc_util.h"
#include "test_util.h"

#ifndef TDISTRUN_PATH
#error "TDISTRUN_PATH must name the tdistrun executable"
#endif
#ifndef WORKER_PATH
#error "WORKER_PATH must name the launcher_worker executable"
#endif

extern char **environ;

/* ---- helpers ---- */

static double deadline_s(void) { return td_test_s(30.0); }

typedef td_proc run;

/* The job secret every launch gets in its environment unless a test clears it (so that runs do
 * not depend on the caller's TD_RPC_SECRET*; jobs over several nodes need one). */
static const char *g_secret = "TD_RPC_SECRET=launcher-test-secret-0123456789abcdef";

/* run_start_env spawns tdistrun with args (NULL-terminated, without argv[0]) in a process group
 * of its own, with the test's environment without any SLURM_* variable (the suite may itself run
 * under srun), plus stale values the launcher must override, a mark it must keep, and extra
 * ("NAME=value", NULL-terminated; may be NULL). */
static void run_start_env(run *r, const char *const *args, const char *const *extra) {
  const char *argv[64];
  int n = 0;
  argv[n++] = TDISTRUN_PATH;
  for (; args[n - 1]; n++) {
    assert_true(n < 63);
    argv[n] = args[n - 1];
  }
  argv[n] = NULL;

  size_t ne = 0, nx = 0;
  for (char **e = environ; *e; e++) ne++;
  while (extra && extra[nx]) nx++;
  char **env = calloc(ne + nx + 5, sizeof *env);
  assert_non_null(env);
  size_t k = 0;
  env[k++] = "RANK=99";
  env[k++] = "MASTER_PORT=1";
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "TD_LAUNCHER_MARK=", 17) != 0 && strncmp(*e, "SLURM_", 6) != 0 &&
        strncmp(*e, "TD_RPC_SECRET", 13) != 0 && strncmp(*e, "TD_RPC_INSECURE=", 16) != 0)
      env[k++] = *e;
  env[k++] = "TD_LAUNCHER_MARK=kept";
  if (g_secret) env[k++] = (char *)g_secret;
  for (size_t x = 0; x < nx; x++) env[k++] = (char *)extra[x];
  env[k] = NULL;
  int rc = td_proc_spawn(r, TDISTRUN_PATH, (char *const *)argv, env, true);
  free(env);
  if (rc != 0) fail_msg("spawning %s: %s", TDISTRUN_PATH, strerror(rc));
}

static void run_start(run *r, const char *const *args) { run_start_env(r, args, NULL); }

/* run_finish reads tdistrun's output to EOF and reaps it, failing the test (after SIGKILLing its
 * group) when that takes longer than the deadline. */
static void run_finish(run *r) {
  if (td_proc_finish(r, 30.0) != 0)
    fail_msg("tdistrun did not finish within %.0f s; stdout:\n%s\nstderr:\n%s", deadline_s(),
             r->out, r->err);
}

static void run_free(run *r) { td_proc_free(r); }

/* launch runs tdistrun with args to completion. */
static void launch(run *r, const char *const *args) {
  run_start(r, args);
  run_finish(r);
}

/* launch_env runs tdistrun with args and extra environment entries to completion. */
static void launch_env(run *r, const char *const *args, const char *const *extra) {
  run_start_env(r, args, extra);
  run_finish(r);
}

static int exit_code(const run *r) {
  if (!WIFEXITED(r->status))
    fail_msg("tdistrun did not exit normally (wait status %#x); stderr:\n%s", r->status, r->err);
  return WEXITSTATUS(r->status);
}

#define ASSERT_EXIT(r, code)                                                                   \
  do {                                                                                         \
    int got_ = exit_code(r);                                                                   \
    if (got_ != (code))                                                                        \
      fail_msg("tdistrun exit code %d, expected %d; stdout:\n%s\nstderr:\n%s", got_, (code),   \
               (r)->out, (r)->err);                                                            \
  } while (0)

/* has_line says whether text holds line as a whole line. */
static bool has_line(const char *text, const char *line) {
  size_t n = strlen(line);
  for (const char *p = text; (p = strstr(p, line)) != NULL; p++)
    if ((p == text || p[-1] == '\n') && (p[n] == '\n' || p[n] == '\0')) return true;
  return false;
}

#define ASSERT_LINE(text, ...)                                                                 \
  do {                                                                                         \
    char want_[512];                                                                           \
    snprintf(want_, sizeof want_, __VA_ARGS__);                                                \
    if (!has_line((text), want_)) fail_msg("missing line '%s' in:\n%s", want_, (text));        \
  } while (0)

#define ASSERT_CONTAINS(text, needle)                                                          \
  do {                                                                                         \
    if (!strstr((text), (needle))) fail_msg("missing '%s' in:\n%s", (needle), (text));         \
  } while (0)

static int count_lines(const char *text) {
  int n = 0;
  for (const char *p = text; *p; p++)
    if (*p == '\n') n++;
  return n;
}

/* Scratch directory for pid files; the teardown removes one a failed test left behind. */
static char *g_scratch;

static char *scratch_create(void) {
  char *d = strdup("/tmp/td_launcher_XXXXXX");
  assert_non_null(d);
  assert_non_null(mkdtemp(d));
  g_scratch = d;
  return d;
}

static void scratch_destroy(char *dir) {
  g_scratch = NULL;
  DIR *d = opendir(dir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char p[4096];
      snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
      unlink(p);
    }
    closedir(d);
  }
  rmdir(dir);
  free(dir);
}

/* teardown runs after every test: after a failure it kills the run left behind, reaps workers
 * that were orphaned to us (we are their subreaper on Linux) and removes the scratch dir. */
static int teardown(void **state) {
  (void)state;
  td_proc_kill_all();
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  if (g_scratch) scratch_destroy(g_scratch);
  return 0;
}

/* read_pid returns the pid recorded by rank for attempt, or -1 when there is none. */
static pid_t read_pid(const char *dir, int rank, int attempt) {
  char p[4096];
  snprintf(p, sizeof p, "%s/%d.%d.pid", dir, rank, attempt);
  FILE *f = fopen(p, "r");
  if (!f) return -1;
  long v = -1;
  if (fscanf(f, "%ld", &v) != 1) v = -1;
  fclose(f);
  return (pid_t)v;
}

/* wait_pid_files waits (bounded) until n ranks have written their pid for attempt. */
static void wait_pid_files(const char *dir, int n, int attempt) {
  double limit = td_test_now_s() + deadline_s();
  for (;;) {
    int have = 0;
    for (int r = 0; r < n; r++) have += read_pid(dir, r, attempt) > 0;
    if (have == n) return;
    if (td_test_now_s() > limit) fail_msg("only %d of %d workers wrote a pid file", have, n);
    td_test_sleep_ms(5);
  }
}

/* assert_workers_gone checks that no worker that wrote a pid for attempt still exists. A
 * survivor is killed so that the test run does not leak it, then the test fails. */
static void assert_workers_gone(const char *dir, int n, int attempt, int expect_pids) {
  int seen = 0;
  for (int r = 0; r < n; r++) {
    pid_t pid = read_pid(dir, r, attempt);
    if (pid <= 0) continue;
    seen++;
    if (kill(pid, 0) == 0 || errno != ESRCH) {
      kill(pid, SIGKILL);
      fail_msg("worker rank %d (pid %ld, attempt %d) survived tdistrun", r, (long)pid, attempt);
    }
  }
  assert_int_equal(seen, expect_pids);
}

/* ---- tests ---- */

static void test_launcher_env_vars_single_node(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "3", WORKER_PATH, "--env", NULL});
  ASSERT_EXIT(&r, 0);
  for (int k = 0; k < 3; k++) {
    ASSERT_LINE(r.out, "[%d]: RANK=%d", k, k);
    ASSERT_LINE(r.out, "[%d]: LOCAL_RANK=%d", k, k);
    ASSERT_LINE(r.out, "[%d]: WORLD_SIZE=3", k);
    ASSERT_LINE(r.out, "[%d]: LOCAL_WORLD_SIZE=3", k);
    ASSERT_LINE(r.out, "[%d]: NODE_RANK=0", k);
    ASSERT_LINE(r.out, "[%d]: MASTER_ADDR=127.0.0.1", k);
    ASSERT_LINE(r.out, "[%d]: MASTER_PORT=29500", k);
    ASSERT_LINE(r.out, "[%d]: TD_RESTART_COUNT=0", k);
    ASSERT_LINE(r.out, "[%d]: TD_LAUNCHER_MARK=kept", k);
  }
  assert_int_equal(count_lines(r.out), 3 * 10);
  assert_string_equal(r.err, "");
  run_free(&r);
}

static void test_launcher_env_vars_multi_node(void **state) {
  (void)state;
  run r;
  /* Also covers --opt=value and the torchrun spelling with underscores. */
  launch(&r, (const char *[]){"--nnodes=2", "--node_rank", "1", "--nproc-per-node", "2",
                              "--master-addr", "10.1.2.3", "--master-port=4242", "--",
                              WORKER_PATH, "--env", NULL});
  ASSERT_EXIT(&r, 0);
  for (int k = 0; k < 2; k++) {
    int rank = 2 + k;
    ASSERT_LINE(r.out, "[%d]: RANK=%d", rank, rank);
    ASSERT_LINE(r.out, "[%d]: LOCAL_RANK=%d", rank, k);
    ASSERT_LINE(r.out, "[%d]: WORLD_SIZE=4", rank);
    ASSERT_LINE(r.out, "[%d]: LOCAL_WORLD_SIZE=2", rank);
    ASSERT_LINE(r.out, "[%d]: NODE_RANK=1", rank);
    ASSERT_LINE(r.out, "[%d]: MASTER_ADDR=10.1.2.3", rank);
    ASSERT_LINE(r.out, "[%d]: MASTER_PORT=4242", rank);
  }
  assert_int_equal(count_lines(r.out), 2 * 10);
  run_free(&r);
}

/* Without a secret in its environment, tdistrun hands a new random one (64 hex digits) to all
 * workers of a job, a different one per job, and never prints it. */
/* value_of returns (static) what rank k printed for "NAME=" (up to the end of its line). */
static const char *value_of(const run *r, int k, const char *name) {
  static char v[256];
  char pfx[96];
  snprintf(pfx, sizeof pfx, "[%d]: %s=", k, name);
  const char *p = strstr(r->out, pfx);
  if (!p) fail_msg("no '%s' in:\n%s", pfx, r->out);
  p += strlen(pfx);
  size_t n = strcspn(p, "\n");
  snprintf(v, sizeof v, "%.*s", (int)(n < sizeof v ? n : sizeof v - 1), p);
  return v;
}

/* Every job has a run id: --rdzv-id, else a new random one per single-node job, the same for all
 * its workers (the library refuses workers of another run). */
static void test_launcher_run_id(void **state) {
  (void)state;
  char first[256] = "";
  for (int job = 0; job < 2; job++) {
    run r;
    launch(&r, (const char *[]){"--nproc-per-node", "2", WORKER_PATH, "--env", NULL});
    ASSERT_EXIT(&r, 0);
    char id0[256];
    snprintf(id0, sizeof id0, "%s", value_of(&r, 0, "TD_RUN_ID"));
    assert_string_equal(id0, value_of(&r, 1, "TD_RUN_ID"));
    assert_true(strncmp(id0, "tdistrun:", 9) == 0 && strlen(id0) == 9 + 16);
    if (job == 0) snprintf(first, sizeof first, "%s", id0);
    else assert_string_not_equal(first, id0);
    run_free(&r);
  }
  run r;
  launch(&r, (const char *[]){"--rdzv-id", "exp-42", "--nproc-per-node", "2", WORKER_PATH,
                              "--env", NULL});
  ASSERT_EXIT(&r, 0);
  assert_string_equal(value_of(&r, 0, "TD_RUN_ID"), "exp-42");
  assert_string_equal(value_of(&r, 1, "TD_RUN_ID"), "exp-42");
  run_free(&r);
}

/* kill -9 of tdistrun: its workers die with it (PR_SET_PDEATHSIG), none keeps running. */
static void test_launcher_sigkill_takes_workers_along(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  run_start(&r, (const char *[]){"--nproc-per-node", "3", WORKER_PATH, "--pid-dir", dir,
                                 "--sleep-ms", "60000", NULL});
  wait_pid_files(dir, 3, 0);
  assert_int_equal(kill(r.pid, SIGKILL), 0);
  run_finish(&r);
  /* this test is a subreaper: the orphans are our children now; each must end by SIGKILL */
  for (int k = 0; k < 3; k++) {
    pid_t pid = read_pid(dir, k, 0);
    int st = 0;
    pid_t got = 0;
    for (double end = td_test_now_s() + td_test_s(5.0); got == 0 && td_test_now_s() < end;
         td_test_sleep_ms(5))
      got = waitpid(pid, &st, WNOHANG);
    if (got != pid) {
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
      fail_msg("worker rank %d (pid %ld) outlived the SIGKILLed tdistrun", k, (long)pid);
    }
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  }
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_secret_generated_per_job(void **state) {
  (void)state;
  const char *saved = g_secret;
  g_secret = NULL;
  char first[128] = "";
  for (int job = 0; job < 2; job++) {
    run r;
    launch(&r, (const char *[]){"--nproc-per-node", "2", WORKER_PATH, "--secret", NULL});
    ASSERT_EXIT(&r, 0);
    char s[2][128];
    for (int k = 0; k < 2; k++) {
      char pfx[32];
      snprintf(pfx, sizeof pfx, "[%d]: TD_RPC_SECRET=", k);
      const char *p = strstr(r.out, pfx);
      assert_non_null(p);
      p += strlen(pfx);
      size_t n = strcspn(p, "\n");
      assert_int_equal(n, 64);
      assert_true(strspn(p, "0123456789abcdef") >= 64);
      memcpy(s[k], p, n);
      s[k][n] = 0;
    }
    assert_string_equal(s[0], s[1]);
    assert_null(strstr(r.err, s[0]));
    if (job == 0) snprintf(first, sizeof first, "%s", s[0]);
    else assert_string_not_equal(first, s[0]);
    run_free(&r);
  }
  g_secret = saved;
}

/* A secret the user gives reaches the workers unchanged; a job over several nodes without one
 * is refused with a message that says how to give one. */
static void test_launcher_secret_given_or_required(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "2", WORKER_PATH, "--secret", NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.out, "[0]: %s", g_secret);
  ASSERT_LINE(r.out, "[1]: %s", g_secret);
  run_free(&r);
  const char *saved = g_secret;
  g_secret = NULL;
  launch(&r, (const char *[]){"--nnodes", "2", "--node-rank", "0", WORKER_PATH, NULL});
  ASSERT_EXIT(&r, 2);
  ASSERT_CONTAINS(r.err, "TD_RPC_SECRET_FILE");
  assert_string_equal(r.out, "");
  run_free(&r);
  g_secret = saved;
}

/* check_stream checks that every line of text is "[r]: " plus the next line rank r should have
 * written, with r in 0..n-1, and that each rank's lines are all there. */
static void check_stream(const char *text, int n, int nlines, bool is_err) {
  int next[8] = {0};
  assert_true(n <= 8);
  assert_true(text[0] == '\0' || text[strlen(text) - 1] == '\n');
  const char *p = text;
  while (*p) {
    const char *eol = strchr(p, '\n');
    assert_non_null(eol);
    char line[1024];
    size_t len = (size_t)(eol - p);
    if (len >= sizeof line) fail_msg("line too long (%zu bytes)", len);
    memcpy(line, p, len);
    line[len] = '\0';
    int rank = -1, off = 0;
    if (sscanf(line, "[%d]: %n", &rank, &off) != 1 || off == 0 || rank < 0 || rank >= n)
      fail_msg("line without a valid rank prefix: '%s'", line);
    const char *body = line + off;
    char want[512];
    int i = next[rank];
    if (i < nlines) {
      int m = snprintf(want, sizeof want, is_err ? "err %d of rank %d" : "line %d of rank %d ",
                       i, rank);
      if (!is_err) {
        memset(want + m, 'a' + i % 26, 200);
        want[m + 200] = '\0';
      }
    } else if (i == nlines) {
      snprintf(want, sizeof want, is_err ? "epart-one epart-two" : "part-one part-two");
    } else if (i == nlines + 1) {
      snprintf(want, sizeof want, is_err ? "etail-no-newline" : "tail-no-newline");
    } else {
      fail_msg("extra line from rank %d: '%s'", rank, body);
    }
    if (strcmp(body, want) != 0)
      fail_msg("rank %d line %d is '%s', expected '%s'", rank, i, body, want);
    next[rank]++;
    p = eol + 1;
  }
  for (int r = 0; r < n; r++)
    if (next[r] != nlines + 2) fail_msg("rank %d wrote %d of %d lines", r, next[r], nlines + 2);
}

static void test_launcher_output_prefixed_per_line(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "3", WORKER_PATH, "--lines", "400",
                              "--partial", "--tail", NULL});
  ASSERT_EXIT(&r, 0);
  check_stream(r.out, 3, 400, false);
  check_stream(r.err, 3, 400, true);
  run_free(&r);
}

static void test_launcher_no_prefix_passes_through(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--no-prefix", "--nproc-per-node", "2", WORKER_PATH, "--env",
                              NULL});
  ASSERT_EXIT(&r, 0);
  assert_true(has_line(r.out, "RANK=0"));
  assert_true(has_line(r.out, "RANK=1"));
  assert_null(strstr(r.out, "]: "));
  assert_int_equal(count_lines(r.out), 2 * 10);
  run_free(&r);
}

static void test_launcher_failure_stops_group(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  /* The long grace period means only the SIGTERM to the survivors can end them in time. */
  launch(&r, (const char *[]){"--nproc-per-node", "3", "--stop-timeout", "600", WORKER_PATH,
                              "--pid-dir", dir, "--fail-rank", "1", "--wait-pids", "3",
                              "--sleep-ms", "60000", NULL});
  ASSERT_EXIT(&r, 1);
  ASSERT_LINE(r.err, "tdistrun: worker rank 1 (local 1) failed with exit code 3; no restarts "
                     "left (0 used)");
  if (r.elapsed > td_test_s(20.0)) fail_msg("the group took %.1f s to stop", r.elapsed);
  assert_workers_gone(dir, 3, 0, 3);
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_failure_escalates_to_sigkill(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  /* The survivors ignore SIGTERM, so only the SIGKILL after --stop-timeout ends them. */
  launch(&r, (const char *[]){"--nproc-per-node", "3", "--stop-timeout", "0.2", WORKER_PATH,
                              "--ignore-term", "--pid-dir", dir, "--fail-rank", "2",
                              "--wait-pids", "3", "--sleep-ms", "60000", NULL});
  ASSERT_EXIT(&r, 1);
  ASSERT_CONTAINS(r.err, "worker rank 2 (local 2) failed with exit code 3");
  if (r.elapsed > td_test_s(20.0)) fail_msg("the group took %.1f s to stop", r.elapsed);
  assert_workers_gone(dir, 3, 0, 3);
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_failure_by_signal_named(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "2", "--node-rank", "1", "--nnodes", "2",
                              WORKER_PATH, "--fail-rank", "3", "--signal", "9", NULL});
  ASSERT_EXIT(&r, 1);
  ASSERT_CONTAINS(r.err, "tdistrun: worker rank 3 (local 1) failed with signal 9");
  run_free(&r);
}

static void test_launcher_restart_after_failure(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "3", "--max-restarts", "2", WORKER_PATH,
                              "--env", "--pid-dir", dir, "--fail-rank", "1", "--fail-attempt",
                              "0", "--wait-pids", "3", NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.err, "tdistrun: worker rank 1 (local 1) failed with exit code 3; restarting the "
                     "group (restart 1 of 2)");
  for (int k = 0; k < 3; k++) {
    ASSERT_LINE(r.out, "[%d]: TD_RESTART_COUNT=0", k);
    ASSERT_LINE(r.out, "[%d]: TD_RESTART_COUNT=1", k);
  }
  assert_null(strstr(r.out, "TD_RESTART_COUNT=2"));
  assert_null(strstr(r.err, "restart 2 of 2"));
  assert_workers_gone(dir, 3, 0, 3);
  assert_workers_gone(dir, 3, 1, 3);
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_restarts_exhausted(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--nproc-per-node", "3", "--max-restarts", "1",
                              "--monitor-interval", "20", WORKER_PATH, "--env", "--fail-rank",
                              "2", "--exit-code", "5", NULL});
  ASSERT_EXIT(&r, 1);
  ASSERT_LINE(r.err, "tdistrun: worker rank 2 (local 2) failed with exit code 5; restarting the "
                     "group (restart 1 of 1)");
  ASSERT_LINE(r.err, "tdistrun: worker rank 2 (local 2) failed with exit code 5; no restarts "
                     "left (1 used)");
  ASSERT_LINE(r.out, "[2]: TD_RESTART_COUNT=1");
  run_free(&r);
}

static void test_launcher_sigterm_stops_workers(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  run_start(&r, (const char *[]){"--nproc-per-node", "3", "--stop-timeout", "600", WORKER_PATH,
                                 "--pid-dir", dir, "--sleep-ms", "60000", NULL});
  wait_pid_files(dir, 3, 0);
  assert_int_equal(kill(r.pid, SIGTERM), 0);
  run_finish(&r);
  ASSERT_EXIT(&r, 128 + SIGTERM);
  if (r.elapsed > td_test_s(20.0)) fail_msg("tdistrun took %.1f s to stop", r.elapsed);
  assert_workers_gone(dir, 3, 0, 3);
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_second_signal_kills(void **state) {
  (void)state;
  char *dir = scratch_create();
  run r;
  /* Workers ignore SIGTERM/SIGINT and the grace period is long: only the second signal's
   * SIGKILL can end them in time. */
  run_start(&r, (const char *[]){"--nproc-per-node", "2", "--stop-timeout", "600", WORKER_PATH,
                                 "--ignore-term", "--pid-dir", dir, "--sleep-ms", "60000",
                                 NULL});
  wait_pid_files(dir, 2, 0);
  assert_int_equal(kill(r.pid, SIGINT), 0);
  td_test_sleep_ms(50);
  assert_int_equal(kill(r.pid, SIGTERM), 0);
  run_finish(&r);
  ASSERT_EXIT(&r, 128 + SIGINT);
  if (r.elapsed > td_test_s(20.0)) fail_msg("tdistrun took %.1f s to stop", r.elapsed);
  assert_workers_gone(dir, 2, 0, 2);
  run_free(&r);
  scratch_destroy(dir);
}

static void test_launcher_standalone_free_port(void **state) {
  (void)state;
  run r;
  launch(&r, (const char *[]){"--standalone", "--nproc-per-node", "2", WORKER_PATH, "--env",
                              NULL});
  ASSERT_EXIT(&r, 0);
  int port[2] = {-1, -1};
  for (int k = 0; k < 2; k++) {
    char key[64];
    snprintf(key, sizeof key, "[%d]: MASTER_PORT=", k);
    const char *p = strstr(r.out, key);
    assert_non_null(p);
    port[k] = atoi(p + strlen(key));
    ASSERT_LINE(r.out, "[%d]: MASTER_ADDR=127.0.0.1", k);
    ASSERT_LINE(r.out, "[%d]: WORLD_SIZE=2", k);
  }
  assert_int_equal(port[0], port[1]);
  assert_true(port[0] > 0 && port[0] <= 65535);
  assert_int_not_equal(port[0], 29500); /* the kernel's ephemeral range normally excludes it */
  run_free(&r);

  /* An explicit --master-port wins. */
  launch(&r, (const char *[]){"--standalone", "--master-port", "23456", WORKER_PATH, "--env",
                              NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.out, "[0]: MASTER_PORT=23456");
  run_free(&r);
}

static void test_launcher_bad_arguments(void **state) {
  (void)state;
  static const struct {
    const char *args[8];
    const char *msg;
  } cases[] = {
      {{"--nproc-per-node", "0", WORKER_PATH}, "--nproc-per-node must be an integer in 1.."},
      {{"--nproc-per-node", "2x", WORKER_PATH}, "--nproc-per-node must be an integer"},
      {{"--nnodes", "0", WORKER_PATH}, "--nnodes must be an integer >= 1"},
      {{"--nnodes", "2", "--node-rank", "2", WORKER_PATH}, "--node-rank 2 is out of range"},
      {{"--node-rank", "1", WORKER_PATH}, "--node-rank 1 is out of range for --nnodes 1"},
      {{"--master-port", "70000", WORKER_PATH}, "--master-port must be an integer in 1..65535"},
      {{"--master-port", "0", WORKER_PATH}, "--master-port must be an integer in 1..65535"},
      {{"--max-restarts", "-1", WORKER_PATH}, "--max-restarts must be an integer >= 0"},
      {{"--monitor-interval", "0", WORKER_PATH}, "--monitor-interval must be"},
      {{"--stop-timeout", "abc", WORKER_PATH}, "--stop-timeout must be"},
      {{"--standalone", "--nnodes", "2", WORKER_PATH}, "--standalone runs a single node"},
      {{"--bogus", WORKER_PATH}, "unknown option '--bogus'"},
      {{"--nproc-per-node"}, "option '--nproc-per-node' needs a value"},
      {{"--nproc-per-node", "2"}, "missing PROGRAM"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    run r;
    launch(&r, cases[c].args);
    ASSERT_EXIT(&r, 2);
    ASSERT_CONTAINS(r.err, cases[c].msg);
    ASSERT_CONTAINS(r.err, "--help");
    assert_string_equal(r.out, "");
    run_free(&r);
  }
  run r;
  launch(&r, (const char *[]){"--help", NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_CONTAINS(r.out, "usage: tdistrun");
  run_free(&r);

  launch(&r, (const char *[]){"--nproc-per-node", "2", "/nonexistent/td_no_such_program", NULL});
  ASSERT_EXIT(&r, 127);
  ASSERT_CONTAINS(r.err, "cannot start worker rank 0");
  run_free(&r);
}

/* Under srun (one tdistrun per node) the node rank, node count, master host and port come from
 * Slurm's variables; step-level ones win over job-level ones. */
static void test_launcher_slurm_env(void **state) {
  (void)state;
  run r;
  launch_env(&r, (const char *[]){"--nproc-per-node", "2", WORKER_PATH, "--env", NULL},
             (const char *[]){"SLURM_NODEID=1", "SLURM_NNODES=4", "SLURM_STEP_NUM_NODES=3",
                              "SLURM_JOB_NODELIST=gpu[01-04,07]", "SLURM_STEP_NODELIST=h[2-4]",
                              "SLURM_JOB_ID=12345", "SLURM_NTASKS=3", "SLURM_PROCID=1", NULL});
  ASSERT_EXIT(&r, 0);
  for (int k = 0; k < 2; k++) {
    int rank = 2 + k;
    ASSERT_LINE(r.out, "[%d]: RANK=%d", rank, rank);
    ASSERT_LINE(r.out, "[%d]: LOCAL_RANK=%d", rank, k);
    ASSERT_LINE(r.out, "[%d]: WORLD_SIZE=6", rank);
    ASSERT_LINE(r.out, "[%d]: NODE_RANK=1", rank);
    ASSERT_LINE(r.out, "[%d]: MASTER_ADDR=h2", rank);
    ASSERT_LINE(r.out, "[%d]: MASTER_PORT=%d", rank, 20000 + 12345 % 12000);
  }
  ASSERT_CONTAINS(r.err, "tdistrun: under Slurm: node 1 of 3, MASTER_ADDR h2, MASTER_PORT 20345");
  run_free(&r);

  /* job-level fallbacks; no SLURM_JOB_ID keeps the default port */
  launch_env(&r, (const char *[]){WORKER_PATH, "--env", NULL},
             (const char *[]){"SLURM_NODEID=0", "SLURM_NNODES=2",
                              "SLURM_JOB_NODELIST=a1,b[2-3]", NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.out, "[0]: WORLD_SIZE=2");
  ASSERT_LINE(r.out, "[0]: NODE_RANK=0");
  ASSERT_LINE(r.out, "[0]: MASTER_ADDR=a1");
  ASSERT_LINE(r.out, "[0]: MASTER_PORT=29500");
  run_free(&r);

  /* options given on the command line win over Slurm */
  launch_env(&r, (const char *[]){"--nnodes", "1", "--node-rank", "0", "--master-addr",
                                  "10.1.2.3", "--master-port", "4242", WORKER_PATH, "--env",
                                  NULL},
             (const char *[]){"SLURM_NODEID=2", "SLURM_NNODES=3", "SLURM_JOB_NODELIST=h[1-3]",
                              "SLURM_JOB_ID=7", "SLURM_NTASKS=9", NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.out, "[0]: RANK=0");
  ASSERT_LINE(r.out, "[0]: WORLD_SIZE=1");
  ASSERT_LINE(r.out, "[0]: MASTER_ADDR=10.1.2.3");
  ASSERT_LINE(r.out, "[0]: MASTER_PORT=4242");
  run_free(&r);

  /* --standalone ignores Slurm */
  launch_env(&r, (const char *[]){"--standalone", WORKER_PATH, "--env", NULL},
             (const char *[]){"SLURM_NODEID=1", "SLURM_NNODES=3", "SLURM_JOB_NODELIST=h[1-3]",
                              NULL});
  ASSERT_EXIT(&r, 0);
  ASSERT_LINE(r.out, "[0]: WORLD_SIZE=1");
  ASSERT_LINE(r.out, "[0]: MASTER_ADDR=127.0.0.1");
  assert_string_equal(r.err, "");
  run_free(&r);
}

static void test_launcher_slurm_env_errors(void **state) {
  (void)state;
  static const struct {
    const char *env[6];
    const char *msg;
  } cases[] = {
      {{"SLURM_NODEID=0", "SLURM_NNODES=3", "SLURM_NTASKS=6", "SLURM_JOB_NODELIST=h[1-3]"},
       "--ntasks-per-node=1"},
      {{"SLURM_NODEID=0", "SLURM_NNODES=3", "SLURM_JOB_NODELIST=h[3-1]"}, "reversed range"},
      {{"SLURM_NODEID=0", "SLURM_NNODES=3", "SLURM_JOB_NODELIST=h[1-3"}, "unbalanced"},
      {{"SLURM_NODEID=x", "SLURM_NNODES=3"}, "SLURM_NODEID='x'"},
      {{"SLURM_NODEID=0", "SLURM_NNODES=0"}, "SLURM_NNODES='0'"},
      {{"SLURM_NODEID=3", "SLURM_NNODES=3", "SLURM_JOB_NODELIST=h[1-3]"},
       "--node-rank 3 is out of range for --nnodes 3"},
      {{"SLURM_NODEID=0", "SLURM_NNODES=1", "SLURM_JOB_ID=12x"}, "SLURM_JOB_ID '12x'"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    run r;
    launch_env(&r, (const char *[]){WORKER_PATH, "--env", NULL}, cases[c].env);
    ASSERT_EXIT(&r, 2);
    ASSERT_CONTAINS(r.err, cases[c].msg);
    assert_string_equal(r.out, "");
    run_free(&r);
  }
}

int main(void) {
#ifdef __linux__
  /* Workers that outlive tdistrun become our children (not init's), so a survivor shows up
   * even as a zombie and the teardown can reap it. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_launcher_env_vars_single_node, teardown),
      cmocka_unit_test_teardown(test_launcher_env_vars_multi_node, teardown),
      cmocka_unit_test_teardown(test_launcher_secret_generated_per_job, teardown),
      cmocka_unit_test_teardown(test_launcher_run_id, teardown),
      cmocka_unit_test_teardown(test_launcher_sigkill_takes_workers_along, teardown),
      cmocka_unit_test_teardown(test_launcher_secret_given_or_required, teardown),
      cmocka_unit_test_teardown(test_launcher_output_prefixed_per_line, teardown),
      cmocka_unit_test_teardown(test_launcher_no_prefix_passes_through, teardown),
      cmocka_unit_test_teardown(test_launcher_failure_stops_group, teardown),
      cmocka_unit_test_teardown(test_launcher_failure_escalates_to_sigkill, teardown),
      cmocka_unit_test_teardown(test_launcher_failure_by_signal_named, teardown),
      cmocka_unit_test_teardown(test_launcher_restart_after_failure, teardown),
      cmocka_unit_test_teardown(test_launcher_restarts_exhausted, teardown),
      cmocka_unit_test_teardown(test_launcher_sigterm_stops_workers, teardown),
      cmocka_unit_test_teardown(test_launcher_second_signal_kills, teardown),
      cmocka_unit_test_teardown(test_launcher_standalone_free_port, teardown),
      cmocka_unit_test_teardown(test_launcher_bad_arguments, teardown),
      cmocka_unit_test_teardown(test_launcher_slurm_env, teardown),
      cmocka_unit_test_teardown(test_launcher_slurm_env_errors, teardown),
  };
  return cmocka_run_group_tests_name("launcher", tests, NULL, NULL);
}
