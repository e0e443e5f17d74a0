/* cuda_nn.cu - neural-network kernels of the CUDA backend: NLL loss (+ backward), im2col /
 * col2im for convolutions, and 2-d max pooling (+ backward).
 *
 * NLL validates targets on the device: the kernel counts the non-ignored targets and records the
 * first out-of-range row with atomics in a two-word scratch block, which the host reads back
 * (this read is the one synchronisation of the entry). The target and upstream-gradient vectors
 * may be strided (an expanded scalar gradient has stride 0).
 *
 * col2im gathers instead of scattering: each input pixel sums the column entries that read it, so
 * the result is deterministic and needs no atomics. Max-pooling backward scatters through the
 * saved arg-max with atomicAdd, because overlapping windows may pick the same input.
 *
 * Cross entropy (fused, for the op's fused path): see its kernels below.
 *
 * 16-bit floats: im2col moves their bits, col2im sums in float32 and rounds once per pixel; NLL
 * and pooling run on float32 copies (td__cu_up), as the CPU does.
 */
#include "cuda_impl.h"

namespace {

/* ---- NLL ---- */

template <typename T>
__global__ void nll_kernel(const T *logp, const int64_t *target, int64_t tstride, int64_t n,
                           int64_t c, int64_t ignore, T *losses, unsigned long long *stats) {
  TD_CU_LOOP(i, n) {
    int64_t t = target[i * tstride];
    T l = 0;
    if (t != ignore) {
      if (t < 0 || t >= c) {
        atomicMin(&stats[1], (unsigned long long)i);
      } else {
        l = -logp[i * c + t];
        atomicAdd(&stats[0], 1ull);
      }
    }
    losses[i] = l;
  }
}

template <typename T>
__global__ void nll_backward_kernel(const int64_t *target, int64_t tstride, const T *gl,
                                    int64_t gstride, int64_t n, int64_t c, int64_t ignore, T *gx) {
  TD_CU_LOOP(i, n) {
    int64_t t = target[i * tstride];
    if (t != ignore && t >= 0 && t < c) gx[i * c + t] = -gl[i * gstride];
  }
}

/* ---- fused cross entropy ----
 * One block per row (rows looped over with a capped grid). Forward: each thread keeps a running
 * max m and sum s of exp(x - m) over its share of the row in one pass (s rescaled when m grows;
 * -inf entries add nothing), the block combines them (max, then the sum of s exp(m - M)), and
 * lse = M + log(S); loss = lse - x[t]. The sums are in double (Acc), exp in the compute type.
 * Targets are validated as NLL does (count and first bad row in the stats words). Backward:
 * gx = gl (exp(x - lse) - [c == t]) per element, zero rows for ignored targets. */
/* ce_row_end: the block's combination of its threads' (max m, sum s) for row and thread 0's
 * loss, lse and target check (the forward kernels' common end). */
template <typename T, typename C>
__device__ __forceinline__ void ce_row_end(const T *xr, int64_t row, int64_t c, C m, double s,
                                           const int64_t *target, int64_t tstride,
                                           int64_t ignore, C *losses, C *lse,
                                           unsigned long long *stats) {
  C mx = td__cu_block_max(m);
  double part = s == 0 ? 0.0 : s * (double)exp(m - mx);
  double tot = td__cu_block_sum(part);
  if (threadIdx.x == 0) {
    double l = (double)mx + log(tot);
    int64_t t = target[row * tstride];
    C loss = 0;
    if (t != ignore) {
      if (t < 0 || t >= c) {
        atomicMin(&stats[1], (unsigned long long)row);
      } else {
        loss = (C)(l - (double)td__ld(xr[t]));
        atomicAdd(&stats[0], 1ull);
      }
    }
    losses[row] = loss;
    lse[row] = (C)l;
  }
}

template <typename T>
__global__ void ce_kernel(const T *x, int64_t n, int64_t c, const int64_t *target,
                          int64_t tstride, int64_t ignore, Cmp<T> *losses, Cmp<T> *lse,
                          unsigned long long *stats) {
  using C = Cmp<T>;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T *xr = x + row * c;
    C m = -(C)INFINITY;
    double s = 0;
    for (int64_t k = threadIdx.x; k < c; k += blockDim.x) {
      C v = td__ld(xr[k]);
      if (v > m) {
        s = (m == -(C)INFINITY ? 0.0 : s * (double)exp(m - v)) + 1.0;
        m = v;
      } else if (!(v == -(C)INFINITY)) {
        s += (double)exp(v - m); /* NaN propagates */
      }
    }
    ce_row_end(xr, row, c, m, s, target, tstride, ignore, losses, lse, stats);
  }
}

