"""build_ffi.py - the cffi description of the tdist Python binding (out-of-line API mode).

Run by the project's build (bindings/python/CMakeLists.txt):
    /usr/bin/python3 build_ffi.py OUT.c
writes the C source of the extension module `tdist._tdist_cffi`; CMake compiles it against
Python's headers and links it with libtdist, so the build needs no internet and no setuptools.

CDEF declares the part of the public C API (include/tdist/*.h) the binding uses - nothing else:
the binding never sees tdist's internals. In API mode the C compiler checks every declaration
against the real headers, so a header change that breaks the binding breaks its build.

GLUE is the extension's own C: callbacks that tdist may call on any of its threads and that
therefore must not take Python's GIL - the release of borrowed buffers and of Python objects
held by tdist values, and log lines - only queue work for the binding's service thread (a Python
thread, tdist/_service.py), which waits for it in tdpy_service_wait with the GIL released.
Registered Python functions and future callbacks are `extern "Python"` (cffi takes the GIL).
"""
import sys

import cffi

CDEF = r"""
typedef enum td_status {
  TD_OK, TD_ERR_INVALID, TD_ERR_STATE, TD_ERR_NOMEM, TD_ERR_SHAPE, TD_ERR_DTYPE, TD_ERR_DEVICE,
  TD_ERR_IO, TD_ERR_FORMAT, TD_ERR_TIMEOUT, TD_ERR_NOT_FOUND, TD_ERR_EXISTS, TD_ERR_REMOTE,
  TD_ERR_CANCELLED, TD_ERR_UNAVAILABLE, TD_ERR_UNSUPPORTED, TD_ERR_INTERNAL, TD_ERR_AUTH, ...
} td_status;
typedef enum td_log_level {
  TD_LOG_TRACE, TD_LOG_DEBUG, TD_LOG_INFO, TD_LOG_WARN, TD_LOG_ERROR, TD_LOG_OFF, ...
} td_log_level;
const char *td_status_str(td_status s);
const char *td_status_name(td_status s);
const char *td_last_error(void);
void td_clear_error(void);
void td_log_set_level(td_log_level level);
td_log_level td_log_get_level(void);
unsigned td_version(void);
const char *td_version_string(void);

/* tensors */
typedef enum td_dtype {
  TD_DTYPE_F32, TD_DTYPE_F64, TD_DTYPE_I64, TD_DTYPE_F16, TD_DTYPE_BF16, TD_DTYPE_I32,
  TD_DTYPE_U8, TD_DTYPE_BOOL, ...
} td_dtype;
#define TD_TIMEOUT_ZERO ...
#define TD_TIMEOUT_INFINITE ...
#define TD_TIMEOUT_DEFAULT ...
#define TD_DTYPE_COUNT ...
#define TD_MAX_DIMS ...
typedef enum td_device_type { TD_DEVICE_CPU, TD_DEVICE_CUDA, ... } td_device_type;
typedef struct td_device { td_device_type type; int index; ...; } td_device;
typedef struct td_tensor td_tensor;
typedef void (*td_tensor_release_fn)(void *ctx, void *data);
size_t td_dtype_size(td_dtype dt);
const char *td_dtype_name(td_dtype dt);
td_device td_device_cpu(void);
td_tensor *td_tensor_ref(td_tensor *t);
void td_tensor_unref(td_tensor *t);
int td_tensor_ndim(const td_tensor *t);
const int64_t *td_tensor_shape(const td_tensor *t);
const int64_t *td_tensor_strides(const td_tensor *t);
int64_t td_tensor_numel(const td_tensor *t);
td_dtype td_tensor_dtype(const td_tensor *t);
td_device td_tensor_device(const td_tensor *t);
size_t td_tensor_nbytes(const td_tensor *t);
bool td_tensor_is_contiguous(const td_tensor *t);
void *td_tensor_data(const td_tensor *t);
td_status td_tensor_from_buffer(const void *data, const int64_t *shape, int ndim, td_dtype dt,
                                td_tensor **out);
td_status td_tensor_from_borrowed(void *data, const int64_t *shape, int ndim, td_dtype dt,
                                  td_tensor_release_fn release, void *ctx, td_tensor **out);
td_status td_tensor_to(const td_tensor *t, td_device dev, td_tensor **out);
td_status td_tensor_contiguous(const td_tensor *t, td_tensor **out);
td_status td_tensor_item(const td_tensor *t, double *out);
td_status td_tensor_sum_all(const td_tensor *t, td_tensor **out);
bool td_tensor_requires_grad(const td_tensor *t);
td_status td_tensor_set_requires_grad(td_tensor *t, bool requires_grad);
td_tensor *td_tensor_grad(const td_tensor *t);

/* values */
typedef enum td_value_kind {
  TD_VALUE_NONE, TD_VALUE_BOOL, TD_VALUE_INT, TD_VALUE_DOUBLE, TD_VALUE_STRING, TD_VALUE_BYTES,
  TD_VALUE_TENSOR, TD_VALUE_LIST, TD_VALUE_DICT, TD_VALUE_EXT, ...
} td_value_kind;
typedef struct td_value td_value;
td_value *td_value_none(void);
td_value *td_value_bool(bool v);
td_value *td_value_int(int64_t v);
td_value *td_value_double(double v);
td_value *td_value_string_n(const char *s, size_t n);
td_value *td_value_bytes(const void *data, size_t n);
td_value *td_value_tensor(td_tensor *t);
td_value *td_value_list(void);
td_value *td_value_dict(void);
td_value *td_value_ref(td_value *v);
void td_value_unref(td_value *v);
td_value_kind td_value_kind_of(const td_value *v);
const char *td_value_kind_name(const td_value *v);
td_status td_value_as_bool(const td_value *v, bool *out);
td_status td_value_as_int(const td_value *v, int64_t *out);
td_status td_value_as_double(const td_value *v, double *out);
td_status td_value_as_string(const td_value *v, const char **out, size_t *len);
td_status td_value_as_bytes(const td_value *v, const void **data, size_t *len);
td_status td_value_as_tensor(const td_value *v, td_tensor **out);
size_t td_value_list_len(const td_value *list);
td_value *td_value_list_get(const td_value *list, size_t i);
td_status td_value_list_append(td_value *list, td_value *item);
size_t td_value_dict_len(const td_value *dict);
td_status td_value_dict_set(td_value *dict, const char *key, td_value *item);
td_status td_value_dict_entry(const td_value *dict, size_t i, const char **key, td_value **item);
const char *td_value_to_string(const td_value *v, char *buf, size_t n);

/* futures */
typedef struct td_future td_future;
typedef void (*td_future_cb)(td_future *f, void *ctx);
td_future *td_future_create(void);
td_future *td_future_ref(td_future *f);
void td_future_unref(td_future *f);
td_status td_future_complete(td_future *f, td_value *value);
bool td_future_done(const td_future *f);
td_status td_future_wait(td_future *f, int64_t timeout_ms);
td_status td_future_status(const td_future *f);
const char *td_future_message(const td_future *f);
td_value *td_future_value(const td_future *f);
td_status td_future_on_done(td_future *f, td_future_cb cb, void *ctx);
td_status td_future_wait_all(td_future *const *fs, int n, int64_t timeout);

/* the agent */
typedef struct td_rpc_agent td_rpc_agent;
typedef struct td_worker_info { char name[128]; int id; char address[256]; } td_worker_info;
#define TD_RPC_PROGRESS_THREADS ...
#define TD_RPC_PROGRESS_HOST ...
typedef struct td_rpc_options {
  const char *init_method;
  int num_worker_threads;
  int64_t rpc_timeout_ms;
  int64_t init_timeout_ms;
  const char *listen_addr;
  int progress;
  const char *secret;
  int insecure;
  int max_world_size;
  ...;
} td_rpc_options;
typedef struct td_rpc_traffic {
  uint64_t frames_sent, bytes_sent, frames_received, bytes_received;
  uint64_t direct_frames_sent, direct_bytes_sent, direct_frames_received, direct_bytes_received;
  uint64_t lane_frames_sent, lane_bytes_sent, lane_frames_received, lane_bytes_received;
} td_rpc_traffic;
typedef struct td_rpc_stats {
  td_rpc_traffic traffic;
  uint64_t calls_started, calls_succeeded, calls_failed, calls_timed_out;
  uint64_t requests_received, requests_failed, requests_rejected;
  uint64_t refused_connections;
  int64_t calls_pending;
  int64_t requests_active;
  int64_t pool_pending;
  uint64_t streams_opened, streams_shared;
  ...;
} td_rpc_stats;
typedef struct td_rpc_call_opts { int64_t timeout_ms; ...; } td_rpc_call_opts;
void td_rpc_call_opts_init(td_rpc_call_opts *o);
typedef struct td_rpc_ctx td_rpc_ctx;
typedef td_status (*td_rpc_fn)(td_rpc_ctx *ctx, td_value *const *args, int nargs,
                               td_value **result, td_future **async_result);
void td_rpc_options_init(td_rpc_options *o);
td_status td_rpc_init(const char *name, int rank, int world_size, const td_rpc_options *opts,
                      td_rpc_agent **out);
td_status td_rpc_init_from_env(const char *name, const td_rpc_options *opts,
                               td_rpc_agent **out);
void td_rpc_init_interrupt(void);
int td_rpc_initial_world_size(const td_rpc_agent *a);
td_status td_rpc_group_members(td_rpc_agent *a, int *members);
td_status td_rpc_shutdown(td_rpc_agent *a, bool graceful, int64_t timeout_ms);
void td_rpc_destroy(td_rpc_agent *a);
td_status td_rpc_register(const char *name, td_rpc_fn fn, void *user_data);
td_status td_rpc_unregister(const char *name);
td_status td_rpc_async(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                       int nargs, const td_rpc_call_opts *opts, td_future **out);
td_status td_rpc_get_worker_info(td_rpc_agent *a, const char *name, td_worker_info *out);
td_status td_rpc_get_worker_info_by_rank(td_rpc_agent *a, int rank, td_worker_info *out);
td_status td_rpc_self(td_rpc_agent *a, td_worker_info *out);
int td_rpc_rank(const td_rpc_agent *a);
int td_rpc_world_size(const td_rpc_agent *a);
td_status td_rpc_set_default_timeout(td_rpc_agent *a, int64_t timeout_ms);
int64_t td_rpc_get_default_timeout(const td_rpc_agent *a);
td_status td_rpc_get_stats(td_rpc_agent *a, td_rpc_stats *out);
int td_rpc_progress_fd(const td_rpc_agent *a);
int td_rpc_progress(td_rpc_agent *a, int max_items);
td_status td_rpc_secret_generate(char *out, size_t n);
td_rpc_agent *td_rpc_ctx_agent(const td_rpc_ctx *c);
const char *td_rpc_ctx_caller_name(const td_rpc_ctx *c);
int td_rpc_ctx_caller_rank(const td_rpc_ctx *c);
void *td_rpc_ctx_user_data(const td_rpc_ctx *c);

/* RRefs and objects */
typedef struct td_rref td_rref;
typedef struct td_rref_id { uint64_t v; } td_rref_id;
typedef struct td_rref_fork_id { uint64_t v; } td_rref_fork_id;
td_status td_remote(td_rpc_agent *a, const char *to, const char *fn, td_value *const *args,
                    int nargs, const td_rpc_call_opts *opts, td_rref **out);
td_status td_rref_create_local(td_rpc_agent *a, td_value *value, td_rref **out);
td_rref *td_rref_ref(td_rref *r);
void td_rref_unref(td_rref *r);
td_status td_rref_to_here_async(td_rref *r, int64_t timeout_ms, td_future **out);
td_status td_rref_local_value(td_rref *r, td_value **out);
int td_rref_owner(const td_rref *r);
const char *td_rref_owner_name(const td_rref *r);
bool td_rref_is_owner(const td_rref *r);
bool td_rref_confirmed_by_owner(const td_rref *r);
td_status td_rref_creation_future(td_rref *r, td_future **out);
const char *td_rref_to_string(const td_rref *r, char *buf, size_t n);
td_status td_rref_rpc_async(td_rref *r, const char *fn, td_value *const *args, int nargs,
                            const td_rpc_call_opts *opts, td_future **out);
td_status td_rref_remote(td_rref *r, const char *fn, td_value *const *args, int nargs,
                         const td_rpc_call_opts *opts, td_rref **out);
td_value *td_value_rref(td_rref *r);
td_status td_value_as_rref(const td_value *v, td_rref **out);
typedef void (*td_object_destroy_fn)(void *obj);
td_status td_object_type_register(const char *name, td_object_destroy_fn destroy);
td_status td_value_object(const char *type, void *obj, td_value **out);
td_status td_value_as_object(const td_value *v, const char *type, void **obj);
const char *td_value_object_type(const td_value *v);

/* distributed autograd and optimizer */
typedef struct td_grad_map td_grad_map;
td_tensor *td_grad_map_get(td_grad_map *m, const td_tensor *t);
size_t td_grad_map_size(td_grad_map *m);
void td_grad_map_destroy(td_grad_map *m);
typedef struct td_dist_autograd_context td_dist_autograd_context;
typedef struct td_dist_autograd_context_id { uint64_t v; } td_dist_autograd_context_id;
td_status td_dist_autograd_context_begin(td_rpc_agent *a, td_dist_autograd_context **out);
td_status td_dist_autograd_context_end(td_dist_autograd_context *ctx);
td_dist_autograd_context_id td_dist_autograd_context_get_id(
    const td_dist_autograd_context *ctx);
td_status td_dist_autograd_backward(td_dist_autograd_context *ctx, td_tensor *const *roots,
                                    int n, bool retain_graph);
td_status td_dist_autograd_get_gradients(td_dist_autograd_context *ctx, td_grad_map **out);
typedef enum td_optim_kind {
  TD_OPTIM_SGD, TD_OPTIM_ADAM, TD_OPTIM_ADAMW, TD_OPTIM_ADAGRAD, TD_OPTIM_RMSPROP, ...
} td_optim_kind;
typedef struct td_optim_options {
  td_optim_kind kind;
  double lr, weight_decay;
  bool maximize;
  double momentum, dampening;
  bool nesterov;
  double beta1, beta2, eps;
  bool amsgrad;
  double lr_decay, initial_accumulator_value, alpha;
  bool centered;
  ...;
} td_optim_options;
void td_optim_options_init(td_optim_options *o, td_optim_kind kind);
typedef struct td_dist_optimizer td_dist_optimizer;
td_status td_dist_optimizer_create(td_rpc_agent *a, const td_optim_options *opts,
                                   td_rref *const *params, size_t n, td_dist_optimizer **out);
td_status td_dist_optimizer_step(td_dist_optimizer *o, td_dist_autograd_context *ctx);
td_status td_dist_optimizer_set_lr(td_dist_optimizer *o, double lr);
void td_dist_optimizer_destroy(td_dist_optimizer *o);

/* the binding's glue (GLUE below) */
void tdpy_release(void *ctx, void *data);
void tdpy_object_destroy(void *obj);
td_status tdpy_set_error(td_status st, const char *message);
td_status tdpy_future_fail(td_future *f, td_status st, const char *message);
void tdpy_log_capture(int on);
int tdpy_service_wait(int64_t timeout_ms);
void tdpy_service_stop(void);
size_t tdpy_take_releases(uintptr_t *out, size_t max);
size_t tdpy_release_pending(void);
int tdpy_take_log(int *level, char *buf, size_t n, uint64_t *dropped);
size_t tdpy_grad_map_items(td_grad_map *m, td_tensor **keys, td_tensor **grads, size_t max);
td_status tdpy_rpc_async(td_rpc_agent *a, const char *to, const char *fn, td_value **args,
                         int nargs, int64_t timeout_ms, td_future **out);
td_status tdpy_future_outcome(td_future *f, td_value **value);
typedef struct tdpy_scalar_t { int kind; int64_t i; double d; } tdpy_scalar_t;
tdpy_scalar_t tdpy_scalar(const td_value *v);

/* Python code that tdist calls (cffi takes the GIL) */
extern "Python" td_status tdpy_dispatch(td_rpc_ctx *, td_value *const *, int, td_value **,
                                        td_future **);
extern "Python" void tdpy_drain_callbacks(void);
extern "Python" void tdpy_run_callback_now(uintptr_t);
void tdpy_future_done(td_future *f, void *ctx);
int tdpy_cb_next(td_future **f, uintptr_t *key);
int tdpy_cb_reacquire(void);
"""

