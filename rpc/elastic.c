/* elastic.c - learning the workers that took a place of an elastic group after its start
 * (td_rpc_options.max_world_size; how they join: rendezvous.c, "Joining a running group").
 *
 * Nobody is told when a worker joins: the starting workers learn it when they first need it -
 * a call by its name or rank (on the caller's thread), or a request from it (on the pool, since
 * the network thread must not wait for the store) - by reading its record and registry from rank
 * 0's store. A place is learnt once: peers[r] is filled under a->mu, then present[r] and the
 * names index entry are published with release stores, so the lock-free readers
 * (td__agent_rank_of, td__agent_present) see either nothing or the whole record.
 *
 * Lock order: a->mu is taken only to install a record read beforehand (no store call under it).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_state.h"

/* Places taken after the start, from the store (a->late_known follows it). */
static td_status late_taken(td_rpc_agent *a, int *out) {
  int64_t k = 0;
  TD_TRY(td__store_add(&a->sc, "late/next", 0, &k));
  int most = a->world - a->world0;
  *out = k < 0 ? 0 : k > most ? most : (int)k; /* (refused joiners count past the places) */
  __atomic_store_n(&a->late_known, *out, __ATOMIC_RELAXED);
  __atomic_store_n(&a->late_read_ns, td__now_ns(), __ATOMIC_RELAXED);
  return TD_OK;
}

/* A free place is asked about again only after LATE_FRESH_NS: a loop over every place (the RRef
 * layer names them all at init) costs one store request, not one per free place. */
#define LATE_FRESH_NS 50000000ull

td_status td__agent_members(td_rpc_agent *a, int *members) {
  if (a->world == a->world0) {
    *members = a->world;
    return TD_OK;
  }
  int late = 0;
  TD_TRY(late_taken(a, &late));
  *members = a->world0 + late;
  return TD_OK;
}

td_status td_rpc_group_members(td_rpc_agent *a, int *members) {
  TD_CHECK_ARG(a && members, "rpc_group_members: NULL argument");
  return td__agent_members(a, members);
}

/* Reads rank r's record and registry and installs them. TD_ERR_NOT_FOUND while its worker has
 * not published them (it is still joining, or died first). */
static td_status learn(td_rpc_agent *a, int r) {
  char key[64];
  uint8_t *rec = NULL, *reg = NULL;
  size_t n = 0;
  bool found = false;
  snprintf(key, sizeof key, "worker/%d", r);
  TD_TRY(td__store_get(&a->sc, key, &rec, NULL, &found));
  if (!found) return td_set_error(TD_ERR_NOT_FOUND, "rpc: rank %d has not joined yet", r);
  snprintf(key, sizeof key, "registry/%d", r);
  td_status st = td__store_get(&a->sc, key, &reg, NULL, &found);
  if (st == TD_OK && !found)
    st = td_set_error(TD_ERR_NOT_FOUND, "rpc: rank %d has not joined yet", r);
  char *fns = NULL;
  if (st == TD_OK) st = td__rdv_registry_text(a, (const char *)reg, &fns, &n);
  td__free(reg);
  if (st != TD_OK) {
    td__free(rec);
    return st;
  }
  pthread_mutex_lock(&a->mu);
  if (td__agent_present(a, r)) { /* learnt meanwhile by another thread */
    pthread_mutex_unlock(&a->mu);
    td__free(rec);
    td__free(fns);
    return TD_OK;
  }
  st = td__rdv_install_peer(a, r, (char *)rec, fns, n);
  td__free(rec);
  if (st != TD_OK && a->peers[r].fns_blob != fns) td__free(fns); /* (else the peer owns it) */
  /* a name already used answers calls by that name as before: the joiner is reachable by rank */
  if (st == TD_OK && td__rdv_index_name(a, r) != TD_OK)
    td_log(TD_LOG_WARN, "rpc: %s: %s", a->name, td_last_error());
  if (st == TD_OK) __atomic_store_n(&a->present[r], TD__PEER_PRESENT, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&a->mu);
  if (st == TD_OK)
    td_log(TD_LOG_DEBUG, "rpc: %s: learnt %s (rank %d), who joined the group after its start",
           a->name, a->peers[r].info.name, r);
  return st;
}

/* Whether this thread may wait for the store: not a network thread running an inline function
 * (it delivers the store's replies), and not before init has finished. */
static bool may_learn(const td_rpc_agent *a) {
  return a->world > a->world0 && !td__rpc_inline_thread && a->name_idx;
}

bool td__agent_learn_rank(td_rpc_agent *a, int rank) {
  if (td__agent_present(a, rank)) return true;
  if (rank < a->world0 || rank >= a->world || !may_learn(a)) return false;
  int late = __atomic_load_n(&a->late_known, __ATOMIC_RELAXED);
  bool fresh = td__now_ns() - __atomic_load_n(&a->late_read_ns, __ATOMIC_RELAXED) < LATE_FRESH_NS;
  if (rank >= a->world0 + late &&
      (fresh || late_taken(a, &late) != TD_OK || rank >= a->world0 + late))
    return false; /* a free place */
  return learn(a, rank) == TD_OK;
}

int td__agent_find(td_rpc_agent *a, const char *name) {
  int r = td__agent_rank_of(a, name);
  if (r >= 0 || !may_learn(a)) return r;
  int late = 0;
  if (late_taken(a, &late) != TD_OK) return -1;
  for (int q = a->world0; q < a->world0 + late; q++)
    if (!td__agent_present(a, q)) learn(a, q); /* (one not joined yet stays unknown) */
  return td__agent_rank_of(a, name);
}

typedef struct learn_task {
  td_rpc_agent *a;
  int rank;
} learn_task;

static void learn_run(void *arg) {
  learn_task *t = arg;
  if (learn(t->a, t->rank) != TD_OK) {
    td_log(TD_LOG_DEBUG, "rpc: %s: rank %d, who called, not learnt yet: %s", t->a->name,
           t->rank, td_last_error());
    uint8_t learning = TD__PEER_LEARNING; /* (unless another thread learnt it meanwhile) */
    __atomic_compare_exchange_n(&t->a->present[t->rank], &learning, TD__PEER_VACANT, false,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }
  td__free(t);
}

void td__agent_learn_later(td_rpc_agent *a, int rank) {
  if (rank < a->world0 || rank >= a->world) return;
  uint8_t vacant = TD__PEER_VACANT;
  if (!__atomic_compare_exchange_n(&a->present[rank], &vacant, TD__PEER_LEARNING, false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    return; /* present, or being learnt */
  learn_task *t = td__malloc(sizeof *t);
  if (t) {
    t->a = a;
    t->rank = rank;
  }
  if (!t || td__threadpool_submit(a->pool, learn_run, t) != TD_OK) {
    td__free(t);
    __atomic_store_n(&a->present[rank], TD__PEER_VACANT, __ATOMIC_RELEASE);
  }
}
