/* rendezvous.c - td__rpc_init_impl: from arguments to a worker that knows the whole group.
 *
 * Init runs in named phases (init_options, init_agent, init_transport, rendezvous, init_finish).
 * The rendezvous itself goes through the store that rank 0 serves, in these steps:
 *   check     world size must match rank 0's
 *   claim     claim/<r> counters catch two workers with one rank
 *   publish   worker/<r> = name + address, registry/<r>, direct/<r>, devmap/<r>
 *   join      the joined counter reaches the world size
 *   read      every worker's record: names (unique), registries, device maps, direct-copy probe
 *             (each kind of record of all N workers in one range request per 4096 ranks or
 *             1 MiB, td__rdv_read_all: O(N) store requests for the group, not O(N^2))
 *   ready     everybody has read everything before anybody proceeds
 *   passed    each worker counts itself done with the store; rank 0 waits for everybody's count
 *             before it takes the store away (at its shutdown), so nobody's init loses it
 * Any worker that detects a fatal mismatch writes "abort", so the others fail fast with the same
 * reason instead of timing out. Rendezvous uses wait-for-ready (rank 0 may start last); after
 * init a missing rank 0 is a failure, not a late start.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent_state.h"
#include "../core/cpus.h"
#include "../core/flight_impl.h"
#include "../core/trace_impl.h"
#include "tdist/trace.h"
#include "../core/netaddr.h"

static bool valid_name(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= sizeof(((td_worker_info *)0)->name)) return false;
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (!isalnum(ch) && ch != '_' && ch != '-' && ch != '.' && ch != ':') return false;
  }
  return true;
}

void td__agent_set_abort(td_rpc_agent *a, const char *why) {
  td__store_set(&a->sc, "abort", why, strlen(why));
}

/* Workers of one group often serve different functions (a parameter server and its trainers, C
 * and Python workers): that is normal, and a call to a function its callee lacks fails at once
 * naming both. So the differences are one DEBUG line: how many of this worker's functions each
 * other worker lacks, with the first few names. */
static void log_registry_differences(td_rpc_agent *a) {
  if (td_log_get_level() > TD_LOG_DEBUG || a->rank < 0) return; /* (a joiner: no rank yet) */
  peer_info *me = &a->peers[a->rank];
  char line[900];
  size_t used = 0;
  int peers = 0;
  line[0] = 0;
  for (int r = 0; r < a->world0; r++) {
    if (r == a->rank) continue;
    peer_info *p = &a->peers[r];
    int missing = 0;
    char names[200] = "";
    size_t nu = 0;
    for (int i = 0; i < me->nfns; i++) {
      if (td__agent_peer_has_fn(p, me->fns[i]) || strncmp(me->fns[i], "__", 2) == 0) continue;
      if (missing < 3 && nu < sizeof names)
        nu += (size_t)snprintf(names + nu, sizeof names - nu, "%s'%s'", missing ? ", " : "",
                               me->fns[i]);
      missing++;
    }
    if (!missing) continue;
    peers++;
    if (used < sizeof line)
      used += (size_t)snprintf(line + used, sizeof line - used, "%s%s lacks %d (%s%s)",
                               used ? "; " : "", p->info.name, missing, names,
                               missing > 3 ? ", ..." : "");
  }
  if (peers)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d of %d other workers lack functions registered here: %s",
           a->name, peers, a->world0 - 1, line);
}

td_status td__rdv_read_all(td_rpc_agent *a, const char *prefix, uint64_t deadline, char ***vals,
                          size_t **lens) {
  for (int k = 0; k < 4; k++) {
    if (a->rdv_pre[k].vals && strcmp(a->rdv_pre[k].prefix, prefix) == 0) {
      *vals = a->rdv_pre[k].vals;
      *lens = a->rdv_pre[k].lens;
      a->rdv_pre[k].vals = NULL;
      a->rdv_pre[k].lens = NULL;
      return TD_OK;
    }
  }
  *vals = td__calloc((size_t)a->world0, sizeof **vals);
  *lens = td__calloc((size_t)a->world0, sizeof **lens);
  td_status st = *vals && *lens ? td__store_wait_range(&a->sc, prefix, 0, a->world0, deadline,
                                                       "abort", (uint8_t **)*vals, *lens)
                                : td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  if (st != TD_OK) {
    td__free(*vals);
    td__free(*lens);
    *vals = NULL;
    *lens = NULL;
  }
  return st;
}

void td__rdv_free_all(td_rpc_agent *a, char **vals, size_t *lens) {
  for (int r = 0; vals && r < a->world0; r++) td__free(vals[r]);
  td__free(vals);
  td__free(lens);
}

/* Rank r's "name\taddress" record. */
static td_status peer_record(td_rpc_agent *a, int r, char *v) {
  char *tab = strchr(v, '\t');
  if (!tab) return td_set_error(TD_ERR_FORMAT, "rpc init: bad worker record for rank %d", r);
  *tab = 0;
  snprintf(a->peers[r].info.name, sizeof a->peers[r].info.name, "%s", v);
  snprintf(a->peers[r].info.address, sizeof a->peers[r].info.address, "%s", tab + 1);
  a->peers[r].info.id = r;
  return TD_OK;
}

/* Rank r's registry snapshot (one function name per line); the peer keeps the blob. */
static td_status peer_functions(td_rpc_agent *a, int r, char *v, size_t n) {
  a->peers[r].fns_blob = v;
  int cnt = 0;
  for (size_t i = 0; i < n; i++) cnt += v[i] == '\n';
  a->peers[r].fns = td__calloc((size_t)(cnt ? cnt : 1), sizeof(char *));
  if (!a->peers[r].fns) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  char *p = v;
  for (int i = 0; i < cnt; i++) {
    char *nl = strchr(p, '\n');
    *nl = 0;
    a->peers[r].fns[i] = p;
    p = nl + 1;
  }
  a->peers[r].nfns = cnt;
  return TD_OK;
}

/* A registry's name in the store: "regblob/" and a 128-bit hash of its text in hex. Workers of
 * a group mostly register the same functions: each publishes only this name under registry/<r>
 * (and the text under it), so reading every worker's registry costs 40 bytes per worker and one
 * get per distinct registry, not the text N times (at 1,024 workers of 1 KiB registries that was
 * 1 GiB through rank 0). Members are trusted, so the hash need only tell registries apart. */
static void registry_key(const char *snap, size_t n, char out[64]) {
  uint64_t h1 = 1469598103934665603ull, h2 = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < n; i++) {
    h1 = (h1 ^ (uint8_t)snap[i]) * 1099511628211ull;
    h2 = (h2 ^ (uint8_t)snap[i]) * 0x100000001b3ull;
    h2 ^= h2 >> 29;
  }
  snprintf(out, 64, "regblob/%016llx%016llx%zx", (unsigned long long)h1,
           (unsigned long long)h2, n);
}

/* The registry texts named by the registry/ records: each distinct one read once (a get), each
 * peer given its own copy (peer_functions parses it in place). */
static td_status peer_registries(td_rpc_agent *a, char **names) {
  for (int r = 0; r < a->world0; r++) {
    if (a->peers[r].fns_blob) continue;
    if (strncmp(names[r], "regblob/", 8) != 0)
      return td_set_error(TD_ERR_FORMAT, "rpc init: bad registry record for rank %d", r);
    uint8_t *v = NULL;
    size_t n = 0;
    bool found = false;
    TD_TRY(td__store_get(&a->sc, names[r], &v, &n, &found));
    if (!found) return td_set_error(TD_ERR_FORMAT, "rpc init: rank %d's registry is missing", r);
    for (int q = r; q < a->world0; q++) {
      if (a->peers[q].fns_blob || strcmp(names[q], names[r]) != 0) continue;
      char *copy = td__malloc(n + 1);
      if (!copy) {
        td__free(v);
        return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
      }
      memcpy(copy, v, n + 1);
      td_status st = peer_functions(a, q, copy, n);
      if (st != TD_OK) {
        td__free(v);
        return st;
      }
    }
    td__free(v);
  }
  return TD_OK;
}

/* Reads every worker's record and registry, a few requests in all (td__store_wait_range). */
static td_status parse_peers(td_rpc_agent *a, uint64_t deadline) {
  char **recs, **regs;
  size_t *rl, *gl;
  TD_TRY(td__rdv_read_all(a, "worker/", deadline, &recs, &rl));
  td_status st = td__rdv_read_all(a, "registry/", deadline, &regs, &gl);
  for (int r = 0; r < a->world0 && st == TD_OK; r++) st = peer_record(a, r, recs[r]);
  if (st == TD_OK) st = peer_registries(a, regs);
  td__rdv_free_all(a, recs, rl);
  td__rdv_free_all(a, regs, gl);
  TD_TRY(st);
  /* names index (td__agent_rank_of), which also finds a name used twice: O(N), not O(N^2);
   * sized for every place, so the workers that join later fit */
  size_t cap = 64;
  while (cap < (size_t)a->world * 2) cap *= 2;
  a->name_idx = td__calloc(cap, sizeof *a->name_idx);
  if (!a->name_idx) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  a->name_mask = cap - 1;
  for (int q = 0; q < a->world0; q++) TD_TRY(td__rdv_index_name(a, q));
  log_registry_differences(a);
  return TD_OK;
}

