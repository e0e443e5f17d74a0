/* test_futures.c - td_future: completion exactly once, waits and timeouts, callbacks (order,
 * exactly once, inline when done), then-chaining (value, error, next future, failed source),
 * wait_all (success, fail-fast, timeout) and completion races between threads.
 * Lock order: a callback log's mu is a leaf. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "rpc/future_impl.h"
#include "rpc/value_impl.h"
#include "test_util.h"

static double now_ms(void) { return td_test_now_s() * 1e3; }

/* A counted extension value: tells whether a value handed to a future was released. */
static int tracked_destroyed;
static void tracked_destroy(void *obj) {
  __atomic_add_fetch(&tracked_destroyed, 1, __ATOMIC_RELAXED);
}
static const td__value_ext_type tracked_type = {.name = "test.Tracked", .destroy = tracked_destroy};

static int64_t int_of(const td_value *v) {
  int64_t x = -999;
  TD_ASSERT_OK(td_value_as_int(v, &x));
  return x;
}

/* ---- completion ---- */

static void test_future_complete_once(void **state) {
  td_future *f = td_future_create();
  assert_non_null(f);
  assert_false(td_future_done(f));
  assert_int_equal(td_future_status(f), TD_ERR_STATE);
  assert_null(td_future_value(f));
  assert_string_equal(td_future_message(f), "");

  TD_ASSERT_OK(td_future_complete(f, td_value_int(5)));
  assert_true(td_future_done(f));
  assert_int_equal(td_future_status(f), TD_OK);
  assert_int_equal(int_of(td_future_value(f)), 5);
  TD_ASSERT_OK(td_future_wait(f, 0));

  /* Later attempts fail and release what they were given. */
  tracked_destroyed = 0;
  TD_ASSERT_STATUS(td_future_complete(f, td__value_ext(&tracked_type, NULL)), TD_ERR_STATE);
  assert_int_equal(tracked_destroyed, 1);
  TD_ASSERT_STATUS(td_future_fail(f, TD_ERR_IO, "late"), TD_ERR_STATE);
  TD_ASSERT_STATUS(td__future_fail_msg(f, TD_ERR_IO, "late"), TD_ERR_STATE);
  assert_int_equal(td_future_status(f), TD_OK);
  assert_int_equal(int_of(td_future_value(f)), 5);
  td_future_unref(f);

  /* Completing with NULL means none. */
  td_future *g = td_future_create();
  TD_ASSERT_OK(td_future_complete(g, NULL));
  assert_non_null(td_future_value(g));
  assert_int_equal(td_value_kind_of(td_future_value(g)), TD_VALUE_NONE);
  td_future_unref(g);

  /* NULL future: the value is still released. */
  tracked_destroyed = 0;
  TD_ASSERT_STATUS(td_future_complete(NULL, td__value_ext(&tracked_type, NULL)), TD_ERR_INVALID);
  assert_int_equal(tracked_destroyed, 1);
  td_future_unref(NULL);
  assert_null(td_future_ref(NULL));
}

