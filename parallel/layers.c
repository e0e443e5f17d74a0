/* layers.c - Megatron's tensor-parallel layers (ColumnParallelLinear, RowParallelLinear,
 * VocabParallelEmbedding), the cutting of whole weights into a member's slice and the joining of
 * the slices, and the functions that treat a split model as the whole one: the split of each
 * parameter, the whole state dict and gradients, and gradient clipping with the whole norm.
 *
 * A layer's state (td__tp_layer) says how its parameters are split; td_tp_param_split finds a
 * parameter's split by walking the module tree for such layers, so any module built of these
 * layers (the GPT of gpt.c, or a user's) is handled without a registry.
 */
#include <math.h>
#include <string.h>

#include "parallel_impl.h"

static void free_layer(void *s) { td__free(s); }

static td_status column_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                                int n_out);
/* reduce_out sums the members' partial outputs: g, or with sequence parallelism a
 * reduce-scatter along the sequence dimension. */
static td_status reduce_out(const td__tp_layer *L, const td_tensor *part, td_tensor **out) {
  if (L->seq_dim < 0) return td_tp_reduce_from_region(L->pg, part, out);
  return td_tp_reduce_scatter_to_sequence(L->pg, part, L->seq_dim, out);
}

static td_status row_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out);
static td_status vocab_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                               int n_out);

static const td_module_type column_type = {"ColumnParallelLinear", column_forward, free_layer};
static const td_module_type row_type = {"RowParallelLinear", row_forward, free_layer};
static const td_module_type vocab_type = {"VocabParallelEmbedding", vocab_forward, free_layer};

const td__tp_layer *td__tp_layer_of(const td_module *m) {
  const td_module_type *t = td_module_get_type(m);
  if (t == &column_type || t == &row_type || t == &vocab_type) return td_module_state(m);
  return NULL;
}

/* ---- cutting and joining ---- */

td_status td__tp_cut(const td_tensor *whole, int dim, int stride, int64_t padded, int p, int r,
                     td_tensor **out) {
  int64_t full = td_tensor_size(whole, dim);
  if (padded < full || padded % ((int64_t)stride * p) != 0)
    return td_set_error(TD_ERR_INVALID, "tensor-parallel cut: size %lld (padded %lld) does not "
                        "split into %d parts of %d members", (long long)full, (long long)padded,
                        stride, p);
  bool prev = td_autograd_set_enabled(false);
  td_tensor *src = td_tensor_ref((td_tensor *)whole), *pad = NULL, *cat = NULL;
  td_status st = TD_OK;
  if (padded > full) {
    int64_t shape[TD_MAX_DIMS];
    int nd = td_tensor_ndim(whole);
    memcpy(shape, td_tensor_shape(whole), sizeof(int64_t) * (size_t)nd);
    shape[dim] = padded - full;
    st = td_tensor_zeros(shape, nd, td_tensor_dtype(whole), td_tensor_device(whole), &pad);
    td_tensor *two[2] = {src, pad};
    if (st == TD_OK) st = td_tensor_cat(two, 2, dim, &cat);
    if (st == TD_OK) {
      td_tensor_unref(src);
      src = cat;
    }
  }
  int64_t part = padded / stride, piece = part / p;
  td_tensor *pieces[8] = {NULL}, *joined = NULL;
  if (stride > 8) st = td_set_error(TD_ERR_INVALID, "tensor-parallel cut: stride %d > 8", stride);
  for (int j = 0; j < stride && st == TD_OK; j++)
    st = td_tensor_narrow(src, dim, j * part + r * piece, piece, &pieces[j]);
  if (st == TD_OK) st = td_tensor_cat(pieces, stride, dim, &joined);
  if (st == TD_OK) st = td_tensor_clone(joined, out);
  td_autograd_set_enabled(prev);
  for (int j = 0; j < stride && j < 8; j++) td_tensor_unref(pieces[j]);
  td_tensor_unref(joined);
  td_tensor_unref(src);
  td_tensor_unref(pad);
  td_dtype dt = st == TD_OK ? td_tensor_dtype(*out) : TD_DTYPE_I64;
  if (dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64 || dt == TD_DTYPE_F16 || dt == TD_DTYPE_BF16)
    st = td_tensor_set_requires_grad(*out, true);
  return st;
}

