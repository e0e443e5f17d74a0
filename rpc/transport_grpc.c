/* transport_grpc.c - the td__transport over gRPC C core (the only file including gRPC headers).
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
#include "transport.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../core/refcount.h"

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

typedef struct unary_srv {
  tag t_recv, t_done;
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
  bool client;
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
  struct td__conn *next_live;
  /* direct-copy frames sent and not yet acknowledged: their tensors stay alive until then */
  uint64_t next_token;
  struct direct_pending *dp;
  int ndp, dpcap;
};

typedef struct direct_pending {
  uint64_t token;
  td_tensor **ts;
  int n;
} direct_pending;

/* Same-host direct copy, each part set once at init (published with release, read with
 * acquire, freed with the transport). */
typedef struct direct_from {
  int n;
  int pids[]; /* processes we may read from (verified at init) */
} direct_from;

typedef struct direct_to {
  int world;
  bool to[]; /* to[rank]: that peer reads our direct-copy frames */
} direct_to;

#define DIRECT_MIN_BYTES (32u << 10) /* smaller payloads go through the stream */

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
  chan_entry *chans;
  int nchans, chancap;
  int64_t busy_poll_ns; /* atomic; 0 = block at once */
  direct_from *direct_from; /* atomic pointers; NULL = none */
  direct_to *direct_to;
  int self_pid;
};

/* ---- helpers ---- */

static gpr_timespec deadline_ms(int64_t ms) {
  if (ms <= 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

static void tags_inc(td__transport *t) { __atomic_add_fetch(&t->live_tags, 1, __ATOMIC_ACQ_REL); }

static void tags_dec(td__transport *t) {
  if (__atomic_sub_fetch(&t->live_tags, 1, __ATOMIC_ACQ_REL) == 0) {
    pthread_mutex_lock(&t->mu);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
  }
}

static grpc_channel_args *make_args(grpc_arg *buf, int *n, const td__transport_opts *o,
                                    bool server) {
  int k = 0;
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = -1}};
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, {.integer = -1}};
  int ka = (int)(o->keepalive_ms > 0 ? o->keepalive_ms : 2000);
  /* how long a ping may stay unanswered: longer than the interval, so a live peer that is merely
   * busy (many processes on few cores, sanitizer builds) is not declared dead */
  int kt = (int)(o->keepalive_timeout_ms > 0 ? o->keepalive_timeout_ms : 20000);
  if (server) {
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, {.integer = 1}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                          {.integer = ka / 2 > 0 ? ka / 2 : 1}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PING_STRIKES, {.integer = 0}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = ka}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = kt}};
  } else {
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = ka}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = kt}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, {.integer = 1}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, {.integer = 0}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, {.integer = 100}};
    /* gRPC reads this one as the least time a connection attempt (TCP + HTTP/2 handshake) may
     * take, not as a backoff: at 100 ms, attempts to a busy peer (64 workers on 2 cores) failed
     * "timed out before receiving SETTINGS frame" and so did the calls. Keep gRPC's 20 s. */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, {.integer = 20000}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, {.integer = 1000}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_RETRIES, {.integer = 0}};
    /* each peer gets its own TCP connection even when addresses repeat across channels */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, {.integer = 1}};
  }
  /* A fixed 16 MiB HTTP/2 stream window instead of BDP probing: with probing the window stayed
   * small and tensor transfers stalled on flow control (1 MiB echoes on loopback went from about
   * 1.5 to 2.3 GB/s, 16-64 MiB ones gained about 10%; small calls did not change). A stream then
   * buffers at most 16 MiB that the poller has not taken yet. */
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_BDP_PROBE, {.integer = 0}};
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                        {.integer = 16 << 20}};
  *n = k;
  static _Thread_local grpc_channel_args args;
  args.num_args = (size_t)k;
  args.args = buf;
  return &args;
}

static grpc_channel *channel_for(td__transport *t, const char *address) {
  pthread_mutex_lock(&t->mu);
  for (int i = 0; i < t->nchans; i++) {
    if (strcmp(t->chans[i].address, address) == 0) {
      grpc_channel *ch = t->chans[i].ch;
      pthread_mutex_unlock(&t->mu);
      return ch;
    }
  }
  if (t->nchans == t->chancap) {
    int nc = t->chancap ? t->chancap * 2 : 8;
    chan_entry *ne = td__realloc(t->chans, (size_t)nc * sizeof *ne);
    if (!ne) {
      pthread_mutex_unlock(&t->mu);
      return NULL;
    }
    t->chans = ne;
    t->chancap = nc;
  }
  grpc_arg argbuf[16];
  int na;
  grpc_channel_args *args = make_args(argbuf, &na, &t->opts, false);
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(address, creds, args);
  grpc_channel_credentials_release(creds);
  char *addr = td__strdup(address);
  if (!ch || !addr) {
    if (ch) grpc_channel_destroy(ch);
    td__free(addr);
    pthread_mutex_unlock(&t->mu);
    return NULL;
  }
  t->chans[t->nchans++] = (chan_entry){addr, ch};
  pthread_mutex_unlock(&t->mu);
  return ch;
}

