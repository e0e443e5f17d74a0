/* test_collectives_nccl.c - the NCCL backend on CUDA tensors, one process per GPU (at most 4),
 * labels gpu and multiproc: every collective in float32, float64 and int64 against the
 * CPU-computed expectation; MAX propagating NaN; mismatched calls failing cleanly; a member that
 * dies before or inside a collective named by the others within the timeout; two members on one
 * GPU refused at creation; subgroups on the process's device; RPC traffic (CUDA tensors along
 * device maps) while collectives run.
 *
 * The parent process never initialises CUDA (td_cuda_device_count asks NVML or a probe child),
 * so the workers it forks can. Without a CUDA device, or without NCCL in the build, every test
 * skips and the program exits 77; tests that need more GPUs than the machine has skip with a
 * message. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

#ifdef TD_TEST_HAVE_NCCL
/* The fault-injection point of collectives/nccl/nccl_backend.c (see coll_impl.h). */
extern void (*td__nccl_test_before_enqueue)(td_process_group *pg, const char *what);
#endif

static int ngpu; /* devices for workers: min(td_cuda_device_count(), 4) */

#define REQUIRE_GPUS(k)                                                                       \
  do {                                                                                        \
    if (ngpu == 0) {                                                                          \
      print_message("%s: no CUDA device is present; skipped\n", __func__);                    \
      skip();                                                                                 \
    }                                                                                         \
    if (!nccl_built()) {                                                                      \
      print_message("%s: this build has no NCCL; skipped\n", __func__);                       \
      skip();                                                                                 \
    }                                                                                         \
    if (ngpu < (k)) {                                                                         \
      print_message("%s: needs %d GPUs, this machine has %d; skipped\n", __func__, (k), ngpu); \
      skip();                                                                                 \
    }                                                                                         \
  } while (0)

static bool nccl_built(void) {
#ifdef TD_TEST_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

/* Runs world workers of fn (timeout in seconds, scaled) and fails unless all of them pass. */
static void run_workers(int world, td_mp_fn fn, double timeout_s) {
  int fails = td_mp_run(world, fn, NULL, timeout_s, NULL);
  if (fails) fail_msg("%d of %d workers failed", fails, world);
}

static double val(int r, int64_t i) { return (double)((r + 1) * (i % 11) - r); }

/* A tensor of n values val(r, off + i) in dt on dev. */
static td_tensor *make_on(int r, int64_t off, int64_t n, td_dtype dt, td_device dev) {
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = val(r, off + i);
  td_tensor *c = coll_tensor(v, n, dt), *g = NULL;
  free(v);
  MP_CHECK_OK(td_tensor_to(c, dev, &g));
  td_tensor_unref(c);
  return g;
}

/* Exact comparison of a tensor on any device with a CPU tensor. */
static void expect_equal(const char *what, const td_tensor *t, const td_tensor *cpu_want) {
  td_tensor *c = NULL;
  MP_CHECK_OK(td_tensor_to(t, td_device_cpu(), &c));
  MP_CHECK(coll_equal(what, c, cpu_want));
  td_tensor_unref(c);
}

/* Comparison within a relative tolerance (NCCL's AVG may pre-scale before it sums). */
static void expect_close(const char *what, const td_tensor *t, const double *want, int64_t n,
                         double rtol) {
  td_tensor *c = NULL;
  MP_CHECK_OK(td_tensor_to(t, td_device_cpu(), &c));
  for (int64_t i = 0; i < n; i++) {
    double g;
    MP_CHECK_OK(td_tensor_get(c, &i, &g));
    if (fabs(g - want[i]) > rtol * (1 + fabs(want[i]))) {
      fprintf(stderr, "%s: element %lld is %.17g, expected %.17g\n", what, (long long)i, g,
              want[i]);
      MP_CHECK(0);
    }
  }
  td_tensor_unref(c);
}

static td_process_group *start(int rank, int world, const char *method, td_rpc_agent **a) {
  char lr[16];
  snprintf(lr, sizeof lr, "%d", rank);
  setenv("LOCAL_RANK", lr, 1);
  td_rpc_options o = coll_opts(method);
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(*a, NULL, 0, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &pg));
  td_process_group_set_timeout(pg, (int64_t)(60000 * coll_scale()));
  return pg;
}