td_status td__tp_join(td_process_group *pg, const td_tensor *slice, int dim, int stride,
                      int64_t full, td_tensor **out) {
  int p = td_process_group_size(pg);
  td_tensor *all = NULL, *whole = NULL, *cut = NULL;
  TD_TRY(td__tp_gather(pg, slice, dim, &all));
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  int64_t len = td_tensor_size(slice, dim), piece = len / stride;
  if (stride == 1) {
    whole = td_tensor_ref(all);
  } else {
    /* member i's slice holds piece i of every part: put part j's pieces together, in order */
    int n = stride * p;
    td_tensor **pieces = td__calloc((size_t)n, sizeof *pieces);
    if (!pieces) st = td_set_error(TD_ERR_NOMEM, "tensor-parallel join: out of memory");
    for (int j = 0; j < stride && st == TD_OK; j++)
      for (int i = 0; i < p && st == TD_OK; i++)
        st = td_tensor_narrow(all, dim, i * len + j * piece, piece, &pieces[j * p + i]);
    if (st == TD_OK) st = td_tensor_cat(pieces, n, dim, &whole);
    for (int i = 0; pieces && i < n; i++) td_tensor_unref(pieces[i]);
    td__free(pieces);
  }
  if (st == TD_OK) st = td_tensor_narrow(whole, dim, 0, full, &cut);
  if (st == TD_OK) st = td_tensor_clone(cut, out);
  td_autograd_set_enabled(prev);
  td_tensor_unref(all);
  td_tensor_unref(whole);
  td_tensor_unref(cut);
  return st;
}

/* ---- layers ---- */

static td_status one_to_one(const char *who, int n_in, int n_out) {
  TD_CHECK_ARG(n_in == 1 && n_out == 1, "%s.forward takes 1 input and 1 output (got %d, %d)", who,
               n_in, n_out);
  return TD_OK;
}

static td_status check_last(const char *who, const td_tensor *x, int64_t n) {
  TD_CHECK_ARG(x, "%s.forward: NULL input", who);
  if (td_tensor_ndim(x) < 1 || td_tensor_size(x, -1) != n) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "%s.forward: input %s, expected [..., %lld]", who,
                        td_tensor_shape_str(x, buf, sizeof buf), (long long)n);
  }
  return TD_OK;
}

static td_status column_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                                int n_out) {
  TD_TRY(one_to_one("ColumnParallelLinear", n_in, n_out));
  const td__tp_layer *L = td_module_state(self);
  TD_TRY(check_last("ColumnParallelLinear", in[0], L->in));
  td_tensor *x = NULL, *y = NULL;
  td_status st = L->seq_dim >= 0 ? td_tp_gather_from_sequence(L->pg, in[0], L->seq_dim, &x)
                                 : td_tp_copy_to_region(L->pg, in[0], &x);
  if (st == TD_OK)
    st = td_tensor_linear(x, td_module_param(self, "weight"), td_module_param(self, "bias"), &y);
  if (st == TD_OK && L->flag) st = td_tp_gather_from_region(L->pg, y, out);
  else if (st == TD_OK) *out = td_tensor_ref(y);
  td_tensor_unref(x);
  td_tensor_unref(y);
  return st;
}

