/* cuda_lowp.cu - bfloat16 / float16 on the CUDA backend: GEMMs through cuBLASLt with float32
 * accumulation, and the float32 round trip of whole tensors that the kernels without a 16-bit
 * instantiation use (td__cu_up / td__cu_down, as cpu_half.c on the CPU).
 *
 * GEMM: one matrix (batch == 1, the Linear layers) is one cublasLtMatmul: A, B, C and D in the
 * 16-bit dtype, CUBLAS_COMPUTE_32F (products summed in float32, the tensor cores' bfloat16 /
 * float16 MMA), alpha and beta float32, D = C (in place, beta 1 when Linear's bias was copied into
 * the output first). The algorithm comes from cublasLtMatmulAlgoGetHeuristic for the operands'
 * real alignment (a view's data pointer may be only 2-byte aligned; the heuristic assumes 256
 * bytes unless told), with a 32 MiB workspace from the caching allocator (freed right after the
 * call is enqueued: every user of the block runs on the same stream). Heuristic results are
 * cached per shape, transposes, leading dimensions, alignments and beta == 0, so a training step
 * asks once per distinct GEMM. Batched products (batch > 1, matmul of stacks) go through
 * cublasGemmStridedBatchedEx with CUBLAS_COMPUTE_32F, which takes a zero batch stride
 * (broadcast), as does the single-matrix case when cuBLASLt finds no algorithm.
 *
 * cuBLASLt handles: one per (host thread, device), taken from a free list of ended threads'
 * handles, like the cuBLAS handles of cuda_backend.cu.
 *
 * Lock order: lt_mu and algo_mu are leaves.
 */
#include "cuda_impl.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include "cuda_blas.h" /* after cuBLAS's headers */
#include <limits.h>
#include <string.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

/* cuda_backend.cu: this thread's cuBLAS handle for device (the current device). */
td_status td__cu_blas_handle(int device, cublasHandle_t *out);

/* ---- the float32 round trip ---- */

td_status td__cu_up_empty(const td_tensor *t, td_tensor **out) {
  *out = NULL;
  if (!t) return TD_OK;
  if (!td__cu_is_half(t->dtype)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return td__tensor_new(t->shape, t->ndim, TD_DTYPE_F32, t->storage->device, out);
}

td_status td__cu_up(const td_tensor *t, td_tensor **out) {
  TD_TRY(td__cu_up_empty(t, out));
  if (*out && *out != t) {
    td_status st = td__cu_copy(*out, t);
    if (st != TD_OK) {
      td_tensor_unref(*out);
      *out = NULL;
      return st;
    }
  }
  return TD_OK;
}

td_status td__cu_down(td_tensor *t, const td_tensor *f) {
  if (!t || !f || t == f) return TD_OK;
  return td__cu_copy(t, f);
}

namespace {

/* ---- cuBLASLt handles ---- */

std::mutex lt_mu;
std::vector<std::vector<cublasLtHandle_t>> *lt_free; /* ended threads' handles, per device */

struct thread_lt {
  std::vector<cublasLtHandle_t> h;
  ~thread_lt() {
    std::lock_guard<std::mutex> lock(lt_mu);
    for (size_t d = 0; d < h.size(); d++) {
      if (!h[d]) continue;
      try {
        if (!lt_free) lt_free = new std::vector<std::vector<cublasLtHandle_t>>();
        if (lt_free->size() <= d) lt_free->resize(d + 1);
        (*lt_free)[d].push_back(h[d]);
      } catch (...) {
      }
    }
  }
};
thread_local thread_lt my_lt;

td_status lt_handle(int device, cublasLtHandle_t *out) {
  std::vector<cublasLtHandle_t> &mine = my_lt.h;
  if ((size_t)device < mine.size() && mine[(size_t)device]) {
    *out = mine[(size_t)device];
    return TD_OK;
  }
  TD_TRY(td__cublas_load()); /* (cuda_blas.h) */
  cublasLtHandle_t h = nullptr;
  try {
    if ((size_t)device >= mine.size()) mine.resize((size_t)device + 1, nullptr);
    std::lock_guard<std::mutex> lock(lt_mu);
    if (lt_free && (size_t)device < lt_free->size() && !(*lt_free)[(size_t)device].empty()) {
      h = (*lt_free)[(size_t)device].back();
      (*lt_free)[(size_t)device].pop_back();
    }
  } catch (...) {
    return td_set_error(TD_ERR_NOMEM, "cuda gemm: out of host memory");
  }
  if (!h) {
    cublasStatus_t s = cublasLtCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS)
      return td_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? TD_ERR_NOMEM : TD_ERR_INTERNAL,
                          "cuda gemm: cublasLtCreate on cuda:%d failed: %s", device,
                          cublasGetStatusString(s));
  }
  mine[(size_t)device] = h;
  *out = h;
  return TD_OK;
}

