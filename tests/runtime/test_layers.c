/* test_layers.c - the layers above the RPC agent register through td_rpc_init only.
 *
 * The program links the static library and references no symbol of the RRef, distributed
 * autograd, distributed optimizer or remote module layers: before td_rpc_init none of their
 * internal functions, value types or object types exist (nothing ran at load time); after it, all
 * of them do. The tests run in this order in one process.
 */
#include <stdio.h>

#include "rpc/agent_impl.h"
#include "rpc/value_impl.h"
#include "tdist/nn.h"
#include "tdist/rref.h"
#include "test_util.h"

/* one internal function per layer, in td_rpc_init's order */
static const char *const internal_fns[] = {"__rref_remote", "__dist_cleanup",
                                           "__dist_optim_step", "__rm_create"};
#define N_FNS (int)(sizeof internal_fns / sizeof internal_fns[0])

static void test_layers_absent_before_init(void **state) {
  td__reg reg;
  for (int i = 0; i < N_FNS; i++)
    if (td__rpc_lookup(internal_fns[i], &reg) != TD_ERR_NOT_FOUND)
      fail_msg("%s is registered before td_rpc_init", internal_fns[i]);
  assert_null(td__value_ext_find("rref"));
  td_value *v = NULL;
  int token = 0;
  assert_int_equal(td_value_object("nn.Module", &token, &v), TD_ERR_NOT_FOUND);
}

static void test_layers_registered_by_rpc_init(void **state) {
  td_rpc_options opts;
  td_rpc_options_init(&opts);
  opts.init_method = "tcp://127.0.0.1:0";
  td_rpc_agent *agent = NULL;
  TD_ASSERT_OK(td_rpc_init("worker0", 0, 1, &opts, &agent));
  td__reg reg;
  for (int i = 0; i < N_FNS; i++)
    if (td__rpc_lookup(internal_fns[i], &reg) != TD_OK)
      fail_msg("td_rpc_init did not register %s", internal_fns[i]);
  assert_non_null(td__value_ext_find("rref"));
  td_module *m = NULL;
  TD_ASSERT_OK(td_linear_create(2, 3, true, NULL, &m));
  td_value *v = NULL;
  TD_ASSERT_OK(td_value_object("nn.Module", m, &v)); /* takes m */
  assert_string_equal(td_value_object_type(v), "nn.Module");
  td_value_unref(v);
  TD_ASSERT_OK(td_rpc_shutdown(agent, true, td_test_ms(10000)));
  td_rpc_destroy(agent);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layers_absent_before_init),
      cmocka_unit_test(test_layers_registered_by_rpc_init),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
