/* cuda_attention_tc.cuh - the tensor-core attention kernels of cuda_attention.cu (included there,
 * inside its translation unit; see its file comment for the algorithm).
 *
 * bfloat16 / float16, head size 64, tiles of 64 rows; a block is four warps, warp w owning the
 * tile's rows 16w .. 16w + 15, FlashAttention-2's layout: every product is an m16n8k16 MMA
 * (mma.sync, float32 accumulators) whose fragments live in registers. Operand tiles sit in shared
 * memory (cp.async copies, rows past L or S as zeros, rows kLd elements apart so that the ldmatrix
 * reads of 8 rows hit 8 different bank groups; the tiles a loop walks are double-buffered, the
 * next one loading while the current one is used) and reach the MMAs through ldmatrix (.trans
 * where the operand's k index runs along the tile's rows). Under the causal mask the forward and
 * gq blocks take the query tiles last to first (the longest first). Exponentials are the SFU's
 * (__expf). The scores' accumulators are in the layout of
 * the next MMA's A operand, so the probabilities (and score gradients) are rounded to the 16-bit
 * dtype and packed straight into A fragments, as FlashAttention-2 does; a thread holds two rows
 * (gr = lane / 4 and gr + 8) and of each 8-column slice the columns 2 (lane % 4) and +1, and a
 * row's max and sum are reduced over the 4 threads of its quad.
 *
 *   forward: per query tile, over key tiles up to the tile's last row (causal) or S: S = Q K^T,
 *            online softmax, O = alpha O + P V (O in registers);
 *   gq:      per query tile, over the same key tiles: S = Q K^T, dP = dO V^T, dS = P (dP - D),
 *            dQ += dS K;
 *   gk, gv:  per key tile, over the query tiles at or after it (causal) or all: S^T = K Q^T,
 *            dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
 * D = rowsum(dO * O) comes from the general kernel attn_d_kernel first.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kTile = 64; /* rows per tile and the head size */
constexpr int kTc = 128;  /* threads per block */
/* 16-bit tiles in shared memory are kLd elements (144 bytes) a row: with 128-byte rows the 8 rows
 * of an ldmatrix read would all start on the same bank group (8-way conflicts). */
constexpr int kLd = kTile + 8;
constexpr int kTileElems = kTile * kLd;

template <typename T> __device__ __forceinline__ uint16_t to_bits(float v) {
  return Cvt<T>::st(v).x;
}

/* pack2: two floats rounded to T, the first in the low half (the lower column, as MMA operands
 * and ldmatrix hold them). */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return (uint32_t)to_bits<T>(lo) | ((uint32_t)to_bits<T>(hi) << 16);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TD_TC_ARCH_OK 1
#else
#define TD_TC_ARCH_OK 0
#endif

#if TD_TC_ARCH_OK
__device__ __forceinline__ uint32_t smem_addr(const uint16_t *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* load_tile_async copies rows r0 .. r0 + 63 (64 elements each, rows rs apart from base) into dst
 * [64][kLd] through cp.async, 16 bytes a thread a step; rows at or past limit are zero-filled
 * (nothing is read for them). All threads of the block call it; each commits and waits for its
 * own copies, and a barrier makes the tile visible to all. */
__device__ __forceinline__ void load_tile_async(uint16_t *dst, const uint16_t *base, int64_t r0,
                                                int64_t limit, int64_t rs) {
  for (int idx = threadIdx.x; idx < kTile * 8; idx += kTc) {
    const int row = idx >> 3, ch = idx & 7;
    const bool in = r0 + row < limit;
    const uint16_t *src = in ? base + (r0 + row) * rs + ch * 8 : base;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     smem_addr(dst + row * kLd + ch * 8)),
                 "l"(src), "r"(in ? 16 : 0));
  }
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* async_wait<N>: until at most N of this thread's committed groups are still in flight */
template <int N> __device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* fexp: exp through the SFU (ex2.approx of x log2 e): a few ulp of float32, far below the 16-bit
 * rounding every probability goes through before its MMA. */
__device__ __forceinline__ float fexp(float x) { return __expf(x); }

/* ldsm4: four 8x8 matrices of 16-bit elements; lanes 8m .. 8m + 7 give the row addresses of
 * matrix m, and lane l receives row l / 4, columns 2 (l % 4) and +1 of each (ldsm4t: of each
 * matrix transposed). */
