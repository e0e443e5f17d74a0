/* auth.c - group authentication: key derivation, the stream handshake and store sessions (see
 * auth.h for the protocol). HMAC-SHA256 comes from OpenSSL's libcrypto (EVP_MAC), randomness from
 * getrandom(2); MACs are compared in constant time (CRYPTO_memcmp).
 *
 * Lock order: the session table's mutex and a client session's mutex are leaves (the client's is
 * released around the network exchange).
 */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "wire.h" /* td__put_u32 / td__get_u32 ... */

/* ---- primitives ---- */

static EVP_MAC *hmac_alg;
static pthread_once_t hmac_once = PTHREAD_ONCE_INIT;

/* libcrypto is told not to clean up at exit: by default its atexit handler frees its state, and a
 * thread still inside tdist then (an init that a caller gave up on, as Python's Ctrl-C does, or
 * handlers abandoned by a shutdown) crashed in its next HMAC. The first initialisation decides,
 * so td__auth_crypto_init runs before anything else of td_rpc_init uses libcrypto. */
static void hmac_fetch(void) {
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, NULL);
  hmac_alg = EVP_MAC_fetch(NULL, "HMAC", NULL);
}

void td__auth_crypto_init(void) { pthread_once(&hmac_once, hmac_fetch); }

/* HMAC-SHA256 of the concatenation of n parts under key. */
static td_status hmac(const uint8_t *key, size_t klen, const void *const *parts,
                      const size_t *lens, int n, uint8_t out[TD__AUTH_MAC]) {
  td__auth_crypto_init();
  if (!hmac_alg) return td_set_error(TD_ERR_INTERNAL, "auth: libcrypto has no HMAC");
  EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(hmac_alg);
  if (!ctx) return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  size_t got = 0;
  int ok = EVP_MAC_init(ctx, key, klen, params);
  for (int i = 0; ok && i < n; i++) ok = EVP_MAC_update(ctx, parts[i], lens[i]);
  ok = ok && EVP_MAC_final(ctx, out, &got, TD__AUTH_MAC) && got == TD__AUTH_MAC;
  EVP_MAC_CTX_free(ctx);
  return ok ? TD_OK : td_set_error(TD_ERR_INTERNAL, "auth: HMAC failed");
}

td_status td__auth_sha256(const uint8_t *p, size_t len, uint8_t out[TD__AUTH_DIGEST]) {
  unsigned int got = 0;
  if (!EVP_Digest(p, len, out, &got, EVP_sha256(), NULL) || got != TD__AUTH_DIGEST)
    return td_set_error(TD_ERR_INTERNAL, "auth: SHA-256 failed");
  return TD_OK;
}

static bool mac_equal(const uint8_t *a, const uint8_t *b) {
  return CRYPTO_memcmp(a, b, TD__AUTH_MAC) == 0;
}

td_status td__auth_random(void *out, size_t n) {
  uint8_t *p = out;
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return td_set_error(TD_ERR_INTERNAL, "auth: no randomness: %s", strerror(errno));
    p += got;
    n -= (size_t)got;
  }
  return TD_OK;
}

td_status td__auth_init(td__auth *a, const char *secret, size_t len) {
  memset(a, 0, sizeof *a);
  if (!secret) return TD_OK; /* insecure */
  if (len < TD__AUTH_MIN_SECRET)
    return td_set_error(TD_ERR_INVALID, "auth: the job secret has %zu characters; use at least %d "
                        "(tdistrun generates 64)", len, TD__AUTH_MIN_SECRET);
  static const char label[] = "tdist/1 key";
  const void *parts[] = {label};
  size_t lens[] = {sizeof label - 1};
  TD_TRY(hmac((const uint8_t *)secret, len, parts, lens, 1, a->key));
  a->secure = true;
  return TD_OK;
}

td_status td__auth_derive(const td__auth *a, const char *label, const void *ctx, size_t n,
                          td__auth *out) {
  memset(out, 0, sizeof *out);
  if (!a->secure) return TD_OK; /* insecure stays insecure: zero MACs, unchecked */
  const void *parts[] = {"tdist/1 derive ", label, ctx};
  size_t lens[] = {15, strlen(label) + 1, n};
  TD_TRY(hmac(a->key, TD__AUTH_KEY, parts, lens, 3, out->key));
  out->secure = true;
  return TD_OK;
}

