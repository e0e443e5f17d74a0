/* ops_reduce.c - sum / mean over dims, max / argmax over one dim, and td__sum_to (the
 * broadcast-undo used by every broadcasting backward).
 *
 * A reduction over several dims runs one kernel per dim, highest dim first, on a contiguous
 * input viewed as [outer, r, inner]. Backward of sum expands the gradient back (materialised, so
 * later kernels see contiguous memory); mean is sum times 1/count; max routes the gradient to the
 * arg-max through a one-hot mask built from the saved indices.
 */
#include <string.h>

#include "tensor_impl.h"


/* Sums contiguous x over dim d (keepdim), no autograd. */
static td_status sum_dim_raw(const td_tensor *x, int d, td_tensor **out) {
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; i++) outer *= x->shape[i];
  for (int i = d + 1; i < x->ndim; i++) inner *= x->shape[i];
  int64_t shape[TD_MAX_DIMS];
  memcpy(shape, x->shape, sizeof shape);
  shape[d] = 1;
  td_tensor *r;
  TD_TRY(td__tensor_new(shape, x->ndim, x->dtype, x->storage->device, &r));
  td_status st = td__backend_of(x)->reduce_sum(x, outer, x->shape[d], inner, r);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

typedef struct {
  td_node base;
  int ndim;
  int64_t shape[TD_MAX_DIMS];      /* input shape */
  int64_t kshape[TD_MAX_DIMS];     /* keepdim result shape */
} sum_node;

static td_status sum_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  sum_node *n = (sum_node *)self;
  td_tensor *g = NULL, *e = NULL;
  TD_TRY(td_tensor_reshape(gout[0], n->kshape, n->ndim, &g));
  td_status st = td__expand_view(g, n->shape, n->ndim, &e);
  td_tensor_unref(g);
  if (st != TD_OK) return st;
  st = td_tensor_contiguous(e, &gin[0]);
  td_tensor_unref(e);
  return st;
}
static const td__node_ops sum_ops = {"SumBackward", sum_backward, NULL, NULL};

