/* trace.c - the event recorder behind tdist/trace.h.
 *
 * Each thread that records gets a buffer of its own, linked into a global list, so recording
 * takes only that buffer's uncontended mutex. Events are formatted at once as JSON lines in the
 * Chrome trace event format, timestamps in microseconds of CLOCK_MONOTONIC, and written to a spool
 * file in the trace directory (opened by td_trace_start) whenever memory would otherwise grow:
 *   - a thread's buffer is written out once it holds TD__TRACE_THREAD_BYTES;
 *   - all buffers are written out once the process holds max_events events in all
 *     (TD_TRACE_MAX_EVENTS, default TD__TRACE_DEFAULT_MAX_EVENTS);
 *   - a thread's buffer is written out and freed when the thread exits (a pthread key's
 *     destructor), and td_trace_stop writes every buffer and frees its storage.
 * Flushing rather than a ring that keeps the newest: the output is a file, and a Chrome trace /
 * PyTorch profiler user expects it complete; the cost is an occasional write of at most
 * max_events lines (a few MB, into the page cache) on the thread that fills the cap. Events are
 * lost only when memory or the file fails; they are counted and reported (otherData's
 * "dropped_events", and a warning when tracing stops). A buffer holds its events as the file
 * separates them (",\n" + line), so a flush is one write(2) on a raw descriptor; a forked child
 * gets no session (fork_child).
 * td_trace_stop writes the rest, then renames the spool to DIR/<name>.trace.json:
 *   {"traceEvents":[
 *   <one event per line>,
 *   ...
 *   ],
 *   "otherData":{"tdist_rank":R,"tdist_name":"...","clock_offset_ns":N,"clock_residual_ns":N,
 *   "dropped_events":N}}
 * and tools/tdist-trace relies on that shape (one event per line, otherData last). Lines from
 * different threads interleave in the file in flush order, not time order; viewers sort by "ts".
 *
 * User spans (td_trace_begin/end) live on a per-thread stack that grows up to
 * TD__TRACE_MAX_DEPTH open spans; deeper begins are counted and skipped, and the ends that match
 * them are skipped too, so every span written is a begin paired with its own end.
 *
 * Invariants: `held` is the number of events in all buffers; a buffer is in `buffers` from its
 * first event until its thread exits; the spool is open exactly while tracing is on.
 * Lock order: list_mu, then a buffer's mu, then file_mu (fork_prepare takes list_mu, file_mu).
 */
#include "trace_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"
#include "tdist/trace.h"

int td__trace_on;

typedef struct open_span {
  char name[96], cat[32];
  uint64_t t0;
} open_span;

typedef struct tbuf {
  pthread_mutex_t mu;
  char *p;
  size_t n, cap; /* bytes */
  size_t nev;    /* events in p */
  int tid;
  uint64_t gen; /* the tracing session its thread-name line belongs to */
  struct tbuf *next;
  /* the thread's open spans (td_trace_begin); only its own thread touches them */
  open_span *open;
  int nopen, open_cap;
  int skipped; /* begins past TD__TRACE_MAX_DEPTH still open (their ends are skipped too) */
} tbuf;

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static tbuf *buffers;
static int next_tid = 1;
static char out_dir[512];
static int proc_rank = -1;
static char proc_name[128];
static int64_t clock_offset_ns, clock_residual_ns;
/* TD_TRACE_TEST_SKEW_NS: tests pretend this process's clock runs that far ahead (written
 * timestamps and the rendezvous estimate both see it), to check the alignment undoes it. */
static int64_t test_skew_ns;
static size_t max_events = TD__TRACE_DEFAULT_MAX_EVENTS;
static size_t held;         /* atomic: events in all buffers */
static uint64_t dropped;    /* atomic: events lost this session */
static int live_buffers;    /* atomic */

/* the spool file of the session (file_mu): a raw descriptor, no stdio buffer, so a forked child
 * that exits flushes nothing of ours into it */
static pthread_mutex_t file_mu = PTHREAD_MUTEX_INITIALIZER;
static int spool = -1;
static char spool_path[560];
static bool spool_first;  /* no event written yet (the next one's leading ",\n" is skipped) */
static bool spool_broken; /* a write failed: the file is no longer one JSON document */

static pthread_once_t key_once = PTHREAD_ONCE_INIT, fork_once = PTHREAD_ONCE_INIT;
static pthread_key_t key;
static void buffer_exit(void *p);
static void key_make(void) { pthread_key_create(&key, buffer_exit); }

