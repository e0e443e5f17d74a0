/* process_group.c - process groups: creation over the RPC rendezvous store and destruction.
 *
 * Creation (collective over the members only):
 *   1. The members agree on a group id. Group rank 0 takes the next value of the store counter
 *      "pg/next_id" and publishes it under "pg/new/<n>/<hash of the rank list>/<k>", where k
 *      counts this process's earlier groups with the same rank list (members create the groups
 *      of one rank list in the same order, so k agrees); the others wait for that key. Groups
 *      over different rank lists never wait on each other, and non-members take no part.
 *   2. Each backend of the table sets itself up in turn (td__coll_backend.setup, all members
 *      alike, one deadline for the whole creation) and says whether it serves the group: the
 *      TCP ring (every group of more than one member; ring.c, ring_connect.c: each member
 *      connects to its right neighbour and accepts its left one, every connection
 *      authenticated), shared memory (every member on this host; shm.c), single-copy reads over
 *      it (shm_cma.c), NCCL (groups created with TD_PG_BACKEND_NCCL; nccl/).
 * A failure anywhere destroys what was set up and fails the creation on this member; the others
 * fail by their deadline or sooner (a closed connection).
 *
 * Destruction: the queue first (queued operations fail, the running one finishes), then the
 * backends in reverse order.
 *
 * Lock order: pg->mu, then pg_counts_mu. No lock is held while talking to the store except
 * pg->mu (the store client is thread-safe).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/flight_impl.h"
#include "../rpc/agent_impl.h"
#include "coll_impl.h"

/* The backend table, in setup order (td__tp). */
static const td__coll_backend *const backends[TD__TP_COUNT] = {
    [TD__TP_RING] = &td__coll_ring,
    [TD__TP_SHM] = &td__coll_shm,
    [TD__TP_CMA] = &td__coll_cma,
#ifdef TD_HAVE_NCCL
    [TD__TP_NCCL] = &td__coll_nccl,
#endif
};

/* ---- per-process counts of groups created per (agent, rank list) ---- */

typedef struct pg_count {
  const td_rpc_agent *agent;
  uint64_t hash;
  int n;
  int64_t count;
} pg_count;

static pthread_mutex_t pg_counts_mu = PTHREAD_MUTEX_INITIALIZER;
static pg_count *pg_counts;
static size_t pg_ncounts, pg_capcounts;

static td_status next_count(const td_rpc_agent *a, uint64_t hash, int n, int64_t *out) {
  td_status st = TD_OK;
  pthread_mutex_lock(&pg_counts_mu);
  size_t i = 0;
  while (i < pg_ncounts && !(pg_counts[i].agent == a && pg_counts[i].hash == hash &&
                             pg_counts[i].n == n))
    i++;
  if (i == pg_ncounts) {
    if (pg_ncounts == pg_capcounts) {
      size_t nc = pg_capcounts ? pg_capcounts * 2 : 16;
      pg_count *t = td__realloc(pg_counts, nc * sizeof *t);
      if (!t) {
        st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
        goto out;
      }
      pg_counts = t;
      pg_capcounts = nc;
    }
    pg_counts[pg_ncounts++] = (pg_count){a, hash, n, 0};
  }
  *out = pg_counts[i].count++;
out:
  pthread_mutex_unlock(&pg_counts_mu);
  return st;
}

td_status td__pg_new_key(const td_rpc_agent *agent, const int *rs, int n, char *key,
                         size_t cap) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < n; i++) h = (h ^ (uint64_t)(uint32_t)rs[i]) * 1099511628211ull;
  int64_t k = 0;
  TD_TRY(next_count(agent, h, n, &k));
  snprintf(key, cap, "pg/new/%d/%016llx/%lld", n, (unsigned long long)h, (long long)k);
  return TD_OK;
}