static void stop(td_process_group *pg, td_rpc_agent *a) {
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
}

/* ---- every collective, every dtype ---- */

static void check_all_reduce(td_process_group *pg, int rank, int world, td_dtype dt, int64_t n) {
  td_device dev = td_device_cuda(rank);
  for (int op = 0; op < 3; op++) {
    if (op == TD_REDUCE_AVG && dt == TD_DTYPE_I64) continue;
    td_tensor *t = make_on(rank, 0, n, dt, dev);
    double *w = malloc((size_t)(n ? n : 1) * sizeof *w);
    for (int64_t i = 0; i < n; i++) {
      w[i] = val(0, i);
      for (int r = 1; r < world; r++)
        w[i] = op == TD_REDUCE_MAX ? fmax(w[i], val(r, i)) : w[i] + val(r, i);
      if (op == TD_REDUCE_AVG) w[i] /= world;
    }
    MP_CHECK_OK(td_process_group_all_reduce(pg, t, (td_reduce_op)op));
    if (op == TD_REDUCE_AVG) {
      expect_close("nccl all_reduce avg", t, w, n, dt == TD_DTYPE_F32 ? 1e-6 : 1e-14);
    } else {
      td_tensor *want = coll_tensor(w, n, dt);
      expect_equal("nccl all_reduce", t, want);
      td_tensor_unref(want);
    }
    free(w);
    td_tensor_unref(t);
  }
}

static void check_gathers(td_process_group *pg, int rank, int world, td_dtype dt, int64_t n) {
  td_device dev = td_device_cuda(rank);
  td_tensor *t = make_on(rank, 0, n, dt, dev), *want = make_on(world - 1, 0, n, dt,
                                                               td_device_cpu());
  MP_CHECK_OK(td_process_group_broadcast(pg, t, world - 1));
  expect_equal("nccl broadcast", t, want);
  td_tensor_unref(t);
  td_tensor_unref(want);
  td_tensor *in = make_on(rank, 0, n, dt, dev), *cat = NULL;
  td_tensor **outs = calloc((size_t)world, sizeof *outs);
  int64_t total = n * world;
  MP_CHECK_OK(td_tensor_zeros(&total, 1, dt, dev, &cat));
  for (int r = 0; r < world; r++) MP_CHECK_OK(td_tensor_zeros(&n, 1, dt, dev, &outs[r]));
  MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, cat, in));
  MP_CHECK_OK(td_process_group_all_gather(pg, outs, in));
  for (int r = 0; r < world; r++) {
    td_tensor *wr = make_on(r, 0, n, dt, td_device_cpu()), *slice = NULL;
    expect_equal("nccl all_gather", outs[r], wr);
    MP_CHECK_OK(td_tensor_narrow(cat, 0, r * n, n, &slice));
    expect_equal("nccl all_gather_into_tensor", slice, wr);
    td_tensor_unref(slice);
    td_tensor_unref(wr);
    td_tensor_unref(outs[r]);
  }
  free(outs);
  td_tensor_unref(in);
  td_tensor_unref(cat);
}

/* reduce_scatter: member r's slot j holds elements [j n, (j + 1) n) of every member's input. */
static void check_reduce_scatter(td_process_group *pg, int rank, int world, td_dtype dt,
                                 int64_t n, td_reduce_op op) {
  td_device dev = td_device_cuda(rank);
  td_tensor *src = make_on(rank, 0, n * world, dt, dev), *out = NULL;
  MP_CHECK_OK(td_tensor_zeros(&n, 1, dt, dev, &out));
  MP_CHECK_OK(td_process_group_reduce_scatter_tensor(pg, out, src, op));
  double *w = malloc((size_t)(n ? n : 1) * sizeof *w);
  for (int64_t i = 0; i < n; i++) {
    w[i] = val(0, rank * n + i);
    for (int r = 1; r < world; r++)
      w[i] = op == TD_REDUCE_MAX ? fmax(w[i], val(r, rank * n + i)) : w[i] + val(r, rank * n + i);
  }
  td_tensor *want = coll_tensor(w, n, dt);
  expect_equal("nccl reduce_scatter", out, want);
  free(w);
  td_tensor_unref(want);
  td_tensor_unref(src);
  td_tensor_unref(out);
}

