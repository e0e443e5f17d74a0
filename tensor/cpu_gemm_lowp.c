/* cpu_gemm_lowp.c - GEMM of bfloat16 and float16 matrices on the CPU.
 *
 * Which kernel, and why: products of 16-bit operands accumulate in float32 and the result is
 * rounded once to the output dtype (what torch.autocast's matmul gives). OpenBLAS (the float32
 * and float64 GEMM here) has no bfloat16 GEMM in Debian's build; oneDNN's matmul does, with
 * AVX512-BF16 instructions where the CPU has them (vdpbf16ps: two bfloat16 products per float32
 * lane), and it is the library PyTorch's CPU autocast uses underneath, so writing our own blocked
 * bfloat16 kernel would at best match it. Measured on this project's 2-vCPU AVX512-BF16 VM, one
 * thread, the GPT example's shapes (768 x 384 x 128 ... 768 x 128 x 512): oneDNN bfloat16 200-370
 * GFLOP/s against OpenBLAS sgemm's 60-66, i.e. 4-6x. So:
 *   - bfloat16 with oneDNN in the build (TD_HAVE_DNNL): one matmul primitive per shape, cached
 *     per thread (creation costs 0.5-5 ms; execution of a cached one a few microseconds of
 *     overhead); beta = 1 becomes a sum post-op; batches are a 3-d matmul with the batch strides
 *     given (stride 0: a broadcast operand, batch dim 1);
 *   - otherwise (no oneDNN, float16, a shape oneDNN refuses, alpha != 1, beta not 0 or 1): each
 *     batch entry's operands converted to float32, OpenBLAS sgemm, the result rounded back.
 * oneDNN runs on OpenMP; its team is kept at OpenBLAS's thread count (openblas_get_num_threads),
 * the one knob the examples set (--threads), so both libraries use the same cores. A process that
 * forks after running oneDNN with more than one thread may hang in the child (GNU OpenMP's pool
 * does not survive fork); with one thread no pool exists.
 *
 * THREAD SAFETY: any thread; the primitive cache is per thread (a pthread key frees it when the
 * thread ends).
 */
#include <cblas.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"

/* ---- fallback: float32 copies through sgemm ---- */

static td_status gemm_via_f32(td_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                              double alpha, const uint16_t *a, int64_t sa, const uint16_t *b,
                              int64_t sb, double beta, uint16_t *c, int64_t sc, int64_t batch) {
  float *fa = NULL, *fb = NULL, *fc = NULL;
  td_status st = td__cpu_half_buffer(dt, NULL, m * k, &fa);
  if (st == TD_OK) st = td__cpu_half_buffer(dt, NULL, k * n, &fb);
  if (st == TD_OK) st = td__cpu_half_buffer(dt, NULL, m * n, &fc);
  if (st != TD_OK) goto out;
  int lda = (int)(ta ? m : k), ldb = (int)(tb ? k : n), ldc = (int)n;
  for (int64_t i = 0; i < batch; i++) {
    if ((i == 0 || sa) && k) td__half_load(dt, fa, a + i * sa, 1, m * k);
    if ((i == 0 || sb) && k) td__half_load(dt, fb, b + i * sb, 1, k * n);
    if (beta != 0) td__half_load(dt, fc, c + i * sc, 1, m * n);
    if (k == 0) {
      for (int64_t j = 0; j < m * n; j++) fc[j] = beta == 0 ? 0.f : (float)beta * fc[j];
    } else {
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                  (int)m, (int)n, (int)k, (float)alpha, fa, lda, fb, ldb, (float)beta, fc, ldc);
    }
    td__half_store(dt, c + i * sc, 1, fc, m * n);
  }
out:
  td__free(fa);
  td__free(fb);
  td__free(fc);
  return st;
}

#ifdef TD_HAVE_DNNL
#include <dnnl.h>

/* OpenMP's per-thread team size (libgomp, which oneDNN links). */
extern void omp_set_num_threads(int n);
extern int omp_get_max_threads(void);

#define CACHE_SLOTS 64

