/* ddp.c - data-parallel gradient averaging: the core of torch's DistributedDataParallel.
 *
 * Creation: the module's parameters (td_module_parameters order: deterministic and identical on
 * every replica of the same architecture) are checked across the group through an all_gather of
 * a fingerprint (count, dtypes, shapes, device types), then group rank 0's parameters and
 * buffers are broadcast so every replica starts equal. Parameters are packed into buckets: a
 * bucket holds one dtype and at most bucket_bytes (the first one first_bucket_bytes; a parameter
 * larger than that gets a bucket of its own). Each bucket owns a flat buffer on the parameters'
 * device.
 *
 * Two ways to reduce:
 *   - after backward (td_ddp_sync_gradients): for each bucket, copy every parameter's .grad into
 *     its slice (zeros where a parameter has no .grad), all_reduce(AVG), copy each slice back into
 *     the .grad in place (or give a parameter without .grad a new one).
 *   - overlapped (td_ddp_options.overlap, td_ddp_prepare / td_ddp_finish), as PyTorch's reducer:
 *     buckets hold the parameters in reverse order (the last layers' gradients arrive first); a
 *     hook on every parameter (it runs as the gradient is about to be accumulated) writes what the
 *     .grad will hold (the old .grad plus the incoming gradient) into the parameter's slice and
 *     marks it ready; when every parameter of the next bucket in order is ready, its all_reduce is
 *     started asynchronously from the hook, so buckets start in the same order on every member
 *     while backward goes on. td_ddp_finish starts what is left (a parameter that got no gradient:
 *     zeros with find_unused_parameters, else an error naming it), waits, and copies the averages
 *     into the .grads. A parameter whose gradient arrives twice in one pass (its bucket already on
 *     its way) has its bucket reduced again from the final .grads. After the first pass the
 *     buckets are rebuilt once in the order the gradients arrived on group rank 0 (broadcast, so
 *     every member builds the same buckets). Results are those of the after-backward averaging:
 *     the same values in the same all_reduce per element.
 *
 * Gradient accumulation (td_ddp_no_sync): a pass prepared while no_sync is set (the setting is
 * read by td_ddp_prepare) reduces nothing and its finish does not communicate; the first pass
 * prepared without it reduces the sum of the window once. Where the window's gradients live:
 *   - default: in .grad (the hooks do nothing; autograd accumulates), and the reducing pass's
 *     hooks put .grad + the incoming gradient into the slices as usual;
 *   - gradient_as_bucket_view: in the buckets. The hooks of a no_sync pass add each gradient
 *     into its slice and clear the .grad (as the reducing pass's hooks do), without marking
 *     anything ready, so the window holds one copy of the gradient (the buckets) instead of
 *     .grads beside them; acc[i] says parameter i's slice holds window gradients, so the
 *     reducing pass adds to it (its first gradient would otherwise overwrite the slice).
 * Either way a parameter that got gradients in the window but none in the reducing pass is no
 * unused parameter. td_ddp_sync_gradients under no_sync reduces nothing either.
 *
 * Compressed reduction (td_ddp_options.reduce_dtype bfloat16 / float16, PyTorch's reduce_dtype
 * and bf16_compress_hook): a bucket's all_reduce sends a 16-bit copy made when it starts (the
 * collectives accumulate 16-bit sums in float32, reduce.c) and its average is read back into the
 * float32 bucket when it lands, so every .grad holds a 16-bit value in float32 storage and the
 * optimizer keeps float32 state. Half the bytes on the wire, one rounding of each gradient and
 * of its average.
 * Copies run with grad mode off. Hooks run on the thread that runs backward; nothing here is
 * shared with other threads but the group's queue (which has its own lock).
 */
#include <stdio.h>
#include <string.h>

#include "replicas.h"
#include "tdist/autograd.h"

#define DEFAULT_BUCKET_BYTES ((size_t)25 << 20)

#define DEFAULT_FIRST_BUCKET_BYTES ((size_t)1 << 20)

typedef struct bucket {
  td_tensor *buf; /* flat [numel] on the parameters' device */
  td_tensor *comm; /* reduce_dtype: the 16-bit copy being reduced (NULL otherwise) */
  size_t first, count; /* positions [first, first + count) of order[] */
  size_t ready;        /* overlapped pass: parameters ready */
  td_future *work;     /* overlapped pass: its all_reduce, once started */
  bool dirty;          /* a gradient arrived after it started: reduce again at finish */
} bucket;

