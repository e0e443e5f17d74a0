/* test_modules_fixtures.c - modules and losses against PyTorch 1.13 (scripts/gen_fixtures.py).
 *
 * Each fixture holds the inputs, the initial parameters, the upstream gradients gy and the
 * expected outputs and gradients of sum(output * gy) (float64). The modules are converted to
 * float64, loaded with the fixture's parameters through td_module_load_state_dict (strict), run
 * forward and backward, and compared elementwise.
 */
#include <stdio.h>
#include <string.h>

#include "fixture.h"
#include "tdist/nn.h"
#include "test_util.h"

#define RTOL 1e-6
#define ATOL 1e-9

/* load_params builds a state dict from the fixture's entries "<prefix><name>" and loads it. */
static void load_params(td_module *m, const td_tensor_list *fx, const char *prefix) {
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  size_t pl = strlen(prefix);
  for (size_t i = 0; i < fx->n; i++)
    if (strncmp(fx->names[i], prefix, pl) == 0)
      TD_ASSERT_OK(td_tensor_list_append(&sd, fx->names[i] + pl, fx->tensors[i]));
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  TD_ASSERT_OK(td_module_load_state_dict(m, &sd, true));
  td_tensor_list_fini(&sd);
}

/* add_weighted adds sum(y * gy) to *loss (creating it when NULL). */
static void add_weighted(td_tensor **loss, const td_tensor *y, const td_tensor *gy) {
  td_tensor *p = NULL, *s = NULL;
  TD_ASSERT_OK(td_tensor_mul(y, gy, &p));
  TD_ASSERT_OK(td_tensor_sum_all(p, &s));
  td_tensor_unref(p);
  if (!*loss) {
    *loss = s;
    return;
  }
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_add(*loss, s, &t));
  td_tensor_unref(s);
  td_tensor_unref(*loss);
  *loss = t;
}

/* check_param_grads compares every parameter's gradient with "grad.<name>". */
static void check_param_grads(td_module *m, const td_tensor_list *fx) {
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_ASSERT_OK(td_module_named_parameters(m, &l));
  for (size_t i = 0; i < l.n; i++) {
    char key[128];
    snprintf(key, sizeof key, "grad.%s", l.names[i]);
    fixture_check_grad(key, l.tensors[i], fx, key, RTOL, ATOL);
  }
  td_tensor_list_fini(&l);
}

static void test_linear_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("nn_linear", &fx, NULL);
  td_module *m = NULL;
  TD_ASSERT_OK(td_linear_create(5, 3, true, NULL, &m));
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_tensor_list_append(&sd, "weight", fixture_get(&fx, "weight")));
  TD_ASSERT_OK(td_tensor_list_append(&sd, "bias", fixture_get(&fx, "bias")));
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  TD_ASSERT_OK(td_module_load_state_dict(m, &sd, true));
  td_tensor_list_fini(&sd);
  td_tensor *x = fixture_leaf(&fx, "x", true), *y = NULL, *loss = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  td_test_assert_close("Linear y", y, fixture_get(&fx, "y"), RTOL, ATOL);
  add_weighted(&loss, y, fixture_get(&fx, "gy"));
  TD_ASSERT_OK(td_tensor_backward(loss));
  fixture_check_grad("Linear grad x", x, &fx, "grad.x", RTOL, ATOL);
  check_param_grads(m, &fx);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(loss);
  td_module_unref(m);
  td_tensor_list_fini(&fx);
}

static void test_conv2d_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("nn_conv2d", &fx, NULL);
  td_conv2d_opts co;
  td_conv2d_opts_init(&co, 3);
  co.kernel_w = 2;
  co.stride_h = 2;
  co.pad_h = co.pad_w = 1;
  td_module *m = NULL;
  TD_ASSERT_OK(td_conv2d_create(3, 4, &co, NULL, &m));
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_tensor_list_append(&sd, "weight", fixture_get(&fx, "weight")));
  TD_ASSERT_OK(td_tensor_list_append(&sd, "bias", fixture_get(&fx, "bias")));
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  TD_ASSERT_OK(td_module_load_state_dict(m, &sd, true));
  td_tensor_list_fini(&sd);
  td_tensor *x = fixture_leaf(&fx, "x", true), *y = NULL, *loss = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  td_test_assert_close("Conv2d y", y, fixture_get(&fx, "y"), RTOL, ATOL);
  add_weighted(&loss, y, fixture_get(&fx, "gy"));
  TD_ASSERT_OK(td_tensor_backward(loss));
  fixture_check_grad("Conv2d grad x", x, &fx, "grad.x", RTOL, ATOL);
  check_param_grads(m, &fx);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(loss);
  td_module_unref(m);
  td_tensor_list_fini(&fx);
}

