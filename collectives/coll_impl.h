/* coll_impl.h - internals shared by the process-group files:
 *   process_group.c  creation (group id and addresses through the store), ring connections,
 *                    the deadline-bound exchange primitive, failure reporting;
 *   ops.c            the public operation entry points (sync and async), argument checks, the
 *                    choice of algorithm and the dispatch to a backend;
 *   work.c           the per-group queue and worker thread behind the asynchronous calls;
 *   ring.c           the CPU ring algorithms over TCP (members on any hosts);
 *   shm.c            the same-host shared-memory transport (segment, rounds, waiting, liveness);
 *   shm_coll.c       the CPU algorithms over that transport;
 *   reduce.c         the element kernels (two-way and n-way reductions, AVG division);
 *   ddp.c            the data-parallel gradient helper;
 *   replicas.c       what ddp.c and zero.c share (parameter checks, buckets, .grad writes);
 *   zero.c           ZeRO stages 1 and 2 (sharded optimizer state, stage 2 overlap);
 *   zero_ckpt.c      ZeRO's sharded checkpoints (save, consolidate, load);
 *   nccl/nccl_backend.c  the NCCL backend (only in builds with NCCL; the only file including
 *                    CUDA or NCCL headers).
 */
#ifndef TD_COLLECTIVES_IMPL_H
#define TD_COLLECTIVES_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "../rpc/store.h"
#include "tdist/collectives.h"
#include "tdist/optim.h"

#define TD__PG_DEFAULT_TIMEOUT_MS 60000

typedef struct td__nccl td__nccl;
typedef struct td__shm td__shm;
typedef struct td__work td__work;

/* Operation kinds (the wire value of td__op_hdr.kind). */
enum { TD__K_ALL_REDUCE = 1, TD__K_BROADCAST, TD__K_ALL_GATHER, TD__K_REDUCE_SCATTER, TD__K_BARRIER };

#define TD__OP_MAGIC 0x54444f50u /* "TDOP" */

/* The header every member announces at the start of an operation; members compare theirs with
 * the others' (count: elements of the tensor, of the input of all_gather, of the output of
 * reduce_scatter; arg: the reduce op, or the root of a broadcast). */
typedef struct td__op_hdr {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
  uint64_t count;
  int32_t dtype;
  int32_t arg;
  uint32_t algo; /* the algorithm this member chose: members whose settings differ fail */
  uint32_t reserved;
} td__op_hdr;

/* A contiguous piece of a tensor. */
typedef struct td__chunk {
  char *p;
  size_t nbytes;
} td__chunk;

/* Algorithm modes (TD_COLL_ALGO, read at group creation). */
typedef enum td__algo_mode {
  TD__MODE_AUTO = 0,   /* shared memory when every member is on this host, else the ring */
  TD__MODE_RING,       /* the TCP ring for everything */
  TD__MODE_SHM,        /* shared memory (must be possible), algorithm by size */
  TD__MODE_SHM_DIRECT, /* shared memory; all_reduce always one-round ("shm_direct") */
  TD__MODE_SHM_RSAG,   /* shared memory; all_reduce always reduce-scatter + all-gather */
  TD__MODE_CMA,        /* shared memory; single-copy reads whenever possible */
} td__algo_mode;

/* One operation as queued and executed (ops.c, work.c). Tensors are borrowed by the sync calls
 * and referenced by queued work. */
typedef struct td__op {
  uint32_t kind;      /* TD__K_* */
  td_reduce_op rop;   /* reductions */
  int root;           /* broadcast */
  td_tensor *t;       /* all_reduce, broadcast: the tensor; all_gather: the input;
                         reduce_scatter: the output */
  td_tensor *whole;   /* all_gather_into_tensor: the output; reduce_scatter_tensor: the input */
  td_tensor **list;   /* list forms: size tensors (all_gather: outs; reduce_scatter: ins) */
} td__op;

