/* test_rpc_scale.c - 64 worker processes (TD_RPC_SCALE_WORLD for another count, by hand) on one
 * (small) machine: init, an all-to-all round of
 * calls (every worker calls every other worker once, async, then waits for all) and a graceful
 * shutdown, with two worker threads per agent and the default keepalive (stretched by
 * TD_TEST_TIMEOUT_SCALE, and 4x in sanitizer builds). Rank 0 prints the time each phase took. */
#include <stdio.h>
#include <stdlib.h>

#include "rpc_test_fns.h"
#include "test_util.h"

enum { WORLD_MAX = 1024 };

static int world_size(void) {
  const char *e = getenv("TD_RPC_SCALE_WORLD");
  int w = e && *e ? atoi(e) : 64;
  return w >= 2 && w <= WORLD_MAX ? w : 64;
}

/* Sanitizer builds run several times slower: 64 of them overload two cores, so live peers answer
 * pings late and finish connection handshakes late; the keepalive timeout and the handshake
 * timeout (20 s each by default) are stretched accordingly. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SLOWDOWN 4.0
#else
#define SLOWDOWN 1.0
#endif

static int worker_all_to_all(int rank, int world, const char *method, void *arg) {
  double scale = td_test_timeout_scale();
  register_test_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = td_test_ms(200000);
  o.rpc_timeout_ms = td_test_ms(120000);
  o.keepalive_timeout_ms = (int64_t)(o.keepalive_timeout_ms * scale * SLOWDOWN);
  char hs[32];
  snprintf(hs, sizeof hs, "%lld", (long long)(20000 * scale * SLOWDOWN));
  setenv("TD_RPC_HANDSHAKE_TIMEOUT_MS", hs, 1); /* this worker process only */
  td_rpc_agent *a;
  double t0 = td_test_now_s();
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  double t_init = td_test_now_s();
  MP_CHECK(td_rpc_world_size(a) == world);

  /* every worker calls add(rank, peer) on every other worker */
  td_future **fs = calloc((size_t)world, sizeof *fs);
  MP_CHECK(fs != NULL);
  for (int p = 0; p < world; p++) {
    if (p == rank) continue;
    td_worker_info wi;
    MP_CHECK_OK(td_rpc_get_worker_info_by_rank(a, p, &wi));
    td_value *args[2] = {td_value_int(rank * 1000), td_value_int(p)};
    MP_CHECK_OK(td_rpc_async(a, wi.name, "add", args, 2, NULL, &fs[p]));
    td_value_unref(args[0]);
    td_value_unref(args[1]);
  }
  for (int p = 0; p < world; p++) {
    if (p == rank) continue;
    td_status st = td_future_wait(fs[p], td_test_ms(150000));
    if (st != TD_OK)
      fprintf(stderr, "rank %d: call to rank %d: %s: %s\n", rank, p, td_status_name(st),
              td_future_message(fs[p]));
    MP_CHECK_OK(st);
    int64_t v = -1;
    MP_CHECK_OK(td_value_as_int(td_future_value(fs[p]), &v));
    MP_CHECK(v == rank * 1000 + p);
    td_future_unref(fs[p]);
  }
  free(fs);
  double t_calls = td_test_now_s();
  td_status st = td_rpc_shutdown(a, true, td_test_ms(150000));
  if (st != TD_OK) fprintf(stderr, "rank %d: shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  double t_shut = td_test_now_s();
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  if (rank == 0)
    fprintf(stderr, "scale: %d workers: init %.2f s, all-to-all (%d calls each) %.2f s, graceful "
            "shutdown %.2f s\n", world, t_init - t0, world - 1, t_calls - t_init, t_shut - t_calls);
  return 0;
}

static void test_rpc_scale_64_workers_all_to_all(void **state) {
  (void)state;
  static int codes[WORLD_MAX];
  int world = world_size();
  double t0 = td_test_now_s();
  int fails = td_mp_run(world, worker_all_to_all, NULL, 280, codes);
  fprintf(stderr, "scale: %d workers: %.2f s from fork to the last exit\n", world,
          td_test_now_s() - t0);
  if (fails) {
    char buf[512];
    size_t used = 0;
    for (int r = 0; r < world && used < sizeof buf - 16; r++)
      if (codes[r]) used += (size_t)snprintf(buf + used, sizeof buf - used, " %d:%d", r, codes[r]);
    fail_msg("%d of %d workers failed (rank:code%s)", fails, world, buf);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_scale_64_workers_all_to_all),
  };
  return cmocka_run_group_tests_name("rpc_scale", tests, NULL, NULL);
}
