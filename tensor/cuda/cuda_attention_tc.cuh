/* cuda_attention_tc.cuh - the tensor-core attention kernels of cuda_attention.cu (included there,
 * inside its translation unit; see its file comment for the algorithm).
 *
 * bfloat16 / float16, head size 64, tiles of 64 rows; a block is four warps, warp w owning the
 * tile's rows 16w .. 16w + 15. WMMA 16x16x16 with float32 accumulators does every product; the
 * elementwise steps (scale, causal mask, online softmax, the probabilities' and score gradients'
 * rounding to the 16-bit dtype before their MMAs, as FlashAttention-2 does) run on the warp's
 * rows in shared memory, lane pair (2r, 2r + 1) owning row r, lane 2r + h its columns 32h ..
 * 32h + 31. Operand tiles are loaded with 16-byte reads (rows 16-byte aligned: tc_fits), rows past
 * L or S as zeros.
 *
 *   forward: per query tile, over key tiles up to the tile's last row (causal) or S: S = Q K^T,
 *            online softmax, O = alpha O + P V (O kept in shared memory: it is rescaled by rows);
 *   gq:      per query tile, over the same key tiles: S = Q K^T, dP = dO V^T, dS = P (dP - D),
 *            dQ += dS K (accumulators in registers across tiles);
 *   gk, gv:  per key tile, over the query tiles at or after it (causal) or all: S^T = K Q^T,
 *            dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
 * D = rowsum(dO * O) comes from the general kernel attn_d_kernel first.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;  /* rows per tile and the head size */
constexpr int kTc = 128;   /* threads per block */
constexpr int kTileElems = kTile * kTile;
constexpr int kWarpElems = 16 * kTile; /* one warp's 16 rows of a tile */

template <typename T> struct WT;
template <> struct WT<td_bf16> { using type = __nv_bfloat16; };
template <> struct WT<td_f16> { using type = __half; };

template <typename T> __device__ __forceinline__ uint16_t to_bits(float v) {
  return Cvt<T>::st(v).x;
}

/* load_tile copies rows r0 .. r0 + 63 (64 elements each, rows rs apart from base) into dst
 * [64][64]; rows at or past limit are zeros. All threads of the block call it. */
__device__ __forceinline__ void load_tile(uint16_t *dst, const uint16_t *base, int64_t r0,
                                          int64_t limit, int64_t rs) {
  for (int idx = threadIdx.x; idx < kTile * 8; idx += kTc) {
    int row = idx >> 3, ch = idx & 7;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r0 + row < limit) val = *(const uint4 *)(base + (r0 + row) * rs + ch * 8);
    *(uint4 *)(dst + row * kTile + ch * 8) = val;
  }
}

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_frag;

/* mma_abt: acc[t] (+)= A (16 x 64, row-major, ld 64) times B^T where B is 64 x 64 row-major
 * (ld 64), column tile t of the result being rows 16t .. 16t + 15 of B. */
template <typename W>
__device__ __forceinline__ void mma_abt(acc_frag *acc, const W *a, const W *b) {
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + kk * 16, kTile);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, W, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, b + t * 16 * kTile + kk * 16, kTile);
      wmma::mma_sync(acc[t], fa, fb, acc[t]);
    }
  }
}

/* mma_ab: acc[t] (+)= A (16 x 64, row-major, ld 64) times B (64 x 64 row-major, ld 64), column
 * tile t of the result being columns 16t .. 16t + 15 of B. */
template <typename W>
__device__ __forceinline__ void mma_ab(acc_frag *acc, const W *a, const W *b) {
#pragma unroll
  for (int kk = 0; kk < 4; kk++) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + kk * 16, kTile);
#pragma unroll
    for (int t = 0; t < 4; t++) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, W, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, b + kk * 16 * kTile + t * 16, kTile);
      wmma::mma_sync(acc[t], fa, fb, acc[t]);
    }
  }
}

__device__ __forceinline__ void zero_acc(acc_frag *acc) {
#pragma unroll
  for (int t = 0; t < 4; t++) wmma::fill_fragment(acc[t], 0.0f);
}

