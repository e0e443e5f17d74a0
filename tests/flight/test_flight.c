/* test_flight.c - the flight recorder on its own (core/flight.c): the ring keeps the newest
 * TD__FLIGHT_RING records in order when it wraps, a writer lapped by the ring drops its older
 * record rather than replace a newer one, concurrent writers never leave a torn record,
 * open waits survive the ring wrapping, a dump reads back field for field (and through
 * `tdist-trace why-hung`), deadline dumps need a directory and keep the first of a cascade, and
 * SIGUSR1 dumps through the dumper thread. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/flight_impl.h"
#include "flight_test_util.h"
#include "proc_util.h"
#include "tdist/trace.h"
#include "test_util.h"

static td__flight_rec snap[TD__FLIGHT_RING];

static void rec_ev(uint64_t a, int32_t peer, const char *name) {
  td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_SEND, .peer = peer, .a = a}, name);
}

static void test_flight_ring_wraps_keeping_newest(void **state) {
  (void)state;
  uint64_t base = td__flight_claimed();
  for (uint64_t i = 0; i < TD__FLIGHT_RING + 100; i++) rec_ev(i, 3, "wrap");
  assert_int_equal(td__flight_claimed() - base, TD__FLIGHT_RING + 100);
  size_t n = td__flight_snapshot(snap, TD__FLIGHT_RING);
  assert_int_equal(n, TD__FLIGHT_RING);
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(snap[i].a, 100 + i); /* the 100 oldest were overwritten, order kept */
    assert_int_equal(snap[i].stamp, base + 100 + i + 1);
    assert_int_equal(snap[i].peer, 3);
    assert_string_equal(snap[i].name, "wrap");
  }
  /* names are cut to fit, never overflow */
  rec_ev(1, 0, "a_function_name_longer_than_the_field");
  assert_int_equal(td__flight_snapshot(snap, 1), 1);
  assert_int_equal(strlen(snap[0].name), TD__FLIGHT_NAME - 1);
}

/* A writer preempted between its claim and its write for a whole lap of the ring finds its slot
 * holding a newer claim: it drops its older record, and the newer one stays readable. */
static void test_flight_lapped_writer_keeps_the_newer_record(void **state) {
  (void)state;
  uint64_t dropped = td__flight_dropped();
  uint64_t late = td__flight_claim();
  for (uint64_t i = 0; i < TD__FLIGHT_RING; i++) rec_ev(i, 4, "lap");
  td__flight_rec old = {.kind = TD__FL_RPC_SEND, .peer = 4, .a = 999999};
  snprintf(old.name, sizeof old.name, "late");
  td__flight_write(late, &old);
  assert_int_equal(td__flight_dropped(), dropped + 1);
  size_t n = td__flight_snapshot(snap, TD__FLIGHT_RING);
  assert_int_equal(n, TD__FLIGHT_RING); /* the newest lap, whole: the late record replaced none */
  assert_int_equal(snap[n - 1].a, TD__FLIGHT_RING - 1);
  assert_string_equal(snap[n - 1].name, "lap");
  for (size_t i = 0; i < n; i++) assert_int_not_equal(snap[i].a, 999999);
}

enum { WRITERS = 4, PER_WRITER = 50000 };

static void *writer(void *arg) {
  int w = (int)(intptr_t)arg;
  char name[8];
  snprintf(name, sizeof name, "w%d", w);
  for (uint64_t i = 0; i < PER_WRITER; i++)
    td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_RECV, .peer = w, .a = i,
                                       .b = i * 7 + (uint64_t)w}, name);
  return NULL;
}

/* How many of the records taken are torn (their fields disagree). */
static size_t count_torn(const td__flight_rec *r, size_t n) {
  size_t torn = 0;
  for (size_t i = 0; i < n; i++) {
    if (r[i].kind != TD__FL_RPC_RECV) continue;
    char name[8];
    snprintf(name, sizeof name, "w%d", r[i].peer);
    torn += strcmp(r[i].name, name) != 0 || r[i].b != r[i].a * 7 + (uint64_t)r[i].peer;
  }
  return torn;
}

