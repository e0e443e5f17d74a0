/* nccl_backend.c - the NCCL backend of process groups (TD_PG_BACKEND_NCCL). Compiled only when
 * the build has CUDA and NCCL (TD_HAVE_NCCL); the only file of collectives/ that includes CUDA or
 * NCCL headers.
 *
 * Setup (collective, after the group's TCP ring is up, so every member is known to be alive):
 * group rank 0 makes an ncclUniqueId and publishes it under "pg/<id>/nccl_uid"; every member
 * reads it and calls ncclCommInitRank on the group's device (LOCAL_RANK % device count when
 * LOCAL_RANK is set, else group rank % device count).
 *
 * Operations are enqueued on the device's legacy default stream, the stream every kernel of the
 * CUDA tensor backend uses, so they are ordered with the ops that produced and will consume the
 * tensors. Each call then waits for completion by polling an event, NCCL's asynchronous error
 * and the group's deadline; on an error or a timeout it aborts the communicator (ncclCommAbort,
 * which unblocks the kernels) and fails the group, so a dead peer is an error, not a hang.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../coll_impl.h"

struct td__nccl {
  ncclComm_t comm;
  int device;
  cudaEvent_t done;
  bool aborted;
};

int td__nccl_device(const td__nccl *c) { return c ? c->device : -1; }

static td_status cuda_err(cudaError_t e, const char *what) {
  cudaGetLastError();
  return td_set_error(TD_ERR_DEVICE, "nccl backend: %s: %s", what, cudaGetErrorString(e));
}

static td_status nccl_err(ncclResult_t r, const char *what) {
  return td_set_error(r == ncclSystemError || r == ncclRemoteError ? TD_ERR_UNAVAILABLE
                                                                   : TD_ERR_INTERNAL,
                      "nccl backend: %s: %s", what, ncclGetErrorString(r));
}

static td_status pick_device(td_process_group *pg, int *out) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count <= 0) {
    cudaGetLastError();
    return td_set_error(TD_ERR_DEVICE, "process_group_create: the NCCL backend needs a CUDA "
                        "device and this process has none");
  }
  const char *lr = getenv("LOCAL_RANK");
  int base = lr && *lr ? atoi(lr) : pg->rank;
  *out = (base < 0 ? 0 : base) % count;
  return TD_OK;
}

td_status td__nccl_create(td_process_group *pg, td__nccl **out) {
  td__nccl *c = td__calloc(1, sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  td_status st = pick_device(pg, &c->device);
  ncclUniqueId uid;
  char key[96];
  td__pg_key(pg, "nccl_uid", key, sizeof key);
  if (st == TD_OK && pg->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) st = nccl_err(r, "ncclGetUniqueId");
    if (st == TD_OK) st = td__store_set(pg->sc, key, &uid, sizeof uid);
  } else if (st == TD_OK) {
    uint8_t *v = NULL;
    size_t n = 0;
    st = td__store_wait_key(pg->sc, key, td__pg_deadline(pg), NULL, &v, &n);
    if (st == TD_OK && n != sizeof uid)
      st = td_set_error(TD_ERR_FORMAT, "process_group_create: bad NCCL id (%zu bytes)", n);
    if (st == TD_OK) memcpy(&uid, v, sizeof uid);
    td__free(v);
  }
  if (st == TD_OK) {
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) st = cuda_err(e, "cudaSetDevice");
  }
  if (st == TD_OK) {
    ncclResult_t r = ncclCommInitRank(&c->comm, pg->size, uid, pg->rank);
    if (r != ncclSuccess) st = nccl_err(r, "ncclCommInitRank");
  }
  if (st == TD_OK) {
    cudaError_t e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e != cudaSuccess) st = cuda_err(e, "cudaEventCreate");
  }
  if (st != TD_OK) {
    td__nccl_destroy(c);
    return st;
  }
  *out = c;
  return TD_OK;
}

void td__nccl_destroy(td__nccl *c) {
  if (!c) return;
  cudaSetDevice(c->device);
  if (c->done) cudaEventDestroy(c->done);
  if (c->comm) {
    if (c->aborted) ncclCommAbort(c->comm);
    else ncclCommDestroy(c->comm);
  }
  td__free(c);
}

static ncclDataType_t nccl_dtype(td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F32: return ncclFloat32;
    case TD_DTYPE_F64: return ncclFloat64;
    case TD_DTYPE_I64: return ncclInt64;
  }
  return ncclFloat32;
}

static td_status nccl_op(td_reduce_op op, ncclRedOp_t *out) {
  switch (op) {
    case TD_REDUCE_SUM: *out = ncclSum; return TD_OK;
    case TD_REDUCE_MAX: *out = ncclMax; return TD_OK;
    case TD_REDUCE_AVG:
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000
      *out = ncclAvg;
      return TD_OK;
#else
      return td_set_error(TD_ERR_UNSUPPORTED, "nccl backend: avg needs NCCL >= 2.10");
#endif
  }
  return td_set_error(TD_ERR_INVALID, "nccl backend: unknown reduce op %d", (int)op);
}

/* Waits until the work enqueued so far finished, failing (and aborting) on an asynchronous NCCL
 * error or at the group's deadline. */
