/* da_test_fns.h - functions and model parts shared by the distributed autograd tests (every
 * worker registers all of them).
 *
 * Model parts are built deterministically (float64, parameters filled from a seed) so that a
 * single-process reference can build the very same model:
 *   "mlp1": Sequential(Linear(D, H), ReLU)          "head": Linear(H, C)
 *   "emb":  Embedding(V, E)                          "mlp2": Sequential(Linear(E, H), ReLU, Linear(H, C))
 */
#ifndef TD_DA_TEST_FNS_H
#define TD_DA_TEST_FNS_H

#include <math.h>
#include <string.h>

#include "mp_util.h"
#include "test_fns.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/nn.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

#define DA_TRY(expr)                    \
  do {                                  \
    td_status da_s_ = (expr);           \
    if (da_s_ != TD_OK) return da_s_;   \
  } while (0)

enum { DA_N = 8, DA_D = 6, DA_H = 5, DA_C = 3, DA_V = 10, DA_E = 4 };

static inline td_status da_fill(td_module *m, int64_t seed) {
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  DA_TRY(td_module_to_dtype(m, TD_DTYPE_F64));
  DA_TRY(td_module_parameters(m, &ps));
  for (size_t i = 0; i < ps.n; i++) {
    double *d = td_tensor_data(ps.tensors[i]);
    for (int64_t k = 0; k < td_tensor_numel(ps.tensors[i]); k++)
      d[k] = 0.5 * sin(0.7 * (double)seed + 1.3 * (double)i + 0.913 * (double)k);
  }
  td_tensor_list_fini(&ps);
  return TD_OK;
}

static inline td_status da_build(const char *kind, int64_t seed, td_module **out) {
  td_module *m = NULL, *a = NULL, *b = NULL, *c = NULL;
  td_status st;
  if (strcmp(kind, "head") == 0) {
    st = td_linear_create(DA_H, DA_C, true, NULL, &m);
  } else if (strcmp(kind, "emb") == 0) {
    st = td_embedding_create(DA_V, DA_E, NULL, &m);
  } else if (strcmp(kind, "mlp1") == 0) {
    st = td_sequential_create(&m);
    if (st == TD_OK) st = td_linear_create(DA_D, DA_H, true, NULL, &a);
    if (st == TD_OK) st = td_relu_create(&b);
    if (st == TD_OK) st = td_sequential_append(m, a);
    if (st == TD_OK) st = td_sequential_append(m, b);
  } else if (strcmp(kind, "mlp2") == 0) {
    st = td_sequential_create(&m);
    if (st == TD_OK) st = td_linear_create(DA_E, DA_H, true, NULL, &a);
    if (st == TD_OK) st = td_relu_create(&b);
    if (st == TD_OK) st = td_linear_create(DA_H, DA_C, true, NULL, &c);
    if (st == TD_OK) st = td_sequential_append(m, a);
    if (st == TD_OK) st = td_sequential_append(m, b);
    if (st == TD_OK) st = td_sequential_append(m, c);
  } else {
    return td_set_error(TD_ERR_INVALID, "no part '%s'", kind);
  }
  td_module_unref(a);
  td_module_unref(b);
  td_module_unref(c);
  if (st == TD_OK) st = da_fill(m, seed);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* make_part(kind, seed) -> nn.Module object */
static td_status da_make_part(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  const char *kind;
  int64_t seed;
  DA_TRY(td_value_as_string(args[0], &kind, NULL));
  DA_TRY(td_value_as_int(args[1], &seed));
  td_module *m = NULL;
  DA_TRY(da_build(kind, seed, &m));
  td_status st = td_value_object("nn.Module", m, res);
  if (st != TD_OK) td_module_unref(m);
  return st;
}

/* fwd(module, x) -> module(x) (runs in the caller's context: the result carries history) */
static td_status da_fwd(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  void *m;
  td_tensor *x, *y;
  DA_TRY(td_value_as_object(args[0], "nn.Module", &m));
  DA_TRY(td_value_as_tensor(args[1], &x));
  DA_TRY(td_module_forward(m, x, &y));
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return TD_OK;
}

/* da_info() -> [contexts, backward passes, send functions] on this worker */
static td_status da_info(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  td_dist_autograd_debug_info di;
  DA_TRY(td_dist_autograd_get_debug_info(td_rpc_ctx_agent(c), &di));
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_int(di.num_contexts));
  td_value_list_append(l, td_value_int(di.num_backward_passes));
  td_value_list_append(l, td_value_int(di.num_send_functions));
  *res = l;
  return TD_OK;
}

/* A process-wide parameter p (float64 [DA_D], p[k] = 1 + k + rank) for the small tests. */
static td_tensor *da_p;

static inline td_tensor *da_param(int rank) {
  if (!da_p) {
    int64_t shape[1] = {DA_D};
    double d[DA_D];
    for (int k = 0; k < DA_D; k++) d[k] = 1.0 + k + rank;
    td_tensor_from_buffer(d, shape, 1, TD_DTYPE_F64, &da_p);
    td_tensor_set_requires_grad(da_p, true);
  }
  return da_p;
}

/* mulp(x) -> x * p */
static td_status da_mulp(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  td_tensor *x, *y;
  DA_TRY(td_value_as_tensor(args[0], &x));
  DA_TRY(td_tensor_mul(x, da_param(td_rpc_rank(td_rpc_ctx_agent(c))), &y));
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return TD_OK;
}

