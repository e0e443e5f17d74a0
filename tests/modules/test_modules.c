/* test_modules.c - the module object and the built-in modules: shapes, parameter names, train and
 * eval, initialisation statistics, user-defined types, the factory registry, devices and dtypes,
 * and misuse giving clear statuses. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tdist/nn.h"
#include "test_util.h"

/* ---- helpers ---- */

static void assert_shape(const td_tensor *t, const int64_t *shape, int ndim) {
  char a[96];
  if (td_tensor_ndim(t) != ndim) fail_msg("shape %s: wrong rank", td_tensor_shape_str(t, a, 96));
  for (int i = 0; i < ndim; i++)
    if (td_tensor_shape(t)[i] != shape[i])
      fail_msg("shape %s: dim %d should be %lld", td_tensor_shape_str(t, a, 96), i,
               (long long)shape[i]);
}

/* forward_shape runs m on a random float32 input of in_shape and checks the output shape. */
static void forward_shape(td_module *m, const int64_t *in_shape, int in_nd,
                          const int64_t *out_shape, int out_nd) {
  td_tensor *x = td_test_randn(in_shape, in_nd, TD_DTYPE_F32, 7, false), *y = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  assert_shape(y, out_shape, out_nd);
  td_tensor_unref(x);
  td_tensor_unref(y);
}

static void assert_names(td_module *m, const char *const *names, size_t n) {
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_named_parameters(m, &l));
  if (l.n != n) fail_msg("%zu parameters, expected %zu", l.n, n);
  for (size_t i = 0; i < n; i++)
    if (strcmp(l.names[i], names[i]) != 0)
      fail_msg("parameter %zu is \"%s\", expected \"%s\"", i, l.names[i], names[i]);
  for (size_t i = 0; i < n; i++) {
    assert_true(td_tensor_requires_grad(l.tensors[i]));
    assert_true(td_tensor_is_leaf(l.tensors[i]));
  }
  td_tensor_list_fini(&l);
}

/* to_doubles copies t into a new malloc'd double array. */
static double *to_doubles(const td_tensor *t) {
  td_tensor *d = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_F64, &d));
  int64_t n = td_tensor_numel(t);
  double *buf = malloc((size_t)(n ? n : 1) * sizeof *buf);
  TD_ASSERT_OK(td_tensor_copy_to_buffer(d, buf, (size_t)n * sizeof *buf));
  td_tensor_unref(d);
  return buf;
}

/* stats computes min, max, mean and standard deviation of t. */
static void stats(const td_tensor *t, double *mn, double *mx, double *mean, double *sd) {
  int64_t n = td_tensor_numel(t);
  double *v = to_doubles(t);
  double s = 0, s2 = 0;
  *mn = INFINITY;
  *mx = -INFINITY;
  for (int64_t i = 0; i < n; i++) {
    s += v[i];
    if (v[i] < *mn) *mn = v[i];
    if (v[i] > *mx) *mx = v[i];
  }
  *mean = s / (double)n;
  for (int64_t i = 0; i < n; i++) s2 += (v[i] - *mean) * (v[i] - *mean);
  *sd = sqrt(s2 / (double)n);
  free(v);
}

/* check_uniform asserts that t looks like U(-bound, bound). */
static void check_uniform(const char *what, const td_tensor *t, double bound) {
  double mn, mx, mean, sd;
  stats(t, &mn, &mx, &mean, &sd);
  int64_t n = td_tensor_numel(t);
  if (mn < -bound || mx > bound)
    fail_msg("%s: values [%g, %g] outside +-%g", what, mn, mx, bound);
  double want_sd = bound / sqrt(3.0);
  if (fabs(mean) > 5 * want_sd / sqrt((double)n))
    fail_msg("%s: mean %g too far from 0 (bound %g, n %lld)", what, mean, bound, (long long)n);
  if (fabs(sd - want_sd) > 0.1 * want_sd)
    fail_msg("%s: std %g, expected about %g", what, sd, want_sd);
  if (n >= 1000 && (mx < 0.95 * bound || mn > -0.95 * bound))
    fail_msg("%s: values [%g, %g] do not span +-%g", what, mn, mx, bound);
}

static td_module *param_module(td_module *m, const char *path, td_tensor **t) {
  TD_ASSERT_OK(td_module_get_parameter(m, path, t));
  return m;
}

/* ---- tests ---- */

static void test_linear_shapes_and_names(void **state) {
  (void)state;
  td_module *m = NULL;
  TD_ASSERT_OK(td_linear_create(4, 3, true, NULL, &m));
  assert_string_equal(td_module_type_name(m), "Linear");
  const char *names[] = {"weight", "bias"};
  assert_names(m, names, 2);
  assert_int_equal(td_module_num_parameters(m), 15);
  td_tensor *w = td_module_param(m, "weight");
  assert_shape(w, (int64_t[]){3, 4}, 2);
  assert_int_equal(td_tensor_dtype(w), TD_DTYPE_F32);
  forward_shape(m, (int64_t[]){2, 4}, 2, (int64_t[]){2, 3}, 2);
  forward_shape(m, (int64_t[]){5, 2, 4}, 3, (int64_t[]){5, 2, 3}, 3);
  forward_shape(m, (int64_t[]){4}, 1, (int64_t[]){3}, 1);
  td_module_unref(m);

  TD_ASSERT_OK(td_linear_create(4, 3, false, NULL, &m));
  const char *names_nb[] = {"weight"};
  assert_names(m, names_nb, 1);
  forward_shape(m, (int64_t[]){2, 4}, 2, (int64_t[]){2, 3}, 2);
  td_module_unref(m);
}

