/* test_fns.c - RPC functions shared by the test programs (see test_fns.h). */
#include "test_fns.h"

#include "mp_util.h"
#include "tdist/dist_autograd.h"
#include "tdist/nn.h"
#include "tdist/rref.h"

td_status td_test_fn_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

td_status td_test_fn_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  int64_t x, y;
  if (n != 2) return td_set_error(TD_ERR_INVALID, "add takes 2 arguments, got %d", n);
  td_status st = td_value_as_int(args[0], &x);
  if (st == TD_OK) st = td_value_as_int(args[1], &y);
  if (st != TD_OK) return st;
  *res = td_value_int(x + y);
  return TD_OK;
}

td_status td_test_fn_fail(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  return td_set_error(TD_ERR_INVALID, "boom %d", 42);
}

td_status td_test_fn_slow(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t ms = 0;
  if (n) td_value_as_int(args[0], &ms);
  td_test_sleep_ms(ms);
  *res = td_value_int(ms);
  return TD_OK;
}

td_status td_test_fn_grads_of(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  void *m;
  if (n != 1) return td_set_error(TD_ERR_INVALID, "grads_of takes 1 argument, got %d", n);
  td_status st = td_value_as_object(args[0], "nn.Module", &m);
  if (st != TD_OK) return st;
  td_dist_autograd_context *ctx = td_dist_autograd_current();
  if (!ctx) return td_set_error(TD_ERR_STATE, "grads_of: no current context");
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  td_value *l = td_value_list();
  st = l ? td_module_parameters(m, &ps) : td_set_error(TD_ERR_NOMEM, "grads_of: out of memory");
  for (size_t i = 0; st == TD_OK && i < ps.n; i++) {
    td_tensor *g = td_grad_map_get(td_dist_autograd_context_grad_map(ctx), ps.tensors[i]);
    td_value *gv = g ? td_value_tensor(g) : td_value_none();
    td_tensor_unref(g);
    st = td_value_list_append(l, gv);
    if (st != TD_OK) td_value_unref(gv);
  }
  td_tensor_list_fini(&ps);
  if (st == TD_OK) *res = l;
  else td_value_unref(l);
  return st;
}
