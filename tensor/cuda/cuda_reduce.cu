/* cuda_reduce.cu - reductions of the CUDA backend: sum and max (+ arg-max) over the middle dim of
 * a contiguous [outer, r, inner] view, softmax / log-softmax (+ backward) and layer norm
 * (+ backward).
 *
 * Sum and max: with inner == 1 and long rows a block reduces (a chunk of) one row with shuffles;
 * otherwise a thread reduces (a chunk of) one column, so a warp reads consecutive addresses when
 * inner > 1. When outer * inner alone gives too few threads, r is split into chunks: the first
 * pass writes partial results [outer, nsplit, inner] to scratch memory and the reduction runs
 * again over nsplit. Arg-max partials carry their index; ties keep the smaller index (PyTorch's
 * "first occurrence"), and NaN counts as the largest value.
 *
 * Softmax and layer norm use one block per row (inner == 1) or one thread per column, and read
 * the row several times (max, sum, write); rows are small enough to stay in L1/L2.
 *
 * Rows: a block loops over rows (row = blockIdx.x, += gridDim.x) with a grid of at most
 * TD_CU_MAX_BLOCKS, so any number of rows works (a grid of `outer` blocks fails from 2^31 rows
 * and, cast to 32 bits, skipped rows from 2^32). Every loop bound is the same for all threads of
 * a block, so the block reductions inside stay uniform. Indices are 64-bit throughout.
 *
 * 16-bit floats: sums read them and accumulate in double into float32 results rounded once;
 * max, softmax and layer norm run on float32 copies (td__cu_up), as the CPU does.
 *
 * Accumulation: float32 sums (sum, softmax denominators and backward sums, layer-norm moments and
 * parameter gradients) accumulate in double (Acc<float>), as the CPU backend does, so a long
 * same-sign sum keeps float32 accuracy instead of drifting by n * eps / 2 when one thread adds a
 * long column; elementwise math (exp, the results) stays in the element type. log_softmax is
 * (x - max) - log(sum), whose first step is exact, not x - (max + log(sum)), which rounds to the
 * ulp of max for large logits.
 */
#include "cuda_impl.h"

namespace {

/* Acc<T> is the accumulator type of sums of T (double for float, see the file comment). */
template <typename T> struct AccT { using type = T; };
template <> struct AccT<float> { using type = double; };
template <> struct AccT<td_bf16> { using type = double; };
template <> struct AccT<td_f16> { using type = double; };
template <typename T> using Acc = typename AccT<T>::type;

/* row_grid returns the grid of a block-per-row kernel over rows rows. */
unsigned row_grid(int64_t rows) {
  return (unsigned)(rows < 1 ? 1 : rows > TD_CU_MAX_BLOCKS ? TD_CU_MAX_BLOCKS : rows);
}

#define TD_CU_ROWS(o, rows) for (int64_t o = blockIdx.x; o < (rows); o += gridDim.x)

/* ---- sum ---- */

/* Sums read T and write O: O is T, except for the 16-bit floats, whose sums (partial and final)
 * are float32 (rounded to the 16-bit dtype once, by the caller). */
template <typename T, typename O>
__global__ void sum_rows_kernel(const T *x, int64_t outer, int64_t r, int64_t chunk, O *out) {
  int64_t s = blockIdx.y, nsplit = gridDim.y;
  int64_t k0 = s * chunk, k1 = min(r, k0 + chunk);
  TD_CU_ROWS(o, outer) {
    const T *row = x + o * r;
    Acc<O> acc = 0;
    for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) acc += (Acc<O>)td__ld(row[k]);
    acc = td__cu_block_sum(acc);
    if (threadIdx.x == 0) out[o * nsplit + s] = (O)acc;
  }
}

template <typename T, typename O>
__global__ void sum_cols_kernel(const T *x, int64_t outer, int64_t r, int64_t inner,
                                int64_t chunk, O *out) {
  int64_t s = blockIdx.y, nsplit = gridDim.y;
  int64_t k0 = s * chunk, k1 = min(r, k0 + chunk);
  TD_CU_LOOP(t, outer * inner) {
    int64_t o = t / inner, i = t - o * inner;
    const T *p = x + o * r * inner + i;
    Acc<O> acc = 0;
    for (int64_t k = k0; k < k1; k++) acc += (Acc<O>)td__ld(p[k * inner]);
    out[(o * nsplit + s) * inner + i] = (O)acc;
  }
}

/* use_rows says whether a block reduces each row (long contiguous rows) rather than a thread
 * each column (inner > 1, or rows too short to keep a block busy). */
bool use_rows(int64_t r, int64_t inner) { return inner == 1 && r > 64; }

