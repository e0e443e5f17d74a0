/* test_nn_conv.c - conv2d and max_pool2d: forward values against PyTorch and against a direct
 * (7-loop) reference convolution, gradients against finite differences (float64) and against the
 * reference backward on an input large enough to be processed in chunks, and misuse.
 *
 * Expected numbers were produced with PyTorch 1.13 in float64:
 *   formula(n, a, m, s, o) = torch.tensor([((i * a) % m) * s + o for i in range(n)])
 *   x = formula(32, 5, 11, 0.5, -2).reshape(1, 2, 4, 4)
 *   w = formula(54, 3, 7, 0.25, -0.75).reshape(3, 2, 3, 3); b = [0.5, -1, 0.25]
 *   F.conv2d(x, w, b, stride=2, padding=1); F.conv2d(x, w, None, stride=(1, 2), padding=(0, 1))
 *   xp = formula(20, 7, 20, 1, -10).reshape(1, 1, 4, 5)
 *   F.max_pool2d(xp, 2, 2); F.max_pool2d(xp, (3, 2), (1, 3))
 */
#include "nn_test_util.h"

static double *host_doubles(const td_tensor *t) {
  td_tensor *d;
  TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_F64, &d));
  int64_t n = td_tensor_numel(t);
  double *buf = malloc((size_t)(n ? n : 1) * sizeof(double));
  TD_ASSERT_OK(td_tensor_copy_to_buffer(d, buf, (size_t)n * sizeof(double)));
  td_tensor_unref(d);
  return buf;
}

/* ---- conv2d forward ---- */

static void test_conv2d_forward_matches_torch(void **state) {
  (void)state;
  const int64_t xs[] = {1, 2, 4, 4}, ws[] = {3, 2, 3, 3}, bs[] = {3};
  const double bv[] = {0.5, -1.0, 0.25};
  const double s2p1[] = {-5.625, -3.75, 4.625, 6.75, 0.875, 1.375,
                         -3.125, -2,    2.25,  1.375, -1.125, -5.375};
  const double s12p01[] = {3, 3.25, 4.125, 6.25, 4.25, 4, -2.125, -1, -5, -0.5, -1.375, -5.625};
  for (int f32 = 0; f32 < 2; f32++) {
    td_dtype dt = f32 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    td_tensor *x = nn_formula(xs, 4, 5, 11, 0.5, -2.0, dt, false);
    td_tensor *w = nn_formula(ws, 4, 3, 7, 0.25, -0.75, dt, false);
    td_tensor *b = td_test_tensor(bv, bs, 1, dt, false), *y;
    TD_ASSERT_OK(td_tensor_conv2d(x, w, b, 2, 2, 1, 1, &y));
    const int64_t ys[] = {1, 3, 2, 2};
    nn_expect_shape(y, ys, 4);
    assert_int_equal(td_tensor_dtype(y), dt);
    nn_expect("conv2d stride 2 pad 1", y, s2p1, 12, 1e-6);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_conv2d(x, w, NULL, 1, 2, 0, 1, &y));
    nn_expect_shape(y, ys, 4);
    nn_expect("conv2d stride (1,2) pad (0,1)", y, s12p01, 12, 1e-6);
    td_tensor_unref(y);

    /* Unbatched [C, H, W] input gives [O, OH, OW]. */
    td_tensor *x3;
    TD_ASSERT_OK(td_tensor_squeeze(x, 0, &x3));
    TD_ASSERT_OK(td_tensor_conv2d(x3, w, b, 2, 2, 1, 1, &y));
    nn_expect_shape(y, ys + 1, 3);
    nn_expect("conv2d unbatched", y, s2p1, 12, 1e-6);
    td_tensor_unref(y);
    td_tensor_unref(x3);
    td_tensor_unref(x);
    td_tensor_unref(w);
    td_tensor_unref(b);
  }
}

typedef struct conv_cfg {
  int64_t n, c, h, w, o, kh, kw;
  int sh, sw, ph, pw;
} conv_cfg;

