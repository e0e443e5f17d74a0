/* ops_matmul.c - torch.matmul semantics on top of one differentiable batched GEMM (bmm), and the
 * fused linear layer (F.linear).
 *
 * bmm: a [B, M, K] @ b [B, K, N] -> [B, M, N] on contiguous operands, with a backward made of two
 * more GEMMs (ga = g @ b^T, gb = a^T @ g). Everything else - 1-d promotion, flattening the
 * leading dims of `x @ W` into one GEMM, broadcasting batch dims - is composed from views that
 * carry their own backward, so matmul's gradient needs no extra code.
 *
 * linear: y = x W^T + b as one GEMM over x's leading dims, reading W [out, in] in place, with the
 * bias written into the output rows first and accumulated by the GEMM (beta = 1, as PyTorch's
 * addmm): no separate broadcast add, and no zeroing pass inside BLAS. Backward: gx = gy W,
 * gW = gy^T x (in W's layout), gb = the column sums of gy.
 */
#include <string.h>

#include "tensor_impl.h"

typedef struct {
  td_node base;
  td_tensor *a, *b; /* contiguous [B, M, K], [B, K, N] */
} bmm_node;

static void bmm_release(td_node *self) {
  bmm_node *n = (bmm_node *)self;
  td_tensor_unref(n->a);
  td_tensor_unref(n->b);
  n->a = n->b = NULL;
}

static td_status bmm_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  bmm_node *n = (bmm_node *)self;
  td_tensor *g = NULL;
  TD_TRY(td_tensor_contiguous(gout[0], &g));
  int64_t B = n->a->shape[0], M = n->a->shape[1], K = n->a->shape[2], N = n->b->shape[2];
  const td__backend *be = td__backend_of(g);
  td_status st = TD_OK;
  if (td__node_needs_grad(self, 0)) {
    st = td__tensor_new_like(n->a, &gin[0]);
    if (st == TD_OK)
      st = be->gemm(g->dtype, false, true, M, K, N, 1.0, td_tensor_data(g), M * N,
                    td_tensor_data(n->b), K * N, 0.0, td_tensor_data(gin[0]), M * K, B);
  }
  if (st == TD_OK && td__node_needs_grad(self, 1)) {
    st = td__tensor_new_like(n->b, &gin[1]);
    if (st == TD_OK)
      st = be->gemm(g->dtype, true, false, K, N, M, 1.0, td_tensor_data(n->a), M * K,
                    td_tensor_data(g), M * N, 0.0, td_tensor_data(gin[1]), K * N, B);
  }
  td_tensor_unref(g);
  return st;
}
static const td__node_ops bmm_ops = {"BmmBackward", bmm_backward, bmm_release, NULL};

