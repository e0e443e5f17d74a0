/* cuda_impl.h - internals shared by the CUDA backend files (CUDA C++ only; never installed).
 *
 * The CUDA backend is the td__backend table td__cuda_backend (cuda_backend.cu). Its entries live
 * in these files, one family each:
 *   cuda_backend.cu      errors, device guard, host<->device copies, cuBLAS GEMM, the runtime's
 *                        device count, the table itself;
 *   cuda_alloc.cu        the caching allocator (C interface in cuda_alloc.h);
 *   cuda_elementwise.cu  strided copy / fill / binary / unary (+ backward), index_select/add;
 *   cuda_reduce.cu       sum and max over [outer, r, inner], softmax (+ backward), layer norm
 *                        (+ backward);
 *   cuda_nn.cu           NLL (+ backward), fused cross entropy (+ backward), im2col / col2im,
 *                        max pooling (+ backward);
 *   cuda_attention.cu    fused scaled-dot-product attention (+ backward), flash-attention style;
 *   cuda_optim.cu        multi-tensor Adam / AdamW and the sum of squares of a tensor list;
 *   cuda_lowp.cu         16-bit GEMMs through cuBLASLt, the float32 round trip of whole tensors;
 *   cuda_blas.c / .h     cuBLAS and cuBLASLt, loaded with dlopen on the first handle (a table
 *                        the GEMM files call through; not linked).
 *
 * Conventions:
 *   - Every entry first calls td__cu_enter() (or td__cu_set_device()) so the calling thread's
 *     current device is the tensor's device; host threads may call entries concurrently.
 *   - All work is issued on the legacy default stream of the device, so kernels, cuBLAS calls
 *     and the allocator's block reuse are ordered without explicit synchronisation; only the
 *     host<->device copies (and NLL's count read-back) block.
 *   - A failed CUDA call becomes a td_status with a td_set_error() message naming the backend
 *     entry and cudaGetErrorString() (td__cu_error()).
 *   - Kernels use grid-stride loops with 64-bit indices; block reductions assume blockDim.x is a
 *     multiple of 32 (at most 1024).
 */
#ifndef TD_TENSOR_CUDA_IMPL_H
#define TD_TENSOR_CUDA_IMPL_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

extern "C" {
#include "../tensor_impl.h"
}

/* Threads per block for elementwise kernels. */
#define TD_CU_THREADS 256
/* Most blocks in gridDim.x of any launch: kernels loop (grid-stride, or over rows) beyond it. */
#define TD_CU_MAX_BLOCKS (65535 * 32)

/* ---- errors and device selection (cuda_backend.cu) ---- */

/* td__cu_error turns a CUDA error into a td_status (TD_ERR_NOMEM for allocation failures,
 * TD_ERR_DEVICE for missing devices or drivers, TD_ERR_INTERNAL otherwise) with a message naming
 * op; it also clears the runtime's last-error slot. */
td_status td__cu_error(cudaError_t e, const char *op);
/* td__cu_check_launch reports the error of the last kernel launch, if any, as td__cu_error(). */
td_status td__cu_check_launch(const char *op);
/* td__cu_set_device makes device index the calling thread's current device. */
td_status td__cu_set_device(int index, const char *op);
/* td__cu_device_of returns in *index the device that owns device pointer p. */
td_status td__cu_device_of(const void *p, const char *op, int *index);
/* td__cu_enter checks that t lives on a CUDA device and makes that device current. */
td_status td__cu_enter(const char *op, const td_tensor *t);
/* td__cu_same_device returns TD_ERR_DEVICE naming op unless t (when not NULL) lives on the CUDA
 * device ref lives on. */
td_status td__cu_same_device(const char *op, const td_tensor *ref, const td_tensor *t);
/* td__cu_need_contig returns TD_ERR_INTERNAL naming op unless t (when not NULL) is contiguous
 * (the backend contract says the caller made it so). */
