/* group.c - what a process group offers its backends: names of members, store keys, deadlines,
 * the scratch buffer, and failure reporting.
 *
 * Failures: the first member that observes a dead or silent member (or a mismatched call)
 * records the reason in the store ("pg/<id>/failed") and then tells every serving backend
 * (td__coll_backend.fail: the ring closes its connections, shared memory wakes its waiters). The
 * other members notice, find that record and report it, so every member names the worker that
 * actually failed. A broken group stays broken.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "coll_impl.h"

const char *td__pg_who(const td_process_group *pg, int grank, char *buf, size_t n) {
  if (grank < 0 || grank >= pg->size) snprintf(buf, n, "group rank %d", grank);
  else snprintf(buf, n, "%s (rank %d)", pg->names[grank], pg->ranks[grank]);
  return buf;
}

const char *td__pg_key(const td_process_group *pg, const char *suffix, char *buf, size_t n) {
  snprintf(buf, n, "pg/%llu/%s", (unsigned long long)pg->id, suffix);
  return buf;
}

uint64_t td__pg_deadline(const td_process_group *pg) { return td__deadline_ns(pg->timeout_ms); }

int td__pg_remaining_ms(uint64_t deadline_ns) {
  uint64_t now = td__now_ns();
  if (now >= deadline_ns) return 0;
  uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
  return ms > 1000000 ? 1000000 : (int)ms;
}

bool td__pid_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = 0;
  const char *rp = strrchr(buf, ')');
  return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}

void td__pg_sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

td_status td__pg_set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
    return td_set_error(TD_ERR_IO, "process group: fcntl: %s", strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return TD_OK;
}

td_status td__pg_scratch(td_process_group *pg, size_t n) {
  if (n <= pg->scratch_cap) return TD_OK;
  uint8_t *b = td__malloc(n);
  if (!b) return td_set_error(TD_ERR_NOMEM, "process group: out of memory (%zu bytes)", n);
  td__free(pg->scratch);
  pg->scratch = b;
  pg->scratch_cap = n;
  return TD_OK;
}

/* ---- failure reporting ---- */

td_status td__pg_fail(td_process_group *pg, td_status st, const char *msg) {
  return td__pg_fail_member(pg, st, -1, msg);
}

/* The first observer of a lost member notes it, in the group (the lost-member notice of
 * td_process_group_wait_lost) and in the store ("pg/<id>/lost/<group rank>" = "<status>\n<why>"),
 * where the other members and the decider of a re-formation (generation.c) read it. */
static void note_lost(td_process_group *pg, int culprit, td_status st, const char *msg) {
  pthread_mutex_lock(&pg->lost_mu);
  bool first = pg->lost_grank < 0;
  if (first) {
    pg->lost_grank = culprit;
    pg->lost_status = st;
    snprintf(pg->lost_why, sizeof pg->lost_why, "%s", msg);
  }
  pthread_mutex_unlock(&pg->lost_mu);
  char key[96], suffix[48], rec[600];
  snprintf(suffix, sizeof suffix, "lost/%d", culprit);
  int k = snprintf(rec, sizeof rec, "%d\n%s", (int)st, msg);
  td__store_set(pg->sc, td__pg_key(pg, suffix, key, sizeof key), rec,
                (size_t)(k < (int)sizeof rec ? k : (int)sizeof rec - 1));
}

td_status td__pg_fail_member(td_process_group *pg, td_status st, int culprit, const char *msg) {
  char key[96];
  td__pg_key(pg, "failed", key, sizeof key);
  uint8_t *v = NULL;
  size_t n = 0;
  bool found = false;
  char *report = NULL;
  td_status rst = st;
  /* a failure recorded by another member is the root cause of what we saw */
  if (td__store_get(pg->sc, key, &v, &n, &found) == TD_OK && found && v) {
    char *nl = strchr((char *)v, '\n');
    if (nl) {
      *nl = 0;
      int code = atoi((char *)v);
      if (code > 0) rst = (td_status)code;
      report = td__strdup(nl + 1);
    }
  } else {
    if (culprit >= 0 && culprit < pg->size && culprit != pg->rank) note_lost(pg, culprit, st, msg);
    size_t len = strlen(msg);
    char *rec = td__malloc(len + 16);
    if (rec) {
      int k = snprintf(rec, len + 16, "%d\n%s", (int)st, msg);
      td__store_set(pg->sc, key, rec, (size_t)k);
      td__free(rec);
    }
  }
  td__free(v);
  if (!report) report = td__strdup(msg);
  /* after the record: the others read it when they wake or see the connections close (or, on
   * shared memory, whom it blamed, when the store is gone with its host) */
  pg->fail_culprit = culprit >= 0 && culprit < pg->size && culprit != pg->rank ? culprit : -1;
  for (int i = 0; i < TD__TP_COUNT; i++)
    if (pg->tp[i] && pg->tp[i]->fail) pg->tp[i]->fail(pg);
  pg->broken = true;
  pg->broken_status = rst;
  td__free(pg->broken_msg);
  pg->broken_msg = report;
  return td_set_error(rst, "process group %llu (generation %llu): %s", (unsigned long long)pg->id,
                      (unsigned long long)pg->generation, report ? report : msg);
}

td_status td__pg_wait_key(td_process_group *pg, const char *key, uint64_t deadline,
                          const char *what, uint8_t **v, size_t *n) {
  td_status st = td__store_wait_key(pg->sc, key, deadline, NULL, v, n);
  if (st == TD_ERR_TIMEOUT)
    return td_set_error(TD_ERR_TIMEOUT, "process_group_create: timed out waiting for %s", what);
  return st;
}


/* ---- mismatched calls ---- */

td_status td__op_mismatch(td_process_group *pg, const td__op_hdr *mine, int other,
                          const td__op_hdr *theirs) {
  char a[160], b[160], me[160], who[160], msg[800];
  td__op_describe(mine, a, sizeof a);
  if (theirs->magic != TD__OP_MAGIC) snprintf(b, sizeof b, "something unreadable");
  else td__op_describe(theirs, b, sizeof b);
  td__pg_who(pg, pg->rank, me, sizeof me);
  td__pg_who(pg, other, who, sizeof who);
  if (theirs->magic == TD__OP_MAGIC && strcmp(a, b) == 0 && mine->algo != theirs->algo)
    snprintf(msg, sizeof msg, "mismatched collectives: %s runs %s with algorithm %s but %s with "
             "%s (set TD_COLL_ALGO and TD_COLL_SHM_DIRECT_MAX alike on every member)", me, a,
             td__algo_name(mine->algo), who, td__algo_name(theirs->algo));
  else
    snprintf(msg, sizeof msg, "mismatched collectives: %s called %s but %s called %s", me, a, who,
             b);
  return td__pg_fail(pg, TD_ERR_STATE, msg);
}

/* ---- fault injection (td_ft_ddp_inject) ---- */

void td__pg_inject_close(td_process_group *pg) {
  pthread_mutex_lock(&pg->mu);
  if (!pg->broken) {
    char me[160], msg[300];
    snprintf(msg, sizeof msg, "fault injection: %s closed its connections of the group",
             td__pg_who(pg, pg->rank, me, sizeof me));
    td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
  }
  pthread_mutex_unlock(&pg->mu);
}

bool td__pg_is_broken(td_process_group *pg) {
  pthread_mutex_lock(&pg->mu);
  bool b = pg->broken;
  pthread_mutex_unlock(&pg->mu);
  return b;
}
