/* test_store.c - the rendezvous store's delete (rpc/store.c): the server's table through its
 * request handler (the "network" is a direct call), then the client over a one-worker agent.
 * A delete says whether the key existed and leaves it absent as if never set; set/delete cycles
 * keep the table at the size of the keys alive, every lookup right, and each delete's work to a
 * few entries (no rebuild); waiters on a deleted key wait for it to be set again. Range reads
 * (op 7) give consecutive keys' values within their limits, a repeated one comes from the range
 * remembered until a key under its prefix changes, and a group's rendezvous reads every
 * worker's records in a few of them. The store protocol played by 32 and 256 simulated workers
 * (rpc/store_sim.h) costs each worker the same number of requests outside its waits, and bytes
 * that grow with the group only by the table's small records. A publish (op 9) sets a worker's
 * records and counts it in one request, whole or not at all; a ranges request (op 10) reads
 * several prefixes' records at once. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/core.h"
#include "mp_util.h"
#include "rpc/agent_impl.h"
#include "rpc/agent_state.h"
#include "rpc/store.h"
#include "rpc/store_sim.h"
#include "tdist.pb-c.h"
#include "tdist/rpc.h"
#include "test_util.h"

/* One request to the server: *found and the value (val: NUL-terminated, at most 63 bytes) as the
 * reply says. */
static void req(td__store *s, uint32_t op, const char *key, const char *value, bool *found,
                   char *val) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = op;
  r.key = (char *)key;
  if (value) {
    r.value.data = (uint8_t *)value;
    r.value.len = strlen(value);
  }
  uint8_t buf[1024], *rep = NULL;
  size_t n = tdist__store_request__pack(&r, buf), rl = 0;
  TD_ASSERT_OK(td__store_handle(s, buf, n, &rep, &rl));
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
  assert_non_null(p);
  if (found) *found = p->found;
  if (val) {
    assert_true(p->value.len < 64);
    memcpy(val, p->value.data, p->value.len);
    val[p->value.len] = 0;
  }
  tdist__store_reply__free_unpacked(p, NULL);
  td__free(rep);
}

enum { SET = 1, GET = 2, ADD = 3, CHECK = 4, DEL = 5 };

/* Adds delta to the counter at key on the server; returns the new value. */
static int64_t add(td__store *s, const char *key, int64_t delta) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = ADD;
  r.key = (char *)key;
  r.delta = delta;
  uint8_t buf[1024], *rep = NULL;
  size_t rl = 0;
  TD_ASSERT_OK(td__store_handle(s, buf, tdist__store_request__pack(&r, buf), &rep, &rl));
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
  assert_non_null(p);
  int64_t num = p->number;
  tdist__store_reply__free_unpacked(p, NULL);
  td__free(rep);
  return num;
}

static void test_store_delete_reports_whether_key_existed(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  bool found;
  char v[64];
  req(s, SET, "a", "1", NULL, NULL);
  req(s, SET, "b", "22", NULL, NULL);
  req(s, DEL, "a", NULL, &found, NULL);
  assert_true(found);
  req(s, GET, "a", NULL, &found, NULL);
  assert_false(found);
  req(s, CHECK, "a", NULL, &found, NULL);
  assert_false(found);
  req(s, DEL, "a", NULL, &found, NULL); /* already gone */
  assert_false(found);
  req(s, DEL, "never", NULL, &found, NULL);
  assert_false(found);
  req(s, GET, "b", NULL, &found, v);
  assert_true(found);
  assert_string_equal(v, "22");
  /* a deleted counter starts again from 0 */
  assert_int_equal(add(s, "c", 5), 5);
  req(s, DEL, "c", NULL, &found, NULL);
  assert_true(found);
  assert_int_equal(add(s, "c", 1), 1);
  req(s, DEL, "c", NULL, NULL, NULL);
  req(s, DEL, "b", NULL, &found, NULL);
  assert_true(found);
  td__store_stats st;
  td__store_stats_get(s, &st);
  assert_int_equal(st.keys, 0);
  assert_int_equal(st.bytes, 0); /* keys and values all given back */
  td__store_destroy(s);
}

#define LIVE 1000
#define CYCLES 50000

static void key_of(char *k, size_t n, int i) { snprintf(k, n, "key/%d", i); }

/* A window of LIVE keys slides over CYCLES keys (set key i, delete key i - LIVE), so the keys
 * alive sit in probe runs that deleted keys crossed: every delete finds its key, the table keeps
 * its size, every live key keeps its value, deleted keys stay gone, and the deletes together
 * move a few entries each (a rebuild per delete would move all LIVE of them every time). */
static void test_store_set_delete_cycles_stay_bounded(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  char k[32], v[64], want[32];
  bool found;
  td__store_stats before, after;
  for (int i = 0; i < CYCLES; i++) {
    if (i == LIVE) td__store_stats_get(s, &before);
    key_of(k, sizeof k, i);
    snprintf(want, sizeof want, "v%d", i);
    req(s, SET, k, want, NULL, NULL);
    if (i < LIVE) continue;
    key_of(k, sizeof k, i - LIVE);
    req(s, DEL, k, NULL, &found, NULL);
    assert_true(found);
  }
  td__store_stats_get(s, &after);
  assert_int_equal(after.keys, LIVE);
  assert_int_equal(after.slots, before.slots);
  assert_true(after.moves - before.moves <= 4u * (CYCLES - LIVE));
  for (int i = CYCLES - LIVE; i < CYCLES; i++) {
    key_of(k, sizeof k, i);
    snprintf(want, sizeof want, "v%d", i);
    req(s, GET, k, NULL, &found, v);
    assert_true(found);
    assert_string_equal(v, want);
  }
  for (int i = 0; i < CYCLES - LIVE; i += 97) {
    key_of(k, sizeof k, i);
    req(s, GET, k, NULL, &found, NULL);
    assert_false(found);
  }
  td__store_destroy(s);
}

