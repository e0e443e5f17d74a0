/* ring_connect.c - opening the TCP ring of a CPU process group: listeners, connections to the
 * right neighbour, and the authenticated handshake on every connection.
 *
 * Each member listens on a port of the agent's listen address, publishes it in the store
 * (authenticated: store sessions, rpc/auth.h), connects to its right neighbour and accepts its
 * left one. Every connection opens with the handshake of the RPC streams (rpc/auth.h: HELLO,
 * CHALLENGE, PROOF; mutual HMAC-SHA256 over fresh nonces of both sides) under a key of the group
 * (td__auth_derive(K, "ring", id | size | member ranks | generation)), the connecting member as client with
 * its group rank, the accepting one as server. So a connection is used only after both sides
 * proved knowledge of the job secret *for this group*, and only when the accepting member sees
 * its left neighbour's rank and the connecting one its right neighbour's: a stranger who
 * connects first, a replayed hello (the nonces are fresh), a worker of another group or another
 * job, a member at the wrong place are refused, counted in the agent's refused connections
 * (td_rpc_stats) and logged, and the member keeps waiting for the right peer until the
 * deadline. (Before, the ring accepted the first socket that sent a clear-text 16-byte hello
 * with the group's counter value as id.) Insecure mode (no secret, explicitly allowed) runs the
 * same messages with unchecked MACs, as the streams do.
 *
 * Both directions progress in one poll loop: a member's client side waits for its right
 * neighbour's CHALLENGE while its server side serves its left neighbour and any strangers, so a
 * ring of members that all connect first cannot deadlock. At most PENDING unauthenticated
 * connections are served at once (the oldest is dropped for a newer one) and each must finish
 * within HS_LIMIT, so a silent stranger cannot hold the listener.
 *
 * Encryption: when the agent runs with TLS (or TD_COLL_ENCRYPT=1), each connection then carries
 * AES-256-GCM records under a key of its own, derived from the ring key and the handshake's
 * nonces (ring_crypt.c); whether a group encrypts is bound into its ring key. Without TLS the
 * ring carries tensors in clear after the handshake: on one host no other user can read or
 * inject into an established loopback connection, across hosts the network can.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../rpc/agent_impl.h"
#include "../rpc/auth.h"
#include "coll_impl.h"

#define PENDING 32                     /* unauthenticated connections served at once */
#define HS_LIMIT 5000000000ull         /* ns a connection has to finish the handshake */

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
      if (td__pg_set_nonblocking(fd) != TD_OK) {
        close(fd);
        continue;
      }
      int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (r != 0 && errno == EINPROGRESS) {
        struct pollfd p = {fd, POLLOUT, 0};
        int ms = td__pg_remaining_ms(deadline);
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
    td__pg_sleep_ms(backoff);
    backoff = backoff * 2 > 100 ? 100 : backoff * 2;
  }
out:
  freeaddrinfo(res);
  return st;
}

