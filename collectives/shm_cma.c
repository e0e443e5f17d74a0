/* shm_cma.c - single-copy collectives for large messages on one host: members read each other's
 * tensors directly with process_vm_readv (cross-memory attach, as Open MPI's vader transport and
 * this library's RPC direct copy do) instead of staging them through the shared buffers. The
 * shared segment still carries the rounds, headers and the exposed addresses (shm_impl.h).
 *
 *   broadcast ("cma_bcast"): round 1 exposes the root's tensor; every other member copies it
 *     once; round 2 tells the root that nobody reads it any more (only the root waits for it).
 *   all_gather ("cma_gather"): round 1 exposes every input; each member copies the n - 1 others
 *     into its output; round 2: nobody reads an input any more.
 *   reduce_scatter ("cma_scatter", concatenated input only): round 1 exposes every input; member
 *     r reads slot r of every other input in pieces of PIECE bytes into cache-sized temporaries
 *     and reduces them with its own slot into its output; round 2 as above.
 *   all_reduce ("cma_rsag"): round 1 exposes every tensor; member r reduces chunk r (its n-th of
 *     the tensor) in place from the others' chunk r, read in pieces as above; round 2: every
 *     chunk is reduced; each member copies chunk j of member j for every j; round 3: nobody
 *     reads a tensor any more.
 * Each byte crosses memory about once per reader (two copies with the shared buffers), with two
 * or three synchronisations per operation whatever its size. Reductions combine members 0, 1,
 * ..., n-1 in that order as everywhere else, so results are bit-identical on every member.
 *
 * This is the CMA entry of the backend table (td__coll_cma): it serves when the shared-memory
 * backend does and every member proved at setup that it can read the others' memory.
 */
#include <string.h>

#include "shm_impl.h"

#define PIECE_TOTAL ((size_t)256 << 10) /* the temporaries of one reduction piece, together */
#define PIECE_MIN ((size_t)32 << 10)

/* The first round: header and exposed buffer; afterwards peer[m] is member m's buffer. local
 * (optional) runs between posting and waiting: work of this member alone, hidden behind the wait
 * for the others. */
static td_status cma_begin(td_process_group *pg, const td__op_hdr *h, const void *mine,
                           const char **peer, void (*local)(void *), void *local_arg,
                           uint64_t dl) {
  td__shm *s = pg->shm;
  uint64_t k = td__shm_next_round(s);
  TD_TRY(td__shm_reuse(pg, k, h, dl));
  td__shm_put_header(s, k, h);
  td__shm_expose(s, k, mine, NULL);
  td__shm_post(s, k);
  if (local) local(local_arg);
  TD_TRY(td__shm_wait(pg, k, -1, h, dl));
  TD_TRY(td__shm_check_headers(pg, k, h));
  for (int m = 0; m < pg->size; m++) peer[m] = td__shm_exposed(s, m, k, 0);
  return TD_OK;
}

/* A round without data: post, then wait for member who (every member: -1; nobody: -2). */
static td_status cma_sync(td_process_group *pg, const td__op_hdr *h, int who, uint64_t dl) {
  td__shm *s = pg->shm;
  uint64_t k = td__shm_next_round(s);
  td__shm_post(s, k);
  return who == -2 ? TD_OK : td__shm_wait(pg, k, who, h, dl);
}

static td_status peers_alloc(const td_process_group *pg, const char ***out) {
  *out = td__calloc((size_t)pg->size, sizeof **out);
  return *out ? TD_OK : td_set_error(TD_ERR_NOMEM, "collective: out of memory");
}

static td_status cma_broadcast(td_process_group *pg, const td__op_hdr *h, void *data,
                               size_t nbytes, int root, uint64_t dl) {
  const char **peer = NULL;
  TD_TRY(peers_alloc(pg, &peer));
  td_status st = cma_begin(pg, h, data, peer, NULL, NULL, dl);
  if (st == TD_OK && pg->rank != root && nbytes)
    st = td__shm_read(pg, root, data, peer[root], nbytes, h);
  if (st == TD_OK) st = cma_sync(pg, h, pg->rank == root ? -1 : -2, dl);
  td__free(peer);
  return st;
}

typedef struct own_copy {
  void *dst;
  const void *src;
  size_t n;
} own_copy;

static void copy_own(void *arg) {
  own_copy *c = arg;
  if (c->n && c->dst != c->src) memmove(c->dst, c->src, c->n);
}

static td_status cma_all_gather(td_process_group *pg, const td__op_hdr *h, td__chunk *outs,
                                const void *in, size_t nbytes, uint64_t dl) {
  const char **peer = NULL;
  TD_TRY(peers_alloc(pg, &peer));
  own_copy oc = {outs[pg->rank].p, in, nbytes};
  td_status st = cma_begin(pg, h, in, peer, copy_own, &oc, dl);
  for (int j = 0; st == TD_OK && j < pg->size && nbytes; j++)
    if (j != pg->rank) st = td__shm_read(pg, j, outs[j].p, peer[j], nbytes, h);
  if (st == TD_OK) st = cma_sync(pg, h, -1, dl);
  td__free(peer);
  return st;
}

/* dst[0, count) = the reduction over members of their elements at offset off (bytes) of the
 * exposed buffers, this member's own being `own` (already at that offset). Reads pieces of the
 * others into temporaries from the group's scratch buffer. */
