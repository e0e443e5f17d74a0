/* test_collectives_nccl_setup.c - NCCL group creation on machines without a GPU, in builds with
 * NCCL (label multiproc): every member's setup fails, and each member reports the same verdict
 * from the readiness records exchanged over the ring (the first member that failed, by name, and
 * why), promptly, instead of some members waiting inside NCCL for the others. Skipped (77) in
 * builds without NCCL, and on machines with a GPU (test_collectives_nccl covers those). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "coll_test_util.h"

static int worker_setup_fails(int rank, int world, const char *method, void *arg) {
  td_rpc_options o = coll_opts(method);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_process_group *pg = (td_process_group *)&pg;
  double t0 = coll_now_s();
  td_status st = td_process_group_create(a, NULL, 0, TD_PG_BACKEND_NCCL, TD_TIMEOUT_DEFAULT, &pg);
  if (st != TD_ERR_DEVICE || !strstr(td_last_error(), "NCCL setup failed on worker0 (rank 0)") ||
      !strstr(td_last_error(), "needs a CUDA device")) {
    fprintf(stderr, "rank %d: got %s: %s\n", rank, td_status_name(st), td_last_error());
    MP_CHECK(0);
  }
  MP_CHECK(pg == (td_process_group *)&pg); /* untouched on failure */
  MP_CHECK(coll_now_s() - t0 < 20 * coll_scale());
  /* the agent is fine: a CPU group works */
  td_process_group *cpu = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &cpu));
  MP_CHECK_OK(td_process_group_barrier(cpu));
  td_process_group_destroy(cpu);
  MP_CHECK_OK(td_rpc_shutdown(a, true, 30000));
  td_rpc_destroy(a);
  return 0;
}

static bool skipped;

static void test_nccl_setup_failure_reported_by_every_member(void **state) {
#ifndef TD_TEST_HAVE_NCCL
  print_message("this build has no NCCL; skipped\n");
  skipped = true;
  skip();
#endif
  if (td_cuda_device_count() > 0) {
    print_message("this machine has a GPU (test_collectives_nccl covers it); skipped\n");
    skipped = true;
    skip();
  }
  int fails = td_mp_run(3, worker_setup_fails, NULL, 120, NULL);
  if (fails) fail_msg("%d of 3 workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_nccl_setup_failure_reported_by_every_member),
  };
  int failed = cmocka_run_group_tests_name("collectives_nccl_setup", tests, NULL, NULL);
  if (failed) return 1;
  return skipped ? 77 : 0;
}
