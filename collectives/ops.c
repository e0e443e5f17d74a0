/* ops.c - the public collective operations: argument checks, the synchronous and asynchronous
 * entry points, the choice of algorithm and the dispatch to a backend.
 *
 * Every call checks its tensors on the calling thread (an error there is returned at once and
 * nothing is queued), describes itself as a td__op and hands it to work.c, which runs it in call
 * order with the group's other operations: on the calling thread when nothing else is queued or
 * running, else on the group's worker thread. td__pg_execute then runs it under pg->mu:
 *   1. a broken group refuses (TD_ERR_STATE with the first failure's message);
 *   2. the operation gets the next sequence number and a deadline (the group's timeout);
 *   3. the algorithm is chosen (choose(), below) and run; each checks the members' headers first
 *      (ring: with the neighbours; shared memory: with every member).
 *
 * Algorithm choice for CPU groups of more than one member (choose(); TD_COLL_ALGO overrides, see
 * collectives.h): the shared-memory transport when every member runs on this host (td__shm_setup
 * decided it at creation), else the TCP ring. On shared memory: all_reduce of at most direct_max
 * bytes in one round, larger ones reduce-scatter + all-gather through the round buffers; the
 * single-copy (process_vm_readv) versions where the thresholds below say they win.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_impl.h"
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

/* ---- names ---- */

const char *td__kind_name(uint32_t k) {
  switch (k) {
    case TD__K_ALL_REDUCE: return "all_reduce";
    case TD__K_BROADCAST: return "broadcast";
    case TD__K_ALL_GATHER: return "all_gather";
    case TD__K_REDUCE_SCATTER: return "reduce_scatter";
    case TD__K_BARRIER: return "barrier";
    default: return "?";
  }
}

static const char *rop_name(int op) {
  return op == TD_REDUCE_SUM ? "sum" : op == TD_REDUCE_AVG ? "avg" : op == TD_REDUCE_MAX ? "max"
                                                                                         : "?";
}

void td__op_describe(const td__op_hdr *h, char *buf, size_t n) {
  const char *dt =
      h->dtype >= 0 && h->dtype < TD_DTYPE_COUNT ? td_dtype_name((td_dtype)h->dtype) : "?";
  unsigned long long seq = (unsigned long long)h->seq, cnt = (unsigned long long)h->count;
  if (h->kind == TD__K_BARRIER) snprintf(buf, n, "barrier (#%llu)", seq);
  else if (h->kind == TD__K_BROADCAST)
    snprintf(buf, n, "broadcast(root %d, %s x %llu) (#%llu)", h->arg, dt, cnt, seq);
  else if (h->kind == TD__K_ALL_GATHER)
    snprintf(buf, n, "all_gather(%s x %llu) (#%llu)", dt, cnt, seq);
  else
    snprintf(buf, n, "%s(%s, %s x %llu) (#%llu)", td__kind_name(h->kind), rop_name(h->arg), dt,
             cnt, seq);
}

static const char *algo_name(uint32_t a);

td_status td__op_mismatch(td_process_group *pg, const td__op_hdr *mine, int other,
                          const td__op_hdr *theirs) {
  char a[160], b[160], me[160], who[160], msg[800];
  td__op_describe(mine, a, sizeof a);
  if (theirs->magic != TD__OP_MAGIC) snprintf(b, sizeof b, "something unreadable");
  else td__op_describe(theirs, b, sizeof b);
  td__pg_who(pg, pg->rank, me, sizeof me);
  td__pg_who(pg, other, who, sizeof who);
  if (theirs->magic == TD__OP_MAGIC && strcmp(a, b) == 0 && mine->algo != theirs->algo)
    snprintf(msg, sizeof msg, "mismatched collectives: %s runs %s with algorithm %s but %s with "
             "%s (set TD_COLL_ALGO and TD_COLL_SHM_DIRECT_MAX alike on every member)", me, a,
             algo_name(mine->algo), who, algo_name(theirs->algo));
  else
    snprintf(msg, sizeof msg, "mismatched collectives: %s called %s but %s called %s", me, a, who,
             b);
  return td__pg_fail(pg, TD_ERR_STATE, msg);
}

