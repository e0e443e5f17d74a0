/* test_core.c - status table, thread-local errors, logging levels and the thread pool. */
#include <pthread.h>
#include <string.h>

#include "core/core.h"
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_table),
      cmocka_unit_test(test_status_thread_local),
      cmocka_unit_test(test_log_level),
      cmocka_unit_test(test_threadpool_runs_everything),
  };
  return cmocka_run_group_tests_name("core", tests, NULL, NULL);
}
