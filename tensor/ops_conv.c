/* ops_conv.c - 2-d convolution and 2-d max pooling, forward and backward.
 *
 * conv2d lowers to GEMM: im2col turns each image [C, H, W] into col [K = C*kh*kw, L = OH*OW],
 * and y[n] [O, L] = w [O, K] @ col[n]. Images are processed in chunks whose col buffers together
 * stay under COL_BUDGET elements, with one batched GEMM per chunk (w broadcast with batch stride
 * 0). Backward: gcol[n] = w^T @ gy[n] (batched) then col2im into gx; gw = sum_n gy[n] @ col[n]^T
 * (col recomputed from the saved input, accumulated with beta = 1); gb = sum of gy over N and L.
 * Inputs may be [N, C, H, W] or unbatched [C, H, W] (as in PyTorch); groups = 1, dilation = 1.
 *
 * max_pool2d runs the backend kernel, which also writes the arg-max position of each window
 * (flat iy * W + ix in its plane); backward scatters the gradient through those positions.
 * No padding, floor mode.
 *
 * Every kernel goes through td__backend_of(x), so the same code drives CPU and CUDA.
 */
#include "tensor_impl.h"

/* Largest col buffer, in elements, before images are processed in smaller chunks. */
#define COL_BUDGET ((int64_t)1 << 22)

static char *elem_ptr(const td_tensor *t, int64_t i) {
  return (char *)td_tensor_data(t) + (size_t)i * td_dtype_size(t->dtype);
}

/* ---- conv2d ---- */

typedef struct conv_geom {
  int64_t n, c, h, w, o, kh, kw, oh, ow, k, l;
  int sh, sw, ph, pw;
} conv_geom;

typedef struct conv_node {
  td_node base;
  td_tensor *x; /* contiguous [N, C, H, W], no history */
  td_tensor *w; /* contiguous [O, C, kh, kw], no history */
  conv_geom g;
  bool batched;  /* the input was 4-d */
  int bias_edge; /* edge index of the bias, or -1 */
} conv_node;

static int64_t chunk_images(const conv_geom *g) {
  int64_t per = g->k * g->l, nb = per > 0 ? COL_BUDGET / per : g->n;
  if (nb < 1) nb = 1;
  if (nb > g->n) nb = g->n;
  return nb;
}

static td_status new_col(const td_tensor *like, const conv_geom *g, int64_t nb, td_tensor **out) {
  int64_t shape[3] = {nb, g->k, g->l};
  return td__tensor_new(shape, 3, like->dtype, td_tensor_device(like), out);
}

static td_status conv_forward(const td__backend *be, const conv_geom *g, const td_tensor *x,
                              const td_tensor *w, td_tensor *y) {
  if (g->n == 0) return TD_OK;
  td_dtype dt = x->dtype;
  int64_t nb = chunk_images(g), chw = g->c * g->h * g->w, kl = g->k * g->l, ol = g->o * g->l;
  td_tensor *col;
  TD_TRY(new_col(x, g, nb, &col));
  td_status st = TD_OK;
  for (int64_t n0 = 0; n0 < g->n && st == TD_OK; n0 += nb) {
    int64_t b = g->n - n0 < nb ? g->n - n0 : nb;
    for (int64_t i = 0; i < b && st == TD_OK; i++)
      st = be->im2col(dt, elem_ptr(x, (n0 + i) * chw), g->c, g->h, g->w, (int)g->kh, (int)g->kw,
                      g->sh, g->sw, g->ph, g->pw, elem_ptr(col, i * kl));
    if (st == TD_OK)
      st = be->gemm(dt, false, false, g->o, g->l, g->k, 1.0, td_tensor_data(w), 0,
                    td_tensor_data(col), kl, 0.0, elem_ptr(y, n0 * ol), ol, b);
  }
  td_tensor_unref(col);
  return st;
}

