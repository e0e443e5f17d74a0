/* collectives.h - process groups and collective operations (torch.distributed for C), and a
 * data-parallel (DDP) gradient helper.
 *
 * A process group is a set of workers of one RPC group (td_rpc_init) that run collectives
 * together. td_process_group_create() is collective over the listed ranks: every member calls it
 * with the same rank list, in the same order relative to its other group creations; workers that
 * are not members may call it as well and get NULL (like torch.distributed.new_group). Members are
 * numbered 0..size-1 in increasing order of their global rank ("group ranks"). Several groups,
 * over the same or different ranks, coexist; each has its own connections.
 *
 * Backends:
 *   - TD_PG_BACKEND_CPU: contiguous CPU tensors. Any size works, including 0 elements and fewer
 *     elements than members; results are bit-identical on every member. Two transports:
 *       * shared memory, when every member runs on this host (same host address, boot and pid
 *         namespace, as the RPC layer's direct copy decides): one POSIX shared-memory segment per
 *         group (its name is removed as soon as every member mapped it) carries each member's
 *         round buffers and flags; members wait by yielding, then sleeping on a futex. Large
 *         messages are read straight out of the other members' tensors (process_vm_readv) where
 *         the host allows it. No byte goes through a socket.
 *       * otherwise a ring of direct TCP connections (bound to the agent's listen address, found
 *         through the rendezvous store).
 *     Algorithms, chosen by size (td_process_group_algorithm names the choice):
 *       all_reduce  "shm_direct" up to 64 KiB: one round, every member reduces the whole vector
 *                   from every member's buffer (latency-optimal); "shm_rsag" above: reduce-
 *                   scatter then all-gather through the buffers in cache-sized pieces, each
 *                   member reducing its 1/n (memory-bandwidth-optimal); "cma_rsag" (1, 16] MiB
 *                   with a CPU per member: the same with single-copy reads; "ring" over TCP:
 *                   reduce-scatter then all-gather around the ring.
 *       broadcast   "shm_bcast" (pipelined through the root's buffers), "cma_bcast" 64 KiB-1 MiB
 *                   with a CPU per member, "ring" (pipelined around the ring).
 *       all_gather, reduce_scatter  "shm_gather" / "shm_scatter", "cma_gather" / "cma_scatter"
 *                   from 64 KiB with a CPU per member (reduce_scatter: the concatenated form, up
 *                   to 32 MiB), "ring".
 *       barrier     "shm_barrier", "ring".
 *     Environment (read at td_process_group_create; members should agree):
 *       TD_COLL_ALGO = auto (default) | ring (TCP even on one host) | shm (shared memory; creation
 *         fails with TD_ERR_UNSUPPORTED when impossible) | shm_direct | shm_rsag (shared memory,
 *         every all_reduce one-round where it fits / always split; no single-copy reads) | cma
 *         (single-copy reads for every operation but barrier).
 *       TD_COLL_SHM_DIRECT_MAX (bytes, 65536): the one-round all_reduce limit.
 *       TD_COLL_CMA=0: no single-copy reads. TD_COLL_SHM_BUF (bytes): one member's round buffer
 *       (default 1 MiB, less beyond 32 members). TD_COLL_YIELD_US (200): how long a waiting
 *       member yields the CPU before it sleeps. TD_COLL_SPIN_US: how long it spins before
 *       yielding (default: adaptive, up to 5 us, when the members do not outnumber the CPUs; a
 *       wait that outlasts its spin makes the next ones yield at once; never when crowded).
 *       TD_COLL_ENCRYPT = 1 | 0: the TCP ring encrypts its data (AES-256-GCM records under a key
 *       per connection; needs the job secret). Default: on when the agent runs with TLS, else
 *       off. Members must agree (those that do not fail the ring handshake).
 *   - TD_PG_BACKEND_NCCL: contiguous CUDA tensors on the group's device, through NCCL. Only in
 *     builds with NCCL; otherwise creating such a group is TD_ERR_UNSUPPORTED. The device is the
 *     process's, the same in every group of the process: the one of td_cuda_set_device(), else
 *     cuda:(LOCAL_RANK % device count) when LOCAL_RANK is set, else cuda:(world rank % device
 *     count). Creation refuses (TD_ERR_INVALID, naming both) two members on one machine with the
 *     same GPU. The members check each operation's header on the host ring as for CPU groups;
 *     MAX propagates NaN as the CPU backend does.
 *
 * Dtypes: float32, float64 and int64 for every operation; TD_REDUCE_AVG needs a float dtype
 * (TD_ERR_DTYPE for int64, as in PyTorch).
 *
 * Failures: every operation has a deadline (the group's timeout, tdist/timeout.h: given at
 * creation, changed with td_process_group_set_timeout; TD_TIMEOUT_DEFAULT is 60 s). A
 * member that dies (its process exits, its connections close) or stops answering makes the
 * operation fail on every member with TD_ERR_UNAVAILABLE or TD_ERR_TIMEOUT and a message naming
 * that worker ("worker2 (rank 2)"), never a hang; a member that skips a collective is named at
 * the deadline with the collective and its sequence number ("all_reduce (#7) timed out after
 * 60000 ms: worker2 (rank 2) did not arrive ..."). Members that call different operations (or
 * different sizes, dtypes, reduce ops or roots) in the same position fail with TD_ERR_STATE
 * describing both calls ("mismatched collectives: worker0 (rank 0) called all_reduce(sum, float32
 * x 8) (#2) but worker1 (rank 1) called broadcast(root 0, float32 x 8) (#2)"); on shared memory
 * every member checks every other member's call, on the TCP ring each checks its neighbour's (a
 * member whose part of a broadcast was over before the mismatch was met learns of it at its next
 * call). After a failure the group is broken: every later operation returns TD_ERR_STATE with the
 * first failure's message; destroy it (and create a new one if the survivors want to continue).
 *
 * THREAD SAFETY: a group may be used from any thread; its operations run one at a time in the
 * order of the calls (synchronous and asynchronous alike), and every member must issue the
 * group's collectives in the same order. The synchronous forms block the calling thread until the
 * operation finished on this member. Destroy every group before td_rpc_destroy() of the agent it
 * was created with.
 */
#ifndef TDIST_COLLECTIVES_H
#define TDIST_COLLECTIVES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/rpc.h"
#include "tdist/status.h"
#include "tdist/tensor.h"
#include "tdist/timeout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_process_group td_process_group;

typedef enum td_pg_backend {
  TD_PG_BACKEND_CPU = 0,  /* TCP ring between the members (PyTorch's "gloo" role) */
  TD_PG_BACKEND_NCCL = 1, /* NCCL on CUDA tensors */
} td_pg_backend;

typedef enum td_reduce_op {
  TD_REDUCE_SUM = 0,
  TD_REDUCE_AVG = 1, /* sum divided by the group size; float dtypes only */
  TD_REDUCE_MAX = 2,
} td_reduce_op;

/* td_process_group_create makes a group of the workers whose global ranks are ranks[0..n) (any
 * order, no duplicates; ranks == NULL means every worker of the agent's group, n is then
 * ignored). Collective: blocks until every member has called it and the members are connected
 * (for NCCL: until every member's communicator is set up), or the timeout passes (TD_ERR_TIMEOUT
 * naming the members that never arrived; a member that failed to set up makes every member fail
 * with its error, naming it). The timeout (tdist/timeout.h; TD_TIMEOUT_DEFAULT: 60 s) becomes the
 * group's timeout for its operations too, as torch.distributed.new_group(timeout=) does. On a
 * member *out gets the group; on a non-member *out is set to NULL and TD_OK is returned without
 * any communication. TD_ERR_INVALID for a rank outside [0, world size), duplicates or n < 1,
 * or a bad TD_COLL_ALGO / TD_COLL_SHM_DIRECT_MAX; TD_ERR_UNSUPPORTED for TD_PG_BACKEND_NCCL in a
 * build without NCCL, or TD_COLL_ALGO asking for shared memory the members cannot share;
 * TD_ERR_DEVICE for NCCL without a CUDA device. Release with td_process_group_destroy(). THREAD SAFETY: any thread; a
 * worker must create the groups of one rank list in the same order as the other members. */
TD_API td_status td_process_group_create(td_rpc_agent *agent, const int *ranks, int n,
                                         td_pg_backend backend, td_timeout_ms timeout,
                                         td_process_group **out);
/* td_process_group_destroy closes the group's connections, unmaps its shared memory and frees it
 * (not collective; peers still inside an operation with this member see it as gone). Operations
 * still queued by the _async calls fail with TD_ERR_CANCELLED; the one running finishes first
 * (bounded by the group's timeout). NULL does nothing. Must not run concurrently with another
 * call on the same group. */
TD_API void td_process_group_destroy(td_process_group *pg);

/* td_process_group_rank returns this member's group rank (0..size-1), or -1 for NULL. */
TD_API int td_process_group_rank(const td_process_group *pg);
/* td_process_group_size returns the number of members, or 0 for NULL. */
TD_API int td_process_group_size(const td_process_group *pg);
/* td_process_group_global_rank returns the global (RPC) rank of group rank group_rank, or -1
 * when out of range. */
