/* test_cuda_ops.c - every tensor op on cuda:0 against the same op on the CPU.
 *
 * Each case builds its inputs on the CPU, copies them to cuda:0 with td_tensor_to(), runs the
 * same public op on both devices and compares the results (float32 and float64). When inputs
 * require grad it then back-propagates sum(y * W) for a fixed random W on both devices and
 * compares the leaf gradients, so every backward kernel runs too. A case where the CPU fails must
 * fail on CUDA with the same status (out-of-range targets and indices, int64 division by zero).
 *
 * Without a CUDA device (or in a build without CUDA) every test calls skip() with a message, and
 * the program exits with 77, which CMake's SKIP_RETURN_CODE reports as "skipped".
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "test_util.h"

#define F32 TD_DTYPE_F32
#define F64 TD_DTYPE_F64
#define I64 TD_DTYPE_I64

#define REQUIRE_CUDA()                                                                       \
  do {                                                                                       \
    if (td_cuda_device_count() == 0) {                                                       \
      print_message("%s: no CUDA device is present (td_cuda_device_count() == 0); skipped\n", \
                    __func__);                                                               \
      skip();                                                                                \
    }                                                                                        \
  } while (0)

/* ---- input specifications ---- */

typedef enum { IN_NORMAL, IN_UNIFORM, IN_INT, IN_VALUES } in_kind;

typedef struct {
  in_kind kind;
  int ndim;
  int64_t shape[4];
  double lo, hi;        /* IN_UNIFORM: range; IN_INT: integers in [lo, hi) */
  const double *values; /* IN_VALUES */
  bool is_int;          /* IN_VALUES: int64 instead of the case dtype */
  bool grad;            /* float inputs: require grad on both devices */
} in_spec;

#define NORMAL(g, nd, ...) {.kind = IN_NORMAL, .ndim = nd, .shape = {__VA_ARGS__}, .grad = g}
#define UNIFORM(g, a, b, nd, ...) \
  {.kind = IN_UNIFORM, .ndim = nd, .shape = {__VA_ARGS__}, .lo = a, .hi = b, .grad = g}
#define INTS(a, b, nd, ...) {.kind = IN_INT, .ndim = nd, .shape = {__VA_ARGS__}, .lo = a, .hi = b}
#define IVALUES(v, nd, ...) \
  {.kind = IN_VALUES, .ndim = nd, .shape = {__VA_ARGS__}, .values = v, .is_int = true}

static td_tensor *make_input(const in_spec *s, td_dtype dt, uint64_t seed) {
  td_tensor *t = NULL, *u = NULL;
  switch (s->kind) {
    case IN_NORMAL: return td_test_randn(s->shape, s->ndim, dt, seed, false);
    case IN_UNIFORM: return td_test_rand(s->shape, s->ndim, dt, s->lo, s->hi, seed, false);
    case IN_INT:
      /* lo >= 0, so truncation towards zero is floor */
      u = td_test_rand(s->shape, s->ndim, F64, s->lo, s->hi, seed, false);
      TD_ASSERT_OK(td_tensor_to_dtype(u, I64, &t));
      td_tensor_unref(u);
      return t;
    case IN_VALUES: return td_test_tensor(s->values, s->shape, s->ndim, s->is_int ? I64 : dt, false);
  }
  return NULL;
}

/* ---- the ops under test ---- */

typedef enum {
  E_ADD_BCAST, E_SUB_BCAST, E_MUL_T, E_DIV, E_MAXIMUM, E_MAXIMUM_TIES, E_SCALARS, E_POW3, E_POW2,
  E_POWHALF, E_EXP, E_LOG, E_SQRT, E_TANH, E_SIGMOID, E_RELU, E_GELU, E_BIG_ADD, E_PERMUTED_EXP,
  E_EXPAND_MUL,
  M_2D, M_BATCH, M_BCAST, M_DOT, M_VEC, M_TRANS, M_EMPTY_K, M_LARGE,
  R_SUM_KEEP, R_SUM_02, R_SUM_ALL_BIG, R_SUM_COLS_BIG, R_MEAN, R_MEAN_ALL, R_MAX_ROWS, R_MAX_COLS,
  R_MAX_BIG, R_ARGMAX_TIES, R_MAXIDX_COLS_TIES, R_SUM_EMPTY,
  S_SM_LAST, S_SM_MID, S_LSM_LAST, S_LSM_MID, S_SM_WIDE, S_SM_LARGE_LOGITS,
  L_NLL_MEAN, L_NLL_SUM, L_NLL_NONE, L_NLL_1D, L_NLL_BAD, L_CE, L_MSE_MEAN, L_MSE_SUM, L_MSE_NONE,
  C_CONV_BIAS, C_CONV_NOBIAS, C_CONV_BIG, P_POOL, P_POOL_OVERLAP, P_POOL_RECT,
  I_EMBED, I_EMBED_BAD, I_SELECT_MID, I_SELECT_FIRST, I_SELECT_INT,
  N_LN1, N_LN2, N_LN_WIDE, N_LN_ROWS,
  J_CAT0, J_CAT1, J_STACK, J_PERMUTE_CLONE, J_NARROW_CLONE, J_TO_F32, J_TO_I64,
  P_INPLACE, P_COPY_BCAST, P_FILL, P_DROPOUT, P_INT_ARITH, P_INT_DIV0, P_INT_SUM,
} op_id;

