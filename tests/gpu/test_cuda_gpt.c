/* test_cuda_gpt.c - the CUDA kernels the GPT needs, against the CPU backend: bfloat16 / float16
 * conversions, elementwise ops (the general kernels and the 16-byte vector ones, which must also
 * agree with each other bit for bit), reductions, softmax, layer norm, losses and embeddings in the
 * 16-bit dtypes, cuBLASLt GEMMs, the flash attention (general and tensor-core kernels, forward and
 * backward, float32 / float64 / bfloat16 / float16), multi-tensor AdamW, the sum of squares of
 * gradient-norm clipping, the allocator's peak, and a small GPT trained a few steps on both
 * devices (float32: every step's loss within 1e-4; bfloat16 autocast: within 2%).
 *
 * Comparisons use the max-norm relative error max|cuda - cpu| / max|cpu| (NaN positions must
 * agree): float32 within 1e-5 where the two compute the same sums in a different order, float64
 * 1e-12, and the 16-bit dtypes within a few units of their rounding (2^-8 bfloat16, 2^-11
 * float16), scaled where a reduction of length n adds rounding (the tolerances name the factor).
 * Conversions and copies must give the CPU's exact bits.
 *
 * Without a CUDA device every test skips and the program exits with 77 (ctest: "Skipped").
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"
#include "tdist/nn.h"
#include "tdist/optim.h"

#define F32 TD_DTYPE_F32
#define F64 TD_DTYPE_F64
#define I64 TD_DTYPE_I64
#define BF16 TD_DTYPE_BF16
#define F16 TD_DTYPE_F16

#define BF16_EPS 0.00390625       /* 2^-8: bfloat16's relative rounding */
#define F16_EPS 0.00048828125     /* 2^-11 */

static td_device cuda0(void) { return td_device_cuda(0); }

/* half_eps is the unit roundoff of a 16-bit dtype (0 for the others: callers give their own). */
static double half_eps(td_dtype dt) { return dt == BF16 ? BF16_EPS : dt == F16 ? F16_EPS : 0; }

/* host64 returns t as a float64 CPU tensor. */
static td_tensor *host64(const td_tensor *t) {
  td_tensor *c = NULL, *d = NULL;
  TD_ASSERT_OK(td_tensor_to(t, td_device_cpu(), &c));
  TD_ASSERT_OK(td_tensor_to_dtype(c, F64, &d));
  td_tensor_unref(c);
  return d;
}

/* near fails unless gpu (on cuda:0) and cpu have the same shape and dtype and
 * max|gpu - cpu| <= rtol * max|cpu| (NaN where the other is NaN). */
static void near(const char *what, const td_tensor *gpu, const td_tensor *cpu, double rtol) {
  td_device d = td_tensor_device(gpu);
  if (d.type != TD_DEVICE_CUDA) fail_msg("%s: the result is not on a CUDA device", what);
  if (td_tensor_dtype(gpu) != td_tensor_dtype(cpu))
    fail_msg("%s: dtype %s on CUDA, %s on the CPU", what, td_dtype_name(td_tensor_dtype(gpu)),
             td_dtype_name(td_tensor_dtype(cpu)));
  if (!td_tensor_same_shape(gpu, cpu)) fail_msg("%s: shapes differ", what);
  td_tensor *a = host64(gpu), *b = host64(cpu), *ac = NULL, *bc = NULL;
  TD_ASSERT_OK(td_tensor_contiguous(a, &ac));
  TD_ASSERT_OK(td_tensor_contiguous(b, &bc));
  const double *x = td_tensor_data(ac), *y = td_tensor_data(bc);
  int64_t n = td_tensor_numel(bc), worst = -1;
  double ref = 0, err = 0;
  for (int64_t i = 0; i < n; i++)
    if (isfinite(y[i]) && fabs(y[i]) > ref) ref = fabs(y[i]);
  for (int64_t i = 0; i < n; i++) {
    if (isnan(x[i]) != isnan(y[i]) || (isinf(y[i]) && x[i] != y[i]))
      fail_msg("%s: element %lld is %g on CUDA, %g on the CPU", what, (long long)i, x[i], y[i]);
    if (!isfinite(y[i])) continue;
    double e = fabs(x[i] - y[i]);
    if (e > err) err = e, worst = i;
  }
  if (err > rtol * ref)
    fail_msg("%s: max error %.3g (relative %.3g > %.3g) at element %lld: %.9g on CUDA, %.9g on "
             "the CPU", what, err, ref > 0 ? err / ref : err, rtol, (long long)worst,
             x[worst], y[worst]);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(ac);
  td_tensor_unref(bc);
}

/* rnd returns a CPU tensor of N(0, 1) (or U[lo, hi) when lo < hi) values in dt. */
static td_tensor *rnd(const int64_t *shape, int nd, td_dtype dt, uint64_t seed, double lo,
                      double hi) {
  td_tensor *f = lo < hi ? td_test_rand(shape, nd, F64, lo, hi, seed, false)
                         : td_test_randn(shape, nd, F64, seed, false);
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(f, dt, &t));
  td_tensor_unref(f);
  return t;
}

static td_tensor *on_gpu(const td_tensor *t) {
  td_tensor *g = NULL;
  TD_ASSERT_OK(td_tensor_to(t, cuda0(), &g));
  return g;
}

/* Leaves that require grad: a CPU tensor and its CUDA copy. */
static void leaf_pair(const td_tensor *src, td_tensor **c, td_tensor **g) {
  TD_ASSERT_OK(td_tensor_clone(src, c));
  *g = on_gpu(src);
  TD_ASSERT_OK(td_tensor_set_requires_grad(*c, true));
  TD_ASSERT_OK(td_tensor_set_requires_grad(*g, true));
}

/* backprop_weighted runs backward of sum(y * W) with W a fixed N(0, 1) tensor in y's dtype,
 * on y's device. */
