/* stage.c - the worker side of pipeline schedules (pipeline.h): a stage object holding this
 * worker's model chunks, running forward and backward ops one at a time in the order the driver
 * numbered them.
 *
 * Design: a "pipe.Stage" object lives on the chunks' owner behind an RRef. __ps_op carries the
 * run number and the op's index (seq) in this worker's schedule order. Every op is queued and
 * its handler returns the reply future (no pool thread waits). When the stage is idle and the op
 * that is next in order is queued, one drive task goes to the agent's pool and runs the queued
 * ops in order, one at a time, until the next one has not arrived yet. Ops therefore never
 * overlap and never run out of order, whatever the network does; and since the drive task is not
 * the handler, each op's reply leaves as soon as that op is done, not when the chain ends.
 * - Forward F(i, c): the input becomes a leaf that requires grad (except for the model's first
 *   chunk), the chunk runs on it, and the last chunk computes the micro-batch's loss; the stage
 *   keeps (input, output) under (c, i) and replies with the output (the loss for the last chunk).
 * - Backward B(i, c): plain td_autograd_backward from the kept output with the received gradient
 *   (1 for the loss), so the chunk's parameters accumulate into .grad; replies with the input's
 *   gradient (none for the first chunk) and drops what F kept.
 * - A new run number resets the stage (queue failed, kept activations and counters dropped); an
 *   op of an older run is refused. A failed op aborts its run here: queued and later ops of the
 *   run fail at once; __ps_abort does the same on the driver's request, so no op waits for a
 *   predecessor that will never come.
 *
 * Invariants: at most one drive task per stage (`running`), so at most one op runs at a time;
 * the queue holds the ops not yet run; a drive task holds a reference to the stage's value.
 *
 * Lock order: a stage's mu is a leaf; it is never held while running a module, the engine, or
 * completing a future.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../core/core.h"
#include "../rpc/agent_impl.h"
#include "remote_impl.h"
#include "tdist/autograd.h"
#include "tdist/nn.h"
#include "tdist/pipeline.h"
#include "tdist/rref.h"

typedef struct ps_saved {
  int c, mb;
  td_tensor *in;  /* the input leaf (NULL for the first chunk) */
  td_tensor *out; /* the output, or the loss for the last chunk */
} ps_saved;

typedef struct ps_op {
  int64_t run, seq;
  int kind, c, mb, flags;
  double scale;
  td_value *data, *target; /* references */
  td_future *reply;        /* reference */
} ps_op;

typedef struct ps_stage {
  pthread_mutex_t mu;
  td_module **chunks; /* references */
  int nchunks;
  int64_t run, next_seq; /* guarded by mu, as everything below */
  bool running, aborted;
  ps_op *queue;
  int nq, capq;
  ps_saved *saved;
  int nsaved, capsaved;
  int peak;
  double busy_s;
} ps_stage;

static void op_release(ps_op *op) {
  td_value_unref(op->data);
  td_value_unref(op->target);
  td_future_unref(op->reply);
}

static void saved_release(ps_saved *s) {
  td_tensor_unref(s->in);
  td_tensor_unref(s->out);
}

static void stage_destroy(void *obj) {
  ps_stage *s = obj;
  for (int i = 0; i < s->nq; i++) {
    td_future_fail(s->queue[i].reply, TD_ERR_CANCELLED, "pipeline stage: destroyed");
    op_release(&s->queue[i]);
  }
  for (int i = 0; i < s->nsaved; i++) saved_release(&s->saved[i]);
  for (int i = 0; i < s->nchunks; i++) td_module_unref(s->chunks[i]);
  td__free(s->queue);
  td__free(s->saved);
  td__free(s->chunks);
  pthread_mutex_destroy(&s->mu);
  td__free(s);
}

/* ---- creation ---- */

