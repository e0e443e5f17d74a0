/* nccl_backend.c - the NCCL backend of process groups (TD_PG_BACKEND_NCCL). Compiled only when
 * the build has CUDA and NCCL (TD_HAVE_NCCL); the only file of collectives/ that includes CUDA or
 * NCCL headers (its CUDA kernels live in tensor/cuda/cuda_collective.cu).
 *
 * Setup (collective, after the group's TCP ring is up, so every member is known to be alive):
 *   1. Each member picks its device per process, never per group (td__cuda_process_device: the
 *      device of td_cuda_set_device, else LOCAL_RANK % count, else world rank % count), so the
 *      world group and every subgroup of a process use the same GPU; it selects the device and
 *      reads its PCI bus id. A member that fails here still takes part in step 2 with its error.
 *   2. The members all-gather one readiness record each over the ring (host, boot id, device,
 *      bus id, status, message). Every member then reaches the same verdict: the first member
 *      that failed is reported by all; two members on one machine (same boot id) with the same
 *      GPU (same bus id) are refused before NCCL sees them (NCCL would fail on some of them and
 *      leave the others waiting).
 *   3. Group rank 0 makes the ncclUniqueId, which a second ring all-gather hands to everyone.
 *   4. Each member marks "pg/<id>/nccl_arrived/<rank>" in the store, creates its communicator
 *      non-blocking (ncclCommInitRankConfig, config.blocking = 0) and polls it (wait_comm) until
 *      it is ready, fails, a member fails, or the group's deadline passes; then it marks
 *      "pg/<id>/nccl_ready/<rank>". On a timeout it names the members that never arrived or never
 *      got ready, aborts its communicator (ncclCommAbort) and fails the group.
 *
 * Operations are enqueued on the device's legacy default stream, the stream every kernel of the
 * CUDA tensor backend uses, so they are ordered with the ops that produced and will consume the
 * tensors. Before any of them, ring.c exchanges the operation header on the host ring (kind,
 * sequence, count, dtype, op or root), as for CPU groups, so mismatched calls fail cleanly
 * instead of letting NCCL read past a smaller buffer. Each call then polls (wait_comm) the
 * communicator state (a non-blocking communicator may still be enqueueing), then an event
 * recorded after the operation; meanwhile it watches the ring connections (a dead neighbour
 * closes them), the store's failure record of the group (any member's failure, with its cause)
 * and the deadline. On any of these it aborts the communicator, which stops the kernels, and
 * fails the group: a dead peer is an error that names it, not a hang.
 *
 * MAX on float tensors reduces order keys (tensor/cuda/cuda_collective.cu) as integers, so NaN
 * propagates exactly as in the CPU backend; NCCL's own float MAX may drop it.
 *
 * Destruction finalises the communicator (bounded wait), or aborts it when the group is broken or
 * finalising does not finish in time; the calling thread's current device is restored.
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../tensor/cuda/cuda_collective.h"
#include "../../tensor/device_count.h"
#include "../coll_impl.h"

#define STORE_POLL_NS 100000000ull /* how often a waiting member reads the failure record */
#define DESTROY_WAIT_MS 10000      /* at most this long for ncclCommFinalize at destruction */

struct td__nccl {
  td_process_group *pg; /* the owning group (borrowed) */
  ncclComm_t comm;      /* NULL after an abort */
  int device;
  cudaEvent_t done;
  bool aborted;
};

void (*td__nccl_test_before_enqueue)(td_process_group *pg, const char *what);

static td_status cuda_err(cudaError_t e, const char *what) {
  cudaGetLastError();
  return td_set_error(TD_ERR_DEVICE, "nccl backend: %s: %s", what, cudaGetErrorString(e));
}

static td_status nccl_status(ncclResult_t r) {
  return r == ncclSystemError || r == ncclRemoteError ? TD_ERR_UNAVAILABLE : TD_ERR_INTERNAL;
}

