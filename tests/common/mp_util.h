/* mp_util.h - support for the tests that run real worker processes: clocks and timing windows
 * that stretch with TD_TEST_TIMEOUT_SCALE, a forked multi-process runner on 127.0.0.1 with a free
 * port, RPC options and shutdown for workers, and checks usable inside child processes.
 *
 * Children must not use cmocka assertions (a failure would unwind into the child's copy of the
 * test runner); use MP_CHECK / MP_CHECK_OK, which print the location and exit the child with 1.
 *
 * Timing rule: every window a test waits for something that should happen (a reply, a worker, a
 * condition polled in a loop) is scaled with td_test_ms / td_test_s / TD_TEST_POLL, so slow
 * machines and sanitizer builds (TD_TEST_TIMEOUT_SCALE=3 in CI's TSan stage) do not fail for lack
 * of time. Windows that a test expects to EXPIRE (a 200 ms call timeout that must fire) are not
 * scaled: they are the behaviour under test.
 */
#ifndef TD_MP_UTIL_H
#define TD_MP_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tdist/rpc.h"
#include "tdist/status.h"

/* ---- time ---- */

/* td_test_timeout_scale returns TD_TEST_TIMEOUT_SCALE from the environment (default 1). */
double td_test_timeout_scale(void);
/* td_test_ms returns ms times the scale (a deadline for something that should happen). */
int64_t td_test_ms(int64_t ms);
/* td_test_s returns s times the scale. */
double td_test_s(double s);
/* td_test_now_s returns a monotonic clock in seconds. */
double td_test_now_s(void);
/* td_test_sleep_ms sleeps ms milliseconds (the whole time, through signals). */
void td_test_sleep_ms(int64_t ms);

/* TD_TEST_POLL(cond, timeout_s) evaluates cond every 2 ms until it is true or timeout_s (scaled)
 * has passed; the caller then checks cond (or what it computed) itself:
 *   TD_TEST_POLL((stats(a, &made, &destroyed), destroyed == 1), 5);
 *   MP_CHECK(destroyed == 1); */
#define TD_TEST_POLL(cond, timeout_s)                                                         \
  for (double td_poll_end_ = td_test_now_s() + td_test_s(timeout_s);                          \
       !(cond) && td_test_now_s() < td_poll_end_; td_test_sleep_ms(2)) {                       \
  }

/* ---- worker processes ---- */

typedef int (*td_mp_fn)(int rank, int world, const char *init_method, void *arg);

/* td_mp_run forks world children running fn(rank, world, "tcp://127.0.0.1:<free port>", arg);
 * waits up to timeout_s (scaled) for all of them, then SIGKILLs the rest (by pid). codes[rank]
 * (if not NULL) gets each exit code (128+signal when killed, 124 on timeout). Returns the number
 * of children that did not exit 0. */
int td_mp_run(int world, td_mp_fn fn, void *arg, double timeout_s, int *codes);

/* td_mp_free_port returns a TCP port on 127.0.0.1 that was free a moment ago, chosen below the
 * kernel's ephemeral port range (so no port-0 bind or outgoing connection of a test running
 * beside can take it before the worker binds it). */
int td_mp_free_port(void);

/* td_mp_rpc_options returns options for a test worker: init_method, threads pool threads, init
 * and call timeouts of 30 s (scaled). */
td_rpc_options td_mp_rpc_options(const char *init_method, int threads);

/* td_mp_finish shuts a worker's agent down gracefully within timeout_s (scaled), destroys it and,
 * under AddressSanitizer, checks for leaks (children leave with _exit, which skips the exit-time
 * leak check). Exits the child with 1 on failure. */
void td_mp_finish(td_rpc_agent *a, double timeout_s);

/* MP_CHECK_NO_LEAKS: a leak check for a child about to _exit (no-op without ASan). */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#define MP_CHECK_NO_LEAKS() MP_CHECK(__lsan_do_recoverable_leak_check() == 0)
#else
#define MP_CHECK_NO_LEAKS() ((void)0)
#endif

#define MP_CHECK(cond)                                                                       \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "[pid %d] %s:%d: check failed: %s\n", (int)getpid(), __FILE__,         \
              __LINE__, #cond);                                                              \
      fflush(stderr);                                                                        \
      _exit(1);                                                                              \
    }                                                                                        \
  } while (0)

#define MP_CHECK_OK(expr)                                                                    \
  do {                                                                                       \
    td_status mp_s_ = (expr);                                                                \
    if (mp_s_ != TD_OK) {                                                                    \
      fprintf(stderr, "[pid %d] %s:%d: %s returned %s: %s\n", (int)getpid(), __FILE__,       \
              __LINE__, #expr, td_status_name(mp_s_), td_last_error());                      \
      fflush(stderr);                                                                        \
      _exit(1);                                                                              \
    }                                                                                        \
  } while (0)

#endif