/* ---- heuristic cache ---- */

typedef std::tuple<int, int, int, int64_t, int64_t, int64_t, uint32_t, uint32_t, uint32_t, int,
                   int>
    algo_key; /* dtype, transa, transb, m, n, k, align a, b, c, beta != 0 (2: a bias epilogue),
                 device */
std::mutex algo_mu;
std::map<algo_key, cublasLtMatmulAlgo_t> *algo_cache;

constexpr size_t kWorkspace = (size_t)32 << 20;

/* align_of returns the largest power of two (at most 256) dividing the address. */
uint32_t align_of(const void *p) {
  uintptr_t a = (uintptr_t)p;
  uint32_t al = 256;
  while (al > 1 && (a & (al - 1))) al >>= 1;
  return al;
}

template <typename H>
__global__ void scale_half_kernel(H *c, int64_t mn, int64_t stride_c, int64_t batch, float beta) {
  TD_CU_LOOP(e, mn * batch) {
    int64_t b = e / mn;
    H *p = c + b * stride_c + (e - b * mn);
    *p = Cvt<H>::st(beta == 0.0f ? 0.0f : beta * td__ld(*p));
  }
}

td_status blas_error(cublasStatus_t s, const char *what, int64_t m, int64_t n, int64_t k,
                     int64_t batch) {
  return td_set_error(s == CUBLAS_STATUS_ALLOC_FAILED ? TD_ERR_NOMEM : TD_ERR_INTERNAL,
                      "cuda gemm: %s failed (m=%lld n=%lld k=%lld batch=%lld): %s", what,
                      (long long)m, (long long)n, (long long)k, (long long)batch,
                      cublasGetStatusString(s));
}

/* gemm_ex: the cuBLAS route (batched, or no cuBLASLt algorithm); same operand mapping as
 * cu_gemm in cuda_backend.cu. */