td_status td__rdv_index_name(td_rpc_agent *a, int q) {
  size_t i = td__agent_name_hash(a->peers[q].info.name) & a->name_mask;
  for (int e; (e = __atomic_load_n(&a->name_idx[i], __ATOMIC_ACQUIRE)) != 0;
       i = (i + 1) & a->name_mask) {
    if (strcmp(a->peers[e - 1].info.name, a->peers[q].info.name) == 0)
      return td_set_error(TD_ERR_EXISTS, "rpc init: ranks %d and %d both use the name '%s'",
                          e - 1, q, a->peers[q].info.name);
  }
  /* readers walk the index without a lock: the entry appears whole, after the peer's record */
  __atomic_store_n(&a->name_idx[i], q + 1, __ATOMIC_RELEASE);
  return TD_OK;
}

td_status td__rdv_install_peer(td_rpc_agent *a, int r, char *rec, char *fns, size_t nfns) {
  TD_TRY(peer_record(a, r, rec));
  return peer_functions(a, r, fns, nfns);
}

td_status td__rdv_registry_text(td_rpc_agent *a, const char *key, char **text, size_t *n) {
  if (strncmp(key, "regblob/", 8) != 0)
    return td_set_error(TD_ERR_FORMAT, "rpc: bad registry record '%.40s'", key);
  bool found = false;
  TD_TRY(td__store_get(&a->sc, key, (uint8_t **)text, n, &found));
  if (!found) return td_set_error(TD_ERR_FORMAT, "rpc: the registry '%.40s' is missing", key);
  return TD_OK;
}


/* ---- the rendezvous steps ---- */

/* The long waits of the rendezvous (for rank 0's store to come up, for every worker to join) run
 * in slices of TD__RDV_REPORT_MS; after each, an INFO line says what this worker still waits for,
 * so a job started with too large a WORLD_SIZE or without its rank 0 is not silent. */
#define TD__RDV_REPORT_MS 10000

/* TD_RPC_INIT_REPORT_MS overrides the interval (tests). */
static int64_t rdv_report_ms(void) {
  const char *e = getenv("TD_RPC_INIT_REPORT_MS");
  long long v = e && *e ? strtoll(e, NULL, 10) : 0;
  return v >= 50 ? v : TD__RDV_REPORT_MS;
}

typedef struct rdv_progress {
  int64_t joined;  /* last count read, -1 before any */
  char missing[300]; /* "2, 3" */
} rdv_progress;

/* Reads how many joined and which ranks have not published themselves yet. */
static void rdv_read_progress(td_rpc_agent *a, rdv_progress *p) {
  int64_t joined;
  if (td__store_add(&a->sc, "joined", 0, &joined) != TD_OK) return;
  p->joined = joined;
  size_t used = 0;
  int listed = 0;
  p->missing[0] = 0;
  for (int r = 0; r < a->world0 && listed <= 16; r++) {
    char key[64];
    bool found = true;
    snprintf(key, sizeof key, "worker/%d", r);
    if (td__store_get(&a->sc, key, NULL, NULL, &found) != TD_OK || found) continue;
    used += (size_t)snprintf(p->missing + used, sizeof p->missing - used, "%s%s",
                             listed ? ", " : "", listed == 16 ? "..." : "");
    if (listed < 16 && used < sizeof p->missing)
      used += (size_t)snprintf(p->missing + used, sizeof p->missing - used, "%d", r);
    if (used >= sizeof p->missing) used = sizeof p->missing - 1;
    listed++;
  }
}

static void rdv_report(td_rpc_agent *a, const char *key, uint64_t started, rdv_progress *p) {
  double waited = (double)(td__now_ns() - started) * 1e-9;
  if (strcmp(key, "world_size") == 0) {
    td_log(TD_LOG_INFO, "rpc init: %s (rank %d) has waited %.1f s for rank 0's rendezvous store "
           "at %s (is rank 0 started, with this MASTER_ADDR/MASTER_PORT?)", a->name, a->rank,
           waited, a->sc.address);
    return;
  }
  rdv_read_progress(a, p);
  td_log(TD_LOG_INFO, "rpc init: %s (rank %d) has waited %.1f s: %lld of %d workers joined at %s; "
         "still missing ranks %s", a->name, a->rank, waited, (long long)p->joined, a->world0,
         a->sc.address, p->missing[0] ? p->missing : "(none: finishing)");
}

/* Waits until key exists (target < 0; *v as for td__store_wait_key) or its counter reaches
 * target, by deadline, reporting every TD__RDV_REPORT_MS. */
/* td_rpc_init_interrupt's count: an init that sees it change gives up */
static uint64_t init_interrupts;

void td_rpc_init_interrupt(void) { __atomic_add_fetch(&init_interrupts, 1, __ATOMIC_RELEASE); }

static bool init_interrupted(const td_rpc_agent *a) {
  return __atomic_load_n(&init_interrupts, __ATOMIC_ACQUIRE) != a->init_gen;
}

/* Waits for the store key in slices of at most RDV_POLL_MS, or world ms in larger groups (so
 * td_rpc_init_interrupt is seen; each slice is one wait parked at the store), reporting progress
 * every rdv_report_ms. */
#define RDV_POLL_MS 250
#define RDV_SLICE_SLACK_MS 250
static td_status rdv_wait(td_rpc_agent *a, const char *key, int64_t target, uint64_t deadline,
                          rdv_progress *p, uint8_t **v) {
  uint64_t started = td__now_ns(), report = (uint64_t)rdv_report_ms() * 1000000ull;
  uint64_t next_report = started + report;
  int64_t backoff = 1; /* across the slices */
  for (;;) {
    if (init_interrupted(a))
      return td_set_error(TD_ERR_CANCELLED, "rpc init: interrupted (td_rpc_init_interrupt) "
                          "while waiting for the other workers");
    uint64_t now = td__now_ns();
    uint64_t poll = (uint64_t)(a->world > RDV_POLL_MS ? a->world : RDV_POLL_MS) * 1000000ull;
    uint64_t until = deadline > now + poll ? now + poll : deadline;
    /* the calls may outlast the slice by RDV_SLICE_SLACK_MS: a parked wait is answered at the
     * slice's end, later by the loaded server's tick (store.c, park_once) */
    uint64_t call_until = until + RDV_SLICE_SLACK_MS * 1000000ull;
    td__store_set_deadline(&a->sc, call_until < deadline ? call_until : deadline);
    td_status st = target < 0 ? td__store_poll_key(&a->sc, key, until, "abort", &backoff, v, NULL)
                              : td__store_poll_ge(&a->sc, key, target, until, "abort", &backoff);
    td__store_set_deadline(&a->sc, deadline);
    if (st != TD_ERR_TIMEOUT || td__now_ns() >= deadline) return st;
    if (td__now_ns() >= next_report) {
      rdv_report(a, key, started, p);
      next_report += report;
    }
  }
}

static td_status rdv_check_world(td_rpc_agent *a, uint64_t deadline) {
  uint8_t *ws = NULL;
  rdv_progress p = {-1, ""};
  td_status st = rdv_wait(a, "world_size", -1, deadline, &p, &ws);
  if (st == TD_ERR_TIMEOUT)
    return td__error_prefix(st, "rpc init: rank 0's rendezvous store at %s never answered "
                            "within %lld ms", a->sc.address, (long long)a->opts.init_timeout_ms);
  TD_TRY(st);
  long master_ws = strtol((char *)ws, NULL, 10);
  td__free(ws);
  /* a worker of another run reads two keys and leaves: it must not disturb that run; the run id
   * and the places (max_world_size: a store without the key is a group of fixed size) are read
   * in one request */
  uint8_t *rid = NULL, *mw = NULL;
  bool found = false, mw_found = false;
  TD_TRY(td__store_get2(&a->sc, "run_id", &rid, NULL, &found, "max_world_size", &mw, &mw_found));
  if (!found || strcmp((char *)rid, a->run_id) != 0) {
    td__free(mw);
    a->foreign = true;
    char mport[16] = "?";
    const char *colon = strrchr(a->sc.address, ':');
    if (colon) snprintf(mport, sizeof mport, "%s", colon + 1);
    td_status fs = td_set_error(TD_ERR_EXISTS, "rpc init: the rendezvous store at %s belongs to "
                                "another run (its run id '%s', ours '%s'): two jobs share "
                                "MASTER_PORT %s; give each job its own port (--master-port, or "
                                "tdistrun --standalone)", a->sc.address,
                                found ? (char *)rid : "?", a->run_id, mport);
    td__free(rid);
    return fs;
  }
  td__free(rid);
  long master_max = mw_found ? strtol((char *)mw, NULL, 10) : master_ws;
  td__free(mw);
  if (a->joiner && master_max > master_ws && master_ws > 0 && master_max <= (1 << 24) &&
      (master_ws != a->world0 || master_max != a->world)) {
    /* a joiner takes the group's sizes (a joining node may run fewer workers than the others,
     * so its launcher's WORLD_SIZE is not the group's): nothing uses them yet */
    td_log(TD_LOG_DEBUG, "rpc: joining a group of %ld started workers and %ld places (given %d "
           "and %d)", master_ws, master_max, a->world0, a->world);
    peer_info *peers = td__calloc((size_t)master_max, sizeof *peers);
    uint8_t *present = td__calloc((size_t)master_max, sizeof *present);
    if (!peers || !present || td__transport_set_world(a->tr, (int)master_max) != TD_OK) {
      td__free(peers);
      td__free(present);
      return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
    }
    td__free(a->peers);
    td__free(a->present);
    a->peers = peers;
    a->present = present;
    a->world0 = (int)master_ws;
    a->world = (int)master_max;
  }
  if (a->joiner && master_max <= master_ws)
    return td_set_error(TD_ERR_INVALID, "rpc init: cannot join the group at %s: it has no free "
                        "places (its max world size is its world size, %ld)", a->sc.address,
                        master_ws);
  if (master_ws == a->world0 && master_max == a->world) return TD_OK;
  char why[300];
  if (master_ws != a->world0)
    snprintf(why, sizeof why, "rpc init: %s was started with world size %d but rank 0 with %ld",
             a->joiner ? "a worker joining the group" : "this rank", a->world0, master_ws);
  else
    snprintf(why, sizeof why, "rpc init: %s was started with max world size %d but rank 0 with "
             "%ld", a->joiner ? "a worker joining the group" : "this rank", a->world, master_max);
  if (a->joiner) /* the group runs: a stranger's mistake must not abort it */
    return td_set_error(TD_ERR_INVALID, "%s", why);
  td__agent_set_abort(a, why);
  return td_set_error(TD_ERR_INVALID, "%s", why);
}

