/* ring.c - the collective operations: argument checks, the per-operation header check, and the
 * CPU ring algorithms (the NCCL backend is dispatched to for TD_PG_BACKEND_NCCL groups).
 *
 * Every operation (CPU and NCCL groups alike) starts with a header exchange: each member sends
 * {kind, sequence number, element count, dtype, reduce op or root} to its right neighbour and
 * compares what its left neighbour sent. Around the ring this checks that all members run the
 * same operation on compatible tensors; a mismatch fails the group with TD_ERR_STATE describing
 * both calls (instead of exchanging garbage, or NCCL reading past a buffer, or hanging). The header is also what makes a barrier a barrier.
 *
 * Algorithms (n members, member r; chunk i of a tensor is its i-th of n nearly equal parts):
 *   - reduce-scatter: n-1 steps; at step s member r sends chunk (r - s + shift) and receives
 *     chunk (r - s - 1 + shift), which it reduces into its own copy; afterwards member r holds
 *     the full reduction of chunk (r + 1 + shift). Chunks are exchanged in segments of
 *     SEG_BYTES so the receive buffer stays small.
 *   - all-gather: n-1 steps; member r starts with chunk (r + shift) and at step s sends chunk
 *     (r - s + shift) and receives chunk (r - s - 1 + shift) in place.
 *   - all_reduce = reduce-scatter (shift 0) + all-gather (shift 1); AVG divides at the end, on
 *     every member alike, so results are bit-identical everywhere.
 *   - reduce_scatter = reduce-scatter with shift -1 on a working copy (member r ends with slot r).
 *   - broadcast: pipelined along the ring from the root in segments: the member at distance d
 *     from the root receives segment j at step j + d - 1 and forwards it at step j + d.
 *   - barrier: an all-gather of one byte per member after the header.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"

#define SEG_BYTES ((size_t)1 << 20)
#define OP_MAGIC 0x54444f50u /* "TDOP" */

enum { K_ALL_REDUCE = 1, K_BROADCAST, K_ALL_GATHER, K_REDUCE_SCATTER, K_BARRIER };

typedef struct op_hdr {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  uint64_t count;
  int32_t dtype;
  int32_t arg; /* reduce op, or the root of a broadcast */
} op_hdr;

typedef struct chunk {
  char *p;
  size_t nbytes;
} chunk;

static const char *kind_name(uint32_t k) {
  switch (k) {
    case K_ALL_REDUCE: return "all_reduce";
    case K_BROADCAST: return "broadcast";
    case K_ALL_GATHER: return "all_gather";
    case K_REDUCE_SCATTER: return "reduce_scatter";
    case K_BARRIER: return "barrier";
    default: return "?";
  }
}

static const char *op_name(int op) {
  return op == TD_REDUCE_SUM ? "sum" : op == TD_REDUCE_AVG ? "avg" : op == TD_REDUCE_MAX ? "max"
                                                                                         : "?";
}

static void describe(const op_hdr *h, char *buf, size_t n) {
  const char *dt = h->dtype >= 0 && h->dtype <= 2 ? td_dtype_name((td_dtype)h->dtype) : "?";
  if (h->kind == K_BARRIER) snprintf(buf, n, "barrier (#%llu)", (unsigned long long)h->seq);
  else if (h->kind == K_BROADCAST)
    snprintf(buf, n, "broadcast(root %d, %s x %llu) (#%llu)", h->arg, dt,
             (unsigned long long)h->count, (unsigned long long)h->seq);
  else if (h->kind == K_ALL_GATHER)
    snprintf(buf, n, "all_gather(%s x %llu) (#%llu)", dt, (unsigned long long)h->count,
             (unsigned long long)h->seq);
  else
    snprintf(buf, n, "%s(%s, %s x %llu) (#%llu)", kind_name(h->kind), op_name(h->arg), dt,
             (unsigned long long)h->count, (unsigned long long)h->seq);
}

