/* work.c - the order-keeping queue behind a group's operations, and the worker thread that runs
 * the asynchronous ones.
 *
 * Every operation of a group, synchronous or not, runs in call order (the order in which the
 * calls entered td__work_run), one at a time:
 *   - a synchronous call runs on the calling thread when nothing is queued or running (the common
 *     case: no thread hop, so small operations keep their latency); otherwise it queues itself
 *     like an asynchronous call and waits for its future;
 *   - an asynchronous call queues a copy of the operation, holding references to its tensors, and
 *     returns the operation's future; the worker thread (started by the first queued operation)
 *     runs the queue front to back and completes each future with the operation's outcome.
 * `busy` marks an operation running on either kind of thread, so the worker never starts one
 * while a synchronous call runs inline, and an inline run never overtakes queued work.
 *
 * Futures complete on the worker thread (so their callbacks run there and must not block; see
 * td_future_on_done). Successful ones carry the output: a tensor value (all_reduce, broadcast:
 * the tensor; all_gather_into_tensor: the output; reduce_scatter: the output), a list of tensors
 * (all_gather's list form) or none (barrier). Failed ones carry the operation's status and
 * message.
 *
 * Lock order: w->mu, then (in td__pg_execute, never while holding w->mu) pg->mu.
 */
#include <pthread.h>

#include "coll_impl.h"
#include "../core/flight_impl.h"

typedef struct item {
  td__op op; /* with references to its tensors and its own copy of the list */
  td_future *f;
  struct item *next;
} item;

struct td__work {
  td_process_group *pg;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  item *head, *tail;
  bool busy;    /* an operation is running (worker or inline) */
  bool closing; /* td__work_destroy started */
  bool started; /* the worker thread exists */
  pthread_t th;
};

td_status td__work_create(td_process_group *pg) {
  td__work *w = td__calloc(1, sizeof *w);
  if (!w) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  w->pg = pg;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  pg->work = w;
  return TD_OK;
}

static int list_len(const td_process_group *pg, const td__op *op) {
  return op->list ? pg->size : 0;
}

static void item_free(td_process_group *pg, item *it) {
  if (!it) return;
  td_tensor_unref(it->op.t);
  td_tensor_unref(it->op.whole);
  for (int i = 0; i < list_len(pg, &it->op); i++) td_tensor_unref(it->op.list[i]);
  td__free(it->op.list);
  td_future_unref(it->f);
  td__free(it);
}

static item *item_make(td_process_group *pg, const td__op *op) {
  item *it = td__calloc(1, sizeof *it);
  if (!it) return NULL;
  it->op = *op;
  it->op.list = NULL;
  it->f = td_future_create();
  if (op->list) it->op.list = td__calloc((size_t)pg->size, sizeof *it->op.list);
  if (!it->f || (op->list && !it->op.list)) {
    it->op.t = it->op.whole = NULL;
    item_free(pg, it);
    return NULL;
  }
  if (op->t) td_tensor_ref(op->t);
  if (op->whole) td_tensor_ref(op->whole);
  for (int i = 0; i < list_len(pg, op); i++) it->op.list[i] = td_tensor_ref(op->list[i]);
  return it;
}

/* The value a successful operation's future carries (NULL: none). */
static td_value *result_value(td_process_group *pg, const td__op *op) {
  if (op->kind == TD__K_BARRIER) return NULL;
  if (op->kind == TD__K_ALL_GATHER && op->list) {
    td_value *l = td_value_list();
    for (int i = 0; l && i < pg->size; i++) {
      td_value *v = td_value_tensor(op->list[i]);
      if (!v || td_value_list_append(l, v) != TD_OK) {
        td_value_unref(v);
        td_value_unref(l);
        return NULL;
      }
    }
    return l;
  }
  return td_value_tensor(op->kind == TD__K_ALL_GATHER ? op->whole : op->t);
}

static void finish(td_process_group *pg, item *it, td_status st) {
  if (st == TD_OK) td_future_complete(it->f, result_value(pg, &it->op));
  else td_future_fail(it->f, st, "%s", td_last_error());
  item_free(pg, it);
}

static void *worker_main(void *arg) {
  td__work *w = arg;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->closing && (!w->head || w->busy)) pthread_cond_wait(&w->cv, &w->mu);
    if (w->closing) break;
    item *it = w->head;
    w->head = it->next;
    if (!w->head) w->tail = NULL;
    w->busy = true;
    pthread_mutex_unlock(&w->mu);
    finish(w->pg, it, td__pg_execute(w->pg, &it->op));
    pthread_mutex_lock(&w->mu);
    w->busy = false;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

/* Runs op on this thread when the group is idle; returns false (and does nothing) otherwise. */
static bool run_inline(td__work *w, const td__op *op, td_status *st) {
  pthread_mutex_lock(&w->mu);
  bool idle = !w->busy && !w->head && !w->closing;
  if (idle) w->busy = true;
  pthread_mutex_unlock(&w->mu);
  if (!idle) return false;
  *st = td__pg_execute(w->pg, op);
  pthread_mutex_lock(&w->mu);
  w->busy = false;
  if (w->head) pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return true;
}

static td_status enqueue(td__work *w, const td__op *op, td_future **out) {
  td_process_group *pg = w->pg;
  item *it = item_make(pg, op);
  if (!it) return td_set_error(TD_ERR_NOMEM, "%s: out of memory", td__kind_name(op->kind));
  td_future *f = td_future_ref(it->f);
  td_status st = TD_OK;
  pthread_mutex_lock(&w->mu);
  if (w->closing) {
    st = td_set_error(TD_ERR_STATE, "%s: process group %llu is being destroyed",
                      td__kind_name(op->kind), (unsigned long long)pg->id);
  } else if (!w->started) {
    if (pthread_create(&w->th, NULL, worker_main, w) != 0)
      st = td_set_error(TD_ERR_IO, "%s: cannot start the group's worker thread",
                        td__kind_name(op->kind));
    else
      w->started = true;
  }
  if (st == TD_OK) {
    if (w->tail) w->tail->next = it;
    else w->head = it;
    w->tail = it;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  if (st != TD_OK) {
    item_free(pg, it);
    td_future_unref(f);
    return st;
  }
  *out = f;
  return TD_OK;
}

td_status td__work_run(td_process_group *pg, const td__op *op, td_future **out) {
  td__work *w = pg->work;
  if (out) return enqueue(w, op, out);
  td_status st;
  uint64_t t0 = td__now_ns();
  if (run_inline(w, op, &st)) { /* the caller waited in it (a queued one: in td_future_wait) */
    td__flight_count_wait(td__now_ns() - t0);
    return st;
  }
  td_future *f = NULL;
  TD_TRY(enqueue(w, op, &f));
  st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* bounded: every queued operation has a deadline */
  td_future_unref(f);
  return st;
}

void td__work_destroy(td__work *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->closing = true;
  item *it = w->head;
  w->head = w->tail = NULL;
  pthread_cond_broadcast(&w->cv);
  bool started = w->started;
  pthread_mutex_unlock(&w->mu);
  if (started) pthread_join(w->th, NULL); /* after the running operation, if any */
  while (it) {
    item *next = it->next;
    td_future_fail(it->f, TD_ERR_CANCELLED, "%s: process group %llu was destroyed before the "
                   "operation ran", td__kind_name(it->op.kind), (unsigned long long)w->pg->id);
    item_free(w->pg, it);
    it = next;
  }
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  td__free(w);
}