typedef struct waiter {
  const td__store_client *c;
  td_status st;
  char value[64];
} waiter;

static void *wait_for_w(void *arg) {
  waiter *w = arg;
  uint8_t *v = NULL;
  size_t n = 0;
  w->st = td__store_wait_key(w->c, "w", td__now_ns() + (uint64_t)td_test_ms(10000) * 1000000u,
                             NULL, &v, &n);
  if (w->st == TD_OK) snprintf(w->value, sizeof w->value, "%s", (const char *)v);
  td__free(v);
  return NULL;
}

/* A one-worker agent: its store client talks to its own server over loopback. */
static td_rpc_agent *solo_agent(void) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:0";
  td_rpc_agent *a;
  TD_ASSERT_OK(td_rpc_init("solo", 0, 1, &o, &a));
  return a;
}

/* Through the client: delete says whether the key existed; a wait on a deleted key does not see
 * its old value: it times out, or returns the value set after the delete. */
static void test_store_client_delete_and_waiters(void **state) {
  (void)state;
  td_rpc_agent *a = solo_agent();
  const td__store_client *c = td__agent_store(a);
  bool existed = true, found = true;
  TD_ASSERT_OK(td__store_delete(c, "w", &existed));
  assert_false(existed);
  TD_ASSERT_OK(td__store_set(c, "w", "old", 3));
  TD_ASSERT_OK(td__store_delete(c, "w", &existed));
  assert_true(existed);
  TD_ASSERT_OK(td__store_get(c, "w", NULL, NULL, &found));
  assert_false(found);
  /* a window that must expire: not scaled */
  uint8_t *v = NULL;
  size_t n;
  assert_int_equal(td__store_wait_key(c, "w", td__now_ns() + 100000000u, NULL, &v, &n),
                   TD_ERR_TIMEOUT);
  waiter w = {.c = c};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, wait_for_w, &w), 0);
  TD_ASSERT_OK(td__store_set(c, "w", "new", 3));
  pthread_join(th, NULL);
  TD_ASSERT_OK(w.st);
  assert_string_equal(w.value, "new");
  /* a counter waited on after its delete counts again from 0 */
  int64_t cur;
  TD_ASSERT_OK(td__store_add(c, "n", 5, &cur));
  TD_ASSERT_OK(td__store_delete(c, "n", NULL));
  assert_int_equal(td__store_wait_ge(c, "n", 1, td__now_ns() + 100000000u, NULL),
                   TD_ERR_TIMEOUT);
  TD_ASSERT_OK(td__store_add(c, "n", 1, &cur));
  assert_int_equal(cur, 1);
  TD_ASSERT_OK(td_rpc_shutdown(a, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(a);
}

/* One range request to the server: the reply (free with tdist__store_reply__free_unpacked). */
static Tdist__StoreReply *range(td__store *s, const char *prefix, int first, int count,
                                const char *watch) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 7;
  r.key = (char *)prefix;
  r.first = first;
  r.count = count;
  r.watch_key = (char *)(watch ? watch : "");
  uint8_t buf[1024], *rep = NULL;
  size_t rl = 0;
  TD_ASSERT_OK(td__store_handle(s, buf, tdist__store_request__pack(&r, buf), &rep, &rl));
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
  td__free(rep);
  assert_non_null(p);
  return p;
}

static void assert_value(const Tdist__StoreReply *p, size_t i, const char *want) {
  assert_true(i < p->n_values);
  assert_int_equal(p->values[i].len, strlen(want));
  assert_memory_equal(p->values[i].data, want, strlen(want));
}

/* A range gives the values of prefix+first, prefix+first+1, ... while they exist, in order; the
 * first missing key ends it; the watched key comes with it. */
static void test_store_range_reads_consecutive_keys(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  char k[32], v[32];
  for (int i = 0; i < 10; i++) {
    if (i == 5) continue;
    snprintf(k, sizeof k, "p/%d", i);
    snprintf(v, sizeof v, "v%d", i * 11);
    req(s, SET, k, v, NULL, NULL);
  }
  req(s, SET, "p/x", "not a rank", NULL, NULL);
  Tdist__StoreReply *p = range(s, "p/", 0, 10, NULL);
  assert_int_equal(p->n_values, 5);
  assert_int_equal(p->number, 5);
  assert_false(p->found); /* not all ten */
  assert_false(p->watched);
  for (int i = 0; i < 5; i++) {
    snprintf(v, sizeof v, "v%d", i * 11);
    assert_value(p, (size_t)i, v);
  }
  tdist__store_reply__free_unpacked(p, NULL);
  p = range(s, "p/", 6, 4, "p/x");
  assert_int_equal(p->n_values, 4);
  assert_true(p->found);
  assert_value(p, 3, "v99");
  assert_true(p->watched);
  assert_int_equal(p->watch_value.len, 10);
  tdist__store_reply__free_unpacked(p, NULL);
  p = range(s, "p/", 5, 3, "nothing");
  assert_int_equal(p->n_values, 0);
  assert_false(p->watched);
  tdist__store_reply__free_unpacked(p, NULL);
  p = range(s, "q/", 0, 3, NULL);
  assert_int_equal(p->n_values, 0);
  tdist__store_reply__free_unpacked(p, NULL);
  /* a bad range is refused */
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 7;
  r.key = (char *)"p/";
  r.first = -1;
  r.count = 2;
  uint8_t buf[256], *rep = NULL;
  size_t rl = 0;
  assert_int_equal(td__store_handle(s, buf, tdist__store_request__pack(&r, buf), &rep, &rl),
                   TD_ERR_INVALID);
  td__store_destroy(s);
}