/* ---- the algorithm ---- */

typedef enum algo {
  A_LOCAL,
  A_NCCL,
  A_RING,
  A_SHM_DIRECT,
  A_SHM_RSAG,
  A_SHM_BCAST,
  A_SHM_GATHER,
  A_SHM_SCATTER,
  A_SHM_BARRIER,
  A_CMA_RSAG,
  A_CMA_BCAST,
  A_CMA_GATHER,
  A_CMA_SCATTER,
} algo;

static const char *algo_names[] = {"local",      "nccl",        "ring",       "shm_direct",
                                   "shm_rsag",   "shm_bcast",   "shm_gather", "shm_scatter",
                                   "shm_barrier", "cma_rsag",   "cma_bcast",  "cma_gather",
                                   "cma_scatter"};

static const char *algo_name(uint32_t a) {
  return a < sizeof algo_names / sizeof *algo_names ? algo_names[a] : "?";
}

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
  if (!td__shm_cma(pg->shm) || pg->mode == TD__MODE_SHM_DIRECT || pg->mode == TD__MODE_SHM_RSAG)
    return false;
  if (pg->mode == TD__MODE_CMA) return true;
  if (td__shm_crowded(pg->shm) || nbytes < CMA_MIN) return false;
  switch (kind) {
    case TD__K_ALL_REDUCE: return nbytes > CMA_AR_MIN && nbytes <= CMA_AR_MAX;
    case TD__K_BROADCAST: return nbytes <= CMA_BCAST_MAX;
    case TD__K_REDUCE_SCATTER: return nbytes <= CMA_SCATTER_MAX;
    default: return true;
  }
}

/* whole: reduce_scatter's input is one tensor (the single-copy version needs that). */
static algo choose(const td_process_group *pg, uint32_t kind, size_t nbytes, bool whole) {
  if (pg->backend == TD_PG_BACKEND_NCCL && kind != TD__K_BARRIER) return A_NCCL;
  if (pg->size == 1) return A_LOCAL;
  if (!pg->shm) return A_RING;
  bool cma = kind != TD__K_BARRIER && cma_suits(pg, kind, nbytes);
  switch (kind) {
    case TD__K_ALL_REDUCE: {
      if (cma) return A_CMA_RSAG;
      if (pg->mode == TD__MODE_SHM_RSAG) return A_SHM_RSAG;
      bool fits = nbytes <= td__shm_buf_bytes(pg->shm);
      if (pg->mode == TD__MODE_SHM_DIRECT && fits) return A_SHM_DIRECT;
      return fits && nbytes <= pg->direct_max ? A_SHM_DIRECT : A_SHM_RSAG;
    }
    case TD__K_BROADCAST: return cma ? A_CMA_BCAST : A_SHM_BCAST;
    case TD__K_ALL_GATHER: return cma ? A_CMA_GATHER : A_SHM_GATHER;
    case TD__K_REDUCE_SCATTER: return cma && whole ? A_CMA_SCATTER : A_SHM_SCATTER;
    default: return A_SHM_BARRIER;
  }
}

const char *td_process_group_algorithm(const td_process_group *pg, td_pg_op op, size_t nbytes) {
  static const uint32_t kinds[] = {TD__K_ALL_REDUCE, TD__K_BROADCAST, TD__K_ALL_GATHER,
                                   TD__K_REDUCE_SCATTER, TD__K_BARRIER};
  if (!pg || (int)op < 0 || (int)op > (int)TD_PG_OP_BARRIER) return "?";
  return algo_names[choose(pg, kinds[op], nbytes, true)];
}

/* ---- execution (pg->mu held) ---- */

/* The element count the header announces, and the whole buffer's size in bytes. */
static uint64_t hdr_count(const td__op *op) {
  return op->kind == TD__K_BARRIER ? 1 : (uint64_t)td_tensor_numel(op->t);
}

