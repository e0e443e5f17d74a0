/* tensor.h - N-d tensors over reference-counted storage, and the ops on them.
 *
 * A td_tensor is a view (shape, strides in elements, offset) over a td storage block that lives
 * on one device. Views (reshape of a contiguous tensor, narrow, transpose, permute, unsqueeze,
 * squeeze, expand, detach) share storage and cost no copy. Tensors are reference counted.
 *
 * Ops are functions `td_tensor_<op>(inputs..., td_tensor **out)`: on TD_OK *out holds a new
 * reference; on failure *out is untouched and td_last_error() says why (which op, which shapes).
 * When grad mode is on (see autograd.h) and an input requires grad, the result records a backward
 * node so that td_autograd_backward() can differentiate through it.
 *
 * THREAD SAFETY: every function may be called from any thread. Tensors are immutable through this
 * API except for the explicitly in-place functions (suffix `_`), which the caller must not run
 * concurrently with other uses of the same tensor.
 */
#ifndef TDIST_TENSOR_H
#define TDIST_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Maximum number of dimensions of a tensor. */
#define TD_MAX_DIMS 8

/* Element types. float32, float64, bfloat16 and float16 are computed with (the floating dtypes:
 * td_dtype_is_float), int64 too where integers make sense (indices, counts, arithmetic). The
 * two 16-bit floats live on the CPU and on CUDA devices: their kernels load into float32, compute
 * there (matrix products accumulate in float32: OpenBLAS/oneDNN on the CPU, tensor cores through
 * cuBLASLt on CUDA; sums, softmax, layer norm and losses read them into float32) and round the
 * result to nearest even.
 * Most programs use them through autocast (td_autocast_begin below: float32 weights, 16-bit
 * compute) rather than as parameters. int32, uint8 and bool (numbers >= 5) exist for transport
 * and storage - the dtypes other runtimes hand over (PyTorch, numpy): CPU tensors of them can be
 * created (td_tensor_empty/zeros/full, from_buffer, from_borrowed), viewed, copied and converted
 * to and from every dtype (td_tensor_to_dtype, td_tensor_copy_: float -> integer truncates,
 * -> bool is != 0), read (td_tensor_get, item), compared (td_tensor_allclose) and sent in RPC
 * values; every other op, autograd and CUDA placement refuse them with TD_ERR_DTYPE ("<op>: int32
 * is a transport-only dtype ..."). */
typedef enum td_dtype {
  TD_DTYPE_F32 = 0,
  TD_DTYPE_F64 = 1,
  TD_DTYPE_I64 = 2,
  TD_DTYPE_F16 = 3,  /* IEEE 754 binary16 */
  TD_DTYPE_BF16 = 4, /* bfloat16: the upper half of a float32 (rounded to nearest even) */
  TD_DTYPE_I32 = 5,
  TD_DTYPE_U8 = 6,
  TD_DTYPE_BOOL = 7, /* one byte, 0 or 1 */
} td_dtype;

/* The number of dtypes (valid dtypes are 0 .. TD_DTYPE_COUNT - 1). */
#define TD_DTYPE_COUNT 8

typedef enum td_device_type {
  TD_DEVICE_CPU = 0,
  TD_DEVICE_CUDA = 1,
} td_device_type;

/* A device: its type and, for CUDA, the ordinal (0 for CPU). */
typedef struct td_device {
  td_device_type type;
  int index;
} td_device;

typedef struct td_tensor td_tensor;
typedef struct td_generator td_generator;

/* td_device_cpu returns the CPU device. */
TD_API td_device td_device_cpu(void);
/* td_device_cuda returns the CUDA device with the given ordinal. */
TD_API td_device td_device_cuda(int index);
/* td_device_parse parses "cpu", "cuda" or "cuda:N" into *out. TD_ERR_INVALID on other text. */
TD_API td_status td_device_parse(const char *text, td_device *out);
/* td_device_str writes "cpu" or "cuda:N" into buf (at least 16 bytes) and returns buf. */
TD_API const char *td_device_str(td_device d, char *buf, size_t n);
/* td_device_equal returns true when a and b name the same device. */
TD_API bool td_device_equal(td_device a, td_device b);
/* td_device_available returns true when tensors can be allocated on d in this process (always
 * for CPU; for CUDA only when the build has CUDA and the device exists). */