/* One reply holds at most TD__STORE_RANGE_MAX values and, past its first, TD__STORE_RANGE_BYTES
 * bytes of them (a value alone larger than that still comes, by itself). */
static void test_store_range_reply_is_bounded(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  char k[32];
  for (int i = 0; i < TD__STORE_RANGE_MAX + 10; i++) {
    snprintf(k, sizeof k, "n/%d", i);
    req(s, SET, k, "1", NULL, NULL);
  }
  Tdist__StoreReply *p = range(s, "n/", 0, TD__STORE_RANGE_MAX + 10, NULL);
  assert_int_equal(p->n_values, TD__STORE_RANGE_MAX);
  tdist__store_reply__free_unpacked(p, NULL);
  size_t big = TD__STORE_RANGE_BYTES / 2 + 1, huge = TD__STORE_RANGE_BYTES + 5;
  char *b = malloc(huge + 1);
  assert_non_null(b);
  memset(b, 'x', huge);
  b[huge] = 0;
  TD_ASSERT_OK(td__store_local_set(s, "b/0", b, huge));
  TD_ASSERT_OK(td__store_local_set(s, "b/1", b, big));
  TD_ASSERT_OK(td__store_local_set(s, "b/2", b, big));
  p = range(s, "b/", 0, 3, NULL);
  assert_int_equal(p->n_values, 1); /* the huge one alone */
  assert_int_equal(p->values[0].len, huge);
  tdist__store_reply__free_unpacked(p, NULL);
  p = range(s, "b/", 1, 2, NULL);
  assert_int_equal(p->n_values, 1); /* two halves and a byte are past the budget */
  tdist__store_reply__free_unpacked(p, NULL);
  free(b);
  td__store_destroy(s);
}

/* The values of range(prefix, first, count) are want[0..n-1]. */
static void assert_range(td__store *s, const char *prefix, int first, int count, int n,
                         const char *const *want) {
  Tdist__StoreReply *p = range(s, prefix, first, count, NULL);
  assert_int_equal(p->n_values, n);
  assert_int_equal(p->found, n == count);
  for (int i = 0; i < n; i++) assert_value(p, (size_t)i, want[i]);
  tdist__store_reply__free_unpacked(p, NULL);
}

static td__store_stats stats_of(td__store *s) {
  td__store_stats st;
  td__store_stats_get(s, &st);
  return st;
}

static uint64_t remembered(td__store *s) { return stats_of(s).ranges_remembered; }

/* A repeated range is served from the one gathered before (the N readers of a start-up table),
 * and every change under its prefix (set, add, delete, a new key) is seen by the next read. */
static void test_store_range_remembered_until_a_key_changes(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  req(s, SET, "r/0", "a", NULL, NULL);
  req(s, SET, "r/1", "b", NULL, NULL);
  req(s, SET, "r/2", "c", NULL, NULL);
  assert_range(s, "r/", 0, 4, 3, (const char *[]){"a", "b", "c"});
  assert_int_equal(remembered(s), 0);
  assert_range(s, "r/", 0, 4, 3, (const char *[]){"a", "b", "c"});
  assert_int_equal(remembered(s), 1);
  req(s, SET, "other/0", "z", NULL, NULL); /* another prefix: still remembered */
  assert_range(s, "r/", 0, 4, 3, (const char *[]){"a", "b", "c"});
  assert_int_equal(remembered(s), 2);
  req(s, SET, "r/1", "B", NULL, NULL);
  assert_range(s, "r/", 0, 4, 3, (const char *[]){"a", "B", "c"});
  assert_int_equal(remembered(s), 2);
  req(s, SET, "r/3", "d", NULL, NULL); /* the missing key arrives: the range is complete */
  assert_range(s, "r/", 0, 4, 4, (const char *[]){"a", "B", "c", "d"});
  add(s, "r/2", 5);
  assert_range(s, "r/", 0, 4, 4, (const char *[]){"a", "B", "5", "d"});
  req(s, DEL, "r/1", NULL, NULL, NULL);
  assert_range(s, "r/", 0, 4, 1, (const char *[]){"a"});
  assert_range(s, "r/", 2, 2, 2, (const char *[]){"5", "d"}); /* another range, gathered */
  assert_int_equal(remembered(s), 2);
  /* more ranges than are remembered: each still right, old ones gathered again */
  char k[32], v[32];
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < 12; i++) {
      snprintf(k, sizeof k, "m%d/0", i);
      snprintf(v, sizeof v, "v%d.%d", i, round);
      if (round == 1 && i % 3 == 0) req(s, SET, k, v, NULL, NULL);
      else if (round == 0) req(s, SET, k, v, NULL, NULL);
      snprintf(k, sizeof k, "m%d/", i);
      snprintf(v, sizeof v, "v%d.%d", i, round == 1 && i % 3 == 0 ? 1 : 0);
      assert_range(s, k, 0, 1, 1, (const char *[]){v});
      assert_range(s, k, 0, 1, 1, (const char *[]){v});
    }
  td__store_destroy(s);
}

