/* trace.h - a timeline of what every worker did, in the Chrome trace / Perfetto JSON format.
 *
 * With tracing on, a worker records events and writes them to DIR/<name>.trace.json when tracing
 * stops (td_trace_stop, or the agent's shutdown): RPC calls (the caller's send, the
 * request waiting in the callee's queue, the handler, the reply; function name and peer in the
 * arguments, and a flow arrow from each call to its handler), RRef operations, distributed
 * autograd passes, optimizer steps, and the program's own spans (td_trace_begin / td_trace_end).
 * `tools/tdist-trace merge DIR -o run.json` merges the workers' files into one timeline, one
 * process track per worker, clocks aligned with the offsets each worker estimated against rank 0
 * at rendezvous (NTP-style exchanges; the residual uncertainty is recorded). Open it in
 * chrome://tracing or https://ui.perfetto.dev.
 *
 * TD_TRACE=DIR turns tracing on for every worker of a program (td_rpc_init starts it); the API
 * does the same from code. Off, the cost is one predictable branch per event site.
 *
 * Memory is bounded, the trace is not cut: events wait in per-thread buffers of at most 1 MiB and
 * at most TD_TRACE_MAX_EVENTS events in all (default 100000; read by td_trace_start); a buffer
 * that fills, and the buffer of a thread that exits, is written to a temporary file in DIR
 * (.trace-XXXXXX, renamed to <name>.trace.json when tracing stops). Spans nest up to 1024 deep
 * per thread; deeper ones are skipped together with their ends. Events lost (spans too deep, out
 * of memory, a failing disk) are counted in the file's otherData ("dropped_events") and logged
 * at WARN when tracing stops. A child forked while tracing is on starts with tracing off and
 * none of the parent's events (td_trace_start, or TD_TRACE at its td_rpc_init, gives it a file
 * of its own).
 *
 * THREAD SAFETY: every function may be called from any thread; a span begun on a thread must end
 * on it.
 */
#ifndef TDIST_TRACE_H
#define TDIST_TRACE_H

#include <stdbool.h>
#include <stdint.h>

#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* td_trace_start starts recording events of this process into dir (created when missing), in a
 * file named after the worker once it is known (td_rpc_init), else after the process id.
 * TD_ERR_STATE when tracing is already on, TD_ERR_IO when dir cannot take the file. */
TD_API td_status td_trace_start(const char *dir);
/* td_trace_stop stops recording and writes the file. Does nothing when tracing is off. */
TD_API td_status td_trace_stop(void);
/* td_trace_enabled tells whether events are being recorded. */
TD_API bool td_trace_enabled(void);
/* td_trace_begin opens a span named name (category cat, NULL: "user") on the calling thread;
 * td_trace_end closes the innermost open one. Strings are copied. Spans nest (1024 deep; deeper
 * spans are skipped with their own ends, so every span written is a begin with its own end). */
TD_API void td_trace_begin(const char *name, const char *cat);
TD_API void td_trace_end(void);
/* td_trace_instant records a point event. */
TD_API void td_trace_instant(const char *name, const char *cat);

/* ---- flight recorder ----
 * Always on (TD_FLIGHT=0 turns it off), separate from the opt-in trace above: a fixed ring of
 * the last 16384 events of this process (RPC send, arrival, handler start and end, completion;
 * future waits; collective entries and exits with group, sequence number, size and algorithm)
 * and what each thread waits in now. It is dumped as text to DIR/<worker name>.flight:
 *   - when a blocking call reaches its deadline (a collective, td_future_wait, td_rpc_sync),
 *     or fails, only when a dump directory is set (TD_FLIGHT_DIR, td_debug_set_dump_dir), at
 *     most once per 10 s per process;
 *   - on SIGUSR1 (installed by td_rpc_init when the program left SIGUSR1 at its default) and on
 *     td_debug_dump, into the dump directory or else ${TMPDIR:-/tmp}/tdist-flight.
 * `tdist-trace why-hung DIR` reads the dumps of all workers and names what holds the job. */

/* td_debug_dump writes this process's flight recorder to its dump file now, reason in its
 * header. TD_ERR_IO when the file cannot be written, TD_ERR_STATE when the recorder is off.
 * THREAD SAFETY: any thread; blocks on the file system only. */
TD_API td_status td_debug_dump(const char *reason);
/* td_debug_set_dump_dir sets the dump directory (NULL or "": back to TD_FLIGHT_DIR). */
TD_API td_status td_debug_set_dump_dir(const char *dir);

#ifdef __cplusplus
}
#endif

#endif
