/* ops_binary.c - broadcasting elementwise binary ops (add, sub, mul, div, maximum) with their
 * backward, and the in-place updates used by optimizers (add_, addcmul_, addcdiv_, maximum_,
 * mul_scalar_, and adam_, the fused Adam / AdamW step).
 *
 * Forward: both operands are viewed with the broadcast shape (stride 0 where broadcast) and the
 * device kernel writes a fresh contiguous result. Two floating operands of different dtypes
 * compute in the wider one (td__promote_float: bfloat16 + float32 -> float32, what autocast's
 * residual additions need): the narrower one is converted first, differentiably, so its gradient
 * comes back in its own dtype. Backward: each operand's gradient is computed at
 * the broadcast shape and summed back to the operand's shape (td__sum_to).
 */
#include <math.h>
#include <string.h>

#include "tensor_impl.h"

/* A raw (no autograd) broadcast view of t with the given shape. */
static td_status bview(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out) {
  int64_t strides[TD_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    if (i < lead) strides[i] = 0;
    else strides[i] = (t->shape[i - lead] == shape[i]) ? t->strides[i - lead] : 0;
  }
  return td__tensor_view(t, shape, strides, ndim, t->offset, out);
}

static const char *bin_name(td__binary_op op) {
  switch (op) {
    case TD__BIN_ADD: return "add";
    case TD__BIN_SUB: return "sub";
    case TD__BIN_MUL: return "mul";
    case TD__BIN_DIV: return "div";
    case TD__BIN_MAX: return "maximum";
    case TD__BIN_MIN: return "minimum";
    case TD__BIN_EQ: return "eq";
    case TD__BIN_GT: return "gt";
  }
  return "binary";
}

/* promoted converts a and b to their common floating dtype when both are floating and differ
 * (*ac, *bc: new references, or NULL when nothing was converted); conversions record history
 * when grad mode is on. */
static td_status promoted(const td_tensor *a, const td_tensor *b, td_tensor **ac,
                          td_tensor **bc) {
  *ac = *bc = NULL;
  if (!a || !b || a->dtype == b->dtype || !td_dtype_is_float(a->dtype) ||
      !td_dtype_is_float(b->dtype))
    return TD_OK;
  td_dtype dt = td__promote_float(a->dtype, b->dtype);
  td_status st = TD_OK;
  if (a->dtype != dt) st = td_tensor_to_dtype(a, dt, ac);
  if (st == TD_OK && b->dtype != dt) st = td_tensor_to_dtype(b, dt, bc);
  if (st != TD_OK) {
    td_tensor_unref(*ac);
    *ac = NULL;
  }
  return st;
}

static td_status binary_raw(td__binary_op op, const td_tensor *a, const td_tensor *b,
                            td_tensor **out);

static td_status binary_raw_promoted(td__binary_op op, const td_tensor *a, const td_tensor *b,
                                     td_tensor **out) {
  td_tensor *ac, *bc;
  bool prev = td_autograd_set_enabled(false);
  td_status st = promoted(a, b, &ac, &bc);
  td_autograd_set_enabled(prev);
  if (st == TD_OK) st = binary_raw(op, ac ? ac : a, bc ? bc : b, out);
  td_tensor_unref(ac);
  td_tensor_unref(bc);
  return st;
}

