/* test_collectives_groups.c - subgroups (members {1, 2} of 4 workers; rank 0 calls and gets no
 * group, rank 3 does not call), two groups over the same ranks, groups used alternately with the
 * world group, a one-member group; a member killed with SIGKILL makes every other member's
 * collective fail promptly with an error naming it, and the survivors can form a new group. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

static double v(int global_rank, int64_t i, int round) {
  return (double)((global_rank + 1) * 100 + (i % 17) + round);
}

static td_tensor *make(int global_rank, int64_t n, int round) {
  double *x = malloc((size_t)(n ? n : 1) * sizeof *x);
  for (int64_t i = 0; i < n; i++) x[i] = v(global_rank, i, round);
  td_tensor *t = coll_tensor(x, n, TD_DTYPE_F64);
  free(x);
  return t;
}

/* all_reduce(sum) over the global ranks in members[0..k) checked exactly. */
static void check_sum(td_process_group *pg, const int *members, int k, int me, int64_t n,
                      int round) {
  td_tensor *t = make(me, n, round), *want = make(members[0], n, round);
  double *w = td_tensor_data(want);
  for (int64_t i = 0; i < n; i++)
    for (int j = 1; j < k; j++) w[i] += v(members[j], i, round);
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  MP_CHECK(coll_equal("group all_reduce", t, want));
  td_tensor_unref(t);
  td_tensor_unref(want);
}

static int worker_groups(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *sub = NULL, *sub2 = NULL, *all = NULL, *solo = NULL;
  const int pair[2] = {2, 1}; /* any order: members are numbered by global rank */
  const int every[4] = {0, 1, 2, 3};
  if (rank != 3) {
    sub = (td_process_group *)&sub; /* must be overwritten with NULL on rank 0 */
    MP_CHECK_OK(td_process_group_create(a, pair, 2, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &sub));
  }
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &all));
  if (rank == 1 || rank == 2)
    MP_CHECK_OK(td_process_group_create(a, pair, 2, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &sub2));
  if (rank == 3) MP_CHECK_OK(td_process_group_create(a, &rank, 1, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &solo));
  if (rank == 0) MP_CHECK(sub == NULL);
  if (rank == 1 || rank == 2) {
    MP_CHECK(sub && sub2 && td_process_group_size(sub) == 2);
    MP_CHECK(td_process_group_rank(sub) == rank - 1);
    MP_CHECK(td_process_group_global_rank(sub, 0) == 1 && td_process_group_global_rank(sub, 1) == 2);
  }
  MP_CHECK(td_process_group_size(all) == 4 && td_process_group_rank(all) == rank);
  const int members[2] = {1, 2};
  for (int round = 0; round < 6; round++) {
    int64_t n = round % 2 ? 1001 : 3;
    check_sum(all, every, 4, rank, n, round);
    if (sub) {
      check_sum(sub, members, 2, rank, n + 1, round);
      /* the second group over the same ranks is separate: a broadcast from its rank 1 */
      td_tensor *t = make(rank, n, round), *want = make(2, n, round);
      MP_CHECK_OK(td_process_group_broadcast(sub2, t, 1));
      MP_CHECK(coll_equal("sub2 broadcast", t, want));
      td_tensor_unref(t);
      td_tensor_unref(want);
      MP_CHECK_OK(td_process_group_barrier(sub));
    }
    if (solo) {
      td_tensor *t = make(rank, n, round), *want = make(rank, n, round);
      MP_CHECK_OK(td_process_group_all_reduce(solo, t, TD_REDUCE_AVG));
      MP_CHECK_OK(td_process_group_broadcast(solo, t, 0));
      MP_CHECK_OK(td_process_group_barrier(solo));
      MP_CHECK(coll_equal("solo", t, want));
      td_tensor_unref(t);
      td_tensor_unref(want);
    }
    MP_CHECK_OK(td_process_group_barrier(all));
  }
  td_process_group_destroy(sub);
  td_process_group_destroy(sub2);
  td_process_group_destroy(solo);
  td_process_group_destroy(all);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_process_group_subgroups_and_alternation(void **state) {
  int codes[4];
  int fails = td_mp_run(4, worker_groups, NULL, 120, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

/* ---- a member killed with SIGKILL ---- */

static int worker_dead_peer(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  int64_t n = 1 << 20;
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_ones(&n, 1, TD_DTYPE_F32, td_device_cpu(), &t));
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  MP_CHECK(((float *)td_tensor_data(t))[n - 1] == (float)world);
  MP_CHECK_OK(td_process_group_barrier(pg));
  if (rank == 2) raise(SIGKILL);
  /* the others keep reducing: the first all_reduce that needs rank 2 fails on every member,
   * including ranks 0 (not a neighbour of 2 in the ring 0 -> 1 -> 2 -> 3 -> 0) */
  double t0 = coll_now_s();
  td_status st = TD_OK;
  for (int i = 0; i < 100 && st == TD_OK; i++) st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  double el = coll_now_s() - t0;
  const char *msg = td_last_error();
  fprintf(stderr, "[rank %d] after %.3f s: %s: %s\n", rank, el, td_status_name(st), msg);
  MP_CHECK(st == TD_ERR_UNAVAILABLE);
  MP_CHECK(strstr(msg, "worker2 (rank 2)") != NULL);
  MP_CHECK(el < 10 * coll_scale());
  MP_CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "worker2 (rank 2)") != NULL);
  td_process_group_destroy(pg);
  /* the survivors regroup */
  const int survivors[3] = {0, 1, 3};
  MP_CHECK_OK(td_process_group_create(a, survivors, 3, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK_OK(td_tensor_fill_(t, 2.0));
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  MP_CHECK(((float *)td_tensor_data(t))[0] == 6.0f);
  MP_CHECK_OK(td_process_group_barrier(pg));
  td_process_group_destroy(pg);
  td_tensor_unref(t);
  td_rpc_shutdown(a, false, 0); /* worker2 never arrives at a graceful shutdown */
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_process_group_dead_peer_fails_everyone(void **state) {
  int codes[4];
  int fails = td_mp_run(4, worker_dead_peer, NULL, 90, codes);
  if (codes[0] != 0 || codes[1] != 0 || codes[3] != 0 || codes[2] != 128 + SIGKILL)
    fail_msg("exit codes %d %d %d %d (want 0 0 %d 0; %d failed)", codes[0], codes[1], codes[2],
             codes[3], 128 + SIGKILL, fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_process_group_subgroups_and_alternation),
      cmocka_unit_test(test_process_group_dead_peer_fails_everyone),
  };
  return cmocka_run_group_tests_name("collectives_groups", tests, NULL, NULL);
}
