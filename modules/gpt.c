/* gpt.c - the GPT building blocks in nanoGPT's layout: CausalSelfAttention, MLP, Block, GPT.
 *
 * Every module is made of built-in children (Linear, LayerNorm, Embedding, Sequential), so the
 * parameter names are nanoGPT's state_dict keys ("transformer.h.0.attn.c_attn.weight", ...) and a
 * state dict moves between tdist and the PyTorch model of bench/peers/torch/gpt.py unchanged.
 *
 *   CausalSelfAttention  c_attn Linear(C, 3C) -> the [B, T, 3C] projection is viewed as
 *                        [B, T, 3, H, hd] and q, k, v are [B, H, T, hd] views of it (unbind and
 *                        transpose: no copy; one backward node gathers their gradients);
 *                        td_tensor_scaled_dot_product_attention with the causal mask; its output
 *                        is laid out as [B, T, H, hd], so merging the heads back to [B, T, C] is a
 *                        view; c_proj Linear(C, C).
 *   MLP                  c_fc Linear(C, 4C), exact GELU, c_proj Linear(4C, C).
 *   Block                pre-LayerNorm residual block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
 *   GPT                  transformer.{wte, wpe, h.<i>, ln_f} and lm_head Linear(C, V, no bias)
 *                        whose weight IS transformer.wte.weight (one tensor registered under two
 *                        names: both uses accumulate into its gradient, module conversions keep
 *                        the sharing, td_module_parameters lists it once). "transformer" is a
 *                        ModuleDict-like container without a forward of its own.
 *
 * Activation checkpointing (td_gpt_set_activation_checkpointing): full mode checkpoints each
 * Block (its input is what it keeps); selective mode checkpoints each attention module's core,
 * the region from q, k, v to the attention output (td_module_checkpoint_region), so backward
 * recomputes the [B, H, T, T] probabilities instead of keeping them (Megatron-LM's selective
 * recompute).
 *
 * Initialisation is nanoGPT's _init_weights: Linear and Embedding weights N(0, 0.02), biases 0,
 * LayerNorm 1 / 0, and every c_proj.weight N(0, 0.02 / sqrt(2 n_layer)). Dropout is not built in
 * (nanoGPT's small CPU recipe trains with dropout 0).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "modules_impl.h"

#define INIT_STD 0.02

void td_gpt_config_init(td_gpt_config *c) {
  if (!c) return;
  memset(c, 0, sizeof *c);
  c->block_size = 64;
  c->n_layer = 4;
  c->n_head = 4;
  c->n_embd = 128;
}

static td_status check_config(const char *who, const td_gpt_config *c, bool need_vocab) {
  TD_CHECK_ARG(c, "%s: NULL config", who);
  TD_CHECK_ARG(!need_vocab || c->vocab_size > 0, "%s: vocab_size %lld must be > 0", who,
               (long long)c->vocab_size);
  TD_CHECK_ARG(c->block_size > 0 && c->n_layer >= 0 && c->n_head > 0 && c->n_embd > 0,
               "%s: block_size %lld, n_layer %d, n_head %d, n_embd %lld must be positive", who,
               (long long)c->block_size, c->n_layer, c->n_head, (long long)c->n_embd);
  TD_CHECK_ARG(c->n_embd % c->n_head == 0, "%s: n_embd %lld is not divisible by n_head %d", who,
               (long long)c->n_embd, c->n_head);
  return TD_OK;
}

/* proj_std is nanoGPT's special init of the residual projections. */
static double proj_std(const td_gpt_config *c) {
  return INIT_STD / sqrt(2.0 * (c->n_layer > 0 ? c->n_layer : 1));
}

/* make_linear creates Linear(in, out, bias) with weight N(0, std) and a zero bias. */
static td_status make_linear(int64_t in, int64_t out, bool bias, double std, td_generator *g,
                             td_module **m) {
  TD_TRY(td_linear_create(in, out, bias, g, m));
  td_status st = td_nn_init_normal_(td_module_param(*m, "weight"), 0.0, std, g);
  if (st == TD_OK && bias) st = td_tensor_zero_(td_module_param(*m, "bias"));
  if (st != TD_OK) {
    td_module_unref(*m);
    *m = NULL;
  }
  return st;
}

