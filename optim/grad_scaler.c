/* grad_scaler.c - dynamic loss scaling for low-precision training: PyTorch's GradScaler rule
 * (torch.cuda.amp.GradScaler, PyTorch 1.13) over tdist's optimizers (tdist/optim.h).
 *
 * An iteration is what happens between two td_grad_scaler_update calls:
 *   scale(loss)        loss * scale (a differentiable op: backward yields scale * gradients)
 *   unscale            gradients *= 1 / scale, and this process's `local_inf` |= "a gradient
 *                      held an inf or a NaN" (checked on the scaled values, as PyTorch's
 *                      _amp_foreach_non_finite_check_and_unscale_); per optimizer once
 *   found_inf          the decision every replica acts on: the first call of the iteration runs
 *                      the agreement (td_grad_scaler_agree_fn: e.g. an all_reduce MAX over a
 *                      data-parallel group, collectives/grad_scaler.c), later calls return the
 *                      same answer; no agreement: the local flag
 *   step(optimizer)    the optimizer's step unless found_inf (unscaling first if needed)
 *   update             found_inf: scale *= backoff_factor, growth tracker 0 (the step was
 *                      skipped); else tracker + 1, and at growth_interval scale *= growth_factor
 *                      (kept only when finite in float32, as _amp_update_scale_) and tracker 0
 * The iteration's flags are cleared by update. Invariants: the decision is taken once per
 * iteration (after it, unscaling more gradients is refused: they could not change it), so every
 * replica that shares the agreement skips the same steps and moves its scale alike.
 *
 * Unscaling: contiguous float32 / float64 CPU gradients in one pass (check, then multiply);
 * anything else through tensor ops (sum of g * 0 is NaN exactly when g holds an inf or a NaN,
 * then an in-place multiply), so any device and dtype the tensor layer computes in works.
 *
 * Not locked: one thread uses a scaler at a time (the training loop's).
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../core/core.h"
#include "tdist/nn.h"
#include "tdist/optim.h"

typedef struct opt_entry {
  const td_optim *opt;
  bool unscaled, stepped; /* this iteration */
} opt_entry;

struct td_grad_scaler {
  td_grad_scaler_options o;
  double scale;
  int64_t growth_tracker;
  /* this iteration */
  bool checked;   /* gradients were unscaled */
  bool local_inf; /* this process's unscales met an inf or a NaN */
  bool agreed;    /* the decision was taken */
  bool found;     /* the decision */
  opt_entry *opts;
  size_t nopts, cap;
  td_grad_scaler_agree_fn agree;
  void *agree_ctx;
  td_grad_scaler_stats stats;
};

void td_grad_scaler_options_init(td_grad_scaler_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->init_scale = 65536.0; /* 2^16 */
  o->growth_factor = 2.0;
  o->backoff_factor = 0.5;
  o->growth_interval = 2000;
  o->dynamic = true;
}

static td_status check_options(const td_grad_scaler_options *o, const char *what) {
  if (!(o->init_scale > 0) || isinf(o->init_scale) || o->init_scale > FLT_MAX)
    return td_set_error(TD_ERR_INVALID, "%s: init_scale %g must be > 0 and a finite float32",
                        what, o->init_scale);
  if (!o->dynamic) return TD_OK;
  if (!(o->growth_factor > 1.0) || isinf(o->growth_factor))
    return td_set_error(TD_ERR_INVALID, "%s: growth_factor %g must be finite and > 1", what,
                        o->growth_factor);
  if (!(o->backoff_factor > 0 && o->backoff_factor < 1.0))
    return td_set_error(TD_ERR_INVALID, "%s: backoff_factor %g must be in (0, 1)", what,
                        o->backoff_factor);
  if (o->growth_interval < 1)
    return td_set_error(TD_ERR_INVALID, "%s: growth_interval %lld must be >= 1", what,
                        (long long)o->growth_interval);
  return TD_OK;
}

td_status td_grad_scaler_create(const td_grad_scaler_options *opts, td_grad_scaler **out) {
  TD_CHECK_ARG(out, "grad_scaler_create: NULL out");
  td_grad_scaler_options o;
  if (opts) o = *opts;
  else td_grad_scaler_options_init(&o);
  TD_TRY(check_options(&o, "grad_scaler_create"));
  td_grad_scaler *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "grad_scaler_create: out of memory");
  s->o = o;
  s->scale = (double)(float)o.init_scale; /* PyTorch keeps the scale in a float32 tensor */
  *out = s;
  return TD_OK;
}