template <typename T>
__global__ void ce_backward_kernel(const T *x, int64_t n, int64_t c, const int64_t *target,
                                   int64_t tstride, int64_t ignore, const Cmp<T> *lse,
                                   const Cmp<T> *gl, int64_t gstride, T *gx) {
  using C = Cmp<T>;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T *xr = x + row * c;
    T *gr = gx + row * c;
    int64_t t = target[row * tstride];
    bool on = t != ignore && t >= 0 && t < c;
    C g = on ? gl[row * gstride] : (C)0, l = lse[row];
    for (int64_t k = threadIdx.x; k < c; k += blockDim.x) {
      C p = exp(td__ld(xr[k]) - l);
      gr[k] = Cvt<T>::st(on ? g * (p - (k == t ? (C)1 : (C)0)) : (C)0);
    }
  }
}

/* The 16-bit cross-entropy kernels above with 16-byte loads and stores (8 elements at a time; rows
 * a multiple of 8 elements, 16-byte aligned). The same arithmetic element by element: the backward
 * gives the same bits; in the forward each thread's share of a row is other elements (8
 * consecutive ones at a time), so the row's sum may differ in its last bits. */
template <typename T> union Vec8 {
  uint4 u;
  T e[8];
};

template <typename T>
__global__ void ce_vec_kernel(const T *x, int64_t n, int64_t c, const int64_t *target,
                              int64_t tstride, int64_t ignore, float *losses, float *lse,
                              unsigned long long *stats) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T *xr = x + row * c;
    const uint4 *xv = (const uint4 *)xr;
    float m = -INFINITY;
    double s = 0;
    for (int64_t k8 = threadIdx.x; k8 < c / 8; k8 += blockDim.x) {
      Vec8<T> w;
      w.u = xv[k8];
#pragma unroll
      for (int e = 0; e < 8; e++) {
        float v = td__ld(w.e[e]);
        if (v > m) {
          s = (m == -INFINITY ? 0.0 : s * (double)expf(m - v)) + 1.0;
          m = v;
        } else if (!(v == -INFINITY)) {
          s += (double)expf(v - m); /* NaN propagates */
        }
      }
    }
    ce_row_end(xr, row, c, m, s, target, tstride, ignore, losses, lse, stats);
  }
}

template <typename T>
__global__ void ce_backward_vec_kernel(const T *x, int64_t n, int64_t c, const int64_t *target,
                                       int64_t tstride, int64_t ignore, const float *lse,
                                       const float *gl, int64_t gstride, T *gx) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const uint4 *xv = (const uint4 *)(x + row * c);
    uint4 *gv = (uint4 *)(gx + row * c);
    int64_t t = target[row * tstride];
    bool on = t != ignore && t >= 0 && t < c;
    float g = on ? gl[row * gstride] : 0.0f, l = lse[row];
    for (int64_t k8 = threadIdx.x; k8 < c / 8; k8 += blockDim.x) {
      Vec8<T> w, o;
      w.u = xv[k8];
#pragma unroll
      for (int e = 0; e < 8; e++) {
        int64_t k = k8 * 8 + e;
        float p = expf(td__ld(w.e[e]) - l);
        o.e[e] = Cvt<T>::st(on ? g * (p - (k == t ? 1.0f : 0.0f)) : 0.0f);
      }
      gv[k8] = o.u;
    }
  }
}

/* vec8_ok: 16-bit rows of c elements at p take the kernels above. */
bool vec8_ok(td_dtype dt, const void *p, int64_t c) {
  return (dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16) && c % 8 == 0 && ((uintptr_t)p & 15) == 0;
}

/* ---- im2col / col2im ---- */

template <typename T>
__global__ void im2col_kernel(const T *x, int64_t c, int64_t h, int64_t w, int kh, int kw, int sh,
                              int sw, int ph, int pw, int64_t oh, int64_t ow, T *col) {
  int64_t total = c * kh * kw * oh * ow;
  TD_CU_LOOP(e, total) {
    int64_t ox = e % ow, t = e / ow;
    int64_t oy = t % oh;
    t /= oh;
    int64_t kj = t % kw;
    t /= kw;
    int64_t ki = t % kh, ch = t / kh;
    int64_t iy = oy * sh - ph + ki, ix = ox * sw - pw + kj;
    col[e] = (iy >= 0 && iy < h && ix >= 0 && ix < w) ? x[(ch * h + iy) * w + ix] : (T)0;
  }
}

