/* test_nn_attention.c - td_tensor_scaled_dot_product_attention: gradients against finite
 * differences (float64; contiguous and strided heads, causal and full, L != S, Ev != E), values
 * and gradients against PyTorch 1.13 (tests/fixtures/attention.safetensors from
 * scripts/gen_gpt_fixtures.py, nanoGPT's masked_fill + softmax formulation, float64 and float32),
 * agreement with the same attention composed from matmul and softmax, the output layout, and
 * misuse.
 */
#include <math.h>

#include "../modules/fixture.h"
#include "nn_test_util.h"

typedef struct attn_ctx {
  bool causal;
  double scale;
  int heads; /* > 0: inputs[0] is a [B, T, 3C] projection split into heads like nanoGPT */
} attn_ctx;

/* split_heads returns q, k, v [B, H, T, C/H] as strided views of x [B, T, 3C] (nanoGPT's split,
 * done with views: [B, T, 3, H, hd], unbind, transpose). */
static td_status split_heads(const td_tensor *x, int heads, td_tensor **qkv) {
  int64_t B = td_tensor_size(x, 0), T = td_tensor_size(x, 1), C = td_tensor_size(x, 2) / 3;
  int64_t shape[5] = {B, T, 3, heads, C / heads};
  td_tensor *x5 = NULL, *parts[3] = {NULL, NULL, NULL};
  td_status st = td_tensor_reshape(x, shape, 5, &x5);
  if (st == TD_OK) st = td_tensor_unbind(x5, 2, parts);
  for (int i = 0; i < 3 && st == TD_OK; i++) st = td_tensor_transpose(parts[i], 1, 2, &qkv[i]);
  for (int i = 0; i < 3; i++) td_tensor_unref(parts[i]);
  td_tensor_unref(x5);
  return st;
}

static td_status attn_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  attn_ctx *c = ctx;
  if (c->heads == 0) return td_tensor_scaled_dot_product_attention(in[0], in[1], in[2], c->causal,
                                                                   c->scale, out);
  td_tensor *qkv[3] = {NULL, NULL, NULL};
  td_status st = split_heads(in[0], c->heads, qkv);
  if (st == TD_OK)
    st = td_tensor_scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], c->causal, c->scale, out);
  for (int i = 0; i < 3; i++) td_tensor_unref(qkv[i]);
  return st;
}

