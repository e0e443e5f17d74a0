/* rpc_throughput.c - asynchronous RPC throughput between two workers with a fixed number of calls
 * in flight.
 *
 * Rank 0 (this process) issues td_rpc_async echoes of one int64 to rank 1 (a forked process) and
 * keeps `inflight` of them outstanding: each reply's future callback issues the next call, until
 * `calls` replies have come back. Warm-up calls (same scheme) first. Both workers run on
 * 127.0.0.1. Peer: bench/peers/torch/rpc_throughput.py; compare with
 * bench/compare.sh rpc_throughput.
 *
 * Output (docs/BENCH.md): one JSON line
 *   {"bench": "rpc_throughput", "config": {...}, "results": {"calls_per_s", ...}}
 * Options: --calls N (20000), --warmup N (2000), --inflight N (64), --min-seconds S (0.5: when
 * the timed calls took less, one more timed round sized to fill the rest follows, and the figure
 * counts both: 20,000 calls at 700k/s last 30 ms, where one scheduler hiccup moves the figure by
 * a third), --threads N (agent worker threads, 16), --security compare|secret|insecure|tls
 * (compare: the default group (secret) gives calls_per_s, and the same rounds run without
 * authentication and with TLS too, alternating, under results.security with their ratios to the
 * insecure run).
 *
 * Lock order: a round's mu is a leaf (reply callbacks take it only to record the end or an error).
 */
#include <pthread.h>

#include "rpc_bench_util.h"

static td_status fn_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

/* One round (warm-up or timed): `total` calls with at most `inflight` outstanding. A round
 * outlives the agents, so a callback still finishing when its round has ended touches valid
 * memory. */
typedef struct tp_round {
  td_rpc_agent *a;
  td_value *arg;
  long long total;
  long long issued;  /* atomic: calls started (or claimed) */
  long long replied; /* atomic: callbacks run */
  long long failed;  /* atomic */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool finished; /* under mu */
  char err[512]; /* first failure, under mu */
} tp_round;

static void issue(tp_round *r);

/* issue_next starts one more call. A callback that runs at once inside td_future_on_done (the
 * reply beat the registration) would otherwise recurse into issue; it leaves a debt that the
 * outer issue_next on the same thread pays in its loop. */
static _Thread_local int tl_active, tl_owed;
static void issue_next(tp_round *r) {
  tl_owed++;
  if (tl_active) return;
  tl_active = 1;
  while (tl_owed > 0) {
    tl_owed--;
    issue(r);
  }
  tl_active = 0;
}

/* fail_round records the first failure and ends the round (main then aborts the run). */
static void fail_round(tp_round *r, const char *what) {
  __atomic_add_fetch(&r->failed, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&r->mu);
  if (!r->err[0]) snprintf(r->err, sizeof r->err, "%s", what);
  r->finished = true;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

static void on_reply(td_future *f, void *ctx) {
  tp_round *r = ctx;
  long long total = r->total;
  td_status st = td_future_status(f);
  int64_t got = -1;
  if (st == TD_OK) st = td_value_as_int(td_future_value(f), &got);
  if (st != TD_OK || got != 7) {
    char what[512];
    snprintf(what, sizeof what, "%s: %s", td_status_name(st == TD_OK ? TD_ERR_INTERNAL : st),
             td_future_status(f) != TD_OK ? td_future_message(f) : "wrong answer");
    fail_round(r, what);
    return;
  }
  /* keep the window full: a call finished, start the next one */
  issue_next(r);
  if (__atomic_add_fetch(&r->replied, 1, __ATOMIC_ACQ_REL) == total) {
    pthread_mutex_lock(&r->mu);
    r->finished = true;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
  }
}

/* issue starts one more call unless `total` have been started. */
static void issue(tp_round *r) {
  if (__atomic_add_fetch(&r->issued, 1, __ATOMIC_ACQ_REL) > r->total) return;
  td_future *f = NULL;
  td_status st = td_rpc_async(r->a, "worker1", "bench_echo", &r->arg, 1, NULL, &f);
  if (st == TD_OK) st = td_future_on_done(f, on_reply, r);
  if (st != TD_OK) {
    char what[512];
    snprintf(what, sizeof what, "%s: %s", td_status_name(st), td_last_error());
    fail_round(r, what);
  }
  /* the agent keeps its own reference until the callbacks have run */
  td_future_unref(f);
}

/* run_round makes `total` calls with `inflight` outstanding; returns the wall time in s. r lives
 * until the agents are gone (callbacks may still look at it after the round has ended). */
static double run_round(rb_pair *p, tp_round *r, td_value *arg, long long total,
                        long long inflight) {
  memset(r, 0, sizeof *r);
  r->a = p->agent;
  r->arg = arg;
  r->total = total;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  uint64_t t0 = rb_now_ns();
  for (long long i = 0; i < inflight && i < total; i++) issue_next(r);
  pthread_mutex_lock(&r->mu);
  while (!r->finished) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
  double wall = (double)(rb_now_ns() - t0) * 1e-9;
  if (__atomic_load_n(&r->failed, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&r->mu);
    fprintf(stderr, "rpc_throughput: a call failed: %s\n", r->err);
    pthread_mutex_unlock(&r->mu);
    rb_abort(p);
  }
  return wall;
}

/* One measurement on a prepared pair: a warm-up round and a timed one, and when that took less
 * than min_s a second timed round sized to fill the rest; returns the timed wall and adds the
 * timed calls to *done. */
static const char *path = "grpc"; /* the path the main mode's calls took (rb_path) */

static double measure(rb_pair *pp, td_value *arg, long long warmup, long long calls,
                      long long inflight, double min_s, long long *busy_poll_us, bool main_mode,
                      long long *done) {
  rb_pair p = *pp;
  static tp_round rounds[64]; /* outlive the agents (see tp_round); 3 per measurement */
  static int used;
  if (used + 3 > 64) {
    fprintf(stderr, "rpc_throughput: too many measurements\n");
    exit(1);
  }
  tp_round *r = &rounds[used];
  used += 3;
  rb_begin(&p);
  *busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);
  if (warmup > 0) run_round(&p, &r[0], arg, warmup, inflight);
  double wall = run_round(&p, &r[1], arg, calls, inflight);
  *done += calls;
  if (wall < min_s) {
    double more = (double)calls * (min_s - wall) / (wall > 1e-6 ? wall : 1e-6);
    long long extra = more > 5e7 ? 50000000LL : (long long)more + 1;
    wall += run_round(&p, &r[2], arg, extra, inflight);
    *done += extra;
  }
  if (main_mode) path = rb_path(&p);
  if (rb_finish(&p) != 0) { /* no callback runs after this */
    fprintf(stderr, "rpc_throughput: a worker did not shut down cleanly\n");
    exit(1);
  }
  return wall;
}