TD_API bool td_device_available(td_device d);
/* td_cuda_device_count returns the number of CUDA devices usable by this process (0 without a
 * CUDA build or without a GPU), after CUDA_VISIBLE_DEVICES. It never initialises CUDA in the
 * calling process (it asks NVML, or a short-lived child process), so a program may count devices
 * and then fork() workers that use CUDA. Computed once per process. THREAD SAFETY: any thread; the
 * first call may block while the probe child runs (at most 30 s). */
TD_API int td_cuda_device_count(void);
/* td_cuda_set_device sets this process's CUDA device, like torch.cuda.set_device: the device
 * every NCCL process group created afterwards uses. -1 returns to the default choice:
 * cuda:(LOCAL_RANK % count) when LOCAL_RANK is set, else cuda:(world rank % count). Does not
 * initialise CUDA. TD_ERR_DEVICE when index >= td_cuda_device_count(); TD_ERR_UNSUPPORTED
 * without CUDA in the build. THREAD SAFETY: any thread. */
TD_API td_status td_cuda_set_device(int index);
/* td_cuda_get_device returns the device set with td_cuda_set_device, or -1. THREAD SAFETY: any
 * thread. */
TD_API int td_cuda_get_device(void);
/* td_cuda_empty_cache gives every cached, unused block of the CUDA caching allocator back to the
 * driver (all devices), so that other processes on the GPU can use the memory. Blocks in use are
 * not affected. TD_OK without CUDA in the build (nothing is cached). THREAD SAFETY: any thread;
 * blocks while the driver frees (cudaFree synchronises the device); other threads keep
 * allocating meanwhile. */
TD_API td_status td_cuda_empty_cache(void);
/* td_cuda_memory_info reports the caching allocator's bytes on device: *in_use (handed out to
 * tensors, rounded to the allocator's size classes) and *cached (kept for reuse). TD_ERR_DEVICE
 * for a device that does not exist; TD_ERR_UNSUPPORTED without CUDA in the build. THREAD
 * SAFETY: any thread. */
TD_API td_status td_cuda_memory_info(int device, size_t *in_use, size_t *cached);
/* td_cuda_memory_peak reports in *peak (may be NULL) the most bytes the caching allocator had
 * handed out on device at once (torch.cuda.max_memory_allocated) since the device's first
 * allocation or the last reset; reset (torch.cuda.reset_peak_memory_stats) then sets the peak to
 * the bytes in use now. Errors as td_cuda_memory_info. THREAD SAFETY: any thread. */
TD_API td_status td_cuda_memory_peak(int device, bool reset, size_t *peak);
/* td_cuda_device_name writes device's name as the CUDA runtime reports it ("NVIDIA H100 80GB
 * HBM3") into buf (n bytes, NUL-terminated; truncated if needed). Initialises CUDA in the
 * calling process (a process that forks CUDA users afterwards must not call it). Errors as
 * td_cuda_memory_info. */
TD_API td_status td_cuda_device_name(int device, char *buf, size_t n);
/* td_cpu_memory_info reports the CPU allocator's bytes: *in_use (the blocks held by tensors and
 * by tdist's own buffers, each rounded up to 4 KiB: torch.cuda.memory_allocated's figure for
 * host memory), *peak (the most in use since the process started or td_cpu_reset_peak_memory)
 * and *cached (freed blocks kept for reuse, TD_CPU_CACHE_MB). Library code, thread stacks and
 * malloc's own state are not counted: RSS is larger. Any pointer may be NULL. THREAD SAFETY: any
 * thread. */
TD_API void td_cpu_memory_info(size_t *in_use, size_t *peak, size_t *cached);
/* td_cpu_reset_peak_memory sets the peak to the bytes in use now, like
 * torch.cuda.reset_peak_memory_stats. THREAD SAFETY: any thread. */
TD_API void td_cpu_reset_peak_memory(void);

