/* mappings.c - Megatron's differentiable collectives: f (copy forward, all-reduce backward), g
 * (all-reduce forward, copy backward), gather / scatter along the last dimension and the
 * sequence-parallel all-gather / reduce-scatter pair.
 *
 * Each operation computes its forward value without history, then, when the input requires
 * grad, makes an external autograd node whose backward runs the conjugate collective on the
 * incoming gradient and attaches the value to it. The backward runs on the thread of the backward
 * pass; every member's pass reaches the node in the same order because the members run the same
 * graph (the engine's order is a function of the graph), so the collectives pair up. A gradient
 * that does not reach the node (NULL) is a zero gradient: the collective still runs, since the
 * other members may not know.
 */
#include <string.h>

#include "parallel_impl.h"

typedef enum map_kind {
  MAP_COPY,         /* f: identity / all-reduce */
  MAP_REDUCE,       /* g: all-reduce / identity */
  MAP_GATHER,       /* all-gather / split along dim */
  MAP_SCATTER,      /* split / all-gather along dim */
  MAP_SEQ_GATHER,   /* all-gather / reduce-scatter along dim */
  MAP_SEQ_SCATTER,  /* reduce-scatter / all-gather along dim */
} map_kind;

static const char *const map_names[] = {
    "TPCopyToRegionBackward",    "TPReduceFromRegionBackward",  "TPGatherFromRegionBackward",
    "TPScatterToRegionBackward", "TPGatherFromSequenceBackward", "TPReduceScatterToSequenceBackward",
};

typedef struct map_ctx {
  td_process_group *pg;
  map_kind kind;
  int dim;
  int out_ndim;
  int64_t out_shape[TD_MAX_DIMS]; /* to stand in zeros for a gradient that did not arrive */
  td_dtype dt;
  td_device dev;
} map_ctx;

/* ---- collectives without autograd ---- */

td_status td__tp_check_divisible(const char *who, const char *what, int64_t n, int p) {
  if (p > 0 && n % p == 0) return TD_OK;
  return td_set_error(TD_ERR_INVALID, "%s: %s %lld is not divisible by the tensor-parallel size %d",
                      who, what, (long long)n, p);
}

/* own_copy returns a contiguous copy of x with its own storage and no history. */
static td_status own_copy(const td_tensor *x, td_tensor **out) {
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_clone(x, out);
  td_autograd_set_enabled(prev);
  return st;
}

td_status td__tp_all_reduce(td_process_group *pg, const td_tensor *x, td_reduce_op op,
                            td_tensor **out) {
  td_tensor *c = NULL;
  TD_TRY(own_copy(x, &c));
  td_status st = td_process_group_all_reduce(pg, c, op);
  if (st != TD_OK) {
    td_tensor_unref(c);
    return st;
  }
  *out = c;
  return TD_OK;
}

static int norm_dim(const td_tensor *x, int dim) { return dim < 0 ? dim + td_tensor_ndim(x) : dim; }

td_status td__tp_gather(td_process_group *pg, const td_tensor *x, int dim, td_tensor **out) {
  int p = td_process_group_size(pg), nd = td_tensor_ndim(x);
  dim = norm_dim(x, dim);
  TD_CHECK_ARG(dim >= 0 && dim < nd, "tensor-parallel gather: dim out of range for %d dims", nd);
  td_tensor *xc = NULL, *parts[TD__MAX_GROUP_PARTS] = {NULL}, **pp = parts;
  if (p > TD__MAX_GROUP_PARTS) {
    pp = td__calloc((size_t)p, sizeof *pp);
    if (!pp) return td_set_error(TD_ERR_NOMEM, "tensor-parallel gather: out of memory");
  }
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_contiguous(x, &xc);
  for (int i = 0; i < p && st == TD_OK; i++)
    st = td_tensor_empty(td_tensor_shape(x), nd, td_tensor_dtype(x), td_tensor_device(x), &pp[i]);
  if (st == TD_OK) st = td_process_group_all_gather(pg, pp, xc);
  if (st == TD_OK) st = td_tensor_cat(pp, p, dim, out);
  td_autograd_set_enabled(prev);
  td_tensor_unref(xc);
  for (int i = 0; i < p; i++) td_tensor_unref(pp[i]);
  if (pp != parts) td__free(pp);
  return st;
}