/* split_r chooses how many chunks r is cut into (see the file comment) and their length. */
void split_r(int64_t outer, int64_t r, int64_t inner, int64_t *nsplit, int64_t *chunk) {
  int64_t ns;
  if (use_rows(r, inner)) {
    int64_t want = (2048 + outer - 1) / outer;
    ns = (r + 4095) / 4096;
    if (ns > want) ns = want;
  } else {
    int64_t cols = outer * inner;
    int64_t want = (131072 + cols - 1) / cols;
    ns = (r + 15) / 16;
    if (ns > want) ns = want;
  }
  if (ns < 1) ns = 1;
  if (ns > 65535) ns = 65535;
  *chunk = (r + ns - 1) / ns;
  *nsplit = (r + *chunk - 1) / *chunk; /* no empty chunk */
}

template <typename T, typename O = T>
td_status sum_typed(int dev, const T *x, int64_t outer, int64_t r, int64_t inner, O *out) {
  const char *op = "reduce_sum";
  if (outer * inner == 0) return TD_OK;
  if (r == 0) {
    cudaError_t e = cudaMemsetAsync(out, 0, (size_t)(outer * inner) * sizeof(O), 0);
    return e == cudaSuccess ? TD_OK : td__cu_error(e, op);
  }
  int64_t nsplit, chunk;
  split_r(outer, r, inner, &nsplit, &chunk);
  O *dst = out;
  void *tmp = nullptr;
  if (nsplit > 1) {
    TD_TRY(td__cu_scratch_alloc(dev, (size_t)(outer * nsplit * inner) * sizeof(O), &tmp));
    dst = (O *)tmp;
  }
  if (use_rows(r, inner)) {
    int threads = td__cu_block_threads(chunk);
    sum_rows_kernel<T, O><<<dim3(row_grid(outer), (unsigned)nsplit), threads>>>(x, outer, r,
                                                                               chunk, dst);
  } else {
    dim3 grid(td__cu_grid(outer * inner, TD_CU_THREADS), (unsigned)nsplit);
    sum_cols_kernel<T, O><<<grid, TD_CU_THREADS>>>(x, outer, r, inner, chunk, dst);
  }
  td_status st = td__cu_check_launch(op);
  if (st == TD_OK && nsplit > 1) st = sum_typed<O, O>(dev, dst, outer, nsplit, inner, out);
  if (tmp) td__cu_scratch_free(dev, tmp);
  return st;
}

/* ---- max and arg-max ---- */

/* better returns true when (b, ib) should replace (a, ia). */
template <typename T> __device__ __forceinline__ bool better(T b, int64_t ib, T a, int64_t ia) {
  bool bn = td__cu_isnan(b), an = td__cu_isnan(a);
  if (bn != an) return bn;
  if (b > a) return true;
  return (b == a || bn) && ib < ia;
}

template <typename T>
__device__ void block_argmax(T *v, int64_t *idx) {
  __shared__ T sv[32];
  __shared__ int64_t si[32];
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    T v2 = __shfl_xor_sync(0xffffffffu, *v, o);
    int64_t i2 = __shfl_xor_sync(0xffffffffu, *idx, o);
    if (better(v2, i2, *v, *idx)) *v = v2, *idx = i2;
  }
  if (lane == 0) sv[wid] = *v, si[wid] = *idx;
  __syncthreads();
  if (wid == 0) {
    *v = lane < nw ? sv[lane] : td__cu_lowest<T>();
    *idx = lane < nw ? si[lane] : INT64_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      T v2 = __shfl_xor_sync(0xffffffffu, *v, o);
      int64_t i2 = __shfl_xor_sync(0xffffffffu, *idx, o);
      if (better(v2, i2, *v, *idx)) *v = v2, *idx = i2;
    }
  }
}

/* in_idx (may be NULL) maps a position k of x to the original index (second and later passes). */
template <typename T>
__global__ void max_rows_kernel(const T *x, const int64_t *in_idx, int64_t outer, int64_t r,
                                int64_t chunk, T *out, int64_t *out_idx) {
  int64_t s = blockIdx.y, nsplit = gridDim.y;
  int64_t k0 = s * chunk, k1 = min(r, k0 + chunk);
  TD_CU_ROWS(o, outer) {
    T best = td__cu_lowest<T>();
    int64_t bi = INT64_MAX;
    for (int64_t k = k0 + threadIdx.x; k < k1; k += blockDim.x) {
      T v = x[o * r + k];
      int64_t i = in_idx ? in_idx[o * r + k] : k;
      if (better(v, i, best, bi)) best = v, bi = i;
    }
    block_argmax(&best, &bi);
    if (threadIdx.x == 0) {
      out[o * nsplit + s] = best;
      if (out_idx) out_idx[o * nsplit + s] = bi;
    }
    __syncthreads(); /* block_argmax's shared slots are reused by the next row */
  }
}

