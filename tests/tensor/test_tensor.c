/* test_tensor.c - tensor creation, metadata, views, borrowed buffers, devices and generators. */
#include <math.h>
#include <string.h>

#include "test_util.h"

static void test_tensor_create_and_metadata(void **state) {
  int64_t s[3] = {2, 3, 4};
  td_tensor *t;
  TD_ASSERT_OK(td_tensor_full(s, 3, 1.5, TD_DTYPE_F32, td_device_cpu(), &t));
  assert_int_equal(td_tensor_ndim(t), 3);
  assert_int_equal(td_tensor_numel(t), 24);
  assert_int_equal(td_tensor_size(t, -1), 4);
  assert_int_equal(td_tensor_size(t, 3), -1);
  assert_int_equal(td_tensor_strides(t)[0], 12);
  assert_int_equal(td_tensor_nbytes(t), 96);
  assert_true(td_tensor_is_contiguous(t));
  assert_true(((float *)td_tensor_data(t))[23] == 1.5f);
  char buf[64];
  assert_string_equal(td_tensor_shape_str(t, buf, sizeof buf), "[2, 3, 4]");
  td_tensor_unref(t);
  td_tensor *sc;
  TD_ASSERT_OK(td_tensor_scalar(4.0, TD_DTYPE_I64, td_device_cpu(), &sc));
  double v;
  TD_ASSERT_OK(td_tensor_item(sc, &v));
  assert_true(v == 4.0);
  assert_int_equal(td_tensor_ndim(sc), 0);
  td_tensor_unref(sc);
  td_tensor *ar;
  TD_ASSERT_OK(td_tensor_arange(0, 1, 0.25, TD_DTYPE_F64, td_device_cpu(), &ar));
  assert_int_equal(td_tensor_numel(ar), 4);
  int64_t i3 = 3;
  TD_ASSERT_OK(td_tensor_get(ar, &i3, &v));
  assert_true(v == 0.75);
  td_tensor_unref(ar);
  int64_t z[2] = {0, 5};
  td_tensor *e;
  TD_ASSERT_OK(td_tensor_zeros(z, 2, TD_DTYPE_F32, td_device_cpu(), &e));
  assert_int_equal(td_tensor_numel(e), 0);
  td_tensor_unref(e);
}

static void test_tensor_misuse(void **state) {
  td_tensor *t = NULL;
  int64_t neg[1] = {-2};
  TD_ASSERT_STATUS(td_tensor_zeros(neg, 1, TD_DTYPE_F32, td_device_cpu(), &t), TD_ERR_INVALID);
  int64_t s[1] = {2};
  TD_ASSERT_STATUS(td_tensor_zeros(s, 9, TD_DTYPE_F32, td_device_cpu(), &t), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_tensor_zeros(s, 1, (td_dtype)9, td_device_cpu(), &t), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_tensor_zeros(s, 1, TD_DTYPE_F32, td_device_cuda(0), &t),
                   td_cuda_device_count() > 0 ? TD_OK : (td_device_available(td_device_cuda(0))
                                                             ? TD_OK
                                                             : TD_ERR_DEVICE));
  td_tensor_unref(t);
  t = NULL;
  TD_ASSERT_STATUS(td_tensor_from_buffer(NULL, s, 1, TD_DTYPE_F32, &t), TD_ERR_INVALID);
  assert_null(t);
  td_tensor *two;
  TD_ASSERT_OK(td_tensor_zeros(s, 1, TD_DTYPE_F32, td_device_cpu(), &two));
  double v;
  TD_ASSERT_STATUS(td_tensor_item(two, &v), TD_ERR_SHAPE);
  int64_t bad = 2;
  TD_ASSERT_STATUS(td_tensor_get(two, &bad, &v), TD_ERR_INVALID);
  char small[4];
  TD_ASSERT_STATUS(td_tensor_copy_to_buffer(two, small, sizeof small), TD_ERR_INVALID);
  td_tensor_unref(two);
  td_tensor_unref(NULL);
}

static void test_tensor_views_share_storage(void **state) {
  double v[6] = {0, 1, 2, 3, 4, 5};
  int64_t s[2] = {2, 3};
  td_tensor *t = td_test_tensor(v, s, 2, TD_DTYPE_F32, false), *tr, *nr, *c, *r;
  TD_ASSERT_OK(td_tensor_transpose(t, 0, 1, &tr));
  assert_false(td_tensor_is_contiguous(tr));
  double x;
  int64_t idx[2] = {2, 1};
  TD_ASSERT_OK(td_tensor_get(tr, idx, &x));
  assert_true(x == 5.0);
  TD_ASSERT_OK(td_tensor_narrow(t, 1, 1, 2, &nr));
  ((float *)td_tensor_data(t))[1] = 42.f; /* visible through the views */
  int64_t i0[2] = {0, 0};
  TD_ASSERT_OK(td_tensor_get(nr, i0, &x));
  assert_true(x == 42.0);
  TD_ASSERT_OK(td_tensor_contiguous(tr, &c));
  assert_true(td_tensor_is_contiguous(c));
  float out[6];
  TD_ASSERT_OK(td_tensor_copy_to_buffer(tr, out, sizeof out));
  float want[6] = {0, 3, 42, 4, 2, 5};
  assert_memory_equal(out, want, sizeof want);
  int64_t rs[1] = {-1};
  TD_ASSERT_OK(td_tensor_reshape(tr, rs, 1, &r)); /* non-contiguous -> copy */
  assert_int_equal(td_tensor_numel(r), 6);
  td_tensor *u, *sq, *d;
  TD_ASSERT_OK(td_tensor_unsqueeze(t, 0, &u));
  assert_int_equal(td_tensor_ndim(u), 3);
  TD_ASSERT_OK(td_tensor_squeeze(u, 0, &sq));
  assert_true(td_tensor_same_shape(sq, t));
  TD_ASSERT_OK(td_tensor_detach(t, &d));
  assert_ptr_equal(td_tensor_data(d), td_tensor_data(t));
  td_tensor *ts[] = {tr, nr, c, r, u, sq, d, t};
  for (size_t i = 0; i < sizeof ts / sizeof *ts; i++) td_tensor_unref(ts[i]);
}

