/* views.c - shape-changing views (reshape, narrow, transpose, permute, (un)squeeze, expand,
 * unbind), contiguous/clone/detach, each with its backward.
 *
 * A view shares its base's storage; its backward maps the gradient back to the base's geometry:
 * reshape-like views reshape it, permutations apply the inverse permutation, narrow scatters into
 * zeros, expand sums over the broadcast dims, (un)squeeze applies the opposite view, and unbind
 * (one node with an output per slice) gathers the slices' gradients into one tensor.
 */
#include <string.h>

#include "tensor_impl.h"

/* ---- backward nodes ---- */

typedef struct {
  td_node base;
  int ndim;
  int64_t shape[TD_MAX_DIMS]; /* input shape */
} reshape_node;

static td_status reshape_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  reshape_node *n = (reshape_node *)self;
  return td_tensor_reshape(gout[0], n->shape, n->ndim, &gin[0]);
}
static const td__node_ops reshape_ops = {"ViewBackward", reshape_backward, NULL};

static td_status expand_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  reshape_node *n = (reshape_node *)self;
  return td__sum_to(gout[0], n->shape, n->ndim, &gin[0]);
}
static const td__node_ops expand_ops = {"ExpandBackward", expand_backward, NULL};

typedef struct {
  td_node base;
  int ndim;
  int inv[TD_MAX_DIMS];
} permute_node;

static td_status permute_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  permute_node *n = (permute_node *)self;
  return td_tensor_permute(gout[0], n->inv, n->ndim, &gin[0]);
}
static const td__node_ops permute_ops = {"PermuteBackward", permute_backward, NULL};

typedef struct {
  td_node base;
  int ndim, dim;
  int64_t start;
  int64_t shape[TD_MAX_DIMS];
} narrow_node;

static td_status narrow_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  narrow_node *n = (narrow_node *)self;
  td_tensor *z = NULL, *v = NULL;
  TD_TRY(td_tensor_zeros(n->shape, n->ndim, gout[0]->dtype, td_tensor_device(gout[0]), &z));
  td_status st = td_tensor_narrow(z, n->dim, n->start, gout[0]->shape[n->dim], &v);
  if (st == TD_OK) st = td__backend_of(z)->copy(v, gout[0]);
  td_tensor_unref(v);
  if (st != TD_OK) {
    td_tensor_unref(z);
    return st;
  }
  gin[0] = z;
  return TD_OK;
}
static const td__node_ops narrow_ops = {"NarrowBackward", narrow_backward, NULL};

/* squeeze / unsqueeze of one dim: the backward is the opposite view of the gradient. */
typedef struct {
  td_node base;
  int dim;
} dim_node;

static td_status squeeze_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  return td_tensor_unsqueeze(gout[0], ((dim_node *)self)->dim, &gin[0]);
}
static const td__node_ops squeeze_ops = {"SqueezeBackward", squeeze_backward, NULL};

static td_status unsqueeze_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  return td_tensor_squeeze(gout[0], ((dim_node *)self)->dim, &gin[0]);
}
static const td__node_ops unsqueeze_ops = {"UnsqueezeBackward", unsqueeze_backward, NULL};

/* unbind: one node with an output per slice; backward writes every slice's gradient into one
 * tensor of the input's shape (missing gradients arrive as zeros). */
typedef struct {
  td_node base;
  int ndim, dim;
  int64_t shape[TD_MAX_DIMS];
} unbind_node;

/* slice_view returns the plain view of t (contiguous, shape of the unbind input) at index k of
 * dim, with dim removed. */
static td_status slice_view(const td_tensor *t, int dim, int64_t k, td_tensor **out) {
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (i == dim) continue;
    shape[n] = t->shape[i];
    strides[n++] = t->strides[i];
  }
  return td__tensor_view(t, shape, strides, n, t->offset + k * t->strides[dim], out);
}

static td_status unbind_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  unbind_node *n = (unbind_node *)self;
  td_tensor *g = NULL;
  TD_TRY(td__tensor_new(n->shape, n->ndim, gout[0]->dtype, td_tensor_device(gout[0]), &g));
  td_status st = TD_OK;
  for (int64_t k = 0; k < n->shape[n->dim] && st == TD_OK; k++) {
    td_tensor *v = NULL;
    st = slice_view(g, n->dim, k, &v);
    if (st == TD_OK) st = td__backend_of(g)->copy(v, gout[k]);
    td_tensor_unref(v);
  }
  if (st != TD_OK) {
    td_tensor_unref(g);
    return st;
  }
  gin[0] = g;
  return TD_OK;
}
static const td__node_ops unbind_ops = {"UnbindBackward", unbind_backward, NULL};

