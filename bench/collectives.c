/* collectives.c - collective operations of a CPU process group: time per call, algorithm and bus
 * bandwidth, for several operations, sizes and process counts.
 *
 * For each process count P (--nprocs, default 2,4) this process forks P workers (it never uses
 * gRPC itself, so forking stays safe), which join one RPC group on 127.0.0.1 and create one CPU
 * process group over every worker. Then, for each operation and size, every member runs the same
 * loop:
 *   warm-up calls; rank 0 estimates the time per call and broadcasts an iteration count that
 *   fills about --min-time-ms; barrier; `iters` timed calls back to back; each member's mean time
 *   per call; the maximum over members (an all_reduce MAX) is the reported time_us.
 * Sizes follow nccl-tests: `bytes` is the whole buffer of the operation - the tensor of all_reduce
 * and broadcast, the output of all_gather (each member contributes bytes/P), the input of
 * reduce_scatter (each member receives bytes/P). float32 elements, sum for the reductions, root 0
 * for broadcast; the concatenated forms (all_gather_into_tensor, reduce_scatter_tensor).
 *   algbw_GBps = bytes / time;  busbw_GBps = algbw * factor, factor (nccl-tests'
 *   PERFORMANCE.md): all_reduce 2(P-1)/P, all_gather and reduce_scatter (P-1)/P, broadcast 1.
 * Peers (same loop and figures): bench/peers/torch/collectives.py (torch.distributed, gloo) and
 * bench/peers/mpi/collectives.c (Open MPI); bench/compare.sh collectives runs all of them.
 *
 * Output (BENCH.md): one JSON line
 *   {"bench": "collectives", "config": {...},
 *    "results": {"runs": [{"op", "nprocs", "bytes", "time_us", "algbw_GBps", "busbw_GBps",
 *                          "iters", "algo"}, ...], "memcpy_GBps": x}}
 * where algo is the algorithm the group chose (td_process_group_algorithm).
 * Options: --nprocs LIST, --sizes LIST (bytes), --ops LIST, --min-time-ms N (200),
 * --max-iters N (2000), --warmup N (3).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rpc_bench_util.h"
#include "tdist/collectives.h"

enum { OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER, N_OPS };
static const char *op_names[N_OPS] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};
static const td_pg_op pg_ops[N_OPS] = {TD_PG_OP_ALL_REDUCE, TD_PG_OP_BROADCAST, TD_PG_OP_ALL_GATHER,
                                       TD_PG_OP_REDUCE_SCATTER};

#define MAX_LIST 16

typedef struct cfg {
  int nprocs[MAX_LIST], n_nprocs;
  long long sizes[MAX_LIST];
  int n_sizes;
  int ops[N_OPS], n_ops;
  long long min_time_ms, max_iters, warmup;
} cfg;

typedef struct result {
  int op, nprocs;
  long long bytes, iters;
  double time_us;
  char algo[64];
} result;

static double bus_factor(int op, int p) {
  if (op == OP_ALL_REDUCE) return 2.0 * (p - 1) / p;
  if (op == OP_BROADCAST) return 1.0;
  return (double)(p - 1) / p;
}

static td_tensor *tensor_f32(int64_t n, float v) {
  td_tensor *t = NULL;
  RB_CHECK(td_tensor_full(&n, 1, v, TD_DTYPE_F32, td_device_cpu(), &t));
  return t;
}

/* one_call runs one operation on the prepared buffers. */
static void one_call(td_process_group *pg, int op, td_tensor *a, td_tensor *b) {
  switch (op) {
    case OP_ALL_REDUCE: RB_CHECK(td_process_group_all_reduce(pg, a, TD_REDUCE_SUM)); break;
    case OP_BROADCAST: RB_CHECK(td_process_group_broadcast(pg, a, 0)); break;
    case OP_ALL_GATHER: RB_CHECK(td_process_group_all_gather_into_tensor(pg, b, a)); break;
    case OP_REDUCE_SCATTER:
      RB_CHECK(td_process_group_reduce_scatter_tensor(pg, a, b, TD_REDUCE_SUM));
      break;
  }
}