void td_grad_scaler_destroy(td_grad_scaler *s) {
  if (!s) return;
  td__free(s->opts);
  td__free(s);
}

double td_grad_scaler_get_scale(const td_grad_scaler *s) { return s ? s->scale : NAN; }

void td_grad_scaler_set_agreement(td_grad_scaler *s, td_grad_scaler_agree_fn fn, void *ctx) {
  if (!s) return;
  s->agree = fn;
  s->agree_ctx = fn ? ctx : NULL;
}

td_status td_grad_scaler_scale(td_grad_scaler *s, const td_tensor *loss, td_tensor **out) {
  TD_CHECK_ARG(s && loss && out, "grad_scaler_scale: NULL argument");
  return td_tensor_mul_scalar(loss, s->scale, out);
}

/* ---- unscaling ---- */

/* Contiguous float32 / float64 on the CPU: checks every value, then multiplies. */
static bool unscale_host(td_tensor *g, double inv) {
  int64_t n = td_tensor_numel(g);
  bool bad = false;
  if (td_tensor_dtype(g) == TD_DTYPE_F64) {
    double *v = td_tensor_data(g);
    for (int64_t i = 0; i < n; i++) bad |= !isfinite(v[i]);
    for (int64_t i = 0; i < n; i++) v[i] *= inv;
  } else {
    float *v = td_tensor_data(g), f = (float)inv;
    for (int64_t i = 0; i < n; i++) bad |= !isfinite(v[i]);
    for (int64_t i = 0; i < n; i++) v[i] *= f;
  }
  return bad;
}

/* Any other tensor: sum(g * 0) is NaN exactly when g holds an inf or a NaN. */
static td_status unscale_ops(td_tensor *g, double inv, bool *bad) {
  td_tensor *z = NULL, *sum = NULL;
  double v = 0;
  td_status st = td_tensor_mul_scalar(g, 0.0, &z);
  if (st == TD_OK) st = td_tensor_sum_all(z, &sum);
  if (st == TD_OK) st = td_tensor_item(sum, &v);
  if (st == TD_OK) st = td_tensor_mul_scalar_(g, inv);
  if (st == TD_OK) *bad = !isfinite(v);
  td_tensor_unref(z);
  td_tensor_unref(sum);
  return st;
}

td_status td_grad_scaler_unscale_grads_(td_grad_scaler *s, td_tensor *const *grads, size_t n) {
  TD_CHECK_ARG(s && (grads || !n), "grad_scaler_unscale_grads_: NULL argument");
  if (s->agreed)
    return td_set_error(TD_ERR_STATE, "grad_scaler: gradients unscaled after this iteration's "
                        "inf check was decided (unscale every optimizer before the first step, "
                        "then td_grad_scaler_update)");
  double inv = 1.0 / s->scale;
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < n; i++) {
    td_tensor *g = grads[i];
    if (!g) continue;
    td_dtype dt = td_tensor_dtype(g);
    bool bad = false;
    if (td_tensor_device(g).type == TD_DEVICE_CPU && td_tensor_is_contiguous(g) &&
        (dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64))
      bad = unscale_host(g, inv);
    else
      st = unscale_ops(g, inv, &bad);
    if (st != TD_OK) st = td__error_prefix(st, "grad_scaler: unscaling gradient %zu", i);
    s->local_inf |= bad;
  }
  td_autograd_set_enabled(prev);
  s->checked = true; /* a failure half-way still counts: the gradients are no longer whole */
  return st;
}

/* The entry of optimizer opt in this iteration (added when new). */
static td_status entry_of(td_grad_scaler *s, const td_optim *opt, opt_entry **out) {
  for (size_t i = 0; i < s->nopts; i++)
    if (s->opts[i].opt == opt) return (*out = &s->opts[i]), TD_OK;
  if (s->nopts == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 4;
    opt_entry *e = td__realloc(s->opts, cap * sizeof *e);
    if (!e) return td_set_error(TD_ERR_NOMEM, "grad_scaler: out of memory");
    s->opts = e, s->cap = cap;
  }
  s->opts[s->nopts] = (opt_entry){opt, false, false};
  *out = &s->opts[s->nopts++];
  return TD_OK;
}