/* add_child registers child under name and drops the caller's reference (also on failure). */
static td_status add_child(td_module *m, const char *name, td_module *child) {
  td_status st = td_module_register_module(m, name, child);
  td_module_unref(child);
  return st;
}

/* new_module makes an empty module of type whose state is a copy of c. */
static td_status new_module(const td_module_type *type, const td_gpt_config *c, td_module **out) {
  td_gpt_config *s = td__malloc(sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", type->name);
  *s = *c;
  td_status st = td_module_create(type, s, out);
  if (st != TD_OK) td__free(s);
  return st;
}

static void free_state(void *s) { td__free(s); }

/* check_btc verifies that x is a float [B, T, C] tensor. */
static td_status check_btc(const char *who, const td_tensor *x, int64_t C) {
  TD_CHECK_ARG(x, "%s.forward: NULL input", who);
  if (td_tensor_ndim(x) != 3 || td_tensor_size(x, 2) != C) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "%s.forward: input %s, expected [B, T, %lld]", who,
                        td_tensor_shape_str(x, buf, sizeof buf), (long long)C);
  }
  return TD_OK;
}

static td_status one_to_one(const char *who, int n_in, int n_out) {
  TD_CHECK_ARG(n_in == 1 && n_out == 1, "%s.forward takes 1 input and 1 output (got %d, %d)", who,
               n_in, n_out);
  return TD_OK;
}

/* ---- CausalSelfAttention ---- */

/* heads returns q, k, v [B, H, T, hd] as views of qkv5 [B, T, 3, H, hd] (unbind, transpose). */
static td_status heads(const td_tensor *qkv5, td_tensor **h) {
  td_tensor *parts[3] = {NULL, NULL, NULL};
  td_status st = td_tensor_unbind(qkv5, 2, parts);
  for (int i = 0; i < 3 && st == TD_OK; i++) st = td_tensor_transpose(parts[i], 1, 2, &h[i]);
  for (int i = 0; i < 3; i++) td_tensor_unref(parts[i]);
  return st;
}

/* The attention core, the region selective checkpointing recomputes: q, k, v -> y. */
static td_status sdpa_region(void *ctx, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out) {
  (void)ctx, (void)n_in, (void)n_out;
  return td_tensor_scaled_dot_product_attention(in[0], in[1], in[2], true, NAN, &out[0]);
}

static td_status attn_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  TD_TRY(one_to_one("CausalSelfAttention", n_in, n_out));
  const td_gpt_config *c = td_module_state(self);
  TD_TRY(check_btc("CausalSelfAttention", in[0], c->n_embd));
  int64_t B = td_tensor_size(in[0], 0), T = td_tensor_size(in[0], 1), C = c->n_embd;
  int64_t H = c->n_head, s5[5] = {B, T, 3, H, C / H}, s3[3] = {B, T, C};
  td_tensor *qkv = NULL, *qkv5 = NULL, *h[3] = {NULL, NULL, NULL}, *y = NULL, *yt = NULL;
  td_tensor *y3 = NULL;
  td_status st = td_module_forward(td_module_child(self, "c_attn"), in[0], &qkv);
  if (st == TD_OK) st = td_tensor_reshape(qkv, s5, 5, &qkv5);
  if (st == TD_OK) st = heads(qkv5, h);
  if (st == TD_OK)
    st = td_module_checkpoint_region(self, "CausalSelfAttention.attention", sdpa_region, NULL, h,
                                     3, &y, 1);
  if (st == TD_OK) st = td_tensor_transpose(y, 1, 2, &yt);
  if (st == TD_OK) st = td_tensor_reshape(yt, s3, 3, &y3);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "c_proj"), y3, out);
  td_tensor *all[] = {qkv, qkv5, h[0], h[1], h[2], y, yt, y3};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}

