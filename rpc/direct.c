/* direct.c - same-host direct copy, all of it: the probe at rendezvous, the descriptor format,
 * the reader, and the sender's table of frames awaiting their ack (direct.h).
 *
 * A receiver copies large tensors straight out of the sender's memory (process_vm_readv) when
 * both run on one host: one copy instead of socket write + read + decode copy, and no HTTP/2
 * framing or flow control. At init every worker publishes direct/<r> = its same-host record
 * (core/samehost.h: pid, nonce and its address, boot id, pid namespace, advertised host; "-" when
 * disabled, the probe the collectives' shared memory uses too). Every worker probes the peers on
 * its host (same host, boot id and pid namespace) at init, accepts direct-copy frames from those
 * it could read, and publishes directok/<r> (those ranks, as ranges) with its ready count; after
 * the ready barrier each learns which peers can read it. Where the worker has a mailbox (by
 * default; or with TD_RPC_DIRECT_SETTLE=1 and dialled lanes) each pair on one host settles it
 * when it meets instead (td__transport_direct_lazily): making a mailbox lane takes the peer's
 * descriptors with pidfd_getfd, which the kernel allows exactly where it allows
 * process_vm_readv, and the peer's knock back says it took ours; in a dialled lane's handshake
 * each side, once the other proved itself, reads its nonce from its memory and says whether it
 * could (rpc/lane.h). So a worker settles it with the peers it meets, not all N
 * (td__direct_probe says when each is used). Reading another process's memory needs
 * the same user and no ptrace restriction (Yama scope 0, or 1 for a descendant): where the
 * probe fails the peer simply gets the stream or the lane's ring.
 *
 * THREAD SAFETY: the probe runs on the thread in td_rpc_init; the reader on the network thread;
 * a td__direct_acks belongs to its stream and is used under the stream's lock.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include "direct.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/uio.h>
#endif

#include "agent_state.h"
#include "../core/netaddr.h"
#include "../core/samehost.h"

/* ---- descriptors ---- */

bool td__direct_desc_len_ok(uint32_t header_len, uint64_t payload_len) {
  return header_len <= TD__MAX_HEADER && payload_len >= 16 && (payload_len - 16) % 16 == 0 &&
         (payload_len - 16) / 16 <= TD__DIRECT_MAX_TENSORS;
}

uint64_t td__direct_desc_token(const uint8_t *desc) { return td__get_u64(desc); }
int td__direct_desc_pid(const uint8_t *desc) { return (int)td__get_u32(desc + 8); }

td_status td__direct_encode(td__frame *f, uint64_t token, int pid, uint8_t **desc,
                            size_t *desc_len) {
  size_t dl = (size_t)td__direct_desc_size(f->ntensors);
  uint8_t *d = td__malloc(dl);
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  td__put_u64(d, token);
  td__put_u32(d + 8, (uint32_t)pid);
  td__put_u32(d + 12, 0);
  for (int i = 0; i < f->ntensors; i++) {
    td__put_u64(d + 16 + 16 * (size_t)i, (uint64_t)(uintptr_t)td_tensor_data(f->tensors[i]));
    td__put_u64(d + 24 + 16 * (size_t)i, (uint64_t)td_tensor_nbytes(f->tensors[i]));
  }
  td__put_u32(f->head, TD__FRAME_MAGIC_DIRECT);
  td__put_u64(f->head + 8, dl);
  *desc = d;
  *desc_len = dl;
  return TD_OK;
}

void td__direct_ack_frame(uint8_t out[TD__FRAME_PREFIX], uint64_t token) {
  td__put_u32(out, TD__FRAME_MAGIC_ACK);
  td__put_u32(out + 4, 0);
  td__put_u64(out + 8, 0);
  td__put_u64(out + 16, token);
}

/* ---- the reader ---- */

/* Copies len bytes at addr in process pid into dst. */
static td_status read_remote(int pid, uint64_t addr, void *dst, uint64_t len) {
#if defined(__linux__)
  uint8_t *out = dst;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    struct iovec l = {out, chunk}, r = {(void *)(uintptr_t)addr, chunk};
    ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got <= 0)
      return td_set_error(TD_ERR_UNAVAILABLE, "cannot read %llu bytes from process %d: %s",
                          (unsigned long long)chunk, pid, got < 0 ? strerror(errno) : "no data");
    out += got;
    addr += (uint64_t)got;
    len -= (uint64_t)got;
  }
  return TD_OK;