typedef struct setter {
  const td__store_client *c;
} setter;

static void *set_later(void *arg) {
  setter *t = arg;
  char k[32], v[32];
  for (int i = 0; i < 6; i++) {
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
    snprintf(k, sizeof k, "late/%d", i);
    snprintf(v, sizeof v, "value %d", i);
    td__store_set(t->c, k, v, strlen(v));
  }
  return NULL;
}

/* Through the client: a range wait returns once every key exists (set one by one meanwhile), a
 * timeout names the first missing key and leaves nothing allocated, an abort key ends it. */
static void test_store_client_wait_range(void **state) {
  (void)state;
  td_rpc_agent *a = solo_agent();
  const td__store_client *c = td__agent_store(a);
  setter t = {c};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, set_later, &t), 0);
  uint8_t *vals[6] = {0};
  size_t lens[6];
  uint64_t dl = td__now_ns() + (uint64_t)td_test_ms(10000) * 1000000u;
  TD_ASSERT_OK(td__store_wait_range(c, "late/", 0, 6, dl, NULL, vals, lens));
  pthread_join(th, NULL);
  for (int i = 0; i < 6; i++) {
    char want[32];
    snprintf(want, sizeof want, "value %d", i);
    assert_string_equal((char *)vals[i], want);
    assert_int_equal(lens[i], strlen(want));
    td__free(vals[i]);
    vals[i] = NULL;
  }
  assert_int_equal(td__store_wait_range(c, "late/", 4, 4, td__now_ns() + 50000000u, NULL, vals,
                                        lens), TD_ERR_TIMEOUT);
  assert_non_null(strstr(td_last_error(), "'late/6'"));
  for (int i = 0; i < 4; i++) assert_null(vals[i]);
  TD_ASSERT_OK(td__store_set(c, "stop", "gave up", 7));
  dl = td__now_ns() + (uint64_t)td_test_ms(10000) * 1000000u;
  assert_int_equal(td__store_wait_range(c, "late/", 4, 4, dl, "stop", vals, lens),
                   TD_ERR_REMOTE);
  assert_non_null(strstr(td_last_error(), "gave up"));
  TD_ASSERT_OK(td_rpc_shutdown(a, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(a);
}

enum { GROUP = 12 };

/* Rank 0 serves the store: after init, its counts say how the group read each other's records:
 * a handful of range requests per worker, and (nearly) no single gets; reading them key by key
 * took 5 gets per worker and peer (GROUP^2 * 5 = 720 here). */
static int worker_counts(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    /* (rank 0's init does not wait for the others' last reads: their "passed" says they are
     * done with the store) */
    MP_CHECK_OK(td__store_wait_ge(td__agent_store(a), "passed", world,
                                  td__now_ns() + (uint64_t)td_test_ms(30000) * 1000000u, NULL));
    td__store_stats st;
    td__store_stats_get(a->store, &st);
    fprintf(stderr, "store after init of %d workers: %llu requests, %llu gets found, %llu ranges "
            "with values\n", world, (unsigned long long)st.requests,
            (unsigned long long)st.gets_found, (unsigned long long)st.ranges_found);
    /* world_size, run_id, and the one registry text they all share (regblob/) */
    MP_CHECK(st.gets_found <= 4u * (unsigned)world);
    /* worker, registry, devmap, direct (and directok where workers probe each other at init;
     * with mailboxes pairs settle direct copy when they meet) */
    MP_CHECK(st.ranges_found >= 4u * (unsigned)world);
    MP_CHECK(st.ranges_found <= 10u * (unsigned)world);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rendezvous_reads_records_in_range_requests(void **state) {
  (void)state;
  TD_MP_RUN(GROUP, worker_counts, NULL, 60);
}

/* ---- parked waits (op 8) ---- */

static int parks;         /* tokens given: 1, 2, ... */
#define TOKENS 4096
static int answered[TOKENS]; /* per token: 0 not yet, 1 answered not over, 2 over, 3 aborted */
static int64_t answered_num[TOKENS];

static void *t_park(void *ud) {
  (void)ud;
  return (void *)(intptr_t)++parks;
}

static void t_answer(void *token, uint8_t *reply, size_t len) {
  int k = (int)(intptr_t)token;
  assert_true(k > 0 && k < TOKENS && answered[k] == 0);
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, len, reply);
  assert_non_null(p);
  answered[k] = p->watched ? 3 : p->found ? 2 : 1;
  answered_num[k] = p->number;
  tdist__store_reply__free_unpacked(p, NULL);
  td__free(reply);
}

/* A wait with a parker: parked (true) or answered at once (its found). */
static bool wait_req(td__store *s, const char *key, int64_t target, const char *watch, int ms,
                     bool *found) {
  static const td__store_parker pk = {t_park, t_answer, NULL};
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 8;
  r.key = (char *)key;
  r.delta = target;
  r.count = ms;
  r.watch_key = (char *)(watch ? watch : "");
  uint8_t buf[1024], *rep = NULL;
  size_t rl = 0;
  bool parked = false;
  TD_ASSERT_OK(td__store_handle_park(s, buf, tdist__store_request__pack(&r, buf), &rep, &rl, &pk,
                                     &parked));
  if (!parked) {
    Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
    assert_non_null(p);
    *found = p->found;
    tdist__store_reply__free_unpacked(p, NULL);
    td__free(rep);
  }
  return parked;
}

/* A wait that is not over is held, not answered, until the add that ends it (the same request),
 * the abort key, its time, or the server's end; one that is over is answered at once. */
static void test_store_parked_waits_answered_when_over(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  bool found = false;
  assert_true(wait_req(s, "count", 2, "abort", 1000, &found)); /* token 1 */
  assert_int_equal(add(s, "count", 1), 1);
  assert_int_equal(answered[1], 0); /* 1 < 2: still held */
  assert_int_equal(add(s, "count", 1), 2);
  assert_int_equal(answered[1], 2); /* over, answered by that add */
  assert_int_equal(answered_num[1], 2);
  assert_false(wait_req(s, "count", 2, NULL, 1000, &found)); /* over already: at once */
  assert_true(found);
  assert_true(wait_req(s, "key", 0, NULL, 30, &found)); /* token 2: until "key" exists */
  assert_true(wait_req(s, "other", 0, "abort", 1000, &found)); /* token 3 */
  assert_true(wait_req(s, "late", 0, NULL, 1000, &found));     /* token 4 */
  assert_int_equal(td__store_parked(s), 3);
  td__store_expire(s, td__now_ns() + 100000000ull); /* token 2's 30 ms have passed */
  assert_int_equal(answered[2], 1);
  assert_int_equal(td__store_parked(s), 2);
  req(s, SET, "abort", "gave up", NULL, NULL);
  assert_int_equal(answered[3], 3);
  td__store_unpark_all(s);
  assert_int_equal(answered[4], 1);
  assert_int_equal(td__store_parked(s), 0);
  td__store_destroy(s);
}

/* A change looks only at the waits about its key, and at those on a counter only once it
 * reaches their targets: with W workers waiting on one counter and W more on keys of their
 * own, the W - 1 adds before the last look at none (scanning every wait at every change made
 * the group's start-up O(W^2) at rank 0), the last answers the W; a key's set answers its one
 * wait; the abort key answers everybody who watches it. */
static void test_store_change_looks_only_at_its_waits(void **state) {
  (void)state;
  enum { W = 1000 };
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  int base = parks;
  bool found;
  char key[32];
  for (int i = 0; i < W; i++) assert_true(wait_req(s, "joined", W, "abort", 60000, &found));
  for (int i = 0; i < W; i++) {
    snprintf(key, sizeof key, "k/%d", i);
    assert_true(wait_req(s, key, 0, "abort", 60000, &found));
  }
  assert_int_equal(td__store_parked(s), 2 * W);
  for (int i = 0; i < W - 1; i++) add(s, "joined", 1);
  td__store_stats st;
  td__store_stats_get(s, &st);
  assert_int_equal(st.wait_checks, 0);
  for (int i = 1; i <= 2 * W; i++) assert_int_equal(answered[base + i], 0);
  add(s, "joined", 1);
  td__store_stats_get(s, &st);
  assert_int_equal(st.wait_checks, W);
  for (int i = 1; i <= W; i++) assert_int_equal(answered[base + i], 2);
  req(s, SET, "k/7", "x", NULL, NULL);
  td__store_stats_get(s, &st);
  assert_int_equal(st.wait_checks, W + 1);
  assert_int_equal(answered[base + W + 8], 2);
  assert_int_equal(td__store_parked(s), W - 1);
  req(s, SET, "abort", "gave up", NULL, NULL);
  td__store_stats_get(s, &st);
  assert_int_equal(st.wait_checks, 2 * W);
  for (int i = W + 1; i <= 2 * W; i++) assert_int_equal(answered[base + i], i == W + 8 ? 2 : 3);
  assert_int_equal(td__store_parked(s), 0);
  td__store_destroy(s);
}

/* ---- ranges (op 10): several prefixes' records in one request ---- */

/* One ranges request: the reply (free with tdist__store_reply__free_unpacked), NULL when
 * refused (its status in *st). */
static td_status ranges_call(td__store *s, size_t n, const char *const *prefixes, int count,
                             const char *watch, uint8_t **rep, size_t *len) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 10;
  r.key = (char *)"";
  r.count = count;
  r.n_keys = n;
  r.keys = (char **)prefixes;
  r.watch_key = (char *)(watch ? watch : "");
  uint8_t buf[1024];
  *rep = NULL;
  return td__store_handle(s, buf, tdist__store_request__pack(&r, buf), rep, len);
}