static td_status chain2(td_status st, td_tensor *tmp) {
  td_tensor_unref(tmp);
  return st;
}

static td_status run_op(void *ctx, td_tensor *const *in, int n, td_tensor **out) {
  (void)n;
  op_id op = (op_id)(intptr_t)ctx;
  td_tensor *t = NULL, *u = NULL;
  td_status st;
  switch (op) {
    case E_ADD_BCAST: return td_tensor_add(in[0], in[1], out);
    case E_SUB_BCAST: return td_tensor_sub(in[0], in[1], out);
    case E_MUL_T:
      TD_ASSERT_OK(td_tensor_transpose(in[0], 0, 1, &t));
      return chain2(td_tensor_mul(t, in[1], out), t);
    case E_DIV: return td_tensor_div(in[0], in[1], out);
    case E_MAXIMUM: return td_tensor_maximum(in[0], in[1], out);
    case E_MAXIMUM_TIES:
      TD_ASSERT_OK(td_tensor_mul_scalar(in[0], 1.0, &t));
      return chain2(td_tensor_maximum(in[0], t, out), t);
    case E_SCALARS:
      TD_ASSERT_OK(td_tensor_neg(in[0], &t));
      TD_ASSERT_OK(td_tensor_mul_scalar(t, -1.5, &u));
      td_tensor_unref(t);
      return chain2(td_tensor_add_scalar(u, 2.5, out), u);
    case E_POW3: return td_tensor_pow_scalar(in[0], 3.0, out);
    case E_POW2: return td_tensor_pow_scalar(in[0], 2.0, out);
    case E_POWHALF: return td_tensor_pow_scalar(in[0], 0.5, out);
    case E_EXP: return td_tensor_exp(in[0], out);
    case E_LOG: return td_tensor_log(in[0], out);
    case E_SQRT: return td_tensor_sqrt(in[0], out);
    case E_TANH: return td_tensor_tanh(in[0], out);
    case E_SIGMOID: return td_tensor_sigmoid(in[0], out);
    case E_RELU: return td_tensor_relu(in[0], out);
    case E_GELU: return td_tensor_gelu(in[0], out);
    case E_BIG_ADD: return td_tensor_add(in[0], in[1], out);
    case E_PERMUTED_EXP: {
      int p[3] = {2, 0, 1};
      TD_ASSERT_OK(td_tensor_permute(in[0], p, 3, &t));
      return chain2(td_tensor_exp(t, out), t);
    }
    case E_EXPAND_MUL: {
      int64_t s[2] = {3, 4};
      TD_ASSERT_OK(td_tensor_expand(in[0], s, 2, &t));
      return chain2(td_tensor_mul(t, in[1], out), t);
    }
    case M_2D:
    case M_BATCH:
    case M_BCAST:
    case M_DOT:
    case M_VEC:
    case M_EMPTY_K:
    case M_LARGE: return td_tensor_matmul(in[0], in[1], out);
    case M_TRANS:
      TD_ASSERT_OK(td_tensor_transpose(in[0], 0, 1, &t));
      TD_ASSERT_OK(td_tensor_transpose(in[1], 0, 1, &u));
      st = td_tensor_matmul(t, u, out);
      td_tensor_unref(t);
      return chain2(st, u);
    case R_SUM_KEEP: {
      int d[1] = {1};
      return td_tensor_sum(in[0], d, 1, true, out);
    }
    case R_SUM_02: {
      int d[2] = {0, 2};
      return td_tensor_sum(in[0], d, 2, false, out);
    }
    case R_SUM_ALL_BIG: return td_tensor_sum_all(in[0], out);
    case R_SUM_COLS_BIG:
    case R_SUM_EMPTY: {
      int d[1] = {0};
      return td_tensor_sum(in[0], d, 1, false, out);
    }
    case R_MEAN: {
      int d[1] = {1};
      return td_tensor_mean(in[0], d, 1, false, out);
    }
    case R_MEAN_ALL: return td_tensor_mean_all(in[0], out);
    case R_MAX_ROWS:
    case R_MAX_BIG: return td_tensor_max(in[0], 1, false, out, NULL);
    case R_MAX_COLS: return td_tensor_max(in[0], 0, true, out, NULL);
    case R_ARGMAX_TIES:
      TD_ASSERT_OK(td_tensor_to_dtype(in[0], F64, &t));
      return chain2(td_tensor_argmax(t, 1, false, out), t);
    case R_MAXIDX_COLS_TIES:
      TD_ASSERT_OK(td_tensor_to_dtype(in[0], F32, &t));
      st = td_tensor_max(t, 0, false, &u, out);
      td_tensor_unref(u);
      return chain2(st, t);
    case S_SM_LAST:
    case S_SM_WIDE: return td_tensor_softmax(in[0], -1, out);
    case S_SM_MID: return td_tensor_softmax(in[0], 1, out);
    case S_LSM_LAST: return td_tensor_log_softmax(in[0], -1, out);
    case S_LSM_MID: return td_tensor_log_softmax(in[0], 1, out);
    case S_SM_LARGE_LOGITS:
      TD_ASSERT_OK(td_tensor_mul_scalar(in[0], 100.0, &t));
      return chain2(td_tensor_log_softmax(t, 1, out), t);
    case L_NLL_MEAN:
    case L_NLL_SUM:
    case L_NLL_NONE:
    case L_NLL_1D:
    case L_NLL_BAD: {
      td_reduction red = op == L_NLL_SUM ? TD_REDUCTION_SUM
                         : op == L_NLL_NONE ? TD_REDUCTION_NONE
                                            : TD_REDUCTION_MEAN;
      TD_ASSERT_OK(td_tensor_log_softmax(in[0], -1, &t));
      return chain2(td_tensor_nll_loss(t, in[1], red, -100, out), t);
    }
    case L_CE: return td_tensor_cross_entropy(in[0], in[1], TD_REDUCTION_MEAN, -100, out);
    case L_MSE_MEAN: return td_tensor_mse_loss(in[0], in[1], TD_REDUCTION_MEAN, out);
    case L_MSE_SUM: return td_tensor_mse_loss(in[0], in[1], TD_REDUCTION_SUM, out);
    case L_MSE_NONE: return td_tensor_mse_loss(in[0], in[1], TD_REDUCTION_NONE, out);
    case C_CONV_BIAS: return td_tensor_conv2d(in[0], in[1], in[2], 2, 1, 1, 0, out);
    case C_CONV_NOBIAS: return td_tensor_conv2d(in[0], in[1], NULL, 1, 1, 1, 1, out);
    case C_CONV_BIG: return td_tensor_conv2d(in[0], in[1], in[2], 1, 1, 1, 1, out);
    case P_POOL: return td_tensor_max_pool2d(in[0], 2, 2, 2, 2, out);
    case P_POOL_OVERLAP: return td_tensor_max_pool2d(in[0], 3, 3, 1, 1, out);
    case P_POOL_RECT: return td_tensor_max_pool2d(in[0], 3, 2, 2, 3, out);
    case I_EMBED:
    case I_EMBED_BAD: return td_tensor_embedding(in[0], in[1], out);
    case I_SELECT_MID: return td_tensor_index_select(in[0], 1, in[1], out);
    case I_SELECT_FIRST:
    case I_SELECT_INT: return td_tensor_index_select(in[0], 0, in[1], out);
    case N_LN1:
    case N_LN_WIDE:
    case N_LN_ROWS: return td_tensor_layer_norm(in[0], 1, in[1], in[2], 1e-5, out);
    case N_LN2: return td_tensor_layer_norm(in[0], 2, NULL, NULL, 1e-5, out);
    case J_CAT0:
    case J_CAT1: {
      td_tensor *ts[2] = {in[0], in[1]};
      return td_tensor_cat(ts, 2, op == J_CAT0 ? 0 : 1, out);
    }
    case J_STACK: {
      td_tensor *ts[2] = {in[0], in[1]};
      return td_tensor_stack(ts, 2, 1, out);
    }
    case J_PERMUTE_CLONE: {
      int p[3] = {1, 2, 0};
      TD_ASSERT_OK(td_tensor_permute(in[0], p, 3, &t));
      return chain2(td_tensor_clone(t, out), t);
    }
    case J_NARROW_CLONE:
      TD_ASSERT_OK(td_tensor_narrow(in[0], 1, 1, 3, &t));
      return chain2(td_tensor_contiguous(t, out), t);
    case J_TO_F32: {
      td_dtype other = td_tensor_dtype(in[0]) == F32 ? F64 : F32;
      TD_ASSERT_OK(td_tensor_to_dtype(in[0], other, &t));
      TD_ASSERT_OK(td_tensor_mul(t, t, &u));
      td_tensor_unref(t);
      return chain2(td_tensor_to_dtype(u, td_tensor_dtype(in[0]), out), u);
    }
    case J_TO_I64: return td_tensor_to_dtype(in[0], I64, out);
    case P_INPLACE: {
      bool prev = td_autograd_set_enabled(false);
      st = td_tensor_clone(in[0], &t);
      if (st == TD_OK) st = td_tensor_mul_scalar_(t, 1.5);
      if (st == TD_OK) st = td_tensor_add_(t, in[1], -0.5);
      if (st == TD_OK) st = td_tensor_addcmul_(t, in[0], in[2], 0.25);
      if (st == TD_OK) st = td_tensor_addcdiv_(t, in[0], in[2], 2.0);
      if (st == TD_OK) st = td_tensor_maximum_(t, in[2]);
      td_autograd_set_enabled(prev);
      if (st == TD_OK) *out = t;
      else td_tensor_unref(t);
      return st;
    }
    case P_COPY_BCAST: {
      int64_t s[2] = {3, 4};
      td_dtype other = td_tensor_dtype(in[0]) == F32 ? F64 : F32;
      st = td_tensor_zeros(s, 2, other, td_tensor_device(in[0]), &t);
      if (st == TD_OK) st = td_tensor_copy_(t, in[0]); /* [4] broadcast over rows, converted */
      if (st == TD_OK) st = td_tensor_narrow(t, 0, 1, 2, &u);
      if (st == TD_OK) st = td_tensor_copy_(u, in[1]); /* [2, 4] into a strided view */
      td_tensor_unref(u);
      if (st == TD_OK) *out = t;
      else td_tensor_unref(t);
      return st;
    }
    case P_FILL:
      st = td_tensor_clone(in[0], &t);
      if (st == TD_OK) st = td_tensor_detach(t, &u);
      td_tensor_unref(t);
      t = u;
      u = NULL;
      if (st == TD_OK) st = td_tensor_fill_(t, 3.25);
      if (st == TD_OK) st = td_tensor_narrow(t, 1, 1, 2, &u);
      if (st == TD_OK) st = td_tensor_zero_(u);
      td_tensor_unref(u);
      if (st == TD_OK) *out = t;
      else td_tensor_unref(t);
      return st;
    case P_DROPOUT: {
      td_generator *g;
      TD_ASSERT_OK(td_generator_create(7, &g));
      st = td_tensor_dropout(in[0], 0.3, true, g, out);
      td_generator_destroy(g);
      return st;
    }
    case P_INT_ARITH:
      st = td_tensor_add(in[0], in[1], &t);
      if (st == TD_OK) st = td_tensor_mul(t, in[1], &u);
      td_tensor_unref(t);
      t = NULL;
      if (st == TD_OK) st = td_tensor_sub(u, in[0], &t);
      td_tensor_unref(u);
      if (st == TD_OK) st = td_tensor_maximum(t, in[0], out);
      td_tensor_unref(t);
      return st;
    case P_INT_DIV0: return td_tensor_div(in[0], in[1], out);
    case P_INT_SUM: {
      int d[1] = {1};
      return td_tensor_sum(in[0], d, 1, false, out);
    }
  }
  return TD_ERR_INVALID;
}

