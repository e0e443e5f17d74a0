/* test_module_checkpoint.c - activation checkpointing of modules and composable forward hooks
 * (nn.h): a GPT with every block checkpointed (full) or every attention core (selective) gives
 * the loss and every parameter gradient of the plain GPT bit for bit, in float64 and float32, and
 * keeps less after forward (the allocator's count: full keeps the blocks' inputs, selective drops
 * the attention probabilities), also under bfloat16 autocast (the recompute runs in the forward's
 * autocast scope); a Sequential with Dropout replays its masks and leaves the
 * Dropout's generator where the plain run does; several hook entries per module run in
 * registration order, can be removed by handle, coexist with the single-owner call, and run
 * again in the recompute (td_checkpoint_is_recomputing); the errors (selective mode on a type
 * without regions, a non-GPT, a pre hook failing, an unknown mode). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tdist/nn.h"
#include "test_util.h"

/* Every parameter's gradient of a and b (same layout) bit for bit. */
static void assert_grads_bits(td_module *a, td_module *b, const char *what) {
  td_tensor_list pa, pb;
  td_tensor_list_init(&pa);
  td_tensor_list_init(&pb);
  TD_ASSERT_OK(td_module_named_parameters(a, &pa));
  TD_ASSERT_OK(td_module_named_parameters(b, &pb));
  assert_int_equal(pa.n, pb.n);
  for (size_t i = 0; i < pa.n; i++) {
    td_tensor *ga = td_tensor_grad(pa.tensors[i]), *gb = td_tensor_grad(pb.tensors[i]);
    if (!ga || !gb || !td_test_same_bits(ga, gb))
      fail_msg("%s: gradient of %s differs (or is missing)", what, pa.names[i]);
    td_tensor_unref(ga), td_tensor_unref(gb);
  }
  td_tensor_list_fini(&pa);
  td_tensor_list_fini(&pb);
}

static td_module *make_gpt(td_dtype dt) { return td_test_tiny_gpt(dt, 3, 5); }

static void tokens(td_tensor **idx, td_tensor **tgt) {
  int64_t s[2] = {2, 8}, v[16], t[16];
  for (int i = 0; i < 16; i++) v[i] = (i * 5 + 3) % 13, t[i] = (i * 7 + 1) % 13;
  TD_ASSERT_OK(td_tensor_from_buffer(v, s, 2, TD_DTYPE_I64, idx));
  TD_ASSERT_OK(td_tensor_from_buffer(t, s, 2, TD_DTYPE_I64, tgt));
}

/* Runs forward + backward; *kept gets the tensor bytes the forward left behind. */
static td_tensor *loss_of(td_module *m, size_t *kept) {
  td_tensor *idx, *tgt, *logits = NULL, *loss = NULL;
  tokens(&idx, &tgt);
  size_t before = 0, after = 0;
  td_cpu_memory_info(&before, NULL, NULL);
  TD_ASSERT_OK(td_gpt_forward(m, idx, tgt, &logits, &loss));
  td_cpu_memory_info(&after, NULL, NULL);
  if (kept) *kept = after - before;
  TD_ASSERT_OK(td_tensor_backward(loss));
  td_tensor_unref(idx), td_tensor_unref(tgt), td_tensor_unref(logits);
  return loss;
}

