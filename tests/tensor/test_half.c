/* test_half.c - bfloat16 and float16 arithmetic on the CPU, and autocast.
 *
 * The kernels' contract (tensor.h): a 16-bit op computes in float32 and rounds once. So on
 * inputs that both dtypes represent, an elementwise op, a sum, softmax, layer norm or attention's
 * forward in bfloat16 must equal the float32 op's result rounded to bfloat16, bit for bit; GEMMs
 * accumulate in float32 in another order (oneDNN), so they are compared within an ulp or two.
 * Autocast: which ops compute in 16 bits and which in float32, differentiable casts, the weight
 * cache (one cast per weight per scope), backward ignoring the scope, nesting and errors.
 */
#include <math.h>
#include <string.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "test_util.h"

#define TRY(e)                           \
  do {                                   \
    td_status try_st_ = (e);             \
    if (try_st_ != TD_OK) return try_st_; \
  } while (0)

/* grad returns t's gradient (td_tensor_grad's new reference), released by grads_release. */
static td_tensor *kept[256];
static int nkept;
static td_tensor *grad(const td_tensor *t) {
  td_tensor *g = td_tensor_grad(t);
  assert_true(nkept < 256);
  if (g) kept[nkept++] = g;
  return g;
}
static int grads_release(void **state) {
  (void)state;
  while (nkept) td_tensor_unref(kept[--nkept]);
  return 0;
}

static const td_dtype halves[] = {TD_DTYPE_BF16, TD_DTYPE_F16};

/* A float32 tensor whose values the 16-bit dtype dt represents exactly (random, rounded). */
static td_tensor *rep(const int64_t *shape, int nd, td_dtype dt, uint64_t seed, double scale) {
  td_tensor *r = td_test_randn(shape, nd, TD_DTYPE_F32, seed, false), *h = NULL, *f = NULL;
  TD_ASSERT_OK(td_tensor_mul_scalar_(r, scale));
  TD_ASSERT_OK(td_tensor_to_dtype(r, dt, &h));
  TD_ASSERT_OK(td_tensor_to_dtype(h, TD_DTYPE_F32, &f));
  td_tensor_unref(h), td_tensor_unref(r);
  return f;
}

static td_tensor *to(const td_tensor *t, td_dtype dt) {
  td_tensor *r = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(t, dt, &r));
  return r;
}

/* Fails unless h (16-bit) holds exactly ref (float32) rounded to h's dtype. */
static void assert_rounded(const char *what, const td_tensor *h, const td_tensor *ref) {
  assert_int_equal(td_tensor_dtype(ref), TD_DTYPE_F32);
  td_tensor *r = to(ref, td_tensor_dtype(h));
  bool same = false;
  TD_ASSERT_OK(td_tensor_allclose(h, r, 0, 0, &same));
  if (!same) td_test_assert_close(what, h, r, 0, 0); /* names the worst element */
  td_tensor_unref(r);
}

typedef td_status (*bin_fn)(const td_tensor *, const td_tensor *, td_tensor **);

/* Binary ops with broadcasting and strided operands equal float32's, rounded. */
static void test_half_binary_equals_rounded_float32(void **state) {
  (void)state;
  bin_fn fns[] = {td_tensor_add, td_tensor_sub, td_tensor_mul, td_tensor_div, td_tensor_maximum};
  const char *names[] = {"add", "sub", "mul", "div", "maximum"};
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    int64_t sa[2] = {37, 700}, sb[1] = {700}, sc[2] = {700, 37};
    td_tensor *a = rep(sa, 2, dt, 1, 1.0), *b = rep(sb, 1, dt, 2, 1.0), *c = rep(sc, 2, dt, 3, 1.0);
    td_tensor *ct = NULL;
    TD_ASSERT_OK(td_tensor_transpose(c, 0, 1, &ct)); /* [37, 700], strided */
    td_tensor *ah = to(a, dt), *bh = to(b, dt), *cth = NULL, *ch = to(c, dt);
    TD_ASSERT_OK(td_tensor_transpose(ch, 0, 1, &cth));
    for (int i = 0; i < 5; i++) {
      td_tensor *rf = NULL, *rh = NULL;
      TD_ASSERT_OK(fns[i](a, b, &rf)); /* broadcast operand */
      TD_ASSERT_OK(fns[i](ah, bh, &rh));
      assert_int_equal(td_tensor_dtype(rh), dt);
      assert_rounded(names[i], rh, rf);
      td_tensor_unref(rf), td_tensor_unref(rh);
      TD_ASSERT_OK(fns[i](ct, a, &rf)); /* strided operand */
      TD_ASSERT_OK(fns[i](cth, ah, &rh));
      assert_rounded(names[i], rh, rf);
      td_tensor_unref(rf), td_tensor_unref(rh);
    }
    td_tensor_unref(cth), td_tensor_unref(ch), td_tensor_unref(bh), td_tensor_unref(ah);
    td_tensor_unref(ct), td_tensor_unref(c), td_tensor_unref(b), td_tensor_unref(a);
  }
}

