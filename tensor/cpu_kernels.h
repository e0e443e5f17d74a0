/* cpu_kernels.h - CPU kernels of the neural-network entries of the backend table (internal).
 *
 * Implemented in tensor/cpu_nn.c (attention: cpu_attention.c, Adam: cpu_optim.c); cpu_backend.c
 * puts them into td__cpu_backend. Each function has exactly the signature of the td__backend
 * entry of the same name (see tensor_impl.h for the contracts). They handle float32 and float64 (float32 accumulates in
 * double where sums are long), index_select also int64. Every tensor argument is a CPU tensor
 * whose elements are contiguous from td_tensor_data(); the geometry comes from the explicit
 * outer/r/inner arguments or from the tensors' element counts, not from their shapes.
 *
 * THREAD SAFETY: pure functions of their arguments; any thread.
 */
#ifndef TD_TENSOR_CPU_KERNELS_H
#define TD_TENSOR_CPU_KERNELS_H

#include "tensor_impl.h"

td_status td__cpu_softmax(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                          bool logsm, td_tensor *y);
td_status td__cpu_softmax_backward(const td_tensor *y, const td_tensor *gy, int64_t outer,
                                   int64_t r, int64_t inner, bool logsm, td_tensor *gx);
td_status td__cpu_nll(const td_tensor *logp, const td_tensor *target, int64_t ignore_index,
                      td_tensor *losses, int64_t *count);
td_status td__cpu_nll_backward(const td_tensor *target, const td_tensor *gl, int64_t ignore_index,
                               td_tensor *gx);
td_status td__cpu_im2col(td_dtype dt, const void *x, int64_t c, int64_t h, int64_t w, int kh,
                         int kw, int sh, int sw, int ph, int pw, void *col);
td_status td__cpu_col2im(td_dtype dt, const void *col, int64_t c, int64_t h, int64_t w, int kh,
                         int kw, int sh, int sw, int ph, int pw, void *gx);
td_status td__cpu_max_pool2d(const td_tensor *x, int kh, int kw, int sh, int sw, td_tensor *y,
                             td_tensor *idx);
td_status td__cpu_max_pool2d_backward(const td_tensor *gy, const td_tensor *idx, td_tensor *gx);
td_status td__cpu_index_select(const td_tensor *x, int64_t outer, int64_t r, int64_t inner,
                               const td_tensor *index, td_tensor *out);
td_status td__cpu_index_add(td_tensor *gx, int64_t outer, int64_t r, int64_t inner,
                            const td_tensor *index, const td_tensor *g);
td_status td__cpu_layer_norm(const td_tensor *x, const td_tensor *w, const td_tensor *b,
                             double eps, td_tensor *y, td_tensor *mean, td_tensor *rstd);
td_status td__cpu_layer_norm_backward(const td_tensor *gy, const td_tensor *x, const td_tensor *w,
                                      const td_tensor *mean, const td_tensor *rstd, td_tensor *gx,
                                      td_tensor *gw, td_tensor *gb);

/* cpu_optim.c */
td_status td__cpu_adam(td_tensor *p, const td_tensor *g, td_tensor *m, td_tensor *v,
                       const td__adam_consts *c);

/* cpu_attention.c */
td_status td__cpu_attention(td_dtype dt, const td__attn_geom *g, const void *q, const void *k,
                            const void *v, void *y, void *probs);
td_status td__cpu_attention_backward(td_dtype dt, const td__attn_geom *g, const void *q,
                                     const void *k, const void *v, const void *probs,
                                     const void *gy, void *gq, void *gk, void *gv);

#endif
