/* cpu_attention.c - CPU kernels of the fused scaled-dot-product attention (forward, backward).
 *
 * One problem is q [L, E], k [S, E], v [S, Ev] -> y [L, Ev] with rows anywhere in memory (a row
 * stride per operand), so the op can hand in heads that are strided views of a [B, T, 3C]
 * projection without copying them. Per query row i (n = i + 1 keys when causal, else S):
 *
 *   forward   s_j = scale q_i . k_j (j < n); p = softmax(s); y_i = sum_j p_j v_j
 *   backward  dp_j = gy_i . v_j;  D = sum_j p_j dp_j;  ds_j = p_j (dp_j - D)
 *             gq_i = scale sum_j ds_j k_j;  gk_j += scale ds_j q_i;  gv_j += p_j gy_i
 *
 * The masked part of the L x S scores is never computed, and nothing but the probabilities (for
 * the backward) is stored: PyTorch 1.13's nanoGPT attention materialises the full scores, the
 * masked copy and the softmax, and runs two more full-size batched GEMMs in backward.
 *
 * Vectorisation: gcc does not vectorise floating-point sum reductions without -ffast-math, so
 * every inner loop is written as an axpy over a contiguous row: the scores of row i accumulate
 * q_i[e] * k^T[e][0..n) over e (k transposed once per problem into a scratch [E, S] block), the
 * outputs accumulate p_j * v_j[0..Ev) over j. Float32 uses the vectorisable td__expf; the hot
 * loops are compiled per ISA level (TD__CPU_CLONES). Scores and sums are kept in the element
 * type, as PyTorch's float32 GEMM and softmax do.
 */
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_math.h"

static inline __attribute__((always_inline)) float exp_float(float x) { return td__expf(x); }
static inline __attribute__((always_inline)) double exp_double(double x) { return exp(x); }

/* Per-problem scratch: k^T or v^T [max(E, Ev), S], one row of scores, one of dp. */
static size_t scratch_elems(const td__attn_geom *g) {
  int64_t w = g->E > g->Ev ? g->E : g->Ev;
  return (size_t)(w * g->S + 2 * g->S + 1);
}

