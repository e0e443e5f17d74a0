/* pipeline.h - pipeline-parallel training steps that schedule: GPipe, 1F1B (PipeDream-flush) and
 * interleaved 1F1B (Megatron-LM's virtual stages) over RemoteModules.
 *
 * A td_pipe_schedule runs one training step (forward and backward of every micro-batch) of a
 * model cut into chunks that live on other workers (RemoteModules, remote_module.h). Unlike
 * td_pipeline_forward, whose backward is one distributed autograd pass over the whole batch and
 * so cannot interleave forward and backward, the schedule runs each (micro-batch, chunk) forward
 * and backward as separate operations in an order it chooses:
 *
 * - Stages are worker-side objects: td_pipe_schedule_create makes one "stage" per worker holding
 *   that worker's chunks. A forward op F(i, c) runs chunk c on micro-batch i, keeping the input
 *   (made a leaf that requires grad) and the output; a backward op B(i, c) takes the gradient of
 *   that output, runs a local td_autograd_backward from it (parameter gradients accumulate into
 *   `.grad` of the chunk's parameters, over the micro-batches), frees what F kept and returns
 *   the input's gradient for the previous chunk. Plain local autograd: no distributed autograd
 *   context is involved, so nothing forces backward to wait for all forwards.
 * - Each worker runs its ops strictly in its schedule's order, one at a time: ops carry their
 *   index in the worker's order and the stage queues an op that arrives early until the op
 *   before it finished. So the schedule alone decides the order of F and B on each worker, and
 *   the peak of live activations follows from it (1F1B: at most p - s micro-batches on stage s;
 *   GPipe: m).
 * - The driver (the caller) issues an op as soon as its data dependency is there: F(i, c) needs
 *   the output of F(i, c-1); B(i, c) the input gradient of B(i, c+1); the last chunk's B needs its
 *   own F, which computed the micro-batch's loss. It may issue a worker's next op while the
 *   previous one runs (the stage queues it), so consecutive ops on one worker pay no round trip.
 * - Activations and gradients travel through the driver (a reply, then the next request). That
 *   costs one extra hop per dependency compared with sending stage to stage, but the driver then
 *   knows every op's state without further messages: it stops issuing at the first failure, tells
 *   every stage to drop its queue (__ps_abort) and returns the error, and it needs no channels
 *   between stages. For large activations on many hosts stage-to-stage sends would be cheaper.
 *
 * The loss is computed at the last chunk, per micro-batch, scaled so that the micro-batches'
 * losses add up to the loss of the whole batch: TD_PIPE_LOSS_MSE is F.mse_loss (the mean over all
 * elements of the batch of (y - target)^2); TD_PIPE_LOSS_SUM is the sum of the outputs divided by
 * the batch's rows (no target). The gradients in `.grad` are therefore those of the unpipelined
 * model on the whole batch.
 *
 * Schedules (p workers, m micro-batches, v chunks per worker; worker w holds chunks w, w + p, ...,
 * so chunk c runs on worker c mod p; stage s of GPipe/1F1B is worker s):
 * - GPIPE: every forward, then every backward. Live activations per worker: m.
 * - 1F1B: worker s runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
 *   backward, then drains the backwards. Live activations on worker s: min(p - s, m).
 * - INTERLEAVED_1F1B: Megatron-LM's schedule over v chunks per worker (forward chunk order groups
 *   of p micro-batches per chunk; (p - w - 1) * 2 + (v - 1) * p warm-up forwards on worker w, or
 *   all of them when m == p). Needs m divisible by p (TD_ERR_INVALID otherwise). The bubble shrinks
 *   from (p - 1) / m to (p - 1) / (v m) of the ideal time at the cost of more messages.
 * With m < p, GPipe and 1F1B run (with a large bubble); interleaved refuses it (m mod p != 0).
 *
 * THREAD SAFETY: a schedule may be used by one thread at a time; td_pipe_schedule_run and the
 * other calls block and must not be called from a future callback. Several schedules over
 * different modules may run at once.
 *
 * Timeouts: every RPC of a run is bounded by the agent's rpc timeout (TD_TIMEOUT_DEFAULT in
 * tdist/timeout.h), so a run always ends; an op queued on a stage waits at most that long for
 * the op before it.
 */
#ifndef TDIST_PIPELINE_H
#define TDIST_PIPELINE_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/remote_module.h"
#include "tdist/rpc.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_pipe_schedule_kind {
  TD_PIPE_GPIPE = 0,
  TD_PIPE_1F1B = 1,
  TD_PIPE_INTERLEAVED_1F1B = 2,
} td_pipe_schedule_kind;

typedef enum td_pipe_loss {
  TD_PIPE_LOSS_MSE = 0, /* mean over the batch's elements of (y - target)^2; needs a target */
  TD_PIPE_LOSS_SUM = 1, /* sum of y / rows of the batch; no target */
} td_pipe_loss;

