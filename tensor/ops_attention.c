/* ops_attention.c - fused scaled-dot-product attention with an optional built-in causal mask.
 *
 * q [..., L, E], k [..., S, E], v [..., S, Ev] -> y [..., L, Ev], the batch dims equal (no
 * broadcasting). The op never copies a strided head: any operand whose last dim is contiguous is
 * handed to the kernel as it is, described by one element offset per batch entry (computed here
 * by walking the batch dims) and a row stride. So q, k, v may be the [B, H, T, hd] transposed
 * views of one [B, T, 3C] projection, as in nanoGPT.
 *
 * Layouts of the results follow their model operand (PyTorch's "preserve format"): y is dense in
 * q's dim order, and gq / gk / gv in q's / k's / v's. For heads taken from a [B, T, C] tensor
 * ([B, H, T, hd] with strides of [B, T, H, hd]), y's memory is [B, T, H, hd], so the usual
 * transpose(1, 2) + reshape to [B, T, C] afterwards is a view, not a copy.
 *
 * Backward saves the operands (detached views), the softmax probabilities [nb, L, S] and the
 * geometry; it recomputes the per-operand offsets. A backend with the flash-attention entries
 * (attention_lse, CUDA) keeps each query row's log-sum-exp [nb, L] (float32; float64 for float64
 * operands) instead of the probabilities, and the output y (a detached view of the op's result:
 * no copy, no cycle), from which its backward recomputes what it needs: O(L) memory per problem
 * instead of O(L S).
 */
#include <math.h>
#include <string.h>

#include "tensor_impl.h"

/* row_ready returns t (new reference) when its last dim is contiguous, else a contiguous copy. */
static td_status row_ready(const td_tensor *t, td_tensor **out) {
  int nd = t->ndim;
  if (t->shape[nd - 1] <= 1 || t->strides[nd - 1] == 1) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return td__contig(t, out);
}

/* batch_offsets fills off[0..nb) with the element offset of every batch entry of t (its dims
 * before the last two, row-major order of the batch index). */
static void batch_offsets(const td_tensor *t, int64_t nb, int64_t *off) {
  int bd = t->ndim - 2;
  int64_t idx[TD_MAX_DIMS] = {0}, cur = 0;
  for (int64_t b = 0; b < nb; b++) {
    off[b] = cur;
    for (int d = bd - 1; d >= 0; d--) {
      cur += t->strides[d];
      if (++idx[d] < t->shape[d]) break;
      cur -= t->strides[d] * t->shape[d];
      idx[d] = 0;
    }
  }
}

/* new_like_layout allocates a dense tensor of shape whose dims are laid out in the order of
 * ref's strides (largest stride outermost; the last dim always innermost), like PyTorch's
 * empty_like with the preserved memory format. ref has the same ndim as shape. */
static td_status new_like_layout(const td_tensor *ref, const int64_t *shape, td_tensor **out) {
  int nd = ref->ndim, order[TD_MAX_DIMS];
  for (int i = 0; i < nd; i++) order[i] = i;
  /* insertion sort of dims 0..nd-2 by decreasing stride (stable), the last dim stays last */
  for (int i = 1; i < nd - 1; i++)
    for (int j = i; j > 0 && ref->strides[order[j - 1]] < ref->strides[order[j]]; j--) {
      int tmp = order[j];
      order[j] = order[j - 1];
      order[j - 1] = tmp;
    }
  int64_t strides[TD_MAX_DIMS], acc = 1;
  for (int i = nd - 1; i >= 0; i--) {
    strides[order[i]] = acc;
    acc *= shape[order[i]];
  }
  td_tensor *base;
  TD_TRY(td__tensor_new(&acc, 1, ref->dtype, ref->storage->device, &base));
  td_status st = td__tensor_view(base, shape, strides, nd, 0, out);
  td_tensor_unref(base);
  return st;
}

typedef struct attn_node {
  td_node base;
  td_tensor *q, *k, *v, *probs; /* row-ready detached operands, probabilities [nb, L, S] (or the
                                   log-sum-exps [nb, L] with the flash entries) */
  td_tensor *y;                 /* flash entries: the output (detached view); else NULL */
  td__attn_geom g;              /* sizes, mask, scale (offsets recomputed in backward) */
} attn_node;

static void attn_release(td_node *self) {
  attn_node *n = (attn_node *)self;
  td_tensor_unref(n->q);
  td_tensor_unref(n->k);
  td_tensor_unref(n->v);
  td_tensor_unref(n->probs);
  td_tensor_unref(n->y);
  n->q = n->k = n->v = n->probs = n->y = NULL;
}

