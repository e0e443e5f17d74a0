/* test_autograd.c - the local backward engine: accumulation, retain_graph, grad maps, hooks,
 * external nodes, no-grad, deep graphs and concurrent backward passes sharing leaves. */
#include <pthread.h>
#include <string.h>

#include "test_util.h"

#define F64 TD_DTYPE_F64

static double item(const td_tensor *t) {
  double v;
  TD_ASSERT_OK(td_tensor_item(t, &v));
  return v;
}

static double grad_at(const td_tensor *t, int64_t i) {
  td_tensor *g = td_tensor_grad(t);
  assert_non_null(g);
  double v;
  TD_ASSERT_OK(td_tensor_get(g, &i, &v));
  td_tensor_unref(g);
  return v;
}

/* y = sum(x * x) + sum(3 * x): dy/dx = 2x + 3 (a diamond: x feeds two branches). */
static td_tensor *diamond(td_tensor *x) {
  td_tensor *sq, *s1, *m, *s2, *y;
  TD_ASSERT_OK(td_tensor_mul(x, x, &sq));
  TD_ASSERT_OK(td_tensor_sum_all(sq, &s1));
  TD_ASSERT_OK(td_tensor_mul_scalar(x, 3.0, &m));
  TD_ASSERT_OK(td_tensor_sum_all(m, &s2));
  TD_ASSERT_OK(td_tensor_add(s1, s2, &y));
  td_tensor_unref(sq);
  td_tensor_unref(s1);
  td_tensor_unref(m);
  td_tensor_unref(s2);
  return y;
}

