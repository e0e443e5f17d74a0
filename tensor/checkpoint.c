/* checkpoint.c - activation checkpointing: td_checkpoint and its backward node (autograd.h).
 *
 * Forward: the region is pushed on this thread's stack of running regions (name, phase,
 * generator records), fn runs with grad mode off, the region is popped. One node,
 * "CheckpointBackward", keeps what a second run needs: fn and its ctx, detached views of the
 * inputs (no copy), and each generator fn drew from with a clone of its state before the first
 * draw. Its edges are the inputs' histories; the float outputs are detached and attached as its
 * outputs (so an output that is an input, or a view of one, works too).
 *
 * Backward (the node's backward, on the thread running the pass, where grad mode is off):
 *   1. each recorded generator's current state is kept aside and the recorded state set;
 *   2. a "CheckpointInputs" node without edges gets views of the saved inputs that required grad
 *      as its outputs (the other inputs are passed as saved), and fn runs again with grad mode
 *      on, as a region in its recompute phase;
 *   3. the generators get back the states kept in 1 (the recompute draws nothing visible);
 *      the recompute runs in the autocast state the forward ran in (a scope of its dtype, or one
 *      with autocast off), which the engine otherwise suspends around backward functions;
 *   4. a nested engine pass runs from the recomputed outputs that received a gradient, with those
 *      gradients, without retain_graph, and with the gradient map of the pass running this node
 *      (td__autograd_pass_opts: a distributed autograd context's map reaches the parameters);
 *      parameters accumulate there as usual (their hooks run), and CheckpointInputs's backward
 *      collects the inputs' gradients, which the node returns.
 * Both nodes mark their outputs invalid once attached, so the engine hands them NULL rather than
 * zeros for outputs no gradient reached: such an output is left out of the inner pass, and an
 * input the recompute did not use gets no gradient, as without checkpointing. The inner graph is
 * the graph the same ops would have recorded in forward, run in the same order, so the gradients
 * are the same bits.
 *
 * Generator records: every op that draws from a td_generator calls td__rng_note(g) first; each
 * region on this thread's stack in its forward phase that has not seen g yet clones g's state
 * (nested regions all record: the outer one's record covers the inner one's draws).
 *
 * Invariants: the region stack is thread-local and regions live on the stack of the td_checkpoint
 * or backward call that pushed them (popped before it returns); a node's saved inputs and
 * generator states are dropped by release_saved (after a backward without retain_graph) and ctx
 * is released exactly once, when the node dies.
 * Lock order: none (thread-local state; a node is run by one pass at a time, as every node).
 */
#include <stdio.h>
#include <string.h>

#include "tensor_impl.h"

typedef struct rng_rec {
  td_generator *g;     /* borrowed: the caller keeps it alive */
  td_generator *state; /* owned clone: g's state before the region's first draw */
} rng_rec;

typedef struct region {
  struct region *up;
  const char *name;
  td_checkpoint_phase phase;
  rng_rec *rng; /* forward phase: the generators drawn from so far */
  int n_rng, cap_rng;
  bool rng_failed; /* out of memory while recording */
} region;

static _Thread_local region *top;

static void rng_free(rng_rec *r, int n) {
  for (int i = 0; i < n; i++) td_generator_destroy(r[i].state);
  td__free(r);
}

static bool is_float(const td_tensor *t) { return td_dtype_is_float(t->dtype); }

void td__rng_note(td_generator *g) {
  for (region *r = top; r; r = r->up) {
    if (r->phase != TD_CHECKPOINT_PHASE_FORWARD || r->rng_failed) continue;
    bool seen = false;
    for (int i = 0; i < r->n_rng && !seen; i++) seen = r->rng[i].g == g;
    if (seen) continue;
    if (r->n_rng == r->cap_rng) {
      int cap = r->cap_rng ? 2 * r->cap_rng : 4;
      rng_rec *nr = td__realloc(r->rng, (size_t)cap * sizeof *nr);
      if (!nr) {
        r->rng_failed = true;
        continue;
      }
      r->rng = nr;
      r->cap_rng = cap;
    }
    if (td__generator_clone(g, &r->rng[r->n_rng].state) != TD_OK) {
      r->rng_failed = true;
      continue;
    }
    r->rng[r->n_rng++].g = g;
  }
}