static td_status identity_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  gin[0] = td_tensor_ref(gout[0]);
  return TD_OK;
}
static const td__node_ops clone_ops = {"CloneBackward", identity_backward, NULL};

/* Makes the view (geometry given) and records its backward node. */
static td_status make_view(const td_tensor *t, const int64_t *shape, const int64_t *strides,
                           int ndim, int64_t offset, const td__node_ops *ops, size_t node_size,
                           td_tensor **out, td_node **node) {
  td_tensor *v;
  TD_TRY(td__tensor_view(t, shape, strides, ndim, offset, &v));
  *node = NULL;
  if (td__needs_grad(t)) {
    td_status st = TD_OK;
    const td_tensor *ins[1] = {t};
    *node = td__record(v, node_size, ops, ins, 1, &st);
    if (st != TD_OK) {
      td_tensor_unref(v);
      return st;
    }
  }
  *out = v;
  return TD_OK;
}

static td_status view_reshape(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  int64_t strides[TD_MAX_DIMS];
  td__contiguous_strides(shape, ndim, strides);
  td_node *node;
  TD_TRY(make_view(t, shape, strides, ndim, t->offset, &reshape_ops, sizeof(reshape_node), out,
                   &node));
  if (node) {
    reshape_node *n = (reshape_node *)node;
    n->ndim = t->ndim;
    memcpy(n->shape, t->shape, sizeof n->shape);
  }
  return TD_OK;
}

td_status td_tensor_reshape(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  TD_CHECK_ARG(t && out && (shape || ndim == 0), "tensor_reshape: NULL argument");
  TD_CHECK_ARG(ndim >= 0 && ndim <= TD_MAX_DIMS, "tensor_reshape: ndim %d out of range", ndim);
  int64_t s[TD_MAX_DIMS];
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < ndim; i++) {
    s[i] = shape[i];
    if (s[i] == -1) {
      if (infer >= 0) return td_set_error(TD_ERR_INVALID, "tensor_reshape: more than one -1");
      infer = i;
    } else if (s[i] < 0) {
      return td_set_error(TD_ERR_INVALID, "tensor_reshape: negative size %lld", (long long)s[i]);
    } else {
      known *= s[i];
    }
  }
  int64_t numel = td_tensor_numel(t);
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) goto bad;
    s[infer] = numel / known;
  } else if (known != numel) {
    goto bad;
  }
  if (td_tensor_is_contiguous(t)) return view_reshape(t, s, ndim, out);
  td_tensor *c;
  TD_TRY(td_tensor_contiguous(t, &c));
  td_status st = view_reshape(c, s, ndim, out);
  td_tensor_unref(c);
  return st;
bad:;
  char a[128], b[128];
  return td_set_error(TD_ERR_SHAPE, "tensor_reshape: cannot view %s (%lld elements) as %s",
                      td_tensor_shape_str(t, a, sizeof a), (long long)numel,
                      td__shape_str(shape, ndim, b, sizeof b));
}

td_status td_tensor_flatten(const td_tensor *t, int start, int end, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_flatten: NULL argument");
  if (t->ndim == 0) {
    int64_t one = 1;
    return td_tensor_reshape(t, &one, 1, out);
  }
  int s = td__norm_dim(start, t->ndim), e = td__norm_dim(end, t->ndim);
  if (s < 0 || e < 0 || s > e)
    return td_set_error(TD_ERR_INVALID, "tensor_flatten: bad dims %d..%d for %d-d tensor", start,
                        end, t->ndim);
  int64_t shape[TD_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < s; i++) shape[n++] = t->shape[i];
  int64_t m = 1;
  for (int i = s; i <= e; i++) m *= t->shape[i];
  shape[n++] = m;
  for (int i = e + 1; i < t->ndim; i++) shape[n++] = t->shape[i];
  return td_tensor_reshape(t, shape, n, out);
}

td_status td_tensor_narrow(const td_tensor *t, int dim, int64_t start, int64_t len,
                           td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_narrow: NULL argument");
  int d = td__norm_dim(dim, t->ndim);
  if (d < 0 || t->ndim == 0)
    return td_set_error(TD_ERR_INVALID, "tensor_narrow: dim %d out of range for %d-d tensor", dim,
                        t->ndim);
  if (start < 0 || len < 0 || start + len > t->shape[d])
    return td_set_error(TD_ERR_INVALID,
                        "tensor_narrow: range [%lld, %lld) outside dim %d of size %lld",
                        (long long)start, (long long)(start + len), d, (long long)t->shape[d]);
  int64_t shape[TD_MAX_DIMS];
  memcpy(shape, t->shape, sizeof shape);
  shape[d] = len;
  td_node *node;
  TD_TRY(make_view(t, shape, t->strides, t->ndim, t->offset + start * t->strides[d], &narrow_ops,
                   sizeof(narrow_node), out, &node));
  if (node) {
    narrow_node *n = (narrow_node *)node;
    n->ndim = t->ndim;
    n->dim = d;
    n->start = start;
    memcpy(n->shape, t->shape, sizeof n->shape);
  }
  return TD_OK;
}

