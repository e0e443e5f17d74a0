/* serve.c - incoming requests: where they run, how handlers answer, how replies go back, and the
 * transport's callbacks that feed the agent (frames, bad frames, closed streams, ticks, the
 * store's unary method).
 *
 * A request runs on the agent's pool, or on the network thread when its function was registered
 * TD_RPC_INLINE (short and never blocking: td_rpc_sync from one is refused). A handler returns a
 * value, an error, or a future; for a future the reply is sent from its completion callback, so
 * no pool thread waits for nested calls. Remote errors are prefixed "name (rank r): ". A reply
 * that cannot be encoded becomes an error reply saying why. Replies (and errors for malformed
 * requests) count as served for the graceful shutdown's totals. Requests that arrive while this
 * worker still finishes its init are held until it has (hold_until_started).
 *
 * Lock order: none taken here beyond the transport's (td__conn_send) and a->mu (call.c's, and the
 * held list here, never held across a dispatch).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../core/flight_impl.h"
#include "../core/trace_impl.h"
#include "../core/tcache.h"
#include "agent_state.h"

/* Returns TD_OK when the transport accepted the frame. */
static td_status send_frame_or_log(td_rpc_agent *a, td__conn *c, td__msg *m) {
  int peer = td__conn_peer(c);
  bool known = td__agent_present(a, peer);
  /* results go back along the inverse of the caller's map to us */
  td__wire_ctx wctx = {a, peer, a->rank, known ? &a->peers[peer].reply_map : NULL,
                       known ? a->peers[peer].info.name : NULL};
  td__frame f = {0};
  td_status st = td__wire_encode(m, &wctx, &f);
  if (st != TD_OK && m->kind == TD__MSG_RESPONSE) {
    /* the result cannot be sent: tell the caller why instead */
    char msg[700];
    snprintf(msg, sizeof msg, "%s (rank %d): cannot send the result of '%s': %s", a->name,
             a->rank, m->fn ? m->fn : "?", td_last_error());
    td__msg em = {.id = m->id, .kind = TD__MSG_ERROR, .from_rank = a->rank, .status = st,
                  .message = msg};
    st = td__wire_encode(&em, &wctx, &f);
  }
  f.reverse = td__conn_is_client(c); /* a reply on a stream this worker opened */
  if (st == TD_OK) st = td__conn_send(c, &f);
  if (st != TD_OK)
    td_log(TD_LOG_DEBUG, "rpc: %s: reply to rank %d not sent: %s", a->name, td__conn_peer(c),
           td_last_error());
  return st;
}

/* Sends the outcome of a request and retires it. value: owned reference. */
static void reply(request *r, int kind, td_value *value, td_status st, const char *message) {
  td_rpc_agent *a = r->a;
  bool sent = true;
  if (!r->conn) {
    td__call_deliver(a, NULL, r->msg.id, kind, value, st, message);
  } else {
    td__msg m = {0};
    m.id = r->msg.id;
    m.kind = kind;
    m.from_rank = a->rank;
    m.fn = r->msg.fn;
    td_value *vals[1] = {value};
    char mwmsg[1200];
    if (kind == TD__MSG_RESPONSE) {
      m.values = vals;
      m.nvalues = 1;
      m.ctx_id = r->msg.ctx_id;
      const td__rpc_middleware *mw = td__mw_get();
      td_status ms = mw && m.ctx_id ? mw->on_send(a, td__conn_peer(r->conn), &m) : TD_OK;
      if (ms != TD_OK) {
        snprintf(mwmsg, sizeof mwmsg, "%s (rank %d): cannot send the result of '%s': %s",
                 a->name, a->rank, r->msg.fn ? r->msg.fn : "?", td_last_error());
        td__free(m.aux);
        m = (td__msg){.id = r->msg.id, .kind = TD__MSG_ERROR, .from_rank = a->rank,
                      .status = ms, .message = mwmsg};
      }
    } else {
      m.status = st;
      m.message = (char *)message;
    }
    sent = send_frame_or_log(a, r->conn, &m) == TD_OK;
    td__free(m.aux);
    td_value_unref(value);
  }
  if (sent) __atomic_add_fetch(&a->served_total, 1, __ATOMIC_ACQ_REL);
  __atomic_sub_fetch(&a->active_in, 1, __ATOMIC_ACQ_REL);
  td__conn_unref(r->conn);
  td__msg_clear(&r->msg);
  td__tc_free(r, sizeof *r);
}

