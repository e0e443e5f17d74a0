/* rref_test_fns.h - functions registered by the RRef tests (every worker registers all of them).
 *
 * Counter objects are opaque (type "Counter", destructor counted per process). Workers keep RRefs
 * they receive in a slot table ("keep") until "drop_all"; "pass_on" keeps one and forwards it
 * along a list of workers; "here" fetches a received RRef's value inside the handler.
 *
 * Lock order: rt_slot_mu is a leaf (RRefs are released after it is dropped).
 */
#ifndef TD_RREF_TEST_FNS_H
#define TD_RREF_TEST_FNS_H

#include <pthread.h>
#include <string.h>
#include <time.h>

#include "mp_util.h"
#include "test_fns.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

/* ---- Counter objects ---- */

typedef struct rt_counter {
  int64_t v;
} rt_counter;

static int64_t rt_counters_made, rt_counters_destroyed;

static void rt_counter_destroy(void *p) {
  __atomic_add_fetch(&rt_counters_destroyed, 1, __ATOMIC_ACQ_REL);
  free(p);
}

/* make_counter(start[, sleep_ms]) */
static td_status rt_make_counter(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                 td_future **fut) {
  int64_t start = 0, ms = 0;
  if (n > 0) td_value_as_int(args[0], &start);
  if (n > 1) td_value_as_int(args[1], &ms);
  if (ms) td_test_sleep_ms(ms);
  rt_counter *k = malloc(sizeof *k);
  if (!k) return td_set_error(TD_ERR_NOMEM, "no memory");
  k->v = start;
  td_status st = td_value_object("Counter", k, res);
  if (st != TD_OK) free(k);
  else __atomic_add_fetch(&rt_counters_made, 1, __ATOMIC_ACQ_REL);
  return st;
}

/* counter_add(counter, d): v += d, returns v */
static td_status rt_counter_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                td_future **fut) {
  void *p;
  int64_t d = 1;
  if (n < 1) return td_set_error(TD_ERR_INVALID, "counter_add needs the counter");
  td_status st = td_value_as_object(args[0], "Counter", &p);
  if (st != TD_OK) return st;
  if (n > 1) td_value_as_int(args[1], &d);
  rt_counter *k = p;
  *res = td_value_int(__atomic_add_fetch(&k->v, d, __ATOMIC_ACQ_REL));
  return TD_OK;
}

static td_status rt_counter_get(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                td_future **fut) {
  void *p;
  td_status st = td_value_as_object(args[0], "Counter", &p);
  if (st != TD_OK) return st;
  *res = td_value_int(__atomic_load_n(&((rt_counter *)p)->v, __ATOMIC_ACQUIRE));
  return TD_OK;
}

static td_status rt_counter_stats(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                  td_future **fut) {
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_int(__atomic_load_n(&rt_counters_made, __ATOMIC_ACQUIRE)));
  td_value_list_append(l, td_value_int(__atomic_load_n(&rt_counters_destroyed, __ATOMIC_ACQUIRE)));
  *res = l;
  return TD_OK;
}

/* ---- keeping and passing RRefs ---- */

#define RT_SLOTS 4096
static pthread_mutex_t rt_slot_mu = PTHREAD_MUTEX_INITIALIZER;
static td_rref *rt_slots[RT_SLOTS];
static int rt_nslots;

static int rt_keep_rref(td_rref *r) {
  pthread_mutex_lock(&rt_slot_mu);
  int i = rt_nslots < RT_SLOTS ? rt_nslots++ : -1;
  if (i >= 0) rt_slots[i] = td_rref_ref(r);
  pthread_mutex_unlock(&rt_slot_mu);
  return i;
}

static void rt_drop_all_local(void) {
  pthread_mutex_lock(&rt_slot_mu);
  int n = rt_nslots;
  td_rref *copy[RT_SLOTS];
  memcpy(copy, rt_slots, (size_t)n * sizeof *copy);
  rt_nslots = 0;
  pthread_mutex_unlock(&rt_slot_mu);
  for (int i = 0; i < n; i++) td_rref_unref(copy[i]);
}

/* keep(rref): returns [slot, is_owner] */
static td_status rt_keep(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  td_rref *r;
  td_status st = td_value_as_rref(args[0], &r);
  if (st != TD_OK) return st;
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_int(rt_keep_rref(r)));
  td_value_list_append(l, td_value_bool(td_rref_is_owner(r)));
  *res = l;
  return TD_OK;
}

