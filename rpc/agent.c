/* agent.c - the RPC agent: registry, rendezvous, calls and replies, timeouts, dead peers,
 * graceful shutdown.
 *
 * Threads: the transport's poller thread delivers frames (on_msg), closed streams (on_closed) and
 * ticks (timeouts); it never runs user code except future callbacks of replies (which must not
 * block). Requests run on the agent's thread pool. A handler that returns a future replies from
 * that future's callback, so no pool thread waits for nested calls.
 *
 * State: `pending` maps call id -> the caller's future (and the stream it went out on); a min-heap
 * of deadlines drives timeouts (entries of finished calls are skipped lazily and the heap is
 * rebuilt when it holds many of them). Streams to peers are opened lazily, one per peer, and
 * replaced when they fail.
 *
 * Graceful shutdown (PyTorch semantics): every worker announces arrival in the store, then keeps
 * publishing (idle, requests sent, requests served); rank 0 declares the group done once every
 * worker has arrived, all are idle, the totals balance, and two consecutive snapshots agree.
 * The totals count frames the transport accepted (plus calls to self); when a stream closes, the
 * frames that went out on it are taken back out (requests on client streams, replies on server
 * streams), so a request lost with a dead stream cannot unbalance the totals forever.
 *
 * Device maps (td_rpc_options.device_maps) are checked at rendezvous (see "device maps" below)
 * and immutable afterwards: requests are encoded with our map toward the callee, replies with the
 * inverse of the caller's map toward us.
 *
 * Lock order: a->mu, then the transport's locks (through td__conn_send). Futures are completed
 * with no agent lock held.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/uio.h>
#endif

#include "agent_impl.h"
#include "netaddr.h"
#include "tdist/autograd.h"

/* ---- registry (process-wide) ---- */

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static td__reg *regs;
static int nregs, regcap;

static td_status reg_add(const char *name, td_rpc_fn fn, void *ud, bool internal,
                         unsigned flags) {
  if (!name || !*name || !fn) return td_set_error(TD_ERR_INVALID, "rpc_register: NULL name or fn");
  if (strlen(name) > 200) return td_set_error(TD_ERR_INVALID, "rpc_register: name too long");
  bool reserved = name[0] == '_' && name[1] == '_';
  if (reserved != internal)
    return td_set_error(TD_ERR_INVALID, "rpc_register: names starting with \"__\" are reserved "
                        "for tdist ('%s')", name);
  pthread_rwlock_wrlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      bool same = regs[i].fn == fn && regs[i].user_data == ud;
      pthread_rwlock_unlock(&reg_lock);
      if (internal && same) return TD_OK;
      return td_set_error(TD_ERR_EXISTS, "rpc_register: '%s' is already registered", name);
    }
  }
  if (nregs == regcap) {
    int nc = regcap ? regcap * 2 : 32;
    td__reg *nr = td__realloc(regs, (size_t)nc * sizeof *nr);
    if (!nr) {
      pthread_rwlock_unlock(&reg_lock);
      return td_set_error(TD_ERR_NOMEM, "rpc_register: out of memory");
    }
    regs = nr;
    regcap = nc;
  }
  char *n = td__strdup(name);
  if (!n) {
    pthread_rwlock_unlock(&reg_lock);
    return td_set_error(TD_ERR_NOMEM, "rpc_register: out of memory");
  }
  regs[nregs++] = (td__reg){n, fn, ud, flags};
  pthread_rwlock_unlock(&reg_lock);
  return TD_OK;
}

td_status td_rpc_register(const char *name, td_rpc_fn fn, void *user_data) {
  return reg_add(name, fn, user_data, false, 0);
}

td_status td_rpc_register_ex(const char *name, td_rpc_fn fn, void *user_data, unsigned flags) {
  if (flags & ~TD_RPC_INLINE)
    return td_set_error(TD_ERR_INVALID, "rpc_register_ex: unknown flags 0x%x", flags);
  return reg_add(name, fn, user_data, false, flags);
}

td_status td__rpc_register_internal(const char *name, td_rpc_fn fn, void *user_data) {
  return reg_add(name, fn, user_data, true, 0);
}

td_status td__rpc_register_internal_ex(const char *name, td_rpc_fn fn, void *user_data,
                                       unsigned flags) {
  return reg_add(name, fn, user_data, true, flags);
}

td_status td_rpc_unregister(const char *name) {
  if (!name) return td_set_error(TD_ERR_INVALID, "rpc_unregister: NULL name");
  pthread_rwlock_wrlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      td__free(regs[i].name);
      regs[i] = regs[--nregs];
      pthread_rwlock_unlock(&reg_lock);
      return TD_OK;
    }
  }
  pthread_rwlock_unlock(&reg_lock);
  return td_set_error(TD_ERR_NOT_FOUND, "rpc_unregister: '%s' is not registered", name);
}

static bool reg_find(const char *name, td__reg *out) {
  pthread_rwlock_rdlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      *out = regs[i];
      pthread_rwlock_unlock(&reg_lock);
      return true;
    }
  }
  pthread_rwlock_unlock(&reg_lock);
  return false;
}

td_status td__rpc_lookup(const char *name, td__reg *out) {
  return reg_find(name, out) ? TD_OK : TD_ERR_NOT_FOUND;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* "name\nname\n..." sorted, malloc'd. */
static char *reg_snapshot(void) {
  pthread_rwlock_rdlock(&reg_lock);
  size_t len = 1;
  for (int i = 0; i < nregs; i++) len += strlen(regs[i].name) + 1;
  char **names = td__malloc((size_t)(nregs ? nregs : 1) * sizeof *names);
  char *out = td__malloc(len);
  if (!names || !out) {
    pthread_rwlock_unlock(&reg_lock);
    td__free(names);
    td__free(out);
    return NULL;
  }
  for (int i = 0; i < nregs; i++) names[i] = regs[i].name;
  qsort(names, (size_t)nregs, sizeof *names, cmp_str);
  char *p = out;
  for (int i = 0; i < nregs; i++) {
    size_t l = strlen(names[i]);
    memcpy(p, names[i], l);
    p[l] = '\n';
    p += l + 1;
  }
  *p = 0;
  pthread_rwlock_unlock(&reg_lock);
  td__free(names);
  return out;
}

static td__agent_hooks hooks[8];
static int nhooks;
static pthread_mutex_t hooks_mu = PTHREAD_MUTEX_INITIALIZER;

td_status td__agent_add_hooks(const td__agent_hooks *h) {
  pthread_mutex_lock(&hooks_mu);
  for (int i = 0; i < nhooks; i++) {
    if (hooks[i].on_init == h->on_init && hooks[i].on_shutdown == h->on_shutdown) {
      pthread_mutex_unlock(&hooks_mu);
      return TD_OK;
    }
  }
  if (nhooks == 8) {
    pthread_mutex_unlock(&hooks_mu);
    return td_set_error(TD_ERR_NOMEM, "rpc: too many agent hooks");
  }
  hooks[nhooks++] = *h;
  pthread_mutex_unlock(&hooks_mu);
  return TD_OK;
}

static const td__rpc_middleware *middleware;

td_status td__rpc_set_middleware(const td__rpc_middleware *mw) {
  const td__rpc_middleware *expected = NULL;
  if (__atomic_compare_exchange_n(&middleware, &expected, mw, false, __ATOMIC_ACQ_REL,
                                  __ATOMIC_ACQUIRE) || expected == mw)
    return TD_OK;
  return td_set_error(TD_ERR_EXISTS, "rpc: another message middleware is registered");
}

static const td__rpc_middleware *mw_get(void) {
  return __atomic_load_n(&middleware, __ATOMIC_ACQUIRE);
}

/* True while a TD_RPC_INLINE function runs on this (poller) thread: blocking there would stop
 * the thread that delivers every reply. */
static _Thread_local bool in_inline_handler;

/* ---- the agent ---- */

typedef struct pending {
  uint64_t id;
  td_future *fut;
  int peer;
  td__conn *conn; /* NULL for calls to self */
  char fn[64];
  int64_t timeout_ms;
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
  td__conn *conn; /* our stream to it (lazy) */
  td__devmap out_map;   /* our device map toward it (requests we send it) */
  td__devmap reply_map; /* the inverse of its map toward us (replies we send it) */
} peer_info;

struct td_rpc_agent {
  td_rpc_options opts;
  char *listen_addr, *init_method;
  char name[128];
  int rank, world;
  char master[300];
  peer_info *peers;
  td__transport *tr;
  td__store *store; /* rank 0 only */
  td__store_client sc;
  td__threadpool *pool;
  pthread_mutex_t mu;
  /* pending calls: open hash id -> pending* */
  pending **ptab;
  size_t pcap, plen;
  dl_entry *heap;
  size_t hlen, hcap;
  uint64_t next_id;
  int64_t default_timeout_ms;
  int64_t pending_out, active_in;
  int64_t sent_total, served_total;
  bool closing;  /* no new calls */
  bool shut;     /* shutdown finished */
  int64_t busy_poll_us; /* resolved td_rpc_options.busy_poll_us */
  /* same-host direct copy (see direct_publish) */
  uint64_t direct_nonce; /* peers read it from our memory to prove they can */
  bool direct_on;
  bool *direct_cand; /* [world]: same host, both enabled, we can read it */
  int direct_peers;  /* peers that read our frames directly */
  bool hooks_ran;
};

td__threadpool *td__agent_pool(td_rpc_agent *a) { return a->pool; }
const td__store_client *td__agent_store(td_rpc_agent *a) { return &a->sc; }
const char *td__agent_listen_addr(td_rpc_agent *a) { return a->listen_addr; }

void td_rpc_options_init(td_rpc_options *o) {
  memset(o, 0, sizeof *o);
  o->num_worker_threads = 16;
  o->rpc_timeout_ms = 60000;
  o->init_timeout_ms = 120000;
  o->listen_addr = NULL; /* chosen at init: td__choose_address */
  o->keepalive_ms = 2000;
  o->keepalive_timeout_ms = 20000;
  o->busy_poll_us = -1;
  o->direct_copy = -1;
}

int td_rpc_rank(const td_rpc_agent *a) { return a ? a->rank : -1; }
int td_rpc_world_size(const td_rpc_agent *a) { return a ? a->world : 0; }
int64_t td_rpc_busy_poll_us(const td_rpc_agent *a) { return a ? a->busy_poll_us : 0; }
int td_rpc_direct_copy_peers(const td_rpc_agent *a) { return a ? a->direct_peers : 0; }

void td_rpc_set_default_timeout(td_rpc_agent *a, int64_t ms) {
  if (a) __atomic_store_n(&a->default_timeout_ms, ms < 0 ? 0 : ms, __ATOMIC_RELAXED);
}
int64_t td_rpc_get_default_timeout(const td_rpc_agent *a) {
  return a ? __atomic_load_n(&a->default_timeout_ms, __ATOMIC_RELAXED) : 0;
}

static const char *peer_name(td_rpc_agent *a, int rank) {
  if (rank >= 0 && rank < a->world && a->peers && a->peers[rank].info.name[0])
    return a->peers[rank].info.name;
  return "?";
}

/* ---- pending table (a->mu held) ---- */

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
  td__free(p);
}

