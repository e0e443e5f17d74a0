/* parallel.h - tensor parallelism over a process group: Megatron-LM's differentiable collectives,
 * its column-, row- and vocabulary-parallel layers, a vocabulary-parallel cross entropy, and the
 * GPT of nn.h split across the members of a group.
 *
 * A tensor-parallel group is a td_process_group (collectives.h) whose members hold one slice each
 * of the same layers and run the same forward and backward on the same inputs. Each layer keeps
 * only its slice of the weights; the collectives inside forward and backward make every member's
 * results those of the whole layer:
 *
 *   ColumnParallelLinear  Y = X A^T + b with A [out, in] split by rows (output features): member r
 *                         holds A_r [out/p, in] and b_r, computes Y_r = f(X) A_r^T + b_r and keeps
 *                         it (the next layer is row-parallel) or all-gathers Y ("gather_output").
 *   RowParallelLinear     Y = X A^T + b with A split by columns (input features): member r holds
 *                         A_r [out, in/p], takes X_r (already split, or splits X), and
 *                         Y = g(X_r A_r^T) + b with b whole on every member.
 *   VocabParallelEmbedding  the table [V, D] split by rows: member r looks up the ids of its range
 *                         (zeros elsewhere) and g() sums the members' partial results.
 *   vocab-parallel cross entropy  logits split by vocabulary: one MAX all-reduce and one SUM
 *                         all-reduce (the softmax denominators and the target logits together)
 *                         give every member the loss; the backward is local (softmax - one-hot on
 *                         the member's columns), as in Megatron.
 *
 * f and g are Megatron's conjugate operators: f = identity forward, all-reduce (sum) backward
 * (td_tp_copy_to_region), g = all-reduce forward, identity backward (td_tp_reduce_from_region).
 * With sequence parallelism the pair becomes all-gather / reduce-scatter along the sequence
 * dimension (td_tp_gather_from_sequence, td_tp_reduce_scatter_to_sequence).
 *
 * Layout of the GPT (td_tp_gpt_*): every block runs ln_1 -> f -> c_attn (column-parallel: the
 * member's heads, q, k and v each split by heads, Megatron's strided partition) -> attention over
 * its own heads -> c_proj (row-parallel) -> g -> + residual, and the MLP c_fc (column) -> GELU ->
 * c_proj (row) -> g; LayerNorms and the position table are whole on every member (their gradients
 * come out equal everywhere, nothing to synchronise); the token table is vocabulary-parallel and
 * the output head shares its slice (weight tying), so the logits stay split by vocabulary into the
 * cross entropy. Heads (n_head) and the MLP width (4 n_embd) must be divisible by the group size
 * (TD_ERR_INVALID naming both otherwise). A vocabulary that is not divisible is padded to the next
 * multiple of the group size: the padding rows are zero, never looked up, and the cross entropy
 * leaves their logits out of the softmax, so the loss and gradients are exactly the unpadded
 * model's (a padded column that entered the softmax would make the loss silently wrong).
 *
 * Weights: the layers are cut from whole tensors (td_tp_*_from, td_tp_gpt_from), so a model
 * initialised, trained or loaded in one process splits into any group size and the slices join
 * back (td_tp_state_dict_full) into the single-process state dict, nanoGPT's keys, for
 * checkpoints and PyTorch. The create functions initialise the whole layer from the generator (the
 * same seed on every member) and keep the member's slice, as Megatron's CPU initialisation does;
 * the whole weights exist for a moment on each member.
 *
 * Every member must call the same operations in the same order (they are collectives of the
 * group, in forward and in backward); the group must outlive the autograd graphs and modules made
 * with it. CPU tensors, float32 and float64 (the collectives' dtypes); the cross entropy refuses
 * other devices with TD_ERR_UNSUPPORTED.
 *
 * THREAD SAFETY: as the process group's: a group's collectives run one at a time in call order,
 * so two threads running forward or backward through modules of one group at once must agree on
 * an order themselves (one thread per group is the simple rule).
 */
#ifndef TDIST_PARALLEL_H
#define TDIST_PARALLEL_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/collectives.h"
#include "tdist/nn.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- differentiable collectives (Megatron's mappings) ----
 * Each returns a new tensor in *out; when x requires grad (and grad mode is on) the result is
 * part of x's autograd graph with the stated backward. */

/* f: out = x; backward all-reduces (sums) the gradient over the group. */
TD_API td_status td_tp_copy_to_region(td_process_group *pg, const td_tensor *x, td_tensor **out);
/* g: out = sum over the group of x; backward passes the gradient through. */
TD_API td_status td_tp_reduce_from_region(td_process_group *pg, const td_tensor *x,
                                          td_tensor **out);
