/* zero.c - sharded data parallelism, ZeRO stages 1 and 2 (tdist/collectives.h, td_zero_*).
 *
 * Layout: the parameters, in the order of the groups, are laid end to end in a flat index space
 * [0, P); member r owns [r * S, (r + 1) * S) with S = ceil(P / size) (the tail of the last shards
 * is padding, always zero). The part of a parameter that falls in this member's shard is a
 * "segment"; each segment has its own 1-D tensor (a copy of those elements, the master values of
 * this member) and the local td_optim steps the segments, each in the group of its parameter, so
 * per-group learning rates and weight decay hold element by element.
 *
 * A step (td_zero_step), with autograd off:
 *   gflat (size * S, zeros) <- every parameter's .grad at its flat position
 *   stage 1: all_reduce(gflat, AVG); .grads <- their slices of gflat;  shard grad = gflat[rS, rS+S)
 *   stage 2: reduce_scatter(shard grad <- gflat, AVG); gflat freed; .grads cleared
 *   clipping: sum of squares of the shard grad, all_reduce(SUM) of that one number, scale
 *   td_optim_step_grads(segments, their slices of the shard grad)
 *   pshard (S, zeros) <- segments; all_gather(pflat <- pshard); parameters <- slices of pflat
 * Every member runs the same collectives in the same order, so a member that skips a step is
 * caught by the group's mismatch detection like any other collective.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"
#include "tdist/autograd.h"

struct td_zero {
  td_process_group *pg;
  td_zero_options zo;
  size_t np;
  td_tensor **params; /* owned references, in flat order */
  int64_t *pos;       /* per parameter: its first flat index */
  int64_t lo;         /* this member's shard: [lo, lo + S) */
  size_t nseg;
  size_t *seg_param;  /* per segment: its parameter */
  int64_t *seg_pos;   /* per segment: its first flat index */
  int64_t *seg_len;
  td_tensor **seg;    /* per segment: the 1-D master values (owned) */
  td_optim *opt;      /* over seg (NULL when this member owns no element) */
  td_dtype dt;
  td_device dev;
  td_zero_stats stats;
};

void td_zero_options_init(td_zero_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->stage = 2;
}

/* view[0, len) of t's flat elements starting at start, shaped like `like` when like != NULL */
static td_status flat_slice(td_tensor *t, int64_t start, int64_t len, const td_tensor *like,
                            td_tensor **out) {
  td_tensor *n = NULL;
  TD_TRY(td_tensor_narrow(t, 0, start, len, &n));
  if (!like) {
    *out = n;
    return TD_OK;
  }
  td_status st = td_tensor_reshape(n, td_tensor_shape(like), td_tensor_ndim(like), out);
  td_tensor_unref(n);
  return st;
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
  if (z->pg->backend == TD_PG_BACKEND_NCCL && z->np && z->dev.type != TD_DEVICE_CUDA)
    return td_set_error(TD_ERR_DEVICE, "zero_create: an NCCL group needs parameters on CUDA");
  return TD_OK;
}

/* Cuts this member's shard into segments and makes their master copies. */
static td_status make_segments(td_zero *z, int64_t hi) {
  z->seg_param = td__calloc(z->np ? z->np : 1, sizeof *z->seg_param);
  z->seg_pos = td__calloc(z->np ? z->np : 1, sizeof *z->seg_pos);
  z->seg_len = td__calloc(z->np ? z->np : 1, sizeof *z->seg_len);
  z->seg = td__calloc(z->np ? z->np : 1, sizeof *z->seg);
  if (!z->seg_param || !z->seg_pos || !z->seg_len || !z->seg)
    return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    int64_t a = z->pos[i], b = a + td_tensor_numel(z->params[i]);
    int64_t s = a > z->lo ? a : z->lo, e = b < hi ? b : hi;
    if (s >= e) continue;
    size_t k = z->nseg++;
    z->seg_param[k] = i;
    z->seg_pos[k] = s;
    z->seg_len[k] = e - s;
    td_tensor *flat = NULL, *piece = NULL;
    st = flatten(z->params[i], &flat);
    if (st == TD_OK) st = td_tensor_narrow(flat, 0, s - a, e - s, &piece);
    if (st == TD_OK) st = td_tensor_clone(piece, &z->seg[k]);
    td_tensor_unref(piece);
    td_tensor_unref(flat);
  }
  return st;
}