static td_status agree_id(td_process_group *pg, uint64_t deadline) {
  char key[128];
  TD_TRY(td__pg_new_key(pg->agent, pg->ranks, pg->size, key, sizeof key));
  if (pg->rank == 0) {
    int64_t id;
    TD_TRY(td__store_add(pg->sc, "pg/next_id", 1, &id));
    char v[32];
    int n = snprintf(v, sizeof v, "%lld", (long long)id);
    TD_TRY(td__store_set(pg->sc, key, v, (size_t)n));
    pg->id = (uint64_t)id;
    return TD_OK;
  }
  char what[256], who[160];
  snprintf(what, sizeof what, "%s, the group's rank 0, to create the group",
           td__pg_who(pg, 0, who, sizeof who));
  uint8_t *v = NULL;
  TD_TRY(td__pg_wait_key(pg, key, deadline, what, &v, NULL));
  pg->id = strtoull((char *)v, NULL, 10);
  td__free(v);
  return TD_OK;
}

/* ---- public API ---- */

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

td_status td_process_group_create(td_rpc_agent *agent, const int *ranks, int n,
                                  td_pg_backend backend, td_timeout_ms timeout,
                                  td_process_group **out) {
  TD_CHECK_ARG(agent && out, "process_group_create: NULL agent or out");
  TD_CHECK_ARG(td__timeout_valid(timeout), "process_group_create: invalid timeout %lld",
               (long long)timeout);
  TD_CHECK_ARG(backend == TD_PG_BACKEND_CPU || backend == TD_PG_BACKEND_NCCL,
               "process_group_create: unknown backend %d", (int)backend);
#ifndef TD_HAVE_NCCL
  if (backend == TD_PG_BACKEND_NCCL)
    return td_set_error(TD_ERR_UNSUPPORTED, "process_group_create: the NCCL backend is not in "
                        "this build (configure with CUDA and NCCL available)");
#endif
  int world = td_rpc_world_size(agent), me = td_rpc_rank(agent);
  if (!ranks) n = world;
  TD_CHECK_ARG(n >= 1 && n <= world, "process_group_create: %d ranks for a world of %d", n,
               world);
  int *rs = td__malloc((size_t)n * sizeof *rs);
  if (!rs) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  for (int i = 0; i < n; i++) rs[i] = ranks ? ranks[i] : i;
  qsort(rs, (size_t)n, sizeof *rs, cmp_int);
  int my = -1;
  for (int i = 0; i < n; i++) {
    if (rs[i] < 0 || rs[i] >= world || (i && rs[i] == rs[i - 1])) {
      int bad = rs[i];
      td__free(rs);
      return td_set_error(TD_ERR_INVALID, "process_group_create: rank %d is %s", bad,
                          bad < 0 || bad >= world ? "outside the world" : "listed twice");
    }
    if (rs[i] == me) my = i;
  }
  if (my < 0) { /* not a member: like new_group, a non-member gets no group */
    td__free(rs);
    *out = NULL;
    return TD_OK;
  }
  return td__pg_create_member(agent, rs, n, my, backend,
                              td__timeout_resolve(timeout, TD__PG_DEFAULT_TIMEOUT_MS), NULL, out);
}

