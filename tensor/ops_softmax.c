/* ops_softmax.c - softmax, log-softmax and the losses built on them (nll, cross entropy, mse).
 *
 * softmax / log_softmax view the input as contiguous [outer, r, inner] around the reduced dim
 * and run the backend's softmax kernel; the backward node saves the output (as a view without
 * history, so output and node do not keep each other alive) and runs softmax_backward.
 *
 * nll_loss runs the backend's nll kernel into per-sample losses [N] plus the count of
 * non-ignored targets, then reduces on the device (reduce_sum, then an affine scale by 1/count
 * for the mean). Its backward builds the per-sample upstream gradient [N] and scatters it with
 * nll_backward. cross_entropy and mse_loss compose recorded public ops.
 *
 * Semantics follow torch.nn.functional: mean over zero non-ignored targets is NaN (0/0), ignored
 * targets may be out of range, other out-of-range targets are TD_ERR_INVALID.
 */
#include <math.h>

#include "tensor_impl.h"

/* ---- softmax / log_softmax ---- */

typedef struct softmax_node {
  td_node base;
  td_tensor *y; /* forward output, contiguous, without history */
  int64_t outer, r, inner;
  bool log;
} softmax_node;

static td_status softmax_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  softmax_node *n = (softmax_node *)self;
  const char *op = n->log ? "log_softmax backward" : "softmax backward";
  if (!n->y) return td_set_error(TD_ERR_STATE, "%s: saved tensors were released", op);
  const td__backend *be = td__backend_of(n->y);
  TD__NEED_KERNEL(be, softmax_backward, op);
  td_tensor *gy = NULL, *gx = NULL;
  td_status st = td__grad_prep(grad_out[0], n->y->dtype, &gy);
  if (st != TD_OK) goto out;
  st = td__tensor_new_like(n->y, &gx);
  if (st != TD_OK) goto out;
  if (td_tensor_numel(gx) > 0)
    st = be->softmax_backward(n->y, gy, n->outer, n->r, n->inner, n->log, gx);
  if (st != TD_OK) goto out;
  grad_in[0] = gx;
  gx = NULL;
out:
  td_tensor_unref(gy);
  td_tensor_unref(gx);
  return st;
}

static void softmax_release(td_node *self) {
  softmax_node *n = (softmax_node *)self;
  td_tensor_unref(n->y);
  n->y = NULL;
}

static const td__node_ops softmax_ops = {
    .name = "SoftmaxBackward",
    .backward = softmax_backward,
    .release_saved = softmax_release,
};
static const td__node_ops log_softmax_ops = {
    .name = "LogSoftmaxBackward",
    .backward = softmax_backward,
    .release_saved = softmax_release,
};

static td_status softmax_impl(const char *op, const td_tensor *t, int dim, bool log,
                              td_tensor **out) {
  if (!t || !out) return td_set_error(TD_ERR_INVALID, "%s: NULL argument", op);
  TD_TRY(td__check_float(op, t));
  int nd = t->ndim;
  int d = td__norm_dim(dim, nd == 0 ? 1 : nd);
  if (d < 0) {
    char b[96];
    return td_set_error(TD_ERR_INVALID, "%s: dim %d out of range for tensor %s", op, dim,
                        td__shape_str(t->shape, nd, b, sizeof b));
  }
  int64_t outer = 1, r = 1, inner = 1;
  if (nd > 0) {
    for (int i = 0; i < d; i++) outer *= t->shape[i];
    r = t->shape[d];
    for (int i = d + 1; i < nd; i++) inner *= t->shape[i];
  }
  const td__backend *be = td__backend_of(t);
  TD__NEED_KERNEL(be, softmax, op);
  td_tensor *xc = NULL, *y = NULL;
  td_status st = td__contig(t, &xc);
  if (st != TD_OK) goto out;
  st = td__tensor_new(t->shape, nd, t->dtype, td_tensor_device(t), &y);
  if (st != TD_OK) goto out;
  if (outer * r * inner > 0) st = be->softmax(xc, outer, r, inner, log, y);
  if (st != TD_OK) goto out;
  const td_tensor *in[1] = {t};
  softmax_node *n = (softmax_node *)td__record(y, sizeof(softmax_node),
                                               log ? &log_softmax_ops : &softmax_ops, in, 1, &st);
  if (st != TD_OK) goto out;
  if (n) {
    n->outer = outer;
    n->r = r;
    n->inner = inner;
    n->log = log;
    st = td__tensor_view(y, y->shape, y->strides, y->ndim, y->offset, &n->y);
    if (st != TD_OK) goto out;
  }
  *out = y;
  y = NULL;
out:
  td_tensor_unref(xc);
  td_tensor_unref(y);
  return st;
}

