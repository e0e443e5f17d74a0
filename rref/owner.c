/* owner.c - the owner side of RRefs: the table of entries, the internal handlers that create
 * values, accept and release forks, serve to_here and proxy calls, the debug table and the
 * shutdown report. The protocol is described at the top of rref.c.
 *
 * Entries are reference counted under ctx->mu (the table while live, each owner handle, each
 * piece of pending work); every code path that uses an entry outside the lock holds a reference.
 * An entry leaves the table ("settles") once its creation is done and it has no fork, tombstone
 * or handle; its value is released then, outside the lock.
 *
 * Handlers never block: work that needs a value still being created is chained on the entry's
 * ready future, and user methods run on the agent's pool.
 *
 * Lock order: ctx->mu only (a leaf).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rref_impl.h"
#include "../core/flight_impl.h"

/* ---- entries (ctx->mu held unless said otherwise) ---- */

static td__rref_entry *entry_lookup(td__rref_ctx *c, uint64_t id, bool create) {
  td__rref_entry *e = td__u64map_get(&c->owned, id);
  if (e || !create || c->closed || id == 0) return e;
  e = td__calloc(1, sizeof *e);
  td_future *f = td_future_create();
  if (!e || !f || !td__u64map_put(&c->owned, id, e)) {
    td__free(e);
    td_future_unref(f);
    return NULL;
  }
  e->refs = 1;
  e->id = id;
  e->live = true;
  e->ready = f;
  return e;
}

/* Outside the lock, with the last reference. */
static void entry_free(td__rref_entry *e) {
  td_value_unref(e->value);
  td_future_unref(e->ready);
  td__u64vec_fini(&e->forks);
  td__u64vec_fini(&e->tombs);
  td__free(e->err_msg);
  td__free(e);
}

/* Removes a finished, unused entry from the table; its value goes to *drop. */
static void settle(td__rref_ctx *c, td__rref_entry *e, td_value **drop) {
  if (!e->live || e->state == TD__RREF_PENDING || e->forks.n || e->tombs.n || e->handles) return;
  td__u64map_del(&c->owned, e->id);
  e->live = false;
  *drop = e->value;
  e->value = NULL;
  e->refs--; /* the table's; the caller still holds one */
}

/* Drops the caller's reference and releases what settle took, taking the lock itself. */
static void entry_release(td__rref_ctx *c, td__rref_entry *e, td_value *drop) {
  pthread_mutex_lock(&c->mu);
  bool last = --e->refs == 0;
  pthread_mutex_unlock(&c->mu);
  td_value_unref(drop);
  if (last) entry_free(e);
}

enum { FORK_ADDED, FORK_CANCELLED, FORK_DUP, FORK_REMOVED, FORK_TOMBSTONED, FORK_NOMEM };

static int add_fork(td__rref_ctx *c, td__rref_entry *e, uint64_t f) {
  if (td__u64vec_remove(&e->tombs, f)) {
    td__fork_ring_push(&c->done, f);
    return FORK_CANCELLED;
  }
  if (td__u64vec_has(&e->forks, f) || td__fork_ring_has(&c->done, f)) return FORK_DUP;
  return td__u64vec_push(&e->forks, f) ? FORK_ADDED : FORK_NOMEM;
}

static int del_fork(td__rref_ctx *c, td__rref_entry *e, uint64_t f) {
  if (td__u64vec_remove(&e->forks, f)) {
    td__fork_ring_push(&c->done, f);
    return FORK_REMOVED;
  }
  if (td__u64vec_has(&e->tombs, f) || td__fork_ring_has(&c->done, f)) return FORK_DUP;
  return td__u64vec_push(&e->tombs, f) ? FORK_TOMBSTONED : FORK_NOMEM;
}

/* Sets the outcome of a pending entry (takes value; ignored when already set). msg: the full
 * failure message. */
static void entry_set(td__rref_ctx *c, td__rref_entry *e, td_value *value, td_status st,
                      const char *msg) {
  char *m = st != TD_OK ? td__strdup(msg ? msg : "RRef creation failed") : NULL;
  td_value *drop = NULL;
  pthread_mutex_lock(&c->mu);
  bool set = e->state == TD__RREF_PENDING;
  if (set) {
    e->refs++;
    e->state = st == TD_OK ? TD__RREF_READY : TD__RREF_FAILED;
    if (st == TD_OK) {
      e->value = value;
      value = NULL;
    } else {
      e->err_st = st;
      e->err_msg = m;
      m = NULL;
    }
    settle(c, e, &drop);
  }
  pthread_mutex_unlock(&c->mu);
  td_value_unref(value);
  td__free(m);
  if (!set) return;
  if (st == TD_OK) td_future_complete(e->ready, NULL);
  else td__future_fail_msg(e->ready, st, msg);
  entry_release(c, e, drop);
}

void td__rref_fail_entry(td__rref_ctx *c, td__rref_entry *e, td_status st, const char *msg) {
  entry_set(c, e, NULL, st, msg);
}

