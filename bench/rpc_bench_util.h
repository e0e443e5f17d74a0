/* rpc_bench_util.h - shared helpers of the two-worker RPC benchmarks (rpc_latency, rpc_throughput,
 * rpc_bandwidth). Header-only (static functions): every C file under bench/ becomes a program.
 *
 * rb_start() picks a free port on 127.0.0.1, forks rank 1 (which joins, serves calls until rank 0
 * says "done" through a pipe, then shuts down gracefully and exits), and joins as rank 0 in the
 * calling process. rb_finish() tells rank 1 to stop, shuts rank 0 down gracefully and reaps rank 1
 * (killing it by pid if it does not exit in time). Rank 1 waits on a pipe rather than inside
 * td_rpc_shutdown so that its shutdown barrier does not poll rank 0's store while rank 0 measures.
 *
 * Command-line options common to the RPC benchmarks: --threads N (num_worker_threads of both
 * agents, default 16 like PyTorch's TensorPipe default).
 */
#ifndef TD_RPC_BENCH_UTIL_H
#define TD_RPC_BENCH_UTIL_H

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_net.h"
#include "tdist/rpc.h"

static const char *rb_prog = "rpc_bench";

#define RB_CHECK(expr)                                                                          \
  do {                                                                                          \
    td_status rb_s_ = (expr);                                                                   \
    if (rb_s_ != TD_OK) {                                                                       \
      fprintf(stderr, "%s [pid %d]: %s failed: %s: %s\n", rb_prog, (int)getpid(), #expr,       \
              td_status_name(rb_s_), td_last_error());                                          \
      fflush(stderr);                                                                           \
      _exit(1);                                                                                 \
    }                                                                                           \
  } while (0)

static inline uint64_t rb_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* rb_arg_int parses a non-negative integer option value or exits with status 2. */
static inline long long rb_arg_int(const char *name, const char *v) {
  char *end;
  long long x = v ? strtoll(v, &end, 0) : -1;
  if (!v || *end || end == v || x < 0) {
    fprintf(stderr, "%s: bad value '%s' for %s\n", rb_prog, v ? v : "(missing)", name);
    exit(2);
  }
  return x;
}

/* rb_blas_threads writes OPENBLAS_NUM_THREADS as JSON (a number, or null when unset or not a
 * number) into buf. */
static inline const char *rb_blas_threads(char *buf, size_t n) {
  const char *env = getenv("OPENBLAS_NUM_THREADS");
  if (env && *env && strspn(env, "0123456789") == strlen(env) && strlen(env) < 10)
    snprintf(buf, n, "%s", env);
  else
    snprintf(buf, n, "null");
  return buf;
}

