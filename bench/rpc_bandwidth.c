/* rpc_bandwidth.c - tensor echo bandwidth between two workers, next to this machine's memcpy.
 *
 * Rank 0 (this process) sends a float32 tensor of each size to rank 1 (a forked process), which
 * returns it; one synchronous call at a time. Each size gets warm-up calls and then timed ones
 * (more for small sizes); the figure is 2 * bytes / (median round-trip time), counting both
 * directions. memcpy_GBps is the copy rate of one thread (bytes copied per second, median of
 * several memcpy calls of 64 MiB between two preallocated, pre-touched buffers), measured in the
 * same run. GB = 1e9 bytes. Both workers run on 127.0.0.1. Peer: bench/peers/torch/rpc_bandwidth.py;
 * compare with bench/compare.sh rpc_bandwidth.
 *
 * Output (docs/BENCH.md): one JSON line
 *   {"bench": "rpc_bandwidth", "config": {...},
 *    "results": {"echo": [{"bytes": N, "GBps_both_dirs": x, ...}, ...], "memcpy_GBps": y}}
 * Options: --threads N (agent worker threads, 16), --reps-scale X (multiplies every size's
 * repetitions, 1), --memcpy-reps N (10), --sizes LIST (comma-separated subset of the sizes below,
 * in bytes; default all but 2 GiB), --huge (also 2 GiB).
 *
 * First calls and warm calls are reported apart: a size's first echo (first_call_GBps_both_dirs)
 * meets freshly mapped memory on both sides, later ones reuse what the CPU allocator cached (up to
 * its cache size; beyond it, every call is a first call as far as memory goes).
 */
#include "rpc_bench_util.h"

static td_status fn_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

typedef struct size_spec {
  size_t bytes;
  int warmup, reps;
} size_spec;

static const size_spec sizes[] = {
    {1u << 10, 200, 2000}, {64u << 10, 50, 500}, {1u << 20, 10, 100}, {16u << 20, 2, 16},
    {64u << 20, 1, 8},     {256u << 20, 1, 3},   {1u << 30, 1, 2},    {2ull << 30, 1, 2},
};
#define HUGE_SIZE (2ull << 30) /* measured only with --huge */
#define NSIZES ((int)(sizeof sizes / sizeof sizes[0]))

typedef struct size_result {
  double med_s, min_s, mean_s;
  double first_s; /* the size's first echo */
  int reps;
} size_result;

/* echo_once sends t and checks that the same bytes came back. */
static void echo_once(rb_pair *p, td_value *arg, td_tensor *t, bool check_all) {
  td_value *r = NULL;
  td_status st = td_rpc_sync(p->agent, "worker1", "bench_echo", &arg, 1, NULL, &r);
  td_tensor *back = NULL;
  if (st == TD_OK) st = td_value_as_tensor(r, &back);
  if (st == TD_OK && td_tensor_nbytes(back) != td_tensor_nbytes(t)) st = TD_ERR_INTERNAL;
  if (st == TD_OK) {
    const float *a = td_tensor_data(t), *b = td_tensor_data(back);
    size_t n = td_tensor_nbytes(t) / sizeof(float);
    if (check_all ? memcmp(a, b, n * sizeof(float)) != 0 : (a[0] != b[0] || a[n - 1] != b[n - 1]))
      st = TD_ERR_INTERNAL;
  }
  td_value_unref(r);
  if (st != TD_OK) {
    fprintf(stderr, "rpc_bandwidth: echo of %zu bytes failed: %s: %s\n", td_tensor_nbytes(t),
            td_status_name(st), st == TD_ERR_INTERNAL ? "wrong answer" : td_last_error());
    rb_abort(p);
  }
}

static size_result run_size(rb_pair *p, size_t bytes, int warmup, int reps) {
  int64_t shape[1] = {(int64_t)(bytes / sizeof(float))};
  td_tensor *t = NULL;
  RB_CHECK(td_tensor_empty(shape, 1, TD_DTYPE_F32, td_device_cpu(), &t));
  float *d = td_tensor_data(t);
  for (int64_t i = 0; i < shape[0]; i++) d[i] = (float)(i % 1000) * 0.5f;
  td_value *arg = td_value_tensor(t);
  if (!arg) rb_abort(p);
  double first = 0;
  for (int i = 0; i < warmup; i++) {
    uint64_t t0 = rb_now_ns();
    echo_once(p, arg, t, false);
    if (i == 0) first = (double)(rb_now_ns() - t0) * 1e-9;
  }
  echo_once(p, arg, t, true); /* every byte checked once, untimed */
  double *s = malloc((size_t)reps * sizeof *s);
  if (!s) rb_abort(p);
  double sum = 0;
  for (int i = 0; i < reps; i++) {
    uint64_t t0 = rb_now_ns();
    echo_once(p, arg, t, false);
    s[i] = (double)(rb_now_ns() - t0) * 1e-9;
    sum += s[i];
  }
  qsort(s, (size_t)reps, sizeof *s, rb_cmp_double);
  size_result r = {rb_quantile(s, (size_t)reps, 0.5), s[0], sum / reps, first, reps};
  free(s);
  td_value_unref(arg);
  td_tensor_unref(t);
  return r;
}