int64_t td__trace_test_skew(void) { return test_skew_ns; }
static uint64_t generation = 1; /* one per tracing session (each names its threads) */
static _Thread_local tbuf *mine;

static tbuf *buffer_new(void) {
  tbuf *b = td__calloc(1, sizeof *b);
  if (!b) return NULL;
  pthread_once(&key_once, key_make);
  pthread_mutex_init(&b->mu, NULL);
  pthread_mutex_lock(&list_mu);
  b->tid = next_tid++;
  b->next = buffers;
  buffers = b;
  pthread_mutex_unlock(&list_mu);
  __atomic_add_fetch(&live_buffers, 1, __ATOMIC_RELAXED);
  pthread_setspecific(key, b); /* buffer_exit frees it when the thread ends */
  return b;
}

static tbuf *my_buffer(void) {
  uint64_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
  if (mine && mine->gen == gen) return mine;
  if (!mine && !(mine = buffer_new())) return NULL;
  tbuf *b = mine;
  b->gen = gen; /* before the line below, which comes back here */
  char tname[32] = "";
  pthread_getname_np(pthread_self(), tname, sizeof tname);
  td__trace_emit("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"ts\":0,"
                 "\"args\":{\"name\":\"%s\"}}",
                 proc_rank < 0 ? (int)getpid() : proc_rank, b->tid, tname[0] ? tname : "main");
  return b;
}

int td__trace_pid(void) { return proc_rank < 0 ? (int)getpid() : proc_rank; }

int td__trace_tid(void) {
  tbuf *b = my_buffer();
  return b ? b->tid : 0;
}

static void count_dropped(uint64_t n) { __atomic_add_fetch(&dropped, n, __ATOMIC_RELAXED); }

/* Writes n bytes to the spool. file_mu held. */
static bool spool_write(const char *p, size_t n) {
  while (n) {
    ssize_t w = write(spool, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= (size_t)w;
  }
  return true;
}

/* Writes events (each ",\n" and one JSON line, as buffer_append stores them) to the spool, the
 * first of the file without its comma, with "ts" moved by the test skew when there is one.
 * file_mu held. */
static bool spool_events(const char *p, size_t n) {
  size_t skip = spool_first ? 2 : 0;
  spool_first = false;
  if (!test_skew_ns) return spool_write(p + skip, n - skip);
  for (size_t i = 0; i < n;) { /* tests only: one event at a time */
    const char *line = p + i + 2, *nl = memchr(line, '\n', n - i - 2);
    const char *end = nl ? nl - 1 : p + n, *ts = memmem(line, (size_t)(end - line), "\"ts\":", 5);
    char out[1200], *num;
    double v = ts ? strtod(ts + 5, &num) : 0; /* the number ends before the closing brace */
    int k = ts ? snprintf(out, sizeof out, "%s%.*s%.3f%.*s", skip ? "" : ",\n",
                          (int)(ts + 5 - line), line, v + (double)test_skew_ns * 1e-3,
                          (int)(end - num), num)
               : snprintf(out, sizeof out, "%s%.*s", skip ? "" : ",\n", (int)(end - line), line);
    if (k < 0 || !spool_write(out, (size_t)k < sizeof out ? (size_t)k : sizeof out - 1))
      return false;
    skip = 0;
    i = (size_t)(end - p);
  }
  return true;
}

/* Moves b's events to the spool (or counts them dropped when it cannot take them) and empties
 * b. Events recorded while no session is open (a thread that raced td_trace_stop) are kept for
 * the next one unless discard. b->mu held; takes file_mu. */
static void buffer_flush(tbuf *b, bool discard) {
  if (!b->nev) return;
  pthread_mutex_lock(&file_mu);
  if (spool < 0 && !discard) {
    pthread_mutex_unlock(&file_mu);
    return;
  }
  bool counted = spool >= 0; /* events that found no session are not part of one */
  if (counted && !spool_broken && !spool_events(b->p, b->n)) spool_broken = true;
  bool lost = counted && spool_broken;
  pthread_mutex_unlock(&file_mu);
  if (lost) count_dropped(b->nev);
  __atomic_sub_fetch(&held, b->nev, __ATOMIC_RELAXED);
  b->n = 0;
  b->nev = 0;
}

/* Writes every thread's buffer to the spool: the process holds max_events events. */
static void flush_all(void) {
  pthread_mutex_lock(&list_mu);
  for (tbuf *b = buffers; b; b = b->next) {
    pthread_mutex_lock(&b->mu);
    buffer_flush(b, false);
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_unlock(&list_mu);
}

/* The key's destructor: a thread ends; its events go to the spool and its buffer is freed. */
static void buffer_exit(void *p) {
  tbuf *b = p;
  pthread_mutex_lock(&list_mu);
  for (tbuf **pp = &buffers; *pp; pp = &(*pp)->next)
    if (*pp == b) {
      *pp = b->next;
      break;
    }
  pthread_mutex_lock(&b->mu);
  buffer_flush(b, true);
  pthread_mutex_unlock(&b->mu);
  pthread_mutex_unlock(&list_mu);
  if (mine == b) mine = NULL; /* a later destructor that records gets a new buffer */
  td__free(b->p);
  td__free(b->open);
  pthread_mutex_destroy(&b->mu);
  td__free(b);
  __atomic_sub_fetch(&live_buffers, 1, __ATOMIC_RELAXED);
}

/* Appends ",\n" and line (n bytes) to b: events stored as the file separates them, so a flush is
 * one write. b->mu held. */
static bool buffer_append(tbuf *b, const char *line, size_t n) {
  if (b->n + n + 2 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 64 << 10;
    while (cap < b->n + n + 2) cap *= 2;
    char *q = td__realloc(b->p, cap);
    if (!q) return false;
    b->p = q;
    b->cap = cap;
  }
  b->p[b->n++] = ',';
  b->p[b->n++] = '\n';
  memcpy(b->p + b->n, line, n);
  b->n += n;
  b->nev++;
  return true;
}

void td__trace_emit(const char *fmt, ...) {
  tbuf *b = my_buffer();
  if (!b) {
    count_dropped(1);
    return;
  }
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line) n = sizeof line - 1;
  pthread_mutex_lock(&b->mu);
  bool ok = buffer_append(b, line, (size_t)n);
  size_t now = ok ? __atomic_add_fetch(&held, 1, __ATOMIC_RELAXED) : 0;
  if (ok && b->n >= TD__TRACE_THREAD_BYTES) buffer_flush(b, false);
  pthread_mutex_unlock(&b->mu);
  if (!ok) count_dropped(1);
  if (now >= __atomic_load_n(&max_events, __ATOMIC_RELAXED)) flush_all();
}

/* Copies s into out as the inside of a JSON string (quotes and control characters escaped). */
void td__trace_escape(const char *s, char *out, size_t n) {
  size_t k = 0;
  for (; s && *s && k + 7 < n; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      out[k++] = '\\';
      out[k++] = (char)c;
    } else if (c < 0x20) {
      k += (size_t)snprintf(out + k, n - k, "\\u%04x", c);
    } else {
      out[k++] = (char)c;
    }
  }
  out[k] = 0;
}

