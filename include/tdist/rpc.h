/* rpc.h - named workers and remote calls (torch.distributed.rpc for C); values and futures have
 * their own headers (tdist/value.h, tdist/future.h), included here.
 *
 * A process joins a group of world_size workers with td_rpc_init() (explicit rank/world/master) or
 * td_rpc_init_from_env() (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as set by tdistrun or
 * torchrun; Slurm and Open MPI variables as fallbacks). Rank 0 serves a small key-value store that
 * the others use to find each other. Functions are registered by name in every process
 * (td_rpc_register) and called by name on any worker (td_rpc_sync / td_rpc_async); only names and
 * data travel, never code.
 *
 * THREAD SAFETY: every function may be called from any thread, including from inside a registered
 * function (nested calls) and from future callbacks, unless its comment says otherwise. Blocking
 * calls say so; each takes a td_timeout_ms (tdist/timeout.h: > 0 ms, TD_TIMEOUT_ZERO,
 * TD_TIMEOUT_INFINITE, TD_TIMEOUT_DEFAULT = the agent's rpc timeout) or says which one bounds it.
 */
#ifndef TDIST_RPC_H
#define TDIST_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/future.h"
#include "tdist/status.h"
#include "tdist/tensor.h"
#include "tdist/timeout.h"
#include "tdist/value.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================== */
/* Agent                                                                                     */
/* ======================================================================================== */

typedef struct td_rpc_agent td_rpc_agent;

/* Worker identity. id is the rank. */
typedef struct td_worker_info {
  char name[128];
  int id;
  char address[256]; /* host:port the worker's server listens on */
} td_worker_info;

/* td_rpc_device_map_entry is one entry of a device map (torch.distributed.rpc's
 * TensorPipeRpcBackendOptions.set_device_map): a tensor on device `from` of this worker that is
 * sent to worker `worker` arrives there on device `to`. Devices are written as for
 * td_device_parse: "cpu", "cuda" (= cuda:0) or "cuda:N"; "cpu" is allowed on either side. */
typedef struct td_rpc_device_map_entry {
  const char *worker; /* the destination worker's name */
  const char *from;   /* a device of this worker */
  const char *to;     /* a device of `worker` */
} td_rpc_device_map_entry;

/* td_rpc_options.progress */
#define TD_RPC_PROGRESS_THREADS 0
#define TD_RPC_PROGRESS_HOST 1

/* The default of td_rpc_options.max_message_bytes: a 2 GiB tensor fits. */
#define TD_RPC_DEFAULT_MAX_MESSAGE ((2ull << 30) + (64ull << 20))

/* Option structs whose zero values would mean something else than their defaults (a 0 ms
 * timeout: every call expiring at once) start with a field `magic` that only their initialiser
 * sets: td_rpc_options_init() for td_rpc_options, TD_RPC_CALL_OPTS_INIT or td_rpc_call_opts_init()
 * for td_rpc_call_opts. A struct not filled by it (`= {0}`, memset, or written field by field)
 * is refused with TD_ERR_INVALID and a message naming the initialiser, before anything is sent.
 * Set fields after the initialiser; never set magic by hand. */
#define TD_RPC_OPTIONS_MAGIC 0x74645231u   /* "tdR1" */
#define TD_RPC_CALL_OPTS_MAGIC 0x74644331u /* "tdC1" */

