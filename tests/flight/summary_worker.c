/* summary_worker.c - a job for tdistrun --summary (test_flight_hangs): two workers from tdistrun's
 * environment. Rank 1 arrives 100 ms late at each of 5 all_reduces (a straggler); rank 0 then
 * waits on rank 1's 300 ms function through a future and through an RRef fetch. So rank 0 waits
 * about 0.5 s in collectives and 0.6 s on remote work, none of it in td_rpc_sync, and rank 1's
 * straggler score is about 0.5 s. */
#include <stdio.h>
#include <time.h>

#include "tdist/collectives.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

static td_status slow(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                      td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  sleep_ms(300);
  *res = td_value_int(1);
  return TD_OK;
}

#define CHECK(x)                                                     \
  do {                                                               \
    if ((x) != TD_OK) {                                              \
      fprintf(stderr, "summary_worker: %s: %s\n", #x, td_last_error()); \
      return 1;                                                      \
    }                                                                \
  } while (0)

int main(void) {
  td_rpc_register("slow", slow, NULL);
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_timeout_ms = 60000;
  td_rpc_agent *a = NULL;
  td_process_group *pg = NULL;
  CHECK(td_rpc_init_from_env(NULL, &o, &a));
  CHECK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 60000, &pg));
  int rank = td_process_group_rank(pg);
  int64_t shape[1] = {16};
  td_tensor *t = NULL;
  CHECK(td_tensor_ones(shape, 1, TD_DTYPE_F32, td_device_cpu(), &t));
  for (int i = 0; i < 5; i++) {
    if (rank == 1) sleep_ms(100);
    CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  }
  td_tensor_unref(t);
  if (rank == 0) {
    td_future *f = NULL;
    CHECK(td_rpc_async(a, "worker1", "slow", NULL, 0, NULL, &f));
    CHECK(td_future_wait(f, TD_TIMEOUT_INFINITE));
    td_future_unref(f);
    td_rref *r = NULL;
    td_value *v = NULL;
    CHECK(td_remote(a, "worker1", "slow", NULL, 0, NULL, &r));
    CHECK(td_rref_to_here(r, TD_TIMEOUT_DEFAULT, &v));
    td_value_unref(v);
    td_rref_unref(r);
  }
  td_process_group_destroy(pg);
  CHECK(td_rpc_shutdown(a, true, 60000));
  td_rpc_destroy(a);
  return 0;
}
