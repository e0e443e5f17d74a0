/* process_group.c - process groups: creation over the RPC rendezvous store, the ring of TCP
 * connections between members, the deadline-bound exchange primitive and failure reporting.
 *
 * Creation (collective over the members only):
 *   1. The members agree on a group id. Group rank 0 takes the next value of the store counter
 *      "pg/next_id" and publishes it under "pg/new/<n>/<hash of the rank list>/<k>", where k
 *      counts this process's earlier groups with the same rank list (members create the groups
 *      of one rank list in the same order, so k agrees); the others wait for that key. Groups
 *      over different rank lists never wait on each other, and non-members take no part.
 *   2. Each member listens on a TCP socket bound to the agent's listen address (port 0) and
 *      publishes "<port> <host>" under "pg/<id>/addr/<group rank>".
 *   3. Each member connects to its right neighbour (group rank + 1 mod size; bounded retries
 *      with backoff), sends a hello {magic, group id, its group rank}, and accepts the
 *      connection of its left neighbour (checking its hello; strays are dropped). Size 1 groups
 *      have no connections. Size 2 groups have two connections, one per direction.
 *
 * Data moves only to the right (send_fd) and comes only from the left (recv_fd). Every
 * algorithm is a sequence of exchange steps (td__pg_xchg: send to the right while receiving from
 * the left, non-blocking sockets + poll, one deadline per operation), so no step can deadlock.
 *
 * Failures: the first member that observes a dead or silent neighbour records the reason in the
 * store ("pg/<id>/failed") before it closes its connections. Its neighbours then see their
 * connections close, find that record and report it, so the failure travels around the ring in
 * a few round trips and every member names the worker that actually failed.
 *
 * Invariants: pg->mu is held for the whole of an operation; after a failure the connections are
 * closed (-1) and pg->broken is set for good. No lock is held while talking to the store except
 * pg->mu (the store client is thread-safe). Lock order: pg->mu, then pg_counts_mu.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../rpc/agent_impl.h"
#include "coll_impl.h"

#define HELLO_MAGIC 0x54445047u /* "TDPG" */

typedef struct hello {
  uint32_t magic;
  int32_t grank;
  uint64_t id;
} hello;

/* ---- per-process counts of groups created per (agent, rank list) ---- */

typedef struct pg_count {
  const td_rpc_agent *agent;
  uint64_t hash;
  int n;
  int64_t count;
} pg_count;

static pthread_mutex_t pg_counts_mu = PTHREAD_MUTEX_INITIALIZER;
static pg_count *pg_counts;
static size_t pg_ncounts, pg_capcounts;

static td_status next_count(const td_rpc_agent *a, uint64_t hash, int n, int64_t *out) {
  td_status st = TD_OK;
  pthread_mutex_lock(&pg_counts_mu);
  size_t i = 0;
  while (i < pg_ncounts && !(pg_counts[i].agent == a && pg_counts[i].hash == hash &&
                             pg_counts[i].n == n))
    i++;
  if (i == pg_ncounts) {
    if (pg_ncounts == pg_capcounts) {
      size_t nc = pg_capcounts ? pg_capcounts * 2 : 16;
      pg_count *t = td__realloc(pg_counts, nc * sizeof *t);
      if (!t) {
        st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
        goto out;
      }
      pg_counts = t;
      pg_capcounts = nc;
    }
    pg_counts[pg_ncounts++] = (pg_count){a, hash, n, 0};
  }
  *out = pg_counts[i].count++;
out:
  pthread_mutex_unlock(&pg_counts_mu);
  return st;
}

/* ---- small helpers ---- */

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