/* Completes a finished call's future off the poller thread when it has callbacks. */
typedef struct completion {
  pending *p;
  int kind;
  td_value *value;
  td_status status;
  char *message;
} completion;

static void complete_now(completion *c) {
  if (c->kind == TD__MSG_RESPONSE) {
    td_future_complete(c->p->fut, c->value);
  } else {
    td__future_fail_msg(c->p->fut, c->status, c->message);
  }
  pending_free(c->p);
  td__free(c->message);
  td__free(c);
}

static void complete_task(void *arg) { complete_now(arg); }

static void finish_call(td_rpc_agent *a, pending *p, int kind, td_value *value, td_status st,
                        const char *message) {
  completion *c = td__calloc(1, sizeof *c);
  if (!c) {
    td_value_unref(value);
    td__future_fail_msg(p->fut, TD_ERR_NOMEM, "rpc: out of memory completing a call");
    pending_free(p);
  } else {
    c->p = p;
    c->kind = kind;
    c->value = value;
    c->status = st;
    c->message = td__strdup(message ? message : "");
    if (td__future_has_callbacks(p->fut) && td__threadpool_submit(a->pool, complete_task, c) == TD_OK) {
      /* runs on the pool */
    } else {
      complete_now(c);
    }
  }
  __atomic_sub_fetch(&a->pending_out, 1, __ATOMIC_ACQ_REL);
}

/* ---- replies ---- */

typedef struct request {
  td_rpc_agent *a;
  td__conn *conn;  /* NULL: a call to self */
  td__msg msg;
  char caller[128];
} request;

static void deliver_response(td_rpc_agent *a, uint64_t id, int kind, td_value *value,
                             td_status st, const char *message);

/* Returns TD_OK when the transport accepted the frame. */
static td_status send_frame_or_log(td_rpc_agent *a, td__conn *c, td__msg *m) {
  int peer = td__conn_peer(c);
  bool known = peer >= 0 && peer < a->world;
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
    deliver_response(a, r->msg.id, kind, value, st, message);
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
      const td__rpc_middleware *mw = mw_get();
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
  td__free(r);
}

static void reply_error(request *r, td_status st, const char *fmt, ...) TD_PRINTF(3, 4);
static void reply_error(request *r, td_status st, const char *fmt, ...) {
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
    reply_error(r, st, "'%s' failed: %s", r->msg.fn, td_future_message(f));
  }
  td_future_unref(f);
}

static void run_request(void *arg) {
  request *r = arg;
  td_rpc_agent *a = r->a;
  td__reg reg;
  if (!reg_find(r->msg.fn, &reg)) {
    reply_error(r, TD_ERR_NOT_FOUND, "no function '%s' is registered here (called by %s (rank %d))",
                r->msg.fn, r->caller, r->msg.from_rank);
    return;
  }
  const td__rpc_middleware *mw = r->msg.ctx_id ? mw_get() : NULL;
  td__mw_scope scope = {0};
  if (mw) {
    td_status ms = mw->on_recv(a, r->msg.from_rank, &r->msg);
    if (ms != TD_OK) {
      reply_error(r, ms, "'%s': %s", r->msg.fn, td_last_error());
      return;
    }
    mw->enter(a, &r->msg, &scope);
  }
  td_rpc_ctx ctx = {a, r->msg.from_rank, r->caller, reg.user_data, r->msg.fn, r->msg.ctx_id};
  td_value *result = NULL;
  td_future *fut = NULL;
  td_clear_error();
  td_status st = reg.fn(&ctx, r->msg.values, r->msg.nvalues, &result, &fut);
  if (mw) mw->leave(&scope);
  if (st != TD_OK) {
    td_value_unref(result);
    td_future_unref(fut);
    const char *why = td_last_error();
    reply_error(r, st, "'%s' failed: %s", r->msg.fn, *why ? why : td_status_str(st));
    return;
  }
  if (fut) {
    td_value_unref(result);
    if (td_future_on_done(fut, async_done, r) != TD_OK) {
      td_future_unref(fut);
      reply_error(r, TD_ERR_INTERNAL, "'%s': cannot wait for its future", r->msg.fn);
    }
    return;
  }
  reply(r, TD__MSG_RESPONSE, result ? result : td_value_none(), TD_OK, NULL);
}