static void run_lstm_fixture(const char *name, int64_t in, int64_t hidden, bool with_state) {
  td_tensor_list fx;
  td_safetensors_meta meta;
  fixture_load(name, &fx, &meta);
  td_lstm_opts lo;
  td_lstm_opts_init(&lo);
  lo.num_layers = (int)fixture_meta_double(&meta, "num_layers", 1);
  lo.batch_first = fixture_meta_double(&meta, "batch_first", 0) != 0;
  td_module *m = NULL;
  TD_ASSERT_OK(td_lstm_create(in, hidden, &lo, NULL, &m));
  load_params(m, &fx, "param.");
  td_tensor *x = fixture_leaf(&fx, "x", true);
  td_tensor *h0 = with_state ? fixture_leaf(&fx, "h0", true) : NULL;
  td_tensor *c0 = with_state ? fixture_leaf(&fx, "c0", true) : NULL;
  td_tensor *y = NULL, *hn = NULL, *cn = NULL, *loss = NULL;
  TD_ASSERT_OK(td_lstm_forward(m, x, h0, c0, &y, &hn, &cn));
  td_test_assert_close("LSTM output", y, fixture_get(&fx, "output"), RTOL, ATOL);
  td_test_assert_close("LSTM h_n", hn, fixture_get(&fx, "hn"), RTOL, ATOL);
  td_test_assert_close("LSTM c_n", cn, fixture_get(&fx, "cn"), RTOL, ATOL);
  add_weighted(&loss, y, fixture_get(&fx, "gy.output"));
  add_weighted(&loss, hn, fixture_get(&fx, "gy.hn"));
  add_weighted(&loss, cn, fixture_get(&fx, "gy.cn"));
  TD_ASSERT_OK(td_tensor_backward(loss));
  fixture_check_grad("LSTM grad x", x, &fx, "grad.x", RTOL, ATOL);
  if (with_state) {
    fixture_check_grad("LSTM grad h0", h0, &fx, "grad.h0", RTOL, ATOL);
    fixture_check_grad("LSTM grad c0", c0, &fx, "grad.c0", RTOL, ATOL);
  }
  check_param_grads(m, &fx);

  /* the generic multi-tensor forward gives the same results */
  td_tensor *in3[3] = {x, h0, c0}, *out3[3] = {0};
  TD_ASSERT_OK(td_module_forward_multi(m, in3, 3, out3, 3));
  td_test_assert_close("LSTM multi output", out3[0], y, 0, 0);
  td_test_assert_close("LSTM multi c_n", out3[2], cn, 0, 0);
  for (int i = 0; i < 3; i++) td_tensor_unref(out3[i]);

  td_tensor_unref(x);
  td_tensor_unref(h0);
  td_tensor_unref(c0);
  td_tensor_unref(y);
  td_tensor_unref(hn);
  td_tensor_unref(cn);
  td_tensor_unref(loss);
  td_module_unref(m);
  td_tensor_list_fini(&fx);
  td_safetensors_meta_fini(&meta);
}

static void test_lstm_matches_pytorch(void **state) {
  (void)state;
  run_lstm_fixture("nn_lstm", 3, 4, true);
}

static void test_lstm_batch_first_matches_pytorch(void **state) {
  (void)state;
  run_lstm_fixture("nn_lstm_bf", 3, 5, false);
}

static void test_lstm_cell_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("nn_lstm_cell", &fx, NULL);
  td_module *m = NULL;
  TD_ASSERT_OK(td_lstm_cell_create(3, 4, true, NULL, &m));
  load_params(m, &fx, "param.");
  td_tensor *x = fixture_leaf(&fx, "x", true), *h = fixture_leaf(&fx, "h", true);
  td_tensor *c = fixture_leaf(&fx, "c", true), *h1 = NULL, *c1 = NULL, *loss = NULL;
  TD_ASSERT_OK(td_lstm_cell_forward(m, x, h, c, &h1, &c1));
  td_test_assert_close("LSTMCell h1", h1, fixture_get(&fx, "h1"), RTOL, ATOL);
  td_test_assert_close("LSTMCell c1", c1, fixture_get(&fx, "c1"), RTOL, ATOL);
  add_weighted(&loss, h1, fixture_get(&fx, "gy.h1"));
  add_weighted(&loss, c1, fixture_get(&fx, "gy.c1"));
  TD_ASSERT_OK(td_tensor_backward(loss));
  fixture_check_grad("LSTMCell grad x", x, &fx, "grad.x", RTOL, ATOL);
  fixture_check_grad("LSTMCell grad h", h, &fx, "grad.h", RTOL, ATOL);
  fixture_check_grad("LSTMCell grad c", c, &fx, "grad.c", RTOL, ATOL);
  check_param_grads(m, &fx);
  td_tensor_unref(x);
  td_tensor_unref(h);
  td_tensor_unref(c);
  td_tensor_unref(h1);
  td_tensor_unref(c1);
  td_tensor_unref(loss);
  td_module_unref(m);
  td_tensor_list_fini(&fx);
}