/* Fill with td_rpc_options_init(), then set what differs. */
typedef struct td_rpc_options {
  /* Set by td_rpc_options_init (TD_RPC_OPTIONS_MAGIC); anything else is refused. */
  uint32_t magic;
  /* "tcp://host:port" of rank 0's store; NULL or "env://" (PyTorch's default) read MASTER_ADDR
   * and MASTER_PORT (Slurm's first node and a port per Slurm or Open MPI job as fallbacks;
   * td_rpc_init fails naming what is missing, td_rpc_init_from_env defaults to 127.0.0.1:29500). */
  const char *init_method;
  /* Threads running registered functions. Default 16. */
  int num_worker_threads;
  /* The agent's rpc timeout: what TD_TIMEOUT_DEFAULT means for its calls, RRefs and shutdown
   * (tdist/timeout.h; TD_TIMEOUT_INFINITE: no limit). Default 60000 (also what
   * TD_TIMEOUT_DEFAULT here gives). */
  td_timeout_ms rpc_timeout_ms;
  /* How long td_rpc_init may take to find every worker (tdist/timeout.h). Default 120000 (also
   * what TD_TIMEOUT_DEFAULT here gives). */
  td_timeout_ms init_timeout_ms;
  /* Address this worker's server listens on (and advertises). Default NULL: chosen at init from
   * TD_SOCKET_IFNAME (NCCL's syntax: comma list of interface-name prefixes, '^' excludes, '='
   * exact), else the interface of the route toward the master, else loopback (the choice is
   * logged at INFO; loopback whenever the master is loopback). */
  const char *listen_addr;
  /* Keepalive ping interval for peer connections, ms. Default (0) 2000, or 2000 * (world - 1) / 64
   * in groups of more than 65 workers (each worker pings every peer it has a stream to, so the
   * group's pings grow as N^2; this keeps each worker at about 32 a second). A peer whose process
   * died is detected at once (its connection closes); keepalive catches hung peers and cut
   * links. */
  int64_t keepalive_ms;
  /* How long a keepalive ping may stay unanswered before the peer is declared gone and every call
   * waiting on it fails, ms (> 0; TD_TIMEOUT_DEFAULT gives the default; ZERO and INFINITE are
   * TD_ERR_INVALID: a hung peer must be noticed some time). Default 20000 (generous: an
   * overloaded but live peer must not be declared dead); lower it for faster detection of hung
   * hosts. */
  td_timeout_ms keepalive_timeout_ms;
  /* Largest request or reply accepted, in bytes (envelope + tensors); 0 = unlimited. Default
   * TD_RPC_DEFAULT_MAX_MESSAGE (2 GiB of tensors plus 64 MiB of envelope). A larger one is
   * answered with an error and skipped; the stream stays usable. */
  uint64_t max_message_bytes;
  /* Busy-poll window of the network thread, in microseconds: after each message it keeps polling
   * this long before it sleeps, so a reply that follows closely is taken by a running thread
   * rather than by waking a sleeping one (several times lower small-call latency, at the price of
   * that much CPU after each burst of traffic). -1 (default) = automatic: TD_RPC_BUSY_POLL_US if
   * set, else 50 when this host runs no more workers than it has CPUs and 0 when it is
   * oversubscribed. 0 = never spin. */
  int64_t busy_poll_us;
  /* Same-host direct copy: a receiver copies tensors of 32 KiB and more (4 MiB and more when the
   * frame takes the same-host lane, whose ring is faster below that; TD_RPC_LANE_DIRECT_MIN_KB
   * overrides it) straight out of the sender's memory (Linux process_vm_readv) instead of
   * through the socket, when both workers run on one host as the same user and the kernel
   * allows it (settled for each pair when it first meets: by making its mailbox lane, which
   * proves the access without reading, or in the handshake of its dialled lane, frames sent
   * before then going the other way; where this worker has no mailbox (td_rpc_mailbox_lanes),
   * checked at init for every pair on the host instead, unless TD_RPC_DIRECT_SETTLE=1;
   * TD_RPC_DIRECT_SETTLE=0: at init always). -1 (default) = on unless
   * TD_RPC_DIRECT_COPY=0;
   * 0 = off. A tensor sent this way stays referenced by the sender until the receiver has copied
   * it: as with the stream, do not modify a tensor in place while a call that carries it is in
   * flight. */
  int direct_copy;
  /* Same-host lane: frames between two workers on one host move through shared memory (a pair
   * of rings in a memfd handed over a unix socket, polled, with a futex doorbell) instead of
   * their gRPC stream, once the stream's authenticated handshake is done and the peer's process
   * proved itself on the socket. -1 (default) = on unless TD_RPC_SHM_LANE=0; 0 = off; 1 = on.
   * Streams with other hosts, and where the lane cannot be set up, keep using gRPC. */
  int shm_lane;
  /* Device maps for CUDA tensors, PyTorch's set_device_map semantics (docs/DEVICE_MAPS.md):
   * entries {worker, from, to} in any order; a tensor on `from` here arrives on `to` at `worker`,
   * replies follow the caller's map in reverse. Borrowed: read during td_rpc_init only, which
   * checks every worker's maps. Default NULL / 0: only CPU tensors travel. */
  const td_rpc_device_map_entry *device_maps;
  int num_device_maps;
  /* Memory gRPC may hold for this worker's connections (received data not yet taken, send
   * buffers), in bytes; beyond it streams are reset instead of growing, so no peer, member or
   * not, can make a worker buffer without bound. Default 1 GiB (TD_RPC_MEMORY_QUOTA_MB
   * overrides). Tensors are streamed in 8 MiB pieces and taken at once, so training traffic
   * stays far below it. */
  uint64_t memory_quota_bytes;
  /* Where user code runs: TD_RPC_PROGRESS_THREADS (default): registered functions and the
   * callbacks of call futures run on the agent's thread pool. TD_RPC_PROGRESS_HOST: they are
   * queued for the embedding program, which runs them on its own thread with td_rpc_progress()
   * when td_rpc_progress_fd() becomes readable (an event loop's add_reader). */
  int progress;
  /* The job secret every member of the group shares (docs/SECURITY.md). Every connection to a
   * worker or to the store starts with a mutual HMAC-SHA256 challenge-response over fresh nonces
   * proving both ends know it; nothing else is read before. At least 16 characters. Borrowed:
   * read during td_rpc_init only. Default NULL: TD_RPC_SECRET, else the contents of
   * TD_RPC_SECRET_FILE (refused unless it is a regular file of this user with mode 0600 or
   * stricter), else a random one for a world of one worker; otherwise td_rpc_init fails, unless
   * `insecure` is set. tdistrun hands its workers a random secret per job. */
  const char *secret;
  /* 1: when no secret is given, run without authentication (anyone who can reach the ports can
   * join the group, call any function, read and write the store). Also TD_RPC_INSECURE=1.
   * Default 0. */
  int insecure;
  /* TLS (optional, docs/SECURITY.md): PEM files of this worker's certificate (chain), its private
   * key, and the CA that signed every member's certificate: all three or none. Peers verify each
   * other (mutual TLS) for the name tls_server_name (default "tdist"), and the store goes over the
   * same. Default NULL: TD_RPC_TLS_CERT, TD_RPC_TLS_KEY, TD_RPC_TLS_CA, TD_RPC_TLS_NAME; else no
   * TLS. Borrowed: read during td_rpc_init only. */
  const char *tls_cert_file, *tls_key_file, *tls_ca_file, *tls_server_name;
  /* The run this worker belongs to (at most 127 bytes): rank 0's store refuses workers of another
   * run at once ("two jobs share MASTER_PORT ..."), before they can touch it. Default NULL:
   * TD_RUN_ID (tdistrun sets it: --rdzv-id, else the Slurm job, else a random id per job), else
   * "slurm:<job>.<step>" under srun, else "ompi:<job>" under Open MPI's mpirun, else "" (none).
   * Borrowed: read during td_rpc_init only. */
  const char *run_id;
  /* Elastic groups: the places of the group, at least world_size. The world_size workers given
   * to td_rpc_init start the group (ranks 0..world_size-1); later, up to max_world_size -
   * world_size more workers may take the other places of the running group (rank
   * TD_RPC_RANK_JOIN: td_rpc_init gives them the next free place). A place once taken is not
   * given again, even when its worker is gone. Every worker of one group gives the same value
   * (checked). Default 0: TD_RPC_MAX_WORLD_SIZE if set, else world_size (a group of fixed
   * size). */
  int max_world_size;
} td_rpc_options;

