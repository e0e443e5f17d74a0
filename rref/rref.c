/* rref.c - remote references: per-agent contexts, RRef handles, RRefs as values (forks), and the
 * user-side API (td_remote, to_here, proxies).
 *
 * PROTOCOL (the owner is the worker holding the value; every other holder is a user)
 * - Ids: (rank << 48) | counter from the worker that makes them; one counter per agent serves RRef
 *   ids and fork ids, so a fork id is unique in the whole group. A user RRef is one fork; the
 *   creator's fork id is the RRef id. The owner's own handles (td_rref objects on the owner) are
 *   counted separately and carry fork 0.
 * - Owner table: rref id -> entry {state pending/ready/failed, value, error, forks (accepted user
 *   forks), tombstones (forks deleted before their fork message arrived), handles}. An entry
 *   whose creation is done and that has no fork, no tombstone and no handle is removed and its
 *   value released at once (the destructor of an opaque object runs then, on the owner).
 * - Creation: td_remote allocates the id and sends __rref_remote {id, creator fork, target, fn,
 *   args} to the owner; the creator holds its RRef until the owner replies, and the reply comes
 *   once the value exists (or failed). A remote to self makes the entry locally first and runs the
 *   creation through the pool like any self-call. td_rref_remote is the same with a target RRef
 *   whose value is passed first.
 * - Forks: encoding an RRef for peer P makes a new fork F. An owner handle adds F to its entry
 *   directly (the child is confirmed at once). A user sends __rref_fork {id, F, P} to the owner
 *   before the message carrying the RRef leaves and holds its own RRef (a reference) until the
 *   owner acknowledged F, so the owner can never see its fork count drop to zero while F is in
 *   flight: by induction every live user's fork is either accepted or protected by a parent that
 *   is. The owner then sends __rref_confirm to P. P decoding F: on the owner it becomes a handle
 *   and F is released at once; elsewhere it is a user RRef with fork F.
 * - Release: a user RRef's last unref sends __rref_delete {id, F}. A delete of a fork the owner has
 *   not seen yet leaves a tombstone that cancels the later fork message (the parent still holds,
 *   so the value stays alive meanwhile).
 * - Idempotence: the owner remembers the last 8192 forks that ended; a fork or delete message for
 *   one of them, a second fork for an accepted fork, a second delete for a tombstone, and a second
 *   creation request are ignored; a fetch or proxy call through a fork that already ended never
 *   recreates a freed entry. Control messages failing with TD_ERR_UNAVAILABLE (the stream
 *   broke, they may or may not have arrived) are retried 3 times with backoff (util.c).
 * - Waiting: __rref_fetch and __rref_call on a pending entry do not block a pool thread: they
 *   return a future chained on the entry's ready future; __rref_call then runs the method on the
 *   pool. Results travel as outcomes [0, value] or [status, message] so that errors keep the
 *   owner's words ("RRef creation failed: worker1 (rank 1): 'fn' failed: ...").
 * - Shutdown: the graceful barrier already waits for every in-flight message (deletes included);
 *   the agent's shutdown hook then closes the context, releases what is left and reports leaks,
 *   an error in strict mode (td_rref_set_strict or TD_RREF_STRICT=1).
 * Known limits: a message whose encoding or sending fails after an RRef inside it was forked
 * leaves that fork on the owner until shutdown (reported as a leak); duplicates older than the
 * last 8192 finished forks are not recognised.
 *
 * Lock order: ctx_list_mu, then ctx->mu; ctx->mu is a leaf (see rref_impl.h).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rref_impl.h"
#include "../core/flight_impl.h"
#include "../core/trace_impl.h"

/* ---- per-agent contexts ---- */

#define MAX_CTX 32
static pthread_mutex_t ctx_list_mu = PTHREAD_MUTEX_INITIALIZER;
static td__rref_ctx *ctx_list[MAX_CTX];
static int nctx;

typedef struct early_confirm {
  td_status st;
  char *msg;
} early_confirm;

static void ctx_free(td__rref_ctx *c) {
  for (size_t i = 0; i < c->early.cap; i++) {
    early_confirm *e = c->early.keys[i] ? c->early.vals[i] : NULL;
    if (e) {
      td__free(e->msg);
      td__free(e);
    }
  }
  td__u64map_fini(&c->early);
  td__u64map_fini(&c->owned);
  td__u64map_fini(&c->users);
  td__u64map_fini(&c->done.set);
  td__free(c->names);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  td__free(c);
}

void td__rref_ctx_unref(td__rref_ctx *c) {
  if (c && td__ref_dec(&c->rc)) ctx_free(c);
}

static td__rref_ctx *ctx_new(td_rpc_agent *a) {
  td__rref_ctx *c = td__calloc(1, sizeof *c);
  int world = td_rpc_world_size(a);
  if (!c) return NULL;
  c->names = td__calloc((size_t)world, sizeof *c->names);
  if (!c->names) {
    td__free(c);
    return NULL;
  }
  td__ref_init(&c->rc);
  c->agent = a;
  c->rank = td_rpc_rank(a);
  c->world = world;
  for (int r = 0; r < world; r++) {
    td_worker_info wi;
    if (td_rpc_get_worker_info_by_rank(a, r, &wi) == TD_OK)
      snprintf(c->names[r], sizeof c->names[r], "%s", wi.name);
    else
      snprintf(c->names[r], sizeof c->names[r], "worker%d", r);
  }
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  return c;
}

/* Finds a's context (ctx_list_mu held). */
static int ctx_find(td_rpc_agent *a) {
  for (int i = 0; i < nctx; i++)
    if (ctx_list[i]->agent == a) return i;
  return -1;
}

/* Adds c to the list, evicting a closed context when full (ctx_list_mu held). */
static bool ctx_insert(td__rref_ctx *c) {
  if (nctx == MAX_CTX) {
    for (int i = 0; i < nctx; i++) {
      if (ctx_list[i]->closed) {
        td__rref_ctx_unref(ctx_list[i]);
        ctx_list[i] = ctx_list[--nctx];
        break;
      }
    }
  }
  if (nctx == MAX_CTX) return false;
  ctx_list[nctx++] = c;
  return true;
}