#else
  (void)addr; (void)dst; (void)len;
  return td_set_error(TD_ERR_UNSUPPORTED, "direct copy from process %d: not on this system", pid);
#endif
}

td_status td__direct_read(const uint8_t *desc, td_tensor *const *ts, int n) {
  int pid = td__direct_desc_pid(desc);
  for (int i = 0; i < n; i++) {
    uint64_t addr = td__get_u64(desc + 16 + 16 * (size_t)i);
    uint64_t len = td__get_u64(desc + 24 + 16 * (size_t)i);
    if (len != (uint64_t)td_tensor_nbytes(ts[i]))
      return td_set_error(TD_ERR_FORMAT, "direct-copy descriptor: tensor %d has %llu bytes, not "
                          "%zu", i, (unsigned long long)len, td_tensor_nbytes(ts[i]));
    if (len) TD_TRY(read_remote(pid, addr, td_tensor_data(ts[i]), len));
  }
  return TD_OK;
}

/* ---- frames awaiting their ack ---- */

typedef struct td__direct_sent {
  uint64_t token;
  td_tensor **ts;
  int n;
} td__direct_sent;

bool td__direct_acks_reserve(td__direct_acks *t) {
  if (t->n < t->cap) return true;
  int nc = t->cap ? t->cap * 2 : 16;
  td__direct_sent *ne = td__realloc(t->e, (size_t)nc * sizeof *ne);
  if (!ne) return false;
  t->e = ne;
  t->cap = nc;
  return true;
}

uint64_t td__direct_acks_add(td__direct_acks *t, td_tensor **ts, int n) {
  uint64_t token = ++t->next_token;
  t->e[t->n++] = (td__direct_sent){token, ts, n};
  return token;
}

void td__direct_acks_take(td__direct_acks *t, uint64_t token, td_tensor ***ts, int *n) {
  *ts = NULL;
  *n = 0;
  for (int i = 0; i < t->n; i++) {
    if (t->e[i].token == token) {
      *ts = t->e[i].ts;
      *n = t->e[i].n;
      t->e[i] = t->e[--t->n];
      return;
    }
  }
}

void td__direct_release(td_tensor **ts, int n) {
  for (int k = 0; k < n; k++) td_tensor_unref(ts[k]);
  td__free(ts);
}

void td__direct_acks_clear(td__direct_acks *t) {
  for (int i = 0; i < t->n; i++) td__direct_release(t->e[i].ts, t->e[i].n);
  td__free(t->e);
  *t = (td__direct_acks){0};
}

/* ---- the probe at rendezvous ---- */

bool td__direct_wanted(const td_rpc_options *o) {
#if defined(__linux__)
  if (o->direct_copy == 0) return false;
  if (o->direct_copy > 0) return true;
  const char *e = getenv("TD_RPC_DIRECT_COPY");
  return !(e && strcmp(e, "0") == 0);
#else
  (void)o;
  return false;
#endif
}

bool td__lane_wanted(const td_rpc_options *o) {
#if defined(__linux__)
  if (o->shm_lane == 0) return false;
  if (o->shm_lane > 0) return true;
  const char *e = getenv("TD_RPC_SHM_LANE");
  return !(e && strcmp(e, "0") == 0);
#else
  (void)o;
  return false;
#endif
}

/* Mailbox lanes (rpc/lane.h) unless TD_RPC_MAILBOX=0, and only where the kernel's ptrace check
 * is the plain one: under Yama's ptrace_scope 1 or more, pidfd_getfd between peers fails anyway,
 * while any process of the user could still open the arena through /proc/<pid>/fd (which asks
 * only for read access) and write frames into it. */
bool td__mbox_wanted(void) {
#if defined(__linux__)
  const char *e = getenv("TD_RPC_MAILBOX");
  if (e && strcmp(e, "0") == 0) return false;
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return true; /* no Yama */
  int scope = -1;
  if (fscanf(f, "%d", &scope) != 1) scope = -1;
  fclose(f);
  return scope == 0;
#else
  return false;
#endif
}

/* The same-host record is published when either same-host path is wanted; with a mailbox, its
 * descriptors follow the record's six fields (" <doorbell fd> <arena fd>"). */
