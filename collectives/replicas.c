/* replicas.c - what the data-parallel wrappers (ddp.c, zero.c) share: checking that every
 * member holds the same parameters, starting every member from group rank 0's values, laying
 * parameters out in gradient buckets, and writing averaged gradients into .grad.
 */
#include "coll_impl.h"
#include "replicas.h"
#include "tdist/autograd.h"

static uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; i++) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

td_status td__coll_check_same_params(td_process_group *pg, td_tensor *const *params, size_t np,
                                     td_device dev, const char *what) {
  uint64_t h = 1469598103934665603ull;
  h = fnv(h, np);
  for (size_t i = 0; i < np; i++) {
    td_tensor *p = params[i];
    h = fnv(h, (uint64_t)td_tensor_dtype(p));
    h = fnv(h, (uint64_t)td_tensor_device(p).type);
    h = fnv(h, (uint64_t)td_tensor_ndim(p));
    for (int k = 0; k < td_tensor_ndim(p); k++) h = fnv(h, (uint64_t)td_tensor_shape(p)[k]);
  }
  int n = td_process_group_size(pg);
  int64_t one = 1, all = n;
  td_tensor *mine = NULL, *mine_dev = NULL, *every = NULL, *every_cpu = NULL;
  int64_t hv = (int64_t)(h >> 1);
  td_status st = td_tensor_from_buffer(&hv, &one, 1, TD_DTYPE_I64, &mine);
  if (st == TD_OK) st = td_tensor_to(mine, dev, &mine_dev);
  if (st == TD_OK) st = td_tensor_empty(&all, 1, TD_DTYPE_I64, dev, &every);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor(pg, every, mine_dev);
  if (st == TD_OK) st = td_tensor_to(every, td_device_cpu(), &every_cpu);
  if (st == TD_OK) {
    const int64_t *v = td_tensor_data(every_cpu);
    for (int i = 0; i < n; i++) {
      if (v[i] != v[0]) {
        char who[160];
        st = td_set_error(TD_ERR_SHAPE, "%s: the module of %s has different parameters "
                          "(count, dtypes or shapes) from group rank 0's", what,
                          td__pg_who(pg, i, who, sizeof who));
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

td_status td__coll_broadcast_tensor(td_process_group *pg, td_tensor *t) {
  if (td_tensor_is_contiguous(t)) return td_process_group_broadcast(pg, t, 0);
  td_tensor *c = NULL;
  TD_TRY(td_tensor_clone(t, &c));
  td_status st = td_process_group_broadcast(pg, c, 0);
  if (st == TD_OK) st = td_tensor_copy_(t, c);
  td_tensor_unref(c);
  return st;
}

td_status td__coll_grad_assign(td_tensor *p, const td_tensor *v) {
  td_tensor *g = td_tensor_grad(p), *c = NULL;
  td_status st = g ? td_tensor_copy_(g, v) : td_tensor_clone(v, &c);
  if (st == TD_OK && !g) st = td_tensor_set_grad(p, c);
  td_tensor_unref(c);
  td_tensor_unref(g);
  return st;
}

void td__coll_plan_buckets(td_tensor *const *params, const size_t *order, size_t n,
                           size_t first_cap, size_t cap, td__coll_bucket_plan *plan) {
  size_t i = 0;
  plan->nbuckets = 0;
  while (i < n) {
    td_tensor *p0 = params[order[i]];
    td_dtype dt = td_tensor_dtype(p0);
    td_device dev = td_tensor_device(p0);
    size_t lim = plan->nbuckets == 0 ? first_cap : cap;
    size_t bytes = 0, first = i;
    int64_t numel = 0;
    while (i < n) {
      size_t pi = order[i];
      td_tensor *p = params[pi];
      size_t nb = td_tensor_nbytes(p);
      if (td_tensor_dtype(p) != dt || !td_device_equal(td_tensor_device(p), dev)) break;
      if (i > first && bytes + nb > lim) break;
      plan->offset[pi] = numel;
      plan->bucket_of[pi] = plan->nbuckets;
      numel += td_tensor_numel(p);
      bytes += nb;
      i++;
    }
    plan->first[plan->nbuckets] = first;
    plan->count[plan->nbuckets] = i - first;
    plan->numel[plan->nbuckets] = numel;
    plan->nbuckets++;
  }
}

td_status td__coll_bucket_slice(td_tensor *buf, int64_t offset, const td_tensor *p,
                                td_tensor **out) {
  td_tensor *flat = NULL;
  TD_TRY(td_tensor_narrow(buf, 0, offset, td_tensor_numel(p), &flat));
  td_status st = td_tensor_reshape(flat, td_tensor_shape(p), td_tensor_ndim(p), out);
  td_tensor_unref(flat);
  return st;
}
