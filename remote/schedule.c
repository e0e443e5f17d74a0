/* schedule.c - pipeline schedules (pipeline.h): the op orders of GPipe, 1F1B and interleaved
 * 1F1B, and the driver that runs one training step over the workers' stage objects (stage.c).
 *
 * Design: td_pipe_schedule_order gives each worker's list of (kind, chunk, micro-batch) ops. A run
 * numbers the ops of each worker (seq) and issues op k of worker w once ops 0..k-1 of w have been
 * issued and its data dependency is there (the output of F(i, c-1), the input gradient of
 * B(i, c+1), or for the last chunk's B its own F); the stage runs ops in seq order, so issuing
 * early costs nothing and saves a round trip per op. All driver state belongs to the thread
 * running td_pipe_schedule_run; future callbacks only append the finished op to a completion
 * queue (mu, cv) that this thread drains, so no callback ever takes a decision or blocks.
 *
 * Failure: the first failed op stops the issuing, __ps_abort goes to every stage (their queued
 * ops fail at once), and the run returns after every issued op has finished, with the first
 * error. If ever nothing is in flight, nothing can be issued and the run is not done (a schedule
 * bug), the run fails instead of waiting.
 *
 * Lock order: run.mu is a leaf (held only to push or drain the completion queue).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../core/core.h"
#include "../core/trace_impl.h"
#include "remote_impl.h"
#include "tdist/dist_autograd.h"
#include "tdist/pipeline.h"

struct td_pipe_schedule {
  td_rpc_agent *agent;
  td_pipe_options o;
  int p, v, n;       /* workers, chunks per worker, chunks */
  td_rref **stages;  /* [p] stage objects (references) */
  char (*names)[128]; /* [p] owners */
  int64_t run;       /* runs started */
};

void td_pipe_options_init(td_pipe_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->schedule = TD_PIPE_1F1B;
  o->micro_batches = 4;
  o->virtual_stages = 1;
  o->loss = TD_PIPE_LOSS_MSE;
}

/* ---- op orders ---- */

static td_status check_shape(td_pipe_schedule_kind kind, int p, int m, int v) {
  if (kind != TD_PIPE_GPIPE && kind != TD_PIPE_1F1B && kind != TD_PIPE_INTERLEAVED_1F1B)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule: unknown schedule %d", (int)kind);
  if (p < 1 || p > TD_PIPE_MAX_WORKERS)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule: %d workers (1..%d)", p,
                        TD_PIPE_MAX_WORKERS);
  if (m < 1) return td_set_error(TD_ERR_INVALID, "pipe_schedule: micro_batches must be >= 1, got %d", m);
  if (v < 1) return td_set_error(TD_ERR_INVALID, "pipe_schedule: virtual_stages must be >= 1, got %d", v);
  if (kind != TD_PIPE_INTERLEAVED_1F1B && v != 1)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule: virtual_stages = %d needs the interleaved "
                        "schedule (GPipe and 1F1B run one chunk per worker)", v);
  if (kind == TD_PIPE_INTERLEAVED_1F1B && m % p != 0)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule: the interleaved schedule needs the number "
                        "of micro-batches (%d) to be a multiple of the number of workers (%d)",
                        m, p);
  return TD_OK;
}

td_status td_pipe_schedule_order(td_pipe_schedule_kind kind, int p, int m, int v, int w,
                                 int (*ops)[3], int cap, int *n) {
  TD_TRY(check_shape(kind, p, m, v));
  TD_CHECK_ARG(ops && n && w >= 0 && w < p, "pipe_schedule_order: bad argument");
  int total = m * v, k = 0;
  if (cap < 2 * total)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_order: needs room for %d ops, got %d",
                        2 * total, cap);