static void sleep_ns(long ns) {
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

/* ---- waiting with failure detection ---- */

/* Aborts c's communicator (stopping its kernels) and fails the group with st/msg, or with the
 * failure another member recorded first (td__pg_fail). */
static td_status abort_fail(td_process_group *pg, td__nccl *c, td_status st, const char *msg) {
  if (c->comm) ncclCommAbort(c->comm);
  c->comm = NULL;
  c->aborted = true;
  return td__pg_fail(pg, st, msg);
}

/* Returns true (with a message in msg) when a ring neighbour closed its connection or the store
 * holds a failure record of the group (read at most every STORE_POLL_NS, tracked in
 * *next_store). The left neighbour may already have sent the next header (peeked, not read). */
static bool member_failed(td_process_group *pg, const char *what, uint64_t *next_store, char *msg,
                          size_t n) {
  char who[160], me[160], b;
  td__pg_who(pg, pg->rank, me, sizeof me);
  int fds[2] = {pg->recv_fd, pg->send_fd};
  int nb[2] = {(pg->rank + pg->size - 1) % pg->size, (pg->rank + 1) % pg->size};
  for (int i = 0; i < 2; i++) {
    if (fds[i] < 0) continue;
    ssize_t k = recv(fds[i], &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      snprintf(msg, n, "%s is unavailable: connection closed (%s; seen by %s during %s)",
               td__pg_who(pg, nb[i], who, sizeof who), k == 0 ? "end of stream" : strerror(errno),
               me, what);
      return true;
    }
  }
  uint64_t now = td__now_ns();
  if (now < *next_store) return false;
  *next_store = now + STORE_POLL_NS;
  char key[96];
  uint8_t *v = NULL;
  size_t vn = 0;
  bool found = false;
  td__pg_key(pg, "failed", key, sizeof key);
  if (td__store_get(pg->sc, key, &v, &vn, &found) == TD_OK && found)
    snprintf(msg, n, "another member of the group failed during %s", what);
  td__free(v);
  return found;
}

/* Names the members without the store key pg/<id>/<suffix>/<rank> into buf. */
static void missing_members(td_process_group *pg, const char *suffix, char *buf, size_t n) {
  size_t len = 0;
  buf[0] = 0;
  for (int r = 0; r < pg->size && len + 1 < n; r++) {
    char key[128], sfx[48], who[160];
    snprintf(sfx, sizeof sfx, "%s/%d", suffix, r);
    uint8_t *v = NULL;
    size_t vn = 0;
    bool found = false;
    if (td__store_get(pg->sc, td__pg_key(pg, sfx, key, sizeof key), &v, &vn, &found) == TD_OK &&
        !found) {
      int k = snprintf(buf + len, n - len, "%s%s", len ? ", " : "",
                       td__pg_who(pg, r, who, sizeof who));
      len += k > 0 ? (size_t)k : 0;
    }
    td__free(v);
  }
  if (len >= n) len = n - 1;
  buf[len] = 0;
}

/* Polls c until its state is ready (setup: ev false) or, with ev, until the work enqueued so far
 * has finished (an event is recorded once the communicator is no longer enqueueing). Fails and
 * aborts on an NCCL or CUDA error, a failed member, or at deadline (see the file comment). */
static td_status wait_comm(td_process_group *pg, td__nccl *c, const char *what, bool ev,
                           uint64_t deadline) {
  char msg[700], me[160];
  bool recorded = false;
  long pause = 2000;
  uint64_t next_store = td__now_ns() + STORE_POLL_NS;
  td__pg_who(pg, pg->rank, me, sizeof me);
  for (;;) {
    ncclResult_t state = ncclSuccess, r = ncclCommGetAsyncError(c->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state != ncclSuccess && state != ncclInProgress) {
      snprintf(msg, sizeof msg, "%s: NCCL error on %s: %s (%s)", what, me,
               ncclGetErrorString(state), ncclGetLastError(c->comm));
      return abort_fail(pg, c, nccl_status(state), msg);
    }
    if (state == ncclSuccess) {
      if (!ev) return TD_OK;
      cudaError_t e = recorded ? cudaSuccess : cudaEventRecord(c->done, cudaStreamLegacy);
      recorded = true;
      if (e == cudaSuccess) e = cudaEventQuery(c->done);
      if (e == cudaSuccess) return TD_OK;
      if (e != cudaErrorNotReady) {
        snprintf(msg, sizeof msg, "%s: CUDA error on %s: %s", what, me, cudaGetErrorString(e));
        cudaGetLastError();
        return abort_fail(pg, c, TD_ERR_DEVICE, msg);
      }
    }
    if (member_failed(pg, what, &next_store, msg, sizeof msg))
      return abort_fail(pg, c, TD_ERR_UNAVAILABLE, msg);
    if (td__now_ns() >= deadline) {
      char miss[300] = "";
      if (!ev) {
        char arrived[256], ready[256];
        missing_members(pg, "nccl_arrived", arrived, sizeof arrived);
        missing_members(pg, "nccl_ready", ready, sizeof ready);
        if (arrived[0]) snprintf(miss, sizeof miss, "; never arrived: %s", arrived);
        else if (ready[0]) snprintf(miss, sizeof miss, "; not ready: %s", ready);
      }
      snprintf(msg, sizeof msg, "%s timed out after %lld ms on %s%s", what,
               (long long)pg->timeout_ms, me,
               miss[0] ? miss : " (a member is dead, stuck, or did not call it)");
      return abort_fail(pg, c, TD_ERR_TIMEOUT, msg);
    }
    sleep_ns(pause);
    if (pause < 250000) pause *= 2; /* 2 us doubling to 256 us: small collectives stay fast */
  }
}

/* ---- setup ---- */

typedef struct ready_rec {
  int32_t status; /* td_status of the member's local setup; TD_OK when ready */
  int32_t device; /* its CUDA ordinal */
  char host[64];  /* host name, for messages */
  char boot[40];  /* kernel boot id: equal exactly on one machine */
  char bus[32];   /* PCI bus id of the device */
  char why[48];   /* where the device choice came from */
  char msg[320];  /* the error, when status != TD_OK */
} ready_rec;

static void read_boot_id(char *buf, size_t n) {
  buf[0] = 0;
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (fgets(buf, (int)n, f)) buf[strcspn(buf, "\n")] = 0;
  fclose(f);
}

/* Picks and selects this member's device and fills the record (status and msg on failure). */
static void local_setup(td_process_group *pg, td__nccl *c, ready_rec *rec) {
  memset(rec, 0, sizeof *rec);
  gethostname(rec->host, sizeof rec->host - 1);
  read_boot_id(rec->boot, sizeof rec->boot);
  if (!rec->boot[0]) snprintf(rec->boot, sizeof rec->boot, "%.39s", rec->host);
  const char *why = "";
  int count = td_cuda_device_count();
  c->device = td__cuda_process_device(pg->ranks[pg->rank], count, &why);
  rec->device = c->device;
  snprintf(rec->why, sizeof rec->why, "%s", why);
  td_status st = TD_OK;
  cudaError_t e = cudaSuccess;
  if (c->device < 0)
    st = td_set_error(TD_ERR_DEVICE, "the NCCL backend needs a CUDA device and this process has "
                      "none");
  else if ((e = cudaSetDevice(c->device)) != cudaSuccess)
    st = cuda_err(e, "cudaSetDevice");
  else if ((e = cudaDeviceGetPCIBusId(rec->bus, sizeof rec->bus, c->device)) != cudaSuccess)
    st = cuda_err(e, "cudaDeviceGetPCIBusId");
  rec->status = (int32_t)st;
  if (st != TD_OK) snprintf(rec->msg, sizeof rec->msg, "%s", td_last_error());
}

/* All-gathers sz bytes of every member over the ring: all[r * sz ..] gets member r's `mine`. */
static td_status ring_all_gather(td_process_group *pg, const void *mine, size_t sz, char *all,
                                 uint64_t deadline, const char *what) {
  int n = pg->size, r = pg->rank;
  memcpy(all + (size_t)r * sz, mine, sz);
  for (int s = 0; s < n - 1; s++) {
    int so = ((r - s) % n + n) % n, ro = ((r - s - 1) % n + n) % n;
    TD_TRY(td__ring_xchg(pg, all + (size_t)so * sz, sz, all + (size_t)ro * sz, sz, deadline, what));
  }
  return TD_OK;
}

/* The common verdict on the readiness records: the first member that failed, then two members
 * on one GPU. */
static td_status check_records(td_process_group *pg, const ready_rec *recs) {
  char a[160], b[160];
  for (int i = 0; i < pg->size; i++) {
    if (recs[i].status != TD_OK)
      return td_set_error((td_status)recs[i].status, "process_group_create: NCCL setup failed on "
                          "%s: %.320s", td__pg_who(pg, i, a, sizeof a), recs[i].msg);
  }
  for (int i = 0; i < pg->size; i++) {
    for (int j = i + 1; j < pg->size; j++) {
      if (strcmp(recs[i].boot, recs[j].boot) != 0 || strcmp(recs[i].bus, recs[j].bus) != 0)
        continue;
      return td_set_error(TD_ERR_INVALID, "process_group_create: %s and %s would both use GPU %s "
                          "on host %s (cuda:%d, chosen by %s); NCCL needs one GPU per member: "
                          "give each process its own with LOCAL_RANK or td_cuda_set_device()",
                          td__pg_who(pg, i, a, sizeof a), td__pg_who(pg, j, b, sizeof b),
                          recs[i].bus, recs[i].host, recs[i].device, recs[i].why);
    }
  }
  return TD_OK;
}

static void mark(td_process_group *pg, const char *suffix) {
  char key[128], sfx[48];
  snprintf(sfx, sizeof sfx, "%s/%d", suffix, pg->rank);
  td__store_set(pg->sc, td__pg_key(pg, sfx, key, sizeof key), "1", 1);
}

/* Steps 3 and 4 of the file comment. */
static td_status init_comm(td_process_group *pg, td__nccl *c, uint64_t deadline) {
  ncclUniqueId uid;
  memset(&uid, 0, sizeof uid);
  if (pg->rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess) { /* recorded for the others, who are waiting for the id */
      char msg[300];
      snprintf(msg, sizeof msg, "process_group_create: ncclGetUniqueId failed on %s: %s",
               td__pg_who(pg, 0, (char[160]){0}, 160), ncclGetErrorString(r));
      return td__pg_fail(pg, nccl_status(r), msg);
    }
  }
  if (pg->size > 1) {
    char *ids = td__calloc((size_t)pg->size, sizeof uid);
    if (!ids) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
    td_status st = ring_all_gather(pg, &uid, sizeof uid, ids, deadline, "process_group_create");
    if (st == TD_OK) memcpy(&uid, ids, sizeof uid);
    td__free(ids);
    TD_TRY(st);
  }
  mark(pg, "nccl_arrived");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, pg->size, uid, pg->rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    char msg[400];
    snprintf(msg, sizeof msg, "process_group_create: ncclCommInitRankConfig failed on %s: %s",
             td__pg_who(pg, pg->rank, (char[160]){0}, 160), ncclGetErrorString(r));
    return abort_fail(pg, c, nccl_status(r), msg);
  }
  TD_TRY(wait_comm(pg, c, "process_group_create (NCCL communicator setup)", false, deadline));
  mark(pg, "nccl_ready");
  return TD_OK;
}