TD_API int td_process_group_global_rank(const td_process_group *pg, int group_rank);
/* td_process_group_backend returns the group's backend. */
TD_API td_pg_backend td_process_group_backend(const td_process_group *pg);
/* td_process_group_set_timeout sets the group's timeout, the deadline of each later operation
 * (tdist/timeout.h; TD_TIMEOUT_DEFAULT: 60 s). Members should use the same value. TD_ERR_INVALID
 * for a NULL group or an invalid timeout. */
TD_API td_status td_process_group_set_timeout(td_process_group *pg, td_timeout_ms timeout);

/* td_process_group_all_reduce reduces t element-wise across the members and leaves the result
 * in t on every member (in place, like torch.distributed.all_reduce). t must be contiguous, on
 * the backend's device, with the same dtype and element count on every member (shapes may
 * differ). Blocks. */
TD_API td_status td_process_group_all_reduce(td_process_group *pg, td_tensor *t,
                                             td_reduce_op op);
/* td_process_group_broadcast copies t of group rank root into t of every other member (in
 * place). Blocks. */
TD_API td_status td_process_group_broadcast(td_process_group *pg, td_tensor *t, int root);
/* td_process_group_all_gather gathers every member's in into outs (the list form): outs[i]
 * (size entries, each contiguous with in's dtype and element count) receives group rank i's in.
 * in may be one of the outs (outs[rank] may alias in). Blocks. */
TD_API td_status td_process_group_all_gather(td_process_group *pg, td_tensor *const *outs,
                                             const td_tensor *in);
/* td_process_group_all_gather_into_tensor is the concatenated form: out (contiguous, size *
 * numel(in) elements, any shape, e.g. [size * d0, ...] or [size, ...]) holds group rank 0's in
 * first, then rank 1's, and so on in row-major order. Blocks. */
TD_API td_status td_process_group_all_gather_into_tensor(td_process_group *pg, td_tensor *out,
                                                         const td_tensor *in);
/* td_process_group_reduce_scatter reduces the lists ins[0..size) element-wise across members
 * and stores in out the reduction of every member's ins[rank] (the list form, like
 * torch.distributed.reduce_scatter). Every ins[i] and out are contiguous with equal dtype and
 * element count. The inputs are not modified. Blocks. */
TD_API td_status td_process_group_reduce_scatter(td_process_group *pg, td_tensor *out,
                                                 td_tensor *const *ins, td_reduce_op op);
/* td_process_group_reduce_scatter_tensor is the concatenated form: in holds size * numel(out)
 * elements, slot i being elements [i * numel(out), (i + 1) * numel(out)). Blocks. */
TD_API td_status td_process_group_reduce_scatter_tensor(td_process_group *pg, td_tensor *out,
                                                        const td_tensor *in, td_reduce_op op);
/* td_process_group_barrier returns once every member has entered it. Blocks. */
TD_API td_status td_process_group_barrier(td_process_group *pg);

/* ---- asynchronous operations ----
 *
 * Each operation above has an _async form taking the same arguments plus `out`. It checks the
 * arguments at once (an error there is returned, nothing is queued and *out is untouched), then
 * queues the operation and returns at once with *out set to a new reference to its future
 * (release with td_future_unref()). The group runs its operations, synchronous and asynchronous,
 * one at a time in the order the calls were made (on the calling thread when nothing is queued
 * or running, else on the group's worker thread, started by the first asynchronous call), so the
 * order across members is the order of the calls, as for the synchronous forms; a synchronous
 * call behaves as its _async form followed by td_future_wait.
 *
 * The future completes on the group's worker thread (callbacks run there and must not block).
 * On success its value is a tensor value holding the output (all_reduce and broadcast: t;
 * all_gather_into_tensor: out; reduce_scatter and reduce_scatter_tensor: out), a list of the outs
 * for all_gather, or none for barrier. On failure it carries the operation's status and message
 * (the errors listed for the synchronous forms). Wait for one with td_future_wait (optionally with
 * a timeout), for many with td_future_wait_all, or chain with td_future_then.
 *
 * Tensors: the queued operation holds a reference to every tensor it was given until its future
 * completes. Until then the caller must not write the tensors it reads (t, in, ins) nor read or
 * write those it writes (t, out, outs); afterwards they hold the result, exactly as after the
 * synchronous call.
 *
 * td_process_group_destroy fails the operations still queued with TD_ERR_CANCELLED, waits for the
 * one running, and joins the worker: wait for the futures first.
 *
 * THREAD SAFETY: any thread, including future callbacks of other groups; never blocks on the
 * network (only briefly on the group's queue lock). */
TD_API td_status td_process_group_all_reduce_async(td_process_group *pg, td_tensor *t,
                                                   td_reduce_op op, td_future **out);
TD_API td_status td_process_group_broadcast_async(td_process_group *pg, td_tensor *t, int root,
                                                  td_future **out);
TD_API td_status td_process_group_all_gather_async(td_process_group *pg, td_tensor *const *outs,
                                                   const td_tensor *in, td_future **out);
TD_API td_status td_process_group_all_gather_into_tensor_async(td_process_group *pg,
                                                               td_tensor *whole,
                                                               const td_tensor *in,
                                                               td_future **out);
TD_API td_status td_process_group_reduce_scatter_async(td_process_group *pg, td_tensor *res,
                                                       td_tensor *const *ins, td_reduce_op op,
                                                       td_future **out);
TD_API td_status td_process_group_reduce_scatter_tensor_async(td_process_group *pg,
                                                              td_tensor *res,
                                                              const td_tensor *in,
                                                              td_reduce_op op, td_future **out);
TD_API td_status td_process_group_barrier_async(td_process_group *pg, td_future **out);

/* The operations, for td_process_group_algorithm. */
typedef enum td_pg_op {
  TD_PG_OP_ALL_REDUCE = 0,
  TD_PG_OP_BROADCAST = 1,
  TD_PG_OP_ALL_GATHER = 2,     /* nbytes: the gathered output */
  TD_PG_OP_REDUCE_SCATTER = 3, /* nbytes: the whole input */
  TD_PG_OP_BARRIER = 4,
} td_pg_op;

/* td_process_group_algorithm names the algorithm pg uses for operation op on nbytes bytes (see
 * "Algorithms" at the top): "ring", "shm_direct", "shm_rsag", "shm_bcast", "shm_gather",
 * "shm_scatter", "shm_barrier", "nccl", "local" (one member), or "?" for a NULL group or an
 * unknown op. Returns a static string. THREAD SAFETY: any thread; does not block. */
TD_API const char *td_process_group_algorithm(const td_process_group *pg, td_pg_op op,
                                              size_t nbytes);

/* ---- fault tolerance: membership generations and the lost-member notice ----
 *
 * A group has a generation: 0 at td_process_group_create, one more at each re-formation. When a
 * member is lost (its process exits, its connection closes, its keepalive expires) the
 * collective in flight fails on every member with an error naming the lost member and the
 * group's generation ("process group 3 (generation 0): worker2 (rank 2) is unavailable: its
 * process (pid 4711) exited ..."); the group stays broken. The survivors then re-form it among
 * themselves, without restarting:
 *
 *     td_process_group *next = NULL;
 *     if (td_process_group_reform(pg, TD_TIMEOUT_DEFAULT, &next) == TD_OK) {
 *       td_process_group_destroy(pg);
 *       pg = next;   generation + 1, the live members, renumbered 0..size-1 in global rank order
 *     }
 *
 * This is torchft's reconfiguration of a replica group (and what torch.distributed's elastic
 * agent does by restarting every worker), here with the survivors' processes and state kept.
 * The rendezvous store's host (global rank 0) decides nothing itself but must live: it holds
 * the records the survivors agree through, so its loss ends the job (as a lost TCPStore master
 * ends a torchrun job). */

/* td_process_group_generation returns pg's generation (0 for NULL). THREAD SAFETY: any thread. */
TD_API uint64_t td_process_group_generation(const td_process_group *pg);

/* A lost member, as td_process_group_wait_lost reports it. */
typedef struct td_pg_lost {
  int group_rank;       /* in the group that lost it */
  int global_rank;      /* its RPC rank */
  char name[128];       /* its worker name */
  uint64_t generation;  /* the group's generation when it was lost */
  td_status status;     /* TD_ERR_UNAVAILABLE (exited, connection lost) or TD_ERR_TIMEOUT */
  char reason[384];     /* the observer's words ("worker2 (rank 2) is unavailable: ...") */
} td_pg_lost;

/* td_process_group_wait_lost waits up to timeout (TD_TIMEOUT_ZERO: a poll; TD_TIMEOUT_DEFAULT and
 * TD_TIMEOUT_INFINITE: no limit) until pg has lost a member, and describes the first one this
 * member knows of in *out: one whose loss a collective of this member saw, one on this host
 * whose process exited (no collective needed: its pidfd, or its pid), or one another
 * member recorded lost in the store (read every 100 ms, one request per member: meant for
 * groups of tens, not thousands). TD_ERR_TIMEOUT when none was lost by then (*out untouched).
 * This is the notice a program waits on in a thread of its own, or polls between steps, to
 * learn of a loss while it is not in a collective with the lost member (a wait on a third
 * worker). THREAD SAFETY: any thread, concurrently with the group's operations; pg must not be
 * destroyed meanwhile. Blocks. */
TD_API td_status td_process_group_wait_lost(td_process_group *pg, td_timeout_ms timeout,
                                            td_pg_lost *out);