/* ---- the comparison harness ---- */

typedef struct {
  const char *name;
  op_id op;
  int n_in;
  in_spec in[4];
  double tol; /* multiplies the default tolerances; 0 means 1 */
} op_case;

static td_device cuda0(void) { return td_device_cuda(0); }

static void expect_cuda(const char *what, const td_tensor *t) {
  td_device d = td_tensor_device(t);
  if (d.type != TD_DEVICE_CUDA || d.index != 0) {
    char buf[16];
    fail_msg("%s: result lives on %s, expected cuda:0", what, td_device_str(d, buf, sizeof buf));
  }
}

/* compare moves the CUDA result to the CPU and checks it against the CPU result. */
static void compare(const char *what, const td_tensor *gpu, const td_tensor *cpu, td_dtype dt,
                    double scale) {
  expect_cuda(what, gpu);
  td_tensor *back;
  TD_ASSERT_OK(td_tensor_to(gpu, td_device_cpu(), &back));
  assert_int_equal(td_tensor_dtype(back), td_tensor_dtype(cpu));
  double tol = (dt == F32 ? 2e-4 : 1e-9) * scale;
  if (td_tensor_dtype(cpu) == I64) tol = 0;
  td_test_assert_close(what, back, cpu, tol, tol);
  td_tensor_unref(back);
}