static size_t op_bytes(const td_process_group *pg, const td__op *op) {
  if (op->kind == TD__K_BARRIER) return 0;
  size_t nb = td_tensor_nbytes(op->t);
  return op->kind == TD__K_ALL_GATHER || op->kind == TD__K_REDUCE_SCATTER ? nb * (size_t)pg->size
                                                                         : nb;
}

/* The all_gather output slots: group rank i's part. */
static td_status gather_slots(td_process_group *pg, const td__op *op, td__chunk **out) {
  td__chunk *ch = td__malloc((size_t)pg->size * sizeof *ch);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "all_gather: out of memory");
  size_t nb = td_tensor_nbytes(op->t);
  for (int i = 0; i < pg->size; i++)
    ch[i] = (td__chunk){op->list ? td_tensor_data(op->list[i])
                                 : (char *)td_tensor_data(op->whole) + (size_t)i * nb, nb};
  *out = ch;
  return TD_OK;
}

/* The reduce_scatter input slots: slot i goes to group rank i. */
static td_status scatter_slots(td_process_group *pg, const td__op *op, const char ***out) {
  const char **p = td__malloc((size_t)pg->size * sizeof *p);
  if (!p) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  size_t nb = td_tensor_nbytes(op->t);
  for (int i = 0; i < pg->size; i++)
    p[i] = op->list ? td_tensor_data(op->list[i])
                    : (const char *)td_tensor_data(op->whole) + (size_t)i * nb;
  *out = p;
  return TD_OK;
}

static td_status run_ring(td_process_group *pg, const td__op *op, const td__op_hdr *h,
                          uint64_t dl) {
  TD_TRY(td__ring_check(pg, h, dl));
  td_dtype dt = (td_dtype)h->dtype;
  switch (op->kind) {
    case TD__K_ALL_REDUCE:
      return td__ring_all_reduce(pg, td_tensor_data(op->t), h->count, dt, op->rop, dl);
    case TD__K_BROADCAST:
      return td__ring_broadcast(pg, td_tensor_data(op->t), td_tensor_nbytes(op->t), op->root, dl);
    case TD__K_ALL_GATHER: {
      td__chunk *ch = NULL;
      TD_TRY(gather_slots(pg, op, &ch));
      const char *src = td_tensor_data(op->t); /* the ring starts from our own slot */
      if (ch[pg->rank].nbytes && ch[pg->rank].p != src)
        memmove(ch[pg->rank].p, src, ch[pg->rank].nbytes);
      td_status st = td__ring_all_gather(pg, ch, dl);
      td__free(ch);
      return st;
    }
    case TD__K_REDUCE_SCATTER: {
      const char **ins = NULL;
      TD_TRY(scatter_slots(pg, op, &ins));
      td_status st = td__ring_reduce_scatter(pg, td_tensor_data(op->t), ins, h->count, dt,
                                             op->rop, dl);
      td__free(ins);
      return st;
    }
    default: return td__ring_barrier(pg, dl);
  }
}

static td_status run_shm(td_process_group *pg, const td__op *op, const td__op_hdr *h, algo a,
                         uint64_t dl) {
  td_dtype dt = (td_dtype)h->dtype;
  void *data = op->kind == TD__K_BARRIER ? NULL : td_tensor_data(op->t);
  switch (a) {
    case A_SHM_DIRECT:
    case A_SHM_RSAG:
      return td__shm_all_reduce(pg, h, data, h->count, dt, op->rop, a == A_SHM_DIRECT, dl);
    case A_CMA_RSAG: return td__cma_all_reduce(pg, h, data, h->count, dt, op->rop, dl);
    case A_SHM_BCAST:
      return td__shm_broadcast(pg, h, data, td_tensor_nbytes(op->t), op->root, dl);
    case A_CMA_BCAST:
      return td__cma_broadcast(pg, h, data, td_tensor_nbytes(op->t), op->root, dl);
    case A_SHM_GATHER:
    case A_CMA_GATHER: {
      td__chunk *ch = NULL;
      TD_TRY(gather_slots(pg, op, &ch));
      size_t nb = td_tensor_nbytes(op->t);
      td_status st = a == A_CMA_GATHER ? td__cma_all_gather(pg, h, ch, data, nb, dl)
                                       : td__shm_all_gather(pg, h, ch, data, nb, dl);
      td__free(ch);
      return st;
    }
    case A_CMA_SCATTER:
      return td__cma_reduce_scatter(pg, h, data, td_tensor_data(op->whole), h->count, dt, op->rop,
                                    dl);
    case A_SHM_SCATTER: {
      const char **ins = NULL;
      TD_TRY(scatter_slots(pg, op, &ins));
      td_status st = td__shm_reduce_scatter(pg, h, data, ins, h->count, dt, op->rop, dl);
      td__free(ins);
      return st;
    }
    default: return td__shm_barrier(pg, h, dl);
  }
}

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

