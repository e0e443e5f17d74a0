/* test_dist_autograd_async.c - multi-process tests of td_dist_autograd_backward_async: the same
 * gradients as td_dist_autograd_backward on every worker (a graph over three workers with a
 * nested hop and a tensor used twice), the caller's other calls completing while a remote part of the pass is still
 * running (held open by a gate that only this caller's later call opens, so the order is forced,
 * not timed), a remote backward failure failing the future with the worker named, and argument
 * errors returned at once. Every worker runs in strict mode and checks that nothing is left. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "da_test_fns.h"
#include "test_util.h"

/* ---- the gate: a backward function on worker1 that waits until gate_open() is called ---- */

static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static bool gate_is_open, gate_reached;

static td_status gate_backward(void *ctx, td_tensor *const *gout, int n_out, td_tensor **gin,
                               int n_in) {
  (void)ctx, (void)n_out, (void)n_in;
  double end = td_test_now_s() + td_test_s(20);
  pthread_mutex_lock(&gate_mu);
  gate_reached = true;
  while (!gate_is_open && td_test_now_s() < end) {
    pthread_mutex_unlock(&gate_mu);
    td_test_sleep_ms(2);
    pthread_mutex_lock(&gate_mu);
  }
  bool open = gate_is_open;
  pthread_mutex_unlock(&gate_mu);
  if (!open) return td_set_error(TD_ERR_TIMEOUT, "GateBackward: the gate was never opened");
  gin[0] = gout[0] ? td_tensor_ref(gout[0]) : NULL;
  return TD_OK;
}

/* gated(x) -> (x * p) through a GateBackward node: its gradient waits for gate_open() */
static td_status fn_gated(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)n, (void)fut;
  td_tensor *x, *y;
  DA_TRY(td_value_as_tensor(args[0], &x));
  DA_TRY(td_tensor_mul(x, da_param(td_rpc_rank(td_rpc_ctx_agent(c))), &y));
  return da_reply_through(y, "GateBackward", gate_backward, res);
}

/* gate_state() -> [reached, open] */
static td_status fn_gate_state(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  pthread_mutex_lock(&gate_mu);
  bool r = gate_reached, o = gate_is_open;
  pthread_mutex_unlock(&gate_mu);
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_bool(r));
  td_value_list_append(l, td_value_bool(o));
  *res = l;
  return TD_OK;
}

static td_status fn_gate_open(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  (void)c, (void)args, (void)n, (void)res, (void)fut;
  pthread_mutex_lock(&gate_mu);
  gate_is_open = true;
  pthread_mutex_unlock(&gate_mu);
  return TD_OK;
}

/* ---- helpers ---- */

