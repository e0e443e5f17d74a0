/* rref.h - remote references (RRefs): values that live on one worker (the owner) and are used
 * from others (users), with deterministic, reference-counted lifetimes across processes.
 *
 * td_remote() runs a registered function on a worker and returns at once with a user RRef to its
 * result, which stays on that worker (the owner). td_rref_to_here() copies the value to the
 * caller; the proxies (td_rref_rpc_sync / td_rref_rpc_async / td_rref_remote) run a registered
 * function on the owner with the owner's value as first argument, which is how remote objects
 * (modules, parameter servers, anything registered with td_object_type_register) are used.
 *
 * RRefs are values (td_value_rref): they can be arguments and results of rpc and remote calls and
 * be passed on to third workers. Every copy that crosses a process is a "fork" the owner counts;
 * the owner frees the value as soon as the last fork and the last local handle are gone - no
 * garbage collector, no delay. Semantics follow PyTorch's RRef design notes (owner/user, fork
 * confirmation, creation futures); the protocol is described at the top of rref/rref.c and in
 * docs/ARCHITECTURE.md ("RRef").
 *
 * A creation failure (the function failed, was not found, or timed out) is stored on the RRef:
 * td_rref_to_here, the proxies and sending the RRef on all fail with "RRef creation failed: "
 * followed by the owner's message.
 *
 * td_rpc_init registers the RRef layer (and every other layer) with the RPC agent before it
 * starts it, for the shared and the static library alike.
 *
 * THREAD SAFETY: every function may be called from any thread, including from registered functions
 * and future callbacks, unless its comment says it blocks (blocking calls take a td_timeout_ms,
 * tdist/timeout.h, whose TD_TIMEOUT_DEFAULT is the agent's rpc timeout; never block inside a
 * future callback).
 */
#ifndef TDIST_RREF_H
#define TDIST_RREF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/rpc.h"
#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_rref td_rref;

/* Ids that cross processes: (creating worker's rank << 48) | counter. The creator's own fork id
 * equals the RRef id; an owner's local handle has fork id 0. */
typedef struct td_rref_id {
  uint64_t v;
} td_rref_id;
typedef struct td_rref_fork_id {
  uint64_t v;
} td_rref_fork_id;

/* ======================================================================================== */
/* Creating RRefs                                                                            */
/* ======================================================================================== */

/* td_remote runs the registered function fn on worker `to` with args[0..nargs) (borrowed; not to
 * be modified afterwards) and returns at once with an RRef to its result in *out (new reference;
 * release with td_rref_unref()). The value stays on `to`. When `to` is this worker, the RRef is
 * the owner's handle and fn runs on the agent's pool. opts may be NULL; opts->timeout_ms bounds
 * the creation (TD_TIMEOUT_DEFAULT: the agent's rpc timeout). A creation that fails or times out
 * is reported later by the RRef (creation future, to_here, proxies); only errors found at once
 * (agent shut down, unknown worker, NULL arguments, TD_TIMEOUT_ZERO) are returned here. Does not
 * block. */
TD_API td_status td_remote(td_rpc_agent *a, const char *to, const char *fn,
                           td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                           td_rref **out);

/* td_rref_create_local makes an owner RRef around value on this worker (takes a new reference to
 * value; the RRef is confirmed and its value ready at once). *out: new reference; release with
 * td_rref_unref(). */
TD_API td_status td_rref_create_local(td_rpc_agent *a, td_value *value, td_rref **out);

TD_API td_rref *td_rref_ref(td_rref *r);
/* td_rref_unref drops a reference. The last one on a user RRef tells the owner (asynchronously,
 * never blocking); the last one on an owner handle frees the value once no user is left. NULL does
 * nothing. */
TD_API void td_rref_unref(td_rref *r);

/* ======================================================================================== */
/* Using RRefs                                                                               */
/* ======================================================================================== */

/* td_rref_to_here returns a copy of the value (on the owner: the value itself) in *out (new
 * reference). Blocks until the value exists or the timeout passes (TD_TIMEOUT_DEFAULT: the
 * agent's rpc timeout; TD_TIMEOUT_ZERO: on the owner only checks, on a user expires at once):
 * TD_ERR_TIMEOUT then, the creation error for a failed RRef ("RRef creation failed: ..."),
 * TD_ERR_STATE after shutdown. */
TD_API td_status td_rref_to_here(td_rref *r, td_timeout_ms timeout, td_value **out);

/* td_rref_to_here_async is the non-blocking form (for registered functions and callbacks): *out
 * (new reference) completes with the value or the error td_rref_to_here would return. On the
 * owner it completes when the value has been created (the timeout is not applied there). */
TD_API td_status td_rref_to_here_async(td_rref *r, td_timeout_ms timeout, td_future **out);

/* td_rref_local_value returns the value (new reference) on the owner. While the value is still
 * being created it waits for it, at most the agent's rpc timeout (TD_ERR_TIMEOUT then), as
 * PyTorch's local_value does on an owner. TD_ERR_STATE on a user RRef (the message names the
 * owner) or after shutdown; the creation error when the creation failed. */
TD_API td_status td_rref_local_value(td_rref *r, td_value **out);

/* td_rref_owner returns the owner's rank (-1 for NULL). */
TD_API int td_rref_owner(const td_rref *r);
/* td_rref_owner_name returns the owner's worker name. Borrowed; valid while r lives. */
TD_API const char *td_rref_owner_name(const td_rref *r);
TD_API bool td_rref_is_owner(const td_rref *r);
/* td_rref_confirmed_by_owner is true once the owner knows this RRef: at once for owner handles and
 * forks received from the owner, when the creation reply arrives for the creator, when the owner's
 * confirmation arrives for other forks. */
