/* agent_state.h - the RPC agent's state, shared by the files of the agent and by no other layer
 * (upper layers use agent_impl.h). The agent is split by concern:
 *
 *   agent.c       the object: options, accessors, worker infos, handler contexts
 *   registry.c    the process-wide function registry, agent hooks, message middleware
 *   call.c        outgoing calls: pending table, deadline heap, td_rpc_async / td_rpc_sync,
 *                 timeouts, calls failed by a closed stream or by shutdown
 *   serve.c       incoming requests: dispatch (network thread or pool), handlers, replies,
 *                 malformed frames, the store's unary method
 *   rendezvous.c  td__rpc_init_impl: arguments, transport, rendezvous through the store, env;
 *                 joining a running (elastic) group
 *   elastic.c     learning the workers that joined an elastic group after its start
 *   devmap.c      device maps: published and checked at rendezvous
 *   direct.c      same-host direct copy: the probe at rendezvous, descriptors, the reader and
 *                 the ack table (direct.h)
 *   shutdown.c    the graceful barrier, td_rpc_shutdown, td_rpc_destroy
 *
 * Lock order: a->mu, then the transport's locks (through td__conn_send). Futures are completed
 * with no agent lock held. The registry's lock and the hooks' lock are leaves.
 */
#ifndef TD_RPC_AGENT_STATE_H
#define TD_RPC_AGENT_STATE_H

#include <pthread.h>

#include "agent_impl.h"
#include "auth.h"

/* Defaults of td_rpc_options (what TD_TIMEOUT_DEFAULT gives there), ms. */
#define TD__RPC_DEFAULT_TIMEOUT_MS 60000
#define TD__RPC_DEFAULT_INIT_TIMEOUT_MS 120000

/* A call in flight: its future, the peer and the stream it went out on. */
typedef struct pending {
  uint64_t id;
  td_future *fut;
  int peer;
  td__conn *conn; /* NULL for calls to self */
  char fn[64];
  int64_t timeout_ms;
  bool expired; /* ended by its deadline (counted as timed out, not failed) */
  bool traced;  /* an async "call" begin was recorded: record its end */
} pending;

typedef struct dl_entry {
  uint64_t deadline_ns;
  uint64_t id;
} dl_entry;

typedef struct peer_info {
  td_worker_info info;
  char **fns; /* sorted registry of that worker */
  int nfns;
  char *fns_blob;
  td__conn *conn;       /* our stream to it (lazy) */
  td__devmap out_map;   /* our device map toward it (requests we send it) */
  td__devmap reply_map; /* the inverse of its map toward us (replies we send it) */
} peer_info;