/* The rank given to td_rpc_init by a worker that takes a free place in a running group
 * (td_rpc_options.max_world_size; td_rpc_init_from_env: RANK=-1). */
#define TD_RPC_RANK_JOIN (-1)

/* Traffic with one peer (or all of them), by path: frames and bytes (envelope + tensor bytes)
 * through the gRPC stream, those whose tensors went by same-host direct copy (the receiver read
 * them from the sender's memory; bytes counts those tensor bytes; their small descriptor went
 * through the stream or the lane), and those through the same-host lane
 * (td_rpc_options.shm_lane). */
typedef struct td_rpc_traffic {
  uint64_t frames_sent, bytes_sent, frames_received, bytes_received;
  uint64_t direct_frames_sent, direct_bytes_sent, direct_frames_received, direct_bytes_received;
  uint64_t lane_frames_sent, lane_bytes_sent, lane_frames_received, lane_bytes_received;
} td_rpc_traffic;

/* An agent's counters since init (monotonic), and a few gauges (now). */
typedef struct td_rpc_stats {
  td_rpc_traffic traffic; /* with every peer */
  /* calls this worker made: started; finished with a result, with an error (remote or local),
   * by their timeout */
  uint64_t calls_started, calls_succeeded, calls_failed, calls_timed_out;
  /* requests peers made of this worker: received (decoded), whose handler failed, refused
   * before any handler ran (malformed, unknown function, shutting down) */
  uint64_t requests_received, requests_failed, requests_rejected;
  /* connection attempts refused: failed or abandoned handshakes, streams over the limits */
  uint64_t refused_connections;
  int64_t calls_pending;   /* gauge: calls waiting for their outcome */
  int64_t requests_active; /* gauge: requests queued or running here */
  int64_t pool_pending;    /* gauge: tasks queued or running on the agent's thread pool */
  /* user requests answered TD_ERR_TIMEOUT unrun because their caller's timeout passed while they
   * queued (also counted in requests_rejected); requests that found every handler thread busy
   * (the first of a minute is logged at WARN, naming the running handlers) */
  uint64_t requests_expired, pool_saturated;
  /* time (ns) registered functions ran here (until they returned a value or a future), and time
   * this worker's threads spent blocked in td_rpc_sync */
  uint64_t handler_ns, sync_wait_ns;
  /* streams this worker opened to peers (a dialled same-host lane counts as one); peers it
   * reached on a stream (or dialled lane) they had opened to it
   * (one stream serves a pair both ways, so a pair that calls each other makes one connection
   * and one handshake; TD_RPC_SHARE_STREAMS=0 gives every caller a stream of its own) */
  uint64_t streams_opened, streams_shared;
} td_rpc_stats;

