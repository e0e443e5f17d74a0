/* cpu_nn.c - CPU kernels for the neural-network entries of the backend table.
 *
 * softmax / log-softmax, NLL, im2col / col2im, 2-d max pooling, index_select / index_add and
 * layer norm, each with its backward. The op files (ops_softmax.c, ops_conv.c, ops_index.c,
 * ops_norm.c) check arguments and shapes and hand these kernels contiguous tensors; the kernels
 * only re-check what would otherwise corrupt memory (indices, targets).
 *
 * Design: each kernel body is written once as a macro over the element type T and instantiated
 * for float and double; a small exported wrapper dispatches on dtype. Sums over long rows
 * (softmax denominators, NLL, layer-norm moments and parameter gradients) accumulate in double
 * so float32 results match float64 ones to float precision. Hot loops are plain loops over
 * contiguous memory with no per-element calls (except exp/log/sqrt); im2col copies whole valid
 * row segments with memcpy when the horizontal stride is 1.
 */
#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_math.h"

/* The 64-byte vectors of cpu_math.h only live in inlined code. */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wunknown-warning-option"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"

#include <math.h>
#include <string.h>

#define UNSUPPORTED(op, dt) \
  td_set_error(TD_ERR_DTYPE, "%s: CPU kernel does not support dtype %s", op, td_dtype_name(dt))

/* ---- softmax ---- */