td_status td__tp_split(td_process_group *pg, const td_tensor *x, int dim, td_tensor **out) {
  int p = td_process_group_size(pg), r = td_process_group_rank(pg);
  dim = norm_dim(x, dim);
  TD_CHECK_ARG(dim >= 0 && dim < td_tensor_ndim(x), "tensor-parallel split: dim out of range");
  int64_t n = td_tensor_size(x, dim);
  TD_TRY(td__tp_check_divisible("tensor-parallel split", "the split dimension's size", n, p));
  td_tensor *v = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_narrow(x, dim, r * (n / p), n / p, &v);
  if (st == TD_OK) st = td_tensor_clone(v, out);
  td_autograd_set_enabled(prev);
  td_tensor_unref(v);
  return st;
}

td_status td__tp_reduce_scatter(td_process_group *pg, const td_tensor *x, int dim,
                                td_tensor **out) {
  int p = td_process_group_size(pg), nd = td_tensor_ndim(x);
  dim = norm_dim(x, dim);
  TD_CHECK_ARG(dim >= 0 && dim < nd, "tensor-parallel reduce-scatter: dim out of range");
  int64_t n = td_tensor_size(x, dim);
  TD_TRY(td__tp_check_divisible("tensor-parallel reduce-scatter", "the split dimension's size",
                                n, p));
  int64_t shape[TD_MAX_DIMS];
  memcpy(shape, td_tensor_shape(x), sizeof(int64_t) * (size_t)nd);
  shape[dim] = n / p;
  td_tensor *in = NULL, *res = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  if (dim == 0) {
    st = td_tensor_contiguous(x, &in); /* member i's slice is already the i-th block of memory */
  } else {
    /* lay the members' slices one after the other: [p, ..., n/p, ...] */
    td_tensor *v = NULL, *split = NULL;
    int64_t sv[TD_MAX_DIMS + 1];
    for (int i = 0, k = 0; i < nd; i++) {
      if (i == dim) {
        sv[k++] = p;
        sv[k++] = n / p;
      } else {
        sv[k++] = shape[i];
      }
    }
    /* x viewed as [..., p, n/p, ...], the p axis moved to the front, made contiguous */
    st = td_tensor_reshape(x, sv, nd + 1, &split);
    int perm[TD_MAX_DIMS + 1];
    perm[0] = dim;
    for (int i = 0, k = 1; i < nd + 1; i++)
      if (i != dim) perm[k++] = i;
    if (st == TD_OK) st = td_tensor_permute(split, perm, nd + 1, &v);
    if (st == TD_OK) st = td_tensor_clone(v, &in);
    td_tensor_unref(split);
    td_tensor_unref(v);
  }
  if (st == TD_OK) st = td_tensor_empty(shape, nd, td_tensor_dtype(x), td_tensor_device(x), &res);
  if (st == TD_OK) st = td_process_group_reduce_scatter_tensor(pg, res, in, TD_REDUCE_SUM);
  td_autograd_set_enabled(prev);
  td_tensor_unref(in);
  if (st != TD_OK) {
    td_tensor_unref(res);
    return st;
  }
  *out = res;
  return TD_OK;
}

/* ---- the autograd nodes ---- */

/* run_map computes kind's forward (backward = false) or backward of x. */
static td_status run_map(td_process_group *pg, map_kind kind, int dim, bool backward,
                         const td_tensor *x, td_tensor **out) {
  switch (kind) {
    case MAP_COPY:
      if (!backward) return own_copy(x, out);
      return td__tp_all_reduce(pg, x, TD_REDUCE_SUM, out);
    case MAP_REDUCE:
      if (backward) return own_copy(x, out);
      return td__tp_all_reduce(pg, x, TD_REDUCE_SUM, out);
    case MAP_GATHER:
      return backward ? td__tp_split(pg, x, dim, out) : td__tp_gather(pg, x, dim, out);
    case MAP_SCATTER:
      return backward ? td__tp_gather(pg, x, dim, out) : td__tp_split(pg, x, dim, out);
    case MAP_SEQ_GATHER:
      return backward ? td__tp_reduce_scatter(pg, x, dim, out) : td__tp_gather(pg, x, dim, out);
    case MAP_SEQ_SCATTER:
      return backward ? td__tp_gather(pg, x, dim, out) : td__tp_reduce_scatter(pg, x, dim, out);
  }
  return td_set_error(TD_ERR_INTERNAL, "tensor-parallel mapping: unknown kind %d", (int)kind);
}