static void test_future_fail_once(void **state) {
  td_future *f = td_future_create();
  TD_ASSERT_STATUS(td_future_fail(f, TD_OK, "not an error"), TD_ERR_INVALID);
  assert_false(td_future_done(f));
  TD_ASSERT_OK(td_future_fail(f, TD_ERR_IO, "disk %d of %s", 3, "sda"));
  assert_true(td_future_done(f));
  assert_int_equal(td_future_status(f), TD_ERR_IO);
  assert_string_equal(td_future_message(f), "disk 3 of sda");
  assert_null(td_future_value(f));
  td_clear_error();
  TD_ASSERT_STATUS(td_future_wait(f, -1), TD_ERR_IO);
  assert_string_equal(td_last_error(), "disk 3 of sda");
  tracked_destroyed = 0;
  TD_ASSERT_STATUS(td_future_complete(f, td__value_ext(&tracked_type, NULL)), TD_ERR_STATE);
  assert_int_equal(tracked_destroyed, 1);
  TD_ASSERT_STATUS(td_future_fail(f, TD_ERR_TIMEOUT, "again"), TD_ERR_STATE);
  assert_int_equal(td_future_status(f), TD_ERR_IO);
  td_future_unref(f);

  /* Long messages are not cut; td__future_fail_msg copies verbatim (no formatting). */
  char big[5000];
  memset(big, 'm', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  td_future *g = td_future_create();
  TD_ASSERT_OK(td_future_fail(g, TD_ERR_REMOTE, "%s|%d", big, 42));
  assert_int_equal(strlen(td_future_message(g)), sizeof big - 1 + 3);
  assert_string_equal(td_future_message(g) + sizeof big - 1, "|42");
  td_future_unref(g);
  td_future *h = td_future_create();
  TD_ASSERT_OK(td__future_fail_msg(h, TD_ERR_REMOTE, "100% %s %d"));
  assert_string_equal(td_future_message(h), "100% %s %d");
  td_future_unref(h);
  /* A failure without text waits with the generic message. */
  td_future *k = td_future_create();
  TD_ASSERT_OK(td__future_fail_msg(k, TD_ERR_UNAVAILABLE, NULL));
  assert_string_equal(td_future_message(k), "");
  TD_ASSERT_STATUS(td_future_wait(k, 0), TD_ERR_UNAVAILABLE);
  assert_string_equal(td_last_error(), td_status_str(TD_ERR_UNAVAILABLE));
  td_future_unref(k);
}

typedef struct delayed {
  td_future *f;
  int delay_ms;
  td_status status; /* TD_OK completes with int value, else fails */
  int64_t value;
  pthread_t thread;
} delayed;

static void *delayed_main(void *p) {
  delayed *d = p;
  td_test_sleep_ms(d->delay_ms);
  if (d->status == TD_OK) td_future_complete(d->f, td_value_int(d->value));
  else td_future_fail(d->f, d->status, "delayed failure %lld", (long long)d->value);
  return NULL;
}

static void start_delayed(delayed *d, td_future *f, int delay_ms, td_status st, int64_t value) {
  d->f = f;
  d->delay_ms = delay_ms;
  d->status = st;
  d->value = value;
  assert_int_equal(pthread_create(&d->thread, NULL, delayed_main, d), 0);
}

static void test_future_wait_timeout(void **state) {
  td_future *f = td_future_create();
  double t0 = now_ms();
  TD_ASSERT_STATUS(td_future_wait(f, 50), TD_ERR_TIMEOUT);
  assert_true(now_ms() - t0 >= 49);
  assert_false(td_future_done(f));
  TD_ASSERT_STATUS(td_future_wait(f, 0), TD_ERR_TIMEOUT);
  delayed d;
  start_delayed(&d, f, 30, TD_OK, 11);
  TD_ASSERT_OK(td_future_wait(f, -1));
  assert_int_equal(int_of(td_future_value(f)), 11);
  pthread_join(d.thread, NULL);

  td_future *g = td_future_create();
  start_delayed(&d, g, 10, TD_OK, 12);
  TD_ASSERT_OK(td_future_wait(g, td_test_ms(10000)));
  pthread_join(d.thread, NULL);
  TD_ASSERT_STATUS(td_future_wait(NULL, 0), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_future_wait(g, -3), TD_ERR_INVALID); /* not a td_timeout_ms */
  TD_ASSERT_OK(td_future_wait(g, TD_TIMEOUT_DEFAULT));      /* a future has no default: no limit */
  TD_ASSERT_STATUS(td_future_wait_all(&g, 1, -7), TD_ERR_INVALID);
  td_future_unref(f);
  td_future_unref(g);
}

/* ---- callbacks ---- */

typedef struct cb_log {
  pthread_mutex_t mu;
  int order[64];
  pthread_t threads[64];
  int n;
  int calls[64];
  int not_done; /* callbacks that saw a pending future (must stay 0) */
  int register_errors;
} cb_log;

typedef struct cb_arg {
  cb_log *log;
  int id;
  td_future *also; /* when set, register cb_again on it from inside the callback */
} cb_arg;

static void record(td_future *f, void *p) {
  cb_arg *a = p;
  bool done = td_future_done(f); /* outcome published before callbacks run */
  pthread_mutex_lock(&a->log->mu);
  if (!done) a->log->not_done++;
  a->log->order[a->log->n] = a->id;
  a->log->threads[a->log->n] = pthread_self();
  a->log->n++;
  a->log->calls[a->id]++;
  pthread_mutex_unlock(&a->log->mu);
}

static cb_arg nested_arg;

static void record_and_register(td_future *f, void *p) {
  record(f, p);
  /* Registered while the completing thread drains: runs after every earlier callback. (No
   * cmocka assertion here: this runs on another thread.) */
  cb_arg *a = p;
  if (td_future_on_done(f, record, &nested_arg) != TD_OK) a->log->register_errors++;
}

static void *complete_main(void *p) {
  td_future_complete(p, td_value_int(1));
  return NULL;
}

static void test_future_callbacks_order(void **state) {
  cb_log log = {.mu = PTHREAD_MUTEX_INITIALIZER};
  cb_arg args[8];
  td_future *f = td_future_create();
  assert_false(td__future_has_callbacks(f));
  for (int i = 0; i < 5; i++) {
    args[i] = (cb_arg){&log, i, NULL};
    TD_ASSERT_OK(td_future_on_done(f, i == 2 ? record_and_register : record, &args[i]));
  }
  nested_arg = (cb_arg){&log, 5, NULL};
  assert_true(td__future_has_callbacks(f));
  assert_int_equal(log.n, 0);

  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, complete_main, f), 0);
  pthread_join(t, NULL);
  assert_int_equal(log.n, 6);
  assert_int_equal(log.not_done, 0);
  assert_int_equal(log.register_errors, 0);
  for (int i = 0; i < 6; i++) {
    assert_int_equal(log.order[i], i);
    assert_int_equal(log.calls[i], 1);
    assert_true(pthread_equal(log.threads[i], t)); /* on the completing thread */
  }

  /* Registered after completion: runs at once, on this thread, before on_done returns. */
  args[6] = (cb_arg){&log, 6, NULL};
  TD_ASSERT_OK(td_future_on_done(f, record, &args[6]));
  assert_int_equal(log.n, 7);
  assert_int_equal(log.order[6], 6);
  assert_true(pthread_equal(log.threads[6], pthread_self()));
  for (int i = 0; i < 7; i++) assert_int_equal(log.calls[i], 1);

  TD_ASSERT_STATUS(td_future_on_done(f, NULL, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_future_on_done(NULL, record, &args[7]), TD_ERR_INVALID);
  assert_int_equal(log.n, 7);
  assert_false(td__future_has_callbacks(NULL));
  td_future_unref(f);
}

