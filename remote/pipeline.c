/* pipeline.c - the pipeline driver: a batch through a chain of remote modules as micro-batches.
 *
 * Design (GPipe's forward schedule over RPC): the batch is cut along dim 0 into chunks; for each
 * chunk the driver issues, without waiting, td_rref_remote(stage_k, "__rm_forward", [input]) for
 * every stage, where input is the chunk for stage 0 and the RRef returned for stage k-1
 * afterwards. A stage's output therefore stays on its worker and the next stage fetches it from
 * there (__rm_forward fetches RRef inputs itself), so activations never pass through the driver.
 * Each owner runs micro-batch i of stage k as soon as its input exists, so different stages work
 * on different micro-batches at the same time. The driver then fetches the last stage's outputs
 * (all at once) and concatenates them. Everything runs on the caller's thread, so the caller's
 * distributed autograd context is carried by every call and backward reaches every stage.
 */
#include <stdio.h>
#include <string.h>

#include "../core/trace_impl.h"
#include "../core/core.h"
#include "tdist/remote_module.h"

struct td_pipeline {
  td_rpc_agent *agent;
  int n;
  td_rref **stages; /* module RRefs (references) */
};

td_status td_pipeline_create(td_rpc_agent *a, td_remote_module *const *stages, int n,
                             td_pipeline **out) {
  TD_CHECK_ARG(a && stages && out && n >= 1, "pipeline_create: bad argument");
  for (int i = 0; i < n; i++) TD_CHECK_ARG(stages[i], "pipeline_create: stage %d is NULL", i);
  td_pipeline *p = td__calloc(1, sizeof *p);
  td_rref **s = td__calloc((size_t)n, sizeof *s);
  if (!p || !s) {
    td__free(p);
    td__free(s);
    return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  }
  for (int i = 0; i < n; i++) s[i] = td_rref_ref(td_remote_module_rref(stages[i]));
  p->agent = a;
  p->n = n;
  p->stages = s;
  *out = p;
  return TD_OK;
}

void td_pipeline_destroy(td_pipeline *p) {
  if (!p) return;
  for (int i = 0; i < p->n; i++) td_rref_unref(p->stages[i]);
  td__free(p->stages);
  td__free(p);
}

int td_pipeline_num_stages(const td_pipeline *p) { return p ? p->n : 0; }

static td_status forward(td_pipeline *p, td_tensor *x, int micro_batches, td_tensor **y);

/* The driver's whole forward as one span in traces; each micro-batch's stages appear as the
 * owners' handler spans, with arrows from the calls that started them. */
td_status td_pipeline_forward(td_pipeline *p, td_tensor *x, int micro_batches, td_tensor **y) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td_status st = forward(p, x, micro_batches, y);
  if (t0) {
    char args[96];
    snprintf(args, sizeof args, "{\"micro_batches\":%d,\"ok\":%s}", micro_batches,
             st == TD_OK ? "true" : "false");
    td__trace_complete("pipeline", "pipeline forward", t0, td__now_ns(), args);
  }
  return st;
}

static td_status forward(td_pipeline *p, td_tensor *x, int micro_batches, td_tensor **y) {
  TD_CHECK_ARG(p && x && y, "pipeline_forward: NULL argument");
  if (micro_batches < 1)
    return td_set_error(TD_ERR_INVALID, "pipeline_forward: micro_batches must be >= 1, got %d",
                        micro_batches);
  if (td_tensor_ndim(x) < 1 || td_tensor_size(x, 0) < 1)
    return td_set_error(TD_ERR_INVALID, "pipeline_forward: input needs a non-empty dim 0");
  int64_t rows = td_tensor_size(x, 0);
  int64_t chunk = (rows + micro_batches - 1) / micro_batches;
  int m = (int)((rows + chunk - 1) / chunk);
  td_status st = TD_OK;
  td_rref **last = td__calloc((size_t)m, sizeof *last);
  td_future **fetch = td__calloc((size_t)m, sizeof *fetch);
  td_tensor **outs = td__calloc((size_t)m, sizeof *outs);
  if (!last || !fetch || !outs) st = td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");

  /* Issue every micro-batch through every stage without waiting. */
  for (int i = 0; i < m && st == TD_OK; i++) {
    int64_t start = (int64_t)i * chunk, len = rows - start < chunk ? rows - start : chunk;
    td_tensor *xi = NULL;
    st = td_tensor_narrow(x, 0, start, len, &xi);
    td_value *in = st == TD_OK ? td_value_tensor(xi) : NULL;
    td_tensor_unref(xi);
    if (st == TD_OK && !in) st = td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
    for (int k = 0; k < p->n && st == TD_OK; k++) {
      td_rref *o = NULL;
      st = td_rref_remote(p->stages[k], "__rm_forward", &in, 1, NULL, &o);
      td_value_unref(in);
      in = NULL;
      if (st != TD_OK) break;
      if (k == p->n - 1) {
        last[i] = o;
      } else {
        in = td_value_rref(o);
        td_rref_unref(o);
        if (!in) st = td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
      }
    }
    td_value_unref(in);
  }
  /* Fetch the last stage's outputs (all in flight at once), then wait for them in order. */
  for (int i = 0; i < m && st == TD_OK; i++) st = td_rref_to_here_async(last[i], TD_TIMEOUT_DEFAULT, &fetch[i]);
  for (int i = 0; i < m && st == TD_OK; i++) {
    td_future_wait(fetch[i], TD_TIMEOUT_INFINITE);
    st = td_future_status(fetch[i]);
    td_tensor *t = NULL;
    if (st != TD_OK) {
      td_set_error(st, "pipeline_forward: micro-batch %d: %s", i, td_future_message(fetch[i]));
    } else if ((st = td_value_as_tensor(td_future_value(fetch[i]), &t)) == TD_OK) {
      outs[i] = td_tensor_ref(t);
    }
  }
  td_tensor *cat = NULL;
  if (st == TD_OK) st = m == 1 ? (cat = td_tensor_ref(outs[0]), TD_OK)
                               : td_tensor_cat(outs, m, 0, &cat);
  for (int i = 0; i < m; i++) {
    if (outs) td_tensor_unref(outs[i]);
    if (fetch) td_future_unref(fetch[i]);
    if (last) td_rref_unref(last[i]);
  }
  td__free(outs);
  td__free(fetch);
  td__free(last);
  if (st != TD_OK) return st;
  *y = cat;
  return TD_OK;
}
