/* ft_zero3.c - fault-tolerant ZeRO stage 3 (td_ft_zero with units, include/tdist/collectives.h):
 * the parameters of the units sharded between uses as well as the optimizer state, both held
 * twice, so that a lost member takes neither with it.
 *
 * Where the values live. Each block's two holders keep its master values (the block's segments
 * as owned tensors, which its td_optim steps: ft_zero.c's block_hold at stage 3) beside its
 * optimizer state; they are equal bit for bit on both holders, since both step them with the
 * same averaged gradient. The units' parameter tensors have no memory between steps
 * (td__tensor_storage_release: the tensor objects live on, so modules, autograd's saved tensors
 * and hooks keep pointing at them); the parameters outside the units stay whole on every member
 * and are gathered at the commit (gather_rest), as at stage 2.
 *
 * A gather of a set of parameters (a unit's, or the rest): for each block in order that holds
 * some of their elements, its owner packs them from its masters and broadcasts them; every
 * member unpacks them into the parameters (given memory first). The block's owner is agreed by
 * every member (at creation, and by every recovery's plan), so the sequence of broadcasts is the
 * same everywhere; after a lost member the survivors' owners are holders that survived.
 *
 * Shard passes. Every gather is a collective, but after a loss the survivors compute different
 * numbers of shards (the lost ones' shards go to some of them). So each attempt first agrees on
 * R, the most shards any member must compute (an all_reduce MAX), and every member runs R
 * passes: a pass with a shard runs the caller's shard function, whose forward and backward
 * trigger the gathers through hooks; a pass without one serves: it runs the same gathers with
 * no computation. That needs one sequence of gathers per pass, checked as it runs:
 *   pre-forward hook of unit u:   gather u (the pass's gather number u)
 *   post-forward hook of unit u:  an identity node on u's outputs that require grad, then free u
 *   identity node's backward:     gather u again (gather number 2n - 1 - u: backward reaches the
 *                                 units last to first)
 *   gradient hook of a parameter: once every parameter of u has had its gradient in this
 *                                 backward (autograd sums a leaf's uses before its hook), every
 *                                 node that reads them has run: free u (not at the identity node
 *                                 of the unit before it: a node on no path to that output may
 *                                 still read u's parameters then)
 *   end of the pass:              free every unit (one with a parameter that got no gradient);
 *                                 2n gathers must have run
 * A serving pass frees each unit right after its backward gather.
 *
 * Outside a pass the hooks do nothing, and a unit's forward needs its parameters gathered
 * (td_ft_zero_sync gathers every unit until the next step: an evaluation on one member).
 *
 * A gather that fails (a lost member) records its status in z->gst, leaves the unit free, and
 * makes every later hook of the pass fail without a collective; the shard function then fails
 * (the hooks' error), its gradient is not kept, and the attempt fails as a lost reduction does:
 * the recovery (ft_zero_recover.c) re-forms, redoes or rolls forward; the redo's passes gather
 * from the surviving holders.
 *
 * Threads: the thread that runs the td_ft_zero's steps (hooks run on the thread of forward and
 * backward, which is that one: the shard function runs there).
 */
#include <stdio.h>
#include <string.h>

#include "../tensor/storage.h"
#include "tdist/autograd.h"
#include "tdist/nn.h"
#include "zero_impl.h"

typedef struct td__fzunit {
  td_ft_zero *z;
  size_t index;
  td_module *m; /* borrowed */
  int hook;     /* forward hooks' handle (0: none) */
  bool gathered;
  size_t nparams;  /* its parameters */
  size_t arrived;  /* those whose gradient arrived in this pass's backward */
  int64_t numel;   /* its elements */
} td__fzunit;

typedef struct td__fzparam {
  td_ft_zero *z;
  size_t i;
  int handle; /* its gradient hook (-1: none) */
} td__fzparam;

/* ---- gathering ---- */