static td_status row_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out) {
  TD_TRY(one_to_one("RowParallelLinear", n_in, n_out));
  const td__tp_layer *L = td_module_state(self);
  int p = td_process_group_size(L->pg);
  TD_TRY(check_last("RowParallelLinear", in[0], L->flag ? L->in / p : L->in));
  td_tensor *x = NULL, *part = NULL, *y = NULL;
  td_tensor *b = td_module_param(self, "bias");
  td_status st = L->flag ? (x = td_tensor_ref(in[0]), TD_OK)
                         : td_tp_scatter_to_region(L->pg, in[0], &x);
  if (st == TD_OK) st = td_tensor_linear(x, td_module_param(self, "weight"), NULL, &part);
  if (st == TD_OK) st = reduce_out(L, part, b ? &y : out);
  if (st == TD_OK && b) st = td_tensor_add(y, b, out);
  td_tensor_unref(x);
  td_tensor_unref(part);
  td_tensor_unref(y);
  return st;
}

/* local_ids returns ids - start where start <= id < end, else 0, and a float mask [..., 1] of
 * dtype dt that is 1 where the id is this member's. Fails on ids outside [0, V). */
static td_status local_ids(const td__tp_layer *L, const td_tensor *ids, td_dtype dt,
                           td_tensor **local, td_tensor **mask) {
  int p = td_process_group_size(L->pg);
  int64_t rows = L->padded / p, n = td_tensor_numel(ids);
  int nd = td_tensor_ndim(ids), md = nd + 1;
  int64_t mshape[TD_MAX_DIMS + 1];
  memcpy(mshape, td_tensor_shape(ids), sizeof(int64_t) * (size_t)nd);
  mshape[nd] = 1;
  td_tensor *c = NULL, *m64 = NULL;
  TD_TRY(td_tensor_contiguous(ids, &c));
  td_status st = td_tensor_empty(td_tensor_shape(ids), nd, TD_DTYPE_I64, td_device_cpu(), local);
  if (st == TD_OK) st = td_tensor_empty(mshape, md, TD_DTYPE_F64, td_device_cpu(), &m64);
  if (st == TD_OK) {
    const int64_t *src = td_tensor_data(c);
    int64_t *dst = td_tensor_data(*local);
    double *mk = td_tensor_data(m64);
    for (int64_t i = 0; i < n && st == TD_OK; i++) {
      int64_t id = src[i];
      if (id < 0 || id >= L->in) {
        st = td_set_error(TD_ERR_INVALID, "VocabParallelEmbedding.forward: index %lld out of "
                          "range [0, %lld)", (long long)id, (long long)L->in);
        break;
      }
      bool mine = id >= L->start && id < L->start + rows;
      dst[i] = mine ? id - L->start : 0;
      mk[i] = mine ? 1.0 : 0.0;
    }
  }
  if (st == TD_OK) st = td_tensor_to_dtype(m64, dt, mask);
  td_tensor_unref(c);
  td_tensor_unref(m64);
  if (st != TD_OK) {
    td_tensor_unref(*local);
    *local = NULL;
  }
  return st;
}

static td_status vocab_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                               int n_out) {
  TD_TRY(one_to_one("VocabParallelEmbedding", n_in, n_out));
  const td__tp_layer *L = td_module_state(self);
  const td_tensor *ids = in[0];
  TD_CHECK_ARG(ids, "VocabParallelEmbedding.forward: NULL input");
  if (td_tensor_dtype(ids) != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "VocabParallelEmbedding.forward: indices must be int64, "
                        "not %s", td_dtype_name(td_tensor_dtype(ids)));
  if (td_tensor_device(ids).type != TD_DEVICE_CPU)
    return td_set_error(TD_ERR_UNSUPPORTED, "VocabParallelEmbedding.forward: indices must be on "
                        "the CPU");
  td_tensor *w = td_module_param(self, "weight"), *local = NULL, *mask = NULL, *e = NULL;
  td_tensor *em = NULL;
  td_status st = local_ids(L, ids, td_tensor_dtype(w), &local, &mask);
  if (st == TD_OK) st = td_tensor_embedding(w, local, &e);
  if (st == TD_OK) st = td_tensor_mul(e, mask, &em); /* other members' rows are theirs to give */
  if (st == TD_OK) st = reduce_out(L, em, out);
  td_tensor_unref(local);
  td_tensor_unref(mask);
  td_tensor_unref(e);
  td_tensor_unref(em);
  return st;
}