static void backprop_weighted(const td_tensor *y, uint64_t seed) {
  td_tensor *w = rnd(td_tensor_shape(y), td_tensor_ndim(y), td_tensor_dtype(y), seed, 0, 0);
  td_tensor *wd = NULL, *p = NULL, *s = NULL;
  TD_ASSERT_OK(td_tensor_to(w, td_tensor_device(y), &wd));
  TD_ASSERT_OK(td_tensor_mul(y, wd, &p));
  TD_ASSERT_OK(td_tensor_sum_all(p, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor_unref(w);
  td_tensor_unref(wd);
  td_tensor_unref(p);
  td_tensor_unref(s);
}

static void near_grad(const char *what, const td_tensor *g_leaf, const td_tensor *c_leaf,
                      double rtol) {
  td_tensor *gg = td_tensor_grad(g_leaf), *cg = td_tensor_grad(c_leaf);
  if (!gg || !cg) fail_msg("%s: gradient missing (CUDA %p, CPU %p)", what, (void *)gg, (void *)cg);
  near(what, gg, cg, rtol);
  td_tensor_unref(gg);
  td_tensor_unref(cg);
}

/* ---- conversions and copies: the CPU's bits ---- */

static void test_lowp_conversions_match_cpu_bits(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  /* ties at bfloat16 and float16 precision, tiny (float16 subnormal) values, overflow, signed
   * zero, infinities, NaN, values past int32 */
  const double v[] = {1.0,         1.00390625, 1.01171875, -1.0009765625, 1.00048828125,
                      3.0517578125e-05, 5.9604644775390625e-08, 2.98e-08, 1e-45, 65519.0,
                      65520.0,     3.0e38,     -0.0,       INFINITY,      -INFINITY,
                      NAN,         123456.789, -7.5,       4.0e9,         0.33333333};
  int64_t n = (int64_t)(sizeof v / sizeof v[0]);
  const td_dtype all[] = {F32, F64, I64, F16, BF16}; /* the dtypes CUDA tensors have */
  for (size_t a = 0; a < 5; a++) {
    td_tensor *src = td_test_tensor(v, &n, 1, F64, false), *sa = NULL, *ga = NULL;
    TD_ASSERT_OK(td_tensor_to_dtype(src, all[a], &sa)); /* the CPU's conversion from float64 */
    ga = on_gpu(sa);
    for (size_t b = 0; b < 5; b++) {
      td_tensor *cb = NULL, *gb = NULL, *gb_host = NULL;
      TD_ASSERT_OK(td_tensor_to_dtype(sa, all[b], &cb));
      TD_ASSERT_OK(td_tensor_to_dtype(ga, all[b], &gb));
      TD_ASSERT_OK(td_tensor_to(gb, td_device_cpu(), &gb_host));
      /* every element's bits equal; NaN payloads aside (the GPU's float64 -> float32 conversion
       * gives the canonical NaN, the CPU's keeps the payload's top bits) */
      size_t es = td_dtype_size(all[b]);
      assert_int_equal(td_tensor_nbytes(cb), td_tensor_nbytes(gb_host));
      const unsigned char *x = td_tensor_data(gb_host), *y = td_tensor_data(cb);
      for (int64_t i = 0; i < n; i++) {
        if (memcmp(x + (size_t)i * es, y + (size_t)i * es, es) == 0) continue;
        double xv = 0, yv = 0;
        TD_ASSERT_OK(td_tensor_get(gb_host, &i, &xv));
        TD_ASSERT_OK(td_tensor_get(cb, &i, &yv));
        if (!(isnan(xv) && isnan(yv)))
          fail_msg("%s -> %s: element %lld (from %g) is %.9g on CUDA, %.9g on the CPU (bits "
                   "differ)", td_dtype_name(all[a]), td_dtype_name(all[b]), (long long)i, v[i],
                   xv, yv);
      }
      td_tensor_unref(cb);
      td_tensor_unref(gb);
      td_tensor_unref(gb_host);
    }
    td_tensor_unref(src);
    td_tensor_unref(sa);
    td_tensor_unref(ga);
  }
}

static void test_lowp_strided_copy_and_fill_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {BF16, F16};
  int64_t s[3] = {5, 7, 3};
  for (size_t k = 0; k < 2; k++) {
    td_tensor *c = rnd(s, 3, dts[k], 11, 0, 4), *g = on_gpu(c), *ct = NULL, *gt = NULL;
    td_tensor *cc = NULL, *gc = NULL;
    int perm[3] = {2, 0, 1};
    TD_ASSERT_OK(td_tensor_permute(c, perm, 3, &ct));
    TD_ASSERT_OK(td_tensor_permute(g, perm, 3, &gt));
    TD_ASSERT_OK(td_tensor_contiguous(ct, &cc)); /* strided copy kernel */
    TD_ASSERT_OK(td_tensor_contiguous(gt, &gc));
    char what[64];
    snprintf(what, sizeof what, "permuted copy (%s)", td_dtype_name(dts[k]));
    near(what, gc, cc, 0);
    TD_ASSERT_OK(td_tensor_fill_(cc, -2.75)); /* exact in both */
    TD_ASSERT_OK(td_tensor_fill_(gc, -2.75));
    snprintf(what, sizeof what, "fill (%s)", td_dtype_name(dts[k]));
    near(what, gc, cc, 0);
    td_tensor *all[] = {c, g, ct, gt, cc, gc};
    for (int i = 0; i < 6; i++) td_tensor_unref(all[i]);
  }
}

/* ---- elementwise ops and their backward in bfloat16 / float16 ---- */

typedef enum { U_EXP, U_LOG, U_TANH, U_SIGMOID, U_RELU, U_GELU, U_SQRT, U_POW3, U_AFFINE } un_op;

static td_status unary(un_op op, const td_tensor *x, td_tensor **y) {
  switch (op) {
    case U_EXP: return td_tensor_exp(x, y);
    case U_LOG: return td_tensor_log(x, y);
    case U_TANH: return td_tensor_tanh(x, y);
    case U_SIGMOID: return td_tensor_sigmoid(x, y);
    case U_RELU: return td_tensor_relu(x, y);
    case U_GELU: return td_tensor_gelu(x, y);
    case U_SQRT: return td_tensor_sqrt(x, y);
    case U_POW3: return td_tensor_pow_scalar(x, 3.0, y);
    case U_AFFINE: return td_tensor_mul_scalar(x, -1.5, y);
  }
  return TD_ERR_INVALID;
}

static void test_lowp_elementwise_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {BF16, F16};
  for (int k = 0; k < 2; k++) {
    td_dtype dt = dts[k];
    double eps = half_eps(dt);
    int64_t sa[2] = {33, 65}, sb[1] = {65};
    /* binary with broadcasting, forward and backward */
    for (int op = 0; op < 5; op++) {
      td_tensor *a = rnd(sa, 2, dt, 21, 0.5, 2), *b = rnd(sb, 1, dt, 22, 0.5, 2);
      td_tensor *ca, *ga, *cb, *gb, *cy = NULL, *gy = NULL;
      leaf_pair(a, &ca, &ga);
      leaf_pair(b, &cb, &gb);
      td_status (*fn[5])(const td_tensor *, const td_tensor *, td_tensor **) = {
          td_tensor_add, td_tensor_sub, td_tensor_mul, td_tensor_div, td_tensor_maximum};
      TD_ASSERT_OK(fn[op](ca, cb, &cy));
      TD_ASSERT_OK(fn[op](ga, gb, &gy));
      char what[96];
      snprintf(what, sizeof what, "binary op %d (%s)", op, td_dtype_name(dt));
      near(what, gy, cy, 2 * eps); /* the CPU may round through double first */
      backprop_weighted(cy, 23);
      backprop_weighted(gy, 23);
      snprintf(what, sizeof what, "binary op %d (%s) gradient of a", op, td_dtype_name(dt));
      near_grad(what, ga, ca, 4 * eps);
      snprintf(what, sizeof what, "binary op %d (%s) gradient of b (sum of 33)", op,
               td_dtype_name(dt));
      near_grad(what, gb, cb, 8 * eps);
      td_tensor *all[] = {a, b, ca, ga, cb, gb, cy, gy};
      for (int i = 0; i < 8; i++) td_tensor_unref(all[i]);
    }
    for (int op = U_EXP; op <= U_AFFINE; op++) {
      int64_t sx[3] = {4, 17, 31};
      bool pos = op == U_LOG || op == U_SQRT;
      td_tensor *x = rnd(sx, 3, dt, 30 + (uint64_t)op, pos ? 0.1 : -3, 3), *cx, *gx;
      td_tensor *cy = NULL, *gy = NULL;
      leaf_pair(x, &cx, &gx);
      TD_ASSERT_OK(unary((un_op)op, cx, &cy));
      TD_ASSERT_OK(unary((un_op)op, gx, &gy));
      char what[96];
      snprintf(what, sizeof what, "unary op %d (%s)", op, td_dtype_name(dt));
      near(what, gy, cy, 2 * eps);
      backprop_weighted(cy, 31);
      backprop_weighted(gy, 31);
      snprintf(what, sizeof what, "unary op %d (%s) gradient", op, td_dtype_name(dt));
      near_grad(what, gx, cx, 4 * eps);
      td_tensor *all[] = {x, cx, gx, cy, gy};
      for (int i = 0; i < 5; i++) td_tensor_unref(all[i]);
    }
  }
}

