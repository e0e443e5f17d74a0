/* autograd.h - local reverse-mode automatic differentiation.
 *
 * Ops on tensors that require grad record backward nodes (td_node). td_autograd_backward() walks
 * the graph from its roots with dependency counting and accumulates leaf gradients into each
 * leaf's `.grad` or, when the options name a td_grad_map, into that map instead (the distributed
 * autograd layer keeps per-context gradients this way). Without retain_graph, each node frees its
 * saved tensors after it ran, and a second backward through it fails with TD_ERR_STATE.
 *
 * Extension points for the distributed layer: external nodes whose backward is a caller-supplied
 * function (a "recv" node sends its gradients to another worker), td_autograd_attach() to make a
 * received tensor the output of such a node, and td_autograd_backward_node() to continue a
 * backward pass from a node with gradients that arrived from elsewhere.
 *
 * Activation checkpointing (td_checkpoint): a function run without recording in forward, kept as
 * its inputs only, and run again with recording in backward (a nested backward pass through the
 * recomputed graph, which inherits the outer pass's gradient map).
 *
 * THREAD SAFETY: grad mode is per thread. Several threads may run backward passes at once over
 * graphs that share leaf tensors: accumulation into a leaf's `.grad` and into a td_grad_map is
 * serialised per tensor / per map. Two concurrent passes through the same non-leaf nodes need
 * retain_graph on both.
 */
#ifndef TDIST_AUTOGRAD_H
#define TDIST_AUTOGRAD_H

#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_node td_node;
typedef struct td_grad_map td_grad_map;

/* ---- per-tensor state ---- */

TD_API bool td_tensor_requires_grad(const td_tensor *t);
/* td_tensor_set_requires_grad marks a leaf (a tensor with no grad_fn) as requiring grad; float
 * dtypes only. TD_ERR_STATE on a non-leaf. */
TD_API td_status td_tensor_set_requires_grad(td_tensor *t, bool requires_grad);
/* td_tensor_is_leaf returns true when t has no grad_fn. */
TD_API bool td_tensor_is_leaf(const td_tensor *t);
/* td_tensor_grad returns the accumulated gradient of a leaf, or NULL when none. Returns a new
 * reference; release with td_tensor_unref(). */
TD_API td_tensor *td_tensor_grad(const td_tensor *t);
/* td_tensor_set_grad replaces t's gradient (NULL clears it, like optimizer.zero_grad(set_to_none)).
 * Takes a new reference to grad. */
TD_API td_status td_tensor_set_grad(td_tensor *t, td_tensor *grad);
/* td_tensor_grad_fn returns the node that produced t, or NULL for a leaf. Borrowed; valid while t
 * lives. */
TD_API td_node *td_tensor_grad_fn(const td_tensor *t);
/* td_tensor_output_nr returns which output of its grad_fn t is (0 for leaves). */
TD_API int td_tensor_output_nr(const td_tensor *t);

/* ---- grad mode ---- */

/* td_autograd_is_enabled returns whether ops on this thread record history (default true). */
TD_API bool td_autograd_is_enabled(void);
/* td_autograd_set_enabled sets this thread's grad mode and returns the previous one, so a no-grad
 * scope is `bool prev = td_autograd_set_enabled(false); ...; td_autograd_set_enabled(prev);`. */
TD_API bool td_autograd_set_enabled(bool enabled);

/* ---- gradient maps ---- */

/* td_grad_map_create makes an empty thread-safe map tensor -> accumulated gradient. It holds a
 * reference to each key tensor and to each gradient. Release with td_grad_map_destroy(). */
TD_API td_status td_grad_map_create(td_grad_map **out);
TD_API void td_grad_map_destroy(td_grad_map *m);
/* td_grad_map_accumulate adds grad into the entry of t (creating it with a copy of grad). */
TD_API td_status td_grad_map_accumulate(td_grad_map *m, td_tensor *t, const td_tensor *grad);
/* td_grad_map_get returns the gradient accumulated for t, or NULL. Returns a new reference. */
TD_API td_tensor *td_grad_map_get(td_grad_map *m, const td_tensor *t);
/* td_grad_map_size returns the number of entries. */
TD_API size_t td_grad_map_size(td_grad_map *m);
/* td_grad_map_foreach calls fn(ctx, tensor, grad) for every entry (borrowed references, valid
 * during the call) under the map's lock; fn must not touch the map. Stops early and returns fn's
 * status when it is not TD_OK. */