/* tmp: 2 * inner doubles when inner > 1. */
#define DEF_SOFTMAX(T, SFX)                                                                     \
  static void softmax_##SFX(const T *x, T *y, int64_t outer, int64_t r, int64_t inner,         \
                            bool logsm, double *tmp) {                                          \
    if (inner == 1) {                                                                           \
      for (int64_t o = 0; o < outer; o++) {                                                     \
        const T *xr = x + o * r;                                                                \
        T *yr = y + o * r;                                                                      \
        double mx = -INFINITY;                                                                  \
        for (int64_t k = 0; k < r; k++)                                                         \
          if (xr[k] > mx) mx = xr[k];                                                           \
        double s = 0;                                                                           \
        if (logsm) {                                                                            \
          for (int64_t k = 0; k < r; k++) s += exp((double)xr[k] - mx);                         \
          double ls = log(s); /* (x - max) - log(sum): exact first step, as in PyTorch */      \
          for (int64_t k = 0; k < r; k++) yr[k] = (T)(((double)xr[k] - mx) - ls);               \
        } else {                                                                                \
          for (int64_t k = 0; k < r; k++) {                                                     \
            double e = exp((double)xr[k] - mx);                                                 \
            s += e;                                                                             \
            yr[k] = (T)e;                                                                       \
          }                                                                                     \
          double inv = 1.0 / s;                                                                 \
          for (int64_t k = 0; k < r; k++) yr[k] = (T)((double)yr[k] * inv);                     \
        }                                                                                       \
      }                                                                                         \
      return;                                                                                   \
    }                                                                                           \
    double *mx = tmp, *s = tmp + inner;                                                         \
    for (int64_t o = 0; o < outer; o++) {                                                       \
      const T *xb = x + o * r * inner;                                                          \
      T *yb = y + o * r * inner;                                                                \
      for (int64_t i = 0; i < inner; i++) {                                                     \
        mx[i] = -INFINITY;                                                                      \
        s[i] = 0;                                                                               \
      }                                                                                         \
      for (int64_t k = 0; k < r; k++) {                                                         \
        const T *xr = xb + k * inner;                                                           \
        for (int64_t i = 0; i < inner; i++)                                                     \
          if (xr[i] > mx[i]) mx[i] = xr[i];                                                     \
      }                                                                                         \
      for (int64_t k = 0; k < r; k++) {                                                         \
        const T *xr = xb + k * inner;                                                           \
        T *yr = yb + k * inner;                                                                 \
        for (int64_t i = 0; i < inner; i++) {                                                   \
          double e = exp((double)xr[i] - mx[i]);                                                \
          s[i] += e;                                                                            \
          if (!logsm) yr[i] = (T)e;                                                             \
        }                                                                                       \
      }                                                                                         \
      if (logsm) {                                                                              \
        for (int64_t i = 0; i < inner; i++) s[i] = log(s[i]);                                   \
        for (int64_t k = 0; k < r; k++) {                                                       \
          const T *xr = xb + k * inner;                                                         \
          T *yr = yb + k * inner;                                                               \
          for (int64_t i = 0; i < inner; i++) yr[i] = (T)(((double)xr[i] - mx[i]) - s[i]);      \
        }                                                                                       \
      } else {                                                                                  \
        for (int64_t i = 0; i < inner; i++) s[i] = 1.0 / s[i];                                  \
        for (int64_t k = 0; k < r; k++) {                                                       \
          T *yr = yb + k * inner;                                                               \
          for (int64_t i = 0; i < inner; i++) yr[i] = (T)((double)yr[i] * s[i]);                \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

/* softmax: gx = y * (gy - sum(gy * y)); log-softmax: gx = gy - exp(y) * sum(gy). tmp: inner
 * doubles when inner > 1. */
#define DEF_SOFTMAX_BWD(T, SFX)                                                                 \
  static void softmax_bwd_##SFX(const T *y, const T *gy, T *gx, int64_t outer, int64_t r,      \
                                int64_t inner, bool logsm, double *tmp) {                       \
    if (inner == 1) {                                                                           \
      for (int64_t o = 0; o < outer; o++) {                                                     \
        const T *yr = y + o * r, *gr = gy + o * r;                                              \
        T *xr = gx + o * r;                                                                     \
        double s = 0;                                                                           \
        if (logsm) {                                                                            \
          for (int64_t k = 0; k < r; k++) s += gr[k];                                           \
          for (int64_t k = 0; k < r; k++) xr[k] = (T)(gr[k] - exp((double)yr[k]) * s);          \
        } else {                                                                                \
          for (int64_t k = 0; k < r; k++) s += (double)gr[k] * yr[k];                           \
          for (int64_t k = 0; k < r; k++) xr[k] = (T)(yr[k] * (gr[k] - s));                     \
        }                                                                                       \
      }                                                                                         \
      return;                                                                                   \
    }                                                                                           \
    for (int64_t o = 0; o < outer; o++) {                                                       \
      const T *yb = y + o * r * inner, *gb = gy + o * r * inner;                                \
      T *xb = gx + o * r * inner;                                                               \
      for (int64_t i = 0; i < inner; i++) tmp[i] = 0;                                           \
      for (int64_t k = 0; k < r; k++) {                                                         \
        const T *yr = yb + k * inner, *gr = gb + k * inner;                                     \
        if (logsm)                                                                              \
          for (int64_t i = 0; i < inner; i++) tmp[i] += gr[i];                                  \
        else                                                                                    \
          for (int64_t i = 0; i < inner; i++) tmp[i] += (double)gr[i] * yr[i];                  \
      }                                                                                         \
      for (int64_t k = 0; k < r; k++) {                                                         \
        const T *yr = yb + k * inner, *gr = gb + k * inner;                                     \
        T *xr = xb + k * inner;                                                                 \
        if (logsm)                                                                              \
          for (int64_t i = 0; i < inner; i++) xr[i] = (T)(gr[i] - exp((double)yr[i]) * tmp[i]); \
        else                                                                                    \
          for (int64_t i = 0; i < inner; i++) xr[i] = (T)(yr[i] * (gr[i] - tmp[i]));           \
      }                                                                                         \
    }                                                                                           \
  }

DEF_SOFTMAX(float, f32)
DEF_SOFTMAX(double, f64)
DEF_SOFTMAX_BWD(float, f32)
DEF_SOFTMAX_BWD(double, f64)

td_status td__cpu_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                          bool logsm, td_tensor *y) {
  if (outer <= 0 || r <= 0 || inner <= 0) return TD_OK;
  double *tmp = NULL;
  if (inner > 1) {
    tmp = td__malloc(2 * (size_t)inner * sizeof(double));
    if (!tmp) return td_set_error(TD_ERR_NOMEM, "softmax: no memory for %lld temporaries",
                                  (long long)inner);
  }
  td_status st = TD_OK;
  switch (x->dtype) {
    case TD_DTYPE_F32:
      softmax_f32(td_tensor_data(x), td_tensor_data(y), outer, r, inner, logsm, tmp);
      break;
    case TD_DTYPE_F64:
      softmax_f64(td_tensor_data(x), td_tensor_data(y), outer, r, inner, logsm, tmp);
      break;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: st = td__half_softmax(x, outer, r, inner, logsm, y); break;
    default: st = UNSUPPORTED(logsm ? "log_softmax" : "softmax", x->dtype);
  }
  td__free(tmp);
  return st;
}

td_status td__cpu_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                   int64_t r, int64_t inner, bool logsm, td_tensor *gx) {
  if (outer <= 0 || r <= 0 || inner <= 0) return TD_OK;
  double *tmp = NULL;
  if (inner > 1) {
    tmp = td__malloc((size_t)inner * sizeof(double));
    if (!tmp) return td_set_error(TD_ERR_NOMEM, "softmax backward: no memory");
  }
  td_status st = TD_OK;
  switch (y->dtype) {
    case TD_DTYPE_F32:
      softmax_bwd_f32(td_tensor_data(y), td_tensor_data(gy), td_tensor_data(gx), outer, r, inner,
                      logsm, tmp);
      break;
    case TD_DTYPE_F64:
      softmax_bwd_f64(td_tensor_data(y), td_tensor_data(gy), td_tensor_data(gx), outer, r, inner,
                      logsm, tmp);
      break;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: st = td__half_softmax_backward(y, gy, outer, r, inner, logsm, gx); break;
    default: st = UNSUPPORTED("softmax backward", y->dtype);
  }
  td__free(tmp);
  return st;
}

/* ---- negative log-likelihood ---- */

#define DEF_NLL(T, SFX)                                                                         \
  static td_status nll_##SFX(const T *lp, const int64_t *tg, int64_t n, int64_t c,             \
                             int64_t ignore, T *loss, int64_t *count) {                         \
    int64_t cnt = 0;                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                           \
      int64_t t = tg[i];                                                                        \
      if (t == ignore) {                                                                        \
        loss[i] = 0;                                                                            \
        continue;                                                                               \
      }                                                                                         \
      if (t < 0 || t >= c)                                                                      \
        return td_set_error(TD_ERR_INVALID,                                                     \
                            "nll_loss: target %lld at position %lld is out of range [0, %lld)", \
                            (long long)t, (long long)i, (long long)c);                          \
      loss[i] = -lp[i * c + t];                                                                 \
      cnt++;                                                                                    \
    }                                                                                           \
    *count = cnt;                                                                               \
    return TD_OK;                                                                               \
  }