static td_status map_status(grpc_status_code c) {
  switch (c) {
    case GRPC_STATUS_OK: return TD_OK;
    case GRPC_STATUS_CANCELLED: return TD_ERR_CANCELLED;
    case GRPC_STATUS_DEADLINE_EXCEEDED: return TD_ERR_TIMEOUT;
    case GRPC_STATUS_INVALID_ARGUMENT: return TD_ERR_FORMAT;
    case GRPC_STATUS_NOT_FOUND:
    case GRPC_STATUS_UNIMPLEMENTED: return TD_ERR_NOT_FOUND;
    default: return TD_ERR_UNAVAILABLE;
  }
}

/* ---- conns ---- */

td__conn *td__conn_ref(td__conn *c) {
  if (c) td__ref_inc(&c->rc);
  return c;
}

void td__conn_unref(td__conn *c) {
  if (!c || !td__ref_dec(&c->rc)) return;
  for (int i = 0; i < c->ndp; i++) {
    for (int k = 0; k < c->dp[i].n; k++) td_tensor_unref(c->dp[i].ts[k]);
    td__free(c->dp[i].ts);
  }
  td__free(c->dp);
  for (size_t i = 0; i < c->qlen; i++) grpc_slice_unref(c->q[(c->qhead + i) % c->qcap]);
  td__free(c->q);
  if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
  if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
  td__decoder_destroy(c->dec);
  grpc_metadata_array_destroy(&c->initial_md);
  grpc_metadata_array_destroy(&c->trailing_md);
  grpc_slice_unref(c->status_details);
  if (c->error_string) gpr_free((void *)c->error_string);
  if (c->call) grpc_call_unref(c->call);
  pthread_mutex_destroy(&c->mu);
  td__free(c);
}

int td__conn_peer(const td__conn *c) { return __atomic_load_n(&c->peer, __ATOMIC_ACQUIRE); }
void td__conn_set_peer(td__conn *c, int rank) { __atomic_store_n(&c->peer, rank, __ATOMIC_RELEASE); }
bool td__conn_is_client(const td__conn *c) { return c->client; }
bool td__conn_closed(const td__conn *c) {
  td__conn *m = (td__conn *)c;
  pthread_mutex_lock(&m->mu);
  bool v = m->closed;
  pthread_mutex_unlock(&m->mu);
  return v;
}

uint64_t td__conn_frames_sent(const td__conn *c) {
  td__conn *m = (td__conn *)c;
  pthread_mutex_lock(&m->mu);
  uint64_t v = m->nsent;
  pthread_mutex_unlock(&m->mu);
  return v;
}

static void on_dec_msg(void *ud, td__msg *m) {
  td__conn *c = ud;
  c->t->cbs.on_msg(c->t->cbs.ud, c, m);
}

static void on_dec_bad(void *ud, uint64_t id, td_status st, const char *why) {
  td__conn *c = ud;
  if (c->t->cbs.on_bad) c->t->cbs.on_bad(c->t->cbs.ud, c, id, st, why);
}

static bool q_push(td__conn *c, grpc_slice s);
static void start_send(td__conn *c);

static bool direct_allowed(void *ud, int pid) {
  td__conn *c = ud;
  direct_from *d = __atomic_load_n(&c->t->direct_from, __ATOMIC_ACQUIRE);
  for (int i = 0; d && i < d->n; i++)
    if (d->pids[i] == pid) return true;
  return false;
}

static void free_head(void *p);
static grpc_slice owned_slice(void *data, size_t len, void (*destroy)(void *), void *p);

static void direct_send_ack(void *ud, uint64_t token) {
  td__conn *c = ud;
  uint8_t *a = td__malloc(TD__FRAME_PREFIX);
  if (!a) return; /* the sender keeps the tensors until the stream ends */
  td__ack_frame(a, token);
  pthread_mutex_lock(&c->mu);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    td__free(a);
    return;
  }
  grpc_slice s = owned_slice(a, TD__FRAME_PREFIX, free_head, a);
  if (!q_push(c, s)) grpc_slice_unref(s);
  else if (!c->send_inflight) start_send(c);
  pthread_mutex_unlock(&c->mu);
}

static void direct_acked(void *ud, uint64_t token) {
  td__conn *c = ud;
  direct_pending got = {0};
  pthread_mutex_lock(&c->mu);
  for (int i = 0; i < c->ndp; i++) {
    if (c->dp[i].token == token) {
      got = c->dp[i];
      c->dp[i] = c->dp[--c->ndp];
      break;
    }
  }
  pthread_mutex_unlock(&c->mu);
  for (int k = 0; k < got.n; k++) td_tensor_unref(got.ts[k]);
  td__free(got.ts);
}

static td__conn *conn_new(td__transport *t, bool client, int peer) {
  td__conn *c = td__calloc(1, sizeof *c);
  if (!c) return NULL;
  td__ref_init(&c->rc);
  c->t = t;
  c->client = client;
  c->peer = peer;
  pthread_mutex_init(&c->mu, NULL);
  c->t_start = (tag){TAG_CONN_START, c};
  c->t_recv = (tag){TAG_CONN_RECV, c};
  c->t_send = (tag){TAG_CONN_SEND, c};
  c->t_status = (tag){TAG_CONN_STATUS, c};
  c->t_finish = (tag){TAG_CONN_FINISH, c};
  c->status_details = grpc_empty_slice();
  c->first_recv = true;
  grpc_metadata_array_init(&c->initial_md);
  grpc_metadata_array_init(&c->trailing_md);
  td__wire_ctx wctx = {t->opts.agent, peer, t->opts.self_rank};
  if (td__decoder_create(&wctx, t->opts.max_message, on_dec_msg, on_dec_bad, c, &c->dec) !=
      TD_OK) {
    pthread_mutex_destroy(&c->mu);
    td__free(c);
    return NULL;
  }
  static const td__direct_hooks hooks = {direct_allowed, direct_send_ack, direct_acked};
  td__decoder_set_direct(c->dec, &hooks);
  return c;
}