#define PUT(kd, chunk, mb) (ops[k][0] = (kd), ops[k][1] = (chunk), ops[k][2] = (mb), k++)
  if (kind == TD_PIPE_GPIPE) {
    for (int i = 0; i < m; i++) PUT(TD__PS_FORWARD, w, i);
    for (int i = 0; i < m; i++) PUT(TD__PS_BACKWARD, w, i);
  } else if (kind == TD_PIPE_1F1B) {
    int warm = p - w - 1 < m ? p - w - 1 : m, rest = m - warm;
    for (int i = 0; i < warm; i++) PUT(TD__PS_FORWARD, w, i);
    for (int i = 0; i < rest; i++) {
      PUT(TD__PS_FORWARD, w, warm + i);
      PUT(TD__PS_BACKWARD, w, i);
    }
    for (int i = rest; i < m; i++) PUT(TD__PS_BACKWARD, w, i);
  } else {
    /* Megatron-LM's forward_backward_pipelining_with_interleaving: the j-th forward of worker w
     * is micro-batch (j / (p v)) p + j mod p of virtual stage (j mod p v) / p; backwards walk the
     * virtual stages in reverse. */
    int warm = m == p ? total : (p - w - 1) * 2 + (v - 1) * p;
    if (warm > total) warm = total;
    int rest = total - warm;
#define FWD(j) PUT(TD__PS_FORWARD, (((j) % (p * v)) / p) * p + w, ((j) / (p * v)) * p + (j) % p)
#define BWD(j) PUT(TD__PS_BACKWARD, (v - 1 - ((j) % (p * v)) / p) * p + w, \
                   ((j) / (p * v)) * p + (j) % p)
    for (int j = 0; j < warm; j++) FWD(j);
    for (int j = 0; j < rest; j++) {
      FWD(warm + j);
      BWD(j);
    }
    for (int j = rest; j < total; j++) BWD(j);
#undef FWD
#undef BWD
  }
#undef PUT
  *n = k;
  return TD_OK;
}

/* ---- creation ---- */

static td_status make_stage(td_rpc_agent *a, td_remote_module *const *chunks, int p, int v, int w,
                            td_rref **out) {
  (void)a;
  td_value *list = td_value_list(), *arg = NULL;
  td_status st = list ? TD_OK : td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  for (int j = 0; j < v && st == TD_OK; j++) {
    td_value *r = td_value_rref(td_remote_module_rref(chunks[j * p + w]));
    if (!r) st = td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
    else if ((st = td_value_list_append(list, r)) != TD_OK) td_value_unref(r);
  }
  td_rref *s = NULL;
  td_future *f = NULL;
  arg = list;
  if (st == TD_OK) st = td_rref_remote(td_remote_module_rref(chunks[w]), "__ps_create", &arg, 1,
                                       NULL, &s);
  td_value_unref(list);
  if (st == TD_OK) st = td_rref_creation_future(s, &f);
  if (st == TD_OK) st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* bounded by the rpc timeout */
  if (st != TD_OK && f) td_set_error(st, "%s", td_future_message(f));
  td_future_unref(f);
  if (st != TD_OK) {
    td_rref_unref(s);
    return td__error_prefix(st, "pipe_schedule_create: stage on %s",
                            td_remote_module_owner(chunks[w]));
  }
  *out = s;
  return TD_OK;
}

td_status td_pipe_schedule_create(td_rpc_agent *a, td_remote_module *const *chunks, int n,
                                  const td_pipe_options *opts, td_pipe_schedule **out) {
  TD_CHECK_ARG(a && chunks && out && n >= 1, "pipe_schedule_create: bad argument");
  td_pipe_options o;
  td_pipe_options_init(&o);
  if (opts) o = *opts;
  if (o.virtual_stages < 1)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule: virtual_stages must be >= 1, got %d",
                        o.virtual_stages);
  if (n % o.virtual_stages != 0)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_create: %d chunks are not %d per worker",
                        n, o.virtual_stages);
  int v = o.virtual_stages, p = n / v;
  TD_TRY(check_shape(o.schedule, p, o.micro_batches, v));
  if (o.loss != TD_PIPE_LOSS_MSE && o.loss != TD_PIPE_LOSS_SUM)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_create: unknown loss %d", (int)o.loss);
  for (int c = 0; c < n; c++) {
    TD_CHECK_ARG(chunks[c], "pipe_schedule_create: chunk %d is NULL", c);
    const char *own = td_remote_module_owner(chunks[c]);
    if (c >= p && strcmp(own, td_remote_module_owner(chunks[c % p])) != 0)
      return td_set_error(TD_ERR_INVALID, "pipe_schedule_create: chunk %d lives on %s, but must "
                          "live with chunk %d on %s (chunk c runs on worker c mod %d)", c, own,
                          c % p, td_remote_module_owner(chunks[c % p]), p);
    for (int d = 0; d < c && c < p; d++)
      if (!strcmp(own, td_remote_module_owner(chunks[d])))
        return td_set_error(TD_ERR_INVALID, "pipe_schedule_create: chunks %d and %d both live on "
                            "%s; the first %d chunks need %d different workers", d, c, own, p, p);
  }
  td_pipe_schedule *s = td__calloc(1, sizeof *s);
  if (s) s->stages = td__calloc((size_t)p, sizeof *s->stages);
  if (s) s->names = td__calloc((size_t)p, sizeof *s->names);
  if (!s || !s->stages || !s->names) {
    td_pipe_schedule_destroy(s);
    return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  }
  s->agent = a, s->o = o, s->p = p, s->v = v, s->n = n;
  for (int w = 0; w < p; w++) {
    snprintf(s->names[w], sizeof s->names[w], "%s", td_remote_module_owner(chunks[w]));
    td_status st = make_stage(a, chunks, p, v, w, &s->stages[w]);
    if (st != TD_OK) {
      td_pipe_schedule_destroy(s);
      return st;
    }
  }
  *out = s;
  return TD_OK;
}

