/* test_collectives.c - every CPU collective against exact expected results, across real worker
 * processes: 2, 3, 4 and 5 ranks; sizes 0, 1, 7, 1001, 300007 (several ring segments) and one
 * smaller than the world; float32, float64 and int64; sum, avg and max; list and concatenated
 * forms; argument errors; mismatched collectives fail every member with TD_ERR_STATE. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

/* Rank r's element i: integer values, so float sums are exact. */
static double val_sum(int r, int64_t i) { return (double)((r + 1) * ((i % 13) + 1) - 2 * r); }
static double val_max(int r, int64_t i) { return (double)(((r * 31 + i * 17) % 23) - 11); }
static double val(td_reduce_op op, int r, int64_t i) {
  return op == TD_REDUCE_MAX ? val_max(r, i) : val_sum(r, i);
}

static td_tensor *make(td_reduce_op op, int r, int64_t off, int64_t n, td_dtype dt) {
  double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
  for (int64_t i = 0; i < n; i++) v[i] = val(op, r, off + i);
  td_tensor *t = coll_tensor(v, n, dt);
  free(v);
  return t;
}

/* The reduction over ranks 0..world of elements [off, off + n), computed in dt like the ring. */
static td_tensor *expect(td_reduce_op op, int world, int64_t off, int64_t n, td_dtype dt) {
  if (dt == TD_DTYPE_BF16) { /* the values are small integers: exact partial sums; avg rounds
                                once from float32 */
    double *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++) {
      double acc = val(op, 0, off + i);
      for (int r = 1; r < world; r++)
        acc = op == TD_REDUCE_MAX ? fmax(acc, val(op, r, off + i)) : acc + val(op, r, off + i);
      float f = (float)acc;
      if (op == TD_REDUCE_AVG) f /= (float)world;
      v[i] = f;
    }
    td_tensor *t = coll_tensor(v, n, dt);
    free(v);
    return t;
  }
  td_tensor *t = make(op, 0, off, n, dt);
  for (int64_t i = 0; i < n; i++) {
    double acc = val(op, 0, off + i);
    for (int r = 1; r < world; r++)
      acc = op == TD_REDUCE_MAX ? fmax(acc, val(op, r, off + i)) : acc + val(op, r, off + i);
    if (dt == TD_DTYPE_F32) {
      float f = (float)acc;
      if (op == TD_REDUCE_AVG) f /= (float)world;
      ((float *)td_tensor_data(t))[i] = f;
    } else if (dt == TD_DTYPE_F64) {
      ((double *)td_tensor_data(t))[i] = op == TD_REDUCE_AVG ? acc / (double)world : acc;
    } else {
      ((int64_t *)td_tensor_data(t))[i] = (int64_t)acc;
    }
  }
  return t;
}

static void check_all_reduce(td_process_group *pg, int world, td_dtype dt, int64_t n) {
  int rank = td_process_group_rank(pg);
  td_reduce_op ops[3] = {TD_REDUCE_SUM, TD_REDUCE_MAX, TD_REDUCE_AVG};
  char what[128];
  for (int k = 0; k < 3; k++) {
    td_tensor *t = make(ops[k], rank, 0, n, dt);
    if (ops[k] == TD_REDUCE_AVG && dt == TD_DTYPE_I64) {
      MP_CHECK(td_process_group_all_reduce(pg, t, ops[k]) == TD_ERR_DTYPE);
      td_tensor_unref(t);
      continue;
    }
    MP_CHECK_OK(td_process_group_all_reduce(pg, t, ops[k]));
    td_tensor *want = expect(ops[k], world, 0, n, dt);
    snprintf(what, sizeof what, "all_reduce op %d %s x %lld (world %d)", (int)ops[k],
             td_dtype_name(dt), (long long)n, world);
    MP_CHECK(coll_equal(what, t, want));
    td_tensor_unref(t);
    td_tensor_unref(want);
  }
}

static void check_broadcast(td_process_group *pg, int world, td_dtype dt, int64_t n) {
  int rank = td_process_group_rank(pg);
  for (int root = 0; root < world; root++) {
    td_tensor *t = make(TD_REDUCE_SUM, rank, 0, n, dt);
    MP_CHECK_OK(td_process_group_broadcast(pg, t, root));
    td_tensor *want = make(TD_REDUCE_SUM, root, 0, n, dt);
    char what[128];
    snprintf(what, sizeof what, "broadcast root %d %s x %lld", root, td_dtype_name(dt),
             (long long)n);
    MP_CHECK(coll_equal(what, t, want));
    td_tensor_unref(t);
    td_tensor_unref(want);
  }
}

