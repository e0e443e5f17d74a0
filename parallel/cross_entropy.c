/* cross_entropy.c - the vocabulary-parallel cross entropy (Megatron's
 * vocab_parallel_cross_entropy): each member holds the logits of its vocabulary columns.
 *
 * Forward, per row n (all sums in double):
 *   m_n = max over the group of the member's largest valid logit        one MAX all-reduce [N]
 *   S_n = sum over the group of sum_j exp(l_nj - m_n)                    one SUM all-reduce [2N]
 *   t_n = the target's logit minus m_n (from the member that holds it;   (S and t together)
 *         0 from the others)
 *   loss = mean over the rows whose target is not ignore_index of log S_n - t_n
 * The member keeps its softmax columns exp(l - m) / S for the backward, which is local:
 *   dL/dl_nj = (softmax_nj - [j is the target]) * grad / count.
 * Padding columns (global index >= vocab_size) are left out of the max and the sums, and get a
 * zero gradient. Targets are checked before any collective (every member sees the same targets,
 * so every member fails alike).
 */
#include <math.h>
#include <string.h>

#include "parallel_impl.h"

typedef struct ce_ctx {
  td_tensor *probs;  /* [N, Vl] softmax of the member's columns (0 for padding), logits' dtype */
  td_tensor *target; /* [N] int64, contiguous */
  int64_t start, valid, ignore_index;
  double count;      /* rows that count */
} ce_ctx;

static void ce_free(void *v) {
  ce_ctx *c = v;
  td_tensor_unref(c->probs);
  td_tensor_unref(c->target);
  td__free(c);
}

static td_status ce_backward(void *v, td_tensor *const *grad_outputs, int n_outputs,
                             td_tensor **grad_inputs, int n_inputs) {
  ce_ctx *c = v;
  if (n_outputs != 1 || n_inputs != 1)
    return td_set_error(TD_ERR_INTERNAL, "VocabParallelCrossEntropyBackward: %d outputs, %d "
                        "inputs", n_outputs, n_inputs);
  if (!grad_outputs[0]) {
    grad_inputs[0] = NULL;
    return TD_OK;
  }
  double g = 0;
  TD_TRY(td_tensor_item(grad_outputs[0], &g));
  int64_t N = td_tensor_size(c->probs, 0), Vl = td_tensor_size(c->probs, 1);
  td_tensor *gi = NULL;
  TD_TRY(td_tensor_empty(td_tensor_shape(c->probs), 2, td_tensor_dtype(c->probs),
                         td_device_cpu(), &gi));
  const int64_t *tg = td_tensor_data(c->target);
  double scale = g / c->count;
  bool f64 = td_tensor_dtype(gi) == TD_DTYPE_F64;
  for (int64_t n = 0; n < N; n++) {
    bool skip = tg[n] == c->ignore_index;
    int64_t own = tg[n] - c->start; /* the target's column here, if it is this member's */
    for (int64_t j = 0; j < Vl; j++) {
      double pr = f64 ? ((const double *)td_tensor_data(c->probs))[n * Vl + j]
                      : (double)((const float *)td_tensor_data(c->probs))[n * Vl + j];
      double d = skip || j >= c->valid ? 0.0 : (pr - (j == own ? 1.0 : 0.0)) * scale;
      if (f64) ((double *)td_tensor_data(gi))[n * Vl + j] = d;
      else ((float *)td_tensor_data(gi))[n * Vl + j] = (float)d;
    }
  }
  grad_inputs[0] = gi;
  return TD_OK;
}

/* check validates the arguments and the targets (before any collective). */
static td_status check(td_process_group *pg, const td_tensor *logits, const td_tensor *target,
                       int64_t vocab, int64_t ignore, const char *who) {
  char b1[96], b2[96];
  TD_CHECK_ARG(pg && logits && target, "%s: NULL argument", who);
  td_dtype dt = td_tensor_dtype(logits);
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "%s: logits are %s (float32 or float64 only)", who,
                        td_dtype_name(dt));
  if (td_tensor_dtype(target) != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s: target must be int64, not %s", who,
                        td_dtype_name(td_tensor_dtype(target)));
  if (td_tensor_device(logits).type != TD_DEVICE_CPU ||
      td_tensor_device(target).type != TD_DEVICE_CPU)
    return td_set_error(TD_ERR_UNSUPPORTED, "%s: CPU tensors only", who);
  if (td_tensor_ndim(logits) != 2 || td_tensor_ndim(target) != 1 ||
      td_tensor_size(target, 0) != td_tensor_size(logits, 0))
    return td_set_error(TD_ERR_SHAPE, "%s: logits %s and target %s, expected [N, Vl] and [N]",
                        who, td_tensor_shape_str(logits, b1, sizeof b1),
                        td_tensor_shape_str(target, b2, sizeof b2));
  int p = td_process_group_size(pg);
  int64_t Vl = td_tensor_size(logits, 1);
  if (vocab <= 0 || vocab > Vl * p)
    return td_set_error(TD_ERR_SHAPE, "%s: vocab_size %lld does not fit %d members of %lld "
                        "columns", who, (long long)vocab, p, (long long)Vl);
  return TD_OK;
}