/* gx [N, C, H, W] = col2im(w^T @ gy[n]). */
static td_status conv_grad_input(const td__backend *be, const conv_geom *g, const td_tensor *w,
                                 const td_tensor *gy, td_tensor *gx) {
  TD_TRY(be->fill(gx, 0.0));
  if (g->n == 0) return TD_OK;
  td_dtype dt = gy->dtype;
  int64_t nb = chunk_images(g), chw = g->c * g->h * g->w, kl = g->k * g->l, ol = g->o * g->l;
  td_tensor *col;
  TD_TRY(new_col(gy, g, nb, &col));
  td_status st = TD_OK;
  for (int64_t n0 = 0; n0 < g->n && st == TD_OK; n0 += nb) {
    int64_t b = g->n - n0 < nb ? g->n - n0 : nb;
    st = be->gemm(dt, true, false, g->k, g->l, g->o, 1.0, td_tensor_data(w), 0,
                  elem_ptr(gy, n0 * ol), ol, 0.0, td_tensor_data(col), kl, b);
    for (int64_t i = 0; i < b && st == TD_OK; i++)
      st = be->col2im(dt, elem_ptr(col, i * kl), g->c, g->h, g->w, (int)g->kh, (int)g->kw, g->sh,
                      g->sw, g->ph, g->pw, elem_ptr(gx, (n0 + i) * chw));
  }
  td_tensor_unref(col);
  return st;
}

/* gw [O, K] = sum_n gy[n] [O, L] @ col[n]^T [L, K]. */
static td_status conv_grad_weight(const td__backend *be, const conv_geom *g, const td_tensor *x,
                                  const td_tensor *gy, td_tensor *gw) {
  if (g->n == 0) return be->fill(gw, 0.0);
  td_dtype dt = gy->dtype;
  int64_t nb = chunk_images(g), chw = g->c * g->h * g->w, kl = g->k * g->l, ol = g->o * g->l;
  td_tensor *col;
  TD_TRY(new_col(gy, g, nb, &col));
  td_status st = TD_OK;
  for (int64_t n0 = 0; n0 < g->n && st == TD_OK; n0 += nb) {
    int64_t b = g->n - n0 < nb ? g->n - n0 : nb;
    for (int64_t i = 0; i < b && st == TD_OK; i++)
      st = be->im2col(dt, elem_ptr(x, (n0 + i) * chw), g->c, g->h, g->w, (int)g->kh, (int)g->kw,
                      g->sh, g->sw, g->ph, g->pw, elem_ptr(col, i * kl));
    for (int64_t i = 0; i < b && st == TD_OK; i++)
      st = be->gemm(dt, false, true, g->o, g->k, g->l, 1.0, elem_ptr(gy, (n0 + i) * ol), 0,
                    elem_ptr(col, i * kl), 0, n0 + i == 0 ? 0.0 : 1.0, td_tensor_data(gw), 0, 1);
  }
  td_tensor_unref(col);
  return st;
}

/* gb [O] = sum over N and L of gy [N, O, L]. */
static td_status conv_grad_bias(const td__backend *be, const conv_geom *g, const td_tensor *gy,
                                td_tensor *gb) {
  if (g->n == 0) return be->fill(gb, 0.0);
  int64_t ol = g->o * g->l;
  td_tensor *tmp;
  TD_TRY(td__tensor_new(&ol, 1, gy->dtype, td_tensor_device(gy), &tmp));
  td_status st = be->reduce_sum(gy, 1, g->n, ol, tmp);
  if (st == TD_OK) st = be->reduce_sum(tmp, g->o, g->l, 1, gb);
  td_tensor_unref(tmp);
  return st;
}

