/* test_rref.c - multi-process tests of remote references: remote + to_here, creation errors and
 * timeouts, proxies on remote objects with counted destructors, forks in the orderings the
 * protocol must survive (fork before the owner confirmed creation, a parent releasing before its
 * child's fork is accepted, an RRef sent to its own owner, a chain A -> B -> C -> owner), 1000
 * RRefs created, forked and released concurrently by 3 workers, and strict-mode leak reports.
 * Every worker runs in strict mode: a graceful shutdown with a leak would fail the test.
 * Lock order: a creation probe's mu is a leaf. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "rref_test_fns.h"
#include "test_util.h"

static td_rpc_agent *start(int rank, int world, const char *method, int threads) {
  rt_register_all();
  td_rref_set_strict(true);
  td_rpc_options o = td_mp_rpc_options(method, threads);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

static void finish(td_rpc_agent *a) { td_mp_finish(a, 30); }

static int64_t as_int(td_value *v) {
  int64_t x = -1;
  MP_CHECK_OK(td_value_as_int(v, &x));
  return x;
}

/* ---- remote + to_here, owner queries, self remote, local RRefs ---- */

static int worker_basics(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_value *args[2] = {td_value_int(40), td_value_int(2)};
    td_rref *r;
    MP_CHECK_OK(td_remote(a, "worker1", "add", args, 2, NULL, &r));
    MP_CHECK(!td_rref_is_owner(r));
    MP_CHECK(td_rref_owner(r) == 1);
    MP_CHECK(strcmp(td_rref_owner_name(r), "worker1") == 0);
    MP_CHECK(td_rref_get_id(r).v >> 48 == 0);
    MP_CHECK(td_rref_get_fork_id(r).v == td_rref_get_id(r).v); /* the creator's fork */
    td_future *cf;
    MP_CHECK_OK(td_rref_creation_future(r, &cf));
    MP_CHECK_OK(td_future_wait(cf, td_test_ms(10000)));
    td_future_unref(cf);
    MP_CHECK(td_rref_confirmed_by_owner(r));
    td_value *v;
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 42);
    td_value_unref(v);
    /* twice: the value stays on the owner */
    MP_CHECK_OK(td_rref_to_here(r, TD_TIMEOUT_DEFAULT, &v));
    MP_CHECK(as_int(v) == 42);
    td_value_unref(v);
    MP_CHECK(td_rref_local_value(r, &v) == TD_ERR_STATE);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    char s[160];
    td_rref_to_string(r, s, sizeof s);
    MP_CHECK(strstr(s, "RRef(owner=worker1, id=0:") == s);
    td_value *rv = td_value_rref(r);
    td_value_to_string(rv, s, sizeof s);
    MP_CHECK(strstr(s, "RRef(owner=worker1") != NULL);
    td_rref *back;
    MP_CHECK_OK(td_value_as_rref(rv, &back));
    MP_CHECK(back == r);
    MP_CHECK(td_value_as_rref(args[0], &back) == TD_ERR_INVALID);
    td_value_unref(rv);
    td_rref_unref(r);

    /* a tensor value */
    td_tensor *t;
    float data[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {2, 3};
    MP_CHECK_OK(td_tensor_from_buffer(data, shape, 2, TD_DTYPE_F32, &t));
    td_value *tv = td_value_tensor(t);
    MP_CHECK_OK(td_remote(a, "worker1", "echo", &tv, 1, NULL, &r));
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(td_value_equal(v, tv));
    td_value_unref(v);
    td_rref_unref(r);
    td_value_unref(tv);
    td_tensor_unref(t);

    /* remote to self: an owner handle; the function runs on the pool */
    MP_CHECK_OK(td_remote(a, "worker0", "add", args, 2, NULL, &r));
    MP_CHECK(td_rref_is_owner(r));
    MP_CHECK(td_rref_confirmed_by_owner(r));
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 42);
    td_value_unref(v);
    MP_CHECK_OK(td_rref_local_value(r, &v));
    MP_CHECK(as_int(v) == 42);
    td_value_unref(v);
    td_rref_to_string(r, s, sizeof s);
    MP_CHECK(strstr(s, "local") != NULL);
    td_rref_unref(r);

    /* a local RRef sent to a user and fetched back through it */
    MP_CHECK_OK(td_rref_create_local(a, args[0], &r));
    MP_CHECK_OK(td_rref_local_value(r, &v));
    MP_CHECK(v == args[0]);
    td_value_unref(v);
    rv = td_value_rref(r);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "here", &rv, 1, NULL, &v));
    MP_CHECK(as_int(v) == 40);
    td_value_unref(v);
    td_value_unref(rv);
    td_rref_unref(r);
    td_value_unref(args[0]);
    td_value_unref(args[1]);
    size_t o, u;
    rt_table_sizes(a, &o, &u);
    MP_CHECK(u == 0);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  finish(a);
  return 0;
}

static void test_rref_remote_to_here(void **state) { TD_MP_RUN(2, worker_basics, NULL, 90); }

