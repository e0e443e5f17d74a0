/* cuda_attention.cu - fused scaled-dot-product attention on CUDA (the backend's attention_lse
 * entries), flash-attention style: the L x S scores are never stored. The forward keeps, per query
 * row, the log-sum-exp of its scaled scores (lse); the backward recomputes each probability as
 * exp(s - lse) and needs the forward's output y for D_i = gy_i . y_i:
 *
 *   forward   s_j = scale q_i . k_j (j < n_i);  m, l = running max and sum of exp(s - m);
 *             y_i = sum_j exp(s_j - m) v_j / l;  lse_i = m + log(l)
 *   backward  p_ij = exp(s_ij - lse_i);  dp_ij = gy_i . v_j;  ds_ij = p_ij (dp_ij - D_i)
 *             gq_i = scale sum_j ds_ij k_j;  gk_j = scale sum_i ds_ij q_i;  gv_j = sum_i p_ij gy_i
 *
 * with n_i = min(i + 1, S) keys for row i under the causal mask (top-left aligned, as the CPU
 * kernel), S otherwise. Why a kernel of our own and not cuDNN 9's fused SDPA: see
 * docs/ARCHITECTURE.md, "CUDA".
 *
 * Two implementations:
 *   - the general kernels (any float dtype, head sizes E, Ev <= 256, any row strides): one warp
 *     per query row (forward, gq) or per key row (gk, gv). A lane owns one key (or query) of each
 *     chunk of 32 and computes its full dot products; the chunk's probabilities are broadcast
 *     with shuffles into the output accumulators, lane l holding elements l, l + 32, ... The
 *     backward's D_i runs first; gq and (gk, gv) are two kernels that each recompute the
 *     probabilities, so no atomics and no L x S buffer. 16-bit operands compute in float32,
 *     float64 in double; lse is float32 (float64 for float64).
 *   - bfloat16 / float16 with E = Ev = 64 (GPT-2's heads) and 16-byte aligned rows, on tensor
 *     cores (cuda_attention_tc.cuh, FlashAttention-2's layout: mma.sync m16n8k16 with float32
 *     accumulators and every fragment in registers): tiles of 64 queries x 64 keys per block of
 *     four warps (16 queries each) for the forward and the gq pass, 64 keys x 64 queries for the
 *     (gk, gv) pass; the online softmax works on the accumulators, whose layout is that of the
 *     next MMA's A operand. TD_CUDA_ATTENTION=simt forces the general kernels (tests compare the
 *     two).
 *
 * Batch offsets are computed on the device from td__attn_geom's batch dims and strides, so the
 * call copies nothing to the device and does not synchronise.
 */
#include "cuda_impl.h"

#include <mma.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kMaxHead = 256; /* E, Ev of the general kernels */
constexpr int kHeadRegs = kMaxHead / 32;
constexpr int kWarps = 4; /* warps per block of the general kernels */

/* The geometry as the kernels read it (by value). */
template <typename C> struct Geo {
  int64_t nb, L, S, E, Ev;
  int causal;
  C scale;
  int nbd;
  int64_t bshape[TD_MAX_DIMS];
  int64_t bstride[TD__ATT_N][TD_MAX_DIMS];
  int64_t rs[TD__ATT_N];
};

template <typename C> Geo<C> make_geo(const td__attn_geom *g) {
  Geo<C> d;
  memset(&d, 0, sizeof d);
  d.nb = g->nb, d.L = g->L, d.S = g->S, d.E = g->E, d.Ev = g->Ev;
  d.causal = g->causal ? 1 : 0;
  d.scale = (C)g->scale;
  d.nbd = g->nbd;
  for (int i = 0; i < g->nbd; i++) d.bshape[i] = g->bshape[i];
  for (int x = 0; x < TD__ATT_N; x++) {
    d.rs[x] = g->rs[x];
    for (int i = 0; i < g->nbd; i++) d.bstride[x][i] = g->bstride[x][i];
  }
  return d;
}

/* boff returns operand x's element offset of problem b. */
template <typename C> __device__ __forceinline__ int64_t boff(const Geo<C> &g, int x, int64_t b) {
  int64_t o = 0;
  for (int d = g.nbd - 1; d >= 0; d--) {
    int64_t s = g.bshape[d], q = b / s;
    o += (b - q * s) * g.bstride[x][d];
    b = q;
  }
  return o;
}

