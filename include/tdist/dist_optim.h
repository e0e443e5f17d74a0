/* dist_optim.h - the distributed optimizer (torch.distributed.optim.DistributedOptimizer).
 *
 * Parameters are referenced by RRefs whose value, on the owner, is the parameter tensor itself
 * (td_dist_module_parameter_rrefs makes them for every parameter of a module held in an RRef; on
 * the owner, td_rref_create_local(a, td_value_tensor(param)) makes one directly).
 * td_dist_optimizer_create groups the parameters by owner and creates one functional optimizer
 * (optim.h) per owner, remotely, held there as an opaque object behind an RRef.
 * td_dist_optimizer_step sends every owner the context's id; each owner steps its optimizer with
 * the gradients its part of that distributed autograd context accumulated (parameters without a
 * gradient in the context are left alone, their state does not advance). Steps of one owner's
 * optimizer are serialised, so several trainers may step concurrently.
 *
 * td_rpc_init registers this layer's internal RPC functions (and the "nn.Module" object type) on
 * every worker, so owners of parameters need nothing more.
 *
 * THREAD SAFETY: any thread; calls that block say so. A td_dist_optimizer may be stepped from
 * several threads at once (each with its own context).
 *
 * Timeouts: a blocking call here without a timeout argument bounds each RPC it makes by the
 * agent's rpc timeout (TD_TIMEOUT_DEFAULT in tdist/timeout.h: td_rpc_options.rpc_timeout_ms,
 * td_rpc_set_default_timeout).
 */
#ifndef TDIST_DIST_OPTIM_H
#define TDIST_DIST_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "tdist/dist_autograd.h"
#include "tdist/optim.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"
#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_dist_optimizer td_dist_optimizer;

/* td_dist_optimizer_create makes a distributed optimizer of kind opts->kind with opts's
 * hyper-parameters (see td_optim_options_init) over params[0..n) (RRefs to parameter tensors; a
 * parameter may be owned by any worker, this one included). Blocks until every owner has created
 * its optimizer (bounded by the agent's rpc timeout); an owner's failure (invalid options, an
 * RRef whose value is not a float tensor, duplicates) is returned naming that owner. Takes a
 * reference to each RRef. *out: release with td_dist_optimizer_destroy(). */
TD_API td_status td_dist_optimizer_create(td_rpc_agent *a, const td_optim_options *opts,
                                          td_rref *const *params, size_t n,
                                          td_dist_optimizer **out);

/* td_dist_optimizer_step steps every owner's optimizer concurrently with the gradients of ctx
 * (the owners look the context up by id; an owner that never took part in ctx has no gradients
 * and leaves its parameters alone). Blocks until all owners finished; returns the first failure,
 * with td_last_error() naming the owner. */
TD_API td_status td_dist_optimizer_step(td_dist_optimizer *o, td_dist_autograd_context *ctx);

/* td_dist_optimizer_set_lr changes the learning rate of every owner's optimizer for later steps
 * (learning-rate schedules). Blocks until every owner applied it; TD_ERR_INVALID for a negative
 * or non-finite lr (nothing changed then). */
TD_API td_status td_dist_optimizer_set_lr(td_dist_optimizer *o, double lr);

/* td_dist_optimizer_num_owners returns how many workers own parameters of o. */
TD_API int td_dist_optimizer_num_owners(const td_dist_optimizer *o);

/* td_dist_optimizer_destroy releases the remote optimizers (asynchronously, through their RRefs)
 * and the parameter RRefs. NULL does nothing. Must not run concurrently with a step. */
TD_API void td_dist_optimizer_destroy(td_dist_optimizer *o);

/* td_dist_module_parameter_rrefs returns in *out (new reference) a list value of RRefs, one per
 * parameter of the module held by module_rref (a value of object type "nn.Module"), in
 * td_module_parameters order; each RRef's value on the owner is the parameter tensor itself.
 * Blocks until the timeout (tdist/timeout.h; TD_TIMEOUT_DEFAULT: the agent's rpc timeout). */
TD_API td_status td_dist_module_parameter_rrefs(td_rref *module_rref, td_timeout_ms timeout,
                                                td_value **out);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_DIST_OPTIM_H */