typedef td_status (*td_grad_map_fn)(void *ctx, td_tensor *t, td_tensor *grad);
TD_API td_status td_grad_map_foreach(td_grad_map *m, td_grad_map_fn fn, void *ctx);
/* td_grad_map_clear removes every entry. */
TD_API void td_grad_map_clear(td_grad_map *m);

/* ---- backward ---- */

typedef struct td_backward_opts {
  /* Keep saved tensors so the graph can be differentiated again. Default false. */
  bool retain_graph;
  /* When not NULL, leaf gradients accumulate here instead of into `.grad`. Default NULL. */
  td_grad_map *grad_map;
} td_backward_opts;

/* td_autograd_backward differentiates roots[0..n) given their incoming gradients grad_roots (same
 * shapes; grad_roots may be NULL, or hold NULL entries, for scalar roots, meaning 1). opts may be
 * NULL for the defaults. Blocks until the pass finished. Errors from any node are returned with
 * the node named in td_last_error(). */
TD_API td_status td_autograd_backward(td_tensor *const *roots, td_tensor *const *grad_roots, int n,
                                      const td_backward_opts *opts);
/* td_tensor_backward is td_autograd_backward on one scalar root with default options. */
TD_API td_status td_tensor_backward(td_tensor *root);

/* td_autograd_backward_node continues a backward pass from node, given the gradients of its
 * n_outputs outputs (NULL entries mean zero). Used by distributed autograd to resume from a send
 * node when gradients arrive from another worker. */
TD_API td_status td_autograd_backward_node(td_node *node, td_tensor *const *grad_outputs, int n,
                                           const td_backward_opts *opts);

/* ---- nodes ---- */

TD_API td_node *td_node_ref(td_node *n);
TD_API void td_node_unref(td_node *n);
/* td_node_name returns the node's name ("MulBackward", "AccumulateGrad", ...). Never NULL. */
TD_API const char *td_node_name(const td_node *n);
/* td_node_num_inputs returns how many next edges the node has (forward inputs). */
TD_API int td_node_num_inputs(const td_node *n);
/* td_node_next returns the node that receives the gradient of input i (NULL when that input does
 * not need a gradient). Borrowed. */
TD_API td_node *td_node_next(const td_node *n, int i);

/* td_external_backward_fn computes an external node's input gradients. grad_outputs has
 * n_outputs entries (NULL means zero); it must store a new reference (or NULL) in each of
 * grad_inputs[0..n_inputs). It runs on the thread running the backward pass. */
typedef td_status (*td_external_backward_fn)(void *ctx, td_tensor *const *grad_outputs,
                                             int n_outputs, td_tensor **grad_inputs,
                                             int n_inputs);

/* td_node_create_external makes a node with n_outputs outputs whose backward is fn(ctx, ...), and
 * one next edge per tensor of inputs[0..n_inputs) (an input that does not require grad gets no
 * edge). destroy(ctx) runs once when the node dies (also when this call fails). Returns a new
 * reference; release with td_node_unref(). */
TD_API td_status td_node_create_external(const char *name, int n_outputs,
                                         td_tensor *const *inputs, int n_inputs,
                                         td_external_backward_fn fn, void *ctx,
                                         void (*destroy)(void *ctx), td_node **out);

/* td_autograd_attach returns a view of t whose grad_fn is node (output output_nr): gradients that
 * reach the view are handed to node's backward. t must not require grad itself. */
TD_API td_status td_autograd_attach(const td_tensor *t, td_node *node, int output_nr,
                                    td_tensor **out);

/* ---- hooks ---- */

/* td_grad_hook_fn sees a gradient about to flow into t (for a leaf: about to be accumulated). It
 * may store a new reference in *replacement to replace the gradient, or leave it NULL. */
typedef td_status (*td_grad_hook_fn)(void *ctx, const td_tensor *grad, td_tensor **replacement);

/* td_tensor_register_hook adds a hook to t (a leaf, or a non-leaf whose grad_fn then calls it);
 * *handle identifies it for td_tensor_remove_hook(). Hooks run in registration order. */
TD_API td_status td_tensor_register_hook(td_tensor *t, td_grad_hook_fn fn, void *ctx, int *handle);
TD_API td_status td_tensor_remove_hook(td_tensor *t, int handle);

/* ---- activation checkpointing (torch.utils.checkpoint) ---- */

/* td_checkpoint_fn computes outputs[0..n_outputs) from inputs[0..n_inputs) (entries may be NULL
 * where the caller passes NULL). It must store a new reference in every output on TD_OK. It runs
 * twice: once in forward with grad mode off, and again in backward with grad mode on (the
 * recompute); both runs must compute the same thing (same shapes, same ops, same generators). */
