/* test_rref_unit.c - in-process tests of the RRef layer: opaque object values (registry,
 * destructors, refusal to travel), and a world of one worker (port 0) exercising local RRefs,
 * remotes to self, proxies, the debug table and strict leak reports; outside strict mode, RRefs
 * still held at shutdown are released quietly (one DEBUG line, no warning). */
#include <stdlib.h>
#include <string.h>

#include "rref_test_fns.h"
#include "test_util.h"

static int destroyed;
static void count_destroy(void *p) {
  destroyed++;
  free(p);
}

static void test_object_values(void **state) {
  TD_ASSERT_OK(td_object_type_register("UnitThing", count_destroy));
  TD_ASSERT_OK(td_object_type_register("UnitThing", count_destroy)); /* same pair: fine */
  assert_int_equal(td_object_type_register("UnitThing", NULL), TD_ERR_EXISTS);
  int *p = malloc(sizeof *p);
  td_value *v = NULL;
  assert_int_equal(td_value_object("NoSuchType", p, &v), TD_ERR_NOT_FOUND);
  assert_null(v); /* the caller still owns p */
  TD_ASSERT_OK(td_value_object("UnitThing", p, &v));
  assert_int_equal(td_value_kind_of(v), TD_VALUE_EXT);
  assert_string_equal(td_value_object_type(v), "UnitThing");
  assert_null(td_value_object_type(td_value_none()));
  void *back = NULL;
  TD_ASSERT_OK(td_value_as_object(v, "UnitThing", &back));
  assert_ptr_equal(back, p);
  TD_ASSERT_OK(td_value_as_object(v, NULL, &back));
  assert_int_equal(td_value_as_object(v, "Other", &back), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "expected object of type 'Other', got 'UnitThing'"));
  assert_int_equal(td_value_as_object(td_value_none(), NULL, &back), TD_ERR_INVALID);
  char buf[64];
  assert_string_equal(td_value_to_string(v, buf, sizeof buf), "<UnitThing object>");
  td_value *l = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l, td_value_ref(v)));
  td_value_unref(v);
  assert_int_equal(destroyed, 0);
  td_value_unref(l);
  assert_int_equal(destroyed, 1); /* exactly once, with the last reference */
  assert_null(td_value_rref(NULL));
  td_rref_unref(NULL);
  assert_int_equal(td_rref_owner(NULL), -1);
}

static td_rpc_agent *solo(void) {
  td_rpc_options o = td_mp_rpc_options("tcp://127.0.0.1:0", 4);
  td_rpc_agent *a;
  TD_ASSERT_OK(td_rpc_init("solo", 0, 1, &o, &a));
  return a;
}

static size_t owned_count(td_rpc_agent *a) {
  td_value *t;
  TD_ASSERT_OK(td_rref_debug_table(a, &t));
  size_t n = td_value_list_len(td_value_dict_get(t, "owned"));
  td_value_unref(t);
  return n;
}

static bool fns_registered;

static void register_once(void) {
  if (!fns_registered) rt_register_all();
  fns_registered = true;
}