template <typename T>
__global__ void col2im_kernel(const T *col, int64_t c, int64_t h, int64_t w, int kh, int kw,
                              int sh, int sw, int ph, int pw, int64_t oh, int64_t ow, T *gx) {
  int64_t total = c * h * w;
  TD_CU_LOOP(e, total) {
    int64_t x = e % w, t = e / w;
    int64_t y = t % h, ch = t / h;
    Cmp<T> sum = 0;
    for (int ki = 0; ki < kh; ki++) {
      int64_t ny = y + ph - ki;
      if (ny < 0 || ny % sh != 0) continue;
      int64_t oy = ny / sh;
      if (oy >= oh) continue;
      for (int kj = 0; kj < kw; kj++) {
        int64_t nx = x + pw - kj;
        if (nx < 0 || nx % sw != 0) continue;
        int64_t ox = nx / sw;
        if (ox >= ow) continue;
        sum += td__ld(col[((ch * kh + ki) * kw + kj) * oh * ow + oy * ow + ox]);
      }
    }
    gx[e] = Cvt<T>::st(td__ld(gx[e]) + sum);
  }
}

/* conv_geometry checks the convolution arguments and returns the output size. */
td_status conv_geometry(const char *op, td_dtype dt, int64_t h, int64_t w, int kh, int kw, int sh,
                        int sw, int ph, int pw, int64_t *oh, int64_t *ow) {
  if (!td_dtype_is_float(dt))
    return td_set_error(TD_ERR_DTYPE, "cuda %s: %s images are not supported", op,
                        td_dtype_name(dt));
  if (kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0 || ph < 0 || pw < 0)
    return td_set_error(TD_ERR_INVALID, "cuda %s: bad kernel %dx%d, stride %dx%d or padding %dx%d",
                        op, kh, kw, sh, sw, ph, pw);
  *oh = (h + 2 * ph - kh) / sh + 1;
  *ow = (w + 2 * pw - kw) / sw + 1;
  if (h + 2 * ph < kh || w + 2 * pw < kw) *oh = *ow = 0;
  return TD_OK;
}

/* ---- max pooling ---- */

template <typename T>
__global__ void max_pool2d_kernel(const T *x, int64_t total, int64_t h, int64_t w, int64_t oh,
                                  int64_t ow, int kh, int kw, int sh, int sw, T *y, int64_t *idx) {
  TD_CU_LOOP(e, total) {
    int64_t ox = e % ow, t = e / ow;
    int64_t oy = t % oh, nc = t / oh;
    const T *p = x + nc * h * w;
    int64_t y0 = oy * sh, x0 = ox * sw;
    T best = -(T)INFINITY;
    int64_t bi = y0 * w + x0;
    for (int i = 0; i < kh; i++) {
      for (int j = 0; j < kw; j++) {
        int64_t pos = (y0 + i) * w + x0 + j;
        T v = p[pos];
        if (v > best || v != v) {
          best = v;
          bi = pos;
        }
      }
    }
    y[e] = best;
    if (idx) idx[e] = bi;
  }
}

template <typename T>
__global__ void max_pool2d_backward_kernel(const T *gy, const int64_t *idx, int64_t total,
                                           int64_t plane_out, int64_t plane_in, T *gx) {
  TD_CU_LOOP(e, total) {
    int64_t i = idx[e];
    if (i >= 0 && i < plane_in) td__cu_atomic_add(&gx[(e / plane_out) * plane_in + i], gy[e]);
  }
}

} /* namespace */

/* ---- entries ---- */

