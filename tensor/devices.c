/* devices.c - CUDA device discovery and process-wide CUDA settings that need no CUDA context:
 * td_cuda_device_count, td_cuda_set_device / td_cuda_get_device, and the caching allocator's
 * controls td_cuda_empty_cache / td_cuda_memory_info (forwarded to tensor/cuda/ in CUDA builds).
 *
 * Counting without initialising CUDA. A process that initialised the CUDA driver cannot use CUDA
 * in a child made by fork() (every call there fails with cudaErrorInitializationError), and tdist
 * counts devices where forks follow: td_rpc_init publishes the count for the device-map checks,
 * and programs and tests count before they fork their workers. So the count never comes from
 * the CUDA runtime of the calling process; it comes, in this order, from
 *   1. CUDA_VISIBLE_DEVICES, when it hides every device ("", "-1", a bad first entry): 0;
 *   2. NVML (libnvidia-ml.so.1, part of the driver, opened with dlopen; it creates no CUDA
 *      context): the machine's GPUs with CUDA_VISIBLE_DEVICES applied as the CUDA runtime applies
 *      it (td__cuda_visible_count);
 *   3. otherwise (no NVML, GPUs in MIG mode, "MIG-" entries): a probe child. fork(); the child
 *      asks the CUDA runtime, writes the count into a pipe and exits; the parent reads the pipe
 *      with a deadline and reaps the child by pid. If the child reports that CUDA was already
 *      initialised in this process (by other code), the runtime is asked here directly.
 * The answer is computed once per process (pthread_once) and inherited by later children.
 *
 * The process device (td_cuda_set_device) is one atomic int: the CUDA device NCCL groups use.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "device_count.h"
#include "tensor_impl.h"
#ifdef TD_HAVE_CUDA
#include "cuda/cuda_alloc.h"
#endif

#define PROBE_TIMEOUT_MS 30000
#define CUDA_ERROR_INITIALIZATION 3 /* cudaErrorInitializationError */

/* ---- CUDA_VISIBLE_DEVICES ---- */

/* Reads an ordinal like strtoul at the start of s (after blanks): -1 when there is no digit or
 * the value is negative. */
static long leading_ordinal(const char *s, const char *end) {
  while (s < end && (*s == ' ' || *s == '\t')) s++;
  bool neg = false;
  if (s < end && (*s == '+' || *s == '-')) neg = *s++ == '-';
  long v = 0;
  const char *d = s;
  while (s < end && *s >= '0' && *s <= '9' && v < 1000000) v = v * 10 + (*s++ - '0');
  if (s == d) return -1;
  return neg && v != 0 ? -1 : v;
}

/* Resolves a "GPU-" prefix [s, end) against uuids: the index, -1 when none matches, -2 when
 * several do. */
static int match_uuid(const char *s, const char *end, int physical,
                      const char (*uuids)[TD__UUID_LEN]) {
  size_t n = (size_t)(end - s);
  int found = -1;
  for (int i = 0; i < physical; i++) {
    if (strlen(uuids[i]) >= n && memcmp(uuids[i], s, n) == 0) {
      if (found >= 0) return -2;
      found = i;
    }
  }
  return found;
}

int td__cuda_visible_count(const char *env, int physical, const char (*uuids)[TD__UUID_LEN]) {
  if (physical < 0) physical = 0;
  if (!env) return physical;
  bool by_uuid = strncmp(env, "GPU-", 4) == 0;
  if (strncmp(env, "MIG-", 4) == 0 || (by_uuid && !uuids)) return -1;
  int seen[64], n = 0;
  const char *s = env;
  for (;;) {
    const char *end = strchr(s, ',');
    if (!end) end = s + strlen(s);
    int idx;
    if (by_uuid) {
      if (strncmp(s, "GPU-", 4) != 0) break;
      idx = match_uuid(s, end, physical, uuids);
      if (idx == -2) return -1;
    } else {
      long v = leading_ordinal(s, end);
      idx = v >= 0 && v < physical ? (int)v : -1;
    }
    if (idx < 0) break;
    for (int k = 0; k < n; k++)
      if (seen[k] == idx) return 0; /* a repeated device hides all of them */
    if (n == (int)(sizeof seen / sizeof seen[0])) break;
    seen[n++] = idx;
    if (!*end) break;
    s = end + 1;
  }
  return n;
}

/* ---- NVML ---- */

typedef int nvml_ret;
typedef struct nvml_device_st *nvml_device;

