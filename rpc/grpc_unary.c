/* grpc_unary.c - unary calls (/tdist.Store/Op, the rendezvous store): the server side answers
 * through the agent's on_unary on the poller thread; the client side uses a private pluck queue so
 * it can block on any thread. See grpc_impl.h for the design.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc_impl.h"

/* ---- server side ---- */

/* A unary call whose answer comes later (td__transport_unary_defer): held by the transport's
 * list until answered, and by whoever answers it. The first of the answer and the transport's
 * shutdown sends the reply (answered), the other only lets go. */
struct td__unary_token {
  int refs;     /* atomic */
  int answered; /* atomic */
  td__transport *t;
  unary_srv *u;
  struct td__unary_token *prev, *next; /* t->deferred (t->mu) */
};

/* The call on_unary is answering on this thread (td__transport_unary_defer). */
static _Thread_local unary_srv *serving;

static void token_unref(td__unary_token *k) {
  if (__atomic_sub_fetch(&k->refs, 1, __ATOMIC_ACQ_REL) == 0) td__free(k);
}

static void unary_finish(unary_srv *u, grpc_status_code code, const char *msg, uint8_t *reply,
                         size_t reply_len);

static void unary_free(unary_srv *u) {
  if (u->req) grpc_byte_buffer_destroy(u->req);
  if (u->reply) grpc_byte_buffer_destroy(u->reply);
  grpc_slice_unref(u->details);
  if (u->call) grpc_call_unref(u->call);
  td__free(u->method);
  td__free(u);
}

void td__grpc_unary_accept(td__transport *t, grpc_call *call, const char *method) {
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
  td__grpc_tags_inc(t);
  TSAN_RELEASE(&u->t_recv);
  if (grpc_call_start_batch(call, ops, 2, &u->t_recv, NULL) != GRPC_CALL_OK) {
    td__grpc_tags_dec(t);
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
    serving = u;
    td_status st = buf ? (t->cbs.on_unary ? t->cbs.on_unary(t->cbs.ud, u->method, buf, len, &reply,
                                                            &reply_len)
                                          : td_set_error(TD_ERR_NOT_FOUND, "no unary methods"))
                       : td_set_error(TD_ERR_NOMEM, "out of memory");
    serving = NULL;
    td__free(buf);
    if (st == TD_ERR_AUTH) {
      char *peer = grpc_call_get_peer(u->call);
      td__grpc_refused(t, peer ? peer : "?", td_last_error());
      gpr_free(peer);
    }
    if (st != TD_OK) {
      code = st == TD_ERR_NOT_FOUND ? GRPC_STATUS_UNIMPLEMENTED
             : st == TD_ERR_AUTH    ? GRPC_STATUS_UNAUTHENTICATED
                                    : GRPC_STATUS_INVALID_ARGUMENT;
      snprintf(msg, sizeof msg, "%s", td_last_error());
    }
  }
  if (u->token) { /* deferred: answered later */
    td__free(reply);
    return;
  }
  unary_finish(u, code, msg, reply, reply_len);
}

/* Sends the reply (or the failed status) and closes the call; u is freed when that completes. */
static void unary_finish(unary_srv *u, grpc_status_code code, const char *msg, uint8_t *reply,
                         size_t reply_len) {
  td__transport *t = u->tr;
  grpc_op ops[3];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  if (code == GRPC_STATUS_OK) {
    grpc_slice s = reply ? td__grpc_owned_slice(reply, reply_len, td__grpc_free_head, reply)
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
  /* (u is the poller's to free once the batch is started: nothing of it is read after the
   * release, which matters since rank 0 answers parked waits from its own store calls too, on
   * other threads than the poller) */
  grpc_call *call = u->call;
  td__grpc_tags_inc(t);
  TSAN_RELEASE(&u->t_done);
  if (grpc_call_start_batch(call, ops, n, &u->t_done, NULL) != GRPC_CALL_OK) {
    td__grpc_tags_dec(t);
    unary_free(u);
  }
  grpc_slice_unref(details);
}

void *td__transport_unary_defer(void) {
  unary_srv *u = serving;
  if (!u || u->token) return NULL;
  td__transport *t = u->tr;
  td__unary_token *k = td__calloc(1, sizeof *k);
  if (!k) return NULL;
  k->refs = 2; /* the list's, the caller's */
  k->t = t;
  k->u = u;
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down; /* (td__grpc_unary_answer_all runs after it is set) */
  if (!down) {
    k->next = t->deferred;
    if (t->deferred) t->deferred->prev = k;
    t->deferred = k;
    u->token = k;
  }
  pthread_mutex_unlock(&t->mu);
  if (down) {
    td__free(k);
    return NULL;
  }
  return k;
}

/* Takes k off the transport's list (once) and drops the list's reference. */
static void token_unlist(td__unary_token *k) {
  td__transport *t = k->t;
  pthread_mutex_lock(&t->mu);
  bool listed = k->prev || k->next || t->deferred == k;
  if (listed) {
    if (k->prev) k->prev->next = k->next;
    else t->deferred = k->next;
    if (k->next) k->next->prev = k->prev;
    k->prev = k->next = NULL;
  }
  pthread_mutex_unlock(&t->mu);
  if (listed) token_unref(k);
}

void td__transport_unary_answer(void *token, uint8_t *reply, size_t len) {
  td__unary_token *k = token;
  if (!__atomic_exchange_n(&k->answered, 1, __ATOMIC_ACQ_REL)) {
    unary_srv *u = k->u;
    token_unlist(k);
    if (reply) unary_finish(u, GRPC_STATUS_OK, "", reply, len);
    else unary_finish(u, GRPC_STATUS_UNAVAILABLE, "the store could not answer", NULL, 0);
  } else {
    td__free(reply);
  }
  token_unref(k);
}

void td__grpc_unary_answer_all(td__transport *t) {
  for (;;) {
    pthread_mutex_lock(&t->mu);
    td__unary_token *k = t->deferred;
    if (k) __atomic_add_fetch(&k->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_unlock(&t->mu);
    if (!k) return;
    if (!__atomic_exchange_n(&k->answered, 1, __ATOMIC_ACQ_REL)) {
      unary_srv *u = k->u;
      token_unlist(k);
      unary_finish(u, GRPC_STATUS_UNAVAILABLE, "the server is shutting down", NULL, 0);
    } else {
      token_unlist(k);
    }
    token_unref(k);
  }
}

void td__grpc_unary_event(tag *tg, bool success) {
  if (tg->kind == TAG_UNARY_RECV) handle_unary_recv(tg->obj, success);
  else unary_free(tg->obj);
}

/* ---- unary client ---- */

td_status td__transport_unary(td__transport *t, const char *address, const char *method,
                              const uint8_t *req, size_t len, int64_t timeout_ms,
                              bool wait_for_ready, uint8_t **reply, size_t *reply_len) {
  grpc_channel *ch = td__grpc_channel_for(t, address);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "rpc: cannot create a channel to %s", address);
  grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
  gpr_timespec dl = td__grpc_deadline_ms(timeout_ms > 0 ? timeout_ms : 60000);
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
      st = td_set_error(td__grpc_map_status(code), "rpc: %s on %s failed: %s", method, address, d);
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