/* ---- creation errors and timeouts ---- */

static int worker_errors(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_rref *r;
    td_value *v = NULL;
    MP_CHECK_OK(td_remote(a, "worker1", "fail", NULL, 0, NULL, &r));
    td_future *cf;
    MP_CHECK_OK(td_rref_creation_future(r, &cf));
    MP_CHECK(td_future_wait(cf, td_test_ms(10000)) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_future_message(cf), "RRef creation failed: worker1 (rank 1): 'fail' failed: "
                                           "boom 42") == td_future_message(cf));
    td_future_unref(cf);
    MP_CHECK(td_rref_to_here(r, td_test_ms(10000), &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed: worker1 (rank 1): 'fail' failed: "
                                     "boom 42") != NULL);
    /* proxies and forks report it too */
    MP_CHECK(td_rref_rpc_sync(r, "echo", NULL, 0, NULL, &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed") != NULL);
    td_value *rv = td_value_rref(r);
    MP_CHECK(td_rpc_sync(a, "worker1", "keep", &rv, 1, NULL, &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed") != NULL);
    td_value_unref(rv);
    td_rref_unref(r);

    /* unknown function */
    MP_CHECK_OK(td_remote(a, "worker1", "no_such_fn", NULL, 0, NULL, &r));
    MP_CHECK(td_rref_to_here(r, td_test_ms(10000), &v) == TD_ERR_NOT_FOUND);
    MP_CHECK(strstr(td_last_error(), "no function 'no_such_fn'") != NULL);
    td_rref_unref(r);

    /* a failure seen through a fork made while the creation was still running: the owner
     * reports it (here the fork went back to the owner, whose to_here waits and fails) */
    td_value *ms = td_value_int(300), *zero = td_value_int(0);
    td_rref *k;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &k));
    MP_CHECK_OK(td_rref_remote(k, "fail", NULL, 0, NULL, &r));
    rv = td_value_rref(r);
    MP_CHECK(td_rpc_sync(a, "worker1", "here", &rv, 1, NULL, &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed: worker1 (rank 1): 'fail' failed: "
                                     "boom 42") != NULL);
    MP_CHECK(td_rref_rpc_sync(r, "echo", NULL, 0, NULL, &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed: worker1 (rank 1): 'fail'") != NULL);
    td_value_unref(rv);
    td_rref_unref(r);
    td_rref_unref(k);
    td_value_unref(ms);
    td_value_unref(zero);

    /* creation timeout: stored on the RRef */
    td_value *slow = td_value_int(1500);
    td_rpc_call_opts opts = TD_RPC_CALL_OPTS_INIT;
    opts.timeout_ms = 200;
    MP_CHECK_OK(td_remote(a, "worker1", "slow", &slow, 1, &opts, &r));
    MP_CHECK(td_rref_to_here(r, td_test_ms(10000), &v) == TD_ERR_TIMEOUT);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed") != NULL);
    MP_CHECK(strstr(td_last_error(), "timed out") != NULL);
    td_rref_unref(r);

    /* call options not filled by TD_RPC_CALL_OPTS_INIT: refused, nothing sent, no RRef */
    td_rpc_stats before, after;
    MP_CHECK_OK(td_rpc_get_stats(a, &before));
    td_rpc_call_opts zeroed = {0};
    r = NULL;
    MP_CHECK(td_remote(a, "worker1", "slow", &slow, 1, &zeroed, &r) == TD_ERR_INVALID && !r);
    MP_CHECK(strstr(td_last_error(), "td_rpc_call_opts not initialised: use "
                                     "TD_RPC_CALL_OPTS_INIT") != NULL);
    td_rref *lr;
    MP_CHECK_OK(td_rref_create_local(a, slow, &lr));
    MP_CHECK(td_rref_remote(lr, "echo", NULL, 0, &zeroed, &r) == TD_ERR_INVALID && !r);
    MP_CHECK(strstr(td_last_error(), "not initialised") != NULL);
    v = NULL;
    MP_CHECK(td_rref_rpc_sync(lr, "echo", NULL, 0, &zeroed, &v) == TD_ERR_INVALID && !v);
    MP_CHECK(strstr(td_last_error(), "not initialised") != NULL);
    MP_CHECK_OK(td_rpc_get_stats(a, &after));
    MP_CHECK(after.calls_started == before.calls_started);
    td_rref_unref(lr);

    /* to_here timeout on a slow (but fine) creation; a later to_here gets the value */
    MP_CHECK_OK(td_remote(a, "worker1", "slow", &slow, 1, NULL, &r));
    MP_CHECK(td_rref_to_here(r, 200, &v) == TD_ERR_TIMEOUT);
    MP_CHECK(strstr(td_last_error(), "to_here") != NULL);
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 1500);
    td_value_unref(v);
    td_rref_unref(r);

    /* to_here timeout on the owner (a self remote) */
    MP_CHECK_OK(td_remote(a, "worker0", "slow", &slow, 1, NULL, &r));
    MP_CHECK(td_rref_to_here(r, 100, &v) == TD_ERR_TIMEOUT);
    /* local_value on the owner waits for the value being created (PyTorch's OwnerRRef) */
    MP_CHECK_OK(td_rref_local_value(r, &v));
    MP_CHECK(as_int(v) == 1500);
    td_value_unref(v);
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 1500);
    td_value_unref(v);
    td_rref_unref(r);

    /* a self remote that fails */
    MP_CHECK_OK(td_remote(a, "worker0", "fail", NULL, 0, NULL, &r));
    MP_CHECK(td_rref_to_here(r, td_test_ms(10000), &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "RRef creation failed: worker0 (rank 0): 'fail' failed") !=
             NULL);
    td_rref_unref(r);
    td_value_unref(slow);
    MP_CHECK(td_remote(a, "nobody", "add", NULL, 0, NULL, &r) == TD_ERR_NOT_FOUND);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  finish(a);
  return 0;
}

static void test_rref_creation_errors_and_timeouts(void **state) {
  TD_MP_RUN(2, worker_errors, NULL, 90);
}

/* ---- proxies on remote objects; destructors counted ---- */

static void counter_stats(td_rpc_agent *a, const char *who, int64_t *made, int64_t *destroyed) {
  td_value *v;
  MP_CHECK_OK(td_rpc_sync(a, who, "counter_stats", NULL, 0, NULL, &v));
  *made = as_int(td_value_list_get(v, 0));
  *destroyed = as_int(td_value_list_get(v, 1));
  td_value_unref(v);
}

/* owned_on returns the number of entries worker who owns (its "table" function). */
static int64_t owned_on(td_rpc_agent *a, const char *who) {
  td_value *v;
  MP_CHECK_OK(td_rpc_sync(a, who, "table", NULL, 0, NULL, &v));
  int64_t owned = as_int(td_value_list_get(v, 0));
  td_value_unref(v);
  return owned;
}

static int worker_proxies(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_value *start10 = td_value_int(10), *five = td_value_int(5), *v;
    td_rref *k;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", &start10, 1, NULL, &k));
    MP_CHECK_OK(td_rref_rpc_sync(k, "counter_add", &five, 1, NULL, &v));
    MP_CHECK(as_int(v) == 15);
    td_value_unref(v);
    td_future *fs[20];
    for (int i = 0; i < 20; i++) MP_CHECK_OK(td_rref_rpc_async(k, "counter_add", &five, 1, NULL, &fs[i]));
    MP_CHECK_OK(td_future_wait_all(fs, 20, td_test_ms(10000)));
    for (int i = 0; i < 20; i++) td_future_unref(fs[i]);
    td_rref *g;
    MP_CHECK_OK(td_rref_remote(k, "counter_get", NULL, 0, NULL, &g));
    MP_CHECK_OK(td_rref_to_here(g, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 115);
    td_value_unref(v);
    td_rref_unref(g);
    /* an opaque object cannot travel */
    MP_CHECK(td_rref_to_here(k, td_test_ms(10000), &v) != TD_OK);
    MP_CHECK(strstr(td_last_error(), "Counter") != NULL);
    /* errors of the method name the owner and the method */
    td_value *bad = td_value_string("x");
    MP_CHECK(td_rref_rpc_sync(k, "counter_add", &bad, 1, NULL, &v) == TD_OK); /* d defaults */
    td_value_unref(v);
    MP_CHECK(td_rref_rpc_sync(k, "fail", &bad, 1, NULL, &v) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1): 'fail' failed: boom 42") != NULL);
    MP_CHECK(td_rref_rpc_sync(k, "nope", NULL, 0, NULL, &v) == TD_ERR_NOT_FOUND);
    td_value_unref(bad);

    int64_t made, destroyed;
    counter_stats(a, "worker1", &made, &destroyed);
    MP_CHECK(made == 1 && destroyed == 0);
    /* an async proxy keeps its RRef alive: release before the reply */
    td_future *f;
    MP_CHECK_OK(td_rref_rpc_async(k, "counter_get", NULL, 0, NULL, &f));
    td_rref_unref(k);
    MP_CHECK_OK(td_future_wait(f, td_test_ms(10000)));
    MP_CHECK(as_int(td_future_value(f)) == 116);
    td_future_unref(f);
    /* the last user is gone: the destructor runs on the owner, exactly once */
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed), 5);
    MP_CHECK(made == 1 && destroyed == 1);

    /* proxies on a value still being created wait for it (no pool thread blocks) */
    td_value *ms = td_value_int(400);
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", (td_value *[]){start10, ms}, 2, NULL, &k));
    for (int i = 0; i < 8; i++) MP_CHECK_OK(td_rref_rpc_async(k, "counter_add", &five, 1, NULL, &fs[i]));
    MP_CHECK_OK(td_rref_remote(k, "counter_get", NULL, 0, NULL, &g));
    MP_CHECK_OK(td_future_wait_all(fs, 8, td_test_ms(10000)));
    for (int i = 0; i < 8; i++) td_future_unref(fs[i]);
    MP_CHECK_OK(td_rref_to_here(g, td_test_ms(10000), &v)); /* ran concurrently with the adds */
    MP_CHECK(as_int(v) >= 10 && as_int(v) <= 50 && as_int(v) % 5 == 0);
    td_value_unref(v);
    td_rref_unref(g);
    MP_CHECK_OK(td_rref_remote(k, "counter_get", NULL, 0, NULL, &g));
    MP_CHECK_OK(td_rref_to_here(g, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 50);
    td_value_unref(v);
    td_rref_unref(g);
    td_rref_unref(k);
    td_value_unref(ms);

    /* a local object on worker0 used through a self proxy */
    td_value *ov;
    rt_counter *kk = malloc(sizeof *kk);
    kk->v = 7;
    MP_CHECK_OK(td_value_object("Counter", kk, &ov));
    MP_CHECK_OK(td_rref_create_local(a, ov, &k));
    td_value_unref(ov);
    MP_CHECK_OK(td_rref_rpc_sync(k, "counter_add", &five, 1, NULL, &v));
    MP_CHECK(as_int(v) == 12);
    td_value_unref(v);
    MP_CHECK(__atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE) == 0);
    td_rref_unref(k);
    MP_CHECK(__atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE) == 1);
    td_value_unref(start10);
    td_value_unref(five);
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed == 2), 5);
    MP_CHECK(made == 2 && destroyed == 2);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  finish(a);
  return 0;
}