/* Starts a batch holding a conn reference. Caller holds c->mu. */
static bool conn_batch(td__conn *c, const grpc_op *ops, size_t n, tag *tg) {
  td__conn_ref(c);
  tags_inc(c->t);
  TSAN_RELEASE(tg);
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tg, NULL);
  if (e != GRPC_CALL_OK) {
    td_log(TD_LOG_ERROR, "rpc transport: start_batch failed (%d)", (int)e);
    tags_dec(c->t);
    td__ref_dec(&c->rc); /* the caller still holds its own reference */
    return false;
  }
  return true;
}

static bool start_recv(td__conn *c) {
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (c->client && c->first_recv) {
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n].data.recv_initial_metadata.recv_initial_metadata = &c->initial_md;
    n++;
  }
  c->first_recv = false;
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n].data.recv_message.recv_message = &c->recv_bb;
  n++;
  return conn_batch(c, ops, n, &c->t_recv);
}

/* Server side: sends the final status (after any in-flight message). Caller holds c->mu. */
static void start_finish(td__conn *c) {
  if (c->client || !c->finish_pending || c->send_inflight) return;
  c->finish_pending = false;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  grpc_slice details = grpc_slice_from_copied_string(c->finish_msg);
  op.data.send_status_from_server.status = c->finish_code;
  op.data.send_status_from_server.status_details = &details;
  conn_batch(c, &op, 1, &c->t_finish);
  grpc_slice_unref(details);
}

/* Takes up to CHUNK bytes of queued slices into one message and starts sending it. Caller holds
 * c->mu and knows no send is in flight. */
static void start_send(td__conn *c) {
  if (c->qlen == 0 || c->closed) return;
  grpc_slice parts[256];
  size_t np = 0, bytes = 0;
  while (c->qlen && np < 256 && bytes < CHUNK) {
    grpc_slice *s = &c->q[c->qhead];
    size_t len = GRPC_SLICE_LENGTH(*s);
    if (bytes + len <= CHUNK) {
      parts[np++] = *s;
      bytes += len;
      c->qhead = (c->qhead + 1) % c->qcap;
      c->qlen--;
    } else {
      size_t take = CHUNK - bytes;
      parts[np++] = grpc_slice_split_head(s, take);
      bytes += take;
    }
  }
  c->send_bb = grpc_raw_byte_buffer_create(parts, np);
  for (size_t i = 0; i < np; i++) grpc_slice_unref(parts[i]);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = c->send_bb;
  c->send_inflight = true;
  if (!conn_batch(c, &op, 1, &c->t_send)) {
    c->send_inflight = false;
    grpc_byte_buffer_destroy(c->send_bb);
    c->send_bb = NULL;
  }
}

static void free_head(void *p) {
  TSAN_ACQUIRE(p);
  td__free(p);
}
static void unref_tensor(void *p) {
  TSAN_ACQUIRE(p);
  td_tensor_unref(p);
}

/* A slice over memory that destroy(p) frees, from whichever thread drops the slice last. */
static grpc_slice owned_slice(void *data, size_t len, void (*destroy)(void *), void *p) {
  TSAN_RELEASE(p);
  return grpc_slice_new_with_user_data(data, len, destroy, p);
}

/* Grows the queue so that n more slices fit. Caller holds c->mu. */
static bool q_reserve(td__conn *c, size_t n) {
  if (c->qlen + n <= c->qcap) return true;
  size_t nc = c->qcap ? c->qcap * 2 : 64;
  while (nc < c->qlen + n) nc *= 2;
  grpc_slice *nq = td__malloc(nc * sizeof *nq);
  if (!nq) return false;
  for (size_t i = 0; i < c->qlen; i++) nq[i] = c->q[(c->qhead + i) % c->qcap];
  td__free(c->q);
  c->q = nq;
  c->qhead = 0;
  c->qcap = nc;
  return true;
}

/* Room for one more pending direct-copy frame. Caller holds c->mu. */
static bool dp_reserve(td__conn *c) {
  if (c->ndp < c->dpcap) return true;
  int nc = c->dpcap ? c->dpcap * 2 : 16;
  direct_pending *nd = td__realloc(c->dp, (size_t)nc * sizeof *nd);
  if (!nd) return false;
  c->dp = nd;
  c->dpcap = nc;
  return true;
}

static bool q_push(td__conn *c, grpc_slice s) {
  if (!q_reserve(c, 1)) return false;
  c->q[(c->qhead + c->qlen) % c->qcap] = s;
  c->qlen++;
  return true;
}

