/* test_util.c - gradient checking, random tensors and tensor comparison for the tests. */
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

td_tensor *td_test_randn(const int64_t *shape, int ndim, td_dtype dt, uint64_t seed,
                         bool requires_grad) {
  td_generator *g;
  td_tensor *t;
  TD_ASSERT_OK(td_generator_create(seed, &g));
  TD_ASSERT_OK(td_tensor_normal(shape, ndim, 0.0, 1.0, dt, td_device_cpu(), g, &t));
  td_generator_destroy(g);
  if (requires_grad) TD_ASSERT_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

td_tensor *td_test_rand(const int64_t *shape, int ndim, td_dtype dt, double lo, double hi,
                        uint64_t seed, bool requires_grad) {
  td_generator *g;
  td_tensor *t;
  TD_ASSERT_OK(td_generator_create(seed, &g));
  TD_ASSERT_OK(td_tensor_uniform(shape, ndim, lo, hi, dt, td_device_cpu(), g, &t));
  td_generator_destroy(g);
  if (requires_grad) TD_ASSERT_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

td_tensor *td_test_tensor(const double *values, const int64_t *shape, int ndim, td_dtype dt,
                          bool requires_grad) {
  td_tensor *d, *t;
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  TD_ASSERT_OK(td_tensor_from_buffer(values, shape, ndim, TD_DTYPE_F64, &d));
  (void)n;
  TD_ASSERT_OK(td_tensor_to_dtype(d, dt, &t));
  if (t == d) {
    /* same dtype: detach into an independent tensor so requires_grad can be set */
    td_tensor_unref(t);
    TD_ASSERT_OK(td_tensor_clone(d, &t));
  }
  td_tensor_unref(d);
  if (requires_grad) TD_ASSERT_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

static double *to_doubles(const td_tensor *t) {
  int64_t n = td_tensor_numel(t);
  double *buf = malloc((size_t)(n ? n : 1) * sizeof(double));
  td_tensor *d;
  bool prev = td_autograd_set_enabled(false);
  TD_ASSERT_OK(td_tensor_to_dtype(t, TD_DTYPE_F64, &d));
  td_autograd_set_enabled(prev);
  TD_ASSERT_OK(td_tensor_copy_to_buffer(d, buf, (size_t)n * sizeof(double)));
  td_tensor_unref(d);
  return buf;
}

void td_test_assert_close(const char *what, const td_tensor *a, const td_tensor *b, double rtol,
                          double atol) {
  char sa[128], sb[128];
  if (!td_tensor_same_shape(a, b))
    fail_msg("%s: shapes differ: %s vs %s", what, td_tensor_shape_str(a, sa, sizeof sa),
             td_tensor_shape_str(b, sb, sizeof sb));
  int64_t n = td_tensor_numel(a);
  double *x = to_doubles(a), *y = to_doubles(b);
  int64_t worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < n; i++) {
    double tol = atol + rtol * fabs(y[i]);
    double diff = fabs(x[i] - y[i]);
    if (isnan(x[i]) != isnan(y[i]) || diff > tol) {
      double excess = isnan(diff) ? INFINITY : diff - tol;
      if (worst < 0 || excess > worst_excess) {
        worst = i;
        worst_excess = excess;
      }
    }
  }
  if (worst >= 0) {
    double xv = x[worst], yv = y[worst];
    free(x);
    free(y);
    fail_msg("%s: element %lld differs: got %.10g, expected %.10g (rtol %g, atol %g)", what,
             (long long)worst, xv, yv, rtol, atol);
  }
  free(x);
  free(y);
}

/* Evaluates sum(fn(inputs) * w) as a double with grad disabled. */
static double eval_weighted(td_test_fn fn, void *ctx, td_tensor *const *inputs, int n,
                            const td_tensor *w) {
  td_tensor *o = NULL, *p = NULL, *s = NULL;
  TD_ASSERT_OK(fn(ctx, inputs, n, &o));
  TD_ASSERT_OK(td_tensor_mul(o, w, &p));
  TD_ASSERT_OK(td_tensor_sum_all(p, &s));
  double v;
  TD_ASSERT_OK(td_tensor_item(s, &v));
  td_tensor_unref(o);
  td_tensor_unref(p);
  td_tensor_unref(s);
  return v;
}

void td_test_gradcheck(td_test_fn fn, void *ctx, td_tensor *const *inputs, int n, double eps,
                       double atol, double rtol) {
  /* analytic */
  td_tensor *o = NULL, *w = NULL, *p = NULL, *s = NULL;
  TD_ASSERT_OK(fn(ctx, inputs, n, &o));
  w = td_test_rand(td_tensor_shape(o), td_tensor_ndim(o), td_tensor_dtype(o), 0.5, 1.5, 1234,
                   false);
  TD_ASSERT_OK(td_tensor_mul(o, w, &p));
  TD_ASSERT_OK(td_tensor_sum_all(p, &s));
  for (int i = 0; i < n; i++)
    if (inputs[i] && td_tensor_requires_grad(inputs[i])) TD_ASSERT_OK(td_tensor_set_grad(inputs[i], NULL));
  TD_ASSERT_OK(td_tensor_backward(s));
  td_tensor_unref(o);
  td_tensor_unref(p);
  td_tensor_unref(s);

  bool prev = td_autograd_set_enabled(false);
  for (int i = 0; i < n; i++) {
    td_tensor *x = inputs[i];
    if (!x || !td_tensor_requires_grad(x)) continue;
    td_tensor *g = td_tensor_grad(x);
    if (!g) fail_msg("gradcheck: input %d received no gradient", i);
    double *ga = to_doubles(g);
    td_tensor_unref(g);
    int64_t m = td_tensor_numel(x);
    td_dtype dt = td_tensor_dtype(x);
    if (!td_tensor_is_contiguous(x)) fail_msg("gradcheck: input %d must be contiguous", i);
    void *data = td_tensor_data(x);
    for (int64_t j = 0; j < m; j++) {
      double orig = dt == TD_DTYPE_F32 ? ((float *)data)[j] : ((double *)data)[j];
#define SETV(v)                                  \
  do {                                           \
    if (dt == TD_DTYPE_F32) ((float *)data)[j] = (float)(v); \
    else ((double *)data)[j] = (v);              \
  } while (0)
      SETV(orig + eps);
      double fp = eval_weighted(fn, ctx, inputs, n, w);
      SETV(orig - eps);
      double fm = eval_weighted(fn, ctx, inputs, n, w);
      SETV(orig);
#undef SETV
      double num = (fp - fm) / (2 * eps);
      if (fabs(ga[j] - num) > atol + rtol * fabs(num)) {
        double a = ga[j];
        free(ga);
        td_tensor_unref(w);
        td_autograd_set_enabled(prev);
        fail_msg("gradcheck: input %d element %lld: analytic %.10g vs numeric %.10g", i,
                 (long long)j, a, num);
      }
    }
    free(ga);
  }
  td_autograd_set_enabled(prev);
  for (int i = 0; i < n; i++)
    if (inputs[i] && td_tensor_requires_grad(inputs[i])) TD_ASSERT_OK(td_tensor_set_grad(inputs[i], NULL));
  td_tensor_unref(w);
}

const char *td_test_source_path(const char *rel, char *buf, size_t n) {
  const char *root = getenv("TD_SOURCE_DIR");
  if (!root || !*root) root = TD_SOURCE_DIR;
  snprintf(buf, n, "%s/%s", root, rel);
  return buf;
}


int td_test_count_nodes(const td_tensor *root, const char *name) {
  enum { CAP = 4096 };
  const td_node **seen = calloc(CAP, sizeof *seen), **stack = calloc(CAP, sizeof *stack);
  int nseen = 0, sp = 0, count = 0;
  if (!seen || !stack) abort();
  if (td_tensor_grad_fn(root)) stack[sp++] = td_tensor_grad_fn(root);
  while (sp) {
    const td_node *n = stack[--sp];
    bool dup = false;
    for (int i = 0; i < nseen && !dup; i++) dup = seen[i] == n;
    if (dup) continue;
    if (nseen == CAP) abort(); /* a test graph, small by construction */
    seen[nseen++] = n;
    if (strcmp(td_node_name(n), name) == 0) count++;
    for (int i = 0; i < td_node_num_inputs(n); i++) {
      td_node *c = td_node_next(n, i);
      if (c && sp < CAP) stack[sp++] = c;
    }
  }
  free(seen);
  free(stack);
  return count;
}

bool td_test_same_bits(const td_tensor *a, const td_tensor *b) {
  if (!a || !b || !td_tensor_same_shape(a, b) || td_tensor_dtype(a) != td_tensor_dtype(b))
    return false;
  td_tensor *ca = NULL, *cb = NULL;
  bool eq = td_tensor_contiguous(a, &ca) == TD_OK && td_tensor_contiguous(b, &cb) == TD_OK &&
            memcmp(td_tensor_data(ca), td_tensor_data(cb), td_tensor_nbytes(ca)) == 0;
  td_tensor_unref(ca);
  td_tensor_unref(cb);
  return eq;
}

td_module *td_test_tiny_gpt(td_dtype dt, int n_layer, uint64_t seed) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = 13, c.block_size = 8, c.n_layer = n_layer, c.n_head = 2, c.n_embd = 16;
  td_generator *g = NULL;
  td_module *m = NULL;
  MP_CHECK_OK(td_generator_create(seed, &g));
  MP_CHECK_OK(td_gpt_create(&c, g, &m));
  td_generator_destroy(g);
  if (dt != TD_DTYPE_F32) MP_CHECK_OK(td_module_to_dtype(m, dt));
  return m;
}