static void deliver_response(td_rpc_agent *a, uint64_t id, int kind, td_value *value,
                             td_status st, const char *message) {
  pthread_mutex_lock(&a->mu);
  pending *p = ptab_take(a, id);
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

/* ---- transport callbacks (poller thread) ---- */

static bool run_inline(const td__reg *reg, const td__msg *m) {
  if (reg->flags & TD_RPC_INLINE) return true;
  const char *target;
  td__reg treg;
  return (reg->flags & TD__RPC_INLINE_LIKE_ARG1) && m->nvalues >= 2 &&
         td_value_as_string(m->values[1], &target, NULL) == TD_OK && reg_find(target, &treg) &&
         (treg.flags & TD_RPC_INLINE);
}

static void on_msg(void *ud, td__conn *c, td__msg *m) {
  td_rpc_agent *a = ud;
  if (m->kind == TD__MSG_REQUEST) {
    if (td__conn_peer(c) < 0 && m->from_rank >= 0 && m->from_rank < a->world)
      td__conn_set_peer(c, m->from_rank);
    request *r = td__calloc(1, sizeof *r);
    if (!r) {
      td__msg_clear(m);
      return;
    }
    r->a = a;
    r->conn = td__conn_ref(c);
    r->msg = *m;
    memset(m, 0, sizeof *m);
    int from = r->msg.from_rank;
    snprintf(r->caller, sizeof r->caller, "%s",
             (from >= 0 && from < a->world) ? peer_name(a, from) : "unknown");
    __atomic_add_fetch(&a->active_in, 1, __ATOMIC_ACQ_REL);
    td__reg reg;
    if (reg_find(r->msg.fn, &reg) && run_inline(&reg, &r->msg)) {
      in_inline_handler = true;
      run_request(r);
      in_inline_handler = false;
      return;
    }
    if (td__threadpool_submit(a->pool, run_request, r) != TD_OK)
      reply_error(r, TD_ERR_STATE, "the agent is shutting down");
    return;
  }
  td_value *v = NULL;
  const td__rpc_middleware *mw = m->ctx_id ? mw_get() : NULL;
  if (mw && m->kind == TD__MSG_RESPONSE && mw->on_recv(a, td__conn_peer(c), m) != TD_OK) {
    char why[800];
    snprintf(why, sizeof why, "rpc: reply from %s (rank %d) rejected: %s",
             peer_name(a, td__conn_peer(c)), td__conn_peer(c), td_last_error());
    deliver_response(a, m->id, TD__MSG_ERROR, NULL, TD_ERR_FORMAT, why);
    td__msg_clear(m);
    return;
  }
  if (m->kind == TD__MSG_RESPONSE && m->nvalues == 1) {
    v = m->values[0];
    m->values[0] = NULL;
  }
  deliver_response(a, m->id, m->kind, v, m->status ? m->status : TD_ERR_REMOTE, m->message);
  td__msg_clear(m);
}

static void on_bad(void *ud, td__conn *c, uint64_t id, td_status st, const char *why) {
  td_rpc_agent *a = ud;
  char msg[700];
  if (td__conn_is_client(c)) {
    /* a reply we cannot decode, or whose tensors cannot be placed where the map says */
    snprintf(msg, sizeof msg, "rpc: %s reply from %s (rank %d): %s",
             st == TD_ERR_DEVICE ? "cannot accept the" : "malformed",
             peer_name(a, td__conn_peer(c)), td__conn_peer(c), why);
    deliver_response(a, id, TD__MSG_ERROR, NULL, st, msg);
    return;
  }
  td_log(TD_LOG_WARN, "rpc: %s: rejected a request (id %llu): %s", a->name,
         (unsigned long long)id, why);
  snprintf(msg, sizeof msg, "%s (rank %d): request rejected: %s", a->name, a->rank, why);
  td__msg em = {.id = id, .kind = TD__MSG_ERROR, .from_rank = a->rank, .status = st,
                .message = msg};
  /* answered: the caller counted it as sent, so the shutdown barrier must see it served */
  if (send_frame_or_log(a, c, &em) == TD_OK)
    __atomic_add_fetch(&a->served_total, 1, __ATOMIC_ACQ_REL);
}

static void on_closed(void *ud, td__conn *c, td_status st, const char *why) {
  td_rpc_agent *a = ud;
  /* shutdown accounting: the other end takes this stream's frames back out as well (or is gone) */
  int64_t frames = (int64_t)td__conn_frames_sent(c);
  if (!td__conn_is_client(c)) {
    __atomic_sub_fetch(&a->served_total, frames, __ATOMIC_ACQ_REL);
    return;
  }
  __atomic_sub_fetch(&a->sent_total, frames, __ATOMIC_ACQ_REL);
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
  snprintf(msg, sizeof msg, "rpc: %s (rank %d) is unreachable: %s", peer_name(a, peer), peer,
           why && *why ? why : "connection closed");
  if (k) td_log(TD_LOG_WARN, "%s (%zu calls failed)", msg, k);
  for (size_t i = 0; i < k; i++)
    finish_call(a, failed[i], TD__MSG_ERROR, NULL, st == TD_ERR_CANCELLED ? st : TD_ERR_UNAVAILABLE,
                msg);
  td__free(failed);
}

static void on_tick(void *ud) {
  td_rpc_agent *a = ud;
  uint64_t now = td__now_ns();
  pending *expired[64];
  int n = 0;
  pthread_mutex_lock(&a->mu);
  while (a->hlen && a->heap[0].deadline_ns <= now && n < 64) {
    uint64_t id = a->heap[0].id;
    a->heap[0] = a->heap[--a->hlen];
    heap_down(a->heap, a->hlen, 0);
    pending *p = ptab_take(a, id);
    if (p) expired[n++] = p;
  }
  heap_compact(a);
  pthread_mutex_unlock(&a->mu);
  for (int i = 0; i < n; i++) {
    char msg[400];
    snprintf(msg, sizeof msg, "rpc: call to '%s' on %s (rank %d) timed out after %lld ms",
             expired[i]->fn, peer_name(a, expired[i]->peer), expired[i]->peer,
             (long long)expired[i]->timeout_ms);
    finish_call(a, expired[i], TD__MSG_ERROR, NULL, TD_ERR_TIMEOUT, msg);
  }
}

static td_status on_unary(void *ud, const char *method, const uint8_t *req, size_t len,
                          uint8_t **reply_buf, size_t *reply_len) {
  td_rpc_agent *a = ud;
  if (strcmp(method, TD__STORE_METHOD) == 0 && a->store)
    return td__store_handle(a->store, req, len, reply_buf, reply_len);
  return td_set_error(TD_ERR_NOT_FOUND, "no method %s on %s", method, a->name);
}

/* ---- calls ---- */

static int rank_of(td_rpc_agent *a, const char *name) {
  for (int r = 0; r < a->world; r++)
    if (strcmp(a->peers[r].info.name, name) == 0) return r;
  return -1;
}

static bool peer_has_fn(peer_info *p, const char *fn) {
  int lo = 0, hi = p->nfns - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    int c = strcmp(p->fns[mid], fn);
    if (c == 0) return true;
    if (c < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return false;
}

/* Returns the stream to peer (new reference), opening it when needed. */
static td_status peer_conn(td_rpc_agent *a, int peer, td__conn **out) {
  pthread_mutex_lock(&a->mu);
  td__conn *c = a->peers[peer].conn;
  if (c && td__conn_closed(c)) {
    a->peers[peer].conn = NULL;
    td__conn_unref(c);
    c = NULL;
  }
  if (!c) {
    td_status st = td__transport_connect(a->tr, peer, a->peers[peer].info.address, &c);
    if (st != TD_OK) {
      pthread_mutex_unlock(&a->mu);
      return st;
    }
    a->peers[peer].conn = c;
  }
  *out = td__conn_ref(c);
  pthread_mutex_unlock(&a->mu);
  return TD_OK;
}

static td_status rpc_async(td_rpc_agent *a, const char *to, const char *fn,
                           td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                           bool reply_map, td_future **out);

td_status td_rpc_async(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                       int nargs, const td_rpc_call_opts *opts, td_future **out) {
  return rpc_async(a, to, fn, args, nargs, opts, false, out);
}

td_status td__rpc_async_reply_map(td_rpc_agent *a, const char *to, const char *fn,
                                  td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                                  td_future **out) {
  return rpc_async(a, to, fn, args, nargs, opts, true, out);
}

static td_status rpc_async(td_rpc_agent *a, const char *to, const char *fn,
                           td_value *const *args, int nargs, const td_rpc_call_opts *opts,
                           bool reply_map, td_future **out) {
  TD_CHECK_ARG(a && to && fn && out && nargs >= 0 && (args || nargs == 0),
               "rpc_async: invalid argument");
  if (__atomic_load_n(&a->closing, __ATOMIC_ACQUIRE))
    return td_set_error(TD_ERR_STATE, "rpc_async: the agent %s has shut down", a->name);
  int peer = rank_of(a, to);
  if (peer < 0)
    return td_set_error(TD_ERR_NOT_FOUND, "rpc_async: no worker named '%s' (this is %s)", to,
                        a->name);
  bool internal = fn[0] == '_' && fn[1] == '_';
  if (!internal && !peer_has_fn(&a->peers[peer], fn))
    return td_set_error(TD_ERR_NOT_FOUND, "rpc_async: function '%s' is not registered on %s "
                        "(rank %d) (called from %s (rank %d))", fn, to, peer, a->name, a->rank);
  for (int i = 0; i < nargs; i++)
    TD_CHECK_ARG(args[i], "rpc_async: argument %d is NULL", i);
  int64_t timeout = opts && opts->timeout_ms >= 0 ? opts->timeout_ms : td_rpc_get_default_timeout(a);
  td_future *f = td_future_create();
  pending *p = td__calloc(1, sizeof *p);
  if (!f || !p) {
    td_future_unref(f);
    td__free(p);
    return td_set_error(TD_ERR_NOMEM, "rpc_async: out of memory");
  }
  p->id = __atomic_add_fetch(&a->next_id, 1, __ATOMIC_RELAXED);
  p->fut = td_future_ref(f);
  p->peer = peer;
  p->timeout_ms = timeout;
  snprintf(p->fn, sizeof p->fn, "%s", fn);
  td__msg m = {0};
  m.id = p->id;
  m.kind = TD__MSG_REQUEST;
  m.fn = (char *)fn;
  m.from_rank = a->rank;
  m.values = (td_value **)args;
  m.nvalues = nargs;
  m.timeout_ms = timeout;
  td__frame frame = {0};
  td_status st = TD_OK;
  const td__rpc_middleware *mw = mw_get();
  if (mw && (st = mw->on_send(a, peer, &m)) != TD_OK) {
    td__free(m.aux);
    pending_free(p);
    td_future_unref(f);
    return st;
  }
  uint64_t ctx_id = m.ctx_id;
  if (peer != a->rank) {
    td__wire_ctx wctx = {a, peer, a->rank,
                         reply_map ? &a->peers[peer].reply_map : &a->peers[peer].out_map,
                         a->peers[peer].info.name};
    st = td__wire_encode(&m, &wctx, &frame);
    td__free(m.aux);
    m.aux = NULL;
    if (st == TD_OK) st = peer_conn(a, peer, &p->conn);
    if (st != TD_OK) {
      td__frame_clear(&frame);
      pending_free(p);
      td_future_unref(f);
      return st;
    }
  }
  __atomic_add_fetch(&a->pending_out, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
  /* once p is in the table, a timeout or a closing stream may complete and free it on the
   * poller at any moment: from here on only these copies are used */
  uint64_t id = p->id;
  td__conn *conn = td__conn_ref(p->conn);
  pthread_mutex_lock(&a->mu);
  bool in_tab = ptab_put(a, p);
  bool ok = in_tab;
  if (ok && timeout > 0) ok = heap_push(a, td__now_ns() + (uint64_t)timeout * 1000000ull, id);
  pthread_mutex_unlock(&a->mu);
  if (!ok) {
    /* out of memory: fail the future rather than lose track of it (p is ours unless it made it
     * into the table, where a closing stream may have taken it meanwhile) */
    pending *q = p;
    if (in_tab) {
      pthread_mutex_lock(&a->mu);
      q = ptab_take(a, id);
      pthread_mutex_unlock(&a->mu);
    }
    __atomic_sub_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
    td__frame_clear(&frame);
    if (q) finish_call(a, q, TD__MSG_ERROR, NULL, TD_ERR_NOMEM, "rpc: out of memory");
    td__conn_unref(conn);
    *out = f;
    return TD_OK;
  }
  if (peer == a->rank) {
    request *r = td__calloc(1, sizeof *r);
    char *fncopy = td__strdup(fn);
    td_value **vals = td__calloc((size_t)(nargs ? nargs : 1), sizeof *vals);
    if (!r || !fncopy || !vals) {
      td__free(r);
      td__free(fncopy);
      td__free(vals);
      deliver_response(a, id, TD__MSG_ERROR, NULL, TD_ERR_NOMEM, "rpc: out of memory");
    } else {
      for (int i = 0; i < nargs; i++) vals[i] = td_value_ref(args[i]);
      r->a = a;
      r->msg = (td__msg){.id = id, .kind = TD__MSG_REQUEST, .fn = fncopy, .from_rank = a->rank,
                         .values = vals, .nvalues = nargs, .timeout_ms = timeout,
                         .ctx_id = ctx_id};
      snprintf(r->caller, sizeof r->caller, "%s", a->name);
      __atomic_add_fetch(&a->active_in, 1, __ATOMIC_ACQ_REL);
      if (td__threadpool_submit(a->pool, run_request, r) != TD_OK)
        reply_error(r, TD_ERR_STATE, "the agent is shutting down");
    }
  } else {
    st = td__conn_send(conn, &frame);
    if (st != TD_OK) {
      /* nothing left this process: the peer will never serve it */
      __atomic_sub_fetch(&a->sent_total, 1, __ATOMIC_ACQ_REL);
      char msg[600];
      snprintf(msg, sizeof msg, "rpc: cannot send '%s' to %s (rank %d): %s", fn, to, peer,
               td_last_error());
      deliver_response(a, id, TD__MSG_ERROR, NULL, st, msg);
    }
  }
  td__conn_unref(conn);
  *out = f;
  return TD_OK;
}

td_status td_rpc_sync(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                      int nargs, const td_rpc_call_opts *opts, td_value **result) {
  TD_CHECK_ARG(result, "rpc_sync: NULL result");
  if (in_inline_handler)
    return td_set_error(TD_ERR_STATE, "rpc_sync: blocking call from a TD_RPC_INLINE function "
                        "(use td_rpc_async and return its future)");
  td_future *f;
  TD_TRY(td_rpc_async(a, to, fn, args, nargs, opts, &f));
  td_status st = td_future_wait(f, -1);
  if (st == TD_OK) {
    td_value *v = td_future_value(f);
    *result = v ? td_value_ref(v) : td_value_none();
  } else {
    td_set_error(st, "%s", td_future_message(f));
  }
  td_future_unref(f);
  return st;
}

/* ---- worker info ---- */

td_status td_rpc_get_worker_info(td_rpc_agent *a, const char *name, td_worker_info *out) {
  TD_CHECK_ARG(a && name && out, "rpc_get_worker_info: NULL argument");
  int r = rank_of(a, name);
  if (r < 0) return td_set_error(TD_ERR_NOT_FOUND, "rpc: no worker named '%s'", name);
  *out = a->peers[r].info;
  return TD_OK;
}

td_status td_rpc_get_worker_info_by_rank(td_rpc_agent *a, int rank, td_worker_info *out) {
  TD_CHECK_ARG(a && out, "rpc_get_worker_info_by_rank: NULL argument");
  if (rank < 0 || rank >= a->world)
    return td_set_error(TD_ERR_NOT_FOUND, "rpc: no worker with rank %d (world size %d)", rank,
                        a->world);
  *out = a->peers[rank].info;
  return TD_OK;
}

td_status td_rpc_self(td_rpc_agent *a, td_worker_info *out) {
  return td_rpc_get_worker_info_by_rank(a, a ? a->rank : -1, out);
}

td_rpc_agent *td_rpc_ctx_agent(const td_rpc_ctx *c) { return c->agent; }
const char *td_rpc_ctx_caller_name(const td_rpc_ctx *c) { return c->caller_name; }
int td_rpc_ctx_caller_rank(const td_rpc_ctx *c) { return c->caller_rank; }
void *td_rpc_ctx_user_data(const td_rpc_ctx *c) { return c->user_data; }

/* ---- rendezvous ---- */

static bool valid_name(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= sizeof(((td_worker_info *)0)->name)) return false;
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (!isalnum(ch) && ch != '_' && ch != '-' && ch != '.' && ch != ':') return false;
  }
  return true;
}

/* Store operations from rank 0 go straight to its own map. */
static td_status st_set(td_rpc_agent *a, const char *key, const void *v, size_t n) {
  return td__store_set(&a->sc, key, v, n);
}

static td_status st_add(td_rpc_agent *a, const char *key, int64_t d, int64_t *out) {
  return td__store_add(&a->sc, key, d, out);
}

static td_status st_get(td_rpc_agent *a, const char *key, uint8_t **v, size_t *n, bool *found) {
  return td__store_get(&a->sc, key, v, n, found);
}

static void set_abort(td_rpc_agent *a, const char *why) {
  st_set(a, "abort", why, strlen(why));
}

static td_status parse_peers(td_rpc_agent *a, uint64_t deadline) {
  for (int r = 0; r < a->world; r++) {
    char key[64];
    uint8_t *v = NULL;
    size_t n = 0;
    snprintf(key, sizeof key, "worker/%d", r);
    TD_TRY(td__store_wait_key(&a->sc, key, deadline, "abort", &v, &n));
    /* "name\taddress" */
    char *tab = strchr((char *)v, '\t');
    if (!tab) {
      td__free(v);
      return td_set_error(TD_ERR_FORMAT, "rpc init: bad worker record for rank %d", r);
    }
    *tab = 0;
    snprintf(a->peers[r].info.name, sizeof a->peers[r].info.name, "%s", (char *)v);
    snprintf(a->peers[r].info.address, sizeof a->peers[r].info.address, "%s", tab + 1);
    a->peers[r].info.id = r;
    td__free(v);
    snprintf(key, sizeof key, "registry/%d", r);
    TD_TRY(td__store_wait_key(&a->sc, key, deadline, "abort", &v, &n));
    a->peers[r].fns_blob = (char *)v;
    int cnt = 0;
    for (size_t i = 0; i < n; i++) cnt += v[i] == '\n';
    a->peers[r].fns = td__calloc((size_t)(cnt ? cnt : 1), sizeof(char *));
    if (!a->peers[r].fns) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
    char *p = (char *)v;
    for (int i = 0; i < cnt; i++) {
      char *nl = strchr(p, '\n');
      *nl = 0;
      a->peers[r].fns[i] = p;
      p = nl + 1;
    }
    a->peers[r].nfns = cnt;
  }
  for (int r = 0; r < a->world; r++)
    for (int q = r + 1; q < a->world; q++)
      if (strcmp(a->peers[r].info.name, a->peers[q].info.name) == 0)
        return td_set_error(TD_ERR_EXISTS, "rpc init: ranks %d and %d both use the name '%s'", r,
                            q, a->peers[r].info.name);
  /* compare registries with ours */
  peer_info *me = &a->peers[a->rank];
  for (int r = 0; r < a->world; r++) {
    if (r == a->rank) continue;
    peer_info *p = &a->peers[r];
    for (int i = 0; i < me->nfns; i++)
      if (!peer_has_fn(p, me->fns[i]))
        td_log(TD_LOG_WARN, "rpc: %s (rank %d) has no function '%s' (registered on %s)",
               p->info.name, r, me->fns[i], a->name);
  }
  return TD_OK;
}

static void host_part(const char *addr, char *out, size_t n);

/* ---- same-host direct copy ----
 * A receiver copies large tensors straight out of the sender's memory (process_vm_readv) when
 * both run on one host: one copy instead of socket write + read + decode copy. At init every
 * worker publishes direct/<r> = "pid nonce address boot-id host" ("-" when disabled); each probes
 * the peers on its host (same advertised host and boot id) by reading their nonce from their
 * memory, accepts direct-copy frames from those it could read, and publishes directok/<r> (one
 * '0'/'1' per rank); after the ready barrier each learns which peers can read it. Reading
 * another process's memory needs the same user and no ptrace restriction (Yama scope 0 or 1 for
 * siblings does not suffice; see docs/ARCHITECTURE.md): where the probe fails the peer simply
 * gets the stream. */

static void boot_id(char *out, size_t n) {
  snprintf(out, n, "-");
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (fgets(out, (int)n, f)) out[strcspn(out, "\r\n")] = 0;
  fclose(f);
  if (!out[0]) snprintf(out, n, "-");
}

static bool direct_wanted(const td_rpc_options *o) {
#if defined(__linux__)
  if (o->direct_copy == 0) return false;
  if (o->direct_copy > 0) return true;
  const char *e = getenv("TD_RPC_DIRECT_COPY");
  return !(e && strcmp(e, "0") == 0);
#else
  (void)o;
  return false;
#endif
}

static td_status direct_publish(td_rpc_agent *a) {
  char key[64], val[512], bid[64];
  boot_id(bid, sizeof bid);
  a->direct_on = a->direct_on && strcmp(bid, "-") != 0;
  int n;
  snprintf(key, sizeof key, "direct/%d", a->rank);
  if (a->direct_on) {
    a->direct_nonce = td__now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)a;
    char host[256];
    host_part(a->peers[a->rank].info.address, host, sizeof host);
    n = snprintf(val, sizeof val, "%d %llu %llu %s %s", (int)getpid(),
                 (unsigned long long)a->direct_nonce,
                 (unsigned long long)(uintptr_t)&a->direct_nonce, bid, host);
  } else {
    n = snprintf(val, sizeof val, "-");
  }
  return st_set(a, key, val, (size_t)n);
}