static const td_module_type attn_type = {"CausalSelfAttention", attn_forward, free_state};

td_status td_causal_self_attention_create(const td_gpt_config *c, td_generator *g,
                                          td_module **out) {
  TD_CHECK_ARG(out, "td_causal_self_attention_create: NULL out");
  TD_TRY(check_config("td_causal_self_attention_create", c, false));
  td_module *m = NULL, *ca = NULL, *cp = NULL;
  TD_TRY(new_module(&attn_type, c, &m));
  td_status st = make_linear(c->n_embd, 3 * c->n_embd, true, INIT_STD, g, &ca);
  if (st == TD_OK) st = add_child(m, "c_attn", ca);
  if (st == TD_OK) st = make_linear(c->n_embd, c->n_embd, true, proj_std(c), g, &cp);
  if (st == TD_OK) st = add_child(m, "c_proj", cp);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* ---- MLP ---- */

static td_status mlp_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                             int n_out) {
  TD_TRY(one_to_one("MLP", n_in, n_out));
  const td_gpt_config *c = td_module_state(self);
  TD_TRY(check_btc("MLP", in[0], c->n_embd));
  td_tensor *h = NULL, *a = NULL;
  td_status st = td_module_forward(td_module_child(self, "c_fc"), in[0], &h);
  if (st == TD_OK) st = td_tensor_gelu(h, &a);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "c_proj"), a, out);
  td_tensor_unref(h);
  td_tensor_unref(a);
  return st;
}

static const td_module_type mlp_type = {"MLP", mlp_forward, free_state};

/* assemble makes a module of type t (state: a copy of c) with the named children (new
 * references). */
static td_status assemble(const td_module_type *t, const td_gpt_config *c,
                          const char *const *names, td_module *const *children, int n,
                          td_module **out) {
  td_module *m = NULL;
  TD_TRY(new_module(t, c, &m));
  td_status st = TD_OK;
  for (int i = 0; i < n && st == TD_OK; i++) {
    TD_CHECK_ARG(children[i], "%s: NULL child \"%s\"", t->name, names[i]);
    st = td_module_register_module(m, names[i], children[i]);
  }
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_status td_gpt_mlp_assemble(const td_gpt_config *c, td_module *c_fc, td_module *c_proj,
                              td_module **out) {
  TD_CHECK_ARG(out, "td_gpt_mlp_assemble: NULL out");
  TD_TRY(check_config("td_gpt_mlp_assemble", c, false));
  const char *names[2] = {"c_fc", "c_proj"};
  td_module *ch[2] = {c_fc, c_proj};
  return assemble(&mlp_type, c, names, ch, 2, out);
}

td_status td_gpt_mlp_create(const td_gpt_config *c, td_generator *g, td_module **out) {
  TD_CHECK_ARG(out, "td_gpt_mlp_create: NULL out");
  TD_TRY(check_config("td_gpt_mlp_create", c, false));
  td_module *fc = NULL, *cp = NULL;
  td_status st = make_linear(c->n_embd, 4 * c->n_embd, true, INIT_STD, g, &fc);
  if (st == TD_OK) st = make_linear(4 * c->n_embd, c->n_embd, true, proj_std(c), g, &cp);
  if (st == TD_OK) st = td_gpt_mlp_assemble(c, fc, cp, out);
  td_module_unref(fc);
  td_module_unref(cp);
  return st;
}

/* ---- Block ---- */

/* residual computes x + f(norm(x)) with the children named norm and f. */
static td_status residual(td_module *self, const char *norm, const char *f, const td_tensor *x,
                          td_tensor **out) {
  td_tensor *n = NULL, *y = NULL;
  td_status st = td_module_forward(td_module_child(self, norm), x, &n);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, f), n, &y);
  if (st == TD_OK) st = td_tensor_add(x, y, out);
  td_tensor_unref(n);
  td_tensor_unref(y);
  return st;
}