/* Computes op(a, b) into a new tensor without recording history. */
static td_status binary_raw(td__binary_op op, const td_tensor *a, const td_tensor *b,
                            td_tensor **out) {
  const char *name = bin_name(op);
  TD_CHECK_ARG(a && b && out, "%s: NULL argument", name);
  if (a->dtype != b->dtype && td_dtype_is_float(a->dtype) && td_dtype_is_float(b->dtype))
    return binary_raw_promoted(op, a, b, out);
  TD_TRY(td__check_same_device(name, a, b));
  TD_TRY(td__check_same_dtype(name, a, b));
  TD_TRY(td__check_compute(name, a));
  int64_t shape[TD_MAX_DIMS];
  int nd;
  TD_TRY(td__broadcast_shape(name, a->shape, a->ndim, b->shape, b->ndim, shape, &nd));
  td_tensor *av = NULL, *bv = NULL, *r = NULL;
  td_status st = bview(a, shape, nd, &av);
  if (st == TD_OK) st = bview(b, shape, nd, &bv);
  if (st == TD_OK) st = td__tensor_new(shape, nd, a->dtype, a->storage->device, &r);
  if (st == TD_OK) st = td__backend_of(a)->binary(op, av, bv, r);
  td_tensor_unref(av);
  td_tensor_unref(bv);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

typedef struct {
  td_node base;
  td__binary_op op;
  td_tensor *a, *b; /* saved operands (NULL when not needed) */
  int an, bn;
  int64_t ashape[TD_MAX_DIMS], bshape[TD_MAX_DIMS];
} binary_node;

static void binary_release(td_node *self) {
  binary_node *n = (binary_node *)self;
  td_tensor_unref(n->a);
  td_tensor_unref(n->b);
  n->a = n->b = NULL;
}

/* gin = sum_to(g, shape), taking ownership of g. */
static td_status reduce_into(td_tensor *g, const int64_t *shape, int nd, td_tensor **gin) {
  td_status st = td__sum_to(g, shape, nd, gin);
  td_tensor_unref(g);
  return st;
}

static td_status binary_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  binary_node *n = (binary_node *)self;
  td_tensor *g = gout[0];
  bool need_a = td__node_needs_grad(self, 0), need_b = td__node_needs_grad(self, 1);
  td_tensor *t = NULL, *u = NULL;
  switch (n->op) {
    case TD__BIN_ADD:
    case TD__BIN_SUB:
      if (need_a) TD_TRY(td__sum_to(g, n->ashape, n->an, &gin[0]));
      if (need_b) {
        if (n->op == TD__BIN_SUB) {
          TD_TRY(td_tensor_neg(g, &t));
          TD_TRY(reduce_into(t, n->bshape, n->bn, &gin[1]));
        } else {
          TD_TRY(td__sum_to(g, n->bshape, n->bn, &gin[1]));
        }
      }
      return TD_OK;
    case TD__BIN_MUL:
      if (need_a) {
        TD_TRY(td_tensor_mul(g, n->b, &t));
        TD_TRY(reduce_into(t, n->ashape, n->an, &gin[0]));
      }
      if (need_b) {
        TD_TRY(td_tensor_mul(g, n->a, &t));
        TD_TRY(reduce_into(t, n->bshape, n->bn, &gin[1]));
      }
      return TD_OK;
    case TD__BIN_DIV:
      if (need_a) {
        TD_TRY(td_tensor_div(g, n->b, &t));
        TD_TRY(reduce_into(t, n->ashape, n->an, &gin[0]));
      }
      if (need_b) {
        /* d(a/b)/db = -a / b^2 */
        td_status st = td_tensor_mul(g, n->a, &t);
        if (st == TD_OK) st = td_tensor_mul(n->b, n->b, &u);
        td_tensor *q = NULL;
        if (st == TD_OK) st = td_tensor_div(t, u, &q);
        td_tensor_unref(t);
        td_tensor_unref(u);
        t = NULL;
        if (st == TD_OK) st = td_tensor_neg(q, &t);
        td_tensor_unref(q);
        if (st != TD_OK) return st;
        TD_TRY(reduce_into(t, n->bshape, n->bn, &gin[1]));
      }
      return TD_OK;
    case TD__BIN_MAX: {
      /* gradient to the larger operand, split evenly on ties */
      td_tensor *gt = NULL, *eq = NULL, *w = NULL, *half = NULL;
      td_status st = binary_raw(TD__BIN_GT, n->a, n->b, &gt);
      if (st == TD_OK) st = binary_raw(TD__BIN_EQ, n->a, n->b, &eq);
      if (st == TD_OK) st = td_tensor_mul_scalar(eq, 0.5, &half);
      if (st == TD_OK) st = td_tensor_add(gt, half, &w); /* weight of a */
      if (st == TD_OK && need_a) {
        st = td_tensor_mul(g, w, &t);
        if (st == TD_OK) st = reduce_into(t, n->ashape, n->an, &gin[0]);
      }
      if (st == TD_OK && need_b) {
        td_tensor *wb = NULL;
        st = td_tensor_add_scalar(w, 0, &wb);
        if (st == TD_OK) st = td_tensor_mul_scalar_(wb, -1.0);
        if (st == TD_OK) st = td_tensor_add_scalar(wb, 1.0, &u);
        td_tensor_unref(wb);
        if (st == TD_OK) st = td_tensor_mul(g, u, &t);
        td_tensor_unref(u);
        if (st == TD_OK) st = reduce_into(t, n->bshape, n->bn, &gin[1]);
      }
      td_tensor_unref(gt);
      td_tensor_unref(eq);
      td_tensor_unref(half);
      td_tensor_unref(w);
      return st;
    }
    default:
      return td_set_error(TD_ERR_INTERNAL, "binary backward: unexpected op %d", (int)n->op);
  }
}

