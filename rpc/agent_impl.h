/* agent_impl.h - what upper layers (RRefs, distributed autograd, collectives, remote modules) may
 * use of the RPC agent: registration points and a few accessors. The agent's own state is in
 * agent_state.h, which no other layer includes. */
#ifndef TD_RPC_AGENT_IMPL_H
#define TD_RPC_AGENT_IMPL_H

#include "../core/threadpool.h"
#include "future_impl.h"
#include "store.h"
#include "transport.h"

/* Registered functions. Internal ones (names starting "__") come from the library itself. */
typedef struct td__reg {
  char *name;
  td_rpc_fn fn;
  void *user_data;
  unsigned flags; /* TD_RPC_INLINE, TD__RPC_INLINE_LIKE_ARG1 */
} td__reg;

/* Internal flag: the request runs on the network thread exactly when its second argument is the
 * name of a function registered TD_RPC_INLINE (the RRef layer's __rref_remote and __rref_call,
 * which run that function on the owner, so users get the same dispatch through remote() and
 * proxies as through rpc). */
#define TD__RPC_INLINE_LIKE_ARG1 0x100u

struct td_rpc_ctx {
  td_rpc_agent *agent;
  int caller_rank;
  const char *caller_name;
  void *user_data;
  const char *fn;
  uint64_t ctx_id; /* distributed autograd context id carried by the request */
  uint64_t deadline_ns; /* the caller's deadline (td__now_ns clock; 0: none) */
  td__conn *conn;       /* the caller's stream (NULL: a call to self) */
};

/* td__rpc_register_internal registers a reserved "__name" function (idempotent for the same fn). */
td_status td__rpc_register_internal(const char *name, td_rpc_fn fn, void *user_data);
/* td_rpc_async whose CUDA tensors follow the map used for replies to `to` (the inverse of its map
 * toward us) instead of our own map toward it: for data that travels back along the path of a
 * request `to` sent us (distributed autograd's gradients of received arguments). */
td_status td__rpc_async_reply_map(td_rpc_agent *a, const char *to, const char *fn,
                                  td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                                  td_future **out);
/* ... with td_rpc_register_ex's flags (TD_RPC_INLINE: runs on the network thread). */
td_status td__rpc_register_internal_ex(const char *name, td_rpc_fn fn, void *user_data,
                                       unsigned flags);
/* td__rpc_lookup copies the registration of name into *out (TD_ERR_NOT_FOUND when absent; no
 * message set). Used by upper layers that run registered functions themselves (RRef proxies). */
td_status td__rpc_lookup(const char *name, td__reg *out);

/* Process-wide hooks that upper layers install (called with the agent at init and shutdown). */
typedef struct td__agent_hooks {
  void (*on_init)(td_rpc_agent *a);
  /* Before the transport stops, after the barrier; graceful is true when the barrier passed. An
   * error (with td_set_error) becomes td_rpc_shutdown's result when nothing else failed. */
  td_status (*on_shutdown)(td_rpc_agent *a, bool graceful);
} td__agent_hooks;
td_status td__agent_add_hooks(const td__agent_hooks *h);

/* Message middleware: one upper layer (distributed autograd) sees every request and response
 * that carries values, on both ends, including internal "__" calls and calls to self.
 * - on_send(a, peer, m): before m is encoded (peer == own rank for calls to self, whose values are
 *   shared, not copied), on the sending thread. For a request m->ctx_id is 0 on entry; for a
 *   response it is the request's. It may set m->ctx_id, m->autograd_msg_id and m->aux / m->naux
 *   (td__malloc'd; the agent frees it). An error fails the call (requests) or replaces the
 *   response with that error.
 * - on_recv(a, peer, m): for a request on the pool thread before the handler; for a response on
 *   the poller thread before the caller's future completes (must not block). It may replace
 *   tensors inside m->values (td__value_map_tensors). An error is the call's outcome.
 * - enter / leave: around the handler of a request, on the pool thread; scope is caller storage.
 * Registered once per process (a second different registration is TD_ERR_EXISTS). */