static td_status rt_drop_all(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  rt_drop_all_local();
  *res = td_value_none();
  return TD_OK;
}

/* here(rref): the RRef's value, fetched without blocking the handler's thread */
static td_status rt_here(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  td_rref *r;
  td_status st = td_value_as_rref(args[0], &r);
  if (st != TD_OK) return st;
  return td_rref_to_here_async(r, td_test_ms(20000), fut);
}

/* ready_at_entry(rref): [confirmed by its owner, its value readable here (owner only)] as the
 * function starts: tdist runs a user function only once its RRef arguments are usable. */
static td_status rt_ready_at_entry(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                   td_future **fut) {
  td_rref *r;
  td_status st = td_value_as_rref(args[0], &r);
  if (st != TD_OK) return st;
  td_value *v = NULL;
  bool readable = td_rref_is_owner(r) && td_rref_local_value(r, &v) == TD_OK;
  td_value_unref(v);
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_bool(td_rref_confirmed_by_owner(r)));
  td_value_list_append(l, td_value_bool(readable));
  *res = l;
  return TD_OK;
}

/* pass_on(rref, [names...]): keeps the RRef here, forwards it to names[0] with the rest; the last
 * one only keeps it. Replies when the whole chain has replied (async, no thread waits). */
static td_status rt_pass_on(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  td_rref *r;
  td_status st = td_value_as_rref(args[0], &r);
  if (st != TD_OK) return st;
  rt_keep_rref(r);
  size_t left = td_value_list_len(args[1]);
  if (left == 0) {
    *res = td_value_bool(td_rref_is_owner(r));
    return TD_OK;
  }
  const char *next;
  st = td_value_as_string(td_value_list_get(args[1], 0), &next, NULL);
  if (st != TD_OK) return st;
  td_value *rest = td_value_list();
  for (size_t i = 1; i < left; i++)
    td_value_list_append(rest, td_value_ref(td_value_list_get(args[1], i)));
  td_value *a2[2] = {args[0], rest};
  st = td_rpc_async(td_rpc_ctx_agent(c), next, "pass_on", a2, 2, NULL, fut);
  td_value_unref(rest);
  return st;
}

/* sink(anything): receives and drops */
static td_status rt_sink(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  *res = td_value_none();
  return TD_OK;
}

/* forward(rref, to): fire-and-forget sink(rref) on `to`, returns at once */
static td_status rt_forward(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  const char *to;
  td_status st = td_value_as_string(args[1], &to, NULL);
  if (st != TD_OK) return st;
  td_future *f = NULL;
  st = td_rpc_async(td_rpc_ctx_agent(c), to, "sink", args, 1, NULL, &f);
  td_future_unref(f);
  *res = td_value_none();
  return st;
}

/* table(): [owned entries, user rrefs] of this worker */
static td_status rt_table(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  td_value *t;
  td_status st = td_rref_debug_table(td_rpc_ctx_agent(c), &t);
  if (st != TD_OK) return st;
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_int((int64_t)td_value_list_len(td_value_dict_get(t, "owned"))));
  td_value_list_append(l, td_value_int((int64_t)td_value_list_len(td_value_dict_get(t, "users"))));
  td_value_unref(t);
  *res = l;
  return TD_OK;
}

/* rendezvous counter on worker0 for test barriers */
static int64_t rt_arrived;
static td_status rt_arrive(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  int64_t d = 0;
  if (n) td_value_as_int(args[0], &d);
  *res = td_value_int(__atomic_add_fetch(&rt_arrived, d, __ATOMIC_ACQ_REL));
  return TD_OK;
}

/* blocking_probe(...): tries a blocking call back to its caller and returns the status it got.
 * Registered twice: "probe_inline" (TD_RPC_INLINE, where the call must be refused with
 * TD_ERR_STATE because the function runs on the network thread) and "probe_pool" (pool: TD_OK). */
static td_status rt_blocking_probe(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                   td_future **fut) {
  td_value *x = td_value_int(1), *y = td_value_int(2), *xs[2] = {x, y}, *v = NULL;
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = td_test_ms(10000);
  td_status st = td_rpc_sync(td_rpc_ctx_agent(c), td_rpc_ctx_caller_name(c), "add", xs, 2, &o, &v);
  td_value_unref(v);
  td_value_unref(x);
  td_value_unref(y);
  *res = td_value_int((int64_t)st);
  return TD_OK;
}

