/* cpus.h - how many CPUs this process may actually use (internal). */
#ifndef TD_CORE_CPUS_H
#define TD_CORE_CPUS_H

/* td__cpus_usable returns the CPUs this process may run on: the size of its affinity mask
 * (taskset, cpusets), further capped by a cgroup v2 CPU quota (cpu.max "quota period", rounded
 * up) when one applies; sysconf(_SC_NPROCESSORS_ONLN) where neither can be read. At least 1.
 * TD_CPUS (a positive integer) overrides the answer, for tests. THREAD SAFETY: any thread. */
long td__cpus_usable(void);
/* td__cpus_from_quota turns the text of a cgroup v2 cpu.max file into a CPU count (0: no
 * quota, "max", or unreadable text). Exposed for tests. */
long td__cpus_from_quota(const char *cpu_max);

#endif
