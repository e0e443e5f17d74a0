/* cuda_elementwise.cu - strided elementwise kernels of the CUDA backend: copy (with dtype
 * conversion), fill, binary, unary and unary backward, plus the gather/scatter pair
 * index_select / index_add.
 *
 * Strided operands: the host folds the common shape and each operand's strides into a Geom (by
 * value, a few hundred bytes of kernel parameters). Size-1 dims are dropped and neighbouring dims
 * that are contiguous in every operand are merged, so the common contiguous case becomes one dim
 * and costs one multiply per element. Each thread turns a row-major linear index into one offset
 * per operand.
 *
 * dtypes follow the CPU backend: copy and fill take every dtype in any combination (same-dtype
 * copies and fills move the element's bytes; conversions between float32, float64 and int64 are
 * casts, float -> int64 as td__f2i64; float32 <-> bfloat16 / float16 have their own kernels, the
 * hot casts of autocast; every other pair goes through double like the CPU's td__load /
 * td__store); binary takes the floats and int64 (an int64 division by zero is TD_ERR_INVALID,
 * found with one extra synchronisation); unary takes floats, and int64 only for affine maps with
 * integral coefficients; unary_backward is float only; index_select gathers any dtype's bytes,
 * index_add takes float32, float64 and int64 (16-bit floats through float32 copies). bfloat16 and
 * float16 compute in float32 and round each result once, which is what the CPU gives (cpu_half.c).
 * MAX and MIN propagate NaN; float32 unary ops compute in float32 (the CPU computes in double and
 * rounds, so results may differ in the last bit).
 * Index kernels skip (index_add) or zero (index_select) out-of-range indices instead of faulting;
 * the op layer has already rejected them with a message.
 */
#include "cuda_impl.h"

#include <string.h>

#include <type_traits>

namespace {

template <int N> struct Geom {
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t st[N][TD_MAX_DIMS];
};

/* make_geom folds shape and the N operands' strides (see the file comment). */
template <int N>
Geom<N> make_geom(const int64_t *shape, int ndim, const int64_t *const *strides) {
  int64_t sh[TD_MAX_DIMS], st[N][TD_MAX_DIMS];
  int m = 0;
  for (int d = ndim - 1; d >= 0; d--) {
    if (shape[d] == 1) continue;
    if (m > 0) {
      bool merge = true;
      for (int k = 0; k < N; k++)
        if (strides[k][d] != st[k][m - 1] * sh[m - 1]) merge = false;
      if (merge) {
        sh[m - 1] *= shape[d];
        continue;
      }
    }
    sh[m] = shape[d];
    for (int k = 0; k < N; k++) st[k][m] = strides[k][d];
    m++;
  }
  Geom<N> g;
  memset(&g, 0, sizeof g);
  g.ndim = m;
  for (int j = 0; j < m; j++) {
    g.shape[j] = sh[m - 1 - j];
    for (int k = 0; k < N; k++) g.st[k][j] = st[k][m - 1 - j];
  }
  return g;
}

template <int N> bool geom_contiguous(const Geom<N> &g) {
  if (g.ndim == 0) return true;
  if (g.ndim > 1) return false;
  for (int k = 0; k < N; k++)
    if (g.st[k][0] != 1) return false;
  return true;
}

template <int N>
__device__ __forceinline__ void geom_offsets(const Geom<N> &g, int64_t i, int64_t *off) {
  if (g.ndim == 1) {
#pragma unroll
    for (int k = 0; k < N; k++) off[k] = i * g.st[k][0];
    return;
  }
#pragma unroll
  for (int k = 0; k < N; k++) off[k] = 0;
  for (int d = g.ndim - 1; d >= 0; d--) {
    int64_t s = g.shape[d], q = i / s, r = i - q * s;
    i = q;
#pragma unroll
    for (int k = 0; k < N; k++) off[k] += r * g.st[k][d];
  }
}

/* ---- 16-byte paths ----
 * Contiguous operands whose pointers are 16-byte aligned and whose size is a multiple of 8
 * elements take kernels that move 8 elements a thread a step with 16-byte loads and stores (one
 * 2-byte element per thread left the memory system mostly idle: GELU on bfloat16 ran at a fifth
 * of the bandwidth of a float32 add). Same arithmetic per element, so the same bits. */
template <typename T> union Vec8 {
  uint4 u[sizeof(T) / 2];
  T e[8];
};

/* vec8: the element count and pointers take the 16-byte kernels. */
__host__ bool vec8(int64_t n, const void *a, const void *b = nullptr, const void *c = nullptr) {
  return n % 8 == 0 && !((uintptr_t)a & 15) && !((uintptr_t)b & 15) && !((uintptr_t)c & 15);
}

#define TD_CU_LOOP8(i, n) TD_CU_LOOP(i, (n) / 8)

/* ---- copy ---- */

/* convert is the element conversion of copy between float32, float64 and int64: a cast, except
 * float -> int64, which follows the CPU (td__f2i64: INT64_MIN for NaN, +-inf and out-of-range
 * values; CUDA's cast saturates). */
template <typename Td, typename Ts> __device__ __forceinline__ Td convert(Ts v) {
  if constexpr (std::is_same<Td, int64_t>::value && std::is_floating_point<Ts>::value)
    return td__f2i64((double)v);
  return (Td)v;
}

template <typename Td, typename Ts>
__global__ void copy_kernel(Geom<2> g, int64_t n, Td *dst, const Ts *src) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    dst[o[0]] = convert<Td, Ts>(src[o[1]]);
  }
}

