/* test_collectives_async.c - the asynchronous collectives across real worker processes: many
 * operations in flight complete in call order with exact results (sizes differ per call, so an
 * operation run out of order on any member fails the header check); a synchronous call issued
 * behind queued ones waits its turn; the futures carry the outputs; argument errors return at
 * once without a future; a failure fails that future and every later one; td_future_wait with a
 * timeout returns TD_ERR_TIMEOUT while a peer has not arrived; destroying a group cancels what is
 * still queued. Run with the default algorithms and again with TD_COLL_ALGO=ring. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

/* Call i's tensor on rank r: 1 + (i % 5) * 97 elements, value r + i + j % 7 at element j. */
static int64_t len_of(int i) { return 1 + (i % 5) * 97; }
static td_tensor *input(int r, int i) {
  int64_t n = len_of(i);
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_empty(&n, 1, TD_DTYPE_F64, td_device_cpu(), &t));
  for (int64_t j = 0; j < n; j++) ((double *)td_tensor_data(t))[j] = r + i + (double)(j % 7);
  return t;
}
static bool sum_ok(const td_tensor *t, int world, int i) {
  for (int64_t j = 0; j < len_of(i); j++) {
    double want = 0;
    for (int r = 0; r < world; r++) want += r + i + (double)(j % 7);
    if (((const double *)td_tensor_data(t))[j] != want) return false;
  }
  return true;
}

/* ---- order, many in flight, sync behind async, future values ---- */

#define N_OPS 200