/* a [B, M, K], b [B, K, N], any strides. */
static td_status bmm(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  td_tensor *ac = NULL, *bc = NULL, *r = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_contiguous(a, &ac);
  if (st == TD_OK) st = td_tensor_contiguous(b, &bc);
  td_autograd_set_enabled(prev);
  int64_t B = a->shape[0], M = a->shape[1], K = a->shape[2], N = b->shape[2];
  int64_t shape[3] = {B, M, N};
  if (st == TD_OK) st = td__tensor_new(shape, 3, a->dtype, a->storage->device, &r);
  if (st == TD_OK)
    st = td__backend_of(a)->gemm(a->dtype, false, false, M, N, K, 1.0, td_tensor_data(ac), M * K,
                                 td_tensor_data(bc), K * N, 0.0, td_tensor_data(r), M * N, B);
  if (st == TD_OK && td__needs_grad2(a, b)) {
    const td_tensor *ins[2] = {a, b};
    bmm_node *n = (bmm_node *)td__record(r, sizeof(bmm_node), &bmm_ops, ins, 2, &st);
    if (n) {
      st = td_tensor_detach(ac, &n->a);
      if (st == TD_OK) st = td_tensor_detach(bc, &n->b);
    }
  }
  td_tensor_unref(ac);
  td_tensor_unref(bc);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

/* ---- mm: 2-D GEMM that reads row-major or transposed (column-major) operands in place ---- */

/* How GEMM can read a 2-D view t: row-major contiguous (trans false) or the transpose of a
 * row-major contiguous matrix (trans true). Returns false for other layouts. */
static bool gemm_layout(const td_tensor *t, bool *trans) {
  if (t->ndim != 2) return false;
  int64_t r = t->shape[0], c = t->shape[1];
  if ((c == 1 || t->strides[1] == 1) && (r == 1 || t->strides[0] == c)) {
    *trans = false;
    return true;
  }
  if ((r == 1 || t->strides[0] == 1) && (c == 1 || t->strides[1] == r)) {
    *trans = true;
    return true;
  }
  return false;
}

typedef struct {
  td_node base;
  td_tensor *a, *b; /* detached views as given to forward */
  bool ta, tb;      /* their layouts */
} mm_node;

static void mm_release(td_node *self) {
  mm_node *n = (mm_node *)self;
  td_tensor_unref(n->a);
  td_tensor_unref(n->b);
  n->a = n->b = NULL;
}

/* A [r, c] result computed in transposed layout: returns the [c, r]-shaped... view helper. */
static td_status transposed_view(td_tensor *t, td_tensor **out) {
  int64_t shape[2] = {t->shape[1], t->shape[0]}, strides[2] = {1, t->shape[1]};
  return td__tensor_view(t, shape, strides, 2, t->offset, out);
}

static td_status mm_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  mm_node *n = (mm_node *)self;
  td_tensor *g = NULL;
  TD_TRY(td_tensor_contiguous(gout[0], &g));
  int64_t M = n->a->shape[0], K = n->a->shape[1], N = n->b->shape[1];
  const td__backend *be = td__backend_of(g);
  td_dtype dt = g->dtype;
  const void *ad = td_tensor_data(n->a), *bd = td_tensor_data(n->b), *gd = td_tensor_data(g);
  td_status st = TD_OK;
  td_tensor *tmp = NULL;
  if (td__node_needs_grad(self, 0)) {
    if (!n->ta) { /* ga [M,K] = g @ b^T */
      int64_t sh[2] = {M, K};
      st = td__tensor_new(sh, 2, dt, g->storage->device, &gin[0]);
      if (st == TD_OK)
        st = be->gemm(dt, false, !n->tb, M, K, N, 1.0, gd, 0, bd, 0, 0.0, td_tensor_data(gin[0]),
                      0, 1);
    } else { /* a is stored transposed: ga^T [K,M] = b @ g^T, returned as a transposed view */
      int64_t sh[2] = {K, M};
      st = td__tensor_new(sh, 2, dt, g->storage->device, &tmp);
      if (st == TD_OK)
        st = be->gemm(dt, n->tb, true, K, M, N, 1.0, bd, 0, gd, 0, 0.0, td_tensor_data(tmp), 0, 1);
      if (st == TD_OK) st = transposed_view(tmp, &gin[0]);
      td_tensor_unref(tmp);
      tmp = NULL;
    }
  }
  if (st == TD_OK && td__node_needs_grad(self, 1)) {
    if (!n->tb) { /* gb [K,N] = a^T @ g */
      int64_t sh[2] = {K, N};
      st = td__tensor_new(sh, 2, dt, g->storage->device, &gin[1]);
      if (st == TD_OK)
        st = be->gemm(dt, !n->ta, false, K, N, M, 1.0, ad, 0, gd, 0, 0.0, td_tensor_data(gin[1]),
                      0, 1);
    } else { /* b is stored transposed (x @ W^T): gb^T [N,K] = g^T @ a, in W's own layout */
      int64_t sh[2] = {N, K};
      st = td__tensor_new(sh, 2, dt, g->storage->device, &tmp);
      if (st == TD_OK)
        st = be->gemm(dt, true, n->ta, N, K, M, 1.0, gd, 0, ad, 0, 0.0, td_tensor_data(tmp), 0, 1);
      if (st == TD_OK) st = transposed_view(tmp, &gin[1]);
      td_tensor_unref(tmp);
    }
  }
  td_tensor_unref(g);
  return st;
}
static const td__node_ops mm_ops = {"MmBackward", mm_backward, mm_release, NULL};

