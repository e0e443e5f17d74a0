/* tensor_impl.h - internals shared by the tensor, autograd and op files (never installed).
 *
 * Layout:
 *   td_storage   reference-counted block of device memory (or a borrowed host buffer).
 *   td_tensor    view: shape, strides (elements), offset (elements) over one storage, plus the
 *                autograd fields (requires_grad, grad, grad_fn, output_nr, hooks).
 *   td_node      backward node: a vtable (td__node_ops), next edges, output metadata, hooks.
 *   td__backend  per-device kernel table; ops in tensor/ops_*.c are device independent and call
 *                kernels through td__backend_of(tensor). CPU kernels live in tensor/cpu_*.c,
 *                CUDA kernels under tensor/cuda/.
 *
 * How to write a differentiable op (see ops_binary.c for a model):
 *   1. check arguments; set td_set_error() with the op's name and the shapes on failure;
 *   2. allocate the result with td__tensor_new() and run the kernel through the backend;
 *   3. if td__needs_grad2(a, b): node = td__node_new(sizeof(my_node), &my_ops, 1, 2);
 *      td__node_set_next(node, 0, a); td__node_set_next(node, 1, b); save what backward needs
 *      (td_tensor_ref'd tensors, scalars) in my_node; td__tensor_set_history(out, node, 0);
 *      td_node_unref(node);
 *   4. backward(self, grad_out, grad_in) computes grad_in[i] for each i where
 *      td__node_needs_grad(self, i), using the public ops (grad mode is off while backward runs,
 *      so nothing is recorded); release_saved() drops the saved tensors.
 */
#ifndef TD_TENSOR_IMPL_H
#define TD_TENSOR_IMPL_H

#include <pthread.h>
#include <string.h>

#include "../core/core.h"
#include "../core/refcount.h"
#include "tdist/autograd.h"
#include "tdist/tensor.h"

/* ---- storage and tensor ---- */

typedef struct td__storage {
  td__refcnt rc;
  void *data;    /* host or device address */
  size_t nbytes; /* capacity in bytes */
  td_device device;
  td_tensor_release_fn release; /* borrowed buffers: called instead of the backend free */
  void *release_ctx;
  bool borrowed;
} td__storage;

typedef struct td__hook {
  struct td__hook *next;
  int handle;
  int output_nr; /* for node pre-hooks: which output the hook watches */
  td_grad_hook_fn fn;
  void *ctx;
} td__hook;

struct td_tensor {
  td__refcnt rc;
  td__storage *storage;
  int64_t offset; /* elements */
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t strides[TD_MAX_DIMS]; /* elements */
  td_dtype dtype;
  /* autograd */
  bool requires_grad;
  td_node *grad_fn; /* owned reference or NULL (leaf) */
  int output_nr;
  pthread_mutex_t grad_mu; /* guards grad, hooks and grad_acc */
  td_tensor *grad;         /* leaf gradient (owned) or NULL */
  td__hook *hooks;         /* leaf hooks */
  td_node *grad_acc;       /* leaf: its AccumulateGrad node while one exists (no reference: the
                              node holds the leaf and clears this as it dies), so every use of the
                              leaf feeds one node, as PyTorch's grad_accumulator_ */
};

/* td__tensor_new allocates a contiguous tensor with fresh storage on dev. */
td_status td__tensor_new(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                         td_tensor **out);
/* td__tensor_new_like allocates a contiguous tensor of t's shape, dtype and device. */
td_status td__tensor_new_like(const td_tensor *t, td_tensor **out);
/* td__tensor_view makes a view over t's storage with the given geometry (no autograd). */
td_status td__tensor_view(const td_tensor *t, const int64_t *shape, const int64_t *strides,
                          int ndim, int64_t offset, td_tensor **out);
/* td__contiguous_strides fills row-major strides for shape. */
void td__contiguous_strides(const int64_t *shape, int ndim, int64_t *strides);
int64_t td__shape_numel(const int64_t *shape, int ndim);
/* td__norm_dim turns a possibly negative dim into [0, ndim); returns -1 when out of range. */
int td__norm_dim(int dim, int ndim);
/* td__broadcast_shape computes the broadcast shape of a and b into out/out_ndim;
 * TD_ERR_SHAPE (with a message naming op) when incompatible. */
