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

td__conn *td__conn_ref(td__conn *c) {
  if (c) td__ref_inc(&c->rc);
  return c;
}

void td__conn_unref(td__conn *c) {
  if (!c || !td__ref_dec(&c->rc)) return;
  td__direct_acks_clear(&c->acks);
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
  td__grpc_tags_inc(c->t);
  TSAN_RELEASE(tg);
  grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tg, NULL);
  if (e != GRPC_CALL_OK) {
    td_log(TD_LOG_ERROR, "rpc transport: start_batch failed (%d)", (int)e);
    td__grpc_tags_dec(c->t);
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
      f->payload_len >= TD__DIRECT_MIN_BYTES) {
    uint8_t *desc = NULL;
    size_t dl = 0;
    uint64_t token = td__direct_acks_peek(&c->acks);
    /* everything that can fail comes before the first push: a half-queued frame would corrupt
     * the stream */
    bool ok = td__direct_acks_reserve(&c->acks) && q_reserve(c, 2) &&
              td__direct_encode(f, token, c->t->self_pid, &desc, &dl) == TD_OK;
    if (ok) {
      q_push(c, td__grpc_owned_slice(f->head, f->head_len, td__grpc_free_head, f->head));
      f->head = NULL;
      q_push(c, td__grpc_owned_slice(desc, dl, td__grpc_free_head, desc));
      td__direct_acks_add(&c->acks, f->tensors, f->ntensors);
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
  if (!c->send_inflight) start_send(c);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Marks c closed and drops queued data. Caller holds c->mu. */
void td__grpc_conn_mark_closed(td__conn *c) {
  c->closed = true;
  for (size_t i = 0; i < c->qlen; i++) grpc_slice_unref(c->q[(c->qhead + i) % c->qcap]);
  c->qlen = 0;
  c->qhead = 0;
}

static void conn_close_locked(td__conn *c, grpc_status_code code, const char *why) {
  if (c->closed) return;
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
  grpc_channel *ch = td__grpc_channel_for(t, address);
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
  if (c->client) {
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
  if (!success) td__grpc_conn_mark_closed(c);
  else if (c->qlen) start_send(c);
  start_finish(c);
  pthread_mutex_unlock(&c->mu);
}

void td__grpc_stream_accept(td__transport *t, grpc_call *call) {
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

void td__grpc_stream_event(tag *tg, bool success) {
  td__conn *c = tg->obj;
  switch (tg->kind) {
    case TAG_CONN_RECV: handle_conn_recv(c, success); break;
    case TAG_CONN_SEND: handle_conn_send(c, success); break;
    case TAG_CONN_STATUS: handle_conn_status(c); break;
    default: break; /* TAG_CONN_START, TAG_CONN_FINISH: nothing to do */
  }
  td__conn_unref(c);
}
