/* optim.h - functional optimizers: SGD, Adam, AdamW, Adagrad and RMSprop; parameter groups,
 * gradient-norm clipping, a warmup + cosine learning-rate schedule, and dynamic loss scaling
 * (td_grad_scaler, at the end).
 *
 * A td_optim owns a list of parameters (references) and the per-parameter state (momentum
 * buffers, moment estimates, step counts). "Functional" means the gradients are an input of the
 * step rather than something the optimizer goes looking for: td_optim_step_grads() takes one
 * gradient per parameter, td_optim_step_grad_map() reads them from a td_grad_map (what distributed
 * autograd produces), and td_optim_step() is the convenience form that uses each parameter's
 * `.grad`. A parameter without a gradient is skipped and its state does not advance, as in
 * PyTorch.
 *
 * Parameters may come in groups (torch.optim's param_groups), each with its own learning rate and
 * weight decay, e.g. AdamW with decay on the weight matrices and none on biases and LayerNorm
 * parameters (td_optim_create_groups). Parameter indices (td_optim_param, td_optim_step_grads,
 * td_optim_step_count) run over the groups in order.
 *
 * The update rules and defaults are those of torch.optim in PyTorch 1.13 (single-tensor,
 * non-foreach implementations), including weight_decay, maximize, SGD's momentum / dampening /
 * nesterov, Adam's amsgrad, AdamW's decoupled decay, Adagrad's lr_decay and initial accumulator,
 * and RMSprop's centered and momentum variants. Updates are written with the device-independent
 * in-place tensor ops, so parameters may live on any device (the state is created next to each
 * parameter) and the arithmetic happens in the parameter's dtype.
 *
 * THREAD SAFETY: every call may be made from any thread. Steps on one optimizer are serialised
 * by its internal mutex; the caller must not modify the parameters concurrently with a step.
 */
#ifndef TDIST_OPTIM_H
#define TDIST_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/autograd.h"
#include "tdist/nn.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_optim_kind {
  TD_OPTIM_SGD = 0,
  TD_OPTIM_ADAM = 1,
  TD_OPTIM_ADAMW = 2,
  TD_OPTIM_ADAGRAD = 3,
  TD_OPTIM_RMSPROP = 4,
} td_optim_kind;

/* Hyper-parameters of every optimizer; each kind reads the fields it documents. Fill with
 * td_optim_options_init(), which sets PyTorch 1.13's defaults for the kind, then override. */
typedef struct td_optim_options {
  td_optim_kind kind;
  /* Learning rate. Defaults: Adam/AdamW 1e-3, Adagrad/RMSprop 1e-2; SGD has none (NaN) and must
   * be set, as torch.optim.SGD requires lr. */
  double lr;
  /* L2 penalty added to the gradient (AdamW: decoupled decay of the weights). Default 0;
   * AdamW 1e-2. */
  double weight_decay;
  /* Ascend instead of descend. Default false. */
  bool maximize;
  /* SGD and RMSprop: momentum factor, default 0. */
  double momentum;
  /* SGD: dampening of the momentum, default 0. */
  double dampening;
  /* SGD: Nesterov momentum (needs momentum > 0 and dampening 0), default false. */
  bool nesterov;
  /* Adam/AdamW: coefficients of the running averages, default 0.9 and 0.999. */
  double beta1, beta2;
  /* Term added to denominators. Defaults: Adam/AdamW/RMSprop 1e-8, Adagrad 1e-10. */
  double eps;
  /* Adam/AdamW: use the running maximum of the second moment, default false. */
  bool amsgrad;
  /* Adagrad: learning-rate decay, default 0. */
  double lr_decay;
  /* Adagrad: starting value of the squared-gradient sums, default 0. */
  double initial_accumulator_value;
  /* RMSprop: smoothing constant, default 0.99. */
  double alpha;
  /* RMSprop: normalise by the estimated variance of the gradient, default false. */
  bool centered;
} td_optim_options;

/* td_optim_options_init sets o to the defaults of kind. */
TD_API void td_optim_options_init(td_optim_options *o, td_optim_kind kind);
/* td_optim_kind_name returns "SGD", "Adam", "AdamW", "Adagrad" or "RMSprop"; never NULL. */
TD_API const char *td_optim_kind_name(td_optim_kind kind);

