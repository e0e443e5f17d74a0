/* cuda_blas.h - cuBLAS and cuBLASLt, loaded on first use (never installed).
 *
 * The library does not link cuBLAS: libcublasLt alone costs every process that maps it about
 * 95 ms of start-up and 94 MiB of private memory (relocations), measured here, whether or not it
 * ever touches a GPU; a CUDA build's CPU-only workers (a parameter server's trainers, a large
 * RPC group) paid that each. The CUDA backend loads libcublas (which brings libcublasLt) with
 * dlopen when it creates its first handle (td__cublas_load), and calls the few functions it uses
 * through the table td__cublas.
 *
 * A file that calls cuBLAS includes this header after <cublas_v2.h> / <cublasLt.h>: the macros
 * at the end send each name to its table entry, so the calls read as cuBLAS's own (the loader
 * pattern of OpenGL's glad). Every call must follow a successful td__cublas_load (the handle
 * getters call it first). */
#ifndef TD_TENSOR_CUDA_BLAS_H
#define TD_TENSOR_CUDA_BLAS_H

#include <cublasLt.h>
#include <cublas_v2.h>

#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The functions used (names after cuBLAS's own macros: cublasCreate is cublasCreate_v2). */
#define TD__CUBLAS_FUNCTIONS(X)                                                                  \
  X(cublasCreate_v2)                                                                             \
  X(cublasGetStatusString)                                                                       \
  X(cublasSgemmStridedBatched)                                                                   \
  X(cublasDgemmStridedBatched)                                                                   \
  X(cublasLtCreate)                                                                              \
  X(cublasLtMatmul)                                                                              \
  X(cublasLtMatmulAlgoGetHeuristic)                                                              \
  X(cublasLtMatmulDescCreate)                                                                    \
  X(cublasLtMatmulDescDestroy)                                                                   \
  X(cublasLtMatmulDescSetAttribute)                                                              \
  X(cublasLtMatmulPreferenceCreate)                                                              \
  X(cublasLtMatmulPreferenceDestroy)                                                             \
  X(cublasLtMatmulPreferenceSetAttribute)                                                        \
  X(cublasLtMatrixLayoutCreate)                                                                  \
  X(cublasLtMatrixLayoutDestroy)

/* cublasGemmStridedBatchedEx is overloaded in C++ (a cudaDataType compute type): its type is
 * spelt out, the others' are taken from their declarations */
typedef cublasStatus_t (*td__cublas_gemm_sbex_fn)(
    cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
    const void *, cudaDataType, int, long long, const void *, cudaDataType, int, long long,
    const void *, void *, cudaDataType, int, long long, int, cublasComputeType_t, cublasGemmAlgo_t);

#define TD__CUBLAS_MEMBER(f) __typeof__(f) *f;
typedef struct td__cublas_api {
  TD__CUBLAS_FUNCTIONS(TD__CUBLAS_MEMBER)
  td__cublas_gemm_sbex_fn cublasGemmStridedBatchedEx;
} td__cublas_api;
#undef TD__CUBLAS_MEMBER

/* Filled by td__cublas_load; read-only afterwards. */
extern td__cublas_api td__cublas;

/* td__cublas_load loads cuBLAS once per process (thread-safe; later calls return the first
 * result): the soname of the toolkit the library was built with (libcublas.so.<major>) through
 * the usual search path, then from the toolkit's library directory. TD_ERR_DEVICE names
 * the library and dlerror() when it cannot be loaded or lacks a function. */
td_status td__cublas_load(void);

#ifdef __cplusplus
}
#endif

/* The calls, through the table (after the declarations above: these names are now macros). */
#ifndef TD__CUBLAS_LOADER
#define cublasCreate_v2 (td__cublas.cublasCreate_v2)
#define cublasGetStatusString (td__cublas.cublasGetStatusString)
#define cublasSgemmStridedBatched (td__cublas.cublasSgemmStridedBatched)
#define cublasDgemmStridedBatched (td__cublas.cublasDgemmStridedBatched)
#define cublasGemmStridedBatchedEx (td__cublas.cublasGemmStridedBatchedEx)
#define cublasLtCreate (td__cublas.cublasLtCreate)
#define cublasLtMatmul (td__cublas.cublasLtMatmul)
#define cublasLtMatmulAlgoGetHeuristic (td__cublas.cublasLtMatmulAlgoGetHeuristic)
#define cublasLtMatmulDescCreate (td__cublas.cublasLtMatmulDescCreate)
#define cublasLtMatmulDescDestroy (td__cublas.cublasLtMatmulDescDestroy)
#define cublasLtMatmulDescSetAttribute (td__cublas.cublasLtMatmulDescSetAttribute)
#define cublasLtMatmulPreferenceCreate (td__cublas.cublasLtMatmulPreferenceCreate)
#define cublasLtMatmulPreferenceDestroy (td__cublas.cublasLtMatmulPreferenceDestroy)
#define cublasLtMatmulPreferenceSetAttribute (td__cublas.cublasLtMatmulPreferenceSetAttribute)
#define cublasLtMatrixLayoutCreate (td__cublas.cublasLtMatrixLayoutCreate)
#define cublasLtMatrixLayoutDestroy (td__cublas.cublasLtMatrixLayoutDestroy)
#endif

#endif
