/* test_gpt.c - the GPT modules (CausalSelfAttention, MLP, Block, GPT): finite-difference
 * gradients of a Block and a whole tiny GPT wrt every parameter (float64), PyTorch 1.13
 * references (tests/fixtures/gpt_block and gpt_tiny from scripts/gen_gpt_fixtures.py, the model
 * of bench/peers/torch/gpt.py) for values and gradients in float64 and float32, weight tying,
 * nanoGPT's parameter names and initialisation, and misuse. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fixture.h"
#include "tdist/nn.h"
#include "test_util.h"

static td_gpt_config tiny_config(void) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = 11;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

/* load_prefixed copies every fixture tensor named prefix<name> into a state dict under <name>
 * and loads it strictly into m. */
static void load_prefixed(td_module *m, const td_tensor_list *fx, const char *prefix) {
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  size_t pl = strlen(prefix);
  for (size_t i = 0; i < fx->n; i++)
    if (fx->names[i] && strncmp(fx->names[i], prefix, pl) == 0)
      TD_ASSERT_OK(td_tensor_list_append(&sd, fx->names[i] + pl, fx->tensors[i]));
  TD_ASSERT_OK(td_module_load_state_dict(m, &sd, true));
  td_tensor_list_fini(&sd);
}

/* check_param_grads compares the gradient of every (deduplicated) parameter with
 * fixture[prefix<name>]. */
static void check_param_grads(td_module *m, const td_tensor_list *fx, const char *prefix,
                              double rtol, double atol) {
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  TD_ASSERT_OK(td_module_named_parameters(m, &ps));
  for (size_t i = 0; i < ps.n; i++) {
    char key[160];
    snprintf(key, sizeof key, "%s%s", prefix, ps.names[i]);
    fixture_check_grad(key, ps.tensors[i], fx, key, rtol, atol);
  }
  td_tensor_list_fini(&ps);
}

/* ---- finite differences ---- */

typedef struct mod_ctx {
  td_module *m;
  td_tensor *idx, *tgt; /* GPT: tokens and targets (inputs are then only parameters) */
} mod_ctx;

static td_status block_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  return td_module_forward(((mod_ctx *)ctx)->m, in[0], out);
}

static td_status gpt_loss_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)in, (void)n;
  mod_ctx *c = ctx;
  td_tensor *logits = NULL;
  td_status st = td_gpt_forward(c->m, c->idx, c->tgt, &logits, out);
  td_tensor_unref(logits);
  return st;
}

static td_status gpt_logits_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)in, (void)n;
  mod_ctx *c = ctx;
  return td_gpt_forward(c->m, c->idx, NULL, out, NULL);
}

/* params_with appends m's parameters to first (when not NULL) in a new array of *n entries. */
static td_tensor **params_with(td_module *m, td_tensor *first, td_tensor_list *ps, int *n) {
  td_tensor_list_init(ps);
  TD_ASSERT_OK(td_module_parameters(m, ps));
  td_tensor **in = calloc(ps->n + 1, sizeof *in);
  int k = 0;
  if (first) in[k++] = first;
  for (size_t i = 0; i < ps->n; i++) in[k++] = ps->tensors[i];
  *n = k;
  return in;
}

/* Perturb the default init so that no gradient is accidentally tiny. */
static void randomise(td_module *m, uint64_t seed) {
  td_generator *g;
  TD_ASSERT_OK(td_generator_create(seed, &g));
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  TD_ASSERT_OK(td_module_parameters(m, &ps));
  for (size_t i = 0; i < ps.n; i++) TD_ASSERT_OK(td_nn_init_normal_(ps.tensors[i], 0, 0.4, g));
  td_tensor_list_fini(&ps);
  td_generator_destroy(g);
}

/* f64_model makes a float64 Block (or whole GPT) of the tiny config; seed != 0 randomises it. */
static td_module *f64_model(bool whole, uint64_t seed) {
  td_gpt_config c = tiny_config();
  td_module *m;
  TD_ASSERT_OK(whole ? td_gpt_create(&c, NULL, &m) : td_gpt_block_create(&c, NULL, &m));
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  if (seed) randomise(m, seed);
  return m;
}

