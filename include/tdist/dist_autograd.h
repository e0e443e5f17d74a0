/* dist_autograd.h - distributed autograd: backward passes that follow tensors across RPCs
 * (torch.distributed.autograd, FAST mode).
 *
 * A context (td_dist_autograd_context_begin) records, for one training step, every RPC, remote()
 * and to_here() whose values carry tensors that require grad. The sender keeps a "send function"
 * (an autograd node with edges to those tensors' graphs) and the receiver makes the received
 * tensors the outputs of a "recv function", both under the same autograd message id, for
 * arguments and results alike. The context is current on the thread that began it and on the
 * threads serving requests made inside it (nested calls propagate it), so user code never passes
 * context ids around.
 *
 * td_dist_autograd_backward() runs the local graph from the roots; every recv function it reaches
 * sends its gradients to the worker that sent the tensor, which continues from the matching send
 * function in the same context, and so on across any number of hops. It returns when every
 * worker's part has finished. Leaf gradients accumulate in the context (on every worker), never
 * in `.grad`; td_dist_autograd_get_gradients() reads them, and the distributed optimizer
 * (dist_optim.h) steps with them.
 *
 * Ending a context on its creator frees it on every worker that took part, including workers
 * reached only through nested calls (each worker forwards the cleanup to the workers it talked
 * to). Design notes: docs/ARCHITECTURE.md, "Distributed autograd".
 *
 * THREAD SAFETY: one current context per thread. Any thread may begin its own context; several
 * contexts may run backward passes at once over the same parameters (their gradients stay apart).
 * Functions that block say so.
 *
 * Timeouts: a blocking call here without a timeout argument bounds each RPC it makes by the
 * agent's rpc timeout (TD_TIMEOUT_DEFAULT in tdist/timeout.h: td_rpc_options.rpc_timeout_ms,
 * td_rpc_set_default_timeout).
 */
#ifndef TDIST_DIST_AUTOGRAD_H
#define TDIST_DIST_AUTOGRAD_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/autograd.h"
#include "tdist/rpc.h"
#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_dist_autograd_context td_dist_autograd_context;

/* Context ids: (creating worker's rank << 48) | counter. */
typedef struct td_dist_autograd_context_id {
  uint64_t v;
} td_dist_autograd_context_id;

/* td_dist_autograd_context_begin creates a context on this worker and makes it current on the
 * calling thread. TD_ERR_STATE when the thread already has a current context, or the agent has
 * shut down. *out: new reference; end it with td_dist_autograd_context_end() (which also releases
 * the reference). Does not block. */
TD_API td_status td_dist_autograd_context_begin(td_rpc_agent *a, td_dist_autograd_context **out);

/* td_dist_autograd_context_end ends ctx (which must have been created on this worker,
 * TD_ERR_STATE otherwise): it stops being current on this thread, is freed here, and a cleanup
 * goes to every worker that took part, each of which frees its part and forwards the cleanup to
 * the workers it talked to. Blocks until the whole tree acknowledged (bounded by the agent's
 * rpc timeout per hop); an unreachable worker is reported naming it, the context is gone
 * here either way. Always releases the caller's reference. NULL does nothing. */
TD_API td_status td_dist_autograd_context_end(td_dist_autograd_context *ctx);

/* td_dist_autograd_context_end_async is td_dist_autograd_context_end without waiting: *out (new
 * reference; may be NULL for fire-and-forget, as PyTorch's context exit does) completes once every
 * worker acknowledged the cleanup, or fails naming the one that could not be reached. Does not
 * block; always releases the caller's reference to ctx. */
TD_API td_status td_dist_autograd_context_end_async(td_dist_autograd_context *ctx,
                                                   td_future **out);

/* td_dist_autograd_current returns this thread's current context, or NULL. Borrowed; valid until
 * the context ends (on the creator) or the request being served returns (elsewhere). */
TD_API td_dist_autograd_context *td_dist_autograd_current(void);

/* td_dist_autograd_set_current makes ctx (may be NULL) current on the calling thread and returns
 * the previous one, for code that continues a context on another thread (restore the previous
 * one when done). Borrowed: the caller keeps ctx alive while it is current. */
TD_API td_dist_autograd_context *td_dist_autograd_set_current(td_dist_autograd_context *ctx);

