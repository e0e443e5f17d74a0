/* test_collectives_nccl.c - the NCCL backend on CUDA tensors, one process per GPU (at most 4):
 * every collective against the CPU-computed expectation. Without a CUDA device it skips (exit
 * 77); in a build without NCCL it checks that asking for the backend is TD_ERR_UNSUPPORTED and
 * skips as well. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

static int world_for_devices(void) {
  int n = td_cuda_device_count();
  return n > 4 ? 4 : n;
}

/* CPU tensor of n floats for rank r (integer values), then moved to dev. */
static td_tensor *make_on(int r, int64_t off, int64_t n, td_device dev) {
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = (double)((r + 1) * ((off + i) % 11) - r);
  td_tensor *c = coll_tensor(v, n, TD_DTYPE_F32), *g = NULL;
  free(v);
  MP_CHECK_OK(td_tensor_to(c, dev, &g));
  td_tensor_unref(c);
  return g;
}

static void expect_equal(const char *what, td_tensor *gpu, td_tensor *cpu_want) {
  td_tensor *c = NULL;
  MP_CHECK_OK(td_tensor_to(gpu, td_device_cpu(), &c));
  MP_CHECK(coll_equal(what, c, cpu_want));
  td_tensor_unref(c);
}

static int worker_nccl(int rank, int world, const char *method, void *arg) {
  char lr[16];
  snprintf(lr, sizeof lr, "%d", rank);
  setenv("LOCAL_RANK", lr, 1);
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, &pg));
  td_device dev = td_device_cuda(rank);
  int64_t sizes[3] = {1, 7, 100003};
  for (int s = 0; s < 3; s++) {
    int64_t n = sizes[s];
    /* all_reduce sum / max / avg */
    for (int op = 0; op < 3; op++) {
      td_tensor *t = make_on(rank, 0, n, dev), *want = make_on(0, 0, n, td_device_cpu());
      float *w = td_tensor_data(want);
      for (int64_t i = 0; i < n; i++) {
        for (int r = 1; r < world; r++) {
          float x = (float)((r + 1) * (i % 11) - r);
          w[i] = op == TD_REDUCE_MAX ? (x > w[i] ? x : w[i]) : w[i] + x;
        }
        if (op == TD_REDUCE_AVG) w[i] /= (float)world;
      }
      MP_CHECK_OK(td_process_group_all_reduce(pg, t, (td_reduce_op)op));
      expect_equal("nccl all_reduce", t, want);
      td_tensor_unref(t);
      td_tensor_unref(want);
    }
    /* broadcast from the last rank */
    td_tensor *t = make_on(rank, 0, n, dev), *want = make_on(world - 1, 0, n, td_device_cpu());
    MP_CHECK_OK(td_process_group_broadcast(pg, t, world - 1));
    expect_equal("nccl broadcast", t, want);
    td_tensor_unref(t);
    td_tensor_unref(want);
    /* all_gather, both forms */
    td_tensor *in = make_on(rank, 0, n, dev), *cat = NULL, **outs = calloc((size_t)world, sizeof *outs);
    int64_t total = n * world;
    MP_CHECK_OK(td_tensor_zeros(&total, 1, TD_DTYPE_F32, dev, &cat));
    for (int r = 0; r < world; r++) MP_CHECK_OK(td_tensor_zeros(&n, 1, TD_DTYPE_F32, dev, &outs[r]));
    MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, cat, in));
    MP_CHECK_OK(td_process_group_all_gather(pg, outs, in));
    for (int r = 0; r < world; r++) {
      td_tensor *wr = make_on(r, 0, n, td_device_cpu()), *slice = NULL;
      expect_equal("nccl all_gather", outs[r], wr);
      MP_CHECK_OK(td_tensor_narrow(cat, 0, r * n, n, &slice));
      expect_equal("nccl all_gather_into_tensor", slice, wr);
      td_tensor_unref(slice);
      td_tensor_unref(wr);
      td_tensor_unref(outs[r]);
    }
    free(outs);
    td_tensor_unref(in);
    /* reduce_scatter (sum): member r's slot j holds elements [j n, (j + 1) n) */
    td_tensor *src = make_on(rank, 0, total, dev), *out = NULL;
    MP_CHECK_OK(td_tensor_zeros(&n, 1, TD_DTYPE_F32, dev, &out));
    MP_CHECK_OK(td_process_group_reduce_scatter_tensor(pg, out, src, TD_REDUCE_SUM));
    td_tensor *rw = make_on(0, rank * n, n, td_device_cpu());
    float *w = td_tensor_data(rw);
    for (int64_t i = 0; i < n; i++)
      for (int r = 1; r < world; r++) w[i] += (float)((r + 1) * ((rank * n + i) % 11) - r);
    expect_equal("nccl reduce_scatter", out, rw);
    td_tensor_unref(src);
    td_tensor_unref(out);
    td_tensor_unref(rw);
    td_tensor_unref(cat);
    MP_CHECK_OK(td_process_group_barrier(pg));
  }
  /* a CPU tensor is refused by an NCCL group */
  td_tensor *c = make_on(rank, 0, 3, td_device_cpu());
  MP_CHECK(td_process_group_all_reduce(pg, c, TD_REDUCE_SUM) == TD_ERR_DEVICE);
  td_tensor_unref(c);
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  return 0;
}

static int worker_probe(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  td_status st = td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, &pg);
  if (st == TD_OK) td_process_group_destroy(pg);
  MP_CHECK(st == TD_OK || st == TD_ERR_UNSUPPORTED);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  return st == TD_OK ? 0 : 77;
}

static int skipped_no_nccl;

static void test_nccl_collectives_match_cpu(void **state) {
  if (td_cuda_device_count() == 0) {
    print_message("no CUDA device is present (td_cuda_device_count() == 0); skipped\n");
    skip();
  }
  int world = world_for_devices(), codes[4] = {0};
  td_mp_run(1, worker_probe, NULL, 60, codes);
  if (codes[0] != 0 && codes[0] != 77) fail_msg("the NCCL probe failed (exit %d)", codes[0]);
  if (codes[0] == 77) {
    skipped_no_nccl = 1;
    print_message("this build has no NCCL (the backend reports TD_ERR_UNSUPPORTED); skipped\n");
    skip();
  }
  int fails = td_mp_run(world, worker_nccl, NULL, 240, codes);
  if (fails) fail_msg("%d of %d workers failed", fails, world);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nccl_collectives_match_cpu),
  };
  int failed = cmocka_run_group_tests_name("collectives_nccl", tests, NULL, NULL);
  if (failed) return 1;
  return td_cuda_device_count() == 0 || skipped_no_nccl ? 77 : 0;
}