/* td_rpc_get_stats fills out with a's counters (each read atomically; the set is not a single
 * snapshot). THREAD SAFETY: any thread, any time between init and td_rpc_destroy. */
TD_API td_status td_rpc_get_stats(td_rpc_agent *a, td_rpc_stats *out);
/* td_rpc_get_peer_traffic fills out with the traffic between a and the worker of that rank
 * (TD_ERR_NOT_FOUND outside [0, world size)). */
TD_API td_status td_rpc_get_peer_traffic(td_rpc_agent *a, int rank, td_rpc_traffic *out);

/* td_rpc_progress_fd returns the file descriptor that is readable while user code waits to run on
 * an agent in TD_RPC_PROGRESS_HOST mode (-1 in the default mode). Borrowed: valid until
 * td_rpc_destroy; poll it, never read or close it. THREAD SAFETY: any thread. */
TD_API int td_rpc_progress_fd(const td_rpc_agent *a);
/* td_rpc_progress runs up to max_items (< 0: all) queued items - registered functions serving
 * requests, callbacks of call futures - on the calling thread and returns how many ran (-1 with
 * TD_ERR_STATE when a is not in host mode). The calling thread becomes the progress thread: while
 * it blocks in td_future_wait, td_future_wait_all or a graceful td_rpc_shutdown it keeps running
 * the queue, so a wait there cannot deadlock on work only it could do. THREAD SAFETY: one thread at
 * a time. */