td_status td_tensor_permute(const td_tensor *t, const int *perm, int ndim, td_tensor **out) {
  TD_CHECK_ARG(t && out && (perm || ndim == 0), "tensor_permute: NULL argument");
  if (ndim != t->ndim)
    return td_set_error(TD_ERR_INVALID, "tensor_permute: %d dims given for %d-d tensor", ndim,
                        t->ndim);
  bool seen[TD_MAX_DIMS] = {false};
  int p[TD_MAX_DIMS];
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  for (int i = 0; i < ndim; i++) {
    int d = td__norm_dim(perm[i], ndim);
    if (d < 0 || seen[d])
      return td_set_error(TD_ERR_INVALID, "tensor_permute: invalid permutation entry %d", perm[i]);
    seen[d] = true;
    p[i] = d;
    shape[i] = t->shape[d];
    strides[i] = t->strides[d];
  }
  td_node *node;
  TD_TRY(make_view(t, shape, strides, ndim, t->offset, &permute_ops, sizeof(permute_node), out,
                   &node));
  if (node) {
    permute_node *n = (permute_node *)node;
    n->ndim = ndim;
    for (int i = 0; i < ndim; i++) n->inv[p[i]] = i;
  }
  return TD_OK;
}

td_status td_tensor_transpose(const td_tensor *t, int d0, int d1, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_transpose: NULL argument");
  int a = td__norm_dim(d0, t->ndim), b = td__norm_dim(d1, t->ndim);
  if (a < 0 || b < 0 || t->ndim == 0)
    return td_set_error(TD_ERR_INVALID, "tensor_transpose: dims %d, %d out of range for %d-d",
                        d0, d1, t->ndim);
  int perm[TD_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) perm[i] = i;
  perm[a] = b;
  perm[b] = a;
  return td_tensor_permute(t, perm, t->ndim, out);
}

td_status td_tensor_unsqueeze(const td_tensor *t, int dim, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_unsqueeze: NULL argument");
  int d = dim < 0 ? dim + t->ndim + 1 : dim;
  if (d < 0 || d > t->ndim || t->ndim >= TD_MAX_DIMS)
    return td_set_error(TD_ERR_INVALID, "tensor_unsqueeze: dim %d out of range for %d-d tensor",
                        dim, t->ndim);
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  int n = 0;
  for (int i = 0; i <= t->ndim; i++) {
    if (i == d) { /* any stride works for a size-1 dim; keep the layout contiguous-looking */
      shape[n] = 1;
      strides[n++] = i < t->ndim ? t->strides[i] * t->shape[i] : 1;
    }
    if (i < t->ndim) {
      shape[n] = t->shape[i];
      strides[n++] = t->strides[i];
    }
  }
  td_node *node;
  TD_TRY(make_view(t, shape, strides, n, t->offset, &unsqueeze_ops, sizeof(dim_node), out, &node));
  if (node) ((dim_node *)node)->dim = d;
  return TD_OK;
}

td_status td_tensor_squeeze(const td_tensor *t, int dim, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_squeeze: NULL argument");
  int d = td__norm_dim(dim, t->ndim);
  if (d < 0 || t->ndim == 0 || t->shape[d] != 1)
    return td_set_error(TD_ERR_INVALID, "tensor_squeeze: dim %d is not a size-1 dim", dim);
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  int n = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (i == d) continue;
    shape[n] = t->shape[i];
    strides[n++] = t->strides[i];
  }
  td_node *node;
  TD_TRY(make_view(t, shape, strides, n, t->offset, &squeeze_ops, sizeof(dim_node), out, &node));
  if (node) ((dim_node *)node)->dim = d;
  return TD_OK;
}