typedef td_status (*un_fn)(const td_tensor *, td_tensor **);

/* Unary ops and their backward through autograd equal float32's, rounded. */
static void test_half_unary_and_backward_equal_rounded_float32(void **state) {
  (void)state;
  un_fn fns[] = {td_tensor_relu, td_tensor_gelu, td_tensor_tanh, td_tensor_sigmoid, td_tensor_exp};
  const char *names[] = {"relu", "gelu", "tanh", "sigmoid", "exp"};
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    int64_t s[2] = {3, 1000};
    td_tensor *x = rep(s, 2, dt, 4, 2.0), *gy = rep(s, 2, dt, 5, 1.0);
    for (int i = 0; i < 5; i++) {
      td_tensor *xf = NULL;
      TD_ASSERT_OK(td_tensor_clone(x, &xf));
      td_tensor *xh = to(x, dt), *gyh = to(gy, dt);
      TD_ASSERT_OK(td_tensor_set_requires_grad(xf, true));
      TD_ASSERT_OK(td_tensor_set_requires_grad(xh, true));
      td_tensor *yf = NULL, *yh = NULL;
      TD_ASSERT_OK(fns[i](xf, &yf));
      TD_ASSERT_OK(fns[i](xh, &yh));
      assert_rounded(names[i], yh, yf);
      /* backward from the same (representable) upstream gradient, rounded on the 16-bit side */
      TD_ASSERT_OK(td_autograd_backward(&yf, &gy, 1, NULL));
      TD_ASSERT_OK(td_autograd_backward(&yh, &gyh, 1, NULL));
      assert_int_equal(td_tensor_dtype(grad(xh)), dt);
      if (i < 2) { /* relu, gelu: backward from x, exact */
        assert_rounded(names[i], grad(xh), grad(xf));
      } else { /* tanh, sigmoid, exp read their 16-bit output y: off by y's rounding */
        td_tensor *g = to(grad(xh), TD_DTYPE_F32);
        /* where y rounds to +-1 (tanh) the 16-bit slope is 0: absolute slack of a few ulps */
        td_test_assert_close(names[i], g, grad(xf), dt == TD_DTYPE_BF16 ? 0.05 : 0.01,
                             dt == TD_DTYPE_BF16 ? 0.03 : 0.005);
        td_tensor_unref(g);
      }
      td_tensor_unref(yf), td_tensor_unref(yh), td_tensor_unref(xf), td_tensor_unref(xh);
      td_tensor_unref(gyh);
    }
    td_tensor_unref(gy), td_tensor_unref(x);
  }
}

/* Sums accumulate in double (float32's rule) and round once. */
static void test_half_sums_equal_rounded_float32(void **state) {
  (void)state;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    int64_t s[3] = {4, 3000, 5};
    td_tensor *x = rep(s, 3, dt, 6, 0.01), *xh = to(x, dt);
    for (int dim = 0; dim < 3; dim++) {
      td_tensor *rf = NULL, *rh = NULL;
      TD_ASSERT_OK(td_tensor_sum(x, &dim, 1, false, &rf));
      TD_ASSERT_OK(td_tensor_sum(xh, &dim, 1, false, &rh));
      assert_int_equal(td_tensor_dtype(rh), dt);
      assert_rounded("sum", rh, rf);
      td_tensor_unref(rf), td_tensor_unref(rh);
    }
    td_tensor_unref(xh), td_tensor_unref(x);
  }
}

/* Softmax, log_softmax, layer norm and cross entropy on 16-bit tensors (no autocast) compute in
 * float32: the float32 results, rounded. */
