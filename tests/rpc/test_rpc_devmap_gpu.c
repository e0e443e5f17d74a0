/* test_rpc_devmap_gpu.c - CUDA tensors over RPC along device maps (label gpu): a tensor on cuda:0
 * sent with cuda:0 -> cuda:0 arrives on cuda:0 with equal values and the reply comes back on
 * cuda:0 (the reverse map); cuda:0 -> cpu lands on the CPU and a CPU result comes back on cuda:0;
 * a tensor on an unmapped device is a TD_ERR_DEVICE naming the device and the peer, as an
 * argument and as a result; distributed autograd sends the gradient of an argument back along the
 * reverse map. Two workers share the one GPU.
 *
 * The parent process never touches CUDA (a CUDA context does not survive fork): a probe child
 * counts the devices. Without one every test calls skip() with a message and the program exits
 * with 77, which CMake's SKIP_RETURN_CODE reports as "skipped". */
#include "rpc_test_fns.h"
#include "tdist/autograd.h"
#include "tdist/dist_autograd.h"
#include "test_util.h"

static int ncuda; /* found by the probe child */

static int probe_devices(int rank, int world, const char *method, void *arg) {
  int n = td_cuda_device_count();
  return n > 100 ? 100 : n;
}

#define REQUIRE_GPU()                                                                         \
  do {                                                                                        \
    if (ncuda == 0) {                                                                         \
      print_message("%s: no CUDA device is present (td_cuda_device_count() == 0); skipped\n", \
                    __func__);                                                                \
      skip();                                                                                 \
    }                                                                                         \
  } while (0)

static const float data[] = {1.5f, -2, 3, 4.25f, 5, 6};
static const int64_t shape[] = {2, 3};

/* where(t): [the device t arrived on, t + 1 computed there] */
static td_status fn_where(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  td_tensor *t, *u;
  td_status st = td_value_as_tensor(args[0], &t);
  if (st != TD_OK) return st;
  if ((st = td_tensor_add_scalar(t, 1, &u)) != TD_OK) return st;
  char dn[32];
  td_value *l = td_value_list();
  if (!l || td_value_list_append(l, td_value_string(td_device_str(td_tensor_device(t), dn,
                                                                  sizeof dn))) != TD_OK ||
      td_value_list_append(l, td_value_tensor(u)) != TD_OK) {
    td_value_unref(l);
    td_tensor_unref(u);
    return td_set_error(TD_ERR_NOMEM, "where: out of memory");
  }
  td_tensor_unref(u);
  *res = l;
  return TD_OK;
}

/* make_cuda(): a tensor on cuda:0 */
static td_status fn_make_cuda(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  td_tensor *t;
  td_status st = td_tensor_ones(shape, 2, TD_DTYPE_F32, td_device_cuda(0), &t);
  if (st != TD_OK) return st;
  *res = td_value_tensor(t);
  td_tensor_unref(t);
  return TD_OK;
}

typedef struct gpu_case {
  td_rpc_device_map_entry map; /* worker0's map toward worker1 */
  const char *arrives_on;      /* where worker1 finds the argument */
  td_device reply_on;          /* where worker0 finds the result */
} gpu_case;

/* Checks that h (any device) holds data + add. */
static void check_values(const td_tensor *h, float add) {
  float got[6];
  MP_CHECK(td_tensor_numel(h) == 6);
  MP_CHECK_OK(td_tensor_copy_to_buffer(h, got, sizeof got));
  for (int i = 0; i < 6; i++) MP_CHECK(got[i] == data[i] + add);
}

static int worker_transfer(int rank, int world, const char *method, void *arg) {
  const gpu_case *c = arg;
  MP_CHECK_OK(td_rpc_register("where", fn_where, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 2);
  if (rank == 0) {
    o.device_maps = &c->map;
    o.num_device_maps = 1;
  }
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_tensor *h, *g;
    MP_CHECK_OK(td_tensor_from_buffer(data, shape, 2, TD_DTYPE_F32, &h));
    MP_CHECK_OK(td_tensor_to(h, td_device_cuda(0), &g));
    td_value *v = td_value_tensor(g), *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "where", &v, 1, NULL, &r));
    const char *on;
    MP_CHECK_OK(td_value_as_string(td_value_list_get(r, 0), &on, NULL));
    if (strcmp(on, c->arrives_on) != 0) {
      fprintf(stderr, "the argument arrived on %s, not %s\n", on, c->arrives_on);
      return 1;
    }
    td_tensor *back;
    MP_CHECK_OK(td_value_as_tensor(td_value_list_get(r, 1), &back));
    MP_CHECK(td_device_equal(td_tensor_device(back), c->reply_on));
    check_values(back, 1);
    check_values(g, 0); /* the sender's tensor is untouched */
    td_value_unref(r);
    td_value_unref(v);
    td_tensor_unref(g);
    td_tensor_unref(h);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  td_rpc_destroy(a);
  return 0;
}

static void run_case(const gpu_case *c) {
  TD_MP_RUN(2, worker_transfer, (void *)c, 90);
}

static void test_rpc_devmap_gpu_cuda_to_cuda(void **state) {
  REQUIRE_GPU();
  const gpu_case c = {{"worker1", "cuda:0", "cuda:0"}, "cuda:0", {TD_DEVICE_CUDA, 0}};
  run_case(&c);
}

/* cuda:0 -> cpu: the argument lands on worker1's CPU; its CPU result comes back along the
 * reverse entry cpu -> cuda:0. */