/* rb_cmp_u64 orders uint64_t values for qsort. */
static inline int rb_cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static inline int rb_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* rb_quantile returns the q-quantile (0..1) of sorted[0..n) with linear interpolation between
 * closest ranks (numpy's default; the PyTorch peers use the same rule). */
static inline double rb_quantile(const double *sorted, size_t n, double q) {
  if (n == 0) return 0.0;
  double pos = q * (double)(n - 1);
  size_t i = (size_t)pos;
  if (i + 1 >= n) return sorted[n - 1];
  double frac = pos - (double)i;
  return sorted[i] + (sorted[i + 1] - sorted[i]) * frac;
}

typedef struct rb_pair {
  pid_t child;        /* rank 1 */
  int start_fd;       /* write end of the pipe rank 1 waits on before it joins */
  int go_fd;          /* write end of the pipe rank 1 waits on before it leaves */
  char method[64];    /* tcp://127.0.0.1:<port> */
  td_rpc_options o;   /* both ranks' options (the strings below live here too) */
  char secret[65], cert[96], key[96], ca[96];
  td_rpc_agent *agent; /* rank 0 (this process) */
} rb_pair;

static void rb_rank1(const td_rpc_options *base, int rfd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the benchmark */
  td_rpc_agent *a = NULL;
  RB_CHECK(td_rpc_init("worker1", 1, 2, base, &a));
  char b;
  ssize_t n;
  do {
    n = read(rfd, &b, 1);
  } while (n < 0 && errno == EINTR);
  /* a byte: rank 0 is done and shuts down gracefully too; EOF: rank 0 died */
  td_status st = td_rpc_shutdown(a, n == 1, 60000);
  td_rpc_destroy(a);
  fflush(stderr);
  _exit(n == 1 && st == TD_OK ? 0 : 1);
}

/* How the two workers protect their group: a job secret (the default of every tdist group), no
 * authentication at all, or the secret plus mutual TLS. */
typedef enum { RB_SECRET, RB_INSECURE, RB_TLS } rb_security;
static const char *const rb_security_names[] = {"secret", "insecure", "tls"};

/* TLS files for RB_TLS, made once per process with the openssl tool in a private directory that
 * is removed at exit. */
static char rb_tls_dir[64];
static void rb_tls_cleanup(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", rb_tls_dir);
  if (rb_tls_dir[0] && system(cmd) != 0) fprintf(stderr, "%s: could not remove %s\n", rb_prog,
                                                  rb_tls_dir);
}
static inline bool rb_tls_files(void) {
  if (rb_tls_dir[0]) return true;
  snprintf(rb_tls_dir, sizeof rb_tls_dir, "/tmp/td_bench_tls_XXXXXX");
  if (!mkdtemp(rb_tls_dir)) return false;
  atexit(rb_tls_cleanup);
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "cd %s && umask 077 && printf 'subjectAltName=DNS:tdist\\n' > ext && "
           "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ca -keyout ca.key "
           "-out ca.pem && openssl req -newkey rsa:2048 -nodes -subj /CN=tdist -keyout w.key "
           "-out w.csr && openssl x509 -req -in w.csr -CA ca.pem -CAkey ca.key "
           "-CAcreateserial -days 2 -extfile ext -out w.pem > /dev/null 2>&1",
           rb_tls_dir);
  return system(cmd) == 0;
}

/* rb_prepare forks rank 1 of a pair protected as sec says; it waits until rb_begin. A benchmark
 * that measures several pairs prepares them all before the first one starts: a child forked
 * after gRPC has run in the parent inherits a half-copied gRPC (its threads are not copied) and
 * misbehaves (runaway keepalive pings, which a server answers with GOAWAY). Exits the process on
 * failure. */
static inline void rb_prepare(rb_pair *p, int threads, rb_security sec) {
  memset(p, 0, sizeof *p);
  int port = bench_free_port();
  if (port <= 0) {
    fprintf(stderr, "%s: no free port on 127.0.0.1\n", rb_prog);
    exit(1);
  }
  snprintf(p->method, sizeof p->method, "tcp://127.0.0.1:%d", port);
  td_rpc_options *o = &p->o;
  td_rpc_options_init(o);
  o->init_method = p->method;
  o->num_worker_threads = threads;
  o->init_timeout_ms = 60000;
  if (sec == RB_INSECURE) {
    o->insecure = 1;
  } else {
    if (td_rpc_secret_generate(p->secret, sizeof p->secret) != TD_OK) {
      fprintf(stderr, "%s: %s\n", rb_prog, td_last_error());
      exit(1);
    }
    o->secret = p->secret;
  }
  if (sec == RB_TLS) {
    if (!rb_tls_files()) {
      fprintf(stderr, "%s: cannot make TLS certificates (is openssl installed?)\n", rb_prog);
      exit(1);
    }
    snprintf(p->cert, sizeof p->cert, "%s/w.pem", rb_tls_dir);
    snprintf(p->key, sizeof p->key, "%s/w.key", rb_tls_dir);
    snprintf(p->ca, sizeof p->ca, "%s/ca.pem", rb_tls_dir);
    o->tls_cert_file = p->cert;
    o->tls_key_file = p->key;
    o->tls_ca_file = p->ca;
  }
  int go[2], start[2];
  if (pipe(go) != 0 || pipe(start) != 0) {
    perror("pipe");
    exit(1);
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(1);
  }
  if (pid == 0) {
    close(go[1]);
    close(start[1]);
    char c;
    ssize_t n;
    do {
      n = read(start[0], &c, 1);
    } while (n < 0 && errno == EINTR);
    if (n != 1) _exit(1); /* rank 0 gave up before starting this pair */
    close(start[0]);
    rb_rank1(o, go[0]);
  }
  close(go[0]);
  close(start[0]);
  p->child = pid;
  p->go_fd = go[1];
  p->start_fd = start[1];
}

