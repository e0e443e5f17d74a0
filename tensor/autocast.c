/* autocast.c - the per-thread autocast policy (tensor.h, "mixed precision") and its cast cache.
 *
 * State is thread-local: a stack of scopes (each either a 16-bit compute dtype or "off"), a
 * suspension flag the autograd engine sets while it runs backward functions (so a backward called
 * inside a scope computes each node in the dtypes its forward saw), and the cast cache.
 *
 * The cache holds the low-precision casts of leaves that require grad (weights), keyed by the
 * source tensor and by grad mode (a cast made under no_grad has no history and must not serve a
 * later forward that needs gradients; PyTorch keys on the tensor alone). Each entry keeps a
 * reference to its source, so a freed weight's address cannot be reused while the entry lives.
 * The outermost td_autocast_end drops the cache: the next forward casts again, reading the
 * weights the optimizer updated in between.
 *
 * The ops call in at their entry (ops_matmul.c, ops_attention.c, ops_conv.c: lower; ops_softmax.c,
 * ops_norm.c, ops_reduce.c: float32) and run on the converted tensors; conversions are
 * td_tensor_to_dtype, differentiable.
 *
 * THREAD SAFETY: every function works on the calling thread's state only.
 */
#include "tensor_impl.h"

#define MAX_DEPTH 64

typedef struct {
  td_tensor *src;  /* owned reference */
  td_tensor *cast; /* owned reference */
  td_dtype dt;
  bool grad;
} cache_entry;

static _Thread_local struct {
  int depth;
  td_dtype stack[MAX_DEPTH]; /* a 16-bit dtype: on; float32 / float64: off */
  bool suspended;
  cache_entry *cache;
  int n, cap;
  int64_t casts, hits;
} ac;

static bool is_low(td_dtype dt) { return dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16; }

bool td_autocast_dtype(td_dtype *dt) {
  if (ac.depth == 0 || ac.suspended || !is_low(ac.stack[ac.depth - 1])) return false;
  if (dt) *dt = ac.stack[ac.depth - 1];
  return true;
}

td_status td_autocast_begin(td_dtype dt) {
  if (!is_low(dt) && dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "autocast_begin: %s is not a compute dtype for autocast "
                        "(bfloat16 or float16 turn it on, float32 or float64 off)",
                        td_dtype_name(dt));
  if (ac.depth == MAX_DEPTH)
    return td_set_error(TD_ERR_STATE, "autocast_begin: more than %d nested scopes", MAX_DEPTH);
  if (ac.depth == 0) ac.casts = ac.hits = 0;
  ac.stack[ac.depth++] = dt;
  return TD_OK;
}

static void cache_clear(void) {
  for (int i = 0; i < ac.n; i++) {
    td_tensor_unref(ac.cache[i].src);
    td_tensor_unref(ac.cache[i].cast);
  }
  td__free(ac.cache);
  ac.cache = NULL;
  ac.n = ac.cap = 0;
}

void td_autocast_end(void) {
  if (ac.depth == 0) return;
  if (--ac.depth == 0) cache_clear();
}

void td_autocast_cache_stats(int64_t *casts, int64_t *hits) {
  if (casts) *casts = ac.casts;
  if (hits) *hits = ac.hits;
}

bool td__autocast_suspend(void) {
  bool prev = ac.suspended;
  ac.suspended = true;
  return prev;
}

void td__autocast_resume(bool prev) { ac.suspended = prev; }

/* cast converts t to dt (differentiably), through the cache for weights. */
static td_status cast(const td_tensor *t, td_dtype dt, td_tensor **out) {
  bool cacheable = t->requires_grad && !t->grad_fn;
  bool grad = td_autograd_is_enabled();
  if (cacheable)
    for (int i = 0; i < ac.n; i++)
      if (ac.cache[i].src == t && ac.cache[i].dt == dt && ac.cache[i].grad == grad) {
        ac.hits++;
        *out = td_tensor_ref(ac.cache[i].cast);
        return TD_OK;
      }
  td_tensor *c;
  TD_TRY(td_tensor_to_dtype(t, dt, &c));
  ac.casts++;
  if (cacheable) {
    if (ac.n == ac.cap) {
      int cap = ac.cap ? 2 * ac.cap : 32;
      cache_entry *e = td__realloc(ac.cache, (size_t)cap * sizeof *e);
      if (!e) { /* no cache: still correct, only slower */
        *out = c;
        return TD_OK;
      }
      ac.cache = e;
      ac.cap = cap;
    }
    ac.cache[ac.n++] = (cache_entry){td_tensor_ref((td_tensor *)t), td_tensor_ref(c), dt, grad};
  }
  *out = c;
  return TD_OK;
}

td_status td__autocast_lower(const td_tensor *t, td_tensor **out) {
  td_dtype dt;
  *out = NULL;
  if (!t) return TD_OK;
  if (!td_autocast_dtype(&dt) || t->dtype == dt || !td_dtype_is_float(t->dtype)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return cast(t, dt, out);
}

td_status td__autocast_f32(const td_tensor *t, td_tensor **out) {
  *out = NULL;
  if (!t) return TD_OK;
  if (!td_autocast_dtype(NULL) || !is_low(t->dtype)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return td_tensor_to_dtype(t, TD_DTYPE_F32, out);
}

td_status td__autocast_args(bool lower, const td_tensor *const *in, td_tensor **out, int n,
                            bool *changed) {
  *changed = false;
  for (int i = 0; i < n; i++) {
    td_status st = lower ? td__autocast_lower(in[i], &out[i]) : td__autocast_f32(in[i], &out[i]);
    if (st != TD_OK) {
      for (int j = 0; j < i; j++) td_tensor_unref(out[j]);
      return st;
    }
    *changed = *changed || out[i] != in[i];
  }
  return TD_OK;
}