td_status td_tp_vocab_parallel_cross_entropy(td_process_group *pg, const td_tensor *logits,
                                             const td_tensor *target, int64_t vocab_size,
                                             int64_t ignore_index, td_tensor **out) {
  const char *who = "td_tp_vocab_parallel_cross_entropy";
  td_dtype ldt = logits ? td_tensor_dtype(logits) : TD_DTYPE_F32;
  if (td_autocast_dtype(NULL) && (ldt == TD_DTYPE_BF16 || ldt == TD_DTYPE_F16)) {
    /* a loss: computed in float32 under autocast, as td_tensor_cross_entropy (tensor.h) */
    td_tensor *l32 = NULL;
    TD_TRY(td_tensor_to_dtype(logits, TD_DTYPE_F32, &l32));
    td_status st = td_tp_vocab_parallel_cross_entropy(pg, l32, target, vocab_size, ignore_index,
                                                      out);
    td_tensor_unref(l32);
    return st;
  }
  TD_TRY(check(pg, logits, target, vocab_size, ignore_index, who));
  TD_CHECK_ARG(out, "%s: NULL out", who);
  int r = td_process_group_rank(pg);
  int64_t N = td_tensor_size(logits, 0), Vl = td_tensor_size(logits, 1), start = r * Vl;
  int64_t valid = vocab_size - start < 0 ? 0 : (vocab_size - start > Vl ? Vl : vocab_size - start);
  bool f64 = td_tensor_dtype(logits) == TD_DTYPE_F64;
  td_tensor *l = NULL, *tg = NULL, *mx = NULL, *st2 = NULL, *probs = NULL, *loss = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_tensor_contiguous(logits, &l);
  if (st == TD_OK) st = td_tensor_contiguous(target, &tg);
  const int64_t *t = st == TD_OK ? td_tensor_data(tg) : NULL;
  double count = 0;
  for (int64_t n = 0; n < N && st == TD_OK; n++) {
    if (t[n] == ignore_index) continue;
    if (t[n] < 0 || t[n] >= vocab_size)
      st = td_set_error(TD_ERR_INVALID, "%s: target %lld at row %lld is outside [0, %lld)", who,
                        (long long)t[n], (long long)n, (long long)vocab_size);
    count += 1;
  }
  int64_t nn = N, n2 = 2 * N;
  if (st == TD_OK) st = td_tensor_empty(&nn, 1, TD_DTYPE_F64, td_device_cpu(), &mx);
  if (st == TD_OK) st = td_tensor_empty(&n2, 1, TD_DTYPE_F64, td_device_cpu(), &st2);
  if (st == TD_OK)
    st = td_tensor_empty(td_tensor_shape(l), 2, td_tensor_dtype(l), td_device_cpu(), &probs);
#define LOGIT(n, j) \
  (f64 ? ((const double *)td_tensor_data(l))[(n) * Vl + (j)] \
       : (double)((const float *)td_tensor_data(l))[(n) * Vl + (j)])
  if (st == TD_OK) {
    double *m = td_tensor_data(mx);
    for (int64_t n = 0; n < N; n++) {
      double v = -INFINITY;
      for (int64_t j = 0; j < valid; j++) {
        double x = LOGIT(n, j);
        if (x > v || isnan(x)) v = x; /* NaN propagates, as the all-reduce's MAX does */
      }
      m[n] = v;
    }
    st = td_process_group_all_reduce(pg, mx, TD_REDUCE_MAX);
  }
  if (st == TD_OK) {
    const double *m = td_tensor_data(mx);
    double *s = td_tensor_data(st2); /* [0, N): sums of exponentials; [N, 2N): target logits */
    for (int64_t n = 0; n < N; n++) {
      double sum = 0;
      for (int64_t j = 0; j < Vl; j++) {
        double e = j < valid ? exp(LOGIT(n, j) - m[n]) : 0.0;
        sum += e;
        if (f64) ((double *)td_tensor_data(probs))[n * Vl + j] = e;
        else ((float *)td_tensor_data(probs))[n * Vl + j] = (float)e; /* scaled below */
      }
      s[n] = sum;
      int64_t own = t[n] - start;
      s[N + n] = t[n] != ignore_index && own >= 0 && own < valid ? LOGIT(n, own) - m[n] : 0.0;
    }
    st = td_process_group_all_reduce(pg, st2, TD_REDUCE_SUM);
  }
#undef LOGIT
  if (st == TD_OK) {
    const double *s = td_tensor_data(st2);
    double total = 0;
    for (int64_t n = 0; n < N; n++) {
      if (t[n] != ignore_index) total += log(s[n]) - s[N + n];
      for (int64_t j = 0; j < Vl; j++) {
        if (f64) ((double *)td_tensor_data(probs))[n * Vl + j] /= s[n];
        else ((float *)td_tensor_data(probs))[n * Vl + j] /= (float)s[n];
      }
    }
    st = td_tensor_scalar(total / count, td_tensor_dtype(l), td_device_cpu(), &loss);
  }
  td_autograd_set_enabled(prev);
  if (st == TD_OK && td_tensor_requires_grad(logits) && td_autograd_is_enabled()) {
    ce_ctx *c = td__calloc(1, sizeof *c);
    if (!c) st = td_set_error(TD_ERR_NOMEM, "%s: out of memory", who);
    td_node *node = NULL;
    if (st == TD_OK) {
      c->probs = td_tensor_ref(probs);
      c->target = td_tensor_ref(tg);
      c->start = start;
      c->valid = valid;
      c->ignore_index = ignore_index;
      c->count = count;
      td_tensor *in = (td_tensor *)logits;
      st = td_node_create_external("VocabParallelCrossEntropyBackward", 1, &in, 1, ce_backward,
                                   c, ce_free, &node);
    }
    if (st == TD_OK) st = td_autograd_attach(loss, node, 0, out);
    td_node_unref(node);
  } else if (st == TD_OK) {
    *out = td_tensor_ref(loss);
  }
  td_tensor *all[] = {l, tg, mx, st2, probs, loss};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  return st;
}