GLUE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tdist/tdist.h>

/* The service queue: keys of Python objects tdist no longer needs (borrowed buffers, objects
 * held by values) and log lines, filled on any thread without the GIL, drained by the binding's
 * service thread. Lock order: tdpy_mu is a leaf. */
static pthread_mutex_t tdpy_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t tdpy_cv = PTHREAD_COND_INITIALIZER;
static uintptr_t *tdpy_rel;
static size_t tdpy_rel_n, tdpy_rel_cap;
#define TDPY_LOGQ 256
#define TDPY_LOGLEN 1024
static struct { int level; char msg[TDPY_LOGLEN]; } tdpy_logq[TDPY_LOGQ];
static size_t tdpy_log_head, tdpy_log_n;
static uint64_t tdpy_log_dropped;
static int tdpy_stop;

static uint64_t tdpy_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Releases wait at most TDPY_RELEASE_DELAY_MS for the service thread, which is woken at once
 * only when TDPY_RELEASE_BATCH have piled up: the binding also drains the queue inline on its
 * hot paths (calls, handlers), so a busy program pays no thread switch per tensor. */
#define TDPY_RELEASE_DELAY_MS 10
#define TDPY_RELEASE_BATCH 64
static uint64_t tdpy_rel_first_ms; /* when the queue last became non-empty */
static int tdpy_svc_idle;          /* the service thread waits with no release due */