static void test_half_float32_kernels_round_trip(void **state) {
  (void)state;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    int64_t s[2] = {6, 33}, ws[1] = {33}, ts[1] = {6};
    td_tensor *x = rep(s, 2, dt, 7, 3.0), *w = rep(ws, 1, dt, 8, 1.0), *b = rep(ws, 1, dt, 9, 1.0);
    td_tensor *xh = to(x, dt), *wh = to(w, dt), *bh = to(b, dt), *rf = NULL, *rh = NULL;
    TD_ASSERT_OK(td_tensor_softmax(x, 1, &rf));
    TD_ASSERT_OK(td_tensor_softmax(xh, 1, &rh));
    assert_rounded("softmax", rh, rf);
    td_tensor_unref(rf), td_tensor_unref(rh);
    TD_ASSERT_OK(td_tensor_log_softmax(x, 1, &rf));
    TD_ASSERT_OK(td_tensor_log_softmax(xh, 1, &rh));
    assert_rounded("log_softmax", rh, rf);
    td_tensor_unref(rf), td_tensor_unref(rh);
    TD_ASSERT_OK(td_tensor_layer_norm(x, 1, w, b, 1e-5, &rf));
    TD_ASSERT_OK(td_tensor_layer_norm(xh, 1, wh, bh, 1e-5, &rh));
    assert_rounded("layer_norm", rh, rf);
    td_tensor_unref(rf), td_tensor_unref(rh);
    double tv[6] = {0, 5, 32, 7, 1, 9};
    td_tensor *tg = td_test_tensor(tv, ts, 1, TD_DTYPE_I64, false);
    TD_ASSERT_OK(td_tensor_cross_entropy(x, tg, TD_REDUCTION_MEAN, -100, &rf));
    TD_ASSERT_OK(td_tensor_cross_entropy(xh, tg, TD_REDUCTION_MEAN, -100, &rh));
    td_test_assert_close("cross_entropy", rh, rf, 1e-2, 0); /* log_softmax rounded in between */
    td_tensor_unref(rf), td_tensor_unref(rh), td_tensor_unref(tg);
    td_tensor_unref(bh), td_tensor_unref(wh), td_tensor_unref(xh);
    td_tensor_unref(b), td_tensor_unref(w), td_tensor_unref(x);
  }
}

/* GEMMs: plain, transposed operands (linear's x W^T), batched with a broadcast operand, and
 * linear's beta = 1 bias; within two 16-bit ulps of float32's (accumulation order differs). */
static void test_half_matmul_within_ulps(void **state) {
  (void)state;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    double ulp = dt == TD_DTYPE_BF16 ? 1.0 / 128 : 1.0 / 1024;
    int64_t sx[2] = {64, 96}, sw[2] = {48, 96}, sbias[1] = {48}, sa[3] = {3, 17, 96};
    td_tensor *x = rep(sx, 2, dt, 10, 1.0), *w = rep(sw, 2, dt, 11, 0.1),
              *bias = rep(sbias, 1, dt, 12, 1.0), *a = rep(sa, 3, dt, 13, 1.0);
    td_tensor *xh = to(x, dt), *wh = to(w, dt), *bh = to(bias, dt), *ah = to(a, dt);
    td_tensor *rf = NULL, *rh = NULL, *wt = NULL, *wht = NULL, *r16 = NULL;
    TD_ASSERT_OK(td_tensor_linear(x, w, bias, &rf));
    TD_ASSERT_OK(td_tensor_linear(xh, wh, bh, &rh));
    assert_int_equal(td_tensor_dtype(rh), dt);
    r16 = to(rf, dt); /* the ideal: float32's product rounded once */
    td_test_assert_close("linear", rh, r16, 2 * ulp, 1e-3);
    td_tensor_unref(rf), td_tensor_unref(rh), td_tensor_unref(r16);
    TD_ASSERT_OK(td_tensor_transpose(w, 0, 1, &wt));
    TD_ASSERT_OK(td_tensor_transpose(wh, 0, 1, &wht));
    TD_ASSERT_OK(td_tensor_matmul(a, wt, &rf)); /* [3, 17, 96] @ [96, 48] */
    TD_ASSERT_OK(td_tensor_matmul(ah, wht, &rh));
    r16 = to(rf, dt);
    td_test_assert_close("batched matmul", rh, r16, 2 * ulp, 1e-3);
    td_tensor_unref(rf), td_tensor_unref(rh), td_tensor_unref(r16);
    /* backward of linear: gradients of x and W in the 16-bit dtype, close to float32's */
    td_tensor *xg = to(x, dt), *wg = to(w, dt), *y = NULL, *l = NULL, *xf = NULL, *wf = NULL,
              *yf = NULL, *lf = NULL;
    TD_ASSERT_OK(td_tensor_set_requires_grad(xg, true));
    TD_ASSERT_OK(td_tensor_set_requires_grad(wg, true));
    TD_ASSERT_OK(td_tensor_linear(xg, wg, NULL, &y));
    TD_ASSERT_OK(td_tensor_sum_all(y, &l));
    TD_ASSERT_OK(td_tensor_backward(l));
    TD_ASSERT_OK(td_tensor_clone(x, &xf));
    TD_ASSERT_OK(td_tensor_clone(w, &wf));
    TD_ASSERT_OK(td_tensor_set_requires_grad(xf, true));
    TD_ASSERT_OK(td_tensor_set_requires_grad(wf, true));
    TD_ASSERT_OK(td_tensor_linear(xf, wf, NULL, &yf));
    TD_ASSERT_OK(td_tensor_sum_all(yf, &lf));
    TD_ASSERT_OK(td_tensor_backward(lf));
    assert_int_equal(td_tensor_dtype(grad(wg)), dt);
    td_tensor *gx = to(grad(xg), TD_DTYPE_F32), *gw = to(grad(wg), TD_DTYPE_F32);
    td_test_assert_close("linear dx", gx, grad(xf), 2 * ulp, 1e-3);
    td_test_assert_close("linear dW", gw, grad(wf), 2 * ulp, 1e-2);
    td_tensor_unref(gx), td_tensor_unref(gw);
    td_tensor_unref(y), td_tensor_unref(l), td_tensor_unref(yf), td_tensor_unref(lf);
    td_tensor_unref(xg), td_tensor_unref(wg), td_tensor_unref(xf), td_tensor_unref(wf);
    td_tensor_unref(wt), td_tensor_unref(wht);
    td_tensor_unref(ah), td_tensor_unref(bh), td_tensor_unref(wh), td_tensor_unref(xh);
    td_tensor_unref(a), td_tensor_unref(bias), td_tensor_unref(w), td_tensor_unref(x);
  }
}