void td_pipe_schedule_destroy(td_pipe_schedule *s) {
  if (!s) return;
  for (int w = 0; s->stages && w < s->p; w++) td_rref_unref(s->stages[w]);
  td__free(s->stages);
  td__free(s->names);
  td__free(s);
}

td_status td_pipe_schedule_zero_grad(td_pipe_schedule *s) {
  TD_CHECK_ARG(s, "pipe_schedule_zero_grad: NULL schedule");
  td_future **fs = td__calloc((size_t)s->p, sizeof *fs);
  if (!fs) return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  td_status st = TD_OK;
  int k = 0;
  for (; k < s->p && st == TD_OK; k++)
    st = td_rref_rpc_async(s->stages[k], "__ps_zero_grad", NULL, 0, NULL, &fs[k]);
  if (st != TD_OK) k--;
  for (int w = 0; w < k; w++) {
    td_status ws = td_future_wait(fs[w], TD_TIMEOUT_INFINITE); /* bounded by the rpc timeout */
    if (ws != TD_OK && st == TD_OK)
      st = td_set_error(ws, "pipe_schedule_zero_grad: %s", td_future_message(fs[w]));
    td_future_unref(fs[w]);
  }
  td__free(fs);
  return st;
}

/* ---- one run ---- */

typedef struct run run;

typedef struct run_op {
  int w, seq, kind, c, mb;
  td_future *f; /* reference, once issued */
  run *r;
} run_op;

struct run {
  td_pipe_schedule *s;
  int m, p, v, n, per; /* per: ops per worker (2 m v) */
  int64_t id;
  run_op *ops;         /* [p * per]: worker w's ops from w * per, in its order */
  int *next;           /* [p]: next op of each worker to issue */
  td_value **xs, **ts; /* [m]: input and target micro-batches */
  td_value **fout, **bout; /* [n * m]: F outputs and B input gradients until consumed */
  bool *fdone, *bdone;     /* [n * m] */
  double scale;
  int issued, completed;
  td_status st; /* the first error */
  char msg[1536];
  td_future **aborts; /* [p], once failed */
  double loss;
  td_pipe_stats stats;
  /* the completion queue: futures' callbacks push, the run's thread drains */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  run_op **q, **qtake;
  int nq;
};

static void op_done(td_future *f, void *ud) {
  (void)f;
  run_op *o = ud;
  run *r = o->r;
  pthread_mutex_lock(&r->mu);
  r->q[r->nq++] = o;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

static const char *op_name(const run_op *o) { return o->kind == TD__PS_FORWARD ? "forward" : "backward"; }

/* fail records the run's first error and asks every stage to drop the run's queued ops. A stage
 * that failed an op refuses its later queued ops (TD_ERR_CANCELLED), and those replies may reach
 * the driver before the failure's own: a root cause replaces a recorded refusal. */
static void fail(run *r, td_status st, const char *fmt, ...) TD_PRINTF(3, 4);
static void fail(run *r, td_status st, const char *fmt, ...) {
  bool first = r->st == TD_OK;
  if (!first && !(r->st == TD_ERR_CANCELLED && st != TD_ERR_CANCELLED)) return;
  r->st = st;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->msg, sizeof r->msg, fmt, ap);
  va_end(ap);
  if (!first) return; /* the stages were told already */
  td_value *idv = td_value_int(r->id);
  for (int w = 0; w < r->p && idv; w++)
    if (td_rref_rpc_async(r->s->stages[w], "__ps_abort", &idv, 1, NULL, &r->aborts[w]) != TD_OK)
      r->aborts[w] = NULL; /* best effort: the stage's queued ops still time out */
  td_value_unref(idv);
}

