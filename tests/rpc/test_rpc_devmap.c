/* test_rpc_devmap.c - device maps (td_rpc_options.device_maps) without a GPU: every kind of bad
 * map fails td_rpc_init on every worker, fast and with the same message naming the worker and the
 * entry; cpu maps are accepted and calls carry tensors as before; a cuda:N map needs that device.
 * The transfers of CUDA tensors are in test_rpc_devmap_gpu.c (label gpu). */
#include <time.h>

#include "rpc_test_fns.h"
#include "test_util.h"

/* ---- bad maps ---- */

typedef struct bad_map_case {
  const char *name;
  int rank; /* the worker whose map is bad (the others give none) */
  td_rpc_device_map_entry e[2];
  int n;
  td_status st;      /* what the worker that finds it returns (the others may see TD_ERR_REMOTE) */
  const char *where; /* the worker and the entry, as every worker's message names them */
  const char *why;
} bad_map_case;

static const bad_map_case bad_cases[] = {
    {"unknown worker", 0, {{"nobody", "cpu", "cpu"}}, 1, TD_ERR_INVALID,
     "device map of worker0 (rank 0), entry 0 {\"nobody\", \"cpu\", \"cpu\"}",
     "there is no worker named 'nobody'"},
    {"map to itself", 1, {{"worker1", "cpu", "cpu"}}, 1, TD_ERR_INVALID,
     "device map of worker1 (rank 1), entry 0", "cannot map devices to itself"},
    {"malformed local device", 1, {{"worker0", "cpu", "cpu"}, {"worker0", "gpu:0", "cpu"}}, 2,
     TD_ERR_INVALID, "device map of worker1 (rank 1), entry 1 {\"worker0\", \"gpu:0\", \"cpu\"}",
     "local device 'gpu:0' is malformed"},
    {"malformed remote device", 0, {{"worker1", "cpu", "cuda:-1"}}, 1, TD_ERR_INVALID,
     "device map of worker0 (rank 0), entry 0", "remote device 'cuda:-1' is malformed"},
    {"NULL device", 0, {{"worker1", NULL, "cpu"}}, 1, TD_ERR_INVALID,
     "device map of worker0 (rank 0), entry 0", "local device '' is malformed"},
    {"local device index", 0, {{"worker1", "cuda:1023", "cpu"}}, 1, TD_ERR_DEVICE,
     "device map of worker0 (rank 0), entry 0",
     "local device cuda:1023 does not exist on worker0"},
    {"remote device index", 1, {{"worker0", "cpu", "cuda:1023"}}, 1, TD_ERR_DEVICE,
     "device map of worker1 (rank 1), entry 0",
     "remote device cuda:1023 does not exist on worker0"},
    /* checked before whether the devices exist, so it needs no GPU */
    {"two devices to one", 0, {{"worker1", "cpu", "cpu"}, {"worker1", "cuda:0", "cpu"}}, 2,
     TD_ERR_INVALID, "device map of worker0 (rank 0), entry 1",
     "cpu and cuda:0 both map to cpu on worker1"},
    {"one device twice", 1, {{"worker0", "cpu", "cpu"}, {"worker0", "cpu", "cuda:0"}}, 2,
     TD_ERR_INVALID, "device map of worker1 (rank 1), entry 1",
     "cpu is already mapped to cpu on worker0"},
};

static int worker_bad_map(int rank, int world, const char *method, void *arg) {
  const bad_map_case *c = arg;
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = td_test_ms(60000); /* a worker left waiting would be killed by td_mp_run first */
  if (rank == c->rank) {
    o.device_maps = c->e;
    o.num_device_maps = c->n;
  }
  td_rpc_agent *a = NULL;
  double t0 = td_test_now_s();
  td_status st = td_rpc_init(NULL, rank, world, &o, &a);
  double took = td_test_now_s() - t0;
  if (st == TD_OK || a) {
    fprintf(stderr, "case '%s': rank %d: td_rpc_init succeeded\n", c->name, rank);
    return 1;
  }
  const char *msg = td_last_error();
  if ((st != c->st && st != TD_ERR_REMOTE) || !strstr(msg, c->where) || !strstr(msg, c->why) ||
      took > 15.0) {
    fprintf(stderr, "case '%s': rank %d: %s after %.1f s: '%s'\n", c->name, rank,
            td_status_name(st), took, msg);
    return 1;
  }
  return 0;
}

static void test_rpc_devmap_bad_maps_fail_init(void **state) {
  for (size_t i = 0; i < sizeof bad_cases / sizeof *bad_cases; i++) {
    TD_MP_RUN(2, worker_bad_map, (void *)&bad_cases[i], 40);
  }
}

/* A count or pointer that cannot be right fails at once, before any network. */
static void test_rpc_devmap_bad_options(void **state) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  assert_null(o.device_maps);
  assert_int_equal(o.num_device_maps, 0);
  o.init_method = "tcp://127.0.0.1:1";
  td_rpc_agent *a = NULL;
  o.num_device_maps = -1;
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 2, &o, &a), TD_ERR_INVALID);
  o.num_device_maps = 1;
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 2, &o, &a), TD_ERR_INVALID);
  assert_null(a);
}

