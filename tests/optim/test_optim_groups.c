/* test_optim_groups.c - parameter groups, gradient-norm clipping, the warmup + cosine
 * schedule and the state accessors for checkpoints: API and misuse, and PyTorch 1.13 references from scripts/gen_gpt_fixtures.py
 * (optim_adamw_groups, optim_clip, optim_schedule). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../modules/fixture.h"
#include "tdist/optim.h"
#include "test_util.h"

static td_tensor *vec(const double *v, int64_t n, bool rg) {
  return td_test_tensor(v, &n, 1, TD_DTYPE_F64, rg);
}

/* AdamW with decay 0.1 on group 0 ([3, 4] matrix) and none on group 1 (two vectors, lr 0.02)
 * against 3 steps of torch.optim.AdamW with the same param_groups. */
static void test_optim_groups_adamw_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  td_safetensors_meta meta;
  fixture_load("optim_adamw_groups", &fx, &meta);
  td_tensor *p[3];
  char key[64];
  for (int i = 0; i < 3; i++) {
    snprintf(key, sizeof key, "p.0.%d", i);
    p[i] = fixture_leaf(&fx, key, true);
  }
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  o.lr = fixture_meta_double(&meta, "lr", NAN);
  o.beta1 = fixture_meta_double(&meta, "beta1", NAN);
  o.beta2 = fixture_meta_double(&meta, "beta2", NAN);
  td_optim_group g[2];
  td_optim_group_init(&g[0], p, 1);
  g[0].weight_decay = fixture_meta_double(&meta, "group0_weight_decay", NAN);
  td_optim_group_init(&g[1], p + 1, 2);
  g[1].weight_decay = fixture_meta_double(&meta, "group1_weight_decay", NAN);
  g[1].lr = fixture_meta_double(&meta, "group1_lr", NAN);
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create_groups(&o, g, 2, &opt));
  assert_int_equal(td_optim_num_groups(opt), 2);
  assert_int_equal(td_optim_num_params(opt), 3);
  for (int s = 0; s < 3; s++) {
    td_optim_zero_grad(opt);
    for (int i = 0; i < 3; i++) {
      snprintf(key, sizeof key, "g.%d.%d", s, i);
      TD_ASSERT_OK(td_tensor_set_grad(p[i], fixture_get(&fx, key)));
    }
    TD_ASSERT_OK(td_optim_step(opt));
    for (int i = 0; i < 3; i++) {
      char what[96];
      snprintf(key, sizeof key, "p.%d.%d", s + 1, i);
      snprintf(what, sizeof what, "AdamW groups: param %d after step %d", i, s + 1);
      td_test_assert_close(what, p[i], fixture_get(&fx, key), 1e-9, 1e-12);
    }
  }
  td_optim_destroy(opt);
  for (int i = 0; i < 3; i++) td_tensor_unref(p[i]);
  td_tensor_list_fini(&fx);
  td_safetensors_meta_fini(&meta);
}

/* Inherited values, per-group accessors, set_lr on every group, set_group_lr on one. */
static void test_optim_groups_accessors(void **state) {
  (void)state;
  double v[] = {1, 2};
  td_tensor *a = vec(v, 2, true), *b = vec(v, 2, true), *c = vec(v, 2, true);
  td_tensor *ga[1] = {a}, *gb[2] = {b, c};
  td_optim_group g[3];
  td_optim_group_init(&g[0], ga, 1);
  td_optim_group_init(&g[1], gb, 2);
  g[1].weight_decay = 0.0;
  g[1].lr = 0.5;
  td_optim_group_init(&g[2], NULL, 0); /* an empty group is allowed, as in PyTorch */
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create_groups(&o, g, 3, &opt));
  double lr, wd;
  size_t n;
  TD_ASSERT_OK(td_optim_group_get(opt, 0, &lr, &wd, &n));
  assert_true(lr == 1e-3 && wd == 1e-2 && n == 1); /* inherited AdamW defaults */
  TD_ASSERT_OK(td_optim_group_get(opt, 1, &lr, &wd, &n));
  assert_true(lr == 0.5 && wd == 0.0 && n == 2);
  TD_ASSERT_STATUS(td_optim_group_get(opt, 3, &lr, NULL, NULL), TD_ERR_INVALID);
  assert_ptr_equal(td_optim_param(opt, 2), c);
  TD_ASSERT_OK(td_optim_set_lr(opt, 0.25));
  for (size_t i = 0; i < 3; i++) {
    TD_ASSERT_OK(td_optim_group_get(opt, i, &lr, NULL, NULL));
    assert_true(lr == 0.25);
  }
  TD_ASSERT_OK(td_optim_set_group_lr(opt, 1, 0.125));
  TD_ASSERT_OK(td_optim_group_get(opt, 0, &lr, NULL, NULL));
  assert_true(lr == 0.25);
  TD_ASSERT_OK(td_optim_group_get(opt, 1, &lr, NULL, NULL));
  assert_true(lr == 0.125);
  TD_ASSERT_STATUS(td_optim_set_group_lr(opt, 1, -1), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_set_group_lr(opt, 9, 0.1), TD_ERR_INVALID);
  /* a group with lr 0 and no decay leaves its parameters alone; the other group moves */
  TD_ASSERT_OK(td_optim_set_group_lr(opt, 1, 0.0));
  double one[] = {1, 1};
  td_tensor *gr = vec(one, 2, false);
  td_tensor *grads[3] = {gr, gr, gr};
  TD_ASSERT_OK(td_optim_step_grads(opt, grads, 3));
  td_tensor *orig = vec(v, 2, false);
  td_test_assert_close("lr-0 group unchanged", b, orig, 0, 0);
  double moved;
  int64_t i0 = 0;
  TD_ASSERT_OK(td_tensor_get(a, &i0, &moved));
  assert_true(moved < 1.0);
  td_optim_destroy(opt);
  td_tensor_unref(orig);
  td_tensor_unref(gr);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(c);
}