static void test_linear_forward_values(void **state) {
  (void)state;
  td_module *m = NULL;
  TD_ASSERT_OK(td_linear_create(2, 2, true, NULL, &m));
  double wv[] = {1, 2, 3, 4}, bv[] = {0.5, -1}, xv[] = {1, -1, 2, 0.5};
  td_tensor *w = td_test_tensor(wv, (int64_t[]){2, 2}, 2, TD_DTYPE_F32, false);
  td_tensor *b = td_test_tensor(bv, (int64_t[]){2}, 1, TD_DTYPE_F32, false);
  td_tensor *x = td_test_tensor(xv, (int64_t[]){2, 2}, 2, TD_DTYPE_F32, false);
  TD_ASSERT_OK(td_module_set_parameter(m, "weight", w));
  TD_ASSERT_OK(td_module_set_parameter(m, "bias", b));
  assert_ptr_equal(td_module_param(m, "weight"), w);
  assert_true(td_tensor_requires_grad(w));
  td_tensor *y = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  /* y = x W^T + b: [1-2+0.5, 3-4-1; 2+1+0.5, 6+2-1] */
  double ev[] = {-0.5, -2, 3.5, 7};
  td_tensor *e = td_test_tensor(ev, (int64_t[]){2, 2}, 2, TD_DTYPE_F32, false);
  td_test_assert_close("linear", y, e, 1e-6, 1e-6);
  td_tensor_unref(w);
  td_tensor_unref(b);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(e);
  td_module_unref(m);
}