td_status td__cu_need_contig(const char *op, const td_tensor *t);

/* td__cu_vector returns the element count and element stride of a vector operand: a 1-d tensor
 * with any stride, or a contiguous tensor of any rank read in order (the CPU kernels go by
 * element counts, so the op layer may hand over either). */
td_status td__cu_vector(const char *op, const td_tensor *t, int64_t *n, int64_t *stride);

/* td__cu_scratch_alloc / td__cu_scratch_free take temporary device memory from the caching
 * allocator of device index (the current device). Freeing right after enqueueing the kernels
 * that use the block is safe: every user of the block runs on the same stream. */
td_status td__cu_scratch_alloc(int index, size_t nbytes, void **out);
void td__cu_scratch_free(int index, void *p);

/* ---- backend entries (one declaration per td__backend field) ---- */

td_status td__cu_copy(td_tensor *dst, const td_tensor *src);
td_status td__cu_fill(td_tensor *t, double value);
td_status td__cu_binary(td__binary_op op, const td_tensor *a, const td_tensor *b, td_tensor *out);
td_status td__cu_unary(td__unary_op op, const td_tensor *x, td_tensor *out, double p0, double p1);
td_status td__cu_unary_backward(td__unary_op op, const td_tensor *x, const td_tensor *y,
                                const td_tensor *gy, td_tensor *gx, double p0, double p1);
td_status td__cu_reduce_sum(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                            td_tensor *out);
td_status td__cu_reduce_max(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                            td_tensor *out, td_tensor *idx);
td_status td__cu_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner, bool log,
                         td_tensor *y);
td_status td__cu_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                  int64_t r, int64_t inner, bool log, td_tensor *gx);
td_status td__cu_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                     td_tensor *losses, int64_t *count);
td_status td__cu_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                              td_tensor *gx);
td_status td__cu_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                        int kw, int sh, int sw, int ph, int pw, void *col);
td_status td__cu_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                        int kw, int sh, int sw, int ph, int pw, void *gx);
td_status td__cu_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                            td_tensor *idx);
td_status td__cu_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx);
td_status td__cu_index_select(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                              const td_tensor *index, td_tensor *out);
td_status td__cu_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                           const td_tensor *index, const td_tensor *g);
td_status td__cu_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                            double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd);
td_status td__cu_layer_norm_backward(const td_tensor *gy, const td_tensor *x, const td_tensor *w,
                                     const td_tensor *mean, const td_tensor *rstd,
                                     td_tensor *gx, td_tensor *gw, td_tensor *gb);

/* td__cu_sum_raw sums contiguous x viewed as [outer, r, inner] over r into out [outer, inner]
 * (float or double, on the current device, which is index). Shared by reduce_sum and the layer
 * norm backward. */
td_status td__cu_sum_raw(td_dtype dt, int index, const void *x, int64_t outer, int64_t r,
                         int64_t inner, void *out);

/* 16-bit floats and fused kernels (cuda_lowp.cu, cuda_attention.cu, cuda_optim.cu). */
/* td__cu_gemm_lowp_bias: C [m, n] = op(A) op(B) + bias (bias [n] contiguous, added to every row
 * by cuBLASLt's epilogue), one matrix of bfloat16 / float16. TD_ERR_UNSUPPORTED (no error set)
 * when cuBLASLt has no algorithm for it: the caller then adds the bias itself. */
td_status td__cu_gemm_lowp_bias(td_dtype dt, int device, bool transa, bool transb, int64_t m,
                                int64_t n, int64_t k, const void *a, const void *b,
                                const void *bias, void *c);
td_status td__cu_gemm_lowp(td_dtype dt, int device, bool transa, bool transb, int64_t m,
                           int64_t n, int64_t k, double alpha, const void *a, int64_t stride_a,
                           const void *b, int64_t stride_b, double beta, void *c,
                           int64_t stride_c, int64_t batch);
