/* nn.h - neural-network modules, parameter initialisation and safetensors state dicts.
 *
 * A td_module is an opaque, reference-counted object made of
 *   - a type (td_module_type): a name and a forward function, the vtable of the module;
 *   - a type-specific state pointer (configuration such as in_features) owned by the module;
 *   - named parameters (leaf tensors that require grad), named buffers (tensors saved in the
 *     state dict but not trained) and named child modules, each list in registration order.
 * Built-in modules (Linear, Conv2d, LSTM, Sequential, ...) are made with td_<kind>_create(); a
 * user-defined module fills a td_module_type and calls td_module_create(), then registers its
 * parameters and children. Parameter names are dotted paths through the children, exactly like
 * the keys of PyTorch's state_dict ("0.weight", "fc1.bias", "weight_ih_l0"), so a state dict
 * saved here loads in PyTorch and back.
 *
 * Forward: every module has a multi-tensor forward, td_module_forward_multi(m, in, n_in, out,
 * n_out); td_module_forward(m, x, &y) is its one-in, one-out form (what Sequential chains). Richer
 * modules also get a typed wrapper (td_lstm_forward). Outputs follow the tensor.h convention: on
 * TD_OK each out[i] holds a new reference, on failure out is untouched and td_last_error() says
 * which module and which shape was wrong. Around every forward run the module's hook entries
 * (td_module_add_forward_hooks); a module may be checkpointed (td_module_set_checkpoint: its
 * forward keeps only its inputs and runs again in backward, see td_checkpoint in autograd.h).
 *
 * Initialisation follows PyTorch 1.13's defaults (see each constructor). Every constructor takes
 * a td_generator; NULL means the process-wide default generator of this layer (deterministic,
 * reseeded with td_nn_manual_seed(), serialised by a mutex). Modules are created as float32 on
 * the CPU; td_module_to() and td_module_to_dtype() move or convert them (create an optimizer
 * afterwards: they replace the parameter tensors).
 *
 * State dicts are stored as safetensors files: an 8-byte little-endian header length, a JSON
 * header {"name": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}, "__metadata__":
 * {...}}, then the raw little-endian data. Reading validates the file fully and returns
 * TD_ERR_FORMAT for anything malformed.
 *
 * THREAD SAFETY: forward may run on one module from several threads at once (Dropout and LSTM
 * dropout serialise their generator internally). Structural calls (register, set_parameter, to,
 * to_dtype, load) must not run concurrently with anything else on the same module tree. The
 * factory registry and the default generator are safe from any thread.
 */
#ifndef TDIST_NN_H
#define TDIST_NN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/autograd.h"
#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_module td_module;

/* ---- lists of (optionally named) tensors ---- */

/* A td_tensor_list is caller-owned storage for a list of tensors, each optionally named. The list
 * owns one reference to every tensor and a copy of every name. Initialise with
 * td_tensor_list_init() (or zero it), release with td_tensor_list_fini(). */
typedef struct td_tensor_list {
  size_t n;            /* number of entries */
  td_tensor **tensors; /* n owned references; passable as `td_tensor *const *` */
  char **names;        /* n owned strings (an entry may be NULL for an unnamed tensor) */
  size_t cap;          /* allocated capacity (internal) */
} td_tensor_list;

/* td_tensor_list_init makes l an empty list. */
TD_API void td_tensor_list_init(td_tensor_list *l);
/* td_tensor_list_fini drops every reference and name and leaves l empty. NULL does nothing. */
TD_API void td_tensor_list_fini(td_tensor_list *l);
/* td_tensor_list_append adds (name, t); name may be NULL. Takes a new reference to t and copies
 * name. Duplicate names are not checked here. */
TD_API td_status td_tensor_list_append(td_tensor_list *l, const char *name, td_tensor *t);
/* td_tensor_list_find returns the tensor named name, or NULL. Borrowed; valid while l holds it. */
TD_API td_tensor *td_tensor_list_find(const td_tensor_list *l, const char *name);

/* ---- the module vtable and generic calls ---- */

/* td_module_forward_fn computes outputs[0..n_outputs) from inputs[0..n_inputs) (entries may be
 * NULL where the module documents an optional input). It must check the counts and shapes, store
 * a new reference in every output on TD_OK and leave outputs untouched on failure (with
 * td_set_error naming the module). It may run on several threads at once. */
