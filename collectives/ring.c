/* ring.c - the CPU collectives over the TCP ring (members on any hosts): the header check with
 * the neighbours and the ring algorithms. ops.c chooses them and holds pg->mu around them.
 *
 * Header check: each member sends its td__op_hdr {kind, sequence number, element count, dtype,
 * reduce op or root} to its right neighbour and compares what its left neighbour sent. Around
 * the ring this checks that all members run the same operation on compatible tensors; a mismatch
 * fails the group with TD_ERR_STATE describing both calls (instead of exchanging garbage or
 * hanging). The header is also what makes a barrier a barrier.
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
 *     from the root receives segment j at step j + d - 1 and forwards it at step j + d; the last
 *     member then acknowledges to the root (see ack_root).
 *   - barrier: an all-gather of one byte per member after the header.
 */
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"

#define SEG_BYTES ((size_t)1 << 20)

typedef td__chunk chunk;

static int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

td_status td__ring_check(td_process_group *pg, const td__op_hdr *mine, uint64_t dl) {
  td__op_hdr theirs;
  const char *name = td__kind_name(mine->kind);
  TD_TRY(td__pg_xchg(pg, mine, sizeof *mine, &theirs, sizeof theirs, dl, name));
  if (memcmp(mine, &theirs, sizeof *mine) == 0) return TD_OK;
  return td__op_mismatch(pg, mine, (pg->rank + pg->size - 1) % pg->size, &theirs);
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
      if (rl) td__reduce_into(rc->p + ro, pg->scratch, rl / es, dt, op);
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

td_status td__ring_all_reduce(td_process_group *pg, void *data, size_t count, td_dtype dt,
                              td_reduce_op op, uint64_t dl) {
  if (count == 0) return TD_OK;
  chunk *ch = split(data, count, td_dtype_size(dt), pg->size);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "all_reduce: out of memory");
  td_status st = rs_ring(pg, ch, dt, op, 0, dl, "all_reduce");
  if (st == TD_OK) st = ag_ring(pg, ch, 1, dl, "all_reduce");
  td__free(ch);
  return st;
}

/* The last member of a broadcast's chain (distance n - 1, the root's left neighbour) sends one
 * byte to the root: the root returns only once everyone received, so a member that failed the
 * operation (a mismatch) fails the root too instead of leaving it to its next call. */
static td_status ack_root(td_process_group *pg, int64_t d, uint64_t dl) {
  char b = 1;
  if (d == pg->size - 1) return td__pg_xchg(pg, &b, 1, NULL, 0, dl, "broadcast");
  if (d == 0) return td__pg_xchg(pg, NULL, 0, &b, 1, dl, "broadcast");
  return TD_OK;
}

td_status td__ring_broadcast(td_process_group *pg, void *vdata, size_t nbytes, int root,
                             uint64_t dl) {
  int n = pg->size;
  char *data = vdata;
  int64_t d = mod(pg->rank - root, n);
  if (nbytes == 0) return ack_root(pg, d, dl);
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
  return ack_root(pg, d, dl);
}

td_status td__ring_all_gather(td_process_group *pg, td__chunk *ch, uint64_t dl) {
  return ag_ring(pg, ch, 0, dl, "all_gather");
}

td_status td__ring_reduce_scatter(td_process_group *pg, void *out, const char *const *ins,
                                  size_t count, td_dtype dt, td_reduce_op op, uint64_t dl) {
  size_t es = td_dtype_size(dt), nb = count * es, seg = SEG_BYTES / es * es;
  TD_TRY(td__pg_scratch(pg, seg + nb * (size_t)pg->size));
  chunk *ch = td__malloc((size_t)pg->size * sizeof *ch);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  char *work = (char *)pg->scratch + seg; /* rs_ring uses the first seg bytes */
  for (int i = 0; i < pg->size; i++) {
    ch[i] = (chunk){work + (size_t)i * nb, nb};
    if (nb) memcpy(ch[i].p, ins[i], nb);
  }
  td_status st = nb ? rs_ring(pg, ch, dt, op, -1, dl, "reduce_scatter") : TD_OK;
  if (st == TD_OK && nb) memcpy(out, ch[pg->rank].p, nb);
  td__free(ch);
  return st;
}

td_status td__ring_barrier(td_process_group *pg, uint64_t dl) {
  TD_TRY(td__pg_scratch(pg, (size_t)pg->size));
  chunk *ch = split((char *)pg->scratch, (size_t)pg->size, 1, pg->size);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "barrier: out of memory");
  td_status st = ag_ring(pg, ch, 0, dl, "barrier");
  td__free(ch);
  return st;
}
