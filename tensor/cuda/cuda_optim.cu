/* cuda_optim.cu - the optimizer's kernels of the CUDA backend: the fused Adam / AdamW update (one
 * parameter, or many at once) and the sum of squares of a tensor list (gradient-norm clipping).
 *
 * Adam follows tensor/cpu_optim.c (PyTorch 1.13's _single_tensor_adam) element by element in the
 * parameter's dtype (float32 or float64: the master weights; autocast keeps them float32):
 *   g = -g if maximize;  g += l2 * p;  p *= decay;  m = b1 m + (1 - b1) g;
 *   v = b2 v + (1 - b2) g^2;  p += -step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * Multi-tensor apply: up to kAdamPer parameters travel by value in the kernel's parameters (under
 * the 4 KiB limit), blockIdx.y picks the parameter and the blocks along x stride over its
 * elements, so a step of a GPT's ~150 parameters is a handful of launches instead of ~150, and
 * nothing is copied to the device first (no host synchronisation).
 *
 * Sum of squares: each block adds the squares of a strided share of one tensor in double and
 * writes its partial sum; one last block adds the partials in a fixed order (the result does not
 * depend on timing, unlike atomics), and the host reads the double back: the step's one
 * synchronisation for clipping. Non-contiguous tensors are made contiguous first.
 */
#include "cuda_impl.h"

#include <string.h>

namespace {

constexpr int kAdamPer = 24;

template <typename T> struct AdamOne {
  T *p;
  const T *g;
  T *m;
  T *v;
  int64_t n;
  T b1, b2, ob1, ob2, eps, l2, decay, neg_step, bc2, sign;
};

template <typename T> struct AdamBatch {
  AdamOne<T> t[kAdamPer];
};

template <typename T> AdamOne<T> adam_one(td_tensor *p, const td_tensor *g, td_tensor *m,
                                          td_tensor *v, const td__adam_consts *c) {
  AdamOne<T> a;
  a.p = (T *)td__cu_ptr(p);
  a.g = (const T *)td__cu_ptr(g);
  a.m = (T *)td__cu_ptr(m);
  a.v = (T *)td__cu_ptr(v);
  a.n = td__cu_numel(p);
  a.b1 = (T)c->beta1;
  a.b2 = (T)c->beta2;
  a.ob1 = (T)(1 - c->beta1);
  a.ob2 = (T)(1 - c->beta2);
  a.eps = (T)c->eps;
  a.l2 = (T)c->l2;
  a.decay = (T)c->decay;
  a.neg_step = (T)-c->step_size;
  a.bc2 = (T)c->bc2_sqrt;
  a.sign = c->maximize ? (T)-1 : (T)1;
  return a;
}

template <typename T> __global__ void adam_kernel(AdamBatch<T> b) {
  const AdamOne<T> &a = b.t[blockIdx.y];
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n;
       i += (int64_t)gridDim.x * blockDim.x) {
    T pi0 = a.p[i];
    T gi = a.sign * a.g[i] + a.l2 * pi0;
    T pi = pi0 * a.decay;
    T mi = a.m[i] * a.b1 + a.ob1 * gi;
    T vi = a.v[i] * a.b2 + a.ob2 * gi * gi;
    T denom = sqrt(vi) / a.bc2 + a.eps;
    a.m[i] = mi;
    a.v[i] = vi;
    a.p[i] = pi + a.neg_step * mi / denom;
  }
}

td_status check_adam(const char *op, td_tensor *p, const td_tensor *g, const td_tensor *m,
                     const td_tensor *v, td_dtype dt, int dev) {
  const td_tensor *all[4] = {p, g, m, v};
  for (int i = 0; i < 4; i++) {
    if (all[i]->storage->device.type != TD_DEVICE_CUDA || td__cu_dev(all[i]) != dev)
      return td_set_error(TD_ERR_DEVICE, "cuda %s: operands on different devices", op);
    if (all[i]->dtype != dt)
      return td_set_error(TD_ERR_DTYPE, "cuda %s: operands of different dtypes", op);
    TD_TRY(td__cu_need_contig(op, all[i]));
  }
  if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
    return td_set_error(TD_ERR_DTYPE, "cuda %s: %s parameters are not supported (the master "
                        "weights are float32 or float64)", op, td_dtype_name(dt));
  return TD_OK;
}

template <typename T>
td_status adam_typed(td_tensor *const *p, const td_tensor *const *g, td_tensor *const *m,
                     td_tensor *const *v, const td__adam_consts *c, int n) {
  const char *op = "adam";
  for (int i0 = 0; i0 < n; i0 += kAdamPer) {
    int cnt = n - i0 < kAdamPer ? n - i0 : kAdamPer;
    AdamBatch<T> b;
    memset(&b, 0, sizeof b);
    int64_t most = 0;
    for (int j = 0; j < cnt; j++) {
      b.t[j] = adam_one<T>(p[i0 + j], g[i0 + j], m[i0 + j], v[i0 + j], &c[i0 + j]);
      if (b.t[j].n > most) most = b.t[j].n;
    }
    if (most == 0) continue;
    unsigned gx = td__cu_grid(most, TD_CU_THREADS);
    if (gx > 4096) gx = 4096; /* grid-stride beyond: enough blocks to fill any GPU */
    adam_kernel<T><<<dim3(gx, (unsigned)cnt), TD_CU_THREADS>>>(b);
    TD_TRY(td__cu_check_launch(op));
  }
  return TD_OK;
}