void td__direct_record(td_rpc_agent *a, char key[64], char val[512]) {
  char host[256];
  snprintf(key, 64, "direct/%d", a->rank);
  if (a->direct_on || a->lane_on) {
    a->direct_nonce = td__samehost_nonce(a);
    td__addr_host(a->peers[a->rank].info.address, host, sizeof host);
    bool ok = td__samehost_record(host, &a->direct_nonce, val, 512);
    a->direct_on &= ok;
    a->lane_on &= ok;
    int bfd, afd;
    size_t len = strlen(val);
    if (ok && a->lane_on && a->lane_mbox &&
        td__transport_mbox_open(a->tr, a->world, a->direct_nonce, &bfd, &afd) == TD_OK &&
        len + 32 < 512)
      snprintf(val + len, 512 - len, " %d %d", bfd, afd);
    else
      a->lane_mbox = false; /* (no mailbox published: the pairs dial) */
  } else {
    snprintf(val, 512, "-");
  }
}

/* "directok/<rank>": the ranks this worker reads directly, as ascending ranges "a-b,c,..." (""
 * for none): a few bytes for a whole host, where a byte per rank made every worker read N^2. */
static td_status ranks_encode(const bool *on, int n, char **out) {
  size_t cap = 64, len = 0;
  char *b = td__malloc(cap);
  if (!b) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  b[0] = 0;
  for (int r = 0; r < n; r++) {
    if (!on[r]) continue;
    int e = r;
    while (e + 1 < n && on[e + 1]) e++;
    if (cap - len < 32) {
      char *nb = td__realloc(b, cap * 2);
      if (!nb) {
        td__free(b);
        return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
      }
      b = nb;
      cap *= 2;
    }
    len += (size_t)snprintf(b + len, cap - len, len ? ",%d" : "%d", r);
    if (e > r) len += (size_t)snprintf(b + len, cap - len, "-%d", e);
    r = e;
  }
  *out = b;
  return TD_OK;
}

/* Whether rank is in a ranges list of ranks_encode (a malformed list holds nothing). */
static bool ranks_has(const char *s, int rank) {
  while (*s) {
    char *end;
    long a = strtol(s, &end, 10), b = a;
    if (end == s) return false;
    if (*end == '-') {
      const char *q = end + 1;
      b = strtol(q, &end, 10);
      if (end == q) return false;
    }
    if (rank >= a && rank <= b) return true;
    if (*end != ',' && *end) return false;
    s = *end ? end + 1 : end;
  }
  return false;
}

/* The mailbox descriptors after a record's six fields (td__direct_record), or -1. */
static void mbox_fds(const char *rec, int *bell, int *arena) {
  *bell = *arena = -1;
  const char *p = rec;
  for (int i = 0; p && i < 6; i++) {
    while (*p == ' ') p++;
    p = strchr(p, ' ');
  }
  int b, f;
  char extra;
  if (p && sscanf(p, " %d %d %c", &b, &f, &extra) == 2 && b >= 0 && f >= 0) {
    *bell = b;
    *arena = f;
  }
}

/* Same-host lanes: rank r's stream may move to a lane when r's record names this host, boot and
 * pid namespace; the lane's socket then accepts only r's published pid, proving the secret sent
 * on r's authenticated stream (rpc/lane.c). Reading r's memory is not needed (lanes work where
 * the kernel forbids cross-memory reads), but when r is readable the pid is also the one direct
 * copy verified. */
