/* watchdog.c - failure detection of the multi-process examples (see watchdog.h).
 *
 * One thread per worker: it sleeps an interval on wd.cv, pings its peers (rank 0: everybody;
 * the others: rank 0) with td_rpc_async, and waits for the answers in short slices so that a
 * loss reported by rank 0 (ex_wd_lost, which only records and signals) ends the process without
 * waiting for a ping. A ping that fails while the watchdog is not stopping is a lost worker.
 *
 * Lock order: wd.mu is a leaf; on_fail runs with it released.
 */
#define _GNU_SOURCE
#include "watchdog.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "example_util.h"

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int64_t interval_ms, timeout_ms; /* from ex_watchdog_configure; 0: the default */
  td_rpc_agent *agent;
  void (*on_fail)(const char *msg);
  void (*on_lost)(int rank, const char *why); /* ex_watchdog_tolerate: rank 0 goes on */
  pthread_t thread;
  bool running, stop;
  bool notified;       /* rank 0 reported a lost worker (ex_wd_lost) */
  char notice[512];    /* its text */
  int epoch;           /* where this worker is (-1: before its first step) */
  int64_t step;
} wd = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .epoch = -1};

/* env_ms reads a positive number of milliseconds from variable name, else def. */
static int64_t env_ms(const char *name, int64_t def) {
  const char *v = getenv(name);
  long long x = v && *v ? atoll(v) : 0;
  return x > 0 ? (int64_t)x : def;
}

void ex_watchdog_tolerate(void (*on_lost)(int rank, const char *why)) { wd.on_lost = on_lost; }

void ex_watchdog_configure(int64_t interval_ms, int64_t timeout_ms) {
  wd.interval_ms = interval_ms;
  wd.timeout_ms = timeout_ms;
}

bool ex_watchdog_enabled(void) {
  const char *v = getenv("TD_WATCHDOG");
  return !(v && !strcmp(v, "0"));
}

void ex_watchdog_note_step(int epoch, int64_t step) {
  __atomic_store_n(&wd.step, step, __ATOMIC_RELAXED);
  __atomic_store_n(&wd.epoch, epoch, __ATOMIC_RELAXED);
}

/* ex_wd_ping() -> none: the liveness probe. */
static td_status ex_wd_ping(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  *res = td_value_none();
  return *res ? TD_OK : TD_ERR_NOMEM;
}

/* ex_wd_lost(text) -> none: rank 0 lost a worker; the watchdog thread stops this process. It
 * only records (a handler never blocks). */
static td_status ex_wd_lost(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  (void)c, (void)fut;
  const char *text = NULL;
  if (n != 1 || td_value_as_string(args[0], &text, NULL) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "ex_wd_lost: expected (text)");
  pthread_mutex_lock(&wd.mu);
  if (!wd.notified) {
    snprintf(wd.notice, sizeof wd.notice, "%s", text);
    wd.notified = true;
    pthread_cond_broadcast(&wd.cv);
  }
  pthread_mutex_unlock(&wd.mu);
  *res = td_value_none();
  return *res ? TD_OK : TD_ERR_NOMEM;
}

void ex_watchdog_register(void) {
  EX_CHECK(td_rpc_register_ex("ex_wd_ping", ex_wd_ping, NULL, TD_RPC_INLINE));
  EX_CHECK(td_rpc_register_ex("ex_wd_lost", ex_wd_lost, NULL, TD_RPC_INLINE));
}

/* stopping says whether ex_watchdog_stop was called (a failed ping is then a normal exit). */
static bool stopping(void) {
  pthread_mutex_lock(&wd.mu);
  bool s = wd.stop;
  pthread_mutex_unlock(&wd.mu);
  return s;
}

bool ex_watchdog_where(char *buf, size_t n) {
  int ep = __atomic_load_n(&wd.epoch, __ATOMIC_RELAXED);
  int64_t st = __atomic_load_n(&wd.step, __ATOMIC_RELAXED);
  if (ep < 0) snprintf(buf, n, "before its first training step");
  else if (st < 0) snprintf(buf, n, "in epoch %d", ep + 1);
  else snprintf(buf, n, "at epoch %d step %lld", ep + 1, (long long)st);
  return ep >= 0;
}

/* finish prints the line about the lost worker (what) and ends the process, through on_fail when
 * the example gave one. */
_Noreturn static void finish(const char *what) {
  char line[900], where[96];
  ex_watchdog_where(where, sizeof where);
  snprintf(line, sizeof line, "%s; this worker (rank %d) was %s", what, td_rpc_rank(wd.agent),
           where);
  if (wd.on_fail) wd.on_fail(line); /* does not return */
  fprintf(stderr, "%s: %s; stopping\n", program_invocation_short_name, line);
  fflush(stderr);
  _exit(1); /* a graceful shutdown would wait for the lost worker */
}