__device__ __forceinline__ void ldsm4(uint32_t *r, const uint16_t *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t *r, const uint16_t *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

/* mma: c (16 x 8, float32) += a (16 x 16, row-major fragment) b (16 x 8, column-major); TY is the
 * PTX name of T. */
#define TD_MMA16816(TY)                                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, "      \
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                                 \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct Mma {
  static __device__ __forceinline__ void run(float *c, const uint32_t *a, uint32_t b0,
                                             uint32_t b1) {
    if constexpr (std::is_same<T, td_bf16>::value) TD_MMA16816("bf16");
    else TD_MMA16816("f16");
  }
};
#undef TD_MMA16816

/* a_frag: the A fragment of rows r0 .. r0 + 15, columns k0 .. k0 + 15 of a [64][kLd] tile. */
__device__ __forceinline__ void a_frag(uint32_t *a, const uint16_t *tile, int r0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm4(a, tile + (r0 + (lane & 15)) * kLd + k0 + (lane >> 4) * 8);
}

/* mma_nt: acc[n] (16 x 8 each, n = 0 .. 7: 64 columns) += A (four k-steps of 16: the 64-wide
 * head) times B^T, B's rows (64 of them, the columns of the result) being the tile's rows and
 * the head running along them: S = Q K^T and its kin. */
template <typename T>
__device__ __forceinline__ void mma_nt(float (*acc)[4], const uint32_t (*a)[4],
                                       const uint16_t *tile) {
  const int lane = threadIdx.x & 31;
  const int row = (lane & 7) + ((lane >> 4) << 3), col = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
#pragma unroll
    for (int np = 0; np < 4; np++) {
      uint32_t b[4];
      ldsm4(b, tile + (np * 16 + row) * kLd + kk * 16 + col);
      Mma<T>::run(acc[2 * np], a[kk], b[0], b[1]);
      Mma<T>::run(acc[2 * np + 1], a[kk], b[2], b[3]);
    }
  }
}

/* mma_nn: acc[n] += P (16 x 64: the 16-bit packing of the score-shaped accumulators p) times B,
 * B (64 x 64) being the tile as stored (k along its rows): O += P V and its kin. */