static td_status wait_done(td_process_group *pg, const char *what) {
  td__nccl *c = pg->nccl;
  char msg[400];
  cudaError_t e = cudaEventRecord(c->done, cudaStreamLegacy);
  if (e != cudaSuccess) return cuda_err(e, "cudaEventRecord");
  uint64_t deadline = td__pg_deadline(pg);
  for (;;) {
    e = cudaEventQuery(c->done);
    if (e == cudaSuccess) return TD_OK;
    if (e != cudaErrorNotReady) {
      snprintf(msg, sizeof msg, "%s: CUDA error: %s", what, cudaGetErrorString(e));
      cudaGetLastError();
      c->aborted = true;
      return td__pg_fail(pg, TD_ERR_DEVICE, msg);
    }
    ncclResult_t ar = ncclSuccess;
    ncclCommGetAsyncError(c->comm, &ar);
    if (ar != ncclSuccess || td__now_ns() >= deadline) {
      c->aborted = true;
      if (ar != ncclSuccess)
        snprintf(msg, sizeof msg, "%s: NCCL error on %s (rank %d): %s", what,
                 pg->names[pg->rank], pg->ranks[pg->rank], ncclGetErrorString(ar));
      else
        snprintf(msg, sizeof msg, "%s timed out after %lld ms on %s (rank %d) (a member is dead "
                 "or did not call it)", what, (long long)pg->timeout_ms, pg->names[pg->rank],
                 pg->ranks[pg->rank]);
      /* abort now so the kernels stop; destroy will not wait on them */
      ncclCommAbort(c->comm);
      c->comm = NULL;
      return td__pg_fail(pg, ar != ncclSuccess ? TD_ERR_UNAVAILABLE : TD_ERR_TIMEOUT, msg);
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

static td_status enter(td_process_group *pg) {
  if (!pg->nccl || !pg->nccl->comm)
    return td_set_error(TD_ERR_STATE, "nccl backend: the communicator was aborted");
  cudaError_t e = cudaSetDevice(pg->nccl->device);
  return e == cudaSuccess ? TD_OK : cuda_err(e, "cudaSetDevice");
}

td_status td__nccl_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op) {
  ncclRedOp_t rop = ncclSum;
  TD_TRY(nccl_op(op, &rop));
  TD_TRY(enter(pg));
  void *p = td_tensor_data(t);
  ncclResult_t r = ncclAllReduce(p, p, (size_t)td_tensor_numel(t), nccl_dtype(td_tensor_dtype(t)),
                                 rop, pg->nccl->comm, cudaStreamLegacy);
  if (r != ncclSuccess) return nccl_err(r, "ncclAllReduce");
  return wait_done(pg, "all_reduce");
}

td_status td__nccl_broadcast(td_process_group *pg, td_tensor *t, int root) {
  TD_TRY(enter(pg));
  void *p = td_tensor_data(t);
  ncclResult_t r = ncclBroadcast(p, p, (size_t)td_tensor_numel(t), nccl_dtype(td_tensor_dtype(t)),
                                 root, pg->nccl->comm, cudaStreamLegacy);
  if (r != ncclSuccess) return nccl_err(r, "ncclBroadcast");
  return wait_done(pg, "broadcast");
}

td_status td__nccl_all_gather(td_process_group *pg, void *out, const void *in, size_t count,
                              td_dtype dt) {
  TD_TRY(enter(pg));
  ncclResult_t r = ncclAllGather(in, out, count, nccl_dtype(dt), pg->nccl->comm,
                                 cudaStreamLegacy);
  if (r != ncclSuccess) return nccl_err(r, "ncclAllGather");
  return wait_done(pg, "all_gather");
}

td_status td__nccl_reduce_scatter(td_process_group *pg, void *out, const void *in, size_t count,
                                  td_dtype dt, td_reduce_op op) {
  ncclRedOp_t rop = ncclSum;
  TD_TRY(nccl_op(op, &rop));
  TD_TRY(enter(pg));
  ncclResult_t r = ncclReduceScatter(in, out, count, nccl_dtype(dt), rop, pg->nccl->comm,
                                     cudaStreamLegacy);
  if (r != ncclSuccess) return nccl_err(r, "ncclReduceScatter");
  return wait_done(pg, "reduce_scatter");
}