struct td_process_group {
  td_rpc_agent *agent;
  const td__store_client *sc; /* the agent's store client (borrowed) */
  uint64_t id;                /* agreed through the store counter "pg/next_id" */
  int rank, size;             /* group rank and size */
  int *ranks;                 /* size global ranks, increasing */
  char (*names)[128];         /* worker names by group rank */
  td_pg_backend backend;
  int64_t timeout_ms;
  int send_fd; /* connection to the right neighbour (rank + 1), -1 when size == 1 */
  int recv_fd; /* connection from the left neighbour (rank - 1), -1 when size == 1 */
  pthread_mutex_t mu; /* one operation at a time; guards everything below */
  uint64_t seq;       /* operations started */
  uint64_t waited_seq; /* the operation whose long wait was recorded in the store (ring) */
  bool broken;
  td_status broken_status;
  char *broken_msg;
  uint8_t *scratch; /* reused buffer for ring operations */
  size_t scratch_cap;
  td__nccl *nccl; /* NCCL communicator (TD_PG_BACKEND_NCCL) */
  td__shm *shm;   /* same-host shared memory (CPU groups whose members share a host), or NULL */
  td__algo_mode mode;  /* TD_COLL_ALGO at creation */
  size_t direct_max;   /* all_reduce bytes up to which shared memory uses one round */
  td__work *work;      /* asynchronous operations (work.c); created with the group */
};

/* "worker2 (rank 2)" for group rank grank, written into buf (at least 160 bytes). */
const char *td__pg_who(const td_process_group *pg, int grank, char *buf, size_t n);

/* td__coll_check_same_params compares a fingerprint of params[0..np) (count, dtypes, shapes,
 * device types) across pg through an all_gather on dev, so every member fails alike on a
 * mismatch: TD_ERR_SHAPE "<what>: the module of workerN (rank N) has different parameters ...".
 * Collective. (replicas.c) */
td_status td__coll_check_same_params(td_process_group *pg, td_tensor *const *params, size_t np,
                                     td_device dev, const char *what);
/* td__coll_broadcast_tensor broadcasts t from group rank 0 (through a contiguous copy when t is
 * not contiguous). Collective. */
td_status td__coll_broadcast_tensor(td_process_group *pg, td_tensor *t);

/* td__coll_grad_assign writes v into p's .grad in place, or gives p a copy of v as its .grad
 * when it has none (replicas.c). */
td_status td__coll_grad_assign(td_tensor *p, const td_tensor *v);

/* A bucket layout (td__coll_plan_buckets): per parameter its bucket and element offset in it;
 * per bucket its positions [first, first + count) of the order it was planned in and its
 * elements. Arrays of the caller, each with room for n entries. */
typedef struct td__coll_bucket_plan {
  size_t *bucket_of; /* per parameter */
  int64_t *offset;   /* per parameter */
  size_t *first, *count; /* per bucket */
  int64_t *numel;        /* per bucket */
  size_t nbuckets;
} td__coll_bucket_plan;
/* td__coll_plan_buckets packs params, taken in the order order[0..n), into buckets of one dtype
 * and device and at most cap bytes (the first bucket first_cap; a parameter larger than that gets
 * a bucket of its own). Deterministic: the same inputs give the same buckets on every member.
 * (replicas.c, for ddp.c and zero.c) */
void td__coll_plan_buckets(td_tensor *const *params, const size_t *order, size_t n,
                           size_t first_cap, size_t cap, td__coll_bucket_plan *plan);
/* td__coll_bucket_slice returns the view of the flat bucket buffer buf that holds parameter p at
 * element offset, shaped like p. New reference. */
td_status td__coll_bucket_slice(td_tensor *buf, int64_t offset, const td_tensor *p,
                                td_tensor **out);

/* ---- zero.c / zero_ckpt.c ---- */

/* A ZeRO bucket: parameters order[first, first + count) laid end to end (numel elements), padded
 * to size * chunk; member r owns elements [r * chunk, (r + 1) * chunk) of it, which sit at
 * shard_off in its shard gradient. */
typedef struct td__zbucket {
  size_t first, count;
  int64_t numel, chunk, shard_off;
  /* overlapped pass (stage 2 with overlap) */
  td_tensor *buf;   /* size * chunk elements, from the first gradient to the start; else NULL */
  size_t ready;     /* parameters whose gradient arrived */
  td_future *work;  /* its reduce_scatter, once started */
  bool late;        /* a gradient arrived after the start: reduced again at the step */
  int64_t nbytes;   /* its buffer's bytes */
  bool released;    /* its bytes no longer counted in owner->inflight (atomic) */
  struct td_zero *owner;
} td__zbucket;

