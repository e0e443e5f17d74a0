/* cuda_backend.cu - the CUDA kernel table: errors, device guard, host<->device copies, cuBLAS
 * GEMM (float32 / float64 here; bfloat16 / float16 through cuBLASLt in cuda_lowp.cu), the
 * runtime's device count (for the probe child of tensor/devices.c) and registration
 * (td__cuda_backend). Memory comes from the caching allocator in cuda_alloc.cu.
 *
 * cuBLAS: one handle per (host thread, device), as PyTorch keeps them. With one handle per device
 * shared by every thread, the parameter server example failed its first backward on an H100 with
 * cuBLAS 13 in 6 of 6 runs (CUBLAS_STATUS_INTERNAL_ERROR: the server's RPC threads ran two
 * trainers' passes); per-thread handles passed 6 of 6. The cuBLAS documentation advises against
 * sharing a handle between threads. A thread creates its handle on first use
 * (default stream, host pointer mode, default math, i.e. no TF32); when the thread ends its
 * handles go to a free list that later threads take from, so short-lived threads do not leak them.
 *
 * Lock order: blas_mu is a leaf (never held while calling out of this file).
 */
#include "cuda_alloc.h"
#include "cuda_impl.h"

#include <cublas_v2.h>

#include "cuda_blas.h" /* after cuBLAS's headers */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <vector>

/* ---- errors and device selection ---- */

td_status td__cu_error(cudaError_t e, const char *op) {
  (void)cudaGetLastError(); /* clear the (non-sticky) last-error slot */
  td_status s = TD_ERR_INTERNAL;
  if (e == cudaErrorMemoryAllocation) {
    s = TD_ERR_NOMEM;
  } else if (e == cudaErrorInvalidDevice || e == cudaErrorNoDevice ||
             e == cudaErrorInsufficientDriver || e == cudaErrorDevicesUnavailable) {
    s = TD_ERR_DEVICE;
  }
  return td_set_error(s, "cuda %s: %s (%s)", op, cudaGetErrorString(e), cudaGetErrorName(e));
}

td_status td__cu_check_launch(const char *op) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? TD_OK : td__cu_error(e, op);
}

td_status td__cu_set_device(int index, const char *op) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == index) return TD_OK;
  cudaError_t e = cudaSetDevice(index);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return td_set_error(TD_ERR_DEVICE, "cuda %s: cannot select device cuda:%d: %s", op, index,
                        cudaGetErrorString(e));
  }
  return TD_OK;
}

td_status td__cu_device_of(const void *p, const char *op, int *index) {
  cudaPointerAttributes attr;
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) return td__cu_error(e, op);
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return td_set_error(TD_ERR_DEVICE, "cuda %s: %p is not device memory", op, p);
  *index = attr.device;
  return TD_OK;
}

td_status td__cu_enter(const char *op, const td_tensor *t) {
  if (t->storage->device.type != TD_DEVICE_CUDA)
    return td_set_error(TD_ERR_DEVICE, "cuda %s: tensor is not on a CUDA device", op);
  return td__cu_set_device(td__cu_dev(t), op);
}

td_status td__cu_same_device(const char *op, const td_tensor *ref, const td_tensor *t) {
  if (!t) return TD_OK;
  if (t->storage->device.type != TD_DEVICE_CUDA || td__cu_dev(t) != td__cu_dev(ref))
    return td_set_error(TD_ERR_DEVICE, "cuda %s: operands on different devices (cuda:%d and %s%d)",
                        op, td__cu_dev(ref),
                        t->storage->device.type == TD_DEVICE_CUDA ? "cuda:" : "cpu ",
                        td__cu_dev(t));
  return TD_OK;
}

td_status td__cu_need_contig(const char *op, const td_tensor *t) {
  if (!t) return TD_OK;
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->strides[d] != expect)
      return td_set_error(TD_ERR_INTERNAL, "cuda %s: operand must be contiguous", op);
    expect *= t->shape[d];
  }
  return TD_OK;
}

td_status td__cu_vector(const char *op, const td_tensor *t, int64_t *n, int64_t *stride) {
  *n = td__cu_numel(t);
  if (t->ndim == 1) {
    *stride = t->strides[0];
    return TD_OK;
  }
  *stride = 1;
  return td__cu_need_contig(op, t);
}

/* ---- device names (tensor/devices.c: td_cuda_device_name) ---- */

extern "C" td_status td__cu_device_name(int device, char *buf, size_t n) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return td__cu_error(e, "device_name");
  snprintf(buf, n, "%s", prop.name);
  return TD_OK;
}

/* ---- device count (for the probe child of tensor/devices.c) ---- */

extern "C" int td__cuda_runtime_count(int *err) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  *err = (int)e;
  return n;
}