static int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

/* ---- element kernels ---- */

static void reduce_into(void *dst, const void *src, size_t n, td_dtype dt, td_reduce_op op) {
  bool mx = op == TD_REDUCE_MAX;
#define RED(T)                                                      \
  do {                                                              \
    T *d = dst;                                                     \
    const T *s = src;                                               \
    if (mx) {                                                       \
      for (size_t i = 0; i < n; i++)                                \
        if (s[i] > d[i] || s[i] != s[i]) d[i] = s[i];               \
    } else {                                                        \
      for (size_t i = 0; i < n; i++) d[i] += s[i];                  \
    }                                                               \
  } while (0)
  switch (dt) {
    case TD_DTYPE_F32: RED(float); break;
    case TD_DTYPE_F64: RED(double); break;
    case TD_DTYPE_I64: RED(int64_t); break;
  }
#undef RED
}

static void divide(void *p, size_t n, td_dtype dt, int by) {
  if (dt == TD_DTYPE_F32) {
    float *x = p;
    for (size_t i = 0; i < n; i++) x[i] /= (float)by;
  } else if (dt == TD_DTYPE_F64) {
    double *x = p;
    for (size_t i = 0; i < n; i++) x[i] /= (double)by;
  }
}

/* ---- checks and the header ---- */

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
  return TD_OK;
}

/* Locks pg and starts an operation: refuses a broken group, then (CPU, size > 1) checks the
 * neighbours' headers. On failure pg->mu is released. */
static td_status begin(td_process_group *pg, uint32_t kind, uint64_t count, td_dtype dt, int arg,
                       uint64_t *deadline) {
  pthread_mutex_lock(&pg->mu);
  const char *name = kind_name(kind);
  if (pg->broken) {
    td_status st = td_set_error(TD_ERR_STATE, "%s: process group %llu is broken by an earlier "
                                "failure: %s", name, (unsigned long long)pg->id,
                                pg->broken_msg ? pg->broken_msg : "");
    pthread_mutex_unlock(&pg->mu);
    return st;
  }
  *deadline = td__pg_deadline(pg);
  op_hdr mine = {OP_MAGIC, kind, ++pg->seq, count, (int32_t)dt, arg}, theirs;
  /* NCCL groups check the header too (NCCL itself would read past a smaller buffer or hang on a
   * mismatch); their barriers run on this host-side ring, ordering host threads (not streams) */
  if (pg->size == 1) return TD_OK;
  td_status st = td__pg_xchg(pg, &mine, sizeof mine, &theirs, sizeof theirs, *deadline, name);
  if (st == TD_OK && memcmp(&mine, &theirs, sizeof mine) != 0) {
    char a[128], b[128], who[160], msg[600];
    describe(&mine, a, sizeof a);
    if (theirs.magic == OP_MAGIC) describe(&theirs, b, sizeof b);
    else snprintf(b, sizeof b, "something unreadable");
    snprintf(msg, sizeof msg, "mismatched collectives: %s called %s but %s called %s",
             td__pg_who(pg, pg->rank, (char[160]){0}, 160), a,
             td__pg_who(pg, (pg->rank + pg->size - 1) % pg->size, who, sizeof who), b);
    st = td__pg_fail(pg, TD_ERR_STATE, msg);
  }
  if (st != TD_OK) pthread_mutex_unlock(&pg->mu);
  return st;
}

static td_status end(td_process_group *pg, td_status st) {
  pthread_mutex_unlock(&pg->mu);
  return st;
}

/* ---- ring algorithms (pg->mu held) ---- */