typedef struct td_optim td_optim;

/* td_optim_create makes an optimizer over params[0..n) (float tensors; duplicates are refused)
 * with the options copied from opts. Invalid hyper-parameters are TD_ERR_INVALID naming the field
 * (the checks of torch.optim). Takes a reference to each parameter. Release with
 * td_optim_destroy(). */
TD_API td_status td_optim_create(const td_optim_options *opts, td_tensor *const *params, size_t n,
                                 td_optim **out);

/* One parameter group of td_optim_create_groups: params[0..n) share the learning rate and the
 * weight decay given here (NAN: the optimizer's options). Fill with td_optim_group_init(). */
typedef struct td_optim_group {
  td_tensor *const *params; /* borrowed for the duration of td_optim_create_groups */
  size_t n;                 /* number of parameters; a group may be empty */
  double lr;                /* learning rate; NAN (default) inherits opts->lr */
  double weight_decay;      /* weight decay; NAN (default) inherits opts->weight_decay */
} td_optim_group;

/* td_optim_group_init sets g to params[0..n) with the learning rate and weight decay inherited. */
TD_API void td_optim_group_init(td_optim_group *g, td_tensor *const *params, size_t n);

/* td_optim_create_groups makes an optimizer over the parameters of groups[0..n_groups), in that
 * order, with the options copied from opts and each group's own lr / weight_decay where set
 * (PyTorch's param_groups: AdamW's decoupled decay then applies per group). A parameter in two
 * groups, or twice in one, is TD_ERR_INVALID; each group's values are validated like the options.
 * td_optim_create(opts, params, n, out) is the one-group form. Takes a reference to each
 * parameter. Release with td_optim_destroy(). THREAD SAFETY: any thread. */
TD_API td_status td_optim_create_groups(const td_optim_options *opts,
                                        const td_optim_group *groups, size_t n_groups,
                                        td_optim **out);

/* td_optim_destroy drops the parameters and the state. NULL does nothing. Must not run
 * concurrently with another call on o. */
TD_API void td_optim_destroy(td_optim *o);

/* td_optim_step updates every parameter that has a `.grad` (see td_tensor_grad). */
TD_API td_status td_optim_step(td_optim *o);
/* td_optim_step_grads updates parameter i with grads[i] for i in [0, n); n must equal the number
 * of parameters; a NULL entry skips that parameter. Gradients must match their parameter's shape,
 * dtype and device (TD_ERR_SHAPE / TD_ERR_DTYPE / TD_ERR_DEVICE, checked for all before any
 * update). Borrowed: the gradients are only read. */
TD_API td_status td_optim_step_grads(td_optim *o, td_tensor *const *grads, size_t n);
/* td_optim_step_grad_map updates every parameter that has an entry in grads. */
TD_API td_status td_optim_step_grad_map(td_optim *o, td_grad_map *grads);
/* td_optim_zero_grad clears the `.grad` of every parameter (set to none). */
TD_API void td_optim_zero_grad(td_optim *o);

/* td_optim_num_params returns the number of parameters. */
TD_API size_t td_optim_num_params(const td_optim *o);
/* td_optim_param returns parameter i, or NULL. Borrowed; valid while o lives. */
TD_API td_tensor *td_optim_param(const td_optim *o, size_t i);
/* td_optim_options_get copies the current options into *out. */
TD_API void td_optim_options_get(td_optim *o, td_optim_options *out);
/* td_optim_set_lr changes the learning rate of every group (and of the options) for later steps,
 * as schedules do. TD_ERR_INVALID for a negative or NaN lr. */
TD_API td_status td_optim_set_lr(td_optim *o, double lr);
/* td_optim_num_groups returns the number of parameter groups (1 for td_optim_create). */
TD_API size_t td_optim_num_groups(const td_optim *o);
/* td_optim_group_get reports group i's learning rate, weight decay and number of parameters
 * (any pointer may be NULL). TD_ERR_INVALID for an unknown i. */
TD_API td_status td_optim_group_get(td_optim *o, size_t i, double *lr, double *weight_decay,
                                    size_t *n_params);
/* td_optim_set_group_lr changes group i's learning rate only. TD_ERR_INVALID for an unknown i or
 * a negative or NaN lr. */