static void tdpy_push_release(uintptr_t key) {
  pthread_mutex_lock(&tdpy_mu);
  if (tdpy_rel_n == tdpy_rel_cap) {
    size_t cap = tdpy_rel_cap ? tdpy_rel_cap * 2 : 256;
    uintptr_t *p = realloc(tdpy_rel, cap * sizeof *p);
    if (!p) { /* out of memory: the object stays alive (a leak, never a crash) */
      pthread_mutex_unlock(&tdpy_mu);
      return;
    }
    tdpy_rel = p;
    tdpy_rel_cap = cap;
  }
  tdpy_rel[tdpy_rel_n] = key;
  __atomic_store_n(&tdpy_rel_n, tdpy_rel_n + 1, __ATOMIC_RELAXED);
  if (tdpy_rel_n == 1) tdpy_rel_first_ms = tdpy_now_ms();
  if ((tdpy_rel_n == 1 && tdpy_svc_idle) || tdpy_rel_n == TDPY_RELEASE_BATCH)
    pthread_cond_signal(&tdpy_cv);
  pthread_mutex_unlock(&tdpy_mu);
}

/* A hint (no lock): the hot paths call it per call and drain when it is non-zero. */
static size_t tdpy_release_pending(void) { return __atomic_load_n(&tdpy_rel_n, __ATOMIC_RELAXED); }