static td_status rs_ring(td_process_group *pg, chunk *ch, td_dtype dt, td_reduce_op op,
                         int shift, uint64_t dl, const char *name) {
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt), seg = SEG_BYTES / es * es;
  TD_TRY(td__pg_scratch(pg, seg));
  for (int s = 0; s < n - 1; s++) {
    const chunk *sc = &ch[mod(r - s + shift, n)];
    chunk *rc = &ch[mod(r - s - 1 + shift, n)];
    size_t ns = (sc->nbytes + seg - 1) / seg, nr = (rc->nbytes + seg - 1) / seg;
    size_t nseg = ns > nr ? ns : nr;
    for (size_t k = 0; k < nseg; k++) {
      size_t so = k * seg, ro = k * seg;
      size_t sl = so < sc->nbytes ? (sc->nbytes - so < seg ? sc->nbytes - so : seg) : 0;
      size_t rl = ro < rc->nbytes ? (rc->nbytes - ro < seg ? rc->nbytes - ro : seg) : 0;
      TD_TRY(td__pg_xchg(pg, sc->p + (sl ? so : 0), sl, pg->scratch, rl, dl, name));
      if (rl) reduce_into(rc->p + ro, pg->scratch, rl / es, dt, op);
    }
  }
  return TD_OK;
}

static td_status ag_ring(td_process_group *pg, chunk *ch, int shift, uint64_t dl,
                         const char *name) {
  int n = pg->size, r = pg->rank;
  for (int s = 0; s < n - 1; s++) {
    const chunk *sc = &ch[mod(r - s + shift, n)];
    chunk *rc = &ch[mod(r - s - 1 + shift, n)];
    TD_TRY(td__pg_xchg(pg, sc->p, sc->nbytes, rc->p, rc->nbytes, dl, name));
  }
  return TD_OK;
}

/* Splits count elements of es bytes at p into n nearly equal chunks (the first count % n get one
 * more element). */
static chunk *split(char *p, size_t count, size_t es, int n) {
  chunk *ch = td__malloc((size_t)n * sizeof *ch);
  if (!ch) return NULL;
  size_t base = count / (size_t)n, rem = count % (size_t)n, off = 0;
  for (int i = 0; i < n; i++) {
    size_t len = base + ((size_t)i < rem);
    ch[i] = (chunk){p + off * es, len * es};
    off += len;
  }
  return ch;
}

static td_status cpu_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op,
                                uint64_t dl) {
  td_dtype dt = td_tensor_dtype(t);
  size_t count = (size_t)td_tensor_numel(t), es = td_dtype_size(dt);
  char *data = td_tensor_data(t);
  if (pg->size > 1 && count) {
    chunk *ch = split(data, count, es, pg->size);
    if (!ch) return td_set_error(TD_ERR_NOMEM, "all_reduce: out of memory");
    td_status st = rs_ring(pg, ch, dt, op, 0, dl, "all_reduce");
    if (st == TD_OK) st = ag_ring(pg, ch, 1, dl, "all_reduce");
    td__free(ch);
    TD_TRY(st);
  }
  if (op == TD_REDUCE_AVG) divide(data, count, dt, pg->size);
  return TD_OK;
}

static td_status cpu_broadcast(td_process_group *pg, td_tensor *t, int root, uint64_t dl) {
  int n = pg->size;
  char *data = td_tensor_data(t);
  size_t nbytes = td_tensor_nbytes(t);
  if (n == 1 || nbytes == 0) return TD_OK;
  int64_t d = mod(pg->rank - root, n);
  int64_t nseg = (int64_t)((nbytes + SEG_BYTES - 1) / SEG_BYTES);
  int64_t steps = nseg + n - 2;
  for (int64_t k = 0; k < steps; k++) {
    int64_t sj = k - d, rj = k - d + 1;
    bool do_send = d <= n - 2 && sj >= 0 && sj < nseg;
    bool do_recv = d >= 1 && rj >= 0 && rj < nseg;
    size_t so = (size_t)(do_send ? sj : 0) * SEG_BYTES, ro = (size_t)(do_recv ? rj : 0) * SEG_BYTES;
    size_t sl = do_send ? (nbytes - so < SEG_BYTES ? nbytes - so : SEG_BYTES) : 0;
    size_t rl = do_recv ? (nbytes - ro < SEG_BYTES ? nbytes - ro : SEG_BYTES) : 0;
    if (!sl && !rl) continue;
    TD_TRY(td__pg_xchg(pg, data + so, sl, data + ro, rl, dl, "broadcast"));
  }
  return TD_OK;
}

