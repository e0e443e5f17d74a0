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
 * Options: --calls N (5000), --warmup N (500), --threads N (agent worker threads, 16).
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

int main(int argc, char **argv) {
  rb_prog = "rpc_latency";
  long long calls = 5000, warmup = 500, threads = 16;
  int pool_handler = 0;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--calls") == 0) calls = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--warmup") == 0) warmup = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--pool-handler") == 0) pool_handler = 1;
    else {
      fprintf(stderr, "usage: rpc_latency [--calls N] [--warmup N] [--threads N]\n"
                      "                   [--pool-handler]\n");
      return 2;
    }
  }
  if (calls < 1 || threads < 1) {
    fprintf(stderr, "rpc_latency: --calls and --threads must be >= 1\n");
    return 2;
  }
  /* the echo is tiny and never blocks: TD_RPC_INLINE runs it on the receiving poller thread
   * (--pool-handler runs it on the agent's thread pool like any other function) */
  RB_CHECK(td_rpc_register_ex("bench_echo", fn_echo, NULL, pool_handler ? 0 : TD_RPC_INLINE));
  double *us = malloc((size_t)calls * sizeof *us);
  if (!us) return 1;

  rb_pair p;
  rb_start(&p, (int)threads);
  long long busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);
  for (long long i = 0; i < warmup; i++) one_call(&p, i);
  uint64_t t0 = rb_now_ns();
  for (long long i = 0; i < calls; i++) {
    uint64_t s = rb_now_ns();
    one_call(&p, warmup + i);
    us[i] = (double)(rb_now_ns() - s) * 1e-3;
  }
  double wall = (double)(rb_now_ns() - t0) * 1e-9;
  int rc = rb_finish(&p);

  double mean = 0;
  for (long long i = 0; i < calls; i++) mean += us[i];
  mean /= (double)calls;
  qsort(us, (size_t)calls, sizeof *us, rb_cmp_double);
  char blas[32];
  printf("{\"bench\": \"rpc_latency\", \"config\": {\"impl\": \"tdist\", \"transport\": \"grpc\", "
         "\"world_size\": 2, \"handler\": \"%s\", \"busy_poll_us\": %lld, \"threads\": %lld, \"warmup_calls\": %lld, \"calls\": %lld, "
         "\"payload\": \"int64\", \"openblas_num_threads\": %s}, "
         "\"results\": {\"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, "
         "\"min_us\": %.3f, \"max_us\": %.3f, \"mean_us\": %.3f, \"calls_per_s\": %.1f, "
         "\"wall_s\": %.4f}}\n",
         pool_handler ? "pool" : "inline", busy_poll_us,
         threads, warmup, calls, rb_blas_threads(blas, sizeof blas),
         rb_quantile(us, (size_t)calls, 0.50), rb_quantile(us, (size_t)calls, 0.90),
         rb_quantile(us, (size_t)calls, 0.99), us[0], us[calls - 1], mean,
         (double)calls / wall, wall);
  fflush(stdout);
  free(us);
  td_rpc_unregister("bench_echo");
  return rc;
}
