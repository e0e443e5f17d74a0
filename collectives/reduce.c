/* reduce.c - element kernels of the CPU collectives: two-way and n-way reductions and the
 * division of TD_REDUCE_AVG, for float32, float64, int64, bfloat16 and float16.
 *
 * The 16-bit floats accumulate in float32: an n-way reduction (the shared-memory paths) reads
 * every source into float32, adds them there and rounds once; a two-way step (the TCP ring's
 * hops) rounds after each hop, as NCCL's bfloat16 ring does.
 *
 * Bit-identical results: every algorithm fixes the order in which contributions are combined
 * (td__reduce_n adds sources 0, 1, ..., n-1 from left to right for every element), and the same
 * code runs on every member, so members that reduce the same inputs get the same bits.
 * td__reduce_n works through blocks of REDUCE_BLOCK bytes in a stack buffer: the loops stay
 * two-operand (the compiler vectorizes them), the block stays in L1 between the n passes, and the
 * destination may alias any source.
 * TD_REDUCE_MAX propagates NaN (a NaN source wins), like torch.maximum.
 */
#include <string.h>

#include "../tensor/half_convert.h"
#include "coll_impl.h"

static bool is_half(td_dtype dt) { return dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16; }

static inline float h2f(td_dtype dt, uint16_t h) {
  return dt == TD_DTYPE_BF16 ? td__bf16_to_f32(h) : td__f16_to_f32(h);
}
static inline uint16_t f2h(td_dtype dt, float f) {
  return dt == TD_DTYPE_BF16 ? td__f32_to_bf16(f) : td__f32_to_f16(f);
}

#define REDUCE_BLOCK 4096

#define ADD_LOOP(T)                                                \
  do {                                                             \
    T *restrict d = dst;                                           \
    const T *restrict s = src;                                     \
    for (size_t i = 0; i < n; i++) d[i] += s[i];                   \
  } while (0)
#define MAX_LOOP(T)                                                \
  do {                                                             \
    T *restrict d = dst;                                           \
    const T *restrict s = src;                                     \
    for (size_t i = 0; i < n; i++) d[i] = (s[i] > d[i] || s[i] != s[i]) ? s[i] : d[i]; \
  } while (0)

void td__reduce_into(void *dst, const void *src, size_t n, td_dtype dt, td_reduce_op op) {
  bool mx = op == TD_REDUCE_MAX;
  switch (dt) {
    case TD_DTYPE_F32:
      if (mx) MAX_LOOP(float);
      else ADD_LOOP(float);
      break;
    case TD_DTYPE_F64:
      if (mx) MAX_LOOP(double);
      else ADD_LOOP(double);
      break;
    case TD_DTYPE_I64:
      if (mx) MAX_LOOP(int64_t);
      else ADD_LOOP(int64_t);
      break;
    case TD_DTYPE_BF16:
    case TD_DTYPE_F16: {
      uint16_t *d = dst;
      const uint16_t *sp = src;
      for (size_t i = 0; i < n; i++) {
        float a = h2f(dt, d[i]), b = h2f(dt, sp[i]);
        d[i] = f2h(dt, mx ? ((b > a || b != b) ? b : a) : a + b);
      }
      break;
    }
    default: break; /* transport dtypes: refused before any reduction (ops.c, check_op) */
  }
}

/* n-way reduction of 16-bit floats: float32 accumulation, one rounding per element. */
static void reduce_n_half(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n,
                          td_dtype dt, td_reduce_op op) {
  enum { BLK = REDUCE_BLOCK / 4 };
  float acc[BLK];
  bool mx = op == TD_REDUCE_MAX;
  for (size_t off = 0; off < n; off += BLK) {
    size_t k = n - off < BLK ? n - off : BLK;
    const uint16_t *s0 = (const uint16_t *)srcs[0] + off;
    for (size_t i = 0; i < k; i++) acc[i] = h2f(dt, s0[i]);
    for (int j = 1; j < nsrc; j++) {
      const uint16_t *sj = (const uint16_t *)srcs[j] + off;
      for (size_t i = 0; i < k; i++) {
        float b = h2f(dt, sj[i]);
        acc[i] = mx ? ((b > acc[i] || b != b) ? b : acc[i]) : acc[i] + b;
      }
    }
    uint16_t *d = (uint16_t *)dst + off, *d2 = dst2 ? (uint16_t *)dst2 + off : NULL;
    for (size_t i = 0; i < k; i++) {
      d[i] = f2h(dt, acc[i]);
      if (d2) d2[i] = d[i];
    }
  }
}

void td__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t n, td_dtype dt,
                  td_reduce_op op) {
  td__reduce_n2(dst, NULL, srcs, nsrc, n, dt, op);
}

void td__reduce_n2(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n,
                   td_dtype dt, td_reduce_op op) {
  if (is_half(dt)) {
    reduce_n_half(dst, dst2, srcs, nsrc, n, dt, op);
    return;
  }
  size_t es = td_dtype_size(dt), per = REDUCE_BLOCK / es;
  _Alignas(64) unsigned char blk[REDUCE_BLOCK];
  for (size_t off = 0; off < n; off += per) {
    size_t k = n - off < per ? n - off : per, boff = off * es;
    memcpy(blk, (const char *)srcs[0] + boff, k * es);
    for (int j = 1; j < nsrc; j++) td__reduce_into(blk, (const char *)srcs[j] + boff, k, dt, op);
    memcpy((char *)dst + boff, blk, k * es);
    if (dst2) memcpy((char *)dst2 + boff, blk, k * es);
  }
}

void td__divide(void *p, size_t n, td_dtype dt, int by) {
  if (dt == TD_DTYPE_F32) {
    float *x = p;
    for (size_t i = 0; i < n; i++) x[i] /= (float)by;
  } else if (dt == TD_DTYPE_F64) {
    double *x = p;
    for (size_t i = 0; i < n; i++) x[i] /= (double)by;
  } else if (is_half(dt)) {
    uint16_t *x = p;
    for (size_t i = 0; i < n; i++) x[i] = f2h(dt, h2f(dt, x[i]) / (float)by);
  }
}
