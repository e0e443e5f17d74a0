/* test_nn_index.c - index_select, embedding, cat and stack: hand-computed forward values,
 * gradients against finite differences (float64), and misuse (bad indices, shapes, dtypes). */
#include "nn_test_util.h"

/* t = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] */
static td_tensor *arange34(td_dtype dt, bool requires_grad) {
  const int64_t s[] = {3, 4};
  return nn_formula(s, 2, 1, 1000, 1.0, 0.0, dt, requires_grad);
}

/* ---- index_select ---- */

static void test_index_select_forward(void **state) {
  (void)state;
  td_tensor *t = arange34(TD_DTYPE_F64, false), *y;
  const int64_t i0[] = {2, 0, 2}, s3[] = {3}, i1[] = {3, 1}, s2[] = {2};
  td_tensor *idx0 = nn_i64(i0, s3, 1), *idx1 = nn_i64(i1, s2, 1);

  TD_ASSERT_OK(td_tensor_index_select(t, 0, idx0, &y));
  const int64_t y0s[] = {3, 4};
  const double y0[] = {8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11};
  nn_expect_shape(y, y0s, 2);
  nn_expect("index_select dim 0", y, y0, 12, 0);
  td_tensor_unref(y);

  TD_ASSERT_OK(td_tensor_index_select(t, -1, idx1, &y));
  const int64_t y1s[] = {3, 2};
  const double y1[] = {3, 1, 7, 5, 11, 9};
  nn_expect_shape(y, y1s, 2);
  nn_expect("index_select dim -1", y, y1, 6, 0);
  td_tensor_unref(y);

  /* A 0-d index keeps the dim with size 1, as in PyTorch. */
  const int64_t one = 1;
  td_tensor *i0d = nn_i64(&one, NULL, 0);
  TD_ASSERT_OK(td_tensor_index_select(t, 1, i0d, &y));
  const int64_t y2s[] = {3, 1};
  const double y2[] = {1, 5, 9};
  nn_expect_shape(y, y2s, 2);
  nn_expect("index_select 0-d index", y, y2, 3, 0);
  td_tensor_unref(y);

  /* Non-contiguous input (transpose) and int64 data. */
  td_tensor *ti = arange34(TD_DTYPE_I64, false), *tt;
  TD_ASSERT_OK(td_tensor_transpose(ti, 0, 1, &tt));
  TD_ASSERT_OK(td_tensor_index_select(tt, 0, idx1, &y));
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_I64);
  const double y3[] = {3, 7, 11, 1, 5, 9};
  nn_expect("index_select transposed int64", y, y3, 6, 0);
  td_tensor_unref(y);
  td_tensor_unref(tt);
  td_tensor_unref(ti);

  /* 3-d input along the middle dim: rows of 2 elements are copied. */
  const int64_t s322[] = {3, 2, 2};
  td_tensor *t3 = nn_formula(s322, 3, 1, 1000, 1.0, 0.0, TD_DTYPE_F32, false);
  const int64_t im[] = {1, 1, 0};
  td_tensor *idxm = nn_i64(im, s3, 1);
  TD_ASSERT_OK(td_tensor_index_select(t3, 1, idxm, &y));
  const int64_t y4s[] = {3, 3, 2};
  const double y4[] = {2, 3, 2, 3, 0, 1, 6, 7, 6, 7, 4, 5, 10, 11, 10, 11, 8, 9};
  nn_expect_shape(y, y4s, 3);
  nn_expect("index_select middle dim", y, y4, 18, 0);
  td_tensor_unref(y);
  td_tensor_unref(idxm);
  td_tensor_unref(t3);

  /* A 0-d input takes one index 0. */
  td_tensor *sc, *zero = NULL;
  const int64_t z = 0;
  TD_ASSERT_OK(td_tensor_scalar(5.0, TD_DTYPE_F64, td_device_cpu(), &sc));
  zero = nn_i64(&z, NULL, 0);
  TD_ASSERT_OK(td_tensor_index_select(sc, 0, zero, &y));
  assert_int_equal(td_tensor_ndim(y), 0);
  assert_true(nn_item(y) == 5.0);
  td_tensor_unref(y);
  td_tensor_unref(zero);
  td_tensor_unref(sc);

  td_tensor_unref(i0d);
  td_tensor_unref(idx0);
  td_tensor_unref(idx1);
  td_tensor_unref(t);
}

typedef struct isel_ctx {
  int dim;
  const td_tensor *index;
  bool transpose;
} isel_ctx;

static td_status isel_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  isel_ctx *c = ctx;
  if (!c->transpose) return td_tensor_index_select(in[0], c->dim, c->index, out);
  td_tensor *t;
  td_status st = td_tensor_transpose(in[0], 0, 2, &t);
  if (st != TD_OK) return st;
  st = td_tensor_index_select(t, c->dim, c->index, out);
  td_tensor_unref(t);
  return st;
}

