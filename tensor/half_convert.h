/* half_convert.h - scalar conversions between float32 and the 16-bit floats (internal; host
 * code). Shared by the tensor layer (tensor_impl.h includes it) and the collectives' reductions,
 * which must not see the rest of the tensor internals.
 * THREAD SAFETY: pure functions.
 */
#ifndef TD_TENSOR_HALF_CONVERT_H
#define TD_TENSOR_HALF_CONVERT_H

#include <stdint.h>
#include <string.h>

/* Half-precision conversions (host code): IEEE binary16 and bfloat16 <-> float, rounding to
 * nearest even; NaN stays NaN, overflow gives infinity. */
static inline float td__bits_f32(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
static inline uint32_t td__f32_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}
static inline float td__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return td__bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
  if (exp == 0) { /* zero or subnormal: man * 2^-24 */
    float f = (float)man * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return td__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}
static inline uint16_t td__f32_to_f16(float f) {
  uint32_t b = td__f32_bits(f), sign = (b >> 16) & 0x8000u, a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) { /* below the smallest normal half: subnormal, in units of 2^-24 */
    float m = td__bits_f32(a) * 16777216.0f; /* exact; rounding below is to nearest even */
    uint32_t q = (uint32_t)m;
    float frac = m - (float)q;
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23); /* rebias, round to nearest even */
  return (uint16_t)(sign | (r >> 13));
}
static inline float td__bf16_to_f32(uint16_t h) { return td__bits_f32((uint32_t)h << 16); }
static inline uint16_t td__f32_to_bf16(float f) {
  uint32_t b = td__f32_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u); /* quiet NaN */
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
#endif
