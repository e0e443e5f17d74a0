/* test_tensor_parallel.c - tensor parallelism (parallel/) against one process, with real worker
 * processes on 127.0.0.1 at tensor-parallel sizes 2 and 4 (float64):
 *   - each differentiable collective's forward value and the gradient its backward gives;
 *   - column- and row-parallel linears equal the whole Linear (output and gradients);
 *   - the vocabulary-parallel cross entropy equals td_tensor_cross_entropy on the whole logits,
 *     with ignored targets and a vocabulary padded to the group size (at size 4, vocabulary 5: one
 *     member holds only padding);
 *   - the split GPT gives the single-process logits, loss and every parameter's gradient, and
 *     after 10 AdamW steps with weight-decay groups and clipping by the whole norm, the same
 *     parameters (to 1e-9; the issue asks 1e-6), without and with sequence parallelism;
 *   - refusals: heads not divisible by the group size, a target outside the vocabulary;
 *   - at size 2, the split GPT with activation checkpointing (every block, or every attention
 *     core; with and without sequence parallelism; float64 and float32: the recompute runs the
 *     forward's collectives again in backward) gives the loss, every member's gradients and,
 *     after AdamW steps, the parameters of the split GPT without it, bit for bit.
 * Every member computes the whole model as well, so each compares its own results.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../collectives/coll_test_util.h"
#include "tdist/parallel.h"
#include "test_util.h"

#define TOL 1e-9

/* value returns a deterministic pseudo-random number in [-1, 1) for (seed, i). */
static double value(uint64_t seed, int64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull + 1;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return (double)(x >> 11) / (double)(1ull << 52) - 1.0;
}

static td_tensor *filled(const int64_t *shape, int nd, uint64_t seed, bool grad) {
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_empty(shape, nd, TD_DTYPE_F64, td_device_cpu(), &t));
  double *p = td_tensor_data(t);
  for (int64_t i = 0; i < td_tensor_numel(t); i++) p[i] = value(seed, i);
  if (grad) MP_CHECK_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

/* max_diff returns the largest |a - b| (shapes must match; NAN when they do not). */
static double max_diff(const td_tensor *a, const td_tensor *b) {
  if (!a || !b || !td_tensor_same_shape(a, b)) return NAN;
  td_tensor *ca = NULL, *cb = NULL, *da = NULL, *db = NULL;
  MP_CHECK_OK(td_tensor_to_dtype(a, TD_DTYPE_F64, &da));
  MP_CHECK_OK(td_tensor_to_dtype(b, TD_DTYPE_F64, &db));
  MP_CHECK_OK(td_tensor_contiguous(da, &ca));
  MP_CHECK_OK(td_tensor_contiguous(db, &cb));
  double m = 0;
  const double *pa = td_tensor_data(ca), *pb = td_tensor_data(cb);
  for (int64_t i = 0; i < td_tensor_numel(ca); i++) {
    double d = fabs(pa[i] - pb[i]);
    if (!(d <= m)) m = d;
  }
  td_tensor_unref(ca);
  td_tensor_unref(cb);
  td_tensor_unref(da);
  td_tensor_unref(db);
  return m;
}

#define CHECK_CLOSE(what, a, b)                                                            \
  do {                                                                                     \
    double d_ = max_diff((a), (b));                                                        \
    if (!(d_ <= TOL)) {                                                                    \
      fprintf(stderr, "[pid %d] %s: max |difference| %.3g > %.1g\n", (int)getpid(), (what), \
              d_, TOL);                                                                    \
      MP_CHECK(0);                                                                         \
    }                                                                                      \
  } while (0)

/* weighted_sum returns sum(y * w) with w filled from seed (a loss whose gradient is w). */
static td_tensor *weighted_sum(const td_tensor *y, uint64_t seed) {
  td_tensor *w = filled(td_tensor_shape(y), td_tensor_ndim(y), seed, false), *yw = NULL, *s = NULL;
  MP_CHECK_OK(td_tensor_mul(y, w, &yw));
  MP_CHECK_OK(td_tensor_sum_all(yw, &s));
  td_tensor_unref(w);
  td_tensor_unref(yw);
  return s;
}

