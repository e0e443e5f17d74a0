/* cuda_collective.cu - CUDA helpers of the NCCL backend (interface: cuda_collective.h).
 *
 * Order keys. NCCL's float MAX drops or keeps a NaN depending on the order in which values meet
 * (its max is `x < y ? y : x` or fmax), while the CPU ring backend propagates NaN. A float's bits
 * read as a sign-magnitude integer order like the float; turning the negative half into two's
 * complement order (flip every bit but the sign) gives an integer whose signed order is the
 * float order: -inf < ... < -0 < +0 < ... < +inf < NaN once every NaN is made the positive quiet
 * NaN. An integer MAX is exact and order-independent, so encode, reduce as int32/int64, decode
 * gives a NaN-propagating float MAX, bit-identical on every member. (-0 and +0 compare equal as
 * floats but not as keys: MAX(-0, +0) is +0 everywhere.)
 */
#include "cuda_collective.h"
#include "cuda_impl.h"

#include <string.h>

namespace {

template <typename F, typename I> struct KeyTraits;
template <> struct KeyTraits<float, int32_t> {
  static constexpr int32_t kMagnitude = 0x7fffffff;
  static constexpr int32_t kNaN = 0x7fc00000;
};
template <> struct KeyTraits<double, int64_t> {
  static constexpr int64_t kMagnitude = 0x7fffffffffffffffll;
  static constexpr int64_t kNaN = 0x7ff8000000000000ll;
};

template <typename F, typename I> __host__ __device__ __forceinline__ I to_key(F v) {
  I b;
  if (v != v) return KeyTraits<F, I>::kNaN;
  memcpy(&b, &v, sizeof b);
  return b >= 0 ? b : (I)(b ^ KeyTraits<F, I>::kMagnitude);
}

template <typename F, typename I> __host__ __device__ __forceinline__ F from_key(I k) {
  I b = k >= 0 ? k : (I)(k ^ KeyTraits<F, I>::kMagnitude);
  F v;
  memcpy(&v, &b, sizeof v);
  return v;
}

template <typename F, typename I>
__global__ void order_keys_kernel(const void *src, void *dst, int64_t n, bool decode) {
  TD_CU_LOOP(i, n) {
    if (decode) {
      I k = ((const I *)src)[i];
      ((F *)dst)[i] = from_key<F, I>(k);
    } else {
      F v = ((const F *)src)[i];
      ((I *)dst)[i] = to_key<F, I>(v);
    }
  }
}

} /* namespace */

extern "C" {

td_status td__cu_order_keys(td_dtype dt, int device, const void *src, void *dst, size_t n,
                            bool decode) {
  const char *op = "order_keys";
  if (dt == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda %s: int64 needs no keys", op);
  if (n == 0) return TD_OK;
  TD_TRY(td__cu_set_device(device, op));
  unsigned grid = td__cu_grid((int64_t)n, TD_CU_THREADS);
  if (dt == TD_DTYPE_F32)
    order_keys_kernel<float, int32_t><<<grid, TD_CU_THREADS>>>(src, dst, (int64_t)n, decode);
  else
    order_keys_kernel<double, int64_t><<<grid, TD_CU_THREADS>>>(src, dst, (int64_t)n, decode);
  return td__cu_check_launch(op);
}

int32_t td__cu_order_key_f32(float v) { return to_key<float, int32_t>(v); }
float td__cu_order_unkey_f32(int32_t k) { return from_key<float, int32_t>(k); }
int64_t td__cu_order_key_f64(double v) { return to_key<double, int64_t>(v); }
double td__cu_order_unkey_f64(int64_t k) { return from_key<double, int64_t>(k); }

} /* extern "C" */
