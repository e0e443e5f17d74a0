/* generation.c - membership generations of a process group: the lost-member notice and the
 * re-formation of a group among its live members (td_process_group_wait_lost,
 * td_process_group_reform; include/tdist/collectives.h, "Fault tolerance").
 *
 * A group has a lineage (the id of its generation 0) and a generation number. When a member is
 * lost, the collective in flight fails on every member naming it (group.c); the first observer
 * notes the loss ("pg/<id>/lost/<group rank>" in the store, and in its group for the notice).
 * The survivors then call td_process_group_reform on the broken group, which creates generation
 * g + 1 among the members that are still there:
 *   1. each caller announces itself: "ft/<lineage>/<g+1>/join/<global rank>" = its pid;
 *   2. the first caller to take a ticket ("ft/<lineage>/<g+1>/ticket", a store counter) decides
 *      the membership: it waits until every member of the old group has joined or is known lost
 *      (its process exited, as a backend with pids sees it: excluded at once; noted lost by an
 *      observer: excluded after JOIN_GRACE_MS without a join, since a closed connection does not
 *      prove a death; neither: excluded at half the call's timeout, the other half being left to
 *      set up the new group), takes a new group id from "pg/next_id"
 *      and publishes "ft/<lineage>/<g+1>/members" = "<id> <global rank> ...";
 *   3. every caller reads that record; one that is not listed is stale and gets TD_ERR_STATE
 *      naming the generation it was left out of; the members create the group (process_group.c)
 *      with the decided id and generation, so their ring connections are authenticated under a
 *      key bound to both (ring_connect.c: a member of another generation fails the handshake).
 * A caller whose re-formation failed (a second failure while the new group was set up) calls it
 * again on the same old group: it then forms generation g + 2 from the same candidates, and so
 * on. The decider dying while it decides makes the others' re-formation time out (a clear error,
 * never a hang); the rendezvous store's host (global rank 0) is the limit of the scheme: without
 * it nothing can be agreed.
 *
 * Spares (td_process_group_spare): a worker outside the group offers itself under
 * "ft/<lineage>/spare/<i>" (i from the counter "ft/<lineage>/spares"; the value is its global
 * rank and its same-host record). A decider that excluded k members admits up to k spares,
 * lowest global rank first: it claims each ("ft/<lineage>/spare/<i>/claim", a counter: the
 * first to take it owns it; a spare on this host whose process exited is claimed and skipped),
 * lists it in the members record, and then tells it the generation
 * ("ft/<lineage>/spare/<i>/gen"). The spare reads the record and creates the group with the
 * others, as a member that joined (pg->joined: it holds none of the group's state; td_ft_ddp and
 * td_ft_zero heal it). The decider also adds k to "ft/<lineage>/left_out".
 * td_process_group_release_spares sets "ft/<lineage>/over", then claims every offer and answers
 * it with generation 0 ("not needed"); a spare checks "over" after offering itself, so an offer
 * made during a release is seen by one or the other.
 *
 * Lock order: pg->lost_mu is a leaf; nothing here takes pg->mu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../core/flight_impl.h"
#include "../core/netaddr.h"
#include "../core/samehost.h"
#include "../rpc/agent_impl.h"
#include "coll_impl.h"

#define JOIN_GRACE_MS 1000 /* how long a member noted lost (not seen exited) may still join */
#define STORE_CHECK_MS 100 /* wait_lost: how often the store's loss records are read */

uint64_t td_process_group_generation(const td_process_group *pg) {
  return pg ? pg->generation : 0;
}

/* ---- the lost-member notice ---- */

static void fill_lost(const td_process_group *pg, int m, td_status st, const char *why,
                      td_pg_lost *out) {
  memset(out, 0, sizeof *out);
  out->group_rank = m;
  out->global_rank = pg->ranks[m];
  snprintf(out->name, sizeof out->name, "%s", pg->names[m]);
  out->generation = pg->generation;
  out->status = st;
  snprintf(out->reason, sizeof out->reason, "%s", why);
}

/* A member whose process a backend saw exit, or -1. */
static int exited_member(td_process_group *pg) {
  for (int m = 0; m < pg->size; m++) {
    if (m == pg->rank) continue;
    for (int i = 0; i < TD__TP_COUNT; i++)
      if (pg->tp[i] && pg->tp[i]->member_alive && pg->tp[i]->member_alive(pg, m) == 0) return m;
  }
  return -1;
}

