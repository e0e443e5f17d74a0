/* call.c - outgoing calls: td_rpc_async / td_rpc_sync, the pending table, deadlines, and the
 * three ways a call ends besides its reply (timeout, its stream closing, shutdown).
 *
 * A call goes through named stages, each a function below:
 *   check     the agent is open, the callee exists and published fn          (call_check)
 *   prepare   future + pending entry, the message, the middleware's on_send  (call_prepare)
 *   encode    for a peer: the frame and the stream to it                     (call_encode)
 *   register  the entry and its deadline become visible to the poller        (call_register)
 *   dispatch  the frame is queued, or a call to self goes to the pool        (call_dispatch)
 * Once registered, the entry belongs to whoever takes it out of the table first (the reply, the
 * timeout on the network thread's tick, a closing stream, shutdown); later stages work only on
 * copies of its id and stream.
 *
 * The pending table is an open hash id -> pending*; deadlines sit in a min-heap checked on every
 * tick (entries of finished calls are skipped lazily, and the heap is compacted once they dominate
 * it, so memory stays flat under millions of calls). A finished call's future completes on the
 * pool when it has user callbacks, else on the completing thread (only waiters wake up).
 *
 * A call is refused while a checkpointed region runs on the calling thread (td_checkpoint: the
 * region's forward runs again in backward and cannot repeat a call).
 *
 * Lock order: a->mu, then the transport's locks. Futures complete with no agent lock held.
 */
#include <stdio.h>
#include <string.h>

#include "../core/flight_impl.h"
#include "../core/tcache.h"
#include "../core/trace_impl.h"
#include "future_impl.h"
#include "agent_state.h"
#include "tdist/autograd.h"

/* ---- pending table and deadline heap (a->mu held) ---- */

static size_t id_hash(uint64_t id) {
  id ^= id >> 33;
  id *= 0xff51afd7ed558ccdull;
  id ^= id >> 33;
  return (size_t)id;
}

static bool ptab_put(td_rpc_agent *a, pending *p) {
  if ((a->plen + 1) * 2 > a->pcap) {
    size_t nc = a->pcap ? a->pcap * 2 : 256;
    pending **nt = td__calloc(nc, sizeof *nt);
    if (!nt) return false;
    for (size_t i = 0; i < a->pcap; i++) {
      if (!a->ptab[i]) continue;
      size_t j = id_hash(a->ptab[i]->id) & (nc - 1);
      while (nt[j]) j = (j + 1) & (nc - 1);
      nt[j] = a->ptab[i];
    }
    td__free(a->ptab);
    a->ptab = nt;
    a->pcap = nc;
  }
  size_t j = id_hash(p->id) & (a->pcap - 1);
  while (a->ptab[j]) j = (j + 1) & (a->pcap - 1);
  a->ptab[j] = p;
  a->plen++;
  return true;
}

static pending *ptab_take(td_rpc_agent *a, uint64_t id) {
  if (!a->pcap) return NULL;
  size_t j = id_hash(id) & (a->pcap - 1);
  while (a->ptab[j]) {
    if (a->ptab[j]->id == id) break;
    j = (j + 1) & (a->pcap - 1);
  }
  pending *p = a->ptab[j];
  if (!p) return NULL;
  /* backward-shift deletion keeps probe chains intact */
  a->ptab[j] = NULL;
  a->plen--;
  size_t k = (j + 1) & (a->pcap - 1);
  while (a->ptab[k]) {
    pending *q = a->ptab[k];
    a->ptab[k] = NULL;
    size_t h = id_hash(q->id) & (a->pcap - 1);
    while (a->ptab[h]) h = (h + 1) & (a->pcap - 1);
    a->ptab[h] = q;
    k = (k + 1) & (a->pcap - 1);
  }
  return p;
}

static void heap_swap(dl_entry *h, size_t i, size_t j) {
  dl_entry t = h[i];
  h[i] = h[j];
  h[j] = t;
}

static void heap_down(dl_entry *h, size_t n, size_t i) {
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < n && h[l].deadline_ns < h[m].deadline_ns) m = l;
    if (r < n && h[r].deadline_ns < h[m].deadline_ns) m = r;
    if (m == i) return;
    heap_swap(h, i, m);
    i = m;
  }
}