#define DEF_NLL_BWD(T, SFX)                                                                     \
  static td_status nll_bwd_##SFX(const int64_t *tg, const T *gl, int64_t n, int64_t c,         \
                                 int64_t ignore, T *gx) {                                       \
    for (int64_t i = 0; i < n; i++) {                                                           \
      T *row = gx + i * c;                                                                      \
      for (int64_t j = 0; j < c; j++) row[j] = 0;                                               \
      int64_t t = tg[i];                                                                        \
      if (t == ignore) continue;                                                                \
      if (t < 0 || t >= c)                                                                      \
        return td_set_error(TD_ERR_INVALID,                                                     \
                            "nll_loss backward: target %lld at position %lld is out of range "  \
                            "[0, %lld)",                                                        \
                            (long long)t, (long long)i, (long long)c);                          \
      row[t] = -gl[i];                                                                          \
    }                                                                                           \
    return TD_OK;                                                                               \
  }

DEF_NLL(float, f32)
DEF_NLL(double, f64)
DEF_NLL_BWD(float, f32)
DEF_NLL_BWD(double, f64)

td_status td__cpu_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                      td_tensor *losses, int64_t *count) {
  int64_t n = td_tensor_numel(target);
  int64_t c = n > 0 ? td_tensor_numel(logp) / n : 0;
  *count = 0;
  if (n == 0) return TD_OK;
  switch (logp->dtype) {
    case TD_DTYPE_F32:
      return nll_f32(td_tensor_data(logp), td_tensor_data(target), n, c, ignore_index,
                     td_tensor_data(losses), count);
    case TD_DTYPE_F64:
      return nll_f64(td_tensor_data(logp), td_tensor_data(target), n, c, ignore_index,
                     td_tensor_data(losses), count);
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_nll(logp, target, ignore_index, losses, count);
    default: return UNSUPPORTED("nll_loss", logp->dtype);
  }
}

td_status td__cpu_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                               td_tensor *gx) {
  int64_t n = td_tensor_numel(target);
  if (n == 0) return TD_OK;
  int64_t c = td_tensor_numel(gx) / n;
  switch (gx->dtype) {
    case TD_DTYPE_F32:
      return nll_bwd_f32(td_tensor_data(target), td_tensor_data(gl), n, c, ignore_index,
                         td_tensor_data(gx));
    case TD_DTYPE_F64:
      return nll_bwd_f64(td_tensor_data(target), td_tensor_data(gl), n, c, ignore_index,
                         td_tensor_data(gx));
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_nll_backward(target, gl, ignore_index, gx);
    default: return UNSUPPORTED("nll_loss backward", gx->dtype);
  }
}

/* ---- im2col / col2im ----
 *
 * col row (ci, ki, kj) holds, for every output position (oy, ox), the input pixel
 * x[ci, oy*sh - ph + ki, ox*sw - pw + kj] (0 outside the image). For one (ki, kj) the output
 * columns ox whose input column lies inside the image form one range [lo, hi], computed once per
 * row so the inner loop has no bounds tests. */

static void valid_range(int64_t w, int64_t ow, int kj, int sw, int pw, int64_t *lo, int64_t *hi) {
  int64_t a = (int64_t)pw - kj; /* ox*sw >= a */
  int64_t b = w - 1 + pw - kj;  /* ox*sw <= b */
  *lo = a <= 0 ? 0 : (a + sw - 1) / sw;
  *hi = b < 0 ? -1 : b / sw;
  if (*hi > ow - 1) *hi = ow - 1;
}

