/* ops_index.c - index_select, embedding, cat and stack, forward and backward.
 *
 * index_select views the input as contiguous [outer, r, inner] around dim and gathers rows with
 * the backend's index_select kernel; backward scatters with index_add into zeros (duplicate
 * indices accumulate). Indices are range-checked on the host before any kernel runs (a copy to
 * the host for device tensors), so an out-of-range index is a clean TD_ERR_INVALID naming the
 * index, its position and the valid range. embedding is index_select on dim 0 of the flattened
 * indices followed by a reshape, so its gradient also comes from index_add.
 *
 * cat copies each input into its slice of the result with the backend's strided copy; backward
 * hands each input the matching slice of the incoming gradient. stack = unsqueeze + cat.
 */
#include "tensor_impl.h"

/* check_indices verifies that every element of the contiguous int64 tensor idx lies in
 * [0, limit); otherwise returns TD_ERR_INVALID with a message naming op, the value, its position
 * and `what` (the indexed tensor's shape). */
static td_status check_indices(const char *op, const td_tensor *idx, int64_t limit,
                               const char *what) {
  int64_t m = td_tensor_numel(idx);
  if (m == 0) return TD_OK;
  const int64_t *ix;
  int64_t *host = NULL;
  if (td_tensor_device(idx).type == TD_DEVICE_CPU) {
    ix = td_tensor_data(idx);
  } else {
    host = td__malloc((size_t)m * sizeof(int64_t));
    if (!host) return td_set_error(TD_ERR_NOMEM, "%s: no memory to check %lld indices", op,
                                   (long long)m);
    td_status st = td_tensor_copy_to_buffer(idx, host, (size_t)m * sizeof(int64_t));
    if (st != TD_OK) {
      td__free(host);
      return st;
    }
    ix = host;
  }
  td_status st = TD_OK;
  for (int64_t j = 0; j < m; j++) {
    if (ix[j] < 0 || ix[j] >= limit) {
      st = td_set_error(TD_ERR_INVALID, "%s: index %lld at position %lld is out of range "
                        "[0, %lld) for %s", op, (long long)ix[j], (long long)j,
                        (long long)limit, what);
      break;
    }
  }
  td__free(host);
  return st;
}

/* ---- index_select ---- */

typedef struct isel_node {
  td_node base;
  td_tensor *index; /* int64 [m], contiguous */
  int64_t outer, r, inner;
  int ndim; /* input shape */
  int64_t shape[TD_MAX_DIMS];
  td_dtype dtype;
} isel_node;

static td_status isel_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  isel_node *n = (isel_node *)self;
  if (!n->index)
    return td_set_error(TD_ERR_STATE, "index_select backward: saved tensors were released");
  const td__backend *be = td__backend_of(n->index);
  TD__NEED_KERNEL(be, index_add, "index_select backward");
  td_tensor *gy = NULL, *gx = NULL;
  td_status st = td__grad_prep(grad_out[0], n->dtype, &gy);
  if (st == TD_OK) st = td__tensor_new(n->shape, n->ndim, n->dtype, td_tensor_device(gy), &gx);
  if (st == TD_OK) st = be->fill(gx, 0.0);
  if (st == TD_OK && td_tensor_numel(gy) > 0)
    st = be->index_add(gx, n->outer, n->r, n->inner, n->index, gy);
  if (st == TD_OK) {
    grad_in[0] = gx;
    gx = NULL;
  }
  td_tensor_unref(gy);
  td_tensor_unref(gx);
  return st;
}

static void isel_release(td_node *self) {
  isel_node *n = (isel_node *)self;
  td_tensor_unref(n->index);
  n->index = NULL;
}

static const td__node_ops isel_ops = {
    .name = "IndexSelectBackward",
    .backward = isel_backward,
    .release_saved = isel_release,
};

