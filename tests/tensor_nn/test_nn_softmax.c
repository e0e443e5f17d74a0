/* test_nn_softmax.c - softmax, log_softmax, nll_loss, cross_entropy and mse_loss: forward values
 * against PyTorch, gradients against finite differences (float64), and misuse.
 *
 * Expected numbers were produced with PyTorch 1.13 in float64:
 *   formula(n, a, m, s, o) = torch.tensor([((i * a) % m) * s + o for i in range(n)])
 *   x = [[1, 2, 3], [-1, 0.5, 0]]: F.softmax(x, 1), F.softmax(x, 0), F.log_softmax(x, 1)
 *   x3 = formula(12, 7, 12, 0.25, -1).reshape(2, 3, 2): F.softmax(x3, 1), F.log_softmax(x3, 0)
 *   logits = formula(12, 5, 12, 0.5, -2).reshape(3, 4), t = [1, 3, 0]:
 *     F.nll_loss(F.log_softmax(logits, 1), t, reduction=..., ignore_index=...)
 *     F.cross_entropy(logits, [2, 0, 1]), F.cross_entropy(logits[1], tensor(2))
 */
#include "nn_test_util.h"

/* ---- softmax ---- */

static void test_softmax_forward_matches_torch(void **state) {
  (void)state;
  const double xv[] = {1.0, 2.0, 3.0, -1.0, 0.5, 0.0};
  const int64_t shape[] = {2, 3};
  const double sm1[] = {0.090030573170380448, 0.24472847105479761, 0.66524095577482178,
                        0.12195165230972885, 0.54654938726617963, 0.33149896042409149};
  const double sm0[] = {0.88079707797788231, 0.81757447619364365, 0.95257412682243336,
                        0.11920292202211755, 0.18242552380635632, 0.047425873177566788};
  const double lsm1[] = {-2.4076059644443806, -1.4076059644443804, -0.40760596444438041,
                         -2.1041306053367284, -0.60413060533672835, -1.1041306053367284};
  for (int f32 = 0; f32 < 2; f32++) {
    td_dtype dt = f32 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    double tol = f32 ? 1e-6 : 1e-13;
    td_tensor *x = td_test_tensor(xv, shape, 2, dt, false), *y;
    TD_ASSERT_OK(td_tensor_softmax(x, 1, &y));
    assert_int_equal(td_tensor_dtype(y), dt);
    nn_expect("softmax dim 1", y, sm1, 6, tol);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_softmax(x, -1, &y));
    nn_expect("softmax dim -1", y, sm1, 6, tol);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_softmax(x, 0, &y));
    nn_expect("softmax dim 0", y, sm0, 6, tol);
    td_tensor_unref(y);
    TD_ASSERT_OK(td_tensor_log_softmax(x, 1, &y));
    nn_expect("log_softmax dim 1", y, lsm1, 6, tol);
    td_tensor_unref(y);
    td_tensor_unref(x);
  }
}

static void test_softmax_inner_dims_match_torch(void **state) {
  (void)state;
  const int64_t shape[] = {2, 3, 2};
  const double sm1[] = {0.18632372322584759, 0.18632372322584759, 0.30719588571849837,
                        0.30719588571849837, 0.50648039105565401, 0.50648039105565401,
                        0.18632372322584759, 0.18632372322584759, 0.30719588571849837,
                        0.30719588571849837, 0.50648039105565401, 0.50648039105565401};
  const double a = -1.7014132779827524, b = -0.20141327798275246;
  const double lsm0[] = {a, b, a, b, a, b, b, a, b, a, b, a};
  td_tensor *x = nn_formula(shape, 3, 7, 12, 0.25, -1.0, TD_DTYPE_F64, false), *y;
  TD_ASSERT_OK(td_tensor_softmax(x, 1, &y));
  nn_expect("softmax [2,3,2] dim 1", y, sm1, 12, 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_log_softmax(x, 0, &y));
  nn_expect("log_softmax [2,3,2] dim 0", y, lsm0, 12, 1e-13);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

static void test_softmax_large_logits_are_stable(void **state) {
  (void)state;
  const double xv[] = {1000.0, 1001.0, -1000.0};
  const int64_t shape[] = {3};
  td_tensor *x = nn_f64(xv, shape, 1, false), *y;
  TD_ASSERT_OK(td_tensor_softmax(x, 0, &y));
  const double want[] = {0.2689414213699951, 0.7310585786300049, 0.0};
  nn_expect("softmax large", y, want, 3, 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_log_softmax(x, 0, &y));
  const double lwant[] = {-1.3132616875182228, -0.31326168751822286, -2001.3132616875182};
  nn_expect("log_softmax large", y, lwant, 3, 1e-12);
  td_tensor_unref(y);
  td_tensor_unref(x);
}

typedef struct sm_ctx {
  int dim;
  bool log;
  bool transpose; /* apply to the transpose (a non-contiguous input) */
} sm_ctx;

static td_status sm_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  sm_ctx *c = ctx;
  td_tensor *x = td_tensor_ref(in[0]);
  if (c->transpose) {
    td_tensor *t;
    td_status st = td_tensor_transpose(x, 0, 2, &t);
    td_tensor_unref(x);
    if (st != TD_OK) return st;
    x = t;
  }
  td_status st = c->log ? td_tensor_log_softmax(x, c->dim, out) : td_tensor_softmax(x, c->dim, out);
  td_tensor_unref(x);
  return st;
}

