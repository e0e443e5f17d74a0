/* test_core.c - status table, thread-local errors and their prefixes, logging levels, the
 * reference count's underflow checks, the thread pool and the per-thread block cache. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"
#include "core/refcount.h"
#include "core/tcache.h"
#include "core/threadpool.h"
#include "test_util.h"

static void test_status_table(void **state) {
  assert_string_equal(td_status_name(TD_OK), "TD_OK");
  assert_string_equal(td_status_name(TD_ERR_SHAPE), "TD_ERR_SHAPE");
  assert_string_equal(td_status_str(TD_ERR_TIMEOUT), "timed out");
  assert_string_equal(td_status_str((td_status)999), "unknown status");
  assert_string_equal(td_status_name((td_status)-3), "TD_UNKNOWN");
}

static void *other_thread(void *p) {
  td_set_error(TD_ERR_IO, "other thread %d", 7);
  *(int *)p = strcmp(td_last_error(), "other thread 7") == 0;
  return NULL;
}

static void test_status_thread_local(void **state) {
  assert_int_equal(td_set_error(TD_ERR_SHAPE, "mine %s", "x"), TD_ERR_SHAPE);
  int ok = 0;
  pthread_t t;
  pthread_create(&t, NULL, other_thread, &ok);
  pthread_join(t, NULL);
  assert_true(ok);
  assert_string_equal(td_last_error(), "mine x");
  td_clear_error();
  assert_string_equal(td_last_error(), "");
}

static void test_error_prefix_prepends(void **state) {
  td_set_error(TD_ERR_IO, "inner %d", 1);
  assert_int_equal(td__error_prefix(TD_ERR_TIMEOUT, "outer %s", "call"), TD_ERR_TIMEOUT);
  assert_string_equal(td_last_error(), "outer call: inner 1");
  /* an argument may be the current message itself */
  td__error_prefix(TD_ERR_IO, "[%s]", td_last_error());
  assert_string_equal(td_last_error(), "[outer call: inner 1]: outer call: inner 1");
  td_clear_error();
  td__error_prefix(TD_ERR_IO, "alone");
  assert_string_equal(td_last_error(), "alone");
}

static void test_error_prefix_truncates_the_end(void **state) {
  char inner[1500];
  memset(inner, 'x', sizeof inner - 1);
  inner[sizeof inner - 1] = '\0';
  td_set_error(TD_ERR_IO, "%s", inner);
  td__error_prefix(TD_ERR_IO, "context");
  const char *e = td_last_error();
  assert_int_equal(strlen(e), 1023); /* the buffer holds 1023 characters and the NUL */
  assert_memory_equal(e, "context: xxx", 12);
  assert_int_equal(e[1022], 'x');
}

/* run fn in a forked child and return its wait status */
static int in_child(void (*fn)(void)) {
  fflush(stdout);
  fflush(stderr);
  pid_t p = fork();
  assert_true(p >= 0);
  if (p == 0) {
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    fn();
    _exit(0);
  }
  int status = 0;
  assert_int_equal(waitpid(p, &status, 0), p);
  return status;
}

static void release_twice(void) {
  td__refcnt r;
  td__ref_init(&r);
  td__ref_inc(&r);
  if (td__ref_dec(&r) || !td__ref_dec(&r)) _exit(2); /* 2 -> 1 -> 0: the second is the last */
  td__ref_dec(&r);
}

static void take_on_dead(void) {
  td__refcnt r;
  td__ref_init(&r);
  if (!td__ref_dec(&r)) _exit(2);
  td__ref_inc(&r);
}

static void balanced(void) {
  td__refcnt r;
  td__ref_init(&r);
  for (int i = 0; i < 100; i++) td__ref_inc(&r);
  for (int i = 0; i < 100; i++)
    if (td__ref_dec(&r)) _exit(2);
  if (td__ref_get(&r) != 1 || !td__ref_dec(&r)) _exit(2);
}

static void test_refcount_underflow_aborts(void **state) {
  int st = in_child(release_twice);
  assert_true(WIFSIGNALED(st));
  assert_int_equal(WTERMSIG(st), SIGABRT);
  st = in_child(take_on_dead);
  assert_true(WIFSIGNALED(st));
  assert_int_equal(WTERMSIG(st), SIGABRT);
  st = in_child(balanced);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0);
}

static void test_log_level(void **state) {
  td_log_level prev = td_log_get_level();
  td_log_set_level(TD_LOG_ERROR);
  assert_int_equal(td_log_get_level(), TD_LOG_ERROR);
  td_log(TD_LOG_INFO, "not shown");
  td_log_set_level(prev);
}

static void incr(void *arg) { __atomic_add_fetch((int *)arg, 1, __ATOMIC_RELAXED); }

