/* test_cuda_devices.c - counting CUDA devices without initialising CUDA (tensor/devices.c), on any
 * machine: CUDA_VISIBLE_DEVICES applied as the CUDA runtime applies it, the probe child (answer,
 * hang, death, reaping), the process device used by NCCL groups, and, through the dynamic
 * loader's own log (LD_DEBUG=libs), that a process that counted devices never looked for the
 * CUDA driver (libcuda.so.1) itself, so that children it forks can use CUDA. */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tensor/device_count.h"
#include "test_util.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- CUDA_VISIBLE_DEVICES ---- */

static void test_cuda_visible_count_ordinals(void **state) {
  (void)state;
  assert_int_equal(td__cuda_visible_count(NULL, 4, NULL), 4);
  assert_int_equal(td__cuda_visible_count("", 4, NULL), 0);
  assert_int_equal(td__cuda_visible_count("-1", 4, NULL), 0);
  assert_int_equal(td__cuda_visible_count("none", 4, NULL), 0);
  assert_int_equal(td__cuda_visible_count("0", 4, NULL), 1);
  assert_int_equal(td__cuda_visible_count("3,1", 4, NULL), 2);
  assert_int_equal(td__cuda_visible_count(" 1, 0", 4, NULL), 2);
  assert_int_equal(td__cuda_visible_count("+2", 4, NULL), 1);
  /* text after the digits is ignored, like strtoul: "1gpu2,0" is 1,0 */
  assert_int_equal(td__cuda_visible_count("1gpu2,0", 4, NULL), 2);
  /* the list ends at the first invalid entry: negative, out of range, no digits */
  assert_int_equal(td__cuda_visible_count("0,-1,1", 4, NULL), 1);
  assert_int_equal(td__cuda_visible_count("1,5,0", 4, NULL), 1);
  assert_int_equal(td__cuda_visible_count("2,x,0", 4, NULL), 1);
  assert_int_equal(td__cuda_visible_count("4", 4, NULL), 0);
  assert_int_equal(td__cuda_visible_count("0,1,", 4, NULL), 2);
  /* a repeated device hides every device */
  assert_int_equal(td__cuda_visible_count("0,1,0", 4, NULL), 0);
  assert_int_equal(td__cuda_visible_count("0", 0, NULL), 0);
}

static void test_cuda_visible_count_uuids(void **state) {
  (void)state;
  char uuids[3][TD__UUID_LEN] = {"GPU-1a2b3c4d-0000-1111-2222-333344445555",
                                 "GPU-1a2b9999-0000-1111-2222-333344445555",
                                 "GPU-77777777-0000-1111-2222-333344445555"};
  const char(*u)[TD__UUID_LEN] = (const char(*)[TD__UUID_LEN])uuids;
  assert_int_equal(td__cuda_visible_count("GPU-77777777-0000-1111-2222-333344445555", 3, u), 1);
  assert_int_equal(td__cuda_visible_count("GPU-7,GPU-1a2b3", 3, u), 2); /* unique prefixes */
  assert_int_equal(td__cuda_visible_count("GPU-7,GPU-dead,GPU-1a2b3", 3, u), 1);
  assert_int_equal(td__cuda_visible_count("GPU-7,0", 3, u), 1);     /* a non-UUID ends it */
  assert_int_equal(td__cuda_visible_count("GPU-7,GPU-77", 3, u), 0); /* the same device twice */
  /* undecidable here: an ambiguous prefix, MIG instances, UUIDs without the device list */
  assert_int_equal(td__cuda_visible_count("GPU-1a2b", 3, u), -1);
  assert_int_equal(td__cuda_visible_count("MIG-1a2b3c4d", 3, u), -1);
  assert_int_equal(td__cuda_visible_count("GPU-7", 3, NULL), -1);
}

/* ---- the probe child ---- */

static int fn_three(int *err) {
  *err = 35;
  return 3;
}

static int fn_hang(int *err) {
  (void)err;
  for (;;) pause();
  return 0;
}

static int fn_die(int *err) {
  (void)err;
  _exit(9);
}

static void assert_no_children(void) {
  errno = 0;
  assert_int_equal(waitpid(-1, NULL, WNOHANG), -1);
  assert_int_equal(errno, ECHILD);
}

static void test_cuda_probe_answers_and_is_reaped(void **state) {
  (void)state;
  int n = -1, err = -1;
  TD_ASSERT_OK(td__cuda_probe(fn_three, 10000, &n, &err));
  assert_int_equal(n, 3);
  assert_int_equal(err, 35);
  assert_no_children();
}

