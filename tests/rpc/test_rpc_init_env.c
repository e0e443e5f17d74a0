/* test_rpc_init_env.c - how a worker starts: td_rpc_init reads MASTER_ADDR / MASTER_PORT when
 * init_method is NULL or "env://" (PyTorch's default) and says what is missing otherwise; a
 * request that arrives while its callee still finishes its init waits until that init has
 * finished (the callee's layers are ready when the handler runs); registries that differ are one
 * DEBUG line, not a warning per function; the handshake timeout stretches with the workers per
 * CPU the launcher says this host runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpus.h"
#include "rpc/agent_impl.h"
#include "rpc/agent_state.h"
#include "rpc_test_fns.h"
#include "test_util.h"

/* ---- MASTER_ADDR / MASTER_PORT and "env://" in td_rpc_init ---- */

static int worker_env_init(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", strrchr(method, ':') + 1, 1);
  /* rank 0 leaves init_method NULL, rank 1 writes PyTorch's "env://" */
  td_rpc_options o = td_mp_rpc_options(rank == 0 ? NULL : "env://", 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_value *two[2] = {td_value_int(40), td_value_int(2)}, *r;
  MP_CHECK_OK(td_rpc_sync(a, rank ? "worker0" : "worker1", "add", two, 2, NULL, &r));
  int64_t v = 0;
  MP_CHECK_OK(td_value_as_int(r, &v));
  MP_CHECK(v == 42);
  td_value_unref(r);
  td_value_unref(two[0]);
  td_value_unref(two[1]);
  td_mp_finish(a, 20);
  return 0;
}

static void test_rpc_init_reads_master_from_env(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_env_init, NULL, 60);
}

static void test_rpc_init_env_missing_named(void **state) {
  (void)state;
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  unsetenv("SLURM_JOB_ID");
  unsetenv("SLURM_STEP_NODELIST");
  unsetenv("SLURM_JOB_NODELIST");
  td_rpc_options o;
  td_rpc_options_init(&o);
  td_rpc_agent *a = NULL;
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 2, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "MASTER_ADDR and MASTER_PORT not set"));
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  o.init_method = "env://";
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 2, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "(or \"env://\") and MASTER_PORT not set"));
  setenv("MASTER_PORT", "99999", 1);
  TD_ASSERT_STATUS(td_rpc_init(NULL, 0, 2, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "bad MASTER_PORT '99999'"));
  assert_null(a);
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
}

/* ---- a request that arrives during the callee's init ---- */

/* Rank 0's init ends slowly: an agent hook (run at the end of init, as the RRef layer's is)
 * sleeps, then marks the init finished. Rank 1 calls rank 0 the moment its own init returns,
 * which is while rank 0 still sleeps in that hook. */
static int hook_done;

static void slow_hook(td_rpc_agent *a) {
  if (td_rpc_rank(a) != 0) return;
  td_test_sleep_ms(500); /* must outlast rank 1's call: not scaled */
  __atomic_store_n(&hook_done, 1, __ATOMIC_RELEASE);
}

/* init_finished() -> [whether rank 0's init hooks had all run, this worker's rank from the
 * handler's agent] */
static td_status fn_init_finished(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                  td_future **fut) {
  (void)args, (void)n, (void)fut;
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_bool(__atomic_load_n(&hook_done, __ATOMIC_ACQUIRE) != 0));
  td_value_list_append(l, td_value_int(td_rpc_rank(td_rpc_ctx_agent(c))));
  *res = l;
  return TD_OK;
}

static int worker_early_call(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_test_fns();
  td__agent_hooks h = {slow_hook, NULL};
  MP_CHECK_OK(td__agent_add_hooks(&h));
  MP_CHECK_OK(td_rpc_register("init_finished", fn_init_finished, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 1) {
    td_value *r;
    MP_CHECK_OK(td_rpc_sync(a, "worker0", "init_finished", NULL, 0, NULL, &r));
    bool finished = false;
    int64_t their_rank = -1;
    MP_CHECK_OK(td_value_as_bool(td_value_list_get(r, 0), &finished));
    MP_CHECK_OK(td_value_as_int(td_value_list_get(r, 1), &their_rank));
    MP_CHECK(finished);
    MP_CHECK(their_rank == 0);
    td_value_unref(r);
  }
  td_mp_finish(a, 20);
  return 0;
}

static void test_rpc_request_during_init_waits_for_it(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_early_call, NULL, 60);
}

/* ---- registries that differ ---- */

static char log_lines[8192];
static int warnings;

static void capture(td_log_level level, const char *msg, void *ud) {
  (void)ud;
  if (level >= TD_LOG_WARN) warnings++;
  size_t n = strlen(log_lines);
  snprintf(log_lines + n, sizeof log_lines - n, "%d:%s\n", (int)level, msg);
}