typedef struct {
  bool used, ok; /* ok false: oneDNN refused this shape; use the fallback */
  bool ta, tb, accumulate;
  int64_t m, n, k, sa, sb, sc, batch;
  uint64_t last_use;
  dnnl_primitive_t prim;
  dnnl_memory_t ma, mb, mc;
} entry;

typedef struct {
  dnnl_engine_t engine;
  dnnl_stream_t stream;
  entry e[CACHE_SLOTS];
  uint64_t clock;
} tcache;

static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;

static void entry_clear(entry *e) {
  if (e->prim) dnnl_primitive_destroy(e->prim);
  if (e->ma) dnnl_memory_destroy(e->ma);
  if (e->mb) dnnl_memory_destroy(e->mb);
  if (e->mc) dnnl_memory_destroy(e->mc);
  memset(e, 0, sizeof *e);
}

static void tcache_free(void *p) {
  tcache *tc = p;
  if (!tc) return;
  for (int i = 0; i < CACHE_SLOTS; i++) entry_clear(&tc->e[i]);
  if (tc->stream) dnnl_stream_destroy(tc->stream);
  if (tc->engine) dnnl_engine_destroy(tc->engine);
  td__free(tc);
}

static void cache_key_init(void) { (void)pthread_key_create(&cache_key, tcache_free); }

static tcache *tcache_get(void) {
  pthread_once(&cache_once, cache_key_init);
  tcache *tc = pthread_getspecific(cache_key);
  if (tc) return tc->engine ? tc : NULL;
  tc = td__calloc(1, sizeof *tc);
  if (!tc) return NULL;
  if (dnnl_engine_create(&tc->engine, dnnl_cpu, 0) != dnnl_success ||
      dnnl_stream_create(&tc->stream, tc->engine, dnnl_stream_default_flags) != dnnl_success) {
    if (tc->engine) dnnl_engine_destroy(tc->engine);
    tc->engine = NULL; /* remembered: this thread uses the fallback */
  }
  pthread_setspecific(cache_key, tc);
  return tc->engine ? tc : NULL;
}

/* Descriptor of a batch of [r, c] matrices, each row-major ([r, c], trans false) or stored as
 * its transpose ([c, r] row-major, trans true), bstride elements apart (0: one broadcast). */
static dnnl_status_t desc(dnnl_memory_desc_t *d, int64_t batch, int64_t r, int64_t c, bool trans,
                          int64_t bstride) {
  dnnl_dims_t dims = {bstride || batch == 1 ? batch : 1, r, c};
  dnnl_dims_t strides = {bstride ? bstride : r * c, trans ? 1 : c, trans ? r : 1};
  return dnnl_memory_desc_init_by_strides(d, 3, dims, dnnl_bf16, strides);
}

static bool entry_build(tcache *tc, entry *e) {
  dnnl_memory_desc_t da, db, dc;
  dnnl_matmul_desc_t md;
  dnnl_primitive_attr_t attr = NULL;
  dnnl_post_ops_t po = NULL;
  dnnl_primitive_desc_t pd = NULL;
  bool ok = desc(&da, e->batch, e->m, e->k, e->ta, e->sa) == dnnl_success &&
            desc(&db, e->batch, e->k, e->n, e->tb, e->sb) == dnnl_success &&
            desc(&dc, e->batch, e->m, e->n, false, e->sc ? e->sc : e->m * e->n) == dnnl_success &&
            dnnl_matmul_desc_init(&md, &da, &db, NULL, &dc) == dnnl_success &&
            dnnl_primitive_attr_create(&attr) == dnnl_success;
  if (ok && e->accumulate)
    ok = dnnl_post_ops_create(&po) == dnnl_success &&
         dnnl_post_ops_append_sum(po, 1.0f) == dnnl_success &&
         dnnl_primitive_attr_set_post_ops(attr, po) == dnnl_success;
  ok = ok && dnnl_primitive_desc_create(&pd, &md, attr, tc->engine, NULL) == dnnl_success &&
       dnnl_primitive_create(&e->prim, pd) == dnnl_success &&
       dnnl_memory_create(&e->ma, &da, tc->engine, DNNL_MEMORY_NONE) == dnnl_success &&
       dnnl_memory_create(&e->mb, &db, tc->engine, DNNL_MEMORY_NONE) == dnnl_success &&
       dnnl_memory_create(&e->mc, &dc, tc->engine, DNNL_MEMORY_NONE) == dnnl_success;
  if (pd) dnnl_primitive_desc_destroy(pd);
  if (po) dnnl_post_ops_destroy(po);
  if (attr) dnnl_primitive_attr_destroy(attr);
  return ok;
}