static bool probe_peer(int pid, uint64_t addr, uint64_t nonce) {
#if defined(__linux__)
  uint64_t got = 0;
  struct iovec l = {&got, sizeof got}, r = {(void *)(uintptr_t)addr, sizeof got};
  return process_vm_readv(pid, &l, 1, &r, 1, 0) == (ssize_t)sizeof got && got == nonce;
#else
  (void)pid; (void)addr; (void)nonce;
  return false;
#endif
}

static td_status direct_probe(td_rpc_agent *a, uint64_t deadline) {
  a->direct_cand = td__calloc((size_t)a->world, sizeof *a->direct_cand);
  int *pids = td__calloc((size_t)a->world, sizeof *pids);
  char *ok = td__malloc((size_t)a->world + 1);
  if (!a->direct_cand || !pids || !ok) {
    td__free(pids);
    td__free(ok);
    return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  }
  memset(ok, '0', (size_t)a->world);
  ok[a->world] = 0;
  int npids = 0;
  char bid[64], host[256];
  boot_id(bid, sizeof bid);
  host_part(a->peers[a->rank].info.address, host, sizeof host);
  td_status st = TD_OK;
  for (int r = 0; a->direct_on && r < a->world && st == TD_OK; r++) {
    if (r == a->rank) continue;
    char key[64];
    uint8_t *v = NULL;
    snprintf(key, sizeof key, "direct/%d", r);
    st = td__store_wait_key(&a->sc, key, deadline, "abort", &v, NULL);
    if (st != TD_OK) break;
    int pid;
    unsigned long long nonce, addr;
    char pbid[64], phost[256];
    if (sscanf((char *)v, "%d %llu %llu %63s %255s", &pid, &nonce, &addr, pbid, phost) == 5 &&
        strcmp(pbid, bid) == 0 && strcmp(phost, host) == 0 && probe_peer(pid, addr, nonce)) {
      a->direct_cand[r] = true;
      ok[r] = '1';
      pids[npids++] = pid;
    }
    td__free(v);
  }
  if (st == TD_OK) st = td__transport_allow_direct(a->tr, pids, npids);
  if (st == TD_OK) {
    char key[64];
    snprintf(key, sizeof key, "directok/%d", a->rank);
    st = st_set(a, key, ok, (size_t)a->world);
  }
  td__free(pids);
  td__free(ok);
  return st;
}

