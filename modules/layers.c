/* layers.c - the stateless-forward built-in modules: Linear, Conv2d, MaxPool2d, ReLU, Tanh,
 * Sigmoid, GELU, Dropout, Embedding, LayerNorm, Flatten and Sequential.
 *
 * Each module is a td_module_type (static) plus a small configuration struct as the module's
 * state. Forward functions read the parameters by registration index (td__module_param_at), so
 * they see the current tensors after td_module_to()/td_module_to_dtype() replaced them. Every
 * forward checks the input (NULL, rank, size, dtype, device) itself and names the module in the
 * error, before calling the differentiable tensor op.
 *
 * Lock order: a Dropout's mu guards its generator and is held only around td_tensor_dropout,
 * which takes no lock but the tensor layer's leaf locks (the CPU allocator's cache).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "modules_impl.h"

/* ---- shared helpers ---- */

static void free_state(void *state) { td__free(state); }

/* make_module creates a module of type owning a zeroed state of size bytes (*state points at it). */
static td_status make_module(const td_module_type *type, size_t size, void **state,
                             td_module **out) {
  void *s = NULL;
  if (size) {
    s = td__calloc(1, size);
    if (!s) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", type->name);
  }
  td_status st = td_module_create(type, s, out);
  if (st != TD_OK) {
    td__free(s);
    return st;
  }
  if (state) *state = s;
  return TD_OK;
}

/* one_in_one_out checks the forward arity of single-tensor modules. */
static td_status one_in_one_out(const char *name, td_tensor *const *in, int n_in, int n_out) {
  TD_CHECK_ARG(n_in == 1 && n_out == 1, "%s.forward takes 1 input and 1 output (got %d, %d)",
               name, n_in, n_out);
  TD_CHECK_ARG(in[0], "%s.forward: NULL input tensor", name);
  return TD_OK;
}

/* add_param creates a float32 parameter of shape, fills it with U(-bound, bound) (kaiming when
 * kaiming_a >= 0) and registers it. */
static td_status add_uniform_param(td_module *m, const char *name, const int64_t *shape, int ndim,
                                   double kaiming_a, double bound, td_generator *g) {
  td_tensor *t = NULL;
  td_status st = td__nn_new_param(shape, ndim, &t);
  if (st != TD_OK) return st;
  if (kaiming_a >= 0) st = td_nn_init_kaiming_uniform_(t, kaiming_a, g);
  else st = td_nn_init_uniform_(t, -bound, bound, g);
  if (st == TD_OK) st = td_module_register_parameter(m, name, t);
  td_tensor_unref(t);
  return st;
}

static td_status add_filled_param(td_module *m, const char *name, const int64_t *shape, int ndim,
                                  double value) {
  td_tensor *t = NULL;
  td_status st = td__nn_new_param(shape, ndim, &t);
  if (st != TD_OK) return st;
  st = td_tensor_fill_(t, value);
  if (st == TD_OK) st = td_module_register_parameter(m, name, t);
  td_tensor_unref(t);
  return st;
}

/* ---- Linear ---- */

typedef struct linear_state {
  int64_t in, out;
  bool bias;
} linear_state;

static td_status linear_forward(td_module *self, td_tensor *const *in, int n_in,
                                td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Linear", in, n_in, n_out));
  const linear_state *s = td_module_state(self);
  td_tensor *x = in[0], *w = td__module_param_at(self, 0);
  td_tensor *b = s->bias ? td__module_param_at(self, 1) : NULL;
  TD_TRY(td__nn_check_input("Linear", x, w));
  int nd = td_tensor_ndim(x);
  if (nd < 1 || td_tensor_size(x, -1) != s->in) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "Linear(%lld, %lld).forward: input %s, expected [..., %lld]",
                        (long long)s->in, (long long)s->out,
                        td_tensor_shape_str(x, buf, sizeof buf), (long long)s->in);
  }
  return td_tensor_linear(x, w, b, out);
}

static const td_module_type linear_type = {"Linear", linear_forward, free_state};