td_status td__auth_read_file(const char *path, bool private_file, size_t max, char **out,
                             size_t *len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return td_set_error(TD_ERR_IO, "auth: cannot open %s: %s", path, strerror(errno));
  struct stat sb;
  td_status st = TD_OK;
  if (fstat(fd, &sb) != 0) {
    st = td_set_error(TD_ERR_IO, "auth: cannot stat %s: %s", path, strerror(errno));
  } else if (!S_ISREG(sb.st_mode)) {
    st = td_set_error(TD_ERR_INVALID, "auth: %s is not a regular file", path);
  } else if (private_file && sb.st_uid != geteuid()) {
    st = td_set_error(TD_ERR_INVALID, "auth: %s belongs to uid %u, not to this user (%u)", path,
                      (unsigned)sb.st_uid, (unsigned)geteuid());
  } else if (private_file && (sb.st_mode & 077)) {
    st = td_set_error(TD_ERR_INVALID, "auth: %s is readable or writable by others (mode %03o); "
                      "run chmod 600 %s", path, (unsigned)(sb.st_mode & 0777), path);
  } else if ((uint64_t)sb.st_size > max) {
    st = td_set_error(TD_ERR_INVALID, "auth: %s is larger than %zu bytes", path, max);
  }
  char *buf = st == TD_OK ? td__malloc((size_t)sb.st_size + 1) : NULL;
  if (st == TD_OK && !buf) st = td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  size_t got = 0;
  while (st == TD_OK && got < (size_t)sb.st_size) {
    ssize_t n = read(fd, buf + got, (size_t)sb.st_size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) st = td_set_error(TD_ERR_IO, "auth: cannot read %s: %s", path,
                                  n < 0 ? strerror(errno) : "short file");
    else got += (size_t)n;
  }
  close(fd);
  if (st != TD_OK) {
    if (buf) memset(buf, 0, got);
    td__free(buf);
    return st;
  }
  buf[got] = 0;
  *out = buf;
  if (len) *len = got;
  return TD_OK;
}

td_status td__auth_secret_from_file(const char *path, char **out) {
  char *buf;
  size_t n;
  td_status st = td__auth_read_file(path, true, 4096, &buf, &n);
  if (st != TD_OK) return td__error_prefix(st, "the secret file");
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) buf[--n] = 0;
  *out = buf;
  return TD_OK;
}

/* ---- the stream handshake ---- */

#define HS_VERSION 1
#define MAGIC_HELLO 0x31484454u     /* "TDH1" */
#define MAGIC_CHALLENGE 0x32484454u /* "TDH2" */
#define MAGIC_PROOF 0x33484454u     /* "TDH3" */

enum { HS_NONE, HS_CLIENT_SENT_HELLO, HS_SERVER_SENT_CHALLENGE, HS_DONE };

static td_status hs_mac(const td__hs *h, const char *label, int client_rank, int server_rank,
                        uint8_t out[TD__AUTH_MAC]) {
  if (!h->auth->secure) {
    memset(out, 0, TD__AUTH_MAC);
    return TD_OK;
  }
  uint8_t ranks[8];
  td__put_u32(ranks, (uint32_t)client_rank);
  td__put_u32(ranks + 4, (uint32_t)server_rank);
  const void *parts[] = {label, h->nonce_c, h->nonce_s, ranks};
  size_t lens[] = {strlen(label), TD__AUTH_NONCE, TD__AUTH_NONCE, sizeof ranks};
  return hmac(h->auth->key, TD__AUTH_KEY, parts, lens, 4, out);
}

/* The refusal for a peer whose mode differs from ours. */
static td_status mode_mismatch(const td__auth *a, int peer_mode, const char *who) {
  if (peer_mode != 0 && peer_mode != 1)
    return td_set_error(TD_ERR_AUTH, "auth: %s uses an unknown authentication mode %d", who,
                        peer_mode);
  return td_set_error(TD_ERR_AUTH, "auth: %s %s a job secret but this worker %s (start every "
                      "worker of a group the same way: all with the job's secret, or all with "
                      "TD_RPC_INSECURE=1)", who, peer_mode ? "has" : "has no",
                      a->secure ? "has one" : "runs insecure");
}

td_status td__hs_client_hello(td__hs *h, const td__auth *a, int self_rank, int peer_rank,
                              uint8_t *out) {
  memset(h, 0, sizeof *h);
  h->auth = a;
  h->self_rank = self_rank;
  h->peer_rank = peer_rank;
  TD_TRY(td__auth_random(h->nonce_c, TD__AUTH_NONCE));
  td__put_u32(out, MAGIC_HELLO);
  out[4] = HS_VERSION;
  out[5] = 0;
  out[6] = a->secure ? 1 : 0;
  out[7] = 0;
  td__put_u32(out + 8, (uint32_t)self_rank);
  td__put_u32(out + 12, (uint32_t)peer_rank);
  memcpy(out + 16, h->nonce_c, TD__AUTH_NONCE);
  h->state = HS_CLIENT_SENT_HELLO;
  return TD_OK;
}