/* Gives memory to (restore) or frees the parameters of unit u (-1: the others). */
static td_status set_live(td_ft_zero *z, int u, bool live) {
  for (size_t i = 0; i < z->np; i++) {
    if (z->unit_of[i] != u) continue;
    TD_TRY(live ? td__tensor_storage_restore(z->params[i])
                : td__tensor_storage_release(z->params[i]));
  }
  return TD_OK;
}

/* Gathers the parameters of unit u (-1: those outside the units) from the blocks' owners. */
static td_status gather_set(td_ft_zero *z, int u, int64_t step) {
  TD_TRY(set_live(z, u, true));
  int64_t S = 0;
  for (int bi = 0; bi < z->B; bi++)
    if (z->b[bi].hi - z->b[bi].lo > S) S = z->b[bi].hi - z->b[bi].lo;
  td_tensor *t = NULL;
  TD_TRY(td_tensor_empty(&S, 1, z->dt, td_device_cpu(), &t)); /* each use filled first */
  size_t es = td_dtype_size(z->dt);
  int r = td_process_group_rank(z->pg);
  td_status st = TD_OK;
  bool first = true;
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    const td__zfblock *b = &z->b[bi];
    int64_t count = 0;
    for (size_t j = 0; j < b->nseg; j++)
      if (z->unit_of[z->segs[b->seg0 + j].param] == u) count += z->segs[b->seg0 + j].len;
    if (!count) continue;
    int root = td__ft_group_rank(z->pg, b->own);
    if (root < 0 || (root == r && !b->held)) {
      st = td_set_error(TD_ERR_STATE, "ft_zero: block %d's owner (global rank %d) does not hold "
                        "it", bi, b->own);
      break;
    }
    td_tensor *v = NULL;
    st = td_tensor_narrow(t, 0, 0, count, &v);
    char *d = st == TD_OK ? td_tensor_data(v) : NULL;
    for (size_t j = 0, at = 0; st == TD_OK && root == r && j < b->nseg; j++) {
      const td__zfseg *s = &z->segs[b->seg0 + j];
      if (z->unit_of[s->param] != u) continue;
      memcpy(d + at, td_tensor_data(b->view[j]), (size_t)s->len * es);
      at += (size_t)s->len * es;
    }
    if (st == TD_OK) st = td_process_group_broadcast(z->pg, v, root);
    for (size_t j = 0, at = 0; st == TD_OK && j < b->nseg; j++) {
      const td__zfseg *s = &z->segs[b->seg0 + j];
      if (z->unit_of[s->param] != u) continue;
      memcpy((char *)td_tensor_data(z->params[s->param]) + (size_t)s->off * es, d + at,
             (size_t)s->len * es);
      at += (size_t)s->len * es;
    }
    td_tensor_unref(v);
    if (st == TD_OK && u < 0 && first) td__ftz_inject_at(z, step, TD_FT_DURING_GATHER);
    first = false;
  }
  td_tensor_unref(t);
  if (st != TD_OK && u >= 0) (void)set_live(z, u, false); /* half-copied values: never used */
  return st;
}

static void unit_free(td_ft_zero *z, size_t u) {
  if (!z->u[u].gathered) return;
  (void)set_live(z, (int)u, false); /* cannot fail: the tensors own their storage (setup) */
  z->u[u].gathered = false;
  z->live_numel -= z->u[u].numel;
}

void td__ftz3_free_units(td_ft_zero *z) {
  for (size_t u = 0; u < z->nu; u++) unit_free(z, u);
}

/* The pass's next gather, of unit u for its forward or its backward: checks the order, gathers
 * (unless a gather of this pass failed already: then it fails without a collective). */