#ifdef TD_HAVE_NCCL
/* NCCL works on single buffers: the list forms go through a temporary. */
static td_status run_nccl(td_process_group *pg, const td__op *op) {
  td_dtype dt = td_tensor_dtype(op->t);
  int64_t numel = td_tensor_numel(op->t);
  switch (op->kind) {
    case TD__K_ALL_REDUCE: return td__nccl_all_reduce(pg, op->t, op->rop);
    case TD__K_BROADCAST: return td__nccl_broadcast(pg, op->t, op->root);
    case TD__K_ALL_GATHER: {
      if (op->whole)
        return td__nccl_all_gather(pg, td_tensor_data(op->whole), td_tensor_data(op->t),
                                   (size_t)numel, dt);
      int64_t shape[1] = {numel * pg->size};
      td_tensor *tmp = NULL;
      TD_TRY(td_tensor_empty(shape, 1, dt, td_tensor_device(op->t), &tmp));
      td_status st = td__nccl_all_gather(pg, td_tensor_data(tmp), td_tensor_data(op->t),
                                         (size_t)numel, dt);
      for (int i = 0; st == TD_OK && i < pg->size; i++) {
        td_tensor *v = NULL, *v2 = NULL;
        st = td_tensor_narrow(tmp, 0, numel * i, numel, &v);
        if (st == TD_OK)
          st = td_tensor_reshape(v, td_tensor_shape(op->list[i]), td_tensor_ndim(op->list[i]),
                                 &v2);
        if (st == TD_OK) st = td_tensor_copy_(op->list[i], v2);
        td_tensor_unref(v);
        td_tensor_unref(v2);
      }
      td_tensor_unref(tmp);
      return st;
    }
    case TD__K_REDUCE_SCATTER: {
      if (op->whole)
        return td__nccl_reduce_scatter(pg, td_tensor_data(op->t), td_tensor_data(op->whole),
                                       (size_t)numel, dt, op->rop);
      td_tensor **flat = td__calloc((size_t)pg->size, sizeof *flat), *cat = NULL;
      if (!flat) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
      int64_t shape[1] = {-1};
      td_status st = TD_OK;
      for (int i = 0; st == TD_OK && i < pg->size; i++)
        st = td_tensor_reshape(op->list[i], shape, 1, &flat[i]);
      if (st == TD_OK) st = td_tensor_cat(flat, pg->size, 0, &cat);
      if (st == TD_OK)
        st = td__nccl_reduce_scatter(pg, td_tensor_data(op->t), td_tensor_data(cat),
                                     (size_t)numel, dt, op->rop);
      for (int i = 0; i < pg->size; i++) td_tensor_unref(flat[i]);
      td__free(flat);
      td_tensor_unref(cat);
      return st;
    }
    default: return TD_OK;
  }
}
#endif

static td_status execute(td_process_group *pg, const td__op *op);

/* Each operation as one span in traces (category "collective"), with its group, size and
 * algorithm. */
td_status td__pg_execute(td_process_group *pg, const td__op *op) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td_status st = execute(pg, op);
  if (t0) {
    char args[200];
    snprintf(args, sizeof args, "{\"group\":%llu,\"bytes\":%zu,\"algorithm\":\"%s\","
             "\"ok\":%s}", (unsigned long long)pg->id, op_bytes(pg, op), algo_names[choose(pg, op->kind, op_bytes(pg, op), op->whole != NULL)],
             st == TD_OK ? "true" : "false");
    td__trace_complete("collective", td__kind_name(op->kind), t0, td__now_ns(), args);
  }
  return st;
}