template <typename T>
__device__ __forceinline__ void mma_nn(float (*acc)[4], const float (*p)[4],
                                       const uint16_t *tile) {
  const int lane = threadIdx.x & 31;
  const int row = (lane & 7) + ((lane >> 3) & 1) * 8, col = (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
    uint32_t a[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                     pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                     pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < 4; np++) {
      uint32_t b[4];
      ldsm4t(b, tile + (kk * 16 + row) * kLd + np * 16 + col);
      Mma<T>::run(acc[2 * np], a, b[0], b[1]);
      Mma<T>::run(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

__device__ __forceinline__ void zero8(float (*acc)[4]) {
#pragma unroll
  for (int n = 0; n < 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

/* quad_max / quad_sum: over the 4 threads of a quad (the threads sharing a row). */
__device__ __forceinline__ float quad_max(float v) {
  v = td__cu_max_nan(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return td__cu_max_nan(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/* store_rows: the 16 x 64 accumulators times f into rows r_lo (accumulator halves 0, 1) and
 * r_lo + 8 (halves 2, 3) of out (row stride rs), rows at or past limit left out. */
template <typename T>
__device__ __forceinline__ void store_rows(T *out, int64_t rs, int64_t r_lo, int64_t limit,
                                           const float (*acc)[4], float f_lo, float f_hi) {
  const int tg = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int64_t r = r_lo + 8 * h;
    if (r >= limit) continue;
    const float f = h ? f_hi : f_lo;
    T *row = out + r * rs;
#pragma unroll
    for (int n = 0; n < 8; n++) {
      row[n * 8 + tg * 2] = Cvt<T>::st(acc[n][2 * h] * f);
      row[n * 8 + tg * 2 + 1] = Cvt<T>::st(acc[n][2 * h + 1] * f);
    }
  }
}
#endif

/* Shared memory of the forward: the Q tile and two K, V tiles (the next pair loads while the
 * current one is used). */
constexpr size_t kFwdSmem = 5 * kTileElems * 2;

/* q_tile: the query tile of this block. Under the causal mask the last tiles see the most keys:
 * they start first, so the short ones fill the tail of the grid. */
__device__ __forceinline__ int64_t q_tile(const Geo<float> &g) {
  return (int64_t)(g.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kTile;
}

template <typename T>
__global__ void __launch_bounds__(kTc, 4) tc_fwd_kernel(Geo<float> g, const T *q, const T *k,
                                                     const T *v, T *y, float *lse) {
#if TD_TC_ARCH_OK
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Qs = (uint16_t *)tc_smem, *Kb = Qs + kTileElems, *Vb = Kb + 2 * kTileElems;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int64_t b = blockIdx.y, q0 = q_tile(g);
  const uint16_t *kb = (const uint16_t *)(k + boff(g, TD__ATT_K, b));
  const uint16_t *vb = (const uint16_t *)(v + boff(g, TD__ATT_V, b));
  const int64_t nblk = g.causal ? (q0 + kTile < g.S ? q0 + kTile : g.S) : g.S;
  load_tile_async(Qs, (const uint16_t *)(q + boff(g, TD__ATT_Q, b)), q0, g.L, g.rs[TD__ATT_Q]);
  if (nblk > 0) {
    load_tile_async(Kb, kb, 0, g.S, g.rs[TD__ATT_K]);
    load_tile_async(Vb, vb, 0, g.S, g.rs[TD__ATT_V]);
  }
  async_commit();
  async_wait<0>();
  __syncthreads();
  uint32_t qa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; kk++) a_frag(qa[kk], Qs, 16 * w, 16 * kk);
  const int64_t i_lo = q0 + 16 * w + gr, i_hi = i_lo + 8;
  /* rows past L: any finite softmax */
  const int64_t n_lo = i_lo < g.L ? keys(g, i_lo) : g.S, n_hi = i_hi < g.L ? keys(g, i_hi) : g.S;
  float o[8][4];
  zero8(o);
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;
  for (int64_t j0 = 0, t = 0; j0 < nblk; j0 += kTile, t++) {
    const uint16_t *Ks = Kb + (t & 1) * kTileElems, *Vs = Vb + (t & 1) * kTileElems;
    if (j0 + kTile < nblk) { /* the next pair, into the buffers the previous tile used */
      load_tile_async(Kb + ((t + 1) & 1) * kTileElems, kb, j0 + kTile, g.S, g.rs[TD__ATT_K]);
      load_tile_async(Vb + ((t + 1) & 1) * kTileElems, vb, j0 + kTile, g.S, g.rs[TD__ATT_V]);
      async_commit();
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads(); /* this tile's K, V are in */
    float s[8][4];
    zero8(s);
    mma_nt<T>(s, qa, Ks);
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
    for (int n = 0; n < 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int64_t j = j0 + n * 8 + tg * 2 + e;
        s[n][e] = j < n_lo ? s[n][e] * g.scale : -INFINITY;
        s[n][2 + e] = j < n_hi ? s[n][2 + e] * g.scale : -INFINITY;
        mx_lo = td__cu_max_nan(mx_lo, s[n][e]);
        mx_hi = td__cu_max_nan(mx_hi, s[n][2 + e]);
      }
    }
    const float mn_lo = td__cu_max_nan(m_lo, quad_max(mx_lo));
    const float mn_hi = td__cu_max_nan(m_hi, quad_max(mx_hi));
    /* no visible key yet (cannot happen for a real row) */
    const bool none_lo = mn_lo == -INFINITY, none_hi = mn_hi == -INFINITY;
    const float a_lo = none_lo ? 1.0f : fexp(m_lo - mn_lo);
    const float a_hi = none_hi ? 1.0f : fexp(m_hi - mn_hi);
    float ps_lo = 0.0f, ps_hi = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        s[n][e] = none_lo ? 0.0f : fexp(s[n][e] - mn_lo);
        s[n][2 + e] = none_hi ? 0.0f : fexp(s[n][2 + e] - mn_hi);
        ps_lo += s[n][e];
        ps_hi += s[n][2 + e];
      }
      o[n][0] *= a_lo, o[n][1] *= a_lo, o[n][2] *= a_hi, o[n][3] *= a_hi;
    }
    l_lo = l_lo * a_lo + quad_sum(ps_lo);
    l_hi = l_hi * a_hi + quad_sum(ps_hi);
    m_lo = mn_lo, m_hi = mn_hi;
    mma_nn<T>(o, s, Vs);
    __syncthreads(); /* every warp is done with this tile's buffers */
  }
  store_rows<T>(y + boff(g, TD__ATT_Y, b), g.rs[TD__ATT_Y], i_lo, g.L, o, 1.0f / l_lo,
                1.0f / l_hi);
  if (lse && tg == 0) {
    if (i_lo < g.L) lse[b * g.L + i_lo] = m_lo + logf(l_lo);
    if (i_hi < g.L) lse[b * g.L + i_hi] = m_hi + logf(l_hi);
  }
#else
  __trap(); /* tc_fits keeps devices below compute capability 8.0 off this kernel */
#endif
}

/* gq: Q, dO and two K, V tiles. */
constexpr size_t kDqSmem = 6 * kTileElems * 2;

template <typename T>
__global__ void __launch_bounds__(kTc, 3) tc_dq_kernel(Geo<float> g, const T *q, const T *k,
                                                    const T *v, const T *gy, const float *lse,
                                                    const float *D, T *gq) {
#if TD_TC_ARCH_OK
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Qs = (uint16_t *)tc_smem, *Gs = Qs + kTileElems, *Kb = Gs + kTileElems;
  uint16_t *Vb = Kb + 2 * kTileElems;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int64_t b = blockIdx.y, q0 = q_tile(g);
  const uint16_t *kb = (const uint16_t *)(k + boff(g, TD__ATT_K, b));
  const uint16_t *vb = (const uint16_t *)(v + boff(g, TD__ATT_V, b));
  const int64_t nblk = g.causal ? (q0 + kTile < g.S ? q0 + kTile : g.S) : g.S;
  load_tile_async(Qs, (const uint16_t *)(q + boff(g, TD__ATT_Q, b)), q0, g.L, g.rs[TD__ATT_Q]);
  load_tile_async(Gs, (const uint16_t *)(gy + boff(g, TD__ATT_GY, b)), q0, g.L,
                  g.rs[TD__ATT_GY]);
  if (nblk > 0) {
    load_tile_async(Kb, kb, 0, g.S, g.rs[TD__ATT_K]);
    load_tile_async(Vb, vb, 0, g.S, g.rs[TD__ATT_V]);
  }
  async_commit();
  async_wait<0>();
  __syncthreads();
  uint32_t qa[4][4], ga[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
    a_frag(qa[kk], Qs, 16 * w, 16 * kk);
    a_frag(ga[kk], Gs, 16 * w, 16 * kk);
  }
  const int64_t i_lo = q0 + 16 * w + gr, i_hi = i_lo + 8;
  const bool r_lo = i_lo < g.L, r_hi = i_hi < g.L;
  const int64_t n_lo = r_lo ? keys(g, i_lo) : 0, n_hi = r_hi ? keys(g, i_hi) : 0;
  const float li_lo = r_lo ? lse[b * g.L + i_lo] : 0.0f, di_lo = r_lo ? D[b * g.L + i_lo] : 0.0f;
  const float li_hi = r_hi ? lse[b * g.L + i_hi] : 0.0f, di_hi = r_hi ? D[b * g.L + i_hi] : 0.0f;
  float dq[8][4];
  zero8(dq);
  for (int64_t j0 = 0, t = 0; j0 < nblk; j0 += kTile, t++) {
    const uint16_t *Ks = Kb + (t & 1) * kTileElems, *Vs = Vb + (t & 1) * kTileElems;
    if (j0 + kTile < nblk) {
      load_tile_async(Kb + ((t + 1) & 1) * kTileElems, kb, j0 + kTile, g.S, g.rs[TD__ATT_K]);
      load_tile_async(Vb + ((t + 1) & 1) * kTileElems, vb, j0 + kTile, g.S, g.rs[TD__ATT_V]);
      async_commit();
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads();
    float s[8][4], dp[8][4];
    zero8(s);
    zero8(dp);
    mma_nt<T>(s, qa, Ks);
    mma_nt<T>(dp, ga, Vs);
#pragma unroll
    for (int n = 0; n < 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int64_t j = j0 + n * 8 + tg * 2 + e;
        s[n][e] = j < n_lo ? fexp(s[n][e] * g.scale - li_lo) * (dp[n][e] - di_lo) : 0.0f;
        s[n][2 + e] =
            j < n_hi ? fexp(s[n][2 + e] * g.scale - li_hi) * (dp[n][2 + e] - di_hi) : 0.0f;
      }
    }
    mma_nn<T>(dq, s, Ks);
    __syncthreads();
  }
  store_rows<T>(gq + boff(g, TD__ATT_GQ, b), g.rs[TD__ATT_GQ], i_lo, g.L, dq, g.scale, g.scale);
#else
  __trap();
#endif
}

/* gk, gv: K, V and two Q, dO tiles with their lse and D. */
constexpr size_t kDkvSmem = 6 * kTileElems * 2 + 4 * kTile * 4;

template <typename T>
__global__ void __launch_bounds__(kTc, 3) tc_dkv_kernel(Geo<float> g, const T *q, const T *k,
                                                     const T *v, const T *gy, const float *lse,
                                                     const float *D, T *gk, T *gv) {
#if TD_TC_ARCH_OK
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Ks = (uint16_t *)tc_smem, *Vs = Ks + kTileElems, *Qb = Vs + kTileElems;
  uint16_t *Gb = Qb + 2 * kTileElems;
  float *Lb = (float *)(Gb + 2 * kTileElems), *Db = Lb + 2 * kTile;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tg = lane & 3;
  const int64_t b = blockIdx.y, k0 = (int64_t)blockIdx.x * kTile;
  const uint16_t *qb = (const uint16_t *)(q + boff(g, TD__ATT_Q, b));
  const uint16_t *gb = (const uint16_t *)(gy + boff(g, TD__ATT_GY, b));
  const int64_t j_lo = k0 + 16 * w + gr, j_hi = j_lo + 8;
  float dk[8][4], dv[8][4];
  zero8(dk);
  zero8(dv);
  /* row i sees key j iff j < keys(i): query tiles before k0 see none of this tile (causal) */
  const int64_t first = g.causal ? k0 : 0;
  /* loads the query tile at i0 (Q, dO, lse, D) into buffer u */
  auto load_q = [&](int64_t i0, int u) {
    load_tile_async(Qb + u * kTileElems, qb, i0, g.L, g.rs[TD__ATT_Q]);
    load_tile_async(Gb + u * kTileElems, gb, i0, g.L, g.rs[TD__ATT_GY]);
    if (threadIdx.x < kTile) {
      int64_t ii = i0 + threadIdx.x;
      Lb[u * kTile + threadIdx.x] = ii < g.L ? lse[b * g.L + ii] : 0.0f;
      Db[u * kTile + threadIdx.x] = ii < g.L ? D[b * g.L + ii] : 0.0f;
    }
  };
  load_tile_async(Ks, (const uint16_t *)(k + boff(g, TD__ATT_K, b)), k0, g.S, g.rs[TD__ATT_K]);
  load_tile_async(Vs, (const uint16_t *)(v + boff(g, TD__ATT_V, b)), k0, g.S, g.rs[TD__ATT_V]);
  if (first < g.L) load_q(first, 0);
  async_commit();
  for (int64_t i0 = first, t = 0; i0 < g.L; i0 += kTile, t++) {
    const int u = (int)(t & 1);
    const uint16_t *Qs = Qb + u * kTileElems, *Gs = Gb + u * kTileElems;
    const float *Ls = Lb + u * kTile, *Dd = Db + u * kTile;
    if (i0 + kTile < g.L) {
      load_q(i0 + kTile, u ^ 1);
      async_commit();
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads();
    uint32_t a[4][4];
    float st[8][4], dpt[8][4];
    zero8(st);
    zero8(dpt);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) a_frag(a[kk], Ks, 16 * w, 16 * kk);
    mma_nt<T>(st, a, Qs);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) a_frag(a[kk], Vs, 16 * w, 16 * kk);
    mma_nt<T>(dpt, a, Gs);
#pragma unroll
    for (int n = 0; n < 8; n++) {
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int ic = n * 8 + tg * 2 + e;
        const int64_t i = i0 + ic;
        const int64_t n_i = i < g.L ? keys(g, i) : 0;
        const float li = Ls[ic], di = Dd[ic];
        float p = j_lo < n_i ? fexp(st[n][e] * g.scale - li) : 0.0f;
        st[n][e] = p;
        dpt[n][e] = p * (dpt[n][e] - di);
        p = j_hi < n_i ? fexp(st[n][2 + e] * g.scale - li) : 0.0f;
        st[n][2 + e] = p;
        dpt[n][2 + e] = p * (dpt[n][2 + e] - di);
      }
    }
    mma_nn<T>(dv, st, Gs);
    mma_nn<T>(dk, dpt, Qs);
    __syncthreads();
  }
  async_wait<0>(); /* no query tile at all: the K, V copies are still owed */
  if (gk) store_rows<T>(gk + boff(g, TD__ATT_GK, b), g.rs[TD__ATT_GK], j_lo, g.S, dk, g.scale,
                        g.scale);
  if (gv) store_rows<T>(gv + boff(g, TD__ATT_GV, b), g.rs[TD__ATT_GV], j_lo, g.S, dv, 1.0f, 1.0f);
#else
  __trap();
#endif
}

/* tc_arch returns whether the current device has bfloat16 tensor cores (8.0 and later). */
bool tc_arch() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 8;
}

/* operand_fits: 16-byte aligned base, and rows and batch entries a multiple of 8 elements apart,
 * so every row starts 16-byte aligned. */
bool operand_fits(const td__attn_geom *g, int x, const void *p) {
  if (!p || ((uintptr_t)p & 15) || (g->rs[x] & 7)) return false;
  for (int d = 0; d < g->nbd; d++)
    if (g->bstride[x][d] & 7) return false;
  return true;
}

/* tc_fits says whether the tensor-core kernels take this call (gy NULL: the forward). */
bool tc_fits(const td__attn_geom *g, const void *q, const void *k, const void *v, const void *y,
             const void *gy) {
  if (g->E != kTile || g->Ev != kTile || g->nb > 65535 || !tc_arch()) return false;
  if (!operand_fits(g, TD__ATT_Q, q) || !operand_fits(g, TD__ATT_K, k) ||
      !operand_fits(g, TD__ATT_V, v))
    return false;
  (void)y; /* written element by element in the forward; read by the D kernel, which is general */
  return !gy || operand_fits(g, TD__ATT_GY, gy);
}

template <typename K> td_status tc_smem(K kernel, size_t bytes, const char *op) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)bytes);
  return e == cudaSuccess ? TD_OK : td__cu_error(e, op);
}

