/* ring.c - the CPU collectives over the TCP ring (members on any hosts): the header check with
 * the neighbours and the ring algorithms. ops.c chooses them and holds pg->mu around them.
 *
 * Connections and failures: data moves only to the right (send_fd) and comes only from the left
 * (recv_fd). Every algorithm is a sequence of exchange steps (td__ring_xchg: send to the right
 * while receiving from the left, non-blocking sockets + poll, one deadline per operation), so no
 * step can deadlock. The first member that observes a dead or silent neighbour fails the group
 * (td__pg_fail records the reason in the store, then the ring's fail entry closes the
 * connections); its neighbours see their connections close, find that record and report it, so
 * the failure travels around the ring in a few round trips and every member names the worker
 * that actually failed. A member waiting past half its deadline notes in the store which
 * operation it waits in, so the one that times out can say who never arrived.
 *
 * Header check: each member sends its td__op_hdr {kind, sequence number, element count, dtype,
 * reduce op or root} to its right neighbour and compares what its left neighbour sent. Around
 * the ring this checks that all members run the same operation on compatible tensors; a mismatch
 * fails the group with TD_ERR_STATE describing both calls (instead of exchanging garbage or
 * hanging). The header is also what makes a barrier a barrier.
 *
 * Algorithms (n members, member r; chunk i of a tensor is its i-th of n nearly equal parts):
 *   - reduce-scatter: n-1 steps; at step s member r sends chunk (r - s + shift) and receives
 *     chunk (r - s - 1 + shift), which it reduces into its own copy; afterwards member r holds
 *     the full reduction of chunk (r + 1 + shift). Chunks are exchanged in segments of
 *     SEG_BYTES so the receive buffer stays small.
 *   - all-gather: n-1 steps; member r starts with chunk (r + shift) and at step s sends chunk
 *     (r - s + shift) and receives chunk (r - s - 1 + shift) in place.
 *   - all_reduce = reduce-scatter (shift 0) + all-gather (shift 1); AVG divides at the end, on
 *     every member alike, so results are bit-identical everywhere.
 *   - reduce_scatter = reduce-scatter with shift -1 on a working copy (member r ends with slot r).
 *   - broadcast: pipelined along the ring from the root in segments: the member at distance d
 *     from the root receives segment j at step j + d - 1 and forwards it at step j + d; the last
 *     member then acknowledges to the root (see ack_root).
 *   - barrier: an all-gather of one byte per member after the header.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "coll_impl.h"

#define SEG_BYTES ((size_t)1 << 20)

typedef td__chunk chunk;

static int64_t mod(int64_t a, int64_t n) { return ((a % n) + n) % n; }

td_status td__ring_check(td_process_group *pg, const td__op_hdr *mine, uint64_t dl) {
  td__op_hdr theirs;
  const char *name = td__kind_name(mine->kind);
  TD_TRY(td__ring_xchg(pg, mine, sizeof *mine, &theirs, sizeof theirs, dl, name));
  if (memcmp(mine, &theirs, sizeof *mine) == 0) return TD_OK;
  return td__op_mismatch(pg, mine, (pg->rank + pg->size - 1) % pg->size, &theirs);
}

/* ---- the exchange primitive (pg->mu held) ---- */

void (*td__ring_test_sent)(td_process_group *pg, const void *p, size_t n);

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
  return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, k > 0 ? -1 : (pg->rank + 1) % pg->size, msg);
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

static td_status xchg_raw(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf,
                         size_t rn, uint64_t deadline_ns, const char *op) {
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
    int ms = td__pg_remaining_ms(noted ? deadline_ns : half);
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
        return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, (pg->rank + 1) % pg->size, msg);
      }
      TD_TRY(check_right_alive(pg, op));
    }
    if (sent < sn && (p[0].revents & POLLOUT)) {
      ssize_t k = send(pg->send_fd, (const char *)sbuf + sent, sn - sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0 && td__ring_test_sent)
        td__ring_test_sent(pg, (const char *)sbuf + sent, (size_t)k);
      if (k > 0) sent += (size_t)k;
      else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        snprintf(msg, sizeof msg, "%s is unavailable: send failed (%s; seen by %s during %s)",
                 td__pg_who(pg, (pg->rank + 1) % pg->size, who, sizeof who), strerror(errno),
                 me, op);
        return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, (pg->rank + 1) % pg->size, msg);
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
        return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, (pg->rank + pg->size - 1) % pg->size,
                                  msg);
      }
    }
  }
  return TD_OK;
}

