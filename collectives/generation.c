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
 * Lock order: pg->lost_mu is a leaf; nothing here takes pg->mu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../core/flight_impl.h"
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

/* The decider: waits for every old member's verdict, then publishes the membership. */
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
  int64_t id = 0;
  td_status st = td__store_add(pg->sc, "pg/next_id", 1, &id);
  size_t cap = 32 + (size_t)pg->size * 12, len = 0;
  char *rec = st == TD_OK ? td__malloc(cap) : NULL;
  if (st == TD_OK && !rec) st = td_set_error(TD_ERR_NOMEM, "process_group_reform: out of memory");
  if (st == TD_OK) {
    len = (size_t)snprintf(rec, cap, "%lld", (long long)id);
    for (int m = 0; m < pg->size; m++)
      if (verdict[m] == 1) len += (size_t)snprintf(rec + len, cap - len, " %d", pg->ranks[m]);
    char key[160];
    st = td__store_set(pg->sc, ft_key(pg, gen, "members", key, sizeof key), rec, len);
  }
  td__free(rec);
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