TD_API td_status td_optim_set_group_lr(td_optim *o, size_t i, double lr);

/* td_optim_clip_grad_norm scales the `.grad` of every parameter in place so that their joint
 * norm is at most max_norm, with torch.nn.utils.clip_grad_norm_'s rule (PyTorch 1.13): the total
 * norm is the norm_type-norm of the per-gradient norms (norm_type > 0, or INFINITY for the
 * largest absolute value), and every gradient is multiplied by min(1, max_norm / (total + 1e-6)).
 * Parameters without a gradient are ignored (total 0 when none has one). A non-finite total is
 * not an error (as PyTorch's default): the gradients are then scaled by NaN. The sums accumulate
 * in double. On TD_OK *total_norm (may be NULL) is the norm before clipping. TD_ERR_INVALID for a
 * negative or NaN max_norm or a norm_type <= 0. THREAD SAFETY: serialised with steps by o's
 * mutex; the caller must not run backward into these gradients at the same time. */
TD_API td_status td_optim_clip_grad_norm(td_optim *o, double max_norm, double norm_type,
                                         double *total_norm);

/* td_optim_lr_warmup_cosine returns the learning rate of step `step` (0-based) in nanoGPT's
 * schedule: linear warmup lr * (step + 1) / (warmup + 1) for step < warmup, then a cosine decay
 * from lr to min_lr reached at step decay_steps, then min_lr. decay_steps <= warmup means no
 * decay phase (min_lr from step warmup on). Pure function; any thread. */
TD_API double td_optim_lr_warmup_cosine(int64_t step, int64_t warmup, int64_t decay_steps,
                                        double lr, double min_lr);
/* td_optim_step_count returns how many times parameter i was updated (0 for an unknown i). */
TD_API int64_t td_optim_step_count(td_optim *o, size_t i);

/* td_optim_state_get reports parameter i's state for checkpoints: bufs[0..3) receive new
 * references to its state tensors (NULL where the kind has none or the first update has not
 * created it yet; see the table in optim.c: Adam(W) exp_avg, exp_avg_sq, max_exp_avg_sq; SGD
 * momentum_buffer; Adagrad sum; RMSprop square_avg, momentum_buffer, grad_avg), *step (may be
 * NULL) its step count. The tensors are the live state: copy them before the next step if they
 * must stay as they are. Release each with td_tensor_unref(). TD_ERR_INVALID for an unknown i. */
TD_API td_status td_optim_state_get(td_optim *o, size_t i, td_tensor *bufs[3], int64_t *step);
/* td_optim_state_set replaces parameter i's state with copies of bufs[0..3) (each with the
 * parameter's element count, any shape, dtype and device: converted to the parameter's; NULL
 * drops that state, so the next update starts it afresh as PyTorch does) and its step count.
 * TD_ERR_SHAPE for a wrong element count (nothing changed). Borrowed: bufs are only read. */
TD_API td_status td_optim_state_set(td_optim *o, size_t i, td_tensor *const bufs[3], int64_t step);
/* td_optim_state_adopt is td_optim_state_set without the copies: parameter i's state becomes
 * bufs[0..3) themselves (viewed in the parameter's shape; each must be contiguous, with the
 * parameter's element count, dtype and device: else TD_ERR_SHAPE, nothing changed). The caller
 * keeps its references but must not write them afterwards (they are the live state). */
TD_API td_status td_optim_state_adopt(td_optim *o, size_t i, td_tensor *const bufs[3],
                                      int64_t step);
/* td_optim_state_set_step sets parameter i's step count only, its state tensors kept (for a
 * caller that wrote the live tensors of td_optim_state_get in place). TD_ERR_INVALID for an
 * unknown i or a negative step. */
TD_API td_status td_optim_state_set_step(td_optim *o, size_t i, int64_t step);