static void nccl_free(td__nccl *c);

static td_status nccl_create(td_process_group *pg, td__nccl **out) {
  td__nccl *c = td__calloc(1, sizeof *c);
  ready_rec *recs = td__calloc((size_t)pg->size, sizeof *recs);
  td_status st = TD_OK;
  if (!c || !recs) {
    st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
    goto out;
  }
  c->pg = pg;
  uint64_t deadline = td__pg_deadline(pg);
  ready_rec mine;
  local_setup(pg, c, &mine);
  if (pg->size > 1)
    st = ring_all_gather(pg, &mine, sizeof mine, (char *)recs, deadline, "process_group_create");
  else
    recs[0] = mine;
  if (st == TD_OK) st = check_records(pg, recs);
  if (st == TD_OK) st = init_comm(pg, c, deadline);
  if (st == TD_OK) {
    cudaError_t e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e != cudaSuccess) st = cuda_err(e, "cudaEventCreate");
  }
out:
  td__free(recs);
  if (st != TD_OK) {
    nccl_free(c);
    return st;
  }
  *out = c;
  return TD_OK;
}

static void nccl_free(td__nccl *c) {
  if (!c) return;
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  if (c->device >= 0) cudaSetDevice(c->device);
  if (c->done) cudaEventDestroy(c->done);
  if (c->comm) {
    bool clean = !c->aborted && !(c->pg && c->pg->broken);
    if (clean) {
      ncclResult_t r = ncclCommFinalize(c->comm);
      clean = r == ncclSuccess || r == ncclInProgress;
    }
    uint64_t deadline = td__now_ns() + (uint64_t)DESTROY_WAIT_MS * 1000000ull;
    ncclResult_t state = ncclInProgress;
    while (clean) {
      if (ncclCommGetAsyncError(c->comm, &state) != ncclSuccess) state = ncclInternalError;
      if (state != ncclInProgress || td__now_ns() >= deadline) break;
      sleep_ns(100000);
    }
    if (clean && state == ncclSuccess) ncclCommDestroy(c->comm);
    else ncclCommAbort(c->comm);
  }
  if (prev >= 0) cudaSetDevice(prev);
  cudaGetLastError();
  td__free(c);
}

