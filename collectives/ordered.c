/* ordered.c - td_process_group_all_reduce_ordered: the sum of a batch's shards in shard order,
 * bitwise the same whoever holds which shard (include/tdist/collectives.h).
 *
 * Why: floating-point addition is not associative, so a sum's bits depend on its order. An
 * all_reduce adds in an order set by the group (the shared-memory algorithms fold members
 * 0..n-1 left to right; the TCP ring starts each chunk at a different member), so when a member
 * is lost and its shard of the batch is recomputed by another, an ordinary all_reduce over the
 * survivors gives other bits. Here the order is the shards': ((s_0 + s_1) + s_2) + ..., each
 * addition being td__reduce_n's, the kernel the shared-memory all_reduce uses.
 *
 * Two paths, chosen alike on every member from what every member knows (owner[], the size and
 * the group's algorithm for the size):
 *   - identity: shard s on group rank s for every s, and the group's all_reduce of this size is
 *     a left-to-right fold of members (shm_direct, shm_rsag, cma_rsag): one all_reduce SUM is
 *     the ordered sum. A failure-free data-parallel step takes this path at the cost of the
 *     plain all_reduce.
 *   - gather: the vector in pieces; for each piece every member contributes its shards' pieces
 *     (kmax slots, kmax the most shards one member holds, unused slots zero) to one
 *     all_gather_into_tensor, and every member folds the n_shards pieces in shard order with
 *     td__reduce_n (the same kernel, so the same bits as the identity path). Traffic: size x kmax
 *     x the vector per member, and each member adds n_shards vectors: the price of a degraded
 *     group, paid only while shards do not sit on their own ranks.
 * AVG divides by n_shards afterwards (td__divide), on both paths alike.
 */
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"

#define PIECE_BYTES ((size_t)4 << 20) /* the most bytes one member contributes per all_gather */

static td_status check_args(const td_process_group *pg, const td_tensor *out,
                            td_tensor *const *mine, int n_mine, const int *owner, int n_shards,
                            td_reduce_op op) {
  TD_CHECK_ARG(pg && out && owner && n_shards >= 1 && (n_mine == 0 || mine),
               "all_reduce_ordered: NULL argument or no shards");
  TD_CHECK_ARG(op == TD_REDUCE_SUM || op == TD_REDUCE_AVG,
               "all_reduce_ordered: only sum and avg are ordered reductions");
  TD_CHECK_ARG(td_tensor_is_contiguous(out) && td_tensor_device(out).type == TD_DEVICE_CPU,
               "all_reduce_ordered: out must be a contiguous CPU tensor");
  int have = 0;
  for (int s = 0; s < n_shards; s++) {
    TD_CHECK_ARG(owner[s] >= 0 && owner[s] < pg->size,
                 "all_reduce_ordered: shard %d's owner %d is not a group rank (size %d)", s,
                 owner[s], pg->size);
    have += owner[s] == pg->rank;
  }
  TD_CHECK_ARG(have == n_mine, "all_reduce_ordered: owner[] gives this member %d shards, %d given",
               have, n_mine);
  for (int j = 0; j < n_mine; j++)
    TD_CHECK_ARG(mine[j] && td_tensor_is_contiguous(mine[j]) &&
                     td_tensor_device(mine[j]).type == TD_DEVICE_CPU &&
                     td_tensor_dtype(mine[j]) == td_tensor_dtype(out) &&
                     td_tensor_numel(mine[j]) == td_tensor_numel(out),
                 "all_reduce_ordered: shard tensor %d must be contiguous on the CPU with out's "
                 "dtype and element count", j);
  return TD_OK;
}

/* Whether the identity path applies (see the file header). */
static bool identity_path(const td_process_group *pg, const td_tensor *out, const int *owner,
                          int n_shards) {
  if (n_shards != pg->size) return false;
  for (int s = 0; s < n_shards; s++)
    if (owner[s] != s) return false;
  if (pg->size == 1) return true;
  const char *a = td_process_group_algorithm(pg, TD_PG_OP_ALL_REDUCE, td_tensor_nbytes(out));
  return !strcmp(a, "shm_direct") || !strcmp(a, "shm_rsag") || !strcmp(a, "cma_rsag");
}

static td_status gather_path(td_process_group *pg, td_tensor *out, td_tensor *const *mine,
                             int n_mine, const int *owner, int n_shards) {
  int n = pg->size, kmax = 0;
  int *count = td__calloc((size_t)n, sizeof *count), *slot = td__malloc((size_t)n_shards *
                                                                        sizeof *slot);
  const void **srcs = td__malloc((size_t)n_shards * sizeof *srcs);
  td_status st = count && slot && srcs ? TD_OK
                                       : td_set_error(TD_ERR_NOMEM, "all_reduce_ordered: out of "
                                                      "memory");
  for (int s = 0; st == TD_OK && s < n_shards; s++) {
    slot[s] = count[owner[s]]++;
    if (count[owner[s]] > kmax) kmax = count[owner[s]];
  }
  td_dtype dt = td_tensor_dtype(out);
  size_t es = td_dtype_size(dt), total = (size_t)td_tensor_numel(out);
  size_t per = PIECE_BYTES / ((size_t)kmax * es + 1);
  if (per < 1) per = 1;
  for (size_t off = 0; st == TD_OK && off < total; off += per) {
    size_t len = total - off < per ? total - off : per;
    int64_t sn = (int64_t)(len * (size_t)kmax), gn = sn * n;
    td_tensor *send = NULL, *all = NULL;
    st = td_tensor_zeros(&sn, 1, dt, td_device_cpu(), &send);
    if (st == TD_OK) st = td_tensor_empty(&gn, 1, dt, td_device_cpu(), &all);
    if (st == TD_OK) {
      char *sp = td_tensor_data(send);
      for (int j = 0; j < n_mine; j++)
        memcpy(sp + (size_t)j * len * es, (const char *)td_tensor_data(mine[j]) + off * es,
               len * es);
      st = td_process_group_all_gather_into_tensor(pg, all, send);
    }
    if (st == TD_OK) {
      const char *ap = td_tensor_data(all);
      for (int s = 0; s < n_shards; s++)
        srcs[s] = ap + ((size_t)owner[s] * (size_t)kmax + (size_t)slot[s]) * len * es;
      td__reduce_n((char *)td_tensor_data(out) + off * es, srcs, n_shards, len, dt,
                   TD_REDUCE_SUM);
    }
    td_tensor_unref(send);
    td_tensor_unref(all);
  }
  td__free(count);
  td__free(slot);
  td__free((void *)srcs);
  return st;
}

td_status td_process_group_all_reduce_ordered(td_process_group *pg, td_tensor *out,
                                              td_tensor *const *mine, int n_mine,
                                              const int *owner, int n_shards, td_reduce_op op) {
  TD_TRY(check_args(pg, out, mine, n_mine, owner, n_shards, op));
  td_status st;
  if (identity_path(pg, out, owner, n_shards)) {
    if (td_tensor_data(out) != td_tensor_data(mine[0]))
      memcpy(td_tensor_data(out), td_tensor_data(mine[0]), td_tensor_nbytes(out));
    st = td_process_group_all_reduce(pg, out, TD_REDUCE_SUM);
  } else {
    st = gather_path(pg, out, mine, n_mine, owner, n_shards);
  }
  if (st == TD_OK && op == TD_REDUCE_AVG)
    td__divide(td_tensor_data(out), (size_t)td_tensor_numel(out), td_tensor_dtype(out), n_shards);
  return st;
}