static td_status conv_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  conv_node *n = (conv_node *)self;
  if (!n->x) return td_set_error(TD_ERR_STATE, "conv2d backward: saved tensors were released");
  const conv_geom *g = &n->g;
  const td__backend *be = td__backend_of(n->x);
  td_tensor *gy = NULL, *gx = NULL, *gw = NULL, *gb = NULL;
  int64_t xshape[4] = {g->n, g->c, g->h, g->w};
  td_status st = td__grad_prep(grad_out[0], n->x->dtype, &gy);
  if (st == TD_OK && td__node_needs_grad(self, 0)) {
    st = td__tensor_new(xshape, 4, gy->dtype, td_tensor_device(gy), &gx);
    if (st == TD_OK) st = conv_grad_input(be, g, n->w, gy, gx);
    if (st == TD_OK) st = td__plain_view(gx, n->batched ? xshape : xshape + 1, n->batched ? 4 : 3,
                                     &grad_in[0]);
  }
  if (st == TD_OK && td__node_needs_grad(self, 1)) {
    st = td__tensor_new_like(n->w, &gw);
    if (st == TD_OK) st = conv_grad_weight(be, g, n->x, gy, gw);
    if (st == TD_OK) {
      grad_in[1] = gw;
      gw = NULL;
    }
  }
  if (st == TD_OK && n->bias_edge >= 0 && td__node_needs_grad(self, n->bias_edge)) {
    st = td__tensor_new(&g->o, 1, gy->dtype, td_tensor_device(gy), &gb);
    if (st == TD_OK) st = conv_grad_bias(be, g, gy, gb);
    if (st == TD_OK) {
      grad_in[n->bias_edge] = gb;
      gb = NULL;
    }
  }
  td_tensor_unref(gy);
  td_tensor_unref(gx);
  td_tensor_unref(gw);
  td_tensor_unref(gb);
  return st;
}

static void conv_release(td_node *self) {
  conv_node *n = (conv_node *)self;
  td_tensor_unref(n->x);
  td_tensor_unref(n->w);
  n->x = n->w = NULL;
}

static const td__node_ops conv_ops = {
    .name = "Conv2dBackward",
    .backward = conv_backward,
    .release_saved = conv_release,
};

static td_status conv_check(const td_tensor *x, const td_tensor *w, const td_tensor *bias,
                            int sh, int sw, int ph, int pw, conv_geom *g) {
  if (!x || !w) return td_set_error(TD_ERR_INVALID, "conv2d: NULL input or weight");
  TD_TRY(td__check_float("conv2d", x));
  TD_TRY(td__check_same_dtype("conv2d", x, w));
  TD_TRY(td__check_same_device("conv2d", x, w));
  if (bias) {
    TD_TRY(td__check_same_dtype("conv2d", x, bias));
    TD_TRY(td__check_same_device("conv2d", x, bias));
  }
  char a[96], b[96];
  const char *xs = td__shape_str(x->shape, x->ndim, a, sizeof a);
  const char *ws = td__shape_str(w->shape, w->ndim, b, sizeof b);
  if ((x->ndim != 4 && x->ndim != 3) || w->ndim != 4)
    return td_set_error(TD_ERR_SHAPE,
                        "conv2d: expected input [N, C, H, W] or [C, H, W] and weight "
                        "[O, C, kh, kw], got input %s and weight %s", xs, ws);
  if (sh < 1 || sw < 1 || ph < 0 || pw < 0)
    return td_set_error(TD_ERR_INVALID, "conv2d: stride (%d, %d) must be >= 1 and padding "
                        "(%d, %d) >= 0", sh, sw, ph, pw);
  int off = x->ndim - 3;
  g->n = off ? x->shape[0] : 1;
  g->c = x->shape[off];
  g->h = x->shape[off + 1];
  g->w = x->shape[off + 2];
  g->o = w->shape[0];
  g->kh = w->shape[2];
  g->kw = w->shape[3];
  if (g->o < 1 || w->shape[1] < 1 || g->kh < 1 || g->kw < 1)
    return td_set_error(TD_ERR_SHAPE, "conv2d: weight %s has an empty dimension", ws);
  if (w->shape[1] != g->c)
    return td_set_error(TD_ERR_SHAPE, "conv2d: input %s has %lld channels but weight %s expects "
                        "%lld (groups = 1)", xs, (long long)g->c, ws, (long long)w->shape[1]);
  if (bias && (bias->ndim != 1 || bias->shape[0] != g->o)) {
    char c[96];
    return td_set_error(TD_ERR_SHAPE, "conv2d: bias %s must be [%lld] for weight %s",
                        td__shape_str(bias->shape, bias->ndim, c, sizeof c), (long long)g->o, ws);
  }
  if (g->h + 2 * ph < g->kh || g->w + 2 * pw < g->kw)
    return td_set_error(TD_ERR_SHAPE, "conv2d: kernel %lldx%lld is larger than the padded input "
                        "%lldx%lld (input %s, padding (%d, %d))", (long long)g->kh,
                        (long long)g->kw, (long long)(g->h + 2 * ph), (long long)(g->w + 2 * pw),
                        xs, ph, pw);
  g->sh = sh;
  g->sw = sw;
  g->ph = ph;
  g->pw = pw;
  g->oh = (g->h + 2 * ph - g->kh) / sh + 1;
  g->ow = (g->w + 2 * pw - g->kw) / sw + 1;
  g->k = g->c * g->kh * g->kw;
  g->l = g->oh * g->ow;
  return TD_OK;
}

