/* grad_scaler.c - the data-parallel side of loss scaling (tdist/optim.h's td_grad_scaler): the
 * agreement on found_inf over a process group, so that every replica skips the same steps.
 *
 * td_grad_scaler lives in optim/ (tensors and optimizers only) and takes the decision of an
 * iteration through an agreement callback; this file is the callback over a process group: one
 * all_reduce MAX of a one-element flag (int64, on the group's device: the CPU, or the NCCL
 * communicator's GPU). zero.c agrees the same way over its own groups (td_zero_step_scaled).
 */
#include "coll_impl.h"
#include "replicas.h"

td_status td__coll_any(td_process_group *pg, td_device dev, bool *flag) {
  if (td_process_group_backend(pg) != TD_PG_BACKEND_NCCL) dev = td_device_cpu();
  int64_t one = 1, v = *flag ? 1 : 0;
  td_tensor *f = NULL, *fd = NULL, *back = NULL;
  td_status st = td_tensor_from_buffer(&v, &one, 1, TD_DTYPE_I64, &f);
  if (st == TD_OK) st = td_tensor_to(f, dev, &fd);
  if (st == TD_OK) st = td_process_group_all_reduce(pg, fd, TD_REDUCE_MAX);
  if (st == TD_OK) st = td_tensor_to(fd, td_device_cpu(), &back);
  if (st == TD_OK) *flag = *(const int64_t *)td_tensor_data(back) != 0;
  td_tensor_unref(f);
  td_tensor_unref(fd);
  td_tensor_unref(back);
  return st;
}

static td_status agree_over_group(void *ctx, bool *found) {
  td_process_group *pg = ctx;
  td_device dev = td_device_cpu();
  if (pg->backend == TD_PG_BACKEND_NCCL) dev = td_device_cuda(pg->nccl_device);
  return td__coll_any(pg, dev, found);
}

td_status td_grad_scaler_set_process_group(td_grad_scaler *s, td_process_group *pg) {
  TD_CHECK_ARG(s, "grad_scaler_set_process_group: NULL scaler");
  td_grad_scaler_set_agreement(s, pg ? agree_over_group : NULL, pg);
  return TD_OK;
}
