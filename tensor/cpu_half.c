/* cpu_half.c - bfloat16 and float16 on the CPU: row conversions to and from float32, and the
 * float32 round trip that lets the float32 kernels serve the 16-bit dtypes.
 *
 * A 16-bit float is a storage format here, never an arithmetic one: kernels load elements into
 * float32, compute in float32 (or double where the float32 kernels accumulate in double), and
 * round each result once to the output's dtype, to nearest even. So a bfloat16 op gives exactly
 * the float32 op's result rounded to bfloat16, the rule PyTorch's CPU kernels follow.
 *
 * Two ways in:
 *   - hot elementwise kernels (cpu_backend.c: binary, unary, their backward, axpy, sums) convert
 *     a chunk of a row into a float32 buffer on the stack, run the float32 row function and
 *     convert back: no allocation, every buffer in L1;
 *   - the other kernels (softmax, layer norm, losses, pooling, index_add, im2col) get float32
 *     copies of their 16-bit tensors (td__cpu_up), run the float32 kernel and convert the
 *     outputs back (td__cpu_down). They run under autocast on float32 data anyway (tensor.h), so
 *     this path only serves programs that hold 16-bit tensors themselves.
 *
 * Conversions: bfloat16 -> float32 is a shift; float32 -> bfloat16 rounds to nearest even with
 * integer arithmetic (NaN stays a quiet NaN); float16 uses the compiler's _Float16 conversions
 * (F16C instructions in the x86-64-v3/v4 clones, libgcc's otherwise), which round to nearest
 * even and keep NaN and infinity. All rows vectorise (TD__CPU_CLONES).
 *
 * THREAD SAFETY: pure functions of their arguments.
 */
#include "cpu_half.h"

#include "cpu_math.h"

typedef uint32_t u32a __attribute__((may_alias));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define TD_HAVE_FLOAT16 1
#endif

TD__CPU_CLONES void td__cvt_bf16_to_f32(float *restrict d, const uint16_t *restrict s,
                                        int64_t n) {
  u32a *o = (u32a *)d;
  for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)s[i] << 16;
}

