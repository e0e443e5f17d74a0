/* cpu_backend.c - CPU kernels for memory, copies, elementwise ops, reductions and GEMM, and the
 * CPU backend table.
 *
 * Elementwise kernels walk any strided geometry: dims are first coalesced (adjacent dims that are
 * contiguous in every operand merge), then the innermost dim runs as a tight loop and the outer
 * dims as an odometer. Float32 sums accumulate in double. GEMM goes to OpenBLAS (bfloat16 and
 * float16: cpu_gemm_lowp.c). The 16-bit dtypes run the float32 row functions on chunks converted
 * on the stack (cpu_half.c), so each result is the float32 result rounded once.
 *
 * Lock order: cache.mu (the allocator's cache of freed blocks) is a leaf; kernels take no lock.
 */
#include <cblas.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_math.h"
#include "tensor_impl.h"

/* ---- memory ----
 * Blocks carry a 64-byte header holding their size. Freed blocks of at least CACHE_MIN bytes go
 * to per-size free lists (up to CACHE_BINS sizes and TD_CPU_CACHE_MB, default 256 MiB, in all),
 * so a training loop that allocates the same shapes every step reuses warm pages instead of
 * faulting in freshly mapped memory each time. Smaller blocks go straight back to malloc.
 *
 * Blocks of HUGE_MIN bytes and more are mapped on their own, 2 MiB-aligned, and advised to use
 * transparent huge pages (madvise(MADV_HUGEPAGE); Debian's default THP mode is "madvise"): the
 * first touch of fresh memory then costs one fault per 2 MiB instead of per 4 KiB, and copies
 * through it miss the TLB less. Measured on the 2-vCPU VM (bench/rpc_bandwidth, warm echoes):
 * 64 MiB 4.96 -> 6.4 GB/s, 256 MiB 2.25 -> 4.0, 1 GiB 2.1 -> 4.0. A first touch is fast (memset of
 * a new 256 MiB mapping 0.04 s vs 0.10 s) while the kernel has free huge pages, but when memory
 * is fragmented it compacts first (THP defrag "madvise") and can be slower than 4 KiB pages.
 * TD_CPU_HUGEPAGES=0 turns it off. */

#define HDR 64
#define CACHE_MIN (64u << 10)
#define CACHE_BINS 64
#define HUGE_MIN (4u << 20)
#define HUGE_ALIGN (2u << 20)
#define HUGE_PAGE_HDR 4096u /* the small page before a huge block's data, holding its header */

/* The header of a block: its size, and the free-list link while cached. */
typedef struct blk {
  size_t size;
  struct blk *next;
} blk;