typedef td_status (*td_module_forward_fn)(td_module *self, td_tensor *const *inputs,
                                          int n_inputs, td_tensor **outputs, int n_outputs);

/* A td_module_type describes a kind of module. It must outlive every module of that type (use
 * static storage). */
typedef struct td_module_type {
  /* Type name, e.g. "Linear" or "MyBlock". Required. */
  const char *name;
  /* Forward. Required. */
  td_module_forward_fn forward;
  /* Frees the state pointer given to td_module_create() when the module dies. May be NULL. */
  void (*destroy)(void *state);
} td_module_type;

/* td_module_create makes an empty module of the given type with the given state (may be NULL).
 * The new module is in training mode. On TD_OK the module owns state and calls type->destroy on
 * it when it dies; on failure the caller keeps state. Returns a new reference in *out; release
 * with td_module_unref(). */
TD_API td_status td_module_create(const td_module_type *type, void *state, td_module **out);
/* td_module_ref adds a reference and returns m. */
TD_API td_module *td_module_ref(td_module *m);
/* td_module_unref drops a reference; the last one releases parameters, buffers, children and
 * the state. NULL does nothing. */
TD_API void td_module_unref(td_module *m);
/* td_module_type_name returns the type's name ("Linear"). Never NULL; static storage. */
TD_API const char *td_module_type_name(const td_module *m);
/* td_module_get_type returns the module's type. Borrowed (static storage). */
TD_API const td_module_type *td_module_get_type(const td_module *m);
/* td_module_state returns the state pointer given to td_module_create(). Borrowed; valid while m
 * lives. */
TD_API void *td_module_state(const td_module *m);

/* td_module_forward runs the one-input, one-output forward: *y gets a new reference. Modules with
 * several inputs or outputs use their first (LSTM: output only, with zero initial state). */
TD_API td_status td_module_forward(td_module *m, const td_tensor *x, td_tensor **y);
/* td_module_forward_multi runs the full forward (see each module for its inputs and outputs). */
TD_API td_status td_module_forward_multi(td_module *m, td_tensor *const *inputs, int n_inputs,
                                         td_tensor **outputs, int n_outputs);

/* Forward hooks. Layers that manage a module watch its forward through hooks: ZeRO stage 3
 * gathers a unit's parameters before its forward and frees them after. pre runs before the
 * module's forward (an error stops the forward and is returned); post runs after it, also when it
 * failed (st is its status; outputs are then untouched), and may replace outputs[i] (release the
 * old reference, store a new one); its error is returned (outputs released). */
typedef td_status (*td_module_pre_hook_fn)(void *ctx, td_module *m);
typedef td_status (*td_module_post_hook_fn)(void *ctx, td_module *m, td_status st,
                                            td_tensor **outputs, int n_outputs);
/* td_module_add_forward_hooks adds an entry (pre, post, ctx) to m's forward hooks (either
 * function may be NULL, not both) and stores its handle in *handle (may be NULL) for
 * td_module_remove_forward_hooks. A module has any number of entries, each layer its own: the pre
 * hooks run in registration order before the forward, the post hooks in registration order after
 * it (as PyTorch's module hooks). When a pre hook fails the forward does not run, the post hooks
 * of the entries before it run with that failure, and it is returned. Hooks run on the thread
 * calling forward, for td_module_forward and td_module_forward_multi alike, and again when
 * activation checkpointing recomputes the module's forward in backward (then
 * td_checkpoint_is_recomputing() is true; a hook that must act once per forward checks it).
 * A hook must not add or remove m's hooks. Not while m runs forward on another thread. */
TD_API td_status td_module_add_forward_hooks(td_module *m, td_module_pre_hook_fn pre,
                                             td_module_post_hook_fn post, void *ctx,
                                             int *handle);
/* td_module_remove_forward_hooks removes the entry handle. TD_ERR_NOT_FOUND when m has no entry
 * by that handle. Not while m runs forward on another thread. */
TD_API td_status td_module_remove_forward_hooks(td_module *m, int handle);
/* td_module_set_forward_hooks is the single-owner form of earlier versions: it sets the one
 * entry this call manages (pre == post == NULL removes it), which runs among the added entries
 * in registration order. TD_ERR_STATE when it already set one (clear it first). */
