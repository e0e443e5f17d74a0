/* metrics.h - the examples' metrics files (--metrics FILE): one JSON object per line.
 *
 * Rank 0 writes FILE, rank r > 0 writes FILE with ".rank<r>" before its extension
 * (run.jsonl -> run.rank1.jsonl), each truncated when opened; scripts/plot.py reads a file and its
 * siblings. Every record has "kind", "rank", "worker" and "time_s" (seconds since the process
 * opened its file):
 *   {"kind": "start", "example": ..., "world_size": n, "config": {...}}
 *   {"kind": "step", "epoch": e, "step": s (global, from 0), "loss": x, "lr": x,
 *    "samples_per_s" or "tokens_per_s": x, "phases": {"forward_s": x, ...}}  (all but loss
 *    optional)
 *   {"kind": "eval", "epoch": e, "<metric>": x}               (test_accuracy, perplexity, ...)
 *   {"kind": "eval", "step": s, "<metric>": x}                (ex_metrics_eval_step: gpt)
 *   {"kind": "counters", "rpc": {td_rpc_stats fields}}         (at the end, when an agent ran)
 * Writing is line-buffered and never fails the run: a file that cannot be written is reported once
 * and then ignored. THREAD SAFETY: any thread (one lock).
 */
#ifndef TD_EXAMPLE_METRICS_H
#define TD_EXAMPLE_METRICS_H

#include <stdbool.h>
#include <stdint.h>

#include "example_util.h"
#include "tdist/rpc.h"

/* ex_metrics_open starts this process's file for path (NULL: metrics off) as rank `rank` called
 * worker, with a "start" record holding config (may be NULL). */
void ex_metrics_open(const char *path, int rank, int world_size, const char *worker,
                     const char *example, const ex_json *config);
/* ex_metrics_rate_name names the throughput field of step records: "samples_per_s" (default)
 * or, for language models, "tokens_per_s". */
void ex_metrics_rate_name(const char *name);
/* ex_metrics_on says whether records are written. */
bool ex_metrics_on(void);

/* A step's phases: names and seconds, n of them (up to 8). */
typedef struct ex_phases {
  int n;
  const char *name[8];
  double s[8];
} ex_phases;
/* ex_phases_add appends a phase (ignored beyond 8). */
void ex_phases_add(ex_phases *p, const char *name, double seconds);

/* ex_metrics_step records one training step. lr, samples_per_s: NAN to leave out; phases: NULL
 * or empty to leave out. */
void ex_metrics_step(int epoch, int64_t step, double loss, double lr, double samples_per_s,
                     const ex_phases *phases);
/* ex_metrics_eval records an evaluation after epoch (1-based count of epochs done). */
void ex_metrics_eval(int epoch, const char *metric, double value);
/* ex_metrics_eval_step records an evaluation made before step `step` (programs that count steps,
 * not epochs: the record holds "step" instead of "epoch"). */
void ex_metrics_eval_step(int64_t step, const char *metric, double value);
/* ex_metrics_counters records the agent's counters (td_rpc_get_stats). */
void ex_metrics_counters(td_rpc_agent *a);
/* ex_metrics_close flushes and closes the file. */
void ex_metrics_close(void);

#endif