static void gpt_parity(td_dtype dt) {
  td_module *plain = make_gpt(dt), *full = make_gpt(dt), *sel = make_gpt(dt);
  TD_ASSERT_OK(td_gpt_set_activation_checkpointing(full, TD_CHECKPOINT_FULL));
  TD_ASSERT_OK(td_gpt_set_activation_checkpointing(sel, TD_CHECKPOINT_SELECTIVE));
  td_module *h0 = td_module_child(td_module_child(td_module_child(full, "transformer"), "h"), "0");
  assert_int_equal(td_module_get_checkpoint(h0), TD_CHECKPOINT_FULL);
  assert_int_equal(td_module_get_checkpoint(td_module_child(h0, "attn")), TD_CHECKPOINT_NONE);
  size_t kp = 0, kf = 0, ks = 0;
  td_tensor *lp = loss_of(plain, &kp), *lf = loss_of(full, &kf), *ls = loss_of(sel, &ks);
  print_message("%s: forward kept %zu bytes plain, %zu full, %zu selective\n",
                td_dtype_name(dt), kp, kf, ks);
  assert_int_equal(td_test_count_nodes(lf, "CheckpointBackward"), 3);
  assert_int_equal(td_test_count_nodes(ls, "CheckpointBackward"), 3);
  assert_true(td_test_same_bits(lp, lf));
  assert_true(td_test_same_bits(lp, ls));
  assert_grads_bits(plain, full, "full");
  assert_grads_bits(plain, sel, "selective");
  /* selective drops each block's probabilities [B, H, T, T] (and nothing else it would keep) */
  size_t e = td_dtype_size(dt), probs = 3 * (size_t)(2 * 2 * 8 * 8) * e;
  assert_true(ks < kp);
  assert_true(kp - ks >= probs);
  /* full keeps about one [B, T, C] per block instead of every intermediate */
  assert_true(kf < ks);
  assert_true(kf * 3 < kp);
  /* switched off again, the model runs plainly */
  TD_ASSERT_OK(td_gpt_set_activation_checkpointing(full, TD_CHECKPOINT_NONE));
  assert_int_equal(td_module_get_checkpoint(h0), TD_CHECKPOINT_NONE);
  td_module_zero_grad(full);
  td_module_zero_grad(plain);
  td_tensor *lf2 = loss_of(full, NULL), *lp2 = loss_of(plain, NULL);
  assert_grads_bits(plain, full, "full switched off");
  td_tensor *all[] = {lp, lf, ls, lf2, lp2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_module_unref(plain), td_module_unref(full), td_module_unref(sel);
}

static void test_module_checkpoint_gpt_bitwise(void **state) {
  (void)state;
  gpt_parity(TD_DTYPE_F64);
  gpt_parity(TD_DTYPE_F32);
}

/* Under autocast (the GPT's forward in a bfloat16 scope: td_module_set_autocast), the recompute
 * runs in the forward's scope although the engine suspends autocast in backward: the same bits
 * as the plain autocast GPT. */
static void test_module_checkpoint_autocast_bitwise(void **state) {
  (void)state;
  for (int mode = 1; mode <= 2; mode++) {
    td_module *plain = make_gpt(TD_DTYPE_F32), *ck = make_gpt(TD_DTYPE_F32);
    TD_ASSERT_OK(td_module_set_autocast(plain, true, TD_DTYPE_BF16));
    TD_ASSERT_OK(td_module_set_autocast(ck, true, TD_DTYPE_BF16));
    TD_ASSERT_OK(td_gpt_set_activation_checkpointing(
        ck, mode == 1 ? TD_CHECKPOINT_FULL : TD_CHECKPOINT_SELECTIVE));
    td_tensor *lp = loss_of(plain, NULL), *lc = loss_of(ck, NULL);
    assert_int_equal(td_test_count_nodes(lc, "CheckpointBackward"), 3); /* 16-bit outputs too */
    assert_true(td_test_same_bits(lp, lc));
    assert_grads_bits(plain, ck, mode == 1 ? "full, bfloat16 autocast" : "selective, autocast");
    td_tensor_unref(lp), td_tensor_unref(lc);
    td_module_unref(plain), td_module_unref(ck);
  }
}

/* ---- Dropout inside a checkpointed module ---- */

static td_module *make_dropout_net(void) {
  td_generator *g;
  td_module *seq, *l1, *dr, *l2;
  TD_ASSERT_OK(td_generator_create(3, &g));
  TD_ASSERT_OK(td_sequential_create(&seq));
  TD_ASSERT_OK(td_linear_create(6, 6, true, g, &l1));
  TD_ASSERT_OK(td_dropout_create(0.4, g, &dr));
  TD_ASSERT_OK(td_linear_create(6, 2, true, g, &l2));
  td_module *ch[3] = {l1, dr, l2};
  for (int i = 0; i < 3; i++) {
    TD_ASSERT_OK(td_sequential_append(seq, ch[i]));
    td_module_unref(ch[i]);
  }
  td_generator_destroy(g);
  TD_ASSERT_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

static td_tensor *net_loss(td_module *m, uint64_t seed) {
  int64_t s[2] = {5, 6};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F64, seed, true), *y = NULL, *l = NULL;
  TD_ASSERT_OK(td_module_forward(m, x, &y));
  TD_ASSERT_OK(td_tensor_sum_all(y, &l));
  td_tensor_unref(x), td_tensor_unref(y);
  return l;
}

static void test_module_checkpoint_dropout_replay(void **state) {
  (void)state;
  td_module *a = make_dropout_net(), *b = make_dropout_net();
  TD_ASSERT_OK(td_module_set_checkpoint(b, TD_CHECKPOINT_FULL));
  for (int step = 0; step < 3; step++) { /* masks differ per step: each must be replayed */
    td_module_zero_grad(a);
    td_module_zero_grad(b);
    td_tensor *la = net_loss(a, 10 + step), *lb = net_loss(b, 10 + step);
    assert_true(td_test_same_bits(la, lb));
    assert_string_equal(td_node_name(td_tensor_grad_fn(lb)), "SumBackward");
    TD_ASSERT_OK(td_tensor_backward(la));
    TD_ASSERT_OK(td_tensor_backward(lb));
    assert_grads_bits(a, b, "dropout net");
    td_tensor_unref(la), td_tensor_unref(lb);
  }
  /* in evaluation (no grad) nothing is checkpointed */
  bool prev = td_autograd_set_enabled(false);
  td_tensor *le = net_loss(b, 1);
  assert_false(td_tensor_requires_grad(le));
  td_autograd_set_enabled(prev);
  td_tensor_unref(le);
  td_module_unref(a), td_module_unref(b);
}

/* ---- hooks ---- */

typedef struct hook_log {
  char buf[256];
  int recomputes;
  bool fail_pre, fail_in_recompute;
} hook_log;

typedef struct hook_ctx {
  hook_log *log;
  char tag;
} hook_ctx;

static void log_add(hook_log *l, char kind, char tag) {
  size_t n = strlen(l->buf);
  if (n + 3 < sizeof l->buf) l->buf[n] = kind, l->buf[n + 1] = tag, l->buf[n + 2] = 0;
}

static td_status pre_hook(void *ctx, td_module *m) {
  (void)m;
  hook_ctx *c = ctx;
  log_add(c->log, td_checkpoint_is_recomputing() ? 'R' : 'P', c->tag);
  if (td_checkpoint_is_recomputing()) c->log->recomputes++;
  if (c->log->fail_pre && c->tag == 'b') return td_set_error(TD_ERR_STATE, "pre hook b fails");
  if (c->log->fail_in_recompute && td_checkpoint_is_recomputing())
    return td_set_error(TD_ERR_STATE, "hook fails in the recompute");
  return TD_OK;
}

static td_status post_hook(void *ctx, td_module *m, td_status st, td_tensor **out, int n) {
  (void)m, (void)out, (void)n;
  hook_ctx *c = ctx;
  log_add(c->log, st == TD_OK ? 'Q' : 'F', c->tag);
  return TD_OK;
}

/* A post hook that doubles the output (replaces it). */
static td_status double_hook(void *ctx, td_module *m, td_status st, td_tensor **out, int n) {
  (void)ctx, (void)m, (void)n;
  if (st != TD_OK) return TD_OK;
  td_tensor *d = NULL;
  td_status s = td_tensor_mul_scalar(out[0], 2.0, &d);
  if (s != TD_OK) return s;
  td_tensor_unref(out[0]);
  out[0] = d;
  return TD_OK;
}

static void test_module_forward_hooks_compose(void **state) {
  (void)state;
  td_module *lin;
  TD_ASSERT_OK(td_linear_create(3, 2, true, NULL, &lin));
  hook_log log = {0};
  hook_ctx ca = {&log, 'a'}, cb = {&log, 'b'}, cc = {&log, 'c'};
  int ha = 0, hb = 0;
  TD_ASSERT_OK(td_module_add_forward_hooks(lin, pre_hook, post_hook, &ca, &ha));
  TD_ASSERT_OK(td_module_set_forward_hooks(lin, pre_hook, post_hook, &cb)); /* the old call */
  TD_ASSERT_STATUS(td_module_set_forward_hooks(lin, pre_hook, NULL, &cb), TD_ERR_STATE);
  TD_ASSERT_OK(td_module_add_forward_hooks(lin, pre_hook, double_hook, &cc, &hb));
  TD_ASSERT_STATUS(td_module_add_forward_hooks(lin, NULL, NULL, NULL, NULL), TD_ERR_INVALID);
  int64_t s[2] = {1, 3};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F32, 1, false), *y = NULL, *y0 = NULL;
  TD_ASSERT_OK(td_module_forward(lin, x, &y));
  assert_string_equal(log.buf, "PaPbPcQaQb"); /* registration order, pre then post */
  /* the old call's entry goes, the others stay */
  TD_ASSERT_OK(td_module_set_forward_hooks(lin, NULL, NULL, NULL));
  TD_ASSERT_STATUS(td_module_remove_forward_hooks(lin, 12345), TD_ERR_NOT_FOUND);
  TD_ASSERT_OK(td_module_remove_forward_hooks(lin, hb));
  log.buf[0] = 0;
  TD_ASSERT_OK(td_module_forward(lin, x, &y0));
  assert_string_equal(log.buf, "PaQa");
  td_tensor *twice = NULL;
  TD_ASSERT_OK(td_tensor_mul_scalar(y0, 2.0, &twice));
  assert_true(td_test_same_bits(y, twice)); /* the first forward went through the doubling hook */
  /* a failing pre hook: no forward, the post hooks of the entries before it see the failure */
  TD_ASSERT_OK(td_module_add_forward_hooks(lin, pre_hook, post_hook, &cb, &hb));
  TD_ASSERT_OK(td_module_add_forward_hooks(lin, pre_hook, post_hook, &cc, NULL));
  log.fail_pre = true;
  log.buf[0] = 0;
  td_tensor *y2 = NULL;
  TD_ASSERT_STATUS(td_module_forward(lin, x, &y2), TD_ERR_STATE);
  assert_non_null(strstr(td_last_error(), "pre hook b fails"));
  assert_null(y2);
  assert_string_equal(log.buf, "PaPbFa");
  td_tensor *all[] = {x, y, y0, twice};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_module_unref(lin);
}