td_status td_tensor_sum(const td_tensor *t, const int *dims, int ndims, bool keepdim,
                        td_tensor **out) {
  TD_CHECK_ARG(t && out && (dims || ndims == 0), "sum: NULL argument");
  TD__AUTOCAST(false, 1, (t), td_tensor_sum(ac_t[0], dims, ndims, keepdim, out));
  TD_TRY(td__check_compute("sum", t));
  bool red[TD_MAX_DIMS] = {false};
  for (int i = 0; i < ndims; i++) {
    int d = td__norm_dim(dims[i], t->ndim);
    if (d < 0 || (t->ndim == 0 && dims[i] != 0 && dims[i] != -1))
      return td_set_error(TD_ERR_INVALID, "sum: dim %d out of range for %d-d tensor", dims[i],
                          t->ndim);
    if (t->ndim) red[d] = true;
  }
  td_tensor *cur;
  TD_TRY(td__tensor_view(t, t->shape, t->strides, t->ndim, t->offset, &cur));
  td_status st = TD_OK;
  if (!td_tensor_is_contiguous(cur)) {
    td_tensor *c = NULL;
    st = td__tensor_new_like(t, &c);
    if (st == TD_OK) st = td__backend_of(t)->copy(c, cur);
    td_tensor_unref(cur);
    cur = c;
    if (st != TD_OK) {
      td_tensor_unref(cur);
      return st;
    }
  }
  for (int d = t->ndim - 1; d >= 0 && st == TD_OK; d--) {
    if (!red[d]) continue;
    td_tensor *nx;
    st = sum_dim_raw(cur, d, &nx);
    if (st == TD_OK) {
      td_tensor_unref(cur);
      cur = nx;
    }
  }
  int64_t kshape[TD_MAX_DIMS], rshape[TD_MAX_DIMS];
  int rn = 0;
  for (int d = 0; d < t->ndim; d++) {
    kshape[d] = red[d] ? 1 : t->shape[d];
    if (!red[d]) rshape[rn++] = t->shape[d];
  }
  td_tensor *r = NULL;
  if (st == TD_OK && cur->storage == t->storage) {
    /* nothing was reduced: the result must not share the input's memory */
    td_tensor *c = NULL;
    st = td__tensor_new_like(cur, &c);
    if (st == TD_OK) st = td__backend_of(cur)->copy(c, cur);
    td_tensor_unref(cur);
    cur = c;
  }
  if (st == TD_OK) {
    if (keepdim || t->ndim == 0) {
      r = td_tensor_ref(cur);
    } else {
      int64_t strides[TD_MAX_DIMS];
      td__contiguous_strides(rshape, rn, strides);
      st = td__tensor_view(cur, rshape, strides, rn, cur->offset, &r);
    }
  }
  td_tensor_unref(cur);
  if (st == TD_OK && td__needs_grad(t)) {
    const td_tensor *ins[1] = {t};
    sum_node *n = (sum_node *)td__record(r, sizeof(sum_node), &sum_ops, ins, 1, &st);
    if (n) {
      n->ndim = t->ndim;
      memcpy(n->shape, t->shape, sizeof n->shape);
      memcpy(n->kshape, kshape, sizeof n->kshape);
    }
  }
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

td_status td_tensor_sum_all(const td_tensor *t, td_tensor **out) {
  TD_CHECK_ARG(t && out, "sum_all: NULL argument");
  int dims[TD_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) dims[i] = i;
  return td_tensor_sum(t, dims, t->ndim, false, out);
}

td_status td_tensor_mean(const td_tensor *t, const int *dims, int ndims, bool keepdim,
                         td_tensor **out) {
  TD_CHECK_ARG(t && out, "mean: NULL argument");
  TD__AUTOCAST(false, 1, (t), td_tensor_mean(ac_t[0], dims, ndims, keepdim, out));
  TD_TRY(td__check_float("mean", t));
  td_tensor *s;
  TD_TRY(td_tensor_sum(t, dims, ndims, keepdim, &s));
  int64_t count = td_tensor_numel(t) / (td_tensor_numel(s) ? td_tensor_numel(s) : 1);
  if (td_tensor_numel(s) == 0) count = 0;
  td_status st = td_tensor_mul_scalar(s, count ? 1.0 / (double)count : (0.0 / 0.0), out);
  td_tensor_unref(s);
  return st;
}

td_status td_tensor_mean_all(const td_tensor *t, td_tensor **out) {
  TD_CHECK_ARG(t && out, "mean_all: NULL argument");
  int dims[TD_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) dims[i] = i;
  return td_tensor_mean(t, dims, t->ndim, false, out);
}

td_status td__sum_to(const td_tensor *grad, const int64_t *shape, int ndim, td_tensor **out) {
  if (grad->ndim == ndim && memcmp(grad->shape, shape, (size_t)ndim * sizeof(int64_t)) == 0) {
    *out = td_tensor_ref((td_tensor *)grad);
    return TD_OK;
  }
  if (ndim > grad->ndim) goto bad;
  int dims[TD_MAX_DIMS];
  int nd = 0, lead = grad->ndim - ndim;
  for (int i = 0; i < grad->ndim; i++) {
    if (i < lead) dims[nd++] = i;
    else if (shape[i - lead] == 1 && grad->shape[i] != 1) dims[nd++] = i;
    else if (shape[i - lead] != grad->shape[i]) goto bad;
  }
  td_tensor *s;
  TD_TRY(td_tensor_sum(grad, dims, nd, true, &s));
  td_status st = td_tensor_reshape(s, shape, ndim, out);
  td_tensor_unref(s);
  return st;
bad:;
  char a[128], b[128];
  return td_set_error(TD_ERR_SHAPE, "sum_to: cannot reduce %s to %s",
                      td_tensor_shape_str(grad, a, sizeof a), td__shape_str(shape, ndim, b, sizeof b));
}

/* ---- max / argmax ---- */

typedef struct {
  td_node base;
  int dim;
  bool keepdim;
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  td_tensor *idx; /* keepdim-shaped int64 indices */
} max_node;

static void max_release(td_node *self) {
  max_node *n = (max_node *)self;
  td_tensor_unref(n->idx);
  n->idx = NULL;
}

static td_status max_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  max_node *n = (max_node *)self;
  int64_t kshape[TD_MAX_DIMS];
  memcpy(kshape, n->shape, sizeof kshape);
  kshape[n->dim] = 1;
  int64_t r = n->shape[n->dim];
  td_tensor *g = NULL, *ar = NULL, *arv = NULL, *idxe = NULL, *eq = NULL, *mask = NULL;
  td_status st = td_tensor_reshape(gout[0], kshape, n->ndim, &g);
  /* one-hot of the arg-max along dim: arange(r) viewed along dim == idx */
  int64_t ashape[TD_MAX_DIMS];
  for (int i = 0; i < n->ndim; i++) ashape[i] = 1;
  ashape[n->dim] = r;
  if (st == TD_OK)
    st = td_tensor_arange(0, (double)r, 1, TD_DTYPE_I64, td_tensor_device(gout[0]), &ar);
  if (st == TD_OK) st = td_tensor_reshape(ar, ashape, n->ndim, &arv);
  td_tensor *arx = NULL;
  if (st == TD_OK) st = td__expand_view(arv, n->shape, n->ndim, &arx);
  if (st == TD_OK) st = td__expand_view(n->idx, n->shape, n->ndim, &idxe);
  if (st == TD_OK) st = td__binary_raw(TD__BIN_EQ, arx, idxe, &eq);
  if (st == TD_OK) st = td_tensor_to_dtype(eq, gout[0]->dtype, &mask);
  if (st == TD_OK) st = td_tensor_mul(mask, g, &gin[0]);
  td_tensor_unref(g);
  td_tensor_unref(ar);
  td_tensor_unref(arv);
  td_tensor_unref(arx);
  td_tensor_unref(idxe);
  td_tensor_unref(eq);
  td_tensor_unref(mask);
  return st;
}
static const td__node_ops max_ops = {"MaxBackward", max_backward, max_release, NULL};