static td_status block_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                               int n_out) {
  TD_TRY(one_to_one("Block", n_in, n_out));
  const td_gpt_config *c = td_module_state(self);
  TD_TRY(check_btc("Block", in[0], c->n_embd));
  td_tensor *x1 = NULL;
  td_status st = residual(self, "ln_1", "attn", in[0], &x1);
  if (st == TD_OK) st = residual(self, "ln_2", "mlp", x1, out);
  td_tensor_unref(x1);
  return st;
}

static const td_module_type block_type = {"Block", block_forward, free_state};

static td_status make_layer_norm(int64_t C, td_module **out) {
  return td_layer_norm_create(&C, 1, 1e-5, true, out);
}

td_status td_gpt_block_assemble(const td_gpt_config *c, td_module *ln_1, td_module *attn,
                                td_module *ln_2, td_module *mlp, td_module **out) {
  TD_CHECK_ARG(out, "td_gpt_block_assemble: NULL out");
  TD_TRY(check_config("td_gpt_block_assemble", c, false));
  const char *names[4] = {"ln_1", "attn", "ln_2", "mlp"};
  td_module *ch[4] = {ln_1, attn, ln_2, mlp};
  return assemble(&block_type, c, names, ch, 4, out);
}

td_status td_gpt_block_create(const td_gpt_config *c, td_generator *g, td_module **out) {
  TD_CHECK_ARG(out, "td_gpt_block_create: NULL out");
  TD_TRY(check_config("td_gpt_block_create", c, false));
  td_module *ch[4] = {NULL, NULL, NULL, NULL};
  td_status st = make_layer_norm(c->n_embd, &ch[0]);
  if (st == TD_OK) st = td_causal_self_attention_create(c, g, &ch[1]);
  if (st == TD_OK) st = make_layer_norm(c->n_embd, &ch[2]);
  if (st == TD_OK) st = td_gpt_mlp_create(c, g, &ch[3]);
  if (st == TD_OK) st = td_gpt_block_assemble(c, ch[0], ch[1], ch[2], ch[3], out);
  for (int i = 0; i < 4; i++) td_module_unref(ch[i]);
  return st;
}

/* ---- GPT ---- */

static td_status dict_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  return td_set_error(TD_ERR_UNSUPPORTED, "ModuleDict has no forward (call its children)");
}

static const td_module_type dict_type = {"ModuleDict", dict_forward, NULL};

/* embed returns wte(idx) + wpe(arange(T)) for idx [B, T]. */
static td_status embed(td_module *tr, const td_tensor *idx, td_tensor **out) {
  int64_t T = td_tensor_size(idx, 1);
  td_tensor *pos = NULL, *tok = NULL, *pe = NULL;
  td_status st = td_tensor_arange(0, (double)T, 1, TD_DTYPE_I64, td_tensor_device(idx), &pos);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "wte"), idx, &tok);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "wpe"), pos, &pe);
  if (st == TD_OK) st = td_tensor_add(tok, pe, out);
  td_tensor_unref(pos);
  td_tensor_unref(tok);
  td_tensor_unref(pe);
  return st;
}

/* check_tokens verifies that t is int64 [B, T] with 1 <= T <= block_size (shape of ref when
 * ref is not NULL). */
static td_status check_tokens(const char *what, const td_tensor *t, const td_tensor *ref,
                              int64_t block_size) {
  char buf[96];
  TD_CHECK_ARG(t, "GPT.forward: NULL %s", what);
  if (td_tensor_dtype(t) != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "GPT.forward: %s must be int64, not %s", what,
                        td_dtype_name(td_tensor_dtype(t)));
  if (td_tensor_ndim(t) != 2 || (ref && !td_tensor_same_shape(t, ref)))
    return td_set_error(TD_ERR_SHAPE, "GPT.forward: %s %s, expected [B, T]%s", what,
                        td_tensor_shape_str(t, buf, sizeof buf), ref ? " like idx" : "");
  int64_t T = td_tensor_size(t, 1);
  if (T < 1 || T > block_size)
    return td_set_error(TD_ERR_SHAPE, "GPT.forward: cannot forward a sequence of length %lld, "
                        "block size is %lld", (long long)T, (long long)block_size);
  return TD_OK;
}

