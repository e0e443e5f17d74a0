/* test_cpus.c - the CPUs a process may use (core/cpus.c): cgroup v2 quota parsing, the affinity
 * mask, and the TD_CPUS override. */
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/cpus.h"

static void test_cpus_quota_parsing(void **state) {
  (void)state;
  assert_int_equal(td__cpus_from_quota("max 100000\n"), 0);
  assert_int_equal(td__cpus_from_quota("200000 100000\n"), 2);
  assert_int_equal(td__cpus_from_quota("150000 100000"), 2); /* 1.5 CPUs round up */
  assert_int_equal(td__cpus_from_quota("50000 100000"), 1);
  assert_int_equal(td__cpus_from_quota("garbage"), 0);
  assert_int_equal(td__cpus_from_quota("-5 100000"), 0);
  assert_int_equal(td__cpus_from_quota("100000 0"), 0);
  assert_int_equal(td__cpus_from_quota(NULL), 0);
}

static void test_cpus_env_override(void **state) {
  (void)state;
  setenv("TD_CPUS", "7", 1);
  assert_int_equal(td__cpus_usable(), 7);
  setenv("TD_CPUS", "0", 1); /* not a positive count: ignored */
  assert_true(td__cpus_usable() >= 1);
  setenv("TD_CPUS", "x", 1);
  assert_true(td__cpus_usable() >= 1);
  unsetenv("TD_CPUS");
}

/* A child pinned to one CPU sees one CPU, whatever the machine has. */
static void test_cpus_follow_affinity(void **state) {
  (void)state;
  unsetenv("TD_CPUS");
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) _exit(2);
    int first = -1;
    for (int i = 0; i < CPU_SETSIZE && first < 0; i++)
      if (CPU_ISSET(i, &set)) first = i;
    CPU_ZERO(&set);
    CPU_SET(first, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) _exit(3);
    _exit(td__cpus_usable() == 1 ? 0 : 1);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cpus_quota_parsing),
      cmocka_unit_test(test_cpus_env_override),
      cmocka_unit_test(test_cpus_follow_affinity),
  };
  return cmocka_run_group_tests_name("cpus", tests, NULL, NULL);
}