static int64_t cfg_oh(const conv_cfg *g) { return (g->h + 2 * g->ph - g->kh) / g->sh + 1; }
static int64_t cfg_ow(const conv_cfg *g) { return (g->w + 2 * g->pw - g->kw) / g->sw + 1; }

/* Direct convolution: y[n,o,i,j] = b[o] + sum_{c,p,q} x[n,c,i*sh-ph+p, j*sw-pw+q] w[o,c,p,q]. */
static void ref_conv(const conv_cfg *g, const double *x, const double *w, const double *b,
                     double *y) {
  int64_t oh = cfg_oh(g), ow = cfg_ow(g);
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t o = 0; o < g->o; o++)
      for (int64_t i = 0; i < oh; i++)
        for (int64_t j = 0; j < ow; j++) {
          double s = b ? b[o] : 0.0;
          for (int64_t c = 0; c < g->c; c++)
            for (int64_t p = 0; p < g->kh; p++) {
              int64_t iy = i * g->sh - g->ph + p;
              if (iy < 0 || iy >= g->h) continue;
              for (int64_t q = 0; q < g->kw; q++) {
                int64_t ix = j * g->sw - g->pw + q;
                if (ix < 0 || ix >= g->w) continue;
                s += x[((n * g->c + c) * g->h + iy) * g->w + ix] *
                     w[((o * g->c + c) * g->kh + p) * g->kw + q];
              }
            }
          y[((n * g->o + o) * oh + i) * ow + j] = s;
        }
}

/* Gradients of sum(y * gy) for the direct convolution. */
static void ref_conv_backward(const conv_cfg *g, const double *x, const double *w,
                              const double *gy, double *gx, double *gw, double *gb) {
  int64_t oh = cfg_oh(g), ow = cfg_ow(g);
  memset(gx, 0, (size_t)(g->n * g->c * g->h * g->w) * sizeof(double));
  memset(gw, 0, (size_t)(g->o * g->c * g->kh * g->kw) * sizeof(double));
  memset(gb, 0, (size_t)g->o * sizeof(double));
  for (int64_t n = 0; n < g->n; n++)
    for (int64_t o = 0; o < g->o; o++)
      for (int64_t i = 0; i < oh; i++)
        for (int64_t j = 0; j < ow; j++) {
          double d = gy[((n * g->o + o) * oh + i) * ow + j];
          gb[o] += d;
          for (int64_t c = 0; c < g->c; c++)
            for (int64_t p = 0; p < g->kh; p++) {
              int64_t iy = i * g->sh - g->ph + p;
              if (iy < 0 || iy >= g->h) continue;
              for (int64_t q = 0; q < g->kw; q++) {
                int64_t ix = j * g->sw - g->pw + q;
                if (ix < 0 || ix >= g->w) continue;
                int64_t xi = ((n * g->c + c) * g->h + iy) * g->w + ix;
                int64_t wi = ((o * g->c + c) * g->kh + p) * g->kw + q;
                gx[xi] += d * w[wi];
                gw[wi] += d * x[xi];
              }
            }
        }
}