/* Attention's forward on heads taken as strided views is float32's, rounded; backward close. */
static void test_half_attention(void **state) {
  (void)state;
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    int64_t s[3] = {2, 19, 3 * 16}; /* [B, T, 3C] with 2 heads of 8 */
    td_tensor *qkv = rep(s, 3, dt, 14, 1.0), *qkvh = to(qkv, dt);
    td_tensor *outs[2], *grads[2];
    td_tensor *srcs[2] = {qkv, qkvh};
    for (int v = 0; v < 2; v++) {
      td_tensor *src = NULL;
      TD_ASSERT_OK(td_tensor_clone(srcs[v], &src));
      TD_ASSERT_OK(td_tensor_set_requires_grad(src, true));
      td_tensor *parts[3], *heads[3];
      for (int p = 0; p < 3; p++) {
        int64_t hs[4] = {2, 19, 2, 8};
        TD_ASSERT_OK(td_tensor_narrow(src, 2, p * 16, 16, &parts[p]));
        td_tensor *r = NULL;
        TD_ASSERT_OK(td_tensor_reshape(parts[p], hs, 4, &r));
        TD_ASSERT_OK(td_tensor_transpose(r, 1, 2, &heads[p]));
        td_tensor_unref(r);
      }
      TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(heads[0], heads[1], heads[2], true, NAN,
                                                          &outs[v]));
      td_tensor *l = NULL, *sq = NULL;
      TD_ASSERT_OK(td_tensor_mul(outs[v], outs[v], &sq));
      TD_ASSERT_OK(td_tensor_sum_all(sq, &l));
      TD_ASSERT_OK(td_tensor_backward(l));
      grads[v] = to(grad(src), TD_DTYPE_F32);
      td_tensor_unref(l), td_tensor_unref(sq);
      for (int p = 0; p < 3; p++) td_tensor_unref(parts[p]), td_tensor_unref(heads[p]);
      td_tensor_unref(src);
    }
    assert_int_equal(td_tensor_dtype(outs[1]), dt);
    assert_rounded("attention", outs[1], outs[0]);
    td_test_assert_close("attention backward", grads[1], grads[0], 0.05, 0.05);
    for (int v = 0; v < 2; v++) td_tensor_unref(outs[v]), td_tensor_unref(grads[v]);
    td_tensor_unref(qkvh), td_tensor_unref(qkv);
  }
}