/* ---- the 16-byte vector kernels (contiguous, 16-byte aligned, a multiple of 8 elements) ----
 * The shapes above (2145, 2108 elements) take the general kernels; [8, 96] takes the vector ones:
 * against the CPU as above, and against the general kernels (the same op on a transposed view)
 * bit for bit, since both do the same arithmetic per element. */

/* same_bits fails unless a (contiguous op) and b_t (the op on the transposed view, transposed
 * back) hold the same values. */
static void same_bits(const char *what, const td_tensor *a, const td_tensor *b_t) {
  td_tensor *b = NULL;
  TD_ASSERT_OK(td_tensor_transpose(b_t, 0, 1, &b));
  near(what, a, b, 0.0);
  td_tensor_unref(b);
}

static void test_lowp_vector_paths_match_cpu_and_general(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  int64_t sh[2] = {8, 96};
  const td_dtype dts[] = {BF16, F16, F32};
  for (int k = 0; k < 3; k++) {
    td_dtype dt = dts[k];
    double eps = dt == F32 ? 1e-6 : half_eps(dt);
    char what[112];
    /* add, sub, mul of same-shape operands */
    td_status (*fn[3])(const td_tensor *, const td_tensor *, td_tensor **) = {
        td_tensor_add, td_tensor_sub, td_tensor_mul};
    for (int op = 0; op < 3; op++) {
      td_tensor *a = rnd(sh, 2, dt, 41, 0.5, 2), *b = rnd(sh, 2, dt, 42, 0.5, 2);
      td_tensor *ga = on_gpu(a), *gb = on_gpu(b), *cy = NULL, *gy = NULL, *at = NULL, *bt = NULL;
      td_tensor *gyt = NULL;
      TD_ASSERT_OK(fn[op](a, b, &cy));
      TD_ASSERT_OK(fn[op](ga, gb, &gy));
      snprintf(what, sizeof what, "vector binary op %d (%s)", op, td_dtype_name(dt));
      near(what, gy, cy, 2 * eps);
      TD_ASSERT_OK(td_tensor_transpose(ga, 0, 1, &at));
      TD_ASSERT_OK(td_tensor_transpose(gb, 0, 1, &bt));
      TD_ASSERT_OK(fn[op](at, bt, &gyt));
      snprintf(what, sizeof what, "vector binary op %d (%s) vs the general kernel", op,
               td_dtype_name(dt));
      same_bits(what, gy, gyt);
      td_tensor *all[] = {a, b, ga, gb, cy, gy, at, bt, gyt};
      for (int i = 0; i < 9; i++) td_tensor_unref(all[i]);
    }
    if (dt == F32) {
      /* float32 <-> 16-bit copies: the CPU's bits both ways */
      const td_dtype hs[] = {BF16, F16};
      for (int h = 0; h < 2; h++) {
        td_tensor *x = rnd(sh, 2, F32, 43, -3, 3), *gx = on_gpu(x), *ch = NULL, *gh = NULL;
        td_tensor *cb = NULL, *gbk = NULL;
        TD_ASSERT_OK(td_tensor_to_dtype(x, hs[h], &ch));
        TD_ASSERT_OK(td_tensor_to_dtype(gx, hs[h], &gh));
        snprintf(what, sizeof what, "float32 -> %s, vector copy", td_dtype_name(hs[h]));
        near(what, gh, ch, 0.0);
        TD_ASSERT_OK(td_tensor_to_dtype(ch, F32, &cb));
        TD_ASSERT_OK(td_tensor_to_dtype(gh, F32, &gbk));
        snprintf(what, sizeof what, "%s -> float32, vector copy", td_dtype_name(hs[h]));
        near(what, gbk, cb, 0.0);
        td_tensor *all[] = {x, gx, ch, gh, cb, gbk};
        for (int i = 0; i < 6; i++) td_tensor_unref(all[i]);
      }
      continue;
    }
    /* unary ops and their backward */
    for (int op = U_EXP; op <= U_AFFINE; op++) {
      bool pos = op == U_LOG || op == U_SQRT;
      td_tensor *x = rnd(sh, 2, dt, 50 + (uint64_t)op, pos ? 0.1 : -3, 3), *cx, *gx;
      td_tensor *cy = NULL, *gy = NULL, *xt = NULL, *gyt = NULL;
      leaf_pair(x, &cx, &gx);
      TD_ASSERT_OK(unary((un_op)op, cx, &cy));
      TD_ASSERT_OK(unary((un_op)op, gx, &gy));
      snprintf(what, sizeof what, "vector unary op %d (%s)", op, td_dtype_name(dt));
      near(what, gy, cy, 2 * eps);
      TD_ASSERT_OK(td_tensor_transpose(gx, 0, 1, &xt));
      TD_ASSERT_OK(unary((un_op)op, xt, &gyt));
      snprintf(what, sizeof what, "vector unary op %d (%s) vs the general kernel", op,
               td_dtype_name(dt));
      same_bits(what, gy, gyt);
      td_tensor_unref(gyt);
      td_tensor_unref(xt);
      backprop_weighted(cy, 51);
      backprop_weighted(gy, 51);
      snprintf(what, sizeof what, "vector unary op %d (%s) gradient", op, td_dtype_name(dt));
      near_grad(what, gx, cx, 4 * eps);
      td_tensor *all[] = {x, cx, gx, cy, gy};
      for (int i = 0; i < 5; i++) td_tensor_unref(all[i]);
    }
  }
}

/* ---- reductions, softmax, layer norm, losses, embeddings in 16-bit dtypes ---- */