static bool write_exact(int fd, const void *buf, size_t n, uint64_t deadline) {
  size_t sent = 0;
  while (sent < n) {
    struct pollfd p = {fd, POLLOUT, 0};
    int ms = td__pg_remaining_ms(deadline);
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

/* One connection on its way through the handshake, client or server side. */
typedef struct hs_conn {
  int fd;            /* -1: free */
  td__hs h;
  uint8_t in[TD__HS_MAX_LEN];
  size_t got, want;  /* bytes of the current message read / expected */
  uint64_t until;    /* handshake deadline (ns) */
} hs_conn;

/* Whether this group's ring is encrypted (ring_crypt.c): with TLS, or TD_COLL_ENCRYPT=1;
 * TD_COLL_ENCRYPT=0 turns it off. Only with a job secret: without one the key is known. */
static bool want_encryption(td_process_group *pg) {
  const char *e = getenv("TD_COLL_ENCRYPT");
  bool on = e && *e ? strcmp(e, "0") != 0 : td__agent_tls(pg->agent);
  if (on && !td__agent_auth(pg->agent)->secure) {
    td_log(TD_LOG_WARN, "process group %llu: the ring stays in clear text: encrypting it needs "
           "a job secret (insecure mode)", (unsigned long long)pg->id);
    return false;
  }
  return on;
}

/* ring_key derives the group's handshake key: bound to its id, size, member ranks and whether
 * the ring is encrypted (members that disagree fail the handshake instead of reading records
 * as data). */
static td_status ring_key(td_process_group *pg, bool encrypted, td__auth *out) {
  uint8_t ctx[29];
  uint64_t id = pg->id, gen = pg->generation, hash = 1469598103934665603ull; /* members, folded */
  int32_t size = pg->size;
  for (int i = 0; i < pg->size; i++)
    hash = (hash ^ (uint64_t)(uint32_t)pg->ranks[i]) * 1099511628211ull;
  memcpy(ctx, &id, 8);
  memcpy(ctx + 8, &size, 4);
  memcpy(ctx + 12, &hash, 8);
  ctx[20] = encrypted ? 1 : 0;
  memcpy(ctx + 21, &gen, 8); /* a member of another generation fails the handshake */
  return td__auth_derive(td__agent_auth(pg->agent), "ring", ctx, sizeof ctx, out);
}

/* refuse drops a connection that failed the handshake or took too long, counting it. */
static void refuse(td_process_group *pg, hs_conn *c, const char *why) {
  char who[160];
  int left = (pg->rank + pg->size - 1) % pg->size;
  td_log(TD_LOG_WARN, "process group %llu: refused a connection while waiting for %s: %s",
         (unsigned long long)pg->id, td__pg_who(pg, left, who, sizeof who), why);
  td__agent_count_refused(pg->agent);
  close(c->fd);
  c->fd = -1;
}

/* read_some reads what is available of c's current message; returns false on end of stream or
 * an error, true otherwise (c->got tells how far it is). */
static bool read_some(hs_conn *c) {
  while (c->got < c->want) {
    ssize_t k = recv(c->fd, c->in + c->got, c->want - c->got, MSG_DONTWAIT);
    if (k > 0) {
      c->got += (size_t)k;
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return true;
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

/* server_step advances a server-side connection with new input; returns 1 when it authenticated
 * as the left neighbour, 0 to keep waiting, -1 when it was refused (closed). */
static int server_step(td_process_group *pg, const td__auth *ra, hs_conn *c) {
  if (!read_some(c)) {
    refuse(pg, c, "closed during the handshake");
    return -1;
  }
  if (c->got < c->want) return 0;
  if (c->want == TD__HS_HELLO_LEN) {
    uint8_t out[TD__HS_CHALLENGE_LEN];
    if (td__hs_server_hello(&c->h, ra, pg->rank, c->in, c->got, out) != TD_OK ||
        !write_exact(c->fd, out, sizeof out, c->until)) {
      refuse(pg, c, td_last_error());
      return -1;
    }
    c->got = 0;
    c->want = TD__HS_PROOF_LEN;
    return 0;
  }
  int peer = -1;
  if (td__hs_server_proof(&c->h, c->in, c->got, &peer) != TD_OK) {
    refuse(pg, c, td_last_error());
    return -1;
  }
  int left = (pg->rank + pg->size - 1) % pg->size;
  if (peer != left) {
    char why[96];
    snprintf(why, sizeof why, "group rank %d is not the left neighbour (%d)", peer, left);
    refuse(pg, c, why);
    return -1;
  }
  return 1;
}

/* client_start connects to the right neighbour and sends the HELLO. */
static td_status client_start(td_process_group *pg, const td__auth *ra, const char *rec,
                              uint64_t deadline, hs_conn *c) {
  int right = (pg->rank + 1) % pg->size;
  uint8_t hello[TD__HS_HELLO_LEN];
  TD_TRY(connect_right(pg, rec, deadline, &c->fd));
  c->got = 0;
  c->want = TD__HS_CHALLENGE_LEN;
  td_status st = td__hs_client_hello(&c->h, ra, pg->rank, right, hello);
  if (st == TD_OK && !write_exact(c->fd, hello, sizeof hello, deadline)) {
    char who[160];
    st = td_set_error(TD_ERR_UNAVAILABLE, "process_group_create: cannot greet %s",
                      td__pg_who(pg, right, who, sizeof who));
  }
  if (st != TD_OK) {
    close(c->fd);
    c->fd = -1;
  }
  return st;
}

/* handshake runs both sides of this member's ring connections to the end: the client side toward
 * the right neighbour (address record rec) and the server side on listener lfd. */
static td_status handshake(td_process_group *pg, int lfd, const char *rec, uint64_t deadline) {
  td__auth ra;
  bool encrypted = want_encryption(pg);
  TD_TRY(ring_key(pg, encrypted, &ra));
  char who[160];
  int right = (pg->rank + 1) % pg->size, left = (pg->rank + pg->size - 1) % pg->size;
  hs_conn cl = {.fd = -1}, sv[PENDING];
  for (int i = 0; i < PENDING; i++) sv[i].fd = -1;
  bool client_done = false;
  int recv_fd = -1;
  td_status st = client_start(pg, &ra, rec, deadline, &cl);
  while (st == TD_OK && (!client_done || recv_fd < 0)) {
    struct pollfd p[PENDING + 2];
    int np = 0, ci = -1, li = -1, map[PENDING];
    uint64_t wake = deadline;
    if (!client_done) ci = np, p[np++] = (struct pollfd){cl.fd, POLLIN, 0};
    if (recv_fd < 0) {
      li = np, p[np++] = (struct pollfd){lfd, POLLIN, 0};
      for (int i = 0; i < PENDING; i++)
        if (sv[i].fd >= 0) {
          map[np - li - 1] = i;
          p[np++] = (struct pollfd){sv[i].fd, POLLIN, 0};
          if (sv[i].until < wake) wake = sv[i].until;
        }
    }
    int ms = td__pg_remaining_ms(wake);
    int r = poll(p, (nfds_t)np, ms > 0 ? ms : 0);
    if (r < 0 && errno != EINTR) {
      st = td_set_error(TD_ERR_IO, "process_group_create: poll: %s", strerror(errno));
      break;
    }
    uint64_t now = td__now_ns();
    if (now >= deadline) {
      td__pg_who(pg, !client_done ? right : left, who, sizeof who);
      st = td_set_error(TD_ERR_TIMEOUT, "process_group_create: timed out waiting for %s to %s",
                        who, !client_done ? "answer the ring handshake" : "connect");
      break;
    }
    if (r <= 0) goto expire;
    if (ci >= 0 && p[ci].revents) { /* the right neighbour's CHALLENGE */
      if (!read_some(&cl)) { /* it dropped us (restarting its listener?): connect again */
        close(cl.fd);
        cl.fd = -1;
        st = client_start(pg, &ra, rec, deadline, &cl);
        continue;
      }
      if (cl.got == cl.want) {
        uint8_t proof[TD__HS_PROOF_LEN];
        st = td__hs_client_challenge(&cl.h, cl.in, cl.got, proof);
        if (st != TD_OK) {
          st = td__error_prefix(st, "process_group_create: the connection to %s (every member "
                                "needs the same job secret and the same ring encryption: TLS, "
                                "TD_COLL_ENCRYPT)", td__pg_who(pg, right, who, sizeof who));
          break;
        }
        if (!write_exact(cl.fd, proof, sizeof proof, deadline)) {
          st = td_set_error(TD_ERR_UNAVAILABLE, "process_group_create: cannot finish the ring "
                            "handshake with %s", td__pg_who(pg, right, who, sizeof who));
          break;
        }
        if (encrypted) {
          st = td__ring_crypt_create(&ra, cl.h.nonce_c, cl.h.nonce_s, true, &pg->ring_seal);
          if (st != TD_OK) break;
        }
        client_done = true;
        pg->send_fd = cl.fd;
        cl.fd = -1;
      }
    }
    for (int k = li + 1; li >= 0 && k < np && recv_fd < 0; k++) {
      if (!p[k].revents) continue;
      hs_conn *c = &sv[map[k - li - 1]];
      if (server_step(pg, &ra, c) == 1) {
        if (encrypted) {
          st = td__ring_crypt_create(&ra, c->h.nonce_c, c->h.nonce_s, false, &pg->ring_open);
          if (st != TD_OK) break;
        }
        recv_fd = c->fd;
        c->fd = -1;
      }
    }
    if (li >= 0 && recv_fd < 0 && (p[li].revents & POLLIN)) {
      int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0 && td__pg_set_nonblocking(fd) != TD_OK) {
        close(fd);
        fd = -1;
      }
      if (fd >= 0) {
        int slot = 0; /* a free slot, else the oldest connection's */
        for (int i = 0; i < PENDING; i++) {
          if (sv[i].fd < 0) {
            slot = i;
            break;
          }
          if (sv[i].until < sv[slot].until) slot = i;
        }
        if (sv[slot].fd >= 0) refuse(pg, &sv[slot], "too many connections in their handshake");
        sv[slot] = (hs_conn){.fd = fd, .got = 0, .want = TD__HS_HELLO_LEN,
                             .until = now + HS_LIMIT < deadline ? now + HS_LIMIT : deadline};
      }
    }
  expire:
    for (int i = 0; i < PENDING; i++)
      if (sv[i].fd >= 0 && td__now_ns() >= sv[i].until)
        refuse(pg, &sv[i], "did not finish the handshake in time");
  }
  for (int i = 0; i < PENDING; i++)
    if (sv[i].fd >= 0) close(sv[i].fd);
  if (cl.fd >= 0) close(cl.fd);
  if (st == TD_OK && encrypted) {
    pg->ring_records = td__malloc(2 * (TD__RING_PIECE + TD__RING_TAG));
    if (!pg->ring_records) st = td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  }
  if (st == TD_OK) {
    pg->recv_fd = recv_fd;
  } else if (recv_fd >= 0) {
    close(recv_fd);
  }
  return st;
}

td_status td__ring_connect(td_process_group *pg, uint64_t deadline) {
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
    st = td__pg_wait_key(pg, td__pg_key(pg, suffix, key, sizeof key), deadline, what, &rec, NULL);
  }
  if (st == TD_OK) st = handshake(pg, lfd, (const char *)rec, deadline);
  td__free(rec);
  close(lfd);
  return st;
}
