/* rpc_scale - how a group's start-up, one all-to-all round of calls and its graceful shutdown
 * grow with the number of workers, on one machine.
 *
 *   rpc_scale [--worlds 64,128,256] [--sim 64,256,1024] [--threads 2] [--stagger-ms 0]
 *             [--peers K] [--inline]
 *
 * Processes (--worlds): N real worker processes on 127.0.0.1 (forked; lightweight: --threads pool
 * threads each). Each inits (td_rpc_init), calls add(rank, peer) on every other worker (async,
 * then waits for all), and shuts down gracefully; the figures are the slowest worker's time in
 * each phase, the time from the first fork to the last exit, and the peak resident memory of the
 * largest worker and of all of them summed. On a small machine the larger groups are
 * oversubscribed (hundreds of processes on a few CPUs): that is the point. The round makes
 * N(N-1) calls and as many pairs meet, so on a fixed machine its work grows as N^2 whatever the
 * transport; --peers K makes each worker call only the K ranks after its own (rank+1 ... rank+K,
 * modulo N; 0, the default, is everyone), a round whose work grows as N, as a pipeline's, a
 * ring's or a parameter server's does: what start-up and shutdown cost, separated from the pairs.
 * --inline registers add with TD_RPC_INLINE (it runs where its request is decoded, the lane or
 * poller thread, with no hop to the pool): what the round costs without that wake-up (tdist
 * only; the PyTorch peer accepts the flag and ignores it, its handlers always run on its pool).
 *
 * Store protocol (--sim): N simulated workers (threads, rpc/store_sim.h) play the rendezvous and
 * the shutdown barrier against the real store server, beyond what the machine can start as
 * processes: requests and bytes per phase, per worker, and the server's time. Each worker
 * publishes 4 records and reads each kind of record of all N in range requests, so requests per
 * worker stay flat and bytes per worker grow as N (the table itself); the waits cost what their
 * polling costs.
 *
 * Peer: bench/peers/torch/rpc_scale.py runs the processes part with torch.distributed.rpc
 * (TensorPipe), whose rendezvous reads every other worker's address key by key (N requests per
 * worker); `bench/compare.sh rpc_scale 3 -- --worlds 64 --sim ""` runs both.
 * Output: progress on stderr, one JSON line on stdout (keys in docs/BENCH.md).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define BENCH_PROG "rpc_scale"
#include "../rpc/store_sim.h"
#include "bench_net.h"
#include "bench_util.h"
#include "tdist/rpc.h"

/* In a forked worker: a failed call ends the worker (its exit status reports it). */
#define W_CHECK(expr)                                                                           \
  do {                                                                                          \
    td_status w_ = (expr);                                                                      \
    if (w_ != TD_OK) {                                                                          \
      fprintf(stderr, BENCH_PROG " [pid %d]: %s failed: %s: %s\n", (int)getpid(), #expr,      \
              td_status_name(w_), td_last_error());                                             \
      fflush(stderr);                                                                           \
      _exit(1);                                                                                 \
    }                                                                                           \
  } while (0)

#define MAX_LIST 16

typedef struct phase_times {
  double init_s, calls_s, shutdown_s;
  int ok; /* worker: it finished; the group's worst: workers whose init finished */
  /* after the all-to-all (td_rpc_stats): connections this worker opened (a dialled lane counts
   * as one) and peers it reached on one they opened; the group's: summed */
  double opened, shared;
} phase_times;

static td_status fn_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)c;
  (void)fut;
  int64_t x = 0, y = 0;
  if (n != 2 || td_value_as_int(args[0], &x) != TD_OK || td_value_as_int(args[1], &y) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "add takes 2 ints");
  *res = td_value_int(x + y);
  return TD_OK;
}

static double secs(double a, double b) { return b - a; }