/* ---- dynamic loss scaling (mixed precision) ----
 *
 * td_grad_scaler is PyTorch's GradScaler (torch.cuda.amp, 1.13): float16 gradients underflow
 * where float32 ones do not, so the loss is multiplied by a large scale before backward and the
 * gradients divided by it before the step; a step whose gradients overflowed (an inf or a NaN)
 * is skipped and the scale halved, and after growth_interval steps in a row without one the
 * scale doubles. One iteration, every call in this order:
 *
 *     td_grad_scaler_scale(s, loss, &scaled);  td_tensor_backward(scaled);
 *     td_grad_scaler_unscale_(s, opt);          (optional; needed before clipping)
 *     td_optim_clip_grad_norm(opt, 1.0, 2.0, NULL);
 *     td_grad_scaler_step(s, opt, &stepped);    (the optimizer's step unless found_inf)
 *     td_grad_scaler_update(s);                 (the scale rule; ends the iteration)
 *
 * Data parallelism: every replica must skip the same steps, so found_inf is a decision taken
 * once per iteration through an agreement (td_grad_scaler_set_agreement; tdist/collectives.h's
 * td_grad_scaler_set_process_group makes it an all_reduce MAX over a process group, and
 * td_zero_step_scaled agrees over the td_zero's groups itself, since each ZeRO member sees only
 * its shard of the gradient). Without an agreement the decision is this process's alone.
 * With gradient accumulation the scale multiplies each micro-batch's loss (divided by the
 * micro-batch count first); one update per optimizer step.
 *
 * Precision: the scale is held as a float32 value (PyTorch's tensor); its powers of two make
 * scaling and unscaling exact, so a run that never overflows computes, in float32 or float64,
 * the same numbers as one without scaling (up to values that underflow without it).
 *
 * THREAD SAFETY: not locked; one thread uses a scaler at a time. The calls block only when the
 * agreement does (a collective). */
typedef struct td_grad_scaler td_grad_scaler;

typedef struct td_grad_scaler_options {
  double init_scale;       /* the first scale: default 65536 (2^16); > 0, a finite float32 */
  double growth_factor;    /* dynamic: the scale's factor after growth_interval good steps (2) */
  double backoff_factor;   /* dynamic: its factor after a step with an inf or a NaN (0.5) */
  int64_t growth_interval; /* dynamic: good steps in a row before the scale grows (2000) */
  bool dynamic;            /* true (default): the rule above; false: the scale stays init_scale
                              (steps with an inf or a NaN are still skipped), as Megatron's
                              constant scaler */
} td_grad_scaler_options;
/* td_grad_scaler_options_init sets PyTorch's defaults (65536, 2, 0.5, 2000, dynamic). */
TD_API void td_grad_scaler_options_init(td_grad_scaler_options *o);

/* td_grad_scaler_create makes a scaler (opts NULL: the defaults). TD_ERR_INVALID for an
 * init_scale that is not a positive finite float32, or, when dynamic, a growth_factor <= 1, a
 * backoff_factor outside (0, 1) or a growth_interval < 1. Release with td_grad_scaler_destroy. */
TD_API td_status td_grad_scaler_create(const td_grad_scaler_options *opts, td_grad_scaler **out);
/* td_grad_scaler_destroy frees s. NULL does nothing. */
TD_API void td_grad_scaler_destroy(td_grad_scaler *s);

/* td_grad_scaler_scale returns loss * scale in *out (a new reference, differentiable: its
 * backward gives the scaled gradients). */
TD_API td_status td_grad_scaler_scale(td_grad_scaler *s, const td_tensor *loss, td_tensor **out);
/* td_grad_scaler_unscale_ divides the .grad of every parameter of opt by the scale, in place,
 * and records whether any held an inf or a NaN (before the division, as PyTorch checks).
 * TD_ERR_STATE when called twice for opt in one iteration, or after the iteration's found_inf
 * was decided (unscale every optimizer before the first step). */
TD_API td_status td_grad_scaler_unscale_(td_grad_scaler *s, td_optim *opt);
/* td_grad_scaler_unscale_grads_ is the same for gradients the caller holds (a sharded
 * optimizer's shard, say): grads[0..n) divided in place (NULL entries skipped), the inf check
 * recorded. May be called several times per iteration, until found_inf is decided
 * (TD_ERR_STATE after). Borrowed: the tensors are only written. */
TD_API td_status td_grad_scaler_unscale_grads_(td_grad_scaler *s, td_tensor *const *grads,
                                               size_t n);

