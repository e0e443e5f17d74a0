/* future.c - td_future: a reference-counted, write-once outcome (value, or status + message) with
 * callbacks, chaining (td_future_then) and waits with deadlines.
 *
 * Design:
 * - Each future has a mutex, a condition variable on CLOCK_MONOTONIC (for td_future_wait), a FIFO
 *   of callbacks and a list of watchers (td_future_wait_all's waiters, unlinked when it returns,
 *   so repeated polling never grows any list).
 * - Completion (finish) publishes the outcome under the lock, wakes waiters and watchers, then
 *   runs the callbacks one by one with the lock released, in registration order, on the completing
 *   thread. While it does so the future is "draining": a callback registered meanwhile (from any
 *   thread, including from inside a callback) is queued behind the others and run by the draining
 *   thread, so registration order holds for every callback. Once drained, td_future_on_done runs
 *   the callback at once on the caller's thread.
 * - A pending future whose last reference is dropped while callbacks are registered is failed with
 *   TD_ERR_CANCELLED first, so every accepted callback runs exactly once and chained futures never
 *   hang.
 * - td_future_then registers a callback that runs fn and completes the chained future; when fn
 *   returns a next future, a second callback forwards next's outcome (flattening).
 *
 * Invariants: done never goes back to false; status, message and value never change after done;
 * callbacks and watchers are only touched under mu; cb nodes are owned by the list until popped.
 * Lock order: future->mu, then waiter->mu (td_future_wait_all). No lock is held while a callback
 * runs or while td_set_error/td_log run.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/flight_impl.h"
#include "../core/refcount.h"
#include "../core/tcache.h"
#include "future_impl.h"

typedef struct cb_node {
  td_future_cb cb;
  void *ctx;
  struct cb_node *next;
} cb_node;

/* A td_future_wait_all call: woken by any watched future's completion. */
typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool signaled; /* a watched future completed since the last check */
} waiter;

typedef struct watch_node {
  waiter *w;
  bool linked;
  struct watch_node *prev, *next;
} watch_node;

struct td_future {
  td__refcnt rc;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC; broadcast when done */
  bool done;         /* outcome published (written under mu, atomically: also read without) */
  bool draining;     /* the completing thread is still running callbacks */
  bool had_callbacks; /* written under mu, atomically: also read without it */
  td_status status;
  char *message;   /* heap, or NULL for "" */
  td_value *value; /* owned; td_value_none() when completed with NULL */
  cb_node *cb_head, *cb_tail;
  watch_node *watchers;
  /* what a wait on it waits for, in the flight recorder: set once by the call that made it,
   * before the future is shared (fl_peer -1: not a call's future) */
  int32_t fl_peer;
  uint64_t fl_id;
  char fl_name[TD__FLIGHT_NAME];
  uint8_t fl_subj_kind; /* td__flight_subj_kind of what it is about */
  uint64_t fl_subj_id;
};

/* ---- clocks ---- */

static int cond_init_monotonic(pthread_cond_t *cv) {
  pthread_condattr_t a;
  int rc = pthread_condattr_init(&a);
  if (rc) return rc;
  rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  if (!rc) rc = pthread_cond_init(cv, &a);
  pthread_condattr_destroy(&a);
  return rc;
}