static int remaining_ms(uint64_t deadline_ns) {
  uint64_t now = td__now_ns();
  if (now >= deadline_ns) return 0;
  uint64_t ms = (deadline_ns - now + 999999ull) / 1000000ull;
  return ms > 1000000 ? 1000000 : (int)ms;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

static td_status set_nonblocking(int fd) {
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
  td__shm_mark_failed(pg->shm); /* after the record: the others read it when they wake */
  close_fd(&pg->send_fd);
  close_fd(&pg->recv_fd);
  pg->broken = true;
  pg->broken_status = rst;
  td__free(pg->broken_msg);
  pg->broken_msg = report;
  return td_set_error(rst, "process group %llu: %s", (unsigned long long)pg->id,
                      report ? report : msg);
}

/* ---- the exchange primitive ---- */

/* Reads whatever arrived on send_fd: the right neighbour never sends, so readable means closed. */
static td_status check_right_alive(td_process_group *pg, const char *op) {
  char b[64], who[160], msg[400];
  ssize_t k = recv(pg->send_fd, b, sizeof b, MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return TD_OK;
  td__pg_who(pg, (pg->rank + 1) % pg->size, who, sizeof who);
  if (k > 0)
    snprintf(msg, sizeof msg, "%s: protocol error: unexpected bytes from %s", op, who);
  else
    snprintf(msg, sizeof msg, "%s is unavailable: connection closed (%s; seen by %s during %s)",
             who, k == 0 ? "end of stream" : strerror(errno),
             td__pg_who(pg, pg->rank, (char[160]){0}, 160), op);
  return td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
}

/* A member waiting past half its deadline records "pg/<id>/at/<rank>" = "<seq>", so that the
 * member that times out can tell who never arrived (a neighbour may itself be waiting). */
static void note_long_wait(td_process_group *pg) {
  if (pg->waited_seq == pg->seq) return;
  pg->waited_seq = pg->seq;
  char key[96], suffix[48], v[32];
  snprintf(suffix, sizeof suffix, "at/%d", pg->rank);
  int n = snprintf(v, sizeof v, "%llu", (unsigned long long)pg->seq);
  td__store_set(pg->sc, td__pg_key(pg, suffix, key, sizeof key), v, (size_t)n);
}

/* The timeout message: the members without a record of this operation did not arrive. */
static td_status fail_ring_timeout(td_process_group *pg, const char *op, int wait_for) {
  char who[160], me[160], msg[1200], key[96], suffix[48];
  size_t len = (size_t)snprintf(msg, sizeof msg, "%s (#%llu) timed out after %lld ms: ", op,
                                (unsigned long long)pg->seq, (long long)pg->timeout_ms);
  int missing = 0;
  for (int m = 0; m < pg->size && len < sizeof msg; m++) {
    if (m == pg->rank) continue;
    uint8_t *v = NULL;
    bool found = false;
    snprintf(suffix, sizeof suffix, "at/%d", m);
    td__store_get(pg->sc, td__pg_key(pg, suffix, key, sizeof key), &v, NULL, &found);
    unsigned long long seq = found && v ? strtoull((char *)v, NULL, 10) : 0;
    td__free(v);
    if (seq >= pg->seq) continue;
    len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%s did not arrive", missing++ ? ", " : "",
                            td__pg_who(pg, m, who, sizeof who));
  }
  if (!missing && len < sizeof msg)
    len += (size_t)snprintf(msg + len, sizeof msg - len, "waiting for %s",
                            td__pg_who(pg, wait_for, who, sizeof who));
  if (len < sizeof msg)
    snprintf(msg + len, sizeof msg - len, " (seen by %s)", td__pg_who(pg, pg->rank, me, sizeof me));
  return td__pg_fail(pg, TD_ERR_TIMEOUT, msg);
}

td_status td__pg_xchg(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf, size_t rn,
                      uint64_t deadline_ns, const char *op) {
  size_t sent = 0, got = 0;
  char who[160], me[160], msg[480];
  td__pg_who(pg, pg->rank, me, sizeof me);
  uint64_t half = deadline_ns - (uint64_t)pg->timeout_ms * 500000ull;
  while (sent < sn || got < rn) {
    struct pollfd p[2];
    /* the right side matters only while we still send: a neighbour that got everything may
     * finish the operation and close before we do */
    p[0].fd = sent < sn ? pg->send_fd : -1;
    p[0].events = POLLIN | POLLRDHUP | POLLOUT;
    p[0].revents = 0;
    p[1].fd = got < rn ? pg->recv_fd : -1;
    p[1].events = POLLIN;
    p[1].revents = 0;
    bool noted = pg->waited_seq == pg->seq;
    int ms = remaining_ms(noted ? deadline_ns : half);
    int r = ms > 0 ? poll(p, 2, ms) : 0;
    if (r < 0) {
      if (errno == EINTR) continue;
      snprintf(msg, sizeof msg, "%s: poll: %s", op, strerror(errno));
      return td__pg_fail(pg, TD_ERR_IO, msg);
    }
    if (r == 0 && !noted) {
      note_long_wait(pg);
      continue;
    }
    if (r == 0) {
      int wait_for = got < rn ? (pg->rank + pg->size - 1) % pg->size : (pg->rank + 1) % pg->size;
      return fail_ring_timeout(pg, op, wait_for);
    }
    if (p[0].revents & (POLLIN | POLLRDHUP | POLLERR | POLLHUP)) {
      if (p[0].revents & (POLLERR | POLLHUP)) {
        int err = 0;
        socklen_t el = sizeof err;
        getsockopt(pg->send_fd, SOL_SOCKET, SO_ERROR, &err, &el);
        snprintf(msg, sizeof msg, "%s is unavailable: connection lost (%s; seen by %s during %s)",
                 td__pg_who(pg, (pg->rank + 1) % pg->size, who, sizeof who),
                 err ? strerror(err) : "hang-up", me, op);
        return td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
      }
      TD_TRY(check_right_alive(pg, op));
    }
    if (sent < sn && (p[0].revents & POLLOUT)) {
      ssize_t k = send(pg->send_fd, (const char *)sbuf + sent, sn - sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) sent += (size_t)k;
      else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        snprintf(msg, sizeof msg, "%s is unavailable: send failed (%s; seen by %s during %s)",
                 td__pg_who(pg, (pg->rank + 1) % pg->size, who, sizeof who), strerror(errno),
                 me, op);
        return td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
      }
    }
    if (got < rn && (p[1].revents & (POLLIN | POLLERR | POLLHUP))) {
      ssize_t k = recv(pg->recv_fd, (char *)rbuf + got, rn - got, MSG_DONTWAIT);
      if (k > 0) got += (size_t)k;
      else if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        snprintf(msg, sizeof msg,
                 "%s is unavailable: connection closed (%s; seen by %s during %s)",
                 td__pg_who(pg, (pg->rank + pg->size - 1) % pg->size, who, sizeof who),
                 k == 0 ? "end of stream" : strerror(errno), me, op);
        return td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
      }
    }
  }
  return TD_OK;
}