/* The local optimizer over the segments, each in its parameter's group. */
static td_status make_optim(td_zero *z, const td_optim_options *opts,
                            const td_optim_group *groups, size_t n_groups) {
  if (!z->nseg) return TD_OK;
  td_optim_group *sg = td__calloc(n_groups, sizeof *sg);
  td_tensor **lists = td__calloc(z->nseg, sizeof *lists);
  if (!sg || !lists) {
    td__free(sg);
    td__free(lists);
    return td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  }
  size_t k = 0, first = 0; /* parameters of group g: [first, first + groups[g].n) */
  for (size_t g = 0; g < n_groups; g++) {
    size_t start = k;
    while (k < z->nseg && z->seg_param[k] < first + groups[g].n) {
      lists[k] = z->seg[k];
      k++;
    }
    td_optim_group_init(&sg[g], lists + start, k - start);
    sg[g].lr = groups[g].lr;
    sg[g].weight_decay = groups[g].weight_decay;
    first += groups[g].n;
  }
  td_status st = td_optim_create_groups(opts, sg, n_groups, &z->opt);
  td__free(sg);
  td__free(lists);
  return st;
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
  if (zopts) z->zo = *zopts;
  else td_zero_options_init(&z->zo);
  td_status st = TD_OK;
  if (z->zo.stage != 1 && z->zo.stage != 2)
    st = td_set_error(TD_ERR_INVALID, "zero_create: stage %d; 1 (optimizer state) or 2 (also "
                      "gradients) (stage 3 is not implemented)", z->zo.stage);
  else if (!(z->zo.max_grad_norm >= 0) || isinf(z->zo.max_grad_norm))
    st = td_set_error(TD_ERR_INVALID, "zero_create: max_grad_norm must be finite and >= 0");
  for (size_t g = 0; st == TD_OK && g < n_groups; g++) {
    if (groups[g].n && !groups[g].params)
      st = td_set_error(TD_ERR_INVALID, "zero_create: group %zu has no parameter array", g);
    z->np += groups[g].n;
  }
  if (st == TD_OK) {
    z->params = td__calloc(z->np ? z->np : 1, sizeof *z->params);
    z->pos = td__calloc(z->np ? z->np : 1, sizeof *z->pos);
    if (!z->params || !z->pos) st = td_set_error(TD_ERR_NOMEM, "zero_create: out of memory");
  }
  int64_t P = 0;
  for (size_t g = 0, i = 0; st == TD_OK && g < n_groups; g++) {
    for (size_t j = 0; j < groups[g].n; j++, i++) {
      if (!groups[g].params[j]) {
        st = td_set_error(TD_ERR_INVALID, "zero_create: group %zu, parameter %zu is NULL", g, j);
        break;
      }
      z->params[i] = td_tensor_ref(groups[g].params[j]);
      z->pos[i] = P;
      P += td_tensor_numel(z->params[i]);
    }
  }
  if (st == TD_OK && z->np) {
    z->dt = td_tensor_dtype(z->params[0]);
    z->dev = td_tensor_device(z->params[0]);
  } else {
    z->dt = TD_DTYPE_F32;
    z->dev = pg->backend == TD_PG_BACKEND_NCCL ? td_device_cuda(0) : td_device_cpu();
  }
  if (st == TD_OK) st = check_params(z);
  bool prev = td_autograd_set_enabled(false);
  if (st == TD_OK) st = td__coll_check_same_params(pg, z->params, z->np, z->dev, "zero_create");
  for (size_t i = 0; st == TD_OK && i < z->np; i++)
    st = td__coll_broadcast_tensor(pg, z->params[i]);
  int n = td_process_group_size(pg), r = td_process_group_rank(pg);
  int64_t S = P ? (P + n - 1) / n : 1;
  z->lo = (int64_t)r * S;
  int64_t hi = z->lo + S < P ? z->lo + S : P;
  if (st == TD_OK) st = make_segments(z, hi);
  td_autograd_set_enabled(prev);
  if (st == TD_OK) st = make_optim(z, opts, groups, n_groups);
  if (st != TD_OK) {
    td_zero_destroy(z);
    return st;
  }
  z->stats.stage = z->zo.stage;
  z->stats.numel = P;
  z->stats.shard_numel = S;
  z->stats.owned_numel = hi > z->lo ? hi - z->lo : 0;
  z->stats.optim_params = z->nseg;
  z->stats.last_grad_norm = NAN;
  *out = z;
  return TD_OK;
}