__device__ __forceinline__ void store_acc(float *dst, const acc_frag *acc) {
#pragma unroll
  for (int t = 0; t < 4; t++) wmma::store_matrix_sync(dst + t * 16, acc[t], kTile, wmma::mem_row_major);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TD_TC_ARCH_OK 1
#else
#define TD_TC_ARCH_OK 0
#endif

/* Shared memory of the forward: Q, K, V tiles, per warp S (float) and O (float), P (16-bit). */
constexpr size_t kFwdSmem = 3 * kTileElems * 2 + 2 * 4 * kWarpElems * 4 + 4 * kWarpElems * 2;

template <typename T>
__global__ void __launch_bounds__(kTc) tc_fwd_kernel(Geo<float> g, const T *q, const T *k,
                                                     const T *v, T *y, float *lse) {
#if TD_TC_ARCH_OK
  using W = typename WT<T>::type;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Qs = (uint16_t *)tc_smem, *Ks = Qs + kTileElems, *Vs = Ks + kTileElems;
  float *Sf = (float *)(Vs + kTileElems), *Of = Sf + 4 * kWarpElems;
  uint16_t *Ps = (uint16_t *)(Of + 4 * kWarpElems);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.y, q0 = (int64_t)blockIdx.x * kTile;
  const uint16_t *kb = (const uint16_t *)(k + boff(g, TD__ATT_K, b));
  const uint16_t *vb = (const uint16_t *)(v + boff(g, TD__ATT_V, b));
  load_tile(Qs, (const uint16_t *)(q + boff(g, TD__ATT_Q, b)), q0, g.L, g.rs[TD__ATT_Q]);
  float *Sw = Sf + w * kWarpElems, *Ow = Of + w * kWarpElems;
  uint16_t *Pw = Ps + w * kWarpElems;
  const int r = lane >> 1, c0 = (lane & 1) * 32;
  const int64_t i = q0 + 16 * w + r;
  const int64_t n_i = i < g.L ? keys(g, i) : g.S; /* rows past L: any finite softmax */
  for (int c = 0; c < 32; c++) Ow[r * kTile + c0 + c] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t nblk = g.causal ? (q0 + kTile < g.S ? q0 + kTile : g.S) : g.S;
  for (int64_t j0 = 0; j0 < nblk; j0 += kTile) {
    __syncthreads(); /* the previous tile's K, V are no longer read */
    load_tile(Ks, kb, j0, g.S, g.rs[TD__ATT_K]);
    load_tile(Vs, vb, j0, g.S, g.rs[TD__ATT_V]);
    __syncthreads();
    acc_frag acc[4];
    zero_acc(acc);
    mma_abt<W>(acc, (const W *)Qs + 16 * w * kTile, (const W *)Ks);
    store_acc(Sw, acc);
    __syncwarp();
    float sv[32], mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; c++) {
      int64_t j = j0 + c0 + c;
      sv[c] = j < n_i ? Sw[r * kTile + c0 + c] * g.scale : -INFINITY;
      mx = td__cu_max_nan(mx, sv[c]);
    }
    mx = td__cu_max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mn = td__cu_max_nan(m, mx);
    const bool none = mn == -INFINITY; /* no visible key yet (cannot happen for a real row) */
    const float alpha = none ? 1.0f : expf(m - mn);
    float ps = 0.0f;
#pragma unroll
    for (int c = 0; c < 32; c++) {
      float p = none ? 0.0f : expf(sv[c] - mn);
      ps += p;
      Pw[r * kTile + c0 + c] = to_bits<T>(p);
      Ow[r * kTile + c0 + c] *= alpha;
    }
    ps += __shfl_xor_sync(0xffffffffu, ps, 1);
    l = l * alpha + ps;
    m = mn;
    __syncwarp();
#pragma unroll
    for (int t = 0; t < 4; t++) wmma::load_matrix_sync(acc[t], Ow + t * 16, kTile, wmma::mem_row_major);
    mma_ab<W>(acc, (const W *)Pw, (const W *)Vs);
    store_acc(Ow, acc);
    __syncwarp();
  }
  if (i < g.L) {
    const float inv = 1.0f / l;
    T *yr = y + boff(g, TD__ATT_Y, b) + i * g.rs[TD__ATT_Y];
    for (int c = 0; c < 32; c++) yr[c0 + c] = Cvt<T>::st(Ow[r * kTile + c0 + c] * inv);
    if (lse && (lane & 1) == 0) lse[b * g.L + i] = m + logf(l);
  }
#else
  __trap(); /* tc_fits keeps devices below compute capability 8.0 off this kernel */
#endif
}