/* A piece of a parameter in this member's shard: elements [off, off + len) of parameter param
 * (flat, row-major), at shard_off in the shard, in bucket bucket. */
typedef struct td__zseg {
  size_t param, bucket;
  int64_t off, len, shard_off;
} td__zseg;

struct td_zero {
  td_process_group *pg;
  td_zero_options zo;
  size_t np;
  td_tensor **params;   /* owned references, in flat order (the groups' order) */
  size_t *order;        /* bucket layout: order[k] is the parameter at position k */
  size_t *bucket_of;    /* per parameter */
  int64_t *offset;      /* per parameter: element offset in its bucket */
  td__zbucket *b;
  size_t nb;
  size_t nseg;
  td__zseg *segs;
  td_tensor **seg;      /* per segment: the 1-D master values (owned) */
  td_optim *opt;        /* over seg (NULL when this member owns no element) */
  td_optim_kind okind;  /* its kind (checkpoints) */
  double *norm_w;       /* per parameter: weight of its squares in the clipping norm, or NULL */
  td_dtype dt;
  td_device dev;
  /* overlapped passes */
  void *hctx;           /* per parameter: hook context */
  int *hook_handle;
  bool *seen, *late;    /* per parameter, this pass */
  bool armed;
  size_t pending;       /* parameter whose .grad is dropped at the next hook (np: none) */
  size_t next_bucket;
  size_t oldest;        /* started buckets [oldest, next_bucket) may still be in flight */
  td_tensor *sgrad;     /* the pass's shard gradient (S elements) */
  int64_t inflight;     /* bytes of bucket buffers allocated and not yet reduced (atomic: the
                           group's worker thread subtracts) */
  td_status hook_st;
  char hook_msg[512];
  td_zero_stats stats;
  /* stage 3 (zero3.c) */
  size_t nu;             /* units */
  size_t nub;            /* their buckets: b[0..nub), the last unit's first */
  struct td__zunit *u;
  int *unit_of;          /* per parameter: its unit, or -1 */
  bool pinned;           /* td_zero_gather_params: units stay gathered */
  int64_t live_bytes;    /* bytes of unit parameters gathered now */
  int64_t gather_bytes;  /* bytes of all_gather output buffers alive now (gathers in flight) */
};

/* td__zero_bucket_part returns this member's part of bucket k (chunk elements: its segments'
 * master values, zeros in the padding), what the all_gathers of the parameters send. (zero.c) */
td_status td__zero_bucket_part(td_zero *z, size_t k, td_tensor **out);

/* ---- zero3.c: stage 3 ---- */

/* td__zero3_plan lays out the buckets of a stage-3 td_zero (each unit's parameters in buckets of
 * bucket_bytes of their own, last unit first, then the other parameters) and returns S. z->params set; units from
 * z->zo. */
td_status td__zero3_plan(td_zero *z, int64_t *S);
/* td__zero3_start sets the units' forward hooks and frees their parameters (after the segments
 * were made from them). */
td_status td__zero3_start(td_zero *z);
/* td__zero3_unit_ready: bucket k's gradients are all in (a hook): frees its unit's parameters. */
void td__zero3_unit_ready(td_zero *z, size_t k);
/* td__zero3_end_pass waits for gathers in flight and frees every gathered unit (unless pinned):
 * at a step, after the reduction. */
td_status td__zero3_end_pass(td_zero *z);
/* td__zero3_param_live: parameter i has memory now (always, outside stage 3). */
bool td__zero3_param_live(const td_zero *z, size_t i);
/* td__zero3_destroy clears the hooks and frees the units (parameters' memory restored). */
void td__zero3_destroy(td_zero *z);

/* td__zero_agree returns TD_OK when every member passes mine == TD_OK (an all_reduce MAX of a
 * flag), so that a failure on one member fails every member: the member that failed keeps its
 * status and message, the others get TD_ERR_STATE "<what>: failed on another member".
 * Collective. (zero.c) */
td_status td__zero_agree(td_zero *z, td_status mine, const char *what);

/* td__pg_deadline returns the monotonic deadline (ns) of an operation starting now. */
uint64_t td__pg_deadline(const td_process_group *pg);

/* td__pg_xchg sends sn bytes of sbuf to the right neighbour while receiving rn bytes from the
 * left one into rbuf, until both are done or deadline_ns passes. A closed connection is
 * TD_ERR_UNAVAILABLE, a deadline TD_ERR_TIMEOUT, both naming the neighbour and op; the group is
 * then failed (td__pg_fail). pg->mu held. */