static bool heap_push(td_rpc_agent *a, uint64_t deadline, uint64_t id) {
  if (a->hlen == a->hcap) {
    size_t nc = a->hcap ? a->hcap * 2 : 256;
    dl_entry *nh = td__realloc(a->heap, nc * sizeof *nh);
    if (!nh) return false;
    a->heap = nh;
    a->hcap = nc;
  }
  size_t i = a->hlen++;
  a->heap[i] = (dl_entry){deadline, id};
  while (i > 0 && a->heap[(i - 1) / 2].deadline_ns > a->heap[i].deadline_ns) {
    heap_swap(a->heap, i, (i - 1) / 2);
    i = (i - 1) / 2;
  }
  return true;
}

/* Drops heap entries of calls that already finished once they dominate the heap. */
static void heap_compact(td_rpc_agent *a) {
  if (a->hlen < 1024 || a->hlen < 4 * a->plen) return;
  size_t k = 0;
  for (size_t i = 0; i < a->hlen; i++) {
    uint64_t id = a->heap[i].id;
    if (!a->pcap) break;
    size_t j = id_hash(id) & (a->pcap - 1);
    bool live = false;
    while (a->ptab[j]) {
      if (a->ptab[j]->id == id) {
        live = true;
        break;
      }
      j = (j + 1) & (a->pcap - 1);
    }
    if (live) a->heap[k++] = a->heap[i];
  }
  a->hlen = k;
  for (size_t i = a->hlen / 2; i-- > 0;) heap_down(a->heap, a->hlen, i);
  if (a->hcap > 4096 && a->hlen < a->hcap / 8) {
    size_t nc = a->hcap / 4;
    dl_entry *nh = td__realloc(a->heap, nc * sizeof *nh);
    if (nh) {
      a->heap = nh;
      a->hcap = nc;
    }
  }
}

static void pending_free(pending *p) {
  td_future_unref(p->fut);
  td__conn_unref(p->conn);
  td__tc_free(p, sizeof *p);
}

/* Completes a finished call's future: on this thread when nobody registered a callback (only
 * waiters wake up, and nothing is allocated), else on the pool, where user callbacks run. */
static void complete_now(pending *p, int kind, td_value *value, td_status st,
                         const char *message) {
  if (kind == TD__MSG_RESPONSE) td_future_complete(p->fut, value);
  else td__future_fail_msg(p->fut, st, message);
  pending_free(p);
}

/* A completion that runs on the pool (the future has user callbacks). */
typedef struct completion {
  struct completion *next; /* a burst's list (td__call_burst_end) */
  td_rpc_agent *a;
  pending *p;
  int kind;
  td_value *value;
  td_status status;
  char *message;
} completion;

static void complete_one(completion *c) {
  complete_now(c->p, c->kind, c->value, c->status, c->message);
  td__free(c->message);
  td__free(c);
}

/* Runs a burst's completions in the order their replies arrived. A user callback that blocks in
 * a wait first hands the rest of the burst to the pool as a task of its own (the callback may wait
 * for one of them). */
typedef struct burst_run {
  td_rpc_agent *a;
  completion *rest;
} burst_run;

static void complete_task(void *arg);

static void hand_over_rest(void *ud) {
  burst_run *br = ud;
  completion *rest = br->rest;
  br->rest = NULL;
  if (rest && td__agent_submit_user(br->a, complete_task, rest) != TD_OK)
    br->rest = rest; /* shutting down: run them here after all */
}

static void complete_task(void *arg) {
  completion *c = arg;
  burst_run br = {c->a, NULL};
  while (c) {
    br.rest = c->next;
    if (br.rest) td__future_set_before_block(hand_over_rest, &br);
    complete_one(c);
    td__future_set_before_block(NULL, NULL);
    c = br.rest;
  }
}

/* A burst: while a receiving thread delivers the frames it took from its rings in one pass
 * (td__call_burst_begin / _end, through the transport), completions that go to the pool collect
 * here and go there as one task (one allocation, one lock, at most one wake-up), instead of one
 * task per reply. Per thread; bound to the agent that opened it. */
static _Thread_local struct {
  td_rpc_agent *a; /* NULL: no burst open on this thread */
  completion *head, *tail;
  int n;
} burst;
#define BURST_MAX 64 /* completions handed over at once at most (the first must not wait long) */