static void run_case(const op_case *c, td_dtype dt) {
  td_tensor *cin[4] = {0}, *gin[4] = {0}, *cy = NULL, *gy = NULL;
  char what[192];
  const char *dn = td_dtype_name(dt);
  double scale = c->tol > 0 ? c->tol : 1.0;
  bool any_grad = false;
  for (int i = 0; i < c->n_in; i++) {
    cin[i] = make_input(&c->in[i], dt, 1000 + 17 * (uint64_t)i + (uint64_t)c->op);
    TD_ASSERT_OK(td_tensor_to(cin[i], cuda0(), &gin[i]));
    snprintf(what, sizeof what, "%s (%s) input %d", c->name, dn, i);
    expect_cuda(what, gin[i]);
    if (c->in[i].grad && td_tensor_dtype(cin[i]) != I64) {
      TD_ASSERT_OK(td_tensor_set_requires_grad(cin[i], true));
      TD_ASSERT_OK(td_tensor_set_requires_grad(gin[i], true));
      any_grad = true;
    }
  }
  void *ctx = (void *)(intptr_t)c->op;
  td_status cs = run_op(ctx, cin, c->n_in, &cy);
  const char *cerr = cs == TD_OK ? "" : td_last_error();
  char cmsg[256];
  snprintf(cmsg, sizeof cmsg, "%s", cerr);
  td_status gs = run_op(ctx, gin, c->n_in, &gy);
  if (cs != gs)
    fail_msg("%s (%s): CPU returned %s (%s) but CUDA returned %s (%s)", c->name, dn,
             td_status_name(cs), cmsg, td_status_name(gs), gs == TD_OK ? "" : td_last_error());
  if (cs == TD_OK) {
    snprintf(what, sizeof what, "%s (%s) forward", c->name, dn);
    compare(what, gy, cy, dt, scale);
    if (any_grad && td_tensor_dtype(cy) != I64) {
      td_tensor *w, *wg, *pc, *pg, *lc, *lg;
      w = td_test_randn(td_tensor_shape(cy), td_tensor_ndim(cy), td_tensor_dtype(cy), 99, false);
      TD_ASSERT_OK(td_tensor_to(w, cuda0(), &wg));
      TD_ASSERT_OK(td_tensor_mul(cy, w, &pc));
      TD_ASSERT_OK(td_tensor_mul(gy, wg, &pg));
      TD_ASSERT_OK(td_tensor_sum_all(pc, &lc));
      TD_ASSERT_OK(td_tensor_sum_all(pg, &lg));
      TD_ASSERT_OK(td_tensor_backward(lc));
      TD_ASSERT_OK(td_tensor_backward(lg));
      for (int i = 0; i < c->n_in; i++) {
        if (!c->in[i].grad || td_tensor_dtype(cin[i]) == I64) continue;
        td_tensor *gc = td_tensor_grad(cin[i]), *gg = td_tensor_grad(gin[i]);
        snprintf(what, sizeof what, "%s (%s) gradient of input %d", c->name, dn, i);
        if (!gc || !gg) fail_msg("%s: missing (CPU %p, CUDA %p)", what, (void *)gc, (void *)gg);
        compare(what, gg, gc, dt, scale);
        td_tensor_unref(gc);
        td_tensor_unref(gg);
      }
      td_tensor_unref(w);
      td_tensor_unref(wg);
      td_tensor_unref(pc);
      td_tensor_unref(pg);
      td_tensor_unref(lc);
      td_tensor_unref(lg);
    }
  }
  td_tensor_unref(cy);
  td_tensor_unref(gy);
  for (int i = 0; i < c->n_in; i++) {
    td_tensor_unref(cin[i]);
    td_tensor_unref(gin[i]);
  }
}