td_status td__cu_attention(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                           const void *v, void *y, void *lse);
td_status td__cu_attention_backward(td_dtype dt, const td__attn_geom *g, const void *q,
                                    const void *k, const void *v, const void *y, const void *lse,
                                    const void *gy, void *gq, void *gk, void *gv);
td_status td__cu_adam(td_tensor *p, const td_tensor *g, td_tensor *m, td_tensor *v,
                      const td__adam_consts *c);
td_status td__cu_adam_multi(td_tensor *const *p, const td_tensor *const *g, td_tensor *const *m,
                            td_tensor *const *v, const td__adam_consts *c, int n);
td_status td__cu_sum_squares(const td_tensor *const *ts, int n, double *out);
td_status td__cu_cross_entropy(const td_tensor *logits, const td_tensor *target,
                               int64_t ignore_index, td_tensor *losses, td_tensor *lse,
                               int64_t *count);
td_status td__cu_cross_entropy_backward(const td_tensor *logits, const td_tensor *target,
                                        const td_tensor *lse, const td_tensor *gl,
                                        int64_t ignore_index, td_tensor *gx);

/* td__cu_up returns in *out a float32 copy of t on t's device when t is a 16-bit float tensor
 * (a new reference to t otherwise; NULL for NULL); td__cu_up_empty the same without copying the
 * values (for outputs); td__cu_down copies f back into t (rounding to t's dtype) when they
 * differ. The CUDA kernels without a 16-bit instantiation run on these float32 copies, as the
 * CPU's do (cpu_half.c): a 16-bit op gives the float32 op's result rounded once. */
td_status td__cu_up(const td_tensor *t, td_tensor **out);
td_status td__cu_up_empty(const td_tensor *t, td_tensor **out);
td_status td__cu_down(td_tensor *t, const td_tensor *f);

/* ---- small host helpers ---- */

static inline size_t td__cu_esize(td_dtype dt) { return td_dtype_size(dt); }

static inline bool td__cu_is_half(td_dtype dt) {
  return dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16;
}

/* td__cu_ptr returns the device address of t's element 0. */
static inline void *td__cu_ptr(const td_tensor *t) {
  return (char *)t->storage->data + t->offset * (int64_t)td__cu_esize(t->dtype);
}

static inline int td__cu_dev(const td_tensor *t) { return t->storage->device.index; }

static inline int64_t td__cu_numel(const td_tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

/* td__cu_grid returns a grid size for a grid-stride loop over n items. */
static inline unsigned td__cu_grid(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > TD_CU_MAX_BLOCKS) b = TD_CU_MAX_BLOCKS;
  return (unsigned)b;
}

/* td__cu_block_threads returns a power of two in [32, 256] covering n items when possible. */
static inline int td__cu_block_threads(int64_t n) {
  int t = 32;
  while (t < 256 && t < n) t <<= 1;
  return t;
}

/* ---- 16-bit floats on the device ----
 * Storage types (distinct from uint16_t so templates tell them apart) and conversions that give
 * the CPU's bits (half_convert.h): bfloat16 <-> float32 and float16 <-> float32 rounding to
 * nearest even, NaN kept quiet. Arithmetic on them is always float32 (Cmp<T>). */
struct td_bf16 {
  uint16_t x;
};
struct td_f16 {
  uint16_t x;
};