/* deadline_after returns now + ms on CLOCK_MONOTONIC (ms >= 0). */
static struct timespec deadline_after(int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t max_ms = (int64_t)1 << 50; /* ~35,000 years: no overflow below */
  if (ms > max_ms) ms = max_ms;
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec += 1;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

/* ---- lifecycle ---- */

td_future *td_future_create(void) {
  td_future *f = td__tc_calloc(sizeof *f); /* a call makes one: from the thread's cache */
  if (!f) return NULL;
  if (pthread_mutex_init(&f->mu, NULL)) goto fail_free;
  if (cond_init_monotonic(&f->cv)) goto fail_mu;
  td__ref_init(&f->rc);
  f->status = TD_ERR_STATE;
  f->fl_peer = -1;
  return f;
fail_mu:
  pthread_mutex_destroy(&f->mu);
fail_free:
  td__tc_free(f, sizeof *f);
  return NULL;
}

td_future *td_future_ref(td_future *f) {
  if (f) td__ref_inc(&f->rc);
  return f;
}

static td_status finish(td_future *f, td_value *value, td_status st, char *msg);

void td_future_unref(td_future *f) {
  if (!f || !td__ref_dec(&f->rc)) return;
  /* the last reference: nobody else can touch f now (the decrement ordered their writes before
   * these reads), so no lock */
  bool abandoned = !f->done && f->cb_head;
  if (abandoned) {
    /* Nobody can complete it any more: fail it so its callbacks still run exactly once. The
     * callbacks may take references; the future then lives on, done. */
    td__ref_init(&f->rc);
    finish(f, NULL, TD_ERR_CANCELLED,
           td__strdup("future abandoned: last reference dropped while pending"));
    td_future_unref(f);
    return;
  }
  TD_ASSERT(!f->watchers && !f->cb_head);
  td_value_unref(f->value);
  td__free(f->message);
  pthread_cond_destroy(&f->cv);
  pthread_mutex_destroy(&f->mu);
  td__tc_free(f, sizeof *f);
}

/* ---- completion ---- */

/* drain runs the queued callbacks in order. Called with f->mu held and f->draining set; returns
 * with f->mu released and f->draining cleared. */
static void drain(td_future *f) {
  while (f->cb_head) {
    cb_node *n = f->cb_head;
    f->cb_head = n->next;
    if (!f->cb_head) f->cb_tail = NULL;
    pthread_mutex_unlock(&f->mu);
    n->cb(f, n->ctx);
    td__free(n);
    pthread_mutex_lock(&f->mu);
  }
  f->draining = false;
  pthread_mutex_unlock(&f->mu);
}

/* finish publishes an outcome exactly once, wakes waiters, then runs the callbacks. Takes
 * ownership of value and msg in every case. */
static td_status finish(td_future *f, td_value *value, td_status st, char *msg) {
  td_future_ref(f); /* keep f alive while callbacks run, whatever they release */
  pthread_mutex_lock(&f->mu);
  if (f->done) {
    pthread_mutex_unlock(&f->mu);
    td_value_unref(value);
    td__free(msg);
    td_future_unref(f);
    return td_set_error(TD_ERR_STATE, "future: already completed");
  }
  f->status = st;
  f->message = msg;
  f->value = st == TD_OK ? (value ? value : td_value_none()) : NULL;
  if (st != TD_OK) td_value_unref(value);
  __atomic_store_n(&f->done, true, __ATOMIC_RELEASE); /* last: td_future_done reads it unlocked */
  f->draining = true;
  pthread_cond_broadcast(&f->cv);
  for (watch_node *n = f->watchers; n; n = n->next) {
    pthread_mutex_lock(&n->w->mu);
    n->w->signaled = true;
    pthread_cond_signal(&n->w->cv);
    pthread_mutex_unlock(&n->w->mu);
  }
  drain(f);
  td_future_unref(f);
  return TD_OK;
}

td_status td_future_complete(td_future *f, td_value *value) {
  if (!f) {
    td_value_unref(value);
    return td_set_error(TD_ERR_INVALID, "future_complete: NULL future");
  }
  return finish(f, value, TD_OK, NULL);
}

td_status td__future_fail_msg(td_future *f, td_status st, const char *msg) {
  TD_CHECK_ARG(f, "future_fail: NULL future");
  TD_CHECK_ARG(st != TD_OK, "future_fail: status must be an error, not TD_OK");
  char *copy = msg && *msg ? td__strdup(msg) : NULL; /* out of memory: fail without text */
  return finish(f, NULL, st, copy);
}

td_status td_future_fail(td_future *f, td_status st, const char *fmt, ...) {
  TD_CHECK_ARG(f, "future_fail: NULL future");
  TD_CHECK_ARG(st != TD_OK, "future_fail: status must be an error, not TD_OK");
  char *msg = NULL;
  if (fmt) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k > 0 && (msg = td__malloc((size_t)k + 1)) != NULL) vsnprintf(msg, (size_t)k + 1, fmt, ap2);
    va_end(ap2);
  }
  return finish(f, NULL, st, msg);
}

/* ---- queries ---- */

