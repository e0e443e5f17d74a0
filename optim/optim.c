/* optim.c - functional optimizers with torch.optim 1.13 semantics, parameter groups, gradient
 * clipping and the warmup + cosine schedule.
 *
 * Each parameter has a slot with its step count and up to three state tensors whose meaning
 * depends on the kind:
 *            buf[0]            buf[1]            buf[2]
 *   SGD      momentum_buffer   -                 -
 *   Adam(W)  exp_avg           exp_avg_sq        max_exp_avg_sq (amsgrad)
 *   Adagrad  sum               -                 -
 *   RMSprop  square_avg        momentum_buffer   grad_avg (centered)
 * State tensors are created next to their parameter (same device and dtype), lazily on the first
 * update as PyTorch does, except Adagrad's sum which exists from the start
 * (initial_accumulator_value).
 *
 * The update of one parameter follows PyTorch's _single_tensor_<kind> function line by line, with
 * the in-place ops of tensor.h; the comments quote the PyTorch lines. Adam and AdamW without
 * amsgrad first try td_tensor_adam_multi_ over every parameter of the step (one pass per
 * parameter, one kernel launch per group of parameters on CUDA), then td_tensor_adam_ per
 * parameter, and fall back to the composed ops where the device has no such kernel. All of it runs with grad
 * mode off. A step first validates every (parameter, gradient) pair and only then updates, so a
 * bad gradient leaves every parameter untouched.
 *
 * Groups: every slot records its group; a group holds the lr and weight_decay that override the
 * options for its parameters, and an update reads a copy of the options with those two replaced.
 *
 * Locking: one mutex per optimizer (mu) held for a whole step, set_lr and the accessors. No other
 * library lock is taken while it is held except the tensor layer's internal ones.
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "../core/core.h"
#include "tdist/optim.h"

typedef struct slot {
  td_tensor *param;
  td_tensor *buf[3];
  int64_t step;
  size_t group;
} slot;

typedef struct group {
  double lr, weight_decay;
  size_t n; /* parameters in the group */
} group;

struct td_optim {
  pthread_mutex_t mu;
  td_optim_options o;
  size_t n;
  slot *slots;
  size_t n_groups;
  group *groups;
};

#define CK(expr)               \
  do {                         \
    st = (expr);               \
    if (st != TD_OK) goto out; \
  } while (0)

/* ---- options ---- */

const char *td_optim_kind_name(td_optim_kind kind) {
  switch (kind) {
    case TD_OPTIM_SGD: return "SGD";
    case TD_OPTIM_ADAM: return "Adam";
    case TD_OPTIM_ADAMW: return "AdamW";
    case TD_OPTIM_ADAGRAD: return "Adagrad";
    case TD_OPTIM_RMSPROP: return "RMSprop";
  }
  return "unknown";
}

void td_optim_options_init(td_optim_options *o, td_optim_kind kind) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->kind = kind;
  o->beta1 = 0.9;
  o->beta2 = 0.999;
  o->eps = 1e-8;
  o->alpha = 0.99;
  switch (kind) {
    case TD_OPTIM_SGD: o->lr = NAN; break;
    case TD_OPTIM_ADAM: o->lr = 1e-3; break;
    case TD_OPTIM_ADAMW:
      o->lr = 1e-3;
      o->weight_decay = 1e-2;
      break;
    case TD_OPTIM_ADAGRAD:
      o->lr = 1e-2;
      o->eps = 1e-10;
      break;
    case TD_OPTIM_RMSPROP: o->lr = 1e-2; break;
  }
}