int main(int argc, char **argv) {
  rb_prog = "rpc_throughput";
  long long calls = 20000, warmup = 2000, inflight = 64, threads = 16;
  double min_s = 0.5;
  int pool_handler = 0;
  const char *security = "compare";
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--calls") == 0) calls = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--warmup") == 0) warmup = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--inflight") == 0) inflight = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--min-seconds") == 0 && v) min_s = atof(v), i++;
    else if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--pool-handler") == 0) pool_handler = 1;
    else if (strcmp(argv[i], "--security") == 0 && v) security = v, i++;
    else {
      fprintf(stderr, "usage: rpc_throughput [--calls N] [--warmup N] [--inflight N] "
                      "[--min-seconds S] [--threads N] [--pool-handler]\n"
                      "                      [--security compare|secret|insecure|tls]\n");
      return 2;
    }
  }
  if (calls < 1 || inflight < 1 || threads < 1 || !(min_s >= 0 && min_s <= 600)) {
    fprintf(stderr, "rpc_throughput: --calls, --inflight and --threads must be >= 1, "
                    "--min-seconds within [0, 600]\n");
    return 2;
  }
  int only = -1;
  for (int m = 0; m < 3; m++)
    if (strcmp(security, rb_security_names[m]) == 0) only = m;
  if (only < 0 && strcmp(security, "compare") != 0) {
    fprintf(stderr, "rpc_throughput: --security must be compare, secret, insecure or tls\n");
    return 2;
  }
  /* the echo is tiny and never blocks: TD_RPC_INLINE runs it on the receiving poller thread
   * (--pool-handler runs it on the agent's thread pool like any other function) */
  RB_CHECK(td_rpc_register_ex("bench_echo", fn_echo, NULL, pool_handler ? 0 : TD_RPC_INLINE));
  td_value *arg = td_value_int(7);
  if (!arg) return 1;
  int rounds = only < 0 ? 2 : 1;
  long long per = calls / rounds > 0 ? calls / rounds : 1, busy_poll_us = 0;
  rb_pair pairs[2][3];
  for (int r = 0; r < rounds; r++) /* every pair forked before the first starts (rb_prepare) */
    for (int m = 0; m < 3; m++)
      if (only < 0 || m == only) rb_prepare(&pairs[r][m], (int)threads, (rb_security)m);
  double wall[3] = {0, 0, 0};
  long long n[3] = {0, 0, 0};
  for (int r = 0; r < rounds; r++)
    for (int m = 0; m < 3; m++) {
      if (only >= 0 && m != only) continue;
      wall[m] += measure(&pairs[r][m], arg, warmup, per, inflight, min_s / rounds, &busy_poll_us,
                         m == (only >= 0 ? only : RB_SECRET), &n[m]);
    }
  double cps[3];
  for (int m = 0; m < 3; m++) cps[m] = n[m] ? (double)n[m] / wall[m] : 0;
  int main_m = only >= 0 ? only : RB_SECRET;
  char blas[32], sec_json[384] = "";
  if (only < 0)
    snprintf(sec_json, sizeof sec_json,
             ", \"security\": {\"insecure\": {\"calls_per_s\": %.1f}, \"tls\": "
             "{\"calls_per_s\": %.1f}, \"secret_vs_insecure\": %.4f, \"tls_vs_insecure\": %.4f}",
             cps[RB_INSECURE], cps[RB_TLS], cps[RB_SECRET] / cps[RB_INSECURE],
             cps[RB_TLS] / cps[RB_INSECURE]);
  printf("{\"bench\": \"rpc_throughput\", \"config\": {\"impl\": \"tdist\", \"transport\": "
         "\"%s\", \"world_size\": 2, \"handler\": \"%s\", \"security\": \"%s\", "
         "\"busy_poll_us\": %lld, \"threads\": %lld, \"warmup_calls\": %lld, "
         "\"calls\": %lld, \"min_seconds\": %.3g, \"inflight\": %lld, \"payload\": \"int64\", "
         "\"openblas_num_threads\": %s}, "
         "\"results\": {\"calls_per_s\": %.1f, \"us_per_call\": %.3f, \"wall_s\": %.4f%s}}\n",
         path, pool_handler ? "pool" : "inline", rb_security_names[main_m], busy_poll_us, threads,
         warmup, n[main_m], min_s, inflight, rb_blas_threads(blas, sizeof blas), cps[main_m],
         wall[main_m] / (double)n[main_m] * 1e6, wall[main_m], sec_json);
  fflush(stdout);
  td_value_unref(arg);
  td_rpc_unregister("bench_echo");
  return 0;
}