/* td_process_group_reform creates the next generation of pg among its members that are still
 * there, and returns it in *out (a new group: pg itself stays broken; destroy it). Collective
 * over the survivors: every live member calls it, typically after an operation failed. The
 * first caller decides the membership: every member of pg that called reform by then, less
 * those known lost (a member whose process exited is excluded at once, one a peer saw lost
 * through a closed connection after 1 s without calling, any other at half the timeout). Members
 * are renumbered 0..size-1 in global rank order; the ring's connections are authenticated
 * again under a key bound to the new id and generation, so a member of an older generation
 * cannot connect. timeout (TD_TIMEOUT_DEFAULT: pg's timeout) bounds the whole call. A member
 * left out (it called too late) gets TD_ERR_STATE ("... is stale: generation 1 of process group
 * 3 was formed without it"); TD_ERR_TIMEOUT when the decision never came (the deciding member
 * was lost while deciding) or the new group could not connect (another member lost meanwhile):
 * calling reform again on the same pg then forms the generation after. Release *out with
 * td_process_group_destroy(). THREAD SAFETY: one call at a time per group, not concurrently
 * with its operations. Blocks. */
TD_API td_status td_process_group_reform(td_process_group *pg, td_timeout_ms timeout,
                                         td_process_group **out);

/* Spares: workers of the RPC group kept outside a process group, each waiting to replace a lost
 * member (torchelastic's standby nodes, here without restarting the survivors):
 *
 *     members (ranks 0..3):  td_process_group_create(agent, ranks, 4, ...)      then train;
 *                            td_process_group_release_spares(pg) when done
 *     spare (rank 4):        td_process_group_spare(agent, ranks, 4, ..., &pg, &lost)
 *                            pg NULL: released, not needed; else a member of a new generation
 *
 * A re-formation that leaves k members out admits up to k waiting spares into the generation it
 * forms (lowest global rank first; a spare on the decider's host whose process exited is passed
 * over). The admitted spare's group is like the others' members' (generation,
 * ranks renumbered in global rank order), except that td_process_group_joined says it holds
 * none of the group's state yet: td_ft_ddp_create on it heals it from the survivors. */

/* td_process_group_spare offers this worker as a spare of the group created over ranks[0..n)
 * (the list its members give td_process_group_create; this worker must not be in it, and must
 * call this where a member would call create: groups of one rank list are counted in order).
 * Blocks until a re-formation admits it (TD_OK, *out the new generation's group, to be used as
 * the members use theirs: a collective of the survivors is waiting for it), or a member calls
 * td_process_group_release_spares (TD_OK, *out NULL; *members_lost, when not NULL, says
 * whether any re-formation left members out: the program can then choose its shutdown as the
 * members do), or `wait` passes (TD_ERR_TIMEOUT, the offer withdrawn; TD_TIMEOUT_DEFAULT and
 * TD_TIMEOUT_INFINITE: no limit; a generation that admitted it but could not form, another
 * member lost meanwhile, is formed again without it, and it offers itself again).
 * timeout becomes the new group's timeout, as for create. The
 * loss of the rendezvous store's host (global rank 0) ends the wait with its error.
 * TD_ERR_INVALID for a bad rank list. THREAD SAFETY: any thread. Blocks. */
TD_API td_status td_process_group_spare(td_rpc_agent *agent, const int *ranks, int n,
                                        td_pg_backend backend, td_timeout_ms timeout,
                                        td_timeout_ms wait, td_process_group **out,
                                        bool *members_lost);
/* td_process_group_release_spares answers every spare still waiting for pg's lineage (and every
 * later offer) with "not needed", and returns once each answered spare has acknowledged its
 * answer (a spare on this host whose process exited is not waited for; the others at most the
 * group's timeout). Call it once the group will not re-form again (after the last step), from
 * one member that outlives the answers: the rendezvous store's host (global rank 0) when it is
 * a member, since it leaving ends the store. Calling it again does no harm. THREAD SAFETY: any
 * thread. Blocks. */
TD_API td_status td_process_group_release_spares(td_process_group *pg);
/* td_process_group_spares_waiting counts the spares waiting to replace a member of pg's lineage
 * (offered, not admitted, not withdrawn; one on this host whose process exited is dropped).
 * A few store requests per spare. THREAD SAFETY: any thread. */
TD_API td_status td_process_group_spares_waiting(td_process_group *pg, int *waiting);
/* td_process_group_joined says whether this member entered pg as a spare (false for NULL). */
TD_API bool td_process_group_joined(const td_process_group *pg);

/* td_process_group_all_reduce_ordered sums the shards of a batch in shard order whoever holds
 * them: the n_shards contributions (shard s is held by group rank owner[s]; owner is the same
 * on every member, and a member may hold any number of shards, none included) are combined as
 * ((s_0 + s_1) + s_2) + ... + s_{n_shards-1} element by element, and out receives the sum
 * (TD_REDUCE_SUM) or the sum divided by n_shards (TD_REDUCE_AVG) on every member. mine[j] is this
 * member's j-th shard in increasing shard order (as many as owner[] gives it). Every tensor is
 * contiguous, on the CPU, with out's dtype and element count. The result is bitwise the same
 * whatever the group's size and whoever holds which shard, so a shard moved to another member
 * (because its holder was lost) changes no bit: that is what makes a recomputed step equal the
 * step without the failure. Cost: when every member holds the shard of its own group rank and
 * the group reduces on shared memory (those algorithms fold members 0..n-1 left to right), one
 * all_reduce; otherwise an all_gather of every shard in pieces of at most 4 MiB per member
 * (size x the most shards a member holds), each member folding the pieces itself. Collective;
 * blocks. TD_ERR_INVALID for an owner out of range, a wrong count of mine, mismatched tensors
 * or TD_REDUCE_MAX. */
TD_API td_status td_process_group_all_reduce_ordered(td_process_group *pg, td_tensor *out,
                                                     td_tensor *const *mine, int n_mine,
                                                     const int *owner, int n_shards,
                                                     td_reduce_op op);

/* ---- data parallelism ---- */

typedef struct td_ddp td_ddp;

/* td_ddp_create prepares data-parallel gradient averaging of module's parameters over pg.
 * Collective over pg: it checks that every member's module has the same parameters (count,
 * dtypes, shapes: TD_ERR_SHAPE on every member otherwise) and copies group rank 0's parameters
 * and buffers to every member (as torch's DistributedDataParallel does), so all replicas start
 * equal. The parameters, in td_module_parameters order, are laid out in buckets of at most
 * bucket_bytes (0: 25 MiB; a larger parameter gets a bucket of its own; a bucket holds one
 * dtype). Holds a reference to module (not to pg: pg must outlive the td_ddp). Replacing
 * the module's parameter tensors afterwards (td_module_to, set_parameter) needs a new td_ddp.
 * Release with td_ddp_destroy(). */
TD_API td_status td_ddp_create(td_process_group *pg, td_module *module, size_t bucket_bytes,
                               td_ddp **out);
/* td_ddp_sync_gradients averages every parameter's .grad across the group (call it after the
 * backward pass, before the optimizer step), one all_reduce per bucket: grads are flattened into
 * the bucket buffer, averaged, and copied back into the existing .grad tensors in place. A
 * parameter without a gradient counts as zeros and receives the averaged gradient as a new
 * .grad. Collective over the group; blocks. */
TD_API td_status td_ddp_sync_gradients(td_ddp *ddp);
/* Options of a td_ddp (td_ddp_options_init fills the defaults). */
typedef struct td_ddp_options {
  size_t bucket_bytes;       /* at most this many bytes per bucket (default 25 MiB) */
  size_t first_bucket_bytes; /* the first bucket's cap (default 1 MiB), so the first all_reduce
                                starts early in backward */
  bool overlap;              /* reduce during backward (td_ddp_prepare / td_ddp_finish); default
                                false (td_ddp_sync_gradients after backward) */
  bool find_unused_parameters; /* overlap: a parameter without a gradient in a pass counts as
                                  zeros (else td_ddp_finish fails naming it). Default false */
  bool gradient_as_bucket_view; /* as PyTorch's: after a reduction each .grad is a view of its
                                  bucket slice instead of a copy, so the gradients take no memory
                                  beside the buckets (one copy of the gradient instead of two).
                                  With overlap the hooks also clear each .grad as its gradient
                                  enters the bucket, so .grads read during backward are absent; a
                                  second gradient for a parameter after its bucket started (two
                                  backwards in one pass) is an error instead of a re-reduction.
                                  Values are the same as without. Default false */
  td_dtype reduce_dtype; /* the dtype the buckets travel in (PyTorch's reduce_dtype):
                            TD_DTYPE_BF16 or TD_DTYPE_F16 send a 16-bit copy of each bucket
                            (half the bytes), reduced with float32 accumulation, and read the
                            average back into the float32 buckets; any other value (the default,
                            TD_DTYPE_F32) reduces in the gradients' own dtype. CPU groups only */
} td_ddp_options;
TD_API void td_ddp_options_init(td_ddp_options *o);