/* A checkpointed module's hooks run around the forward and again around the recompute. */
static void test_module_checkpoint_hooks_rerun(void **state) {
  (void)state;
  td_module *a = make_dropout_net(), *b = make_dropout_net();
  TD_ASSERT_OK(td_module_set_checkpoint(b, TD_CHECKPOINT_FULL));
  hook_log log = {0};
  hook_ctx outer = {&log, 'o'}, inner = {&log, 'i'};
  td_module *lin_b = td_module_child(b, "0");
  TD_ASSERT_OK(td_module_add_forward_hooks(b, pre_hook, post_hook, &outer, NULL));
  TD_ASSERT_OK(td_module_add_forward_hooks(lin_b, pre_hook, post_hook, &inner, NULL));
  td_tensor *la = net_loss(a, 4), *lb = net_loss(b, 4);
  assert_string_equal(log.buf, "PoPiQiQo");
  log.buf[0] = 0;
  TD_ASSERT_OK(td_tensor_backward(la));
  TD_ASSERT_OK(td_tensor_backward(lb));
  assert_string_equal(log.buf, "RoRiQiQo"); /* the recompute, in backward */
  assert_int_equal(log.recomputes, 2);
  assert_grads_bits(a, b, "hooked");
  td_tensor_unref(la), td_tensor_unref(lb);
  /* a hook failing in the recompute fails the backward, naming the region */
  log.fail_in_recompute = true;
  td_tensor *lc = net_loss(b, 5);
  TD_ASSERT_STATUS(td_tensor_backward(lc), TD_ERR_STATE);
  assert_non_null(strstr(td_last_error(), "checkpoint 'Sequential'"));
  assert_non_null(strstr(td_last_error(), "hook fails in the recompute"));
  td_tensor_unref(lc);
  td_module_unref(a), td_module_unref(b);
}

