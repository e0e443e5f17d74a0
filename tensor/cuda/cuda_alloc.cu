/* cuda_alloc.cu - the caching allocator of the CUDA backend (interface: cuda_alloc.h).
 *
 * cudaMalloc and cudaFree synchronise the device and cost tens of microseconds, so freed blocks
 * are kept in per-device free lists and handed out again. A request is rounded up to a size
 * class (td__cu_size_class); each class of each device has a LIFO free list. A map from block
 * address to (device, class) lets free() find the list, since the backend's free() is not told
 * the size. Blocks are reused without synchronisation: all work is issued on the device's legacy
 * default stream, so a kernel that still uses a freed block runs before any kernel of its next
 * owner.
 *
 * No device call runs under the lock: a miss allocates after releasing it; emptying swaps the
 * free lists out under the lock and frees them after (cudaFree waits for all queued work on the
 * device, which may include an NCCL collective waiting on a peer, so freeing under the lock
 * would stall every thread's allocations behind it). When an allocation reports out of memory,
 * the device's cached blocks go back to the driver and the allocation is tried once more;
 * td_cuda_empty_cache() does the same on request, for every device.
 *
 * Lock order: c->mu is a leaf (nothing else is locked while it is held, no call leaves the file).
 */
#include "cuda_alloc.h"
#include "cuda_impl.h"

#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr int kClasses = 128;
constexpr size_t kSmallMax = (size_t)1 << 20; /* powers of two up to here */

struct DeviceCache {
  std::vector<void *> free_list[kClasses];
  size_t cached_bytes = 0; /* bytes in free lists */
  size_t used_bytes = 0;   /* bytes handed out */
  size_t peak_bytes = 0;   /* the most used_bytes since creation or the last reset */
};

int floor_log2(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

} /* namespace */

struct td__cu_cache {
  td__cu_raw_ops ops;
  std::mutex mu;
  std::atomic<std::thread::id> owner{}; /* the thread holding mu, if any (td__cu_cache_locked) */
  std::vector<DeviceCache *> devs;   /* index = device ordinal */
  std::unordered_map<void *, uint32_t> live; /* address -> device << 8 | class */
};

namespace {

/* Holds c->mu and records the holder meanwhile. */
struct Guard {
  td__cu_cache *c;
  explicit Guard(td__cu_cache *cc) : c(cc) {
    c->mu.lock();
    c->owner.store(std::this_thread::get_id());
  }
  ~Guard() {
    c->owner.store(std::thread::id());
    c->mu.unlock();
  }
};

/* device_cache returns the cache of a device, creating it on first use; NULL when out of host
 * memory (no C++ exception may escape into the C callers). c->mu held. */
DeviceCache *device_cache(td__cu_cache *c, int device) {
  try {
    if ((size_t)device >= c->devs.size()) c->devs.resize((size_t)device + 1, nullptr);
    if (!c->devs[(size_t)device]) c->devs[(size_t)device] = new DeviceCache;
  } catch (...) {
    return nullptr;
  }
  return c->devs[(size_t)device];
}

/* empty_device moves device's free lists out under the lock, then frees them without it. */
void empty_device(td__cu_cache *c, int device) {
  std::vector<void *> taken[kClasses];
  {
    Guard g(c);
    if ((size_t)device >= c->devs.size() || !c->devs[(size_t)device]) return;
    DeviceCache *dc = c->devs[(size_t)device];
    for (int k = 0; k < kClasses; k++) taken[k].swap(dc->free_list[k]);
    dc->cached_bytes = 0;
  }
  for (int k = 0; k < kClasses; k++)
    for (void *p : taken[k]) c->ops.free(c->ops.ctx, device, p);
}

/* ---- the process-wide cache over the CUDA runtime ---- */

td_status raw_cuda_alloc(void *, int device, size_t nbytes, void **out) {
  TD_TRY(td__cu_set_device(device, "alloc"));
  void *p = nullptr;
  cudaError_t e = cudaMalloc(&p, nbytes);
  if (e != cudaSuccess) return td__cu_error(e, "alloc");
  *out = p;
  return TD_OK;
}

void raw_cuda_free(void *, int, void *p) {
  (void)cudaFree(p); /* by address (unified addressing): any current device will do */
  (void)cudaGetLastError();
}

} /* namespace */