/* ---- operations ---- */

static ncclDataType_t nccl_dtype(td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F32: return ncclFloat32;
    case TD_DTYPE_F64: return ncclFloat64;
    case TD_DTYPE_I64: return ncclInt64;
    case TD_DTYPE_BF16: return ncclBfloat16;
    case TD_DTYPE_F16: return ncclFloat16;
    default: break; /* transport dtypes never live on a GPU (tensor.h) */
  }
  return ncclFloat32;
}

/* The NCCL reduction and the type it reduces: float MAX reduces order keys as integers. */
static td_status nccl_op(td_reduce_op op, td_dtype dt, ncclRedOp_t *rop, ncclDataType_t *ty,
                         bool *keys) {
  *ty = nccl_dtype(dt);
  *keys = false;
  switch (op) {
    case TD_REDUCE_SUM: *rop = ncclSum; return TD_OK;
    case TD_REDUCE_MAX:
      *rop = ncclMax;
      if (dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64) { /* 16-bit floats: NCCL's own max */
        *keys = true;
        *ty = dt == TD_DTYPE_F32 ? ncclInt32 : ncclInt64;
      }
      return TD_OK;
    case TD_REDUCE_AVG:
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= 21000
      *rop = ncclAvg;
      return TD_OK;
#else
      return td_set_error(TD_ERR_UNSUPPORTED, "nccl backend: avg needs NCCL >= 2.10");
#endif
  }
  return td_set_error(TD_ERR_INVALID, "nccl backend: unknown reduce op %d", (int)op);
}

