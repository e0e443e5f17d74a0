/* trace.c - the event recorder behind tdist/trace.h.
 *
 * Each thread that records gets a buffer of its own, linked into a global list the first time and
 * kept for the life of the process (a thread may be inside td__trace_emit with it while another
 * stops tracing), so recording takes only that buffer's uncontended mutex; td_trace_stop writes
 * and empties every buffer.
 * Events are formatted at once as JSON lines in the Chrome trace event format, timestamps in
 * microseconds of CLOCK_MONOTONIC; td_trace_stop writes
 *   {"traceEvents":[
 *   <one event per line>,
 *   ...
 *   ],
 *   "otherData":{"tdist_rank":R,"tdist_name":"...","clock_offset_ns":N,"clock_residual_ns":N}}
 * and tools/tdist-trace relies on that shape (one event per line, otherData last).
 *
 * Lock order: list_mu, then a buffer's mu.
 */
#include "trace_impl.h"

#include <errno.h>
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

typedef struct tbuf {
  pthread_mutex_t mu;
  char *p;
  size_t n, cap;
  int tid;
  uint64_t gen; /* the tracing session its thread-name line belongs to */
  struct tbuf *next;
  /* the thread's open spans (td_trace_begin) */
  struct {
    char name[96], cat[32];
    uint64_t t0;
  } open[32];
  int nopen;
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

int64_t td__trace_test_skew(void) { return test_skew_ns; }
static uint64_t generation = 1; /* one per tracing session (each names its threads) */
static _Thread_local tbuf *mine;

static tbuf *my_buffer(void) {
  uint64_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
  if (mine && mine->gen == gen) return mine;
  if (!mine) {
    tbuf *b = td__calloc(1, sizeof *b);
    if (!b) return NULL;
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_lock(&list_mu);
    b->tid = next_tid++;
    b->next = buffers;
    buffers = b;
    pthread_mutex_unlock(&list_mu);
    mine = b;
  }
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

void td__trace_emit(const char *fmt, ...) {
  tbuf *b = my_buffer();
  if (!b) return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line) n = sizeof line - 1;
  pthread_mutex_lock(&b->mu);
  if (b->n + (size_t)n + 2 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 64 << 10;
    while (cap < b->n + (size_t)n + 2) cap *= 2;
    char *q = td__realloc(b->p, cap);
    if (!q) {
      pthread_mutex_unlock(&b->mu);
      return;
    }
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, line, (size_t)n);
  b->n += (size_t)n;
  b->p[b->n++] = '\n';
  pthread_mutex_unlock(&b->mu);
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

td_status td_trace_start(const char *dir) {
  TD_CHECK_ARG(dir && *dir, "trace_start: NULL or empty directory");
  if (__atomic_load_n(&td__trace_on, __ATOMIC_ACQUIRE))
    return td_set_error(TD_ERR_STATE, "trace_start: tracing is already on");
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return td_set_error(TD_ERR_IO, "trace_start: cannot create %s: %s", dir, strerror(errno));
  pthread_mutex_lock(&list_mu);
  snprintf(out_dir, sizeof out_dir, "%s", dir);
  const char *skew = getenv("TD_TRACE_TEST_SKEW_NS");
  test_skew_ns = skew ? strtoll(skew, NULL, 10) : 0;
  pthread_mutex_unlock(&list_mu);
  __atomic_store_n(&td__trace_on, 1, __ATOMIC_RELEASE);
  return TD_OK;
}

bool td_trace_enabled(void) { return __atomic_load_n(&td__trace_on, __ATOMIC_ACQUIRE) != 0; }

td_status td_trace_stop(void) {
  if (!__atomic_exchange_n(&td__trace_on, 0, __ATOMIC_ACQ_REL)) return TD_OK;
  pthread_mutex_lock(&list_mu);
  tbuf *list = buffers;
  __atomic_add_fetch(&generation, 1, __ATOMIC_ACQ_REL);
  char path[700], tmp[720], name[160];
  if (proc_name[0]) snprintf(name, sizeof name, "%s", proc_name);
  else snprintf(name, sizeof name, "pid%d", (int)getpid());
  snprintf(path, sizeof path, "%s/%s.trace.json", out_dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int rank = proc_rank;
  int64_t off = clock_offset_ns, res = clock_residual_ns;
  pthread_mutex_unlock(&list_mu); /* the list only grows at its head: `list` onwards is stable */
  FILE *f = fopen(tmp, "w");
  td_status st = f ? TD_OK : td_set_error(TD_ERR_IO, "trace_stop: cannot write %s: %s", tmp,
                                          strerror(errno));
  if (f) fprintf(f, "{\"traceEvents\":[\n");
  bool first = true;
  for (tbuf *b = list; b; b = b->next) {
    pthread_mutex_lock(&b->mu); /* a thread still inside emit finishes its line first */
    for (size_t i = 0; f && i < b->n;) {
      char *line = b->p + i, *nl = memchr(line, '\n', b->n - i);
      size_t len = (size_t)(nl - line);
      *nl = 0;
      char *ts = test_skew_ns ? strstr(line, "\"ts\":") : NULL;
      fputs(first ? "" : ",\n", f);
      if (ts) {
        char *end;
        double v = strtod(ts + 5, &end);
        fprintf(f, "%.*s%.3f%s", (int)(ts + 5 - line), line, v + (double)test_skew_ns * 1e-3, end);
      } else {
        fwrite(line, 1, len, f);
      }
      first = false;
      i += len + 1;
    }
    b->n = 0;
    pthread_mutex_unlock(&b->mu);
  }
  if (f) {
    char en[300];
    td__trace_escape(name, en, sizeof en);
    fprintf(f, "\n],\n\"otherData\":{\"tdist_rank\":%d,\"tdist_name\":\"%s\","
            "\"clock_offset_ns\":%lld,\"clock_residual_ns\":%lld}}\n",
            rank, en, (long long)off, (long long)res);
    if (fclose(f) != 0 || rename(tmp, path) != 0)
      st = td_set_error(TD_ERR_IO, "trace_stop: cannot write %s: %s", path, strerror(errno));
  }
  return st;
}

void td_trace_begin(const char *name, const char *cat) {
  if (!TD__TRACE_ON()) return;
  tbuf *b = my_buffer();
  if (!b || b->nopen >= 32) return;
  snprintf(b->open[b->nopen].name, sizeof b->open[0].name, "%s", name ? name : "");
  snprintf(b->open[b->nopen].cat, sizeof b->open[0].cat, "%s", cat ? cat : "user");
  b->open[b->nopen++].t0 = td__now_ns();
}

void td_trace_end(void) {
  if (!TD__TRACE_ON()) return;
  tbuf *b = my_buffer();
  if (!b || b->nopen == 0) return;
  b->nopen--;
  char cat[40];
  td__trace_escape(b->open[b->nopen].cat, cat, sizeof cat);
  td__trace_complete(cat, b->open[b->nopen].name, b->open[b->nopen].t0, td__now_ns(), NULL);
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