/* After the ready barrier: which peers read us directly (they published before it). */
static td_status direct_learn(td_rpc_agent *a, uint64_t deadline) {
  bool *to = td__calloc((size_t)a->world, sizeof *to);
  if (!to) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  td_status st = TD_OK;
  for (int r = 0; r < a->world && st == TD_OK; r++) {
    if (r == a->rank || !a->direct_cand[r]) continue;
    char key[64];
    uint8_t *v = NULL;
    size_t n = 0;
    snprintf(key, sizeof key, "directok/%d", r);
    st = td__store_wait_key(&a->sc, key, deadline, "abort", &v, &n);
    if (st == TD_OK && n > (size_t)a->rank && v[a->rank] == '1') {
      to[r] = true;
      a->direct_peers++;
    }
    td__free(v);
  }
  if (st == TD_OK && a->direct_peers) st = td__transport_direct_to(a->tr, to, a->world);
  td__free(to);
  if (st == TD_OK && a->direct_peers)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d peers on this host copy tensors directly", a->name,
           a->direct_peers);
  return st;
}

/* ---- device maps ----
 * Every worker publishes devmap/<r> = "<its CUDA device count>\n" followed by one line
 * "worker\tfrom\tto\n" per entry of its td_rpc_options.device_maps, as given (NULL strings become
 * "", tabs and newlines '?'). After the join barrier every worker reads every record and checks
 * all maps in rank order and entry order, so all of them find the same first error and fail with
 * the same message. Each then keeps its own map toward every peer (for its requests) and the
 * inverse of every peer's map toward itself (for its replies to that peer). */

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *q = td__realloc(b->p, cap);
    if (!q) {
      b->oom = true;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

/* Appends s (NULL: "") with tabs and newlines replaced, then end. */
static void sb_field(sbuf *b, const char *s, char end) {
  for (const char *q = s ? s : ""; *q; q++) sb_put(b, *q == '\t' || *q == '\n' ? "?" : q, 1);
  sb_put(b, &end, 1);
}

static td_status devmap_publish(td_rpc_agent *a) {
  sbuf b = {0};
  char head[32];
  int n = snprintf(head, sizeof head, "%d\n", td_cuda_device_count());
  sb_put(&b, head, (size_t)n);
  for (int i = 0; i < a->opts.num_device_maps; i++) {
    const td_rpc_device_map_entry *e = &a->opts.device_maps[i];
    sb_field(&b, e->worker, '\t');
    sb_field(&b, e->from, '\t');
    sb_field(&b, e->to, '\n');
  }
  if (b.oom) {
    td__free(b.p);
    return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  }
  char key[64];
  snprintf(key, sizeof key, "devmap/%d", a->rank);
  td_status st = st_set(a, key, b.p, b.n);
  td__free(b.p);
  return st;
}

static td_status devmap_add(td__devmap *m, td_device from, td_device to) {
  td__devmap_entry *e = td__realloc(m->e, (size_t)(m->n + 1) * sizeof *e);
  if (!e) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  m->e = e;
  m->e[m->n++] = (td__devmap_entry){from, to};
  return TD_OK;
}

/* Checks one entry of rank q's map (line `line`, entry number i) and adds it to maps[dest].
 * counts: every rank's CUDA device count. */
static td_status devmap_entry(td_rpc_agent *a, int q, int i, char *line, const int *counts,
                              td__devmap *maps) {
  char *from = strchr(line, '\t'), *to = from ? strchr(from + 1, '\t') : NULL;
  if (!from || !to)
    return td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", q);
  *from++ = 0;
  *to++ = 0;
  const char *worker = line, *qn = a->peers[q].info.name;
  char where[700];
  snprintf(where, sizeof where, "rpc init: device map of %s (rank %d), entry %d {\"%.128s\", "
           "\"%.64s\", \"%.64s\"}", qn, q, i, worker, from, to);
  int dest = rank_of(a, worker);
  if (dest < 0)
    return td_set_error(TD_ERR_INVALID, "%s: there is no worker named '%.128s'", where, worker);
  if (dest == q)
    return td_set_error(TD_ERR_INVALID, "%s: a worker cannot map devices to itself (calls to "
                        "self share their tensors)", where);
  const char *dn = a->peers[dest].info.name;
  td_device f, t;
  if (td_device_parse(from, &f) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "%s: local device '%.64s' is malformed (use cpu, cuda or "
                        "cuda:N)", where, from);
  if (td_device_parse(to, &t) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "%s: remote device '%.64s' is malformed (use cpu, cuda or "
                        "cuda:N)", where, to);
  /* the map's shape first (it does not depend on the machines), then whether the devices exist */
  td__devmap *m = &maps[dest];
  char b1[32], b2[32], b3[32];
  for (int k = 0; k < m->n; k++) {
    bool same_from = td_device_equal(m->e[k].from, f), same_to = td_device_equal(m->e[k].to, t);
    if (same_from && same_to) return TD_OK; /* given twice */
    if (same_from)
      return td_set_error(TD_ERR_INVALID, "%s: %s is already mapped to %s on %s", where,
                          td_device_str(f, b1, sizeof b1),
                          td_device_str(m->e[k].to, b2, sizeof b2), dn);
    if (same_to)
      return td_set_error(TD_ERR_INVALID, "%s: %s and %s both map to %s on %s, so replies from %s "
                          "could not be mapped back", where,
                          td_device_str(m->e[k].from, b1, sizeof b1),
                          td_device_str(f, b2, sizeof b2), td_device_str(t, b3, sizeof b3), dn,
                          dn);
  }
  if (f.type == TD_DEVICE_CUDA && f.index >= counts[q])
    return td_set_error(TD_ERR_DEVICE, "%s: local device cuda:%d does not exist on %s (it has %d "
                        "CUDA devices)", where, f.index, qn, counts[q]);
  if (t.type == TD_DEVICE_CUDA && t.index >= counts[dest])
    return td_set_error(TD_ERR_DEVICE, "%s: remote device cuda:%d does not exist on %s (it has %d "
                        "CUDA devices)", where, t.index, dn, counts[dest]);
  return devmap_add(m, f, t);
}

/* Reads every worker's record, checks every map, keeps this worker's maps (see above). */
static td_status devmap_setup(td_rpc_agent *a, uint64_t deadline) {
  int w = a->world;
  char **recs = td__calloc((size_t)w, sizeof *recs);
  int *counts = td__calloc((size_t)w, sizeof *counts);
  td__devmap *maps = td__calloc((size_t)w, sizeof *maps);
  td_status st = recs && counts && maps ? TD_OK : td_set_error(TD_ERR_NOMEM, "rpc init: out of "
                                                                 "memory");
  for (int r = 0; r < w && st == TD_OK; r++) {
    char key[64];
    uint8_t *v = NULL;
    snprintf(key, sizeof key, "devmap/%d", r);
    st = td__store_wait_key(&a->sc, key, deadline, "abort", &v, NULL);
    if (st != TD_OK) break;
    recs[r] = (char *)v;
    char *end;
    long c = strtol(recs[r], &end, 10);
    if (*end != '\n' || c < 0 || c > TD__MAX_CUDA_INDEX + 1) {
      st = td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", r);
      break;
    }
    counts[r] = (int)c;
  }
  for (int q = 0; q < w && st == TD_OK; q++) {
    char *line = strchr(recs[q], '\n') + 1;
    for (int i = 0; *line && st == TD_OK; i++) {
      char *nl = strchr(line, '\n');
      if (!nl) {
        st = td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", q);
        break;
      }
      *nl = 0;
      st = devmap_entry(a, q, i, line, counts, maps);
      line = nl + 1;
    }
    for (int r = 0; r < w; r++) {
      if (st == TD_OK && q == a->rank) {
        a->peers[r].out_map = maps[r]; /* moved */
      } else if (st == TD_OK && r == a->rank) {
        td__devmap *rm = &a->peers[q].reply_map;
        for (int k = 0; k < maps[r].n && st == TD_OK; k++)
          st = devmap_add(rm, maps[r].e[k].to, maps[r].e[k].from);
        td__free(maps[r].e);
      } else {
        td__free(maps[r].e);
      }
      maps[r] = (td__devmap){0};
    }
  }
  for (int r = 0; recs && r < w; r++) td__free(recs[r]);
  td__free(recs);
  td__free(counts);
  td__free(maps);
  if (st == TD_OK && a->opts.num_device_maps)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d device map entries checked", a->name,
           a->opts.num_device_maps);
  return st;
}