/* geom_offsets allocates one block for the offsets of the given operands (ts[X] NULL: unused). */
static td_status geom_offsets(td__attn_geom *g, td_tensor *const *ts, int64_t **block) {
  int64_t *blk = td__malloc((size_t)(TD__ATT_N * (g->nb ? g->nb : 1)) * sizeof(int64_t));
  if (!blk) return td_set_error(TD_ERR_NOMEM, "attention: out of memory");
  for (int x = 0; x < TD__ATT_N; x++) {
    g->off[x] = NULL;
    g->rs[x] = 0;
    if (!ts[x]) continue;
    int64_t *o = blk + (size_t)x * (size_t)(g->nb ? g->nb : 1);
    batch_offsets(ts[x], g->nb, o);
    g->off[x] = o;
    g->rs[x] = ts[x]->strides[ts[x]->ndim - 2];
    g->nbd = ts[x]->ndim - 2;
    for (int d = 0; d < g->nbd; d++) {
      g->bshape[d] = ts[x]->shape[d];
      g->bstride[x][d] = ts[x]->strides[d];
    }
  }
  *block = blk;
  return TD_OK;
}

static td_status attn_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  attn_node *n = (attn_node *)self;
  if (!n->probs) return td_set_error(TD_ERR_STATE, "attention backward: saved tensors released");
  const td__backend *be = td__backend_of(n->q);
  bool flash = n->y != NULL;
  if (flash) TD__NEED_KERNEL(be, attention_lse_backward, "attention backward");
  else TD__NEED_KERNEL(be, attention_backward, "attention backward");
  td_tensor *gy = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
  int64_t *blk = NULL;
  td_status st = TD_OK;
  if (gout[0]->dtype != n->q->dtype) st = td__grad_prep(gout[0], n->q->dtype, &gy);
  else st = row_ready(gout[0], &gy);
  if (st == TD_OK && td__node_needs_grad(self, 0)) st = new_like_layout(n->q, n->q->shape, &gq);
  if (st == TD_OK && td__node_needs_grad(self, 1)) st = new_like_layout(n->k, n->k->shape, &gk);
  if (st == TD_OK && td__node_needs_grad(self, 2)) st = new_like_layout(n->v, n->v->shape, &gv);
  td__attn_geom g = n->g;
  td_tensor *ts[TD__ATT_N] = {n->q, n->k, n->v, n->y, gy, gq, gk, gv};
  if (st == TD_OK) st = geom_offsets(&g, ts, &blk);
  if (st == TD_OK && flash)
    st = be->attention_lse_backward(n->q->dtype, &g, td_tensor_data(n->q), td_tensor_data(n->k),
                                    td_tensor_data(n->v), td_tensor_data(n->y),
                                    td_tensor_data(n->probs), td_tensor_data(gy),
                                    gq ? td_tensor_data(gq) : NULL,
                                    gk ? td_tensor_data(gk) : NULL,
                                    gv ? td_tensor_data(gv) : NULL);
  else if (st == TD_OK)
    st = be->attention_backward(n->q->dtype, &g, td_tensor_data(n->q), td_tensor_data(n->k),
                                td_tensor_data(n->v), td_tensor_data(n->probs),
                                td_tensor_data(gy), gq ? td_tensor_data(gq) : NULL,
                                gk ? td_tensor_data(gk) : NULL, gv ? td_tensor_data(gv) : NULL);
  td__free(blk);
  td_tensor_unref(gy);
  if (st != TD_OK) {
    td_tensor_unref(gq);
    td_tensor_unref(gk);
    td_tensor_unref(gv);
    return st;
  }
  gin[0] = gq;
  gin[1] = gk;
  gin[2] = gv;
  return TD_OK;
}

static const td__node_ops attn_ops = {"ScaledDotProductAttentionBackward", attn_backward,
                                      attn_release, NULL};

/* check_args validates the operands and fills the sizes of g. */
static td_status check_args(const td_tensor *q, const td_tensor *k, const td_tensor *v,
                            td__attn_geom *g) {
  const char *op = "scaled_dot_product_attention";
  TD_TRY(td__check_float(op, q));
  TD_TRY(td__check_same_dtype(op, q, k));
  TD_TRY(td__check_same_dtype(op, q, v));
  TD_TRY(td__check_same_device(op, q, k));
  TD_TRY(td__check_same_device(op, q, v));
  char a[96], b[96], c[96];
  int nd = q->ndim;
  bool ok = nd >= 2 && k->ndim == nd && v->ndim == nd;
  for (int d = 0; ok && d < nd - 2; d++) ok = k->shape[d] == q->shape[d] && v->shape[d] == q->shape[d];
  ok = ok && k->shape[nd - 1] == q->shape[nd - 1] && v->shape[nd - 2] == k->shape[nd - 2];
  if (!ok)
    return td_set_error(TD_ERR_SHAPE, "%s: q %s, k %s, v %s: expected q [..., L, E], k [..., S, "
                        "E], v [..., S, Ev] with equal batch dims", op,
                        td_tensor_shape_str(q, a, sizeof a), td_tensor_shape_str(k, b, sizeof b),
                        td_tensor_shape_str(v, c, sizeof c));
  g->L = q->shape[nd - 2];
  g->E = q->shape[nd - 1];
  g->S = k->shape[nd - 2];
  g->Ev = v->shape[nd - 1];
  g->nb = td__shape_numel(q->shape, nd - 2);
  if (g->S == 0 && g->L > 0 && g->nb > 0)
    return td_set_error(TD_ERR_SHAPE, "%s: no keys (k %s) for %lld queries", op,
                        td_tensor_shape_str(k, b, sizeof b), (long long)g->L);
  return TD_OK;
}

