/* zero.c - sharded data parallelism, ZeRO stages 1 and 2 (tdist/collectives.h, td_zero_*).
 *
 * Layout: the parameters are laid out in buckets (td__coll_plan_buckets, shared with DDP); a
 * bucket of B elements is padded to size * c with c = ceil(B / size), and member r owns its
 * elements [r * c, (r + 1) * c). Without overlap there is one bucket over the flat order (the
 * groups' order), so member r owns [r * S, (r + 1) * S) of the flat index space [0, P) with
 * S = ceil(P / size) (the tail of the last shards is padding, always zero). With overlap the
 * buckets follow the expected gradient order (td_zero_options.grad_order, else the flat order
 * reversed) and hold at most bucket_bytes each; a member's shard is its part of every bucket,
 * end to end. The part of a parameter that falls in this member's shard is a "segment"; each
 * segment has its own 1-D tensor (a copy of those elements, the master values of this member)
 * and the local td_optim steps the segments, each in the group of its parameter, so per-group
 * learning rates and weight decay hold element by element.
 *
 * A step (td_zero_step), with autograd off:
 *   reduction, bucket by bucket (a buffer of size * c zeros <- the parameters' .grads):
 *     stage 1: all_reduce(buf, AVG); .grads <- their slices; shard grad <- this member's part
 *     stage 2: reduce_scatter(this member's part of the shard grad <- buf, AVG); .grads cleared
 *     stage 2 overlapped: done during backward (below); the step waits for it
 *   clipping: sum of squares of the shard grad, all_reduce(SUM) of that one number, scale
 *   td_optim_step_grads(segments, their slices of the shard grad)
 *   per bucket: part (c) <- segments; all_gather(buf <- part); parameters <- slices of buf
 * Temporary buffers are one bucket at a time; the shard gradient has S elements.
 *
 * Overlap (stage 2, td_zero_prepare before backward): a hook on every parameter (it runs as the
 * gradient is about to be accumulated) adds the gradient (and a .grad left from before the pass)
 * into the parameter's slice of its bucket's buffer, allocated at the bucket's first gradient;
 * when every parameter of the next bucket in order has arrived, its reduce_scatter starts
 * asynchronously and the buffer is released when it completes, so buckets start in the same
 * order on every member. A parameter's .grad, accumulated by autograd right after its hook, is
 * dropped at the next hook (or at the step), so no full gradient outlives the step. A gradient
 * that arrives after its bucket started (a second backward in one pass; autograd sums a leaf's
 * uses, tied weights included, before its hook runs) stays in .grad; the step agrees on such
 * late buckets across the group (an all_reduce MAX of one flag per bucket) and reduce_scatters
 * their late gradients into the shard gradient. A parameter that got no gradient counts as zeros
 * (or its .grad). With max_inflight_bytes, a hook about to allocate a buffer first waits for
 * started reduce_scatters, oldest first, until the live buffers fit (a member ahead of the
 * others would otherwise hold its whole gradient in buckets waiting for them). Buffers are
 * counted (peak_bucket_bytes) until their reduce_scatter completes, by the worker thread's
 * future callback or by whoever waited, once. Hooks run on the thread that runs backward; the group's worker thread runs the
 * reduce_scatters and touches only the bucket buffers it was handed and this member's parts of
 * the shard gradient, which nothing else reads or writes before the step has waited for them.
 *
 * Gradient accumulation (td_zero_no_sync): a pass prepared while no_sync is set runs the same
 * hooks (each gradient added into its bucket's buffer, the .grad dropped, stage 3's units freed
 * once their buckets are complete) but starts no reduce_scatter; the buffers, allocated at the
 * window's first gradients, keep the sum of the window's passes, and the next pass prepared
 * without no_sync adds its gradients and starts each bucket as it completes, as any overlapped
 * pass: one reduction per window, overlapped with the last backward. So at stages 2 and 3 the
 * window's gradient lives in the bucket buffers (the full gradient of the model, P elements,
 * held locally until the last pass: the price of one reduction instead of K; nothing in .grad,
 * no second copy); max_inflight_bytes cannot apply while the window is open. A td_zero_step
 * after a no_sync pass (no_sync cleared) reduces the window after backward. Stage 1 and stage 2
 * without overlap need nothing: backward passes accumulate into .grad and the step reduces once.
 * td_zero_zero_grad drops a window's buffers (as it drops .grads), and a step under no_sync is
 * refused.
 *
 * Loss scaling (td_zero_step_scaled): after the reduction the shard gradient (stage 1: the
 * averaged .grads) is unscaled by the td_grad_scaler, and found_inf is agreed over the group (and
 * norm_group) with an all_reduce MAX of one flag, since at stages 2 and 3 each member sees only
 * its shard's gradients: on an inf or a NaN anywhere every member skips clipping, the shard step
 * and the gathers alike, so the parameters stay equal everywhere.
 *
 * Every member runs the same collectives in the same order, so a member that skips a step is
 * caught by the group's mismatch detection like any other collective.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zero_impl.h"
#include "tdist/autograd.h"

#define DEFAULT_BUCKET_BYTES ((size_t)4 << 20) /* small: a bucket in flight is the full gradient stage 2 holds */
#define DEFAULT_FIRST_BUCKET_BYTES ((size_t)1 << 20)

typedef struct hook_ctx {
  td_zero *z;
  size_t param;
} hook_ctx;

void td_zero_options_init(td_zero_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->stage = 2;
}

/* t's elements as a flat view (t contiguous) or a flat copy. New reference. */
static td_status flatten(td_tensor *t, td_tensor **out) {
  int64_t n = td_tensor_numel(t);
  if (td_tensor_is_contiguous(t)) return td_tensor_reshape(t, &n, 1, out);
  td_tensor *c = NULL;
  TD_TRY(td_tensor_clone(t, &c));
  td_status st = td_tensor_reshape(c, &n, 1, out);
  td_tensor_unref(c);
  return st;
}