#define DEF_IM2COL(T, SFX)                                                                      \
  static void im2col_##SFX(const T *x, int64_t c, int64_t h, int64_t w, int kh, int kw, int sh, \
                           int sw, int ph, int pw, T *col) {                                    \
    int64_t oh = (h + 2 * ph - kh) / sh + 1, ow = (w + 2 * pw - kw) / sw + 1;                   \
    for (int64_t ci = 0; ci < c; ci++) {                                                        \
      for (int ki = 0; ki < kh; ki++) {                                                         \
        for (int kj = 0; kj < kw; kj++) {                                                       \
          T *dst = col + ((ci * kh + ki) * kw + kj) * oh * ow;                                  \
          int64_t lo, hi;                                                                       \
          valid_range(w, ow, kj, sw, pw, &lo, &hi);                                             \
          int64_t zlo = lo < ow ? lo : ow, zhi = lo > hi + 1 ? lo : hi + 1;                     \
          for (int64_t oy = 0; oy < oh; oy++) {                                                 \
            T *d = dst + oy * ow;                                                               \
            int64_t iy = oy * sh - ph + ki;                                                     \
            if (iy < 0 || iy >= h) {                                                            \
              memset(d, 0, (size_t)ow * sizeof(T));                                             \
              continue;                                                                         \
            }                                                                                   \
            int64_t sb = (ci * h + iy) * w - pw + kj; /* x index of ox = 0 (may be < row) */   \
            for (int64_t ox = 0; ox < zlo; ox++) d[ox] = 0;                                     \
            if (sw == 1) {                                                                      \
              if (hi >= lo) memcpy(d + lo, x + sb + lo, (size_t)(hi - lo + 1) * sizeof(T));     \
            } else {                                                                            \
              for (int64_t ox = lo; ox <= hi; ox++) d[ox] = x[sb + ox * sw];                    \
            }                                                                                   \
            for (int64_t ox = zhi; ox < ow; ox++) d[ox] = 0;                                    \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

#define DEF_COL2IM(T, SFX)                                                                      \
  static void col2im_##SFX(const T *col, int64_t c, int64_t h, int64_t w, int kh, int kw,      \
                           int sh, int sw, int ph, int pw, T *gx) {                             \
    int64_t oh = (h + 2 * ph - kh) / sh + 1, ow = (w + 2 * pw - kw) / sw + 1;                   \
    for (int64_t ci = 0; ci < c; ci++) {                                                        \
      for (int ki = 0; ki < kh; ki++) {                                                         \
        for (int kj = 0; kj < kw; kj++) {                                                       \
          const T *srcrow = col + ((ci * kh + ki) * kw + kj) * oh * ow;                         \
          int64_t lo, hi;                                                                       \
          valid_range(w, ow, kj, sw, pw, &lo, &hi);                                             \
          for (int64_t oy = 0; oy < oh; oy++) {                                                 \
            int64_t iy = oy * sh - ph + ki;                                                     \
            if (iy < 0 || iy >= h) continue;                                                    \
            const T *s = srcrow + oy * ow;                                                      \
            int64_t db = (ci * h + iy) * w - pw + kj;                                           \
            if (sw == 1) {                                                                      \
              for (int64_t ox = lo; ox <= hi; ox++) gx[db + ox] += s[ox];                       \
            } else {                                                                            \
              for (int64_t ox = lo; ox <= hi; ox++) gx[db + ox * sw] += s[ox];                  \
            }                                                                                   \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

DEF_IM2COL(float, f32)
DEF_IM2COL(double, f64)
DEF_COL2IM(float, f32)
DEF_COL2IM(double, f64)

td_status td__cpu_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                         int kw, int sh, int sw, int ph, int pw, void *col) {
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0 || h + 2 * ph < kh ||
      w + 2 * pw < kw)
    return td_set_error(TD_ERR_INVALID, "im2col: bad geometry");
  switch (dt) {
    case TD_DTYPE_F32: im2col_f32(x, c, h, w, kh, kw, sh, sw, ph, pw, col); return TD_OK;
    case TD_DTYPE_F64: im2col_f64(x, c, h, w, kh, kw, sh, sw, ph, pw, col); return TD_OK;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_im2col(dt, x, c, h, w, kh, kw, sh, sw, ph, pw, col);
    default: return UNSUPPORTED("im2col", dt);
  }
}

td_status td__cpu_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                         int kw, int sh, int sw, int ph, int pw, void *gx) {
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0 || h + 2 * ph < kh ||
      w + 2 * pw < kw)
    return td_set_error(TD_ERR_INVALID, "col2im: bad geometry");
  switch (dt) {
    case TD_DTYPE_F32: col2im_f32(col, c, h, w, kh, kw, sh, sw, ph, pw, gx); return TD_OK;
    case TD_DTYPE_F64: col2im_f64(col, c, h, w, kh, kw, sh, sw, ph, pw, gx); return TD_OK;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_col2im(dt, col, c, h, w, kh, kw, sh, sw, ph, pw, gx);
    default: return UNSUPPORTED("col2im", dt);
  }
}

/* ---- max pooling ----
 *
 * Same rule as PyTorch: the window's first element wins ties, and a NaN wins over numbers (so
 * NaN propagates). idx holds the flat position iy * W + ix inside the (n, c) plane. */

#define DEF_MAXPOOL(T, UT, SFX)                                                                 \
  static void maxpool_##SFX(const T *x, int64_t planes, int64_t h, int64_t w, int kh, int kw,   \
                            int sh, int sw, int64_t oh, int64_t ow, T *y, int64_t *idx) {       \
    for (int64_t p = 0; p < planes; p++) {                                                      \
      const T *xp = x + p * h * w;                                                              \
      T *yp = y + p * oh * ow;                                                                  \
      int64_t *ip = idx ? idx + p * oh * ow : NULL;                                             \
      for (int64_t oy = 0; oy < oh; oy++) {                                                     \
        int64_t y0 = oy * sh;                                                                   \
        for (int64_t ox = 0; ox < ow; ox++) {                                                   \
          int64_t x0 = ox * sw;                                                                 \
          T best = -INFINITY;                                                                   \
          int64_t bi = y0 * w + x0;                                                             \
          for (int i = 0; i < kh; i++) {                                                        \
            int64_t base = (y0 + i) * w + x0;                                                   \
            const T *row = xp + base;                                                           \
            for (int j = 0; j < kw; j++) {                                                      \
              /* Branch-free select through the bit patterns: comparisons on data mispredict   \
               * about half the time, which costs more than the arithmetic. */                  \
              T v = row[j];                                                                     \
              int64_t m = -(int64_t)((v > best) | (v != v));                                    \
              UT vb, bb;                                                                        \
              memcpy(&vb, &v, sizeof v);                                                        \
              memcpy(&bb, &best, sizeof best);                                                  \
              bb = (bb & ~(UT)m) | (vb & (UT)m);                                                \
              memcpy(&best, &bb, sizeof best);                                                  \
              bi = (bi & ~m) | ((base + j) & m);                                                \
            }                                                                                   \
          }                                                                                     \
          yp[oy * ow + ox] = best;                                                              \
          if (ip) ip[oy * ow + ox] = bi;                                                        \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

#define DEF_MAXPOOL_BWD(T, SFX)                                                                 \
  static td_status maxpool_bwd_##SFX(const T *gy, const int64_t *idx, int64_t planes,          \
                                     int64_t hw, int64_t ohw, T *gx) {                          \
    for (int64_t p = 0; p < planes; p++) {                                                      \
      const T *g = gy + p * ohw;                                                                \
      const int64_t *ip = idx + p * ohw;                                                        \
      T *d = gx + p * hw;                                                                       \
      for (int64_t k = 0; k < ohw; k++) {                                                       \
        int64_t i = ip[k];                                                                      \
        if (i < 0 || i >= hw)                                                                   \
          return td_set_error(TD_ERR_INTERNAL, "max_pool2d backward: index %lld outside plane " \
                              "of %lld elements", (long long)i, (long long)hw);                 \
        d[i] += g[k];                                                                           \
      }                                                                                         \
    }                                                                                           \
    return TD_OK;                                                                               \
  }

DEF_MAXPOOL(float, uint32_t, f32)
DEF_MAXPOOL(double, uint64_t, f64)

#if defined(__SSE2__)
#include <emmintrin.h>
/* The common 2x2 window with stride 2 on float32, four outputs at a time (SSE2; CNN training spent
 * about 20% of its time in the scalar kernel). Same rule as maxpool_f32, element by element in the
 * window's order: take v when v > best or v is NaN. Indices are computed in 32-bit lanes (a plane
 * holds far fewer than 2^31 elements here) and widened when stored. */
static void maxpool2x2_f32(const float *x, int64_t planes, int64_t h, int64_t w, int64_t oh,
                           int64_t ow, float *y, int64_t *idx) {
  int64_t ow4 = ow & ~(int64_t)3;
  for (int64_t p = 0; p < planes; p++) {
    const float *xp = x + p * h * w;
    float *yp = y + p * oh * ow;
    int64_t *ip = idx ? idx + p * oh * ow : NULL;
    for (int64_t oy = 0; oy < oh; oy++) {
      const float *r0 = xp + 2 * oy * w, *r1 = r0 + w;
      int32_t b0 = (int32_t)(2 * oy * w), b1 = (int32_t)(b0 + w);
      for (int64_t ox = 0; ox < ow4; ox += 4) {
        /* 8 consecutive inputs per row cover 4 windows: even lanes are j = 0, odd are j = 1 */
        __m128 a0 = _mm_loadu_ps(r0 + 2 * ox), a1 = _mm_loadu_ps(r0 + 2 * ox + 4);
        __m128 c0 = _mm_loadu_ps(r1 + 2 * ox), c1 = _mm_loadu_ps(r1 + 2 * ox + 4);
        __m128 v[4] = {_mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)),
                       _mm_shuffle_ps(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm_shuffle_ps(c0, c1, _MM_SHUFFLE(3, 1, 3, 1))};
        __m128i col = _mm_add_epi32(_mm_set1_epi32((int32_t)(2 * ox)), _mm_setr_epi32(0, 2, 4, 6));
        __m128i pos[4] = {_mm_add_epi32(col, _mm_set1_epi32(b0)),
                          _mm_add_epi32(col, _mm_set1_epi32(b0 + 1)),
                          _mm_add_epi32(col, _mm_set1_epi32(b1)),
                          _mm_add_epi32(col, _mm_set1_epi32(b1 + 1))};
        __m128 best = v[0];
        __m128i bi = pos[0];
        for (int k = 1; k < 4; k++) {
          __m128 take = _mm_or_ps(_mm_cmpgt_ps(v[k], best), _mm_cmpunord_ps(v[k], v[k]));
          best = _mm_or_ps(_mm_and_ps(take, v[k]), _mm_andnot_ps(take, best));
          __m128i ti = _mm_castps_si128(take);
          bi = _mm_or_si128(_mm_and_si128(ti, pos[k]), _mm_andnot_si128(ti, bi));
        }
        _mm_storeu_ps(yp + oy * ow + ox, best);
        if (ip) {
          __m128i zero = _mm_setzero_si128();
          _mm_storeu_si128((__m128i *)(ip + oy * ow + ox), _mm_unpacklo_epi32(bi, zero));
          _mm_storeu_si128((__m128i *)(ip + oy * ow + ox + 2), _mm_unpackhi_epi32(bi, zero));
        }
      }
      for (int64_t ox = ow4; ox < ow; ox++) {
        const float *win[4] = {r0 + 2 * ox, r0 + 2 * ox + 1, r1 + 2 * ox, r1 + 2 * ox + 1};
        int64_t wpos[4] = {b0 + 2 * ox, b0 + 2 * ox + 1, b1 + 2 * ox, b1 + 2 * ox + 1};
        float best = *win[0];
        int64_t bi = wpos[0];
        for (int k = 1; k < 4; k++) {
          float v = *win[k];
          if (v > best || v != v) {
            best = v;
            bi = wpos[k];
          }
        }
        yp[oy * ow + ox] = best;
        if (ip) ip[oy * ow + ox] = bi;
      }
    }
  }
}
#endif
DEF_MAXPOOL_BWD(float, f32)
DEF_MAXPOOL_BWD(double, f64)

td_status td__cpu_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                             td_tensor *idx) {
  if (x->ndim != 4 || y->ndim != 4)
    return td_set_error(TD_ERR_INTERNAL, "max_pool2d: CPU kernel expects 4-d tensors");
  int64_t planes = x->shape[0] * x->shape[1], h = x->shape[2], w = x->shape[3];
  int64_t oh = y->shape[2], ow = y->shape[3];
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || (oh > 0 && (oh - 1) * sh + kh > h) ||
      (ow > 0 && (ow - 1) * sw + kw > w))
    return td_set_error(TD_ERR_INVALID, "max_pool2d: bad geometry");
  int64_t *ip = idx ? td_tensor_data(idx) : NULL;
  switch (x->dtype) {
    case TD_DTYPE_F32:
#if defined(__SSE2__)
      if (kh == 2 && kw == 2 && sh == 2 && sw == 2 && h * w < ((int64_t)1 << 31)) {
        maxpool2x2_f32(td_tensor_data(x), planes, h, w, oh, ow, td_tensor_data(y), ip);
        return TD_OK;
      }
#endif
      maxpool_f32(td_tensor_data(x), planes, h, w, kh, kw, sh, sw, oh, ow, td_tensor_data(y), ip);
      return TD_OK;
    case TD_DTYPE_F64:
      maxpool_f64(td_tensor_data(x), planes, h, w, kh, kw, sh, sw, oh, ow, td_tensor_data(y), ip);
      return TD_OK;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_max_pool2d(x, kh, kw, sh, sw, y, idx);
    default: return UNSUPPORTED("max_pool2d", x->dtype);
  }
}

td_status td__cpu_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx) {
  if (gx->ndim != 4 || gy->ndim != 4)
    return td_set_error(TD_ERR_INTERNAL, "max_pool2d backward: CPU kernel expects 4-d tensors");
  int64_t planes = gx->shape[0] * gx->shape[1];
  int64_t hw = gx->shape[2] * gx->shape[3], ohw = gy->shape[2] * gy->shape[3];
  switch (gx->dtype) {
    case TD_DTYPE_F32:
      return maxpool_bwd_f32(td_tensor_data(gy), td_tensor_data(idx), planes, hw, ohw,
                             td_tensor_data(gx));
    case TD_DTYPE_F64:
      return maxpool_bwd_f64(td_tensor_data(gy), td_tensor_data(idx), planes, hw, ohw,
                             td_tensor_data(gx));
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_max_pool2d_backward(gy, idx, gx);
    default: return UNSUPPORTED("max_pool2d backward", gx->dtype);
  }
}

/* ---- index_select / index_add ---- */

static td_status check_indices(const char *op, const int64_t *ix, int64_t m, int64_t r) {
  for (int64_t j = 0; j < m; j++)
    if (ix[j] < 0 || ix[j] >= r)
      return td_set_error(TD_ERR_INVALID, "%s: index %lld at position %lld is out of range "
                          "[0, %lld)", op, (long long)ix[j], (long long)j, (long long)r);
  return TD_OK;
}

td_status td__cpu_index_select(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                               const td_tensor *index, td_tensor *out) {
  int64_t m = td_tensor_numel(index);
  const int64_t *ix = td_tensor_data(index);
  TD_TRY(check_indices("index_select", ix, m, r));
  size_t es = td_dtype_size(x->dtype), row = (size_t)inner * es;
  const char *src = td_tensor_data(x);
  char *dst = td_tensor_data(out);
  if (inner == 1) {
    /* Element gathers: fixed-size copies compile to plain loads and stores. */
    for (int64_t o = 0; o < outer; o++) {
      const char *s = src + (size_t)(o * r) * es;
      char *d = dst + (size_t)(o * m) * es;
      if (es == 8)
        for (int64_t j = 0; j < m; j++) memcpy(d + (size_t)j * 8, s + (size_t)ix[j] * 8, 8);
      else if (es == 4)
        for (int64_t j = 0; j < m; j++) memcpy(d + (size_t)j * 4, s + (size_t)ix[j] * 4, 4);
      else
        for (int64_t j = 0; j < m; j++) memcpy(d + (size_t)j * es, s + (size_t)ix[j] * es, es);
    }
    return TD_OK;
  }
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < m; j++)
      memcpy(dst + (size_t)(o * m + j) * row, src + (size_t)(o * r + ix[j]) * row, row);
  return TD_OK;
}

#define DEF_INDEX_ADD(T, SFX)                                                                   \
  static void index_add_##SFX(T *gx, int64_t outer, int64_t r, int64_t inner,                  \
                              const int64_t *ix, int64_t m, const T *g) {                       \
    for (int64_t o = 0; o < outer; o++)                                                         \
      for (int64_t j = 0; j < m; j++) {                                                         \
        T *d = gx + (o * r + ix[j]) * inner;                                                    \
        const T *s = g + (o * m + j) * inner;                                                   \
        for (int64_t i = 0; i < inner; i++) d[i] += s[i];                                       \
      }                                                                                         \
  }

DEF_INDEX_ADD(float, f32)
DEF_INDEX_ADD(double, f64)

td_status td__cpu_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                            const td_tensor *index, const td_tensor *g) {
  int64_t m = td_tensor_numel(index);
  const int64_t *ix = td_tensor_data(index);
  TD_TRY(check_indices("index_add", ix, m, r));
  switch (gx->dtype) {
    case TD_DTYPE_F32:
      index_add_f32(td_tensor_data(gx), outer, r, inner, ix, m, td_tensor_data(g));
      return TD_OK;
    case TD_DTYPE_F64:
      index_add_f64(td_tensor_data(gx), outer, r, inner, ix, m, td_tensor_data(g));
      return TD_OK;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_index_add(gx, outer, r, inner, index, g);
    default: return UNSUPPORTED("index_add", gx->dtype);
  }
}