/* Makes the communicator's device current and runs the test hook; refuses an aborted group. */
static td_status enter(td_process_group *pg, const char *what) {
  if (!pg->nccl || !pg->nccl->comm)
    return td_set_error(TD_ERR_STATE, "nccl backend: the communicator was aborted");
  cudaError_t e = cudaSetDevice(pg->nccl->device);
  if (e != cudaSuccess) return cuda_err(e, "cudaSetDevice");
  if (td__nccl_test_before_enqueue) td__nccl_test_before_enqueue(pg, what);
  return TD_OK;
}

/* Waits for an enqueued operation (r: what the enqueue call returned). */
static td_status finish(td_process_group *pg, ncclResult_t r, const char *what) {
  if (r != ncclSuccess && r != ncclInProgress) {
    char msg[400];
    snprintf(msg, sizeof msg, "%s: NCCL refused the operation on %s: %s", what,
             td__pg_who(pg, pg->rank, (char[160]){0}, 160), ncclGetErrorString(r));
    return abort_fail(pg, pg->nccl, nccl_status(r), msg);
  }
  return wait_comm(pg, pg->nccl, what, true, td__pg_deadline(pg));
}

static td_status nccl_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op) {
  ncclRedOp_t rop = ncclSum;
  ncclDataType_t ty = ncclFloat32;
  bool keys = false;
  td_dtype dt = td_tensor_dtype(t);
  TD_TRY(nccl_op(op, dt, &rop, &ty, &keys));
  TD_TRY(enter(pg, "all_reduce"));
  void *p = td_tensor_data(t);
  size_t n = (size_t)td_tensor_numel(t);
  int dev = pg->nccl->device;
  if (keys) TD_TRY(td__cu_order_keys(dt, dev, p, p, n, false));
  td_status st = finish(pg, ncclAllReduce(p, p, n, ty, rop, pg->nccl->comm, cudaStreamLegacy),
                        "all_reduce");
  if (keys) {
    td_status ds = td__cu_order_keys(dt, dev, p, p, n, true); /* floats again, even on failure */
    if (st == TD_OK) st = ds;
  }
  return st;
}

static td_status nccl_broadcast(td_process_group *pg, td_tensor *t, int root) {
  TD_TRY(enter(pg, "broadcast"));
  void *p = td_tensor_data(t);
  return finish(pg, ncclBroadcast(p, p, (size_t)td_tensor_numel(t),
                                  nccl_dtype(td_tensor_dtype(t)), root, pg->nccl->comm,
                                  cudaStreamLegacy), "broadcast");
}

static td_status nccl_all_gather(td_process_group *pg, void *out, const void *in,
                                 size_t count, td_dtype dt) {
  TD_TRY(enter(pg, "all_gather"));
  return finish(pg, ncclAllGather(in, out, count, nccl_dtype(dt), pg->nccl->comm,
                                  cudaStreamLegacy), "all_gather");
}

