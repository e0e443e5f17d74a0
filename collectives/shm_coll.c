/* shm_coll.c - the CPU collectives over the same-host shared-memory transport (round protocol in
 * shm_impl.h). B is one member's round buffer (td__shm_buf_bytes), n the group size, r this
 * member; "piece" is the part of a message one round carries.
 *
 *   all_reduce, one round ("shm_direct", messages of at most B bytes): every member copies its
 *     tensor into its buffer, then reduces the whole vector from all n buffers into its tensor.
 *     One synchronisation; each member reads n times the message (fine while it is small).
 *   all_reduce, reduce-scatter + all-gather ("shm_rsag"): pieces of B bytes, each cut into n
 *     chunks. Round 1 of a piece: every member copies the chunks other members own into its
 *     buffer; member r reduces chunk r from the n buffers (its own contribution read from its
 *     tensor) into its buffer of the next round and its tensor. Round 2: every member copies the
 *     other members' reduced chunks into its tensor. Each member moves about 3 times the message
 *     through memory whatever n is, and the piece stays in cache between the rounds.
 *   broadcast: pieces of B bytes; the root copies a piece into its buffer, the others copy it out
 *     (they wait for the root only, except in the first round, where everyone checks headers).
 *   all_gather: pieces of the input; every member copies its piece in, then every buffer out.
 *   reduce_scatter: pieces of at most B / n elements of the output; every member copies its
 *     inputs for the other members into its buffer, then reduces its own slot from the n buffers.
 *   barrier: one round with the header and no data.
 * Every reduction adds members 0, 1, ..., n-1 in that order (td__reduce_n), so every member gets
 * the same bits; AVG divides afterwards (ops.c), alike on every member.
 */
#include <string.h>

#include "shm_impl.h"

/* Member j's part of a piece of len elements: [start(j), start(j) + length(j)). */
static size_t part_start(size_t len, int n, int j) {
  size_t base = len / (size_t)n, rem = len % (size_t)n;
  return (size_t)j * base + ((size_t)j < rem ? (size_t)j : rem);
}
static size_t part_len(size_t len, int n, int j) {
  return len / (size_t)n + ((size_t)j < len % (size_t)n);
}

static size_t pieces(size_t total, size_t per) {
  return total == 0 ? 1 : (total + per - 1) / per;
}

/* Round k's start: buffers of round k - 2 are free; the first round also publishes h. */
static td_status begin_round(td_process_group *pg, uint64_t k, const td__op_hdr *h, bool first,
                             uint64_t dl) {
  TD_TRY(td__shm_reuse(pg, k, h, dl));
  if (first) td__shm_put_header(pg->shm, k, h);
  return TD_OK;
}

/* Posts round k and waits for member who (every member: -1, and always in a first round). */
static td_status finish_round(td_process_group *pg, uint64_t k, int who, const td__op_hdr *h,
                              bool first, uint64_t dl) {
  td__shm_post(pg->shm, k);
  TD_TRY(td__shm_wait(pg, k, first ? -1 : who, h, dl));
  return first ? td__shm_check_headers(pg, k, h) : TD_OK;
}

static td_status all_reduce_direct(td_process_group *pg, const td__op_hdr *h, char *data,
                                   size_t count, td_dtype dt, td_reduce_op op, uint64_t dl) {
  td__shm *s = pg->shm;
  size_t nb = count * td_dtype_size(dt);
  uint64_t k = td__shm_next_round(s);
  const void **srcs = pg->slot_srcs;
  td_status st = begin_round(pg, k, h, true, dl);
  if (st == TD_OK) {
    if (nb) memcpy(td__shm_buf(s, pg->rank, k), data, nb);
    st = finish_round(pg, k, -1, h, true, dl);
  }
  if (st == TD_OK && nb) {
    for (int j = 0; j < pg->size; j++) srcs[j] = td__shm_buf(s, j, k);
    td__reduce_n(data, srcs, pg->size, count, dt, op);
  }
  return st;
}

