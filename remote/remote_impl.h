/* remote_impl.h - internals shared by the files of remote/ (never installed).
 *
 * The pipeline schedule's stage protocol (stage.c serves it, schedule.c drives it). Every call is
 * an RRef proxy call on the stage object, whose value comes first:
 *   __ps_create [chunk module, [module RRefs]] -> "pipe.Stage" object (through td_rref_remote on
 *       the first chunk's RRef; the list holds the worker's chunks in virtual-stage order, all
 *       owned by this worker)
 *   __ps_op [stage, run, seq, kind, chunk, mb, flags, scale, data, target]
 *       -> [result (tensor or none), peak live activations, busy seconds] of this run so far
 *   __ps_abort [stage, run]: fail the run's queued ops and refuse its later ones
 *   __ps_zero_grad [stage]: clear .grad of every chunk's parameters
 */
#ifndef TD_REMOTE_IMPL_H
#define TD_REMOTE_IMPL_H

#include "tdist/nn.h"
#include "tdist/tensor.h"

#define TD__PS_STAGE_TYPE "pipe.Stage"

enum {
  TD__PS_FORWARD = 0,
  TD__PS_BACKWARD = 1,
};

/* __ps_op flags */
enum {
  TD__PS_FIRST = 1,     /* the model's first chunk: its input needs no gradient */
  TD__PS_LAST = 2,      /* the model's last chunk: forward computes the micro-batch's loss */
  TD__PS_LOSS_SHIFT = 2 /* flags >> TD__PS_LOSS_SHIFT is the td_pipe_loss */
};

/* td__rm_module_device returns the device of m's first parameter (the CPU without parameters). */
td_device td__rm_module_device(td_module *m);

/* td__pipe_stage_register registers the stage functions and object type (remote layer init). */
void td__pipe_stage_register(void);

#endif
