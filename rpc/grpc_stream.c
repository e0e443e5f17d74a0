/* grpc_stream.c - streams between workers (td__conn over a bidi /tdist.Rpc/Stream call): the
 * send queue, receiving into the conn's decoder, direct-copy acks, closing, and the stream's
 * events on the poller thread. See grpc_impl.h for the design.
 *
 * Lock order: t->mu, then c->mu. No lock is held while calling the agent's callbacks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_impl.h"
#include "tdist/rpc.h"

td__conn *td__conn_ref(td__conn *c) {
  if (c) td__ref_inc(&c->rc);
  return c;
}

void td__conn_unref(td__conn *c) {
  if (!c || !td__ref_dec(&c->rc)) return;
  if (c->lane) {
    td__lane_close(c->lane);
    td__lane_unref(c->lane);
  }
  td__direct_acks_clear(&c->acks);
  for (size_t i = 0; i < c->qlen; i++) grpc_slice_unref(c->q[(c->qhead + i) % c->qcap]);
  td__free(c->q);
  if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
  if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
  grpc_slice_unref(c->rd_slice);
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
bool td__conn_is_client(const td__conn *c) { return c->client; }
/* A dialled lane's conn is over as soon as its lane is closed (its end is reported a little
 * later, when the lane thread drops it). */
static bool lane_gone(const td__conn *c) { return c->direct && !(c->lane && td__lane_tx_on(c->lane)); }

/* (closed only turns true, stored atomically under c->mu: a call's check needs no lock) */
bool td__conn_closed(const td__conn *c) {
  return __atomic_load_n(&c->closed, __ATOMIC_ACQUIRE) || lane_gone(c);
}

uint64_t td__conn_frames_sent(const td__conn *c) {
  td__conn *m = (td__conn *)c;
  pthread_mutex_lock(&m->mu);
  uint64_t v = m->nsent;
  pthread_mutex_unlock(&m->mu);
  return v;
}

uint64_t td__conn_reverse_sent(const td__conn *c) {
  td__conn *m = (td__conn *)c;
  pthread_mutex_lock(&m->mu);
  uint64_t v = m->nrev;
  pthread_mutex_unlock(&m->mu);
  return v;
}

/* The traffic counters of the conn's peer (NULL before its rank is known). */
static td_rpc_traffic *traffic_of(td__conn *c) {
  int peer = td__conn_peer(c);
  return peer >= 0 && peer < c->t->opts.world ? &c->t->traffic[peer] : NULL;
}

static void count(uint64_t *field, uint64_t n) { __atomic_add_fetch(field, n, __ATOMIC_RELAXED); }

static void on_dec_msg(void *ud, td__msg *m) {
  td__conn *c = ud;
  td_rpc_traffic *tr = traffic_of(c);
  if (tr) {
    uint64_t bytes;
    bool direct;
    td__decoder_last_frame(c->dec, &bytes, &direct);
    count(direct ? &tr->direct_frames_received : &tr->frames_received, 1);
    count(direct ? &tr->direct_bytes_received : &tr->bytes_received, bytes);
  }
  c->t->cbs.on_msg(c->t->cbs.ud, c, m);
}

/* A frame that came through the lane (lane thread). */
static void on_lane_msg(void *ud, td__msg *m) {
  td__conn *c = ud;
  td_rpc_traffic *tr = traffic_of(c);
  if (tr) {
    uint64_t bytes;
    bool direct;
    td__decoder_last_frame(c->lane_dec, &bytes, &direct);
    count(direct ? &tr->direct_frames_received : &tr->lane_frames_received, 1);
    count(direct ? &tr->direct_bytes_received : &tr->lane_bytes_received, bytes);
  }
  c->t->cbs.on_msg(c->t->cbs.ud, c, m);
}

static void on_dec_bad(void *ud, uint64_t id, td_status st, const char *why) {
  td__conn *c = ud;
  if (c->t->cbs.on_bad) c->t->cbs.on_bad(c->t->cbs.ud, c, id, st, why);
}

static bool q_push(td__conn *c, grpc_slice s);
static void start_send(td__conn *c);
static void conn_close_locked(td__conn *c, grpc_status_code code, const char *why);
static void lane_control(void *ud, uint64_t type, const uint8_t *body, size_t len);
static void lane_ask(td__conn *c);
static void lane_ask_earned(td__conn *c);
static void unauth_done(td__conn *c);
static void feed_message(td__conn *c);
static void bulk_task(void *arg);
static void recv_finished(td__conn *c, td_status st);

/* A direct-copy frame is honoured only from the authenticated member of this stream, naming its
 * own process as verified (at init, or in a dialled lane's handshake): nobody can make us read
 * a third process's memory. */
static bool direct_allowed(void *ud, int pid) {
  td__conn *c = ud;
  direct_from *d = __atomic_load_n(&c->t->direct_from, __ATOMIC_ACQUIRE);
  int peer = td__conn_peer(c);
  return d && c->auth == AUTH_DONE && peer >= 0 && peer < d->world && pid > 0 &&
         __atomic_load_n(&d->pid_of[peer], __ATOMIC_ACQUIRE) == pid;
}


static void direct_send_ack(void *ud, uint64_t token) {
  td__conn *c = ud;
  uint8_t *a = td__malloc(TD__FRAME_PREFIX);
  if (!a) return; /* the sender keeps the tensors until the stream ends */
  td__direct_ack_frame(a, token);
  pthread_mutex_lock(&c->mu);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    td__free(a);
    return;
  }
  if ((c->lane && td__lane_tx_on(c->lane)) || c->direct) {
    td__lane_msg m = {.head = a, .head_len = TD__FRAME_PREFIX};
    if (td__lane_send(c->lane, &m) == TD_ERR_FORMAT) /* (a closed lane frees it) */
      conn_close_locked(c, GRPC_STATUS_INVALID_ARGUMENT, td_last_error());
    pthread_mutex_unlock(&c->mu);
    return;
  }
  grpc_slice s = td__grpc_owned_slice(a, TD__FRAME_PREFIX, td__grpc_free_head, a);
  if (!q_push(c, s)) grpc_slice_unref(s);
  else if (!c->send_inflight) start_send(c);
  pthread_mutex_unlock(&c->mu);
}

static void direct_acked(void *ud, uint64_t token) {
  td__conn *c = ud;
  td_tensor **ts;
  int n;
  pthread_mutex_lock(&c->mu);
  td__direct_acks_take(&c->acks, token, &ts, &n);
  pthread_mutex_unlock(&c->mu);
  td__direct_release(ts, n);
}

static const td__auth *conn_auth(const td__transport *t) {
  return t->opts.auth ? t->opts.auth : &t->insecure;
}

/* The decoder paused for a large copy: feed_message hands it to the bulk thread. */
static void direct_offload(void *ud) { (void)ud; }

/* Frames in progress from one member count against its bound across all its streams (a member
 * withholding the last byte of large frames on several streams holds at most that). */
static void set_budget(td__conn *c, td__decoder *d, int rank) {
  td__transport *t = c->t;
  if (t->held && t->held_max && rank >= 0 && rank < t->opts.world)
    td__decoder_set_budget(d, &t->held[rank], t->held_max);
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
  c->born_ns = td__now_ns();
  c->progress_ns = c->born_ns;
  c->rd_slice = grpc_empty_slice();
  grpc_metadata_array_init(&c->initial_md);
  grpc_metadata_array_init(&c->trailing_md);
  td__wire_ctx wctx = {t->opts.agent, peer, t->opts.self_rank};
  if (td__decoder_create(&wctx, t->opts.max_message, on_dec_msg, on_dec_bad, c, &c->dec) !=
      TD_OK) {
    pthread_mutex_destroy(&c->mu);
    td__free(c);
    return NULL;
  }
  static const td__direct_hooks hooks = {direct_allowed, direct_send_ack, direct_acked,
                                         direct_offload, lane_control};
  td__decoder_set_direct(c->dec, &hooks);
  set_budget(c, c->dec, peer);
  return c;
}