/* validate mirrors the ValueError checks of the torch.optim constructors. */
static td_status validate(const td_optim_options *o) {
  const char *k = td_optim_kind_name(o->kind);
  switch (o->kind) {
    case TD_OPTIM_SGD:
    case TD_OPTIM_ADAM:
    case TD_OPTIM_ADAMW:
    case TD_OPTIM_ADAGRAD:
    case TD_OPTIM_RMSPROP: break;
    default: return td_set_error(TD_ERR_INVALID, "optimizer: unknown kind %d", (int)o->kind);
  }
  if (isnan(o->lr) && o->kind == TD_OPTIM_SGD)
    return td_set_error(TD_ERR_INVALID, "SGD: lr is required (set opts.lr)");
  TD_CHECK_ARG(o->lr >= 0, "%s: invalid learning rate: %g", k, o->lr);
  TD_CHECK_ARG(o->weight_decay >= 0, "%s: invalid weight_decay value: %g", k, o->weight_decay);
  switch (o->kind) {
    case TD_OPTIM_SGD:
      TD_CHECK_ARG(o->momentum >= 0, "SGD: invalid momentum value: %g", o->momentum);
      TD_CHECK_ARG(!o->nesterov || (o->momentum > 0 && o->dampening == 0),
                   "SGD: Nesterov momentum requires a momentum and zero dampening");
      break;
    case TD_OPTIM_ADAM:
    case TD_OPTIM_ADAMW:
      TD_CHECK_ARG(o->eps >= 0, "%s: invalid epsilon value: %g", k, o->eps);
      TD_CHECK_ARG(o->beta1 >= 0 && o->beta1 < 1, "%s: invalid beta parameter at index 0: %g", k,
                   o->beta1);
      TD_CHECK_ARG(o->beta2 >= 0 && o->beta2 < 1, "%s: invalid beta parameter at index 1: %g", k,
                   o->beta2);
      break;
    case TD_OPTIM_ADAGRAD:
      TD_CHECK_ARG(o->lr_decay >= 0, "Adagrad: invalid lr_decay value: %g", o->lr_decay);
      TD_CHECK_ARG(o->initial_accumulator_value >= 0,
                   "Adagrad: invalid initial_accumulator_value value: %g",
                   o->initial_accumulator_value);
      TD_CHECK_ARG(o->eps >= 0, "Adagrad: invalid epsilon value: %g", o->eps);
      break;
    case TD_OPTIM_RMSPROP:
      TD_CHECK_ARG(o->eps >= 0, "RMSprop: invalid epsilon value: %g", o->eps);
      TD_CHECK_ARG(o->momentum >= 0, "RMSprop: invalid momentum value: %g", o->momentum);
      TD_CHECK_ARG(o->alpha >= 0, "RMSprop: invalid alpha value: %g", o->alpha);
      break;
  }
  return TD_OK;
}

/* ---- lifecycle ---- */

static td_status full_like(const td_tensor *t, double v, td_tensor **out) {
  return td_tensor_full(td_tensor_shape(t), td_tensor_ndim(t), v, td_tensor_dtype(t),
                        td_tensor_device(t), out);
}

void td_optim_group_init(td_optim_group *g, td_tensor *const *params, size_t n) {
  if (!g) return;
  g->params = params;
  g->n = n;
  g->lr = NAN;
  g->weight_decay = NAN;
}

/* check_params validates the parameters of every group: float tensors, none twice. */
static td_status check_params(const char *k, const td_optim_group *groups, size_t n_groups) {
  size_t idx = 0;
  for (size_t gi = 0; gi < n_groups; gi++) {
    TD_CHECK_ARG(groups[gi].params || groups[gi].n == 0, "%s: group %zu has a NULL params array",
                 k, gi);
    for (size_t i = 0; i < groups[gi].n; i++, idx++) {
      const td_tensor *p = groups[gi].params[i];
      TD_CHECK_ARG(p, "%s: parameter %zu is NULL", k, idx);
      td_dtype dt = td_tensor_dtype(p);
      if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
        return td_set_error(TD_ERR_DTYPE, "%s: parameter %zu is %s; optimizers keep float32 or "
                            "float64 parameters and state (for 16-bit compute, keep float32 "
                            "weights and use autocast: td_autocast_begin)", k, idx,
                            td_dtype_name(dt));
      size_t jdx = 0;
      for (size_t gj = 0; gj <= gi; gj++)
        for (size_t j = 0; j < groups[gj].n && jdx < idx; j++, jdx++)
          TD_CHECK_ARG(groups[gj].params[j] != p,
                       "%s: parameter %zu is the same tensor as parameter %zu%s", k, idx, jdx,
                       gj != gi ? " (some parameters appear in more than one group)" : "");
    }
  }
  return TD_OK;
}

td_status td_optim_create_groups(const td_optim_options *opts, const td_optim_group *groups,
                                 size_t n_groups, td_optim **out) {
  TD_CHECK_ARG(opts && out, "td_optim_create_groups: NULL options or out");
  TD_CHECK_ARG(groups || n_groups == 0, "td_optim_create_groups: NULL groups array");
  TD_TRY(validate(opts));
  const char *k = td_optim_kind_name(opts->kind);
  size_t n = 0;
  for (size_t gi = 0; gi < n_groups; gi++) {
    td_optim_options go = *opts;
    if (!isnan(groups[gi].lr)) go.lr = groups[gi].lr;
    if (!isnan(groups[gi].weight_decay)) go.weight_decay = groups[gi].weight_decay;
    TD_CHECK_ARG(go.lr >= 0, "%s: group %zu: invalid learning rate: %g", k, gi, go.lr);
    TD_CHECK_ARG(go.weight_decay >= 0, "%s: group %zu: invalid weight_decay value: %g", k, gi,
                 go.weight_decay);
    n += groups[gi].n;
  }
  TD_TRY(check_params(k, groups, n_groups));
  td_optim *o = td__calloc(1, sizeof *o);
  slot *slots = td__calloc(n ? n : 1, sizeof *slots);
  group *gs = td__calloc(n_groups ? n_groups : 1, sizeof *gs);
  if (!o || !slots || !gs) {
    td__free(o);
    td__free(slots);
    td__free(gs);
    return td_set_error(TD_ERR_NOMEM, "td_optim_create: out of memory");
  }
  o->o = *opts;
  o->n = n;
  o->slots = slots;
  o->n_groups = n_groups;
  o->groups = gs;
  pthread_mutex_init(&o->mu, NULL);
  size_t idx = 0;
  for (size_t gi = 0; gi < n_groups; gi++) {
    gs[gi].lr = isnan(groups[gi].lr) ? opts->lr : groups[gi].lr;
    gs[gi].weight_decay =
        isnan(groups[gi].weight_decay) ? opts->weight_decay : groups[gi].weight_decay;
    gs[gi].n = groups[gi].n;
    for (size_t i = 0; i < groups[gi].n; i++, idx++) {
      slots[idx].param = td_tensor_ref(groups[gi].params[i]);
      slots[idx].group = gi;
    }
  }
  if (opts->kind == TD_OPTIM_ADAGRAD) {
    for (size_t i = 0; i < n; i++) {
      td_status st = full_like(slots[i].param, opts->initial_accumulator_value, &slots[i].buf[0]);
      if (st != TD_OK) {
        td_optim_destroy(o);
        return st;
      }
    }
  }
  *out = o;
  return TD_OK;
}