td_status td_grad_scaler_unscale_(td_grad_scaler *s, td_optim *opt) {
  TD_CHECK_ARG(s && opt, "grad_scaler_unscale_: NULL argument");
  opt_entry *e = NULL;
  TD_TRY(entry_of(s, opt, &e));
  if (e->unscaled)
    return td_set_error(TD_ERR_STATE, "grad_scaler_unscale_: already called for this optimizer "
                        "since the last update");
  size_t n = td_optim_num_params(opt);
  td_tensor **g = td__calloc(n ? n : 1, sizeof *g);
  if (!g) return td_set_error(TD_ERR_NOMEM, "grad_scaler_unscale_: out of memory");
  for (size_t i = 0; i < n; i++) g[i] = td_tensor_grad(td_optim_param(opt, i));
  td_status st = td_grad_scaler_unscale_grads_(s, g, n);
  for (size_t i = 0; i < n; i++) td_tensor_unref(g[i]);
  td__free(g);
  if (st == TD_OK) e->unscaled = true;
  return st;
}

/* ---- the decision ---- */

td_status td_grad_scaler_found_inf_ex(td_grad_scaler *s, td_grad_scaler_agree_fn fn, void *ctx,
                                      bool *found) {
  TD_CHECK_ARG(s && found, "grad_scaler_found_inf: NULL argument");
  if (!s->checked)
    return td_set_error(TD_ERR_STATE, "grad_scaler: no gradients were unscaled in this iteration "
                        "(td_grad_scaler_unscale_ or td_grad_scaler_step first)");
  if (!s->agreed) {
    bool f = s->local_inf;
    td_status st = fn ? fn(ctx, &f) : TD_OK;
    if (st != TD_OK) return td__error_prefix(st, "grad_scaler: agreeing on found_inf");
    s->found = f;
    s->agreed = true;
  }
  *found = s->found;
  return TD_OK;
}

td_status td_grad_scaler_found_inf(td_grad_scaler *s, bool *found) {
  TD_CHECK_ARG(s, "grad_scaler_found_inf: NULL scaler");
  return td_grad_scaler_found_inf_ex(s, s->agree, s->agree_ctx, found);
}

td_status td_grad_scaler_step(td_grad_scaler *s, td_optim *opt, bool *stepped) {
  TD_CHECK_ARG(s && opt, "grad_scaler_step: NULL argument");
  opt_entry *e = NULL;
  TD_TRY(entry_of(s, opt, &e));
  if (e->stepped)
    return td_set_error(TD_ERR_STATE, "grad_scaler_step: already called for this optimizer "
                        "since the last update");
  if (!e->unscaled) TD_TRY(td_grad_scaler_unscale_(s, opt));
  bool found = false;
  TD_TRY(td_grad_scaler_found_inf(s, &found));
  if (!found) TD_TRY(td_optim_step(opt));
  TD_TRY(entry_of(s, opt, &e)); /* the array may have moved */
  e->stepped = true;
  if (stepped) *stepped = !found;
  return TD_OK;
}

td_status td_grad_scaler_update(td_grad_scaler *s) {
  TD_CHECK_ARG(s, "grad_scaler_update: NULL scaler");
  if (!s->checked)
    return td_set_error(TD_ERR_STATE, "grad_scaler_update: no inf checks were recorded in this "
                        "iteration (unscale or step before update)");
  bool found = false;
  TD_TRY(td_grad_scaler_found_inf(s, &found));
  if (found) {
    s->stats.skipped_steps++;
    if (s->o.dynamic) {
      s->scale = (double)(float)(s->scale * s->o.backoff_factor);
      s->growth_tracker = 0;
      s->stats.backoffs++;
    }
  } else if (s->o.dynamic) {
    int64_t successful = s->growth_tracker + 1;
    if (successful == s->o.growth_interval) {
      float grown = (float)(s->scale * s->o.growth_factor);
      if (isfinite(grown)) s->scale = (double)grown, s->stats.growths++;
      s->growth_tracker = 0;
    } else {
      s->growth_tracker = successful;
    }
  }
  s->stats.updates++;
  s->checked = s->local_inf = s->agreed = s->found = false;
  s->nopts = 0;
  return TD_OK;
}