static td_status check_params(td_zero *z) {
  for (size_t i = 0; i < z->np; i++) {
    td_tensor *p = z->params[i];
    td_dtype dt = td_tensor_dtype(p);
    td_device dev = td_tensor_device(p);
    if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
      return td_set_error(TD_ERR_DTYPE, "zero_create: parameter %zu is %s; float32 or float64 "
                          "only", i, td_dtype_name(dt));
    if (dt != z->dt || dev.type != z->dev.type || dev.index != z->dev.index)
      return td_set_error(TD_ERR_INVALID, "zero_create: parameter %zu differs in dtype or device "
                          "from parameter 0 (one flat layout needs one dtype and one device)", i);
    for (size_t j = 0; j < i; j++)
      if (z->params[j] == p)
        return td_set_error(TD_ERR_INVALID, "zero_create: parameter %zu appears twice "
                            "(positions %zu and %zu)", i, j, i);
  }
  if (td_process_group_backend(z->pg) == TD_PG_BACKEND_NCCL && z->np && z->dev.type != TD_DEVICE_CUDA)
    return td_set_error(TD_ERR_DEVICE, "zero_create: an NCCL group needs parameters on CUDA");
  return TD_OK;
}

static int seg_cmp(const void *a, const void *b) {
  const td__zseg *x = a, *y = b;
  if (x->param != y->param) return x->param < y->param ? -1 : 1;
  return x->off < y->off ? -1 : x->off > y->off;
}

/* The bucket order: grad_order's parameters first, then the others in reverse flat order with
 * overlap; the flat order without. */
static td_status make_order(td_zero *z) {
  bool *used = td__calloc(z->np ? z->np : 1, sizeof *used);
  if (!used) return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  size_t k = 0;
  td_status st = TD_OK;
  for (size_t j = 0; z->zo.overlap && j < z->zo.n_grad_order; j++) {
    size_t i = 0;
    while (i < z->np && z->params[i] != z->zo.grad_order[j]) i++;
    if (i == z->np) {
      st = td_set_error(TD_ERR_INVALID, "zero_create: grad_order entry %zu is not one of the "
                        "groups' parameters", j);
      break;
    }
    if (!used[i]) used[i] = true, z->order[k++] = i; /* a repeat (tied weights) counts once */
  }
  for (size_t i = z->np; st == TD_OK && i-- > 0;)
    if (!used[i] && z->zo.overlap) z->order[k++] = i;
  for (size_t i = 0; st == TD_OK && !z->zo.overlap && i < z->np; i++) z->order[k++] = i;
  td__free(used);
  return st;
}

/* Lays the parameters out in buckets and gives each bucket its chunk; returns S. */
static td_status make_buckets(td_zero *z, int64_t *S) {
  size_t m = z->np ? z->np : 1;
  z->order = td__calloc(m, sizeof *z->order);
  z->bucket_of = td__calloc(m, sizeof *z->bucket_of);
  z->offset = td__calloc(m, sizeof *z->offset);
  z->b = td__calloc(m, sizeof *z->b);
  size_t *first = td__calloc(m, sizeof *first), *count = td__calloc(m, sizeof *count);
  int64_t *numel = td__calloc(m, sizeof *numel);
  td_status st = TD_OK;
  if (!z->order || !z->bucket_of || !z->offset || !z->b || !first || !count || !numel)
    st = td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  if (st == TD_OK) st = make_order(z);
  size_t cap = z->zo.bucket_bytes ? z->zo.bucket_bytes : DEFAULT_BUCKET_BYTES, first_cap = cap;
  if (z->zo.overlap)
    first_cap = z->zo.first_bucket_bytes ? z->zo.first_bucket_bytes : DEFAULT_FIRST_BUCKET_BYTES;
  td__coll_bucket_plan plan = {z->bucket_of, z->offset, first, count, numel, 0};
  if (st == TD_OK) td__coll_plan_buckets(z->params, z->order, z->np, first_cap, cap, &plan);
  int n = td_process_group_size(z->pg);
  *S = 0;
  for (size_t k = 0; st == TD_OK && k < plan.nbuckets; k++) {
    td__zbucket *b = &z->b[z->nb++];
    b->first = first[k];
    b->count = count[k];
    b->numel = numel[k];
    b->chunk = numel[k] ? (numel[k] + n - 1) / n : 1;
    b->shard_off = *S;
    b->owner = z;
    *S += b->chunk;
  }
  td__free(first);
  td__free(count);
  td__free(numel);
  return st;
}

/* Cuts this member's part of every bucket into segments (sorted by parameter, then offset) and
 * makes their master values: views of the parameters at stages 1 and 2 (the parameter memory
 * every member keeps anyway), copies at stage 3 (the parameters are freed between uses). */
static td_status make_segments(td_zero *z) {
  size_t m = z->np + z->nb + 1;
  z->segs = td__calloc(m, sizeof *z->segs);
  z->seg = td__calloc(m, sizeof *z->seg);
  if (!z->segs || !z->seg) return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  int64_t r = td_process_group_rank(z->pg);
  for (size_t k = 0; k < z->nb; k++) {
    const td__zbucket *b = &z->b[k];
    int64_t lo = r * b->chunk, hi = lo + b->chunk;
    for (size_t q = b->first; q < b->first + b->count; q++) {
      size_t i = z->order[q];
      int64_t a = z->offset[i], e = a + td_tensor_numel(z->params[i]);
      int64_t s0 = a > lo ? a : lo, e0 = e < hi ? e : hi;
      if (s0 < e0)
        z->segs[z->nseg++] = (td__zseg){i, k, s0 - a, e0 - s0, b->shard_off + (s0 - lo)};
    }
  }
  qsort(z->segs, z->nseg, sizeof *z->segs, seg_cmp);
  td_status st = TD_OK;
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) {
    td_tensor *p = z->params[z->segs[k].param], *flat = NULL, *piece = NULL;
    /* stages 1 and 2: the parameter's own elements (a view: stepping it updates them in place);
     * stage 3, or a parameter that is not contiguous: a copy */
    bool view = z->zo.stage < 3 && td_tensor_is_contiguous(p);
    st = flatten(p, &flat);
    if (st == TD_OK) st = td_tensor_narrow(flat, 0, z->segs[k].off, z->segs[k].len, &piece);
    if (st == TD_OK && view) z->seg[k] = td_tensor_ref(piece);
    else if (st == TD_OK) st = td_tensor_clone(piece, &z->seg[k]);
    td_tensor_unref(piece);
    td_tensor_unref(flat);
  }
  return st;
}