/* keys returns how many keys row i sees. */
template <typename C> __device__ __forceinline__ int64_t keys(const Geo<C> &g, int64_t i) {
  return g.causal ? (i + 1 < g.S ? i + 1 : g.S) : g.S;
}

template <typename T, typename C>
__device__ __forceinline__ C dot_row(const C *a, const T *b, int64_t n) {
  C s = 0;
  for (int64_t e = 0; e < n; e++) s += a[e] * (C)td__ld(b[e]);
  return s;
}

template <typename C> __device__ __forceinline__ C cexp(C x) { return exp(x); }

/* ---- general kernels ---- */

/* Forward: one warp per query row; dynamic shared memory: kWarps rows of E values (q). */
template <typename T>
__global__ void attn_fwd_kernel(Geo<Cmp<T>> g, const T *q, const T *k, const T *v, T *y,
                                Cmp<T> *lse) {
  using C = Cmp<T>;
  extern __shared__ unsigned char smem_raw[];
  C *qs = (C *)smem_raw + (threadIdx.x >> 5) * g.E;
  const int lane = threadIdx.x & 31;
  const int64_t rows = g.nb * g.L;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += nwarps) {
    const int64_t b = row / g.L, i = row - b * g.L, n = keys(g, i);
    const T *qr = q + boff(g, TD__ATT_Q, b) + i * g.rs[TD__ATT_Q];
    const T *kb = k + boff(g, TD__ATT_K, b), *vb = v + boff(g, TD__ATT_V, b);
    T *yr = y + boff(g, TD__ATT_Y, b) + i * g.rs[TD__ATT_Y];
    __syncwarp();
    for (int64_t e = lane; e < g.E; e += 32) qs[e] = (C)td__ld(qr[e]) * g.scale;
    __syncwarp();
    C acc[kHeadRegs];
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) acc[t] = 0;
    C m = -(C)INFINITY, l = 0;
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const int64_t j = j0 + lane;
      C s = j < n ? dot_row(qs, kb + j * g.rs[TD__ATT_K], g.E) : -(C)INFINITY;
      C mn = td__cu_max_nan(m, td__cu_warp_max(s)); /* finite: lane 0's key is valid */
      C alpha = cexp(m - mn), p = j < n ? cexp(s - mn) : (C)0;
      l = l * alpha + td__cu_warp_sum(p);
      m = mn;
      const int cnt = (int)(n - j0 < 32 ? n - j0 : 32);
#pragma unroll
      for (int t = 0; t < kHeadRegs; t++) acc[t] *= alpha;
      for (int u = 0; u < cnt; u++) {
        C pu = __shfl_sync(0xffffffffu, p, u);
        const T *vr = vb + (j0 + u) * g.rs[TD__ATT_V];
#pragma unroll
        for (int t = 0; t < kHeadRegs; t++) {
          int64_t e = lane + 32 * t;
          if (e < g.Ev) acc[t] += pu * (C)td__ld(vr[e]);
        }
      }
    }
    C inv = (C)1 / l;
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) {
      int64_t e = lane + 32 * t;
      if (e < g.Ev) yr[e] = Cvt<T>::st((Cmp<T>)(acc[t] * inv));
    }
    if (lse && lane == 0) lse[row] = m + log(l);
  }
}

/* D_i = gy_i . y_i (one warp per row). */
template <typename T>
__global__ void attn_d_kernel(Geo<Cmp<T>> g, const T *y, const T *gy, Cmp<T> *D) {
  using C = Cmp<T>;
  const int lane = threadIdx.x & 31;
  const int64_t rows = g.nb * g.L;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += nwarps) {
    const int64_t b = row / g.L, i = row - b * g.L;
    const T *yr = y + boff(g, TD__ATT_Y, b) + i * g.rs[TD__ATT_Y];
    const T *gr = gy + boff(g, TD__ATT_GY, b) + i * g.rs[TD__ATT_GY];
    C s = 0;
    for (int64_t e = lane; e < g.Ev; e += 32) s += (C)td__ld(yr[e]) * (C)td__ld(gr[e]);
    s = td__cu_warp_sum(s);
    if (lane == 0) D[row] = s;
  }
}