td_status td__broadcast_shape(const char *op, const int64_t *a, int an, const int64_t *b, int bn,
                              int64_t *out, int *out_ndim);
/* td__expand_view returns a view of t broadcast to shape (stride 0 in broadcast dims). */
td_status td__expand_view(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out);
/* td__sum_to reduces grad (broadcast shape) back to shape by summing broadcast dims. */
td_status td__sum_to(const td_tensor *grad, const int64_t *shape, int ndim, td_tensor **out);
/* td__check_same_device returns TD_ERR_DEVICE naming op when a and b are on different devices. */
td_status td__check_same_device(const char *op, const td_tensor *a, const td_tensor *b);
/* td__check_compute returns TD_ERR_DTYPE naming op when t has a transport-only dtype (float16,
 * bfloat16, int32, uint8, bool: see tensor.h); every op that runs a kernel other than copy and
 * fill on a tensor not already checked with td__check_float calls it first. */
td_status td__check_compute(const char *op, const td_tensor *t);
/* td__check_float returns TD_ERR_DTYPE naming op unless t is float32/float64. */
td_status td__check_float(const char *op, const td_tensor *t);
/* Autocast (tensor/autocast.c). td__autocast_lower returns in *out t converted to this thread's
 * autocast dtype when autocast is on and t is a floating CPU tensor of another dtype (weights
 * through the per-scope cache), else a new reference to t (NULL for NULL). td__autocast_f32 does
 * the same for the float32 ops: a 16-bit t becomes float32 while autocast is on. */
td_status td__autocast_lower(const td_tensor *t, td_tensor **out);
td_status td__autocast_f32(const td_tensor *t, td_tensor **out);
/* td__autocast_suspend turns autocast off on this thread until td__autocast_resume(previous
 * value) (the engine, around backward functions). */
bool td__autocast_suspend(void);
void td__autocast_resume(bool prev);
/* td__autocast_args converts the n tensors of in (NULL entries allowed) for an op entered under
 * autocast: to the autocast dtype (lower) or to float32 (!lower). out[i] gets a new reference
 * (NULL for NULL); *changed tells whether any tensor was converted. On failure nothing is held. */
td_status td__autocast_args(bool lower, const td_tensor *const *in, td_tensor **out, int n,
                            bool *changed);
/* TD__AUTOCAST(lower, n, (a, b, ...), CALL): at an op's entry, when autocast is on and converts
 * any of the n listed tensors, runs CALL with them replaced by the converted ones (CALL names them
 * ac_t[0], ac_t[1], ...: normally the op itself again) and returns its status. */
#define TD__AUTOCAST(lower, n, ARGS, CALL)                                                    \
  do {                                                                                        \
    if (td_autocast_dtype(NULL)) {                                                            \
      const td_tensor *ac_in[n] = {TD__UNPAREN ARGS};                                         \
      td_tensor *ac_t[n];                                                                     \
      bool ac_changed = false;                                                                \
      td_status ac_st = td__autocast_args(lower, ac_in, ac_t, n, &ac_changed);                \
      if (ac_st != TD_OK) return ac_st;                                                       \
      if (ac_changed) ac_st = CALL;                                                           \
      for (int ac_i = 0; ac_i < (n); ac_i++) td_tensor_unref(ac_t[ac_i]);                     \
      if (ac_changed) return ac_st;                                                           \
    }                                                                                         \
  } while (0)
#define TD__UNPAREN(...) __VA_ARGS__
/* td__promote_float returns the dtype two floating dtypes compute in: the wider one; bfloat16
 * with float16 gives float32 (neither holds the other). */
td_dtype td__promote_float(td_dtype a, td_dtype b);
/* td__check_same_dtype returns TD_ERR_DTYPE naming op when dtypes differ. */
td_status td__check_same_dtype(const char *op, const td_tensor *a, const td_tensor *b);
/* td__shape_str formats a shape "[2, 3]" into buf. */
const char *td__shape_str(const int64_t *shape, int ndim, char *buf, size_t n);

/* ---- autograd internals ---- */

