/* cpu_half.h - bfloat16 / float16 helpers of the CPU kernels (internal; tensor/cpu_half.c).
 *
 * Every 16-bit kernel computes in float32 and rounds once per result (cpu_half.c's comment).
 * THREAD SAFETY: pure functions.
 */
#ifndef TD_TENSOR_CPU_HALF_H
#define TD_TENSOR_CPU_HALF_H

#include "cpu_kernels.h"
#include "tensor_impl.h"

/* Elements a chunked kernel converts at a time (float32 buffers of this size live on the
 * stack: 2 KiB each). */
#define TD__HALF_CHUNK 512

static inline bool td__dtype_is_half(td_dtype dt) {
  return dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16;
}

/* Contiguous rows: n elements converted. */
void td__cvt_bf16_to_f32(float *restrict d, const uint16_t *restrict s, int64_t n);
void td__cvt_f32_to_bf16(uint16_t *restrict d, const float *restrict s, int64_t n);
void td__cvt_f16_to_f32(float *restrict d, const uint16_t *restrict s, int64_t n);
void td__cvt_f32_to_f16(uint16_t *restrict d, const float *restrict s, int64_t n);

/* td__half_load reads n elements of 16-bit dtype dt, ss elements apart, into contiguous d. */
void td__half_load(td_dtype dt, float *d, const void *s, int64_t ss, int64_t n);
/* td__half_store writes contiguous s into n elements of dtype dt, sd elements apart. */
void td__half_store(td_dtype dt, void *d, int64_t sd, const float *s, int64_t n);
/* td__half_copy_pair returns true when td__half_copy_row converts from sdt to dd. */
static inline bool td__half_copy_pair(td_dtype dd, td_dtype sdt) {
  bool df = dd == TD_DTYPE_F32 || dd == TD_DTYPE_F64, sf = sdt == TD_DTYPE_F32 || sdt == TD_DTYPE_F64;
  return (td__dtype_is_half(dd) && sf) || (df && td__dtype_is_half(sdt));
}
/* td__half_copy_row copies one strided row between a 16-bit dtype and float32 / float64 (either
 * direction); returns false (nothing done) for any other pair of dtypes. */
bool td__half_copy_row(td_dtype dd, void *d, int64_t sd, td_dtype sdt, const void *s, int64_t ss,
                       int64_t n);

/* td__cpu_up returns in *out a contiguous float32 copy of t when t is 16-bit, else a new
 * reference to t; NULL for NULL. td__cpu_up_empty is the same without copying the contents (for
 * outputs). Release with td_tensor_unref. */
td_status td__cpu_up(const td_tensor *t, td_tensor **out);
td_status td__cpu_up_empty(const td_tensor *t, td_tensor **out);
/* td__cpu_down converts f back into t when they are different tensors (t 16-bit, f its float32
 * stand-in); nothing for NULL or t == f. */
td_status td__cpu_down(td_tensor *t, const td_tensor *f);
/* td__cpu_half_buffer allocates n floats (td__free) and, when src is not NULL, fills them from
 * src's n contiguous elements of dtype dt. */
td_status td__cpu_half_buffer(td_dtype dt, const void *src, int64_t n, float **out);

/* The float32 round trips of cpu_nn.c's kernels (same signatures as their td__cpu_ versions in
 * cpu_kernels.h, which call these for 16-bit tensors). */
td_status td__half_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner, bool log,
                           td_tensor *y);
td_status td__half_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                    int64_t r, int64_t inner, bool log, td_tensor *gx);
td_status td__half_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                       td_tensor *losses, int64_t *count);
td_status td__half_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                                td_tensor *gx);
td_status td__half_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                              td_tensor *idx);
td_status td__half_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx);
td_status td__half_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                             const td_tensor *index, const td_tensor *g);
td_status td__half_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                              double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd);
td_status td__half_layer_norm_backward(const td_tensor *gy, const td_tensor *x,
                                       const td_tensor *w, const td_tensor *mean,
                                       const td_tensor *rstd, td_tensor *gx, td_tensor *gw,
                                       td_tensor *gb);
td_status td__half_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                          int kw, int sh, int sw, int ph, int pw, void *col);
td_status td__half_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                          int kw, int sh, int sw, int ph, int pw, void *gx);

/* td__cpu_gemm_lowp is the GEMM entry (tensor_impl.h) for bfloat16 and float16: oneDNN's matmul
 * where the build has it (bfloat16 with float32 accumulation), else float32 copies through
 * OpenBLAS's sgemm. tensor/cpu_gemm_lowp.c. */
td_status td__cpu_gemm_lowp(td_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                            double alpha, const void *a, int64_t sa, const void *b, int64_t sb,
                            double beta, void *c, int64_t sc, int64_t batch);
/* td__cpu_gemm_lowp_native returns true when dt's GEMM runs natively in 16 bits on this thread
 * (oneDNN bfloat16), false when it goes through float32 copies. */
bool td__cpu_gemm_lowp_native(td_dtype dt);

#endif
