/* cuda_alloc.h - the caching allocator of the CUDA backend (cuda_alloc.cu) as a C interface, for
 * the backend table, tensor/devices.c (td_cuda_empty_cache, td_cuda_memory_info) and the tests.
 * No CUDA header: the device memory itself comes through a td__cu_raw_ops table, which is
 * cudaMalloc/cudaFree for the process-wide cache (td__cu_default_cache) and may be anything for a
 * cache a test creates (the bookkeeping is host code and runs without a GPU).
 */
#ifndef TD_TENSOR_CUDA_ALLOC_H
#define TD_TENSOR_CUDA_ALLOC_H

#include <stdbool.h>
#include <stddef.h>

#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a cache gets and returns device memory. alloc returns TD_ERR_NOMEM (with a message) when
 * the device is out of memory, which makes the cache empty itself and try once more; free must
 * not fail. Both are called with no lock of the cache held. */
typedef struct td__cu_raw_ops {
  td_status (*alloc)(void *ctx, int device, size_t nbytes, void **out);
  void (*free)(void *ctx, int device, void *p);
  void *ctx;
} td__cu_raw_ops;

typedef struct td__cu_cache td__cu_cache;

/* td__cu_cache_create makes an empty cache over ops (copied). Release with
 * td__cu_cache_destroy(), after every block was freed. */
td_status td__cu_cache_create(const td__cu_raw_ops *ops, td__cu_cache **out);
/* td__cu_cache_destroy gives the cached blocks back and frees c. NULL does nothing. */
void td__cu_cache_destroy(td__cu_cache *c);
/* td__cu_default_cache returns the process-wide cache over cudaMalloc/cudaFree that CUDA tensors
 * use; created on first use and never destroyed (tensors freed during exit still find it). */
td__cu_cache *td__cu_default_cache(void);

/* td__cu_cache_alloc returns a block of at least nbytes on device: a cached block of the same
 * size class when there is one, else a new one from ops.alloc; when that reports out of memory,
 * the device's cached blocks go back first and the allocation is tried once more. TD_ERR_NOMEM
 * with a message naming the device and the bytes in use when it still fails. THREAD SAFETY: any
 * thread. */
td_status td__cu_cache_alloc(td__cu_cache *c, int device, size_t nbytes, void **out);
/* td__cu_cache_free returns p (from td__cu_cache_alloc of c; NULL does nothing) to its free list.
 * Aborts on a pointer the cache did not hand out. THREAD SAFETY: any thread. */
void td__cu_cache_free(td__cu_cache *c, void *p);
/* td__cu_cache_empty gives the cached blocks of device (-1: every device) back through ops.free.
 * The lists are taken under the lock and freed after it is released, so other threads keep
 * allocating meanwhile. THREAD SAFETY: any thread. */
td_status td__cu_cache_empty(td__cu_cache *c, int device);
/* td__cu_cache_stats reports the bytes handed out and the bytes cached on device (0 for a device
 * the cache never saw). THREAD SAFETY: any thread. */
void td__cu_cache_stats(td__cu_cache *c, int device, size_t *in_use, size_t *cached);
/* td__cu_cache_peak reports (peak may be NULL) the most bytes handed out on device since the
 * cache saw it first or since the last reset; reset sets the peak to the bytes in use now.
 * THREAD SAFETY: any thread. */
void td__cu_cache_peak(td__cu_cache *c, int device, bool reset, size_t *peak);
/* td__cu_device_name writes the CUDA runtime's name of device (cudaGetDeviceProperties) into buf
 * (n bytes, NUL-terminated). Initialises CUDA in the calling process. */
td_status td__cu_device_name(int device, char *buf, size_t n);
/* td__cu_cache_locked returns true when the calling thread holds c's lock (for tests that check
 * that ops.alloc and ops.free run outside it). THREAD SAFETY: any thread. */
bool td__cu_cache_locked(td__cu_cache *c);

/* td__cu_size_class rounds n up to its size class (*rounded) and returns the class, or -1 when n
 * is too large: powers of two from 512 B to 1 MiB, then four classes per octave (at most 25%
 * waste). td__cu_class_size is the size of a class. Pure. */
int td__cu_size_class(size_t n, size_t *rounded);
size_t td__cu_class_size(int cls);

#ifdef __cplusplus
}
#endif

#endif
