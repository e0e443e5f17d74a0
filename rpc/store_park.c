/* store_park.c - rank 0's store holding waits instead of being polled (store.h, parked waits).
 *
 * A wait (op 8) that is not over when it arrives is parked in the store; its unary call is
 * deferred in the transport (td__transport_unary_defer) and its session's seal kept
 * (td__auth_store_current_seal), so that when a set, add or delete ends the wait (on the poller
 * thread, inside another request), or its time passes (the poller's tick), the reply is sealed
 * and sent then. Before the transport shuts down, td__store_park_end answers every parked wait;
 * the transport fails any call still deferred after that.
 *
 * Lock order: park() runs under the store's mutex and takes the transport's t->mu (the store is
 * never called under t->mu); an answer runs with no store lock held (store.c).
 */
#include <string.h>

#include "agent_state.h"

typedef struct store_wait {
  void *token; /* the transport's deferred call */
  td__auth_seal seal;
} store_wait;

/* The parker's park(): the request being served is held (poller thread, inside on_unary; not
 * through a->tr, which td__transport_create may not have set yet when a worker's first wait
 * arrives). */
static void *park(void *ud) {
  (void)ud;
  store_wait *w = td__malloc(sizeof *w);
  if (!w) return NULL;
  w->token = td__transport_unary_defer();
  if (!w->token) {
    td__free(w);
    return NULL;
  }
  td__auth_store_current_seal(&w->seal);
  return w;
}

/* The parker's answer(): seal the reply with the session's key and send it. */
static void answer(void *token, uint8_t *reply, size_t len) {
  store_wait *w = token;
  uint8_t *out = NULL;
  size_t n = 0;
  if (reply && td__auth_store_seal(&w->seal, reply, len, &out, &n) != TD_OK) out = NULL;
  else if (!reply) out = NULL;
  td__transport_unary_answer(w->token, out, n);
  memset(&w->seal, 0, sizeof w->seal);
  td__free(w);
}

void td__store_park_init(td_rpc_agent *a) {
  a->store_parker = (td__store_parker){park, answer, a};
}

td_status td__store_park_body(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                              size_t *reply_len) {
  td_rpc_agent *a = ctx;
  bool parked = false;
  td_status st = td__store_handle_park(a->store, req, len, reply, reply_len, &a->store_parker,
                                       &parked);
  if (st == TD_OK && parked) { /* an empty body now (dropped: the call is deferred) */
    *reply = NULL;
    *reply_len = 0;
  }
  return st;
}

void td__store_park_tick(td_rpc_agent *a) {
  if (a->store) td__store_expire(a->store, td__now_ns());
}

void td__store_park_end(td_rpc_agent *a) {
  if (a->store) td__store_unpark_all(a->store);
}