bool td_future_done(const td_future *cf) {
  if (!cf) return false;
  /* without the lock (a waiter polls it): done is stored last, with release, under mu */
  return __atomic_load_n(&cf->done, __ATOMIC_ACQUIRE);
}

td_status td_future_status(const td_future *cf) {
  if (!cf) return TD_ERR_INVALID;
  td_future *f = (td_future *)cf;
  pthread_mutex_lock(&f->mu);
  td_status st = f->done ? f->status : TD_ERR_STATE;
  pthread_mutex_unlock(&f->mu);
  return st;
}

const char *td_future_message(const td_future *cf) {
  if (!cf) return "";
  td_future *f = (td_future *)cf;
  pthread_mutex_lock(&f->mu);
  const char *m = f->done && f->message ? f->message : "";
  pthread_mutex_unlock(&f->mu);
  return m;
}

td_value *td_future_value(const td_future *cf) {
  if (!cf) return NULL;
  td_future *f = (td_future *)cf;
  /* value is set before done is published (release) and never changes after */
  return __atomic_load_n(&f->done, __ATOMIC_ACQUIRE) ? f->value : NULL;
}

bool td__future_has_callbacks(td_future *f) {
  if (!f) return false;
  return __atomic_load_n(&f->had_callbacks, __ATOMIC_ACQUIRE);
}

/* failure_error copies a done, failed future's outcome into this thread's error text. */
static td_status failure_error(td_future *f) {
  const char *m = f->message ? f->message : td_status_str(f->status);
  return td_set_error(f->status, "%s", m);
}

/* The calling thread's pump (host-driven progress, rpc/progress.c): runs while it waits. */
static _Thread_local void (*wait_pump)(void *);
static _Thread_local void *wait_pump_ud;

void td__future_set_wait_pump(void (*pump)(void *ud), void *ud) {
  wait_pump = pump;
  wait_pump_ud = ud;
}

/* Work this thread holds back and must hand over before it blocks (td__future_set_before_block). */
static _Thread_local void (*before_block)(void *);
static _Thread_local void *before_block_ud;

void td__future_set_before_block(void (*fn)(void *ud), void *ud) {
  before_block = fn;
  before_block_ud = ud;
}

/* Runs (once) the hook of the work this thread holds back: it is about to block. */
static void hand_over_before_block(void) {
  void (*fn)(void *) = before_block;
  if (!fn) return;
  before_block = NULL;
  fn(before_block_ud);
}

/* The wait poller (td__future_set_wait_poller): read-locked while a waiter uses it; a writer
 * (removing it) goes first, so waiters that keep coming cannot hold it off. */
#ifdef PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP
static pthread_rwlock_t poller_lock = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
#else
static pthread_rwlock_t poller_lock = PTHREAD_RWLOCK_INITIALIZER;
#endif
static td__wait_poller poller;

void td__future_set_wait_poller(const td__wait_poller *p, void *ud) {
  pthread_rwlock_wrlock(&poller_lock);
  if (p) poller = *p;
  else if (poller.ud == ud) memset(&poller, 0, sizeof poller);
  pthread_rwlock_unlock(&poller_lock);
}

/* Whether a wait on fs[0..n) is over: all done (wait_all: or one failed). */
static bool wait_over(td_future *const *fs, int n) {
  bool all = true;
  for (int i = 0; i < n; i++) {
    if (!td_future_done(fs[i])) all = false;
    else if (n > 1 && td_future_status(fs[i]) != TD_OK) return true;
  }
  return all;
}

/* Before blocking on fs[0..n): drive the poller while it makes progress or its window lasts, for
 * at most timeout_ms (< 0: none) and never longer than 10 ms in all (then the lane's own thread
 * takes over again). */
static void poll_before_wait_n(td_future *const *fs, int n, td_timeout_ms timeout_ms) {
  if (wait_pump || pthread_rwlock_tryrdlock(&poller_lock) != 0) return;
  int64_t w = poller.poll ? poller.window_ns(poller.ud) : 0;
  if (w > 0) {
    poller.enter(poller.ud);
    uint64_t t0 = td__now_ns(), last = t0;
    uint64_t cap = timeout_ms > 0 && timeout_ms < 10 ? (uint64_t)timeout_ms * 1000000u
                                                      : 10000000u;
    while (!wait_over(fs, n)) {
      uint64_t now = td__now_ns();
      if (now - t0 > cap) break;
      if (poller.poll(poller.ud)) last = now;
      else if (now - last > (uint64_t)w) break;
    }
    poller.leave(poller.ud);
  }
  pthread_rwlock_unlock(&poller_lock);
}