td_status td__cu_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                     td_tensor *losses, int64_t *count) {
  const char *op = "nll";
  if (td__cu_is_half(logp->dtype)) {
    td_tensor *lf = NULL, *of = NULL;
    td_status st = td__cu_up(logp, &lf);
    if (st == TD_OK) st = td__cu_up_empty(losses, &of);
    if (st == TD_OK) st = td__cu_nll(lf, target, ignore_index, of, count);
    if (st == TD_OK) st = td__cu_down(losses, of);
    td_tensor_unref(lf);
    td_tensor_unref(of);
    return st;
  }
  TD_TRY(td__cu_enter(op, logp));
  TD_TRY(td__cu_same_device(op, logp, target));
  TD_TRY(td__cu_same_device(op, logp, losses));
  TD_TRY(td__cu_need_contig(op, logp));
  TD_TRY(td__cu_need_contig(op, losses));
  if (logp->dtype == TD_DTYPE_I64 || losses->dtype != logp->dtype)
    return td_set_error(TD_ERR_DTYPE, "cuda nll: log-probabilities and losses need one float dtype");
  if (target->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda nll: targets must be int64, got %s",
                        td_dtype_name(target->dtype));
  /* Geometry from element counts, as on the CPU: N targets, C = numel(logp) / N. */
  int64_t n = 0, tstride = 0;
  TD_TRY(td__cu_vector(op, target, &n, &tstride));
  int64_t c = n > 0 ? td__cu_numel(logp) / n : 0;
  if (n > 0 && (n * c != td__cu_numel(logp) || td__cu_numel(losses) != n))
    return td_set_error(TD_ERR_SHAPE, "cuda nll: %lld targets for %lld log-probabilities and "
                        "%lld losses", (long long)n, (long long)td__cu_numel(logp),
                        (long long)td__cu_numel(losses));
  if (n == 0) {
    *count = 0;
    return TD_OK;
  }
  int dev = td__cu_dev(logp);
  void *scratch = nullptr;
  TD_TRY(td__cu_scratch_alloc(dev, 2 * sizeof(unsigned long long), &scratch));
  unsigned long long *stats = (unsigned long long *)scratch;
  unsigned long long host[2] = {0, 0};
  td_status st = TD_OK;
  cudaError_t e = cudaMemsetAsync(stats, 0, sizeof(unsigned long long), 0);
  if (e == cudaSuccess) e = cudaMemsetAsync(stats + 1, 0xff, sizeof(unsigned long long), 0);
  if (e != cudaSuccess) {
    st = td__cu_error(e, op);
    goto out;
  }
  {
    unsigned grid = td__cu_grid(n, TD_CU_THREADS);
    const int64_t *pt = (const int64_t *)td__cu_ptr(target);
    if (logp->dtype == TD_DTYPE_F32)
      nll_kernel<float><<<grid, TD_CU_THREADS>>>((const float *)td__cu_ptr(logp), pt, tstride, n,
                                                 c, ignore_index, (float *)td__cu_ptr(losses),
                                                 stats);
    else
      nll_kernel<double><<<grid, TD_CU_THREADS>>>((const double *)td__cu_ptr(logp), pt, tstride,
                                                  n, c, ignore_index,
                                                  (double *)td__cu_ptr(losses), stats);
    st = td__cu_check_launch(op);
    if (st != TD_OK) goto out;
    e = cudaMemcpy(host, stats, sizeof host, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      st = td__cu_error(e, op);
      goto out;
    }
    if (host[1] != ~0ull) {
      int64_t bad = 0, row = (int64_t)host[1];
      e = cudaMemcpy(&bad, pt + row * tstride, sizeof bad, cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) {
        st = td__cu_error(e, op);
        goto out;
      }
      st = td_set_error(TD_ERR_INVALID,
                        "cuda nll: target %lld at row %lld is out of range [0, %lld)",
                        (long long)bad, (long long)row, (long long)c);
      goto out;
    }
    *count = (int64_t)host[0];
  }
out:
  td__cu_scratch_free(dev, scratch);
  return st;
}