/* __ps_create [chunk module, [module RRefs]] */
static td_status h_create(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)x, (void)fut;
  if (n != 2 || td_value_kind_of(args[1]) != TD_VALUE_LIST || td_value_list_len(args[1]) < 1)
    return td_set_error(TD_ERR_FORMAT, "__ps_create: malformed request");
  int nc = (int)td_value_list_len(args[1]);
  ps_stage *s = td__calloc(1, sizeof *s);
  td_module **ch = td__calloc((size_t)nc, sizeof *ch);
  if (!s || !ch) {
    td__free(s);
    td__free(ch);
    return td_set_error(TD_ERR_NOMEM, "pipeline stage: out of memory");
  }
  pthread_mutex_init(&s->mu, NULL);
  s->chunks = ch;
  td_status st = TD_OK;
  for (int i = 0; i < nc && st == TD_OK; i++) {
    td_rref *r = NULL;
    td_value *v = NULL;
    void *m = NULL;
    st = td_value_as_rref(td_value_list_get(args[1], (size_t)i), &r);
    if (st == TD_OK) st = td_rref_local_value(r, &v);
    if (st == TD_OK) st = td_value_as_object(v, "nn.Module", &m);
    if (st == TD_OK) {
      ch[i] = td_module_ref(m);
      s->nchunks++;
    } else {
      td__error_prefix(st, "pipeline stage: chunk %d", i);
    }
    td_value_unref(v);
  }
  if (st == TD_OK) st = td_value_object(TD__PS_STAGE_TYPE, s, res);
  if (st != TD_OK) stage_destroy(s);
  return st;
}

/* ---- running ops ---- */

/* loss of micro-batch output y: (y - target)^2 summed, or y summed; times scale. */
static td_status compute_loss(td_tensor *y, const td_value *target, int kind, double scale,
                              td_tensor **out) {
  td_tensor *t = NULL, *td = NULL, *d = NULL, *sq = NULL, *s = NULL;
  td_status st = TD_OK;
  if (kind == TD_PIPE_LOSS_MSE) {
    if (td_value_as_tensor(target, &t) != TD_OK)
      return td_set_error(TD_ERR_INVALID, "pipeline loss: MSE needs a target tensor");
    st = td_tensor_to(t, td_tensor_device(y), &td);
    if (st == TD_OK) st = td_tensor_sub(y, td, &d);
    if (st == TD_OK) st = td_tensor_mul(d, d, &sq);
    if (st == TD_OK) st = td_tensor_sum_all(sq, &s);
  } else if (kind == TD_PIPE_LOSS_SUM) {
    st = td_tensor_sum_all(y, &s);
  } else {
    st = td_set_error(TD_ERR_INVALID, "pipeline loss: unknown loss %d", kind);
  }
  if (st == TD_OK) st = td_tensor_mul_scalar(s, scale, out);
  td_tensor_unref(td), td_tensor_unref(d), td_tensor_unref(sq), td_tensor_unref(s);
  return st;
}

static td_status keep(ps_stage *s, int c, int mb, td_tensor *in, td_tensor *out) {
  pthread_mutex_lock(&s->mu);
  td_status st = TD_OK;
  for (int i = 0; i < s->nsaved && st == TD_OK; i++)
    if (s->saved[i].c == c && s->saved[i].mb == mb)
      st = td_set_error(TD_ERR_STATE, "pipeline stage: forward of micro-batch %d, chunk %d ran "
                        "twice", mb, c);
  if (st == TD_OK && s->nsaved == s->capsaved) {
    int nc = s->capsaved ? 2 * s->capsaved : 8;
    ps_saved *ns = td__realloc(s->saved, (size_t)nc * sizeof *ns);
    if (!ns) st = td_set_error(TD_ERR_NOMEM, "pipeline stage: out of memory");
    else s->saved = ns, s->capsaved = nc;
  }
  if (st == TD_OK) {
    s->saved[s->nsaved++] = (ps_saved){c, mb, in ? td_tensor_ref(in) : NULL, td_tensor_ref(out)};
    if (s->nsaved > s->peak) s->peak = s->nsaved;
  }
  pthread_mutex_unlock(&s->mu);
  return st;
}

static td_status run_forward(ps_stage *s, const ps_op *op, td_tensor **result) {
  td_module *m = s->chunks[op->c];
  td_tensor *x, *xd = NULL, *in = NULL, *y = NULL, *loss = NULL;
  if (td_value_as_tensor(op->data, &x) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "pipeline stage: forward input is a %s, expected a tensor",
                        td_value_kind_name(op->data));
  td_status st = td_tensor_to(x, td__rm_module_device(m), &xd);
  if (st == TD_OK && !(op->flags & TD__PS_FIRST)) {
    st = td_tensor_detach(xd, &in);
    if (st == TD_OK) st = td_tensor_set_requires_grad(in, true);
  }
  if (st == TD_OK) st = td_module_forward(m, in ? in : xd, &y);
  if (st == TD_OK && (op->flags & TD__PS_LAST))
    st = compute_loss(y, op->target, op->flags >> TD__PS_LOSS_SHIFT, op->scale, &loss);
  td_tensor *out = loss ? loss : y;
  if (st == TD_OK) st = keep(s, op->c, op->mb, in, out);
  if (st == TD_OK) st = td_tensor_to(out, td_device_cpu(), result);
  td_tensor_unref(xd), td_tensor_unref(in), td_tensor_unref(y), td_tensor_unref(loss);
  return st;
}