td_status td__conn_send(td__conn *c, td__frame *f) {
  td_status st = TD_OK;
  pthread_mutex_lock(&c->mu);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    td__frame_clear(f);
    return td_set_error(TD_ERR_UNAVAILABLE, "connection to rank %d is closed", td__conn_peer(c));
  }
  /* same host: the peer copies the tensors out of our memory; they stay alive until its ack */
  direct_to *dc = __atomic_load_n(&c->t->direct_to, __ATOMIC_ACQUIRE);
  int peer = td__conn_peer(c);
  if (dc && peer >= 0 && peer < dc->world && dc->to[peer] && f->ntensors > 0 &&
      f->payload_len >= DIRECT_MIN_BYTES) {
    uint8_t *desc = NULL;
    size_t dl = 0;
    uint64_t token = c->next_token + 1;
    /* everything that can fail comes before the first push: a half-queued frame would corrupt
     * the stream */
    bool ok = dp_reserve(c) && q_reserve(c, 2) &&
              td__frame_make_direct(f, token, c->t->self_pid, &desc, &dl) == TD_OK;
    if (ok) {
      c->next_token = token;
      q_push(c, owned_slice(f->head, f->head_len, free_head, f->head));
      f->head = NULL;
      q_push(c, owned_slice(desc, dl, free_head, desc));
      c->dp[c->ndp++] = (direct_pending){token, f->tensors, f->ntensors};
      f->tensors = NULL;
      f->ntensors = 0;
      c->nsent++;
      if (!c->send_inflight) start_send(c);
    } else {
      st = td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory queueing a frame");
    }
    td__frame_clear(f);
    pthread_mutex_unlock(&c->mu);
    return st;
  }
  /* room for the whole frame first: a frame queued in part would corrupt the stream */
  if (!q_reserve(c, 1 + (size_t)f->ntensors)) {
    td__frame_clear(f);
    pthread_mutex_unlock(&c->mu);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory queueing a frame");
  }
  /* the slices take over the head buffer and the tensor references */
  q_push(c, owned_slice(f->head, f->head_len, free_head, f->head));
  f->head = NULL;
  for (int i = 0; i < f->ntensors; i++) {
    td_tensor *tt = f->tensors[i];
    f->tensors[i] = NULL;
    size_t nb = td_tensor_nbytes(tt);
    if (nb == 0) {
      td_tensor_unref(tt);
      continue;
    }
    q_push(c, owned_slice(td_tensor_data(tt), nb, unref_tensor, tt));
  }
  td__frame_clear(f);
  c->nsent++;
  if (!c->send_inflight) start_send(c);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Marks c closed and drops queued data. Caller holds c->mu. */
static void conn_mark_closed(td__conn *c) {
  c->closed = true;
  for (size_t i = 0; i < c->qlen; i++) grpc_slice_unref(c->q[(c->qhead + i) % c->qcap]);
  c->qlen = 0;
  c->qhead = 0;
}

static void conn_close_locked(td__conn *c, grpc_status_code code, const char *why) {
  if (c->closed) return;
  conn_mark_closed(c);
  if (c->client) {
    grpc_call_cancel(c->call, NULL);
  } else {
    c->finish_pending = true;
    c->finish_code = code;
    snprintf(c->finish_msg, sizeof c->finish_msg, "%s", why ? why : "closed");
    start_finish(c);
  }
}

void td__conn_close(td__conn *c, const char *why) {
  pthread_mutex_lock(&c->mu);
  conn_close_locked(c, GRPC_STATUS_UNAVAILABLE, why);
  pthread_mutex_unlock(&c->mu);
}

static void live_add(td__transport *t, td__conn *c) {
  pthread_mutex_lock(&t->mu);
  c->next_live = t->live;
  t->live = td__conn_ref(c);
  pthread_mutex_unlock(&t->mu);
}

static void live_remove(td__transport *t, td__conn *c) {
  pthread_mutex_lock(&t->mu);
  for (td__conn **p = &t->live; *p; p = &(*p)->next_live) {
    if (*p == c) {
      *p = c->next_live;
      pthread_mutex_unlock(&t->mu);
      td__conn_unref(c);
      return;
    }
  }
  pthread_mutex_unlock(&t->mu);
}

td_status td__transport_connect(td__transport *t, int peer_rank, const char *address,
                                td__conn **out) {
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  if (down) return td_set_error(TD_ERR_STATE, "rpc transport is shutting down");
  grpc_channel *ch = channel_for(t, address);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "rpc transport: cannot create a channel to %s", address);
  td__conn *c = conn_new(t, true, peer_rank);
  if (!c) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  c->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, t->cq,
                                     grpc_slice_from_static_string(STREAM_METHOD), NULL,
                                     gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  if (!c->call) {
    td__conn_unref(c);
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc transport: cannot open a stream to %s", address);
  }
  live_add(t, c);
  pthread_mutex_lock(&c->mu);
  grpc_op ops[1];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  bool ok = conn_batch(c, ops, 1, &c->t_start);
  grpc_op st;
  memset(&st, 0, sizeof st);
  st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  st.data.recv_status_on_client.trailing_metadata = &c->trailing_md;
  st.data.recv_status_on_client.status = &c->status;
  st.data.recv_status_on_client.status_details = &c->status_details;
  st.data.recv_status_on_client.error_string = &c->error_string;
  ok = ok && conn_batch(c, &st, 1, &c->t_status);
  ok = ok && start_recv(c);
  pthread_mutex_unlock(&c->mu);
  if (!ok) {
    td__conn_close(c, "cannot start the stream");
  }
  *out = c;
  return TD_OK;
}

