/* mp_util.c - clocks scaled for slow machines, the forked multi-process test runner, worker
 * options and shutdown (see mp_util.h). */
#include "mp_util.h"

#include "tdist/rpc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Whether port is free on 127.0.0.1 now (bound and released; SO_REUSEADDR as the gRPC server
 * binds, so a port whose old connections linger in TIME_WAIT counts as free, as it is to it).
 * port 0: any; the port bound is returned, or -1. */
static int probe_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons((uint16_t)port);
  socklen_t len = sizeof sa;
  int got = -1;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
    got = ntohs(sa.sin_port);
  close(fd);
  return got;
}

/* A port below the kernel's ephemeral range (net.ipv4.ip_local_port_range), chosen at random:
 * a port from that range (what binding port 0 gives) could be taken, between this probe and the
 * worker's bind, by any socket bound to port 0 or connecting out meanwhile (every worker's
 * server and every connection of the tests running beside this one: CI once lost a case so,
 * "port ... is in use"). Below the range only another test's random pick can meet it. */
int td_mp_free_port(void) {
  int lo = 32768, hi = 60999;
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f) {
    if (fscanf(f, "%d %d", &lo, &hi) != 2) lo = 32768;
    fclose(f);
  }
  const int first = 10000;
  if (lo - first >= 1000) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    unsigned seed = (unsigned)getpid() * 2654435761u ^ (unsigned)ts.tv_nsec;
    for (int i = 0; i < 100; i++) {
      int port = first + (int)(rand_r(&seed) % (unsigned)(lo - first));
      if (probe_port(port) == port) return port;
    }
  }
  return probe_port(0);
}

double td_test_timeout_scale(void) {
  const char *e = getenv("TD_TEST_TIMEOUT_SCALE");
  double v = e ? atof(e) : 1.0;
  return v > 0 ? v : 1.0;
}

int64_t td_test_ms(int64_t ms) { return (int64_t)((double)ms * td_test_timeout_scale()); }

double td_test_s(double s) { return s * td_test_timeout_scale(); }

double td_test_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void td_test_sleep_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

td_rpc_options td_mp_rpc_options(const char *init_method, int threads) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = init_method;
  o.num_worker_threads = threads;
  o.init_timeout_ms = td_test_ms(30000);
  o.rpc_timeout_ms = td_test_ms(30000);
  return o;
}

void td_mp_finish(td_rpc_agent *a, double timeout_s) {
  MP_CHECK_OK(td_rpc_shutdown(a, true, (int64_t)(td_test_s(timeout_s) * 1000)));
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
}

int td_mp_run(int world, td_mp_fn fn, void *arg, double timeout_s, int *codes) {
  double scale = td_test_timeout_scale();
  td_rpc_secret_ensure_env(); /* every group a test starts authenticates (one secret per run) */
  int port = td_mp_free_port();
  char method[64];
  snprintf(method, sizeof method, "tcp://127.0.0.1:%d", port);
  pid_t *pids = calloc((size_t)world, sizeof *pids);
  int *done = calloc((size_t)world, sizeof *done);
  int failures = 0;
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < world; r++) {
    pid_t p = fork();
    if (p == 0) {
      int rc = fn(r, world, method, arg);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
    pids[r] = p;
    if (p < 0) {
      done[r] = 1;
      failures++;
      if (codes) codes[r] = -1;
    }
  }
  double deadline = td_test_now_s() + timeout_s * scale;
  int left = world - failures;
  while (left > 0) {
    int status;
    pid_t p = waitpid(-1, &status, WNOHANG);
    if (p > 0) {
      for (int r = 0; r < world; r++) {
        if (pids[r] != p || done[r]) continue;
        done[r] = 1;
        left--;
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (codes) codes[r] = code;
        if (code != 0) failures++;
      }
      continue;
    }
    if (td_test_now_s() > deadline) break;
    td_test_sleep_ms(2);
  }
  for (int r = 0; r < world; r++) {
    if (done[r] || pids[r] <= 0) continue;
    fprintf(stderr, "td_mp_run: rank %d (pid %d) still running after %.1f s: killing it\n", r,
            (int)pids[r], timeout_s * scale);
    kill(pids[r], SIGKILL);
    waitpid(pids[r], NULL, 0);
    if (codes) codes[r] = 124;
    failures++;
  }
  free(pids);
  free(done);
  return failures;
}