/* State for checkpoints: an AdamW whose state and step count are copied from another continues
 * exactly as the other does (the bias correction needs the step); a wrong element count is
 * refused and changes nothing; a dropped state restarts from zeros. */
static void test_optim_state_get_set_continues_a_run(void **state) {
  (void)state;
  double v[] = {1, -2, 3}, gv[] = {0.5, 0.25, -1};
  td_tensor *a = vec(v, 3, true), *b = vec(v, 3, true), *g = vec(gv, 3, false);
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  o.lr = 0.1;
  td_optim *oa = NULL, *ob = NULL;
  TD_ASSERT_OK(td_optim_create(&o, &a, 1, &oa));
  TD_ASSERT_OK(td_optim_create(&o, &b, 1, &ob));
  td_tensor *bufs[3] = {0};
  int64_t step = -1;
  TD_ASSERT_OK(td_optim_state_get(oa, 0, bufs, &step));
  assert_true(!bufs[0] && !bufs[1] && !bufs[2] && step == 0); /* created by the first update */
  for (int i = 0; i < 3; i++) TD_ASSERT_OK(td_optim_step_grads(oa, &g, 1));
  TD_ASSERT_OK(td_optim_state_get(oa, 0, bufs, &step));
  assert_true(bufs[0] && bufs[1] && !bufs[2] && step == 3);
  TD_ASSERT_OK(td_tensor_copy_(b, a));
  double four[] = {1, 2, 3, 4};
  td_tensor *wrong = vec(four, 4, false), *bad[3] = {wrong, NULL, NULL};
  TD_ASSERT_STATUS(td_optim_state_set(ob, 0, bad, 3), TD_ERR_SHAPE);
  assert_int_equal(td_optim_step_count(ob, 0), 0);
  TD_ASSERT_OK(td_optim_state_set(ob, 0, bufs, step));
  assert_int_equal(td_optim_step_count(ob, 0), 3);
  TD_ASSERT_OK(td_optim_step_grads(oa, &g, 1));
  TD_ASSERT_OK(td_optim_step_grads(ob, &g, 1));
  td_test_assert_close("resumed AdamW", b, a, 0, 0);
  /* the copies are the optimizer's own: changing the source does not reach it */
  TD_ASSERT_OK(td_tensor_zero_(bufs[0]));
  td_tensor *nb[3] = {0};
  TD_ASSERT_OK(td_optim_state_get(ob, 0, nb, NULL));
  assert_true(nb[0] && nb[0] != bufs[0]);
  for (int i = 0; i < 3; i++) td_tensor_unref(nb[i]);
  /* the step count alone: the live tensors kept (the same objects), the count changed */
  TD_ASSERT_OK(td_optim_state_set_step(ob, 0, 7));
  td_tensor *kb[3] = {0};
  TD_ASSERT_OK(td_optim_state_get(ob, 0, kb, &step));
  assert_true(kb[0] == nb[0] && kb[1] != NULL && step == 7);
  for (int i = 0; i < 3; i++) td_tensor_unref(kb[i]);
  /* adopted: the given tensors are the state (no copy), viewed in the parameter's shape */
  double st2[] = {5, 6, 7};
  td_tensor *own = vec(st2, 3, false), *ad[3] = {own, own, NULL};
  TD_ASSERT_OK(td_optim_state_adopt(ob, 0, ad, 9));
  TD_ASSERT_OK(td_optim_state_get(ob, 0, kb, &step));
  assert_true(kb[0] && td_tensor_data(kb[0]) == td_tensor_data(own) && !kb[2] && step == 9);
  for (int i = 0; i < 3; i++) td_tensor_unref(kb[i]);
  td_tensor *bad4[3] = {wrong, NULL, NULL};
  TD_ASSERT_STATUS(td_optim_state_adopt(ob, 0, bad4, 1), TD_ERR_SHAPE);
  assert_int_equal(td_optim_step_count(ob, 0), 9); /* nothing changed */
  td_tensor_unref(own);
  TD_ASSERT_STATUS(td_optim_state_set_step(ob, 0, -1), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_state_set_step(ob, 1, 1), TD_ERR_INVALID);
  td_tensor *none[3] = {0};
  TD_ASSERT_OK(td_optim_state_set(ob, 0, none, 0));
  TD_ASSERT_OK(td_optim_state_get(ob, 0, nb, &step));
  assert_true(!nb[0] && !nb[1] && step == 0);
  TD_ASSERT_STATUS(td_optim_state_get(ob, 1, nb, NULL), TD_ERR_INVALID);
  for (int i = 0; i < 3; i++) td_tensor_unref(bufs[i]);
  td_tensor_unref(wrong);
  td_optim_destroy(oa);
  td_optim_destroy(ob);
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(g);
}

