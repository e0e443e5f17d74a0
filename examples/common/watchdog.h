/* watchdog.h - failure detection of the multi-process examples (not part of the library): a
 * worker that dies or hangs stops the job within the keepalive timeout, under any launcher.
 *
 * Why: a launcher that stops the job when one worker fails (tdistrun, mpirun, an example forking
 * its workers) hides the problem, but `srun` (without --kill-on-bad-exit) and hand-started
 * workers leave the survivors running. A survivor blocked in a call to the dead worker learns
 * of it from the agent (the connection closes, or its keepalive expires), but one that waits on
 * a third worker (a trainer waiting at the server's epoch barrier, the server waiting for the
 * dead trainer's report) would wait forever.
 *
 * How: on by default. Rank 0 pings every other worker and every other worker pings rank 0,
 * once per interval (TD_KEEPALIVE_MS, default 2000 ms, the agent's keepalive interval), each
 * ping bounded by interval + keepalive timeout (TD_KEEPALIVE_TIMEOUT_MS, default 20000 ms, the
 * agent's). A ping that fails names a lost worker: a dead process fails it at once (its
 * connection is refused), a hung one within the bounds. Rank 0 tells every other worker which
 * one was lost (ex_wd_lost, bounded by 1 s), so every survivor prints the same member, then each
 * survivor prints one line
 *   "<program>: worker2 (rank 2) failed: <why>; this worker (rank 0) was at epoch 1 step 37;
 *    stopping"
 * and exits with status 1 (or runs the example's on_fail, which then owns the exit).
 * TD_WATCHDOG=0 turns it off (the job then relies on its launcher to stop it).
 *
 * THREAD SAFETY: ex_watchdog_register before td_rpc_init; ex_watchdog_start / _stop from the
 * main thread; ex_watchdog_note_step from any thread.
 * Lock order: the watchdog's mutex is a leaf; on_fail runs with it released.
 */
#ifndef TD_EX_WATCHDOG_H
#define TD_EX_WATCHDOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/rpc.h"

/* ex_watchdog_register registers the watchdog's functions (every worker, before td_rpc_init). */
void ex_watchdog_register(void);
/* ex_watchdog_configure sets the ping interval and keepalive timeout, ms (0: keep the default:
 * the environment's, else 2000 / 20000), for the next ex_watchdog_start. */
void ex_watchdog_configure(int64_t interval_ms, int64_t timeout_ms);
/* ex_watchdog_enabled says whether ex_watchdog_start will watch (TD_WATCHDOG is not 0). */
bool ex_watchdog_enabled(void);
/* ex_watchdog_start starts watching the group of agent a (does nothing when disabled or with a
 * world of one). on_fail (may be NULL: print the line and exit 1) runs once, on the watchdog's
 * thread, with the line's text, when a worker is lost; it must end the process. */
void ex_watchdog_start(td_rpc_agent *a, void (*on_fail)(const char *msg));
/* ex_watchdog_tolerate (rank 0, before ex_watchdog_start): a lost worker other than rank 0 does
 * not end the job: on_lost(rank, why) runs on the watchdog's thread (it must not block long),
 * that worker is no longer pinged and the others are not told; the watchdog goes on. Without
 * it (the default) a lost worker stops every survivor. */
void ex_watchdog_tolerate(void (*on_lost)(int rank, const char *why));
/* ex_watchdog_stop ends the pings: call it before a worker may leave (its graceful shutdown),
 * since a worker that left normally must not count as lost. Safe to call twice. */
void ex_watchdog_stop(void);
/* ex_watchdog_note_step records where this worker is, for the line (ex_metrics_step calls it;
 * epoch from 0; step -1: only the epoch is known, as on a server). */
void ex_watchdog_note_step(int epoch, int64_t step);
/* ex_watchdog_where writes where this worker is ("at epoch 2 step 937", "in epoch 2", "before
 * its first training step") into buf; false when no step was noted yet. ex_die adds it to its
 * line, so an error a lost worker caused says where it struck. */
bool ex_watchdog_where(char *buf, size_t n);

#endif
