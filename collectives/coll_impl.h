/* coll_impl.h - the collectives' transport layer: what the process-group files share.
 *
 * Layers, each calling only the ones below it (backends never call up: the chooser reaches them
 * through the table, td__coll_backend):
 *   ops.c            the public operations: argument checks on the calling thread, then work.c;
 *   process_group.c  creation and destruction: the group id through the store, each backend of
 *                    the table set up in turn (td__coll_backend.setup), torn down in reverse;
 *   work.c           the per-group queue and worker thread behind the asynchronous calls;
 *   execute.c        one operation under pg->mu: numbering, the choice of algorithm (size,
 *                    TD_COLL_ALGO, what the backends reported at setup) and the dispatch to the
 *                    chosen backend's run;
 *   backends         ring.c + ring_connect.c + ring_crypt.c (TCP ring, members on any hosts;
 *                    authenticated connections, encrypted records under TLS), shm.c +
 *                    shm_coll.c (same-host shared memory), shm_cma.c (single-copy reads over the
 *                    shared-memory rounds), nccl/nccl_backend.c (NCCL; only in builds with it,
 *                    the only file including CUDA or NCCL headers);
 *   group.c          the services every backend uses: names, store keys, deadlines, scratch,
 *                    failure reporting (td__pg_fail tells every backend through its fail entry);
 *   op.c             the description of an operation: kinds, header (kind, sequence, count,
 *                    dtype, op or root, algorithm), names and messages, buffer slots;
 *   reduce.c         the element kernels (two-way and n-way reductions, AVG division).
 * Beside creation, generation.c re-forms a group among its live members (membership
 * generations) and keeps the lost-member notice; ordered.c (the shard-order reduction) and
 * ft_ddp.c (fault-tolerant data parallelism) use only the public operations.
 * What data-parallel wrappers (ddp.c here, zero/) share is in replicas.h.
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

#define TD__PG_DEFAULT_TIMEOUT_MS 60000

typedef struct td__nccl td__nccl;
typedef struct td__shm td__shm;
typedef struct td__work td__work;
typedef struct td__ring_crypt td__ring_crypt;

/* ==== op.c: what an operation is ==== */

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
  uint32_t algo; /* the algorithm this member chose (td__algo): members whose settings differ fail */
  uint32_t reserved;
} td__op_hdr;

/* The algorithms (the chooser's verdicts, td__op_hdr.algo). */
typedef enum td__algo {
  TD__A_LOCAL,
  TD__A_NCCL,
  TD__A_RING,
  TD__A_SHM_DIRECT,
  TD__A_SHM_RSAG,
  TD__A_SHM_BCAST,
  TD__A_SHM_GATHER,
  TD__A_SHM_SCATTER,
  TD__A_SHM_BARRIER,
  TD__A_CMA_RSAG,
  TD__A_CMA_BCAST,
  TD__A_CMA_GATHER,
  TD__A_CMA_SCATTER,
  TD__A_COUNT
} td__algo;

/* A contiguous piece of a tensor. */
typedef struct td__chunk {
  char *p;
  size_t nbytes;
} td__chunk;

/* One operation as queued and executed. Tensors are borrowed by the sync calls and referenced by
 * queued work. */
typedef struct td__op {
  uint32_t kind;      /* TD__K_* */
  td_reduce_op rop;   /* reductions */
  int root;           /* broadcast */
  td_tensor *t;       /* all_reduce, broadcast: the tensor; all_gather: the input;
                         reduce_scatter: the output */
  td_tensor *whole;   /* all_gather_into_tensor: the output; reduce_scatter_tensor: the input */
  td_tensor **list;   /* list forms: size tensors (all_gather: outs; reduce_scatter: ins) */
} td__op;

const char *td__kind_name(uint32_t kind);
/* td__algo_name: "ring", "shm_direct", ... ("?" when out of range). */
const char *td__algo_name(uint32_t algo);
/* td__op_describe writes "all_reduce(sum, float32 x 7) (#3)" into buf. */
void td__op_describe(const td__op_hdr *h, char *buf, size_t n);
/* td__op_header fills h for op (sequence seq, algorithm algo). */
void td__op_header(const td__op *op, uint64_t seq, td__algo algo, td__op_hdr *h);
/* td__op_bytes: the whole buffer's size (what td_process_group_algorithm counts) in a group of
 * size members. */
size_t td__op_bytes(const td__op *op, int size);
/* td__op_gather_slots fills out[0..size) with the all_gather output slots (slot i: group rank
 * i's part); td__op_scatter_slots with the reduce_scatter input slots (slot i goes to group rank
 * i). Backends pass the group's arrays (pg->slot_chunks, pg->slot_ins). */
