/* dist_autograd_impl.h - internals shared by the distributed autograd files (never installed).
 *
 * Objects: one da_state per agent (contexts by id, tombstones of ended contexts, id counters,
 * debug counters) and reference-counted contexts (gradient map, send functions by autograd
 * message id, the set of workers this worker talked to within the context).
 *
 * Lock order: da_state.mu, then a context's mu, then the grad map's own lock (inside the engine).
 * No lock is held while calling into the agent or the engine.
 */
#ifndef TD_DIST_AUTOGRAD_IMPL_H
#define TD_DIST_AUTOGRAD_IMPL_H

#include <pthread.h>

#include "../core/core.h"
#include "../core/flight_impl.h"
#include "../core/refcount.h"
#include "../rpc/agent_impl.h"
#include "../rpc/value_impl.h"
#include "tdist/dist_autograd.h"

#define DA_TOMBSTONES 8192 /* ended context ids remembered so that stragglers cannot revive them */

typedef struct da_send {
  uint64_t msg_id;
  td_node *node; /* owned reference */
} da_send;

typedef struct da_state da_state;

struct td_dist_autograd_context {
  td__refcnt rc;
  uint64_t id;
  da_state *st;
  pthread_mutex_t mu;
  td_grad_map *grads;
  da_send *sends; /* guarded by mu */
  size_t nsends, capsends;
  uint8_t *workers; /* [world]: 1 when this worker sent to or received from that rank */
  bool ended;       /* removed from the table (guarded by mu) */
};

struct da_state {
  td_rpc_agent *agent;
  int rank, world;
  pthread_mutex_t mu;
  td_dist_autograd_context **ctxs; /* live contexts (guarded by mu) */
  size_t nctxs, capctxs;
  uint64_t tomb[DA_TOMBSTONES];
  size_t ntomb, tomb_pos;
  uint64_t next_ctx, next_msg; /* atomic counters */
  int64_t running;             /* atomic: backward passes running here */
  bool closed;
  da_state *next;
};

/* da_state_of returns the state of agent a (created on first use); NULL only when out of memory. */
da_state *td__da_state_of(td_rpc_agent *a);
/* td__da_lookup returns a new reference to the live context id, or NULL. */
td_dist_autograd_context *td__da_lookup(da_state *s, uint64_t id);
/* td__da_ctx_send_find returns a new reference to the send function msg_id of c, or NULL. */
td_node *td__da_send_find(td_dist_autograd_context *c, uint64_t msg_id);
/* td__da_ctx_add_send stores node (takes a new reference) under msg_id. */
td_status td__da_send_add(td_dist_autograd_context *c, uint64_t msg_id, td_node *node);
/* td__da_worker_name writes rank's worker name into buf. */
void td__da_worker_name(da_state *s, int rank, char *buf, size_t n);
/* "rank:counter" of an id, for messages. */
const char *td__da_id_str(uint64_t id, char *buf, size_t n);

/* backward.c: send/recv functions and the __dist_backward handler. */
/* td__da_record_send makes the send function for the tensors of m that require grad (if any) and
 * sets m->autograd_msg_id and m->aux. */
td_status td__da_record_send(td_dist_autograd_context *c, int peer, td__msg *m);
/* td__da_attach_recv makes the tensors of m listed in m->aux outputs of a new recv function. */
td_status td__da_attach_recv(td_dist_autograd_context *c, int peer, td__msg *m);
void td__da_backward_register(void);

/* join.c-like helper (backward.c): a future that completes once every future of fs[0..n) is done:
 * with none when all succeeded (and first_error is TD_OK), else failing with first_error and
 * first_msg, or with the first failed future's status and message. Takes the references of fs.
 * done(ud) runs once when the join completes (before the join's callbacks), may be NULL. */
td_status td__da_join(td_future **fs, int n, td_status first_error, const char *first_msg,
                      void (*done)(void *ud), void *ud, td_future **out);

#endif