/* ---- public entry points ---- */

td_status td_process_group_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op) {
  TD_CHECK_ARG(pg, "all_reduce: NULL group");
  TD_TRY(check_tensor(pg, t, "all_reduce", "tensor"));
  TD_TRY(check_op(op, td_tensor_dtype(t), "all_reduce"));
  uint64_t dl;
  TD_TRY(begin(pg, K_ALL_REDUCE, (uint64_t)td_tensor_numel(t), td_tensor_dtype(t), (int)op, &dl));
  td_status st;
#ifdef TD_HAVE_NCCL
  if (pg->backend == TD_PG_BACKEND_NCCL) return end(pg, td__nccl_all_reduce(pg, t, op));
#endif
  st = cpu_all_reduce(pg, t, op, dl);
  return end(pg, st);
}

td_status td_process_group_broadcast(td_process_group *pg, td_tensor *t, int root) {
  TD_CHECK_ARG(pg, "broadcast: NULL group");
  TD_TRY(check_tensor(pg, t, "broadcast", "tensor"));
  TD_CHECK_ARG(root >= 0 && root < pg->size, "broadcast: root %d outside the group of %d", root,
               pg->size);
  uint64_t dl;
  TD_TRY(begin(pg, K_BROADCAST, (uint64_t)td_tensor_numel(t), td_tensor_dtype(t), root, &dl));
#ifdef TD_HAVE_NCCL
  if (pg->backend == TD_PG_BACKEND_NCCL) return end(pg, td__nccl_broadcast(pg, t, root));
#endif
  return end(pg, cpu_broadcast(pg, t, root, dl));
}

/* All-gather over explicit slots (slot i receives group rank i's input). */
static td_status gather_slots(td_process_group *pg, chunk *ch, const td_tensor *in) {
  size_t nb = td_tensor_nbytes(in);
  uint64_t dl;
  TD_TRY(begin(pg, K_ALL_GATHER, (uint64_t)td_tensor_numel(in), td_tensor_dtype(in), 0, &dl));
  const char *src = td_tensor_data(in);
  if (nb && ch[pg->rank].p != src) memmove(ch[pg->rank].p, src, nb);
  return end(pg, ag_ring(pg, ch, 0, dl, "all_gather"));
}

td_status td_process_group_all_gather(td_process_group *pg, td_tensor *const *outs,
                                      const td_tensor *in) {
  TD_CHECK_ARG(pg && outs, "all_gather: NULL group or outs");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  int64_t numel = td_tensor_numel(in);
  char what[32];
  for (int i = 0; i < pg->size; i++) {
    snprintf(what, sizeof what, "outs[%d]", i);
    TD_TRY(check_tensor(pg, outs[i], "all_gather", what));
    TD_TRY(check_same(in, outs[i], "all_gather", what, numel));
  }
  if (pg->backend == TD_PG_BACKEND_NCCL) {
#ifdef TD_HAVE_NCCL
    /* NCCL gathers into one buffer: gather into a temporary, then copy out */
    int64_t shape[1] = {numel * pg->size};
    td_tensor *tmp = NULL;
    TD_TRY(td_tensor_empty(shape, 1, td_tensor_dtype(in), td_tensor_device(in), &tmp));
    td_status st = td_process_group_all_gather_into_tensor(pg, tmp, in);
    for (int i = 0; st == TD_OK && i < pg->size; i++) {
      td_tensor *v = NULL, *v2 = NULL;
      st = td_tensor_narrow(tmp, 0, numel * i, numel, &v);
      if (st == TD_OK)
        st = td_tensor_reshape(v, td_tensor_shape(outs[i]), td_tensor_ndim(outs[i]), &v2);
      if (st == TD_OK) st = td_tensor_copy_(outs[i], v2);
      td_tensor_unref(v);
      td_tensor_unref(v2);
    }
    td_tensor_unref(tmp);
    return st;
#endif
  }
  chunk *ch = td__malloc((size_t)pg->size * sizeof *ch);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "all_gather: out of memory");
  for (int i = 0; i < pg->size; i++) ch[i] = (chunk){td_tensor_data(outs[i]), td_tensor_nbytes(in)};
  td_status st = gather_slots(pg, ch, in);
  td__free(ch);
  return st;
}