/* The HELLO's ticket: HMAC(K, "tdist/1 hello" | nonce_c | client_rank | wanted_rank). */
static td_status hello_ticket(const td__auth *a, const uint8_t *hello, uint8_t out[TD__AUTH_MAC]) {
  if (!a->secure) {
    memset(out, 0, TD__AUTH_MAC);
    return TD_OK;
  }
  static const char label[] = "tdist/1 hello";
  const void *parts[] = {label, hello + 16, hello + 8};
  size_t lens[] = {sizeof label - 1, TD__AUTH_NONCE, 8};
  return hmac(a->key, TD__AUTH_KEY, parts, lens, 3, out);
}

td_status td__hs_client_ticket(const td__hs *h, const uint8_t *hello, uint8_t *out) {
  memcpy(out, hello, TD__HS_HELLO_LEN);
  return hello_ticket(h->auth, hello, out + TD__HS_HELLO_LEN);
}

td_status td__hs_client_challenge(td__hs *h, const uint8_t *in, size_t n, uint8_t *out) {
  if (h->state != HS_CLIENT_SENT_HELLO)
    return td_set_error(TD_ERR_AUTH, "auth: unexpected handshake message");
  if (n != TD__HS_CHALLENGE_LEN || td__get_u32(in) != MAGIC_CHALLENGE)
    return td_set_error(TD_ERR_AUTH, "auth: the server did not answer with a tdist handshake "
                        "(%zu bytes)", n);
  if (in[4] != HS_VERSION)
    return td_set_error(TD_ERR_AUTH, "auth: the server speaks handshake version %u, this worker %u",
                        in[4], HS_VERSION);
  if (in[6] != (h->auth->secure ? 1 : 0)) return mode_mismatch(h->auth, in[6], "the server");
  int server_rank = (int)td__get_u32(in + 8);
  memcpy(h->nonce_s, in + 12, TD__AUTH_NONCE);
  uint8_t mac[TD__AUTH_MAC];
  TD_TRY(hs_mac(h, "tdist/1 server", h->self_rank, server_rank, mac));
  if (h->auth->secure && !mac_equal(mac, in + 44))
    return td_set_error(TD_ERR_AUTH, "auth: the server could not prove it knows the job secret "
                        "(another job's worker, or not a tdist worker)");
  if (server_rank != h->peer_rank)
    return td_set_error(TD_ERR_AUTH, "auth: reached rank %d instead of rank %d at that address",
                        server_rank, h->peer_rank);
  td__put_u32(out, MAGIC_PROOF);
  td__put_u32(out + 4, 0);
  TD_TRY(hs_mac(h, "tdist/1 client", h->self_rank, server_rank, out + 8));
  h->state = HS_DONE;
  return TD_OK;
}

td_status td__hs_server_hello(td__hs *h, const td__auth *a, int self_rank, const uint8_t *in,
                              size_t n, uint8_t *out) {
  memset(h, 0, sizeof *h);
  h->auth = a;
  h->self_rank = self_rank;
  if ((n != TD__HS_HELLO_LEN && n != TD__HS_TICKET_LEN) || td__get_u32(in) != MAGIC_HELLO)
    return td_set_error(TD_ERR_AUTH, "auth: the stream did not start with a tdist handshake "
                        "(%zu bytes)", n);
  if (in[4] != HS_VERSION)
    return td_set_error(TD_ERR_AUTH, "auth: the client speaks handshake version %u, this worker %u",
                        in[4], HS_VERSION);
  if (in[6] != (a->secure ? 1 : 0)) return mode_mismatch(a, in[6], "the client");
  int client_rank = (int)td__get_u32(in + 8);
  int wanted = (int)td__get_u32(in + 12);
  if (client_rank < 0)
    return td_set_error(TD_ERR_AUTH, "auth: the client claims rank %d", client_rank);
  if (wanted != self_rank)
    return td_set_error(TD_ERR_AUTH, "auth: a client looking for rank %d reached rank %d", wanted,
                        self_rank);
  if (n == TD__HS_TICKET_LEN) {
    uint8_t mac[TD__AUTH_MAC];
    TD_TRY(hello_ticket(a, in, mac));
    if (a->secure && !mac_equal(mac, in + TD__HS_HELLO_LEN))
      return td_set_error(TD_ERR_AUTH, "auth: a HELLO claiming rank %d does not prove it knows "
                          "the job secret", client_rank);
    h->ticketed = true;
  }
  h->peer_rank = client_rank;
  memcpy(h->nonce_c, in + 16, TD__AUTH_NONCE);
  TD_TRY(td__auth_random(h->nonce_s, TD__AUTH_NONCE));
  td__put_u32(out, MAGIC_CHALLENGE);
  out[4] = HS_VERSION;
  out[5] = 0;
  out[6] = a->secure ? 1 : 0;
  out[7] = 0;
  td__put_u32(out + 8, (uint32_t)self_rank);
  memcpy(out + 12, h->nonce_s, TD__AUTH_NONCE);
  TD_TRY(hs_mac(h, "tdist/1 server", client_rank, self_rank, out + 44));
  h->state = HS_SERVER_SENT_CHALLENGE;
  return TD_OK;
}

