/* remote_module.h - modules that live on another worker (torch.distributed.nn.RemoteModule) and a
 * pipeline driver that runs a batch through a chain of them as micro-batches (GPipe).
 *
 * A td_remote_module is this worker's handle to a module created on a worker named by a device
 * string ("worker1/cpu", "worker1/cuda:0", "rank:1/cpu") from a factory registered there with
 * td_module_factory_register (the factory receives the td_value given as args, or NULL). The
 * module itself is an "nn.Module" object behind an RRef (td_remote_module_rref): forward runs on
 * the owner through RRef proxies, so inside a distributed autograd context the call is recorded
 * and td_dist_autograd_backward reaches the remote parameters; td_remote_module_parameters gives
 * RRefs to them for td_dist_optimizer_create. Inputs of forward are tensors or RRefs to tensors
 * (fetched by the owner, not by the caller); they are moved to the module's device and the output
 * comes back on the CPU. The RRef can be sent to a third worker (td_value_rref), which makes its
 * own handle with td_remote_module_from_rref.
 *
 * The pipeline splits a batch along dim 0 into m micro-batches and sends each through the stages
 * with td_rref_remote: a stage's output stays on its worker as an RRef and the next stage fetches
 * it directly, so activations never pass through the driver; the driver fetches only the last
 * stage's outputs and concatenates them. Micro-batch i enters stage k as soon as stage k-1 has
 * produced it, so the stages work on different micro-batches at once (GPipe's forward schedule);
 * backward runs through distributed autograd in the caller's context. Schedules that interleave
 * forward and backward of micro-batches (1F1B, interleaved 1F1B) are in tdist/pipeline.h.
 *
 * td_rpc_init registers this layer's internal RPC functions on every worker, so any worker can
 * host a remote module.
 *
 * THREAD SAFETY: every function may be called from any thread except inside a future callback
 * (those that block say so). A handle may be used from several threads at once; destroy it when
 * no call is running.
 *
 * Timeouts: a blocking call here without a timeout argument bounds each RPC it makes by the
 * agent's rpc timeout (TD_TIMEOUT_DEFAULT in tdist/timeout.h: td_rpc_options.rpc_timeout_ms,
 * td_rpc_set_default_timeout).
 */
#ifndef TDIST_REMOTE_MODULE_H
#define TDIST_REMOTE_MODULE_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/nn.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A parsed remote device string "<worker>/<device>". */
typedef struct td_remote_device {
  char worker[128]; /* worker name; "" when given by rank */
  int rank;         /* rank for "rank:N/..."; -1 when given by name */
  td_device device; /* "cpu", "cuda" (index 0) or "cuda:N" */
} td_remote_device;

/* td_remote_device_parse parses text ("worker1/cpu", "trainer/cuda:0", "rank:2/cpu") into *out.
 * TD_ERR_INVALID with td_last_error() naming the string and the problem for anything else (no
 * '/', empty worker, "rank:" without a non-negative integer, unknown device). Does not block. */
TD_API td_status td_remote_device_parse(const char *text, td_remote_device *out);

typedef struct td_remote_module td_remote_module;

/* td_remote_module_create creates the module on the worker named by remote_device, with
 * td_module_factory_create(factory, args) there (args may be NULL; it is sent, so it must be
 * sendable) and moves it to the device. Blocks until the module exists (bounded by the agent's
 * rpc timeout). Errors: TD_ERR_INVALID for a malformed device string, TD_ERR_NOT_FOUND for an
 * unknown worker or rank, and the owner's error (unknown factory, unavailable device) naming the
 * worker. *out: release with td_remote_module_destroy(). */
TD_API td_status td_remote_module_create(td_rpc_agent *a, const char *remote_device,
                                         const char *factory, td_value *args,
                                         td_remote_module **out);

/* td_remote_module_from_rref makes a handle for the module held by module_rref (an RRef to an
 * "nn.Module" object, e.g. received from another worker). Blocks for one call to the owner (to
 * learn the device); TD_ERR_INVALID when the value is not a module. Takes a new reference to
 * module_rref. *out: release with td_remote_module_destroy(). */