static td_tensor *grad_of(const td_tensor *t) {
  td_tensor *g = td_tensor_grad(t);
  MP_CHECK(g != NULL);
  return g;
}

/* ---- the mappings ---- */

/* check_mappings: member r's input is filled with seed 100 + r, its loss weights with 200 + r;
 * the expected values come from every member's data, which each member can compute. */
static void check_mappings(td_process_group *pg) {
  int p = td_process_group_size(pg), r = td_process_group_rank(pg);
  int64_t s2[2] = {4, 2 * p};
  td_tensor *x = filled(s2, 2, 100 + r, true), *y = NULL, *want = NULL, *g = NULL;
  td_tensor *loss = NULL;

  /* f: identity forward; the gradient is the sum of every member's upstream gradient */
  MP_CHECK_OK(td_tp_copy_to_region(pg, x, &y));
  CHECK_CLOSE("copy_to_region forward", y, x);
  loss = weighted_sum(y, 200 + r);
  MP_CHECK_OK(td_tensor_backward(loss));
  MP_CHECK_OK(td_tensor_zeros(s2, 2, TD_DTYPE_F64, td_device_cpu(), &want));
  for (int i = 0; i < p; i++) {
    td_tensor *w = filled(s2, 2, 200 + i, false);
    MP_CHECK_OK(td_tensor_add_(want, w, 1.0));
    td_tensor_unref(w);
  }
  g = grad_of(x);
  CHECK_CLOSE("copy_to_region backward", g, want);
  td_tensor_unref(g);
  td_tensor_unref(y);
  td_tensor_unref(loss);
  MP_CHECK_OK(td_tensor_set_grad(x, NULL));

  /* g: the sum of every member's input forward (that is `want`'s construction with seeds 100+i),
   * the upstream gradient unchanged backward */
  td_tensor_unref(want);
  MP_CHECK_OK(td_tensor_zeros(s2, 2, TD_DTYPE_F64, td_device_cpu(), &want));
  for (int i = 0; i < p; i++) {
    td_tensor *w = filled(s2, 2, 100 + i, false);
    MP_CHECK_OK(td_tensor_add_(want, w, 1.0));
    td_tensor_unref(w);
  }
  MP_CHECK_OK(td_tp_reduce_from_region(pg, x, &y));
  CHECK_CLOSE("reduce_from_region forward", y, want);
  loss = weighted_sum(y, 300 + r);
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor *w300 = filled(s2, 2, 300 + r, false);
  g = grad_of(x);
  CHECK_CLOSE("reduce_from_region backward", g, w300);
  td_tensor_unref(g);
  td_tensor_unref(y);
  td_tensor_unref(loss);
  MP_CHECK_OK(td_tensor_set_grad(x, NULL));

  /* scatter along the last dim, then gather back: the round trip is x; the gradient through both
   * is the member's own upstream weights (the gather's backward keeps the member's slice, the
   * scatter's backward all-gathers the slices) */
  td_tensor *part = NULL, *back = NULL, *own = NULL;
  MP_CHECK_OK(td_tp_scatter_to_region(pg, x, &part));
  MP_CHECK_OK(td_tensor_narrow(x, 1, 2 * r, 2, &own));
  CHECK_CLOSE("scatter_to_region forward", part, own);
  MP_CHECK_OK(td_tp_gather_from_region(pg, part, &back));
  /* column block i of the gathered tensor is member i's slice of its own input */
  td_tensor *xcols[16] = {NULL}, *xjoined = NULL;
  for (int i = 0; i < p; i++) {
    td_tensor *xi = filled(s2, 2, 100 + i, false);
    MP_CHECK_OK(td_tensor_narrow(xi, 1, 2 * i, 2, &xcols[i]));
    td_tensor_unref(xi);
  }
  MP_CHECK_OK(td_tensor_cat(xcols, p, 1, &xjoined));
  CHECK_CLOSE("gather_from_region forward", back, xjoined);
  for (int i = 0; i < p; i++) td_tensor_unref(xcols[i]);
  td_tensor_unref(xjoined);
  loss = weighted_sum(back, 300 + r);
  MP_CHECK_OK(td_tensor_backward(loss));
  g = grad_of(x);
  /* gather's backward gives member r columns [2r, 2r+2) of its own weights; scatter's backward
   * joins every member's piece: column block i comes from member i's weights 300+i */
  td_tensor *cols[16] = {NULL}, *joined = NULL;
  for (int i = 0; i < p; i++) {
    td_tensor *wi = filled(s2, 2, 300 + i, false);
    MP_CHECK_OK(td_tensor_narrow(wi, 1, 2 * i, 2, &cols[i]));
    td_tensor_unref(wi);
  }
  MP_CHECK_OK(td_tensor_cat(cols, p, 1, &joined));
  CHECK_CLOSE("gather/scatter backward", g, joined);
  for (int i = 0; i < p; i++) td_tensor_unref(cols[i]);
  td_tensor_unref(joined);
  td_tensor_unref(g);
  td_tensor_unref(part);
  td_tensor_unref(back);
  td_tensor_unref(own);
  td_tensor_unref(loss);
  MP_CHECK_OK(td_tensor_set_grad(x, NULL));

  /* sequence parallel along dim 1 of a [3, 2p, 2] tensor: reduce-scatter then all-gather gives
   * the sum over the members; backward: all-gather's backward reduce-scatters the upstream
   * weights, then reduce-scatter's backward all-gathers -> the sum of every member's weights */
  int64_t s3[3] = {3, 2 * p, 2};
  td_tensor *z = filled(s3, 3, 400 + r, true), *zs = NULL, *zg = NULL, *zsum = NULL, *gsum = NULL;
  MP_CHECK_OK(td_tensor_zeros(s3, 3, TD_DTYPE_F64, td_device_cpu(), &zsum));
  MP_CHECK_OK(td_tensor_zeros(s3, 3, TD_DTYPE_F64, td_device_cpu(), &gsum));
  for (int i = 0; i < p; i++) {
    td_tensor *a = filled(s3, 3, 400 + i, false), *b = filled(s3, 3, 500 + i, false);
    MP_CHECK_OK(td_tensor_add_(zsum, a, 1.0));
    MP_CHECK_OK(td_tensor_add_(gsum, b, 1.0));
    td_tensor_unref(a);
    td_tensor_unref(b);
  }
  MP_CHECK_OK(td_tp_reduce_scatter_to_sequence(pg, z, 1, &zs));
  MP_CHECK(td_tensor_size(zs, 1) == 2 && td_tensor_size(zs, 0) == 3);
  td_tensor *zown = NULL;
  MP_CHECK_OK(td_tensor_narrow(zsum, 1, 2 * r, 2, &zown));
  CHECK_CLOSE("reduce_scatter_to_sequence forward", zs, zown);
  MP_CHECK_OK(td_tp_gather_from_sequence(pg, zs, 1, &zg));
  CHECK_CLOSE("gather_from_sequence forward", zg, zsum);
  loss = weighted_sum(zg, 500 + r);
  MP_CHECK_OK(td_tensor_backward(loss));
  g = grad_of(z);
  CHECK_CLOSE("sequence pair backward", g, gsum);
  td_tensor *pieces[] = {z, zs, zg, zsum, gsum, zown, g, loss, x, want, w300};
  for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) td_tensor_unref(pieces[i]);
}