static void unref_in_cb(td_future *f, void *p) {
  *(int *)p += 1;
  td_future_unref(f); /* drops the reference taken for this callback */
}

static void test_future_callback_releases_reference(void **state) {
  /* A callback may drop the last reference other than the completer's. */
  td_future *f = td_future_create();
  int ran = 0;
  TD_ASSERT_OK(td_future_on_done(td_future_ref(f), unref_in_cb, &ran));
  td_future *completer = td_future_ref(f);
  td_future_unref(f);
  TD_ASSERT_OK(td_future_complete(completer, NULL));
  assert_int_equal(ran, 1);
  td_future_unref(completer);
}

/* ---- then ---- */

typedef struct then_arg {
  int mode; /* 0: value+1, 1: error, 2: next future, 3: both set, 4: recover, 5: hand over next */
  td_future *next;
  td_status seen_status;
  char seen_message[128];
  int calls;
} then_arg;

static td_status then_fn(void *ctx, td_future *src, td_value **result, td_future **next) {
  then_arg *a = ctx;
  a->calls++;
  a->seen_status = td_future_status(src);
  snprintf(a->seen_message, sizeof a->seen_message, "%s", td_future_message(src));
  switch (a->mode) {
    case 0:
      if (a->seen_status != TD_OK) return td_set_error(TD_ERR_INTERNAL, "source failed");
      *result = td_value_int(int_of(td_future_value(src)) + 1);
      return TD_OK;
    case 1:
      return td_set_error(TD_ERR_IO, "then failed: %d", 7);
    case 2:
      *next = td_future_ref(a->next);
      return TD_OK;
    case 3:
      *next = td_future_ref(a->next);
      *result = td_value_int(1);
      return TD_OK;
    case 5:
      *next = a->next; /* our only reference goes to the chain */
      a->next = NULL;
      return TD_OK;
    default:
      *result = td_value_string("recovered");
      return TD_OK;
  }
}