static void test_rref_proxies_on_objects(void **state) { TD_MP_RUN(2, worker_proxies, NULL, 90); }

/* ---- fork orderings ---- */

static int worker_forks(int rank, int world, const char *method, void *arg) {
  /* the owner of (1)-(3) accepts forks late: deletes overtake fork messages */
  if (rank == 1) setenv("TD_RREF_TEST_FORK_DELAY_MS", "200", 1);
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_value *zero = td_value_int(0), *ms = td_value_int(500), *v;
    int64_t made, destroyed;

    /* (1) a fork sent before the owner confirmed the creation: worker2 fetches the value */
    td_rref *r;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &r));
    td_rref *g;
    MP_CHECK_OK(td_rref_remote(r, "counter_get", NULL, 0, NULL, &g));
    MP_CHECK(!td_rref_confirmed_by_owner(g));
    td_value *gv = td_value_rref(g);
    /* as in PyTorch, worker2's function starts only once the owner confirmed its fork (the owner
     * accepts forks 200 ms late here) */
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "ready_at_entry", &gv, 1, NULL, &v));
    MP_CHECK(td_value_equal(td_value_list_get(v, 0), td_value_bool(true)));
    td_value_unref(v);
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "here", &gv, 1, NULL, &v)); /* fork of a pending RRef */
    MP_CHECK(as_int(v) == 0);
    td_value_unref(v);
    td_value_unref(gv);
    td_rref_unref(g);

    /* (1b) on the owner, a function given an RRef whose value is still being made (500 ms)
     * starts once it exists */
    td_rref *slow;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &slow));
    td_value *sv = td_value_rref(slow);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "ready_at_entry", &sv, 1, NULL, &v));
    MP_CHECK(td_value_equal(td_value_list_get(v, 0), td_value_bool(true)));
    MP_CHECK(td_value_equal(td_value_list_get(v, 1), td_value_bool(true)));
    td_value_unref(v);
    td_value_unref(sv);
    td_rref_unref(slow);
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed == 1), 5);
    MP_CHECK(made == 2 && destroyed == 1);

    /* (2) the parent releases its RRef before its child's fork was accepted */
    td_value *rv = td_value_rref(r);
    td_future *f;
    MP_CHECK_OK(td_rpc_async(a, "worker2", "keep", &rv, 1, NULL, &f));
    td_value_unref(rv);
    td_rref_unref(r); /* worker0 holds nothing now; the hold on the fork keeps the value */
    MP_CHECK_OK(td_future_wait(f, td_test_ms(10000)));
    td_future_unref(f);
    counter_stats(a, "worker1", &made, &destroyed);
    MP_CHECK(made == 2 && destroyed == 1);
    /* worker2 still reaches the object; its fork is confirmed by the owner */
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "table", NULL, 0, NULL, &v));
    MP_CHECK(as_int(td_value_list_get(v, 1)) == 1);
    td_value_unref(v);
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "drop_all", NULL, 0, NULL, &v));
    td_value_unref(v);
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed != 1), 5);
    MP_CHECK(destroyed == 2);

    /* (3) an RRef sent to its own owner becomes a local handle there */
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", &zero, 1, NULL, &r));
    rv = td_value_rref(r);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "keep", &rv, 1, NULL, &v));
    MP_CHECK(td_value_list_get(v, 1) && td_value_equal(td_value_list_get(v, 1), td_value_bool(true)));
    td_value_unref(v);
    td_value_unref(rv);
    td_rref_unref(r);
    td_test_sleep_ms(td_test_ms(100));
    counter_stats(a, "worker1", &made, &destroyed);
    MP_CHECK(made == 3 && destroyed == 2); /* the owner's handle keeps it */
    /* the owner's table shows one handle and no fork once things settle */
    TD_TEST_POLL(owned_on(a, "worker1") == 1, 5);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "drop_all", NULL, 0, NULL, &v));
    td_value_unref(v);
    /* worker0's delete follows the (late) fork ack */
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed == 3), 5);
    MP_CHECK(destroyed == 3);

    /* (4) an RRef forwarded by a user to a third worker fire-and-forget, released everywhere at
     * once; and a confirmed fork seen in the debug table */
    MP_CHECK_OK(td_remote(a, "worker2", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &r));
    rv = td_value_rref(r);
    td_value *to = td_value_string("worker1");
    for (int i = 0; i < 20; i++) {
      MP_CHECK_OK(td_rpc_async(a, "worker1", "forward", (td_value *[]){rv, to}, 2, NULL, &f));
      td_future_unref(f);
    }
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "keep", &rv, 1, NULL, &v));
    td_value_unref(v);
    td_value_unref(to);
    td_value_unref(rv);
    td_value *t;
    MP_CHECK_OK(td_rref_debug_table(a, &t));
    td_value *users = td_value_dict_get(t, "users");
    MP_CHECK(td_value_list_len(users) == 1);
    td_value_unref(t);
    td_rref_unref(r);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "drop_all", NULL, 0, NULL, &v));
    td_value_unref(v);
    TD_TEST_POLL((counter_stats(a, "worker2", &made, &destroyed), destroyed == 1), 5);
    MP_CHECK(made == 1 && destroyed == 1);

    /* (4) as (1) and (1b), for functions started by remote() (PyTorch's
     * test_user_rrefs_confirmed_remote): on the owner, given an RRef whose value is still being
     * made (500 ms), it starts once the value exists; on another worker, given a fork the owner
     * accepts 200 ms late, once the owner confirmed it */
    td_rref *late, *fork, *res;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &late));
    td_value *lv = td_value_rref(late);
    MP_CHECK_OK(td_remote(a, "worker1", "ready_at_entry", &lv, 1, NULL, &res));
    MP_CHECK_OK(td_rref_to_here(res, td_test_ms(10000), &v));
    MP_CHECK(td_value_equal(td_value_list_get(v, 0), td_value_bool(true)));
    MP_CHECK(td_value_equal(td_value_list_get(v, 1), td_value_bool(true)));
    td_value_unref(v);
    td_rref_unref(res);
    MP_CHECK_OK(td_rref_remote(late, "counter_get", NULL, 0, NULL, &fork));
    td_value *fv = td_value_rref(fork);
    MP_CHECK_OK(td_remote(a, "worker2", "ready_at_entry", &fv, 1, NULL, &res));
    MP_CHECK_OK(td_rref_to_here(res, td_test_ms(10000), &v));
    MP_CHECK(td_value_equal(td_value_list_get(v, 0), td_value_bool(true)));
    td_value_unref(v);
    td_rref_unref(res);
    td_value_unref(fv);
    td_rref_unref(fork);
    td_value_unref(lv);
    td_rref_unref(late);
    TD_TEST_POLL((counter_stats(a, "worker1", &made, &destroyed), destroyed == made), 5);
    td_value_unref(zero);
    td_value_unref(ms);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  MP_CHECK(__atomic_load_n(&rt_counters_made, __ATOMIC_ACQUIRE) ==
           __atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE));
  finish(a);
  return 0;
}