static const td__node_ops add_ops = {"AddBackward", binary_backward, binary_release, NULL};
static const td__node_ops sub_ops = {"SubBackward", binary_backward, binary_release, NULL};
static const td__node_ops mul_ops = {"MulBackward", binary_backward, binary_release, NULL};
static const td__node_ops div_ops = {"DivBackward", binary_backward, binary_release, NULL};
static const td__node_ops max_ops = {"MaximumBackward", binary_backward, binary_release, NULL};

static td_status binary_op(td__binary_op op, const td__node_ops *ops, const td_tensor *a,
                           const td_tensor *b, td_tensor **out) {
  TD_CHECK_ARG(out, "%s: NULL out", bin_name(op));
  if (a && b && a->dtype != b->dtype && td_dtype_is_float(a->dtype) &&
      td_dtype_is_float(b->dtype)) {
    td_tensor *ac, *bc;
    td_status st = promoted(a, b, &ac, &bc);
    if (st == TD_OK) st = binary_op(op, ops, ac ? ac : a, bc ? bc : b, out);
    td_tensor_unref(ac);
    td_tensor_unref(bc);
    return st;
  }
  td_tensor *r = NULL;
  TD_TRY(binary_raw(op, a, b, &r));
  if (td__needs_grad2(a, b)) {
    if (a->dtype == TD_DTYPE_I64) {
      td_tensor_unref(r);
      return td_set_error(TD_ERR_DTYPE, "%s: int64 tensors cannot require grad", bin_name(op));
    }
    td_status st = TD_OK;
    const td_tensor *ins[2] = {a, b};
    binary_node *n = (binary_node *)td__record(r, sizeof(binary_node), ops, ins, 2, &st);
    if (st != TD_OK) {
      td_tensor_unref(r);
      return st;
    }
    n->op = op;
    n->an = a->ndim;
    n->bn = b->ndim;
    memcpy(n->ashape, a->shape, sizeof n->ashape);
    memcpy(n->bshape, b->shape, sizeof n->bshape);
    bool save_a = op == TD__BIN_MAX || (op == TD__BIN_MUL && td__node_needs_grad(&n->base, 1)) ||
                  (op == TD__BIN_DIV && td__node_needs_grad(&n->base, 1));
    bool save_b = op == TD__BIN_MAX || op == TD__BIN_DIV ||
                  (op == TD__BIN_MUL && td__node_needs_grad(&n->base, 0));
    if (save_a) st = td_tensor_detach(a, &n->a);
    if (st == TD_OK && save_b) st = td_tensor_detach(b, &n->b);
    if (st != TD_OK) {
      td_tensor_unref(r);
      return st;
    }
  }
  *out = r;
  return TD_OK;
}