/* The local optimizer over the segments, each in its parameter's group (segments are sorted by
 * parameter, so each group's are contiguous). */
static td_status make_optim(td_zero *z, const td_optim_options *opts,
                            const td_optim_group *groups, size_t n_groups) {
  if (!z->nseg) return TD_OK;
  td_optim_group *sg = td__calloc(n_groups, sizeof *sg);
  if (!sg) return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  size_t k = 0, first = 0; /* parameters of group g: [first, first + groups[g].n) */
  for (size_t g = 0; g < n_groups; g++) {
    size_t start = k;
    while (k < z->nseg && z->segs[k].param < first + groups[g].n) k++;
    td_optim_group_init(&sg[g], z->seg + start, k - start);
    sg[g].lr = groups[g].lr;
    sg[g].weight_decay = groups[g].weight_decay;
    first += groups[g].n;
  }
  td_status st = td_optim_create_groups(opts, sg, n_groups, &z->opt);
  td__free(sg);
  return st;
}

static td_status grad_hook(void *ctx, const td_tensor *grad, td_tensor **replacement);

/* Overlap: a hook on every parameter. */
static td_status add_hooks(td_zero *z) {
  size_t m = z->np ? z->np : 1;
  hook_ctx *h = td__calloc(m, sizeof *h);
  z->hctx = h;
  z->hook_handle = td__calloc(m, sizeof *z->hook_handle);
  z->seen = td__calloc(m, sizeof *z->seen);
  z->late = td__calloc(m, sizeof *z->late);
  if (!h || !z->hook_handle || !z->seen || !z->late)
    return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  for (size_t i = 0; i < z->np; i++) z->hook_handle[i] = -1;
  for (size_t i = 0; i < z->np; i++) {
    h[i] = (hook_ctx){z, i};
    TD_TRY(td_tensor_register_hook(z->params[i], grad_hook, &h[i], &z->hook_handle[i]));
  }
  return TD_OK;
}

static td_status check_options(const td_zero_options *zo) {
  if (zo->stage < 1 || zo->stage > 3)
    return td_set_error(TD_ERR_INVALID, "zero_create: stage %d; 1 (optimizer state), 2 (also "
                        "gradients) or 3 (also parameters)", zo->stage);
  if (zo->stage == 3 && (!zo->units || !zo->n_units))
    return td_set_error(TD_ERR_INVALID, "zero_create: stage 3 needs units (td_zero_options.units: "
                        "the modules whose parameters are gathered together, e.g. the blocks)");
  if (zo->stage != 3 && zo->n_units)
    return td_set_error(TD_ERR_INVALID, "zero_create: units are for stage 3 (stage %d given)",
                        zo->stage);
  if (!(zo->max_grad_norm >= 0) || isinf(zo->max_grad_norm))
    return td_set_error(TD_ERR_INVALID, "zero_create: max_grad_norm must be finite and >= 0");
  if (zo->norm_weights)
    for (size_t i = 0; i < zo->n_norm_weights; i++)
      if (!(zo->norm_weights[i] >= 0) || isinf(zo->norm_weights[i]))
        return td_set_error(TD_ERR_INVALID, "zero_create: norm_weights[%zu] = %g must be finite "
                            "and >= 0", i, zo->norm_weights[i]);
  if (zo->overlap && zo->stage == 1)
    return td_set_error(TD_ERR_INVALID, "zero_create: overlap needs stage 2 (stage 1 keeps full "
                        "gradients; for them td_ddp_create_ex overlaps the all_reduce)");
  if (zo->n_grad_order && !zo->grad_order)
    return td_set_error(TD_ERR_INVALID, "zero_create: n_grad_order %zu with a NULL grad_order",
                        zo->n_grad_order);
  return TD_OK;
}

/* Takes a reference to every group's parameters into z->params (flat order); *P: elements. */
static td_status take_params(td_zero *z, const td_optim_group *groups, size_t n_groups,
                             int64_t *P) {
  for (size_t g = 0; g < n_groups; g++) {
    if (groups[g].n && !groups[g].params)
      return td_set_error(TD_ERR_INVALID, "zero_create: group %zu has no parameter array", g);
    z->np += groups[g].n;
  }
  z->params = td__calloc(z->np ? z->np : 1, sizeof *z->params);
  if (!z->params) return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  *P = 0;
  for (size_t g = 0, i = 0; g < n_groups; g++) {
    for (size_t j = 0; j < groups[g].n; j++, i++) {
      if (!groups[g].params[j])
        return td_set_error(TD_ERR_INVALID, "zero_create: group %zu, parameter %zu is NULL", g, j);
      z->params[i] = td_tensor_ref(groups[g].params[j]);
      *P += td_tensor_numel(z->params[i]);
    }
  }
  return TD_OK;
}