static void test_rref_fork_orderings(void **state) { TD_MP_RUN(3, worker_forks, NULL, 120); }

/* ---- chain A -> B -> C -> owner ---- */

static int worker_chain(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    /* owner worker3; A = worker0 (creator), B = worker1, C = worker2, then back to the owner;
     * the creation is still running while the RRef travels */
    td_value *zero = td_value_int(0), *ms = td_value_int(300), *v;
    td_rref *r;
    MP_CHECK_OK(td_remote(a, "worker3", "make_counter", (td_value *[]){zero, ms}, 2, NULL, &r));
    td_value *rv = td_value_rref(r);
    td_value *path = td_value_list();
    td_value_list_append(path, td_value_string("worker2"));
    td_value_list_append(path, td_value_string("worker3"));
    td_future *f;
    MP_CHECK_OK(td_rpc_async(a, "worker1", "pass_on", (td_value *[]){rv, path}, 2, NULL, &f));
    td_value_unref(rv);
    td_value_unref(path);
    td_rref_unref(r); /* A lets go at once */
    MP_CHECK_OK(td_future_wait(f, td_test_ms(20000)));
    MP_CHECK(td_value_equal(td_future_value(f), td_value_bool(true))); /* owner got a handle */
    td_future_unref(f);
    int64_t made = 0, destroyed;
    /* the creation may still be running */
    TD_TEST_POLL((counter_stats(a, "worker3", &made, &destroyed), made != 0), 5);
    MP_CHECK(made == 1 && destroyed == 0);
    /* every holder fetches through its own fork */
    for (int w = 1; w <= 2; w++) {
      char name[16];
      snprintf(name, sizeof name, "worker%d", w);
      MP_CHECK_OK(td_rpc_sync(a, name, "table", NULL, 0, NULL, &v));
      MP_CHECK(as_int(td_value_list_get(v, 1)) == 1);
      td_value_unref(v);
    }
    /* B and C release first, then the owner's handle: freed after the last one */
    for (int w = 1; w <= 3; w++) {
      char name[16];
      snprintf(name, sizeof name, "worker%d", w);
      MP_CHECK_OK(td_rpc_sync(a, name, "drop_all", NULL, 0, NULL, &v));
      td_value_unref(v);
    }
    TD_TEST_POLL((counter_stats(a, "worker3", &made, &destroyed), destroyed), 5);
    MP_CHECK(made == 1 && destroyed == 1);
    td_value_unref(zero);
    td_value_unref(ms);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  finish(a);
  return 0;
}