template <typename T>
__global__ void max_cols_kernel(const T *x, const int64_t *in_idx, int64_t outer, int64_t r,
                                int64_t inner, int64_t chunk, T *out, int64_t *out_idx) {
  int64_t s = blockIdx.y, nsplit = gridDim.y;
  int64_t k0 = s * chunk, k1 = min(r, k0 + chunk);
  TD_CU_LOOP(t, outer * inner) {
    int64_t o = t / inner, i = t - o * inner;
    T best = td__cu_lowest<T>();
    int64_t bi = INT64_MAX;
    for (int64_t k = k0; k < k1; k++) {
      int64_t pos = (o * r + k) * inner + i;
      T v = x[pos];
      int64_t ki = in_idx ? in_idx[pos] : k;
      if (better(v, ki, best, bi)) best = v, bi = ki;
    }
    out[(o * nsplit + s) * inner + i] = best;
    if (out_idx) out_idx[(o * nsplit + s) * inner + i] = bi;
  }
}

template <typename T>
td_status max_typed(int dev, const T *x, const int64_t *in_idx, int64_t outer, int64_t r,
                    int64_t inner, T *out, int64_t *out_idx) {
  const char *op = "reduce_max";
  int64_t nsplit, chunk;
  split_r(outer, r, inner, &nsplit, &chunk);
  T *dst = out;
  int64_t *dst_idx = out_idx;
  void *tmp = nullptr, *tmp_idx = nullptr;
  if (nsplit > 1) {
    size_t cnt = (size_t)(outer * nsplit * inner);
    TD_TRY(td__cu_scratch_alloc(dev, cnt * sizeof(T), &tmp));
    td_status st = td__cu_scratch_alloc(dev, cnt * sizeof(int64_t), &tmp_idx);
    if (st != TD_OK) {
      td__cu_scratch_free(dev, tmp);
      return st;
    }
    dst = (T *)tmp;
    dst_idx = (int64_t *)tmp_idx;
  }
  if (use_rows(r, inner)) {
    int threads = td__cu_block_threads(chunk);
    max_rows_kernel<T><<<dim3(row_grid(outer), (unsigned)nsplit), threads>>>(
        x, in_idx, outer, r, chunk, dst, dst_idx);
  } else {
    dim3 grid(td__cu_grid(outer * inner, TD_CU_THREADS), (unsigned)nsplit);
    max_cols_kernel<T><<<grid, TD_CU_THREADS>>>(x, in_idx, outer, r, inner, chunk, dst, dst_idx);
  }
  td_status st = td__cu_check_launch(op);
  if (st == TD_OK && nsplit > 1) st = max_typed<T>(dev, dst, dst_idx, outer, nsplit, inner, out, out_idx);
  if (tmp) td__cu_scratch_free(dev, tmp);
  if (tmp_idx) td__cu_scratch_free(dev, tmp_idx);
  return st;
}

/* ---- softmax ---- */

template <typename T>
__global__ void softmax_rows_kernel(const T *x, int64_t outer, int64_t r, bool log, T *y) {
  TD_CU_ROWS(o, outer) {
    const T *row = x + o * r;
    T *out = y + o * r;
    T mx = td__cu_lowest<T>();
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x) mx = td__cu_max_nan(mx, row[k]);
    mx = td__cu_block_max(mx);
    Acc<T> sum = 0;
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x) sum += exp(row[k] - mx);
    sum = td__cu_block_sum(sum);
    if (log) {
      Acc<T> ls = ::log(sum);
      for (int64_t k = threadIdx.x; k < r; k += blockDim.x)
        out[k] = (T)(((Acc<T>)row[k] - mx) - ls);
    } else {
      T inv = (T)((Acc<T>)1 / sum);
      for (int64_t k = threadIdx.x; k < r; k += blockDim.x) out[k] = exp(row[k] - mx) * inv;
    }
  }
}

template <typename T>
__global__ void softmax_cols_kernel(const T *x, int64_t outer, int64_t r, int64_t inner,
                                    bool log, T *y) {
  TD_CU_LOOP(t, outer * inner) {
    int64_t o = t / inner, i = t - o * inner;
    const T *p = x + o * r * inner + i;
    T *q = y + o * r * inner + i;
    T mx = td__cu_lowest<T>();
    for (int64_t k = 0; k < r; k++) mx = td__cu_max_nan(mx, p[k * inner]);
    Acc<T> sum = 0;
    for (int64_t k = 0; k < r; k++) sum += exp(p[k * inner] - mx);
    if (log) {
      Acc<T> ls = ::log(sum);
      for (int64_t k = 0; k < r; k++) q[k * inner] = (T)(((Acc<T>)p[k * inner] - mx) - ls);
    } else {
      T inv = (T)((Acc<T>)1 / sum);
      for (int64_t k = 0; k < r; k++) q[k * inner] = exp(p[k * inner] - mx) * inv;
    }
  }
}

