/* grpc_impl.h - the gRPC transport's internals, shared by its three files (and only they include
 * gRPC headers):
 *   grpc_transport.c  channels, the server, the poller thread and its dispatch, lifecycle
 *   grpc_stream.c     streams (td__conn): send queue, receive into the decoder, closing
 *   grpc_unary.c      unary calls (the rendezvous store), server and client side
 *
 * Design:
 * - One completion queue (next-type) and one poller thread per transport; every tag is a small
 *   struct embedded in the object it belongs to, whose `kind` tells the poller what completed.
 *   Each started batch holds a reference on its object until its tag comes back.
 * - Streams (/tdist.Rpc/Stream) are bidi calls wrapped in td__conn. Per conn: at most one
 *   SEND_MESSAGE and one RECV_MESSAGE batch in flight (gRPC's rule). The send side is a queue of
 *   slices (frame heads and tensor bytes referenced in place, released through slice destroy
 *   callbacks); each send takes up to CHUNK bytes from its front, splitting big slices, so small
 *   frames coalesce and huge tensors stream in pieces.
 * - Unary calls (/tdist.Store/Op) answer through on_unary; the client side of a unary call uses a
 *   private pluck queue so it can block on any thread.
 * - Channels are cached per address with keepalive so a hung or dead peer fails the stream's
 *   status batch (UNAVAILABLE) and so every call waiting on it.
 *
 * Lock order: t->mu, then c->mu (never the other way). No lock is held while calling the agent's
 * callbacks.
 */
#ifndef TD_RPC_GRPC_IMPL_H
#define TD_RPC_GRPC_IMPL_H

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <pthread.h>

#include "../core/refcount.h"
#include "../core/threadpool.h"
#include "auth.h"
#include "direct.h"
#include "lane.h"
#include "transport.h"

/* ThreadSanitizer does not see the synchronisation inside gRPC (an uninstrumented library):
 * hand-offs through it are declared explicitly. Data written before a batch starts is read by the
 * thread that takes the batch's tag from the queue (release on the tag, acquire on the event);
 * memory given to gRPC as a slice is freed by whichever thread drops the slice (release at
 * creation, acquire in the destroy callback). No-ops in other builds. */
#if defined(__SANITIZE_THREAD__)
#define TD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TD_TSAN 1
#endif
#endif
#ifdef TD_TSAN
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define TSAN_RELEASE(p) __tsan_release((void *)(p))
#define TSAN_ACQUIRE(p) __tsan_acquire((void *)(p))
#else
#define TSAN_RELEASE(p) ((void)0)
#define TSAN_ACQUIRE(p) ((void)0)
#endif

#define STREAM_METHOD "/tdist.Rpc/Stream"
#define CHUNK (8u << 20) /* bytes per gRPC message on a stream */
#define N_REQUEST_SLOTS 16

enum {
  TAG_NEW_CALL = 1,
  TAG_CONN_START,
  TAG_CONN_RECV,
  TAG_CONN_SEND,
  TAG_CONN_STATUS,
  TAG_CONN_FINISH, /* server: our SEND_STATUS batch */
  TAG_UNARY_RECV,
  TAG_UNARY_DONE,
  TAG_SERVER_SHUTDOWN,
};

typedef struct tag {
  int kind;
  void *obj;
} tag;

typedef struct req_slot {
  tag t;
  grpc_call *call;
  grpc_call_details details;
  grpc_metadata_array md;
} req_slot;

typedef struct td__unary_token td__unary_token;

typedef struct unary_srv {
  tag t_recv, t_done;
  td__unary_token *token; /* deferred: answered later (grpc_unary.c) */
  td__transport *tr;
  grpc_call *call;
  char *method;
  grpc_byte_buffer *req;
  grpc_byte_buffer *reply;
  grpc_slice details;
  int cancelled;
} unary_srv;

typedef struct chan_entry {
  char *address;
  grpc_channel *ch;
} chan_entry;

