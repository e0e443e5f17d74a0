/* ops_norm.c - layer normalisation and dropout.
 *
 * layer_norm views x as contiguous [M, N] (N = product of the last normalized_ndim dims) and
 * runs the backend's layer_norm kernel, which also returns each row's mean and 1/std. The
 * backward node saves x, the weight and those statistics and runs layer_norm_backward for the
 * gradients that are needed. weight and bias are optional and independent, as in PyTorch.
 *
 * dropout draws its keep-mask on the CPU from the caller's td_generator (so a seed gives the same
 * mask on every device), moves it to x's device and multiplies: mask entries are 0 or 1/(1-p),
 * and the recorded multiplication supplies the backward (gradient = mask * upstream).
 */
#include <math.h>

#include "tensor_impl.h"

/* flat_contig returns a contiguous history-free view of t with shape [n] (or [m, n]). */
static td_status flat_contig(const td_tensor *t, const int64_t *shape, int ndim,
                             td_tensor **out) {
  td_tensor *c;
  TD_TRY(td__contig(t, &c));
  td_status st = td__plain_view(c, shape, ndim, out);
  td_tensor_unref(c);
  return st;
}

/* ---- layer_norm ---- */

typedef struct ln_node {
  td_node base;
  td_tensor *x;    /* [M, N] contiguous, no history */
  td_tensor *w;    /* [N] or NULL */
  td_tensor *mean; /* [M] */
  td_tensor *rstd; /* [M] */
  int64_t m, n;
  int ndim; /* x's shape; the parameters have its last pnd dims */
  int pnd;
  int64_t shape[TD_MAX_DIMS];
  int w_edge, b_edge; /* edge indices, -1 when absent */
} ln_node;

static td_status ln_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  ln_node *n = (ln_node *)self;
  if (!n->x) return td_set_error(TD_ERR_STATE, "layer_norm backward: saved tensors released");
  const td__backend *be = td__backend_of(n->x);
  TD__NEED_KERNEL(be, layer_norm_backward, "layer_norm backward");
  int64_t xshape[2] = {n->m, n->n};
  const int64_t *pshape = n->shape + n->ndim - n->pnd;
  bool need_x = td__node_needs_grad(self, 0);
  bool need_w = n->w_edge >= 0 && td__node_needs_grad(self, n->w_edge);
  bool need_b = n->b_edge >= 0 && td__node_needs_grad(self, n->b_edge);
  td_tensor *g = NULL, *gy = NULL, *gx = NULL, *gw = NULL, *gb = NULL;
  td_device dev = td_tensor_device(n->x);
  td_dtype dt = n->x->dtype;
  td_status st = td__grad_prep(grad_out[0], dt, &g);
  if (st == TD_OK) st = td__plain_view(g, xshape, 2, &gy);
  if (st == TD_OK && need_x) st = td__tensor_new(xshape, 2, dt, dev, &gx);
  if (st == TD_OK && need_w) st = td__tensor_new(&n->n, 1, dt, dev, &gw);
  if (st == TD_OK && need_b) st = td__tensor_new(&n->n, 1, dt, dev, &gb);
  if (st == TD_OK && (gx || gw || gb))
    st = be->layer_norm_backward(gy, n->x, n->w, n->mean, n->rstd, gx, gw, gb);
  if (st == TD_OK && need_x) st = td__plain_view(gx, n->shape, n->ndim, &grad_in[0]);
  if (st == TD_OK && need_w) st = td__plain_view(gw, pshape, n->pnd, &grad_in[n->w_edge]);
  if (st == TD_OK && need_b) st = td__plain_view(gb, pshape, n->pnd, &grad_in[n->b_edge]);
  td_tensor_unref(g);
  td_tensor_unref(gy);
  td_tensor_unref(gx);
  td_tensor_unref(gw);
  td_tensor_unref(gb);
  return st;
}

static void ln_release(td_node *self) {
  ln_node *n = (ln_node *)self;
  td_tensor_unref(n->x);
  td_tensor_unref(n->w);
  td_tensor_unref(n->mean);
  td_tensor_unref(n->rstd);
  n->x = n->w = n->mean = n->rstd = NULL;
}

static const td__node_ops ln_ops = {
    .name = "LayerNormBackward",
    .backward = ln_backward,
    .release_saved = ln_release,
};

/* ln_check_param verifies that p (weight or bias) has the normalised shape of x. */
static td_status ln_check_param(const char *what, const td_tensor *x, int pnd,
                                const td_tensor *p) {
  TD_TRY(td__check_same_dtype("layer_norm", x, p));
  TD_TRY(td__check_same_device("layer_norm", x, p));
  bool ok = p->ndim == pnd;
  for (int i = 0; ok && i < pnd; i++) ok = p->shape[i] == x->shape[x->ndim - pnd + i];
  if (!ok) {
    char a[96], b[96];
    return td_set_error(TD_ERR_SHAPE, "layer_norm: %s %s must match the last %d dims of input %s",
                        what, td__shape_str(p->shape, p->ndim, a, sizeof a), pnd,
                        td__shape_str(x->shape, x->ndim, b, sizeof b));
  }
  return TD_OK;
}

