/* hang_worker.c - a job that hangs, for tdistrun --hang-timeout (test_flight_hangs): two workers
 * from tdistrun's environment make a group and meet at a barrier; then rank 1 goes on with its
 * own code (a long sleep, standing for a stuck computation) while rank 0 waits in the next
 * barrier, whose deadline (60 s) lies far beyond the hang timeout. Exits 0 only if nothing
 * stops it, which the test counts as a failure. */
#include <stdio.h>
#include <unistd.h>

#include "tdist/collectives.h"
#include "tdist/rpc.h"

int main(void) {
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_timeout_ms = 60000;
  td_rpc_agent *a = NULL;
  td_process_group *pg = NULL;
  if (td_rpc_init_from_env(NULL, &o, &a) != TD_OK ||
      td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 60000, &pg) != TD_OK ||
      td_process_group_barrier(pg) != TD_OK) {
    fprintf(stderr, "hang_worker: %s\n", td_last_error());
    return 1;
  }
  fprintf(stderr, "hang_worker: rank %d past the first barrier\n", td_process_group_rank(pg));
  if (td_process_group_rank(pg) == 1) {
    for (int i = 0; i < 60; i++) sleep(1); /* never enters barrier #2; SIGUSR1 cuts one sleep */
  } else {
    td_process_group_barrier(pg);
  }
  return 0;
}
