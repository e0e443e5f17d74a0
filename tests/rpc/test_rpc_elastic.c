/* test_rpc_elastic.c - elastic groups (td_rpc_options.max_world_size): workers that join a
 * running group take the next free places, reach and are reached by every worker by name and
 * rank, are counted by the graceful shutdown; a full group and a name in use refuse a joiner
 * without disturbing the group, a joiner takes the group's sizes whatever it was started with;
 * free places answer TD_ERR_NOT_FOUND. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rpc_test_fns.h"
#include "test_util.h"

#define START 2  /* workers that start the group */
#define PLACES 4 /* its places */

static td_rpc_options elastic_options(const char *method, int places) {
  td_rpc_options o = td_mp_rpc_options(method, 4);
  o.max_world_size = places;
  return o;
}

/* add(1, 2) on worker `to`, by name: 3 */
static void check_add(td_rpc_agent *a, const char *to) {
  td_value *args[2] = {td_value_int(1), td_value_int(2)}, *r = NULL;
  td_status st = td_rpc_sync(a, to, "add", args, 2, NULL, &r);
  if (st != TD_OK) fprintf(stderr, "rank %d -> %s: %s\n", td_rpc_rank(a), to, td_last_error());
  MP_CHECK_OK(st);
  int64_t v = 0;
  MP_CHECK_OK(td_value_as_int(r, &v));
  MP_CHECK(v == 3);
  td_value_unref(args[0]);
  td_value_unref(args[1]);
  td_value_unref(r);
}

/* whoami on `to`: the name `to` knows this worker by */
static bool known_as(td_rpc_agent *a, const char *to, const char *name) {
  td_value *r = NULL;
  if (td_rpc_sync(a, to, "whoami", NULL, 0, NULL, &r) != TD_OK) return false;
  const char *s = NULL;
  bool same = td_value_as_string(r, &s, NULL) == TD_OK && strcmp(s, name) == 0;
  td_value_unref(r);
  return same;
}

/* Processes 0 and 1 start the group; 2 and 3 join it (named late2 and late3, ranks in the order
 * they take their places). Every worker calls every other one by name (the starting workers
 * after td_rpc_group_members says both joined), except worker1, which learns the joiners' names
 * from their requests; all four pass the graceful shutdown, which waits for a joiner's late
 * call. */
static int worker_join(int proc, int nproc, const char *method, void *arg) {
  register_test_fns();
  td_rpc_options o = elastic_options(method, PLACES);
  td_rpc_agent *a;
  char name[32];
  bool joiner = proc >= START;
  snprintf(name, sizeof name, joiner ? "late%d" : "worker%d", proc);
  MP_CHECK_OK(td_rpc_init(name, joiner ? TD_RPC_RANK_JOIN : proc, START, &o, &a));
  MP_CHECK(td_rpc_world_size(a) == PLACES);
  MP_CHECK(td_rpc_initial_world_size(a) == START);
  int me = td_rpc_rank(a);
  MP_CHECK(joiner ? me >= START && me < PLACES : me == proc);
  int members = 0;
  TD_TEST_POLL(td_rpc_group_members(a, &members) == TD_OK && members == PLACES, 20);
  MP_CHECK(members == PLACES);
  const char *names[PLACES] = {"worker0", "worker1", "late2", "late3"};
  for (int p = 0; p < PLACES; p++) {
    /* worker1 never looks a joiner up: it learns them from their requests (below) */
    if (p == proc || (proc == 1 && p >= START)) continue;
    td_worker_info wi;
    /* a joiner may not have published itself yet: its name is unknown until it has */
    TD_TEST_POLL(td_rpc_get_worker_info(a, names[p], &wi) == TD_OK, 20);
    MP_CHECK_OK(td_rpc_get_worker_info(a, names[p], &wi));
    td_worker_info by_rank;
    MP_CHECK_OK(td_rpc_get_worker_info_by_rank(a, wi.id, &by_rank));
    MP_CHECK(strcmp(by_rank.name, names[p]) == 0);
    check_add(a, names[p]);
  }
  if (joiner) { /* worker1 learns a joiner's name from its requests (on its pool) */
    bool known = false;
    TD_TEST_POLL((known = known_as(a, "worker1", name)), 10);
    MP_CHECK(known);
  }
  if (proc == 3) { /* the graceful shutdown waits for a joiner: the others are in it by now */
    td_test_sleep_ms(td_test_ms(1000));
    check_add(a, "worker0");
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_elastic_join_call_shutdown(void **state) {
  TD_MP_RUN(PLACES, worker_join, NULL, 90);
}

/* Marker files in the test's directory: the processes of test_rpc_elastic_refusals tell each
 * other what they have done. */
static void mark(const char *dir, const char *what) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, what);
  FILE *f = fopen(path, "w");
  MP_CHECK(f != NULL);
  fclose(f);
}