static td_status execute(td_process_group *pg, const td__op *op) {
  const char *name = td__kind_name(op->kind);
  pthread_mutex_lock(&pg->mu);
  td_status st = TD_OK;
  if (pg->broken) {
    st = td_set_error(TD_ERR_STATE, "%s: process group %llu is broken by an earlier failure: %s",
                      name, (unsigned long long)pg->id, pg->broken_msg ? pg->broken_msg : "");
    goto out;
  }
  uint64_t dl = td__pg_deadline(pg);
  td__op_hdr h = {TD__OP_MAGIC, op->kind, ++pg->seq, hdr_count(op),
                  op->kind == TD__K_BARRIER ? (int32_t)TD_DTYPE_F32 : (int32_t)td_tensor_dtype(op->t),
                  op->kind == TD__K_BROADCAST ? op->root : (int32_t)op->rop, 0, 0};
  if (op->kind == TD__K_BARRIER || op->kind == TD__K_ALL_GATHER) h.arg = 0;
  algo a = choose(pg, op->kind, op_bytes(pg, op), op->whole != NULL);
  h.algo = (uint32_t)a;
  switch (a) {
    case A_LOCAL: st = run_local(op); break;
#ifdef TD_HAVE_NCCL
    case A_NCCL:
      /* NCCL groups check the header on the host-side ring too: NCCL itself would read past a
       * smaller buffer or hang on a mismatch */
      st = pg->size > 1 ? td__ring_check(pg, &h, dl) : TD_OK;
      if (st == TD_OK) st = run_nccl(pg, op);
      break;
#else
    case A_NCCL: st = td_set_error(TD_ERR_UNSUPPORTED, "%s: no NCCL in this build", name); break;
#endif
    case A_RING: st = run_ring(pg, op, &h, dl); break;
    default: st = run_shm(pg, op, &h, a, dl); break;
  }
  /* AVG: every CPU algorithm leaves the sum, identical on every member; divide alike */
  if (st == TD_OK && a != A_NCCL && op->rop == TD_REDUCE_AVG &&
      (op->kind == TD__K_ALL_REDUCE || op->kind == TD__K_REDUCE_SCATTER))
    td__divide(td_tensor_data(op->t), h.count, (td_dtype)h.dtype, pg->size);
out:
  pthread_mutex_unlock(&pg->mu);
  return st;
}

/* ---- argument checks (calling thread) ---- */

static td_status check_tensor(const td_process_group *pg, const td_tensor *t, const char *name,
                              const char *what) {
  if (!t) return td_set_error(TD_ERR_INVALID, "%s: NULL %s", name, what);
  if (!td_tensor_is_contiguous(t))
    return td_set_error(TD_ERR_INVALID, "%s: %s must be contiguous", name, what);
  td_device d = td_tensor_device(t);
  char db[32];
  if (pg->backend == TD_PG_BACKEND_CPU && d.type != TD_DEVICE_CPU)
    return td_set_error(TD_ERR_DEVICE, "%s: %s is on %s; this group's backend (cpu) takes CPU "
                        "tensors (create the group with TD_PG_BACKEND_NCCL for CUDA)", name, what,
                        td_device_str(d, db, sizeof db));
  if (pg->backend == TD_PG_BACKEND_NCCL) {
#ifdef TD_HAVE_NCCL
    if (d.type != TD_DEVICE_CUDA || d.index != td__nccl_device(pg->nccl))
      return td_set_error(TD_ERR_DEVICE, "%s: %s is on %s; this NCCL group works on cuda:%d",
                          name, what, td_device_str(d, db, sizeof db), td__nccl_device(pg->nccl));
#endif
  }
  return TD_OK;
}