td_status td_linear_create(int64_t in_features, int64_t out_features, bool bias, td_generator *g,
                           td_module **out) {
  TD_CHECK_ARG(out, "td_linear_create: NULL out");
  TD_CHECK_ARG(in_features >= 0 && out_features >= 0,
               "td_linear_create: negative size (%lld, %lld)", (long long)in_features,
               (long long)out_features);
  linear_state *s = NULL;
  td_module *m = NULL;
  TD_TRY(make_module(&linear_type, sizeof *s, (void **)&s, &m));
  s->in = in_features;
  s->out = out_features;
  s->bias = bias;
  int64_t wshape[2] = {out_features, in_features};
  td_status st = add_uniform_param(m, "weight", wshape, 2, sqrt(5.0), 0, g);
  if (st == TD_OK && bias) {
    double bound = in_features > 0 ? 1.0 / sqrt((double)in_features) : 0.0;
    st = add_uniform_param(m, "bias", &out_features, 1, -1, bound, g);
  }
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- Conv2d ---- */

typedef struct conv2d_state {
  int64_t in, out;
  td_conv2d_opts o;
} conv2d_state;

void td_conv2d_opts_init(td_conv2d_opts *o, int kernel_size) {
  if (!o) return;
  o->kernel_h = o->kernel_w = kernel_size;
  o->stride_h = o->stride_w = 1;
  o->pad_h = o->pad_w = 0;
  o->bias = true;
}

/* as_batched makes a 3-d [C, H, W] input 4-d; *unbatched tells the caller to squeeze back. */
static td_status as_batched(const char *name, const td_tensor *x, td_tensor **x4,
                            bool *unbatched) {
  int nd = td_tensor_ndim(x);
  if (nd == 4) {
    *x4 = td_tensor_ref((td_tensor *)x);
    *unbatched = false;
    return TD_OK;
  }
  if (nd == 3) {
    *unbatched = true;
    return td_tensor_unsqueeze(x, 0, x4);
  }
  char buf[96];
  return td_set_error(TD_ERR_SHAPE, "%s.forward: input %s, expected [N, C, H, W] or [C, H, W]",
                      name, td_tensor_shape_str(x, buf, sizeof buf));
}

/* finish_batched squeezes dim 0 of y when the input was unbatched; takes y's reference. */
static td_status finish_batched(td_tensor *y, bool unbatched, td_tensor **out) {
  if (!unbatched) {
    *out = y;
    return TD_OK;
  }
  td_status st = td_tensor_squeeze(y, 0, out);
  td_tensor_unref(y);
  return st;
}

static td_status conv2d_forward(td_module *self, td_tensor *const *in, int n_in,
                                td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Conv2d", in, n_in, n_out));
  const conv2d_state *s = td_module_state(self);
  td_tensor *w = td__module_param_at(self, 0);
  td_tensor *b = s->o.bias ? td__module_param_at(self, 1) : NULL;
  TD_TRY(td__nn_check_input("Conv2d", in[0], w));
  td_tensor *x = NULL, *y = NULL;
  bool unbatched = false;
  TD_TRY(as_batched("Conv2d", in[0], &x, &unbatched));
  td_status st = TD_OK;
  const int64_t *sh = td_tensor_shape(x);
  char buf[96];
  if (sh[1] != s->in) {
    st = td_set_error(TD_ERR_SHAPE, "Conv2d(%lld, %lld).forward: input %s has %lld channels, "
                      "expected %lld", (long long)s->in, (long long)s->out,
                      td_tensor_shape_str(in[0], buf, sizeof buf), (long long)sh[1],
                      (long long)s->in);
  } else if (sh[2] + 2 * s->o.pad_h < s->o.kernel_h || sh[3] + 2 * s->o.pad_w < s->o.kernel_w) {
    st = td_set_error(TD_ERR_SHAPE, "Conv2d.forward: input %s (padded by %d, %d) is smaller than "
                      "the %dx%d kernel", td_tensor_shape_str(in[0], buf, sizeof buf),
                      s->o.pad_h, s->o.pad_w, s->o.kernel_h, s->o.kernel_w);
  } else {
    st = td_tensor_conv2d(x, w, b, s->o.stride_h, s->o.stride_w, s->o.pad_h, s->o.pad_w, &y);
  }
  td_tensor_unref(x);
  if (st != TD_OK) return st;
  return finish_batched(y, unbatched, out);
}

static const td_module_type conv2d_type = {"Conv2d", conv2d_forward, free_state};

td_status td_conv2d_create(int64_t in_channels, int64_t out_channels, const td_conv2d_opts *opts,
                           td_generator *g, td_module **out) {
  TD_CHECK_ARG(out && opts, "td_conv2d_create: NULL opts or out");
  TD_CHECK_ARG(in_channels > 0 && out_channels > 0, "td_conv2d_create: channels must be > 0 "
               "(%lld, %lld)", (long long)in_channels, (long long)out_channels);
  TD_CHECK_ARG(opts->kernel_h > 0 && opts->kernel_w > 0 && opts->stride_h > 0 &&
                   opts->stride_w > 0 && opts->pad_h >= 0 && opts->pad_w >= 0,
               "td_conv2d_create: kernel %dx%d, stride %dx%d, padding %dx%d: kernel and stride "
               "must be > 0, padding >= 0", opts->kernel_h, opts->kernel_w, opts->stride_h,
               opts->stride_w, opts->pad_h, opts->pad_w);
  conv2d_state *s = NULL;
  td_module *m = NULL;
  TD_TRY(make_module(&conv2d_type, sizeof *s, (void **)&s, &m));
  s->in = in_channels;
  s->out = out_channels;
  s->o = *opts;
  int64_t wshape[4] = {out_channels, in_channels, opts->kernel_h, opts->kernel_w};
  td_status st = add_uniform_param(m, "weight", wshape, 4, sqrt(5.0), 0, g);
  if (st == TD_OK && opts->bias) {
    double fan_in = (double)(in_channels * opts->kernel_h * opts->kernel_w);
    st = add_uniform_param(m, "bias", &out_channels, 1, -1, 1.0 / sqrt(fan_in), g);
  }
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- MaxPool2d ---- */

typedef struct pool_state {
  int kh, kw, sh, sw;
} pool_state;

static td_status pool_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  TD_TRY(one_in_one_out("MaxPool2d", in, n_in, n_out));
  const pool_state *s = td_module_state(self);
  td_tensor *x = NULL, *y = NULL;
  bool unbatched = false;
  TD_TRY(as_batched("MaxPool2d", in[0], &x, &unbatched));
  td_status st;
  const int64_t *sh = td_tensor_shape(x);
  if (sh[2] < s->kh || sh[3] < s->kw) {
    char buf[96];
    st = td_set_error(TD_ERR_SHAPE, "MaxPool2d.forward: input %s is smaller than the %dx%d "
                      "window", td_tensor_shape_str(in[0], buf, sizeof buf), s->kh, s->kw);
  } else {
    st = td_tensor_max_pool2d(x, s->kh, s->kw, s->sh, s->sw, &y);
  }
  td_tensor_unref(x);
  if (st != TD_OK) return st;
  return finish_batched(y, unbatched, out);
}

static const td_module_type pool_type = {"MaxPool2d", pool_forward, free_state};

td_status td_max_pool2d_create(int kernel_h, int kernel_w, int stride_h, int stride_w,
                               td_module **out) {
  TD_CHECK_ARG(out, "td_max_pool2d_create: NULL out");
  TD_CHECK_ARG(kernel_h > 0 && kernel_w > 0 && stride_h >= 0 && stride_w >= 0,
               "td_max_pool2d_create: kernel %dx%d must be > 0 and stride %dx%d >= 0", kernel_h,
               kernel_w, stride_h, stride_w);
  pool_state *s = NULL;
  TD_TRY(make_module(&pool_type, sizeof *s, (void **)&s, out));
  s->kh = kernel_h;
  s->kw = kernel_w;
  s->sh = stride_h ? stride_h : kernel_h;
  s->sw = stride_w ? stride_w : kernel_w;
  return TD_OK;
}

/* ---- activations ---- */

typedef td_status (*unary_op)(const td_tensor *x, td_tensor **out);

static td_status activation(const char *name, unary_op op, td_tensor *const *in, int n_in,
                            td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out(name, in, n_in, n_out));
  if (td_tensor_dtype(in[0]) == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s.forward: input must be float32 or float64, not int64",
                        name);
  return op(in[0], out);
}