static td_status run_backward(ps_stage *s, const ps_op *op, td_tensor **result) {
  ps_saved sv = {0};
  bool found = false;
  pthread_mutex_lock(&s->mu);
  for (int i = 0; i < s->nsaved && !found; i++) {
    if (s->saved[i].c != op->c || s->saved[i].mb != op->mb) continue;
    sv = s->saved[i];
    s->saved[i] = s->saved[--s->nsaved];
    found = true;
  }
  pthread_mutex_unlock(&s->mu);
  if (!found)
    return td_set_error(TD_ERR_STATE, "pipeline stage: backward of micro-batch %d, chunk %d "
                        "before its forward", op->mb, op->c);
  td_tensor *g = NULL, *gd = NULL, *gin = NULL;
  td_status st = TD_OK;
  if (!(op->flags & TD__PS_LAST)) {
    if (td_value_as_tensor(op->data, &g) != TD_OK)
      st = td_set_error(TD_ERR_INVALID, "pipeline stage: backward needs the output's gradient, "
                        "got a %s", td_value_kind_name(op->data));
    if (st == TD_OK) st = td_tensor_to(g, td_tensor_device(sv.out), &gd);
  }
  if (st == TD_OK) st = td_autograd_backward(&sv.out, gd ? &gd : NULL, 1, NULL);
  if (st == TD_OK && sv.in) {
    gin = td_tensor_grad(sv.in);
    if (!gin) st = td_set_error(TD_ERR_STATE, "pipeline stage: chunk %d's output does not "
                                "depend on its input", op->c);
    else st = td_tensor_to(gin, td_device_cpu(), result);
  }
  td_tensor_unref(gd), td_tensor_unref(gin);
  saved_release(&sv);
  return st;
}

static td_value *reply_value(td_tensor *result, int peak, double busy) {
  td_value *l = td_value_list();
  td_value *a = result ? td_value_tensor(result) : td_value_none();
  td_value *b = td_value_int(peak), *c = td_value_double(busy);
  if (!l || !a || !b || !c) goto fail;
  if (td_value_list_append(l, a) != TD_OK) goto fail;
  a = NULL;
  if (td_value_list_append(l, b) != TD_OK) goto fail;
  b = NULL;
  if (td_value_list_append(l, c) != TD_OK) goto fail;
  return l;
fail:
  td_value_unref(l), td_value_unref(a), td_value_unref(b), td_value_unref(c);
  return NULL;
}

/* Takes the queued ops of the stage (caller holds mu) so they can be failed without the lock. */
static ps_op *take_queue_locked(ps_stage *s, int *n) {
  ps_op *q = s->queue;
  *n = s->nq;
  s->queue = NULL;
  s->nq = s->capq = 0;
  return q;
}

static void fail_ops(ps_op *q, int n, const char *why) {
  for (int i = 0; i < n; i++) {
    td_future_fail(q[i].reply, TD_ERR_CANCELLED, "pipeline stage: op %lld of run %lld not run: %s",
                   (long long)q[i].seq, (long long)q[i].run, why);
    op_release(&q[i]);
  }
  td__free(q);
}

/* execute runs op (this thread owns `running`), completes its reply and releases it. */
static void execute(ps_stage *s, ps_op *op) {
  uint64_t t0 = td__now_ns();
  td_tensor *result = NULL;
  td_clear_error();
  td_status st = op->kind == TD__PS_FORWARD ? run_forward(s, op, &result)
                                            : run_backward(s, op, &result);
  double dt = (double)(td__now_ns() - t0) * 1e-9;
  ps_op *q = NULL;
  int nq = 0;
  pthread_mutex_lock(&s->mu);
  s->busy_s += dt;
  int peak = s->peak;
  double busy = s->busy_s;
  if (st != TD_OK && op->run == s->run) {
    s->aborted = true;
    q = take_queue_locked(s, &nq);
  }
  pthread_mutex_unlock(&s->mu);
  if (st == TD_OK) {
    td_value *v = reply_value(result, peak, busy);
    if (v) td_future_complete(op->reply, v);
    else td_future_fail(op->reply, TD_ERR_NOMEM, "pipeline stage: out of memory");
  } else {
    td_future_fail(op->reply, st, "%s of micro-batch %d (chunk %d of this worker): %s",
                   op->kind == TD__PS_FORWARD ? "forward" : "backward", op->mb, op->c,
                   td_last_error());
  }
  td_tensor_unref(result);
  op_release(op);
  if (q) fail_ops(q, nq, "an earlier op of the run failed on this worker");
}

