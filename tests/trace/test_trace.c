/* test_trace.c - the trace recorder (tdist/trace.h): nothing is recorded while it is off; spans
 * from several threads, nested and with strings that need escaping, end up in a file that is one
 * JSON document in the Chrome trace format; a second session starts clean. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tdist/collectives.h"
#include "tdist/rpc.h"
#include "tdist/trace.h"
#include "test_util.h"

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = malloc((size_t)n + 1);
  if (!b || fread(b, 1, (size_t)n, f) != (size_t)n) {
    fclose(f);
    free(b);
    return NULL;
  }
  b[n] = 0;
  fclose(f);
  return b;
}

static int count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = hay; (p = strstr(p, needle)); p++) n++;
  return n;
}

static void *spans(void *arg) {
  (void)arg;
  for (int i = 0; i < 100; i++) {
    td_trace_begin("outer", "work");
    td_trace_begin("in\"ner\\", NULL);
    td_trace_end();
    td_trace_end();
  }
  return NULL;
}

/* Validates the file with Python's json module: it must parse, and every event must carry the
 * fields the format requires. */
static bool valid_json(const char *path) {
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "/usr/bin/python3 -c \"import json,sys; d=json.load(open('%s')); "
           "assert all(all(k in e for k in ('ph','pid','tid','ts')) for e in d['traceEvents']); "
           "assert all(e['dur']>=0 for e in d['traceEvents'] if e['ph']=='X')\"",
           path);
  return system(cmd) == 0;
}

static void test_trace_records_spans_from_threads(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  /* off: nothing recorded, nothing written */
  spans(NULL);
  TD_ASSERT_OK(td_trace_stop());
  assert_false(td_trace_enabled());
  TD_ASSERT_OK(td_trace_start(dir));
  assert_true(td_trace_enabled());
  assert_int_equal(td_trace_start(dir), TD_ERR_STATE);
  pthread_t th[3];
  for (int i = 0; i < 3; i++) assert_int_equal(pthread_create(&th[i], NULL, spans, NULL), 0);
  spans(NULL);
  for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
  td_trace_instant("marker", "test");
  TD_ASSERT_OK(td_trace_stop());
  char path[128];
  snprintf(path, sizeof path, "%s/pid%d.trace.json", dir, (int)getpid());
  char *text = slurp(path);
  assert_non_null(text);
  assert_int_equal(count(text, "\"name\":\"outer\""), 400);
  assert_int_equal(count(text, "\"name\":\"in\\\"ner\\\\\""), 400); /* escaped */
  assert_int_equal(count(text, "\"name\":\"marker\""), 1);
  assert_int_equal(count(text, "\"name\":\"thread_name\""), 4);
  free(text);
  assert_true(valid_json(path));
  /* a second session starts empty */
  TD_ASSERT_OK(td_trace_start(dir));
  td_trace_begin("second", NULL);
  td_trace_end();
  TD_ASSERT_OK(td_trace_stop());
  text = slurp(path);
  assert_non_null(text);
  assert_int_equal(count(text, "\"name\":\"outer\""), 0);
  assert_int_equal(count(text, "\"name\":\"second\""), 1);
  free(text);
  assert_true(valid_json(path));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* A collective is one span of category "collective" named after the operation, with its size
 * and algorithm (a group of one worker runs the local algorithm). */
static void test_trace_records_collectives(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:0";
  td_rpc_agent *a;
  TD_ASSERT_OK(td_rpc_init("solo", 0, 1, &o, &a));
  td_process_group *pg;
  TD_ASSERT_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  float v[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  td_tensor *t;
  TD_ASSERT_OK(td_tensor_from_buffer(v, shape, 1, TD_DTYPE_F32, &t));
  TD_ASSERT_OK(td_trace_start(dir));
  TD_ASSERT_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  TD_ASSERT_OK(td_process_group_barrier(pg));
  TD_ASSERT_OK(td_trace_stop());
  td_tensor_unref(t);
  td_process_group_destroy(pg);
  TD_ASSERT_OK(td_rpc_shutdown(a, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(a);
  char path[128];
  snprintf(path, sizeof path, "%s/pid%d.trace.json", dir, (int)getpid());
  char *text = slurp(path);
  assert_non_null(text);
  assert_int_equal(count(text, "\"cat\":\"collective\""), 2);
  assert_int_equal(count(text, "\"name\":\"all_reduce\""), 1);
  assert_int_equal(count(text, "\"bytes\":16"), 1);
  free(text);
  assert_true(valid_json(path));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_trace_records_spans_from_threads),
      cmocka_unit_test(test_trace_records_collectives),
  };
  return cmocka_run_group_tests_name("trace", tests, NULL, NULL);
}