td_status td_optim_create(const td_optim_options *opts, td_tensor *const *params, size_t n,
                          td_optim **out) {
  TD_CHECK_ARG(params || n == 0, "td_optim_create: NULL params array");
  td_optim_group g;
  td_optim_group_init(&g, params, n);
  return td_optim_create_groups(opts, &g, 1, out);
}

void td_optim_destroy(td_optim *o) {
  if (!o) return;
  for (size_t i = 0; i < o->n; i++) {
    td_tensor_unref(o->slots[i].param);
    for (int b = 0; b < 3; b++) td_tensor_unref(o->slots[i].buf[b]);
  }
  td__free(o->slots);
  td__free(o->groups);
  pthread_mutex_destroy(&o->mu);
  td__free(o);
}

/* ---- updates ---- */

static td_status ensure_zeros(slot *s, int b) {
  if (s->buf[b]) return TD_OK;
  return full_like(s->param, 0.0, &s->buf[b]);
}

/* effective_grad: grad = grad if not maximize else -grad; if weight_decay != 0:
 * grad = grad.add(param, alpha=weight_decay). Never modifies g; new reference in *out. */
static td_status effective_grad(const td_optim_options *o, td_tensor *p, const td_tensor *g,
                                double wd, td_tensor **out) {
  td_tensor *d = NULL;
  td_status st = TD_OK;
  if (o->maximize) CK(td_tensor_neg(g, &d));
  else if (wd != 0) CK(td_tensor_clone(g, &d));
  else d = td_tensor_ref((td_tensor *)g);
  if (wd != 0) CK(td_tensor_add_(d, p, wd));
  *out = d;
  d = NULL;
out:
  td_tensor_unref(d);
  return st;
}

static td_status sgd_update(const td_optim_options *o, slot *s, const td_tensor *g) {
  td_status st = TD_OK;
  td_tensor *d = NULL, *step_dir = NULL;
  CK(effective_grad(o, s->param, g, o->weight_decay, &d));
  s->step++;
  if (o->momentum != 0) {
    if (!s->buf[0]) { /* buf = torch.clone(d_p).detach() */
      CK(td_tensor_clone(d, &s->buf[0]));
    } else { /* buf.mul_(momentum).add_(d_p, alpha=1 - dampening) */
      CK(td_tensor_mul_scalar_(s->buf[0], o->momentum));
      CK(td_tensor_add_(s->buf[0], d, 1 - o->dampening));
    }
    if (o->nesterov) { /* d_p = d_p.add(buf, alpha=momentum) */
      CK(td_tensor_clone(d, &step_dir));
      CK(td_tensor_add_(step_dir, s->buf[0], o->momentum));
    } else { /* d_p = buf */
      step_dir = td_tensor_ref(s->buf[0]);
    }
  } else {
    step_dir = td_tensor_ref(d);
  }
  CK(td_tensor_add_(s->param, step_dir, -o->lr)); /* param.add_(d_p, alpha=-lr) */
out:
  td_tensor_unref(d);
  td_tensor_unref(step_dir);
  return st;
}