td_status td__hs_server_proof(td__hs *h, const uint8_t *in, size_t n, int *peer_rank) {
  if (h->state != HS_SERVER_SENT_CHALLENGE)
    return td_set_error(TD_ERR_AUTH, "auth: unexpected handshake message");
  if (n != TD__HS_PROOF_LEN || td__get_u32(in) != MAGIC_PROOF)
    return td_set_error(TD_ERR_AUTH, "auth: bad handshake proof (%zu bytes)", n);
  uint8_t mac[TD__AUTH_MAC];
  TD_TRY(hs_mac(h, "tdist/1 client", h->peer_rank, h->self_rank, mac));
  if (h->auth->secure && !mac_equal(mac, in + 8))
    return td_set_error(TD_ERR_AUTH, "auth: the client claiming rank %d could not prove it knows "
                        "the job secret", h->peer_rank);
  h->state = HS_DONE;
  *peer_rank = h->peer_rank;
  return TD_OK;
}

/* ---- store sessions ---- */

#define MAGIC_STORE 0x31534454u /* "TDS1" */
enum { ST_OPEN = 1, ST_OP = 2, ST_UNKNOWN_SESSION = 3 };
#define OPEN_LEN 40
#define OPEN_REPLY_LEN 80
#define OP_HEAD 56   /* magic, type, sid, seq, mac */
#define REPLY_HEAD 40 /* magic, type, mac */
#define WINDOW 64

/* A session (slot i of the table): its id carries i in its low SID_SLOT_BITS bits, so finding it
 * is one index, and the rest is the table's generation count (random at creation, so two servers'
 * ids differ and a worker that talks to a restarted store is told "unknown session", not "bad
 * MAC"). Each slot is on one list: free, pending (opened, never used with a valid MAC: all an
 * outsider can make) or verified, the last two in order of use (most recent first). */
#define SID_SLOT_BITS 24
#define SID_SLOT_MASK ((1u << SID_SLOT_BITS) - 1)
enum { POOL_PENDING, POOL_VERIFIED, POOL_FREE };

typedef struct session {
  uint64_t sid;  /* 0: a free slot */
  uint8_t key[TD__AUTH_KEY];
  uint64_t top;  /* highest sequence number accepted */
  uint64_t seen; /* bit i: top - i was accepted */
  int pool, prev, next; /* its list, and its neighbours there (-1: none) */
} session;

typedef struct pool {
  int head, tail, n, max;
} pool;

struct td__auth_sessions {
  const td__auth *auth;
  pthread_mutex_t mu;
  session *tab;
  int cap;       /* slots allocated */
  pool pools[3]; /* POOL_FREE's max: unused */
  uint64_t gen;
};

static td_status session_key(const td__auth *a, const uint8_t *nc, const uint8_t *ns, uint64_t sid,
                             const char *label, uint8_t out[TD__AUTH_MAC]) {
  if (!a->secure) {
    memset(out, 0, TD__AUTH_MAC);
    return TD_OK;
  }
  uint8_t s[8];
  td__put_u64(s, sid);
  const void *parts[] = {label, nc, ns, s};
  size_t lens[] = {strlen(label), TD__AUTH_NONCE, TD__AUTH_NONCE, 8};
  return hmac(a->key, TD__AUTH_KEY, parts, lens, 4, out);
}

/* MAC of a reply under a session key: over the SHA-256 of its body (digest: given, or NULL:
 * computed here), so a store that serves the same large body to many workers hashes it once. */
static td_status rep_mac(const td__auth *a, const uint8_t *key, uint64_t sid, uint64_t seq,
                         const uint8_t *body, size_t len, const uint8_t *digest,
                         uint8_t out[TD__AUTH_MAC]) {
  if (!a->secure) {
    memset(out, 0, TD__AUTH_MAC);
    return TD_OK;
  }
  uint8_t d[TD__AUTH_DIGEST];
  if (!digest) {
    TD_TRY(td__auth_sha256(body, len, d));
    digest = d;
  }
  uint8_t ids[16];
  td__put_u64(ids, sid);
  td__put_u64(ids + 8, seq);
  const void *parts[] = {"rep", ids, digest};
  size_t lens[] = {3, sizeof ids, TD__AUTH_DIGEST};
  return hmac(key, TD__AUTH_KEY, parts, lens, 3, out);
}