td_status td_zero_create(td_process_group *pg, const td_optim_options *opts,
                         const td_optim_group *groups, size_t n_groups,
                         const td_zero_options *zopts, td_zero **out) {
  TD_CHECK_ARG(pg && opts && (groups || !n_groups) && out,
               "zero_create: NULL group, options, groups or out");
  *out = NULL;
  td_zero *z = td__calloc(1, sizeof *z);
  if (!z) return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  z->pg = pg;
  z->okind = opts->kind;
  if (zopts) z->zo = *zopts;
  else td_zero_options_init(&z->zo);
  int64_t P = 0, S = 0;
  td_status st = check_options(&z->zo);
  if (z->zo.stage == 3) z->zo.overlap = true; /* stage 3 reduces during backward */
  if (st == TD_OK) st = take_params(z, groups, n_groups, &P);
  if (st == TD_OK && z->zo.norm_weights) {
    if (z->zo.n_norm_weights != z->np)
      st = td_set_error(TD_ERR_INVALID, "zero_create: %zu norm weights for %zu parameters",
                        z->zo.n_norm_weights, z->np);
    else if (!(z->norm_w = td__calloc(z->np ? z->np : 1, sizeof *z->norm_w)))
      st = td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
    else
      memcpy(z->norm_w, z->zo.norm_weights, z->np * sizeof *z->norm_w);
  }
  z->zo.norm_weights = NULL; /* the caller's array: read here only */
  if (st == TD_OK && z->np) {
    z->dt = td_tensor_dtype(z->params[0]);
    z->dev = td_tensor_device(z->params[0]);
  } else {
    z->dt = TD_DTYPE_F32;
    z->dev = td_process_group_backend(pg) == TD_PG_BACKEND_NCCL ? td_device_cuda(0) : td_device_cpu();
  }
  if (st == TD_OK) st = check_params(z);
  bool prev = td_autograd_set_enabled(false);
  if (st == TD_OK) st = td__coll_check_same_params(pg, z->params, z->np, z->dev, "zero_create");
  for (size_t i = 0; st == TD_OK && i < z->np; i++)
    st = td__coll_broadcast_tensor(pg, z->params[i]);
  if (st == TD_OK) st = z->zo.stage == 3 ? td__zero3_plan(z, &S) : make_buckets(z, &S);
  if (st == TD_OK) st = make_segments(z);
  td_autograd_set_enabled(prev);
  if (st == TD_OK) st = make_optim(z, opts, groups, n_groups);
  if (st == TD_OK && z->zo.overlap) st = add_hooks(z);
  if (st == TD_OK && z->zo.stage == 3) st = td__zero3_start(z);
  z->zo.grad_order = NULL; /* borrowed for the creation only */
  z->zo.n_grad_order = 0;
  z->zo.units = NULL;
  if (st != TD_OK) {
    td_zero_destroy(z);
    return st;
  }
  z->pending = z->np;
  z->stats.stage = z->zo.stage;
  z->stats.numel = P;
  z->stats.shard_numel = S;
  for (size_t k = 0; k < z->nseg; k++) z->stats.owned_numel += z->segs[k].len;
  z->stats.optim_params = z->nseg;
  z->stats.buckets = z->nb;
  z->stats.overlap = z->zo.overlap;
  z->stats.last_grad_norm = NAN;
  *out = z;
  return TD_OK;
}

/* The slice of the bucket buffer buf holding parameter i, shaped like it. New reference. */
static td_status slice_of(td_zero *z, td_tensor *buf, size_t i, td_tensor **out) {
  return td__coll_bucket_slice(buf, z->offset[i], z->params[i], out);
}

static td_status bucket_buffer(td_zero *z, const td__zbucket *b, td_tensor **out) {
  int64_t all = b->chunk * td_process_group_size(z->pg);
  return td_tensor_zeros(&all, 1, z->dt, z->dev, out);
}

/* buf (zeros) <- the .grads of bucket k's parameters (only the late ones when late_only). */
static td_status fill_bucket(td_zero *z, size_t k, td_tensor *buf, bool late_only) {
  const td__zbucket *b = &z->b[k];
  td_status st = TD_OK;
  for (size_t q = b->first; st == TD_OK && q < b->first + b->count; q++) {
    size_t i = z->order[q];
    if (late_only && !z->late[i]) continue;
    td_tensor *g = td_tensor_grad(z->params[i]), *s = NULL;
    if (!g) continue;
    st = slice_of(z, buf, i, &s);
    if (st == TD_OK) st = td_tensor_copy_(s, g);
    td_tensor_unref(s);
    td_tensor_unref(g);
  }
  return st;
}

/* Stage 1: the averaged gradients of bucket k go back into the .grads (a parameter without one
 * gets one). */
static td_status scatter_grads(td_zero *z, size_t k, td_tensor *buf) {
  const td__zbucket *b = &z->b[k];
  td_status st = TD_OK;
  for (size_t q = b->first; st == TD_OK && q < b->first + b->count; q++) {
    td_tensor *s = NULL;
    st = slice_of(z, buf, z->order[q], &s);
    if (st == TD_OK) st = td__coll_grad_assign(z->params[z->order[q]], s);
    td_tensor_unref(s);
  }
  return st;
}

/* This member's part of bucket k in the shard gradient. New reference. */
static td_status part_of(td_zero *z, td_tensor *sgrad, size_t k, td_tensor **out) {
  return td_tensor_narrow(sgrad, 0, z->b[k].shard_off, z->b[k].chunk, out);
}

/* Without overlap: every bucket from the .grads, one bucket buffer at a time. Stage 1
 * all_reduces into the .grads (sgrad NULL: the segments' gradients are read from them); stage 2
 * reduce_scatters into the shard gradient. */
static td_status reduce_after(td_zero *z, td_tensor *sgrad) {
  td_status st = TD_OK;
  for (size_t k = 0; st == TD_OK && k < z->nb; k++) {
    td_tensor *buf = NULL, *part = NULL;
    st = bucket_buffer(z, &z->b[k], &buf);
    if (st == TD_OK) st = fill_bucket(z, k, buf, false);
    if (z->zo.stage == 1) {
      if (st == TD_OK) st = td_process_group_all_reduce(z->pg, buf, TD_REDUCE_AVG);
      if (st == TD_OK) st = scatter_grads(z, k, buf);
    } else {
      if (st == TD_OK) st = part_of(z, sgrad, k, &part);
      if (st == TD_OK) st = td_process_group_reduce_scatter_tensor(z->pg, part, buf, TD_REDUCE_AVG);
    }
    z->stats.bytes_reduced += td_tensor_nbytes(buf);
    td_tensor_unref(part);
    td_tensor_unref(buf);
  }
  return st;
}

/* ---- overlap ---- */

/* Bucket buffers of an overlapped pass are counted from allocation until their reduce_scatter
 * completes: by the group's worker thread (a future callback) or by a hook that waited for it,
 * whichever comes first (the flag `released`). */
static void release_bytes(td__zbucket *b) {
  if (!__atomic_exchange_n(&b->released, true, __ATOMIC_ACQ_REL))
    __atomic_sub_fetch(&b->owner->inflight, b->nbytes, __ATOMIC_RELAXED);
}

static void bucket_done(td_future *f, void *ctx) {
  (void)f;
  release_bytes(ctx);
}

/* With max_inflight_bytes: waits, oldest first, for started buckets until need more bytes fit. */
static td_status make_room(td_zero *z, int64_t need) {
  int64_t cap = (int64_t)z->zo.max_inflight_bytes;
  while (cap && __atomic_load_n(&z->inflight, __ATOMIC_RELAXED) + need > cap &&
         z->oldest < z->next_bucket) {
    td__zbucket *b = &z->b[z->oldest++];
    if (!b->work) continue;
    td_status st = td_future_wait(b->work, TD_TIMEOUT_INFINITE); /* bounded by the group */
    if (st != TD_OK) return td_set_error(st, "zero: %s", td_future_message(b->work));
    release_bytes(b);
    z->stats.waits_for_room++;
  }
  return TD_OK;
}