static void test_flight_concurrent_writers_leave_no_torn_record(void **state) {
  (void)state;
  pthread_t th[WRITERS];
  for (int w = 0; w < WRITERS; w++)
    assert_int_equal(pthread_create(&th[w], NULL, writer, (void *)(intptr_t)w), 0);
  /* readers run during the writes: every record they take is whole (counted, asserted after
   * the join so a failure leaves no writer running into the next test) */
  size_t torn = 0;
  for (int k = 0; k < 20; k++) torn += count_torn(snap, td__flight_snapshot(snap, TD__FLIGHT_RING));
  for (int w = 0; w < WRITERS; w++) pthread_join(th[w], NULL);
  assert_int_equal(torn, 0);
  size_t n = td__flight_snapshot(snap, TD__FLIGHT_RING);
  /* nobody writes now: every slot is complete, except where the newest claim's writer found an
   * older writer still in the slot (preempted between its claim and its write for a lap of the
   * ring) and dropped its record; such a hold spans a lap, so each writer costs the last lap one
   * record at most */
  assert_true(n >= TD__FLIGHT_RING - WRITERS && n <= TD__FLIGHT_RING);
  assert_int_equal(count_torn(snap, n), 0);
  /* each writer's records appear in its own order */
  uint64_t last[WRITERS];
  bool seen[WRITERS] = {false};
  for (size_t i = 0; i < n; i++) {
    int w = snap[i].peer;
    assert_true(w >= 0 && w < WRITERS);
    if (seen[w]) assert_true(snap[i].a > last[w]);
    seen[w] = true;
    last[w] = snap[i].a;
  }
}

/* ---- dumps ---- */

static char dir[256];

static int setup_dir(void **state) {
  (void)state;
  if (flight_test_mkdir(dir, sizeof dir, "td-flight") != 0) return -1;
  return td_debug_set_dump_dir(dir) == TD_OK ? 0 : -1;
}

static int teardown_dir(void **state) {
  (void)state;
  td_proc_kill_all();
  flight_test_rmdir(dir);
  td_debug_set_dump_dir(NULL);
  return 0;
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  static char buf[8 << 20];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  return buf;
}