/* build_cnn makes Conv2d(1,4,3,pad 1) ReLU MaxPool2d(2) Flatten Linear(64, 10) Dropout. */
static td_module *build_cnn(td_generator *g) {
  td_module *seq = NULL, *c = NULL;
  TD_ASSERT_OK(td_sequential_create(&seq));
  td_conv2d_opts co;
  td_conv2d_opts_init(&co, 3);
  co.pad_h = co.pad_w = 1;
  TD_ASSERT_OK(td_conv2d_create(1, 4, &co, g, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_relu_create(&c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_max_pool2d_create(2, 2, 0, 0, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_flatten_create(1, -1, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_linear_create(64, 10, true, g, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_dropout_create(0.1, g, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  return seq;
}

static void test_sequential_cnn_shapes_names_backward(void **state) {
  (void)state;
  td_generator *g = NULL;
  TD_ASSERT_OK(td_generator_create(1, &g));
  td_module *seq = build_cnn(g);
  const char *names[] = {"0.weight", "0.bias", "4.weight", "4.bias"};
  assert_names(seq, names, 4);
  assert_int_equal(td_module_num_children(seq), 6);
  const char *cname = NULL;
  assert_non_null(td_module_child_at(seq, 2, &cname));
  assert_string_equal(cname, "2");
  assert_string_equal(td_module_type_name(td_module_child(seq, "2")), "MaxPool2d");
  assert_null(td_module_child_at(seq, 6, NULL));
  assert_int_equal(td_module_num_parameters(seq), 4 * 9 + 4 + 640 + 10);

  td_tensor *x = td_test_randn((int64_t[]){2, 1, 8, 8}, 4, TD_DTYPE_F32, 3, false);
  td_tensor *y = NULL, *loss = NULL;
  TD_ASSERT_OK(td_module_forward(seq, x, &y));
  assert_shape(y, (int64_t[]){2, 10}, 2);
  TD_ASSERT_OK(td_tensor_sum_all(y, &loss));
  TD_ASSERT_OK(td_tensor_backward(loss));
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_parameters(seq, &l));
  for (size_t i = 0; i < l.n; i++) {
    td_tensor *gr = td_tensor_grad(l.tensors[i]);
    if (!gr) fail_msg("parameter %s got no gradient", l.names[i]);
    assert_true(td_tensor_same_shape(gr, l.tensors[i]));
    td_tensor_unref(gr);
  }
  td_module_zero_grad(seq);
  for (size_t i = 0; i < l.n; i++) assert_null(td_tensor_grad(l.tensors[i]));
  td_tensor_list_fini(&l);
  /* unbatched [C, H, W] input through conv and pool */
  td_module *conv = td_module_child(seq, "0"), *pool = td_module_child(seq, "2");
  forward_shape(conv, (int64_t[]){1, 8, 8}, 3, (int64_t[]){4, 8, 8}, 3);
  forward_shape(pool, (int64_t[]){4, 8, 7}, 3, (int64_t[]){4, 4, 3}, 3);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(loss);
  td_module_unref(seq);
  td_generator_destroy(g);
}

static void test_module_train_eval_dropout(void **state) {
  (void)state;
  td_module *seq = NULL, *d = NULL, *r = NULL;
  TD_ASSERT_OK(td_sequential_create(&seq));
  TD_ASSERT_OK(td_relu_create(&r));
  TD_ASSERT_OK(td_dropout_create(0.5, NULL, &d));
  TD_ASSERT_OK(td_sequential_append(seq, r));
  TD_ASSERT_OK(td_sequential_append(seq, d));
  assert_true(td_module_is_training(seq));
  assert_true(td_module_is_training(d));
  td_tensor *x = NULL, *y = NULL;
  TD_ASSERT_OK(td_tensor_ones((int64_t[]){1000}, 1, TD_DTYPE_F32, td_device_cpu(), &x));
  TD_ASSERT_OK(td_module_forward(seq, x, &y));
  double *v = to_doubles(y);
  int zeros = 0;
  for (int i = 0; i < 1000; i++) {
    if (v[i] == 0) zeros++;
    else if (fabs(v[i] - 2.0) > 1e-6) fail_msg("kept element %d is %g, expected 2", i, v[i]);
  }
  free(v);
  if (zeros < 400 || zeros > 600) fail_msg("dropout(0.5) zeroed %d of 1000", zeros);
  td_tensor_unref(y);

  td_module_train(seq, false);
  assert_false(td_module_is_training(seq));
  assert_false(td_module_is_training(d));
  TD_ASSERT_OK(td_module_forward(seq, x, &y));
  td_test_assert_close("eval dropout", y, x, 0, 0);
  td_tensor_unref(y);

  /* a child added to an eval-mode parent follows the parent */
  td_module *d2 = NULL;
  TD_ASSERT_OK(td_dropout_create(0.9, NULL, &d2));
  TD_ASSERT_OK(td_sequential_append(seq, d2));
  assert_false(td_module_is_training(d2));
  td_module_train(seq, true);
  assert_true(td_module_is_training(d2));
  td_tensor_unref(x);
  td_module_unref(d2);
  td_module_unref(d);
  td_module_unref(r);
  td_module_unref(seq);
}

static void test_module_init_statistics(void **state) {
  (void)state;
  td_generator *g = NULL;
  TD_ASSERT_OK(td_generator_create(42, &g));
  td_module *m = NULL;
  td_tensor *t = NULL;

  TD_ASSERT_OK(td_linear_create(100, 300, true, g, &m));
  check_uniform("Linear.weight", td_module_param(m, "weight"), 1.0 / sqrt(100.0));
  check_uniform("Linear.bias", td_module_param(m, "bias"), 1.0 / sqrt(100.0));
  td_module_unref(m);

  td_conv2d_opts co;
  td_conv2d_opts_init(&co, 3);
  TD_ASSERT_OK(td_conv2d_create(3, 64, &co, g, &m));
  check_uniform("Conv2d.weight", td_module_param(m, "weight"), 1.0 / sqrt(27.0));
  check_uniform("Conv2d.bias", td_module_param(m, "bias"), 1.0 / sqrt(27.0));
  td_module_unref(m);

  TD_ASSERT_OK(td_embedding_create(1000, 16, g, &m));
  double mn, mx, mean, sd;
  stats(td_module_param(m, "weight"), &mn, &mx, &mean, &sd);
  if (fabs(mean) > 0.03 || fabs(sd - 1.0) > 0.03)
    fail_msg("Embedding.weight mean %g sd %g, expected N(0, 1)", mean, sd);
  td_module_unref(m);

  td_lstm_opts lo;
  td_lstm_opts_init(&lo);
  lo.num_layers = 2;
  TD_ASSERT_OK(td_lstm_create(30, 25, &lo, g, &m));
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_named_parameters(m, &l));
  for (size_t i = 0; i < l.n; i++) check_uniform(l.names[i], l.tensors[i], 1.0 / 5.0);
  td_tensor_list_fini(&l);
  td_module_unref(m);

  TD_ASSERT_OK(td_layer_norm_create((int64_t[]){6}, 1, 1e-5, true, &m));
  param_module(m, "weight", &t);
  stats(t, &mn, &mx, &mean, &sd);
  assert_true(mn == 1.0 && mx == 1.0);
  td_tensor_unref(t);
  param_module(m, "bias", &t);
  stats(t, &mn, &mx, &mean, &sd);
  assert_true(mn == 0.0 && mx == 0.0);
  td_tensor_unref(t);
  td_module_unref(m);
  td_generator_destroy(g);
}

static void test_module_init_deterministic(void **state) {
  (void)state;
  td_generator *g1 = NULL, *g2 = NULL;
  TD_ASSERT_OK(td_generator_create(9, &g1));
  TD_ASSERT_OK(td_generator_create(9, &g2));
  td_module *a = NULL, *b = NULL;
  TD_ASSERT_OK(td_linear_create(7, 5, true, g1, &a));
  TD_ASSERT_OK(td_linear_create(7, 5, true, g2, &b));
  td_test_assert_close("same seed", td_module_param(a, "weight"), td_module_param(b, "weight"), 0,
                       0);
  td_module_unref(a);
  td_module_unref(b);
  /* the default generator is reproducible through td_nn_manual_seed */
  TD_ASSERT_OK(td_nn_manual_seed(123));
  TD_ASSERT_OK(td_linear_create(7, 5, true, NULL, &a));
  TD_ASSERT_OK(td_nn_manual_seed(123));
  TD_ASSERT_OK(td_linear_create(7, 5, true, NULL, &b));
  td_test_assert_close("manual seed", td_module_param(a, "bias"), td_module_param(b, "bias"), 0,
                       0);
  td_module_unref(a);
  td_module_unref(b);
  td_generator_destroy(g1);
  td_generator_destroy(g2);
}

static void test_lstm_shapes_and_names(void **state) {
  (void)state;
  td_lstm_opts lo;
  td_lstm_opts_init(&lo);
  lo.num_layers = 2;
  td_module *m = NULL;
  TD_ASSERT_OK(td_lstm_create(3, 4, &lo, NULL, &m));
  const char *names[] = {"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0",
                         "weight_ih_l1", "weight_hh_l1", "bias_ih_l1", "bias_hh_l1"};
  assert_names(m, names, 8);
  assert_shape(td_module_param(m, "weight_ih_l0"), (int64_t[]){16, 3}, 2);
  assert_shape(td_module_param(m, "weight_ih_l1"), (int64_t[]){16, 4}, 2);
  assert_shape(td_module_param(m, "bias_hh_l1"), (int64_t[]){16}, 1);

  td_tensor *x = td_test_randn((int64_t[]){5, 2, 3}, 3, TD_DTYPE_F32, 1, false);
  td_tensor *y = NULL, *hn = NULL, *cn = NULL;
  TD_ASSERT_OK(td_lstm_forward(m, x, NULL, NULL, &y, &hn, &cn));
  assert_shape(y, (int64_t[]){5, 2, 4}, 3);
  assert_shape(hn, (int64_t[]){2, 2, 4}, 3);
  assert_shape(cn, (int64_t[]){2, 2, 4}, 3);
  /* the last output step equals the last layer's h_n */
  td_tensor *last = NULL, *hl = NULL;
  TD_ASSERT_OK(td_tensor_narrow(y, 0, 4, 1, &last));
  TD_ASSERT_OK(td_tensor_narrow(hn, 0, 1, 1, &hl));
  td_test_assert_close("output[-1] == h_n[-1]", last, hl, 0, 0);
  td_tensor_unref(last);
  td_tensor_unref(hl);
  td_tensor_unref(y);
  td_tensor_unref(hn);
  td_tensor_unref(cn);
  /* the generic forward gives the output only */
  forward_shape(m, (int64_t[]){5, 2, 3}, 3, (int64_t[]){5, 2, 4}, 3);
  /* unbatched */
  td_tensor *xu = td_test_randn((int64_t[]){6, 3}, 2, TD_DTYPE_F32, 2, false);
  TD_ASSERT_OK(td_lstm_forward(m, xu, NULL, NULL, &y, &hn, NULL));
  assert_shape(y, (int64_t[]){6, 4}, 2);
  assert_shape(hn, (int64_t[]){2, 4}, 2);
  td_tensor_unref(y);
  td_tensor_unref(hn);
  td_tensor_unref(xu);
  td_tensor_unref(x);
  td_module_unref(m);

  /* batch_first, no bias */
  lo.num_layers = 1;
  lo.batch_first = true;
  lo.bias = false;
  TD_ASSERT_OK(td_lstm_create(3, 4, &lo, NULL, &m));
  const char *names_nb[] = {"weight_ih_l0", "weight_hh_l0"};
  assert_names(m, names_nb, 2);
  forward_shape(m, (int64_t[]){2, 7, 3}, 3, (int64_t[]){2, 7, 4}, 3);
  td_module_unref(m);

  /* inter-layer dropout: random in training, deterministic in evaluation */
  td_lstm_opts_init(&lo);
  lo.num_layers = 2;
  lo.dropout = 0.5;
  TD_ASSERT_OK(td_lstm_create(3, 4, &lo, NULL, &m));
  x = td_test_randn((int64_t[]){5, 2, 3}, 3, TD_DTYPE_F32, 1, false);
  td_tensor *y1 = NULL, *y2 = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y1));
  TD_ASSERT_OK(td_module_forward(m, x, &y2));
  bool same = true;
  TD_ASSERT_OK(td_tensor_allclose(y1, y2, 0, 0, &same));
  assert_false(same);
  td_tensor_unref(y1);
  td_tensor_unref(y2);
  td_module_train(m, false);
  TD_ASSERT_OK(td_module_forward(m, x, &y1));
  TD_ASSERT_OK(td_module_forward(m, x, &y2));
  td_test_assert_close("eval LSTM", y1, y2, 0, 0);
  td_tensor_unref(y1);
  td_tensor_unref(y2);
  td_tensor_unref(x);
  td_module_unref(m);

  /* LSTMCell */
  TD_ASSERT_OK(td_lstm_cell_create(3, 4, true, NULL, &m));
  const char *cell_names[] = {"weight_ih", "weight_hh", "bias_ih", "bias_hh"};
  assert_names(m, cell_names, 4);
  forward_shape(m, (int64_t[]){2, 3}, 2, (int64_t[]){2, 4}, 2);
  forward_shape(m, (int64_t[]){3}, 1, (int64_t[]){4}, 1);
  td_module_unref(m);
}

static void test_misc_layers(void **state) {
  (void)state;
  td_module *m = NULL;
  /* LayerNorm normalises the last dims */
  TD_ASSERT_OK(td_layer_norm_create((int64_t[]){8}, 1, 1e-5, true, &m));
  td_tensor *x = td_test_randn((int64_t[]){3, 8}, 2, TD_DTYPE_F64, 5, false), *y = NULL;
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  double *v = to_doubles(y);
  for (int r = 0; r < 3; r++) {
    double s = 0, s2 = 0;
    for (int c = 0; c < 8; c++) s += v[r * 8 + c];
    for (int c = 0; c < 8; c++) s2 += (v[r * 8 + c] - s / 8) * (v[r * 8 + c] - s / 8);
    if (fabs(s / 8) > 1e-9 || fabs(s2 / 8 - 1) > 1e-3)
      fail_msg("LayerNorm row %d: mean %g var %g", r, s / 8, s2 / 8);
  }
  free(v);
  td_tensor_unref(y);
  td_module_unref(m);

  /* activations agree with the tensor ops */
  td_status (*creators[])(td_module **) = {td_relu_create, td_tanh_create, td_sigmoid_create,
                                           td_gelu_create};
  td_status (*ops[])(const td_tensor *, td_tensor **) = {td_tensor_relu, td_tensor_tanh,
                                                         td_tensor_sigmoid, td_tensor_gelu};
  const char *tnames[] = {"ReLU", "Tanh", "Sigmoid", "GELU"};
  for (int i = 0; i < 4; i++) {
    td_tensor *e = NULL;
    TD_ASSERT_OK(creators[i](&m));
    assert_string_equal(td_module_type_name(m), tnames[i]);
    assert_int_equal(td_module_num_parameters(m), 0);
    TD_ASSERT_OK(td_module_forward(m, x, &y));
    TD_ASSERT_OK(ops[i](x, &e));
    td_test_assert_close(tnames[i], y, e, 0, 0);
    td_tensor_unref(e);
    td_tensor_unref(y);
    td_module_unref(m);
  }
  td_tensor_unref(x);

  /* Embedding */
  TD_ASSERT_OK(td_embedding_create(10, 3, NULL, &m));
  int64_t idx[] = {1, 9, 1, 0};
  td_tensor *ix = NULL, *row = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(idx, (int64_t[]){2, 2}, 2, TD_DTYPE_I64, &ix));
  TD_ASSERT_OK(td_module_forward(m, ix, &y));
  assert_shape(y, (int64_t[]){2, 2, 3}, 3);
  TD_ASSERT_OK(td_tensor_narrow(td_module_param(m, "weight"), 0, 9, 1, &row));
  td_tensor *got = NULL, *got2 = NULL;
  TD_ASSERT_OK(td_tensor_narrow(y, 1, 1, 1, &got));
  TD_ASSERT_OK(td_tensor_narrow(got, 0, 0, 1, &got2));
  td_tensor *got3 = NULL;
  TD_ASSERT_OK(td_tensor_reshape(got2, (int64_t[]){1, 3}, 2, &got3));
  td_test_assert_close("embedding row 9", got3, row, 0, 0);
  td_tensor_unref(got);
  td_tensor_unref(got2);
  td_tensor_unref(got3);
  td_tensor_unref(row);
  td_tensor_unref(y);
  td_tensor_unref(ix);
  td_module_unref(m);

  /* Flatten with a custom range, empty Sequential is the identity */
  TD_ASSERT_OK(td_flatten_create(0, 1, &m));
  forward_shape(m, (int64_t[]){2, 3, 4}, 3, (int64_t[]){6, 4}, 2);
  td_module_unref(m);
  TD_ASSERT_OK(td_sequential_create(&m));
  forward_shape(m, (int64_t[]){2, 3}, 2, (int64_t[]){2, 3}, 2);
  td_module_unref(m);
}

/* ---- user-defined module ---- */

typedef struct block_state {
  int *destroyed;
  double scale;
} block_state;

static void block_destroy(void *s) {
  block_state *b = s;
  (*b->destroyed)++;
  free(b);
}

/* forward: fc2(relu(fc1(x))) * scale + offset */
static td_status block_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                               int n_out) {
  if (n_in != 1 || n_out != 1) return td_set_error(TD_ERR_INVALID, "Block: 1 in, 1 out");
  block_state *s = td_module_state(self);
  td_tensor *h = NULL, *r = NULL, *o = NULL, *sc = NULL, *y = NULL;
  td_status st = td_module_forward(td_module_child(self, "fc1"), in[0], &h);
  if (st == TD_OK) st = td_tensor_relu(h, &r);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "fc2"), r, &o);
  if (st == TD_OK) st = td_tensor_mul_scalar(o, s->scale, &sc);
  if (st == TD_OK) st = td_tensor_add(sc, td_module_param(self, "offset"), &y);
  td_tensor_unref(h);
  td_tensor_unref(r);
  td_tensor_unref(o);
  td_tensor_unref(sc);
  if (st == TD_OK) *out = y;
  return st;
}