/* Reads the store's loss records; true with *out filled when one exists. */
static bool stored_lost(td_process_group *pg, td_pg_lost *out) {
  char key[96], suffix[48];
  for (int m = 0; m < pg->size; m++) {
    if (m == pg->rank) continue;
    uint8_t *v = NULL;
    bool found = false;
    snprintf(suffix, sizeof suffix, "lost/%d", m);
    if (td__store_get(pg->sc, td__pg_key(pg, suffix, key, sizeof key), &v, NULL, &found) !=
            TD_OK ||
        !found || !v) {
      td__free(v);
      continue;
    }
    char *nl = strchr((char *)v, '\n');
    int code = atoi((char *)v);
    fill_lost(pg, m, code > 0 ? (td_status)code : TD_ERR_UNAVAILABLE, nl ? nl + 1 : "", out);
    td__free(v);
    return true;
  }
  return false;
}

static bool local_lost(td_process_group *pg, td_pg_lost *out) {
  pthread_mutex_lock(&pg->lost_mu);
  int m = pg->lost_grank;
  if (m >= 0) fill_lost(pg, m, pg->lost_status, pg->lost_why, out);
  pthread_mutex_unlock(&pg->lost_mu);
  if (m >= 0) return true;
  m = exited_member(pg);
  if (m < 0) return false;
  char why[256], who[160];
  snprintf(why, sizeof why, "%s is unavailable: its process exited",
           td__pg_who(pg, m, who, sizeof who));
  fill_lost(pg, m, TD_ERR_UNAVAILABLE, why, out);
  return true;
}

td_status td_process_group_wait_lost(td_process_group *pg, td_timeout_ms timeout,
                                     td_pg_lost *out) {
  TD_CHECK_ARG(pg && out && td__timeout_valid(timeout),
               "process_group_wait_lost: NULL group or out, or an invalid timeout");
  uint64_t dl = td__deadline_ns(td__timeout_resolve(timeout, TD_TIMEOUT_INFINITE));
  uint64_t next_store = 0;
  for (;;) {
    td_pg_lost l;
    if (local_lost(pg, &l)) {
      *out = l;
      return TD_OK;
    }
    uint64_t now = td__now_ns();
    if (now >= next_store) {
      if (stored_lost(pg, &l)) {
        *out = l;
        return TD_OK;
      }
      next_store = td__now_ns() + (uint64_t)STORE_CHECK_MS * 1000000ull;
    }
    now = td__now_ns();
    if (now >= dl)
      return td_set_error(TD_ERR_TIMEOUT, "process_group_wait_lost: no member of process group "
                          "%llu (generation %llu) was lost", (unsigned long long)pg->id,
                          (unsigned long long)pg->generation);
    uint64_t left = dl - now;
    td__pg_sleep_ms(left < 10000000ull ? (int64_t)(left / 1000000ull) + 1 : 10);
  }
}

/* ---- re-formation ---- */

static const char *ft_key(const td_process_group *pg, uint64_t gen, const char *suffix, char *buf,
                          size_t n) {
  snprintf(buf, n, "ft/%llu/%llu/%s", (unsigned long long)pg->lineage, (unsigned long long)gen,
           suffix);
  return buf;
}

/* What the decider knows of old member m: 1 joined, 0 excluded, -1 not yet decided. */
static int member_verdict(td_process_group *pg, uint64_t gen, int m, uint64_t t0, uint64_t dl) {
  char key[160], suffix[48];
  bool found = false;
  snprintf(suffix, sizeof suffix, "join/%d", pg->ranks[m]);
  if (td__store_get(pg->sc, ft_key(pg, gen, suffix, key, sizeof key), NULL, NULL, &found) ==
          TD_OK &&
      found)
    return 1;
  for (int i = 0; i < TD__TP_COUNT; i++)
    if (pg->tp[i] && pg->tp[i]->member_alive && pg->tp[i]->member_alive(pg, m) == 0) return 0;
  uint64_t now = td__now_ns();
  if (now >= dl) return 0;
  if (now - t0 < (uint64_t)JOIN_GRACE_MS * 1000000ull) return -1;
  snprintf(suffix, sizeof suffix, "lost/%d", m);
  found = false;
  td__store_get(pg->sc, td__pg_key(pg, suffix, key, sizeof key), NULL, NULL, &found);
  return found ? 0 : -1;
}