static td_status check_same(const td_tensor *ref, const td_tensor *t, const char *name,
                            const char *what, int64_t numel) {
  if (td_tensor_dtype(t) != td_tensor_dtype(ref))
    return td_set_error(TD_ERR_DTYPE, "%s: %s is %s, expected %s", name, what,
                        td_dtype_name(td_tensor_dtype(t)), td_dtype_name(td_tensor_dtype(ref)));
  if (td_tensor_numel(t) != numel)
    return td_set_error(TD_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", name, what,
                        (long long)td_tensor_numel(t), (long long)numel);
  return TD_OK;
}

static td_status check_op(td_reduce_op op, td_dtype dt, const char *name) {
  if (op != TD_REDUCE_SUM && op != TD_REDUCE_AVG && op != TD_REDUCE_MAX)
    return td_set_error(TD_ERR_INVALID, "%s: unknown reduce op %d", name, (int)op);
  if (op == TD_REDUCE_AVG && dt == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s: avg needs a float dtype, got int64", name);
  if (dt > TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s: cannot reduce %s (a transport-only dtype: "
                        "broadcast and all_gather carry it)", name, td_dtype_name(dt));
  return TD_OK;
}

/* Checks a list of size tensors against ref (same dtype, numel elements each). */
static td_status check_list(const td_process_group *pg, td_tensor *const *list,
                            const td_tensor *ref, const char *name, const char *lname) {
  char what[32];
  for (int i = 0; i < pg->size; i++) {
    snprintf(what, sizeof what, "%s[%d]", lname, i);
    TD_TRY(check_tensor(pg, list[i], name, what));
    TD_TRY(check_same(ref, list[i], name, what, td_tensor_numel(ref)));
  }
  return TD_OK;
}

/* ---- public entry points: out == NULL runs synchronously ---- */

static td_status all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg, "all_reduce: NULL group");
  TD_TRY(check_tensor(pg, t, "all_reduce", "tensor"));
  TD_TRY(check_op(op, td_tensor_dtype(t), "all_reduce"));
  td__op o = {.kind = TD__K_ALL_REDUCE, .rop = op, .t = t};
  return td__work_run(pg, &o, out);
}

static td_status broadcast(td_process_group *pg, td_tensor *t, int root, td_future **out) {
  TD_CHECK_ARG(pg, "broadcast: NULL group");
  TD_TRY(check_tensor(pg, t, "broadcast", "tensor"));
  TD_CHECK_ARG(root >= 0 && root < pg->size, "broadcast: root %d outside the group of %d", root,
               pg->size);
  td__op o = {.kind = TD__K_BROADCAST, .root = root, .t = t};
  return td__work_run(pg, &o, out);
}

static td_status all_gather(td_process_group *pg, td_tensor *const *outs, const td_tensor *in,
                            td_future **out) {
  TD_CHECK_ARG(pg && outs, "all_gather: NULL group or outs");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  TD_TRY(check_list(pg, outs, in, "all_gather", "outs"));
  td__op o = {.kind = TD__K_ALL_GATHER, .t = (td_tensor *)in, .list = (td_tensor **)outs};
  return td__work_run(pg, &o, out);
}

static td_status all_gather_into(td_process_group *pg, td_tensor *whole, const td_tensor *in,
                                 td_future **out) {
  TD_CHECK_ARG(pg, "all_gather: NULL group");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  TD_TRY(check_tensor(pg, whole, "all_gather", "output"));
  TD_TRY(check_same(in, whole, "all_gather", "output", td_tensor_numel(in) * pg->size));
  td__op o = {.kind = TD__K_ALL_GATHER, .t = (td_tensor *)in, .whole = whole};
  return td__work_run(pg, &o, out);
}

static td_status reduce_scatter(td_process_group *pg, td_tensor *res, td_tensor *const *ins,
                                td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg && ins, "reduce_scatter: NULL group or ins");
  TD_TRY(check_tensor(pg, res, "reduce_scatter", "output"));
  TD_TRY(check_op(op, td_tensor_dtype(res), "reduce_scatter"));
  TD_TRY(check_list(pg, ins, res, "reduce_scatter", "ins"));
  td__op o = {.kind = TD__K_REDUCE_SCATTER, .rop = op, .t = res, .list = (td_tensor **)ins};
  return td__work_run(pg, &o, out);
}