td_checkpoint_phase td_checkpoint_current(const char **name) {
  if (name) *name = top ? top->name : NULL;
  return top ? top->phase : TD_CHECKPOINT_PHASE_NONE;
}

bool td_checkpoint_is_recomputing(void) {
  for (region *r = top; r; r = r->up)
    if (r->phase == TD_CHECKPOINT_PHASE_RECOMPUTE) return true;
  return false;
}

/* ---- CheckpointInputs: collects the inputs' gradients of the inner pass ---- */

typedef struct capture_node {
  td_node base;
  td_tensor **grads; /* n_outputs slots of the running backward (references stored here) */
} capture_node;

static td_status capture_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  (void)gin; /* no edges */
  capture_node *c = (capture_node *)self;
  for (int k = 0; k < self->n_outputs; k++) {
    if (!gout[k]) continue;
    td_tensor_unref(c->grads[k]);
    c->grads[k] = td_tensor_ref(gout[k]);
  }
  return TD_OK;
}

static const td__node_ops capture_ops = {"CheckpointInputs", capture_backward, NULL, NULL};

/* Makes *out a view of t that is output k of node, with the output marked invalid (no zeros for
 * a missing gradient). */
static td_status attach_view(const td_tensor *t, td_node *node, int k, td__out_meta *meta,
                             td_tensor **out) {
  td_tensor *v;
  TD_TRY(td__tensor_view(t, t->shape, t->strides, t->ndim, t->offset, &v));
  td__tensor_set_history(v, node, k);
  if (meta) *meta = node->outs[k];
  node->outs[k].valid = false;
  *out = v;
  return TD_OK;
}

/* ---- CheckpointBackward ---- */

typedef struct ckpt_node {
  td_node base;
  td_checkpoint_fn fn;
  void *ctx;
  void (*release)(void *ctx);
  char *name;
  td_dtype autocast; /* the forward's autocast dtype, or TD_DTYPE_F32: autocast was off */
  td_tensor **in;     /* n_inputs detached views (NULL where the input was NULL) */
  bool saved;         /* in and rng still held */
  rng_rec *rng;
  int n_rng;
  td__out_meta *meta; /* n_outputs: the outputs' shapes (valid: a float output attached) */
} ckpt_node;

static void ckpt_release_saved(td_node *self) {
  ckpt_node *n = (ckpt_node *)self;
  for (int i = 0; n->in && i < self->n_inputs; i++) {
    td_tensor_unref(n->in[i]);
    n->in[i] = NULL;
  }
  rng_free(n->rng, n->n_rng);
  n->rng = NULL;
  n->n_rng = 0;
  n->saved = false;
}

static void ckpt_destroy(td_node *self) {
  ckpt_node *n = (ckpt_node *)self;
  if (n->release) n->release(n->ctx);
  td__free(n->in);
  td__free(n->meta);
  td__free(n->name);
}

/* Checks the recomputed outputs against the forward's: every one made, same shapes and dtypes. */
static td_status check_recomputed(const ckpt_node *n, td_tensor *const *out) {
  for (int k = 0; k < n->base.n_outputs; k++) {
    if (!out[k])
      return td_set_error(TD_ERR_INVALID, "checkpoint '%s': the recompute returned TD_OK without "
                          "output %d", n->name, k);
    const td__out_meta *m = &n->meta[k];
    if (!m->valid) continue;
    if (m->dtype != out[k]->dtype || m->ndim != out[k]->ndim ||
        memcmp(m->shape, out[k]->shape, (size_t)m->ndim * sizeof(int64_t)) != 0) {
      char a[128], b[128];
      return td_set_error(TD_ERR_STATE, "checkpoint '%s': the recompute made output %d %s %s, "
                          "the forward %s %s (the function must compute the same thing both "
                          "times)", n->name, k, td_dtype_name(out[k]->dtype),
                          td_tensor_shape_str(out[k], a, sizeof a), td_dtype_name(m->dtype),
                          td__shape_str(m->shape, m->ndim, b, sizeof b));
    }
  }
  return TD_OK;
}