static td_status nccl_reduce_scatter(td_process_group *pg, void *out, const void *in,
                                     size_t count, td_dtype dt, td_reduce_op op) {
  ncclRedOp_t rop = ncclSum;
  ncclDataType_t ty = ncclFloat32;
  bool keys = false;
  TD_TRY(nccl_op(op, dt, &rop, &ty, &keys));
  TD_TRY(enter(pg, "reduce_scatter"));
  int dev = pg->nccl->device;
  td_tensor *tmp = NULL;
  const void *src = in;
  if (keys) { /* encode a copy: the input is the caller's */
    int64_t total = (int64_t)count * pg->size;
    TD_TRY(td_tensor_empty(&total, 1, dt, td_device_cuda(dev), &tmp));
    td_status st = td__cu_order_keys(dt, dev, in, td_tensor_data(tmp), (size_t)total, false);
    if (st != TD_OK) {
      td_tensor_unref(tmp);
      return st;
    }
    src = td_tensor_data(tmp);
  }
  td_status st = finish(pg, ncclReduceScatter(src, out, count, ty, rop, pg->nccl->comm,
                                              cudaStreamLegacy), "reduce_scatter");
  if (keys) {
    td_status ds = td__cu_order_keys(dt, dev, out, out, count, true);
    if (st == TD_OK) st = ds;
  }
  td_tensor_unref(tmp); /* the allocator reuses it only after the queued work (one stream) */
  return st;
}

/* ---- the backend ---- */

/* NCCL works on single buffers: the list forms go through a temporary. */
static td_status run_op(td_process_group *pg, const td__op *op) {
  td_dtype dt = td_tensor_dtype(op->t);
  int64_t numel = td_tensor_numel(op->t);
  switch (op->kind) {
    case TD__K_ALL_REDUCE: return nccl_all_reduce(pg, op->t, op->rop);
    case TD__K_BROADCAST: return nccl_broadcast(pg, op->t, op->root);
    case TD__K_ALL_GATHER: {
      if (op->whole)
        return nccl_all_gather(pg, td_tensor_data(op->whole), td_tensor_data(op->t),
                                   (size_t)numel, dt);
      int64_t shape[1] = {numel * pg->size};
      td_tensor *tmp = NULL;
      TD_TRY(td_tensor_empty(shape, 1, dt, td_tensor_device(op->t), &tmp));
      td_status st = nccl_all_gather(pg, td_tensor_data(tmp), td_tensor_data(op->t),
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
        return nccl_reduce_scatter(pg, td_tensor_data(op->t), td_tensor_data(op->whole),
                                       (size_t)numel, dt, op->rop);
      td_tensor **flat = td__calloc((size_t)pg->size, sizeof *flat), *cat = NULL;
      if (!flat) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
      int64_t shape[1] = {-1};
      td_status st = TD_OK;
      for (int i = 0; st == TD_OK && i < pg->size; i++)
        st = td_tensor_reshape(op->list[i], shape, 1, &flat[i]);
      if (st == TD_OK) st = td_tensor_cat(flat, pg->size, 0, &cat);
      if (st == TD_OK)
        st = nccl_reduce_scatter(pg, td_tensor_data(op->t), td_tensor_data(cat),
                                     (size_t)numel, dt, op->rop);
      for (int i = 0; i < pg->size; i++) td_tensor_unref(flat[i]);
      td__free(flat);
      td_tensor_unref(cat);
      return st;
    }
    default: return TD_OK;
  }
}

/* NCCL groups check the header on the host-side ring first: NCCL itself would read past a
 * smaller buffer or hang on a mismatch. */
static td_status nccl_run(td_process_group *pg, const td__op *op, const td__op_hdr *h,
                          uint64_t dl) {
  if (pg->size > 1) TD_TRY(td__ring_check(pg, h, dl));
  return run_op(pg, op);
}

static td_status nccl_setup(td_process_group *pg, uint64_t deadline, bool *serves) {
  (void)deadline; /* the group's own: td__pg_deadline at the start of create */
  *serves = false;
  if (pg->backend != TD_PG_BACKEND_NCCL) return TD_OK;
  TD_TRY(nccl_create(pg, &pg->nccl));
  pg->nccl_device = pg->nccl->device;
  *serves = true;
  return TD_OK;
}

static void nccl_destroy(td_process_group *pg) {
  nccl_free(pg->nccl);
  pg->nccl = NULL;
}

/* No fail entry: a waiting member watches the ring and the store's failure record itself
 * (wait_comm). */
const td__coll_backend td__coll_nccl = {
    .name = "nccl",
    .setup = nccl_setup,
    .destroy = nccl_destroy,
    .run = nccl_run,
    .avg_is_sum = false,
};