__device__ __forceinline__ float td__cu_bf16_to_f32(uint16_t h) {
  return __uint_as_float((uint32_t)h << 16);
}
__device__ __forceinline__ uint16_t td__cu_f32_to_bf16(float f) {
  uint32_t b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float td__cu_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (ex == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
  if (ex == 0) {
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return __uint_as_float(sign | ((ex + 112u) << 23) | (man << 13));
}
__device__ __forceinline__ uint16_t td__cu_f32_to_f16(float f) {
  uint32_t b = __float_as_uint(f), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    float m = __fmul_rn(__uint_as_float(a), 16777216.0f);
    uint32_t q = (uint32_t)m;
    float frac = __fsub_rn(m, (float)q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
  return (uint16_t)(sign | (r >> 13));
}

/* Cmp<T> is the type T computes in: float for the 16-bit floats, T itself otherwise. td__ld
 * loads an element into it, Cvt<T>::st rounds a value back to T. */
template <typename T> struct CmpT { using type = T; };
template <> struct CmpT<td_bf16> { using type = float; };
template <> struct CmpT<td_f16> { using type = float; };
template <typename T> using Cmp = typename CmpT<T>::type;

__device__ __forceinline__ float td__ld(float v) { return v; }
__device__ __forceinline__ double td__ld(double v) { return v; }
__device__ __forceinline__ int64_t td__ld(int64_t v) { return v; }
__device__ __forceinline__ float td__ld(td_bf16 v) { return td__cu_bf16_to_f32(v.x); }
__device__ __forceinline__ float td__ld(td_f16 v) { return td__cu_f16_to_f32(v.x); }

template <typename T> struct Cvt {
  static __device__ __forceinline__ T st(Cmp<T> v) { return v; }
};
template <> struct Cvt<td_bf16> {
  static __device__ __forceinline__ td_bf16 st(float v) { return td_bf16{td__cu_f32_to_bf16(v)}; }
};
template <> struct Cvt<td_f16> {
  static __device__ __forceinline__ td_f16 st(float v) { return td_f16{td__cu_f32_to_f16(v)}; }
};

/* ---- device helpers ---- */

#define TD_CU_LOOP(i, n)                                                                      \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                  \
       i += (int64_t)gridDim.x * blockDim.x)

template <typename T> __device__ __forceinline__ bool td__cu_isnan(T v) { return v != v; }
template <> __device__ __forceinline__ bool td__cu_isnan<int64_t>(int64_t) { return false; }

/* td__cu_lowest returns the identity of max: -inf for floats, INT64_MIN for int64. */
template <typename T> __device__ __forceinline__ T td__cu_lowest() { return -(T)INFINITY; }
template <> __device__ __forceinline__ int64_t td__cu_lowest<int64_t>() { return INT64_MIN; }

/* td__cu_max_nan is max(a, b) that propagates NaN. */
template <typename T> __device__ __forceinline__ T td__cu_max_nan(T a, T b) {
  return (a > b || td__cu_isnan(a)) ? a : b;
}

template <typename T> __device__ __forceinline__ T td__cu_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T> __device__ __forceinline__ T td__cu_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = td__cu_max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* td__cu_block_sum returns the sum of v over the block to every thread. Every thread of the
 * block must call it; the shared scratch may be reused right after it returns. */
template <typename T> __device__ T td__cu_block_sum(T v) {
  __shared__ T sh[33];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = td__cu_warp_sum(v);
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    T w = lane < nw ? sh[lane] : (T)0;
    w = td__cu_warp_sum(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  T r = sh[32];
  __syncthreads();
  return r;
}

/* td__cu_block_max is td__cu_block_sum for max (NaN propagates). */
template <typename T> __device__ T td__cu_block_max(T v) {
  __shared__ T sh[33];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = td__cu_warp_max(v);
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    T w = lane < nw ? sh[lane] : td__cu_lowest<T>();
    w = td__cu_warp_max(w);
    if (lane == 0) sh[32] = w;
  }
  __syncthreads();
  T r = sh[32];
  __syncthreads();
  return r;
}

/* td__cu_atomic_add adds v to *p (float and double natively on sm_60+; int64 as two's-complement
 * unsigned addition). */
__device__ __forceinline__ void td__cu_atomic_add(float *p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void td__cu_atomic_add(double *p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void td__cu_atomic_add(int64_t *p, int64_t v) {
  atomicAdd((unsigned long long *)p, (unsigned long long)v);
}

#endif