static int worker_order(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  /* a synchronous call right behind the first asynchronous one (the worker thread is only
   * starting) must not overtake it: the sizes differ, so overtaking fails the header check */
  td_tensor *first = input(rank, 1), *second = input(rank, 2);
  td_future *ff = NULL;
  MP_CHECK_OK(td_process_group_all_reduce_async(pg, first, TD_REDUCE_SUM, &ff));
  MP_CHECK_OK(td_process_group_all_reduce(pg, second, TD_REDUCE_SUM));
  MP_CHECK(td_future_done(ff) && td_future_status(ff) == TD_OK);
  MP_CHECK(sum_ok(first, world, 1) && sum_ok(second, world, 2));
  td_future_unref(ff);
  td_tensor_unref(first);
  td_tensor_unref(second);
  td_tensor *ts[N_OPS];
  td_future *fs[N_OPS];
  for (int i = 0; i < N_OPS; i++) {
    ts[i] = input(rank, i);
    if (i % 50 == 25) MP_CHECK_OK(td_process_group_barrier_async(pg, &fs[i]));
    else MP_CHECK_OK(td_process_group_all_reduce_async(pg, ts[i], TD_REDUCE_SUM, &fs[i]));
  }
  /* a synchronous call queues behind them: when it returns, every earlier one is done */
  td_tensor *b = input(rank, 3);
  MP_CHECK_OK(td_process_group_broadcast(pg, b, world - 1));
  for (int i = 0; i < N_OPS; i++) MP_CHECK(td_future_done(fs[i]));
  td_tensor *want_b = input(world - 1, 3);
  MP_CHECK(coll_equal("broadcast behind async", b, want_b));
  MP_CHECK_OK(td_future_wait_all(fs, N_OPS, 0));
  for (int i = 0; i < N_OPS; i++) {
    td_value *v = td_future_value(fs[i]);
    if (i % 50 == 25) {
      MP_CHECK(td_value_kind_of(v) == TD_VALUE_NONE);
    } else {
      td_tensor *got = NULL;
      MP_CHECK_OK(td_value_as_tensor(v, &got));
      MP_CHECK(got == ts[i]);
      MP_CHECK(sum_ok(ts[i], world, i));
    }
    td_future_unref(fs[i]);
    td_tensor_unref(ts[i]);
  }
  /* list-form all_gather: the future carries the list of outputs */
  td_tensor *in = input(rank, 1), *outs[8];
  for (int i = 0; i < world; i++) outs[i] = input(-1, 1);
  td_future *f = NULL;
  MP_CHECK_OK(td_process_group_all_gather_async(pg, outs, in, &f));
  MP_CHECK_OK(td_future_wait(f, -1));
  td_value *l = td_future_value(f);
  MP_CHECK(td_value_list_len(l) == (size_t)world);
  for (int i = 0; i < world; i++) {
    td_tensor *got = NULL, *want = input(i, 1);
    MP_CHECK_OK(td_value_as_tensor(td_value_list_get(l, (size_t)i), &got));
    MP_CHECK(got == outs[i] && coll_equal("all_gather_async", outs[i], want));
    td_tensor_unref(want);
    td_tensor_unref(outs[i]);
  }
  td_future_unref(f);
  /* concatenated forms */
  int64_t n = len_of(1), whole_n = n * world;
  td_tensor *whole = NULL, *part = input(-1, 1);
  MP_CHECK_OK(td_tensor_zeros(&whole_n, 1, TD_DTYPE_F64, td_device_cpu(), &whole));
  td_future *fg = NULL, *fr = NULL;
  MP_CHECK_OK(td_process_group_all_gather_into_tensor_async(pg, whole, in, &fg));
  MP_CHECK_OK(td_process_group_reduce_scatter_tensor_async(pg, part, whole, TD_REDUCE_SUM, &fr));
  MP_CHECK_OK(td_future_wait(fr, -1)); /* the later one done implies the earlier one done */
  MP_CHECK(td_future_done(fg) && td_future_status(fg) == TD_OK);
  for (int64_t j = 0; j < n; j++) { /* slot rank of the gathered tensor, summed over members */
    double want = world * (rank + 1 + (double)(j % 7));
    MP_CHECK(((double *)td_tensor_data(part))[j] == want);
  }
  td_future_unref(fg);
  td_future_unref(fr);
  td_tensor_unref(whole);
  td_tensor_unref(part);
  td_tensor_unref(in);
  td_tensor_unref(b);
  td_tensor_unref(want_b);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_async_order_many_in_flight(void **state) {
  (void)state;
  int codes[4];
  int fails = td_mp_run(3, worker_order, NULL, 120, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

/* ---- errors: arguments at once; a failure fails its future and every later one ---- */

static int worker_errors(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  td_future *f = (td_future *)&f; /* must stay untouched */
  int64_t shape[2] = {2, 3};
  td_tensor *t = NULL, *tt = NULL;
  MP_CHECK_OK(td_tensor_zeros(shape, 2, TD_DTYPE_F32, td_device_cpu(), &t));
  MP_CHECK_OK(td_tensor_transpose(t, 0, 1, &tt));
  MP_CHECK(td_process_group_all_reduce_async(pg, tt, TD_REDUCE_SUM, &f) == TD_ERR_INVALID);
  MP_CHECK(f == (td_future *)&f);
  MP_CHECK(td_process_group_all_reduce_async(pg, t, TD_REDUCE_SUM, NULL) == TD_ERR_INVALID);
  MP_CHECK(td_process_group_broadcast_async(pg, t, world, &f) == TD_ERR_INVALID);
  MP_CHECK(f == (td_future *)&f);
  /* one good operation, then rank 1 reduces a different count: the second fails everywhere,
   * and the third (queued behind it) fails with the group broken */
  td_future *fs[3];
  td_tensor *x = input(rank, 0), *y = input(rank, rank == 1 ? 1 : 2), *z = input(rank, 0);
  MP_CHECK_OK(td_process_group_all_reduce_async(pg, x, TD_REDUCE_SUM, &fs[0]));
  MP_CHECK_OK(td_process_group_all_reduce_async(pg, y, TD_REDUCE_SUM, &fs[1]));
  MP_CHECK_OK(td_process_group_all_reduce_async(pg, z, TD_REDUCE_SUM, &fs[2]));
  MP_CHECK(td_future_wait_all(fs, 3, -1) == TD_ERR_STATE);
  MP_CHECK(td_future_status(fs[0]) == TD_OK && sum_ok(x, world, 0));
  MP_CHECK(td_future_status(fs[1]) == TD_ERR_STATE);
  MP_CHECK(strstr(td_future_message(fs[1]), "mismatched collectives") != NULL);
  MP_CHECK(td_future_wait(fs[2], -1) == TD_ERR_STATE);
  MP_CHECK(strstr(td_future_message(fs[2]), "broken") != NULL);
  for (int i = 0; i < 3; i++) td_future_unref(fs[i]);
  /* the synchronous form reports the same */
  MP_CHECK(td_process_group_barrier(pg) == TD_ERR_STATE);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(z);
  td_tensor_unref(t);
  td_tensor_unref(tt);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_async_errors_reach_every_later_future(void **state) {
  (void)state;
  int codes[3];
  int fails = td_mp_run(3, worker_errors, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

/* ---- wait with a timeout; destroy cancels the queue ---- */

static int worker_wait_timeout(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL, *side = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &side));
  td_tensor *t = input(rank, 4);
  td_future *f = NULL;
  if (rank == 0) {
    /* rank 1 calls its all_reduce only after the side barrier, which follows this wait */
    MP_CHECK_OK(td_process_group_all_reduce_async(pg, t, TD_REDUCE_SUM, &f));
    double t0 = coll_now_s();
    MP_CHECK(td_future_wait(f, 100) == TD_ERR_TIMEOUT);
    MP_CHECK(coll_now_s() - t0 >= 0.09 && !td_future_done(f));
    MP_CHECK_OK(td_process_group_barrier(side));
    MP_CHECK_OK(td_future_wait(f, -1));
  } else {
    MP_CHECK_OK(td_process_group_barrier(side));
    MP_CHECK_OK(td_process_group_all_reduce_async(pg, t, TD_REDUCE_SUM, &f));
    MP_CHECK_OK(td_future_wait(f, 30000));
  }
  MP_CHECK(sum_ok(t, world, 4));
  td_future_unref(f);
  /* destroy with work queued: rank 1 never joins these, so the barrier the worker runs (if it
   * started it already) times out, and the queued ones are cancelled; destroy returns with every
   * future done */
  if (rank == 0) {
    td_process_group_set_timeout(pg, 300);
    td_future *q[3];
    for (int i = 0; i < 3; i++) MP_CHECK_OK(td_process_group_barrier_async(pg, &q[i]));
    td_process_group_destroy(pg);
    pg = NULL;
    for (int i = 0; i < 3; i++) MP_CHECK(td_future_done(q[i]));
    MP_CHECK(td_future_status(q[0]) == TD_ERR_TIMEOUT || td_future_status(q[0]) == TD_ERR_CANCELLED);
    for (int i = 1; i < 3; i++) {
      td_status st = td_future_status(q[i]);
      MP_CHECK(st == TD_ERR_CANCELLED || st == TD_ERR_STATE);
      td_future_unref(q[i]);
    }
    td_future_unref(q[0]);
  }
  MP_CHECK_OK(td_process_group_barrier(side));
  td_process_group_destroy(pg);
  td_process_group_destroy(side);
  td_tensor_unref(t);
  coll_leave(a);
  return 0;
}

static void test_async_wait_timeout_and_destroy(void **state) {
  (void)state;
  int codes[2];
  int fails = td_mp_run(2, worker_wait_timeout, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_async_order_many_in_flight),
      cmocka_unit_test(test_async_errors_reach_every_later_future),
      cmocka_unit_test(test_async_wait_timeout_and_destroy),
  };
  return cmocka_run_group_tests_name("collectives_async", tests, NULL, NULL);
}