/* td_tensor_release_fn of buffers borrowed from Python objects: ctx is the object's key. */
static void tdpy_release(void *ctx, void *data) {
  (void)data;
  tdpy_push_release((uintptr_t)ctx);
}

/* td_object_destroy_fn of the "python.object" type: obj is the object's key. */
static void tdpy_object_destroy(void *obj) { tdpy_push_release((uintptr_t)obj); }

static td_status tdpy_set_error(td_status st, const char *message) {
  return td_set_error(st, "%s", message);
}

static td_status tdpy_future_fail(td_future *f, td_status st, const char *message) {
  return td_future_fail(f, st, "%s", message);
}

static void tdpy_log_line(td_log_level level, const char *msg, void *ud) {
  (void)ud;
  pthread_mutex_lock(&tdpy_mu);
  if (tdpy_log_n == TDPY_LOGQ) {
    tdpy_log_dropped++; /* the service thread is behind: drop, count, never block tdist */
  } else {
    size_t i = (tdpy_log_head + tdpy_log_n++) % TDPY_LOGQ;
    tdpy_logq[i].level = (int)level;
    snprintf(tdpy_logq[i].msg, TDPY_LOGLEN, "%s", msg);
    pthread_cond_signal(&tdpy_cv);
  }
  pthread_mutex_unlock(&tdpy_mu);
}