/* gq: one warp per query row; shared memory: kWarps x (E + Ev) values (q scaled, gy). */
template <typename T>
__global__ void attn_dq_kernel(Geo<Cmp<T>> g, const T *q, const T *k, const T *v, const T *gy,
                               const Cmp<T> *lse, const Cmp<T> *D, T *gq) {
  using C = Cmp<T>;
  extern __shared__ unsigned char smem_raw[];
  C *qs = (C *)smem_raw + (threadIdx.x >> 5) * (g.E + g.Ev), *gs = qs + g.E;
  const int lane = threadIdx.x & 31;
  const int64_t rows = g.nb * g.L;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += nwarps) {
    const int64_t b = row / g.L, i = row - b * g.L, n = keys(g, i);
    const T *qr = q + boff(g, TD__ATT_Q, b) + i * g.rs[TD__ATT_Q];
    const T *gr = gy + boff(g, TD__ATT_GY, b) + i * g.rs[TD__ATT_GY];
    const T *kb = k + boff(g, TD__ATT_K, b), *vb = v + boff(g, TD__ATT_V, b);
    T *out = gq + boff(g, TD__ATT_GQ, b) + i * g.rs[TD__ATT_GQ];
    __syncwarp();
    for (int64_t e = lane; e < g.E; e += 32) qs[e] = (C)td__ld(qr[e]) * g.scale;
    for (int64_t e = lane; e < g.Ev; e += 32) gs[e] = (C)td__ld(gr[e]);
    __syncwarp();
    const C li = lse[row], di = D[row];
    C acc[kHeadRegs];
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) acc[t] = 0;
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
      const int64_t j = j0 + lane;
      C ds = 0;
      if (j < n) {
        C p = cexp(dot_row(qs, kb + j * g.rs[TD__ATT_K], g.E) - li);
        C dp = dot_row(gs, vb + j * g.rs[TD__ATT_V], g.Ev);
        ds = p * (dp - di);
      }
      const int cnt = (int)(n - j0 < 32 ? n - j0 : 32);
      for (int u = 0; u < cnt; u++) {
        C du = __shfl_sync(0xffffffffu, ds, u);
        const T *kr = kb + (j0 + u) * g.rs[TD__ATT_K];
#pragma unroll
        for (int t = 0; t < kHeadRegs; t++) {
          int64_t e = lane + 32 * t;
          if (e < g.E) acc[t] += du * (C)td__ld(kr[e]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) {
      int64_t e = lane + 32 * t;
      if (e < g.E) out[e] = Cvt<T>::st((Cmp<T>)(acc[t] * g.scale));
    }
  }
}

/* gk, gv: one warp per key row j, over the query rows that see it (i >= j when causal); shared
 * memory: kWarps x (E + Ev) values (k, v). Either output may be NULL. */