static void test_rpc_devmap_gpu_cuda_to_cpu(void **state) {
  REQUIRE_GPU();
  const gpu_case c = {{"worker1", "cuda:0", "cpu"}, "cpu", {TD_DEVICE_CUDA, 0}};
  run_case(&c);
}

/* Only cpu is mapped: a cuda:0 argument is refused at once, and so is a cuda:0 result (the call
 * fails with the callee's reason); the agent goes on working. */
static int worker_unmapped(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("make_cuda", fn_make_cuda, NULL));
  const td_rpc_device_map_entry map = {"worker1", "cpu", "cpu"};
  td_rpc_options o = td_mp_rpc_options(method, 2);
  if (rank == 0) {
    o.device_maps = &map;
    o.num_device_maps = 1;
  }
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_tensor *g;
    MP_CHECK_OK(td_tensor_ones(shape, 2, TD_DTYPE_F32, td_device_cuda(0), &g));
    td_value *v = td_value_tensor(g), *r = NULL;
    td_future *f = NULL;
    MP_CHECK(td_rpc_async(a, "worker1", "echo", &v, 1, NULL, &f) == TD_ERR_DEVICE);
    MP_CHECK(f == NULL);
    MP_CHECK(strstr(td_last_error(), "cuda:0") && strstr(td_last_error(), "worker1 (rank 1)"));
    MP_CHECK(td_rpc_sync(a, "worker1", "make_cuda", NULL, 0, NULL, &r) == TD_ERR_DEVICE);
    const char *msg = td_last_error();
    if (!strstr(msg, "make_cuda") || !strstr(msg, "cuda:0") ||
        !strstr(msg, "sent back to worker0 (rank 0)")) {
      fprintf(stderr, "unexpected message: '%s'\n", msg);
      return 1;
    }
    td_value *x = td_value_int(7);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &x, 1, NULL, &r));
    MP_CHECK(td_value_equal(r, x));
    td_value_unref(r);
    td_value_unref(x);
    td_value_unref(v);
    td_tensor_unref(g);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_devmap_gpu_unmapped_is_an_error(void **state) {
  REQUIRE_GPU();
  TD_MP_RUN(2, worker_unmapped, NULL, 90);
}

/* twice(t) = 2 t, computed where t arrived */
static td_status fn_twice(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  td_tensor *t, *u;
  td_status st = td_value_as_tensor(args[0], &t);
  if (st == TD_OK) st = td_tensor_mul_scalar(t, 2, &u);
  if (st != TD_OK) return st;
  *res = td_value_tensor(u);
  td_tensor_unref(u);
  return TD_OK;
}

/* worker0 maps cuda:0 -> cpu toward worker1 (worker1 has no map): x on cuda:0 is doubled on
 * worker1's CPU, the result comes back on cuda:0, and the gradient of x (2 everywhere) must come
 * back from worker1's CPU to cuda:0 along the reverse of worker0's map. */
static int worker_autograd(int rank, int world, const char *method, void *arg) {
  MP_CHECK_OK(td_rpc_register("twice", fn_twice, NULL));
  const td_rpc_device_map_entry map = {"worker1", "cuda:0", "cpu"};
  td_rpc_options o = td_mp_rpc_options(method, 2);
  if (rank == 0) {
    o.device_maps = &map;
    o.num_device_maps = 1;
  }
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_tensor *h, *x, *y, *loss;
    MP_CHECK_OK(td_tensor_from_buffer(data, shape, 2, TD_DTYPE_F32, &h));
    MP_CHECK_OK(td_tensor_to(h, td_device_cuda(0), &x));
    MP_CHECK_OK(td_tensor_set_requires_grad(x, true));
    td_dist_autograd_context *ctx;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_value *v = td_value_tensor(x), *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "twice", &v, 1, NULL, &r));
    MP_CHECK_OK(td_value_as_tensor(r, &y));
    MP_CHECK(td_device_equal(td_tensor_device(y), td_device_cuda(0)));
    MP_CHECK_OK(td_tensor_sum_all(y, &loss));
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
    td_grad_map *gm;
    MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
    td_tensor *gx = td_grad_map_get(gm, x);
    MP_CHECK(gx != NULL);
    MP_CHECK(td_device_equal(td_tensor_device(gx), td_device_cuda(0)));
    float got[6];
    MP_CHECK_OK(td_tensor_copy_to_buffer(gx, got, sizeof got));
    for (int i = 0; i < 6; i++) MP_CHECK(got[i] == 2.0f);
    td_tensor_unref(gx);
    td_grad_map_destroy(gm);
    td_tensor_unref(loss);
    td_value_unref(r);
    td_value_unref(v);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    td_tensor_unref(x);
    td_tensor_unref(h);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_devmap_gpu_gradients_take_the_reverse_map(void **state) {
  REQUIRE_GPU();
  TD_MP_RUN(2, worker_autograd, NULL, 90);
}

int main(void) {
  int codes[1] = {0};
  td_mp_run(1, probe_devices, NULL, 60, codes);
  ncuda = codes[0] >= 0 && codes[0] <= 100 ? codes[0] : 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_devmap_gpu_cuda_to_cuda),
      cmocka_unit_test(test_rpc_devmap_gpu_cuda_to_cpu),
      cmocka_unit_test(test_rpc_devmap_gpu_unmapped_is_an_error),
      cmocka_unit_test(test_rpc_devmap_gpu_gradients_take_the_reverse_map),
  };
  int rc = cmocka_run_group_tests(tests, NULL, NULL);
  return rc == 0 && ncuda == 0 ? 77 : rc;
}