static struct {
  pthread_mutex_t mu;
  size_t sizes[CACHE_BINS];
  blk *heads[CACHE_BINS];
  int counts[CACHE_BINS];
  size_t total, cap;
  bool inited;
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* Bytes handed out (page-rounded block sizes, headers not counted) and their high-water mark,
 * for td_cpu_memory_info: the figure PyTorch calls memory_allocated / max_memory_allocated. */
static size_t mem_in_use, mem_peak;

static void account_alloc(size_t sz) {
  size_t now = __atomic_add_fetch(&mem_in_use, sz, __ATOMIC_RELAXED);
  size_t peak = __atomic_load_n(&mem_peak, __ATOMIC_RELAXED);
  while (now > peak &&
         !__atomic_compare_exchange_n(&mem_peak, &peak, now, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
}

void td_cpu_memory_info(size_t *in_use, size_t *peak, size_t *cached) {
  if (in_use) *in_use = __atomic_load_n(&mem_in_use, __ATOMIC_RELAXED);
  if (peak) *peak = __atomic_load_n(&mem_peak, __ATOMIC_RELAXED);
  if (cached) {
    pthread_mutex_lock(&cache.mu);
    *cached = cache.total;
    pthread_mutex_unlock(&cache.mu);
  }
}

void td_cpu_reset_peak_memory(void) {
  __atomic_store_n(&mem_peak, __atomic_load_n(&mem_in_use, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}

static void cache_init_locked(void) {
  if (cache.inited) return;
  const char *e = getenv("TD_CPU_CACHE_MB");
  long mb = e ? strtol(e, NULL, 10) : 256;
  cache.cap = mb > 0 ? (size_t)mb << 20 : 0;
  cache.inited = true;
}

static bool huge_pages_wanted(void) {
  static int on = -1;
  int v = __atomic_load_n(&on, __ATOMIC_RELAXED);
  if (v < 0) {
    const char *e = getenv("TD_CPU_HUGEPAGES");
    v = !(e && strcmp(e, "0") == 0);
    __atomic_store_n(&on, v, __ATOMIC_RELAXED);
  }
  return v;
}

/* A block of sz bytes (a multiple of 4096) whose data starts on a 2 MiB boundary, advised to
 * use huge pages, with its header at the end of the 4 KiB page just before: the header never
 * spills into a huge page of its own and the tail that does not fill a huge page stays in small
 * pages, so RSS grows by what the data touches (a 4 MiB tensor once cost three huge pages, 6 MiB,
 * when the header sat in front of it). Returns the header, NULL when out of memory. */
static void *huge_map(size_t sz) {
  size_t want = HUGE_PAGE_HDR + sz;
  char *p = mmap(NULL, want + HUGE_ALIGN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (p == MAP_FAILED) return NULL;
  uintptr_t data = ((uintptr_t)p + HUGE_PAGE_HDR + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1);
  char *first = (char *)data - HUGE_PAGE_HDR, *end = (char *)data + sz;
  if (first > p) munmap(p, (size_t)(first - p));
  if (p + want + HUGE_ALIGN > end) munmap(end, (size_t)(p + want + HUGE_ALIGN - end));
#ifdef MADV_HUGEPAGE
  madvise((void *)data, sz, MADV_HUGEPAGE);
#endif
  return (char *)data - HDR;
}

static td_status cpu_alloc(int dev, size_t nbytes, void **out) {
  size_t sz = (nbytes + 4095) / 4096 * 4096;
  if (sz >= CACHE_MIN) {
    pthread_mutex_lock(&cache.mu);
    for (int i = 0; i < CACHE_BINS; i++) {
      if (cache.sizes[i] == sz && cache.heads[i]) {
        blk *b = cache.heads[i];
        cache.heads[i] = b->next;
        cache.counts[i]--;
        cache.total -= sz;
        pthread_mutex_unlock(&cache.mu);
        account_alloc(sz);
        *out = (char *)b + HDR;
        return TD_OK;
      }
    }
    pthread_mutex_unlock(&cache.mu);
  }
  void *p = NULL;
  if (sz >= HUGE_MIN && huge_pages_wanted()) {
    p = huge_map(sz);
    if (!p) return td_set_error(TD_ERR_NOMEM, "cpu: cannot allocate %zu bytes", nbytes);
    ((blk *)p)->size = sz | 1; /* low bit: mapped on its own (sizes are multiples of 4096) */
  } else {
    if (posix_memalign(&p, HDR, sz + HDR) != 0)
      return td_set_error(TD_ERR_NOMEM, "cpu: cannot allocate %zu bytes", nbytes);
    ((blk *)p)->size = sz;
  }
  account_alloc(sz);
  *out = (char *)p + HDR;
  return TD_OK;
}

/* Returns a block to the system. */
static void block_release(char *p) {
  size_t word = ((blk *)p)->size;
  if (word & 1) { /* huge_map's layout: one small page, then the data */
    munmap(p + HDR - HUGE_PAGE_HDR, HUGE_PAGE_HDR + (word & ~(size_t)1));
  } else {
    free(p);
  }
}

static void cpu_free(int dev, void *ptr) {
  if (!ptr) return;
  char *p = (char *)ptr - HDR;
  size_t word = ((blk *)p)->size, sz = word & ~(size_t)1;
  __atomic_sub_fetch(&mem_in_use, sz, __ATOMIC_RELAXED);
  if (sz >= CACHE_MIN) {
    pthread_mutex_lock(&cache.mu);
    cache_init_locked();
    if (cache.total + sz <= cache.cap) {
      int slot = -1;
      for (int i = 0; i < CACHE_BINS; i++) {
        if (cache.sizes[i] == sz) {
          slot = i;
          break;
        }
        if (slot < 0 && cache.counts[i] == 0) slot = i;
      }
      if (slot >= 0) {
        blk *b = (blk *)p;
        cache.sizes[slot] = sz;
        b->size = word; /* keeps how it was allocated */
        b->next = cache.heads[slot];
        cache.heads[slot] = b;
        cache.counts[slot]++;
        cache.total += sz;
        pthread_mutex_unlock(&cache.mu);
        return;
      }
    }
    pthread_mutex_unlock(&cache.mu);
  }
  block_release(p);
}

static td_status cpu_memcpy(int dev, void *dst, const void *src, size_t n) {
  if (n) memcpy(dst, src, n);
  return TD_OK;
}

/* ---- strided iteration ---- */

typedef struct {
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  int64_t st[3][TD_MAX_DIMS]; /* strides of up to three operands */
} geom;

/* Builds a coalesced geometry for n operands of the same shape. */
static void geom_make(geom *g, const td_tensor *const *ops, int n) {
  const td_tensor *t0 = ops[0];
  int nd = 0;
  for (int d = 0; d < t0->ndim; d++) {
    if (t0->shape[d] == 1) continue;
    g->shape[nd] = t0->shape[d];
    for (int k = 0; k < n; k++) g->st[k][nd] = ops[k]->strides[d];
    nd++;
  }
  if (nd == 0) {
    g->shape[0] = 1;
    for (int k = 0; k < n; k++) g->st[k][0] = 1;
    nd = 1;
  }
  /* merge dim d into d+1 (inner) when stride[d] == stride[d+1] * shape[d+1] for all operands */
  int out = nd - 1;
  int64_t shp[TD_MAX_DIMS], str[3][TD_MAX_DIMS];
  shp[out] = g->shape[nd - 1];
  for (int k = 0; k < n; k++) str[k][out] = g->st[k][nd - 1];
  for (int d = nd - 2; d >= 0; d--) {
    bool ok = true;
    for (int k = 0; k < n; k++) ok = ok && g->st[k][d] == str[k][out] * shp[out];
    if (ok) {
      shp[out] *= g->shape[d];
    } else {
      out--;
      shp[out] = g->shape[d];
      for (int k = 0; k < n; k++) str[k][out] = g->st[k][d];
    }
  }
  g->ndim = nd - out;
  for (int d = 0; d < g->ndim; d++) {
    g->shape[d] = shp[out + d];
    for (int k = 0; k < n; k++) g->st[k][d] = str[k][out + d];
  }
}

/* Iterates the outer dims; for each inner row calls body with element offsets. */
#define GEOM_LOOP(g, nops, BODY)                                                 \
  do {                                                                           \
    int64_t idx_[TD_MAX_DIMS] = {0};                                             \
    int64_t off_[3] = {0, 0, 0};                                                 \
    int nd_ = (g)->ndim;                                                         \
    int64_t n_ = (g)->shape[nd_ - 1];                                            \
    int64_t s0_ = (g)->st[0][nd_ - 1], s1_ = (g)->st[1][nd_ - 1],               \
            s2_ = (g)->st[2][nd_ - 1];                                           \
    (void)s1_;                                                                   \
    (void)s2_;                                                                   \
    for (;;) {                                                                   \
      BODY;                                                                      \
      int d_ = nd_ - 2;                                                          \
      for (; d_ >= 0; d_--) {                                                    \
        idx_[d_]++;                                                              \
        for (int k_ = 0; k_ < (nops); k_++) off_[k_] += (g)->st[k_][d_];         \
        if (idx_[d_] < (g)->shape[d_]) break;                                    \
        for (int k_ = 0; k_ < (nops); k_++)                                      \
          off_[k_] -= (g)->st[k_][d_] * (g)->shape[d_];                          \
        idx_[d_] = 0;                                                            \
      }                                                                          \
      if (d_ < 0) break;                                                         \
    }                                                                            \
  } while (0)

static inline char *elem_ptr(const td_tensor *t) { return (char *)td_tensor_data(t); }

/* ---- copy and fill ---- */

/* CONV is the element conversion: a cast, except float -> int64 (td__f2i64). Rows with unit
 * strides on both sides get their own loop, which vectorises (a bias broadcast into a matrix,
 * slices gathered into one gradient). */
#define COPY_ROW(TD, TS, CONV)                                                       \
  TD__CPU_CLONES static void copy_row_##TD##_##TS(TD *d, int64_t sd, const TS *s,    \
                                                  int64_t ss, int64_t n) {           \
    if (sd == 1 && ss == 1) {                                                        \
      for (int64_t i = 0; i < n; i++) d[i] = CONV(s[i]);                             \
      return;                                                                        \
    }                                                                                \
    for (int64_t i = 0; i < n; i++) d[i * sd] = CONV(s[i * ss]);                    \
  }
#define CAST_F(v) ((float)(v))
#define CAST_D(v) ((double)(v))
#define CAST_I(v) ((int64_t)(v))
COPY_ROW(float, float, CAST_F)
COPY_ROW(float, double, CAST_F)
COPY_ROW(float, int64_t, CAST_F)
COPY_ROW(double, float, CAST_D)
COPY_ROW(double, double, CAST_D)
COPY_ROW(double, int64_t, CAST_D)
COPY_ROW(int64_t, float, td__f2i64)
COPY_ROW(int64_t, double, td__f2i64)
COPY_ROW(int64_t, int64_t, CAST_I)
TD__CPU_CLONES static void copy_row_u16(uint16_t *d, int64_t sd, const uint16_t *s, int64_t ss,
                                        int64_t n) {
  if (sd == 1 && ss == 1) {
    memcpy(d, s, (size_t)n * 2);
  } else if (sd == 1 && ss == 0) {
    for (int64_t i = 0; i < n; i++) d[i] = s[0];
  } else {
    for (int64_t i = 0; i < n; i++) d[i * sd] = s[i * ss];
  }
}

/* Copies with a transport dtype (tensor.h) on either side: bytes for equal dtypes (NaN payloads
 * kept), else element by element through double. */
static void copy_transport(const geom *g, char *db, td_dtype dd, const char *sb, td_dtype sd) {
  if (dd == sd) {
    size_t es = td_dtype_size(dd);
    if (es == 2) { /* the 16-bit floats: typed rows (a bias broadcast into a matrix) */
      GEOM_LOOP(g, 2, copy_row_u16((uint16_t *)db + off_[0], s0_, (const uint16_t *)sb + off_[1],
                                   s1_, n_));
      return;
    }
    GEOM_LOOP(g, 2, {
      for (int64_t i = 0; i < n_; i++)
        memcpy(db + (size_t)(off_[0] + i * s0_) * es, sb + (size_t)(off_[1] + i * s1_) * es, es);
    });
    return;
  }
  GEOM_LOOP(g, 2, {
    for (int64_t i = 0; i < n_; i++)
      td__store(db, dd, off_[0] + i * s0_, td__load(sb, sd, off_[1] + i * s1_));
  });
}

static td_status cpu_copy(td_tensor *dst, const td_tensor *src) {
  if (td_tensor_numel(dst) == 0) return TD_OK;
  if (dst->dtype == src->dtype && td_tensor_is_contiguous(dst) && td_tensor_is_contiguous(src)) {
    memmove(td_tensor_data(dst), td_tensor_data(src), td_tensor_nbytes(dst));
    return TD_OK;
  }
  const td_tensor *ops[2] = {dst, src};
  geom g;
  geom_make(&g, ops, 2);
  char *db = elem_ptr(dst);
  const char *sb = elem_ptr(src);
  if (dst->dtype > TD_DTYPE_I64 || src->dtype > TD_DTYPE_I64) {
    size_t de = td_dtype_size(dst->dtype), se = td_dtype_size(src->dtype);
    if (td__half_copy_pair(dst->dtype, src->dtype)) {
      GEOM_LOOP(&g, 2, td__half_copy_row(dst->dtype, db + (size_t)off_[0] * de, s0_, src->dtype,
                                         sb + (size_t)off_[1] * se, s1_, n_));
      return TD_OK;
    }
    copy_transport(&g, db, dst->dtype, sb, src->dtype);
    return TD_OK;
  }
#define COPY_CASE(TD, TS)                                                                \
  GEOM_LOOP(&g, 2, copy_row_##TD##_##TS((TD *)db + off_[0], s0_, (const TS *)sb + off_[1], \
                                        s1_, n_))
  int key = (int)dst->dtype * 3 + (int)src->dtype;
  switch (key) {
    case 0: COPY_CASE(float, float); break;
    case 1: COPY_CASE(float, double); break;
    case 2: COPY_CASE(float, int64_t); break;
    case 3: COPY_CASE(double, float); break;
    case 4: COPY_CASE(double, double); break;
    case 5: COPY_CASE(double, int64_t); break;
    case 6: COPY_CASE(int64_t, float); break;
    case 7: COPY_CASE(int64_t, double); break;
    case 8: COPY_CASE(int64_t, int64_t); break;
  }
#undef COPY_CASE
  return TD_OK;
}

static td_status cpu_fill(td_tensor *t, double v) {
  if (td_tensor_numel(t) == 0) return TD_OK;
  const td_tensor *ops[1] = {t};
  geom g;
  geom_make(&g, ops, 1);
  char *b = elem_ptr(t);
  switch (t->dtype) {
    case TD_DTYPE_F32: {
      float fv = (float)v;
      GEOM_LOOP(&g, 1, {
        float *p = (float *)b + off_[0];
        for (int64_t i = 0; i < n_; i++) p[i * s0_] = fv;
      });
      break;
    }
    case TD_DTYPE_F64:
      GEOM_LOOP(&g, 1, {
        double *p = (double *)b + off_[0];
        for (int64_t i = 0; i < n_; i++) p[i * s0_] = v;
      });
      break;
    case TD_DTYPE_I64: {
      int64_t iv = td__f2i64(v);
      GEOM_LOOP(&g, 1, {
        int64_t *p = (int64_t *)b + off_[0];
        for (int64_t i = 0; i < n_; i++) p[i * s0_] = iv;
      });
      break;
    }
    default: { /* transport dtypes: convert once, then copy the element's bytes */
      char one[8];
      size_t es = td_dtype_size(t->dtype);
      td__store(one, t->dtype, 0, v);
      GEOM_LOOP(&g, 1, {
        for (int64_t i = 0; i < n_; i++) memcpy(b + (size_t)(off_[0] + i * s0_) * es, one, es);
      });
      break;
    }
  }
  return TD_OK;
}

/* ---- binary ---- */

#define BIN_ROW(T, NAME, EXPR)                                                              \
  TD__CPU_CLONES static void NAME##_##T(T *o, int64_t so, const T *a, int64_t sa, const T *b, \
                                        int64_t sb, int64_t n) {                            \
    if (so == 1 && sa == 1 && sb == 1) {                                                    \
      for (int64_t i = 0; i < n; i++) {                                                     \
        T x = a[i], y = b[i];                                                               \
        o[i] = (EXPR);                                                                      \
      }                                                                                     \
    } else if (so == 1 && sa == 1 && sb == 0) {                                             \
      T y = b[0];                                                                           \
      for (int64_t i = 0; i < n; i++) {                                                     \
        T x = a[i];                                                                         \
        o[i] = (EXPR);                                                                      \
      }                                                                                     \
    } else {                                                                                \
      for (int64_t i = 0; i < n; i++) {                                                     \
        T x = a[i * sa], y = b[i * sb];                                                     \
        o[i * so] = (EXPR);                                                                 \
      }                                                                                     \
    }                                                                                       \
  }

#define BIN_ALL(T)                                  \
  BIN_ROW(T, b_add, x + y)                          \
  BIN_ROW(T, b_sub, x - y)                          \
  BIN_ROW(T, b_mul, x * y)                          \
  BIN_ROW(T, b_div, x / y)                          \
  BIN_ROW(T, b_max, (x > y || x != x) ? x : y)      \
  BIN_ROW(T, b_min, (x < y || x != x) ? x : y)      \
  BIN_ROW(T, b_eq, (T)(x == y))                     \
  BIN_ROW(T, b_gt, (T)(x > y))
BIN_ALL(float)
BIN_ALL(double)
BIN_ALL(int64_t)

typedef void (*bin_row_f)(void *, int64_t, const void *, int64_t, const void *, int64_t, int64_t);

#define BIN_TABLE(T)                                                                    \
  {(bin_row_f)b_add_##T, (bin_row_f)b_sub_##T, (bin_row_f)b_mul_##T, (bin_row_f)b_div_##T, \
   (bin_row_f)b_max_##T, (bin_row_f)b_min_##T, (bin_row_f)b_eq_##T, (bin_row_f)b_gt_##T}
static const bin_row_f bin_rows[3][8] = {BIN_TABLE(float), BIN_TABLE(double), BIN_TABLE(int64_t)};

/* One strided row of a 16-bit binary op: chunks of both operands are converted to float32 (a
 * broadcast operand, stride 0, once per chunk), the float32 row function runs, the result is
 * rounded back. out may alias a or b: each chunk is read before it is written. */
static void half_bin_row(bin_row_f f, td_dtype dt, uint16_t *o, int64_t so, const uint16_t *a,
                         int64_t sa, const uint16_t *b, int64_t sb, int64_t n) {
  float fa[TD__HALF_CHUNK], fb[TD__HALF_CHUNK], fo[TD__HALF_CHUNK];
  for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
    int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
    td__half_load(dt, fa, a + i0 * sa, sa, sa ? m : 1);
    td__half_load(dt, fb, b + i0 * sb, sb, sb ? m : 1);
    f(fo, 1, fa, sa ? 1 : 0, fb, sb ? 1 : 0, m);
    td__half_store(dt, o + i0 * so, so, fo, m);
  }
}

static td_status cpu_binary(td__binary_op op, const td_tensor *a, const td_tensor *b,
                            td_tensor *out) {
  if (td_tensor_numel(out) == 0) return TD_OK;
  if (out->dtype == TD_DTYPE_I64 && op == TD__BIN_DIV) {
    /* integer division by zero is undefined behaviour in C: reject it up front */
    const td_tensor *ops2[1] = {b};
    geom gb;
    geom_make(&gb, ops2, 1);
    const int64_t *bb = (const int64_t *)elem_ptr(b);
    bool zero = false;
    GEOM_LOOP(&gb, 1, {
      for (int64_t i = 0; i < n_; i++) zero = zero || bb[off_[0] + i * s0_] == 0;
    });
    if (zero) return td_set_error(TD_ERR_INVALID, "div: integer division by zero");
  }
  const td_tensor *ops[3] = {out, a, b};
  geom g;
  geom_make(&g, ops, 3);
  if (td__dtype_is_half(out->dtype)) {
    td_dtype dt = out->dtype;
    uint16_t *ob = (uint16_t *)elem_ptr(out);
    const uint16_t *ab = (const uint16_t *)elem_ptr(a), *bb = (const uint16_t *)elem_ptr(b);
    GEOM_LOOP(&g, 3, half_bin_row(bin_rows[0][op], dt, ob + off_[0], s0_, ab + off_[1], s1_,
                                  bb + off_[2], s2_, n_));
    return TD_OK;
  }
  bin_row_f f = bin_rows[out->dtype][op];
  size_t es = td_dtype_size(out->dtype);
  char *ob = elem_ptr(out);
  const char *ab = elem_ptr(a), *bb = elem_ptr(b);
  GEOM_LOOP(&g, 3, f(ob + off_[0] * (int64_t)es, s0_, ab + off_[1] * (int64_t)es, s1_,
                     bb + off_[2] * (int64_t)es, s2_, n_));
  return TD_OK;
}

/* ---- unary ---- */

/* GELU (exact, erf form) per element type: float32 through the vectorisable td__erff (PyTorch's
 * own float approximation), float64 through libm. */
static inline __attribute__((always_inline)) float gelu_float(float x) {
  return 0.5f * x * (1.0f + td__erff(x * (float)M_SQRT1_2));
}
static inline __attribute__((always_inline)) double gelu_double(double x) {
  return 0.5 * x * (1.0 + erf(x * M_SQRT1_2));
}
/* Its derivative: Phi(x) + x phi(x). */
static inline __attribute__((always_inline)) float gelu_grad_float(float x) {
  float cdf = 0.5f * (1.0f + td__erff(x * (float)M_SQRT1_2));
  float pdf = td__expf(-0.5f * x * x) * 0.3989422804014327f;
  return cdf + x * pdf;
}
static inline __attribute__((always_inline)) double gelu_grad_double(double x) {
  double cdf = 0.5 * (1.0 + erf(x * M_SQRT1_2));
  double pdf = exp(-0.5 * x * x) * 0.3989422804014327;
  return cdf + x * pdf;
}
static inline double sigmoid_d(double x) {
  return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

#define UN_ROW(T)                                                                            \
  static inline __attribute__((always_inline)) void un_row_##T(                               \
      td__unary_op op, T *o, int64_t so, const T *x, int64_t sx, int64_t n,                   \
                         double p0, double p1) {                                              \
    switch (op) {                                                                            \
      case TD__UN_AFFINE: {                                                                  \
        T a = (T)p0, b = (T)p1;                                                              \
        for (int64_t i = 0; i < n; i++) o[i * so] = a * x[i * sx] + b;                       \
        break;                                                                               \
      }                                                                                      \
      case TD__UN_POW:                                                                       \
        if (p0 == 2.0)                                                                       \
          for (int64_t i = 0; i < n; i++) o[i * so] = x[i * sx] * x[i * sx];                 \
        else                                                                                 \
          for (int64_t i = 0; i < n; i++) o[i * so] = (T)pow((double)x[i * sx], p0);         \
        break;                                                                               \
      case TD__UN_EXP:                                                                       \
        for (int64_t i = 0; i < n; i++) o[i * so] = (T)exp((double)x[i * sx]);               \
        break;                                                                               \
      case TD__UN_LOG:                                                                       \
        for (int64_t i = 0; i < n; i++) o[i * so] = (T)log((double)x[i * sx]);               \
        break;                                                                               \
      case TD__UN_SQRT:                                                                      \
        for (int64_t i = 0; i < n; i++) o[i * so] = (T)sqrt((double)x[i * sx]);              \
        break;                                                                               \
      case TD__UN_TANH:                                                                      \
        for (int64_t i = 0; i < n; i++) o[i * so] = (T)tanh((double)x[i * sx]);              \
        break;                                                                               \
      case TD__UN_SIGMOID:                                                                   \
        for (int64_t i = 0; i < n; i++) o[i * so] = (T)sigmoid_d((double)x[i * sx]);         \
        break;                                                                               \
      case TD__UN_RELU:                                                                      \
        for (int64_t i = 0; i < n; i++) o[i * so] = x[i * sx] > 0 ? x[i * sx] : (T)0;        \
        break;                                                                               \
      case TD__UN_GELU:                                                                      \
        for (int64_t i = 0; i < n; i++) o[i * so] = gelu_##T(x[i * sx]);                      \
        break;                                                                               \
      case TD__UN_ABS:                                                                       \
        for (int64_t i = 0; i < n; i++) o[i * so] = x[i * sx] < 0 ? -x[i * sx] : x[i * sx];  \
        break;                                                                               \
    }                                                                                        \
  }
UN_ROW(float)
UN_ROW(double)

/* Contiguous rows get their own instantiation so the loops vectorize (per ISA level). */
TD__CPU_CLONES static void un_row_float_any(td__unary_op op, float *o, int64_t so,
                                            const float *x, int64_t sx, int64_t n, double p0,
                                            double p1) {
  if (so == 1 && sx == 1) un_row_float(op, o, 1, x, 1, n, p0, p1);
  else un_row_float(op, o, so, x, sx, n, p0, p1);
}
static void un_row_double_any(td__unary_op op, double *o, int64_t so, const double *x,
                              int64_t sx, int64_t n, double p0, double p1) {
  if (so == 1 && sx == 1) un_row_double(op, o, 1, x, 1, n, p0, p1);
  else un_row_double(op, o, so, x, sx, n, p0, p1);
}

static td_status cpu_unary(td__unary_op op, const td_tensor *x, td_tensor *out, double p0,
                           double p1) {
  if (td_tensor_numel(out) == 0) return TD_OK;
  const td_tensor *ops[2] = {out, x};
  geom g;
  geom_make(&g, ops, 2);
  char *ob = elem_ptr(out);
  const char *xb = elem_ptr(x);
  switch (out->dtype) {
    case TD_DTYPE_F32:
      GEOM_LOOP(&g, 2, un_row_float_any(op, (float *)ob + off_[0], s0_,
                                        (const float *)xb + off_[1], s1_, n_, p0, p1));
      break;
    case TD_DTYPE_F64:
      GEOM_LOOP(&g, 2, un_row_double_any(op, (double *)ob + off_[0], s0_,
                                         (const double *)xb + off_[1], s1_, n_, p0, p1));
      break;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: {
      float fx[TD__HALF_CHUNK], fo[TD__HALF_CHUNK];
      td_dtype dt = out->dtype;
      GEOM_LOOP(&g, 2, {
        uint16_t *o = (uint16_t *)ob + off_[0];
        const uint16_t *xi = (const uint16_t *)xb + off_[1];
        for (int64_t i0 = 0; i0 < n_; i0 += TD__HALF_CHUNK) {
          int64_t m = n_ - i0 < TD__HALF_CHUNK ? n_ - i0 : TD__HALF_CHUNK;
          td__half_load(dt, fx, xi + i0 * s1_, s1_, m);
          un_row_float_any(op, fo, 1, fx, 1, m, p0, p1);
          td__half_store(dt, o + i0 * s0_, s0_, fo, m);
        }
      });
      break;
    }
    case TD_DTYPE_I64:
      if (op == TD__UN_AFFINE && p0 == (double)(int64_t)p0 && p1 == (double)(int64_t)p1) {
        int64_t a = (int64_t)p0, b = (int64_t)p1;
        GEOM_LOOP(&g, 2, {
          int64_t *o = (int64_t *)ob + off_[0];
          const int64_t *xi = (const int64_t *)xb + off_[1];
          for (int64_t i = 0; i < n_; i++) o[i * s0_] = a * xi[i * s1_] + b;
        });
        break;
      }
      return td_set_error(TD_ERR_DTYPE, "unary op on int64 tensors is not supported");
    default: /* transport dtypes: the ops refuse them before (td__check_compute) */
      return td_set_error(TD_ERR_DTYPE, "unary op on %s tensors is not supported",
                          td_dtype_name(out->dtype));
  }
  return TD_OK;
}

#define UNB(T)                                                                                 \
  TD__CPU_CLONES static void unb_##T(td__unary_op op, const T *restrict x,                     \
                                     const T *restrict y, const T *restrict gy,                \
                                     T *restrict gx, int64_t n, double p0) {                   \
    switch (op) {                                                                              \
      case TD__UN_AFFINE:                                                                      \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * (T)p0;                                 \
        break;                                                                                 \
      case TD__UN_POW:                                                                         \
        for (int64_t i = 0; i < n; i++)                                                        \
          gx[i] = (T)((double)gy[i] * p0 *                                                     \
                      (p0 == 2.0 ? (double)x[i] : pow((double)x[i], p0 - 1.0)));               \
        break;                                                                                 \
      case TD__UN_EXP:                                                                         \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * y[i];                                  \
        break;                                                                                 \
      case TD__UN_LOG:                                                                         \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] / x[i];                                  \
        break;                                                                                 \
      case TD__UN_SQRT:                                                                        \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * (T)0.5 / y[i];                         \
        break;                                                                                 \
      case TD__UN_TANH:                                                                        \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * ((T)1 - y[i] * y[i]);                  \
        break;                                                                                 \
      case TD__UN_SIGMOID:                                                                     \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * y[i] * ((T)1 - y[i]);                  \
        break;                                                                                 \
      case TD__UN_RELU: /* mask multiply, the mask in a variable first, or gcc keeps a branch \
                         * and does not vectorize (differs from a select only for a non-finite \
                         * gradient where x <= 0) */                                          \
        for (int64_t i = 0; i < n; i++) {                                                      \
          T m_ = x[i] > 0;                                                                     \
          gx[i] = gy[i] * m_;                                                                  \
        }                                                                                      \
        break;                                                                                 \
      case TD__UN_GELU:                                                                        \
        for (int64_t i = 0; i < n; i++) gx[i] = gy[i] * gelu_grad_##T(x[i]);                   \
        break;                                                                                 \
      case TD__UN_ABS:                                                                         \
        for (int64_t i = 0; i < n; i++)                                                        \
          gx[i] = x[i] > 0 ? gy[i] : (x[i] < 0 ? -gy[i] : (T)0);                               \
        break;                                                                                 \
    }                                                                                          \
  }
UNB(float)
UNB(double)

static td_status cpu_unary_backward(td__unary_op op, const td_tensor *x, const td_tensor *y,
                                    const td_tensor *gy, td_tensor *gx, double p0, double p1) {
  int64_t n = td_tensor_numel(gx);
  const void *xp = x ? td_tensor_data(x) : NULL, *yp = y ? td_tensor_data(y) : NULL;
  if (gx->dtype == TD_DTYPE_F32)
    unb_float(op, xp, yp, td_tensor_data(gy), td_tensor_data(gx), n, p0);
  else if (gx->dtype == TD_DTYPE_F64)
    unb_double(op, xp, yp, td_tensor_data(gy), td_tensor_data(gx), n, p0);
  else if (td__dtype_is_half(gx->dtype)) {
    float fx[TD__HALF_CHUNK], fy[TD__HALF_CHUNK], fg[TD__HALF_CHUNK], fo[TD__HALF_CHUNK];
    td_dtype dt = gx->dtype;
    const uint16_t *x16 = xp, *y16 = yp, *g16 = td_tensor_data(gy);
    uint16_t *o16 = td_tensor_data(gx);
    for (int64_t i0 = 0; i0 < n; i0 += TD__HALF_CHUNK) {
      int64_t m = n - i0 < TD__HALF_CHUNK ? n - i0 : TD__HALF_CHUNK;
      if (x16) td__half_load(dt, fx, x16 + i0, 1, m);
      if (y16) td__half_load(dt, fy, y16 + i0, 1, m);
      td__half_load(dt, fg, g16 + i0, 1, m);
      unb_float(op, x16 ? fx : NULL, y16 ? fy : NULL, fg, fo, m, p0);
      td__half_store(dt, o16 + i0, 1, fo, m);
    }
  } else
    return td_set_error(TD_ERR_DTYPE, "unary backward on int64");
  return TD_OK;
}

/* ---- reductions ---- */

#define RSUM(T)                                                                               \
  TD__CPU_CLONES static void rsum_##T(const T *x, int64_t outer, int64_t r, int64_t inner,    \
                                      T *out, double *acc) {                                  \
    for (int64_t o = 0; o < outer; o++) {                                                     \
      const T *xo = x + o * r * inner;                                                        \
      if (inner == 1) {                                                                       \
        double s = 0;                                                                         \
        for (int64_t k = 0; k < r; k++) s += xo[k];                                           \
        out[o] = (T)s;                                                                        \
        continue;                                                                             \
      }                                                                                       \
      for (int64_t i = 0; i < inner; i++) acc[i] = 0;                                         \
      for (int64_t k = 0; k < r; k++) {                                                       \
        const T *row = xo + k * inner;                                                        \
        for (int64_t i = 0; i < inner; i++) acc[i] += row[i];                                 \
      }                                                                                       \
      for (int64_t i = 0; i < inner; i++) out[o * inner + i] = (T)acc[i];                     \
    }                                                                                         \
  }
