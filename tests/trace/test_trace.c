/* test_trace.c - the trace recorder (tdist/trace.h): nothing is recorded while it is off; spans
 * from several threads, nested and with strings that need escaping, end up in a file that is one
 * JSON document in the Chrome trace format; a second session starts clean. Memory stays bounded:
 * past TD_TRACE_MAX_EVENTS the events go to the file (all of them, still one valid document);
 * deep nesting writes each span with its own begin and end; an exiting thread's buffer is freed
 * (its events written first); a forked child does not inherit the session. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tdist/collectives.h"
#include "tdist/rpc.h"
#include "tdist/trace.h"
#include "core/trace_impl.h"
#include "mp_util.h"
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
/* A one-worker agent "solo" on 127.0.0.1 and its process group. */
static td_rpc_agent *solo_start(td_process_group **pg) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:0";
  td_rpc_agent *a;
  TD_ASSERT_OK(td_rpc_init("solo", 0, 1, &o, &a));
  TD_ASSERT_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, pg));
  return a;
}

static void solo_finish(td_rpc_agent *a, td_process_group *pg) {
  td_process_group_destroy(pg);
  TD_ASSERT_OK(td_rpc_shutdown(a, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(a);
}

static void test_trace_records_collectives(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  td_process_group *pg;
  td_rpc_agent *a = solo_start(&pg);
  float v[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  td_tensor *t;
  TD_ASSERT_OK(td_tensor_from_buffer(v, shape, 1, TD_DTYPE_F32, &t));
  TD_ASSERT_OK(td_trace_start(dir));
  TD_ASSERT_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  TD_ASSERT_OK(td_process_group_barrier(pg));
  TD_ASSERT_OK(td_trace_stop());
  td_tensor_unref(t);
  solo_finish(a, pg);
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

/* ---- bounds ---- */

/* Finds the one event named name in text: returns how many there are, and the first's ts and dur
 * (microseconds). */
static int span_of(const char *text, const char *name, double *ts, double *dur) {
  char needle[128];
  snprintf(needle, sizeof needle, "\"name\":\"%s\"", name);
  int n = 0;
  for (const char *p = text; (p = strstr(p, needle)); p++) {
    const char *bol = p;
    while (bol > text && bol[-1] != '\n') bol--;
    const char *t = strstr(bol, "\"ts\":"), *d = strstr(bol, "\"dur\":");
    if (n++ == 0) {
      *ts = t ? strtod(t + 5, NULL) : -1;
      *dur = d ? strtod(d + 6, NULL) : -1;
    }
  }
  return n;
}

static char *session_file(const char *dir) {
  char path[128];
  snprintf(path, sizeof path, "%s/pid%d.trace.json", dir, (int)getpid());
  assert_true(valid_json(path));
  char *text = slurp(path);
  assert_non_null(text);
  return text;
}

static void remove_dir(const char *dir) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

#define CAP_EVENTS 1000
#define CAP_PER_THREAD 10000
#define CAP_THREADS 3

typedef struct peak {
  size_t events, bytes;
} peak;

/* Records CAP_PER_THREAD spans, sampling the recorder's holdings every 50. */
static void *many_spans(void *arg) {
  peak *pk = arg;
  for (int i = 0; i < CAP_PER_THREAD; i++) {
    td_trace_begin("cap", NULL);
    td_trace_end();
    if (i % 50 == 0) {
      td__trace_counts c;
      td__trace_counts_get(&c);
      if (c.events_held > pk->events) pk->events = c.events_held;
      if (c.bytes_held > pk->bytes) pk->bytes = c.bytes_held;
    }
  }
  return NULL;
}

/* 30,000 spans under a cap of 1,000 events: the recorder never holds more than the cap (plus the
 * one event each other thread may add while the buffers are being written), and the file still
 * has every span, one valid document, nothing dropped. */
static void test_trace_events_over_cap_stay_bounded(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  char cap[16];
  snprintf(cap, sizeof cap, "%d", CAP_EVENTS);
  setenv("TD_TRACE_MAX_EVENTS", cap, 1);
  TD_ASSERT_OK(td_trace_start(dir));
  unsetenv("TD_TRACE_MAX_EVENTS");
  td__trace_counts c;
  td__trace_counts_get(&c);
  assert_int_equal(c.max_events, CAP_EVENTS);
  pthread_t th[CAP_THREADS];
  peak pk[CAP_THREADS];
  memset(pk, 0, sizeof pk);
  for (int i = 0; i < CAP_THREADS; i++)
    assert_int_equal(pthread_create(&th[i], NULL, many_spans, &pk[i]), 0);
  for (int i = 0; i < CAP_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < CAP_THREADS; i++) {
    assert_true(pk[i].events <= CAP_EVENTS + CAP_THREADS);
    assert_true(pk[i].bytes <= (2u << 20)); /* 30,000 events held would be about 4 MB */
  }
  TD_ASSERT_OK(td_trace_stop());
  td__trace_counts_get(&c);
  assert_int_equal(c.events_held, 0);
  char *text = session_file(dir);
  assert_int_equal(count(text, "\"name\":\"cap\""), CAP_THREADS * CAP_PER_THREAD);
  assert_int_equal(count(text, "\"dropped_events\":0}"), 1);
  free(text);
  remove_dir(dir);
}

/* 100 nested spans are 100 spans, each inside its parent; 1,030 nested ones keep the outer 1,024
 * (TD__TRACE_MAX_DEPTH) and skip the innermost six with their own ends (counted as dropped), so
 * the outer spans still end at their own td_trace_end. */
static void test_trace_deep_nesting_gives_matched_spans(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  TD_ASSERT_OK(td_trace_start(dir));
  char name[32];
  for (int i = 0; i < 100; i++) {
    snprintf(name, sizeof name, "d%d", i);
    td_trace_begin(name, NULL);
  }
  for (int i = 0; i < 100; i++) td_trace_end();
  int deep = TD__TRACE_MAX_DEPTH + 6;
  for (int i = 0; i < deep; i++) {
    snprintf(name, sizeof name, "e%d", i);
    td_trace_begin(name, NULL);
    if (i == deep - 1) td_trace_instant("bottom", NULL);
  }
  for (int i = 0; i < deep; i++) {
    if (i == deep - TD__TRACE_MAX_DEPTH) td_trace_instant("skipped_closed", NULL);
    td_trace_end();
  }
  td_trace_begin("after", NULL); /* the thread's nesting is back at the top */
  td_trace_end();
  TD_ASSERT_OK(td_trace_stop());
  char *text = session_file(dir);
  double ts[100], dur[100];
  for (int i = 0; i < 100; i++) {
    snprintf(name, sizeof name, "d%d", i);
    assert_int_equal(span_of(text, name, &ts[i], &dur[i]), 1);
    if (i) { /* inside its parent */
      assert_true(ts[i] >= ts[i - 1]);
      assert_true(ts[i] + dur[i] <= ts[i - 1] + dur[i - 1]);
    }
  }
  for (int i = 0; i < deep; i++) {
    snprintf(name, sizeof name, "e%d", i);
    double t, d;
    assert_int_equal(span_of(text, name, &t, &d), i < TD__TRACE_MAX_DEPTH ? 1 : 0);
  }
  /* the innermost kept span ends at its own end, after the skipped ones' ends */
  double tb, db, tc, dc, ti, di;
  assert_int_equal(span_of(text, "skipped_closed", &tc, &dc), 1);
  snprintf(name, sizeof name, "e%d", TD__TRACE_MAX_DEPTH - 1);
  assert_int_equal(span_of(text, name, &ti, &di), 1);
  assert_int_equal(span_of(text, "bottom", &tb, &db), 1);
  assert_true(ti <= tb && ti + di >= tc);
  assert_int_equal(span_of(text, "after", &tb, &db), 1);
  assert_int_equal(count(text, "\"dropped_events\":6}"), 1);
  free(text);
  remove_dir(dir);
}

static void *exiting(void *arg) {
  (void)arg;
  for (int i = 0; i < 10; i++) {
    td_trace_begin("exiting", NULL);
    td_trace_end();
  }
  return NULL;
}

/* A thread that recorded and exits gives its buffer back (after writing its events). */
static void test_trace_thread_exit_frees_buffer(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  TD_ASSERT_OK(td_trace_start(dir));
  td_trace_instant("main", NULL); /* this thread's buffer exists before the count */
  td__trace_counts before, after;
  td__trace_counts_get(&before);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, exiting, NULL), 0);
  pthread_join(th, NULL);
  td__trace_counts_get(&after);
  assert_int_equal(after.live_buffers, before.live_buffers);
  assert_int_equal(after.events_held, before.events_held); /* its events left with it */
  TD_ASSERT_OK(td_trace_stop());
  char *text = session_file(dir);
  assert_int_equal(count(text, "\"name\":\"exiting\""), 10);
  free(text);
  remove_dir(dir);
}

/* In a forked child (TD_MP_RUN): tracing is off, the parent's events are not there, and a
 * session of its own writes its own file. */
static int forked_child(int rank, int world, const char *method, void *arg) {
  (void)rank, (void)world, (void)method;
  const char *dir = arg;
  MP_CHECK(!td_trace_enabled());
  MP_CHECK_OK(td_trace_start(dir));
  td_trace_begin("child", NULL);
  td_trace_end();
  MP_CHECK_OK(td_trace_stop());
  char path[128];
  snprintf(path, sizeof path, "%s/pid%d.trace.json", dir, (int)getpid());
  char *text = slurp(path);
  MP_CHECK(text && count(text, "\"name\":\"child\"") == 1);
  MP_CHECK(count(text, "\"name\":\"parent_before\"") == 0);
  MP_CHECK(count(text, "\"name\":\"thread_name\"") == 1);
  free(text);
  MP_CHECK(valid_json(path));
  return 0;
}

/* A process that forks while tracing keeps its session to itself: the child starts untraced and
 * may trace on its own; the parent's file has its events only, before and after the fork. */
static void test_trace_fork_child_starts_untraced(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  TD_ASSERT_OK(td_trace_start(dir));
  td_trace_begin("parent_before", NULL);
  td_trace_end();
  TD_MP_RUN(1, forked_child, dir, 30);
  td_trace_begin("parent_after", NULL);
  td_trace_end();
  TD_ASSERT_OK(td_trace_stop());
  char *text = session_file(dir);
  assert_int_equal(count(text, "\"name\":\"parent_before\""), 1);
  assert_int_equal(count(text, "\"name\":\"parent_after\""), 1);
  assert_int_equal(count(text, "\"name\":\"child\""), 0);
  free(text);
  remove_dir(dir);
}

/* ---- the offline timeline ---- */

static td_status fn_echo(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)ctx, (void)args, (void)n, (void)fut;
  *res = td_value_int(1);
  return TD_OK;
}

/* Runs TDIST_TRACE with args; its exit status (-1: it could not run). */
static int run_tool(char *const argv[]) {
  pid_t p = fork();
  if (p == 0) {
    execv(argv[0], argv);
    _exit(127);
  }
  int st = 0;
  if (p < 0 || waitpid(p, &st, 0) != p) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A small traced run (a call to itself, an all_reduce, a user span with a name that needs escaping
 * in HTML, an instant) merged and rendered by `tdist-trace html`: one page, self-contained (no
 * script, style or image from anywhere, no URL), holding every event of the run with its
 * worker's track, and a script that draws, zooms, pans and resets the timeline
 * (tests/trace/page_script_check.js, when node is installed). */
static void test_trace_html_page_of_a_merged_run(void **state) {
  (void)state;
  char dir[] = "/tmp/td_trace_XXXXXX";
  assert_non_null(mkdtemp(dir));
  td_rpc_register("echo_fn", fn_echo, NULL);
  TD_ASSERT_OK(td_trace_start(dir)); /* before init: the agent names its track */
  td_process_group *pg;
  td_rpc_agent *a = solo_start(&pg);
  float v[4] = {1, 2, 3, 4};
  int64_t shape[1] = {4};
  td_tensor *t;
  TD_ASSERT_OK(td_tensor_from_buffer(v, shape, 1, TD_DTYPE_F32, &t));
  td_trace_begin("step <1> & co", "user");
  td_value *r = NULL;
  TD_ASSERT_OK(td_rpc_sync(a, "solo", "echo_fn", NULL, 0, NULL, &r));
  td_value_unref(r);
  TD_ASSERT_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  td_trace_instant("checkpoint_mark", "user");
  td_trace_end();
  td_tensor_unref(t);
  solo_finish(a, pg);
  TD_ASSERT_OK(td_trace_stop());
  char json[160], html[160];
  snprintf(json, sizeof json, "%s/run.json", dir);
  snprintf(html, sizeof html, "%s/run.html", dir);
  char tool[] = TDIST_TRACE_PATH, merge[] = "merge", render[] = "html", dash_o[] = "-o";
  assert_int_equal(run_tool((char *const[]){tool, merge, dir, dash_o, json, NULL}), 0);
  assert_int_equal(run_tool((char *const[]){tool, render, json, dash_o, html, NULL}), 0);
  char *page = slurp(html);
  assert_non_null(page);
  assert_int_equal(strncmp(page, "<!DOCTYPE html>", 15), 0);
  assert_non_null(strstr(page, "</html>"));
  assert_non_null(strstr(page, "<svg id=\"tl\""));
  assert_non_null(strstr(page, "solo (rank 0): thread ")); /* the worker's track */
  assert_non_null(strstr(page, ">all_reduce</text>"));      /* a span with its label */
  assert_non_null(strstr(page, "[collective]"));
  assert_non_null(strstr(page, "echo_fn"));                 /* the call and its handler */
  assert_non_null(strstr(page, "[handler]"));
  assert_non_null(strstr(page, "class=\"flow\""));          /* the call -> handler arrow */
  assert_non_null(strstr(page, "checkpoint_mark"));
  assert_non_null(strstr(page, "step &lt;1&gt; &amp; co")); /* escaped, never raw */
  assert_null(strstr(page, "step <1>"));
  /* self-contained: no URL, no external script, style or image */
  assert_null(strstr(page, "http:"));
  assert_null(strstr(page, "https:"));
  assert_null(strstr(page, "src="));
  assert_null(strstr(page, "href="));
  assert_null(strstr(page, "@import"));
  if (access("/usr/bin/node", X_OK) == 0) { /* the script runs, zooms, pans and resets */
    char node[] = "/usr/bin/node", check[] = TD_SOURCE_DIR "/tests/trace/page_script_check.js";
    assert_int_equal(run_tool((char *const[]){node, check, html, NULL}), 0);
  }
  free(page);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_trace_records_spans_from_threads),
      cmocka_unit_test(test_trace_records_collectives),
      cmocka_unit_test(test_trace_events_over_cap_stay_bounded),
      cmocka_unit_test(test_trace_deep_nesting_gives_matched_spans),
      cmocka_unit_test(test_trace_thread_exit_frees_buffer),
      cmocka_unit_test(test_trace_fork_child_starts_untraced),
      cmocka_unit_test(test_trace_html_page_of_a_merged_run),
  };
  return cmocka_run_group_tests_name("trace", tests, NULL, NULL);
}
