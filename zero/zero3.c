/* zero3.c - ZeRO stage 3: the units' parameters sharded between uses (tdist/collectives.h).
 *
 * A stage-3 td_zero is a stage-2 td_zero with overlap (zero.c does the gradient buckets, the
 * clipping, the shard step and the checkpoints) whose first buckets are the units' (each unit's
 * parameters in buckets of bucket_bytes of their own), last unit first (the order backward
 * finishes them); the other parameters follow in ordinary buckets and stay whole on every
 * member. Each member's master values of its part of
 * every bucket (zero.c's segments) are the only copy of a unit's parameters between uses.
 *
 * A unit's parameters are "gathered" (their tensors have memory holding the current values) or
 * "free" (td__tensor_storage_release: no memory; the tensor objects live on, so modules,
 * autograd's saved tensors and hooks keep pointing at them). Gathering: this member's part of
 * the unit's bucket (a copy of its segments) is all_gathered asynchronously into a bucket-sized
 * buffer; when the unit needs it, the buffer is waited for and copied into the re-allocated
 * tensors. Gathers run on the group's worker thread in the order they are started, which is the
 * same on every member because every member runs the same forwards and backwards.
 *
 * When (all on the thread running forward / backward):
 *   pre-forward hook of unit u:  start u+1's gather (prefetch), gather u (wait)
 *   post-forward hook of unit u: put an identity node on u's outputs (autograd on, an output
 *                                requires grad), free u
 *   the same hooks when activation checkpointing recomputes u's forward in backward: gather u
 *                                if it is free (the identity node on the region's outputs
 *                                gathered it when the region is u), prefetch u+1 only if its
 *                                gradients are not all in (a region spanning units), keep u
 *                                after (its backward follows at once)
 *   identity node's backward:    start u-1's gather (prefetch), gather u (wait); grads unchanged
 *   gradient hook (zero.c) completing u's bucket: free u (every node that read u's parameters
 *                                has run: each produced one of their gradients); the count of
 *                                complete buckets restarts at each td_zero_prepare, so the passes
 *                                of a gradient-accumulation window free their units too
 *   td_zero_step, after the reduction: wait for gathers in flight (stale after the step), free
 *                                every unit still gathered (a pass without td_zero_prepare)
 * A prefetch is only started for a unit that is free and not already being gathered, and only
 * while autograd decides the same thing on every member, so the sequence of collectives stays
 * identical across members.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tensor/storage.h"
#include "zero_impl.h"
#include "tdist/autograd.h"

typedef struct td__zunit {
  td_zero *z;
  size_t index;       /* unit index (forward order) */
  size_t b0, nbk;     /* its buckets: z->b[b0 .. b0 + nbk) */
  td_module *m;       /* borrowed: the caller keeps it alive */
  bool gathered;
  bool started;       /* its all_gathers are in flight */
  td_future **work;   /* per bucket: the all_gather in flight */
  td_tensor **buf;    /* per bucket: its output while in flight */
  int hook;           /* handle of our forward hooks on m (0: none) */
  size_t ready;       /* buckets whose gradients are all in, this pass */
  int64_t nbytes;     /* bytes of its parameters */
} td__zunit;

/* ---- layout ---- */

