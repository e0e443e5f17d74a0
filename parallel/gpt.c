/* gpt.c - the GPT of nn.h split over a tensor-parallel group (Megatron's layout).
 *
 *   TPCausalSelfAttention  c_attn ColumnParallelLinear(C, 3C) cut with stride 3, so that the
 *                          member's output is [q, k, v] of its n_head/p heads; attention over
 *                          those heads; c_proj RowParallelLinear(C, C) on the member's head
 *                          outputs, summed over the group (g), plus the bias.
 *   MLP, Block             nn.h's (td_gpt_mlp_assemble, td_gpt_block_assemble) over c_fc
 *                          ColumnParallelLinear(C, 4C), c_proj RowParallelLinear(4C, C), and the
 *                          attention above; LayerNorms whole.
 *   TPGPT                  transformer.{wte VocabParallelEmbedding, wpe Embedding, h, ln_f} and
 *                          lm_head ColumnParallelLinear whose weight is wte's slice (tying); the
 *                          loss is the vocabulary-parallel cross entropy of the member's logits.
 * The parameter names are the single-process model's, so td_tp_state_dict_full gives its state
 * dict. The whole copies (LayerNorms, wpe) are made with a private generator so that splitting a
 * model does not move the caller's random numbers.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "parallel_impl.h"

typedef struct tp_gpt_state {
  td_process_group *pg;
  td_gpt_config c;
  int64_t vocab_padded;
  bool sequence_parallel; /* the residual stream split along T (dimension 1) */
} tp_gpt_state;

static void free_state(void *s) { td__free(s); }

static td_status one_to_one(const char *who, int n_in, int n_out) {
  TD_CHECK_ARG(n_in == 1 && n_out == 1, "%s.forward takes 1 input and 1 output (got %d, %d)", who,
               n_in, n_out);
  return TD_OK;
}

static td_status check_btc(const char *who, const td_tensor *x, int64_t C) {
  TD_CHECK_ARG(x, "%s.forward: NULL input", who);
  if (td_tensor_ndim(x) != 3 || td_tensor_size(x, 2) != C) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "%s.forward: input %s, expected [B, T, %lld]", who,
                        td_tensor_shape_str(x, buf, sizeof buf), (long long)C);
  }
  return TD_OK;
}

/* ---- attention, MLP, block ---- */

/* The attention core over the member's heads (selective activation checkpointing's region). */
static td_status sdpa_region(void *ctx, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out) {
  (void)ctx, (void)n_in, (void)n_out;
  return td_tensor_scaled_dot_product_attention(in[0], in[1], in[2], true, NAN, &out[0]);
}

static td_status attn_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  TD_TRY(one_to_one("TPCausalSelfAttention", n_in, n_out));
  const tp_gpt_state *s = td_module_state(self);
  int p = td_process_group_size(s->pg);
  int64_t C = s->c.n_embd, H = s->c.n_head / p, hd = s->c.n_embd / s->c.n_head;
  TD_TRY(check_btc("TPCausalSelfAttention", in[0], C));
  td_tensor *qkv = NULL, *qkv5 = NULL, *parts[3] = {NULL}, *h[3] = {NULL}, *y = NULL, *yt = NULL;
  td_tensor *y3 = NULL;
  td_status st = td_module_forward(td_module_child(self, "c_attn"), in[0], &qkv);
  /* the whole sequence: with sequence parallelism c_attn gathered it */
  int64_t B = st == TD_OK ? td_tensor_size(qkv, 0) : 0, T = st == TD_OK ? td_tensor_size(qkv, 1) : 0;
  int64_t s5[5] = {B, T, 3, H, hd}, s3[3] = {B, T, H * hd};
  if (st == TD_OK) st = td_tensor_reshape(qkv, s5, 5, &qkv5);
  if (st == TD_OK) st = td_tensor_unbind(qkv5, 2, parts);
  for (int i = 0; i < 3 && st == TD_OK; i++) st = td_tensor_transpose(parts[i], 1, 2, &h[i]);
  if (st == TD_OK)
    st = td_module_checkpoint_region(self, "TPCausalSelfAttention.attention", sdpa_region, NULL,
                                     h, 3, &y, 1);
  if (st == TD_OK) st = td_tensor_transpose(y, 1, 2, &yt);
  if (st == TD_OK) st = td_tensor_reshape(yt, s3, 3, &y3);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "c_proj"), y3, out);
  td_tensor *all[] = {qkv, qkv5, parts[0], parts[1], parts[2], h[0], h[1], h[2], y, yt, y3};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}

