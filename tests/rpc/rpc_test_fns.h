/* rpc_test_fns.h - functions registered by the RPC tests (every worker registers all). */
#ifndef TD_RPC_TEST_FNS_H
#define TD_RPC_TEST_FNS_H

#include <string.h>
#include <time.h>

#include "mp_util.h"
#include "test_fns.h"
#include "tdist/rpc.h"

static td_status fn_whoami(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  *res = td_value_string(td_rpc_ctx_caller_name(c));
  return TD_OK;
}

/* nested(worker): a synchronous call from inside a handler: add(1, 2) on worker, plus 1 */
static td_status fn_nested(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  const char *to;
  td_status st = td_value_as_string(args[0], &to, NULL);
  if (st != TD_OK) return st;
  td_value *a[2] = {td_value_int(1), td_value_int(2)}, *r = NULL;
  st = td_rpc_sync(td_rpc_ctx_agent(c), to, "add", a, 2, NULL, &r);
  td_value_unref(a[0]);
  td_value_unref(a[1]);
  if (st != TD_OK) return st;
  int64_t v;
  st = td_value_as_int(r, &v);
  td_value_unref(r);
  if (st != TD_OK) return st;
  *res = td_value_int(v + 1);
  return TD_OK;
}

static td_status plus_one(void *ctx, td_future *src, td_value **result, td_future **next) {
  if (td_future_status(src) != TD_OK)
    return td_set_error(td_future_status(src), "%s", td_future_message(src));
  int64_t v;
  td_status st = td_value_as_int(td_future_value(src), &v);
  if (st != TD_OK) return st;
  *result = td_value_int(v + 1);
  return TD_OK;
}

/* chain(hops): an async hop to the next rank; replies hops when the chain returns */
static td_status fn_chain(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t hops;
  td_status st = td_value_as_int(args[0], &hops);
  if (st != TD_OK) return st;
  if (hops == 0) {
    *res = td_value_int(0);
    return TD_OK;
  }
  td_rpc_agent *a = td_rpc_ctx_agent(c);
  td_worker_info next;
  st = td_rpc_get_worker_info_by_rank(a, (td_rpc_rank(a) + 1) % td_rpc_world_size(a), &next);
  if (st != TD_OK) return st;
  td_value *arg = td_value_int(hops - 1);
  td_future *f = NULL;
  st = td_rpc_async(a, next.name, "chain", &arg, 1, NULL, &f);
  td_value_unref(arg);
  if (st != TD_OK) return st;
  st = td_future_then(f, plus_one, NULL, fut);
  td_future_unref(f);
  return st;
}

/* inline_sync(worker): an inline function that (wrongly) makes a blocking call */
static td_status fn_inline_sync(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                td_future **fut) {
  const char *to;
  td_status st = td_value_as_string(args[0], &to, NULL);
  if (st != TD_OK) return st;
  td_value *r = NULL;
  st = td_rpc_sync(td_rpc_ctx_agent(c), to, "whoami", NULL, 0, NULL, &r);
  td_value_unref(r);
  return st;
}

static void register_test_fns(void) {
  MP_CHECK_OK(td_rpc_register_ex("inline_add", td_test_fn_add, NULL, TD_RPC_INLINE));
  MP_CHECK_OK(td_rpc_register_ex("inline_sync", fn_inline_sync, NULL, TD_RPC_INLINE));
  MP_CHECK_OK(td_rpc_register("echo", td_test_fn_echo, NULL));
  MP_CHECK_OK(td_rpc_register("add", td_test_fn_add, NULL));
  MP_CHECK_OK(td_rpc_register("fail", td_test_fn_fail, NULL));
  MP_CHECK_OK(td_rpc_register("slow", td_test_fn_slow, NULL));
  MP_CHECK_OK(td_rpc_register("whoami", fn_whoami, NULL));
  MP_CHECK_OK(td_rpc_register("nested", fn_nested, NULL));
  MP_CHECK_OK(td_rpc_register("chain", fn_chain, NULL));
}

#endif