template <typename Td>
void launch_copy(td_dtype sdt, const Geom<2> &g, int64_t n, Td *dst, const void *src) {
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  switch (sdt) {
    case TD_DTYPE_F32:
      copy_kernel<<<grid, TD_CU_THREADS>>>(g, n, dst, (const float *)src);
      break;
    case TD_DTYPE_F64:
      copy_kernel<<<grid, TD_CU_THREADS>>>(g, n, dst, (const double *)src);
      break;
    case TD_DTYPE_I64:
      copy_kernel<<<grid, TD_CU_THREADS>>>(g, n, dst, (const int64_t *)src);
      break;
    default: break;
  }
}

/* Same-dtype copies move the element's bytes (NaN payloads kept, as on the CPU). */
template <typename U>
__global__ void copy_bits_kernel(Geom<2> g, int64_t n, U *dst, const U *src) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    dst[o[0]] = src[o[1]];
  }
}

/* float32 <-> 16-bit float: the hot conversions of autocast (weights down, activations up). */
template <typename H>
__global__ void copy_to_half_vec_kernel(int64_t n, H *dst, const float *src) {
  TD_CU_LOOP8(i, n) {
    Vec8<float> a;
    Vec8<H> o;
    a.u[0] = ((const uint4 *)src)[2 * i];
    a.u[1] = ((const uint4 *)src)[2 * i + 1];
#pragma unroll
    for (int e = 0; e < 8; e++) o.e[e] = Cvt<H>::st(a.e[e]);
    ((uint4 *)dst)[i] = o.u[0];
  }
}
template <typename H>
__global__ void copy_from_half_vec_kernel(int64_t n, float *dst, const H *src) {
  TD_CU_LOOP8(i, n) {
    Vec8<H> a;
    Vec8<float> o;
    a.u[0] = ((const uint4 *)src)[i];
#pragma unroll
    for (int e = 0; e < 8; e++) o.e[e] = td__ld(a.e[e]);
    ((uint4 *)dst)[2 * i] = o.u[0];
    ((uint4 *)dst)[2 * i + 1] = o.u[1];
  }
}
template <typename H>
__global__ void copy_to_half_kernel(Geom<2> g, int64_t n, H *dst, const float *src) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    dst[o[0]] = Cvt<H>::st(src[o[1]]);
  }
}
template <typename H>
__global__ void copy_from_half_kernel(Geom<2> g, int64_t n, float *dst, const H *src) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    dst[o[0]] = td__ld(src[o[1]]);
  }
}

/* Every other pair, element by element through double, as the CPU's copy_transport
 * (td__load / td__store): a 16-bit float is stored from the value rounded to float32 first. */
__device__ __forceinline__ double load_any(const void *b, int dt, int64_t i) {
  switch (dt) {
    case TD_DTYPE_F32: return ((const float *)b)[i];
    case TD_DTYPE_F64: return ((const double *)b)[i];
    case TD_DTYPE_I64: return (double)((const int64_t *)b)[i];
    case TD_DTYPE_F16: return td__cu_f16_to_f32(((const uint16_t *)b)[i]);
    case TD_DTYPE_BF16: return td__cu_bf16_to_f32(((const uint16_t *)b)[i]);
    case TD_DTYPE_I32: return ((const int32_t *)b)[i];
    case TD_DTYPE_U8: return ((const uint8_t *)b)[i];
    case TD_DTYPE_BOOL: return ((const uint8_t *)b)[i] != 0;
  }
  return 0;
}
__device__ __forceinline__ void store_any(void *b, int dt, int64_t i, double v) {
  switch (dt) {
    case TD_DTYPE_F32: ((float *)b)[i] = (float)v; break;
    case TD_DTYPE_F64: ((double *)b)[i] = v; break;
    case TD_DTYPE_I64: ((int64_t *)b)[i] = td__f2i64(v); break;
    case TD_DTYPE_F16: ((uint16_t *)b)[i] = td__cu_f32_to_f16((float)v); break;
    case TD_DTYPE_BF16: ((uint16_t *)b)[i] = td__cu_f32_to_bf16((float)v); break;
    case TD_DTYPE_I32: ((int32_t *)b)[i] = (int32_t)(uint32_t)(uint64_t)td__f2i64(v); break;
    case TD_DTYPE_U8: ((uint8_t *)b)[i] = (uint8_t)(uint64_t)td__f2i64(v); break;
    case TD_DTYPE_BOOL: ((uint8_t *)b)[i] = v != 0; break;
  }
}
__global__ void copy_any_kernel(Geom<2> g, int64_t n, void *dst, int ddt, const void *src,
                                int sdt) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    store_any(dst, ddt, o[0], load_any(src, sdt, o[1]));
  }
}

bool core_dtype(td_dtype dt) {
  return dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64 || dt == TD_DTYPE_I64;
}

/* ---- fill ---- */