template <typename T>
td_status tc_fwd(const td__attn_geom *g, const void *q, const void *k, const void *v, void *y,
                 void *lse) {
  const char *op = "attention";
  Geo<float> d = make_geo<float>(g);
  TD_TRY(tc_smem(tc_fwd_kernel<T>, kFwdSmem, op));
  dim3 grid((unsigned)((g->L + kTile - 1) / kTile), (unsigned)g->nb);
  tc_fwd_kernel<T><<<grid, kTc, kFwdSmem>>>(d, (const T *)q, (const T *)k, (const T *)v, (T *)y,
                                           (float *)lse);
  return td__cu_check_launch(op);
}

template <typename T>
td_status tc_bwd(int dev, const td__attn_geom *g, const void *q, const void *k, const void *v,
                 const void *y, const void *lse, const void *gy, void *gq, void *gk, void *gv) {
  const char *op = "attention_backward";
  Geo<float> d = make_geo<float>(g);
  void *dbuf = nullptr;
  TD_TRY(td__cu_scratch_alloc(dev, (size_t)(g->nb * g->L) * sizeof(float), &dbuf));
  float *D = (float *)dbuf;
  attn_d_kernel<T><<<warp_grid(g->nb * g->L), 32 * kWarps>>>(d, (const T *)y, (const T *)gy, D);
  td_status st = td__cu_check_launch(op);
  if (st == TD_OK && gq) {
    st = tc_smem(tc_dq_kernel<T>, kDqSmem, op);
    if (st == TD_OK) {
      dim3 grid((unsigned)((g->L + kTile - 1) / kTile), (unsigned)g->nb);
      tc_dq_kernel<T><<<grid, kTc, kDqSmem>>>(d, (const T *)q, (const T *)k, (const T *)v,
                                              (const T *)gy, (const float *)lse, D, (T *)gq);
      st = td__cu_check_launch(op);
    }
  }
  if (st == TD_OK && (gk || gv) && g->S > 0) {
    st = tc_smem(tc_dkv_kernel<T>, kDkvSmem, op);
    if (st == TD_OK) {
      dim3 grid((unsigned)((g->S + kTile - 1) / kTile), (unsigned)g->nb);
      tc_dkv_kernel<T><<<grid, kTc, kDkvSmem>>>(d, (const T *)q, (const T *)k, (const T *)v,
                                                (const T *)gy, (const float *)lse, D, (T *)gk,
                                                (T *)gv);
      st = td__cu_check_launch(op);
    }
  }
  td__cu_scratch_free(dev, dbuf);
  return st;
}

} /* namespace */