static Tdist__StoreReply *ranges_req(td__store *s, size_t n, const char *const *prefixes,
                                     int count, td_status *st) {
  uint8_t *rep = NULL;
  size_t rl = 0;
  *st = ranges_call(s, n, prefixes, count, NULL, &rep, &rl);
  if (*st != TD_OK) return NULL;
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
  td__free(rep);
  assert_non_null(p);
  return p;
}

/* A ranges request (op 10) with a watch key; the raw reply (td__malloc'd). */
static uint8_t *ranges_raw(td__store *s, size_t n, const char *const *prefixes, int count,
                           const char *watch, size_t *len) {
  uint8_t *rep = NULL;
  TD_ASSERT_OK(ranges_call(s, n, prefixes, count, watch, &rep, len));
  return rep;
}

static uint64_t packed_count(td__store *s) { return stats_of(s).ranges_packed; }

/* The same ranges request asked again, nothing under its prefixes changed: the reply kept packed,
 * byte for byte what a rebuild gives; a change under a prefix, or a set watch key (whose value
 * the reply carries), rebuilds it; a reply with a prefix that brought no values is not kept (a
 * key that then comes under it is seen). */
static void test_store_ranges_reply_kept_packed(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  req(s, SET, "a/0", "x", NULL, NULL);
  req(s, SET, "a/1", "y", NULL, NULL);
  req(s, SET, "b/0", "z", NULL, NULL);
  const char *ab[] = {"a/", "b/"};
  size_t l1, l2, l3;
  uint8_t *r1 = ranges_raw(s, 2, ab, 4, "abort", &l1);
  assert_int_equal(packed_count(s), 0);
  uint8_t *r2 = ranges_raw(s, 2, ab, 4, "abort", &l2);
  assert_int_equal(packed_count(s), 1);
  assert_int_equal(l1, l2);
  assert_memory_equal(r1, r2, l1);
  td__free(r2);
  r2 = ranges_raw(s, 2, ab, 3, "abort", &l2); /* another request: rebuilt */
  assert_int_equal(packed_count(s), 1);
  td__free(r2);
  r2 = ranges_raw(s, 2, ab, 4, "abort", &l2); /* kept for the last one only */
  assert_int_equal(packed_count(s), 1);
  td__free(r2);
  req(s, SET, "a/1", "Y", NULL, NULL);
  r2 = ranges_raw(s, 2, ab, 4, "abort", &l2);
  assert_int_equal(packed_count(s), 1);
  Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, l2, r2);
  assert_non_null(p);
  assert_int_equal(p->n_values, 3);
  assert_memory_equal(p->values[1].data, "Y", 1);
  tdist__store_reply__free_unpacked(p, NULL);
  uint8_t *r3 = ranges_raw(s, 2, ab, 4, "abort", &l3);
  assert_int_equal(packed_count(s), 2);
  assert_int_equal(l2, l3);
  assert_memory_equal(r2, r3, l2);
  td__free(r3);
  /* a prefix without values has no remembered range to say a key came under it: such a reply
   * is not kept */
  const char *ac[] = {"a/", "c/"};
  r3 = ranges_raw(s, 2, ac, 4, "abort", &l3);
  td__free(r3);
  r3 = ranges_raw(s, 2, ac, 4, "abort", &l3);
  assert_int_equal(packed_count(s), 2);
  td__free(r3);
  req(s, SET, "c/0", "w", NULL, NULL);
  r3 = ranges_raw(s, 2, ac, 4, "abort", &l3);
  p = tdist__store_reply__unpack(NULL, l3, r3);
  assert_non_null(p);
  assert_int_equal(p->n_values, 3);
  assert_memory_equal(p->values[2].data, "w", 1);
  tdist__store_reply__free_unpacked(p, NULL);
  td__free(r3);
  req(s, SET, "abort", "gave up", NULL, NULL);
  r3 = ranges_raw(s, 2, ab, 4, "abort", &l3);
  assert_int_equal(packed_count(s), 2);
  p = tdist__store_reply__unpack(NULL, l3, r3);
  assert_non_null(p);
  assert_true(p->watched);
  assert_memory_equal(p->watch_value.data, "gave up", 7);
  tdist__store_reply__free_unpacked(p, NULL);
  td__free(r1);
  td__free(r2);
  td__free(r3);
  td__store_destroy(s);
}