/* reply_error answers with an error; failed says whether the handler failed (else the request
 * was refused before any handler ran): the two are counted apart. */
static void reply_error(request *r, bool failed, td_status st, const char *fmt, ...)
    TD_PRINTF(4, 5);
static void reply_error(request *r, bool failed, td_status st, const char *fmt, ...) {
  if (failed) TD__COUNT(r->a, requests_failed);
  else TD__COUNT(r->a, requests_rejected);
  char body[1024], msg[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(body, sizeof body, fmt, ap);
  va_end(ap);
  snprintf(msg, sizeof msg, "%s (rank %d): %s", r->a->name, r->a->rank, body);
  reply(r, TD__MSG_ERROR, NULL, st, msg);
}

static void async_done(td_future *f, void *ctx) {
  request *r = ctx;
  td_status st = td_future_status(f);
  if (st == TD_OK) {
    td_value *v = td_future_value(f);
    reply(r, TD__MSG_RESPONSE, v ? td_value_ref(v) : td_value_none(), TD_OK, NULL);
  } else {
    reply_error(r, true, st, "'%s' failed: %s", r->msg.fn, td_future_message(f));
  }
  td_future_unref(f);
}

/* Trace: the handler's span on this thread, where the caller's flow arrow ends, with how long the
 * request waited for a thread. */
static void trace_handler(const request *r, uint64_t t0) {
  char fn[80], caller[160], args[320], name[100];
  td__trace_escape(r->msg.fn, fn, sizeof fn);
  td__trace_escape(r->caller, caller, sizeof caller);
  snprintf(args, sizeof args, "{\"fn\":\"%s\",\"caller\":\"%s\",\"id\":%llu,\"queued_us\":%.1f}",
           fn, caller, (unsigned long long)r->msg.id,
           r->arrived_ns && t0 > r->arrived_ns ? (double)(t0 - r->arrived_ns) * 1e-3 : 0.0);
  snprintf(name, sizeof name, "%s", r->msg.fn);
  td__trace_flow('f', td__call_trace_id(r->msg.from_rank, r->msg.id), "rpc", t0);
  td__trace_complete("handler", name, t0, td__now_ns(), args);
}

/* ---- handlers running on this worker's threads ---- */

static void running_add(request *r) {
  td_rpc_agent *a = r->a;
  r->started_ns = td__now_ns();
  pthread_mutex_lock(&a->run_mu);
  r->run_prev = NULL;
  r->run_next = a->running;
  if (a->running) a->running->run_prev = r;
  a->running = r;
  pthread_mutex_unlock(&a->run_mu);
}

static void running_remove(request *r) {
  td_rpc_agent *a = r->a;
  pthread_mutex_lock(&a->run_mu);
  if (r->run_prev) r->run_prev->run_next = r->run_next;
  else a->running = r->run_next;
  if (r->run_next) r->run_next->run_prev = r->run_prev;
  pthread_mutex_unlock(&a->run_mu);
}

int td__serve_running(td_rpc_agent *a, char *buf, size_t n) {
  size_t used = 0;
  int count = 0;
  if (n) buf[0] = 0;
  pthread_mutex_lock(&a->run_mu);
  /* (read under the lock: a handler that started after an earlier read printed 18446744073.7 s) */
  uint64_t now = td__now_ns();
  for (const request *r = a->running; r; r = r->run_next, count++) {
    if (used + 1 >= n) continue;
    int k = snprintf(buf + used, n - used, "%s'%s' called by %s (rank %d), running %.1f s",
                     count ? "; " : "", r->msg.fn, r->caller, r->msg.from_rank,
                     (double)(now > r->started_ns ? now - r->started_ns : 0) * 1e-9);
    used = k < 0 ? used : used + (size_t)k >= n ? n - 1 : used + (size_t)k;
  }
  pthread_mutex_unlock(&a->run_mu);
  return count;
}

int64_t td_rpc_ctx_time_left_ms(const td_rpc_ctx *c) {
  if (!c || !c->deadline_ns) return -1;
  uint64_t now = td__now_ns();
  return now >= c->deadline_ns ? 0 : (int64_t)((c->deadline_ns - now) / 1000000u);
}

bool td_rpc_ctx_cancelled(const td_rpc_ctx *c) {
  if (!c) return false;
  if (c->deadline_ns && td__now_ns() >= c->deadline_ns) return true;
  if (c->conn && td__conn_closed(c->conn)) return true;
  return __atomic_load_n(&c->agent->closing, __ATOMIC_ACQUIRE);
}

static bool is_internal(const char *fn) { return fn && fn[0] == '_' && fn[1] == '_'; }

/* A user's request whose caller stopped waiting while it sat in the queue is answered without
 * running (tdist's own "__" requests always run: their effects matter even when late). */
static bool expired_in_queue(request *r) {
  if (!r->deadline_ns || is_internal(r->msg.fn)) return false;
  uint64_t now = td__now_ns();
  if (now < r->deadline_ns) return false;
  TD__COUNT(r->a, requests_expired);
  reply_error(r, false, TD_ERR_TIMEOUT, "'%s' dropped unrun: its caller's timeout (%lld ms) "
              "passed while it waited %.0f ms for a thread", r->msg.fn,
              (long long)r->msg.timeout_ms, (double)(now - r->arrived_ns) * 1e-6);
  return true;
}

static void run_request(void *arg);
static td_status submit_request(td_rpc_agent *a, request *r);

static void gate_passed(td_future *f, void *arg) {
  request *r = arg;
  td_status st = td_future_status(f);
  if (st != TD_OK) {
    reply_error(r, false, st, "'%s' not run: an argument is not usable: %s", r->msg.fn,
                td_future_message(f));
  } else if (submit_request(r->a, r) != TD_OK) {
    reply_error(r, false, TD_ERR_STATE, "the agent is shutting down");
  }
  td_future_unref(f);
}

/* User functions start once their arguments are usable (PyTorch waits for the pending user RRefs
 * of a request before running its function): true when r now waits for that (it comes back
 * through gate_passed). */
static bool wait_for_arguments(request *r) {
  td__arg_gate_fn gate = td__rpc_arg_gate();
  if (r->gated || !gate || is_internal(r->msg.fn)) return false;
  r->gated = true;
  td_future *wait = NULL;
  td_status st = gate(r->a, r->msg.values, r->msg.nvalues, &wait);
  if (st != TD_OK) {
    reply_error(r, false, st, "'%s' not run: %s", r->msg.fn, td_last_error());
    return true;
  }
  if (!wait) return false;
  if (td_future_on_done(wait, gate_passed, r) != TD_OK) {
    td_future_unref(wait);
    reply_error(r, false, TD_ERR_INTERNAL, "'%s': cannot wait for its arguments", r->msg.fn);
  }
  return true;
}

/* Runs r's handler, registered as reg (found by the caller). */
static void run_found(request *r, const td__reg *found) {
  td_rpc_agent *a = r->a;
  td__reg reg = *found;
  if (expired_in_queue(r) || wait_for_arguments(r)) return;
  const td__rpc_middleware *mw = r->msg.ctx_id ? td__mw_get() : NULL;
  td__mw_scope scope = {0};
  if (mw) {
    td_status ms = mw->on_recv(a, r->msg.from_rank, &r->msg);
    if (ms != TD_OK) {
      reply_error(r, false, ms, "'%s': %s", r->msg.fn, td_last_error());
      return;
    }
    mw->enter(a, &r->msg, &scope);
  }
  td_rpc_ctx ctx = {a, r->msg.from_rank, r->caller, reg.user_data, r->msg.fn, r->msg.ctx_id,
                    r->deadline_ns, r->conn};
  td_value *result = NULL;
  td_future *fut = NULL;
  td_clear_error();
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  /* handlers on the pool's (or the host's) threads are listed, to name them when the pool is
   * saturated or shutdown abandons them; an inline one runs on a network thread, briefly */
  bool listed = !td__rpc_inline_thread;
  if (listed) running_add(r);
  else r->started_ns = td__now_ns();
  td__flight_ev fl = {.kind = TD__FL_HANDLER_START, .peer = r->msg.from_rank, .a = r->msg.id,
                      .b = r->msg.ctx_id, .y = r->msg.ctx_id ? TD__FL_SUBJ_CTX : 0};
  td__flight_push(&fl, r->msg.fn);
  td_status st = reg.fn(&ctx, r->msg.values, r->msg.nvalues, &result, &fut);
  fl.kind = TD__FL_HANDLER_END;
  fl.x = (uint8_t)st;
  fl.y = st == TD_OK && fut; /* the reply waits on the returned future */
  td__flight_subj subj = td__flight_open_subject(); /* as the handler annotated it */
  fl.b = subj.id;
  fl.c = subj.kind;
  td__flight_pop(&fl, r->msg.fn);
  if (listed) running_remove(r);
  __atomic_add_fetch(&a->cnt.handler_ns, td__now_ns() - r->started_ns, __ATOMIC_RELAXED);
  if (t0) trace_handler(r, t0);
  if (mw) mw->leave(&scope);
  if (st != TD_OK) {
    td_value_unref(result);
    td_future_unref(fut);
    const char *why = td_last_error();
    reply_error(r, true, st, "'%s' failed: %s", r->msg.fn, *why ? why : td_status_str(st));
    return;
  }
  if (fut) {
    td_value_unref(result);
    if (td_future_on_done(fut, async_done, r) != TD_OK) {
      td_future_unref(fut);
      reply_error(r, true, TD_ERR_INTERNAL, "'%s': cannot wait for its future", r->msg.fn);
    }
    return;
  }
  reply(r, TD__MSG_RESPONSE, result ? result : td_value_none(), TD_OK, NULL);
}

static void run_request(void *arg) {
  request *r = arg;
  td__reg reg;
  if (!td__reg_find(r->msg.fn, &reg)) {
    reply_error(r, false, TD_ERR_NOT_FOUND, "no function '%s' is registered here (called by %s (rank %d))",
                r->msg.fn, r->caller, r->msg.from_rank);
    return;
  }
  run_found(r, &reg);
}


/* A request's arrival: its deadline is the caller's timeout from now (the caller's clock is not
 * ours; time on the wire only makes the handler's view a little generous). */
static void arrived(request *r) {
  r->arrived_ns = td__now_ns();
  td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_RECV, .peer = r->msg.from_rank,
                                     .a = r->msg.id, .b = r->msg.ctx_id,
                                     .y = r->msg.ctx_id ? TD__FL_SUBJ_CTX : 0}, r->msg.fn);
  if (r->msg.timeout_ms > 0)
    r->deadline_ns = r->arrived_ns + (uint64_t)r->msg.timeout_ms * 1000000u;
}

