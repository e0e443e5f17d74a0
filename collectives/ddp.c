/* ddp.c - data-parallel gradient averaging (the core of torch's DistributedDataParallel,
 * without hooks into backward: the caller runs td_ddp_sync_gradients after backward).
 *
 * Creation: the module's parameters (td_module_parameters order: deterministic and identical on
 * every replica of the same architecture) are checked across the group through an all_gather of
 * a fingerprint (count, dtypes, shapes, device types), then group rank 0's parameters and
 * buffers are broadcast so every replica starts equal. Parameters are packed in order into
 * buckets: a bucket holds one dtype and at most bucket_bytes (a parameter larger than that gets
 * a bucket of its own). Each bucket owns a flat buffer on the parameters' device.
 *
 * Sync: for each bucket, copy every parameter's .grad into its slice of the buffer (zeros where
 * a parameter has no .grad), all_reduce(AVG) the buffer, copy each slice back into the .grad in
 * place (or give a parameter without .grad a new one). Copies run with grad mode off.
 */
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"
#include "tdist/autograd.h"

#define DEFAULT_BUCKET_BYTES ((size_t)25 << 20)

typedef struct bucket {
  td_tensor *buf; /* flat [numel] on the parameters' device */
  size_t first, count; /* parameters [first, first + count) */
} bucket;

struct td_ddp {
  td_process_group *pg;
  td_module *module;
  td_tensor_list params;
  int64_t *offset; /* element offset of each parameter in its bucket */
  bucket *buckets;
  int nbuckets;
};

static uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; i++) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

/* Every member gathers every member's fingerprint, so all of them fail alike on a mismatch. */
static td_status check_same_params(td_ddp *d, td_device dev) {
  uint64_t h = 1469598103934665603ull;
  h = fnv(h, d->params.n);
  for (size_t i = 0; i < d->params.n; i++) {
    td_tensor *p = d->params.tensors[i];
    h = fnv(h, (uint64_t)td_tensor_dtype(p));
    h = fnv(h, (uint64_t)td_tensor_device(p).type);
    h = fnv(h, (uint64_t)td_tensor_ndim(p));
    for (int k = 0; k < td_tensor_ndim(p); k++) h = fnv(h, (uint64_t)td_tensor_shape(p)[k]);
  }
  int n = td_process_group_size(d->pg);
  int64_t one = 1, all = n;
  td_tensor *mine = NULL, *mine_dev = NULL, *every = NULL, *every_cpu = NULL;
  int64_t hv = (int64_t)(h >> 1);
  td_status st = td_tensor_from_buffer(&hv, &one, 1, TD_DTYPE_I64, &mine);
  if (st == TD_OK) st = td_tensor_to(mine, dev, &mine_dev);
  if (st == TD_OK) st = td_tensor_empty(&all, 1, TD_DTYPE_I64, dev, &every);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor(d->pg, every, mine_dev);
  if (st == TD_OK) st = td_tensor_to(every, td_device_cpu(), &every_cpu);
  if (st == TD_OK) {
    const int64_t *v = td_tensor_data(every_cpu);
    for (int i = 0; i < n; i++) {
      if (v[i] != v[0]) {
        char who[160];
        st = td_set_error(TD_ERR_SHAPE, "ddp_create: the module of %s has different parameters "
                          "(count, dtypes or shapes) from group rank 0's",
                          td__pg_who(d->pg, i, who, sizeof who));
        break;
      }
    }
  }
  td_tensor_unref(mine);
  td_tensor_unref(mine_dev);
  td_tensor_unref(every);
  td_tensor_unref(every_cpu);
  return st;
}

/* Broadcasts t from group rank 0 (through a contiguous copy when t is not contiguous). */
static td_status broadcast_tensor(td_process_group *pg, td_tensor *t) {
  if (td_tensor_is_contiguous(t)) return td_process_group_broadcast(pg, t, 0);
  td_tensor *c = NULL;
  TD_TRY(td_tensor_clone(t, &c));
  td_status st = td_process_group_broadcast(pg, c, 0);
  if (st == TD_OK) st = td_tensor_copy_(t, c);
  td_tensor_unref(c);
  return st;
}

static td_status make_buckets(td_ddp *d, size_t bucket_bytes) {
  size_t n = d->params.n;
  d->offset = td__calloc(n ? n : 1, sizeof *d->offset);
  d->buckets = td__calloc(n ? n : 1, sizeof *d->buckets);
  if (!d->offset || !d->buckets) return td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
  size_t i = 0;
  while (i < n) {
    td_tensor *p0 = d->params.tensors[i];
    td_dtype dt = td_tensor_dtype(p0);
    td_device dev = td_tensor_device(p0);
    size_t bytes = 0, first = i;
    int64_t numel = 0;
    while (i < n) {
      td_tensor *p = d->params.tensors[i];
      size_t nb = td_tensor_nbytes(p);
      if (td_tensor_dtype(p) != dt || !td_device_equal(td_tensor_device(p), dev)) break;
      if (i > first && bytes + nb > bucket_bytes) break;
      d->offset[i] = numel;
      numel += td_tensor_numel(p);
      bytes += nb;
      i++;
    }
    bucket *b = &d->buckets[d->nbuckets++];
    b->first = first;
    b->count = i - first;
    TD_TRY(td_tensor_zeros(&numel, 1, dt, dev, &b->buf));
  }
  return TD_OK;
}