/* out = the members' x joined along the last dimension (member 0 first); backward keeps the
 * member's slice of the gradient. */
TD_API td_status td_tp_gather_from_region(td_process_group *pg, const td_tensor *x,
                                          td_tensor **out);
/* out = the member's slice of x along the last dimension (its size must be divisible by the group
 * size); backward all-gathers the gradient. */
TD_API td_status td_tp_scatter_to_region(td_process_group *pg, const td_tensor *x,
                                         td_tensor **out);
/* Sequence parallelism along dimension dim: out = the members' x joined along dim; backward
 * reduce-scatters (sums, then keeps the member's slice) the gradient. */
TD_API td_status td_tp_gather_from_sequence(td_process_group *pg, const td_tensor *x, int dim,
                                            td_tensor **out);
/* out = the member's slice along dim of the sum over the group of x (dim's size divisible by the
 * group size); backward all-gathers the gradient along dim. */
TD_API td_status td_tp_reduce_scatter_to_sequence(td_process_group *pg, const td_tensor *x,
                                                  int dim, td_tensor **out);

/* ---- layers ----
 * Modules with parameters "weight" (and "bias"), holding the member's slice. The _from forms cut
 * the slice from a whole nn Linear / Embedding module (any dtype; the slices are copies); the
 * _create forms make the whole layer with td_linear_create / td_embedding_create from g (NULL:
 * the default generator) and cut it, so that every member seeded alike gets the slices of one
 * single-process layer. */

/* ColumnParallelLinear from a Linear(in, out): out % group size == 0. gather_output: forward
 * returns the whole [..., out] (all-gathered), else the member's [..., out/p]. */
TD_API td_status td_tp_column_linear_from(td_process_group *pg, const td_module *linear,
                                          bool gather_output, td_module **out);
TD_API td_status td_tp_column_linear_create(td_process_group *pg, int64_t in_features,
                                            int64_t out_features, bool bias, bool gather_output,
                                            td_generator *g, td_module **out);
/* RowParallelLinear from a Linear(in, out): in % group size == 0. input_is_parallel: forward
 * takes the member's [..., in/p] (the output of a column-parallel layer), else the whole
 * [..., in] and keeps the member's slice. The output is whole on every member. */
TD_API td_status td_tp_row_linear_from(td_process_group *pg, const td_module *linear,
                                       bool input_is_parallel, td_module **out);
TD_API td_status td_tp_row_linear_create(td_process_group *pg, int64_t in_features,
                                         int64_t out_features, bool bias, bool input_is_parallel,
                                         td_generator *g, td_module **out);
/* VocabParallelEmbedding from an Embedding(V, D): the member holds rows [r Vp/p, (r+1) Vp/p) of
 * the table padded with zero rows to Vp, the next multiple of the group size. int64 ids of any
 * shape in [0, V) -> [..., D], whole on every member (an id outside is TD_ERR_INVALID). */
TD_API td_status td_tp_vocab_embedding_from(td_process_group *pg, const td_module *embedding,
                                            td_module **out);
TD_API td_status td_tp_vocab_embedding_create(td_process_group *pg, int64_t num_embeddings,
                                              int64_t embedding_dim, td_generator *g,
                                              td_module **out);

/* td_tp_vocab_parallel_cross_entropy: logits [N, Vl] (this member's columns
 * [r Vl, (r+1) Vl) of a vocabulary of vocab_size <= p Vl entries; columns past vocab_size are
 * padding and left out), target int64 [N] in [0, vocab_size) or equal to ignore_index (no
 * contribution; the mean divides by the count of the others, NaN when none is left, as
 * torch.nn.functional.cross_entropy). *out: the mean loss, a scalar equal on every member. */
TD_API td_status td_tp_vocab_parallel_cross_entropy(td_process_group *pg, const td_tensor *logits,
                                                    const td_tensor *target, int64_t vocab_size,
                                                    int64_t ignore_index, td_tensor **out);

/* ---- the GPT ---- */

/* td_tp_gpt_from splits a GPT of nn.h (td_gpt_create, any dtype) over the group: same parameter
 * names, each tensor the member's slice (or a copy of the whole for LayerNorms, biases of
 * row-parallel layers and the position table). */