TD_API int td_rpc_progress(td_rpc_agent *a, int max_items);

/* td_rpc_options_init fills o with the defaults (and its magic: a td_rpc_options not filled by
 * it is refused by td_rpc_init and td_rpc_init_from_env). */
TD_API void td_rpc_options_init(td_rpc_options *o);

/* td_rpc_secret_generate writes a new random job secret (64 hexadecimal characters and a NUL) into
 * out, which must hold at least 65 bytes. A program that starts its own workers (fork) without a
 * launcher calls it once, before forking, and hands the result to every worker (for example in
 * TD_RPC_SECRET, which children inherit). Returns TD_ERR_INVALID when n < 65, TD_ERR_INTERNAL when
 * the system has no randomness to give. THREAD SAFETY: any thread. */
TD_API td_status td_rpc_secret_generate(char *out, size_t n);
/* td_rpc_secret_ensure_env sets TD_RPC_SECRET to a new random secret unless TD_RPC_SECRET or
 * TD_RPC_SECRET_FILE is already set: for a program about to fork its own workers. Not
 * thread-safe (it changes the environment): call it before starting threads. */
TD_API td_status td_rpc_secret_ensure_env(void);

/* td_rpc_ctx describes the call a registered function is serving. Borrowed; valid during the
 * call only. */
typedef struct td_rpc_ctx td_rpc_ctx;
TD_API td_rpc_agent *td_rpc_ctx_agent(const td_rpc_ctx *c);
TD_API const char *td_rpc_ctx_caller_name(const td_rpc_ctx *c);
TD_API int td_rpc_ctx_caller_rank(const td_rpc_ctx *c);
/* td_rpc_ctx_user_data returns the user_data given to td_rpc_register. */
TD_API void *td_rpc_ctx_user_data(const td_rpc_ctx *c);
/* td_rpc_ctx_time_left_ms returns how long the caller still waits for this call's result (ms, 0
 * once its timeout has passed), or -1 when the call has no timeout. The caller's timeout travels
 * with the request and counts here from its arrival. A user function whose caller's timeout
 * passed while it waited for a thread is never run: the caller gets TD_ERR_TIMEOUT "dropped
 * unrun" (counted in td_rpc_stats.requests_expired). */
TD_API int64_t td_rpc_ctx_time_left_ms(const td_rpc_ctx *c);
/* td_rpc_ctx_cancelled returns true once nobody will read this call's result: the caller's timeout
 * passed, the caller's stream closed (it died or went away), or this agent is shutting down (after
 * the graceful barrier, or at once for a non-graceful shutdown). A long handler polls it and
 * returns early (any status: the result is discarded). THREAD SAFETY: any thread, while the
 * handler runs. */
TD_API bool td_rpc_ctx_cancelled(const td_rpc_ctx *c);

/* td_rpc_fn is a registered function. It receives the arguments (borrowed) and either stores a
 * result in *result (new reference; NULL means none), or stores a future in *async_result (new
 * reference) whose outcome becomes the reply once it completes - no thread waits meanwhile - or
 * returns an error with td_set_error, which reaches the caller prefixed with this worker's name
 * and rank. It runs on one of the agent's worker threads. */
typedef td_status (*td_rpc_fn)(td_rpc_ctx *ctx, td_value *const *args, int nargs,
                                td_value **result, td_future **async_result);