/* Every pool thread busy and requests waiting: counted per waiting request, and logged at most
 * once a minute with what holds the threads, so one peer's slow calls cannot starve the others
 * unnoticed. */
static void note_saturation(td_rpc_agent *a, const char *caller) {
  size_t running, queued;
  int nthreads;
  td__threadpool_load(a->pool, &running, &queued, &nthreads);
  if (queued == 0 || running < (size_t)nthreads) return;
  TD__COUNT(a, pool_saturated);
  uint64_t now = td__now_ns(), last = __atomic_load_n(&a->saturation_logged_ns, __ATOMIC_RELAXED);
  if (last && now - last < 60000000000ull) return;
  if (!__atomic_compare_exchange_n(&a->saturation_logged_ns, &last, now, false, __ATOMIC_RELAXED,
                                   __ATOMIC_RELAXED))
    return;
  char held[600];
  td__serve_running(a, held, sizeof held);
  td_log(TD_LOG_WARN, "rpc: %s: all %d handler threads are busy and %zu requests wait (the "
         "latest from %s); running: %s (raise num_worker_threads, or make long handlers return "
         "a future)", a->name, nthreads, queued, caller, held);
}

/* A user's function runs where user code runs (pool or host progress); tdist's own "__"
 * functions always on the pool. */