/* An encrypted ring exchanges records (ring_crypt.c): step k seals piece k of what goes right
 * and opens piece k of what came from the left, as one raw exchange. The left neighbour sends
 * exactly what this member receives, so both ends cut the same pieces; every member's step k
 * needs only its neighbours' step k, so the lockstep cannot deadlock. */
td_status td__ring_xchg(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf, size_t rn,
                        uint64_t deadline_ns, const char *op) {
  if (!pg->ring_seal) return xchg_raw(pg, sbuf, sn, rbuf, rn, deadline_ns, op);
  uint8_t *out = pg->ring_records, *in = out + TD__RING_PIECE + TD__RING_TAG;
  size_t so = 0, ro = 0;
  while (so < sn || ro < rn) {
    size_t sl = sn - so < TD__RING_PIECE ? sn - so : TD__RING_PIECE;
    size_t rl = rn - ro < TD__RING_PIECE ? rn - ro : TD__RING_PIECE;
    if (sl) TD_TRY(td__ring_seal(pg->ring_seal, (const char *)sbuf + so, sl, out));
    TD_TRY(xchg_raw(pg, out, sl ? sl + TD__RING_TAG : 0, in, rl ? rl + TD__RING_TAG : 0,
                    deadline_ns, op));
    if (rl) {
      td_status st = td__ring_open(pg->ring_open, in, rl + TD__RING_TAG, (char *)rbuf + ro);
      if (st != TD_OK) {
        char who[160], msg[600];
        snprintf(msg, sizeof msg, "%s: data from %s failed authentication: %s", op,
                 td__pg_who(pg, (pg->rank + pg->size - 1) % pg->size, who, sizeof who),
                 td_last_error());
        return td__pg_fail(pg, st, msg);
      }
    }
    so += sl;
    ro += rl;
  }
  return TD_OK;
}

/* ---- ring algorithms (pg->mu held) ---- */

static td_status rs_ring(td_process_group *pg, chunk *ch, td_dtype dt, td_reduce_op op,
                         int shift, uint64_t dl, const char *name) {
  int n = pg->size, r = pg->rank;
  size_t es = td_dtype_size(dt), seg = SEG_BYTES / es * es;
  TD_TRY(td__pg_scratch(pg, seg));
  for (int s = 0; s < n - 1; s++) {
    const chunk *sc = &ch[mod(r - s + shift, n)];
    chunk *rc = &ch[mod(r - s - 1 + shift, n)];
    size_t ns = (sc->nbytes + seg - 1) / seg, nr = (rc->nbytes + seg - 1) / seg;
    size_t nseg = ns > nr ? ns : nr;
    for (size_t k = 0; k < nseg; k++) {
      size_t so = k * seg, ro = k * seg;
      size_t sl = so < sc->nbytes ? (sc->nbytes - so < seg ? sc->nbytes - so : seg) : 0;
      size_t rl = ro < rc->nbytes ? (rc->nbytes - ro < seg ? rc->nbytes - ro : seg) : 0;
      TD_TRY(td__ring_xchg(pg, sc->p + (sl ? so : 0), sl, pg->scratch, rl, dl, name));
      if (rl) td__reduce_into(rc->p + ro, pg->scratch, rl / es, dt, op);
    }
  }
  return TD_OK;
}