td_status td_process_group_all_gather_into_tensor(td_process_group *pg, td_tensor *out,
                                                  const td_tensor *in) {
  TD_CHECK_ARG(pg, "all_gather: NULL group");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  TD_TRY(check_tensor(pg, out, "all_gather", "output"));
  int64_t numel = td_tensor_numel(in);
  TD_TRY(check_same(in, out, "all_gather", "output", numel * pg->size));
#ifdef TD_HAVE_NCCL
  if (pg->backend == TD_PG_BACKEND_NCCL) {
    uint64_t dl;
    TD_TRY(begin(pg, K_ALL_GATHER, (uint64_t)numel, td_tensor_dtype(in), 0, &dl));
    return end(pg, td__nccl_all_gather(pg, td_tensor_data(out), td_tensor_data(in),
                                       (size_t)numel, td_tensor_dtype(in)));
  }
#endif
  chunk *ch = split(td_tensor_data(out), (size_t)numel * (size_t)pg->size,
                    td_dtype_size(td_tensor_dtype(in)), pg->size);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "all_gather: out of memory");
  td_status st = gather_slots(pg, ch, in);
  td__free(ch);
  return st;
}

/* Reduce-scatter of n slots copied into the scratch buffer; in_slot(i) gives slot i's input. */
static td_status scatter_slots(td_process_group *pg, td_tensor *out, const char *const *ins,
                               td_reduce_op op) {
  td_dtype dt = td_tensor_dtype(out);
  size_t count = (size_t)td_tensor_numel(out), es = td_dtype_size(dt), nb = count * es;
  uint64_t dl;
  TD_TRY(begin(pg, K_REDUCE_SCATTER, count, dt, (int)op, &dl));
  size_t seg = SEG_BYTES / es * es;
  td_status st = td__pg_scratch(pg, seg + nb * (size_t)pg->size);
  chunk *ch = st == TD_OK ? td__malloc((size_t)pg->size * sizeof *ch) : NULL;
  if (st == TD_OK && !ch) st = td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  if (st == TD_OK) {
    char *work = (char *)pg->scratch + seg; /* rs_ring uses the first seg bytes */
    for (int i = 0; i < pg->size; i++) {
      ch[i] = (chunk){work + (size_t)i * nb, nb};
      if (nb) memcpy(ch[i].p, ins[i], nb);
    }
    if (pg->size > 1 && nb) st = rs_ring(pg, ch, dt, op, -1, dl, "reduce_scatter");
    if (st == TD_OK) {
      if (op == TD_REDUCE_AVG) divide(ch[pg->rank].p, count, dt, pg->size);
      if (nb) memcpy(td_tensor_data(out), ch[pg->rank].p, nb);
    }
  }
  td__free(ch);
  return end(pg, st);
}