td_status td__pg_xchg(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf, size_t rn,
                      uint64_t deadline_ns, const char *op);

/* td__pg_fail marks the group broken after a local observation (status st, message msg) and
 * returns the status to report: when another member already recorded a failure in the store
 * (the root cause, e.g. the member that saw a peer die), that one is reported; otherwise this
 * one is recorded for the others. Closes the connections, so the neighbours notice at once.
 * Sets td_last_error. pg->mu held. */
td_status td__pg_fail(td_process_group *pg, td_status st, const char *msg);

/* td__pg_scratch makes pg->scratch at least n bytes. pg->mu held. */
td_status td__pg_scratch(td_process_group *pg, size_t n);

/* ---- ops.c ---- */

/* td__pg_execute runs one operation to the end on this member: locks pg->mu, refuses a broken
 * group, numbers the operation, checks the members' headers and runs the chosen algorithm. The
 * tensors were checked by the caller. Sets td_last_error on failure. Blocks. */
td_status td__pg_execute(td_process_group *pg, const td__op *op);
/* td__pg_read_mode reads TD_COLL_ALGO and TD_COLL_SHM_DIRECT_MAX into pg (at creation). */
td_status td__pg_read_mode(td_process_group *pg);
const char *td__kind_name(uint32_t kind);
/* td__op_describe writes "all_reduce(sum, float32 x 7) (#3)" into buf. */
void td__op_describe(const td__op_hdr *h, char *buf, size_t n);
/* td__op_mismatch fails the group with TD_ERR_STATE describing this member's call (mine) and
 * group rank other's (theirs; magic checked here). */
td_status td__op_mismatch(td_process_group *pg, const td__op_hdr *mine, int other,
                          const td__op_hdr *theirs);

/* ---- reduce.c: element kernels ---- */

/* dst[i] = dst[i] (op) src[i] for n elements. */
void td__reduce_into(void *dst, const void *src, size_t n, td_dtype dt, td_reduce_op op);
/* dst[i] = srcs[0][i] (op) srcs[1][i] ... (op) srcs[nsrc-1][i], combined left to right; dst may
 * alias any source. */
void td__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t n, td_dtype dt,
                  td_reduce_op op);
/* td__reduce_n writing the result to dst2 as well (NULL: dst only); the two must not overlap. */
void td__reduce_n2(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n,
                   td_dtype dt, td_reduce_op op);
/* p[i] /= by for float dtypes (nothing for int64). */
void td__divide(void *p, size_t n, td_dtype dt, int by);

/* ---- ring.c: the TCP ring (pg->mu held; h is this member's header, already numbered) ---- */

/* td__ring_check exchanges headers with the neighbours; a mismatch fails the group. */
td_status td__ring_check(td_process_group *pg, const td__op_hdr *h, uint64_t dl);
td_status td__ring_all_reduce(td_process_group *pg, void *data, size_t count, td_dtype dt,
                              td_reduce_op op, uint64_t dl);
td_status td__ring_broadcast(td_process_group *pg, void *data, size_t nbytes, int root,
                             uint64_t dl);
/* slot i of ch (size entries) receives group rank i's part; ch[rank] already holds ours. */
td_status td__ring_all_gather(td_process_group *pg, td__chunk *ch, uint64_t dl);
/* out (count elements) gets the reduction of every member's ins[rank]. */
td_status td__ring_reduce_scatter(td_process_group *pg, void *out, const char *const *ins,
                                  size_t count, td_dtype dt, td_reduce_op op, uint64_t dl);
td_status td__ring_barrier(td_process_group *pg, uint64_t dl);

/* ---- shm.c / shm_coll.c: same-host shared memory ---- */

/* td__shm_setup decides, collectively with the other members (through the store), whether
 * every member runs on this host and can map one shared segment; sets pg->shm, or leaves it NULL
 * (then the ring serves). Fails only when the store does (or the deadline passes). */
td_status td__shm_setup(td_process_group *pg, uint64_t deadline);
void td__shm_destroy(td__shm *s);
/* td__shm_mark_failed tells the other members' waits that this group failed (after the failure
 * was recorded in the store). NULL does nothing. */