static td_status adam_update(const td_optim_options *o, slot *s, const td_tensor *g) {
  td_status st = TD_OK;
  bool decoupled = o->kind == TD_OPTIM_ADAMW;
  td_tensor *d = NULL, *root = NULL, *denom = NULL;
  CK(ensure_zeros(s, 0));
  CK(ensure_zeros(s, 1));
  if (o->amsgrad) CK(ensure_zeros(s, 2));
  if (!o->amsgrad) { /* one fused pass where the device has the kernel */
    td_adam_args a = {.lr = o->lr, .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps,
                      .weight_decay = o->weight_decay, .decoupled = decoupled,
                      .maximize = o->maximize, .step = s->step + 1};
    st = td_tensor_adam_(s->param, g, s->buf[0], s->buf[1], &a);
    if (st == TD_OK) s->step++;
    if (st != TD_ERR_UNSUPPORTED) return st;
    st = TD_OK;
  }
  CK(effective_grad(o, s->param, g, decoupled ? 0.0 : o->weight_decay, &d));
  s->step++;
  if (decoupled) CK(td_tensor_mul_scalar_(s->param, 1 - o->lr * o->weight_decay));
  /* exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1) */
  CK(td_tensor_mul_scalar_(s->buf[0], o->beta1));
  CK(td_tensor_add_(s->buf[0], d, 1 - o->beta1));
  /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) */
  CK(td_tensor_mul_scalar_(s->buf[1], o->beta2));
  CK(td_tensor_addcmul_(s->buf[1], d, d, 1 - o->beta2));
  double step = (double)s->step;
  double bias_correction1 = 1 - pow(o->beta1, step);
  double bias_correction2 = 1 - pow(o->beta2, step);
  double step_size = o->lr / bias_correction1;
  double bias_correction2_sqrt = sqrt(bias_correction2);
  td_tensor *second = s->buf[1];
  if (o->amsgrad) { /* torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i]) */
    CK(td_tensor_maximum_(s->buf[2], s->buf[1]));
    second = s->buf[2];
  }
  /* denom = (second.sqrt() / bias_correction2_sqrt).add_(eps) */
  CK(td_tensor_sqrt(second, &root));
  CK(td_tensor_mul_scalar_(root, 1.0 / bias_correction2_sqrt));
  CK(td_tensor_add_scalar(root, o->eps, &denom));
  /* param.addcdiv_(exp_avg, denom, value=-step_size) */
  CK(td_tensor_addcdiv_(s->param, s->buf[0], denom, -step_size));
out:
  td_tensor_unref(d);
  td_tensor_unref(root);
  td_tensor_unref(denom);
  return st;
}

static td_status adagrad_update(const td_optim_options *o, slot *s, const td_tensor *g) {
  td_status st = TD_OK;
  td_tensor *d = NULL, *root = NULL, *std = NULL;
  s->step++;
  double step = (double)s->step;
  CK(effective_grad(o, s->param, g, o->weight_decay, &d));
  double clr = o->lr / (1 + (step - 1) * o->lr_decay);
  CK(td_tensor_addcmul_(s->buf[0], d, d, 1.0)); /* state_sum.addcmul_(grad, grad, value=1) */
  CK(td_tensor_sqrt(s->buf[0], &root));         /* std = state_sum.sqrt().add_(eps) */
  CK(td_tensor_add_scalar(root, o->eps, &std));
  CK(td_tensor_addcdiv_(s->param, d, std, -clr)); /* param.addcdiv_(grad, std, value=-clr) */
out:
  td_tensor_unref(d);
  td_tensor_unref(root);
  td_tensor_unref(std);
  return st;
}

static td_status rmsprop_update(const td_optim_options *o, slot *s, const td_tensor *g) {
  td_status st = TD_OK;
  td_tensor *d = NULL, *var = NULL, *root = NULL, *avg = NULL;
  CK(ensure_zeros(s, 0));
  if (o->momentum > 0) CK(ensure_zeros(s, 1));
  if (o->centered) CK(ensure_zeros(s, 2));
  s->step++;
  CK(effective_grad(o, s->param, g, o->weight_decay, &d));
  /* square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha) */
  CK(td_tensor_mul_scalar_(s->buf[0], o->alpha));
  CK(td_tensor_addcmul_(s->buf[0], d, d, 1 - o->alpha));
  if (o->centered) {
    /* grad_avg.mul_(alpha).add_(grad, alpha=1 - alpha) */
    CK(td_tensor_mul_scalar_(s->buf[2], o->alpha));
    CK(td_tensor_add_(s->buf[2], d, 1 - o->alpha));
    /* avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_() */
    CK(td_tensor_clone(s->buf[0], &var));
    CK(td_tensor_addcmul_(var, s->buf[2], s->buf[2], -1.0));
    CK(td_tensor_sqrt(var, &root));
  } else {
    CK(td_tensor_sqrt(s->buf[0], &root)); /* avg = square_avg.sqrt() */
  }
  CK(td_tensor_add_scalar(root, o->eps, &avg)); /* avg = avg.add_(eps) */
  if (o->momentum > 0) {
    /* buf.mul_(momentum).addcdiv_(grad, avg); param.add_(buf, alpha=-lr) */
    CK(td_tensor_mul_scalar_(s->buf[1], o->momentum));
    CK(td_tensor_addcdiv_(s->buf[1], d, avg, 1.0));
    CK(td_tensor_add_(s->param, s->buf[1], -o->lr));
  } else {
    CK(td_tensor_addcdiv_(s->param, d, avg, -o->lr)); /* param.addcdiv_(grad, avg, value=-lr) */
  }
out:
  td_tensor_unref(d);
  td_tensor_unref(var);
  td_tensor_unref(root);
  td_tensor_unref(avg);
  return st;
}