/* make_layer wraps L (copied) with its parameters into a module of type t. */
static td_status make_layer(const td_module_type *t, const td__tp_layer *L, td_tensor *w,
                            td_tensor *b, td_module **out) {
  td__tp_layer *s = td__malloc(sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", t->name);
  *s = *L;
  s->seq_dim = -1; /* td_tp_set_sequence_parallel turns it on */
  td_module *m = NULL;
  td_status st = td_module_create(t, s, &m);
  if (st != TD_OK) {
    td__free(s);
    return st;
  }
  st = td_module_register_parameter(m, "weight", w);
  if (st == TD_OK && b) st = td_module_register_parameter(m, "bias", b);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

static td_status check_linear(const char *who, td_process_group *pg, const td_module *linear) {
  TD_CHECK_ARG(pg && linear, "%s: NULL group or module", who);
  TD_CHECK_ARG(strcmp(td_module_type_name(linear), "Linear") == 0, "%s: module is a %s, not a "
               "Linear", who, td_module_type_name(linear));
  return TD_OK;
}

td_status td__tp_linear_from(td_process_group *pg, const td_module *linear, td__tp_kind kind,
                             bool flag, int stride, int64_t padded_out, td_module **out) {
  const char *who = kind == TD__TP_COLUMN ? "td_tp_column_linear_from" : "td_tp_row_linear_from";
  TD_CHECK_ARG(out, "%s: NULL out", who);
  TD_TRY(check_linear(who, pg, linear));
  int p = td_process_group_size(pg), r = td_process_group_rank(pg);
  td_tensor *W = td_module_param(linear, "weight"), *B = td_module_param(linear, "bias");
  td__tp_layer L = {pg, kind, flag, stride, td_tensor_size(W, 1), td_tensor_size(W, 0), 0, 0};
  L.padded = kind == TD__TP_COLUMN ? (padded_out > 0 ? padded_out : L.out) : L.in;
  if (kind == TD__TP_COLUMN)
    TD_TRY(td__tp_check_divisible(who, stride > 1 ? "each part of the output features"
                                                  : "out_features", L.padded / stride, p));
  else
    TD_TRY(td__tp_check_divisible(who, "in_features", L.in, p));
  td_tensor *w = NULL, *b = NULL;
  td_status st = td__tp_cut(W, kind == TD__TP_COLUMN ? 0 : 1, stride, L.padded, p, r, &w);
  if (st == TD_OK && B && kind == TD__TP_COLUMN) st = td__tp_cut(B, 0, stride, L.padded, p, r, &b);
  if (st == TD_OK && B && kind == TD__TP_ROW) {
    bool prev = td_autograd_set_enabled(false);
    st = td_tensor_clone(B, &b);
    td_autograd_set_enabled(prev);
    if (st == TD_OK) st = td_tensor_set_requires_grad(b, true);
  }
  if (st == TD_OK) st = make_layer(kind == TD__TP_COLUMN ? &column_type : &row_type, &L, w, b, out);
  td_tensor_unref(w);
  td_tensor_unref(b);
  return st;
}

td_status td_tp_column_linear_from(td_process_group *pg, const td_module *linear,
                                   bool gather_output, td_module **out) {
  return td__tp_linear_from(pg, linear, TD__TP_COLUMN, gather_output, 1, 0, out);
}

td_status td_tp_row_linear_from(td_process_group *pg, const td_module *linear,
                                bool input_is_parallel, td_module **out) {
  return td__tp_linear_from(pg, linear, TD__TP_ROW, input_is_parallel, 1, 0, out);
}

static td_status linear_create(td_process_group *pg, int64_t in, int64_t outf, bool bias,
                               td__tp_kind kind, bool flag, td_generator *g, td_module **out) {
  TD_CHECK_ARG(pg && out, "tensor-parallel linear: NULL group or out");
  td_module *whole = NULL;
  TD_TRY(td_linear_create(in, outf, bias, g, &whole));
  td_status st = td__tp_linear_from(pg, whole, kind, flag, 1, 0, out);
  td_module_unref(whole);
  return st;
}

td_status td_tp_column_linear_create(td_process_group *pg, int64_t in_features,
                                     int64_t out_features, bool bias, bool gather_output,
                                     td_generator *g, td_module **out) {
  return linear_create(pg, in_features, out_features, bias, TD__TP_COLUMN, gather_output, g, out);
}

td_status td_tp_row_linear_create(td_process_group *pg, int64_t in_features, int64_t out_features,
                                  bool bias, bool input_is_parallel, td_generator *g,
                                  td_module **out) {
  return linear_create(pg, in_features, out_features, bias, TD__TP_ROW, input_is_parallel, g,
                       out);
}

td_status td_tp_vocab_embedding_from(td_process_group *pg, const td_module *embedding,
                                     td_module **out) {
  const char *who = "td_tp_vocab_embedding_from";
  TD_CHECK_ARG(pg && embedding && out, "%s: NULL argument", who);
  TD_CHECK_ARG(strcmp(td_module_type_name(embedding), "Embedding") == 0, "%s: module is a %s, "
               "not an Embedding", who, td_module_type_name(embedding));
  int p = td_process_group_size(pg), r = td_process_group_rank(pg);
  td_tensor *W = td_module_param(embedding, "weight");
  int64_t V = td_tensor_size(W, 0), Vp = (V + p - 1) / p * p;
  td__tp_layer L = {pg, TD__TP_VOCAB, false, 1, V, td_tensor_size(W, 1), Vp, r * (Vp / p)};
  td_tensor *w = NULL;
  TD_TRY(td__tp_cut(W, 0, 1, Vp, p, r, &w));
  td_status st = make_layer(&vocab_type, &L, w, NULL, out);
  td_tensor_unref(w);
  return st;
}

td_status td_tp_vocab_embedding_create(td_process_group *pg, int64_t num_embeddings,
                                       int64_t embedding_dim, td_generator *g, td_module **out) {
  TD_CHECK_ARG(pg && out, "td_tp_vocab_embedding_create: NULL group or out");
  td_module *whole = NULL;
  TD_TRY(td_embedding_create(num_embeddings, embedding_dim, g, &whole));
  td_status st = td_tp_vocab_embedding_from(pg, whole, out);
  td_module_unref(whole);
  return st;
}

/* ---- splits of a model's parameters ---- */

static td_tp_split whole_split(void) { return (td_tp_split){-1, 1, 0, 0}; }

/* layer_split gives the split of t when it is a parameter of layer L (module m). */
static bool layer_split(const td_module *m, const td__tp_layer *L, const td_tensor *t,
                        td_tp_split *out) {
  bool is_w = td_module_param(m, "weight") == t, is_b = td_module_param(m, "bias") == t;
  if (!is_w && !is_b) return false;
  switch (L->kind) {
    case TD__TP_COLUMN: *out = (td_tp_split){0, L->stride, L->out, L->padded}; break;
    case TD__TP_ROW: *out = is_w ? (td_tp_split){1, 1, L->in, L->in} : whole_split(); break;
    case TD__TP_VOCAB: *out = (td_tp_split){0, 1, L->in, L->padded}; break;
  }
  return true;
}

static bool find_split(const td_module *m, const td_tensor *t, td_tp_split *out) {
  const td__tp_layer *L = td__tp_layer_of(m);
  if (L && layer_split(m, L, t, out)) return true;
  for (int i = 0; i < td_module_num_children(m); i++)
    if (find_split(td_module_child_at(m, i, NULL), t, out)) return true;
  return false;
}

/* split_of returns t's split (whole when no tensor-parallel layer holds it). */
static td_tp_split split_of(td_module *root, const td_tensor *t) {
  td_tp_split s;
  if (!find_split(root, t, &s)) s = whole_split();
  return s;
}

td_status td_tp_param_split(td_module *root, const td_tensor *t, td_tp_split *out) {
  TD_CHECK_ARG(root && t && out, "td_tp_param_split: NULL argument");
  td_tensor_list l;
  td_tensor_list_init(&l);
  TD_TRY(td_module_parameters(root, &l));
  bool found = false;
  for (size_t i = 0; i < l.n && !found; i++) found = l.tensors[i] == t;
  td_tensor_list_fini(&l);
  if (!found)
    return td_set_error(TD_ERR_NOT_FOUND, "td_tp_param_split: the tensor is not a parameter of "
                        "this %s", td_module_type_name(root));
  *out = split_of(root, t);
  return TD_OK;
}

/* whole_of returns the whole tensor of t (split as s) over the group: joined, or a copy. */
static td_status whole_of(td_process_group *pg, const td_tensor *t, td_tp_split s,
                          td_tensor **out) {
  if (s.dim >= 0) return td__tp_join(pg, t, s.dim, s.stride, s.full, out);
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_clone(t, out);
  td_autograd_set_enabled(prev);
  return st;
}

static td_status full_list(td_process_group *pg, td_module *root, bool grads,
                           td_tensor_list *out) {
  const char *who = grads ? "td_tp_grads_full" : "td_tp_state_dict_full";
  TD_CHECK_ARG(pg && root && out, "%s: NULL argument", who);
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_status st = grads ? td_module_named_parameters(root, &l) : td_module_state_dict(root, &l);
  for (size_t i = 0; i < l.n && st == TD_OK; i++) {
    td_tensor *t = l.tensors[i], *src = NULL, *whole = NULL;
    if (grads) {
      src = td_tensor_grad(t);
      if (!src)
        st = td_tensor_zeros(td_tensor_shape(t), td_tensor_ndim(t), td_tensor_dtype(t),
                             td_tensor_device(t), &src);
    } else {
      src = td_tensor_ref(t);
    }
    if (st == TD_OK) st = whole_of(pg, src, split_of(root, t), &whole);
    if (st == TD_OK) st = td_tensor_list_append(out, l.names[i], whole);
    td_tensor_unref(src);
    td_tensor_unref(whole);
  }
  td_tensor_list_fini(&l);
  return st;
}

td_status td_tp_state_dict_full(td_process_group *pg, td_module *root, td_tensor_list *out) {
  return full_list(pg, root, false, out);
}

td_status td_tp_grads_full(td_process_group *pg, td_module *root, td_tensor_list *out) {
  return full_list(pg, root, true, out);
}

/* sum_squares returns the sum of the squares of t's elements (float32 or float64). */
static td_status sum_squares(const td_tensor *t, double *out) {
  td_tensor *c = NULL;
  TD_TRY(td_tensor_contiguous(t, &c));
  int64_t n = td_tensor_numel(c);
  double s = 0;
  td_status st = TD_OK;
  if (td_tensor_device(c).type != TD_DEVICE_CPU) {
    st = td_set_error(TD_ERR_UNSUPPORTED, "td_tp_clip_grad_norm: gradients must be on the CPU");
  } else if (td_tensor_dtype(c) == TD_DTYPE_F32) {
    const float *p = td_tensor_data(c);
    for (int64_t i = 0; i < n; i++) s += (double)p[i] * (double)p[i];
  } else if (td_tensor_dtype(c) == TD_DTYPE_F64) {
    const double *p = td_tensor_data(c);
    for (int64_t i = 0; i < n; i++) s += p[i] * p[i];
  } else {
    st = td_set_error(TD_ERR_DTYPE, "td_tp_clip_grad_norm: %s gradients",
                      td_dtype_name(td_tensor_dtype(c)));
  }
  td_tensor_unref(c);
  *out = s;
  return st;
}

td_status td_tp_clip_grad_norm(td_process_group *pg, td_module *root, double max_norm,
                               double *total_norm) {
  TD_CHECK_ARG(pg && root, "td_tp_clip_grad_norm: NULL group or module");
  TD_CHECK_ARG(max_norm >= 0, "td_tp_clip_grad_norm: max_norm %g must be >= 0", max_norm);
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_status st = td_module_parameters(root, &l);
  double split_sq = 0, whole_sq = 0;
  for (size_t i = 0; i < l.n && st == TD_OK; i++) {
    td_tensor *g = td_tensor_grad(l.tensors[i]);
    if (!g) continue;
    double s = 0;
    st = sum_squares(g, &s);
    td_tensor_unref(g);
    if (split_of(root, l.tensors[i]).dim >= 0) split_sq += s;
    else whole_sq += s; /* equal on every member: counted once */
  }
  td_tensor *sum = NULL;
  int64_t one = 1;
  if (st == TD_OK) st = td_tensor_from_buffer(&split_sq, &one, 1, TD_DTYPE_F64, &sum);
  if (st == TD_OK) st = td_process_group_all_reduce(pg, sum, TD_REDUCE_SUM);
  double total = 0;
  if (st == TD_OK) total = sqrt(*(const double *)td_tensor_data(sum) + whole_sq);
  double coef = max_norm / (total + 1e-6);
  for (size_t i = 0; i < l.n && st == TD_OK && !(coef >= 1.0); i++) {
    td_tensor *g = td_tensor_grad(l.tensors[i]);
    if (g) st = td_tensor_mul_scalar_(g, coef);
    td_tensor_unref(g);
  }
  td_tensor_unref(sum);
  td_tensor_list_fini(&l);
  if (st == TD_OK && total_norm) *total_norm = total;
  return st;
}

/* ---- sequence parallelism ---- */

static void set_seq(td_module *m, int dim) {
  if (td__tp_layer_of(m)) ((td__tp_layer *)td_module_state(m))->seq_dim = dim;
  for (int i = 0; i < td_module_num_children(m); i++) set_seq(td_module_child_at(m, i, NULL), dim);
}

td_status td_tp_set_sequence_parallel(td_module *root, int seq_dim) {
  TD_CHECK_ARG(root, "td_tp_set_sequence_parallel: NULL module");
  TD_CHECK_ARG(seq_dim >= -1, "td_tp_set_sequence_parallel: seq_dim %d (>= 0, or -1 for off)",
               seq_dim);
  set_seq(root, seq_dim);
  return TD_OK;
}

td_status td_tp_sync_sequence_parallel_grads(td_process_group *pg, td_module *root) {
  TD_CHECK_ARG(pg && root, "td_tp_sync_sequence_parallel_grads: NULL argument");
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_status st = td_module_parameters(root, &l);
  for (size_t i = 0; i < l.n && st == TD_OK; i++) {
    td_tensor *t = l.tensors[i];
    if (split_of(root, t).dim >= 0) continue;
    td_tensor *g = td_tensor_grad(t);
    if (!g) { /* a zero share still takes part: the other members may have one */
      st = td_tensor_zeros(td_tensor_shape(t), td_tensor_ndim(t), td_tensor_dtype(t),
                           td_tensor_device(t), &g);
      if (st == TD_OK) st = td_tensor_set_grad(t, g);
    }
    if (st == TD_OK) st = td_process_group_all_reduce(pg, g, TD_REDUCE_SUM);
    td_tensor_unref(g);
  }
  td_tensor_list_fini(&l);
  return st;
}