/* measure runs one (op, bytes) point on every member; fills *r on every member. */
static void measure(td_process_group *pg, const cfg *c, int op, long long bytes, result *r) {
  int p = td_process_group_size(pg);
  int64_t count = bytes / 4;
  /* a: the tensor (all_reduce, broadcast) or the per-member part; b: the whole buffer */
  int64_t part = op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER ? count / p : count;
  td_tensor *a = tensor_f32(part, 1.0f), *b = NULL;
  if (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) b = tensor_f32(part * p, 1.0f);
  for (long long i = 0; i < c->warmup; i++) one_call(pg, op, a, b);
  /* rank 0 times a few calls and decides how many fill min_time_ms */
  RB_CHECK(td_process_group_barrier(pg));
  uint64_t t0 = rb_now_ns();
  int probe = 3;
  for (int i = 0; i < probe; i++) one_call(pg, op, a, b);
  double est_s = (double)(rb_now_ns() - t0) * 1e-9 / probe;
  td_tensor *it = tensor_f32(1, 0.0f);
  long long iters = (long long)((double)c->min_time_ms * 1e-3 / (est_s > 1e-9 ? est_s : 1e-9));
  if (iters < 3) iters = 3;
  if (iters > c->max_iters) iters = c->max_iters;
  ((float *)td_tensor_data(it))[0] = (float)iters;
  RB_CHECK(td_process_group_broadcast(pg, it, 0));
  iters = (long long)((float *)td_tensor_data(it))[0];
  td_tensor_unref(it);
  RB_CHECK(td_process_group_barrier(pg));
  t0 = rb_now_ns();
  for (long long i = 0; i < iters; i++) one_call(pg, op, a, b);
  double mine_us = (double)(rb_now_ns() - t0) * 1e-3 / (double)iters;
  int64_t one = 1;
  td_tensor *tm = NULL;
  RB_CHECK(td_tensor_full(&one, 1, mine_us, TD_DTYPE_F64, td_device_cpu(), &tm));
  RB_CHECK(td_process_group_all_reduce(pg, tm, TD_REDUCE_MAX));
  r->op = op;
  r->nprocs = p;
  r->bytes = part * (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER ? p : 1) * 4;
  r->iters = iters;
  r->time_us = ((double *)td_tensor_data(tm))[0];
  snprintf(r->algo, sizeof r->algo, "%s",
           td_process_group_algorithm(pg, pg_ops[op], (size_t)r->bytes));
  td_tensor_unref(tm);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

/* run_world runs every point with p members, this process being rank `rank`; rank 0 stores the
 * results in out (n_ops * n_sizes entries). */
static void run_world(const cfg *c, int rank, int p, const char *method, result *out) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = method;
  o.num_worker_threads = 2;
  o.init_timeout_ms = 60000;
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  td_rpc_agent *a = NULL;
  RB_CHECK(td_rpc_init(name, rank, p, &o, &a));
  td_process_group *pg = NULL;
  RB_CHECK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  int k = 0;
  for (int i = 0; i < c->n_ops; i++)
    for (int j = 0; j < c->n_sizes; j++) {
      result r;
      measure(pg, c, c->ops[i], c->sizes[j], &r);
      if (out) out[k] = r;
      k++;
    }
  td_process_group_destroy(pg);
  RB_CHECK(td_rpc_shutdown(a, true, 60000));
  td_rpc_destroy(a);
}

/* world forks p workers (this process never uses gRPC, so every fork is clean) and collects
 * rank 0's results (n entries) through a pipe; returns the number of workers that failed. */
static int world(const cfg *c, int p, result *out, int n) {
  int port = bench_free_port();
  if (port <= 0) {
    fprintf(stderr, "collectives: no free port on 127.0.0.1\n");
    return 1;
  }
  char method[64];
  snprintf(method, sizeof method, "tcp://127.0.0.1:%d", port);
  int fds[2];
  if (pipe(fds) != 0) {
    perror("pipe");
    exit(1);
  }
  pid_t kids[64];
  /* the workers' job secret (a new one unless the environment gives one; it uses no gRPC, so
   * this process stays fork-safe) */
  if (td_rpc_secret_ensure_env() != TD_OK) {
    fprintf(stderr, "collectives: %s\n", td_last_error());
    return p;
  }
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < p; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      exit(1);
    }
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(fds[0]);
      result *mine = r == 0 ? calloc((size_t)n, sizeof *mine) : NULL;
      run_world(c, r, p, method, mine);
      size_t len = r == 0 ? (size_t)n * sizeof *mine : 0, off = 0;
      while (off < len) {
        ssize_t w = write(fds[1], (char *)mine + off, len - off);
        if (w <= 0 && errno != EINTR) _exit(1);
        if (w > 0) off += (size_t)w;
      }
      fflush(stderr);
      _exit(0);
    }
    kids[r] = pid;
  }
  close(fds[1]);
  size_t len = (size_t)n * sizeof *out, off = 0;
  while (off < len) {
    ssize_t k = read(fds[0], (char *)out + off, len - off);
    if (k == 0 || (k < 0 && errno != EINTR)) break;
    if (k > 0) off += (size_t)k;
  }
  close(fds[0]);
  int bad = off == len ? 0 : 1;
  for (int r = 0; r < p; r++) {
    int status = 0;
    if (waitpid(kids[r], &status, 0) != kids[r] || !WIFEXITED(status) || WEXITSTATUS(status))
      bad++;
  }
  return bad;
}

/* memcpy_gbps: median rate of copying 64 MiB between two pre-touched buffers, one thread. */
static double memcpy_gbps(void) {
  size_t n = (size_t)64 << 20;
  char *x = malloc(n), *y = malloc(n);
  if (!x || !y) exit(1);
  memset(x, 1, n);
  memset(y, 2, n);
  double r[7];
  for (int i = 0; i < 7; i++) {
    uint64_t t = rb_now_ns();
    memcpy(y, x, n);
    r[i] = (double)n / (double)(rb_now_ns() - t);
  }
  qsort(r, 7, sizeof *r, rb_cmp_double);
  free(x);
  free(y);
  return r[3];
}