static bool ready(const run *r, const run_op *o) {
  if (o->kind == TD__PS_FORWARD) return o->c == 0 || r->fdone[(o->c - 1) * r->m + o->mb];
  if (o->c == r->n - 1) return r->fdone[o->c * r->m + o->mb];
  return r->bdone[(o->c + 1) * r->m + o->mb];
}

/* issue sends o with its data; the data slot it consumed is released. */
static td_status issue(run *r, run_op *o) {
  td_value **slot = o->kind == TD__PS_FORWARD
                        ? (o->c == 0 ? &r->xs[o->mb] : &r->fout[(o->c - 1) * r->m + o->mb])
                        : (o->c == r->n - 1 ? NULL : &r->bout[(o->c + 1) * r->m + o->mb]);
  bool last = o->c == r->n - 1;
  int flags = (o->c == 0 ? TD__PS_FIRST : 0) | (last ? TD__PS_LAST : 0) |
              ((int)r->s->o.loss << TD__PS_LOSS_SHIFT);
  td_value *args[9] = {td_value_int(r->id), td_value_int(o->seq), td_value_int(o->kind),
                       td_value_int(o->c / r->p), td_value_int(o->mb), td_value_int(flags),
                       td_value_double(r->scale),
                       slot && *slot ? td_value_ref(*slot) : td_value_none(),
                       o->kind == TD__PS_FORWARD && last && r->ts[o->mb] ? td_value_ref(r->ts[o->mb])
                                                                         : td_value_none()};
  td_status st = TD_OK;
  for (int i = 0; i < 9; i++)
    if (!args[i]) st = td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  if (st == TD_OK)
    st = td_rref_rpc_async(r->s->stages[o->w], "__ps_op", args, 9, NULL, &o->f);
  for (int i = 0; i < 9; i++) td_value_unref(args[i]);
  if (st != TD_OK) return st;
  r->issued++;
  if (slot) {
    td_value_unref(*slot);
    *slot = NULL;
  }
  if (td_future_on_done(o->f, op_done, o) != TD_OK) op_done(o->f, o); /* counted, seen failed */
  return TD_OK;
}

static void issue_ready(run *r) {
  for (int w = 0; w < r->p && r->st == TD_OK; w++) {
    while (r->next[w] < r->per && r->st == TD_OK) {
      run_op *o = &r->ops[w * r->per + r->next[w]];
      if (!ready(r, o)) break;
      td_status st = issue(r, o);
      if (st != TD_OK) {
        fail(r, st, "%s of micro-batch %d, chunk %d on %s not sent: %s", op_name(o), o->mb, o->c,
             r->s->names[w], td_last_error());
        break;
      }
      r->next[w]++;
    }
  }
}

/* finished handles a completed op: its result feeds the next op, its counters the stats. */
static void finished(run *r, run_op *o) {
  r->completed++;
  td_status fs = td_future_done(o->f) ? td_future_status(o->f) : TD_ERR_NOMEM;
  if (fs != TD_OK) {
    fail(r, fs, "%s of micro-batch %d, chunk %d on %s failed: %s", op_name(o), o->mb, o->c,
         r->s->names[o->w], td_future_message(o->f));
    return;
  }
  td_value *v = td_future_value(o->f), *res = td_value_list_get(v, 0);
  int64_t peak = 0;
  double busy = 0;
  if (!res || td_value_as_int(td_value_list_get(v, 1), &peak) != TD_OK ||
      td_value_as_double(td_value_list_get(v, 2), &busy) != TD_OK) {
    fail(r, TD_ERR_FORMAT, "%s of micro-batch %d on %s: malformed reply", op_name(o), o->mb,
         r->s->names[o->w]);
    return;
  }
  if (peak > r->stats.peak_live[o->w]) r->stats.peak_live[o->w] = (int)peak;
  if (busy > r->stats.busy_s[o->w]) r->stats.busy_s[o->w] = busy;
  r->stats.ops++;
  int k = o->c * r->m + o->mb;
  if (o->kind == TD__PS_FORWARD) {
    r->fdone[k] = true;
    if (o->c == r->n - 1) {
      td_tensor *t;
      double l = 0;
      if (td_value_as_tensor(res, &t) != TD_OK || td_tensor_item(t, &l) != TD_OK)
        fail(r, TD_ERR_FORMAT, "loss of micro-batch %d on %s: not a scalar", o->mb,
             r->s->names[o->w]);
      r->loss += l;
    } else {
      r->fout[k] = td_value_ref(res);
    }
  } else {
    r->bdone[k] = true;
    if (o->c > 0) r->bout[k] = td_value_ref(res);
  }
}