/* One piece of the reduce-scatter + all-gather all_reduce: elements [0, len) of p. */
static td_status rsag_piece(td_process_group *pg, const td__op_hdr *h, char *p, size_t len,
                            td_dtype dt, td_reduce_op op, bool first, const void **srcs,
                            uint64_t dl) {
  td__shm *s = pg->shm;
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt);
  uint64_t k = td__shm_next_round(s);
  TD_TRY(begin_round(pg, k, h, first, dl));
  char *mine = td__shm_buf(s, r, k);
  for (int j = 0; j < n; j++)
    if (j != r && part_len(len, n, j))
      memcpy(mine + part_start(len, n, j) * es, p + part_start(len, n, j) * es,
             part_len(len, n, j) * es);
  TD_TRY(finish_round(pg, k, -1, h, first, dl));
  size_t ms = part_start(len, n, r) * es, ml = part_len(len, n, r);
  for (int j = 0; j < n; j++) srcs[j] = j == r ? p + ms : td__shm_buf(s, j, k) + ms;
  char *reduced = td__shm_buf(s, r, k + 1) + ms; /* round k + 1's buffer: everyone posted k */
  if (ml) td__reduce_n2(reduced, p + ms, srcs, n, ml, dt, op);
  TD_TRY(finish_round(pg, k + 1, -1, h, false, dl));
  for (int j = 0; j < n; j++) {
    size_t js = part_start(len, n, j) * es, jl = part_len(len, n, j) * es;
    if (j != r && jl) memcpy(p + js, td__shm_buf(s, j, k + 1) + js, jl);
  }
  return TD_OK;
}

td_status td__shm_all_reduce(td_process_group *pg, const td__op_hdr *h, void *data, size_t count,
                             td_dtype dt, td_reduce_op op, bool direct, uint64_t dl) {
  if (direct) return all_reduce_direct(pg, h, data, count, dt, op, dl);
  size_t es = td_dtype_size(dt), per = td__shm_buf_bytes(pg->shm) / es;
  const void **srcs = pg->slot_srcs;
  td_status st = TD_OK;
  size_t np = pieces(count, per);
  for (size_t q = 0; st == TD_OK && q < np; q++) {
    size_t off = q * per, len = count - off < per ? count - off : per;
    st = rsag_piece(pg, h, (char *)data + off * es, count ? len : 0, dt, op, q == 0, srcs, dl);
  }
  return st;
}

td_status td__shm_broadcast(td_process_group *pg, const td__op_hdr *h, void *data, size_t nbytes,
                            int root, uint64_t dl) {
  td__shm *s = pg->shm;
  size_t per = td__shm_buf_bytes(s), np = pieces(nbytes, per);
  bool is_root = pg->rank == root;
  for (size_t q = 0; q < np; q++) {
    size_t off = q * per, len = nbytes ? (nbytes - off < per ? nbytes - off : per) : 0;
    uint64_t k = td__shm_next_round(s);
    /* the root reuses its buffers; everyone reuses its header slot in the first round */
    if (is_root || q == 0) TD_TRY(begin_round(pg, k, h, q == 0, dl));
    if (is_root && len) memcpy(td__shm_buf(s, root, k), (char *)data + off, len);
    TD_TRY(finish_round(pg, k, root, h, q == 0, dl));
    if (!is_root && len) memcpy((char *)data + off, td__shm_buf(s, root, k), len);
  }
  return TD_OK;
}

td_status td__shm_all_gather(td_process_group *pg, const td__op_hdr *h, td__chunk *outs,
                             const void *in, size_t nbytes, uint64_t dl) {
  td__shm *s = pg->shm;
  size_t per = td__shm_buf_bytes(s), np = pieces(nbytes, per);
  for (size_t q = 0; q < np; q++) {
    size_t off = q * per, len = nbytes ? (nbytes - off < per ? nbytes - off : per) : 0;
    uint64_t k = td__shm_next_round(s);
    TD_TRY(begin_round(pg, k, h, q == 0, dl));
    if (len) memcpy(td__shm_buf(s, pg->rank, k), (const char *)in + off, len);
    td__shm_post(s, k);
    /* our own part while the others arrive */
    char *own = outs[pg->rank].p + off;
    if (len && own != (const char *)in + off) memmove(own, (const char *)in + off, len);
    TD_TRY(td__shm_wait(pg, k, -1, h, dl));
    if (q == 0) TD_TRY(td__shm_check_headers(pg, k, h));
    for (int j = 0; j < pg->size && len; j++)
      if (j != pg->rank) memcpy(outs[j].p + off, td__shm_buf(s, j, k), len);
  }
  return TD_OK;
}