static int parse_list(const char *s, long long *out, int max) {
  int n = 0;
  char *dup = strdup(s), *save = NULL;
  for (char *tok = strtok_r(dup, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save))
    out[n++] = rb_arg_int("list", tok);
  free(dup);
  return n;
}

static void parse_args(int argc, char **argv, cfg *c) {
  long long tmp[MAX_LIST];
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) goto usage;
    if (strcmp(argv[i], "--nprocs") == 0) {
      c->n_nprocs = parse_list(v, tmp, MAX_LIST);
      for (int k = 0; k < c->n_nprocs; k++) {
        if (tmp[k] < 2 || tmp[k] > 64) goto usage;
        c->nprocs[k] = (int)tmp[k];
      }
    } else if (strcmp(argv[i], "--sizes") == 0) {
      c->n_sizes = parse_list(v, c->sizes, MAX_LIST);
    } else if (strcmp(argv[i], "--ops") == 0) {
      c->n_ops = 0;
      char *dup = strdup(v), *save = NULL;
      for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < N_OPS && strcmp(op_names[k], t) != 0) k++;
        if (k == N_OPS || c->n_ops == N_OPS) {
          free(dup);
          goto usage;
        }
        c->ops[c->n_ops++] = k;
      }
      free(dup);
    } else if (strcmp(argv[i], "--min-time-ms") == 0) {
      c->min_time_ms = rb_arg_int(argv[i], v);
    } else if (strcmp(argv[i], "--max-iters") == 0) {
      c->max_iters = rb_arg_int(argv[i], v);
    } else if (strcmp(argv[i], "--warmup") == 0) {
      c->warmup = rb_arg_int(argv[i], v);
    } else {
      goto usage;
    }
    i++;
  }
  if (c->n_nprocs && c->n_sizes && c->n_ops && c->max_iters >= 3) return;
usage:
  fprintf(stderr, "usage: collectives [--nprocs LIST] [--sizes LIST] [--ops LIST]\n"
                  "                   [--min-time-ms N] [--max-iters N] [--warmup N]\n"
                  "  ops: all_reduce,broadcast,all_gather,reduce_scatter; nprocs 2..64\n");
  exit(2);
}

static void print_json(const cfg *c, const result *res, int n, double mcpy) {
  const char *env = getenv("TD_COLL_ALGO");
  printf("{\"bench\": \"collectives\", \"config\": {\"impl\": \"tdist\", \"backend\": \"cpu\", "
         "\"dtype\": \"float32\", \"reduce_op\": \"sum\", \"broadcast_root\": 0, "
         "\"nprocs\": [");
  for (int i = 0; i < c->n_nprocs; i++) printf("%s%d", i ? ", " : "", c->nprocs[i]);
  printf("], \"sizes\": [");
  for (int i = 0; i < c->n_sizes; i++) printf("%s%lld", i ? ", " : "", c->sizes[i]);
  printf("], \"min_time_ms\": %lld, \"max_iters\": %lld, \"warmup\": %lld, "
         "\"td_coll_algo\": \"%s\", \"host_cpus\": %ld}, \"results\": {\"runs\": [",
         c->min_time_ms, c->max_iters, c->warmup, env ? env : "",
         sysconf(_SC_NPROCESSORS_ONLN));
  for (int i = 0; i < n; i++) {
    const result *r = &res[i];
    double alg = (double)r->bytes / (r->time_us * 1e3);
    printf("%s{\"op\": \"%s\", \"nprocs\": %d, \"bytes\": %lld, \"time_us\": %.3f, "
           "\"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f, \"iters\": %lld, \"algo\": \"%s\"}",
           i ? ", " : "", op_names[r->op], r->nprocs, r->bytes, r->time_us, alg,
           alg * bus_factor(r->op, r->nprocs), r->iters, r->algo);
  }
  printf("], \"memcpy_GBps\": %.3f}}\n", mcpy);
  fflush(stdout);
}

int main(int argc, char **argv) {
  rb_prog = "collectives";
  cfg c = {.nprocs = {2, 4}, .n_nprocs = 2,
           .sizes = {4096, 1 << 20, 16 << 20, 64 << 20}, .n_sizes = 4,
           .ops = {OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER}, .n_ops = 4,
           .min_time_ms = 200, .max_iters = 2000, .warmup = 3};
  parse_args(argc, argv, &c);
  int per = c.n_ops * c.n_sizes, total = per * c.n_nprocs;
  result *res = calloc((size_t)total, sizeof *res);
  if (!res) return 1;
  int bad = 0;
  for (int i = 0; i < c.n_nprocs; i++) {
    fprintf(stderr, "collectives: %d processes\n", c.nprocs[i]);
    bad += world(&c, c.nprocs[i], res + (size_t)i * per, per);
  }
  print_json(&c, res, total, memcpy_gbps());
  free(res);
  return bad ? 1 : 0;
}