/* A world of one checks its map as well. The child leaves with exit() rather than _exit(), so a
 * leak checker (ASan builds) sees the failed init unwind; the parent never starts an agent itself
 * (gRPC does not survive fork). */
static int worker_solo(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_method = "tcp://127.0.0.1:0";
  const td_rpc_device_map_entry e[] = {{"ghost", "cpu", "cpu"}};
  o.device_maps = e;
  o.num_device_maps = 1;
  td_rpc_agent *a = NULL;
  MP_CHECK(td_rpc_init("solo", 0, 1, &o, &a) == TD_ERR_INVALID);
  MP_CHECK(strstr(td_last_error(), "device map of solo (rank 0), entry 0"));
  MP_CHECK(strstr(td_last_error(), "no worker named 'ghost'"));
  MP_CHECK(a == NULL);
  o.num_device_maps = 0; /* without the bad entry the same world starts */
  MP_CHECK_OK(td_rpc_init("solo", 0, 1, &o, &a));
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(10000)));
  td_rpc_destroy(a);
  exit(0);
}

static void test_rpc_devmap_world_of_one(void **state) {
  int code = 0;
  if (td_mp_run(1, worker_solo, NULL, 30, &code)) fail_msg("the worker failed (%d)", code);
}

/* ---- cpu maps ---- */

/* Both workers map cpu -> cpu toward each other (worker1 gives its entry twice, which is
 * accepted); tensors go both ways, in requests and replies, and stay on the CPU. */
static int worker_cpu_maps(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  const td_rpc_device_map_entry maps0[] = {{"worker1", "cpu", "cpu"}};
  const td_rpc_device_map_entry maps1[] = {{"worker0", "cpu", "cpu"}, {"worker0", "cpu", "cpu"}};
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.device_maps = rank == 0 ? maps0 : maps1;
  o.num_device_maps = rank == 0 ? 1 : 2;
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  const float data[] = {1.5f, -2, 3, 4, 5, 6};
  int64_t shape[] = {3, 2};
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(data, shape, 2, TD_DTYPE_F32, &t));
  td_value *d = td_value_dict();
  MP_CHECK(d && td_value_dict_set(d, "t", td_value_tensor(t)) == TD_OK);
  MP_CHECK(td_value_dict_set(d, "n", td_value_int(rank)) == TD_OK);
  td_value *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, rank == 0 ? "worker1" : "worker0", "echo", &d, 1, NULL, &r));
  MP_CHECK(td_value_equal(r, d));
  td_tensor *back = NULL;
  MP_CHECK_OK(td_value_as_tensor(td_value_dict_get(r, "t"), &back));
  MP_CHECK(td_tensor_device(back).type == TD_DEVICE_CPU);
  td_value_unref(r);
  td_value_unref(d);
  td_tensor_unref(t);
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_devmap_cpu_maps_accepted(void **state) {
  TD_MP_RUN(2, worker_cpu_maps, NULL, 60);
}

/* ---- cuda:0 ---- */

/* A map from cuda:0 is an init error exactly when the worker has no CUDA device (as on machines
 * without a GPU, or in a build without CUDA); with one it is accepted. */
static int worker_cuda0(int rank, int world, const char *method, void *arg) {
  const td_rpc_device_map_entry maps[] = {{"worker1", "cuda:0", "cpu"}};
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = td_test_ms(60000);
  if (rank == 0) {
    o.device_maps = maps;
    o.num_device_maps = 1;
  }
  int ncuda = td_cuda_device_count();
  td_rpc_agent *a = NULL;
  td_status st = td_rpc_init(NULL, rank, world, &o, &a);
  if (ncuda > 0) {
    MP_CHECK_OK(st);
    MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
    td_rpc_destroy(a);
    return 0;
  }
  MP_CHECK(st == TD_ERR_DEVICE || st == TD_ERR_REMOTE);
  const char *msg = td_last_error();
  if (!strstr(msg, "device map of worker0 (rank 0), entry 0 {\"worker1\", \"cuda:0\", \"cpu\"}") ||
      !strstr(msg, "local device cuda:0 does not exist on worker0 (it has 0 CUDA devices)")) {
    fprintf(stderr, "rank %d: '%s'\n", rank, msg);
    return 1;
  }
  return 0;
}

static void test_rpc_devmap_cuda_map_needs_the_device(void **state) {
  TD_MP_RUN(2, worker_cuda0, NULL, 60);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_devmap_bad_maps_fail_init),
      cmocka_unit_test(test_rpc_devmap_bad_options),
      cmocka_unit_test(test_rpc_devmap_world_of_one),
      cmocka_unit_test(test_rpc_devmap_cpu_maps_accepted),
      cmocka_unit_test(test_rpc_devmap_cuda_map_needs_the_device),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