void td__shm_mark_failed(td__shm *s);
/* td__shm_buf_bytes is the size of one member's buffer for one round. */
size_t td__shm_buf_bytes(const td__shm *s);
/* The algorithms (pg->mu held; h: this member's numbered header, checked against every member's
 * in the first round). direct: all_reduce in one round (the message must fit one buffer). */
td_status td__shm_all_reduce(td_process_group *pg, const td__op_hdr *h, void *data, size_t count,
                             td_dtype dt, td_reduce_op op, bool direct, uint64_t dl);
td_status td__shm_broadcast(td_process_group *pg, const td__op_hdr *h, void *data, size_t nbytes,
                            int root, uint64_t dl);
td_status td__shm_all_gather(td_process_group *pg, const td__op_hdr *h, td__chunk *outs,
                             const void *in, size_t nbytes, uint64_t dl);
td_status td__shm_reduce_scatter(td_process_group *pg, const td__op_hdr *h, void *out,
                                 const char *const *ins, size_t count, td_dtype dt,
                                 td_reduce_op op, uint64_t dl);
td_status td__shm_barrier(td_process_group *pg, const td__op_hdr *h, uint64_t dl);
/* Single-copy versions (shm_cma.c; only when td__shm_cma): members read each other's tensors.
 * reduce_scatter takes the concatenated input. */
td_status td__cma_all_reduce(td_process_group *pg, const td__op_hdr *h, void *data, size_t count,
                             td_dtype dt, td_reduce_op op, uint64_t dl);
td_status td__cma_broadcast(td_process_group *pg, const td__op_hdr *h, void *data, size_t nbytes,
                            int root, uint64_t dl);
td_status td__cma_all_gather(td_process_group *pg, const td__op_hdr *h, td__chunk *outs,
                             const void *in, size_t nbytes, uint64_t dl);
td_status td__cma_reduce_scatter(td_process_group *pg, const td__op_hdr *h, void *out,
                                 const char *in, size_t count, td_dtype dt, td_reduce_op op,
                                 uint64_t dl);
bool td__shm_cma(const td__shm *s);
/* td__shm_crowded: the members outnumber this host's CPUs (available to this process). */
bool td__shm_crowded(const td__shm *s);

/* ---- work.c: asynchronous operations ---- */

td_status td__work_create(td_process_group *pg);
/* td__work_destroy fails the queued operations with TD_ERR_CANCELLED, waits for the running one
 * and joins the worker thread. NULL does nothing. */
void td__work_destroy(td__work *w);
/* td__work_run runs op in call order with the group's other operations: on this thread when
 * nothing is queued or running (sync), else through the queue. Async (out != NULL): queues a
 * copy holding references to the tensors and returns its future in *out. */
td_status td__work_run(td_process_group *pg, const td__op *op, td_future **out);

/* td__pg_store_prefix writes "pg/<id>/" + suffix into buf. */
const char *td__pg_key(const td_process_group *pg, const char *suffix, char *buf, size_t n);

#ifdef TD_HAVE_NCCL
/* NCCL backend (nccl/nccl_backend.c). create is collective over the group (readiness records and
 * the unique id over the ring, then a non-blocking communicator setup bounded by the group's
 * deadline); the operations take contiguous CUDA tensors on the communicator's device and wait
 * for completion with the group's deadline, watching the members (aborting the communicator and
 * failing the group on an error, a dead member or the deadline). */
td_status td__nccl_create(td_process_group *pg, td__nccl **out);
void td__nccl_destroy(td__nccl *c);
td_status td__nccl_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op);
td_status td__nccl_broadcast(td_process_group *pg, td_tensor *t, int root);
td_status td__nccl_all_gather(td_process_group *pg, void *out, const void *in, size_t count,
                              td_dtype dt);
td_status td__nccl_reduce_scatter(td_process_group *pg, void *out, const void *in, size_t count,
                                  td_dtype dt, td_reduce_op op);
int td__nccl_device(const td__nccl *c);
/* td__nccl_test_before_enqueue, when set (tests only; NULL otherwise), runs in every NCCL
 * operation after the header check, right before the operation is enqueued: a fault-injection
 * point for tests of members that die inside a collective. */
extern void (*td__nccl_test_before_enqueue)(td_process_group *pg, const char *what);
#endif

#endif