TD__CPU_CLONES void td__cvt_f32_to_bf16(uint16_t *restrict d, const float *restrict s,
                                        int64_t n) {
  const u32a *in = (const u32a *)s;
  for (int64_t i = 0; i < n; i++) {
    uint32_t b = in[i];
    uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    uint32_t q = (b >> 16) | 0x40u; /* NaN: keep sign and payload's top bits, quiet */
    d[i] = (uint16_t)((b & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
}

#ifdef TD_HAVE_FLOAT16
TD__CPU_CLONES void td__cvt_f16_to_f32(float *restrict d, const uint16_t *restrict s, int64_t n) {
  const _Float16 *h = (const _Float16 *)(const void *)s;
  for (int64_t i = 0; i < n; i++) d[i] = (float)h[i];
}
TD__CPU_CLONES void td__cvt_f32_to_f16(uint16_t *restrict d, const float *restrict s, int64_t n) {
  _Float16 *h = (_Float16 *)(void *)d;
  for (int64_t i = 0; i < n; i++) h[i] = (_Float16)s[i];
}
#else
void td__cvt_f16_to_f32(float *restrict d, const uint16_t *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = td__f16_to_f32(s[i]);
}
void td__cvt_f32_to_f16(uint16_t *restrict d, const float *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = td__f32_to_f16(s[i]);
}
#endif

void td__half_load(td_dtype dt, float *d, const void *s, int64_t ss, int64_t n) {
  const uint16_t *h = s;
  if (ss == 1) {
    if (dt == TD_DTYPE_BF16) td__cvt_bf16_to_f32(d, h, n);
    else td__cvt_f16_to_f32(d, h, n);
    return;
  }
  if (dt == TD_DTYPE_BF16)
    for (int64_t i = 0; i < n; i++) d[i] = td__bf16_to_f32(h[i * ss]);
  else
    for (int64_t i = 0; i < n; i++) d[i] = td__f16_to_f32(h[i * ss]);
}

void td__half_store(td_dtype dt, void *d, int64_t sd, const float *s, int64_t n) {
  uint16_t *h = d;
  if (sd == 1) {
    if (dt == TD_DTYPE_BF16) td__cvt_f32_to_bf16(h, s, n);
    else td__cvt_f32_to_f16(h, s, n);
    return;
  }
  if (dt == TD_DTYPE_BF16)
    for (int64_t i = 0; i < n; i++) h[i * sd] = td__f32_to_bf16(s[i]);
  else
    for (int64_t i = 0; i < n; i++) h[i * sd] = td__f32_to_f16(s[i]);
}

/* Copies between float32 (or float64) and a 16-bit dtype for one strided row; f64 goes through
 * float32 in chunks (the rounding to 16 bits from the float32 value is the same as from the
 * double for every double that float32 represents; others round twice, as PyTorch's CPU
 * conversion does). Returns false when the pair is not one of these. */
bool td__half_copy_row(td_dtype dd, void *d, int64_t sd, td_dtype sdt, const void *s, int64_t ss,
                       int64_t n) {
  float buf[TD__HALF_CHUNK];
  if (td__dtype_is_half(dd) && sdt == TD_DTYPE_F32) {
    if (ss == 1) {
      td__half_store(dd, d, sd, s, n);
      return true;
    }
    for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
      int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
      const float *sp = (const float *)s + i0 * ss;
      for (int64_t i = 0; i < m; i++) buf[i] = sp[i * ss];
      td__half_store(dd, (uint16_t *)d + i0 * sd, sd, buf, m);
    }
    return true;
  }
  if (dd == TD_DTYPE_F32 && td__dtype_is_half(sdt)) {
    if (sd == 1) {
      td__half_load(sdt, d, s, ss, n);
      return true;
    }
    for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
      int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
      td__half_load(sdt, buf, (const uint16_t *)s + i0 * ss, ss, m);
      float *dp = (float *)d + i0 * sd;
      for (int64_t i = 0; i < m; i++) dp[i * sd] = buf[i];
    }
    return true;
  }
  if (td__dtype_is_half(dd) && sdt == TD_DTYPE_F64) {
    for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
      int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
      const double *sp = (const double *)s + i0 * ss;
      for (int64_t i = 0; i < m; i++) buf[i] = (float)sp[i * ss];
      td__half_store(dd, (uint16_t *)d + i0 * sd, sd, buf, m);
    }
    return true;
  }
  if (dd == TD_DTYPE_F64 && td__dtype_is_half(sdt)) {
    for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
      int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
      td__half_load(sdt, buf, (const uint16_t *)s + i0 * ss, ss, m);
      double *dp = (double *)d + i0 * sd;
      for (int64_t i = 0; i < m; i++) dp[i * sd] = buf[i];
    }
    return true;
  }
  return false;
}

/* ---- the float32 round trip of whole tensors ---- */

td_status td__cpu_up_empty(const td_tensor *t, td_tensor **out) {
  *out = NULL;
  if (!t) return TD_OK;
  if (!td__dtype_is_half(t->dtype)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return td__tensor_new(t->shape, t->ndim, TD_DTYPE_F32, t->storage->device, out);
}

td_status td__cpu_up(const td_tensor *t, td_tensor **out) {
  TD_TRY(td__cpu_up_empty(t, out));
  if (*out && *out != t) {
    td_status st = td__cpu_backend.copy(*out, t);
    if (st != TD_OK) {
      td_tensor_unref(*out);
      *out = NULL;
      return st;
    }
  }
  return TD_OK;
}

td_status td__cpu_down(td_tensor *t, const td_tensor *f) {
  if (!t || !f || t == f) return TD_OK;
  return td__cpu_backend.copy(t, f);
}

td_status td__cpu_half_buffer(td_dtype dt, const void *src, int64_t n, float **out) {
  float *b = td__malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  if (!b) return td_set_error(TD_ERR_NOMEM, "%s kernel: out of memory (%lld elements)",
                              td_dtype_name(dt), (long long)n);
  if (src) td__half_load(dt, b, src, 1, n);
  *out = b;
  return TD_OK;
}

/* ---- kernels through float32 copies (cpu_nn.c's entries call these for 16-bit tensors) ----
 * Each converts its 16-bit tensors with td__cpu_up, runs the float32 kernel and rounds the
 * outputs back. NULL tensor arguments stay NULL. */

#define UP(t, f) (st == TD_OK ? (st = td__cpu_up((t), &(f))) : st)
#define UP_EMPTY(t, f) (st == TD_OK ? (st = td__cpu_up_empty((t), &(f))) : st)
#define DOWN(t, f) (st == TD_OK ? (st = td__cpu_down((t), (f))) : st)

td_status td__half_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner, bool log,
                           td_tensor *y) {
  td_tensor *xf = NULL, *yf = NULL;
  td_status st = TD_OK;
  UP(x, xf);
  UP_EMPTY(y, yf);
  if (st == TD_OK) st = td__cpu_softmax(xf, outer, r, inner, log, yf);
  DOWN(y, yf);
  td_tensor_unref(xf);
  td_tensor_unref(yf);
  return st;
}

