/* progress.c - host-driven progress: an embedding runtime (Python's asyncio, any event loop) runs
 * this agent's user code on its own thread, when it wants to.
 *
 * With td_rpc_options.progress = TD_RPC_PROGRESS_HOST, work that runs user code - registered
 * functions serving requests (also through RRef proxies and remote()), and the callbacks of
 * futures that calls complete - is not run on tdist's pool but queued; td_rpc_progress_fd()
 * becomes readable (an eventfd) while the queue holds work, and td_rpc_progress() runs it on the
 * calling thread. tdist's own work (the network thread, internal functions, the bulk copies)
 * keeps its threads. A thread that calls td_rpc_progress (or td_rpc_init in this mode) becomes
 * the progress thread: when it blocks in td_future_wait / td_future_wait_all, or in a graceful
 * td_rpc_shutdown, it keeps running the queue meanwhile, so waiting there cannot deadlock on work
 * only it could run. A graceful shutdown called on another thread (tdist.asyncio runs it in the
 * loop's executor while the loop keeps running the queue) leaves the queue to the progress thread:
 * handlers never run on a thread the program did not give them.
 *
 * A thread's wait pump (thread-local, future.c) names its queue by id, not by address: a pump left
 * on a thread after its agent was destroyed (from another thread, or before the thread makes a
 * new agent) finds no live queue with that id and retires, instead of touching freed memory or
 * running a newer agent's queue on a thread that is not its progress thread. A queue is not freed
 * while a pump runs it (never destroy an agent from inside one of its own handlers).
 *
 * THREAD SAFETY: td__agent_submit_user from any thread; td_rpc_progress from one thread at a time
 * (the progress thread). Lock order: live_mu, then a queue's mutex (a leaf).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "agent_state.h"

typedef struct item {
  td__task_fn fn;
  void *arg;
  struct item *next;
} item;

struct td__hostq {
  pthread_mutex_t mu;
  item *head, *tail;
  size_t n;
  int efd;
  uint64_t id;              /* unique in the process, set at creation */
  int pumping;              /* pumps running this queue now */
  struct td__hostq *next;   /* in the live list */
  pthread_t owner;          /* the progress thread (the last to adopt the queue); guarded by mu */
  int has_owner;
};

static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t live_cv = PTHREAD_COND_INITIALIZER;
static td__hostq *live;
static uint64_t live_next_id;

/* Finds the live queue with id and marks a pump running on it (NULL when it is gone). */
static td__hostq *live_acquire(uint64_t id) {
  pthread_mutex_lock(&live_mu);
  td__hostq *q = live;
  while (q && q->id != id) q = q->next;
  if (q) q->pumping++;
  pthread_mutex_unlock(&live_mu);
  return q;
}

static void live_release(td__hostq *q) {
  pthread_mutex_lock(&live_mu);
  if (--q->pumping == 0) pthread_cond_broadcast(&live_cv);
  pthread_mutex_unlock(&live_mu);
}

td_status td__hostq_create(td__hostq **out) {
  td__hostq *q = td__calloc(1, sizeof *q);
  if (!q) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  q->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (q->efd < 0) {
    td__free(q);
    return td_set_error(TD_ERR_INTERNAL, "rpc: eventfd: %s", strerror(errno));
  }
  pthread_mutex_init(&q->mu, NULL);
  pthread_mutex_lock(&live_mu);
  q->id = ++live_next_id;
  q->next = live;
  live = q;
  pthread_mutex_unlock(&live_mu);
  *out = q;
  return TD_OK;
}

/* Runs what is left (the agent is going away) and frees the queue. */
void td__hostq_destroy(td__hostq *q) {
  if (!q) return;
  pthread_mutex_lock(&live_mu); /* no pump finds it any more; wait for those running it */
  td__hostq **pp = &live;
  while (*pp != q) pp = &(*pp)->next;
  *pp = q->next;
  while (q->pumping) pthread_cond_wait(&live_cv, &live_mu);
  pthread_mutex_unlock(&live_mu);
  while (td__hostq_run(q, -1) > 0) {
  }
  close(q->efd);
  pthread_mutex_destroy(&q->mu);
  td__free(q);
}

static td_status hostq_push(td__hostq *q, td__task_fn fn, void *arg) {
  item *it = td__malloc(sizeof *it);
  if (!it) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  *it = (item){fn, arg, NULL};
  pthread_mutex_lock(&q->mu);
  if (q->tail) q->tail->next = it;
  else q->head = it;
  q->tail = it;
  q->n++;
  pthread_mutex_unlock(&q->mu);
  uint64_t one = 1;
  ssize_t w = write(q->efd, &one, sizeof one); /* readable until drained */
  (void)w;
  return TD_OK;
}

int td__hostq_run(td__hostq *q, int max) {
  int ran = 0;
  while (max < 0 || ran < max) {
    pthread_mutex_lock(&q->mu);
    item *it = q->head;
    if (it) {
      q->head = it->next;
      if (!q->head) q->tail = NULL;
      q->n--;
    }
    if (!q->n) { /* empty: the fd stops being readable (a push after this re-arms it) */
      uint64_t v;
      ssize_t r = read(q->efd, &v, sizeof v);
      (void)r;
    }
    pthread_mutex_unlock(&q->mu);
    if (!it) break;
    it->fn(it->arg);
    td__free(it);
    ran++;
  }
  return ran;
}

td_status td__agent_submit_user(td_rpc_agent *a, td__task_fn fn, void *arg) {
  if (a->hostq) return hostq_push(a->hostq, fn, arg);
  return td__threadpool_submit(a->pool, fn, arg);
}

/* The progress thread's pump for blocking waits (future.c); ud is the queue's id. */
static void pump(void *ud) {
  td__hostq *q = live_acquire((uint64_t)(uintptr_t)ud);
  if (!q) { /* its agent is gone: this thread is nobody's progress thread any more */
    td__future_set_wait_pump(NULL, NULL);
    return;
  }
  td__hostq_run(q, -1);
  live_release(q);
}

static void adopt(td_rpc_agent *a) {
  td__hostq *q = a->hostq;
  td__future_set_wait_pump(pump, (void *)(uintptr_t)q->id);
  pthread_mutex_lock(&q->mu);
  q->owner = pthread_self();
  q->has_owner = 1;
  pthread_mutex_unlock(&q->mu);
}

void td__progress_adopt_thread(td_rpc_agent *a) {
  if (a->hostq) adopt(a);
}

void td__progress_pump(td_rpc_agent *a) {
  if (a->hostq) td__hostq_run(a->hostq, -1);
}

void td__progress_pump_if_owner(td_rpc_agent *a) {
  td__hostq *q = a->hostq;
  if (!q) return;
  pthread_mutex_lock(&q->mu);
  bool mine = q->has_owner && pthread_equal(q->owner, pthread_self());
  pthread_mutex_unlock(&q->mu);
  if (mine) td__hostq_run(q, -1);
}

int td_rpc_progress_fd(const td_rpc_agent *a) { return a && a->hostq ? a->hostq->efd : -1; }

int td_rpc_progress(td_rpc_agent *a, int max_items) {
  if (!a || !a->hostq) {
    td_set_error(TD_ERR_STATE, "rpc_progress: the agent does not use host-driven progress");
    return -1;
  }
  adopt(a);
  return td__hostq_run(a->hostq, max_items);
}