td_status td__zero3_plan(td_zero *z, int64_t *S) {
  size_t m = z->np ? z->np : 1;
  z->nu = z->zo.n_units;
  z->order = td__calloc(m, sizeof *z->order);
  z->bucket_of = td__calloc(m, sizeof *z->bucket_of);
  z->offset = td__calloc(m, sizeof *z->offset);
  z->b = td__calloc(m, sizeof *z->b);
  z->unit_of = td__calloc(m, sizeof *z->unit_of);
  z->u = td__calloc(z->nu ? z->nu : 1, sizeof *z->u);
  size_t *first = td__calloc(m, sizeof *first), *count = td__calloc(m, sizeof *count);
  int64_t *numel = td__calloc(m, sizeof *numel);
  td_status st = TD_OK;
  if (!z->order || !z->bucket_of || !z->offset || !z->b || !z->unit_of || !z->u || !first ||
      !count || !numel)
    st = td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  /* which unit each parameter belongs to */
  if (st == TD_OK)
    st = td__zero_units_map(z->zo.units, z->nu, z->params, z->np, z->unit_of, "zero_create");
  /* the order gradients arrive in: units last to first, each unit's parameters in reverse
   * module order (not the groups' order: that puts a block's biases and norms, its first and
   * last gradients, in one bucket that completes only when the whole unit has); then the others
   * in grad_order, then reversed */
  size_t k = 0;
  for (size_t u = z->nu; st == TD_OK && u-- > 0;) {
    td_tensor_list l;
    td_tensor_list_init(&l);
    st = td_module_parameters(z->zo.units[u], &l);
    for (size_t j = l.n; st == TD_OK && j-- > 0;)
      for (size_t i = 0; i < z->np; i++)
        if (z->params[i] == l.tensors[j]) {
          z->order[k++] = i;
          break;
        }
    td_tensor_list_fini(&l);
  }
  size_t n_unit_params = k;
  for (size_t j = 0; st == TD_OK && j < z->zo.n_grad_order; j++)
    for (size_t i = 0; i < z->np; i++)
      if (z->params[i] == z->zo.grad_order[j] && z->unit_of[i] < 0) {
        bool dup = false;
        for (size_t q = n_unit_params; q < k; q++) dup |= z->order[q] == i;
        if (!dup) z->order[k++] = i;
        break;
      }
  for (size_t i = z->np; st == TD_OK && i-- > 0;) {
    bool placed = z->unit_of[i] >= 0;
    for (size_t q = n_unit_params; !placed && q < k; q++) placed = z->order[q] == i;
    if (!placed) z->order[k++] = i;
  }
  int n = td_process_group_size(z->pg);
  *S = 0;
  size_t pos = 0;
  /* each unit's parameters in buckets of their own (bucket_bytes), then the rest */
  size_t cap = z->zo.bucket_bytes ? z->zo.bucket_bytes : ((size_t)4 << 20);
  for (size_t q = 0; st == TD_OK && q <= z->nu; q++) {
    size_t len = 0;
    int unit = -1;
    if (q < z->nu) {
      unit = z->unit_of[z->order[pos]];
      while (pos + len < n_unit_params && z->unit_of[z->order[pos + len]] == unit) len++;
    } else {
      len = z->np - pos;
    }
    if (!len) continue;
    td__coll_bucket_plan plan = {z->bucket_of, z->offset, first, count, numel, 0};
    td__coll_plan_buckets(z->params, z->order + pos, len, cap, cap, &plan);
    if (unit >= 0) {
      z->u[unit].b0 = z->nb;
      z->u[unit].nbk = plan.nbuckets;
    }
    for (size_t j = 0; j < plan.nbuckets; j++) {
      td__zbucket *b = &z->b[z->nb];
      b->first = pos + first[j];
      b->count = count[j];
      b->numel = numel[j];
      b->chunk = numel[j] ? (numel[j] + n - 1) / n : 1;
      b->shard_off = *S;
      b->owner = z;
      *S += b->chunk;
      for (size_t r = b->first; r < b->first + b->count; r++)
        z->bucket_of[z->order[r]] = z->nb;
      z->nb++;
    }
    pos += len;
    if (q + 1 == z->nu) z->nub = z->nb;
  }
  for (size_t u = 0; st == TD_OK && u < z->nu; u++) {
    td__zunit *un = &z->u[u];
    un->z = z;
    un->index = u;
    un->m = z->zo.units[u];
    un->gathered = true;
    un->work = td__calloc(un->nbk, sizeof *un->work);
    un->buf = td__calloc(un->nbk, sizeof *un->buf);
    if (!un->work || !un->buf) st = td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
    for (size_t k = un->b0; k < un->b0 + un->nbk; k++)
      un->nbytes += z->b[k].numel * (int64_t)td_dtype_size(z->dt);
  }
  td__free(first);
  td__free(count);
  td__free(numel);
  return st;
}