/* td_dist_autograd_context_retrieve finds the context with id on this worker (e.g. in a function
 * that received a context id). TD_ERR_NOT_FOUND naming the id when this worker has no such
 * context. *out: new reference; release with td_dist_autograd_context_unref(). */
TD_API td_status td_dist_autograd_context_retrieve(td_rpc_agent *a, td_dist_autograd_context_id id,
                                                   td_dist_autograd_context **out);
TD_API td_dist_autograd_context *td_dist_autograd_context_ref(td_dist_autograd_context *ctx);
/* td_dist_autograd_context_unref drops a reference (it does not end the context). NULL does
 * nothing. */
TD_API void td_dist_autograd_context_unref(td_dist_autograd_context *ctx);

/* td_dist_autograd_context_get_id returns ctx's id ({0} for NULL). */
TD_API td_dist_autograd_context_id td_dist_autograd_context_get_id(const td_dist_autograd_context *ctx);

/* td_dist_autograd_backward differentiates the local scalar roots[0..n) within ctx (each with
 * gradient 1) across every worker their graphs reach through recv functions. With retain_graph the
 * graph (here and on the other workers) can be differentiated again, and gradients add up.
 * Blocks until every worker's part has finished (each RPC bounded by the agent's rpc
 * timeout). A failure anywhere is returned with td_last_error() naming the worker where it
 * happened, after the other parts finished. Must not be called from a future callback. */
TD_API td_status td_dist_autograd_backward(td_dist_autograd_context *ctx, td_tensor *const *roots,
                                           int n, bool retain_graph);

/* td_dist_autograd_backward_async is td_dist_autograd_backward without waiting for the other
 * workers: it checks the arguments and runs the local part of the pass on the calling thread (the
 * engine over this worker's graph, which sends the gradients of every recv function it reaches),
 * then returns with *out (new reference) completing with none once every worker's part has
 * finished, or failing with the first error, whose message names the worker where it happened
 * ("dist_autograd_backward: worker1 (rank 1): ..."), after the other parts finished. Argument
 * errors (the same as the sync call's) are returned at once and start nothing. Meanwhile the
 * caller may make other calls, also in ctx (e.g. the next forward), and may wait on *out with any
 * timeout; each RPC of the pass is bounded by the agent's rpc timeout, so *out always completes.
 * Must not be called from a future callback (the local part runs the engine on this thread). */
TD_API td_status td_dist_autograd_backward_async(td_dist_autograd_context *ctx,
                                                 td_tensor *const *roots, int n,
                                                 bool retain_graph, td_future **out);

/* td_dist_autograd_get_gradients returns in *out a new map (a copy) from each leaf tensor of this
 * worker that received a gradient in ctx to that gradient; look gradients up with
 * td_grad_map_get() and release the map with td_grad_map_destroy(). */
TD_API td_status td_dist_autograd_get_gradients(td_dist_autograd_context *ctx, td_grad_map **out);

/* td_dist_autograd_context_grad_map returns the context's own gradient map. Borrowed; valid while
 * the caller holds ctx. Modifying it (td_grad_map_clear) affects the context. */
TD_API td_grad_map *td_dist_autograd_context_grad_map(td_dist_autograd_context *ctx);

/* Counters for tests and debugging. */
typedef struct td_dist_autograd_debug_info {
  int64_t num_contexts;        /* live contexts on this worker */
  int64_t num_backward_passes; /* backward passes running here (roots and forwarded parts) */
  int64_t num_send_functions;  /* send functions held by the live contexts */
} td_dist_autograd_debug_info;

/* td_dist_autograd_get_debug_info fills *out for agent a. */
TD_API td_status td_dist_autograd_get_debug_info(td_rpc_agent *a, td_dist_autograd_debug_info *out);

/* td_dist_autograd_set_strict (process-wide; also TD_DIST_AUTOGRAD_STRICT=1): a graceful
 * td_rpc_shutdown that finds contexts still alive on this worker (never ended by their creator)
 * frees them as always but returns TD_ERR_STATE naming them, instead of only logging a warning.
 * Tests use it to catch leaked contexts. */
TD_API void td_dist_autograd_set_strict(bool on);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_DIST_AUTOGRAD_H */
