/* test_rpc_lifecycle.c - multi-process tests of init and shutdown: init errors (duplicate names,
 * world-size mismatch, invalid names, timeouts), init from the environment, init after shutdown,
 * graceful shutdown waiting for fire-and-forget chains, shutdown deadlines naming the workers
 * that never arrived, non-graceful shutdown. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/stat.h>

#include "rpc_test_fns.h"
#include "test_util.h"

/* ---- fire-and-forget chains ---- */

static char marker_dir[256];

/* relay(k): fire-and-forget relay(k-1) to the next rank, then return at once; at 0 write a file */
static td_status fn_relay(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t k;
  td_status st = td_value_as_int(args[0], &k);
  if (st != TD_OK) return st;
  td_rpc_agent *a = td_rpc_ctx_agent(c);
  if (k == 0) {
    td_test_sleep_ms(300); /* the last hop is slow: shutdown must wait for it */
    char path[300];
    snprintf(path, sizeof path, "%s/done-%d", marker_dir, td_rpc_rank(a));
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
    *res = td_value_none();
    return TD_OK;
  }
  td_worker_info next;
  st = td_rpc_get_worker_info_by_rank(a, (td_rpc_rank(a) + 1) % td_rpc_world_size(a), &next);
  if (st != TD_OK) return st;
  td_value *arg = td_value_int(k - 1);
  td_future *f = NULL;
  st = td_rpc_async(a, next.name, "relay", &arg, 1, NULL, &f);
  td_value_unref(arg);
  td_future_unref(f); /* nobody waits */
  *res = td_value_none();
  return st;
}