/* ---- poller: event handlers ---- */

static void notify_closed(td__conn *c, td_status st, const char *why) {
  pthread_mutex_lock(&c->mu);
  bool first = !c->notified;
  c->notified = true;
  conn_mark_closed(c);
  pthread_mutex_unlock(&c->mu);
  if (first && c->t->cbs.on_closed) c->t->cbs.on_closed(c->t->cbs.ud, c, st, why);
}

static void handle_conn_status(td__conn *c) {
  char why[512];
  if (c->client) {
    char *details = grpc_slice_to_c_string(c->status_details);
    snprintf(why, sizeof why, "%s%s%s", details, c->error_string ? " / " : "",
             c->error_string ? c->error_string : "");
    gpr_free(details);
    notify_closed(c, c->status == GRPC_STATUS_OK ? TD_ERR_UNAVAILABLE : map_status(c->status), why);
  } else {
    snprintf(why, sizeof why, "the peer closed its stream%s", c->cancelled ? " (cancelled)" : "");
    notify_closed(c, TD_ERR_UNAVAILABLE, why);
  }
  live_remove(c->t, c);
}

static void handle_conn_recv(td__conn *c, bool success) {
  grpc_byte_buffer *bb = c->recv_bb;
  c->recv_bb = NULL;
  if (!success || !bb) {
    /* end of the stream: the status tag reports why; a server answers a half-close with OK */
    if (bb) grpc_byte_buffer_destroy(bb);
    pthread_mutex_lock(&c->mu);
    if (!c->client && !c->closed) conn_close_locked(c, GRPC_STATUS_OK, "stream ended");
    pthread_mutex_unlock(&c->mu);
    return;
  }
  grpc_byte_buffer_reader r;
  td_status st = TD_OK;
  if (!grpc_byte_buffer_reader_init(&r, bb)) {
    st = td_set_error(TD_ERR_FORMAT, "unreadable message");
  } else {
    grpc_slice s;
    while (st == TD_OK && grpc_byte_buffer_reader_next(&r, &s)) {
      st = td__decoder_feed(c->dec, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s));
      grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
  }
  grpc_byte_buffer_destroy(bb);
  pthread_mutex_lock(&c->mu);
  if (st != TD_OK) {
    char why[300];
    snprintf(why, sizeof why, "tdist stream corrupt: %s", td_last_error());
    td_log(TD_LOG_WARN, "rpc: closing a stream from rank %d: %s", td__conn_peer(c), why);
    conn_close_locked(c, GRPC_STATUS_INVALID_ARGUMENT, why);
  } else if (!c->closed || !c->client) {
    if (!c->closed) start_recv(c);
  }
  pthread_mutex_unlock(&c->mu);
}

static void handle_conn_send(td__conn *c, bool success) {
  pthread_mutex_lock(&c->mu);
  if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
  c->send_bb = NULL;
  c->send_inflight = false;
  if (!success) conn_mark_closed(c);
  else if (c->qlen) start_send(c);
  start_finish(c);
  pthread_mutex_unlock(&c->mu);
}

static void start_server_conn(td__transport *t, grpc_call *call) {
  td__conn *c = conn_new(t, false, -1);
  if (!c) {
    grpc_call_cancel(call, NULL);
    grpc_call_unref(call);
    return;
  }
  c->call = call;
  live_add(t, c);
  pthread_mutex_lock(&c->mu);
  grpc_op md;
  memset(&md, 0, sizeof md);
  md.op = GRPC_OP_SEND_INITIAL_METADATA;
  bool ok = conn_batch(c, &md, 1, &c->t_start);
  grpc_op cl;
  memset(&cl, 0, sizeof cl);
  cl.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  cl.data.recv_close_on_server.cancelled = &c->cancelled;
  ok = ok && conn_batch(c, &cl, 1, &c->t_status);
  ok = ok && start_recv(c);
  pthread_mutex_unlock(&c->mu);
  if (!ok) td__conn_close(c, "cannot start the stream");
  td__conn_unref(c);
}

static void unary_free(unary_srv *u) {
  if (u->req) grpc_byte_buffer_destroy(u->req);
  if (u->reply) grpc_byte_buffer_destroy(u->reply);
  grpc_slice_unref(u->details);
  if (u->call) grpc_call_unref(u->call);
  td__free(u->method);
  td__free(u);
}

static void start_unary_srv(td__transport *t, grpc_call *call, const char *method) {
  unary_srv *u = td__calloc(1, sizeof *u);
  if (!u || !(u->method = td__strdup(method))) {
    td__free(u);
    grpc_call_cancel(call, NULL);
    grpc_call_unref(call);
    return;
  }
  u->tr = t;
  u->call = call;
  u->details = grpc_empty_slice();
  u->t_recv = (tag){TAG_UNARY_RECV, u};
  u->t_done = (tag){TAG_UNARY_DONE, u};
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_RECV_MESSAGE;
  ops[1].data.recv_message.recv_message = &u->req;
  tags_inc(t);
  TSAN_RELEASE(&u->t_recv);
  if (grpc_call_start_batch(call, ops, 2, &u->t_recv, NULL) != GRPC_CALL_OK) {
    tags_dec(t);
    unary_free(u);
  }
}