static bool overlaps(const char *a, size_t an, const char *b, size_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

td_status td__shm_reduce_scatter(td_process_group *pg, const td__op_hdr *h, void *out,
                                 const char *const *ins, size_t count, td_dtype dt,
                                 td_reduce_op op, uint64_t dl) {
  td__shm *s = pg->shm;
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt), nb = count * es;
  size_t per = td__shm_buf_bytes(s) / ((size_t)n * es), np = pieces(count, per ? per : 1);
  per = per ? per : 1;
  /* an output overlapping another member's input would be overwritten before it is sent */
  char *dst = out;
  bool alias = false;
  for (int i = 0; i < n; i++)
    if (i != r && overlaps(out, nb, ins[i], nb)) alias = true;
  if (alias) {
    TD_TRY(td__pg_scratch(pg, nb));
    dst = (char *)pg->scratch;
  }
  const void **srcs = pg->slot_srcs;
  td_status st = TD_OK;
  for (size_t q = 0; st == TD_OK && q < np; q++) {
    size_t off = q * per, len = count ? (count - off < per ? count - off : per) : 0;
    uint64_t k = td__shm_next_round(s);
    st = begin_round(pg, k, h, q == 0, dl);
    if (st != TD_OK) break;
    char *mine = td__shm_buf(s, r, k);
    for (int i = 0; i < n && len; i++)
      if (i != r) memcpy(mine + (size_t)i * per * es, ins[i] + off * es, len * es);
    st = finish_round(pg, k, -1, h, q == 0, dl);
    if (st != TD_OK || !len) continue;
    for (int j = 0; j < n; j++)
      srcs[j] = j == r ? ins[r] + off * es : td__shm_buf(s, j, k) + (size_t)r * per * es;
    td__reduce_n(dst + off * es, srcs, n, len, dt, op);
  }
  if (st == TD_OK && alias && nb) memcpy(out, dst, nb);
  return st;
}

td_status td__shm_barrier(td_process_group *pg, const td__op_hdr *h, uint64_t dl) {
  uint64_t k = td__shm_next_round(pg->shm);
  TD_TRY(begin_round(pg, k, h, true, dl));
  return finish_round(pg, k, -1, h, true, dl);
}

/* ---- the backend ---- */

static td_status shm_run(td_process_group *pg, const td__op *op, const td__op_hdr *h,
                         uint64_t dl) {
  td_dtype dt = (td_dtype)h->dtype;
  void *data = op->kind == TD__K_BARRIER ? NULL : td_tensor_data(op->t);
  switch (h->algo) {
    case TD__A_SHM_DIRECT:
    case TD__A_SHM_RSAG:
      return td__shm_all_reduce(pg, h, data, h->count, dt, op->rop, h->algo == TD__A_SHM_DIRECT,
                                dl);
    case TD__A_SHM_BCAST:
      return td__shm_broadcast(pg, h, data, td_tensor_nbytes(op->t), op->root, dl);
    case TD__A_SHM_GATHER: {
      td__op_gather_slots(op, pg->size, pg->slot_chunks);
      return td__shm_all_gather(pg, h, pg->slot_chunks, data, td_tensor_nbytes(op->t), dl);
    }
    case TD__A_SHM_SCATTER: {
      td__op_scatter_slots(op, pg->size, pg->slot_ins);
      return td__shm_reduce_scatter(pg, h, data, pg->slot_ins, h->count, dt, op->rop, dl);
    }
    case TD__A_SHM_BARRIER: return td__shm_barrier(pg, h, dl);
    default:
      return td_set_error(TD_ERR_INTERNAL, "collectives: %s is not a shared-memory algorithm",
                          td__algo_name(h->algo));
  }
}

const td__coll_backend td__coll_shm = {
    .name = "shm",
    .setup = td__shm_setup,
    .fail = td__shm_fail,
    .destroy = td__shm_destroy,
    .run = shm_run,
    .avg_is_sum = true,
    .member_alive = td__shm_member_alive,
};