/* softmax: gx = y * (gy - sum(gy * y)); log-softmax: gx = gy - exp(y) * sum(gy). */
template <typename T>
__global__ void softmax_bwd_rows_kernel(const T *y, const T *gy, int64_t outer, int64_t r,
                                        bool log, T *gx) {
  TD_CU_ROWS(o, outer) {
    int64_t base = o * r;
    Acc<T> s = 0;
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x)
      s += log ? (Acc<T>)gy[base + k] : (Acc<T>)gy[base + k] * y[base + k];
    T st = (T)td__cu_block_sum(s);
    for (int64_t k = threadIdx.x; k < r; k += blockDim.x) {
      int64_t p = base + k;
      gx[p] = log ? gy[p] - exp(y[p]) * st : y[p] * (gy[p] - st);
    }
  }
}

template <typename T>
__global__ void softmax_bwd_cols_kernel(const T *y, const T *gy, int64_t outer, int64_t r,
                                        int64_t inner, bool log, T *gx) {
  TD_CU_LOOP(t, outer * inner) {
    int64_t o = t / inner, i = t - o * inner;
    int64_t base = o * r * inner + i;
    Acc<T> s = 0;
    for (int64_t k = 0; k < r; k++) {
      int64_t p = base + k * inner;
      s += log ? (Acc<T>)gy[p] : (Acc<T>)gy[p] * y[p];
    }
    T st = (T)s;
    for (int64_t k = 0; k < r; k++) {
      int64_t p = base + k * inner;
      gx[p] = log ? gy[p] - exp(y[p]) * st : y[p] * (gy[p] - st);
    }
  }
}

/* ---- layer norm ---- */

template <typename T>
__global__ void layer_norm_kernel(const T *x, const T *w, const T *b, int64_t rows, int64_t n,
                                  T eps, T *y, T *mean, T *rstd) {
  TD_CU_ROWS(m, rows) {
    int64_t base = m * n;
    Acc<T> s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += x[base + j];
    Acc<T> mu = td__cu_block_sum(s) / (Acc<T>)n;
    Acc<T> v = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      Acc<T> d = x[base + j] - mu;
      v += d * d;
    }
    Acc<T> var = td__cu_block_sum(v) / (Acc<T>)n;
    T rs = (T)((Acc<T>)1 / sqrt(var + (Acc<T>)eps)), mt = (T)mu;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      T t = (x[base + j] - mt) * rs;
      if (w) t *= w[j];
      if (b) t += b[j];
      y[base + j] = t;
    }
    if (threadIdx.x == 0) {
      if (mean) mean[m] = mt;
      if (rstd) rstd[m] = rs;
    }
  }
}

/* gx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = gy * w and xhat = (x - mean) * rstd. */
template <typename T>
__global__ void layer_norm_bwd_kernel(const T *gy, const T *x, const T *w, const T *mean,
                                      const T *rstd, int64_t rows, int64_t n, T *gx) {
  TD_CU_ROWS(m, rows) {
    int64_t base = m * n;
    T mu = mean[m], rs = rstd[m];
    Acc<T> s1 = 0, s2 = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      T g = w ? gy[base + j] * w[j] : gy[base + j];
      s1 += g;
      s2 += (Acc<T>)g * ((x[base + j] - mu) * rs);
    }
    T m1 = (T)(td__cu_block_sum(s1) / (Acc<T>)n);
    T m2 = (T)(td__cu_block_sum(s2) / (Acc<T>)n);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      T g = w ? gy[base + j] * w[j] : gy[base + j];
      T xh = (x[base + j] - mu) * rs;
      gx[base + j] = rs * (g - m1 - xh * m2);
    }
  }
}

/* Partial column sums over a chunk of rows: gw_part[s, j] = sum gy * xhat, gb_part[s, j] = sum
 * gy (either output may be NULL). */
template <typename T>
__global__ void layer_norm_wb_kernel(const T *gy, const T *x, const T *mean, const T *rstd,
                                     int64_t rows, int64_t n, int64_t chunk, T *gw_part,
                                     T *gb_part) {
  int64_t s = blockIdx.y;
  int64_t m0 = s * chunk, m1 = min(rows, m0 + chunk);
  TD_CU_LOOP(j, n) {
    Acc<T> aw = 0, ab = 0;
    for (int64_t m = m0; m < m1; m++) {
      T g = gy[m * n + j];
      aw += (Acc<T>)g * ((x[m * n + j] - mean[m]) * rstd[m]);
      ab += g;
    }
    if (gw_part) gw_part[s * n + j] = (T)aw;
    if (gb_part) gb_part[s * n + j] = (T)ab;
  }
}