/* ---- connection setup ---- */

static td_status wait_key(td_process_group *pg, const char *key, uint64_t deadline,
                          const char *what, uint8_t **v, size_t *n) {
  td_status st = td__store_wait_key(pg->sc, key, deadline, NULL, v, n);
  if (st == TD_ERR_TIMEOUT)
    return td_set_error(TD_ERR_TIMEOUT, "process_group_create: timed out waiting for %s", what);
  return st;
}

static td_status open_listener(td_process_group *pg, int *fd_out, char *addr, size_t addr_n) {
  const char *host = td__agent_listen_addr(pg->agent);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  int gr = getaddrinfo(host, "0", &hints, &res);
  if (gr != 0)
    return td_set_error(TD_ERR_IO, "process_group_create: cannot resolve listen address '%s': %s",
                        host, gai_strerror(gr));
  int fd = -1;
  td_status st = TD_OK;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 16) == 0) break;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0)
    return td_set_error(TD_ERR_IO, "process_group_create: cannot listen on %s: %s", host,
                        strerror(errno));
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
    st = td_set_error(TD_ERR_IO, "process_group_create: getsockname: %s", strerror(errno));
    close(fd);
    return st;
  }
  int port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                            : ((struct sockaddr_in *)&ss)->sin_port);
  snprintf(addr, addr_n, "%d %s", port, host);
  *fd_out = fd;
  return TD_OK;
}

/* Connects to "<port> <host>" with retries (refused: the listener may be restarting) until
 * deadline; each attempt is a non-blocking connect bounded by poll. */