static void check_all_gather(td_process_group *pg, int world, td_dtype dt, int64_t n) {
  int rank = td_process_group_rank(pg);
  char what[128];
  /* list form; the input is also outs[rank] (in place) on odd sizes */
  td_tensor *in = make(TD_REDUCE_SUM, rank, 0, n, dt);
  td_tensor **outs = calloc((size_t)world, sizeof *outs);
  for (int i = 0; i < world; i++) {
    if (i == rank && (n % 2)) outs[i] = td_tensor_ref(in);
    else MP_CHECK_OK(td_tensor_full(&n, 1, -77.0, dt, td_device_cpu(), &outs[i]));
  }
  MP_CHECK_OK(td_process_group_all_gather(pg, outs, in));
  for (int i = 0; i < world; i++) {
    td_tensor *want = make(TD_REDUCE_SUM, i, 0, n, dt);
    snprintf(what, sizeof what, "all_gather[%d] %s x %lld", i, td_dtype_name(dt), (long long)n);
    MP_CHECK(coll_equal(what, outs[i], want));
    td_tensor_unref(want);
    td_tensor_unref(outs[i]);
  }
  free(outs);
  /* concatenated form, shaped [world, n] */
  int64_t shape[2] = {world, n};
  td_tensor *out = NULL;
  MP_CHECK_OK(td_tensor_full(shape, 2, -77.0, dt, td_device_cpu(), &out));
  MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, out, in));
  for (int i = 0; i < world; i++) {
    td_tensor *row = NULL, *want = make(TD_REDUCE_SUM, i, 0, n, dt);
    MP_CHECK_OK(td_tensor_narrow(out, 0, i, 1, &row));
    snprintf(what, sizeof what, "all_gather_into_tensor[%d] %s x %lld", i, td_dtype_name(dt),
             (long long)n);
    MP_CHECK(coll_equal(what, row, want));
    td_tensor_unref(row);
    td_tensor_unref(want);
  }
  td_tensor_unref(out);
  td_tensor_unref(in);
}

static void check_reduce_scatter(td_process_group *pg, int world, td_dtype dt, int64_t n) {
  int rank = td_process_group_rank(pg);
  td_reduce_op ops[3] = {TD_REDUCE_SUM, TD_REDUCE_MAX, TD_REDUCE_AVG};
  char what[128];
  for (int k = 0; k < 3; k++) {
    td_reduce_op op = ops[k];
    /* slot j of member r holds elements [j n, (j + 1) n) of member r's sequence */
    td_tensor **ins = calloc((size_t)world, sizeof *ins);
    for (int j = 0; j < world; j++) ins[j] = make(op, rank, j * n, n, dt);
    td_tensor *out = NULL, *out2 = NULL, *cat = make(op, rank, 0, n * world, dt);
    MP_CHECK_OK(td_tensor_full(&n, 1, -5.0, dt, td_device_cpu(), &out));
    MP_CHECK_OK(td_tensor_full(&n, 1, -5.0, dt, td_device_cpu(), &out2));
    if (op == TD_REDUCE_AVG && dt == TD_DTYPE_I64) {
      MP_CHECK(td_process_group_reduce_scatter(pg, out, ins, op) == TD_ERR_DTYPE);
    } else {
      MP_CHECK_OK(td_process_group_reduce_scatter(pg, out, ins, op));
      MP_CHECK_OK(td_process_group_reduce_scatter_tensor(pg, out2, cat, op));
      td_tensor *want = expect(op, world, rank * n, n, dt);
      snprintf(what, sizeof what, "reduce_scatter op %d %s x %lld", (int)op, td_dtype_name(dt),
               (long long)n);
      MP_CHECK(coll_equal(what, out, want));
      snprintf(what, sizeof what, "reduce_scatter_tensor op %d %s x %lld", (int)op,
               td_dtype_name(dt), (long long)n);
      MP_CHECK(coll_equal(what, out2, want));
      td_tensor_unref(want);
      /* inputs untouched */
      for (int j = 0; j < world; j++) {
        td_tensor *orig = make(op, rank, j * n, n, dt);
        MP_CHECK(coll_equal("reduce_scatter input", ins[j], orig));
        td_tensor_unref(orig);
      }
    }
    for (int j = 0; j < world; j++) td_tensor_unref(ins[j]);
    free(ins);
    td_tensor_unref(out);
    td_tensor_unref(out2);
    td_tensor_unref(cat);
  }
}

