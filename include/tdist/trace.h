/* trace.h - a timeline of what every worker did, in the Chrome trace / Perfetto JSON format.
 *
 * With tracing on, a worker records events into memory and writes them to DIR/<name>.trace.json
 * when tracing stops (td_trace_stop, or the agent's shutdown): RPC calls (the caller's send, the
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
 * TD_ERR_STATE when tracing is already on. */
TD_API td_status td_trace_start(const char *dir);
/* td_trace_stop stops recording and writes the file. Does nothing when tracing is off. */
TD_API td_status td_trace_stop(void);
/* td_trace_enabled tells whether events are being recorded. */
TD_API bool td_trace_enabled(void);
/* td_trace_begin opens a span named name (category cat, NULL: "user") on the calling thread;
 * td_trace_end closes the innermost open one. Strings are copied. Spans nest. */
TD_API void td_trace_begin(const char *name, const char *cat);
TD_API void td_trace_end(void);
/* td_trace_instant records a point event. */
TD_API void td_trace_instant(const char *name, const char *cat);

#ifdef __cplusplus
}
#endif

#endif