static void test_gpt_block_gradcheck(void **state) {
  (void)state;
  td_module *b = f64_model(false, 5);
  const int64_t xs[] = {2, 4, 8};
  td_tensor *x = td_test_randn(xs, 3, TD_DTYPE_F64, 71, true);
  td_tensor_list ps;
  int n;
  td_tensor **in = params_with(b, x, &ps, &n);
  assert_int_equal(n, 13); /* x + 12 parameters */
  mod_ctx ctx = {b, NULL, NULL};
  td_test_gradcheck(block_fn, &ctx, in, n, 1e-6, 1e-7, 1e-5);
  free(in);
  td_tensor_list_fini(&ps);
  td_tensor_unref(x);
  td_module_unref(b);
}

/* The whole model: the loss (with an ignored target) and the logits, wrt every parameter,
 * including the tied embedding / head matrix. */
static void test_gpt_gradcheck(void **state) {
  (void)state;
  td_module *m = f64_model(true, 6);
  const int64_t idx_v[] = {1, 4, 10, 0, 3, 3, 7, 2, 9, 5}, tgt_v[] = {4, 10, 0, -1, 3, 7, 2, 9,
                                                                       5, 6};
  const int64_t s[] = {2, 5};
  td_tensor *idx, *tgt;
  TD_ASSERT_OK(td_tensor_from_buffer(idx_v, s, 2, TD_DTYPE_I64, &idx));
  TD_ASSERT_OK(td_tensor_from_buffer(tgt_v, s, 2, TD_DTYPE_I64, &tgt));
  td_tensor_list ps;
  int n;
  td_tensor **in = params_with(m, NULL, &ps, &n);
  assert_int_equal(n, 2 + 12 * 2 + 2); /* wte (tied head), wpe, 2 blocks, ln_f */
  mod_ctx ctx = {m, idx, tgt};
  td_test_gradcheck(gpt_loss_fn, &ctx, in, n, 1e-6, 1e-8, 1e-5);
  td_test_gradcheck(gpt_logits_fn, &ctx, in, n, 1e-6, 1e-7, 1e-5);
  free(in);
  td_tensor_list_fini(&ps);
  td_tensor_unref(idx);
  td_tensor_unref(tgt);
  td_module_unref(m);
}

/* ---- PyTorch ---- */

/* fixture_model makes a Block (or a whole GPT) of the tiny config in the fixture's dtype and loads
 * the fixture's parameters ("param." or "param_f32." keys) into it. */
static td_module *fixture_model(const td_tensor_list *fx, bool whole, bool f32) {
  td_gpt_config c = tiny_config();
  td_module *m;
  TD_ASSERT_OK(whole ? td_gpt_create(&c, NULL, &m) : td_gpt_block_create(&c, NULL, &m));
  if (!f32) TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  load_prefixed(m, fx, f32 ? "param_f32." : "param.");
  return m;
}

static void test_gpt_block_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("gpt_block", &fx, NULL);
  for (int f32 = 0; f32 < 2; f32++) {
    const char *sfx = f32 ? ".f32" : "";
    double rtol = f32 ? 1e-4 : 1e-10, atol = f32 ? 1e-5 : 1e-12;
    td_module *b = fixture_model(&fx, false, f32);
    char key[96];
    snprintf(key, sizeof key, "x%s", sfx);
    td_tensor *x = fixture_leaf(&fx, key, true), *y, *w, *sum;
    TD_ASSERT_OK(td_module_forward(b, x, &y));
    snprintf(key, sizeof key, "y%s", sfx);
    td_test_assert_close(key, y, fixture_get(&fx, key), rtol, atol);
    snprintf(key, sizeof key, "gy%s", sfx);
    TD_ASSERT_OK(td_tensor_mul(y, fixture_get(&fx, key), &w));
    TD_ASSERT_OK(td_tensor_sum_all(w, &sum));
    TD_ASSERT_OK(td_tensor_backward(sum));
    snprintf(key, sizeof key, "grad.x%s", sfx);
    fixture_check_grad(key, x, &fx, key, rtol, atol);
    check_param_grads(b, &fx, f32 ? "grad_f32." : "grad.", rtol, atol);
    td_tensor_unref(sum);
    td_tensor_unref(w);
    td_tensor_unref(y);
    td_tensor_unref(x);
    td_module_unref(b);
  }
  td_tensor_list_fini(&fx);
}

