/* test_rpc_progress.c - host-driven progress (TD_RPC_PROGRESS_HOST): a worker whose main thread
 * polls td_rpc_progress_fd() and runs td_rpc_progress() gets its registered functions and the
 * callbacks of its call futures run on that thread; a blocking call made on that thread while a
 * nested call back into it is pending does not deadlock; the fd is readable exactly while work is
 * queued; the default mode has no fd; a graceful shutdown called on another thread (as
 * tdist.asyncio does) leaves the queue to the progress thread. */
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "mp_util.h"
#include "rpc_test_fns.h"
#include "test_util.h"

static pthread_t host_thread;
static volatile int host_stop;

/* Rank 1: answers whether it runs on the host's thread. */
static td_status fn_on_host(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  (void)c;
  (void)args;
  (void)n;
  (void)fut;
  *res = td_value_bool(pthread_equal(pthread_self(), host_thread));
  return TD_OK;
}

static td_status fn_stop(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c;
  (void)args;
  (void)n;
  (void)fut;
  host_stop = 1;
  *res = td_value_none();
  return TD_OK;
}

/* Rank 0: calls back into its caller (rank 1's "on_host") and returns the answer. */
static td_status fn_call_back(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  (void)args;
  (void)n;
  (void)res;
  return td_rpc_async(td_rpc_ctx_agent(c), td_rpc_ctx_caller_name(c), "on_host", NULL, 0, NULL,
                      fut);
}

static int callback_on_host;
static void note_thread(td_future *f, void *ctx) {
  (void)f;
  (void)ctx;
  callback_on_host = pthread_equal(pthread_self(), host_thread) ? 1 : -1;
}

static bool fd_readable(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

static int worker_progress(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("on_host", fn_on_host, NULL));
  MP_CHECK_OK(td_rpc_register("stop", fn_stop, NULL));
  MP_CHECK_OK(td_rpc_register("call_back", fn_call_back, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  if (rank == 1) o.progress = TD_RPC_PROGRESS_HOST;
  host_thread = pthread_self();
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    MP_CHECK(td_rpc_progress_fd(a) == -1);
    MP_CHECK(td_rpc_progress(a, -1) == -1);
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "on_host", NULL, 0, NULL, &r));
    bool on_host = false;
    MP_CHECK_OK(td_value_as_bool(r, &on_host));
    MP_CHECK(on_host); /* rank 1 ran it on its main thread */
    td_value_unref(r);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "stop", NULL, 0, NULL, &r));
    td_value_unref(r);
  } else {
    int fd = td_rpc_progress_fd(a);
    MP_CHECK(fd >= 0);
    /* serve until rank 0 says stop: the queue's work runs here, nowhere else */
    while (!host_stop) {
      if (fd_readable(fd, (int)td_test_ms(100))) MP_CHECK(td_rpc_progress(a, -1) >= 0);
    }
    MP_CHECK(!fd_readable(fd, 0)); /* drained */
    /* a call's callback runs on this thread too */
    td_value *x = td_value_int(5);
    td_future *f;
    MP_CHECK_OK(td_rpc_async(a, "worker0", "echo", &x, 1, NULL, &f));
    MP_CHECK_OK(td_future_on_done(f, note_thread, NULL));
    while (!callback_on_host) {
      if (fd_readable(fd, (int)td_test_ms(100))) td_rpc_progress(a, -1);
    }
    MP_CHECK(callback_on_host == 1);
    td_future_unref(f);
    td_value_unref(x);
    /* a blocking call from this thread whose answer needs this thread (rank 0 calls back into
     * rank 1's "on_host" before answering): the wait runs the queue, so it completes */
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker0", "call_back", NULL, 0, NULL, &r));
    bool on_host = false;
    MP_CHECK_OK(td_value_as_bool(r, &on_host));
    MP_CHECK(on_host);
    td_value_unref(r);
  }
  /* rank 1's graceful shutdown runs its queue while it waits for the others */
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_progress_host_thread_runs_user_code(void **state) {
  (void)state;
  int codes[2];
  int fails = td_mp_run(2, worker_progress, NULL, 120, codes);
  if (fails) fail_msg("%d workers failed (codes %d %d)", fails, codes[0], codes[1]);
}

/* ---- a graceful shutdown on another thread ---- */

static atomic_int shut_done;
static td_status shut_status;

static void *shut_down(void *arg) {
  shut_status = td_rpc_shutdown(arg, true, td_test_ms(30000));
  atomic_store(&shut_done, 1);
  return NULL;
}