static td_status rdv_claim(td_rpc_agent *a) {
  char key[64];
  int64_t claims;
  snprintf(key, sizeof key, "claim/%d", a->rank);
  TD_TRY(td__store_add(&a->sc, key, 1, &claims));
  if (claims == 1) return TD_OK;
  char why[100];
  snprintf(why, sizeof why, "rpc init: two workers claim rank %d", a->rank);
  td__agent_set_abort(a, why);
  return td_set_error(TD_ERR_EXISTS, "%s", why);
}

/* Publishes this worker's records - worker/<r> (name and address), its registry's text under
 * its hash and registry/<r> naming it, and (not for joiners) direct/<r> (same-host record) and
 * devmap/<r> (device maps) - and then, when count_key is not NULL, adds 1 to that counter: one
 * request (td__store_publish), where it was one per record and one for the count (rank 0 answers
 * every worker's requests: at 256 workers each one of them took ~0.1 s). */
static td_status rdv_publish(td_rpc_agent *a, const char *count_key) {
  char wkey[64], wval[512], rkey[64], name[64], dkey[64], dval[512], mkey[64];
  snprintf(wkey, sizeof wkey, "worker/%d", a->rank);
  int wn = snprintf(wval, sizeof wval, "%s\t%s", a->name, a->peers[a->rank].info.address);
  char *snap = td__reg_snapshot();
  if (!snap) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  registry_key(snap, strlen(snap), name);
  snprintf(rkey, sizeof rkey, "registry/%d", a->rank);
  char *keys[5] = {wkey, name, rkey, dkey, mkey};
  const void *vals[5] = {wval, snap, name, dval, NULL};
  size_t lens[5] = {(size_t)wn, strlen(snap), strlen(name), 0, 0};
  size_t n = 3;
  char *mval = NULL;
  td_status st = TD_OK;
  if (!a->joiner) { /* (joiners: no direct copy nor device maps, gRPC streams only) */
    td__direct_record(a, dkey, dval);
    lens[3] = strlen(dval);
    st = td__devmap_record(a, mkey, &mval, &lens[4]);
    vals[4] = mval;
    n = 5;
  }
  if (st == TD_OK) st = td__store_publish(&a->sc, n, keys, vals, lens, count_key, 1, NULL);
  td__free(snap);
  td__free(mval);
  return st;
}

/* Waits for every worker to have published and counted itself in "joined" (rdv_publish). */
static td_status rdv_join(td_rpc_agent *a, uint64_t deadline) {
  rdv_progress p = {-1, ""};
  td_status st = rdv_wait(a, "joined", a->world0, deadline, &p, NULL);
  if (st != TD_ERR_TIMEOUT) return st;
  char why[600];
  snprintf(why, sizeof why, "%s", td_last_error());
  /* a count read now is the truth; when the store is gone, say so and what was last seen */
  td__store_set_deadline(&a->sc, td__now_ns() + 100000000ull);
  int64_t before = p.joined;
  rdv_read_progress(a, &p);
  if (p.joined >= 0 && p.joined != before)
    return td_set_error(TD_ERR_TIMEOUT, "rpc init: only %lld of %d workers joined within %lld ms "
                        "(missing ranks %s)", (long long)p.joined, a->world0,
                        (long long)a->opts.init_timeout_ms, p.missing);
  if (before >= 0)
    return td_set_error(TD_ERR_TIMEOUT, "rpc init: the group did not form within %lld ms: %s "
                        "(last seen: %lld of %d workers joined, missing ranks %s)",
                        (long long)a->opts.init_timeout_ms, why, (long long)before, a->world0,
                        p.missing);
  return td_set_error(TD_ERR_TIMEOUT, "rpc init: the group did not form within %lld ms: %s",
                      (long long)a->opts.init_timeout_ms, why);
}

/* The records the read phase needs, of every worker, in one request (td__store_ranges: all are
 * there, published before the join barrier): kept for td__rdv_read_all, which reads a prefix
 * the reply did not bring whole as before. A failure here only loses the shortcut. */
static void rdv_prefetch(td_rpc_agent *a) {
  static const char *const pre[4] = {"worker/", "registry/", "devmap/", "direct/"};
  uint8_t **vals[4] = {0};
  size_t *lens[4] = {0};
  int got[4] = {0};
  bool ok = true;
  for (int k = 0; k < 4; k++) {
    vals[k] = td__calloc((size_t)a->world0, sizeof *vals[k]);
    lens[k] = td__calloc((size_t)a->world0, sizeof *lens[k]);
    ok &= vals[k] && lens[k];
  }
  if (ok && td__store_ranges(&a->sc, 4, pre, 0, a->world0, vals, lens, got) != TD_OK) ok = false;
  for (int k = 0; k < 4; k++) {
    if (ok && got[k] == a->world0) {
      a->rdv_pre[k].prefix = pre[k];
      a->rdv_pre[k].vals = (char **)vals[k];
      a->rdv_pre[k].lens = lens[k];
    } else {
      td__rdv_free_all(a, (char **)vals[k], lens[k]);
    }
  }
}

/* Frees what the read phase did not take. */
static void rdv_prefetch_drop(td_rpc_agent *a) {
  for (int k = 0; k < 4; k++) {
    td__rdv_free_all(a, a->rdv_pre[k].vals, a->rdv_pre[k].lens);
    a->rdv_pre[k].vals = NULL;
    a->rdv_pre[k].lens = NULL;
  }
}

static td_status rdv_read_phase(td_rpc_agent *a, uint64_t deadline) {
  uint64_t t0 = td__now_ns();
  rdv_prefetch(a);
  td_status st = parse_peers(a, deadline);
  uint64_t t1 = td__now_ns();
  if (st != TD_OK) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    if (st == TD_ERR_EXISTS) td__agent_set_abort(a, msg);
    return td_set_error(st, "%s", msg);
  }
  TD_TRY(td__devmap_setup(a, deadline));
  uint64_t t2 = td__now_ns();
  st = td__direct_probe(a, deadline);
  td_log(TD_LOG_DEBUG, "rpc: %s: read phase (ms): records %.1f, device maps %.1f, same-host "
         "probe %.1f", a->name, (double)(t1 - t0) / 1e6, (double)(t2 - t1) / 1e6,
         (double)(td__now_ns() - t2) / 1e6);
  return st;
}

static td_status rdv_read(td_rpc_agent *a, uint64_t deadline) {
  td_status st = rdv_read_phase(a, deadline);
  rdv_prefetch_drop(a);
  return st;
}

/* Publishes directok/<r> (td__direct_probe) with the count in "ready", one request; waits for
 * everyone's; learns who reads us directly. */
static td_status rdv_ready(td_rpc_agent *a, uint64_t deadline) {
  char key[64];
  snprintf(key, sizeof key, "directok/%d", a->rank);
  char *keys[1] = {key};
  const void *vals[1] = {a->direct_ok ? a->direct_ok : ""};
  size_t lens[1] = {strlen(vals[0])};
  TD_TRY(td__store_publish(&a->sc, 1, keys, vals, lens, "ready", 1, NULL));
  TD_TRY(td__store_wait_ge(&a->sc, "ready", a->world0, deadline, "abort"));
  return td__direct_learn(a, deadline);
}

/* Every worker counts itself "passed" once it needs the store no more for its init. Rank 0 does
 * not wait for the count here but before it takes the store away (td__rdv_passed_wait, at its
 * shutdown): waiting here held every call to rank 0 (requests that arrive during init wait for
 * it) until the slowest worker's add got through, while the workers already past init loaded the
 * host (256 workers on 2 CPUs: 5.8 s). Rank 0 may shut down while the reply to the last add is on
 * its way, so another rank that loses its reply goes on: past "ready" the group is complete and
 * every worker has read everything. */
static td_status rdv_passed(td_rpc_agent *a) {
  td_status st = td__store_add(&a->sc, "passed", 1, NULL);
  if (a->rank != 0 && (st == TD_ERR_UNAVAILABLE || st == TD_ERR_CANCELLED)) {
    td_log(TD_LOG_DEBUG, "rpc: %s: the reply to 'passed' was lost (%s); rank 0 may have left "
           "already, the group is complete", a->name, td_last_error());
    st = TD_OK;
  }
  return st;
}

