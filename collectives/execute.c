/* execute.c - one operation on this member: numbering, the choice of algorithm and the
 * dispatch to the backend that runs it.
 *
 * td__pg_execute runs an operation under pg->mu:
 *   1. a broken group refuses (TD_ERR_STATE with the first failure's message);
 *   2. the operation gets the next sequence number and a deadline (the group's timeout);
 *   3. the algorithm is chosen (choose(), below) and its backend's run entry executes it; every
 *      backend checks the members' headers first (ring: with the neighbours; shared memory: with
 *      every member; NCCL: over the host ring);
 *   4. AVG: backends that leave the sum (td__coll_backend.avg_is_sum) leave it identical on every
 *      member, which then divides alike.
 *
 * Algorithm choice for CPU groups of more than one member (choose(); TD_COLL_ALGO overrides, see
 * collectives.h): the shared-memory backend when it serves the group (every member on this
 * host: it decided at creation), else the TCP ring. On shared memory: all_reduce of at most
 * direct_max bytes in one round, larger ones reduce-scatter + all-gather through the round
 * buffers; the single-copy (CMA backend, process_vm_readv) versions where the thresholds below
 * say they win. The chooser reads only what the backends reported at setup (which serve,
 * pg->shm_buf_bytes, pg->shm_crowded), never their internals.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_impl.h"
#include "../core/flight_impl.h"
#include "../core/trace_impl.h"

/* Size thresholds (bytes of the whole buffer, as td_process_group_algorithm counts them), from
 * bench/collectives on a 2-CPU host (figures in docs/ARCHITECTURE.md, "Collectives"):
 *   - all_reduce in one round up to DIRECT_MAX (TD_COLL_SHM_DIRECT_MAX overrides);
 *   - single-copy reads only while every member has a CPU (when members outnumber CPUs the
 *     staged copies were as fast or faster: the copy work is the same and spread more evenly),
 *     and then for all_gather and reduce_scatter from CMA_MIN on, broadcast from CMA_MIN to
 *     CMA_BCAST_MAX and all_reduce above CMA_AR_MIN up to CMA_AR_MAX: beyond those sizes the data
 *     no longer stays in cache and the pipelined copies through the shared buffers, which keep
 *     every member busy at once, beat process_vm_readv (which pins every page it copies). */
#define DIRECT_MAX_DEFAULT ((size_t)64 << 10)
#define CMA_MIN ((size_t)64 << 10)
#define CMA_BCAST_MAX ((size_t)1 << 20)
#define CMA_AR_MIN ((size_t)1 << 20)
#define CMA_AR_MAX ((size_t)16 << 20)
#define CMA_SCATTER_MAX ((size_t)32 << 20)

/* ---- the choice ---- */

static td_status env_bytes(const char *name, size_t dflt, size_t *out) {
  const char *e = getenv(name);
  *out = dflt;
  if (!e || !*e) return TD_OK;
  char *end;
  unsigned long long v = strtoull(e, &end, 10);
  if (*end || e[0] == '-')
    return td_set_error(TD_ERR_INVALID, "process_group_create: %s='%s' is not a byte count", name,
                        e);
  *out = (size_t)v;
  return TD_OK;
}

td_status td__pg_read_mode(td_process_group *pg) {
  const char *e = getenv("TD_COLL_ALGO");
  pg->mode = TD__MODE_AUTO;
  if (e && *e && strcmp(e, "auto") != 0) {
    if (strcmp(e, "ring") == 0) pg->mode = TD__MODE_RING;
    else if (strcmp(e, "shm") == 0) pg->mode = TD__MODE_SHM;
    else if (strcmp(e, "shm_direct") == 0) pg->mode = TD__MODE_SHM_DIRECT;
    else if (strcmp(e, "shm_rsag") == 0) pg->mode = TD__MODE_SHM_RSAG;
    else if (strcmp(e, "cma") == 0) pg->mode = TD__MODE_CMA;
    else
      return td_set_error(TD_ERR_INVALID, "process_group_create: TD_COLL_ALGO='%s' is not one "
                          "of auto, ring, shm, shm_direct, shm_rsag, cma", e);
  }
  return env_bytes("TD_COLL_SHM_DIRECT_MAX", DIRECT_MAX_DEFAULT, &pg->direct_max);
}