template <typename T>
__global__ void attn_dkv_kernel(Geo<Cmp<T>> g, const T *q, const T *k, const T *v, const T *gy,
                                const Cmp<T> *lse, const Cmp<T> *D, T *gk, T *gv) {
  using C = Cmp<T>;
  extern __shared__ unsigned char smem_raw[];
  C *ks = (C *)smem_raw + (threadIdx.x >> 5) * (g.E + g.Ev), *vs = ks + g.E;
  const int lane = threadIdx.x & 31;
  const int64_t rows = g.nb * g.S;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
       row += nwarps) {
    const int64_t b = row / g.S, j = row - b * g.S;
    const T *kr = k + boff(g, TD__ATT_K, b) + j * g.rs[TD__ATT_K];
    const T *vr = v + boff(g, TD__ATT_V, b) + j * g.rs[TD__ATT_V];
    const T *qb = q + boff(g, TD__ATT_Q, b), *gb = gy + boff(g, TD__ATT_GY, b);
    const C *lb = lse + b * g.L, *db = D + b * g.L;
    __syncwarp();
    for (int64_t e = lane; e < g.E; e += 32) ks[e] = (C)td__ld(kr[e]);
    for (int64_t e = lane; e < g.Ev; e += 32) vs[e] = (C)td__ld(vr[e]);
    __syncwarp();
    C ak[kHeadRegs], av[kHeadRegs];
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) ak[t] = av[t] = 0;
    const int64_t first = g.causal ? j : 0; /* row i sees key j iff j < keys(i) */
    for (int64_t i0 = first; i0 < g.L; i0 += 32) {
      const int64_t i = i0 + lane;
      C p = 0, ds = 0;
      if (i < g.L) {
        const T *qr = qb + i * g.rs[TD__ATT_Q], *gr = gb + i * g.rs[TD__ATT_GY];
        p = cexp(dot_row(ks, qr, g.E) * g.scale - lb[i]);
        ds = p * (dot_row(vs, gr, g.Ev) - db[i]);
      }
      const int cnt = (int)(g.L - i0 < 32 ? g.L - i0 : 32);
      for (int u = 0; u < cnt; u++) {
        C pu = __shfl_sync(0xffffffffu, p, u), du = __shfl_sync(0xffffffffu, ds, u);
        const T *qr = qb + (i0 + u) * g.rs[TD__ATT_Q], *gr = gb + (i0 + u) * g.rs[TD__ATT_GY];
#pragma unroll
        for (int t = 0; t < kHeadRegs; t++) {
          int64_t e = lane + 32 * t;
          if (e < g.E) ak[t] += du * (C)td__ld(qr[e]);
          if (e < g.Ev) av[t] += pu * (C)td__ld(gr[e]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kHeadRegs; t++) {
      int64_t e = lane + 32 * t;
      if (gk && e < g.E)
        gk[boff(g, TD__ATT_GK, b) + j * g.rs[TD__ATT_GK] + e] = Cvt<T>::st((C)(ak[t] * g.scale));
      if (gv && e < g.Ev)
        gv[boff(g, TD__ATT_GV, b) + j * g.rs[TD__ATT_GV] + e] = Cvt<T>::st((C)av[t]);
    }
  }
}

/* warp_grid returns the blocks of a warp-per-row kernel over rows rows (kWarps rows a block;
 * the kernels loop when the grid is capped). */
unsigned warp_grid(int64_t rows) { return td__cu_grid(rows, kWarps); }

template <typename T>
td_status fwd_simt(const td__attn_geom *g, const void *q, const void *k, const void *v, void *y,
                   void *lse) {
  using C = Cmp<T>;
  Geo<C> d = make_geo<C>(g);
  size_t sm = (size_t)kWarps * (size_t)g->E * sizeof(C);
  attn_fwd_kernel<T><<<warp_grid(g->nb * g->L), 32 * kWarps, sm>>>(
      d, (const T *)q, (const T *)k, (const T *)v, (T *)y, (C *)lse);
  return td__cu_check_launch("attention");
}

template <typename T>
td_status bwd_simt(int dev, const td__attn_geom *g, const void *q, const void *k, const void *v,
                   const void *y, const void *lse, const void *gy, void *gq, void *gk, void *gv) {
  using C = Cmp<T>;
  const char *op = "attention_backward";
  Geo<C> d = make_geo<C>(g);
  void *dbuf = nullptr;
  TD_TRY(td__cu_scratch_alloc(dev, (size_t)(g->nb * g->L > 0 ? g->nb * g->L : 1) * sizeof(C),
                              &dbuf));
  C *D = (C *)dbuf;
  td_status st = TD_OK;
  if (g->L > 0) {
    attn_d_kernel<T><<<warp_grid(g->nb * g->L), 32 * kWarps>>>(d, (const T *)y, (const T *)gy,
                                                               D);
    st = td__cu_check_launch(op);
  }
  size_t sm = (size_t)kWarps * (size_t)(g->E + g->Ev) * sizeof(C);
  if (st == TD_OK && gq && g->L > 0) {
    attn_dq_kernel<T><<<warp_grid(g->nb * g->L), 32 * kWarps, sm>>>(
        d, (const T *)q, (const T *)k, (const T *)v, (const T *)gy, (const C *)lse, D, (T *)gq);
    st = td__cu_check_launch(op);
  }
  if (st == TD_OK && (gk || gv) && g->S > 0) {
    attn_dkv_kernel<T><<<warp_grid(g->nb * g->S), 32 * kWarps, sm>>>(
        d, (const T *)q, (const T *)k, (const T *)v, (const T *)gy, (const C *)lse, D, (T *)gk,
        (T *)gv);
    st = td__cu_check_launch(op);
  }
  td__cu_scratch_free(dev, dbuf);
  return st;
}

/* simt_only: TD_CUDA_ATTENTION=simt (read at every call, so a test can compare both paths). */
bool simt_only() {
  const char *e = getenv("TD_CUDA_ATTENTION");
  return e && !strcmp(e, "simt");
}

td_status check_geom(const char *op, const td__attn_geom *g) {
  if (g->E > kMaxHead || g->Ev > kMaxHead)
    return td_set_error(TD_ERR_UNSUPPORTED, "cuda %s: head sizes E=%lld, Ev=%lld: at most %d "
                        "per head on CUDA", op, (long long)g->E, (long long)g->Ev, kMaxHead);
  if (g->nbd > TD_MAX_DIMS - 2 || g->nbd < 0)
    return td_set_error(TD_ERR_INTERNAL, "cuda %s: %d batch dims", op, g->nbd);
  return TD_OK;
}

td_status enter_ptr(const char *op, const void *p, int *dev) {
  TD_TRY(td__cu_device_of(p, op, dev));
  return td__cu_set_device(*dev, op);
}

} /* namespace */