/* Fills store the element's bytes, converted once on the host as the CPU does (td__store). */
template <typename U> __global__ void fill_kernel(Geom<1> g, int64_t n, U *p, U v) {
  TD_CU_LOOP(i, n) {
    int64_t o[1];
    geom_offsets(g, i, o);
    p[o[0]] = v;
  }
}

/* ---- binary ---- */

template <typename T, int OP> __device__ __forceinline__ T binop(T a, T b) {
  if constexpr (OP == TD__BIN_ADD) return a + b;
  if constexpr (OP == TD__BIN_SUB) return a - b;
  if constexpr (OP == TD__BIN_MUL) return a * b;
  if constexpr (OP == TD__BIN_DIV) {
    if constexpr (std::is_integral<T>::value) return b == 0 ? (T)0 : a / b;
    return a / b;
  }
  if constexpr (OP == TD__BIN_MAX) return (a > b || td__cu_isnan(a)) ? a : b;
  if constexpr (OP == TD__BIN_MIN) return (a < b || td__cu_isnan(a)) ? a : b;
  if constexpr (OP == TD__BIN_EQ) return a == b ? (T)1 : (T)0;
  if constexpr (OP == TD__BIN_GT) return a > b ? (T)1 : (T)0;
  return (T)0;
}

/* any_zero sets *flag when some element of b is 0 (int64 division check). */
__global__ void any_zero_kernel(Geom<1> g, int64_t n, const int64_t *b, int *flag) {
  TD_CU_LOOP(i, n) {
    int64_t o[1];
    geom_offsets(g, i, o);
    if (b[o[0]] == 0) *flag = 1;
  }
}

/* check_int_divisor returns TD_ERR_INVALID when int64 tensor b holds a zero, like the CPU backend
 * (this costs one synchronisation). */
td_status check_int_divisor(int dev, const td_tensor *b) {
  const char *op = "binary";
  int64_t n = td__cu_numel(b);
  const int64_t *strides[1] = {b->strides};
  Geom<1> g = make_geom<1>(b->shape, b->ndim, strides);
  void *scratch = nullptr;
  TD_TRY(td__cu_scratch_alloc(dev, sizeof(int), &scratch));
  int flag = 0;
  td_status st = TD_OK;
  cudaError_t e = cudaMemsetAsync(scratch, 0, sizeof(int), 0);
  if (e == cudaSuccess) {
    any_zero_kernel<<<td__cu_grid(n, TD_CU_THREADS), TD_CU_THREADS>>>(
        g, n, (const int64_t *)td__cu_ptr(b), (int *)scratch);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaMemcpy(&flag, scratch, sizeof flag, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) st = td__cu_error(e, op);
  else if (flag) st = td_set_error(TD_ERR_INVALID, "div: integer division by zero");
  td__cu_scratch_free(dev, scratch);
  return st;
}

template <typename T, int OP>
__global__ void binary_kernel(Geom<3> g, int64_t n, const T *a, const T *b, T *out) {
  TD_CU_LOOP(i, n) {
    int64_t o[3];
    geom_offsets(g, i, o);
    out[o[2]] = Cvt<T>::st(binop<Cmp<T>, OP>(td__ld(a[o[0]]), td__ld(b[o[1]])));
  }
}

/* binary_vec_kernel: contiguous float32 / 16-bit operands, 8 elements a thread a step. */
template <typename T, int OP>
__global__ void binary_vec_kernel(int64_t n, const T *a, const T *b, T *out) {
  constexpr int W = sizeof(T) / 2; /* 16-byte words per 8 elements */
  TD_CU_LOOP8(i, n) {
    Vec8<T> x, y, o;
#pragma unroll
    for (int w = 0; w < W; w++) {
      x.u[w] = ((const uint4 *)a)[W * i + w];
      y.u[w] = ((const uint4 *)b)[W * i + w];
    }
#pragma unroll
    for (int e = 0; e < 8; e++)
      o.e[e] = Cvt<T>::st(binop<Cmp<T>, OP>(td__ld(x.e[e]), td__ld(y.e[e])));
#pragma unroll
    for (int w = 0; w < W; w++) ((uint4 *)out)[W * i + w] = o.u[w];
  }
}

template <typename T>
bool launch_binary(td__binary_op op, const Geom<3> &g, int64_t n, const void *a, const void *b,
                   void *out) {
  const T *pa = (const T *)a, *pb = (const T *)b;
  T *po = (T *)out;
  constexpr bool vec_type = std::is_same<T, float>::value || std::is_same<T, td_bf16>::value ||
                            std::is_same<T, td_f16>::value;
  if (vec_type && geom_contiguous(g) && vec8(n, a, b, out)) {
    unsigned g8 = td__cu_grid(n / 8, TD_CU_THREADS);
#define TD_CU_BIN_VEC(OPC)                                                                    \
  case OPC: binary_vec_kernel<T, OPC><<<g8, TD_CU_THREADS>>>(n, pa, pb, po); return true;
    switch (op) {
      TD_CU_BIN_VEC(TD__BIN_ADD)
      TD_CU_BIN_VEC(TD__BIN_SUB)
      TD_CU_BIN_VEC(TD__BIN_MUL)
      default: break; /* the other ops take the general kernel */
    }
#undef TD_CU_BIN_VEC
  }
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
#define TD_CU_BIN_CASE(OPC)                                                                   \
  case OPC: binary_kernel<T, OPC><<<grid, TD_CU_THREADS>>>(g, n, pa, pb, po); return true;
  switch (op) {
    TD_CU_BIN_CASE(TD__BIN_ADD)
    TD_CU_BIN_CASE(TD__BIN_SUB)
    TD_CU_BIN_CASE(TD__BIN_MUL)
    TD_CU_BIN_CASE(TD__BIN_DIV)
    TD_CU_BIN_CASE(TD__BIN_MAX)
    TD_CU_BIN_CASE(TD__BIN_MIN)
    TD_CU_BIN_CASE(TD__BIN_EQ)
    TD_CU_BIN_CASE(TD__BIN_GT)
  }
#undef TD_CU_BIN_CASE
  return false;
}

/* ---- unary ---- */

template <typename C> __device__ __forceinline__ C sigmoid(C x) {
  if (x >= (C)0) return (C)1 / ((C)1 + exp(-x));
  C e = exp(x);
  return e / ((C)1 + e);
}

template <typename C> __device__ __forceinline__ C gelu_cdf(C x) {
  return (C)0.5 * ((C)1 + erf(x * (C)0.70710678118654752440));
}

template <typename C> __device__ __forceinline__ C unary_fwd(int op, C x, C p0, C p1) {
  switch (op) {
    case TD__UN_AFFINE: return p0 * x + p1;
    case TD__UN_POW: return p0 == (C)2 ? x * x : pow(x, p0);
    case TD__UN_EXP: return exp(x);
    case TD__UN_LOG: return log(x);
    case TD__UN_SQRT: return sqrt(x);
    case TD__UN_TANH: return tanh(x);
    case TD__UN_SIGMOID: return sigmoid(x);
    case TD__UN_RELU: return x > (C)0 ? x : (C)0;
    case TD__UN_GELU: return x * gelu_cdf(x);
    case TD__UN_ABS: return fabs(x);
  }
  return x;
}

template <typename T>
__global__ void unary_kernel(Geom<2> g, int64_t n, int op, const T *x, T *out, Cmp<T> p0,
                             Cmp<T> p1) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    out[o[1]] = Cvt<T>::st(unary_fwd<Cmp<T>>(op, td__ld(x[o[0]]), p0, p1));
  }
}

