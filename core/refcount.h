/* refcount.h - a tiny atomic reference count (internal).
 *
 * An object embeds a td__refcnt; td__ref_inc adds one, td__ref_dec drops one and returns true when
 * the count reached zero, at which point the caller runs the destructor. Acquire/release ordering
 * makes every write done before the last drop visible to the destructor.
 */
#ifndef TD_CORE_REFCOUNT_H
#define TD_CORE_REFCOUNT_H

#include <stdbool.h>
#include <stdint.h>

typedef struct td__refcnt {
  int64_t n;
} td__refcnt;

static inline void td__ref_init(td__refcnt *r) { __atomic_store_n(&r->n, 1, __ATOMIC_RELAXED); }

static inline void td__ref_inc(td__refcnt *r) { __atomic_add_fetch(&r->n, 1, __ATOMIC_RELAXED); }

static inline bool td__ref_dec(td__refcnt *r) {
  return __atomic_sub_fetch(&r->n, 1, __ATOMIC_ACQ_REL) == 0;
}

static inline int64_t td__ref_get(const td__refcnt *r) {
  return __atomic_load_n(&r->n, __ATOMIC_ACQUIRE);
}

#endif