#define DEF_ATTENTION(T)                                                                        \
  /* transpose_rows writes the n x w matrix with rows rs apart into dst [w, n]. */             \
  static void transpose_rows_##T(const T *src, int64_t rs, int64_t n, int64_t w, T *dst) {    \
    for (int64_t j = 0; j < n; j++)                                                             \
      for (int64_t e = 0; e < w; e++) dst[e * n + j] = src[j * rs + e];                        \
  }                                                                                             \
                                                                                                \
  /* softmax_row turns s[0..n) into probabilities (unnormalised exp) and returns 1/sum. */     \
  static inline T softmax_row_##T(T *s, int64_t n) {                                            \
    T m = s[0];                                                                                 \
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;                                    \
    for (int64_t j = 0; j < n; j++) s[j] = exp_##T(s[j] - m);                                   \
    T l = 0;                                                                                    \
    for (int64_t j = 0; j < n; j++) l += s[j];                                                  \
    return (T)1 / l;                                                                            \
  }                                                                                             \
                                                                                                \
  TD__CPU_CLONES static void attn_fwd_##T(const td__attn_geom *g, int64_t b, const T *q,      \
                                          const T *k, const T *v, T *y, T *probs, T *scr) {    \
    const int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev;                                     \
    const T scale = (T)g->scale;                                                                \
    const T *qb = q + g->off[TD__ATT_Q][b], *kb = k + g->off[TD__ATT_K][b];                    \
    const T *vb = v + g->off[TD__ATT_V][b];                                                     \
    T *yb = y + g->off[TD__ATT_Y][b];                                                           \
    T *kt = scr, *s = scr + (g->E > g->Ev ? g->E : g->Ev) * S;                                  \
    transpose_rows_##T(kb, g->rs[TD__ATT_K], S, E, kt);                                         \
    for (int64_t i = 0; i < L; i++) {                                                           \
      int64_t n = g->causal ? (i + 1 < S ? i + 1 : S) : S;                                      \
      const T *qi = qb + i * g->rs[TD__ATT_Q];                                                  \
      for (int64_t j = 0; j < n; j++) s[j] = 0;                                                 \
      for (int64_t e = 0; e < E; e++) {                                                         \
        const T a = qi[e] * scale, *kr = kt + e * S;                                            \
        for (int64_t j = 0; j < n; j++) s[j] += a * kr[j];                                      \
      }                                                                                         \
      const T inv = softmax_row_##T(s, n);                                                      \
      for (int64_t j = 0; j < n; j++) s[j] *= inv;                                              \
      T *yi = yb + i * g->rs[TD__ATT_Y];                                                        \
      for (int64_t e = 0; e < Ev; e++) yi[e] = 0;                                               \
      for (int64_t j = 0; j < n; j++) {                                                         \
        const T p = s[j], *vj = vb + j * g->rs[TD__ATT_V];                                      \
        for (int64_t e = 0; e < Ev; e++) yi[e] += p * vj[e];                                    \
      }                                                                                         \
      if (probs) {                                                                              \
        T *pi = probs + (b * L + i) * S;                                                        \
        for (int64_t j = 0; j < n; j++) pi[j] = s[j];                                           \
        for (int64_t j = n; j < S; j++) pi[j] = 0;                                              \
      }                                                                                         \
    }                                                                                           \
  }                                                                                             \
                                                                                                \
  TD__CPU_CLONES static void attn_bwd_##T(const td__attn_geom *g, int64_t b, const T *q,      \
                                          const T *k, const T *v, const T *probs, const T *gy, \
                                          T *gq, T *gk, T *gv, T *scr) {                        \
    const int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev;                                     \
    const T scale = (T)g->scale;                                                                \
    const int64_t qrs = g->rs[TD__ATT_Q], krs = g->rs[TD__ATT_K], gyrs = g->rs[TD__ATT_GY];    \
    const T *qb = q + g->off[TD__ATT_Q][b], *kb = k + g->off[TD__ATT_K][b];                    \
    const T *gyb = gy + g->off[TD__ATT_GY][b];                                                  \
    T *gqb = gq ? gq + g->off[TD__ATT_GQ][b] : NULL;                                            \
    T *gkb = gk ? gk + g->off[TD__ATT_GK][b] : NULL;                                            \
    T *gvb = gv ? gv + g->off[TD__ATT_GV][b] : NULL;                                            \
    T *vt = scr, *dp = scr + (g->E > g->Ev ? g->E : g->Ev) * S;                                 \
    if (gkb)                                                                                    \
      for (int64_t j = 0; j < S; j++) memset(gkb + j * g->rs[TD__ATT_GK], 0, E * sizeof(T));   \
    if (gvb)                                                                                    \
      for (int64_t j = 0; j < S; j++) memset(gvb + j * g->rs[TD__ATT_GV], 0, Ev * sizeof(T));  \
    if (gqb || gkb) transpose_rows_##T(v + g->off[TD__ATT_V][b], g->rs[TD__ATT_V], S, Ev, vt);  \
    for (int64_t i = 0; i < L; i++) {                                                           \
      int64_t n = g->causal ? (i + 1 < S ? i + 1 : S) : S;                                      \
      const T *pi = probs + (b * L + i) * S, *gyi = gyb + i * gyrs, *qi = qb + i * qrs;        \
      if (gvb)                                                                                  \
        for (int64_t j = 0; j < n; j++) {                                                       \
          const T p = pi[j];                                                                    \
          T *gvj = gvb + j * g->rs[TD__ATT_GV];                                                 \
          for (int64_t e = 0; e < Ev; e++) gvj[e] += p * gyi[e];                                \
        }                                                                                       \
      if (!gqb && !gkb) continue;                                                               \
      for (int64_t j = 0; j < n; j++) dp[j] = 0;                                                \
      for (int64_t e = 0; e < Ev; e++) {                                                        \
        const T a = gyi[e], *vr = vt + e * S;                                                   \
        for (int64_t j = 0; j < n; j++) dp[j] += a * vr[j];                                     \
      }                                                                                         \
      T d = 0;                                                                                  \
      for (int64_t j = 0; j < n; j++) d += pi[j] * dp[j];                                       \
      for (int64_t j = 0; j < n; j++) dp[j] = pi[j] * (dp[j] - d) * scale; /* scale ds_j */     \
      if (gqb) {                                                                                \
        T *gqi = gqb + i * g->rs[TD__ATT_GQ];                                                   \
        for (int64_t e = 0; e < E; e++) gqi[e] = 0;                                             \
        for (int64_t j = 0; j < n; j++) {                                                       \
          const T c = dp[j], *kj = kb + j * krs;                                                \
          for (int64_t e = 0; e < E; e++) gqi[e] += c * kj[e];                                  \
        }                                                                                       \
      }                                                                                         \
      if (gkb)                                                                                  \
        for (int64_t j = 0; j < n; j++) {                                                       \
          const T c = dp[j];                                                                    \
          T *gkj = gkb + j * g->rs[TD__ATT_GK];                                                 \
          for (int64_t e = 0; e < E; e++) gkj[e] += c * qi[e];                                  \
        }                                                                                       \
    }                                                                                           \
  }
DEF_ATTENTION(float)
DEF_ATTENTION(double)

td_status td__cpu_attention(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                            const void *v, void *y, void *probs) {
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "attention: CPU kernel does not support %s",
                        td_dtype_name(dt));
  if (g->nb == 0 || g->L == 0) return TD_OK;
  void *scr = td__malloc(scratch_elems(g) * td_dtype_size(dt));
  if (!scr) return td_set_error(TD_ERR_NOMEM, "attention: out of memory");
  for (int64_t b = 0; b < g->nb; b++) {
    if (dt == TD_DTYPE_F32) attn_fwd_float(g, b, q, k, v, y, probs, scr);
    else attn_fwd_double(g, b, q, k, v, y, probs, scr);
  }
  td__free(scr);
  return TD_OK;
}

td_status td__cpu_attention_backward(td_dtype dt, const td__attn_geom *g, const void *q,
                                     const void *k, const void *v, const void *probs,
                                     const void *gy, void *gq, void *gk, void *gv) {
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "attention backward: CPU kernel does not support %s",
                        td_dtype_name(dt));
  if (g->nb == 0) return TD_OK;
  void *scr = td__malloc(scratch_elems(g) * td_dtype_size(dt));
  if (!scr) return td_set_error(TD_ERR_NOMEM, "attention backward: out of memory");
  for (int64_t b = 0; b < g->nb; b++) {
    if (dt == TD_DTYPE_F32) attn_bwd_float(g, b, q, k, v, probs, gy, gq, gk, gv, scr);
    else attn_bwd_double(g, b, q, k, v, probs, gy, gq, gk, gv, scr);
  }
  td__free(scr);
  return TD_OK;
}