typedef struct td__node_ops {
  const char *name;
  /* backward: grad_out has node->n_outputs entries (never NULL: missing gradients are zero
   * tensors); store a new reference or NULL in each grad_in[0..n_inputs). */
  td_status (*backward)(td_node *self, td_tensor *const *grad_out, td_tensor **grad_in);
  /* release_saved: drop saved tensors (called after backward without retain_graph, and on
   * destruction). May be NULL. */
  void (*release_saved)(td_node *self);
  /* destroy: free anything else the node owns; runs once, after release_saved, when the last
   * reference goes. May be NULL. */
  void (*destroy)(td_node *self);
} td__node_ops;

typedef struct td__edge {
  td_node *node; /* owned reference, NULL = no gradient needed */
  int input_nr;  /* which output of `node` this edge feeds */
} td__edge;

typedef struct td__out_meta {
  bool valid; /* false until a tensor was attached as this output */
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  td_dtype dtype;
  td_device device;
} td__out_meta;

struct td_node {
  td__refcnt rc;
  const td__node_ops *ops;
  uint64_t seq;       /* creation order; later nodes run first */
  int n_outputs;      /* forward outputs = backward gradient inputs */
  int n_inputs;       /* forward inputs = next edges */
  td__edge *next;     /* n_inputs edges */
  td__out_meta *outs; /* n_outputs output metadata (to build zero gradients) */
  bool released;      /* saved tensors were dropped */
  pthread_mutex_t mu; /* guards hooks and released */
  td__hook *hooks;    /* pre-hooks on outputs */
  td_tensor *leaf;    /* AccumulateGrad only: the leaf (owned) */
};

/* td__node_new allocates a node of `size` bytes (size >= sizeof(td_node); a derived struct puts
 * td_node first) with zeroed edges. Returns NULL on allocation failure. */
td_node *td__node_new(size_t size, const td__node_ops *ops, int n_outputs, int n_inputs);
/* td__node_set_next points edge i at input's history: its grad_fn, or an AccumulateGrad node for a
 * leaf that requires grad, or nothing. */
td_status td__node_set_next(td_node *node, int i, const td_tensor *input);
/* td__node_needs_grad returns true when edge i leads somewhere. */
bool td__node_needs_grad(const td_node *node, int i);
/* td__needs_grad returns true when grad mode is on and t requires grad. */
bool td__needs_grad(const td_tensor *t);
bool td__needs_grad2(const td_tensor *a, const td_tensor *b);
/* td__tensor_set_history makes out the output_nr'th output of node (sets requires_grad, records
 * the output's metadata in node). */
void td__tensor_set_history(td_tensor *out, td_node *node, int output_nr);
/* td__record is the shortcut for ops with one output: when grad mode is on and any of inputs
 * (NULL entries allowed) requires grad, it builds a node with td__node_new(size, ops, 1,
 * n_inputs), sets edge i from inputs[i], makes out its output 0, and returns the node (borrowed:
 * out owns it) so the caller can fill its saved fields. Returns NULL when no grad is needed, or on
 * failure, in which case *st is set (st is left alone otherwise). */
td_node *td__record(td_tensor *out, size_t size, const td__node_ops *ops,
                    const td_tensor *const *inputs, int n_inputs, td_status *st);

/* td__autograd_pass_opts returns the options of the innermost backward pass running on this
 * thread (NULL when none runs, or when it runs with the defaults). A nested pass started from a
 * node's backward (a checkpoint's recompute) takes its gradient map from here. */
const td_backward_opts *td__autograd_pass_opts(void);

/* ---- activation checkpointing (checkpoint.c) ---- */

/* td__rng_note tells the checkpointed regions running forward on this thread (if any) that an op
 * is about to draw from g, so each records g's state before its first draw (for the replay).
 * Every op that draws from a td_generator calls it first (td_tensor_dropout, the random fills). */
void td__rng_note(td_generator *g);
/* td__generator_clone makes a generator in g's exact state; td__generator_copy_state sets dst's
 * state to src's (tensor.c, where the generator's layout lives). */
td_status td__generator_clone(const td_generator *g, td_generator **out);
void td__generator_copy_state(td_generator *dst, const td_generator *src);

/* td__contig returns a new reference to t when it is contiguous, else a contiguous copy made
 * through the backend (no autograd history). */