/* gq: Q, dO, K, V tiles; per warp S and dP (float), dS (16-bit). */
constexpr size_t kDqSmem = 4 * kTileElems * 2 + 2 * 4 * kWarpElems * 4 + 4 * kWarpElems * 2;

template <typename T>
__global__ void __launch_bounds__(kTc) tc_dq_kernel(Geo<float> g, const T *q, const T *k,
                                                    const T *v, const T *gy, const float *lse,
                                                    const float *D, T *gq) {
#if TD_TC_ARCH_OK
  using W = typename WT<T>::type;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Qs = (uint16_t *)tc_smem, *Gs = Qs + kTileElems, *Ks = Gs + kTileElems;
  uint16_t *Vs = Ks + kTileElems;
  float *Sf = (float *)(Vs + kTileElems), *Df = Sf + 4 * kWarpElems;
  uint16_t *Ps = (uint16_t *)(Df + 4 * kWarpElems);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.y, q0 = (int64_t)blockIdx.x * kTile;
  const uint16_t *kb = (const uint16_t *)(k + boff(g, TD__ATT_K, b));
  const uint16_t *vb = (const uint16_t *)(v + boff(g, TD__ATT_V, b));
  load_tile(Qs, (const uint16_t *)(q + boff(g, TD__ATT_Q, b)), q0, g.L, g.rs[TD__ATT_Q]);
  load_tile(Gs, (const uint16_t *)(gy + boff(g, TD__ATT_GY, b)), q0, g.L, g.rs[TD__ATT_GY]);
  float *Sw = Sf + w * kWarpElems, *Dw = Df + w * kWarpElems;
  uint16_t *Pw = Ps + w * kWarpElems;
  const int r = lane >> 1, c0 = (lane & 1) * 32;
  const int64_t i = q0 + 16 * w + r;
  const bool real = i < g.L;
  const int64_t n_i = real ? keys(g, i) : 0;
  const float li = real ? lse[b * g.L + i] : 0.0f, di = real ? D[b * g.L + i] : 0.0f;
  acc_frag dq[4];
  zero_acc(dq);
  const int64_t nblk = g.causal ? (q0 + kTile < g.S ? q0 + kTile : g.S) : g.S;
  for (int64_t j0 = 0; j0 < nblk; j0 += kTile) {
    __syncthreads();
    load_tile(Ks, kb, j0, g.S, g.rs[TD__ATT_K]);
    load_tile(Vs, vb, j0, g.S, g.rs[TD__ATT_V]);
    __syncthreads();
    acc_frag acc[4];
    zero_acc(acc);
    mma_abt<W>(acc, (const W *)Qs + 16 * w * kTile, (const W *)Ks);
    store_acc(Sw, acc);
    zero_acc(acc);
    mma_abt<W>(acc, (const W *)Gs + 16 * w * kTile, (const W *)Vs);
    store_acc(Dw, acc);
    __syncwarp();
#pragma unroll 8
    for (int c = 0; c < 32; c++) {
      int64_t j = j0 + c0 + c;
      int e = r * kTile + c0 + c;
      float ds = 0.0f;
      if (j < n_i) {
        float p = expf(Sw[e] * g.scale - li);
        ds = p * (Dw[e] - di);
      }
      Pw[e] = to_bits<T>(ds);
    }
    __syncwarp();
    mma_ab<W>(dq, (const W *)Pw, (const W *)Ks);
  }
  store_acc(Sw, dq);
  __syncwarp();
  if (real) {
    T *out = gq + boff(g, TD__ATT_GQ, b) + i * g.rs[TD__ATT_GQ];
    for (int c = 0; c < 32; c++) out[c0 + c] = Cvt<T>::st(Sw[r * kTile + c0 + c] * g.scale);
  }
#else
  __trap();
#endif
}

/* gk, gv: K, V, Q, dO tiles; per warp S^T and dP^T (float), P^T and dS^T (16-bit); the query
 * tile's lse and D. */
constexpr size_t kDkvSmem =
    4 * kTileElems * 2 + 2 * 4 * kWarpElems * 4 + 2 * 4 * kWarpElems * 2 + 2 * kTile * 4;