/* a [M, K] @ b [K, N], both 2-D. */
static td_status mm(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  td_tensor *ac = NULL, *bc = NULL, *r = NULL;
  bool ta = false, tb = false;
  td_status st = TD_OK;
  bool prev = td_autograd_set_enabled(false);
  if (gemm_layout(a, &ta)) st = td__tensor_view(a, a->shape, a->strides, 2, a->offset, &ac);
  else st = td_tensor_contiguous(a, &ac);
  if (st == TD_OK) {
    if (gemm_layout(b, &tb)) st = td__tensor_view(b, b->shape, b->strides, 2, b->offset, &bc);
    else st = td_tensor_contiguous(b, &bc);
  }
  td_autograd_set_enabled(prev);
  int64_t M = a->shape[0], K = a->shape[1], N = b->shape[1];
  int64_t shape[2] = {M, N};
  if (st == TD_OK) st = td__tensor_new(shape, 2, a->dtype, a->storage->device, &r);
  if (st == TD_OK)
    st = td__backend_of(a)->gemm(a->dtype, ta, tb, M, N, K, 1.0, td_tensor_data(ac), 0,
                                 td_tensor_data(bc), 0, 0.0, td_tensor_data(r), 0, 1);
  if (st == TD_OK && td__needs_grad2(a, b)) {
    const td_tensor *ins[2] = {a, b};
    mm_node *n = (mm_node *)td__record(r, sizeof(mm_node), &mm_ops, ins, 2, &st);
    if (n) {
      n->a = td_tensor_ref(ac);
      n->b = td_tensor_ref(bc);
      n->ta = ta;
      n->tb = tb;
    }
  }
  td_tensor_unref(ac);
  td_tensor_unref(bc);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

/* Reshape helper that releases its input on the way (for chains of views). */
static td_status reshape_owned(td_tensor *t, const int64_t *shape, int nd, td_tensor **out) {
  td_status st = td_tensor_reshape(t, shape, nd, out);
  td_tensor_unref(t);
  return st;
}

td_status td_tensor_matmul(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  TD_CHECK_ARG(a && b && out, "matmul: NULL argument");
  TD__AUTOCAST(true, 2, (a, b), td_tensor_matmul(ac_t[0], ac_t[1], out));
  TD_TRY(td__check_same_device("matmul", a, b));
  TD_TRY(td__check_same_dtype("matmul", a, b));
  TD_TRY(td__check_float("matmul", a));
  if (a->ndim == 0 || b->ndim == 0)
    return td_set_error(TD_ERR_SHAPE, "matmul: both arguments need at least 1 dimension");
  int64_t K = a->shape[a->ndim - 1];
  int64_t Kb = b->ndim == 1 ? b->shape[0] : b->shape[b->ndim - 2];
  if (K != Kb) {
    char sa[128], sb[128];
    return td_set_error(TD_ERR_SHAPE, "matmul: %s @ %s: inner dimensions %lld and %lld differ",
                        td_tensor_shape_str(a, sa, sizeof sa), td_tensor_shape_str(b, sb, sizeof sb),
                        (long long)K, (long long)Kb);
  }
  td_tensor *a3 = NULL, *b3 = NULL, *r = NULL;
  td_status st = TD_OK;
  int64_t oshape[TD_MAX_DIMS];
  int on = 0;

  if (b->ndim <= 2) {
    /* a [..., M, K] (or [K]) @ b [K, N] (or [K]): one GEMM over the flattened leading dims, reading
     * a transposed b (x @ W^T) in place. */
    int64_t N = b->ndim == 1 ? 1 : b->shape[1];
    int64_t rows = a->ndim == 1 ? 1 : td__shape_numel(a->shape, a->ndim - 1);
    int64_t s2a[2] = {rows, K}, s2b[2] = {K, N};
    if (a->ndim == 2) a3 = td_tensor_ref((td_tensor *)a);
    else st = td_tensor_reshape(a, s2a, 2, &a3);
    if (st == TD_OK) {
      if (b->ndim == 2) b3 = td_tensor_ref((td_tensor *)b);
      else st = td_tensor_reshape(b, s2b, 2, &b3);
    }
    for (int i = 0; i < a->ndim - 1; i++) oshape[on++] = a->shape[i];
    if (b->ndim == 2) oshape[on++] = N;
    if (st == TD_OK) st = mm(a3, b3, &r);
    td_tensor_unref(a3);
    td_tensor_unref(b3);
    if (st != TD_OK) return st;
    if (on == 2 && a->ndim == 2) {
      *out = r;
      return TD_OK;
    }
    return reshape_owned(r, oshape, on, out);
  } else {
    /* batched: broadcast the batch dims, then [B, M, K] @ [B, K, N] */
    int an = a->ndim == 1 ? 2 : a->ndim;
    int64_t ash[TD_MAX_DIMS], bsh[TD_MAX_DIMS];
    if (a->ndim == 1) {
      ash[0] = 1;
      ash[1] = K;
    } else {
      memcpy(ash, a->shape, (size_t)a->ndim * sizeof(int64_t));
    }
    memcpy(bsh, b->shape, (size_t)b->ndim * sizeof(int64_t));
    int64_t M = ash[an - 2], N = bsh[b->ndim - 1];
    int64_t batch[TD_MAX_DIMS];
    int bn;
    st = td__broadcast_shape("matmul", ash, an - 2, bsh, b->ndim - 2, batch, &bn);
    if (st != TD_OK) return st;
    if (bn + 2 > TD_MAX_DIMS) return td_set_error(TD_ERR_SHAPE, "matmul: too many dims");
    int64_t B = td__shape_numel(batch, bn);
    int64_t ea[TD_MAX_DIMS], eb[TD_MAX_DIMS];
    memcpy(ea, batch, (size_t)bn * sizeof(int64_t));
    memcpy(eb, batch, (size_t)bn * sizeof(int64_t));
    ea[bn] = M;
    ea[bn + 1] = K;
    eb[bn] = K;
    eb[bn + 1] = N;
    td_tensor *av = NULL, *ae = NULL, *be = NULL;
    int64_t s3a[3] = {B, M, K}, s3b[3] = {B, K, N};
    st = td_tensor_reshape(a, ash, an, &av);
    if (st == TD_OK) st = td_tensor_expand(av, ea, bn + 2, &ae);
    if (st == TD_OK) st = td_tensor_expand(b, eb, bn + 2, &be);
    td_tensor_unref(av);
    if (st == TD_OK) {
      st = reshape_owned(ae, s3a, 3, &a3);
      ae = NULL;
    }
    if (st == TD_OK) {
      st = reshape_owned(be, s3b, 3, &b3);
      be = NULL;
    }
    td_tensor_unref(ae);
    td_tensor_unref(be);
    memcpy(oshape, batch, (size_t)bn * sizeof(int64_t));
    on = bn;
    if (a->ndim > 1) oshape[on++] = M;
    oshape[on++] = N;
  }
  if (st == TD_OK) st = bmm(a3, b3, &r);
  td_tensor_unref(a3);
  td_tensor_unref(b3);
  if (st != TD_OK) return st;
  return reshape_owned(r, oshape, on, out);
}

/* ---- linear ---- */

typedef struct {
  td_node base;
  td_tensor *x, *w; /* x as [M, K] (contiguous), w [N, K] as given (row-major or transposed) */
  bool tw;          /* w is stored row-major [N, K] (true) or as the transpose of [K, N] */
  int ndim;         /* x's shape, for gx */
  int64_t shape[TD_MAX_DIMS];
} linear_node;

static void linear_release(td_node *self) {
  linear_node *n = (linear_node *)self;
  td_tensor_unref(n->x);
  td_tensor_unref(n->w);
  n->x = n->w = NULL;
}

static td_status linear_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  linear_node *n = (linear_node *)self;
  if (!n->x) return td_set_error(TD_ERR_STATE, "linear backward: saved tensors released");
  int64_t M = n->x->shape[0], K = n->x->shape[1], N = n->w->shape[0];
  int64_t g2s[2] = {M, N};
  td_tensor *gc = NULL, *g = NULL, *tmp = NULL;
  td_status st = td__grad_prep(gout[0], n->x->dtype, &gc);
  if (st == TD_OK) st = td__plain_view(gc, g2s, 2, &g);
  td_tensor_unref(gc);
  if (st != TD_OK) return st;
  const td__backend *be = td__backend_of(g);
  td_dtype dt = g->dtype;
  td_device dev = td_tensor_device(g);
  const void *gd = td_tensor_data(g), *xd = td_tensor_data(n->x), *wd = td_tensor_data(n->w);
  if (td__node_needs_grad(self, 0)) { /* gx [M, K] = g @ W */
    st = td__tensor_new(n->shape, n->ndim, dt, dev, &gin[0]);
    if (st == TD_OK)
      st = be->gemm(dt, false, !n->tw, M, K, N, 1.0, gd, 0, wd, 0, 0.0, td_tensor_data(gin[0]),
                    0, 1);
  }
  if (st == TD_OK && td__node_needs_grad(self, 1)) {
    if (n->tw) { /* gW [N, K] = g^T @ x, W's own layout */
      int64_t sh[2] = {N, K};
      st = td__tensor_new(sh, 2, dt, dev, &gin[1]);
      if (st == TD_OK)
        st = be->gemm(dt, true, false, N, K, M, 1.0, gd, 0, xd, 0, 0.0, td_tensor_data(gin[1]),
                      0, 1);
    } else { /* W is the transpose of a [K, N] matrix: gW^T [K, N] = x^T @ g, as that view */
      int64_t sh[2] = {K, N};
      st = td__tensor_new(sh, 2, dt, dev, &tmp);
      if (st == TD_OK)
        st = be->gemm(dt, true, false, K, N, M, 1.0, xd, 0, gd, 0, 0.0, td_tensor_data(tmp), 0, 1);
      if (st == TD_OK) st = transposed_view(tmp, &gin[1]);
      td_tensor_unref(tmp);
    }
  }
  if (st == TD_OK && self->n_inputs > 2 && td__node_needs_grad(self, 2)) { /* gb = column sums */
    st = td__tensor_new(&N, 1, dt, dev, &gin[2]);
    if (st == TD_OK) st = be->reduce_sum(g, 1, M, N, gin[2]);
  }
  td_tensor_unref(g);
  return st;
}
static const td__node_ops linear_ops = {"LinearBackward", linear_backward, linear_release, NULL};

