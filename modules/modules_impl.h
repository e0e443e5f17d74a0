/* modules_impl.h - internals shared by the files under modules/ (never installed).
 *
 *   module.c       the td_module object: refcount, parameters, buffers, children, dotted names,
 *                  state dicts, train/eval, devices, the factory registry, td_tensor_list.
 *   forward.c      forward: its autocast scope, the hooks around it and activation
 *                  checkpointing.
 *   init.c         the default generator and torch.nn.init-style initialisers.
 *   layers.c       Linear, Conv2d, MaxPool2d, activations, Dropout, Embedding, LayerNorm,
 *                  Flatten, Sequential.
 *   lstm.c         LSTMCell and the multi-layer LSTM.
 *   gpt.c          CausalSelfAttention, MLP, Block and GPT (nanoGPT's layout).
 *   json.c         a small strict JSON parser (the subset safetensors headers use).
 *   safetensors.c  safetensors encode/decode and module save/load.
 */
#ifndef TD_MODULES_IMPL_H
#define TD_MODULES_IMPL_H

#include "../core/core.h"
#include "../core/refcount.h"
#include "tdist/nn.h"

/* ---- the module object (module.c; forward.c runs it) ---- */

typedef struct td__mslot {
  char *name;
  td_tensor *t;
} td__mslot;

typedef struct td__mchild {
  char *name;
  td_module *m;
} td__mchild;

/* One entry of a module's forward hooks (td_module_add_forward_hooks). */
typedef struct td__mhook {
  int handle;
  td_module_pre_hook_fn pre;
  td_module_post_hook_fn post;
  void *ctx;
  bool legacy; /* set by td_module_set_forward_hooks */
} td__mhook;

struct td_module {
  td__refcnt rc;
  const td_module_type *type;
  void *state;
  bool training;
  td__mslot *params;
  int n_params, cap_params;
  td__mslot *buffers;
  int n_buffers, cap_buffers;
  td__mchild *children;
  int n_children, cap_children;
  td__mhook *hooks; /* forward hooks, in registration order */
  int n_hooks, cap_hooks;
  td_checkpoint_mode ckpt; /* td_module_set_checkpoint; default TD_CHECKPOINT_NONE */
  bool autocast;           /* td_module_set_autocast: forward inside a scope of autocast_dt */
  td_dtype autocast_dt;
};

/* td__module_param_at returns m's i-th own parameter in registration order (borrowed), or NULL. */
td_tensor *td__module_param_at(const td_module *m, int i);
/* td__module_num_params returns the number of m's own parameters. */
int td__module_num_params(const td_module *m);

/* td__nn_gen_acquire returns g when not NULL; otherwise locks and returns the default generator.
 * Pair every call with td__nn_gen_release(g) passing the same argument g. */
td_generator *td__nn_gen_acquire(td_generator *g);
void td__nn_gen_release(td_generator *g);

/* td__nn_check_input returns TD_ERR_INVALID for a NULL x, and TD_ERR_DTYPE / TD_ERR_DEVICE when x
 * does not match the parameter ref (skipped when ref is NULL), naming the module. */
td_status td__nn_check_input(const char *module, const td_tensor *x, const td_tensor *ref);

/* td__nn_new_param makes a float32 CPU leaf tensor of shape for a parameter (uninitialised). */
td_status td__nn_new_param(const int64_t *shape, int ndim, td_tensor **out);

/* td__nn_shape_str formats shape[0..ndim) as "[2, 3]" into buf and returns buf. */
const char *td__nn_shape_str(const int64_t *shape, int ndim, char *buf, size_t n);

/* ---- JSON (json.c) ---- */

typedef enum td__json_type {
  TD__JSON_NULL,
  TD__JSON_BOOL,
  TD__JSON_NUMBER,
  TD__JSON_STRING,
  TD__JSON_ARRAY,
  TD__JSON_OBJECT,
} td__json_type;

typedef struct td__json td__json;
struct td__json {
  td__json_type type;
  bool boolean;
  /* NUMBER: is_uint when the text was a non-negative integer without fraction or exponent that
   * fits in uint64 (value in u); num holds the value as a double in every case. */
  bool is_uint;
  uint64_t u;
  double num;
  /* STRING: decoded UTF-8, NUL-terminated; len excludes the NUL (the text may hold \u0000). */
  char *str;
  size_t len;
  /* ARRAY / OBJECT: n items; OBJECT also has keys[i] (decoded, NUL-terminated) and key_lens[i]. */
  size_t n;
  td__json *items;
  char **keys;
  size_t *key_lens;
};

/* td__json_parse parses exactly one JSON value from text[0..len) (surrounding whitespace
 * allowed; nesting depth at most 64). On TD_OK *out is a new tree; free with td__json_free().
 * On failure returns TD_ERR_FORMAT (or TD_ERR_NOMEM) with the byte offset in the message. */
td_status td__json_parse(const char *text, size_t len, td__json **out);
/* td__json_free frees a tree from td__json_parse. NULL does nothing. */
void td__json_free(td__json *v);
/* td__json_get returns the member key of object v, or NULL. Borrowed. */
const td__json *td__json_get(const td__json *v, const char *key);

/* td__json_buf is a growable output buffer for writing JSON. */
typedef struct td__json_buf {
  char *data;
  size_t len, cap;
  bool failed; /* an allocation failed; data is unusable */
} td__json_buf;
void td__json_buf_append(td__json_buf *b, const char *s, size_t n);
void td__json_buf_printf(td__json_buf *b, const char *fmt, ...) TD_PRINTF(2, 3);
/* td__json_buf_string appends s[0..n) as a quoted, escaped JSON string. */
void td__json_buf_string(td__json_buf *b, const char *s, size_t n);

#endif
