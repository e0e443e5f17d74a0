/* test_dtypes.c - the dtypes beyond float32/float64/int64 (float16, bfloat16, int32, uint8,
 * bool): sizes and names, creation, views, copies, conversions to and from every dtype with the
 * exact bit patterns of IEEE binary16 / bfloat16 rounding, element reads, comparisons, the clear
 * TD_ERR_DTYPE that every computing op and autograd give the transport-only ones (int32, uint8,
 * bool), and CUDA placement refused for all of them. (The 16-bit floats' arithmetic:
 * test_half.c.) */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "test_util.h"

static const td_dtype transport[] = {TD_DTYPE_F16, TD_DTYPE_BF16, TD_DTYPE_I32, TD_DTYPE_U8,
                                     TD_DTYPE_BOOL};
#define NT ((int)(sizeof transport / sizeof transport[0]))
static const td_dtype transport_only[] = {TD_DTYPE_I32, TD_DTYPE_U8, TD_DTYPE_BOOL};
#define NTO ((int)(sizeof transport_only / sizeof transport_only[0]))

static void test_dtype_sizes_and_names(void **state) {
  (void)state;
  static const struct {
    td_dtype dt;
    size_t size;
    const char *name;
  } want[] = {{TD_DTYPE_F32, 4, "float32"}, {TD_DTYPE_F64, 8, "float64"},
              {TD_DTYPE_I64, 8, "int64"},   {TD_DTYPE_F16, 2, "float16"},
              {TD_DTYPE_BF16, 2, "bfloat16"}, {TD_DTYPE_I32, 4, "int32"},
              {TD_DTYPE_U8, 1, "uint8"},    {TD_DTYPE_BOOL, 1, "bool"}};
  assert_int_equal(sizeof want / sizeof want[0], TD_DTYPE_COUNT);
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    assert_int_equal(td_dtype_size(want[i].dt), want[i].size);
    assert_string_equal(td_dtype_name(want[i].dt), want[i].name);
  }
  assert_int_equal(td_dtype_size((td_dtype)TD_DTYPE_COUNT), 0);
  assert_string_equal(td_dtype_name((td_dtype)TD_DTYPE_COUNT), "unknown");
  td_tensor *t = NULL;
  int64_t shape[1] = {2};
  TD_ASSERT_STATUS(td_tensor_empty(shape, 1, (td_dtype)TD_DTYPE_COUNT, td_device_cpu(), &t),
                   TD_ERR_DTYPE);
  assert_null(t);
}

/* Converts one double to dt and returns the element's bits (zero-extended). */
static uint64_t bits_of(double v, td_dtype dt) {
  td_tensor *s = NULL, *c = NULL;
  TD_ASSERT_OK(td_tensor_scalar(v, TD_DTYPE_F64, td_device_cpu(), &s));
  TD_ASSERT_OK(td_tensor_to_dtype(s, dt, &c));
  assert_int_equal(td_tensor_dtype(c), dt);
  uint64_t b = 0;
  memcpy(&b, td_tensor_data(c), td_dtype_size(dt));
  td_tensor_unref(c);
  td_tensor_unref(s);
  return b;
}

/* Builds a 0-d tensor of dt from raw bits and reads it back as a double. */
static double value_of(uint64_t bits, td_dtype dt) {
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(&bits, NULL, 0, dt, &t));
  double v = 0;
  TD_ASSERT_OK(td_tensor_item(t, &v));
  td_tensor_unref(t);
  return v;
}