struct td_rpc_agent {
  td_rpc_options opts;
  char *listen_addr, *init_method;
  char name[128];
  char run_id[128]; /* td_rpc_options.run_id, resolved */
  uint64_t init_gen; /* td_rpc_init_interrupt's count when init started (rendezvous.c) */
  bool foreign;     /* the store belongs to another run: leave it alone */
  int rank, world;
  /* Elastic groups (td_rpc_options.max_world_size; rendezvous.c "Joining a running group"):
   * ranks [0, world0) started the group, world is every place; a place r >= world0 is known here
   * once present[r] is TD__PEER_PRESENT (atomic, set with release after peers[r] is filled). */
  int world0;
  bool joiner;       /* this worker took a free place of a running group */
  uint8_t *present;  /* [world] */
  int late_known;    /* atomic: places taken after the start, as last read from the store */
  uint64_t late_read_ns; /* atomic: when (td__now_ns; 0: never) */
  char join_addr[256]; /* a joiner's address until it has its rank */
  peer_info *peers;
  /* peers by name: an open-addressing table of rank + 1 (0: empty), mask + 1 slots, built once
   * the names are read (rendezvous.c); NULL before (td__agent_rank_of then scans) */
  int *name_idx;
  size_t name_mask;
  td__transport *tr;
  td__store *store; /* rank 0 only */
  td__store_parker store_parker; /* rank 0: how its store holds waits (store_park.c) */
  td__store_client sc;
  td__threadpool *pool;
  pthread_mutex_t mu;
  /* pending calls (call.c): open hash id -> pending*, and a min-heap of deadlines */
  pending **ptab;
  size_t pcap, plen;
  dl_entry *heap;
  size_t hlen, hcap;
  uint64_t next_id;
  td_timeout_ms default_timeout_ms; /* the rpc timeout: a duration or TD_TIMEOUT_INFINITE */
  /* shutdown accounting (atomics): calls out, requests being served, frames sent and served */
  int64_t pending_out, active_in;
  int64_t sent_total, served_total;
  /* counters (atomics; td_rpc_get_stats) */
  struct {
    uint64_t calls_started, calls_succeeded, calls_failed, calls_timed_out;
    uint64_t requests_received, requests_failed, requests_rejected;
    uint64_t requests_expired, pool_saturated;
    uint64_t handler_ns, sync_wait_ns;
    uint64_t refused_by_layers; /* td__agent_count_refused: strangers upper layers dropped */
    uint64_t streams_opened, streams_shared; /* peer_conn (call.c) */
  } cnt;
  /* handlers running on pool threads now (serve.c), to name them when the pool is saturated or
   * shutdown abandons them; guarded by run_mu */
  pthread_mutex_t run_mu;
  struct request *running;
  uint64_t saturation_logged_ns; /* last saturation warning (once per minute) */
  bool closing; /* no new calls */
  bool shut;    /* shutdown finished */
  bool abandoned; /* shutdown left handlers running: td_rpc_destroy must not free the agent */
  int64_t busy_poll_us; /* resolved td_rpc_options.busy_poll_us */
  /* group authentication (auth.h): the key, our session with the store, rank 0's sessions */
  td__auth auth;
  bool tls; /* every gRPC connection runs mutual TLS (td_rpc_options.tls_*) */
  td__auth_client store_auth;
  td__auth_sessions *sessions;
  bool trace_owned; /* this agent started tracing (TD_TRACE): its shutdown writes the file */
  /* host-driven progress (progress.c): user code queued for td_rpc_progress, or NULL */
  struct td__hostq *hostq;
  /* same-host direct copy (direct.c) */
  uint64_t direct_nonce; /* peers read it from our memory to prove they can */
  bool direct_on;
  bool lane_on; /* same-host lanes wanted (td_rpc_options.shm_lane, TD_RPC_SHM_LANE) */
  bool lane_dial; /* ... dialled, without a gRPC stream (unless TD_RPC_LANE_DIAL=0) */
  bool lane_mbox; /* ... through mailboxes first (unless TD_RPC_MAILBOX=0; rpc/lane.h) */
  /* init's last store call ("passed", ranks > 0) runs on a detached thread, off init's path:
   * started (passed_async), over (passed_done, under passed_mu; td__rdv_passed_join) */
  bool passed_async;
  bool passed_done;
  pthread_mutex_t passed_mu;
  pthread_cond_t passed_cv;
  /* calls may go out on a stream the callee opened (call.c peer_conn; TD_RPC_SHARE_STREAMS=0
   * turns it off) */
  bool share_streams;
  int local_workers; /* workers with this worker's host in their address (after init) */
  bool *direct_cand; /* [world]: same host, both enabled, we can read it */
  /* the ranks we read directly ("directok/<rank>", td__direct_probe), published with the ready
   * count (rdv_ready) */
  char *direct_ok;
  /* The records of every worker read at the start of the read phase in one request
   * (rdv_prefetch: worker/, registry/, devmap/, direct/), each taken by the td__rdv_read_all of
   * its prefix; init's thread only. */
  struct {
    const char *prefix;
    char **vals; /* NULL: not read whole, or taken */
    size_t *lens;
  } rdv_pre[4];
  int direct_peers;  /* peers that read our frames directly */
  /* Requests that arrive before init has finished (peers may call as soon as they passed the
   * ready barrier) wait here, in arrival order, until td__serve_start (serve.c); guarded by mu.
   * serving is read without mu on the hot path (atomic). */
  bool serving;
  struct request *held_head, *held_tail;
};

/* An incoming request, from its arrival to its reply (serve.c). */
typedef struct request {
  td_rpc_agent *a;
  td__conn *conn; /* NULL: a call to self */
  td__msg msg;
  char caller[128];
  uint64_t arrived_ns;  /* when it arrived */
  uint64_t deadline_ns; /* arrival + the caller's timeout (0: none) */
  uint64_t started_ns;  /* when its handler started (while on the running list) */
  struct request *run_prev, *run_next;
  bool gated; /* its arguments passed the argument gate (agent_impl.h) */
  struct request *held_next; /* on the agent's held list (before init finished) */
} request;