/* An agreement on found_inf: *found_inf holds this process's flag on entry and, on TD_OK, the
 * flag every replica acts on (the OR over the replicas). Runs once per iteration, at the first
 * td_grad_scaler_found_inf (or step, or update); collective for the replicas that share it. */
typedef td_status (*td_grad_scaler_agree_fn)(void *ctx, bool *found_inf);
/* td_grad_scaler_set_agreement sets (fn NULL: removes) the agreement of later iterations; ctx
 * is borrowed and must outlive the scaler's use of it. */
TD_API void td_grad_scaler_set_agreement(td_grad_scaler *s, td_grad_scaler_agree_fn fn,
                                         void *ctx);
/* td_grad_scaler_found_inf reports whether this iteration's gradients held an inf or a NaN: the
 * first call of an iteration takes the decision (through the agreement, when one is set), the
 * later ones return it. TD_ERR_STATE when nothing was unscaled in this iteration. */
TD_API td_status td_grad_scaler_found_inf(td_grad_scaler *s, bool *found);
/* td_grad_scaler_found_inf_ex is td_grad_scaler_found_inf with agreement fn (ctx; NULL: this
 * process's flag) instead of the one set, for code that agrees over its own groups
 * (td_zero_step_scaled). Once decided, the decision stands whatever fn is given. */
TD_API td_status td_grad_scaler_found_inf_ex(td_grad_scaler *s, td_grad_scaler_agree_fn fn,
                                             void *ctx, bool *found);
/* td_grad_scaler_step unscales opt's gradients if td_grad_scaler_unscale_ did not, takes the
 * iteration's decision and steps opt unless found_inf; *stepped (may be NULL) tells which.
 * TD_ERR_STATE when called twice for opt in one iteration. */
TD_API td_status td_grad_scaler_step(td_grad_scaler *s, td_optim *opt, bool *stepped);
/* td_grad_scaler_update applies the rule (see td_grad_scaler_options) from the iteration's
 * decision and ends the iteration. TD_ERR_STATE when nothing was unscaled since the last update
 * (PyTorch: "No inf checks were recorded prior to update"). */
TD_API td_status td_grad_scaler_update(td_grad_scaler *s);
/* td_grad_scaler_get_scale returns the current scale (NAN for NULL). */
TD_API double td_grad_scaler_get_scale(const td_grad_scaler *s);

typedef struct td_grad_scaler_stats {
  uint64_t updates;       /* iterations ended by td_grad_scaler_update */
  uint64_t skipped_steps; /* of those, iterations whose found_inf was true (no step taken) */
  uint64_t backoffs, growths; /* scale changes (dynamic) */
} td_grad_scaler_stats;
TD_API td_status td_grad_scaler_get_stats(const td_grad_scaler *s, td_grad_scaler_stats *out);

/* The state a checkpoint keeps (PyTorch's GradScaler.state_dict: scale and _growth_tracker). */
typedef struct td_grad_scaler_state {
  double scale;
  int64_t growth_tracker; /* good steps in a row since the scale last changed */
} td_grad_scaler_state;
TD_API td_status td_grad_scaler_get_state(const td_grad_scaler *s, td_grad_scaler_state *out);
/* td_grad_scaler_set_state restores it (between iterations: TD_ERR_STATE after an unscale and
 * before the update; TD_ERR_INVALID for a scale that is not a positive finite float32 or a
 * negative tracker). */
TD_API td_status td_grad_scaler_set_state(td_grad_scaler *s, const td_grad_scaler_state *in);
/* td_grad_scaler_state_dict appends PyTorch's five entries as 0-d tensors named prefix + "scale",
 * "growth_factor", "backoff_factor" (float64), "growth_interval", "_growth_tracker" (int64) to
 * *out (prefix may be NULL), for a safetensors checkpoint beside the model's tensors. */
TD_API td_status td_grad_scaler_state_dict(const td_grad_scaler *s, const char *prefix,
                                           td_tensor_list *out);
/* td_grad_scaler_load_state_dict restores them from sd: scale and _growth_tracker are required,
 * the three others optional (validated as at creation; nothing changes on an error). */
TD_API td_status td_grad_scaler_load_state_dict(td_grad_scaler *s, const char *prefix,
                                                const td_tensor_list *sd);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_OPTIM_H */