static td_status max_impl(const td_tensor *t, int dim, bool keepdim, td_tensor **values,
                          td_tensor **indices, bool record) {
  TD_CHECK_ARG(t, "max: NULL tensor");
  TD_TRY(td__check_compute("max", t));
  int d = td__norm_dim(dim, t->ndim);
  if (d < 0 || t->ndim == 0)
    return td_set_error(TD_ERR_INVALID, "max: dim %d out of range for %d-d tensor", dim, t->ndim);
  if (t->shape[d] == 0)
    return td_set_error(TD_ERR_SHAPE, "max: cannot reduce over an empty dim %d", d);
  td_tensor *c = NULL, *v = NULL, *ix = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_contiguous(t, &c);
  td_autograd_set_enabled(prev);
  if (st != TD_OK) return st;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; i++) outer *= t->shape[i];
  for (int i = d + 1; i < t->ndim; i++) inner *= t->shape[i];
  int64_t kshape[TD_MAX_DIMS];
  memcpy(kshape, t->shape, sizeof kshape);
  kshape[d] = 1;
  st = td__tensor_new(kshape, t->ndim, t->dtype, t->storage->device, &v);
  if (st == TD_OK) st = td__tensor_new(kshape, t->ndim, TD_DTYPE_I64, t->storage->device, &ix);
  if (st == TD_OK) st = td__backend_of(t)->reduce_max(c, outer, t->shape[d], inner, v, ix);
  td_tensor_unref(c);
  td_tensor *vo = NULL, *io = NULL;
  if (st == TD_OK && !keepdim) {
    int64_t rshape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
    int rn = 0;
    for (int i = 0; i < t->ndim; i++)
      if (i != d) rshape[rn++] = t->shape[i];
    td__contiguous_strides(rshape, rn, strides);
    st = td__tensor_view(v, rshape, strides, rn, 0, &vo);
    if (st == TD_OK) st = td__tensor_view(ix, rshape, strides, rn, 0, &io);
  } else if (st == TD_OK) {
    vo = td_tensor_ref(v);
    io = td_tensor_ref(ix);
  }
  if (st == TD_OK && record && td__needs_grad(t)) {
    const td_tensor *ins[1] = {t};
    max_node *n = (max_node *)td__record(vo, sizeof(max_node), &max_ops, ins, 1, &st);
    if (n) {
      n->dim = d;
      n->keepdim = keepdim;
      n->ndim = t->ndim;
      memcpy(n->shape, t->shape, sizeof n->shape);
      n->idx = td_tensor_ref(ix);
    }
  }
  td_tensor_unref(v);
  td_tensor_unref(ix);
  if (st != TD_OK) {
    td_tensor_unref(vo);
    td_tensor_unref(io);
    return st;
  }
  if (values) *values = vo;
  else td_tensor_unref(vo);
  if (indices) *indices = io;
  else td_tensor_unref(io);
  return TD_OK;
}

td_status td_tensor_max(const td_tensor *t, int dim, bool keepdim, td_tensor **values,
                        td_tensor **indices) {
  TD_CHECK_ARG(values, "max: NULL values");
  return max_impl(t, dim, keepdim, values, indices, true);
}

td_status td_tensor_argmax(const td_tensor *t, int dim, bool keepdim, td_tensor **out) {
  TD_CHECK_ARG(out, "argmax: NULL out");
  return max_impl(t, dim, keepdim, NULL, out, false);
}