/* Tensor-core kernels (below, cuda_attention_tc.cuh). */
#include "cuda_attention_tc.cuh"

td_status td__cu_attention(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                           const void *v, void *y, void *lse) {
  const char *op = "attention";
  if (g->nb == 0 || g->L == 0) return TD_OK;
  TD_TRY(check_geom(op, g));
  int dev = 0;
  TD_TRY(enter_ptr(op, y, &dev));
  if (td__cu_is_half(dt) && !simt_only() && tc_fits(g, q, k, v, y, nullptr))
    return dt == TD_DTYPE_BF16 ? tc_fwd<td_bf16>(g, q, k, v, y, lse)
                               : tc_fwd<td_f16>(g, q, k, v, y, lse);
  switch (dt) {
    case TD_DTYPE_F32: return fwd_simt<float>(g, q, k, v, y, lse);
    case TD_DTYPE_F64: return fwd_simt<double>(g, q, k, v, y, lse);
    case TD_DTYPE_BF16: return fwd_simt<td_bf16>(g, q, k, v, y, lse);
    case TD_DTYPE_F16: return fwd_simt<td_f16>(g, q, k, v, y, lse);
    default: break;
  }
  return td_set_error(TD_ERR_DTYPE, "cuda attention: %s is not supported", td_dtype_name(dt));
}

td_status td__cu_attention_backward(td_dtype dt, const td__attn_geom *g, const void *q,
                                    const void *k, const void *v, const void *y, const void *lse,
                                    const void *gy, void *gq, void *gk, void *gv) {
  const char *op = "attention_backward";
  if (g->nb == 0 || (!gq && !gk && !gv)) return TD_OK;
  TD_TRY(check_geom(op, g));
  int dev = 0;
  TD_TRY(enter_ptr(op, gy, &dev));
  if (g->L == 0) { /* no query: the key gradients are zero */
    size_t es = td_dtype_size(dt);
    for (int x = TD__ATT_GK; x <= TD__ATT_GV; x++) {
      void *p = x == TD__ATT_GK ? gk : gv;
      int64_t w = x == TD__ATT_GK ? g->E : g->Ev;
      if (!p) continue;
      for (int64_t b = 0; b < g->nb; b++)
        for (int64_t j = 0; j < g->S; j++) {
          cudaError_t e = cudaMemsetAsync((char *)p + (g->off[x][b] + j * g->rs[x]) * es, 0,
                                          (size_t)w * es, 0);
          if (e != cudaSuccess) return td__cu_error(e, op);
        }
    }
    return TD_OK;
  }
  if (td__cu_is_half(dt) && !simt_only() && tc_fits(g, q, k, v, y, gy))
    return dt == TD_DTYPE_BF16 ? tc_bwd<td_bf16>(dev, g, q, k, v, y, lse, gy, gq, gk, gv)
                               : tc_bwd<td_f16>(dev, g, q, k, v, y, lse, gy, gq, gk, gv);
  switch (dt) {
    case TD_DTYPE_F32: return bwd_simt<float>(dev, g, q, k, v, y, lse, gy, gq, gk, gv);
    case TD_DTYPE_F64: return bwd_simt<double>(dev, g, q, k, v, y, lse, gy, gq, gk, gv);
    case TD_DTYPE_BF16: return bwd_simt<td_bf16>(dev, g, q, k, v, y, lse, gy, gq, gk, gv);
    case TD_DTYPE_F16: return bwd_simt<td_f16>(dev, g, q, k, v, y, lse, gy, gq, gk, gv);
    default: break;
  }
  return td_set_error(TD_ERR_DTYPE, "cuda attention backward: %s is not supported",
                      td_dtype_name(dt));
}