static td_status rendezvous(td_rpc_agent *a) {
  uint64_t deadline = td__now_ns() + (uint64_t)a->opts.init_timeout_ms * 1000000ull;
  char key[64], val[512];
  int64_t claims;
  /* world size must match rank 0's */
  uint8_t *ws = NULL;
  TD_TRY(td__store_wait_key(&a->sc, "world_size", deadline, "abort", &ws, NULL));
  long master_ws = strtol((char *)ws, NULL, 10);
  td__free(ws);
  if (master_ws != a->world) {
    snprintf(val, sizeof val, "rpc init: rank %d was started with world size %d but rank 0 with %ld",
             a->rank, a->world, master_ws);
    set_abort(a, val);
    return td_set_error(TD_ERR_INVALID, "%s", val);
  }
  snprintf(key, sizeof key, "claim/%d", a->rank);
  TD_TRY(st_add(a, key, 1, &claims));
  if (claims != 1) {
    snprintf(val, sizeof val, "rpc init: two workers claim rank %d", a->rank);
    set_abort(a, val);
    return td_set_error(TD_ERR_EXISTS, "%s", val);
  }
  td_worker_info *self = &a->peers[a->rank].info;
  snprintf(key, sizeof key, "worker/%d", a->rank);
  int n = snprintf(val, sizeof val, "%s\t%s", a->name, self->address);
  TD_TRY(st_set(a, key, val, (size_t)n));
  char *snap = reg_snapshot();
  if (!snap) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  snprintf(key, sizeof key, "registry/%d", a->rank);
  td_status st = st_set(a, key, snap, strlen(snap));
  td__free(snap);
  TD_TRY(st);
  TD_TRY(direct_publish(a));
  TD_TRY(devmap_publish(a));
  int64_t joined;
  TD_TRY(st_add(a, "joined", 1, &joined));
  st = td__store_wait_ge(&a->sc, "joined", a->world, deadline, "abort");
  if (st == TD_ERR_TIMEOUT) {
    int64_t now_joined = 0;
    st_add(a, "joined", 0, &now_joined);
    return td_set_error(TD_ERR_TIMEOUT, "rpc init: only %lld of %d workers joined within %lld ms",
                        (long long)now_joined, a->world, (long long)a->opts.init_timeout_ms);
  }
  TD_TRY(st);
  st = parse_peers(a, deadline);
  if (st != TD_OK) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    if (st == TD_ERR_EXISTS) set_abort(a, msg);
    return td_set_error(st, "%s", msg);
  }
  TD_TRY(devmap_setup(a, deadline));
  TD_TRY(direct_probe(a, deadline));
  /* everybody has read everything before anybody proceeds (rank 0 may be asked right away) */
  TD_TRY(st_add(a, "ready", 1, NULL));
  TD_TRY(td__store_wait_ge(&a->sc, "ready", a->world, deadline, "abort"));
  TD_TRY(direct_learn(a, deadline));
  /* rank 0 returns only when everybody is past the barrier, so it cannot take the store away
   * (by shutting down right after init) while someone still polls it */
  TD_TRY(st_add(a, "passed", 1, NULL));
  if (a->rank == 0) TD_TRY(td__store_wait_ge(&a->sc, "passed", a->world, deadline, "abort"));
  return TD_OK;
}

/* host_part copies the host of "host:port" or "[v6]:port" into out. */
static void host_part(const char *addr, char *out, size_t n) {
  const char *b = addr, *e;
  if (*b == '[') {
    b++;
    e = strchr(b, ']');
  } else {
    e = strrchr(b, ':');
  }
  size_t len = e ? (size_t)(e - b) : strlen(b);
  if (len >= n) len = n - 1;
  memcpy(out, b, len);
  out[len] = 0;
}

/* busy_poll_window resolves td_rpc_options.busy_poll_us once every worker's address is known:
 * spinning pays off only when every local worker can have a CPU of its own. */