/* Every other op the models use accepts the 16-bit dtypes, forward and backward, close to
 * float32 (a dropped kernel would be TD_ERR_DTYPE, a wrong one far off). */
typedef td_status (*op1_fn)(const td_tensor *x, td_tensor **out);
static td_status op_pow(const td_tensor *x, td_tensor **o) { return td_tensor_pow_scalar(x, 2, o); }
static td_status op_neg(const td_tensor *x, td_tensor **o) { return td_tensor_neg(x, o); }
static td_status op_absexp(const td_tensor *x, td_tensor **o) {
  td_tensor *t = NULL;
  TRY(td_tensor_mul_scalar(x, 0.25, &t));
  td_status st = td_tensor_exp(t, o);
  td_tensor_unref(t);
  return st;
}
static td_status op_max(const td_tensor *x, td_tensor **o) {
  return td_tensor_max(x, 1, false, o, NULL);
}
static td_status op_mean(const td_tensor *x, td_tensor **o) {
  int d = 0;
  return td_tensor_mean(x, &d, 1, false, o);
}
static td_status op_cat(const td_tensor *x, td_tensor **o) {
  td_tensor *ts[2] = {(td_tensor *)x, (td_tensor *)x};
  return td_tensor_cat(ts, 2, 1, o);
}
static td_status op_embedding(const td_tensor *x, td_tensor **o) {
  double iv[5] = {0, 3, 3, 1, 5};
  int64_t n = 5;
  td_tensor *ix = td_test_tensor(iv, &n, 1, TD_DTYPE_I64, false);
  td_status st = td_tensor_embedding(x, ix, o);
  td_tensor_unref(ix);
  return st;
}
static td_status op_dropout(const td_tensor *x, td_tensor **o) {
  td_generator *g = NULL;
  TRY(td_generator_create(3, &g));
  td_status st = td_tensor_dropout(x, 0.3, true, g, o);
  td_generator_destroy(g);
  return st;
}
static td_status op_conv_pool(const td_tensor *x, td_tensor **o) {
  int64_t s4[4] = {1, 1, 6, 8}, sw[4] = {2, 1, 3, 3};
  td_tensor *x4 = NULL, *w = rep(sw, 4, td_tensor_dtype(x), 50, 0.5), *wc = NULL, *c = NULL;
  td_status st = td_tensor_reshape(x, s4, 4, &x4);
  if (st == TD_OK) st = td_tensor_to_dtype(w, td_tensor_dtype(x), &wc);
  if (st == TD_OK) st = td_tensor_conv2d(x4, wc, NULL, 1, 1, 1, 1, &c);
  if (st == TD_OK) st = td_tensor_max_pool2d(c, 2, 2, 2, 2, o);
  td_tensor_unref(x4), td_tensor_unref(w), td_tensor_unref(wc), td_tensor_unref(c);
  return st;
}

static void test_half_ops_forward_backward(void **state) {
  (void)state;
  op1_fn fns[] = {op_pow, op_neg, op_absexp, op_max, op_mean, op_cat, op_embedding, op_dropout,
                  op_conv_pool};
  const char *names[] = {"pow", "neg", "exp", "max", "mean", "cat", "embedding", "dropout",
                         "conv2d+max_pool2d"};
  for (int d = 0; d < 2; d++) {
    td_dtype dt = halves[d];
    double tol = dt == TD_DTYPE_BF16 ? 0.03 : 0.005;
    int64_t s[2] = {6, 8};
    td_tensor *x = rep(s, 2, dt, 51, 1.0);
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
      td_tensor *xf = NULL, *xh = to(x, dt), *yf = NULL, *yh = NULL, *lf = NULL, *lh = NULL;
      TD_ASSERT_OK(td_tensor_clone(x, &xf));
      TD_ASSERT_OK(td_tensor_set_requires_grad(xf, true));
      TD_ASSERT_OK(td_tensor_set_requires_grad(xh, true));
      td_status st = fns[i](xh, &yh);
      if (st != TD_OK) fail_msg("%s on %s: %s", names[i], td_dtype_name(dt), td_last_error());
      TD_ASSERT_OK(fns[i](xf, &yf));
      assert_int_equal(td_tensor_dtype(yh), dt);
      td_tensor *y32 = to(yh, TD_DTYPE_F32);
      td_test_assert_close(names[i], y32, yf, tol, tol);
      TD_ASSERT_OK(td_tensor_sum_all(yf, &lf));
      TD_ASSERT_OK(td_tensor_sum_all(yh, &lh));
      TD_ASSERT_OK(td_tensor_backward(lf));
      st = td_tensor_backward(lh);
      if (st != TD_OK)
        fail_msg("%s backward on %s: %s", names[i], td_dtype_name(dt), td_last_error());
      assert_int_equal(td_tensor_dtype(grad(xh)), dt);
      td_tensor *g32 = to(grad(xh), TD_DTYPE_F32);
      td_test_assert_close(names[i], g32, grad(xf), tol, tol);
      td_tensor *all[] = {xf, xh, yf, yh, lf, lh, y32, g32};
      for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) td_tensor_unref(all[k]);
    }
    td_tensor_unref(x);
  }
}