td_status td_tensor_add(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_op(TD__BIN_ADD, &add_ops, a, b, out);
}
td_status td_tensor_sub(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_op(TD__BIN_SUB, &sub_ops, a, b, out);
}
td_status td_tensor_mul(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_op(TD__BIN_MUL, &mul_ops, a, b, out);
}
td_status td_tensor_div(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_op(TD__BIN_DIV, &div_ops, a, b, out);
}
td_status td_tensor_maximum(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_op(TD__BIN_MAX, &max_ops, a, b, out);
}

/* ---- in-place updates ---- */

/* other broadcast to t's shape (raw view), after device/dtype checks. */
static td_status inplace_operand(const char *name, const td_tensor *t, const td_tensor *other,
                                 td_tensor **out) {
  TD_CHECK_ARG(t && other, "%s: NULL tensor", name);
  TD_TRY(td__check_same_device(name, t, other));
  TD_TRY(td__check_same_dtype(name, t, other));
  TD_TRY(td__check_compute(name, t));
  int64_t shape[TD_MAX_DIMS];
  int nd;
  TD_TRY(td__broadcast_shape(name, t->shape, t->ndim, other->shape, other->ndim, shape, &nd));
  if (nd != t->ndim || memcmp(shape, t->shape, (size_t)nd * sizeof(int64_t)) != 0) {
    char a[128], b[128];
    return td_set_error(TD_ERR_SHAPE, "%s: operand %s does not broadcast to the target %s", name,
                        td_tensor_shape_str(other, a, sizeof a), td_tensor_shape_str(t, b, sizeof b));
  }
  return bview(other, t->shape, t->ndim, out);
}

td_status td_tensor_mul_scalar_(td_tensor *t, double s) {
  TD_CHECK_ARG(t, "tensor_mul_scalar_: NULL tensor");
  TD_TRY(td__check_compute("tensor_mul_scalar_", t));
  return td__backend_of(t)->unary(TD__UN_AFFINE, t, t, s, 0.0);
}

td_status td_tensor_add_(td_tensor *t, const td_tensor *other, double alpha) {
  td_tensor *o;
  TD_TRY(inplace_operand("tensor_add_", t, other, &o));
  const td__backend *be = td__backend_of(t);
  td_status st;
  if (be->axpy && td_tensor_data(o) != td_tensor_data(t)) {
    st = be->axpy(t, alpha, o);
  } else if (alpha == 1.0) {
    st = be->binary(TD__BIN_ADD, t, o, t);
  } else {
    td_tensor *tmp = NULL;
    st = td__tensor_new_like(t, &tmp);
    if (st == TD_OK) st = be->unary(TD__UN_AFFINE, o, tmp, alpha, 0.0);
    if (st == TD_OK) st = be->binary(TD__BIN_ADD, t, tmp, t);
    td_tensor_unref(tmp);
  }
  td_tensor_unref(o);
  return st;
}

static td_status addc(const char *name, td__binary_op op, td_tensor *t, const td_tensor *a,
                      const td_tensor *b, double value) {
  td_tensor *av = NULL, *bv = NULL, *tmp = NULL;
  td_status st = inplace_operand(name, t, a, &av);
  if (st == TD_OK) st = inplace_operand(name, t, b, &bv);
  if (st == TD_OK) st = td__tensor_new_like(t, &tmp);
  const td__backend *be = t ? td__backend_of(t) : NULL;
  if (st == TD_OK) st = be->binary(op, av, bv, tmp);
  if (st == TD_OK && value != 1.0) st = be->unary(TD__UN_AFFINE, tmp, tmp, value, 0.0);
  if (st == TD_OK) st = be->binary(TD__BIN_ADD, t, tmp, t);
  td_tensor_unref(av);
  td_tensor_unref(bv);
  td_tensor_unref(tmp);
  return st;
}