static void tdpy_log_capture(int on) { td_log_set_handler(on ? tdpy_log_line : NULL, NULL); }

static void tdpy_deadline(struct timespec *ts, uint64_t ms_from_now) {
  clock_gettime(CLOCK_REALTIME, ts);
  ts->tv_sec += (time_t)(ms_from_now / 1000);
  ts->tv_nsec += (long)(ms_from_now % 1000) * 1000000;
  if (ts->tv_nsec >= 1000000000) ts->tv_sec++, ts->tv_nsec -= 1000000000;
}

/* Waits (GIL released by cffi) until there is work for the service thread - a log line, a
 * batch of releases, or a release older than TDPY_RELEASE_DELAY_MS - or timeout_ms passes or
 * stop was asked; returns 1 when stopping. */
static int tdpy_service_wait(int64_t timeout_ms) {
  struct timespec end;
  tdpy_deadline(&end, (uint64_t)timeout_ms);
  pthread_mutex_lock(&tdpy_mu);
  for (;;) {
    if (tdpy_stop || tdpy_log_n || tdpy_rel_n >= TDPY_RELEASE_BATCH) break;
    struct timespec until = end;
    tdpy_svc_idle = !tdpy_rel_n;
    if (tdpy_rel_n) {
      uint64_t now = tdpy_now_ms(), due = tdpy_rel_first_ms + TDPY_RELEASE_DELAY_MS;
      if (now >= due) break;
      tdpy_deadline(&until, due - now);
    }
    int timed_out = pthread_cond_timedwait(&tdpy_cv, &tdpy_mu, &until) != 0;
    if (timed_out && tdpy_svc_idle) break; /* timeout_ms passed with nothing to do */
  }
  tdpy_svc_idle = 0;
  int stop = tdpy_stop;
  tdpy_stop = 0; /* one stop request per service thread */
  pthread_mutex_unlock(&tdpy_mu);
  return stop;
}