TD_API td_status td_module_set_forward_hooks(td_module *m, td_module_pre_hook_fn pre,
                                             td_module_post_hook_fn post, void *ctx);

/* td_module_set_autocast makes m's forward (td_module_forward, td_module_forward_multi) run
 * inside an autocast scope (tensor.h): enabled with dt TD_DTYPE_BF16 or TD_DTYPE_F16 computes in
 * that dtype, enabled with TD_DTYPE_F32 or TD_DTYPE_F64 forces full precision inside (a part that
 * must stay float32 within an autocast model); enabled false clears the setting (the forward runs
 * in whatever scope its caller has). The parameters keep their dtype: float32 master weights with
 * 16-bit compute. The setting travels with the thread that calls forward, so a module run by a
 * pipeline stage or an RPC handler computes as configured. TD_ERR_DTYPE for another dtype. Not
 * while m runs forward on another thread. */
TD_API td_status td_module_set_autocast(td_module *m, bool enabled, td_dtype dt);

/* ---- activation checkpointing ---- */

/* How a module's forward keeps what its backward needs. */
typedef enum td_checkpoint_mode {
  TD_CHECKPOINT_NONE = 0,  /* everything the ops save (the default) */
  TD_CHECKPOINT_FULL,      /* only the inputs: the whole forward runs again in backward
                            * (td_checkpoint over the module's forward, hooks included) */
  TD_CHECKPOINT_SELECTIVE, /* only the regions its type marks with td_module_checkpoint_region
                            * run again (Megatron-LM's selective recompute: the GPT attention
                            * modules mark their scaled-dot-product core, whose probabilities are
                            * the large, cheap part) */
} td_checkpoint_mode;

/* td_module_set_checkpoint sets m's mode (m alone, not its children). With FULL, a forward with
 * grad mode on goes through td_checkpoint: the module's pre hooks, then its type's forward
 * without recording, then its post hooks; in backward, the hooks and the forward run again with
 * recording over the saved inputs, and the incoming gradients flow through that graph; the
 * parameters accumulate then (their hooks run during backward, as without checkpointing). The
 * gradients are bit for bit those of the forward without checkpointing. With SELECTIVE, a forward
 * with grad mode on that marks no region fails with TD_ERR_UNSUPPORTED (its type does not know
 * selective recompute). A checkpointed forward must not make RPCs (refused, see td_checkpoint)
 * and must draw random numbers only through td_tensor_dropout and the random fills. Not while m
 * runs forward. */
TD_API td_status td_module_set_checkpoint(td_module *m, td_checkpoint_mode mode);
/* td_module_get_checkpoint returns m's mode (TD_CHECKPOINT_NONE for NULL). */
TD_API td_checkpoint_mode td_module_get_checkpoint(const td_module *m);
/* td_module_checkpoint_region is for module types' forwards: it runs fn(ctx, inputs, ...) into
 * outputs as part of m's forward, through td_checkpoint (named name, or m's type name when NULL)
 * when m's mode is TD_CHECKPOINT_SELECTIVE, directly otherwise. ctx must outlive the backward (the
 * GPT attention passes none: its region reads only its inputs). */
TD_API td_status td_module_checkpoint_region(td_module *m, const char *name, td_checkpoint_fn fn,
                                             void *ctx, td_tensor *const *inputs, int n_inputs,
                                             td_tensor **outputs, int n_outputs);

/* ---- building modules (for user-defined types) ---- */

/* td_module_register_parameter adds a parameter named name (no '.', unique among m's parameters,
 * buffers and children). t must be a float leaf tensor; it is marked requires_grad. Takes a new
 * reference to t. */
TD_API td_status td_module_register_parameter(td_module *m, const char *name, td_tensor *t);
/* td_module_register_buffer adds a buffer (saved in the state dict, not returned by
 * td_module_parameters, never requires grad). Takes a new reference to t. */
TD_API td_status td_module_register_buffer(td_module *m, const char *name, td_tensor *t);
/* td_module_register_module adds child under name. Refuses a child that contains m (a cycle).
 * Takes a new reference to child. The child's training flag is set to m's. */
TD_API td_status td_module_register_module(td_module *m, const char *name, td_module *child);