static void run_cases(const op_case *cases, size_t n) {
  for (size_t i = 0; i < n; i++) {
    run_case(&cases[i], F64);
    run_case(&cases[i], F32);
  }
}

#define NCASES(a) (sizeof(a) / sizeof((a)[0]))

/* ---- tests ---- */

static void test_cuda_missing_device_is_reported(void **state) {
  (void)state;
  int n = td_cuda_device_count();
  assert_true(n >= 0);
  assert_false(td_device_available(td_device_cuda(n)));
  td_tensor *t = NULL;
  int64_t shape[1] = {4};
  td_status st = td_tensor_zeros(shape, 1, F32, td_device_cuda(n), &t);
  assert_true(st == TD_ERR_DEVICE || st == TD_ERR_UNSUPPORTED);
  assert_null(t);
  assert_true(strlen(td_last_error()) > 0);
}

static void test_cuda_elementwise_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"add broadcast", E_ADD_BCAST, 2, {NORMAL(true, 2, 4, 5), NORMAL(true, 1, 5)}},
      {"sub broadcast", E_SUB_BCAST, 2, {NORMAL(true, 3, 3, 1, 4), NORMAL(true, 2, 2, 4)}},
      {"mul transposed", E_MUL_T, 2, {NORMAL(true, 2, 5, 4), NORMAL(true, 2, 4, 5)}},
      {"div", E_DIV, 2, {NORMAL(true, 2, 4, 5), UNIFORM(true, 0.5, 2.0, 2, 4, 5)}},
      {"maximum", E_MAXIMUM, 2, {NORMAL(true, 2, 6, 7), NORMAL(true, 2, 6, 7)}},
      {"maximum ties", E_MAXIMUM_TIES, 1, {NORMAL(true, 2, 6, 7)}},
      {"scalar ops", E_SCALARS, 1, {NORMAL(true, 2, 3, 5)}},
      {"pow 3", E_POW3, 1, {NORMAL(true, 2, 3, 5)}},
      {"pow 2", E_POW2, 1, {NORMAL(true, 2, 3, 5)}},
      {"pow 0.5", E_POWHALF, 1, {UNIFORM(true, 0.5, 2.0, 2, 3, 5)}},
      {"exp", E_EXP, 1, {NORMAL(true, 2, 3, 5)}},
      {"log", E_LOG, 1, {UNIFORM(true, 0.5, 3.0, 2, 3, 5)}},
      {"sqrt", E_SQRT, 1, {UNIFORM(true, 0.5, 3.0, 2, 3, 5)}},
      {"tanh", E_TANH, 1, {NORMAL(true, 2, 3, 5)}},
      {"sigmoid", E_SIGMOID, 1, {UNIFORM(true, -8.0, 8.0, 2, 6, 5)}},
      {"relu", E_RELU, 1, {NORMAL(true, 2, 6, 5)}},
      {"gelu", E_GELU, 1, {UNIFORM(true, -4.0, 4.0, 2, 6, 5)}},
      {"add 3M elements", E_BIG_ADD, 2, {NORMAL(true, 2, 1500, 2001), NORMAL(true, 1, 2001)},
       10},
      {"exp of permuted view", E_PERMUTED_EXP, 1, {NORMAL(true, 3, 2, 3, 4)}},
      {"mul of expanded view", E_EXPAND_MUL, 2, {NORMAL(true, 2, 3, 1), NORMAL(true, 2, 3, 4)}},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_matmul_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"matmul 2-d", M_2D, 2, {NORMAL(true, 2, 5, 7), NORMAL(true, 2, 7, 3)}},
      {"matmul batched", M_BATCH, 2, {NORMAL(true, 3, 2, 5, 7), NORMAL(true, 2, 7, 3)}},
      {"matmul broadcast", M_BCAST, 2, {NORMAL(true, 4, 2, 1, 4, 6), NORMAL(true, 3, 3, 6, 5)}},
      {"matmul dot", M_DOT, 2, {NORMAL(true, 1, 7), NORMAL(true, 1, 7)}},
      {"matmul matrix-vector", M_VEC, 2, {NORMAL(true, 2, 4, 7), NORMAL(true, 1, 7)}},
      {"matmul transposed views", M_TRANS, 2, {NORMAL(true, 2, 7, 5), NORMAL(true, 2, 3, 7)}},
      {"matmul K = 0", M_EMPTY_K, 2, {NORMAL(true, 2, 3, 0), NORMAL(true, 2, 0, 4)}},
      {"matmul large", M_LARGE, 2, {NORMAL(true, 2, 64, 300), NORMAL(true, 2, 300, 129)}, 20},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_reductions_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"sum keepdim", R_SUM_KEEP, 1, {NORMAL(true, 3, 3, 4, 5)}},
      {"sum dims 0,2", R_SUM_02, 1, {NORMAL(true, 3, 3, 4, 5)}},
      {"sum_all 37000", R_SUM_ALL_BIG, 1, {NORMAL(true, 2, 1000, 37)}, 50},
      {"sum columns", R_SUM_COLS_BIG, 1, {NORMAL(true, 2, 300, 500)}, 10},
      {"mean", R_MEAN, 1, {NORMAL(true, 2, 4, 6)}},
      {"mean_all", R_MEAN_ALL, 1, {NORMAL(true, 2, 4, 6)}},
      {"max rows", R_MAX_ROWS, 1, {NORMAL(true, 2, 5, 300)}},
      {"max columns", R_MAX_COLS, 1, {NORMAL(true, 2, 300, 7)}},
      {"max multi-pass", R_MAX_BIG, 1, {NORMAL(true, 2, 3, 20000)}},
      {"argmax ties (first occurrence)", R_ARGMAX_TIES, 1, {INTS(0, 3, 2, 2, 20000)}},
      {"max index ties, columns", R_MAXIDX_COLS_TIES, 1, {INTS(0, 3, 2, 20000, 3)}},
      {"sum over empty dim", R_SUM_EMPTY, 1, {NORMAL(true, 2, 0, 3)}},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_softmax_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"softmax last dim", S_SM_LAST, 1, {NORMAL(true, 2, 6, 10)}},
      {"softmax middle dim", S_SM_MID, 1, {NORMAL(true, 3, 2, 5, 3)}},
      {"log_softmax last dim", S_LSM_LAST, 1, {NORMAL(true, 2, 6, 10)}},
      {"log_softmax middle dim", S_LSM_MID, 1, {NORMAL(true, 3, 2, 5, 3)}},
      {"softmax wide rows", S_SM_WIDE, 1, {NORMAL(true, 2, 4, 3000)}},
      {"log_softmax large logits", S_SM_LARGE_LOGITS, 1, {NORMAL(true, 2, 4, 9)}, 100},
  };
  run_cases(cases, NCASES(cases));
}