typedef struct hook_ctx {
  struct td_ddp *d;
  size_t param; /* index in params */
} hook_ctx;

struct td_ddp {
  td_process_group *pg;
  td_module *module;
  td_tensor_list params;
  td_ddp_options opts;
  size_t *order;     /* bucket layout: order[k] is the parameter at position k */
  size_t *bucket_of; /* per parameter: its bucket */
  int64_t *offset;   /* per parameter: element offset in its bucket */
  bucket *buckets;
  int nbuckets;
  /* overlapped passes */
  hook_ctx *hctx;
  int *hook_handle;
  bool armed, no_sync, rebuilt;
  bool pass_sync;    /* the armed pass reduces (no_sync was clear at td_ddp_prepare) */
  bool *seen;        /* per parameter: its gradient arrived in this pass */
  bool *acc;         /* per parameter: it got gradients in no_sync passes since the last
                        reduction (gradient_as_bucket_view: they are in its slice) */
  size_t pending;    /* gradient_as_bucket_view: the parameter whose .grad autograd set after its
                        hook (already in its slice; dropped at the next hook), or params.n */
  size_t *arrival;   /* the first pass's arrival order (parameter indices) */
  size_t narrived;
  int next_bucket;   /* the next bucket to start, in order */
  td_status hook_st; /* the first failure inside a hook */
  char hook_msg[512];
  td_ddp_stats stats;
};

static void free_buckets(td_ddp *d) {
  for (int k = 0; k < d->nbuckets; k++) {
    td_tensor_unref(d->buckets[k].buf);
    td_tensor_unref(d->buckets[k].comm);
    td_future_unref(d->buckets[k].work);
  }
  td__free(d->buckets);
  d->buckets = NULL;
  d->nbuckets = 0;
}

/* Lays the parameters out in buckets in the order d->order gives. */
static td_status make_buckets(td_ddp *d) {
  size_t n = d->params.n;
  free_buckets(d);
  size_t m = n ? n : 1;
  d->buckets = td__calloc(m, sizeof *d->buckets);
  size_t *first = td__calloc(m, sizeof *first), *count = td__calloc(m, sizeof *count);
  int64_t *numel = td__calloc(m, sizeof *numel);
  td_status st = TD_OK;
  if (!d->buckets || !first || !count || !numel)
    st = td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
  td__coll_bucket_plan plan = {d->bucket_of, d->offset, first, count, numel, 0};
  if (st == TD_OK)
    td__coll_plan_buckets(d->params.tensors, d->order, n, d->opts.first_bucket_bytes,
                          d->opts.bucket_bytes, &plan);
  for (size_t k = 0; st == TD_OK && k < plan.nbuckets; k++) {
    bucket *b = &d->buckets[d->nbuckets++];
    b->first = first[k];
    b->count = count[k];
    td_tensor *p0 = d->params.tensors[d->order[first[k]]];
    st = td_tensor_zeros(&numel[k], 1, td_tensor_dtype(p0), td_tensor_device(p0), &b->buf);
  }
  td__free(first);
  td__free(count);
  td__free(numel);
  return st;
}

void td_ddp_options_init(td_ddp_options *o) {
  memset(o, 0, sizeof *o);
  o->bucket_bytes = DEFAULT_BUCKET_BYTES;
  o->first_bucket_bytes = DEFAULT_FIRST_BUCKET_BYTES;
}

static td_status grad_hook(void *ctx, const td_tensor *grad, td_tensor **replacement);

/* Overlapped mode: a hook on every parameter. */
static td_status add_hooks(td_ddp *d) {
  size_t n = d->params.n;
  d->hctx = td__calloc(n ? n : 1, sizeof *d->hctx);
  d->hook_handle = td__calloc(n ? n : 1, sizeof *d->hook_handle);
  d->seen = td__calloc(n ? n : 1, sizeof *d->seen);
  d->arrival = td__calloc(n ? n : 1, sizeof *d->arrival);
  d->acc = td__calloc(n ? n : 1, sizeof *d->acc);
  if (!d->hctx || !d->hook_handle || !d->seen || !d->arrival || !d->acc)
    return td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
  for (size_t i = 0; i < n; i++) {
    d->hctx[i] = (hook_ctx){d, i};
    d->hook_handle[i] = -1;
    TD_TRY(td_tensor_register_hook(d->params.tensors[i], grad_hook, &d->hctx[i],
                                   &d->hook_handle[i]));
  }
  return TD_OK;
}