static const td_module_type block_type = {"Block", block_forward, block_destroy};

static td_module *make_block(int *destroyed) {
  block_state *s = calloc(1, sizeof *s);
  s->destroyed = destroyed;
  s->scale = 2.0;
  td_module *m = NULL, *fc1 = NULL, *fc2 = NULL;
  TD_ASSERT_OK(td_module_create(&block_type, s, &m));
  td_tensor *off = NULL, *steps = NULL;
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){2}, 1, TD_DTYPE_F32, td_device_cpu(), &off));
  TD_ASSERT_OK(td_module_register_parameter(m, "offset", off));
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){1}, 1, TD_DTYPE_I64, td_device_cpu(), &steps));
  TD_ASSERT_OK(td_module_register_buffer(m, "steps", steps));
  TD_ASSERT_OK(td_linear_create(3, 5, true, NULL, &fc1));
  TD_ASSERT_OK(td_linear_create(5, 2, true, NULL, &fc2));
  TD_ASSERT_OK(td_module_register_module(m, "fc1", fc1));
  TD_ASSERT_OK(td_module_register_module(m, "fc2", fc2));
  td_tensor_unref(off);
  td_tensor_unref(steps);
  td_module_unref(fc1);
  td_module_unref(fc2);
  return m;
}

static void test_module_user_type(void **state) {
  (void)state;
  int destroyed = 0;
  td_module *m = make_block(&destroyed);
  const char *names[] = {"offset", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  assert_names(m, names, 5);
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_module_state_dict(m, &sd));
  assert_int_equal(sd.n, 6);
  assert_string_equal(sd.names[1], "steps");
  td_tensor_list_fini(&sd);
  assert_string_equal(td_module_type_name(m), "Block");
  assert_ptr_equal(td_module_get_type(m), &block_type);
  forward_shape(m, (int64_t[]){4, 3}, 2, (int64_t[]){4, 2}, 2);

  /* dotted get / set */
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_module_get_parameter(m, "fc2.bias", &t));
  assert_ptr_equal(t, td_module_param(td_module_child(m, "fc2"), "bias"));
  td_tensor_unref(t);
  TD_ASSERT_OK(td_module_get_parameter(m, "steps", &t));
  assert_false(td_tensor_requires_grad(t));
  td_tensor_unref(t);
  TD_ASSERT_STATUS(td_module_get_parameter(m, "fc3.bias", &t), TD_ERR_NOT_FOUND);
  TD_ASSERT_STATUS(td_module_get_parameter(m, "fc1.nothing", &t), TD_ERR_NOT_FOUND);
  td_tensor *bad = NULL;
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){3}, 1, TD_DTYPE_F32, td_device_cpu(), &bad));
  TD_ASSERT_STATUS(td_module_set_parameter(m, "fc2.bias", bad), TD_ERR_SHAPE);
  td_tensor_unref(bad);
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){2}, 1, TD_DTYPE_F64, td_device_cpu(), &bad));
  TD_ASSERT_STATUS(td_module_set_parameter(m, "fc2.bias", bad), TD_ERR_DTYPE);
  td_tensor_unref(bad);

  /* registration misuse */
  td_tensor *p = NULL;
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){2}, 1, TD_DTYPE_F32, td_device_cpu(), &p));
  TD_ASSERT_STATUS(td_module_register_parameter(m, "a.b", p), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_module_register_parameter(m, "", p), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_module_register_parameter(m, "fc1", p), TD_ERR_EXISTS);
  TD_ASSERT_STATUS(td_module_register_parameter(m, "offset", p), TD_ERR_EXISTS);
  TD_ASSERT_STATUS(td_module_register_module(m, "self", m), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_module_register_module(td_module_child(m, "fc1"), "parent", m),
                   TD_ERR_INVALID);
  td_tensor *ip = NULL;
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){2}, 1, TD_DTYPE_I64, td_device_cpu(), &ip));
  TD_ASSERT_STATUS(td_module_register_parameter(m, "ints", ip), TD_ERR_DTYPE);
  td_tensor_unref(ip);
  td_tensor_unref(p);
  TD_ASSERT_STATUS(td_module_create(NULL, NULL, &m), TD_ERR_INVALID);

  assert_int_equal(destroyed, 0);
  td_module *extra = td_module_ref(m);
  td_module_unref(m);
  assert_int_equal(destroyed, 0);
  td_module_unref(extra);
  assert_int_equal(destroyed, 1);
  td_module_unref(NULL);
}