extern "C" {

int td__cu_size_class(size_t n, size_t *rounded) {
  if (n <= 512) {
    *rounded = 512;
    return 0;
  }
  if (n <= kSmallMax) {
    int o = floor_log2(n - 1) + 1; /* 2^(o-1) < n <= 2^o */
    *rounded = (size_t)1 << o;
    return o - 9; /* 1 .. 11 */
  }
  int o = floor_log2(n - 1); /* 2^o < n <= 2^(o+1), o >= 20 */
  if (o > 47) return -1;
  size_t step = (size_t)1 << (o - 2);
  size_t k = (n + step - 1) / step; /* 5 .. 8 */
  *rounded = k * step;
  return 12 + (o - 20) * 4 + (int)(k - 5);
}

size_t td__cu_class_size(int cls) {
  if (cls == 0) return 512;
  if (cls <= 11) return (size_t)1 << (cls + 9);
  int o = 20 + (cls - 12) / 4;
  size_t k = 5 + (size_t)((cls - 12) % 4);
  return k * ((size_t)1 << (o - 2));
}

td_status td__cu_cache_create(const td__cu_raw_ops *ops, td__cu_cache **out) {
  if (!ops || !ops->alloc || !ops->free || !out)
    return td_set_error(TD_ERR_INVALID, "cuda cache: NULL ops");
  td__cu_cache *c = nullptr;
  try {
    c = new td__cu_cache;
  } catch (...) {
    return td_set_error(TD_ERR_NOMEM, "cuda cache: out of host memory");
  }
  c->ops = *ops;
  *out = c;
  return TD_OK;
}

void td__cu_cache_destroy(td__cu_cache *c) {
  if (!c) return;
  for (size_t d = 0; d < c->devs.size(); d++) empty_device(c, (int)d);
  for (DeviceCache *dc : c->devs) delete dc;
  delete c;
}

td__cu_cache *td__cu_default_cache(void) {
  static td__cu_cache *c = [] {
    td__cu_raw_ops ops = {raw_cuda_alloc, raw_cuda_free, nullptr};
    td__cu_cache *made = nullptr;
    if (td__cu_cache_create(&ops, &made) != TD_OK) TD_PANIC("cuda cache: out of host memory");
    return made; /* intentionally never destroyed, see the file comment */
  }();
  return c;
}

td_status td__cu_cache_alloc(td__cu_cache *c, int device, size_t nbytes, void **out) {
  if (device < 0) return td_set_error(TD_ERR_DEVICE, "cuda alloc: bad device index %d", device);
  size_t rounded = 0;
  int cls = td__cu_size_class(nbytes, &rounded);
  if (cls < 0)
    return td_set_error(TD_ERR_NOMEM, "cuda alloc: %zu bytes is too large a request", nbytes);
  {
    Guard g(c);
    DeviceCache *dc = device_cache(c, device);
    if (!dc) return td_set_error(TD_ERR_NOMEM, "cuda alloc: out of host memory");
    std::vector<void *> &fl = dc->free_list[cls];
    if (!fl.empty()) {
      void *p = fl.back();
      try {
        c->live.emplace(p, ((uint32_t)device << 8) | (uint32_t)cls);
      } catch (...) {
        return td_set_error(TD_ERR_NOMEM, "cuda alloc: out of host memory");
      }
      fl.pop_back();
      dc->cached_bytes -= rounded;
      dc->used_bytes += rounded;
      if (dc->used_bytes > dc->peak_bytes) dc->peak_bytes = dc->used_bytes;
      *out = p;
      return TD_OK;
    }
  }
  void *p = nullptr;
  td_status st = c->ops.alloc(c->ops.ctx, device, rounded, &p);
  if (st == TD_ERR_NOMEM) {
    empty_device(c, device);
    st = c->ops.alloc(c->ops.ctx, device, rounded, &p);
  }
  if (st != TD_OK) {
    char why[256];
    snprintf(why, sizeof why, "%s", td_last_error());
    size_t used = 0, cached = 0;
    td__cu_cache_stats(c, device, &used, &cached);
    return td_set_error(st, "cuda alloc: cannot allocate %zu bytes on cuda:%d (%zu bytes in use "
                        "by tensors, %zu cached): %s", rounded, device, used, cached, why);
  }
  {
    Guard g(c);
    DeviceCache *dc = device_cache(c, device);
    bool tracked = false;
    if (dc) {
      try {
        c->live.emplace(p, ((uint32_t)device << 8) | (uint32_t)cls);
        tracked = true;
      } catch (...) {
      }
    }
    if (tracked) {
      dc->used_bytes += rounded;
      if (dc->used_bytes > dc->peak_bytes) dc->peak_bytes = dc->used_bytes;
      *out = p;
      return TD_OK;
    }
  }
  c->ops.free(c->ops.ctx, device, p); /* cannot track it: give it back */
  return td_set_error(TD_ERR_NOMEM, "cuda alloc: out of host memory");
}

void td__cu_cache_free(td__cu_cache *c, void *p) {
  if (!p) return;
  int dev = 0;
  {
    Guard g(c);
    auto it = c->live.find(p);
    if (it == c->live.end()) TD_PANIC("cuda free: %p was not allocated here", p);
    dev = (int)(it->second >> 8);
    int cls = (int)(it->second & 0xff);
    c->live.erase(it);
    DeviceCache *dc = c->devs[(size_t)dev]; /* exists: the block was allocated through it */
    size_t sz = td__cu_class_size(cls);
    dc->used_bytes -= sz;
    try {
      dc->free_list[cls].push_back(p);
      dc->cached_bytes += sz;
      return;
    } catch (...) {
      /* no host memory to cache the block: give it back to the driver (below, unlocked) */
    }
  }
  c->ops.free(c->ops.ctx, dev, p);
}

td_status td__cu_cache_empty(td__cu_cache *c, int device) {
  size_t ndev;
  {
    Guard g(c);
    ndev = c->devs.size();
  }
  if (device >= 0) {
    empty_device(c, device);
    return TD_OK;
  }
  for (size_t d = 0; d < ndev; d++) empty_device(c, (int)d);
  return TD_OK;
}

void td__cu_cache_stats(td__cu_cache *c, int device, size_t *in_use, size_t *cached) {
  Guard g(c);
  *in_use = *cached = 0;
  if (device < 0 || (size_t)device >= c->devs.size() || !c->devs[(size_t)device]) return;
  *in_use = c->devs[(size_t)device]->used_bytes;
  *cached = c->devs[(size_t)device]->cached_bytes;
}

void td__cu_cache_peak(td__cu_cache *c, int device, bool reset, size_t *peak) {
  Guard g(c);
  size_t v = 0;
  if (device >= 0 && (size_t)device < c->devs.size() && c->devs[(size_t)device]) {
    DeviceCache *dc = c->devs[(size_t)device];
    v = dc->peak_bytes;
    if (reset) dc->peak_bytes = dc->used_bytes;
  }
  if (peak) *peak = v;
}

bool td__cu_cache_locked(td__cu_cache *c) {
  return c->owner.load() == std::this_thread::get_id();
}

} /* extern "C" */