/* Starts a batch holding a conn reference. Caller holds c->mu. */
static bool conn_batch(td__conn *c, const grpc_op *ops, size_t n, tag *tg) {
  td__conn_ref(c);
  td__grpc_tags_inc(c->t);
  TSAN_RELEASE(tg);
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tg, NULL);
  if (e != GRPC_CALL_OK) {
    td_log(TD_LOG_ERROR, "rpc transport: start_batch failed (%d)", (int)e);
    td__grpc_tags_dec(c->t);
    td__ref_dec(&c->rc); /* the caller still holds its own reference */
    return false;
  }
  __atomic_add_fetch(&c->batches, 1, __ATOMIC_RELAXED);
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

/* Starts sending the next message: a pending handshake message alone, else (once authenticated)
 * up to CHUNK bytes of queued slices. Caller holds c->mu and knows no send is in flight. */
static void start_send(td__conn *c) {
  if (c->closed) return;
  grpc_slice parts[256];
  size_t np = 0, bytes = 0;
  if (c->hs_out_len) {
    parts[np++] = grpc_slice_from_copied_buffer((const char *)c->hs_out, c->hs_out_len);
    c->hs_out_len = 0;
  } else {
    if (c->auth != AUTH_DONE || c->qlen == 0) return;
    while (c->qlen && np < 256 && bytes < CHUNK) {
      grpc_slice *q = &c->q[c->qhead];
      size_t len = GRPC_SLICE_LENGTH(*q);
      if (bytes + len <= CHUNK) {
        parts[np++] = *q;
        bytes += len;
        c->qhead = (c->qhead + 1) % c->qcap;
        c->qlen--;
      } else {
        size_t take = CHUNK - bytes;
        parts[np++] = grpc_slice_split_head(q, take);
        bytes += take;
      }
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

static void unref_tensor(void *p) {
  TSAN_ACQUIRE(p);
  td_tensor_unref(p);
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

static bool q_push(td__conn *c, grpc_slice s) {
  if (!q_reserve(c, 1)) return false;
  c->q[(c->qhead + c->qlen) % c->qcap] = s;
  c->qlen++;
  return true;
}

/* Sends f through c's lane (c->mu held, the lane switched on): its bytes go straight into the
 * ring when they fit, so the calling thread hands nothing to another. desc: a direct-copy
 * descriptor to send after the head (taken over), or NULL. */
static td_status lane_send(td__conn *c, td__frame *f, uint8_t *desc, size_t desc_len) {
  bool rev = f->reverse;
  td__lane_msg m = {.head = f->head, .head_len = f->head_len, .extra = desc,
                    .extra_len = desc_len};
  f->head = NULL;
  if (!desc) {
    m.tensors = f->tensors;
    m.ntensors = f->ntensors;
    f->tensors = NULL;
    f->ntensors = 0;
  }
  uint64_t bytes = m.head_len + (desc ? 0 : f->payload_len);
  td__frame_clear(f);
  td_status st = td__lane_send(c->lane, &m);
  if (st == TD_ERR_FORMAT) {
    char why[300];
    snprintf(why, sizeof why, "%s", td_last_error());
    td_log(TD_LOG_WARN, "rpc: closing the stream %s rank %d: %s", c->client ? "to" : "from",
           td__conn_peer(c), why);
    conn_close_locked(c, GRPC_STATUS_INVALID_ARGUMENT, why);
    return td_set_error(TD_ERR_UNAVAILABLE, "connection to rank %d is closed: %s",
                        td__conn_peer(c), why);
  }
  if (st != TD_OK) return st;
  td_rpc_traffic *tr = traffic_of(c);
  if (tr && !desc) {
    count(&tr->lane_frames_sent, 1);
    count(&tr->lane_bytes_sent, bytes);
  }
  c->nsent++;
  c->nrev += rev;
  return TD_OK;
}

td_status td__conn_send(td__conn *c, td__frame *f) {
  td_status st = TD_OK;
  bool rev = f->reverse;
  pthread_mutex_lock(&c->mu);
  bool lane = c->lane && td__lane_tx_on(c->lane);
  /* (a dialled lane's conn has no other path: once its lane is closed, so is the conn) */
  if (c->closed || (c->direct && !lane)) {
    pthread_mutex_unlock(&c->mu);
    td__frame_clear(f);
    return td_set_error(TD_ERR_UNAVAILABLE, "connection to rank %d is closed", td__conn_peer(c));
  }
  /* same host: the peer copies the tensors out of our memory; they stay alive until its ack */
  direct_to *dc = __atomic_load_n(&c->t->direct_to, __ATOMIC_ACQUIRE);
  int peer = td__conn_peer(c);
  if (dc && peer >= 0 && peer < dc->world && __atomic_load_n(&dc->to[peer], __ATOMIC_ACQUIRE) &&
      f->ntensors > 0 &&
      f->payload_len >= (lane ? c->t->opts.lane_direct_min : TD__DIRECT_MIN_BYTES)) {
    uint8_t *desc = NULL;
    size_t dl = 0;
    uint64_t token = td__direct_acks_peek(&c->acks);
    /* everything that can fail comes before the first push: a half-queued frame would corrupt
     * the stream */
    bool ok = td__direct_acks_reserve(&c->acks) && (lane || q_reserve(c, 2)) &&
              td__direct_encode(f, token, c->t->self_pid, &desc, &dl) == TD_OK;
    if (ok) {
      td_rpc_traffic *tr = traffic_of(c);
      if (tr) {
        count(&tr->direct_frames_sent, 1);
        count(&tr->direct_bytes_sent, f->payload_len);
      }
      td__direct_acks_add(&c->acks, f->tensors, f->ntensors);
      f->tensors = NULL;
      f->ntensors = 0;
      if (lane) {
        f->reverse = rev;
        st = lane_send(c, f, desc, dl);
      } else {
        q_push(c, td__grpc_owned_slice(f->head, f->head_len, td__grpc_free_head, f->head));
        f->head = NULL;
        q_push(c, td__grpc_owned_slice(desc, dl, td__grpc_free_head, desc));
        c->nsent++;
        c->nrev += rev;
        lane_ask_earned(c);
        if (!c->send_inflight) start_send(c);
      }
    } else {
      st = td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory queueing a frame");
    }
    td__frame_clear(f);
    pthread_mutex_unlock(&c->mu);
    return st;
  }
  if (lane) {
    st = lane_send(c, f, NULL, 0);
    pthread_mutex_unlock(&c->mu);
    return st;
  }
  /* room for the whole frame first: a frame queued in part would corrupt the stream */
  if (!q_reserve(c, 1 + (size_t)f->ntensors)) {
    td__frame_clear(f);
    pthread_mutex_unlock(&c->mu);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory queueing a frame");
  }
  td_rpc_traffic *tr = traffic_of(c);
  if (tr) {
    count(&tr->frames_sent, 1);
    count(&tr->bytes_sent, f->head_len + f->payload_len);
  }
  /* the slices take over the head buffer and the tensor references */
  q_push(c, td__grpc_owned_slice(f->head, f->head_len, td__grpc_free_head, f->head));
  f->head = NULL;
  for (int i = 0; i < f->ntensors; i++) {
    td_tensor *tt = f->tensors[i];
    f->tensors[i] = NULL;
    size_t nb = td_tensor_nbytes(tt);
    if (nb == 0) {
      td_tensor_unref(tt);
      continue;
    }
    q_push(c, td__grpc_owned_slice(td_tensor_data(tt), nb, unref_tensor, tt));
  }
  td__frame_clear(f);
  c->nsent++;
  c->nrev += rev;
  lane_ask_earned(c);
  if (!c->send_inflight) start_send(c);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Marks c closed and drops queued data. Caller holds c->mu. */
void td__grpc_conn_mark_closed(td__conn *c) {
  __atomic_store_n(&c->closed, true, __ATOMIC_RELEASE); /* (td__conn_closed reads it unlocked) */
  if (c->lane) td__lane_close(c->lane);
  for (size_t i = 0; i < c->qlen; i++) grpc_slice_unref(c->q[(c->qhead + i) % c->qcap]);
  c->qlen = 0;
  c->qhead = 0;
}

static void conn_close_locked(td__conn *c, grpc_status_code code, const char *why) {
  if (c->closed) return;
  if (c->direct) {
    /* no call to end: the lane's end (its socket) tells the peer; the lane thread drops it and
     * td__grpc_lane_ended reports it */
    td__lane_close_why(c->lane, why ? why : "closed");
    td__grpc_conn_mark_closed(c);
    return;
  }
  td__grpc_conn_mark_closed(c);
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

/* The live list is doubly linked: a conn leaves in O(1) (a worker of a large group holds a conn
 * per peer, and all of them leave at its shutdown). */
static void live_add(td__transport *t, td__conn *c) {
  pthread_mutex_lock(&t->mu);
  c->next_live = t->live;
  c->prev_live = NULL;
  if (t->live) t->live->prev_live = c;
  t->live = td__conn_ref(c);
  c->in_live = true;
  pthread_mutex_unlock(&t->mu);
}

/* Notes c (a server conn whose peer is authenticated) as the one td__transport_reverse_conn
 * returns first for its rank. */
static void rev_note(td__transport *t, td__conn *c) {
  int peer = td__conn_peer(c);
  if (peer < 0) return;
  pthread_mutex_lock(&t->mu);
  if (peer >= t->rev_n) {
    int n = peer + 1 > 2 * t->rev_n ? peer + 1 : 2 * t->rev_n;
    td__conn **ni = td__realloc(t->rev_idx, (size_t)n * sizeof *ni);
    if (ni) t->rev_idx = ni;
    int *nc = ni ? td__realloc(t->rev_cnt, (size_t)n * sizeof *nc) : NULL;
    if (nc) t->rev_cnt = nc;
    if (ni && nc) {
      memset(ni + t->rev_n, 0, (size_t)(n - t->rev_n) * sizeof *ni);
      memset(nc + t->rev_n, 0, (size_t)(n - t->rev_n) * sizeof *nc);
      t->rev_n = n;
    }
  }
  if (peer < t->rev_n && c->in_live) {
    t->rev_idx[peer] = c;
    if (!c->rev_noted) t->rev_cnt[peer]++;
    c->rev_noted = true;
  }
  pthread_mutex_unlock(&t->mu);
}

static void live_remove(td__transport *t, td__conn *c) {
  pthread_mutex_lock(&t->mu);
  if (!c->in_live) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  int peer = td__conn_peer(c);
  bool was_rev = peer >= 0 && peer < t->rev_n && t->rev_idx[peer] == c;
  if (was_rev) t->rev_idx[peer] = NULL;
  if (c->rev_noted && peer >= 0 && peer < t->rev_n) t->rev_cnt[peer]--;
  c->rev_noted = false;
  /* (only when another of the peer's streams is live: a scan per removed conn made shutting down
   * a 1,024-worker group's conns cost N^2 again) */
  was_rev = was_rev && t->rev_cnt[peer] > 0;
  if (c->prev_live) c->prev_live->next_live = c->next_live;
  else t->live = c->next_live;
  if (c->next_live) c->next_live->prev_live = c->prev_live;
  c->next_live = c->prev_live = NULL;
  c->in_live = false;
  /* another stream the peer opened (a retry, a reconnect) takes its place in the index, so that
   * reverse_conn needs the index alone: its scan of every live stream, for each peer a worker
   * first called, cost a 1,024-worker all-to-all a million lock pairs per worker */
  for (td__conn *o = t->live; was_rev && o; o = o->next_live) {
    if (o->client || o->peer != peer) continue;
    pthread_mutex_lock(&o->mu);
    bool ok = o->auth == AUTH_DONE && !o->closed && !lane_gone(o);
    pthread_mutex_unlock(&o->mu);
    if (ok) {
      t->rev_idx[peer] = o;
      break;
    }
  }
  pthread_mutex_unlock(&t->mu);
  td__conn_unref(c);
}

/* Opens c's call on its channel and sends the HELLO with its ticket in the same batch as the
 * stream's metadata (one write: the server finds the HELLO with the new stream). Client; caller
 * holds c->mu. */
static bool client_open(td__conn *c) {
  td__transport *t = c->t;
  c->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, t->cq,
                                     grpc_slice_from_static_string(STREAM_METHOD), NULL,
                                     gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
  if (!c->call) return false;
  uint8_t hello[TD__HS_HELLO_LEN], msg[TD__HS_TICKET_LEN];
  if (td__hs_client_hello(&c->hs, conn_auth(t), t->opts.self_rank, c->peer, hello) != TD_OK ||
      td__hs_client_ticket(&c->hs, hello, msg) != TD_OK)
    return false;
  c->auth = AUTH_CLIENT_HELLO_SENT;
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)msg, sizeof msg);
  c->send_bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = c->send_bb;
  c->send_inflight = true;
  if (!conn_batch(c, ops, 2, &c->t_send)) {
    c->send_inflight = false;
    grpc_byte_buffer_destroy(c->send_bb);
    c->send_bb = NULL;
    return false;
  }
  grpc_op st;
  memset(&st, 0, sizeof st);
  st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  st.data.recv_status_on_client.trailing_metadata = &c->trailing_md;
  st.data.recv_status_on_client.status = &c->status;
  st.data.recv_status_on_client.status_details = &c->status_details;
  st.data.recv_status_on_client.error_string = &c->error_string;
  return conn_batch(c, &st, 1, &c->t_status) && start_recv(c);
}

td__conn *td__transport_reverse_conn(td__transport *t, int peer_rank) {
  td__conn *found = NULL;
  pthread_mutex_lock(&t->mu);
  td__conn *hint = peer_rank >= 0 && peer_rank < t->rev_n ? t->rev_idx[peer_rank] : NULL;
  if (hint && !t->shutting_down) {
    pthread_mutex_lock(&hint->mu);
    if (hint->auth == AUTH_DONE && !hint->closed && !lane_gone(hint) && hint->peer == peer_rank)
      found = td__conn_ref(hint);
    pthread_mutex_unlock(&hint->mu);
  }
  pthread_mutex_unlock(&t->mu);
  return found;
}

static void *conn_grab(void *c) { return td__conn_ref(c); }

td_status td__transport_connect(td__transport *t, int peer_rank, const char *address,
                                td__conn **out) {
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  if (down) return td_set_error(TD_ERR_STATE, "rpc transport is shutting down");
  /* a member on this host: a mailbox lane (no set-up with the peer at all), else a dialled lane;
   * no gRPC channel, call or HTTP/2 under either. The mailbox lane's conn is the one conn of the
   * pair, whichever side made it (through dialed). */
  void *mc = NULL;
  if (t->lanes && td__lanes_can_mbox(t->lanes, peer_rank) &&
      td__lanes_mbox(t->lanes, peer_rank, conn_grab, &mc) == TD_OK && mc) {
    *out = mc;
    return TD_OK;
  }
  if (t->lanes && td__lanes_can_dial(t->lanes, peer_rank)) {
    if (td__grpc_dial(t, peer_rank, out) == TD_OK) return TD_OK;
    td_log(TD_LOG_DEBUG, "rpc: a gRPC stream to rank %d instead: %s", peer_rank, td_last_error());
  }
  grpc_channel *ch = td__grpc_channel_for(t, address);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "rpc transport: cannot create a channel to %s", address);
  td__conn *c = conn_new(t, true, peer_rank);
  if (!c) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  snprintf(c->peer_addr, sizeof c->peer_addr, "%s", address);
  c->ch = ch;
  c->retry_until_ns = td__now_ns() + (uint64_t)(t->opts.handshake_timeout_ms > 0
                                                    ? t->opts.handshake_timeout_ms
                                                    : 20000) * 1000000ull;
  /* the HELLO goes first; frames queued meanwhile wait for the handshake (set up before the
   * poller can see the conn: live list, batches) */
  live_add(t, c);
  pthread_mutex_lock(&c->mu);
  bool ok = client_open(c);
  bool none = c->call == NULL;
  pthread_mutex_unlock(&c->mu);
  if (none) {
    live_remove(t, c);
    td__conn_unref(c);
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc transport: cannot open a stream to %s", address);
  }
  if (!ok) td__conn_close(c, "cannot start the stream");
  *out = c;
  return TD_OK;
}

/* ---- a refused handshake, tried again (client) ---- */

/* Whether the stream's end is the server refusing or evicting our handshake before it answered
 * (RESOURCE_EXHAUSTED: its slots were full; DEADLINE_EXCEEDED: our HELLO came too late): nothing
 * but the HELLO went out, so the frames queued meanwhile can go on a new stream. */
static bool retryable(td__conn *c) {
  td__transport *t = c->t;
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  pthread_mutex_lock(&c->mu);
  bool r = !down && c->auth == AUTH_CLIENT_HELLO_SENT && !c->closed &&
           (c->status == GRPC_STATUS_RESOURCE_EXHAUSTED ||
            c->status == GRPC_STATUS_DEADLINE_EXCEEDED) &&
           td__now_ns() < c->retry_until_ns;
  pthread_mutex_unlock(&c->mu);
  return r;
}

/* Once every batch of the refused call is back, the retry is scheduled (10 ms doubling). */
static void retry_arm(td__conn *c) {
  pthread_mutex_lock(&c->mu);
  bool arm = c->retrying && __atomic_load_n(&c->batches, __ATOMIC_RELAXED) == 0 &&
             !c->retry_at_ns;
  uint64_t ms = 0;
  if (arm) {
    ms = 10ull << (c->retries < 6 ? c->retries : 6);
    if (ms > TD__RETRY_MAX_MS) ms = TD__RETRY_MAX_MS;
    c->retries++;
    c->retry_at_ns = td__now_ns() + ms * 1000000ull;
  }
  pthread_mutex_unlock(&c->mu);
  if (!arm) return;
  __atomic_add_fetch(&c->t->nretrying, 1, __ATOMIC_RELAXED);
  td_log(TD_LOG_DEBUG, "rpc: the handshake of the stream to rank %d at %s was refused; trying "
         "again in %llu ms", c->peer, c->peer_addr, (unsigned long long)ms);
}

static void notify_closed(td__conn *c, td_status st, const char *why);

/* Opens a new call for c (no batch of the old one is left), or, once the transport is shutting
 * down, reports its end: the poller, or td__transport_shutdown for the retries still waiting.
 * The first caller to find the retry armed takes it; any other returns. */
static void conn_restart(td__conn *c) {
  td__transport *t = c->t;
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  pthread_mutex_lock(&c->mu);
  if (!c->retry_at_ns) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  __atomic_sub_fetch(&t->nretrying, 1, __ATOMIC_RELAXED);
  c->retrying = false;
  c->retry_at_ns = 0;
  bool ok = false, none = true;
  if (!down && !c->closed) {
    grpc_call_unref(c->call);
    c->call = NULL;
    grpc_metadata_array_destroy(&c->initial_md);
    grpc_metadata_array_init(&c->initial_md);
    grpc_metadata_array_destroy(&c->trailing_md);
    grpc_metadata_array_init(&c->trailing_md);
    grpc_slice_unref(c->status_details);
    c->status_details = grpc_empty_slice();
    if (c->error_string) gpr_free((void *)c->error_string);
    c->error_string = NULL;
    if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
    c->recv_bb = NULL;
    if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
    c->send_bb = NULL;
    c->send_inflight = false;
    c->first_recv = true;
    c->status = GRPC_STATUS_OK;
    ok = client_open(c);
    none = c->call == NULL;
    if (!ok && !none) conn_close_locked(c, GRPC_STATUS_UNAVAILABLE, "cannot restart the stream");
  }
  pthread_mutex_unlock(&c->mu);
  if (none) { /* no call whose status would report the end: report it here */
    notify_closed(c, TD_ERR_UNAVAILABLE, down || c->closed ? "the stream was closed while its "
                  "handshake waited to be tried again" : "cannot open a stream");
    live_remove(t, c);
  }
}

int td__grpc_retry_due(td__transport *t, uint64_t now) {
  if (!__atomic_load_n(&t->nretrying, __ATOMIC_RELAXED)) return 0;
  td__conn *due[64];
  int n = 0;
  pthread_mutex_lock(&t->mu);
  for (td__conn *c = t->live; c && n < 64; c = c->next_live) {
    if (!c->client) continue;
    pthread_mutex_lock(&c->mu);
    bool d = c->retry_at_ns && c->retry_at_ns <= now;
    pthread_mutex_unlock(&c->mu);
    if (d) due[n++] = td__conn_ref(c);
  }
  pthread_mutex_unlock(&t->mu);
  for (int i = 0; i < n; i++) {
    conn_restart(due[i]);
    td__conn_unref(due[i]);
  }
  return n;
}

/* ---- the same-host lane (lane.h): set-up through control frames on this stream ---- */

/* Queues a lane control frame on the gRPC stream. Caller holds c->mu. */
static void push_control(td__conn *c, uint64_t type, const uint8_t *body, size_t len) {
  uint8_t *b = td__malloc(TD__FRAME_PREFIX + len);
  if (!b) return; /* the peer's half-made lane waits until the stream ends */
  td__put_u32(b, TD__FRAME_MAGIC_LANE);
  td__put_u32(b + 4, 0);
  td__put_u64(b + 8, len);
  td__put_u64(b + 16, type);
  if (len) memcpy(b + TD__FRAME_PREFIX, body, len);
  grpc_slice s = td__grpc_owned_slice(b, TD__FRAME_PREFIX + len, td__grpc_free_head, b);
  if (!q_push(c, s)) grpc_slice_unref(s);
  else if (!c->send_inflight) start_send(c);
}

/* The decoder of a lane of c: frames counted as lane traffic, direct copies as on the stream
 * (large ones on the bulk thread: td__grpc_lane_offload), no control frames (they travel on the
 * stream only). */
static td__decoder *lane_decoder(td__conn *c) {
  static const td__direct_hooks hooks = {direct_allowed, direct_send_ack, direct_acked,
                                         direct_offload, NULL};
  td__wire_ctx wctx = {c->t->opts.agent, td__conn_peer(c), c->t->opts.self_rank};
  td__decoder *d = NULL;
  if (td__decoder_create(&wctx, c->t->opts.max_message, on_lane_msg, on_dec_bad, c, &d) != TD_OK)
    return NULL;
  td__decoder_set_direct(d, &hooks);
  set_budget(c, d, td__conn_peer(c));
  return d;
}

/* Client, once the handshake proved the server: ask for a lane when the server runs on this host
 * (the server never sends a control frame unasked). Caller holds c->mu. */
static void lane_ask(td__conn *c) {
  /* where this host runs more workers than a process may hold lanes, a stream earns its lane by
   * use (TD__LANE_LAZY_FRAMES frames): the lanes go to the busy pairs, and a group's start-up
   * (one call to every peer) does not set up a lane per pair for nothing */
  if (__atomic_load_n(&c->t->lane_lazy, __ATOMIC_RELAXED) && c->nsent < TD__LANE_LAZY_FRAMES)
    return;
  if (c->t->lanes && !c->lane && !c->closed && td__lanes_knows(c->t->lanes, td__conn_peer(c)))
    push_control(c, TD__LANE_ASK, NULL, 0);
}

/* After a frame went onto the stream: the frame that earns a lazy stream its lane. Caller holds
 * c->mu. */
static void lane_ask_earned(td__conn *c) {
  if (c->nsent == TD__LANE_LAZY_FRAMES && c->client && c->auth == AUTH_DONE &&
      __atomic_load_n(&c->t->lane_lazy, __ATOMIC_RELAXED))
    lane_ask(c);
}

/* Server, asked by the client: offer a lane when the client runs on this host. Caller holds
 * c->mu. */
static void lane_offer(td__conn *c) {
  td__transport *t = c->t;
  if (!t->lanes || c->lane || c->closed) {
    push_control(c, TD__LANE_DECLINE, NULL, 0);
    return;
  }
  td__decoder *d = lane_decoder(c);
  if (!d) {
    push_control(c, TD__LANE_DECLINE, NULL, 0);
    return;
  }
  uint8_t body[TD__LANE_CTRL_MAX];
  size_t len = 0;
  td__lane *l = NULL;
  td__conn_ref(c); /* the lane's */
  if (td__lane_offer(t->lanes, td__conn_peer(c), d, c, body, &len, &l) != TD_OK || !l) {
    td__conn_unref(c);
    push_control(c, TD__LANE_DECLINE, NULL, 0);
    return;
  }
  c->lane = l;
  c->lane_dec = d;
  push_control(c, TD__LANE_OFFER, body, len);
}

static void lane_drop(td__conn *c) {
  td__lane_close(c->lane);
  td__lane_unref(c->lane);
  c->lane = NULL;
  c->lane_dec = NULL;
}

/* A control frame from the peer (poller thread). Messages out of turn are ignored: the stream
 * keeps working either way. */
static void lane_control(void *ud, uint64_t type, const uint8_t *body, size_t len) {
  td__conn *c = ud;
  td__transport *t = c->t;
  pthread_mutex_lock(&c->mu);
  td__lane *l = c->lane;
  bool on = l && td__lane_tx_on(l);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  switch (type) {
    case TD__LANE_ASK:
      if (c->client || l) break;
      lane_offer(c);
      break;
    case TD__LANE_OFFER: {
      if (!c->client || l) break;
      td__decoder *d = t->lanes ? lane_decoder(c) : NULL;
      td__lane *nl = NULL;
      td_status st = TD_ERR_UNAVAILABLE;
      if (d) {
        td__conn_ref(c);
        st = td__lane_join(t->lanes, td__conn_peer(c), body, len, d, c, &nl);
        if (st != TD_OK) td__conn_unref(c);
      }
      if (st == TD_OK) {
        c->lane = nl;
        c->lane_dec = d;
        push_control(c, TD__LANE_ATTACH, NULL, 0);
      } else {
        if (t->lanes)
          td_log(TD_LOG_DEBUG, "rpc: no lane to rank %d: %s", td__conn_peer(c), td_last_error());
        push_control(c, TD__LANE_DECLINE, NULL, 0);
      }
      break;
    }
    case TD__LANE_ATTACH:
      if (c->client || !l || on) break;
      if (td__lane_accept(l) == TD_OK) {
        /* READY is this side's last frame on the stream; what follows goes to the lane */
        push_control(c, TD__LANE_READY, NULL, 0);
        td__lane_start_tx(l);
      } else {
        td_log(TD_LOG_DEBUG, "rpc: no lane from rank %d: %s", td__conn_peer(c), td_last_error());
        lane_drop(c);
        push_control(c, TD__LANE_DECLINE, NULL, 0);
      }
      break;
    case TD__LANE_READY:
      if (!c->client || !l || on) break;
      if (td__lane_ready(l) == TD_OK) {
        /* the peer's frames after READY are in the lane; ours after SWITCH will be */
        push_control(c, TD__LANE_SWITCH, NULL, 0);
        td__lane_start_tx(l);
        td__lane_start_rx(l);
      } else {
        /* the server already sends through the lane: without it the stream is broken */
        char why[300];
        snprintf(why, sizeof why, "%s", td_last_error());
        td_log(TD_LOG_WARN, "rpc: closing the stream to rank %d: %s", td__conn_peer(c), why);
        conn_close_locked(c, GRPC_STATUS_INTERNAL, why);
      }
      break;
    case TD__LANE_SWITCH:
      if (c->client || !l || !on) break;
      td__lane_start_rx(l);
      break;
    case TD__LANE_DECLINE:
      if (l && !on) lane_drop(c);
      break;
    default: break;
  }
  pthread_mutex_unlock(&c->mu);
}

void td__grpc_lane_failed(void *conn, const char *why) { td__conn_close(conn, why); }

/* ---- dialled lanes: conns with no gRPC call (lane.h) ---- */

td_status td__grpc_dial(td__transport *t, int peer_rank, td__conn **out) {
  td__conn *c = conn_new(t, true, peer_rank);
  if (!c) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  c->direct = true;
  c->auth = AUTH_DONE; /* the lane reads nothing the peer did not write after proving itself */
  snprintf(c->peer_addr, sizeof c->peer_addr, "lane");
  td__decoder *d = lane_decoder(c);
  if (!d) {
    td__conn_unref(c);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  }
  td__lane *l = NULL;
  td__conn_ref(c); /* the lane's */
  /* (the lane thread may deliver a frame before td__lane_dial returns: the decoder is known
   * first, and c->lane is set under c->mu, which sends take) */
  c->lane_dec = d;
  /* live before the lane exists: a lane that ends at once takes its conn out again (t->mu
   * comes before c->mu) */
  live_add(t, c);
  pthread_mutex_lock(&c->mu);
  td_status st = td__lane_dial(t->lanes, peer_rank, d, c, &l);
  if (st != TD_OK) {
    c->lane_dec = NULL;
    pthread_mutex_unlock(&c->mu);
    live_remove(t, c);
    td__conn_unref(c);
    td__conn_unref(c);
    return st;
  }
  c->lane = td__lane_ref(l);
  pthread_mutex_unlock(&c->mu);
  td__lane_unref(l);
  *out = c;
  return TD_OK;
}

td_status td__grpc_lane_dialed(void *transport, td__lane *l, int peer, td__decoder **dec,
                               void **ud) {
  td__transport *t = transport;
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  if (down || peer < 0 || peer >= t->opts.world)
    return td_set_error(TD_ERR_STATE, "rpc transport is shutting down");
  /* a mailbox lane has no dialling side: the lower rank's conn is the client (whose requests
   * carry no reverse mark), whichever side made the lane */
  bool client = td__lane_is_mbox(l) && t->opts.self_rank < peer;
  td__conn *c = conn_new(t, client, peer);
  if (!c) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  c->direct = true;
  c->auth = AUTH_DONE;
  snprintf(c->peer_addr, sizeof c->peer_addr, "lane");
  td__decoder *d = lane_decoder(c);
  if (!d) {
    td__conn_unref(c);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  }
  c->lane = td__lane_ref(l);
  c->lane_dec = d;
  live_add(t, c);
  rev_note(t, c);
  *dec = d;
  *ud = c; /* our reference becomes the lane's */
  return TD_OK;
}

/* A dialled lane ended: its conn closes and leaves (once; the lane gives its reference back
 * through release next). */
void td__grpc_lane_ended(void *conn, const char *why) {
  td__conn *c = conn;
  if (!c->direct) return;
  notify_closed(c, TD_ERR_UNAVAILABLE, why);
  live_remove(c->t, c);
}
void td__grpc_lane_release(void *conn) { td__conn_unref(conn); }

typedef struct lane_bulk {
  td__conn *c; /* references */
  td__lane *l;
} lane_bulk;

static void lane_bulk_task(void *arg) {
  lane_bulk *b = arg;
  td__lane_resume(b->l);
  td__lane_unref(b->l);
  td__conn_unref(b->c);
  td__free(b);
}

/* A lane's decoder paused for a large copy: the bulk thread makes it, as for the stream
 * (feed_message), holding the stream whose callbacks deliver the frame. */
void td__grpc_lane_offload(void *conn, td__lane *l) {
  td__conn *c = conn;
  lane_bulk *b = td__malloc(sizeof *b);
  if (b) {
    b->c = td__conn_ref(c);
    b->l = l;
    if (td__threadpool_submit(c->t->bulk, lane_bulk_task, b) == TD_OK) return;
    td__conn_unref(c);
    td__free(b);
  }
  td__lane_resume(l); /* shutting down (or out of memory): copy here */
  td__lane_unref(l);
}

/* ---- events (poller thread) ---- */

static void notify_closed(td__conn *c, td_status st, const char *why) {
  pthread_mutex_lock(&c->mu);
  bool first = !c->notified;
  c->notified = true;
  td__grpc_conn_mark_closed(c);
  pthread_mutex_unlock(&c->mu);
  if (first && c->t->cbs.on_closed) c->t->cbs.on_closed(c->t->cbs.ud, c, st, why);
}

static void handle_conn_status(td__conn *c) {
  char why[512];
  if (c->client && retryable(c)) {
    pthread_mutex_lock(&c->mu);
    c->retrying = true; /* retry_arm schedules it once every batch is back */
    pthread_mutex_unlock(&c->mu);
    return;
  }
  unauth_done(c);
  if (!c->client && c->auth != AUTH_DONE) {
    /* a stream that never authenticated (opened and reset, refused, timed out): counted per
     * connection, and gRPC's buffers for it are given back to the system */
    td__grpc_abuse_note(c->t, c->peer_addr);
    td__grpc_trim(c->t);
  }
  if (c->auth == AUTH_FAILED) {
    /* our side refused the handshake: its reason, not gRPC's "cancelled" */
    notify_closed(c, TD_ERR_AUTH, c->finish_msg);
  } else if (c->client) {
    char *details = grpc_slice_to_c_string(c->status_details);
    snprintf(why, sizeof why, "%s%s%s", details, c->error_string ? " / " : "",
             c->error_string ? c->error_string : "");
    gpr_free(details);
    notify_closed(c, c->status == GRPC_STATUS_OK ? TD_ERR_UNAVAILABLE : td__grpc_map_status(c->status), why);
  } else {
    snprintf(why, sizeof why, "the peer closed its stream%s", c->cancelled ? " (cancelled)" : "");
    notify_closed(c, TD_ERR_UNAVAILABLE, why);
  }
  live_remove(c->t, c);
}

/* Leaves the counts of streams in their handshake (once). Poller thread. */
static void unauth_done(td__conn *c) {
  if (!c->unauth_counted && !c->member_counted) return;
  pthread_mutex_lock(&c->t->mu);
  if (c->unauth_counted) c->t->unauth--;
  if (c->member_counted) c->t->unproven--;
  c->unauth_counted = c->member_counted = false;
  pthread_mutex_unlock(&c->t->mu);
}

/* A HELLO with a valid ticket (a member's): refused when its nonce was seen lately (a replay),
 * else the stream moves from the strangers' slots to the members' (TD_ERR_UNAVAILABLE when
 * those are full). Poller thread. */
static td_status member_enter(td__conn *c) {
  td__transport *t = c->t;
  uint64_t tag;
  memcpy(&tag, c->hs.nonce_c, sizeof tag);
  int cap = 2 * t->opts.world + TD__MAX_UNAUTH_STREAMS;
  if (__atomic_load_n(&t->refuse_hellos, __ATOMIC_RELAXED) > 0 &&
      __atomic_sub_fetch(&t->refuse_hellos, 1, __ATOMIC_RELAXED) >= 0)
    return td_set_error(TD_ERR_UNAVAILABLE, "too many members' streams in their handshake "
                        "(refused for a test)");
  pthread_mutex_lock(&t->mu);
  bool seen = false;
  for (int i = 0; i < TD__SEEN_NONCES && !seen; i++) seen = t->seen_nonce[i] == tag;
  bool room = !seen && t->unproven < cap;
  if (room) {
    t->seen_nonce[t->seen_next] = tag;
    t->seen_next = (t->seen_next + 1) % TD__SEEN_NONCES;
    t->unproven++;
    if (c->unauth_counted) t->unauth--;
    c->unauth_counted = false;
    c->member_counted = true;
  }
  pthread_mutex_unlock(&t->mu);
  if (seen) return td_set_error(TD_ERR_AUTH, "auth: a replayed HELLO");
  if (!room)
    return td_set_error(TD_ERR_UNAVAILABLE, "too many members' streams in their handshake");
  return TD_OK;
}

/* Refuses the handshake: the stream closes with code and why. */
static void handshake_failed(td__conn *c, grpc_status_code code, const char *why) {
  pthread_mutex_lock(&c->mu);
  c->auth = AUTH_FAILED;
  conn_close_locked(c, code, why);
  snprintf(c->finish_msg, sizeof c->finish_msg, "%s", why);
  pthread_mutex_unlock(&c->mu);
  unauth_done(c);
  if (!c->client) td__grpc_refused(c->t, c->peer_addr, why);
  else td_log(TD_LOG_WARN, "rpc: stream to rank %d at %s refused: %s", td__conn_peer(c),
              c->peer_addr, why);
}

/* Server: the HELLO arrived. Only one with a valid ticket gets a CHALLENGE (and a members' slot);
 * anything else is refused at once, so a stranger never waits for a PROOF. */
static void server_hello(td__conn *c, const uint8_t *msg, size_t n) {
  td__transport *t = c->t;
  uint8_t chal[TD__HS_CHALLENGE_LEN];
  grpc_status_code code = GRPC_STATUS_UNAUTHENTICATED;
  td_status st = td__hs_server_hello(&c->hs, conn_auth(t), t->opts.self_rank, msg, n, chal);
  if (st == TD_OK && !c->hs.ticketed)
    st = td_set_error(TD_ERR_AUTH, "auth: a HELLO without its ticket (not a member of this "
                      "group's version of tdist)");
  if (st == TD_OK && (st = member_enter(c)) == TD_ERR_UNAVAILABLE)
    code = GRPC_STATUS_RESOURCE_EXHAUSTED;
  if (st != TD_OK) {
    char why[300];
    snprintf(why, sizeof why, "%s", td_last_error());
    handshake_failed(c, code, why);
    return;
  }
  pthread_mutex_lock(&c->mu);
  memcpy(c->hs_out, chal, sizeof chal);
  c->hs_out_len = TD__HS_CHALLENGE_LEN;
  c->auth = AUTH_SERVER_WAIT_PROOF;
  if (!c->send_inflight) start_send(c);
  if (!c->closed) start_recv(c);
  pthread_mutex_unlock(&c->mu);
}

/* One handshake message arrived (auth.h): answer it, or finish, or refuse. */
static void handle_handshake(td__conn *c, grpc_byte_buffer *bb) {
  uint8_t msg[TD__HS_MAX_LEN];
  size_t n = grpc_byte_buffer_length(bb), off = 0;
  if (n > TD__HS_MAX_LEN) {
    char why[160];
    snprintf(why, sizeof why, "auth: %zu bytes arrived before the handshake", n);
    handshake_failed(c, GRPC_STATUS_UNAUTHENTICATED, why);
    return;
  }
  grpc_byte_buffer_reader r;
  if (grpc_byte_buffer_reader_init(&r, bb)) {
    grpc_slice sl;
    while (grpc_byte_buffer_reader_next(&r, &sl)) {
      size_t l = GRPC_SLICE_LENGTH(sl);
      if (off + l <= sizeof msg) memcpy(msg + off, GRPC_SLICE_START_PTR(sl), l);
      off += l;
      grpc_slice_unref(sl);
    }
    grpc_byte_buffer_reader_destroy(&r);
  }
  td_status st = TD_ERR_AUTH;
  int rank = -1;
  if (c->auth == AUTH_SERVER_WAIT_HELLO) {
    server_hello(c, msg, off);
    return;
  }
  pthread_mutex_lock(&c->mu);
  switch (c->auth) {
    case AUTH_CLIENT_HELLO_SENT:
      st = td__hs_client_challenge(&c->hs, msg, off, c->hs_out);
      if (st == TD_OK) {
        c->hs_out_len = TD__HS_PROOF_LEN;
        c->auth = AUTH_DONE; /* the PROOF, then the frames queued meanwhile */
        lane_ask(c);         /* and the request for a lane, when the peer runs on this host */
        if (!c->send_inflight) start_send(c);
      }
      break;
    case AUTH_SERVER_WAIT_PROOF:
      st = td__hs_server_proof(&c->hs, msg, off, &rank);
      if (st == TD_OK) {
        __atomic_store_n(&c->peer, rank, __ATOMIC_RELEASE);
        td__decoder_set_peer(c->dec, rank);
        set_budget(c, c->dec, rank);
        c->auth = AUTH_DONE;
      }
      break;
    default: td_set_error(TD_ERR_AUTH, "auth: unexpected handshake message"); break;
  }
  bool ok = st == TD_OK && !c->closed;
  if (ok) start_recv(c);
  bool done = c->auth == AUTH_DONE;
  pthread_mutex_unlock(&c->mu);
  if (st != TD_OK) {
    char why[300];
    snprintf(why, sizeof why, "%s", td_last_error());
    handshake_failed(c, GRPC_STATUS_UNAUTHENTICATED, why);
  } else if (done) {
    unauth_done(c);
    if (!c->client) rev_note(c->t, c);
  }
}

static void handle_conn_recv(td__conn *c, bool success) {
  grpc_byte_buffer *bb = c->recv_bb;
  c->recv_bb = NULL;
  if (!success || !bb) {
    /* end of the stream: the status tag reports why; a server answers a half-close with OK, or
     * with an error at once when it came in the middle of a frame */
    if (bb) grpc_byte_buffer_destroy(bb);
    pthread_mutex_lock(&c->mu);
    if (!c->client && !c->closed) {
      if (td__decoder_idle(c->dec)) conn_close_locked(c, GRPC_STATUS_OK, "stream ended");
      else conn_close_locked(c, GRPC_STATUS_INVALID_ARGUMENT, "the stream ended inside a frame");
    }
    pthread_mutex_unlock(&c->mu);
    return;
  }
  __atomic_store_n(&c->progress_ns, td__now_ns(), __ATOMIC_RELAXED);
  if (c->auth != AUTH_DONE) {
    handle_handshake(c, bb);
    grpc_byte_buffer_destroy(bb);
    return;
  }
  if (!grpc_byte_buffer_reader_init(&c->rd, bb)) {
    grpc_byte_buffer_destroy(bb);
    td_set_error(TD_ERR_FORMAT, "unreadable message");
    recv_finished(c, TD_ERR_FORMAT);
    return;
  }
  c->rd_bb = bb;
  c->rd_slice = grpc_empty_slice();
  c->rd_off = 0;
  feed_message(c);
}

/* Feeds the message being read (c->rd) to the decoder from where it stopped. When the decoder
 * pauses for a large direct copy, the copy and the rest of the message continue on the bulk
 * thread (bulk_task); otherwise the message is released and the next receive starts. Runs on one
 * thread at a time per conn: the poller, or the bulk thread while the conn is paused (no receive
 * is started meanwhile). */
static void feed_message(td__conn *c) {
  td_status st = TD_OK;
  for (;;) {
    size_t len = GRPC_SLICE_LENGTH(c->rd_slice);
    if (c->rd_off == len) {
      grpc_slice_unref(c->rd_slice);
      c->rd_slice = grpc_empty_slice();
      c->rd_off = 0;
      if (!grpc_byte_buffer_reader_next(&c->rd, &c->rd_slice)) break;
      continue;
    }
    size_t used = 0;
    st = td__decoder_feed_some(c->dec, GRPC_SLICE_START_PTR(c->rd_slice) + c->rd_off,
                               len - c->rd_off, &used);
    c->rd_off += used;
    if (st != TD_OK) break;
    if (td__decoder_paused(c->dec)) {
      td__conn_ref(c);
      /* the bulk thread owns the decoder until it clears this (the sweep stays away) */
      __atomic_store_n(&c->offloaded, true, __ATOMIC_RELEASE);
      if (td__threadpool_submit(c->t->bulk, bulk_task, c) == TD_OK) return;
      __atomic_store_n(&c->offloaded, false, __ATOMIC_RELEASE);
      td__conn_unref(c);
      td__decoder_resume(c->dec); /* shutting down: copy here */
    }
  }
  grpc_slice_unref(c->rd_slice);
  c->rd_slice = grpc_empty_slice();
  grpc_byte_buffer_reader_destroy(&c->rd);
  grpc_byte_buffer_destroy(c->rd_bb);
  c->rd_bb = NULL;
  recv_finished(c, st);
}

/* On the bulk thread: the paused frame's copy, then the rest of its message. */
static void bulk_task(void *arg) {
  td__conn *c = arg;
  td__decoder_resume(c->dec);
  __atomic_store_n(&c->progress_ns, td__now_ns(), __ATOMIC_RELAXED);
  feed_message(c); /* may hand it on again, or finish the message and receive the next */
  td__conn_unref(c);
}

/* The message is consumed: close a corrupt stream, else receive the next message. */
static void recv_finished(td__conn *c, td_status st) {
  /* done with the decoder on this thread (the bulk thread hands it back to the poller here) */
  __atomic_store_n(&c->offloaded, false, __ATOMIC_RELEASE);
  pthread_mutex_lock(&c->mu);
  if (st != TD_OK) {
    char why[300];
    snprintf(why, sizeof why, "tdist stream corrupt: %s", td_last_error());
    td_log(TD_LOG_WARN, "rpc: closing a stream from rank %d: %s", td__conn_peer(c), why);
    conn_close_locked(c, GRPC_STATUS_INVALID_ARGUMENT, why);
  } else if (!c->closed) {
    start_recv(c);
  }
  pthread_mutex_unlock(&c->mu);
}

static void handle_conn_send(td__conn *c, bool success) {
  pthread_mutex_lock(&c->mu);
  if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
  c->send_bb = NULL;
  c->send_inflight = false;
  /* (a client still waiting for the CHALLENGE sent nothing but its HELLO: its queued frames stay
   * for a retry, which the stream's status decides) */
  if (!success && !(c->client && c->auth == AUTH_CLIENT_HELLO_SENT)) td__grpc_conn_mark_closed(c);
  else if (success) start_send(c);
  start_finish(c);
  pthread_mutex_unlock(&c->mu);
}

/* The server stream that has been in its handshake longest (new reference), or NULL. Poller. */
static td__conn *oldest_in_handshake(td__transport *t) {
  td__conn *o = NULL;
  pthread_mutex_lock(&t->mu);
  for (td__conn *c = t->live; c; c = c->next_live)
    if (!c->client && c->unauth_counted && (!o || c->born_ns < o->born_ns)) o = c;
  if (o) td__conn_ref(o);
  pthread_mutex_unlock(&t->mu);
  return o;
}

void td__grpc_stream_accept(td__transport *t, grpc_call *call) {
  char *peer = grpc_call_get_peer(call);
  int cap = t->opts.world * 2 > TD__MAX_UNAUTH_STREAMS ? t->opts.world * 2
                                                        : TD__MAX_UNAUTH_STREAMS;
  pthread_mutex_lock(&t->mu);
  bool full = t->unauth >= cap;
  pthread_mutex_unlock(&t->mu);
  if (full) { /* the oldest handshake gives its slot up */
    td__conn *o = oldest_in_handshake(t);
    if (o) {
      handshake_failed(o, GRPC_STATUS_RESOURCE_EXHAUSTED,
                       "sent no HELLO before newer streams needed its slot");
      td__conn_unref(o);
    }
  }
  pthread_mutex_lock(&t->mu);
  bool room = t->unauth < cap;
  if (room) t->unauth++;
  pthread_mutex_unlock(&t->mu);
  td__conn *c = room ? conn_new(t, false, -1) : NULL;
  if (!c) {
    if (room) {
      pthread_mutex_lock(&t->mu);
      t->unauth--;
      pthread_mutex_unlock(&t->mu);
    }
    td__grpc_refused(t, peer ? peer : "?",
                     room ? "out of memory" : "too many streams in their handshake");
    gpr_free(peer);
    grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED,
                                 "too many unauthenticated streams", NULL);
    grpc_call_unref(call);
    return;
  }
  snprintf(c->peer_addr, sizeof c->peer_addr, "%s", peer ? peer : "?");
  gpr_free(peer);
  c->call = call;
  c->auth = AUTH_SERVER_WAIT_HELLO;
  c->unauth_counted = true;
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

void td__grpc_stream_event(tag *tg, bool success) {
  td__conn *c = tg->obj;
  __atomic_sub_fetch(&c->batches, 1, __ATOMIC_RELAXED);
  switch (tg->kind) {
    case TAG_CONN_RECV: handle_conn_recv(c, success); break;
    case TAG_CONN_SEND: handle_conn_send(c, success); break;
    case TAG_CONN_STATUS: handle_conn_status(c); break;
    default: break; /* TAG_CONN_START, TAG_CONN_FINISH: nothing to do */
  }
  if (c->retrying) retry_arm(c); /* (set and cleared on this thread) */
  td__conn_unref(c);
}

/* ---- deadlines: handshakes and stalled frames ---- */

void td__grpc_sweep(td__transport *t, uint64_t now) {
  uint64_t hs_ns = (uint64_t)(t->opts.handshake_timeout_ms > 0 ? t->opts.handshake_timeout_ms
                                                                : 20000) * 1000000ull;
  uint64_t stall_ns = (uint64_t)(t->opts.stall_timeout_ms > 0 ? t->opts.stall_timeout_ms : 60000) *
                      1000000ull;
  uint64_t hello_ns = (uint64_t)(t->opts.hello_timeout_ms > 0 ? t->opts.hello_timeout_ms : 2000) *
                      1000000ull;
  /* a HELLO is late only when the poller has found its queue empty since the HELLO was due (it
   * is not waiting there behind other events: a starved worker times out nobody for that), or
   * after the whole handshake timeout */
  uint64_t idle = __atomic_load_n(&t->idle_ns, __ATOMIC_RELAXED);
  td__conn *late[64];
  const char *why[64];
  int n = 0;
  pthread_mutex_lock(&t->mu);
  for (td__conn *c = t->live; c && n < 64; c = c->next_live) {
    /* auth and the decoder belong to the poller thread, which runs this, except while a large
     * copy has the decoder on the bulk thread */
    if (__atomic_load_n(&c->offloaded, __ATOMIC_ACQUIRE)) continue;
    uint64_t progress = __atomic_load_n(&c->progress_ns, __ATOMIC_RELAXED);
    /* (clients are not timed: a server that never answers is a hung peer, which keepalive
     * catches) */
    if (!c->client && c->auth == AUTH_SERVER_WAIT_HELLO && now - c->born_ns > hello_ns &&
        (idle > c->born_ns + hello_ns || now - c->born_ns > hs_ns)) {
      why[n] = "auth: no HELLO in time";
      late[n++] = td__conn_ref(c);
    } else if (!c->client && c->auth == AUTH_SERVER_WAIT_PROOF && now - c->born_ns > hs_ns) {
      why[n] = "auth: the handshake did not finish in time";
      late[n++] = td__conn_ref(c);
    } else if (c->auth == AUTH_DONE && !td__decoder_idle(c->dec) &&
               !td__decoder_paused(c->dec) && now - progress > stall_ns) {
      why[n] = "a frame made no progress for the stall timeout: dropped";
      late[n++] = td__conn_ref(c);
    }
  }
  pthread_mutex_unlock(&t->mu);
  for (int i = 0; i < n; i++) {
    td__conn *c = late[i];
    if (c->auth == AUTH_DONE) {
      td_log(TD_LOG_WARN, "rpc: closing the stream %s rank %d (%s): %s",
             c->client ? "to" : "from", td__conn_peer(c), c->peer_addr, why[i]);
      pthread_mutex_lock(&c->mu);
      conn_close_locked(c, GRPC_STATUS_DEADLINE_EXCEEDED, why[i]);
      pthread_mutex_unlock(&c->mu);
    } else {
      handshake_failed(c, GRPC_STATUS_DEADLINE_EXCEEDED, why[i]);
    }
    td__conn_unref(c);
  }
}