static td_status pass_buffer(td_zero *z, td__zbucket *b) {
  if (b->buf) return TD_OK;
  int64_t need = b->chunk * td_process_group_size(z->pg) * (int64_t)td_dtype_size(z->dt);
  TD_TRY(make_room(z, need));
  TD_TRY(bucket_buffer(z, b, &b->buf));
  b->nbytes = (int64_t)td_tensor_nbytes(b->buf);
  b->released = false;
  int64_t now = __atomic_add_fetch(&z->inflight, b->nbytes, __ATOMIC_RELAXED);
  if (now > (int64_t)z->stats.peak_bucket_bytes) z->stats.peak_bucket_bytes = (uint64_t)now;
  return TD_OK;
}

/* Starts bucket b's reduce_scatter into this member's part of the shard gradient and lets the
 * queued operation hold the last reference to the bucket's buffer. */
static td_status start_bucket(td_zero *z, size_t k, bool in_backward) {
  td__zbucket *b = &z->b[k];
  td_status st = pass_buffer(z, b);
  td_tensor *part = NULL;
  if (st == TD_OK) st = part_of(z, z->sgrad, k, &part);
  if (st == TD_OK)
    st = td_process_group_reduce_scatter_tensor_async(z->pg, part, b->buf, TD_REDUCE_AVG, &b->work);
  if (st == TD_OK && td_future_on_done(b->work, bucket_done, b) != TD_OK)
    bucket_done(b->work, b); /* out of memory for the callback: counted as released now */
  if (st == TD_OK) {
    uint64_t bytes = td_tensor_nbytes(b->buf);
    z->stats.bytes_reduced += bytes;
    if (in_backward) z->stats.bytes_started_in_backward += bytes;
    td_tensor_unref(b->buf);
    b->buf = NULL;
  }
  td_tensor_unref(part);
  return st;
}

/* Starts, in bucket order, every bucket whose parameters have all arrived. */
static td_status start_ready(td_zero *z) {
  while (z->next_bucket < z->nb && z->b[z->next_bucket].ready == z->b[z->next_bucket].count) {
    TD_TRY(start_bucket(z, z->next_bucket, true));
    z->next_bucket++;
  }
  return TD_OK;
}

/* The .grad autograd accumulated after the previous hook is already in its bucket: drop it. */
static void drop_pending(td_zero *z) {
  if (z->pending < z->np) (void)td_tensor_set_grad(z->params[z->pending], NULL);
  z->pending = z->np;
}

/* The gradient of parameter i is about to be accumulated: add it into its bucket's slice. */
static td_status hook_body(td_zero *z, size_t i, const td_tensor *grad) {
  drop_pending(z);
  td__zbucket *b = &z->b[z->bucket_of[i]];
  if (b->work) { /* too late for the bucket: kept in .grad, reduced again at the step */
    z->late[i] = true;
    b->late = true;
    return TD_OK;
  }
  td_status st = pass_buffer(z, b);
  td_tensor *s = NULL, *old = NULL;
  if (st == TD_OK) st = slice_of(z, b->buf, i, &s);
  if (st == TD_OK) st = td_tensor_add_(s, grad, 1.0);
  if (st == TD_OK && !z->seen[i]) { /* a .grad from before the pass counts too */
    old = td_tensor_grad(z->params[i]);
    if (old) st = td_tensor_add_(s, old, 1.0);
    z->seen[i] = true;
    b->ready++;
    if (b->ready == b->count) td__zero3_unit_ready(z, z->bucket_of[i]); /* stage 3 */
  }
  td_tensor_unref(s);
  td_tensor_unref(old);
  z->pending = i;
  if (st != TD_OK) return st;
  if (!z->pass_sync) { /* accumulating: the buffers keep the window's sum, nothing starts */
    z->window = true;
    return TD_OK;
  }
  return start_ready(z);
}

static td_status grad_hook(void *ctx, const td_tensor *grad, td_tensor **replacement) {
  (void)replacement;
  hook_ctx *h = ctx;
  td_zero *z = h->z;
  if (!z->armed || z->hook_st != TD_OK) return TD_OK;
  bool prev = td_autograd_set_enabled(false);
  td_status st = hook_body(z, h->param, grad);
  td_autograd_set_enabled(prev);
  if (st != TD_OK) { /* reported by td_zero_step, not by backward */
    z->hook_st = st;
    snprintf(z->hook_msg, sizeof z->hook_msg, "%s", td_last_error());
  }
  return TD_OK;
}

/* The pass's shard gradient (S elements of zeros), made by the pass that reduces. */
static td_status make_sgrad(td_zero *z) {
  if (z->sgrad) return TD_OK;
  int64_t S = z->stats.shard_numel ? z->stats.shard_numel : 1;
  return td_tensor_zeros(&S, 1, z->dt, z->dev, &z->sgrad);
}

/* Ends a no_sync pass (its gradients stay in the buckets); reports a failure of its hooks. */
static td_status end_accumulating(td_zero *z, const char *what) {
  drop_pending(z);
  z->armed = false;
  if (z->hook_st != TD_OK)
    return td_set_error(z->hook_st, "%s: inside the previous backward: %s", what, z->hook_msg);
  return TD_OK;
}

td_status td_zero_prepare(td_zero *z) {
  TD_CHECK_ARG(z, "zero_prepare: NULL td_zero");
  if (!z->zo.overlap)
    return td_set_error(TD_ERR_STATE, "zero_prepare: this td_zero was created without overlap "
                        "(td_zero_options.overlap); td_zero_step reduces after backward");
  if (z->armed && z->pass_sync)
    return td_set_error(TD_ERR_STATE, "zero_prepare: the previous pass was not finished "
                        "(td_zero_step after every backward, or td_zero_no_sync before it)");
  if (z->armed) TD_TRY(end_accumulating(z, "zero_prepare"));
  z->pass_sync = !z->no_sync;
  if (z->pass_sync) TD_TRY(make_sgrad(z));
  else z->stats.passes_accumulated++;
  td__zero3_begin_pass(z);
  for (size_t k = 0; k < z->nb; k++) z->b[k].ready = 0, z->b[k].late = false;
  memset(z->seen, 0, z->np * sizeof *z->seen);
  memset(z->late, 0, z->np * sizeof *z->late);
  z->pending = z->np;
  z->next_bucket = 0;
  z->oldest = 0;
  z->hook_st = TD_OK;
  z->hook_msg[0] = 0;
  z->armed = true;
  return TD_OK;
}

