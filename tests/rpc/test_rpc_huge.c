/* test_rpc_huge.c - a large tensor arriving at a worker does not hold up its network thread: while
 * rank 1 sends 512 MiB tensors to rank 0 (same host: rank 0 copies them out of rank 1's memory),
 * rank 2 keeps calling a function that rank 0 runs on its network thread, and keeps using rank 0's
 * store; the slowest of those calls must stay well below the time one transfer takes (were the
 * copy made on the network thread, a call arriving meanwhile would wait for all of it). The
 * group shuts down gracefully afterwards. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "mp_util.h"
#include "rpc_test_fns.h"
#include "test_util.h"

#define BIG_BYTES (512ull << 20)

/* Rank 0: swallows a tensor (answers its first element). */
static td_status fn_sink(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)fut;
  td_tensor *t;
  if (n != 1 || td_value_as_tensor(args[0], &t) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "sink: one tensor");
  *res = td_value_double(((const float *)td_tensor_data(t))[0]);
  return TD_OK;
}

/* Rank 2: told by rank 1 that the transfers are over, and how long the slowest took. */
static volatile int stop_flag;
static volatile double transfer_s;
static td_status fn_stop(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)fut;
  double s = 0;
  if (n == 1) td_value_as_double(args[0], &s);
  transfer_s = s;
  __atomic_store_n(&stop_flag, 1, __ATOMIC_RELEASE);
  *res = td_value_none();
  return TD_OK;
}

static int worker_huge(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("sink", fn_sink, NULL));
  MP_CHECK_OK(td_rpc_register_ex("ping", td_test_fn_echo, NULL, TD_RPC_INLINE)); /* network thread */
  MP_CHECK_OK(td_rpc_register("stop", fn_stop, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  o.rpc_timeout_ms = td_test_ms(120000);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 1) {
    int64_t shape[1] = {(int64_t)(BIG_BYTES / 4)};
    td_tensor *t;
    MP_CHECK_OK(td_tensor_full(shape, 1, 3.0, TD_DTYPE_F32, td_device_cpu(), &t));
    td_value *v = td_value_tensor(t);
    double longest = 0;
    for (int i = 0; i < 4; i++) {
      td_value *r = NULL;
      double t0 = td_test_now_s();
      MP_CHECK_OK(td_rpc_sync(a, "worker0", "sink", &v, 1, NULL, &r));
      double dt = td_test_now_s() - t0;
      if (dt > longest) longest = dt;
      double first;
      MP_CHECK_OK(td_value_as_double(r, &first));
      MP_CHECK(first == 3.0);
      td_value_unref(r);
    }
    fprintf(stderr, "512 MiB transfers: the slowest took %.3f s\n", longest);
    td_value *l = td_value_double(longest), *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "stop", &l, 1, NULL, &r));
    td_value_unref(r);
    td_value_unref(l);
    td_value_unref(v);
    td_tensor_unref(t);
  } else if (rank == 2) {
    /* calls to rank 0 while the transfers run (ping runs on rank 0's network thread) */
    double worst_call = 0;
    int calls = 0;
    while (!__atomic_load_n(&stop_flag, __ATOMIC_ACQUIRE)) {
      td_value *x = td_value_int(calls), *r = NULL;
      double t0 = td_test_now_s();
      MP_CHECK_OK(td_rpc_sync(a, "worker0", "ping", &x, 1, NULL, &r));
      double dt = td_test_now_s() - t0;
      if (dt > worst_call) worst_call = dt;
      td_value_unref(r);
      td_value_unref(x);
      calls++;
      td_test_sleep_ms(2);
    }
    fprintf(stderr, "during the transfers: %d calls to rank 0, the slowest %.3f s (a transfer "
            "%.3f s)\n", calls, worst_call, transfer_s);
    MP_CHECK(calls > 10);
    /* copied on the network thread, a call would wait for a whole transfer's copy; a short
     * transfer (a fast machine) proves nothing either way */
    if (transfer_s > 0.1) MP_CHECK(worst_call < transfer_s / 2);
  }
  /* rank 0 enters the graceful shutdown at once and waits there for the transfers: four 512 MiB
   * tensors took 51-63 s in a loaded ASan run, so the deadline must not be a minute */
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(180000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_huge_receive_keeps_network_thread_free(void **state) {
  (void)state;
  TD_MP_RUN(3, worker_huge, NULL, 240);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_huge_receive_keeps_network_thread_free),
  };
  return cmocka_run_group_tests_name("rpc_huge", tests, NULL, NULL);
}
