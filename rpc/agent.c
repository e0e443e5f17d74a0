/* agent.c - the RPC agent object: options and their defaults, accessors, worker infos and the
 * handler context. The agent's work is split by concern across rpc/ (see agent_state.h for the
 * map): calls in call.c, requests in serve.c, init in rendezvous.c, shutdown in shutdown.c.
 *
 * THREAD SAFETY: every accessor may run on any thread once init returned; the worker table is
 * immutable after init.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_state.h"

td__threadpool *td__agent_pool(td_rpc_agent *a) { return a->pool; }
const td__store_client *td__agent_store(td_rpc_agent *a) { return &a->sc; }
const char *td__agent_listen_addr(td_rpc_agent *a) { return a->listen_addr; }
const td__auth *td__agent_auth(td_rpc_agent *a) { return &a->auth; }
bool td__agent_tls(td_rpc_agent *a) { return a->tls; }
void td__agent_count_refused(td_rpc_agent *a) {
  __atomic_add_fetch(&a->cnt.refused_by_layers, 1, __ATOMIC_RELAXED);
}

void td_rpc_options_init(td_rpc_options *o) {
  memset(o, 0, sizeof *o);
  o->magic = TD_RPC_OPTIONS_MAGIC;
  o->num_worker_threads = 16;
  o->rpc_timeout_ms = TD__RPC_DEFAULT_TIMEOUT_MS;
  o->init_timeout_ms = TD__RPC_DEFAULT_INIT_TIMEOUT_MS;
  o->listen_addr = NULL; /* chosen at init: td__choose_address */
  o->keepalive_ms = 0; /* automatic: 2000, longer in large groups (rendezvous.c) */
  o->keepalive_timeout_ms = 20000;
  o->busy_poll_us = -1;
  o->direct_copy = -1;
  o->shm_lane = -1;
  o->max_message_bytes = TD_RPC_DEFAULT_MAX_MESSAGE;
  o->memory_quota_bytes = 1ull << 30;
}

void td_rpc_call_opts_init(td_rpc_call_opts *o) { *o = (td_rpc_call_opts)TD_RPC_CALL_OPTS_INIT; }

td_status td__call_opts_timeout(const td_rpc_call_opts *opts, const char *who,
                                td_timeout_ms *out) {
  if (opts && opts->magic != TD_RPC_CALL_OPTS_MAGIC)
    return td_set_error(TD_ERR_INVALID, "%s: td_rpc_call_opts not initialised: use "
                        "TD_RPC_CALL_OPTS_INIT or td_rpc_call_opts_init(), then set its fields "
                        "(a zeroed struct would read as TD_TIMEOUT_ZERO: expired at once)", who);
  *out = opts ? opts->timeout_ms : TD_TIMEOUT_DEFAULT;
  return TD_OK;
}

td_status td_rpc_secret_generate(char *out, size_t n) {
  TD_CHECK_ARG(out && n >= 65, "rpc_secret_generate: the buffer must hold 65 bytes");
  uint8_t b[32];
  TD_TRY(td__auth_random(b, sizeof b));
  for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
  memset(b, 0, sizeof b);
  return TD_OK;
}

td_status td_rpc_secret_ensure_env(void) {
  const char *s = getenv("TD_RPC_SECRET"), *f = getenv("TD_RPC_SECRET_FILE");
  if ((s && *s) || (f && *f)) return TD_OK;
  char secret[65];
  TD_TRY(td_rpc_secret_generate(secret, sizeof secret));
  int rc = setenv("TD_RPC_SECRET", secret, 1);
  memset(secret, 0, sizeof secret);
  return rc == 0 ? TD_OK : td_set_error(TD_ERR_NOMEM, "rpc_secret_ensure_env: setenv failed");
}

td_status td_rpc_get_stats(td_rpc_agent *a, td_rpc_stats *out) {
  TD_CHECK_ARG(a && out, "rpc_get_stats: NULL argument");
  memset(out, 0, sizeof *out);
  td__transport_traffic(a->tr, -1, &out->traffic);
#define LOAD(f) __atomic_load_n(&a->cnt.f, __ATOMIC_RELAXED)
  out->calls_started = LOAD(calls_started);
  out->calls_succeeded = LOAD(calls_succeeded);
  out->calls_failed = LOAD(calls_failed);
  out->calls_timed_out = LOAD(calls_timed_out);
  out->requests_received = LOAD(requests_received);
  out->requests_failed = LOAD(requests_failed);
  out->requests_rejected = LOAD(requests_rejected);
  out->requests_expired = LOAD(requests_expired);
  out->pool_saturated = LOAD(pool_saturated);
  out->handler_ns = LOAD(handler_ns);
  out->sync_wait_ns = LOAD(sync_wait_ns);
  out->refused_connections = td__transport_refused(a->tr) + LOAD(refused_by_layers);
  out->streams_opened = LOAD(streams_opened);
  out->streams_shared = LOAD(streams_shared);
#undef LOAD
  out->calls_pending = __atomic_load_n(&a->pending_out, __ATOMIC_ACQUIRE);
  out->requests_active = __atomic_load_n(&a->active_in, __ATOMIC_ACQUIRE);
  out->pool_pending = (int64_t)td__threadpool_pending(a->pool);
  return TD_OK;
}