static void check_against_reference(const conv_cfg *g, td_dtype dt, bool with_bias, double tol) {
  const int64_t xs[] = {g->n, g->c, g->h, g->w}, ws[] = {g->o, g->c, g->kh, g->kw};
  const int64_t ys[] = {g->n, g->o, cfg_oh(g), cfg_ow(g)};
  td_tensor *x = td_test_randn(xs, 4, dt, 21, true), *w = td_test_randn(ws, 4, dt, 22, true);
  td_tensor *b = with_bias ? td_test_randn(&g->o, 1, dt, 23, true) : NULL;
  td_tensor *gy = td_test_randn(ys, 4, dt, 24, false), *y, *p, *s;
  TD_ASSERT_OK(td_tensor_conv2d(x, w, b, g->sh, g->sw, g->ph, g->pw, &y));
  nn_expect_shape(y, ys, 4);

  double *xd = host_doubles(x), *wd = host_doubles(w), *bd = b ? host_doubles(b) : NULL;
  double *gyd = host_doubles(gy);
  int64_t ny = td_tensor_numel(y), nx = td_tensor_numel(x), nw = td_tensor_numel(w);
  double *want = malloc((size_t)ny * sizeof(double));
  ref_conv(g, xd, wd, bd, want);
  nn_expect("conv2d vs reference", y, want, ny, tol);

  TD_ASSERT_OK(td_tensor_mul(y, gy, &p));
  TD_ASSERT_OK(td_tensor_sum_all(p, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  double *gx = malloc((size_t)nx * sizeof(double)), *gw = malloc((size_t)nw * sizeof(double));
  double *gb = malloc((size_t)g->o * sizeof(double));
  ref_conv_backward(g, xd, wd, gyd, gx, gw, gb);
  td_tensor *ga = td_tensor_grad(x);
  nn_expect("conv2d grad input vs reference", ga, gx, nx, tol);
  td_tensor_unref(ga);
  ga = td_tensor_grad(w);
  nn_expect("conv2d grad weight vs reference", ga, gw, nw, tol);
  td_tensor_unref(ga);
  if (b) {
    ga = td_tensor_grad(b);
    nn_expect("conv2d grad bias vs reference", ga, gb, g->o, tol);
    td_tensor_unref(ga);
  }
  free(gx);
  free(gw);
  free(gb);
  free(want);
  free(xd);
  free(wd);
  free(bd);
  free(gyd);
  td_tensor_unref(s);
  td_tensor_unref(p);
  td_tensor_unref(y);
  td_tensor_unref(gy);
  td_tensor_unref(x);
  td_tensor_unref(w);
  td_tensor_unref(b);
}

static void test_conv2d_matches_reference(void **state) {
  (void)state;
  const conv_cfg cfgs[] = {
      {2, 3, 7, 6, 4, 3, 3, 1, 1, 0, 0}, {3, 2, 8, 9, 5, 3, 2, 2, 3, 1, 2},
      {1, 1, 5, 5, 2, 5, 5, 1, 1, 2, 2}, {2, 4, 6, 6, 3, 1, 1, 2, 1, 0, 1},
      {2, 2, 3, 4, 2, 4, 4, 3, 3, 3, 3}, /* windows that start in the padding */
  };
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
    check_against_reference(&cfgs[i], TD_DTYPE_F64, i % 2 == 0, 1e-10);
    check_against_reference(&cfgs[i], TD_DTYPE_F32, i % 2 == 1, 1e-4);
  }
}

/* 16 * 3 * 3 * 110 * 110 col elements per image: the op processes the 3 images in chunks of 2
 * and 1, which this checks against the direct convolution. */
static void test_conv2d_chunked_batch_matches_reference(void **state) {
  (void)state;
  const conv_cfg g = {3, 16, 110, 110, 2, 3, 3, 1, 1, 1, 1};
  check_against_reference(&g, TD_DTYPE_F64, true, 1e-9);
}

/* ---- conv2d gradients ---- */

typedef struct conv_ctx {
  int sh, sw, ph, pw;
  bool unbatched;
} conv_ctx;

static td_status conv_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  conv_ctx *c = ctx;
  return td_tensor_conv2d(in[0], in[1], n > 2 ? in[2] : NULL, c->sh, c->sw, c->ph, c->pw, out);
}