template <typename T>
__global__ void __launch_bounds__(kTc) tc_dkv_kernel(Geo<float> g, const T *q, const T *k,
                                                     const T *v, const T *gy, const float *lse,
                                                     const float *D, T *gk, T *gv) {
#if TD_TC_ARCH_OK
  using W = typename WT<T>::type;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  uint16_t *Ks = (uint16_t *)tc_smem, *Vs = Ks + kTileElems, *Qs = Vs + kTileElems;
  uint16_t *Gs = Qs + kTileElems;
  float *Sf = (float *)(Gs + kTileElems), *Df = Sf + 4 * kWarpElems;
  uint16_t *Ps = (uint16_t *)(Df + 4 * kWarpElems), *Ds = Ps + 4 * kWarpElems;
  float *Ls = (float *)(Ds + 4 * kWarpElems), *Dd = Ls + kTile;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.y, k0 = (int64_t)blockIdx.x * kTile;
  const uint16_t *qb = (const uint16_t *)(q + boff(g, TD__ATT_Q, b));
  const uint16_t *gb = (const uint16_t *)(gy + boff(g, TD__ATT_GY, b));
  load_tile(Ks, (const uint16_t *)(k + boff(g, TD__ATT_K, b)), k0, g.S, g.rs[TD__ATT_K]);
  load_tile(Vs, (const uint16_t *)(v + boff(g, TD__ATT_V, b)), k0, g.S, g.rs[TD__ATT_V]);
  float *Sw = Sf + w * kWarpElems, *Dw = Df + w * kWarpElems;
  uint16_t *Pw = Ps + w * kWarpElems, *DSw = Ds + w * kWarpElems;
  const int r = lane >> 1, c0 = (lane & 1) * 32;
  const int64_t j = k0 + 16 * w + r;
  acc_frag dk[4], dv[4];
  zero_acc(dk);
  zero_acc(dv);
  /* row i sees key j iff j <= i (causal): query tiles before k0 see none of this tile */
  for (int64_t i0 = g.causal ? k0 : 0; i0 < g.L; i0 += kTile) {
    __syncthreads();
    load_tile(Qs, qb, i0, g.L, g.rs[TD__ATT_Q]);
    load_tile(Gs, gb, i0, g.L, g.rs[TD__ATT_GY]);
    if (threadIdx.x < kTile) {
      int64_t ii = i0 + threadIdx.x;
      Ls[threadIdx.x] = ii < g.L ? lse[b * g.L + ii] : 0.0f;
      Dd[threadIdx.x] = ii < g.L ? D[b * g.L + ii] : 0.0f;
    }
    __syncthreads();
    acc_frag acc[4];
    zero_acc(acc);
    mma_abt<W>(acc, (const W *)Ks + 16 * w * kTile, (const W *)Qs);
    store_acc(Sw, acc);
    zero_acc(acc);
    mma_abt<W>(acc, (const W *)Vs + 16 * w * kTile, (const W *)Gs);
    store_acc(Dw, acc);
    __syncwarp();
#pragma unroll 8
    for (int c = 0; c < 32; c++) {
      int ic = c0 + c;
      int64_t i = i0 + ic;
      int e = r * kTile + ic;
      float p = 0.0f, ds = 0.0f;
      if (j < g.S && i < g.L && (!g.causal || j <= i)) {
        p = expf(Sw[e] * g.scale - Ls[ic]);
        ds = p * (Dw[e] - Dd[ic]);
      }
      Pw[e] = to_bits<T>(p);
      DSw[e] = to_bits<T>(ds);
    }
    __syncwarp();
    mma_ab<W>(dv, (const W *)Pw, (const W *)Gs);
    mma_ab<W>(dk, (const W *)DSw, (const W *)Qs);
  }
  store_acc(Sw, dk);
  store_acc(Dw, dv);
  __syncwarp();
  if (j < g.S) {
    if (gk) {
      T *out = gk + boff(g, TD__ATT_GK, b) + j * g.rs[TD__ATT_GK];
      for (int c = 0; c < 32; c++) out[c0 + c] = Cvt<T>::st(Sw[r * kTile + c0 + c] * g.scale);
    }
    if (gv) {
      T *out = gv + boff(g, TD__ATT_GV, b) + j * g.rs[TD__ATT_GV];
      for (int c = 0; c < 32; c++) out[c0 + c] = Cvt<T>::st(Dw[r * kTile + c0 + c]);
    }
  }
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