static void test_gpt_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  fixture_load("gpt_tiny", &fx, NULL);
  for (int f32 = 0; f32 < 2; f32++) {
    const char *sfx = f32 ? ".f32" : "";
    double rtol = f32 ? 1e-4 : 1e-10, atol = f32 ? 1e-5 : 1e-12;
    td_module *m = fixture_model(&fx, true, f32);
    char key[96];
    snprintf(key, sizeof key, "idx%s", sfx);
    td_tensor *idx = fixture_get(&fx, key);
    snprintf(key, sizeof key, "targets%s", sfx);
    td_tensor *tgt = fixture_get(&fx, key), *logits, *loss;
    TD_ASSERT_OK(td_gpt_forward(m, idx, tgt, &logits, &loss));
    snprintf(key, sizeof key, "logits%s", sfx);
    td_test_assert_close(key, logits, fixture_get(&fx, key), rtol, atol);
    snprintf(key, sizeof key, "loss%s", sfx);
    double lv, want;
    TD_ASSERT_OK(td_tensor_item(loss, &lv));
    TD_ASSERT_OK(td_tensor_item(fixture_get(&fx, key), &want));
    if (fabs(lv - want) > rtol * fabs(want)) fail_msg("loss %.12g, PyTorch %.12g", lv, want);
    TD_ASSERT_OK(td_tensor_backward(loss));
    check_param_grads(m, &fx, f32 ? "grad_f32." : "grad.", rtol, atol);
    td_tensor_unref(logits);
    td_tensor_unref(loss);
    td_module_unref(m);
  }
  td_tensor_list_fini(&fx);
}

/* ---- structure ---- */