static td_status loop(run *r) {
  int total = r->p * r->per;
  for (;;) {
    if (r->st == TD_OK) issue_ready(r);
    if (r->completed == r->issued) {
      if (r->st == TD_OK && r->completed < total)
        fail(r, TD_ERR_STATE, "the schedule stalled after %d of %d ops (nothing in flight, "
             "nothing ready)", r->completed, total);
      break;
    }
    pthread_mutex_lock(&r->mu);
    while (r->nq == 0) pthread_cond_wait(&r->cv, &r->mu); /* every op's RPC has a timeout */
    int nq = r->nq;
    memcpy(r->qtake, r->q, (size_t)nq * sizeof *r->q);
    r->nq = 0;
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < nq; i++) finished(r, r->qtake[i]);
  }
  for (int w = 0; w < r->p; w++) {
    if (!r->aborts[w]) continue;
    td_future_wait(r->aborts[w], TD_TIMEOUT_INFINITE); /* bounded by the rpc timeout */
    td_future_unref(r->aborts[w]);
  }
  return r->st;
}

/* cut splits t along dim 0 into m chunks of `chunk` rows (the last one shorter). */
static td_status cut(td_tensor *t, int m, int64_t chunk, td_value **out) {
  int64_t rows = td_tensor_size(t, 0);
  for (int i = 0; i < m; i++) {
    int64_t start = (int64_t)i * chunk, len = rows - start < chunk ? rows - start : chunk;
    td_tensor *c = NULL;
    TD_TRY(td_tensor_narrow(t, 0, start, len, &c));
    out[i] = td_value_tensor(c);
    td_tensor_unref(c);
    if (!out[i]) return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  }
  return TD_OK;
}

static td_status run_init(run *r, td_pipe_schedule *s, td_tensor *x, td_tensor *target) {
  int64_t rows = td_tensor_size(x, 0);
  int64_t chunk = (rows + s->o.micro_batches - 1) / s->o.micro_batches;
  r->s = s, r->p = s->p, r->v = s->v, r->n = s->n;
  r->m = (int)((rows + chunk - 1) / chunk);
  TD_TRY(check_shape(s->o.schedule, r->p, r->m, r->v));
  r->per = 2 * r->m * r->v;
  int total = r->p * r->per, nm = r->n * r->m;
  r->ops = td__calloc((size_t)total, sizeof *r->ops);
  r->next = td__calloc((size_t)r->p, sizeof *r->next);
  r->xs = td__calloc((size_t)r->m, sizeof *r->xs);
  r->ts = td__calloc((size_t)r->m, sizeof *r->ts);
  r->fout = td__calloc((size_t)nm, sizeof *r->fout);
  r->bout = td__calloc((size_t)nm, sizeof *r->bout);
  r->fdone = td__calloc((size_t)nm, sizeof *r->fdone);
  r->bdone = td__calloc((size_t)nm, sizeof *r->bdone);
  r->aborts = td__calloc((size_t)r->p, sizeof *r->aborts);
  r->q = td__calloc((size_t)total, sizeof *r->q);
  r->qtake = td__calloc((size_t)total, sizeof *r->qtake);
  if (!r->ops || !r->next || !r->xs || !r->ts || !r->fout || !r->bout || !r->fdone ||
      !r->bdone || !r->aborts || !r->q || !r->qtake)
    return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  int (*order)[3] = td__calloc((size_t)r->per, sizeof *order);
  if (!order) return td_set_error(TD_ERR_NOMEM, "pipeline: out of memory");
  td_status st = TD_OK;
  for (int w = 0; w < r->p && st == TD_OK; w++) {
    int k = 0;
    st = td_pipe_schedule_order(s->o.schedule, r->p, r->m, r->v, w, order, r->per, &k);
    for (int j = 0; j < k && st == TD_OK; j++)
      r->ops[w * r->per + j] = (run_op){w, j, order[j][0], order[j][1], order[j][2], NULL, r};
  }
  td__free(order);
  TD_TRY(st);
  TD_TRY(cut(x, r->m, chunk, r->xs));
  if (target) TD_TRY(cut(target, r->m, chunk, r->ts));
  r->scale = s->o.loss == TD_PIPE_LOSS_MSE ? 1.0 / (double)td_tensor_numel(target)
                                           : 1.0 / (double)rows;
  r->stats.workers = r->p, r->stats.micro_batches = r->m, r->stats.virtual_stages = r->v;
  return TD_OK;
}