/* td_rpc_register registers fn under name for every agent in this process (names are unique;
 * TD_ERR_EXISTS otherwise). Names starting with "__" are reserved.
 * - When: register before td_rpc_init. Each worker publishes its registry at init, and callers
 *   refuse at once a call to a function the callee did not publish: a function registered after
 *   init runs when called from this process (calls to self), but peers never see it.
 * - user_data: borrowed; it must stay valid until the function is unregistered, or until every
 *   agent of the process is destroyed (a call may be running on any agent's thread until then).
 * - Unregistering (td_rpc_unregister) affects requests that arrive afterwards only: they fail with
 *   TD_ERR_NOT_FOUND naming the worker; a call already running finishes normally.
 * THREAD SAFETY: any thread. */
TD_API td_status td_rpc_register(const char *name, td_rpc_fn fn, void *user_data);
/* Registration flags. TD_RPC_INLINE: the function is short and never blocks, so it runs on the
 * transport's poller thread as soon as the request arrives instead of on a pool thread (saves a
 * thread hand-off per call: lower latency for tiny functions). It must not make blocking calls
 * (td_rpc_sync from it fails with TD_ERR_STATE) nor wait on futures; async calls are fine. */
#define TD_RPC_INLINE 1u

/* td_rpc_register_ex is td_rpc_register with flags (TD_RPC_INLINE or 0). */
TD_API td_status td_rpc_register_ex(const char *name, td_rpc_fn fn, void *user_data,
                                    unsigned flags);

/* td_rpc_unregister removes a registration (TD_ERR_NOT_FOUND when absent); see td_rpc_register
 * for what it means to calls in flight. */
TD_API td_status td_rpc_unregister(const char *name);

/* td_rpc_init joins the group as worker `name` (NULL: "worker<rank>"). Blocks until every worker
 * has joined or opts->init_timeout_ms passes. Rank 0's store is opts->init_method, or MASTER_ADDR /
 * MASTER_PORT from the environment (see td_rpc_options.init_method). Other workers may call this
 * one as soon as they have joined: their requests wait until this init has finished (every layer
 * ready), then run, possibly before td_rpc_init has returned here; a handler gets the agent from
 * td_rpc_ctx_agent. With rank TD_RPC_RANK_JOIN (and max_world_size > world_size) the worker
 * joins a running group instead: it takes the next free place (td_rpc_rank says which), learns
 * the workers there, and the others learn it when they first need it (a call by its name or
 * rank, or a request from it); it has no same-host lane, direct copy or device maps (gRPC
 * streams only). Invalid or duplicate names, a rank outside
 * [0, world_size) or taken twice, a full group, a world size that differs from rank 0's and a bad device map
 * (see td_rpc_options.device_maps) are errors. Returns
 * the agent in *out; release with td_rpc_shutdown() then td_rpc_destroy(). */
TD_API td_status td_rpc_init(const char *name, int rank, int world_size,
                             const td_rpc_options *opts, td_rpc_agent **out);
/* td_rpc_init_from_env reads RANK, WORLD_SIZE (LOCAL_RANK is informational), MASTER_ADDR and
 * MASTER_PORT (default 29500); falls back to SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / the
 * first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), then to OMPI_COMM_WORLD_RANK /
 * _SIZE / _LOCAL_RANK. Under Slurm without MASTER_PORT the port is 20000 + SLURM_JOB_ID % 12000,
 * under mpirun 20000 + a hash of the Open MPI job % 12000, so two jobs on one node do not collide
 * (and if they do, the run id check refuses the second: td_rpc_options.run_id). Under mpirun over
 * several hosts set MASTER_ADDR (rank 0's host) with `mpirun -x MASTER_ADDR=...`. name may be
 * NULL. opts->init_method, when set, overrides MASTER_ADDR/MASTER_PORT. TD_RPC_MAX_WORLD_SIZE
 * (tdistrun --nnodes MIN:MAX sets it) makes the group elastic, and RANK=-1 then joins a running
 * group (TD_RPC_RANK_JOIN). */
TD_API td_status td_rpc_init_from_env(const char *name, const td_rpc_options *opts,
                                      td_rpc_agent **out);