typedef td_status (*td_checkpoint_fn)(void *ctx, td_tensor *const *inputs, int n_inputs,
                                      td_tensor **outputs, int n_outputs);

/* Options of td_checkpoint; zero them (or pass NULL) for the defaults. */
typedef struct td_checkpoint_opts {
  /* Names the region in its node ("CheckpointBackward"), in errors and for
   * td_checkpoint_current(). Copied. Default NULL: "checkpoint". */
  const char *name;
  /* The function reads leaves that require grad besides its inputs (a module's parameters):
   * record the node even when no input requires grad, so those leaves get their gradients.
   * Default false: as torch.utils.checkpoint, outputs require grad only when an input does. */
  bool reads_params;
  /* Called once with ctx when nothing needs it any more: when the node dies, at return when no
   * node was recorded, or when the call fails. Default NULL: ctx outlives the backward. */
  void (*release)(void *ctx);
} td_checkpoint_opts;

/* td_checkpoint runs fn(ctx, inputs, ...) with grad mode off and keeps only what it needs to run
 * it again: detached views of the inputs (sharing their storage: no copy; they must not be
 * modified in place before backward) and the states of the generators fn drew from. The float
 * outputs become outputs of one node, "CheckpointBackward", whose edges are the inputs that
 * require grad. Its backward re-runs fn with grad mode on over detached inputs, with each
 * generator set back to the state it had when fn first drew from it (td_tensor_dropout and the
 * random fills record this; draws made directly with td_generator_next_* are not seen), then
 * backpropagates the outputs' incoming gradients through that recomputed graph and returns the
 * inputs' gradients; afterwards each generator gets back the state it had before the recompute.
 * Leaves that fn reads (parameters) accumulate during that inner pass as in any backward (their
 * hooks run then: DDP and ZeRO see each gradient once), into `.grad`, or into the grad_map of
 * the backward pass running the node (a distributed autograd context's), which the inner pass
 * inherits. Outputs that received no gradient are not backpropagated. The result is the
 * gradient of the same computation without checkpointing, bit for bit when every use of each
 * input is inside the region (a GPT block's input; otherwise its partial gradients are added in
 * another order: equal up to rounding). Differences: an input fn does not use gets a zero
 * gradient rather than none (the node has an edge to it); a leaf read inside the region and also
 * outside it (or in two regions) gets its gradient in two parts, so its hooks run twice in one
 * backward (as with PyTorch's reentrant checkpoint).
 * Nothing is checkpointed when grad mode is off, or when no input requires grad and
 * opts->reads_params is false: fn then runs once, directly (recording as usual when grad mode is
 * on), with ctx released at return. While fn runs (forward or recompute)
 * RPCs from this thread are refused (TD_ERR_STATE naming the region: a recompute would repeat
 * them). Non-float outputs are returned as fn made them. On failure (fn's error prefixed with
 * the region's name, a NULL output, invalid arguments: TD_ERR_INVALID) outputs are untouched.
 * THREAD SAFETY: fn runs on the calling thread, the recompute on the thread running backward;
 * a generator fn uses must not be used by another thread during the recompute, and must outlive
 * the node. */
TD_API td_status td_checkpoint(td_checkpoint_fn fn, void *ctx, td_tensor *const *inputs,
                               int n_inputs, td_tensor **outputs, int n_outputs,
                               const td_checkpoint_opts *opts);

/* What the innermost checkpointed region on this thread is doing. */
typedef enum td_checkpoint_phase {
  TD_CHECKPOINT_PHASE_NONE = 0,  /* no checkpointed function runs on this thread */
  TD_CHECKPOINT_PHASE_FORWARD,   /* its first run, grad mode off */
  TD_CHECKPOINT_PHASE_RECOMPUTE, /* its run again in backward, grad mode on */
} td_checkpoint_phase;

/* td_checkpoint_current returns the phase of the innermost checkpointed region running on this
 * thread and, when name is not NULL, its name in *name (NULL when none; borrowed, valid while the
 * region runs). */
TD_API td_checkpoint_phase td_checkpoint_current(const char **name);
/* td_checkpoint_is_recomputing returns true while any enclosing checkpointed region on this
 * thread is being recomputed: the forward running now repeats one that already ran (module hooks
 * use it to skip work done once per step, e.g. ZeRO-3's prefetch of the next unit). */
TD_API bool td_checkpoint_is_recomputing(void);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_AUTOGRAD_H */