static void test_future_then_value(void **state) {
  td_future *f = td_future_create();
  then_arg a = {.mode = 0};
  td_future *g = NULL, *h = NULL;
  TD_ASSERT_OK(td_future_then(f, then_fn, &a, &g));
  TD_ASSERT_OK(td_future_then(g, then_fn, &a, &h)); /* chain of two */
  assert_false(td_future_done(g));
  assert_int_equal(a.calls, 0);
  TD_ASSERT_OK(td_future_complete(f, td_value_int(1)));
  assert_int_equal(a.calls, 2);
  TD_ASSERT_OK(td_future_wait(h, 0));
  assert_int_equal(int_of(td_future_value(g)), 2);
  assert_int_equal(int_of(td_future_value(h)), 3);

  /* On a finished future, fn runs at once. */
  td_future *k = NULL;
  TD_ASSERT_OK(td_future_then(h, then_fn, &a, &k));
  assert_int_equal(a.calls, 3);
  assert_int_equal(int_of(td_future_value(k)), 4);
  TD_ASSERT_STATUS(td_future_then(NULL, then_fn, &a, &k), TD_ERR_INVALID);
  td_future_unref(f);
  td_future_unref(g);
  td_future_unref(h);
  td_future_unref(k);
}

static void test_future_then_error(void **state) {
  td_future *f = td_future_create();
  then_arg a = {.mode = 1};
  td_future *g = NULL;
  TD_ASSERT_OK(td_future_then(f, then_fn, &a, &g));
  TD_ASSERT_OK(td_future_complete(f, td_value_int(1)));
  assert_int_equal(td_future_status(g), TD_ERR_IO);
  assert_string_equal(td_future_message(g), "then failed: 7");
  TD_ASSERT_STATUS(td_future_wait(g, 0), TD_ERR_IO);
  assert_string_equal(td_last_error(), "then failed: 7");

  /* Setting both a result and a next future is an error, and neither leaks. */
  td_future *f2 = td_future_create(), *n2 = td_future_create(), *g2 = NULL;
  then_arg b = {.mode = 3, .next = n2};
  TD_ASSERT_OK(td_future_then(f2, then_fn, &b, &g2));
  TD_ASSERT_OK(td_future_complete(f2, NULL));
  assert_int_equal(td_future_status(g2), TD_ERR_INVALID);
  td_future_unref(f);
  td_future_unref(g);
  td_future_unref(f2);
  td_future_unref(n2);
  td_future_unref(g2);
}

static void test_future_then_next_future(void **state) {
  /* fn returns a pending future; the chained future follows it. */
  td_future *f = td_future_create(), *n = td_future_create(), *g = NULL;
  then_arg a = {.mode = 2, .next = n};
  TD_ASSERT_OK(td_future_then(f, then_fn, &a, &g));
  TD_ASSERT_OK(td_future_complete(f, td_value_int(1)));
  assert_int_equal(a.calls, 1);
  assert_false(td_future_done(g));
  TD_ASSERT_STATUS(td_future_wait(g, 20), TD_ERR_TIMEOUT);
  delayed d;
  start_delayed(&d, n, 20, TD_OK, 77);
  TD_ASSERT_OK(td_future_wait(g, td_test_ms(10000)));
  assert_int_equal(int_of(td_future_value(g)), 77);
  pthread_join(d.thread, NULL);

  /* A next future that fails fails the chained one with its status and message. */
  td_future *f2 = td_future_create(), *n2 = td_future_create(), *g2 = NULL;
  then_arg b = {.mode = 2, .next = n2};
  TD_ASSERT_OK(td_future_then(f2, then_fn, &b, &g2));
  TD_ASSERT_OK(td_future_complete(f2, NULL));
  TD_ASSERT_OK(td_future_fail(n2, TD_ERR_UNAVAILABLE, "worker3 (rank 3): gone"));
  assert_int_equal(td_future_status(g2), TD_ERR_UNAVAILABLE);
  assert_string_equal(td_future_message(g2), "worker3 (rank 3): gone");

  /* An already finished next future is followed at once. */
  td_future *f3 = td_future_create(), *n3 = td_future_create(), *g3 = NULL;
  TD_ASSERT_OK(td_future_complete(n3, td_value_string("ready")));
  then_arg c = {.mode = 2, .next = n3};
  TD_ASSERT_OK(td_future_complete(f3, NULL));
  TD_ASSERT_OK(td_future_then(f3, then_fn, &c, &g3));
  TD_ASSERT_OK(td_future_wait(g3, 0));
  const char *s = NULL;
  TD_ASSERT_OK(td_value_as_string(td_future_value(g3), &s, NULL));
  assert_string_equal(s, "ready");

  /* A next future nobody else holds is abandoned: the chained future fails, never hangs. */
  td_future *f4 = td_future_create(), *n4 = td_future_create(), *g4 = NULL;
  then_arg e = {.mode = 5, .next = n4};
  TD_ASSERT_OK(td_future_then(f4, then_fn, &e, &g4));
  TD_ASSERT_OK(td_future_complete(f4, NULL));
  assert_null(e.next);
  assert_int_equal(td_future_status(g4), TD_ERR_CANCELLED);

  td_future *all[] = {f, n, g, f2, n2, g2, f3, n3, g3, f4, g4};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) td_future_unref(all[i]);
}