td_status td_ddp_create_ex(td_process_group *pg, td_module *module, const td_ddp_options *opts,
                           td_ddp **out) {
  TD_CHECK_ARG(pg && module && out, "ddp_create: NULL group, module or out");
  td_ddp *d = td__calloc(1, sizeof *d);
  if (!d) return td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
  if (opts) d->opts = *opts;
  else td_ddp_options_init(&d->opts);
  if (!d->opts.bucket_bytes) d->opts.bucket_bytes = DEFAULT_BUCKET_BYTES;
  if (!d->opts.first_bucket_bytes)
    d->opts.first_bucket_bytes = d->opts.overlap ? DEFAULT_FIRST_BUCKET_BYTES : d->opts.bucket_bytes;
  d->pg = pg;
  d->module = td_module_ref(module);
  td_tensor_list_init(&d->params);
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_module_parameters(module, &d->params);
  size_t n = d->params.n;
  td_device dev = n ? td_tensor_device(d->params.tensors[0]) : td_device_cpu();
  if (st == TD_OK && td_process_group_backend(pg) == TD_PG_BACKEND_NCCL && dev.type != TD_DEVICE_CUDA)
    st = td_set_error(TD_ERR_DEVICE, "ddp_create: an NCCL group needs a module on CUDA");
  td_dtype rd = d->opts.reduce_dtype;
  if (st == TD_OK && (rd == TD_DTYPE_BF16 || rd == TD_DTYPE_F16) && dev.type != TD_DEVICE_CPU)
    st = td_set_error(TD_ERR_UNSUPPORTED, "ddp_create: reduce_dtype %s needs CPU parameters "
                      "(16-bit CUDA tensors are not supported yet)", td_dtype_name(rd));
  if (st == TD_OK)
    st = td__coll_check_same_params(pg, d->params.tensors, n, dev, "ddp_create");
  if (st == TD_OK) st = td_module_state_dict(module, &sd);
  for (size_t i = 0; st == TD_OK && i < sd.n; i++) st = td__coll_broadcast_tensor(pg, sd.tensors[i]);
  if (st == TD_OK) {
    d->order = td__calloc(n ? n : 1, sizeof *d->order);
    d->bucket_of = td__calloc(n ? n : 1, sizeof *d->bucket_of);
    d->offset = td__calloc(n ? n : 1, sizeof *d->offset);
    if (!d->order || !d->bucket_of || !d->offset)
      st = td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
    /* overlapped: reverse parameter order, the order gradients tend to arrive in */
    for (size_t i = 0; st == TD_OK && i < n; i++) d->order[i] = d->opts.overlap ? n - 1 - i : i;
  }
  if (st == TD_OK) st = make_buckets(d);
  if (st == TD_OK && d->opts.overlap) st = add_hooks(d);
  td_autograd_set_enabled(prev);
  td_tensor_list_fini(&sd);
  if (st != TD_OK) {
    td_ddp_destroy(d);
    return st;
  }
  *out = d;
  return TD_OK;
}

td_status td_ddp_create(td_process_group *pg, td_module *module, size_t bucket_bytes,
                        td_ddp **out) {
  td_ddp_options o;
  td_ddp_options_init(&o);
  o.bucket_bytes = bucket_bytes ? bucket_bytes : DEFAULT_BUCKET_BYTES;
  o.first_bucket_bytes = o.bucket_bytes;
  return td_ddp_create_ex(pg, module, &o, out);
}

/* The slice of bucket b holding parameter i, shaped like the parameter. New reference. */
static td_status slice_of(td_ddp *d, bucket *b, size_t i, td_tensor **out) {
  return td__coll_bucket_slice(b->buf, d->offset[i], d->params.tensors[i], out);
}

/* Whether g is the bucket slice s itself (gradient_as_bucket_view). */
static bool aliases(const td_tensor *g, const td_tensor *s) {
  return g && td_tensor_data(g) == td_tensor_data(s);
}