/* nanoGPT's names, one tied tensor under two keys, the init statistics, the config round trip. */
static void test_gpt_structure_and_init(void **state) {
  (void)state;
  td_gpt_config c;
  td_gpt_config_init(&c);
  assert_true(c.block_size == 64 && c.n_layer == 4 && c.n_head == 4 && c.n_embd == 128);
  c.vocab_size = 65;
  td_module *m;
  TD_ASSERT_OK(td_gpt_create(&c, NULL, &m));
  assert_string_equal(td_module_type_name(m), "GPT");
  td_tensor *wte, *head, *proj, *fc, *lnw;
  TD_ASSERT_OK(td_module_get_parameter(m, "transformer.wte.weight", &wte));
  TD_ASSERT_OK(td_module_get_parameter(m, "lm_head.weight", &head));
  assert_ptr_equal(wte, head);
  TD_ASSERT_OK(td_module_get_parameter(m, "transformer.h.3.attn.c_proj.weight", &proj));
  TD_ASSERT_OK(td_module_get_parameter(m, "transformer.h.0.mlp.c_fc.weight", &fc));
  TD_ASSERT_OK(td_module_get_parameter(m, "transformer.ln_f.weight", &lnw));
  td_tensor *t;
  TD_ASSERT_STATUS(td_module_get_parameter(m, "transformer.h.4.attn.c_attn.weight", &t),
                   TD_ERR_NOT_FOUND);
  /* standard deviations: 0.02 (weights), 0.02 / sqrt(8) (residual projections) */
  td_tensor *objs[2] = {fc, proj};
  double want[2] = {0.02, 0.02 / sqrt(8.0)};
  for (int i = 0; i < 2; i++) {
    td_tensor *sq, *ms;
    TD_ASSERT_OK(td_tensor_mul(objs[i], objs[i], &sq));
    TD_ASSERT_OK(td_tensor_mean_all(sq, &ms));
    double v;
    TD_ASSERT_OK(td_tensor_item(ms, &v));
    if (fabs(sqrt(v) - want[i]) > 0.05 * want[i])
      fail_msg("init std %d: %g, expected about %g", i, sqrt(v), want[i]);
    td_tensor_unref(sq);
    td_tensor_unref(ms);
  }
  double one;
  int64_t i0 = 5;
  TD_ASSERT_OK(td_tensor_get(lnw, &i0, &one));
  assert_true(one == 1.0);
  /* parameter list: the tied matrix once; state dict: both keys */
  td_tensor_list ps, sd;
  td_tensor_list_init(&ps);
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_module_parameters(m, &ps));
  TD_ASSERT_OK(td_module_state_dict(m, &sd));
  assert_int_equal(ps.n, 2 + 4 * 12 + 2);
  assert_int_equal(sd.n, ps.n + 1);
  assert_non_null(td_tensor_list_find(&sd, "lm_head.weight"));
  int64_t want_params = 65 * 128 + 64 * 128 + 4 * (12 * 128 * 128 + 13 * 128) + 2 * 128;
  assert_int_equal(td_module_num_parameters(m), want_params);
  /* the tying survives a dtype conversion */
  TD_ASSERT_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  td_tensor *w2, *h2;
  TD_ASSERT_OK(td_module_get_parameter(m, "transformer.wte.weight", &w2));
  TD_ASSERT_OK(td_module_get_parameter(m, "lm_head.weight", &h2));
  assert_ptr_equal(w2, h2);
  td_gpt_config back;
  TD_ASSERT_OK(td_gpt_config_get(m, &back));
  assert_true(back.vocab_size == 65 && back.n_embd == 128);
  td_tensor *all[] = {wte, head, proj, fc, lnw, w2, h2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_tensor_list_fini(&ps);
  td_tensor_list_fini(&sd);
  td_module_unref(m);
}

/* The tied matrix's gradient is the sum of what the embedding lookup and the head contribute:
 * compare with the same model untied (lm_head.weight a separate copy). */
static void test_gpt_tied_gradient_accumulates(void **state) {
  (void)state;
  td_module *m = f64_model(true, 7), *u = f64_model(true, 0);
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_module_state_dict(m, &sd));
  TD_ASSERT_OK(td_module_load_state_dict(u, &sd, true));
  td_tensor_list_fini(&sd);
  td_tensor *uw = td_module_param(td_module_child(td_module_child(u, "transformer"), "wte"),
                                  "weight");
  td_tensor *det, *copy;
  TD_ASSERT_OK(td_tensor_detach(uw, &det));
  TD_ASSERT_OK(td_tensor_clone(det, &copy));
  TD_ASSERT_OK(td_module_set_parameter(u, "lm_head.weight", copy)); /* untied */
  td_tensor *uh = td_module_param(td_module_child(u, "lm_head"), "weight");
  assert_ptr_not_equal(uw, uh);
  const int64_t idx_v[] = {1, 4, 10, 0, 4, 2}, s[] = {2, 3};
  td_tensor *idx, *logits, *loss, *lu, *lossu;
  TD_ASSERT_OK(td_tensor_from_buffer(idx_v, s, 2, TD_DTYPE_I64, &idx));
  TD_ASSERT_OK(td_gpt_forward(m, idx, idx, &logits, &loss));
  TD_ASSERT_OK(td_tensor_backward(loss));
  TD_ASSERT_OK(td_gpt_forward(u, idx, idx, &lu, &lossu));
  TD_ASSERT_OK(td_tensor_backward(lossu));
  td_test_assert_close("untied loss", lossu, loss, 1e-14, 0);
  td_tensor *wte = td_module_param(td_module_child(td_module_child(m, "transformer"), "wte"),
                                   "weight");
  td_tensor *g = td_tensor_grad(wte), *ge = td_tensor_grad(uw), *gh = td_tensor_grad(uh), *sum;
  assert_non_null(g);
  assert_non_null(ge);
  assert_non_null(gh);
  TD_ASSERT_OK(td_tensor_add(ge, gh, &sum));
  td_test_assert_close("tied gradient = embedding + head", g, sum, 1e-12, 1e-14);
  /* both shares matter: neither alone is the tied gradient */
  bool close;
  TD_ASSERT_OK(td_tensor_allclose(g, ge, 1e-6, 1e-9, &close));
  assert_false(close);
  TD_ASSERT_OK(td_tensor_allclose(g, gh, 1e-6, 1e-9, &close));
  assert_false(close);
  td_tensor *all[] = {det, copy, idx, logits, loss, lu, lossu, g, ge, gh, sum};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_module_unref(m);
  td_module_unref(u);
}