/* ---- gathering and freeing ---- */

/* Frees the memory of every parameter of bucket k. */
static td_status free_bucket(td_zero *z, size_t k) {
  const td__zbucket *b = &z->b[k];
  for (size_t q = b->first; q < b->first + b->count; q++)
    TD_TRY(td__tensor_storage_release(z->params[z->order[q]]));
  return TD_OK;
}

/* Counts the bytes stage 3 holds beyond the shards (peak_gather_bytes) after an increase. */
static void note_held(td_zero *z) {
  int64_t held = z->live_bytes + z->gather_bytes;
  if (held > (int64_t)z->stats.peak_gather_bytes) z->stats.peak_gather_bytes = (uint64_t)held;
}

/* Drops buffer *buf of a gather (counted out). */
static void drop_buf(td_zero *z, td_tensor **buf) {
  if (*buf) z->gather_bytes -= (int64_t)td_tensor_nbytes(*buf);
  td_tensor_unref(*buf);
  *buf = NULL;
}

static td_status unit_free(td_zero *z, td__zunit *u) {
  if (!u->gathered || z->pinned) return TD_OK;
  for (size_t k = u->b0; k < u->b0 + u->nbk; k++) TD_TRY(free_bucket(z, k));
  u->gathered = false;
  z->live_bytes -= u->nbytes;
  return TD_OK;
}

/* Starts bucket k's all_gather: this member's segments of it -> *buf. */
static td_status gather_bucket_start(td_zero *z, size_t k, td_tensor **buf, td_future **work) {
  td_tensor *part = NULL;
  int64_t all = z->b[k].chunk * td_process_group_size(z->pg);
  td_status st = td__zero_bucket_part(z, k, &part);
  if (st == TD_OK) st = td_tensor_empty(&all, 1, z->dt, z->dev, buf);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor_async(z->pg, *buf, part, work);
  td_tensor_unref(part);
  if (st != TD_OK) {
    td_tensor_unref(*buf);
    *buf = NULL;
  } else {
    z->gather_bytes += (int64_t)td_tensor_nbytes(*buf);
    note_held(z);
  }
  return st;
}

/* Waits for bucket j of u's all_gather and drops it (its output too). */
static td_status gather_bucket_wait(td__zunit *u, size_t j) {
  if (!u->work[j]) return TD_OK;
  td_status st = td_future_wait(u->work[j], TD_TIMEOUT_INFINITE); /* bounded by the group */
  if (st != TD_OK)
    st = td_set_error(st, "zero: gathering the parameters of units[%zu] (%s): %s", u->index,
                      td_module_type_name(u->m), td_future_message(u->work[j]));
  td_future_unref(u->work[j]);
  u->work[j] = NULL;
  return st;
}

/* Starts unit u's all_gathers, one per bucket (a failure waits for those already started). */
static td_status gather_start(td_zero *z, td__zunit *u, bool prefetch) {
  if (u->gathered || u->started) return TD_OK;
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  size_t j = 0;
  for (; st == TD_OK && j < u->nbk; j++)
    st = gather_bucket_start(z, u->b0 + j, &u->buf[j], &u->work[j]);
  td_autograd_set_enabled(prev);
  if (st != TD_OK) {
    for (size_t i = 0; i < j; i++) {
      (void)gather_bucket_wait(u, i);
      drop_buf(z, &u->buf[i]);
    }
    return st;
  }
  u->started = true;
  z->stats.unit_gathers++;
  if (prefetch) z->stats.prefetched++;
  return TD_OK;
}

/* Waits for u's gathers (starting them if needed) and copies them into the parameters, bucket by
 * bucket (each bucket's buffer dropped as soon as it is copied). */