static const double nll_targets[] = {0, 4, -100, 2, 2, 1};
static const double nll_bad_targets[] = {0, 7, 1};
static const double nll_one_target[] = {3};

static void test_cuda_losses_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"nll mean (ignore_index)", L_NLL_MEAN, 2, {NORMAL(true, 2, 6, 5), IVALUES(nll_targets, 1, 6)}},
      {"nll sum", L_NLL_SUM, 2, {NORMAL(true, 2, 6, 5), IVALUES(nll_targets, 1, 6)}},
      {"nll none", L_NLL_NONE, 2, {NORMAL(true, 2, 6, 5), IVALUES(nll_targets, 1, 6)}},
      {"nll 1-d", L_NLL_1D, 2, {NORMAL(true, 1, 5), IVALUES(nll_one_target, 0, 0)}},
      {"nll out-of-range target", L_NLL_BAD, 2,
       {NORMAL(true, 2, 3, 5), IVALUES(nll_bad_targets, 1, 3)}},
      {"cross_entropy", L_CE, 2, {NORMAL(true, 2, 8, 10), INTS(0, 10, 1, 8)}},
      {"mse mean", L_MSE_MEAN, 2, {NORMAL(true, 2, 4, 5), NORMAL(true, 2, 4, 5)}},
      {"mse sum", L_MSE_SUM, 2, {NORMAL(true, 2, 4, 5), NORMAL(true, 2, 4, 5)}},
      {"mse none", L_MSE_NONE, 2, {NORMAL(true, 2, 4, 5), NORMAL(false, 2, 4, 5)}},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_conv_pool_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"conv2d bias stride 2x1 pad 1x0", C_CONV_BIAS, 3,
       {NORMAL(true, 4, 2, 3, 7, 6), NORMAL(true, 4, 4, 3, 3, 2), NORMAL(true, 1, 4)}},
      {"conv2d no bias pad 1", C_CONV_NOBIAS, 2,
       {NORMAL(true, 4, 1, 2, 5, 5), NORMAL(true, 4, 3, 2, 3, 3)}},
      {"conv2d 8->16 channels", C_CONV_BIG, 3,
       {NORMAL(true, 4, 2, 8, 16, 16), NORMAL(true, 4, 16, 8, 3, 3), NORMAL(true, 1, 16)}, 20},
      {"max_pool2d 2x2", P_POOL, 1, {NORMAL(true, 4, 2, 3, 8, 7)}},
      {"max_pool2d overlapping 3x3 stride 1", P_POOL_OVERLAP, 1, {NORMAL(true, 4, 2, 2, 9, 9)}},
      {"max_pool2d 3x2 stride 2x3", P_POOL_RECT, 1, {NORMAL(true, 4, 1, 3, 9, 10)}},
  };
  run_cases(cases, NCASES(cases));
}