static void test_lowp_reductions_norms_losses_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {BF16, F16};
  for (int k = 0; k < 2; k++) {
    td_dtype dt = dts[k];
    double eps = half_eps(dt);
    char what[96];
    int64_t s[3] = {6, 300, 40};
    td_tensor *x = rnd(s, 3, dt, 41, 0, 0), *cx, *gx;
    leaf_pair(x, &cx, &gx);
    /* sums (float32 accumulation, one rounding) over each dim, and everything */
    for (int d = 0; d < 3; d++) {
      td_tensor *cy = NULL, *gy = NULL;
      TD_ASSERT_OK(td_tensor_sum(cx, &d, 1, false, &cy));
      TD_ASSERT_OK(td_tensor_sum(gx, &d, 1, false, &gy));
      snprintf(what, sizeof what, "sum over dim %d (%s)", d, td_dtype_name(dt));
      near(what, gy, cy, 2 * eps);
      td_tensor_unref(cy);
      td_tensor_unref(gy);
    }
    /* max with indices (exact) */
    {
      td_tensor *cy = NULL, *gy = NULL, *ci = NULL, *gi = NULL;
      TD_ASSERT_OK(td_tensor_max(cx, 1, false, &cy, &ci));
      TD_ASSERT_OK(td_tensor_max(gx, 1, false, &gy, &gi));
      snprintf(what, sizeof what, "max (%s)", td_dtype_name(dt));
      near(what, gy, cy, 0);
      near("argmax", gi, ci, 0);
      td_tensor *all[] = {cy, gy, ci, gi};
      for (int i = 0; i < 4; i++) td_tensor_unref(all[i]);
    }
    /* softmax / log_softmax over the last and the middle dim, with backward */
    for (int lg = 0; lg < 2; lg++)
      for (int dim = 1; dim <= 2; dim++) {
        td_tensor *cy = NULL, *gy = NULL;
        TD_ASSERT_OK(td_tensor_set_grad(cx, NULL));
        TD_ASSERT_OK(td_tensor_set_grad(gx, NULL));
        TD_ASSERT_OK((lg ? td_tensor_log_softmax : td_tensor_softmax)(cx, dim, &cy));
        TD_ASSERT_OK((lg ? td_tensor_log_softmax : td_tensor_softmax)(gx, dim, &gy));
        snprintf(what, sizeof what, "%s dim %d (%s)", lg ? "log_softmax" : "softmax", dim,
                 td_dtype_name(dt));
        near(what, gy, cy, 2 * eps);
        backprop_weighted(cy, 42);
        backprop_weighted(gy, 42);
        snprintf(what, sizeof what, "%s dim %d (%s) gradient", lg ? "log_softmax" : "softmax",
                 dim, td_dtype_name(dt));
        near_grad(what, gx, cx, 8 * eps);
        td_tensor_unref(cy);
        td_tensor_unref(gy);
      }
    /* layer norm over the last dim with weight and bias, with backward (sums over 240 rows) */
    {
      int64_t sw[1] = {40};
      td_tensor *w = rnd(sw, 1, dt, 43, 0.5, 1.5), *b = rnd(sw, 1, dt, 44, -1, 1);
      td_tensor *cw, *gw, *cb, *gb, *cy = NULL, *gy = NULL;
      leaf_pair(w, &cw, &gw);
      leaf_pair(b, &cb, &gb);
      TD_ASSERT_OK(td_tensor_set_grad(cx, NULL));
      TD_ASSERT_OK(td_tensor_set_grad(gx, NULL));
      TD_ASSERT_OK(td_tensor_layer_norm(cx, 1, cw, cb, 1e-5, &cy));
      TD_ASSERT_OK(td_tensor_layer_norm(gx, 1, gw, gb, 1e-5, &gy));
      snprintf(what, sizeof what, "layer_norm (%s)", td_dtype_name(dt));
      near(what, gy, cy, 4 * eps);
      backprop_weighted(cy, 45);
      backprop_weighted(gy, 45);
      snprintf(what, sizeof what, "layer_norm (%s) gradient of x", td_dtype_name(dt));
      near_grad(what, gx, cx, 8 * eps);
      snprintf(what, sizeof what, "layer_norm (%s) gradient of w (1800 rows)", td_dtype_name(dt));
      near_grad(what, gw, cw, 16 * eps);
      snprintf(what, sizeof what, "layer_norm (%s) gradient of b (1800 rows)", td_dtype_name(dt));
      near_grad(what, gb, cb, 16 * eps);
      td_tensor *all[] = {w, b, cw, gw, cb, gb, cy, gy};
      for (int i = 0; i < 8; i++) td_tensor_unref(all[i]);
    }
    /* cross entropy of 16-bit logits (ignore_index included), with backward */
    {
      int64_t sl[2] = {37, 1000}, st[1] = {37};
      td_tensor *l = rnd(sl, 2, dt, 46, 0, 0), *cl, *gl, *cy = NULL, *gy = NULL;
      double tv[37];
      for (int i = 0; i < 37; i++) tv[i] = i == 5 ? -100 : (double)((i * 271) % 1000);
      td_tensor *ct = td_test_tensor(tv, st, 1, I64, false), *gt = on_gpu(ct);
      leaf_pair(l, &cl, &gl);
      TD_ASSERT_OK(td_tensor_cross_entropy(cl, ct, TD_REDUCTION_MEAN, -100, &cy));
      TD_ASSERT_OK(td_tensor_cross_entropy(gl, gt, TD_REDUCTION_MEAN, -100, &gy));
      snprintf(what, sizeof what, "cross_entropy (%s logits)", td_dtype_name(dt));
      near(what, gy, cy, 4 * eps);
      TD_ASSERT_OK(td_tensor_backward(cy));
      TD_ASSERT_OK(td_tensor_backward(gy));
      snprintf(what, sizeof what, "cross_entropy (%s logits) gradient", td_dtype_name(dt));
      near_grad(what, gl, cl, 4 * eps);
      td_tensor *all[] = {l, cl, gl, cy, gy, ct, gt};
      for (int i = 0; i < 7; i++) td_tensor_unref(all[i]);
    }
    /* embedding of a 16-bit table and its backward (index_add through float32) */
    {
      int64_t sw[2] = {50, 24}, si[2] = {3, 9};
      double iv[27];
      for (int i = 0; i < 27; i++) iv[i] = (double)((i * 7) % 11 + (i % 3) * 13);
      td_tensor *w = rnd(sw, 2, dt, 47, 0, 0), *cw, *gw, *cy = NULL, *gy = NULL;
      td_tensor *ci = td_test_tensor(iv, si, 2, I64, false), *gi = on_gpu(ci);
      leaf_pair(w, &cw, &gw);
      TD_ASSERT_OK(td_tensor_embedding(cw, ci, &cy));
      TD_ASSERT_OK(td_tensor_embedding(gw, gi, &gy));
      snprintf(what, sizeof what, "embedding (%s)", td_dtype_name(dt));
      near(what, gy, cy, 0);
      backprop_weighted(cy, 48);
      backprop_weighted(gy, 48);
      snprintf(what, sizeof what, "embedding (%s) gradient (repeated ids)", td_dtype_name(dt));
      near_grad(what, gw, cw, 4 * eps);
      td_tensor *all[] = {w, cw, gw, cy, gy, ci, gi};
      for (int i = 0; i < 7; i++) td_tensor_unref(all[i]);
    }
    td_tensor_unref(x);
    td_tensor_unref(cx);
    td_tensor_unref(gx);
  }
}