static void test_optim_groups_misuse(void **state) {
  (void)state;
  double v[] = {1, 2};
  td_tensor *a = vec(v, 2, true), *b = vec(v, 2, true);
  td_tensor *g0[2] = {a, b}, *g1[1] = {a};
  td_optim_group g[2];
  td_optim_group_init(&g[0], g0, 2);
  td_optim_group_init(&g[1], g1, 1);
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  td_optim *opt = NULL;
  TD_ASSERT_STATUS(td_optim_create_groups(&o, g, 2, &opt), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "more than one group"));
  td_optim_group_init(&g[1], g1, 1);
  g[0].n = 1;
  g[1].params = g0 + 1; /* now disjoint: a | b */
  g[1].weight_decay = -0.5;
  TD_ASSERT_STATUS(td_optim_create_groups(&o, g, 2, &opt), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "group 1"));
  g[1].weight_decay = NAN;
  g[1].lr = -1;
  TD_ASSERT_STATUS(td_optim_create_groups(&o, g, 2, &opt), TD_ERR_INVALID);
  g[1].lr = NAN;
  g[1].params = NULL;
  TD_ASSERT_STATUS(td_optim_create_groups(&o, g, 2, &opt), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_create_groups(&o, NULL, 2, &opt), TD_ERR_INVALID);
  assert_null(opt);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

/* clip_grad_norm_ for norm types 2, inf, 1, 3 (clipping) and 2 with a large max_norm (no
 * change) against PyTorch: the returned total norm and every clipped gradient. */
static void test_optim_clip_grad_norm_matches_pytorch(void **state) {
  (void)state;
  td_tensor_list fx;
  td_safetensors_meta meta;
  fixture_load("optim_clip", &fx, &meta);
  const char *cases[] = {"2", "inf", "1", "3", "2big"};
  const double norm_types[] = {2, INFINITY, 1, 3, 2}, max_norms[] = {1.0, 0.5, 2.0, 1.5, 1000};
  char key[64];
  for (int c = 0; c < 5; c++) {
    td_tensor *p[3];
    for (int i = 0; i < 3; i++) {
      snprintf(key, sizeof key, "g.%d", i);
      td_tensor *g = fixture_get(&fx, key), *gc;
      TD_ASSERT_OK(td_tensor_zeros(td_tensor_shape(g), td_tensor_ndim(g), TD_DTYPE_F64,
                                   td_device_cpu(), &p[i]));
      TD_ASSERT_OK(td_tensor_set_requires_grad(p[i], true));
      TD_ASSERT_OK(td_tensor_clone(g, &gc));
      TD_ASSERT_OK(td_tensor_set_grad(p[i], gc));
      td_tensor_unref(gc);
    }
    td_optim_options o;
    td_optim_options_init(&o, TD_OPTIM_SGD);
    o.lr = 0.1;
    td_optim *opt = NULL;
    TD_ASSERT_OK(td_optim_create(&o, p, 3, &opt));
    double total = -1;
    TD_ASSERT_OK(td_optim_clip_grad_norm(opt, max_norms[c], norm_types[c], &total));
    snprintf(key, sizeof key, "total.%s", cases[c]);
    double want;
    TD_ASSERT_OK(td_tensor_item(fixture_get(&fx, key), &want));
    if (fabs(total - want) > 1e-12 * fabs(want))
      fail_msg("clip case %s: total norm %.17g, PyTorch %.17g", cases[c], total, want);
    for (int i = 0; i < 3; i++) {
      char what[64];
      snprintf(key, sizeof key, "clipped.%s.%d", cases[c], i);
      snprintf(what, sizeof what, "clip case %s grad %d", cases[c], i);
      fixture_check_grad(what, p[i], &fx, key, 1e-12, 1e-15);
      td_tensor_unref(p[i]);
    }
    td_optim_destroy(opt);
  }
  td_tensor_list_fini(&fx);
  td_safetensors_meta_fini(&meta);
}