/* Whether the single-copy version of kind suits nbytes (see the thresholds above). */
static bool cma_suits(const td_process_group *pg, uint32_t kind, size_t nbytes) {
  if (!pg->tp[TD__TP_CMA] || pg->mode == TD__MODE_SHM_DIRECT || pg->mode == TD__MODE_SHM_RSAG)
    return false;
  if (pg->mode == TD__MODE_CMA) return true;
  if (pg->shm_crowded || nbytes < CMA_MIN) return false;
  switch (kind) {
    case TD__K_ALL_REDUCE: return nbytes > CMA_AR_MIN && nbytes <= CMA_AR_MAX;
    case TD__K_BROADCAST: return nbytes <= CMA_BCAST_MAX;
    case TD__K_REDUCE_SCATTER: return nbytes <= CMA_SCATTER_MAX;
    default: return true;
  }
}

/* whole: reduce_scatter's input is one tensor (the single-copy version needs that). */
static td__algo choose(const td_process_group *pg, uint32_t kind, size_t nbytes, bool whole) {
  if (pg->backend == TD_PG_BACKEND_NCCL && kind != TD__K_BARRIER) return TD__A_NCCL;
  if (pg->size == 1) return TD__A_LOCAL;
  if (!pg->tp[TD__TP_SHM]) return TD__A_RING;
  bool cma = kind != TD__K_BARRIER && cma_suits(pg, kind, nbytes);
  switch (kind) {
    case TD__K_ALL_REDUCE: {
      if (cma) return TD__A_CMA_RSAG;
      if (pg->mode == TD__MODE_SHM_RSAG) return TD__A_SHM_RSAG;
      bool fits = nbytes <= pg->shm_buf_bytes;
      if (pg->mode == TD__MODE_SHM_DIRECT && fits) return TD__A_SHM_DIRECT;
      return fits && nbytes <= pg->direct_max ? TD__A_SHM_DIRECT : TD__A_SHM_RSAG;
    }
    case TD__K_BROADCAST: return cma ? TD__A_CMA_BCAST : TD__A_SHM_BCAST;
    case TD__K_ALL_GATHER: return cma ? TD__A_CMA_GATHER : TD__A_SHM_GATHER;
    case TD__K_REDUCE_SCATTER: return cma && whole ? TD__A_CMA_SCATTER : TD__A_SHM_SCATTER;
    default: return TD__A_SHM_BARRIER;
  }
}

const char *td_process_group_algorithm(const td_process_group *pg, td_pg_op op, size_t nbytes) {
  static const uint32_t kinds[] = {TD__K_ALL_REDUCE, TD__K_BROADCAST, TD__K_ALL_GATHER,
                                   TD__K_REDUCE_SCATTER, TD__K_BARRIER};
  if (!pg || (int)op < 0 || (int)op > (int)TD_PG_OP_BARRIER) return "?";
  return td__algo_name(choose(pg, kinds[op], nbytes, true));
}

/* ---- execution ---- */

/* A one-member group: all_gather and reduce_scatter copy slot 0; the rest is done already. */
static td_status run_local(const td__op *op) {
  size_t nb = op->kind == TD__K_BARRIER ? 0 : td_tensor_nbytes(op->t);
  if (!nb) return TD_OK;
  if (op->kind == TD__K_ALL_GATHER) {
    void *dst = op->list ? td_tensor_data(op->list[0]) : td_tensor_data(op->whole);
    if (dst != td_tensor_data(op->t)) memmove(dst, td_tensor_data(op->t), nb);
  } else if (op->kind == TD__K_REDUCE_SCATTER) {
    const void *src = op->list ? td_tensor_data(op->list[0]) : td_tensor_data(op->whole);
    memmove(td_tensor_data(op->t), src, nb);
  }
  return TD_OK;
}

/* The backend of each algorithm (TD__A_LOCAL: none, the group has one member). */
static const td__tp algo_backend[TD__A_COUNT] = {
    [TD__A_LOCAL] = TD__TP_COUNT,        [TD__A_NCCL] = TD__TP_NCCL,
    [TD__A_RING] = TD__TP_RING,          [TD__A_SHM_DIRECT] = TD__TP_SHM,
    [TD__A_SHM_RSAG] = TD__TP_SHM,       [TD__A_SHM_BCAST] = TD__TP_SHM,
    [TD__A_SHM_GATHER] = TD__TP_SHM,     [TD__A_SHM_SCATTER] = TD__TP_SHM,
    [TD__A_SHM_BARRIER] = TD__TP_SHM,    [TD__A_CMA_RSAG] = TD__TP_CMA,
    [TD__A_CMA_BCAST] = TD__TP_CMA,      [TD__A_CMA_GATHER] = TD__TP_CMA,
    [TD__A_CMA_SCATTER] = TD__TP_CMA};