static void poll_before_wait(td_future *f, td_timeout_ms timeout_ms) {
  poll_before_wait_n(&f, 1, timeout_ms);
}

/* Waits on cv until *deadline (NULL: no deadline), in slices of 2 ms with the pump run between
 * them when this thread has one. Caller holds mu. Returns ETIMEDOUT at the deadline. */
static int cond_wait_pumped(pthread_cond_t *cv, pthread_mutex_t *mu,
                            const struct timespec *deadline) {
  if (!wait_pump) return deadline ? pthread_cond_timedwait(cv, mu, deadline)
                                  : pthread_cond_wait(cv, mu);
  pthread_mutex_unlock(mu);
  wait_pump(wait_pump_ud);
  pthread_mutex_lock(mu);
  struct timespec slice = deadline_after(2);
  if (deadline && (deadline->tv_sec < slice.tv_sec ||
                   (deadline->tv_sec == slice.tv_sec && deadline->tv_nsec < slice.tv_nsec)))
    return pthread_cond_timedwait(cv, mu, deadline);
  pthread_cond_timedwait(cv, mu, &slice);
  return 0;
}

void td__future_set_flight(td_future *f, int peer, uint64_t call_id, const char *fn) {
  f->fl_peer = peer;
  f->fl_id = call_id;
  td__strcpy_trunc(f->fl_name, sizeof f->fl_name, fn);
}

void td__future_set_flight_subject(td_future *f, int kind, uint64_t id) {
  f->fl_subj_kind = (uint8_t)kind;
  f->fl_subj_id = id;
}

/* The open record of a wait on f. */
static td__flight_ev wait_ev(const td_future *f, td_timeout_ms timeout_ms) {
  return (td__flight_ev){.kind = TD__FL_WAIT_BEGIN, .peer = f->fl_peer, .a = f->fl_id,
                         .b = f->fl_subj_id, .y = f->fl_subj_kind,
                         .c = td__flight_timeout_field(timeout_ms)};
}

/* A wait that ends by its deadline, by its call's (TD_ERR_TIMEOUT), or by the loss of the worker
 * it waits on (TD_ERR_UNAVAILABLE) asks for a dump while its record is still open. */
static bool wait_dumps(td_status st) { return st == TD_ERR_TIMEOUT || st == TD_ERR_UNAVAILABLE; }

static void wait_expired(const td_future *f, bool lost) {
  char what[120];
  snprintf(what, sizeof what, "%s of the wait for %s%s", lost ? "peer lost" : "deadline",
           f->fl_peer >= 0 ? "call " : "a future", f->fl_peer >= 0 ? f->fl_name : "");
  td__flight_deadline(what);
}

/* A wait that blocks is an open record of the flight recorder while it lasts (and counts in the
 * process's waiting time); one that ends as wait_dumps says asks for a dump while still open. */
td_status td_future_wait(td_future *f, td_timeout_ms timeout_ms) {
  TD_CHECK_ARG(f, "future_wait: NULL future");
  TD_CHECK_ARG(td__timeout_valid(timeout_ms), "future_wait: invalid timeout %lld",
               (long long)timeout_ms);
  struct timespec deadline;
  if (timeout_ms > 0) deadline = deadline_after(timeout_ms);
  if (timeout_ms != 0 && !td_future_done(f)) poll_before_wait(f, timeout_ms);
  pthread_mutex_lock(&f->mu);
  bool blocked = !f->done && timeout_ms != 0;
  if (blocked && before_block) {
    pthread_mutex_unlock(&f->mu);
    hand_over_before_block();
    pthread_mutex_lock(&f->mu);
    blocked = !f->done;
  }
  td__flight_ev ev = wait_ev(f, timeout_ms);
  uint64_t t0 = blocked ? td__now_ns() : 0;
  if (blocked) td__flight_push(&ev, f->fl_name);
  while (!f->done && timeout_ms != 0) {
    if (cond_wait_pumped(&f->cv, &f->mu, timeout_ms < 0 ? NULL : &deadline) == ETIMEDOUT) break;
  }
  bool done = f->done;
  pthread_mutex_unlock(&f->mu);
  if (blocked) {
    td__flight_count_wait(td__now_ns() - t0);
    if (!done || wait_dumps(f->status)) wait_expired(f, done && f->status == TD_ERR_UNAVAILABLE);
    ev.kind = TD__FL_WAIT_END;
    ev.b = done ? (uint64_t)f->status : (uint64_t)TD_ERR_TIMEOUT;
    td__flight_pop(&ev, f->fl_name);
  }
  if (!done)
    return td_set_error(TD_ERR_TIMEOUT, "future_wait: not done after %lld ms",
                        (long long)timeout_ms);
  /* Outcome fields are immutable once done; the caller's reference keeps them alive. */
  return f->status == TD_OK ? TD_OK : failure_error(f);
}