/* ---- the fused cross entropy (float32 / float64 logits; 16-bit ones under autocast) ---- */

static void ce_case(td_dtype dt, bool autocast, td_reduction red, int64_t n, int64_t c,
                    double tol) {
  int64_t sl[2] = {n, c}, st1[1] = {n};
  td_tensor *l = rnd(sl, 2, dt, 120, -4, 4), *cl, *gl, *cy = NULL, *gy = NULL;
  double *tv = malloc((size_t)n * sizeof *tv);
  for (int64_t i = 0; i < n; i++) tv[i] = i % 7 == 3 ? -1 : (double)((i * 7919) % c);
  td_tensor *ct = td_test_tensor(tv, st1, 1, I64, false), *gt = on_gpu(ct);
  free(tv);
  leaf_pair(l, &cl, &gl);
  if (autocast) TD_ASSERT_OK(td_autocast_begin(dt));
  TD_ASSERT_OK(td_tensor_cross_entropy(cl, ct, red, -1, &cy));
  TD_ASSERT_OK(td_tensor_cross_entropy(gl, gt, red, -1, &gy));
  if (autocast) td_autocast_end();
  char what[128];
  snprintf(what, sizeof what, "cross_entropy (%s%s, reduction %d, %lld x %lld)",
           td_dtype_name(dt), autocast ? " under autocast" : "", (int)red, (long long)n,
           (long long)c);
  near(what, gy, cy, tol);
  backprop_weighted(cy, 121);
  backprop_weighted(gy, 121);
  char gw[160];
  snprintf(gw, sizeof gw, "%s gradient", what);
  near_grad(gw, gl, cl, dt == F32 ? 1e-5 : dt == F64 ? 1e-12 : 2 * half_eps(dt));
  td_tensor *all[] = {l, cl, gl, cy, gy, ct, gt};
  for (int i = 0; i < 7; i++) td_tensor_unref(all[i]);
}

static void test_fused_cross_entropy_matches_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_reduction reds[] = {TD_REDUCTION_MEAN, TD_REDUCTION_SUM, TD_REDUCTION_NONE};
  for (int r = 0; r < 3; r++) {
    ce_case(F32, false, reds[r], 67, 50304, 1e-5); /* GPT-2's vocabulary: long rows */
    ce_case(F32, false, reds[r], 300, 5, 1e-5);    /* short rows, more rows than threads */
    ce_case(F64, false, reds[r], 33, 1000, 1e-12);
    ce_case(BF16, true, reds[r], 67, 50304, 1e-5); /* float32 inside: the CPU's autocast path */
    ce_case(F16, true, reds[r], 40, 777, 1e-5);
  }
  /* an out-of-range target fails as on the CPU, naming it */
  int64_t sl[2] = {4, 10}, st1[1] = {4};
  const double tv[4] = {1, 2, 10, 3};
  td_tensor *l = rnd(sl, 2, F32, 122, 0, 0), *g = on_gpu(l), *y = NULL;
  td_tensor *t = td_test_tensor(tv, st1, 1, I64, false), *tg = on_gpu(t);
  td_status st = td_tensor_cross_entropy(g, tg, TD_REDUCTION_MEAN, -100, &y);
  if (st != TD_ERR_INVALID || !strstr(td_last_error(), "target 10"))
    fail_msg("a target of 10 for 10 classes gave %s (%s)", td_status_name(st), td_last_error());
  td_tensor_unref(l);
  td_tensor_unref(g);
  td_tensor_unref(t);
  td_tensor_unref(tg);
}

/* ---- GEMMs: cuBLASLt (one matrix) and cublasGemmStridedBatchedEx (batches) ---- */

static void test_lowp_matmul_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {BF16, F16};
  for (int k = 0; k < 2; k++) {
    td_dtype dt = dts[k];
    double eps = half_eps(dt);
    char what[128];
    /* shapes: odd sizes, aligned sizes, batches, broadcast batches */
    struct {
      int nda, ndb;
      int64_t a[3], b[3];
      bool ta, tb;
    } cases[] = {
        {2, 2, {67, 33}, {33, 45}, false, false},
        {2, 2, {128, 64}, {64, 256}, false, false},
        {2, 2, {33, 67}, {33, 45}, true, false},   /* a^T: a read transposed */
        {2, 2, {67, 33}, {45, 33}, false, true},   /* b^T */
        {3, 3, {3, 20, 48}, {3, 48, 16}, false, false},
        {3, 2, {4, 17, 32}, {32, 24}, false, false}, /* b broadcast over the batch */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
      td_tensor *a = rnd(cases[c].a, cases[c].nda, dt, 51 + c, 0, 0);
      td_tensor *b = rnd(cases[c].b, cases[c].ndb, dt, 61 + c, 0, 0);
      td_tensor *ca, *ga, *cb, *gb, *cat = NULL, *gat = NULL, *cbt = NULL, *gbt = NULL;
      td_tensor *cy = NULL, *gy = NULL;
      leaf_pair(a, &ca, &ga);
      leaf_pair(b, &cb, &gb);
      if (cases[c].ta) {
        TD_ASSERT_OK(td_tensor_transpose(ca, 0, 1, &cat));
        TD_ASSERT_OK(td_tensor_transpose(ga, 0, 1, &gat));
      } else {
        cat = td_tensor_ref(ca), gat = td_tensor_ref(ga);
      }
      if (cases[c].tb) {
        TD_ASSERT_OK(td_tensor_transpose(cb, 0, 1, &cbt));
        TD_ASSERT_OK(td_tensor_transpose(gb, 0, 1, &gbt));
      } else {
        cbt = td_tensor_ref(cb), gbt = td_tensor_ref(gb);
      }
      TD_ASSERT_OK(td_tensor_matmul(cat, cbt, &cy));
      TD_ASSERT_OK(td_tensor_matmul(gat, gbt, &gy));
      int64_t kdim = td_tensor_size(cat, -1);
      snprintf(what, sizeof what, "matmul case %zu (%s, k = %lld)", c, td_dtype_name(dt),
               (long long)kdim);
      near(what, gy, cy, 4 * eps);
      backprop_weighted(cy, 70 + c);
      backprop_weighted(gy, 70 + c);
      snprintf(what, sizeof what, "matmul case %zu (%s) gradient of a", c, td_dtype_name(dt));
      near_grad(what, ga, ca, 4 * eps);
      snprintf(what, sizeof what, "matmul case %zu (%s) gradient of b", c, td_dtype_name(dt));
      near_grad(what, gb, cb, 4 * eps);
      td_tensor *all[] = {a, b, ca, ga, cb, gb, cat, gat, cbt, gbt, cy, gy};
      for (int i = 0; i < 12; i++) td_tensor_unref(all[i]);
    }
    /* Linear with a bias (the output starts as the bias: beta 1), on an input that starts one
     * element into its storage (a 2-byte aligned pointer: cuBLASLt told the real alignment) */
    {
      int64_t sx[1] = {31 * 96 + 1}, sw[2] = {40, 96}, sb[1] = {40}, s2[2] = {31, 96};
      td_tensor *xs = rnd(sx, 1, dt, 81, 0, 0), *w = rnd(sw, 2, dt, 82, 0, 0);
      td_tensor *b = rnd(sb, 1, dt, 83, 0, 0), *cxs, *gxs, *cw, *gw, *cb, *gb;
      td_tensor *cx = NULL, *gx = NULL, *cy = NULL, *gy = NULL, *cn = NULL, *gn = NULL;
      leaf_pair(xs, &cxs, &gxs);
      leaf_pair(w, &cw, &gw);
      leaf_pair(b, &cb, &gb);
      /* x: a contiguous [31, 96] view starting at element 1 of its storage */
      TD_ASSERT_OK(td_tensor_narrow(cxs, 0, 1, 31 * 96, &cn));
      TD_ASSERT_OK(td_tensor_narrow(gxs, 0, 1, 31 * 96, &gn));
      TD_ASSERT_OK(td_tensor_reshape(cn, s2, 2, &cx));
      TD_ASSERT_OK(td_tensor_reshape(gn, s2, 2, &gx));
      td_tensor_unref(cn);
      td_tensor_unref(gn);
      TD_ASSERT_OK(td_tensor_linear(cx, cw, cb, &cy));
      TD_ASSERT_OK(td_tensor_linear(gx, gw, gb, &gy));
      snprintf(what, sizeof what, "linear with bias, unaligned input (%s)", td_dtype_name(dt));
      near(what, gy, cy, 4 * eps);
      backprop_weighted(cy, 84);
      backprop_weighted(gy, 84);
      snprintf(what, sizeof what, "linear (%s) gradient of x", td_dtype_name(dt));
      near_grad(what, gxs, cxs, 4 * eps);
      snprintf(what, sizeof what, "linear (%s) gradient of w", td_dtype_name(dt));
      near_grad(what, gw, cw, 4 * eps);
      snprintf(what, sizeof what, "linear (%s) gradient of b (31 rows)", td_dtype_name(dt));
      near_grad(what, gb, cb, 4 * eps);
      td_tensor *all[] = {xs, w, b, cxs, gxs, cw, gw, cb, gb, cx, gx, cy, gy};
      for (int i = 0; i < 13; i++) td_tensor_unref(all[i]);
    }
  }
}