static td_rpc_agent *start(int rank, int world, const char *method) {
  da_register_all();
  td_rpc_register("gated", fn_gated, NULL);
  td_rpc_register("gate_state", fn_gate_state, NULL);
  td_rpc_register("gate_open", fn_gate_open, NULL);
  da_param(rank);
  td_rref_set_strict(true);
  td_dist_autograd_set_strict(true);
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

static td_tensor *leaf_x(void) {
  double d[DA_D];
  for (int k = 0; k < DA_D; k++) d[k] = 0.5 + 0.25 * k;
  int64_t shape[1] = {DA_D};
  td_tensor *t;
  MP_CHECK_OK(td_tensor_from_buffer(d, shape, 1, TD_DTYPE_F64, &t));
  MP_CHECK_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

static td_tensor *remote_grad_p(td_rpc_agent *a, const char *to) {
  td_value *r;
  MP_CHECK_OK(td_rpc_sync(a, to, "grad_p", NULL, 0, NULL, &r));
  MP_CHECK(td_value_kind_of(r) == TD_VALUE_TENSOR);
  td_tensor *t;
  MP_CHECK_OK(td_value_as_tensor(r, &t));
  td_tensor_ref(t);
  td_value_unref(r);
  return t;
}

static td_tensor *sum_all(td_tensor *y) {
  td_tensor *s;
  MP_CHECK_OK(td_tensor_sum_all(y, &s));
  return s;
}

/* The gradients of one pass over x -> worker1 mulp -> worker1 hop(worker2 mulp): x's (here) and
 * p's on worker1 and worker2, run with the sync or the async call. */
typedef struct grads3 {
  td_tensor *gx, *g1, *g2;
} grads3;

static grads3 pass(td_rpc_agent *a, bool async) {
  td_tensor *x = leaf_x();
  td_dist_autograd_context *ctx;
  MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
  td_value *xv = td_value_tensor(x);
  td_tensor *y1 = da_rpc_tensor(a, "worker1", "mulp", &xv, 1);
  td_value *hargs[3] = {td_value_tensor(y1), td_value_string("worker2"), td_value_string("mulp")};
  td_tensor *y2 = da_rpc_tensor(a, "worker1", "hop", hargs, 3);
  td_tensor *y3 = NULL, *loss = NULL;
  MP_CHECK_OK(td_tensor_mul(y2, x, &y3)); /* x used twice: two paths into x's gradient */
  loss = sum_all(y3);
  if (async) {
    td_future *f = NULL;
    MP_CHECK_OK(td_dist_autograd_backward_async(ctx, &loss, 1, false, &f));
    MP_CHECK_OK(td_future_wait(f, td_test_ms(30000)));
    MP_CHECK(td_value_kind_of(td_future_value(f)) == TD_VALUE_NONE);
    td_future_unref(f);
  } else {
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
  }
  grads3 g;
  g.gx = td_grad_map_get(td_dist_autograd_context_grad_map(ctx), x);
  MP_CHECK(g.gx);
  g.g1 = remote_grad_p(a, "worker1");
  g.g2 = remote_grad_p(a, "worker2");
  for (int i = 0; i < 3; i++) td_value_unref(hargs[i]);
  td_value_unref(xv);
  td_tensor_unref(x), td_tensor_unref(y1), td_tensor_unref(y2), td_tensor_unref(y3);
  td_tensor_unref(loss);
  MP_CHECK_OK(td_dist_autograd_context_end(ctx));
  return g;
}

static void check_equal(const td_tensor *a, const td_tensor *b, const char *what) {
  bool ok = false;
  MP_CHECK_OK(td_tensor_allclose(a, b, 0, 0, &ok)); /* the same arithmetic: bit-identical */
  if (!ok) fprintf(stderr, "mismatch: %s\n", what);
  MP_CHECK(ok);
}

/* ---- tests ---- */

static int w_parity(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = start(rank, world, method);
  if (rank == 0) {
    grads3 s = pass(a, false), as = pass(a, true);
    check_equal(s.gx, as.gx, "gradient of x");
    check_equal(s.g1, as.g1, "gradient of p on worker1");
    check_equal(s.g2, as.g2, "gradient of p on worker2");
    /* and they are not trivial (worker2 is reached only through worker1) */
    double v = 0;
    int64_t i0 = 0;
    MP_CHECK_OK(td_tensor_get(as.g1, &i0, &v));
    MP_CHECK(v != 0);
    grads3 *gs[2] = {&s, &as};
    for (int k = 0; k < 2; k++)
      td_tensor_unref(gs[k]->gx), td_tensor_unref(gs[k]->g1), td_tensor_unref(gs[k]->g2);
    da_check_clean(a);
  }
  td_mp_finish(a, 60);
  return 0;
}

static void test_dist_autograd_async_same_gradients(void **state) {
  (void)state;
  TD_MP_RUN(3, w_parity, NULL, 120);
}

static int w_overlap(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = start(rank, world, method);
  if (rank == 0) {
    td_tensor *x = leaf_x();
    td_dist_autograd_context *ctx;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_value *xv = td_value_tensor(x);
    td_tensor *y = da_rpc_tensor(a, "worker1", "gated", &xv, 1);
    td_tensor *loss = sum_all(y);
    td_future *f = NULL;
    /* returns while worker1's part waits at the gate */
    MP_CHECK_OK(td_dist_autograd_backward_async(ctx, &loss, 1, false, &f));
    MP_CHECK(!td_future_done(f));
    /* other work meanwhile: a forward RPC in the same context, on another worker */
    td_tensor *y2 = da_rpc_tensor(a, "worker2", "mulp", &xv, 1);
    MP_CHECK(td_tensor_numel(y2) == DA_D);
    td_value *gs = NULL;
    bool reached = false;
    TD_TEST_POLL((td_value_unref(gs), gs = NULL,
                  td_rpc_sync(a, "worker1", "gate_state", NULL, 0, NULL, &gs) == TD_OK &&
                      td_value_as_bool(td_value_list_get(gs, 0), &reached) == TD_OK && reached),
                 20);
    MP_CHECK(reached);
    td_value_unref(gs);
    MP_CHECK(!td_future_done(f)); /* the gate is still closed: the pass cannot have finished */
    td_value *none = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "gate_open", NULL, 0, NULL, &none));
    td_value_unref(none);
    MP_CHECK_OK(td_future_wait(f, td_test_ms(30000)));
    td_future_unref(f);
    td_tensor *g = remote_grad_p(a, "worker1");
    /* d sum(x * p) / dp = x */
    bool ok = false;
    MP_CHECK_OK(td_tensor_allclose(g, x, 0, 0, &ok));
    MP_CHECK(ok);
    td_tensor_unref(g);
    td_tensor_unref(y), td_tensor_unref(y2), td_tensor_unref(loss), td_tensor_unref(x);
    td_value_unref(xv);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    da_check_clean(a);
  }
  td_mp_finish(a, 60);
  return 0;
}