#define TD_ACTIVATION(fn_name, type_name, op)                                               \
  static td_status fn_name##_forward(td_module *self, td_tensor *const *in, int n_in,       \
                                     td_tensor **out, int n_out) {                          \
    (void)self;                                                                             \
    return activation(type_name, op, in, n_in, out, n_out);                                 \
  }                                                                                         \
  static const td_module_type fn_name##_type = {type_name, fn_name##_forward, NULL};       \
  td_status td_##fn_name##_create(td_module **out) {                                        \
    TD_CHECK_ARG(out, "td_" #fn_name "_create: NULL out");                                  \
    return make_module(&fn_name##_type, 0, NULL, out);                                      \
  }

TD_ACTIVATION(relu, "ReLU", td_tensor_relu)
TD_ACTIVATION(tanh, "Tanh", td_tensor_tanh)
TD_ACTIVATION(sigmoid, "Sigmoid", td_tensor_sigmoid)
TD_ACTIVATION(gelu, "GELU", td_tensor_gelu)

/* ---- Dropout ---- */

typedef struct dropout_state {
  double p;
  pthread_mutex_t mu; /* serialises use of gen */
  td_generator *gen;
} dropout_state;

static void dropout_destroy(void *state) {
  dropout_state *s = state;
  td_generator_destroy(s->gen);
  pthread_mutex_destroy(&s->mu);
  td__free(s);
}

static td_status dropout_forward(td_module *self, td_tensor *const *in, int n_in,
                                 td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Dropout", in, n_in, n_out));
  dropout_state *s = td_module_state(self);
  if (td_tensor_dtype(in[0]) == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "Dropout.forward: input must be float32 or float64");
  if (!td_module_is_training(self) || s->p == 0) {
    *out = td_tensor_ref(in[0]);
    return TD_OK;
  }
  pthread_mutex_lock(&s->mu);
  td_status st = td_tensor_dropout(in[0], s->p, true, s->gen, out);
  pthread_mutex_unlock(&s->mu);
  return st;
}

static const td_module_type dropout_type = {"Dropout", dropout_forward, dropout_destroy};

td_status td_dropout_create(double p, td_generator *g, td_module **out) {
  TD_CHECK_ARG(out, "td_dropout_create: NULL out");
  TD_CHECK_ARG(p >= 0 && p <= 1, "td_dropout_create: p = %g must be in [0, 1]", p);
  dropout_state *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "td_dropout_create: out of memory");
  s->p = p;
  pthread_mutex_init(&s->mu, NULL);
  td_generator *src = td__nn_gen_acquire(g);
  uint64_t seed = src ? td_generator_next_u64(src) : 0;
  td__nn_gen_release(g);
  td_status st = src ? td_generator_create(seed, &s->gen)
                     : td_set_error(TD_ERR_NOMEM, "td_dropout_create: no generator");
  if (st == TD_OK) st = td_module_create(&dropout_type, s, out);
  if (st != TD_OK) dropout_destroy(s);
  return st;
}