static td_status update(const td_optim_options *o, slot *s, const td_tensor *g) {
  switch (o->kind) {
    case TD_OPTIM_SGD: return sgd_update(o, s, g);
    case TD_OPTIM_ADAM:
    case TD_OPTIM_ADAMW: return adam_update(o, s, g);
    case TD_OPTIM_ADAGRAD: return adagrad_update(o, s, g);
    case TD_OPTIM_RMSPROP: return rmsprop_update(o, s, g);
  }
  return td_set_error(TD_ERR_INTERNAL, "optimizer: unknown kind %d", (int)o->kind);
}

/* check_grad validates gradient g of parameter i. */
static td_status check_grad(const td_optim *o, size_t i, const td_tensor *g) {
  const td_tensor *p = o->slots[i].param;
  const char *k = td_optim_kind_name(o->o.kind);
  char a[96], b[96];
  if (!td_tensor_same_shape(p, g))
    return td_set_error(TD_ERR_SHAPE, "%s.step: gradient %zu has shape %s but its parameter %s",
                        k, i, td_tensor_shape_str(g, a, sizeof a),
                        td_tensor_shape_str(p, b, sizeof b));
  if (td_tensor_dtype(p) != td_tensor_dtype(g))
    return td_set_error(TD_ERR_DTYPE, "%s.step: gradient %zu is %s but its parameter %s", k, i,
                        td_dtype_name(td_tensor_dtype(g)), td_dtype_name(td_tensor_dtype(p)));
  if (!td_device_equal(td_tensor_device(p), td_tensor_device(g)))
    return td_set_error(TD_ERR_DEVICE, "%s.step: gradient %zu is on %s but its parameter on %s",
                        k, i, td_device_str(td_tensor_device(g), a, sizeof a),
                        td_device_str(td_tensor_device(p), b, sizeof b));
  return TD_OK;
}

/* adam_multi steps every parameter with a gradient through td_tensor_adam_multi_ (Adam / AdamW
 * without amsgrad): on CUDA one kernel launch per group of parameters instead of one per
 * parameter. Returns TD_ERR_UNSUPPORTED, with nothing updated, when the device or the layout does
 * not allow it (the caller then updates parameter by parameter). o->mu held. */
static td_status adam_multi(td_optim *o, td_tensor *const *grads) {
  size_t m = 0;
  for (size_t i = 0; i < o->n; i++) m += grads[i] != NULL;
  if (m == 0) return TD_OK;
  td_tensor **p = td__calloc(4 * m, sizeof *p);
  td_adam_args *a = td__calloc(m, sizeof *a);
  size_t *idx = td__calloc(m, sizeof *idx);
  td_status st = TD_OK;
  if (!p || !a || !idx) {
    st = td_set_error(TD_ERR_NOMEM, "optimizer step: out of memory");
    goto out;
  }
  size_t k = 0;
  for (size_t i = 0; i < o->n && st == TD_OK; i++) {
    if (!grads[i]) continue;
    slot *s = &o->slots[i];
    st = ensure_zeros(s, 0);
    if (st == TD_OK) st = ensure_zeros(s, 1);
    const group *gr = &o->groups[s->group];
    p[k] = s->param, p[m + k] = grads[i], p[2 * m + k] = s->buf[0], p[3 * m + k] = s->buf[1];
    a[k] = (td_adam_args){.lr = gr->lr, .beta1 = o->o.beta1, .beta2 = o->o.beta2,
                          .eps = o->o.eps, .weight_decay = gr->weight_decay,
                          .decoupled = o->o.kind == TD_OPTIM_ADAMW, .maximize = o->o.maximize,
                          .step = s->step + 1};
    idx[k++] = i;
  }
  if (st == TD_OK)
    st = td_tensor_adam_multi_(p, (const td_tensor *const *)(p + m), p + 2 * m, p + 3 * m, a, m);
  if (st == TD_OK)
    for (size_t j = 0; j < m; j++) o->slots[idx[j]].step++;
out:
  td__free(p);
  td__free(a);
  td__free(idx);
  return st;
}