/* MAC of a request ("req") under a session key. */
static td_status op_mac(const td__auth *a, const uint8_t *key, const char *dir, uint64_t sid,
                        uint64_t seq, const uint8_t *body, size_t len, uint8_t out[TD__AUTH_MAC]) {
  if (!a->secure) {
    memset(out, 0, TD__AUTH_MAC);
    return TD_OK;
  }
  uint8_t ids[16];
  td__put_u64(ids, sid);
  td__put_u64(ids + 8, seq);
  const void *parts[] = {dir, ids, body};
  size_t lens[] = {3, sizeof ids, len};
  return hmac(key, TD__AUTH_KEY, parts, lens, 3, out);
}

int td__auth_sessions_members(int group) {
  int64_t m = 2 * (int64_t)(group > 0 ? group : 0) + 64;
  if (m < TD__AUTH_MAX_SESSIONS) m = TD__AUTH_MAX_SESSIONS;
  if (m > (int64_t)SID_SLOT_MASK - TD__AUTH_MAX_SESSIONS) m = SID_SLOT_MASK - TD__AUTH_MAX_SESSIONS;
  return (int)m;
}

td_status td__auth_sessions_create(const td__auth *a, int group, td__auth_sessions **out) {
  td__auth_sessions *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  s->auth = a;
  pthread_mutex_init(&s->mu, NULL);
  for (int k = 0; k < 3; k++) s->pools[k] = (pool){.head = -1, .tail = -1};
  s->pools[POOL_PENDING].max = TD__AUTH_MAX_SESSIONS;
  s->pools[POOL_VERIFIED].max = td__auth_sessions_members(group);
  td_status st = td__auth_random(&s->gen, sizeof s->gen);
  if (st != TD_OK) {
    td__auth_sessions_destroy(s);
    return st;
  }
  *out = s;
  return TD_OK;
}

void td__auth_sessions_destroy(td__auth_sessions *s) {
  if (!s) return;
  pthread_mutex_destroy(&s->mu);
  if (s->tab) memset(s->tab, 0, (size_t)s->cap * sizeof *s->tab);
  td__free(s->tab);
  td__free(s);
}

static void list_remove(td__auth_sessions *s, int i) {
  session *e = &s->tab[i];
  pool *p = &s->pools[e->pool];
  if (e->prev >= 0) s->tab[e->prev].next = e->next;
  else p->head = e->next;
  if (e->next >= 0) s->tab[e->next].prev = e->prev;
  else p->tail = e->prev;
  p->n--;
  e->prev = e->next = -1;
}

static void list_push(td__auth_sessions *s, int i, int k) {
  session *e = &s->tab[i];
  pool *p = &s->pools[k];
  e->pool = k;
  e->prev = -1;
  e->next = p->head;
  if (p->head >= 0) s->tab[p->head].prev = i;
  else p->tail = i;
  p->head = i;
  p->n++;
}

/* Slot i forgets its session and goes to the free list. mu held. */
static void session_drop(td__auth_sessions *s, int i) {
  list_remove(s, i);
  memset(s->tab[i].key, 0, sizeof s->tab[i].key);
  s->tab[i].sid = 0;
  list_push(s, i, POOL_FREE);
}

/* A slot for a new pending session, or -1 (out of memory): a free one, else a new one, except
 * that a full pending pool gives up its least recently used session. So an outsider, who can
 * open sessions but not use them, holds at most TD__AUTH_MAX_SESSIONS of them and never
 * pushes out a member's. mu held. */
static int session_slot(td__auth_sessions *s) {
  pool *pend = &s->pools[POOL_PENDING], *fr = &s->pools[POOL_FREE];
  if (pend->n >= pend->max) session_drop(s, pend->tail);
  if (fr->n == 0) {
    int64_t want = s->cap ? 2 * (int64_t)s->cap : 64,
            most = (int64_t)pend->max + s->pools[POOL_VERIFIED].max;
    if (want > most) want = most;
    if (want <= s->cap) return -1; /* (cannot happen: the two pools' bounds) */
    session *nt = td__realloc(s->tab, (size_t)want * sizeof *nt);
    if (!nt) return -1;
    s->tab = nt;
    for (int i = s->cap; i < (int)want; i++) {
      memset(&s->tab[i], 0, sizeof s->tab[i]);
      list_push(s, i, POOL_FREE);
    }
    s->cap = (int)want;
  }
  int i = fr->head;
  list_remove(s, i);
  return i;
}