/* Parameters without gradients are ignored; none at all gives a total of 0; bad arguments. */
static void test_optim_clip_grad_norm_edges(void **state) {
  (void)state;
  double v[] = {3, 4};
  td_tensor *a = vec(v, 2, true), *b = vec(v, 2, true);
  td_tensor *ps[2] = {a, b};
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAM);
  td_optim *opt = NULL;
  TD_ASSERT_OK(td_optim_create(&o, ps, 2, &opt));
  double total = -1;
  TD_ASSERT_OK(td_optim_clip_grad_norm(opt, 1.0, 2.0, &total));
  assert_true(total == 0.0);
  td_tensor *g = vec(v, 2, false);
  TD_ASSERT_OK(td_tensor_set_grad(b, g));
  TD_ASSERT_OK(td_optim_clip_grad_norm(opt, 1.0, 2.0, &total));
  assert_true(fabs(total - 5.0) < 1e-12);
  td_tensor *gb = td_tensor_grad(b);
  double s[] = {3 / (5 + 1e-6), 4 / (5 + 1e-6)};
  td_tensor *want = vec(s, 2, false);
  td_test_assert_close("clipped to norm 1", gb, want, 1e-12, 0);
  assert_null(td_tensor_grad(a));
  TD_ASSERT_STATUS(td_optim_clip_grad_norm(opt, -1.0, 2.0, &total), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_clip_grad_norm(opt, NAN, 2.0, &total), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_clip_grad_norm(opt, 1.0, 0.0, &total), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_optim_clip_grad_norm(NULL, 1.0, 2.0, &total), TD_ERR_INVALID);
  td_tensor_unref(want);
  td_tensor_unref(gb);
  td_tensor_unref(g);
  td_optim_destroy(opt);
  td_tensor_unref(a);
  td_tensor_unref(b);
}

/* Every learning rate of nanoGPT's get_lr (through LambdaLR) for two configurations. */
static void test_optim_lr_warmup_cosine_matches_nanogpt(void **state) {
  (void)state;
  td_tensor_list fx;
  td_safetensors_meta meta;
  fixture_load("optim_schedule", &fx, &meta);
  const char *names[] = {"a", "b"};
  for (int c = 0; c < 2; c++) {
    char key[32];
    snprintf(key, sizeof key, "config.%s", names[c]);
    const char *cfg = td_safetensors_meta_get(&meta, key);
    assert_non_null(cfg);
    long long warmup, decay;
    double lr, min_lr;
    assert_int_equal(sscanf(cfg, "%lld,%lld,%lf,%lf", &warmup, &decay, &lr, &min_lr), 4);
    snprintf(key, sizeof key, "lr.%s", names[c]);
    td_tensor *want = fixture_get(&fx, key);
    int64_t n = td_tensor_numel(want);
    assert_true(n > decay); /* the fixture covers warmup, decay and the floor */
    for (int64_t i = 0; i < n; i++) {
      double w, got = td_optim_lr_warmup_cosine(i, warmup, decay, lr, min_lr);
      TD_ASSERT_OK(td_tensor_get(want, &i, &w));
      if (fabs(got - w) > 1e-15 * w)
        fail_msg("config %s step %lld: lr %.17g, nanoGPT %.17g", names[c], (long long)i, got, w);
    }
  }
  /* no decay phase: min_lr from the end of the warmup on */
  assert_true(td_optim_lr_warmup_cosine(3, 4, 4, 1.0, 0.1) == 0.8);
  assert_true(td_optim_lr_warmup_cosine(4, 4, 4, 1.0, 0.1) == 0.1);
  td_tensor_list_fini(&fx);
  td_safetensors_meta_fini(&meta);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_optim_groups_adamw_matches_pytorch),
      cmocka_unit_test(test_optim_groups_accessors),
      cmocka_unit_test(test_optim_groups_misuse),
      cmocka_unit_test(test_optim_state_get_set_continues_a_run),
      cmocka_unit_test(test_optim_clip_grad_norm_matches_pytorch),
      cmocka_unit_test(test_optim_clip_grad_norm_edges),
      cmocka_unit_test(test_optim_lr_warmup_cosine_matches_nanogpt),
  };
  return cmocka_run_group_tests_name("optim_groups", tests, NULL, NULL);
}