static void test_dist_autograd_async_caller_works_meanwhile(void **state) {
  (void)state;
  TD_MP_RUN(3, w_overlap, NULL, 120);
}

static int w_error(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = start(rank, world, method);
  if (rank == 0) {
    td_tensor *x = leaf_x();
    td_dist_autograd_context *ctx;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_value *xv = td_value_tensor(x);
    /* argument errors come back at once and start nothing */
    td_future *f = (td_future *)&f;
    MP_CHECK(td_dist_autograd_backward_async(ctx, &x, 1, false, &f) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "leaf"));
    MP_CHECK(f == (td_future *)&f);
    MP_CHECK(td_dist_autograd_backward_async(ctx, &x, 1, false, NULL) == TD_ERR_INVALID);
    /* x -> worker1 hop -> worker2 failing: the backward fails two hops away */
    td_value *hargs[3] = {td_value_tensor(x), td_value_string("worker2"),
                          td_value_string("failing")};
    td_tensor *y = da_rpc_tensor(a, "worker1", "hop", hargs, 3);
    td_tensor *loss = sum_all(y);
    f = NULL;
    MP_CHECK_OK(td_dist_autograd_backward_async(ctx, &loss, 1, false, &f));
    MP_CHECK(td_future_wait(f, td_test_ms(30000)) == TD_ERR_INVALID);
    const char *msg = td_future_message(f);
    fprintf(stderr, "async backward error: %s\n", msg);
    MP_CHECK(strstr(msg, "dist_autograd_backward") && strstr(msg, "worker2 (rank 2)") &&
             strstr(msg, "boom in FailBackward"));
    td_future_unref(f);
    for (int i = 0; i < 3; i++) td_value_unref(hargs[i]);
    td_tensor_unref(y), td_tensor_unref(loss), td_tensor_unref(x);
    td_value_unref(xv);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    da_check_clean(a);
  }
  td_mp_finish(a, 60);
  return 0;
}

static void test_dist_autograd_async_remote_error(void **state) {
  (void)state;
  TD_MP_RUN(3, w_error, NULL, 120);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dist_autograd_async_same_gradients),
      cmocka_unit_test(test_dist_autograd_async_caller_works_meanwhile),
      cmocka_unit_test(test_dist_autograd_async_remote_error),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