/* Runs fn again with grad mode on, over rin, into rout, with the generators replayed. */
static td_status recompute(ckpt_node *n, td_tensor *const *rin, td_tensor **rout) {
  td_status st = TD_OK;
  td_generator **kept = td__calloc((size_t)(n->n_rng ? n->n_rng : 1), sizeof *kept);
  if (!kept) return td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", n->name);
  int nk = 0;
  for (; nk < n->n_rng && st == TD_OK; nk++) st = td__generator_clone(n->rng[nk].g, &kept[nk]);
  if (st != TD_OK) nk--; /* the failed clone holds nothing */
  for (int r = 0; st == TD_OK && r < n->n_rng; r++)
    td__generator_copy_state(n->rng[r].g, n->rng[r].state);
  /* the forward's autocast state (the engine suspends autocast around backward functions) */
  bool suspended = false;
  if (st == TD_OK) {
    suspended = td__autocast_suspend();
    td__autocast_resume(false);
    st = td_autocast_begin(n->autocast);
    if (st != TD_OK) td__autocast_resume(suspended);
  }
  if (st == TD_OK) {
    region reg = {.up = top, .name = n->name, .phase = TD_CHECKPOINT_PHASE_RECOMPUTE};
    top = &reg;
    bool prev = td_autograd_set_enabled(true);
    st = n->fn(n->ctx, rin, n->base.n_inputs, rout, n->base.n_outputs);
    td_autograd_set_enabled(prev);
    top = reg.up;
    td_autocast_end();
    td__autocast_resume(suspended);
    if (st != TD_OK) td__error_prefix(st, "checkpoint '%s': recompute in backward", n->name);
  }
  for (int r = 0; r < nk; r++) { /* the state the program saw before the recompute */
    td__generator_copy_state(n->rng[r].g, kept[r]);
    td_generator_destroy(kept[r]);
  }
  td__free(kept);
  return st;
}

/* The nested pass from the recomputed outputs that got a gradient; the inputs' gradients land in
 * cap (through the CheckpointInputs node). */
static td_status inner_backward(ckpt_node *n, td_tensor *const *gout, td_tensor **rout) {
  int n_out = n->base.n_outputs, nr = 0;
  td_tensor **roots = td__calloc((size_t)n_out, sizeof *roots);
  td_tensor **grads = td__calloc((size_t)n_out, sizeof *grads);
  td_status st = roots && grads ? TD_OK
                                : td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory",
                                               n->name);
  for (int k = 0; st == TD_OK && k < n_out; k++) {
    if (!gout[k] || !td_tensor_requires_grad(rout[k])) continue;
    roots[nr] = rout[k];
    grads[nr++] = gout[k];
  }
  if (st == TD_OK && nr > 0) {
    const td_backward_opts *outer = td__autograd_pass_opts();
    td_backward_opts o = {.retain_graph = false, .grad_map = outer ? outer->grad_map : NULL};
    st = td_autograd_backward(roots, grads, nr, &o);
    if (st != TD_OK) td__error_prefix(st, "checkpoint '%s': backward of the recompute", n->name);
  }
  td__free(roots);
  td__free(grads);
  return st;
}