/* ---- callbacks ---- */

static td_status on_done(td_future *f, td_future_cb cb, void *ctx, bool light);

td_status td_future_on_done(td_future *f, td_future_cb cb, void *ctx) {
  return on_done(f, cb, ctx, false);
}

td_status td__future_on_done_light(td_future *f, td_future_cb cb, void *ctx) {
  return on_done(f, cb, ctx, true);
}

static td_status on_done(td_future *f, td_future_cb cb, void *ctx, bool light) {
  TD_CHECK_ARG(f && cb, "future_on_done: NULL %s", f ? "callback" : "future");
  cb_node *n = td__malloc(sizeof *n);
  if (!n) return td_set_error(TD_ERR_NOMEM, "future_on_done: out of memory");
  n->cb = cb;
  n->ctx = ctx;
  n->next = NULL;
  pthread_mutex_lock(&f->mu);
  if (!light) __atomic_store_n(&f->had_callbacks, true, __ATOMIC_RELEASE);
  if (!f->done || f->draining) {
    if (f->cb_tail) f->cb_tail->next = n;
    else f->cb_head = n;
    f->cb_tail = n;
    pthread_mutex_unlock(&f->mu);
    return TD_OK;
  }
  pthread_mutex_unlock(&f->mu);
  td__free(n);
  cb(f, ctx);
  return TD_OK;
}

/* ---- chaining ---- */

typedef struct then_ctx {
  td_future *out; /* the chained future (one reference) */
  td_future_then_fn fn;
  void *ctx;
  /* td__future_then_light: where the rest goes when out has callbacks of its own */
  td_status (*submit)(void *ud, void (*task)(void *), void *arg);
  void *submit_ud;
  td_future *src; /* the source, while the rest waits for the pool */
} then_ctx;

/* forward_cb copies the outcome of the future fn returned (src) into the chained future. */
static void forward_cb(td_future *src, void *p) {
  td_future *out = p;
  td_status st = td_future_status(src);
  if (st == TD_OK) td_future_complete(out, td_value_ref(td_future_value(src)));
  else td__future_fail_msg(out, st, td_future_message(src));
  td_future_unref(out);
}

static void then_cb(td_future *src, void *p) {
  then_ctx *t = p;
  td_value *result = NULL;
  td_future *next = NULL;
  td_clear_error();
  td_status st = t->fn(t->ctx, src, &result, &next);
  if (st != TD_OK) {
    td_value_unref(result);
    td_future_unref(next);
    const char *m = td_last_error();
    td__future_fail_msg(t->out, st, m[0] ? m : td_status_str(st));
  } else if (next && result) {
    td_value_unref(result);
    td_future_unref(next);
    td__future_fail_msg(t->out, TD_ERR_INVALID,
                        "future_then: the callback set both a result and a next future");
  } else if (next) {
    td_future *out = td_future_ref(t->out);
    if (td_future_on_done(next, forward_cb, out) != TD_OK) {
      td__future_fail_msg(out, TD_ERR_NOMEM, "future_then: out of memory following next future");
      td_future_unref(out);
    }
    /* Dropping our reference is safe: if it was the last one, next is abandoned and forward_cb
     * sees TD_ERR_CANCELLED. */
    td_future_unref(next);
  } else {
    td_future_complete(t->out, result);
  }
  td_future_unref(t->out);
  td__free(t);
}

