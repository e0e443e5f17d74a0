/* pingpong.c - the floor under a same-host RPC: two processes bouncing 8 bytes, with nothing
 * else (no encoding, no dispatch, no security). A peer of bench/rpc_latency (bench/compare.sh
 * rpc_latency runs it in the same invocation and reports ours / floor).
 *
 *   --mode unix  a unix stream socket pair; each side spins on a non-blocking recv (the reads
 *                never sleep, so no wake-up is measured: the kernel's socket path only)
 *   --mode shm   a shared page; each side spins on a sequence word the other writes (the cost
 *                of a cache line crossing cores, and of sharing a CPU when they must)
 * Spinning sides yield their CPU every 8 empty polls, as tdist's lane does: on a machine with
 * fewer free CPUs than spinning threads the other side may need it.
 *
 * Output: one JSON line
 *   {"bench": "pingpong", "config": {"mode", "iters", "warmup"},
 *    "results": {"p50_us", "p90_us", "p99_us", "round_trips_per_s"}}   (round trips)
 * Options: --mode unix|shm (unix), --iters N (20000), --warmup N (2000).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdbool.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void relax(unsigned *idle) {
  if (++*idle % 8 == 0) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
  else __builtin_ia32_pause();
#endif
}

/* ---- unix socket ---- */

static void sock_send(int fd, uint64_t v) {
  if (send(fd, &v, sizeof v, MSG_NOSIGNAL) != (ssize_t)sizeof v) _exit(3);
}

static uint64_t sock_recv(int fd) {
  uint64_t v;
  unsigned idle = 0;
  for (;;) {
    ssize_t n = recv(fd, &v, sizeof v, MSG_DONTWAIT);
    if (n == (ssize_t)sizeof v) return v;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) _exit(4);
    relax(&idle);
  }
}

/* ---- shared page ---- */

typedef struct page {
  _Alignas(64) uint64_t ping;
  _Alignas(64) uint64_t pong;
} page;

static uint64_t wait_word(uint64_t *w, uint64_t want) {
  unsigned idle = 0;
  uint64_t v;
  while ((v = __atomic_load_n(w, __ATOMIC_ACQUIRE)) != want) relax(&idle);
  return v;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  const char *mode = "unix";
  long iters = 20000, warmup = 2000;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--mode") == 0 && v) mode = v, i++;
    else if (strcmp(argv[i], "--iters") == 0 && v) iters = atol(v), i++;
    else if (strcmp(argv[i], "--warmup") == 0 && v) warmup = atol(v), i++;
    else {
      fprintf(stderr, "usage: pingpong [--mode unix|shm] [--iters N] [--warmup N]\n");
      return 2;
    }
  }
  bool shm = strcmp(mode, "shm") == 0;
  if ((!shm && strcmp(mode, "unix") != 0) || iters < 1 || warmup < 0) {
    fprintf(stderr, "pingpong: --mode unix|shm, --iters >= 1\n");
    return 2;
  }
  long total = warmup + iters;
  int sv[2] = {-1, -1};
  page *pg = NULL;
  if (shm) {
    pg = mmap(NULL, sizeof *pg, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (pg == MAP_FAILED) return perror("mmap"), 1;
    memset(pg, 0, sizeof *pg);
  } else if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    return perror("socketpair"), 1;
  }
  pid_t child = fork();
  if (child < 0) return perror("fork"), 1;
  if (child == 0) { /* the echoing side */
    for (long i = 1; i <= total; i++) {
      if (shm) {
        wait_word(&pg->ping, (uint64_t)i);
        __atomic_store_n(&pg->pong, (uint64_t)i, __ATOMIC_RELEASE);
      } else {
        sock_send(sv[1], sock_recv(sv[1]));
      }
    }
    _exit(0);
  }
  double *us = malloc((size_t)iters * sizeof *us);
  if (!us) return 1;
  uint64_t t0 = 0;
  for (long i = 1; i <= total; i++) {
    if (i == warmup + 1) t0 = now_ns();
    uint64_t s = now_ns();
    if (shm) {
      __atomic_store_n(&pg->ping, (uint64_t)i, __ATOMIC_RELEASE);
      wait_word(&pg->pong, (uint64_t)i);
    } else {
      sock_send(sv[0], (uint64_t)i);
      if (sock_recv(sv[0]) != (uint64_t)i) return fprintf(stderr, "pingpong: wrong echo\n"), 1;
    }
    if (i > warmup) us[i - warmup - 1] = (double)(now_ns() - s) * 1e-3;
  }
  double wall = (double)(now_ns() - t0) * 1e-9;
  int status = 0;
  waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "pingpong: the echoing process failed\n");
    return 1;
  }
  qsort(us, (size_t)iters, sizeof *us, cmp);
  printf("{\"bench\": \"pingpong\", \"config\": {\"mode\": \"%s\", \"iters\": %ld, \"warmup\": %ld}, "
         "\"results\": {\"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, "
         "\"round_trips_per_s\": %.1f}}\n",
         mode, iters, warmup, us[iters / 2], us[(size_t)((double)iters * 0.9)],
         us[(size_t)((double)iters * 0.99)], (double)iters / wall);
  free(us);
  return 0;
}
