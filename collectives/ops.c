/* ops.c - the public collective operations: argument checks and the synchronous and
 * asynchronous entry points.
 *
 * Every call checks its tensors on the calling thread (an error there is returned at once and
 * nothing is queued), describes itself as a td__op and hands it to work.c, which runs it in call
 * order with the group's other operations (execute.c: td__pg_execute): on the calling thread
 * when nothing else is queued or running, else on the group's worker thread.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_impl.h"

/* ---- argument checks (calling thread) ---- */

static td_status check_tensor(const td_process_group *pg, const td_tensor *t, const char *name,
                              const char *what) {
  if (!t) return td_set_error(TD_ERR_INVALID, "%s: NULL %s", name, what);
  if (!td_tensor_is_contiguous(t))
    return td_set_error(TD_ERR_INVALID, "%s: %s must be contiguous", name, what);
  td_device d = td_tensor_device(t);
  char db[32];
  if (pg->backend == TD_PG_BACKEND_CPU && d.type != TD_DEVICE_CPU)
    return td_set_error(TD_ERR_DEVICE, "%s: %s is on %s; this group's backend (cpu) takes CPU "
                        "tensors (create the group with TD_PG_BACKEND_NCCL for CUDA)", name, what,
                        td_device_str(d, db, sizeof db));
  if (pg->backend == TD_PG_BACKEND_NCCL &&
      (d.type != TD_DEVICE_CUDA || d.index != pg->nccl_device))
    return td_set_error(TD_ERR_DEVICE, "%s: %s is on %s; this NCCL group works on cuda:%d", name,
                        what, td_device_str(d, db, sizeof db), pg->nccl_device);
  return TD_OK;
}

static td_status check_same(const td_tensor *ref, const td_tensor *t, const char *name,
                            const char *what, int64_t numel) {
  if (td_tensor_dtype(t) != td_tensor_dtype(ref))
    return td_set_error(TD_ERR_DTYPE, "%s: %s is %s, expected %s", name, what,
                        td_dtype_name(td_tensor_dtype(t)), td_dtype_name(td_tensor_dtype(ref)));
  if (td_tensor_numel(t) != numel)
    return td_set_error(TD_ERR_SHAPE, "%s: %s has %lld elements, expected %lld", name, what,
                        (long long)td_tensor_numel(t), (long long)numel);
  return TD_OK;
}

static td_status check_op(td_reduce_op op, td_dtype dt, const char *name) {
  if (op != TD_REDUCE_SUM && op != TD_REDUCE_AVG && op != TD_REDUCE_MAX)
    return td_set_error(TD_ERR_INVALID, "%s: unknown reduce op %d", name, (int)op);
  if (op == TD_REDUCE_AVG && dt == TD_DTYPE_I64)
    return td_set_error(TD_ERR_DTYPE, "%s: avg needs a float dtype, got int64", name);
  if (dt > TD_DTYPE_BF16)
    return td_set_error(TD_ERR_DTYPE, "%s: cannot reduce %s (a transport-only dtype: "
                        "broadcast and all_gather carry it)", name, td_dtype_name(dt));
  return TD_OK;
}

/* Checks a list of size tensors against ref (same dtype, numel elements each). */
static td_status check_list(const td_process_group *pg, td_tensor *const *list,
                            const td_tensor *ref, const char *name, const char *lname) {
  char what[32];
  for (int i = 0; i < pg->size; i++) {
    snprintf(what, sizeof what, "%s[%d]", lname, i);
    TD_TRY(check_tensor(pg, list[i], name, what));
    TD_TRY(check_same(ref, list[i], name, what, td_tensor_numel(ref)));
  }
  return TD_OK;
}

/* ---- public entry points: out == NULL runs synchronously ---- */

static td_status all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg, "all_reduce: NULL group");
  TD_TRY(check_tensor(pg, t, "all_reduce", "tensor"));
  TD_TRY(check_op(op, td_tensor_dtype(t), "all_reduce"));
  td__op o = {.kind = TD__K_ALL_REDUCE, .rop = op, .t = t};
  return td__work_run(pg, &o, out);
}

static td_status broadcast(td_process_group *pg, td_tensor *t, int root, td_future **out) {
  TD_CHECK_ARG(pg, "broadcast: NULL group");
  TD_TRY(check_tensor(pg, t, "broadcast", "tensor"));
  TD_CHECK_ARG(root >= 0 && root < pg->size, "broadcast: root %d outside the group of %d", root,
               pg->size);
  td__op o = {.kind = TD__K_BROADCAST, .root = root, .t = t};
  return td__work_run(pg, &o, out);
}

static td_status all_gather(td_process_group *pg, td_tensor *const *outs, const td_tensor *in,
                            td_future **out) {
  TD_CHECK_ARG(pg && outs, "all_gather: NULL group or outs");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  TD_TRY(check_list(pg, outs, in, "all_gather", "outs"));
  td__op o = {.kind = TD__K_ALL_GATHER, .t = (td_tensor *)in, .list = (td_tensor **)outs};
  return td__work_run(pg, &o, out);
}

