/* proc_util.c - child processes with captured output (see proc_util.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "proc_util.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mp_util.h"

extern char **environ;

/* The processes not reaped yet, by value (a td_proc may live on a test's stack, gone after a
 * failed assertion unwinds it). */
#define MAX_LIVE 16
static struct {
  pid_t pid;
  bool own_group;
  int fds[2];
} live[MAX_LIVE];

static int live_find(pid_t pid) {
  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i].pid == pid && pid > 0) return i;
  return -1;
}

static void live_forget(pid_t pid) {
  int i = live_find(pid);
  if (i >= 0) live[i].pid = 0;
}

static void live_fd_closed(pid_t pid, int which) {
  int i = live_find(pid);
  if (i >= 0) live[i].fds[which] = -1;
}

int td_proc_spawn(td_proc *p, const char *path, char *const argv[], char *const envp[],
                  bool own_group) {
  memset(p, 0, sizeof *p);
  p->out_fd = p->err_fd = -1;
  int slot = -1;
  for (int i = 0; i < MAX_LIVE && slot < 0; i++)
    if (live[i].pid == 0) slot = i;
  if (slot < 0) return EAGAIN;
  int po[2], pe[2];
  if (pipe2(po, O_CLOEXEC) != 0) return errno;
  if (pipe2(pe, O_CLOEXEC) != 0) {
    int e = errno;
    close(po[0]), close(po[1]);
    return e;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, po[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, pe[1], STDERR_FILENO);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  if (own_group) {
    posix_spawnattr_setpgroup(&at, 0);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
  }
  p->start = td_test_now_s();
  int rc = posix_spawn(&p->pid, path, &fa, &at, argv, envp ? envp : environ);
  posix_spawnattr_destroy(&at);
  posix_spawn_file_actions_destroy(&fa);
  close(po[1]);
  close(pe[1]);
  if (rc != 0) {
    close(po[0]), close(pe[0]);
    p->pid = 0;
    return rc;
  }
  p->own_group = own_group;
  p->out_fd = po[0];
  p->err_fd = pe[0];
  live[slot].pid = p->pid;
  live[slot].own_group = own_group;
  live[slot].fds[0] = p->out_fd;
  live[slot].fds[1] = p->err_fd;
  return 0;
}

static void append(char **buf, size_t *len, const char *s, size_t n) {
  char *nb = realloc(*buf, *len + n + 1);
  if (!nb) abort(); /* a test's output does not exhaust memory */
  memcpy(nb + *len, s, n);
  *len += n;
  nb[*len] = '\0';
  *buf = nb;
}

/* kill_reap ends one recorded process (its group when it has one), reaps it, closes its pipes. */
static void kill_reap(int i) {
  kill(live[i].own_group ? -live[i].pid : live[i].pid, SIGKILL);
  while (waitpid(live[i].pid, NULL, 0) < 0 && errno == EINTR) {
  }
  for (int k = 0; k < 2; k++)
    if (live[i].fds[k] >= 0) close(live[i].fds[k]);
  live[i].pid = 0;
}

static int give_up(td_proc *p) {
  int i = live_find(p->pid);
  if (i >= 0) kill_reap(i);
  p->out_fd = p->err_fd = -1;
  p->pid = 0;
  p->elapsed = td_test_now_s() - p->start;
  return -1;
}

int td_proc_finish(td_proc *p, double timeout_s) {
  double limit = p->start + td_test_s(timeout_s);
  append(&p->out, &p->out_len, "", 0);
  append(&p->err, &p->err_len, "", 0);
  while (p->out_fd >= 0 || p->err_fd >= 0) {
    struct pollfd pf[2] = {{.fd = p->out_fd, .events = POLLIN}, {.fd = p->err_fd, .events = POLLIN}};
    int left = (int)((limit - td_test_now_s()) * 1000);
    if (left <= 0) return give_up(p);
    int pr = poll(pf, 2, left);
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) return give_up(p);
    for (int k = 0; k < 2; k++) {
      if (pf[k].fd < 0 || !pf[k].revents) continue;
      char chunk[65536];
      ssize_t n = read(pf[k].fd, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        close(pf[k].fd);
        live_fd_closed(p->pid, k);
        if (k == 0) p->out_fd = -1;
        else p->err_fd = -1;
        continue;
      }
      if (k == 0) append(&p->out, &p->out_len, chunk, (size_t)n);
      else append(&p->err, &p->err_len, chunk, (size_t)n);
    }
  }
  for (;;) { /* the pipes are closed; the exit follows, but stay bounded */
    pid_t w = waitpid(p->pid, &p->status, WNOHANG);
    if (w == p->pid) break;
    if (w < 0 && errno != EINTR) return give_up(p);
    if (td_test_now_s() > limit) return give_up(p);
    td_test_sleep_ms(2);
  }
  live_forget(p->pid);
  p->pid = 0;
  p->elapsed = td_test_now_s() - p->start;
  return 0;
}

void td_proc_free(td_proc *p) {
  free(p->out);
  free(p->err);
  p->out = p->err = NULL;
}

void td_proc_kill_all(void) {
  for (int i = 0; i < MAX_LIVE; i++)
    if (live[i].pid > 0) kill_reap(i);
}