/* Each prefix's values as op 7 gives them, one prefix after another, with their counts; a
 * prefix after the first that would take the reply past the byte limit gets none (the client
 * asks for it alone); 0 or more than 8 prefixes are refused. */
static void test_store_ranges_read_several_prefixes_at_once(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  char key[32], val[32];
  for (int i = 0; i < 5; i++) {
    snprintf(key, sizeof key, "a/%d", i);
    snprintf(val, sizeof val, "a%d", i);
    req(s, SET, key, val, NULL, NULL);
  }
  for (int i = 0; i < 3; i++) {
    snprintf(key, sizeof key, "b/%d", i);
    snprintf(val, sizeof val, "b%d", i);
    req(s, SET, key, val, NULL, NULL);
  }
  td_status st;
  const char *abc[] = {"a/", "b/", "c/"};
  Tdist__StoreReply *p = ranges_req(s, 3, abc, 5, &st);
  TD_ASSERT_OK(st);
  assert_int_equal(p->n_counts, 3);
  assert_int_equal(p->counts[0], 5);
  assert_int_equal(p->counts[1], 3);
  assert_int_equal(p->counts[2], 0);
  assert_int_equal(p->n_values, 8);
  assert_value(p, 0, "a0");
  assert_value(p, 4, "a4");
  assert_value(p, 5, "b0");
  assert_value(p, 7, "b2");
  tdist__store_reply__free_unpacked(p, NULL);
  /* the byte limit: big/0, big/1 and mid/0 of 600 KB each */
  size_t bn = 600u << 10;
  char *big = malloc(bn + 1);
  assert_non_null(big);
  memset(big, 'x', bn);
  big[bn] = 0;
  TD_ASSERT_OK(td__store_local_set(s, "big/0", big, bn));
  TD_ASSERT_OK(td__store_local_set(s, "big/1", big, bn));
  TD_ASSERT_OK(td__store_local_set(s, "mid/0", big, bn));
  free(big);
  const char *big_mid[] = {"big/", "mid/"};
  p = ranges_req(s, 2, big_mid, 2, &st);
  TD_ASSERT_OK(st);
  assert_int_equal(p->counts[0], 1); /* op 7's own limit */
  assert_int_equal(p->counts[1], 0); /* 1.2 MB would pass the limit: none */
  assert_int_equal(p->n_values, 1);
  tdist__store_reply__free_unpacked(p, NULL);
  const char *big_a[] = {"big/", "a/"};
  p = ranges_req(s, 2, big_a, 2, &st);
  TD_ASSERT_OK(st);
  assert_int_equal(p->counts[0], 1); /* op 7's own limit */
  assert_int_equal(p->counts[1], 2);
  tdist__store_reply__free_unpacked(p, NULL);
  const char *nine[9] = {"a/", "a/", "a/", "a/", "a/", "a/", "a/", "a/", "a/"};
  assert_null(ranges_req(s, 9, nine, 2, &st));
  assert_int_equal(st, TD_ERR_INVALID);
  assert_null(ranges_req(s, 0, nine, 2, &st));
  assert_int_equal(st, TD_ERR_INVALID);
  td__store_destroy(s);
}

