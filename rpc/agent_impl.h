/* agent_impl.h - internals of the RPC agent shared by agent.c and the upper layers' hooks. */
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
} td__reg;

struct td_rpc_ctx {
  td_rpc_agent *agent;
  int caller_rank;
  const char *caller_name;
  void *user_data;
  const char *fn;
  uint64_t ctx_id; /* distributed autograd context id carried by the request */
};

/* td__rpc_register_internal registers a reserved "__name" function (idempotent for the same fn). */
td_status td__rpc_register_internal(const char *name, td_rpc_fn fn, void *user_data);
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

/* The agent's thread pool (to schedule work off the poller thread). */
td__threadpool *td__agent_pool(td_rpc_agent *a);

#endif