static void test_rref_fork_chain_to_owner(void **state) { TD_MP_RUN(4, worker_chain, NULL, 120); }

/* ---- a fork whose owner dies before it could confirm it ---- */

static atomic_int fork_owner_let_go; /* rank 2: set by let_go (a handler thread) */

static void *die_later(void *arg) {
  (void)arg;
  td_test_sleep_ms(300);
  _exit(0); /* as a crash would: no shutdown, the connections just close */
}

/* die_soon(): this process ends 300 ms from now */
static td_status fn_die_soon(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  pthread_t t;
  if (pthread_create(&t, NULL, die_later, NULL) != 0)
    return td_set_error(TD_ERR_INTERNAL, "die_soon: no thread");
  pthread_detach(t);
  *res = td_value_none();
  return TD_OK;
}

static td_status fn_let_go(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  atomic_store(&fork_owner_let_go, 1);
  *res = td_value_none();
  return TD_OK;
}

/* worker0 forks an RRef owned by worker1 to worker2 while worker1 accepts forks 1.5 s late, and
 * worker1 dies meanwhile: the owner never confirms worker2's copy. worker0's fork notice fails,
 * so worker0 tells worker2, whose function (gated on the confirmation) then runs and fails
 * naming the owner, instead of waiting forever (which hung a pipeline whose first stage died). */