static int worker_collectives(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a;
  td_process_group *pg = start(rank, world, method, &a);
  int64_t sizes[3] = {1, 7, 100003};
  td_dtype dts[3] = {TD_DTYPE_F32, TD_DTYPE_F64, TD_DTYPE_I64};
  for (int d = 0; d < 3; d++) {
    for (int s = 0; s < 3; s++) {
      check_all_reduce(pg, rank, world, dts[d], sizes[s]);
      check_gathers(pg, rank, world, dts[d], sizes[s]);
      check_reduce_scatter(pg, rank, world, dts[d], sizes[s], TD_REDUCE_SUM);
      check_reduce_scatter(pg, rank, world, dts[d], sizes[s], TD_REDUCE_MAX);
      MP_CHECK_OK(td_process_group_barrier(pg));
    }
  }
  /* a CPU tensor, and a tensor on another GPU, are refused by an NCCL group */
  td_tensor *c = make_on(rank, 0, 3, TD_DTYPE_F32, td_device_cpu());
  MP_CHECK(td_process_group_all_reduce(pg, c, TD_REDUCE_SUM) == TD_ERR_DEVICE);
  td_tensor_unref(c);
  stop(pg, a);
  return 0;
}

static void test_nccl_collectives_match_cpu(void **state) {
  REQUIRE_GPUS(1);
  run_workers(ngpu, worker_collectives, 240);
}

/* ---- MAX and NaN ---- */

/* Member r puts a NaN at element 3 r + 1 and -inf at 3 r + 2: the maximum is NaN wherever any
 * member has one, as on the CPU backend, in all_reduce and reduce_scatter. */
static int worker_nan_max(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a;
  td_process_group *pg = start(rank, world, method, &a);
  int64_t n = 3 * world + 5;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = (td_dtype)d;
    double *x = malloc((size_t)n * sizeof *x), *w = malloc((size_t)n * sizeof *w);
    for (int64_t i = 0; i < n; i++) {
      x[i] = i == 3 * rank + 1 ? NAN : i == 3 * rank + 2 ? -INFINITY : val(rank, i);
      w[i] = -INFINITY;
      for (int r = 0; r < world; r++) {
        double v = i == 3 * r + 1 ? NAN : i == 3 * r + 2 ? -INFINITY : val(r, i);
        w[i] = isnan(w[i]) || isnan(v) ? NAN : fmax(w[i], v);
      }
    }
    td_tensor *h = coll_tensor(x, n, dt), *t = NULL;
    MP_CHECK_OK(td_tensor_to(h, td_device_cuda(rank), &t));
    MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_MAX));
    td_tensor *want = coll_tensor(w, n, dt), *got = NULL;
    MP_CHECK_OK(td_tensor_to(t, td_device_cpu(), &got));
    for (int64_t i = 0; i < n; i++) {
      double g, e;
      MP_CHECK_OK(td_tensor_get(got, &i, &g));
      MP_CHECK_OK(td_tensor_get(want, &i, &e));
      MP_CHECK(isnan(e) ? isnan(g) : g == e);
    }
    free(x);
    free(w);
    td_tensor_unref(h);
    td_tensor_unref(t);
    td_tensor_unref(want);
    td_tensor_unref(got);
  }
  stop(pg, a);
  return 0;
}

static void test_nccl_max_propagates_nan(void **state) {
  REQUIRE_GPUS(1);
  run_workers(ngpu, worker_nan_max, 120);
}

/* ---- misuse and failures ---- */

/* Member 0 reduces 8 elements, the others 16: every member fails with TD_ERR_STATE describing
 * both calls, before NCCL sees the buffers. */
static int worker_mismatch(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a;
  td_process_group *pg = start(rank, world, method, &a);
  td_tensor *t = make_on(rank, 0, rank == 0 ? 8 : 16, TD_DTYPE_F32, td_device_cuda(rank));
  MP_CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "mismatched collectives"));
  MP_CHECK(strstr(td_last_error(), "x 8") || strstr(td_last_error(), "x 16"));
  td_tensor_unref(t);
  stop(pg, a);
  return 0;
}

static void test_nccl_mismatched_calls_fail_cleanly(void **state) {
  REQUIRE_GPUS(2);
  run_workers(ngpu, worker_mismatch, 120);
}