TD_API bool td_rref_confirmed_by_owner(const td_rref *r);
/* td_rref_creation_future returns (new reference) a future that completes with none when the
 * value has been created (creator and owner) or the owner has confirmed this fork (other users),
 * or fails with "RRef creation failed: ..." when the creation failed or timed out. */
TD_API td_status td_rref_creation_future(td_rref *r, td_future **out);
TD_API td_rref_id td_rref_get_id(const td_rref *r);
TD_API td_rref_fork_id td_rref_get_fork_id(const td_rref *r);
/* td_rref_to_string writes "RRef(owner=worker1, id=0:5, fork=2:7)" (ids as rank:counter; owner
 * handles say "local" instead of a fork) into buf and returns buf (cut to n bytes, always
 * NUL-terminated when n > 0). */
TD_API const char *td_rref_to_string(const td_rref *r, char *buf, size_t n);

/* ======================================================================================== */
/* Proxies: registered functions run on the owner with the value as first argument            */
/* ======================================================================================== */

/* td_rref_rpc_async calls fn on r's owner with [value, args...] and returns at once with a future
 * (new reference) in *out. The value is created first if still pending. r is kept alive until the
 * call completes. opts as for td_rpc_async. A failed RRef is reported at once
 * ("RRef creation failed: ..."). Errors of fn read "<owner> (rank r): 'fn' failed: ...". */
TD_API td_status td_rref_rpc_async(td_rref *r, const char *fn, td_value *const *args, int nargs,
                                   const td_rpc_call_opts *opts, td_future **out);
/* td_rref_rpc_sync is td_rref_rpc_async + wait: *result gets the value (new reference). Blocks
 * (bounded by the call's timeout). */
TD_API td_status td_rref_rpc_sync(td_rref *r, const char *fn, td_value *const *args, int nargs,
                                  const td_rpc_call_opts *opts, td_value **result);
/* td_rref_remote runs fn on r's owner with [value, args...] and returns at once with a new RRef
 * (same owner) to its result in *out (new reference). */
TD_API td_status td_rref_remote(td_rref *r, const char *fn, td_value *const *args, int nargs,
                                const td_rpc_call_opts *opts, td_rref **out);

/* ======================================================================================== */
/* RRefs and opaque objects as values                                                         */
/* ======================================================================================== */

/* td_value_rref wraps r in a value (takes a new reference to r). Returns a new reference or NULL
 * when out of memory. Sending the value to another worker forks the RRef. */
TD_API td_value *td_value_rref(td_rref *r);
/* td_value_as_rref: *out borrowed, valid while v lives (td_rref_ref it to keep it).
 * TD_ERR_INVALID when v is not an RRef. */
TD_API td_status td_value_as_rref(const td_value *v, td_rref **out);

/* Opaque objects: values that never leave their process (sending one is TD_ERR_INVALID) and are
 * destroyed by their type's destructor when the last value holding them goes - on an RRef's
 * owner, when the last user is gone. td_rpc_init registers the type "nn.Module" (the
 * distributed optimizer's layer does, with td_module_unref as destructor: wrap td_module_ref(m)),
 * so modules can be wrapped once the agent is up. */
typedef void (*td_object_destroy_fn)(void *obj);
/* td_object_type_register registers a type name (copied; unique per process: TD_ERR_EXISTS for
 * another destructor under the same name; the same pair twice is TD_OK). destroy may be NULL. */
TD_API td_status td_object_type_register(const char *name, td_object_destroy_fn destroy);
/* td_value_object wraps obj (of a registered type) in a value: *out new reference. Takes
 * ownership of obj on TD_OK (the destructor runs with the last reference); on failure
 * (TD_ERR_NOT_FOUND for an unregistered type, TD_ERR_NOMEM) the caller keeps it. */
TD_API td_status td_value_object(const char *type, void *obj, td_value **out);
/* td_value_as_object: *obj borrowed, valid while v lives. type may be NULL to accept any object
 * type; otherwise a different type is TD_ERR_INVALID ("value: expected object of type 'A', got
 * 'B'"). */
TD_API td_status td_value_as_object(const td_value *v, const char *type, void **obj);
/* td_value_object_type returns the object's type name, or NULL when v is not an object. */
TD_API const char *td_value_object_type(const td_value *v);

/* ======================================================================================== */
/* Debugging and leaks                                                                       */
/* ======================================================================================== */

/* td_rref_debug_table returns this worker's live RRef table in *out (new reference), a dict:
 *   "owned": list of {"id", "state" ("pending"|"ready"|"failed"), "forks": [fork ids],
 *             "tombstones": [forks deleted before their parent's fork message arrived],
 *             "handles": local handles}
 *   "users": list of {"id", "fork", "owner", "confirmed", "children": forks sent on whose owner
 *             acknowledgement this RRef still waits}
 *   "early_confirms": confirmations received before their RRef was decoded.
 *   "releasing": values of RRefs already gone from the table whose release (for an opaque
 *             object, its destructor) is still queued on the agent's pool.
 * Ids are ints. TD_ERR_STATE after shutdown. */
TD_API td_status td_rref_debug_table(td_rpc_agent *a, td_value **out);

/* td_rref_set_strict turns leak reports into errors (process-wide): a graceful td_rpc_shutdown that
 * finds owned RRefs with live users or handles, or user RRefs not released, logs a warning and
 * returns TD_ERR_STATE naming them (after releasing them). Also on when the environment has
 * TD_RREF_STRICT=1. Off (the default), RRefs the program still holds at shutdown are released as
 * PyTorch's shutdown does, and listed at DEBUG level only. */
TD_API void td_rref_set_strict(bool on);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_RREF_H */