static td_status then_register(td_future *f, td_future_then_fn fn, void *ctx, bool light,
                               td_status (*submit)(void *, void (*)(void *), void *),
                               void *submit_ud, td_future **out);

td_status td_future_then(td_future *f, td_future_then_fn fn, void *ctx, td_future **out) {
  return then_register(f, fn, ctx, false, NULL, NULL, out);
}

/* The rest of a light then on the pool: the chained future had callbacks of its own. */
static void then_task(void *arg) {
  then_ctx *t = arg;
  td_future *src = t->src;
  t->src = NULL;
  then_cb(src, t);
  td_future_unref(src);
}

/* A light then's callback: runs on the thread that completes the source (it does not make the
 * source hop to the pool); fn is light, and the chained future completes here too unless it has
 * callbacks of its own (user code), which go to the pool as they would have. */
static void then_light_cb(td_future *src, void *p) {
  then_ctx *t = p;
  if (t->submit && td__future_has_callbacks(t->out)) {
    t->src = td_future_ref(src);
    if (t->submit(t->submit_ud, then_task, t) == TD_OK) return;
    td_future_unref(t->src); /* the pool is shutting down: here after all */
    t->src = NULL;
  }
  then_cb(src, t);
}

td_status td__future_then_light(td_future *f, td_future_then_fn fn, void *ctx,
                                td_status (*submit)(void *ud, void (*task)(void *), void *arg),
                                void *submit_ud, td_future **out) {
  return then_register(f, fn, ctx, true, submit, submit_ud, out);
}

static td_status then_register(td_future *f, td_future_then_fn fn, void *ctx, bool light,
                               td_status (*submit)(void *, void (*)(void *), void *),
                               void *submit_ud, td_future **out) {
  TD_CHECK_ARG(f && fn && out, "future_then: NULL argument");
  td_future *g = td_future_create();
  then_ctx *t = td__malloc(sizeof *t);
  if (!g || !t) {
    td_future_unref(g);
    td__free(t);
    return td_set_error(TD_ERR_NOMEM, "future_then: out of memory");
  }
  /* a wait on the chained future waits for what f waits for (fields set before f was shared) */
  g->fl_peer = f->fl_peer;
  g->fl_id = f->fl_id;
  memcpy(g->fl_name, f->fl_name, sizeof g->fl_name);
  g->fl_subj_kind = f->fl_subj_kind;
  g->fl_subj_id = f->fl_subj_id;
  t->out = td_future_ref(g);
  t->fn = fn;
  t->ctx = ctx;
  t->submit = submit;
  t->submit_ud = submit_ud;
  t->src = NULL;
  td_status st = light ? td__future_on_done_light(f, then_light_cb, t)
                       : td_future_on_done(f, then_cb, t);
  if (st != TD_OK) {
    td_future_unref(g);
    td_future_unref(g);
    td__free(t);
    return st;
  }
  *out = g;
  return TD_OK;
}

/* ---- waiting for many ---- */

/* scan returns 1 when every future succeeded, -1 when one failed (its index in *failed, the
 * lowest such), 0 otherwise. */
static int scan(td_future *const *fs, int n, int *failed) {
  bool all = true;
  for (int i = 0; i < n; i++) {
    td_future *f = fs[i];
    pthread_mutex_lock(&f->mu);
    bool done = f->done;
    td_status st = f->status;
    pthread_mutex_unlock(&f->mu);
    if (!done) {
      all = false;
    } else if (st != TD_OK) {
      *failed = i;
      return -1;
    }
  }
  return all ? 1 : 0;
}

static td_status scan_result(td_future *const *fs, int r, int failed) {
  if (r > 0) return TD_OK;
  td_future *f = fs[failed];
  const char *m = td_future_message(f);
  td_status st = td_future_status(f);
  return td_set_error(st, "future %d of the set failed: %s", failed, m[0] ? m : td_status_str(st));
}

