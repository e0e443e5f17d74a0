/* trace_impl.h - recording trace events from inside tdist (core/trace.c; public API in
 * tdist/trace.h). Every event site is guarded by TD__TRACE_ON(), one predictable branch when
 * tracing is off. Timestamps are td__now_ns() values. */
#ifndef TD_CORE_TRACE_IMPL_H
#define TD_CORE_TRACE_IMPL_H

#include <stddef.h>
#include <stdint.h>

extern int td__trace_on;
#define TD__TRACE_ON() __builtin_expect(__atomic_load_n(&td__trace_on, __ATOMIC_RELAXED), 0)

/* A complete span ("X") on the calling thread; args_json is NULL or a JSON object. */
void td__trace_complete(const char *cat, const char *name, uint64_t t0, uint64_t t1,
                        const char *args_json);
/* A flow point: ph 's' starts arrow id (inside the span that encloses ts on this thread), 'f'
 * ends it at the next span that starts on this thread. */
void td__trace_flow(char ph, uint64_t id, const char *cat, uint64_t ts);
/* One JSON event line (printf format), appended to this thread's buffer. */
void td__trace_emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Escapes s for a JSON string into out. */
void td__trace_escape(const char *s, char *out, size_t n);
/* This process's track (rank) and file name (worker name), and its clock's offset to rank 0's
 * (ns to add to local times) with the estimate's half round trip. */
void td__trace_set_process(int rank, const char *name);
void td__trace_set_clock(int64_t offset_ns, int64_t residual_ns);
int td__trace_pid(void);
/* The pretend clock skew of tests (TD_TRACE_TEST_SKEW_NS), 0 normally. */
int64_t td__trace_test_skew(void);
int td__trace_tid(void);

/* Memory bounds of the recorder (core/trace.c): the events held in all threads' buffers before
 * they are written to the trace file (TD_TRACE_MAX_EVENTS overrides the default), the bytes one
 * thread's buffer holds before it is written, the depth of open td_trace_begin spans per thread
 * (deeper ones are skipped with their ends, and counted as dropped). */
#define TD__TRACE_DEFAULT_MAX_EVENTS 100000
#define TD__TRACE_THREAD_BYTES (1u << 20)
#define TD__TRACE_MAX_DEPTH 1024

/* What the recorder holds now (for tests): events in buffers, bytes allocated for them, buffers
 * of live threads, events dropped this session, and the cap in force. */
typedef struct td__trace_counts {
  size_t events_held, bytes_held;
  int live_buffers;
  uint64_t dropped;
  size_t max_events;
} td__trace_counts;
void td__trace_counts_get(td__trace_counts *out);

#endif