static void die_inside(td_process_group *pg, const char *what) {
  (void)pg;
  (void)what;
  fflush(stderr);
  _exit(3);
}

/* The last member dies (arg "inside": in the collective, after the header check, right before
 * NCCL is called; else before calling it); the others fail within the timeout with a message
 * that names it, and the group is broken afterwards. */
static int worker_dies(int rank, int world, const char *method, void *arg) {
  bool inside = arg != NULL;
  td_rpc_agent *a;
  td_process_group *pg = start(rank, world, method, &a);
  int64_t timeout_ms = (int64_t)(30000 * coll_scale());
  td_process_group_set_timeout(pg, timeout_ms);
  td_tensor *t = make_on(rank, 0, 1 << 20, TD_DTYPE_F32, td_device_cuda(rank));
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM)); /* the group works */
  if (rank == world - 1) {
    if (!inside) _exit(3);
#ifdef TD_TEST_HAVE_NCCL
    td__nccl_test_before_enqueue = die_inside;
#else
    die_inside(pg, "all_reduce");
#endif
  }
  double t0 = coll_now_s();
  td_status st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  double took = coll_now_s() - t0;
  char who[64];
  snprintf(who, sizeof who, "worker%d (rank %d)", world - 1, world - 1);
  if (!(st == TD_ERR_UNAVAILABLE || st == TD_ERR_TIMEOUT) || !strstr(td_last_error(), who)) {
    fprintf(stderr, "rank %d: got %s: %s\n", rank, td_status_name(st), td_last_error());
    MP_CHECK(0);
  }
  MP_CHECK(took < (double)timeout_ms / 1000.0 + 5.0);
  fprintf(stderr, "rank %d: failed after %.2f s: %s\n", rank, took, td_last_error());
  MP_CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM) == TD_ERR_STATE);
  td_tensor_unref(t);
  td_process_group_destroy(pg);
  td_rpc_shutdown(a, false, 5000);
  td_rpc_destroy(a);
  return 0;
}

static void run_dies(bool inside) {
  int world = ngpu > 3 ? 3 : ngpu, codes[4] = {0};
  td_mp_run(world, worker_dies, inside ? (void *)1 : NULL, 180, codes);
  for (int r = 0; r < world - 1; r++)
    if (codes[r] != 0) fail_msg("surviving worker %d exited with %d", r, codes[r]);
  if (codes[world - 1] != 3) fail_msg("the dying worker exited with %d", codes[world - 1]);
}

static void test_nccl_member_dies_before_the_call(void **state) {
  REQUIRE_GPUS(2);
  run_dies(false);
}

static void test_nccl_member_dies_inside_a_collective(void **state) {
  REQUIRE_GPUS(2);
  run_dies(true);
}

/* Two members given the same GPU (both LOCAL_RANK=0) are refused at creation, on both, with a
 * message naming both, instead of NCCL failing on one and hanging the other. One GPU suffices. */
static int worker_same_gpu(int rank, int world, const char *method, void *arg) {
  setenv("LOCAL_RANK", "0", 1);
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  td_status st = td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &pg);
  if (st != TD_ERR_INVALID || !strstr(td_last_error(), "worker0 (rank 0)") ||
      !strstr(td_last_error(), "worker1 (rank 1)") || !strstr(td_last_error(), "both use GPU")) {
    fprintf(stderr, "rank %d: got %s: %s\n", rank, td_status_name(st), td_last_error());
    MP_CHECK(0);
  }
  MP_CHECK(pg == NULL);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  return 0;
}

static void test_nccl_two_members_on_one_gpu_refused(void **state) {
  REQUIRE_GPUS(1);
  run_workers(2, worker_same_gpu, 120);
}

/* ---- subgroups ---- */

/* Each process sets its device with td_cuda_set_device (reversed order, LOCAL_RANK unset); the
 * world group and the subgroup of ranks 1.. use that same device. */