/* pick_locked moves the op that is next in order out of the queue into *op (caller holds mu). */
static bool pick_locked(ps_stage *s, ps_op *op) {
  for (int i = 0; i < s->nq && !s->aborted; i++) {
    if (s->queue[i].seq != s->next_seq || s->queue[i].run != s->run) continue;
    *op = s->queue[i];
    s->queue[i] = s->queue[--s->nq];
    return true;
  }
  return false;
}

static bool has_next_locked(const ps_stage *s) {
  for (int i = 0; i < s->nq && !s->aborted; i++)
    if (s->queue[i].seq == s->next_seq && s->queue[i].run == s->run) return true;
  return false;
}

/* drive_task runs on the agent's pool: the ops that are next in order, one after the other,
 * until none is. It never runs inside a handler, so each reply leaves as soon as its op is done.
 * arg is a reference to the stage's object value (keeps the stage alive). */
static void drive_task(void *arg) {
  td_value *self = arg;
  void *obj = NULL;
  td_value_as_object(self, TD__PS_STAGE_TYPE, &obj);
  ps_stage *s = obj;
  for (;;) {
    ps_op op;
    pthread_mutex_lock(&s->mu);
    bool have = pick_locked(s, &op);
    if (!have) s->running = false;
    pthread_mutex_unlock(&s->mu);
    if (!have) break;
    int64_t run = op.run;
    execute(s, &op);
    pthread_mutex_lock(&s->mu);
    if (run == s->run) s->next_seq++;
    pthread_mutex_unlock(&s->mu);
  }
  td_value_unref(self);
}

/* Resets s for run (caller holds mu); returns the ops to fail in *q. */
static void reset_locked(ps_stage *s, int64_t run, ps_op **q, int *nq, ps_saved **sv, int *nsv) {
  *q = take_queue_locked(s, nq);
  *sv = s->saved;
  *nsv = s->nsaved;
  s->saved = NULL;
  s->nsaved = s->capsaved = 0;
  s->run = run;
  s->next_seq = 0;
  s->aborted = false;
  s->peak = 0;
  s->busy_s = 0;
}

/* release_reset fails and frees what reset_locked took out of a stage. */
static void release_reset(ps_op *stale, int nstale, ps_saved *old, int nold) {
  if (stale) fail_ops(stale, nstale, "a newer run started");
  for (int i = 0; i < nold; i++) saved_release(&old[i]);
  td__free(old);
}