td_status td_tensor_addcmul_(td_tensor *t, const td_tensor *a, const td_tensor *b, double value) {
  return addc("tensor_addcmul_", TD__BIN_MUL, t, a, b, value);
}

td_status td_tensor_addcdiv_(td_tensor *t, const td_tensor *a, const td_tensor *b, double value) {
  return addc("tensor_addcdiv_", TD__BIN_DIV, t, a, b, value);
}

td_status td_tensor_maximum_(td_tensor *t, const td_tensor *other) {
  td_tensor *o;
  TD_TRY(inplace_operand("tensor_maximum_", t, other, &o));
  td_status st = td__backend_of(t)->binary(TD__BIN_MAX, t, o, t);
  td_tensor_unref(o);
  return st;
}

/* Used by ops_reduce.c for max backward and by tests: raw comparisons. */
td_status td__binary_raw(int op, const td_tensor *a, const td_tensor *b, td_tensor **out) {
  return binary_raw((td__binary_op)op, a, b, out);
}

/* ---- fused Adam step ---- */

/* adam_check validates one (param, grad, exp_avg, exp_avg_sq) set for the fused kernels. */
static td_status adam_check(const char *op, const td_tensor *param, const td_tensor *grad,
                            const td_tensor *exp_avg, const td_tensor *exp_avg_sq,
                            const td_adam_args *a) {
  TD_CHECK_ARG(param && grad && exp_avg && exp_avg_sq && a, "%s: NULL argument", op);
  TD_CHECK_ARG(a->step >= 1, "%s: step %lld must be >= 1", op, (long long)a->step);
  TD_TRY(td__check_float(op, param));
  const td_tensor *ops[3] = {grad, exp_avg, exp_avg_sq};
  for (int i = 0; i < 3; i++) {
    TD_TRY(td__check_same_dtype(op, param, ops[i]));
    TD_TRY(td__check_same_device(op, param, ops[i]));
    if (!td_tensor_same_shape(param, ops[i])) {
      char x[96], y[96];
      return td_set_error(TD_ERR_SHAPE, "%s: operand %s for parameter %s", op,
                          td_tensor_shape_str(ops[i], x, sizeof x),
                          td_tensor_shape_str(param, y, sizeof y));
    }
  }
  return TD_OK;
}

static bool adam_contiguous(const td_tensor *p, const td_tensor *g, const td_tensor *m,
                            const td_tensor *v) {
  return td_tensor_is_contiguous(p) && td_tensor_is_contiguous(g) && td_tensor_is_contiguous(m) &&
         td_tensor_is_contiguous(v);
}

static td__adam_consts adam_consts(const td_adam_args *a) {
  double step = (double)a->step;
  td__adam_consts c = {
      .beta1 = a->beta1,
      .beta2 = a->beta2,
      .eps = a->eps,
      .l2 = a->decoupled ? 0.0 : a->weight_decay,
      .decay = a->decoupled ? 1.0 - a->lr * a->weight_decay : 1.0,
      .step_size = a->lr / (1.0 - pow(a->beta1, step)),
      .bc2_sqrt = sqrt(1.0 - pow(a->beta2, step)),
      .maximize = a->maximize,
  };
  return c;
}

td_status td_tensor_adam_(td_tensor *param, const td_tensor *grad, td_tensor *exp_avg,
                          td_tensor *exp_avg_sq, const td_adam_args *a) {
  TD_TRY(adam_check("tensor_adam_", param, grad, exp_avg, exp_avg_sq, a));
  const td__backend *be = td__backend_of(param);
  TD__NEED_KERNEL(be, adam, "tensor_adam_");
  if (!adam_contiguous(param, grad, exp_avg, exp_avg_sq))
    return td_set_error(TD_ERR_UNSUPPORTED, "tensor_adam_: the fused kernel needs contiguous "
                        "operands");
  td__adam_consts c = adam_consts(a);
  return be->adam(param, grad, exp_avg, exp_avg_sq, &c);
}