template <typename T>
__global__ void unary_vec_kernel(int64_t n, int op, const T *x, T *out, Cmp<T> p0, Cmp<T> p1) {
  TD_CU_LOOP8(i, n) {
    Vec8<T> a, o;
    a.u[0] = ((const uint4 *)x)[i];
#pragma unroll
    for (int e = 0; e < 8; e++) o.e[e] = Cvt<T>::st(unary_fwd<Cmp<T>>(op, td__ld(a.e[e]), p0, p1));
    ((uint4 *)out)[i] = o.u[0];
  }
}

/* int64 tensors only take the affine map with integral coefficients (as on the CPU). */
__global__ void affine_i64_kernel(Geom<2> g, int64_t n, const int64_t *x, int64_t *out, int64_t a,
                                  int64_t b) {
  TD_CU_LOOP(i, n) {
    int64_t o[2];
    geom_offsets(g, i, o);
    out[o[1]] = a * x[o[0]] + b;
  }
}

/* x or y may be NULL when the op's derivative does not use it (the op layer saves only what it
 * needs); then the other one stands in. */
template <typename C>
__device__ __forceinline__ C unary_bwd(int op, C x, const C *y, C gy, C p0) {
  switch (op) {
    case TD__UN_AFFINE: return gy * p0;
    case TD__UN_POW: return p0 == (C)2 ? gy * (C)2 * x : gy * p0 * pow(x, p0 - (C)1);
    case TD__UN_EXP: return gy * (y ? *y : exp(x));
    case TD__UN_LOG: return gy / x;
    case TD__UN_SQRT: return gy / ((C)2 * (y ? *y : sqrt(x)));
    case TD__UN_TANH: {
      C t = y ? *y : tanh(x);
      return gy * ((C)1 - t * t);
    }
    case TD__UN_SIGMOID: {
      C s = y ? *y : sigmoid(x);
      return gy * s * ((C)1 - s);
    }
    case TD__UN_RELU: return x > (C)0 ? gy : (C)0;
    case TD__UN_GELU: {
      C pdf = exp((C)-0.5 * x * x) * (C)0.39894228040143267794; /* 1/sqrt(2 pi) */
      return gy * (gelu_cdf(x) + x * pdf);
    }
    case TD__UN_ABS: return x > (C)0 ? gy : (x < (C)0 ? -gy : (C)0);
  }
  return gy;
}

template <typename T>
__global__ void unary_backward_kernel(int64_t n, int op, const T *x, const T *y, const T *gy,
                                      T *gx, Cmp<T> p0) {
  using C = Cmp<T>;
  TD_CU_LOOP(i, n) {
    C yv = y ? td__ld(y[i]) : (C)0;
    gx[i] = Cvt<T>::st(unary_bwd<C>(op, x ? td__ld(x[i]) : (C)0, y ? &yv : nullptr,
                                    td__ld(gy[i]), p0));
  }
}