/* Copies the bucket's averages into the parameters' .grads (a parameter without one gets one);
 * gradient_as_bucket_view: makes each .grad the slice itself. */
static td_status copy_back(td_ddp *d, bucket *b) {
  td_status st = TD_OK;
  for (size_t k = b->first; st == TD_OK && k < b->first + b->count; k++) {
    size_t i = d->order[k];
    td_tensor *s = NULL, *g = NULL;
    st = slice_of(d, b, i, &s);
    if (st == TD_OK && d->opts.gradient_as_bucket_view) {
      g = td_tensor_grad(d->params.tensors[i]);
      if (!aliases(g, s)) st = td_tensor_set_grad(d->params.tensors[i], s);
    } else if (st == TD_OK) {
      st = td__coll_grad_assign(d->params.tensors[i], s);
    }
    td_tensor_unref(g);
    td_tensor_unref(s);
  }
  return st;
}

/* Slice s <- parameter i's .grad, or zeros without one (nothing to copy when it is s). */
static td_status fill_slice(td_ddp *d, size_t i, td_tensor *s) {
  td_tensor *g = td_tensor_grad(d->params.tensors[i]);
  td_status st = aliases(g, s) ? TD_OK : g ? td_tensor_copy_(s, g) : td_tensor_zero_(s);
  td_tensor_unref(g);
  return st;
}

/* compressed tells whether buckets travel in a 16-bit reduce_dtype. */
static bool compressed(const td_ddp *d, const bucket *b) {
  td_dtype r = d->opts.reduce_dtype;
  return (r == TD_DTYPE_BF16 || r == TD_DTYPE_F16) && td_tensor_dtype(b->buf) != r;
}

/* reduce_start starts bucket b's all_reduce (AVG): of the bucket itself, or of a 16-bit copy
 * (reduce_dtype), which reduce_land reads back into the bucket once *work completed. */
static td_status reduce_start(td_ddp *d, bucket *b, td_future **work) {
  td_tensor *t = b->buf;
  if (compressed(d, b)) {
    td_tensor_unref(b->comm);
    b->comm = NULL;
    TD_TRY(td_tensor_to_dtype(b->buf, d->opts.reduce_dtype, &b->comm));
    t = b->comm;
  }
  return td_process_group_all_reduce_async(d->pg, t, TD_REDUCE_AVG, work);
}

static td_status reduce_land(bucket *b) {
  if (!b->comm) return TD_OK;
  td_status st = td_tensor_copy_(b->buf, b->comm); /* float32 <- 16 bits: exact */
  td_tensor_unref(b->comm);
  b->comm = NULL;
  return st;
}

static td_status sync_bucket(td_ddp *d, bucket *b) {
  td_status st = TD_OK;
  for (size_t k = b->first; st == TD_OK && k < b->first + b->count; k++) {
    size_t i = d->order[k];
    td_tensor *s = NULL;
    st = slice_of(d, b, i, &s);
    if (st == TD_OK) st = fill_slice(d, i, s);
    td_tensor_unref(s);
  }
  td_future *f = NULL;
  if (st == TD_OK) st = reduce_start(d, b, &f);
  if (st == TD_OK) st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* bounded by the group */
  if (st == TD_OK && (st = td_future_status(f)) != TD_OK)
    st = td_set_error(st, "%s", td_future_message(f));
  td_future_unref(f);
  if (st == TD_OK) st = reduce_land(b);
  if (st == TD_OK) st = copy_back(d, b);
  return st;
}

/* ---- overlapped passes ---- */

/* Starts, in bucket order, every bucket whose parameters are all ready. */
static td_status start_ready(td_ddp *d) {
  while (d->next_bucket < d->nbuckets) {
    bucket *b = &d->buckets[d->next_bucket];
    if (b->ready < b->count) break;
    TD_TRY(reduce_start(d, b, &b->work));
    d->stats.buckets_started_in_backward++;
    d->stats.bytes_started_in_backward += td_tensor_nbytes(b->buf);
    d->next_bucket++;
  }
  return TD_OK;
}

/* gradient_as_bucket_view: the .grad autograd set after the previous hook is in its slice. */
static void drop_pending(td_ddp *d) {
  if (d->pending < d->params.n) (void)td_tensor_set_grad(d->params.tensors[d->pending], NULL);
  d->pending = d->params.n;
}

