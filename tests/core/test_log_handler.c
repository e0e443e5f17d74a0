/* test_log_handler.c - td_log_set_handler: lines that pass the level reach the handler (level and
 * message without the stderr prefix) and not standard error; NULL restores standard error; calls
 * never overlap, even from many threads; once td_log_set_handler returns, the previous handler is
 * never called again. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "test_util.h"

typedef struct {
  atomic_int calls;
  td_log_level last_level;
  char last[256];
  atomic_int inside; /* handlers running now */
  atomic_int overlaps;
  atomic_int retired; /* set once the handler was replaced: any later call is a bug */
  atomic_int late_calls;
} sink;

static void record(td_log_level level, const char *msg, void *ud) {
  sink *s = ud;
  if (atomic_fetch_add(&s->inside, 1) != 0) atomic_fetch_add(&s->overlaps, 1);
  if (atomic_load(&s->retired)) atomic_fetch_add(&s->late_calls, 1);
  atomic_fetch_add(&s->calls, 1);
  s->last_level = level;
  snprintf(s->last, sizeof s->last, "%s", msg);
  atomic_fetch_sub(&s->inside, 1);
}

/* Runs fn with standard error sent to a temporary file; returns what was written there. */
static void capture_stderr(void (*fn)(void *), void *arg, char *out, size_t n) {
  char path[] = "/tmp/td_log_handler_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  fn(arg);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  ssize_t r = pread(fd, out, n - 1, 0);
  out[r > 0 ? r : 0] = '\0';
  close(fd);
  unlink(path);
}

static void log_two(void *arg) {
  (void)arg;
  td_log(TD_LOG_WARN, "disk %d is %s", 3, "full");
  td_log(TD_LOG_DEBUG, "below the level");
}

static void test_log_handler_receives_lines(void **state) {
  (void)state;
  td_log_level prev = td_log_get_level();
  td_log_set_level(TD_LOG_INFO);
  sink s = {0};
  td_log_set_handler(record, &s);
  char err[512];
  capture_stderr(log_two, NULL, err, sizeof err);
  assert_string_equal(err, ""); /* nothing went to stderr */
  assert_int_equal(s.calls, 1);  /* DEBUG was filtered */
  assert_int_equal(s.last_level, TD_LOG_WARN);
  assert_string_equal(s.last, "disk 3 is full");
  td_log_set_handler(NULL, NULL); /* back to stderr, with the prefix */
  capture_stderr(log_two, NULL, err, sizeof err);
  assert_int_equal(s.calls, 1);
  assert_non_null(strstr(err, "[tdist W "));
  assert_non_null(strstr(err, "] disk 3 is full\n"));
  td_log_set_level(prev);
}

static void *spam(void *arg) {
  atomic_int *stop = arg;
  for (int i = 0; i < 2000 || !atomic_load(stop); i++) td_log(TD_LOG_ERROR, "line %d", i);
  return NULL;
}

static void test_log_handler_threads_and_replacement(void **state) {
  (void)state;
  sink s = {0};
  atomic_int stop = 0;
  td_log_set_handler(record, &s);
  pthread_t th[4];
  for (int i = 0; i < 4; i++) assert_int_equal(pthread_create(&th[i], NULL, spam, &stop), 0);
  while (atomic_load(&s.calls) < 1000) usleep(100); /* the threads are logging through the handler */
  sink other = {0};
  td_log_set_handler(record, &other); /* replaced while lines keep coming */
  atomic_store(&s.retired, 1);
  usleep(20000);
  atomic_store(&stop, 1);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  td_log_set_handler(NULL, NULL);
  assert_int_equal(atomic_load(&s.overlaps), 0);
  assert_int_equal(atomic_load(&other.overlaps), 0);
  assert_int_equal(atomic_load(&s.late_calls), 0);
  assert_true(other.calls > 0);
  assert_int_equal(s.calls + other.calls >= 8000, 1); /* every line went to one of them */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_log_handler_receives_lines),
      cmocka_unit_test(test_log_handler_threads_and_replacement),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