/* td_ddp_create_ex is td_ddp_create with options. With overlap, the buckets hold the parameters
 * in reverse order (their gradients come first in backward) and a hook on every parameter starts
 * a bucket's all_reduce (asynchronously, buckets in the same order on every member) as soon as
 * all its gradients arrived, while backward goes on; after the first pass the buckets are rebuilt
 * once in the order the gradients arrived on group rank 0. Gradients come out identical to
 * td_ddp_sync_gradients's. Per pass:
 *     td_ddp_prepare(ddp);  td_tensor_backward(loss);  td_ddp_finish(ddp);  optimizer step
 * (the module's parameters must get their gradients in .grad, not in a distributed autograd
 * context). */
TD_API td_status td_ddp_create_ex(td_process_group *pg, td_module *module,
                                  const td_ddp_options *opts, td_ddp **out);
/* td_ddp_prepare arms the hooks for the next backward pass (overlap only). */
TD_API td_status td_ddp_prepare(td_ddp *ddp);
/* td_ddp_finish ends a pass: starts the buckets not started yet, waits for all, and writes the
 * averages into the .grads (a parameter without .grad gets one). Collective over the group;
 * blocks. Errors of the hooks (they cannot fail backward itself) are returned here. */
TD_API td_status td_ddp_finish(td_ddp *ddp);
/* td_ddp_no_sync: gradient accumulation, PyTorch's no_sync(). A pass prepared (td_ddp_prepare)
 * while it is set reduces nothing and its td_ddp_finish does not communicate; the gradients
 * accumulate locally: in .grad, or with gradient_as_bucket_view in the buckets themselves (the
 * hooks add them there and clear .grad, so the window holds one copy of the gradient). The
 * first pass prepared after it is cleared averages the window's sum, once. K micro-batches per
 * optimizer step, one reduction:
 *     for (k = 0; k < K; k++) {
 *       td_ddp_no_sync(ddp, k < K - 1);
 *       td_ddp_prepare(ddp);  forward;  td_tensor_backward(loss / K);  td_ddp_finish(ddp);
 *     }
 *     optimizer step; zero_grad
 * The caller divides each micro-batch's loss by K (as PyTorch users do), so the result is the
 * gradient of the mean loss over the K micro-batches of every member. Without overlap,
 * td_ddp_sync_gradients under no_sync reduces nothing either. A parameter that got gradients in
 * the window is not "unused" in the reducing pass. Every member must use the same passes. */
TD_API void td_ddp_no_sync(td_ddp *ddp, bool no_sync);
/* Counters of a td_ddp since creation. */
typedef struct td_ddp_stats {
  uint64_t passes;                      /* finished passes that reduced */
  uint64_t buckets_started_in_backward; /* all_reduces started from hooks, before finish */
  uint64_t bytes_started_in_backward;   /* their bytes */
  uint64_t bytes_reduced;               /* bytes of every bucket of every pass */
  uint64_t unused_parameters;           /* parameter-passes without a gradient */
  uint64_t passes_accumulated;          /* passes (or td_ddp_sync_gradients calls) under
                                           td_ddp_no_sync: gradients kept, nothing reduced */
} td_ddp_stats;
TD_API td_status td_ddp_get_stats(const td_ddp *ddp, td_ddp_stats *out);
/* td_grad_scaler_set_process_group makes found_inf of s (tdist/optim.h) a decision agreed over
 * pg: the first td_grad_scaler_found_inf / _step / _update of an iteration runs an all_reduce MAX
 * of the flag, so every member skips the same steps and keeps the same scale (with DDP the
 * averaged gradients are alike anyway; the agreement also covers gradients changed after the
 * reduction, and costs one 8-byte all_reduce per step). pg NULL: no agreement. pg must outlive
 * the scaler's use of it. Not collective itself. */
TD_API td_status td_grad_scaler_set_process_group(td_grad_scaler *s, td_process_group *pg);

/* td_ddp_num_buckets returns the number of buckets (for tests and tuning). */
TD_API int td_ddp_num_buckets(const td_ddp *ddp);
/* td_ddp_destroy frees ddp and its buckets. NULL does nothing. */
TD_API void td_ddp_destroy(td_ddp *ddp);

/* ---- fault-tolerant data parallelism: a failure costs one step, not the job ----
 *
 * A td_ft_ddp runs data-parallel steps that survive the loss of replicas with the result
 * unchanged: the parameters after a run with any number of lost members are bitwise those of
 * the run without a failure (float64 and float32 alike; at least one member must survive, and
 * the rendezvous store's host, global rank 0, must live: see "fault tolerance" above).
 *
 * How. Each step's global batch is cut into n_shards equal shards (default: the group's size at
 * creation), fixed for the whole run; shard s of step k is the same samples whoever computes it
 * (the caller's shard function draws them from (k, s) alone: td_ft_shard_range). Each member
 * computes the gradient of its shards (the library clears .grad, calls the shard function,
 * which runs forward and backward on the shard's mean loss, and keeps a copy of the gradient),
 * then the shard gradients are summed in shard order (td_process_group_all_reduce_ordered:
 * bitwise the same whoever holds which shard), divided by n_shards, written into the .grads,
 * optionally clipped, and the optimizer steps: the step commits. When a member is lost (before,
 * during or after the reduction), the reduction fails on every survivor naming it; the
 * survivors re-form the group (td_process_group_reform, generation + 1), agree on the last step
 * each committed (a member that committed this step when another did not hands its parameters
 * and optimizer state to the others: the step then stands everywhere, and it is the very state
 * recomputing would give), give the lost member's shards to the survivors holding the fewest
 * (the others keep theirs and their gradients: only lost shards are recomputed), and reduce
 * again. The sum is the same, so the step's result is. Later steps keep that assignment: the
 * epoch is re-sharded over the survivors.
 *
 * Cost without failures: the identity path of the ordered reduction (one all_reduce per bucket
 * on a same-host group), one copy of each shard's gradient out of .grad and of the average back
 * in, and no overlap of the reduction with backward; on a TCP ring (members on several hosts)
 * every step takes the gather path. Per step:
 *
 *     static td_status shard(void *user, int64_t step, int s, int n_shards) {
 *       ... the samples of shard s of step `step`: forward, mean loss, td_tensor_backward ...
 *     }
 *     for (int64_t k = 0; k < steps; k++) {
 *       td_optim_set_lr(opt, schedule(k));
 *       td_ft_step_info info;
 *       if (td_ft_ddp_step(ft, k, shard, &ctx, &info) != TD_OK) break;   stale, or no agreement
 *       if (info.failures) puts(info.message);      who was lost, at which step, what moved
 *     }
 *     td_ft_ddp_sync(ft, NULL);                      before leaving: see td_ft_ddp_sync
 *
 * The shard function must be deterministic in (step, shard) and the parameters (no state that
 * depends on the member: dropout draws from a generator seeded by step and shard), and must not
 * run collectives over the group. */
typedef struct td_ft_ddp td_ft_ddp;

/* td_ft_shard_fn computes the gradient of shard `shard` (of n_shards) of step `step`'s global
 * batch into the .grads of the optimizer's parameters (they are cleared, set to none, before
 * each call). TD_OK or a status, which td_ft_ddp_step returns. Runs on the thread that called
 * td_ft_ddp_step. */
typedef td_status (*td_ft_shard_fn)(void *user, int64_t step, int shard, int n_shards);

typedef struct td_ft_ddp_options {
  int n_shards;            /* shards per step (default 0: the group's size at creation) */
  size_t bucket_bytes;     /* elements reduced per ordered all_reduce, in bytes (0: 4 MiB) */
  double max_grad_norm;    /* > 0: clip the averaged gradient's global 2-norm (default 0) */
  td_timeout_ms reform_timeout; /* bound of each re-formation (TD_TIMEOUT_DEFAULT: the group's
                                   timeout) */
  int max_failures;        /* failures survived before td_ft_ddp_step gives up (0: no limit) */
  td_module *module;       /* the module whose parameters opt steps, or NULL. Given, steps
                              without failure overlap the reduction with backward (td_ddp with
                              overlap: the shard function's backward starts the buckets'
                              all_reduces) while each member holds the shard of its own rank on a
                              same-host group: the same bits, without the wait after backward.
                              It expects one backward pass per shard function call: with
                              gradient accumulation inside it (several backward passes), leave
                              it NULL. Must outlive the td_ft_ddp */
  td_grad_scaler *scaler;  /* loss scaling, or NULL: the shard function backpropagates
                              td_grad_scaler_scale's loss; the commit unscales the averaged
                              gradient, skips the optimizer step on an inf or a NaN and applies
                              the scale rule, once per committed step. The averaged gradient is
                              the same bits on every member, so every survivor takes the same
                              decision without a collective: the scaler must have no agreement
                              (no td_grad_scaler_set_process_group). A member that takes a
                              committed step from another (healed) takes its scaler state too.
                              Borrowed: must outlive the td_ft_ddp */
} td_ft_ddp_options;
/* td_ft_ddp_options_init: n_shards = group size, 4 MiB buckets, no clipping, no limit. */
TD_API void td_ft_ddp_options_init(td_ft_ddp_options *o);