/* td_dtype_size returns the size in bytes of one element (1, 2, 4 or 8; 0 for a number that is
 * no dtype). */
TD_API size_t td_dtype_size(td_dtype dt);
/* td_dtype_name returns PyTorch's name of dt: "float32", "float64", "int64", "float16",
 * "bfloat16", "int32", "uint8", "bool" ("unknown" for a number that is no dtype); never NULL.
 * Static storage. */
TD_API const char *td_dtype_name(td_dtype dt);
/* td_dtype_is_float returns true for float32, float64, bfloat16 and float16: the dtypes that can
 * require grad. */
TD_API bool td_dtype_is_float(td_dtype dt);

/* ---- mixed precision (autocast) ----
 *
 * An autocast scope makes this thread's ops compute in a 16-bit float while the tensors a program
 * holds (parameters, optimizer state) stay float32, as torch.autocast does:
 *   - matmul, linear, conv2d and scaled_dot_product_attention cast their floating inputs to the
 *     scope's dtype and compute there (products accumulate in float32); the result has the
 *     scope's dtype;
 *   - softmax, log_softmax, layer_norm, the losses (cross_entropy, nll_loss, mse_loss), sum and
 *     mean cast 16-bit inputs to float32 and return float32;
 *   - every other op runs in its inputs' dtype, and binary ops of two floating dtypes compute in
 *     the wider one (bfloat16 + float32 -> float32; bfloat16 + float16 -> float32).
 * The casts are differentiable: a float32 weight's gradient arrives in float32. The cast of a
 * leaf that requires grad (a weight) is made once per outermost scope and reused by every op that
 * reads the weight in that scope (cleared when the outermost scope ends), so a forward pass
 * converts each weight once. Backward passes ignore autocast (each node computes in the dtypes its
 * forward saw), so calling backward inside or outside the scope gives the same gradients.
 *
 *   td_autocast_begin(TD_DTYPE_BF16);
 *   td_module_forward(model, x, &logits);  td_tensor_cross_entropy(logits, y, ..., &loss);
 *   td_autocast_end();
 *   td_tensor_backward(loss, NULL);  td_optim_step(opt);
 *
 * Modules can carry the setting themselves (td_module_set_autocast in nn.h), which is what a
 * pipeline stage or an RPC handler (other threads) needs. */
/* td_autocast_begin opens an autocast scope on this thread computing in dt (TD_DTYPE_BF16 or
 * TD_DTYPE_F16), or, with TD_DTYPE_F32 or TD_DTYPE_F64, a scope with autocast off (a region that
 * must run in full precision inside an autocast scope). Scopes nest (at most 64 deep); close each
 * with td_autocast_end. TD_ERR_DTYPE for another dtype, TD_ERR_STATE past 64. THREAD SAFETY:
 * per thread. */
TD_API td_status td_autocast_begin(td_dtype dt);
/* td_autocast_end closes the innermost scope; closing the outermost one releases the cached weight
 * casts. Does nothing without an open scope. */
TD_API void td_autocast_end(void);
/* td_autocast_dtype returns true when autocast is on for this thread and then stores its dtype in
 * *dt (dt may be NULL). */
TD_API bool td_autocast_dtype(td_dtype *dt);
/* td_autocast_cache_stats reports this thread's weight-cast cache: *casts made since the outermost
 * scope opened and *hits (reuses). Either pointer may be NULL. For tests and tuning. */
TD_API void td_autocast_cache_stats(int64_t *casts, int64_t *hits);

/* ---- generators ---- */

/* td_generator_create makes a deterministic random generator seeded with seed (PCG64-style
 * stream; the same seed gives the same numbers on every platform). Release with
 * td_generator_destroy(). THREAD SAFETY: a generator must not be used by two threads at once. */
TD_API td_status td_generator_create(uint64_t seed, td_generator **out);
TD_API void td_generator_destroy(td_generator *g);
/* td_generator_next_u64 returns the next 64 random bits. */
TD_API uint64_t td_generator_next_u64(td_generator *g);
/* td_generator_next_double returns a uniform double in [0, 1). */
TD_API double td_generator_next_double(td_generator *g);