td_status td__half_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                    int64_t r, int64_t inner, bool log, td_tensor *gx) {
  td_tensor *yf = NULL, *gyf = NULL, *gxf = NULL;
  td_status st = TD_OK;
  UP(y, yf);
  UP(gy, gyf);
  UP_EMPTY(gx, gxf);
  if (st == TD_OK) st = td__cpu_softmax_backward(yf, gyf, outer, r, inner, log, gxf);
  DOWN(gx, gxf);
  td_tensor_unref(yf);
  td_tensor_unref(gyf);
  td_tensor_unref(gxf);
  return st;
}

td_status td__half_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                       td_tensor *losses, int64_t *count) {
  td_tensor *lf = NULL, *of = NULL;
  td_status st = TD_OK;
  UP(logp, lf);
  UP_EMPTY(losses, of);
  if (st == TD_OK) st = td__cpu_nll(lf, target, ignore_index, of, count);
  DOWN(losses, of);
  td_tensor_unref(lf);
  td_tensor_unref(of);
  return st;
}

td_status td__half_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                                td_tensor *gx) {
  td_tensor *gf = NULL, *xf = NULL;
  td_status st = TD_OK;
  UP(gl, gf);
  UP_EMPTY(gx, xf);
  if (st == TD_OK) st = td__cpu_nll_backward(target, gf, ignore_index, xf);
  DOWN(gx, xf);
  td_tensor_unref(gf);
  td_tensor_unref(xf);
  return st;
}

td_status td__half_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                              td_tensor *idx) {
  td_tensor *xf = NULL, *yf = NULL;
  td_status st = TD_OK;
  UP(x, xf);
  UP_EMPTY(y, yf);
  if (st == TD_OK) st = td__cpu_max_pool2d(xf, kh, kw, sh, sw, yf, idx);
  DOWN(y, yf);
  td_tensor_unref(xf);
  td_tensor_unref(yf);
  return st;
}

td_status td__half_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx) {
  td_tensor *gyf = NULL, *gxf = NULL;
  td_status st = TD_OK;
  UP(gy, gyf);
  UP(gx, gxf); /* accumulated into: its contents matter */
  if (st == TD_OK) st = td__cpu_max_pool2d_backward(gyf, idx, gxf);
  DOWN(gx, gxf);
  td_tensor_unref(gyf);
  td_tensor_unref(gxf);
  return st;
}

td_status td__half_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                             const td_tensor *index, const td_tensor *g) {
  td_tensor *gxf = NULL, *gf = NULL;
  td_status st = TD_OK;
  UP(gx, gxf);
  UP(g, gf);
  if (st == TD_OK) st = td__cpu_index_add(gxf, outer, r, inner, index, gf);
  DOWN(gx, gxf);
  td_tensor_unref(gxf);
  td_tensor_unref(gf);
  return st;
}

