/* value_impl.h - internals of td_value shared by the rpc files (never installed).
 *
 * Extension values: an upper layer (RRefs, worker infos) registers a td__value_ext_type and wraps
 * its objects with td__value_ext(). The wire codec sends an extension value as its type name plus
 * a plain value tree produced by to_wire() and rebuilds it on the receiver with from_wire(); both
 * get the codec's context (which agent, which peer) so an RRef can record forks.
 */
#ifndef TD_RPC_VALUE_IMPL_H
#define TD_RPC_VALUE_IMPL_H

#include "../core/core.h"
#include "tdist/rpc.h"

typedef struct td__wire_ctx td__wire_ctx; /* defined by the codec: agent, peer rank, direction */

typedef struct td__value_ext_type {
  const char *name; /* unique, travels on the wire */
  /* Frees obj when the last value holding it goes. */
  void (*destroy)(void *obj);
  /* Produces the plain (extension-free) value tree sent for obj (new reference). */
  td_status (*to_wire)(void *obj, td__wire_ctx *ctx, td_value **out);
  /* Rebuilds an object from the plain tree received. */
  td_status (*from_wire)(const td_value *repr, td__wire_ctx *ctx, void **obj);
  /* Optional: structural equality (default: same object). */
  bool (*equal)(const void *a, const void *b);
  /* Optional: short description for td_value_to_string (default: the type name). */
  void (*describe)(const void *obj, char *buf, size_t n);
} td__value_ext_type;

/* td__value_ext wraps obj (ownership passes to the value; destroy runs with the last reference;
 * on NULL return - out of memory - destroy(obj) has already run). */
td_value *td__value_ext(const td__value_ext_type *type, void *obj);
/* For an extension value: its type and object (borrowed); NULL otherwise. */
const td__value_ext_type *td__value_ext_type_of(const td_value *v);
void *td__value_ext_obj(const td_value *v);

/* Registry used by the decoder to find a type by name. Registering the same pointer twice is a
 * no-op; another type with the same name is TD_ERR_EXISTS. */
td_status td__value_ext_register(const td__value_ext_type *type);
const td__value_ext_type *td__value_ext_find(const char *name);

/* td__value_walk_tensors calls fn for every tensor in the tree in depth-first order (list order,
 * dict insertion order). Used by the codec and by distributed autograd. */
typedef td_status (*td__tensor_visit_fn)(void *ctx, td_tensor *t);
td_status td__value_walk_tensors(const td_value *v, td__tensor_visit_fn fn, void *ctx);

/* td__value_map_tensors replaces tensors of a tree in place, in the order of
 * td__value_walk_tensors: fn(ctx, t, &repl) may store a new reference in repl (the value then
 * holds repl instead of t) or leave it NULL. Only for trees nobody else can see yet (a message
 * just decoded): values are otherwise immutable. Used by distributed autograd to make received
 * tensors the outputs of recv functions. */
typedef td_status (*td__tensor_map_fn)(void *ctx, td_tensor *t, td_tensor **repl);
td_status td__value_map_tensors(td_value *v, td__tensor_map_fn fn, void *ctx);

#endif