void td__op_gather_slots(const td__op *op, int size, td__chunk *out);
void td__op_scatter_slots(const td__op *op, int size, const char **out);

/* ==== the backend table ==== */

/* The transports, in the order process groups set them up (and the reverse order they are torn
 * down in): the shared-memory ones need the ring's neighbours alive, NCCL exchanges its id over
 * the ring. */
typedef enum td__tp { TD__TP_RING, TD__TP_SHM, TD__TP_CMA, TD__TP_NCCL, TD__TP_COUNT } td__tp;

typedef struct td__coll_backend {
  const char *name;
  /* setup runs collectively at group creation (every member calls it, in table order) and sets
   * *serves when this backend can run the group's operations (an unsuitable group is no error:
   * not every member on this host, a CPU backend for an NCCL group...). Errors fail the
   * creation. NULL: always serves. */
  td_status (*setup)(td_process_group *pg, uint64_t deadline, bool *serves);
  /* fail tells the other members' waits that the group failed (td__pg_fail calls it after the
   * failure was recorded in the store; pg->mu held). NULL: nothing to tell. */
  void (*fail)(td_process_group *pg);
  /* destroy releases what setup made. NULL: nothing. */
  void (*destroy)(td_process_group *pg);
  /* run executes one operation to the end on this member: pg->mu held, h numbered with the
   * chosen algorithm, tensors checked (contiguous, matching); the header is checked against the
   * other members' before any data moves. AVG is left as the sum when avg_is_sum (the caller
   * divides alike on every member). */
  td_status (*run)(td_process_group *pg, const td__op *op, const td__op_hdr *h, uint64_t dl);
  bool avg_is_sum;
  /* member_alive says whether group rank m's process still runs: 1 yes, 0 it exited, -1 this
   * backend cannot tell (NULL: cannot tell). Any thread, without pg->mu; never blocks. Used by
   * the lost-member notice and the re-formation's decider (generation.c). */
  int (*member_alive)(td_process_group *pg, int m);
} td__coll_backend;

extern const td__coll_backend td__coll_ring, td__coll_shm, td__coll_cma;
#ifdef TD_HAVE_NCCL
extern const td__coll_backend td__coll_nccl;
#endif

/* Algorithm modes (TD_COLL_ALGO, read at group creation). */
typedef enum td__algo_mode {
  TD__MODE_AUTO = 0,   /* shared memory when every member is on this host, else the ring */
  TD__MODE_RING,       /* the TCP ring for everything */
  TD__MODE_SHM,        /* shared memory (must be possible), algorithm by size */
  TD__MODE_SHM_DIRECT, /* shared memory; all_reduce always one-round ("shm_direct") */
  TD__MODE_SHM_RSAG,   /* shared memory; all_reduce always reduce-scatter + all-gather */
  TD__MODE_CMA,        /* shared memory; single-copy reads whenever possible */
} td__algo_mode;

struct td_process_group {
  td_rpc_agent *agent;
  const td__store_client *sc; /* the agent's store client (borrowed) */
  uint64_t id;                /* agreed through the store counter "pg/next_id" */
  uint64_t lineage;           /* the id of generation 0 of this group (re-formations keep it) */
  uint64_t generation;        /* 0 at creation, +1 per td_process_group_reform */
  int reform_tries;           /* re-formations attempted from this group object */
  bool joined;                /* this member entered this generation as a spare
                                 (td_process_group_spare): it has no state of the group's yet */
  /* the lost-member notice (generation.c): the first member this member saw lost, -1 none */
  pthread_mutex_t lost_mu;    /* guards the three fields below; a leaf */
  int lost_grank;
  td_status lost_status;
  char lost_why[384];
  int rank, size;             /* group rank and size */
  int *ranks;                 /* size global ranks, increasing */
  char (*names)[128];         /* worker names by group rank */
  td_pg_backend backend;
  int64_t timeout_ms;
  pthread_mutex_t mu; /* one operation at a time; guards everything below */
  uint64_t seq;       /* operations started */
  bool broken;
  td_status broken_status;
  char *broken_msg;
  int fail_culprit; /* the member td__pg_fail_member blamed, for the backends' fail (-1: none) */
  uint8_t *scratch; /* reused buffer of the backends' algorithms */
  size_t scratch_cap;
  /* size entries each, reused by every operation (no allocation on the small-message path) */
  td__chunk *slot_chunks;  /* all_gather's output slots */
  const char **slot_ins;   /* reduce_scatter's input slots */
  const void **slot_srcs;  /* the sources of a reduction */
  /* the backends serving this group (set up, not yet destroyed), by td__tp; NULL: not serving */
  const td__coll_backend *tp[TD__TP_COUNT];
  td__algo_mode mode; /* TD_COLL_ALGO at creation */
  size_t direct_max;  /* all_reduce bytes up to which shared memory uses one round */
  td__work *work;     /* asynchronous operations (work.c); created with the group */
  /* the backends' state */
  int send_fd;         /* ring: connection to the right neighbour (rank + 1), -1 when none */
  int recv_fd;         /* ring: connection from the left neighbour (rank - 1), -1 when none */
  uint64_t waited_seq; /* ring: the operation whose long wait was recorded in the store */
  td__ring_crypt *ring_seal; /* ring, encrypted: sealing toward the right, or NULL (clear) */
  td__ring_crypt *ring_open; /* ring, encrypted: opening from the left */
  uint8_t *ring_records;     /* ring, encrypted: 2 x (TD__RING_PIECE + TD__RING_TAG) bytes */
  td__shm *shm;        /* shared memory, or NULL */
  int *host_pid;       /* per member: its pid when it runs on this host (same boot, pid namespace
                          and host address), else 0; from the same-host records of creation
                          (shm.c); what the ring's member_alive reads. NULL: unknown */
  size_t shm_buf_bytes; /* shm: one member's round buffer (what one-round all_reduce fits in) */
  bool shm_crowded;     /* shm: the members outnumber this host's CPUs */
  td__nccl *nccl;       /* NCCL communicator, or NULL */
  int nccl_device;      /* its CUDA device, -1 without */
};