/* td_ft_ddp_create prepares fault-tolerant data parallelism of opt's parameters (float32 or
 * float64 CPU tensors) over pg. Collective over pg: copies group rank 0's parameters to every
 * member. Borrows pg and opt (both must outlive the td_ft_ddp; pg is never destroyed by it: the
 * groups it re-forms are its own, see td_ft_ddp_group). opts NULL: the defaults. Release with
 * td_ft_ddp_destroy().
 *
 * On a group a spare was admitted to (td_process_group_spare: the survivors' recovery is
 * waiting for it), it joins instead: it takes n_shards (opts->n_shards is ignored), the shard
 * table, and the parameters, optimizer state (and scaler state) of the last committed step from
 * the survivors, the very state they hold, so the training goes on bitwise as without the
 * failure. The survivors then deal the shards again as at creation over the members (a group
 * made whole again takes each its own shard, and the overlapped fast path, again). The spare
 * runs its first step at td_ft_ddp_next_step, with the same shard function and injections as
 * the others. Survivors report it in td_ft_step_info.joined and the message. */
TD_API td_status td_ft_ddp_create(td_process_group *pg, td_optim *opt,
                                  const td_ft_ddp_options *opts, td_ft_ddp **out);
/* What a td_ft_ddp took from other members (a member that had not committed a step another
 * had, or a spare that joined). */
typedef struct td_ft_ddp_stats {
  int64_t heals;      /* states taken from another member */
  int64_t heal_bytes; /* bytes of parameters and optimizer state taken */
  double heal_s;      /* time spent taking them (the broadcasts from the member that gave it) */
} td_ft_ddp_stats;
TD_API td_status td_ft_ddp_get_stats(const td_ft_ddp *ft, td_ft_ddp_stats *out);

/* td_ft_ddp_next_step returns the step to run next: the last committed step + 1 (0 before the
 * first; for a spare that joined, the step after the one it was healed to). */
TD_API int64_t td_ft_ddp_next_step(const td_ft_ddp *ft);

/* What td_ft_ddp_step did (every field set on TD_OK). */
typedef struct td_ft_step_info {
  int64_t step;            /* the step that committed */
  uint64_t generation;     /* the group's generation it committed in */
  int members;             /* the group's size then */
  int failures;            /* failures survived during this step (0: a plain step) */
  int lost;                /* members lost during this step */
  int joined;              /* spares admitted in place of lost members during this step
                              (td_process_group_spare; td_ft_ddp, td_ft_zero) */
  int shards_computed;     /* shard gradients this member computed in this step */
  int shards_recomputed;   /* shards of lost members the survivors computed in this step */
  bool healed;             /* this member took the step's state from a member that committed it */
  bool overlapped;         /* td_ft_ddp: the step committed on the fast path (its reduction
                              overlapped with backward; see td_ft_ddp_options.module) */
  double recovery_s;       /* from the first failure seen to the commit (0 without failure) */
  double machinery_s;      /* the fault tolerance's own time in a step without failure, beyond
                              what td_ddp / td_zero do; 0 otherwise. td_ft_ddp (fast path only):
                              keeping a copy of the local gradient, dropping it at the commit.
                              td_ft_zero: the copy of each shard's gradient, the commit vote, the
                              optimizer steps of the blocks this member backs, the drop at the
                              commit (not its ordered reduction, which replaces td_zero's; stage
                              3: also the agreement on the number of shard passes, not the
                              gathers, which replace td_zero's) */
  int blocks_copied;       /* td_ft_zero: optimizer blocks whose state was copied to a new holder
                              in this step (a lost holder's block re-replicated) */
  bool rolled_forward;     /* td_ft_zero: the step was completed by the survivors from the state
                              and gradients they held (a member had passed the commit vote), not
                              reduced again */
  char message[1024];      /* one line saying who was lost, at which step and in which phase,
                              and what was recomputed by whom ("" without failure) */
} td_ft_step_info;

/* td_ft_ddp_step runs step `step` (the caller's count: steps must increase by one from any
 * start) to its commit, surviving lost members as described above; info (may be NULL) says what
 * happened. Collective over the current group; blocks. Errors: the shard function's status;
 * TD_ERR_STATE when this member was left out of a re-formation (stale) or a failure that lost
 * no member repeated max_failures times; the re-formation's TD_ERR_TIMEOUT when the survivors
 * could not agree (the store's host lost, a second failure while deciding). The parameters are
 * then those of the last committed step. THREAD SAFETY: one thread. */
TD_API td_status td_ft_ddp_step(td_ft_ddp *ft, int64_t step, td_ft_shard_fn fn, void *user,
                                td_ft_step_info *info);

/* td_ft_ddp_sync is a barrier of the current group that survives lost members as a step does:
 * call it after the last step, before the members leave, so that a member that failed the last
 * step's reduction after another committed it gets that step (info->step: the last committed
 * step, -1 none). Collective; blocks. */
TD_API td_status td_ft_ddp_sync(td_ft_ddp *ft, td_ft_step_info *info);
/* td_ft_ddp_group returns the current group (the one given at creation, or the last re-formed
 * generation). Borrowed: valid until the next td_ft_ddp_step or td_ft_ddp_destroy. */
TD_API td_process_group *td_ft_ddp_group(const td_ft_ddp *ft);

/* td_ft_shard_range gives shard s's samples of a global batch of batch samples cut into n_shards
 * shards: [*begin, *end) (the first batch % n_shards shards have one sample more). */
TD_API void td_ft_shard_range(int64_t batch, int n_shards, int s, int64_t *begin, int64_t *end);

/* Fault injection for tests (in the spirit of torchft's EventInjector): at step `step`, on the
 * member of global rank `rank`, at `when`, do `what`. BEFORE: after its shards are computed,
 * before the reduction; DURING: after the first bucket of the reduction (use several buckets);
 * a step with either takes the ordered path, since the overlapped fast path starts reducing
 * inside backward; AFTER: after the
 * reduction, before the commit; RECOVERY: in a recovery of that step, after the group was
 * re-formed, before the survivors agree (a second failure during recovery). KILL: SIGKILL
 * itself; CLOSE: close its group's connections and fail its group locally (the member lives and
 * re-forms with the others); STOP: SIGSTOP itself (a hung member: alive to every check, the
 * others' collective reaches the group's timeout and the re-formation leaves it out at half its
 * timeout; whoever started it must end it). Each injection fires once. Every member must
 * register the same injections (they decide which path a step takes). ZeRO (td_ft_zero_inject)
 * has four more points, around its commit vote and the all-gather of the parameters that
 * follows its optimizer step: BEFORE_GATHER (this member stepped its optimizer blocks, nothing
 * gathered yet), DURING_GATHER (after the first piece of the all-gather), AFTER_GATHER (after it,
 * before the step counts as committed), AFTER_VOTE (this member received the vote, before it
 * steps its blocks: with CLOSE, a member that voted but did not step, which the recovery rolls
 * forward); its AFTER is after the reduction, before the commit vote. Stage 3 has one more,
 * UNIT_GATHER: in the step's shard passes, after this member's first gather of a unit's
 * parameters (the others are still gathering: a member lost in the middle of a forward). */
typedef enum td_ft_when {
  TD_FT_BEFORE = 0,
  TD_FT_DURING = 1,
  TD_FT_AFTER = 2,
  TD_FT_RECOVERY = 3,
  TD_FT_BEFORE_GATHER = 4,
  TD_FT_DURING_GATHER = 5,
  TD_FT_AFTER_GATHER = 6,
  TD_FT_AFTER_VOTE = 7,
  TD_FT_UNIT_GATHER = 8
} td_ft_when;
typedef enum td_ft_what { TD_FT_KILL = 0, TD_FT_CLOSE = 1, TD_FT_STOP = 2 } td_ft_what;
TD_API td_status td_ft_ddp_inject(td_ft_ddp *ft, int rank, int64_t step, td_ft_when when,
                                  td_ft_what what);
/* td_ft_inject_parse reads "rank:step:when:what" (when: before, during, after, recovery,
 * before_gather, during_gather, after_gather, after_vote; what: kill, close, stop) into its
 * parts; TD_ERR_INVALID otherwise. td_ft_ddp_inject refuses ZeRO's points (DDP has no all-gather
 * and no vote). */
TD_API td_status td_ft_inject_parse(const char *spec, int *rank, int64_t *step, td_ft_when *when,
                                    td_ft_what *what);

/* td_ft_ddp_destroy frees ft and the groups it re-formed (not the one given at creation). NULL
 * does nothing. */
TD_API void td_ft_ddp_destroy(td_ft_ddp *ft);