static void worker(int rank, int world, const char *method, int threads, int peers, bool inl,
                   phase_times *out) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  W_CHECK(td_rpc_register_ex("add", fn_add, NULL, inl ? TD_RPC_INLINE : 0));
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = method;
  o.num_worker_threads = threads;
  o.init_timeout_ms = 300000;
  o.rpc_timeout_ms = 300000;
  double t0 = bench_now_s();
  td_rpc_agent *a = NULL;
  W_CHECK(td_rpc_init(NULL, rank, world, &o, &a));
  double t1 = bench_now_s();
  out->init_s = secs(t0, t1); /* reported even when a later phase fails */
  td_future **fs = calloc((size_t)world, sizeof *fs);
  if (!fs) _exit(1);
  int k = peers > 0 && peers < world - 1 ? peers : world - 1; /* calls: ranks rank+1 .. rank+k */
  for (int i = 1; i <= k; i++) {
    int p = (rank + i) % world;
    td_worker_info wi;
    W_CHECK(td_rpc_get_worker_info_by_rank(a, p, &wi));
    td_value *args[2] = {td_value_int(rank * 1000), td_value_int(p)};
    W_CHECK(td_rpc_async(a, wi.name, "add", args, 2, NULL, &fs[p]));
    td_value_unref(args[0]);
    td_value_unref(args[1]);
  }
  for (int i = 1; i <= k; i++) {
    int p = (rank + i) % world;
    W_CHECK(td_future_wait(fs[p], 300000));
    int64_t v = -1;
    W_CHECK(td_value_as_int(td_future_value(fs[p]), &v));
    if (v != rank * 1000 + p) _exit(3);
    td_future_unref(fs[p]);
  }
  free(fs);
  double t2 = bench_now_s();
  td_rpc_stats rs;
  W_CHECK(td_rpc_get_stats(a, &rs));
  W_CHECK(td_rpc_shutdown(a, true, 300000));
  double t3 = bench_now_s();
  td_rpc_destroy(a);
  *out = (phase_times){secs(t0, t1), secs(t1, t2), secs(t2, t3), 1, (double)rs.streams_opened,
                       (double)rs.streams_shared};
  _exit(0);
}

/* Runs one group of world processes; the slowest worker's phase times, the wall time, and the
 * peak resident memory of the largest worker and of all workers together (each worker's peak,
 * summed: an upper bound on the group's footprint), in MiB. */