td_status td_ddp_create(td_process_group *pg, td_module *module, size_t bucket_bytes,
                        td_ddp **out) {
  TD_CHECK_ARG(pg && module && out, "ddp_create: NULL group, module or out");
  if (!bucket_bytes) bucket_bytes = DEFAULT_BUCKET_BYTES;
  td_ddp *d = td__calloc(1, sizeof *d);
  if (!d) return td_set_error(TD_ERR_NOMEM, "ddp_create: out of memory");
  d->pg = pg;
  d->module = td_module_ref(module);
  td_tensor_list_init(&d->params);
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  bool prev = td_autograd_set_enabled(false);
  td_status st = td_module_parameters(module, &d->params);
  td_device dev = d->params.n ? td_tensor_device(d->params.tensors[0]) : td_device_cpu();
  if (st == TD_OK && pg->backend == TD_PG_BACKEND_NCCL && dev.type != TD_DEVICE_CUDA)
    st = td_set_error(TD_ERR_DEVICE, "ddp_create: an NCCL group needs a module on CUDA");
  if (st == TD_OK) st = check_same_params(d, dev);
  if (st == TD_OK) st = td_module_state_dict(module, &sd);
  for (size_t i = 0; st == TD_OK && i < sd.n; i++) st = broadcast_tensor(pg, sd.tensors[i]);
  if (st == TD_OK) st = make_buckets(d, bucket_bytes);
  td_autograd_set_enabled(prev);
  td_tensor_list_fini(&sd);
  if (st != TD_OK) {
    td_ddp_destroy(d);
    return st;
  }
  *out = d;
  return TD_OK;
}

/* The slice of bucket b holding parameter i, shaped like the parameter. New reference. */
static td_status slice_of(td_ddp *d, bucket *b, size_t i, td_tensor **out) {
  td_tensor *p = d->params.tensors[i], *flat = NULL;
  TD_TRY(td_tensor_narrow(b->buf, 0, d->offset[i], td_tensor_numel(p), &flat));
  td_status st = td_tensor_reshape(flat, td_tensor_shape(p), td_tensor_ndim(p), out);
  td_tensor_unref(flat);
  return st;
}

static td_status sync_bucket(td_ddp *d, bucket *b) {
  td_status st = TD_OK;
  for (size_t i = b->first; st == TD_OK && i < b->first + b->count; i++) {
    td_tensor *g = td_tensor_grad(d->params.tensors[i]), *s = NULL;
    st = slice_of(d, b, i, &s);
    if (st == TD_OK) st = g ? td_tensor_copy_(s, g) : td_tensor_zero_(s);
    td_tensor_unref(s);
    td_tensor_unref(g);
  }
  if (st == TD_OK) st = td_process_group_all_reduce(d->pg, b->buf, TD_REDUCE_AVG);
  for (size_t i = b->first; st == TD_OK && i < b->first + b->count; i++) {
    td_tensor *p = d->params.tensors[i];
    td_tensor *g = td_tensor_grad(p), *s = NULL, *c = NULL;
    st = slice_of(d, b, i, &s);
    if (st == TD_OK && g) st = td_tensor_copy_(g, s);
    if (st == TD_OK && !g) {
      st = td_tensor_clone(s, &c);
      if (st == TD_OK) st = td_tensor_set_grad(p, c);
    }
    td_tensor_unref(s);
    td_tensor_unref(c);
    td_tensor_unref(g);
  }
  return st;
}

td_status td_ddp_sync_gradients(td_ddp *d) {
  TD_CHECK_ARG(d, "ddp_sync_gradients: NULL ddp");
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  for (int k = 0; st == TD_OK && k < d->nbuckets; k++) st = sync_bucket(d, &d->buckets[k]);
  td_autograd_set_enabled(prev);
  return st;
}

int td_ddp_num_buckets(const td_ddp *d) { return d ? d->nbuckets : 0; }

void td_ddp_destroy(td_ddp *d) {
  if (!d) return;
  for (int k = 0; k < d->nbuckets; k++) td_tensor_unref(d->buckets[k].buf);
  td__free(d->buckets);
  td__free(d->offset);
  td_tensor_list_fini(&d->params);
  td_module_unref(d->module);
  td__free(d);
}
