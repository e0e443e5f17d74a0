/* test_optim_fixtures.c - every optimizer configuration against 3 steps of torch.optim 1.13.
 *
 * Each tests/fixtures/optim_<config>.safetensors holds the initial parameters p.0.<i>, the
 * gradients g.<step>.<i> (parameter 1 has none at step 1) and the parameters after each step
 * p.<step+1>.<i>; its metadata holds the hyper-parameters. Every configuration is replayed three
 * ways: explicit gradients (td_optim_step_grads), `.grad` (td_optim_step) and a gradient map
 * (td_optim_step_grad_map).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../modules/fixture.h"
#include "tdist/optim.h"
#include "test_util.h"

#define NPARAM 2
#define NSTEP 3

static const char *configs[] = {
    "sgd",   "sgd_momentum", "sgd_nesterov_wd", "sgd_maximize", "adam", "adam_f32",
    "adam_amsgrad_wd", "adamw", "adamw_amsgrad", "adagrad", "rmsprop",
    "rmsprop_centered_momentum",
};

typedef enum mode { MODE_EXPLICIT, MODE_DOT_GRAD, MODE_GRAD_MAP } mode;

static void options_from_meta(const td_safetensors_meta *m, td_optim_options *o) {
  const char *kind = td_safetensors_meta_get(m, "kind");
  assert_non_null(kind);
  td_optim_kind k = TD_OPTIM_SGD;
  if (strcmp(kind, "sgd") == 0) k = TD_OPTIM_SGD;
  else if (strcmp(kind, "adam") == 0) k = TD_OPTIM_ADAM;
  else if (strcmp(kind, "adamw") == 0) k = TD_OPTIM_ADAMW;
  else if (strcmp(kind, "adagrad") == 0) k = TD_OPTIM_ADAGRAD;
  else if (strcmp(kind, "rmsprop") == 0) k = TD_OPTIM_RMSPROP;
  else fail_msg("unknown optimizer kind %s", kind);
  td_optim_options_init(o, k);
  o->lr = fixture_meta_double(m, "lr", o->lr);
  o->weight_decay = fixture_meta_double(m, "weight_decay", o->weight_decay);
  o->maximize = fixture_meta_double(m, "maximize", 0) != 0;
  o->momentum = fixture_meta_double(m, "momentum", o->momentum);
  o->dampening = fixture_meta_double(m, "dampening", o->dampening);
  o->nesterov = fixture_meta_double(m, "nesterov", 0) != 0;
  o->beta1 = fixture_meta_double(m, "beta1", o->beta1);
  o->beta2 = fixture_meta_double(m, "beta2", o->beta2);
  o->eps = fixture_meta_double(m, "eps", o->eps);
  o->amsgrad = fixture_meta_double(m, "amsgrad", 0) != 0;
  o->lr_decay = fixture_meta_double(m, "lr_decay", o->lr_decay);
  o->initial_accumulator_value =
      fixture_meta_double(m, "initial_accumulator_value", o->initial_accumulator_value);
  o->alpha = fixture_meta_double(m, "alpha", o->alpha);
  o->centered = fixture_meta_double(m, "centered", 0) != 0;
}

static void run_config(const char *config, mode md) {
  char name[96];
  snprintf(name, sizeof name, "optim_%s", config);
  td_tensor_list fx;
  td_safetensors_meta meta;
  fixture_load(name, &fx, &meta);
  td_optim_options o;
  options_from_meta(&meta, &o);
  td_tensor *p[NPARAM];
  char key[64];
  for (int i = 0; i < NPARAM; i++) {
    snprintf(key, sizeof key, "p.0.%d", i);
    p[i] = fixture_leaf(&fx, key, true);
  }
  bool f32 = td_tensor_dtype(p[0]) == TD_DTYPE_F32;
  double rtol = f32 ? 1e-5 : 1e-9, atol = f32 ? 1e-6 : 1e-12;
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create(&o, p, NPARAM, &opt));
  for (int s = 0; s < NSTEP; s++) {
    td_tensor *g[NPARAM];
    for (int i = 0; i < NPARAM; i++) {
      snprintf(key, sizeof key, "g.%d.%d", s, i);
      g[i] = td_tensor_list_find(&fx, key);
    }
    if (md == MODE_EXPLICIT) {
      TD_ASSERT_OK(td_optim_step_grads(opt, g, NPARAM));
    } else if (md == MODE_DOT_GRAD) {
      td_optim_zero_grad(opt);
      for (int i = 0; i < NPARAM; i++)
        if (g[i]) TD_ASSERT_OK(td_tensor_set_grad(p[i], g[i]));
      TD_ASSERT_OK(td_optim_step(opt));
    } else {
      td_grad_map *gm = NULL;
      TD_ASSERT_OK(td_grad_map_create(&gm));
      for (int i = 0; i < NPARAM; i++)
        if (g[i]) TD_ASSERT_OK(td_grad_map_accumulate(gm, p[i], g[i]));
      TD_ASSERT_OK(td_optim_step_grad_map(opt, gm));
      td_grad_map_destroy(gm);
    }
    for (int i = 0; i < NPARAM; i++) {
      char what[160];
      snprintf(key, sizeof key, "p.%d.%d", s + 1, i);
      snprintf(what, sizeof what, "%s mode %d after step %d, param %d", config, (int)md, s + 1,
               i);
      td_test_assert_close(what, p[i], fixture_get(&fx, key), rtol, atol);
    }
  }
  /* parameter 1 had no gradient at step 1: its state advanced twice */
  assert_int_equal(td_optim_step_count(opt, 0), 3);
  assert_int_equal(td_optim_step_count(opt, 1), 2);
  td_optim_destroy(opt);
  for (int i = 0; i < NPARAM; i++) td_tensor_unref(p[i]);
  td_tensor_list_fini(&fx);
  td_safetensors_meta_fini(&meta);
}

static void test_optim_matches_pytorch_explicit_grads(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++)
    run_config(configs[c], MODE_EXPLICIT);
}

static void test_optim_matches_pytorch_dot_grad(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++)
    run_config(configs[c], MODE_DOT_GRAD);
}

static void test_optim_matches_pytorch_grad_map(void **state) {
  (void)state;
  for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++)
    run_config(configs[c], MODE_GRAD_MAP);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optim_matches_pytorch_explicit_grads),
      cmocka_unit_test(test_optim_matches_pytorch_dot_grad),
      cmocka_unit_test(test_optim_matches_pytorch_grad_map),
  };
  return cmocka_run_group_tests_name("optim_fixtures", tests, NULL, NULL);
}