/* ---- the layers ---- */

static td_module *linear64(int64_t in, int64_t out, uint64_t seed) {
  td_generator *g = NULL;
  td_module *m = NULL;
  MP_CHECK_OK(td_generator_create(seed, &g));
  MP_CHECK_OK(td_linear_create(in, out, true, g, &m));
  MP_CHECK_OK(td_module_to_dtype(m, TD_DTYPE_F64));
  td_generator_destroy(g);
  return m;
}

/* check_layers: column (gathered) -> row (whole input) equals Linear -> Linear, forward and the
 * gradients of the input and of every weight (joined). */
static void check_layers(td_process_group *pg) {
  int p = td_process_group_size(pg);
  td_module *a = linear64(6, 4 * p, 11), *b = linear64(4 * p, 5, 12), *ta = NULL, *tb = NULL;
  MP_CHECK_OK(td_tp_column_linear_from(pg, a, true, &ta));
  MP_CHECK_OK(td_tp_row_linear_from(pg, b, false, &tb));
  int64_t sx[2] = {3, 6};
  td_tensor *x = filled(sx, 2, 21, true), *xt = filled(sx, 2, 21, true);
  td_tensor *h = NULL, *y = NULL, *ht = NULL, *yt = NULL;
  MP_CHECK_OK(td_module_forward(a, x, &h));
  MP_CHECK_OK(td_module_forward(b, h, &y));
  MP_CHECK_OK(td_module_forward(ta, xt, &ht));
  CHECK_CLOSE("ColumnParallelLinear (gathered) forward", ht, h);
  MP_CHECK_OK(td_module_forward(tb, ht, &yt));
  CHECK_CLOSE("RowParallelLinear forward", yt, y);
  td_tensor *l = weighted_sum(y, 31), *lt = weighted_sum(yt, 31);
  MP_CHECK_OK(td_tensor_backward(l));
  MP_CHECK_OK(td_tensor_backward(lt));
  td_tensor *gx = grad_of(x), *gxt = grad_of(xt);
  CHECK_CLOSE("column/row input gradient", gxt, gx);
  td_module *pairs[2][2] = {{a, ta}, {b, tb}};
  for (int k = 0; k < 2; k++) {
    td_tensor_list full;
    td_tensor_list_init(&full);
    MP_CHECK_OK(td_tp_grads_full(pg, pairs[k][1], &full));
    MP_CHECK(full.n == 2);
    for (size_t i = 0; i < full.n; i++) {
      td_tensor *want = grad_of(td_module_param(pairs[k][0], full.names[i]));
      CHECK_CLOSE(full.names[i], full.tensors[i], want);
      td_tensor_unref(want);
    }
    td_tensor_list_fini(&full);
  }
  td_tp_split sp;
  MP_CHECK_OK(td_tp_param_split(tb, td_module_param(tb, "bias"), &sp));
  MP_CHECK(sp.dim == -1);
  MP_CHECK_OK(td_tp_param_split(tb, td_module_param(tb, "weight"), &sp));
  MP_CHECK(sp.dim == 1 && sp.full == 4 * p);
  MP_CHECK(td_tp_param_split(tb, x, &sp) == TD_ERR_NOT_FOUND);
  td_tensor *all[] = {x, xt, h, y, ht, yt, l, lt, gx, gxt};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  td_module *mods[] = {a, b, ta, tb};
  for (size_t i = 0; i < 4; i++) td_module_unref(mods[i]);
}