/* ---- attention ---- */

typedef struct {
  int64_t B, H, L, S, E, Ev;
  bool causal, packed; /* packed: q, k, v are [B, H, T, hd] views of one [B, T, 3, H, hd] */
} attn_case;

/* make_qkv returns q, k, v leaves on the CPU (cq...) and CUDA (gq...) plus the packed bases. */
typedef struct {
  td_tensor *cbase, *gbase; /* the packed projection (the leaf), or NULL */
  td_tensor *c[3], *g[3];   /* q, k, v (leaves, or views of the base) */
} qkv;

static void make_qkv(const attn_case *a, td_dtype dt, uint64_t seed, qkv *o) {
  memset(o, 0, sizeof *o);
  if (a->packed) { /* L == S, E == Ev */
    int64_t s5[5] = {a->B, a->L, 3, a->H, a->E};
    td_tensor *p = rnd(s5, 5, dt, seed, 0, 0);
    leaf_pair(p, &o->cbase, &o->gbase);
    td_tensor_unref(p);
    for (int d = 0; d < 2; d++) {
      td_tensor *base = d ? o->gbase : o->cbase, *parts[3];
      TD_ASSERT_OK(td_tensor_unbind(base, 2, parts));
      for (int i = 0; i < 3; i++) {
        TD_ASSERT_OK(td_tensor_transpose(parts[i], 1, 2, d ? &o->g[i] : &o->c[i]));
        td_tensor_unref(parts[i]);
      }
    }
    return;
  }
  int64_t sq[4] = {a->B, a->H, a->L, a->E}, sk[4] = {a->B, a->H, a->S, a->E};
  int64_t sv[4] = {a->B, a->H, a->S, a->Ev};
  const int64_t *sh[3] = {sq, sk, sv};
  for (int i = 0; i < 3; i++) {
    td_tensor *t = rnd(sh[i], 4, dt, seed + (uint64_t)i, 0, 0);
    leaf_pair(t, &o->c[i], &o->g[i]);
    td_tensor_unref(t);
  }
}

static void free_qkv(qkv *o) {
  td_tensor_unref(o->cbase);
  td_tensor_unref(o->gbase);
  for (int i = 0; i < 3; i++) {
    td_tensor_unref(o->c[i]);
    td_tensor_unref(o->g[i]);
  }
}

/* attention_case runs one case forward and backward on both devices (CUDA with the current
 * TD_CUDA_ATTENTION setting) and compares output and gradients within tol. */
static void attention_case(const attn_case *a, td_dtype dt, double tol, const char *path) {
  qkv o;
  make_qkv(a, dt, 90, &o);
  td_tensor *cy = NULL, *gy = NULL;
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(o.c[0], o.c[1], o.c[2], a->causal, NAN, &cy));
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(o.g[0], o.g[1], o.g[2], a->causal, NAN, &gy));
  char what[192];
  snprintf(what, sizeof what, "attention %s (%s, B %lld H %lld L %lld S %lld E %lld Ev %lld%s%s)",
           path, td_dtype_name(dt), (long long)a->B, (long long)a->H, (long long)a->L,
           (long long)a->S, (long long)a->E, (long long)a->Ev, a->causal ? ", causal" : "",
           a->packed ? ", packed" : "");
  near(what, gy, cy, tol);
  backprop_weighted(cy, 91);
  backprop_weighted(gy, 91);
  char gw[224];
  if (a->packed) {
    snprintf(gw, sizeof gw, "%s: gradient of the packed q, k, v", what);
    near_grad(gw, o.gbase, o.cbase, tol);
  } else {
    const char *nm[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
      snprintf(gw, sizeof gw, "%s: gradient of %s", what, nm[i]);
      near_grad(gw, o.g[i], o.c[i], tol);
    }
  }
  td_tensor_unref(cy);
  td_tensor_unref(gy);
  free_qkv(&o);
}

static const attn_case attn_cases[] = {
    {2, 3, 37, 37, 16, 24, true, false},  /* general kernels: odd sizes, E != Ev */
    {1, 2, 20, 45, 40, 8, false, false},  /* L < S, no mask */
    {2, 2, 50, 30, 64, 64, true, false},  /* causal with L > S */
    {2, 3, 130, 130, 64, 64, true, true}, /* GPT's layout: head 64, partial tiles */
    {1, 2, 96, 160, 64, 64, false, false},
};
#define N_ATTN (sizeof attn_cases / sizeof attn_cases[0])