td_status td_tensor_index_select(const td_tensor *t, int dim, const td_tensor *index,
                                 td_tensor **out) {
  if (!t || !index || !out) return td_set_error(TD_ERR_INVALID, "index_select: NULL argument");
  if (index->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "index_select: index must be int64, got %s",
                        td_dtype_name(index->dtype));
  TD_TRY(td__check_same_device("index_select", t, index));
  TD_TRY(td__check_compute("index_select", t));
  char a[96], b[96];
  const char *ts = td__shape_str(t->shape, t->ndim, a, sizeof a);
  if (index->ndim > 1)
    return td_set_error(TD_ERR_SHAPE, "index_select: index must be 0-d or 1-d, got %s",
                        td__shape_str(index->shape, index->ndim, b, sizeof b));
  int nd = t->ndim;
  int d = td__norm_dim(dim, nd == 0 ? 1 : nd);
  if (d < 0)
    return td_set_error(TD_ERR_INVALID, "index_select: dim %d out of range for tensor %s", dim,
                        ts);
  int64_t m = td_tensor_numel(index);
  if (nd == 0 && m != 1)
    return td_set_error(TD_ERR_SHAPE, "index_select: a 0-d input takes exactly one index, got "
                        "%lld", (long long)m);
  int64_t outer = 1, r = 1, inner = 1;
  int64_t oshape[TD_MAX_DIMS];
  for (int i = 0; i < nd; i++) {
    oshape[i] = i == d ? m : t->shape[i];
    if (i < d) outer *= t->shape[i];
    if (i > d) inner *= t->shape[i];
  }
  if (nd > 0) r = t->shape[d];
  const td__backend *be = td__backend_of(t);
  TD__NEED_KERNEL(be, index_select, "index_select");
  td_tensor *ic = NULL, *i1 = NULL, *tc = NULL, *res = NULL;
  td_status st = td__contig(index, &ic);
  if (st == TD_OK) st = td__plain_view(ic, &m, 1, &i1);
  if (st == TD_OK) st = check_indices("index_select", i1, r, ts);
  if (st == TD_OK) st = td__contig(t, &tc);
  if (st == TD_OK) st = td__tensor_new(oshape, nd, t->dtype, td_tensor_device(t), &res);
  if (st == TD_OK && outer * m * inner > 0)
    st = be->index_select(tc, outer, r, inner, i1, res);
  if (st != TD_OK) goto out;
  const td_tensor *in[1] = {t};
  isel_node *n = (isel_node *)td__record(res, sizeof(isel_node), &isel_ops, in, 1, &st);
  if (st != TD_OK) goto out;
  if (n) {
    n->index = td_tensor_ref(i1);
    n->outer = outer;
    n->r = r;
    n->inner = inner;
    n->ndim = nd;
    for (int i = 0; i < nd; i++) n->shape[i] = t->shape[i];
    n->dtype = t->dtype;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(ic);
  td_tensor_unref(i1);
  td_tensor_unref(tc);
  td_tensor_unref(res);
  return st;
}

/* ---- embedding ---- */

td_status td_tensor_embedding(const td_tensor *weight, const td_tensor *indices,
                              td_tensor **out) {
  if (!weight || !indices || !out)
    return td_set_error(TD_ERR_INVALID, "embedding: NULL argument");
  if (indices->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "embedding: indices must be int64, got %s",
                        td_dtype_name(indices->dtype));
  TD_TRY(td__check_same_device("embedding", weight, indices));
  TD_TRY(td__check_compute("embedding", weight));
  char a[96];
  const char *ws = td__shape_str(weight->shape, weight->ndim, a, sizeof a);
  if (weight->ndim != 2)
    return td_set_error(TD_ERR_SHAPE, "embedding: weight must be [V, D], got %s", ws);
  if (indices->ndim >= TD_MAX_DIMS)
    return td_set_error(TD_ERR_SHAPE, "embedding: indices have too many dims (%d)",
                        indices->ndim);
  int64_t m = td_tensor_numel(indices);
  int64_t oshape[TD_MAX_DIMS];
  for (int i = 0; i < indices->ndim; i++) oshape[i] = indices->shape[i];
  oshape[indices->ndim] = weight->shape[1];
  td_tensor *ic = NULL, *flat = NULL, *sel = NULL;
  td_status st = td__contig(indices, &ic);
  if (st == TD_OK) st = td__plain_view(ic, &m, 1, &flat);
  if (st == TD_OK) st = check_indices("embedding", flat, weight->shape[0], ws);
  if (st == TD_OK) st = td_tensor_index_select(weight, 0, flat, &sel);
  if (st == TD_OK) st = td_tensor_reshape(sel, oshape, indices->ndim + 1, out);
  td_tensor_unref(ic);
  td_tensor_unref(flat);
  td_tensor_unref(sel);
  return st;
}

/* ---- cat / stack ---- */

typedef struct cat_node {
  td_node base;
  int dim;
  int n;
  int64_t sizes[]; /* n sizes along dim */
} cat_node;

static td_status cat_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  cat_node *c = (cat_node *)self;
  const td_tensor *g = grad_out[0];
  int d = c->dim;
  int64_t shape[TD_MAX_DIMS];
  for (int i = 0; i < g->ndim; i++) shape[i] = g->shape[i];
  int64_t off = 0;
  td_status st = TD_OK;
  for (int i = 0; i < c->n && st == TD_OK; i++) {
    if (td__node_needs_grad(self, i)) {
      td_tensor *v = NULL;
      shape[d] = c->sizes[i];
      st = td__tensor_view(g, shape, g->strides, g->ndim, g->offset + off * g->strides[d], &v);
      if (st == TD_OK) st = td__contig(v, &grad_in[i]);
      td_tensor_unref(v);
    }
    off += c->sizes[i];
  }
  return st;
}