static void test_module_shared_parameters(void **state) {
  (void)state;
  td_module *seq = NULL, *lin = NULL;
  TD_ASSERT_OK(td_sequential_create(&seq));
  TD_ASSERT_OK(td_linear_create(3, 3, true, NULL, &lin));
  TD_ASSERT_OK(td_sequential_append(seq, lin));
  TD_ASSERT_OK(td_sequential_append(seq, lin));
  const char *names[] = {"0.weight", "0.bias"};
  assert_names(seq, names, 2);
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_module_state_dict(seq, &sd));
  assert_int_equal(sd.n, 4);
  assert_string_equal(sd.names[3], "1.bias");
  td_tensor_list_fini(&sd);
  assert_int_equal(td_module_num_parameters(seq), 12);
  td_module_unref(lin);
  td_module_unref(seq);

  /* tied weights stay tied through a dtype conversion */
  td_module *a = NULL, *b = NULL;
  TD_ASSERT_OK(td_sequential_create(&seq));
  TD_ASSERT_OK(td_linear_create(3, 3, true, NULL, &a));
  TD_ASSERT_OK(td_linear_create(3, 3, true, NULL, &b));
  TD_ASSERT_OK(td_sequential_append(seq, a));
  TD_ASSERT_OK(td_sequential_append(seq, b));
  TD_ASSERT_OK(td_module_set_parameter(seq, "1.weight", td_module_param(a, "weight")));
  const char *tied[] = {"0.weight", "0.bias", "1.bias"};
  assert_names(seq, tied, 3);
  TD_ASSERT_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  assert_ptr_equal(td_module_param(a, "weight"), td_module_param(b, "weight"));
  assert_int_equal(td_tensor_dtype(td_module_param(b, "weight")), TD_DTYPE_F64);
  assert_names(seq, tied, 3);
  td_module_unref(a);
  td_module_unref(b);
  td_module_unref(seq);
}