static void test_future_then_failed_source(void **state) {
  /* The callback runs even though the source failed, and sees its error. */
  td_future *f = td_future_create(), *g = NULL, *h = NULL;
  then_arg a = {.mode = 4}, b = {.mode = 0};
  TD_ASSERT_OK(td_future_then(f, then_fn, &a, &g));
  td_future *f2 = td_future_create();
  TD_ASSERT_OK(td_future_then(f2, then_fn, &b, &h));
  TD_ASSERT_OK(td_future_fail(f, TD_ERR_REMOTE, "worker1 (rank 1): boom"));
  TD_ASSERT_OK(td_future_fail(f2, TD_ERR_REMOTE, "worker2 (rank 2): boom"));
  assert_int_equal(a.calls, 1);
  assert_int_equal(a.seen_status, TD_ERR_REMOTE);
  assert_string_equal(a.seen_message, "worker1 (rank 1): boom");
  TD_ASSERT_OK(td_future_wait(g, 0)); /* fn recovered */
  const char *s = NULL;
  TD_ASSERT_OK(td_value_as_string(td_future_value(g), &s, NULL));
  assert_string_equal(s, "recovered");
  assert_int_equal(b.calls, 1);
  assert_int_equal(td_future_status(h), TD_ERR_INTERNAL); /* mode 0 turns it into its own error */
  assert_string_equal(td_future_message(h), "source failed");
  td_future_unref(f);
  td_future_unref(g);
  td_future_unref(f2);
  td_future_unref(h);
}

static void test_future_abandoned_runs_callbacks(void **state) {
  cb_log log = {.mu = PTHREAD_MUTEX_INITIALIZER};
  cb_arg a = {&log, 0, NULL};
  td_future *f = td_future_create();
  TD_ASSERT_OK(td_future_on_done(f, record, &a));
  td_future *g = NULL;
  TD_ASSERT_STATUS(td_future_then(f, NULL, NULL, &g), TD_ERR_INVALID);
  assert_null(g);
  then_arg a2 = {.mode = 4};
  TD_ASSERT_OK(td_future_then(f, then_fn, &a2, &g));
  td_future_unref(f); /* never completed: callbacks still run, with TD_ERR_CANCELLED */
  assert_int_equal(log.n, 1);
  assert_int_equal(log.calls[0], 1);
  assert_int_equal(log.not_done, 0);
  assert_int_equal(a2.calls, 1);
  assert_int_equal(a2.seen_status, TD_ERR_CANCELLED);
  assert_non_null(strstr(a2.seen_message, "abandoned"));
  TD_ASSERT_OK(td_future_wait(g, 0)); /* mode 4 recovers */
  td_future_unref(g);
}

/* ---- wait_all ---- */

