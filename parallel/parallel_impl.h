/* parallel_impl.h - what the files of parallel/ share: the layers' state (so that the split of a
 * parameter can be found by walking a module tree), the cutting of whole tensors into a member's
 * slice and the joining of the slices, and the collectives without autograd that the mappings
 * and layers use.
 *
 *   mappings.c       Megatron's f / g operators and the sequence-parallel pair, as external
 *                    autograd nodes.
 *   layers.c         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding; cutting
 *                    and joining; td_tp_param_split, td_tp_state_dict_full, td_tp_grads_full,
 *                    td_tp_clip_grad_norm.
 *   cross_entropy.c  the vocabulary-parallel cross entropy.
 *   gpt.c            the GPT's attention, MLP, block and model over the layers.
 */
#ifndef TD_PARALLEL_IMPL_H
#define TD_PARALLEL_IMPL_H

#include "../core/core.h"
#include "tdist/autograd.h"
#include "tdist/parallel.h"

/* Up to this many members, per-member arrays live on the stack. */
#define TD__MAX_GROUP_PARTS 16

typedef enum td__tp_kind {
  TD__TP_COLUMN = 1,
  TD__TP_ROW = 2,
  TD__TP_VOCAB = 3,
} td__tp_kind;

/* The state of a tensor-parallel layer module. */
typedef struct td__tp_layer {
  td_process_group *pg; /* borrowed: must outlive the module */
  td__tp_kind kind;
  bool flag;            /* column: gather_output; row: input_is_parallel */
  int stride;           /* column: parts of the output dimension split separately (1 or 3) */
  int64_t in, out;      /* whole Linear sizes; for the embedding: V and D */
  int64_t padded;       /* embedding: V rounded up to a multiple of the group size */
  int64_t start;        /* embedding: first row of this member's slice */
  int seq_dim;          /* >= 0: sequence parallel along this dimension (the input of a column
                           layer is all-gathered along it, the output of a row layer or the
                           embedding reduce-scattered); -1: not (f and g) */
} td__tp_layer;

/* td__tp_layer_of returns m's layer state when m is a tensor-parallel layer, else NULL. */
const td__tp_layer *td__tp_layer_of(const td_module *m);

/* td__tp_linear_from cuts a Linear into a column-parallel (flag: gather_output; the output
 * dimension made of `stride` parts split separately, padded to padded_out when > 0) or
 * row-parallel (flag: input_is_parallel) layer. */
td_status td__tp_linear_from(td_process_group *pg, const td_module *linear, td__tp_kind kind,
                             bool flag, int stride, int64_t padded_out, td_module **out);

/* td__tp_cut returns member r's slice (of p) of whole along dim: whole's size there (padded with
 * zeros to `padded` first) is made of `stride` equal parts, each cut into p pieces; the slice is
 * piece r of every part, joined. A contiguous copy that requires grad when whole is float. */
td_status td__tp_cut(const td_tensor *whole, int dim, int stride, int64_t padded, int p, int r,
                     td_tensor **out);

/* td__tp_join is td__tp_cut's inverse over the group: all-gathers the members' slices and
 * returns the whole tensor with `full` entries along dim (padding dropped). Collective. */
td_status td__tp_join(td_process_group *pg, const td_tensor *slice, int dim, int stride,
                      int64_t full, td_tensor **out);

/* ---- collectives without autograd (new tensors; the input is not modified) ---- */

/* td__tp_all_reduce returns the group sum (or max) of x. */
td_status td__tp_all_reduce(td_process_group *pg, const td_tensor *x, td_reduce_op op,
                            td_tensor **out);
/* td__tp_gather returns the members' x joined along dim. */
td_status td__tp_gather(td_process_group *pg, const td_tensor *x, int dim, td_tensor **out);
/* td__tp_split returns this member's slice along dim (a contiguous copy). */
td_status td__tp_split(td_process_group *pg, const td_tensor *x, int dim, td_tensor **out);
/* td__tp_reduce_scatter returns this member's slice along dim of the group sum of x. */
td_status td__tp_reduce_scatter(td_process_group *pg, const td_tensor *x, int dim,
                                td_tensor **out);

/* td__tp_check_divisible fails with TD_ERR_INVALID naming what, n and the group size when n is
 * not a multiple of the group size. */
td_status td__tp_check_divisible(const char *who, const char *what, int64_t n, int p);

#endif /* TD_PARALLEL_IMPL_H */