/* step_locked runs one step with grads[0..o->n) (NULL entries skipped); o->mu held. */
static td_status step_locked(td_optim *o, td_tensor *const *grads) {
  for (size_t i = 0; i < o->n; i++)
    if (grads[i]) TD_TRY(check_grad(o, i, grads[i]));
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  if ((o->o.kind == TD_OPTIM_ADAM || o->o.kind == TD_OPTIM_ADAMW) && !o->o.amsgrad) {
    st = adam_multi(o, grads);
    if (st != TD_ERR_UNSUPPORTED) {
      td_autograd_set_enabled(prev);
      return st;
    }
    st = TD_OK;
  }
  for (size_t i = 0; i < o->n && st == TD_OK; i++) {
    if (!grads[i]) continue;
    const group *gr = &o->groups[o->slots[i].group];
    td_optim_options go = o->o;
    go.lr = gr->lr;
    go.weight_decay = gr->weight_decay;
    st = update(&go, &o->slots[i], grads[i]);
  }
  td_autograd_set_enabled(prev);
  return st;
}

td_status td_optim_step_grads(td_optim *o, td_tensor *const *grads, size_t n) {
  TD_CHECK_ARG(o, "td_optim_step_grads: NULL optimizer");
  TD_CHECK_ARG(grads || n == 0, "td_optim_step_grads: NULL grads array");
  TD_CHECK_ARG(n == o->n, "%s.step: %zu gradients for %zu parameters",
               td_optim_kind_name(o->o.kind), n, o->n);
  pthread_mutex_lock(&o->mu);
  td_status st = step_locked(o, grads);
  pthread_mutex_unlock(&o->mu);
  return st;
}

/* step_fetched runs a step with gradients fetched by get (new references or NULL). */
static td_status step_fetched(td_optim *o, td_tensor *(*get)(void *ctx, const td_tensor *p),
                              void *ctx) {
  td_tensor **grads = td__calloc(o->n ? o->n : 1, sizeof *grads);
  if (!grads) return td_set_error(TD_ERR_NOMEM, "optimizer step: out of memory");
  pthread_mutex_lock(&o->mu);
  for (size_t i = 0; i < o->n; i++) grads[i] = get(ctx, o->slots[i].param);
  td_status st = step_locked(o, grads);
  pthread_mutex_unlock(&o->mu);
  for (size_t i = 0; i < o->n; i++) td_tensor_unref(grads[i]);
  td__free(grads);
  return st;
}

static td_tensor *get_dot_grad(void *ctx, const td_tensor *p) {
  (void)ctx;
  return td_tensor_grad(p);
}

static td_tensor *get_map_grad(void *ctx, const td_tensor *p) {
  return td_grad_map_get((td_grad_map *)ctx, p);
}

td_status td_optim_step(td_optim *o) {
  TD_CHECK_ARG(o, "td_optim_step: NULL optimizer");
  return step_fetched(o, get_dot_grad, NULL);
}

td_status td_optim_step_grad_map(td_optim *o, td_grad_map *grads) {
  TD_CHECK_ARG(o && grads, "td_optim_step_grad_map: NULL optimizer or map");
  return step_fetched(o, get_map_grad, grads);
}

void td_optim_zero_grad(td_optim *o) {
  if (!o) return;
  for (size_t i = 0; i < o->n; i++) td_tensor_set_grad(o->slots[i].param, NULL);
}

/* ---- accessors ---- */

size_t td_optim_num_params(const td_optim *o) { return o ? o->n : 0; }

td_tensor *td_optim_param(const td_optim *o, size_t i) {
  return (o && i < o->n) ? o->slots[i].param : NULL;
}

void td_optim_options_get(td_optim *o, td_optim_options *out) {
  if (!o || !out) return;
  pthread_mutex_lock(&o->mu);
  *out = o->o;
  pthread_mutex_unlock(&o->mu);
}