static td_status unit_gather(td_zero *z, td__zunit *u) {
  if (u->gathered) return TD_OK;
  TD_TRY(gather_start(z, u, false));
  td_status st = TD_OK;
  int64_t restored = 0; /* parameter bytes given memory so far (counted in live_bytes) */
  bool prev = td_autograd_set_enabled(false);
  for (size_t j = 0; j < u->nbk; j++) {
    td_status ws = gather_bucket_wait(u, j);
    if (st == TD_OK) st = ws;
    const td__zbucket *b = &z->b[u->b0 + j];
    for (size_t q = b->first; st == TD_OK && q < b->first + b->count; q++) {
      size_t i = z->order[q];
      td_tensor *s = NULL;
      st = td__tensor_storage_restore(z->params[i]);
      if (st == TD_OK) {
        int64_t nb = (int64_t)td_tensor_nbytes(z->params[i]);
        restored += nb, z->live_bytes += nb;
        note_held(z);
      }
      if (st == TD_OK) st = td__coll_bucket_slice(u->buf[j], z->offset[i], z->params[i], &s);
      if (st == TD_OK) st = td_tensor_copy_(z->params[i], s);
      td_tensor_unref(s);
    }
    drop_buf(z, &u->buf[j]);
  }
  td_autograd_set_enabled(prev);
  u->started = false;
  if (st != TD_OK) { /* leave it free: half-copied values must not be used */
    for (size_t k = u->b0; k < u->b0 + u->nbk; k++) (void)free_bucket(z, k);
    z->live_bytes -= restored;
    return st;
  }
  u->gathered = true;
  z->live_bytes += u->nbytes - restored; /* u->nbytes == restored: its parameters */
  if (z->live_bytes > (int64_t)z->stats.peak_unit_bytes)
    z->stats.peak_unit_bytes = (uint64_t)z->live_bytes;
  return TD_OK;
}

/* Drops u's gathers in flight (waited for: their values are about to be stale). */
static td_status gather_drop(td__zunit *u) {
  td_status st = TD_OK;
  for (size_t j = 0; u->started && j < u->nbk; j++) {
    td_status ws = gather_bucket_wait(u, j);
    if (st == TD_OK) st = ws;
    drop_buf(u->z, &u->buf[j]);
  }
  u->started = false;
  return st;
}

static td_status prefetch(td_zero *z, size_t u) {
  if (z->zo.no_prefetch || u >= z->nu) return TD_OK;
  return gather_start(z, &z->u[u], true);
}

/* ---- hooks ---- */

typedef struct unit_node_ctx {
  td_zero *z;
  size_t u;
} unit_node_ctx;

/* Backward reached the unit's output: its parameters are needed again. */
static td_status unit_backward(void *ctx, td_tensor *const *grad_outputs, int n_outputs,
                               td_tensor **grad_inputs, int n_inputs) {
  unit_node_ctx *c = ctx;
  td_zero *z = c->z;
  td_status st = c->u > 0 ? prefetch(z, c->u - 1) : TD_OK;
  if (st == TD_OK) st = unit_gather(z, &z->u[c->u]);
  if (st != TD_OK) return st;
  for (int i = 0; i < n_inputs; i++)
    grad_inputs[i] = i < n_outputs && grad_outputs[i] ? td_tensor_ref(grad_outputs[i]) : NULL;
  return TD_OK;
}

static td_status pre_forward(void *ctx, td_module *m) {
  (void)m;
  td__zunit *u = ctx;
  td_zero *z = u->z;
  size_t next = u->index + 1;
  /* a recompute (activation checkpointing) runs in backward: the next unit is needed only when
   * its gradients are not all in yet (a region spanning several units recomputes them in order) */
  bool done = next < z->nu && z->u[next].ready == z->u[next].nbk;
  if (!td_checkpoint_is_recomputing() || !done) TD_TRY(prefetch(z, next));
  return unit_gather(z, u);
}

/* The outputs that require grad go through one identity node that gathers the unit in backward
 * (any number of them: the arrays are sized by n_outputs). */