static td_status ag_ring(td_process_group *pg, chunk *ch, int shift, uint64_t dl,
                         const char *name) {
  int n = pg->size, r = pg->rank;
  for (int s = 0; s < n - 1; s++) {
    const chunk *sc = &ch[mod(r - s + shift, n)];
    chunk *rc = &ch[mod(r - s - 1 + shift, n)];
    TD_TRY(td__ring_xchg(pg, sc->p, sc->nbytes, rc->p, rc->nbytes, dl, name));
  }
  return TD_OK;
}

/* Splits count elements of es bytes at p into n nearly equal chunks (the first count % n get one
 * more element). */
static chunk *split(char *p, size_t count, size_t es, int n) {
  chunk *ch = td__malloc((size_t)n * sizeof *ch);
  if (!ch) return NULL;
  size_t base = count / (size_t)n, rem = count % (size_t)n, off = 0;
  for (int i = 0; i < n; i++) {
    size_t len = base + ((size_t)i < rem);
    ch[i] = (chunk){p + off * es, len * es};
    off += len;
  }
  return ch;
}

td_status td__ring_all_reduce(td_process_group *pg, void *data, size_t count, td_dtype dt,
                              td_reduce_op op, uint64_t dl) {
  if (count == 0) return TD_OK;
  chunk *ch = split(data, count, td_dtype_size(dt), pg->size);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "all_reduce: out of memory");
  td_status st = rs_ring(pg, ch, dt, op, 0, dl, "all_reduce");
  if (st == TD_OK) st = ag_ring(pg, ch, 1, dl, "all_reduce");
  td__free(ch);
  return st;
}

/* The last member of a broadcast's chain (distance n - 1, the root's left neighbour) sends one
 * byte to the root: the root returns only once everyone received, so a member that failed the
 * operation (a mismatch) fails the root too instead of leaving it to its next call. */
static td_status ack_root(td_process_group *pg, int64_t d, uint64_t dl) {
  char b = 1;
  if (d == pg->size - 1) return td__ring_xchg(pg, &b, 1, NULL, 0, dl, "broadcast");
  if (d == 0) return td__ring_xchg(pg, NULL, 0, &b, 1, dl, "broadcast");
  return TD_OK;
}

td_status td__ring_broadcast(td_process_group *pg, void *vdata, size_t nbytes, int root,
                             uint64_t dl) {
  int n = pg->size;
  char *data = vdata;
  int64_t d = mod(pg->rank - root, n);
  if (nbytes == 0) return ack_root(pg, d, dl);
  int64_t nseg = (int64_t)((nbytes + SEG_BYTES - 1) / SEG_BYTES);
  int64_t steps = nseg + n - 2;
  for (int64_t k = 0; k < steps; k++) {
    int64_t sj = k - d, rj = k - d + 1;
    bool do_send = d <= n - 2 && sj >= 0 && sj < nseg;
    bool do_recv = d >= 1 && rj >= 0 && rj < nseg;
    size_t so = (size_t)(do_send ? sj : 0) * SEG_BYTES, ro = (size_t)(do_recv ? rj : 0) * SEG_BYTES;
    size_t sl = do_send ? (nbytes - so < SEG_BYTES ? nbytes - so : SEG_BYTES) : 0;
    size_t rl = do_recv ? (nbytes - ro < SEG_BYTES ? nbytes - ro : SEG_BYTES) : 0;
    if (!sl && !rl) continue;
    TD_TRY(td__ring_xchg(pg, data + so, sl, data + ro, rl, dl, "broadcast"));
  }
  return ack_root(pg, d, dl);
}

td_status td__ring_all_gather(td_process_group *pg, td__chunk *ch, uint64_t dl) {
  return ag_ring(pg, ch, 0, dl, "all_gather");
}