/* ---- sharded data parallelism (ZeRO stages 1, 2 and 3) ----
 *
 * A td_zero is an optimizer whose state is split across the group, as DeepSpeed's ZeRO and
 * torch's ZeroRedundancyOptimizer do: the parameters (every group's, in order) are laid end to
 * end in buckets of at most bucket_bytes (P elements in all); each bucket is cut into `size`
 * equal parts and member r's parts of every bucket are its shard (S ~ P / size elements);
 * member r keeps optimizer state (Adam's two moments, SGD's momentum, ...) for its shard only
 * and updates only those elements. Each td_zero_step:
 *   1. reduces the gradients: stage 1 all_reduces them (AVG), so every member's .grad holds the
 *      group average afterwards, as under DDP; stage 2 reduce_scatters them (AVG), so each member
 *      receives only its shard's average, and clears the parameters' .grads (set to none);
 *   2. optionally clips by the global gradient norm (max_grad_norm; the norm of the whole
 *      averaged gradient, summed over the shards), with torch.nn.utils.clip_grad_norm_'s rule;
 *   3. runs the local optimizer (td_optim, any kind, the groups' lr and weight decay) on its
 *      shard;
 *   4. all_gathers the updated shards and writes them into every member's parameters.
 * The numbers are those of DDP followed by the same optimizer (up to the summation order of the
 * reduction). Per member: optimizer state for S elements instead of P (Adam: 8S bytes instead of
 * 8P in float32); stages 1 and 2 step the parameters' own elements (no copy of the shard),
 * stage 2 keeps the shard's averaged gradient (S elements) and stage 1 reads the averaged
 * .grads; reductions and gathers go through one bucket buffer at a time (bucket_bytes).
 * With clipping, stage 1 leaves the .grads clipped, as torch.nn.utils.clip_grad_norm_ does.
 * Without overlap the buckets follow the flat order, so with buckets of at least P elements
 * member r owns one contiguous range.
 *
 * Overlap (stage 2, td_zero_options.overlap): the reduction runs during backward. The parameters
 * are laid out in buckets (bucket_bytes, the first first_bucket_bytes) in the order their
 * gradients are expected (grad_order, e.g. a module's parameters reversed; default the flat
 * order reversed); each member owns an equal part of every bucket instead of one contiguous
 * range. Per pass:
 *     td_zero_prepare(z);  td_tensor_backward(loss);  td_zero_step(z);
 * Gradient hooks add each gradient into its bucket and drop the parameter's .grad; when a
 * bucket is complete (and every bucket before it started) its reduce_scatter starts
 * asynchronously and its buffer is freed when that ends, so full gradients exist only in the
 * buckets being filled or reduced and in the last hooked parameter's .grad (dropped at the step).
 * td_zero_step waits for them (a parameter that got no gradient counts as zeros; a gradient that
 * came after its bucket started, from a second backward in the pass, is reduced then) and goes
 * on with 2-4 above. Every member must run the same backward passes. Without td_zero_prepare a
 * step reduces after backward as without overlap (a .grad left from a backward without
 * td_zero_prepare is added to the next prepared pass's buckets).
 *
 * Gradient accumulation, K micro-batches per step with one reduction (td_zero_no_sync):
 *     td_zero_zero_grad(z);
 *     for (k = 0; k < K; k++) {
 *       td_zero_no_sync(z, k < K - 1);
 *       td_zero_prepare(z);  forward;  td_tensor_backward(loss / K);   (prepare: overlap only)
 *     }
 *     td_zero_step(z);
 * The caller divides each micro-batch's loss by K. Stage 1 and stage 2 without overlap need no
 * td_zero_no_sync: backward passes accumulate into .grad and the step reduces once. With overlap
 * (stage 2 and 3) the passes prepared under no_sync add their gradients into the bucket buffers
 * without reducing them (and drop .grad, and stage 3 still frees each unit after its backward):
 * during the window each member holds the model's whole local gradient in its buckets (P
 * elements, the price of one reduction instead of K; max_inflight_bytes cannot bound it), and the
 * last pass, prepared with no_sync cleared, adds its gradients and reduce_scatters each bucket as
 * it completes, overlapped with that backward.
 *
 * Stage 3 (FSDP's full sharding): stage 2 with overlap, and the parameters of the units
 * (td_zero_options.units) are sharded between uses too: each unit is one bucket, its parameters'
 * memory is freed (the tensors stay: shapes, hooks, names), and each member keeps only its part
 * of them (the master values it steps). Forward hooks on each unit all_gather its parameters
 * into their tensors before its forward and free them after; a node on the unit's output gathers
 * them again when backward reaches the unit; once every parameter of the unit has its gradient,
 * the bucket's reduce_scatter starts and the parameters are freed. With prefetch, starting unit
 * u's forward also starts unit u+1's all_gather (backward: u-1's). Parameters outside the units
 * stay whole on every member (their gradients and optimizer state sharded as at stage 2). Per
 * pass: td_zero_prepare(z); forward; td_tensor_backward(loss); td_zero_step(z). A forward
 * without backward (evaluation) gathers and frees the same way. Every member must run the same
 * forwards and backwards (each gather is a collective). Between steps the units' parameters have
 * no memory: read them through td_zero_gather_params.
 *
 * Parameters: float32 or float64, one dtype and one device for all, CPU or (with an NCCL group)
 * CUDA. Every member must pass the same parameter layout (checked: TD_ERR_SHAPE naming the member
 * that differs) and creation copies group rank 0's values to every member. */
typedef struct td_zero td_zero;

typedef struct td_zero_options {
  int stage;            /* 1, 2 or 3 (default 2) */
  double max_grad_norm; /* > 0: clip the averaged gradient to this global 2-norm; 0: no clipping
                           (default) */
  bool overlap;         /* stage 2: reduce_scatter during backward (see above); default false */
  size_t bucket_bytes;  /* bucket capacity in bytes; 0: 4 MiB (smaller than DDP's 25: buckets
                           being filled or reduced are the full gradient held). Without overlap:
                           the size of the reduction and gather buffers of a step */
  size_t first_bucket_bytes; /* overlap: the first bucket's; 0: 1 MiB */
  size_t max_inflight_bytes; /* overlap: before a bucket's buffer is allocated, a hook waits for
                           started reduce_scatters (oldest first) until the buffers alive fit in
                           this many bytes (buffers still filling are never waited for); 0: no
                           cap (default). A member that runs ahead of the others then waits
                           for them instead of holding its whole gradient in buckets */
  td_tensor *const *grad_order; /* overlap: parameters in the order their gradients are expected
                           (repeats ignored; the rest follow in reverse flat order); read by
                           td_zero_create only. Default NULL: the flat order reversed. Stage 3:
                           for the parameters outside the units (each unit's own follow its
                           module's parameter order reversed) */
  size_t n_grad_order;
  /* Clipping a model split over other groups too (tensor and pipeline parallelism): the norm is
   * then the model's, not this data-parallel replica part's. norm_group: the members holding the
   * other parts (the same data rank's model-parallel group); the sum of squares is also summed
   * over it. norm_weights[i] (for parameter i, the groups' flat order; n_norm_weights must be the
   * parameter count): the weight of its squares, 1 for a parameter whose elements no other
   * member of norm_group holds, 1/k for one held whole by k of them (a LayerNorm repeated over a
   * tensor group, a tied table on two stages), so that each element counts once. Read by
   * td_zero_create only. Default NULL: the data-parallel group alone, weights 1. */
  td_process_group *norm_group;
  const double *norm_weights;
  size_t n_norm_weights;
  /* Stage 3 (see below): the units, modules whose parameters are gathered together (a GPT's
   * blocks, say), in the order forward runs them. Every unit parameter must be one of the
   * groups' parameters, in one unit only, and used by no module outside its unit. Read by
   * td_zero_create only; the units must outlive the td_zero (it sets their forward hooks). */
  td_module *const *units;
  size_t n_units;
  bool no_prefetch; /* stage 3: gather a unit only when it runs (default: the next unit's
                       all_gather starts as a unit starts, in forward and in backward) */
} td_zero_options;
/* td_zero_options_init sets stage 2, no clipping, no overlap. */
TD_API void td_zero_options_init(td_zero_options *o);

/* td_zero_create makes a sharded optimizer over the parameters of groups[0..n_groups) (the groups
 * of td_optim_create_groups: each group's lr and weight decay apply to its parameters' elements)
 * with optimizer options opts. zopts NULL: the defaults. Collective over pg. Takes a reference to
 * every parameter; pg must outlive the td_zero. Release with td_zero_destroy(). */
TD_API td_status td_zero_create(td_process_group *pg, const td_optim_options *opts,
                                const td_optim_group *groups, size_t n_groups,
                                const td_zero_options *zopts, td_zero **out);
/* td_zero_prepare arms the gradient hooks for the next backward pass (overlap only: else
 * TD_ERR_STATE, as a second prepare without a step in between, unless the previous pass was
 * prepared under td_zero_no_sync: it ends there, keeping its gradients). Reports the failure of
 * a no_sync pass's hooks. Not collective. */
TD_API td_status td_zero_prepare(td_zero *z);
/* td_zero_no_sync: while set, passes prepared (td_zero_prepare) accumulate their gradients in the
 * buckets and reduce nothing (see "Gradient accumulation" above); td_zero_step refuses to run
 * (TD_ERR_STATE). Read by td_zero_prepare. Every member must use the same passes. */
TD_API void td_zero_no_sync(td_zero *z, bool no_sync);
/* td_zero_step reduces the gradients (a parameter without .grad counts as zeros), clips, steps
 * this member's shard and gathers the parameters (see above). Collective over the group; blocks.
 * Runs with autograd recording off. */
TD_API td_status td_zero_step(td_zero *z);
/* td_zero_step_scaled is td_zero_step for a loss scaled by s (tdist/optim.h, td_grad_scaler):
 * after the reduction the gradients this member holds (its shard's; stage 1: the averaged .grads)
 * are divided by s's scale and checked for infs and NaNs, and found_inf is agreed over the group
 * and norm_group (an all_reduce MAX: at stages 2 and 3 a member sees only its shard); on an inf
 * or a NaN every member skips the clipping, the shard step and the gathers, so the parameters
 * stay as they were, equal everywhere (td_zero_stats.skipped_steps counts it). The caller then
 * calls td_grad_scaler_update(s). s NULL: td_zero_step. Collective; blocks. */