static void test_softmax_gradcheck(void **state) {
  (void)state;
  const int64_t shape[] = {2, 3, 4};
  td_tensor *x = td_test_randn(shape, 3, TD_DTYPE_F64, 11, true);
  const int dims[] = {0, 1, 2, -1};
  for (int log = 0; log < 2; log++)
    for (int tr = 0; tr < 2; tr++)
      for (int i = 0; i < 4; i++) {
        sm_ctx c = {dims[i], log != 0, tr != 0};
        td_test_gradcheck(sm_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
      }
  td_tensor_unref(x);
}

static void test_softmax_misuse(void **state) {
  (void)state;
  const int64_t shape[] = {2, 3};
  td_tensor *x = td_test_randn(shape, 2, TD_DTYPE_F64, 1, false), *y = NULL;
  TD_ASSERT_STATUS(td_tensor_softmax(NULL, 0, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_softmax(x, 0, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_softmax(x, 2, &y), TD_ERR_INVALID);
  nn_expect_error("softmax", "[2, 3]");
  TD_ASSERT_STATUS(td_tensor_log_softmax(x, -3, &y), TD_ERR_INVALID);
  nn_expect_error("log_softmax", NULL);
  td_tensor *xi;
  TD_ASSERT_OK(td_tensor_zeros(shape, 2, TD_DTYPE_I64, td_device_cpu(), &xi));
  TD_ASSERT_STATUS(td_tensor_softmax(xi, 1, &y), TD_ERR_DTYPE);
  assert_null(y);
  td_tensor_unref(xi);
  td_tensor_unref(x);
}

/* ---- nll_loss / cross_entropy ---- */

static td_tensor *ref_logp(bool requires_grad) {
  const int64_t shape[] = {3, 4};
  td_tensor *logits = nn_formula(shape, 2, 5, 12, 0.5, -2.0, TD_DTYPE_F64, false), *lp;
  TD_ASSERT_OK(td_tensor_log_softmax(logits, 1, &lp));
  td_tensor_unref(logits);
  td_tensor *d;
  TD_ASSERT_OK(td_tensor_clone(lp, &d));
  td_tensor_unref(lp);
  if (requires_grad) TD_ASSERT_OK(td_tensor_set_requires_grad(d, true));
  return d;
}

static void test_nll_loss_matches_torch(void **state) {
  (void)state;
  td_tensor *lp = ref_logp(false), *y;
  const int64_t tv[] = {1, 3, 0}, tshape[] = {3};
  td_tensor *t = nn_i64(tv, tshape, 1);
  const double none[] = {2.6124535963187467, 0.27151694733084131, 2.8921514218107727};
  const double none_ign[] = {2.6124535963187467, 0.0, 2.8921514218107727};

  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_MEAN, -100, &y));
  assert_int_equal(td_tensor_ndim(y), 0);
  assert_true(fabs(nn_item(y) - 1.9253739884867869) < 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_SUM, -100, &y));
  assert_true(fabs(nn_item(y) - 5.7761219654603604) < 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_NONE, -100, &y));
  nn_expect("nll none", y, none, 3, 1e-13);
  td_tensor_unref(y);

  /* ignore_index = 3: the mean divides by the 2 remaining targets. */
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_MEAN, 3, &y));
  assert_true(fabs(nn_item(y) - 2.7523025090647595) < 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_SUM, 3, &y));
  assert_true(fabs(nn_item(y) - 5.504605018129519) < 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_NONE, 3, &y));
  nn_expect("nll none ignore", y, none_ign, 3, 1e-13);
  td_tensor_unref(y);

  /* float32 */
  td_tensor *lp32;
  TD_ASSERT_OK(td_tensor_to_dtype(lp, TD_DTYPE_F32, &lp32));
  TD_ASSERT_OK(td_tensor_nll_loss(lp32, t, TD_REDUCTION_MEAN, 3, &y));
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_F32);
  assert_true(fabs(nn_item(y) - 2.7523025090647595) < 1e-6);
  td_tensor_unref(y);
  td_tensor_unref(lp32);
  td_tensor_unref(t);
  td_tensor_unref(lp);
}