void td_zero_no_sync(td_zero *z, bool no_sync) {
  if (z) z->no_sync = no_sync;
}

/* Parameters that got no gradient this pass: their .grad or zeros. */
static td_status add_unseen(td_zero *z) {
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    if (z->seen[i]) continue;
    td__zbucket *b = &z->b[z->bucket_of[i]];
    td_tensor *g = td_tensor_grad(z->params[i]), *s = NULL;
    st = pass_buffer(z, b); /* zeros, or the window's sum */
    if (st == TD_OK && g) st = slice_of(z, b->buf, i, &s);
    if (st == TD_OK && g) st = td_tensor_add_(s, g, 1.0);
    td_tensor_unref(s);
    td_tensor_unref(g);
    z->seen[i] = true;
    b->ready++;
  }
  return st;
}

/* Every member learns which buckets are late anywhere (one flag per bucket, all_reduce MAX). */
static td_status agree_late(td_zero *z) {
  if (!z->nb) return TD_OK;
  int64_t nb = (int64_t)z->nb;
  td_tensor *f = NULL, *fd = NULL, *back = NULL;
  td_status st = td_tensor_zeros(&nb, 1, TD_DTYPE_I64, td_device_cpu(), &f);
  if (st == TD_OK) {
    int64_t *v = td_tensor_data(f);
    for (size_t k = 0; k < z->nb; k++) v[k] = z->b[k].late;
    st = td_tensor_to(f, z->dev, &fd);
  }
  if (st == TD_OK) st = td_process_group_all_reduce(z->pg, fd, TD_REDUCE_MAX);
  if (st == TD_OK) st = td_tensor_to(fd, td_device_cpu(), &back);
  if (st == TD_OK) {
    const int64_t *v = td_tensor_data(back);
    for (size_t k = 0; k < z->nb; k++) z->b[k].late = v[k] != 0;
  }
  td_tensor_unref(f);
  td_tensor_unref(fd);
  td_tensor_unref(back);
  return st;
}

/* A late bucket: its late gradients reduce_scattered and added to this member's part. */
static td_status reduce_late(td_zero *z, size_t k, td_tensor *sgrad) {
  td_tensor *buf = NULL, *tmp = NULL, *part = NULL;
  int64_t c = z->b[k].chunk;
  td_status st = bucket_buffer(z, &z->b[k], &buf);
  if (st == TD_OK) st = fill_bucket(z, k, buf, true);
  if (st == TD_OK) st = td_tensor_empty(&c, 1, z->dt, z->dev, &tmp);
  if (st == TD_OK) st = td_process_group_reduce_scatter_tensor(z->pg, tmp, buf, TD_REDUCE_AVG);
  if (st == TD_OK) st = part_of(z, sgrad, k, &part);
  if (st == TD_OK) st = td_tensor_add_(part, tmp, 1.0);
  if (st == TD_OK) z->stats.late_buckets++, z->stats.bytes_reduced += td_tensor_nbytes(buf);
  td_tensor_unref(buf);
  td_tensor_unref(tmp);
  td_tensor_unref(part);
  return st;
}

/* Ends an overlapped pass: starts what is left in order, waits, adds the late gradients. A
 * no_sync pass (the last of a window, no_sync cleared since) has started nothing: everything
 * starts here. */
static td_status finish_overlap(td_zero *z) {
  z->armed = false;
  td_status st = z->hook_st;
  if (st != TD_OK) td_set_error(st, "zero_step: inside backward: %s", z->hook_msg);
  drop_pending(z);
  if (st == TD_OK && !z->pass_sync) st = make_sgrad(z);
  z->pass_sync = true;
  z->window = false;
  if (st == TD_OK) st = add_unseen(z);
  for (; st == TD_OK && z->next_bucket < z->nb; z->next_bucket++)
    st = start_bucket(z, z->next_bucket, false);
  if (st == TD_OK) st = agree_late(z);
  for (size_t k = 0; k < z->nb; k++) { /* a failure stops starting but still waits */
    td__zbucket *b = &z->b[k];
    if (b->buf) release_bytes(b); /* never started */
    td_tensor_unref(b->buf);
    b->buf = NULL;
    if (!b->work) continue;
    td_status ws = td_future_wait(b->work, TD_TIMEOUT_INFINITE); /* bounded by the group */
    if (ws != TD_OK && st == TD_OK)
      st = td_set_error(ws, "zero_step: %s", td_future_message(b->work));
    release_bytes(b); /* counted out now, whether or not its callback has run yet */
    td_future_unref(b->work);
    b->work = NULL;
  }
  for (size_t k = 0; st == TD_OK && k < z->nb; k++)
    if (z->b[k].late) st = reduce_late(z, k, z->sgrad);
  if (st == TD_OK) z->stats.passes_overlapped++;
  return st;
}

/* ---- the step ---- */

static double sum_squares(const td_tensor *t) {
  double s = 0;
  int64_t n = td_tensor_numel(t);
  if (td_tensor_dtype(t) == TD_DTYPE_F64) {
    const double *v = td_tensor_data(t);
    for (int64_t i = 0; i < n; i++) s += v[i] * v[i];
  } else {
    const float *v = td_tensor_data(t);
    for (int64_t i = 0; i < n; i++) s += (double)v[i] * v[i];
  }
  return s;
}

/* Clips the shard gradient by the global norm (every member computes the same coefficient). */
/* weighted_squares: the squares of the shard gradient, each segment's weighted by its
 * parameter's norm weight. */
static double weighted_squares(const td_zero *z, const td_tensor *cpu) {
  double s = 0;
  bool f64 = td_tensor_dtype(cpu) == TD_DTYPE_F64;
  for (size_t k = 0; k < z->nseg; k++) {
    const td__zseg *g = &z->segs[k];
    double part = 0;
    for (int64_t i = g->shard_off; i < g->shard_off + g->len; i++) {
      double v = f64 ? ((const double *)td_tensor_data(cpu))[i]
                     : (double)((const float *)td_tensor_data(cpu))[i];
      part += v * v;
    }
    s += z->norm_w[g->param] * part;
  }
  return s;
}