static td_status wrap_outputs(td__zunit *u, td_tensor **outputs, int n_outputs) {
  unit_node_ctx *c = td__calloc(1, sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "zero: out of memory");
  c->z = u->z;
  c->u = u->index;
  return td__zero_wrap_outputs("ZeroUnitGather", outputs, n_outputs, unit_backward, c);
}

td_status td__zero_wrap_outputs(const char *name, td_tensor **outputs, int n_outputs,
                                td_external_backward_fn backward, void *ctx) {
  td_tensor **in = td__calloc((size_t)(n_outputs > 0 ? n_outputs : 1), sizeof *in);
  td_tensor **wrapped = td__calloc((size_t)(n_outputs > 0 ? n_outputs : 1), sizeof *wrapped);
  int *idx = td__calloc((size_t)(n_outputs > 0 ? n_outputs : 1), sizeof *idx);
  td_status st = TD_OK;
  int n = 0;
  if (!in || !wrapped || !idx)
    st = td_set_error(TD_ERR_NOMEM, "zero: out of memory (%d unit outputs)", n_outputs);
  for (int i = 0; st == TD_OK && i < n_outputs; i++)
    if (outputs[i] && td_tensor_requires_grad(outputs[i])) idx[n] = i, in[n++] = outputs[i];
  if (st != TD_OK || !n) td__free(ctx);
  if (st == TD_OK && n) {
    td_node *node = NULL;
    st = td_node_create_external(name, n, in, n, backward, ctx, td__free, &node);
    /* the node owns ctx, or freed it on failure */
    for (int k = 0; st == TD_OK && k < n; k++) {
      td_tensor *d = NULL;
      st = td_tensor_detach(in[k], &d);
      if (st == TD_OK) st = td_autograd_attach(d, node, k, &wrapped[k]);
      td_tensor_unref(d);
    }
    td_node_unref(node);
    for (int k = 0; k < n; k++) {
      if (st != TD_OK) {
        td_tensor_unref(wrapped[k]);
        continue;
      }
      td_tensor_unref(outputs[idx[k]]);
      outputs[idx[k]] = wrapped[k];
    }
  }
  td__free(in);
  td__free(wrapped);
  td__free(idx);
  return st;
}

static td_status post_forward(void *ctx, td_module *m, td_status fst, td_tensor **outputs,
                              int n_outputs) {
  (void)m;
  td__zunit *u = ctx;
  td_status st = TD_OK;
  if (fst == TD_OK && td_autograd_is_enabled()) st = wrap_outputs(u, outputs, n_outputs);
  /* a recompute's backward follows at once: the gradient hook completing the unit frees it */
  td_status fs = td_checkpoint_is_recomputing() ? TD_OK : unit_free(u->z, u);
  return st != TD_OK ? st : fs;
}

/* ---- lifecycle ---- */

td_status td__zero3_start(td_zero *z) {
  for (size_t u = 0; u < z->nu; u++) {
    td_status st = td_module_add_forward_hooks(z->u[u].m, pre_forward, post_forward, &z->u[u],
                                               &z->u[u].hook);
    if (st != TD_OK) return td__error_prefix(st, "zero_create: units[%zu]", u);
  }
  z->live_bytes = 0;
  for (size_t u = 0; u < z->nu; u++) z->live_bytes += z->u[u].nbytes;
  z->stats.units = z->nu;
  z->stats.peak_unit_bytes = 0;
  z->gather_bytes = 0;
  for (size_t u = 0; u < z->nu; u++) TD_TRY(unit_free(z, &z->u[u]));
  return TD_OK;
}

void td__zero3_unit_ready(td_zero *z, size_t k) {
  for (size_t u = 0; u < z->nu; u++) {
    td__zunit *un = &z->u[u];
    if (k < un->b0 || k >= un->b0 + un->nbk) continue;
    if (++un->ready == un->nbk) (void)unit_free(z, un);
    return;
  }
}

void td__zero3_begin_pass(td_zero *z) {
  for (size_t u = 0; u < z->nu; u++) z->u[u].ready = 0;
}