static int worker_fork_owner_dies(int rank, int world, const char *method, void *arg) {
  if (rank == 1) setenv("TD_RREF_TEST_FORK_DELAY_MS", "1500", 1);
  MP_CHECK_OK(td_rpc_register("die_soon", fn_die_soon, NULL));
  MP_CHECK_OK(td_rpc_register("let_go", fn_let_go, NULL));
  rt_register_all();
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_value *x = td_value_int(1), *y = td_value_int(2), *v = NULL;
    td_rref *r;
    MP_CHECK_OK(td_remote(a, "worker1", "add", (td_value *[]){x, y}, 2, NULL, &r));
    td_value_unref(x);
    td_value_unref(y);
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v)); /* created and confirmed */
    MP_CHECK(as_int(v) == 3);
    td_value_unref(v);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "die_soon", NULL, 0, NULL, &v));
    td_value_unref(v);
    td_value *rv = td_value_rref(r);
    td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
    co.timeout_ms = td_test_ms(15000);
    double t0 = td_test_now_s();
    td_status st = td_rpc_sync(a, "worker2", "here", &rv, 1, &co, &v);
    double took = td_test_now_s() - t0;
    fprintf(stderr, "worker2's call ended after %.2f s: %s: %s\n", took, td_status_name(st),
            td_last_error());
    MP_CHECK(st != TD_OK && st != TD_ERR_TIMEOUT);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    MP_CHECK(strstr(td_last_error(), "never confirmed") != NULL);
    MP_CHECK(took < td_test_s(10.0));
    td_value_unref(rv);
    td_rref_unref(r);
    /* worker2 ends as soon as it is let go, possibly before its reply leaves, so the reply may
     * be lost; a call that never reached it leaves worker2 waiting, and failing */
    v = NULL;
    st = td_rpc_sync(a, "worker2", "let_go", NULL, 0, NULL, &v);
    MP_CHECK(st == TD_OK || st == TD_ERR_UNAVAILABLE);
    td_value_unref(v);
  } else if (rank == 1) {
    td_test_sleep_ms(td_test_ms(30000)); /* ended by die_soon */
    _exit(1);
  } else {
    TD_TEST_POLL(atomic_load(&fork_owner_let_go), 30);
    MP_CHECK(atomic_load(&fork_owner_let_go));
  }
  MP_CHECK_OK(td_rpc_shutdown(a, false, 0)); /* worker1 is gone: no graceful barrier */
  td_rpc_destroy(a);
  return 0;
}