td_status td__rref_ctx_get(td_rpc_agent *a, bool create, td__rref_ctx **out) {
  TD_CHECK_ARG(a, "rref: NULL agent");
  pthread_mutex_lock(&ctx_list_mu);
  int i = ctx_find(a);
  td__rref_ctx *c = i >= 0 ? ctx_list[i] : NULL;
  td_status st = TD_OK;
  if (c && c->closed) {
    st = td_set_error(TD_ERR_STATE, "rref: the agent has shut down");
  } else if (!c && !create) {
    st = td_set_error(TD_ERR_NOT_FOUND, "rref: this agent has no RRef state");
  } else if (!c) {
    c = ctx_new(a);
    if (!c || !ctx_insert(c)) {
      if (c) ctx_free(c);
      st = td_set_error(TD_ERR_NOMEM, "rref: out of memory (or too many agents)");
    }
  }
  if (st == TD_OK) {
    td__ref_inc(&c->rc);
    *out = c;
  }
  pthread_mutex_unlock(&ctx_list_mu);
  return st;
}

uint64_t td__rref_next_id(td__rref_ctx *c) {
  uint64_t n = __atomic_add_fetch(&c->counter, 1, __ATOMIC_RELAXED);
  return ((uint64_t)c->rank << 48) | (n & ((1ull << 48) - 1));
}

const char *td__rref_name(const td__rref_ctx *c, int rank) {
  return rank >= 0 && rank < c->world ? c->names[rank] : "?";
}

/* The RRef a request is about, for the flight recorder: every RRef request starts with a header
 * list whose first integer is the RRef id ([id, ...], or [[id, ...], ...] for __rref_confirm). */
static uint64_t request_rref_id(td_value *const *args, int nargs) {
  const td_value *v = nargs > 0 ? args[0] : NULL;
  for (int depth = 0; depth < 2 && td_value_kind_of(v) == TD_VALUE_LIST; depth++) {
    v = td_value_list_len(v) ? td_value_list_get(v, 0) : NULL;
    int64_t id;
    if (td_value_kind_of(v) == TD_VALUE_INT && td_value_as_int(v, &id) == TD_OK)
      return (uint64_t)id;
  }
  return 0;
}

