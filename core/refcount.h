/* refcount.h - the one reference count of tdist (internal).
 *
 * An object embeds a td__refcnt; td__ref_init sets it to 1, td__ref_inc adds one, td__ref_dec
 * drops one and returns true when the count reached zero, at which point the caller runs the
 * destructor. Acquire/release ordering makes every write done before the last drop visible to
 * the destructor.
 *
 * Invariant: a count never goes below zero and never rises from zero. Either means a reference
 * was dropped twice or taken on an object already being destroyed (a use after free waiting to
 * happen), so both abort at once (TD_PANIC; a core dump's backtrace names the caller) instead
 * of corrupting memory later. Every refcounted object of the library (tensors, storages, autograd nodes, modules,
 * values, futures, RRefs and their contexts, distributed autograd contexts, connections) uses
 * this type.
 */
#ifndef TD_CORE_REFCOUNT_H
#define TD_CORE_REFCOUNT_H

#include <stdbool.h>
#include <stdint.h>

#include "core.h"

typedef struct td__refcnt {
  int64_t n;
} td__refcnt;

static inline void td__ref_init(td__refcnt *r) { __atomic_store_n(&r->n, 1, __ATOMIC_RELAXED); }

static inline void td__ref_inc(td__refcnt *r) {
  int64_t before = __atomic_fetch_add(&r->n, 1, __ATOMIC_RELAXED);
  if (__builtin_expect(before <= 0, 0))
    TD_PANIC("reference taken on a dead object (count was %lld)", (long long)before);
}

static inline bool td__ref_dec(td__refcnt *r) {
  int64_t after = __atomic_sub_fetch(&r->n, 1, __ATOMIC_ACQ_REL);
  if (__builtin_expect(after < 0, 0))
    TD_PANIC("reference count underflow (count is %lld): a reference was released twice",
             (long long)after);
  return after == 0;
}

/* td__ref_try_inc adds one unless the count is already zero (the object is being destroyed):
 * how a weak pointer kept under a lock is turned into a reference. */
static inline bool td__ref_try_inc(td__refcnt *r) {
  int64_t n = __atomic_load_n(&r->n, __ATOMIC_RELAXED);
  while (n > 0)
    if (__atomic_compare_exchange_n(&r->n, &n, n + 1, true, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
      return true;
  return false;
}

static inline int64_t td__ref_get(const td__refcnt *r) {
  return __atomic_load_n(&r->n, __ATOMIC_ACQUIRE);
}

#endif
