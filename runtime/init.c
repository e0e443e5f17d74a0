/* init.c - the top of the layer stack: tdist's public entry points that need every layer.
 *
 * Upper layers (RRefs, distributed autograd, the distributed optimizer, remote modules) register
 * themselves with the RPC agent: value types, object types, internal "__" functions, middleware,
 * hooks. This is their only registration path: td_rpc_init lives here, above every layer, and
 * calls each layer's (idempotent) registration, in dependency order, before starting the agent.
 * Referencing td_rpc_init pulls every layer out of the static library, and nothing runs at load
 * time (no constructors: a program that dlopen()s tdist gets no hidden side effects).
 */
#include "../rpc/agent_impl.h"
#include "layers.h"

static void register_layers(void) {
  td__rref_layer_init();
  td__dist_autograd_layer_init();
  td__dist_optim_layer_init();
  td__remote_layer_init();
}

td_status td_rpc_init(const char *name, int rank, int world_size, const td_rpc_options *opts,
                      td_rpc_agent **out) {
  register_layers();
  return td__rpc_init_impl(name, rank, world_size, opts, out);
}

td_status td_rpc_init_from_env(const char *name, const td_rpc_options *opts, td_rpc_agent **out) {
  register_layers();
  return td__rpc_init_from_env_impl(name, opts, out);
}