static td_status reduce_scatter_tensor(td_process_group *pg, td_tensor *res, const td_tensor *in,
                                       td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg, "reduce_scatter: NULL group");
  TD_TRY(check_tensor(pg, res, "reduce_scatter", "output"));
  TD_TRY(check_tensor(pg, in, "reduce_scatter", "input"));
  TD_TRY(check_op(op, td_tensor_dtype(res), "reduce_scatter"));
  TD_TRY(check_same(res, in, "reduce_scatter", "input", td_tensor_numel(res) * pg->size));
  td__op o = {.kind = TD__K_REDUCE_SCATTER, .rop = op, .t = res, .whole = (td_tensor *)in};
  return td__work_run(pg, &o, out);
}

static td_status barrier(td_process_group *pg, td_future **out) {
  TD_CHECK_ARG(pg, "barrier: NULL group");
  td__op o = {.kind = TD__K_BARRIER};
  return td__work_run(pg, &o, out);
}

td_status td_process_group_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op) {
  return all_reduce(pg, t, op, NULL);
}
td_status td_process_group_broadcast(td_process_group *pg, td_tensor *t, int root) {
  return broadcast(pg, t, root, NULL);
}
td_status td_process_group_all_gather(td_process_group *pg, td_tensor *const *outs,
                                      const td_tensor *in) {
  return all_gather(pg, outs, in, NULL);
}
td_status td_process_group_all_gather_into_tensor(td_process_group *pg, td_tensor *out,
                                                  const td_tensor *in) {
  return all_gather_into(pg, out, in, NULL);
}
td_status td_process_group_reduce_scatter(td_process_group *pg, td_tensor *out,
                                          td_tensor *const *ins, td_reduce_op op) {
  return reduce_scatter(pg, out, ins, op, NULL);
}
td_status td_process_group_reduce_scatter_tensor(td_process_group *pg, td_tensor *out,
                                                 const td_tensor *in, td_reduce_op op) {
  return reduce_scatter_tensor(pg, out, in, op, NULL);
}
td_status td_process_group_barrier(td_process_group *pg) { return barrier(pg, NULL); }

#define CHECK_OUT(name) TD_CHECK_ARG(out, name "_async: NULL out")

td_status td_process_group_all_reduce_async(td_process_group *pg, td_tensor *t, td_reduce_op op,
                                            td_future **out) {
  CHECK_OUT("all_reduce");
  return all_reduce(pg, t, op, out);
}
td_status td_process_group_broadcast_async(td_process_group *pg, td_tensor *t, int root,
                                           td_future **out) {
  CHECK_OUT("broadcast");
  return broadcast(pg, t, root, out);
}
td_status td_process_group_all_gather_async(td_process_group *pg, td_tensor *const *outs,
                                            const td_tensor *in, td_future **out) {
  CHECK_OUT("all_gather");
  return all_gather(pg, outs, in, out);
}
td_status td_process_group_all_gather_into_tensor_async(td_process_group *pg, td_tensor *whole,
                                                        const td_tensor *in, td_future **out) {
  CHECK_OUT("all_gather_into_tensor");
  return all_gather_into(pg, whole, in, out);
}
td_status td_process_group_reduce_scatter_async(td_process_group *pg, td_tensor *res,
                                                td_tensor *const *ins, td_reduce_op op,
                                                td_future **out) {
  CHECK_OUT("reduce_scatter");
  return reduce_scatter(pg, res, ins, op, out);
}
td_status td_process_group_reduce_scatter_tensor_async(td_process_group *pg, td_tensor *res,
                                                       const td_tensor *in, td_reduce_op op,
                                                       td_future **out) {
  CHECK_OUT("reduce_scatter_tensor");
  return reduce_scatter_tensor(pg, res, in, op, out);
}
td_status td_process_group_barrier_async(td_process_group *pg, td_future **out) {
  CHECK_OUT("barrier");
  return barrier(pg, out);
}