/* 16-bit unary backward, 8 elements a thread a step (x, y NULL as above). */
template <typename T>
__global__ void unary_backward_vec_kernel(int64_t n, int op, const T *x, const T *y, const T *gy,
                                          T *gx, Cmp<T> p0) {
  using C = Cmp<T>;
  TD_CU_LOOP8(i, n) {
    Vec8<T> xv, yv, gv, o;
    if (x) xv.u[0] = ((const uint4 *)x)[i];
    if (y) yv.u[0] = ((const uint4 *)y)[i];
    gv.u[0] = ((const uint4 *)gy)[i];
#pragma unroll
    for (int e = 0; e < 8; e++) {
      C yc = y ? td__ld(yv.e[e]) : (C)0;
      o.e[e] = Cvt<T>::st(unary_bwd<C>(op, x ? td__ld(xv.e[e]) : (C)0, y ? &yc : nullptr,
                                       td__ld(gv.e[e]), p0));
    }
    ((uint4 *)gx)[i] = o.u[0];
  }
}

/* ---- index_select / index_add ---- */

template <typename T>
__global__ void index_select_kernel(int64_t total, int64_t r, int64_t m, int64_t inner,
                                    const T *x, const int64_t *index, int64_t index_stride,
                                    T *out) {
  TD_CU_LOOP(e, total) {
    int64_t i = e % inner, t = e / inner, j = t % m, o = t / m;
    int64_t k = index[j * index_stride];
    out[e] = (k >= 0 && k < r) ? x[(o * r + k) * inner + i] : (T)0; /* range checked by caller */
  }
}

template <typename T>
__global__ void index_add_kernel(int64_t total, int64_t r, int64_t m, int64_t inner, T *gx,
                                 const int64_t *index, int64_t index_stride, const T *g) {
  TD_CU_LOOP(e, total) {
    int64_t i = e % inner, t = e / inner, j = t % m, o = t / m;
    int64_t k = index[j * index_stride];
    if (k >= 0 && k < r) td__cu_atomic_add(&gx[(o * r + k) * inner + i], g[e]);
  }
}

/* index_geometry checks an int64 index vector and returns its length and stride. */
td_status index_geometry(const char *op, const td_tensor *ref, const td_tensor *index, int64_t *m,
                         int64_t *stride) {
  TD_TRY(td__cu_same_device(op, ref, index));
  if (index->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda %s: index must be int64, got %s", op,
                        td_dtype_name(index->dtype));
  return td__cu_vector(op, index, m, stride);
}

} /* namespace */

/* ---- entries ---- */

td_status td__cu_copy(td_tensor *dst, const td_tensor *src) {
  const char *op = "copy";
  TD_TRY(td__cu_enter(op, dst));
  bool same_shape = dst->ndim == src->ndim;
  for (int d = 0; same_shape && d < dst->ndim; d++) same_shape = dst->shape[d] == src->shape[d];
  if (!same_shape) return td_set_error(TD_ERR_SHAPE, "cuda copy: shapes differ");
  int64_t n = td__cu_numel(dst);
  if (n == 0) return TD_OK;
  const int64_t *strides[2] = {dst->strides, src->strides};
  Geom<2> g = make_geom<2>(dst->shape, dst->ndim, strides);
  bool same_dev = src->storage->device.type == TD_DEVICE_CUDA && td__cu_dev(src) == td__cu_dev(dst);
  if (dst->dtype == src->dtype && geom_contiguous(g)) {
    size_t bytes = (size_t)n * td__cu_esize(dst->dtype);
    cudaError_t e;
    if (same_dev) {
      e = cudaMemcpyAsync(td__cu_ptr(dst), td__cu_ptr(src), bytes, cudaMemcpyDeviceToDevice, 0);
    } else if (src->storage->device.type == TD_DEVICE_CUDA) {
      e = cudaMemcpyPeer(td__cu_ptr(dst), td__cu_dev(dst), td__cu_ptr(src), td__cu_dev(src), bytes);
    } else {
      return td__cu_same_device(op, dst, src);
    }
    return e == cudaSuccess ? TD_OK : td__cu_error(e, op);
  }
  if (!same_dev) return td__cu_same_device(op, dst, src);
  void *d = td__cu_ptr(dst);
  const void *s = td__cu_ptr(src);
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  if (dst->dtype == src->dtype) {
    switch (td__cu_esize(dst->dtype)) {
      case 1: copy_bits_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint8_t *)d, (const uint8_t *)s); break;
      case 2:
        copy_bits_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint16_t *)d, (const uint16_t *)s);
        break;
      case 4:
        copy_bits_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint32_t *)d, (const uint32_t *)s);
        break;
      default:
        copy_bits_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint64_t *)d, (const uint64_t *)s);
        break;
    }
  } else if (core_dtype(dst->dtype) && core_dtype(src->dtype)) {
    switch (dst->dtype) {
      case TD_DTYPE_F32: launch_copy(src->dtype, g, n, (float *)d, s); break;
      case TD_DTYPE_F64: launch_copy(src->dtype, g, n, (double *)d, s); break;
      default: launch_copy(src->dtype, g, n, (int64_t *)d, s); break;
    }
  } else if (geom_contiguous(g) && vec8(n, d, s) &&
             ((src->dtype == TD_DTYPE_F32 && td__cu_is_half(dst->dtype)) ||
              (dst->dtype == TD_DTYPE_F32 && td__cu_is_half(src->dtype)))) {
    unsigned g8 = td__cu_grid(n / 8, TD_CU_THREADS);
    if (dst->dtype == TD_DTYPE_BF16)
      copy_to_half_vec_kernel<<<g8, TD_CU_THREADS>>>(n, (td_bf16 *)d, (const float *)s);
    else if (dst->dtype == TD_DTYPE_F16)
      copy_to_half_vec_kernel<<<g8, TD_CU_THREADS>>>(n, (td_f16 *)d, (const float *)s);
    else if (src->dtype == TD_DTYPE_BF16)
      copy_from_half_vec_kernel<<<g8, TD_CU_THREADS>>>(n, (float *)d, (const td_bf16 *)s);
    else
      copy_from_half_vec_kernel<<<g8, TD_CU_THREADS>>>(n, (float *)d, (const td_f16 *)s);
  } else if (src->dtype == TD_DTYPE_F32 && dst->dtype == TD_DTYPE_BF16) {
    copy_to_half_kernel<<<grid, TD_CU_THREADS>>>(g, n, (td_bf16 *)d, (const float *)s);
  } else if (src->dtype == TD_DTYPE_F32 && dst->dtype == TD_DTYPE_F16) {
    copy_to_half_kernel<<<grid, TD_CU_THREADS>>>(g, n, (td_f16 *)d, (const float *)s);
  } else if (dst->dtype == TD_DTYPE_F32 && src->dtype == TD_DTYPE_BF16) {
    copy_from_half_kernel<<<grid, TD_CU_THREADS>>>(g, n, (float *)d, (const td_bf16 *)s);
  } else if (dst->dtype == TD_DTYPE_F32 && src->dtype == TD_DTYPE_F16) {
    copy_from_half_kernel<<<grid, TD_CU_THREADS>>>(g, n, (float *)d, (const td_f16 *)s);
  } else {
    copy_any_kernel<<<grid, TD_CU_THREADS>>>(g, n, d, (int)dst->dtype, s, (int)src->dtype);
  }
  return td__cu_check_launch(op);
}