static void test_nll_loss_all_ignored_mean_is_nan(void **state) {
  (void)state;
  td_tensor *lp = ref_logp(true), *y;
  const int64_t tv[] = {-100, -100, -100}, tshape[] = {3};
  td_tensor *t = nn_i64(tv, tshape, 1);
  TD_ASSERT_OK(td_tensor_nll_loss(lp, t, TD_REDUCTION_MEAN, -100, &y));
  assert_true(isnan(nn_item(y)));
  TD_ASSERT_OK(td_tensor_backward(y));
  td_tensor *g = td_tensor_grad(lp), *z;
  assert_non_null(g);
  TD_ASSERT_OK(td_tensor_zeros(td_tensor_shape(lp), 2, TD_DTYPE_F64, td_device_cpu(), &z));
  td_test_assert_close("all-ignored grad", g, z, 0, 0);
  td_tensor_unref(z);
  td_tensor_unref(g);
  td_tensor_unref(y);
  td_tensor_unref(t);
  td_tensor_unref(lp);
}

static void test_cross_entropy_matches_torch(void **state) {
  (void)state;
  const int64_t shape[] = {3, 4}, tshape[] = {3};
  td_tensor *logits = nn_formula(shape, 2, 5, 12, 0.5, -2.0, TD_DTYPE_F64, false), *y;
  const int64_t tv[] = {2, 0, 1};
  td_tensor *t = nn_i64(tv, tshape, 1);
  TD_ASSERT_OK(td_tensor_cross_entropy(logits, t, TD_REDUCTION_MEAN, -100, &y));
  assert_true(fabs(nn_item(y) - 0.75870732182012024) < 1e-13);
  td_tensor_unref(y);

  /* 1-d logits [C] with a 0-d target: logits[1] = [2, -1.5, 1, 3.5], class 2. */
  td_tensor *row, *t0;
  TD_ASSERT_OK(td_tensor_narrow(logits, 0, 1, 1, &row));
  td_tensor *row1;
  TD_ASSERT_OK(td_tensor_squeeze(row, 0, &row1));
  const int64_t two = 2;
  t0 = nn_i64(&two, NULL, 0);
  TD_ASSERT_OK(td_tensor_cross_entropy(row1, t0, TD_REDUCTION_MEAN, -100, &y));
  assert_int_equal(td_tensor_ndim(y), 0);
  assert_true(fabs(nn_item(y) - 2.7715169473308414) < 1e-13);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_cross_entropy(row1, t0, TD_REDUCTION_NONE, -100, &y));
  assert_int_equal(td_tensor_ndim(y), 0);
  assert_true(fabs(nn_item(y) - 2.7715169473308414) < 1e-13);
  td_tensor_unref(y);
  td_tensor_unref(t0);
  td_tensor_unref(row1);
  td_tensor_unref(row);
  td_tensor_unref(t);
  td_tensor_unref(logits);
}

typedef struct nll_ctx {
  const td_tensor *target;
  td_reduction red;
  int64_t ignore;
  bool ce; /* cross_entropy instead of nll_loss */
} nll_ctx;

static td_status nll_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  nll_ctx *c = ctx;
  return c->ce ? td_tensor_cross_entropy(in[0], c->target, c->red, c->ignore, out)
               : td_tensor_nll_loss(in[0], c->target, c->red, c->ignore, out);
}