static bool marked(const char *dir, const char *what) {
  char path[512];
  struct stat sb;
  snprintf(path, sizeof path, "%s/%s", dir, what);
  return stat(path, &sb) == 0;
}

/* A group of 1 with 2 places. Process 1 joins (rank 1); processes 2 and 3 try once process 1
 * has: the group is full (3 was started with 3 places: a joiner takes the group's sizes).
 * Process 4 gives a starting worker's name: refused too. Rank 0 finds rank 1 by name, the free place answers TD_ERR_NOT_FOUND until then,
 * and the refusals leave the group as it was: ranks 0 and 1 pass a graceful shutdown after them
 * (a refused joiner that took a place would be waited for there). */
static int worker_full(int proc, int nproc, const char *method, void *arg) {
  const char *dir = arg;
  register_test_fns();
  td_rpc_options o = elastic_options(method, 2);
  td_rpc_agent *a = NULL;
  if (proc == 0) {
    MP_CHECK_OK(td_rpc_init("worker0", 0, 1, &o, &a));
    td_worker_info wi;
    td_status st = td_rpc_get_worker_info_by_rank(a, 1, &wi);
    MP_CHECK(st == TD_OK || (st == TD_ERR_NOT_FOUND && strstr(td_last_error(), "free place")));
    TD_TEST_POLL(td_rpc_get_worker_info(a, "first", &wi) == TD_OK, 20);
    MP_CHECK_OK(td_rpc_get_worker_info(a, "first", &wi));
    MP_CHECK(wi.id == 1);
    check_add(a, "first");
    TD_TEST_POLL(marked(dir, "2") && marked(dir, "3") && marked(dir, "4"), 40);
    MP_CHECK(marked(dir, "2") && marked(dir, "3") && marked(dir, "4"));
    int members = 0;
    MP_CHECK_OK(td_rpc_group_members(a, &members));
    MP_CHECK(members == 2);
    mark(dir, "refusals-seen");
    MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
    td_rpc_destroy(a);
    return 0;
  }
  if (proc == 1) {
    MP_CHECK_OK(td_rpc_init("first", TD_RPC_RANK_JOIN, 1, &o, &a));
    MP_CHECK(td_rpc_rank(a) == 1);
    mark(dir, "joined");
    check_add(a, "worker0");
    TD_TEST_POLL(marked(dir, "refusals-seen"), 40);
    MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
    td_rpc_destroy(a);
    return 0;
  }
  /* the refused: 2 (full: it tries after "first" joined), 3 (the same, started with other
   * sizes: a joiner takes the group's), 4 (a starting worker's name) */
  if (proc == 2 || proc == 3) {
    TD_TEST_POLL(marked(dir, "joined"), 40);
    MP_CHECK(marked(dir, "joined"));
  }
  if (proc == 3) o.max_world_size = 3;
  const char *nm = proc == 4 ? "worker0" : proc == 2 ? "second" : "third";
  td_status st = td_rpc_init(nm, TD_RPC_RANK_JOIN, 1, &o, &a);
  if (st == TD_OK) fprintf(stderr, "proc %d joined as rank %d\n", proc, td_rpc_rank(a));
  MP_CHECK(st != TD_OK);
  if (proc == 2) MP_CHECK(st == TD_ERR_STATE && strstr(td_last_error(), "is full"));
  if (proc == 3) MP_CHECK(st == TD_ERR_STATE && strstr(td_last_error(), "its 2 places"));
  if (proc == 4) MP_CHECK(st == TD_ERR_EXISTS && strstr(td_last_error(), "already called"));
  char me[8];
  snprintf(me, sizeof me, "%d", proc);
  mark(dir, me);
  return 0;
}

static void test_rpc_elastic_refusals(void **state) {
  char dir[] = "/tmp/td_elastic_XXXXXX";
  assert_non_null(mkdtemp(dir));
  int codes[5] = {0};
  int fails = td_mp_run(5, worker_full, dir, 90, codes);
  const char *files[] = {"2", "3", "4", "joined", "refusals-seen"};
  for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, files[i]);
    unlink(path);
  }
  rmdir(dir);
  if (fails) fail_msg("%d workers failed (%d %d %d %d %d)", fails, codes[0], codes[1], codes[2],
                      codes[3], codes[4]);
}

/* No process: a joiner needs an elastic group; a max world size below the world size. */
static void test_rpc_elastic_local_errors(void **state) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:1";
  td_rpc_agent *a = NULL;
  assert_int_equal(td_rpc_init("x", TD_RPC_RANK_JOIN, 2, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "max world size"));
  o.max_world_size = 1;
  assert_int_equal(td_rpc_init("x", 0, 2, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "max world size 1"));
  assert_null(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_elastic_local_errors),
      cmocka_unit_test(test_rpc_elastic_join_call_shutdown),
      cmocka_unit_test(test_rpc_elastic_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