static void test_rref_world_of_one(void **state) {
  register_once();
  td_rref_set_strict(true);
  td_rpc_agent *a = solo();
  td_value *x = td_value_int(5), *v;
  td_rref *r;
  TD_ASSERT_OK(td_rref_create_local(a, x, &r));
  assert_true(td_rref_is_owner(r));
  assert_true(td_rref_confirmed_by_owner(r));
  assert_int_equal(td_rref_owner(r), 0);
  assert_string_equal(td_rref_owner_name(r), "solo");
  assert_int_equal(td_rref_get_fork_id(r).v, 0);
  TD_ASSERT_OK(td_rref_local_value(r, &v));
  assert_ptr_equal(v, x);
  td_value_unref(v);
  assert_int_equal(owned_count(a), 1);
  td_value *t;
  TD_ASSERT_OK(td_rref_debug_table(a, &t));
  td_value *e = td_value_list_get(td_value_dict_get(t, "owned"), 0);
  const char *state_s;
  TD_ASSERT_OK(td_value_as_string(td_value_dict_get(e, "state"), &state_s, NULL));
  assert_string_equal(state_s, "ready");
  int64_t handles;
  TD_ASSERT_OK(td_value_as_int(td_value_dict_get(e, "handles"), &handles));
  assert_int_equal(handles, 1);
  td_value_unref(t);
  td_rref_unref(r);
  assert_int_equal(owned_count(a), 0); /* freed with the last handle, at once */

  /* remote to self and proxies through the pool */
  td_value *args[2] = {x, x};
  TD_ASSERT_OK(td_remote(a, "solo", "add", args, 2, NULL, &r));
  TD_ASSERT_OK(td_rref_to_here(r, td_test_ms(10000), &v));
  int64_t n;
  TD_ASSERT_OK(td_value_as_int(v, &n));
  assert_int_equal(n, 10);
  td_value_unref(v);
  TD_ASSERT_OK(td_rref_rpc_sync(r, "add", &x, 1, NULL, &v));
  TD_ASSERT_OK(td_value_as_int(v, &n));
  assert_int_equal(n, 15);
  td_value_unref(v);
  td_rref *r2;
  TD_ASSERT_OK(td_rref_remote(r, "add", &x, 1, NULL, &r2));
  TD_ASSERT_OK(td_rref_to_here(r2, td_test_ms(10000), &v));
  TD_ASSERT_OK(td_value_as_int(v, &n));
  assert_int_equal(n, 15);
  td_value_unref(v);
  td_rref_unref(r2);
  td_rref_unref(r);
  td_value_unref(x);

  /* a leak in strict mode fails the graceful shutdown, naming it; the value is released */
  int64_t before = rt_counters_destroyed;
  TD_ASSERT_OK(td_remote(a, "solo", "make_counter", NULL, 0, NULL, &r));
  td_future *cf;
  TD_ASSERT_OK(td_rref_creation_future(r, &cf));
  TD_ASSERT_OK(td_future_wait(cf, td_test_ms(10000)));
  td_future_unref(cf);
  assert_int_equal(td_rpc_shutdown(a, true, td_test_ms(10000)), TD_ERR_STATE);
  assert_non_null(strstr(td_last_error(), "leaked"));
  assert_int_equal(rt_counters_destroyed, before + 1);
  assert_int_equal(td_rref_local_value(r, &v), TD_ERR_STATE);
  assert_int_equal(td_rref_debug_table(a, &t), TD_ERR_STATE);
  td_rref_unref(r); /* after shutdown: nothing to send, nothing to free twice */
  td_rpc_destroy(a);

  /* a second agent in the same process starts with an empty table */
  a = solo();
  assert_int_equal(owned_count(a), 0);
  TD_ASSERT_OK(td_rpc_shutdown(a, true, td_test_ms(10000)));
  td_rpc_destroy(a);
}

/* log lines captured by test_rref_held_at_shutdown_not_strict */
static char log_seen[4096];
static int log_warnings;
static void capture(td_log_level level, const char *msg, void *ud) {
  (void)ud;
  if (level >= TD_LOG_WARN) log_warnings++;
  size_t n = strlen(log_seen);
  snprintf(log_seen + n, sizeof log_seen - n, "%d:%s\n", (int)level, msg);
}

static void test_rref_held_at_shutdown_not_strict(void **state) {
  register_once();
  td_rref_set_strict(false);
  unsetenv("TD_RREF_STRICT");
  td_rpc_agent *a = solo();
  int64_t before = rt_counters_destroyed;
  td_rref *r, *local;
  TD_ASSERT_OK(td_remote(a, "solo", "make_counter", NULL, 0, NULL, &r));
  td_future *cf;
  TD_ASSERT_OK(td_rref_creation_future(r, &cf));
  TD_ASSERT_OK(td_future_wait(cf, td_test_ms(10000)));
  td_future_unref(cf);
  td_value *x = td_value_int(3);
  TD_ASSERT_OK(td_rref_create_local(a, x, &local));
  td_value_unref(x);
  td_log_level was = td_log_get_level();
  td_log_set_level(TD_LOG_DEBUG);
  log_seen[0] = 0;
  log_warnings = 0;
  td_log_set_handler(capture, NULL);
  /* the program still holds both: a normal shutdown, quiet at the default level */
  td_status st = td_rpc_shutdown(a, true, td_test_ms(10000));
  td_log_set_handler(NULL, NULL);
  td_log_set_level(was);
  TD_ASSERT_OK(st);
  assert_int_equal(log_warnings, 0);
  assert_non_null(strstr(log_seen, "2 RRefs still referenced at shutdown, released"));
  assert_null(strstr(log_seen, "leaked"));
  assert_int_equal(rt_counters_destroyed, before + 1); /* released all the same */
  td_rref_unref(r);
  td_rref_unref(local);
  td_rpc_destroy(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_object_values),
      cmocka_unit_test(test_rref_world_of_one),
      cmocka_unit_test(test_rref_held_at_shutdown_not_strict),
  };
  return cmocka_run_group_tests_name("rref_unit", tests, NULL, NULL);
}