td_status td__half_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                              double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd) {
  td_tensor *xf = NULL, *wf = NULL, *bf = NULL, *yf = NULL, *mf = NULL, *rf = NULL;
  td_status st = TD_OK;
  UP(x, xf);
  UP(w, wf);
  UP(b, bf);
  UP_EMPTY(y, yf);
  UP_EMPTY(mean, mf);
  UP_EMPTY(rstd, rf);
  if (st == TD_OK) st = td__cpu_layer_norm(xf, wf, bf, eps, yf, mf, rf);
  DOWN(y, yf);
  DOWN(mean, mf);
  DOWN(rstd, rf);
  td_tensor *all[6] = {xf, wf, bf, yf, mf, rf};
  for (int i = 0; i < 6; i++) td_tensor_unref(all[i]);
  return st;
}

td_status td__half_layer_norm_backward(const td_tensor *gy, const td_tensor *x,
                                       const td_tensor *w, const td_tensor *mean,
                                       const td_tensor *rstd, td_tensor *gx, td_tensor *gw,
                                       td_tensor *gb) {
  td_tensor *gyf = NULL, *xf = NULL, *wf = NULL, *mf = NULL, *rf = NULL, *gxf = NULL,
            *gwf = NULL, *gbf = NULL;
  td_status st = TD_OK;
  UP(gy, gyf);
  UP(x, xf);
  UP(w, wf);
  UP(mean, mf);
  UP(rstd, rf);
  UP_EMPTY(gx, gxf);
  UP_EMPTY(gw, gwf);
  UP_EMPTY(gb, gbf);
  if (st == TD_OK) st = td__cpu_layer_norm_backward(gyf, xf, wf, mf, rf, gxf, gwf, gbf);
  DOWN(gx, gxf);
  DOWN(gw, gwf);
  DOWN(gb, gbf);
  td_tensor *all[8] = {gyf, xf, wf, mf, rf, gxf, gwf, gbf};
  for (int i = 0; i < 8; i++) td_tensor_unref(all[i]);
  return st;
}

/* im2col / col2im take raw pointers: the image's and the column matrix's element counts. */
static int64_t col_elems(int64_t c, int64_t h, int64_t w, int kh, int kw, int sh, int sw, int ph,
                         int pw) {
  int64_t oh = (h + 2 * ph - kh) / sh + 1, ow = (w + 2 * pw - kw) / sw + 1;
  return c * kh * kw * oh * ow;
}

td_status td__half_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                          int kw, int sh, int sw, int ph, int pw, void *col) {
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0 || h + 2 * ph < kh ||
      w + 2 * pw < kw)
    return td_set_error(TD_ERR_INVALID, "im2col: bad geometry");
  int64_t nc = col_elems(c, h, w, kh, kw, sh, sw, ph, pw);
  float *xf = NULL, *cf = NULL;
  td_status st = td__cpu_half_buffer(dt, x, c * h * w, &xf);
  if (st == TD_OK) st = td__cpu_half_buffer(dt, NULL, nc, &cf);
  if (st == TD_OK) st = td__cpu_im2col(TD_DTYPE_F32, xf, c, h, w, kh, kw, sh, sw, ph, pw, cf);
  if (st == TD_OK) td__half_store(dt, col, 1, cf, nc);
  td__free(xf);
  td__free(cf);
  return st;
}

td_status td__half_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                          int kw, int sh, int sw, int ph, int pw, void *gx) {
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0 || h + 2 * ph < kh ||
      w + 2 * pw < kw)
    return td_set_error(TD_ERR_INVALID, "col2im: bad geometry");
  int64_t nc = col_elems(c, h, w, kh, kw, sh, sw, ph, pw);
  float *cf = NULL, *gf = NULL;
  td_status st = td__cpu_half_buffer(dt, col, nc, &cf);
  if (st == TD_OK) st = td__cpu_half_buffer(dt, gx, c * h * w, &gf);
  if (st == TD_OK) st = td__cpu_col2im(TD_DTYPE_F32, cf, c, h, w, kh, kw, sh, sw, ph, pw, gf);
  if (st == TD_OK) td__half_store(dt, gx, 1, gf, c * h * w);
  td__free(cf);
  td__free(gf);
  return st;
}
