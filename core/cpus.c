/* cpus.c - the CPUs this process may use: affinity mask, then cgroup v2 quota (cpus.h).
 *
 * sysconf(_SC_NPROCESSORS_ONLN) counts the machine's CPUs, not this process's: under taskset,
 * a Slurm allocation (cgroup cpuset) or a container CPU limit it overstates them, and a rule such
 * as "busy-poll when every local worker has a CPU" would spin threads that steal each other's
 * CPU. The cgroup is found through /proc/self/cgroup ("0::/path") under /sys/fs/cgroup.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include "cpus.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

long td__cpus_from_quota(const char *cpu_max) {
  char q[32];
  long long period = 0;
  if (!cpu_max || sscanf(cpu_max, "%31s %lld", q, &period) != 2 || period <= 0) return 0;
  if (strcmp(q, "max") == 0) return 0;
  char *end;
  long long quota = strtoll(q, &end, 10);
  if (*end || quota <= 0) return 0;
  return (long)((quota + period - 1) / period);
}

/* The cgroup v2 quota of this process's cgroup (0: none or not readable). */
static long cgroup_quota_cpus(void) {
  FILE *f = fopen("/proc/self/cgroup", "r");
  if (!f) return 0;
  char line[4096], path[4200] = "";
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "0::", 3) == 0) {
      line[strcspn(line, "\r\n")] = 0;
      snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", line + 3);
      break;
    }
  }
  fclose(f);
  if (!path[0]) return 0;
  f = fopen(path, "r");
  if (!f) return 0;
  char buf[128] = "";
  long n = fgets(buf, sizeof buf, f) ? td__cpus_from_quota(buf) : 0;
  fclose(f);
  return n;
}

long td__cpus_usable(void) {
  const char *env = getenv("TD_CPUS");
  if (env && *env) {
    char *end;
    long v = strtol(env, &end, 10);
    if (*end == 0 && v > 0) return v;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    long c = CPU_COUNT(&set);
    if (c > 0) n = c;
  }
  long q = cgroup_quota_cpus();
  if (q > 0 && q < n) n = q;
#endif
  return n > 0 ? n : 1;
}