static td_status submit_request(td_rpc_agent *a, request *r) {
  if (is_internal(r->msg.fn)) return td__threadpool_submit(a->pool, run_request, r);
  char caller[128];
  td__strcpy_trunc(caller, sizeof caller, r->caller); /* r may be gone once submitted */
  td_status st = td__agent_submit_user(a, run_request, r);
  if (st == TD_OK && !a->hostq) note_saturation(a, caller);
  return st;
}

void td__serve_local(td_rpc_agent *a, uint64_t id, const char *fn, td_value *const *args,
                     int nargs, int64_t timeout_ms, uint64_t ctx_id) {
  request *r = td__tc_calloc(sizeof *r);
  char *fncopy = td__strdup(fn);
  td_value **vals = td__calloc((size_t)(nargs ? nargs : 1), sizeof *vals);
  if (!r || !fncopy || !vals) {
    td__tc_free(r, sizeof *r);
    td__free(fncopy);
    td__free(vals);
    td__call_deliver(a, NULL, id, TD__MSG_ERROR, NULL, TD_ERR_NOMEM, "rpc: out of memory");
    return;
  }
  for (int i = 0; i < nargs; i++) vals[i] = td_value_ref(args[i]);
  r->a = a;
  r->msg = (td__msg){.id = id, .kind = TD__MSG_REQUEST, .fn = fncopy, .from_rank = a->rank,
                     .values = vals, .nvalues = nargs, .timeout_ms = timeout_ms,
                     .ctx_id = ctx_id};
  snprintf(r->caller, sizeof r->caller, "%s", a->name);
  arrived(r);
  __atomic_add_fetch(&a->active_in, 1, __ATOMIC_ACQ_REL);
  TD__COUNT(a, requests_received);
  if (submit_request(a, r) != TD_OK)
    reply_error(r, false, TD_ERR_STATE, "the agent is shutting down");
}

