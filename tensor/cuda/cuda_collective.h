/* cuda_collective.h - CUDA helpers of the NCCL backend (collectives/nccl/nccl_backend.c), as a C
 * interface; defined in cuda_collective.cu. No CUDA header.
 */
#ifndef TD_TENSOR_CUDA_COLLECTIVE_H
#define TD_TENSOR_CUDA_COLLECTIVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* td__cu_order_keys maps n floats (float32 or float64, dt) at src to integers of the same width
 * at dst (src == dst allowed) whose signed order is the order of the floats with every NaN above
 * +inf (NaNs become one positive quiet NaN first), so that an integer MAX reduction (which NCCL
 * does exactly) computes a float MAX that propagates NaN like the CPU backend; decode maps the
 * integers back (decode(encode(x)) == x for every x that is not NaN). Enqueued on the legacy
 * default stream of device (made current). TD_ERR_DTYPE for int64. THREAD SAFETY: any thread. */
td_status td__cu_order_keys(td_dtype dt, int device, const void *src, void *dst, size_t n,
                            bool decode);

/* The same maps for one value on the host (the device code runs these very functions; for
 * tests). */
int32_t td__cu_order_key_f32(float v);
float td__cu_order_unkey_f32(int32_t k);
int64_t td__cu_order_key_f64(double v);
double td__cu_order_unkey_f64(int64_t k);

#ifdef __cplusplus
}
#endif

#endif
