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

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_math.h"

static inline __attribute__((always_inline)) float exp_float(float x) { return td__expf(x); }
static inline __attribute__((always_inline)) double exp_double(double x) { return exp(x); }

/* Register blocking: R rows at a time; columns in chunks of one 64-byte vector (gcc's vector
 * extension: one AVX-512 register, two AVX2 or four SSE2 registers, whatever the clone targets),
 * W elements of T. The score-like products run over chunks of a transposed operand padded with
 * zeros to SP = S rounded up to 16 columns, so no chunk needs a tail. */
#define R 4
#define SPAD 16

typedef float vec_float __attribute__((vector_size(64)));
typedef double vec_double __attribute__((vector_size(64)));
typedef int32_t veci_float __attribute__((vector_size(64))); /* comparison masks */
typedef int64_t veci_double __attribute__((vector_size(64)));

/* The 64-byte vectors are only ever inlined; gcc's note that passing them by value changes the
 * ABI without AVX-512 does not apply. */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"

static int64_t padded(int64_t s) { return (s + SPAD - 1) / SPAD * SPAD; }

/* Scratch per problem: the transposed k or v [max(E, Ev), SP], two row blocks [R, SP], R packed
 * rows [R, max(E, Ev)] and (in backward) the scaled score gradients DS [L + R, SP] (a last
 * partial block of rows reads R). */
static size_t scratch_elems(const td__attn_geom *g, bool backward) {
  int64_t w = g->E > g->Ev ? g->E : g->Ev, sp = padded(g->S);
  return (size_t)(w * sp + 2 * R * sp + R * w + (backward ? (g->L + R) * sp : 0));
}