static void *passed_main(void *arg) {
  td_rpc_agent *a = arg;
  if (rdv_passed(a) != TD_OK)
    td_log(TD_LOG_DEBUG, "rpc: %s: 'passed' not counted: %s", a->name, td_last_error());
  pthread_mutex_lock(&a->passed_mu);
  a->passed_done = true;
  pthread_cond_broadcast(&a->passed_cv);
  pthread_mutex_unlock(&a->passed_mu);
  return NULL;
}

/* Ranks > 0 count themselves "passed" on a thread of their own: init returns without waiting for
 * rank 0 to answer (behind the whole group's requests, that took seconds at 256 workers). After
 * init_finish, which settles the store client the thread uses. A joiner does not count. */
static td_status rdv_passed_start(td_rpc_agent *a) {
  if (a->joiner) return TD_OK;
  /* (detached: a worker that exits without shutting its agent down leaves no thread behind to
   * join; td__rdv_passed_join waits for its end instead) */
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  a->passed_async = a->rank != 0 && pthread_create(&th, &at, passed_main, a) == 0;
  pthread_attr_destroy(&at);
  if (a->passed_async) return TD_OK;
  passed_main(a); /* (rank 0: its own store, at once) */
  return TD_OK;
}

void td__rdv_passed_join(td_rpc_agent *a) {
  if (!a->passed_async) return;
  pthread_mutex_lock(&a->passed_mu);
  while (!a->passed_done) pthread_cond_wait(&a->passed_cv, &a->passed_mu);
  pthread_mutex_unlock(&a->passed_mu);
  a->passed_async = false;
}

void td__rdv_passed_wait(td_rpc_agent *a, uint64_t hard) {
  if (a->rank != 0 || a->joiner || !a->store) return;
  uint64_t dl = td__now_ns() + (uint64_t)td__rdv_exit_wait_ms(a) * 1000000ull;
  if (hard < dl) dl = hard;
  if (td__store_wait_ge(&a->sc, "passed", a->world0, dl, NULL) != TD_OK)
    td_log(TD_LOG_DEBUG, "rpc: %s: shutdown: not every worker finished its init with the store: "
           "%s", a->name, td_last_error());
}

static void init_trace(td_rpc_agent *a);

/* ---- Joining a running group (td_rpc_options.max_world_size, rank TD_RPC_RANK_JOIN) ----
 * The places [world0, world) are taken in order: "late/next" counts them, so a joiner's rank is
 * world0 + its count - 1, and no place is given twice (a place whose worker died stays taken:
 * its rank is not reused by a stranger who could be mistaken for it). A joiner waits for the
 * group to have formed ("ready" of the starting workers), takes its place, publishes its record
 * and registry as the others did at the start (no direct-copy probe or device maps: those are
 * checked pairwise by the whole group at its start), reads the starting workers' records, and
 * announces itself ("late/in/<r>"). The others learn it lazily (elastic.c): a call by its name or
 * rank, or its first request, reads its record from the store. Names are unique: "late/name/<n>"
 * is claimed, and a starting worker's name is refused. */
/* Claims name for a joiner ("late/name/<name>"); a starting worker's name is refused. */
static td_status join_claim_name(td_rpc_agent *a) {
  int r = td__agent_rank_of(a, a->name);
  if (r >= 0)
    return td_set_error(TD_ERR_EXISTS, "rpc init: joining: rank %d of the group is already "
                        "called '%s'", r, a->name);
  char key[200];
  snprintf(key, sizeof key, "late/name/%s", a->name);
  int64_t uses = 0;
  TD_TRY(td__store_add(&a->sc, key, 1, &uses));
  if (uses != 1)
    return td_set_error(TD_ERR_EXISTS, "rpc init: joining: another worker joined the group as "
                        "'%s'", a->name);
  return TD_OK;
}

static td_status join_running(td_rpc_agent *a, uint64_t deadline) {
  rdv_progress p = {-1, ""};
  TD_TRY(rdv_check_world(a, deadline));
  td_status st = rdv_wait(a, "ready", a->world0, deadline, &p, NULL);
  if (st == TD_ERR_TIMEOUT)
    return td__error_prefix(st, "rpc init: joining: the group at %s did not form within %lld ms",
                            a->sc.address, (long long)a->opts.init_timeout_ms);
  TD_TRY(st);
  TD_TRY(parse_peers(a, deadline)); /* the starting workers */
  /* a name given is checked before a place is taken (a place is never given back) */
  bool named = a->name[0] != 0;
  if (named) TD_TRY(join_claim_name(a));
  int64_t k = 0;
  TD_TRY(td__store_add(&a->sc, "late/next", 1, &k));
  if (k < 1 || k > a->world - a->world0)
    return td_set_error(TD_ERR_STATE, "rpc init: the group at %s is full: its %d places (max "
                        "world size) are taken", a->sc.address, a->world);
  a->rank = a->world0 + (int)k - 1;
  td__transport_set_self_rank(a->tr, a->rank);
  snprintf(a->peers[a->rank].info.address, sizeof a->peers[a->rank].info.address, "%s",
           a->join_addr);
  if (!named) {
    snprintf(a->name, sizeof a->name, "worker%d", a->rank);
    TD_TRY(join_claim_name(a));
  }
  TD_TRY(rdv_claim(a));
  TD_TRY(rdv_publish(a, NULL));
  snprintf(a->peers[a->rank].info.name, sizeof a->peers[a->rank].info.name, "%s", a->name);
  a->peers[a->rank].info.id = a->rank;
  char *snap = td__reg_snapshot(); /* (calls to self check it as any other worker's) */
  if (!snap) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  TD_TRY(peer_functions(a, a->rank, snap, strlen(snap)));
  __atomic_store_n(&a->present[a->rank], TD__PEER_PRESENT, __ATOMIC_RELEASE);
  TD_TRY(td__rdv_index_name(a, a->rank));
  init_trace(a);
  char key[64];
  snprintf(key, sizeof key, "late/in/%d", a->rank);
  TD_TRY(td__store_set(&a->sc, key, "1", 1));
  td_log(TD_LOG_INFO, "rpc: %s joined the running group at %s as rank %d (place %lld of the %d "
         "free at its start)", a->name, a->sc.address, a->rank, (long long)k,
         a->world - a->world0);
  return TD_OK;
}

static td_status rendezvous(td_rpc_agent *a) {
  uint64_t deadline = td__deadline_ns(a->opts.init_timeout_ms);
  td__store_set_deadline(&a->sc, deadline); /* no store call outlives the init deadline */
  if (a->joiner) return join_running(a, deadline);
  uint64_t t[5];
  t[0] = td__now_ns();
  TD_TRY(rdv_check_world(a, deadline));
  TD_TRY(rdv_claim(a));
  TD_TRY(rdv_publish(a, "joined"));
  t[1] = td__now_ns();
  TD_TRY(rdv_join(a, deadline));
  t[2] = td__now_ns();
  TD_TRY(rdv_read(a, deadline));
  /* the trace and flight recorder clocks are exchanged with rank 0's store here, while it is
   * sure to be up and not yet busy: after init, in a large group, every worker's exchange
   * queued behind rank 0's share of the group's first calls (128 workers on 2 CPUs: the last
   * worker's init returned 6 s after the first) */
  init_trace(a);
  t[3] = td__now_ns();
  TD_TRY(rdv_ready(a, deadline));
  t[4] = td__now_ns();
  /* ("passed" follows init_finish: td__rdv_passed_start) */
  /* where a large group's start-up goes (docs/ARCHITECTURE.md, "Start-up of large groups") */
  td_log(TD_LOG_DEBUG, "rpc: %s: rendezvous phases (ms): publish %.1f, join %.1f, read %.1f, "
         "ready %.1f", a->name, (double)(t[1] - t[0]) / 1e6, (double)(t[2] - t[1]) / 1e6,
         (double)(t[3] - t[2]) / 1e6, (double)(t[4] - t[3]) / 1e6);
  return TD_OK;
}

/* Workers per CPU on this host, times 100 (td__transport_opts.host_load_x100). */
static int host_load(int local) {
  long cpus = td__cpus_usable();
  return (int)((int64_t)local * 100 / (cpus > 0 ? cpus : 1));
}

/* busy_poll_window resolves td_rpc_options.busy_poll_us once every worker's address is known:
 * spinning pays off only when every local worker can have a CPU of its own. */
static int64_t busy_poll_window(td_rpc_agent *a, int64_t opt) {
  if (opt >= 0) return opt;
  const char *env = getenv("TD_RPC_BUSY_POLL_US");
  if (env && *env) {
    char *end;
    long long v = strtoll(env, &end, 10);
    if (*end == 0 && v >= 0) return v;
    td_log(TD_LOG_WARN, "rpc: ignoring TD_RPC_BUSY_POLL_US='%s' (not a number of microseconds)",
           env);
  }
  char mine[256], other[256];
  td__addr_host(a->peers[a->rank].info.address, mine, sizeof mine);
  int local = 0;
  for (int i = 0; i < a->world; i++) {
    td__addr_host(a->peers[i].info.address, other, sizeof other);
    if (strcmp(mine, other) == 0) local++;
  }
  long cpus = td__cpus_usable();
  a->local_workers = local;
  td__transport_set_host_load(a->tr, host_load(local));
  int64_t us = cpus > 1 && local <= cpus ? 50 : 0;
  td_log(TD_LOG_DEBUG, "rpc: %s: %d workers on this host, %ld CPUs: busy-poll %lld us", a->name,
         local, cpus, (long long)us);
  return us;
}