static td_status ckpt_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  ckpt_node *n = (ckpt_node *)self;
  int n_in = self->n_inputs, n_out = self->n_outputs;
  bool any = false;
  for (int k = 0; k < n_out; k++) any = any || gout[k] != NULL;
  if (!any) return TD_OK;
  if (!n->saved)
    return td_set_error(TD_ERR_STATE, "checkpoint '%s': its inputs were freed (use retain_graph "
                        "for a second backward)", n->name);
  td_status st = TD_OK;
  capture_node *cap = NULL;
  size_t nslots = (size_t)(n_in ? n_in : 1);
  td_tensor **rin = td__calloc(nslots, sizeof *rin), **grads = td__calloc(nslots, sizeof *grads);
  td_tensor **rout = td__calloc((size_t)n_out, sizeof *rout);
  if (!rin || !grads || !rout) {
    st = td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", n->name);
    goto out;
  }
  cap = (capture_node *)td__node_new(sizeof *cap, &capture_ops, n_in, 0);
  if (!cap) {
    st = td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", n->name);
    goto out;
  }
  cap->grads = grads;
  for (int i = 0; st == TD_OK && i < n_in; i++) {
    if (!n->in[i]) continue;
    if (td__node_needs_grad(self, i)) st = attach_view(n->in[i], &cap->base, i, NULL, &rin[i]);
    else rin[i] = td_tensor_ref(n->in[i]);
  }
  if (st == TD_OK) st = recompute(n, rin, rout);
  if (st == TD_OK) st = check_recomputed(n, rout);
  if (st == TD_OK) st = inner_backward(n, gout, rout);
  for (int i = 0; st == TD_OK && i < n_in; i++) {
    gin[i] = grads[i];
    grads[i] = NULL;
  }
out:
  for (int i = 0; i < n_in; i++) {
    if (rin) td_tensor_unref(rin[i]);
    if (grads) td_tensor_unref(grads[i]);
  }
  for (int k = 0; rout && k < n_out; k++) td_tensor_unref(rout[k]);
  if (cap) td_node_unref(&cap->base);
  td__free(rin);
  td__free(grads);
  td__free(rout);
  return st;
}

static const td__node_ops ckpt_ops = {"CheckpointBackward", ckpt_backward, ckpt_release_saved,
                                      ckpt_destroy};

/* ---- td_checkpoint ---- */

/* Checks fn's outputs: every one made on TD_OK. */
static td_status check_outputs(const char *name, td_tensor *const *out, int n) {
  for (int k = 0; k < n; k++)
    if (!out[k])
      return td_set_error(TD_ERR_INVALID, "checkpoint '%s': the function returned TD_OK without "
                          "output %d", name, k);
  return TD_OK;
}

/* Builds the node over inputs, taking over ctx (released when the node dies, also when this
 * fails), and makes out[k] the attached outputs (float ones; the others as made). tmp's
 * references are consumed on TD_OK. */
static td_status make_node(const char *name, td_checkpoint_fn fn, void *ctx,
                           void (*release)(void *), td_tensor *const *inputs, int n_in,
                           region *reg, td_tensor **tmp, int n_out, td_tensor **out) {
  ckpt_node *n = (ckpt_node *)td__node_new(sizeof *n, &ckpt_ops, n_out, n_in);
  if (!n) {
    if (release) release(ctx);
    return td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", name);
  }
  n->fn = fn, n->ctx = ctx, n->release = release;
  if (!td_autocast_dtype(&n->autocast)) n->autocast = TD_DTYPE_F32; /* as the forward ran */
  n->rng = reg->rng, n->n_rng = reg->n_rng; /* taken over */
  reg->rng = NULL, reg->n_rng = 0;
  n->name = td__strdup(name);
  n->in = td__calloc((size_t)(n_in ? n_in : 1), sizeof *n->in);
  n->meta = td__calloc((size_t)n_out, sizeof *n->meta);
  n->saved = true;
  td_status st = n->name && n->in && n->meta
                     ? TD_OK
                     : td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", name);
  for (int i = 0; st == TD_OK && i < n_in; i++) {
    if (!inputs[i]) continue;
    st = td__node_set_next(&n->base, i, inputs[i]);
    if (st == TD_OK) st = td_tensor_detach(inputs[i], &n->in[i]);
  }
  td_tensor **res = td__calloc((size_t)n_out, sizeof *res);
  if (st == TD_OK && !res) st = td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", name);
  for (int k = 0; st == TD_OK && k < n_out; k++) {
    if (is_float(tmp[k])) st = attach_view(tmp[k], &n->base, k, &n->meta[k], &res[k]);
    else res[k] = td_tensor_ref(tmp[k]);
  }
  if (st == TD_OK) {
    for (int k = 0; k < n_out; k++) {
      td_tensor_unref(tmp[k]);
      out[k] = res[k];
    }
  } else {
    for (int k = 0; res && k < n_out; k++) td_tensor_unref(res[k]);
  }
  td__free(res);
  td_node_unref(&n->base); /* the outputs hold it now */
  return st;
}

