/* test_ddp.c - the DDP helper across 2 real processes: creation copies rank 0's parameters,
 * gradients computed on different data are averaged in buckets (a missing gradient counts as
 * zeros) and equal the single-process average; replicas with different parameters are refused on
 * every member; with reduce_dtype bfloat16 the averages are exactly the bfloat16 reduction's
 * (each gradient rounded, summed in float32, rounded, halved) in float32 .grads, after backward
 * and overlapped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

static td_module *build_dt(uint64_t seed, bool small, td_dtype dt) {
  MP_CHECK_OK(td_nn_manual_seed(seed));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(5, 4, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  if (!small) {
    MP_CHECK_OK(td_linear_create(4, 3, true, NULL, &l2));
    MP_CHECK_OK(td_sequential_append(seq, l2));
  }
  td_module_unref(l1);
  td_module_unref(act);
  td_module_unref(l2);
  if (dt != TD_DTYPE_F32) MP_CHECK_OK(td_module_to_dtype(seq, dt));
  return seq;
}

static td_module *build(uint64_t seed, bool small) { return build_dt(seed, small, TD_DTYPE_F64); }

static void backward_on(td_module *m, int data_rank) {
  int64_t xs[2] = {8, 5}, ys[2] = {8, 3};
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  MP_CHECK_OK(td_module_parameters(m, &ps));
  td_dtype dt = td_tensor_dtype(ps.tensors[0]);
  td_tensor_list_fini(&ps);
  td_tensor *x = td_test_randn(xs, 2, dt, 77 + (uint64_t)data_rank, false);
  td_tensor *y = td_test_randn(ys, 2, dt, 99 + (uint64_t)data_rank, false);
  td_tensor *out = NULL, *loss = NULL;
  MP_CHECK_OK(td_module_forward(m, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(out);
  td_tensor_unref(loss);
}

static bool close_to(const td_tensor *a, const td_tensor *b) {
  bool ok = false;
  MP_CHECK_OK(td_tensor_allclose(a, b, 1e-12, 1e-14, &ok));
  return ok;
}

static int worker_ddp(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));

  /* replicas with different architectures are refused everywhere */
  td_module *odd = build(5, rank == 1);
  td_ddp *ddp = NULL;
  MP_CHECK(td_ddp_create(pg, odd, 0, &ddp) == TD_ERR_SHAPE);
  MP_CHECK(strstr(td_last_error(), "different parameters") != NULL);
  MP_CHECK(ddp == NULL);
  td_module_unref(odd);

  /* each rank initialises differently; creation copies rank 0's parameters */
  td_module *m = build(1000 + (uint64_t)rank, false), *ref = build(1000, false);
  MP_CHECK_OK(td_ddp_create(pg, m, 128, &ddp));
  MP_CHECK(td_ddp_num_buckets(ddp) == 3); /* [W1 160 B] [b1 32 B + W2 96 B] [b2 24 B] */
  td_tensor_list pm, pr;
  td_tensor_list_init(&pm);
  td_tensor_list_init(&pr);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  MP_CHECK_OK(td_module_parameters(ref, &pr));
  MP_CHECK(pm.n == 4 && pr.n == 4);
  for (size_t i = 0; i < pm.n; i++) MP_CHECK(coll_equal("broadcast parameter", pm.tensors[i],
                                                        pr.tensors[i]));

  for (int step = 0; step < 2; step++) {
    /* local gradients on this rank's data; on rank 1 the last bias has none */
    td_module_zero_grad(m);
    backward_on(m, rank);
    if (rank == 1) MP_CHECK_OK(td_tensor_set_grad(pm.tensors[3], NULL));
    MP_CHECK_OK(td_ddp_sync_gradients(ddp));

    /* the single-process average */
    td_tensor *sum[4] = {0};
    for (int d = 0; d < world; d++) {
      td_module_zero_grad(ref);
      backward_on(ref, d);
      for (size_t i = 0; i < 4; i++) {
        td_tensor *g = td_tensor_grad(pr.tensors[i]);
        MP_CHECK(g != NULL);
        if (d == 1 && i == 3) MP_CHECK_OK(td_tensor_zero_(g)); /* rank 1 had no grad there */
        if (!sum[i]) MP_CHECK_OK(td_tensor_clone(g, &sum[i]));
        else MP_CHECK_OK(td_tensor_add_(sum[i], g, 1.0));
        td_tensor_unref(g);
      }
    }
    for (size_t i = 0; i < 4; i++) {
      MP_CHECK_OK(td_tensor_mul_scalar_(sum[i], 1.0 / world));
      td_tensor *g = td_tensor_grad(pm.tensors[i]);
      MP_CHECK(g != NULL);
      if (!close_to(g, sum[i])) {
        fprintf(stderr, "[rank %d] step %d: gradient of parameter %zu (%s) differs from the "
                "single-process average\n", rank, step, i, pm.names[i]);
        MP_CHECK(0);
      }
      td_tensor_unref(g);
      td_tensor_unref(sum[i]);
    }
  }
  td_tensor_list_fini(&pm);
  td_tensor_list_fini(&pr);
  td_ddp_destroy(ddp);
  td_module_unref(m);
  td_module_unref(ref);
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