static int released;
static void release_cb(void *ctx, void *data) {
  released++;
  assert_ptr_equal(ctx, data);
}

static void test_tensor_borrowed_release(void **state) {
  static double buf[4] = {1, 2, 3, 4};
  int64_t s[1] = {4};
  td_tensor *t, *v;
  released = 0;
  TD_ASSERT_OK(td_tensor_from_borrowed(buf, s, 1, TD_DTYPE_F64, release_cb, buf, &t));
  TD_ASSERT_OK(td_tensor_narrow(t, 0, 1, 2, &v));
  td_tensor_unref(t);
  assert_int_equal(released, 0); /* the view keeps the storage */
  double x;
  int64_t i = 1;
  TD_ASSERT_OK(td_tensor_get(v, &i, &x));
  assert_true(x == 3.0);
  td_tensor_unref(v);
  assert_int_equal(released, 1);
}

static void test_tensor_generator_deterministic(void **state) {
  int64_t s[1] = {1000};
  td_generator *g1, *g2;
  TD_ASSERT_OK(td_generator_create(42, &g1));
  TD_ASSERT_OK(td_generator_create(42, &g2));
  td_tensor *a, *b, *n;
  TD_ASSERT_OK(td_tensor_uniform(s, 1, -1, 1, TD_DTYPE_F32, td_device_cpu(), g1, &a));
  TD_ASSERT_OK(td_tensor_uniform(s, 1, -1, 1, TD_DTYPE_F32, td_device_cpu(), g2, &b));
  assert_memory_equal(td_tensor_data(a), td_tensor_data(b), 4000);
  TD_ASSERT_OK(td_tensor_normal(s, 1, 0, 1, TD_DTYPE_F64, td_device_cpu(), g1, &n));
  double *d = td_tensor_data(n), mean = 0, var = 0;
  for (int i = 0; i < 1000; i++) mean += d[i] / 1000;
  for (int i = 0; i < 1000; i++) var += (d[i] - mean) * (d[i] - mean) / 1000;
  assert_true(fabs(mean) < 0.15 && fabs(var - 1) < 0.15);
  float *f = td_tensor_data(a);
  for (int i = 0; i < 1000; i++) assert_true(f[i] >= -1 && f[i] < 1);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(n);
  td_generator_destroy(g1);
  td_generator_destroy(g2);
}

static void test_tensor_devices(void **state) {
  td_device d;
  TD_ASSERT_OK(td_device_parse("cuda:3", &d));
  assert_int_equal(d.type, TD_DEVICE_CUDA);
  assert_int_equal(d.index, 3);
  TD_ASSERT_OK(td_device_parse("cpu", &d));
  assert_int_equal(d.type, TD_DEVICE_CPU);
  TD_ASSERT_STATUS(td_device_parse("gpu0", &d), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_device_parse("cuda:x", &d), TD_ERR_INVALID);
  char buf[16];
  assert_string_equal(td_device_str(td_device_cuda(1), buf, sizeof buf), "cuda:1");
  assert_true(td_device_available(td_device_cpu()));
}

static void test_tensor_dtype_conversion(void **state) {
  double v[3] = {1.7, -2.2, 3.0};
  int64_t s[1] = {3};
  td_tensor *t = td_test_tensor(v, s, 1, TD_DTYPE_F64, false), *i, *f;
  TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_I64, &i));
  int64_t out[3];
  TD_ASSERT_OK(td_tensor_copy_to_buffer(i, out, sizeof out));
  assert_int_equal(out[0], 1);
  assert_int_equal(out[1], -2);
  TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_F32, &f));
  bool close;
  TD_ASSERT_OK(td_tensor_allclose(f, t, 1e-6, 0, &close));
  assert_true(close);
  TD_ASSERT_OK(td_tensor_allclose(i, t, 1e-6, 0, &close));
  assert_false(close);
  td_tensor_unref(t);
  td_tensor_unref(i);
  td_tensor_unref(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tensor_create_and_metadata),
      cmocka_unit_test(test_tensor_misuse),
      cmocka_unit_test(test_tensor_views_share_storage),
      cmocka_unit_test(test_tensor_borrowed_release),
      cmocka_unit_test(test_tensor_generator_deterministic),
      cmocka_unit_test(test_tensor_devices),
      cmocka_unit_test(test_tensor_dtype_conversion),
  };
  return cmocka_run_group_tests_name("tensor", tests, NULL, NULL);
}