td_status td_tensor_softmax(const td_tensor *t, int dim, td_tensor **out) {
  TD__AUTOCAST(false, 1, (t), td_tensor_softmax(ac_t[0], dim, out));
  return softmax_impl("softmax", t, dim, false, out);
}

td_status td_tensor_log_softmax(const td_tensor *t, int dim, td_tensor **out) {
  TD__AUTOCAST(false, 1, (t), td_tensor_log_softmax(ac_t[0], dim, out));
  return softmax_impl("log_softmax", t, dim, true, out);
}

/* ---- nll_loss ---- */

typedef struct nll_node {
  td_node base;
  td_tensor *target; /* int64 [N], contiguous */
  int64_t n, c;
  int in_ndim; /* 1 ([C] input) or 2 ([N, C]) */
  td_reduction red;
  int64_t ignore_index;
  int64_t count; /* non-ignored targets */
  td_dtype dtype;
} nll_node;

/* nll_check validates logp / target for op and sets *n, *c. */
static td_status nll_check(const char *op, const td_tensor *logp, const td_tensor *target,
                           td_reduction red, int64_t *n, int64_t *c) {
  if (!logp || !target) return td_set_error(TD_ERR_INVALID, "%s: NULL tensor", op);
  if (red != TD_REDUCTION_MEAN && red != TD_REDUCTION_SUM && red != TD_REDUCTION_NONE)
    return td_set_error(TD_ERR_INVALID, "%s: unknown reduction %d", op, (int)red);
  TD_TRY(td__check_float(op, logp));
  if (target->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s: target must be int64 class indices, got %s", op,
                        td_dtype_name(target->dtype));
  TD_TRY(td__check_same_device(op, logp, target));
  char a[96], b[96];
  bool ok = (logp->ndim == 1 && target->ndim == 0) ||
            (logp->ndim == 2 && target->ndim == 1 && target->shape[0] == logp->shape[0]);
  if (!ok)
    return td_set_error(TD_ERR_SHAPE,
                        "%s: input %s and target %s do not match (expected input [N, C] with "
                        "target [N], or input [C] with target [])",
                        op, td__shape_str(logp->shape, logp->ndim, a, sizeof a),
                        td__shape_str(target->shape, target->ndim, b, sizeof b));
  *n = logp->ndim == 2 ? logp->shape[0] : 1;
  *c = logp->shape[logp->ndim - 1];
  return TD_OK;
}

/* The gradient of a loss over n rows for each row (*out, [n], dtype): the upstream gradient itself
 * without reduction, else the scalar upstream gradient spread over the rows (times 1/count for
 * mean: count is the rows not ignored). Shared by nll_loss and cross_entropy. */
static td_status loss_rows_grad(const td__backend *be, td_tensor *grad_out, td_dtype dtype,
                                int64_t n, td_reduction red, int64_t count, td_tensor **out) {
  td_tensor *g = NULL, *ex = NULL, *gl = NULL;
  int64_t nshape[1] = {n};
  td_status st = td__grad_prep(grad_out, dtype, &g);
  if (st == TD_OK && red == TD_REDUCTION_NONE) {
    st = td__plain_view(g, nshape, 1, &gl);
  } else if (st == TD_OK) {
    st = td__tensor_new(nshape, 1, dtype, td_tensor_device(g), &gl);
    if (st == TD_OK) st = td__expand_view(g, nshape, 1, &ex);
    if (st == TD_OK && n > 0) st = be->copy(gl, ex);
    if (st == TD_OK && red == TD_REDUCTION_MEAN && n > 0)
      st = be->unary(TD__UN_AFFINE, gl, gl, count > 0 ? 1.0 / (double)count : 0.0, 0.0);
  }
  td_tensor_unref(g);
  td_tensor_unref(ex);
  if (st != TD_OK) {
    td_tensor_unref(gl);
    return st;
  }
  *out = gl;
  return TD_OK;
}