static void test_attention_f32_f64_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  for (size_t i = 0; i < N_ATTN; i++) {
    attention_case(&attn_cases[i], F32, 1e-5, "general");
    attention_case(&attn_cases[i], F64, 1e-12, "general");
  }
}

/* 16-bit attention: the tensor-core kernels (head 64, aligned rows) and the general ones
 * (TD_CUDA_ATTENTION=simt) each against the CPU (float32 inside, rounded once); the tensor-core
 * kernels also round the probabilities and score gradients to the dtype before their products,
 * hence a few units of rounding on top. */
static void test_attention_16bit_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {BF16, F16};
  for (int k = 0; k < 2; k++) {
    double eps = half_eps(dts[k]);
    for (size_t i = 0; i < N_ATTN; i++) {
      unsetenv("TD_CUDA_ATTENTION");
      attention_case(&attn_cases[i], dts[k], 8 * eps, "default kernels");
      setenv("TD_CUDA_ATTENTION", "simt", 1);
      attention_case(&attn_cases[i], dts[k], 4 * eps, "general kernels");
      unsetenv("TD_CUDA_ATTENTION");
    }
  }
}

/* ---- the optimizer: multi-tensor AdamW, clipping ---- */

static void adamw_run(td_device dev, td_dtype dt, int n, td_tensor **params, double *norms) {
  const int64_t sizes[] = {1, 7, 100003, 4096, 3, 65};
  for (int i = 0; i < n; i++) {
    int64_t s = sizes[i % 6] + i;
    td_tensor *p = rnd(&s, 1, dt, 100 + (uint64_t)i, 0, 0);
    TD_ASSERT_OK(td_tensor_to(p, dev, &params[i]));
    td_tensor_unref(p);
    TD_ASSERT_OK(td_tensor_set_requires_grad(params[i], true));
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_ADAMW);
  oo.lr = 1e-2;
  oo.weight_decay = 0.1;
  td_optim_group g[2];
  td_optim_group_init(&g[0], params, (size_t)n / 2);
  td_optim_group_init(&g[1], params + n / 2, (size_t)(n - n / 2));
  g[1].weight_decay = 0.0;
  g[1].lr = 3e-3;
  td_optim *opt;
  TD_ASSERT_OK(td_optim_create_groups(&oo, g, 2, &opt));
  for (int step = 0; step < 3; step++) {
    td_optim_zero_grad(opt);
    for (int i = 0; i < n; i++) {
      int64_t s = td_tensor_numel(params[i]);
      td_tensor *gr = rnd(&s, 1, dt, 500 + 31 * (uint64_t)step + (uint64_t)i, 0, 0), *gd = NULL;
      TD_ASSERT_OK(td_tensor_to(gr, dev, &gd));
      TD_ASSERT_OK(td_tensor_set_grad(params[i], gd));
      td_tensor_unref(gr);
      td_tensor_unref(gd);
    }
    TD_ASSERT_OK(td_optim_clip_grad_norm(opt, 50.0, 2.0, &norms[step]));
    TD_ASSERT_OK(td_optim_step(opt));
  }
  td_optim_destroy(opt);
}

static void test_adamw_multi_and_clip_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  const td_dtype dts[] = {F32, F64};
  for (int k = 0; k < 2; k++) {
    enum { N = 30 }; /* more than one launch's worth of parameters */
    td_tensor *cp[N], *gp[N];
    double cn[3], gn[3];
    adamw_run(td_device_cpu(), dts[k], N, cp, cn);
    adamw_run(cuda0(), dts[k], N, gp, gn);
    double tol = dts[k] == F32 ? 1e-5 : 1e-12;
    for (int s = 0; s < 3; s++)
      if (fabs(cn[s] - gn[s]) > tol * cn[s])
        fail_msg("clip_grad_norm (%s) step %d: %.12g on CUDA, %.12g on the CPU",
                 td_dtype_name(dts[k]), s, gn[s], cn[s]);
    for (int i = 0; i < N; i++) {
      char what[64];
      snprintf(what, sizeof what, "AdamW parameter %d (%s)", i, td_dtype_name(dts[k]));
      near(what, gp[i], cp[i], tol);
      td_tensor_unref(cp[i]);
      td_tensor_unref(gp[i]);
    }
  }
}

static void test_sum_squares_match_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  enum { N = 40 };
  td_tensor *c[N], *g[N];
  const td_dtype dts[] = {F32, BF16, F64, F16};
  for (int i = 0; i < N; i++) {
    int64_t s[2] = {3 + i, 17 * (i % 5) + 1};
    td_tensor *t = rnd(s, 2, dts[i % 4], 700 + (uint64_t)i, 0, 0);
    if (i == 7) { /* a transposed view: made contiguous first */
      TD_ASSERT_OK(td_tensor_transpose(t, 0, 1, &c[i]));
    } else {
      c[i] = td_tensor_ref(t);
    }
    g[i] = on_gpu(c[i]);
    if (i == 7) {
      td_tensor *v = NULL;
      TD_ASSERT_OK(td_tensor_transpose(g[i], 0, 1, &v));
      td_tensor_unref(g[i]);
      td_tensor *gt = on_gpu(t);
      TD_ASSERT_OK(td_tensor_transpose(gt, 0, 1, &g[i]));
      td_tensor_unref(gt);
      td_tensor_unref(v);
    }
    td_tensor_unref(t);
  }
  /* the reference: every element in double on the host (the CPU's composed path would round
   * each 16-bit tensor's sum to its dtype) */
  double cs = 0, gs = 0;
  for (int i = 0; i < N; i++) {
    td_tensor *h = host64(c[i]), *hc = NULL;
    TD_ASSERT_OK(td_tensor_contiguous(h, &hc));
    const double *x = td_tensor_data(hc);
    for (int64_t j = 0; j < td_tensor_numel(hc); j++) cs += x[j] * x[j];
    td_tensor_unref(h);
    td_tensor_unref(hc);
  }
  TD_ASSERT_OK(td_tensor_sum_squares((const td_tensor *const *)g, N, &gs));
  if (!(fabs(cs - gs) <= 1e-12 * cs))
    fail_msg("sum of squares: %.15g on CUDA, %.15g in double on the host", gs, cs);
  for (int i = 0; i < N; i++) {
    td_tensor_unref(c[i]);
    td_tensor_unref(g[i]);
  }
}

static void test_cuda_memory_peak_and_name(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  char name[128];
  TD_ASSERT_OK(td_cuda_device_name(0, name, sizeof name));
  assert_true(strlen(name) > 0);
  print_message("cuda:0 is %s\n", name);
  size_t p0 = 0, p1 = 0, p2 = 0;
  TD_ASSERT_OK(td_cuda_memory_peak(0, true, &p0));
  int64_t s = 64 << 20; /* 256 MiB of float32 */
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_zeros(&s, 1, F32, cuda0(), &t));
  TD_ASSERT_OK(td_cuda_memory_peak(0, false, &p1));
  td_tensor_unref(t);
  TD_ASSERT_OK(td_cuda_memory_peak(0, true, &p2)); /* still the peak, then reset */
  size_t p3 = 0;
  TD_ASSERT_OK(td_cuda_memory_peak(0, false, &p3));
  if (p1 < (size_t)s * 4 || p2 != p1 || p3 >= p1)
    fail_msg("peaks: %zu after a 256 MiB tensor, %zu after freeing it, %zu after the reset", p1,
             p2, p3);
}