/* ---- losses ---- */

typedef td_status (*loss_fn)(td_tensor *a, td_tensor *b, const td_tensor_list *fx,
                             td_reduction red, td_tensor **out);

static td_status ce(td_tensor *a, td_tensor *b, const td_tensor_list *fx, td_reduction red,
                    td_tensor **out) {
  (void)b;
  return td_tensor_cross_entropy(a, fixture_get(fx, "target"), red, -100, out);
}

static td_status ce_ignore1(td_tensor *a, td_tensor *b, const td_tensor_list *fx,
                            td_reduction red, td_tensor **out) {
  (void)b;
  return td_tensor_cross_entropy(a, fixture_get(fx, "target"), red, 1, out);
}

static td_status nll(td_tensor *a, td_tensor *b, const td_tensor_list *fx, td_reduction red,
                     td_tensor **out) {
  (void)b;
  return td_tensor_nll_loss(a, fixture_get(fx, "target"), red, -100, out);
}

static td_status mse(td_tensor *a, td_tensor *b, const td_tensor_list *fx, td_reduction red,
                     td_tensor **out) {
  (void)fx;
  return td_tensor_mse_loss(a, b, red, out);
}

static void check_loss(const td_tensor_list *fx, const char *prefix, loss_fn fn,
                       const char *in_a, const char *in_b, const char *gy_none) {
  static const char *reds[] = {"mean", "sum", "none"};
  for (int r = 0; r < 3; r++) {
    td_reduction red = r == 0 ? TD_REDUCTION_MEAN : r == 1 ? TD_REDUCTION_SUM : TD_REDUCTION_NONE;
    td_tensor *a = fixture_leaf(fx, in_a, true);
    td_tensor *b = in_b ? fixture_leaf(fx, in_b, true) : NULL;
    td_tensor *y = NULL, *loss = NULL;
    TD_ASSERT_OK(fn(a, b, fx, red, &y));
    char key[96], what[200];
    snprintf(key, sizeof key, "%s.%s", prefix, reds[r]);
    td_test_assert_close(key, y, fixture_get(fx, key), RTOL, ATOL);
    if (red == TD_REDUCTION_NONE) add_weighted(&loss, y, fixture_get(fx, gy_none));
    else loss = td_tensor_ref(y);
    TD_ASSERT_OK(td_tensor_backward(loss));
    snprintf(key, sizeof key, "%s.%s.grad0", prefix, reds[r]);
    snprintf(what, sizeof what, "%s grad of %s", key, in_a);
    fixture_check_grad(what, a, fx, key, RTOL, ATOL);
    if (b) {
      snprintf(key, sizeof key, "%s.%s.grad1", prefix, reds[r]);
      fixture_check_grad(key, b, fx, key, RTOL, ATOL);
    }
    td_tensor_unref(a);
    td_tensor_unref(b);
    td_tensor_unref(y);
    td_tensor_unref(loss);
  }
}

static void test_losses_match_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("nn_losses", &fx, NULL);
  check_loss(&fx, "ce", ce, "logits", NULL, "gy.none");
  check_loss(&fx, "ce_ignore1", ce_ignore1, "logits", NULL, "gy.none");
  check_loss(&fx, "nll", nll, "logp", NULL, "gy.none");
  check_loss(&fx, "mse", mse, "mse.a", "mse.b", "gy.mse_none");
  td_tensor_list_fini(&fx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_linear_matches_pytorch),
      cmocka_unit_test(test_conv2d_matches_pytorch),
      cmocka_unit_test(test_lstm_matches_pytorch),
      cmocka_unit_test(test_lstm_batch_first_matches_pytorch),
      cmocka_unit_test(test_lstm_cell_matches_pytorch),
      cmocka_unit_test(test_losses_match_pytorch),
  };
  return cmocka_run_group_tests_name("modules_fixtures", tests, NULL, NULL);
}