static void rt_register_all(void) {
  MP_CHECK_OK(td_rpc_register_ex("probe_inline", rt_blocking_probe, NULL, TD_RPC_INLINE));
  MP_CHECK_OK(td_rpc_register("probe_pool", rt_blocking_probe, NULL));
  MP_CHECK_OK(td_object_type_register("Counter", rt_counter_destroy));
  MP_CHECK_OK(td_rpc_register("add", td_test_fn_add, NULL));
  MP_CHECK_OK(td_rpc_register("fail", td_test_fn_fail, NULL));
  MP_CHECK_OK(td_rpc_register("slow", td_test_fn_slow, NULL));
  MP_CHECK_OK(td_rpc_register("echo", td_test_fn_echo, NULL));
  MP_CHECK_OK(td_rpc_register("make_counter", rt_make_counter, NULL));
  MP_CHECK_OK(td_rpc_register("counter_add", rt_counter_add, NULL));
  MP_CHECK_OK(td_rpc_register("counter_get", rt_counter_get, NULL));
  MP_CHECK_OK(td_rpc_register("counter_stats", rt_counter_stats, NULL));
  MP_CHECK_OK(td_rpc_register("keep", rt_keep, NULL));
  MP_CHECK_OK(td_rpc_register("drop_all", rt_drop_all, NULL));
  MP_CHECK_OK(td_rpc_register("here", rt_here, NULL));
  MP_CHECK_OK(td_rpc_register("ready_at_entry", rt_ready_at_entry, NULL));
  MP_CHECK_OK(td_rpc_register("pass_on", rt_pass_on, NULL));
  MP_CHECK_OK(td_rpc_register("sink", rt_sink, NULL));
  MP_CHECK_OK(td_rpc_register("forward", rt_forward, NULL));
  MP_CHECK_OK(td_rpc_register("table", rt_table, NULL));
  MP_CHECK_OK(td_rpc_register("arrive", rt_arrive, NULL));
}

/* rt_arrivals returns worker0's counter of arrivals (zero: an int 0, adds nothing). */
static inline int64_t rt_arrivals(td_rpc_agent *a, td_value *zero) {
  td_value *r = NULL;
  int64_t v = 0;
  MP_CHECK_OK(td_rpc_sync(a, "worker0", "arrive", &zero, 1, NULL, &r));
  MP_CHECK_OK(td_value_as_int(r, &v));
  td_value_unref(r);
  return v;
}

/* rt_barrier: every worker adds 1 to worker0's counter for this round and waits until it reaches
 * world * round (bounded). */
static inline void rt_barrier(td_rpc_agent *a, int round) {
  int world = td_rpc_world_size(a);
  td_value *one = td_value_int(1), *zero = td_value_int(0), *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, "worker0", "arrive", &one, 1, NULL, &r));
  td_value_unref(r);
  int64_t v = 0;
  TD_TEST_POLL((v = rt_arrivals(a, zero)) >= (int64_t)world * round, 15);
  MP_CHECK(v >= (int64_t)world * round);
  td_value_unref(one);
  td_value_unref(zero);
}

/* rt_table_sizes reads this worker's own table (values still being released count as owned). */
static inline void rt_table_sizes(td_rpc_agent *a, size_t *owned, size_t *users) {
  td_value *t;
  MP_CHECK_OK(td_rref_debug_table(a, &t));
  int64_t releasing = 0;
  MP_CHECK_OK(td_value_as_int(td_value_dict_get(t, "releasing"), &releasing));
  *owned = td_value_list_len(td_value_dict_get(t, "owned")) + (size_t)releasing;
  *users = td_value_list_len(td_value_dict_get(t, "users"));
  td_value_unref(t);
}

/* rt_wait_empty polls this worker's table until it is empty (bounded). */
static inline void rt_wait_empty(td_rpc_agent *a) {
  size_t o = 1, u = 1;
  TD_TEST_POLL((rt_table_sizes(a, &o, &u), o == 0 && u == 0), 10);
  if (o || u) {
    td_value *t;
    char buf[2048];
    td_rref_debug_table(a, &t);
    fprintf(stderr, "rank %d table not empty: %s\n", td_rpc_rank(a), td_value_to_string(t, buf, sizeof buf));
    td_value_unref(t);
  }
  MP_CHECK(o == 0 && u == 0);
}

#endif