td_status td__cu_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                              td_tensor *gx) {
  const char *op = "nll_backward";
  if (td__cu_is_half(gx->dtype)) {
    td_tensor *gf = NULL, *xf = NULL;
    td_status st = td__cu_up(gl, &gf);
    if (st == TD_OK) st = td__cu_up_empty(gx, &xf);
    if (st == TD_OK) st = td__cu_nll_backward(target, gf, ignore_index, xf);
    if (st == TD_OK) st = td__cu_down(gx, xf);
    td_tensor_unref(gf);
    td_tensor_unref(xf);
    return st;
  }
  TD_TRY(td__cu_enter(op, gx));
  TD_TRY(td__cu_same_device(op, gx, target));
  TD_TRY(td__cu_same_device(op, gx, gl));
  TD_TRY(td__cu_need_contig(op, gx));
  if (gx->dtype == TD_DTYPE_I64 || gl->dtype != gx->dtype)
    return td_set_error(TD_ERR_DTYPE, "cuda nll_backward: gradients need one float dtype");
  if (target->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda nll_backward: targets must be int64");
  int64_t n = 0, tstride = 0, gn = 0, gstride = 0;
  TD_TRY(td__cu_vector(op, target, &n, &tstride));
  TD_TRY(td__cu_vector(op, gl, &gn, &gstride));
  if (n == 0) return TD_OK;
  int64_t c = td__cu_numel(gx) / n;
  if (gn != n || n * c != td__cu_numel(gx))
    return td_set_error(TD_ERR_SHAPE, "cuda nll_backward: %lld targets, %lld gradients, %lld "
                        "outputs", (long long)n, (long long)gn, (long long)td__cu_numel(gx));
  size_t bytes = (size_t)(n * c) * td__cu_esize(gx->dtype);
  if (bytes == 0) return TD_OK;
  cudaError_t e = cudaMemsetAsync(td__cu_ptr(gx), 0, bytes, 0);
  if (e != cudaSuccess) return td__cu_error(e, op);
  unsigned grid = td__cu_grid(n, TD_CU_THREADS);
  const int64_t *pt = (const int64_t *)td__cu_ptr(target);
  if (gx->dtype == TD_DTYPE_F32)
    nll_backward_kernel<float><<<grid, TD_CU_THREADS>>>(pt, tstride, (const float *)td__cu_ptr(gl),
                                                        gstride, n, c, ignore_index,
                                                        (float *)td__cu_ptr(gx));
  else
    nll_backward_kernel<double><<<grid, TD_CU_THREADS>>>(
        pt, tstride, (const double *)td__cu_ptr(gl), gstride, n, c, ignore_index,
        (double *)td__cu_ptr(gx));
  return td__cu_check_launch(op);
}

td_status td__cu_cross_entropy(const td_tensor *logits, const td_tensor *target,
                               int64_t ignore_index, td_tensor *losses, td_tensor *lse,
                               int64_t *count) {
  const char *op = "cross_entropy";
  TD_TRY(td__cu_enter(op, logits));
  TD_TRY(td__cu_same_device(op, logits, target));
  TD_TRY(td__cu_same_device(op, logits, losses));
  TD_TRY(td__cu_same_device(op, logits, lse));
  TD_TRY(td__cu_need_contig(op, logits));
  TD_TRY(td__cu_need_contig(op, losses));
  TD_TRY(td__cu_need_contig(op, lse));
  td_dtype dt = logits->dtype, ldt = dt == TD_DTYPE_F64 ? TD_DTYPE_F64 : TD_DTYPE_F32;
  if (!td_dtype_is_float(dt) || losses->dtype != ldt || lse->dtype != ldt)
    return td_set_error(TD_ERR_DTYPE, "cuda cross_entropy: %s logits need %s losses",
                        td_dtype_name(dt), td_dtype_name(ldt));
  if (target->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda cross_entropy: targets must be int64");
  int64_t n = 0, tstride = 0;
  TD_TRY(td__cu_vector(op, target, &n, &tstride));
  if (n == 0) {
    *count = 0;
    return TD_OK;
  }
  int64_t c = td__cu_numel(logits) / n;
  if (c * n != td__cu_numel(logits) || c == 0 || td__cu_numel(losses) != n ||
      td__cu_numel(lse) != n)
    return td_set_error(TD_ERR_SHAPE, "cuda cross_entropy: %lld targets for %lld logits",
                        (long long)n, (long long)td__cu_numel(logits));
  int dev = td__cu_dev(logits);
  void *scratch = nullptr;
  TD_TRY(td__cu_scratch_alloc(dev, 2 * sizeof(unsigned long long), &scratch));
  unsigned long long *stats = (unsigned long long *)scratch, host[2] = {0, 0};
  td_status st = TD_OK;
  cudaError_t e = cudaMemsetAsync(stats, 0, sizeof(unsigned long long), 0);
  if (e == cudaSuccess) e = cudaMemsetAsync(stats + 1, 0xff, sizeof(unsigned long long), 0);
  if (e != cudaSuccess) st = td__cu_error(e, op);
  const int64_t *pt = (const int64_t *)td__cu_ptr(target);
  unsigned grid = (unsigned)(n < TD_CU_MAX_BLOCKS ? n : TD_CU_MAX_BLOCKS);
  int threads = td__cu_block_threads(c);
  if (st == TD_OK) {
    const void *px = td__cu_ptr(logits);
    void *pl = td__cu_ptr(losses), *ps = td__cu_ptr(lse);
    switch (dt) {
      case TD_DTYPE_F32:
        ce_kernel<float><<<grid, threads>>>((const float *)px, n, c, pt, tstride, ignore_index,
                                            (float *)pl, (float *)ps, stats);
        break;
      case TD_DTYPE_F64:
        ce_kernel<double><<<grid, threads>>>((const double *)px, n, c, pt, tstride, ignore_index,
                                             (double *)pl, (double *)ps, stats);
        break;
      case TD_DTYPE_BF16:
        if (vec8_ok(dt, px, c))
          ce_vec_kernel<td_bf16><<<grid, threads>>>((const td_bf16 *)px, n, c, pt, tstride,
                                                    ignore_index, (float *)pl, (float *)ps,
                                                    stats);
        else
          ce_kernel<td_bf16><<<grid, threads>>>((const td_bf16 *)px, n, c, pt, tstride,
                                                ignore_index, (float *)pl, (float *)ps, stats);
        break;
      default:
        if (vec8_ok(dt, px, c))
          ce_vec_kernel<td_f16><<<grid, threads>>>((const td_f16 *)px, n, c, pt, tstride,
                                                   ignore_index, (float *)pl, (float *)ps, stats);
        else
          ce_kernel<td_f16><<<grid, threads>>>((const td_f16 *)px, n, c, pt, tstride,
                                               ignore_index, (float *)pl, (float *)ps, stats);
        break;
    }
    st = td__cu_check_launch(op);
  }
  if (st == TD_OK) { /* the count for the mean, and the targets' check: one synchronisation */
    e = cudaMemcpy(host, stats, sizeof host, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) st = td__cu_error(e, op);
  }
  if (st == TD_OK && host[1] != ~0ull) {
    int64_t bad = 0, row = (int64_t)host[1];
    e = cudaMemcpy(&bad, pt + row * tstride, sizeof bad, cudaMemcpyDeviceToHost);
    st = e != cudaSuccess ? td__cu_error(e, op)
                          : td_set_error(TD_ERR_INVALID,
                                         "cuda cross_entropy: target %lld at row %lld is out of "
                                         "range [0, %lld)", (long long)bad, (long long)row,
                                         (long long)c);
  }
  if (st == TD_OK) *count = (int64_t)host[0];
  td__cu_scratch_free(dev, scratch);
  return st;
}

td_status td__cu_cross_entropy_backward(const td_tensor *logits, const td_tensor *target,
                                        const td_tensor *lse, const td_tensor *gl,
                                        int64_t ignore_index, td_tensor *gx) {
  const char *op = "cross_entropy_backward";
  TD_TRY(td__cu_enter(op, gx));
  const td_tensor *same[4] = {logits, target, lse, gl};
  for (int i = 0; i < 4; i++) TD_TRY(td__cu_same_device(op, gx, same[i]));
  TD_TRY(td__cu_need_contig(op, logits));
  TD_TRY(td__cu_need_contig(op, lse));
  TD_TRY(td__cu_need_contig(op, gx));
  td_dtype dt = logits->dtype, ldt = dt == TD_DTYPE_F64 ? TD_DTYPE_F64 : TD_DTYPE_F32;
  if (gx->dtype != dt || lse->dtype != ldt || gl->dtype != ldt || target->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda cross_entropy_backward: dtypes do not match");
  int64_t n = 0, tstride = 0, gn = 0, gstride = 0;
  TD_TRY(td__cu_vector(op, target, &n, &tstride));
  TD_TRY(td__cu_vector(op, gl, &gn, &gstride));
  if (n == 0) return TD_OK;
  int64_t c = td__cu_numel(gx) / n;
  if (gn != n || c * n != td__cu_numel(gx) || td__cu_numel(logits) != c * n ||
      td__cu_numel(lse) != n)
    return td_set_error(TD_ERR_SHAPE, "cuda cross_entropy_backward: inconsistent sizes");
  if (c == 0) return TD_OK;
  const int64_t *pt = (const int64_t *)td__cu_ptr(target);
  unsigned grid = (unsigned)(n < TD_CU_MAX_BLOCKS ? n : TD_CU_MAX_BLOCKS);
  int threads = td__cu_block_threads(c);
  const void *px = td__cu_ptr(logits), *ps = td__cu_ptr(lse), *pg = td__cu_ptr(gl);
  void *po = td__cu_ptr(gx);
  switch (dt) {
    case TD_DTYPE_F32:
      ce_backward_kernel<float><<<grid, threads>>>((const float *)px, n, c, pt, tstride,
                                                   ignore_index, (const float *)ps,
                                                   (const float *)pg, gstride, (float *)po);
      break;
    case TD_DTYPE_F64:
      ce_backward_kernel<double><<<grid, threads>>>((const double *)px, n, c, pt, tstride,
                                                    ignore_index, (const double *)ps,
                                                    (const double *)pg, gstride, (double *)po);
      break;
    case TD_DTYPE_BF16:
      if (vec8_ok(dt, px, c) && vec8_ok(dt, po, c))
        ce_backward_vec_kernel<td_bf16><<<grid, threads>>>(
            (const td_bf16 *)px, n, c, pt, tstride, ignore_index, (const float *)ps,
            (const float *)pg, gstride, (td_bf16 *)po);
      else
        ce_backward_kernel<td_bf16><<<grid, threads>>>((const td_bf16 *)px, n, c, pt, tstride,
                                                       ignore_index, (const float *)ps,
                                                       (const float *)pg, gstride, (td_bf16 *)po);
      break;
    case TD_DTYPE_F16:
      if (vec8_ok(dt, px, c) && vec8_ok(dt, po, c))
        ce_backward_vec_kernel<td_f16><<<grid, threads>>>(
            (const td_f16 *)px, n, c, pt, tstride, ignore_index, (const float *)ps,
            (const float *)pg, gstride, (td_f16 *)po);
      else
        ce_backward_kernel<td_f16><<<grid, threads>>>((const td_f16 *)px, n, c, pt, tstride,
                                                      ignore_index, (const float *)ps,
                                                      (const float *)pg, gstride, (td_f16 *)po);
      break;
    default:
      return td_set_error(TD_ERR_DTYPE, "cuda cross_entropy_backward: %s logits",
                          td_dtype_name(dt));
  }
  return td__cu_check_launch(op);
}

td_status td__cu_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                        int kw, int sh, int sw, int ph, int pw, void *col) {
  const char *op = "im2col";
  int64_t oh = 0, ow = 0;
  TD_TRY(conv_geometry(op, dt, h, w, kh, kw, sh, sw, ph, pw, &oh, &ow));
  int64_t total = c * kh * kw * oh * ow;
  if (total == 0) return TD_OK;
  int dev = 0;
  TD_TRY(td__cu_device_of(col, op, &dev));
  TD_TRY(td__cu_set_device(dev, op));
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  if (dt == TD_DTYPE_F32)
    im2col_kernel<float><<<grid, TD_CU_THREADS>>>((const float *)x, c, h, w, kh, kw, sh, sw, ph,
                                                  pw, oh, ow, (float *)col);
  else if (td__cu_is_half(dt)) /* a gather: the elements' bits (zero padding is +0) */
    im2col_kernel<uint16_t><<<grid, TD_CU_THREADS>>>((const uint16_t *)x, c, h, w, kh, kw, sh, sw,
                                                     ph, pw, oh, ow, (uint16_t *)col);
  else
    im2col_kernel<double><<<grid, TD_CU_THREADS>>>((const double *)x, c, h, w, kh, kw, sh, sw, ph,
                                                   pw, oh, ow, (double *)col);
  return td__cu_check_launch(op);
}

td_status td__cu_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                        int kw, int sh, int sw, int ph, int pw, void *gx) {
  const char *op = "col2im";
  int64_t oh = 0, ow = 0;
  TD_TRY(conv_geometry(op, dt, h, w, kh, kw, sh, sw, ph, pw, &oh, &ow));
  int64_t total = c * h * w;
  if (total == 0 || oh * ow == 0) return TD_OK;
  int dev = 0;
  TD_TRY(td__cu_device_of(gx, op, &dev));
  TD_TRY(td__cu_set_device(dev, op));
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  if (dt == TD_DTYPE_F32)
    col2im_kernel<float><<<grid, TD_CU_THREADS>>>((const float *)col, c, h, w, kh, kw, sh, sw, ph,
                                                  pw, oh, ow, (float *)gx);
  else if (dt == TD_DTYPE_BF16)
    col2im_kernel<td_bf16><<<grid, TD_CU_THREADS>>>((const td_bf16 *)col, c, h, w, kh, kw, sh, sw,
                                                    ph, pw, oh, ow, (td_bf16 *)gx);
  else if (dt == TD_DTYPE_F16)
    col2im_kernel<td_f16><<<grid, TD_CU_THREADS>>>((const td_f16 *)col, c, h, w, kh, kw, sh, sw,
                                                   ph, pw, oh, ow, (td_f16 *)gx);
  else
    col2im_kernel<double><<<grid, TD_CU_THREADS>>>((const double *)col, c, h, w, kh, kw, sh, sw,
                                                   ph, pw, oh, ow, (double *)gx);
  return td__cu_check_launch(op);
}

td_status td__cu_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                            td_tensor *idx) {
  const char *op = "max_pool2d";
  if (td__cu_is_half(x->dtype)) {
    td_tensor *xf = NULL, *yf = NULL;
    td_status st = td__cu_up(x, &xf);
    if (st == TD_OK) st = td__cu_up_empty(y, &yf);
    if (st == TD_OK) st = td__cu_max_pool2d(xf, kh, kw, sh, sw, yf, idx);
    if (st == TD_OK) st = td__cu_down(y, yf);
    td_tensor_unref(xf);
    td_tensor_unref(yf);
    return st;
  }
  TD_TRY(td__cu_enter(op, y));
  TD_TRY(td__cu_same_device(op, y, x));
  TD_TRY(td__cu_same_device(op, y, idx));
  TD_TRY(td__cu_need_contig(op, x));
  TD_TRY(td__cu_need_contig(op, y));
  TD_TRY(td__cu_need_contig(op, idx));
  if (x->dtype == TD_DTYPE_I64 || y->dtype != x->dtype || (idx && idx->dtype != TD_DTYPE_I64))
    return td_set_error(TD_ERR_DTYPE, "cuda max_pool2d: needs float input/output, int64 indices");
  if (x->ndim != 4 || y->ndim != 4)
    return td_set_error(TD_ERR_SHAPE, "cuda max_pool2d: input and output must be 4-d");
  if (kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0)
    return td_set_error(TD_ERR_INVALID, "cuda max_pool2d: bad kernel %dx%d or stride %dx%d", kh,
                        kw, sh, sw);
  int64_t h = x->shape[2], w = x->shape[3], oh = y->shape[2], ow = y->shape[3];
  if (oh > 0 && ow > 0 && ((oh - 1) * sh + kh > h || (ow - 1) * sw + kw > w))
    return td_set_error(TD_ERR_SHAPE, "cuda max_pool2d: output %lldx%lld does not fit input "
                        "%lldx%lld", (long long)oh, (long long)ow, (long long)h, (long long)w);
  int64_t total = td__cu_numel(y);
  if (total == 0) return TD_OK;
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  int64_t *pi = idx ? (int64_t *)td__cu_ptr(idx) : nullptr;
  if (x->dtype == TD_DTYPE_F32)
    max_pool2d_kernel<float><<<grid, TD_CU_THREADS>>>((const float *)td__cu_ptr(x), total, h, w,
                                                      oh, ow, kh, kw, sh, sw,
                                                      (float *)td__cu_ptr(y), pi);
  else
    max_pool2d_kernel<double><<<grid, TD_CU_THREADS>>>((const double *)td__cu_ptr(x), total, h,
                                                       w, oh, ow, kh, kw, sh, sw,
                                                       (double *)td__cu_ptr(y), pi);
  return td__cu_check_launch(op);
}