td_status td__zero3_end_pass(td_zero *z) {
  td_status st = TD_OK;
  for (size_t u = 0; u < z->nu; u++) {
    td__zunit *un = &z->u[u];
    td_status ds = gather_drop(un);
    if (ds != TD_OK && st == TD_OK) st = td__error_prefix(ds, "zero_step");
    td_status fs = unit_free(z, un);
    if (fs != TD_OK && st == TD_OK) st = fs;
    un->ready = 0;
  }
  return st;
}

bool td__zero3_param_live(const td_zero *z, size_t i) {
  return td__tensor_storage_live(z->params[i]);
}

td_status td_zero_gather_params(td_zero *z) {
  TD_CHECK_ARG(z, "zero_gather_params: NULL td_zero");
  if (!z->nu) return TD_OK;
  td_status st = TD_OK;
  for (size_t u = 0; st == TD_OK && u < z->nu; u++) st = gather_start(z, &z->u[u], false);
  for (size_t u = 0; st == TD_OK && u < z->nu; u++) st = unit_gather(z, &z->u[u]);
  if (st == TD_OK) z->pinned = true;
  return st;
}

td_status td_zero_release_params(td_zero *z) {
  TD_CHECK_ARG(z, "zero_release_params: NULL td_zero");
  z->pinned = false;
  td_status st = TD_OK;
  for (size_t u = 0; u < z->nu; u++) {
    if (z->u[u].started) continue; /* in flight: freed when the pass or the step ends */
    td_status fs = unit_free(z, &z->u[u]);
    if (fs != TD_OK && st == TD_OK) st = fs;
  }
  return st;
}

void td__zero3_destroy(td_zero *z) {
  for (size_t u = 0; z->u && u < z->nu; u++) {
    td__zunit *un = &z->u[u];
    if (un->hook) (void)td_module_remove_forward_hooks(un->m, un->hook);
    if (un->work && un->buf) (void)gather_drop(un);
    /* give the tensors memory again (zeros): the modules outlive this td_zero */
    for (size_t k = un->b0; !un->gathered && k < un->b0 + un->nbk; k++) {
      const td__zbucket *b = &z->b[k];
      for (size_t q = b->first; q < b->first + b->count; q++) {
        td_tensor *p = z->params[z->order[q]];
        if (td__tensor_storage_restore(p) == TD_OK) (void)td_tensor_zero_(p);
      }
    }
    td__free(un->work);
    td__free(un->buf);
  }
  td__free(z->u);
  td__free(z->unit_of);
}

td_status td__zero_units_map(td_module *const *units, size_t nu, td_tensor *const *params,
                             size_t np, int *unit_of, const char *fn) {
  for (size_t i = 0; i < np; i++) unit_of[i] = -1;
  td_status st = TD_OK;
  for (size_t u = 0; st == TD_OK && u < nu; u++) {
    if (!units[u]) return td_set_error(TD_ERR_INVALID, "%s: units[%zu] is NULL", fn, u);
    td_tensor_list l;
    td_tensor_list_init(&l);
    st = td_module_parameters(units[u], &l);
    if (st == TD_OK && l.n == 0)
      st = td_set_error(TD_ERR_INVALID, "%s: units[%zu] (%s) has no parameters", fn, u,
                        td_module_type_name(units[u]));
    for (size_t j = 0; st == TD_OK && j < l.n; j++) {
      size_t i = 0;
      while (i < np && params[i] != l.tensors[j]) i++;
      if (i == np)
        st = td_set_error(TD_ERR_INVALID, "%s: parameter '%s' of units[%zu] is not one of the "
                          "groups' parameters", fn, l.names[j], u);
      else if (unit_of[i] >= 0)
        st = td_set_error(TD_ERR_INVALID, "%s: parameter '%s' of units[%zu] is also in "
                          "units[%d] (a unit's parameters belong to it alone)", fn, l.names[j], u,
                          unit_of[i]);
      else
        unit_of[i] = (int)u;
    }
    td_tensor_list_fini(&l);
  }
  return st;
}