static int worker_fire_and_forget(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("relay", fn_relay, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_value *k = td_value_int(4); /* worker1(4) -> 2(3) -> 0(2) -> 1(1) -> 2(0) writes */
    td_future *f;
    MP_CHECK_OK(td_rpc_async(a, "worker1", "relay", &k, 1, NULL, &f));
    td_value_unref(k);
    td_future_unref(f);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  /* graceful shutdown returned: the whole chain must have finished everywhere */
  if (rank == 0) {
    char path[300];
    snprintf(path, sizeof path, "%s/done-2", marker_dir);
    struct stat sb;
    MP_CHECK(stat(path, &sb) == 0);
  }
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_shutdown_waits_for_chains(void **state) {
  snprintf(marker_dir, sizeof marker_dir, "/tmp/tdist-ff-%d", (int)getpid());
  mkdir(marker_dir, 0700);
  int codes[3];
  int fails = td_mp_run(3, worker_fire_and_forget, NULL, 60, codes);
  char path[300];
  snprintf(path, sizeof path, "%s/done-2", marker_dir);
  unlink(path);
  rmdir(marker_dir);
  if (fails) fail_msg("%d workers failed (%d %d %d)", fails, codes[0], codes[1], codes[2]);
}

/* ---- shutdown deadline naming the missing worker ---- */

static int worker_missing(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 2) {
    /* never calls shutdown; it is killed when the others are done */
    td_test_sleep_ms(td_test_ms(3000));
    td_rpc_destroy(a);
    return 0;
  }
  double t0 = td_test_now_s();
  td_status st = td_rpc_shutdown(a, true, 800); /* must expire: not scaled */
  double el = td_test_now_s() - t0;
  MP_CHECK(st == TD_ERR_TIMEOUT);
  MP_CHECK(strstr(td_last_error(), "worker2 (rank 2)") != NULL);
  MP_CHECK(strstr(td_last_error(), "worker1") == NULL);
  MP_CHECK(el < td_test_s(3.0));
  MP_CHECK(td_rpc_shutdown(a, true, 100) == TD_OK); /* second call is a no-op */
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_shutdown_deadline_names_missing(void **state) {
  TD_MP_RUN(3, worker_missing, NULL, 60);
}

/* ---- non-graceful shutdown returns at once and fails calls in flight ---- */

static int worker_abort(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_value *ms = td_value_int(2000);
    td_future *f;
    MP_CHECK_OK(td_rpc_async(a, "worker1", "slow", &ms, 1, NULL, &f));
    td_value_unref(ms);
    double t0 = td_test_now_s();
    MP_CHECK_OK(td_rpc_shutdown(a, false, 0));
    MP_CHECK(td_test_now_s() - t0 < td_test_s(1.0));
    MP_CHECK(td_future_done(f));
    MP_CHECK(td_future_status(f) == TD_ERR_CANCELLED);
    td_future_unref(f);
    td_value *r;
    MP_CHECK(td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &r) == TD_ERR_STATE);
  } else {
    td_test_sleep_ms(td_test_ms(2500));
    td_rpc_shutdown(a, false, 0);
  }
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_shutdown_nongraceful(void **state) {
  TD_MP_RUN(2, worker_abort, NULL, 30);
}

/* ---- init after shutdown, and init from the environment ---- */

static int worker_reinit(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  const char *port = strrchr(method, ':') + 1;
  setenv("RANK", rank == 0 ? "0" : "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port, 1);
  for (int round = 0; round < 2; round++) {
    td_rpc_options o = td_mp_rpc_options(NULL, 2);
    td_rpc_agent *a;
    char nm[16];
    snprintf(nm, sizeof nm, "again%d", rank);
    MP_CHECK_OK(td_rpc_init_from_env(round ? nm : NULL, &o, &a));
    td_worker_info me;
    MP_CHECK_OK(td_rpc_self(a, &me));
    MP_CHECK(me.id == rank);
    const char *peer = round ? NULL : (rank ? "worker0" : "worker1");
    if (!round) {
      td_value *two[2] = {td_value_int(1), td_value_int(rank)}, *r;
      MP_CHECK_OK(td_rpc_sync(a, peer, "add", two, 2, NULL, &r));
      td_value_unref(r);
      td_value_unref(two[0]);
      td_value_unref(two[1]);
    }
    MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
    td_rpc_destroy(a);
    if (round == 0) td_test_sleep_ms(td_test_ms(200)); /* rank 0's port must be free again */
  }
  return 0;
}

static void test_rpc_init_after_shutdown_from_env(void **state) {
  TD_MP_RUN(2, worker_reinit, NULL, 60);
}

/* ---- init errors ---- */

static int worker_dup_names(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = td_test_ms(10000);
  td_rpc_agent *a;
  td_status st = td_rpc_init(rank == 2 ? "trainer" : (rank == 1 ? "trainer" : "ps"), rank, world,
                             &o, &a);
  MP_CHECK(st == TD_ERR_EXISTS || st == TD_ERR_REMOTE);
  MP_CHECK(strstr(td_last_error(), "trainer") != NULL);
  return 0;
}

static void test_rpc_init_duplicate_names(void **state) {
  TD_MP_RUN(3, worker_dup_names, NULL, 30);
}

static int worker_bad_world(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = td_test_ms(10000);
  td_rpc_agent *a;
  td_status st = td_rpc_init(NULL, rank, rank == 1 ? 3 : 2, &o, &a);
  MP_CHECK(st != TD_OK);
  MP_CHECK(strstr(td_last_error(), "world size") != NULL);
  return 0;
}

/* Two runs given one port: rank 0 of run "job-a" waits for its rank 1; a worker of run "job-b"
 * (the same secret, the same rank and world size) comes first and is refused at once, naming the
 * port; then job-a's own rank 1 joins and job-a works. */
static int worker_two_runs(int rank, int world, const char *method, void *arg) {
  (void)world;
  (void)arg;
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  if (rank == 2) { /* job-b's rank 1 */
    o.run_id = "job-b";
    double t0 = td_test_now_s();
    td_status st = td_rpc_init(NULL, 1, 2, &o, &a);
    fprintf(stderr, "job-b refused after %.2f s: %s\n", td_test_now_s() - t0, td_last_error());
    MP_CHECK(st == TD_ERR_EXISTS);
    MP_CHECK(strstr(td_last_error(), "another run") != NULL);
    MP_CHECK(strstr(td_last_error(), "'job-a'") != NULL);
    const char *port = strrchr(method, ':') + 1;
    char want[64];
    snprintf(want, sizeof want, "MASTER_PORT %s", port);
    MP_CHECK(strstr(td_last_error(), want) != NULL);
    MP_CHECK(td_test_now_s() - t0 < td_test_s(5));
    return 0;
  }
  register_test_fns();
  o.run_id = "job-a";
  if (rank == 1) td_test_sleep_ms(td_test_ms(1500)); /* after job-b's attempt */
  MP_CHECK_OK(td_rpc_init(NULL, rank, 2, &o, &a));
  td_value *two[2] = {td_value_int(1), td_value_int(rank)}, *r;
  MP_CHECK_OK(td_rpc_sync(a, rank ? "worker0" : "worker1", "add", two, 2, NULL, &r));
  td_value_unref(r);
  td_value_unref(two[0]);
  td_value_unref(two[1]);
  td_mp_finish(a, 20);
  return 0;
}

static void test_rpc_init_refuses_another_run(void **state) {
  TD_MP_RUN(3, worker_two_runs, NULL, 60);
}

/* MASTER_PORT taken by another program: one clear line naming the port, and none of gRPC's
 * internal error text on standard error (it goes to DEBUG). */
static int worker_port_in_use(int rank, int world, const char *method, void *arg) {
  (void)rank, (void)world, (void)arg;
  int port = atoi(strrchr(method, ':') + 1);
  int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  MP_CHECK(ls >= 0 && bind(ls, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(ls, 4) == 0);
  char path[] = "/tmp/td-port-in-use-XXXXXX";
  int fd = mkstemp(path), saved = dup(2);
  MP_CHECK(fd >= 0 && saved >= 0);
  fflush(stderr);
  dup2(fd, 2);
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  td_status st = td_rpc_init(NULL, 0, 2, &o, &a);
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", td_last_error());
  fflush(stderr);
  dup2(saved, 2);
  char err[8192] = "";
  ssize_t n = pread(fd, err, sizeof err - 1, 0);
  err[n > 0 ? n : 0] = 0;
  close(fd);
  unlink(path);
  close(ls);
  fprintf(stderr, "init: %s\nstderr meanwhile: [%s]\n", msg, err);
  MP_CHECK(st != TD_OK);
  char want[64];
  snprintf(want, sizeof want, "port %d on 127.0.0.1 is in use", port);
  MP_CHECK(strstr(msg, want) != NULL);
  MP_CHECK(strstr(msg, "--standalone") != NULL);
  MP_CHECK(strstr(err, "chttp2") == NULL && strstr(err, "UNKNOWN:") == NULL);
  return 0;
}

static void test_rpc_init_port_in_use_one_line(void **state) {
  TD_MP_RUN(1, worker_port_in_use, NULL, 30);
}

static void test_rpc_init_world_size_mismatch(void **state) {
  TD_MP_RUN(2, worker_bad_world, NULL, 30);
}

static void test_rpc_init_errors_local(void **state) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:1";
  td_rpc_agent *a = NULL;
  TD_ASSERT_STATUS(td_rpc_init("bad name!", 0, 1, &o, &a), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_rpc_init(NULL, 2, 2, &o, &a), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 0, &o, &a), TD_ERR_INVALID);
  o.init_method = "udp://x";
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 1, &o, &a), TD_ERR_INVALID);
  assert_null(a);
  TD_ASSERT_STATUS(td_rpc_register("__mine", td_test_fn_echo, NULL), TD_ERR_INVALID);
  TD_ASSERT_OK(td_rpc_register("twice", td_test_fn_echo, NULL));
  TD_ASSERT_STATUS(td_rpc_register("twice", td_test_fn_echo, NULL), TD_ERR_EXISTS);
  TD_ASSERT_OK(td_rpc_unregister("twice"));
  TD_ASSERT_STATUS(td_rpc_unregister("twice"), TD_ERR_NOT_FOUND);
}

