/* optim.h - functional optimizers: SGD, Adam, AdamW, Adagrad and RMSprop.
 *
 * A td_optim owns a list of parameters (references) and the per-parameter state (momentum
 * buffers, moment estimates, step counts). "Functional" means the gradients are an input of the
 * step rather than something the optimizer goes looking for: td_optim_step_grads() takes one
 * gradient per parameter, td_optim_step_grad_map() reads them from a td_grad_map (what distributed
 * autograd produces), and td_optim_step() is the convenience form that uses each parameter's
 * `.grad`. A parameter without a gradient is skipped and its state does not advance, as in
 * PyTorch.
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
/* td_optim_set_lr changes the learning rate for later steps (for schedules). TD_ERR_INVALID for
 * a negative or NaN lr. */
TD_API td_status td_optim_set_lr(td_optim *o, double lr);
/* td_optim_step_count returns how many times parameter i was updated (0 for an unknown i). */
TD_API int64_t td_optim_step_count(td_optim *o, size_t i);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_OPTIM_H */