/* ---- errors ---- */

static void test_module_checkpoint_errors(void **state) {
  (void)state;
  td_module *lin;
  TD_ASSERT_OK(td_linear_create(3, 2, true, NULL, &lin));
  TD_ASSERT_STATUS(td_module_set_checkpoint(lin, (td_checkpoint_mode)7), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_gpt_set_activation_checkpointing(lin, TD_CHECKPOINT_FULL), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "transformer.h"));
  /* selective on a type that marks no region: refused when it would record */
  TD_ASSERT_OK(td_module_set_checkpoint(lin, TD_CHECKPOINT_SELECTIVE));
  int64_t s[2] = {1, 3};
  td_tensor *x = td_test_randn(s, 2, TD_DTYPE_F32, 1, false), *y = NULL;
  TD_ASSERT_STATUS(td_module_forward(lin, x, &y), TD_ERR_UNSUPPORTED);
  assert_non_null(strstr(td_last_error(), "Linear"));
  assert_null(y);
  bool prev = td_autograd_set_enabled(false); /* nothing to record: no error */
  TD_ASSERT_OK(td_module_forward(lin, x, &y));
  td_autograd_set_enabled(prev);
  td_tensor_unref(y);
  td_tensor_unref(x);
  td_module_unref(lin);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_module_checkpoint_gpt_bitwise),
      cmocka_unit_test(test_module_checkpoint_autocast_bitwise),
      cmocka_unit_test(test_module_checkpoint_dropout_replay),
      cmocka_unit_test(test_module_forward_hooks_compose),
      cmocka_unit_test(test_module_checkpoint_hooks_rerun),
      cmocka_unit_test(test_module_checkpoint_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