typedef struct td__mw_scope {
  void *prev, *cur;
} td__mw_scope;
typedef struct td__rpc_middleware {
  td_status (*on_send)(td_rpc_agent *a, int peer, td__msg *m);
  td_status (*on_recv)(td_rpc_agent *a, int peer, td__msg *m);
  void (*enter)(td_rpc_agent *a, const td__msg *m, td__mw_scope *scope);
  void (*leave)(td__mw_scope *scope);
} td__rpc_middleware;
td_status td__rpc_set_middleware(const td__rpc_middleware *mw);
/* td__rpc_enter_ctx / td__rpc_leave_ctx: the middleware's enter / leave for work that runs a
 * request's function later, on another thread (the RRef layer's remote() and proxy calls whose
 * arguments or target were not ready yet), so it runs inside the request's distributed autograd
 * context (ctx_id 0: nothing). */
void td__rpc_enter_ctx(td_rpc_agent *a, uint64_t ctx_id, const char *fn, td__mw_scope *scope);
void td__rpc_leave_ctx(td_rpc_agent *a, uint64_t ctx_id, td__mw_scope *scope);

/* An argument gate (set by the RRef layer) runs before a user function: it returns in *wait (new
 * reference) a future that completes when the arguments are ready to use - every RRef among them
 * confirmed by its owner - or NULL when they are already. The request then waits for it off the
 * pool's threads and runs afterwards; a failed future fails the request with its message. */
typedef td_status (*td__arg_gate_fn)(td_rpc_agent *a, td_value *const *args, int nargs,
                                     td_future **wait);
void td__rpc_set_arg_gate(td__arg_gate_fn fn);
td__arg_gate_fn td__rpc_arg_gate(void);

/* The agent's thread pool (to schedule work off the poller thread). */
td__threadpool *td__agent_pool(td_rpc_agent *a);
/* td__agent_submit_user schedules work that runs user code (a registered function, a user's
 * future callbacks): on the pool, or - host-driven progress (rpc/progress.c) - on the host's
 * progress thread. Same contract as td__threadpool_submit. */
td_status td__agent_submit_user(td_rpc_agent *a, td__task_fn fn, void *arg);

/* td__agent_store returns the agent's client of the rendezvous store (collectives use it to set
 * up process groups). Borrowed; valid until td_rpc_destroy. The store operations may be called
 * from any thread; after td_rpc_shutdown rank 0's store may be gone (calls then fail). */
const td__store_client *td__agent_store(td_rpc_agent *a);
/* td__agent_listen_addr returns the address the agent's server listens on (chosen at init unless
 * set: TD_SOCKET_IFNAME, else the route toward the master, else loopback). Borrowed; valid until td_rpc_destroy. */
const char *td__agent_listen_addr(td_rpc_agent *a);

/* td__agent_auth returns the agent's group authentication (auth.h: the key derived from the job
 * secret, or insecure mode). Borrowed; immutable; valid until td_rpc_destroy. */
const struct td__auth *td__agent_auth(td_rpc_agent *a);
/* td__agent_tls: the agent's gRPC connections run mutual TLS (upper layers with connections of
 * their own, the collectives' ring, encrypt theirs then). */
bool td__agent_tls(td_rpc_agent *a);
/* td__agent_count_refused adds one to the agent's refused connections (td_rpc_stats): upper
 * layers with connections of their own (the collectives' ring) count the strangers they drop. */
void td__agent_count_refused(td_rpc_agent *a);

/* td__call_opts_timeout reads the timeout of call options (NULL: TD_TIMEOUT_DEFAULT) into *out;
 * TD_ERR_INVALID naming `who` when opts was not filled by TD_RPC_CALL_OPTS_INIT (its magic), so
 * every function that takes td_rpc_call_opts refuses a zeroed struct the same way, before it
 * sends anything. */
td_status td__call_opts_timeout(const td_rpc_call_opts *opts, const char *who,
                                td_timeout_ms *out);

/* The agent's init proper; the public td_rpc_init / td_rpc_init_from_env (runtime/init.c) first
 * register every upper layer, then call these. */
td_status td__rpc_init_impl(const char *name, int rank, int world_size, const td_rpc_options *opts,
                            td_rpc_agent **out);
td_status td__rpc_init_from_env_impl(const char *name, const td_rpc_options *opts,
                                     td_rpc_agent **out);

#endif