/* td_module_param returns m's own parameter called name (no dots), or NULL. Borrowed; valid until
 * the parameter is replaced (td_module_set_parameter, td_module_to, td_module_to_dtype) or m dies.
 * Meant for forward functions. */
TD_API td_tensor *td_module_param(const td_module *m, const char *name);
/* td_module_buffer is td_module_param for buffers. */
TD_API td_tensor *td_module_buffer(const td_module *m, const char *name);
/* td_module_child returns the child called name (no dots), or NULL. Borrowed; valid while m
 * lives. */
TD_API td_module *td_module_child(const td_module *m, const char *name);
/* td_module_num_children returns the number of direct children. */
TD_API int td_module_num_children(const td_module *m);
/* td_module_child_at returns the i-th direct child (registration order) and, when name is not
 * NULL, its name in *name. Both borrowed; NULL when i is out of range. */
TD_API td_module *td_module_child_at(const td_module *m, int i, const char **name);

/* ---- parameters and state ---- */

/* td_module_named_parameters appends every parameter of m and its descendants to *out (which the
 * caller initialised), named by dotted path, in PyTorch's order: own parameters first, then each
 * child's. A tensor reachable under two names is listed once (its first name). */
TD_API td_status td_module_named_parameters(td_module *m, td_tensor_list *out);
/* td_module_parameters is td_module_named_parameters; pass out->tensors, out->n to an optimizer. */
TD_API td_status td_module_parameters(td_module *m, td_tensor_list *out);
/* td_module_num_parameters returns the total number of parameter elements (shared ones once). */
TD_API int64_t td_module_num_parameters(td_module *m);
/* td_module_get_parameter returns the parameter (or buffer) at a dotted path in *out.
 * TD_ERR_NOT_FOUND when there is none. Returns a new reference; release with td_tensor_unref(). */
TD_API td_status td_module_get_parameter(td_module *m, const char *path, td_tensor **out);
/* td_module_set_parameter replaces the parameter (or buffer) at a dotted path with t, which must
 * be a leaf of the same shape and dtype (TD_ERR_SHAPE / TD_ERR_DTYPE otherwise); t's
 * requires_grad is set like the old tensor's. Optimizers holding the old tensor keep updating
 * the old one. Takes a new reference to t. */
TD_API td_status td_module_set_parameter(td_module *m, const char *path, td_tensor *t);
/* td_module_state_dict appends every parameter and buffer (not deduplicated), own first then the
 * children's, named like PyTorch's state_dict keys. The tensors are the module's own (not copies). */
TD_API td_status td_module_state_dict(td_module *m, td_tensor_list *out);
/* td_module_load_state_dict copies the tensors of sd into m's parameters and buffers in place
 * (so optimizers keep working), converting device but not dtype. With strict, a key of m missing
 * from sd is TD_ERR_NOT_FOUND and a key of sd unknown to m is TD_ERR_INVALID (the message lists
 * them all). A shape mismatch is TD_ERR_SHAPE, a dtype mismatch TD_ERR_DTYPE. Everything is
 * checked before anything is copied: on failure m is unchanged. */
TD_API td_status td_module_load_state_dict(td_module *m, const td_tensor_list *sd, bool strict);

/* ---- modes, gradients, devices ---- */

/* td_module_train sets training mode (true) or evaluation mode (false) on m and every
 * descendant. */
TD_API void td_module_train(td_module *m, bool training);
/* td_module_is_training returns m's mode. */
TD_API bool td_module_is_training(const td_module *m);
/* td_module_zero_grad clears the gradient of every parameter (sets it to none, like PyTorch's
 * zero_grad(set_to_none=True)). */
TD_API void td_module_zero_grad(td_module *m);
/* td_module_set_requires_grad sets requires_grad on every parameter (freezing with false). */
TD_API td_status td_module_set_requires_grad(td_module *m, bool requires_grad);
/* td_module_to moves every parameter and buffer (and existing gradients) to dev. Parameters are
 * replaced by new leaf tensors on dev; on failure some may have moved. */
TD_API td_status td_module_to(td_module *m, td_device dev);
/* td_module_to_dtype converts every float parameter and buffer to dt (a float dtype), like
 * PyTorch's module.double() / module.float(). Replaces the tensors. */
TD_API td_status td_module_to_dtype(td_module *m, td_dtype dt);