static void test_attention_gradcheck(void **state) {
  (void)state;
  const int64_t qs[] = {2, 2, 5, 3}, ks[] = {2, 2, 5, 3}, vs[] = {2, 2, 5, 4};
  td_tensor *q = td_test_randn(qs, 4, TD_DTYPE_F64, 41, true);
  td_tensor *k = td_test_randn(ks, 4, TD_DTYPE_F64, 42, true);
  td_tensor *v = td_test_randn(vs, 4, TD_DTYPE_F64, 43, true);
  td_tensor *in[3] = {q, k, v};
  attn_ctx c = {true, NAN, 0};
  td_test_gradcheck(attn_fn, &c, in, 3, 1e-6, 1e-7, 1e-5);
  c = (attn_ctx){false, 0.7, 0};
  td_test_gradcheck(attn_fn, &c, in, 3, 1e-6, 1e-7, 1e-5);
  /* L = 3 queries over S = 6 keys, 2-d operands (no batch dims) */
  const int64_t q2[] = {3, 2}, k2[] = {6, 2}, v2[] = {6, 3};
  td_tensor *a = td_test_randn(q2, 2, TD_DTYPE_F64, 44, true);
  td_tensor *b = td_test_randn(k2, 2, TD_DTYPE_F64, 45, true);
  td_tensor *d = td_test_randn(v2, 2, TD_DTYPE_F64, 46, true);
  td_tensor *in2[3] = {a, b, d};
  c = (attn_ctx){true, NAN, 0};
  td_test_gradcheck(attn_fn, &c, in2, 3, 1e-6, 1e-7, 1e-5);
  c = (attn_ctx){false, NAN, 0};
  td_test_gradcheck(attn_fn, &c, in2, 3, 1e-6, 1e-7, 1e-5);
  /* only some inputs need a gradient */
  td_tensor *kc, *vc, *qd;
  TD_ASSERT_OK(td_tensor_detach(k, &kc));
  TD_ASSERT_OK(td_tensor_detach(v, &vc));
  TD_ASSERT_OK(td_tensor_detach(q, &qd));
  td_tensor *in3[3] = {q, kc, vc};
  c = (attn_ctx){true, NAN, 0};
  td_test_gradcheck(attn_fn, &c, in3, 3, 1e-6, 1e-7, 1e-5);
  td_tensor *in4[3] = {kc, q, vc}; /* gradient for k only (q's place takes a constant) */
  td_test_gradcheck(attn_fn, &c, in4, 3, 1e-6, 1e-7, 1e-5);
  td_tensor *in5[3] = {kc, qd, v}; /* v only */
  td_test_gradcheck(attn_fn, &c, in5, 3, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(qd);
  td_tensor_unref(kc);
  td_tensor_unref(vc);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(d);
  td_tensor_unref(q);
  td_tensor_unref(k);
  td_tensor_unref(v);
}

/* Heads as strided views of one [B, T, 3C] projection: the gradient reaches the projection. */
static void test_attention_gradcheck_strided_heads(void **state) {
  (void)state;
  const int64_t xs[] = {2, 4, 12}; /* C = 4, 2 heads of 2 */
  td_tensor *x = td_test_randn(xs, 3, TD_DTYPE_F64, 47, true);
  attn_ctx c = {true, NAN, 2};
  td_test_gradcheck(attn_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
  c.causal = false;
  td_test_gradcheck(attn_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
  td_tensor_unref(x);
}

/* The same attention composed from matmul, an additive -inf mask and softmax. */
static td_tensor *composed(const td_tensor *q, const td_tensor *k, const td_tensor *v,
                           bool causal) {
  int nd = td_tensor_ndim(q);
  int64_t L = td_tensor_size(q, -2), S = td_tensor_size(k, -2), E = td_tensor_size(q, -1);
  td_tensor *kt, *s, *ss, *p, *y;
  TD_ASSERT_OK(td_tensor_transpose(k, nd - 2, nd - 1, &kt));
  TD_ASSERT_OK(td_tensor_matmul(q, kt, &s));
  TD_ASSERT_OK(td_tensor_mul_scalar(s, 1.0 / sqrt((double)E), &ss));
  if (causal) {
    double *m = calloc((size_t)(L * S), sizeof(double));
    for (int64_t i = 0; i < L; i++)
      for (int64_t j = i + 1; j < S; j++) m[i * S + j] = -INFINITY;
    int64_t ms[2] = {L, S};
    td_tensor *mask = td_test_tensor(m, ms, 2, td_tensor_dtype(q), false), *masked;
    TD_ASSERT_OK(td_tensor_add(ss, mask, &masked));
    td_tensor_unref(ss);
    td_tensor_unref(mask);
    ss = masked;
    free(m);
  }
  TD_ASSERT_OK(td_tensor_softmax(ss, -1, &p));
  TD_ASSERT_OK(td_tensor_matmul(p, v, &y));
  td_tensor_unref(kt);
  td_tensor_unref(s);
  td_tensor_unref(ss);
  td_tensor_unref(p);
  return y;
}

static void test_attention_matches_composed_ops(void **state) {
  (void)state;
  const int64_t qs[] = {3, 4, 7, 8}, vs[] = {3, 4, 7, 5};
  for (int f32 = 0; f32 < 2; f32++) {
    td_dtype dt = f32 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    double tol = f32 ? 2e-6 : 1e-13;
    td_tensor *q = td_test_randn(qs, 4, dt, 51, false), *k = td_test_randn(qs, 4, dt, 52, false);
    td_tensor *v = td_test_randn(vs, 4, dt, 53, false);
    for (int causal = 0; causal < 2; causal++) {
      td_tensor *y, *want = composed(q, k, v, causal);
      TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(q, k, v, causal, NAN, &y));
      nn_expect_shape(y, vs, 4);
      td_test_assert_close(causal ? "causal vs composed" : "full vs composed", y, want, tol, tol);
      td_tensor_unref(y);
      td_tensor_unref(want);
    }
    td_tensor_unref(q);
    td_tensor_unref(k);
    td_tensor_unref(v);
  }
}

/* Values and gradients of nanoGPT's attention in PyTorch 1.13, float64 and float32. */
static void test_attention_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("attention", &fx, NULL);
  const char *cases[] = {"causal", "full", "causal_wide"};
  const bool causal[] = {true, false, true};
  for (int f32 = 0; f32 < 2; f32++) {
    double rtol = f32 ? 1e-5 : 1e-12, atol = f32 ? 1e-6 : 1e-13;
    for (int c = 0; c < 3; c++) {
      char key[64], p[32];
      snprintf(p, sizeof p, "%s%s.", cases[c], f32 ? ".f32" : "");
#define FX(name) (snprintf(key, sizeof key, "%s%s", p, name), key)
      td_tensor *q = fixture_leaf(&fx, FX("q"), true), *k = fixture_leaf(&fx, FX("k"), true);
      td_tensor *v = fixture_leaf(&fx, FX("v"), true), *y, *w, *s;
      TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(q, k, v, causal[c], NAN, &y));
      td_test_assert_close(FX("y"), y, fixture_get(&fx, FX("y")), rtol, atol);
      TD_ASSERT_OK(td_tensor_mul(y, fixture_get(&fx, FX("gy")), &w));
      TD_ASSERT_OK(td_tensor_sum_all(w, &s));
      TD_ASSERT_OK(td_tensor_backward(s));
      fixture_check_grad(FX("grad.q"), q, &fx, FX("grad.q"), rtol, atol);
      fixture_check_grad(FX("grad.k"), k, &fx, FX("grad.k"), rtol, atol);
      fixture_check_grad(FX("grad.v"), v, &fx, FX("grad.v"), rtol, atol);
#undef FX
      td_tensor_unref(s);
      td_tensor_unref(w);
      td_tensor_unref(y);
      td_tensor_unref(q);
      td_tensor_unref(k);
      td_tensor_unref(v);
    }
  }
  td_tensor_list_fini(&fx);
}

