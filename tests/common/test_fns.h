/* test_fns.h - RPC functions that several test programs register (each under the name it
 * chooses): echo, add, fail, slow, and the gradients of a module's parameters in the current
 * distributed autograd context. */
#ifndef TD_TEST_FNS_H
#define TD_TEST_FNS_H

#include "tdist/rpc.h"

/* echo(x) -> x; echo() -> None */
td_status td_test_fn_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut);
/* add(x, y) -> x + y (ints) */
td_status td_test_fn_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut);
/* fail() -> TD_ERR_INVALID "boom 42" */
td_status td_test_fn_fail(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut);
/* slow(ms) -> ms after sleeping ms milliseconds on the pool thread (never TD_RPC_INLINE) */
td_status td_test_fn_slow(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut);
/* grads_of(module object) -> [the gradient of each parameter in the current distributed
 * autograd context, or None]; TD_ERR_STATE without a current context */
td_status td_test_fn_grads_of(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut);

#endif