static td_status unit_use(td_ft_zero *z, size_t u, bool backward) {
  if (z->gst != TD_OK) return td_set_error(z->gst, "%s", z->gmsg);
  size_t n = z->nu, want = backward ? 2 * n - 1 - u : u;
  if (td_checkpoint_is_recomputing() || z->seq != want || z->seq >= 2 * n) {
    z->gst = td_set_error(TD_ERR_INVALID, "ft_zero stage 3: units[%zu]'s %s out of order (gather "
                          "%zu of the shard pass; a pass runs each unit's forward once, in "
                          "order, then one backward through them all, without activation "
                          "checkpointing)", u, backward ? "backward" : "forward", z->seq);
    snprintf(z->gmsg, sizeof z->gmsg, "%s", td_last_error());
    return z->gst;
  }
  z->seq++;
  td_status st = TD_OK;
  if (!z->u[u].gathered) {
    bool prev = td_autograd_set_enabled(false);
    st = gather_set(z, (int)u, z->cur_step);
    td_autograd_set_enabled(prev);
    if (st == TD_OK) {
      z->u[u].gathered = true, z->unit_gathers++;
      z->live_numel += z->u[u].numel;
      if (z->live_numel > z->peak_numel) z->peak_numel = z->live_numel;
    }
  }
  if (st != TD_OK) {
    z->gst = td__error_prefix(st, "ft_zero stage 3: gathering units[%zu] (%s)", u,
                              td_module_type_name(z->u[u].m));
    snprintf(z->gmsg, sizeof z->gmsg, "%s", td_last_error());
    return z->gst;
  }
  td__ftz_inject_at(z, z->cur_step, TD_FT_UNIT_GATHER);
  return TD_OK;
}

/* ---- hooks ---- */

typedef struct node_ctx {
  td_ft_zero *z;
  size_t u;
} node_ctx;

static td_status unit_backward(void *ctx, td_tensor *const *grad_outputs, int n_outputs,
                               td_tensor **grad_inputs, int n_inputs) {
  node_ctx *c = ctx;
  TD_TRY(unit_use(c->z, c->u, true));
  for (int i = 0; i < n_inputs; i++)
    grad_inputs[i] = i < n_outputs && grad_outputs[i] ? td_tensor_ref(grad_outputs[i]) : NULL;
  return TD_OK;
}

/* A parameter's gradient is about to be accumulated (autograd summed all its uses first): once
 * every parameter of its unit has had its gradient in this pass's backward, every node that
 * reads them has run, and the unit is freed. */
static td_status grad_arrived(void *ctx, const td_tensor *grad, td_tensor **replacement) {
  (void)grad, (void)replacement;
  td__fzparam *c = ctx;
  td_ft_zero *z = c->z;
  int u = z->unit_of[c->i];
  if (!z->in_pass || u < 0 || z->seq <= z->nu) return TD_OK; /* in a pass's backward only */
  if (++z->u[u].arrived == z->u[u].nparams) unit_free(z, (size_t)u);
  return TD_OK;
}

static td_status pre_forward(void *ctx, td_module *m) {
  (void)m;
  td__fzunit *u = ctx;
  if (u->z->in_pass) return unit_use(u->z, u->index, false);
  if (u->gathered) return TD_OK; /* outside a step, after td_ft_zero_sync: whole parameters */
  return td_set_error(TD_ERR_STATE, "ft_zero stage 3: units[%zu] (%s) run outside a step while "
                      "its parameters are sharded (td_ft_zero_sync gathers them until the next "
                      "step)", u->index, td_module_type_name(u->m));
}

/* The outputs that require grad go through one identity node that gathers the unit again when
 * backward reaches it. */