static void burst_flush(void) {
  completion *list = burst.head;
  burst.head = burst.tail = NULL;
  burst.n = 0;
  if (list && td__agent_submit_user(burst.a, complete_task, list) != TD_OK) complete_task(list);
}

void td__call_burst_begin(td_rpc_agent *a) {
  if (!burst.a) burst.a = a;
}

void td__call_burst_end(td_rpc_agent *a) {
  if (burst.a != a) return;
  burst_flush();
  burst.a = NULL;
}

/* Queues c for the pool (in the open burst, or as a task of its own); false when the pool
 * refused it (shutting down): the caller completes it here. */
static bool complete_later(td_rpc_agent *a, completion *c) {
  c->next = NULL;
  if (burst.a == a) {
    if (burst.tail) burst.tail->next = c;
    else burst.head = c;
    burst.tail = c;
    if (++burst.n >= BURST_MAX) burst_flush();
    return true;
  }
  return td__agent_submit_user(a, complete_task, c) == TD_OK;
}

static void finish_call(td_rpc_agent *a, pending *p, int kind, td_value *value, td_status st,
                        const char *message) {
  if (p->traced && TD__TRACE_ON()) {
    char fn[80];
    td__trace_escape(p->fn, fn, sizeof fn);
    td__trace_emit("{\"ph\":\"e\",\"cat\":\"rpc\",\"name\":\"%s\",\"id\":\"0x%llx\",\"pid\":%d,"
                   "\"tid\":%d,\"ts\":%.3f,\"args\":{\"outcome\":\"%s\"}}",
                   fn, (unsigned long long)td__call_trace_id(a->rank, p->id), td__trace_pid(),
                   td__trace_tid(), (double)td__now_ns() * 1e-3,
                   kind == TD__MSG_RESPONSE ? "ok" : p->expired ? "timeout" : "error");
  }
  td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_DONE, .peer = p->peer, .a = p->id,
                                     .x = (uint8_t)(kind == TD__MSG_RESPONSE ? TD_OK : st)},
                    p->fn);
  if (kind == TD__MSG_RESPONSE) TD__COUNT(a, calls_succeeded);
  else if (p->expired) TD__COUNT(a, calls_timed_out);
  else TD__COUNT(a, calls_failed);
  if (!td__future_has_callbacks(p->fut)) {
    complete_now(p, kind, value, st, message);
  } else {
    completion *c = td__calloc(1, sizeof *c);
    char *msg = c && kind != TD__MSG_RESPONSE ? td__strdup(message ? message : "") : NULL;
    if (!c || (kind != TD__MSG_RESPONSE && !msg)) {
      td__free(c);
      td_value_unref(value);
      td__future_fail_msg(p->fut, TD_ERR_NOMEM, "rpc: out of memory completing a call");
      pending_free(p);
    } else {
      *c = (completion){.a = a, .p = p, .kind = kind, .value = value, .status = st, .message = msg};
      /* the user's callbacks run on the pool (or the host's progress thread) */
      if (!complete_later(a, c)) complete_one(c);
    }
  }
  __atomic_sub_fetch(&a->pending_out, 1, __ATOMIC_ACQ_REL);
}

void td__call_deliver(td_rpc_agent *a, const td__conn *via, uint64_t id, int kind,
                      td_value *value, td_status st, const char *message) {
  pthread_mutex_lock(&a->mu);
  pending *p = ptab_take(a, id);
  if (p && via && p->conn != via) {
    /* a reply to a call that went out on another stream: not this peer's to answer (taking one
     * entry out left room to put it back) */
    ptab_put(a, p);
    p = NULL;
  }
  pthread_mutex_unlock(&a->mu);
  if (!p) {
    td_log(TD_LOG_DEBUG, "rpc: %s: dropping a late or unknown reply (id %llu)", a->name,
           (unsigned long long)id);
    td_value_unref(value);
    return;
  }
  if (kind == TD__MSG_RESPONSE && !value) value = td_value_none();
  finish_call(a, p, kind, value, st, message);
}

/* ---- the other ends of a call: timeout, closed stream, shutdown ---- */

