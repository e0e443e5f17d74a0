/* mp_util.h - multi-process test helpers: run N worker functions in forked child processes on
 * 127.0.0.1 with a free port, bounded in time, killing (by pid) whatever is left at the end.
 *
 * Children must not use cmocka assertions (a failure would unwind into the child's copy of the
 * test runner); use MP_CHECK / MP_CHECK_OK, which print the location and exit the child with 1.
 */
#ifndef TD_MP_UTIL_H
#define TD_MP_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tdist/status.h"

typedef int (*td_mp_fn)(int rank, int world, const char *init_method, void *arg);

/* td_mp_run forks world children running fn(rank, world, "tcp://127.0.0.1:<free port>", arg);
 * waits up to timeout_s (times TD_TEST_TIMEOUT_SCALE) for all of them, then SIGKILLs the rest.
 * codes[rank] (if not NULL) gets each exit code (128+signal when killed, 124 on timeout).
 * Returns the number of children that did not exit 0. */
int td_mp_run(int world, td_mp_fn fn, void *arg, double timeout_s, int *codes);

/* td_mp_free_port returns a TCP port on 127.0.0.1 that was free a moment ago. */
int td_mp_free_port(void);

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