/* ==== group.c: services of the group to its backends ==== */

/* "worker2 (rank 2)" for group rank grank, written into buf (at least 160 bytes). */
const char *td__pg_who(const td_process_group *pg, int grank, char *buf, size_t n);
/* td__pg_key writes "pg/<id>/" + suffix into buf. */
const char *td__pg_key(const td_process_group *pg, const char *suffix, char *buf, size_t n);
/* td__pg_deadline returns the monotonic deadline (ns) of an operation starting now. */
uint64_t td__pg_deadline(const td_process_group *pg);
/* td__pg_fail marks the group broken after a local observation (status st, message msg) and
 * returns the status to report: when another member already recorded a failure in the store
 * (the root cause, e.g. the member that saw a peer die), that one is reported; otherwise this
 * one is recorded for the others. Then every serving backend's fail entry runs (the ring closes
 * its connections, so the neighbours notice at once; shared memory wakes the waiters). Sets
 * td_last_error. pg->mu held. */
td_status td__pg_fail(td_process_group *pg, td_status st, const char *msg);
/* td__pg_fail_member is td__pg_fail by an observer that saw group rank culprit lost (its process
 * exited, its connection closed): when this is the group's first failure, the loss is also noted
 * for the lost-member notice and in the store ("pg/<id>/lost/<culprit>"). culprit -1: none. */
td_status td__pg_fail_member(td_process_group *pg, td_status st, int culprit, const char *msg);
/* td__pg_inject_close (fault injection, td_ft_ddp_inject) fails the group on this member as a
 * closed connection would: the failure is recorded, the ring's connections close, shared memory
 * wakes its waiters. Takes pg->mu. */
void td__pg_inject_close(td_process_group *pg);
/* td__pg_is_broken says whether an operation of this member failed the group. Takes pg->mu. */
bool td__pg_is_broken(td_process_group *pg);
/* td__op_mismatch fails the group with TD_ERR_STATE describing this member's call (mine) and
 * group rank other's (theirs; magic checked here). */
td_status td__op_mismatch(td_process_group *pg, const td__op_hdr *mine, int other,
                          const td__op_hdr *theirs);
/* td__pg_scratch makes pg->scratch at least n bytes. pg->mu held. */
td_status td__pg_scratch(td_process_group *pg, size_t n);
/* Milliseconds left until a td__now_ns deadline (capped, 0 when past), a sleep, non-blocking +
 * TCP_NODELAY, and a store wait whose timeout names what was awaited. */
int td__pg_remaining_ms(uint64_t deadline_ns);
void td__pg_sleep_ms(int64_t ms);
/* td__pid_alive says whether process pid still runs (kill(pid, 0), and not a zombie in /proc). */
bool td__pid_alive(int pid);
td_status td__pg_set_nonblocking(int fd);
td_status td__pg_wait_key(td_process_group *pg, const char *key, uint64_t deadline,
                          const char *what, uint8_t **v, size_t *n);

/* ==== reduce.c: element kernels ==== */

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

/* ==== ring.c / ring_connect.c: the TCP ring (pg->mu held) ==== */

/* td__ring_check exchanges headers with the neighbours; a mismatch fails the group. (The NCCL
 * backend checks its headers this way too.) */