static int worker_subgroups(int rank, int world, const char *method, void *arg) {
  unsetenv("LOCAL_RANK");
  int mine = world - 1 - rank;
  MP_CHECK_OK(td_cuda_set_device(mine));
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *all = NULL, *sub = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &all));
  int *ranks = malloc((size_t)world * sizeof *ranks);
  for (int r = 1; r < world; r++) ranks[r - 1] = r;
  MP_CHECK_OK(td_process_group_create(a, ranks, world - 1, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &sub));
  free(ranks);
  MP_CHECK((rank == 0) == (sub == NULL));
  int64_t n = 1001;
  for (int round = 0; round < 3; round++) {
    td_tensor *t = make_on(rank, round, n, TD_DTYPE_F64, td_device_cuda(mine));
    MP_CHECK_OK(td_process_group_all_reduce(all, t, TD_REDUCE_SUM));
    td_tensor *want = make_on(0, round, n, TD_DTYPE_F64, td_device_cpu());
    double *w = td_tensor_data(want);
    for (int64_t i = 0; i < n; i++)
      for (int r = 1; r < world; r++) w[i] += val(r, round + i);
    expect_equal("world group", t, want);
    td_tensor_unref(t);
    td_tensor_unref(want);
    if (sub) {
      t = make_on(rank, round, n, TD_DTYPE_F64, td_device_cuda(mine));
      MP_CHECK_OK(td_process_group_all_reduce(sub, t, TD_REDUCE_SUM));
      want = make_on(1, round, n, TD_DTYPE_F64, td_device_cpu());
      w = td_tensor_data(want);
      for (int64_t i = 0; i < n; i++)
        for (int r = 2; r < world; r++) w[i] += val(r, round + i);
      expect_equal("subgroup", t, want);
      td_tensor_unref(t);
      td_tensor_unref(want);
      /* a tensor on another GPU is refused, naming the group's device */
      td_tensor *other = make_on(rank, 0, 4, TD_DTYPE_F64, td_device_cuda((mine + 1) % world));
      MP_CHECK(td_process_group_all_reduce(sub, other, TD_REDUCE_SUM) == TD_ERR_DEVICE);
      char dn[32];
      snprintf(dn, sizeof dn, "works on cuda:%d", mine);
      MP_CHECK(strstr(td_last_error(), dn));
      td_tensor_unref(other);
    }
  }
  td_process_group_destroy(sub);
  td_process_group_destroy(all);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  return 0;
}

static void test_nccl_subgroups_use_the_process_device(void **state) {
  REQUIRE_GPUS(2);
  run_workers(ngpu, worker_subgroups, 180);
}

/* ---- RPC traffic during collectives ---- */

/* echo_plus(t) -> t + 1, computed where t arrived. */
static td_status fn_echo_plus(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  td_tensor *t = NULL, *u = NULL;
  td_status st = td_value_as_tensor(args[0], &t);
  if (st == TD_OK) st = td_tensor_add_scalar(t, 1, &u);
  if (st != TD_OK) return st;
  *res = td_value_tensor(u);
  td_tensor_unref(u);
  return *res ? TD_OK : TD_ERR_NOMEM;
}

typedef struct traffic {
  td_rpc_agent *a;
  const char *peer;
  td_device dev;
  int calls;
  bool ok;
} traffic;

/* Sends CUDA tensors (4 MiB) to the CPU worker and checks the replies, which come back on dev. */
static void *traffic_thread(void *p) {
  traffic *tr = p;
  tr->ok = true;
  for (int i = 0; i < tr->calls && tr->ok; i++) {
    td_tensor *t = NULL, *got = NULL;
    int64_t n = 1 << 20;
    if (td_tensor_full(&n, 1, (double)i, TD_DTYPE_F32, tr->dev, &t) != TD_OK) tr->ok = false;
    td_value *arg = tr->ok ? td_value_tensor(t) : NULL, *res = NULL;
    if (tr->ok && td_rpc_sync(tr->a, tr->peer, "echo_plus", &arg, 1, NULL, &res) != TD_OK) {
      fprintf(stderr, "traffic: %s\n", td_last_error());
      tr->ok = false;
    }
    double v = -1;
    int64_t last = n - 1;
    if (tr->ok && (td_value_as_tensor(res, &got) != TD_OK ||
                   !td_device_equal(td_tensor_device(got), tr->dev) ||
                   td_tensor_get(got, &last, &v) != TD_OK || v != (double)i + 1))
      tr->ok = false;
    td_value_unref(arg);
    td_value_unref(res);
    td_tensor_unref(t);
  }
  return NULL;
}