/* check_cross_entropy: vocabulary 5 over p members (padded to a multiple of p), 6 rows, two of
 * them ignored (-1); the member's logits are its columns of the whole [6, Vp] logits. */
static void check_cross_entropy(td_process_group *pg) {
  int p = td_process_group_size(pg), r = td_process_group_rank(pg);
  int64_t V = 5, Vp = (V + p - 1) / p * p, Vl = Vp / p, N = 6;
  int64_t sw[2] = {N, V}, tshape[1] = {N};
  int64_t tv[6] = {0, 4, -1, 2, 3, -1};
  td_tensor *whole = filled(sw, 2, 41, true), *tg = NULL, *ref = NULL, *mine = NULL, *part = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(tv, tshape, 1, TD_DTYPE_I64, &tg));
  MP_CHECK_OK(td_tensor_cross_entropy(whole, tg, TD_REDUCTION_MEAN, -1, &ref));
  MP_CHECK_OK(td_tensor_backward(ref));
  /* this member's columns: [r Vl, r Vl + Vl) of the whole logits padded with garbage (large
   * values: if padding entered the softmax, the loss would change a lot) */
  int64_t sl[2] = {N, Vl};
  MP_CHECK_OK(td_tensor_full(sl, 2, 50.0, TD_DTYPE_F64, td_device_cpu(), &part));
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < Vl; j++)
      if (r * Vl + j < V)
        ((double *)td_tensor_data(part))[n * Vl + j] = value(41, n * V + r * Vl + j);
  MP_CHECK_OK(td_tensor_set_requires_grad(part, true));
  MP_CHECK_OK(td_tp_vocab_parallel_cross_entropy(pg, part, tg, V, -1, &mine));
  CHECK_CLOSE("vocab-parallel cross entropy", mine, ref);
  MP_CHECK_OK(td_tensor_backward(mine));
  td_tensor *gw = grad_of(whole), *gp = grad_of(part);
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < Vl; j++) {
      double got = ((const double *)td_tensor_data(gp))[n * Vl + j];
      double want = r * Vl + j < V ? ((const double *)td_tensor_data(gw))[n * V + r * Vl + j] : 0;
      if (!(fabs(got - want) <= TOL)) {
        fprintf(stderr, "cross entropy gradient [%lld, %lld]: %.17g, expected %.17g\n",
                (long long)n, (long long)(r * Vl + j), got, want);
        MP_CHECK(0);
      }
    }
  /* a target outside the vocabulary (5 is a padding column at p > 1) is refused on every member
   * before any collective */
  td_tensor *bad = NULL, *out = NULL;
  int64_t bv[6] = {0, 5, 1, 1, 1, 1};
  MP_CHECK_OK(td_tensor_from_buffer(bv, tshape, 1, TD_DTYPE_I64, &bad));
  MP_CHECK(td_tp_vocab_parallel_cross_entropy(pg, part, bad, V, -1, &out) == TD_ERR_INVALID);
  MP_CHECK(strstr(td_last_error(), "target 5") != NULL);
  td_tensor *all[] = {whole, tg, ref, mine, part, gw, gp, bad};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
}