/* Mixed floating dtypes promote to the wider one; gradients return in each input's dtype. */
static void test_half_promotion(void **state) {
  (void)state;
  int64_t s[2] = {4, 5};
  td_tensor *a = rep(s, 2, TD_DTYPE_BF16, 15, 1.0), *b = rep(s, 2, TD_DTYPE_F16, 16, 1.0);
  td_tensor *ah = to(a, TD_DTYPE_BF16), *bh = to(b, TD_DTYPE_F16), *r = NULL, *ref = NULL;
  TD_ASSERT_OK(td_tensor_set_requires_grad(ah, true));
  TD_ASSERT_OK(td_tensor_set_requires_grad(a, true));
  TD_ASSERT_OK(td_tensor_add(ah, b, &r)); /* bfloat16 + float32 -> float32 */
  assert_int_equal(td_tensor_dtype(r), TD_DTYPE_F32);
  TD_ASSERT_OK(td_tensor_add(a, b, &ref));
  td_test_assert_close("bf16 + f32", r, ref, 0, 0);
  td_tensor *l = NULL;
  TD_ASSERT_OK(td_tensor_sum_all(r, &l));
  TD_ASSERT_OK(td_tensor_backward(l));
  assert_int_equal(td_tensor_dtype(grad(ah)), TD_DTYPE_BF16);
  td_tensor_unref(l), td_tensor_unref(r), td_tensor_unref(ref);
  TD_ASSERT_OK(td_tensor_mul(ah, bh, &r)); /* bfloat16 * float16 -> float32 */
  assert_int_equal(td_tensor_dtype(r), TD_DTYPE_F32);
  td_tensor_unref(r);
  td_tensor_unref(bh), td_tensor_unref(ah), td_tensor_unref(b), td_tensor_unref(a);
}

/* Optimizers keep float32 state: 16-bit parameters are refused with a message naming autocast. */
static void test_half_optimizer_refuses_16bit_parameters(void **state) {
  (void)state;
  int64_t s[1] = {4};
  td_tensor *p = NULL;
  TD_ASSERT_OK(td_tensor_zeros(s, 1, TD_DTYPE_BF16, td_device_cpu(), &p));
  TD_ASSERT_OK(td_tensor_set_requires_grad(p, true));
  td_optim *o = NULL;
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_ADAMW);
  TD_ASSERT_STATUS(td_optim_create(&oo, &p, 1, &o), TD_ERR_DTYPE);
  assert_non_null(strstr(td_last_error(), "autocast"));
  assert_null(o);
  td_tensor_unref(p);
}

/* ---- autocast ---- */

/* Under a bfloat16 scope: linear computes in bfloat16 from float32 weights, layer norm and
 * cross entropy in float32, residual adds in float32; the weights' gradients are float32. */