static td_status gpt_forward_impl(td_module *self, td_tensor *const *in, int n_in,
                                  td_tensor **out, int n_out) {
  TD_CHECK_ARG((n_in == 1 || n_in == 2) && (n_out == 1 || n_out == 2),
               "GPT.forward takes (idx[, targets]) and gives (logits[, loss]) (got %d, %d)", n_in,
               n_out);
  const td_gpt_config *c = td_module_state(self);
  const td_tensor *idx = in[0], *tgt = n_in == 2 ? in[1] : NULL;
  TD_TRY(check_tokens("idx", idx, NULL, c->block_size));
  TD_CHECK_ARG(n_out == 1 || tgt, "GPT.forward: the loss needs targets");
  if (tgt) TD_TRY(check_tokens("targets", tgt, idx, c->block_size));
  td_module *tr = td_module_child(self, "transformer");
  td_tensor *x = NULL, *xh = NULL, *xn = NULL, *logits = NULL, *l2 = NULL, *t1 = NULL;
  td_tensor *loss = NULL;
  td_status st = embed(tr, idx, &x);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "h"), x, &xh);
  if (st == TD_OK) st = td_module_forward(td_module_child(tr, "ln_f"), xh, &xn);
  if (st == TD_OK) st = td_module_forward(td_module_child(self, "lm_head"), xn, &logits);
  if (st == TD_OK && n_out == 2) {
    int64_t s2[2] = {-1, c->vocab_size}, s1[1] = {-1};
    st = td_tensor_reshape(logits, s2, 2, &l2);
    if (st == TD_OK) st = td_tensor_reshape(tgt, s1, 1, &t1);
    if (st == TD_OK) st = td_tensor_cross_entropy(l2, t1, TD_REDUCTION_MEAN, -1, &loss);
  }
  if (st == TD_OK) {
    out[0] = logits;
    logits = NULL;
    if (n_out == 2) {
      out[1] = loss;
      loss = NULL;
    }
  }
  td_tensor *all[] = {x, xh, xn, logits, l2, t1, loss};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}

static const td_module_type gpt_type = {"GPT", gpt_forward_impl, free_state};

/* build_transformer makes the "transformer" container: wte, wpe, h (Sequential), ln_f. */
static td_status build_transformer(const td_gpt_config *c, td_generator *g, td_module **out) {
  td_module *tr = NULL, *child = NULL, *h = NULL;
  TD_TRY(td_module_create(&dict_type, NULL, &tr));
  td_status st = td_embedding_create(c->vocab_size, c->n_embd, g, &child);
  if (st == TD_OK) st = td_nn_init_normal_(td_module_param(child, "weight"), 0, INIT_STD, g);
  if (st == TD_OK) st = add_child(tr, "wte", child);
  else td_module_unref(child);
  child = NULL;
  if (st == TD_OK) st = td_embedding_create(c->block_size, c->n_embd, g, &child);
  if (st == TD_OK) st = td_nn_init_normal_(td_module_param(child, "weight"), 0, INIT_STD, g);
  if (st == TD_OK) st = add_child(tr, "wpe", child);
  else td_module_unref(child);
  if (st == TD_OK) st = td_sequential_create(&h);
  for (int i = 0; i < c->n_layer && st == TD_OK; i++) {
    st = td_gpt_block_create(c, g, &child);
    if (st == TD_OK) {
      st = td_sequential_append(h, child);
      td_module_unref(child);
    }
  }
  if (st == TD_OK) {
    st = add_child(tr, "h", h);
    h = NULL;
  }
  if (st == TD_OK) st = make_layer_norm(c->n_embd, &child);
  if (st == TD_OK) st = add_child(tr, "ln_f", child);
  td_module_unref(h);
  if (st != TD_OK) {
    td_module_unref(tr);
    return st;
  }
  *out = tr;
  return TD_OK;
}