static bool run_inline(const td__reg *reg, const td__msg *m) {
  if (reg->flags & TD_RPC_INLINE) return true;
  const char *target;
  td__reg treg;
  return (reg->flags & TD__RPC_INLINE_LIKE_ARG1) && m->nvalues >= 2 &&
         td_value_as_string(m->values[1], &target, NULL) == TD_OK && td__reg_find(target, &treg) &&
         (treg.flags & TD_RPC_INLINE);
}

/* A request from a peer: on this (network) thread when its function is TD_RPC_INLINE, else on
 * the pool or the host's progress thread. */
static void dispatch(request *r) {
  td__reg reg;
  if (td__reg_find(r->msg.fn, &reg) && run_inline(&reg, &r->msg)) {
    bool was = td__rpc_inline_thread;
    td__rpc_inline_thread = true;
    run_found(r, &reg); /* looked up just now: no second lookup */
    td__rpc_inline_thread = was;
    return;
  }
  if (submit_request(r->a, r) != TD_OK)
    reply_error(r, false, TD_ERR_STATE, "the agent is shutting down");
}

/* Peers may call this worker as soon as they passed the ready barrier, while it still finishes
 * its init (the layers' hooks: RRef state, host progress, tracing). Such requests wait on the held
 * list until td__serve_start, so every handler finds the agent complete (a handler may use it the
 * moment it runs, before td_rpc_init has even returned to the program). True when r was held. */