void td__trace_complete(const char *cat, const char *name, uint64_t t0, uint64_t t1,
                        const char *args_json) {
  char en[200];
  td__trace_escape(name, en, sizeof en);
  td__trace_emit("{\"ph\":\"X\",\"cat\":\"%s\",\"name\":\"%s\",\"pid\":%d,\"tid\":%d,"
                 "\"ts\":%.3f,\"dur\":%.3f%s%s}",
                 cat, en, td__trace_pid(), td__trace_tid(), (double)t0 * 1e-3,
                 (double)(t1 > t0 ? t1 - t0 : 0) * 1e-3, args_json ? ",\"args\":" : "",
                 args_json ? args_json : "");
}

void td__trace_flow(char ph, uint64_t id, const char *cat, uint64_t ts) {
  td__trace_emit("{\"ph\":\"%c\",\"cat\":\"%s\",\"name\":\"call\",\"id\":\"0x%" PRIx64 "\","
                 "\"pid\":%d,\"tid\":%d,\"ts\":%.3f%s}",
                 ph, cat, id, td__trace_pid(), td__trace_tid(), (double)ts * 1e-3,
                 ph == 'f' ? ",\"bp\":\"e\"" : "");
}

void td__trace_set_process(int rank, const char *name) {
  pthread_mutex_lock(&list_mu);
  proc_rank = rank;
  snprintf(proc_name, sizeof proc_name, "%s", name ? name : "");
  pthread_mutex_unlock(&list_mu);
}

void td__trace_set_clock(int64_t offset_ns, int64_t residual_ns) {
  clock_offset_ns = offset_ns;
  clock_residual_ns = residual_ns;
}

