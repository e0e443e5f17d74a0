/* proc_util.h - run a program as a child process with its output captured, bounded in time, and
 * kill (by pid, or by the process group it was given) whatever a failed test left behind.
 *
 * Every process started here is recorded until it is reaped; td_proc_kill_all, called from a
 * test's teardown, SIGKILLs and reaps the ones still recorded and closes their pipes.
 */
#ifndef TD_PROC_UTIL_H
#define TD_PROC_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct td_proc {
  pid_t pid;          /* 0 once reaped */
  bool own_group;     /* started in a process group of its own (pgid == pid) */
  int out_fd, err_fd; /* read ends of its stdout and stderr; -1 at EOF */
  char *out, *err;    /* captured output, NUL-terminated (after td_proc_finish) */
  size_t out_len, err_len;
  int status;         /* wait status (after td_proc_finish returned 0) */
  double start, elapsed; /* seconds (td_test_now_s) */
} td_proc;

/* td_proc_spawn starts path with argv (argv[0] included, NULL-terminated) and envp (NULL: this
 * process's environment), stdout and stderr on pipes; own_group puts it in a process group of its
 * own, so that td_proc_kill_all also reaches what it started. Returns 0 or an errno value. */
int td_proc_spawn(td_proc *p, const char *path, char *const argv[], char *const envp[],
                  bool own_group);

/* td_proc_finish reads both pipes to EOF and reaps the process within timeout_s (scaled by
 * TD_TEST_TIMEOUT_SCALE). Returns 0, or -1 when the deadline passed (the process, or its group,
 * is then SIGKILLed and reaped; p->out and p->err hold what it wrote). */
int td_proc_finish(td_proc *p, double timeout_s);

/* td_proc_free releases the captured output. */
void td_proc_free(td_proc *p);

/* td_proc_kill_all SIGKILLs every process started by td_proc_spawn and not reaped yet (its group
 * when it has one), reaps it and closes its pipes. For teardowns after a failed test. */
void td_proc_kill_all(void);

#endif