static void test_cuda_probe_times_out_and_kills(void **state) {
  (void)state;
  int n = -1, err = -1;
  double t0 = now_s();
  TD_ASSERT_STATUS(td__cuda_probe(fn_hang, 300, &n, &err), TD_ERR_TIMEOUT);
  assert_true(now_s() - t0 < 5.0 * td_test_timeout_scale());
  assert_non_null(strstr(td_last_error(), "probe child"));
  assert_int_equal(n, -1); /* untouched on failure */
  assert_no_children();
}

static void test_cuda_probe_child_that_dies_is_an_error(void **state) {
  (void)state;
  int n = -1, err = -1;
  TD_ASSERT_STATUS(td__cuda_probe(fn_die, 10000, &n, &err), TD_ERR_INTERNAL);
  assert_non_null(strstr(td_last_error(), "without an answer"));
  assert_no_children();
}

/* ---- td_cuda_device_count never initialises CUDA here ---- */

#define MARKER "td-devcount-marker-lib.so"

/* Mode of the re-executed program: count, report, exit. Libraries load libcuda.so.1 at start-up
 * (cuBLASLt's constructor looks for it), which is harmless: only initialising it is not. So the
 * program first asks the loader for a library that does not exist, which marks in the loader's
 * log where counting starts. */
static int count_and_report(void) {
  void *h = dlopen(MARKER, RTLD_NOW);
  if (h) dlclose(h);
  int n = td_cuda_device_count();
  printf("pid %d count %d method %s\n", (int)getpid(), n, td__cuda_count_method());
  fflush(stdout);
  return 0;
}

/* Scans the loader logs in dir (LD_DEBUG=libs,files) for libcuda.so being loaded: *mine counts
 * the loads by pid after its marker, *other the loads by any other process. A load is a
 * "file=...libcuda.so...; needed by X" or "dynamically loaded by X" line. Loads by NVML
 * (libnvidia-ml.so.1 opens libcuda.so.1 itself with driver 580 on an H100: it creates no context,
 * and test_cuda_count_then_fork_child_can_use_cuda checks that children can still use CUDA) are
 * not counted; every libcuda line of pid after its marker is printed, for the record. */
static void scan_logs(const char *dir, int pid, int *mine, int *other) {
  *mine = *other = 0;
  bool marked = false;
  int printed = 0;
  DIR *d = opendir(dir);
  assert_non_null(d);
  struct dirent *e;
  char path[512], line[1024];
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, "ld.", 3) != 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    while (fgets(line, sizeof line, f)) {
      if (atoi(line) == pid && strstr(line, MARKER)) marked = true;
      if (!strstr(line, "libcuda.so")) continue;
      bool mine_now = atoi(line) == pid && marked;
      if (mine_now && printed < 12) {
        print_message("  loader: %s", line);
        printed++;
      }
      const char *by = strstr(line, "needed by");
      if (!by) by = strstr(line, "dynamically loaded by");
      if (!by || strstr(by, "libnvidia-ml.so")) continue;
      if (atoi(line) != pid) (*other)++;
      else if (mine_now) (*mine)++;
    }
    fclose(f);
    unlink(path);
  }
  closedir(d);
  assert_true(marked); /* the log is readable and ordered */
}

static void test_cuda_device_count_does_not_load_the_driver(void **state) {
  (void)state;
  char dir[] = "/tmp/td_devcount_XXXXXX", ld[64], out[64];
  assert_non_null(mkdtemp(dir));
  snprintf(ld, sizeof ld, "%s/ld", dir);
  snprintf(out, sizeof out, "%s/out", dir);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    setenv("LD_DEBUG", "libs,files", 1);
    setenv("LD_DEBUG_OUTPUT", ld, 1);
    if (!freopen(out, "w", stdout)) _exit(2);
    execl("/proc/self/exe", "test_cuda_devices", "--count", (char *)NULL);
    _exit(3);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  FILE *f = fopen(out, "r");
  assert_non_null(f);
  int cpid = 0, count = -1;
  char method[32] = "";
  assert_int_equal(fscanf(f, "pid %d count %d method %31s", &cpid, &count, method), 3);
  fclose(f);
  unlink(out);
  assert_int_equal(cpid, (int)pid);
  assert_int_equal(count, td_cuda_device_count());
  int mine = 0, other = 0;
  scan_logs(dir, cpid, &mine, &other);
  rmdir(dir);
  print_message("device count %d from %s; libcuda lookups while counting: %d by the counting "
                "process, %d by others\n", count, method, mine, other);
  assert_int_equal(mine, 0);
  /* the loader log does see CUDA initialisation: the probe child looked for the driver */
  if (strcmp(method, "probe") == 0) assert_true(other > 0);
}

