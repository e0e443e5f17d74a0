/* reduce.c - element kernels of the CPU collectives: two-way and n-way reductions and the
 * division of TD_REDUCE_AVG, for float32, float64 and int64.
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

#include "coll_impl.h"

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
    default: break; /* transport dtypes: refused before any reduction (ops.c, check_op) */
  }
}

void td__reduce_n(void *dst, const void *const *srcs, int nsrc, size_t n, td_dtype dt,
                  td_reduce_op op) {
  td__reduce_n2(dst, NULL, srcs, nsrc, n, dt, op);
}

void td__reduce_n2(void *dst, void *dst2, const void *const *srcs, int nsrc, size_t n,
                   td_dtype dt, td_reduce_op op) {
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
  }
}