/* tell_others sends rank 0's text to every other worker but the lost one, waiting at most 1 s. */
static void tell_others(const char *text, int lost, char (*names)[128], int world) {
  td_future **f = calloc((size_t)world, sizeof *f);
  if (!f) return;
  td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
  co.timeout_ms = 1000;
  for (int r = 1; r < world; r++) {
    if (r == lost) continue;
    td_value *arg = td_value_string(text);
    if (arg) td_rpc_async(wd.agent, names[r], "ex_wd_lost", &arg, 1, &co, &f[r]);
    td_value_unref(arg);
  }
  for (int r = 1; r < world; r++) {
    if (!f[r]) continue;
    td_future_wait(f[r], 1500);
    td_future_unref(f[r]);
  }
  free(f);
}

/* lost handles a failed ping of rank r: rank 0 tells the others first. */
_Noreturn static void lost(int r, const char *why, char (*names)[128], int world) {
  char text[700];
  snprintf(text, sizeof text, "%s (rank %d) failed: %s", names[r], r, why);
  if (td_rpc_rank(wd.agent) == 0) {
    char notice[800];
    snprintf(notice, sizeof notice, "%s, reported by %s", text, names[0]);
    tell_others(notice, r, names, world);
  }
  finish(text);
}

/* wait_interval sleeps one interval; false once stopped. A notice from rank 0 ends the process. */
static bool wait_interval(void) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += wd.interval_ms / 1000;
  dl.tv_nsec += (wd.interval_ms % 1000) * 1000000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&wd.mu);
  while (!wd.stop && !wd.notified && pthread_cond_timedwait(&wd.cv, &wd.mu, &dl) != ETIMEDOUT) {
  }
  bool stop = wd.stop, notified = wd.notified;
  pthread_mutex_unlock(&wd.mu);
  if (notified && !stop) finish(wd.notice);
  return !stop;
}

/* wait_ping waits for one ping's answer in slices of 200 ms, watching for rank 0's notice; true
 * when the ping failed (the message is then td_last_error's). */
static bool ping_failed(td_future *f) {
  for (;;) {
    td_status s = td_future_wait(f, 200);
    if (s != TD_ERR_TIMEOUT || td_future_done(f)) return td_future_status(f) != TD_OK;
    pthread_mutex_lock(&wd.mu);
    bool notified = wd.notified, stop = wd.stop;
    pthread_mutex_unlock(&wd.mu);
    if (notified && !stop) finish(wd.notice);
    if (stop) return false;
  }
}

static void *watch(void *arg) {
  (void)arg;
  int world = td_rpc_world_size(wd.agent), me = td_rpc_rank(wd.agent);
  char(*names)[128] = calloc((size_t)world, sizeof *names);
  td_future **f = calloc((size_t)world, sizeof *f);
  if (!names || !f) ex_die("watchdog: out of memory");
  for (int r = 0; r < world; r++) {
    td_worker_info wi;
    EX_CHECK(td_rpc_get_worker_info_by_rank(wd.agent, r, &wi));
    snprintf(names[r], sizeof names[r], "%s", wi.name);
  }
  bool *gone = calloc((size_t)world, sizeof *gone); /* tolerated losses: no longer pinged */
  if (!gone) ex_die("watchdog: out of memory");
  td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
  co.timeout_ms = wd.interval_ms + wd.timeout_ms; /* a hung peer's bound */
  bool tolerant = me == 0 && wd.on_lost;
  while (wait_interval()) {
    int lo = me == 0 ? 1 : 0, hi = me == 0 ? world : 1;
    for (int r = lo; r < hi; r++) {
      f[r] = NULL;
      if (gone[r]) continue;
      if (td_rpc_async(wd.agent, names[r], "ex_wd_ping", NULL, 0, &co, &f[r]) != TD_OK &&
          !stopping()) {
        if (!tolerant) lost(r, td_last_error(), names, world);
        gone[r] = true;
        wd.on_lost(r, td_last_error());
      }
    }
    for (int r = lo; r < hi; r++) {
      if (!f[r]) continue;
      bool failed = ping_failed(f[r]);
      if (failed && !stopping()) {
        if (!tolerant) lost(r, td_future_message(f[r]), names, world);
        gone[r] = true;
        wd.on_lost(r, td_future_message(f[r]));
      }
      td_future_unref(f[r]);
      f[r] = NULL;
    }
  }
  free(gone);
  free(f);
  free(names);
  return NULL;
}

void ex_watchdog_start(td_rpc_agent *a, void (*on_fail)(const char *msg)) {
  if (!ex_watchdog_enabled() || td_rpc_world_size(a) < 2 || wd.running) return;
  wd.agent = a;
  wd.on_fail = on_fail;
  if (wd.interval_ms <= 0) wd.interval_ms = env_ms("TD_KEEPALIVE_MS", 2000);
  if (wd.timeout_ms <= 0) wd.timeout_ms = env_ms("TD_KEEPALIVE_TIMEOUT_MS", 20000);
  if (pthread_create(&wd.thread, NULL, watch, NULL) != 0) ex_die("cannot start the watchdog");
  wd.running = true;
}

void ex_watchdog_stop(void) {
  if (!wd.running) return;
  pthread_mutex_lock(&wd.mu);
  wd.stop = true;
  pthread_cond_broadcast(&wd.cv);
  pthread_mutex_unlock(&wd.mu);
  pthread_join(wd.thread, NULL);
  wd.running = false;
}