static td_status all_gather_into(td_process_group *pg, td_tensor *whole, const td_tensor *in,
                                 td_future **out) {
  TD_CHECK_ARG(pg, "all_gather: NULL group");
  TD_TRY(check_tensor(pg, in, "all_gather", "input"));
  TD_TRY(check_tensor(pg, whole, "all_gather", "output"));
  TD_TRY(check_same(in, whole, "all_gather", "output", td_tensor_numel(in) * pg->size));
  td__op o = {.kind = TD__K_ALL_GATHER, .t = (td_tensor *)in, .whole = whole};
  return td__work_run(pg, &o, out);
}

static td_status reduce_scatter(td_process_group *pg, td_tensor *res, td_tensor *const *ins,
                                td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg && ins, "reduce_scatter: NULL group or ins");
  TD_TRY(check_tensor(pg, res, "reduce_scatter", "output"));
  TD_TRY(check_op(op, td_tensor_dtype(res), "reduce_scatter"));
  TD_TRY(check_list(pg, ins, res, "reduce_scatter", "ins"));
  td__op o = {.kind = TD__K_REDUCE_SCATTER, .rop = op, .t = res, .list = (td_tensor **)ins};
  return td__work_run(pg, &o, out);
}

static td_status reduce_scatter_tensor(td_process_group *pg, td_tensor *res, const td_tensor *in,
                                       td_reduce_op op, td_future **out) {
  TD_CHECK_ARG(pg, "reduce_scatter: NULL group");
  TD_TRY(check_tensor(pg, res, "reduce_scatter", "output"));
  TD_TRY(check_tensor(pg, in, "reduce_scatter", "input"));
  TD_TRY(check_op(op, td_tensor_dtype(res), "reduce_scatter"));
  TD_TRY(check_same(res, in, "reduce_scatter", "input", td_tensor_numel(res) * pg->size));
  td__op o = {.kind = TD__K_REDUCE_SCATTER, .rop = op, .t = res, .whole = (td_tensor *)in};
  return td__work_run(pg, &o, out);
}

static td_status barrier(td_process_group *pg, td_future **out) {
  TD_CHECK_ARG(pg, "barrier: NULL group");
  td__op o = {.kind = TD__K_BARRIER};
  return td__work_run(pg, &o, out);
}

td_status td_process_group_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op) {
  return all_reduce(pg, t, op, NULL);
}
td_status td_process_group_broadcast(td_process_group *pg, td_tensor *t, int root) {
  return broadcast(pg, t, root, NULL);
}
td_status td_process_group_all_gather(td_process_group *pg, td_tensor *const *outs,
                                      const td_tensor *in) {
  return all_gather(pg, outs, in, NULL);
}
td_status td_process_group_all_gather_into_tensor(td_process_group *pg, td_tensor *out,
                                                  const td_tensor *in) {
  return all_gather_into(pg, out, in, NULL);
}
td_status td_process_group_reduce_scatter(td_process_group *pg, td_tensor *out,
                                          td_tensor *const *ins, td_reduce_op op) {
  return reduce_scatter(pg, out, ins, op, NULL);
}
td_status td_process_group_reduce_scatter_tensor(td_process_group *pg, td_tensor *out,
                                                 const td_tensor *in, td_reduce_op op) {
  return reduce_scatter_tensor(pg, out, in, op, NULL);
}
td_status td_process_group_barrier(td_process_group *pg) { return barrier(pg, NULL); }

#define CHECK_OUT(name) TD_CHECK_ARG(out, name "_async: NULL out")

td_status td_process_group_all_reduce_async(td_process_group *pg, td_tensor *t, td_reduce_op op,
                                            td_future **out) {
  CHECK_OUT("all_reduce");
  return all_reduce(pg, t, op, out);
}
td_status td_process_group_broadcast_async(td_process_group *pg, td_tensor *t, int root,
                                           td_future **out) {
  CHECK_OUT("broadcast");
  return broadcast(pg, t, root, out);
}
td_status td_process_group_all_gather_async(td_process_group *pg, td_tensor *const *outs,
                                            const td_tensor *in, td_future **out) {
  CHECK_OUT("all_gather");
  return all_gather(pg, outs, in, out);
}
td_status td_process_group_all_gather_into_tensor_async(td_process_group *pg, td_tensor *whole,
                                                        const td_tensor *in, td_future **out) {
  CHECK_OUT("all_gather_into_tensor");
  return all_gather_into(pg, whole, in, out);
}
td_status td_process_group_reduce_scatter_async(td_process_group *pg, td_tensor *res,
                                                td_tensor *const *ins, td_reduce_op op,
                                                td_future **out) {
  CHECK_OUT("reduce_scatter");
  return reduce_scatter(pg, res, ins, op, out);
}
td_status td_process_group_reduce_scatter_tensor_async(td_process_group *pg, td_tensor *res,
                                                       const td_tensor *in, td_reduce_op op,
                                                       td_future **out) {
  CHECK_OUT("reduce_scatter_tensor");
  return reduce_scatter_tensor(pg, res, in, op, out);
}
td_status td_process_group_barrier_async(td_process_group *pg, td_future **out) {
  CHECK_OUT("barrier");
  return barrier(pg, out);
}