static void check_arg_errors(td_process_group *pg, td_rpc_agent *a) {
  int64_t shape[2] = {2, 3};
  td_tensor *t = NULL, *tt = NULL;
  MP_CHECK_OK(td_tensor_zeros(shape, 2, TD_DTYPE_F32, td_device_cpu(), &t));
  MP_CHECK_OK(td_tensor_transpose(t, 0, 1, &tt));
  MP_CHECK(td_process_group_all_reduce(pg, tt, TD_REDUCE_SUM) == TD_ERR_INVALID);
  MP_CHECK(strstr(td_last_error(), "contiguous") != NULL);
  MP_CHECK(td_process_group_broadcast(pg, t, td_process_group_size(pg)) == TD_ERR_INVALID);
  MP_CHECK(td_process_group_all_reduce(pg, t, (td_reduce_op)9) == TD_ERR_INVALID);
  MP_CHECK(td_process_group_all_reduce(NULL, t, TD_REDUCE_SUM) == TD_ERR_INVALID);
  td_tensor *out = NULL;
  MP_CHECK_OK(td_tensor_zeros(shape, 2, TD_DTYPE_F32, td_device_cpu(), &out));
  MP_CHECK(td_process_group_all_gather_into_tensor(pg, out, t) == TD_ERR_SHAPE);
  td_tensor *outd = NULL;
  int64_t big = 6 * td_process_group_size(pg);
  MP_CHECK_OK(td_tensor_zeros(&big, 1, TD_DTYPE_F64, td_device_cpu(), &outd));
  MP_CHECK(td_process_group_all_gather_into_tensor(pg, outd, t) == TD_ERR_DTYPE);
  MP_CHECK(td_process_group_create(a, (int[]){0, 0}, 2, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT,
                                   &(td_process_group *){0}) == TD_ERR_INVALID);
  MP_CHECK(td_process_group_create(a, (int[]){td_rpc_world_size(a)}, 1, TD_PG_BACKEND_CPU,
                                   TD_TIMEOUT_DEFAULT, &(td_process_group *){0}) == TD_ERR_INVALID);
  if (td_cuda_device_count() == 0) {
    td_status st = td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT,
                                           &(td_process_group *){0});
    MP_CHECK(st == TD_ERR_UNSUPPORTED || st == TD_ERR_DEVICE);
  }
  /* none of these touched the wire: the group still works */
  MP_CHECK_OK(td_process_group_barrier(pg));
  td_tensor_unref(t);
  td_tensor_unref(tt);
  td_tensor_unref(out);
  td_tensor_unref(outd);
}

static int worker_ops(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK(pg && td_process_group_size(pg) == world && td_process_group_rank(pg) == rank);
  MP_CHECK(td_process_group_global_rank(pg, world - 1) == world - 1);
  MP_CHECK(td_process_group_global_rank(pg, world) == -1);
  int64_t sizes[] = {0, 1, 7, world - 1, 1001, 300007};
  td_dtype dts[] = {TD_DTYPE_F32, TD_DTYPE_F64, TD_DTYPE_I64, TD_DTYPE_BF16};
  for (size_t d = 0; d < 4; d++) {
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
      check_all_reduce(pg, world, dts[d], sizes[s]);
      check_broadcast(pg, world, dts[d], sizes[s]);
      check_all_gather(pg, world, dts[d], sizes[s]);
      check_reduce_scatter(pg, world, dts[d], sizes[s]);
      MP_CHECK_OK(td_process_group_barrier(pg));
    }
  }
  check_arg_errors(pg, a);
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void run_world(int world) {
  int codes[8];
  int fails = td_mp_run(world, worker_ops, NULL, 120, codes);
  if (fails) fail_msg("%d of %d workers failed", fails, world);
}

static void test_collectives_world_2(void **state) { run_world(2); }
static void test_collectives_world_3(void **state) { run_world(3); }
static void test_collectives_world_4(void **state) { run_world(4); }
static void test_collectives_world_5(void **state) { run_world(5); }

/* ---- mismatched calls ---- */

static int worker_mismatch(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  td_tensor *t = make(TD_REDUCE_SUM, rank, 0, 7, TD_DTYPE_F32);
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM)); /* in step */
  /* ranks 0 and 1 all_reduce, rank 2 enters a barrier */
  double t0 = coll_now_s();
  td_status st = rank == 2 ? td_process_group_barrier(pg)
                           : td_process_group_all_reduce(pg, t, TD_REDUCE_SUM);
  if (st != TD_ERR_STATE || !strstr(td_last_error(), "mismatched collectives"))
    fprintf(stderr, "[rank %d] %s: %s\n", rank, td_status_name(st), td_last_error());
  MP_CHECK(st == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "mismatched collectives") != NULL);
  MP_CHECK(strstr(td_last_error(), "barrier") && strstr(td_last_error(), "all_reduce"));
  MP_CHECK(coll_now_s() - t0 < 10 * coll_scale());
  /* the group stays broken */
  MP_CHECK(td_process_group_barrier(pg) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "broken") != NULL);
  td_tensor_unref(t);
  td_process_group_destroy(pg);
  /* a new group works */
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK_OK(td_process_group_barrier(pg));
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_collectives_mismatch_fails_everyone(void **state) {
  int codes[3];
  int fails = td_mp_run(3, worker_mismatch, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_collectives_world_2),
      cmocka_unit_test(test_collectives_world_3),
      cmocka_unit_test(test_collectives_world_4),
      cmocka_unit_test(test_collectives_world_5),
      cmocka_unit_test(test_collectives_mismatch_fails_everyone),
  };
  return cmocka_run_group_tests_name("collectives", tests, NULL, NULL);
}