static int worker_registries(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_test_fns();
  /* rank 0 serves five functions the others lack, rank 2 one of its own */
  const char *only0[] = {"ps_a", "ps_b", "ps_c", "ps_d", "ps_e"};
  if (rank == 0)
    for (int i = 0; i < 5; i++) MP_CHECK_OK(td_rpc_register(only0[i], td_test_fn_echo, NULL));
  if (rank == 2) MP_CHECK_OK(td_rpc_register("trainer_only", td_test_fn_echo, NULL));
  td_log_set_level(TD_LOG_DEBUG);
  td_log_set_handler(capture, NULL);
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_log_set_handler(NULL, NULL);
  td_log_set_level(TD_LOG_WARN);
  MP_CHECK(warnings == 0);
  MP_CHECK(strstr(log_lines, "has no function") == NULL);
  if (rank == 0)
    MP_CHECK(strstr(log_lines, "1:rpc: worker0: 2 of 2 other workers lack functions registered "
                               "here: worker1 lacks 5 ('ps_a', 'ps_b', 'ps_c', ...); worker2 "
                               "lacks 5") != NULL);
  if (rank == 1) MP_CHECK(strstr(log_lines, "lack functions") == NULL);
  if (rank == 2)
    MP_CHECK(strstr(log_lines, "1:rpc: worker2: 2 of 2 other workers lack functions registered "
                               "here: worker0 lacks 1 ('trainer_only'); worker1 lacks 1") != NULL);
  /* a call to a function the callee lacks still fails at once, naming it */
  if (rank == 1) {
    td_value *r = NULL;
    MP_CHECK(td_rpc_sync(a, "worker2", "ps_a", NULL, 0, NULL, &r) == TD_ERR_NOT_FOUND);
    MP_CHECK(strstr(td_last_error(), "ps_a") != NULL);
  }
  td_mp_finish(a, 20);
  return 0;
}

/* ---- the handshake timeout before the group is known ---- */

static const char *const local_vars[] = {"TD_RPC_HANDSHAKE_TIMEOUT_MS", "LOCAL_WORLD_SIZE",
                                         "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"};

static void unset_local_vars(void) {
  for (size_t i = 0; i < sizeof local_vars / sizeof local_vars[0]; i++) unsetenv(local_vars[i]);
}

/* 20 s up to two workers per CPU, then x (workers per CPU) / 2, at most 120 s; the workers per
 * CPU counted from the launcher's local size (tdistrun / torchrun, Open MPI, Slurm) when it gives
 * one, else from the whole group; TD_RPC_HANDSHAKE_TIMEOUT_MS wins. */
static void test_rpc_handshake_timeout_follows_workers_per_cpu(void **state) {
  (void)state;
  int cpus = (int)td__cpus_usable();
  assert_true(cpus >= 1);
  unset_local_vars();
  assert_int_equal(td__rdv_handshake_ms(1), 20000);
  assert_int_equal(td__rdv_handshake_ms(2 * cpus), 20000);
  assert_int_equal(td__rdv_handshake_ms(8 * cpus), 80000);
  assert_int_equal(td__rdv_handshake_ms(100 * cpus), TD__HANDSHAKE_MAX_MS);
  assert_int_equal(td__rdv_local_estimate(100 * cpus), 100 * cpus);
  /* a group of many hosts: the launcher says how many run here */
  const char *by[] = {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"};
  char v[32];
  for (size_t i = 0; i < 3; i++) {
    snprintf(v, sizeof v, "%d", cpus);
    setenv(by[i], v, 1);
    assert_int_equal(td__rdv_local_estimate(100 * cpus), cpus);
    assert_int_equal(td__rdv_handshake_ms(100 * cpus), 20000);
    snprintf(v, sizeof v, "%d", 6 * cpus);
    setenv(by[i], v, 1);
    assert_int_equal(td__rdv_handshake_ms(100 * cpus), 60000);
    assert_int_equal(td__rdv_local_estimate(3), 3); /* never more than the group */
    unsetenv(by[i]);
  }
  setenv("SLURM_NTASKS_PER_NODE", "4(x2)", 1); /* not one number: the whole group */
  assert_int_equal(td__rdv_local_estimate(100 * cpus), 100 * cpus);
  unsetenv("SLURM_NTASKS_PER_NODE");
  setenv("TD_RPC_HANDSHAKE_TIMEOUT_MS", "5000", 1);
  assert_int_equal(td__rdv_handshake_ms(100 * cpus), 5000);
  unset_local_vars();
}

static void test_rpc_registry_differences_one_debug_line(void **state) {
  (void)state;
  TD_MP_RUN(3, worker_registries, NULL, 60);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_handshake_timeout_follows_workers_per_cpu),
      cmocka_unit_test(test_rpc_init_env_missing_named),
      cmocka_unit_test(test_rpc_init_reads_master_from_env),
      cmocka_unit_test(test_rpc_request_during_init_waits_for_it),
      cmocka_unit_test(test_rpc_registry_differences_one_debug_line),
  };
  return cmocka_run_group_tests_name("rpc_init_env", tests, NULL, NULL);
}