static td_status connect_right(td_process_group *pg, const char *rec, uint64_t deadline,
                               int *fd_out) {
  char who[160];
  td__pg_who(pg, (pg->rank + 1) % pg->size, who, sizeof who);
  const char *sp = strchr(rec, ' ');
  if (!sp) return td_set_error(TD_ERR_FORMAT, "process_group_create: bad address record of %s",
                               who);
  char port[16];
  snprintf(port, sizeof port, "%.*s", (int)(sp - rec), rec);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  int gr = getaddrinfo(sp + 1, port, &hints, &res);
  if (gr != 0)
    return td_set_error(TD_ERR_IO, "process_group_create: cannot resolve %s of %s: %s", sp + 1,
                        who, gai_strerror(gr));
  int64_t backoff = 1;
  int last_err = 0;
  td_status st = TD_OK;
  for (;;) {
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        last_err = errno;
        continue;
      }
      if (set_nonblocking(fd) != TD_OK) {
        close(fd);
        continue;
      }
      int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (r != 0 && errno == EINPROGRESS) {
        struct pollfd p = {fd, POLLOUT, 0};
        int ms = remaining_ms(deadline);
        if (ms > 0 && poll(&p, 1, ms) == 1) {
          int err = 0;
          socklen_t el = sizeof err;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
          r = err ? -1 : 0;
          errno = err ? err : ETIMEDOUT;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (r == 0) {
        *fd_out = fd;
        goto out;
      }
      last_err = errno;
      close(fd);
    }
    if (td__now_ns() >= deadline) {
      st = td_set_error(TD_ERR_TIMEOUT, "process_group_create: cannot connect to %s at %s:%s: %s",
                        who, sp + 1, port, strerror(last_err));
      goto out;
    }
    sleep_ms(backoff);
    backoff = backoff * 2 > 100 ? 100 : backoff * 2;
  }
out:
  freeaddrinfo(res);
  return st;
}

/* Reads exactly n bytes from fd (non-blocking) before deadline. */
static bool read_exact(int fd, void *buf, size_t n, uint64_t deadline) {
  size_t got = 0;
  while (got < n) {
    struct pollfd p = {fd, POLLIN, 0};
    int ms = remaining_ms(deadline);
    if (ms <= 0) return false;
    int r = poll(&p, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t k = recv(fd, (char *)buf + got, n - got, MSG_DONTWAIT);
    if (k > 0) got += (size_t)k;
    else if (k == 0 || (errno != EAGAIN && errno != EINTR)) return false;
  }
  return true;
}

static bool write_exact(int fd, const void *buf, size_t n, uint64_t deadline) {
  size_t sent = 0;
  while (sent < n) {
    struct pollfd p = {fd, POLLOUT, 0};
    int ms = remaining_ms(deadline);
    if (ms <= 0) return false;
    int r = poll(&p, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t k = send(fd, (const char *)buf + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) sent += (size_t)k;
    else if (k < 0 && errno != EAGAIN && errno != EINTR) return false;
  }
  return true;
}

static td_status accept_left(td_process_group *pg, int lfd, uint64_t deadline, int *fd_out) {
  int left = (pg->rank + pg->size - 1) % pg->size;
  char who[160];
  td__pg_who(pg, left, who, sizeof who);
  for (;;) {
    struct pollfd p = {lfd, POLLIN, 0};
    int ms = remaining_ms(deadline);
    int r = ms > 0 ? poll(&p, 1, ms) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return td_set_error(TD_ERR_TIMEOUT, "process_group_create: timed out waiting for %s to "
                          "connect", who);
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    if (set_nonblocking(fd) != TD_OK) {
      close(fd);
      continue;
    }
    hello h;
    uint64_t hd = td__now_ns() + 5000000000ull;
    if (read_exact(fd, &h, sizeof h, hd < deadline ? hd : deadline) && h.magic == HELLO_MAGIC &&
        h.id == pg->id && h.grank == left) {
      *fd_out = fd;
      return TD_OK;
    }
    td_log(TD_LOG_WARN, "process group %llu: dropped a stray connection while waiting for %s",
           (unsigned long long)pg->id, who);
    close(fd);
  }
}

static td_status agree_id(td_process_group *pg, uint64_t deadline) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < pg->size; i++) h = (h ^ (uint64_t)(uint32_t)pg->ranks[i]) * 1099511628211ull;
  int64_t k = 0;
  TD_TRY(next_count(pg->agent, h, pg->size, &k));
  char key[128];
  snprintf(key, sizeof key, "pg/new/%d/%016llx/%lld", pg->size, (unsigned long long)h,
           (long long)k);
  if (pg->rank == 0) {
    int64_t id;
    TD_TRY(td__store_add(pg->sc, "pg/next_id", 1, &id));
    char v[32];
    int n = snprintf(v, sizeof v, "%lld", (long long)id);
    TD_TRY(td__store_set(pg->sc, key, v, (size_t)n));
    pg->id = (uint64_t)id;
    return TD_OK;
  }
  char what[256], who[160];
  snprintf(what, sizeof what, "%s, the group's rank 0, to create the group",
           td__pg_who(pg, 0, who, sizeof who));
  uint8_t *v = NULL;
  TD_TRY(wait_key(pg, key, deadline, what, &v, NULL));
  pg->id = strtoull((char *)v, NULL, 10);
  td__free(v);
  return TD_OK;
}