td_status td_tensor_conv2d(const td_tensor *x, const td_tensor *w, const td_tensor *bias,
                           int stride_h, int stride_w, int pad_h, int pad_w, td_tensor **out) {
  if (!out) return td_set_error(TD_ERR_INVALID, "conv2d: NULL out");
  TD__AUTOCAST(true, 3, (x, w, bias),
               td_tensor_conv2d(ac_t[0], ac_t[1], ac_t[2], stride_h, stride_w, pad_h, pad_w, out));
  conv_geom g;
  TD_TRY(conv_check(x, w, bias, stride_h, stride_w, pad_h, pad_w, &g));
  const td__backend *be = td__backend_of(x);
  TD__NEED_KERNEL(be, im2col, "conv2d");
  TD__NEED_KERNEL(be, col2im, "conv2d");
  TD__NEED_KERNEL(be, gemm, "conv2d");
  td_tensor *xc = NULL, *x4 = NULL, *wc = NULL, *y = NULL, *res = NULL, *bx = NULL;
  int64_t xshape[4] = {g.n, g.c, g.h, g.w}, yshape[4] = {g.n, g.o, g.oh, g.ow};
  td_status st = td__contig(x, &xc);
  if (st == TD_OK) st = td__plain_view(xc, xshape, 4, &x4);
  if (st == TD_OK) st = td__contig(w, &wc);
  if (st == TD_OK) st = td__tensor_new(yshape, 4, x->dtype, td_tensor_device(x), &y);
  if (st == TD_OK) st = conv_forward(be, &g, x4, wc, y);
  if (st == TD_OK && bias && g.n > 0) {
    int64_t bstrides[4] = {0, bias->strides[0], 0, 0};
    st = td__tensor_view(bias, yshape, bstrides, 4, bias->offset, &bx);
    if (st == TD_OK) st = be->binary(TD__BIN_ADD, y, bx, y);
  }
  if (st != TD_OK) goto out;
  if (x->ndim == 4) {
    res = y;
    y = NULL;
  } else {
    st = td__plain_view(y, yshape + 1, 3, &res);
    if (st != TD_OK) goto out;
  }
  const td_tensor *in[3] = {x, w, bias};
  conv_node *n = (conv_node *)td__record(res, sizeof(conv_node), &conv_ops, in, bias ? 3 : 2, &st);
  if (st != TD_OK) goto out;
  if (n) {
    n->g = g;
    n->batched = x->ndim == 4;
    n->bias_edge = bias ? 2 : -1;
    n->x = td_tensor_ref(x4);
    st = td__plain_view(wc, wc->shape, 4, &n->w);
    if (st != TD_OK) goto out;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(xc);
  td_tensor_unref(x4);
  td_tensor_unref(wc);
  td_tensor_unref(y);
  td_tensor_unref(bx);
  td_tensor_unref(res);
  return st;
}

/* ---- max_pool2d ---- */

typedef struct pool_node {
  td_node base;
  td_tensor *idx; /* int64 [N, C, OH, OW]: arg-max position iy * W + ix in each plane */
  int64_t xshape[4];
  bool batched;
} pool_node;

static td_status pool_backward(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in) {
  pool_node *n = (pool_node *)self;
  if (!n->idx) return td_set_error(TD_ERR_STATE, "max_pool2d backward: saved tensors released");
  const td__backend *be = td__backend_of(n->idx);
  TD__NEED_KERNEL(be, max_pool2d_backward, "max_pool2d backward");
  td_tensor *gy = NULL, *gy4 = NULL, *gx = NULL;
  td_dtype dt = grad_out[0]->dtype;
  td_status st = td__grad_prep(grad_out[0], dt, &gy);
  if (st == TD_OK) st = td__plain_view(gy, n->idx->shape, 4, &gy4);
  if (st == TD_OK) st = td__tensor_new(n->xshape, 4, dt, td_tensor_device(gy), &gx);
  if (st == TD_OK) st = be->fill(gx, 0.0);
  if (st == TD_OK && td_tensor_numel(gy4) > 0) st = be->max_pool2d_backward(gy4, n->idx, gx);
  if (st == TD_OK)
    st = td__plain_view(gx, n->batched ? n->xshape : n->xshape + 1, n->batched ? 4 : 3, &grad_in[0]);
  td_tensor_unref(gy);
  td_tensor_unref(gy4);
  td_tensor_unref(gx);
  return st;
}

static void pool_release(td_node *self) {
  pool_node *n = (pool_node *)self;
  td_tensor_unref(n->idx);
  n->idx = NULL;
}

static const td__node_ops pool_ops = {
    .name = "MaxPool2DBackward",
    .backward = pool_backward,
    .release_saved = pool_release,
};

td_status td_tensor_max_pool2d(const td_tensor *x, int kh, int kw, int stride_h, int stride_w,
                               td_tensor **out) {
  if (!x || !out) return td_set_error(TD_ERR_INVALID, "max_pool2d: NULL argument");
  TD_TRY(td__check_float("max_pool2d", x));
  char a[96];
  const char *xs = td__shape_str(x->shape, x->ndim, a, sizeof a);
  if (x->ndim != 4 && x->ndim != 3)
    return td_set_error(TD_ERR_SHAPE, "max_pool2d: expected input [N, C, H, W] or [C, H, W], "
                        "got %s", xs);
  if (kh < 1 || kw < 1 || stride_h < 1 || stride_w < 1)
    return td_set_error(TD_ERR_INVALID, "max_pool2d: kernel (%d, %d) and stride (%d, %d) must "
                        "be >= 1", kh, kw, stride_h, stride_w);
  int off = x->ndim - 3;
  int64_t xshape[4] = {off ? x->shape[0] : 1, x->shape[off], x->shape[off + 1],
                       x->shape[off + 2]};
  if (xshape[2] < kh || xshape[3] < kw)
    return td_set_error(TD_ERR_SHAPE, "max_pool2d: kernel %dx%d is larger than input %s", kh, kw,
                        xs);
  const td__backend *be = td__backend_of(x);
  TD__NEED_KERNEL(be, max_pool2d, "max_pool2d");
  int64_t yshape[4] = {xshape[0], xshape[1], (xshape[2] - kh) / stride_h + 1,
                       (xshape[3] - kw) / stride_w + 1};
  td_tensor *xc = NULL, *x4 = NULL, *y = NULL, *idx = NULL, *res = NULL;
  td_status st = td__contig(x, &xc);
  if (st == TD_OK) st = td__plain_view(xc, xshape, 4, &x4);
  if (st == TD_OK) st = td__tensor_new(yshape, 4, x->dtype, td_tensor_device(x), &y);
  if (st == TD_OK) st = td__tensor_new(yshape, 4, TD_DTYPE_I64, td_tensor_device(x), &idx);
  if (st == TD_OK && td_tensor_numel(y) > 0)
    st = be->max_pool2d(x4, kh, kw, stride_h, stride_w, y, idx);
  if (st != TD_OK) goto out;
  if (x->ndim == 4) {
    res = y;
    y = NULL;
  } else {
    st = td__plain_view(y, yshape + 1, 3, &res);
    if (st != TD_OK) goto out;
  }
  const td_tensor *in[1] = {x};
  pool_node *n = (pool_node *)td__record(res, sizeof(pool_node), &pool_ops, in, 1, &st);
  if (st != TD_OK) goto out;
  if (n) {
    n->idx = idx;
    idx = NULL;
    for (int i = 0; i < 4; i++) n->xshape[i] = xshape[i];
    n->batched = x->ndim == 4;
  }
  *out = res;
  res = NULL;
out:
  td_tensor_unref(xc);
  td_tensor_unref(x4);
  td_tensor_unref(y);
  td_tensor_unref(idx);
  td_tensor_unref(res);
  return st;
}