static td_status reduce_from_peers(td_process_group *pg, const td__op_hdr *h, const char **peer,
                                   size_t off, const char *own, char *dst, size_t count,
                                   td_dtype dt, td_reduce_op op) {
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt), per = PIECE_TOTAL / (size_t)(n - 1);
  per = (per < PIECE_MIN ? PIECE_MIN : per) / es;
  TD_TRY(td__pg_scratch(pg, (size_t)n * per * es));
  const void **srcs = td__malloc((size_t)n * sizeof *srcs);
  if (!srcs) return td_set_error(TD_ERR_NOMEM, "collective: out of memory");
  td_status st = TD_OK;
  for (size_t done = 0; st == TD_OK && done < count; done += per) {
    size_t len = count - done < per ? count - done : per, b = done * es;
    for (int j = 0; st == TD_OK && j < n; j++) {
      if (j == r) {
        srcs[j] = own + b;
        continue;
      }
      char *tmp = (char *)pg->scratch + (size_t)j * per * es;
      st = td__shm_read(pg, j, tmp, peer[j] + off + b, len * es, h);
      srcs[j] = tmp;
    }
    if (st == TD_OK) td__reduce_n(dst + b, srcs, n, len, dt, op);
  }
  td__free(srcs);
  return st;
}

static td_status cma_reduce_scatter(td_process_group *pg, const td__op_hdr *h, void *out,
                                    const char *in, size_t count, td_dtype dt, td_reduce_op op,
                                    uint64_t dl) {
  int n = pg->size, r = pg->rank;
  size_t nb = count * td_dtype_size(dt);
  /* an output inside another slot of our input would change it while the others read it */
  const char *o = out;
  bool alias = nb && o < in + (size_t)n * nb && in < o + nb && o != in + (size_t)r * nb;
  char *dst = out, *tmp = NULL;
  if (alias) {
    tmp = td__malloc(nb);
    if (!tmp) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
    dst = tmp;
  }
  const char **peer = NULL;
  td_status st = peers_alloc(pg, &peer);
  if (st == TD_OK) st = cma_begin(pg, h, in, peer, NULL, NULL, dl);
  if (st == TD_OK && nb)
    st = reduce_from_peers(pg, h, peer, (size_t)r * nb, in + (size_t)r * nb, dst, count, dt, op);
  if (st == TD_OK) st = cma_sync(pg, h, -1, dl);
  if (st == TD_OK && alias) memcpy(out, tmp, nb);
  td__free(tmp);
  td__free(peer);
  return st;
}

static td_status cma_all_reduce(td_process_group *pg, const td__op_hdr *h, void *vdata,
                                size_t count, td_dtype dt, td_reduce_op op, uint64_t dl) {
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt), base = count / (size_t)n, rem = count % (size_t)n;
  char *data = vdata;
  const char **peer = NULL;
  TD_TRY(peers_alloc(pg, &peer));
#define START(j) (((size_t)(j) * base + ((size_t)(j) < rem ? (size_t)(j) : rem)) * es)
#define LEN(j) (base + ((size_t)(j) < rem))
  td_status st = cma_begin(pg, h, data, peer, NULL, NULL, dl);
  if (st == TD_OK && LEN(r))
    st = reduce_from_peers(pg, h, peer, START(r), data + START(r), data + START(r), LEN(r), dt,
                           op);
  if (st == TD_OK) st = cma_sync(pg, h, -1, dl);
  for (int j = 0; st == TD_OK && j < n; j++)
    if (j != r && LEN(j)) st = td__shm_read(pg, j, data + START(j), peer[j] + START(j),
                                            LEN(j) * es, h);
  if (st == TD_OK) st = cma_sync(pg, h, -1, dl);
#undef START
#undef LEN
  td__free(peer);
  return st;
}

/* ---- the backend ---- */

static td_status cma_run(td_process_group *pg, const td__op *op, const td__op_hdr *h,
                         uint64_t dl) {
  td_dtype dt = (td_dtype)h->dtype;
  void *data = td_tensor_data(op->t);
  switch (h->algo) {
    case TD__A_CMA_RSAG: return cma_all_reduce(pg, h, data, h->count, dt, op->rop, dl);
    case TD__A_CMA_BCAST: return cma_broadcast(pg, h, data, td_tensor_nbytes(op->t), op->root, dl);
    case TD__A_CMA_GATHER: {
      td__op_gather_slots(op, pg->size, pg->slot_chunks);
      return cma_all_gather(pg, h, pg->slot_chunks, data, td_tensor_nbytes(op->t), dl);
    }
    case TD__A_CMA_SCATTER: /* the concatenated input only (the chooser's condition) */
      return cma_reduce_scatter(pg, h, data, td_tensor_data(op->whole), h->count, dt, op->rop,
                                dl);
    default:
      return td_set_error(TD_ERR_INTERNAL, "collectives: %s is not a single-copy algorithm",
                          td__algo_name(h->algo));
  }
}

/* Serves when the shared-memory backend does and every member could read every other's memory. */
static td_status cma_setup(td_process_group *pg, uint64_t deadline, bool *serves) {
  (void)deadline;
  *serves = pg->shm && td__shm_cma(pg->shm);
  return TD_OK;
}

/* The segment, its failure flag and teardown belong to the shared-memory backend. */
const td__coll_backend td__coll_cma = {
    .name = "cma",
    .setup = cma_setup,
    .run = cma_run,
    .avg_is_sum = true,
};