struct td__conn {
  td__refcnt rc;
  td__transport *t;
  grpc_call *call;
  grpc_channel *ch; /* client: the channel its calls are opened on (the transport's) */
  bool client;
  bool direct; /* a dialled lane without a gRPC call under it (lane.h): call and ch are NULL */
  int peer;
  pthread_mutex_t mu;
  tag t_start, t_recv, t_send, t_status, t_finish;
  /* send side */
  grpc_slice *q;
  size_t qhead, qlen, qcap;
  bool send_inflight;
  grpc_byte_buffer *send_bb;
  bool finish_pending; /* server: send the status once the current send completes */
  grpc_status_code finish_code;
  char finish_msg[256];
  /* receive side */
  grpc_byte_buffer *recv_bb;
  grpc_byte_buffer *rd_bb;    /* the message being fed to the decoder (NULL: none) */
  grpc_byte_buffer_reader rd; /* ... its reader, */
  grpc_slice rd_slice;        /* its current slice */
  size_t rd_off;              /* and how far into it the decoder got */
  td__decoder *dec;
  bool first_recv;
  /* closing */
  grpc_metadata_array initial_md, trailing_md;
  grpc_status_code status;
  grpc_slice status_details;
  const char *error_string;
  int cancelled;
  bool closed;      /* no more sends */
  bool notified;    /* on_closed ran */
  uint64_t nsent;   /* frames accepted by td__conn_send */
  uint64_t nrev;    /* ... of them marked reverse (td__frame.reverse) */
  int batches;      /* atomic: batches started on the current call whose tags are not back */
  /* client: a handshake the server refused or evicted before it answered (nothing but the
   * HELLO was sent) starts again on a new call, the queued frames kept (grpc_stream.c) */
  bool retrying;
  int retries;
  uint64_t retry_at_ns, retry_until_ns;
  struct td__conn *next_live, *prev_live; /* t->live (t->mu) */
  bool in_live;                           /* (t->mu) */
  bool rev_noted;                         /* counted in t->rev_cnt (t->mu) */
  /* direct-copy frames sent and not yet acknowledged: their tensors stay alive until then */
  td__direct_acks acks;
  /* the same-host lane (lane.h) once offered or joined (c->mu; set on the poller), and its
   * decoder (owned by the lane, used by the lane thread) */
  td__lane *lane;
  td__decoder *lane_dec;
  /* authentication (auth.h): nothing is decoded before it, nothing but the handshake is sent */
  td__hs hs;
  int auth;                        /* AUTH_* */
  uint8_t hs_out[TD__HS_MAX_LEN];  /* a handshake message waiting to be sent */
  size_t hs_out_len;
  bool unauth_counted;             /* server: counted in t->unauth (no valid HELLO yet) */
  bool member_counted;             /* server: counted in t->unproven (HELLO with a ticket) */
  uint64_t born_ns;                /* for the handshake deadline */
  uint64_t progress_ns;            /* atomic: last time bytes arrived (stalled frames) */
  bool offloaded;                  /* atomic: the bulk thread has the decoder (grpc_stream.c) */
  char peer_addr[64];              /* the remote address, for logs */
};

enum {
  AUTH_CLIENT_HELLO_SENT, /* client: waiting for the CHALLENGE */
  AUTH_SERVER_WAIT_HELLO, /* server: waiting for the HELLO */
  AUTH_SERVER_WAIT_PROOF, /* server: CHALLENGE sent, waiting for the PROOF */
  AUTH_DONE,
  AUTH_FAILED,
};

/* Same-host direct copy, each table published once at init (with release, read with acquire,
 * freed with the transport); with direct_lazy, its entries are set later, each once, by the
 * dialled lanes' handshakes (atomic stores and loads). */
typedef struct direct_from {
  int world;
  int pid_of[]; /* [rank]: the process of that member we may read from (verified), 0 */
} direct_from;

typedef struct direct_to {
  int world;
  bool to[]; /* to[rank]: that peer reads our direct-copy frames */
} direct_to;

typedef struct direct_lazy {
  int world;
  struct {
    int pid;
    uint64_t addr, nonce;
  } rec[]; /* [rank]: what to probe (the peer's same-host record); pid 0: not on this host */
} direct_lazy;

/* Refused connection attempts: counted, and logged at most once a minute per remote host. */
#define TD__REFUSAL_HOSTS 32
typedef struct td__refusals {
  pthread_mutex_t mu;
  uint64_t count;
  struct {
    char host[64];
    uint64_t logged_ns;
    uint64_t suppressed;
  } hosts[TD__REFUSAL_HOSTS];
} td__refusals;