RSUM(float)
RSUM(double)

/* Sums of 16-bit elements: chunks converted to float32, accumulated in double like float32's. */
TD__CPU_CLONES static void acc_row(double *restrict acc, const float *restrict f, int64_t m) {
  for (int64_t i = 0; i < m; i++) acc[i] += f[i];
}
static void rsum_half(td_dtype dt, const uint16_t *x, int64_t outer, int64_t r, int64_t inner,
                      uint16_t *out, double *acc) {
  float f[TD__HALF_CHUNK];
  for (int64_t o = 0; o < outer; o++) {
    const uint16_t *xo = x + o * r * inner;
    if (inner == 1) {
      double s = 0;
      for (int64_t k0 = 0; k0 < r; k0 += TD__HALF_CHUNK) {
        int64_t m = r - k0 < TD__HALF_CHUNK ? r - k0 : TD__HALF_CHUNK;
        td__half_load(dt, f, xo + k0, 1, m);
        for (int64_t i = 0; i < m; i++) s += f[i];
      }
      float fs = (float)s;
      td__half_store(dt, out + o, 1, &fs, 1);
      continue;
    }
    for (int64_t i = 0; i < inner; i++) acc[i] = 0;
    for (int64_t k = 0; k < r; k++)
      for (int64_t i0 = 0; i0 < inner; i0 += TD__HALF_CHUNK) {
        int64_t m = inner - i0 < TD__HALF_CHUNK ? inner - i0 : TD__HALF_CHUNK;
        td__half_load(dt, f, xo + k * inner + i0, 1, m);
        acc_row(acc + i0, f, m);
      }
    for (int64_t i0 = 0; i0 < inner; i0 += TD__HALF_CHUNK) {
      int64_t m = inner - i0 < TD__HALF_CHUNK ? inner - i0 : TD__HALF_CHUNK;
      for (int64_t i = 0; i < m; i++) f[i] = (float)acc[i0 + i];
      td__half_store(dt, out + o * inner + i0, 1, f, m);
    }
  }
}

