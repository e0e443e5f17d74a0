/* threadpool.h - a fixed-size pool of worker threads running queued tasks (internal).
 *
 * Tasks run in FIFO order on any worker. td__threadpool_shutdown stops new submissions and waits
 * until every queued task has run; td__threadpool_destroy joins the threads and frees the pool.
 * THREAD SAFETY: submit from any thread, including from a task. Shutdown/destroy from a thread
 * that is not one of the pool's workers.
 */
#ifndef TD_CORE_THREADPOOL_H
#define TD_CORE_THREADPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"

typedef struct td__threadpool td__threadpool;
typedef void (*td__task_fn)(void *arg);

/* Creates a pool of nthreads (>= 1) threads named "<name>-<i>". */
td_status td__threadpool_create(int nthreads, const char *name, td__threadpool **out);

/* Queues fn(arg). After shutdown began, only the pool's own tasks may still queue work (it is
 * part of the drain); other threads get TD_ERR_STATE and fn is never called. */
td_status td__threadpool_submit(td__threadpool *p, td__task_fn fn, void *arg);

/* Returns the number of tasks queued or running. */
size_t td__threadpool_pending(td__threadpool *p);

/* True when the calling thread is one of p's workers. */
int td__threadpool_is_worker(td__threadpool *p);
/* td__threadpool_set_spin lets one idle worker at a time poll for new tasks for ns nanoseconds
 * before it sleeps (0, the default: workers sleep at once), so a task submitted soon after the
 * last one finished needs no wake-up. THREAD SAFETY: any thread. */
void td__threadpool_set_spin(td__threadpool *p, int64_t ns);

/* td__threadpool_load reads how many tasks run and wait now, and the pool's size (any out may be
 * NULL). */
void td__threadpool_load(td__threadpool *p, size_t *running, size_t *queued, int *nthreads);

/* Stops new submissions and blocks until every queued task has finished. Safe to call twice. */
void td__threadpool_shutdown(td__threadpool *p);

/* td__threadpool_shutdown_until is td__threadpool_shutdown bounded by deadline_ns (td__now_ns
 * clock; 0: none): TD_ERR_TIMEOUT when tasks still run or wait then. They keep running. */
td_status td__threadpool_shutdown_until(td__threadpool *p, uint64_t deadline_ns);

/* Shuts down, joins the threads and frees p; returns true. When tasks still run or wait (after a
 * bounded shutdown timed out), it does not wait for them: the threads are detached, finish on
 * their own, and p is never freed; returns false. NULL does nothing (true). */
bool td__threadpool_destroy(td__threadpool *p);

#endif