static td_status wrap_outputs(td__fzunit *u, td_tensor **outputs, int n_outputs) {
  node_ctx *c = td__calloc(1, sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  c->z = u->z, c->u = u->index;
  return td__zero_wrap_outputs("FtZeroUnitGather", outputs, n_outputs, unit_backward, c);
}

static td_status post_forward(void *ctx, td_module *m, td_status fst, td_tensor **outputs,
                              int n_outputs) {
  (void)m;
  td__fzunit *u = ctx;
  if (!u->z->in_pass) return TD_OK; /* a forward outside a step: nothing to do */
  td_status st = fst == TD_OK && td_autograd_is_enabled() ? wrap_outputs(u, outputs, n_outputs)
                                                          : TD_OK;
  unit_free(u->z, u->index);
  return st;
}

/* ---- the attempt's shard passes ---- */

static td_status begin_pass(td_ft_zero *z) {
  td__ftz3_free_units(z);
  z->seq = 0;
  for (size_t u = 0; u < z->nu; u++) z->u[u].arrived = 0;
  for (size_t i = 0; i < z->np; i++) TD_TRY(td_tensor_set_grad(z->params[i], NULL));
  return TD_OK;
}

/* A pass without a shard: the gathers a shard's pass runs, for the others. */
static td_status serve(td_ft_zero *z) {
  for (size_t u = 0; u < z->nu; u++) {
    TD_TRY(unit_use(z, u, false));
    unit_free(z, u);
  }
  for (size_t u = z->nu; u-- > 0;) {
    TD_TRY(unit_use(z, u, true));
    unit_free(z, u);
  }
  return TD_OK;
}

td_status td__ftz3_compute(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                           td_ft_step_info *info, bool *user_failed) {
  int m = td__ftz_me(z);
  int *todo = td__calloc((size_t)z->M, sizeof *todo), mine = 0;
  if (!todo) return td_set_error(TD_ERR_NOMEM, "ft_zero_step: out of memory");
  for (int s = 0; s < z->M; s++)
    if (z->owner[s] == m && !z->grad[s]) todo[mine++] = s;
  /* R: the most passes any member runs (the fault tolerance's own collective) */
  uint64_t t0 = td__now_ns();
  int64_t one = 1;
  td_tensor *r = NULL;
  td_status st = td_tensor_zeros(&one, 1, TD_DTYPE_I64, td_device_cpu(), &r);
  if (st == TD_OK) {
    *(int64_t *)td_tensor_data(r) = mine;
    st = td_process_group_all_reduce(z->pg, r, TD_REDUCE_MAX);
  }
  int64_t R = st == TD_OK ? *(int64_t *)td_tensor_data(r) : 0;
  td_tensor_unref(r);
  td__ft_own(&info->machinery_s, t0);
  z->cur_step = step;
  for (int64_t k = 0; st == TD_OK && k < R; k++) {
    z->gst = TD_OK;
    z->gmsg[0] = 0;
    st = begin_pass(z);
    if (st != TD_OK) {
      *user_failed = true;
      break;
    }
    td_status fs = TD_OK;
    z->in_pass = true;
    if (k < mine) fs = fn(user, step, todo[k], z->M);
    else fs = serve(z);
    z->in_pass = false;
    td__ftz3_free_units(z);
    if (z->gst == TD_OK && fs == TD_OK && z->seq != 2 * z->nu)
      z->gst = td_set_error(TD_ERR_INVALID, "ft_zero stage 3: the shard pass ran %zu unit "
                            "gathers, not %zu (each unit's forward once, in order, then one "
                            "backward through them all)", z->seq, 2 * z->nu);
    if (z->gst == TD_ERR_INVALID && !z->gmsg[0])
      snprintf(z->gmsg, sizeof z->gmsg, "%s", td_last_error());
    if (z->gst != TD_OK) { /* a gather failed (a lost member), or the pass was out of order */
      *user_failed = z->gst == TD_ERR_INVALID;
      st = td_set_error(z->gst, "%s", z->gmsg);
      break;
    }
    if (fs != TD_OK) { /* the caller's own failure */
      *user_failed = true;
      st = fs;
      break;
    }
    if (k < mine) {
      st = td__ft_take_grads(z->params, z->np, z->P, z->dt, &z->grad[todo[k]], &info->machinery_s);
      if (st != TD_OK) *user_failed = true;
      else info->shards_computed++;
    }
  }
  z->gst = TD_OK;
  for (size_t i = 0; i < z->np; i++) (void)td_tensor_set_grad(z->params[i], NULL);
  td__free(todo);
  return st;
}

td_status td__ftz3_gather_rest(td_ft_zero *z, int64_t step) { return gather_set(z, -1, step); }

td_status td__ftz3_gather_units(td_ft_zero *z) {
  for (size_t u = 0; u < z->nu; u++) {
    if (z->u[u].gathered) continue;
    td_status st = gather_set(z, (int)u, z->committed);
    if (st != TD_OK) return st;
    z->u[u].gathered = true;
    z->unit_gathers++;
  }
  return TD_OK;
}

/* ---- lifecycle ---- */

td_status td__ftz3_setup(td_ft_zero *z) {
  z->nu = z->o.n_units;
  z->u = td__calloc(z->nu, sizeof *z->u);
  z->unit_of = td__calloc(z->np, sizeof *z->unit_of);
  if (!z->u || !z->unit_of) return td_set_error(TD_ERR_NOMEM, "ft_zero_create: out of memory");
  td_status st = td__zero_units_map(z->o.units, z->nu, z->params, z->np, z->unit_of,
                                    "ft_zero_create");
  for (size_t u = 0; u < z->nu; u++) z->u[u] = (td__fzunit){z, u, z->o.units[u], 0, true};
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    int u = z->unit_of[i];
    if (u >= 0) z->u[u].nparams++, z->u[u].numel += td_tensor_numel(z->params[i]);
  }
  z->ph = td__calloc(z->np, sizeof *z->ph);
  if (st == TD_OK && !z->ph) st = td_set_error(TD_ERR_NOMEM, "ft_zero_create: out of memory");
  for (size_t i = 0; z->ph && i < z->np; i++) z->ph[i] = (td__fzparam){z, i, -1};
  for (size_t i = 0; st == TD_OK && i < z->np; i++)
    if (z->unit_of[i] >= 0)
      st = td_tensor_register_hook(z->params[i], grad_arrived, &z->ph[i], &z->ph[i].handle);
  for (size_t u = 0; st == TD_OK && u < z->nu; u++) {
    st = td_module_add_forward_hooks(z->u[u].m, pre_forward, post_forward, &z->u[u], &z->u[u].hook);
    if (st != TD_OK) st = td__error_prefix(st, "ft_zero_create: units[%zu]", u);
  }
  /* every member holds its blocks' masters now: the units' memory goes */
  for (size_t u = 0; st == TD_OK && u < z->nu; u++) {
    st = set_live(z, (int)u, false);
    if (st != TD_OK)
      st = td__error_prefix(st, "ft_zero_create: units[%zu]'s parameters must own their memory", u);
    else
      z->u[u].gathered = false;
  }
  z->live_numel = 0;
  return st;
}

void td__ftz3_destroy(td_ft_zero *z) {
  for (size_t i = 0; z->ph && i < z->np; i++)
    if (z->ph[i].handle >= 0) (void)td_tensor_remove_hook(z->params[i], z->ph[i].handle);
  td__free(z->ph);
  z->ph = NULL;
  for (size_t u = 0; z->u && u < z->nu; u++) {
    td__fzunit *un = &z->u[u];
    if (un->hook) (void)td_module_remove_forward_hooks(un->m, un->hook);
    if (un->gathered) continue;
    /* the modules outlive this td_ft_zero: memory again, zero-filled */
    for (size_t i = 0; i < z->np; i++)
      if (z->unit_of[i] == (int)u && td__tensor_storage_restore(z->params[i]) == TD_OK)
        (void)td_tensor_zero_(z->params[i]);
  }
  td__free(z->u);
  td__free(z->unit_of);
  z->u = NULL;
  z->unit_of = NULL;
}