static void test_rref_fork_owner_dies_before_confirming(void **state) {
  TD_MP_RUN(3, worker_fork_owner_dies, NULL, 60);
}

/* ---- 1000 RRefs created, forked and released concurrently by 3 workers ---- */

static int worker_stress(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  unsigned seed = 1234u + (unsigned)rank * 77u;
  int n = rank == 0 ? 334 : 333; /* 1000 in all */
  td_future **fs = calloc((size_t)n * 2, sizeof *fs);
  int nf = 0;
  char me[16], other[16], third[16];
  snprintf(me, sizeof me, "worker%d", rank);
  for (int i = 0; i < n; i++) {
    int owner = (int)(rand_r(&seed) % 3);
    int o1 = (int)(rand_r(&seed) % 3), o2 = (int)(rand_r(&seed) % 3);
    char oname[16];
    snprintf(oname, sizeof oname, "worker%d", owner);
    snprintf(other, sizeof other, "worker%d", o1);
    snprintf(third, sizeof third, "worker%d", o2);
    td_value *x = td_value_int(i), *ms = td_value_int(i % 7 == 0 ? 2 : 0);
    td_rref *r;
    if (i % 5 == 0) {
      MP_CHECK_OK(td_remote(a, oname, "make_counter", (td_value *[]){x, ms}, 2, NULL, &r));
    } else {
      MP_CHECK_OK(td_remote(a, oname, "add", (td_value *[]){x, x}, 2, NULL, &r));
    }
    td_value *rv = td_value_rref(r);
    td_value *to = td_value_string(third);
    /* fork to `other`, which forwards a fork to `third` and drops its own */
    MP_CHECK_OK(td_rpc_async(a, other, "forward", (td_value *[]){rv, to}, 2, NULL, &fs[nf++]));
    if (i % 3 == 0) /* and sometimes a fetch through a fork, or a proxy */
      MP_CHECK_OK(i % 5 == 0 ? td_rref_rpc_async(r, "counter_get", NULL, 0, NULL, &fs[nf++])
                             : td_rpc_async(a, third, "here", &rv, 1, NULL, &fs[nf++]));
    td_value_unref(to);
    td_value_unref(rv);
    td_value_unref(x);
    td_value_unref(ms);
    td_rref_unref(r); /* released right away, often before any fork was accepted */
  }
  MP_CHECK_OK(td_future_wait_all(fs, nf, td_test_ms(60000)));
  for (int i = 0; i < nf; i++) td_future_unref(fs[i]);
  free(fs);
  rt_barrier(a, 1); /* everybody's work is done and every RRef released */
  rt_wait_empty(a);
  MP_CHECK(__atomic_load_n(&rt_counters_made, __ATOMIC_ACQUIRE) ==
           __atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE));
  rt_barrier(a, 2);
  finish(a);
  return 0;
}

static void test_rref_stress_1000_concurrent(void **state) {
  TD_MP_RUN(3, worker_stress, NULL, 240);
}

/* ---- strict mode turns leaks into shutdown errors ---- */

static int worker_leak(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  td_rref *r = NULL;
  if (rank == 0) {
    td_value *x = td_value_int(1);
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", &x, 1, NULL, &r));
    td_value_unref(x);
    td_value *v;
    MP_CHECK_OK(td_rref_rpc_sync(r, "counter_get", NULL, 0, NULL, &v));
    td_value_unref(v);
  }
  rt_barrier(a, 1);
  td_status st = td_rpc_shutdown(a, true, td_test_ms(30000));
  MP_CHECK(st == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "leaked") != NULL);
  MP_CHECK(strstr(td_last_error(), rank == 0 ? "user 0:" : "owned 0:") != NULL);
  if (rank == 1) /* released at shutdown */
    MP_CHECK(__atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE) == 1);
  /* releasing after shutdown is safe (nothing is sent) */
  td_rref_unref(r);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rref_strict_mode_reports_leaks(void **state) {
  TD_MP_RUN(2, worker_leak, NULL, 90);
}

/* ---- dispatch: remote() and proxies run TD_RPC_INLINE functions on the owner's network
 * thread and others on its pool; user callbacks on a creation future or on to_here_async's
 * result never run on the network thread ---- */

typedef struct cb_probe {
  td_rpc_agent *a;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  td_status st;
  int64_t sum;
} cb_probe;

