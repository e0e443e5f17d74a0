/* test_gpu_rpc.c - CUDA tensors over RPC beyond test_rpc_devmap_gpu (label gpu): a 512 MiB CUDA
 * tensor each way along a device map, and device maps between cuda:0 of one worker and cuda:1 of
 * the other, in both directions, with replies on the reverse map.
 *
 * The parent process never initialises CUDA (td_cuda_device_count asks NVML or a probe child), so
 * the workers it forks can. Without a CUDA device every test skips and the program exits 77; the
 * two-device test skips with a message on a machine with one GPU. */
#include <string.h>

#include "mp_util.h"
#include "tdist/rpc.h"
#include "test_util.h"

static int ndev;

static double scale(void) { return td_test_timeout_scale(); }

/* twice_on(t, device) -> 2 t, computed where t arrived, which must be `device` (else the call
 * fails with TD_ERR_DEVICE naming both). */
static td_status fn_twice_on(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  td_tensor *t, *u;
  const char *want;
  char dn[32];
  td_status st = td_value_as_tensor(args[0], &t);
  if (st == TD_OK) st = td_value_as_string(args[1], &want, NULL);
  if (st != TD_OK) return st;
  if (strcmp(td_device_str(td_tensor_device(t), dn, sizeof dn), want) != 0)
    return td_set_error(TD_ERR_DEVICE, "twice_on: the argument arrived on %s, not %s", dn, want);
  if ((st = td_tensor_mul_scalar(t, 2, &u)) != TD_OK) return st;
  *res = td_value_tensor(u);
  td_tensor_unref(u);
  return *res ? TD_OK : TD_ERR_NOMEM;
}

static td_rpc_agent *start(int rank, int world, const char *method,
                           const td_rpc_device_map_entry *map) {
  MP_CHECK_OK(td_rpc_register("twice_on", fn_twice_on, NULL));
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = method;
  o.num_worker_threads = 2;
  o.rpc_timeout_ms = (int64_t)(180000 * scale());
  o.init_timeout_ms = (int64_t)(60000 * scale());
  if (map) {
    o.device_maps = map;
    o.num_device_maps = 1;
  }
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

/* Calls twice_on on peer with n float32 values on dev (all 1.5, the last 1024 are 7), which
 * checks that they arrived on arrives_on; checks where the reply came back and its values. */
static void call_where_twice(td_rpc_agent *a, const char *peer, td_device dev, int64_t n,
                             const char *arrives_on) {
  td_tensor *t = NULL, *tail = NULL, *got = NULL;
  MP_CHECK_OK(td_tensor_full(&n, 1, 1.5, TD_DTYPE_F32, dev, &t));
  MP_CHECK_OK(td_tensor_narrow(t, 0, n - 1024, 1024, &tail));
  MP_CHECK_OK(td_tensor_fill_(tail, 7));
  td_value *args[2] = {td_value_tensor(t), td_value_string(arrives_on)}, *res = NULL;
  MP_CHECK_OK(td_rpc_sync(a, peer, "twice_on", args, 2, NULL, &res));
  MP_CHECK_OK(td_value_as_tensor(res, &got));
  MP_CHECK(td_device_equal(td_tensor_device(got), dev));
  MP_CHECK(td_tensor_numel(got) == n);
  int64_t at[4] = {0, n / 2, n - 1025, n - 1};
  double want[4] = {3, 3, 3, 14}, v;
  for (int i = 0; i < 4; i++) {
    MP_CHECK_OK(td_tensor_get(got, &at[i], &v));
    MP_CHECK(v == want[i]);
  }
  td_value_unref(args[0]);
  td_value_unref(args[1]);
  td_value_unref(res);
  td_tensor_unref(tail);
  td_tensor_unref(t);
}

/* ---- a large CUDA tensor ---- */

static int worker_large(int rank, int world, const char *method, void *arg) {
  int d1 = ndev > 1 ? 1 : 0;
  char to[16];
  snprintf(to, sizeof to, "cuda:%d", d1);
  td_rpc_device_map_entry map = {"worker1", "cuda:0", to};
  td_rpc_agent *a = start(rank, world, method, rank == 0 ? &map : NULL);
  if (rank == 0) {
    int64_t n = (int64_t)128 << 20; /* 512 MiB of float32 */
    call_where_twice(a, "worker1", td_device_cuda(0), n, to);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, (int64_t)(120000 * scale())));
  td_rpc_destroy(a);
  return 0;
}

static void test_gpu_rpc_large_cuda_tensor(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  int fails = td_mp_run(2, worker_large, NULL, 240, NULL);
  if (fails) fail_msg("%d of 2 workers failed", fails);
}

/* ---- cuda:0 <-> cuda:1 ---- */

static int worker_cross(int rank, int world, const char *method, void *arg) {
  td_rpc_device_map_entry map0 = {"worker1", "cuda:0", "cuda:1"};
  td_rpc_device_map_entry map1 = {"worker0", "cuda:1", "cuda:0"};
  td_rpc_agent *a = start(rank, world, method, rank == 0 ? &map0 : &map1);
  if (rank == 0) call_where_twice(a, "worker1", td_device_cuda(0), 4096, "cuda:1");
  else call_where_twice(a, "worker0", td_device_cuda(1), 4096, "cuda:0");
  MP_CHECK_OK(td_rpc_shutdown(a, true, (int64_t)(60000 * scale())));
  td_rpc_destroy(a);
  return 0;
}

static void test_gpu_rpc_device_maps_between_cuda0_and_cuda1(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(2);
  int fails = td_mp_run(2, worker_cross, NULL, 120, NULL);
  if (fails) fail_msg("%d of 2 workers failed", fails);
}

int main(void) {
  ndev = td_cuda_device_count(); /* NVML or a probe child: this process stays fork-safe */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_rpc_large_cuda_tensor),
      cmocka_unit_test(test_gpu_rpc_device_maps_between_cuda0_and_cuda1),
  };
  int failed = cmocka_run_group_tests_name("gpu_rpc", tests, NULL, NULL);
  if (failed) return 1;
  return ndev == 0 ? 77 : 0;
}
