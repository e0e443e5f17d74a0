/* forward.c - running a module's forward: its autocast scope, its hooks and activation
 * checkpointing (nn.h).
 *
 * A forward is the module's autocast scope (td_module_set_autocast), when it has one, around
 * three layers, each calling the next:
 *   hooked  the module's hook entries: pre hooks in registration order, the core, post hooks in
 *           registration order (a failing pre hook runs the post hooks of the entries before it);
 *   core    with TD_CHECKPOINT_FULL and grad mode on: td_checkpoint over "recompute", which is the
 *           body in the forward phase and hooked(body) in the recompute phase, so the hooks run
 *           around every run of the forward (ZeRO-3 gathers the unit's parameters again before
 *           the recompute); otherwise the body;
 *   body    the type's forward; with TD_CHECKPOINT_SELECTIVE it must mark a region
 *           (td_module_checkpoint_region), counted in a thread-local frame of the module whose
 *           forward runs.
 * In forward the hooks thus run outside the checkpointed region: a post hook sees (and may wrap)
 * outputs that require grad, as without checkpointing.
 *
 * Hook entries live in the module (an array in registration order, each with a handle from one
 * process-wide counter); changing them is a structural call (not during a forward on m).
 * Invariants: the selective frame is restored by the body that set it, on every path.
 * Lock order: none (module structure is not locked: see nn.h).
 */
#include <stdio.h>
#include <string.h>

#include "modules_impl.h"

static int next_handle;

/* ---- hooks ---- */

static td_status hook_push(td_module *m, td_module_pre_hook_fn pre, td_module_post_hook_fn post,
                           void *ctx, bool legacy, int *handle) {
  if (m->n_hooks == m->cap_hooks) {
    int cap = m->cap_hooks ? 2 * m->cap_hooks : 2;
    td__mhook *h = td__realloc(m->hooks, (size_t)cap * sizeof *h);
    if (!h) return td_set_error(TD_ERR_NOMEM, "%s: out of memory adding forward hooks",
                                m->type->name);
    m->hooks = h;
    m->cap_hooks = cap;
  }
  int id = __atomic_add_fetch(&next_handle, 1, __ATOMIC_RELAXED);
  m->hooks[m->n_hooks++] = (td__mhook){id, pre, post, ctx, legacy};
  if (handle) *handle = id;
  return TD_OK;
}

static void hook_remove_at(td_module *m, int i) {
  memmove(&m->hooks[i], &m->hooks[i + 1], (size_t)(m->n_hooks - i - 1) * sizeof *m->hooks);
  m->n_hooks--;
}

td_status td_module_add_forward_hooks(td_module *m, td_module_pre_hook_fn pre,
                                      td_module_post_hook_fn post, void *ctx, int *handle) {
  TD_CHECK_ARG(m, "td_module_add_forward_hooks: NULL module");
  TD_CHECK_ARG(pre || post, "td_module_add_forward_hooks(%s): neither a pre nor a post hook",
               m->type->name);
  return hook_push(m, pre, post, ctx, false, handle);
}

td_status td_module_remove_forward_hooks(td_module *m, int handle) {
  TD_CHECK_ARG(m, "td_module_remove_forward_hooks: NULL module");
  for (int i = 0; i < m->n_hooks; i++)
    if (m->hooks[i].handle == handle && !m->hooks[i].legacy) {
      hook_remove_at(m, i);
      return TD_OK;
    }
  return td_set_error(TD_ERR_NOT_FOUND, "td_module_remove_forward_hooks: %s has no forward hooks "
                      "with handle %d", m->type->name, handle);
}

td_status td_module_set_forward_hooks(td_module *m, td_module_pre_hook_fn pre,
                                      td_module_post_hook_fn post, void *ctx) {
  TD_CHECK_ARG(m, "td_module_set_forward_hooks: NULL module");
  int at = -1;
  for (int i = 0; i < m->n_hooks && at < 0; i++)
    if (m->hooks[i].legacy) at = i;
  if (!pre && !post) {
    if (at >= 0) hook_remove_at(m, at);
    return TD_OK;
  }
  if (at >= 0)
    return td_set_error(TD_ERR_STATE, "td_module_set_forward_hooks: %s already has forward hooks "
                        "(clear them first)", m->type->name);
  return hook_push(m, pre, post, ctx, true, NULL);
}

