/* test_checkpoint.c - td_checkpoint (autograd.h): the gradients of a checkpointed function equal
 * those of the same function run plainly, bit for bit, in float64 and float32 (inputs used twice,
 * a parameter read besides the inputs, an output nobody uses, an input the function ignores, a
 * non-float output); dropout replayed exactly and the generators left as the program saw them
 * (also when another draw happens between forward and backward, as in 1F1B); nested regions;
 * the inner pass inheriting the outer pass's gradient map; leaf hooks once per backward; the
 * phase queries; retain_graph; float64 finite differences; what a checkpointed forward keeps
 * (the allocator's count); the errors (invalid arguments, a missing output, a failing function,
 * a recompute that makes another shape, a second backward). */
#include <math.h>
#include <string.h>

#include "test_util.h"

#define F64 TD_DTYPE_F64
#define F32 TD_DTYPE_F32

enum { B = 3, D = 4 };

/* ---- the function under test ---- */

/* ctx of fn_block: a parameter read besides the inputs, an optional generator for dropout, and
 * what the function saw (phase, name). */
typedef struct block_ctx {
  td_tensor *w;    /* [D, D] leaf that requires grad */
  td_generator *g; /* NULL: no dropout */
  int runs, forward_runs, recompute_runs;
  bool recomputing_seen;
  const char *name_seen;
} block_ctx;

/* inputs (x [B, D], s [B, D]) -> (y = gelu(x W) * s + tanh(x) [x used twice], z = sum(s * s),
 * an int64 tensor). With a generator, y goes through dropout(p = 0.5). */
static td_status fn_block(void *vctx, td_tensor *const *in, int n_in, td_tensor **out,
                          int n_out) {
  block_ctx *c = vctx;
  c->runs++;
  const char *name = NULL;
  td_checkpoint_phase ph = td_checkpoint_current(&name);
  if (ph == TD_CHECKPOINT_PHASE_FORWARD) c->forward_runs++;
  if (ph == TD_CHECKPOINT_PHASE_RECOMPUTE) c->recompute_runs++;
  c->recomputing_seen = td_checkpoint_is_recomputing();
  c->name_seen = name;
  (void)n_in;
  td_tensor *xw = NULL, *a = NULL, *as = NULL, *t = NULL, *y = NULL, *yd = NULL, *ss = NULL;
  td_tensor *z = NULL, *k = NULL;
  td_status st = td_tensor_matmul(in[0], c->w, &xw);
  if (st == TD_OK) st = td_tensor_gelu(xw, &a);
  if (st == TD_OK) st = td_tensor_mul(a, in[1], &as);
  if (st == TD_OK) st = td_tensor_tanh(in[0], &t);
  if (st == TD_OK) st = td_tensor_add(as, t, &y);
  if (st == TD_OK && c->g) st = td_tensor_dropout(y, 0.5, true, c->g, &yd);
  if (st == TD_OK) st = td_tensor_mul(in[1], in[1], &ss);
  if (st == TD_OK) st = td_tensor_sum_all(ss, &z);
  int64_t two = 2;
  if (st == TD_OK && n_out == 3) st = td_tensor_arange(0, 2, 1, TD_DTYPE_I64, td_device_cpu(), &k);
  (void)two;
  if (st == TD_OK) {
    out[0] = yd ? td_tensor_ref(yd) : td_tensor_ref(y);
    if (n_out > 1) out[1] = td_tensor_ref(z);
    if (n_out > 2) out[2] = td_tensor_ref(k);
  }
  td_tensor *all[] = {xw, a, as, t, y, yd, ss, z, k};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}

static td_tensor *leaf(const int64_t *shape, int nd, td_dtype dt, uint64_t seed) {
  return td_test_randn(shape, nd, dt, seed, true);
}

static void assert_grad_bits(const char *what, const td_tensor *a, const td_tensor *b) {
  td_tensor *ga = td_tensor_grad(a), *gb = td_tensor_grad(b);
  if (!td_test_same_bits(ga, gb)) fail_msg("%s: gradients differ (or one is missing)", what);
  td_tensor_unref(ga);
  td_tensor_unref(gb);
}

/* One model: leaves x, s, w (and a generator seeded 7 when dropout). */
typedef struct model {
  td_tensor *x, *s, *w;
  td_generator *g;
  block_ctx c;
} model;