/* Every call whose deadline passed by this tick fails now, in batches of 64 taken under the lock
 * and finished outside it (before, one batch per 10 ms tick: 10,000 calls sharing a deadline were
 * reported up to 1.6 s late). */
void td__call_expire(td_rpc_agent *a) {
  uint64_t now = td__now_ns();
  pending *expired[64];
  int n;
  do {
    n = 0;
    pthread_mutex_lock(&a->mu);
    while (a->hlen && a->heap[0].deadline_ns <= now && n < 64) {
      uint64_t id = a->heap[0].id;
      a->heap[0] = a->heap[--a->hlen];
      heap_down(a->heap, a->hlen, 0);
      pending *p = ptab_take(a, id);
      if (p) {
        p->expired = true;
        expired[n++] = p;
      }
    }
    heap_compact(a);
    pthread_mutex_unlock(&a->mu);
    for (int i = 0; i < n; i++) {
      char msg[400];
      snprintf(msg, sizeof msg, "rpc: call to '%s' on %s (rank %d) timed out after %lld ms",
               expired[i]->fn, td__agent_peer_name(a, expired[i]->peer), expired[i]->peer,
               (long long)expired[i]->timeout_ms);
      finish_call(a, expired[i], TD__MSG_ERROR, NULL, TD_ERR_TIMEOUT, msg);
    }
  } while (n == 64);
}

void td__call_stream_closed(td_rpc_agent *a, td__conn *c, td_status st, const char *why) {
  int peer = td__conn_peer(c);
  /* collect the calls that went out on this stream */
  pending **failed = NULL;
  size_t nf = 0;
  pthread_mutex_lock(&a->mu);
  if (peer >= 0 && peer < a->world && a->peers && a->peers[peer].conn == c) {
    a->peers[peer].conn = NULL;
    td__conn_unref(c);
  }
  for (size_t i = 0; i < a->pcap; i++) {
    if (a->ptab[i] && a->ptab[i]->conn == c) nf++;
  }
  if (nf) failed = td__malloc(nf * sizeof *failed);
  size_t k = 0;
  if (failed) {
    for (size_t i = 0; i < a->pcap && k < nf; i++) {
      pending *p = a->ptab[i];
      if (p && p->conn == c) failed[k++] = p;
    }
    for (size_t i = 0; i < k; i++) ptab_take(a, failed[i]->id);
  }
  pthread_mutex_unlock(&a->mu);
  char msg[800];
  snprintf(msg, sizeof msg, "rpc: %s (rank %d) is unreachable: %s", td__agent_peer_name(a, peer),
           peer, why && *why ? why : "connection closed");
  if (k) td_log(TD_LOG_WARN, "%s (%zu calls failed)", msg, k);
  for (size_t i = 0; i < k; i++)
    finish_call(a, failed[i], TD__MSG_ERROR, NULL,
                st == TD_ERR_CANCELLED ? st : TD_ERR_UNAVAILABLE, msg);
  td__free(failed);
}

void td__call_fail_all(td_rpc_agent *a, td_status st, const char *msg) {
  for (;;) {
    pending *p = NULL;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->pcap && !p; i++)
      if (a->ptab[i]) p = ptab_take(a, a->ptab[i]->id);
    pthread_mutex_unlock(&a->mu);
    if (!p) return;
    finish_call(a, p, TD__MSG_ERROR, NULL, st, msg);
  }
}

void td__call_free_all(td_rpc_agent *a) {
  for (size_t i = 0; i < a->pcap; i++)
    if (a->ptab[i]) pending_free(a->ptab[i]);
  td__free(a->ptab);
  a->ptab = NULL;
  a->pcap = a->plen = 0;
  td__free(a->heap);
  a->heap = NULL;
  a->hlen = a->hcap = 0;
}

/* ---- starting a call ---- */