static td_status connect_ring(td_process_group *pg, uint64_t deadline) {
  int lfd = -1;
  char addr[300], key[96], suffix[48], what[256], who[160];
  TD_TRY(open_listener(pg, &lfd, addr, sizeof addr));
  snprintf(suffix, sizeof suffix, "addr/%d", pg->rank);
  td_status st = td__store_set(pg->sc, td__pg_key(pg, suffix, key, sizeof key), addr,
                               strlen(addr));
  uint8_t *rec = NULL;
  int right = (pg->rank + 1) % pg->size;
  if (st == TD_OK) {
    snprintf(suffix, sizeof suffix, "addr/%d", right);
    snprintf(what, sizeof what, "%s to join the group", td__pg_who(pg, right, who, sizeof who));
    st = wait_key(pg, td__pg_key(pg, suffix, key, sizeof key), deadline, what, &rec, NULL);
  }
  if (st == TD_OK) st = connect_right(pg, (const char *)rec, deadline, &pg->send_fd);
  if (st == TD_OK) {
    hello h = {HELLO_MAGIC, pg->rank, pg->id};
    if (!write_exact(pg->send_fd, &h, sizeof h, deadline))
      st = td_set_error(TD_ERR_UNAVAILABLE, "process_group_create: cannot greet %s",
                        td__pg_who(pg, right, who, sizeof who));
  }
  if (st == TD_OK) st = accept_left(pg, lfd, deadline, &pg->recv_fd);
  td__free(rec);
  close(lfd);
  return st;
}

/* ---- public API ---- */

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