static void test_conv2d_gradcheck(void **state) {
  (void)state;
  const int64_t xs[] = {2, 2, 5, 5}, ws[] = {3, 2, 3, 3}, bs[] = {3}, w1[] = {3, 2, 1, 1};
  td_tensor *in[3] = {td_test_randn(xs, 4, TD_DTYPE_F64, 1, true),
                      td_test_randn(ws, 4, TD_DTYPE_F64, 2, true),
                      td_test_randn(bs, 1, TD_DTYPE_F64, 3, true)};
  conv_ctx c1 = {2, 2, 1, 1, false}, c2 = {1, 2, 0, 1, false}, c3 = {1, 1, 1, 1, false};
  td_test_gradcheck(conv_fn, &c1, in, 3, 1e-6, 1e-7, 1e-5);
  td_test_gradcheck(conv_fn, &c2, in, 2, 1e-6, 1e-7, 1e-5);
  td_test_gradcheck(conv_fn, &c3, in, 3, 1e-6, 1e-7, 1e-5);
  /* 1x1 kernel */
  td_tensor *k1 = td_test_randn(w1, 4, TD_DTYPE_F64, 4, true);
  td_tensor *in1[3] = {in[0], k1, in[2]};
  td_test_gradcheck(conv_fn, &c1, in1, 3, 1e-6, 1e-7, 1e-5);
  /* Only the weight requires grad. */
  td_tensor *xc;
  TD_ASSERT_OK(td_tensor_detach(in[0], &xc));
  td_tensor *in2[2] = {xc, in[1]};
  td_test_gradcheck(conv_fn, &c2, in2, 2, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(xc);
  td_tensor_unref(k1);
  for (int i = 0; i < 3; i++) td_tensor_unref(in[i]);

  /* Unbatched input [C, H, W]. */
  const int64_t x3s[] = {2, 4, 5};
  td_tensor *in3[3] = {td_test_randn(x3s, 3, TD_DTYPE_F64, 5, true),
                       td_test_randn(ws, 4, TD_DTYPE_F64, 6, true),
                       td_test_randn(bs, 1, TD_DTYPE_F64, 7, true)};
  td_test_gradcheck(conv_fn, &c3, in3, 3, 1e-6, 1e-7, 1e-5);
  for (int i = 0; i < 3; i++) td_tensor_unref(in3[i]);
}

static void test_conv2d_misuse(void **state) {
  (void)state;
  const int64_t xs[] = {1, 2, 4, 4}, ws[] = {3, 2, 3, 3}, w3[] = {3, 3, 3, 3};
  const int64_t wbig[] = {3, 2, 5, 5};
  const int64_t bs[] = {3}, b4[] = {4}, x2[] = {4, 4};
  td_tensor *x = td_test_randn(xs, 4, TD_DTYPE_F64, 1, false);
  td_tensor *w = td_test_randn(ws, 4, TD_DTYPE_F64, 2, false);
  td_tensor *wc = td_test_randn(w3, 4, TD_DTYPE_F64, 3, false);
  td_tensor *wb = td_test_randn(wbig, 4, TD_DTYPE_F64, 3, false);
  td_tensor *b = td_test_randn(bs, 1, TD_DTYPE_F64, 4, false);
  td_tensor *bb = td_test_randn(b4, 1, TD_DTYPE_F64, 4, false);
  td_tensor *w32 = td_test_randn(ws, 4, TD_DTYPE_F32, 5, false);
  td_tensor *xflat = td_test_randn(x2, 2, TD_DTYPE_F64, 6, false), *xi, *y = NULL;
  TD_ASSERT_OK(td_tensor_zeros(xs, 4, TD_DTYPE_I64, td_device_cpu(), &xi));

  TD_ASSERT_STATUS(td_tensor_conv2d(x, wc, b, 1, 1, 0, 0, &y), TD_ERR_SHAPE);
  nn_expect_error("conv2d", "channels");
  TD_ASSERT_STATUS(td_tensor_conv2d(x, wb, NULL, 1, 1, 0, 0, &y), TD_ERR_SHAPE);
  nn_expect_error("conv2d", "larger");
  TD_ASSERT_OK(td_tensor_conv2d(x, wb, NULL, 1, 1, 1, 1, &y)); /* padding makes it fit */
  td_tensor_unref(y);
  y = NULL;
  TD_ASSERT_STATUS(td_tensor_conv2d(x, w, bb, 1, 1, 0, 0, &y), TD_ERR_SHAPE);
  nn_expect_error("bias", "[4]");
  TD_ASSERT_STATUS(td_tensor_conv2d(xflat, w, b, 1, 1, 0, 0, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_conv2d(x, w, b, 0, 1, 0, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_conv2d(x, w, b, 1, 1, -1, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_conv2d(x, w32, b, 1, 1, 0, 0, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_conv2d(xi, w, b, 1, 1, 0, 0, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_conv2d(NULL, w, b, 1, 1, 0, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_conv2d(x, NULL, b, 1, 1, 0, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_conv2d(x, w, b, 1, 1, 0, 0, NULL), TD_ERR_INVALID);
  assert_null(y);

  td_tensor_unref(xi);
  td_tensor_unref(xflat);
  td_tensor_unref(w32);
  td_tensor_unref(bb);
  td_tensor_unref(b);
  td_tensor_unref(wb);
  td_tensor_unref(wc);
  td_tensor_unref(w);
  td_tensor_unref(x);
}

/* ---- max_pool2d ---- */

static void test_max_pool2d_forward_matches_torch(void **state) {
  (void)state;
  /* xp rows: [-10 -3 4 -9 -2], [5 -8 -1 6 -7], [0 7 -6 1 8], [-5 2 9 -4 3] */
  const int64_t xs[] = {1, 1, 4, 5};
  const double p22[] = {5, 6, 7, 9}, p32[] = {7, 8, 7, 8};
  for (int f32 = 0; f32 < 2; f32++) {
    td_dtype dt = f32 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    td_tensor *x = nn_formula(xs, 4, 7, 20, 1.0, -10.0, dt, false), *y;
    TD_ASSERT_OK(td_tensor_max_pool2d(x, 2, 2, 2, 2, &y));
    const int64_t ys[] = {1, 1, 2, 2};
    nn_expect_shape(y, ys, 4);
    nn_expect("max_pool2d 2x2", y, p22, 4, 0);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_max_pool2d(x, 3, 2, 1, 3, &y));
    nn_expect_shape(y, ys, 4);
    nn_expect("max_pool2d 3x2 stride (1,3)", y, p32, 4, 0);
    td_tensor_unref(y);
    td_tensor *x3;
    TD_ASSERT_OK(td_tensor_squeeze(x, 0, &x3));
    TD_ASSERT_OK(td_tensor_max_pool2d(x3, 2, 2, 2, 2, &y));
    nn_expect_shape(y, ys + 1, 3);
    nn_expect("max_pool2d unbatched", y, p22, 4, 0);
    td_tensor_unref(y);
    td_tensor_unref(x3);
    td_tensor_unref(x);
  }
}

static void test_max_pool2d_propagates_nan(void **state) {
  (void)state;
  const double xv[] = {1, NAN, 3, 4, 5, 6, 7, 8};
  const int64_t xs[] = {1, 1, 2, 4};
  td_tensor *x = nn_f64(xv, xs, 4, false), *y;
  TD_ASSERT_OK(td_tensor_max_pool2d(x, 2, 2, 2, 2, &y));
  const double want[] = {NAN, 8};
  nn_expect("max_pool2d nan", y, want, 2, 0);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

typedef struct pool_ctx {
  int kh, kw, sh, sw;
} pool_ctx;

static td_status pool_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  pool_ctx *c = ctx;
  return td_tensor_max_pool2d(in[0], c->kh, c->kw, c->sh, c->sw, out);
}

/* The float32 2x2/stride-2 kernel (vectorized, 4 outputs at a time plus a scalar tail) must
 * agree with the generic float64 kernel on the same values, including ties (the window's first
 * element wins), NaNs (a NaN wins; the last NaN in window order) and -inf: values and where the
 * gradient goes. Widths 8..17 cover every tail length. */
static void test_max_pool2d_2x2_f32_matches_generic(void **state) {
  (void)state;
  for (int64_t wdt = 8; wdt <= 17; wdt++) {
    const int64_t xs[] = {2, 3, 6, wdt};
    int64_t n = 2 * 3 * 6 * wdt;
    double *v = malloc((size_t)n * sizeof *v);
    assert_non_null(v);
    uint64_t r = 0x9e3779b97f4a7c15ull ^ (uint64_t)wdt;
    for (int64_t i = 0; i < n; i++) {
      r = r * 6364136223846793005ull + 1442695040888963407ull;
      int k = (int)(r >> 59); /* 0..31 */
      v[i] = k < 2 ? NAN : k < 3 ? -INFINITY : (double)(k % 5); /* many ties */
    }
    td_tensor *x64, *x32, *y64, *y32, *s64, *s32;
    TD_ASSERT_OK(td_tensor_from_buffer(v, xs, 4, TD_DTYPE_F64, &x64));
    TD_ASSERT_OK(td_tensor_to_dtype(x64, TD_DTYPE_F32, &x32));
    TD_ASSERT_OK(td_tensor_set_requires_grad(x64, true));
    TD_ASSERT_OK(td_tensor_set_requires_grad(x32, true));
    TD_ASSERT_OK(td_tensor_max_pool2d(x64, 2, 2, 2, 2, &y64));
    TD_ASSERT_OK(td_tensor_max_pool2d(x32, 2, 2, 2, 2, &y32));
    int64_t m = td_tensor_numel(y64);
    assert_int_equal(td_tensor_numel(y32), m);
    double *a = malloc((size_t)m * sizeof *a);
    float *b = malloc((size_t)m * sizeof *b);
    TD_ASSERT_OK(td_tensor_copy_to_buffer(y64, a, (size_t)m * sizeof *a));
    TD_ASSERT_OK(td_tensor_copy_to_buffer(y32, b, (size_t)m * sizeof *b));
    for (int64_t i = 0; i < m; i++) {
      if (isnan(a[i])) assert_true(isnan(b[i]));
      else assert_true((double)b[i] == a[i]);
    }
    /* where each window's gradient lands = which element was chosen */
    TD_ASSERT_OK(td_tensor_sum_all(y64, &s64));
    TD_ASSERT_OK(td_tensor_sum_all(y32, &s32));
    TD_ASSERT_OK(td_tensor_backward(s64));
    TD_ASSERT_OK(td_tensor_backward(s32));
    td_tensor *g64 = td_tensor_grad(x64), *g32 = td_tensor_grad(x32);
    double *ga = malloc((size_t)n * sizeof *ga);
    float *gb = malloc((size_t)n * sizeof *gb);
    TD_ASSERT_OK(td_tensor_copy_to_buffer(g64, ga, (size_t)n * sizeof *ga));
    TD_ASSERT_OK(td_tensor_copy_to_buffer(g32, gb, (size_t)n * sizeof *gb));
    for (int64_t i = 0; i < n; i++) {
      if (ga[i] != (double)gb[i]) fail_msg("width %lld: gradient differs at %lld", (long long)wdt,
                                          (long long)i);
    }
    free(ga);
    free(gb);
    free(a);
    free(b);
    free(v);
    td_tensor_unref(g64);
    td_tensor_unref(g32);
    td_tensor_unref(s64);
    td_tensor_unref(s32);
    td_tensor_unref(y64);
    td_tensor_unref(y32);
    td_tensor_unref(x64);
    td_tensor_unref(x32);
  }
}

static void test_max_pool2d_gradcheck(void **state) {
  (void)state;
  const int64_t xs[] = {2, 3, 5, 6}, x3[] = {2, 5, 7};
  td_tensor *x = td_test_randn(xs, 4, TD_DTYPE_F64, 8, true);
  pool_ctx c1 = {2, 2, 2, 2}, c2 = {3, 2, 1, 3}, c3 = {2, 3, 1, 1};
  td_test_gradcheck(pool_fn, &c1, &x, 1, 1e-6, 1e-7, 1e-5);
  td_test_gradcheck(pool_fn, &c2, &x, 1, 1e-6, 1e-7, 1e-5);
  td_test_gradcheck(pool_fn, &c3, &x, 1, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(x);
  x = td_test_randn(x3, 3, TD_DTYPE_F64, 9, true);
  td_test_gradcheck(pool_fn, &c1, &x, 1, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(x);
}

/* Overlapping windows that share their maximum route its gradient once per window; ties go to
 * the first element. */
static void test_max_pool2d_overlapping_windows_and_ties(void **state) {
  (void)state;
  const double xv[] = {0, 0, 0, 0, 9, 0, 0, 0, 0};
  const int64_t xs[] = {1, 1, 3, 3};
  td_tensor *x = nn_f64(xv, xs, 4, true), *y, *s;
  TD_ASSERT_OK(td_tensor_max_pool2d(x, 2, 2, 1, 1, &y));
  TD_ASSERT_OK(td_tensor_sum_all(y, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor *g = td_tensor_grad(x);
  const double want[] = {0, 0, 0, 0, 4, 0, 0, 0, 0};
  nn_expect("max_pool2d shared max grad", g, want, 9, 0);
  td_tensor_unref(g);
  td_tensor_unref(s);
  td_tensor_unref(y);
  td_tensor_unref(x);

  /* Ties go to the first element of each window (PyTorch 1.13 gives grad [[0, 2, 0], [0, 0, 0]]
   * for this input). */
  const double tv[] = {1, 2, 2, 0, 2, 1};
  const int64_t ts[] = {1, 1, 2, 3};
  x = nn_f64(tv, ts, 4, true);
  TD_ASSERT_OK(td_tensor_max_pool2d(x, 2, 2, 1, 1, &y));
  TD_ASSERT_OK(td_tensor_sum_all(y, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  g = td_tensor_grad(x);
  const double twant[] = {0, 2, 0, 0, 0, 0};
  nn_expect("max_pool2d tie grad", g, twant, 6, 0);
  td_tensor_unref(g);
  td_tensor_unref(s);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static void test_max_pool2d_misuse(void **state) {
  (void)state;
  const int64_t xs[] = {1, 2, 4, 4}, x2[] = {4, 4};
  td_tensor *x = td_test_randn(xs, 4, TD_DTYPE_F64, 1, false);
  td_tensor *xf = td_test_randn(x2, 2, TD_DTYPE_F64, 1, false), *xi, *y = NULL;
  TD_ASSERT_OK(td_tensor_zeros(xs, 4, TD_DTYPE_I64, td_device_cpu(), &xi));
  TD_ASSERT_STATUS(td_tensor_max_pool2d(x, 5, 2, 1, 1, &y), TD_ERR_SHAPE);
  nn_expect_error("max_pool2d", "[1, 2, 4, 4]");
  TD_ASSERT_STATUS(td_tensor_max_pool2d(x, 0, 2, 1, 1, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_max_pool2d(x, 2, 2, 0, 1, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_max_pool2d(xf, 2, 2, 2, 2, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_max_pool2d(xi, 2, 2, 2, 2, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_max_pool2d(NULL, 2, 2, 2, 2, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_max_pool2d(x, 2, 2, 2, 2, NULL), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(xi);
  td_tensor_unref(xf);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_conv2d_forward_matches_torch),
      cmocka_unit_test(test_conv2d_matches_reference),
      cmocka_unit_test(test_conv2d_chunked_batch_matches_reference),
      cmocka_unit_test(test_conv2d_gradcheck),
      cmocka_unit_test(test_conv2d_misuse),
      cmocka_unit_test(test_max_pool2d_forward_matches_torch),
      cmocka_unit_test(test_max_pool2d_propagates_nan),
      cmocka_unit_test(test_max_pool2d_gradcheck),
      cmocka_unit_test(test_max_pool2d_2x2_f32_matches_generic),
      cmocka_unit_test(test_max_pool2d_overlapping_windows_and_ties),
      cmocka_unit_test(test_max_pool2d_misuse),
  };
  return cmocka_run_group_tests_name("tensor_nn_conv", tests, NULL, NULL);
}