static td_status dict_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  return td_set_error(TD_ERR_UNSUPPORTED, "ModuleDict has no forward (call its children)");
}

static td_status gpt_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out);

static const td_module_type attn_type = {"TPCausalSelfAttention", attn_forward, free_state};
static const td_module_type dict_type = {"ModuleDict", dict_forward, NULL};
static const td_module_type gpt_type = {"TPGPT", gpt_forward, free_state};

/* ---- the model's forward ---- */

static td_status check_tokens(const char *what, const td_tensor *t, const td_tensor *ref,
                              int64_t block_size) {
  char buf[96];
  TD_CHECK_ARG(t, "TPGPT.forward: NULL %s", what);
  if (td_tensor_dtype(t) != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "TPGPT.forward: %s must be int64, not %s", what,
                        td_dtype_name(td_tensor_dtype(t)));
  if (td_tensor_ndim(t) != 2 || (ref && !td_tensor_same_shape(t, ref)))
    return td_set_error(TD_ERR_SHAPE, "TPGPT.forward: %s %s, expected [B, T]%s", what,
                        td_tensor_shape_str(t, buf, sizeof buf), ref ? " like idx" : "");
  int64_t T = td_tensor_size(t, 1);
  if (T < 1 || T > block_size)
    return td_set_error(TD_ERR_SHAPE, "TPGPT.forward: cannot forward a sequence of length %lld, "
                        "block size is %lld", (long long)T, (long long)block_size);
  return TD_OK;
}

/* gpt_forward: (idx[, targets]) -> (the member's logits [B, T, Vp/p][, loss]). */
static td_status gpt_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out) {
  TD_CHECK_ARG((n_in == 1 || n_in == 2) && (n_out == 1 || n_out == 2),
               "TPGPT.forward takes (idx[, targets]) and gives (logits[, loss]) (got %d, %d)",
               n_in, n_out);
  const tp_gpt_state *s = td_module_state(self);
  const td_tensor *idx = in[0], *tgt = n_in == 2 ? in[1] : NULL;
  TD_TRY(check_tokens("idx", idx, NULL, s->c.block_size));
  TD_CHECK_ARG(n_out == 1 || tgt, "TPGPT.forward: the loss needs targets");
  if (tgt) TD_TRY(check_tokens("targets", tgt, idx, s->c.block_size));
  td_module *tr = td_module_child(self, "transformer");
  int64_t T = td_tensor_size(idx, 1), p0 = 0, pn = T;
  if (s->sequence_parallel) { /* this member's positions [r T/p, (r+1) T/p) */
    int p = td_process_group_size(s->pg);
    if (T % p)
      return td_set_error(TD_ERR_SHAPE, "TPGPT.forward: sequence length %lld is not divisible by "
                          "the tensor-parallel size %d (sequence parallelism splits it)",
                          (long long)T, p);
    pn = T / p;
    p0 = td_process_group_rank(s->pg) * pn;
  }
  td_tensor *pos = NULL, *tok = NULL, *pe = NULL, *x = NULL, *xh = NULL, *xn = NULL;
  td_tensor *logits = NULL, *l2 = NULL, *t1 = NULL, *loss = NULL;
  td_status st = td_tensor_arange((double)p0, (double)(p0 + pn), 1, TD_DTYPE_I64,
                                  td_tensor_device(idx), &pos);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "wte"), idx, &tok);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "wpe"), pos, &pe);
  if (st == TD_OK) st = td_tensor_add(tok, pe, &x);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "h"), x, &xh);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "ln_f"), xh, &xn);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "lm_head"), xn, &logits);
  if (st == TD_OK && n_out == 2) {
    int64_t s2[2] = {-1, td_tensor_size(logits, 2)}, s1[1] = {-1};
    st = td_tensor_reshape(logits, s2, 2, &l2);
    if (st == TD_OK) st = td_tensor_reshape(tgt, s1, 1, &t1);
    if (st == TD_OK)
      st = td_tp_vocab_parallel_cross_entropy(s->pg, l2, t1, s->c.vocab_size, -1, &loss);
  }
  if (st == TD_OK) {
    out[0] = logits;
    logits = NULL;
    if (n_out == 2) {
      out[1] = loss;
      loss = NULL;
    }
  }
  td_tensor *all[] = {pos, tok, pe, x, xh, xn, logits, l2, t1, loss};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}