td_status td_checkpoint(td_checkpoint_fn fn, void *ctx, td_tensor *const *inputs, int n_inputs,
                        td_tensor **outputs, int n_outputs, const td_checkpoint_opts *opts) {
  const char *name = opts && opts->name ? opts->name : "checkpoint";
  void (*release)(void *) = opts ? opts->release : NULL;
  td_status st = TD_OK;
  td_tensor *tmp_small[8] = {0}, **tmp = tmp_small;
  int ntmp = 0; /* slots of tmp in use */
  region reg = {.up = top, .name = name, .phase = TD_CHECKPOINT_PHASE_FORWARD};
  if (!fn || !outputs || n_outputs < 1 || n_inputs < 0 || (n_inputs > 0 && !inputs)) {
    st = td_set_error(TD_ERR_INVALID, "checkpoint '%s': invalid argument (fn %s, %d inputs%s, "
                      "%d outputs%s)", name, fn ? "set" : "NULL", n_inputs,
                      n_inputs > 0 && !inputs ? " in a NULL array" : "", n_outputs,
                      !outputs ? " in a NULL array" : "");
    goto out;
  }
  if (n_outputs > 8 && !(tmp = td__calloc((size_t)n_outputs, sizeof *tmp))) {
    st = td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory", name);
    goto out;
  }
  ntmp = n_outputs;
  bool record = opts && opts->reads_params;
  for (int i = 0; i < n_inputs; i++) record = record || td_tensor_requires_grad(inputs[i]);
  record = record && td_autograd_is_enabled();
  if (record) {
    top = &reg;
    td_autograd_set_enabled(false);
  }
  st = fn(ctx, inputs, n_inputs, tmp, n_outputs);
  if (record) {
    td_autograd_set_enabled(true);
    top = reg.up;
  }
  if (st != TD_OK) {
    td__error_prefix(st, "checkpoint '%s'", name);
    goto out;
  }
  st = check_outputs(name, tmp, n_outputs);
  if (st == TD_OK && reg.rng_failed)
    st = td_set_error(TD_ERR_NOMEM, "checkpoint '%s': out of memory recording generators", name);
  if (st != TD_OK) goto out;
  if (record) {
    st = make_node(name, fn, ctx, release, inputs, n_inputs, &reg, tmp, n_outputs, outputs);
    release = NULL; /* the node's now */
    if (st == TD_OK) memset(tmp, 0, (size_t)n_outputs * sizeof *tmp);
  } else {
    memcpy(outputs, tmp, (size_t)n_outputs * sizeof *tmp);
    memset(tmp, 0, (size_t)n_outputs * sizeof *tmp);
  }
out:
  for (int k = 0; k < ntmp; k++) td_tensor_unref(tmp[k]); /* what is left after a failure */
  if (tmp != tmp_small) td__free(tmp);
  rng_free(reg.rng, reg.n_rng);
  if (release) release(ctx);
  return st;
}