template <typename T>
td_status layer_norm_wb(int dev, const T *gy, const T *x, const T *mean, const T *rstd,
                        int64_t rows, int64_t n, T *gw, T *gb) {
  const char *op = "layer_norm_backward";
  int64_t ns = (131072 + n - 1) / n, by_rows = (rows + 31) / 32;
  if (ns > by_rows) ns = by_rows;
  if (ns < 1) ns = 1;
  if (ns > 65535) ns = 65535;
  int64_t chunk = rows > 0 ? (rows + ns - 1) / ns : 0; /* rows == 0: one pass writing zeros */
  if (rows > 0) ns = (rows + chunk - 1) / chunk;
  T *pw = gw, *pb = gb;
  void *tmp = nullptr;
  if (ns > 1) {
    TD_TRY(td__cu_scratch_alloc(dev, (size_t)(2 * ns * n) * sizeof(T), &tmp));
    pw = gw ? (T *)tmp : nullptr;
    pb = gb ? (T *)tmp + ns * n : nullptr;
  }
  dim3 grid(td__cu_grid(n, TD_CU_THREADS), (unsigned)ns);
  layer_norm_wb_kernel<T><<<grid, TD_CU_THREADS>>>(gy, x, mean, rstd, rows, n, chunk, pw, pb);
  td_status st = td__cu_check_launch(op);
  if (st == TD_OK && ns > 1 && gw) st = td__cu_sum_raw(sizeof(T) == 4 ? TD_DTYPE_F32 : TD_DTYPE_F64,
                                                      dev, pw, 1, ns, n, gw);
  if (st == TD_OK && ns > 1 && gb) st = td__cu_sum_raw(sizeof(T) == 4 ? TD_DTYPE_F32 : TD_DTYPE_F64,
                                                      dev, pb, 1, ns, n, gb);
  if (tmp) td__cu_scratch_free(dev, tmp);
  return st;
}

td_status check_float(const char *op, const td_tensor *t, td_dtype dt) {
  if (!t) return TD_OK;
  if (t->dtype != dt || (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64))
    return td_set_error(TD_ERR_DTYPE, "cuda %s: operands must share one float dtype (got %s)", op,
                        td_dtype_name(t->dtype));
  return TD_OK;
}

/* check_operands validates every non-NULL operand for a float-only contiguous entry. */
td_status check_operands(const char *op, const td_tensor *ref, const td_tensor *const *ts, int n) {
  TD_TRY(td__cu_enter(op, ref));
  for (int i = 0; i < n; i++) {
    TD_TRY(td__cu_same_device(op, ref, ts[i]));
    TD_TRY(td__cu_need_contig(op, ts[i]));
    TD_TRY(check_float(op, ts[i], ref->dtype));
  }
  return TD_OK;
}

} /* namespace */

/* ---- entries ---- */

td_status td__cu_sum_raw(td_dtype dt, int index, const void *x, int64_t outer, int64_t r,
                         int64_t inner, void *out) {
  switch (dt) {
    case TD_DTYPE_F32: return sum_typed(index, (const float *)x, outer, r, inner, (float *)out);
    case TD_DTYPE_F64: return sum_typed(index, (const double *)x, outer, r, inner, (double *)out);
    case TD_DTYPE_I64:
      return sum_typed(index, (const int64_t *)x, outer, r, inner, (int64_t *)out);
    default: break;
  }
  return td_set_error(TD_ERR_DTYPE, "cuda reduce_sum: bad dtype");
}

td_status td__cu_reduce_sum(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                            td_tensor *out) {
  const char *op = "reduce_sum";
  TD_TRY(td__cu_enter(op, out));
  TD_TRY(td__cu_same_device(op, out, x));
  TD_TRY(td__cu_need_contig(op, x));
  TD_TRY(td__cu_need_contig(op, out));
  if (x->dtype != out->dtype) return td_set_error(TD_ERR_DTYPE, "cuda reduce_sum: dtypes differ");
  if (td__cu_is_half(x->dtype)) { /* float32 sums, rounded to the 16-bit dtype once */
    td_tensor *of = NULL;
    TD_TRY(td__cu_up_empty(out, &of));
    td_status st;
    if (x->dtype == TD_DTYPE_BF16)
      st = sum_typed(td__cu_dev(out), (const td_bf16 *)td__cu_ptr(x), outer, r, inner,
                     (float *)td__cu_ptr(of));
    else
      st = sum_typed(td__cu_dev(out), (const td_f16 *)td__cu_ptr(x), outer, r, inner,
                     (float *)td__cu_ptr(of));
    if (st == TD_OK) st = td__cu_down(out, of);
    td_tensor_unref(of);
    return st;
  }
  return td__cu_sum_raw(x->dtype, td__cu_dev(out), td__cu_ptr(x), outer, r, inner,
                        td__cu_ptr(out));
}