static td_status nll_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  nll_node *n = (nll_node *)self;
  if (!n->target) return td_set_error(TD_ERR_STATE, "nll_loss backward: saved tensors released");
  const td__backend *be = td__backend_of(n->target);
  TD__NEED_KERNEL(be, nll_backward, "nll_loss backward");
  td_tensor *gl = NULL, *gx = NULL;
  int64_t xshape[2] = {n->n, n->c};
  td_status st = loss_rows_grad(be, grad_out[0], n->dtype, n->n, n->red, n->count, &gl);
  if (st != TD_OK) goto out;
  st = td__tensor_new(xshape, 2, n->dtype, td_tensor_device(gl), &gx);
  if (st == TD_OK && n->n * n->c > 0) st = be->fill(gx, 0.0);
  if (st == TD_OK && n->n > 0) st = be->nll_backward(n->target, gl, n->ignore_index, gx);
  if (st != TD_OK) goto out;
  if (n->in_ndim == 1) {
    st = td__plain_view(gx, &n->c, 1, &grad_in[0]);
  } else {
    grad_in[0] = gx;
    gx = NULL;
  }
out:
  td_tensor_unref(gl);
  td_tensor_unref(gx);
  return st;
}

static void nll_release(td_node *self) {
  nll_node *n = (nll_node *)self;
  td_tensor_unref(n->target);
  n->target = NULL;
}

static const td__node_ops nll_ops = {
    .name = "NllLossBackward",
    .backward = nll_backward,
    .release_saved = nll_release,
};

td_status td_tensor_nll_loss(const td_tensor *logp, const td_tensor *target, td_reduction red,
                             int64_t ignore_index, td_tensor **out) {
  if (!out) return td_set_error(TD_ERR_INVALID, "nll_loss: NULL out");
  TD__AUTOCAST(false, 1, (logp), td_tensor_nll_loss(ac_t[0], target, red, ignore_index, out));
  int64_t n = 0, c = 0;
  TD_TRY(nll_check("nll_loss", logp, target, red, &n, &c));
  const td__backend *be = td__backend_of(logp);
  TD__NEED_KERNEL(be, nll, "nll_loss");
  td_tensor *lpc = NULL, *lp2 = NULL, *tgc = NULL, *tg1 = NULL, *losses = NULL, *res = NULL;
  int64_t xshape[2] = {n, c}, nshape[1] = {n}, count = 0;
  td_status st = td__contig(logp, &lpc);
  if (st == TD_OK) st = td__plain_view(lpc, xshape, 2, &lp2);
  if (st == TD_OK) st = td__contig(target, &tgc);
  if (st == TD_OK) st = td__plain_view(tgc, nshape, 1, &tg1);
  if (st == TD_OK) st = td__tensor_new(nshape, 1, logp->dtype, td_tensor_device(logp), &losses);
  if (st == TD_OK && n > 0) st = be->nll(lp2, tg1, ignore_index, losses, &count);
  if (st != TD_OK) goto out;
  if (red == TD_REDUCTION_NONE) {
    if (logp->ndim == 1) {
      st = td__plain_view(losses, nshape, 0, &res);
    } else {
      res = losses;
      losses = NULL;
    }
  } else {
    st = td__tensor_new(nshape, 0, logp->dtype, td_tensor_device(logp), &res);
    if (st == TD_OK) st = n > 0 ? be->reduce_sum(losses, 1, n, 1, res) : be->fill(res, 0.0);
    if (st == TD_OK && red == TD_REDUCTION_MEAN)
      st = be->unary(TD__UN_AFFINE, res, res, count > 0 ? 1.0 / (double)count : NAN, 0.0);
  }
  if (st != TD_OK) goto out;
  const td_tensor *in[1] = {logp};
  nll_node *node = (nll_node *)td__record(res, sizeof(nll_node), &nll_ops, in, 1, &st);
  if (st != TD_OK) goto out;
  if (node) {
    node->target = td_tensor_ref(tg1);
    node->n = n;
    node->c = c;
    node->in_ndim = logp->ndim;
    node->red = red;
    node->ignore_index = ignore_index;
    node->count = count;
    node->dtype = logp->dtype;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(lpc);
  td_tensor_unref(lp2);
  td_tensor_unref(tgc);
  td_tensor_unref(tg1);
  td_tensor_unref(losses);
  td_tensor_unref(res);
  return st;
}

/* ---- cross_entropy, mse_loss ---- */

/* The fused cross entropy of backends with the kernels (CUDA): one pass over the logits forward
 * (each row's log-sum-exp, kept for backward) and one backward (softmax - onehot, scaled), instead
 * of log_softmax's [N, C] output, nll's zero-filled [N, C] gradient and log_softmax's backward; 16-bit
 * logits under autocast are read into float32 in place (no float32 copy of [N, C]), which is the
 * float32 cross entropy autocast asks for: float32 loss, the gradient rounded once to the logits'
 * dtype. */
typedef struct ce_node {
  td_node base;
  td_tensor *logits, *target, *lse; /* [N, C] history-free view, [N] int64, [N] */
  int64_t n, c;
  int in_ndim;
  td_reduction red;
  int64_t ignore_index;
  int64_t count;
  td_dtype ldt; /* the losses' dtype: float32, or float64 for float64 logits */
} ce_node;

static td_status ce_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  ce_node *n = (ce_node *)self;
  if (!n->logits) return td_set_error(TD_ERR_STATE, "cross_entropy backward: saved tensors "
                                      "released");
  const td__backend *be = td__backend_of(n->logits);
  TD__NEED_KERNEL(be, cross_entropy_backward, "cross_entropy backward");
  td_tensor *gl = NULL, *gx = NULL;
  int64_t xshape[2] = {n->n, n->c};
  td_status st = loss_rows_grad(be, grad_out[0], n->ldt, n->n, n->red, n->count, &gl);
  if (st == TD_OK) st = td__tensor_new(xshape, 2, n->logits->dtype, td_tensor_device(gl), &gx);
  if (st == TD_OK && n->n * n->c > 0)
    st = be->cross_entropy_backward(n->logits, n->target, n->lse, gl, n->ignore_index, gx);
  if (st != TD_OK) goto out;
  if (n->in_ndim == 1) {
    st = td__plain_view(gx, &n->c, 1, &grad_in[0]);
  } else {
    grad_in[0] = gx;
    gx = NULL;
  }
out:
  td_tensor_unref(gl);
  td_tensor_unref(gx);
  return st;
}