td_status td_rpc_get_peer_traffic(td_rpc_agent *a, int rank, td_rpc_traffic *out) {
  TD_CHECK_ARG(a && out, "rpc_get_peer_traffic: NULL argument");
  if (rank < 0 || rank >= a->world)
    return td_set_error(TD_ERR_NOT_FOUND, "rpc: no worker with rank %d (world size %d)", rank,
                        a->world);
  td__transport_traffic(a->tr, rank, out);
  return TD_OK;
}

int td_rpc_rank(const td_rpc_agent *a) { return a ? a->rank : -1; }
int td_rpc_world_size(const td_rpc_agent *a) { return a ? a->world : 0; }
int td_rpc_initial_world_size(const td_rpc_agent *a) { return a ? a->world0 : 0; }
int64_t td_rpc_busy_poll_us(const td_rpc_agent *a) { return a ? a->busy_poll_us : 0; }
int td_rpc_direct_copy_peers(const td_rpc_agent *a) {
  return a && a->tr ? td__transport_direct_readers(a->tr) : 0;
}
int td_rpc_shm_lanes(const td_rpc_agent *a) {
  return a && a->tr ? td__transport_lanes_up(a->tr) : 0;
}
int td_rpc_mailbox_lanes(const td_rpc_agent *a) {
  return a && a->tr ? td__transport_lanes_mbox(a->tr) : 0;
}

td_status td_rpc_set_default_timeout(td_rpc_agent *a, td_timeout_ms t) {
  TD_CHECK_ARG(a && td__timeout_valid(t), "rpc_set_default_timeout: invalid timeout %lld",
               (long long)t);
  t = td__timeout_resolve(t, a->opts.rpc_timeout_ms);
  __atomic_store_n(&a->default_timeout_ms, t, __ATOMIC_RELAXED);
  return TD_OK;
}
td_timeout_ms td_rpc_get_default_timeout(const td_rpc_agent *a) {
  return a ? __atomic_load_n(&a->default_timeout_ms, __ATOMIC_RELAXED) : TD_TIMEOUT_INFINITE;
}

const char *td__agent_peer_name(const td_rpc_agent *a, int rank) {
  if (a->peers && td__agent_present(a, rank) && a->peers[rank].info.name[0])
    return a->peers[rank].info.name;
  return "?";
}

size_t td__agent_name_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return (size_t)(h ^ (h >> 29));
}

int td__agent_rank_of(const td_rpc_agent *a, const char *name) {
  if (a->name_idx) { /* a call by name costs O(1), not a scan of the group */
    /* (entries of workers that joined later appear while others read: elastic.c) */
    int e;
    for (size_t i = td__agent_name_hash(name) & a->name_mask;
         (e = __atomic_load_n(&a->name_idx[i], __ATOMIC_ACQUIRE)) != 0; i = (i + 1) & a->name_mask)
      if (strcmp(a->peers[e - 1].info.name, name) == 0) return e - 1;
    return -1;
  }
  for (int r = 0; r < a->world0; r++)
    if (strcmp(a->peers[r].info.name, name) == 0) return r;
  return -1;
}

bool td__agent_peer_has_fn(const peer_info *p, const char *fn) {
  int lo = 0, hi = p->nfns - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    int c = strcmp(p->fns[mid], fn);
    if (c == 0) return true;
    if (c < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return false;
}

/* ---- worker info ---- */

td_status td_rpc_get_worker_info(td_rpc_agent *a, const char *name, td_worker_info *out) {
  TD_CHECK_ARG(a && name && out, "rpc_get_worker_info: NULL argument");
  int r = td__agent_find(a, name);
  if (r < 0) return td_set_error(TD_ERR_NOT_FOUND, "rpc: no worker named '%s'", name);
  *out = a->peers[r].info;
  return TD_OK;
}

td_status td_rpc_get_worker_info_by_rank(td_rpc_agent *a, int rank, td_worker_info *out) {
  TD_CHECK_ARG(a && out, "rpc_get_worker_info_by_rank: NULL argument");
  if (rank < 0 || rank >= a->world)
    return td_set_error(TD_ERR_NOT_FOUND, "rpc: no worker with rank %d (world size %d)", rank,
                        a->world);
  if (!td__agent_learn_rank(a, rank))
    return td_set_error(TD_ERR_NOT_FOUND, "rpc: rank %d is a free place of the group (no worker "
                        "has joined there yet; %d places, %d taken at the start)", rank,
                        a->world, a->world0);
  *out = a->peers[rank].info;
  return TD_OK;
}

td_status td_rpc_self(td_rpc_agent *a, td_worker_info *out) {
  return td_rpc_get_worker_info_by_rank(a, a ? a->rank : -1, out);
}

td_rpc_agent *td_rpc_ctx_agent(const td_rpc_ctx *c) { return c->agent; }
const char *td_rpc_ctx_caller_name(const td_rpc_ctx *c) { return c->caller_name; }
int td_rpc_ctx_caller_rank(const td_rpc_ctx *c) { return c->caller_rank; }
void *td_rpc_ctx_user_data(const td_rpc_ctx *c) { return c->user_data; }