/* memcpy_gbps copies 64 MiB between two pre-touched buffers reps times; median rate in GB/s. */
static double memcpy_gbps(int reps) {
  size_t n = 64u << 20;
  char *a = malloc(n), *b = malloc(n);
  if (!a || !b) exit(1);
  memset(a, 1, n);
  memset(b, 2, n);
  memcpy(b, a, n); /* warm-up */
  double *s = malloc((size_t)reps * sizeof *s);
  if (!s) exit(1);
  for (int i = 0; i < reps; i++) {
    a[(size_t)i * 4096 % n] = (char)i; /* a different source each time */
    uint64_t t0 = rb_now_ns();
    memcpy(b, a, n);
    s[i] = (double)(rb_now_ns() - t0) * 1e-9;
    __asm__ __volatile__("" : : "r"(b) : "memory"); /* the copy is used */
  }
  qsort(s, (size_t)reps, sizeof *s, rb_cmp_double);
  double gbps = (double)n / rb_quantile(s, (size_t)reps, 0.5) * 1e-9;
  free(s);
  free(a);
  free(b);
  return gbps;
}

int main(int argc, char **argv) {
  rb_prog = "rpc_bandwidth";
  long long threads = 16, memcpy_reps = 10;
  double scale = 1.0;
  bool use[NSIZES];
  for (int k = 0; k < NSIZES; k++) use[k] = sizes[k].bytes != HUGE_SIZE;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--memcpy-reps") == 0) memcpy_reps = rb_arg_int(argv[i], v), i++;
    else if (strcmp(argv[i], "--reps-scale") == 0 && v) scale = atof(v), i++;
    else if (strcmp(argv[i], "--huge") == 0) use[NSIZES - 1] = true;
    else if (strcmp(argv[i], "--sizes") == 0 && v) {
      for (int k = 0; k < NSIZES; k++) use[k] = false;
      char buf[256];
      snprintf(buf, sizeof buf, "%s", v);
      for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        long long b = rb_arg_int("--sizes", tok);
        int k = 0;
        while (k < NSIZES && sizes[k].bytes != (size_t)b) k++;
        if (k == NSIZES) {
          fprintf(stderr, "rpc_bandwidth: --sizes: %lld is not one of the benchmark's sizes\n", b);
          return 2;
        }
        use[k] = true;
      }
      i++;
    } else {
      fprintf(stderr, "usage: rpc_bandwidth [--threads N] [--reps-scale X] [--memcpy-reps N] "
                      "[--sizes LIST] [--huge]\n");
      return 2;
    }
  }
  if (threads < 1 || memcpy_reps < 1 || !(scale > 0)) {
    fprintf(stderr, "rpc_bandwidth: --threads, --memcpy-reps and --reps-scale must be > 0\n");
    return 2;
  }
  RB_CHECK(td_rpc_register("bench_echo", fn_echo, NULL));

  rb_pair p;
  rb_start(&p, (int)threads);
  long long busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);
  size_result res[NSIZES];
  int reps[NSIZES];
  for (int k = 0; k < NSIZES; k++) {
    if (!use[k]) continue;
    reps[k] = (int)(sizes[k].reps * scale + 0.5);
    if (reps[k] < 1) reps[k] = 1;
    res[k] = run_size(&p, sizes[k].bytes, sizes[k].warmup, reps[k]);
    fprintf(stderr, "rpc_bandwidth: %zu bytes: median round trip %.1f us\n", sizes[k].bytes,
            res[k].med_s * 1e6);
  }
  double mc = memcpy_gbps((int)memcpy_reps);
  int rc = rb_finish(&p);

  char blas[32];
  printf("{\"bench\": \"rpc_bandwidth\", \"config\": {\"impl\": \"tdist\", \"transport\": "
         "\"grpc\", \"world_size\": 2, \"busy_poll_us\": %lld, \"threads\": %lld, \"dtype\": \"float32\", \"sizes\": [",
         busy_poll_us, threads);
  const char *sep = "";
  for (int k = 0; k < NSIZES; k++)
    if (use[k]) printf("%s%zu", sep, sizes[k].bytes), sep = ", ";
  printf("], \"warmup\": [");
  sep = "";
  for (int k = 0; k < NSIZES; k++)
    if (use[k]) printf("%s%d", sep, sizes[k].warmup), sep = ", ";
  printf("], \"reps\": [");
  sep = "";
  for (int k = 0; k < NSIZES; k++)
    if (use[k]) printf("%s%d", sep, reps[k]), sep = ", ";
  printf("], \"memcpy_bytes\": %u, \"memcpy_reps\": %lld, \"openblas_num_threads\": %s}, "
         "\"results\": {\"echo\": [",
         64u << 20, memcpy_reps, rb_blas_threads(blas, sizeof blas));
  sep = "";
  for (int k = 0; k < NSIZES; k++) {
    if (!use[k]) continue;
    double b2 = 2.0 * (double)sizes[k].bytes;
    printf("%s{\"bytes\": %zu, \"GBps_both_dirs\": %.4f, \"GBps_both_dirs_mean\": %.4f, "
           "\"GBps_both_dirs_best\": %.4f, \"first_call_GBps_both_dirs\": %.4f, "
           "\"median_us\": %.2f}",
           sep, sizes[k].bytes, b2 / res[k].med_s * 1e-9, b2 / res[k].mean_s * 1e-9,
           b2 / res[k].min_s * 1e-9, b2 / res[k].first_s * 1e-9, res[k].med_s * 1e6);
    sep = ", ";
  }
  printf("], \"memcpy_GBps\": %.3f}}\n", mc);
  fflush(stdout);
  td_rpc_unregister("bench_echo");
  return rc;
}