/* sum_over sums the double in *v over pg (on the group's device for NCCL). */
static td_status sum_over(td_zero *z, td_process_group *pg, double *v) {
  td_tensor *one = NULL, *dev = NULL, *back = NULL;
  int64_t n1 = 1;
  td_device d = td_process_group_backend(pg) == TD_PG_BACKEND_NCCL ? z->dev : td_device_cpu();
  td_status st = td_tensor_from_buffer(v, &n1, 1, TD_DTYPE_F64, &one);
  if (st == TD_OK) st = td_tensor_to(one, d, &dev);
  if (st == TD_OK) st = td_process_group_all_reduce(pg, dev, TD_REDUCE_SUM);
  if (st == TD_OK) st = td_tensor_to(dev, td_device_cpu(), &back);
  if (st == TD_OK) *v = *(const double *)td_tensor_data(back);
  td_tensor_unref(one);
  td_tensor_unref(dev);
  td_tensor_unref(back);
  return st;
}

/* Segment k's gradient: its slice of the shard gradient, or (stage 1: sgrad NULL) of its
 * parameter's averaged .grad. New reference. */
static td_status seg_grad(td_zero *z, td_tensor *sgrad, size_t k, td_tensor **out) {
  const td__zseg *g = &z->segs[k];
  if (sgrad) return td_tensor_narrow(sgrad, 0, g->shard_off, g->len, out);
  td_tensor *grad = td_tensor_grad(z->params[g->param]), *flat = NULL;
  if (!grad) return td_set_error(TD_ERR_STATE, "zero_step: parameter %zu lost its .grad during "
                                 "the step", g->param);
  td_status st = flatten(grad, &flat);
  if (st == TD_OK) st = td_tensor_narrow(flat, 0, g->off, g->len, out);
  td_tensor_unref(flat);
  td_tensor_unref(grad);
  return st;
}

/* Stage 1: the (weighted) squares of this member's segments of the averaged .grads. */
static td_status seg_squares(td_zero *z, double *sq) {
  td_status st = TD_OK;
  *sq = 0;
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) {
    td_tensor *g = NULL, *cpu = NULL;
    st = seg_grad(z, NULL, k, &g);
    if (st == TD_OK) st = td_tensor_to(g, td_device_cpu(), &cpu);
    if (st == TD_OK) *sq += (z->norm_w ? z->norm_w[z->segs[k].param] : 1.0) * sum_squares(cpu);
    td_tensor_unref(g);
    td_tensor_unref(cpu);
  }
  return st;
}

static td_status clip(td_zero *z, td_tensor *sgrad) {
  td_tensor *cpu = NULL;
  double sq = 0, total = 0;
  td_status st = TD_OK;
  if (sgrad) {
    st = td_tensor_to(sgrad, td_device_cpu(), &cpu);
    if (st == TD_OK) sq = z->norm_w ? weighted_squares(z, cpu) : sum_squares(cpu);
  } else {
    st = seg_squares(z, &sq);
  }
  if (st == TD_OK) st = sum_over(z, z->pg, &sq);
  if (st == TD_OK && z->zo.norm_group) st = sum_over(z, z->zo.norm_group, &sq);
  if (st == TD_OK) {
    total = sqrt(sq);
    z->stats.last_grad_norm = total;
    double coef = z->zo.max_grad_norm / (total + 1e-6);
    bool scale = coef < 1.0 || isnan(coef);
    if (scale && sgrad) st = td_tensor_mul_scalar_(sgrad, coef);
    for (size_t i = 0; scale && !sgrad && st == TD_OK && i < z->np; i++) { /* every .grad */
      td_tensor *g = td_tensor_grad(z->params[i]);
      if (g) st = td_tensor_mul_scalar_(g, coef);
      td_tensor_unref(g);
    }
  }
  td_tensor_unref(cpu);
  return st;
}

/* Steps the segments with their slices of the shard gradient. */
static td_status step_shard(td_zero *z, td_tensor *sgrad) {
  if (!z->nseg) return TD_OK;
  td_tensor **g = td__calloc(z->nseg, sizeof *g);
  if (!g) return td_set_error(TD_ERR_NOMEM, "zero_step: out of memory");
  td_status st = TD_OK;
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) st = seg_grad(z, sgrad, k, &g[k]);
  if (st == TD_OK) st = td_optim_step_grads(z->opt, g, z->nseg);
  for (size_t k = 0; k < z->nseg; k++) td_tensor_unref(g[k]);
  td__free(g);
  return st;
}

td_status td__zero_bucket_part(td_zero *z, size_t k, td_tensor **out) {
  const td__zbucket *b = &z->b[k];
  td_status st = td_tensor_zeros(&b->chunk, 1, z->dt, z->dev, out);
  for (size_t j = 0; st == TD_OK && j < z->nseg; j++) {
    if (z->segs[j].bucket != k) continue;
    td_tensor *s = NULL;
    st = td_tensor_narrow(*out, 0, z->segs[j].shard_off - b->shard_off, z->segs[j].len, &s);
    if (st == TD_OK) st = td_tensor_copy_(s, z->seg[j]);
    td_tensor_unref(s);
  }
  if (st != TD_OK) {
    td_tensor_unref(*out);
    *out = NULL;
  }
  return st;
}

/* Every member's updated part of bucket k into every member's parameters. */
static td_status gather_bucket(td_zero *z, size_t k) {
  const td__zbucket *b = &z->b[k];
  td_tensor *part = NULL, *buf = NULL;
  td_status st = td__zero_bucket_part(z, k, &part);
  if (st == TD_OK) st = bucket_buffer(z, b, &buf);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor(z->pg, buf, part);
  for (size_t q = b->first; st == TD_OK && q < b->first + b->count; q++) {
    td_tensor *s = NULL;
    st = slice_of(z, buf, z->order[q], &s);
    if (st == TD_OK) st = td_tensor_copy_(z->params[z->order[q]], s);
    td_tensor_unref(s);
  }
  td_tensor_unref(part);
  td_tensor_unref(buf);
  return st;
}