static td_status cpu_reduce_sum(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                                td_tensor *out) {
  if (x->dtype == TD_DTYPE_I64) {
    const int64_t *xp = td_tensor_data(x);
    int64_t *op = td_tensor_data(out);
    for (int64_t o = 0; o < outer; o++)
      for (int64_t i = 0; i < inner; i++) {
        int64_t s = 0;
        for (int64_t k = 0; k < r; k++) s += xp[(o * r + k) * inner + i];
        op[o * inner + i] = s;
      }
    return TD_OK;
  }
  double *acc = td__malloc((size_t)(inner > 0 ? inner : 1) * sizeof(double));
  if (!acc) return td_set_error(TD_ERR_NOMEM, "sum: out of memory");
  if (td__dtype_is_half(x->dtype))
    rsum_half(x->dtype, td_tensor_data(x), outer, r, inner, td_tensor_data(out), acc);
  else if (x->dtype == TD_DTYPE_F32)
    rsum_float(td_tensor_data(x), outer, r, inner, td_tensor_data(out), acc);
  else
    rsum_double(td_tensor_data(x), outer, r, inner, td_tensor_data(out), acc);
  td__free(acc);
  return TD_OK;
}

static td_status cpu_reduce_max(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                                td_tensor *out, td_tensor *idx) {
  const void *xp = td_tensor_data(x);
  void *op = td_tensor_data(out);
  int64_t *ip = idx ? td_tensor_data(idx) : NULL;
  td_dtype dt = x->dtype;
  if (dt == TD_DTYPE_I64) { /* exact: int64 values do not all fit a double */
    const int64_t *xi = xp;
    for (int64_t o = 0; o < outer; o++)
      for (int64_t i = 0; i < inner; i++) {
        int64_t base = o * r * inner + i, best = xi[base], bi = 0;
        for (int64_t k = 1; k < r; k++)
          if (xi[base + k * inner] > best) best = xi[base + k * inner], bi = k;
        ((int64_t *)op)[o * inner + i] = best;
        if (ip) ip[o * inner + i] = bi;
      }
    return TD_OK;
  }
  for (int64_t o = 0; o < outer; o++)
    for (int64_t i = 0; i < inner; i++) {
      int64_t base = o * r * inner + i;
      double best = td__load(xp, dt, base);
      int64_t bi = 0;
      for (int64_t k = 1; k < r; k++) {
        double v = td__load(xp, dt, base + k * inner);
        if (v > best || (v != v && best == best)) {
          best = v;
          bi = k;
        }
      }
      td__store(op, dt, o * inner + i, best);
      if (ip) ip[o * inner + i] = bi;
    }
  return TD_OK;
}