TD_API td_status td_tp_gpt_from(td_process_group *pg, const td_module *gpt, td_module **out);
/* Options of td_tp_gpt_from_ex; fill with td_tp_gpt_options_init (all off). */
typedef struct td_tp_gpt_options {
  /* Megatron's sequence parallelism: between the tensor-parallel regions (LayerNorms, residual
   * adds, embeddings) each member holds 1/p of the sequence ([B, T/p, C]), so those activations
   * are split too; the column layers all-gather their input along T and the row layers and the
   * token table reduce-scatter their output along T instead of f and g (the same bytes move).
   * T must be divisible by the group size. The whole parameters (LayerNorms, row biases, the
   * position table) then get a partial gradient on each member: call
   * td_tp_sync_sequence_parallel_grads after backward, before clipping or stepping. */
  bool sequence_parallel;
} td_tp_gpt_options;
TD_API void td_tp_gpt_options_init(td_tp_gpt_options *o);
/* td_tp_gpt_from_ex is td_tp_gpt_from with options (NULL: the defaults). */
TD_API td_status td_tp_gpt_from_ex(td_process_group *pg, const td_module *gpt,
                                   const td_tp_gpt_options *o, td_module **out);
/* td_tp_gpt_create is td_gpt_create(c, g) then td_tp_gpt_from (float32). */
TD_API td_status td_tp_gpt_create(td_process_group *pg, const td_gpt_config *c, td_generator *g,
                                  td_module **out);
/* td_tp_gpt_forward: idx [B, T] (and targets [B, T], or NULL) -> logits and the mean loss over
 * the targets that are not -1 (NULL loss: not computed). gather_logits: *logits is the whole
 * [B, T, vocab_size] on every member (one all-gather), else the member's [B, T, Vp/p] columns.
 * Collective in forward and in backward. */
TD_API td_status td_tp_gpt_forward(td_module *tp_gpt, const td_tensor *idx,
                                   const td_tensor *targets, bool gather_logits,
                                   td_tensor **logits, td_tensor **loss);

/* ---- working with split models ---- */

/* How a parameter is split across the group (td_tp_param_split). */
typedef struct td_tp_split {
  int dim;          /* the dimension that is split; -1: the tensor is whole on every member */
  int stride;       /* the dimension is made of `stride` equal parts each split separately
                       (3 for c_attn: q, k, v); 1 otherwise */
  int64_t full;     /* its size in the whole tensor (before padding) */
  int64_t padded;   /* its size with padding (Vp for vocabulary tables), >= full */
} td_tp_split;

/* td_tp_param_split tells how parameter t of the module tree under root is split (found by
 * identity, TD_ERR_NOT_FOUND if t is not a parameter of root). Parameters of modules that are not
 * tensor-parallel layers are whole. */
TD_API td_status td_tp_param_split(td_module *root, const td_tensor *t, td_tp_split *out);

/* td_tp_state_dict_full gathers the whole parameters of a split model: *out gets the names and
 * whole tensors (padding dropped) of td_module_state_dict(root), as the single-process model
 * would have them, on every member. Collective (one all-gather per split tensor, in name order). */
TD_API td_status td_tp_state_dict_full(td_process_group *pg, td_module *root,
                                       td_tensor_list *out);

/* td_tp_grads_full is the same for the gradients (`.grad`; a parameter without one gives zeros). */
TD_API td_status td_tp_grads_full(td_process_group *pg, td_module *root, td_tensor_list *out);

/* td_tp_set_sequence_parallel switches every tensor-parallel layer under root to sequence
 * parallelism along dimension seq_dim (-1: back to f and g): column layers all-gather their
 * input along it, row layers and vocabulary embeddings reduce-scatter their output along it. */
TD_API td_status td_tp_set_sequence_parallel(td_module *root, int seq_dim);

/* td_tp_sync_sequence_parallel_grads sums over the group the gradient of every whole (not split)
 * parameter under root: with sequence parallelism each member computed it from its part of the
 * sequence. A parameter without a gradient takes part with zeros (and gets them). Collective. */
TD_API td_status td_tp_sync_sequence_parallel_grads(td_process_group *pg, td_module *root);

/* td_tp_clip_grad_norm clips the gradients of the split model as torch.nn.utils.clip_grad_norm_
 * (norm 2) clips the single-process model's: the squares of the split parameters' gradients are
 * summed over the group, those of the whole ones counted once. *total_norm (may be NULL) gets the
 * norm before clipping, equal on every member. Collective. */
TD_API td_status td_tp_clip_grad_norm(td_process_group *pg, td_module *root, double max_norm,
                                      double *total_norm);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_PARALLEL_H */
