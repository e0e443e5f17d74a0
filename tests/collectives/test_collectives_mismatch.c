/* test_collectives_mismatch.c - members that disagree fail loudly and promptly, never hang or
 * exchange garbage: a different operation, element count, dtype, reduce op or broadcast root on
 * one member fails every member with TD_ERR_STATE describing both calls; a member that skips a
 * collective makes the others fail at the group's deadline with TD_ERR_TIMEOUT naming it (and
 * only it) with the collective's name and sequence number, and its own next call on the group
 * fails at once with the same report; members set up to choose different algorithms for one call
 * fail with TD_ERR_STATE naming both. Run with the default algorithms (shared memory here) and
 * with TD_COLL_ALGO=ring. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

enum { C_KIND, C_COUNT, C_DTYPE, C_REDUCE_OP, C_ROOT, C_GATHER_COUNT, N_CASES };

/* What member `odd` (rank 1) and the others call in each case, and two words both calls'
 * descriptions contain. */
static const char *words[N_CASES][2] = {
    {"broadcast(root 0", "all_reduce(sum"}, {"float32 x 7)", "float32 x 8)"},
    {"float64 x 8)", "float32 x 8)"},       {"all_reduce(max", "all_reduce(sum"},
    {"broadcast(root 1", "broadcast(root 0"}, {"all_gather(float32 x 3)", "all_gather(float32 x 4)"},
};

static td_tensor *tensor(int64_t n, td_dtype dt) {
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_full(&n, 1, 1.0, dt, td_device_cpu(), &t));
  return t;
}

static td_status call_case(td_process_group *pg, int c, bool odd) {
  int world = td_process_group_size(pg);
  td_tensor *t = tensor(odd && c == C_COUNT ? 7 : 8, odd && c == C_DTYPE ? TD_DTYPE_F64
                                                                        : TD_DTYPE_F32);
  td_status st;
  if (c == C_KIND) st = odd ? td_process_group_broadcast(pg, t, 0)
                            : td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  else if (c == C_REDUCE_OP)
    st = td_process_group_all_reduce(pg, t, odd ? TD_REDUCE_MAX : TD_REDUCE_SUM);
  else if (c == C_ROOT) st = td_process_group_broadcast(pg, t, odd ? 1 : 0);
  else if (c == C_GATHER_COUNT) {
    int64_t k = odd ? 3 : 4, whole = k * world;
    td_tensor *in = tensor(k, TD_DTYPE_F32), *out = tensor(whole, TD_DTYPE_F32);
    st = td_process_group_all_gather_into_tensor(pg, out, in);
    td_tensor_unref(in);
    td_tensor_unref(out);
  } else st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  td_tensor_unref(t);
  return st;
}

static int worker_mismatch(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  for (int c = 0; c < N_CASES; c++) {
    td_process_group *pg = NULL;
    MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
    MP_CHECK_OK(td_process_group_barrier(pg)); /* in step */
    double t0 = coll_now_s();
    td_status st = call_case(pg, c, rank == 1);
    const char *msg = td_last_error();
    if (st != TD_ERR_STATE || !strstr(msg, words[c][0]) || !strstr(msg, words[c][1]))
      fprintf(stderr, "[rank %d] case %d: %s: %s\n", rank, c, td_status_name(st), msg);
    MP_CHECK(st == TD_ERR_STATE);
    MP_CHECK(strstr(msg, "mismatched collectives") != NULL);
    MP_CHECK(strstr(msg, words[c][0]) && strstr(msg, words[c][1]));
    MP_CHECK(strstr(msg, "(#2)") != NULL); /* the sequence number of the mismatched call */
    MP_CHECK(coll_now_s() - t0 < 10 * coll_scale());
    MP_CHECK(td_process_group_barrier(pg) == TD_ERR_STATE); /* broken for good */
    td_process_group_destroy(pg);
  }
  /* members configured to pick different algorithms for the same call fail instead of mixing
   * them (rank 1 splits every all_reduce, the others use one round for small ones) */
  const char *saved = getenv("TD_COLL_ALGO");
  char *keep = saved ? strdup(saved) : NULL;
  setenv("TD_COLL_ALGO", rank == 1 ? "shm_rsag" : "shm_direct", 1);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  if (keep) setenv("TD_COLL_ALGO", keep, 1);
  else unsetenv("TD_COLL_ALGO");
  free(keep);
  td_tensor *t = tensor(8, TD_DTYPE_F32);
  MP_CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "with algorithm shm_") != NULL);
  td_tensor_unref(t);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_mismatch_op_count_dtype_reduce_root(void **state) {
  (void)state;
  int codes[3];
  int fails = td_mp_run(3, worker_mismatch, NULL, 120, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

/* ---- a member that skips a collective ---- */

static int worker_skip(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL, *side = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &side));
  const int64_t timeout_ms = 600;
  td_process_group_set_timeout(pg, timeout_ms);
  td_tensor *t = tensor(8, TD_DTYPE_F32);
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM)); /* #1, everyone */
  if (rank != 2) {
    double t0 = coll_now_s();
    td_status st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM); /* #2, rank 2 skips it */
    double el = coll_now_s() - t0;
    const char *msg = td_last_error();
    fprintf(stderr, "[rank %d] after %.3f s: %s: %s\n", rank, el, td_status_name(st), msg);
    MP_CHECK(st == TD_ERR_TIMEOUT);
    MP_CHECK(strstr(msg, "worker2 (rank 2) did not arrive") != NULL);
    MP_CHECK(!strstr(msg, "worker0 (rank 0) did not arrive"));
    MP_CHECK(!strstr(msg, "worker1 (rank 1) did not arrive"));
    MP_CHECK(strstr(msg, "all_reduce") && strstr(msg, "(#2)"));
    MP_CHECK(el >= 0.9 * timeout_ms / 1000.0 && el < 10 * coll_scale());
  }
  /* the others have failed the group by now; rank 2's late call fails at once with the report */
  MP_CHECK_OK(td_process_group_barrier(side));
  double t0 = coll_now_s();
  td_status st = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  if (rank == 2) {
    fprintf(stderr, "[rank 2] late call: %s: %s\n", td_status_name(st), td_last_error());
    MP_CHECK(st == TD_ERR_TIMEOUT);
    MP_CHECK(strstr(td_last_error(), "worker2 (rank 2) did not arrive") != NULL);
    MP_CHECK(coll_now_s() - t0 < 0.5 * timeout_ms / 1000.0 * coll_scale());
  } else {
    MP_CHECK(st == TD_ERR_STATE);
  }
  td_tensor_unref(t);
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_process_group_barrier(side));
  td_process_group_destroy(side);
  coll_leave(a);
  return 0;
}

static void test_mismatch_skipped_collective_names_the_rank(void **state) {
  (void)state;
  int codes[3];
  int fails = td_mp_run(3, worker_skip, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mismatch_op_count_dtype_reduce_root),
      cmocka_unit_test(test_mismatch_skipped_collective_names_the_rank),
  };
  return cmocka_run_group_tests_name("collectives_mismatch", tests, NULL, NULL);
}
