/* cpu_math.h - vectorisable float32 exp / erf / GELU and the CPU-dispatch attribute (internal).
 *
 * The library is compiled for the baseline x86-64 ISA (SSE2). Hot CPU kernels that gcc can
 * vectorise are compiled a second and third time for the x86-64-v3 (AVX2, FMA) and x86-64-v4
 * (AVX-512) levels with TD__CPU_CLONES (gcc's target_clones; the loader picks the best version
 * once, through an ifunc, by ISA level: "arch=<cpu>" clones would dispatch on the exact CPU model
 * and miss newer ones), so one binary runs anywhere and uses the wide units where they exist.
 * Without gcc >= 12 on x86-64 the macro is empty (one baseline version); so it is under TSan:
 * gcc instruments the ifunc resolvers it generates (__tsan_func_entry), and the loader runs them
 * while relocating, before libtsan is usable, so every program died before main.
 *
 * Calls into libm (expf, erff) stop gcc from vectorising a loop, so float32 kernels use the
 * branch-free inline functions below instead:
 *   td__expf   Cephes' expf: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r and
 *              2^n put into the exponent bits. Relative error below 2 ulp over the whole range;
 *              0 for x < -87.3 (where float32 would go subnormal); saturates at e^88 for
 *              x > 88 (the kernels only pass x <= 0: softmax, erf).
 *   td__erff   Abramowitz-Stegun 7.1.26 with that exp: |error| < 1.5e-7, the approximation
 *              PyTorch 1.13 uses in its vectorised float GELU, so tdist's float32 GELU agrees
 *              with PyTorch's to about an ulp instead of differing by the approximation error.
 * Float64 kernels keep libm (exp, erf): they serve the finite-difference gradient checks.
 *
 * THREAD SAFETY: pure functions.
 */
#ifndef TD_TENSOR_CPU_MATH_H
#define TD_TENSOR_CPU_MATH_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(TD_NO_CPU_CLONES) && !defined(__SANITIZE_THREAD__)
#define TD__CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", \
                                                    "default")))
#else
#define TD__CPU_CLONES
#endif

/* 64-byte vectors (gcc's vector extension; one AVX-512 register, or two AVX2 / four SSE2 ones in
 * the other clones) for kernels that reduce: gcc does not vectorise floating-point sums by
 * itself without -ffast-math (reassociation), so such kernels keep explicit vector
 * accumulators. Only ever used inside inlined code (the ABI note of -Wpsabi does not apply). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float td__vf8 __attribute__((vector_size(32)));
typedef double td__vd8 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) td__vd8 td__vd8_load_f32(const float *p) {
  td__vf8 v;
  memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, td__vd8);
}
static inline __attribute__((always_inline)) td__vd8 td__vd8_load_f64(const double *p) {
  td__vd8 v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void td__vd8_store_f32(float *p, td__vd8 v) {
  td__vf8 f = __builtin_convertvector(v, td__vf8);
  memcpy(p, &f, sizeof f);
}
static inline __attribute__((always_inline)) void td__vd8_store_f64(double *p, td__vd8 v) {
  memcpy(p, &v, sizeof v);
}
static inline __attribute__((always_inline)) double td__vd8_sum(td__vd8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

static inline __attribute__((always_inline)) float td__expf(float x) {
  /* clamp, remembering the underflow (a select, not a branch: the loop stays vectorisable) */
  float under = x < -87.3f ? 0.0f : 1.0f;
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.3f ? -87.3f : x;
  /* round to nearest by adding and removing 1.5 * 2^23 (vectorises without SSE4.1's roundps) */
  float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - fn * 0.693359375f; /* ln2 split in two for an exact product */
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)fn + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale * under;
}

static inline __attribute__((always_inline)) float td__erff(float x) {
  float ax = x < 0 ? -x : x;
  float sign = x < 0 ? -1.0f : 1.0f;
  float t = 1.0f / (0.3275911f * ax + 1.0f);
  float r = 1.061405429f;
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  return sign * (1.0f - r * t * td__expf(-ax * ax));
}

#endif
