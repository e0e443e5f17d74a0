/* test_ops.c - forward values and finite-difference gradients of the elementwise, reduction,
 * matmul and view ops. */
#include <math.h>
#include <string.h>

#include "test_util.h"

#define F64 TD_DTYPE_F64

typedef enum {
  OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_MAXIMUM, OP_EXP, OP_LOG, OP_SQRT, OP_TANH, OP_SIGMOID,
  OP_RELU, OP_GELU, OP_POW3, OP_ADDS, OP_MULS, OP_NEG, OP_SUM01, OP_SUMK, OP_MEAN1, OP_MEANALL,
  OP_MAX1, OP_MATMUL, OP_RESHAPE, OP_TRANSPOSE, OP_NARROW, OP_PERMUTE, OP_EXPAND, OP_UNSQ,
  OP_CLONE, OP_SQUEEZE, OP_FLATTEN, OP_TODTYPE, OP_MATMUL_TT,
} op_id;

static td_status run_op(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  op_id op = (op_id)(intptr_t)ctx;
  switch (op) {
    case OP_ADD: return td_tensor_add(in[0], in[1], out);
    case OP_SUB: return td_tensor_sub(in[0], in[1], out);
    case OP_MUL: return td_tensor_mul(in[0], in[1], out);
    case OP_DIV: return td_tensor_div(in[0], in[1], out);
    case OP_MAXIMUM: return td_tensor_maximum(in[0], in[1], out);
    case OP_EXP: return td_tensor_exp(in[0], out);
    case OP_LOG: return td_tensor_log(in[0], out);
    case OP_SQRT: return td_tensor_sqrt(in[0], out);
    case OP_TANH: return td_tensor_tanh(in[0], out);
    case OP_SIGMOID: return td_tensor_sigmoid(in[0], out);
    case OP_RELU: return td_tensor_relu(in[0], out);
    case OP_GELU: return td_tensor_gelu(in[0], out);
    case OP_POW3: return td_tensor_pow_scalar(in[0], 3.0, out);
    case OP_ADDS: return td_tensor_add_scalar(in[0], 2.5, out);
    case OP_MULS: return td_tensor_mul_scalar(in[0], -1.5, out);
    case OP_NEG: return td_tensor_neg(in[0], out);
    case OP_SUM01: {
      int dims[2] = {0, -1};
      return td_tensor_sum(in[0], dims, 2, false, out);
    }
    case OP_SUMK: {
      int dims[1] = {1};
      return td_tensor_sum(in[0], dims, 1, true, out);
    }
    case OP_MEAN1: {
      int dims[1] = {1};
      return td_tensor_mean(in[0], dims, 1, false, out);
    }
    case OP_MEANALL: return td_tensor_mean_all(in[0], out);
    case OP_MAX1: return td_tensor_max(in[0], 1, false, out, NULL);
    case OP_MATMUL: return td_tensor_matmul(in[0], in[1], out);
    case OP_MATMUL_TT: { /* both operands are transposed views: GEMM reads them in place */
      td_tensor *at, *bt;
      TD_ASSERT_OK(td_tensor_transpose(in[0], 0, 1, &at));
      TD_ASSERT_OK(td_tensor_transpose(in[1], 0, 1, &bt));
      td_status st = td_tensor_matmul(at, bt, out);
      td_tensor_unref(at);
      td_tensor_unref(bt);
      return st;
    }
    case OP_RESHAPE: {
      int64_t s[2] = {-1, 2};
      return td_tensor_reshape(in[0], s, 2, out);
    }
    case OP_TRANSPOSE: {
      td_tensor *t;
      TD_ASSERT_OK(td_tensor_transpose(in[0], 0, 1, &t));
      td_status st = td_tensor_mul(t, t, out); /* exercise a strided kernel input */
      td_tensor_unref(t);
      return st;
    }
    case OP_NARROW: return td_tensor_narrow(in[0], 1, 1, 2, out);
    case OP_PERMUTE: {
      int p[3] = {2, 0, 1};
      return td_tensor_permute(in[0], p, 3, out);
    }
    case OP_EXPAND: {
      int64_t s[3] = {4, 3, 2};
      return td_tensor_expand(in[0], s, 3, out);
    }
    case OP_UNSQ: return td_tensor_unsqueeze(in[0], 1, out);
    case OP_CLONE: return td_tensor_clone(in[0], out);
    case OP_SQUEEZE: return td_tensor_squeeze(in[0], 1, out);
    case OP_FLATTEN: return td_tensor_flatten(in[0], 1, -1, out);
    case OP_TODTYPE: {
      td_tensor *f;
      td_status st0 = td_tensor_to_dtype(in[0], TD_DTYPE_F32, &f);
      if (st0 != TD_OK) return st0;
      td_tensor *b;
      td_status st = td_tensor_to_dtype(f, TD_DTYPE_F64, &b);
      td_tensor_unref(f);
      if (st != TD_OK) return st;
      st = td_tensor_mul(b, b, out);
      td_tensor_unref(b);
      return st;
    }
  }
  return TD_ERR_INVALID;
}

