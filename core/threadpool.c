/* threadpool.c - fixed worker pool over a linked FIFO guarded by one mutex.
 *
 * Invariants: `queued` counts tasks in the list, `running` tasks being executed; shutdown waits
 * for both to reach zero. Lock order: p->mu only (tasks run with no lock held).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "threadpool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "core.h"

typedef struct task {
  struct task *next;
  td__task_fn fn;
  void *arg;
} task;

struct td__threadpool {
  pthread_mutex_t mu;
  pthread_cond_t cv_work;
  pthread_cond_t cv_idle;
  task *head, *tail;
  size_t queued, running;
  bool stopping, joined;
  int nthreads;
  size_t max_queued; /* the longest the queue has been (td__threadpool_load) */
  pthread_t *threads;
  /* Spinning (td__threadpool_set_spin): one idle worker at a time polls for this long before it
   * sleeps, so tasks that follow each other closely are taken without waking a thread. */
  int64_t spin_ns;  /* atomic; 0: none */
  bool spinning;    /* under mu: a worker spins now (submit need not signal) */
  size_t hint;      /* atomic copy of queued, for the spinner */
};

static _Thread_local td__threadpool *current_pool;

/* The spinning worker: polls (mu released) until a task is queued or the window ends. Caller
 * holds mu; returns with it held. */
static void spin_wait(td__threadpool *p, uint64_t spin) {
  p->spinning = true;
  pthread_mutex_unlock(&p->mu);
  uint64_t t0 = td__now_ns();
  unsigned idle = 0;
  while (!__atomic_load_n(&p->hint, __ATOMIC_ACQUIRE) && td__now_ns() - t0 < spin) {
    if (++idle % 32 == 0) sched_yield(); /* a runnable thread on this CPU goes first */
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
  }
  pthread_mutex_lock(&p->mu);
  p->spinning = false;
}

static void *worker_main(void *arg) {
  td__threadpool *p = arg;
  current_pool = p;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->head && !p->stopping) {
      uint64_t spin = (uint64_t)__atomic_load_n(&p->spin_ns, __ATOMIC_RELAXED);
      if (spin && !p->spinning) {
        spin_wait(p, spin);
        if (p->head || p->stopping) break;
      }
      pthread_cond_wait(&p->cv_work, &p->mu);
    }
    if (!p->head && p->stopping) break;
    task *t = p->head;
    p->head = t->next;
    if (!p->head) p->tail = NULL;
    p->queued--;
    __atomic_store_n(&p->hint, p->queued, __ATOMIC_RELEASE);
    /* submits skipped the signal while a worker spun: pass the rest on */
    if (p->queued) pthread_cond_signal(&p->cv_work);
    p->running++;
    pthread_mutex_unlock(&p->mu);
    t->fn(t->arg);
    td__free(t);
    pthread_mutex_lock(&p->mu);
    p->running--;
    if (p->queued == 0 && p->running == 0) pthread_cond_broadcast(&p->cv_idle);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

td_status td__threadpool_create(int nthreads, const char *name, td__threadpool **out) {
  TD_CHECK_ARG(out && nthreads >= 1, "threadpool_create: need out and nthreads >= 1 (got %d)",
               nthreads);
  td__threadpool *p = td__calloc(1, sizeof *p);
  if (!p) return td_set_error(TD_ERR_NOMEM, "threadpool_create: out of memory");
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv_work, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* td__threadpool_shutdown_until's deadline */
  pthread_cond_init(&p->cv_idle, &ca);
  pthread_condattr_destroy(&ca);
  p->threads = td__calloc((size_t)nthreads, sizeof(pthread_t));
  if (!p->threads) goto nomem;
  for (int i = 0; i < nthreads; i++) {
    if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) {
      pthread_mutex_lock(&p->mu);
      p->stopping = true;
      pthread_cond_broadcast(&p->cv_work);
      pthread_mutex_unlock(&p->mu);
      for (int j = 0; j < i; j++) pthread_join(p->threads[j], NULL);
      td__free(p->threads);
      td__free(p);
      return td_set_error(TD_ERR_NOMEM, "threadpool_create: pthread_create failed");
    }
    char tn[32];
    snprintf(tn, sizeof tn, "%.10s-%d", name ? name : "td", i % 10000);
    tn[15] = 0;
    pthread_setname_np(p->threads[i], tn);
    p->nthreads = i + 1;
  }
  *out = p;
  return TD_OK;