TD_API td_status td_remote_module_from_rref(td_rpc_agent *a, td_rref *module_rref,
                                            td_remote_module **out);

/* td_remote_module_destroy releases the handle (and its reference to the module RRef; the module
 * goes when the last reference anywhere goes). NULL does nothing. Does not block. */
TD_API void td_remote_module_destroy(td_remote_module *rm);

/* td_remote_module_rref returns the RRef to the module. Borrowed; valid while rm lives. */
TD_API td_rref *td_remote_module_rref(const td_remote_module *rm);
/* td_remote_module_owner returns the owner's worker name. Borrowed; valid while rm lives. */
TD_API const char *td_remote_module_owner(const td_remote_module *rm);
/* td_remote_module_device returns the device the module lives on. */
TD_API td_device td_remote_module_device(const td_remote_module *rm);

/* td_remote_module_forward_async runs the module's forward on the owner with inputs
 * args[0..nargs) (each a tensor value or an RRef value to a tensor; borrowed) and returns at once
 * with a future (new reference) completing with the output tensor (CPU). Inside a distributed
 * autograd context the call is recorded. Does not block. */
TD_API td_status td_remote_module_forward_async(td_remote_module *rm, td_value *const *args,
                                                int nargs, td_future **out);
/* td_remote_module_forward is the one-tensor form, waiting for the result: *y gets the output
 * (new reference). Blocks (bounded by the agent's rpc timeout). */
TD_API td_status td_remote_module_forward(td_remote_module *rm, td_tensor *x, td_tensor **y);
/* td_remote_module_forward_remote runs forward on the owner and leaves the output there: *out
 * (new reference) is an RRef to it, which can be given to another module's forward. Does not
 * block. */
TD_API td_status td_remote_module_forward_remote(td_remote_module *rm, td_value *const *args,
                                                 int nargs, td_rref **out);

/* td_remote_module_train sets training (true) or evaluation (false) mode on the remote module.
 * Blocks. */
TD_API td_status td_remote_module_train(td_remote_module *rm, bool training);
/* td_remote_module_is_training asks the owner for the mode. Blocks. */
TD_API td_status td_remote_module_is_training(td_remote_module *rm, bool *training);

/* td_remote_module_parameters returns in *out (new reference) a list value of RRefs to the
 * module's parameters, in td_module_parameters order, for td_dist_optimizer_create. Blocks. */
TD_API td_status td_remote_module_parameters(td_remote_module *rm, td_value **out);

/* ---- pipeline ---- */

typedef struct td_pipeline td_pipeline;

/* td_pipeline_create makes a driver over stages[0..n) (n >= 1), applied in order; each stage's
 * output is the next one's input. Takes a reference to each stage's module RRef (the handles may
 * be destroyed afterwards). *out: release with td_pipeline_destroy(). */
TD_API td_status td_pipeline_create(td_rpc_agent *a, td_remote_module *const *stages, int n,
                                    td_pipeline **out);
/* td_pipeline_destroy releases the driver. NULL does nothing. */
TD_API void td_pipeline_destroy(td_pipeline *p);
/* td_pipeline_num_stages returns the number of stages. */
TD_API int td_pipeline_num_stages(const td_pipeline *p);

/* td_pipeline_forward runs x (a CPU tensor of at least one dim) through the stages as
 * micro_batches chunks along dim 0 (as torch.chunk: chunks of ceil(N / micro_batches) rows, the
 * last one smaller, fewer chunks when N is small) and returns the last stage's outputs
 * concatenated along dim 0 in *y (new reference). Every call is issued at once; the stages
 * overlap on different micro-batches. Inside a distributed autograd context the whole pass is
 * recorded, so td_dist_autograd_backward on a loss of *y reaches every stage's parameters.
 * TD_ERR_INVALID for micro_batches < 1; a stage's failure names its worker. Blocks (each fetch
 * bounded by the agent's rpc timeout). */
TD_API td_status td_pipeline_forward(td_pipeline *p, td_tensor *x, int micro_batches,
                                     td_tensor **y);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_REMOTE_MODULE_H */
