/* ops_unary.c - elementwise unary ops (affine forms of the scalar ops, pow, exp, log, sqrt, tanh,
 * sigmoid, relu, gelu) and their backward through the device's unary_backward kernel.
 *
 * The node saves detached views of the input and/or the output (whichever the derivative uses):
 * saving the output itself would make a reference cycle output -> node -> output.
 */
#include "tensor_impl.h"

typedef struct {
  td_node base;
  td__unary_op op;
  double p0, p1;
  td_tensor *x, *y; /* detached; NULL when the derivative does not use it */
} unary_node;

static void unary_release(td_node *self) {
  unary_node *n = (unary_node *)self;
  td_tensor_unref(n->x);
  td_tensor_unref(n->y);
  n->x = n->y = NULL;
}

static td_status unary_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  unary_node *n = (unary_node *)self;
  td_tensor *g = NULL, *gx = NULL;
  TD_TRY(td_tensor_contiguous(gout[0], &g));
  td_status st = td__tensor_new_like(g, &gx);
  td_tensor *x = NULL, *y = NULL;
  if (st == TD_OK && n->x) st = td_tensor_contiguous(n->x, &x);
  if (st == TD_OK && n->y) st = td_tensor_contiguous(n->y, &y);
  if (st == TD_OK) st = td__backend_of(g)->unary_backward(n->op, x, y, g, gx, n->p0, n->p1);
  td_tensor_unref(g);
  td_tensor_unref(x);
  td_tensor_unref(y);
  if (st != TD_OK) {
    td_tensor_unref(gx);
    return st;
  }
  gin[0] = gx;
  return TD_OK;
}

static const td__node_ops affine_ops = {"AffineBackward", unary_backward, unary_release, NULL};
static const td__node_ops pow_ops = {"PowBackward", unary_backward, unary_release, NULL};
static const td__node_ops exp_ops = {"ExpBackward", unary_backward, unary_release, NULL};
static const td__node_ops log_ops = {"LogBackward", unary_backward, unary_release, NULL};
static const td__node_ops sqrt_ops = {"SqrtBackward", unary_backward, unary_release, NULL};
static const td__node_ops tanh_ops = {"TanhBackward", unary_backward, unary_release, NULL};
static const td__node_ops sigmoid_ops = {"SigmoidBackward", unary_backward, unary_release, NULL};
static const td__node_ops relu_ops = {"ReluBackward", unary_backward, unary_release, NULL};
static const td__node_ops gelu_ops = {"GeluBackward", unary_backward, unary_release, NULL};

typedef struct {
  const char *name;
  const td__node_ops *ops;
  bool save_x, save_y;
} unary_info;

static const unary_info infos[] = {
    [TD__UN_AFFINE] = {"affine", &affine_ops, false, false},
    [TD__UN_POW] = {"pow", &pow_ops, true, false},
    [TD__UN_EXP] = {"exp", &exp_ops, false, true},
    [TD__UN_LOG] = {"log", &log_ops, true, false},
    [TD__UN_SQRT] = {"sqrt", &sqrt_ops, false, true},
    [TD__UN_TANH] = {"tanh", &tanh_ops, false, true},
    [TD__UN_SIGMOID] = {"sigmoid", &sigmoid_ops, false, true},
    [TD__UN_RELU] = {"relu", &relu_ops, true, false},
    [TD__UN_GELU] = {"gelu", &gelu_ops, true, false},
    [TD__UN_ABS] = {"abs", NULL, true, false},
};

static td_status unary_op(td__unary_op op, const td_tensor *x, double p0, double p1,
                          td_tensor **out) {
  const unary_info *info = &infos[op];
  TD_CHECK_ARG(x && out, "%s: NULL argument", info->name);
  if (op != TD__UN_AFFINE) TD_TRY(td__check_float(info->name, x));
  else TD_TRY(td__check_compute(info->name, x));
  td_tensor *y;
  TD_TRY(td__tensor_new_like(x, &y));
  td_status st = td__backend_of(x)->unary(op, x, y, p0, p1);
  if (st == TD_OK && td__needs_grad(x)) {
    const td_tensor *ins[1] = {x};
    unary_node *n = (unary_node *)td__record(y, sizeof(unary_node), info->ops, ins, 1, &st);
    if (n) {
      n->op = op;
      n->p0 = p0;
      n->p1 = p1;
      if (info->save_x) st = td_tensor_detach(x, &n->x);
      if (st == TD_OK && info->save_y) st = td_tensor_detach(y, &n->y);
    }
  }
  if (st != TD_OK) {
    td_tensor_unref(y);
    return st;
  }
  *out = y;
  return TD_OK;
}

td_status td_tensor_add_scalar(const td_tensor *a, double s, td_tensor **out) {
  return unary_op(TD__UN_AFFINE, a, 1.0, s, out);
}
td_status td_tensor_mul_scalar(const td_tensor *a, double s, td_tensor **out) {
  return unary_op(TD__UN_AFFINE, a, s, 0.0, out);
}
td_status td_tensor_neg(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_AFFINE, a, -1.0, 0.0, out);
}
td_status td_tensor_pow_scalar(const td_tensor *a, double p, td_tensor **out) {
  return unary_op(TD__UN_POW, a, p, 0.0, out);
}
td_status td_tensor_exp(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_EXP, a, 0, 0, out);
}
td_status td_tensor_log(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_LOG, a, 0, 0, out);
}
td_status td_tensor_sqrt(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_SQRT, a, 0, 0, out);
}
td_status td_tensor_tanh(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_TANH, a, 0, 0, out);
}
td_status td_tensor_sigmoid(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_SIGMOID, a, 0, 0, out);
}
td_status td_tensor_relu(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_RELU, a, 0, 0, out);
}
td_status td_tensor_gelu(const td_tensor *a, td_tensor **out) {
  return unary_op(TD__UN_GELU, a, 0, 0, out);
}