/* The mark on the id of a call that went out on a stream the callee opened (a shared stream's
 * reverse direction, td__transport_reverse_conn), and so on its reply: on any stream, a frame
 * whose mark differs from the stream's direction (requests on streams peers opened, replies on
 * ours) travels the reverse way. It tells a request from a reply even in a frame too malformed
 * to decode, so each side can answer a bad one correctly. */
#define TD__ID_REVERSE (1ull << 63)

/* Whether a frame with this id on stream c is a request to this worker (else a reply to it). */
static inline bool td__id_is_request(const td__conn *c, uint64_t id) {
  return td__conn_is_client(c) == ((id & TD__ID_REVERSE) != 0);
}

/* The id of a call's trace flow: unique in the group (the caller's rank, then its call id). */
static inline uint64_t td__call_trace_id(int caller_rank, uint64_t id) {
  return ((uint64_t)(unsigned)caller_rank << 48) ^ id;
}

/* Adds one to an agent counter. */
#define TD__COUNT(a, field) __atomic_add_fetch(&(a)->cnt.field, 1, __ATOMIC_RELAXED)

/* ---- agent.c ---- */
/* The name of rank (or "?"). Borrowed; valid until td_rpc_destroy. */
const char *td__agent_peer_name(const td_rpc_agent *a, int rank);
/* The rank of the worker called name, or -1. Lock-free. */
int td__agent_rank_of(const td_rpc_agent *a, const char *name);

/* ---- elastic.c: places taken after the start ---- */
#define TD__PEER_VACANT 0
#define TD__PEER_PRESENT 1
#define TD__PEER_LEARNING 2
/* Whether peers[rank] is filled (every rank of the start; a later one once learnt). */
static inline bool td__agent_present(const td_rpc_agent *a, int rank) {
  return rank >= 0 && rank < a->world &&
         (rank < a->world0 ||
          __atomic_load_n(&a->present[rank], __ATOMIC_ACQUIRE) == TD__PEER_PRESENT);
}
/* td__agent_rank_of, learning the workers that joined since when name is unknown (asks rank
 * 0's store: never on a network thread, where it answers -1). */
int td__agent_find(td_rpc_agent *a, const char *name);
/* Whether rank is present, learning it from the store when it joined since (as above). */
bool td__agent_learn_rank(td_rpc_agent *a, int rank);
/* A request arrived from rank, not yet learnt: learn it on the pool (once). */
void td__agent_learn_later(td_rpc_agent *a, int rank);
/* Places taken now (elastic groups ask the store; else world). */
td_status td__agent_members(td_rpc_agent *a, int *members);
/* Installs rank r's record ("name\taddress") and registry text (owned by the peer after a
 * success); a->mu held by the caller for a place learnt after the start. (rendezvous.c) */
td_status td__rdv_install_peer(td_rpc_agent *a, int r, char *rec, char *fns, size_t nfns);
/* Inserts rank r's name into the names index (a->mu held, or init); TD_ERR_EXISTS with a
 * message when another rank has it. (rendezvous.c) */
td_status td__rdv_index_name(td_rpc_agent *a, int r);
/* Reads the registry text a registry/<r> record names. (rendezvous.c) */
td_status td__rdv_registry_text(td_rpc_agent *a, const char *key, char **text, size_t *n);
/* True when peer p published fn in its registry at init. */
bool td__agent_peer_has_fn(const peer_info *p, const char *fn);

/* ---- registry.c ---- */
/* td__reg_find copies the registration of name into *out; false when absent. */
bool td__reg_find(const char *name, td__reg *out);
/* td__reg_snapshot returns "name\nname\n..." sorted (td__malloc'd), NULL when out of memory. */
char *td__reg_snapshot(void);
/* td__agent_hooks_get copies the installed hooks into out (room for TD__MAX_AGENT_HOOKS) and
 * returns how many there are. */