/* ---- spares ---- */

/* Writes "ft/<lineage>/<what>" into buf, or "ft/<lineage>/spare/<offer>[/<what>]" when offer
 * >= 0 (what NULL: the offer's record). */
static const char *lin_key(char *buf, size_t n, uint64_t lineage, int64_t offer,
                           const char *what) {
  if (offer < 0)
    snprintf(buf, n, "ft/%llu/%s", (unsigned long long)lineage, what ? what : "");
  else if (!what)
    snprintf(buf, n, "ft/%llu/spare/%lld", (unsigned long long)lineage, (long long)offer);
  else
    snprintf(buf, n, "ft/%llu/spare/%lld/%s", (unsigned long long)lineage, (long long)offer,
             what);
  return buf;
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* Claims offer i: true when this caller took it (nobody had). */
static td_status claim(const td__store_client *sc, uint64_t lineage, int64_t i, bool *mine) {
  int64_t v = 0;
  char kb[160];
  TD_TRY(td__store_add(sc, lin_key(kb, sizeof kb, lineage, i, "claim"), 1, &v));
  *mine = v == 1;
  return TD_OK;
}

/* This worker's same-host record, parsed (false when it has none). */
static bool host_self(td_process_group *pg, td__host_rec *me) {
  td_worker_info wi;
  char host[256] = "", rec[400];
  uint64_t nonce = td__samehost_nonce(me);
  if (td_rpc_self(pg->agent, &wi) == TD_OK) td__addr_host(wi.address, host, sizeof host);
  return host[0] && td__samehost_record(host, &nonce, rec, sizeof rec) &&
         td__samehost_parse(rec, me);
}

/* Reads offer i's record: *rank (-1: not written yet) and *gone, true when the spare runs on
 * this host (me, when have_me) and its process exited. */
static td_status offer_read(td_process_group *pg, int64_t i, const td__host_rec *me,
                            bool have_me, long *rank, bool *gone) {
  char kb[160];
  uint8_t *v = NULL;
  bool found = false;
  *rank = -1;
  *gone = false;
  TD_TRY(td__store_get(pg->sc, lin_key(kb, sizeof kb, pg->lineage, i, NULL), &v, NULL, &found));
  if (found && v) {
    char *end = NULL;
    td__host_rec peer;
    *rank = strtol((char *)v, &end, 10);
    if (end == (char *)v) *rank = -2; /* unreadable: never admitted */
    *gone = have_me && *end == ' ' && td__samehost_parse(end + 1, &peer) &&
            td__samehost_same(me, &peer) && !td__pid_alive(peer.pid);
  }
  td__free(v);
  return TD_OK;
}

/* An offer the decider may take: its number and the spare's global rank. */
typedef struct offer_t {
  int64_t i;
  int rank;
} offer_t;

static int cmp_offer(const void *a, const void *b) {
  const offer_t *x = a, *y = b;
  return (x->rank > y->rank) - (x->rank < y->rank);
}

/* Lists the offers not yet claimed whose record is written, whose rank is of this world and not
 * in rs[0..n), and whose spare is not known to have exited (such a one is claimed and passed
 * over), in global rank order: *out malloc'd, *k entries. */
static td_status open_offers(td_process_group *pg, const int *rs, int n, offer_t **out, int *k) {
  int64_t count = 0;
  char kb[160];
  *out = NULL;
  *k = 0;
  TD_TRY(td__store_add(pg->sc, lin_key(kb, sizeof kb, pg->lineage, -1, "spares"), 0, &count));
  if (count <= 0) return TD_OK;
  offer_t *o = td__malloc((size_t)count * sizeof *o);
  if (!o) return td_set_error(TD_ERR_NOMEM, "process group spares: out of memory");
  int world = td_rpc_world_size(pg->agent);
  td__host_rec me;
  bool have_me = host_self(pg, &me);
  td_status st = TD_OK;
  for (int64_t i = 0; st == TD_OK && i < count; i++) {
    long r = -1;
    bool gone = false, took = false;
    int64_t claims = 0;
    st = td__store_add(pg->sc, lin_key(kb, sizeof kb, pg->lineage, i, "claim"), 0, &claims);
    if (st == TD_OK && claims == 0) st = offer_read(pg, i, &me, have_me, &r, &gone);
    bool listed = claims != 0 || r < 0 || r >= world;
    for (int j = 0; !listed && j < n; j++) listed = rs[j] == (int)r;
    if (st != TD_OK || listed) continue;
    if (gone) {
      st = claim(pg->sc, pg->lineage, i, &took);
      if (st == TD_OK && took)
        td_log(TD_LOG_WARN, "process group %llu: spare rank %ld exited before it was needed",
               (unsigned long long)pg->lineage, r);
      continue;
    }
    o[(*k)++] = (offer_t){i, (int)r};
  }
  if (st != TD_OK) {
    td__free(o);
    *k = 0;
    return st;
  }
  qsort(o, (size_t)*k, sizeof *o, cmp_offer);
  *out = o;
  return TD_OK;
}

/* The decider admits up to `want` waiting spares, lowest global rank first: each one it claims
 * has its rank appended to rs[*n..] and its offer number to offer[*n_adm..]. */
static td_status admit_spares(td_process_group *pg, int want, int *rs, int *n, int64_t *offer,
                              int *n_adm) {
  offer_t *o = NULL;
  int k = 0;
  TD_TRY(open_offers(pg, rs, *n, &o, &k));
  td_status st = TD_OK;
  for (int j = 0; st == TD_OK && j < k && *n_adm < want; j++) {
    bool took = false;
    st = claim(pg->sc, pg->lineage, o[j].i, &took);
    if (st != TD_OK || !took) continue; /* withdrawn meanwhile */
    rs[(*n)++] = o[j].rank;
    offer[(*n_adm)++] = o[j].i;
  }
  td__free(o);
  return st;
}

/* The decider: waits for every old member's verdict, then publishes the membership (with the
 * spares it admits in place of the members it leaves out). */
static td_status decide(td_process_group *pg, uint64_t gen, uint64_t dl) {
  int *verdict = td__malloc((size_t)pg->size * sizeof *verdict);
  if (!verdict) return td_set_error(TD_ERR_NOMEM, "process_group_reform: out of memory");
  for (int m = 0; m < pg->size; m++) verdict[m] = m == pg->rank ? 1 : -1;
  uint64_t t0 = td__now_ns();
  int64_t backoff = 1;
  for (;;) {
    int open = 0;
    for (int m = 0; m < pg->size; m++) {
      if (verdict[m] < 0) verdict[m] = member_verdict(pg, gen, m, t0, dl);
      open += verdict[m] < 0;
    }
    if (!open) break;
    td__pg_sleep_ms(backoff);
    backoff = backoff * 2 > 20 ? 20 : backoff * 2;
  }
  int excluded = 0, n = 0, n_adm = 0;
  for (int m = 0; m < pg->size; m++) excluded += verdict[m] == 0;
  int *rs = td__malloc((size_t)(pg->size + excluded + 1) * sizeof *rs);
  int64_t *offer = td__malloc((size_t)(excluded + 1) * sizeof *offer), id = 0, left = 0;
  td_status st = rs && offer ? TD_OK : td_set_error(TD_ERR_NOMEM, "process_group_reform: out of "
                                                    "memory");
  for (int m = 0; st == TD_OK && m < pg->size; m++)
    if (verdict[m] == 1) rs[n++] = pg->ranks[m];
  char kb[160];
  if (st == TD_OK && excluded)
    st = td__store_add(pg->sc, lin_key(kb, sizeof kb, pg->lineage, -1, "left_out"), excluded,
                       &left);
  if (st == TD_OK && excluded) st = admit_spares(pg, excluded, rs, &n, offer, &n_adm);
  if (st == TD_OK) st = td__store_add(pg->sc, "pg/next_id", 1, &id);
  size_t cap = 32 + (size_t)n * 12, len = 0;
  char *rec = st == TD_OK ? td__malloc(cap) : NULL;
  if (st == TD_OK && !rec) st = td_set_error(TD_ERR_NOMEM, "process_group_reform: out of memory");
  if (st == TD_OK) {
    qsort(rs, (size_t)n, sizeof *rs, cmp_int);
    len = (size_t)snprintf(rec, cap, "%lld", (long long)id);
    for (int i = 0; i < n; i++) len += (size_t)snprintf(rec + len, cap - len, " %d", rs[i]);
    char key[160];
    st = td__store_set(pg->sc, ft_key(pg, gen, "members", key, sizeof key), rec, len);
  }
  /* the admitted spares learn their generation once the record they read exists */
  for (int j = 0; st == TD_OK && j < n_adm; j++) {
    char v[24];
    int vn = snprintf(v, sizeof v, "%llu", (unsigned long long)gen);
    st = td__store_set(pg->sc, lin_key(kb, sizeof kb, pg->lineage, offer[j], "gen"), v,
                       (size_t)vn);
  }
  td__free(rec);
  td__free(rs);
  td__free(offer);
  td__free(verdict);
  return st;
}

/* Parses "<id> <rank> <rank> ..." into *id and a malloc'd sorted rank list. */
static td_status parse_members(const char *rec, int world, uint64_t *id, int **ranks, int *n) {
  char *end;
  *id = strtoull(rec, &end, 10);
  int *rs = td__malloc((size_t)world * sizeof *rs), k = 0;
  if (!rs) return td_set_error(TD_ERR_NOMEM, "process_group_reform: out of memory");
  const char *p = end;
  while (*p == ' ' && k < world) {
    long r = strtol(p + 1, &end, 10);
    if (end == p + 1 || r < 0 || r >= world || (k && r <= rs[k - 1])) break;
    rs[k++] = (int)r;
    p = end;
  }
  if (*p || k == 0) {
    td__free(rs);
    return td_set_error(TD_ERR_FORMAT, "process_group_reform: bad membership record '%.60s'",
                        rec);
  }
  *ranks = rs;
  *n = k;
  return TD_OK;
}

td_status td_process_group_reform(td_process_group *pg, td_timeout_ms timeout,
                                  td_process_group **out) {
  TD_CHECK_ARG(pg && out && td__timeout_valid(timeout),
               "process_group_reform: NULL group or out, or an invalid timeout");
  int64_t tmo = td__timeout_resolve(timeout, pg->timeout_ms);
  uint64_t dl = td__deadline_ns(tmo);
  uint64_t gen = pg->generation + 1 + (uint64_t)pg->reform_tries++;
  int me = pg->ranks[pg->rank];
  char key[160], suffix[48], v[24], who[160];
  td__flight_ev fl = {.kind = TD__FL_WAIT_BEGIN, .peer = -1, .a = pg->lineage, .b = gen};
  td__flight_push(&fl, "pg_reform");
  snprintf(suffix, sizeof suffix, "join/%d", me);
  int vn = snprintf(v, sizeof v, "%d", (int)getpid());
  td_status st = td__store_set(pg->sc, ft_key(pg, gen, suffix, key, sizeof key), v, (size_t)vn);
  int64_t ticket = 0;
  if (st == TD_OK) st = td__store_add(pg->sc, ft_key(pg, gen, "ticket", key, sizeof key), 1,
                                      &ticket);
  /* the decision may take half the time; the new group's connections get the rest */
  if (st == TD_OK && ticket == 1) st = decide(pg, gen, td__deadline_ns(tmo / 2));
  uint8_t *rec = NULL;
  if (st == TD_OK) {
    st = td__store_wait_key(pg->sc, ft_key(pg, gen, "members", key, sizeof key), dl, NULL, &rec,
                            NULL);
    if (st == TD_ERR_TIMEOUT)
      st = td_set_error(TD_ERR_TIMEOUT, "process_group_reform: generation %llu of process group "
                        "%llu was not decided within %lld ms (the member deciding it was lost?)",
                        (unsigned long long)gen, (unsigned long long)pg->lineage, (long long)tmo);
  }
  uint64_t id = 0;
  int *rs = NULL, n = 0, my = -1;
  if (st == TD_OK) st = parse_members((const char *)rec, td_rpc_world_size(pg->agent), &id, &rs,
                                      &n);
  td__free(rec);
  for (int i = 0; st == TD_OK && i < n; i++)
    if (rs[i] == me) my = i;
  if (st == TD_OK && my < 0) {
    td__free(rs);
    st = td_set_error(TD_ERR_STATE, "process_group_reform: %s is stale: generation %llu of "
                      "process group %llu was formed without it (it did not join in time)",
                      td__pg_who(pg, pg->rank, who, sizeof who), (unsigned long long)gen,
                      (unsigned long long)pg->lineage);
  }
  if (st == TD_OK) {
    td__pg_given given = {.id = id, .lineage = pg->lineage, .generation = gen, .deadline = dl};
    st = td__pg_create_member(pg->agent, rs, n, my, pg->backend, pg->timeout_ms, &given, out);
    if (st != TD_OK)
      st = td__error_prefix(st, "process_group_reform: generation %llu", (unsigned long long)gen);
  }
  fl.kind = TD__FL_WAIT_END;
  fl.x = (uint8_t)st;
  td__flight_pop(&fl, "pg_reform");
  if (st == TD_OK)
    td_log(TD_LOG_INFO, "process group %llu: generation %llu formed with %d of %d members "
           "(group %llu)", (unsigned long long)pg->lineage, (unsigned long long)gen, n, pg->size,
           (unsigned long long)id);
  return st;
}

/* ---- spares: offering, admission, release ---- */

/* Waits for the generation offer i is answered with (0: released); on the deadline withdraws
 * the offer, unless a decider claimed it meanwhile (then waits for the answer, which follows
 * the claim at once, a little longer). */
static td_status spare_answer(const td__store_client *sc, uint64_t lineage, int64_t i,
                              uint64_t dl, uint64_t *gen, int64_t *left) {
  char kb[160];
  uint8_t *v = NULL;
  td_status st = td__store_wait_key(sc, lin_key(kb, sizeof kb, lineage, i, "gen"), dl, NULL, &v,
                                    NULL);
  if (st == TD_ERR_TIMEOUT) {
    bool mine = false;
    TD_TRY(claim(sc, lineage, i, &mine));
    if (mine) {
      *gen = 0;
      return td_set_error(TD_ERR_TIMEOUT, "process_group_spare: no re-formation of process "
                          "group %llu admitted this spare in time (offer withdrawn)",
                          (unsigned long long)lineage);
    }
    st = td__store_wait_key(sc, kb, td__deadline_ns(TD__PG_DEFAULT_TIMEOUT_MS), NULL, &v, NULL);
  }
  if (st == TD_OK) { /* "<generation>", or "0 <members left out>" for a release */
    char *end = NULL;
    *gen = strtoull((const char *)v, &end, 10);
    if (*gen == 0 && end && *end == ' ') *left = strtoll(end + 1, NULL, 10);
  }
  td__free(v);
  return st;
}

/* Admitted to generation gen of the lineage: reads its members record and creates the group
 * with them (*out marked joined). */
static td_status spare_create(td_rpc_agent *agent, uint64_t lineage, uint64_t gen,
                              td_pg_backend backend, int64_t tmo, td_process_group **out) {
  const td__store_client *sc = td__agent_store(agent);
  int world = td_rpc_world_size(agent), me = td_rpc_rank(agent);
  char kb[160];
  uint8_t *v = NULL;
  snprintf(kb, sizeof kb, "ft/%llu/%llu/members", (unsigned long long)lineage,
           (unsigned long long)gen);
  uint64_t cdl = td__deadline_ns(tmo);
  td_status st = td__store_wait_key(sc, kb, cdl, NULL, &v, NULL);
  uint64_t id = 0;
  int *rs = NULL, k = 0, my = -1;
  if (st == TD_OK) st = parse_members((const char *)v, world, &id, &rs, &k);
  td__free(v);
  for (int j = 0; st == TD_OK && j < k; j++)
    if (rs[j] == me) my = j;
  if (st == TD_OK && my < 0) {
    td__free(rs);
    st = td_set_error(TD_ERR_STATE, "process_group_spare: generation %llu of process group %llu "
                      "does not list this spare", (unsigned long long)gen,
                      (unsigned long long)lineage);
  }
  if (st != TD_OK) return st;
  td__pg_given given = {.id = id, .lineage = lineage, .generation = gen, .deadline = cdl};
  st = td__pg_create_member(agent, rs, k, my, backend, tmo, &given, out);
  if (st != TD_OK)
    return td__error_prefix(st, "process_group_spare: generation %llu", (unsigned long long)gen);
  (*out)->joined = true;
  td_log(TD_LOG_INFO, "process group %llu: joined generation %llu as a spare (%d members)",
         (unsigned long long)lineage, (unsigned long long)gen, k);
  return TD_OK;
}

td_status td_process_group_spare(td_rpc_agent *agent, const int *ranks, int n,
                                 td_pg_backend backend, td_timeout_ms timeout,
                                 td_timeout_ms wait, td_process_group **out,
                                 bool *members_lost) {
  TD_CHECK_ARG(agent && ranks && out && td__timeout_valid(timeout) && td__timeout_valid(wait),
               "process_group_spare: NULL agent, ranks or out, or an invalid timeout");
  int world = td_rpc_world_size(agent), me = td_rpc_rank(agent);
  TD_CHECK_ARG(n >= 1 && n <= world, "process_group_spare: %d ranks for a world of %d", n, world);
  *out = NULL;
  if (members_lost) *members_lost = false;
  int *rs = td__malloc((size_t)n * sizeof *rs);
  if (!rs) return td_set_error(TD_ERR_NOMEM, "process_group_spare: out of memory");
  memcpy(rs, ranks, (size_t)n * sizeof *rs);
  qsort(rs, (size_t)n, sizeof *rs, cmp_int);
  td_status st = TD_OK;
  for (int i = 0; st == TD_OK && i < n; i++)
    if (rs[i] < 0 || rs[i] >= world || (i && rs[i] == rs[i - 1]) || rs[i] == me)
      st = td_set_error(TD_ERR_INVALID, "process_group_spare: rank %d is %s", rs[i],
                        rs[i] == me ? "this worker (a member is not its group's spare)"
                        : rs[i] < 0 || rs[i] >= world ? "outside the world" : "listed twice");
  int64_t tmo = td__timeout_resolve(timeout, TD__PG_DEFAULT_TIMEOUT_MS);
  uint64_t dl = td__deadline_ns(td__timeout_resolve(wait, TD_TIMEOUT_INFINITE));
  const td__store_client *sc = td__agent_store(agent);
  char kb[160], rec[460], host[256] = "";
  uint8_t *v = NULL;
  /* the group's lineage: the id its creation publishes, found as a member finds it */
  if (st == TD_OK) st = td__pg_new_key(agent, rs, n, kb, sizeof kb);
  td__free(rs);
  rs = NULL;
  if (st == TD_OK) st = td__store_wait_key(sc, kb, dl, NULL, &v, NULL);
  if (st == TD_ERR_TIMEOUT)
    st = td_set_error(TD_ERR_TIMEOUT, "process_group_spare: the group was not created in time");
  uint64_t lineage = st == TD_OK ? strtoull((const char *)v, NULL, 10) : 0;
  td__free(v);
  v = NULL;
  /* the offer: this worker's rank and same-host record (so a decider can pass over a spare
   * that exited) */
  td_worker_info wi;
  if (td_rpc_self(agent, &wi) == TD_OK) td__addr_host(wi.address, host, sizeof host);
  uint64_t nonce = td__samehost_nonce(&nonce);
  int rl = snprintf(rec, sizeof rec, "%d ", me);
  if (!host[0] || !td__samehost_record(host, &nonce, rec + rl, sizeof rec - (size_t)rl))
    snprintf(rec + rl, sizeof rec - (size_t)rl, "-");
  /* a generation that admitted this spare but could not form (another member lost while it
   * connected) is formed again without it: it offers itself again, until `wait` passes */
  while (st == TD_OK) {
    int64_t i = 0;
    st = td__store_add(sc, lin_key(kb, sizeof kb, lineage, -1, "spares"), 1, &i);
    i--;
    if (st == TD_OK)
      st = td__store_set(sc, lin_key(kb, sizeof kb, lineage, i, NULL), rec, strlen(rec));
    /* released before this offer was listed: withdraw it unless a decider took it first */
    bool over = false, mine = false;
    if (st == TD_OK)
      st = td__store_get(sc, lin_key(kb, sizeof kb, lineage, -1, "over"), NULL, NULL, &over);
    if (st == TD_OK && over) st = claim(sc, lineage, i, &mine);
    uint64_t gen = 0;
    int64_t left = 0;
    if (st == TD_OK && !mine) st = spare_answer(sc, lineage, i, dl, &gen, &left);
    if (st == TD_OK && mine) /* withdrawn after the release: ask what it said */
      st = td__store_add(sc, lin_key(kb, sizeof kb, lineage, -1, "left_out"), 0, &left);
    if (st == TD_OK && gen == 0) { /* released: the group ended without needing this spare */
      if (members_lost) *members_lost = left > 0;
      /* the releaser waits for this before it may leave (it may host the store); a lost reply
       * means it left already */
      td__store_set(sc, lin_key(kb, sizeof kb, lineage, i, "ack"), "1", 1);
      return TD_OK;
    }
    if (st != TD_OK) return st;
    st = spare_create(agent, lineage, gen, backend, tmo, out);
    if (st == TD_OK) return TD_OK;
    if ((st != TD_ERR_TIMEOUT && st != TD_ERR_UNAVAILABLE) || td__now_ns() >= dl) return st;
    td_log(TD_LOG_WARN, "process group %llu: generation %llu, which admitted this spare, did not "
           "form (%s); offering again", (unsigned long long)lineage, (unsigned long long)gen,
           td_last_error());
  }
  return st;
}

td_status td_process_group_release_spares(td_process_group *pg) {
  TD_CHECK_ARG(pg, "process_group_release_spares: NULL group");
  char kb[160], v[32];
  int64_t count = 0, left = 0;
  TD_TRY(td__store_set(pg->sc, lin_key(kb, sizeof kb, pg->lineage, -1, "over"), "1", 1));
  TD_TRY(td__store_add(pg->sc, lin_key(kb, sizeof kb, pg->lineage, -1, "left_out"), 0, &left));
  TD_TRY(td__store_add(pg->sc, lin_key(kb, sizeof kb, pg->lineage, -1, "spares"), 0, &count));
  int vn = snprintf(v, sizeof v, "0 %lld", (long long)left);
  for (int64_t i = 0; i < count; i++) {
    bool mine = false;
    TD_TRY(claim(pg->sc, pg->lineage, i, &mine));
    if (mine)
      TD_TRY(td__store_set(pg->sc, lin_key(kb, sizeof kb, pg->lineage, i, "gen"), v,
                           (size_t)vn));
  }
  /* every spare that was not admitted has its answer once it acknowledged it: only then may a
   * member leave (the store's host must outlive the answers in flight). A spare on this host
   * whose process exited is not waited for; the others at most the group's timeout. */
  td__host_rec me;
  bool have_me = host_self(pg, &me);
  uint64_t dl = td__deadline_ns(pg->timeout_ms);
  for (int64_t i = 0; i < count; i++) {
    uint8_t *g = NULL;
    bool found = false;
    TD_TRY(td__store_get(pg->sc, lin_key(kb, sizeof kb, pg->lineage, i, "gen"), &g, NULL,
                         &found));
    bool released = found && g && g[0] == '0';
    td__free(g);
    for (int64_t backoff = 1; released;) {
      long r = -1;
      bool gone = false, acked = false;
      TD_TRY(td__store_get(pg->sc, lin_key(kb, sizeof kb, pg->lineage, i, "ack"), NULL, NULL,
                           &acked));
      if (acked) break;
      TD_TRY(offer_read(pg, i, &me, have_me, &r, &gone));
      if (gone || r < 0) break; /* exited, or withdrawn before it wrote its record */
      if (td__now_ns() >= dl) {
        td_log(TD_LOG_WARN, "process group %llu: spare rank %ld did not acknowledge its "
               "release", (unsigned long long)pg->lineage, r);
        break;
      }
      td__pg_sleep_ms(backoff);
      backoff = backoff * 2 > 50 ? 50 : backoff * 2;
    }
  }
  return TD_OK;
}

td_status td_process_group_spares_waiting(td_process_group *pg, int *waiting) {
  TD_CHECK_ARG(pg && waiting, "process_group_spares_waiting: NULL group or out");
  offer_t *o = NULL;
  int k = 0;
  TD_TRY(open_offers(pg, pg->ranks, pg->size, &o, &k));
  td__free(o);
  *waiting = k;
  return TD_OK;
}

bool td_process_group_joined(const td_process_group *pg) { return pg && pg->joined; }