static bool hold_until_started(request *r) {
  td_rpc_agent *a = r->a;
  if (__atomic_load_n(&a->serving, __ATOMIC_ACQUIRE)) return false;
  pthread_mutex_lock(&a->mu);
  bool held = !a->serving;
  if (held) {
    r->held_next = NULL;
    if (a->held_tail) a->held_tail->held_next = r;
    else a->held_head = r;
    a->held_tail = r;
  }
  pthread_mutex_unlock(&a->mu);
  return held;
}

static request *take_held(td_rpc_agent *a) {
  pthread_mutex_lock(&a->mu);
  request *r = a->held_head;
  a->held_head = a->held_tail = NULL;
  pthread_mutex_unlock(&a->mu);
  return r;
}

/* The held requests run in arrival order, and so do those that arrive while they run: serving
 * is switched on only once the list is found empty, so no request that arrives meanwhile can
 * overtake a held one (a lane's thread and the network thread deliver a peer's requests one after
 * the other, but without this the first request after the switch ran before the held ones). */
void td__serve_start(td_rpc_agent *a) {
  int n = 0;
  for (;;) {
    pthread_mutex_lock(&a->mu);
    request *r = a->held_head;
    a->held_head = a->held_tail = NULL;
    if (!r) __atomic_store_n(&a->serving, true, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&a->mu);
    if (!r) break;
    for (request *next; r; r = next, n++) {
      next = r->held_next;
      dispatch(r);
    }
  }
  if (n)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d request%s that arrived during init now run", a->name, n,
           n == 1 ? "" : "s");
}

void td__serve_drop_held(td_rpc_agent *a, const char *why) {
  for (request *r = take_held(a), *next; r; r = next) {
    next = r->held_next;
    reply_error(r, false, TD_ERR_STATE, "'%s' not run: this worker's init failed: %s", r->msg.fn,
                why);
  }
}

void td__serve_msg(void *ud, td__conn *c, td__msg *m) {
  td_rpc_agent *a = ud;
  /* the sender is the rank the stream's handshake proved, whatever the frame claims; requests
   * come on streams peers opened to us, replies on streams we opened, each unless its id bears
   * the reverse mark (a shared stream's other direction: TD__ID_REVERSE) */
  int from = td__conn_peer(c);
  bool is_request = m->kind == TD__MSG_REQUEST;
  if (from < 0 || from >= a->world || is_request != td__id_is_request(c, m->id)) {
    td_log(TD_LOG_WARN, "rpc: %s: dropping a %s from rank %d on a %s stream (id %s the reverse "
           "mark)", a->name, is_request ? "request" : "reply", from,
           td__conn_is_client(c) ? "client" : "server",
           m->id & TD__ID_REVERSE ? "with" : "without");
    td__msg_clear(m);
    return;
  }
  m->from_rank = from;
  if (!td__agent_present(a, from)) td__agent_learn_later(a, from); /* joined after the start */
  if (is_request) {
    request *r = td__tc_calloc(sizeof *r); /* one per request: from the thread's cache */
    if (!r) {
      td__msg_clear(m);
      return;
    }
    r->a = a;
    r->conn = td__conn_ref(c);
    r->msg = *m;
    memset(m, 0, sizeof *m);
    td__strcpy_trunc(r->caller, sizeof r->caller, td__agent_peer_name(a, from));
    arrived(r);
    __atomic_add_fetch(&a->active_in, 1, __ATOMIC_ACQ_REL);
    TD__COUNT(a, requests_received);
    if (!hold_until_started(r)) dispatch(r);
    return;
  }
  td_value *v = NULL;
  const td__rpc_middleware *mw = m->ctx_id ? td__mw_get() : NULL;
  if (mw && m->kind == TD__MSG_RESPONSE && mw->on_recv(a, td__conn_peer(c), m) != TD_OK) {
    char why[800];
    snprintf(why, sizeof why, "rpc: reply from %s (rank %d) rejected: %s",
             td__agent_peer_name(a, td__conn_peer(c)), td__conn_peer(c), td_last_error());
    td__call_deliver(a, c, m->id, TD__MSG_ERROR, NULL, TD_ERR_FORMAT, why);
    td__msg_clear(m);
    return;
  }
  if (m->kind == TD__MSG_RESPONSE && m->nvalues == 1) {
    v = m->values[0];
    m->values[0] = NULL;
  }
  td__call_deliver(a, c, m->id, m->kind, v, m->status ? m->status : TD_ERR_REMOTE, m->message);
  td__msg_clear(m);
}