/* rounded returns t rounded to bfloat16, in float32 (a new tensor). */
static td_tensor *rounded(const td_tensor *t) {
  td_tensor *h = NULL, *f = NULL;
  MP_CHECK_OK(td_tensor_to_dtype(t, TD_DTYPE_BF16, &h));
  MP_CHECK_OK(td_tensor_to_dtype(h, TD_DTYPE_F32, &f));
  td_tensor_unref(h);
  return f;
}

static int worker_ddp_bf16(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  for (int overlap = 0; overlap < 2; overlap++) {
    td_module *m = build_dt(2000, false, TD_DTYPE_F32), *ref = build_dt(2000, false, TD_DTYPE_F32);
    td_ddp_options dopt;
    td_ddp_options_init(&dopt);
    dopt.reduce_dtype = TD_DTYPE_BF16;
    dopt.overlap = overlap;
    td_ddp *ddp = NULL;
    MP_CHECK_OK(td_ddp_create_ex(pg, m, &dopt, &ddp));
    td_tensor_list pm, pr;
    td_tensor_list_init(&pm);
    td_tensor_list_init(&pr);
    MP_CHECK_OK(td_module_parameters(m, &pm));
    MP_CHECK_OK(td_module_parameters(ref, &pr));
    td_module_zero_grad(m);
    if (overlap) MP_CHECK_OK(td_ddp_prepare(ddp));
    backward_on(m, rank);
    MP_CHECK_OK(overlap ? td_ddp_finish(ddp) : td_ddp_sync_gradients(ddp));
    /* the bfloat16 reduction: each gradient rounded, summed in float32, rounded, halved */
    td_tensor *sum[4] = {0};
    for (int d = 0; d < world; d++) {
      td_module_zero_grad(ref);
      backward_on(ref, d);
      for (size_t i = 0; i < 4; i++) {
        td_tensor *g = td_tensor_grad(pr.tensors[i]), *r = rounded(g);
        if (!sum[i]) {
          sum[i] = r;
        } else {
          MP_CHECK_OK(td_tensor_add_(sum[i], r, 1.0));
          td_tensor_unref(r);
        }
        td_tensor_unref(g);
      }
    }
    for (size_t i = 0; i < 4; i++) {
      td_tensor *want = rounded(sum[i]);
      MP_CHECK_OK(td_tensor_mul_scalar_(want, 1.0 / world));
      td_tensor *g = td_tensor_grad(pm.tensors[i]);
      MP_CHECK(g != NULL && td_tensor_dtype(g) == TD_DTYPE_F32);
      bool same = false;
      MP_CHECK_OK(td_tensor_allclose(g, want, 0, 0, &same));
      if (!same) {
        fprintf(stderr, "[rank %d] overlap %d: gradient %zu is not the bfloat16 reduction's\n",
                rank, overlap, i);
        MP_CHECK(0);
      }
      td_tensor_unref(g), td_tensor_unref(want), td_tensor_unref(sum[i]);
    }
    td_tensor_list_fini(&pm);
    td_tensor_list_fini(&pr);
    td_ddp_destroy(ddp);
    td_module_unref(m);
    td_module_unref(ref);
  }
  td_process_group_destroy(pg);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_ddp_bf16_reduction(void **state) {
  int codes[2];
  int fails = td_mp_run(2, worker_ddp_bf16, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

static void test_ddp_averages_gradients(void **state) {
  int codes[2];
  int fails = td_mp_run(2, worker_ddp, NULL, 60, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ddp_averages_gradients),
      cmocka_unit_test(test_ddp_bf16_reduction),
  };
  return cmocka_run_group_tests_name("ddp", tests, NULL, NULL);
}