static const td__node_ops cat_ops = {
    .name = "CatBackward",
    .backward = cat_backward,
    .release_saved = NULL,
};

td_status td_tensor_cat(td_tensor *const *ts, int n, int dim, td_tensor **out) {
  if (!ts || n < 1 || !out)
    return td_set_error(TD_ERR_INVALID, "cat: need at least one tensor (n = %d) and out", n);
  for (int i = 0; i < n; i++)
    if (!ts[i]) return td_set_error(TD_ERR_INVALID, "cat: tensor %d is NULL", i);
  const td_tensor *t0 = ts[0];
  int nd = t0->ndim;
  if (nd == 0) return td_set_error(TD_ERR_INVALID, "cat: 0-d tensors cannot be concatenated");
  int d = td__norm_dim(dim, nd);
  if (d < 0) return td_set_error(TD_ERR_INVALID, "cat: dim %d out of range for %d-d tensors",
                                 dim, nd);
  int64_t shape[TD_MAX_DIMS];
  for (int i = 0; i < nd; i++) shape[i] = t0->shape[i];
  shape[d] = 0;
  for (int i = 0; i < n; i++) {
    const td_tensor *t = ts[i];
    TD_TRY(td__check_same_dtype("cat", t0, t));
    TD_TRY(td__check_same_device("cat", t0, t));
    bool ok = t->ndim == nd;
    for (int j = 0; ok && j < nd; j++) ok = j == d || t->shape[j] == t0->shape[j];
    if (!ok) {
      char a[96], b[96];
      return td_set_error(TD_ERR_SHAPE, "cat: tensor %d has shape %s, incompatible with tensor "
                          "0 %s along dim %d", i, td__shape_str(t->shape, t->ndim, a, sizeof a),
                          td__shape_str(t0->shape, nd, b, sizeof b), d);
    }
    shape[d] += t->shape[d];
  }
  const td__backend *be = td__backend_of(t0);
  td_tensor *res = NULL, *v = NULL;
  td_status st = td__tensor_new(shape, nd, t0->dtype, td_tensor_device(t0), &res);
  int64_t off = 0;
  for (int i = 0; i < n && st == TD_OK; i++) {
    const td_tensor *t = ts[i];
    if (td_tensor_numel(t) > 0) {
      st = td__tensor_view(res, t->shape, res->strides, nd, res->offset + off * res->strides[d],
                           &v);
      if (st == TD_OK) st = be->copy(v, t);
      td_tensor_unref(v);
      v = NULL;
    }
    off += t->shape[d];
  }
  if (st != TD_OK) goto out;
  cat_node *c = (cat_node *)td__record(res, sizeof(cat_node) + (size_t)n * sizeof(int64_t),
                                       &cat_ops, (const td_tensor *const *)ts, n, &st);
  if (st != TD_OK) goto out;
  if (c) {
    c->dim = d;
    c->n = n;
    for (int i = 0; i < n; i++) c->sizes[i] = ts[i]->shape[d];
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(res);
  return st;
}

td_status td_tensor_stack(td_tensor *const *ts, int n, int dim, td_tensor **out) {
  if (!ts || n < 1 || !out)
    return td_set_error(TD_ERR_INVALID, "stack: need at least one tensor (n = %d) and out", n);
  for (int i = 0; i < n; i++)
    if (!ts[i]) return td_set_error(TD_ERR_INVALID, "stack: tensor %d is NULL", i);
  int nd = ts[0]->ndim;
  if (nd + 1 > TD_MAX_DIMS)
    return td_set_error(TD_ERR_SHAPE, "stack: result would have more than %d dims", TD_MAX_DIMS);
  int d = td__norm_dim(dim, nd + 1);
  if (d < 0) return td_set_error(TD_ERR_INVALID, "stack: dim %d out of range for %d-d tensors",
                                 dim, nd);
  for (int i = 1; i < n; i++) {
    if (!td_tensor_same_shape(ts[0], ts[i])) {
      char a[96], b[96];
      return td_set_error(TD_ERR_SHAPE, "stack: tensor %d has shape %s but tensor 0 has %s", i,
                          td__shape_str(ts[i]->shape, ts[i]->ndim, a, sizeof a),
                          td__shape_str(ts[0]->shape, nd, b, sizeof b));
    }
  }
  td_tensor **us = td__calloc((size_t)n, sizeof *us);
  if (!us) return td_set_error(TD_ERR_NOMEM, "stack: no memory for %d tensors", n);
  td_status st = TD_OK;
  for (int i = 0; i < n && st == TD_OK; i++) st = td_tensor_unsqueeze(ts[i], d, &us[i]);
  if (st == TD_OK) st = td_tensor_cat(us, n, d, out);
  for (int i = 0; i < n; i++) td_tensor_unref(us[i]);
  td__free(us);
  return st;
}
