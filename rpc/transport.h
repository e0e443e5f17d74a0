/* transport.h - byte transport between workers (implemented over gRPC C core in
 * grpc_transport.c, grpc_stream.c and grpc_unary.c, the only files that include gRPC headers).
 *
 * A td__conn is one long-lived bidirectional stream: either one this process opened to a peer's
 * server (client side) or one a peer opened to ours (server side). Frames (wire.h) go out through
 * td__conn_send, which queues them and coalesces queued frames into gRPC messages of up to a few
 * MiB (small frames share a message; big tensors are split across messages without copying); the
 * receive side feeds each message's slices into the conn's decoder. Everything completes on one
 * poller thread; td__conn_send may be called from any thread. A conn to a member on this host is
 * a dialled same-host lane instead (lane.h): no gRPC call under it, its frames through shared
 * memory, delivered on the lane thread, its end reported by the socket or lane thread.
 *
 * The transport also carries unary byte calls (the rendezvous store's operations): any process can
 * call a method on any address, and the process that serves the store answers through on_unary.
 */
#ifndef TD_RPC_TRANSPORT_H
#define TD_RPC_TRANSPORT_H

#include <stdint.h>

#include "wire.h"

typedef struct td__transport td__transport;
typedef struct td__conn td__conn;

typedef struct td__transport_cbs {
  void *ud;
  /* A complete message arrived on c (poller thread). Takes ownership of m's contents. */
  void (*on_msg)(void *ud, td__conn *c, td__msg *m);
  /* A frame on c was skipped (malformed or oversized); the peer waits for an answer to id. */
  void (*on_bad)(void *ud, td__conn *c, uint64_t id, td_status st, const char *why);
  /* c closed (peer gone, stream failed, or transport shutting down). Called once per conn. */
  void (*on_closed)(void *ud, td__conn *c, td_status st, const char *why);
  /* A unary call arrived (poller thread): fill *reply (malloc'd, freed by the transport) and
   * return TD_OK, or return an error to answer with a failed status. */
  td_status (*on_unary)(void *ud, const char *method, const uint8_t *req, size_t len,
                        uint8_t **reply, size_t *reply_len);
  /* Called about every tick_ms on the poller thread. */
  void (*on_tick)(void *ud);
  /* Optional: brackets the frames one pass over the same-host lanes delivers (end false before
   * it, true after it), on the thread making the pass (the lane thread, or a waiter driving the
   * lanes), so the agent can hand the pool what the pass produced at once. */
  void (*on_burst)(void *ud, bool end);
} td__transport_cbs;

/* Mutual TLS settings: PEM text (borrowed during td__transport_create) and the name every
 * member's certificate carries. */
typedef struct td__tls {
  const char *cert_pem, *key_pem, *ca_pem;
  const char *name; /* NULL: "tdist" */
} td__tls;

typedef struct td__transport_opts {
  const char *host;         /* listen address */
  int port;                 /* 0 = any free port */
  int64_t keepalive_ms;     /* ping interval for client channels */
  int64_t keepalive_timeout_ms; /* unanswered ping => peer gone (default 20000) */
  uint64_t max_message;     /* decoder limit, 0 = unlimited */
  int self_rank;
  int world;                /* ranks are 0..world-1 (traffic is counted per rank) */
  void *agent;              /* given to the decoders' wire ctx */
  int tick_ms;              /* on_tick period, default 10 */
  /* Group authentication (auth.h): every stream starts with its handshake, whose key this is.
   * NULL: insecure mode (handshake without proofs). Borrowed; must outlive the transport. */
  const struct td__auth *auth;
  /* A server stream must finish its handshake within this (ms; default 20000). */
  int64_t handshake_timeout_ms;
  /* ... and send its HELLO, proving membership, within this (ms; default 2000; a stream whose
   * HELLO may still wait in the poller's queue is not timed out: grpc_stream.c). */
  int64_t hello_timeout_ms;
  /* Bytes of frames in progress (allocated, not yet complete) that one member (a rank) may make
   * this worker hold across all its streams (default max_message + 256 MiB; 0: that default). */
  uint64_t member_held_max;
  /* Mutual TLS on every connection, or NULL for plain TCP. */
  const td__tls *tls;
  /* Memory gRPC may hold for all connections (bytes; default 1 GiB): beyond it streams are reset
   * rather than buffered. */
  uint64_t memory_quota;
  /* A frame whose bytes stop arriving for this long is dropped and its stream closed (ms; default
   * 3 x keepalive_timeout_ms). */
  int64_t stall_timeout_ms;
  /* Same-host lanes (lane.h): streams with a peer on this host move their frames through shared
   * memory once td__transport_allow_lane named the peer's process. */
  bool lane;
  /* Frames with this many bytes of tensors or more go to a same-host peer by direct copy when
   * they take the lane (0: TD__LANE_DIRECT_MIN_BYTES); on the stream the bound is
   * TD__DIRECT_MIN_BYTES (direct.h). */
  uint64_t lane_direct_min;
  /* Keepalive chosen by tdist (keepalive_ms was automatic): on a host running more than twice as
   * many workers as CPUs (host_load_x100 > 200: workers per CPU, times 100) a starved but live
   * peer answers pings late, so the timeout of channels to peers on this host (and of the server)
   * stretches with the load (x load / 200), up to TD__KEEPALIVE_MAX_MS, and the pings thin out
   * (at most 4 per timeout); a peer that dies is still seen at once (its connection closes). host_load_x100 is the estimate before the group is known (every worker on this
   * host); td__transport_set_host_load gives the exact one. */
  bool keepalive_auto;
  int host_load_x100;
} td__transport_opts;