td_status td_process_group_create(td_rpc_agent *agent, const int *ranks, int n,
                                  td_pg_backend backend, td_timeout_ms timeout,
                                  td_process_group **out) {
  TD_CHECK_ARG(agent && out, "process_group_create: NULL agent or out");
  TD_CHECK_ARG(td__timeout_valid(timeout), "process_group_create: invalid timeout %lld",
               (long long)timeout);
  TD_CHECK_ARG(backend == TD_PG_BACKEND_CPU || backend == TD_PG_BACKEND_NCCL,
               "process_group_create: unknown backend %d", (int)backend);
#ifndef TD_HAVE_NCCL
  if (backend == TD_PG_BACKEND_NCCL)
    return td_set_error(TD_ERR_UNSUPPORTED, "process_group_create: the NCCL backend is not in "
                        "this build (configure with CUDA and NCCL available)");
#endif
  int world = td_rpc_world_size(agent), me = td_rpc_rank(agent);
  if (!ranks) n = world;
  TD_CHECK_ARG(n >= 1 && n <= world, "process_group_create: %d ranks for a world of %d", n,
               world);
  int *rs = td__malloc((size_t)n * sizeof *rs);
  if (!rs) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  for (int i = 0; i < n; i++) rs[i] = ranks ? ranks[i] : i;
  qsort(rs, (size_t)n, sizeof *rs, cmp_int);
  int my = -1;
  for (int i = 0; i < n; i++) {
    if (rs[i] < 0 || rs[i] >= world || (i && rs[i] == rs[i - 1])) {
      int bad = rs[i];
      td__free(rs);
      return td_set_error(TD_ERR_INVALID, "process_group_create: rank %d is %s", bad,
                          bad < 0 || bad >= world ? "outside the world" : "listed twice");
    }
    if (rs[i] == me) my = i;
  }
  if (my < 0) { /* not a member: like new_group, a non-member gets no group */
    td__free(rs);
    *out = NULL;
    return TD_OK;
  }
  td_status st = TD_OK;
  td_process_group *pg = td__calloc(1, sizeof *pg);
  if (!pg) {
    td__free(rs);
    return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  }
  pthread_mutex_init(&pg->mu, NULL);
  pg->agent = agent;
  pg->sc = td__agent_store(agent);
  pg->ranks = rs;
  pg->size = n;
  pg->rank = my;
  pg->backend = backend;
  pg->timeout_ms = td__timeout_resolve(timeout, TD__PG_DEFAULT_TIMEOUT_MS);
  pg->send_fd = pg->recv_fd = -1;
  pg->names = td__calloc((size_t)n, sizeof *pg->names);
  if (!pg->names) {
    st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
    goto out;
  }
  for (int i = 0; i < n; i++) {
    td_worker_info wi;
    if (td_rpc_get_worker_info_by_rank(agent, rs[i], &wi) == TD_OK)
      snprintf(pg->names[i], sizeof pg->names[i], "%s", wi.name);
    else
      snprintf(pg->names[i], sizeof pg->names[i], "worker?");
  }
  st = td__pg_read_mode(pg);
  if (st == TD_OK) st = td__work_create(pg);
  if (st != TD_OK) goto out;
  uint64_t deadline = td__pg_deadline(pg);
  st = agree_id(pg, deadline);
  if (st == TD_OK && n > 1) st = connect_ring(pg, deadline);
  if (st == TD_OK) st = td__shm_setup(pg, deadline);
#ifdef TD_HAVE_NCCL
  if (st == TD_OK && backend == TD_PG_BACKEND_NCCL) st = td__nccl_create(pg, &pg->nccl);
#endif
out:
  if (st != TD_OK) {
    td_process_group_destroy(pg);
    return st;
  }
  td_log(TD_LOG_DEBUG, "process group %llu: rank %d of %d", (unsigned long long)pg->id, pg->rank,
         pg->size);
  *out = pg;
  return TD_OK;
}

void td_process_group_destroy(td_process_group *pg) {
  if (!pg) return;
  td__work_destroy(pg->work); /* queued operations fail; the running one finishes first */
  td__shm_destroy(pg->shm);
#ifdef TD_HAVE_NCCL
  td__nccl_destroy(pg->nccl);
#endif
  close_fd(&pg->send_fd);
  close_fd(&pg->recv_fd);
  pthread_mutex_destroy(&pg->mu);
  td__free(pg->scratch);
  td__free(pg->broken_msg);
  td__free(pg->names);
  td__free(pg->ranks);
  td__free(pg);
}

int td_process_group_rank(const td_process_group *pg) { return pg ? pg->rank : -1; }
int td_process_group_size(const td_process_group *pg) { return pg ? pg->size : 0; }
int td_process_group_global_rank(const td_process_group *pg, int group_rank) {
  if (!pg || group_rank < 0 || group_rank >= pg->size) return -1;
  return pg->ranks[group_rank];
}
td_pg_backend td_process_group_backend(const td_process_group *pg) {
  return pg ? pg->backend : TD_PG_BACKEND_CPU;
}
td_status td_process_group_set_timeout(td_process_group *pg, td_timeout_ms timeout_ms) {
  TD_CHECK_ARG(pg && td__timeout_valid(timeout_ms), "process_group_set_timeout: invalid timeout "
               "%lld", (long long)timeout_ms);
  pthread_mutex_lock(&pg->mu);
  pg->timeout_ms = td__timeout_resolve(timeout_ms, TD__PG_DEFAULT_TIMEOUT_MS);
  pthread_mutex_unlock(&pg->mu);
  return TD_OK;
}