td_status td__rref_entry_new_local(td__rref_ctx *c, uint64_t id, td_value *value,
                                   td__rref_entry **out) {
  pthread_mutex_lock(&c->mu);
  td__rref_entry *e = entry_lookup(c, id, true);
  if (e) {
    e->refs++; /* the handle's */
    e->handles++;
    if (value) {
      e->created = true;
      e->state = TD__RREF_READY;
      e->value = td_value_ref(value);
    }
  }
  bool closed = c->closed;
  pthread_mutex_unlock(&c->mu);
  if (!e)
    return td_set_error(closed ? TD_ERR_STATE : TD_ERR_NOMEM, "rref: %s",
                        closed ? "the agent has shut down" : "out of memory");
  if (value) td_future_complete(e->ready, NULL);
  *out = e;
  return TD_OK;
}

td_status td__rref_owner_handle(td__rref_ctx *c, uint64_t id, uint64_t drop_fork, td_rref **out) {
  td_rref *r = td__calloc(1, sizeof *r);
  if (!r) return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  td_value *drop = NULL;
  pthread_mutex_lock(&c->mu);
  td__rref_entry *e = entry_lookup(c, id, true);
  if (e) {
    e->refs++;
    e->handles++;
    if (drop_fork && del_fork(c, e, drop_fork) == FORK_NOMEM)
      td_log(TD_LOG_WARN, "rref: out of memory recording a fork release");
    settle(c, e, &drop);
  }
  pthread_mutex_unlock(&c->mu);
  td_value_unref(drop);
  if (!e) {
    td__free(r);
    return td_set_error(c->closed ? TD_ERR_STATE : TD_ERR_NOMEM, "rref: cannot make a handle");
  }
  td__ref_init(&r->rc);
  td__ref_inc(&c->rc);
  r->ctx = c;
  r->id = id;
  r->owner = c->rank;
  r->entry = e;
  r->created = td_future_ref(e->ready);
  r->confirmed = 1;
  *out = r;
  return TD_OK;
}

td_status td__rref_owner_add_fork(td__rref_ctx *c, td__rref_entry *e, uint64_t f) {
  td_status st = TD_OK;
  pthread_mutex_lock(&c->mu);
  if (!e->live) st = td_set_error(TD_ERR_STATE, "rref: the agent has shut down");
  else if (e->state == TD__RREF_FAILED) st = td_set_error(e->err_st, "%s", e->err_msg);
  else if (add_fork(c, e, f) == FORK_NOMEM) st = td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  pthread_mutex_unlock(&c->mu);
  return st;
}

void td__rref_handle_release(td__rref_ctx *c, td__rref_entry *e) {
  td_value *drop = NULL;
  pthread_mutex_lock(&c->mu);
  e->handles--;
  settle(c, e, &drop);
  pthread_mutex_unlock(&c->mu);
  entry_release(c, e, drop);
}

bool td__rref_entry_pending(td__rref_ctx *c, td__rref_entry *e) {
  pthread_mutex_lock(&c->mu);
  bool pending = e->live && e->state == TD__RREF_PENDING;
  pthread_mutex_unlock(&c->mu);
  return pending;
}