static void test_dtype_float16_bits(void **state) {
  (void)state;
  assert_int_equal(bits_of(1.0, TD_DTYPE_F16), 0x3c00);
  assert_int_equal(bits_of(-2.0, TD_DTYPE_F16), 0xc000);
  assert_int_equal(bits_of(0.1, TD_DTYPE_F16), 0x2e66);         /* rounded down */
  assert_int_equal(bits_of(65504.0, TD_DTYPE_F16), 0x7bff);     /* largest finite */
  assert_int_equal(bits_of(65519.0, TD_DTYPE_F16), 0x7bff);     /* just below the tie */
  assert_int_equal(bits_of(65520.0, TD_DTYPE_F16), 0x7c00);     /* ties to even: inf */
  assert_int_equal(bits_of(1e6, TD_DTYPE_F16), 0x7c00);
  assert_int_equal(bits_of(-INFINITY, TD_DTYPE_F16), 0xfc00);
  assert_int_equal(bits_of(ldexp(1, -24), TD_DTYPE_F16), 0x0001); /* smallest subnormal */
  assert_int_equal(bits_of(ldexp(1, -25), TD_DTYPE_F16), 0x0000); /* tie to even: 0 */
  assert_int_equal(bits_of(ldexp(3, -25), TD_DTYPE_F16), 0x0002); /* tie to even: 2 */
  assert_int_equal(bits_of(ldexp(1, -14), TD_DTYPE_F16), 0x0400); /* smallest normal */
  assert_int_equal(bits_of(1.0 + ldexp(1, -11), TD_DTYPE_F16), 0x3c00); /* tie: even */
  assert_int_equal(bits_of(1.0 + ldexp(3, -11), TD_DTYPE_F16), 0x3c02);
  assert_int_equal(bits_of(-0.0, TD_DTYPE_F16), 0x8000);
  uint64_t nan = bits_of(NAN, TD_DTYPE_F16);
  assert_true((nan & 0x7c00) == 0x7c00 && (nan & 0x3ff) != 0);
  assert_true(value_of(0x3555, TD_DTYPE_F16) == 0.333251953125);
  assert_true(value_of(0x0001, TD_DTYPE_F16) == ldexp(1, -24));
  assert_true(value_of(0x7bff, TD_DTYPE_F16) == 65504.0);
  assert_true(isinf(value_of(0xfc00, TD_DTYPE_F16)) && value_of(0xfc00, TD_DTYPE_F16) < 0);
  assert_true(isnan(value_of(0x7e00, TD_DTYPE_F16)));
}

static void test_dtype_bfloat16_bits(void **state) {
  (void)state;
  assert_int_equal(bits_of(1.0, TD_DTYPE_BF16), 0x3f80);
  assert_int_equal(bits_of(-3.0, TD_DTYPE_BF16), 0xc040);
  assert_int_equal(bits_of(1.0 + ldexp(1, -8), TD_DTYPE_BF16), 0x3f80); /* tie: even */
  assert_int_equal(bits_of(1.0 + ldexp(3, -8), TD_DTYPE_BF16), 0x3f82); /* tie: even (up) */
  assert_int_equal(bits_of(3.4e38, TD_DTYPE_BF16), 0x7f80);             /* rounds to inf */
  uint64_t nan = bits_of(NAN, TD_DTYPE_BF16);
  assert_true((nan & 0x7f80) == 0x7f80 && (nan & 0x7f) != 0);
  assert_true(value_of(0x4049, TD_DTYPE_BF16) == 3.140625);
  assert_true(isnan(value_of(0x7fc1, TD_DTYPE_BF16)));
}

static void test_dtype_integer_conversions(void **state) {
  (void)state;
  assert_int_equal(bits_of(-7.9, TD_DTYPE_I32), (uint32_t)-7); /* truncation */
  assert_int_equal(bits_of(2147483648.0, TD_DTYPE_I32), 0x80000000u); /* wraps */
  assert_int_equal(bits_of(300.0, TD_DTYPE_U8), 44);                   /* wraps */
  assert_int_equal(bits_of(255.9, TD_DTYPE_U8), 255);
  assert_int_equal(bits_of(0.5, TD_DTYPE_BOOL), 1);
  assert_int_equal(bits_of(-2.0, TD_DTYPE_BOOL), 1);
  assert_int_equal(bits_of(0.0, TD_DTYPE_BOOL), 0);
  assert_true(value_of(0xffffffffu, TD_DTYPE_I32) == -1.0);
  assert_true(value_of(200, TD_DTYPE_U8) == 200.0);
  assert_true(value_of(1, TD_DTYPE_BOOL) == 1.0);
}

/* Every pair of dtypes converts through double: values that every dtype holds exactly come back
 * unchanged, both ways, for strided sources too. */
static void test_dtype_conversion_matrix(void **state) {
  (void)state;
  const double bits[6] = {0, 1, 1, 0, 0, 1}, small[6] = {0, 1, 100, 7, 3, 255};
  int64_t shape[2] = {2, 3};
  for (int a = 0; a < TD_DTYPE_COUNT; a++) {
    for (int b = 0; b < TD_DTYPE_COUNT; b++) { /* values every dtype of the pair holds */
      const double *v = a == TD_DTYPE_BOOL || b == TD_DTYPE_BOOL ? bits : small;
      td_tensor *x = td_test_tensor(v, shape, 2, (td_dtype)a, false), *xt = NULL, *y = NULL,
                *back = NULL;
      TD_ASSERT_OK(td_tensor_transpose(x, 0, 1, &xt)); /* strided source */
      TD_ASSERT_OK(td_tensor_to_dtype(xt, (td_dtype)b, &y));
      TD_ASSERT_OK(td_tensor_to_dtype(y, (td_dtype)a, &back));
      bool same = false;
      TD_ASSERT_OK(td_tensor_allclose(back, xt, 0, 0, &same));
      if (!same) fail_msg("%s -> %s -> %s changed the values", td_dtype_name((td_dtype)a),
                          td_dtype_name((td_dtype)b), td_dtype_name((td_dtype)a));
      int64_t idx[2] = {2, 1};
      double got = -1;
      TD_ASSERT_OK(td_tensor_get(y, idx, &got));
      assert_true(got == v[1 * 3 + 2]);
      td_tensor_unref(back), td_tensor_unref(y), td_tensor_unref(xt), td_tensor_unref(x);
    }
  }
}