namespace {

/* ---- memory: the caching allocator (cuda_alloc.cu) ---- */

td_status cu_alloc(int device, size_t nbytes, void **out) {
  return td__cu_cache_alloc(td__cu_default_cache(), device, nbytes, out);
}

void cu_free(int device, void *p) {
  (void)device; /* the cache finds the block's device by its address */
  td__cu_cache_free(td__cu_default_cache(), p);
}

/* ---- host <-> device copies ---- */

td_status cu_copy_h2d(int device, void *dst, const void *src, size_t nbytes) {
  if (nbytes == 0) return TD_OK;
  TD_TRY(td__cu_set_device(device, "copy_h2d"));
  cudaError_t e = cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice);
  return e == cudaSuccess ? TD_OK : td__cu_error(e, "copy_h2d");
}

td_status cu_copy_d2h(int device, void *dst, const void *src, size_t nbytes) {
  if (nbytes == 0) return TD_OK;
  TD_TRY(td__cu_set_device(device, "copy_d2h"));
  cudaError_t e = cudaMemcpy(dst, src, nbytes, cudaMemcpyDeviceToHost);
  return e == cudaSuccess ? TD_OK : td__cu_error(e, "copy_d2h");
}

/* ---- cuBLAS GEMM ---- */

std::mutex blas_mu;
/* Handles of ended threads, per device, for reuse; never destroyed (threads may end during exit). */
std::vector<std::vector<cublasHandle_t>> *blas_free;

/* This thread's handles (index = device); returned to blas_free when the thread ends. */
struct thread_blas {
  std::vector<cublasHandle_t> h;
  ~thread_blas() {
    std::lock_guard<std::mutex> lock(blas_mu);
    for (size_t d = 0; d < h.size(); d++) {
      if (!h[d]) continue;
      try {
        if (!blas_free) blas_free = new std::vector<std::vector<cublasHandle_t>>();
        if (blas_free->size() <= d) blas_free->resize(d + 1);
        (*blas_free)[d].push_back(h[d]);
      } catch (...) {
        /* out of host memory at thread exit: the handle is lost, nothing else */
      }
    }
  }
};
thread_local thread_blas my_blas;

/* blas_handle returns this thread's handle for device (the current device): a free one of an ended
 * thread, else a new one. */
td_status blas_handle(int device, cublasHandle_t *out) {
  std::vector<cublasHandle_t> &mine = my_blas.h;
  if ((size_t)device < mine.size() && mine[(size_t)device]) {
    *out = mine[(size_t)device];
    return TD_OK;
  }
  TD_TRY(td__cublas_load()); /* (cuda_blas.h) */
  cublasHandle_t h = nullptr;
  try {
    if ((size_t)device >= mine.size()) mine.resize((size_t)device + 1, nullptr);
    std::lock_guard<std::mutex> lock(blas_mu);
    if (blas_free && (size_t)device < blas_free->size() && !(*blas_free)[(size_t)device].empty()) {
      h = (*blas_free)[(size_t)device].back();
      (*blas_free)[(size_t)device].pop_back();
    }
  } catch (...) {
    return td_set_error(TD_ERR_NOMEM, "cuda gemm: out of host memory");
  }
  if (!h) {
    cublasStatus_t s = cublasCreate(&h); /* binds the handle to the current device */
    if (s != CUBLAS_STATUS_SUCCESS)
      return td_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? TD_ERR_NOMEM : TD_ERR_INTERNAL,
                          "cuda gemm: cublasCreate on cuda:%d failed: %s", device,
                          cublasGetStatusString(s));
  }
  mine[(size_t)device] = h;
  *out = h;
  return TD_OK;
}

/* scale_kernel sets each [m*n] matrix of c to beta * c (0 when beta == 0, ignoring NaN in c):
 * the K == 0 product, which is left out of the cuBLAS call. */
template <typename T>
__global__ void scale_kernel(T *c, int64_t mn, int64_t stride_c, int64_t batch, T beta) {
  TD_CU_LOOP(e, mn * batch) {
    int64_t b = e / mn;
    T *p = c + b * stride_c + (e - b * mn);
    *p = beta == (T)0 ? (T)0 : beta * *p;
  }
}