td_status td__rref_entry_read(td__rref_ctx *c, td__rref_entry *e, td_value **out) {
  td_status st = TD_OK;
  pthread_mutex_lock(&c->mu);
  if (e->state == TD__RREF_FAILED) st = td_set_error(e->err_st, "%s", e->err_msg);
  else if (!e->live) st = td_set_error(TD_ERR_STATE, "rref: the agent has shut down");
  else if (e->state == TD__RREF_PENDING)
    st = td_set_error(TD_ERR_STATE, "rref: the value is still being created (wait on the "
                      "creation future first)");
  else *out = td_value_ref(e->value);
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* ---- running registered functions on the owner ---- */

typedef struct invoke {
  td__rref_ctx *c; /* reference */
  td__reg reg;
  char fn[208];
  int caller_rank;
  char caller[128];
  td_value **args; /* owned references */
  int nargs;
  td__rref_entry *target; /* reference or NULL: its value goes first */
  td__rref_entry *dest;   /* reference or NULL: __rref_remote's new entry */
  uint64_t ctx_id;        /* the request's distributed autograd context (0: none) */
  td_future *out;         /* NULL or the outcome of a proxy call */
} invoke;

static void invoke_free(invoke *iv) {
  for (int i = 0; i < iv->nargs; i++) td_value_unref(iv->args[i]);
  td__free(iv->args);
  if (iv->target) entry_release(iv->c, iv->target, NULL);
  if (iv->dest) entry_release(iv->c, iv->dest, NULL);
  td_future_unref(iv->out);
  td__rref_ctx_unref(iv->c);
  td__free(iv);
}

/* Delivers the result (value owned) or the error message, then frees iv. */
static void invoke_finish(invoke *iv, td_status st, td_value *value, const char *msg) {
  if (iv->out) {
    td_value *o = st == TD_OK ? td__rref_outcome_ok(value ? td_value_ref(value) : NULL)
                              : td__rref_outcome_err(st, msg);
    if (o) td_future_complete(iv->out, o);
    else td_future_fail(iv->out, TD_ERR_NOMEM, "rref: out of memory");
  }
  if (iv->dest) {
    if (st == TD_OK) {
      entry_set(iv->c, iv->dest, value ? value : td_value_none(), TD_OK, NULL);
      value = NULL;
    } else {
      static const char pre[] = "RRef creation failed: ";
      bool has = strncmp(msg, pre, sizeof pre - 1) == 0;
      char *m = has ? NULL : td__malloc(strlen(msg) + sizeof pre);
      if (m) sprintf(m, "%s%s", pre, msg);
      entry_set(iv->c, iv->dest, NULL, st, m ? m : msg);
      td__free(m);
    }
  }
  td_value_unref(value);
  invoke_free(iv);
}

static void invoke_fail_fn(invoke *iv, td_status st, const char *why) {
  char msg[1400];
  snprintf(msg, sizeof msg, "%s (rank %d): '%s' failed: %s", td__rref_name(iv->c, iv->c->rank),
           iv->c->rank, iv->fn, why && *why ? why : td_status_str(st));
  invoke_finish(iv, st, NULL, msg);
}

static void invoke_async_done(td_future *f, void *arg) {
  invoke *iv = arg;
  td_status st = td_future_status(f);
  if (st == TD_OK) {
    td_value *v = td_future_value(f);
    invoke_finish(iv, TD_OK, v ? td_value_ref(v) : NULL, NULL);
  } else {
    invoke_fail_fn(iv, st, td_future_message(f));
  }
}

/* Runs the function now (on a pool thread). */
static void invoke_run(invoke *iv) {
  td__rref_ctx *c = iv->c;
  int extra = iv->target ? 1 : 0;
  td_value **argv = td__calloc((size_t)iv->nargs + 1, sizeof *argv);
  if (!argv) {
    invoke_finish(iv, TD_ERR_NOMEM, NULL, "rref: out of memory");
    return;
  }
  if (iv->target) {
    td_value *tv = NULL;
    td_status tst = td__rref_entry_read(c, iv->target, &tv);
    if (tst != TD_OK) {
      td__free(argv);
      invoke_finish(iv, tst, NULL, td_last_error());
      return;
    }
    argv[0] = tv;
  }
  for (int i = 0; i < iv->nargs; i++) argv[i + extra] = iv->args[i];
  td_rpc_ctx x = {c->agent, iv->caller_rank, iv->caller, iv->reg.user_data, iv->fn, 0};
  td_value *res = NULL;
  td_future *fut = NULL;
  td_clear_error();
  /* open while the user function runs on this pool thread, about the RRef it creates (or the one
   * it was called through): a wait on that RRef leads here */
  const td__rref_entry *about = iv->dest ? iv->dest : iv->target;
  td__flight_ev fl = {.kind = TD__FL_HANDLER_START, .peer = iv->caller_rank,
                      .b = about ? about->id : 0, .y = about ? TD__FL_SUBJ_RREF : 0};
  td__flight_push(&fl, iv->fn);
  td_status st = iv->reg.fn(&x, argv, iv->nargs + extra, &res, &fut);
  fl.kind = TD__FL_HANDLER_END;
  fl.x = (uint8_t)st;
  fl.c = fl.y;
  fl.y = st == TD_OK && fut;
  td__flight_pop(&fl, iv->fn);
  if (iv->target) td_value_unref(argv[0]);
  td__free(argv);
  if (st != TD_OK) {
    td_value_unref(res);
    td_future_unref(fut);
    char why[1024];
    snprintf(why, sizeof why, "%s", td_last_error());
    invoke_fail_fn(iv, st, why);
  } else if (fut) {
    td_value_unref(res);
    if (td_future_on_done(fut, invoke_async_done, iv) != TD_OK)
      invoke_fail_fn(iv, TD_ERR_INTERNAL, "cannot wait for its future");
    td_future_unref(fut);
  } else {
    invoke_finish(iv, TD_OK, res, NULL);
  }
}

/* A deferred run (on the pool): inside the request's distributed autograd context, as the
 * handler would have run it. */
static void invoke_task(void *arg) {
  invoke *iv = arg;
  td_rpc_agent *a = iv->c->agent;
  uint64_t ctx_id = iv->ctx_id;
  td__mw_scope scope;
  td__rpc_enter_ctx(a, ctx_id, iv->fn, &scope);
  invoke_run(iv); /* frees iv */
  td__rpc_leave_ctx(a, ctx_id, &scope);
}

/* Runs iv on the pool (or host progress), never on the thread completing a future. */
static void invoke_submit(invoke *iv) {
  td__rref_ctx *c = iv->c;
  td_status st = TD_ERR_STATE;
  pthread_mutex_lock(&c->mu);
  if (!c->closed) {
    c->senders++; /* keeps the agent (and its pool) alive across the submit */
    st = TD_OK;
  }
  pthread_mutex_unlock(&c->mu);
  if (st == TD_OK) {
    /* a user's function runs where user code runs (pool or host progress) */
    bool internal = iv->fn[0] == '_' && iv->fn[1] == '_';
    st = internal ? td__threadpool_submit(td__agent_pool(c->agent), invoke_task, iv)
                  : td__agent_submit_user(c->agent, invoke_task, iv);
    pthread_mutex_lock(&c->mu);
    if (--c->senders == 0 && c->closed) pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
  }
  if (st != TD_OK) invoke_finish(iv, TD_ERR_STATE, NULL, "rref: the agent has shut down");
}

/* The target's value is ready (or failed). */
static void target_ready(td_future *f, void *arg) {
  invoke *iv = arg;
  if (td_future_status(f) != TD_OK) {
    invoke_finish(iv, td_future_status(f), NULL, td_future_message(f));
    return;
  }
  invoke_submit(iv);
}

/* Once the arguments are usable: runs iv when its target's value is there, else once it is
 * (here when this is the handler's pool thread, else through the pool). */
static void invoke_after_args(invoke *iv, bool on_pool) {
  int state = TD__RREF_READY;
  if (iv->target) {
    pthread_mutex_lock(&iv->c->mu);
    state = iv->target->state;
    pthread_mutex_unlock(&iv->c->mu);
  }
  if (state != TD__RREF_PENDING) { /* a failed target reports its creation error */
    if (on_pool) invoke_run(iv);
    else invoke_submit(iv);
  } else if (td_future_on_done(iv->target->ready, target_ready, iv) != TD_OK) {
    invoke_finish(iv, TD_ERR_NOMEM, NULL, "rref: out of memory");
  }
}

static void args_ready(td_future *f, void *arg) {
  td_future_unref(f);
  invoke_after_args(arg, false);
}

/* As td_rpc_sync's requests (rpc/serve.c), a function started by remote() or a proxy call waits
 * until every RRef among its arguments is confirmed by its owner (or, here on the owner, has its
 * value): td__rref_args_gate, without holding a pool thread meanwhile. */
static void invoke_start(invoke *iv) {
  td_future *wait = NULL;
  if (td__rref_args_gate(iv->args, iv->nargs, &wait) != TD_OK) {
    invoke_finish(iv, TD_ERR_NOMEM, NULL, "rref: out of memory");
  } else if (!wait) {
    invoke_after_args(iv, true);
  } else if (td_future_on_done(wait, args_ready, iv) != TD_OK) {
    td_future_unref(wait);
    invoke_finish(iv, TD_ERR_NOMEM, NULL, "rref: out of memory");
  }
}

static invoke *invoke_new(td__rref_ctx *c, td_rpc_ctx *x, const td__reg *reg, const char *fn,
                          td_value *const *args, int nargs) {
  invoke *iv = td__calloc(1, sizeof *iv);
  td_value **a = td__calloc((size_t)(nargs ? nargs : 1), sizeof *a);
  if (!iv || !a) {
    td__free(iv);
    td__free(a);
    return NULL;
  }
  td__ref_inc(&c->rc);
  iv->c = c;
  iv->reg = *reg;
  snprintf(iv->fn, sizeof iv->fn, "%s", fn);
  iv->caller_rank = td_rpc_ctx_caller_rank(x);
  iv->ctx_id = x->ctx_id;
  snprintf(iv->caller, sizeof iv->caller, "%s", td_rpc_ctx_caller_name(x));
  for (int i = 0; i < nargs; i++) a[i] = td_value_ref(args[i]);
  iv->args = a;
  iv->nargs = nargs;
  return iv;
}

/* ---- handlers ---- */

static bool hdr_get(const td_value *l, int64_t *xs, int n) {
  if (td_value_kind_of(l) != TD_VALUE_LIST || (int)td_value_list_len(l) != n) return false;
  for (int i = 0; i < n; i++)
    if (td_value_as_int(td_value_list_get(l, (size_t)i), &xs[i]) != TD_OK) return false;
  return true;
}

/* The running handler serves RRef id (the flight recorder's record of it says so). */
static void annotate(int64_t id) {
  td__flight_annotate((td__flight_subj){TD__FL_SUBJ_RREF, (uint64_t)id});
}

static td_status ctx_of(td_rpc_ctx *x, td__rref_ctx **c) {
  return td__rref_ctx_get(td_rpc_ctx_agent(x), true, c);
}

/* Looks an entry up for a request made through fork `fork` (0: an owner handle) and takes a
 * reference. The entry is created when absent (the creation or fork message may still be on its
 * way), unless the fork has already ended: a late request must not resurrect a freed entry.
 * NULL with the error set when closed, released or out of memory. */
static td__rref_entry *entry_hold(td__rref_ctx *c, uint64_t id, uint64_t fork) {
  pthread_mutex_lock(&c->mu);
  bool gone = fork && td__fork_ring_has(&c->done, fork) && !td__u64map_get(&c->owned, id);
  td__rref_entry *e = gone ? NULL : entry_lookup(c, id, true);
  if (e) e->refs++;
  bool closed = c->closed;
  pthread_mutex_unlock(&c->mu);
  if (!e) {
    char a[48], b[48];
    td_set_error(gone ? TD_ERR_STATE : closed ? TD_ERR_STATE : TD_ERR_NOMEM,
                 "rref: RRef %s (fork %s) %s", td__rref_id_str(id, a, sizeof a),
                 td__rref_id_str(fork, b, sizeof b),
                 gone ? "was already released" : closed ? "cannot be used: the agent has shut "
                 "down" : "cannot be used: out of memory");
  }
  return e;
}

/* Outcome of an entry once ready: [0, value] when with_value, [0, none] otherwise. */
typedef struct reply_arg {
  td__rref_ctx *c;
  td__rref_entry *e;
  bool with_value;
} reply_arg;

static td_value *entry_outcome(td__rref_ctx *c, td__rref_entry *e, bool with_value) {
  td_value *v = NULL;
  td_status st = td__rref_entry_read(c, e, &v);
  if (st != TD_OK) return td__rref_outcome_err(st, td_last_error());
  if (!with_value) {
    td_value_unref(v);
    v = NULL;
  }
  return td__rref_outcome_ok(v);
}

static td_status reply_then(void *arg, td_future *src, td_value **result, td_future **next) {
  reply_arg *ra = arg;
  *result = entry_outcome(ra->c, ra->e, ra->with_value);
  entry_release(ra->c, ra->e, NULL);
  td__rref_ctx_unref(ra->c);
  td__free(ra);
  return *result ? TD_OK : td_set_error(TD_ERR_NOMEM, "rref: out of memory");
}

/* Replies with e's outcome now, or once it is ready. Consumes the caller's reference on e. */
static td_status reply_when_ready(td__rref_ctx *c, td__rref_entry *e, bool with_value,
                                  td_value **res, td_future **fut) {
  if (td_future_done(e->ready)) {
    *res = entry_outcome(c, e, with_value);
    entry_release(c, e, NULL);
    return *res ? TD_OK : td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  reply_arg *ra = td__calloc(1, sizeof *ra);
  if (!ra) {
    entry_release(c, e, NULL);
    return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  td__ref_inc(&c->rc);
  *ra = (reply_arg){c, e, with_value};
  td_status st = td_future_then(e->ready, reply_then, ra, fut);
  if (st != TD_OK) {
    entry_release(c, e, NULL);
    td__rref_ctx_unref(c);
    td__free(ra);
  }
  return st;
}

/* __rref_remote [[id, creator fork, target id], fn, args...] */
static td_status h_remote(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t h[3];
  const char *fn;
  if (n < 2 || !hdr_get(args[0], h, 3) || td_value_as_string(args[1], &fn, NULL) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__rref_remote: malformed request");
  annotate(h[0]);
  td__rref_ctx *c;
  TD_TRY(ctx_of(x, &c));
  bool dup = false, nomem = false;
  td__rref_entry *t = NULL;
  pthread_mutex_lock(&c->mu);
  td__rref_entry *e = entry_lookup(c, (uint64_t)h[0], true);
  if (e) {
    e->refs++;
    dup = e->created;
    e->created = true;
    if (!dup && h[1]) nomem = add_fork(c, e, (uint64_t)h[1]) == FORK_NOMEM;
    if (!dup && h[2]) {
      t = entry_lookup(c, (uint64_t)h[2], true);
      if (t) t->refs++;
    }
  }
  bool closed = c->closed;
  pthread_mutex_unlock(&c->mu);
  if (!e) {
    td__rref_ctx_unref(c);
    return td_set_error(closed ? TD_ERR_STATE : TD_ERR_NOMEM, "rref: cannot create an RRef%s",
                        closed ? " (the agent has shut down)" : " (out of memory)");
  }
  if (!dup) {
    td__reg reg;
    char msg[600];
    if (nomem || (h[2] && !t)) {
      entry_set(c, e, NULL, TD_ERR_NOMEM, "RRef creation failed: out of memory");
    } else if (td__rpc_lookup(fn, &reg) != TD_OK) {
      snprintf(msg, sizeof msg, "RRef creation failed: %s (rank %d): no function '%s' is "
               "registered here", td__rref_name(c, c->rank), c->rank, fn);
      entry_set(c, e, NULL, TD_ERR_NOT_FOUND, msg);
    } else {
      invoke *iv = invoke_new(c, x, &reg, fn, args + 2, n - 2);
      if (!iv) {
        entry_set(c, e, NULL, TD_ERR_NOMEM, "RRef creation failed: out of memory");
      } else {
        pthread_mutex_lock(&c->mu);
        e->refs++;
        pthread_mutex_unlock(&c->mu);
        iv->dest = e;
        iv->target = t;
        t = NULL;
        invoke_start(iv);
      }
    }
    if (t) entry_release(c, t, NULL);
  }
  td_status st = reply_when_ready(c, e, false, res, fut);
  td__rref_ctx_unref(c);
  return st;
}

/* __rref_call [[target id, caller's fork], fn, args...] */
static td_status h_call(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  int64_t h[2];
  const char *fn;
  if (n < 2 || !hdr_get(args[0], h, 2) || td_value_as_string(args[1], &fn, NULL) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__rref_call: malformed request");
  annotate(h[0]);
  td__rref_ctx *c;
  TD_TRY(ctx_of(x, &c));
  td__reg reg;
  td_status st = TD_OK;
  if (td__rpc_lookup(fn, &reg) != TD_OK) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s (rank %d): no function '%s' is registered here",
             td__rref_name(c, c->rank), c->rank, fn);
    *res = td__rref_outcome_err(TD_ERR_NOT_FOUND, msg);
    td__rref_ctx_unref(c);
    return *res ? TD_OK : td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  }
  td__rref_entry *t = entry_hold(c, (uint64_t)h[0], (uint64_t)h[1]);
  if (!t) {
    td__rref_ctx_unref(c);
    return TD_ERR_STATE;
  }
  invoke *iv = invoke_new(c, x, &reg, fn, args + 2, n - 2);
  if (iv) {
    iv->target = t;
    iv->out = td_future_create();
  } else if (t) {
    entry_release(c, t, NULL);
  }
  if (!iv || !iv->out) {
    if (iv) invoke_free(iv);
    st = td_set_error(TD_ERR_NOMEM, "rref: cannot run '%s': out of memory", fn);
  } else {
    *fut = td_future_ref(iv->out);
    invoke_start(iv);
  }
  td__rref_ctx_unref(c);
  return st;
}

/* __rref_fetch [[id, fork]] */
static td_status h_fetch(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  int64_t h[2];
  if (n != 1 || !hdr_get(args[0], h, 2))
    return td_set_error(TD_ERR_FORMAT, "__rref_fetch: malformed request");
  annotate(h[0]);
  td__rref_ctx *c;
  TD_TRY(ctx_of(x, &c));
  td__rref_entry *e = entry_hold(c, (uint64_t)h[0], (uint64_t)h[1]);
  td_status st = e ? reply_when_ready(c, e, true, res, fut) : TD_ERR_STATE;
  td__rref_ctx_unref(c);
  return st;
}

/* TD_RREF_TEST_FORK_DELAY_MS (tests only) delays accepting forks on this worker, so that tests
 * can force a parent's delete or a child's delete to overtake the fork message. */
static int64_t fork_delay_ms(void) {
  static int64_t v = -1;
  int64_t x = __atomic_load_n(&v, __ATOMIC_ACQUIRE);
  if (x < 0) {
    const char *e = getenv("TD_RREF_TEST_FORK_DELAY_MS");
    x = e ? atoll(e) : 0;
    if (x < 0 || x > 10000) x = 0;
    __atomic_store_n(&v, x, __ATOMIC_RELEASE);
  }
  return x;
}

/* __rref_fork [[id, fork, child rank, parent rank]] */
static td_status h_fork(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  int64_t h[4];
  if (n != 1 || !hdr_get(args[0], h, 4))
    return td_set_error(TD_ERR_FORMAT, "__rref_fork: malformed request");
  annotate(h[0]);
  int64_t delay = fork_delay_ms();
  if (delay) {
    struct timespec ts = {delay / 1000, (long)(delay % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  td__rref_ctx *c;
  TD_TRY(ctx_of(x, &c));
  uint64_t f = (uint64_t)h[1];
  int r = FORK_DUP;
  td_status est = TD_OK;
  char *emsg = NULL;
  td_value *drop = NULL;
  pthread_mutex_lock(&c->mu);
  td__rref_entry *e = td__fork_ring_has(&c->done, f) ? NULL : entry_lookup(c, (uint64_t)h[0], true);
  if (e) {
    e->refs++;
    r = add_fork(c, e, f);
    if (e->state == TD__RREF_FAILED) {
      est = e->err_st;
      emsg = td__strdup(e->err_msg);
    }
    settle(c, e, &drop);
  }
  pthread_mutex_unlock(&c->mu);
  if (e) entry_release(c, e, drop);
  td_status st = TD_OK;
  if (r == FORK_NOMEM) st = td_set_error(TD_ERR_NOMEM, "rref: out of memory accepting a fork");
  if (r == FORK_ADDED && h[2] != c->rank && h[2] >= 0 && h[2] < c->world) {
    int64_t ch[3] = {h[0], h[1], est};
    td_value *hdr = td_value_list(), *args2 = td_value_list(), *m = td_value_string(emsg ? emsg : "");
    bool ok = hdr && args2 && m;
    for (int i = 0; ok && i < 3; i++) {
      td_value *v = td_value_int(ch[i]);
      ok = v && td_value_list_append(hdr, v) == TD_OK;
      if (!ok) td_value_unref(v);
    }
    ok = ok && td_value_list_append(args2, hdr) == TD_OK;
    if (ok) hdr = NULL;
    ok = ok && td_value_list_append(args2, m) == TD_OK;
    if (ok) m = NULL;
    td_value_unref(hdr);
    td_value_unref(m);
    /* the parent's __rref_fork is answered once the child has the confirmation (or it was given
     * up): a parent whose fork notice fails tells the child itself (rref.c, fork_notice_done),
     * so a child never waits for a confirmation that an owner that died could not send */
    if (ok) td__rref_control_ex(c, (int)h[2], "__rref_confirm", args2, NULL, fut);
    else td_value_unref(args2);
  }
  td__free(emsg);
  td__rref_ctx_unref(c);
  if (st == TD_OK && !*fut) *res = td_value_none();
  return st;
}

typedef struct release_job {
  td__rref_ctx *c; /* reference */
  td_value *v;
} release_job;

static void release_task(void *arg) {
  release_job *j = arg;
  td_value_unref(j->v);
  __atomic_sub_fetch(&j->c->releasing, 1, __ATOMIC_ACQ_REL);
  td__rref_ctx_unref(j->c);
  td__free(j);
}

static void release_later(td__rref_ctx *c, td_rpc_agent *a, td_value *v) {
  release_job *j = td__malloc(sizeof *j);
  if (j) {
    td__ref_inc(&c->rc);
    *j = (release_job){c, v};
    __atomic_add_fetch(&c->releasing, 1, __ATOMIC_ACQ_REL);
    if (td__threadpool_submit(td__agent_pool(a), release_task, j) == TD_OK) return;
    __atomic_sub_fetch(&c->releasing, 1, __ATOMIC_ACQ_REL);
    td__rref_ctx_unref(c);
    td__free(j);
  }
  td_value_unref(v); /* no pool (shutting down) or no memory: release here */
}

/* __rref_delete [[id, fork]] */
static td_status h_delete(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t h[2];
  if (n != 1 || !hdr_get(args[0], h, 2))
    return td_set_error(TD_ERR_FORMAT, "__rref_delete: malformed request");
  annotate(h[0]);
  td__rref_ctx *c;
  TD_TRY(ctx_of(x, &c));
  uint64_t f = (uint64_t)h[1];
  int r = FORK_DUP;
  td_value *drop = NULL;
  pthread_mutex_lock(&c->mu);
  td__rref_entry *e = td__fork_ring_has(&c->done, f) ? NULL : entry_lookup(c, (uint64_t)h[0], true);
  if (e) {
    e->refs++;
    r = del_fork(c, e, f);
    settle(c, e, &drop);
  }
  pthread_mutex_unlock(&c->mu);
  if (e) entry_release(c, e, NULL);
  /* this runs on the network thread: the value (an opaque object's destructor is user code) is
   * released on the pool; the debug table counts it as "releasing" until then */
  if (drop) release_later(c, td_rpc_ctx_agent(x), drop);
  td__rref_ctx_unref(c);
  if (r == FORK_NOMEM) return td_set_error(TD_ERR_NOMEM, "rref: out of memory releasing a fork");
  *res = td_value_none();
  return TD_OK;
}

void td__rref_owner_register(void) {
  td__rpc_register_internal_ex("__rref_remote", h_remote, NULL, TD__RPC_INLINE_LIKE_ARG1);
  td__rpc_register_internal_ex("__rref_call", h_call, NULL, TD__RPC_INLINE_LIKE_ARG1);
  /* fetches and deletes never block: they run on the network thread (TD_RPC_INLINE) */
  td__rpc_register_internal_ex("__rref_fetch", h_fetch, NULL, TD_RPC_INLINE);
  td__rpc_register_internal("__rref_fork", h_fork, NULL);
  td__rpc_register_internal_ex("__rref_delete", h_delete, NULL, TD_RPC_INLINE);
}

/* ---- debug table ---- */

static td_status dict_put(td_value *d, const char *k, td_value *v) {
  if (!v) return td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  td_status st = td_value_dict_set(d, k, v);
  if (st != TD_OK) td_value_unref(v);
  return st;
}

static td_value *u64_list(const td__u64vec *v) {
  td_value *l = td_value_list();
  for (size_t i = 0; l && i < v->n; i++) {
    td_value *x = td_value_int((int64_t)v->v[i]);
    if (!x || td_value_list_append(l, x) != TD_OK) {
      td_value_unref(x);
      td_value_unref(l);
      return NULL;
    }
  }
  return l;
}

static const char *state_name(int s) {
  return s == TD__RREF_READY ? "ready" : s == TD__RREF_FAILED ? "failed" : "pending";
}

static td_status append_item(td_value *list, td_value *d, td_status st) {
  if (st == TD_OK) st = td_value_list_append(list, d);
  if (st != TD_OK) td_value_unref(d);
  return st;
}

td_status td_rref_debug_table(td_rpc_agent *a, td_value **out) {
  TD_CHECK_ARG(a && out, "rref_debug_table: NULL argument");
  td__rref_ctx *c;
  TD_TRY(td__rref_ctx_get(a, true, &c));
  td_value *owned = td_value_list(), *users = td_value_list(), *root = td_value_dict();
  td_status st = owned && users && root ? TD_OK : td_set_error(TD_ERR_NOMEM, "rref: out of memory");
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; st == TD_OK && i < c->owned.cap; i++) {
    td__rref_entry *e = c->owned.keys[i] ? c->owned.vals[i] : NULL;
    if (!e) continue;
    td_value *d = td_value_dict();
    if (!d) {
      st = td_set_error(TD_ERR_NOMEM, "rref: out of memory");
      break;
    }
    st = dict_put(d, "id", td_value_int((int64_t)e->id));
    if (st == TD_OK) st = dict_put(d, "state", td_value_string(state_name(e->state)));
    if (st == TD_OK) st = dict_put(d, "forks", u64_list(&e->forks));
    if (st == TD_OK) st = dict_put(d, "tombstones", u64_list(&e->tombs));
    if (st == TD_OK) st = dict_put(d, "handles", td_value_int(e->handles));
    st = append_item(owned, d, st);
  }
  for (size_t i = 0; st == TD_OK && i < c->users.cap; i++) {
    td_rref *r = c->users.keys[i] ? c->users.vals[i] : NULL;
    if (!r) continue;
    td_value *d = td_value_dict();
    if (!d) {
      st = td_set_error(TD_ERR_NOMEM, "rref: out of memory");
      break;
    }
    st = dict_put(d, "id", td_value_int((int64_t)r->id));
    if (st == TD_OK) st = dict_put(d, "fork", td_value_int((int64_t)r->fork));
    if (st == TD_OK) st = dict_put(d, "owner", td_value_string(td__rref_name(c, r->owner)));
    if (st == TD_OK)
      st = dict_put(d, "confirmed",
                    td_value_bool(__atomic_load_n(&r->confirmed, __ATOMIC_ACQUIRE) != 0));
    if (st == TD_OK)
      st = dict_put(d, "children",
                    td_value_int(__atomic_load_n(&r->children, __ATOMIC_ACQUIRE)));
    st = append_item(users, d, st);
  }
  int64_t early = (int64_t)c->early.len;
  pthread_mutex_unlock(&c->mu);
  if (st == TD_OK) {
    st = dict_put(root, "owned", owned);
    owned = NULL;
  }
  if (st == TD_OK) {
    st = dict_put(root, "users", users);
    users = NULL;
  }
  if (st == TD_OK) st = dict_put(root, "early_confirms", td_value_int(early));
  if (st == TD_OK)
    st = dict_put(root, "releasing",
                  td_value_int(__atomic_load_n(&c->releasing, __ATOMIC_ACQUIRE)));
  td_value_unref(owned);
  td_value_unref(users);
  if (st == TD_OK) *out = root;
  else td_value_unref(root);
  td__rref_ctx_unref(c);
  return st;
}

/* ---- shutdown ---- */

static void report_add(char *buf, size_t n, size_t *used, const char *fmt, ...) TD_PRINTF(4, 5);
static void report_add(char *buf, size_t n, size_t *used, const char *fmt, ...) {
  if (*used + 4 >= n) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf + *used, n - *used, fmt, ap);
  va_end(ap);
  if (k < 0) return;
  *used += (size_t)k;
  if (*used >= n - 4) {
    *used = n - 4;
    memcpy(buf + *used, "...", 4);
    *used = n;
  }
}

int td__rref_ctx_close(td__rref_ctx *c, bool report, char *buf, size_t n) {
  size_t used = 0;
  int leaks = 0;
  buf[0] = 0;
  pthread_mutex_lock(&c->mu);
  c->closed = true;
  while (c->senders > 0) pthread_cond_wait(&c->cv, &c->mu);
  size_t ne = c->owned.len;
  td__rref_entry **es = td__calloc(ne ? ne : 1, sizeof *es);
  td_value **drops = td__calloc(ne ? ne : 1, sizeof *drops);
  size_t k = 0;
  for (size_t i = 0; i < c->owned.cap; i++) {
    td__rref_entry *e = c->owned.keys[i] ? c->owned.vals[i] : NULL;
    if (!e) continue;
    if (report) {
      char id[48], f[48];
      leaks++;
      report_add(buf, n, &used, "%sowned %s (%s, %zu forks%s%s, %lld handles)", used ? "; " : "",
                 td__rref_id_str(e->id, id, sizeof id), state_name(e->state), e->forks.n,
                 e->forks.n ? " e.g. " : "",
                 e->forks.n ? td__rref_id_str(e->forks.v[0], f, sizeof f) : "",
                 (long long)e->handles);
    }
    e->live = false;
    if (es && drops) {
      drops[k] = e->value;
      e->value = NULL;
      es[k++] = e; /* takes over the table's reference */
    }
  }
  if (es && drops) {
    td__u64map_fini(&c->owned);
  }
  if (report) {
    for (size_t i = 0; i < c->users.cap; i++) {
      td_rref *r = c->users.keys[i] ? c->users.vals[i] : NULL;
      if (!r) continue;
      char id[48], f[48];
      leaks++;
      report_add(buf, n, &used, "%suser %s fork %s (owner %s)", used ? "; " : "",
                 td__rref_id_str(r->id, id, sizeof id), td__rref_id_str(r->fork, f, sizeof f),
                 td__rref_name(c, r->owner));
    }
  }
  pthread_mutex_unlock(&c->mu);
  for (size_t i = 0; i < k; i++) {
    if (!td_future_done(es[i]->ready))
      td__future_fail_msg(es[i]->ready, TD_ERR_STATE, "RRef creation failed: the agent shut down");
    entry_release(c, es[i], drops[i]);
  }
  td__free(es);
  td__free(drops);
  return leaks;
}
