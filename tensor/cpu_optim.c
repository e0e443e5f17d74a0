/* cpu_optim.c - the CPU kernel of the fused Adam / AdamW update (td_tensor_adam_).
 *
 * One pass over a contiguous parameter: read p, g, exp_avg, exp_avg_sq, write p, exp_avg,
 * exp_avg_sq, instead of the nine passes (and two temporaries) of the composed in-place ops.
 * Each element follows torch.optim's _single_tensor_adam (PyTorch 1.13) in the element type:
 *
 *   g = -g if maximize;  g += wd * p (Adam's L2)   |  p *= 1 - lr * wd (AdamW)
 *   m = m * beta1 + (1 - beta1) * g
 *   v = v * beta2 + (1 - beta2) * g * g
 *   p += -step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps)
 *
 * This file is compiled with -fno-math-errno (CMakeLists.txt) so that sqrt vectorises (v is never
 * negative; errno is never read), and the loop is compiled per ISA level (TD__CPU_CLONES).
 */
#include <math.h>

#include "cpu_kernels.h"
#include "cpu_math.h"

#define DEF_ADAM(T)                                                                             \
  TD__CPU_CLONES static void adam_##T(T *restrict p, const T *restrict g, T *restrict m,       \
                                      T *restrict v, int64_t n, const td__adam_consts *c) {    \
    const T b1 = (T)c->beta1, b2 = (T)c->beta2, ob1 = (T)(1 - c->beta1);                        \
    const T ob2 = (T)(1 - c->beta2), eps = (T)c->eps, l2 = (T)c->l2, decay = (T)c->decay;       \
    const T neg_step = (T)-c->step_size, bc2 = (T)c->bc2_sqrt;                                  \
    const T sign = c->maximize ? (T)-1 : (T)1;                                                  \
    for (int64_t i = 0; i < n; i++) {                                                           \
      T gi = sign * g[i] + l2 * p[i];                                                           \
      T pi = p[i] * decay;                                                                      \
      T mi = m[i] * b1 + ob1 * gi;                                                              \
      T vi = v[i] * b2 + ob2 * gi * gi;                                                         \
      T denom = sqrt##T(vi) / bc2 + eps;                                                        \
      m[i] = mi;                                                                                \
      v[i] = vi;                                                                                \
      p[i] = pi + neg_step * mi / denom;                                                        \
    }                                                                                           \
  }
#define sqrtfloat sqrtf
#define sqrtdouble sqrt
DEF_ADAM(float)
DEF_ADAM(double)

td_status td__cpu_adam(td_tensor *p, const td_tensor *g, td_tensor *m, td_tensor *v,
                       const td__adam_consts *c) {
  int64_t n = td_tensor_numel(p);
  switch (p->dtype) {
    case TD_DTYPE_F32:
      adam_float(td_tensor_data(p), td_tensor_data(g), td_tensor_data(m), td_tensor_data(v), n,
                 c);
      return TD_OK;
    case TD_DTYPE_F64:
      adam_double(td_tensor_data(p), td_tensor_data(g), td_tensor_data(m), td_tensor_data(v), n,
                  c);
      return TD_OK;
    default:
      return td_set_error(TD_ERR_DTYPE, "adam: CPU kernel does not support %s",
                          td_dtype_name(p->dtype));
  }
}