td_status td__nvml_count(int *count, char (*uuids)[TD__UUID_LEN], int cap, bool *mig) {
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return td_set_error(TD_ERR_UNSUPPORTED, "nvml: libnvidia-ml.so.1 not found");
  nvml_ret (*init)(void) = (nvml_ret(*)(void))dlsym(lib, "nvmlInit_v2");
  nvml_ret (*shutdown)(void) = (nvml_ret(*)(void))dlsym(lib, "nvmlShutdown");
  nvml_ret (*get_count)(unsigned *) = (nvml_ret(*)(unsigned *))dlsym(lib, "nvmlDeviceGetCount_v2");
  nvml_ret (*get_handle)(unsigned, nvml_device *) =
      (nvml_ret(*)(unsigned, nvml_device *))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  nvml_ret (*get_uuid)(nvml_device, char *, unsigned) =
      (nvml_ret(*)(nvml_device, char *, unsigned))dlsym(lib, "nvmlDeviceGetUUID");
  nvml_ret (*get_mig)(nvml_device, unsigned *, unsigned *) =
      (nvml_ret(*)(nvml_device, unsigned *, unsigned *))dlsym(lib, "nvmlDeviceGetMigMode");
  td_status st = TD_OK;
  if (!init || !shutdown || !get_count || !get_handle || !get_uuid) {
    st = td_set_error(TD_ERR_UNSUPPORTED, "nvml: libnvidia-ml.so.1 lacks a needed function");
    goto out;
  }
  if (init() != 0) {
    st = td_set_error(TD_ERR_UNSUPPORTED, "nvml: nvmlInit failed (no driver?)");
    goto out;
  }
  unsigned n = 0;
  if (get_count(&n) != 0) n = 0;
  *mig = false;
  for (unsigned i = 0; i < n; i++) {
    nvml_device d;
    if (get_handle(i, &d) != 0) continue;
    if ((int)i < cap && get_uuid(d, uuids[i], TD__UUID_LEN) != 0) uuids[i][0] = 0;
    unsigned cur = 0, pending = 0;
    if (get_mig && get_mig(d, &cur, &pending) == 0 && cur == 1) *mig = true;
  }
  shutdown();
  *count = (int)n;
out:
  dlclose(lib);
  return st;
}

/* ---- the probe child ---- */

typedef struct probe_msg {
  int count, err;
} probe_msg;

static void reap(pid_t pid) {
  while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
  }
  /* ECHILD: someone else reaped it (SIGCHLD ignored, or a waitpid(-1) elsewhere) */
}

td_status td__cuda_probe(int (*fn)(int *err), int timeout_ms, int *count, int *err) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0)
    return td_set_error(TD_ERR_INTERNAL, "cuda device probe: pipe: %s", strerror(errno));
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return td_set_error(TD_ERR_INTERNAL, "cuda device probe: fork: %s", strerror(errno));
  }
  if (pid == 0) { /* the child: async-signal-safe calls apart from fn */
    close(fds[0]);
    probe_msg m = {0, 0};
    m.count = fn(&m.err);
    ssize_t w = write(fds[1], &m, sizeof m);
    _exit(w == (ssize_t)sizeof m ? 0 : 1);
  }
  close(fds[1]);
  probe_msg m;
  size_t got = 0;
  td_status st = TD_OK;
  uint64_t deadline = td__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  while (got < sizeof m) {
    uint64_t now = td__now_ns();
    int ms = now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
    struct pollfd p = {fds[0], POLLIN, 0};
    int r = ms > 0 ? poll(&p, 1, ms) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      kill(pid, SIGKILL);
      st = td_set_error(TD_ERR_TIMEOUT, "cuda device probe: no answer from the probe child "
                        "(pid %d) within %d ms", (int)pid, timeout_ms);
      break;
    }
    ssize_t k = r > 0 ? read(fds[0], (char *)&m + got, sizeof m - got) : -1;
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      st = td_set_error(TD_ERR_INTERNAL, "cuda device probe: the probe child (pid %d) exited "
                        "without an answer", (int)pid);
      break;
    }
    got += (size_t)k;
  }
  close(fds[0]);
  reap(pid);
  if (st == TD_OK) {
    *count = m.count < 0 ? 0 : m.count;
    *err = m.err;
  }
  return st;
}

/* ---- td_cuda_device_count ---- */

static pthread_once_t count_once = PTHREAD_ONCE_INIT;
static int count_value;
static _Atomic(const char *) count_method = "none";

#ifdef TD_HAVE_CUDA
static int count_devices(const char **method) {
  const char *env = getenv("CUDA_VISIBLE_DEVICES");
  if (env && td__cuda_visible_count(env, 1 << 20, NULL) == 0) {
    *method = "visible";
    return 0;
  }
  char(*uuids)[TD__UUID_LEN] = td__calloc(64, TD__UUID_LEN);
  int physical = 0, n = -1;
  bool mig = false;
  if (uuids && td__nvml_count(&physical, uuids, 64, &mig) == TD_OK && !mig && physical <= 64) {
    n = td__cuda_visible_count(env, physical, (const char(*)[TD__UUID_LEN])uuids);
    *method = "nvml";
  }
  td__free(uuids);
  if (n >= 0) return n;
  int err = 0;
  *method = "probe";
  if (td__cuda_probe(td__cuda_runtime_count, PROBE_TIMEOUT_MS, &n, &err) != TD_OK) {
    td_log(TD_LOG_WARN, "cuda: cannot count devices (%s); assuming none", td_last_error());
    return 0;
  }
  if (err == CUDA_ERROR_INITIALIZATION) { /* CUDA already runs in this process: ask it here */
    *method = "runtime";
    n = td__cuda_runtime_count(&err);
  }
  return n;
}
#endif