static void handle_unary_recv(unary_srv *u, bool success) {
  td__transport *t = u->tr;
  grpc_status_code code = GRPC_STATUS_OK;
  char msg[256] = "";
  uint8_t *reply = NULL;
  size_t reply_len = 0;
  if (!success || !u->req) {
    code = GRPC_STATUS_INVALID_ARGUMENT;
    snprintf(msg, sizeof msg, "no request message");
  } else {
    size_t len = grpc_byte_buffer_length(u->req);
    uint8_t *buf = td__malloc(len ? len : 1);
    grpc_byte_buffer_reader r;
    size_t off = 0;
    if (buf && grpc_byte_buffer_reader_init(&r, u->req)) {
      grpc_slice s;
      while (grpc_byte_buffer_reader_next(&r, &s)) {
        size_t n = GRPC_SLICE_LENGTH(s);
        if (off + n <= len) memcpy(buf + off, GRPC_SLICE_START_PTR(s), n);
        off += n;
        grpc_slice_unref(s);
      }
      grpc_byte_buffer_reader_destroy(&r);
    }
    td_status st = buf ? (t->cbs.on_unary ? t->cbs.on_unary(t->cbs.ud, u->method, buf, len, &reply,
                                                            &reply_len)
                                          : td_set_error(TD_ERR_NOT_FOUND, "no unary methods"))
                       : td_set_error(TD_ERR_NOMEM, "out of memory");
    td__free(buf);
    if (st != TD_OK) {
      code = st == TD_ERR_NOT_FOUND ? GRPC_STATUS_UNIMPLEMENTED : GRPC_STATUS_INVALID_ARGUMENT;
      snprintf(msg, sizeof msg, "%s", td_last_error());
    }
  }
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (code == GRPC_STATUS_OK) {
    grpc_slice s = reply ? owned_slice(reply, reply_len, free_head, reply)
                         : grpc_empty_slice();
    u->reply = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = u->reply;
    n++;
  } else {
    td__free(reply);
  }
  grpc_slice details = grpc_slice_from_copied_string(msg);
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = code;
  ops[n].data.send_status_from_server.status_details = &details;
  n++;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n].data.recv_close_on_server.cancelled = &u->cancelled;
  n++;
  tags_inc(t);
  TSAN_RELEASE(&u->t_done);
  if (grpc_call_start_batch(u->call, ops, n, &u->t_done, NULL) != GRPC_CALL_OK) {
    tags_dec(t);
    unary_free(u);
  }
  grpc_slice_unref(details);
}

static void post_slot(td__transport *t, req_slot *s) {
  grpc_call_details_init(&s->details);
  grpc_metadata_array_init(&s->md);
  s->call = NULL;
  tags_inc(t);
  TSAN_RELEASE(&s->t);
  if (grpc_server_request_call(t->server, &s->call, &s->details, &s->md, t->cq, t->cq, &s->t) !=
      GRPC_CALL_OK) {
    tags_dec(t);
    grpc_call_details_destroy(&s->details);
    grpc_metadata_array_destroy(&s->md);
  }
}

static void handle_new_call(td__transport *t, req_slot *s, bool success) {
  if (success && s->call) {
    char *method = grpc_slice_to_c_string(s->details.method);
    if (strcmp(method, STREAM_METHOD) == 0) start_server_conn(t, s->call);
    else start_unary_srv(t, s->call, method);
    gpr_free(method);
  }
  grpc_call_details_destroy(&s->details);
  grpc_metadata_array_destroy(&s->md);
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  if (success && !down) post_slot(t, s);
}

static void dispatch(td__transport *t, tag *tg, bool success) {
  switch (tg->kind) {
    case TAG_NEW_CALL: handle_new_call(t, (req_slot *)tg, success); break;
    case TAG_CONN_START: break;
    case TAG_CONN_RECV: handle_conn_recv(tg->obj, success); break;
    case TAG_CONN_SEND: handle_conn_send(tg->obj, success); break;
    case TAG_CONN_STATUS: handle_conn_status(tg->obj); break;
    case TAG_CONN_FINISH: break;
    case TAG_UNARY_RECV: handle_unary_recv(tg->obj, success); return;
    case TAG_UNARY_DONE: unary_free(tg->obj); return;
    case TAG_SERVER_SHUTDOWN:
      pthread_mutex_lock(&t->mu);
      t->server_down = true;
      pthread_cond_broadcast(&t->cv);
      pthread_mutex_unlock(&t->mu);
      return;
  }
  if (tg->kind >= TAG_CONN_START && tg->kind <= TAG_CONN_FINISH) td__conn_unref(tg->obj);
}