void td__agent_free(td_rpc_agent *a) {
  if (!a) return;
  td__rdv_passed_join(a);
  if (a->peers) {
    for (int r = 0; r < a->world; r++) {
      td__conn_unref(a->peers[r].conn);
      td__free(a->peers[r].fns);
      td__free(a->peers[r].fns_blob);
    }
  }
  td__devmap_free_all(a);
  td__free(a->name_idx);
  td__free(a->peers);
  td__free(a->present);
  td__free(a->direct_cand);
  td__free(a->direct_ok);
  td__call_free_all(a);
  td__store_destroy(a->store);
  td__auth_sessions_destroy(a->sessions);
  td__hostq_destroy(a->hostq);
  td__auth_client_fini(&a->store_auth);
  memset(&a->auth, 0, sizeof a->auth);
  td__free(a->listen_addr);
  td__free(a->init_method);
  pthread_mutex_destroy(&a->mu);
  pthread_mutex_destroy(&a->passed_mu);
  pthread_cond_destroy(&a->passed_cv);
  pthread_mutex_destroy(&a->run_mu);
  td__free(a);
}


/* ---- init phases ---- */

static td_status parse_master(const char *init_method, char *host, size_t hn, int *port) {
  const char *s = init_method;
  if (strncmp(s, "tcp://", 6) != 0)
    return td_set_error(TD_ERR_INVALID, "rpc init: init_method '%s' must look like tcp://host:port",
                        init_method);
  s += 6;
  const char *colon = strrchr(s, ':');
  if (!colon || colon == s)
    return td_set_error(TD_ERR_INVALID, "rpc init: init_method '%s' has no port", init_method);
  char *end;
  long p = strtol(colon + 1, &end, 10);
  /* port 0 lets a single-worker group (world size 1) pick any free port */
  if (*end || p < 0 || p > 65535)
    return td_set_error(TD_ERR_INVALID, "rpc init: bad port in init_method '%s'", init_method);
  size_t l = (size_t)(colon - s);
  if (s[0] == '[' && l >= 2 && s[l - 1] == ']') {
    s++;
    l -= 2;
  }
  if (l >= hn) return td_set_error(TD_ERR_INVALID, "rpc init: host name too long");
  memcpy(host, s, l);
  host[l] = 0;
  *port = (int)p;
  return TD_OK;
}

static const char *env2(const char *a, const char *b, const char *c) {
  const char *v = getenv(a);
  if (v && *v) return v;
  v = b ? getenv(b) : NULL;
  if (v && *v) return v;
  v = c ? getenv(c) : NULL;
  return v && *v ? v : NULL;
}

/* The "tcp://host:port" of rank 0's store from the environment (what init_method "env://" or
 * NULL means): MASTER_ADDR, else the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST;
 * MASTER_PORT, else a port per Slurm job or per Open MPI job. With defaults (td_rpc_init_from_env)
 * a missing address is loopback and a missing port 29500; without (td_rpc_init, PyTorch's env://)
 * they are an error that says what to set. */
static td_status master_from_env(bool defaults, char *method, size_t n) {
  char host[300];
  const char *ma = getenv("MASTER_ADDR");
  if (!ma || !*ma) {
    const char *nl = getenv("SLURM_STEP_NODELIST");
    if (!nl || !*nl) nl = getenv("SLURM_JOB_NODELIST");
    ma = defaults ? "127.0.0.1" : NULL;
    if (nl && *nl) { /* a malformed list is an error, not a silent loopback */
      TD_TRY(td__slurm_first_host(nl, host, sizeof host));
      ma = host;
    }
  }
  const char *mp = getenv("MASTER_PORT");
  long port = mp && *mp ? strtol(mp, NULL, 10) : defaults ? 29500 : -1;
  const char *job = getenv("SLURM_JOB_ID");
  const char *ompi = getenv("PMIX_NAMESPACE");
  if (!ompi || !*ompi) ompi = getenv("OMPI_MCA_ess_base_jobid");
  if (!(mp && *mp) && job && *job) { /* under Slurm: a port per job (core/netaddr.h) */
    int jp;
    TD_TRY(td__slurm_port(job, &jp));
    port = jp;
  } else if (!(mp && *mp) && ompi && *ompi && getenv("OMPI_COMM_WORLD_RANK")) {
    port = td__job_port(ompi); /* under mpirun: a port per job too */
  }
  if (!ma || port == -1)
    return td_set_error(TD_ERR_INVALID, "rpc_init: no init_method given (or \"env://\") and "
                        "%s%s%s not set: set MASTER_ADDR and MASTER_PORT (rank 0's host and a "
                        "free port, as torchrun and tdistrun do), or give init_method "
                        "\"tcp://host:port\"", ma ? "" : "MASTER_ADDR",
                        !ma && port == -1 ? " and " : "", port == -1 ? "MASTER_PORT" : "");
  if (port <= 0 || port > 65535)
    return td_set_error(TD_ERR_INVALID, "rpc_init: bad MASTER_PORT '%s'", mp ? mp : "");
  snprintf(method, n, strchr(ma, ':') ? "tcp://[%s]:%ld" : "tcp://%s:%ld", ma, port);
  return TD_OK;
}

/* Where rank 0 and this worker are: parsed from init_method, the listen address chosen. */
typedef struct init_addr {
  char method[400]; /* init_method read from the environment */
  char mhost[256];
  int mport;
  char chosen[128];
} init_addr;

/* Refuses options not filled by td_rpc_options_init: their zeroes would be a 0 ms rpc timeout
 * (every call expiring at once), no message size limit, no busy polling, no direct copy. */
static td_status options_check(const td_rpc_options *opts, const char *who) {
  if (opts && opts->magic != TD_RPC_OPTIONS_MAGIC)
    return td_set_error(TD_ERR_INVALID, "%s: td_rpc_options not initialised: use "
                        "td_rpc_options_init(), then set its fields (a zeroed struct would mean "
                        "a 0 ms rpc timeout: every call expiring at once)", who);
  return TD_OK;
}

/* Phase 1: check the arguments, apply defaults, pick the listen address. */
static td_status init_options(const char **name, char *defname, size_t dn, int rank,
                              int world_size, const td_rpc_options *opts, td_rpc_options *o,
                              init_addr *ad) {
  if (world_size < 1) return td_set_error(TD_ERR_INVALID, "rpc_init: world size %d < 1", world_size);
  TD_TRY(options_check(opts, "rpc_init"));
  if (opts) *o = *opts;
  else td_rpc_options_init(o);
  const char *mws = getenv("TD_RPC_MAX_WORLD_SIZE");
  if (o->max_world_size == 0 && mws && *mws) {
    char *end;
    long v = strtol(mws, &end, 10);
    if (*end || v < 1 || v > (1 << 24))
      return td_set_error(TD_ERR_INVALID, "rpc_init: TD_RPC_MAX_WORLD_SIZE='%s' is not a number "
                          "of workers", mws);
    o->max_world_size = (int)v;
  }
  if (o->max_world_size == 0) o->max_world_size = world_size;
  if (o->max_world_size < world_size || o->max_world_size > (1 << 24))
    return td_set_error(TD_ERR_INVALID, "rpc_init: max world size %d outside [%d, %d]",
                        o->max_world_size, world_size, 1 << 24);
  if (rank == TD_RPC_RANK_JOIN && o->max_world_size == world_size)
    return td_set_error(TD_ERR_INVALID, "rpc_init: rank TD_RPC_RANK_JOIN (-1) joins an elastic "
                        "group: its max world size (td_rpc_options.max_world_size, "
                        "TD_RPC_MAX_WORLD_SIZE) must exceed the world size %d", world_size);
  if (rank == TD_RPC_RANK_JOIN && o->num_device_maps > 0)
    return td_set_error(TD_ERR_INVALID, "rpc_init: a worker joining a running group cannot use "
                        "device maps (they are checked by the whole group at its start)");
  if (rank != TD_RPC_RANK_JOIN && (rank < 0 || rank >= world_size))
    return td_set_error(TD_ERR_INVALID, "rpc_init: rank %d outside [0, %d)", rank, world_size);
  if (o->num_device_maps < 0 || (o->num_device_maps > 0 && !o->device_maps))
    return td_set_error(TD_ERR_INVALID, "rpc_init: %d device map entries at %p",
                        o->num_device_maps, (const void *)o->device_maps);
  if (o->num_worker_threads <= 0) o->num_worker_threads = 16;
  if (!td__timeout_valid(o->rpc_timeout_ms) || !td__timeout_valid(o->init_timeout_ms) ||
      (o->keepalive_timeout_ms <= 0 && o->keepalive_timeout_ms != TD_TIMEOUT_DEFAULT))
    return td_set_error(TD_ERR_INVALID, "rpc_init: invalid timeout (rpc %lld, init %lld, "
                        "keepalive %lld ms; see tdist/timeout.h)", (long long)o->rpc_timeout_ms,
                        (long long)o->init_timeout_ms, (long long)o->keepalive_timeout_ms);
  o->rpc_timeout_ms = td__timeout_resolve(o->rpc_timeout_ms, TD__RPC_DEFAULT_TIMEOUT_MS);
  o->init_timeout_ms = td__timeout_resolve(o->init_timeout_ms, TD__RPC_DEFAULT_INIT_TIMEOUT_MS);
  o->keepalive_timeout_ms = td__timeout_resolve(o->keepalive_timeout_ms, 20000);
  /* every stream pings every keepalive_ms: with a stream to each of N-1 peers that is N^2 pings
   * for the group, so past 64 peers the interval grows to keep each worker at ~32 pings/s (256
   * workers on one 2-CPU host spent the machine on pings and declared live peers dead) */
  /* (left at 0 here: init_transport chooses it, and knows then that tdist chose it) */
  if (!*name) {
    /* (a joiner's default name waits for its rank: join_running) */
    if (rank == TD_RPC_RANK_JOIN) defname[0] = 0;
    else snprintf(defname, dn, "worker%d", rank);
    *name = defname;
  }
  if ((**name || rank != TD_RPC_RANK_JOIN) && !valid_name(*name))
    return td_set_error(TD_ERR_INVALID, "rpc_init: invalid worker name '%s' (use 1-127 letters, "
                        "digits, '_', '-', '.', ':')", *name);
  if (!o->init_method || strcmp(o->init_method, "env://") == 0) {
    TD_TRY(master_from_env(false, ad->method, sizeof ad->method));
    o->init_method = ad->method;
  }
  TD_TRY(parse_master(o->init_method, ad->mhost, sizeof ad->mhost, &ad->mport));
  if (!o->listen_addr) { /* TD_SOCKET_IFNAME, else the route toward the master, else loopback */
    TD_TRY(td__choose_address(ad->mhost, getenv("TD_SOCKET_IFNAME"), ad->chosen,
                              sizeof ad->chosen));
    o->listen_addr = ad->chosen;
  }
  if (ad->mport == 0 && world_size > 1)
    return td_set_error(TD_ERR_INVALID, "rpc_init: port 0 in init_method works only for a world "
                        "of one worker (the others could not find rank 0)");
  return TD_OK;
}