td_status td__rref_call(td__rref_ctx *c, int to, const char *fn, td_value *const *args, int nargs,
                        td_timeout_ms timeout_ms, td_future **out) {
  pthread_mutex_lock(&c->mu);
  if (c->closed) {
    pthread_mutex_unlock(&c->mu);
    return td_set_error(TD_ERR_STATE, "rref: the agent %s has shut down", c->names[c->rank]);
  }
  c->senders++;
  pthread_mutex_unlock(&c->mu);
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = timeout_ms;
  uint64_t id = request_rref_id(args, nargs);
  td__flight_subj prev = td__flight_subject_set((td__flight_subj){id ? TD__FL_SUBJ_RREF : 0, id});
  td_status st = td_rpc_async(c->agent, td__rref_name(c, to), fn, args, nargs, &o, out);
  td__flight_subject_set(prev);
  pthread_mutex_lock(&c->mu);
  if (--c->senders == 0 && c->closed) pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Agent hooks: a fresh context per agent; a closed one left by a destroyed agent at the same
 * address is replaced. */
static void hook_init(td_rpc_agent *a) {
  pthread_mutex_lock(&ctx_list_mu);
  int i = ctx_find(a);
  if (i >= 0 && ctx_list[i]->closed) {
    td__rref_ctx_unref(ctx_list[i]);
    ctx_list[i] = ctx_list[--nctx];
    i = -1;
  }
  if (i < 0) {
    td__rref_ctx *c = ctx_new(a);
    if (c && !ctx_insert(c)) {
      ctx_free(c);
      c = NULL;
    }
    if (!c) td_log(TD_LOG_WARN, "rref: out of memory setting up RRefs for an agent");
  }
  pthread_mutex_unlock(&ctx_list_mu);
}

static bool strict_mode;

void td_rref_set_strict(bool on) { __atomic_store_n(&strict_mode, on, __ATOMIC_RELEASE); }

static bool strict_now(void) {
  const char *e = getenv("TD_RREF_STRICT");
  return __atomic_load_n(&strict_mode, __ATOMIC_ACQUIRE) || (e && strcmp(e, "1") == 0);
}

static td_status hook_shutdown(td_rpc_agent *a, bool graceful) {
  pthread_mutex_lock(&ctx_list_mu);
  int i = ctx_find(a);
  td__rref_ctx *c = i >= 0 && !ctx_list[i]->closed ? ctx_list[i] : NULL;
  if (c) td__ref_inc(&c->rc);
  pthread_mutex_unlock(&ctx_list_mu);
  if (!c) return TD_OK;
  char report[1024];
  int leaks = td__rref_ctx_close(c, graceful, report, sizeof report);
  td_status st = TD_OK;
  /* RRefs a program still holds when it shuts down are normal (PyTorch's shutdown releases
   * them too): the agent drops them, and says so at DEBUG. Strict mode (tests, TD_RREF_STRICT=1)
   * calls them leaks: a warning, and td_rpc_shutdown fails. */
  if (leaks && strict_now()) {
    td_log(TD_LOG_WARN, "rref: %s: %d RRef%s leaked at shutdown: %s", c->names[c->rank], leaks,
           leaks == 1 ? "" : "s", report);
    st = td_set_error(TD_ERR_STATE, "rref: %s: %d RRef%s leaked at shutdown (strict mode): %s",
                      c->names[c->rank], leaks, leaks == 1 ? "" : "s", report);
  } else if (leaks) {
    td_log(TD_LOG_DEBUG, "rref: %s: %d RRef%s still referenced at shutdown, released: %s",
           c->names[c->rank], leaks, leaks == 1 ? "" : "s", report);
  }
  td__rref_ctx_unref(c);
  return st;
}

static td_value *int_list(const int64_t *xs, int n);

/* ---- RRef objects ---- */

static td_rref *rref_alloc(td__rref_ctx *c, uint64_t id, uint64_t fork, int owner) {
  td_rref *r = td__calloc(1, sizeof *r);
  if (!r) return NULL;
  td__ref_init(&r->rc);
  td__ref_inc(&c->rc);
  r->ctx = c;
  r->id = id;
  r->fork = fork;
  r->owner = owner;
  return r;
}

/* A new user RRef registered in c->users; early confirmations are applied. */
static td_status user_new(td__rref_ctx *c, uint64_t id, uint64_t fork, int owner, bool confirmed,
                          td_rref **out) {
  td_rref *r = rref_alloc(c, id, fork, owner);
  td_future *f = td_future_create();
  if (!r || !f) {
    if (r) td__rref_ctx_unref(c);
    td__free(r);
    td_future_unref(f);
    return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  /* a wait on it waits for the owner (the value's creation, or this fork's confirmation) */
  td__future_set_flight(f, -1, 0, "rref_created");
  td__future_set_flight_subject(f, TD__FL_SUBJ_RREF, id);
  r->created = f;
  early_confirm *ec = NULL;
  pthread_mutex_lock(&c->mu);
  bool ok = td__u64map_put(&c->users, fork, r);
  if (!confirmed) ec = td__u64map_del(&c->early, fork);
  if (ec || confirmed) r->confirmed = 1;
  pthread_mutex_unlock(&c->mu);
  if (!ok) td_log(TD_LOG_WARN, "rref: out of memory tracking a user RRef (debug table only)");
  if (confirmed) td_future_complete(f, NULL);
  if (ec) {
    if (ec->st == TD_OK) td_future_complete(f, NULL);
    else td__future_fail_msg(f, ec->st, ec->msg);
    td__free(ec->msg);
    td__free(ec);
  }
  *out = r;
  return TD_OK;
}

/* An RRef event for the flight recorder (core/flight_impl.h: RREF_FORK, _CONFIRM, _DELETE). */
static void flight_rref(int kind, int owner, uint64_t id, uint64_t fork, int other, int x) {
  td__flight_record(&(td__flight_ev){.kind = (uint16_t)kind, .peer = owner, .a = id, .b = fork,
                                     .c = (uint32_t)other, .x = (uint8_t)x},
                    kind == TD__FL_RREF_FORK ? "__rref_fork" : kind == TD__FL_RREF_CONFIRM
                                                                   ? "__rref_confirm"
                                                                   : "__rref_delete");
}

static void rref_destroy(td_rref *r) {
  td__rref_ctx *c = r->ctx;
  if (r->entry) {
    td__rref_handle_release(c, r->entry);
  } else if (r->fork) {
    bool closed;
    pthread_mutex_lock(&c->mu);
    if (td__u64map_get(&c->users, r->fork) == r) td__u64map_del(&c->users, r->fork);
    if (!__atomic_load_n(&r->confirmed, __ATOMIC_ACQUIRE)) td__fork_ring_push(&c->done, r->fork);
    closed = c->closed;
    pthread_mutex_unlock(&c->mu);
    if (!closed) {
      flight_rref(TD__FL_RREF_DELETE, r->owner, r->id, r->fork, -1, 0);
      int64_t h[2] = {(int64_t)r->id, (int64_t)r->fork};
      td_value *hdr = int_list(h, 2);
      if (hdr) td__rref_control(c, r->owner, "__rref_delete", hdr, NULL);
      else td_log(TD_LOG_WARN, "rref: out of memory releasing an RRef (the owner keeps it)");
    }
  }
  td_future_unref(r->created);
  td__rref_ctx_unref(c);
  td__free(r);
}

td_rref *td_rref_ref(td_rref *r) {
  if (r) td__ref_inc(&r->rc);
  return r;
}

void td_rref_unref(td_rref *r) {
  if (r && td__ref_dec(&r->rc)) rref_destroy(r);
}

int td_rref_owner(const td_rref *r) { return r ? r->owner : -1; }
const char *td_rref_owner_name(const td_rref *r) { return r ? td__rref_name(r->ctx, r->owner) : "?"; }
bool td_rref_is_owner(const td_rref *r) { return r && r->entry; }
bool td_rref_confirmed_by_owner(const td_rref *r) {
  return r && (r->entry || __atomic_load_n(&r->confirmed, __ATOMIC_ACQUIRE));
}
td_rref_id td_rref_get_id(const td_rref *r) { return (td_rref_id){r ? r->id : 0}; }
td_rref_fork_id td_rref_get_fork_id(const td_rref *r) { return (td_rref_fork_id){r ? r->fork : 0}; }

td_status td_rref_creation_future(td_rref *r, td_future **out) {
  TD_CHECK_ARG(r && out, "rref_creation_future: NULL argument");
  *out = td_future_ref(r->created);
  return TD_OK;
}

const char *td_rref_to_string(const td_rref *r, char *buf, size_t n) {
  if (!buf || !n) return buf;
  if (!r) {
    snprintf(buf, n, "RRef(null)");
    return buf;
  }
  char a[48], b[48];
  td__rref_id_str(r->id, a, sizeof a);
  if (r->entry) snprintf(buf, n, "RRef(owner=%s, id=%s, local)", td_rref_owner_name(r), a);
  else
    snprintf(buf, n, "RRef(owner=%s, id=%s, fork=%s)", td_rref_owner_name(r), a,
             td__rref_id_str(r->fork, b, sizeof b));
  return buf;
}

/* The stored creation failure, if the creation future failed. */
static td_status creation_error(td_rref *r) {
  if (!td_future_done(r->created)) return TD_OK;
  td_status st = td_future_status(r->created);
  if (st == TD_OK) return TD_OK;
  return td_set_error(st, "%s", td_future_message(r->created));
}

/* ---- RRefs as values ---- */

static void ext_destroy(void *obj) { td_rref_unref(obj); }

static td_value *int_list(const int64_t *xs, int n) {
  td_value *l = td_value_list();
  for (int i = 0; l && i < n; i++) {
    td_value *x = td_value_int(xs[i]);
    if (!x || td_value_list_append(l, x) != TD_OK) {
      td_value_unref(x);
      td_value_unref(l);
      return NULL;
    }
  }
  return l;
}

static bool int_list_get(const td_value *l, int64_t *xs, int n) {
  if (td_value_kind_of(l) != TD_VALUE_LIST || (int)td_value_list_len(l) < n) return false;
  for (int i = 0; i < n; i++)
    if (td_value_as_int(td_value_list_get(l, (size_t)i), &xs[i]) != TD_OK) return false;
  return true;
}

/* A fork of a user RRef: the owner confirms it to the child once the parent's __rref_fork notice
 * reaches it, and the notice is answered once the child has that confirmation. When the notice
 * fails instead (the owner died or is unreachable, after the control message's retries), nobody
 * else would ever tell the child, whose functions wait for the confirmation (the argument gate)
 * and whose fetches would wait for the owner: the parent sends the child the failure itself. A
 * failure that reaches a child already confirmed is ignored there (h_confirm confirms once). */
typedef struct fork_watch_t {
  td__rref_ctx *c; /* reference */
  uint64_t id, fork;
  int child, owner;
} fork_watch_t;

static void fork_notice_done(td_future *f, void *arg) {
  fork_watch_t *w = arg;
  td_status st = td_future_status(f);
  if (st != TD_OK && w->child != w->c->rank) {
    char idb[48], msg[700];
    snprintf(msg, sizeof msg,
             "rref: the owner %s (rank %d) of RRef %s could not be told of this worker's copy, so "
             "it was never confirmed: %s",
             td__rref_name(w->c, w->owner), w->owner, td__rref_id_str(w->id, idb, sizeof idb),
             td_future_message(f));
    int64_t h[3] = {(int64_t)w->id, (int64_t)w->fork, st};
    td_value *hdr = int_list(h, 3), *args = td_value_list(), *m = td_value_string(msg);
    bool ok = hdr && args && m && td_value_list_append(args, hdr) == TD_OK;
    if (ok) hdr = NULL;
    ok = ok && td_value_list_append(args, m) == TD_OK;
    if (ok) m = NULL;
    td_value_unref(hdr);
    td_value_unref(m);
    if (ok) td__rref_control(w->c, w->child, "__rref_confirm", args, NULL);
    else td_value_unref(args);
  }
  td__rref_ctx_unref(w->c);
  td__free(w);
}

/* Watches notice (taken) for the fork `fork` of r given to rank child. */
static void fork_watch(td__rref_ctx *c, td_rref *r, uint64_t fork, int child, td_future *notice) {
  fork_watch_t *w = notice ? td__calloc(1, sizeof *w) : NULL;
  if (w) {
    td__ref_inc(&c->rc);
    *w = (fork_watch_t){c, r->id, fork, child, r->owner};
    if (td_future_on_done(notice, fork_notice_done, w) != TD_OK) {
      td__rref_ctx_unref(c);
      td__free(w);
    }
  }
  td_future_unref(notice);
}

static td_status ext_to_wire(void *obj, td__wire_ctx *w, td_value **out) {
  td_rref *r = obj;
  td__rref_ctx *c = r->ctx;
  char s[160];
  if (w->agent != (void *)c->agent)
    return td_set_error(TD_ERR_INVALID, "rref: %s belongs to another agent",
                        td_rref_to_string(r, s, sizeof s));
  TD_TRY(creation_error(r));
  uint64_t f = td__rref_next_id(c);
  bool confirmed = r->entry != NULL;
  flight_rref(TD__FL_RREF_FORK, r->owner, r->id, f, w->peer_rank, r->entry ? 2 : 0);
  if (r->entry) {
    TD_TRY(td__rref_owner_add_fork(c, r->entry, f));
  } else {
    int64_t h[4] = {(int64_t)r->id, (int64_t)f, w->peer_rank, c->rank};
    td_value *hdr = int_list(h, 4);
    if (!hdr) return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
    __atomic_add_fetch(&r->children, 1, __ATOMIC_ACQ_REL);
    td_future *notice = NULL;
    td_status st = td__rref_control_ex(c, r->owner, "__rref_fork", hdr, td_rref_ref(r), &notice);
    if (st != TD_OK) {
      td_future_unref(notice);
      return td__error_prefix(st, "rref: cannot fork %s", td_rref_to_string(r, s, sizeof s));
    }
    fork_watch(c, r, f, w->peer_rank, notice);
  }
  int64_t v[5] = {(int64_t)r->id, (int64_t)f, r->owner, c->rank, confirmed};
  *out = int_list(v, 5);
  return *out ? TD_OK : td_set_error(TD_ERR_NOMEM, "rref: out of memory");
}

static td_status ext_from_wire(const td_value *repr, td__wire_ctx *w, void **obj) {
  int64_t v[5];
  if (!int_list_get(repr, v, 5) || v[0] == 0 || v[1] == 0)
    return td_set_error(TD_ERR_FORMAT, "rref: malformed RRef on the wire");
  td__rref_ctx *c;
  TD_TRY(td__rref_ctx_get(w->agent, true, &c));
  td_status st;
  td_rref *r = NULL;
  if (v[2] < 0 || v[2] >= c->world) {
    st = td_set_error(TD_ERR_FORMAT, "rref: RRef owner rank %lld out of range", (long long)v[2]);
  } else if (v[2] == c->rank) {
    st = td__rref_owner_handle(c, (uint64_t)v[0], (uint64_t)v[1], &r);
  } else {
    if (!v[4]) flight_rref(TD__FL_RREF_FORK, (int)v[2], (uint64_t)v[0], (uint64_t)v[1], (int)v[3], 1);
    st = user_new(c, (uint64_t)v[0], (uint64_t)v[1], (int)v[2], v[4] != 0, &r);
  }
  td__rref_ctx_unref(c);
  if (st == TD_OK) *obj = r;
  return st;
}

static bool ext_equal(const void *a, const void *b) {
  const td_rref *x = a, *y = b;
  return x->ctx == y->ctx && x->id == y->id && x->fork == y->fork;
}

static void ext_describe(const void *obj, char *buf, size_t n) { td_rref_to_string(obj, buf, n); }

static const td__value_ext_type rref_type = {.name = "rref",
                                             .destroy = ext_destroy,
                                             .to_wire = ext_to_wire,
                                             .from_wire = ext_from_wire,
                                             .equal = ext_equal,
                                             .describe = ext_describe};

td_value *td_value_rref(td_rref *r) {
  if (!r) return NULL;
  return td__value_ext(&rref_type, td_rref_ref(r));
}

td_status td_value_as_rref(const td_value *v, td_rref **out) {
  TD_CHECK_ARG(out, "value_as_rref: NULL out");
  if (td__value_ext_type_of(v) != &rref_type)
    return td_set_error(TD_ERR_INVALID, "value: expected rref, got %s", td_value_kind_name(v));
  *out = td__value_ext_obj(v);
  return TD_OK;
}

/* ---- creation ---- */

typedef struct creation {
  td_rref *r;      /* the new RRef (held until the reply) */
  td_rref *target; /* td_rref_remote: the RRef whose value is the first argument (held) */
  td_future *reply; /* set while the completion waits for a pool thread */
} creation;

static void creation_done(td_future *f, void *arg);

static void creation_task(void *arg) {
  creation *cr = arg;
  td_future *f = cr->reply;
  cr->reply = NULL;
  creation_done(f, cr);
  td_future_unref(f);
}

/* creation_reply runs on the thread that receives the owner's reply (usually the network
 * thread): it settles the RRef there unless the future it completes has callbacks of the
 * user's, which then run on the pool. */
static void creation_reply(td_future *f, void *arg) {
  creation *cr = arg;
  td_rref *r = cr->r;
  td_future *settles = r->entry ? r->entry->ready : r->created;
  if (td__future_has_callbacks(settles)) {
    cr->reply = td_future_ref(f);
    if (td__agent_submit_user(r->ctx->agent, creation_task, cr) == TD_OK) return;
    td_future_unref(cr->reply);
    cr->reply = NULL;
  }
  creation_done(f, cr);
}

static void creation_done(td_future *f, void *arg) {
  creation *cr = arg;
  td_rref *r = cr->r;
  td_status st = td_future_status(f);
  if (r->entry) {
    /* a self-remote: the handler settles the entry; only a failed call is left to report */
    if (st != TD_OK) {
      char msg[1200];
      snprintf(msg, sizeof msg, "RRef creation failed: %s", td_future_message(f));
      td__rref_fail_entry(r->ctx, r->entry, st, msg);
    }
  } else if (st != TD_OK) {
    td_future_fail(r->created, st, "RRef creation failed: %s", td_future_message(f));
  } else {
    td_value *v = NULL;
    st = td__rref_outcome_take(td_future_value(f), &v);
    __atomic_store_n(&r->confirmed, 1, __ATOMIC_RELEASE);
    if (st == TD_OK) td_future_complete(r->created, v);
    else td__future_fail_msg(r->created, st, td_last_error());
  }
  td_rref_unref(cr->target);
  td_rref_unref(r);
  td__free(cr);
}

/* Builds [hdr, fn, args...] (new references in argv[0..nargs+2)). */
static td_status build_argv(td_value *hdr, const char *fn, td_value *const *args, int nargs,
                            td_value ***out) {
  td_value **argv = td__calloc((size_t)nargs + 2, sizeof *argv);
  td_value *fv = td_value_string(fn);
  if (!argv || !fv || !hdr) {
    td__free(argv);
    td_value_unref(fv);
    td_value_unref(hdr);
    return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  argv[0] = hdr;
  argv[1] = fv;
  for (int i = 0; i < nargs; i++) argv[i + 2] = td_value_ref(args[i]);
  *out = argv;
  return TD_OK;
}

static void free_argv(td_value **argv, int n) {
  for (int i = 0; i < n; i++) td_value_unref(argv[i]);
  td__free(argv);
}

static td_status remote_start(td__rref_ctx *c, int owner, td_rref *target, const char *fn,
                              td_value *const *args, int nargs, td_timeout_ms timeout_ms,
                              td_rref **out) {
  for (int i = 0; i < nargs; i++) TD_CHECK_ARG(args[i], "remote: argument %d is NULL", i);
  uint64_t id = td__rref_next_id(c);
  bool self = owner == c->rank;
  td_rref *r = NULL;
  td_status st;
  if (self) {
    td__rref_entry *e;
    TD_TRY(td__rref_entry_new_local(c, id, NULL, &e));
    r = rref_alloc(c, id, 0, owner);
    if (!r) {
      td__rref_fail_entry(c, e, TD_ERR_NOMEM, "RRef creation failed: out of memory");
      td__rref_handle_release(c, e);
      return td_set_error(TD_ERR_NOMEM, "remote: out of memory");
    }
    r->entry = e;
    r->created = td_future_ref(e->ready);
    r->confirmed = 1;
  } else {
    TD_TRY(user_new(c, id, id, owner, false, &r));
  }
  int64_t h[3] = {(int64_t)id, self ? 0 : (int64_t)id, target ? (int64_t)target->id : 0};
  td_value **argv = NULL;
  st = build_argv(int_list(h, 3), fn, args, nargs, &argv);
  creation *cr = st == TD_OK ? td__calloc(1, sizeof *cr) : NULL;
  td_future *f = NULL;
  if (cr) {
    st = td__rref_call(c, owner, "__rref_remote", argv, nargs + 2, timeout_ms, &f);
  } else if (st == TD_OK) {
    st = td_set_error(TD_ERR_NOMEM, "remote: out of memory");
  }
  if (argv) free_argv(argv, nargs + 2);
  if (st != TD_OK) {
    char why[800];
    snprintf(why, sizeof why, "%s", td_last_error());
    td__free(cr);
    if (self) {
      td__rref_fail_entry(c, r->entry, st, "RRef creation failed: the request was not sent");
    } else {
      /* never reached the owner: nothing to delete there */
      pthread_mutex_lock(&c->mu);
      td__u64map_del(&c->users, r->fork);
      pthread_mutex_unlock(&c->mu);
      r->fork = 0;
    }
    td_rref_unref(r);
    return td_set_error(st, "%s", why);
  }
  cr->r = td_rref_ref(r);
  cr->target = td_rref_ref(target);
  if (td__future_on_done_light(f, creation_reply, cr) != TD_OK) {
    td_rref_unref(cr->r);
    td_rref_unref(cr->target);
    td__free(cr);
  }
  td_future_unref(f);
  *out = r;
  return TD_OK;
}

td_status td_remote(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                    int nargs, const td_rpc_call_opts *opts, td_rref **out) {
  TD_CHECK_ARG(a && to && fn && out && nargs >= 0 && (args || nargs == 0),
               "remote: invalid argument");
  td_timeout_ms tmo;
  TD_TRY(td__call_opts_timeout(opts, "remote", &tmo));
  td_worker_info wi;
  TD_TRY(td_rpc_get_worker_info(a, to, &wi));
  td__rref_ctx *c;
  TD_TRY(td__rref_ctx_get(a, true, &c));
  td_status st = remote_start(c, wi.id, NULL, fn, args, nargs, tmo, out);
  td__rref_ctx_unref(c);
  return st;
}

td_status td_rref_remote(td_rref *r, const char *fn, td_value *const *args, int nargs,
                         const td_rpc_call_opts *opts, td_rref **out) {
  TD_CHECK_ARG(r && fn && out && nargs >= 0 && (args || nargs == 0),
               "rref_remote: invalid argument");
  td_timeout_ms tmo;
  TD_TRY(td__call_opts_timeout(opts, "rref_remote", &tmo));
  TD_TRY(creation_error(r));
  return remote_start(r->ctx, r->owner, r, fn, args, nargs, tmo, out);
}

td_status td_rref_create_local(td_rpc_agent *a, td_value *value, td_rref **out) {
  TD_CHECK_ARG(a && value && out, "rref_create_local: NULL argument");
  td__rref_ctx *c;
  TD_TRY(td__rref_ctx_get(a, true, &c));
  td__rref_entry *e;
  td_status st = td__rref_entry_new_local(c, td__rref_next_id(c), value, &e);
  td_rref *r = st == TD_OK ? rref_alloc(c, e->id, 0, c->rank) : NULL;
  if (st == TD_OK && !r) {
    td__rref_handle_release(c, e);
    st = td_set_error(TD_ERR_NOMEM, "rref_create_local: out of memory");
  }
  if (r) {
    r->entry = e;
    r->created = td_future_ref(e->ready);
    r->confirmed = 1;
    *out = r;
  }
  td__rref_ctx_unref(c);
  return st;
}

/* ---- using RRefs ---- */

static td_timeout_ms default_timeout(td__rref_ctx *c) {
  pthread_mutex_lock(&c->mu);
  td_timeout_ms t = c->closed ? TD_TIMEOUT_INFINITE : td_rpc_get_default_timeout(c->agent);
  pthread_mutex_unlock(&c->mu);
  return t;
}

static td_status to_here_impl(td_rref *r, td_timeout_ms timeout_ms, td_value **out) {
  TD_CHECK_ARG(r && out && td__timeout_valid(timeout_ms), "rref_to_here: invalid argument");
  TD_TRY(creation_error(r));
  td__rref_ctx *c = r->ctx;
  char s[160];
  if (r->entry) {
    timeout_ms = td__timeout_resolve(timeout_ms, default_timeout(c));
    td_status st = td_future_wait(r->entry->ready, timeout_ms);
    if (st == TD_ERR_TIMEOUT)
      return td_set_error(st, "rref to_here: %s: the value was not created within %lld ms",
                          td_rref_to_string(r, s, sizeof s), (long long)timeout_ms);
    return td__rref_entry_read(c, r->entry, out);
  }
  int64_t h[2] = {(int64_t)r->id, (int64_t)r->fork};
  td_value *hdr = int_list(h, 2);
  if (!hdr) return td_set_error(TD_ERR_NOMEM, "rref to_here: out of memory");
  td_future *f = NULL;
  td_status st = td__rref_call(c, r->owner, "__rref_fetch", &hdr, 1, timeout_ms, &f);
  td_value_unref(hdr);
  TD_TRY(st);
  if (r->fork == r->id && !td_future_done(r->created)) {
    /* the creator: a creation that fails or times out meanwhile is the answer (the fetch would
     * only see the owner's side of it); both futures complete on their own */
    td_future *both[2] = {r->created, f};
    td_future_wait_all(both, 2, TD_TIMEOUT_INFINITE); /* both end by the call's deadline */
    if (creation_error(r) != TD_OK) {
      td_future_unref(f);
      return td_future_status(r->created);
    }
  }
  st = td_future_wait(f, TD_TIMEOUT_INFINITE);
  if (st != TD_OK) {
    st = td_set_error(st, "rref to_here: %s: %s", td_rref_to_string(r, s, sizeof s),
                      td_future_message(f));
  } else {
    st = td__rref_outcome_take(td_future_value(f), out);
  }
  td_future_unref(f);
  return st;
}

static td_status here_then(void *arg, td_future *src, td_value **result, td_future **next) {
  td_rref *r = arg;
  char s[160];
  td_status st = creation_error(r);
  if (st == TD_OK && r->entry) {
    st = td__rref_entry_read(r->ctx, r->entry, result);
  } else if (st == TD_OK && td_future_status(src) != TD_OK) {
    st = td_set_error(td_future_status(src), "rref to_here: %s: %s",
                      td_rref_to_string(r, s, sizeof s), td_future_message(src));
  } else if (st == TD_OK) {
    st = td__rref_outcome_take(td_future_value(src), result);
  }
  td_rref_unref(r);
  return st;
}

/* The agent's pool for what must run where user code runs (td__future_then_light's submit). */
static td_status submit_user(void *agent, void (*task)(void *), void *arg) {
  return td__agent_submit_user(agent, task, arg);
}

/* Chains fn on f for r: light (fn never blocks), so a thread waiting for the result takes the
 * reply, runs fn and completes the result itself, with no hop to the pool (unless the result has
 * callbacks of its own). */
static td_status then_for(td_rref *r, td_future *f, td_future_then_fn fn, td_future **out) {
  if (!r->ctx || !r->ctx->agent) return td_future_then(f, fn, r, out);
  return td__future_then_light(f, fn, r, submit_user, r->ctx->agent, out);
}

td_status td_rref_to_here_async(td_rref *r, td_timeout_ms timeout_ms, td_future **out) {
  TD_CHECK_ARG(r && out && td__timeout_valid(timeout_ms), "rref_to_here_async: invalid argument");
  TD_TRY(creation_error(r));
  td_future *f = NULL;
  if (r->entry) {
    f = td_future_ref(r->entry->ready);
  } else {
    int64_t h[2] = {(int64_t)r->id, (int64_t)r->fork};
    td_value *hdr = int_list(h, 2);
    if (!hdr) return td_set_error(TD_ERR_NOMEM, "rref to_here: out of memory");
    td_status st = td__rref_call(r->ctx, r->owner, "__rref_fetch", &hdr, 1, timeout_ms, &f);
    td_value_unref(hdr);
    TD_TRY(st);
  }
  td_rref_ref(r);
  td_status st = then_for(r, f, here_then, out);
  if (st != TD_OK) td_rref_unref(r);
  td_future_unref(f);
  return st;
}

td_status td_rref_local_value(td_rref *r, td_value **out) {
  TD_CHECK_ARG(r && out, "rref_local_value: NULL argument");
  char s[160];
  if (!r->entry)
    return td_set_error(TD_ERR_STATE, "rref local_value: %s is owned by %s (rank %d), not by "
                        "this worker; use td_rref_to_here", td_rref_to_string(r, s, sizeof s),
                        td_rref_owner_name(r), r->owner);
  /* as PyTorch's OwnerRRef: wait for the value being created, within the agent's rpc timeout */
  if (td__rref_entry_pending(r->ctx, r->entry) && r->created && r->ctx->agent) {
    td_timeout_ms to = td_rpc_get_default_timeout(r->ctx->agent);
    if (td_future_wait(r->created, to) == TD_ERR_TIMEOUT)
      return td_set_error(TD_ERR_TIMEOUT, "rref local_value: %s: its value was not created "
                          "within the rpc timeout (%lld ms)", td_rref_to_string(r, s, sizeof s),
                          (long long)to);
  }
  return td__rref_entry_read(r->ctx, r->entry, out);
}

static td_status proxy_then(void *arg, td_future *src, td_value **result, td_future **next) {
  td_rref *r = arg;
  td_status st = td_future_status(src);
  if (st != TD_OK) st = td_set_error(st, "%s", td_future_message(src));
  else st = td__rref_outcome_take(td_future_value(src), result);
  td_rref_unref(r);
  return st;
}

td_status td_rref_rpc_async(td_rref *r, const char *fn, td_value *const *args, int nargs,
                            const td_rpc_call_opts *opts, td_future **out) {
  TD_CHECK_ARG(r && fn && out && nargs >= 0 && (args || nargs == 0),
               "rref_rpc_async: invalid argument");
  for (int i = 0; i < nargs; i++) TD_CHECK_ARG(args[i], "rref_rpc_async: argument %d is NULL", i);
  td_timeout_ms to;
  TD_TRY(td__call_opts_timeout(opts, "rref_rpc_async", &to));
  TD_TRY(creation_error(r));
  int64_t h[2] = {(int64_t)r->id, (int64_t)r->fork};
  td_value **argv;
  TD_TRY(build_argv(int_list(h, 2), fn, args, nargs, &argv));
  td_future *f = NULL;
  td_status st = td__rref_call(r->ctx, r->owner, "__rref_call", argv, nargs + 2, to, &f);
  free_argv(argv, nargs + 2);
  TD_TRY(st);
  td_rref_ref(r);
  st = then_for(r, f, proxy_then, out);
  if (st != TD_OK) td_rref_unref(r);
  td_future_unref(f);
  return st;
}

td_status td_rref_rpc_sync(td_rref *r, const char *fn, td_value *const *args, int nargs,
                           const td_rpc_call_opts *opts, td_value **result) {
  TD_CHECK_ARG(result, "rref_rpc_sync: NULL result");
  td_future *f;
  TD_TRY(td_rref_rpc_async(r, fn, args, nargs, opts, &f));
  td_status st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* the call's deadline ends it */
  if (st == TD_OK) {
    td_value *v = td_future_value(f);
    *result = v ? td_value_ref(v) : td_value_none();
  } else {
    td_set_error(st, "%s", td_future_message(f));
  }
  td_future_unref(f);
  return st;
}

/* ---- __rref_confirm [[id, fork, status], message] (on a user): the owner accepted fork F ---- */

static td_status h_confirm(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  int64_t h[3];
  const char *msg = "";
  if (n != 1 || td_value_list_len(args[0]) != 2 || !int_list_get(td_value_list_get(args[0], 0), h, 3) ||
      td_value_as_string(td_value_list_get(args[0], 1), &msg, NULL) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__rref_confirm: malformed request");
  td__rref_ctx *c;
  TD_TRY(td__rref_ctx_get(td_rpc_ctx_agent(x), true, &c));
  uint64_t fork = (uint64_t)h[1];
  td_status st = (td_status)h[2];
  td__flight_annotate((td__flight_subj){TD__FL_SUBJ_RREF, (uint64_t)h[0]});
  flight_rref(TD__FL_RREF_CONFIRM, td_rpc_ctx_caller_rank(x), (uint64_t)h[0], fork, -1, st);
  td_future *f = NULL;
  early_confirm *ec = NULL;
  pthread_mutex_lock(&c->mu);
  td_rref *r = td__u64map_get(&c->users, fork);
  if (r) {
    if (!__atomic_exchange_n(&r->confirmed, 1, __ATOMIC_ACQ_REL)) f = td_future_ref(r->created);
  } else if (!td__fork_ring_has(&c->done, fork) && !td__u64map_get(&c->early, fork)) {
    ec = td__calloc(1, sizeof *ec);
    if (ec) {
      ec->st = st;
      ec->msg = td__strdup(msg);
      if (!ec->msg || !td__u64map_put(&c->early, fork, ec)) {
        td__free(ec->msg);
        td__free(ec);
      }
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (f) {
    if (st == TD_OK) td_future_complete(f, NULL);
    else td__future_fail_msg(f, st, msg);
    td_future_unref(f);
  }
  td__rref_ctx_unref(c);
  *res = td_value_none();
  return TD_OK;
}

void td__rref_user_register(void) {
  td__rpc_register_internal("__rref_confirm", h_confirm, NULL);
}

/* ---- the argument gate: user functions start once their RRef arguments are usable ---- */

typedef struct gate {
  td_future *all;
  int left; /* atomic: futures not done yet, plus one while collecting */
} gate;

static void gate_release(gate *g) {
  if (__atomic_sub_fetch(&g->left, 1, __ATOMIC_ACQ_REL) != 0) return;
  td_future_complete(g->all, NULL);
  td_future_unref(g->all);
  td__free(g);
}

static void gate_one_done(td_future *f, void *arg) {
  (void)f;
  gate_release(arg);
}

/* Every RRef in v whose creation (creator), confirmation by the owner (other users) or value
 * (owner) is still pending adds one wait to g. */
static void gate_collect(const td_value *v, gate *g, int depth) {
  if (!v || depth > 64) return;
  switch (td_value_kind_of(v)) {
    case TD_VALUE_LIST:
      for (size_t i = 0; i < td_value_list_len(v); i++)
        gate_collect(td_value_list_get(v, i), g, depth + 1);
      return;
    case TD_VALUE_DICT:
      for (size_t i = 0; i < td_value_dict_len(v); i++) {
        td_value *item = NULL;
        if (td_value_dict_entry(v, i, NULL, &item) == TD_OK) gate_collect(item, g, depth + 1);
      }
      return;
    default: break;
  }
  td_rref *r;
  if (td__value_ext_type_of(v) != &rref_type || !(r = td__value_ext_obj(v)) || !r->created ||
      td_future_done(r->created))
    return;
  __atomic_add_fetch(&g->left, 1, __ATOMIC_ACQ_REL);
  if (td_future_on_done(r->created, gate_one_done, g) != TD_OK) gate_release(g);
}

/* Whether v holds an RRef whose creation or confirmation is still pending (gate_collect's test,
 * without registering anything): most requests carry none and need no gate at all. */
static bool any_pending(const td_value *v, int depth) {
  if (!v || depth > 64) return false;
  switch (td_value_kind_of(v)) {
    case TD_VALUE_LIST:
      for (size_t i = 0; i < td_value_list_len(v); i++)
        if (any_pending(td_value_list_get(v, i), depth + 1)) return true;
      return false;
    case TD_VALUE_DICT:
      for (size_t i = 0; i < td_value_dict_len(v); i++) {
        td_value *item = NULL;
        if (td_value_dict_entry(v, i, NULL, &item) == TD_OK && any_pending(item, depth + 1))
          return true;
      }
      return false;
    default: break;
  }
  td_rref *r;
  return td__value_ext_type_of(v) == &rref_type && (r = td__value_ext_obj(v)) && r->created &&
         !td_future_done(r->created);
}

/* As PyTorch waits for a request's pending user RRefs: *wait completes when every RRef among the
 * arguments is confirmed by its owner and, on the owner, when its value exists (a failed
 * creation ends the wait too: the function sees the failure when it uses that RRef). */
td_status td__rref_args_gate(td_value *const *args, int nargs, td_future **wait) {
  *wait = NULL;
  bool pending = false;
  for (int i = 0; i < nargs && !pending; i++) pending = any_pending(args[i], 0);
  if (!pending) return TD_OK; /* (one that completes from here on needs no wait either) */
  gate *g = td__calloc(1, sizeof *g);
  if (!g || !(g->all = td_future_create())) {
    td__free(g);
    return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  g->left = 1;
  for (int i = 0; i < nargs; i++) gate_collect(args[i], g, 0);
  if (__atomic_load_n(&g->left, __ATOMIC_ACQUIRE) > 1) *wait = td_future_ref(g->all);
  gate_release(g);
  if (*wait && td_future_done(*wait)) { /* everything finished meanwhile */
    td_future_unref(*wait);
    *wait = NULL;
  }
  return TD_OK;
}

static td_status rref_arg_gate(td_rpc_agent *a, td_value *const *args, int nargs,
                               td_future **wait) {
  (void)a;
  return td__rref_args_gate(args, nargs, wait);
}

/* ---- registration with the agent (from td_rpc_init) ---- */

static void layer_init_once(void) {
  td__value_ext_register(&rref_type);
  td__rref_objects_init();
  td__rref_owner_register();
  td__rref_user_register();
  td__agent_hooks h = {hook_init, hook_shutdown};
  td__agent_add_hooks(&h);
  td__rpc_set_arg_gate(rref_arg_gate);
}

/* td__rref_layer_init registers this layer with the agent; td_rpc_init calls it (runtime/init.c)
 * before it starts the agent, the only registration path (no load-time constructor: static
 * programs need no dummy reference, and a dlopen()ed library registers nothing behind the
 * caller's back). Idempotent. */
void td__rref_layer_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, layer_init_once);
}

/* td_rref_to_here, as one span in traces. */
td_status td_rref_to_here(td_rref *r, td_timeout_ms timeout_ms, td_value **out) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td_status st = to_here_impl(r, timeout_ms, out);
  if (t0) td__trace_complete("rref", "rref to_here", t0, td__now_ns(), NULL);
  return st;
}