/* ---- reference counting and metadata ---- */

/* td_tensor_ref adds a reference and returns t. */
TD_API td_tensor *td_tensor_ref(td_tensor *t);
/* td_tensor_unref drops a reference; the last one frees the tensor. NULL does nothing. */
TD_API void td_tensor_unref(td_tensor *t);

TD_API int td_tensor_ndim(const td_tensor *t);
/* td_tensor_shape returns the shape array (ndim entries). Borrowed; valid while t lives. */
TD_API const int64_t *td_tensor_shape(const td_tensor *t);
/* td_tensor_strides returns the strides in elements. Borrowed; valid while t lives. */
TD_API const int64_t *td_tensor_strides(const td_tensor *t);
/* td_tensor_size returns the size of dimension dim (negative counts from the end), or -1 when dim
 * is out of range. */
TD_API int64_t td_tensor_size(const td_tensor *t, int dim);
TD_API int64_t td_tensor_numel(const td_tensor *t);
TD_API td_dtype td_tensor_dtype(const td_tensor *t);
TD_API td_device td_tensor_device(const td_tensor *t);
/* td_tensor_nbytes returns numel * element size. */
TD_API size_t td_tensor_nbytes(const td_tensor *t);
TD_API bool td_tensor_is_contiguous(const td_tensor *t);
/* td_tensor_data returns the address of element 0 (host pointer for CPU tensors, device pointer
 * for CUDA tensors). Borrowed; valid while t lives. Writing through it bypasses autograd. */
TD_API void *td_tensor_data(const td_tensor *t);
/* td_tensor_same_shape returns true when a and b have equal shapes. */
TD_API bool td_tensor_same_shape(const td_tensor *a, const td_tensor *b);
/* td_tensor_shape_str writes "[2, 3]" into buf and returns buf. */
TD_API const char *td_tensor_shape_str(const td_tensor *t, char *buf, size_t n);

/* ---- creation ---- */

/* td_tensor_empty makes an uninitialised tensor. ndim may be 0 (a scalar); shape may be NULL then.
 * Returns a new reference in *out; release with td_tensor_unref(). */
TD_API td_status td_tensor_empty(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                                 td_tensor **out);
TD_API td_status td_tensor_zeros(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                                 td_tensor **out);
TD_API td_status td_tensor_ones(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                                td_tensor **out);
TD_API td_status td_tensor_full(const int64_t *shape, int ndim, double value, td_dtype dt,
                                td_device dev, td_tensor **out);
/* td_tensor_scalar makes a 0-d tensor holding value. */
TD_API td_status td_tensor_scalar(double value, td_dtype dt, td_device dev, td_tensor **out);
/* td_tensor_arange makes the 1-d tensor start, start+step, ... (< end for step > 0). */
TD_API td_status td_tensor_arange(double start, double end, double step, td_dtype dt,
                                  td_device dev, td_tensor **out);
/* td_tensor_uniform fills a new tensor with U[lo, hi) from g (float dtypes only). */
TD_API td_status td_tensor_uniform(const int64_t *shape, int ndim, double lo, double hi,
                                   td_dtype dt, td_device dev, td_generator *g, td_tensor **out);
/* td_tensor_normal fills a new tensor with N(mean, std^2) from g (float dtypes only). */
TD_API td_status td_tensor_normal(const int64_t *shape, int ndim, double mean, double std,
                                  td_dtype dt, td_device dev, td_generator *g, td_tensor **out);
/* td_tensor_from_buffer copies numel elements from a host buffer into a new CPU tensor. */
TD_API td_status td_tensor_from_buffer(const void *data, const int64_t *shape, int ndim,
                                       td_dtype dt, td_tensor **out);
/* td_tensor_release_fn is called once when the last tensor over a borrowed buffer goes away. */
typedef void (*td_tensor_release_fn)(void *ctx, void *data);
/* td_tensor_from_borrowed wraps a caller's host buffer without copying. On TD_OK, release(ctx,
 * data) runs exactly once when the last view of the storage dies; on failure it never runs and the
 * caller keeps the buffer. release may be NULL (the caller guarantees the buffer outlives every
 * view). */