/* The longest keepalive timeout a host's load stretches to (ms). */
#define TD__KEEPALIVE_MAX_MS 300000

/* td__transport_unary_defer, called from inside on_unary: the call being answered is answered
 * later, by td__transport_unary_answer(token, ...) (what on_unary returns is then dropped);
 * NULL when it cannot be (on_unary's reply goes out as usual). Poller thread. A call still
 * unanswered when the transport shuts down is failed with UNAVAILABLE. The transport is the
 * call's own: on_unary may run before td__transport_create has returned it to its owner. */
void *td__transport_unary_defer(void);
/* td__transport_unary_answer sends a deferred call's reply (td__malloc'd, taken; NULL: fail it
 * with UNAVAILABLE) and releases the token: once per token, from any thread, also after the
 * transport shut down (then the reply is dropped). */
void td__transport_unary_answer(void *token, uint8_t *reply, size_t len);

/* Starts the server and the poller thread; *bound_port gets the port actually bound. */
td_status td__transport_create(const td__transport_opts *o, const td__transport_cbs *cbs,
                               td__transport **out, int *bound_port);
/* Stops everything: closes every conn (on_closed runs for each), stops the server, joins the
 * poller. Blocks until gRPC has returned every tag. Safe to call twice. */
void td__transport_shutdown(td__transport *t);
/* td__transport_stop shuts t down and stops its threads without freeing it: for an agent whose
 * abandoned handlers may still touch its streams (sends on them then fail). */
void td__transport_stop(td__transport *t);
void td__transport_destroy(td__transport *t);

/* Same-host direct copy, configured once at init. td__transport_allow_direct: a direct-copy
 * frame is accepted only on the authenticated stream of rank r and only when it names pid_of[r],
 * the process of r whose memory the caller verified it can read (0: none).
 * td__transport_direct_to: frames with at least 32 KiB of tensors go to a peer rank r with to[r]
 * as descriptors that the peer reads from this process's memory (process_vm_readv); the tensors
 * stay referenced until the peer's ack. */
td_status td__transport_allow_direct(td__transport *t, const int *pid_of, int world);
td_status td__transport_direct_to(td__transport *t, const bool *to, int world);
/* td__transport_direct_lazily: instead of both (where this process dials lanes), each pair on
 * this host settles direct copy in its dialled lane's handshake: each side probes the other's
 * memory (rank r's pid_of[r], and the nonce r published at addr_of[r]; 0 pid: not on this
 * host) once the peer proved itself, accepts its frames when it can read it, and tells it so.
 * So a worker probes the peers it meets, not every process on its host. Once, at init.
 * td__transport_dialing: whether this process dials lanes (after td__transport_allow_lane).
 * td__transport_direct_readers: the peers known to read this process's direct-copy frames. */
td_status td__transport_direct_lazily(td__transport *t, const int *pid_of, const uint64_t *addr_of,
                                      const uint64_t *nonce_of, int world);
bool td__transport_dialing(td__transport *t);
int td__transport_direct_readers(td__transport *t);
/* td__transport_allow_lane: streams with rank r may move to a same-host lane whose socket peer is
 * process pid_of[r] (0: never); and a conn to r (td__transport_connect) is a dialled lane, with no
 * gRPC stream at all, at the dial socket named by r's pid and nonce_of[r] (0, or nonce_of NULL:
 * never), this process listening on its own (self_nonce). Once, at init; no-op without lanes.
 * mb_bell_of / mb_arena_of (NULL: none): the descriptors rank r's record published for its
 * mailbox (td__transport_mbox_open; -1: none); where this process has one too, a conn to r is a
 * mailbox lane first (rpc/lane.h), a dialled lane where that cannot be.
 * td__transport_lanes_up: the lanes carrying frames now; _dialed: of them, dialled ones (mailbox
 * lanes included); _mbox: mailbox lanes. */