/* grad_p() -> the gradient of p in the current context (None when none) */
/* slow_param(ms): a float64 parameter [1, 2, 3] made after ms milliseconds */
static td_status da_slow_param(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  int64_t ms = 0;
  if (n != 1 || td_value_as_int(args[0], &ms) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "slow_param takes the delay in ms");
  td_test_sleep_ms(ms);
  double d[3] = {1, 2, 3};
  int64_t shape[1] = {3};
  td_tensor *t;
  DA_TRY(td_tensor_from_buffer(d, shape, 1, TD_DTYPE_F64, &t));
  td_status st = td_tensor_set_requires_grad(t, true);
  if (st == TD_OK) *res = td_value_tensor(t);
  td_tensor_unref(t);
  return st;
}

static td_status da_grad_p(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  td_dist_autograd_context *ctx = td_dist_autograd_current();
  if (!ctx) return td_set_error(TD_ERR_STATE, "grad_p: no current context");
  td_tensor *g = td_grad_map_get(td_dist_autograd_context_grad_map(ctx),
                                 da_param(td_rpc_rank(td_rpc_ctx_agent(c))));
  *res = g ? td_value_tensor(g) : td_value_none();
  td_tensor_unref(g);
  return TD_OK;
}

static td_status fail_backward(void *ctx, td_tensor *const *gout, int n_out, td_tensor **gin,
                               int n_in) {
  return td_set_error(TD_ERR_INVALID, "boom in FailBackward");
}

/* da_reply_through stores in *res a tensor value equal to y whose gradient goes through a new
 * external node `name` (backward fn) before reaching y; releases y. */
static inline td_status da_reply_through(td_tensor *y, const char *name, td_external_backward_fn fn,
                                         td_value **res) {
  td_tensor *d, *z;
  td_node *node;
  DA_TRY(td_node_create_external(name, 1, &y, 1, fn, NULL, NULL, &node));
  DA_TRY(td_tensor_detach(y, &d));
  DA_TRY(td_autograd_attach(d, node, 0, &z));
  td_node_unref(node);
  td_tensor_unref(d);
  td_tensor_unref(y);
  *res = td_value_tensor(z);
  td_tensor_unref(z);
  return TD_OK;
}

/* failing(x) -> x * 2 whose backward fails */
static td_status da_failing(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  td_tensor *x, *y;
  DA_TRY(td_value_as_tensor(args[0], &x));
  DA_TRY(td_tensor_mul_scalar(x, 2.0, &y));
  return da_reply_through(y, "FailBackward", fail_backward, res);
}

/* hop(x, worker, fn) -> rpc_sync(worker, fn, x) * 1.5 (a nested call inside the context) */
static td_status da_hop(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  const char *to, *fn;
  DA_TRY(td_value_as_string(args[1], &to, NULL));
  DA_TRY(td_value_as_string(args[2], &fn, NULL));
  td_value *r;
  DA_TRY(td_rpc_sync(td_rpc_ctx_agent(c), to, fn, args, 1, NULL, &r));
  td_tensor *t, *y;
  td_status st = td_value_as_tensor(r, &t);
  if (st == TD_OK) st = td_tensor_mul_scalar(t, 1.5, &y);
  td_value_unref(r);
  DA_TRY(st);
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return TD_OK;
}

/* da_check_clean asserts (in a child) that no worker holds a context, a running pass or a send
 * function. */
static inline void da_check_clean(td_rpc_agent *a) {
  MP_CHECK(td_dist_autograd_current() == NULL);
  for (int r = 0; r < td_rpc_world_size(a); r++) {
    td_worker_info wi;
    MP_CHECK_OK(td_rpc_get_worker_info_by_rank(a, r, &wi));
    td_value *v;
    MP_CHECK_OK(td_rpc_sync(a, wi.name, "da_info", NULL, 0, NULL, &v));
    for (int k = 0; k < 3; k++) {
      int64_t x = -1;
      MP_CHECK_OK(td_value_as_int(td_value_list_get(v, (size_t)k), &x));
      if (x != 0) fprintf(stderr, "rank %d: counter %d is %lld\n", r, k, (long long)x);
      MP_CHECK(x == 0);
    }
    td_value_unref(v);
  }
}

/* da_rpc_tensor calls fn on worker `to` and returns its tensor result (new reference). */
static inline td_tensor *da_rpc_tensor(td_rpc_agent *a, const char *to, const char *fn,
                                       td_value **args, int n) {
  td_value *r;
  MP_CHECK_OK(td_rpc_sync(a, to, fn, args, n, NULL, &r));
  td_tensor *t;
  MP_CHECK_OK(td_value_as_tensor(r, &t));
  td_tensor_ref(t);
  td_value_unref(r);
  return t;
}

static inline void da_register_all(void) {
  td_rpc_register("make_part", da_make_part, NULL);
  td_rpc_register("fwd", da_fwd, NULL);
  td_rpc_register("grads_of", td_test_fn_grads_of, NULL);
  td_rpc_register("da_info", da_info, NULL);
  td_rpc_register("mulp", da_mulp, NULL);
  td_rpc_register("grad_p", da_grad_p, NULL);
  td_rpc_register("slow_param", da_slow_param, NULL);
  td_rpc_register("failing", da_failing, NULL);
  td_rpc_register("hop", da_hop, NULL);
}

#endif