static void test_flight_dump_round_trip(void **state) {
  (void)state;
  td__flight_set_process(2, "worker2", 3);
  td__flight_set_workers("worker0\0worker1\0worker2", 8, 3);
  td__flight_group_add(7, 2, 3, (const int[]){0, 1, 2});
  td__flight_set_clock(-12345, 10);
  /* an open collective whose start the ring overwrites later: the open record keeps it */
  td__flight_ev coll = {.kind = TD__FL_COLL_ENTER, .peer = 7, .a = 5, .b = 4096, .c = 1024,
                        .x = 0, .y = 3};
  td__flight_push(&coll, "all_reduce");
  td__flight_ev w = {.kind = TD__FL_WAIT_BEGIN, .peer = 1, .a = 42};
  td__flight_push(&w, "fetch");
  w.kind = TD__FL_WAIT_END;
  td__flight_pop(&w, "fetch"); /* closed: not open any more */
  uint64_t late = td__flight_claim(); /* a writer the fillers lap: its record is dropped */
  for (uint64_t i = 0; i < TD__FLIGHT_RING; i++) rec_ev(i, 0, "filler");
  td__flight_write(late, &(td__flight_rec){.kind = TD__FL_RPC_SEND, .name = "late"});
  assert_int_equal(td_debug_dump("unit test"), TD_OK);
  char path[600];
  snprintf(path, sizeof path, "%s/worker2.flight", dir);
  char *t = read_text(path);
  assert_non_null(t);
  assert_non_null(strstr(t, "tdist-flight 1\nrank 2\nname worker2\nworld 3\n"));
  assert_non_null(strstr(t, "clock_offset_ns -12345\n"));
  assert_non_null(strstr(t, "reason unit test\n"));
  assert_non_null(strstr(t, "worker 1 worker1\n"));
  assert_non_null(strstr(t, "group 7 3 2 0 1 2\n"));
  /* the lapped writer's record is counted (with any earlier one), and why-hung says so */
  unsigned long long dropped = 0;
  const char *dl = strstr(t, "\ndropped ");
  assert_non_null(dl);
  assert_int_equal(sscanf(dl + 1, "dropped %llu", &dropped), 1);
  assert_int_equal(dropped, td__flight_dropped());
  assert_true(dropped >= 1);
  int depth, tid, peer;
  unsigned long long ts, a, b;
  unsigned c, x, y;
  char kind[32], name[32];
  const char *open = strstr(t, "\nopen ");
  assert_non_null(open);
  assert_int_equal(sscanf(open + 1, "open %d %llu %d %31s %d %llu %llu %u %u %u %31s", &depth, &ts,
                          &tid, kind, &peer, &a, &b, &c, &x, &y, name), 11);
  assert_int_equal(depth, 0);
  assert_string_equal(kind, "coll_enter");
  assert_int_equal(peer, 7);
  assert_int_equal(a, 5);
  assert_int_equal(b, 4096);
  assert_int_equal(c, 1024);
  assert_int_equal(y, 3);
  assert_string_equal(name, "all_reduce");
  assert_null(strstr(t, "open 1 ")); /* the wait was closed */
  const char *first = strstr(t, " coll_enter 7 5 ");
  assert_non_null(first);
  assert_null(strstr(first + 1, " coll_enter 7 5 ")); /* its ring record is gone: only "open" */
  assert_non_null(strstr(t, " dump 0 1 0 0 0 0 unit_test\nend\n")); /* the request, then end */
  coll.kind = TD__FL_COLL_EXIT;
  td__flight_pop(&coll, "all_reduce");

  /* why-hung names the members of group 7 that left no dump as never entering #5 */
  char tool[] = TDIST_TRACE_PATH;
  char *argv[] = {tool, "why-hung", dir, NULL};
  td_proc p;
  assert_int_equal(td_proc_spawn(&p, tool, argv, NULL, false), 0);
  assert_int_equal(td_proc_finish(&p, 30), 0);
  if (!strstr(p.out, "culprit: worker0 (rank 0) never entered all_reduce #5 (float32 x 1024"))
    fprintf(stderr, "%s%s", p.out, p.err);
  assert_non_null(strstr(p.out, "culprit: worker0 (rank 0) never entered all_reduce #5 "
                                "(float32 x 1024, 4096 bytes, group 7, algorithm shm_direct)"));
  assert_non_null(strstr(p.out, "culprit: worker1 (rank 1) never entered all_reduce #5"));
  assert_non_null(strstr(p.out, "worker2 (rank 2), pid"));
  char said[64];
  snprintf(said, sizeof said, ", %llu record%s dropped:\n", dropped, dropped == 1 ? "" : "s");
  assert_non_null(strstr(p.out, said));
  assert_int_equal(WEXITSTATUS(p.status), 0);
  td_proc_free(&p);
  td__flight_group_remove(7);
}

/* Subjects: the thread's subject is set and restored around calls; a handler's annotation
 * rewrites its open record's subject (what the dump shows); td__flight_start leaves a .proc file
 * with this pid; the summary's totals add up. */