static void count_once_fn(void) {
  const char *method = "build";
  int n = 0;
#ifdef TD_HAVE_CUDA
  n = count_devices(&method);
#endif
  count_value = n;
  atomic_store(&count_method, method);
}

int td_cuda_device_count(void) {
  pthread_once(&count_once, count_once_fn);
  return count_value;
}

const char *td__cuda_count_method(void) { return atomic_load(&count_method); }

/* ---- the process device ---- */

static atomic_int process_device = -1;

td_status td_cuda_set_device(int index) {
#ifndef TD_HAVE_CUDA
  if (index >= 0)
    return td_set_error(TD_ERR_UNSUPPORTED, "cuda_set_device: this build of tdist has no CUDA "
                        "support");
#endif
  if (index >= 0 && index >= td_cuda_device_count())
    return td_set_error(TD_ERR_DEVICE, "cuda_set_device: cuda:%d does not exist (%d CUDA "
                        "devices)", index, td_cuda_device_count());
  atomic_store(&process_device, index < 0 ? -1 : index);
  return TD_OK;
}

int td_cuda_get_device(void) { return atomic_load(&process_device); }

int td__cuda_process_device(int world_rank, int count, const char **why) {
  const char *w;
  int d;
  if (count <= 0) {
    w = "no CUDA device";
    d = -1;
  } else if ((d = atomic_load(&process_device)) >= 0) {
    w = "td_cuda_set_device";
    d %= count;
  } else {
    const char *lr = getenv("LOCAL_RANK");
    char *end = NULL;
    long v = lr && *lr ? strtol(lr, &end, 10) : -1;
    if (lr && *lr && end && *end == 0 && v >= 0) {
      w = "LOCAL_RANK";
      d = (int)(v % count);
    } else {
      w = "the world rank (LOCAL_RANK unset)";
      d = (world_rank < 0 ? 0 : world_rank) % count;
    }
  }
  if (why) *why = w;
  return d;
}

/* ---- caching allocator controls ---- */

td_status td_cuda_empty_cache(void) {
#ifdef TD_HAVE_CUDA
  return td__cu_cache_empty(td__cu_default_cache(), -1);
#else
  return TD_OK;
#endif
}

td_status td_cuda_memory_info(int device, size_t *in_use, size_t *cached) {
  TD_CHECK_ARG(in_use && cached, "cuda_memory_info: NULL argument");
#ifdef TD_HAVE_CUDA
  if (device < 0 || device >= td_cuda_device_count())
    return td_set_error(TD_ERR_DEVICE, "cuda_memory_info: cuda:%d does not exist (%d CUDA "
                        "devices)", device, td_cuda_device_count());
  td__cu_cache_stats(td__cu_default_cache(), device, in_use, cached);
  return TD_OK;
#else
  (void)device;
  return td_set_error(TD_ERR_UNSUPPORTED, "cuda_memory_info: this build of tdist has no CUDA "
                      "support");
#endif
}

td_status td_cuda_memory_peak(int device, bool reset, size_t *peak) {
#ifdef TD_HAVE_CUDA
  if (device < 0 || device >= td_cuda_device_count())
    return td_set_error(TD_ERR_DEVICE, "cuda_memory_peak: cuda:%d does not exist (%d CUDA "
                        "devices)", device, td_cuda_device_count());
  td__cu_cache_peak(td__cu_default_cache(), device, reset, peak);
  return TD_OK;
#else
  (void)device, (void)reset, (void)peak;
  return td_set_error(TD_ERR_UNSUPPORTED, "cuda_memory_peak: this build of tdist has no CUDA "
                      "support");
#endif
}

td_status td_cuda_device_name(int device, char *buf, size_t n) {
  TD_CHECK_ARG(buf && n > 0, "cuda_device_name: NULL or empty buffer");
  buf[0] = 0;
#ifdef TD_HAVE_CUDA
  if (device < 0 || device >= td_cuda_device_count())
    return td_set_error(TD_ERR_DEVICE, "cuda_device_name: cuda:%d does not exist (%d CUDA "
                        "devices)", device, td_cuda_device_count());
  return td__cu_device_name(device, buf, n);
#else
  (void)device;
  return td_set_error(TD_ERR_UNSUPPORTED, "cuda_device_name: this build of tdist has no CUDA "
                      "support");
#endif
}