/* Creation, fill, views, contiguous copies, borrowed buffers and copy_ keep the bytes. */
static void test_dtype_create_view_copy(void **state) {
  (void)state;
  for (int k = 0; k < NT; k++) {
    td_dtype dt = transport[k];
    size_t es = td_dtype_size(dt);
    int64_t shape[2] = {3, 4};
    uint8_t buf[3 * 4 * 4];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(i * 7 + 1);
    if (dt == TD_DTYPE_BOOL)
      for (size_t i = 0; i < sizeof buf; i++) buf[i] &= 1;
    td_tensor *t = NULL, *tt = NULL, *c = NULL, *b = NULL, *z = NULL, *one = NULL;
    TD_ASSERT_OK(td_tensor_from_buffer(buf, shape, 2, dt, &t));
    assert_int_equal(td_tensor_nbytes(t), 12 * es);
    assert_memory_equal(td_tensor_data(t), buf, 12 * es);
    TD_ASSERT_OK(td_tensor_transpose(t, 0, 1, &tt));
    TD_ASSERT_OK(td_tensor_contiguous(tt, &c)); /* a strided copy: element bytes moved */
    for (int i = 0; i < 3; i++)
      for (int j = 0; j < 4; j++)
        assert_memory_equal((char *)td_tensor_data(c) + (size_t)(j * 3 + i) * es,
                            buf + (size_t)(i * 4 + j) * es, es);
    uint8_t out[3 * 4 * 4];
    TD_ASSERT_OK(td_tensor_copy_to_buffer(tt, out, sizeof out));
    assert_memory_equal(out, td_tensor_data(c), 12 * es);
    TD_ASSERT_OK(td_tensor_from_borrowed(buf, shape, 2, dt, NULL, NULL, &b));
    assert_ptr_equal(td_tensor_data(b), buf);
    TD_ASSERT_OK(td_tensor_zeros(shape, 2, dt, td_device_cpu(), &z));
    TD_ASSERT_OK(td_tensor_copy_(z, t));
    assert_memory_equal(td_tensor_data(z), buf, 12 * es);
    TD_ASSERT_OK(td_tensor_ones(shape, 2, dt, td_device_cpu(), &one));
    int64_t idx[2] = {2, 3};
    double v = 0;
    TD_ASSERT_OK(td_tensor_get(one, idx, &v));
    assert_true(v == 1.0);
    bool same = false;
    TD_ASSERT_OK(td_tensor_allclose(c, tt, 0, 0, &same));
    assert_true(same);
    td_tensor_unref(one), td_tensor_unref(z), td_tensor_unref(b), td_tensor_unref(c);
    td_tensor_unref(tt), td_tensor_unref(t);
  }
}