static void ce_release(td_node *self) {
  ce_node *n = (ce_node *)self;
  td_tensor_unref(n->logits);
  td_tensor_unref(n->target);
  td_tensor_unref(n->lse);
  n->logits = n->target = n->lse = NULL;
}

static const td__node_ops ce_ops = {
    .name = "CrossEntropyLossBackward",
    .backward = ce_backward,
    .release_saved = ce_release,
};

/* ce_fused_applies says whether the fused kernels take logits: the device has them, and the
 * logits are float32 / float64, or 16-bit under autocast (whose policy is float32 there). */
static bool ce_fused_applies(const td_tensor *logits) {
  if (!logits || !td__backend_of(logits)->cross_entropy) return false;
  td_dtype dt = logits->dtype;
  if (dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64) return true;
  return (dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16) && td_autocast_dtype(NULL);
}

static td_status ce_fused(const td_tensor *logits, const td_tensor *target, td_reduction red,
                          int64_t ignore_index, td_tensor **out) {
  int64_t n = 0, c = 0;
  TD_TRY(nll_check("cross_entropy", logits, target, red, &n, &c));
  const td__backend *be = td__backend_of(logits);
  td_dtype ldt = logits->dtype == TD_DTYPE_F64 ? TD_DTYPE_F64 : TD_DTYPE_F32;
  td_tensor *lc = NULL, *l2 = NULL, *tgc = NULL, *tg1 = NULL, *losses = NULL, *lse = NULL;
  td_tensor *res = NULL;
  int64_t xshape[2] = {n, c}, nshape[1] = {n}, count = 0;
  td_device dev = td_tensor_device(logits);
  td_status st = td__contig(logits, &lc);
  if (st == TD_OK) st = td__plain_view(lc, xshape, 2, &l2);
  if (st == TD_OK) st = td__contig(target, &tgc);
  if (st == TD_OK) st = td__plain_view(tgc, nshape, 1, &tg1);
  if (st == TD_OK) st = td__tensor_new(nshape, 1, ldt, dev, &losses);
  if (st == TD_OK) st = td__tensor_new(nshape, 1, ldt, dev, &lse);
  if (st == TD_OK && n > 0) {
    if (c == 0) st = td_set_error(TD_ERR_SHAPE, "cross_entropy: no classes for %lld targets",
                                  (long long)n);
    else st = be->cross_entropy(l2, tg1, ignore_index, losses, lse, &count);
  }
  if (st != TD_OK) goto out;
  if (red == TD_REDUCTION_NONE) {
    if (logits->ndim == 1) {
      st = td__plain_view(losses, nshape, 0, &res);
    } else {
      res = losses;
      losses = NULL;
    }
  } else {
    st = td__tensor_new(nshape, 0, ldt, dev, &res);
    if (st == TD_OK) st = n > 0 ? be->reduce_sum(losses, 1, n, 1, res) : be->fill(res, 0.0);
    if (st == TD_OK && red == TD_REDUCTION_MEAN)
      st = be->unary(TD__UN_AFFINE, res, res, count > 0 ? 1.0 / (double)count : NAN, 0.0);
  }
  if (st != TD_OK) goto out;
  const td_tensor *in[1] = {logits};
  ce_node *node = (ce_node *)td__record(res, sizeof(ce_node), &ce_ops, in, 1, &st);
  if (st != TD_OK) goto out;
  if (node) {
    node->logits = td_tensor_ref(l2);
    node->target = td_tensor_ref(tg1);
    node->lse = td_tensor_ref(lse);
    node->n = n;
    node->c = c;
    node->in_ndim = logits->ndim;
    node->red = red;
    node->ignore_index = ignore_index;
    node->count = count;
    node->ldt = ldt;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(lc);
  td_tensor_unref(l2);
  td_tensor_unref(tgc);
  td_tensor_unref(tg1);
  td_tensor_unref(losses);
  td_tensor_unref(lse);
  td_tensor_unref(res);
  return st;
}

td_status td_tensor_cross_entropy(const td_tensor *logits, const td_tensor *target,
                                  td_reduction red, int64_t ignore_index, td_tensor **out) {
  if (!out) return td_set_error(TD_ERR_INVALID, "cross_entropy: NULL out");
  if (ce_fused_applies(logits)) return ce_fused(logits, target, red, ignore_index, out);
  TD__AUTOCAST(false, 1, (logits),
               td_tensor_cross_entropy(ac_t[0], target, red, ignore_index, out));
  int64_t n = 0, c = 0;
  TD_TRY(nll_check("cross_entropy", logits, target, red, &n, &c));
  td_tensor *lp;
  TD_TRY(td_tensor_log_softmax(logits, logits->ndim == 1 ? 0 : 1, &lp));
  td_status st = td_tensor_nll_loss(lp, target, red, ignore_index, out);
  td_tensor_unref(lp);
  return st;
}

td_status td_tensor_mse_loss(const td_tensor *a, const td_tensor *b, td_reduction red,
                             td_tensor **out) {
  if (!a || !b || !out) return td_set_error(TD_ERR_INVALID, "mse_loss: NULL argument");
  TD__AUTOCAST(false, 2, (a, b), td_tensor_mse_loss(ac_t[0], ac_t[1], red, out));
  if (red != TD_REDUCTION_MEAN && red != TD_REDUCTION_SUM && red != TD_REDUCTION_NONE)
    return td_set_error(TD_ERR_INVALID, "mse_loss: unknown reduction %d", (int)red);
  TD_TRY(td__check_float("mse_loss", a));
  TD_TRY(td__check_float("mse_loss", b));
  TD_TRY(td__check_same_dtype("mse_loss", a, b));
  TD_TRY(td__check_same_device("mse_loss", a, b));
  if (!td_tensor_same_shape(a, b)) {
    char sa[96], sb[96];
    return td_set_error(TD_ERR_SHAPE, "mse_loss: input %s and target %s must have the same shape",
                        td__shape_str(a->shape, a->ndim, sa, sizeof sa),
                        td__shape_str(b->shape, b->ndim, sb, sizeof sb));
  }
  td_tensor *d = NULL, *sq = NULL;
  td_status st = td_tensor_sub(a, b, &d);
  if (st == TD_OK) st = td_tensor_mul(d, d, &sq);
  if (st == TD_OK) {
    switch (red) {
      case TD_REDUCTION_NONE:
        *out = sq;
        sq = NULL;
        break;
      case TD_REDUCTION_SUM: st = td_tensor_sum_all(sq, out); break;
      default: st = td_tensor_mean_all(sq, out); break;
    }
  }
  td_tensor_unref(d);
  td_tensor_unref(sq);
  return st;
}