TD_API td_status td_tensor_from_borrowed(void *data, const int64_t *shape, int ndim, td_dtype dt,
                                         td_tensor_release_fn release, void *ctx,
                                         td_tensor **out);
/* td_tensor_to copies t to device dev (a new reference to t itself when it is already there).
 * Differentiable. */
TD_API td_status td_tensor_to(const td_tensor *t, td_device dev, td_tensor **out);
/* td_tensor_to_dtype converts t to dtype dt (a new reference to t when it already has it).
 * Differentiable between float dtypes. */
TD_API td_status td_tensor_to_dtype(const td_tensor *t, td_dtype dt, td_tensor **out);
/* td_tensor_copy_to_buffer copies t's elements in row-major order into a host buffer of nbytes
 * (must be >= td_tensor_nbytes(t)). Works for any device and any strides. */
TD_API td_status td_tensor_copy_to_buffer(const td_tensor *t, void *buf, size_t nbytes);
/* td_tensor_item returns the single element of a one-element tensor as a double in *out. */
TD_API td_status td_tensor_item(const td_tensor *t, double *out);
/* td_tensor_get returns the element at a full index (ndim entries) as a double. */
TD_API td_status td_tensor_get(const td_tensor *t, const int64_t *index, double *out);

/* ---- views (share storage; differentiable) ---- */

/* td_tensor_reshape returns a view when t is contiguous, else a contiguous copy. One entry of
 * shape may be -1 (inferred). */
TD_API td_status td_tensor_reshape(const td_tensor *t, const int64_t *shape, int ndim,
                                   td_tensor **out);
/* td_tensor_flatten merges dims start..end (inclusive; negative counts from the end). */
TD_API td_status td_tensor_flatten(const td_tensor *t, int start, int end, td_tensor **out);
/* td_tensor_narrow returns the view of length len starting at start along dim. */
TD_API td_status td_tensor_narrow(const td_tensor *t, int dim, int64_t start, int64_t len,
                                  td_tensor **out);
TD_API td_status td_tensor_transpose(const td_tensor *t, int d0, int d1, td_tensor **out);
/* td_tensor_permute reorders the dims: result dim i is input dim perm[i]. */
TD_API td_status td_tensor_permute(const td_tensor *t, const int *perm, int ndim,
                                   td_tensor **out);
TD_API td_status td_tensor_unsqueeze(const td_tensor *t, int dim, td_tensor **out);
/* td_tensor_squeeze removes dimension dim, which must have size 1 (a view for any layout). */
TD_API td_status td_tensor_squeeze(const td_tensor *t, int dim, td_tensor **out);
/* td_tensor_unbind returns the size(dim) slices of t along dim, with dim removed, as views in
 * outs[0..size(dim)) (PyTorch's unbind, e.g. q, k, v = qkv.unbind(2)); one backward node writes
 * their gradients into one tensor. New references; on failure outs is untouched. */
TD_API td_status td_tensor_unbind(const td_tensor *t, int dim, td_tensor **outs);
/* td_tensor_expand broadcasts size-1 dims to shape (stride 0), adding leading dims as needed. */
TD_API td_status td_tensor_expand(const td_tensor *t, const int64_t *shape, int ndim,
                                  td_tensor **out);
/* td_tensor_contiguous returns t itself (new reference) when contiguous, else a copy. */
TD_API td_status td_tensor_contiguous(const td_tensor *t, td_tensor **out);
/* td_tensor_clone returns a contiguous copy with its own storage. Differentiable. */
TD_API td_status td_tensor_clone(const td_tensor *t, td_tensor **out);
/* td_tensor_detach returns a view sharing storage that does not require grad and has no history. */
TD_API td_status td_tensor_detach(const td_tensor *t, td_tensor **out);

/* ---- elementwise (broadcasting, differentiable) ---- */