/* gradient_as_bucket_view: parameter i's slice <- what .grad will hold (the slice plus grad when
 * it already holds this pass's or the window's gradients or is the .grad itself; else grad plus
 * the .grad), then the .grad is cleared before autograd accumulates (it then only adopts the
 * incoming tensor, dropped at the next hook). */
static td_status add_to_slice(td_ddp *d, bucket *b, size_t i, const td_tensor *grad) {
  td_tensor *old = td_tensor_grad(d->params.tensors[i]), *s = NULL;
  td_status st = slice_of(d, b, i, &s);
  if (st == TD_OK && (d->seen[i] || d->acc[i] || aliases(old, s))) {
    st = td_tensor_add_(s, grad, 1.0);
  } else if (st == TD_OK) {
    st = td_tensor_copy_(s, grad);
    if (st == TD_OK && old) st = td_tensor_add_(s, old, 1.0);
  }
  if (st == TD_OK) st = td_tensor_set_grad(d->params.tensors[i], NULL);
  td_tensor_unref(s);
  td_tensor_unref(old);
  if (st != TD_OK) return st;
  d->pending = i;
  if (!d->pass_sync) d->acc[i] = true;
  return TD_OK;
}

/* gradient_as_bucket_view: the slice is what .grad will be, so the gradient is added there and
 * the parameter's .grad is cleared before autograd accumulates: no full-size gradient exists
 * beside the buckets, in a reducing pass or in a no_sync one. */
static td_status hook_body_view(td_ddp *d, size_t i, const td_tensor *grad) {
  bucket *b = &d->buckets[d->bucket_of[i]];
  drop_pending(d);
  if (b->work)
    return td_set_error(TD_ERR_STATE, "ddp: parameter %zu got a second gradient after its "
                        "bucket's all_reduce started (a second backward in one pass); with "
                        "gradient_as_bucket_view sum the losses and call backward once", i);
  TD_TRY(add_to_slice(d, b, i, grad));
  if (!d->pass_sync) return TD_OK; /* accumulating: nothing is ready */
  if (d->seen[i]) return TD_OK;
  d->seen[i] = true;
  if (!d->rebuilt && d->narrived < d->params.n) d->arrival[d->narrived++] = i;
  b->ready++;
  return start_ready(d);
}

/* The gradient of parameter i is about to be accumulated: its slice gets what .grad will hold. */
static td_status hook_body(td_ddp *d, size_t i, const td_tensor *grad) {
  if (d->opts.gradient_as_bucket_view) return hook_body_view(d, i, grad);
  if (!d->pass_sync) { /* accumulating: autograd adds the gradient into .grad */
    d->acc[i] = true;
    return TD_OK;
  }
  bucket *b = &d->buckets[d->bucket_of[i]];
  if (d->seen[i]) { /* a second gradient in one pass: reduce this bucket again at finish */
    b->dirty = true;
    return TD_OK;
  }
  d->seen[i] = true;
  if (!d->rebuilt && d->narrived < d->params.n) d->arrival[d->narrived++] = i;
  if (b->work) {
    b->dirty = true;
    return TD_OK;
  }
  td_tensor *old = td_tensor_grad(d->params.tensors[i]), *s = NULL;
  td_status st = slice_of(d, b, i, &s);
  if (st == TD_OK) st = td_tensor_copy_(s, grad);
  if (st == TD_OK && old) st = td_tensor_add_(s, old, 1.0);
  td_tensor_unref(s);
  td_tensor_unref(old);
  if (st != TD_OK) return st;
  b->ready++;
  return start_ready(d);
}

static td_status grad_hook(void *ctx, const td_tensor *grad, td_tensor **replacement) {
  (void)replacement;
  hook_ctx *h = ctx;
  td_ddp *d = h->d;
  if (!d->armed) return TD_OK;
  bool prev = td_autograd_set_enabled(false);
  td_status st = hook_body(d, h->param, grad);
  td_autograd_set_enabled(prev);
  if (st != TD_OK && d->hook_st == TD_OK) { /* reported by td_ddp_finish, not by backward */
    d->hook_st = st;
    snprintf(d->hook_msg, sizeof d->hook_msg, "%s", td_last_error());
  }
  return TD_OK;
}