static int64_t busy_poll_window(td_rpc_agent *a, int64_t opt) {
  if (opt >= 0) return opt;
  const char *env = getenv("TD_RPC_BUSY_POLL_US");
  if (env && *env) {
    char *end;
    long long v = strtoll(env, &end, 10);
    if (*end == 0 && v >= 0) return v;
    td_log(TD_LOG_WARN, "rpc: ignoring TD_RPC_BUSY_POLL_US='%s' (not a number of microseconds)",
           env);
  }
  char mine[256], other[256];
  host_part(a->peers[a->rank].info.address, mine, sizeof mine);
  int local = 0;
  for (int i = 0; i < a->world; i++) {
    host_part(a->peers[i].info.address, other, sizeof other);
    if (strcmp(mine, other) == 0) local++;
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int64_t us = cpus > 1 && local <= cpus ? 50 : 0;
  td_log(TD_LOG_DEBUG, "rpc: %s: %d workers on this host, %ld CPUs: busy-poll %lld us", a->name,
         local, cpus, (long long)us);
  return us;
}

static void agent_free(td_rpc_agent *a) {
  if (!a) return;
  if (a->peers) {
    for (int r = 0; r < a->world; r++) {
      td__conn_unref(a->peers[r].conn);
      td__free(a->peers[r].fns);
      td__free(a->peers[r].fns_blob);
    }
  }
  if (a->peers) {
    for (int r = 0; r < a->world; r++) {
      td__free(a->peers[r].out_map.e);
      td__free(a->peers[r].reply_map.e);
    }
  }
  td__free(a->peers);
  td__free(a->direct_cand);
  for (size_t i = 0; i < a->pcap; i++)
    if (a->ptab[i]) pending_free(a->ptab[i]);
  td__free(a->ptab);
  td__free(a->heap);
  td__store_destroy(a->store);
  td__free(a->listen_addr);
  td__free(a->init_method);
  pthread_mutex_destroy(&a->mu);
  td__free(a);
}

static td_status parse_master(const char *init_method, char *host, size_t hn, int *port) {
  const char *s = init_method;
  if (strncmp(s, "tcp://", 6) != 0)
    return td_set_error(TD_ERR_INVALID, "rpc init: init_method '%s' must look like tcp://host:port",
                        init_method);
  s += 6;
  const char *colon = strrchr(s, ':');
  if (!colon || colon == s)
    return td_set_error(TD_ERR_INVALID, "rpc init: init_method '%s' has no port", init_method);
  char *end;
  long p = strtol(colon + 1, &end, 10);
  /* port 0 lets a single-worker group (world size 1) pick any free port */
  if (*end || p < 0 || p > 65535)
    return td_set_error(TD_ERR_INVALID, "rpc init: bad port in init_method '%s'", init_method);
  size_t l = (size_t)(colon - s);
  if (s[0] == '[' && l >= 2 && s[l - 1] == ']') {
    s++;
    l -= 2;
  }
  if (l >= hn) return td_set_error(TD_ERR_INVALID, "rpc init: host name too long");
  memcpy(host, s, l);
  host[l] = 0;
  *port = (int)p;
  return TD_OK;
}

td_status td__rpc_init_impl(const char *name, int rank, int world_size,
                            const td_rpc_options *opts, td_rpc_agent **out) {
  TD_CHECK_ARG(out, "rpc_init: NULL out");
  if (world_size < 1) return td_set_error(TD_ERR_INVALID, "rpc_init: world size %d < 1", world_size);
  if (rank < 0 || rank >= world_size)
    return td_set_error(TD_ERR_INVALID, "rpc_init: rank %d outside [0, %d)", rank, world_size);
  td_rpc_options o;
  if (opts) o = *opts;
  else td_rpc_options_init(&o);
  if (o.num_device_maps < 0 || (o.num_device_maps > 0 && !o.device_maps))
    return td_set_error(TD_ERR_INVALID, "rpc_init: %d device map entries at %p",
                        o.num_device_maps, (const void *)o.device_maps);
  if (o.num_worker_threads <= 0) o.num_worker_threads = 16;
  if (o.init_timeout_ms <= 0) o.init_timeout_ms = 120000;
  if (o.keepalive_ms <= 0) o.keepalive_ms = 2000;
  if (o.keepalive_timeout_ms <= 0) o.keepalive_timeout_ms = 20000;
  char defname[32];
  if (!name) {
    snprintf(defname, sizeof defname, "worker%d", rank);
    name = defname;
  }
  if (!valid_name(name))
    return td_set_error(TD_ERR_INVALID, "rpc_init: invalid worker name '%s' (use 1-127 letters, "
                        "digits, '_', '-', '.', ':')", name);
  char mhost[256];
  int mport = 0;
  if (!o.init_method)
    return td_set_error(TD_ERR_INVALID, "rpc_init: no init_method (tcp://host:port) given");
  TD_TRY(parse_master(o.init_method, mhost, sizeof mhost, &mport));
  char chosen[128];
  if (!o.listen_addr) { /* TD_SOCKET_IFNAME, else the route toward the master, else loopback */
    TD_TRY(td__choose_address(mhost, getenv("TD_SOCKET_IFNAME"), chosen, sizeof chosen));
    o.listen_addr = chosen;
  }
  if (mport == 0 && world_size > 1)
    return td_set_error(TD_ERR_INVALID, "rpc_init: port 0 in init_method works only for a world "
                        "of one worker (the others could not find rank 0)");

  td_rpc_agent *a = td__calloc(1, sizeof *a);
  if (!a) return td_set_error(TD_ERR_NOMEM, "rpc_init: out of memory");
  pthread_mutex_init(&a->mu, NULL);
  a->listen_addr = td__strdup(o.listen_addr);
  a->init_method = td__strdup(o.init_method);
  o.listen_addr = a->listen_addr;
  o.init_method = a->init_method;
  a->opts = o;
  a->direct_on = direct_wanted(&o);
  snprintf(a->name, sizeof a->name, "%s", name);
  a->rank = rank;
  a->world = world_size;
  a->default_timeout_ms = o.rpc_timeout_ms < 0 ? 0 : o.rpc_timeout_ms;
  a->peers = td__calloc((size_t)world_size, sizeof *a->peers);
  td_status st = TD_OK;
  if (!a->listen_addr || !a->init_method || !a->peers) {
    st = td_set_error(TD_ERR_NOMEM, "rpc_init: out of memory");
    goto fail;
  }
  if (rank == 0) {
    st = td__store_create(&a->store);
    if (st != TD_OK) goto fail;
    char ws[32];
    int n = snprintf(ws, sizeof ws, "%d", world_size);
    /* seed the store before anybody can reach it */
    st = td__store_local_set(a->store, "world_size", ws, (size_t)n);
    if (st != TD_OK) goto fail;
  }
  st = td__threadpool_create(o.num_worker_threads, "td-rpc", &a->pool);
  if (st != TD_OK) goto fail;
  td__transport_opts to = {.host = a->listen_addr,
                           .port = rank == 0 ? mport : 0,
                           .keepalive_ms = o.keepalive_ms,
                           .keepalive_timeout_ms = o.keepalive_timeout_ms,
                           .max_message = o.max_message_bytes,
                           .self_rank = rank,
                           .agent = a,
                           .tick_ms = 10};
  td__transport_cbs cbs = {a, on_msg, on_bad, on_closed, on_unary, on_tick};
  int port = 0;
  st = td__transport_create(&to, &cbs, &a->tr, &port);
  if (st != TD_OK) {
    if (rank == 0) {
      char why[600];
      snprintf(why, sizeof why, "%s", td_last_error());
      td_set_error(st, "rpc_init: rank 0 cannot serve the rendezvous store on %s:%d: %s",
                   a->listen_addr, mport, why);
    }
    goto fail;
  }
  bool v6 = strchr(mhost, ':') != NULL;
  snprintf(a->sc.address, sizeof a->sc.address, v6 ? "[%s]:%d" : "%s:%d", mhost, mport);
  if (rank == 0) {
    v6 = strchr(a->listen_addr, ':') != NULL;
    snprintf(a->sc.address, sizeof a->sc.address, v6 ? "[%s]:%d" : "%s:%d", a->listen_addr, port);
  }
  a->sc.tr = a->tr;
  a->sc.call_timeout_ms = o.init_timeout_ms;
  a->sc.wait_for_ready = true;
  v6 = strchr(a->listen_addr, ':') != NULL;
  snprintf(a->peers[rank].info.address, sizeof a->peers[rank].info.address,
           v6 ? "[%s]:%d" : "%s:%d", a->listen_addr, port);
  st = rendezvous(a);
  if (st != TD_OK) {
    /* let the others read why before rank 0 takes the store away (bounded) */
    char why[1024];
    snprintf(why, sizeof why, "%s", td_last_error());
    a->sc.call_timeout_ms = 1000;
    if (st != TD_ERR_TIMEOUT) set_abort(a, why);
    int64_t acks = 0, joined = 0;
    st_add(a, "failed", 1, &acks);
    if (rank == 0 && st_add(a, "joined", 0, &joined) == TD_OK)
      td__store_wait_ge(&a->sc, "failed", joined, td__now_ns() + 2000000000ull, NULL);
    td_set_error(st, "%s", why);
    goto fail;
  }
  a->opts.device_maps = NULL; /* borrowed: read at init only */
  a->opts.num_device_maps = 0;
  a->sc.call_timeout_ms = 10000;
  a->sc.wait_for_ready = false; /* from now on a missing rank 0 is a failure, not a late start */
  a->busy_poll_us = busy_poll_window(a, o.busy_poll_us);
  td__transport_set_busy_poll(a->tr, a->busy_poll_us);
  pthread_mutex_lock(&hooks_mu);
  int nh = nhooks;
  td__agent_hooks hs[8];
  memcpy(hs, hooks, sizeof hs);
  pthread_mutex_unlock(&hooks_mu);
  for (int i = 0; i < nh; i++)
    if (hs[i].on_init) hs[i].on_init(a);
  td_log(TD_LOG_INFO, "rpc: %s (rank %d of %d) listening on %s", a->name, rank, world_size,
         a->peers[rank].info.address);
  *out = a;
  return TD_OK;
fail:;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", td_last_error());
  if (a->tr) {
    td__transport_shutdown(a->tr);
  }
  td__threadpool_destroy(a->pool);
  a->pool = NULL;
  td__transport_destroy(a->tr);
  a->tr = NULL;
  agent_free(a);
  return td_set_error(st, "%s", msg);
}

/* ---- environment ---- */

static const char *env2(const char *a, const char *b, const char *c) {
  const char *v = getenv(a);
  if (v && *v) return v;
  v = b ? getenv(b) : NULL;
  if (v && *v) return v;
  v = c ? getenv(c) : NULL;
  return v && *v ? v : NULL;
}

td_status td__rpc_init_from_env_impl(const char *name, const td_rpc_options *opts,
                                     td_rpc_agent **out) {
  const char *rs = env2("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK");
  const char *ws = env2("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE");
  if (!rs || !ws)
    return td_set_error(TD_ERR_INVALID, "rpc_init_from_env: RANK and WORLD_SIZE (or Slurm / "
                        "Open MPI equivalents) are not set; start the program with tdistrun");
  char *e1, *e2;
  long rank = strtol(rs, &e1, 10), world = strtol(ws, &e2, 10);
  if (*e1 || *e2 || rank < 0 || world < 1 || rank >= world)
    return td_set_error(TD_ERR_INVALID, "rpc_init_from_env: bad RANK '%s' / WORLD_SIZE '%s'", rs,
                        ws);
  td_rpc_options o;
  if (opts) o = *opts;
  else td_rpc_options_init(&o);
  char method[400], host[300];
  if (!o.init_method) {
    const char *ma = getenv("MASTER_ADDR");
    if (!ma || !*ma) {
      const char *nl = getenv("SLURM_STEP_NODELIST");
      if (!nl || !*nl) nl = getenv("SLURM_JOB_NODELIST");
      ma = "127.0.0.1";
      if (nl && *nl) { /* a malformed list is an error, not a silent loopback */
        TD_TRY(td__slurm_first_host(nl, host, sizeof host));
        ma = host;
      }
    }
    const char *mp = getenv("MASTER_PORT");
    long port = mp && *mp ? strtol(mp, NULL, 10) : 29500;
    const char *job = getenv("SLURM_JOB_ID");
    if (!(mp && *mp) && job && *job) { /* under Slurm: a port per job (rpc/netaddr.h) */
      int jp;
      TD_TRY(td__slurm_port(job, &jp));
      port = jp;
    }
    if (port <= 0 || port > 65535)
      return td_set_error(TD_ERR_INVALID, "rpc_init_from_env: bad MASTER_PORT '%s'", mp);
    snprintf(method, sizeof method, strchr(ma, ':') ? "tcp://[%s]:%ld" : "tcp://%s:%ld", ma, port);
    o.init_method = method;
  }
  return td__rpc_init_impl(name, (int)rank, (int)world, &o, out);
}

/* ---- shutdown ---- */

static void sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Fails every pending call (shutdown). */
static void fail_all(td_rpc_agent *a, td_status st, const char *msg) {
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

/* The graceful barrier. Returns TD_OK, or TD_ERR_TIMEOUT with the missing workers named. */
static td_status barrier(td_rpc_agent *a, uint64_t deadline) {
  char key[64], val[128];
  snprintf(key, sizeof key, "sd/arrived/%d", a->rank);
  TD_TRY(st_set(a, key, "1", 1));
  int64_t *prev = a->rank == 0 ? td__calloc((size_t)a->world * 2, sizeof(int64_t)) : NULL;
  int64_t *cur = a->rank == 0 ? td__calloc((size_t)a->world * 2, sizeof(int64_t)) : NULL;
  if (a->rank == 0 && (!prev || !cur)) {
    td__free(prev);
    td__free(cur);
    return td_set_error(TD_ERR_NOMEM, "rpc shutdown: out of memory");
  }
  bool have_prev = false;
  int64_t backoff = 1;
  td_status st = TD_OK;
  for (;;) {
    bool idle = __atomic_load_n(&a->pending_out, __ATOMIC_ACQUIRE) == 0 &&
                __atomic_load_n(&a->active_in, __ATOMIC_ACQUIRE) == 0;
    int n = snprintf(val, sizeof val, "%d:%lld:%lld", idle ? 1 : 0,
                     (long long)__atomic_load_n(&a->sent_total, __ATOMIC_ACQUIRE),
                     (long long)__atomic_load_n(&a->served_total, __ATOMIC_ACQUIRE));
    snprintf(key, sizeof key, "sd/status/%d", a->rank);
    if ((st = st_set(a, key, val, (size_t)n)) != TD_OK) break;
    bool found = false;
    if ((st = st_get(a, "sd/go", NULL, NULL, &found)) != TD_OK) break;
    if (found) break;
    if (a->rank == 0) {
      bool all = true;
      int64_t sent = 0, served = 0;
      for (int r = 0; r < a->world && all; r++) {
        uint8_t *v = NULL;
        snprintf(key, sizeof key, "sd/status/%d", r);
        if ((st = st_get(a, key, &v, NULL, &found)) != TD_OK) break;
        if (!found) {
          all = false;
          break;
        }
        int i = 0;
        long long s = 0, d = 0;
        sscanf((char *)v, "%d:%lld:%lld", &i, &s, &d);
        td__free(v);
        all = i == 1;
        cur[2 * r] = s;
        cur[2 * r + 1] = d;
        sent += s;
        served += d;
      }
      if (st != TD_OK) break;
      if (all && sent == served && have_prev &&
          memcmp(prev, cur, (size_t)a->world * 2 * sizeof(int64_t)) == 0) {
        if ((st = st_set(a, "sd/go", "1", 1)) != TD_OK) break;
        continue;
      }
      if (all) {
        memcpy(prev, cur, (size_t)a->world * 2 * sizeof(int64_t));
        have_prev = true;
        backoff = 1;
      } else {
        have_prev = false;
      }
    }
    if (td__now_ns() >= deadline) {
      st = TD_ERR_TIMEOUT;
      break;
    }
    sleep_ms(backoff);
    backoff = backoff * 2 > 20 ? 20 : backoff * 2;
  }
  td__free(prev);
  td__free(cur);
  if (st == TD_ERR_TIMEOUT) {
    char missing[900] = "";
    size_t used = 0;
    int arrived = 0;
    for (int r = 0; r < a->world; r++) {
      bool found = true;
      snprintf(key, sizeof key, "sd/arrived/%d", r);
      if (st_get(a, key, NULL, NULL, &found) != TD_OK) continue; /* store gone: unknown */
      arrived += found;
      if (!found && used < sizeof missing - 1)
        used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%s (rank %d)",
                                 used ? ", " : "", peer_name(a, r), r);
    }
    /* rank 0 keeps the store up (briefly) until the others have read the same */
    st_add(a, "sd/timedout", 1, NULL);
    if (a->rank == 0)
      td__store_wait_ge(&a->sc, "sd/timedout", arrived, td__now_ns() + 1000000000ull, NULL);
    return td_set_error(TD_ERR_TIMEOUT, "rpc shutdown: graceful shutdown timed out; %s%s",
                        used ? "workers that never called shutdown: " :
                               "every worker arrived but work was still outstanding",
                        missing);
  }
  if (st != TD_OK) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s", td_last_error());
    return td_set_error(st, "rpc shutdown: lost the rendezvous store: %s", msg);
  }
  return TD_OK;
}