static void check1_tol(op_id op, const int64_t *shape, int nd, double lo, double hi, double eps,
                       double rtol) {
  td_tensor *x = td_test_rand(shape, nd, F64, lo, hi, 7 + op, true);
  td_tensor *in[1] = {x};
  td_test_gradcheck(run_op, (void *)(intptr_t)op, in, 1, eps, 1e-6, rtol);
  td_tensor_unref(x);
}

static void check1(op_id op, const int64_t *shape, int nd, double lo, double hi) {
  td_tensor *x = td_test_rand(shape, nd, F64, lo, hi, 7 + op, true);
  td_tensor *in[1] = {x};
  td_test_gradcheck(run_op, (void *)(intptr_t)op, in, 1, 1e-6, 1e-6, 1e-5);
  td_tensor_unref(x);
}

static void check2(op_id op, const int64_t *sa, int na, const int64_t *sb, int nb, double lo,
                   double hi) {
  td_tensor *a = td_test_rand(sa, na, F64, lo, hi, 11 + op, true);
  td_tensor *b = td_test_rand(sb, nb, F64, lo, hi, 13 + op, true);
  td_tensor *in[2] = {a, b};
  td_test_gradcheck(run_op, (void *)(intptr_t)op, in, 2, 1e-6, 1e-6, 1e-5);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

static void test_ops_binary_grad(void **state) {
  int64_t s23[2] = {2, 3}, s3[1] = {3}, s21[2] = {2, 1}, s423[3] = {4, 2, 3};
  for (op_id op = OP_ADD; op <= OP_DIV; op++) {
    check2(op, s23, 2, s23, 2, 0.5, 2.0);
    check2(op, s23, 2, s3, 1, 0.5, 2.0);  /* broadcast trailing */
    check2(op, s21, 2, s423, 3, 0.5, 2.0); /* broadcast both ways */
  }
  check2(OP_MAXIMUM, s23, 2, s3, 1, -1.0, 1.0);
}

static void test_ops_unary_grad(void **state) {
  int64_t s[2] = {3, 4};
  check1(OP_EXP, s, 2, -1, 1);
  check1(OP_LOG, s, 2, 0.5, 2);
  check1(OP_SQRT, s, 2, 0.5, 2);
  check1(OP_TANH, s, 2, -2, 2);
  check1(OP_SIGMOID, s, 2, -3, 3);
  check1(OP_RELU, s, 2, -1, 1);
  check1(OP_GELU, s, 2, -2, 2);
  check1(OP_POW3, s, 2, -2, 2);
  check1(OP_ADDS, s, 2, -2, 2);
  check1(OP_MULS, s, 2, -2, 2);
  check1(OP_NEG, s, 2, -2, 2);
}

static void test_ops_reduce_grad(void **state) {
  int64_t s[3] = {2, 3, 4};
  check1(OP_SUM01, s, 3, -1, 1);
  check1(OP_SUMK, s, 3, -1, 1);
  check1(OP_MEAN1, s, 3, -1, 1);
  check1(OP_MEANALL, s, 3, -1, 1);
  check1(OP_MAX1, s, 3, -1, 1);
}

static void test_ops_matmul_grad(void **state) {
  int64_t a2[2] = {3, 4}, b2[2] = {4, 5}, v4[1] = {4}, a3[3] = {2, 3, 4}, b3[3] = {2, 4, 5},
          b31[3] = {1, 4, 5}, a4[4] = {2, 1, 3, 4};
  check2(OP_MATMUL, a2, 2, b2, 2, -1, 1);
  check2(OP_MATMUL, v4, 1, v4, 1, -1, 1);
  check2(OP_MATMUL, v4, 1, b2, 2, -1, 1);
  check2(OP_MATMUL, a2, 2, v4, 1, -1, 1);
  check2(OP_MATMUL, a3, 3, b2, 2, -1, 1);
  check2(OP_MATMUL, a3, 3, b3, 3, -1, 1);
  check2(OP_MATMUL, a4, 4, b31, 3, -1, 1);
  check2(OP_MATMUL, v4, 1, b3, 3, -1, 1);
  int64_t ka[2] = {4, 3}, nb[2] = {5, 4};
  check2(OP_MATMUL_TT, ka, 2, nb, 2, -1, 1); /* [3,4] @ [4,5] from transposed storage */
}

/* x @ W^T (the Linear layout) must match a contiguous computation and give W a contiguous
 * gradient in W's own layout. */
static void test_ops_matmul_transposed_weight(void **state) {
  int64_t xs[2] = {6, 4}, ws[2] = {3, 4};
  td_tensor *x = td_test_randn(xs, 2, F64, 1, true), *w = td_test_randn(ws, 2, F64, 2, true);
  td_tensor *wt, *y, *s, *wtc, *y2;
  TD_ASSERT_OK(td_tensor_transpose(w, 0, 1, &wt));
  TD_ASSERT_OK(td_tensor_matmul(x, wt, &y));
  bool prev = td_autograd_set_enabled(false);
  TD_ASSERT_OK(td_tensor_contiguous(wt, &wtc));
  TD_ASSERT_OK(td_tensor_matmul(x, wtc, &y2));
  td_autograd_set_enabled(prev);
  td_test_assert_close("x @ W^T", y, y2, 1e-12, 1e-12);
  TD_ASSERT_OK(td_tensor_sum_all(y, &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor *gw = td_tensor_grad(w);
  assert_true(td_tensor_is_contiguous(gw));
  td_tensor *ts[] = {x, w, wt, y, s, wtc, y2, gw};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) td_tensor_unref(ts[i]);
}

static void test_ops_view_grad(void **state) {
  int64_t s[2] = {3, 4}, s3[3] = {2, 3, 4}, s31[2] = {3, 1}, s312[3] = {3, 1, 2};
  check1(OP_RESHAPE, s, 2, -1, 1);
  check1(OP_TRANSPOSE, s, 2, -1, 1);
  check1(OP_NARROW, s, 2, -1, 1);
  check1(OP_PERMUTE, s3, 3, -1, 1);
  check1(OP_EXPAND, s31, 2, -1, 1);
  check1(OP_UNSQ, s, 2, -1, 1);
  check1(OP_CLONE, s, 2, -1, 1);
  check1(OP_SQUEEZE, s312, 3, -1, 1);
  check1(OP_FLATTEN, s3, 3, -1, 1);
  /* through float32: x*x is exact under central differences, so only rounding remains */
  check1_tol(OP_TODTYPE, s, 2, -1, 1, 1e-2, 1e-4);
}

static void test_ops_forward_values(void **state) {
  double av[6] = {1, 2, 3, 4, 5, 6}, bv[3] = {10, 20, 30};
  int64_t sa[2] = {2, 3}, sb[1] = {3};
  td_tensor *a = td_test_tensor(av, sa, 2, TD_DTYPE_F32, false);
  td_tensor *b = td_test_tensor(bv, sb, 1, TD_DTYPE_F32, false);
  td_tensor *r, *e;
  TD_ASSERT_OK(td_tensor_add(a, b, &r));
  double ev[6] = {11, 22, 33, 14, 25, 36};
  e = td_test_tensor(ev, sa, 2, TD_DTYPE_F32, false);
  td_test_assert_close("add", r, e, 0, 0);
  td_tensor_unref(r);
  td_tensor_unref(e);
  /* matmul [2,3] @ [3] = [1*10+2*20+3*30, 4*10+5*20+6*30] */
  TD_ASSERT_OK(td_tensor_matmul(a, b, &r));
  double mv[2] = {140, 320};
  int64_t s2[1] = {2};
  e = td_test_tensor(mv, s2, 1, TD_DTYPE_F32, false);
  td_test_assert_close("matmul", r, e, 0, 0);
  td_tensor_unref(r);
  td_tensor_unref(e);
  /* sum over dim 0 */
  int d0 = 0;
  TD_ASSERT_OK(td_tensor_sum(a, &d0, 1, false, &r));
  double sv[3] = {5, 7, 9};
  e = td_test_tensor(sv, sb, 1, TD_DTYPE_F32, false);
  td_test_assert_close("sum", r, e, 0, 0);
  td_tensor_unref(r);
  td_tensor_unref(e);
  /* max / argmax over dim 1 */
  td_tensor *idx;
  TD_ASSERT_OK(td_tensor_max(a, 1, false, &r, &idx));
  double v;
  int64_t i1[1] = {1};
  TD_ASSERT_OK(td_tensor_get(r, i1, &v));
  assert_true(v == 6.0);
  TD_ASSERT_OK(td_tensor_get(idx, i1, &v));
  assert_true(v == 2.0);
  assert_int_equal(td_tensor_dtype(idx), TD_DTYPE_I64);
  td_tensor_unref(r);
  td_tensor_unref(idx);
  /* gelu(1) = 0.8413447460685429 */
  td_tensor *one, *g;
  TD_ASSERT_OK(td_tensor_scalar(1.0, TD_DTYPE_F64, td_device_cpu(), &one));
  TD_ASSERT_OK(td_tensor_gelu(one, &g));
  TD_ASSERT_OK(td_tensor_item(g, &v));
  assert_true(fabs(v - 0.8413447460685429) < 1e-12);
  td_tensor_unref(one);
  td_tensor_unref(g);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

static void test_ops_inplace(void **state) {
  double tv[3] = {1, 2, 3}, ov[3] = {4, 5, 6};
  int64_t s[1] = {3};
  td_tensor *t = td_test_tensor(tv, s, 1, TD_DTYPE_F32, false);
  td_tensor *o = td_test_tensor(ov, s, 1, TD_DTYPE_F32, false);
  TD_ASSERT_OK(td_tensor_add_(t, o, 0.5));     /* 3, 4.5, 6 */
  TD_ASSERT_OK(td_tensor_mul_scalar_(t, 2.0)); /* 6, 9, 12 */
  TD_ASSERT_OK(td_tensor_addcmul_(t, o, o, 1.0)); /* 22, 34, 48 */
  TD_ASSERT_OK(td_tensor_addcdiv_(t, o, o, -2.0)); /* 20, 32, 46 */
  TD_ASSERT_OK(td_tensor_maximum_(t, o));
  double ev[3] = {20, 32, 46};
  td_tensor *e = td_test_tensor(ev, s, 1, TD_DTYPE_F32, false);
  td_test_assert_close("inplace", t, e, 0, 0);
  int64_t s2[1] = {2};
  td_tensor *bad = td_test_tensor(ev, s2, 1, TD_DTYPE_F32, false);
  TD_ASSERT_STATUS(td_tensor_add_(t, bad, 1.0), TD_ERR_SHAPE);
  td_tensor_unref(bad);
  td_tensor_unref(e);
  td_tensor_unref(t);
  td_tensor_unref(o);
}

static void test_ops_misuse(void **state) {
  int64_t s23[2] = {2, 3}, s4[1] = {4}, s32[2] = {3, 2};
  td_tensor *a = td_test_randn(s23, 2, TD_DTYPE_F32, 1, false);
  td_tensor *b = td_test_randn(s4, 1, TD_DTYPE_F32, 2, false);
  td_tensor *c = td_test_randn(s32, 2, TD_DTYPE_F64, 3, false);
  td_tensor *r = NULL;
  TD_ASSERT_STATUS(td_tensor_add(a, b, &r), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "[2, 3]"));
  assert_null(r);
  TD_ASSERT_STATUS(td_tensor_matmul(a, a, &r), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_matmul(a, c, &r), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_add(NULL, a, &r), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_add(a, a, NULL), TD_ERR_INVALID);
  int64_t bad[2] = {5, 5};
  TD_ASSERT_STATUS(td_tensor_reshape(a, bad, 2, &r), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_tensor_narrow(a, 1, 2, 5, &r), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_transpose(a, 0, 5, &r), TD_ERR_INVALID);
  int d = 7;
  TD_ASSERT_STATUS(td_tensor_sum(a, &d, 1, false, &r), TD_ERR_INVALID);
  td_tensor *i64;
  TD_ASSERT_OK(td_tensor_arange(0, 4, 1, TD_DTYPE_I64, td_device_cpu(), &i64));
  TD_ASSERT_STATUS(td_tensor_exp(i64, &r), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_set_requires_grad(i64, true), TD_ERR_DTYPE);
  td_tensor *z;
  TD_ASSERT_OK(td_tensor_zeros(s4, 1, TD_DTYPE_I64, td_device_cpu(), &z));
  TD_ASSERT_STATUS(td_tensor_div(i64, z, &r), TD_ERR_INVALID);
  assert_null(r);
  td_tensor_unref(z);
  td_tensor_unref(i64);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_binary_grad),  cmocka_unit_test(test_ops_unary_grad),
      cmocka_unit_test(test_ops_reduce_grad),  cmocka_unit_test(test_ops_matmul_grad),
      cmocka_unit_test(test_ops_matmul_transposed_weight),
      cmocka_unit_test(test_ops_view_grad),    cmocka_unit_test(test_ops_forward_values),
      cmocka_unit_test(test_ops_inplace),      cmocka_unit_test(test_ops_misuse),
  };
  return cmocka_run_group_tests_name("ops", tests, NULL, NULL);
}
