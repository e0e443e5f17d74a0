/* future.h - futures: the outcome of an asynchronous operation (remote calls, RRef creation,
 * collectives), completed exactly once with a value or an error (status + message). A remote
 * failure's message starts with the remote worker's name and rank.
 *
 * THREAD SAFETY: every function from any thread, including future callbacks, unless its comment
 * says otherwise. Waits take a td_timeout_ms (tdist/timeout.h).
 */
#ifndef TDIST_FUTURE_H
#define TDIST_FUTURE_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/status.h"
#include "tdist/timeout.h"
#include "tdist/value.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_future td_future;

/* td_future_create makes a pending future (for async handlers and user code). Returns a new
 * reference or NULL when out of memory. */
TD_API td_future *td_future_create(void);
TD_API td_future *td_future_ref(td_future *f);
/* td_future_unref drops a reference; NULL does nothing. Dropping the last reference to a pending
 * future that has callbacks fails it first with TD_ERR_CANCELLED ("future abandoned: ..."), so
 * its callbacks and chained futures still run exactly once; without callbacks it is just freed. */
TD_API void td_future_unref(td_future *f);

/* td_future_complete completes f with value (always takes ownership of value, NULL means none:
 * td_future_value then returns a none value). TD_ERR_STATE when f is already done, TD_ERR_INVALID
 * when f is NULL (value is released in both cases). The outcome is published (waiters wake) before
 * the callbacks run; callbacks run on this thread before the call returns. */
TD_API td_status td_future_complete(td_future *f, td_value *value);
/* td_future_fail completes f with an error: status must not be TD_OK (TD_ERR_INVALID, f stays
 * pending); the message is formatted printf-style, any length (fmt may be NULL for none).
 * TD_ERR_STATE when f is already done. Callbacks as for td_future_complete. */
TD_API td_status td_future_fail(td_future *f, td_status status, const char *fmt, ...)
    TD_PRINTF(3, 4);

TD_API bool td_future_done(const td_future *f);
/* td_future_wait blocks until f is done or the timeout passes (TD_TIMEOUT_ZERO only checks;
 * TD_TIMEOUT_INFINITE and TD_TIMEOUT_DEFAULT wait without limit: a future has no default of its
 * own). Returns TD_ERR_TIMEOUT on timeout (f stays pending), else f's status (setting
 * td_last_error to f's message on failure); TD_ERR_INVALID for another negative timeout. */
TD_API td_status td_future_wait(td_future *f, td_timeout_ms timeout);
/* td_future_status is f's outcome: TD_OK, an error, or TD_ERR_STATE while pending (use
 * td_future_done to tell a pending future from one failed with TD_ERR_STATE). */
TD_API td_status td_future_status(const td_future *f);
/* td_future_message is the error message of a failed future ("" otherwise). Borrowed; valid while
 * f lives. */
TD_API const char *td_future_message(const td_future *f);
/* td_future_value returns the value of a successful future (borrowed, valid while f lives), or
 * NULL when pending or failed. */
TD_API td_value *td_future_value(const td_future *f);

/* td_future_cb runs once when the future is done, on the thread that completed it (or on the
 * caller's thread when already done), with no library lock held. It must not block. f is borrowed
 * for the duration of the call. */
typedef void (*td_future_cb)(td_future *f, void *ctx);
/* td_future_on_done adds a callback. Callbacks run exactly once, in registration order. One
 * registered while the completing thread is still running earlier callbacks (from any thread, or
 * from inside a callback) is queued and run by that thread after them; otherwise, on a done
 * future, it runs at once on the caller's thread before td_future_on_done returns. On failure
 * (TD_ERR_INVALID for NULL f or cb, TD_ERR_NOMEM) it never runs. */
TD_API td_status td_future_on_done(td_future *f, td_future_cb cb, void *ctx);

/* td_future_then_fn sees the finished future src (successful or failed; src is borrowed) and
 * produces the chained future's outcome: return an error (message via td_set_error; without one
 * the status's generic text is used) to fail it, or store a value in *result (new reference; NULL
 * means none), or store a future in *next (new reference, handed to the chain) whose outcome -
 * value, or status and message - the chained future then follows. Setting both fails the chained
 * future with TD_ERR_INVALID. Anything stored alongside an error is released. It runs where a
 * td_future_cb would, and must not block. */
typedef td_status (*td_future_then_fn)(void *ctx, td_future *src, td_value **result,
                                       td_future **next);
/* td_future_then returns (in *out, new reference) a future completed by fn after f finishes.
 * fn runs exactly once (at once when f is already done) unless this call fails. */
TD_API td_status td_future_then(td_future *f, td_future_then_fn fn, void *ctx, td_future **out);

/* td_future_wait_all waits for all n futures, returning TD_OK once all succeeded, or as soon as
 * one has failed (the lowest-indexed failed one seen: its status, with td_last_error "future <i>
 * of the set failed: <its message>"), or TD_ERR_TIMEOUT once the timeout passed (as for
 * td_future_wait: TD_TIMEOUT_ZERO only checks, INFINITE and DEFAULT wait without limit). n == 0
 * is TD_OK; NULL entries are TD_ERR_INVALID. Blocks; leaves no callback or other trace on the
 * futures. */
TD_API td_status td_future_wait_all(td_future *const *fs, int n, td_timeout_ms timeout);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_FUTURE_H */
