/* replicas.h - what the data-parallel wrappers share (ddp.c here; zero/): parameter checks
 * across the group, broadcasts of whole tensors, bucket layouts, .grad writes, and agreements of
 * one flag. Built on the public process-group API only (replicas.c, grad_scaler.c).
 */
#ifndef TD_COLLECTIVES_REPLICAS_H
#define TD_COLLECTIVES_REPLICAS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "tdist/collectives.h"

/* td__coll_check_same_params compares a fingerprint of params[0..np) (count, dtypes, shapes,
 * device types) across pg through an all_gather on dev, so every member fails alike on a
 * mismatch: TD_ERR_SHAPE "<what>: the module of workerN (rank N) has different parameters ...".
 * Collective. (replicas.c) */
td_status td__coll_check_same_params(td_process_group *pg, td_tensor *const *params, size_t np,
                                     td_device dev, const char *what);
/* td__coll_broadcast_tensor broadcasts t from group rank 0 (through a contiguous copy when t is
 * not contiguous). Collective. */
td_status td__coll_broadcast_tensor(td_process_group *pg, td_tensor *t);

/* td__coll_grad_assign writes v into p's .grad in place, or gives p a copy of v as its .grad
 * when it has none (replicas.c). */
td_status td__coll_grad_assign(td_tensor *p, const td_tensor *v);

/* A bucket layout (td__coll_plan_buckets): per parameter its bucket and element offset in it;
 * per bucket its positions [first, first + count) of the order it was planned in and its
 * elements. Arrays of the caller, each with room for n entries. */
typedef struct td__coll_bucket_plan {
  size_t *bucket_of; /* per parameter */
  int64_t *offset;   /* per parameter */
  size_t *first, *count; /* per bucket */
  int64_t *numel;        /* per bucket */
  size_t nbuckets;
} td__coll_bucket_plan;
/* td__coll_plan_buckets packs params, taken in the order order[0..n), into buckets of one dtype
 * and device and at most cap bytes (the first bucket first_cap; a parameter larger than that gets
 * a bucket of its own). Deterministic: the same inputs give the same buckets on every member.
 * (replicas.c, for ddp.c and zero/) */
void td__coll_plan_buckets(td_tensor *const *params, const size_t *order, size_t n,
                           size_t first_cap, size_t cap, td__coll_bucket_plan *plan);
/* td__coll_bucket_slice returns the view of the flat bucket buffer buf that holds parameter p at
 * element offset, shaped like p. New reference. */
td_status td__coll_bucket_slice(td_tensor *buf, int64_t offset, const td_tensor *p,
                                td_tensor **out);

/* td__coll_any ORs *flag over the members of pg (an all_reduce MAX of one int64, on dev for an
 * NCCL group, else on the CPU). Collective. (grad_scaler.c; zero/: loss scaling, agreements) */
td_status td__coll_any(td_process_group *pg, td_device dev, bool *flag);

#endif