void td__trace_counts_get(td__trace_counts *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&list_mu);
  for (tbuf *b = buffers; b; b = b->next) {
    pthread_mutex_lock(&b->mu);
    out->bytes_held += b->cap;
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_unlock(&list_mu);
  out->events_held = __atomic_load_n(&held, __ATOMIC_RELAXED);
  out->live_buffers = __atomic_load_n(&live_buffers, __ATOMIC_RELAXED);
  out->dropped = __atomic_load_n(&dropped, __ATOMIC_RELAXED);
  out->max_events = __atomic_load_n(&max_events, __ATOMIC_RELAXED);
}

/* fork(): the child does not inherit the session. It starts with tracing off (TD_TRACE or
 * td_trace_start gives it a session of its own), no spool (the parent's descriptor is closed;
 * the parent's file never sees the child), and only its own thread's buffer, emptied: the other
 * threads do not exist in the child, and their buffers' locks may have been held at the fork
 * (those buffers are left to the child's memory). The locks of the list and the file are taken
 * around the fork so the child finds them consistent. */
static void fork_prepare(void) {
  pthread_mutex_lock(&list_mu);
  pthread_mutex_lock(&file_mu);
}

static void fork_parent(void) {
  pthread_mutex_unlock(&file_mu);
  pthread_mutex_unlock(&list_mu);
}

static void fork_child(void) {
  __atomic_store_n(&td__trace_on, 0, __ATOMIC_RELAXED);
  generation++; /* a session of the child names its thread again */
  if (spool >= 0) close(spool);
  spool = -1;
  buffers = mine;
  if (mine) {
    mine->next = NULL;
    mine->n = mine->nev = 0;
  }
  __atomic_store_n(&held, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&live_buffers, mine ? 1 : 0, __ATOMIC_RELAXED);
  fork_parent();
}