td_status td__pg_create_member(td_rpc_agent *agent, int *rs, int n, int my, td_pg_backend backend,
                               int64_t timeout_ms, const td__pg_given *given,
                               td_process_group **out) {
  td_status st = TD_OK;
  td_process_group *pg = td__calloc(1, sizeof *pg);
  if (!pg) {
    td__free(rs);
    return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  }
  pthread_mutex_init(&pg->mu, NULL);
  pthread_mutex_init(&pg->lost_mu, NULL);
  pg->lost_grank = -1;
  pg->fail_culprit = -1;
  pg->agent = agent;
  pg->sc = td__agent_store(agent);
  pg->ranks = rs;
  pg->size = n;
  pg->rank = my;
  pg->backend = backend;
  pg->timeout_ms = timeout_ms;
  pg->send_fd = pg->recv_fd = -1;
  pg->nccl_device = -1;
  pg->names = td__calloc((size_t)n, sizeof *pg->names);
  pg->slot_chunks = td__calloc((size_t)n, sizeof *pg->slot_chunks);
  pg->slot_ins = td__calloc((size_t)n, sizeof *pg->slot_ins);
  pg->slot_srcs = td__calloc((size_t)n, sizeof *pg->slot_srcs);
  if (!pg->names || !pg->slot_chunks || !pg->slot_ins || !pg->slot_srcs) {
    st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    td_worker_info wi;
    if (td_rpc_get_worker_info_by_rank(agent, rs[i], &wi) == TD_OK)
      snprintf(pg->names[i], sizeof pg->names[i], "%s", wi.name);
    else
      snprintf(pg->names[i], sizeof pg->names[i], "worker?");
  }
  st = td__pg_read_mode(pg);
  if (st == TD_OK) st = td__work_create(pg);
  if (st != TD_OK) goto out;
  uint64_t deadline = given ? given->deadline : td__pg_deadline(pg);
  if (given) {
    pg->id = given->id;
    pg->lineage = given->lineage;
    pg->generation = given->generation;
  } else {
    st = agree_id(pg, deadline);
    pg->lineage = pg->id;
  }
  for (int i = 0; st == TD_OK && i < TD__TP_COUNT; i++) {
    bool serves = true;
    if (!backends[i]) continue;
    if (backends[i]->setup) st = backends[i]->setup(pg, deadline, &serves);
    if (st == TD_OK && serves) pg->tp[i] = backends[i];
  }
out:
  if (st != TD_OK) {
    td_process_group_destroy(pg);
    return st;
  }
  td_log(TD_LOG_DEBUG, "process group %llu: rank %d of %d, generation %llu",
         (unsigned long long)pg->id, pg->rank, pg->size, (unsigned long long)pg->generation);
  td__flight_group_add(pg->id, pg->rank, pg->size, pg->ranks); /* dumps name its members */
  *out = pg;
  return TD_OK;
}

void td_process_group_destroy(td_process_group *pg) {
  if (!pg) return;
  if (pg->id) td__flight_group_remove(pg->id);
  td__work_destroy(pg->work); /* queued operations fail; the running one finishes first */
  for (int i = TD__TP_COUNT - 1; i >= 0; i--) {
    if (pg->tp[i] && pg->tp[i]->destroy) pg->tp[i]->destroy(pg);
    pg->tp[i] = NULL;
  }
  pthread_mutex_destroy(&pg->mu);
  pthread_mutex_destroy(&pg->lost_mu);
  td__free(pg->scratch);
  td__free(pg->broken_msg);
  td__free(pg->names);
  td__free(pg->slot_chunks);
  td__free(pg->host_pid);
  td__free((void *)pg->slot_ins);
  td__free((void *)pg->slot_srcs);
  td__free(pg->ranks);
  td__free(pg);
}

int td_process_group_rank(const td_process_group *pg) { return pg ? pg->rank : -1; }
int td_process_group_size(const td_process_group *pg) { return pg ? pg->size : 0; }
int td_process_group_global_rank(const td_process_group *pg, int group_rank) {
  if (!pg || group_rank < 0 || group_rank >= pg->size) return -1;
  return pg->ranks[group_rank];
}
td_pg_backend td_process_group_backend(const td_process_group *pg) {
  return pg ? pg->backend : TD_PG_BACKEND_CPU;
}
td_status td_process_group_set_timeout(td_process_group *pg, td_timeout_ms timeout_ms) {
  TD_CHECK_ARG(pg && td__timeout_valid(timeout_ms), "process_group_set_timeout: invalid timeout "
               "%lld", (long long)timeout_ms);
  pthread_mutex_lock(&pg->mu);
  pg->timeout_ms = td__timeout_resolve(timeout_ms, TD__PG_DEFAULT_TIMEOUT_MS);
  pthread_mutex_unlock(&pg->mu);
  return TD_OK;
}
