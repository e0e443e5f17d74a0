/* rpc_latency.c - round-trip latency of a synchronous RPC between two workers.
 *
 * Rank 0 (this process) calls "bench_echo" on rank 1 (a forked process) with one int64 argument
 * and waits for the reply, one call at a time: warm-up calls, then timed calls, each timed on its
 * own. Both workers run on 127.0.0.1. Peer: bench/peers/torch/rpc_latency.py; compare with
 * bench/compare.sh rpc_latency.
 *
 * Output (docs/BENCH.md): one JSON line
 *   {"bench": "rpc_latency", "config": {...},
 *    "results": {"p50_us", "p90_us", "p99_us", "calls_per_s", ...}}
 * Options: --calls N (5000), --warmup N (500), --threads N (agent worker threads, 16),
 * --security compare|secret|insecure|tls (compare: the default group (secret) gives the main
 * figures, and the same calls are measured without authentication and with TLS too, in
 * alternating rounds, under results.security with their ratios to the insecure run).
 */
#include "rpc_bench_util.h"

static td_status fn_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

/* one_call makes one synchronous echo of i and checks the answer. */
static void one_call(rb_pair *p, int64_t i) {
  td_value *arg = td_value_int(i), *r = NULL;
  td_status st = arg ? td_rpc_sync(p->agent, "worker1", "bench_echo", &arg, 1, NULL, &r)
                     : TD_ERR_NOMEM;
  int64_t got = -1;
  if (st == TD_OK) st = td_value_as_int(r, &got);
  td_value_unref(arg);
  td_value_unref(r);
  if (st != TD_OK || got != i) {
    fprintf(stderr, "rpc_latency: call %lld failed: %s: %s\n", (long long)i, td_status_name(st),
            st == TD_OK ? "wrong answer" : td_last_error());
    rb_abort(p);
  }
}

/* One measurement on a prepared pair: warm-up calls, then calls timed one by one into us[]. */
static void measure(rb_pair *pp, long long warmup, long long calls, double *us, double *wall,
                    long long *busy_poll_us, const char **path) {
  rb_pair p = *pp;
  rb_begin(&p);
  *busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);
  for (long long i = 0; i < warmup; i++) one_call(&p, i);
  uint64_t t0 = rb_now_ns();
  for (long long i = 0; i < calls; i++) {
    uint64_t s = rb_now_ns();
    one_call(&p, warmup + i);
    us[i] = (double)(rb_now_ns() - s) * 1e-3;
  }
  *wall += (double)(rb_now_ns() - t0) * 1e-9;
  *path = rb_path(&p);
  if (rb_finish(&p) != 0) {
    fprintf(stderr, "rpc_latency: a worker did not shut down cleanly\n");
    exit(1);
  }
}