static void test_autocast_policy(void **state) {
  (void)state;
  int64_t sx[2] = {8, 16}, sw[2] = {16, 16}, sb[1] = {16}, ts[1] = {8};
  td_tensor *x = td_test_randn(sx, 2, TD_DTYPE_F32, 20, false);
  td_tensor *w = td_test_randn(sw, 2, TD_DTYPE_F32, 21, true);
  td_tensor *b = td_test_randn(sb, 1, TD_DTYPE_F32, 22, true);
  double tv[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  td_tensor *tg = td_test_tensor(tv, ts, 1, TD_DTYPE_I64, false);
  td_dtype dt = TD_DTYPE_F32;
  assert_false(td_autocast_dtype(&dt));
  TD_ASSERT_OK(td_autocast_begin(TD_DTYPE_BF16));
  assert_true(td_autocast_dtype(&dt));
  assert_int_equal(dt, TD_DTYPE_BF16);
  td_tensor *h = NULL, *n = NULL, *res = NULL, *h2 = NULL, *logits = NULL, *loss = NULL;
  TD_ASSERT_OK(td_tensor_linear(x, w, b, &h));
  assert_int_equal(td_tensor_dtype(h), TD_DTYPE_BF16);
  TD_ASSERT_OK(td_tensor_layer_norm(h, 1, NULL, NULL, 1e-5, &n));
  assert_int_equal(td_tensor_dtype(n), TD_DTYPE_F32);
  TD_ASSERT_OK(td_tensor_gelu(h, &h2));
  assert_int_equal(td_tensor_dtype(h2), TD_DTYPE_BF16); /* runs in its input's dtype */
  TD_ASSERT_OK(td_tensor_add(x, h2, &res));
  assert_int_equal(td_tensor_dtype(res), TD_DTYPE_F32);
  TD_ASSERT_OK(td_tensor_linear(res, w, NULL, &logits)); /* the same weight again */
  TD_ASSERT_OK(td_tensor_cross_entropy(logits, tg, TD_REDUCTION_MEAN, -100, &loss));
  assert_int_equal(td_tensor_dtype(loss), TD_DTYPE_F32);
  int64_t casts = 0, hits = 0;
  td_autocast_cache_stats(&casts, &hits);
  assert_int_equal(hits, 1); /* w cast once, reused by the second linear */
  assert_int_equal(casts, 4); /* w, b, x, res */
  td_autocast_end();
  assert_false(td_autocast_dtype(NULL));
  TD_ASSERT_OK(td_tensor_backward(loss));
  assert_int_equal(td_tensor_dtype(grad(w)), TD_DTYPE_F32);
  assert_int_equal(td_tensor_dtype(grad(b)), TD_DTYPE_F32);
  td_tensor *all[] = {h, n, res, h2, logits, loss, tg, b, w, x};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
}

/* One step of a small MLP under autocast: close to float32 (bfloat16's precision), gradients the
 * same whether backward runs inside or outside the scope (it ignores autocast). */
static td_status mlp_loss(td_tensor *w1, td_tensor *w2, const td_tensor *x, td_dtype ac,
                          bool backward_inside, td_tensor **loss) {
  td_tensor *h = NULL, *a = NULL, *y = NULL, *sq = NULL;
  td_status st = ac != TD_DTYPE_F32 ? td_autocast_begin(ac) : TD_OK;
  if (st != TD_OK) return st;
  st = td_tensor_linear(x, w1, NULL, &h);
  if (st == TD_OK) st = td_tensor_gelu(h, &a);
  if (st == TD_OK) st = td_tensor_linear(a, w2, NULL, &y);
  if (st == TD_OK) st = td_tensor_mse_loss(y, x, TD_REDUCTION_MEAN, loss);
  if (st == TD_OK && backward_inside) st = td_tensor_backward(*loss);
  if (ac != TD_DTYPE_F32) td_autocast_end();
  if (st == TD_OK && !backward_inside) st = td_tensor_backward(*loss);
  td_tensor_unref(h), td_tensor_unref(a), td_tensor_unref(y), td_tensor_unref(sq);
  return st;
}

static void test_autocast_mlp_close_to_float32_backward_scope_free(void **state) {
  (void)state;
  int64_t sx[2] = {32, 64}, s1[2] = {128, 64}, s2[2] = {64, 128};
  td_tensor *x = td_test_randn(sx, 2, TD_DTYPE_F32, 30, false);
  td_tensor *g1[3], *g2[3], *loss[3];
  td_dtype modes[3] = {TD_DTYPE_F32, TD_DTYPE_BF16, TD_DTYPE_BF16};
  for (int m = 0; m < 3; m++) {
    td_tensor *w1 = td_test_randn(s1, 2, TD_DTYPE_F32, 31, false);
    td_tensor *w2 = td_test_randn(s2, 2, TD_DTYPE_F32, 32, false);
    TD_ASSERT_OK(td_tensor_mul_scalar_(w1, 0.125));
    TD_ASSERT_OK(td_tensor_mul_scalar_(w2, 0.09));
    TD_ASSERT_OK(td_tensor_set_requires_grad(w1, true));
    TD_ASSERT_OK(td_tensor_set_requires_grad(w2, true));
    TD_ASSERT_OK(mlp_loss(w1, w2, x, modes[m], m == 2, &loss[m]));
    assert_int_equal(td_tensor_dtype(loss[m]), TD_DTYPE_F32);
    g1[m] = td_tensor_grad(w1);
    g2[m] = td_tensor_grad(w2);
    td_tensor_unref(w1), td_tensor_unref(w2);
  }
  td_test_assert_close("bf16 loss", loss[1], loss[0], 0.02, 0);
  td_test_assert_close("bf16 dW1", g1[1], g1[0], 0.05, 0.05 * 1e-2);
  td_test_assert_close("bf16 dW2", g2[1], g2[0], 0.05, 0.05 * 1e-2);
  /* backward inside the scope: identical to outside */
  td_test_assert_close("inside/outside", g1[2], g1[1], 0, 0);
  td_test_assert_close("inside/outside", g2[2], g2[1], 0, 0);
  for (int m = 0; m < 3; m++) td_tensor_unref(g1[m]), td_tensor_unref(g2[m]), td_tensor_unref(loss[m]);
  td_tensor_unref(x);
}

/* Scopes nest; a float32 scope turns autocast off inside; the cache lives until the outermost
 * end; a cast made under no_grad does not serve a forward that needs gradients. */
static void test_autocast_scopes_and_cache(void **state) {
  (void)state;
  int64_t sx[2] = {2, 4}, sw[2] = {3, 4};
  td_tensor *x = td_test_randn(sx, 2, TD_DTYPE_F32, 40, false);
  td_tensor *w = td_test_randn(sw, 2, TD_DTYPE_F32, 41, true);
  td_tensor *y = NULL, *z = NULL, *l = NULL;
  TD_ASSERT_STATUS(td_autocast_begin(TD_DTYPE_I64), TD_ERR_DTYPE);
  TD_ASSERT_OK(td_autocast_begin(TD_DTYPE_BF16));
  TD_ASSERT_OK(td_autocast_begin(TD_DTYPE_F32));
  assert_false(td_autocast_dtype(NULL));
  TD_ASSERT_OK(td_tensor_linear(x, w, NULL, &y));
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_F32);
  td_tensor_unref(y);
  td_autocast_end();
  bool prev = td_autograd_set_enabled(false);
  TD_ASSERT_OK(td_tensor_linear(x, w, NULL, &y)); /* no_grad: a cast without history */
  td_autograd_set_enabled(prev);
  assert_false(td_tensor_requires_grad(y));
  TD_ASSERT_OK(td_tensor_linear(x, w, NULL, &z)); /* grad mode: its own cast, with history */
  assert_true(td_tensor_requires_grad(z));
  int64_t casts = 0, hits = 0;
  td_autocast_cache_stats(&casts, &hits);
  assert_int_equal(hits, 0);
  TD_ASSERT_OK(td_tensor_sum_all(z, &l));
  assert_int_equal(td_tensor_dtype(l), TD_DTYPE_F32);
  td_autocast_end();
  td_autocast_end(); /* extra end: nothing */
  TD_ASSERT_OK(td_tensor_backward(l));
  assert_non_null(grad(w));
  for (int i = 0; i < 64; i++) TD_ASSERT_OK(td_autocast_begin(TD_DTYPE_BF16));
  TD_ASSERT_STATUS(td_autocast_begin(TD_DTYPE_BF16), TD_ERR_STATE);
  for (int i = 0; i < 64; i++) td_autocast_end();
  assert_false(td_autocast_dtype(NULL));
  td_tensor_unref(l), td_tensor_unref(y), td_tensor_unref(z), td_tensor_unref(w);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_half_binary_equals_rounded_float32, grads_release),
      cmocka_unit_test_teardown(test_half_unary_and_backward_equal_rounded_float32, grads_release),
      cmocka_unit_test_teardown(test_half_sums_equal_rounded_float32, grads_release),
      cmocka_unit_test_teardown(test_half_float32_kernels_round_trip, grads_release),
      cmocka_unit_test_teardown(test_half_matmul_within_ulps, grads_release),
      cmocka_unit_test_teardown(test_half_attention, grads_release),
      cmocka_unit_test_teardown(test_half_ops_forward_backward, grads_release),
      cmocka_unit_test_teardown(test_half_promotion, grads_release),
      cmocka_unit_test_teardown(test_half_optimizer_refuses_16bit_parameters, grads_release),
      cmocka_unit_test_teardown(test_autocast_policy, grads_release),
      cmocka_unit_test_teardown(test_autocast_mlp_close_to_float32_backward_scope_free, grads_release),
      cmocka_unit_test_teardown(test_autocast_scopes_and_cache, grads_release),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