#define TD__MAX_AGENT_HOOKS 8
int td__agent_hooks_get(td__agent_hooks *out);
/* The message middleware, or NULL. */
const td__rpc_middleware *td__mw_get(void);
/* True while a TD_RPC_INLINE function runs on this (network) thread: blocking there would stop
 * the thread that delivers every reply. */
extern _Thread_local bool td__rpc_inline_thread;

/* ---- call.c ---- */
/* td__call_deliver completes the pending call id with a response (value: owned reference) or an
 * error; a late or unknown id is dropped, and so is a reply that arrives on another stream (via)
 * than the one the call went out on (via NULL: local knowledge). Any thread, no agent lock held. */
void td__call_deliver(td_rpc_agent *a, const td__conn *via, uint64_t id, int kind,
                      td_value *value, td_status st, const char *message);
/* td__call_burst_begin / _end bracket the frames a receiving thread delivers from one pass over
 * its rings: completions that must run on the pool (futures with user callbacks) go there as one
 * task at the end (or every 64), in arrival order, instead of one task each. The receiving
 * thread only; nested or other agents' bursts are ignored. */
void td__call_burst_begin(td_rpc_agent *a);
void td__call_burst_end(td_rpc_agent *a);
/* td__call_stream_closed fails every call that went out on the client stream c. */
void td__call_stream_closed(td_rpc_agent *a, td__conn *c, td_status st, const char *why);
/* td__call_expire fails the calls whose deadline passed (network thread, every tick). */
void td__call_expire(td_rpc_agent *a);
/* td__call_fail_all fails every pending call (shutdown). */
void td__call_fail_all(td_rpc_agent *a, td_status st, const char *msg);
/* td__call_free_all releases the pending table and the heap (td_rpc_destroy). */
void td__call_free_all(td_rpc_agent *a);

/* ---- serve.c ---- */
/* Transport callbacks (network thread). */
void td__serve_msg(void *ud, td__conn *c, td__msg *m);
void td__serve_bad(void *ud, td__conn *c, uint64_t id, td_status st, const char *why);
void td__serve_closed(void *ud, td__conn *c, td_status st, const char *why);
td_status td__serve_unary(void *ud, const char *method, const uint8_t *req, size_t len,
                          uint8_t **reply_buf, size_t *reply_len);
void td__serve_tick(void *ud);
void td__serve_burst(void *ud, bool end);
/* td__agent_name_hash: the hash of a worker name in a->name_idx (agent.c). */
size_t td__agent_name_hash(const char *s);

/* ---- store_park.c: rank 0's store holding waits (store.h, parked waits) ---- */
/* td__store_park_init sets rank 0's parker once, with its store, before any thread serves a
 * store call (the poller and, for rank 0's own calls, the calling thread both do:
 * local_store_unary). */
void td__store_park_init(td_rpc_agent *a);
/* td__store_park_body serves one verified store operation (ctx: the agent) with its waits
 * parked; td__store_park_tick answers those whose time passed (poller tick);
 * td__store_park_end answers all of them (before the transport shuts down). */
td_status td__store_park_body(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                              size_t *reply_len);
void td__store_park_tick(td_rpc_agent *a);
void td__store_park_end(td_rpc_agent *a);
/* td__serve_running writes into buf (n bytes) the handlers running on this worker's threads now
 * ("'fn' called by name (rank r), running 1.5 s; ...") and returns how many there are. */
int td__serve_running(td_rpc_agent *a, char *buf, size_t n);
/* td__serve_start lets requests run: those held since before init finished first (the end of
 * init, once every layer's hook ran). td__serve_drop_held answers the held ones with an error
 * (a failed init). */
void td__serve_start(td_rpc_agent *a);
void td__serve_drop_held(td_rpc_agent *a, const char *why);
/* td__serve_local runs a call to self (id already pending) on the pool; fn and args are copied. */
void td__serve_local(td_rpc_agent *a, uint64_t id, const char *fn, td_value *const *args,
                     int nargs, int64_t timeout_ms, uint64_t ctx_id);

/* ---- direct.c ---- */
/* Whether this worker offers direct copy (option, TD_RPC_DIRECT_COPY, platform). */
bool td__direct_wanted(const td_rpc_options *o);
/* Whether this worker offers same-host lanes (option, TD_RPC_SHM_LANE, platform). */
bool td__lane_wanted(const td_rpc_options *o);
bool td__mbox_wanted(void);
/* Rendezvous steps, in this order: the record published before the join barrier (key
 * "direct/<rank>" and its value, published with the worker's other records), probe after it,
 * learn after the ready barrier. */
