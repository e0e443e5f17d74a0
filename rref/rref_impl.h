/* rref_impl.h - internals shared by the rref/ files (never installed).
 *
 * rref.c   the protocol description, per-agent contexts, td_rref objects (user and owner
 *          handles), the "rref" value type (forks on the wire), the user-side API.
 * owner.c  the owner's table of entries and the internal handlers (__rref_remote, __rref_fork,
 *          __rref_delete, __rref_fetch, __rref_call), the debug table and the shutdown hook.
 * util.c   small containers (u64 map, u64 vector, ring of finished fork ids), control messages
 *          with retries (one timer thread per process) and opaque objects.
 *
 * Lock order: ctx->mu is a leaf lock: nothing is sent, no future completed and no value or RRef
 * released while it is held.
 */
#ifndef TD_RREF_IMPL_H
#define TD_RREF_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "../core/core.h"
#include "../core/refcount.h"
#include "../rpc/agent_impl.h"
#include "../rpc/value_impl.h"
#include "tdist/rref.h"

/* ---- containers (util.c) ---- */

/* Open-addressing map uint64 -> pointer. Key 0 is reserved (never an id). */
typedef struct td__u64map {
  uint64_t *keys;
  void **vals;
  size_t cap, len;
} td__u64map;
void *td__u64map_get(const td__u64map *m, uint64_t k);
/* td__u64map_put inserts or replaces; false when out of memory. */
bool td__u64map_put(td__u64map *m, uint64_t k, void *v);
/* td__u64map_del removes k and returns its value (NULL when absent). */
void *td__u64map_del(td__u64map *m, uint64_t k);
void td__u64map_fini(td__u64map *m);

typedef struct td__u64vec {
  uint64_t *v;
  size_t n, cap;
} td__u64vec;
bool td__u64vec_has(const td__u64vec *v, uint64_t x);
bool td__u64vec_push(td__u64vec *v, uint64_t x);
/* td__u64vec_remove removes one x (order not kept); false when absent. */
bool td__u64vec_remove(td__u64vec *v, uint64_t x);
void td__u64vec_fini(td__u64vec *v);

/* Ring of the last TD__RREF_DONE_CAP fork ids that ended (owner: added then deleted, or a
 * tombstone cancelled; user: released before its confirmation came). A control message about a
 * fork in the ring is a duplicate (a retry) and is ignored. */
#define TD__RREF_DONE_CAP 8192
typedef struct td__fork_ring {
  uint64_t ring[TD__RREF_DONE_CAP];
  size_t head, len;
  td__u64map set;
} td__fork_ring;
bool td__fork_ring_has(const td__fork_ring *r, uint64_t f);
void td__fork_ring_push(td__fork_ring *r, uint64_t f);

/* ---- contexts, entries, handles ---- */

enum { TD__RREF_PENDING = 0, TD__RREF_READY = 1, TD__RREF_FAILED = 2 };

typedef struct td__rref_ctx td__rref_ctx;

/* An owner's record of one RRef. Fields under ctx->mu except `ready` (a future, completed once,
 * outside the lock). */
typedef struct td__rref_entry {
  int64_t refs; /* struct references: the table (while live), owner handles, pending work */
  uint64_t id;
  int state;
  bool live;    /* in ctx->owned */
  bool created; /* the creation request was applied (dedupe) */
  td_value *value;
  td_status err_st; /* FAILED: the creation error ("RRef creation failed: ...") */
  char *err_msg;
  td_future *ready; /* completes with none when the value is set; fails on creation failure */
  td__u64vec forks; /* user forks the owner has accepted */
  td__u64vec tombs; /* forks deleted before their fork message arrived */
  int64_t handles;  /* owner handles (td_rref objects in this process) */
} td__rref_entry;

struct td__rref_ctx {
  td__refcnt rc;
  td_rpc_agent *agent; /* only used while !closed */
  int rank, world;
  char (*names)[128]; /* worker names by rank (copied at creation) */
  pthread_mutex_t mu;
  pthread_cond_t cv; /* senders reached 0 */
  bool closed;
  int senders;      /* threads inside td_rpc_async on behalf of this layer */
  uint64_t counter; /* id counter (atomic) */
  td__u64map owned; /* rref id -> td__rref_entry* */
  td__u64map users; /* fork id -> td_rref* (user RRefs alive here) */
  td__u64map early; /* fork id -> early_confirm* (confirmation before the RRef was decoded) */
  td__fork_ring done;
  int64_t releasing; /* (atomic) freed values whose release is queued on the pool */
};

