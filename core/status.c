/* status.c - status table, thread-local error text and leveled logging.
 *
 * The error text lives in a fixed thread-local buffer (no allocation, so it can be set on the
 * out-of-memory path). Logging takes one process-wide mutex per line so lines from different
 * threads never interleave.
 *
 * Lock order: log_mu is a leaf (held only around one fprintf).
 */
#include "core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define ERRBUF_SIZE 1024

static _Thread_local char errbuf[ERRBUF_SIZE];

const char *td_status_str(td_status s) {
  switch (s) {
#define TD_STATUS_STR_(name, value, msg) \
  case TD_##name:                        \
    return msg;
    TD_STATUS_MAP(TD_STATUS_STR_)
#undef TD_STATUS_STR_
  }
  return "unknown status";
}

const char *td_status_name(td_status s) {
  switch (s) {
#define TD_STATUS_NAME_(name, value, msg) \
  case TD_##name:                         \
    return "TD_" #name;
    TD_STATUS_MAP(TD_STATUS_NAME_)
#undef TD_STATUS_NAME_
  }
  return "TD_UNKNOWN";
}

const char *td_last_error(void) { return errbuf; }

void td_clear_error(void) { errbuf[0] = '\0'; }

td_status td_set_error(td_status s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(errbuf, sizeof errbuf, fmt, ap);
  va_end(ap);
  td_log(TD_LOG_DEBUG, "%s: %s", td_status_name(s), errbuf);
  return s;
}

td_status td__error_prefix(td_status s, const char *fmt, ...) {
  /* The arguments may point into errbuf (td_last_error()): format them before touching it. */
  char prefix[ERRBUF_SIZE], old[ERRBUF_SIZE];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, errbuf, sizeof old);
  size_t n = strlen(prefix);
  memcpy(errbuf, prefix, n + 1);
  if (old[0] && n + 2 < sizeof errbuf) { /* truncated at the end, like vsnprintf */
    memcpy(errbuf + n, ": ", 2);
    size_t m = strnlen(old, sizeof errbuf - n - 3);
    memcpy(errbuf + n + 2, old, m);
    errbuf[n + 2 + m] = '\0';
  }
  td_log(TD_LOG_DEBUG, "%s: %s", td_status_name(s), errbuf);
  return s;
}

/* ---- logging ---- */

static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int log_level = TD_LOG_WARN;
static td_log_fn log_fn; /* guarded by log_mu */
static void *log_ud;

static void log_init(void) {
  const char *e = getenv("TD_LOG_LEVEL");
  if (!e || !*e) return;
  static const char *names[] = {"trace", "debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 6; i++) {
    if (strcasecmp(e, names[i]) == 0) {
      log_level = i;
      return;
    }
  }
  if (e[0] >= '0' && e[0] <= '5' && e[1] == '\0') log_level = e[0] - '0';
}

void td_log_set_level(td_log_level level) {
  pthread_once(&log_once, log_init);
  __atomic_store_n(&log_level, (int)level, __ATOMIC_RELAXED);
}

td_log_level td_log_get_level(void) {
  pthread_once(&log_once, log_init);
  return (td_log_level)__atomic_load_n(&log_level, __ATOMIC_RELAXED);
}

void td_log(td_log_level level, const char *fmt, ...) {
  if ((int)level < (int)td_log_get_level() || level >= TD_LOG_OFF) return;
  static const char tags[] = "TDIWE";
  char line[2048];
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  localtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "[tdist %c %02d:%02d:%02d.%03ld] ", tags[level], tm.tm_hour,
                   tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && n < (int)sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&log_mu);
  if (log_fn) log_fn(level, line + n, log_ud);
  else fprintf(stderr, "%s\n", line);
  pthread_mutex_unlock(&log_mu);
}

void td_log_set_handler(td_log_fn fn, void *user_data) {
  pthread_mutex_lock(&log_mu);
  log_fn = fn;
  log_ud = user_data;
  pthread_mutex_unlock(&log_mu);
}