/* ---- module factory registry ---- */

/* td_module_factory_fn creates a module from args. What args points at is agreed between the
 * code that registers the factory and the code that calls it (the remote-module layer passes its
 * argument value; local callers may pass a struct or NULL). Returns a new reference in *out. */
typedef td_status (*td_module_factory_fn)(void *ctx, const void *args, td_module **out);

/* td_module_factory_register registers fn under name (copied). TD_ERR_EXISTS when the name is
 * taken. THREAD SAFETY: any thread. */
TD_API td_status td_module_factory_register(const char *name, td_module_factory_fn fn, void *ctx);
/* td_module_factory_unregister removes name; TD_ERR_NOT_FOUND when absent. */
TD_API td_status td_module_factory_unregister(const char *name);
/* td_module_factory_exists returns true when name is registered. */
TD_API bool td_module_factory_exists(const char *name);
/* td_module_factory_create calls the factory registered under name (outside the registry's
 * lock). TD_ERR_NOT_FOUND when none. Returns a new reference in *out. */
TD_API td_status td_module_factory_create(const char *name, const void *args, td_module **out);

/* ---- initialisation (PyTorch's torch.nn.init) ---- */

/* td_nn_manual_seed reseeds this layer's default generator (used when a constructor or
 * initialiser gets g == NULL). THREAD SAFETY: any thread. */
TD_API td_status td_nn_manual_seed(uint64_t seed);
/* td_nn_init_fans computes fan_in = size(1) * receptive field and fan_out = size(0) * receptive
 * field of a tensor of at least 2 dims (TD_ERR_INVALID otherwise). */
TD_API td_status td_nn_init_fans(const td_tensor *t, int64_t *fan_in, int64_t *fan_out);
/* td_nn_init_uniform_ fills t with U[lo, hi) from g (NULL: default generator). */
TD_API td_status td_nn_init_uniform_(td_tensor *t, double lo, double hi, td_generator *g);
/* td_nn_init_normal_ fills t with N(mean, std^2). */
TD_API td_status td_nn_init_normal_(td_tensor *t, double mean, double std, td_generator *g);
/* td_nn_init_kaiming_uniform_ is kaiming_uniform_(t, a, mode='fan_in',
 * nonlinearity='leaky_relu'): U(-b, b) with b = sqrt(6 / ((1 + a^2) fan_in)). */
TD_API td_status td_nn_init_kaiming_uniform_(td_tensor *t, double a, td_generator *g);
/* td_nn_init_xavier_uniform_: U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)). */
TD_API td_status td_nn_init_xavier_uniform_(td_tensor *t, double gain, td_generator *g);

/* ---- built-in modules ----
 * Each returns a new module reference in *out; release with td_module_unref(). Parameters are
 * float32 on the CPU. g is the generator for initialisation (NULL: the default generator). */

/* td_linear_create: y = x W^T + b for x [..., in_features] -> [..., out_features]. Parameters
 * "weight" [out, in] kaiming_uniform_(a = sqrt(5)) and, when bias, "bias" [out] U(-1/sqrt(in),
 * 1/sqrt(in)). */
TD_API td_status td_linear_create(int64_t in_features, int64_t out_features, bool bias,
                                  td_generator *g, td_module **out);

/* Options of td_conv2d_create; fill with td_conv2d_opts_init(). */
typedef struct td_conv2d_opts {
  int kernel_h, kernel_w; /* kernel size; set by td_conv2d_opts_init */
  int stride_h, stride_w; /* default 1 */
  int pad_h, pad_w;       /* zero padding; default 0 */
  bool bias;              /* default true */
} td_conv2d_opts;
/* td_conv2d_opts_init sets a square kernel of kernel_size, stride 1, padding 0, bias on. */
TD_API void td_conv2d_opts_init(td_conv2d_opts *o, int kernel_size);
/* td_conv2d_create: x [N, C_in, H, W] (or [C_in, H, W]) -> [N, C_out, OH, OW]. Parameters
 * "weight" [C_out, C_in, kh, kw] kaiming_uniform_(a = sqrt(5)), "bias" [C_out] U(-1/sqrt(fan_in),
 * 1/sqrt(fan_in)), fan_in = C_in * kh * kw. */