/* A process that counted devices forks a child; the CUDA runtime works there (it is not the
 * "initialization error" of a child forked after the parent initialised CUDA) and agrees. */
static void test_cuda_count_then_fork_child_can_use_cuda(void **state) {
  (void)state;
#ifndef TD_TEST_HAVE_CUDA
  assert_int_equal(td_cuda_device_count(), 0);
  assert_string_equal(td__cuda_count_method(), "build");
  skip();
#else
  int parent = td_cuda_device_count();
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int err = 0, n = td__cuda_runtime_count(&err);
    if (err == 3 /* cudaErrorInitializationError */) _exit(3);
    _exit(n == parent ? 0 : 4);
  }
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  if (WEXITSTATUS(status) == 3) fail_msg("the forked child got cudaErrorInitializationError");
  assert_int_equal(WEXITSTATUS(status), 0);
#endif
}

/* ---- the process device ---- */

static void test_cuda_process_device_choice(void **state) {
  (void)state;
  const char *why = NULL;
  unsetenv("LOCAL_RANK");
  assert_int_equal(td__cuda_process_device(5, 2, &why), 1);
  assert_non_null(strstr(why, "world rank"));
  setenv("LOCAL_RANK", "3", 1);
  assert_int_equal(td__cuda_process_device(4, 2, &why), 1);
  assert_string_equal(why, "LOCAL_RANK");
  assert_int_equal(td__cuda_process_device(0, 8, NULL), 3);
  setenv("LOCAL_RANK", "x1", 1); /* not a number: the world rank decides */
  assert_int_equal(td__cuda_process_device(6, 4, &why), 2);
  assert_non_null(strstr(why, "world rank"));
  assert_int_equal(td__cuda_process_device(6, 0, &why), -1);
  unsetenv("LOCAL_RANK");
  /* td_cuda_set_device wins over both, for every group of the process */
  assert_int_equal(td_cuda_get_device(), -1);
  int n = td_cuda_device_count();
  if (n == 0) {
    td_status st = td_cuda_set_device(0);
    assert_true(st == TD_ERR_DEVICE || st == TD_ERR_UNSUPPORTED);
  } else {
    TD_ASSERT_OK(td_cuda_set_device(n - 1));
    assert_int_equal(td_cuda_get_device(), n - 1);
    setenv("LOCAL_RANK", "0", 1);
    assert_int_equal(td__cuda_process_device(0, n, &why), n - 1);
    assert_string_equal(why, "td_cuda_set_device");
    unsetenv("LOCAL_RANK");
    TD_ASSERT_STATUS(td_cuda_set_device(n), TD_ERR_DEVICE);
    assert_int_equal(td_cuda_get_device(), n - 1); /* unchanged on failure */
  }
  TD_ASSERT_OK(td_cuda_set_device(-1));
  assert_int_equal(td_cuda_get_device(), -1);
}

static void test_cuda_cache_controls_without_device(void **state) {
  (void)state;
  TD_ASSERT_OK(td_cuda_empty_cache());
  size_t used = 1, cached = 1;
  int n = td_cuda_device_count();
  td_status st = td_cuda_memory_info(n, &used, &cached);
  assert_true(st == TD_ERR_DEVICE || st == TD_ERR_UNSUPPORTED);
  TD_ASSERT_STATUS(td_cuda_memory_info(0, NULL, &cached), TD_ERR_INVALID);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--count") == 0) return count_and_report();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_visible_count_ordinals),
      cmocka_unit_test(test_cuda_visible_count_uuids),
      cmocka_unit_test(test_cuda_probe_answers_and_is_reaped),
      cmocka_unit_test(test_cuda_probe_times_out_and_kills),
      cmocka_unit_test(test_cuda_probe_child_that_dies_is_an_error),
      cmocka_unit_test(test_cuda_device_count_does_not_load_the_driver),
      cmocka_unit_test(test_cuda_count_then_fork_child_can_use_cuda),
      cmocka_unit_test(test_cuda_process_device_choice),
      cmocka_unit_test(test_cuda_cache_controls_without_device),
  };
  return cmocka_run_group_tests_name("cuda_devices", tests, NULL, NULL);
}