/* Returns the stream to peer (new reference), opening it when needed. */
static td_status peer_conn(td_rpc_agent *a, int peer, td__conn **out) {
  pthread_mutex_lock(&a->mu);
  td__conn *c = a->peers[peer].conn;
  if (c && td__conn_closed(c)) {
    a->peers[peer].conn = NULL;
    td__conn_unref(c);
    c = NULL;
  }
  if (!c && a->share_streams && (c = td__transport_reverse_conn(a->tr, peer)) != NULL) {
    /* the peer already opened an authenticated stream to us: it serves both ways */
    a->peers[peer].conn = c;
    TD__COUNT(a, streams_shared);
  }
  if (!c) {
    td_status st = td__transport_connect(a->tr, peer, a->peers[peer].info.address, &c);
    if (st != TD_OK) {
      pthread_mutex_unlock(&a->mu);
      return st;
    }
    a->peers[peer].conn = c;
    TD__COUNT(a, streams_opened);
  }
  *out = td__conn_ref(c);
  pthread_mutex_unlock(&a->mu);
  return TD_OK;
}

/* One call on its way out (stack storage of rpc_async). */
typedef struct call {
  td_rpc_agent *a;
  uint64_t t0; /* when the call began (traces) */
  const char *to, *fn;
  td_value *const *args;
  int nargs;
  int peer;
  td_timeout_ms timeout_ms; /* resolved: a duration or TD_TIMEOUT_INFINITE */
  bool reply_map; /* encode with the map used for replies to the callee */
  td_future *fut; /* the caller's reference */
  pending *p;
  td__msg m;
  td__frame frame;
} call;

static td_status call_check(call *c, const td_rpc_call_opts *opts) {
  td_rpc_agent *a = c->a;
  td_timeout_ms t;
  TD_TRY(td__call_opts_timeout(opts, "rpc_async", &t));
  if (__atomic_load_n(&a->closing, __ATOMIC_ACQUIRE))
    return td_set_error(TD_ERR_STATE, "rpc_async: the agent %s has shut down", a->name);
  c->peer = td__agent_find(a, c->to); /* (learns a worker that joined since: elastic.c) */
  if (c->peer < 0)
    return td_set_error(TD_ERR_NOT_FOUND, "rpc_async: no worker named '%s' (this is %s)", c->to,
                        a->name);
  bool internal = c->fn[0] == '_' && c->fn[1] == '_';
  if (!internal && !td__agent_peer_has_fn(&a->peers[c->peer], c->fn))
    return td_set_error(TD_ERR_NOT_FOUND, "rpc_async: function '%s' is not registered on %s "
                        "(rank %d) (called from %s (rank %d))", c->fn, c->to, c->peer, a->name,
                        a->rank);
  for (int i = 0; i < c->nargs; i++)
    TD_CHECK_ARG(c->args[i], "rpc_async: argument %d is NULL", i);
  TD_CHECK_ARG(td__timeout_valid(t), "rpc_async: invalid timeout %lld", (long long)t);
  c->timeout_ms = td__timeout_resolve(t, td_rpc_get_default_timeout(a));
  if (c->timeout_ms == TD_TIMEOUT_ZERO)
    return td_set_error(TD_ERR_TIMEOUT, "rpc_async: call to '%s' on %s started with "
                        "TD_TIMEOUT_ZERO: expired at once", c->fn, c->to);
  return TD_OK;
}

/* Undoes call_prepare (before call_register only). */
static void call_discard(call *c) {
  td__free(c->m.aux);
  c->m.aux = NULL;
  td__frame_clear(&c->frame);
  if (c->p) pending_free(c->p);
  c->p = NULL;
  td_future_unref(c->fut);
  c->fut = NULL;
}

static td_status call_prepare(call *c) {
  td_rpc_agent *a = c->a;
  c->fut = td_future_create();
  c->p = td__tc_calloc(sizeof *c->p); /* from the thread's cache: one per call */
  if (!c->fut || !c->p) {
    call_discard(c);
    return td_set_error(TD_ERR_NOMEM, "rpc_async: out of memory");
  }
  pending *p = c->p;
  p->id = __atomic_add_fetch(&a->next_id, 1, __ATOMIC_RELAXED);
  p->fut = td_future_ref(c->fut);
  p->peer = c->peer;
  p->timeout_ms = c->timeout_ms;
  td__strcpy_trunc(p->fn, sizeof p->fn, c->fn);
  td__future_set_flight(c->fut, c->peer, p->id, c->fn);
  c->m = (td__msg){.id = p->id, .kind = TD__MSG_REQUEST, .fn = (char *)c->fn,
                   .from_rank = a->rank, .values = (td_value **)c->args, .nvalues = c->nargs,
                   .timeout_ms = c->timeout_ms > 0 ? c->timeout_ms : 0};
  const td__rpc_middleware *mw = td__mw_get();
  td_status st = mw ? mw->on_send(a, c->peer, &c->m) : TD_OK;
  if (st != TD_OK) call_discard(c);
  return st;
}