static void test_module_to_dtype_and_device(void **state) {
  (void)state;
  int destroyed = 0;
  td_module *m = make_block(&destroyed);
  td_tensor *w_before = td_module_param(td_module_child(m, "fc1"), "weight");
  td_tensor *w_copy = NULL;
  TD_ASSERT_OK(td_tensor_clone(w_before, &w_copy));
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_state_dict(m, &l));
  for (size_t i = 0; i < l.n; i++) {
    if (strcmp(l.names[i], "steps") == 0) {
      assert_int_equal(td_tensor_dtype(l.tensors[i]), TD_DTYPE_I64); /* ints untouched */
      continue;
    }
    assert_int_equal(td_tensor_dtype(l.tensors[i]), TD_DTYPE_F64);
    assert_true(td_tensor_is_leaf(l.tensors[i]));
    assert_true(td_tensor_requires_grad(l.tensors[i]));
  }
  td_tensor_list_fini(&l);
  td_test_assert_close("converted weight", td_module_param(td_module_child(m, "fc1"), "weight"),
                       w_copy, 1e-7, 0);
  td_tensor *x32 = td_test_randn((int64_t[]){2, 3}, 2, TD_DTYPE_F32, 1, false), *y = NULL;
  TD_ASSERT_STATUS(td_module_forward(m, x32, &y), TD_ERR_DTYPE);
  td_tensor *x64 = td_test_randn((int64_t[]){2, 3}, 2, TD_DTYPE_F64, 1, false);
  TD_ASSERT_OK(td_module_forward(m, x64, &y));
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_F64);
  td_tensor_unref(y);
  td_tensor_unref(x32);
  td_tensor_unref(x64);
  td_tensor_unref(w_copy);
  TD_ASSERT_STATUS(td_module_to_dtype(m, TD_DTYPE_I64), TD_ERR_DTYPE);
  TD_ASSERT_OK(td_module_to(m, td_device_cpu()));
  if (!td_device_available(td_device_cuda(0)))
    TD_ASSERT_STATUS(td_module_to(m, td_device_cuda(0)), TD_ERR_DEVICE);
  td_module_unref(m);
}