td_status td__ring_check(td_process_group *pg, const td__op_hdr *h, uint64_t dl);
/* td__ring_xchg sends sn bytes of sbuf to the right neighbour while receiving rn bytes from the
 * left one into rbuf, until both are done or deadline_ns passes. A closed connection is
 * TD_ERR_UNAVAILABLE, a deadline TD_ERR_TIMEOUT, both naming the neighbour and op; the group is
 * then failed (td__pg_fail). */
td_status td__ring_xchg(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf, size_t rn,
                        uint64_t deadline_ns, const char *op);
/* ring_crypt.c: the ring's records when it is encrypted (TLS, or TD_COLL_ENCRYPT=1): AES-256-GCM
 * under a key per connection (from the group's ring key and the handshake's nonces), a counter
 * per record. */
#define TD__RING_PIECE ((size_t)256 << 10) /* the most bytes of one record */
#define TD__RING_TAG 16
struct td__auth;
td_status td__ring_crypt_create(const struct td__auth *ring_key, const uint8_t *nonce_c,
                                const uint8_t *nonce_s, bool seal, td__ring_crypt **out);
void td__ring_crypt_destroy(td__ring_crypt *c);
/* td__ring_seal writes n (at most TD__RING_PIECE) bytes of in, sealed, and their tag into out
 * (n + TD__RING_TAG bytes). */
td_status td__ring_seal(td__ring_crypt *c, const void *in, size_t n, uint8_t *out);
/* td__ring_open checks and decrypts a record of n bytes (tag included) into out; TD_ERR_AUTH when
 * it was not sealed by the peer with the next counter. */
td_status td__ring_open(td__ring_crypt *c, const uint8_t *in, size_t n, void *out);
/* td__ring_test_sent, when set (tests only; NULL otherwise), sees every byte the ring puts on its
 * connection to the right, as sent: tests check that an encrypted ring never shows its data. */
extern void (*td__ring_test_sent)(td_process_group *pg, const void *p, size_t n);
/* td__ring_connect opens pg's ring (send_fd to the right, recv_fd from the left), every
 * connection authenticated (ring_connect.c). */
td_status td__ring_connect(td_process_group *pg, uint64_t deadline);

/* ==== execute.c: one operation ==== */

/* td__pg_execute runs one operation to the end on this member: locks pg->mu, refuses a broken
 * group, numbers the operation, chooses the algorithm and runs it on its backend. The tensors
 * were checked by the caller. Sets td_last_error on failure. Blocks. */
td_status td__pg_execute(td_process_group *pg, const td__op *op);
/* ==== process_group.c / generation.c: creation and re-formation ==== */

/* What a re-formation decided for the group it creates (else creation agrees on an id). */
typedef struct td__pg_given {
  uint64_t id, lineage, generation;
  uint64_t deadline; /* of the whole creation (monotonic ns) */
} td__pg_given;
/* td__pg_create_member makes this member's group over the sorted global ranks rs[0..n) (takes
 * ownership of rs, malloc'd), my being this member's index, and sets up every backend. Collective
 * over the members. */
td_status td__pg_create_member(td_rpc_agent *agent, int *rs, int n, int my, td_pg_backend backend,
                               int64_t timeout_ms, const td__pg_given *given,
                               td_process_group **out);

/* td__pg_new_key writes the store key under which the creation of the next group over the
 * sorted global ranks rs[0..n) publishes its id ("pg/new/<n>/<hash>/<k>", k counting this
 * process's earlier creations over the same list) and counts this one. */
td_status td__pg_new_key(const td_rpc_agent *agent, const int *rs, int n, char *key,
                         size_t cap);

/* td__pg_read_mode reads TD_COLL_ALGO and TD_COLL_SHM_DIRECT_MAX into pg (at creation). */
td_status td__pg_read_mode(td_process_group *pg);

/* ==== work.c: asynchronous operations ==== */

td_status td__work_create(td_process_group *pg);
/* td__work_destroy fails the queued operations with TD_ERR_CANCELLED, waits for the running one
 * and joins the worker thread. NULL does nothing. */
void td__work_destroy(td__work *w);
/* td__work_run runs op in call order with the group's other operations: on this thread when
 * nothing is queued or running (sync), else through the queue. Async (out != NULL): queues a
 * copy holding references to the tensors and returns its future in *out. */
td_status td__work_run(td_process_group *pg, const td__op *op, td_future **out);

#ifdef TD_HAVE_NCCL
/* td__nccl_test_before_enqueue, when set (tests only; NULL otherwise), runs in every NCCL
 * operation after the header check, right before the operation is enqueued: a fault-injection
 * point for tests of members that die inside a collective. */
extern void (*td__nccl_test_before_enqueue)(td_process_group *pg, const char *what);
#endif

#endif