td_status td_ddp_prepare(td_ddp *d) {
  TD_CHECK_ARG(d, "ddp_prepare: NULL ddp");
  if (!d->opts.overlap)
    return td_set_error(TD_ERR_STATE, "ddp_prepare: this td_ddp was created without overlap "
                        "(td_ddp_options.overlap); use td_ddp_sync_gradients after backward");
  if (d->armed)
    return td_set_error(TD_ERR_STATE, "ddp_prepare: the previous pass was not finished "
                        "(td_ddp_finish after every backward)");
  for (int k = 0; k < d->nbuckets; k++) {
    d->buckets[k].ready = 0;
    d->buckets[k].dirty = false;
  }
  memset(d->seen, 0, d->params.n * sizeof *d->seen);
  d->pending = d->params.n;
  d->next_bucket = 0;
  d->hook_st = TD_OK;
  d->hook_msg[0] = 0;
  d->pass_sync = !d->no_sync;
  d->armed = true;
  return TD_OK;
}

/* After the first pass: rebuild the buckets in the order gradients arrived on group rank 0. */
static td_status rebuild(td_ddp *d) {
  size_t n = d->params.n;
  int64_t nn = (int64_t)n;
  td_tensor *ord = NULL;
  TD_TRY(td_tensor_zeros(&nn, 1, TD_DTYPE_I64, td_device_cpu(), &ord));
  int64_t *o = td_tensor_data(ord);
  /* arrived first, then the ones that never arrived, in reverse parameter order */
  bool *used = td__calloc(n ? n : 1, sizeof *used);
  if (!used) {
    td_tensor_unref(ord);
    return td_set_error(TD_ERR_NOMEM, "ddp: out of memory");
  }
  size_t k = 0;
  for (size_t j = 0; j < d->narrived; j++) used[d->arrival[j]] = true, o[k++] = (int64_t)d->arrival[j];
  for (size_t j = n; j-- > 0;) if (!used[j]) o[k++] = (int64_t)j;
  td__free(used);
  td_tensor *dev_ord = NULL;
  td_device dev = n ? td_tensor_device(d->params.tensors[0]) : td_device_cpu();
  td_status st = td_tensor_to(ord, dev, &dev_ord);
  if (st == TD_OK) st = td_process_group_broadcast(d->pg, dev_ord, 0);
  td_tensor *back = NULL;
  if (st == TD_OK) st = td_tensor_to(dev_ord, td_device_cpu(), &back);
  if (st == TD_OK) {
    const int64_t *v = td_tensor_data(back);
    for (size_t j = 0; j < n; j++) d->order[j] = (size_t)v[j];
    st = make_buckets(d);
  }
  /* gradient_as_bucket_view: the .grads move into the new buckets (the old ones go with them) */
  for (int k = 0; st == TD_OK && d->opts.gradient_as_bucket_view && k < d->nbuckets; k++) {
    bucket *b = &d->buckets[k];
    for (size_t q = b->first; st == TD_OK && q < b->first + b->count; q++) {
      td_tensor *s = NULL;
      st = slice_of(d, b, d->order[q], &s);
      if (st == TD_OK) st = fill_slice(d, d->order[q], s);
      if (st == TD_OK) st = td_tensor_set_grad(d->params.tensors[d->order[q]], s);
      td_tensor_unref(s);
    }
  }
  td_tensor_unref(back);
  td_tensor_unref(dev_ord);
  td_tensor_unref(ord);
  d->rebuilt = true;
  return st;
}