/* ---- splitting a GPT ---- */

static td_status add_child(td_module *m, const char *name, td_module *child) {
  td_status st = td_module_register_module(m, name, child);
  td_module_unref(child);
  return st;
}

static td_status new_module(const td_module_type *type, const tp_gpt_state *s, td_module **out) {
  tp_gpt_state *c = td__malloc(sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", type->name);
  *c = *s;
  td_status st = td_module_create(type, c, out);
  if (st != TD_OK) td__free(c);
  return st;
}

/* copy_params copies the values of src's own "weight" and "bias" into dst's (no history). */
static td_status copy_params(td_module *dst, const td_module *src) {
  const char *names[2] = {"weight", "bias"};
  td_status st = td_module_to_dtype(dst, td_tensor_dtype(td_module_param(src, "weight")));
  bool prev = td_autograd_set_enabled(false);
  for (int i = 0; i < 2 && st == TD_OK; i++) {
    td_tensor *d = td_module_param(dst, names[i]), *s = td_module_param(src, names[i]);
    if (d && s) st = td_tensor_copy_(d, s);
  }
  td_autograd_set_enabled(prev);
  return st;
}

/* whole_copy makes a copy of the LayerNorm (eps 1e-5, as the GPT's) or Embedding src. */
static td_status whole_copy(const td_module *src, td_generator *gen, td_module **out) {
  td_tensor *w = td_module_param(src, "weight");
  td_status st;
  if (strcmp(td_module_type_name(src), "Embedding") == 0) {
    st = td_embedding_create(td_tensor_size(w, 0), td_tensor_size(w, 1), gen, out);
  } else {
    int64_t C = td_tensor_size(w, 0);
    st = td_layer_norm_create(&C, 1, 1e-5, true, out);
  }
  if (st == TD_OK) st = copy_params(*out, src);
  if (st != TD_OK && *out) {
    td_module_unref(*out);
    *out = NULL;
  }
  return st;
}

static td_status child_from(const td_module *full, const char *path, td_module **out) {
  td_module *m = (td_module *)full;
  char buf[64];
  const char *p = path;
  while (m && *p) {
    const char *dot = strchr(p, '.');
    size_t n = dot ? (size_t)(dot - p) : strlen(p);
    if (n >= sizeof buf) return td_set_error(TD_ERR_INTERNAL, "td_tp_gpt_from: long path");
    memcpy(buf, p, n);
    buf[n] = 0;
    m = td_module_child(m, buf);
    p = dot ? dot + 1 : p + n;
  }
  if (!m) return td_set_error(TD_ERR_INVALID, "td_tp_gpt_from: the GPT has no \"%s\"", path);
  *out = m;
  return TD_OK;
}

/* pair_from cuts full.n1 into a column-parallel layer (its output dimension in `stride` parts)
 * and full.n2 into a row-parallel one taking the parallel input. */
static td_status pair_from(const tp_gpt_state *s, const td_module *full, const char *n1,
                           int stride, const char *n2, td_module **col, td_module **row) {
  td_status st = td__tp_linear_from(s->pg, td_module_child(full, n1), TD__TP_COLUMN, false, stride,
                                    0, col);
  if (st == TD_OK)
    st = td__tp_linear_from(s->pg, td_module_child(full, n2), TD__TP_ROW, true, 1, 0, row);
  return st;
}

/* block_from splits one Block: nn.h's Block and MLP over the parallel layers (their forwards only
 * route through the children), and the attention of this file (its heads are the member's). */
static td_status block_from(const tp_gpt_state *s, const td_module *full, td_generator *gen,
                            td_module **out) {
  td_module *ln1 = NULL, *ln2 = NULL, *attn = NULL, *mlp = NULL, *a = NULL, *b = NULL;
  td_module *fc = NULL, *proj = NULL;
  td_status st = whole_copy(td_module_child(full, "ln_1"), gen, &ln1);
  if (st == TD_OK) st = whole_copy(td_module_child(full, "ln_2"), gen, &ln2);
  if (st == TD_OK) st = pair_from(s, td_module_child(full, "attn"), "c_attn", 3, "c_proj", &a, &b);
  if (st == TD_OK) st = new_module(&attn_type, s, &attn);
  if (st == TD_OK) st = td_module_register_module(attn, "c_attn", a);
  if (st == TD_OK) st = td_module_register_module(attn, "c_proj", b);
  if (st == TD_OK) st = pair_from(s, td_module_child(full, "mlp"), "c_fc", 1, "c_proj", &fc, &proj);
  if (st == TD_OK) st = td_gpt_mlp_assemble(&s->c, fc, proj, &mlp);
  if (st == TD_OK) st = td_gpt_block_assemble(&s->c, ln1, attn, ln2, mlp, out);
  td_module *all[] = {ln1, ln2, attn, mlp, a, b, fc, proj};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_module_unref(all[i]);
  return st;
}

static td_status transformer_from(const tp_gpt_state *s, const td_module *full,
                                  td_generator *gen, td_module **out) {
  td_module *tr = NULL, *child = NULL, *h = NULL, *src = NULL;
  TD_TRY(td_module_create(&dict_type, NULL, &tr));
  td_status st = child_from(full, "transformer.wte", &src);
  if (st == TD_OK) st = td_tp_vocab_embedding_from(s->pg, src, &child);
  if (st == TD_OK) st = add_child(tr, "wte", child);
  if (st == TD_OK) st = child_from(full, "transformer.wpe", &src);
  if (st == TD_OK) st = whole_copy(src, gen, &child);
  if (st == TD_OK) st = add_child(tr, "wpe", child);
  if (st == TD_OK) st = td_sequential_create(&h);
  for (int i = 0; i < s->c.n_layer && st == TD_OK; i++) {
    char path[48];
    snprintf(path, sizeof path, "transformer.h.%d", i);
    st = child_from(full, path, &src);
    if (st == TD_OK) st = block_from(s, src, gen, &child);
    if (st == TD_OK) {
      st = td_sequential_append(h, child);
      td_module_unref(child);
    }
  }
  if (st == TD_OK) {
    st = add_child(tr, "h", h);
    h = NULL;
  }
  if (st == TD_OK) st = child_from(full, "transformer.ln_f", &src);
  if (st == TD_OK) st = whole_copy(src, gen, &child);
  if (st == TD_OK) st = add_child(tr, "ln_f", child);
  td_module_unref(h);
  if (st != TD_OK) {
    td_module_unref(tr);
    return st;
  }
  *out = tr;
  return TD_OK;
}

void td_tp_gpt_options_init(td_tp_gpt_options *o) {
  if (o) memset(o, 0, sizeof *o);
}

td_status td_tp_gpt_from(td_process_group *pg, const td_module *gpt, td_module **out) {
  return td_tp_gpt_from_ex(pg, gpt, NULL, out);
}

td_status td_tp_gpt_from_ex(td_process_group *pg, const td_module *gpt,
                            const td_tp_gpt_options *o, td_module **out) {
  const char *who = "td_tp_gpt_from";
  TD_CHECK_ARG(pg && gpt && out, "%s: NULL argument", who);
  tp_gpt_state s = {pg, {0}, 0, o && o->sequence_parallel};
  TD_TRY(td_gpt_config_get(gpt, &s.c));
  int p = td_process_group_size(pg);
  if (s.c.n_head % p != 0)
    return td_set_error(TD_ERR_INVALID, "%s: n_head %d is not divisible by the tensor-parallel "
                        "size %d (each member takes whole heads)", who, s.c.n_head, p);
  TD_TRY(td__tp_check_divisible(who, "the MLP width 4 n_embd", 4 * s.c.n_embd, p));
  s.vocab_padded = (s.c.vocab_size + p - 1) / p * p;
  td_generator *gen = NULL;
  TD_TRY(td_generator_create(0, &gen));
  td_module *m = NULL, *tr = NULL, *head = NULL;
  td_status st = new_module(&gpt_type, &s, &m);
  if (st == TD_OK) st = transformer_from(&s, gpt, gen, &tr);
  if (st == TD_OK) st = add_child(m, "transformer", tr);
  if (st == TD_OK)
    st = td__tp_linear_from(pg, td_module_child(gpt, "lm_head"), TD__TP_COLUMN, false, 1,
                            s.vocab_padded, &head);
  if (st == TD_OK) st = add_child(m, "lm_head", head);
  /* weight tying: lm_head.weight is the very slice transformer.wte.weight */
  if (st == TD_OK)
    st = td_module_set_parameter(m, "lm_head.weight",
                                 td_module_param(td_module_child(tr, "wte"), "weight"));
  td_generator_destroy(gen);
  if (st == TD_OK && s.sequence_parallel) st = td_tp_set_sequence_parallel(m, 1);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_status td_tp_gpt_create(td_process_group *pg, const td_gpt_config *c, td_generator *g,
                           td_module **out) {
  TD_CHECK_ARG(pg && c && out, "td_tp_gpt_create: NULL argument");
  td_module *whole = NULL;
  TD_TRY(td_gpt_create(c, g, &whole));
  td_status st = td_tp_gpt_from(pg, whole, out);
  td_module_unref(whole);
  return st;
}

td_status td_tp_gpt_forward(td_module *tp_gpt, const td_tensor *idx, const td_tensor *targets,
                            bool gather_logits, td_tensor **logits, td_tensor **loss) {
  TD_CHECK_ARG(tp_gpt && logits, "td_tp_gpt_forward: NULL module or logits");
  TD_CHECK_ARG(td_module_get_type(tp_gpt) == &gpt_type, "td_tp_gpt_forward: module is a %s, not "
               "a TPGPT", td_module_type_name(tp_gpt));
  TD_CHECK_ARG(!loss || targets, "td_tp_gpt_forward: a loss needs targets");
  const tp_gpt_state *s = td_module_state(tp_gpt);
  td_tensor *in[2] = {(td_tensor *)idx, (td_tensor *)targets}, *res[2] = {NULL, NULL};
  TD_TRY(td_module_forward_multi(tp_gpt, in, targets ? 2 : 1, res, loss ? 2 : 1));
  td_status st = TD_OK;
  if (gather_logits) {
    td_tensor *all = NULL;
    st = td_tp_gather_from_region(s->pg, res[0], &all);
    if (st == TD_OK) st = td_tensor_narrow(all, 2, 0, s->c.vocab_size, logits);
    td_tensor_unref(all);
    td_tensor_unref(res[0]);
  } else {
    *logits = res[0];
  }
  if (st != TD_OK) {
    td_tensor_unref(res[1]);
    return st;
  }
  if (loss) *loss = res[1];
  return TD_OK;
}