/* rb_begin lets rank 1 join and joins as rank 0. Register the benchmark's functions before. */
static inline void rb_begin(rb_pair *p) {
  char c = 1;
  if (write(p->start_fd, &c, 1) != 1) perror("write");
  close(p->start_fd);
  p->start_fd = -1;
  td_status st = td_rpc_init("worker0", 0, 2, &p->o, &p->agent);
  if (st != TD_OK) {
    fprintf(stderr, "%s: td_rpc_init failed: %s: %s\n", rb_prog, td_status_name(st),
            td_last_error());
    kill(p->child, SIGKILL);
    waitpid(p->child, NULL, 0);
    exit(1);
  }
}

/* rb_start_auth forks rank 1 and joins as rank 0, both protected as sec says. */
static inline void rb_start_auth(rb_pair *p, int threads, rb_security sec) {
  rb_prepare(p, threads, sec);
  rb_begin(p);
}

/* rb_start: rb_start_auth with authentication on (the default of every tdist group). */
static inline void rb_start(rb_pair *p, int threads) { rb_start_auth(p, threads, RB_SECRET); }

/* rb_path names the path rank 0's frames to rank 1 took so far: "lane" when most went through the
 * same-host lane (td_rpc_options.shm_lane), else "grpc". */
static inline const char *rb_path(rb_pair *p) {
  td_rpc_traffic tr;
  if (td_rpc_get_peer_traffic(p->agent, 1, &tr) != TD_OK) return "grpc";
  return tr.lane_frames_sent > tr.frames_sent ? "lane" : "grpc";
}

/* rb_finish stops both workers. Returns 0 when both shut down cleanly. */
static inline int rb_finish(rb_pair *p) {
  char b = 1;
  ssize_t w = write(p->go_fd, &b, 1);
  close(p->go_fd);
  td_status st = td_rpc_shutdown(p->agent, w == 1, 60000);
  if (st != TD_OK)
    fprintf(stderr, "%s: rank 0 shutdown: %s: %s\n", rb_prog, td_status_name(st), td_last_error());
  td_rpc_destroy(p->agent);
  p->agent = NULL;
  int code = -1;
  uint64_t give_up = rb_now_ns() + 30ull * 1000000000ull;
  for (;;) {
    int status;
    pid_t r = waitpid(p->child, &status, WNOHANG);
    if (r == p->child) {
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (r < 0 || rb_now_ns() > give_up) {
      fprintf(stderr, "%s: rank 1 (pid %d) did not exit: killing it\n", rb_prog, (int)p->child);
      kill(p->child, SIGKILL);
      waitpid(p->child, NULL, 0);
      break;
    }
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
  }
  if (code != 0) fprintf(stderr, "%s: rank 1 exited with %d\n", rb_prog, code);
  return st == TD_OK && code == 0 ? 0 : 1;
}

/* rb_abort kills rank 1 (by pid) after a failure on rank 0 and exits with status 1. */
static inline void rb_abort(rb_pair *p) {
  kill(p->child, SIGKILL);
  waitpid(p->child, NULL, 0);
  exit(1);
}

#endif