/* ---- Embedding ---- */

typedef struct embedding_state {
  int64_t num, dim;
} embedding_state;

static td_status embedding_forward(td_module *self, td_tensor *const *in, int n_in,
                                   td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Embedding", in, n_in, n_out));
  td_tensor *w = td__module_param_at(self, 0);
  if (td_tensor_dtype(in[0]) != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "Embedding.forward: indices must be int64, not %s",
                        td_dtype_name(td_tensor_dtype(in[0])));
  if (!td_device_equal(td_tensor_device(in[0]), td_tensor_device(w)))
    return td_set_error(TD_ERR_DEVICE, "Embedding.forward: indices and weight are on different "
                        "devices");
  return td_tensor_embedding(w, in[0], out);
}

static const td_module_type embedding_type = {"Embedding", embedding_forward, free_state};

td_status td_embedding_create(int64_t num_embeddings, int64_t embedding_dim, td_generator *g,
                              td_module **out) {
  TD_CHECK_ARG(out, "td_embedding_create: NULL out");
  TD_CHECK_ARG(num_embeddings > 0 && embedding_dim > 0,
               "td_embedding_create: sizes must be > 0 (%lld, %lld)", (long long)num_embeddings,
               (long long)embedding_dim);
  embedding_state *s = NULL;
  td_module *m = NULL;
  TD_TRY(make_module(&embedding_type, sizeof *s, (void **)&s, &m));
  s->num = num_embeddings;
  s->dim = embedding_dim;
  int64_t shape[2] = {num_embeddings, embedding_dim};
  td_tensor *w = NULL;
  td_status st = td__nn_new_param(shape, 2, &w);
  if (st == TD_OK) st = td_nn_init_normal_(w, 0.0, 1.0, g);
  if (st == TD_OK) st = td_module_register_parameter(m, "weight", w);
  td_tensor_unref(w);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- LayerNorm ---- */

typedef struct layer_norm_state {
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  double eps;
  bool affine;
} layer_norm_state;

static td_status layer_norm_forward(td_module *self, td_tensor *const *in, int n_in,
                                    td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("LayerNorm", in, n_in, n_out));
  const layer_norm_state *s = td_module_state(self);
  td_tensor *w = s->affine ? td__module_param_at(self, 0) : NULL;
  td_tensor *b = s->affine ? td__module_param_at(self, 1) : NULL;
  td_tensor *x = in[0];
  if (td_tensor_dtype(x) == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "LayerNorm.forward: input must be float32 or float64");
  TD_TRY(td__nn_check_input("LayerNorm", x, w));
  int nd = td_tensor_ndim(x);
  bool ok = nd >= s->ndim;
  for (int i = 0; ok && i < s->ndim; i++)
    ok = td_tensor_shape(x)[nd - s->ndim + i] == s->shape[i];
  if (!ok) {
    char a[96], b2[96];
    return td_set_error(TD_ERR_SHAPE, "LayerNorm.forward: input %s does not end with the "
                        "normalized shape %s", td_tensor_shape_str(x, a, sizeof a),
                        td__nn_shape_str(s->shape, s->ndim, b2, sizeof b2));
  }
  return td_tensor_layer_norm(x, s->ndim, w, b, s->eps, out);
}