static td_status call_encode(call *c) {
  td_rpc_agent *a = c->a;
  if (c->peer == a->rank) { /* calls to self share their values */
    td__free(c->m.aux);
    c->m.aux = NULL;
    return TD_OK;
  }
  peer_info *pi = &a->peers[c->peer];
  td__wire_ctx wctx = {a, c->peer, a->rank, c->reply_map ? &pi->reply_map : &pi->out_map,
                       pi->info.name};
  /* the stream first: a call on a stream the callee opened carries the reverse mark in its id */
  td_status st = peer_conn(a, c->peer, &c->p->conn);
  if (st == TD_OK && !td__conn_is_client(c->p->conn)) {
    c->p->id |= TD__ID_REVERSE;
    c->m.id = c->p->id;
    td__future_set_flight(c->fut, c->peer, c->p->id, c->fn);
  }
  if (st == TD_OK) st = td__wire_encode(&c->m, &wctx, &c->frame);
  c->frame.reverse = st == TD_OK && !td__conn_is_client(c->p->conn);
  td__free(c->m.aux);
  c->m.aux = NULL;
  if (st != TD_OK) call_discard(c);
  return st;
}

/* Publishes the pending entry (and its deadline). Returns false when out of memory, after
 * failing the call's future; the entry is no longer c's either way. */
