/* threadpool.h - a fixed-size pool of worker threads running queued tasks (internal).
 *
 * Tasks run in FIFO order on any worker. td__threadpool_shutdown stops new submissions and waits
 * until every queued task has run; td__threadpool_destroy joins the threads and frees the pool.
 * THREAD SAFETY: submit from any thread, including from a task. Shutdown/destroy from a thread
 * that is not one of the pool's workers.
 */
#ifndef TD_CORE_THREADPOOL_H
#define TD_CORE_THREADPOOL_H

#include <stddef.h>

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

/* Stops new submissions and blocks until every queued task has finished. Safe to call twice. */
void td__threadpool_shutdown(td__threadpool *p);

/* Shuts down (if not done), joins the threads and frees p. NULL does nothing. */
void td__threadpool_destroy(td__threadpool *p);

#endif