static void test_future_wait_all_success(void **state) {
  enum { N = 6 };
  td_future *fs[N];
  delayed d[N];
  for (int i = 0; i < N; i++) fs[i] = td_future_create();
  TD_ASSERT_OK(td_future_complete(fs[0], NULL)); /* one already done */
  for (int i = 1; i < N; i++) start_delayed(&d[i], fs[i], 5 * (N - i), TD_OK, i);
  TD_ASSERT_OK(td_future_wait_all(fs, N, td_test_ms(10000)));
  for (int i = 0; i < N; i++) assert_true(td_future_done(fs[i]));
  for (int i = 1; i < N; i++) pthread_join(d[i].thread, NULL);
  TD_ASSERT_OK(td_future_wait_all(fs, N, 0)); /* all done: no wait needed */
  TD_ASSERT_OK(td_future_wait_all(NULL, 0, 0));
  td_future *with_null[2] = {fs[0], NULL};
  TD_ASSERT_STATUS(td_future_wait_all(with_null, 2, 0), TD_ERR_INVALID);
  for (int i = 0; i < N; i++) td_future_unref(fs[i]);
}

static void test_future_wait_all_fail_fast(void **state) {
  enum { N = 4 };
  td_future *fs[N];
  for (int i = 0; i < N; i++) fs[i] = td_future_create();
  /* fs[0] pending forever (until the end), fs[2] fails after 30 ms, fs[3] completes late. */
  delayed fail_d, late_d;
  TD_ASSERT_OK(td_future_complete(fs[1], NULL));
  start_delayed(&fail_d, fs[2], 30, TD_ERR_REMOTE, 2);
  double t0 = now_ms();
  TD_ASSERT_STATUS(td_future_wait_all(fs, N, td_test_ms(20000)), TD_ERR_REMOTE);
  double took = now_ms() - t0;
  assert_true(took < (double)td_test_ms(10000)); /* fail-fast: long before the timeout */
  assert_non_null(strstr(td_last_error(), "future 2"));
  assert_non_null(strstr(td_last_error(), "delayed failure 2"));
  assert_false(td_future_done(fs[0]));
  pthread_join(fail_d.thread, NULL);

  /* Already failed: returns at once, even with timeout 0. */
  TD_ASSERT_STATUS(td_future_wait_all(fs, N, 0), TD_ERR_REMOTE);
  start_delayed(&late_d, fs[3], 5, TD_OK, 3);
  pthread_join(late_d.thread, NULL);
  TD_ASSERT_OK(td_future_complete(fs[0], NULL));
  for (int i = 0; i < N; i++) td_future_unref(fs[i]);
}

static void test_future_wait_all_timeout(void **state) {
  enum { N = 3 };
  td_future *fs[N];
  for (int i = 0; i < N; i++) fs[i] = td_future_create();
  TD_ASSERT_OK(td_future_complete(fs[1], NULL));
  double t0 = now_ms();
  TD_ASSERT_STATUS(td_future_wait_all(fs, N, 50), TD_ERR_TIMEOUT);
  assert_true(now_ms() - t0 >= 49);
  TD_ASSERT_STATUS(td_future_wait_all(fs, N, 0), TD_ERR_TIMEOUT);
  /* Repeated polling leaves nothing behind on the futures. */
  for (int i = 0; i < 200; i++) TD_ASSERT_STATUS(td_future_wait_all(fs, N, 1), TD_ERR_TIMEOUT);
  assert_false(td__future_has_callbacks(fs[0]));
  /* The same future twice in the set is fine. */
  td_future *twice[2] = {fs[0], fs[0]};
  delayed d;
  start_delayed(&d, fs[0], 10, TD_OK, 0);
  TD_ASSERT_OK(td_future_wait_all(twice, 2, td_test_ms(10000)));
  pthread_join(d.thread, NULL);
  TD_ASSERT_OK(td_future_complete(fs[2], NULL));
  TD_ASSERT_OK(td_future_wait_all(fs, N, -1));
  for (int i = 0; i < N; i++) td_future_unref(fs[i]);
}

/* ---- races ---- */

enum { RACERS = 8 };

typedef struct race {
  td_future *f;
  pthread_barrier_t *barrier;
  int id;
  td_status result;
  int *cb_count;
} race;

static void count_cb(td_future *f, void *p) { __atomic_add_fetch((int *)p, 1, __ATOMIC_RELAXED); }