/* ---- state ---- */

td_status td_grad_scaler_get_stats(const td_grad_scaler *s, td_grad_scaler_stats *out) {
  TD_CHECK_ARG(s && out, "grad_scaler_get_stats: NULL argument");
  *out = s->stats;
  return TD_OK;
}

td_status td_grad_scaler_get_state(const td_grad_scaler *s, td_grad_scaler_state *out) {
  TD_CHECK_ARG(s && out, "grad_scaler_get_state: NULL argument");
  out->scale = s->scale;
  out->growth_tracker = s->growth_tracker;
  return TD_OK;
}

td_status td_grad_scaler_set_state(td_grad_scaler *s, const td_grad_scaler_state *in) {
  TD_CHECK_ARG(s && in, "grad_scaler_set_state: NULL argument");
  TD_CHECK_ARG(in->scale > 0 && in->scale <= FLT_MAX, "grad_scaler_set_state: scale %g must be "
               "> 0 and a finite float32", in->scale);
  TD_CHECK_ARG(in->growth_tracker >= 0, "grad_scaler_set_state: growth_tracker %lld must be >= 0",
               (long long)in->growth_tracker);
  if (s->checked)
    return td_set_error(TD_ERR_STATE, "grad_scaler_set_state: in the middle of an iteration "
                        "(after unscale, before update)");
  s->scale = (double)(float)in->scale;
  s->growth_tracker = in->growth_tracker;
  return TD_OK;
}

/* The five entries of PyTorch's GradScaler.state_dict(), in its order. */
static const char *const keys[5] = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                                    "_growth_tracker"};

static void key(char *buf, size_t n, const char *prefix, int k) {
  snprintf(buf, n, "%s%s", prefix ? prefix : "", keys[k]);
}

td_status td_grad_scaler_state_dict(const td_grad_scaler *s, const char *prefix,
                                    td_tensor_list *out) {
  TD_CHECK_ARG(s && out, "grad_scaler_state_dict: NULL argument");
  double v[5] = {s->scale, s->o.growth_factor, s->o.backoff_factor,
                 (double)s->o.growth_interval, (double)s->growth_tracker};
  td_status st = TD_OK;
  for (int k = 0; st == TD_OK && k < 5; k++) {
    char name[256];
    td_tensor *t = NULL;
    key(name, sizeof name, prefix, k);
    st = td_tensor_scalar(v[k], k >= 3 ? TD_DTYPE_I64 : TD_DTYPE_F64, td_device_cpu(), &t);
    if (st == TD_OK) st = td_tensor_list_append(out, name, t);
    td_tensor_unref(t);
  }
  return st;
}

td_status td_grad_scaler_load_state_dict(td_grad_scaler *s, const char *prefix,
                                         const td_tensor_list *sd) {
  TD_CHECK_ARG(s && sd, "grad_scaler_load_state_dict: NULL argument");
  double v[5];
  bool have[5];
  for (int k = 0; k < 5; k++) {
    char name[256];
    key(name, sizeof name, prefix, k);
    td_tensor *t = td_tensor_list_find(sd, name);
    have[k] = t != NULL;
    if (!t && (k == 0 || k == 4))
      return td_set_error(TD_ERR_INVALID, "grad_scaler_load_state_dict: no \"%s\"", name);
    if (t && td_tensor_numel(t) != 1)
      return td_set_error(TD_ERR_SHAPE, "grad_scaler_load_state_dict: \"%s\" has %lld elements, "
                          "not 1", name, (long long)td_tensor_numel(t));
    if (t) TD_TRY(td_tensor_item(t, &v[k]));
  }
  td_grad_scaler_options o = s->o;
  if (have[1]) o.growth_factor = v[1];
  if (have[2]) o.backoff_factor = v[2];
  if (have[3]) o.growth_interval = (int64_t)v[3];
  TD_TRY(check_options(&o, "grad_scaler_load_state_dict"));
  td_grad_scaler_state state = {v[0], (int64_t)v[4]};
  TD_TRY(td_grad_scaler_set_state(s, &state));
  s->o.growth_factor = o.growth_factor;
  s->o.backoff_factor = o.backoff_factor;
  s->o.growth_interval = o.growth_interval;
  return TD_OK;
}