typedef struct td_pipe_options {
  td_pipe_schedule_kind schedule; /* default TD_PIPE_1F1B */
  int micro_batches;              /* m >= 1; default 4. The batch is cut as torch.chunk cuts it */
  int virtual_stages;             /* v >= 1 chunks per worker; default 1 (GPipe, 1F1B need 1) */
  td_pipe_loss loss;              /* default TD_PIPE_LOSS_MSE */
} td_pipe_options;

/* td_pipe_options_init fills *o with the defaults above. */
TD_API void td_pipe_options_init(td_pipe_options *o);

#define TD_PIPE_MAX_WORKERS 64

/* What one run did, measured by the stages themselves (activations, busy time) and the driver
 * (wall time). */
typedef struct td_pipe_stats {
  int workers;        /* p */
  int micro_batches;  /* m as cut (fewer than asked when the batch has fewer rows) */
  int virtual_stages; /* v */
  int64_t ops;        /* forward and backward ops run: 2 m v p on success */
  double wall_s;      /* seconds from the first op sent to the last reply, on the driver */
  /* Per worker: seconds spent running ops (forward, loss, backward) and the most
   * (micro-batch, chunk) pairs whose forward had run and backward had not. */
  double busy_s[TD_PIPE_MAX_WORKERS];
  int peak_live[TD_PIPE_MAX_WORKERS];
  /* wall_s / (mean of busy_s) - 1: the pipeline bubble (idle time over useful time). Ideal
   * (no messages, equal stages): (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved. */
  double bubble;
} td_pipe_stats;

typedef struct td_pipe_schedule td_pipe_schedule;

/* td_pipe_schedule_create makes a schedule over the model chunks[0..n) (model order; n = p v
 * with v = opts->virtual_stages). Chunk c must live on the same worker as chunk c mod p, and the
 * first p chunks on p different workers (TD_ERR_INVALID naming the chunk otherwise). Creates the
 * stage objects on the workers (blocks, each RPC bounded by the agent's rpc timeout) and takes
 * references to the chunks' RRefs (the handles may be destroyed afterwards). opts may be NULL for
 * the defaults. Errors: TD_ERR_INVALID for bad options (m < 1, v < 1, v != 1 outside the
 * interleaved schedule, n not a multiple of v, p > TD_PIPE_MAX_WORKERS, interleaved with m not
 * divisible by p). *out: release with td_pipe_schedule_destroy(). */
TD_API td_status td_pipe_schedule_create(td_rpc_agent *a, td_remote_module *const *chunks, int n,
                                         const td_pipe_options *opts, td_pipe_schedule **out);

/* td_pipe_schedule_destroy releases the schedule and its stages (their references; a stage goes
 * when its RRef does). NULL does nothing. Does not block. */
TD_API void td_pipe_schedule_destroy(td_pipe_schedule *s);

/* td_pipe_schedule_run runs one step on x (CPU tensor, batch along dim 0) with target (same rows
 * as the model's output; NULL for TD_PIPE_LOSS_SUM): every micro-batch forward and backward in
 * the schedule's order. Parameter gradients accumulate into `.grad` of the chunks' parameters on
 * their workers (add up over runs: see td_pipe_schedule_zero_grad). *loss (may be NULL) gets the
 * batch's loss, stats (may be NULL) what the run measured. The caller's distributed autograd
 * context, if any, is not used (the stages run plain local autograd). Errors: TD_ERR_INVALID for
 * bad shapes, interleaved with a cut of m not divisible by p; the first failing op's error with
 * the op, the micro-batch and the worker named; after a failure the stages drop what the run
 * left, and the next run starts clean. Blocks until every op issued has finished. */
TD_API td_status td_pipe_schedule_run(td_pipe_schedule *s, td_tensor *x, td_tensor *target,
                                      double *loss, td_pipe_stats *stats);

/* td_pipe_schedule_zero_grad clears `.grad` of every chunk's parameters (set to none, as
 * optimizer.zero_grad()). Blocks. */
TD_API td_status td_pipe_schedule_zero_grad(td_pipe_schedule *s);

/* td_pipe_schedule_order writes worker w's op order for schedule kind with p workers, m
 * micro-batches and v chunks per worker into ops[0..cap) as triples {kind (0 forward, 1
 * backward), chunk (model order), micro-batch}, and their count (2 m v) into *n. For tests and
 * tools; TD_ERR_INVALID for bad arguments (as create) or cap < 2 m v. Does not block. */
TD_API td_status td_pipe_schedule_order(td_pipe_schedule_kind kind, int p, int m, int v, int w,
                                        int (*ops)[3], int cap, int *n);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_PIPELINE_H */