TD_API td_status td_zero_step_scaled(td_zero *z, td_grad_scaler *s);
/* td_zero_gather_params (stage 3) gathers every unit's parameters into their tensors and keeps
 * them until td_zero_release_params (to save or inspect the model; a forward in between leaves
 * them gathered). Collective. Other stages: TD_OK, nothing to do. */
TD_API td_status td_zero_gather_params(td_zero *z);
/* td_zero_release_params frees what td_zero_gather_params gathered. Not collective. */
TD_API td_status td_zero_release_params(td_zero *z);
/* td_zero_zero_grad clears the .grad of every parameter (set to none) and drops the gradients
 * that passes under td_zero_no_sync accumulated in the buckets and no step has reduced (as
 * PyTorch's zero_grad drops what no_sync accumulated in .grad); a no_sync pass still prepared
 * ends. Not collective (every member should do the same). */
TD_API void td_zero_zero_grad(td_zero *z);
/* td_zero_set_lr changes the learning rate of every group for later steps (schedules). */
TD_API td_status td_zero_set_lr(td_zero *z, double lr);
/* Sizes and counters of a td_zero. */
typedef struct td_zero_stats {
  int stage;
  int64_t numel;          /* P: elements of all parameters */
  int64_t shard_numel;    /* S: elements per shard (the last shards may hold padding) */
  int64_t owned_numel;    /* elements of real parameters in this member's shard (<= S) */
  size_t optim_params;    /* tensors the local optimizer updates (pieces of parameters) */
  uint64_t steps;         /* steps taken (loss scaling's skipped steps not counted) */
  uint64_t skipped_steps; /* td_zero_step_scaled calls that skipped the step (found_inf) */
  uint64_t passes_accumulated; /* passes prepared under td_zero_no_sync */
  double last_grad_norm;  /* the global norm before clipping at the last step (NAN before the
                             first step, without clipping, or after a step loss scaling
                             skipped) */
  bool overlap;           /* created with overlap */
  size_t buckets;         /* buckets of the layout (1 without overlap) */
  uint64_t passes_overlapped;         /* steps that ended an overlapped pass */
  uint64_t bytes_started_in_backward; /* bucket bytes whose reduce_scatter started in a hook */
  uint64_t bytes_reduced;             /* bucket bytes of every reduction of every step */
  uint64_t late_buckets;  /* bucket-passes reduced again for gradients that came late */
  uint64_t peak_bucket_bytes; /* overlap: the most bytes of bucket buffers (full gradients)
                             alive at once, from allocation to the end of their reduce_scatter */
  uint64_t waits_for_room;    /* overlap: reduce_scatters a hook waited for (max_inflight_bytes) */
  size_t units;               /* stage 3: units */
  uint64_t unit_gathers;      /* stage 3: all_gathers of a unit's parameters */
  uint64_t prefetched;        /* stage 3: of those, started ahead of the unit (prefetch) */
  uint64_t peak_unit_bytes;   /* stage 3: the most bytes of unit parameters gathered at once */
  uint64_t peak_gather_bytes; /* stage 3: the most bytes held at once by gathered units and by
                                 the output buffers of gathers in flight (prefetches): the
                                 full-size parameter memory stage 3 adds to its shards */
} td_zero_stats;
TD_API td_status td_zero_get_stats(const td_zero *z, td_zero_stats *out);
/* ---- ZeRO checkpoints ----
 *
 * Shard files: td_zero_save(z, prefix) makes every member write its own file,
 * "<prefix>.zero-<rank>-of-<world>.safetensors" (td_zero_shard_path), holding for each piece of a
 * parameter in its shard (flat parameter i, the groups' order; elements [off, off + len) in
 * row-major order):
 *     "param.<i>@<off>"          the values (1-D, len elements, the parameters' dtype)
 *     "param.<i>@<off>.<state>"  the optimizer state under torch.optim's names (AdamW: exp_avg,
 *                                exp_avg_sq; max_exp_avg_sq with amsgrad; SGD momentum_buffer;
 *                                Adagrad sum; RMSprop square_avg, momentum_buffer, grad_avg),
 *                                absent before the first step
 *     "param.<i>@<off>.step"     the step count (int64, [1])
 * and the metadata format "tdist.zero.shard", tdist.zero.version "1", world, rank, optimizer
 * (td_optim_kind_name), numel (P), params (their count), steps (td_zero_stats.steps) and
 * "param.<i>.shape" ("7,5"; "" for a scalar).
 * Consolidated file (td_zero_consolidate): the same without the cut, format "tdist.zero.full"
 * and no world or rank: "param.<i>" (the parameter, its shape), "param.<i>.<state>" (its shape),
 * "param.<i>.step". PyTorch reads it with safetensors (or 8 bytes of header length, the JSON
 * header, the data), and "param.<i>" are the model's parameters. */

/* td_zero_shard_path writes "<prefix>.zero-<rank>-of-<world>.safetensors" into buf (n bytes).
 * TD_ERR_INVALID when it does not fit or rank is not in [0, world). Any thread. */
TD_API td_status td_zero_shard_path(const char *prefix, int rank, int world, char *buf, size_t n);
/* td_zero_save writes this member's shard file (see above) through a temporary file renamed into
 * place. Collective: every member calls it with the same prefix, between steps (TD_ERR_STATE
 * while a pass is prepared); the members agree on the outcome, so a failure on one (TD_ERR_IO
 * naming the path) fails every member (the others TD_ERR_STATE). Blocks. */
TD_API td_status td_zero_save(td_zero *z, const char *prefix);
/* td_zero_consolidate merges the shard files paths[0..n) of one save (every rank once, any order)
 * into one consolidated file at out_path. TD_ERR_FORMAT names the file and the problem (another
 * save's file, a missing or repeated rank, elements not covered exactly once, an unknown tensor).
 * Not collective; any thread. */
TD_API td_status td_zero_consolidate(const char *const *paths, size_t n, const char *out_path);
/* td_zero_load restores parameters, optimizer state and step count from a checkpoint: one
 * consolidated file (n == 1), or the n shard files of a save at any world size (assembled in
 * memory). The checkpoint must have this td_zero's parameter count, shapes and optimizer kind
 * (TD_ERR_SHAPE otherwise, checked before anything changes); stage, overlap, bucket layout and
 * world size may differ. Every member reads the whole state. Collective, between steps; a failure
 * on one member fails every member (the others TD_ERR_STATE). Learning rates are not restored
 * (schedules set them). Blocks. */
TD_API td_status td_zero_load(td_zero *z, const char *const *paths, size_t n);

/* td_zero_destroy frees z (its shard, its optimizer state). NULL does nothing. */
TD_API void td_zero_destroy(td_zero *z);

/* ---- fault-tolerant ZeRO, stages 1 and 2: a lost member costs one step, not its state ----
 *
 * A td_ft_zero is td_ft_ddp's step (fixed shards of the batch, the ordered reduction, commit on
 * every survivor or none) with the optimizer state sharded as ZeRO shards it, and every piece of
 * that state held twice, so that a lost member takes nothing with it. The parameters (every
 * group's, in order; P elements) are cut into n_blocks fixed blocks (default: the group's size
 * at creation; block b is elements [b * ceil(P / n_blocks), ...) of the flat order). Each block
 * has two holders, its owner and a backup (at creation: group rank b and the next one, ring
 * order), both keeping its optimizer state and stepping it with the same averaged gradient, so
 * their states are equal bit for bit: 2/n of the state per member instead of ZeRO's 1/n. A step:
 *   1. each member computes its shards of the batch (as td_ft_ddp: the shard function);
 *   2. the ordered reduction of the gradients, bucket by bucket: stage 1 keeps the whole
 *      average (P elements, as td_zero stage 1 does; the .grads are cleared), stage 2 keeps only
 *      the parts of the blocks it holds (2/n of the gradient; with two holders per block a
 *      reduce-scatter would move as many bytes as this all_reduce);
 *   3. the commit vote: an all_reduce of one number per block (the owner's sum of squares of
 *      its block's averaged gradient, for clipping by the global norm, folded in block order so
 *      the norm's bits do not depend on who holds what). A member that receives it knows that
 *      every member finished step 2, so every block's gradient is on both its holders;
 *   4. each member steps the blocks it holds (td_optim over views of the parameters), unless
 *      its own group failed after the vote (the recovery then steps them);
 *   5. the all-gather: every block's updated values from its owner into every member's
 *      parameters; the step is committed.
 * A member lost anywhere makes the survivors re-form the group and exchange what each holds
 * (per block: whether it has its state, at which step, whether it has the step's gradient).
 * When some survivor passed the vote, the step is completed from that (roll forward): the
 * holders that did not step yet step with the gradient they hold and the agreed clipping
 * factor, and the parameters are gathered again; otherwise no survivor stepped and the step is
 * redone: the lost member's shards of the batch go to the survivors (recomputed), the others'
 * gradients are kept, and the reduction runs again with the same bits. Each block lost with
 * one holder gets a new backup (the survivor holding the fewest blocks) with a copy of its
 * state from the live holder: the layout is re-sharded over the survivors, block by block. So
 * the parameters after any number of lost members equal a failure-free run's bitwise (float64
 * and float32 alike), as long as no block loses both holders in one recovery (two neighbours
 * lost at once): then every survivor fails the step with TD_ERR_UNAVAILABLE naming the block
 * and its lost holders (its state is gone; restart from a checkpoint), never a hang. The
 * store's host (global rank 0) must live, as for td_ft_ddp.
 *
 * Cost without failures: td_ft_ddp's ordered path (no overlap with backward), the vote (one
 * all_reduce of n_blocks doubles), twice ZeRO's optimizer work and state (each block stepped by
 * its two holders), and the all-gather. Per step, as td_ft_ddp:
 *     td_ft_zero_set_lr(z, schedule(k));
 *     td_ft_zero_step(z, k, shard, &ctx, &info);     shard: see td_ft_shard_fn
 *     ...
 *     td_ft_zero_sync(z, NULL);                      after the last step
 *
 * Stage 3 (units): the units' parameters are sharded between uses too. A block's two holders
 * keep its master values (beside its optimizer state), so a lost member takes no parameter with
 * it; the units' tensors have no memory between steps (td_ft_zero_stats.param_numel). In a shard
 * pass, a unit's pre-forward hook gathers its parameters from the owners of the blocks it spans
 * (one broadcast per block), its post-forward hook frees them and puts an identity node on its
 * outputs whose backward gathers them again; they are freed again once every one of their
 * gradients has arrived (a gradient hook per parameter; a parameter without a gradient in the
 * pass keeps its unit until the pass ends). The parameters outside the units stay whole and are
 * gathered at the commit as at stage 2. Since every gather is a collective, every member runs
 * the same number of shard passes per attempt (the most any member computes; a member with
 * fewer serves the others' gathers without computing), and each pass must run the units'
 * forwards once each, in order, then one backward through them all (no activation
 * checkpointing inside a unit): a pass that does not fails the step with TD_ERR_INVALID on every
 * member (each runs the same shard function). A member lost during a gather fails
 * the gather on the survivors, who recover as from a lost reduction; the recomputed shards
 * gather from the surviving holders. td_ft_zero_sync ends with every unit gathered (whole
 * parameters on every survivor until the next step: outside a step the hooks do nothing, so
 * one member may then run forwards alone, an evaluation; a unit's forward outside a step while
 * it is free fails with TD_ERR_STATE); td_ft_zero_destroy leaves a free unit's parameters
 * zero-filled. With gradient accumulation inside the shard function (several backward passes
 * per pass) the pass is out of order: not supported at stage 3. Gradients are kept whole per
 * shard until the commit, as at stages 1 and 2 (only the parameters and the optimizer state
 * are sharded).
 */