/* ---- publish (op 9): a worker's records and its count in one request ---- */

/* One publish request of n pairs (keys[i] = vals[i]; nvals may differ from n) and an add to
 * add_key: its status, and the counter in *num. */
static td_status publish_req(td__store *s, size_t n, const char *const *keys, size_t nvals,
                             const char *const *vals, const size_t *lens, const char *add_key,
                             int64_t *num) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 9;
  r.key = (char *)(add_key ? add_key : "");
  r.delta = 1;
  r.n_keys = n;
  r.keys = (char **)keys;
  ProtobufCBinaryData v[80];
  for (size_t i = 0; i < nvals; i++)
    v[i] = (ProtobufCBinaryData){lens ? lens[i] : strlen(vals[i]), (uint8_t *)vals[i]};
  r.n_values = nvals;
  r.values = v;
  size_t packed = tdist__store_request__get_packed_size(&r);
  uint8_t *buf = malloc(packed), *rep = NULL;
  assert_non_null(buf);
  tdist__store_request__pack(&r, buf);
  size_t rl = 0;
  td_status st = td__store_handle(s, buf, packed, &rep, &rl);
  free(buf);
  if (st == TD_OK) {
    Tdist__StoreReply *p = tdist__store_reply__unpack(NULL, rl, rep);
    assert_non_null(p);
    if (num) *num = p->number;
    tdist__store_reply__free_unpacked(p, NULL);
  }
  td__free(rep);
  return st;
}

/* The pairs are set and the counter counts, in one request; the parked waits on any of them
 * are answered by it; a publish that breaks a limit (pairs that do not match, too many, a value
 * too large anywhere in it) is refused whole: nothing set, nothing counted. */
static void test_store_publish_sets_records_then_counts(void **state) {
  (void)state;
  td__store *s;
  TD_ASSERT_OK(td__store_create(&s));
  memset(answered, 0, sizeof answered);
  parks = 0;
  bool found = false;
  char val[64];
  assert_true(wait_req(s, "joined", 2, "abort", 1000, &found)); /* token 1 */
  assert_true(wait_req(s, "direct/1", 0, NULL, 1000, &found));  /* token 2 */
  const char *keys[] = {"worker/1", "registry/1", "direct/1"};
  const char *vals[] = {"w1\t127.0.0.1:5", "regblob/x", "host-record"};
  int64_t num = 0;
  TD_ASSERT_OK(publish_req(s, 3, keys, 3, vals, NULL, "joined", &num));
  assert_int_equal(num, 1);
  for (int i = 0; i < 3; i++) {
    req(s, GET, keys[i], NULL, &found, val);
    assert_true(found);
    assert_string_equal(val, vals[i]);
  }
  assert_int_equal(answered[1], 0); /* 1 < 2 */
  assert_int_equal(answered[2], 2); /* its key was set */
  const char *keys2[] = {"worker/2"};
  const char *vals2[] = {"w2"};
  TD_ASSERT_OK(publish_req(s, 1, keys2, 1, vals2, NULL, "joined", &num));
  assert_int_equal(num, 2);
  assert_int_equal(answered[1], 2); /* the count reached 2 */
  /* refused whole */
  const char *bad_keys[] = {"a/1", "a/2"};
  assert_int_equal(publish_req(s, 2, bad_keys, 1, vals, NULL, "joined", NULL), TD_ERR_INVALID);
  const char *many[TD__STORE_PUBLISH_MAX + 1];
  for (int i = 0; i <= TD__STORE_PUBLISH_MAX; i++) many[i] = "a/1";
  assert_int_equal(publish_req(s, TD__STORE_PUBLISH_MAX + 1, many, TD__STORE_PUBLISH_MAX + 1,
                               many, NULL, "joined", NULL), TD_ERR_INVALID);
  char *huge = calloc(TD__STORE_MAX_VALUE + 1, 1);
  assert_non_null(huge);
  const char *hv[] = {"small", huge};
  size_t hl[] = {5, TD__STORE_MAX_VALUE + 1};
  assert_int_equal(publish_req(s, 2, bad_keys, 2, hv, hl, "joined", NULL), TD_ERR_INVALID);
  free(huge);
  req(s, GET, "a/1", NULL, &found, NULL);
  assert_false(found);
  assert_int_equal(add(s, "joined", 0), 2);
  td__store_unpark_all(s);
  td__store_destroy(s);
}