static int run_group(int world, int threads, int peers, bool inl, phase_times *worst, double *wall_s,
                     double *rss_max_mb, double *rss_sum_mb) {
  phase_times *pt = mmap(NULL, (size_t)world * sizeof *pt, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pid_t *pids = calloc((size_t)world, sizeof *pids);
  if (pt == MAP_FAILED || !pids) return -1;
  memset(pt, 0, (size_t)world * sizeof *pt);
  int port = bench_free_port();
  char method[64];
  snprintf(method, sizeof method, "tcp://127.0.0.1:%d", port);
  fflush(stdout);
  fflush(stderr);
  double t0 = bench_now_s();
  for (int r = 0; r < world; r++) {
    pid_t p = fork();
    if (p == 0) worker(r, world, method, threads, peers, inl, &pt[r]);
    pids[r] = p;
  }
  int failed = 0;
  *rss_max_mb = *rss_sum_mb = 0;
  for (int r = 0; r < world; r++) {
    int status = 0;
    struct rusage ru;
    memset(&ru, 0, sizeof ru);
    if (pids[r] <= 0 || wait4(pids[r], &status, 0, &ru) != pids[r] || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0)
      failed++;
    double mb = (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
    if (mb > *rss_max_mb) *rss_max_mb = mb;
    *rss_sum_mb += mb;
  }
  *wall_s = secs(t0, bench_now_s());
  memset(worst, 0, sizeof *worst);
  for (int r = 0; r < world; r++) {
    if (pt[r].init_s > worst->init_s) worst->init_s = pt[r].init_s;
    worst->ok += pt[r].init_s > 0;
    if (pt[r].calls_s > worst->calls_s) worst->calls_s = pt[r].calls_s;
    if (pt[r].shutdown_s > worst->shutdown_s) worst->shutdown_s = pt[r].shutdown_s;
    worst->opened += pt[r].opened;
    worst->shared += pt[r].shared;
  }
  munmap(pt, (size_t)world * sizeof *pt);
  free(pids);
  return failed;
}

static int parse_list(const char *name, const char *s, int *out) {
  int n = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s ? s : "");
  for (char *tok = strtok(buf, ","); tok && n < MAX_LIST; tok = strtok(NULL, ","))
    out[n++] = (int)bench_arg_int(name, tok);
  return n;
}

int main(int argc, char **argv) {
  int worlds[MAX_LIST], sims[MAX_LIST], threads = 2, stagger = 0, peers = 0;
  bool inl = false;
  int nw = parse_list("--worlds", "64,128,256", worlds);
  int ns = parse_list("--sim", "64,256,1024", sims);
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : "";
    if (strcmp(argv[i], "--worlds") == 0) nw = parse_list(argv[i], v, worlds), i++;
    else if (strcmp(argv[i], "--sim") == 0) ns = parse_list(argv[i], v, sims), i++;
    else if (strcmp(argv[i], "--threads") == 0) threads = (int)bench_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--stagger-ms") == 0) stagger = (int)bench_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--peers") == 0) peers = (int)bench_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--inline") == 0) inl = true;
    else {
      fprintf(stderr, "usage: rpc_scale [--worlds N,N,...] [--sim N,N,...] [--threads N] "
              "[--stagger-ms MS] [--peers K] [--inline]\n");
      return 2;
    }
  }
  if (td_rpc_secret_ensure_env() != TD_OK) {
    fprintf(stderr, "rpc_scale: %s\n", td_last_error());
    return 1;
  }
  /* the processes first: this process runs no gRPC before it forks them */
  char procs[4096] = "";
  size_t pu = 0;
  int failures = 0;
  for (int i = 0; i < nw; i++) {
    phase_times w = {0};
    double wall = 0, rss_max = 0, rss_sum = 0;
    int failed = run_group(worlds[i], threads, peers, inl, &w, &wall, &rss_max, &rss_sum);
    failures += failed != 0;
    fprintf(stderr, "rpc_scale: %d processes: init %.2f s, round %.2f s, shutdown %.2f s, "
            "%.2f s from the first fork to the last exit; peak RSS %.0f MiB per worker at most, "
            "%.0f MiB summed%s (%d of %d finished init); per worker %.1f connections opened, "
            "%.1f peers reached on theirs\n", worlds[i], w.init_s, w.calls_s,
            w.shutdown_s, wall, rss_max, rss_sum, failed ? " (FAILED)" : "", w.ok, worlds[i],
            w.opened / worlds[i], w.shared / worlds[i]);
    pu += (size_t)snprintf(procs + pu, sizeof procs - pu, "%s{\"world\": %d, \"ok\": %s, "
                           "\"init_s\": %.3f, \"all_to_all_s\": %.3f, \"shutdown_s\": %.3f, "
                           "\"wall_s\": %.3f, \"failed_workers\": %d, \"rss_max_mb\": %.1f, "
                           "\"rss_sum_mb\": %.1f, \"inited_workers\": %d, "
                           "\"opened_per_worker\": %.1f, \"shared_per_worker\": %.1f}",
                           i ? ", " : "", worlds[i],
                           failed ? "false" : "true", w.init_s, w.calls_s, w.shutdown_s, wall,
                           failed, rss_max, rss_sum, w.ok, w.opened / worlds[i],
                           w.shared / worlds[i]);
    if (pu >= sizeof procs) pu = sizeof procs - 1;
  }
  char simj[8192] = "";
  size_t su = 0;
  for (int i = 0; i < ns; i++) {
    td__store_sim_opts so = {.world = sims[i], .registry_bytes = 600, .stagger_ms = stagger,
                             .timeout_ms = 300000};
    td__store_sim_result r;
    if (td__store_sim_run(&so, &r) != TD_OK) {
      fprintf(stderr, "rpc_scale: store simulation of %d workers: %s\n", sims[i], td_last_error());
      failures++;
      continue;
    }
    uint64_t req = 0, bytes = 0, server = 0;
    char ph[2048] = "";
    size_t pl = 0;
    for (int p = 0; p < TD__SIM_PHASES; p++) {
      const td__store_sim_phase *x = &r.phase[p];
      req += x->requests;
      bytes += x->bytes_in + x->bytes_out;
      server += x->server_ns;
      pl += (size_t)snprintf(ph + pl, sizeof ph - pl, "%s\"%s\": {\"requests\": %llu, "
                             "\"requests_per_worker\": %.2f, \"bytes_per_worker\": %.0f, "
                             "\"server_ms\": %.1f}", p ? ", " : "", td__store_sim_phase_name(p),
                             (unsigned long long)x->requests,
                             (double)x->requests / sims[i],
                             (double)(x->bytes_in + x->bytes_out) / sims[i],
                             (double)x->server_ns * 1e-6);
      if (pl >= sizeof ph) pl = sizeof ph - 1;
    }
    fprintf(stderr, "rpc_scale: store protocol, %d simulated workers: %.1f requests and %.0f "
            "bytes per worker, server busy %.0f ms, %.2f s\n", sims[i], (double)req / sims[i],
            (double)bytes / sims[i], (double)server * 1e-6, r.wall_s);
    su += (size_t)snprintf(simj + su, sizeof simj - su, "%s{\"world\": %d, \"wall_s\": %.3f, "
                           "\"requests\": %llu, \"requests_per_worker\": %.2f, "
                           "\"bytes_per_worker\": %.0f, \"server_ms\": %.1f, \"phases\": {%s}}",
                           su ? ", " : "", sims[i], r.wall_s, (unsigned long long)req,
                           (double)req / sims[i], (double)bytes / sims[i],
                           (double)server * 1e-6, ph);
    if (su >= sizeof simj) su = sizeof simj - 1;
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  printf("{\"bench\": \"rpc_scale\", \"config\": {\"threads\": %d, \"cpus\": %ld, "
         "\"stagger_ms\": %d, \"peers\": %d, \"inline\": %s}, \"results\": {\"processes\": [%s], "
         "\"store_sim\": [%s]}}\n", threads, cpus, stagger, peers, inl ? "true" : "false", procs, simj);
  return failures ? 1 : 0;
}