/* gflat <- every parameter's .grad at its position (gflat starts as zeros). */
static td_status gather_grads(td_zero *z, td_tensor *gflat) {
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    td_tensor *g = td_tensor_grad(z->params[i]), *s = NULL;
    if (!g) continue;
    st = flat_slice(gflat, z->pos[i], td_tensor_numel(z->params[i]), z->params[i], &s);
    if (st == TD_OK) st = td_tensor_copy_(s, g);
    td_tensor_unref(s);
    td_tensor_unref(g);
  }
  return st;
}

/* Stage 1: the averaged gradients go back into the .grads (a parameter without one gets one). */
static td_status scatter_grads(td_zero *z, td_tensor *gflat) {
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    td_tensor *p = z->params[i], *s = NULL;
    st = flat_slice(gflat, z->pos[i], td_tensor_numel(p), p, &s);
    if (st == TD_OK) st = td__coll_grad_assign(p, s);
    td_tensor_unref(s);
  }
  return st;
}

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
static td_status clip(td_zero *z, td_tensor *sgrad) {
  td_tensor *cpu = NULL, *one = NULL, *one_dev = NULL, *back = NULL;
  td_status st = td_tensor_to(sgrad, td_device_cpu(), &cpu);
  double local = st == TD_OK ? sum_squares(cpu) : 0, total = 0;
  int64_t n1 = 1;
  if (st == TD_OK) st = td_tensor_from_buffer(&local, &n1, 1, TD_DTYPE_F64, &one);
  if (st == TD_OK) st = td_tensor_to(one, z->dev, &one_dev);
  if (st == TD_OK) st = td_process_group_all_reduce(z->pg, one_dev, TD_REDUCE_SUM);
  if (st == TD_OK) st = td_tensor_to(one_dev, td_device_cpu(), &back);
  if (st == TD_OK) {
    total = sqrt(*(const double *)td_tensor_data(back));
    z->stats.last_grad_norm = total;
    double coef = z->zo.max_grad_norm / (total + 1e-6);
    if (coef < 1.0 || isnan(coef)) st = td_tensor_mul_scalar_(sgrad, coef);
  }
  td_tensor_unref(cpu);
  td_tensor_unref(one);
  td_tensor_unref(one_dev);
  td_tensor_unref(back);
  return st;
}

/* Steps the segments with their slices of the shard gradient. */
static td_status step_shard(td_zero *z, td_tensor *sgrad) {
  if (!z->nseg) return TD_OK;
  td_tensor **g = td__calloc(z->nseg, sizeof *g);
  if (!g) return td_set_error(TD_ERR_NOMEM, "zero_step: out of memory");
  td_status st = TD_OK;
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++)
    st = td_tensor_narrow(sgrad, 0, z->seg_pos[k] - z->lo, z->seg_len[k], &g[k]);
  if (st == TD_OK) st = td_optim_step_grads(z->opt, g, z->nseg);
  for (size_t k = 0; k < z->nseg; k++) td_tensor_unref(g[k]);
  td__free(g);
  return st;
}