td_status td_rpc_shutdown(td_rpc_agent *a, bool graceful, int64_t timeout_ms) {
  TD_CHECK_ARG(a, "rpc_shutdown: NULL agent");
  pthread_mutex_lock(&a->mu);
  bool already = a->shut;
  a->shut = true;
  pthread_mutex_unlock(&a->mu);
  if (already) return TD_OK;
  if (timeout_ms < 0) timeout_ms = 60000;
  uint64_t deadline = td__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  td_status st = TD_OK;
  char msg[1024] = "";
  if (graceful) {
    st = barrier(a, deadline);
    if (st != TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
  }
  pthread_mutex_lock(&hooks_mu);
  int nh = nhooks;
  td__agent_hooks hs[8];
  memcpy(hs, hooks, sizeof hs);
  pthread_mutex_unlock(&hooks_mu);
  td_status hook_st = TD_OK;
  char hook_msg[1024] = "";
  for (int i = 0; i < nh; i++) {
    if (!hs[i].on_shutdown) continue;
    td_status s = hs[i].on_shutdown(a, graceful && st == TD_OK);
    if (s != TD_OK && hook_st == TD_OK) {
      hook_st = s;
      snprintf(hook_msg, sizeof hook_msg, "%s", td_last_error());
    }
  }
  __atomic_store_n(&a->closing, true, __ATOMIC_RELEASE);
  fail_all(a, TD_ERR_CANCELLED, graceful && st == TD_OK
                                    ? "rpc: the agent shut down"
                                    : "rpc: the agent shut down before the call finished");
  if (graceful && st == TD_OK) {
    /* rank 0 serves the store: keep it up until everybody has seen "go" */
    st_add(a, "sd/exited", 1, NULL);
    if (a->rank == 0) {
      uint64_t dl = td__now_ns() + 5000000000ull;
      if (dl > deadline + 5000000000ull) dl = deadline + 5000000000ull;
      td__store_wait_ge(&a->sc, "sd/exited", a->world, dl, NULL);
    }
  }
  td__transport_shutdown(a->tr);
  td__threadpool_shutdown(a->pool);
  fail_all(a, TD_ERR_CANCELLED, "rpc: the agent shut down");
  if (st != TD_OK) return td_set_error(st, "%s", msg);
  if (hook_st != TD_OK) return td_set_error(hook_st, "%s", hook_msg);
  return TD_OK;
}

void td_rpc_destroy(td_rpc_agent *a) {
  if (!a) return;
  td_rpc_shutdown(a, false, 0);
  td__threadpool_destroy(a->pool);
  a->pool = NULL;
  td__transport_destroy(a->tr);
  a->tr = NULL;
  agent_free(a);
}