td_status td_future_wait_all(td_future *const *fs, int n, td_timeout_ms timeout_ms) {
  TD_CHECK_ARG(n >= 0 && (fs || n == 0), "future_wait_all: bad array (n = %d)", n);
  TD_CHECK_ARG(td__timeout_valid(timeout_ms), "future_wait_all: invalid timeout %lld",
               (long long)timeout_ms);
  for (int i = 0; i < n; i++) TD_CHECK_ARG(fs[i], "future_wait_all: future %d is NULL", i);
  int failed = -1;
  int r = scan(fs, n, &failed);
  if (r != 0) return scan_result(fs, r, failed);
  if (timeout_ms == 0)
    return td_set_error(TD_ERR_TIMEOUT, "future_wait_all: not done after 0 ms");
  poll_before_wait_n(fs, n, timeout_ms); /* the replies may be taken by this thread */
  r = scan(fs, n, &failed);
  if (r != 0) return scan_result(fs, r, failed);
  hand_over_before_block();

  struct timespec deadline;
  if (timeout_ms > 0) deadline = deadline_after(timeout_ms);
  waiter w = {.signaled = false};
  watch_node *nodes = td__calloc((size_t)n, sizeof *nodes);
  if (!nodes) return td_set_error(TD_ERR_NOMEM, "future_wait_all: out of memory");
  if (pthread_mutex_init(&w.mu, NULL)) {
    td__free(nodes);
    return td_set_error(TD_ERR_NOMEM, "future_wait_all: cannot create a mutex");
  }
  if (cond_init_monotonic(&w.cv)) {
    pthread_mutex_destroy(&w.mu);
    td__free(nodes);
    return td_set_error(TD_ERR_NOMEM, "future_wait_all: cannot create a condition variable");
  }
  for (int i = 0; i < n; i++) {
    td_future *f = fs[i];
    pthread_mutex_lock(&f->mu);
    if (!f->done) {
      nodes[i].w = &w;
      nodes[i].linked = true;
      nodes[i].next = f->watchers;
      if (f->watchers) f->watchers->prev = &nodes[i];
      f->watchers = &nodes[i];
    }
    pthread_mutex_unlock(&f->mu);
  }

  /* one open record for the set, naming its first future not done yet */
  int first = 0;
  for (int i = 0; i < n; i++)
    if (nodes[i].linked) {
      first = i;
      break;
    }
  td__flight_ev ev = wait_ev(fs[first], timeout_ms);
  ev.x = 1;
  ev.c = (uint32_t)n;
  td__flight_push(&ev, fs[first]->fl_name);
  uint64_t t0 = td__now_ns();
  bool timed_out = false;
  for (;;) {
    r = scan(fs, n, &failed);
    if (r != 0 || timed_out) break;
    pthread_mutex_lock(&w.mu);
    while (!w.signaled && !timed_out) {
      if (cond_wait_pumped(&w.cv, &w.mu, timeout_ms < 0 ? NULL : &deadline) == ETIMEDOUT)
        timed_out = true;
      if (wait_pump) break; /* a pumped slice: look at the futures again */
    }
    w.signaled = false;
    pthread_mutex_unlock(&w.mu);
  }

  for (int i = 0; i < n; i++) {
    if (!nodes[i].linked) continue;
    td_future *f = fs[i];
    pthread_mutex_lock(&f->mu);
    if (nodes[i].prev) nodes[i].prev->next = nodes[i].next;
    else f->watchers = nodes[i].next;
    if (nodes[i].next) nodes[i].next->prev = nodes[i].prev;
    pthread_mutex_unlock(&f->mu);
  }
  td__flight_count_wait(td__now_ns() - t0);
  pthread_cond_destroy(&w.cv);
  pthread_mutex_destroy(&w.mu);
  td__free(nodes);
  td_status fst = r < 0 ? td_future_status(fs[failed]) : TD_OK;
  if (r == 0 || (r < 0 && wait_dumps(fst)))
    wait_expired(fs[r == 0 ? first : failed], fst == TD_ERR_UNAVAILABLE);
  ev.kind = TD__FL_WAIT_END;
  ev.b = r > 0 ? TD_OK : r < 0 ? (uint64_t)fst : (uint64_t)TD_ERR_TIMEOUT;
  td__flight_pop(&ev, fs[first]->fl_name);
  if (r != 0) return scan_result(fs, r, failed);
  return td_set_error(TD_ERR_TIMEOUT, "future_wait_all: not all done after %lld ms",
                      (long long)timeout_ms);
}