td_status td__cu_fill(td_tensor *t, double value) {
  const char *op = "fill";
  TD_TRY(td__cu_enter(op, t));
  int64_t n = td__cu_numel(t);
  if (n == 0) return TD_OK;
  const int64_t *strides[1] = {t->strides};
  Geom<1> g = make_geom<1>(t->shape, t->ndim, strides);
  void *p = td__cu_ptr(t);
  size_t es = td__cu_esize(t->dtype);
  unsigned char one[8] = {0};
  td__store(one, t->dtype, 0, value); /* the element's bytes, as the CPU stores them */
  bool zero_bits = true;
  for (size_t i = 0; i < es; i++) zero_bits = zero_bits && one[i] == 0;
  if (zero_bits && geom_contiguous(g)) {
    cudaError_t e = cudaMemsetAsync(p, 0, (size_t)n * es, 0);
    return e == cudaSuccess ? TD_OK : td__cu_error(e, op);
  }
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  switch (es) {
    case 1: fill_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint8_t *)p, one[0]); break;
    case 2: {
      uint16_t v;
      memcpy(&v, one, 2);
      fill_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint16_t *)p, v);
      break;
    }
    case 4: {
      uint32_t v;
      memcpy(&v, one, 4);
      fill_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint32_t *)p, v);
      break;
    }
    default: {
      uint64_t v;
      memcpy(&v, one, 8);
      fill_kernel<<<grid, TD_CU_THREADS>>>(g, n, (uint64_t *)p, v);
      break;
    }
  }
  return td__cu_check_launch(op);
}

td_status td__cu_binary(td__binary_op op, const td_tensor *a, const td_tensor *b, td_tensor *out) {
  const char *name = "binary";
  TD_TRY(td__cu_enter(name, out));
  TD_TRY(td__cu_same_device(name, out, a));
  TD_TRY(td__cu_same_device(name, out, b));
  if (a->dtype != out->dtype || b->dtype != out->dtype)
    return td_set_error(TD_ERR_DTYPE, "cuda binary: operand dtypes differ");
  if (a->ndim != out->ndim || b->ndim != out->ndim)
    return td_set_error(TD_ERR_SHAPE, "cuda binary: operand ranks differ");
  int64_t n = td__cu_numel(out);
  if (n == 0) return TD_OK;
  if (out->dtype == TD_DTYPE_I64 && op == TD__BIN_DIV) TD_TRY(check_int_divisor(td__cu_dev(out), b));
  const int64_t *strides[3] = {a->strides, b->strides, out->strides};
  Geom<3> g = make_geom<3>(out->shape, out->ndim, strides);
  bool ok = false;
  const void *pa = td__cu_ptr(a), *pb = td__cu_ptr(b);
  void *po = td__cu_ptr(out);
  switch (out->dtype) {
    case TD_DTYPE_F32: ok = launch_binary<float>(op, g, n, pa, pb, po); break;
    case TD_DTYPE_F64: ok = launch_binary<double>(op, g, n, pa, pb, po); break;
    case TD_DTYPE_I64: ok = launch_binary<int64_t>(op, g, n, pa, pb, po); break;
    case TD_DTYPE_BF16: ok = launch_binary<td_bf16>(op, g, n, pa, pb, po); break;
    case TD_DTYPE_F16: ok = launch_binary<td_f16>(op, g, n, pa, pb, po); break;
    default:
      return td_set_error(TD_ERR_DTYPE, "cuda binary: %s is not a compute dtype",
                          td_dtype_name(out->dtype));
  }
  if (!ok) return td_set_error(TD_ERR_INVALID, "cuda binary: unknown op %d", (int)op);
  return td__cu_check_launch(name);
}

