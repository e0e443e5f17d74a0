/* op.c - what an operation is, at the bottom of the collectives: its kind and header (kind,
 * sequence, element count, dtype, reduce op or root, algorithm), the words messages use for them,
 * and the buffer slots of the list forms. Every other file of collectives/ may use it; it uses
 * none of them.
 */
#include <stdio.h>
#include <string.h>

#include "coll_impl.h"

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

static const char *const algo_names[TD__A_COUNT] = {
    [TD__A_LOCAL] = "local",          [TD__A_NCCL] = "nccl",
    [TD__A_RING] = "ring",            [TD__A_SHM_DIRECT] = "shm_direct",
    [TD__A_SHM_RSAG] = "shm_rsag",    [TD__A_SHM_BCAST] = "shm_bcast",
    [TD__A_SHM_GATHER] = "shm_gather", [TD__A_SHM_SCATTER] = "shm_scatter",
    [TD__A_SHM_BARRIER] = "shm_barrier", [TD__A_CMA_RSAG] = "cma_rsag",
    [TD__A_CMA_BCAST] = "cma_bcast",  [TD__A_CMA_GATHER] = "cma_gather",
    [TD__A_CMA_SCATTER] = "cma_scatter"};

const char *td__algo_name(uint32_t a) { return a < TD__A_COUNT ? algo_names[a] : "?"; }

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

void td__op_header(const td__op *op, uint64_t seq, td__algo algo, td__op_hdr *h) {
  bool barrier = op->kind == TD__K_BARRIER;
  *h = (td__op_hdr){
      .magic = TD__OP_MAGIC,
      .kind = op->kind,
      .seq = seq,
      .count = barrier ? 1 : (uint64_t)td_tensor_numel(op->t),
      .dtype = barrier ? (int32_t)TD_DTYPE_F32 : (int32_t)td_tensor_dtype(op->t),
      .arg = op->kind == TD__K_BROADCAST ? op->root
             : barrier || op->kind == TD__K_ALL_GATHER ? 0
                                                       : (int32_t)op->rop,
      .algo = (uint32_t)algo};
}

size_t td__op_bytes(const td__op *op, int size) {
  if (op->kind == TD__K_BARRIER) return 0;
  size_t nb = td_tensor_nbytes(op->t);
  return op->kind == TD__K_ALL_GATHER || op->kind == TD__K_REDUCE_SCATTER ? nb * (size_t)size : nb;
}

void td__op_gather_slots(const td__op *op, int size, td__chunk *out) {
  size_t nb = td_tensor_nbytes(op->t);
  for (int i = 0; i < size; i++)
    out[i] = (td__chunk){op->list ? td_tensor_data(op->list[i])
                                  : (char *)td_tensor_data(op->whole) + (size_t)i * nb, nb};
}

void td__op_scatter_slots(const td__op *op, int size, const char **out) {
  size_t nb = td_tensor_nbytes(op->t);
  for (int i = 0; i < size; i++)
    out[i] = op->list ? td_tensor_data(op->list[i])
                      : (const char *)td_tensor_data(op->whole) + (size_t)i * nb;
}