TD_API td_status td_conv2d_create(int64_t in_channels, int64_t out_channels,
                                  const td_conv2d_opts *opts, td_generator *g, td_module **out);

/* td_max_pool2d_create: max pooling of x [N, C, H, W] (or [C, H, W]), no padding, floor mode;
 * stride 0 means stride = kernel (PyTorch's default). */
TD_API td_status td_max_pool2d_create(int kernel_h, int kernel_w, int stride_h, int stride_w,
                                      td_module **out);

/* Parameter-free activations. */
TD_API td_status td_relu_create(td_module **out);
TD_API td_status td_tanh_create(td_module **out);
TD_API td_status td_sigmoid_create(td_module **out);
/* td_gelu_create: the exact (erf) GELU. */
TD_API td_status td_gelu_create(td_module **out);

/* td_dropout_create: in training mode zeroes each element with probability p (0 <= p <= 1) and
 * scales the rest by 1/(1-p); identity in evaluation mode. The masks come from the module's own
 * generator, seeded from g at creation. */
TD_API td_status td_dropout_create(double p, td_generator *g, td_module **out);

/* td_embedding_create: int64 indices of any shape -> [..., embedding_dim]. Parameter "weight"
 * [num_embeddings, embedding_dim] N(0, 1). */
TD_API td_status td_embedding_create(int64_t num_embeddings, int64_t embedding_dim,
                                     td_generator *g, td_module **out);

/* td_layer_norm_create normalises over the trailing dims given by normalized_shape[0..ndim)
 * with eps (PyTorch default 1e-5). With elementwise_affine, parameters "weight" (ones) and
 * "bias" (zeros) of that shape. */
TD_API td_status td_layer_norm_create(const int64_t *normalized_shape, int ndim, double eps,
                                      bool elementwise_affine, td_module **out);

/* td_flatten_create merges dims start_dim..end_dim (PyTorch's nn.Flatten: 1, -1). */
TD_API td_status td_flatten_create(int start_dim, int end_dim, td_module **out);

/* td_sequential_create makes an empty Sequential; td_sequential_append adds a child named by its
 * position ("0", "1", ...) and takes a new reference to it. Forward feeds each child's output to
 * the next (one tensor in, one out); an empty Sequential is the identity. */
TD_API td_status td_sequential_create(td_module **out);
TD_API td_status td_sequential_append(td_module *seq, td_module *child);

/* td_lstm_cell_create: one LSTM step. Parameters "weight_ih" [4H, input_size], "weight_hh"
 * [4H, H] and, with bias, "bias_ih", "bias_hh" [4H], all U(-1/sqrt(H), 1/sqrt(H)); gate order
 * i, f, g, o as in PyTorch. Forward (multi): inputs (x [B, in] or [in], h [B, H] or NULL, c or
 * NULL; NULL state = zeros), outputs (h', c') or just h'. */
TD_API td_status td_lstm_cell_create(int64_t input_size, int64_t hidden_size, bool bias,
                                     td_generator *g, td_module **out);
/* td_lstm_cell_forward: (h1, c1) = cell(x, (h0, c0)); h0, c0 may be NULL (zeros). */
TD_API td_status td_lstm_cell_forward(td_module *cell, const td_tensor *x, const td_tensor *h0,
                                      const td_tensor *c0, td_tensor **h1, td_tensor **c1);

/* Options of td_lstm_create; fill with td_lstm_opts_init(). */
typedef struct td_lstm_opts {
  int num_layers;   /* stacked layers; default 1 */
  bool bias;        /* b_ih and b_hh; default true */
  bool batch_first; /* input and output [B, T, F] instead of [T, B, F]; default false */
  double dropout;   /* dropout on the outputs of each layer but the last, in training; 0 */
} td_lstm_opts;
TD_API void td_lstm_opts_init(td_lstm_opts *o);
/* td_lstm_create: multi-layer LSTM (unidirectional). Parameters per layer k: "weight_ih_lk"
 * [4H, in_k], "weight_hh_lk" [4H, H], "bias_ih_lk", "bias_hh_lk" [4H], all U(-1/sqrt(H),
 * 1/sqrt(H)). Forward (multi): inputs (x, h0, c0) with x [T, B, in] ([B, T, in] when
 * batch_first, or unbatched [T, in]) and h0, c0 [L, B, H] ([L, H] unbatched) or NULL (zeros);
 * outputs (output [T, B, H] (batch_first: [B, T, H]), h_n [L, B, H], c_n [L, B, H]) or just
 * output. opts may be NULL for the defaults. */