static void *racer_main(void *p) {
  race *r = p;
  pthread_barrier_wait(r->barrier);
  if (r->id % 4 == 3) {
    /* Some threads register callbacks while others complete. */
    td_future_on_done(r->f, count_cb, r->cb_count);
    r->result = TD_ERR_STATE;
    return NULL;
  }
  if (r->id % 2) r->result = td_future_fail(r->f, TD_ERR_IO, "racer %d", r->id);
  else r->result = td_future_complete(r->f, td_value_int(r->id));
  td_future_on_done(r->f, count_cb, r->cb_count);
  return NULL;
}

static void test_future_concurrent_complete(void **state) {
  for (int round = 0; round < 200; round++) {
    td_future *f = td_future_create();
    int cb_count = 0;
    TD_ASSERT_OK(td_future_on_done(f, count_cb, &cb_count));
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, RACERS);
    race rs[RACERS];
    pthread_t ts[RACERS];
    for (int i = 0; i < RACERS; i++) {
      rs[i] = (race){f, &barrier, i, TD_ERR_INTERNAL, &cb_count};
      assert_int_equal(pthread_create(&ts[i], NULL, racer_main, &rs[i]), 0);
    }
    for (int i = 0; i < RACERS; i++) pthread_join(ts[i], NULL);
    pthread_barrier_destroy(&barrier);
    int winners = 0, winner = -1;
    for (int i = 0; i < RACERS; i++) {
      if (rs[i].result == TD_OK) {
        winners++;
        winner = i;
      } else {
        assert_int_equal(rs[i].result, TD_ERR_STATE);
      }
    }
    assert_int_equal(winners, 1);
    /* Every callback ran exactly once: 1 registered before + 1 per racer. */
    assert_int_equal(cb_count, 1 + RACERS);
    if (winner % 2) {
      assert_int_equal(td_future_status(f), TD_ERR_IO);
      char want[32];
      snprintf(want, sizeof want, "racer %d", winner);
      assert_string_equal(td_future_message(f), want);
    } else {
      assert_int_equal(int_of(td_future_value(f)), winner);
    }
    td_future_unref(f);
  }
}

typedef struct waiter_arg {
  td_future *f;
  td_status st;
} waiter_arg;

static void *waiter_main(void *p) {
  waiter_arg *w = p;
  w->st = td_future_wait(w->f, -1);
  return NULL;
}

static void *all_waiter_main(void *p) {
  waiter_arg *w = p;
  w->st = td_future_wait_all(&w->f, 1, -1);
  return NULL;
}

static void test_future_many_waiters(void **state) {
  td_future *f = td_future_create();
  waiter_arg ws[8];
  pthread_t ts[8];
  for (int i = 0; i < 8; i++) {
    ws[i] = (waiter_arg){f, TD_ERR_INTERNAL};
    assert_int_equal(pthread_create(&ts[i], NULL, i % 2 ? waiter_main : all_waiter_main, &ws[i]),
                     0);
  }
  td_test_sleep_ms(20);
  TD_ASSERT_OK(td_future_fail(f, TD_ERR_CANCELLED, "stop"));
  for (int i = 0; i < 8; i++) {
    pthread_join(ts[i], NULL);
    assert_int_equal(ws[i].st, TD_ERR_CANCELLED);
  }
  td_future_unref(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_future_complete_once),
      cmocka_unit_test(test_future_fail_once),
      cmocka_unit_test(test_future_wait_timeout),
      cmocka_unit_test(test_future_callbacks_order),
      cmocka_unit_test(test_future_callback_releases_reference),
      cmocka_unit_test(test_future_abandoned_runs_callbacks),
      cmocka_unit_test(test_future_then_value),
      cmocka_unit_test(test_future_then_error),
      cmocka_unit_test(test_future_then_next_future),
      cmocka_unit_test(test_future_then_failed_source),
      cmocka_unit_test(test_future_wait_all_success),
      cmocka_unit_test(test_future_wait_all_fail_fast),
      cmocka_unit_test(test_future_wait_all_timeout),
      cmocka_unit_test(test_future_concurrent_complete),
      cmocka_unit_test(test_future_many_waiters),
  };
  return cmocka_run_group_tests_name("rpc_futures", tests, NULL, NULL);
}