static void run_fini(run *r) {
  int total = r->p * r->per, nm = r->n * r->m;
  for (int i = 0; r->ops && i < total; i++) td_future_unref(r->ops[i].f);
  for (int i = 0; i < r->m; i++) {
    if (r->xs) td_value_unref(r->xs[i]);
    if (r->ts) td_value_unref(r->ts[i]);
  }
  for (int i = 0; i < nm; i++) {
    if (r->fout) td_value_unref(r->fout[i]);
    if (r->bout) td_value_unref(r->bout[i]);
  }
  td__free(r->ops), td__free(r->next), td__free(r->xs), td__free(r->ts);
  td__free(r->fout), td__free(r->bout), td__free(r->fdone), td__free(r->bdone);
  td__free(r->aborts), td__free(r->q), td__free(r->qtake);
}

static td_status check_inputs(td_pipe_schedule *s, td_tensor *x, td_tensor *target) {
  TD_CHECK_ARG(s && x, "pipe_schedule_run: NULL argument");
  if (td_tensor_ndim(x) < 1 || td_tensor_size(x, 0) < 1)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_run: the input needs a non-empty dim 0");
  if (s->o.loss == TD_PIPE_LOSS_MSE && !target)
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_run: the MSE loss needs a target");
  if (target && (td_tensor_ndim(target) < 1 || td_tensor_size(target, 0) != td_tensor_size(x, 0)))
    return td_set_error(TD_ERR_INVALID, "pipe_schedule_run: the target has %lld rows, the input "
                        "%lld", td_tensor_ndim(target) < 1 ? 0LL
                                                          : (long long)td_tensor_size(target, 0),
                        (long long)td_tensor_size(x, 0));
  return TD_OK;
}

td_status td_pipe_schedule_run(td_pipe_schedule *s, td_tensor *x, td_tensor *target,
                               double *loss, td_pipe_stats *stats) {
  TD_TRY(check_inputs(s, x, target));
  static const char *const kinds[] = {"gpipe", "1f1b", "interleaved_1f1b"};
  uint64_t t0 = td__now_ns();
  run r;
  memset(&r, 0, sizeof r);
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  r.id = ++s->run;
  /* the stages run plain local autograd: no call of the run joins the caller's context */
  td_dist_autograd_context *prev = td_dist_autograd_set_current(NULL);
  td_status st = run_init(&r, s, x, target);
  if (st == TD_OK) {
    st = loop(&r);
    if (st != TD_OK) st = td_set_error(st, "pipe_schedule_run (%s, run %lld): %s",
                                       kinds[s->o.schedule], (long long)r.id, r.msg);
  }
  td_dist_autograd_set_current(prev);
  uint64_t t1 = td__now_ns();
  r.stats.wall_s = (double)(t1 - t0) * 1e-9;
  double busy = 0;
  for (int w = 0; w < r.p; w++) busy += r.stats.busy_s[w] / r.p;
  r.stats.bubble = busy > 0 ? r.stats.wall_s / busy - 1 : 0;
  if (TD__TRACE_ON()) {
    char args[128];
    snprintf(args, sizeof args, "{\"schedule\":\"%s\",\"micro_batches\":%d,\"ok\":%s}",
             kinds[s->o.schedule], r.m, st == TD_OK ? "true" : "false");
    td__trace_complete("pipeline", "pipeline schedule run", t0, t1, args);
  }
  double l = r.loss;
  td_pipe_stats sv = r.stats;
  run_fini(&r);
  pthread_mutex_destroy(&r.mu);
  pthread_cond_destroy(&r.cv);
  if (st != TD_OK) return st;
  if (loss) *loss = l;
  if (stats) *stats = sv;
  return TD_OK;
}
