/* future_impl.h - internals of td_future used by the rpc agent (never installed). */
#ifndef TD_RPC_FUTURE_IMPL_H
#define TD_RPC_FUTURE_IMPL_H

#include <stdbool.h>

#include "../core/core.h"
#include "tdist/rpc.h"

/* td__future_has_callbacks returns true when at least one callback (td_future_on_done or
 * td_future_then, not td__future_on_done_light) has ever been registered on f, whether it has
 * already run or not. The agent completes such a call's future on its pool rather than on the
 * network thread. THREAD SAFETY: any thread; the answer may change as soon as it is returned. */
bool td__future_has_callbacks(td_future *f);

/* td__future_on_done_light is td_future_on_done for a callback that never blocks and is short
 * (a few table updates): it does not count for td__future_has_callbacks, so the outcome of a call
 * whose future only has such callbacks is delivered on the network thread without a hop to the
 * pool. */
td_status td__future_on_done_light(td_future *f, td_future_cb cb, void *ctx);

/* td__future_then_light is td_future_then for a light fn (short, never blocking): registered with
 * td__future_on_done_light, so f's completion does not hop to the pool for it; fn runs on the
 * completing thread, and so does the chained future's completion unless that future has
 * callbacks of its own (td__future_has_callbacks when f completes): then fn and the completion
 * run through submit(submit_ud, task, arg) (the agent's pool), as with td_future_then. A blocking
 * wait on the chained future thus takes the reply, runs fn and completes it on the waiting
 * thread, with no hop. */
td_status td__future_then_light(td_future *f, td_future_then_fn fn, void *ctx,
                                td_status (*submit)(void *ud, void (*task)(void *), void *arg),
                                void *submit_ud, td_future **out);

/* td__future_fail_msg fails f with status st (not TD_OK) and the message msg, copied verbatim
 * (no printf formatting; NULL means ""). Same contract as td_future_fail: TD_ERR_STATE when f is
 * already done, TD_ERR_INVALID for a NULL f or st == TD_OK. Callbacks run on this thread. */
td_status td__future_fail_msg(td_future *f, td_status st, const char *msg);

/* td__future_set_flight names what a wait on f waits for in the flight recorder: call call_id
 * of fn on worker peer. Called once, before f is shared. */
void td__future_set_flight(td_future *f, int peer, uint64_t call_id, const char *fn);
/* td__future_set_flight_subject adds what the wait is about (td__flight_subj_kind and id, e.g. the
 * RRef a fetch reads); like td__future_set_flight, before the future is waited on. A future made
 * by td_future_then inherits its source's call and subject. */
void td__future_set_flight_subject(td_future *f, int kind, uint64_t id);
/* td__future_set_wait_pump makes pump(ud) run on this thread while it blocks in td_future_wait or
 * td_future_wait_all (every few milliseconds and before each wait), so a thread that must run
 * queued work (host-driven progress) cannot deadlock waiting for it. NULL clears it. */
void td__future_set_wait_pump(void (*pump)(void *ud), void *ud);

/* td__future_set_before_block makes fn(ud) run once on this thread before it next blocks in
 * td_future_wait or td_future_wait_all (then the hook is cleared): a thread running a batch of
 * completions hands the rest of the batch to other threads when one of them blocks, so no
 * completion waits behind a callback that waits for it. NULL clears it. */
void td__future_set_before_block(void (*fn)(void *ud), void *ud);

/* A process-wide source of progress that a thread about to block in td_future_wait drives itself
 * for a short window (rpc/lane.c: the receive side of the same-host lanes), so that a reply is
 * taken by the thread waiting for it instead of by a thread that must then wake it. enter and
 * leave bracket a waiter's polling; poll returns true when it made progress; window_ns is how
 * long a waiter keeps polling without progress (0: do not poll). */
typedef struct td__wait_poller {
  void (*enter)(void *ud);
  bool (*poll)(void *ud);
  void (*leave)(void *ud);
  int64_t (*window_ns)(void *ud);
  void *ud;
} td__wait_poller;
/* td__future_set_wait_poller installs p (copied), or with p NULL removes the poller whose ud is
 * ud (once it returns, no thread uses it any more). */
void td__future_set_wait_poller(const td__wait_poller *p, void *ud);

#endif