/* ---- sum of squares ---- */

constexpr int kSqPer = 32;
constexpr unsigned kSqBlocks = 256;

struct SqBatch {
  const void *x[kSqPer];
  int64_t n[kSqPer];
  int dt[kSqPer];
};

__device__ __forceinline__ double load_float(const void *x, int dt, int64_t i) {
  switch (dt) {
    case TD_DTYPE_F32: return ((const float *)x)[i];
    case TD_DTYPE_F64: return ((const double *)x)[i];
    case TD_DTYPE_BF16: return td__cu_bf16_to_f32(((const uint16_t *)x)[i]);
    case TD_DTYPE_F16: return td__cu_f16_to_f32(((const uint16_t *)x)[i]);
  }
  return 0;
}

/* partial[(first + blockIdx.y) * gridDim.x + blockIdx.x] = this block's share of tensor y. */
__global__ void sumsq_kernel(SqBatch b, int64_t first, double *partial) {
  int t = blockIdx.y;
  const void *x = b.x[t];
  int dt = b.dt[t];
  double acc = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < b.n[t];
       i += (int64_t)gridDim.x * blockDim.x) {
    double v = load_float(x, dt, i);
    acc += v * v;
  }
  acc = td__cu_block_sum(acc);
  if (threadIdx.x == 0) partial[(first + t) * gridDim.x + blockIdx.x] = acc;
}

/* One block: *out = the sum of partial[0..n), each thread a fixed strided share. */
__global__ void sum_partials_kernel(const double *partial, int64_t n, double *out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = td__cu_block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

} /* namespace */

td_status td__cu_adam(td_tensor *p, const td_tensor *g, td_tensor *m, td_tensor *v,
                      const td__adam_consts *c) {
  return td__cu_adam_multi(&p, &g, &m, &v, c, 1);
}

td_status td__cu_adam_multi(td_tensor *const *p, const td_tensor *const *g, td_tensor *const *m,
                            td_tensor *const *v, const td__adam_consts *c, int n) {
  const char *op = "adam";
  if (n <= 0) return TD_OK;
  TD_TRY(td__cu_enter(op, p[0]));
  int dev = td__cu_dev(p[0]);
  td_dtype dt = p[0]->dtype;
  for (int i = 0; i < n; i++) TD_TRY(check_adam(op, p[i], g[i], m[i], v[i], dt, dev));
  if (dt == TD_DTYPE_F32) return adam_typed<float>(p, g, m, v, c, n);
  return adam_typed<double>(p, g, m, v, c, n);
}

td_status td__cu_sum_squares(const td_tensor *const *ts, int n, double *out) {
  const char *op = "sum_squares";
  *out = 0.0;
  if (n <= 0) return TD_OK;
  TD_TRY(td__cu_enter(op, ts[0]));
  int dev = td__cu_dev(ts[0]);
  td_tensor **own = (td_tensor **)td__calloc((size_t)n, sizeof *own); /* contiguous copies */
  if (!own) return td_set_error(TD_ERR_NOMEM, "cuda %s: out of memory", op);
  td_status st = TD_OK;
  for (int i = 0; i < n && st == TD_OK; i++) {
    if (ts[i]->storage->device.type != TD_DEVICE_CUDA || td__cu_dev(ts[i]) != dev)
      st = td_set_error(TD_ERR_DEVICE, "cuda %s: tensors on different devices", op);
    else if (!td_dtype_is_float(ts[i]->dtype))
      st = td_set_error(TD_ERR_DTYPE, "cuda %s: %s tensors are not supported", op,
                        td_dtype_name(ts[i]->dtype));
    else
      st = td__contig(ts[i], &own[i]);
  }
  int64_t nb = ((int64_t)n + kSqPer - 1) / kSqPer * kSqPer; /* partial rows, whole batches */
  void *scratch = nullptr;
  if (st == TD_OK)
    st = td__cu_scratch_alloc(dev, (size_t)(nb * kSqBlocks + 1) * sizeof(double), &scratch);
  if (st == TD_OK) {
    double *partial = (double *)scratch, *result = partial + nb * kSqBlocks;
    cudaError_t e = cudaMemsetAsync(partial, 0, (size_t)(nb * kSqBlocks) * sizeof(double), 0);
    if (e != cudaSuccess) st = td__cu_error(e, op);
    for (int i0 = 0; i0 < n && st == TD_OK; i0 += kSqPer) {
      int cnt = n - i0 < kSqPer ? n - i0 : kSqPer;
      SqBatch b;
      memset(&b, 0, sizeof b);
      for (int j = 0; j < cnt; j++) {
        b.x[j] = td__cu_ptr(own[i0 + j]);
        b.n[j] = td__cu_numel(own[i0 + j]);
        b.dt[j] = (int)own[i0 + j]->dtype;
      }
      sumsq_kernel<<<dim3(kSqBlocks, (unsigned)cnt), TD_CU_THREADS>>>(b, i0, partial);
      st = td__cu_check_launch(op);
    }
    if (st == TD_OK) {
      sum_partials_kernel<<<1, 1024>>>(partial, nb * kSqBlocks, result);
      st = td__cu_check_launch(op);
    }
    if (st == TD_OK) {
      e = cudaMemcpy(out, result, sizeof(double), cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) st = td__cu_error(e, op);
    }
  }
  if (scratch) td__cu_scratch_free(dev, scratch);
  for (int i = 0; i < n; i++) td_tensor_unref(own[i]);
  td__free(own);
  return st;
}