/* The flight recorder's record of an operation: entered (open while it runs) and left. */
static td__flight_ev flight_ev(const td_process_group *pg, const td__op *op,
                               const td__op_hdr *h) {
  return (td__flight_ev){.kind = TD__FL_COLL_ENTER, .peer = (int32_t)pg->id, .a = h->seq,
                         .b = td__op_bytes(op, pg->size),
                         .c = h->count > UINT32_MAX ? UINT32_MAX : (uint32_t)h->count,
                         .x = (uint8_t)h->dtype, .y = (uint8_t)h->algo};
}

/* A failed operation (its deadline, a dead or mismatched member) asks for a dump while it is
 * still open, so the dump shows it as what this member waits in. */
static void flight_leave(td__flight_ev *ev, td_status st, const char *name) {
  if (st != TD_OK) {
    char what[300];
    snprintf(what, sizeof what, "%s #%llu %s: %s", name, (unsigned long long)ev->a,
             st == TD_ERR_TIMEOUT ? "reached its deadline" : "failed", td_last_error());
    td__flight_deadline(what);
  }
  ev->kind = TD__FL_COLL_EXIT;
  ev->x = (uint8_t)st;
  td__flight_pop(ev, name);
}

static td_status execute(td_process_group *pg, const td__op *op, td__algo *chosen) {
  const char *name = td__kind_name(op->kind);
  pthread_mutex_lock(&pg->mu);
  td_status st = TD_OK;
  td__flight_ev fl = {0};
  uint64_t t0 = 0;
  if (pg->broken) {
    st = td_set_error(TD_ERR_STATE, "%s: process group %llu is broken by an earlier failure: %s",
                      name, (unsigned long long)pg->id, pg->broken_msg ? pg->broken_msg : "");
    goto out;
  }
  uint64_t dl = td__pg_deadline(pg);
  td__algo a = choose(pg, op->kind, td__op_bytes(op, pg->size), op->whole != NULL);
  *chosen = a;
  td__op_hdr h;
  td__op_header(op, ++pg->seq, a, &h);
  fl = flight_ev(pg, op, &h);
  td__flight_push(&fl, name);
  t0 = td__now_ns();
  if (a == TD__A_LOCAL) {
    st = run_local(op);
    goto out;
  }
  const td__coll_backend *be = pg->tp[algo_backend[a]];
  if (!be) {
    st = a == TD__A_NCCL
             ? td_set_error(TD_ERR_UNSUPPORTED, "%s: no NCCL in this build", name)
             : td_set_error(TD_ERR_INTERNAL, "%s: algorithm %s chosen without its backend", name,
                            td__algo_name(a));
    goto out;
  }
  st = be->run(pg, op, &h, dl);
  if (st == TD_OK && be->avg_is_sum && op->rop == TD_REDUCE_AVG &&
      (op->kind == TD__K_ALL_REDUCE || op->kind == TD__K_REDUCE_SCATTER))
    td__divide(td_tensor_data(op->t), h.count, (td_dtype)h.dtype, pg->size);
out:
  if (t0) td__flight_count_coll(td__now_ns() - t0); /* --summary's straggler scores */
  if (fl.kind) flight_leave(&fl, st, name);
  pthread_mutex_unlock(&pg->mu);
  return st;
}

/* Each operation as one span in traces (category "collective"), with its group, size and
 * algorithm. */
td_status td__pg_execute(td_process_group *pg, const td__op *op) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td__algo a = TD__A_COUNT;
  td_status st = execute(pg, op, &a);
  if (t0) {
    char args[200];
    snprintf(args, sizeof args, "{\"group\":%llu,\"bytes\":%zu,\"algorithm\":\"%s\","
             "\"ok\":%s}", (unsigned long long)pg->id, td__op_bytes(op, pg->size),
             td__algo_name(a), st == TD_OK ? "true" : "false");
    td__trace_complete("collective", td__kind_name(op->kind), t0, td__now_ns(), args);
  }
  return st;
}