/* The client's publish and get2 (two keys in one request) against a real server. */
static void test_store_client_publish_and_get2(void **state) {
  (void)state;
  td_rpc_agent *a = solo_agent();
  const td__store_client *c = td__agent_store(a);
  char *keys[] = {"p/1", "p/2"};
  const void *vals[] = {"one", "two"};
  size_t lens[] = {3, 3};
  int64_t num = 0;
  TD_ASSERT_OK(td__store_publish(c, 2, keys, vals, lens, "p/count", 1, &num));
  assert_int_equal(num, 1);
  TD_ASSERT_OK(td__store_publish(c, 1, keys, vals, lens, NULL, 1, &num)); /* no count */
  uint8_t *v = NULL, *v2 = NULL;
  bool found = false, found2 = false;
  size_t n = 0;
  TD_ASSERT_OK(td__store_get2(c, "p/1", &v, &n, &found, "p/2", &v2, &found2));
  assert_true(found && found2);
  assert_string_equal((char *)v, "one");
  assert_int_equal(n, 3);
  assert_string_equal((char *)v2, "two");
  td__free(v);
  td__free(v2);
  v = v2 = NULL;
  TD_ASSERT_OK(td__store_get2(c, "p/count", &v, NULL, &found, "p/none", &v2, &found2));
  assert_true(found);
  assert_false(found2);
  assert_string_equal((char *)v, "1");
  assert_null(v2);
  td__free(v);
  /* both published records and the missing third prefix, in one request */
  const char *pre[] = {"p/", "q/"};
  uint8_t *va[2][4] = {{0}}, **vp[2] = {va[0], va[1]};
  size_t la[2][4], *lp[2] = {la[0], la[1]};
  int got[2] = {-1, -1};
  TD_ASSERT_OK(td__store_ranges(c, 2, pre, 1, 4, vp, lp, got));
  assert_int_equal(got[0], 2);
  assert_int_equal(got[1], 0);
  assert_string_equal((char *)va[0][0], "one");
  assert_string_equal((char *)va[0][1], "two");
  assert_int_equal(la[0][1], 3);
  td__free(va[0][0]);
  td__free(va[0][1]);
  TD_ASSERT_OK(td_rpc_shutdown(a, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(a);
}

/* Requests per worker outside the waits (check, publish, read): the same at 32 and 256 workers;
 * bytes per worker in the read phase: the table of N small records (no registry text per
 * worker: each costs 40 bytes, not its 600); the waits' polls bounded per worker too. */
static void test_store_protocol_grows_linearly(void **state) {
  (void)state;
  td__store_sim_result r[2];
  int worlds[2] = {32, 256};
  for (int i = 0; i < 2; i++) {
    td__store_sim_opts o = {.world = worlds[i], .registry_bytes = 600, .stagger_ms = 200,
                            .timeout_ms = td_test_ms(60000)};
    TD_ASSERT_OK(td__store_sim_run(&o, &r[i]));
    for (int p = 0; p < TD__SIM_PHASES; p++)
      fprintf(stderr, "store sim %d workers: %-8s %6.2f requests, %8.0f bytes per worker\n",
              worlds[i], td__store_sim_phase_name(p), (double)r[i].phase[p].requests / worlds[i],
              (double)(r[i].phase[p].bytes_in + r[i].phase[p].bytes_out) / worlds[i]);
  }
  /* the claim, then the records with the count in "joined" (td__store_publish); at 256 (two
   * clock exchanges) the read phase's records in one request (td__store_ranges), the registry
   * text, the clock */
  for (int i = 0; i < 2; i++) assert_true(r[i].phase[TD__SIM_PUBLISH].requests <= 2u * worlds[i]);
  assert_true(r[1].phase[TD__SIM_READ].requests <= 4u * worlds[1] + worlds[1] / 8);
  int fixed[] = {TD__SIM_PUBLISH, TD__SIM_READ};
  for (int k = 0; k < 2; k++) {
    double small = (double)r[0].phase[fixed[k]].requests / worlds[0];
    double large = (double)r[1].phase[fixed[k]].requests / worlds[1];
    assert_true(large <= small + 0.5);
    assert_true(large <= 10);
  }
  double read_bytes = (double)(r[1].phase[TD__SIM_READ].bytes_in +
                               r[1].phase[TD__SIM_READ].bytes_out) / worlds[1];
  assert_true(read_bytes < 300.0 * worlds[1]);
  for (int p = 0; p < TD__SIM_PHASES; p++)
    assert_true((double)r[1].phase[p].requests / worlds[1] < 100);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      /* first: its workers are forked, before this process starts gRPC for its own agents */
      cmocka_unit_test(test_rendezvous_reads_records_in_range_requests),
      cmocka_unit_test(test_store_delete_reports_whether_key_existed),
      cmocka_unit_test(test_store_set_delete_cycles_stay_bounded),
      cmocka_unit_test(test_store_client_delete_and_waiters),
      cmocka_unit_test(test_store_range_reads_consecutive_keys),
      cmocka_unit_test(test_store_range_reply_is_bounded),
      cmocka_unit_test(test_store_range_remembered_until_a_key_changes),
      cmocka_unit_test(test_store_client_wait_range),
      cmocka_unit_test(test_store_parked_waits_answered_when_over),
      cmocka_unit_test(test_store_change_looks_only_at_its_waits),
      cmocka_unit_test(test_store_ranges_read_several_prefixes_at_once),
      cmocka_unit_test(test_store_ranges_reply_kept_packed),
      cmocka_unit_test(test_store_publish_sets_records_then_counts),
      cmocka_unit_test(test_store_client_publish_and_get2),
      cmocka_unit_test(test_store_protocol_grows_linearly),
  };
  return cmocka_run_group_tests_name("store", tests, NULL, NULL);
}