/* td_rpc_init_interrupt makes every td_rpc_init / td_rpc_init_from_env that is waiting for the
 * other workers in this process give up: each returns TD_ERR_CANCELLED within about 0.3 s,
 * having released what it made. Inits started afterwards are not affected. For hosts that stop
 * waiting for an init they started on another thread (Python's Ctrl-C): a process must not exit
 * while a thread is still inside tdist. Any thread; async-signal-safe (one atomic increment). */
TD_API void td_rpc_init_interrupt(void);

/* td_rpc_get_worker_info fills *out for the worker called name. */
TD_API td_status td_rpc_get_worker_info(td_rpc_agent *a, const char *name, td_worker_info *out);
/* td_rpc_get_worker_info_by_rank fills *out for rank. */
TD_API td_status td_rpc_get_worker_info_by_rank(td_rpc_agent *a, int rank, td_worker_info *out);
/* td_rpc_self fills *out with this worker's info. */
TD_API td_status td_rpc_self(td_rpc_agent *a, td_worker_info *out);
TD_API int td_rpc_rank(const td_rpc_agent *a);
/* td_rpc_world_size: the places of the group, ranks 0..world_size-1 (max_world_size in an
 * elastic group, where some places may still be free: td_rpc_get_worker_info_by_rank answers
 * TD_ERR_NOT_FOUND for those). */
TD_API int td_rpc_world_size(const td_rpc_agent *a);
/* td_rpc_initial_world_size: the workers that started the group (ranks 0..n-1): the world_size
 * given to td_rpc_init; equal to td_rpc_world_size in a group of fixed size. */
TD_API int td_rpc_initial_world_size(const td_rpc_agent *a);
/* td_rpc_group_members: how many places of the group are taken now (the workers that started it
 * and those that joined since, whether they are still alive or not); asks rank 0's store in an
 * elastic group. */
TD_API td_status td_rpc_group_members(td_rpc_agent *a, int *members);
/* td_rpc_busy_poll_us returns the busy-poll window in effect (td_rpc_options.busy_poll_us after
 * the automatic choice), in microseconds. */
TD_API int64_t td_rpc_busy_poll_us(const td_rpc_agent *a);
/* td_rpc_direct_copy_peers returns how many peers copy tensors directly from this worker:
 * growing as peers on this host meet it (a pair settles it when it makes its mailbox or dialled
 * lane), or known at init where the group probes there (td_rpc_options.direct_copy). THREAD
 * SAFETY: any thread. */
TD_API int td_rpc_direct_copy_peers(const td_rpc_agent *a);
/* td_rpc_shm_lanes returns how many streams of this worker run over a same-host lane now (both
 * directions switched; td_rpc_options.shm_lane). THREAD SAFETY: any thread. */
TD_API int td_rpc_shm_lanes(const td_rpc_agent *a);
/* td_rpc_mailbox_lanes returns how many of them are mailbox lanes: a pair on one host whose
 * processes may take each other's descriptors (the kernel's ptrace check, as for direct copy)
 * shares one lane through slots of their mailboxes, with no handshake between them
 * (TD_RPC_MAILBOX=0 turns them off: the pair dials a lane instead). THREAD SAFETY: any thread. */
TD_API int td_rpc_mailbox_lanes(const td_rpc_agent *a);

/* Options of one call. Fill with TD_RPC_CALL_OPTS_INIT (or td_rpc_call_opts_init), then set what
 * differs:
 *   td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
 *   o.timeout_ms = 500;
 * A struct not filled so (`td_rpc_call_opts o = {0}`, `{.timeout_ms = 500}`) fails the call at
 * once with TD_ERR_INVALID ("td_rpc_call_opts not initialised: use TD_RPC_CALL_OPTS_INIT"), and
 * nothing is sent: a zeroed timeout would otherwise read as TD_TIMEOUT_ZERO, expired at once. */