static int worker_alone(int rank, int world, const char *method, void *arg) {
  /* world size 2 but only rank 1 starts: rank 0's store never appears */
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.init_timeout_ms = 700; /* must expire: not scaled */
  td_rpc_agent *a;
  double t0 = td_test_now_s();
  td_status st = td_rpc_init(NULL, 1, 2, &o, &a);
  MP_CHECK(st != TD_OK);
  MP_CHECK(td_test_now_s() - t0 < td_test_s(5.0));
  return 0;
}

static void test_rpc_init_deadline(void **state) {
  TD_MP_RUN(1, worker_alone, NULL, 30);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_init_errors_local),
      cmocka_unit_test(test_rpc_shutdown_waits_for_chains),
      cmocka_unit_test(test_rpc_shutdown_deadline_names_missing),
      cmocka_unit_test(test_rpc_shutdown_nongraceful),
      cmocka_unit_test(test_rpc_init_after_shutdown_from_env),
      cmocka_unit_test(test_rpc_init_duplicate_names),
      cmocka_unit_test(test_rpc_init_world_size_mismatch),
      cmocka_unit_test(test_rpc_init_refuses_another_run),
      cmocka_unit_test(test_rpc_init_port_in_use_one_line),
      cmocka_unit_test(test_rpc_init_deadline),
  };
  return cmocka_run_group_tests_name("rpc_lifecycle", tests, NULL, NULL);
}