/* ---- GEMM ---- */

static td_status cpu_gemm(td_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                          double alpha, const void *a, int64_t sa, const void *b, int64_t sb,
                          double beta, void *c, int64_t sc, int64_t batch) {
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return td_set_error(TD_ERR_INVALID, "matmul: dimension too large for BLAS");
  if (td__dtype_is_half(dt))
    return td__cpu_gemm_lowp(dt, ta, tb, m, n, k, alpha, a, sa, b, sb, beta, c, sc, batch);
  int lda = (int)(ta ? m : k), ldb = (int)(tb ? k : n), ldc = (int)n;
  if (m == 0 || n == 0) return TD_OK;
  for (int64_t i = 0; i < batch; i++) {
    if (dt == TD_DTYPE_F32) {
      if (k == 0) {
        float *cp = (float *)c + i * sc;
        for (int64_t j = 0; j < m * n; j++) cp[j] = beta == 0 ? 0.f : (float)beta * cp[j];
        continue;
      }
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  (int)m, (int)n, (int)k, (float)alpha, (const float *)a + i * sa, lda,
                  (const float *)b + i * sb, ldb, (float)beta, (float *)c + i * sc, ldc);
    } else if (dt == TD_DTYPE_F64) {
      if (k == 0) {
        double *cp = (double *)c + i * sc;
        for (int64_t j = 0; j < m * n; j++) cp[j] = beta == 0 ? 0. : beta * cp[j];
        continue;
      }
      cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  (int)m, (int)n, (int)k, alpha, (const double *)a + i * sa, lda,
                  (const double *)b + i * sb, ldb, beta, (double *)c + i * sc, ldc);
    } else {
      return td_set_error(TD_ERR_DTYPE, "matmul: int64 is not supported");
    }
  }
  return TD_OK;
}