/* ---- the GPT ---- */

static td_gpt_config small_config(void) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = 13; /* not divisible by 2 or 4: padding */
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  return c;
}

static void batch(int step, td_tensor **idx, td_tensor **tgt) {
  int64_t s[2] = {3, 8}, v[24], t[24];
  for (int i = 0; i < 24; i++) {
    v[i] = (int64_t)((value(1000 + (uint64_t)step, i) + 1.0) * 6.5) % 13;
    t[i] = i % 7 == 3 ? -1 : (int64_t)((value(2000 + (uint64_t)step, i) + 1.0) * 6.5) % 13;
  }
  MP_CHECK_OK(td_tensor_from_buffer(v, s, 2, TD_DTYPE_I64, idx));
  MP_CHECK_OK(td_tensor_from_buffer(t, s, 2, TD_DTYPE_I64, tgt));
}

/* adamw makes AdamW over m's parameters: decay for the matrices, none for the rest. */
static td_optim *adamw(td_module *m) {
  td_tensor_list l;
  td_tensor_list_init(&l);
  MP_CHECK_OK(td_module_parameters(m, &l));
  td_tensor **dec = calloc(l.n, sizeof *dec), **nodec = calloc(l.n, sizeof *nodec);
  size_t nd = 0, nn = 0;
  for (size_t i = 0; i < l.n; i++) {
    if (td_tensor_ndim(l.tensors[i]) >= 2) dec[nd++] = l.tensors[i];
    else nodec[nn++] = l.tensors[i];
  }
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_ADAMW);
  o.lr = 1e-2;
  td_optim_group g[2];
  td_optim_group_init(&g[0], dec, nd);
  td_optim_group_init(&g[1], nodec, nn);
  g[0].weight_decay = 0.1;
  g[1].weight_decay = 0.0;
  td_optim *opt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&o, g, 2, &opt));
  free(dec);
  free(nodec);
  td_tensor_list_fini(&l);
  return opt;
}