/* Ops that compute refuse transport-only dtypes with TD_ERR_DTYPE naming the op and the dtype. */
static void test_dtype_ops_refused(void **state) {
  (void)state;
  for (int k = 0; k < NTO; k++) {
    td_dtype dt = transport_only[k];
    const char *name = td_dtype_name(dt);
    int64_t shape[2] = {2, 2}, ish[1] = {1};
    td_tensor *a = NULL, *i64 = NULL, *r = NULL, *v = NULL;
    TD_ASSERT_OK(td_tensor_zeros(shape, 2, dt, td_device_cpu(), &a));
    TD_ASSERT_OK(td_tensor_zeros(ish, 1, TD_DTYPE_I64, td_device_cpu(), &i64));
    struct {
      const char *op;
      td_status st;
    } cases[] = {
        {"add", td_tensor_add(a, a, &r)},
        {"mul_scalar", td_tensor_mul_scalar(a, 2.0, &r)},
        {"tensor_mul_scalar_", td_tensor_mul_scalar_(a, 2.0)},
        {"tensor_add_", td_tensor_add_(a, a, 1.0)},
        {"relu", td_tensor_relu(a, &r)},
        {"sum", td_tensor_sum_all(a, &r)},
        {"max", td_tensor_max(a, 0, false, &v, NULL)},
        {"matmul", td_tensor_matmul(a, a, &r)},
        {"softmax", td_tensor_softmax(a, 1, &r)},
        {"index_select", td_tensor_index_select(a, 0, i64, &r)},
        {"embedding", td_tensor_embedding(a, i64, &r)},
        {"tensor_set_requires_grad", td_tensor_set_requires_grad(a, true)},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
      if (cases[i].st != TD_ERR_DTYPE)
        fail_msg("%s on %s returned %s, expected TD_ERR_DTYPE", cases[i].op, name,
                 td_status_name(cases[i].st));
    }
    assert_null(r);
    assert_null(v);
    /* The message names the op (last case: requires grad) and the dtype. */
    assert_non_null(strstr(td_last_error(), name));
    TD_ASSERT_STATUS(td_tensor_add(a, a, &r), TD_ERR_DTYPE);
    assert_non_null(strstr(td_last_error(), "add"));
    assert_non_null(strstr(td_last_error(), "transport-only"));
    td_generator *g = NULL;
    TD_ASSERT_OK(td_generator_create(1, &g));
    TD_ASSERT_STATUS(td_tensor_uniform(shape, 2, 0, 1, dt, td_device_cpu(), g, &r),
                     TD_ERR_INVALID);
    td_generator_destroy(g);
    td_tensor_unref(i64), td_tensor_unref(a);
  }
}

/* No CUDA placement for the transport-only dtypes, with or without CUDA in the build; the 16-bit
 * floats are CUDA dtypes (refused only for the want of a device, never for the dtype). */
static void test_dtype_cuda_refused(void **state) {
  (void)state;
  for (int k = 0; k < NT; k++) {
    td_dtype dt = transport[k];
    bool half = dt == TD_DTYPE_F16 || dt == TD_DTYPE_BF16;
    int64_t shape[2] = {2, 2};
    td_tensor *a = NULL, *r = NULL;
    TD_ASSERT_OK(td_tensor_zeros(shape, 2, dt, td_device_cpu(), &a));
    if (!half) {
      TD_ASSERT_STATUS(td_tensor_empty(shape, 2, dt, td_device_cuda(0), &r), TD_ERR_DTYPE);
      TD_ASSERT_STATUS(td_tensor_to(a, td_device_cuda(0), &r), TD_ERR_DTYPE);
      assert_null(r);
    } else {
      td_status st = td_tensor_empty(shape, 2, dt, td_device_cuda(0), &r);
      if (st == TD_ERR_DTYPE) fail_msg("%s refused on CUDA: %s", td_dtype_name(dt), td_last_error());
      td_tensor_unref(r);
      r = NULL;
      st = td_tensor_to(a, td_device_cuda(0), &r);
      if (st == TD_ERR_DTYPE) fail_msg("%s refused on CUDA: %s", td_dtype_name(dt), td_last_error());
      td_tensor_unref(r);
    }
    td_tensor_unref(a);
  }
}

/* Converting a tensor that requires grad to a transport-only dtype gives a plain tensor (no
 * history that could send gradients through a dtype autograd does not handle); to a 16-bit float
 * the conversion is differentiable. */
static void test_dtype_conversion_cuts_history(void **state) {
  (void)state;
  int64_t shape[1] = {3};
  td_tensor *x = td_test_randn(shape, 1, TD_DTYPE_F32, 7, true), *h = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(x, TD_DTYPE_I32, &h));
  assert_false(td_tensor_requires_grad(h));
  assert_null(td_tensor_grad_fn(h));
  td_tensor_unref(h);
  TD_ASSERT_OK(td_tensor_to_dtype(x, TD_DTYPE_F16, &h));
  assert_true(td_tensor_requires_grad(h));
  assert_string_equal(td_node_name(td_tensor_grad_fn(h)), "ToCopyBackward");
  td_tensor_unref(h), td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dtype_sizes_and_names),
      cmocka_unit_test(test_dtype_float16_bits),
      cmocka_unit_test(test_dtype_bfloat16_bits),
      cmocka_unit_test(test_dtype_integer_conversions),
      cmocka_unit_test(test_dtype_conversion_matrix),
      cmocka_unit_test(test_dtype_create_view_copy),
      cmocka_unit_test(test_dtype_ops_refused),
      cmocka_unit_test(test_dtype_cuda_refused),
      cmocka_unit_test(test_dtype_conversion_cuts_history),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