static void *poller_main(void *arg) {
  td__transport *t = arg;
  int tick = t->opts.tick_ms > 0 ? t->opts.tick_ms : 10;
  uint64_t next_tick = td__now_ns() + (uint64_t)tick * 1000000ull;
  uint64_t last_event = 0;
  for (;;) {
    /* Busy polling: for a short window after an event, poll without blocking, so a reply or the
     * next request that follows closely is picked up by a running thread instead of waking a
     * sleeping one (on virtual machines an idle vCPU's wake-up costs tens of microseconds). */
    uint64_t spin = (uint64_t)__atomic_load_n(&t->busy_poll_ns, __ATOMIC_RELAXED);
    grpc_event ev;
    if (spin && td__now_ns() - last_event < spin) {
      ev = grpc_completion_queue_next(t->cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.type == GRPC_QUEUE_TIMEOUT) {
        sched_yield(); /* a runnable thread on this CPU goes first */
        continue;
      }
    } else {
      ev = grpc_completion_queue_next(t->cq, deadline_ms(tick), NULL);
    }
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) {
      TSAN_ACQUIRE(ev.tag);
      last_event = td__now_ns();
      dispatch(t, ev.tag, ev.success != 0);
      tags_dec(t);
    }
    uint64_t now = td__now_ns();
    if (now >= next_tick) {
      next_tick = now + (uint64_t)tick * 1000000ull;
      if (t->cbs.on_tick) t->cbs.on_tick(t->cbs.ud);
    }
  }
  return NULL;
}

/* Publishes p into *slot once (readers hold no lock, so it is never replaced before destroy). */
static td_status publish_once(void **slot, void *p) {
  void *none = NULL;
  if (!__atomic_compare_exchange_n(slot, &none, p, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    td__free(p);
    return td_set_error(TD_ERR_STATE, "rpc transport: direct copy is already configured");
  }
  return TD_OK;
}

td_status td__transport_allow_direct(td__transport *t, const int *pids, int npids) {
  direct_from *d = td__malloc(sizeof *d + (size_t)(npids > 0 ? npids : 1) * sizeof(int));
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  d->n = npids;
  if (npids) memcpy(d->pids, pids, (size_t)npids * sizeof(int));
  return publish_once((void **)&t->direct_from, d);
}

td_status td__transport_direct_to(td__transport *t, const bool *to, int world) {
  direct_to *d = td__malloc(sizeof *d + (size_t)(world > 0 ? world : 1) * sizeof(bool));
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  d->world = world;
  if (world) memcpy(d->to, to, (size_t)world * sizeof(bool));
  return publish_once((void **)&t->direct_to, d);
}

void td__transport_set_busy_poll(td__transport *t, int64_t us) {
  __atomic_store_n(&t->busy_poll_ns, us > 0 ? us * 1000 : 0, __ATOMIC_RELAXED);
}

/* ---- lifecycle ---- */

td_status td__transport_create(const td__transport_opts *o, const td__transport_cbs *cbs,
                               td__transport **out, int *bound_port) {
  td__transport *t = td__calloc(1, sizeof *t);
  if (!t) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  t->opts = *o;
  t->host = td__strdup(o->host ? o->host : "127.0.0.1");
  t->opts.host = t->host;
  t->cbs = *cbs;
  t->self_pid = (int)getpid();
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  grpc_init();
  t->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_arg argbuf[16];
  int na;
  grpc_channel_args *args = make_args(argbuf, &na, o, true);
  t->server = grpc_server_create(args, NULL);
  grpc_server_register_completion_queue(t->server, t->cq, NULL);
  char addr[300];
  bool v6 = strchr(t->host, ':') != NULL;
  snprintf(addr, sizeof addr, v6 ? "[%s]:%d" : "%s:%d", t->host, o->port);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  int port = grpc_server_add_http2_port(t->server, addr, creds);
  grpc_server_credentials_release(creds);
  if (port == 0) {
    grpc_server_destroy(t->server);
    grpc_completion_queue_shutdown(t->cq);
    while (grpc_completion_queue_next(t->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(t->cq);
    grpc_shutdown();
    td__free(t->host);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    td__free(t);
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc: cannot listen on %s (address in use or invalid)",
                        addr);
  }
  grpc_server_start(t->server);
  t->t_server_shutdown = (tag){TAG_SERVER_SHUTDOWN, t};
  for (int i = 0; i < N_REQUEST_SLOTS; i++) {
    t->slots[i].t = (tag){TAG_NEW_CALL, &t->slots[i]};
    post_slot(t, &t->slots[i]);
  }
  if (pthread_create(&t->poller, NULL, poller_main, t) != 0) {
    t->poller_started = false;
    td__transport_shutdown(t);
    td__transport_destroy(t);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: cannot start the poller thread");
  }
  pthread_setname_np(t->poller, "td-poller");
  t->poller_started = true;
  *bound_port = port;
  *out = t;
  return TD_OK;
}

void td__transport_shutdown(td__transport *t) {
  if (!t) return;
  pthread_mutex_lock(&t->mu);
  if (t->shutting_down) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  t->shutting_down = true;
  pthread_mutex_unlock(&t->mu);
  tags_inc(t);
  TSAN_RELEASE(&t->t_server_shutdown);
  grpc_server_shutdown_and_notify(t->server, t->cq, &t->t_server_shutdown);
  grpc_server_cancel_all_calls(t->server);
  /* close every stream we know of */
  pthread_mutex_lock(&t->mu);
  size_t n = 0;
  for (td__conn *c = t->live; c; c = c->next_live) n++;
  td__conn **list = td__calloc(n ? n : 1, sizeof *list);
  size_t k = 0;
  for (td__conn *c = t->live; c && list; c = c->next_live) list[k++] = td__conn_ref(c);
  pthread_mutex_unlock(&t->mu);
  for (size_t i = 0; i < k; i++) {
    pthread_mutex_lock(&list[i]->mu);
    conn_mark_closed(list[i]);
    grpc_call_cancel(list[i]->call, NULL);
    pthread_mutex_unlock(&list[i]->mu);
    td__conn_unref(list[i]);
  }
  td__free(list);
  if (t->poller_started) {
    uint64_t give_up = td__now_ns() + 10ull * 1000000000ull;
    pthread_mutex_lock(&t->mu);
    while (__atomic_load_n(&t->live_tags, __ATOMIC_ACQUIRE) > 0 && td__now_ns() < give_up) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 20 * 1000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&t->cv, &t->mu, &ts);
    }
    pthread_mutex_unlock(&t->mu);
    if (__atomic_load_n(&t->live_tags, __ATOMIC_ACQUIRE) > 0)
      td_log(TD_LOG_WARN, "rpc transport: %lld gRPC operations still pending at shutdown",
             (long long)t->live_tags);
  }
}