td_status td__cu_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx) {
  const char *op = "max_pool2d_backward";
  if (td__cu_is_half(gx->dtype)) {
    td_tensor *gyf = NULL, *gxf = NULL;
    td_status st = td__cu_up(gy, &gyf);
    if (st == TD_OK) st = td__cu_up(gx, &gxf); /* accumulated into: its contents matter */
    if (st == TD_OK) st = td__cu_max_pool2d_backward(gyf, idx, gxf);
    if (st == TD_OK) st = td__cu_down(gx, gxf);
    td_tensor_unref(gyf);
    td_tensor_unref(gxf);
    return st;
  }
  TD_TRY(td__cu_enter(op, gx));
  TD_TRY(td__cu_same_device(op, gx, gy));
  TD_TRY(td__cu_same_device(op, gx, idx));
  TD_TRY(td__cu_need_contig(op, gy));
  TD_TRY(td__cu_need_contig(op, idx));
  TD_TRY(td__cu_need_contig(op, gx));
  if (gx->dtype == TD_DTYPE_I64 || gy->dtype != gx->dtype || idx->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda max_pool2d_backward: needs float gradients, int64 "
                        "indices");
  if (gx->ndim != 4 || gy->ndim != 4 || td__cu_numel(idx) != td__cu_numel(gy))
    return td_set_error(TD_ERR_SHAPE, "cuda max_pool2d_backward: bad gradient or index shape");
  int64_t total = td__cu_numel(gy);
  if (total == 0) return TD_OK;
  int64_t plane_out = gy->shape[2] * gy->shape[3], plane_in = gx->shape[2] * gx->shape[3];
  unsigned grid = td__cu_grid(total, TD_CU_THREADS);
  const int64_t *pi = (const int64_t *)td__cu_ptr(idx);
  if (gx->dtype == TD_DTYPE_F32)
    max_pool2d_backward_kernel<float><<<grid, TD_CU_THREADS>>>(
        (const float *)td__cu_ptr(gy), pi, total, plane_out, plane_in, (float *)td__cu_ptr(gx));
  else
    max_pool2d_backward_kernel<double><<<grid, TD_CU_THREADS>>>(
        (const double *)td__cu_ptr(gy), pi, total, plane_out, plane_in, (double *)td__cu_ptr(gx));
  return td__cu_check_launch(op);
}