static const double embed_ids[] = {1, 3, 3, 9, 0, 1, 1, 1, 7, 2, 3, 3, 5, 9, 9};
static const double embed_bad_ids[] = {1, 10, 2};
static const double select_ids[] = {5, 0, 5, 2, 1};
static const double select_first_ids[] = {3, 3, 0};

static void test_cuda_indexing_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"embedding with repeats", I_EMBED, 2, {NORMAL(true, 2, 10, 4), IVALUES(embed_ids, 2, 3, 5)}},
      {"embedding out-of-range index", I_EMBED_BAD, 2,
       {NORMAL(true, 2, 10, 4), IVALUES(embed_bad_ids, 1, 3)}},
      {"index_select middle dim", I_SELECT_MID, 2,
       {NORMAL(true, 3, 4, 6, 3), IVALUES(select_ids, 1, 5)}},
      {"index_select dim 0", I_SELECT_FIRST, 2,
       {NORMAL(true, 2, 4, 3), IVALUES(select_first_ids, 1, 3)}},
      {"index_select int64", I_SELECT_INT, 2,
       {INTS(0, 1000, 2, 4, 3), IVALUES(select_first_ids, 1, 3)}},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_layer_norm_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"layer_norm affine", N_LN1, 3,
       {NORMAL(true, 3, 4, 5, 6), NORMAL(true, 1, 6), NORMAL(true, 1, 6)}},
      {"layer_norm 2 dims, no affine", N_LN2, 1, {NORMAL(true, 3, 3, 4, 5)}},
      {"layer_norm wide rows", N_LN_WIDE, 3,
       {NORMAL(true, 2, 3, 700), NORMAL(true, 1, 700), NORMAL(true, 1, 700)}, 10},
      {"layer_norm many rows", N_LN_ROWS, 3,
       {NORMAL(true, 2, 2000, 8), NORMAL(true, 1, 8), NORMAL(true, 1, 8)}, 20},
  };
  run_cases(cases, NCASES(cases));
}

static void test_cuda_copies_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"cat dim 0", J_CAT0, 2, {NORMAL(true, 2, 2, 3), NORMAL(true, 2, 4, 3)}},
      {"cat dim 1", J_CAT1, 2, {NORMAL(true, 2, 3, 2), NORMAL(true, 2, 3, 4)}},
      {"stack", J_STACK, 2, {NORMAL(true, 2, 3, 2), NORMAL(true, 2, 3, 2)}},
      {"clone of permuted view", J_PERMUTE_CLONE, 1, {NORMAL(true, 3, 2, 3, 4)}},
      {"contiguous of narrowed view", J_NARROW_CLONE, 1, {NORMAL(true, 2, 3, 5)}},
      {"dtype round trip", J_TO_F32, 1, {NORMAL(true, 2, 3, 5)}},
      {"float to int64", J_TO_I64, 1, {UNIFORM(false, -50.0, 50.0, 2, 3, 5)}},
  };
  run_cases(cases, NCASES(cases));
}

static const double int_b[] = {3, -2, 5, 7, 1, -4};
static const double int_b_zero[] = {3, 0, 5, 7, 1, -4};