td_status td__ring_reduce_scatter(td_process_group *pg, void *out, const char *const *ins,
                                  size_t count, td_dtype dt, td_reduce_op op, uint64_t dl) {
  size_t es = td_dtype_size(dt), nb = count * es, seg = SEG_BYTES / es * es;
  TD_TRY(td__pg_scratch(pg, seg + nb * (size_t)pg->size));
  chunk *ch = td__malloc((size_t)pg->size * sizeof *ch);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "reduce_scatter: out of memory");
  char *work = (char *)pg->scratch + seg; /* rs_ring uses the first seg bytes */
  for (int i = 0; i < pg->size; i++) {
    ch[i] = (chunk){work + (size_t)i * nb, nb};
    if (nb) memcpy(ch[i].p, ins[i], nb);
  }
  td_status st = nb ? rs_ring(pg, ch, dt, op, -1, dl, "reduce_scatter") : TD_OK;
  if (st == TD_OK && nb) memcpy(out, ch[pg->rank].p, nb);
  td__free(ch);
  return st;
}

td_status td__ring_barrier(td_process_group *pg, uint64_t dl) {
  TD_TRY(td__pg_scratch(pg, (size_t)pg->size));
  chunk *ch = split((char *)pg->scratch, (size_t)pg->size, 1, pg->size);
  if (!ch) return td_set_error(TD_ERR_NOMEM, "barrier: out of memory");
  td_status st = ag_ring(pg, ch, 0, dl, "barrier");
  td__free(ch);
  return st;
}

/* ---- the backend ---- */

static td_status ring_run(td_process_group *pg, const td__op *op, const td__op_hdr *h,
                          uint64_t dl) {
  TD_TRY(td__ring_check(pg, h, dl));
  td_dtype dt = (td_dtype)h->dtype;
  switch (op->kind) {
    case TD__K_ALL_REDUCE:
      return td__ring_all_reduce(pg, td_tensor_data(op->t), h->count, dt, op->rop, dl);
    case TD__K_BROADCAST:
      return td__ring_broadcast(pg, td_tensor_data(op->t), td_tensor_nbytes(op->t), op->root, dl);
    case TD__K_ALL_GATHER: {
      td__chunk *ch = pg->slot_chunks;
      td__op_gather_slots(op, pg->size, ch);
      const char *src = td_tensor_data(op->t); /* the ring starts from our own slot */
      if (ch[pg->rank].nbytes && ch[pg->rank].p != src)
        memmove(ch[pg->rank].p, src, ch[pg->rank].nbytes);
      return td__ring_all_gather(pg, ch, dl);
    }
    case TD__K_REDUCE_SCATTER: {
      td__op_scatter_slots(op, pg->size, pg->slot_ins);
      return td__ring_reduce_scatter(pg, td_tensor_data(op->t), pg->slot_ins, h->count, dt,
                                     op->rop, dl);
    }
    default: return td__ring_barrier(pg, dl);
  }
}

static td_status ring_setup(td_process_group *pg, uint64_t deadline, bool *serves) {
  *serves = pg->size > 1;
  return *serves ? td__ring_connect(pg, deadline) : TD_OK;
}

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

/* A failed group closes its connections: the neighbours' polls see it at once. */
static void ring_close(td_process_group *pg) {
  close_fd(&pg->send_fd);
  close_fd(&pg->recv_fd);
}

static void ring_destroy(td_process_group *pg) {
  ring_close(pg);
  td__ring_crypt_destroy(pg->ring_seal);
  td__ring_crypt_destroy(pg->ring_open);
  td__free(pg->ring_records);
  pg->ring_seal = pg->ring_open = NULL;
  pg->ring_records = NULL;
}

/* A member on this host: whether its process runs (the same-host records of creation gave its
 * pid); others: unknown (a closed connection is all the ring sees of them). */
static int ring_member_alive(td_process_group *pg, int m) {
  if (!pg->host_pid || m < 0 || m >= pg->size || pg->host_pid[m] <= 0) return -1;
  return td__pid_alive(pg->host_pid[m]) ? 1 : 0;
}

const td__coll_backend td__coll_ring = {
    .name = "ring",
    .setup = ring_setup,
    .fail = ring_close,
    .destroy = ring_destroy,
    .run = ring_run,
    .avg_is_sum = true,
    .member_alive = ring_member_alive,
};
