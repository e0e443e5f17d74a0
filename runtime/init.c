/* init.c - the top of the layer stack: tdist's public entry points that need every layer.
 *
 * Upper layers (RRefs, distributed autograd, the distributed optimizer) register themselves with
 * the RPC agent: value types, internal "__" functions, middleware, hooks. Each layer also does
 * this from a constructor when the shared library loads, but a program linked against the static
 * library only gets the object files it references, so a worker that merely serves RRefs or
 * optimizer steps would lack them. td_rpc_init lives here, above every layer, and calls each
 * layer's (idempotent) registration before starting the agent, which pulls them all in.
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