/* ---- a small GPT on both devices ---- */

typedef struct {
  td_module *m;
  td_optim *opt;
  td_tensor *x, *y;
} gpt_run;

static void gpt_setup(gpt_run *r, td_device dev, td_dtype ac, int64_t n_embd, int n_head) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = 67, c.block_size = 48, c.n_layer = 2, c.n_head = n_head, c.n_embd = n_embd;
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(7, &g));
  TD_ASSERT_OK(td_gpt_create(&c, g, &r->m));
  if (dev.type == TD_DEVICE_CUDA) TD_ASSERT_OK(td_module_to(r->m, dev));
  if (ac != F32) TD_ASSERT_OK(td_module_set_autocast(r->m, true, ac));
  int64_t s[2] = {3, 48};
  td_tensor *hx, *hy;
  TD_ASSERT_OK(td_tensor_empty(s, 2, I64, td_device_cpu(), &hx));
  TD_ASSERT_OK(td_tensor_empty(s, 2, I64, td_device_cpu(), &hy));
  int64_t *px = td_tensor_data(hx), *py = td_tensor_data(hy);
  for (int i = 0; i < 3 * 48; i++) px[i] = (int64_t)(td_generator_next_u64(g) % 67);
  for (int i = 0; i < 3 * 48; i++) py[i] = (px[i] * 5 + 3) % 67; /* a learnable map */
  TD_ASSERT_OK(td_tensor_to(hx, dev, &r->x));
  TD_ASSERT_OK(td_tensor_to(hy, dev, &r->y));
  td_tensor_unref(hx);
  td_tensor_unref(hy);
  td_generator_destroy(g);
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  TD_ASSERT_OK(td_module_parameters(r->m, &ps));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_ADAMW);
  oo.lr = 3e-3;
  oo.weight_decay = 0.1;
  TD_ASSERT_OK(td_optim_create(&oo, ps.tensors, ps.n, &r->opt));
  td_tensor_list_fini(&ps);
}

static void gpt_free(gpt_run *r) {
  td_optim_destroy(r->opt);
  td_module_unref(r->m);
  td_tensor_unref(r->x);
  td_tensor_unref(r->y);
}

static double gpt_step(gpt_run *r) {
  td_tensor *logits, *loss;
  td_optim_zero_grad(r->opt);
  TD_ASSERT_OK(td_gpt_forward(r->m, r->x, r->y, &logits, &loss));
  TD_ASSERT_OK(td_tensor_backward(loss));
  double norm = 0, v = NAN;
  TD_ASSERT_OK(td_optim_clip_grad_norm(r->opt, 1.0, 2.0, &norm));
  TD_ASSERT_OK(td_optim_step(r->opt));
  TD_ASSERT_OK(td_tensor_item(loss, &v));
  td_tensor_unref(logits);
  td_tensor_unref(loss);
  return v;
}

/* gpt_train_case: the first step's gradients (float32) and every step's loss. */
static void gpt_train_case(td_dtype ac, int64_t n_embd, int n_head, double loss_tol) {
  gpt_run c, g;
  gpt_setup(&c, td_device_cpu(), ac, n_embd, n_head);
  gpt_setup(&g, cuda0(), ac, n_embd, n_head);
  if (ac == F32) { /* the gradients of the first forward / backward */
    td_tensor *l1, *l2, *o1, *o2;
    TD_ASSERT_OK(td_gpt_forward(c.m, c.x, c.y, &o1, &l1));
    TD_ASSERT_OK(td_gpt_forward(g.m, g.x, g.y, &o2, &l2));
    near("GPT logits (float32)", o2, o1, 1e-4);
    TD_ASSERT_OK(td_tensor_backward(l1));
    TD_ASSERT_OK(td_tensor_backward(l2));
    td_tensor_list pc, pg;
    td_tensor_list_init(&pc);
    td_tensor_list_init(&pg);
    TD_ASSERT_OK(td_module_parameters(c.m, &pc));
    TD_ASSERT_OK(td_module_parameters(g.m, &pg));
    assert_int_equal(pc.n, pg.n);
    for (size_t i = 0; i < pc.n; i++) {
      char what[64];
      snprintf(what, sizeof what, "GPT parameter %zu gradient (float32)", i);
      near_grad(what, pg.tensors[i], pc.tensors[i], 1e-4);
    }
    td_tensor_list_fini(&pc);
    td_tensor_list_fini(&pg);
    td_tensor *all[] = {l1, l2, o1, o2};
    for (int i = 0; i < 4; i++) td_tensor_unref(all[i]);
  }
  for (int step = 0; step < 8; step++) {
    double lc = gpt_step(&c), lg = gpt_step(&g);
    print_message("GPT (%s, width %lld, %d heads) step %d: loss %.6f on the CPU, %.6f on CUDA\n",
                  td_dtype_name(ac), (long long)n_embd, n_head, step, lc, lg);
    if (!(fabs(lc - lg) <= loss_tol * fabs(lc)))
      fail_msg("GPT (%s) step %d: loss %.8g on CUDA, %.8g on the CPU (relative tolerance %g)",
               td_dtype_name(ac), step, lg, lc, loss_tol);
  }
  gpt_free(&c);
  gpt_free(&g);
}

static void test_gpt_training_matches_cpu(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  gpt_train_case(F32, 128, 2, 1e-4);  /* head 64 */
  gpt_train_case(F32, 48, 3, 1e-4);   /* head 16: the general attention kernels */
  gpt_train_case(BF16, 128, 2, 2e-2); /* tensor-core attention, cuBLASLt GEMMs */
  gpt_train_case(F16, 128, 2, 2e-2);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lowp_conversions_match_cpu_bits),
      cmocka_unit_test(test_lowp_strided_copy_and_fill_match_cpu),
      cmocka_unit_test(test_lowp_elementwise_match_cpu),
      cmocka_unit_test(test_lowp_vector_paths_match_cpu_and_general),
      cmocka_unit_test(test_lowp_reductions_norms_losses_match_cpu),
      cmocka_unit_test(test_fused_cross_entropy_matches_cpu),
      cmocka_unit_test(test_lowp_matmul_match_cpu),
      cmocka_unit_test(test_attention_f32_f64_match_cpu),
      cmocka_unit_test(test_attention_16bit_match_cpu),
      cmocka_unit_test(test_adamw_multi_and_clip_match_cpu),
      cmocka_unit_test(test_sum_squares_match_cpu),
      cmocka_unit_test(test_cuda_memory_peak_and_name),
      cmocka_unit_test(test_gpt_training_matches_cpu),
  };
  int failed = cmocka_run_group_tests_name("cuda_gpt", tests, NULL, NULL);
  if (failed) return 1;
  return td_cuda_device_count() == 0 ? 77 : 0;
}