/* entry_find returns the cached primitive for this shape, building it (evicting the least
 * recently used slot) when missing; NULL when this thread has no oneDNN engine. */
static entry *entry_find(bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t sa,
                         int64_t sb, int64_t sc, int64_t batch, bool accumulate) {
  tcache *tc = tcache_get();
  if (!tc) return NULL;
  entry *victim = &tc->e[0];
  for (int i = 0; i < CACHE_SLOTS; i++) {
    entry *e = &tc->e[i];
    if (e->used && e->ta == ta && e->tb == tb && e->m == m && e->n == n && e->k == k &&
        e->sa == sa && e->sb == sb && e->sc == sc && e->batch == batch &&
        e->accumulate == accumulate) {
      e->last_use = ++tc->clock;
      return e;
    }
    if (!e->used || (victim->used && e->last_use < victim->last_use)) victim = e;
  }
  entry_clear(victim);
  *victim = (entry){.used = true, .ta = ta, .tb = tb, .accumulate = accumulate, .m = m, .n = n,
                    .k = k, .sa = sa, .sb = sb, .sc = sc, .batch = batch,
                    .last_use = ++tc->clock};
  victim->ok = entry_build(tc, victim);
  if (!victim->ok) { /* keep the refusal cached, without the half-built objects */
    entry keep = *victim;
    victim->ma = victim->mb = victim->mc = NULL;
    victim->prim = NULL;
    entry_clear(&keep);
    victim->ok = false;
  }
  return victim;
}

static bool gemm_dnnl(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void *a,
                      int64_t sa, const void *b, int64_t sb, double beta, void *c, int64_t sc,
                      int64_t batch) {
  entry *e = entry_find(ta, tb, m, n, k, batch > 1 ? sa : 0, batch > 1 ? sb : 0,
                        batch > 1 ? sc : 0, batch, beta != 0);
  if (!e || !e->ok) return false;
  tcache *tc = pthread_getspecific(cache_key);
  int nt = openblas_get_num_threads();
  if (nt > 0 && omp_get_max_threads() != nt) omp_set_num_threads(nt);
  if (dnnl_memory_set_data_handle_v2(e->ma, (void *)a, tc->stream) != dnnl_success ||
      dnnl_memory_set_data_handle_v2(e->mb, (void *)b, tc->stream) != dnnl_success ||
      dnnl_memory_set_data_handle_v2(e->mc, c, tc->stream) != dnnl_success)
    return false;
  dnnl_exec_arg_t args[3] = {
      {DNNL_ARG_SRC, e->ma}, {DNNL_ARG_WEIGHTS, e->mb}, {DNNL_ARG_DST, e->mc}};
  if (dnnl_primitive_execute(e->prim, tc->stream, 3, args) != dnnl_success) return false;
  return dnnl_stream_wait(tc->stream) == dnnl_success;
}
#endif

td_status td__cpu_gemm_lowp(td_dtype dt, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                            double alpha, const void *a, int64_t sa, const void *b, int64_t sb,
                            double beta, void *c, int64_t sc, int64_t batch) {
  if (m == 0 || n == 0 || batch == 0) return TD_OK;
#ifdef TD_HAVE_DNNL
  if (dt == TD_DTYPE_BF16 && alpha == 1.0 && (beta == 0.0 || beta == 1.0) && k > 0 &&
      gemm_dnnl(ta, tb, m, n, k, a, sa, b, sb, beta, c, sc, batch))
    return TD_OK;
#endif
  return gemm_via_f32(dt, ta, tb, m, n, k, alpha, a, sa, b, sb, beta, c, sc, batch);
}

bool td__cpu_gemm_lowp_native(td_dtype dt) {
#ifdef TD_HAVE_DNNL
  return dt == TD_DTYPE_BF16 && tcache_get() != NULL;
#else
  (void)dt;
  return false;
#endif
}