td_status td_tensor_scaled_dot_product_attention(const td_tensor *q, const td_tensor *k,
                                                 const td_tensor *v, bool causal, double scale,
                                                 td_tensor **out) {
  TD_CHECK_ARG(q && k && v && out, "scaled_dot_product_attention: NULL argument");
  TD__AUTOCAST(true, 3, (q, k, v),
               td_tensor_scaled_dot_product_attention(ac_t[0], ac_t[1], ac_t[2], causal, scale,
                                                      out));
  td__attn_geom g;
  memset(&g, 0, sizeof g);
  TD_TRY(check_args(q, k, v, &g));
  if (isnan(scale)) scale = g.E > 0 ? 1.0 / sqrt((double)g.E) : 1.0;
  TD_CHECK_ARG(isfinite(scale), "scaled_dot_product_attention: scale %g is not finite", scale);
  g.causal = causal;
  g.scale = scale;
  const td__backend *be = td__backend_of(q);
  bool flash = be->attention_lse != NULL;
  if (!flash) TD__NEED_KERNEL(be, attention, "scaled_dot_product_attention");
  td_tensor *qr = NULL, *kr = NULL, *vr = NULL, *y = NULL, *probs = NULL;
  int64_t *blk = NULL;
  bool grad = td__needs_grad(q) || td__needs_grad(k) || td__needs_grad(v);
  int nd = q->ndim;
  int64_t yshape[TD_MAX_DIMS];
  memcpy(yshape, q->shape, (size_t)nd * sizeof(int64_t));
  yshape[nd - 1] = g.Ev;
  td_status st = row_ready(q, &qr);
  if (st == TD_OK) st = row_ready(k, &kr);
  if (st == TD_OK) st = row_ready(v, &vr);
  if (st == TD_OK) st = new_like_layout(qr, yshape, &y);
  if (st == TD_OK && grad && flash) { /* per-row log-sum-exps */
    int64_t lshape[2] = {g.nb, g.L};
    st = td__tensor_new(lshape, 2, q->dtype == TD_DTYPE_F64 ? TD_DTYPE_F64 : TD_DTYPE_F32,
                        q->storage->device, &probs);
  } else if (st == TD_OK && grad) {
    int64_t pshape[3] = {g.nb, g.L, g.S};
    st = td__tensor_new(pshape, 3, q->dtype, q->storage->device, &probs);
  }
  td_tensor *ts[TD__ATT_N] = {qr, kr, vr, y, NULL, NULL, NULL, NULL};
  if (st == TD_OK) st = geom_offsets(&g, ts, &blk);
  if (st == TD_OK && flash)
    st = be->attention_lse(q->dtype, &g, td_tensor_data(qr), td_tensor_data(kr),
                           td_tensor_data(vr), td_tensor_data(y),
                           probs ? td_tensor_data(probs) : NULL);
  else if (st == TD_OK)
    st = be->attention(q->dtype, &g, td_tensor_data(qr), td_tensor_data(kr), td_tensor_data(vr),
                       td_tensor_data(y), probs ? td_tensor_data(probs) : NULL);
  td__free(blk);
  memset(g.off, 0, sizeof g.off);
  if (st == TD_OK && grad) {
    const td_tensor *ins[3] = {q, k, v};
    attn_node *n = (attn_node *)td__record(y, sizeof(attn_node), &attn_ops, ins, 3, &st);
    if (n) {
      n->g = g;
      if (st == TD_OK) st = td_tensor_detach(qr, &n->q);
      if (st == TD_OK) st = td_tensor_detach(kr, &n->k);
      if (st == TD_OK) st = td_tensor_detach(vr, &n->v);
      if (st == TD_OK) n->probs = td_tensor_ref(probs);
      if (st == TD_OK && flash) st = td_tensor_detach(y, &n->y);
    }
  }
  td_tensor_unref(qr);
  td_tensor_unref(kr);
  td_tensor_unref(vr);
  td_tensor_unref(probs);
  if (st != TD_OK) {
    td_tensor_unref(y);
    return st;
  }
  *out = y;
  return TD_OK;
}