static void test_autograd_accumulate_and_retain(void **state) {
  double xv[3] = {1, 2, 3};
  int64_t s[1] = {3};
  td_tensor *x = td_test_tensor(xv, s, 1, F64, true);
  td_tensor *y = diamond(x);
  assert_true(item(y) == 14 + 18);
  td_backward_opts o = {.retain_graph = true};
  TD_ASSERT_OK(td_autograd_backward(&y, NULL, 1, &o));
  assert_true(grad_at(x, 1) == 7.0);
  /* second pass adds up */
  TD_ASSERT_OK(td_autograd_backward(&y, NULL, 1, NULL));
  assert_true(grad_at(x, 1) == 14.0);
  /* the graph is freed now: a third pass is a clear error */
  TD_ASSERT_STATUS(td_tensor_backward(y), TD_ERR_STATE);
  assert_non_null(strstr(td_last_error(), "second time"));
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static void test_autograd_grad_map(void **state) {
  double xv[3] = {1, 2, 3};
  int64_t s[1] = {3};
  td_tensor *x = td_test_tensor(xv, s, 1, F64, true);
  td_grad_map *m;
  TD_ASSERT_OK(td_grad_map_create(&m));
  td_tensor *y = diamond(x);
  td_backward_opts o = {.retain_graph = true, .grad_map = m};
  TD_ASSERT_OK(td_autograd_backward(&y, NULL, 1, &o));
  TD_ASSERT_OK(td_autograd_backward(&y, NULL, 1, &o));
  assert_null(td_tensor_grad(x)); /* .grad untouched */
  assert_int_equal(td_grad_map_size(m), 1);
  td_tensor *g = td_grad_map_get(m, x);
  double v;
  int64_t i = 2;
  TD_ASSERT_OK(td_tensor_get(g, &i, &v));
  assert_true(v == 18.0);
  td_tensor_unref(g);
  td_grad_map_destroy(m);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static td_status double_hook(void *ctx, const td_tensor *grad, td_tensor **rep) {
  (*(int *)ctx)++;
  return td_tensor_mul_scalar(grad, 2.0, rep);
}

static void test_autograd_hooks(void **state) {
  double xv[2] = {1, 2};
  int64_t s[1] = {2};
  td_tensor *x = td_test_tensor(xv, s, 1, F64, true);
  td_tensor *h, *y;
  int leaf_calls = 0, mid_calls = 0, handle;
  TD_ASSERT_OK(td_tensor_register_hook(x, double_hook, &leaf_calls, &handle));
  TD_ASSERT_OK(td_tensor_mul_scalar(x, 5.0, &h));
  TD_ASSERT_OK(td_tensor_register_hook(h, double_hook, &mid_calls, NULL));
  TD_ASSERT_OK(td_tensor_sum_all(h, &y));
  TD_ASSERT_OK(td_tensor_backward(y));
  assert_int_equal(leaf_calls, 1);
  assert_int_equal(mid_calls, 1);
  assert_true(grad_at(x, 0) == 20.0); /* 1 * 2 (mid hook) * 5 * 2 (leaf hook) */
  TD_ASSERT_OK(td_tensor_remove_hook(x, handle));
  TD_ASSERT_STATUS(td_tensor_remove_hook(x, handle), TD_ERR_NOT_FOUND);
  td_tensor_unref(h);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static td_status count_hook(void *ctx, const td_tensor *grad, td_tensor **rep) {
  (void)grad;
  (void)rep;
  (*(int *)ctx)++;
  return TD_OK;
}

/* A leaf used by three ops (two products and a transposed view, as a GPT's tied embedding and
 * head) has one AccumulateGrad node: its hook runs once per backward, on the summed gradient, and
 * .grad is written once. After the graph is gone a new graph gets a new node. */
static void test_autograd_leaf_used_twice_accumulates_once(void **state) {
  double wv[4] = {1, 2, 3, 4};
  int64_t s[1] = {4}, s2[2] = {2, 2};
  td_tensor *w = td_test_tensor(wv, s, 1, F64, true);
  int calls = 0;
  TD_ASSERT_OK(td_tensor_register_hook(w, count_hook, &calls, NULL));
  for (int round = 0; round < 2; round++) {
    td_tensor *a, *wr, *wt, *b, *c, *sa, *sb, *sc, *ab, *l;
    TD_ASSERT_OK(td_tensor_mul_scalar(w, 3.0, &a));
    TD_ASSERT_OK(td_tensor_reshape(w, s2, 2, &wr));
    TD_ASSERT_OK(td_tensor_transpose(wr, 0, 1, &wt));
    TD_ASSERT_OK(td_tensor_mul_scalar(wt, 5.0, &b));
    TD_ASSERT_OK(td_tensor_mul(w, w, &c));
    TD_ASSERT_OK(td_tensor_sum_all(a, &sa));
    TD_ASSERT_OK(td_tensor_sum_all(b, &sb));
    TD_ASSERT_OK(td_tensor_sum_all(c, &sc));
    TD_ASSERT_OK(td_tensor_add(sa, sb, &ab));
    TD_ASSERT_OK(td_tensor_add(ab, sc, &l));
    TD_ASSERT_OK(td_tensor_set_grad(w, NULL));
    TD_ASSERT_OK(td_tensor_backward(l));
    assert_int_equal(calls, round + 1);
    for (int i = 0; i < 4; i++) assert_true(grad_at(w, i) == 3.0 + 5.0 + 2.0 * wv[i]);
    td_tensor *t[] = {a, wr, wt, b, c, sa, sb, sc, ab, l};
    for (size_t k = 0; k < sizeof t / sizeof *t; k++) td_tensor_unref(t[k]);
  }
  td_tensor_unref(w);
}

/* An external node standing for "the rest of the graph on another worker": it receives the
 * gradient of an attached tensor and records it. */
typedef struct {
  int calls;
  double seen;
  int destroyed;
} ext_ctx;

static td_status ext_backward(void *ctx, td_tensor *const *gout, int nout, td_tensor **gin,
                              int nin) {
  ext_ctx *c = ctx;
  c->calls++;
  td_tensor *s;
  td_status st = td_tensor_sum_all(gout[0], &s);
  if (st != TD_OK) return st;
  st = td_tensor_item(s, &c->seen);
  td_tensor_unref(s);
  for (int i = 0; i < nin; i++) gin[i] = NULL;
  return st;
}

static void ext_destroy(void *ctx) { ((ext_ctx *)ctx)->destroyed++; }

static void test_autograd_external_recv(void **state) {
  ext_ctx c = {0};
  td_node *recv;
  TD_ASSERT_OK(td_node_create_external("RecvRpcBackward", 1, NULL, 0, ext_backward, &c,
                                       ext_destroy, &recv));
  assert_string_equal(td_node_name(recv), "RecvRpcBackward");
  double v[3] = {1, 2, 3};
  int64_t s[1] = {3};
  td_tensor *raw = td_test_tensor(v, s, 1, F64, false), *t, *sq, *y;
  TD_ASSERT_OK(td_autograd_attach(raw, recv, 0, &t));
  td_node_unref(recv);
  assert_true(td_tensor_requires_grad(t));
  TD_ASSERT_OK(td_tensor_mul(t, t, &sq));
  TD_ASSERT_OK(td_tensor_sum_all(sq, &y));
  TD_ASSERT_OK(td_tensor_backward(y));
  assert_int_equal(c.calls, 1);
  assert_true(c.seen == 12.0); /* sum(2 * x) */
  td_tensor_unref(y);
  td_tensor_unref(sq);
  assert_int_equal(c.destroyed, 0);
  td_tensor_unref(t);
  assert_int_equal(c.destroyed, 1);
  td_tensor_unref(raw);
}

static td_status pass_through(void *ctx, td_tensor *const *gout, int nout, td_tensor **gin,
                              int nin) {
  for (int i = 0; i < nin; i++) gin[i] = td_tensor_ref(gout[i]);
  return TD_OK;
}

static void test_autograd_external_send_resume(void **state) {
  /* sender side: w requires grad, u = 2 * w is "sent"; gradients for u arrive later. */
  double v[2] = {1, 1};
  int64_t s[1] = {2};
  td_tensor *w = td_test_tensor(v, s, 1, F64, true), *u;
  TD_ASSERT_OK(td_tensor_mul_scalar(w, 2.0, &u));
  td_node *send;
  td_tensor *ins[1] = {u};
  TD_ASSERT_OK(td_node_create_external("SendRpcBackward", 1, ins, 1, pass_through, NULL, NULL,
                                       &send));
  assert_int_equal(td_node_num_inputs(send), 1);
  td_tensor_unref(u); /* the node keeps u's history alive */
  double gv[2] = {10, 20};
  td_tensor *g = td_test_tensor(gv, s, 1, F64, false);
  td_grad_map *m;
  TD_ASSERT_OK(td_grad_map_create(&m));
  td_backward_opts o = {.grad_map = m};
  TD_ASSERT_OK(td_autograd_backward_node(send, &g, 1, &o));
  td_tensor *gw = td_grad_map_get(m, w);
  double got;
  int64_t i = 1;
  TD_ASSERT_OK(td_tensor_get(gw, &i, &got));
  assert_true(got == 40.0);
  TD_ASSERT_STATUS(td_autograd_backward_node(send, &g, 2, &o), TD_ERR_INVALID);
  td_tensor_unref(gw);
  td_tensor_unref(g);
  td_grad_map_destroy(m);
  td_node_unref(send);
  td_tensor_unref(w);
}

static void test_autograd_no_grad(void **state) {
  int64_t s[1] = {4};
  td_tensor *x = td_test_randn(s, 1, F64, 1, true), *y;
  bool prev = td_autograd_set_enabled(false);
  assert_false(td_autograd_is_enabled());
  TD_ASSERT_OK(td_tensor_mul(x, x, &y));
  td_autograd_set_enabled(prev);
  assert_true(td_autograd_is_enabled());
  assert_false(td_tensor_requires_grad(y));
  assert_null(td_tensor_grad_fn(y));
  td_tensor *s1;
  TD_ASSERT_OK(td_tensor_sum_all(y, &s1));
  TD_ASSERT_STATUS(td_tensor_backward(s1), TD_ERR_STATE);
  td_tensor_unref(s1);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static void test_autograd_deep_chain(void **state) {
  /* 20000 nodes: building, differentiating and freeing must not recurse on the stack */
  int64_t s[1] = {1};
  td_tensor *x = td_test_randn(s, 1, F64, 3, true);
  td_tensor *cur = td_tensor_ref(x);
  for (int i = 0; i < 20000; i++) {
    td_tensor *n;
    TD_ASSERT_OK(td_tensor_add_scalar(cur, 1e-4, &n));
    td_tensor_unref(cur);
    cur = n;
  }
  td_tensor *y;
  TD_ASSERT_OK(td_tensor_sum_all(cur, &y));
  TD_ASSERT_OK(td_tensor_backward(y));
  assert_true(grad_at(x, 0) == 1.0);
  td_tensor_unref(y);
  td_tensor_unref(cur);
  td_tensor_unref(x);
}

typedef struct {
  td_tensor *w;
  int iters;
  td_status st;
} thr_arg;

static void *backward_thread(void *p) {
  thr_arg *a = p;
  int64_t s[2] = {8, 16};
  for (int i = 0; i < a->iters && a->st == TD_OK; i++) {
    td_tensor *x = td_test_rand(s, 2, F64, 1.0, 1.0, (uint64_t)i, false); /* all ones */
    td_tensor *h = NULL, *y = NULL;
    a->st = td_tensor_matmul(x, a->w, &h);
    if (a->st == TD_OK) a->st = td_tensor_sum_all(h, &y);
    if (a->st == TD_OK) a->st = td_tensor_backward(y);
    td_tensor_unref(x);
    td_tensor_unref(h);
    td_tensor_unref(y);
  }
  return NULL;
}

static void test_autograd_concurrent_shared_leaf(void **state) {
  int64_t s[2] = {16, 4};
  td_tensor *w = td_test_randn(s, 2, F64, 5, true);
  enum { T = 4, ITERS = 50 };
  pthread_t th[T];
  thr_arg args[T];
  for (int i = 0; i < T; i++) {
    args[i] = (thr_arg){w, ITERS, TD_OK};
    pthread_create(&th[i], NULL, backward_thread, &args[i]);
  }
  for (int i = 0; i < T; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < T; i++) TD_ASSERT_OK(args[i].st);
  /* d/dw sum(ones[8,16] @ w) = 8 everywhere, per pass */
  td_tensor *g = td_tensor_grad(w), *e;
  TD_ASSERT_OK(td_tensor_full(s, 2, 8.0 * T * ITERS, F64, td_device_cpu(), &e));
  td_test_assert_close("shared leaf grad", g, e, 0, 0);
  td_tensor_unref(g);
  td_tensor_unref(e);
  td_tensor_unref(w);
}

static void test_autograd_nonscalar_root(void **state) {
  int64_t s[1] = {3};
  td_tensor *x = td_test_randn(s, 1, F64, 9, true), *y;
  TD_ASSERT_OK(td_tensor_mul_scalar(x, 2.0, &y));
  TD_ASSERT_STATUS(td_tensor_backward(y), TD_ERR_SHAPE);
  td_tensor *g;
  TD_ASSERT_OK(td_tensor_ones(s, 1, F64, td_device_cpu(), &g));
  TD_ASSERT_OK(td_autograd_backward(&y, &g, 1, NULL));
  assert_true(grad_at(x, 0) == 2.0);
  td_tensor *bad;
  int64_t s2[1] = {2};
  TD_ASSERT_OK(td_tensor_ones(s2, 1, F64, td_device_cpu(), &bad));
  TD_ASSERT_STATUS(td_autograd_backward(&y, &bad, 1, NULL), TD_ERR_SHAPE);
  td_tensor_unref(bad);
  td_tensor_unref(g);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_autograd_accumulate_and_retain),
      cmocka_unit_test(test_autograd_grad_map),
      cmocka_unit_test(test_autograd_hooks),
      cmocka_unit_test(test_autograd_leaf_used_twice_accumulates_once),
      cmocka_unit_test(test_autograd_external_recv),
      cmocka_unit_test(test_autograd_external_send_resume),
      cmocka_unit_test(test_autograd_no_grad),
      cmocka_unit_test(test_autograd_deep_chain),
      cmocka_unit_test(test_autograd_concurrent_shared_leaf),
      cmocka_unit_test(test_autograd_nonscalar_root),
  };
  return cmocka_run_group_tests_name("autograd", tests, NULL, NULL);
}