td_status td_gpt_create(const td_gpt_config *c, td_generator *g, td_module **out) {
  TD_CHECK_ARG(out, "td_gpt_create: NULL out");
  TD_TRY(check_config("td_gpt_create", c, true));
  td_module *m = NULL, *tr = NULL, *head = NULL;
  TD_TRY(new_module(&gpt_type, c, &m));
  td_status st = build_transformer(c, g, &tr);
  if (st == TD_OK) st = add_child(m, "transformer", tr);
  if (st == TD_OK) st = td_linear_create(c->n_embd, c->vocab_size, false, g, &head);
  if (st == TD_OK) st = add_child(m, "lm_head", head);
  /* weight tying: lm_head.weight is the very tensor transformer.wte.weight */
  if (st == TD_OK)
    st = td_module_set_parameter(m, "lm_head.weight",
                                 td_module_param(td_module_child(tr, "wte"), "weight"));
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_status td_gpt_forward(td_module *gpt, const td_tensor *idx, const td_tensor *targets,
                         td_tensor **logits, td_tensor **loss) {
  TD_CHECK_ARG(gpt && logits, "td_gpt_forward: NULL module or logits");
  TD_CHECK_ARG(td_module_get_type(gpt) == &gpt_type, "td_gpt_forward: module is a %s, not a GPT",
               td_module_type_name(gpt));
  TD_CHECK_ARG(!loss || targets, "td_gpt_forward: a loss needs targets");
  td_tensor *in[2] = {(td_tensor *)idx, (td_tensor *)targets}, *res[2] = {NULL, NULL};
  TD_TRY(td_module_forward_multi(gpt, in, targets ? 2 : 1, res, loss ? 2 : 1));
  *logits = res[0];
  if (loss) *loss = res[1];
  return TD_OK;
}

td_status td_gpt_set_activation_checkpointing(td_module *gpt, td_checkpoint_mode mode) {
  TD_CHECK_ARG(gpt, "td_gpt_set_activation_checkpointing: NULL module");
  TD_CHECK_ARG(mode == TD_CHECKPOINT_NONE || mode == TD_CHECKPOINT_FULL ||
                   mode == TD_CHECKPOINT_SELECTIVE,
               "td_gpt_set_activation_checkpointing: unknown mode %d", (int)mode);
  td_module *h = td_module_child(td_module_child(gpt, "transformer"), "h");
  if (!h)
    return td_set_error(TD_ERR_INVALID, "td_gpt_set_activation_checkpointing: %s has no "
                        "transformer.h (not a GPT)", td_module_type_name(gpt));
  int n = td_module_num_children(h);
  for (int i = 0; i < n; i++) { /* everything checked before anything changes */
    const char *name = NULL;
    td_module *block = td_module_child_at(h, i, &name);
    if (!td_module_child(block, "attn"))
      return td_set_error(TD_ERR_INVALID, "td_gpt_set_activation_checkpointing: block "
                          "transformer.h.%s (%s) has no attn", name, td_module_type_name(block));
  }
  for (int i = 0; i < n; i++) {
    td_module *block = td_module_child_at(h, i, NULL);
    TD_TRY(td_module_set_checkpoint(block, mode == TD_CHECKPOINT_FULL ? mode : TD_CHECKPOINT_NONE));
    TD_TRY(td_module_set_checkpoint(td_module_child(block, "attn"),
                                    mode == TD_CHECKPOINT_SELECTIVE ? mode : TD_CHECKPOINT_NONE));
  }
  return TD_OK;
}

td_status td_gpt_config_get(const td_module *gpt, td_gpt_config *out) {
  TD_CHECK_ARG(gpt && out, "td_gpt_config_get: NULL argument");
  TD_CHECK_ARG(td_module_get_type(gpt) == &gpt_type, "td_gpt_config_get: module is a %s, not a "
               "GPT", td_module_type_name(gpt));
  *out = *(const td_gpt_config *)td_module_state(gpt);
  return TD_OK;
}