td_status td__direct_probe(td_rpc_agent *a, uint64_t deadline) {
  size_t w = (size_t)a->world;
  a->direct_cand = td__calloc(w, sizeof *a->direct_cand);
  int *pids = td__calloc(w, sizeof *pids);      /* direct copy: the candidates' processes */
  uint64_t *addrs = td__calloc(w, sizeof *addrs), *nonces = td__calloc(w, sizeof *nonces);
  int *lane_pids = td__calloc(w, sizeof *lane_pids);
  uint64_t *lane_nonces = td__calloc(w, sizeof *lane_nonces);
  int *mb_bell = td__malloc(w * sizeof *mb_bell), *mb_arena = td__malloc(w * sizeof *mb_arena);
  td_status st = TD_OK;
  if (!a->direct_cand || !pids || !addrs || !nonces || !lane_pids || !lane_nonces || !mb_bell ||
      !mb_arena) {
    st = td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
    goto out;
  }
  td__host_rec me = {0};
  if (a->direct_on || a->lane_on) {
    char mine[512], host[256];
    td__addr_host(a->peers[a->rank].info.address, host, sizeof host);
    bool ok = td__samehost_record(host, &a->direct_nonce, mine, sizeof mine) &&
              td__samehost_parse(mine, &me);
    a->direct_on &= ok;
    a->lane_on &= ok;
  }
  bool share = a->direct_on || a->lane_on;
  for (size_t r = 0; r < w; r++) mb_bell[r] = mb_arena[r] = -1;
  char **recs = NULL;
  size_t *lens = NULL;
  st = share ? td__rdv_read_all(a, "direct/", deadline, &recs, &lens) : TD_OK;
  for (int r = 0; share && st == TD_OK && r < a->world0; r++) { /* (joiners: gRPC only) */
    td__host_rec peer;
    if (r == a->rank || !td__samehost_parse(recs[r], &peer) || !td__samehost_same(&me, &peer))
      continue;
    if (a->lane_on) {
      lane_pids[r] = peer.pid;
      lane_nonces[r] = peer.nonce; /* names its dial socket */
      mbox_fds(recs[r], &mb_bell[r], &mb_arena[r]);
    }
    if (a->direct_on) { /* only rank r, on its authenticated stream, may name it */
      pids[r] = peer.pid;
      addrs[r] = peer.addr;
      nonces[r] = peer.nonce;
    }
  }
  td__rdv_free_all(a, recs, lens);
  if (st == TD_OK && a->lane_on)
    st = td__transport_allow_lane(a->tr, lane_pids, a->lane_dial ? lane_nonces : NULL,
                                  a->direct_nonce, a->lane_mbox ? mb_bell : NULL,
                                  a->lane_mbox ? mb_arena : NULL, a->world);
  if (st != TD_OK) goto out;
  const char *settle = getenv("TD_RPC_DIRECT_SETTLE");
  bool lazily = settle && strcmp(settle, "1") == 0   ? true
                : settle && strcmp(settle, "0") == 0 ? false
                                                     : a->lane_mbox;
  if (a->direct_on && a->lane_dial && lazily && td__transport_dialing(a->tr)) {
    /* each pair settles it when it meets: a worker probes the peers it calls or is called by,
     * not every process on its host (1,024 workers on one host calling 8 peers each spent a
     * sixth of their start-up's CPU probing each other and reading the answers). By default
     * where this process has a mailbox: making a mailbox lane proves the access without
     * reading the peer (lane.h, probe). With TD_RPC_DIRECT_SETTLE=1 dialled lanes settle it
     * too, in their handshakes, by reading the peer on the socket thread, where
     * process_vm_readv waits for the peer's memory map lock, which a peer setting up lanes
     * holds often: 1,024 workers calling each other all failed dialled lane handshakes that
     * did not finish within 120 s, 2 runs of 2 (the init probe: 2 of 2 complete); so without
     * a mailbox every worker probes its host's peers here, unless that variable says so.
     * TD_RPC_DIRECT_SETTLE=0: the init probe always. A pair whose mailbox lane cannot be made
     * dials, and its handshake settles it by reading. */
    st = td__transport_direct_lazily(a->tr, pids, addrs, nonces, a->world);
  } else {
    for (int r = 0; r < a->world; r++) {
      td__host_rec peer = {.pid = pids[r], .addr = addrs[r], .nonce = nonces[r]};
      if (pids[r] > 0 && td__samehost_readable(&peer)) a->direct_cand[r] = true;
      else pids[r] = 0;
    }
    st = td__transport_allow_direct(a->tr, pids, a->world);
  }
  if (st == TD_OK) st = ranks_encode(a->direct_cand, a->world, &a->direct_ok);
out:
  td__free(pids);
  td__free(addrs);
  td__free(nonces);
  td__free(lane_pids);
  td__free(lane_nonces);
  td__free(mb_bell);
  td__free(mb_arena);
  return st;
}

/* After the ready barrier: which peers read us directly (they published before it). */
td_status td__direct_learn(td_rpc_agent *a, uint64_t deadline) {
  bool *to = td__calloc((size_t)a->world, sizeof *to);
  if (!to) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  bool any = false;
  for (int r = 0; r < a->world; r++) any |= a->direct_cand[r];
  char **oks = NULL;
  size_t *lens = NULL;
  td_status st = any ? td__rdv_read_all(a, "directok/", deadline, &oks, &lens) : TD_OK;
  for (int r = 0; any && st == TD_OK && r < a->world0; r++) {
    if (r == a->rank || !a->direct_cand[r] || !ranks_has(oks[r], a->rank)) continue;
    to[r] = true;
    a->direct_peers++;
  }
  td__rdv_free_all(a, oks, lens);
  if (st == TD_OK && a->direct_peers) st = td__transport_direct_to(a->tr, to, a->world);
  td__free(to);
  if (st == TD_OK && a->direct_peers)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d peers on this host copy tensors directly", a->name,
           a->direct_peers);
  return st;
}