static void test_flight_subjects_annotations_and_process_file(void **state) {
  (void)state;
  td__flight_set_process(2, "worker2", 3);
  td__flight_subj rref = {TD__FL_SUBJ_RREF, ((uint64_t)1 << 48) | 7};
  td__flight_subj prev = td__flight_subject_set(rref);
  assert_int_equal(prev.kind, TD__FL_SUBJ_NONE);
  assert_int_equal(td__flight_subject().id, rref.id);
  td__flight_subject_set(prev);
  assert_int_equal(td__flight_subject().kind, TD__FL_SUBJ_NONE);

  td__flight_ev h = {.kind = TD__FL_HANDLER_START, .peer = 1, .a = 9};
  td__flight_push(&h, "__rref_fork");
  assert_int_equal(td__flight_open_subject().kind, TD__FL_SUBJ_NONE);
  td__flight_annotate(rref);
  td__flight_subj got = td__flight_open_subject();
  assert_int_equal(got.kind, TD__FL_SUBJ_RREF);
  assert_int_equal(got.id, rref.id);
  assert_int_equal(td_debug_dump("subjects"), TD_OK);
  char path[600];
  snprintf(path, sizeof path, "%s/worker2.flight", dir);
  char *t = read_text(path);
  assert_non_null(t);
  char want[200]; /* open 0 TS TID handler_start 1 9 <id> 0 0 1 __rref_fork */
  snprintf(want, sizeof want, " handler_start 1 9 %llu 0 0 1 __rref_fork\n",
           (unsigned long long)rref.id);
  assert_non_null(strstr(t, want));
  assert_non_null(strstr(t, "\npool "));
  h.kind = TD__FL_HANDLER_END;
  td__flight_pop(&h, "__rref_fork");

  td__flight_start();
  snprintf(path, sizeof path, "%s/worker2.proc", dir);
  t = read_text(path);
  assert_non_null(t);
  char pid_line[32];
  snprintf(pid_line, sizeof pid_line, "pid %d\n", (int)getpid());
  assert_non_null(strstr(t, pid_line));
  assert_non_null(strstr(t, "\nhost "));
  assert_non_null(strstr(t, "\nstart "));

  td__wait_totals w0, w1;
  td__flight_wait_totals(&w0);
  td__flight_count_wait(1000);
  td__flight_count_coll(300);
  td__flight_wait_totals(&w1);
  assert_int_equal(w1.wait_ns - w0.wait_ns, 1000);
  assert_int_equal(w1.coll_ns - w0.coll_ns, 300);
  assert_int_equal(w1.coll_n - w0.coll_n, 1);
}

static void test_flight_deadline_dumps_need_a_dir_and_keep_the_first(void **state) {
  (void)state;
  char path[600];
  snprintf(path, sizeof path, "%s/worker2.flight", dir);
  unlink(path);
  td_debug_set_dump_dir(NULL);
  unsetenv("TD_FLIGHT_DIR");
  td__flight_deadline("deadline: no dir");
  assert_int_not_equal(access(path, F_OK), 0);
  td_debug_set_dump_dir(dir);
  td__flight_deadline("deadline: first expiry");
  char *t = read_text(path);
  assert_non_null(t);
  assert_non_null(strstr(t, "reason deadline: first expiry\n"));
  td__flight_deadline("deadline: second expiry"); /* the same hang's cascade: the first is kept */
  assert_non_null(strstr(read_text(path), "reason deadline: first expiry\n"));
}

static void test_flight_sigusr1_dumps_from_the_dumper_thread(void **state) {
  (void)state;
  char path[600];
  snprintf(path, sizeof path, "%s/worker2.flight", dir);
  unlink(path);
  td__flight_start();
  td__flight_start(); /* idempotent */
  assert_int_equal(raise(SIGUSR1), 0); /* would end the process without the handler */
  TD_TEST_POLL(access(path, F_OK) == 0, 10);
  char *t = read_text(path);
  assert_non_null(t);
  assert_non_null(strstr(t, "reason SIGUSR1\n"));
  assert_non_null(strstr(t, "\nend\n"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_flight_ring_wraps_keeping_newest),
      cmocka_unit_test(test_flight_lapped_writer_keeps_the_newer_record),
      cmocka_unit_test(test_flight_concurrent_writers_leave_no_torn_record),
      cmocka_unit_test_setup_teardown(test_flight_dump_round_trip, setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_subjects_annotations_and_process_file,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_deadline_dumps_need_a_dir_and_keep_the_first,
                                      setup_dir, teardown_dir),
      cmocka_unit_test_setup_teardown(test_flight_sigusr1_dumps_from_the_dumper_thread, setup_dir,
                                      teardown_dir),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