/* ---- layer norm ----
 *
 * Rows of N elements: mean and biased variance in double (two passes), rstd = 1/sqrt(var + eps),
 * y = (x - mean) * rstd * w + b. Backward with xhat = (x - mean) * rstd and g = gy * w:
 * gx = rstd * (g - mean(g) - xhat * mean(g * xhat)), gw = sum_rows gy * xhat, gb = sum_rows gy.
 * Both element types run through vectors of 8 doubles (float32 converted on load), so the sums
 * vectorise and still accumulate in double; a row's last N % 8 elements go one by one. */

#define LN_V 8

#define DEF_LAYER_NORM(T, SFX)                                                                  \
  TD__CPU_CLONES static void layer_norm_##SFX(const T *x, const T *w, const T *b, double eps,  \
                                              int64_t m, int64_t n, T *y, T *mean, T *rstd) {  \
    const int64_t nv = n - n % LN_V;                                                            \
    for (int64_t r = 0; r < m; r++) {                                                           \
      const T *xr = x + r * n;                                                                  \
      T *yr = y + r * n;                                                                        \
      td__vd8 acc = {0};                                                                        \
      for (int64_t j = 0; j < nv; j += LN_V) acc += td__vd8_load_##SFX(xr + j);                \
      double s = td__vd8_sum(acc);                                                              \
      for (int64_t j = nv; j < n; j++) s += xr[j];                                              \
      const double mu = s / (double)n;                                                          \
      td__vd8 vacc = {0};                                                                       \
      for (int64_t j = 0; j < nv; j += LN_V) {                                                  \
        td__vd8 d = td__vd8_load_##SFX(xr + j) - mu;                                            \
        vacc += d * d;                                                                          \
      }                                                                                         \
      double v = td__vd8_sum(vacc);                                                             \
      for (int64_t j = nv; j < n; j++) v += (xr[j] - mu) * (xr[j] - mu);                        \
      const double rs = 1.0 / sqrt(v / (double)n + eps);                                        \
      mean[r] = (T)mu;                                                                          \
      rstd[r] = (T)rs;                                                                          \
      for (int64_t j = 0; j < nv; j += LN_V) {                                                  \
        td__vd8 o = (td__vd8_load_##SFX(xr + j) - mu) * rs;                                     \
        if (w) o *= td__vd8_load_##SFX(w + j);                                                  \
        if (b) o += td__vd8_load_##SFX(b + j);                                                  \
        td__vd8_store_##SFX(yr + j, o);                                                         \
      }                                                                                         \
      for (int64_t j = nv; j < n; j++) {                                                        \
        double o = (xr[j] - mu) * rs;                                                           \
        if (w) o *= w[j];                                                                       \
        if (b) o += b[j];                                                                       \
        yr[j] = (T)o;                                                                           \
      }                                                                                         \
    }                                                                                           \
  }

/* gwa, gba: n doubles (or NULL) accumulating the parameter gradients. */
#define DEF_LAYER_NORM_BWD(T, SFX)                                                              \
  TD__CPU_CLONES static void layer_norm_bwd_##SFX(const T *gy, const T *x, const T *w,         \
                                                  const T *mean, const T *rstd, int64_t m,     \
                                                  int64_t n, T *gx, double *gwa,               \
                                                  double *gba) {                               \
    const int64_t nv = n - n % LN_V;                                                            \
    for (int64_t r = 0; r < m; r++) {                                                           \
      const T *xr = x + r * n, *gr = gy + r * n;                                                \
      const double mu = mean[r], rs = rstd[r];                                                  \
      td__vd8 vsg = {0}, vsgx = {0};                                                            \
      for (int64_t j = 0; j < nv; j += LN_V) {                                                  \
        td__vd8 xh = (td__vd8_load_##SFX(xr + j) - mu) * rs, gj = td__vd8_load_##SFX(gr + j);  \
        if (gwa) td__vd8_store_f64(gwa + j, td__vd8_load_f64(gwa + j) + gj * xh);              \
        if (gba) td__vd8_store_f64(gba + j, td__vd8_load_f64(gba + j) + gj);                   \
        if (w) gj *= td__vd8_load_##SFX(w + j);                                                 \
        vsg += gj;                                                                              \
        vsgx += gj * xh;                                                                        \
      }                                                                                         \
      double sg = td__vd8_sum(vsg), sgx = td__vd8_sum(vsgx);                                    \
      for (int64_t j = nv; j < n; j++) {                                                        \
        double xh = (xr[j] - mu) * rs;                                                          \
        double g = w ? (double)gr[j] * w[j] : (double)gr[j];                                    \
        sg += g;                                                                                \
        sgx += g * xh;                                                                          \
        if (gwa) gwa[j] += (double)gr[j] * xh;                                                  \
        if (gba) gba[j] += gr[j];                                                               \
      }                                                                                         \
      if (!gx) continue;                                                                        \
      sg /= (double)n;                                                                          \
      sgx /= (double)n;                                                                         \
      T *xo = gx + r * n;                                                                       \
      for (int64_t j = 0; j < nv; j += LN_V) {                                                  \
        td__vd8 xh = (td__vd8_load_##SFX(xr + j) - mu) * rs, gj = td__vd8_load_##SFX(gr + j);  \
        if (w) gj *= td__vd8_load_##SFX(w + j);                                                 \
        td__vd8_store_##SFX(xo + j, rs * (gj - sg - xh * sgx));                                 \
      }                                                                                         \
      for (int64_t j = nv; j < n; j++) {                                                        \
        double xh = (xr[j] - mu) * rs;                                                          \
        double g = w ? (double)gr[j] * w[j] : (double)gr[j];                                    \
        xo[j] = (T)(rs * (g - sg - xh * sgx));                                                  \
      }                                                                                         \
    }                                                                                           \
  }

DEF_LAYER_NORM(float, f32)
DEF_LAYER_NORM(double, f64)
DEF_LAYER_NORM_BWD(float, f32)
DEF_LAYER_NORM_BWD(double, f64)

static const void *opt_data(const td_tensor *t) { return t ? td_tensor_data(t) : NULL; }

td_status td__cpu_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                             double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd) {
  int64_t m = td_tensor_numel(mean);
  if (m == 0) return TD_OK;
  int64_t n = td_tensor_numel(x) / m;
  switch (x->dtype) {
    case TD_DTYPE_F32:
      layer_norm_f32(td_tensor_data(x), opt_data(w), opt_data(b), eps, m, n, td_tensor_data(y),
                     td_tensor_data(mean), td_tensor_data(rstd));
      return TD_OK;
    case TD_DTYPE_F64:
      layer_norm_f64(td_tensor_data(x), opt_data(w), opt_data(b), eps, m, n, td_tensor_data(y),
                     td_tensor_data(mean), td_tensor_data(rstd));
      return TD_OK;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: return td__half_layer_norm(x, w, b, eps, y, mean, rstd);
    default: return UNSUPPORTED("layer_norm", x->dtype);
  }
}

td_status td__cpu_layer_norm_backward(const td_tensor *gy, const td_tensor *x, const td_tensor *w,
                                      const td_tensor *mean, const td_tensor *rstd, td_tensor *gx,
                                      td_tensor *gw, td_tensor *gb) {
  int64_t m = td_tensor_numel(mean);
  int64_t n = m > 0 ? td_tensor_numel(x) / m : (gw ? td_tensor_numel(gw)
                                                   : gb ? td_tensor_numel(gb) : 0);
  if (x->dtype == TD_DTYPE_BF16 || x->dtype == TD_DTYPE_F16)
    return td__half_layer_norm_backward(gy, x, w, mean, rstd, gx, gw, gb);
  if (x->dtype != TD_DTYPE_F32 && x->dtype != TD_DTYPE_F64)
    return UNSUPPORTED("layer_norm backward", x->dtype);
  double *acc = NULL;
  if (gw || gb) {
    acc = td__calloc(2 * (size_t)n, sizeof(double));
    if (!acc) return td_set_error(TD_ERR_NOMEM, "layer_norm backward: no memory");
  }
  double *gwa = gw ? acc : NULL, *gba = gb ? acc + n : NULL;
  if (x->dtype == TD_DTYPE_F32) {
    if (m > 0)
      layer_norm_bwd_f32(td_tensor_data(gy), td_tensor_data(x), opt_data(w), td_tensor_data(mean),
                         td_tensor_data(rstd), m, n, gx ? td_tensor_data(gx) : NULL, gwa, gba);
    for (int64_t j = 0; j < n; j++) {
      if (gw) ((float *)td_tensor_data(gw))[j] = (float)gwa[j];
      if (gb) ((float *)td_tensor_data(gb))[j] = (float)gba[j];
    }
  } else {
    if (m > 0)
      layer_norm_bwd_f64(td_tensor_data(gy), td_tensor_data(x), opt_data(w), td_tensor_data(mean),
                         td_tensor_data(rstd), m, n, gx ? td_tensor_data(gx) : NULL, gwa, gba);
    for (int64_t j = 0; j < n; j++) {
      if (gw) ((double *)td_tensor_data(gw))[j] = gwa[j];
      if (gb) ((double *)td_tensor_data(gb))[j] = gba[j];
    }
  }
  td__free(acc);
  return TD_OK;
}