td_status td_tensor_unbind(const td_tensor *t, int dim, td_tensor **outs) {
  TD_CHECK_ARG(t && outs, "tensor_unbind: NULL argument");
  int d = td__norm_dim(dim, t->ndim);
  if (d < 0 || t->ndim == 0)
    return td_set_error(TD_ERR_INVALID, "tensor_unbind: dim %d out of range for %d-d tensor", dim,
                        t->ndim);
  int64_t m = t->shape[d];
  TD_CHECK_ARG(m <= INT32_MAX, "tensor_unbind: %lld slices", (long long)m);
  td_node *node = NULL;
  if (td__needs_grad(t)) {
    node = td__node_new(sizeof(unbind_node), &unbind_ops, (int)(m ? m : 1), 1);
    if (!node) return td_set_error(TD_ERR_NOMEM, "tensor_unbind: out of memory");
    td_status st = td__node_set_next(node, 0, t);
    if (st != TD_OK) {
      td_node_unref(node);
      return st;
    }
    unbind_node *n = (unbind_node *)node;
    n->ndim = t->ndim;
    n->dim = d;
    memcpy(n->shape, t->shape, sizeof n->shape);
  }
  for (int64_t k = 0; k < m; k++) {
    td_status st = slice_view(t, d, k, &outs[k]);
    if (st != TD_OK) {
      for (int64_t j = 0; j < k; j++) td_tensor_unref(outs[j]);
      td_node_unref(node);
      return st;
    }
    if (node) td__tensor_set_history(outs[k], node, (int)k);
  }
  td_node_unref(node);
  return TD_OK;
}

td_status td__expand_view(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  if (ndim < t->ndim || ndim > TD_MAX_DIMS) goto bad;
  int64_t strides[TD_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    if (i < lead) {
      strides[i] = 0;
      continue;
    }
    int64_t s = t->shape[i - lead];
    if (s == shape[i]) strides[i] = t->strides[i - lead];
    else if (s == 1) strides[i] = 0;
    else goto bad;
  }
  td_node *node;
  TD_TRY(make_view(t, shape, strides, ndim, t->offset, &expand_ops, sizeof(reshape_node), out,
                   &node));
  if (node) {
    reshape_node *n = (reshape_node *)node;
    n->ndim = t->ndim;
    memcpy(n->shape, t->shape, sizeof n->shape);
  }
  return TD_OK;
bad:;
  char a[128], b[128];
  return td_set_error(TD_ERR_SHAPE, "expand: cannot broadcast %s to %s",
                      td_tensor_shape_str(t, a, sizeof a), td__shape_str(shape, ndim, b, sizeof b));
}

td_status td_tensor_expand(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  TD_CHECK_ARG(t && out && (shape || ndim == 0), "tensor_expand: NULL argument");
  return td__expand_view(t, shape, ndim, out);
}

static td_status copy_new(const td_tensor *t, td_tensor **out) {
  td_tensor *c;
  TD_TRY(td__tensor_new_like(t, &c));
  td_status st = td__backend_of(t)->copy(c, t);
  if (st == TD_OK && td__needs_grad(t)) {
    const td_tensor *ins[1] = {t};
    td__record(c, sizeof(td_node), &clone_ops, ins, 1, &st);
  }
  if (st != TD_OK) {
    td_tensor_unref(c);
    return st;
  }
  *out = c;
  return TD_OK;
}

td_status td_tensor_contiguous(const td_tensor *t, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_contiguous: NULL argument");
  if (td_tensor_is_contiguous(t)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return copy_new(t, out);
}

td_status td_tensor_clone(const td_tensor *t, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_clone: NULL argument");
  return copy_new(t, out);
}

td_status td_tensor_detach(const td_tensor *t, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_detach: NULL argument");
  return td__tensor_view(t, t->shape, t->strides, t->ndim, t->offset, out);
}

/* ---- history-free helpers for op implementations ---- */

td_status td__contig(const td_tensor *t, td_tensor **out) {
  if (td_tensor_is_contiguous(t)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  td_tensor *c = NULL;
  TD_TRY(td__tensor_new_like(t, &c));
  td_status st = td__backend_of(t)->copy(c, t);
  if (st != TD_OK) {
    td_tensor_unref(c);
    return st;
  }
  *out = c;
  return TD_OK;
}

td_status td__grad_prep(const td_tensor *g, td_dtype dt, td_tensor **out) {
  if (g->dtype == dt) return td__contig(g, out);
  td_tensor *c = NULL;
  TD_TRY(td_tensor_to_dtype(g, dt, &c));
  td_status st = td__contig(c, out);
  td_tensor_unref(c);
  return st;
}

td_status td__plain_view(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  int64_t strides[TD_MAX_DIMS];
  td__contiguous_strides(shape, ndim, strides);
  return td__tensor_view(t, shape, strides, ndim, t->offset, out);
}