td_status td__cu_reduce_max(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                            td_tensor *out, td_tensor *idx) {
  const char *op = "reduce_max";
  TD_TRY(td__cu_enter(op, out));
  TD_TRY(td__cu_same_device(op, out, x));
  TD_TRY(td__cu_same_device(op, out, idx));
  TD_TRY(td__cu_need_contig(op, x));
  TD_TRY(td__cu_need_contig(op, out));
  TD_TRY(td__cu_need_contig(op, idx));
  if (x->dtype != out->dtype) return td_set_error(TD_ERR_DTYPE, "cuda reduce_max: dtypes differ");
  if (td__cu_is_half(x->dtype)) { /* through float32 copies (exact: max picks an element) */
    td_tensor *xf = NULL, *of = NULL;
    td_status st = td__cu_up(x, &xf);
    if (st == TD_OK) st = td__cu_up_empty(out, &of);
    if (st == TD_OK) st = td__cu_reduce_max(xf, outer, r, inner, of, idx);
    if (st == TD_OK) st = td__cu_down(out, of);
    td_tensor_unref(xf);
    td_tensor_unref(of);
    return st;
  }
  if (idx && idx->dtype != TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "cuda reduce_max: indices must be int64");
  if (outer * inner == 0) return TD_OK;
  if (r == 0) return td_set_error(TD_ERR_INVALID, "cuda reduce_max: cannot reduce an empty dim");
  int dev = td__cu_dev(out);
  int64_t *pi = idx ? (int64_t *)td__cu_ptr(idx) : nullptr;
  switch (x->dtype) {
    case TD_DTYPE_F32:
      return max_typed(dev, (const float *)td__cu_ptr(x), nullptr, outer, r, inner,
                       (float *)td__cu_ptr(out), pi);
    case TD_DTYPE_F64:
      return max_typed(dev, (const double *)td__cu_ptr(x), nullptr, outer, r, inner,
                       (double *)td__cu_ptr(out), pi);
    case TD_DTYPE_I64:
      return max_typed(dev, (const int64_t *)td__cu_ptr(x), nullptr, outer, r, inner,
                       (int64_t *)td__cu_ptr(out), pi);
    default: break;
  }
  return td_set_error(TD_ERR_DTYPE, "cuda reduce_max: bad dtype");
}

td_status td__cu_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner, bool log,
                         td_tensor *y) {
  const char *op = "softmax";
  if (td__cu_is_half(y->dtype) || td__cu_is_half(x->dtype)) {
    td_tensor *xf = NULL, *yf = NULL;
    td_status st = td__cu_up(x, &xf);
    if (st == TD_OK) st = td__cu_up_empty(y, &yf);
    if (st == TD_OK) st = td__cu_softmax(xf, outer, r, inner, log, yf);
    if (st == TD_OK) st = td__cu_down(y, yf);
    td_tensor_unref(xf);
    td_tensor_unref(yf);
    return st;
  }
  const td_tensor *ts[] = {x, y};
  TD_TRY(check_operands(op, y, ts, 2));
  if (outer * r * inner == 0) return TD_OK;
  if (inner == 1) {
    int threads = td__cu_block_threads(r);
    if (y->dtype == TD_DTYPE_F32)
      softmax_rows_kernel<float><<<row_grid(outer), threads>>>(
          (const float *)td__cu_ptr(x), outer, r, log, (float *)td__cu_ptr(y));
    else
      softmax_rows_kernel<double><<<row_grid(outer), threads>>>(
          (const double *)td__cu_ptr(x), outer, r, log, (double *)td__cu_ptr(y));
  } else {
    unsigned grid = td__cu_grid(outer * inner, TD_CU_THREADS);
    if (y->dtype == TD_DTYPE_F32)
      softmax_cols_kernel<float><<<grid, TD_CU_THREADS>>>(
          (const float *)td__cu_ptr(x), outer, r, inner, log, (float *)td__cu_ptr(y));
    else
      softmax_cols_kernel<double><<<grid, TD_CU_THREADS>>>(
          (const double *)td__cu_ptr(x), outer, r, inner, log, (double *)td__cu_ptr(y));
  }
  return td__cu_check_launch(op);
}