static session *session_find(td__auth_sessions *s, uint64_t sid) {
  uint32_t i = (uint32_t)(sid & SID_SLOT_MASK);
  if (sid == 0 || i >= (uint32_t)s->cap || s->tab[i].sid != sid) return NULL;
  return &s->tab[i];
}

/* Session e was used with a valid MAC: it becomes (or stays) the most recently used verified
 * one; a full verified pool gives up its least recently used session (a member that comes back
 * opens a new one). mu held. */
static void session_touch(td__auth_sessions *s, session *e) {
  int i = (int)(e - s->tab);
  pool *ver = &s->pools[POOL_VERIFIED];
  bool was = e->pool == POOL_VERIFIED;
  list_remove(s, i);
  if (!was && ver->n >= ver->max) session_drop(s, ver->tail);
  list_push(s, i, POOL_VERIFIED);
}

/* Accepts seq once within the window. mu held. */
static bool window_accept(session *e, uint64_t seq) {
  if (seq == 0) return false;
  if (seq > e->top) {
    uint64_t shift = seq - e->top;
    e->seen = shift >= WINDOW ? 0 : e->seen << shift;
    e->seen |= 1;
    e->top = seq;
    return true;
  }
  uint64_t back = e->top - seq;
  if (back >= WINDOW || (e->seen >> back) & 1) return false;
  e->seen |= 1ull << back;
  return true;
}

static td_status serve_open(td__auth_sessions *s, const uint8_t *req, size_t len, uint8_t **reply,
                            size_t *reply_len) {
  if (len != OPEN_LEN) return td_set_error(TD_ERR_AUTH, "auth: malformed store session request");
  uint8_t ns[TD__AUTH_NONCE];
  TD_TRY(td__auth_random(ns, sizeof ns));
  const uint8_t *nc = req + 8;
  uint8_t *out = td__malloc(OPEN_REPLY_LEN);
  if (!out) return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  pthread_mutex_lock(&s->mu);
  int i = session_slot(s);
  if (i < 0) {
    pthread_mutex_unlock(&s->mu);
    td__free(out);
    return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  }
  uint64_t sid;
  do sid = (++s->gen << SID_SLOT_BITS) | (uint64_t)i; while (sid == 0);
  session *e = &s->tab[i];
  e->sid = sid;
  e->top = e->seen = 0;
  list_push(s, i, POOL_PENDING);
  td_status st = session_key(s->auth, nc, ns, sid, "tdist/1 store session", e->key);
  pthread_mutex_unlock(&s->mu);
  td__put_u32(out, MAGIC_STORE);
  out[4] = ST_OPEN;
  out[5] = s->auth->secure ? 1 : 0;
  out[6] = out[7] = 0;
  td__put_u64(out + 8, sid);
  memcpy(out + 16, ns, TD__AUTH_NONCE);
  if (st == TD_OK) st = session_key(s->auth, nc, ns, sid, "tdist/1 store", out + 48);
  if (st != TD_OK) {
    td__free(out);
    return st;
  }
  *reply = out;
  *reply_len = OPEN_REPLY_LEN;
  return TD_OK;
}

/* The session key, id and sequence number of the operation td__auth_store_serve is handling on
 * this thread (td__auth_store_current_seal), and the digest of its reply's body when the
 * handler gave it (td__auth_store_body_digest). */
static _Thread_local td__auth_seal current_seal;
static _Thread_local bool body_digest_set;
static _Thread_local uint8_t body_digest[TD__AUTH_DIGEST];

void td__auth_store_body_digest(const uint8_t digest[TD__AUTH_DIGEST]) {
  memcpy(body_digest, digest, TD__AUTH_DIGEST);
  body_digest_set = true;
}

static td_status seal_with(const td__auth_seal *seal, uint8_t *body, size_t n,
                           const uint8_t *digest, uint8_t **reply, size_t *reply_len);