td_status td_tensor_layer_norm(const td_tensor *x, int normalized_ndim, const td_tensor *weight,
                               const td_tensor *bias, double eps, td_tensor **out) {
  if (!x || !out) return td_set_error(TD_ERR_INVALID, "layer_norm: NULL argument");
  TD__AUTOCAST(false, 3, (x, weight, bias),
               td_tensor_layer_norm(ac_t[0], normalized_ndim, ac_t[1], ac_t[2], eps, out));
  TD_TRY(td__check_float("layer_norm", x));
  if (normalized_ndim < 1 || normalized_ndim > x->ndim) {
    char a[96];
    return td_set_error(TD_ERR_INVALID, "layer_norm: normalized_ndim %d must be in [1, %d] for "
                        "input %s", normalized_ndim, x->ndim,
                        td__shape_str(x->shape, x->ndim, a, sizeof a));
  }
  int pnd = normalized_ndim;
  if (weight) TD_TRY(ln_check_param("weight", x, pnd, weight));
  if (bias) TD_TRY(ln_check_param("bias", x, pnd, bias));
  const td__backend *be = td__backend_of(x);
  TD__NEED_KERNEL(be, layer_norm, "layer_norm");
  int64_t m = 1, n = 1;
  for (int i = 0; i < x->ndim; i++) *(i < x->ndim - pnd ? &m : &n) *= x->shape[i];
  int64_t xshape[2] = {m, n};
  td_device dev = td_tensor_device(x);
  td_tensor *x2 = NULL, *w1 = NULL, *b1 = NULL, *y = NULL, *mean = NULL, *rstd = NULL;
  td_tensor *res = NULL;
  td_status st = flat_contig(x, xshape, 2, &x2);
  if (st == TD_OK && weight) st = flat_contig(weight, &n, 1, &w1);
  if (st == TD_OK && bias) st = flat_contig(bias, &n, 1, &b1);
  if (st == TD_OK) st = td__tensor_new(xshape, 2, x->dtype, dev, &y);
  if (st == TD_OK) st = td__tensor_new(&m, 1, x->dtype, dev, &mean);
  if (st == TD_OK) st = td__tensor_new(&m, 1, x->dtype, dev, &rstd);
  if (st == TD_OK && m > 0) {
    if (n > 0) {
      st = be->layer_norm(x2, w1, b1, eps, y, mean, rstd);
    } else {
      st = be->fill(mean, 0.0);
      if (st == TD_OK) st = be->fill(rstd, 1.0 / sqrt(eps));
    }
  }
  if (st == TD_OK) st = td__plain_view(y, x->shape, x->ndim, &res);
  if (st != TD_OK) goto out;
  const td_tensor *in[3];
  int nin = 0, w_edge = -1, b_edge = -1;
  in[nin++] = x;
  if (weight) {
    w_edge = nin;
    in[nin++] = weight;
  }
  if (bias) {
    b_edge = nin;
    in[nin++] = bias;
  }
  ln_node *node = (ln_node *)td__record(res, sizeof(ln_node), &ln_ops, in, nin, &st);
  if (st != TD_OK) goto out;
  if (node) {
    node->x = x2;
    node->w = w1;
    node->mean = mean;
    node->rstd = rstd;
    x2 = w1 = mean = rstd = NULL;
    node->m = m;
    node->n = n;
    node->ndim = x->ndim;
    node->pnd = pnd;
    for (int i = 0; i < x->ndim; i++) node->shape[i] = x->shape[i];
    node->w_edge = w_edge;
    node->b_edge = b_edge;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(x2);
  td_tensor_unref(w1);
  td_tensor_unref(b1);
  td_tensor_unref(y);
  td_tensor_unref(mean);
  td_tensor_unref(rstd);
  td_tensor_unref(res);
  return st;
}

/* ---- dropout ---- */

/* make_mask fills a new CPU tensor of x's shape and dtype with 0 (probability p) or 1/(1-p). */
static td_status make_mask(const td_tensor *x, double p, td_generator *g, td_tensor **out) {
  td_tensor *mask;
  TD_TRY(td__tensor_new(x->shape, x->ndim, x->dtype, td_device_cpu(), &mask));
  int64_t n = td_tensor_numel(mask);
  double keep = p >= 1.0 ? 0.0 : 1.0 / (1.0 - p);
  if (x->dtype == TD_DTYPE_F32) {
    float *d = td_tensor_data(mask), kf = (float)keep;
    for (int64_t i = 0; i < n; i++) d[i] = p >= 1.0 || td_generator_next_double(g) < p ? 0.0f : kf;
  } else if (x->dtype == TD_DTYPE_F64) {
    double *d = td_tensor_data(mask);
    for (int64_t i = 0; i < n; i++) d[i] = p >= 1.0 || td_generator_next_double(g) < p ? 0.0 : keep;
  } else { /* the 16-bit floats: the same draws, the scale rounded to the dtype */
    void *d = td_tensor_data(mask);
    for (int64_t i = 0; i < n; i++)
      td__store(d, x->dtype, i, p >= 1.0 || td_generator_next_double(g) < p ? 0.0 : keep);
  }
  *out = mask;
  return TD_OK;
}

td_status td_tensor_dropout(const td_tensor *x, double p, bool train, td_generator *g,
                            td_tensor **out) {
  if (!x || !out) return td_set_error(TD_ERR_INVALID, "dropout: NULL argument");
  TD_TRY(td__check_float("dropout", x));
  if (!(p >= 0.0 && p <= 1.0))
    return td_set_error(TD_ERR_INVALID, "dropout: probability p = %g is not in [0, 1]", p);
  if (!train || p == 0.0) {
    *out = td_tensor_ref((td_tensor *)x);
    return TD_OK;
  }
  if (!g && p < 1.0) return td_set_error(TD_ERR_INVALID, "dropout: NULL generator in training");
  td_tensor *mask = NULL, *dmask = NULL;
  if (g) td__rng_note(g); /* a checkpointed region replays the draw */
  td_status st = make_mask(x, p, g, &mask);
  if (st == TD_OK) st = td_tensor_to(mask, td_tensor_device(x), &dmask);
  if (st == TD_OK) st = td_tensor_mul(x, dmask, out);
  td_tensor_unref(mask);
  td_tensor_unref(dmask);
  return st;
}