td_status td_process_group_reduce_scatter(td_process_group *pg, td_tensor *out,
                                          td_tensor *const *ins, td_reduce_op op) {
  TD_CHECK_ARG(pg && ins, "reduce_scatter: NULL group or ins");
  TD_TRY(check_tensor(pg, out, "reduce_scatter", "output"));
  TD_TRY(check_op(op, td_tensor_dtype(out), "reduce_scatter"));
  char what[32];
  for (int i = 0; i < pg->size; i++) {
    snprintf(what, sizeof what, "ins[%d]", i);
    TD_TRY(check_tensor(pg, ins[i], "reduce_scatter", what));
    TD_TRY(check_same(out, ins[i], "reduce_scatter", what, td_tensor_numel(out)));
  }
  if (pg->backend == TD_PG_BACKEND_NCCL) {
#ifdef TD_HAVE_NCCL
    /* NCCL reduces one buffer: concatenate the flattened inputs */
    td_tensor **flat = td__calloc((size_t)pg->size, sizeof *flat), *cat = NULL;
    if (!flat) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
    int64_t shape[1] = {-1};
    td_status st = TD_OK;
    for (int i = 0; st == TD_OK && i < pg->size; i++)
      st = td_tensor_reshape(ins[i], shape, 1, &flat[i]);
    if (st == TD_OK) st = td_tensor_cat(flat, pg->size, 0, &cat);
    if (st == TD_OK) st = td_process_group_reduce_scatter_tensor(pg, out, cat, op);
    for (int i = 0; i < pg->size; i++) td_tensor_unref(flat[i]);
    td__free(flat);
    td_tensor_unref(cat);
    return st;
#endif
  }
  const char **ptrs = td__malloc((size_t)pg->size * sizeof *ptrs);
  if (!ptrs) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  for (int i = 0; i < pg->size; i++) ptrs[i] = td_tensor_data(ins[i]);
  td_status st = scatter_slots(pg, out, ptrs, op);
  td__free(ptrs);
  return st;
}

td_status td_process_group_reduce_scatter_tensor(td_process_group *pg, td_tensor *out,
                                                 const td_tensor *in, td_reduce_op op) {
  TD_CHECK_ARG(pg, "reduce_scatter: NULL group");
  TD_TRY(check_tensor(pg, out, "reduce_scatter", "output"));
  TD_TRY(check_tensor(pg, in, "reduce_scatter", "input"));
  TD_TRY(check_op(op, td_tensor_dtype(out), "reduce_scatter"));
  int64_t count = td_tensor_numel(out);
  TD_TRY(check_same(out, in, "reduce_scatter", "input", count * pg->size));
#ifdef TD_HAVE_NCCL
  if (pg->backend == TD_PG_BACKEND_NCCL) {
    uint64_t dl;
    TD_TRY(begin(pg, K_REDUCE_SCATTER, (uint64_t)count, td_tensor_dtype(out), (int)op, &dl));
    return end(pg, td__nccl_reduce_scatter(pg, td_tensor_data(out), td_tensor_data(in),
                                           (size_t)count, td_tensor_dtype(out), op));
  }
#endif
  const char **ptrs = td__malloc((size_t)pg->size * sizeof *ptrs);
  if (!ptrs) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  size_t nb = td_tensor_nbytes(out);
  for (int i = 0; i < pg->size; i++) ptrs[i] = (const char *)td_tensor_data(in) + (size_t)i * nb;
  td_status st = scatter_slots(pg, out, ptrs, op);
  td__free(ptrs);
  return st;
}

td_status td_process_group_barrier(td_process_group *pg) {
  TD_CHECK_ARG(pg, "barrier: NULL group");
  uint64_t dl;
  TD_TRY(begin(pg, K_BARRIER, 1, TD_DTYPE_F32, 0, &dl));
  chunk *ch = NULL;
  td_status st = td__pg_scratch(pg, (size_t)pg->size);
  if (st == TD_OK) {
    ch = split((char *)pg->scratch, (size_t)pg->size, 1, pg->size);
    if (!ch) st = td_set_error(TD_ERR_NOMEM, "barrier: out of memory");
  }
  if (st == TD_OK) st = ag_ring(pg, ch, 0, dl, "barrier");
  td__free(ch);
  return end(pg, st);
}