typedef struct td_ft_zero td_ft_zero;

typedef struct td_ft_zero_options {
  int stage;               /* 1, 2 or 3 (default 2; 3: units required, see below) */
  int n_shards;            /* shards of the batch per step (0: the group's size at creation) */
  int n_blocks;            /* optimizer blocks (0: the group's size at creation) */
  size_t bucket_bytes;     /* bytes per ordered all_reduce and per all-gather piece (0: 4 MiB) */
  double max_grad_norm;    /* > 0: clip the averaged gradient's global 2-norm (default 0) */
  td_timeout_ms reform_timeout; /* bound of each re-formation (TD_TIMEOUT_DEFAULT: the group's) */
  int max_failures;        /* failures survived before a step gives up (0: no limit) */
  td_grad_scaler *scaler;  /* loss scaling, or NULL: as td_ft_ddp_options.scaler. The vote
                              carries every block's sum of squares (of the scaled gradient),
                              non-finite on every member when any block overflowed: then no
                              block is stepped (a skipped step, also when the survivors roll it
                              forward); else each block's gradient is multiplied by the clip
                              factor / scale. The scale rule runs once per committed step on
                              every member. No agreement on the scaler. Borrowed */
  td_module *const *units; /* stage 3: modules whose parameters are gathered for their forward
                              and backward only (a GPT's blocks), in forward order; every
                              parameter of a unit is one of the groups'. Borrowed: the array is
                              read at creation, the modules must outlive the td_ft_zero (it
                              sets their forward hooks) */
  size_t n_units;
} td_ft_zero_options;
/* td_ft_zero_options_init: stage 2, n_shards and n_blocks the group's size, 4 MiB, no clipping,
 * no limit. */
TD_API void td_ft_zero_options_init(td_ft_zero_options *o);

/* td_ft_zero_create makes a fault-tolerant sharded optimizer over the parameters of
 * groups[0..n_groups) (as td_zero_create: each group's lr and weight decay apply to its
 * parameters; contiguous float32 or float64 CPU tensors of one dtype) with optimizer options
 * opts. Collective over pg: copies group rank 0's parameters to every member. Borrows pg (never
 * destroyed by it) and takes a reference to every parameter. zopts NULL: the defaults. Release
 * with td_ft_zero_destroy().
 *
 * On a group a spare was admitted to (td_process_group_spare: the survivors' recovery waits for
 * it after their re-formation), it joins instead: the spare takes n_shards and
 * n_blocks from the survivors (zopts' are ignored; the same model, parameter groups and stage
 * are required: else TD_ERR_INVALID on every member), takes a lost member's place in the block
 * layout (copies of the blocks it held, state and values (stage 3: master values), from their
 * other holder), its shards of the batch, and the parameters (stage 3: those outside the units)
 * and scaler state of the last committed step, so the
 * training goes on bitwise as without the failure, every block held twice again, and a group
 * made whole has the layout of its start. The spare runs its first step at
 * td_ft_zero_next_step; td_ft_zero_stats.heals says what it took. Survivors report it in
 * td_ft_step_info.joined. */
TD_API td_status td_ft_zero_create(td_process_group *pg, const td_optim_options *opts,
                                   const td_optim_group *groups, size_t n_groups,
                                   const td_ft_zero_options *zopts, td_ft_zero **out);
/* td_ft_zero_step runs step `step` (steps increase by one from any start) to its commit,
 * surviving lost members as described above; info (may be NULL) says what happened. Errors as
 * td_ft_ddp_step's, and TD_ERR_UNAVAILABLE when a block lost both its holders. Collective over
 * the current group; blocks. THREAD SAFETY: one thread. */
TD_API td_status td_ft_zero_step(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                                 td_ft_step_info *info);
/* td_ft_zero_sync is td_ft_ddp_sync for a td_ft_zero: a barrier that survives lost members
 * (and re-replicates their blocks); call it after the last step. Collective; blocks. */
TD_API td_status td_ft_zero_sync(td_ft_zero *z, td_ft_step_info *info);
/* td_ft_zero_set_lr sets every group's learning rate for the next steps (schedules); blocks
 * taken over later get it too. TD_ERR_INVALID for a negative or NaN lr. Not collective. */
TD_API td_status td_ft_zero_set_lr(td_ft_zero *z, double lr);
/* td_ft_zero_inject: fault injection as td_ft_ddp_inject, every point of td_ft_when. */
TD_API td_status td_ft_zero_inject(td_ft_zero *z, int rank, int64_t step, td_ft_when when,
                                   td_ft_what what);
/* td_ft_zero_group returns the current group. Borrowed: valid until the next step, sync or
 * destroy. */
TD_API td_process_group *td_ft_zero_group(const td_ft_zero *z);
/* What a td_ft_zero holds on this member, and its own time in failure-free steps. */
typedef struct td_ft_zero_stats {
  int stage;
  int n_blocks;
  int64_t numel;          /* P: elements of all parameters */
  int owned;              /* blocks this member owns (steps, votes for and gathers from) */
  int backed;             /* blocks it backs (steps too, keeps their state) */
  int64_t state_numel;    /* elements of the blocks it holds (their optimizer state is kept;
                             stage 3: their master values too) */
  int64_t grad_numel;     /* elements of averaged gradient it keeps in a step (stage 1: P) */
  int64_t plain_steps;    /* steps committed without a failure by this member */
  double machinery_s;     /* their td_ft_step_info.machinery_s summed: the fault tolerance's own
                             time per step is machinery_s / plain_steps */
  int units;              /* stage 3: its units (0 otherwise) */
  int64_t param_numel;    /* elements of the parameters that have memory on this member now
                             (P at stages 1 and 2; stage 3 between steps: the parameters outside
                             the units) */
  int64_t unit_gathers;   /* stage 3: gathers of a unit's parameters run by this member (two per
                             unit per shard pass, and those of td_ft_zero_sync) */
  int64_t peak_unit_numel; /* stage 3: the most elements of unit parameters that had memory at
                              once on this member during a shard pass */
  int64_t heals;          /* a spare that joined: 1 (0 otherwise) */
  int64_t heal_bytes;     /* ... bytes it took: its blocks' values and optimizer state, the
                             parameters */
  double heal_s;          /* ... time from entering the survivors' recovery to healed */
} td_ft_zero_stats;
TD_API td_status td_ft_zero_get_stats(const td_ft_zero *z, td_ft_zero_stats *out);
/* td_ft_zero_next_step is td_ft_ddp_next_step for a td_ft_zero (for a spare that joined: the
 * step after the one it was healed to). */
TD_API int64_t td_ft_zero_next_step(const td_ft_zero *z);
/* td_ft_zero_destroy frees z, its optimizer state and the groups it re-formed. NULL does
 * nothing. */
TD_API void td_ft_zero_destroy(td_ft_zero *z);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_COLLECTIVES_H */