void td__serve_bad(void *ud, td__conn *c, uint64_t id, td_status st, const char *why) {
  td_rpc_agent *a = ud;
  char msg[700];
  if (!td__id_is_request(c, id)) {
    /* a reply we cannot decode, or whose tensors cannot be placed where the map says */
    snprintf(msg, sizeof msg, "rpc: %s reply from %s (rank %d): %s",
             st == TD_ERR_DEVICE ? "cannot accept the" : "malformed",
             td__agent_peer_name(a, td__conn_peer(c)), td__conn_peer(c), why);
    td__call_deliver(a, c, id, TD__MSG_ERROR, NULL, st, msg);
    return;
  }
  TD__COUNT(a, requests_rejected);
  td_log(TD_LOG_WARN, "rpc: %s: rejected a request (id %llu): %s", a->name,
         (unsigned long long)id, why);
  snprintf(msg, sizeof msg, "%s (rank %d): request rejected: %s", a->name, a->rank, why);
  td__msg em = {.id = id, .kind = TD__MSG_ERROR, .from_rank = a->rank, .status = st,
                .message = msg};
  /* answered: the caller counted it as sent, so the shutdown barrier must see it served */
  if (send_frame_or_log(a, c, &em) == TD_OK)
    __atomic_add_fetch(&a->served_total, 1, __ATOMIC_ACQ_REL);
}

void td__serve_closed(void *ud, td__conn *c, td_status st, const char *why) {
  td_rpc_agent *a = ud;
  /* shutdown accounting: the other end takes this stream's frames back out as well (or is gone);
   * frames that went the stream's reverse way are the other kind (requests on a stream the peer
   * opened, replies on ours) */
  int64_t rev = (int64_t)td__conn_reverse_sent(c);
  int64_t fwd = (int64_t)td__conn_frames_sent(c) - rev;
  bool ours = td__conn_is_client(c);
  __atomic_sub_fetch(&a->sent_total, ours ? fwd : rev, __ATOMIC_ACQ_REL);
  __atomic_sub_fetch(&a->served_total, ours ? rev : fwd, __ATOMIC_ACQ_REL);
  /* calls that went out on it fail (on ours, or on the peer's when it served both ways) */
  td__call_stream_closed(a, c, st, why);
}

void td__serve_tick(void *ud) {
  td__call_expire(ud);
  td__store_park_tick(ud);
}

void td__serve_burst(void *ud, bool end) {
  if (end) td__call_burst_end(ud);
  else td__call_burst_begin(ud);
}

td_status td__serve_unary(void *ud, const char *method, const uint8_t *req, size_t len,
                          uint8_t **reply_buf, size_t *reply_len) {
  td_rpc_agent *a = ud;
  if (strcmp(method, TD__STORE_METHOD) == 0 && a->store)
    return td__auth_store_serve(a->sessions, req, len, td__store_park_body, a, reply_buf,
                                reply_len);
  return td_set_error(TD_ERR_NOT_FOUND, "no method %s on %s", method, a->name);
}
