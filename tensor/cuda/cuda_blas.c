/* cuda_blas.c - loads cuBLAS on first use (cuda_blas.h says why). */
#define TD__CUBLAS_LOADER /* the real names, not the table's macros */
#include "cuda_blas.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#ifndef TD_CUDA_LIBDIR
#define TD_CUDA_LIBDIR "/usr/local/cuda/lib64"
#endif
#define TD__STR(x) #x
#define TD__XSTR(x) TD__STR(x)
#define TD__CUBLAS_SONAME "libcublas.so." TD__XSTR(CUBLAS_VER_MAJOR)

td__cublas_api td__cublas;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static td_status load_status = TD_ERR_DEVICE;
static char load_error[512];

static void load(void) {
  /* by soname first (LD_LIBRARY_PATH, the caller's runpath, ldconfig), then where the toolkit
   * was at build time; libcublas finds libcublasLt beside itself (its runpath is $ORIGIN) */
  void *h = dlopen(TD__CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    char first[256];
    snprintf(first, sizeof first, "%s", dlerror());
    h = dlopen(TD_CUDA_LIBDIR "/" TD__CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      snprintf(load_error, sizeof load_error, "cannot load cuBLAS (%s): %s; nor from %s: %s",
               TD__CUBLAS_SONAME, first, TD_CUDA_LIBDIR, dlerror());
      return;
    }
  }
  td__cublas_api api;
#define TD__CUBLAS_SYM(f)                                                                        \
  *(void **)&api.f = dlsym(h, TD__XSTR(f));                                                      \
  if (!api.f) {                                                                                  \
    snprintf(load_error, sizeof load_error, "%s has no %s: a cuBLAS older than the toolkit "    \
             "tdist was built with (cuBLAS %d)?", TD__CUBLAS_SONAME, TD__XSTR(f),                \
             CUBLAS_VER_MAJOR);                                                                  \
    dlclose(h);                                                                                  \
    return;                                                                                      \
  }
  TD__CUBLAS_FUNCTIONS(TD__CUBLAS_SYM)
  TD__CUBLAS_SYM(cublasGemmStridedBatchedEx)
#undef TD__CUBLAS_SYM
  td__cublas = api; /* (the handle stays open for the process's life) */
  load_status = TD_OK;
}

td_status td__cublas_load(void) {
  pthread_once(&load_once, load);
  if (load_status == TD_OK) return TD_OK;
  return td_set_error(TD_ERR_DEVICE, "cuda gemm: %s", load_error);
}