td_status td_optim_set_lr(td_optim *o, double lr) {
  TD_CHECK_ARG(o, "td_optim_set_lr: NULL optimizer");
  TD_CHECK_ARG(lr >= 0, "%s: invalid learning rate: %g", td_optim_kind_name(o->o.kind), lr);
  pthread_mutex_lock(&o->mu);
  o->o.lr = lr;
  for (size_t i = 0; i < o->n_groups; i++) o->groups[i].lr = lr;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

size_t td_optim_num_groups(const td_optim *o) { return o ? o->n_groups : 0; }

td_status td_optim_group_get(td_optim *o, size_t i, double *lr, double *weight_decay,
                             size_t *n_params) {
  TD_CHECK_ARG(o, "td_optim_group_get: NULL optimizer");
  TD_CHECK_ARG(i < o->n_groups, "td_optim_group_get: group %zu of %zu", i, o->n_groups);
  pthread_mutex_lock(&o->mu);
  if (lr) *lr = o->groups[i].lr;
  if (weight_decay) *weight_decay = o->groups[i].weight_decay;
  if (n_params) *n_params = o->groups[i].n;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

td_status td_optim_set_group_lr(td_optim *o, size_t i, double lr) {
  TD_CHECK_ARG(o, "td_optim_set_group_lr: NULL optimizer");
  TD_CHECK_ARG(i < o->n_groups, "td_optim_set_group_lr: group %zu of %zu", i, o->n_groups);
  TD_CHECK_ARG(lr >= 0, "%s: invalid learning rate: %g", td_optim_kind_name(o->o.kind), lr);
  pthread_mutex_lock(&o->mu);
  o->groups[i].lr = lr;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

int64_t td_optim_step_count(td_optim *o, size_t i) {
  if (!o || i >= o->n) return 0;
  pthread_mutex_lock(&o->mu);
  int64_t n = o->slots[i].step;
  pthread_mutex_unlock(&o->mu);
  return n;
}

/* Makes nb[0..3) (new references, taken over) parameter i's state and step its count when st
 * is TD_OK; else drops them and returns st. */
static td_status install_state(td_optim *o, size_t i, td_tensor *nb[3], int64_t step,
                               td_status st) {
  if (st != TD_OK) {
    for (int b = 0; b < 3; b++) td_tensor_unref(nb[b]);
    return st;
  }
  pthread_mutex_lock(&o->mu);
  for (int b = 0; b < 3; b++) {
    if (!nb[b] && o->o.kind == TD_OPTIM_ADAGRAD && b == 0) continue; /* sum exists from the start */
    td_tensor_unref(o->slots[i].buf[b]);
    o->slots[i].buf[b] = nb[b];
  }
  o->slots[i].step = step;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

td_status td_optim_state_adopt(td_optim *o, size_t i, td_tensor *const bufs[3], int64_t step) {
  TD_CHECK_ARG(o && bufs && i < o->n && step >= 0, "td_optim_state_adopt: bad optimizer, "
               "parameter %zu, bufs or step %lld", i, (long long)step);
  const td_tensor *p = o->slots[i].param;
  td_tensor *nb[3] = {0};
  td_status st = TD_OK;
  for (int b = 0; st == TD_OK && b < 3; b++) {
    if (!bufs[b]) continue;
    td_device d = td_tensor_device(bufs[b]), pd = td_tensor_device(p);
    if (td_tensor_numel(bufs[b]) != td_tensor_numel(p) ||
        td_tensor_dtype(bufs[b]) != td_tensor_dtype(p) || !td_tensor_is_contiguous(bufs[b]) ||
        d.type != pd.type || d.index != pd.index)
      st = td_set_error(TD_ERR_SHAPE, "td_optim_state_adopt: state %d of parameter %zu is not "
                        "a contiguous tensor of the parameter's element count, dtype and device",
                        b, i);
    else
      st = td_tensor_reshape(bufs[b], td_tensor_shape(p), td_tensor_ndim(p), &nb[b]);
  }
  return install_state(o, i, nb, step, st);
}

td_status td_optim_state_set_step(td_optim *o, size_t i, int64_t step) {
  TD_CHECK_ARG(o && i < o->n && step >= 0, "td_optim_state_set_step: bad optimizer, parameter "
               "%zu or step %lld", i, (long long)step);
  pthread_mutex_lock(&o->mu);
  o->slots[i].step = step;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

/* ---- state (checkpoints) ---- */

td_status td_optim_state_get(td_optim *o, size_t i, td_tensor *bufs[3], int64_t *step) {
  TD_CHECK_ARG(o && bufs, "td_optim_state_get: NULL optimizer or bufs");
  TD_CHECK_ARG(i < o->n, "td_optim_state_get: parameter %zu of %zu", i, o->n);
  pthread_mutex_lock(&o->mu);
  for (int b = 0; b < 3; b++) bufs[b] = o->slots[i].buf[b] ? td_tensor_ref(o->slots[i].buf[b]) : NULL;
  if (step) *step = o->slots[i].step;
  pthread_mutex_unlock(&o->mu);
  return TD_OK;
}

td_status td_optim_state_set(td_optim *o, size_t i, td_tensor *const bufs[3], int64_t step) {
  TD_CHECK_ARG(o && bufs, "td_optim_state_set: NULL optimizer or bufs");
  TD_CHECK_ARG(i < o->n, "td_optim_state_set: parameter %zu of %zu", i, o->n);
  TD_CHECK_ARG(step >= 0, "td_optim_state_set: negative step %lld", (long long)step);
  const td_tensor *p = o->slots[i].param;
  for (int b = 0; b < 3; b++) {
    if (!bufs[b]) continue;
    char a[96], w[96];
    if (td_tensor_numel(bufs[b]) != td_tensor_numel(p))
      return td_set_error(TD_ERR_SHAPE, "td_optim_state_set: state %d of parameter %zu has shape "
                          "%s; the parameter %s", b, i, td_tensor_shape_str(bufs[b], a, sizeof a),
                          td_tensor_shape_str(p, w, sizeof w));
  }
  td_tensor *nb[3] = {0};
  td_status st = TD_OK;
  bool prev = td_autograd_set_enabled(false);
  for (int b = 0; st == TD_OK && b < 3; b++) { /* copies next to the parameter, in its dtype */
    if (!bufs[b]) continue;
    st = full_like(p, 0.0, &nb[b]);
    td_tensor *moved = NULL, *src = NULL;
    if (st == TD_OK) st = td_tensor_to(bufs[b], td_tensor_device(p), &moved);
    if (st == TD_OK) st = td_tensor_reshape(moved, td_tensor_shape(p), td_tensor_ndim(p), &src);
    if (st == TD_OK) st = td_tensor_copy_(nb[b], src);
    td_tensor_unref(src);
    td_tensor_unref(moved);
  }
  td_autograd_set_enabled(prev);
  return install_state(o, i, nb, step, st);
}

/* ---- gradient clipping ---- */

/* grad_norm_pow returns sum(|g|^p) (p finite) or max(|g|) (p infinite) of one gradient, through
 * the device-independent tensor ops (float32 sums accumulate in double inside the kernel). */
static td_status grad_norm_pow(const td_tensor *g, double p, double *out) {
  td_tensor *neg = NULL, *a = NULL, *pw = NULL, *flat = NULL, *r = NULL;
  td_status st = TD_OK;
  if (p == 2.0) {
    CK(td_tensor_mul(g, g, &pw));
    CK(td_tensor_sum_all(pw, &r));
  } else {
    CK(td_tensor_neg(g, &neg));
    CK(td_tensor_maximum(g, neg, &a)); /* |g|, NaN kept */
    if (isinf(p)) {
      int64_t n = td_tensor_numel(a);
      CK(td_tensor_reshape(a, &n, 1, &flat));
      CK(td_tensor_max(flat, 0, false, &r, NULL));
    } else {
      CK(td_tensor_pow_scalar(a, p, &pw));
      CK(td_tensor_sum_all(pw, &r));
    }
  }
  CK(td_tensor_item(r, out));
out:
  td_tensor_unref(neg);
  td_tensor_unref(a);
  td_tensor_unref(pw);
  td_tensor_unref(flat);
  td_tensor_unref(r);
  return st;
}

td_status td_optim_clip_grad_norm(td_optim *o, double max_norm, double norm_type,
                                  double *total_norm) {
  TD_CHECK_ARG(o, "td_optim_clip_grad_norm: NULL optimizer");
  TD_CHECK_ARG(max_norm >= 0, "clip_grad_norm: invalid max_norm %g", max_norm);
  TD_CHECK_ARG(norm_type > 0, "clip_grad_norm: invalid norm_type %g", norm_type);
  td_tensor **grads = td__calloc(o->n ? o->n : 1, sizeof *grads);
  if (!grads) return td_set_error(TD_ERR_NOMEM, "clip_grad_norm: out of memory");
  bool prev = td_autograd_set_enabled(false);
  pthread_mutex_lock(&o->mu);
  td_status st = TD_OK;
  double acc = 0.0;
  for (size_t i = 0; i < o->n; i++) grads[i] = td_tensor_grad(o->slots[i].param);
  if (norm_type == 2.0) { /* one reduction over the list: one host synchronisation on CUDA */
    CK(td_tensor_sum_squares((const td_tensor *const *)grads, o->n, &acc));
  } else {
    for (size_t i = 0; i < o->n; i++) {
      if (!grads[i] || td_tensor_numel(grads[i]) == 0) continue;
      double v = 0.0;
      CK(grad_norm_pow(grads[i], norm_type, &v));
      if (isinf(norm_type)) acc = (v > acc || isnan(v)) ? v : acc;
      else acc += v;
    }
  }
  double total = isinf(norm_type) ? acc : (norm_type == 2.0 ? sqrt(acc) : pow(acc, 1.0 / norm_type));
  /* clip_coef = max_norm / (total_norm + 1e-6); clamp(max=1.0); g.mul_(clip_coef_clamped). A
   * factor of exactly 1 leaves the gradients as they are, so it is skipped. */
  double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) {
    for (size_t i = 0; i < o->n; i++)
      if (grads[i]) CK(td_tensor_mul_scalar_(grads[i], coef));
  }
  if (total_norm) *total_norm = total;
out:
  pthread_mutex_unlock(&o->mu);
  td_autograd_set_enabled(prev);
  for (size_t i = 0; i < o->n; i++) td_tensor_unref(grads[i]);
  td__free(grads);
  return st;
}

/* ---- schedule ---- */

double td_optim_lr_warmup_cosine(int64_t step, int64_t warmup, int64_t decay_steps, double lr,
                                 double min_lr) {
  if (step < warmup) return lr * (double)(step + 1) / (double)(warmup + 1);
  if (step > decay_steps || decay_steps <= warmup) return min_lr;
  double ratio = (double)(step - warmup) / (double)(decay_steps - warmup);
  double coeff = 0.5 * (1.0 + cos(M_PI * ratio));
  return min_lr + coeff * (lr - min_lr);
}