int main(int argc, char **argv) {
  rb_prog = "rpc_latency";
  long long calls = 5000, warmup = 500, threads = 16;
  int pool_handler = 0;
  const char *security = "compare";
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--calls") == 0) calls = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--warmup") == 0) warmup = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--pool-handler") == 0) pool_handler = 1;
    else if (strcmp(argv[i], "--security") == 0 && v) security = v, i++;
    else {
      fprintf(stderr, "usage: rpc_latency [--calls N] [--warmup N] [--threads N]\n"
                      "                   [--pool-handler] [--security compare|secret|insecure|tls]\n");
      return 2;
    }
  }
  if (calls < 1 || threads < 1) {
    fprintf(stderr, "rpc_latency: --calls and --threads must be >= 1\n");
    return 2;
  }
  int only = -1; /* one mode, or -1: compare */
  for (int m = 0; m < 3; m++)
    if (strcmp(security, rb_security_names[m]) == 0) only = m;
  if (only < 0 && strcmp(security, "compare") != 0) {
    fprintf(stderr, "rpc_latency: --security must be compare, secret, insecure or tls\n");
    return 2;
  }
  /* the echo is tiny and never blocks: TD_RPC_INLINE runs it on the receiving poller thread
   * (--pool-handler runs it on the agent's thread pool like any other function) */
  RB_CHECK(td_rpc_register_ex("bench_echo", fn_echo, NULL, pool_handler ? 0 : TD_RPC_INLINE));
  double *us[3] = {NULL, NULL, NULL}, wall[3] = {0, 0, 0};
  long long n[3] = {0, 0, 0}, busy_poll_us = 0;
  const char *path = "grpc";
  int rounds = only < 0 ? 2 : 1;
  long long per = calls / rounds > 0 ? calls / rounds : 1;
  for (int m = 0; m < 3; m++) {
    us[m] = malloc((size_t)(per * rounds) * sizeof *us[m]);
    if (!us[m]) return 1;
  }
  /* alternating rounds, so drift of the machine weighs on every mode alike; every pair is
   * forked before the first starts (see rb_prepare) */
  rb_pair pairs[2][3];
  for (int r = 0; r < rounds; r++)
    for (int m = 0; m < 3; m++)
      if (only < 0 || m == only) rb_prepare(&pairs[r][m], (int)threads, (rb_security)m);
  for (int r = 0; r < rounds; r++)
    for (int m = 0; m < 3; m++) {
      if (only >= 0 && m != only) continue;
      const char *pm = "grpc";
      measure(&pairs[r][m], warmup, per, us[m] + n[m], &wall[m], &busy_poll_us, &pm);
      if (m == (only >= 0 ? only : RB_SECRET)) path = pm;
      n[m] += per;
    }
  double p50[3], p90[3], p99[3], mean[3], cps[3];
  for (int m = 0; m < 3; m++) {
    if (!n[m]) continue;
    mean[m] = 0;
    for (long long i = 0; i < n[m]; i++) mean[m] += us[m][i];
    mean[m] /= (double)n[m];
    qsort(us[m], (size_t)n[m], sizeof *us[m], rb_cmp_double);
    p50[m] = rb_quantile(us[m], (size_t)n[m], 0.50);
    p90[m] = rb_quantile(us[m], (size_t)n[m], 0.90);
    p99[m] = rb_quantile(us[m], (size_t)n[m], 0.99);
    cps[m] = (double)n[m] / wall[m];
  }
  int main_m = only >= 0 ? only : RB_SECRET;
  char blas[32], sec_json[512] = "";
  if (only < 0)
    snprintf(sec_json, sizeof sec_json,
             ", \"security\": {\"insecure\": {\"p50_us\": %.3f, \"p99_us\": %.3f, "
             "\"calls_per_s\": %.1f}, \"tls\": {\"p50_us\": %.3f, \"p99_us\": %.3f, "
             "\"calls_per_s\": %.1f}, \"secret_p50_vs_insecure\": %.4f, "
             "\"tls_p50_vs_insecure\": %.4f}",
             p50[RB_INSECURE], p99[RB_INSECURE], cps[RB_INSECURE], p50[RB_TLS], p99[RB_TLS],
             cps[RB_TLS], p50[RB_SECRET] / p50[RB_INSECURE], p50[RB_TLS] / p50[RB_INSECURE]);
  printf("{\"bench\": \"rpc_latency\", \"config\": {\"impl\": \"tdist\", \"transport\": \"%s\", "
         "\"world_size\": 2, \"handler\": \"%s\", \"security\": \"%s\", \"busy_poll_us\": %lld, "
         "\"threads\": %lld, \"warmup_calls\": %lld, \"calls\": %lld, "
         "\"payload\": \"int64\", \"openblas_num_threads\": %s}, "
         "\"results\": {\"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, "
         "\"min_us\": %.3f, \"max_us\": %.3f, \"mean_us\": %.3f, \"calls_per_s\": %.1f, "
         "\"wall_s\": %.4f%s}}\n",
         path, pool_handler ? "pool" : "inline", rb_security_names[main_m], busy_poll_us, threads,
         warmup, n[main_m], rb_blas_threads(blas, sizeof blas), p50[main_m], p90[main_m],
         p99[main_m], us[main_m][0], us[main_m][n[main_m] - 1], mean[main_m], cps[main_m],
         wall[main_m], sec_json);
  fflush(stdout);
  for (int m = 0; m < 3; m++) free(us[m]);
  td_rpc_unregister("bench_echo");
  return 0;
}