struct td_rref {
  td__refcnt rc;
  td__rref_ctx *ctx; /* reference */
  uint64_t id, fork; /* fork 0: owner handle */
  int owner;
  td__rref_entry *entry; /* owner handles: struct reference */
  td_future *created;    /* users: creation / confirmation; owners: entry->ready */
  int confirmed;         /* atomic */
  int64_t children;      /* atomic: forks sent whose owner acknowledgement is awaited */
};

/* td__rref_ctx_get returns (new reference) the context of agent a, creating it when create is set
 * (TD_ERR_STATE when a was shut down). */
td_status td__rref_ctx_get(td_rpc_agent *a, bool create, td__rref_ctx **out);
void td__rref_ctx_unref(td__rref_ctx *c);
uint64_t td__rref_next_id(td__rref_ctx *c);
const char *td__rref_name(const td__rref_ctx *c, int rank);

/* td__rref_call sends fn to rank `to` through the agent unless the context is closed (then
 * TD_ERR_STATE). args borrowed. timeout_ms as td_rpc_call_opts. */
td_status td__rref_call(td__rref_ctx *c, int to, const char *fn, td_value *const *args, int nargs,
                        td_timeout_ms timeout_ms, td_future **out);
/* td__rref_control sends a fire-and-forget control message (arg: its one argument, owned), retried
 * on TD_ERR_UNAVAILABLE with backoff. hold (may be NULL) is an RRef reference released (and its
 * children count decremented) once the message is acknowledged or given up. Returns the first
 * attempt's synchronous failure (everything has been released then). */
td_status td__rref_control(td__rref_ctx *c, int to, const char *fn, td_value *arg, td_rref *hold);
/* td__rref_control_ex is td__rref_control that also reports how the message ended: *outcome (may
 * be NULL; a new reference, set even when the first attempt fails synchronously) completes with
 * no value once the receiver acknowledged it, or fails with the last attempt's error when it was
 * given up. */
td_status td__rref_control_ex(td__rref_ctx *c, int to, const char *fn, td_value *arg, td_rref *hold,
                              td_future **outcome);

/* Builds outcome values: [0, value] (takes value; NULL means none) or [status, message]. */
td_value *td__rref_outcome_ok(td_value *value);
td_value *td__rref_outcome_err(td_status st, const char *msg);
/* td__rref_outcome_take reads an outcome: TD_OK with *value (new reference), or the error with
 * td_last_error set to its message. */
td_status td__rref_outcome_take(const td_value *outcome, td_value **value);

/* Owner side (owner.c), all take ctx->mu themselves. */
/* td__rref_owner_handle_new: an owner handle for id (entry created pending when absent); when
 * drop_fork is not 0 that fork is released (an RRef sent back to its owner). */
td_status td__rref_owner_handle(td__rref_ctx *c, uint64_t id, uint64_t drop_fork, td_rref **out);
/* td__rref_entry_new_local: a new entry with one handle (ready with value when value != NULL). */
td_status td__rref_entry_new_local(td__rref_ctx *c, uint64_t id, td_value *value,
                                   td__rref_entry **out);
/* td__rref_owner_add_fork: adds fork f to the entry of an owner handle (sending it away). */
td_status td__rref_owner_add_fork(td__rref_ctx *c, td__rref_entry *e, uint64_t f);
/* td__rref_handle_release drops an owner handle's hold on e. */
void td__rref_handle_release(td__rref_ctx *c, td__rref_entry *e);
/* td__rref_entry_pending: the entry's value is still being created. */
bool td__rref_entry_pending(td__rref_ctx *c, td__rref_entry *e);
/* td__rref_entry_read: the entry's value (new reference) or its error. */
td_status td__rref_entry_read(td__rref_ctx *c, td__rref_entry *e, td_value **out);
/* td__rref_fail_entry fails a pending entry (a self-remote that could not be sent). */
void td__rref_fail_entry(td__rref_ctx *c, td__rref_entry *e, td_status st, const char *msg);
void td__rref_owner_register(void);
/* td__rref_ctx_close marks c closed, waits for senders, releases every entry; returns the leak
 * report in buf (empty when none) and the number of leaks. */
int td__rref_ctx_close(td__rref_ctx *c, bool report, char *buf, size_t n);

/* User side (rref.c). */
void td__rref_user_register(void);
/* td__rref_args_gate: *wait (NULL when nothing is pending) completes once every RRef among args
 * (lists and dicts searched) is confirmed by its owner and, on the owner, has its value or failed
 * (PyTorch waits for a request's pending user RRefs before running its function). rref.c. */
td_status td__rref_args_gate(td_value *const *args, int nargs, td_future **wait);

/* Opaque objects (util.c). */
void td__rref_objects_init(void);

/* Formats an id as "rank:counter". */
const char *td__rref_id_str(uint64_t id, char *buf, size_t n);

#endif