td_status td__cu_unary(td__unary_op op, const td_tensor *x, td_tensor *out, double p0, double p1) {
  const char *name = "unary";
  TD_TRY(td__cu_enter(name, out));
  TD_TRY(td__cu_same_device(name, out, x));
  if (x->dtype != out->dtype) return td_set_error(TD_ERR_DTYPE, "cuda unary: dtypes differ");
  if (x->ndim != out->ndim) return td_set_error(TD_ERR_SHAPE, "cuda unary: ranks differ");
  int64_t n = td__cu_numel(out);
  if (n == 0) return TD_OK;
  const int64_t *strides[2] = {x->strides, out->strides};
  Geom<2> g = make_geom<2>(out->shape, out->ndim, strides);
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  const void *px = td__cu_ptr(x);
  void *po = td__cu_ptr(out);
  switch (out->dtype) {
    case TD_DTYPE_F32:
      unary_kernel<float><<<grid, TD_CU_THREADS>>>(g, n, (int)op, (const float *)px,
                                                   (float *)po, (float)p0, (float)p1);
      break;
    case TD_DTYPE_F64:
      unary_kernel<double><<<grid, TD_CU_THREADS>>>(g, n, (int)op, (const double *)px,
                                                    (double *)po, p0, p1);
      break;
    case TD_DTYPE_BF16:
      if (geom_contiguous(g) && vec8(n, px, po))
        unary_vec_kernel<td_bf16><<<td__cu_grid(n / 8, TD_CU_THREADS), TD_CU_THREADS>>>(
            n, (int)op, (const td_bf16 *)px, (td_bf16 *)po, (float)p0, (float)p1);
      else
        unary_kernel<td_bf16><<<grid, TD_CU_THREADS>>>(g, n, (int)op, (const td_bf16 *)px,
                                                       (td_bf16 *)po, (float)p0, (float)p1);
      break;
    case TD_DTYPE_F16:
      if (geom_contiguous(g) && vec8(n, px, po))
        unary_vec_kernel<td_f16><<<td__cu_grid(n / 8, TD_CU_THREADS), TD_CU_THREADS>>>(
            n, (int)op, (const td_f16 *)px, (td_f16 *)po, (float)p0, (float)p1);
      else
        unary_kernel<td_f16><<<grid, TD_CU_THREADS>>>(g, n, (int)op, (const td_f16 *)px,
                                                      (td_f16 *)po, (float)p0, (float)p1);
      break;
    case TD_DTYPE_I64:
      if (op != TD__UN_AFFINE || p0 != (double)(int64_t)p0 || p1 != (double)(int64_t)p1)
        return td_set_error(TD_ERR_DTYPE, "cuda unary: int64 tensors only take integral "
                            "affine maps");
      affine_i64_kernel<<<grid, TD_CU_THREADS>>>(g, n, (const int64_t *)px, (int64_t *)po,
                                                 (int64_t)p0, (int64_t)p1);
      break;
    default:
      return td_set_error(TD_ERR_DTYPE, "cuda unary: %s is not a compute dtype",
                          td_dtype_name(out->dtype));
  }
  return td__cu_check_launch(name);
}

td_status td__cu_unary_backward(td__unary_op op, const td_tensor *x, const td_tensor *y,
                                const td_tensor *gy, td_tensor *gx, double p0, double p1) {
  const char *name = "unary_backward";
  (void)p1;
  TD_TRY(td__cu_enter(name, gx));
  TD_TRY(td__cu_same_device(name, gx, x));
  TD_TRY(td__cu_same_device(name, gx, y));
  TD_TRY(td__cu_same_device(name, gx, gy));
  TD_TRY(td__cu_need_contig(name, x));
  TD_TRY(td__cu_need_contig(name, y));
  TD_TRY(td__cu_need_contig(name, gy));
  TD_TRY(td__cu_need_contig(name, gx));
  if (!x && !y && op != TD__UN_AFFINE)
    return td_set_error(TD_ERR_INVALID, "cuda unary_backward: op %d needs x or y", (int)op);
  if (!td_dtype_is_float(gx->dtype) || (x && x->dtype != gx->dtype) || gy->dtype != gx->dtype ||
      (y && y->dtype != gx->dtype))
    return td_set_error(TD_ERR_DTYPE, "cuda unary_backward: needs one float dtype");
  int64_t n = td__cu_numel(gx);
  if (n == 0) return TD_OK;
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  const void *py = y ? td__cu_ptr(y) : nullptr, *pxx = x ? td__cu_ptr(x) : nullptr;
  const void *pg = td__cu_ptr(gy);
  void *po = td__cu_ptr(gx);
  switch (gx->dtype) {
    case TD_DTYPE_F32:
      unary_backward_kernel<float><<<grid, TD_CU_THREADS>>>(
          n, (int)op, (const float *)pxx, (const float *)py, (const float *)pg, (float *)po,
          (float)p0);
      break;
    case TD_DTYPE_BF16:
      if (vec8(n, pxx, py, pg) && vec8(n, po))
        unary_backward_vec_kernel<td_bf16><<<td__cu_grid(n / 8, TD_CU_THREADS), TD_CU_THREADS>>>(
            n, (int)op, (const td_bf16 *)pxx, (const td_bf16 *)py, (const td_bf16 *)pg,
            (td_bf16 *)po, (float)p0);
      else
        unary_backward_kernel<td_bf16><<<grid, TD_CU_THREADS>>>(
            n, (int)op, (const td_bf16 *)pxx, (const td_bf16 *)py, (const td_bf16 *)pg,
            (td_bf16 *)po, (float)p0);
      break;
    case TD_DTYPE_F16:
      if (vec8(n, pxx, py, pg) && vec8(n, po))
        unary_backward_vec_kernel<td_f16><<<td__cu_grid(n / 8, TD_CU_THREADS), TD_CU_THREADS>>>(
            n, (int)op, (const td_f16 *)pxx, (const td_f16 *)py, (const td_f16 *)pg,
            (td_f16 *)po, (float)p0);
      else
        unary_backward_kernel<td_f16><<<grid, TD_CU_THREADS>>>(
            n, (int)op, (const td_f16 *)pxx, (const td_f16 *)py, (const td_f16 *)pg,
            (td_f16 *)po, (float)p0);
      break;
    default:
      unary_backward_kernel<double><<<grid, TD_CU_THREADS>>>(
          n, (int)op, (const double *)pxx, (const double *)py, (const double *)pg, (double *)po,
          p0);
      break;
  }
  return td__cu_check_launch(name);
}