td_status gemm_ex(cudaDataType_t ty, int device, bool transa, bool transb, int64_t m, int64_t n,
                  int64_t k, float alpha, const void *a, int64_t stride_a, const void *b,
                  int64_t stride_b, float beta, void *c, int64_t stride_c, int64_t batch) {
  cublasHandle_t h;
  TD_TRY(td__cu_blas_handle(device, &h));
  cublasOperation_t ob = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t oa = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  int ldb = (int)(transb ? k : n), lda = (int)(transa ? m : k), ldc = (int)n;
  cublasStatus_t s = cublasGemmStridedBatchedEx(
      h, ob, oa, (int)n, (int)m, (int)k, &alpha, b, ty, ldb, stride_b, a, ty, lda, stride_a, &beta,
      c, ty, ldc, stride_c, (int)batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return s == CUBLAS_STATUS_SUCCESS ? TD_OK
                                    : blas_error(s, "cublasGemmStridedBatchedEx", m, n, k, batch);
}

/* Owns the cuBLASLt descriptors of one call. */
struct lt_descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~lt_descs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

/* lt_gemm: one matrix through cuBLASLt; bias (NULL: none) is added to every row of C by the
 * epilogue (CUBLASLT_EPILOGUE_BIAS: cuBLASLt's D is our C transposed, its rows our columns), beta
 * then being 0. TD_ERR_UNSUPPORTED, no error set, when cuBLASLt has no algorithm for the case. */
td_status lt_gemm(td_dtype dt, int device, bool transa, bool transb, int64_t m, int64_t n,
                  int64_t k, float fa, const void *a, const void *b, float fb, const void *bias,
                  void *c) {
  cudaDataType_t ty = dt == TD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const int64_t batch = 1;
  cublasLtHandle_t h;
  TD_TRY(lt_handle(device, &h));
  /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (see cu_gemm): cuBLASLt's
   * first operand is our B, stored column-major as [n, k] (ld n) or, transposed, [k, n] (ld k);
   * its second is our A: [k, m] (ld k) or, transposed, [m, k] (ld m); D = C is [n, m] (ld n). */
  cublasOperation_t ob = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t oa = transa ? CUBLAS_OP_T : CUBLAS_OP_N;
  uint64_t rb = (uint64_t)(transb ? k : n), cb = (uint64_t)(transb ? n : k);
  uint64_t ra = (uint64_t)(transa ? m : k), ca = (uint64_t)(transa ? k : m);
  lt_descs d;
  cublasStatus_t s = cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ob, sizeof ob);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &oa, sizeof oa);
  if (s == CUBLAS_STATUS_SUCCESS && bias) {
    cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
    s = cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
    if (s == CUBLAS_STATUS_SUCCESS) /* the bias in the output's dtype */
      s = cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &ty,
                                         sizeof ty);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                         sizeof bias);
  }
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&d.la, ty, rb, cb, (int64_t)rb);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatrixLayoutCreate(&d.lb, ty, ra, ca, (int64_t)ra);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutCreate(&d.lc, ty, (uint64_t)n, (uint64_t)m, n);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_error(s, "cuBLASLt descriptors", m, n, k, batch);
  uint32_t al_b = align_of(b), al_a = align_of(a), al_c = align_of(c);
  algo_key key(dt, transa, transb, m, n, k, al_a, al_b, al_c, bias ? 2 : fb != 0.0f, device);
  cublasLtMatmulAlgo_t algo;
  bool have = false;
  {
    std::lock_guard<std::mutex> lock(algo_mu);
    if (algo_cache) {
      auto it = algo_cache->find(key);
      if (it != algo_cache->end()) {
        algo = it->second;
        have = true;
      }
    }
  }
  if (!have) {
    uint64_t ws = kWorkspace;
    s = cublasLtMatmulPreferenceCreate(&d.pref);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ws, sizeof ws);
    /* cuBLASLt's A is our B, its B our A; C and D are our C */
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                               &al_b, sizeof al_b);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                               &al_a, sizeof al_a);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                               &al_c, sizeof al_c);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                               &al_c, sizeof al_c);
    if (s != CUBLAS_STATUS_SUCCESS) return blas_error(s, "cuBLASLt preference", m, n, k, batch);
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    s = cublasLtMatmulAlgoGetHeuristic(h, d.op, d.la, d.lb, d.lc, d.lc, d.pref, 1, &res, &found);
    if (s != CUBLAS_STATUS_SUCCESS || found == 0 || res.state != CUBLAS_STATUS_SUCCESS)
      return TD_ERR_UNSUPPORTED; /* no cuBLASLt algorithm for this case */
    algo = res.algo;
    try {
      std::lock_guard<std::mutex> lock(algo_mu);
      if (!algo_cache) algo_cache = new std::map<algo_key, cublasLtMatmulAlgo_t>();
      (*algo_cache)[key] = algo;
    } catch (...) {
      /* no cache entry: the next call asks again */
    }
  }
  void *ws = nullptr;
  TD_TRY(td__cu_scratch_alloc(device, kWorkspace, &ws));
  s = cublasLtMatmul(h, d.op, &fa, b, d.la, a, d.lb, &fb, c, d.lc, c, d.lc, &algo, ws, kWorkspace,
                     0);
  td__cu_scratch_free(device, ws);
  if (s != CUBLAS_STATUS_SUCCESS) return blas_error(s, "cublasLtMatmul", m, n, k, batch);
  return TD_OK;
}

} /* namespace */

td_status td__cu_gemm_lowp_bias(td_dtype dt, int device, bool transa, bool transb, int64_t m,
                                int64_t n, int64_t k, const void *a, const void *b,
                                const void *bias, void *c) {
  if (k == 0) return TD_ERR_UNSUPPORTED; /* the caller's copy of the bias is the result */
  return lt_gemm(dt, device, transa, transb, m, n, k, 1.0f, a, b, 0.0f, bias, c);
}

td_status td__cu_gemm_lowp(td_dtype dt, int device, bool transa, bool transb, int64_t m,
                           int64_t n, int64_t k, double alpha, const void *a, int64_t stride_a,
                           const void *b, int64_t stride_b, double beta, void *c,
                           int64_t stride_c, int64_t batch) {
  const char *op = "gemm";
  cudaDataType_t ty = dt == TD_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
  float fa = (float)alpha, fb = (float)beta;
  if (k == 0) {
    unsigned grid = td__cu_grid(m * n * batch, TD_CU_THREADS);
    if (dt == TD_DTYPE_BF16)
      scale_half_kernel<<<grid, TD_CU_THREADS>>>((td_bf16 *)c, m * n, stride_c, batch, fb);
    else
      scale_half_kernel<<<grid, TD_CU_THREADS>>>((td_f16 *)c, m * n, stride_c, batch, fb);
    return td__cu_check_launch(op);
  }
  if (batch > 1)
    return gemm_ex(ty, device, transa, transb, m, n, k, fa, a, stride_a, b, stride_b, fb, c,
                   stride_c, batch);
  td_status st = lt_gemm(dt, device, transa, transb, m, n, k, fa, a, b, fb, nullptr, c);
  if (st != TD_ERR_UNSUPPORTED) return st;
  return gemm_ex(ty, device, transa, transb, m, n, k, fa, a, stride_a, b, stride_b, fb, c,
                 stride_c, batch); /* no cuBLASLt algorithm for this case */
}