TD_API td_status td_lstm_create(int64_t input_size, int64_t hidden_size, const td_lstm_opts *opts,
                                td_generator *g, td_module **out);
/* td_lstm_forward: output, (h_n, c_n) = lstm(x, (h0, c0)); h0 and c0 may be NULL (zeros); hn and
 * cn may be NULL when not wanted. New references in *output, *hn, *cn. */
TD_API td_status td_lstm_forward(td_module *lstm, const td_tensor *x, const td_tensor *h0,
                                 const td_tensor *c0, td_tensor **output, td_tensor **hn,
                                 td_tensor **cn);

/* ---- GPT (nanoGPT's layout) ----
 * The modules of a GPT-2 style decoder, named like nanoGPT's state_dict keys so that weights
 * move between tdist and PyTorch through safetensors files. Each create function returns a new
 * module reference in *out (release with td_module_unref()); weights are float32 on the CPU,
 * initialised as nanoGPT does (Linear and Embedding weights N(0, 0.02), biases 0, LayerNorm 1/0,
 * residual projections c_proj.weight N(0, 0.02 / sqrt(2 n_layer))) from g (NULL: the default
 * generator). There is no dropout (nanoGPT's small recipe uses 0). */

/* Configuration of the GPT modules; fill with td_gpt_config_init(), then set vocab_size. */
typedef struct td_gpt_config {
  int64_t vocab_size; /* tokens; required by td_gpt_create (default 0) */
  int64_t block_size; /* longest context, the size of the position table; default 64 */
  int n_layer;        /* blocks; default 4 */
  int n_head;         /* attention heads, must divide n_embd; default 4 */
  int64_t n_embd;     /* width C; default 128 */
} td_gpt_config;
/* td_gpt_config_init sets c to the defaults above (nanoGPT's small CPU recipe). */
TD_API void td_gpt_config_init(td_gpt_config *c);

/* td_causal_self_attention_create: x [B, T, C] -> [B, T, C]. Children "c_attn" Linear(C, 3C)
 * and "c_proj" Linear(C, C); the heads are views of the c_attn output and go through
 * td_tensor_scaled_dot_product_attention with the causal mask (no mask tensor). */
TD_API td_status td_causal_self_attention_create(const td_gpt_config *c, td_generator *g,
                                                 td_module **out);
/* td_gpt_mlp_create: x [B, T, C] -> c_proj(gelu(c_fc(x))), "c_fc" Linear(C, 4C), exact GELU,
 * "c_proj" Linear(4C, C). */
TD_API td_status td_gpt_mlp_create(const td_gpt_config *c, td_generator *g, td_module **out);
/* td_gpt_block_create: the pre-LayerNorm residual block x += attn(ln_1(x)); x += mlp(ln_2(x)),
 * children "ln_1", "attn", "ln_2", "mlp"; [B, T, C] -> [B, T, C]. */
TD_API td_status td_gpt_block_create(const td_gpt_config *c, td_generator *g, td_module **out);
/* td_gpt_mlp_assemble and td_gpt_block_assemble make an MLP or a Block from given children
 * (each [..., C] in and out where the layout above says so; any module types, e.g. the
 * tensor-parallel layers of parallel.h). They take a new reference to each child. */
TD_API td_status td_gpt_mlp_assemble(const td_gpt_config *c, td_module *c_fc, td_module *c_proj,
                                     td_module **out);
TD_API td_status td_gpt_block_assemble(const td_gpt_config *c, td_module *ln_1, td_module *attn,
                                       td_module *ln_2, td_module *mlp, td_module **out);
/* td_gpt_create: the whole model, children "transformer" ("wte" Embedding(V, C), "wpe"
 * Embedding(block_size, C), "h" Sequential of n_layer Blocks, "ln_f" LayerNorm(C)) and
 * "lm_head" Linear(C, V, no bias) whose weight is the same tensor as transformer.wte.weight
 * (tied: both uses accumulate into one gradient; the state dict lists both keys, the parameter
 * list once). Forward (multi): inputs (idx int64 [B, T] with T <= block_size[, targets int64
 * [B, T]]), outputs (logits [B, T, V][, mean cross-entropy loss over the B*T targets, targets
 * equal to -1 ignored]). */