static int worker_shutdown_elsewhere(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("on_host", fn_on_host, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  if (rank == 1) o.progress = TD_RPC_PROGRESS_HOST;
  host_thread = pthread_self();
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    /* rank 1 is in its graceful shutdown (on a thread of its own) while these arrive */
    for (int i = 0; i < 60; i++) {
      td_value *r = NULL;
      MP_CHECK_OK(td_rpc_sync(a, "worker1", "on_host", NULL, 0, NULL, &r));
      bool on_host = false;
      MP_CHECK_OK(td_value_as_bool(r, &on_host));
      MP_CHECK(on_host);
      td_value_unref(r);
      td_test_sleep_ms(5);
    }
    MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  } else {
    pthread_t s;
    MP_CHECK(pthread_create(&s, NULL, shut_down, a) == 0);
    /* a busy host: it gets to the queue every 10 ms (the shutdown thread's barrier polls more
     * often: before the fix it ran the handlers it found) */
    while (!atomic_load(&shut_done)) {
      td_test_sleep_ms(10);
      td_rpc_progress(a, -1);
    }
    pthread_join(s, NULL);
    MP_CHECK_OK(shut_status);
  }
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_progress_shutdown_on_another_thread(void **state) {
  (void)state;
  int codes[2];
  int fails = td_mp_run(2, worker_shutdown_elsewhere, NULL, 120, codes);
  if (fails) fail_msg("%d workers failed (codes %d %d)", fails, codes[0], codes[1]);
}

/* ---- a thread's pump outlives its agent ---- */

/* Set by serve_c before it publishes c_agent (release), read after (acquire). */
static pthread_t c_self;
static atomic_int c_stop;
static _Atomic(td_rpc_agent *) c_agent;

static td_status fn_on_c_thread(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  *res = td_value_bool(pthread_equal(pthread_self(), c_self));
  return TD_OK;
}

static void *destroy_agent(void *arg) {
  td_rpc_agent *a = arg;
  td_rpc_shutdown(a, true, td_test_ms(10000));
  td_rpc_destroy(a);
  return NULL;
}

/* Makes host agent C, then serves its queue until c_stop. */
static void *serve_c(void *arg) {
  (void)arg;
  td_rpc_options o = td_mp_rpc_options("tcp://127.0.0.1:0", 2);
  o.progress = TD_RPC_PROGRESS_HOST;
  td_rpc_agent *a = NULL;
  if (td_rpc_init(NULL, 0, 1, &o, &a) != TD_OK) return NULL;
  c_self = pthread_self();
  atomic_store(&c_agent, a);
  while (!atomic_load(&c_stop)) {
    td_rpc_progress(a, -1);
    if (fd_readable(td_rpc_progress_fd(a), 1)) td_rpc_progress(a, -1);
  }
  td_rpc_shutdown(a, true, td_test_ms(10000));
  td_rpc_destroy(a);
  return NULL;
}

/* This thread was agent A's progress thread; A is destroyed by another thread, and a new host
 * agent C lives on thread T. A wait on this thread must neither touch A (freed: ASan) nor run C's
 * queue (C's handlers run on T only, even when C was allocated where A was). */
static void test_rpc_progress_pump_outlives_its_agent(void **state) {
  (void)state;
  TD_ASSERT_OK(td_rpc_register("on_c_thread", fn_on_c_thread, NULL));
  td_rpc_options o = td_mp_rpc_options("tcp://127.0.0.1:0", 2);
  o.progress = TD_RPC_PROGRESS_HOST;
  td_rpc_agent *a = NULL;
  TD_ASSERT_OK(td_rpc_init(NULL, 0, 1, &o, &a)); /* this thread: A's progress thread */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, destroy_agent, a), 0);
  pthread_join(t, NULL);
  atomic_store(&c_stop, 0);
  pthread_t c_thread;
  assert_int_equal(pthread_create(&c_thread, NULL, serve_c, NULL), 0);
  TD_TEST_POLL(atomic_load(&c_agent) != NULL, 30);
  td_rpc_agent *c = atomic_load(&c_agent);
  assert_non_null(c);
  td_future *f = NULL;
  TD_ASSERT_OK(td_rpc_async(c, "worker0", "on_c_thread", NULL, 0, NULL, &f));
  TD_ASSERT_OK(td_future_wait(f, td_test_ms(30000))); /* A's stale pump runs here meanwhile */
  bool on_c = false;
  TD_ASSERT_OK(td_value_as_bool(td_future_value(f), &on_c));
  assert_true(on_c);
  td_future_unref(f);
  atomic_store(&c_stop, 1);
  pthread_join(c_thread, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_progress_host_thread_runs_user_code),
      /* before the in-process test: its forks must not inherit a running agent's threads */
      cmocka_unit_test(test_rpc_progress_shutdown_on_another_thread),
      cmocka_unit_test(test_rpc_progress_pump_outlives_its_agent),
  };
  return cmocka_run_group_tests_name("rpc_progress", tests, NULL, NULL);
}