td_status cu_gemm(td_dtype dt, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                  double alpha, const void *a, int64_t stride_a, const void *b, int64_t stride_b,
                  double beta, void *c, int64_t stride_c, int64_t batch) {
  const char *op = "gemm";
  if (!td_dtype_is_float(dt))
    return td_set_error(TD_ERR_DTYPE, "cuda gemm: %s matrices are not supported",
                        td_dtype_name(dt));
  if (m <= 0 || n <= 0 || batch <= 0) return TD_OK;
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX || batch > INT_MAX)
    return td_set_error(TD_ERR_INVALID,
                        "cuda gemm: dimensions m=%lld n=%lld k=%lld batch=%lld exceed cuBLAS's "
                        "32-bit limits",
                        (long long)m, (long long)n, (long long)k, (long long)batch);
  int device = 0;
  TD_TRY(td__cu_device_of(c, op, &device));
  TD_TRY(td__cu_set_device(device, op));
  if (td__cu_is_half(dt)) /* cuBLASLt, float32 accumulation (cuda_lowp.cu) */
    return td__cu_gemm_lowp(dt, device, transa, transb, m, n, k, alpha, a, stride_a, b, stride_b,
                            beta, c, stride_c, batch);
  if (k == 0) {
    unsigned grid = td__cu_grid(m * n * batch, TD_CU_THREADS);
    if (dt == TD_DTYPE_F32)
      scale_kernel<float><<<grid, TD_CU_THREADS>>>((float *)c, m * n, stride_c, batch, (float)beta);
    else
      scale_kernel<double><<<grid, TD_CU_THREADS>>>((double *)c, m * n, stride_c, batch, beta);
    return td__cu_check_launch(op);
  }
  cublasHandle_t h;
  TD_TRY(blas_handle(device, &h));
  /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: a row-major [r, s] matrix is
   * the column-major [s, r] matrix with leading dimension s. So cuBLAS computes the [n, m]
   * column-major result from B (first) and A (second) with the same transpose flags. */
  cublasOperation_t ob = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t oa = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  int ldb = (int)(transb ? k : n);
  int lda = (int)(transa ? m : k);
  int ldc = (int)n;
  cublasStatus_t s;
  if (dt == TD_DTYPE_F32) {
    float fa = (float)alpha, fb = (float)beta;
    s = cublasSgemmStridedBatched(h, ob, oa, (int)n, (int)m, (int)k, &fa, (const float *)b, ldb,
                                  stride_b, (const float *)a, lda, stride_a, &fb, (float *)c, ldc,
                                  stride_c, (int)batch);
  } else {
    s = cublasDgemmStridedBatched(h, ob, oa, (int)n, (int)m, (int)k, &alpha, (const double *)b,
                                  ldb, stride_b, (const double *)a, lda, stride_a, &beta,
                                  (double *)c, ldc, stride_c, (int)batch);
  }
  if (s != CUBLAS_STATUS_SUCCESS)
    return td_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? TD_ERR_NOMEM : TD_ERR_INTERNAL,
                        "cuda gemm: cuBLAS failed (m=%lld n=%lld k=%lld batch=%lld): %s",
                        (long long)m, (long long)n, (long long)k, (long long)batch,
                        cublasGetStatusString(s));
  return TD_OK;
}

/* cu_gemm_bias: linear's GEMM with its bias in cuBLASLt's epilogue (bfloat16 / float16 only). */
td_status cu_gemm_bias(td_dtype dt, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                       const void *a, const void *b, const void *bias, void *c) {
  if (!td__cu_is_half(dt) || m <= 0 || n <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX)
    return TD_ERR_UNSUPPORTED;
  int device = 0;
  TD_TRY(td__cu_device_of(c, "gemm", &device));
  TD_TRY(td__cu_set_device(device, "gemm"));
  return td__cu_gemm_lowp_bias(dt, device, transa, transb, m, n, k, a, b, bias, c);
}

td__backend make_backend() {
  td__backend b;
  memset(&b, 0, sizeof b);
  b.name = "cuda";
  b.alloc = cu_alloc;
  b.free = cu_free;
  b.copy_h2d = cu_copy_h2d;
  b.copy_d2h = cu_copy_d2h;
  b.copy = td__cu_copy;
  b.fill = td__cu_fill;
  b.binary = td__cu_binary;
  b.unary = td__cu_unary;
  b.unary_backward = td__cu_unary_backward;
  b.reduce_sum = td__cu_reduce_sum;
  b.reduce_max = td__cu_reduce_max;
  b.gemm = cu_gemm;
  b.gemm_bias = cu_gemm_bias;
  b.softmax = td__cu_softmax;
  b.softmax_backward = td__cu_softmax_backward;
  b.nll = td__cu_nll;
  b.nll_backward = td__cu_nll_backward;
  b.im2col = td__cu_im2col;
  b.col2im = td__cu_col2im;
  b.max_pool2d = td__cu_max_pool2d;
  b.max_pool2d_backward = td__cu_max_pool2d_backward;
  b.index_select = td__cu_index_select;
  b.index_add = td__cu_index_add;
  b.layer_norm = td__cu_layer_norm;
  b.layer_norm_backward = td__cu_layer_norm_backward;
  b.attention_lse = td__cu_attention;
  b.attention_lse_backward = td__cu_attention_backward;
  b.adam = td__cu_adam;
  b.adam_multi = td__cu_adam_multi;
  b.sum_squares = td__cu_sum_squares;
  b.cross_entropy = td__cu_cross_entropy;
  b.cross_entropy_backward = td__cu_cross_entropy_backward;
  return b;
}

const td__backend cuda_backend = make_backend();

} /* namespace */

td_status td__cu_blas_handle(int device, cublasHandle_t *out) { return blas_handle(device, out); }

td_status td__cu_scratch_alloc(int index, size_t nbytes, void **out) {
  return td__cu_cache_alloc(td__cu_default_cache(), index, nbytes, out);
}

void td__cu_scratch_free(int index, void *p) {
  (void)index;
  td__cu_cache_free(td__cu_default_cache(), p);
}

/* The table tensor.c dispatches to for TD_DEVICE_CUDA tensors (declared in tensor_impl.h with C
 * linkage). */
const td__backend *td__cuda_backend = &cuda_backend;