static const td_module_type layer_norm_type = {"LayerNorm", layer_norm_forward, free_state};

td_status td_layer_norm_create(const int64_t *normalized_shape, int ndim, double eps,
                               bool elementwise_affine, td_module **out) {
  TD_CHECK_ARG(out && normalized_shape, "td_layer_norm_create: NULL shape or out");
  TD_CHECK_ARG(ndim >= 1 && ndim <= TD_MAX_DIMS, "td_layer_norm_create: ndim %d not in [1, %d]",
               ndim, TD_MAX_DIMS);
  TD_CHECK_ARG(eps >= 0, "td_layer_norm_create: negative eps %g", eps);
  for (int i = 0; i < ndim; i++)
    TD_CHECK_ARG(normalized_shape[i] > 0, "td_layer_norm_create: normalized_shape[%d] = %lld "
                 "must be > 0", i, (long long)normalized_shape[i]);
  layer_norm_state *s = NULL;
  td_module *m = NULL;
  TD_TRY(make_module(&layer_norm_type, sizeof *s, (void **)&s, &m));
  s->ndim = ndim;
  memcpy(s->shape, normalized_shape, (size_t)ndim * sizeof *normalized_shape);
  s->eps = eps;
  s->affine = elementwise_affine;
  td_status st = TD_OK;
  if (elementwise_affine) {
    st = add_filled_param(m, "weight", normalized_shape, ndim, 1.0);
    if (st == TD_OK) st = add_filled_param(m, "bias", normalized_shape, ndim, 0.0);
  }
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- Flatten ---- */

typedef struct flatten_state {
  int start, end;
} flatten_state;

static td_status flatten_forward(td_module *self, td_tensor *const *in, int n_in,
                                 td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Flatten", in, n_in, n_out));
  const flatten_state *s = td_module_state(self);
  return td_tensor_flatten(in[0], s->start, s->end, out);
}

static const td_module_type flatten_type = {"Flatten", flatten_forward, free_state};

td_status td_flatten_create(int start_dim, int end_dim, td_module **out) {
  TD_CHECK_ARG(out, "td_flatten_create: NULL out");
  flatten_state *s = NULL;
  TD_TRY(make_module(&flatten_type, sizeof *s, (void **)&s, out));
  s->start = start_dim;
  s->end = end_dim;
  return TD_OK;
}

/* ---- Sequential ---- */

static td_status sequential_forward(td_module *self, td_tensor *const *in, int n_in,
                                    td_tensor **out, int n_out) {
  TD_TRY(one_in_one_out("Sequential", in, n_in, n_out));
  td_tensor *cur = td_tensor_ref(in[0]);
  int n = td_module_num_children(self);
  for (int i = 0; i < n; i++) {
    td_tensor *next = NULL;
    td_status st = td_module_forward(td_module_child_at(self, i, NULL), cur, &next);
    td_tensor_unref(cur);
    if (st != TD_OK) return st;
    cur = next;
  }
  *out = cur;
  return TD_OK;
}

static const td_module_type sequential_type = {"Sequential", sequential_forward, NULL};

td_status td_sequential_create(td_module **out) {
  TD_CHECK_ARG(out, "td_sequential_create: NULL out");
  return make_module(&sequential_type, 0, NULL, out);
}

td_status td_sequential_append(td_module *seq, td_module *child) {
  TD_CHECK_ARG(seq && child, "td_sequential_append: NULL module");
  TD_CHECK_ARG(td_module_get_type(seq) == &sequential_type,
               "td_sequential_append: module is a %s, not a Sequential", td_module_type_name(seq));
  char name[24];
  snprintf(name, sizeof name, "%d", td_module_num_children(seq));
  return td_module_register_module(seq, name, child);
}