typedef struct td_rpc_call_opts {
  /* Set by the initialiser (TD_RPC_CALL_OPTS_MAGIC); anything else is refused. */
  uint32_t magic;
  /* The call's timeout (tdist/timeout.h): TD_TIMEOUT_DEFAULT is the agent's rpc timeout as it is
   * when the call starts, TD_TIMEOUT_INFINITE none, TD_TIMEOUT_ZERO fails the call at once with
   * TD_ERR_TIMEOUT. It travels with the request: the callee drops a request whose deadline passed
   * while it was queued, and its handler can read what is left of it
   * (td_rpc_ctx_time_left_ms). */
  td_timeout_ms timeout_ms;
} td_rpc_call_opts;
/* TD_RPC_CALL_OPTS_INIT initialises a td_rpc_call_opts with the defaults (timeout
 * TD_TIMEOUT_DEFAULT). */
#define TD_RPC_CALL_OPTS_INIT {TD_RPC_CALL_OPTS_MAGIC, TD_TIMEOUT_DEFAULT}
/* td_rpc_call_opts_init does the same as TD_RPC_CALL_OPTS_INIT (for bindings, which cannot use
 * macros). */
TD_API void td_rpc_call_opts_init(td_rpc_call_opts *o);

/* td_rpc_async calls fn on worker `to` with args[0..nargs) (borrowed; not to be modified
 * afterwards) and returns at once with a future (new reference) in *out. opts may be NULL (the
 * defaults); one not filled by TD_RPC_CALL_OPTS_INIT is TD_ERR_INVALID, nothing sent. A CUDA
 * tensor on a device that the device map toward `to` does not cover fails the call at once with
 * TD_ERR_DEVICE (see td_rpc_options.device_maps). */
TD_API td_status td_rpc_async(td_rpc_agent *a, const char *to, const char *fn,
                              td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                              td_future **out);
/* td_rpc_sync is td_rpc_async + wait: *result gets the value (new reference) on TD_OK; on failure
 * td_last_error() holds the message. Blocks. */
TD_API td_status td_rpc_sync(td_rpc_agent *a, const char *to, const char *fn,
                             td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                             td_value **result);

/* td_rpc_set_default_timeout changes the agent's rpc timeout (what TD_TIMEOUT_DEFAULT means for
 * calls started from now on): a duration, TD_TIMEOUT_INFINITE, or TD_TIMEOUT_DEFAULT to go back to
 * td_rpc_options.rpc_timeout_ms. TD_ERR_INVALID for another negative value. */
TD_API td_status td_rpc_set_default_timeout(td_rpc_agent *a, td_timeout_ms timeout);
/* td_rpc_get_default_timeout returns the agent's rpc timeout (a duration or TD_TIMEOUT_INFINITE). */
TD_API td_timeout_ms td_rpc_get_default_timeout(const td_rpc_agent *a);

/* td_rpc_shutdown stops the agent. Graceful: blocks until every worker has called shutdown and no
 * worker has work outstanding (calls in flight, handlers running, including fire-and-forget
 * chains), then tears down; once the timeout passed (TD_TIMEOUT_DEFAULT: the agent's rpc timeout;
 * TD_TIMEOUT_INFINITE: no limit) it aborts, fails everything outstanding, and returns
 * TD_ERR_TIMEOUT with a message naming the workers that never arrived. Non-graceful: fails
 * everything outstanding and returns at once. Either way it returns by its deadline + 1 s,
 * whatever handlers, peers or transfers do: handlers still running then are abandoned (they finish
 * on their own; their replies are dropped) and named in the TD_ERR_TIMEOUT message (function,
 * caller, running time); td_rpc_destroy then leaves the agent's memory to the process, which can
 * exit normally. Handlers see td_rpc_ctx_cancelled() once the agent stops. With TD_SUMMARY_DIR
 * set (tdistrun --summary) the agent's totals are written there. Safe to call twice. */
TD_API td_status td_rpc_shutdown(td_rpc_agent *a, bool graceful, td_timeout_ms timeout);
/* td_rpc_destroy frees a shut-down agent (shutting it down non-gracefully first if needed). NULL
 * does nothing. */
TD_API void td_rpc_destroy(td_rpc_agent *a);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_RPC_H */