/* check_same_tensors compares a gathered list with the whole model's tensors (by name). */
static void check_same_tensors(const char *what, const td_tensor_list *got, td_module *whole,
                               bool grads) {
  td_tensor_list want;
  td_tensor_list_init(&want);
  MP_CHECK_OK(grads ? td_module_named_parameters(whole, &want) : td_module_state_dict(whole, &want));
  MP_CHECK(got->n == want.n);
  for (size_t i = 0; i < want.n; i++) {
    td_tensor *t = td_tensor_list_find(got, want.names[i]);
    if (!t) {
      fprintf(stderr, "%s: no \"%s\" in the split model\n", what, want.names[i]);
      MP_CHECK(0);
    }
    td_tensor *w = grads ? grad_of(want.tensors[i]) : td_tensor_ref(want.tensors[i]);
    double d = max_diff(t, w);
    if (!(d <= TOL)) {
      fprintf(stderr, "[pid %d] %s \"%s\": max |difference| %.3g\n", (int)getpid(), what,
              want.names[i], d);
      MP_CHECK(0);
    }
    td_tensor_unref(w);
  }
  td_tensor_list_fini(&want);
}

static void check_gpt(td_process_group *pg, bool sp) {
  int p = td_process_group_size(pg);
  td_gpt_config c = small_config();
  td_generator *g = NULL;
  td_module *whole = NULL, *tp = NULL;
  MP_CHECK_OK(td_generator_create(5, &g));
  MP_CHECK_OK(td_gpt_create(&c, g, &whole));
  td_generator_destroy(g);
  MP_CHECK_OK(td_module_to_dtype(whole, TD_DTYPE_F64));
  td_tp_gpt_options go;
  td_tp_gpt_options_init(&go);
  go.sequence_parallel = sp;
  MP_CHECK_OK(td_tp_gpt_from_ex(pg, whole, &go, &tp));
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  MP_CHECK_OK(td_tp_state_dict_full(pg, tp, &sd));
  check_same_tensors("state dict round trip", &sd, whole, false);
  td_tensor_list_fini(&sd);
  /* the vocabulary table is padded: 13 rows -> ceil(13/p) per member */
  td_tensor *wte = NULL;
  MP_CHECK_OK(td_module_get_parameter(tp, "transformer.wte.weight", &wte));
  MP_CHECK(td_tensor_size(wte, 0) == (13 + p - 1) / p);
  td_tensor_unref(wte);
  { /* with sequence parallelism the residual stream holds T/p positions per member */
    td_tensor *idx = NULL, *tgt = NULL, *e = NULL;
    batch(0, &idx, &tgt);
    td_module *emb = td_module_child(td_module_child(tp, "transformer"), "wte");
    MP_CHECK_OK(td_module_forward(emb, idx, &e));
    MP_CHECK(td_tensor_size(e, 1) == (sp ? 8 / p : 8));
    td_tensor_unref(idx);
    td_tensor_unref(tgt);
    td_tensor_unref(e);
  }

  td_optim *ow = adamw(whole), *ot = adamw(tp);
  for (int step = 0; step < 10; step++) {
    td_tensor *idx = NULL, *tgt = NULL, *lw = NULL, *lossw = NULL, *lt = NULL, *losst = NULL;
    batch(step, &idx, &tgt);
    td_optim_zero_grad(ow);
    td_optim_zero_grad(ot);
    MP_CHECK_OK(td_gpt_forward(whole, idx, tgt, &lw, &lossw));
    MP_CHECK_OK(td_tp_gpt_forward(tp, idx, tgt, true, &lt, &losst));
    CHECK_CLOSE("logits", lt, lw);
    CHECK_CLOSE("loss", losst, lossw);
    MP_CHECK_OK(td_tensor_backward(lossw));
    MP_CHECK_OK(td_tensor_backward(losst));
    if (sp) MP_CHECK_OK(td_tp_sync_sequence_parallel_grads(pg, tp));
    if (step == 0 || step == 9) {
      td_tensor_list gl;
      td_tensor_list_init(&gl);
      MP_CHECK_OK(td_tp_grads_full(pg, tp, &gl));
      check_same_tensors("gradient", &gl, whole, true);
      td_tensor_list_fini(&gl);
    }
    double nw = 0, nt = 0;
    MP_CHECK_OK(td_optim_clip_grad_norm(ow, 0.5, 2.0, &nw));
    MP_CHECK_OK(td_tp_clip_grad_norm(pg, tp, 0.5, &nt));
    MP_CHECK(nw > 0.5); /* the clipping is exercised */
    if (!(fabs(nw - nt) <= TOL * nw)) {
      fprintf(stderr, "step %d: gradient norm %.17g, split model %.17g\n", step, nw, nt);
      MP_CHECK(0);
    }
    MP_CHECK_OK(td_optim_step(ow));
    MP_CHECK_OK(td_optim_step(ot));
    td_tensor *all[] = {idx, tgt, lw, lossw, lt, losst};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  }
  td_tensor_list_init(&sd);
  MP_CHECK_OK(td_tp_state_dict_full(pg, tp, &sd));
  check_same_tensors("parameters after 10 AdamW steps", &sd, whole, false);
  /* the weights moved: this is not the initial state */
  td_module *fresh = NULL;
  td_generator *g2 = NULL;
  MP_CHECK_OK(td_generator_create(5, &g2));
  MP_CHECK_OK(td_gpt_create(&c, g2, &fresh));
  td_tensor *w0 = td_tensor_list_find(&sd, "lm_head.weight"), *f0 = NULL;
  MP_CHECK_OK(td_module_get_parameter(fresh, "lm_head.weight", &f0));
  MP_CHECK(max_diff(w0, f0) > 1e-3);
  td_tensor_unref(f0);
  td_module_unref(fresh);
  td_generator_destroy(g2);
  td_tensor_list_fini(&sd);

  /* heads that do not divide: refused with both numbers */
  if (p == 4) {
    td_gpt_config bad = c;
    bad.n_head = 2;
    td_module *wb = NULL, *tb = NULL;
    MP_CHECK_OK(td_gpt_create(&bad, NULL, &wb));
    MP_CHECK(td_tp_gpt_from(pg, wb, &tb) == TD_ERR_INVALID && tb == NULL);
    MP_CHECK(strstr(td_last_error(), "n_head 2") && strstr(td_last_error(), "size 4"));
    td_module_unref(wb);
  }
  td_optim_destroy(ow);
  td_optim_destroy(ot);
  td_module_unref(whole);
  td_module_unref(tp);
}