void td__direct_record(td_rpc_agent *a, char key[64], char val[512]);
td_status td__direct_probe(td_rpc_agent *a, uint64_t deadline);
td_status td__direct_learn(td_rpc_agent *a, uint64_t deadline);

/* ---- devmap.c ---- */
/* The record published before the join barrier (key "devmap/<rank>", *val td__malloc'd, *n
 * bytes); set up (check every map, keep ours) after it. */
td_status td__devmap_record(td_rpc_agent *a, char key[64], char **val, size_t *n);
td_status td__devmap_setup(td_rpc_agent *a, uint64_t deadline);
void td__devmap_free_all(td_rpc_agent *a);

/* ---- progress.c ---- */
typedef struct td__hostq td__hostq;
td_status td__hostq_create(td__hostq **out);
/* Runs up to max queued items (max < 0: all) on this thread; returns how many ran. */
int td__hostq_run(td__hostq *q, int max);
void td__hostq_destroy(td__hostq *q);
/* The calling thread becomes the progress thread (its blocking waits run the queue). */
void td__progress_adopt_thread(td_rpc_agent *a);
/* Runs what is queued (host mode; no-op otherwise). */
void td__progress_pump(td_rpc_agent *a);
/* The same, only when called on the progress thread (the graceful barrier: a shutdown called on
 * another thread leaves the queue to the progress thread). */
void td__progress_pump_if_owner(td_rpc_agent *a);

/* ---- rendezvous.c ---- */
/* td__rdv_local_estimate: workers on this host before the group is known (the launcher's
 * LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or SLURM_NTASKS_PER_NODE, else world).
 * td__rdv_handshake_ms: the handshake timeout of a group of world workers (TD_RPC_HANDSHAKE_
 * TIMEOUT_MS, else 20 s stretched by workers per CPU past 2, at most TD__HANDSHAKE_MAX_MS). */
#define TD__HANDSHAKE_MAX_MS 120000
int td__rdv_local_estimate(int world);
int64_t td__rdv_handshake_ms(int world);
/* td__rdv_passed_wait: rank 0, before its store goes away (shutdown), waits (until hard, and no
 * longer than td__rdv_exit_wait_ms) for every starting worker to have finished its init's use of
 * the store ("passed"). No-op on other ranks. */
void td__rdv_passed_wait(td_rpc_agent *a, uint64_t hard);
/* td__rdv_passed_join: waits for this worker's own "passed" to have reached the store (ranks >
 * 0 send it from a thread of its own as init returns). Before the transport goes away. */
void td__rdv_passed_join(td_rpc_agent *a);
/* td__rdv_exit_wait_ms: how long rank 0 keeps its store up after the graceful barrier for the
 * others to see "go" and report (shutdown.c): 5 s, on a host running more than twice as many
 * workers as CPUs longer with the load (x load / 200), at most 60 s. */
int64_t td__rdv_exit_wait_ms(const td_rpc_agent *a);
/* td__rdv_store_call_ms: the store client's per-call timeout during a graceful shutdown: 10 s,
 * stretched the same way (at most 60 s; every call still ends by the shutdown's deadline). */
int64_t td__rdv_store_call_ms(const td_rpc_agent *a);

/* td__agent_set_abort makes every worker still in rendezvous fail with why. */
void td__agent_set_abort(td_rpc_agent *a, const char *why);
/* td__rdv_read_all waits for every rank's record under prefix ("worker/" ... "worker/<N-1>") and
 * gives them (NUL-terminated) in a few store requests, or none when the read phase's first
 * request brought them (a->rdv_pre); free with td__rdv_free_all. */
td_status td__rdv_read_all(td_rpc_agent *a, const char *prefix, uint64_t deadline, char ***vals,
                          size_t **lens);
void td__rdv_free_all(td_rpc_agent *a, char **vals, size_t *lens);
/* td__agent_free releases what init built (after the transport and pool are gone). */
void td__agent_free(td_rpc_agent *a);

#endif
