/* device_count.h - internals of tensor/devices.c shared with the CUDA backend and the tests:
 * counting CUDA devices without initialising CUDA in the calling process (never installed).
 *
 * Everything here is plain C with no CUDA header: the parts that need the CUDA runtime are
 * reached through td__cuda_runtime_count (tensor/cuda/cuda_backend.cu, CUDA builds only).
 */
#ifndef TD_TENSOR_DEVICE_COUNT_H
#define TD_TENSOR_DEVICE_COUNT_H

#include <stdbool.h>

#include "tdist/status.h"

/* Size of one UUID string as NVML writes it ("GPU-xxxxxxxx-xxxx-..."), terminator included. */
#define TD__UUID_LEN 96

/* td__cuda_visible_count applies a CUDA_VISIBLE_DEVICES value to the devices of the machine the
 * way the CUDA runtime does: env NULL leaves all `physical` devices visible; a comma list of
 * ordinals keeps entries up to the first invalid one (no digits, negative, or >= physical; text
 * after the digits is ignored, so "1gpu" is 1), and a repeated ordinal hides everything; a list of
 * "GPU-" UUID prefixes is resolved against uuids[0..physical) the same way (a prefix matching no
 * device ends the list). Returns the number of visible devices, or -1 when that cannot be decided
 * here ("MIG-" entries, UUIDs when uuids is NULL, a prefix matching several devices): the caller
 * must then ask the CUDA runtime. THREAD SAFETY: any thread; pure. */
int td__cuda_visible_count(const char *env, int physical, const char (*uuids)[TD__UUID_LEN]);

/* td__cuda_probe runs fn in a child process made with fork() (so this process never initialises
 * CUDA) and returns what it found: the child calls fn(&err), writes the count and err into a
 * pipe and exits at once. Waits at most timeout_ms for the answer, then kills the child (by pid);
 * the child is always reaped. TD_OK with *count and *err; TD_ERR_TIMEOUT when the child did not
 * answer in time; TD_ERR_INTERNAL when it died without answering or fork/pipe failed (message
 * set). THREAD SAFETY: any thread; blocks up to timeout_ms. */
td_status td__cuda_probe(int (*fn)(int *err), int timeout_ms, int *count, int *err);

/* td__nvml_count asks NVML (libnvidia-ml.so.1, loaded with dlopen; it creates no CUDA context)
 * for the GPUs of the machine: *count, their UUIDs in uuids[0..min(count, cap)), and *mig when any
 * of them runs in MIG mode. TD_ERR_UNSUPPORTED when the library is absent or does not initialise
 * (no driver). THREAD SAFETY: any thread. */
td_status td__nvml_count(int *count, char (*uuids)[TD__UUID_LEN], int cap, bool *mig);

/* td__cuda_runtime_count returns the device count of the CUDA runtime (cudaGetDeviceCount: this
 * initialises CUDA in the calling process) and its error code in *err (0 on success; the count
 * is 0 on an error). Defined in tensor/cuda/cuda_backend.cu; absent without CUDA in the build. */
int td__cuda_runtime_count(int *err);

/* td__cuda_count_method returns where td_cuda_device_count()'s cached answer came from: "build"
 * (no CUDA in this build), "visible" (CUDA_VISIBLE_DEVICES hides every device), "nvml", "probe"
 * (a probe child), "runtime" (this process had already initialised CUDA), or "none" before the
 * first count. Borrowed static string. THREAD SAFETY: any thread. */
const char *td__cuda_count_method(void);

/* td__cuda_process_device returns the CUDA device this process uses for NCCL groups: the one set
 * with td_cuda_set_device(), else LOCAL_RANK % count when LOCAL_RANK is set, else world_rank %
 * count; -1 when count <= 0. *why (may be NULL) gets a short phrase naming the source, for
 * messages. THREAD SAFETY: any thread. */
int td__cuda_process_device(int world_rank, int count, const char **why);

#endif