/* Connections whose streams end without ever authenticating (opened and reset, the HTTP/2
 * rapid-reset pattern, or refused handshakes), counted per TCP connection over a window: past
 * TD__ABUSE_STREAMS in TD__ABUSE_WINDOW_NS the connection is closed (grpc_transport.c). A member
 * connection sees one such stream at most per refused handshake. */
#define TD__ABUSE_CONNS 64
#define TD__ABUSE_STREAMS 64
#define TD__ABUSE_WINDOW_NS 10000000000ull
typedef struct td__abuse {
  char peer[64]; /* gRPC's peer string: "ipv4:127.0.0.1:54321" */
  uint64_t since_ns;
  uint32_t count;
} td__abuse;
#define TD__SEEN_NONCES 1024

struct td__transport {
  td__transport_opts opts;
  char *host;
  td__transport_cbs cbs;
  grpc_completion_queue *cq;
  grpc_server *server;
  pthread_t poller;
  bool poller_started;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool shutting_down, server_down, done;
  int64_t live_tags;
  req_slot slots[N_REQUEST_SLOTS];
  tag t_server_shutdown;
  td__conn *live; /* conns whose status has not come back */
  td__conn **rev_idx; /* [rev_n]: the latest authenticated server conn of each rank, in live (no
                       * reference; t->mu): td__transport_reverse_conn without a scan */
  int *rev_cnt; /* [rev_n]: server conns of each rank noted and still live (t->mu) */
  int rev_n;
  td__unary_token *deferred; /* unary calls to be answered later (grpc_unary.c) */
  chan_entry *chans;
  int nchans, chancap;
  int64_t busy_poll_ns; /* atomic; 0 = block at once */
  direct_from *direct_from; /* atomic pointers; NULL = none */
  direct_to *direct_to;
  direct_lazy *direct_lazy;
  int direct_readers; /* atomic: entries of direct_to set */
  int self_pid;
  /* authentication and bounds (auth.h, grpc_stream.c) */
  td__auth insecure;      /* used when opts.auth is NULL */
  int unauth;             /* server streams that sent no valid HELLO yet (t->mu) */
  int unproven;           /* server streams whose HELLO had a ticket, waiting for the PROOF */
  uint64_t idle_ns;       /* atomic: the poller last found its queue empty */
  int nretrying;          /* atomic: client streams waiting to retry their handshake */
  int port;               /* the port the server is bound to */
  int64_t *held;          /* [opts.world] bytes of frames in progress per member (atomics) */
  uint64_t held_max;      /* the bound on each */
  uint64_t trim_ns;       /* poller: last time freed memory was given back to the system */
  bool trim_wanted;       /* atomic: a stream that never authenticated ended since */
  /* ticketed HELLO nonces seen lately (a replayed HELLO is refused; t->mu) */
  uint64_t seen_nonce[TD__SEEN_NONCES];
  int seen_next;
  /* connections whose streams end before authenticating, per connection (abuse, t->mu) */
  td__abuse abuse[TD__ABUSE_CONNS];
  uint64_t next_sweep_ns; /* poller: next check of handshake deadlines and stalled frames */
  td__refusals refusals;  /* refused attempts, logged once per address per minute */
  td_rpc_traffic *traffic; /* [opts.world], updated with atomics */
  grpc_resource_quota *quota; /* bounds what gRPC buffers for all connections */
  td__threadpool *bulk;        /* large direct copies, off the poller thread */
  bool tls;                        /* mutual TLS on every connection (opts.tls) */
  char tls_name[256];              /* the name certificates are checked for */
  grpc_channel_credentials *chan_creds; /* TLS: shared by every channel; NULL: insecure */
  td__lanes *lanes; /* same-host lanes (opts.lane and the platform allow them); NULL: none */
  bool lane_lazy;   /* atomic: more peers on this host than TD__LANE_MAX: lanes by use only */
  int host_load_x100; /* atomic: workers per CPU on this host, times 100 (keepalive_auto) */
  int tick_ms;        /* atomic: the poller's tick (opts.tick_ms, longer on a loaded host) */
  int refuse_hellos;  /* atomic: td__transport_test_refuse_hellos */
};