typedef struct {
  td__threadpool *p;
  int *counter;
} nest_arg;

static void nested(void *arg) {
  nest_arg *n = arg;
  for (int i = 0; i < 10; i++) td__threadpool_submit(n->p, incr, n->counter);
}

static void test_threadpool_runs_everything(void **state) {
  td__threadpool *p;
  TD_ASSERT_OK(td__threadpool_create(4, "test", &p));
  int counter = 0;
  for (int i = 0; i < 1000; i++) TD_ASSERT_OK(td__threadpool_submit(p, incr, &counter));
  nest_arg na = {p, &counter};
  TD_ASSERT_OK(td__threadpool_submit(p, nested, &na));
  td__threadpool_shutdown(p);
  assert_int_equal(counter, 1010);
  assert_int_equal(td__threadpool_pending(p), 0);
  TD_ASSERT_STATUS(td__threadpool_submit(p, incr, &counter), TD_ERR_STATE);
  td__threadpool_shutdown(p);
  td__threadpool_destroy(p);
  td__threadpool_destroy(NULL);
  TD_ASSERT_STATUS(td__threadpool_create(0, "x", &p), TD_ERR_INVALID);
}

/* A block the cache hands out again is zeroed like calloc's, whatever its last owner left in it,
 * and it is the block given back (the cache, not calloc, served it). */
static void test_tcache_reuse_is_zeroed(void **state) {
  (void)state;
  for (size_t n = 8; n <= TD__TC_MAX; n *= 2) {
    unsigned char *p = td__tc_calloc(n);
    assert_non_null(p);
    memset(p, 0xab, n);
    int before = td__tc_cached(n);
    td__tc_free(p, n);
    assert_int_equal(td__tc_cached(n), before + 1);
    unsigned char *q = td__tc_calloc(n);
    assert_ptr_equal(q, p);
    assert_int_equal(td__tc_cached(n), before);
    for (size_t i = 0; i < n; i++) assert_int_equal(q[i], 0);
    td__tc_free(q, n);
  }
  /* above the largest class: plain calloc/free, never cached */
  int before = td__tc_cached(TD__TC_MAX + 1);
  void *big = td__tc_calloc(TD__TC_MAX + 1);
  assert_non_null(big);
  td__tc_free(big, TD__TC_MAX + 1);
  assert_int_equal(td__tc_cached(TD__TC_MAX + 1), before);
}

enum { TC_N = 3 * TD__TC_KEEP };
typedef struct tc_flow {
  void *blocks[TC_N];
} tc_flow;

static void *tc_free_all(void *arg) {
  tc_flow *f = arg;
  for (int i = 0; i < TC_N; i++) td__tc_free(f->blocks[i], 200);
  return NULL;
}

/* Blocks one thread allocates and another frees come back to the allocating thread through the
 * depot in full lists, zeroed, instead of piling up in the freeing thread's list. */
static void test_tcache_depot_returns_blocks_freed_elsewhere(void **state) {
  (void)state;
  tc_flow f;
  for (int i = 0; i < TC_N; i++) {
    f.blocks[i] = td__tc_calloc(200);
    assert_non_null(f.blocks[i]);
    memset(f.blocks[i], 0x5a, 200);
  }
  /* empty this thread's list of the class so the next allocation must look in the depot */
  void *mine[TD__TC_KEEP];
  int nmine = 0;
  while (td__tc_cached(200) > 0) mine[nmine++] = td__tc_calloc(200);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, tc_free_all, &f), 0);
  assert_int_equal(pthread_join(t, NULL), 0);
  /* the freeing thread handed its full lists over (what it kept was freed at its exit) */
  unsigned char *q = td__tc_calloc(200);
  assert_non_null(q);
  assert_int_equal(td__tc_cached(200), TD__TC_KEEP - 1);
  bool found = false;
  for (int i = 0; i < TC_N; i++) found |= f.blocks[i] == (void *)q;
  assert_true(found);
  for (int i = 0; i < 200; i++) assert_int_equal(q[i], 0);
  td__tc_free(q, 200);
  for (int i = 0; i < nmine; i++) td__tc_free(mine[i], 200);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_table),
      cmocka_unit_test(test_status_thread_local),
      cmocka_unit_test(test_error_prefix_prepends),
      cmocka_unit_test(test_error_prefix_truncates_the_end),
      cmocka_unit_test(test_refcount_underflow_aborts),
      cmocka_unit_test(test_log_level),
      cmocka_unit_test(test_threadpool_runs_everything),
      cmocka_unit_test(test_tcache_reuse_is_zeroed),
      cmocka_unit_test(test_tcache_depot_returns_blocks_freed_elsewhere),
  };
  return cmocka_run_group_tests_name("core", tests, NULL, NULL);
}