static void tdpy_service_stop(void) {
  pthread_mutex_lock(&tdpy_mu);
  tdpy_stop = 1;
  pthread_cond_broadcast(&tdpy_cv);
  pthread_mutex_unlock(&tdpy_mu);
}

static size_t tdpy_take_releases(uintptr_t *out, size_t max) {
  pthread_mutex_lock(&tdpy_mu);
  size_t n = tdpy_rel_n < max ? tdpy_rel_n : max;
  if (n) memcpy(out, tdpy_rel + (tdpy_rel_n - n), n * sizeof *out);
  __atomic_store_n(&tdpy_rel_n, tdpy_rel_n - n, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&tdpy_mu);
  return n;
}

/* Collects up to max entries of a gradient map (new references to key and gradient) and
 * returns how many it has, so a caller can enumerate it without running Python under the
 * map's lock. */
typedef struct { td_tensor **keys, **grads; size_t n, max; } tdpy_items;

static td_status tdpy_collect(void *ctx, td_tensor *t, td_tensor *g) {
  tdpy_items *it = ctx;
  if (it->n < it->max) {
    it->keys[it->n] = td_tensor_ref(t);
    it->grads[it->n] = td_tensor_ref(g);
  }
  it->n++;
  return TD_OK;
}

static size_t tdpy_grad_map_items(td_grad_map *m, td_tensor **keys, td_tensor **grads,
                                  size_t max) {
  tdpy_items it = {keys, grads, 0, max};
  td_grad_map_foreach(m, tdpy_collect, &it);
  return it.n;
}

/* Python future callbacks, combined. A future's completion runs tdpy_future_done on whatever
 * thread completes it (a pool thread, mostly); instead of every such thread waiting for the GIL
 * (16 pool threads convoying on it cost a third of the binding's calls/s), the completion is
 * queued, and only a thread that finds nobody draining the queue enters Python
 * (tdpy_drain_callbacks) and runs the queued callbacks in order. Before each callback the
 * draining role is given up (tdpy_cb_next) and taken back afterwards only if it is still free
 * (tdpy_cb_reacquire): a callback that blocks never holds the others up, since the next
 * completion then starts a drainer of its own. Lock order: tdpy_cb_mu is a leaf. */
typedef struct { td_future *f; uintptr_t key; } tdpy_cb;
static pthread_mutex_t tdpy_cb_mu = PTHREAD_MUTEX_INITIALIZER;
static tdpy_cb *tdpy_cbq;
static size_t tdpy_cb_head, tdpy_cb_n, tdpy_cb_cap;
static int tdpy_cb_draining;

static void tdpy_drain_callbacks(void);
static void tdpy_run_callback_now(uintptr_t key);