static void test_module_misuse(void **state) {
  (void)state;
  td_module *lin = NULL, *m = NULL;
  td_tensor *y = NULL;
  TD_ASSERT_OK(td_linear_create(4, 3, true, NULL, &lin));
  TD_ASSERT_STATUS(td_module_forward(lin, NULL, &y), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_module_forward(NULL, NULL, &y), TD_ERR_INVALID);
  td_tensor *x5 = td_test_randn((int64_t[]){2, 5}, 2, TD_DTYPE_F32, 1, false);
  TD_ASSERT_STATUS(td_module_forward(lin, x5, &y), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "Linear"));
  td_tensor *x64 = td_test_randn((int64_t[]){2, 4}, 2, TD_DTYPE_F64, 1, false);
  TD_ASSERT_STATUS(td_module_forward(lin, x64, &y), TD_ERR_DTYPE);
  assert_null(y);
  td_tensor *two[2] = {x64, x64};
  td_tensor *outs[2] = {0};
  TD_ASSERT_STATUS(td_module_forward_multi(lin, two, 2, outs, 1), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_sequential_append(lin, lin), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_lstm_forward(lin, x64, NULL, NULL, &y, NULL, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_linear_create(-1, 3, true, NULL, &m), TD_ERR_INVALID);

  td_conv2d_opts co;
  td_conv2d_opts_init(&co, 3);
  TD_ASSERT_OK(td_conv2d_create(2, 4, &co, NULL, &m));
  td_tensor *x2 = td_test_randn((int64_t[]){4, 5}, 2, TD_DTYPE_F32, 1, false);
  TD_ASSERT_STATUS(td_module_forward(m, x2, &y), TD_ERR_SHAPE);
  td_tensor *xc = td_test_randn((int64_t[]){1, 3, 5, 5}, 4, TD_DTYPE_F32, 1, false);
  TD_ASSERT_STATUS(td_module_forward(m, xc, &y), TD_ERR_SHAPE); /* 3 channels, expects 2 */
  td_tensor *xs = td_test_randn((int64_t[]){1, 2, 2, 5}, 4, TD_DTYPE_F32, 1, false);
  TD_ASSERT_STATUS(td_module_forward(m, xs, &y), TD_ERR_SHAPE); /* smaller than the kernel */
  td_module_unref(m);
  co.stride_h = 0;
  TD_ASSERT_STATUS(td_conv2d_create(2, 4, &co, NULL, &m), TD_ERR_INVALID);

  TD_ASSERT_OK(td_embedding_create(5, 2, NULL, &m));
  TD_ASSERT_STATUS(td_module_forward(m, x2, &y), TD_ERR_DTYPE);
  td_module_unref(m);

  td_lstm_opts lo;
  td_lstm_opts_init(&lo);
  TD_ASSERT_OK(td_lstm_create(4, 3, &lo, NULL, &m));
  td_tensor *xl = td_test_randn((int64_t[]){5, 2, 4}, 3, TD_DTYPE_F32, 1, false);
  td_tensor *hbad = td_test_randn((int64_t[]){1, 3, 3}, 3, TD_DTYPE_F32, 1, false);
  td_tensor *hn = NULL;
  TD_ASSERT_STATUS(td_lstm_forward(m, x5, NULL, NULL, &y, NULL, NULL), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_lstm_forward(m, xl, hbad, NULL, &y, &hn, NULL), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "h0"));
  td_module_unref(m);
  lo.num_layers = 0;
  TD_ASSERT_STATUS(td_lstm_create(4, 3, &lo, NULL, &m), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_dropout_create(1.5, NULL, &m), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_layer_norm_create((int64_t[]){0}, 1, 1e-5, true, &m), TD_ERR_INVALID);
  TD_ASSERT_OK(td_layer_norm_create((int64_t[]){5}, 1, 1e-5, true, &m));
  TD_ASSERT_STATUS(td_module_forward(m, xl, &y), TD_ERR_SHAPE);
  td_module_unref(m);
  assert_null(y);
  assert_null(hn);

  td_tensor_unref(x5);
  td_tensor_unref(x64);
  td_tensor_unref(x2);
  td_tensor_unref(xc);
  td_tensor_unref(xs);
  td_tensor_unref(xl);
  td_tensor_unref(hbad);
  td_module_unref(lin);
}

/* ---- registry ---- */

typedef struct mlp_args {
  int64_t in, hidden, out;
} mlp_args;

static td_status mlp_factory(void *ctx, const void *args, td_module **out) {
  int *calls = ctx;
  (*calls)++;
  const mlp_args *a = args;
  if (!a) return td_set_error(TD_ERR_INVALID, "mlp factory needs args");
  td_module *seq = NULL, *c = NULL;
  td_status st = td_sequential_create(&seq);
  if (st != TD_OK) return st;
  st = td_linear_create(a->in, a->hidden, true, NULL, &c);
  if (st == TD_OK) st = td_sequential_append(seq, c);
  td_module_unref(c);
  c = NULL;
  if (st == TD_OK) st = td_relu_create(&c);
  if (st == TD_OK) st = td_sequential_append(seq, c);
  td_module_unref(c);
  c = NULL;
  if (st == TD_OK) st = td_linear_create(a->hidden, a->out, true, NULL, &c);
  if (st == TD_OK) st = td_sequential_append(seq, c);
  td_module_unref(c);
  if (st != TD_OK) {
    td_module_unref(seq);
    return st;
  }
  *out = seq;
  return TD_OK;
}