td_status td_tensor_adam_multi_(td_tensor *const *params, const td_tensor *const *grads,
                                td_tensor *const *exp_avgs, td_tensor *const *exp_avg_sqs,
                                const td_adam_args *args, size_t n) {
  const char *op = "tensor_adam_multi_";
  TD_CHECK_ARG((params && grads && exp_avgs && exp_avg_sqs && args) || n == 0,
               "%s: NULL array", op);
  if (n == 0) return TD_OK;
  TD_CHECK_ARG(n <= INT32_MAX, "%s: %zu parameters is too many", op, n);
  for (size_t i = 0; i < n; i++)
    TD_TRY(adam_check(op, params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], &args[i]));
  for (size_t i = 1; i < n; i++)
    if (!td_device_equal(params[i]->storage->device, params[0]->storage->device))
      return td_set_error(TD_ERR_UNSUPPORTED, "%s: parameters on more than one device (0 and "
                          "%zu)", op, i);
  const td__backend *be = td__backend_of(params[0]);
  TD__NEED_KERNEL(be, adam, op);
  bool one_dtype = true;
  for (size_t i = 0; i < n; i++) {
    if (!adam_contiguous(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]))
      return td_set_error(TD_ERR_UNSUPPORTED, "%s: the fused kernel needs contiguous operands "
                          "(parameter %zu is not)", op, i);
    one_dtype = one_dtype && params[i]->dtype == params[0]->dtype;
  }
  td__adam_consts *c = td__malloc(n * sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", op);
  for (size_t i = 0; i < n; i++) c[i] = adam_consts(&args[i]);
  td_status st = TD_OK;
  if (be->adam_multi && one_dtype) {
    st = be->adam_multi(params, grads, exp_avgs, exp_avg_sqs, c, (int)n);
  } else {
    for (size_t i = 0; i < n && st == TD_OK; i++)
      st = be->adam(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], &c[i]);
  }
  td__free(c);
  return st;
}

td_status td_tensor_sum_squares(const td_tensor *const *ts, size_t n, double *out) {
  const char *op = "tensor_sum_squares";
  TD_CHECK_ARG((ts || n == 0) && out, "%s: NULL argument", op);
  const td_tensor *first = NULL;
  size_t m = 0;
  bool one_dev = true;
  for (size_t i = 0; i < n; i++) {
    if (!ts[i]) continue;
    TD_TRY(td__check_float(op, ts[i]));
    if (!first) first = ts[i];
    one_dev = one_dev && td_device_equal(first->storage->device, ts[i]->storage->device);
    m++;
  }
  *out = 0.0;
  if (!first) return TD_OK;
  TD_CHECK_ARG(m <= INT32_MAX, "%s: %zu tensors is too many", op, m);
  const td__backend *be = td__backend_of(first);
  if (be->sum_squares && one_dev) {
    const td_tensor **list = td__malloc(m * sizeof *list);
    if (!list) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", op);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
      if (ts[i]) list[k++] = ts[i];
    td_status st = be->sum_squares(list, (int)m, out);
    td__free(list);
    return st;
  }
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  double acc = 0.0;
  for (size_t i = 0; i < n && st == TD_OK; i++) {
    if (!ts[i] || td_tensor_numel(ts[i]) == 0) continue;
    td_tensor *sq = NULL, *s = NULL;
    double v = 0.0;
    st = td_tensor_mul(ts[i], ts[i], &sq);
    if (st == TD_OK) st = td_tensor_sum_all(sq, &s);
    if (st == TD_OK) st = td_tensor_item(s, &v);
    acc += v;
    td_tensor_unref(sq);
    td_tensor_unref(s);
  }
  td_autograd_set_enabled(prev);
  if (st == TD_OK) *out = acc;
  return st;
}