/* td_future_cb of the binding's futures: ctx is the callback's key. */
static void tdpy_future_done(td_future *f, void *ctx) {
  pthread_mutex_lock(&tdpy_cb_mu);
  if (tdpy_cb_n == tdpy_cb_cap) {
    size_t cap = tdpy_cb_cap ? tdpy_cb_cap * 2 : 64;
    tdpy_cb *q = malloc(cap * sizeof *q);
    if (!q) { /* out of memory: this one runs here, without the queue */
      pthread_mutex_unlock(&tdpy_cb_mu);
      tdpy_run_callback_now((uintptr_t)ctx);
      return;
    }
    for (size_t i = 0; i < tdpy_cb_n; i++) q[i] = tdpy_cbq[(tdpy_cb_head + i) % tdpy_cb_cap];
    free(tdpy_cbq);
    tdpy_cbq = q;
    tdpy_cb_cap = cap;
    tdpy_cb_head = 0;
  }
  tdpy_cbq[(tdpy_cb_head + tdpy_cb_n++) % tdpy_cb_cap] = (tdpy_cb){td_future_ref(f), (uintptr_t)ctx};
  int drain = !tdpy_cb_draining;
  if (drain) tdpy_cb_draining = 1;
  pthread_mutex_unlock(&tdpy_cb_mu);
  if (drain) tdpy_drain_callbacks(); /* takes the GIL */
}

/* The drainer's next callback (1; *f a reference for the caller), giving the role up either
 * way; 0 when the queue is empty. */
static int tdpy_cb_next(td_future **f, uintptr_t *key) {
  pthread_mutex_lock(&tdpy_cb_mu);
  int got = tdpy_cb_n > 0;
  if (got) {
    *f = tdpy_cbq[tdpy_cb_head].f;
    *key = tdpy_cbq[tdpy_cb_head].key;
    tdpy_cb_head = (tdpy_cb_head + 1) % tdpy_cb_cap;
    tdpy_cb_n--;
  }
  tdpy_cb_draining = 0;
  pthread_mutex_unlock(&tdpy_cb_mu);
  return got;
}

/* After a callback: takes the role back (1) when nobody took it and callbacks wait. */
static int tdpy_cb_reacquire(void) {
  pthread_mutex_lock(&tdpy_cb_mu);
  int take = !tdpy_cb_draining && tdpy_cb_n > 0;
  if (take) tdpy_cb_draining = 1;
  pthread_mutex_unlock(&tdpy_cb_mu);
  return take;
}

/* The binding's hot paths in one C call each (every cffi call releases and takes the GIL). */

/* td_rpc_async with a timeout instead of an options struct; releases the argument values (the
 * binding's own new references) whatever the outcome. */
static td_status tdpy_rpc_async(td_rpc_agent *a, const char *to, const char *fn, td_value **args,
                                int nargs, int64_t timeout_ms, td_future **out) {
  td_rpc_call_opts o = TD_RPC_CALL_OPTS_INIT;
  o.timeout_ms = timeout_ms;
  td_status st = td_rpc_async(a, to, fn, args, nargs, &o, out);
  for (int i = 0; i < nargs; i++) td_value_unref(args[i]);
  return st;
}

/* The status of done future f, and on success its value (borrowed; NULL for none) in *value. */
static td_status tdpy_future_outcome(td_future *f, td_value **value) {
  td_status st = td_future_status(f);
  *value = st == TD_OK ? td_future_value(f) : NULL;
  return st;
}

/* v's kind, with an int's or bool's value in .i and a double's in .d (one call for the
 * scalars; returned by value, so threads share no scratch). */
typedef struct tdpy_scalar_t { int kind; int64_t i; double d; } tdpy_scalar_t;

static tdpy_scalar_t tdpy_scalar(const td_value *v) {
  tdpy_scalar_t s = {(int)td_value_kind_of(v), 0, 0.0};
  if (s.kind == TD_VALUE_INT) td_value_as_int(v, &s.i);
  else if (s.kind == TD_VALUE_DOUBLE) td_value_as_double(v, &s.d);
  else if (s.kind == TD_VALUE_BOOL) {
    bool b = false;
    td_value_as_bool(v, &b);
    s.i = b;
  }
  return s;
}

static int tdpy_take_log(int *level, char *buf, size_t n, uint64_t *dropped) {
  pthread_mutex_lock(&tdpy_mu);
  int got = tdpy_log_n > 0;
  if (got) {
    *level = tdpy_logq[tdpy_log_head].level;
    snprintf(buf, n, "%s", tdpy_logq[tdpy_log_head].msg);
    tdpy_log_head = (tdpy_log_head + 1) % TDPY_LOGQ;
    tdpy_log_n--;
  }
  *dropped = tdpy_log_dropped;
  tdpy_log_dropped = 0;
  pthread_mutex_unlock(&tdpy_mu);
  return got;
}
"""


def make_ffi():
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("tdist._tdist_cffi", GLUE)
    return ffi


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_ffi.py OUT.c")
    make_ffi().emit_c_code(sys.argv[1])