static void test_module_factory_registry(void **state) {
  (void)state;
  int calls = 0;
  assert_false(td_module_factory_exists("test.mlp"));
  TD_ASSERT_OK(td_module_factory_register("test.mlp", mlp_factory, &calls));
  assert_true(td_module_factory_exists("test.mlp"));
  TD_ASSERT_STATUS(td_module_factory_register("test.mlp", mlp_factory, &calls), TD_ERR_EXISTS);
  mlp_args a = {4, 8, 2};
  td_module *m = NULL;
  TD_ASSERT_OK(td_module_factory_create("test.mlp", &a, &m));
  assert_int_equal(calls, 1);
  forward_shape(m, (int64_t[]){3, 4}, 2, (int64_t[]){3, 2}, 2);
  const char *names[] = {"0.weight", "0.bias", "2.weight", "2.bias"};
  assert_names(m, names, 4);
  td_module_unref(m);
  m = NULL;
  TD_ASSERT_STATUS(td_module_factory_create("test.mlp", NULL, &m), TD_ERR_INVALID);
  assert_null(m);
  TD_ASSERT_STATUS(td_module_factory_create("test.nothing", &a, &m), TD_ERR_NOT_FOUND);
  assert_non_null(strstr(td_last_error(), "test.nothing"));
  TD_ASSERT_OK(td_module_factory_unregister("test.mlp"));
  assert_false(td_module_factory_exists("test.mlp"));
  TD_ASSERT_STATUS(td_module_factory_unregister("test.mlp"), TD_ERR_NOT_FOUND);
  TD_ASSERT_STATUS(td_module_factory_create("test.mlp", &a, &m), TD_ERR_NOT_FOUND);
}

static void test_tensor_list(void **state) {
  (void)state;
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_tensor *t = td_test_randn((int64_t[]){2}, 1, TD_DTYPE_F32, 1, false);
  for (int i = 0; i < 20; i++) {
    char name[16];
    snprintf(name, sizeof name, "t%d", i);
    TD_ASSERT_OK(td_tensor_list_append(&l, i == 5 ? NULL : name, t));
  }
  assert_int_equal(l.n, 20);
  assert_ptr_equal(td_tensor_list_find(&l, "t19"), t);
  assert_null(td_tensor_list_find(&l, "t5"));
  assert_null(td_tensor_list_find(&l, "x"));
  assert_null(l.names[5]);
  TD_ASSERT_STATUS(td_tensor_list_append(&l, "n", NULL), TD_ERR_INVALID);
  td_tensor_list_fini(&l);
  assert_int_equal(l.n, 0);
  td_tensor_list_fini(&l); /* twice is fine */
  td_tensor_list_fini(NULL);
  td_tensor_unref(t);
}

/* A CNN moved to CUDA computes what it computes on the CPU (skipped without a GPU). */
static void test_module_on_cuda(void **state) {
  (void)state;
  td_device cuda = td_device_cuda(0);
  if (!td_device_available(cuda)) skip();
  td_generator *g = NULL;
  TD_ASSERT_OK(td_generator_create(5, &g));
  td_module *cpu = build_cnn(g), *gpu = NULL;
  td_generator_destroy(g);
  TD_ASSERT_OK(td_generator_create(5, &g));
  gpu = build_cnn(g);
  td_generator_destroy(g);
  td_module_train(cpu, false);
  td_module_train(gpu, false);
  TD_ASSERT_OK(td_module_to(gpu, cuda));
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_parameters(gpu, &l));
  for (size_t i = 0; i < l.n; i++) {
    assert_true(td_device_equal(td_tensor_device(l.tensors[i]), cuda));
    assert_true(td_tensor_is_leaf(l.tensors[i]) && td_tensor_requires_grad(l.tensors[i]));
  }
  td_tensor_list_fini(&l);
  td_tensor *x = td_test_randn((int64_t[]){2, 1, 8, 8}, 4, TD_DTYPE_F32, 3, false);
  td_tensor *xg = NULL, *yc = NULL, *yg = NULL;
  TD_ASSERT_OK(td_tensor_to(x, cuda, &xg));
  TD_ASSERT_OK(td_module_forward(cpu, x, &yc));
  TD_ASSERT_OK(td_module_forward(gpu, xg, &yg));
  td_test_assert_close("CNN on cuda", yg, yc, 1e-4, 1e-5);
  TD_ASSERT_STATUS(td_module_forward(gpu, x, &yc), TD_ERR_DEVICE);
  /* saved from the GPU, loaded on the CPU */
  char path[] = "/tmp/td_module_cuda_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  TD_ASSERT_OK(td_module_save(gpu, path));
  TD_ASSERT_OK(td_module_load(cpu, path));
  remove(path);
  td_tensor_unref(x);
  td_tensor_unref(xg);
  td_tensor_unref(yc);
  td_tensor_unref(yg);
  td_module_unref(cpu);
  td_module_unref(gpu);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_shapes_and_names),
      cmocka_unit_test(test_linear_forward_values),
      cmocka_unit_test(test_sequential_cnn_shapes_names_backward),
      cmocka_unit_test(test_module_train_eval_dropout),
      cmocka_unit_test(test_module_init_statistics),
      cmocka_unit_test(test_module_init_deterministic),
      cmocka_unit_test(test_lstm_shapes_and_names),
      cmocka_unit_test(test_misc_layers),
      cmocka_unit_test(test_module_user_type),
      cmocka_unit_test(test_module_shared_parameters),
      cmocka_unit_test(test_module_to_dtype_and_device),
      cmocka_unit_test(test_module_misuse),
      cmocka_unit_test(test_module_factory_registry),
      cmocka_unit_test(test_tensor_list),
      cmocka_unit_test(test_module_on_cuda),
  };
  return cmocka_run_group_tests_name("modules", tests, NULL, NULL);
}