/* no_secret_error says how to give the workers a secret, in the words of the launcher that
 * started this one: under srun and mpirun the user must make it (no launcher process exists that
 * could, and nothing public about a job, such as its id, may be the key), so the message gives
 * the line to paste. */
static td_status no_secret_error(void) {
  static const char make[] = "export TD_RPC_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | "
                             "tr -d ' \\n')";
  const char *slurm = getenv("SLURM_JOB_ID"), *ompi = getenv("OMPI_COMM_WORLD_RANK");
  if (slurm && *slurm)
    return td_set_error(TD_ERR_AUTH, "rpc_init: no job secret: under srun, run `%s` before srun "
                        "(srun passes it to every task; sbatch scripts: see "
                        "examples/slurm/param_server.sbatch), or set TD_RPC_SECRET_FILE to a "
                        "file of mode 0600 every node sees", make);
  if (ompi && *ompi)
    return td_set_error(TD_ERR_AUTH, "rpc_init: no job secret: under mpirun, run `%s` and pass "
                        "it on with `mpirun -x TD_RPC_SECRET ...`, or set TD_RPC_SECRET_FILE to a "
                        "file of mode 0600 every node sees", make);
  return td_set_error(TD_ERR_AUTH, "rpc_init: no job secret: start the workers with tdistrun "
                      "(it gives them one), or give every worker the same secret: `%s` in the "
                      "shell that starts them (or TD_RPC_SECRET_FILE, a file only you can read), "
                      "or set TD_RPC_INSECURE=1 to run without authentication", make);
}

/* The job secret: the option, TD_RPC_SECRET, TD_RPC_SECRET_FILE, a random one for a world of
 * one; else insecure mode when explicitly allowed; else an error saying how to give one. */
static td_status init_auth(td_rpc_agent *a, const td_rpc_options *o) {
  const char *env = getenv("TD_RPC_SECRET"), *file = getenv("TD_RPC_SECRET_FILE");
  const char *ins = getenv("TD_RPC_INSECURE");
  char *owned = NULL;
  const char *secret = o->secret;
  if (!secret && env && *env) secret = env;
  if (!secret && file && *file) {
    TD_TRY(td__auth_secret_from_file(file, &owned));
    secret = owned;
  }
  char random[65];
  if (!secret && a->world == 1) { /* nobody else needs to know it */
    uint8_t b[32];
    TD_TRY(td__auth_random(b, sizeof b));
    for (int i = 0; i < 32; i++) snprintf(random + 2 * i, 3, "%02x", b[i]);
    secret = random;
  }
  td_status st = TD_OK;
  if (secret) {
    st = td__auth_init(&a->auth, secret, strlen(secret));
  } else if (o->insecure || (ins && strcmp(ins, "1") == 0)) {
    td__auth_init(&a->auth, NULL, 0);
    td_log(TD_LOG_WARN, "rpc: %s runs WITHOUT authentication (TD_RPC_INSECURE): anyone who can "
           "reach its port can join the group, call its functions and read the store", a->name);
  } else {
    st = no_secret_error();
  }
  if (owned) {
    memset(owned, 0, strlen(owned));
    td__free(owned);
  }
  memset(random, 0, sizeof random);
  if (st != TD_OK) return st;
  td__auth_client_init(&a->store_auth, &a->auth);
  a->sc.auth = &a->store_auth;
  if (a->rank == 0) TD_TRY(td__auth_sessions_create(&a->auth, a->world, &a->sessions));
  return TD_OK;
}

/* The run id (td_rpc_options.run_id): the option, TD_RUN_ID, the Slurm step, the Open MPI job. */
static td_status resolve_run_id(const td_rpc_options *o, char *out, size_t n) {
  const char *id = o->run_id, *e;
  char buf[200] = "";
  if (!id && (e = getenv("TD_RUN_ID")) && *e) id = e;
  if (!id && (e = getenv("SLURM_JOB_ID")) && *e) {
    const char *step = getenv("SLURM_STEP_ID");
    snprintf(buf, sizeof buf, "slurm:%s.%s", e, step && *step ? step : "batch");
    id = buf;
  }
  if (!id && (((e = getenv("PMIX_NAMESPACE")) && *e) ||
              ((e = getenv("OMPI_MCA_ess_base_jobid")) && *e))) {
    snprintf(buf, sizeof buf, "ompi:%s", e);
    id = buf;
  }
  if (!id) id = "";
  if (strlen(id) >= n)
    return td_set_error(TD_ERR_INVALID, "rpc_init: run id '%.40s...' is longer than %zu bytes",
                        id, n - 1);
  snprintf(out, n, "%s", id);
  return TD_OK;
}

/* Phase 2: the agent object, rank 0's store (seeded before anybody can reach it), the pool. */
static td_status init_agent(const char *name, int rank, int world_size, td_rpc_options *o,
                            td_rpc_agent **out) {
  td_rpc_agent *a = td__calloc(1, sizeof *a);
  if (!a) return td_set_error(TD_ERR_NOMEM, "rpc_init: out of memory");
  a->init_gen = __atomic_load_n(&init_interrupts, __ATOMIC_ACQUIRE);
  *out = a;
  pthread_mutex_init(&a->mu, NULL);
  pthread_mutex_init(&a->passed_mu, NULL);
  pthread_cond_init(&a->passed_cv, NULL);
  pthread_mutex_init(&a->run_mu, NULL);
  a->listen_addr = td__strdup(o->listen_addr);
  a->init_method = td__strdup(o->init_method);
  o->listen_addr = a->listen_addr;
  o->init_method = a->init_method;
  a->opts = *o;
  a->direct_on = td__direct_wanted(o);
  a->lane_on = td__lane_wanted(o);
  {
    const char *e = getenv("TD_RPC_LANE_DIAL");
    a->lane_dial = a->lane_on && !(e && strcmp(e, "0") == 0);
    a->lane_mbox = a->lane_dial && td__mbox_wanted();
  }
  const char *share = getenv("TD_RPC_SHARE_STREAMS");
  a->share_streams = !(share && strcmp(share, "0") == 0);
  snprintf(a->name, sizeof a->name, "%s", name);
  a->rank = rank;
  a->joiner = rank == TD_RPC_RANK_JOIN;
  a->world0 = world_size;
  a->world = o->max_world_size;
  TD_TRY(resolve_run_id(o, a->run_id, sizeof a->run_id));
  a->default_timeout_ms = o->rpc_timeout_ms;
  a->peers = td__calloc((size_t)a->world, sizeof *a->peers);
  a->present = td__calloc((size_t)a->world, sizeof *a->present);
  if (!a->listen_addr || !a->init_method || !a->peers || !a->present)
    return td_set_error(TD_ERR_NOMEM, "rpc_init: out of memory");
  TD_TRY(init_auth(a, o));
  if (o->progress == TD_RPC_PROGRESS_HOST) TD_TRY(td__hostq_create(&a->hostq));
  else if (o->progress != TD_RPC_PROGRESS_THREADS)
    return td_set_error(TD_ERR_INVALID, "rpc_init: unknown progress mode %d", o->progress);
  if (rank == 0) {
    TD_TRY(td__store_create(&a->store));
    td__store_park_init(a);
    char ws[32];
    int n = snprintf(ws, sizeof ws, "%d", world_size);
    TD_TRY(td__store_local_set(a->store, "world_size", ws, (size_t)n));
    n = snprintf(ws, sizeof ws, "%d", a->world);
    TD_TRY(td__store_local_set(a->store, "max_world_size", ws, (size_t)n));
    TD_TRY(td__store_local_set(a->store, "run_id", a->run_id, strlen(a->run_id)));
  }
  return td__threadpool_create(o->num_worker_threads, "td-rpc", &a->pool);
}