TD_API td_status td_gpt_create(const td_gpt_config *c, td_generator *g, td_module **out);
/* td_gpt_forward runs a GPT: *logits [B, T, V] and, when loss is not NULL (targets required),
 * *loss (0-d). New references; release with td_tensor_unref(). THREAD SAFETY: as any forward. */
TD_API td_status td_gpt_forward(td_module *gpt, const td_tensor *idx, const td_tensor *targets,
                                td_tensor **logits, td_tensor **loss);
/* td_gpt_set_activation_checkpointing sets how a GPT's blocks keep their activations: FULL
 * checkpoints every block (transformer.h.<i>: its input is all it keeps), SELECTIVE every block's
 * attention core (transformer.h.<i>.attn), NONE neither. Works on any module laid out as the GPT
 * (the tensor-parallel GPT of parallel.h too); TD_ERR_INVALID, with nothing changed, for a module
 * without transformer.h or a block without attn. */
TD_API td_status td_gpt_set_activation_checkpointing(td_module *gpt, td_checkpoint_mode mode);
/* td_gpt_config_get copies a GPT's configuration into *out (TD_ERR_INVALID for other modules). */
TD_API td_status td_gpt_config_get(const td_module *gpt, td_gpt_config *out);

/* ---- safetensors ---- */

/* Metadata of a safetensors file: the string pairs of "__metadata__". Caller-owned storage;
 * init with td_safetensors_meta_init(), release with td_safetensors_meta_fini(). */
typedef struct td_safetensors_meta {
  size_t n;
  char **keys;   /* owned */
  char **values; /* owned */
} td_safetensors_meta;
TD_API void td_safetensors_meta_init(td_safetensors_meta *m);
TD_API void td_safetensors_meta_fini(td_safetensors_meta *m);
/* td_safetensors_meta_set adds or replaces key (both strings copied). */
TD_API td_status td_safetensors_meta_set(td_safetensors_meta *m, const char *key,
                                         const char *value);
/* td_safetensors_meta_get returns the value of key or NULL. Borrowed; valid while m holds it. */
TD_API const char *td_safetensors_meta_get(const td_safetensors_meta *m, const char *key);

/* td_safetensors_serialize encodes the named tensors (every entry must have a unique, non-empty
 * name; any device, any strides; float32, float64 or int64) and optional metadata (may be NULL)
 * into a new malloc'd buffer *buf of *len bytes; free it with free(). */
TD_API td_status td_safetensors_serialize(const td_tensor_list *tensors,
                                          const td_safetensors_meta *meta, void **buf,
                                          size_t *len);
/* td_safetensors_parse decodes a safetensors image and appends its tensors (new CPU tensors,
 * in header order) to *tensors and, when meta is not NULL, its metadata to *meta. Any malformed
 * input is TD_ERR_FORMAT with the reason in td_last_error(); a well-formed file with a dtype
 * other than F32/F64/I64 is TD_ERR_DTYPE. On failure the lists are unchanged. */
TD_API td_status td_safetensors_parse(const void *buf, size_t len, td_tensor_list *tensors,
                                      td_safetensors_meta *meta);
/* td_safetensors_write writes the file at path (through a temporary file renamed into place, so
 * a reader never sees half a file). TD_ERR_IO names the path and errno text. */
TD_API td_status td_safetensors_write(const char *path, const td_tensor_list *tensors,
                                      const td_safetensors_meta *meta);
/* td_safetensors_read reads and parses the file at path (see td_safetensors_parse). */
TD_API td_status td_safetensors_read(const char *path, td_tensor_list *tensors,
                                     td_safetensors_meta *meta);

/* td_module_save writes m's state dict to path as safetensors (metadata "format": "pt" and
 * "tdist.module": the root type name). */
TD_API td_status td_module_save(td_module *m, const char *path);
/* td_module_load reads path and loads it strictly into m (td_module_load_state_dict with strict;
 * TD_ERR_FORMAT for a corrupt file). On failure m is unchanged. */
TD_API td_status td_module_load(td_module *m, const char *path);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_NN_H */