/* Loss scaling: this member's reduced gradients divided by the scale, then found_inf agreed
 * over the group and norm_group (every member skips alike). */
static td_status agree_found_inf(void *ctx, bool *found) {
  td_zero *z = ctx;
  TD_TRY(td__coll_any(z->pg, z->dev, found));
  return z->zo.norm_group ? td__coll_any(z->zo.norm_group, z->dev, found) : TD_OK;
}

static td_status unscale(td_zero *z, td_grad_scaler *s, td_tensor *sgrad, bool *skip) {
  td_status st = TD_OK;
  if (sgrad) {
    st = td_grad_scaler_unscale_grads_(s, &sgrad, 1);
  } else { /* stage 1: the averaged .grads */
    td_tensor **g = td__calloc(z->np ? z->np : 1, sizeof *g);
    if (!g) return td_set_error(TD_ERR_NOMEM, "zero_step: out of memory");
    for (size_t i = 0; i < z->np; i++) g[i] = td_tensor_grad(z->params[i]);
    st = td_grad_scaler_unscale_grads_(s, g, z->np);
    for (size_t i = 0; i < z->np; i++) td_tensor_unref(g[i]);
    td__free(g);
  }
  if (st == TD_OK) st = td_grad_scaler_found_inf_ex(s, agree_found_inf, z, skip);
  return st;
}

td_status td_zero_step(td_zero *z) { return td_zero_step_scaled(z, NULL); }

td_status td_zero_step_scaled(td_zero *z, td_grad_scaler *scaler) {
  TD_CHECK_ARG(z, "zero_step: NULL td_zero");
  if (z->no_sync)
    return td_set_error(TD_ERR_STATE, "zero_step: td_zero_no_sync is set: clear it before the "
                        "last pass of the accumulation window (its gradients are not reduced)");
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  if (z->armed) {
    st = finish_overlap(z);
  } else {
    int64_t S = z->stats.shard_numel ? z->stats.shard_numel : 1;
    if (z->zo.stage > 1) st = td_tensor_zeros(&S, 1, z->dt, z->dev, &z->sgrad);
    if (st == TD_OK) st = reduce_after(z, z->sgrad);
  }
  td_tensor *sgrad = z->sgrad;
  z->sgrad = NULL;
  if (z->nu) { /* stage 3: gathers in flight waited for, units freed */
    td_status es = td__zero3_end_pass(z);
    if (st == TD_OK) st = es;
  }
  bool skip = false; /* loss scaling: an inf or a NaN somewhere in the group's gradients */
  if (st == TD_OK && scaler) st = unscale(z, scaler, sgrad, &skip);
  if (st == TD_OK && z->zo.stage >= 2) td_zero_zero_grad(z); /* no full gradient is kept */
  if (st == TD_OK && !skip && z->zo.max_grad_norm > 0) st = clip(z, sgrad);
  if (st == TD_OK && !skip) st = step_shard(z, sgrad);
  td_tensor_unref(sgrad);
  for (size_t k = z->nub; st == TD_OK && !skip && k < z->nb; k++)
    st = gather_bucket(z, k); /* units: at use */
  if (st == TD_OK && !skip) z->stats.steps++;
  if (st == TD_OK && skip) z->stats.skipped_steps++, z->stats.last_grad_norm = NAN;
  td_autograd_set_enabled(prev);
  return st;
}

void td_zero_zero_grad(td_zero *z) {
  if (!z) return;
  for (size_t i = 0; i < z->np; i++) (void)td_tensor_set_grad(z->params[i], NULL);
  if (z->armed && !z->pass_sync) z->armed = false, z->pending = z->np; /* a no_sync pass ends */
  if (z->window && !z->armed) { /* the window's gradients are dropped with the .grads */
    for (size_t k = 0; k < z->nb; k++) {
      td__zbucket *b = &z->b[k];
      if (!b->buf || b->work) continue;
      release_bytes(b);
      td_tensor_unref(b->buf);
      b->buf = NULL;
    }
    z->window = false;
  }
}

td_status td_zero_set_lr(td_zero *z, double lr) {
  TD_CHECK_ARG(z, "zero_set_lr: NULL td_zero");
  TD_CHECK_ARG(lr >= 0, "zero_set_lr: lr must be >= 0, got %g", lr);
  return z->opt ? td_optim_set_lr(z->opt, lr) : TD_OK;
}

td_status td_zero_get_stats(const td_zero *z, td_zero_stats *out) {
  TD_CHECK_ARG(z && out, "zero_get_stats: NULL argument");
  *out = z->stats;
  return TD_OK;
}

td_status td__zero_agree(td_zero *z, td_status mine, const char *what) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", td_last_error());
  bool any = mine != TD_OK;
  td_status st = td__coll_any(z->pg, z->dev, &any);
  if (mine != TD_OK) return td_set_error(mine, "%s", msg);
  if (st != TD_OK) return st;
  return any ? td_set_error(TD_ERR_STATE, "%s: failed on another member", what) : TD_OK;
}

void td_zero_destroy(td_zero *z) {
  if (!z) return;
  for (size_t k = 0; z->b && k < z->nb; k++) {
    if (z->b[k].work) td_future_wait(z->b[k].work, TD_TIMEOUT_INFINITE);
    td_future_unref(z->b[k].work);
    td_tensor_unref(z->b[k].buf);
  }
  for (size_t i = 0; z->hook_handle && i < z->np; i++)
    if (z->hook_handle[i] >= 0) td_tensor_remove_hook(z->params[i], z->hook_handle[i]);
  td__zero3_destroy(z);
  td_tensor_unref(z->sgrad);
  td_optim_destroy(z->opt);
  for (size_t k = 0; z->seg && k < z->nseg; k++) td_tensor_unref(z->seg[k]);
  for (size_t i = 0; z->params && i < z->np; i++) td_tensor_unref(z->params[i]);
  td__free(z->seg);
  td__free(z->segs);
  td__free(z->norm_w);
  td__free(z->b);
  td__free(z->order);
  td__free(z->bucket_of);
  td__free(z->offset);
  td__free(z->hctx);
  td__free(z->hook_handle);
  td__free(z->seen);
  td__free(z->late);
  td__free(z->params);
  td__free(z);
}