static void test_index_select_gradcheck(void **state) {
  (void)state;
  const int64_t s[] = {3, 4, 5}, is[] = {5};
  const int64_t iv[] = {2, 0, 2, 1, 2}; /* duplicates accumulate */
  td_tensor *x = td_test_randn(s, 3, TD_DTYPE_F64, 3, true), *idx = nn_i64(iv, is, 1);
  for (int tr = 0; tr < 2; tr++)
    for (int d = 0; d < 3; d++) {
      isel_ctx c = {d, idx, tr != 0};
      td_test_gradcheck(isel_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
    }
  td_tensor_unref(idx);
  td_tensor_unref(x);
}

static void test_index_select_misuse(void **state) {
  (void)state;
  td_tensor *t = arange34(TD_DTYPE_F64, false), *y = NULL;
  const int64_t bad[] = {0, 3}, neg[] = {-1}, s2[] = {2}, s1[] = {1}, s11[] = {1, 2};
  td_tensor *ib = nn_i64(bad, s2, 1), *in = nn_i64(neg, s1, 1), *i2d = nn_i64(bad, s11, 2);
  td_tensor *fi;
  TD_ASSERT_OK(td_tensor_to_dtype(ib, TD_DTYPE_F64, &fi));
  TD_ASSERT_STATUS(td_tensor_index_select(t, 0, ib, &y), TD_ERR_INVALID);
  nn_expect_error("index_select", "index 3");
  TD_ASSERT_STATUS(td_tensor_index_select(t, 1, in, &y), TD_ERR_INVALID);
  nn_expect_error("index -1", "[3, 4]");
  TD_ASSERT_OK(td_tensor_index_select(t, 1, ib, &y)); /* 3 is fine along dim 1 */
  td_tensor_unref(y);
  y = NULL;
  TD_ASSERT_STATUS(td_tensor_index_select(t, 2, ib, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_index_select(t, 0, i2d, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_index_select(t, 0, fi, &y), TD_ERR_DTYPE);
  nn_expect_error("index_select", "int64");
  TD_ASSERT_STATUS(td_tensor_index_select(NULL, 0, ib, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_index_select(t, 0, NULL, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_index_select(t, 0, ib, NULL), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(fi);
  td_tensor_unref(i2d);
  td_tensor_unref(in);
  td_tensor_unref(ib);
  td_tensor_unref(t);
}

/* ---- embedding ---- */

static void test_embedding_forward(void **state) {
  (void)state;
  td_tensor *w = arange34(TD_DTYPE_F32, false), *y;
  const int64_t iv[] = {0, 2, 2, 1}, is[] = {2, 2};
  td_tensor *idx = nn_i64(iv, is, 2);
  TD_ASSERT_OK(td_tensor_embedding(w, idx, &y));
  const int64_t ys[] = {2, 2, 4};
  const double want[] = {0, 1, 2, 3, 8, 9, 10, 11, 8, 9, 10, 11, 4, 5, 6, 7};
  nn_expect_shape(y, ys, 3);
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_F32);
  nn_expect("embedding", y, want, 16, 0);
  td_tensor_unref(y);

  const int64_t two = 2;
  td_tensor *i0 = nn_i64(&two, NULL, 0);
  TD_ASSERT_OK(td_tensor_embedding(w, i0, &y));
  const int64_t y1s[] = {4};
  nn_expect_shape(y, y1s, 1);
  nn_expect("embedding 0-d index", y, want + 4, 4, 0);
  td_tensor_unref(y);
  td_tensor_unref(i0);
  td_tensor_unref(idx);
  td_tensor_unref(w);
}

static td_status emb_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  return td_tensor_embedding(in[0], ctx, out);
}

static void test_embedding_gradcheck(void **state) {
  (void)state;
  const int64_t ws[] = {5, 3}, is[] = {2, 3};
  const int64_t iv[] = {4, 0, 4, 1, 4, 0};
  td_tensor *w = td_test_randn(ws, 2, TD_DTYPE_F64, 12, true), *idx = nn_i64(iv, is, 2);
  td_test_gradcheck(emb_fn, idx, &w, 1, 1e-6, 1e-7, 1e-5);

  /* Rows never looked up get zero gradient; repeated rows get the sum. */
  td_tensor *y, *s;
  TD_ASSERT_OK(td_tensor_embedding(w, idx, &y));
  TD_ASSERT_OK(td_tensor_sum_all(y, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor *g = td_tensor_grad(w);
  const double want[] = {2, 2, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0, 3, 3, 3};
  nn_expect("embedding grad counts", g, want, 15, 0);
  td_tensor_unref(g);
  td_tensor_unref(s);
  td_tensor_unref(y);
  td_tensor_unref(idx);
  td_tensor_unref(w);
}

static void test_embedding_misuse(void **state) {
  (void)state;
  td_tensor *w = arange34(TD_DTYPE_F64, false), *y = NULL;
  const int64_t bad[] = {1, 3, 0, 2}, neg[] = {0, -2}, s4[] = {2, 2}, s2[] = {2};
  td_tensor *ib = nn_i64(bad, s4, 2), *in = nn_i64(neg, s2, 1), *fi, *w1;
  TD_ASSERT_STATUS(td_tensor_embedding(w, ib, &y), TD_ERR_INVALID);
  nn_expect_error("embedding", "index 3 at position 1");
  TD_ASSERT_STATUS(td_tensor_embedding(w, in, &y), TD_ERR_INVALID);
  nn_expect_error("embedding", "index -2");
  TD_ASSERT_OK(td_tensor_to_dtype(in, TD_DTYPE_F32, &fi));
  TD_ASSERT_STATUS(td_tensor_embedding(w, fi, &y), TD_ERR_DTYPE);
  nn_expect_error("embedding", "int64");
  TD_ASSERT_OK(td_tensor_flatten(w, 0, 1, &w1));
  TD_ASSERT_STATUS(td_tensor_embedding(w1, in, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_embedding(NULL, in, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_embedding(w, NULL, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_embedding(w, in, NULL), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(w1);
  td_tensor_unref(fi);
  td_tensor_unref(in);
  td_tensor_unref(ib);
  td_tensor_unref(w);
}

/* ---- cat / stack ---- */

static void test_cat_forward(void **state) {
  (void)state;
  const double av[] = {1, 2, 3, 4, 5, 6}, bv[] = {7, 8}, cv[] = {9, 10, 11, 12};
  const int64_t as[] = {2, 3}, bs[] = {2, 1}, cs[] = {2, 2};
  td_tensor *ts[3] = {nn_f64(av, as, 2, false), nn_f64(bv, bs, 2, false),
                      nn_f64(cv, cs, 2, false)};
  td_tensor *y;
  TD_ASSERT_OK(td_tensor_cat(ts, 3, 1, &y));
  const int64_t ys[] = {2, 6};
  const double want[] = {1, 2, 3, 7, 9, 10, 4, 5, 6, 8, 11, 12};
  nn_expect_shape(y, ys, 2);
  nn_expect("cat dim 1", y, want, 12, 0);
  td_tensor_unref(y);

  /* dim 0 with a transposed (non-contiguous) piece: a^T is [3, 2]. */
  td_tensor *at, *p2[2];
  TD_ASSERT_OK(td_tensor_transpose(ts[0], 0, 1, &at));
  p2[0] = at;
  p2[1] = ts[2];
  TD_ASSERT_OK(td_tensor_cat(p2, 2, -2, &y));
  const int64_t y2s[] = {5, 2};
  const double want2[] = {1, 4, 2, 5, 3, 6, 9, 10, 11, 12};
  nn_expect_shape(y, y2s, 2);
  nn_expect("cat dim -2", y, want2, 10, 0);
  td_tensor_unref(y);
  td_tensor_unref(at);

  /* One tensor gives a copy; int64 works. */
  td_tensor *i, *ic;
  TD_ASSERT_OK(td_tensor_to_dtype(ts[0], TD_DTYPE_I64, &i));
  TD_ASSERT_OK(td_tensor_cat(&i, 1, 0, &ic));
  assert_ptr_not_equal(ic, i);
  assert_int_equal(td_tensor_dtype(ic), TD_DTYPE_I64);
  nn_expect("cat one int64", ic, av, 6, 0);
  td_tensor_unref(ic);
  td_tensor_unref(i);
  for (int k = 0; k < 3; k++) td_tensor_unref(ts[k]);
}

typedef struct cat_ctx {
  int dim;
  bool stack;
} cat_ctx;

static td_status cat_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  cat_ctx *c = ctx;
  return c->stack ? td_tensor_stack(in, n, c->dim, out) : td_tensor_cat(in, n, c->dim, out);
}

static void test_cat_gradcheck(void **state) {
  (void)state;
  const int64_t a[] = {2, 3, 4}, b[] = {2, 1, 4}, c[] = {2, 2, 4};
  td_tensor *in[3] = {td_test_randn(a, 3, TD_DTYPE_F64, 1, true),
                      td_test_randn(b, 3, TD_DTYPE_F64, 2, false),
                      td_test_randn(c, 3, TD_DTYPE_F64, 3, true)};
  cat_ctx c1 = {1, false};
  td_test_gradcheck(cat_fn, &c1, in, 3, 1e-6, 1e-7, 1e-5);
  for (int i = 0; i < 3; i++) td_tensor_unref(in[i]);

  const int64_t s[] = {3, 2};
  td_tensor *eq[3] = {td_test_randn(s, 2, TD_DTYPE_F64, 4, true),
                      td_test_randn(s, 2, TD_DTYPE_F64, 5, true),
                      td_test_randn(s, 2, TD_DTYPE_F64, 6, true)};
  for (int d = -3; d < 3; d++) {
    cat_ctx cs = {d, true};
    td_test_gradcheck(cat_fn, &cs, eq, 3, 1e-6, 1e-7, 1e-5);
  }
  for (int d = 0; d < 2; d++) {
    cat_ctx cc = {d, false};
    td_test_gradcheck(cat_fn, &cc, eq, 3, 1e-6, 1e-7, 1e-5);
  }
  for (int i = 0; i < 3; i++) td_tensor_unref(eq[i]);
}

static void test_stack_forward(void **state) {
  (void)state;
  const double av[] = {1, 2, 3}, bv[] = {4, 5, 6};
  const int64_t s[] = {3};
  td_tensor *ts[2] = {nn_f64(av, s, 1, false), nn_f64(bv, s, 1, false)}, *y;
  TD_ASSERT_OK(td_tensor_stack(ts, 2, 0, &y));
  const int64_t y0s[] = {2, 3};
  const double w0[] = {1, 2, 3, 4, 5, 6};
  nn_expect_shape(y, y0s, 2);
  nn_expect("stack dim 0", y, w0, 6, 0);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_stack(ts, 2, -1, &y));
  const int64_t y1s[] = {3, 2};
  const double w1[] = {1, 4, 2, 5, 3, 6};
  nn_expect_shape(y, y1s, 2);
  nn_expect("stack dim -1", y, w1, 6, 0);
  td_tensor_unref(y);
  td_tensor_unref(ts[0]);
  td_tensor_unref(ts[1]);
}

static void test_cat_stack_misuse(void **state) {
  (void)state;
  const int64_t a[] = {2, 3}, b[] = {3, 3}, c[] = {2, 3, 1};
  td_tensor *ta = td_test_randn(a, 2, TD_DTYPE_F64, 1, false);
  td_tensor *tb = td_test_randn(b, 2, TD_DTYPE_F64, 2, false);
  td_tensor *tc = td_test_randn(c, 3, TD_DTYPE_F64, 3, false);
  td_tensor *tf = td_test_randn(a, 2, TD_DTYPE_F32, 4, false), *sc, *y = NULL;
  TD_ASSERT_OK(td_tensor_scalar(1.0, TD_DTYPE_F64, td_device_cpu(), &sc));
  td_tensor *ab[2] = {ta, tb}, *ac[2] = {ta, tc}, *af[2] = {ta, tf}, *an[2] = {ta, NULL};
  td_tensor *ss[2] = {sc, sc};

  TD_ASSERT_STATUS(td_tensor_cat(ab, 2, 1, &y), TD_ERR_SHAPE);
  nn_expect_error("cat", "tensor 1");
  TD_ASSERT_OK(td_tensor_cat(ab, 2, 0, &y)); /* [5, 3] */
  td_tensor_unref(y);
  y = NULL;
  TD_ASSERT_STATUS(td_tensor_cat(ac, 2, 0, &y), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_cat(af, 2, 0, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_cat(an, 2, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cat(ab, 0, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cat(NULL, 2, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cat(ab, 2, 2, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cat(ss, 2, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cat(ab, 2, 0, NULL), TD_ERR_INVALID);

  TD_ASSERT_STATUS(td_tensor_stack(ab, 2, 0, &y), TD_ERR_SHAPE);
  nn_expect_error("stack", "[3, 3]");
  TD_ASSERT_STATUS(td_tensor_stack(af, 2, 0, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_stack(an, 2, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_stack(ab, 2, 3, &y), TD_ERR_INVALID);
  TD_ASSERT_OK(td_tensor_stack(ss, 2, 0, &y)); /* 0-d tensors stack into [2] */
  const int64_t two[] = {2};
  nn_expect_shape(y, two, 1);
  td_tensor_unref(y);

  td_tensor_unref(sc);
  td_tensor_unref(tf);
  td_tensor_unref(tc);
  td_tensor_unref(tb);
  td_tensor_unref(ta);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_index_select_forward),
      cmocka_unit_test(test_index_select_gradcheck),
      cmocka_unit_test(test_index_select_misuse),
      cmocka_unit_test(test_embedding_forward),
      cmocka_unit_test(test_embedding_gradcheck),
      cmocka_unit_test(test_embedding_misuse),
      cmocka_unit_test(test_cat_forward),
      cmocka_unit_test(test_cat_gradcheck),
      cmocka_unit_test(test_stack_forward),
      cmocka_unit_test(test_cat_stack_misuse),
  };
  return cmocka_run_group_tests_name("tensor_nn_index", tests, NULL, NULL);
}