td_status td__transport_allow_lane(td__transport *t, const int *pid_of, const uint64_t *nonce_of,
                                   uint64_t self_nonce, const int *mb_bell_of,
                                   const int *mb_arena_of, int world);
int td__transport_lanes_up(td__transport *t);
int td__transport_lanes_dialed(td__transport *t);
int td__transport_lanes_mbox(td__transport *t);
/* td__transport_mbox_open: this process's mailbox for a group of world ranks (nonce: its
 * same-host record's); *bell_fd and *arena_fd are the descriptors the record publishes.
 * TD_ERR_UNAVAILABLE without lanes. Once, at init, before td__transport_allow_lane. */
td_status td__transport_mbox_open(td__transport *t, int world, uint64_t nonce, int *bell_fd,
                                  int *arena_fd);

/* td__transport_traffic adds up the traffic with rank (or with every rank when rank < 0) into
 * *out (a td_rpc_traffic). THREAD SAFETY: any thread. */
struct td_rpc_traffic;
void td__transport_traffic(td__transport *t, int rank, struct td_rpc_traffic *out);

/* The number of refused connection attempts (failed or abandoned handshakes, streams over the
 * limits) since the transport started. THREAD SAFETY: any thread. */
uint64_t td__transport_refused(td__transport *t);

/* Sets the poller's busy-poll window: after each event it keeps polling without sleeping for this
 * many microseconds (0 = off, the default). */
void td__transport_set_busy_poll(td__transport *t, int64_t us);
/* A worker that joins a running group learns its rank after the transport is up (before any
 * stream to a peer exists); until then a HELLO for any rank is refused. */
void td__transport_set_self_rank(td__transport *t, int rank);
/* ... and the group's size, which may differ from what it was started with (before the rank). */
td_status td__transport_set_world(td__transport *t, int world);
/* td__transport_set_host_load: workers on this host per CPU, times 100, once the group is known
 * (for channels created from then on; see td__transport_opts.keepalive_auto). Any thread. */
void td__transport_set_host_load(td__transport *t, int load_x100);
/* td__transport_test_refuse_hellos (tests): the next n valid HELLOs this server receives are
 * refused as when the members' handshake slots are full (RESOURCE_EXHAUSTED). Any thread. */
void td__transport_test_refuse_hellos(td__transport *t, int n);

/* Opens a stream to the server at address ("host:port") for peer_rank. Returns a new
 * reference. The stream connects lazily; failures surface through on_closed. */
td_status td__transport_connect(td__transport *t, int peer_rank, const char *address,
                                td__conn **out);

td__conn *td__conn_ref(td__conn *c);
void td__conn_unref(td__conn *c);
/* The peer rank: for client conns the rank connected to (the server proved it in the
 * handshake); for server conns the rank the client proved in the handshake (-1 before: no frame
 * is decoded before). */
int td__conn_peer(const td__conn *c);
bool td__conn_is_client(const td__conn *c);
bool td__conn_closed(const td__conn *c);
/* Queues f for sending (takes ownership of f's contents on TD_OK and on failure alike).
 * TD_ERR_UNAVAILABLE when the conn is closed. THREAD SAFETY: any thread. */
td_status td__conn_send(td__conn *c, td__frame *f);
/* The number of frames td__conn_send accepted on c (final once c is closed: sends fail then). */
uint64_t td__conn_frames_sent(const td__conn *c);
/* ... of which frames marked reverse (td__frame.reverse). */
uint64_t td__conn_reverse_sent(const td__conn *c);
/* A stream peer_rank opened to this worker whose handshake proved that rank and which is still
 * open (new reference), or NULL. One stream serves a pair both ways: this worker's calls to
 * peer_rank may go out on it (ids marked TD__ID_REVERSE) instead of on a stream of its own, so a
 * pair that calls each other costs one connection and one handshake, not two. */
td__conn *td__transport_reverse_conn(td__transport *t, int peer_rank);
/* Closes the conn from this side (queued frames are dropped). */
void td__conn_close(td__conn *c, const char *why);

/* Makes a unary call to method at address and waits for the reply (malloc'd into *reply).
 * wait_for_ready: keep trying to connect until the deadline (rendezvous with a server that is
 * still starting). THREAD SAFETY: any thread. */
td_status td__transport_unary(td__transport *t, const char *address, const char *method,
                              const uint8_t *req, size_t len, int64_t timeout_ms,
                              bool wait_for_ready, uint8_t **reply, size_t *reply_len);

#endif