td_status td__auth_store_serve(td__auth_sessions *s, const uint8_t *req, size_t len,
                               td__store_body_fn handle, void *ctx, uint8_t **reply,
                               size_t *reply_len) {
  if (len < 8 || td__get_u32(req) != MAGIC_STORE)
    return td_set_error(TD_ERR_AUTH, "auth: not a tdist store request");
  if (req[4] == ST_OPEN) return serve_open(s, req, len, reply, reply_len);
  if (req[4] != ST_OP || len < OP_HEAD)
    return td_set_error(TD_ERR_AUTH, "auth: malformed store request");
  uint64_t sid = td__get_u64(req + 8), seq = td__get_u64(req + 16);
  const uint8_t *body = req + OP_HEAD;
  size_t blen = len - OP_HEAD;
  uint8_t key[TD__AUTH_KEY], mac[TD__AUTH_MAC];
  pthread_mutex_lock(&s->mu);
  session *e = session_find(s, sid);
  if (e) memcpy(key, e->key, sizeof key);
  pthread_mutex_unlock(&s->mu);
  if (!e) { /* forgotten (or never opened): the client opens a new session */
    uint8_t *out = td__malloc(8);
    if (!out) return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
    td__put_u32(out, MAGIC_STORE);
    out[4] = ST_UNKNOWN_SESSION;
    out[5] = out[6] = out[7] = 0;
    *reply = out;
    *reply_len = 8;
    return TD_OK;
  }
  TD_TRY(op_mac(s->auth, key, "req", sid, seq, body, blen, mac));
  if (s->auth->secure && !mac_equal(mac, req + 24))
    return td_set_error(TD_ERR_AUTH, "auth: store request with a bad MAC");
  pthread_mutex_lock(&s->mu);
  e = session_find(s, sid);
  bool fresh = e && window_accept(e, seq);
  if (fresh) session_touch(s, e);
  pthread_mutex_unlock(&s->mu);
  if (!fresh) return td_set_error(TD_ERR_AUTH, "auth: store request replayed or too old");
  uint8_t *body_reply = NULL;
  size_t brl = 0;
  /* a handler that answers later (a parked wait) seals its reply with this */
  current_seal = (td__auth_seal){.secure = s->auth->secure, .sid = sid, .seq = seq};
  memcpy(current_seal.key, key, sizeof key);
  body_digest_set = false;
  td_status st = handle(ctx, body, blen, &body_reply, &brl);
  td__auth_seal seal = current_seal;
  memset(&current_seal, 0, sizeof current_seal);
  memset(key, 0, sizeof key);
  bool given = body_digest_set;
  body_digest_set = false;
  if (st == TD_OK)
    st = seal_with(&seal, body_reply, brl, given ? body_digest : NULL, reply, reply_len);
  memset(&seal, 0, sizeof seal);
  return st;
}

void td__auth_store_current_seal(td__auth_seal *out) { *out = current_seal; }

td_status td__auth_store_seal(const td__auth_seal *seal, uint8_t *body, size_t n, uint8_t **reply,
                              size_t *reply_len) {
  return seal_with(seal, body, n, NULL, reply, reply_len);
}

static td_status seal_with(const td__auth_seal *seal, uint8_t *body, size_t n,
                           const uint8_t *digest, uint8_t **reply, size_t *reply_len) {
  uint8_t *out = td__malloc(REPLY_HEAD + n);
  if (!out) {
    td__free(body);
    return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  }
  td__put_u32(out, MAGIC_STORE);
  out[4] = ST_OP;
  out[5] = out[6] = out[7] = 0;
  if (n) memcpy(out + REPLY_HEAD, body, n);
  td__free(body);
  td__auth mode = {.secure = seal->secure};
  td_status st = rep_mac(&mode, seal->key, seal->sid, seal->seq, out + REPLY_HEAD, n, digest,
                         out + 8);
  if (st != TD_OK) {
    td__free(out);
    return st;
  }
  *reply = out;
  *reply_len = REPLY_HEAD + n;
  return TD_OK;
}

void td__auth_client_init(td__auth_client *c, const td__auth *a) {
  memset(c, 0, sizeof *c);
  c->auth = a;
  pthread_mutex_init(&c->mu, NULL);
}

void td__auth_client_fini(td__auth_client *c) {
  if (!c->auth) return;
  pthread_mutex_destroy(&c->mu);
  memset(c, 0, sizeof *c);
}