nomem:
  td__free(p);
  return td_set_error(TD_ERR_NOMEM, "threadpool_create: out of memory");
}

td_status td__threadpool_submit(td__threadpool *p, td__task_fn fn, void *arg) {
  TD_CHECK_ARG(p && fn, "threadpool_submit: NULL pool or function");
  task *t = td__malloc(sizeof *t);
  if (!t) return td_set_error(TD_ERR_NOMEM, "threadpool_submit: out of memory");
  t->next = NULL;
  t->fn = fn;
  t->arg = arg;
  pthread_mutex_lock(&p->mu);
  /* During shutdown, tasks may still queue follow-up work (it is part of the drain). */
  if (p->stopping && current_pool != p) {
    pthread_mutex_unlock(&p->mu);
    td__free(t);
    return td_set_error(TD_ERR_STATE, "threadpool_submit: pool is shutting down");
  }
  if (p->tail) p->tail->next = t;
  else p->head = t;
  p->tail = t;
  p->queued++;
  __atomic_store_n(&p->hint, p->queued, __ATOMIC_RELEASE);
  if (p->queued > p->max_queued) p->max_queued = p->queued;
  if (!p->spinning) pthread_cond_signal(&p->cv_work); /* else the spinner takes it */
  pthread_mutex_unlock(&p->mu);
  return TD_OK;
}

size_t td__threadpool_pending(td__threadpool *p) {
  pthread_mutex_lock(&p->mu);
  size_t n = p->queued + p->running;
  pthread_mutex_unlock(&p->mu);
  return n;
}

void td__threadpool_set_spin(td__threadpool *p, int64_t ns) {
  if (p) __atomic_store_n(&p->spin_ns, ns > 0 ? ns : 0, __ATOMIC_RELAXED);
}

int td__threadpool_is_worker(td__threadpool *p) { return p && current_pool == p; }

void td__threadpool_load(td__threadpool *p, size_t *running, size_t *queued, int *nthreads) {
  pthread_mutex_lock(&p->mu);
  if (running) *running = p->running;
  if (queued) *queued = p->queued;
  if (nthreads) *nthreads = p->nthreads;
  pthread_mutex_unlock(&p->mu);
}

td_status td__threadpool_shutdown_until(td__threadpool *p, uint64_t deadline_ns) {
  if (!p) return TD_OK;
  struct timespec ts = {(time_t)(deadline_ns / 1000000000ull), (long)(deadline_ns % 1000000000ull)};
  td_status st = TD_OK;
  pthread_mutex_lock(&p->mu);
  p->stopping = true;
  pthread_cond_broadcast(&p->cv_work);
  while (p->queued || p->running) {
    if (!deadline_ns) {
      pthread_cond_wait(&p->cv_idle, &p->mu);
    } else if (pthread_cond_timedwait(&p->cv_idle, &p->mu, &ts) == ETIMEDOUT &&
               (p->queued || p->running)) {
      st = td_set_error(TD_ERR_TIMEOUT, "threadpool: %zu tasks running and %zu queued at the "
                        "deadline", p->running, p->queued);
      break;
    }
  }
  pthread_mutex_unlock(&p->mu);
  return st;
}

void td__threadpool_shutdown(td__threadpool *p) { (void)td__threadpool_shutdown_until(p, 0); }

bool td__threadpool_destroy(td__threadpool *p) {
  if (!p) return true;
  pthread_mutex_lock(&p->mu);
  p->stopping = true;
  pthread_cond_broadcast(&p->cv_work);
  bool busy = p->queued || p->running;
  pthread_mutex_unlock(&p->mu);
  if (busy) {
    /* abandoned: the threads finish what they run and then exit on their own; p stays
     * allocated for them (a deliberate leak, once per abandoned pool) */
    for (int i = 0; i < p->nthreads; i++) pthread_detach(p->threads[i]);
    return false;
  }
  for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv_work);
  pthread_cond_destroy(&p->cv_idle);
  td__free(p->threads);
  td__free(p);
  return true;
}