TD_API td_status td_tensor_add(const td_tensor *a, const td_tensor *b, td_tensor **out);
TD_API td_status td_tensor_sub(const td_tensor *a, const td_tensor *b, td_tensor **out);
TD_API td_status td_tensor_mul(const td_tensor *a, const td_tensor *b, td_tensor **out);
TD_API td_status td_tensor_div(const td_tensor *a, const td_tensor *b, td_tensor **out);
/* td_tensor_maximum is the elementwise max (gradient to the larger; ties split evenly). */
TD_API td_status td_tensor_maximum(const td_tensor *a, const td_tensor *b, td_tensor **out);
/* Scalar forms: a + s, a * s, a ^ p. */
TD_API td_status td_tensor_add_scalar(const td_tensor *a, double s, td_tensor **out);
TD_API td_status td_tensor_mul_scalar(const td_tensor *a, double s, td_tensor **out);
TD_API td_status td_tensor_pow_scalar(const td_tensor *a, double p, td_tensor **out);
TD_API td_status td_tensor_neg(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_exp(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_log(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_sqrt(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_tanh(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_sigmoid(const td_tensor *a, td_tensor **out);
TD_API td_status td_tensor_relu(const td_tensor *a, td_tensor **out);
/* td_tensor_gelu is the exact (erf) GELU, PyTorch's default. */
TD_API td_status td_tensor_gelu(const td_tensor *a, td_tensor **out);

/* ---- linear algebra ---- */

/* td_tensor_matmul follows torch.matmul: 1-d x 1-d dot, 2-d x 2-d GEMM, batched with
 * broadcasting of the batch dims for >= 3-d, 1-d operands promoted and the added dim removed. */
TD_API td_status td_tensor_matmul(const td_tensor *a, const td_tensor *b, td_tensor **out);

/* td_tensor_linear is torch.nn.functional.linear: y = x W^T + b for x [..., in], weight
 * [out, in], bias [out] or NULL -> y [..., out], as one GEMM that reads W in place and starts
 * from the bias (no separate broadcast add). */
TD_API td_status td_tensor_linear(const td_tensor *x, const td_tensor *weight,
                                  const td_tensor *bias, td_tensor **out);

/* ---- reductions (differentiable) ---- */

/* td_tensor_sum_all / mean_all reduce every element to a 0-d tensor. */
TD_API td_status td_tensor_sum_all(const td_tensor *t, td_tensor **out);
TD_API td_status td_tensor_mean_all(const td_tensor *t, td_tensor **out);
/* td_tensor_sum / mean reduce over the ndims dims listed (negative allowed), keeping them as size
 * 1 when keepdim. */
TD_API td_status td_tensor_sum(const td_tensor *t, const int *dims, int ndims, bool keepdim,
                               td_tensor **out);
TD_API td_status td_tensor_mean(const td_tensor *t, const int *dims, int ndims, bool keepdim,
                                td_tensor **out);
/* td_tensor_max reduces over one dim; *values gets the maxima and, when indices is not NULL,
 * *indices their int64 positions (first occurrence). Gradient flows to the arg-max. */
TD_API td_status td_tensor_max(const td_tensor *t, int dim, bool keepdim, td_tensor **values,
                               td_tensor **indices);
/* td_tensor_argmax returns the int64 positions of the maxima along dim (not differentiable). */
TD_API td_status td_tensor_argmax(const td_tensor *t, int dim, bool keepdim, td_tensor **out);

/* ---- neural-network ops (differentiable) ---- */

TD_API td_status td_tensor_softmax(const td_tensor *t, int dim, td_tensor **out);
TD_API td_status td_tensor_log_softmax(const td_tensor *t, int dim, td_tensor **out);

typedef enum td_reduction {
  TD_REDUCTION_MEAN = 0,
  TD_REDUCTION_SUM = 1,
  TD_REDUCTION_NONE = 2,
} td_reduction;

/* td_tensor_nll_loss: logp [N, C] (or [C]), target int64 [N] (or []); entries equal to
 * ignore_index contribute nothing (mean divides by the count of the others). */
TD_API td_status td_tensor_nll_loss(const td_tensor *logp, const td_tensor *target,
                                    td_reduction red, int64_t ignore_index, td_tensor **out);
/* td_tensor_cross_entropy = nll_loss(log_softmax(logits, 1), target). */
TD_API td_status td_tensor_cross_entropy(const td_tensor *logits, const td_tensor *target,
                                         td_reduction red, int64_t ignore_index,
                                         td_tensor **out);
/* td_tensor_mse_loss: mean (or sum, or none) of (a - b)^2; shapes must match. */
TD_API td_status td_tensor_mse_loss(const td_tensor *a, const td_tensor *b, td_reduction red,
                                    td_tensor **out);

/* td_tensor_conv2d: x [N, C, H, W], w [O, C/groups, kh, kw], bias [O] or NULL; groups = 1. */
TD_API td_status td_tensor_conv2d(const td_tensor *x, const td_tensor *w, const td_tensor *bias,
                                  int stride_h, int stride_w, int pad_h, int pad_w,
                                  td_tensor **out);
/* td_tensor_max_pool2d: x [N, C, H, W]; no padding; floor mode. */
TD_API td_status td_tensor_max_pool2d(const td_tensor *x, int kh, int kw, int stride_h,
                                      int stride_w, td_tensor **out);
/* td_tensor_embedding: weight [V, D], int64 indices of any shape -> [..., D]. Indices out of
 * range are TD_ERR_INVALID naming the bad index. */
TD_API td_status td_tensor_embedding(const td_tensor *weight, const td_tensor *indices,
                                     td_tensor **out);
/* td_tensor_dropout zeroes each element with probability p and scales the rest by 1/(1-p) when
 * train is true (mask drawn from g); returns a new reference to x otherwise. */
TD_API td_status td_tensor_dropout(const td_tensor *x, double p, bool train, td_generator *g,
                                   td_tensor **out);
/* td_tensor_layer_norm normalises over the last normalized_ndim dims; weight and bias (shape of
 * those dims) may be NULL. */
TD_API td_status td_tensor_layer_norm(const td_tensor *x, int normalized_ndim,
                                      const td_tensor *weight, const td_tensor *bias, double eps,
                                      td_tensor **out);
/* td_tensor_scaled_dot_product_attention is fused attention: y = softmax(scale * q k^T + mask) v
 * over the last two dims of q [..., L, E], k [..., S, E], v [..., S, Ev] (equal batch dims, e.g.
 * [B, H, T, hd]; float32 or float64), y [..., L, Ev]. With causal, query i sees keys 0..i only
 * (the mask is built in, PyTorch 2's is_causal: a lower-triangular mask aligned at the top
 * left); S must be >= 1 when there are queries. scale NAN means 1/sqrt(E). The L x S scores are
 * computed row by row and never materialised; backward keeps only the probabilities. Operands
 * whose last dim is contiguous are read in place (strided heads need no copy), and y is laid out
 * in q's dim order, so heads of a [B, T, C] tensor give a y whose transpose(1, 2) reshapes to
 * [B, T, C] as a view. CPU only so far: TD_ERR_UNSUPPORTED on devices without the kernel. */
TD_API td_status td_tensor_scaled_dot_product_attention(const td_tensor *q, const td_tensor *k,
                                                        const td_tensor *v, bool causal,
                                                        double scale, td_tensor **out);

/* ---- joining and indexing (differentiable) ---- */

/* td_tensor_cat joins n tensors along dim (all other dims equal). */
TD_API td_status td_tensor_cat(td_tensor *const *ts, int n, int dim, td_tensor **out);
/* td_tensor_stack joins n tensors of equal shape along a new dim. */
TD_API td_status td_tensor_stack(td_tensor *const *ts, int n, int dim, td_tensor **out);
/* td_tensor_index_select picks the entries of int64 1-d index along dim. */
TD_API td_status td_tensor_index_select(const td_tensor *t, int dim, const td_tensor *index,
                                        td_tensor **out);

/* ---- in-place updates (not recorded by autograd; used by optimizers and initialisers) ---- */

/* td_tensor_copy_ copies src into dst (same shape; src is broadcast if needed; dtype converted:
 * float to int64 truncates, and NaN, +-inf and out-of-range values give INT64_MIN, on every
 * device). When src and dst overlap in memory the result is as if src were read completely
 * first (src is staged through a temporary; src == dst is a no-op). TD_ERR_INVALID when several
 * elements of dst share one memory location (an expanded view), as in PyTorch. */
TD_API td_status td_tensor_copy_(td_tensor *dst, const td_tensor *src);
TD_API td_status td_tensor_fill_(td_tensor *t, double value);
TD_API td_status td_tensor_zero_(td_tensor *t);
/* td_tensor_mul_scalar_: t *= s. */
TD_API td_status td_tensor_mul_scalar_(td_tensor *t, double s);
/* td_tensor_add_: t += alpha * other (other broadcast to t). */
TD_API td_status td_tensor_add_(td_tensor *t, const td_tensor *other, double alpha);
/* td_tensor_addcmul_: t += value * a * b. */
TD_API td_status td_tensor_addcmul_(td_tensor *t, const td_tensor *a, const td_tensor *b,
                                    double value);
/* td_tensor_addcdiv_: t += value * a / b. */
TD_API td_status td_tensor_addcdiv_(td_tensor *t, const td_tensor *a, const td_tensor *b,
                                    double value);
/* td_tensor_maximum_: t = max(t, other). */
TD_API td_status td_tensor_maximum_(td_tensor *t, const td_tensor *other);
/* Arguments of td_tensor_adam_: one step of torch.optim.Adam / AdamW (PyTorch 1.13's
 * single-tensor rule, no amsgrad). */
typedef struct td_adam_args {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled; /* AdamW: decay the weights (p *= 1 - lr * wd), not the gradient */
  bool maximize;  /* ascend */
  int64_t step;   /* this update's step number, 1 for the first */
} td_adam_args;
/* td_tensor_adam_ applies one Adam / AdamW update in place to param, exp_avg and exp_avg_sq from
 * grad (same shape, dtype and device) in one fused pass. TD_ERR_UNSUPPORTED when the device has
 * no fused kernel or an operand is not contiguous: the caller then composes the update from the
 * ops above, as the optimizers of optim.h do. */
TD_API td_status td_tensor_adam_(td_tensor *param, const td_tensor *grad, td_tensor *exp_avg,
                                 td_tensor *exp_avg_sq, const td_adam_args *a);
/* td_tensor_adam_multi_ is td_tensor_adam_ on n parameters at once, args[i] for parameter i. On
 * a device with a multi-tensor kernel (CUDA) one launch updates many parameters; elsewhere it
 * calls td_tensor_adam_ for each. Every operand is checked before anything changes;
 * TD_ERR_UNSUPPORTED (nothing updated) under the conditions of td_tensor_adam_, or when the
 * parameters are not all on one device. */
TD_API td_status td_tensor_adam_multi_(td_tensor *const *params, const td_tensor *const *grads,
                                       td_tensor *const *exp_avgs,
                                       td_tensor *const *exp_avg_sqs, const td_adam_args *args,
                                       size_t n);
/* td_tensor_sum_squares sets *out to the sum, over the n float tensors (NULL entries skipped),
 * of the squares of their elements, accumulated in double: the squared 2-norm of a gradient
 * list. Tensors all on one CUDA device take one kernel per 32 tensors and one host
 * synchronisation in all; otherwise each tensor's sum of squares is read on its own (rounded to
 * its dtype, as mul + sum_all give it). */
TD_API td_status td_tensor_sum_squares(const td_tensor *const *ts, size_t n, double *out);
/* td_tensor_uniform_ / normal_ refill t from g. */
TD_API td_status td_tensor_uniform_(td_tensor *t, double lo, double hi, td_generator *g);
TD_API td_status td_tensor_normal_(td_tensor *t, double mean, double std, td_generator *g);

/* ---- comparison helpers (tests, examples) ---- */

/* td_tensor_allclose sets *out to whether |a - b| <= atol + rtol * |b| everywhere (same shape
 * required; any devices and dtypes). */
TD_API td_status td_tensor_allclose(const td_tensor *a, const td_tensor *b, double rtol,
                                    double atol, bool *out);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_TENSOR_H */