td_status td__contig(const td_tensor *t, td_tensor **out);
/* td__grad_prep returns g as a contiguous tensor of dtype dt (for backward functions). */
td_status td__grad_prep(const td_tensor *g, td_dtype dt, td_tensor **out);
/* td__plain_view returns a history-free view of t's storage with a contiguous layout of shape. */
td_status td__plain_view(const td_tensor *t, const int64_t *shape, int ndim, td_tensor **out);
/* TD__NEED_KERNEL returns TD_ERR_UNSUPPORTED from the enclosing op when the device's backend lacks
 * a kernel. */
#define TD__NEED_KERNEL(be, entry, op)                                                       \
  do {                                                                                       \
    if (!(be)->entry)                                                                        \
      return td_set_error(TD_ERR_UNSUPPORTED, "%s: backend %s has no %s kernel", op,        \
                          (be)->name, #entry);                                               \
  } while (0)

/* td__binary_raw computes op(a, b) (a td__binary_op) with broadcasting, without autograd. */
td_status td__binary_raw(int op, const td_tensor *a, const td_tensor *b, td_tensor **out);

/* ---- per-device kernel table ---- */

typedef enum td__binary_op {
  TD__BIN_ADD,
  TD__BIN_SUB,
  TD__BIN_MUL,
  TD__BIN_DIV,
  TD__BIN_MAX,
  TD__BIN_MIN,
  TD__BIN_EQ, /* 1 where equal else 0 (same dtype as inputs) */
  TD__BIN_GT, /* 1 where a > b else 0 */
} td__binary_op;

typedef enum td__unary_op {
  TD__UN_AFFINE, /* y = p0 * x + p1 */
  TD__UN_POW,    /* y = x ^ p0 */
  TD__UN_EXP,
  TD__UN_LOG,
  TD__UN_SQRT,
  TD__UN_TANH,
  TD__UN_SIGMOID,
  TD__UN_RELU,
  TD__UN_GELU,
  TD__UN_ABS,
} td__unary_op;

/* Geometry of a batch of attention problems (td__backend.attention): problem b of operand X
 * (one of TD__ATT_*) starts at element off[X][b] of X's data, its rows rs[X] elements apart,
 * each row contiguous. q is [L, E], k [S, E], v [S, Ev], y and gy [L, Ev] per problem. */
enum { TD__ATT_Q, TD__ATT_K, TD__ATT_V, TD__ATT_Y, TD__ATT_GY, TD__ATT_GQ, TD__ATT_GK, TD__ATT_GV,
       TD__ATT_N };
typedef struct td__attn_geom {
  int64_t nb, L, S, E, Ev;
  bool causal;  /* row i sees keys 0..i only */
  double scale; /* factor on q k^T */
  const int64_t *off[TD__ATT_N]; /* nb offsets per operand; NULL for operands not used */
  int64_t rs[TD__ATT_N];         /* row strides in elements */
  /* The same offsets as batch dims and strides (for kernels that compute them on the device):
   * off[X][b] = sum_d idx_d(b) * bstride[X][d], idx(b) the row-major multi-index of b over
   * bshape[0..nbd). */
  int nbd;
  int64_t bshape[TD_MAX_DIMS];
  int64_t bstride[TD__ATT_N][TD_MAX_DIMS];
} td__attn_geom;

/* Per-step constants of the fused Adam kernel (td__backend.adam), from td_tensor_adam_. */
typedef struct td__adam_consts {
  double beta1, beta2, eps;
  double l2;        /* Adam's weight decay added to the gradient (0 for AdamW) */
  double decay;     /* AdamW's factor on the weights, 1 - lr * weight_decay (1 for Adam) */
  double step_size; /* lr / (1 - beta1^step) */
  double bc2_sqrt;  /* sqrt(1 - beta2^step) */
  bool maximize;
} td__adam_consts;

typedef struct td__backend {
  const char *name;
  /* Memory. */
  td_status (*alloc)(int device_index, size_t nbytes, void **out);
  void (*free)(int device_index, void *p);
  /* Host <-> device copies of contiguous bytes (CPU backend: memcpy). */
  td_status (*copy_h2d)(int device_index, void *dst, const void *src, size_t nbytes);
  td_status (*copy_d2h)(int device_index, void *dst, const void *src, size_t nbytes);
  /* dst[i] = (dst dtype) src[i] for arbitrary strides on both sides; same shape; same device. */
  td_status (*copy)(td_tensor *dst, const td_tensor *src);
  /* Every element of t (any strides) = value. */
  td_status (*fill)(td_tensor *t, double value);
  /* out = op(a, b); a, b, out have the same shape and dtype; a and b may have any strides
   * (including 0 for broadcast); out may alias a (in-place). */
  td_status (*binary)(td__binary_op op, const td_tensor *a, const td_tensor *b, td_tensor *out);
  /* out = op(x; p0, p1); x and out same shape and dtype, any strides, out may alias x. */
  td_status (*unary)(td__unary_op op, const td_tensor *x, td_tensor *out, double p0, double p1);
  /* gx = dy * op'(x) (y = op(x) given for ops that use it); all contiguous, same shape. */
  td_status (*unary_backward)(td__unary_op op, const td_tensor *x, const td_tensor *y,
                              const td_tensor *gy, td_tensor *gx, double p0, double p1);
  /* Contiguous x viewed as [outer, r, inner]: out[o, i] = sum_k x[o, k, i]. */
  td_status (*reduce_sum)(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                          td_tensor *out);
  /* Same view: out = max over k, idx (int64, may be NULL) = first arg-max. */
  td_status (*reduce_max)(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                          td_tensor *out, td_tensor *idx);
  /* Batched GEMM on contiguous row-major matrices:
   * C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] with op = transpose when trans*; A is
   * [M,K] (or [K,M] when transa), B is [K,N] (or [N,K]), C is [M,N]. Batch strides in elements
   * (0 broadcasts one matrix across the batch). Pointers are element 0 of each operand. */
  td_status (*gemm)(td_dtype dt, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                    double alpha, const void *a, int64_t stride_a, const void *b,
                    int64_t stride_b, double beta, void *c, int64_t stride_c, int64_t batch);
  /* Optional (NULL where absent): one GEMM with a bias, C = op(A) @ op(B) + bias on every row
   * (bias [N] contiguous, C [M,N]), the bias added by the GEMM itself (linear's forward; without
   * it linear copies the bias into C first and runs gemm with beta 1). TD_ERR_UNSUPPORTED with no
   * error set when the backend cannot take the case: the caller falls back. */
  td_status (*gemm_bias)(td_dtype dt, bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                         const void *a, const void *b, const void *bias, void *c);
  /* Softmax (or log-softmax when log) over the middle dim of contiguous [outer, r, inner]. */
  td_status (*softmax)(const td_tensor *x, int64_t outer, int64_t r, int64_t inner, bool log,
                       td_tensor *y);
  /* Backward given y = softmax(x) (or log_softmax) and gy: gx. */
  td_status (*softmax_backward)(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                int64_t r, int64_t inner, bool log, td_tensor *gx);
  /* NLL over logp [N, C] contiguous and target int64 [N]; out: losses [N] (0 for ignored),
   * *count = number of non-ignored targets. Out-of-range targets -> TD_ERR_INVALID. */
  td_status (*nll)(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                   td_tensor *losses, int64_t *count);
  /* gx[n, target[n]] = -gl[n] (gl: [N] per-sample upstream gradient); other entries 0. */
  td_status (*nll_backward)(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                            td_tensor *gx);
  /* im2col of one image x [C, H, W] (contiguous, element pointer) into col [C*kh*kw, oh*ow]. */
  td_status (*im2col)(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh, int kw,
                      int sh, int sw, int ph, int pw, void *col);
  /* col2im: accumulate col back into gx [C, H, W] (gx zeroed by the caller). */
  td_status (*col2im)(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                      int kw, int sh, int sw, int ph, int pw, void *gx);
  /* Max pooling on contiguous x [N, C, H, W] -> y [N, C, OH, OW] and idx (int64 flat h*W+w). */
  td_status (*max_pool2d)(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                          td_tensor *idx);
  /* gx (zeroed by caller, [N, C, H, W]) += gy scattered through idx. */
  td_status (*max_pool2d_backward)(const td_tensor *gy, const td_tensor *idx, td_tensor *gx);
  /* Contiguous x as [outer, r, inner]: out[o, j, i] = x[o, index[j], i] (index int64 [m], values
   * checked in range by the caller). */
  td_status (*index_select)(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                            const td_tensor *index, td_tensor *out);
  /* gx[o, index[j], i] += g[o, j, i] (gx contiguous [outer, r, inner], zeroed by the caller). */
  td_status (*index_add)(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                         const td_tensor *index, const td_tensor *g);
  /* Layer norm over the last dim of contiguous x [M, N]; w, b [N] or NULL; outputs y [M, N],
   * mean [M], rstd [M]. */
  td_status (*layer_norm)(const td_tensor *x, const td_tensor *w, const td_tensor *b, double eps,
                          td_tensor *y, td_tensor *mean, td_tensor *rstd);
  /* Backward: gx [M, N]; gw, gb [N] (either may be NULL when not needed). */
  td_status (*layer_norm_backward)(const td_tensor *gy, const td_tensor *x, const td_tensor *w,
                                   const td_tensor *mean, const td_tensor *rstd, td_tensor *gx,
                                   td_tensor *gw, td_tensor *gb);
  /* Optional (NULL: ops fall back to unary + binary): y += alpha * x, same shape and dtype, any
   * strides (y may not alias x). The optimizers' hot path. */
  td_status (*axpy)(td_tensor *y, double alpha, const td_tensor *x);
  /* Optional (NULL: the op reports TD_ERR_UNSUPPORTED): fused scaled-dot-product attention of
   * g->nb problems, y = softmax(scale q k^T with the causal mask) v; probs (may be NULL) gets
   * every problem's L x S probabilities, row-major, problems one after another, masked entries
   * 0. Pointers are element 0 of each tensor. */
  td_status (*attention)(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                         const void *v, void *y, void *probs);
  /* Its backward from gy and the saved probs: gq, gk, gv (each may be NULL when not needed) are
   * written, not accumulated. */
  td_status (*attention_backward)(td_dtype dt, const td__attn_geom *g, const void *q,
                                  const void *k, const void *v, const void *probs,
                                  const void *gy, void *gq, void *gk, void *gv);
  /* Optional (NULL: td_tensor_adam_ reports TD_ERR_UNSUPPORTED and optimizers compose the update
   * from the elementwise ops): one Adam / AdamW step on contiguous p, g, m, v of one dtype. */
  td_status (*adam)(td_tensor *p, const td_tensor *g, td_tensor *m, td_tensor *v,
                    const td__adam_consts *c);
  /* Optional (NULL: td_tensor_adam_multi_ calls adam once per parameter): the Adam / AdamW step
   * of n parameters at once (multi-tensor apply), c[i] the constants of parameter i; the op
   * layer has checked that all operands are contiguous, of one float dtype and on one device. */
  td_status (*adam_multi)(td_tensor *const *p, const td_tensor *const *g, td_tensor *const *m,
                          td_tensor *const *v, const td__adam_consts *c, int n);
  /* Optional (NULL: td_tensor_sum_squares composes mul + sum per tensor): *out = the sum over the
   * n tensors (any strides, one float dtype each, one device) of their squared elements,
   * accumulated in double; the one host synchronisation of a gradient-norm clip. */
  td_status (*sum_squares)(const td_tensor *const *ts, int n, double *out);
  /* Optional, preferred to attention / attention_backward when set (flash attention): the same
   * attention keeping each query row's log-sum-exp of its scaled scores, lse (may be NULL: no
   * backward) nb * L values of float32 (float64 for float64 operands), instead of the
   * probabilities; its backward recomputes the probabilities from q, k and lse, and takes y, the
   * forward's output, at g->off[TD__ATT_Y] / g->rs[TD__ATT_Y]. */
  td_status (*attention_lse)(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                             const void *v, void *y, void *lse);
  td_status (*attention_lse_backward)(td_dtype dt, const td__attn_geom *g, const void *q,
                                      const void *k, const void *v, const void *y,
                                      const void *lse, const void *gy, void *gq, void *gk,
                                      void *gv);
  /* Optional (NULL: cross_entropy is log_softmax + nll_loss): cross entropy fused, for logits
   * [N, C] (contiguous; float32 / float64, or a 16-bit float read into float32) and int64 target
   * [N] (any stride): losses [N] (0 for ignored rows) and lse [N] (each row's log-sum-exp), both
   * float32 (float64 for float64 logits), *count and bad targets as nll. */
  td_status (*cross_entropy)(const td_tensor *logits, const td_tensor *target,
                             int64_t ignore_index, td_tensor *losses, td_tensor *lse,
                             int64_t *count);
  /* Its backward: gx [N, C] in the logits' dtype = gl[n] (softmax(logits[n]) - onehot(target[n]))
   * computed in the losses' dtype and rounded once; zero rows for ignored targets. gl [N] (any
   * stride, the losses' dtype). */
  td_status (*cross_entropy_backward)(const td_tensor *logits, const td_tensor *target,
                                      const td_tensor *lse, const td_tensor *gl,
                                      int64_t ignore_index, td_tensor *gx);
} td__backend;

/* td__backend_for returns the kernel table for device d, or NULL (with td_set_error) when this
 * build has none. */
const td__backend *td__backend_for(td_device d);
/* td__backend_of is td__backend_for(t's device); t's device always has a backend. */
const td__backend *td__backend_of(const td_tensor *t);

extern const td__backend td__cpu_backend;
/* Set by tensor/cuda/ when the build has CUDA (NULL otherwise). */
extern const td__backend *td__cuda_backend;

/* TD__HD marks helpers shared by host and CUDA device code. */
#ifdef __CUDACC__
#define TD__HD __host__ __device__
#else
#define TD__HD
#endif

/* td__f2i64 converts a float to int64 the same way on every device: truncation toward zero, and
 * INT64_MIN for NaN, +-inf and values outside the int64 range (what PyTorch gives on the CPU; a
 * plain C cast is undefined there, and CUDA's conversion saturates, with NaN -> 0). */
static inline TD__HD int64_t td__f2i64(double v) {
  return v >= -9223372036854775808.0 && v < 9223372036854775808.0 ? (int64_t)v : INT64_MIN;
}

#include "half_convert.h"

/* td__f2i32 and td__f2u8 convert like td__f2i64 and then wrap to the narrower type (what a
 * float -> int64 -> int32 conversion gives in PyTorch). */
static inline int32_t td__f2i32(double v) { return (int32_t)(uint32_t)(uint64_t)td__f2i64(v); }
static inline uint8_t td__f2u8(double v) { return (uint8_t)(uint64_t)td__f2i64(v); }

/* Element access helpers for CPU code (every dtype, through double: exact for all of them but
 * int64 values beyond 2^53). */
static inline double td__load(const void *base, td_dtype dt, int64_t i) {
  switch (dt) {
    case TD_DTYPE_F32: return ((const float *)base)[i];
    case TD_DTYPE_F64: return ((const double *)base)[i];
    case TD_DTYPE_I64: return (double)((const int64_t *)base)[i];
    case TD_DTYPE_F16: return td__f16_to_f32(((const uint16_t *)base)[i]);
    case TD_DTYPE_BF16: return td__bf16_to_f32(((const uint16_t *)base)[i]);
    case TD_DTYPE_I32: return ((const int32_t *)base)[i];
    case TD_DTYPE_U8: return ((const uint8_t *)base)[i];
    case TD_DTYPE_BOOL: return ((const uint8_t *)base)[i] != 0;
  }
  return 0;
}
static inline void td__store(void *base, td_dtype dt, int64_t i, double v) {
  switch (dt) {
    case TD_DTYPE_F32: ((float *)base)[i] = (float)v; break;
    case TD_DTYPE_F64: ((double *)base)[i] = v; break;
    case TD_DTYPE_I64: ((int64_t *)base)[i] = td__f2i64(v); break;
    case TD_DTYPE_F16: ((uint16_t *)base)[i] = td__f32_to_f16((float)v); break;
    case TD_DTYPE_BF16: ((uint16_t *)base)[i] = td__f32_to_bf16((float)v); break;
    case TD_DTYPE_I32: ((int32_t *)base)[i] = td__f2i32(v); break;
    case TD_DTYPE_U8: ((uint8_t *)base)[i] = td__f2u8(v); break;
    case TD_DTYPE_BOOL: ((uint8_t *)base)[i] = v != 0; break;
  }
}

#endif