static void test_cuda_inplace_and_int_match_cpu(void **state) {
  (void)state;
  REQUIRE_CUDA();
  static const op_case cases[] = {
      {"in-place updates", P_INPLACE, 3,
       {NORMAL(false, 2, 4, 5), NORMAL(false, 1, 5), UNIFORM(false, 1.0, 2.0, 2, 4, 5)}},
      {"copy_ broadcast and convert", P_COPY_BCAST, 2, {NORMAL(false, 1, 4), NORMAL(false, 2, 2, 4)}},
      {"fill_ and zero_ of a view", P_FILL, 1, {NORMAL(false, 2, 3, 4)}},
      {"dropout with a seeded generator", P_DROPOUT, 1, {NORMAL(true, 2, 20, 30)}},
      {"int64 arithmetic", P_INT_ARITH, 2, {INTS(0, 100, 2, 2, 3), IVALUES(int_b, 2, 2, 3)}},
      {"int64 division by zero", P_INT_DIV0, 2, {INTS(0, 100, 2, 2, 3), IVALUES(int_b_zero, 2, 2, 3)}},
      {"int64 sum", P_INT_SUM, 1, {INTS(0, 1000, 2, 7, 300)}},
  };
  for (size_t i = 0; i < NCASES(cases); i++) run_case(&cases[i], F64);
  for (size_t i = 0; i < 4; i++) run_case(&cases[i], F32);
}

static void test_cuda_transfers_and_accessors(void **state) {
  (void)state;
  REQUIRE_CUDA();
  int64_t shape[2] = {3, 4};
  td_tensor *c = td_test_randn(shape, 2, F64, 5, false), *g, *gt, *ct;
  TD_ASSERT_OK(td_tensor_to(c, cuda0(), &g));
  TD_ASSERT_OK(td_tensor_transpose(g, 0, 1, &gt));
  TD_ASSERT_OK(td_tensor_transpose(c, 0, 1, &ct));
  double a[12], b[12];
  TD_ASSERT_OK(td_tensor_copy_to_buffer(gt, a, sizeof a)); /* strided device tensor */
  TD_ASSERT_OK(td_tensor_copy_to_buffer(ct, b, sizeof b));
  assert_memory_equal(a, b, sizeof a);
  int64_t idx[2] = {2, 1};
  double vg, vc;
  TD_ASSERT_OK(td_tensor_get(gt, idx, &vg));
  TD_ASSERT_OK(td_tensor_get(ct, idx, &vc));
  assert_true(vg == vc);
  td_tensor *s;
  TD_ASSERT_OK(td_tensor_sum_all(g, &s));
  TD_ASSERT_OK(td_tensor_item(s, &vg));
  double sum = 0;
  for (int i = 0; i < 12; i++) sum += b[i];
  assert_true(fabs(vg - sum) < 1e-12);
  bool close = false;
  TD_ASSERT_OK(td_tensor_allclose(g, c, 0, 0, &close));
  assert_true(close);
  td_tensor_unref(s);
  td_tensor_unref(gt);
  td_tensor_unref(ct);
  td_tensor_unref(g);
  td_tensor_unref(c);
}

/* Many tensors of mixed sizes alive at once, freed in a scattered order and reallocated: the
 * caching allocator must never hand out a block that is still in use. */
static void test_cuda_allocator_reuse_keeps_data(void **state) {
  (void)state;
  REQUIRE_CUDA();
  enum { N = 96 };
  td_tensor *ts[N] = {0};
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < N; i++) {
      if (ts[i] && (i + round) % 3 != 0) continue;
      td_tensor_unref(ts[i]);
      int64_t n = 1 + (int64_t)((i * 7919 + round * 104729) % 300000);
      TD_ASSERT_OK(td_tensor_full(&n, 1, (double)(i + 1000 * round), F32, cuda0(), &ts[i]));
    }
    for (int i = 0; i < N; i++) {
      td_tensor *mx;
      double v;
      TD_ASSERT_OK(td_tensor_max(ts[i], 0, false, &mx, NULL));
      TD_ASSERT_OK(td_tensor_item(mx, &v));
      td_tensor_unref(mx);
      td_tensor *mn, *neg;
      double w;
      TD_ASSERT_OK(td_tensor_neg(ts[i], &neg));
      TD_ASSERT_OK(td_tensor_max(neg, 0, false, &mn, NULL));
      TD_ASSERT_OK(td_tensor_item(mn, &w));
      td_tensor_unref(mn);
      td_tensor_unref(neg);
      if (v != -w) fail_msg("tensor %d holds mixed values: max %g, min %g", i, v, -w);
    }
  }
  for (int i = 0; i < N; i++) td_tensor_unref(ts[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_missing_device_is_reported),
      cmocka_unit_test(test_cuda_elementwise_match_cpu),
      cmocka_unit_test(test_cuda_matmul_match_cpu),
      cmocka_unit_test(test_cuda_reductions_match_cpu),
      cmocka_unit_test(test_cuda_softmax_match_cpu),
      cmocka_unit_test(test_cuda_losses_match_cpu),
      cmocka_unit_test(test_cuda_conv_pool_match_cpu),
      cmocka_unit_test(test_cuda_indexing_match_cpu),
      cmocka_unit_test(test_cuda_layer_norm_match_cpu),
      cmocka_unit_test(test_cuda_copies_match_cpu),
      cmocka_unit_test(test_cuda_inplace_and_int_match_cpu),
      cmocka_unit_test(test_cuda_transfers_and_accessors),
      cmocka_unit_test(test_cuda_allocator_reuse_keeps_data),
  };
  int failed = cmocka_run_group_tests_name("cuda_ops", tests, NULL, NULL);
  if (failed) return 1;
  return td_cuda_device_count() == 0 ? 77 : 0;
}