/* Heads of a [B, T, 3C] projection: y's transpose(1, 2) is contiguous (reshape is a view) and
 * the heads were read in place. */
static void test_attention_output_layout_follows_q(void **state) {
  (void)state;
  const int64_t xs[] = {2, 5, 24};
  td_tensor *x = td_test_randn(xs, 3, TD_DTYPE_F32, 61, false), *qkv[3], *y, *yt, *qc;
  TD_ASSERT_OK(split_heads(x, 4, qkv));
  assert_false(td_tensor_is_contiguous(qkv[0]));
  /* the heads are views of x: no copy was made */
  assert_ptr_equal(td_tensor_data(qkv[0]), td_tensor_data(x));
  assert_ptr_equal((char *)td_tensor_data(qkv[1]), (char *)td_tensor_data(x) + 8 * sizeof(float)); /* C = 8 */
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], true, NAN, &y));
  const int64_t ys[] = {2, 4, 5, 2};
  nn_expect_shape(y, ys, 4);
  TD_ASSERT_OK(td_tensor_transpose(y, 1, 2, &yt));
  assert_true(td_tensor_is_contiguous(yt));
  /* same values as with contiguous copies of the heads */
  td_tensor *kc, *vc, *y2;
  TD_ASSERT_OK(td_tensor_contiguous(qkv[0], &qc));
  TD_ASSERT_OK(td_tensor_contiguous(qkv[1], &kc));
  TD_ASSERT_OK(td_tensor_contiguous(qkv[2], &vc));
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(qc, kc, vc, true, NAN, &y2));
  assert_true(td_tensor_is_contiguous(y2));
  td_test_assert_close("strided vs contiguous heads", y, y2, 0, 0);
  /* a non-contiguous last dim is copied first and gives the same result */
  td_tensor *qt, *qtt, *y3;
  TD_ASSERT_OK(td_tensor_transpose(qc, 2, 3, &qt));
  TD_ASSERT_OK(td_tensor_contiguous(qt, &qtt));
  td_tensor_unref(qt);
  TD_ASSERT_OK(td_tensor_transpose(qtt, 2, 3, &qt)); /* values of qc, last-dim stride != 1 */
  assert_int_not_equal(td_tensor_strides(qt)[3], 1);
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(qt, kc, vc, true, NAN, &y3));
  td_test_assert_close("transposed-last-dim q", y3, y2, 0, 0);
  td_tensor *objs[] = {x, qkv[0], qkv[1], qkv[2], y, yt, qc, kc, vc, y2, qt, qtt, y3};
  for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) td_tensor_unref(objs[i]);
}

static void test_attention_misuse(void **state) {
  (void)state;
  const int64_t s4[] = {1, 2, 3, 4}, s4b[] = {1, 3, 3, 4}, s4e[] = {1, 2, 3, 5};
  const int64_t s0[] = {1, 2, 0, 4};
  td_tensor *q = td_test_randn(s4, 4, TD_DTYPE_F64, 1, false);
  td_tensor *kb = td_test_randn(s4b, 4, TD_DTYPE_F64, 2, false);
  td_tensor *ke = td_test_randn(s4e, 4, TD_DTYPE_F64, 3, false);
  td_tensor *k0 = td_test_randn(s0, 4, TD_DTYPE_F64, 4, false);
  td_tensor *qf = td_test_randn(s4, 4, TD_DTYPE_F32, 5, false), *qi, *y = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(q, TD_DTYPE_I64, &qi));
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, kb, kb, true, NAN, &y),
                   TD_ERR_SHAPE);
  nn_expect_error("scaled_dot_product_attention", "[1, 3, 3, 4]");
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, ke, ke, true, NAN, &y),
                   TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, k0, k0, false, NAN, &y),
                   TD_ERR_SHAPE);
  nn_expect_error("no keys", NULL);
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, qf, q, true, NAN, &y),
                   TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(qi, qi, qi, true, NAN, &y),
                   TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, q, q, true, INFINITY, &y),
                   TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_scaled_dot_product_attention(q, NULL, q, true, NAN, &y),
                   TD_ERR_INVALID);
  assert_null(y);
  /* no queries: an empty result */
  const int64_t e[] = {1, 2, 0, 4};
  td_tensor *qe = td_test_randn(e, 4, TD_DTYPE_F64, 6, false);
  TD_ASSERT_OK(td_tensor_scaled_dot_product_attention(qe, q, q, true, NAN, &y));
  nn_expect_shape(y, e, 4);
  td_tensor *objs[] = {q, kb, ke, k0, qf, qi, qe, y};
  for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) td_tensor_unref(objs[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_attention_gradcheck),
      cmocka_unit_test(test_attention_gradcheck_strided_heads),
      cmocka_unit_test(test_attention_matches_composed_ops),
      cmocka_unit_test(test_attention_matches_pytorch),
      cmocka_unit_test(test_attention_output_layout_follows_q),
      cmocka_unit_test(test_attention_misuse),
  };
  return cmocka_run_group_tests_name("nn_attention", tests, NULL, NULL);
}