typedef td_status (*forward_fn)(td_module *m, td_tensor *const *in, int n_in, td_tensor **out,
                                int n_out);

/* Runs the post hooks of entries [0, n) after a forward that ended with st. */
static td_status run_post(td_module *m, int n, td_status st, td_tensor **out, int n_out) {
  char msg[512] = "";
  if (st != TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
  td_status hs = TD_OK;
  for (int i = 0; i < n; i++) {
    if (!m->hooks[i].post) continue;
    td_status s = m->hooks[i].post(m->hooks[i].ctx, m, st == TD_OK ? hs : st, out, n_out);
    if (s != TD_OK && hs == TD_OK) {
      hs = s;
      if (st == TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
    }
  }
  if (st == TD_OK && hs == TD_OK) return TD_OK;
  if (st == TD_OK) /* a post hook failed: the outputs go */
    for (int i = 0; i < n_out; i++) {
      td_tensor_unref(out[i]);
      out[i] = NULL;
    }
  return td_set_error(st != TD_OK ? st : hs, "%s", msg); /* the first failure's message */
}

/* fn between m's hooks. */
static td_status hooked(td_module *m, forward_fn fn, td_tensor *const *in, int n_in,
                        td_tensor **out, int n_out) {
  if (!m->n_hooks) return fn(m, in, n_in, out, n_out);
  int n = m->n_hooks;
  for (int i = 0; i < n; i++) {
    if (!m->hooks[i].pre) continue;
    td_status st = m->hooks[i].pre(m->hooks[i].ctx, m);
    if (st != TD_OK) return run_post(m, i, st, out, 0);
  }
  td_status st = fn(m, in, n_in, out, n_out);
  return run_post(m, n, st, out, n_out);
}

/* ---- checkpointing ---- */

/* The module whose selective forward runs on this thread, and the regions it marked. */
static _Thread_local const td_module *sel_module;
static _Thread_local int sel_regions;

static td_status body(td_module *m, td_tensor *const *in, int n_in, td_tensor **out, int n_out) {
  if (m->ckpt != TD_CHECKPOINT_SELECTIVE) return m->type->forward(m, in, n_in, out, n_out);
  const td_module *up_module = sel_module;
  int up_regions = sel_regions;
  sel_module = m, sel_regions = 0;
  td_status st = m->type->forward(m, in, n_in, out, n_out);
  int marked = sel_regions;
  sel_module = up_module, sel_regions = up_regions;
  if (st != TD_OK || marked || !td_autograd_is_enabled()) return st;
  for (int i = 0; i < n_out; i++) {
    td_tensor_unref(out[i]);
    out[i] = NULL;
  }
  return td_set_error(TD_ERR_UNSUPPORTED, "%s: selective activation checkpointing is set but its "
                      "forward marks no region to recompute (td_module_checkpoint_region; the GPT "
                      "attention modules mark their attention core)", m->type->name);
}

/* The checkpointed function of a FULL module: the body in forward (the hooks ran outside the
 * region), the hooks and the body in the recompute. */
static td_status recompute_fn(void *ctx, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  td_module *m = ctx;
  if (td_checkpoint_current(NULL) == TD_CHECKPOINT_PHASE_RECOMPUTE)
    return hooked(m, body, in, n_in, out, n_out);
  return body(m, in, n_in, out, n_out);
}

static void release_module(void *ctx) { td_module_unref(ctx); }

static bool has_grad_params(const td_module *m) {
  for (int i = 0; i < m->n_params; i++)
    if (td_tensor_requires_grad(m->params[i].t)) return true;
  for (int i = 0; i < m->n_children; i++)
    if (has_grad_params(m->children[i].m)) return true;
  return false;
}

static td_status core(td_module *m, td_tensor *const *in, int n_in, td_tensor **out, int n_out) {
  if (m->ckpt != TD_CHECKPOINT_FULL || !td_autograd_is_enabled())
    return body(m, in, n_in, out, n_out);
  td_checkpoint_opts o = {.name = m->type->name, .reads_params = has_grad_params(m),
                          .release = release_module};
  return td_checkpoint(recompute_fn, td_module_ref(m), in, n_in, out, n_out, &o);
}

td_status td_module_set_checkpoint(td_module *m, td_checkpoint_mode mode) {
  TD_CHECK_ARG(m, "td_module_set_checkpoint: NULL module");
  TD_CHECK_ARG(mode == TD_CHECKPOINT_NONE || mode == TD_CHECKPOINT_FULL ||
                   mode == TD_CHECKPOINT_SELECTIVE,
               "td_module_set_checkpoint(%s): unknown mode %d", m->type->name, (int)mode);
  m->ckpt = mode;
  return TD_OK;
}

td_checkpoint_mode td_module_get_checkpoint(const td_module *m) {
  return m ? m->ckpt : TD_CHECKPOINT_NONE;
}

td_status td_module_checkpoint_region(td_module *m, const char *name, td_checkpoint_fn fn,
                                      void *ctx, td_tensor *const *inputs, int n_inputs,
                                      td_tensor **outputs, int n_outputs) {
  TD_CHECK_ARG(m && fn, "td_module_checkpoint_region: NULL module or function");
  if (m->ckpt != TD_CHECKPOINT_SELECTIVE) {
    TD_CHECK_ARG(outputs && n_outputs > 0 && n_inputs >= 0 && (inputs || !n_inputs),
                 "td_module_checkpoint_region(%s): invalid inputs or outputs", m->type->name);
    return fn(ctx, inputs, n_inputs, outputs, n_outputs);
  }
  if (sel_module == m) sel_regions++;
  td_checkpoint_opts o = {.name = name ? name : m->type->name};
  return td_checkpoint(fn, ctx, inputs, n_inputs, outputs, n_outputs, &o);
}

/* ---- autocast and forward ---- */

td_status td_module_set_autocast(td_module *m, bool enabled, td_dtype dt) {
  TD_CHECK_ARG(m, "td_module_set_autocast: NULL module");
  if (enabled && dt != TD_DTYPE_BF16 && dt != TD_DTYPE_F16 && dt != TD_DTYPE_F32 &&
      dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "td_module_set_autocast: %s is not an autocast dtype "
                        "(bfloat16, float16; float32 or float64 for full precision)",
                        td_dtype_name(dt));
  m->autocast = enabled;
  m->autocast_dt = dt;
  return TD_OK;
}

/* The hooked forward inside m's autocast scope, when it has one (a checkpointed region inside
 * records the scope and recomputes in it). */
static td_status forward_scoped(td_module *m, td_tensor *const *inputs, int n_inputs,
                                td_tensor **outputs, int n_outputs) {
  if (!m->autocast) return hooked(m, core, inputs, n_inputs, outputs, n_outputs);
  TD_TRY(td_autocast_begin(m->autocast_dt));
  td_status st = hooked(m, core, inputs, n_inputs, outputs, n_outputs);
  td_autocast_end();
  return st;
}

td_status td_module_forward_multi(td_module *m, td_tensor *const *inputs, int n_inputs,
                                  td_tensor **outputs, int n_outputs) {
  TD_CHECK_ARG(m, "td_module_forward: NULL module");
  TD_CHECK_ARG(n_inputs >= 0 && (inputs || n_inputs == 0),
               "%s.forward: NULL inputs array", m->type->name);
  TD_CHECK_ARG(outputs && n_outputs > 0, "%s.forward: NULL outputs array", m->type->name);
  return forward_scoped(m, inputs, n_inputs, outputs, n_outputs);
}

td_status td_module_forward(td_module *m, const td_tensor *x, td_tensor **y) {
  TD_CHECK_ARG(m, "td_module_forward: NULL module");
  TD_CHECK_ARG(x, "%s.forward: NULL input", m->type->name);
  TD_CHECK_ARG(y, "%s.forward: NULL output", m->type->name);
  td_tensor *in[1] = {(td_tensor *)x};
  return forward_scoped(m, in, 1, y, 1);
}