#define DEF_ATTENTION(T)                                                                        \
  typedef vec_##T V_##T;                                                                        \
  enum { W_##T = (int)(sizeof(V_##T) / sizeof(T)) };                                            \
  static inline __attribute__((always_inline)) V_##T load_##T(const T *p) {                     \
    V_##T v;                                                                                    \
    memcpy(&v, p, sizeof v);                                                                    \
    return v;                                                                                   \
  }                                                                                             \
  static inline __attribute__((always_inline)) void store_##T(T *p, V_##T v) {                  \
    memcpy(p, &v, sizeof v);                                                                    \
  }                                                                                             \
  static inline __attribute__((always_inline)) V_##T vmax_##T(V_##T a, V_##T b) {              \
    veci_##T m = a > b;                                                                         \
    return (V_##T)(((veci_##T)a & m) | ((veci_##T)b & ~m));                                     \
  }                                                                                             \
  static inline __attribute__((always_inline)) T hsum_##T(V_##T v) {                            \
    T s = 0;                                                                                    \
    for (int k = 0; k < W_##T; k++) s += v[k];                                                  \
    return s;                                                                                   \
  }                                                                                             \
  /* dot returns sum_{j < n} a[j] b[j] (vector chunks, then a scalar tail). */                  \
  static inline T dot_##T(const T *a, const T *b, int64_t n) {                                  \
    V_##T acc = {0};                                                                            \
    int64_t j = 0;                                                                              \
    for (; j + W_##T <= n; j += W_##T) acc += load_##T(a + j) * load_##T(b + j);                \
    T s = hsum_##T(acc);                                                                        \
    for (; j < n; j++) s += a[j] * b[j];                                                        \
    return s;                                                                                   \
  }                                                                                             \
                                                                                                \
  /* transpose_rows writes the n x w matrix with rows rs apart into dst [w, ld] (ld >= n; the   \
   * columns n..ld are zeroed). */                                                              \
  static inline void transpose_rows_##T(const T *src, int64_t rs, int64_t n, int64_t w,        \
                                        int64_t ld, T *dst) {                                   \
    for (int64_t j = 0; j < n; j++) {                                                           \
      const T *row = src + j * rs;                                                              \
      for (int64_t e = 0; e < w; e++) dst[e * ld + j] = row[e];                                 \
    }                                                                                           \
    for (int64_t e = 0; e < w; e++)                                                             \
      for (int64_t j = n; j < ld; j++) dst[e * ld + j] = 0;                                     \
  }                                                                                             \
                                                                                                \
  /* rows_by_cols: out[r][0..nc*W) = sum_e a[r][e] * bt[e][0..nc*W) for the R packed rows of a \
   * ([R, E], scale already applied), bt [E, ld]; out rows ld apart. Two chunks at a time keep  \
   * 2R independent accumulators in flight. */                                                  \
  static inline void rows_by_cols_##T(const T *a, const T *bt, int64_t ld, int64_t E,          \
                                      int64_t nc, T *out) {                                     \
    int64_t c = 0;                                                                              \
    for (; c + 2 <= nc; c += 2) {                                                               \
      V_##T acc0[R] = {0}, acc1[R] = {0};                                                       \
      for (int64_t e = 0; e < E; e++) {                                                         \
        const T *br = bt + e * ld + c * W_##T;                                                  \
        const V_##T b0 = load_##T(br), b1 = load_##T(br + W_##T);                               \
        for (int r = 0; r < R; r++) {                                                           \
          acc0[r] += a[r * E + e] * b0;                                                         \
          acc1[r] += a[r * E + e] * b1;                                                         \
        }                                                                                       \
      }                                                                                         \
      for (int r = 0; r < R; r++) {                                                             \
        store_##T(out + r * ld + c * W_##T, acc0[r]);                                           \
        store_##T(out + r * ld + (c + 1) * W_##T, acc1[r]);                                     \
      }                                                                                         \
    }                                                                                           \
    if (c < nc) {                                                                               \
      V_##T acc[R] = {0};                                                                       \
      for (int64_t e = 0; e < E; e++) {                                                         \
        const V_##T b = load_##T(bt + e * ld + c * W_##T);                                      \
        for (int r = 0; r < R; r++) acc[r] += a[r * E + e] * b;                                 \
      }                                                                                         \
      for (int r = 0; r < R; r++) store_##T(out + r * ld + c * W_##T, acc[r]);                  \
    }                                                                                           \
  }                                                                                             \
                                                                                                \
  /* pack_rows copies the R rows a[r] (E long) times scale into dst [R, E]. */                  \
  static inline void pack_rows_##T(const T *const *a, T scale, int64_t E, T *dst) {             \
    for (int r = 0; r < R; r++)                                                                 \
      for (int64_t e = 0; e < E; e++) dst[r * E + e] = a[r][e] * scale;                         \
  }                                                                                             \
                                                                                                \
  /* combine_rows: out[r][0..w) = sum_{t in [t0, t1)} cb[r][t * cs] * x_t[0..w) for R        \
   * coefficient sequences cb[r] (stride cs) and the rows x_t = x + t * xrs; out rows r < nr    \
   * are written. Rows of probabilities times v (cb[r] a row of P, cs 1) and columns of DS or P \
   * times q or gy (cb[r] a column, cs the row length) are both this. Two chunks at a time. */  \
  static inline void combine_rows_##T(const T *const *cb, int64_t cs, int64_t t0, int64_t t1,  \
                                      const T *x, int64_t xrs, int64_t w, int nr,              \
                                      T *const *out) {                                          \
    int64_t c = 0;                                                                              \
    for (; c + 2 * W_##T <= w; c += 2 * W_##T) {                                                \
      V_##T acc0[R] = {0}, acc1[R] = {0};                                                       \
      for (int64_t t = t0; t < t1; t++) {                                                       \
        const T *xr = x + t * xrs + c;                                                          \
        const V_##T x0 = load_##T(xr), x1 = load_##T(xr + W_##T);                               \
        for (int r = 0; r < R; r++) {                                                           \
          const T k = cb[r][t * cs];                                                            \
          acc0[r] += k * x0;                                                                    \
          acc1[r] += k * x1;                                                                    \
        }                                                                                       \
      }                                                                                         \
      for (int r = 0; r < nr; r++) {                                                            \
        store_##T(out[r] + c, acc0[r]);                                                         \
        store_##T(out[r] + c + W_##T, acc1[r]);                                                 \
      }                                                                                         \
    }                                                                                           \
    for (; c + W_##T <= w; c += W_##T) {                                                        \
      V_##T acc[R] = {0};                                                                       \
      for (int64_t t = t0; t < t1; t++) {                                                       \
        const V_##T xt = load_##T(x + t * xrs + c);                                             \
        for (int r = 0; r < R; r++) acc[r] += cb[r][t * cs] * xt;                               \
      }                                                                                         \
      for (int r = 0; r < nr; r++) store_##T(out[r] + c, acc[r]);                               \
    }                                                                                           \
    for (int r = 0; r < nr; r++) /* the columns past the last full chunk */                     \
      for (int64_t k = c; k < w; k++) {                                                         \
        T acc = 0;                                                                              \
        for (int64_t t = t0; t < t1; t++) acc += cb[r][t * cs] * x[t * xrs + k];                \
        out[r][k] = acc;                                                                        \
      }                                                                                         \
  }                                                                                             \
                                                                                                \
  /* row_starts sets cb[r] = m + r * ld: the R rows of a block as coefficient sequences. */     \
  static inline void row_starts_##T(const T *m, int64_t ld, const T **cb) {                     \
    for (int r = 0; r < R; r++) cb[r] = m + r * ld;                                             \
  }                                                                                             \
                                                                                                \
  /* softmax_row turns s[0..n) into probabilities and zeroes s[n..nc*W), working on whole     \
   * vectors: the masked tail is set to -inf first, whose exp is 0. */                          \
  static inline void softmax_row_##T(T *s, int64_t n, int64_t nc) {                             \
    const int64_t end = nc * W_##T;                                                             \
    for (int64_t j = n; j < end; j++) s[j] = -INFINITY;                                         \
    V_##T m = load_##T(s);                                                                      \
    for (int64_t c = 1; c < nc; c++) m = vmax_##T(m, load_##T(s + c * W_##T));                  \
    T mx = m[0];                                                                                \
    for (int k = 1; k < W_##T; k++) mx = m[k] > mx ? m[k] : mx;                                 \
    for (int64_t j = 0; j < end; j++) s[j] = exp_##T(s[j] - mx);                                \
    V_##T acc = {0};                                                                            \
    for (int64_t c = 0; c < nc; c++) acc += load_##T(s + c * W_##T);                            \
    const T inv = (T)1 / hsum_##T(acc);                                                         \
    for (int64_t j = 0; j < end; j++) s[j] *= inv;                                              \
  }                                                                                             \
                                                                                                \
  TD__CPU_CLONES static void attn_fwd_##T(const td__attn_geom *g, int64_t b, const T *q,      \
                                          const T *k, const T *v, T *y, T *probs, T *scr) {    \
    const int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev, SP = padded(S);                     \
    const T scale = (T)g->scale;                                                                \
    const T *qb = q + g->off[TD__ATT_Q][b], *vb = v + g->off[TD__ATT_V][b];                    \
    T *yb = y + g->off[TD__ATT_Y][b];                                                           \
    T *kt = scr, *sblk = scr + (E > Ev ? E : Ev) * SP, *apk = sblk + 2 * R * SP;                \
    transpose_rows_##T(k + g->off[TD__ATT_K][b], g->rs[TD__ATT_K], S, E, SP, kt);              \
    for (int64_t i0 = 0; i0 < L; i0 += R) {                                                     \
      const int nr = (int)(L - i0 < R ? L - i0 : R);                                            \
      const T *qrows[R];                                                                        \
      T *yrows[R];                                                                              \
      int64_t n[R];                                                                             \
      for (int r = 0; r < R; r++) {                                                             \
        int64_t i = i0 + (r < nr ? r : nr - 1);                                                 \
        qrows[r] = qb + i * g->rs[TD__ATT_Q];                                                   \
        yrows[r] = yb + i * g->rs[TD__ATT_Y];                                                   \
        n[r] = g->causal ? (i + 1 < S ? i + 1 : S) : S;                                         \
      }                                                                                         \
      const int64_t nmax = n[nr - 1];                                                           \
      const int64_t nc = (nmax + W_##T - 1) / W_##T;                                            \
      pack_rows_##T(qrows, scale, E, apk);                                                      \
      rows_by_cols_##T(apk, kt, SP, E, nc, sblk);                                               \
      for (int r = 0; r < nr; r++) softmax_row_##T(sblk + r * SP, n[r], nc);                    \
      const T *cb[R];                                                                           \
      row_starts_##T(sblk, SP, cb);                                                             \
      combine_rows_##T(cb, 1, 0, nmax, vb, g->rs[TD__ATT_V], Ev, nr, yrows);                    \
      if (probs)                                                                                \
        for (int r = 0; r < nr; r++) {                                                          \
          T *pi = probs + (b * L + i0 + r) * S;                                                 \
          for (int64_t j = 0; j < nmax; j++) pi[j] = sblk[r * SP + j];                          \
          for (int64_t j = nmax; j < S; j++) pi[j] = 0;                                         \
        }                                                                                       \
    }                                                                                           \
  }                                                                                             \
                                                                                                \
  TD__CPU_CLONES static void attn_bwd_##T(const td__attn_geom *g, int64_t b, const T *q,      \
                                          const T *k, const T *v, const T *probs, const T *gy, \
                                          T *gq, T *gk, T *gv, T *scr) {                        \
    const int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev, SP = padded(S);                     \
    const T scale = (T)g->scale;                                                                \
    const T *qb = q + g->off[TD__ATT_Q][b], *kb = k + g->off[TD__ATT_K][b];                    \
    const T *gyb = gy + g->off[TD__ATT_GY][b], *pb = probs + b * L * S;                         \
    const int64_t qrs = g->rs[TD__ATT_Q], gyrs = g->rs[TD__ATT_GY];                             \
    T *vt = scr, *dblk = scr + (E > Ev ? E : Ev) * SP, *apk = dblk + 2 * R * SP;                \
    T *ds = apk + R * (E > Ev ? E : Ev);                                                        \
    /* pass 1, query rows: dp = gy v^T, ds = p (dp - rowsum(p dp)) * scale, gq = ds k */        \
    if (gq || gk) {                                                                             \
      transpose_rows_##T(v + g->off[TD__ATT_V][b], g->rs[TD__ATT_V], S, Ev, SP, vt);           \
      for (int64_t i0 = 0; i0 < L; i0 += R) {                                                   \
        const int nr = (int)(L - i0 < R ? L - i0 : R);                                          \
        const T *gyrows[R];                                                                     \
        T *gqrows[R];                                                                           \
        int64_t n[R];                                                                           \
        for (int r = 0; r < R; r++) {                                                           \
          int64_t i = i0 + (r < nr ? r : nr - 1);                                               \
          gyrows[r] = gyb + i * gyrs;                                                           \
          gqrows[r] = gq ? gq + g->off[TD__ATT_GQ][b] + i * g->rs[TD__ATT_GQ] : NULL;           \
          n[r] = g->causal ? (i + 1 < S ? i + 1 : S) : S;                                       \
        }                                                                                       \
        const int64_t nmax = n[nr - 1];                                                         \
        pack_rows_##T(gyrows, (T)1, Ev, apk);                                                   \
        rows_by_cols_##T(apk, vt, SP, Ev, (nmax + W_##T - 1) / W_##T, dblk);                    \
        for (int r = 0; r < nr; r++) {                                                          \
          const T *pi = pb + (i0 + r) * S, *dp = dblk + r * SP;                                 \
          T *dsi = ds + (i0 + r) * SP, d = 0;                                                   \
          d = dot_##T(pi, dp, n[r]);                                                            \
          for (int64_t j = 0; j < n[r]; j++) dsi[j] = pi[j] * (dp[j] - d) * scale;              \
          for (int64_t j = n[r]; j < SP; j++) dsi[j] = 0;                                       \
        }                                                                                       \
        if (gq) {                                                                               \
          const T *cb[R];                                                                       \
          row_starts_##T(ds + i0 * SP, SP, cb);                                                 \
          combine_rows_##T(cb, 1, 0, nmax, kb, g->rs[TD__ATT_K], E, nr, gqrows);                \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
    /* pass 2, key rows: gk_j = sum_i ds_ij q_i, gv_j = sum_i p_ij gy_i (i >= j when causal) */ \
    for (int64_t j0 = 0; j0 < S && (gk || gv); j0 += R) {                                       \
      const int nr = (int)(S - j0 < R ? S - j0 : R);                                            \
      const T *dcol[R], *pcol[R]; /* columns j of DS and P */                                   \
      T *gkrows[R], *gvrows[R];                                                                 \
      for (int r = 0; r < R; r++) {                                                             \
        int64_t j = j0 + (r < nr ? r : nr - 1);                                                 \
        dcol[r] = ds + j;                                                                       \
        pcol[r] = pb + j;                                                                       \
        gkrows[r] = gk ? gk + g->off[TD__ATT_GK][b] + j * g->rs[TD__ATT_GK] : NULL;             \
        gvrows[r] = gv ? gv + g->off[TD__ATT_GV][b] + j * g->rs[TD__ATT_GV] : NULL;             \
      }                                                                                         \
      const int64_t i0 = g->causal ? (j0 < L ? j0 : L) : 0;                                     \
      if (gk) combine_rows_##T(dcol, SP, i0, L, qb, qrs, E, nr, gkrows);                        \
      if (gv) combine_rows_##T(pcol, S, i0, L, gyb, gyrs, Ev, nr, gvrows);                      \
    }                                                                                           \
  }
DEF_ATTENTION(float)
DEF_ATTENTION(double)

/* ---- bfloat16 / float16: each problem's rows converted to float32, the float32 kernel, the
 * results rounded back (probabilities too: the backward reads them back into float32, as
 * PyTorch's bfloat16 softmax output is read by its backward) ---- */

typedef struct {
  float *q, *k, *v, *y, *p, *gy, *gq, *gk, *gv;
  void *scr;
} half_bufs;

static void half_bufs_free(half_bufs *h) {
  float *all[9] = {h->q, h->k, h->v, h->y, h->p, h->gy, h->gq, h->gk, h->gv};
  for (int i = 0; i < 9; i++) td__free(all[i]);
  td__free(h->scr);
}

static td_status half_bufs_alloc(const td__attn_geom *g, bool backward, half_bufs *h) {
  memset(h, 0, sizeof *h);
  int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev;
  int64_t n[9] = {L * E, S * E, S * Ev, L * Ev, L * S, backward ? L * Ev : 0, backward ? L * E : 0,
                  backward ? S * E : 0, backward ? S * Ev : 0};
  float **slot[9] = {&h->q, &h->k, &h->v, &h->y, &h->p, &h->gy, &h->gq, &h->gk, &h->gv};
  for (int i = 0; i < 9; i++) {
    if (!n[i] && i >= 5) continue;
    *slot[i] = td__malloc((size_t)(n[i] > 0 ? n[i] : 1) * sizeof(float));
    if (!*slot[i]) goto nomem;
  }
  h->scr = td__calloc(scratch_elems(g, backward), sizeof(float));
  if (!h->scr) goto nomem;
  return TD_OK;
nomem:
  half_bufs_free(h);
  return td_set_error(TD_ERR_NOMEM, "attention: out of memory");
}

/* Rows of problem b of operand X (n rows of w elements) into / out of a contiguous float block. */
static void rows_in(td_dtype dt, const td__attn_geom *g, int x, int64_t b, const void *base,
                    int64_t n, int64_t w, float *d) {
  const uint16_t *p = (const uint16_t *)base + g->off[x][b];
  for (int64_t i = 0; i < n; i++) td__half_load(dt, d + i * w, p + i * g->rs[x], 1, w);
}
static void rows_out(td_dtype dt, const td__attn_geom *g, int x, int64_t b, void *base, int64_t n,
                     int64_t w, const float *s) {
  uint16_t *p = (uint16_t *)base + g->off[x][b];
  for (int64_t i = 0; i < n; i++) td__half_store(dt, p + i * g->rs[x], 1, s + i * w, w);
}

/* The geometry of one contiguous float32 problem. */
static void one_problem(const td__attn_geom *g, td__attn_geom *g1, const int64_t *zero) {
  *g1 = *g;
  g1->nb = 1;
  int64_t w[TD__ATT_N] = {g->E, g->E, g->Ev, g->Ev, g->Ev, g->E, g->E, g->Ev};
  for (int x = 0; x < TD__ATT_N; x++) {
    g1->off[x] = zero;
    g1->rs[x] = w[x];
  }
}

/* operands_in converts problem b's q, k and v rows into h's float32 blocks. */
static void operands_in(td_dtype dt, const td__attn_geom *g, int64_t b, const void *q,
                        const void *k, const void *v, half_bufs *h) {
  rows_in(dt, g, TD__ATT_Q, b, q, g->L, g->E, h->q);
  rows_in(dt, g, TD__ATT_K, b, k, g->S, g->E, h->k);
  rows_in(dt, g, TD__ATT_V, b, v, g->S, g->Ev, h->v);
}

static const int64_t zero_off[1] = {0};

static td_status attention_half(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                                 const void *v, void *y, void *probs) {
  half_bufs h;
  TD_TRY(half_bufs_alloc(g, false, &h));
  td__attn_geom g1;
  one_problem(g, &g1, zero_off);
  int64_t L = g->L, S = g->S, Ev = g->Ev;
  for (int64_t b = 0; b < g->nb; b++) {
    operands_in(dt, g, b, q, k, v, &h);
    attn_fwd_float(&g1, 0, h.q, h.k, h.v, h.y, probs ? h.p : NULL, h.scr);
    rows_out(dt, g, TD__ATT_Y, b, y, L, Ev, h.y);
    if (probs) td__half_store(dt, (uint16_t *)probs + b * L * S, 1, h.p, L * S);
  }
  half_bufs_free(&h);
  return TD_OK;
}

static td_status attention_backward_half(td_dtype dt, const td__attn_geom *g, const void *q,
                                         const void *k, const void *v, const void *probs,
                                         const void *gy, void *gq, void *gk, void *gv) {
  half_bufs h;
  TD_TRY(half_bufs_alloc(g, true, &h));
  td__attn_geom g1;
  one_problem(g, &g1, zero_off);
  int64_t L = g->L, S = g->S, E = g->E, Ev = g->Ev;
  for (int64_t b = 0; b < g->nb; b++) {
    operands_in(dt, g, b, q, k, v, &h);
    rows_in(dt, g, TD__ATT_GY, b, gy, L, Ev, h.gy);
    td__half_load(dt, h.p, (const uint16_t *)probs + b * L * S, 1, L * S);
    attn_bwd_float(&g1, 0, h.q, h.k, h.v, h.p, h.gy, gq ? h.gq : NULL, gk ? h.gk : NULL,
                   gv ? h.gv : NULL, h.scr);
    if (gq) rows_out(dt, g, TD__ATT_GQ, b, gq, L, E, h.gq);
    if (gk) rows_out(dt, g, TD__ATT_GK, b, gk, S, E, h.gk);
    if (gv) rows_out(dt, g, TD__ATT_GV, b, gv, S, Ev, h.gv);
  }
  half_bufs_free(&h);
  return TD_OK;
}

td_status td__cpu_attention(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                            const void *v, void *y, void *probs) {
  if (g->nb == 0 || g->L == 0) return TD_OK;
  if (td__dtype_is_half(dt)) return attention_half(dt, g, q, k, v, y, probs);
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "attention: CPU kernel does not support %s",
                        td_dtype_name(dt));
  void *scr = td__calloc(scratch_elems(g, false), td_dtype_size(dt));
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
  if (g->nb == 0) return TD_OK;
  if (td__dtype_is_half(dt))
    return attention_backward_half(dt, g, q, k, v, probs, gy, gq, gk, gv);
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "attention backward: CPU kernel does not support %s",
                        td_dtype_name(dt));
  void *scr = td__calloc(scratch_elems(g, true), td_dtype_size(dt));
  if (!scr) return td_set_error(TD_ERR_NOMEM, "attention backward: out of memory");
  for (int64_t b = 0; b < g->nb; b++) {
    if (dt == TD_DTYPE_F32) attn_bwd_float(g, b, q, k, v, probs, gy, gq, gk, gv, scr);
    else attn_bwd_double(g, b, q, k, v, probs, gy, gq, gk, gv, scr);
  }
  td__free(scr);
  return TD_OK;
}