static void model_make(model *m, td_dtype dt, bool dropout) {
  int64_t sx[2] = {B, D}, sw[2] = {D, D};
  memset(m, 0, sizeof *m);
  m->x = leaf(sx, 2, dt, 1);
  m->s = leaf(sx, 2, dt, 2);
  m->w = leaf(sw, 2, dt, 3);
  if (dropout) TD_ASSERT_OK(td_generator_create(7, &m->g));
  m->c.w = m->w;
  m->c.g = m->g;
}

static void model_free(model *m) {
  td_tensor_unref(m->x), td_tensor_unref(m->s), td_tensor_unref(m->w);
  td_generator_destroy(m->g);
}

/* loss = sum(y * y) + 3 z through the function, checkpointed or not; outputs n_out of them. */
static td_tensor *run_loss(model *m, bool ckpt, int n_out) {
  td_tensor *in[2] = {m->x, m->s}, *out[3] = {NULL, NULL, NULL};
  if (ckpt) {
    td_checkpoint_opts o = {.name = "block"};
    TD_ASSERT_OK(td_checkpoint(fn_block, &m->c, in, 2, out, n_out, &o));
    assert_string_equal(td_node_name(td_tensor_grad_fn(out[0])), "CheckpointBackward");
  } else {
    TD_ASSERT_OK(fn_block(&m->c, in, 2, out, n_out));
  }
  td_tensor *yy = NULL, *l1 = NULL, *l2 = NULL, *loss = NULL;
  TD_ASSERT_OK(td_tensor_mul(out[0], out[0], &yy));
  TD_ASSERT_OK(td_tensor_sum_all(yy, &l1));
  if (n_out > 1) {
    TD_ASSERT_OK(td_tensor_mul_scalar(out[1], 3.0, &l2));
    TD_ASSERT_OK(td_tensor_add(l1, l2, &loss));
  } else {
    loss = td_tensor_ref(l1);
  }
  if (n_out > 2) assert_int_equal(td_tensor_dtype(out[2]), TD_DTYPE_I64);
  td_tensor *all[] = {out[0], out[1], out[2], yy, l1, l2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return loss;
}

static void check_parity(td_dtype dt, int n_out, bool dropout) {
  model a, b;
  model_make(&a, dt, dropout);
  model_make(&b, dt, dropout);
  td_tensor *la = run_loss(&a, false, n_out), *lb = run_loss(&b, true, n_out);
  assert_true(td_test_same_bits(la, lb));
  TD_ASSERT_OK(td_tensor_backward(la));
  TD_ASSERT_OK(td_tensor_backward(lb));
  assert_grad_bits("x", a.x, b.x);
  assert_grad_bits("s", a.s, b.s);
  assert_grad_bits("w (read besides the inputs)", a.w, b.w);
  /* the checkpointed function ran twice: forward without recording, then the recompute */
  assert_int_equal(b.c.forward_runs, 1);
  assert_int_equal(b.c.recompute_runs, 1);
  assert_string_equal(b.c.name_seen, "block");
  if (dropout) { /* both generators where the plain run left its own */
    assert_true(td_generator_next_u64(a.g) == td_generator_next_u64(b.g));
  }
  td_tensor_unref(la), td_tensor_unref(lb);
  model_free(&a), model_free(&b);
}

static void test_checkpoint_matches_plain_bitwise(void **state) {
  (void)state;
  check_parity(F64, 3, false);
  check_parity(F32, 3, false);
  check_parity(F64, 2, false);
  check_parity(F32, 1, false); /* z is not an output at all */
}

/* Only y is used downstream: z's part of the graph must not run (s gets only y's gradient). */
static void test_checkpoint_unused_output_and_input(void **state) {
  (void)state;
  model a, b;
  model_make(&a, F64, false);
  model_make(&b, F64, false);
  int64_t sx[2] = {B, D};
  td_tensor *ua = leaf(sx, 2, F64, 9), *ub = leaf(sx, 2, F64, 9);
  td_tensor *ina[3] = {a.x, a.s, ua}, *inb[3] = {b.x, b.s, ub};
  td_tensor *oa[2] = {NULL, NULL}, *ob[2] = {NULL, NULL};
  TD_ASSERT_OK(fn_block(&a.c, ina, 3, oa, 2));
  TD_ASSERT_OK(td_checkpoint(fn_block, &b.c, inb, 3, ob, 2, NULL));
  td_tensor *sa = NULL, *sb = NULL;
  TD_ASSERT_OK(td_tensor_sum_all(oa[0], &sa));
  TD_ASSERT_OK(td_tensor_sum_all(ob[0], &sb));
  TD_ASSERT_OK(td_tensor_backward(sa));
  TD_ASSERT_OK(td_tensor_backward(sb));
  assert_grad_bits("x", a.x, b.x);
  assert_grad_bits("s", a.s, b.s);
  assert_grad_bits("w", a.w, b.w);
  /* an input the function ignores: none without checkpointing; zeros with it (the node has an
   * edge to it: which inputs the function uses is known only when it runs) */
  td_tensor *gua = td_tensor_grad(ua), *gub = td_tensor_grad(ub);
  assert_null(gua);
  assert_non_null(gub);
  const double *gd = td_tensor_data(gub);
  for (int64_t i = 0; i < td_tensor_numel(gub); i++) assert_true(gd[i] == 0.0);
  td_tensor_unref(gub);
  td_tensor *all[] = {ua, ub, oa[0], oa[1], ob[0], ob[1], sa, sb};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  model_free(&a), model_free(&b);
}

/* (y, z) = (2 x, sqrt(0 x)): z's backward turns a zero gradient into NaN (0 * inf). */
static td_status fn_nan_if_run(void *ctx, td_tensor *const *in, int n, td_tensor **out, int no) {
  (void)ctx, (void)n, (void)no;
  td_tensor *zx = NULL;
  td_status st = td_tensor_mul_scalar(in[0], 2.0, &out[0]);
  if (st == TD_OK) st = td_tensor_mul_scalar(in[0], 0.0, &zx);
  if (st == TD_OK) st = td_tensor_sqrt(zx, &out[1]);
  td_tensor_unref(zx);
  return st;
}

/* An output nobody uses gets no gradient, not zeros: its part of the graph does not run. */
static void test_checkpoint_unused_output_not_backpropagated(void **state) {
  (void)state;
  int64_t sx[2] = {B, D};
  td_tensor *x = leaf(sx, 2, F64, 1), *in[1] = {x}, *out[2] = {NULL, NULL}, *s = NULL;
  TD_ASSERT_OK(td_checkpoint(fn_nan_if_run, NULL, in, 1, out, 2, NULL));
  TD_ASSERT_OK(td_tensor_sum_all(out[0], &s));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor *g = td_tensor_grad(x);
  const double *gd = td_tensor_data(g);
  for (int64_t i = 0; i < td_tensor_numel(g); i++) assert_true(gd[i] == 2.0);
  td_tensor *all[] = {x, out[0], out[1], s, g};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
}

/* ---- dropout ---- */

static void test_checkpoint_dropout_replay_exact(void **state) {
  (void)state;
  check_parity(F64, 2, true);
  check_parity(F32, 2, true);
  /* another draw from the generator between forward and backward (1F1B runs the next
   * micro-batch's forward first): the recompute still replays the forward's mask, and after
   * backward the generator is where that draw left it */
  model a, b;
  model_make(&a, F64, true);
  model_make(&b, F64, true);
  td_tensor *la = run_loss(&a, false, 2), *lb = run_loss(&b, true, 2);
  int64_t s1[1] = {5};
  td_tensor *ra = NULL, *rb = NULL;
  TD_ASSERT_OK(td_tensor_uniform(s1, 1, 0, 1, F64, td_device_cpu(), a.g, &ra));
  TD_ASSERT_OK(td_tensor_uniform(s1, 1, 0, 1, F64, td_device_cpu(), b.g, &rb));
  TD_ASSERT_OK(td_tensor_backward(la));
  TD_ASSERT_OK(td_tensor_backward(lb));
  assert_grad_bits("x after an intervening draw", a.x, b.x);
  assert_grad_bits("w after an intervening draw", a.w, b.w);
  assert_true(td_generator_next_u64(a.g) == td_generator_next_u64(b.g));
  td_tensor *all[] = {la, lb, ra, rb};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  model_free(&a), model_free(&b);
}

/* ---- nesting ---- */

typedef struct nest_ctx {
  block_ctx inner;
  td_generator *g;
  bool inner_ckpt; /* false: the plain reference */
} nest_ctx;

/* outer(x, s) = d * d with d = dropout(inner(x, s).y), inner checkpointed inside (x and s are
 * used inside the inner region only: their partial gradients add up in the same order). */
static td_status fn_outer(void *vctx, td_tensor *const *in, int n_in, td_tensor **out, int n_out) {
  nest_ctx *c = vctx;
  (void)n_in, (void)n_out;
  td_tensor *io[1] = {NULL}, *d = NULL;
  td_checkpoint_opts o = {.name = "inner"};
  td_status st = c->inner_ckpt ? td_checkpoint(fn_block, &c->inner, in, 2, io, 1, &o)
                               : fn_block(&c->inner, in, 2, io, 1);
  if (st == TD_OK) st = td_tensor_dropout(io[0], 0.25, true, c->g, &d);
  if (st == TD_OK) st = td_tensor_mul(d, d, &out[0]);
  td_tensor_unref(io[0]);
  td_tensor_unref(d);
  return st;
}

static void test_checkpoint_nested(void **state) {
  (void)state;
  model a, b;
  model_make(&a, F64, true);
  model_make(&b, F64, true);
  nest_ctx ca = {a.c, NULL, false}, cb = {b.c, NULL, true};
  TD_ASSERT_OK(td_generator_create(11, &ca.g));
  TD_ASSERT_OK(td_generator_create(11, &cb.g));
  td_tensor *ina[2] = {a.x, a.s}, *inb[2] = {b.x, b.s}, *ya = NULL, *yb = NULL;
  /* a: plain; b: both levels checkpointed */
  TD_ASSERT_OK(fn_outer(&ca, ina, 2, &ya, 1));
  td_checkpoint_opts o = {.name = "outer"};
  TD_ASSERT_OK(td_checkpoint(fn_outer, &cb, inb, 2, &yb, 1, &o));
  td_tensor *sa = NULL, *sb = NULL;
  TD_ASSERT_OK(td_tensor_sum_all(ya, &sa));
  TD_ASSERT_OK(td_tensor_sum_all(yb, &sb));
  assert_true(td_test_same_bits(sa, sb));
  TD_ASSERT_OK(td_tensor_backward(sa));
  TD_ASSERT_OK(td_tensor_backward(sb));
  assert_grad_bits("x (nested)", a.x, b.x);
  assert_grad_bits("s (nested)", a.s, b.s);
  assert_grad_bits("w (nested)", a.w, b.w);
  /* inside the outer forward (grad off) the inner region ran directly; in the outer recompute
   * it was a region of its own, in forward and then recomputed inside the outer recompute */
  assert_int_equal(cb.inner.runs, 3);
  assert_int_equal(cb.inner.recompute_runs, 1);
  assert_true(cb.inner.recomputing_seen);
  assert_true(td_generator_next_u64(ca.g) == td_generator_next_u64(cb.g));
  assert_true(td_generator_next_u64(a.g) == td_generator_next_u64(b.g));
  td_tensor *all[] = {ya, yb, sa, sb};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_generator_destroy(ca.g), td_generator_destroy(cb.g);
  model_free(&a), model_free(&b);
}

/* ---- gradient maps, hooks, parameters without inputs ---- */

static td_status count_hook(void *ctx, const td_tensor *grad, td_tensor **rep) {
  (void)grad, (void)rep;
  ++*(int *)ctx;
  return TD_OK;
}

static void test_checkpoint_inherits_grad_map(void **state) {
  (void)state;
  model a, b;
  model_make(&a, F64, false);
  model_make(&b, F64, false);
  int hooks_a = 0, hooks_b = 0, ha, hb;
  TD_ASSERT_OK(td_tensor_register_hook(a.w, count_hook, &hooks_a, &ha));
  TD_ASSERT_OK(td_tensor_register_hook(b.w, count_hook, &hooks_b, &hb));
  td_grad_map *ma = NULL, *mb = NULL;
  TD_ASSERT_OK(td_grad_map_create(&ma));
  TD_ASSERT_OK(td_grad_map_create(&mb));
  td_tensor *la = run_loss(&a, false, 2), *lb = run_loss(&b, true, 2);
  td_backward_opts oa = {.grad_map = ma}, ob = {.grad_map = mb};
  TD_ASSERT_OK(td_autograd_backward(&la, NULL, 1, &oa));
  TD_ASSERT_OK(td_autograd_backward(&lb, NULL, 1, &ob));
  /* the recompute's inner pass wrote the parameter's gradient into the outer pass's map */
  td_tensor *gw = td_tensor_grad(b.w);
  assert_null(gw);
  assert_int_equal(td_grad_map_size(mb), td_grad_map_size(ma));
  td_tensor *leaves_a[3] = {a.x, a.s, a.w}, *leaves_b[3] = {b.x, b.s, b.w};
  for (int i = 0; i < 3; i++) {
    td_tensor *ga = td_grad_map_get(ma, leaves_a[i]), *gb = td_grad_map_get(mb, leaves_b[i]);
    assert_non_null(gb);
    assert_true(td_test_same_bits(ga, gb));
    td_tensor_unref(ga), td_tensor_unref(gb);
  }
  assert_int_equal(hooks_a, 1);
  assert_int_equal(hooks_b, 1); /* once per backward, during the inner pass */
  td_grad_map_destroy(ma), td_grad_map_destroy(mb);
  td_tensor_unref(la), td_tensor_unref(lb);
  model_free(&a), model_free(&b);
}

/* No input requires grad: without reads_params nothing is checkpointed (the function runs as
 * if called directly); with it the region is checkpointed and the parameter gets its gradient
 * from the recompute. Both give the plain run's gradient. */
static void test_checkpoint_reads_params(void **state) {
  (void)state;
  for (int rp = 0; rp < 2; rp++) {
    model a, b;
    model_make(&a, F64, false);
    model_make(&b, F64, false);
    TD_ASSERT_OK(td_tensor_set_requires_grad(b.x, false));
    TD_ASSERT_OK(td_tensor_set_requires_grad(b.s, false));
    TD_ASSERT_OK(td_tensor_set_requires_grad(a.x, false));
    TD_ASSERT_OK(td_tensor_set_requires_grad(a.s, false));
    td_tensor *in[2] = {b.x, b.s}, *out[2] = {NULL, NULL};
    td_checkpoint_opts o = {.name = "params", .reads_params = rp};
    TD_ASSERT_OK(td_checkpoint(fn_block, &b.c, in, 2, out, 2, &o));
    /* without reads_params the function ran once, directly, recording its graph as usual */
    assert_true(td_tensor_requires_grad(out[0]));
    assert_int_equal(b.c.forward_runs, rp);
    assert_int_equal(strcmp(td_node_name(td_tensor_grad_fn(out[0])), "CheckpointBackward") == 0,
                     rp);
    {
      td_tensor *la = run_loss(&a, false, 2), *sb = NULL, *yy = NULL, *l1 = NULL, *l2 = NULL;
      TD_ASSERT_OK(td_tensor_mul(out[0], out[0], &yy));
      TD_ASSERT_OK(td_tensor_sum_all(yy, &l1));
      TD_ASSERT_OK(td_tensor_mul_scalar(out[1], 3.0, &l2));
      TD_ASSERT_OK(td_tensor_add(l1, l2, &sb));
      TD_ASSERT_OK(td_tensor_backward(la));
      TD_ASSERT_OK(td_tensor_backward(sb));
      assert_grad_bits("w (no input requires grad)", a.w, b.w);
      td_tensor *all[] = {la, sb, yy, l1, l2};
      for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
    }
    td_tensor_unref(out[0]), td_tensor_unref(out[1]);
    model_free(&a), model_free(&b);
  }
}

/* ---- phases, retain_graph, memory ---- */

static void test_checkpoint_phase_and_retain(void **state) {
  (void)state;
  assert_int_equal(td_checkpoint_current(NULL), TD_CHECKPOINT_PHASE_NONE);
  assert_false(td_checkpoint_is_recomputing());
  model b;
  model_make(&b, F64, false);
  td_tensor *lb = run_loss(&b, true, 2);
  assert_false(b.c.recomputing_seen);
  td_backward_opts keep = {.retain_graph = true};
  TD_ASSERT_OK(td_autograd_backward(&lb, NULL, 1, &keep));
  assert_true(b.c.recomputing_seen);
  td_tensor *g1 = td_tensor_grad(b.w), *g1c = NULL;
  TD_ASSERT_OK(td_tensor_clone(g1, &g1c));
  TD_ASSERT_OK(td_tensor_backward(lb)); /* recomputes again: the gradients add up */
  assert_int_equal(b.c.recompute_runs, 2);
  td_tensor *g2 = td_tensor_grad(b.w), *twice = NULL;
  TD_ASSERT_OK(td_tensor_mul_scalar(g1c, 2.0, &twice));
  td_test_assert_close("w after two backwards", g2, twice, 1e-14, 0);
  TD_ASSERT_STATUS(td_tensor_backward(lb), TD_ERR_STATE); /* freed now */
  assert_non_null(strstr(td_last_error(), "second time"));
  assert_int_equal(td_checkpoint_current(NULL), TD_CHECKPOINT_PHASE_NONE);
  td_tensor *all[] = {lb, g1, g1c, g2, twice};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  model_free(&b);
}

/* A chain of 4 checkpointed blocks keeps their inputs only: the tensor memory a forward leaves
 * behind is less than half of the plain chain's (each block holds ~8 [B, D] intermediates). */
static size_t chain_kept(bool ckpt) {
  int64_t sx[2] = {64, 64}, sw[2] = {64, 64};
  block_ctx c = {0};
  c.w = leaf(sw, 2, F64, 3);
  td_tensor *x = leaf(sx, 2, F64, 1), *s = leaf(sx, 2, F64, 2), *h = td_tensor_ref(x);
  size_t before = 0, after = 0;
  td_cpu_memory_info(&before, NULL, NULL);
  td_tensor *outs[4] = {NULL};
  for (int i = 0; i < 4; i++) {
    td_tensor *in[2] = {h, s};
    if (ckpt) TD_ASSERT_OK(td_checkpoint(fn_block, &c, in, 2, &outs[i], 1, NULL));
    else TD_ASSERT_OK(fn_block(&c, in, 2, &outs[i], 1));
    td_tensor_unref(h);
    h = td_tensor_ref(outs[i]);
  }
  td_cpu_memory_info(&after, NULL, NULL);
  td_tensor *sum = NULL;
  TD_ASSERT_OK(td_tensor_sum_all(h, &sum));
  TD_ASSERT_OK(td_tensor_backward(sum));
  for (int i = 0; i < 4; i++) td_tensor_unref(outs[i]);
  td_tensor *all[] = {sum, h, x, s, c.w};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return after - before;
}

static void test_checkpoint_keeps_inputs_only(void **state) {
  (void)state;
  size_t plain = chain_kept(false), ckpt = chain_kept(true);
  size_t one = 64 * 64 * sizeof(double);
  print_message("kept after forward: plain %zu bytes, checkpointed %zu (one [64, 64]: %zu)\n",
                plain, ckpt, one);
  assert_true(ckpt <= 5 * one); /* the 4 block outputs (each the next one's saved input) */
  assert_true(plain >= 15 * one); /* xw, gelu(xw), tanh(x) and the output per block */
}

/* ---- finite differences ---- */

static td_status gc_fn(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  td_tensor *o[2] = {NULL, NULL};
  td_checkpoint_opts opt = {.name = "gradcheck"};
  block_ctx *c = ctx;
  c->w = in[2];
  (void)n;
  td_status st = td_checkpoint(fn_block, c, in, 2, o, 2, &opt);
  if (st == TD_OK) st = td_tensor_mul(o[0], o[1], out);
  td_tensor_unref(o[0]), td_tensor_unref(o[1]);
  return st;
}

static void test_checkpoint_gradcheck(void **state) {
  (void)state;
  int64_t sx[2] = {B, D}, sw[2] = {D, D};
  td_tensor *in[3] = {leaf(sx, 2, F64, 21), leaf(sx, 2, F64, 22), leaf(sw, 2, F64, 23)};
  block_ctx c = {0};
  td_test_gradcheck(gc_fn, &c, in, 3, 1e-6, 1e-7, 1e-6);
  for (int i = 0; i < 3; i++) td_tensor_unref(in[i]);
}

/* ---- errors ---- */

static td_status fn_null_output(void *ctx, td_tensor *const *in, int n, td_tensor **out, int no) {
  (void)ctx, (void)n, (void)no;
  out[0] = td_tensor_ref(in[0]);
  return TD_OK; /* out[1] left NULL */
}

static td_status fn_fails(void *ctx, td_tensor *const *in, int n, td_tensor **out, int no) {
  (void)ctx, (void)in, (void)n, (void)out, (void)no;
  return td_set_error(TD_ERR_SHAPE, "the function's own failure");
}

/* Makes [B, D] the first time and [B, D + 1] after: not recomputable. */
static td_status fn_unstable(void *ctx, td_tensor *const *in, int n, td_tensor **out, int no) {
  (void)n, (void)no;
  int *runs = ctx;
  int64_t s[2] = {B, D + ((*runs)++ ? 1 : 0)};
  td_tensor *z = NULL;
  td_status st = td_tensor_zeros(s, 2, F64, td_device_cpu(), &z);
  if (st == TD_OK && *runs == 1) st = td_tensor_mul(in[0], z, &out[0]);
  else if (st == TD_OK) st = td_tensor_add_scalar(z, 1.0, &out[0]);
  td_tensor_unref(z);
  return st;
}

static int releases;
static void count_release(void *ctx) {
  (void)ctx;
  releases++;
}

static void test_checkpoint_errors(void **state) {
  (void)state;
  int64_t sx[2] = {B, D};
  td_tensor *x = leaf(sx, 2, F64, 1), *in[1] = {x}, *out[2] = {NULL, NULL};
  td_checkpoint_opts o = {.name = "bad", .release = count_release};
  releases = 0;
  TD_ASSERT_STATUS(td_checkpoint(NULL, NULL, in, 1, out, 1, &o), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "checkpoint 'bad'"));
  TD_ASSERT_STATUS(td_checkpoint(fn_fails, NULL, in, 1, out, 0, &o), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_checkpoint(fn_fails, NULL, in, 1, NULL, 1, &o), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_checkpoint(fn_fails, NULL, NULL, 1, out, 1, &o), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "NULL array"));
  assert_int_equal(releases, 4); /* ctx released on every failure */
  TD_ASSERT_STATUS(td_checkpoint(fn_null_output, NULL, in, 1, out, 2, &o), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "without output 1"));
  assert_null(out[0]); /* outputs untouched on failure */
  TD_ASSERT_STATUS(td_checkpoint(fn_fails, NULL, in, 1, out, 1, &o), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "checkpoint 'bad'"));
  assert_non_null(strstr(td_last_error(), "the function's own failure"));
  assert_int_equal(releases, 6);
  assert_int_equal(td_checkpoint_current(NULL), TD_CHECKPOINT_PHASE_NONE); /* popped */
  /* a recompute that makes another shape fails the backward, naming the region */
  int runs = 0;
  td_checkpoint_opts ou = {.name = "unstable"};
  TD_ASSERT_OK(td_checkpoint(fn_unstable, &runs, in, 1, out, 1, &ou));
  td_tensor *s = NULL;
  TD_ASSERT_OK(td_tensor_sum_all(out[0], &s));
  TD_ASSERT_STATUS(td_tensor_backward(s), TD_ERR_STATE);
  assert_non_null(strstr(td_last_error(), "checkpoint 'unstable'"));
  assert_non_null(strstr(td_last_error(), "same thing both times"));
  td_tensor_unref(s), td_tensor_unref(out[0]);
  out[0] = NULL;
  /* the release callback runs once when the node dies */
  releases = 0;
  TD_ASSERT_OK(td_checkpoint(fn_null_output, NULL, in, 1, out, 1, &o));
  assert_int_equal(releases, 0);
  td_tensor_unref(out[0]);
  assert_int_equal(releases, 1);
  td_tensor_unref(x);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_checkpoint_matches_plain_bitwise),
      cmocka_unit_test(test_checkpoint_unused_output_and_input),
      cmocka_unit_test(test_checkpoint_unused_output_not_backpropagated),
      cmocka_unit_test(test_checkpoint_dropout_replay_exact),
      cmocka_unit_test(test_checkpoint_nested),
      cmocka_unit_test(test_checkpoint_inherits_grad_map),
      cmocka_unit_test(test_checkpoint_reads_params),
      cmocka_unit_test(test_checkpoint_phase_and_retain),
      cmocka_unit_test(test_checkpoint_keeps_inputs_only),
      cmocka_unit_test(test_checkpoint_gradcheck),
      cmocka_unit_test(test_checkpoint_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