td_status td_ddp_finish(td_ddp *d) {
  TD_CHECK_ARG(d, "ddp_finish: NULL ddp");
  if (!d->armed)
    return td_set_error(TD_ERR_STATE, "ddp_finish: no pass was prepared (td_ddp_prepare before "
                        "backward)");
  d->armed = false;
  td_status st = d->hook_st;
  if (st != TD_OK) td_set_error(st, "ddp_finish: inside backward: %s", d->hook_msg);
  drop_pending(d);
  if (!d->pass_sync) { /* gradient accumulation: nothing reduced this pass */
    if (st == TD_OK) d->stats.passes_accumulated++;
    return st;
  }
  bool prev = td_autograd_set_enabled(false);
  /* parameters that got no gradient this pass */
  for (size_t i = 0; st == TD_OK && i < d->params.n; i++) {
    if (d->seen[i]) continue;
    if (d->acc[i] && d->opts.gradient_as_bucket_view) { /* the window's sum is in its slice */
      bucket *b = &d->buckets[d->bucket_of[i]];
      d->seen[i] = true;
      if (!b->work) b->ready++;
      continue;
    }
    if (!d->opts.find_unused_parameters && !d->acc[i]) {
      char shp[96];
      st = td_set_error(TD_ERR_STATE, "ddp_finish: parameter %zu (shape %s) got no gradient in "
                        "this pass; if the model leaves parameters unused, create the td_ddp with "
                        "find_unused_parameters", i,
                        td_tensor_shape_str(d->params.tensors[i], shp, sizeof shp));
      break;
    }
    bucket *b = &d->buckets[d->bucket_of[i]];
    td_tensor *s = NULL;
    st = slice_of(d, b, i, &s);
    if (st == TD_OK) st = fill_slice(d, i, s); /* .grad: the window's sum, or none */
    td_tensor_unref(s);
    d->seen[i] = true;
    if (!d->acc[i]) d->stats.unused_parameters++;
    if (st == TD_OK && !b->work) b->ready++;
  }
  /* what is left starts now, still in order (a failure stops starting but still waits) */
  while (st == TD_OK && d->next_bucket < d->nbuckets) {
    bucket *b = &d->buckets[d->next_bucket++];
    st = reduce_start(d, b, &b->work);
  }
  for (int k = 0; k < d->nbuckets; k++) {
    bucket *b = &d->buckets[k];
    d->stats.bytes_reduced += td_tensor_nbytes(b->buf);
    if (!b->work) continue;
    td_status ws = td_future_wait(b->work, TD_TIMEOUT_INFINITE); /* bounded by the group */
    if (ws != TD_OK && st == TD_OK) st = td_set_error(ws, "ddp_finish: %s", td_future_message(b->work));
    td_future_unref(b->work);
    b->work = NULL;
    if (st == TD_OK) st = reduce_land(b);
    if (st == TD_OK && b->dirty) st = sync_bucket(d, b); /* from the final .grads */
    else if (st == TD_OK) st = copy_back(d, b);
  }
  d->stats.passes++;
  memset(d->acc, 0, d->params.n * sizeof *d->acc); /* the window is reduced */
  if (st == TD_OK && !d->rebuilt) st = rebuild(d);
  td_autograd_set_enabled(prev);
  return st;
}

void td_ddp_no_sync(td_ddp *d, bool no_sync) {
  if (d) d->no_sync = no_sync;
}

td_status td_ddp_get_stats(const td_ddp *d, td_ddp_stats *out) {
  TD_CHECK_ARG(d && out, "ddp_get_stats: NULL argument");
  *out = d->stats;
  return TD_OK;
}

td_status td_ddp_sync_gradients(td_ddp *d) {
  TD_CHECK_ARG(d, "ddp_sync_gradients: NULL ddp");
  if (d->no_sync) { /* gradient accumulation: the .grads keep their sums */
    d->stats.passes_accumulated++;
    return TD_OK;
  }
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  for (int k = 0; st == TD_OK && k < d->nbuckets; k++) st = sync_bucket(d, &d->buckets[k]);
  td_autograd_set_enabled(prev);
  return st;
}

int td_ddp_num_buckets(const td_ddp *d) { return d ? d->nbuckets : 0; }

void td_ddp_destroy(td_ddp *d) {
  if (!d) return;
  for (int k = 0; k < d->nbuckets; k++)
    if (d->buckets[k].work) td_future_wait(d->buckets[k].work, TD_TIMEOUT_INFINITE);
  for (size_t i = 0; d->hook_handle && i < d->params.n; i++)
    if (d->hook_handle[i] >= 0) td_tensor_remove_hook(d->params.tensors[i], d->hook_handle[i]);
  free_buckets(d);
  td__free(d->hctx);
  td__free(d->hook_handle);
  td__free(d->seen);
  td__free(d->arrival);
  td__free(d->acc);
  td__free(d->order);
  td__free(d->bucket_of);
  td__free(d->offset);
  td_tensor_list_fini(&d->params);
  td_module_unref(d->module);
  td__free(d);
}