void td__transport_destroy(td__transport *t) {
  if (!t) return;
  td__transport_shutdown(t);
  grpc_completion_queue_shutdown(t->cq);
  if (t->poller_started) pthread_join(t->poller, NULL);
  else
    while (grpc_completion_queue_next(t->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
  while (t->live) {
    td__conn *c = t->live;
    t->live = c->next_live;
    td__conn_unref(c);
  }
  grpc_server_destroy(t->server);
  for (int i = 0; i < t->nchans; i++) {
    grpc_channel_destroy(t->chans[i].ch);
    td__free(t->chans[i].address);
  }
  td__free(t->chans);
  grpc_completion_queue_destroy(t->cq);
  grpc_shutdown();
  td__free(t->host);
  td__free(t->direct_from);
  td__free(t->direct_to);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  td__free(t);
}

/* ---- unary client ---- */

td_status td__transport_unary(td__transport *t, const char *address, const char *method,
                              const uint8_t *req, size_t len, int64_t timeout_ms,
                              bool wait_for_ready, uint8_t **reply, size_t *reply_len) {
  grpc_channel *ch = channel_for(t, address);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "rpc: cannot create a channel to %s", address);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  gpr_timespec dl = deadline_ms(timeout_ms > 0 ? timeout_ms : 60000);
  grpc_call *call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                             grpc_slice_from_static_string(method), NULL, dl, NULL);
  td_status st = TD_OK;
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, len);
  grpc_byte_buffer *sbb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_byte_buffer *rbb = NULL;
  grpc_metadata_array imd, tmd;
  grpc_metadata_array_init(&imd);
  grpc_metadata_array_init(&tmd);
  grpc_status_code code = GRPC_STATUS_UNKNOWN;
  grpc_slice details = grpc_empty_slice();
  const char *errstr = NULL;
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[0].flags = wait_for_ready ? GRPC_INITIAL_METADATA_WAIT_FOR_READY : 0;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = sbb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &imd;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &rbb;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &tmd;
  ops[5].data.recv_status_on_client.status = &code;
  ops[5].data.recv_status_on_client.status_details = &details;
  ops[5].data.recv_status_on_client.error_string = &errstr;
  int mytag;
  TSAN_RELEASE(&mytag);
  if (!call || grpc_call_start_batch(call, ops, 6, &mytag, NULL) != GRPC_CALL_OK) {
    st = td_set_error(TD_ERR_INTERNAL, "rpc: cannot start a call to %s", address);
  } else {
    grpc_event ev = grpc_completion_queue_pluck(cq, &mytag, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                NULL);
    (void)ev;
    TSAN_ACQUIRE(&mytag);
    if (code != GRPC_STATUS_OK) {
      char *d = grpc_slice_to_c_string(details);
      st = td_set_error(map_status(code), "rpc: %s on %s failed: %s", method, address, d);
      gpr_free(d);
    } else if (rbb) {
      size_t n = grpc_byte_buffer_length(rbb);
      uint8_t *buf = td__malloc(n ? n : 1);
      grpc_byte_buffer_reader r;
      if (!buf || !grpc_byte_buffer_reader_init(&r, rbb)) {
        td__free(buf);
        st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
      } else {
        size_t off = 0;
        grpc_slice rs;
        while (grpc_byte_buffer_reader_next(&r, &rs)) {
          memcpy(buf + off, GRPC_SLICE_START_PTR(rs), GRPC_SLICE_LENGTH(rs));
          off += GRPC_SLICE_LENGTH(rs);
          grpc_slice_unref(rs);
        }
        grpc_byte_buffer_reader_destroy(&r);
        *reply = buf;
        *reply_len = n;
      }
    } else {
      *reply = NULL;
      *reply_len = 0;
    }
  }
  if (rbb) grpc_byte_buffer_destroy(rbb);
  grpc_byte_buffer_destroy(sbb);
  grpc_metadata_array_destroy(&imd);
  grpc_metadata_array_destroy(&tmd);
  grpc_slice_unref(details);
  if (errstr) gpr_free((void *)errstr);
  if (call) grpc_call_unref(call);
  grpc_completion_queue_shutdown(cq);
  while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(cq);
  return st;
}