static td_status map_backward(void *vctx, td_tensor *const *grad_outputs, int n_outputs,
                              td_tensor **grad_inputs, int n_inputs) {
  map_ctx *c = vctx;
  if (n_outputs != 1 || n_inputs != 1)
    return td_set_error(TD_ERR_INTERNAL, "%s: %d outputs, %d inputs", map_names[c->kind],
                        n_outputs, n_inputs);
  td_tensor *g = grad_outputs[0] ? td_tensor_ref(grad_outputs[0]) : NULL;
  if (!g) TD_TRY(td_tensor_zeros(c->out_shape, c->out_ndim, c->dt, c->dev, &g));
  td_status st = run_map(c->pg, c->kind, c->dim, true, g, &grad_inputs[0]);
  td_tensor_unref(g);
  return st;
}

static void map_ctx_free(void *c) { td__free(c); }

static td_status map_apply(const char *who, td_process_group *pg, map_kind kind, const td_tensor *x,
                           int dim, td_tensor **out) {
  TD_CHECK_ARG(pg && x && out, "%s: NULL argument", who);
  int nd = td_tensor_ndim(x);
  if (kind != MAP_COPY && kind != MAP_REDUCE) {
    TD_CHECK_ARG(nd > 0, "%s: a scalar has no dimension to gather or split", who);
    TD_CHECK_ARG(dim >= -nd && dim < nd, "%s: dim %d out of range for %d dims", who, dim, nd);
    dim = norm_dim(x, dim);
  }
  td_tensor *y = NULL;
  TD_TRY(run_map(pg, kind, dim, false, x, &y));
  if (!td_tensor_requires_grad(x) || !td_autograd_is_enabled()) {
    *out = y;
    return TD_OK;
  }
  map_ctx *c = td__calloc(1, sizeof *c);
  if (!c) {
    td_tensor_unref(y);
    return td_set_error(TD_ERR_NOMEM, "%s: out of memory", who);
  }
  c->pg = pg;
  c->kind = kind;
  c->dim = dim;
  c->out_ndim = td_tensor_ndim(y);
  memcpy(c->out_shape, td_tensor_shape(y), sizeof(int64_t) * (size_t)c->out_ndim);
  c->dt = td_tensor_dtype(y);
  c->dev = td_tensor_device(y);
  td_node *node = NULL;
  td_tensor *in = (td_tensor *)x;
  td_status st = td_node_create_external(map_names[kind], 1, &in, 1, map_backward, c, map_ctx_free,
                                         &node);
  if (st == TD_OK) st = td_autograd_attach(y, node, 0, out);
  td_node_unref(node);
  td_tensor_unref(y);
  return st;
}

td_status td_tp_copy_to_region(td_process_group *pg, const td_tensor *x, td_tensor **out) {
  return map_apply("td_tp_copy_to_region", pg, MAP_COPY, x, 0, out);
}

td_status td_tp_reduce_from_region(td_process_group *pg, const td_tensor *x, td_tensor **out) {
  return map_apply("td_tp_reduce_from_region", pg, MAP_REDUCE, x, 0, out);
}

td_status td_tp_gather_from_region(td_process_group *pg, const td_tensor *x, td_tensor **out) {
  return map_apply("td_tp_gather_from_region", pg, MAP_GATHER, x, -1, out);
}

td_status td_tp_scatter_to_region(td_process_group *pg, const td_tensor *x, td_tensor **out) {
  return map_apply("td_tp_scatter_to_region", pg, MAP_SCATTER, x, -1, out);
}

td_status td_tp_gather_from_sequence(td_process_group *pg, const td_tensor *x, int dim,
                                     td_tensor **out) {
  return map_apply("td_tp_gather_from_sequence", pg, MAP_SEQ_GATHER, x, dim, out);
}

td_status td_tp_reduce_scatter_to_sequence(td_process_group *pg, const td_tensor *x, int dim,
                                           td_tensor **out) {
  return map_apply("td_tp_reduce_scatter_to_sequence", pg, MAP_SEQ_SCATTER, x, dim, out);
}