static td_status parse_op(td_value *const *args, int n, ps_op *op) {
  int64_t v[6];
  if (n != 10) return td_set_error(TD_ERR_FORMAT, "__ps_op: malformed request");
  for (int i = 0; i < 6; i++)
    if (td_value_as_int(args[1 + i], &v[i]) != TD_OK)
      return td_set_error(TD_ERR_FORMAT, "__ps_op: malformed request");
  if (td_value_as_double(args[7], &op->scale) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__ps_op: malformed request");
  op->run = v[0], op->seq = v[1];
  if (v[2] < 0 || v[2] > 1 || v[3] < 0 || v[4] < 0 || v[4] > (1 << 30) || v[5] < 0 ||
      v[5] > 255 || op->seq < 0)
    return td_set_error(TD_ERR_FORMAT, "__ps_op: malformed request");
  op->kind = (int)v[2], op->c = (int)v[3], op->mb = (int)v[4], op->flags = (int)v[5];
  return TD_OK;
}

/* __ps_op [stage, run, seq, kind, chunk, mb, flags, scale, data, target] */
static td_status h_op(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                      td_future **fut) {
  (void)res;
  void *obj;
  ps_op op = {0};
  TD_TRY(td_value_as_object(args[0], TD__PS_STAGE_TYPE, &obj));
  TD_TRY(parse_op(args, n, &op));
  ps_stage *s = obj;
  if (op.c >= s->nchunks)
    return td_set_error(TD_ERR_INVALID, "pipeline stage: no chunk %d here (%d chunks)", op.c,
                        s->nchunks);
  op.reply = td_future_create();
  if (!op.reply) return td_set_error(TD_ERR_NOMEM, "pipeline stage: out of memory");
  op.data = td_value_ref(args[8]);
  op.target = td_value_ref(args[9]);
  *fut = td_future_ref(op.reply); /* before the op is queued: another thread may release it */
  ps_op *stale = NULL;
  ps_saved *old = NULL;
  int nstale = 0, nold = 0;
  const char *refuse = NULL;
  bool go = false;
  pthread_mutex_lock(&s->mu);
  if (op.run > s->run) reset_locked(s, op.run, &stale, &nstale, &old, &nold);
  if (op.run < s->run) refuse = "it belongs to an earlier run";
  else if (s->aborted) refuse = "an earlier op of the run failed";
  else if (op.seq < s->next_seq) refuse = "an op with its number already ran";
  for (int i = 0; i < s->nq && !refuse; i++)
    if (s->queue[i].seq == op.seq) refuse = "an op with its number is already queued";
  if (!refuse && s->nq == s->capq) {
    int nc = s->capq ? 2 * s->capq : 8;
    ps_op *nqueue = td__realloc(s->queue, (size_t)nc * sizeof *nqueue);
    if (!nqueue) refuse = "out of memory";
    else s->queue = nqueue, s->capq = nc;
  }
  if (!refuse) {
    s->queue[s->nq++] = op;
    /* start a driver when the stage is idle and the next op is here */
    if (!s->running && has_next_locked(s)) s->running = go = true;
  }
  pthread_mutex_unlock(&s->mu);
  release_reset(stale, nstale, old, nold);
  if (refuse) {
    /* refused after the run's failure: TD_ERR_CANCELLED, which the driver ranks below the failure
     * itself (the replies may arrive in either order) */
    bool after_failure = strcmp(refuse, "an earlier op of the run failed") == 0;
    td_future_fail(op.reply, after_failure ? TD_ERR_CANCELLED : TD_ERR_STATE,
                   "pipeline stage: op %lld of run %lld refused: %s", (long long)op.seq,
                   (long long)op.run, refuse);
    op_release(&op);
    return TD_OK;
  }
  td_value *self = go ? td_value_ref(args[0]) : NULL;
  if (go && td__agent_submit_user(td_rpc_ctx_agent(x), drive_task, self) != TD_OK) {
    td_value_unref(self);
    int nq = 0;
    pthread_mutex_lock(&s->mu);
    s->running = false;
    s->aborted = true;
    ps_op *q = take_queue_locked(s, &nq);
    pthread_mutex_unlock(&s->mu);
    fail_ops(q, nq, "the worker is shutting down");
  }
  return TD_OK;
}

/* __ps_abort [stage, run] */
static td_status h_abort(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)x, (void)res, (void)fut;
  void *obj;
  int64_t run;
  if (n != 2 || td_value_as_int(args[1], &run) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__ps_abort: malformed request");
  TD_TRY(td_value_as_object(args[0], TD__PS_STAGE_TYPE, &obj));
  ps_stage *s = obj;
  ps_op *q = NULL, *stale = NULL;
  ps_saved *old = NULL;
  int nq = 0, nstale = 0, nold = 0;
  pthread_mutex_lock(&s->mu);
  /* an abort may overtake the run's first op here: it then opens the run already aborted, so
   * that op is refused instead of waiting for predecessors that will never be sent */
  if (run > s->run) reset_locked(s, run, &stale, &nstale, &old, &nold);
  if (run == s->run) {
    s->aborted = true;
    q = take_queue_locked(s, &nq);
  }
  pthread_mutex_unlock(&s->mu);
  release_reset(stale, nstale, old, nold);
  if (q) fail_ops(q, nq, "the run was aborted by its driver");
  return TD_OK;
}

/* __ps_zero_grad [stage] */
static td_status h_zero_grad(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  (void)x, (void)res, (void)fut;
  void *obj;
  if (n != 1) return td_set_error(TD_ERR_FORMAT, "__ps_zero_grad: malformed request");
  TD_TRY(td_value_as_object(args[0], TD__PS_STAGE_TYPE, &obj));
  ps_stage *s = obj;
  td_status st = TD_OK;
  for (int c = 0; c < s->nchunks && st == TD_OK; c++) {
    td_tensor_list ps;
    td_tensor_list_init(&ps);
    st = td_module_parameters(s->chunks[c], &ps);
    for (size_t i = 0; i < ps.n && st == TD_OK; i++) st = td_tensor_set_grad(ps.tensors[i], NULL);
    td_tensor_list_fini(&ps);
  }
  return st;
}

void td__pipe_stage_register(void) {
  td_object_type_register(TD__PS_STAGE_TYPE, stage_destroy);
  td__rpc_register_internal("__ps_create", h_create, NULL);
  td__rpc_register_internal("__ps_op", h_op, NULL);
  td__rpc_register_internal("__ps_abort", h_abort, NULL);
  td__rpc_register_internal("__ps_zero_grad", h_zero_grad, NULL);
}