/* Ranks 0..world-2 are NCCL members on their GPU; rank world-1 is a CPU worker. Each member runs
 * 40 all_reduces of 16 MiB while a thread of it makes 40 calls carrying CUDA tensors to the CPU
 * worker (device map cuda:r -> cpu, replies back on cuda:r), and the CPU worker calls every
 * member with CPU tensors meanwhile. */
static int worker_traffic(int rank, int world, const char *method, void *arg) {
  int members = world - 1;
  bool member = rank < members;
  char lr[16], dev_s[16], cpu_name[32];
  snprintf(lr, sizeof lr, "%d", rank);
  snprintf(dev_s, sizeof dev_s, "cuda:%d", rank);
  snprintf(cpu_name, sizeof cpu_name, "worker%d", members);
  if (member) setenv("LOCAL_RANK", lr, 1);
  MP_CHECK_OK(td_rpc_register("echo_plus", fn_echo_plus, NULL));
  td_rpc_options o = coll_opts(method);
  td_rpc_device_map_entry map = {cpu_name, dev_s, "cpu"};
  if (member) {
    o.device_maps = &map;
    o.num_device_maps = 1;
  }
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  int *ranks = malloc((size_t)members * sizeof *ranks);
  for (int r = 0; r < members; r++) ranks[r] = r;
  td_process_group *pg = NULL;
  if (member) MP_CHECK_OK(td_process_group_create(a, ranks, members, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &pg));
  free(ranks);
  if (member) {
    traffic tr = {a, cpu_name, td_device_cuda(rank), 40, false};
    pthread_t th;
    MP_CHECK(pthread_create(&th, NULL, traffic_thread, &tr) == 0);
    int64_t n = 4 << 20;
    for (int i = 0; i < 40; i++) {
      td_tensor *t = NULL;
      MP_CHECK_OK(td_tensor_full(&n, 1, (double)(rank + i), TD_DTYPE_F32, td_device_cuda(rank),
                                 &t));
      MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
      double got = 0, want = 0;
      int64_t last = n - 1;
      for (int r = 0; r < members; r++) want += r + i;
      MP_CHECK_OK(td_tensor_get(t, &last, &got));
      MP_CHECK(got == want);
      td_tensor_unref(t);
    }
    pthread_join(th, NULL);
    MP_CHECK(tr.ok);
  } else {
    for (int i = 0; i < 40; i++) {
      for (int r = 0; r < members; r++) {
        char peer[32];
        snprintf(peer, sizeof peer, "worker%d", r);
        td_tensor *t = NULL, *got = NULL;
        int64_t n = 1 << 18;
        MP_CHECK_OK(td_tensor_full(&n, 1, (double)i, TD_DTYPE_F64, td_device_cpu(), &t));
        td_value *v = td_value_tensor(t), *res = NULL;
        MP_CHECK_OK(td_rpc_sync(a, peer, "echo_plus", &v, 1, NULL, &res));
        MP_CHECK_OK(td_value_as_tensor(res, &got));
        MP_CHECK(((double *)td_tensor_data(got))[n - 1] == (double)i + 1);
        td_value_unref(v);
        td_value_unref(res);
        td_tensor_unref(t);
      }
    }
  }
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 60000));
  td_rpc_destroy(a);
  return 0;
}

static void test_nccl_rpc_traffic_during_collectives(void **state) {
  REQUIRE_GPUS(1);
  run_workers(ngpu + 1, worker_traffic, 240);
}

int main(void) {
  int n = td_cuda_device_count(); /* NVML or a probe child: this process stays fork-safe */
  ngpu = n > 4 ? 4 : n;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nccl_collectives_match_cpu),
      cmocka_unit_test(test_nccl_max_propagates_nan),
      cmocka_unit_test(test_nccl_mismatched_calls_fail_cleanly),
      cmocka_unit_test(test_nccl_member_dies_before_the_call),
      cmocka_unit_test(test_nccl_member_dies_inside_a_collective),
      cmocka_unit_test(test_nccl_two_members_on_one_gpu_refused),
      cmocka_unit_test(test_nccl_subgroups_use_the_process_device),
      cmocka_unit_test(test_nccl_rpc_traffic_during_collectives),
  };
  int failed = cmocka_run_group_tests_name("collectives_nccl", tests, NULL, NULL);
  if (failed) return 1;
  return ngpu == 0 || !nccl_built() ? 77 : 0;
}