/* ---- axpy ---- */

static td_status cpu_axpy(td_tensor *y, double alpha, const td_tensor *x) {
  int64_t n = td_tensor_numel(y);
  if (n == 0) return TD_OK;
  if (y->dtype == TD_DTYPE_I64) return td_set_error(TD_ERR_DTYPE, "axpy: int64 is not supported");
  if (td__dtype_is_half(y->dtype)) { /* y + alpha x as float32 chunks, rounded once */
    const td_tensor *ops[2] = {y, x};
    geom g;
    geom_make(&g, ops, 2);
    uint16_t *yb = td_tensor_data(y);
    const uint16_t *xb = td_tensor_data(x);
    float fy[TD__HALF_CHUNK], fx[TD__HALF_CHUNK], a = (float)alpha;
    td_dtype dt = y->dtype;
    GEOM_LOOP(&g, 2, {
      for (int64_t i0 = 0; i0 < n_; i0 += TD__HALF_CHUNK) {
        int64_t m = n_ - i0 < TD__HALF_CHUNK ? n_ - i0 : TD__HALF_CHUNK;
        td__half_load(dt, fy, yb + off_[0] + i0 * s0_, s0_, m);
        td__half_load(dt, fx, xb + off_[1] + i0 * s1_, s1_, m);
        for (int64_t i = 0; i < m; i++) fy[i] += a * fx[i];
        td__half_store(dt, yb + off_[0] + i0 * s0_, s0_, fy, m);
      }
    });
    return TD_OK;
  }
  if (td_tensor_is_contiguous(y) && td_tensor_is_contiguous(x) && n <= INT32_MAX) {
    if (y->dtype == TD_DTYPE_F32)
      cblas_saxpy((int)n, (float)alpha, td_tensor_data(x), 1, td_tensor_data(y), 1);
    else
      cblas_daxpy((int)n, alpha, td_tensor_data(x), 1, td_tensor_data(y), 1);
    return TD_OK;
  }
  const td_tensor *ops[2] = {y, x};
  geom g;
  geom_make(&g, ops, 2);
  char *yb = elem_ptr(y);
  const char *xb = elem_ptr(x);
  if (y->dtype == TD_DTYPE_F32) {
    float a = (float)alpha;
    GEOM_LOOP(&g, 2, {
      float *yp = (float *)yb + off_[0];
      const float *xp = (const float *)xb + off_[1];
      for (int64_t i = 0; i < n_; i++) yp[i * s0_] += a * xp[i * s1_];
    });
  } else {
    GEOM_LOOP(&g, 2, {
      double *yp = (double *)yb + off_[0];
      const double *xp = (const double *)xb + off_[1];
      for (int64_t i = 0; i < n_; i++) yp[i * s0_] += alpha * xp[i * s1_];
    });
  }
  return TD_OK;
}

const td__backend td__cpu_backend = {
    .name = "cpu",
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_h2d = cpu_memcpy,
    .copy_d2h = cpu_memcpy,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .binary = cpu_binary,
    .unary = cpu_unary,
    .unary_backward = cpu_unary_backward,
    .reduce_sum = cpu_reduce_sum,
    .reduce_max = cpu_reduce_max,
    .gemm = cpu_gemm,
    .softmax = td__cpu_softmax,
    .softmax_backward = td__cpu_softmax_backward,
    .nll = td__cpu_nll,
    .nll_backward = td__cpu_nll_backward,
    .im2col = td__cpu_im2col,
    .col2im = td__cpu_col2im,
    .max_pool2d = td__cpu_max_pool2d,
    .max_pool2d_backward = td__cpu_max_pool2d_backward,
    .index_select = td__cpu_index_select,
    .index_add = td__cpu_index_add,
    .layer_norm = td__cpu_layer_norm,
    .layer_norm_backward = td__cpu_layer_norm_backward,
    .axpy = cpu_axpy,
    .attention = td__cpu_attention,
    .attention_backward = td__cpu_attention_backward,
    .adam = td__cpu_adam,
};