/* Server streams in their handshake, in two tiers (grpc_stream.c):
 * - streams that have not sent a valid HELLO: at most this many (or twice the world), each for
 *   hello_timeout_ms. Members send their HELLO with the stream, so this tier holds strangers;
 *   when it is full a new stream takes the slot of the oldest one (it is never refused);
 * - streams whose HELLO carried a valid ticket (a member's: auth.h), waiting for the PROOF: at
 *   most twice the world plus this many, each for handshake_timeout_ms. No stranger gets here. */
#define TD__MAX_UNAUTH_STREAMS 64
/* A client stream whose handshake the server refused or evicted retries after 10 ms doubling to
 * this, until handshake_timeout_ms after it was opened. */
#define TD__RETRY_MAX_MS 500
/* Where more peers share this host than a process may hold lanes, a client stream asks for its
 * lane once it has carried this many frames. */
#define TD__LANE_LAZY_FRAMES 16


/* ---- grpc_transport.c ---- */
gpr_timespec td__grpc_deadline_ms(int64_t ms);
void td__grpc_tags_inc(td__transport *t);
void td__grpc_tags_dec(td__transport *t);
/* The cached channel to address (created on first use); NULL when out of memory. */
grpc_channel *td__grpc_channel_for(td__transport *t, const char *address);
td_status td__grpc_map_status(grpc_status_code c);
/* A slice over memory that destroy(p) frees, from whichever thread drops the slice last. */
grpc_slice td__grpc_owned_slice(void *data, size_t len, void (*destroy)(void *), void *p);
void td__grpc_free_head(void *p); /* destroy callback for td__malloc'd memory */

/* td__grpc_refused counts a refused attempt from addr and logs why, rate-limited per host. */
void td__grpc_refused(td__transport *t, const char *addr, const char *why);
/* td__grpc_abuse_note counts a stream of connection peer that ended without authenticating;
 * past the bound it closes that connection (poller thread). */
void td__grpc_abuse_note(td__transport *t, const char *peer);
/* td__grpc_trim gives memory freed by gRPC back to the system (rate-limited; any thread). */
void td__grpc_trim(td__transport *t);

/* ---- grpc_stream.c ---- */
/* td__grpc_sweep closes server streams past their handshake deadline and streams whose current
 * frame made no progress for the stall timeout (poller thread, about once a second). */
void td__grpc_sweep(td__transport *t, uint64_t now);
/* td__grpc_retry_due restarts the client streams whose handshake retry is due (poller; once
 * the transport is shutting down, it reports their end instead, and td__transport_shutdown
 * calls it with now = UINT64_MAX for every retry still waiting). Returns how many it took up
 * (at most 64 a call). */
int td__grpc_retry_due(td__transport *t, uint64_t now);
/* Accepts a stream a peer opened to our server (poller thread). */
void td__grpc_stream_accept(td__transport *t, grpc_call *call);
/* A stream's tag came back (poller thread). */
void td__grpc_stream_event(tag *tg, bool success);
/* Marks c closed and drops queued data. Caller holds c->mu. */
void td__grpc_conn_mark_closed(td__conn *c);
/* Callbacks of the transport's lanes (td__lanes_opts). */
void td__grpc_lane_failed(void *conn, const char *why);
void td__grpc_lane_release(void *conn);
void td__grpc_lane_offload(void *conn, td__lane *l);
td_status td__grpc_lane_dialed(void *transport, td__lane *l, int peer, td__decoder **dec,
                               void **ud);
void td__grpc_lane_ended(void *conn, const char *why);
/* td__grpc_dial opens a dialled lane to peer_rank for a new client conn (*out), or fails when
 * none can be (then a gRPC stream is used). */
td_status td__grpc_dial(td__transport *t, int peer_rank, td__conn **out);

/* ---- grpc_unary.c ---- */
/* td__grpc_unary_answer_all fails every deferred unary call (shutdown). */
void td__grpc_unary_answer_all(td__transport *t);
void td__grpc_unary_accept(td__transport *t, grpc_call *call, const char *method);
void td__grpc_unary_event(tag *tg, bool success);

#endif