static void test_nll_loss_gradcheck(void **state) {
  (void)state;
  const int64_t shape[] = {5, 4}, tshape[] = {5};
  const int64_t tv[] = {1, 3, 0, 3, 2};
  td_tensor *x = td_test_randn(shape, 2, TD_DTYPE_F64, 5, true);
  td_tensor *t = nn_i64(tv, tshape, 1);
  const td_reduction reds[] = {TD_REDUCTION_MEAN, TD_REDUCTION_SUM, TD_REDUCTION_NONE};
  for (int ce = 0; ce < 2; ce++)
    for (int r = 0; r < 3; r++)
      for (int ig = 0; ig < 2; ig++) {
        nll_ctx c = {t, reds[r], ig ? 3 : -100, ce != 0};
        td_test_gradcheck(nll_fn, &c, &x, 1, 1e-6, 1e-7, 1e-5);
      }
  td_tensor_unref(t);
  td_tensor_unref(x);

  /* 1-d input with a 0-d target. */
  const int64_t cshape[] = {4}, three = 3;
  td_tensor *x1 = td_test_randn(cshape, 1, TD_DTYPE_F64, 6, true);
  td_tensor *t0 = nn_i64(&three, NULL, 0);
  for (int ce = 0; ce < 2; ce++)
    for (int r = 0; r < 3; r++) {
      nll_ctx c = {t0, reds[r], -100, ce != 0};
      td_test_gradcheck(nll_fn, &c, &x1, 1, 1e-6, 1e-7, 1e-5);
    }
  td_tensor_unref(t0);
  td_tensor_unref(x1);
}

