/* launcher_worker.c - the worker program that test_launcher runs under tdistrun.
 *
 * Steps, in order, each enabled by an option:
 *   --ignore-term        ignore SIGTERM and SIGINT (tests the SIGKILL escalation)
 *   --pid-dir D          write this process's pid to D/<RANK>.<TD_RESTART_COUNT>.pid (atomically,
 *                        through a rename)
 *   --env                print "NAME=value" for each launcher variable (and TD_LAUNCHER_MARK,
 *                        TD_RUN_ID)
 *   --secret             print "TD_RPC_SECRET=value" (the job secret the launcher handed over)
 *   --lines N            print N long lines to stdout and N to stderr, each in two write() calls
 *   --partial            print "part-one " and, after 20 ms, "part-two\n" on stdout and stderr
 *   --fail-rank R        fail when RANK == R ...
 *   --fail-attempt A     ... and TD_RESTART_COUNT == A (default: any attempt)
 *   --wait-pids N        ... after N pid files of this attempt exist in --pid-dir (max 20 s)
 *   --exit-code C        fail by exiting with C (default 3)
 *   --signal S           fail by raising signal S instead
 *   --sleep-ms M         then sleep M ms (signals end it as their default action says)
 *   --tail               finally print "tail-no-newline" (no '\n') to stdout and stderr
 * Output goes through write(2), so nothing waits in stdio buffers.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void out(int fd, const char *s, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, s, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      exit(90);
    }
    s += w;
    n -= (size_t)w;
  }
}

static void outs(int fd, const char *s) { out(fd, s, strlen(s)); }

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int env_int(const char *name) {
  const char *v = getenv(name);
  return v ? atoi(v) : -1;
}

static int count_pid_files(const char *dir, int attempt, int world) {
  int n = 0;
  for (int r = 0; r < world; r++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%d.%d.pid", dir, r, attempt);
    if (access(path, F_OK) == 0) n++;
  }
  return n;
}

int main(int argc, char **argv) {
  const char *pid_dir = NULL;
  int env = 0, partial = 0, tail = 0, ignore_term = 0, secret = 0;
  long lines = 0, sleep = 0;
  int fail_rank = -1, fail_attempt = -1, wait_pids = 0, exit_code = 3, sig = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define VALUE()                                              \
  (v ? (i++, v) : (fprintf(stderr, "%s needs a value\n", a), exit(64), ""))
    if (!strcmp(a, "--env")) env = 1;
    else if (!strcmp(a, "--secret")) secret = 1;
    else if (!strcmp(a, "--partial")) partial = 1;
    else if (!strcmp(a, "--tail")) tail = 1;
    else if (!strcmp(a, "--ignore-term")) ignore_term = 1;
    else if (!strcmp(a, "--pid-dir")) pid_dir = VALUE();
    else if (!strcmp(a, "--lines")) lines = atol(VALUE());
    else if (!strcmp(a, "--sleep-ms")) sleep = atol(VALUE());
    else if (!strcmp(a, "--fail-rank")) fail_rank = atoi(VALUE());
    else if (!strcmp(a, "--fail-attempt")) fail_attempt = atoi(VALUE());
    else if (!strcmp(a, "--wait-pids")) wait_pids = atoi(VALUE());
    else if (!strcmp(a, "--exit-code")) exit_code = atoi(VALUE());
    else if (!strcmp(a, "--signal")) sig = atoi(VALUE());
    else {
      fprintf(stderr, "launcher_worker: unknown argument '%s'\n", a);
      return 64;
    }
#undef VALUE
  }
  int rank = env_int("RANK"), attempt = env_int("TD_RESTART_COUNT");
  int world = env_int("WORLD_SIZE");
  char buf[1024];

  if (ignore_term) {
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
  }
  if (env) {
    static const char *const names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                        "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                        "TD_RESTART_COUNT", "TD_LAUNCHER_MARK", "TD_RUN_ID"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
      const char *v = getenv(names[k]);
      snprintf(buf, sizeof buf, "%s=%s\n", names[k], v ? v : "(unset)");
      outs(STDOUT_FILENO, buf);
    }
  }
  if (secret) {
    const char *v = getenv("TD_RPC_SECRET");
    snprintf(buf, sizeof buf, "TD_RPC_SECRET=%s\n", v ? v : "(unset)");
    outs(STDOUT_FILENO, buf);
  }
  for (long i = 0; i < lines; i++) {
    /* ~250 bytes, written in two pieces so that the launcher sees split lines. */
    int n = snprintf(buf, sizeof buf, "line %ld of rank %d ", i, rank);
    memset(buf + n, 'a' + (int)(i % 26), 200);
    n += 200;
    buf[n++] = '\n';
    out(STDOUT_FILENO, buf, (size_t)n / 2);
    out(STDOUT_FILENO, buf + n / 2, (size_t)n - (size_t)n / 2);
    n = snprintf(buf, sizeof buf, "err %ld of rank %d\n", i, rank);
    out(STDERR_FILENO, buf, 4);
    out(STDERR_FILENO, buf + 4, (size_t)n - 4);
  }
  if (partial) {
    outs(STDOUT_FILENO, "part-one ");
    outs(STDERR_FILENO, "epart-one ");
    sleep_ms(20);
    outs(STDOUT_FILENO, "part-two\n");
    outs(STDERR_FILENO, "epart-two\n");
  }
  /* the pid file also says "my output is written": a worker that fails after waiting for
   * everybody's pid file cannot cut the others' output short */
  if (pid_dir) {
    char tmp[4096], path[4096];
    snprintf(tmp, sizeof tmp, "%s/.%d.%d.tmp", pid_dir, rank, attempt);
    snprintf(path, sizeof path, "%s/%d.%d.pid", pid_dir, rank, attempt);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%ld\n", (long)getpid()) < 0 || fclose(f) != 0 || rename(tmp, path))
      return 91;
  }
  if (rank == fail_rank && (fail_attempt < 0 || attempt == fail_attempt)) {
    if (wait_pids > 0 && pid_dir) {
      for (int t = 0; t < 4000 && count_pid_files(pid_dir, attempt, world) < wait_pids; t++)
        sleep_ms(5);
    }
    if (sig) {
      signal(sig, SIG_DFL);
      raise(sig);
    }
    return exit_code;
  }
  if (sleep > 0) sleep_ms(sleep);
  if (tail) {
    outs(STDOUT_FILENO, "tail-no-newline");
    outs(STDERR_FILENO, "etail-no-newline");
  }
  return 0;
}