static void format_addr(char *out, size_t n, const char *host, int port) {
  snprintf(out, n, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

/* A positive whole number from the environment (milliseconds, MiB, KiB: the name says), else
 * dflt. */
static int64_t env_ms(const char *name, int64_t dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  long long ms = strtoll(v, &end, 10);
  if (*end || ms <= 0) {
    td_log(TD_LOG_WARN, "rpc: ignoring %s='%s' (not a positive whole number)", name, v);
    return dflt;
  }
  return ms;
}

static int64_t env_ms_max(const char *name, int64_t dflt, int64_t max) {
  int64_t v = env_ms(name, dflt);
  return v > max ? max : v;
}

/* Workers on this host before the group is known: what the launcher says (LOCAL_WORLD_SIZE from
 * tdistrun and torchrun, OMPI_COMM_WORLD_LOCAL_SIZE from Open MPI, SLURM_NTASKS_PER_NODE when
 * it is one number), else every worker of the group (at most world either way). */
int td__rdv_local_estimate(int world) {
  static const char *const vars[] = {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                     "SLURM_NTASKS_PER_NODE"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = getenv(vars[i]);
    if (!v || !*v) continue;
    char *end;
    long n = strtol(v, &end, 10);
    if (*end == 0 && n > 0) return n < world ? (int)n : world;
  }
  return world;
}

/* The handshake timeout (TD_RPC_HANDSHAKE_TIMEOUT_MS, else 20 s): on a host running more than
 * twice as many workers as CPUs (td__rdv_local_estimate) longer with the load, x load / 200, up
 * to TD__HANDSHAKE_MAX_MS. It bounds a member's handshake at the server (strangers have their
 * 2 s HELLO tier), the client's connection attempts and its handshake retries: 192 workers on
 * 2 CPUs lost connection attempts and handshakes at 20 s, and their all-to-all failed; at 120 s
 * it completed. */
int64_t td__rdv_exit_wait_ms(const td_rpc_agent *a) {
  int load = host_load(a->local_workers > 0 ? a->local_workers : 1);
  int64_t ms = 5000;
  if (load > 200) ms = ms * load / 200;
  return ms < 60000 ? ms : 60000;
}

int64_t td__rdv_store_call_ms(const td_rpc_agent *a) {
  int load = host_load(a->local_workers > 0 ? a->local_workers : 1);
  int64_t ms = 10000;
  if (load > 200) ms = ms * load / 200;
  return ms < 60000 ? ms : 60000;
}

int64_t td__rdv_handshake_ms(int world) {
  int64_t ms = env_ms("TD_RPC_HANDSHAKE_TIMEOUT_MS", 0);
  if (ms > 0) return ms;
  int load = host_load(td__rdv_local_estimate(world));
  ms = 20000;
  if (load > 200) ms = ms * load / 200;
  return ms < TD__HANDSHAKE_MAX_MS ? ms : TD__HANDSHAKE_MAX_MS;
}

/* TLS files from the options or the environment: all three or none. *tls is filled with their
 * contents (td__malloc'd; release with tls_free) when they are given. */
static td_status init_tls(const td_rpc_options *o, td__tls *tls, bool *on) {
  const char *cert = o->tls_cert_file ? o->tls_cert_file : getenv("TD_RPC_TLS_CERT");
  const char *key = o->tls_key_file ? o->tls_key_file : getenv("TD_RPC_TLS_KEY");
  const char *ca = o->tls_ca_file ? o->tls_ca_file : getenv("TD_RPC_TLS_CA");
  const char *name = o->tls_server_name ? o->tls_server_name : getenv("TD_RPC_TLS_NAME");
  int given = (cert && *cert) + (key && *key) + (ca && *ca);
  *on = false;
  memset(tls, 0, sizeof *tls);
  if (given == 0) return TD_OK;
  if (given != 3)
    return td_set_error(TD_ERR_INVALID, "rpc_init: TLS needs a certificate, its key and the CA "
                        "(tls_cert_file / TD_RPC_TLS_CERT, tls_key_file / TD_RPC_TLS_KEY, "
                        "tls_ca_file / TD_RPC_TLS_CA): %d of 3 given", given);
  char *c = NULL, *k = NULL, *x = NULL;
  td_status st = td__auth_read_file(cert, false, 1 << 20, &c, NULL);
  if (st == TD_OK) st = td__auth_read_file(key, true, 1 << 20, &k, NULL);
  if (st == TD_OK) st = td__auth_read_file(ca, false, 1 << 20, &x, NULL);
  if (st != TD_OK) {
    td__free(c);
    td__free(k);
    td__free(x);
    return td__error_prefix(st, "rpc_init: TLS");
  }
  *tls = (td__tls){c, k, x, name && *name ? name : NULL};
  *on = true;
  return TD_OK;
}

static void tls_free(td__tls *tls) {
  td__free((char *)tls->cert_pem);
  if (tls->key_pem) {
    memset((char *)tls->key_pem, 0, strlen(tls->key_pem));
    td__free((char *)tls->key_pem);
  }
  td__free((char *)tls->ca_pem);
  memset(tls, 0, sizeof *tls);
}

/* Phase 3: the server (rank 0's serves the store on the master port) and the store client. */
/* Rank 0's store client: a request handled on the calling thread (never parked: a wait polls,
 * which costs rank 0 a table lookup). */
static td_status local_store_unary(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                                   size_t *reply_len) {
  td_rpc_agent *a = ctx;
  return td__serve_unary(a, TD__STORE_METHOD, req, len, reply, reply_len);
}

static td_status init_transport(td_rpc_agent *a, const init_addr *ad) {
  const td_rpc_options *o = &a->opts;
  td__tls tls;
  bool tls_on;
  TD_TRY(init_tls(o, &tls, &tls_on));
  a->tls = tls_on;
  td__transport_opts to = {.host = a->listen_addr,
                           .port = a->rank == 0 ? ad->mport : 0,
                           .keepalive_ms = o->keepalive_ms > 0 ? o->keepalive_ms
                                           : a->world > 65 ? (a->world - 1) * 2000 / 64 : 2000,
                           .keepalive_timeout_ms = o->keepalive_timeout_ms,
                           .max_message = o->max_message_bytes,
                           .self_rank = a->rank,
                           .world = a->world,
                           .agent = a,
                           .tick_ms = 10,
                           .auth = &a->auth,
                           .handshake_timeout_ms = td__rdv_handshake_ms(a->world),
                           .hello_timeout_ms = env_ms("TD_RPC_HELLO_TIMEOUT_MS", 2000),
                           .member_held_max = (uint64_t)env_ms("TD_RPC_MEMBER_HELD_MB", 0) << 20,
                           .memory_quota = (uint64_t)env_ms("TD_RPC_MEMORY_QUOTA_MB",
                                                            (int64_t)(o->memory_quota_bytes >> 20))
                                           << 20,
                           .stall_timeout_ms = env_ms("TD_RPC_STALL_TIMEOUT_MS",
                                                      3 * o->keepalive_timeout_ms),
                           .lane = a->lane_on,
                           .lane_direct_min = (uint64_t)env_ms_max("TD_RPC_LANE_DIRECT_MIN_KB",
                                                                   0, INT64_C(1) << 40) << 10,
                           .keepalive_auto = o->keepalive_ms <= 0,
                           /* until the group is known: the launcher's word, else everybody */
                           .host_load_x100 = host_load(td__rdv_local_estimate(a->world)),
                           .tls = tls_on ? &tls : NULL};
  td__transport_cbs cbs = {a, td__serve_msg, td__serve_bad, td__serve_closed, td__serve_unary,
                           td__serve_tick, td__serve_burst};
  int port = 0;
  td_status st = td__transport_create(&to, &cbs, &a->tr, &port);
  if (st == TD_OK && tls_on)
    td_log(TD_LOG_INFO, "rpc: %s: TLS on every connection (peers verified as '%s')", a->name,
           tls.name ? tls.name : "tdist");
  tls_free(&tls);
  if (st != TD_OK) {
    if (a->rank != 0) return st;
    if (strstr(td_last_error(), "is in use"))
      return td_set_error(st, "rpc_init: rank 0 cannot serve the rendezvous store: port %d on %s "
                          "is in use (another job, or one still exiting); choose another "
                          "MASTER_PORT (tdistrun --master-port), or let tdistrun --standalone "
                          "pick a free one", ad->mport, a->listen_addr);
    return td__error_prefix(st, "rpc_init: rank 0 cannot serve the rendezvous store on %s:%d",
                            a->listen_addr, ad->mport);
  }
  if (a->rank == 0) format_addr(a->sc.address, sizeof a->sc.address, a->listen_addr, port);
  else format_addr(a->sc.address, sizeof a->sc.address, ad->mhost, ad->mport);
  a->sc.tr = a->tr;
  __atomic_store_n(&a->sc.call_timeout_ms, o->init_timeout_ms, __ATOMIC_RELAXED);
  __atomic_store_n(&a->sc.wait_for_ready, true, __ATOMIC_RELAXED);
  if (a->rank == 0 && a->store) {
    /* rank 0's own store calls go straight to its store, not through its own gRPC server: there
     * they queued behind the whole group's requests (256 workers on 2 CPUs: seconds per call) */
    a->sc.unary_fn = local_store_unary;
    a->sc.unary_ctx = a;
  }
  /* N workers polling a wait: at most about 1,000 requests a second at the store (or 50 ms).
   * Rank 0 serves them on one thread with the CPU share of any worker: at 4,000 a second (the
   * earlier bound) 128 workers on 2 CPUs kept it saturated through the rendezvous. */
  a->sc.max_backoff_ms = a->world > 50 ? a->world : 50;
  if (a->sc.unary_fn) a->sc.max_backoff_ms = 5; /* (its polls cost a lookup, not a request) */
  /* ... and waits are parked at the store rather than polled: one request per wait (or per
   * 2 s), answered when the counter or key gets there */
  a->sc.park_ms = TD__STORE_PARK_MAX_MS;
  if (a->joiner) format_addr(a->join_addr, sizeof a->join_addr, a->listen_addr, port);
  else
    format_addr(a->peers[a->rank].info.address, sizeof a->peers[a->rank].info.address,
                a->listen_addr, port);
  return TD_OK;
}

/* After a failed rendezvous: let the others read why before rank 0 takes the store away
 * (bounded). */
static void rendezvous_failed(td_rpc_agent *a, td_status st) {
  char why[1024];
  snprintf(why, sizeof why, "%s", td_last_error());
  /* another run's store, or a running group a joiner failed to join: write nothing there */
  if (a->foreign || a->joiner) return;
  __atomic_store_n(&a->sc.call_timeout_ms, 1000, __ATOMIC_RELAXED);
  if (st == TD_ERR_TIMEOUT) {
    /* the others time out on their own: just say so, briefly (init keeps to its deadline) */
    td__store_set_deadline(&a->sc, td__now_ns() + 100000000ull);
    td__store_add(&a->sc, "failed", 1, NULL);
    td_set_error(st, "%s", why);
    return;
  }
  td__store_set_deadline(&a->sc, td__now_ns() + 1000000000ull);
  td__agent_set_abort(a, why);
  int64_t acks = 0, joined = 0;
  td__store_add(&a->sc, "failed", 1, &acks);
  if (a->rank == 0 && td__store_add(&a->sc, "joined", 0, &joined) == TD_OK)
    td__store_wait_ge(&a->sc, "failed", joined, td__now_ns() + 1000000000ull, NULL);
  td_set_error(st, "%s", why);
}

/* Tracing (TD_TRACE=DIR starts it for the whole program): name this process's track, and
 * estimate this clock's offset to rank 0's from a few exchanges with its store, keeping the one
 * with the shortest round trip (its half is the residual uncertainty). */
/* The flight recorder (always on) learns who this process is and the names of the others, and
 * shares the clock estimate, which its dumps need as much as traces do. */
static void init_flight(td_rpc_agent *a) {
  td__flight_set_process(a->rank, a->name, a->world);
  td__flight_set_pool(a->opts.num_worker_threads);
  char *names = td__calloc((size_t)a->world, sizeof a->peers[0].info.name);
  if (names) {
    for (int i = 0; i < a->world; i++)
      memcpy(names + (size_t)i * sizeof a->peers[0].info.name, a->peers[i].info.name,
             sizeof a->peers[0].info.name);
    td__flight_set_workers(names, sizeof a->peers[0].info.name, a->world);
    td__free(names);
  }
  td__flight_start();
}

static void init_trace(td_rpc_agent *a) {
  const char *dir = getenv("TD_TRACE");
  if (dir && *dir && !td_trace_enabled() && td_trace_start(dir) == TD_OK) a->trace_owned = true;
  init_flight(a);
  bool flight = __atomic_load_n(&td__flight_state, __ATOMIC_ACQUIRE) > 0; /* set by any thread */
  if (td_trace_enabled()) td__trace_set_process(a->rank, a->name);
  if ((!td_trace_enabled() && !flight) || a->rank == 0) return;
  int64_t best_rtt = INT64_MAX, offset = 0;
  /* the flight recorder alone (always on) needs less precision than a trace: in large groups,
   * whose workers all ask rank 0's store at once, 2 exchanges rather than 8 */
  int rounds = td_trace_enabled() || a->world <= 64 ? 8 : 2;
  for (int i = 0; i < rounds; i++) {
    int64_t skew = td__trace_test_skew(), server, t0 = (int64_t)td__now_ns() + skew;
    if (td__store_now(&a->sc, &server) != TD_OK) return;
    int64_t t1 = (int64_t)td__now_ns() + skew;
    if (t1 - t0 < best_rtt) {
      best_rtt = t1 - t0;
      offset = server - (t0 + t1) / 2;
    }
  }
  td__trace_set_clock(offset, best_rtt / 2);
  td__flight_set_clock(offset, best_rtt / 2);
}

/* Phase 5: the group is known: settle the store client, busy polling, upper layers' hooks. */
static void init_finish(td_rpc_agent *a) {
  td__progress_adopt_thread(a); /* host mode: the thread that joined drives progress */
  a->opts.device_maps = NULL; /* borrowed: read at init only */
  a->opts.num_device_maps = 0;
  __atomic_store_n(&a->sc.call_timeout_ms, 10000, __ATOMIC_RELAXED);
  td__store_set_deadline(&a->sc, 0);
  char owner[160];
  snprintf(owner, sizeof owner, "%s (rank 0)", a->peers[0].info.name);
  td__store_set_owner(&a->sc, owner);
  /* from now on a missing rank 0 is a failure, not a late start */
  __atomic_store_n(&a->sc.wait_for_ready, false, __ATOMIC_RELAXED);
  /* After the line above: the group is complete, so rank 0 may already have finished and left
   * (a non-graceful shutdown does not wait for anyone): nothing here waits for its store (the
   * clocks were exchanged before the ready barrier, init_trace). */
  a->busy_poll_us = busy_poll_window(a, a->opts.busy_poll_us);
  td__transport_set_busy_poll(a->tr, a->busy_poll_us);
  /* the pool's handlers and callbacks follow each other closely under load as replies do */
  td__threadpool_set_spin(a->pool, a->busy_poll_us * 1000);
  td__agent_hooks hs[TD__MAX_AGENT_HOOKS];
  int nh = td__agent_hooks_get(hs);
  for (int i = 0; i < nh; i++)
    if (hs[i].on_init) hs[i].on_init(a);
  td_log(TD_LOG_INFO, "rpc: %s (rank %d of %d) listening on %s", a->name, a->rank, a->world,
         a->peers[a->rank].info.address);
  td__serve_start(a); /* requests that arrived meanwhile run now, on a complete agent */
}

td_status td__rpc_init_impl(const char *name, int rank, int world_size,
                            const td_rpc_options *opts, td_rpc_agent **out) {
  TD_CHECK_ARG(out, "rpc_init: NULL out");
  td__auth_crypto_init(); /* before gRPC or anything else initialises libcrypto */
  td_rpc_options o;
  init_addr ad = {{0}};
  char defname[32];
  TD_TRY(init_options(&name, defname, sizeof defname, rank, world_size, opts, &o, &ad));
  td_rpc_agent *a = NULL;
  td_status st = init_agent(name, rank, world_size, &o, &a);
  if (st == TD_OK) st = init_transport(a, &ad);
  if (st == TD_OK && (st = rendezvous(a)) != TD_OK) rendezvous_failed(a, st);
  if (st == TD_OK) {
    init_finish(a);
    st = rdv_passed_start(a);
  }
  if (st == TD_OK) {
    *out = a;
    return TD_OK;
  }
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", td_last_error());
  if (a) {
    if (a->trace_owned) td_trace_stop(); /* started at the rendezvous (init_trace) */
    td__serve_drop_held(a, msg);
    td__store_park_end(a);
    td__transport_shutdown(a->tr);
    td__threadpool_destroy(a->pool);
    a->pool = NULL;
    td__transport_destroy(a->tr);
    a->tr = NULL;
    td__agent_free(a);
  }
  return td_set_error(st, "%s", msg);
}

/* ---- from the environment (torchrun, Slurm, Open MPI) ---- */

td_status td__rpc_init_from_env_impl(const char *name, const td_rpc_options *opts,
                                     td_rpc_agent **out) {
  TD_TRY(options_check(opts, "rpc_init_from_env"));
  const char *rs = env2("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK");
  const char *ws = env2("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE");
  if (!rs || !ws)
    return td_set_error(TD_ERR_INVALID, "rpc_init_from_env: RANK and WORLD_SIZE (or Slurm / "
                        "Open MPI equivalents) are not set; start the program with tdistrun");
  char *e1, *e2;
  long rank = strtol(rs, &e1, 10), world = strtol(ws, &e2, 10);
  /* RANK=-1: join a running group (TD_RPC_MAX_WORLD_SIZE; checked by td_rpc_init) */
  if (*e1 || *e2 || rank < TD_RPC_RANK_JOIN || world < 1 || rank >= world)
    return td_set_error(TD_ERR_INVALID, "rpc_init_from_env: bad RANK '%s' / WORLD_SIZE '%s'", rs,
                        ws);
  td_rpc_options o;
  if (opts) o = *opts;
  else td_rpc_options_init(&o);
  char method[400];
  if (!o.init_method || strcmp(o.init_method, "env://") == 0) {
    TD_TRY(master_from_env(true, method, sizeof method));
    o.init_method = method;
  }
  return td__rpc_init_impl(name, (int)rank, (int)world, &o, out);
}