/* linear_check validates the operands of td_tensor_linear. */
static td_status linear_check(const td_tensor *x, const td_tensor *w, const td_tensor *b) {
  TD_TRY(td__check_float("linear", x));
  TD_TRY(td__check_same_dtype("linear", x, w));
  TD_TRY(td__check_same_device("linear", x, w));
  if (b) {
    TD_TRY(td__check_same_dtype("linear", x, b));
    TD_TRY(td__check_same_device("linear", x, b));
  }
  char a[96], c[96], d[96];
  if (x->ndim < 1 || w->ndim != 2 || x->shape[x->ndim - 1] != w->shape[1] ||
      (b && (b->ndim != 1 || b->shape[0] != w->shape[0])))
    return td_set_error(TD_ERR_SHAPE, "linear: x %s, weight %s, bias %s: expected x [..., in], "
                        "weight [out, in], bias [out]", td_tensor_shape_str(x, a, sizeof a),
                        td_tensor_shape_str(w, c, sizeof c),
                        b ? td_tensor_shape_str(b, d, sizeof d) : "none");
  return TD_OK;
}

td_status td_tensor_linear(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                           td_tensor **out) {
  TD_CHECK_ARG(x && w && out, "linear: NULL argument");
  TD__AUTOCAST(true, 3, (x, w, b), td_tensor_linear(ac_t[0], ac_t[1], ac_t[2], out));
  TD_TRY(linear_check(x, w, b));
  int64_t K = w->shape[1], N = w->shape[0], M = td_tensor_numel(x) / (K ? K : 1);
  if (K == 0) M = x->ndim == 1 ? 1 : td__shape_numel(x->shape, x->ndim - 1);
  int64_t s2[2] = {M, K}, os[TD_MAX_DIMS], o2[2] = {M, N};
  int on = 0;
  for (int i = 0; i < x->ndim - 1; i++) os[on++] = x->shape[i];
  os[on++] = N;
  td_tensor *xc = NULL, *x2 = NULL, *wv = NULL, *y = NULL, *res = NULL;
  const td__backend *be = td__backend_of(x);
  bool tw = true;
  td_status st = td__contig(x, &xc);
  if (st == TD_OK) st = td__plain_view(xc, s2, 2, &x2);
  /* W read in place when row-major [N, K] (x W^T: transposed operand) or when it is the
   * transpose of a row-major [K, N] (plain operand); other layouts are copied */
  if (st == TD_OK) {
    bool wt;
    if (gemm_layout(w, &wt)) {
      tw = !wt;
      st = td__tensor_view(w, w->shape, w->strides, 2, w->offset, &wv);
    } else {
      st = td__contig(w, &wv);
    }
  }
  if (st == TD_OK) st = td__tensor_new(o2, 2, x->dtype, x->storage->device, &y);
  double beta = 0.0;
  bool done = false;
  /* the bias in the GEMM itself where the backend can (CUDA's 16-bit GEMMs) */
  if (st == TD_OK && b && M > 0 && N > 0 && K > 0 && be->gemm_bias && b->dtype == x->dtype &&
      b->strides[0] == 1) {
    td_status bs = be->gemm_bias(x->dtype, false, tw, M, N, K, td_tensor_data(x2),
                                 td_tensor_data(wv), td_tensor_data(b), td_tensor_data(y));
    if (bs == TD_OK) done = true;
    else if (bs != TD_ERR_UNSUPPORTED) st = bs;
  }
  if (st == TD_OK && !done && b && M > 0 && N > 0) { /* y rows = b (a broadcast view), then y +=
                                                        x W^T */
    int64_t es[2] = {M, N}, est[2] = {0, b->strides[0]};
    td_tensor *bb = NULL;
    st = td__tensor_view(b, es, est, 2, b->offset, &bb);
    if (st == TD_OK) st = be->copy(y, bb);
    td_tensor_unref(bb);
    beta = 1.0;
  }
  if (st == TD_OK && !done)
    st = be->gemm(x->dtype, false, tw, M, N, K, 1.0, td_tensor_data(x2), 0, td_tensor_data(wv), 0,
                  beta, td_tensor_data(y), 0, 1);
  if (st == TD_OK) st = td__plain_view(y, os, on, &res);
  if (st == TD_OK && (td__needs_grad(x) || td__needs_grad(w) || (b && td__needs_grad(b)))) {
    const td_tensor *ins[3] = {x, w, b};
    linear_node *n =
        (linear_node *)td__record(res, sizeof(linear_node), &linear_ops, ins, b ? 3 : 2, &st);
    if (n) {
      n->x = td_tensor_ref(x2);
      n->w = td_tensor_ref(wv);
      n->tw = tw;
      n->ndim = x->ndim;
      memcpy(n->shape, x->shape, sizeof n->shape);
    }
  }
  td_tensor_unref(xc);
  td_tensor_unref(x2);
  td_tensor_unref(wv);
  td_tensor_unref(y);
  if (st != TD_OK) {
    td_tensor_unref(res);
    return st;
  }
  *out = res;
  return TD_OK;
}