static void fork_register(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

/* The cap on events held (TD_TRACE_MAX_EVENTS, a positive integer), else the default. */
static size_t max_events_from_env(void) {
  const char *e = getenv("TD_TRACE_MAX_EVENTS");
  char *end;
  long long v = e && *e ? strtoll(e, &end, 10) : 0;
  if (e && *e && (*end || v < 1)) {
    td_log(TD_LOG_WARN, "trace: TD_TRACE_MAX_EVENTS=%s is not a positive integer; using %d", e,
           TD__TRACE_DEFAULT_MAX_EVENTS);
    v = 0;
  }
  return v > 0 ? (size_t)v : TD__TRACE_DEFAULT_MAX_EVENTS;
}

td_status td_trace_start(const char *dir) {
  TD_CHECK_ARG(dir && *dir, "trace_start: NULL or empty directory");
  if (__atomic_load_n(&td__trace_on, __ATOMIC_ACQUIRE))
    return td_set_error(TD_ERR_STATE, "trace_start: tracing is already on");
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return td_set_error(TD_ERR_IO, "trace_start: cannot create %s: %s", dir, strerror(errno));
  pthread_once(&fork_once, fork_register);
  pthread_mutex_lock(&list_mu);
  pthread_mutex_lock(&file_mu);
  td_status st = TD_OK;
  /* a unique name: workers of several hosts may share the directory */
  snprintf(spool_path, sizeof spool_path, "%s/.trace-XXXXXX", dir);
  spool = mkostemp(spool_path, O_CLOEXEC);
  static const char head[] = "{\"traceEvents\":[\n";
  if (spool < 0 || !spool_write(head, sizeof head - 1)) {
    st = td_set_error(TD_ERR_IO, "trace_start: cannot write in %s: %s", dir, strerror(errno));
    if (spool >= 0) {
      close(spool);
      unlink(spool_path);
      spool = -1;
    }
  } else {
    fchmod(spool, 0644);
    spool_first = true;
    spool_broken = false;
    snprintf(out_dir, sizeof out_dir, "%s", dir);
    const char *skew = getenv("TD_TRACE_TEST_SKEW_NS");
    test_skew_ns = skew ? strtoll(skew, NULL, 10) : 0;
    __atomic_store_n(&max_events, max_events_from_env(), __ATOMIC_RELAXED);
    __atomic_store_n(&dropped, 0, __ATOMIC_RELAXED);
  }
  pthread_mutex_unlock(&file_mu);
  pthread_mutex_unlock(&list_mu);
  if (st == TD_OK) __atomic_store_n(&td__trace_on, 1, __ATOMIC_RELEASE);
  return st;
}

bool td_trace_enabled(void) { return __atomic_load_n(&td__trace_on, __ATOMIC_ACQUIRE) != 0; }

/* Ends the spool with otherData and renames it to DIR/<name>.trace.json. list_mu and file_mu
 * held. */
static td_status spool_finish(uint64_t lost) {
  char path[700], name[160], en[300], tail[800];
  if (proc_name[0]) snprintf(name, sizeof name, "%s", proc_name);
  else snprintf(name, sizeof name, "pid%d", (int)getpid());
  snprintf(path, sizeof path, "%s/%s.trace.json", out_dir, name);
  td__trace_escape(name, en, sizeof en);
  int n = snprintf(tail, sizeof tail, "\n],\n\"otherData\":{\"tdist_rank\":%d,\"tdist_name\":\"%s\","
                   "\"clock_offset_ns\":%lld,\"clock_residual_ns\":%lld,\"dropped_events\":%llu}}\n",
                   proc_rank, en, (long long)clock_offset_ns, (long long)clock_residual_ns,
                   (unsigned long long)lost);
  bool ok = !spool_broken && spool_write(tail, (size_t)n);
  ok = close(spool) == 0 && ok;
  spool = -1;
  if (ok && rename(spool_path, path) == 0) return TD_OK;
  td_status st = td_set_error(TD_ERR_IO, "trace_stop: cannot write %s: %s", path,
                              ok ? strerror(errno) : "a write failed (disk full?)");
  unlink(spool_path);
  return st;
}

td_status td_trace_stop(void) {
  if (!__atomic_exchange_n(&td__trace_on, 0, __ATOMIC_ACQ_REL)) return TD_OK;
  pthread_mutex_lock(&list_mu);
  __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
  for (tbuf *b = buffers; b; b = b->next) {
    pthread_mutex_lock(&b->mu); /* a thread still inside emit finishes its line first */
    buffer_flush(b, false);
    td__free(b->p); /* the storage goes back at once; the thread's next event allocates anew */
    b->p = NULL;
    b->cap = 0;
    pthread_mutex_unlock(&b->mu);
  }
  uint64_t lost = __atomic_exchange_n(&dropped, 0, __ATOMIC_RELAXED);
  pthread_mutex_lock(&file_mu);
  td_status st = spool_finish(lost);
  pthread_mutex_unlock(&file_mu);
  pthread_mutex_unlock(&list_mu);
  if (lost)
    td_log(TD_LOG_WARN, "trace: %llu events were dropped (out of memory, the trace file could "
           "not be written, or spans nested deeper than %d); the trace is incomplete", (unsigned long long)lost,
           TD__TRACE_MAX_DEPTH);
  return st;
}

void td_trace_begin(const char *name, const char *cat) {
  if (!TD__TRACE_ON()) return;
  tbuf *b = my_buffer();
  if (!b) return;
  if (b->skipped || b->nopen == b->open_cap) {
    int cap = b->open_cap ? b->open_cap * 2 : 16;
    open_span *q = b->skipped || cap > TD__TRACE_MAX_DEPTH
                       ? NULL
                       : td__realloc(b->open, (size_t)cap * sizeof *q);
    if (!q) { /* too deep (or no memory): skip it and the end that matches it */
      b->skipped++;
      count_dropped(1);
      return;
    }
    b->open = q;
    b->open_cap = cap;
  }
  open_span *s = &b->open[b->nopen++];
  snprintf(s->name, sizeof s->name, "%s", name ? name : "");
  snprintf(s->cat, sizeof s->cat, "%s", cat ? cat : "user");
  s->t0 = td__now_ns();
}

void td_trace_end(void) {
  if (!TD__TRACE_ON()) return;
  tbuf *b = my_buffer();
  if (!b) return;
  if (b->skipped) {
    b->skipped--;
    return;
  }
  if (b->nopen == 0) return;
  open_span *s = &b->open[--b->nopen];
  char cat[40];
  td__trace_escape(s->cat, cat, sizeof cat);
  td__trace_complete(cat, s->name, s->t0, td__now_ns(), NULL);
}

void td_trace_instant(const char *name, const char *cat) {
  if (!TD__TRACE_ON()) return;
  char en[200], ec[40];
  td__trace_escape(name, en, sizeof en);
  td__trace_escape(cat ? cat : "user", ec, sizeof ec);
  td__trace_emit("{\"ph\":\"i\",\"s\":\"t\",\"cat\":\"%s\",\"name\":\"%s\",\"pid\":%d,\"tid\":%d,"
                 "\"ts\":%.3f}",
                 ec, en, td__trace_pid(), td__trace_tid(), (double)td__now_ns() * 1e-3);
}