/* ---- activation checkpointing ---- */

/* Every parameter's gradient (grads) or value of the member's slices of a and b, bit for bit. */
static void check_bits(const char *what, td_module *a, td_module *b, bool grads) {
  td_tensor_list pa, pb;
  td_tensor_list_init(&pa);
  td_tensor_list_init(&pb);
  MP_CHECK_OK(td_module_named_parameters(a, &pa));
  MP_CHECK_OK(td_module_named_parameters(b, &pb));
  MP_CHECK(pa.n == pb.n);
  for (size_t i = 0; i < pa.n; i++) {
    td_tensor *x = grads ? td_tensor_grad(pa.tensors[i]) : td_tensor_ref(pa.tensors[i]);
    td_tensor *y = grads ? td_tensor_grad(pb.tensors[i]) : td_tensor_ref(pb.tensors[i]);
    if (!td_test_same_bits(x, y)) {
      fprintf(stderr, "[pid %d] %s: %s of %s differs\n", (int)getpid(), what,
              grads ? "gradient" : "value", pa.names[i]);
      MP_CHECK(0);
    }
    td_tensor_unref(x), td_tensor_unref(y);
  }
  td_tensor_list_fini(&pa);
  td_tensor_list_fini(&pb);
}

static void check_gpt_checkpoint(td_process_group *pg, td_dtype dt, td_checkpoint_mode mode,
                                 bool sp) {
  td_gpt_config c = small_config();
  td_generator *g = NULL;
  td_module *whole = NULL, *plain = NULL, *ck = NULL;
  MP_CHECK_OK(td_generator_create(5, &g));
  MP_CHECK_OK(td_gpt_create(&c, g, &whole));
  td_generator_destroy(g);
  if (dt != TD_DTYPE_F32) MP_CHECK_OK(td_module_to_dtype(whole, dt));
  td_tp_gpt_options go;
  td_tp_gpt_options_init(&go);
  go.sequence_parallel = sp;
  MP_CHECK_OK(td_tp_gpt_from_ex(pg, whole, &go, &plain));
  MP_CHECK_OK(td_tp_gpt_from_ex(pg, whole, &go, &ck));
  MP_CHECK_OK(td_gpt_set_activation_checkpointing(ck, mode));
  char what[96];
  snprintf(what, sizeof what, "%s, %s%s", td_dtype_name(dt),
           mode == TD_CHECKPOINT_FULL ? "every block" : "every attention core",
           sp ? ", sequence parallel" : "");
  td_optim *op = adamw(plain), *oc = adamw(ck);
  for (int step = 0; step < 2; step++) {
    td_tensor *idx = NULL, *tgt = NULL, *lp = NULL, *lossp = NULL, *lc = NULL, *lossc = NULL;
    batch(step, &idx, &tgt);
    td_optim_zero_grad(op);
    td_optim_zero_grad(oc);
    MP_CHECK_OK(td_tp_gpt_forward(plain, idx, tgt, true, &lp, &lossp));
    MP_CHECK_OK(td_tp_gpt_forward(ck, idx, tgt, true, &lc, &lossc));
    MP_CHECK(td_test_same_bits(lossp, lossc));
    MP_CHECK(td_test_count_nodes(lossc, "CheckpointBackward") == c.n_layer);
    MP_CHECK(td_test_count_nodes(lossp, "CheckpointBackward") == 0);
    MP_CHECK_OK(td_tensor_backward(lossp));
    MP_CHECK_OK(td_tensor_backward(lossc));
    if (sp) MP_CHECK_OK(td_tp_sync_sequence_parallel_grads(pg, plain));
    if (sp) MP_CHECK_OK(td_tp_sync_sequence_parallel_grads(pg, ck));
    check_bits(what, plain, ck, true);
    MP_CHECK_OK(td_optim_step(op));
    MP_CHECK_OK(td_optim_step(oc));
    td_tensor *all[] = {idx, tgt, lp, lossp, lc, lossc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  }
  check_bits(what, plain, ck, false);
  td_optim_destroy(op), td_optim_destroy(oc);
  td_module_unref(whole), td_module_unref(plain), td_module_unref(ck);
}

static int worker_checkpoint(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  for (int k = 0; k < 8; k++)
    check_gpt_checkpoint(pg, k & 1 ? TD_DTYPE_F32 : TD_DTYPE_F64,
                         k & 2 ? TD_CHECKPOINT_SELECTIVE : TD_CHECKPOINT_FULL, k & 4);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_tensor_parallel_checkpointed_gpt_matches_plain(void **state) {
  (void)state;
  int codes[2] = {0};
  assert_int_equal(td_mp_run(2, worker_checkpoint, NULL, 120, codes), 0);
}

static int worker(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  check_mappings(pg);
  check_layers(pg);
  check_cross_entropy(pg);
  check_gpt(pg, false);
  check_gpt(pg, true); /* sequence parallel */
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void run(int world) {
  int codes[4] = {0};
  int fails = td_mp_run(world, worker, NULL, 120, codes);
  for (int i = 0; i < world; i++)
    if (codes[i]) fprintf(stderr, "rank %d exited with %d\n", i, codes[i]);
  assert_int_equal(fails, 0);
}

static void test_tensor_parallel_size_2_matches_one_process(void **state) {
  (void)state;
  run(2);
}

static void test_tensor_parallel_size_4_matches_one_process(void **state) {
  (void)state;
  run(4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tensor_parallel_size_2_matches_one_process),
      cmocka_unit_test(test_tensor_parallel_size_4_matches_one_process),
      cmocka_unit_test(test_tensor_parallel_checkpointed_gpt_matches_plain),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
