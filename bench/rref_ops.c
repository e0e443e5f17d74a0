/* rref_ops.c - remote references: remote() + to_here round trips and proxy calls per second.
 *
 * Two workers on 127.0.0.1 (rank 1 forked by rpc_bench_util.h). remote_to_here: rank 0 creates an
 * RRef on rank 1 with td_remote("bench_echo", i) and fetches it with td_rref_to_here, one at a
 * time, releasing it each iteration (so the owner also processes the delete). proxy_rpc_sync:
 * rank 0 creates one opaque counter object on rank 1 with td_remote and calls
 * td_rref_rpc_sync(counter, "bench_counter_add", 1) on it, one at a time. The PyTorch peer
 * (bench/peers/torch/rref_ops.py) does the same with rpc.remote / to_here / rref.rpc_sync().
 *
 * bench_echo and bench_counter_add are registered TD_RPC_INLINE (tiny, non-blocking), so the owner
 * runs them on its network thread; --pool-handler registers them without the flag (thread pool).
 *
 * usage: rref_ops [--iters N] [--warmup N] [--threads N] [--pool-handler]
 * Prints one JSON line (docs/BENCH.md): results.remote_to_here.ops_per_s,
 * results.proxy_rpc_sync.ops_per_s (and us_per_op for both).
 */
#include "rpc_bench_util.h"
#include "tdist/rref.h"

static td_status bench_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

typedef struct bench_counter {
  int64_t v;
} bench_counter;

static void counter_destroy(void *p) { free(p); }

static td_status bench_make_counter(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                    td_future **fut) {
  bench_counter *k = calloc(1, sizeof *k);
  if (!k) return td_set_error(TD_ERR_NOMEM, "out of memory");
  td_status st = td_value_object("BenchCounter", k, res);
  if (st != TD_OK) free(k);
  return st;
}

static td_status bench_counter_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                   td_future **fut) {
  void *p;
  int64_t d = 0;
  if (n != 2) return td_set_error(TD_ERR_INVALID, "counter_add(counter, d)");
  td_status st = td_value_as_object(args[0], "BenchCounter", &p);
  if (st == TD_OK) st = td_value_as_int(args[1], &d);
  if (st != TD_OK) return st;
  *res = td_value_int(__atomic_add_fetch(&((bench_counter *)p)->v, d, __ATOMIC_ACQ_REL));
  return TD_OK;
}

static void remote_to_here(rb_pair *p, long long n, long long base) {
  for (long long i = base; i < base + n; i++) {
    td_value *x = td_value_int(i), *v = NULL;
    td_rref *r;
    int64_t got = -1;
    RB_CHECK(td_remote(p->agent, "worker1", "bench_echo", &x, 1, NULL, &r));
    RB_CHECK(td_rref_to_here(r, TD_TIMEOUT_DEFAULT, &v));
    RB_CHECK(td_value_as_int(v, &got));
    if (got != i) {
      fprintf(stderr, "%s: wrong answer %lld for %lld\n", rb_prog, (long long)got, i);
      rb_abort(p);
    }
    td_value_unref(v);
    td_value_unref(x);
    td_rref_unref(r);
  }
}

static int64_t proxy_calls(rb_pair *p, td_rref *k, long long n) {
  td_value *one = td_value_int(1), *v = NULL;
  int64_t got = -1;
  for (long long i = 0; i < n; i++) {
    RB_CHECK(td_rref_rpc_sync(k, "bench_counter_add", &one, 1, NULL, &v));
    RB_CHECK(td_value_as_int(v, &got));
    td_value_unref(v);
  }
  td_value_unref(one);
  return got;
}

int main(int argc, char **argv) {
  rb_prog = "rref_ops";
  long long iters = 2000, warmup = 200, threads = 16;
  int pool_handler = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--iters") == 0) iters = rb_arg_int("--iters", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--warmup") == 0) warmup = rb_arg_int("--warmup", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int("--threads", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--pool-handler") == 0) pool_handler = 1;
    else {
      fprintf(stderr, "usage: rref_ops [--iters N] [--warmup N] [--threads N] [--pool-handler]\n");
      return 2;
    }
  }
  if (iters < 1 || threads < 1) {
    fprintf(stderr, "rref_ops: --iters and --threads must be >= 1\n");
    return 2;
  }
  RB_CHECK(td_object_type_register("BenchCounter", counter_destroy));
  unsigned flags = pool_handler ? 0 : TD_RPC_INLINE;
  RB_CHECK(td_rpc_register_ex("bench_echo", bench_echo, NULL, flags));
  RB_CHECK(td_rpc_register("bench_make_counter", bench_make_counter, NULL));
  RB_CHECK(td_rpc_register_ex("bench_counter_add", bench_counter_add, NULL, flags));
  rb_pair p;
  rb_start(&p, (int)threads);
  long long busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);

  remote_to_here(&p, warmup, 0);
  uint64_t t0 = rb_now_ns();
  remote_to_here(&p, iters, warmup);
  double rt_s = (double)(rb_now_ns() - t0) * 1e-9;

  td_rref *k;
  RB_CHECK(td_remote(p.agent, "worker1", "bench_make_counter", NULL, 0, NULL, &k));
  proxy_calls(&p, k, warmup);
  t0 = rb_now_ns();
  int64_t last = proxy_calls(&p, k, iters);
  double px_s = (double)(rb_now_ns() - t0) * 1e-9;
  if (last != warmup + iters) {
    fprintf(stderr, "rref_ops: wrong counter %lld\n", (long long)last);
    rb_abort(&p);
  }
  td_rref_unref(k);
  int rc = rb_finish(&p);

  char blas[16];
  printf("{\"bench\": \"rref_ops\", \"config\": {\"impl\": \"tdist\", \"world_size\": 2, "
         "\"handler\": \"%s\", \"busy_poll_us\": %lld, \"threads\": %lld, \"warmup\": %lld, \"iters\": %lld, \"openblas_num_threads\": %s}, "
         "\"results\": {\"remote_to_here\": {\"ops_per_s\": %.1f, \"us_per_op\": %.2f}, "
         "\"proxy_rpc_sync\": {\"ops_per_s\": %.1f, \"us_per_op\": %.2f}}}\n",
         pool_handler ? "pool" : "inline", busy_poll_us, threads,
         warmup, iters, rb_blas_threads(blas, sizeof blas), (double)iters / rt_s,
         rt_s * 1e6 / (double)iters, (double)iters / px_s, px_s * 1e6 / (double)iters);
  fflush(stdout);
  return rc;
}