/* Blocks on an RPC inside the callback: on the network thread this could never complete. */
static void creation_cb(td_future *f, void *arg) {
  cb_probe *p = arg;
  td_value *x = td_value_int(20), *y = td_value_int(22), *xs[2] = {x, y}, *v = NULL;
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = td_test_ms(10000);
  td_status st = td_rpc_sync(p->a, "worker1", "add", xs, 2, &o, &v);
  int64_t sum = -1;
  if (st == TD_OK) td_value_as_int(v, &sum);
  td_value_unref(v);
  td_value_unref(x);
  td_value_unref(y);
  pthread_mutex_lock(&p->mu);
  p->st = st;
  p->sum = sum;
  p->done = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

static int worker_dispatch(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_rref *r;
    td_value *v;
    MP_CHECK_OK(td_remote(a, "worker1", "probe_inline", NULL, 0, NULL, &r));
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == TD_ERR_STATE); /* ran on the network thread: blocking refused */
    td_value_unref(v);
    td_rref_unref(r);
    MP_CHECK_OK(td_remote(a, "worker1", "probe_pool", NULL, 0, NULL, &r));
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == TD_OK); /* ran on the pool: the nested call went through */
    td_value_unref(v);
    td_rref_unref(r);

    /* proxies: the owner's object first, same dispatch rule */
    td_value *start0 = td_value_int(0);
    td_rref *k;
    MP_CHECK_OK(td_remote(a, "worker1", "make_counter", &start0, 1, NULL, &k));
    td_value_unref(start0);
    /* (a call on an object still being created runs on the pool once it exists) */
    td_future *kf;
    MP_CHECK_OK(td_rref_creation_future(k, &kf));
    MP_CHECK_OK(td_future_wait(kf, td_test_ms(10000)));
    td_future_unref(kf);
    MP_CHECK_OK(td_rref_rpc_sync(k, "probe_inline", NULL, 0, NULL, &v));
    MP_CHECK(as_int(v) == TD_ERR_STATE);
    td_value_unref(v);
    MP_CHECK_OK(td_rref_rpc_sync(k, "probe_pool", NULL, 0, NULL, &v));
    MP_CHECK(as_int(v) == TD_OK);
    td_value_unref(v);
    td_rref_unref(k);

    /* a callback registered on the creation future before the owner answers blocks on an RPC */
    cb_probe p = {.a = a, .done = 0};
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    td_value *ms = td_value_int(300);
    MP_CHECK_OK(td_remote(a, "worker1", "slow", &ms, 1, NULL, &r));
    td_value_unref(ms);
    td_future *cf;
    MP_CHECK_OK(td_rref_creation_future(r, &cf));
    MP_CHECK(!td_future_done(cf));
    MP_CHECK_OK(td_future_on_done(cf, creation_cb, &p));
    pthread_mutex_lock(&p.mu);
    while (!p.done) pthread_cond_wait(&p.cv, &p.mu);
    pthread_mutex_unlock(&p.mu);
    MP_CHECK_OK(p.st);
    MP_CHECK(p.sum == 42);
    MP_CHECK_OK(td_rref_to_here(r, td_test_ms(10000), &v));
    MP_CHECK(as_int(v) == 300);
    td_value_unref(v);
    td_future_unref(cf);
    td_rref_unref(r);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);

    /* the same on to_here_async's result: its light step runs where the reply is decoded, but a
     * callback of the user's on the result still runs on the pool (it blocks on an RPC) */
    cb_probe q = {.a = a, .done = 0};
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    ms = td_value_int(300);
    MP_CHECK_OK(td_remote(a, "worker1", "slow", &ms, 1, NULL, &r));
    td_value_unref(ms);
    td_future *hf;
    MP_CHECK_OK(td_rref_to_here_async(r, td_test_ms(10000), &hf));
    MP_CHECK(!td_future_done(hf));
    MP_CHECK_OK(td_future_on_done(hf, creation_cb, &q));
    pthread_mutex_lock(&q.mu);
    while (!q.done) pthread_cond_wait(&q.cv, &q.mu);
    pthread_mutex_unlock(&q.mu);
    MP_CHECK_OK(q.st);
    MP_CHECK(q.sum == 42);
    MP_CHECK_OK(td_future_wait(hf, td_test_ms(10000)));
    MP_CHECK(as_int(td_future_value(hf)) == 300);
    td_future_unref(hf);
    td_rref_unref(r);
    pthread_mutex_destroy(&q.mu);
    pthread_cond_destroy(&q.cv);
  }
  rt_barrier(a, 1);
  rt_wait_empty(a);
  finish(a);
  return 0;
}

static void test_rref_dispatch_inline_pool_and_callbacks(void **state) {
  TD_MP_RUN(2, worker_dispatch, NULL, 90);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rref_remote_to_here),
      cmocka_unit_test(test_rref_creation_errors_and_timeouts),
      cmocka_unit_test(test_rref_proxies_on_objects),
      cmocka_unit_test(test_rref_fork_orderings),
      cmocka_unit_test(test_rref_fork_chain_to_owner),
      cmocka_unit_test(test_rref_fork_owner_dies_before_confirming),
      cmocka_unit_test(test_rref_stress_1000_concurrent),
      cmocka_unit_test(test_rref_strict_mode_reports_leaks),
      cmocka_unit_test(test_rref_dispatch_inline_pool_and_callbacks),
  };
  return cmocka_run_group_tests_name("rref", tests, NULL, NULL);
}