td_status td__cu_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                  int64_t r, int64_t inner, bool log, td_tensor *gx) {
  const char *op = "softmax_backward";
  if (td__cu_is_half(gx->dtype) || td__cu_is_half(y->dtype)) {
    td_tensor *yf = NULL, *gyf = NULL, *gxf = NULL;
    td_status st = td__cu_up(y, &yf);
    if (st == TD_OK) st = td__cu_up(gy, &gyf);
    if (st == TD_OK) st = td__cu_up_empty(gx, &gxf);
    if (st == TD_OK) st = td__cu_softmax_backward(yf, gyf, outer, r, inner, log, gxf);
    if (st == TD_OK) st = td__cu_down(gx, gxf);
    td_tensor_unref(yf);
    td_tensor_unref(gyf);
    td_tensor_unref(gxf);
    return st;
  }
  const td_tensor *ts[] = {y, gy, gx};
  TD_TRY(check_operands(op, gx, ts, 3));
  if (outer * r * inner == 0) return TD_OK;
  if (inner == 1) {
    int threads = td__cu_block_threads(r);
    if (gx->dtype == TD_DTYPE_F32)
      softmax_bwd_rows_kernel<float><<<row_grid(outer), threads>>>(
          (const float *)td__cu_ptr(y), (const float *)td__cu_ptr(gy), outer, r, log,
          (float *)td__cu_ptr(gx));
    else
      softmax_bwd_rows_kernel<double><<<row_grid(outer), threads>>>(
          (const double *)td__cu_ptr(y), (const double *)td__cu_ptr(gy), outer, r, log,
          (double *)td__cu_ptr(gx));
  } else {
    unsigned grid = td__cu_grid(outer * inner, TD_CU_THREADS);
    if (gx->dtype == TD_DTYPE_F32)
      softmax_bwd_cols_kernel<float><<<grid, TD_CU_THREADS>>>(
          (const float *)td__cu_ptr(y), (const float *)td__cu_ptr(gy), outer, r, inner, log,
          (float *)td__cu_ptr(gx));
    else
      softmax_bwd_cols_kernel<double><<<grid, TD_CU_THREADS>>>(
          (const double *)td__cu_ptr(y), (const double *)td__cu_ptr(gy), outer, r, inner, log,
          (double *)td__cu_ptr(gx));
  }
  return td__cu_check_launch(op);
}

/* layer_norm_dims returns M and N of x viewed as [M, N]: from the element counts of mean
 * (M) and x, as on the CPU, or from x's last dim when there is no mean tensor (or no row). */
static void layer_norm_dims(const td_tensor *x, const td_tensor *mean, const td_tensor *param,
                            int64_t *rows, int64_t *n) {
  int64_t m = mean ? td__cu_numel(mean) : 0;
  if (m > 0) {
    *rows = m;
    *n = td__cu_numel(x) / m;
    return;
  }
  *n = param ? td__cu_numel(param) : (x->ndim > 0 ? x->shape[x->ndim - 1] : 1);
  *rows = *n > 0 ? td__cu_numel(x) / *n : 0;
}