static bool call_register(call *c) {
  td_rpc_agent *a = c->a;
  pending *p = c->p;
  uint64_t id = p->id;
  c->p = NULL;
  __atomic_add_fetch(&a->pending_out, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
  TD__COUNT(a, calls_started);
  pthread_mutex_lock(&a->mu);
  bool in_tab = ptab_put(a, p);
  bool ok = in_tab;
  if (ok && c->timeout_ms > 0)
    ok = heap_push(a, td__now_ns() + (uint64_t)c->timeout_ms * 1000000ull, id);
  pthread_mutex_unlock(&a->mu);
  if (ok) return true;
  /* out of memory: fail the future rather than lose track of it (p is ours unless it made it into
   * the table, where a closing stream may have taken it meanwhile) */
  pending *q = p;
  if (in_tab) {
    pthread_mutex_lock(&a->mu);
    q = ptab_take(a, id);
    pthread_mutex_unlock(&a->mu);
  }
  __atomic_sub_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
  td__frame_clear(&c->frame);
  if (q) finish_call(a, q, TD__MSG_ERROR, NULL, TD_ERR_NOMEM, "rpc: out of memory");
  return false;
}

/* Trace: the send on this thread (with the flow arrow to the handler) and the call's whole life on
 * an async track of its own (its end is recorded by finish_call). */
static void trace_send(call *c, uint64_t id) {
  td_rpc_agent *a = c->a;
  uint64_t t1 = td__now_ns(), tid = td__call_trace_id(a->rank, id);
  char fn[80], to[160], args[300];
  td__trace_escape(c->fn, fn, sizeof fn);
  td__trace_escape(c->to, to, sizeof to);
  snprintf(args, sizeof args, "{\"fn\":\"%s\",\"to\":\"%s\",\"id\":%llu}", fn, to,
           (unsigned long long)id);
  td__trace_emit("{\"ph\":\"b\",\"cat\":\"rpc\",\"name\":\"%s\",\"id\":\"0x%llx\",\"pid\":%d,"
                 "\"tid\":%d,\"ts\":%.3f,\"args\":%s}",
                 fn, (unsigned long long)tid, td__trace_pid(), td__trace_tid(), (double)c->t0 * 1e-3,
                 args);
  char name[120];
  snprintf(name, sizeof name, "send %s", c->fn);
  td__trace_complete("rpc", name, c->t0, t1, args);
  td__trace_flow('s', tid, "rpc", t1);
}

static void call_dispatch(call *c, uint64_t id, td__conn *conn) {
  td_rpc_agent *a = c->a;
  if (c->peer == a->rank) {
    td__serve_local(a, id, c->fn, c->args, c->nargs, c->m.timeout_ms, c->m.ctx_id);
    return;
  }
  td_status st = td__conn_send(conn, &c->frame);
  if (st != TD_OK) {
    /* nothing left this process: the peer will never serve it */
    __atomic_sub_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
    char msg[600];
    snprintf(msg, sizeof msg, "rpc: cannot send '%s' to %s (rank %d): %s", c->fn, c->to, c->peer,
             td_last_error());
    td__call_deliver(a, NULL, id, TD__MSG_ERROR, NULL, st, msg);
  }
}

static td_status rpc_async(td_rpc_agent *a, const char *to, const char *fn,
                           td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                           bool reply_map, td_future **out) {
  TD_CHECK_ARG(a && to && fn && out && nargs >= 0 && (args || nargs == 0),
               "rpc_async: invalid argument");
  const char *region = NULL;
  td_checkpoint_phase phase = td_checkpoint_current(&region);
  if (phase != TD_CHECKPOINT_PHASE_NONE)
    return td_set_error(TD_ERR_STATE, "rpc: cannot call '%s' on %s inside the checkpointed region "
                        "'%s' (%s): a checkpointed forward runs again in backward, which would "
                        "repeat the call and its effects on %s, and its recompute cannot be "
                        "replayed exactly; make the call outside the region", fn, to, region,
                        phase == TD_CHECKPOINT_PHASE_FORWARD ? "in its forward"
                                                             : "in its recompute in backward",
                        to);
  call c = {.a = a, .to = to, .fn = fn, .args = args, .nargs = nargs, .reply_map = reply_map};
  bool traced = TD__TRACE_ON();
  if (traced) c.t0 = td__now_ns();
  TD_TRY(call_check(&c, opts));
  TD_TRY(call_prepare(&c));
  TD_TRY(call_encode(&c));
  /* once registered, a timeout or a closing stream may complete and free the entry on the poller
   * at any moment: from here on only these copies are used */
  uint64_t id = c.p->id;
  td__conn *conn = td__conn_ref(c.p->conn);
  c.p->traced = traced;
  if (traced) trace_send(&c, id); /* before the reply can complete it */
  /* what the call is about: the caller's subject (an RRef, a backward hop), else the distributed
   * autograd context the middleware attached */
  td__flight_subj subj = td__flight_subject();
  if (!subj.kind && c.m.ctx_id) subj = (td__flight_subj){TD__FL_SUBJ_CTX, c.m.ctx_id};
  td__future_set_flight_subject(c.fut, subj.kind, subj.id);
  td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_SEND, .peer = c.peer, .a = id,
                                     .b = subj.id, .y = subj.kind,
                                     .c = td__flight_timeout_field(c.timeout_ms)}, fn);
  if (call_register(&c)) call_dispatch(&c, id, conn);
  td__conn_unref(conn);
  *out = c.fut;
  return TD_OK;
}

td_status td_rpc_async(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                       int nargs, const td_rpc_call_opts *opts, td_future **out) {
  return rpc_async(a, to, fn, args, nargs, opts, false, out);
}

td_status td__rpc_async_reply_map(td_rpc_agent *a, const char *to, const char *fn,
                                  td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                                  td_future **out) {
  return rpc_async(a, to, fn, args, nargs, opts, true, out);
}

td_status td_rpc_sync(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                      int nargs, const td_rpc_call_opts *opts, td_value **result) {
  TD_CHECK_ARG(result, "rpc_sync: NULL result");
  if (td__rpc_inline_thread)
    return td_set_error(TD_ERR_STATE, "rpc_sync: blocking call from a TD_RPC_INLINE function "
                        "(use td_rpc_async and return its future)");
  td_future *f;
  TD_TRY(td_rpc_async(a, to, fn, args, nargs, opts, &f));
  uint64_t t0 = td__now_ns();
  td_status st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* the call's own deadline ends it */
  __atomic_add_fetch(&a->cnt.sync_wait_ns, td__now_ns() - t0, __ATOMIC_RELAXED);
  if (st == TD_OK) {
    td_value *v = td_future_value(f);
    *result = v ? td_value_ref(v) : td_value_none();
  } else {
    td_set_error(st, "%s", td_future_message(f));
  }
  td_future_unref(f);
  return st;
}