td_status td__cu_index_select(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                              const td_tensor *index, td_tensor *out) {
  const char *op = "index_select";
  TD_TRY(td__cu_enter(op, out));
  TD_TRY(td__cu_same_device(op, out, x));
  TD_TRY(td__cu_need_contig(op, x));
  TD_TRY(td__cu_need_contig(op, out));
  if (x->dtype != out->dtype) return td_set_error(TD_ERR_DTYPE, "cuda index_select: dtypes differ");
  int64_t m = 0, istride = 0;
  TD_TRY(index_geometry(op, out, index, &m, &istride));
  int64_t total = outer * m * inner;
  if (total == 0) return TD_OK;
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  const int64_t *pi = (const int64_t *)td__cu_ptr(index);
  const void *px = td__cu_ptr(x);
  void *po = td__cu_ptr(out);
  /* a gather moves bytes: one instantiation per element size (zero bits for a skipped index) */
  switch (td__cu_esize(out->dtype)) {
    case 1:
      index_select_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (const uint8_t *)px, pi,
                                                   istride, (uint8_t *)po);
      break;
    case 2:
      index_select_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (const uint16_t *)px, pi,
                                                   istride, (uint16_t *)po);
      break;
    case 4:
      index_select_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (const uint32_t *)px, pi,
                                                   istride, (uint32_t *)po);
      break;
    default:
      index_select_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (const uint64_t *)px, pi,
                                                   istride, (uint64_t *)po);
      break;
  }
  return td__cu_check_launch(op);
}

td_status td__cu_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                           const td_tensor *index, const td_tensor *g) {
  const char *op = "index_add";
  TD_TRY(td__cu_enter(op, gx));
  TD_TRY(td__cu_same_device(op, gx, g));
  TD_TRY(td__cu_need_contig(op, gx));
  TD_TRY(td__cu_need_contig(op, g));
  if (g->dtype != gx->dtype) return td_set_error(TD_ERR_DTYPE, "cuda index_add: dtypes differ");
  if (td__cu_is_half(gx->dtype)) { /* through float32 copies (cuda_lowp.cu) */
    td_tensor *gxf = NULL, *gf = NULL;
    td_status st = td__cu_up(gx, &gxf);
    if (st == TD_OK) st = td__cu_up(g, &gf);
    if (st == TD_OK) st = td__cu_index_add(gxf, outer, r, inner, index, gf);
    if (st == TD_OK) st = td__cu_down(gx, gxf);
    td_tensor_unref(gxf);
    td_tensor_unref(gf);
    return st;
  }
  int64_t m = 0, istride = 0;
  TD_TRY(index_geometry(op, gx, index, &m, &istride));
  int64_t total = outer * m * inner;
  if (total == 0) return TD_OK;
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  const int64_t *pi = (const int64_t *)td__cu_ptr(index);
  const void *pg = td__cu_ptr(g);
  void *px = td__cu_ptr(gx);
  switch (gx->dtype) {
    case TD_DTYPE_F32:
      index_add_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (float *)px, pi, istride,
                                                (const float *)pg);
      break;
    case TD_DTYPE_F64:
      index_add_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (double *)px, pi, istride,
                                                (const double *)pg);
      break;
    case TD_DTYPE_I64:
      index_add_kernel<<<grid, TD_CU_THREADS>>>(total, r, m, inner, (int64_t *)px, pi, istride,
                                                (const int64_t *)pg);
      break;
    default:
      return td_set_error(TD_ERR_DTYPE, "cuda index_add: %s is not supported",
                          td_dtype_name(gx->dtype));
  }
  return td__cu_check_launch(op);
}
