/* timeout.h - the one timeout type of tdist: every blocking call and every timeout option takes a
 * td_timeout_ms and reads it by the same rule (nng's nng_duration):
 *
 *   t > 0                 wait at most t milliseconds
 *   TD_TIMEOUT_ZERO       do not wait: a wait only checks what is already there, a call started
 *                         with it has already expired (it fails with TD_ERR_TIMEOUT unless it can
 *                         finish without waiting)
 *   TD_TIMEOUT_INFINITE   no limit
 *   TD_TIMEOUT_DEFAULT    the default of the object the call works on, named in each call's comment
 *                         (the agent's rpc timeout for calls and RRefs, the group's timeout for
 *                         collectives; a future has no default of its own: it waits without limit)
 *
 * Any other negative value is TD_ERR_INVALID. An option struct's initialiser
 * (td_rpc_options_init, TD_RPC_CALL_OPTS_INIT) fills its timeouts with their documented values,
 * and the structs whose timeouts 0 would silently expire refuse to be used without it (tdist/rpc.h,
 * TD_RPC_OPTIONS_MAGIC): a zeroed struct is an error, not a deadline.
 */
#ifndef TDIST_TIMEOUT_H
#define TDIST_TIMEOUT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A duration in milliseconds, or one of the three named values below. */
typedef int64_t td_timeout_ms;

#define TD_TIMEOUT_ZERO ((td_timeout_ms)0)
#define TD_TIMEOUT_INFINITE ((td_timeout_ms)-1)
#define TD_TIMEOUT_DEFAULT ((td_timeout_ms)-2)

#ifdef __cplusplus
}
#endif
#endif /* TDIST_TIMEOUT_H */