td_status td__cu_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                            double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd) {
  const char *op = "layer_norm";
  if (td__cu_is_half(x->dtype) || td__cu_is_half(y->dtype)) {
    td_tensor *f[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    td_status st = td__cu_up(x, &f[0]);
    if (st == TD_OK) st = td__cu_up(w, &f[1]);
    if (st == TD_OK) st = td__cu_up(b, &f[2]);
    if (st == TD_OK) st = td__cu_up_empty(y, &f[3]);
    if (st == TD_OK) st = td__cu_up_empty(mean, &f[4]);
    if (st == TD_OK) st = td__cu_up_empty(rstd, &f[5]);
    if (st == TD_OK) st = td__cu_layer_norm(f[0], f[1], f[2], eps, f[3], f[4], f[5]);
    if (st == TD_OK) st = td__cu_down(y, f[3]);
    if (st == TD_OK) st = td__cu_down(mean, f[4]);
    if (st == TD_OK) st = td__cu_down(rstd, f[5]);
    for (int i = 0; i < 6; i++) td_tensor_unref(f[i]);
    return st;
  }
  const td_tensor *ts[] = {x, w, b, y, mean, rstd};
  TD_TRY(check_operands(op, y, ts, 6));
  int64_t rows, n;
  layer_norm_dims(x, mean, w ? w : b, &rows, &n);
  if (rows * n != td__cu_numel(x) || td__cu_numel(y) != rows * n ||
      (rstd && td__cu_numel(rstd) != rows))
    return td_set_error(TD_ERR_SHAPE, "cuda layer_norm: inconsistent element counts");
  if (w && td__cu_numel(w) != n)
    return td_set_error(TD_ERR_SHAPE, "cuda layer_norm: weight has %lld elements, rows have %lld",
                        (long long)td__cu_numel(w), (long long)n);
  if (b && td__cu_numel(b) != n)
    return td_set_error(TD_ERR_SHAPE, "cuda layer_norm: bias has %lld elements, rows have %lld",
                        (long long)td__cu_numel(b), (long long)n);
  if (rows == 0 || n == 0) return TD_OK;
  int threads = td__cu_block_threads(n);
#define TD_CU_PTR(t, T) ((t) ? (T *)td__cu_ptr(t) : (T *)nullptr)
  if (y->dtype == TD_DTYPE_F32)
    layer_norm_kernel<float><<<row_grid(rows), threads>>>(
        TD_CU_PTR(x, const float), TD_CU_PTR(w, const float), TD_CU_PTR(b, const float), rows, n,
        (float)eps, TD_CU_PTR(y, float), TD_CU_PTR(mean, float), TD_CU_PTR(rstd, float));
  else
    layer_norm_kernel<double><<<row_grid(rows), threads>>>(
        TD_CU_PTR(x, const double), TD_CU_PTR(w, const double), TD_CU_PTR(b, const double), rows, n,
        eps, TD_CU_PTR(y, double), TD_CU_PTR(mean, double), TD_CU_PTR(rstd, double));
  return td__cu_check_launch(op);
}

td_status td__cu_layer_norm_backward(const td_tensor *gy, const td_tensor *x, const td_tensor *w,
                                     const td_tensor *mean, const td_tensor *rstd,
                                     td_tensor *gx, td_tensor *gw, td_tensor *gb) {
  const char *op = "layer_norm_backward";
  if (td__cu_is_half(x->dtype) || td__cu_is_half(gy->dtype)) {
    td_tensor *f[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    td_status st = td__cu_up(gy, &f[0]);
    if (st == TD_OK) st = td__cu_up(x, &f[1]);
    if (st == TD_OK) st = td__cu_up(w, &f[2]);
    if (st == TD_OK) st = td__cu_up(mean, &f[3]);
    if (st == TD_OK) st = td__cu_up(rstd, &f[4]);
    if (st == TD_OK) st = td__cu_up_empty(gx, &f[5]);
    if (st == TD_OK) st = td__cu_up_empty(gw, &f[6]);
    if (st == TD_OK) st = td__cu_up_empty(gb, &f[7]);
    if (st == TD_OK)
      st = td__cu_layer_norm_backward(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
    if (st == TD_OK) st = td__cu_down(gx, f[5]);
    if (st == TD_OK) st = td__cu_down(gw, f[6]);
    if (st == TD_OK) st = td__cu_down(gb, f[7]);
    for (int i = 0; i < 8; i++) td_tensor_unref(f[i]);
    return st;
  }
  const td_tensor *ts[] = {gy, x, w, mean, rstd, gx, gw, gb};
  TD_TRY(check_operands(op, x, ts, 8));
  if (!mean || !rstd)
    return td_set_error(TD_ERR_INVALID, "cuda layer_norm_backward: needs the saved mean and rstd");
  int64_t rows, n;
  layer_norm_dims(x, mean, gw ? gw : gb, &rows, &n);
  if (n == 0) return TD_OK;
  if (rows * n != td__cu_numel(x) || td__cu_numel(gy) != rows * n ||
      td__cu_numel(rstd) != rows || (gx && td__cu_numel(gx) != rows * n) ||
      (gw && td__cu_numel(gw) != n) || (gb && td__cu_numel(gb) != n))
    return td_set_error(TD_ERR_SHAPE, "cuda layer_norm_backward: inconsistent element counts");
  int dev = td__cu_dev(x);
  if (gx && rows > 0) {
    int threads = td__cu_block_threads(n);
    if (x->dtype == TD_DTYPE_F32)
      layer_norm_bwd_kernel<float><<<row_grid(rows), threads>>>(
          TD_CU_PTR(gy, const float), TD_CU_PTR(x, const float), TD_CU_PTR(w, const float),
          TD_CU_PTR(mean, const float), TD_CU_PTR(rstd, const float), rows, n,
          TD_CU_PTR(gx, float));
    else
      layer_norm_bwd_kernel<double><<<row_grid(rows), threads>>>(
          TD_CU_PTR(gy, const double), TD_CU_PTR(x, const double), TD_CU_PTR(w, const double),
          TD_CU_PTR(mean, const double), TD_CU_PTR(rstd, const double), rows, n,
          TD_CU_PTR(gx, double));
    TD_TRY(td__cu_check_launch(op));
  }
  if (!gw && !gb) return TD_OK;
  if (x->dtype == TD_DTYPE_F32)
    return layer_norm_wb<float>(dev, TD_CU_PTR(gy, const float), TD_CU_PTR(x, const float),
                                TD_CU_PTR(mean, const float), TD_CU_PTR(rstd, const float), rows,
                                n, TD_CU_PTR(gw, float), TD_CU_PTR(gb, float));
  return layer_norm_wb<double>(dev, TD_CU_PTR(gy, const double), TD_CU_PTR(x, const double),
                               TD_CU_PTR(mean, const double), TD_CU_PTR(rstd, const double), rows,
                               n, TD_CU_PTR(gw, double), TD_CU_PTR(gb, double));
#undef TD_CU_PTR
}