/* Every member's updated shard into every member's parameters. */
static td_status gather_params(td_zero *z) {
  int n = td_process_group_size(z->pg);
  int64_t S = z->stats.shard_numel, all = S * n;
  td_tensor *pshard = NULL, *pflat = NULL;
  td_status st = td_tensor_zeros(&S, 1, z->dt, z->dev, &pshard);
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) {
    td_tensor *s = NULL;
    st = flat_slice(pshard, z->seg_pos[k] - z->lo, z->seg_len[k], NULL, &s);
    if (st == TD_OK) st = td_tensor_copy_(s, z->seg[k]);
    td_tensor_unref(s);
  }
  if (st == TD_OK) st = td_tensor_empty(&all, 1, z->dt, z->dev, &pflat);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor(z->pg, pflat, pshard);
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    td_tensor *s = NULL;
    st = flat_slice(pflat, z->pos[i], td_tensor_numel(z->params[i]), z->params[i], &s);
    if (st == TD_OK) st = td_tensor_copy_(z->params[i], s);
    td_tensor_unref(s);
  }
  td_tensor_unref(pshard);
  td_tensor_unref(pflat);
  return st;
}

td_status td_zero_step(td_zero *z) {
  TD_CHECK_ARG(z, "zero_step: NULL td_zero");
  int n = td_process_group_size(z->pg);
  int64_t S = z->stats.shard_numel, all = S * n;
  bool prev = td_autograd_set_enabled(false);
  td_tensor *gflat = NULL, *sgrad = NULL;
  td_status st = td_tensor_zeros(&all, 1, z->dt, z->dev, &gflat);
  if (st == TD_OK) st = gather_grads(z, gflat);
  if (z->zo.stage == 1) {
    if (st == TD_OK) st = td_process_group_all_reduce(z->pg, gflat, TD_REDUCE_AVG);
    if (st == TD_OK) st = scatter_grads(z, gflat);
    if (st == TD_OK) st = td_tensor_narrow(gflat, 0, z->lo, S, &sgrad);
  } else {
    if (st == TD_OK) st = td_tensor_empty(&S, 1, z->dt, z->dev, &sgrad);
    if (st == TD_OK) st = td_process_group_reduce_scatter_tensor(z->pg, sgrad, gflat, TD_REDUCE_AVG);
    td_tensor_unref(gflat); /* the full gradient is not kept: each member holds its shard's */
    gflat = NULL;
    if (st == TD_OK) td_zero_zero_grad(z);
  }
  if (st == TD_OK && z->zo.max_grad_norm > 0) st = clip(z, sgrad);
  if (st == TD_OK) st = step_shard(z, sgrad);
  td_tensor_unref(sgrad);
  td_tensor_unref(gflat);
  if (st == TD_OK) st = gather_params(z);
  if (st == TD_OK) z->stats.steps++;
  td_autograd_set_enabled(prev);
  return st;
}

void td_zero_zero_grad(td_zero *z) {
  for (size_t i = 0; z && i < z->np; i++) (void)td_tensor_set_grad(z->params[i], NULL);
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

void td_zero_destroy(td_zero *z) {
  if (!z) return;
  td_optim_destroy(z->opt);
  for (size_t k = 0; z->seg && k < z->nseg; k++) td_tensor_unref(z->seg[k]);
  for (size_t i = 0; z->params && i < z->np; i++) td_tensor_unref(z->params[i]);
  td__free(z->seg);
  td__free(z->seg_param);
  td__free(z->seg_pos);
  td__free(z->seg_len);
  td__free(z->params);
  td__free(z->pos);
  td__free(z);
}