static td_status client_open(td__auth_client *c, td__unary_fn send, void *ctx) {
  uint8_t req[OPEN_LEN], nc[TD__AUTH_NONCE];
  TD_TRY(td__auth_random(nc, sizeof nc));
  td__put_u32(req, MAGIC_STORE);
  req[4] = ST_OPEN;
  req[5] = req[6] = req[7] = 0;
  memcpy(req + 8, nc, sizeof nc);
  uint8_t *rep = NULL;
  size_t rl = 0;
  TD_TRY(send(ctx, req, sizeof req, &rep, &rl));
  td_status st = TD_OK;
  uint8_t mac[TD__AUTH_MAC], key[TD__AUTH_KEY];
  if (rl != OPEN_REPLY_LEN || td__get_u32(rep) != MAGIC_STORE || rep[4] != ST_OPEN) {
    st = td_set_error(TD_ERR_AUTH, "auth: the store did not answer with a tdist session (%zu "
                      "bytes)", rl);
  } else if (rep[5] != (c->auth->secure ? 1 : 0)) {
    st = mode_mismatch(c->auth, rep[5], "the store (rank 0)");
  } else {
    uint64_t sid = td__get_u64(rep + 8);
    st = session_key(c->auth, nc, rep + 16, sid, "tdist/1 store", mac);
    if (st == TD_OK && c->auth->secure && !mac_equal(mac, rep + 48))
      st = td_set_error(TD_ERR_AUTH, "auth: the store could not prove it knows the job secret "
                        "(another job's rank 0 on that port?)");
    if (st == TD_OK) st = session_key(c->auth, nc, rep + 16, sid, "tdist/1 store session", key);
    if (st == TD_OK) {
      pthread_mutex_lock(&c->mu);
      c->sid = sid;
      c->seq = 0;
      memcpy(c->key, key, sizeof key);
      c->open = true;
      pthread_mutex_unlock(&c->mu);
    }
  }
  td__free(rep);
  return st;
}

/* One OP on the current session. *reopen: the server forgot it. */
static td_status client_op(td__auth_client *c, td__unary_fn send, void *ctx, const uint8_t *body,
                           size_t len, uint8_t **reply, size_t *reply_len, bool *reopen) {
  *reopen = false;
  uint8_t key[TD__AUTH_KEY];
  pthread_mutex_lock(&c->mu);
  uint64_t sid = c->sid, seq = ++c->seq;
  memcpy(key, c->key, sizeof key);
  pthread_mutex_unlock(&c->mu);
  uint8_t *req = td__malloc(OP_HEAD + len);
  if (!req) return td_set_error(TD_ERR_NOMEM, "auth: out of memory");
  td__put_u32(req, MAGIC_STORE);
  req[4] = ST_OP;
  req[5] = req[6] = req[7] = 0;
  td__put_u64(req + 8, sid);
  td__put_u64(req + 16, seq);
  if (len) memcpy(req + OP_HEAD, body, len);
  td_status st = op_mac(c->auth, key, "req", sid, seq, body, len, req + 24);
  uint8_t *rep = NULL;
  size_t rl = 0;
  if (st == TD_OK) st = send(ctx, req, OP_HEAD + len, &rep, &rl);
  td__free(req);
  if (st != TD_OK) return st;
  uint8_t mac[TD__AUTH_MAC];
  if (rl == 8 && td__get_u32(rep) == MAGIC_STORE && rep[4] == ST_UNKNOWN_SESSION) {
    *reopen = true;
  } else if (rl < REPLY_HEAD || td__get_u32(rep) != MAGIC_STORE || rep[4] != ST_OP) {
    st = td_set_error(TD_ERR_AUTH, "auth: malformed store reply");
  } else if ((st = rep_mac(c->auth, key, sid, seq, rep + REPLY_HEAD, rl - REPLY_HEAD, NULL,
                           mac)) == TD_OK &&
             c->auth->secure && !mac_equal(mac, rep + 8)) {
    st = td_set_error(TD_ERR_AUTH, "auth: store reply with a bad MAC (tampered with on the way?)");
  } else if (st == TD_OK) {
    size_t bl = rl - REPLY_HEAD;
    uint8_t *b = td__malloc(bl ? bl : 1);
    if (!b) st = td_set_error(TD_ERR_NOMEM, "auth: out of memory");
    else {
      if (bl) memcpy(b, rep + REPLY_HEAD, bl);
      *reply = b;
      *reply_len = bl;
    }
  }
  td__free(rep);
  return st;
}

td_status td__auth_store_call(td__auth_client *c, td__unary_fn send, void *ctx,
                              const uint8_t *body, size_t len, uint8_t **reply,
                              size_t *reply_len) {
  for (int attempt = 0; attempt < 2; attempt++) {
    pthread_mutex_lock(&c->mu);
    bool open = c->open;
    pthread_mutex_unlock(&c->mu);
    if (!open) TD_TRY(client_open(c, send, ctx));
    bool reopen = false;
    TD_TRY(client_op(c, send, ctx, body, len, reply, reply_len, &reopen));
    if (!reopen) return TD_OK;
    pthread_mutex_lock(&c->mu);
    c->open = false;
    pthread_mutex_unlock(&c->mu);
  }
  return td_set_error(TD_ERR_AUTH, "auth: the store keeps forgetting this worker's session");
}