static void test_gpt_misuse(void **state) {
  (void)state;
  td_gpt_config c = tiny_config();
  td_module *m = NULL, *x = NULL;
  c.n_head = 3; /* does not divide 8 */
  TD_ASSERT_STATUS(td_gpt_create(&c, NULL, &m), TD_ERR_INVALID);
  c = tiny_config();
  c.vocab_size = 0;
  TD_ASSERT_STATUS(td_gpt_create(&c, NULL, &m), TD_ERR_INVALID);
  TD_ASSERT_OK(td_gpt_block_create(&c, NULL, &x)); /* blocks need no vocabulary */
  c = tiny_config();
  TD_ASSERT_OK(td_gpt_create(&c, NULL, &m));
  const int64_t long_s[] = {1, 9}, ok_s[] = {1, 4};
  int64_t v[9] = {0};
  td_tensor *too_long, *idx, *fidx, *logits = NULL, *loss = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(v, long_s, 2, TD_DTYPE_I64, &too_long));
  TD_ASSERT_OK(td_tensor_from_buffer(v, ok_s, 2, TD_DTYPE_I64, &idx));
  TD_ASSERT_OK(td_tensor_to_dtype(idx, TD_DTYPE_F32, &fidx));
  TD_ASSERT_STATUS(td_gpt_forward(m, too_long, NULL, &logits, NULL), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "block size is 8"));
  TD_ASSERT_STATUS(td_gpt_forward(m, fidx, NULL, &logits, NULL), TD_ERR_DTYPE);
  TD_ASSERT_STATUS(td_gpt_forward(m, idx, too_long, &logits, &loss), TD_ERR_SHAPE);
  TD_ASSERT_STATUS(td_gpt_forward(m, idx, NULL, &logits, &loss), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_gpt_forward(x, idx, NULL, &logits, NULL), TD_ERR_INVALID);
  v[0] = 11; /* out of the vocabulary */
  td_tensor *bad;
  TD_ASSERT_OK(td_tensor_from_buffer(v, ok_s, 2, TD_DTYPE_I64, &bad));
  TD_ASSERT_STATUS(td_gpt_forward(m, bad, NULL, &logits, NULL), TD_ERR_INVALID);
  assert_null(logits);
  assert_null(loss);
  /* a block wants [B, T, C] */
  TD_ASSERT_STATUS(td_module_forward(x, fidx, &logits), TD_ERR_SHAPE);
  td_module *tr = td_module_child(m, "transformer");
  TD_ASSERT_STATUS(td_module_forward(tr, fidx, &logits), TD_ERR_UNSUPPORTED);
  td_tensor *all[] = {too_long, idx, fidx, bad};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_module_unref(m);
  td_module_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpt_block_gradcheck),
      cmocka_unit_test(test_gpt_gradcheck),
      cmocka_unit_test(test_gpt_block_matches_pytorch),
      cmocka_unit_test(test_gpt_matches_pytorch),
      cmocka_unit_test(test_gpt_structure_and_init),
      cmocka_unit_test(test_gpt_tied_gradient_accumulates),
      cmocka_unit_test(test_gpt_misuse),
  };
  return cmocka_run_group_tests_name("gpt", tests, NULL, NULL);
}