static void test_nll_loss_misuse(void **state) {
  (void)state;
  const int64_t shape[] = {3, 4}, tshape[] = {3}, t2shape[] = {2};
  td_tensor *x = td_test_randn(shape, 2, TD_DTYPE_F64, 1, false), *y = NULL;
  const int64_t bad[] = {1, 4, 0}, neg[] = {1, -1, 0}, ok[] = {1, 2, 0};
  td_tensor *tbad = nn_i64(bad, tshape, 1), *tneg = nn_i64(neg, tshape, 1);
  td_tensor *tok = nn_i64(ok, tshape, 1), *t2 = nn_i64(ok, t2shape, 1);

  TD_ASSERT_STATUS(td_tensor_nll_loss(x, tbad, TD_REDUCTION_MEAN, -100, &y), TD_ERR_INVALID);
  nn_expect_error("nll_loss", "target 4");
  TD_ASSERT_STATUS(td_tensor_nll_loss(x, tneg, TD_REDUCTION_SUM, -100, &y), TD_ERR_INVALID);
  nn_expect_error("target -1", "position 1");
  TD_ASSERT_STATUS(td_tensor_cross_entropy(x, tbad, TD_REDUCTION_NONE, -100, &y), TD_ERR_INVALID);
  /* An out-of-range value equal to ignore_index is fine. */
  TD_ASSERT_OK(td_tensor_nll_loss(x, tbad, TD_REDUCTION_MEAN, 4, &y));
  td_tensor_unref(y);
  y = NULL;

  TD_ASSERT_STATUS(td_tensor_nll_loss(x, t2, TD_REDUCTION_MEAN, -100, &y), TD_ERR_SHAPE);
  nn_expect_error("nll_loss", "[3, 4]");
  TD_ASSERT_STATUS(td_tensor_cross_entropy(x, t2, TD_REDUCTION_MEAN, -100, &y), TD_ERR_SHAPE);
  nn_expect_error("cross_entropy", "[2]");

  td_tensor *tf, *xi;
  TD_ASSERT_OK(td_tensor_to_dtype(tok, TD_DTYPE_F64, &tf));
  TD_ASSERT_STATUS(td_tensor_nll_loss(x, tf, TD_REDUCTION_MEAN, -100, &y), TD_ERR_DTYPE);
  nn_expect_error("target", "int64");
  TD_ASSERT_STATUS(td_tensor_cross_entropy(x, tf, TD_REDUCTION_MEAN, -100, &y), TD_ERR_DTYPE);
  TD_ASSERT_OK(td_tensor_zeros(shape, 2, TD_DTYPE_I64, td_device_cpu(), &xi));
  TD_ASSERT_STATUS(td_tensor_nll_loss(xi, tok, TD_REDUCTION_MEAN, -100, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_cross_entropy(xi, tok, TD_REDUCTION_MEAN, -100, &y), TD_ERR_DTYPE);

  TD_ASSERT_STATUS(td_tensor_nll_loss(NULL, tok, TD_REDUCTION_MEAN, -100, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_nll_loss(x, NULL, TD_REDUCTION_MEAN, -100, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_nll_loss(x, tok, TD_REDUCTION_MEAN, -100, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_cross_entropy(x, NULL, TD_REDUCTION_MEAN, -100, &y),
                   TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_nll_loss(x, tok, (td_reduction)7, -100, &y), TD_ERR_INVALID);

  /* 3-d input is not supported. */
  const int64_t s3[] = {3, 4, 2};
  td_tensor *x3 = td_test_randn(s3, 3, TD_DTYPE_F64, 2, false);
  TD_ASSERT_STATUS(td_tensor_cross_entropy(x3, tok, TD_REDUCTION_MEAN, -100, &y), TD_ERR_SHAPE);
  assert_null(y);

  td_tensor_unref(x3);
  td_tensor_unref(xi);
  td_tensor_unref(tf);
  td_tensor_unref(t2);
  td_tensor_unref(tok);
  td_tensor_unref(tneg);
  td_tensor_unref(tbad);
  td_tensor_unref(x);
}

/* ---- mse_loss ---- */

static void test_mse_loss_values(void **state) {
  (void)state;
  const double av[] = {1, 2, 3, 4}, bv[] = {1.5, 1.0, 3.0, 2.0};
  const int64_t shape[] = {2, 2};
  td_tensor *a = nn_f64(av, shape, 2, false), *b = nn_f64(bv, shape, 2, false), *y;
  /* (a - b)^2 = 0.25, 1, 0, 4 */
  TD_ASSERT_OK(td_tensor_mse_loss(a, b, TD_REDUCTION_MEAN, &y));
  assert_true(fabs(nn_item(y) - 1.3125) < 1e-15);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_mse_loss(a, b, TD_REDUCTION_SUM, &y));
  assert_true(fabs(nn_item(y) - 5.25) < 1e-15);
  td_tensor_unref(y);
  TD_ASSERT_OK(td_tensor_mse_loss(a, b, TD_REDUCTION_NONE, &y));
  const double none[] = {0.25, 1, 0, 4};
  nn_expect_shape(y, shape, 2);
  nn_expect("mse none", y, none, 4, 1e-15);
  td_tensor_unref(y);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

static td_status mse_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  return td_tensor_mse_loss(in[0], in[1], *(td_reduction *)ctx, out);
}

static void test_mse_loss_gradcheck(void **state) {
  (void)state;
  const int64_t shape[] = {3, 4};
  td_tensor *in[2] = {td_test_randn(shape, 2, TD_DTYPE_F64, 3, true),
                      td_test_randn(shape, 2, TD_DTYPE_F64, 4, true)};
  for (int r = 0; r < 3; r++) {
    td_reduction red = (td_reduction)r;
    td_test_gradcheck(mse_fn, &red, in, 2, 1e-6, 1e-7, 1e-5);
  }
  td_tensor_unref(in[0]);
  td_tensor_unref(in[1]);
}

static void test_mse_loss_misuse(void **state) {
  (void)state;
  const int64_t s1[] = {3, 4}, s2[] = {4, 3};
  td_tensor *a = td_test_randn(s1, 2, TD_DTYPE_F64, 3, false);
  td_tensor *b = td_test_randn(s2, 2, TD_DTYPE_F64, 4, false);
  td_tensor *c = td_test_randn(s1, 2, TD_DTYPE_F32, 4, false), *y = NULL;
  TD_ASSERT_STATUS(td_tensor_mse_loss(a, b, TD_REDUCTION_MEAN, &y), TD_ERR_SHAPE);
  nn_expect_error("mse_loss", "[4, 3]");
  TD_ASSERT_STATUS(td_tensor_mse_loss(a, c, TD_REDUCTION_MEAN, &y), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_mse_loss(a, NULL, TD_REDUCTION_MEAN, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_mse_loss(a, a, (td_reduction)-1, &y), TD_ERR_INVALID);
  assert_null(y);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_softmax_forward_matches_torch),
      cmocka_unit_test(test_softmax_inner_dims_match_torch),
      cmocka_unit_test(test_softmax_large_logits_are_stable),
      cmocka_unit_test(test_softmax_gradcheck),
      cmocka_unit_test(test_softmax_misuse),
      cmocka_unit_test(test_nll_loss_matches_torch),
      cmocka_unit_test(test_nll_loss_all_ignored_mean_is_nan),
      cmocka_unit_test(test_cross_entropy_matches_torch),
      cmocka_unit_test(test_nll_loss_gradcheck),
      cmocka_unit_test(test_nll_loss_misuse),
      cmocka_unit_test(test_mse_loss_values),
      cmocka_unit_test(test_mse_loss_gradcheck),
      cmocka_unit_test(test_mse_loss_misuse),
  };
  return cmocka_run_group_tests_name("tensor_nn_softmax", tests, NULL, NULL);
}
