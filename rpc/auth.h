/* auth.h - group authentication (internal): the job secret, the handshake that opens every stream,
 * and the authenticated sessions of the rendezvous store.
 *
 * Every member of a group knows the job secret; the key K = HMAC-SHA256(secret, "tdist/1 key")
 * is derived from it (the secret itself never leaves the process). Nothing a peer sends is
 * decoded before it proved knowledge of K with a fresh nonce of ours, and a peer learns nothing
 * from us before we proved the same to it (mutual challenge-response over HMAC-SHA256, from
 * OpenSSL's libcrypto):
 *
 * Streams (first three gRPC messages of every /tdist.Rpc/Stream call, before any frame):
 *   HELLO      client -> server  "TDH1" ver mode  client_rank wanted_rank  nonce_c        48 B
 *   CHALLENGE  server -> client  "TDH2" ver mode  server_rank nonce_s mac_s               76 B
 *   PROOF      client -> server  "TDH3" 0         mac_c                                   40 B
 *   mac_s = HMAC(K, "tdist/1 server" | nonce_c | nonce_s | client_rank | server_rank)
 *   mac_c = HMAC(K, "tdist/1 client" | nonce_c | nonce_s | client_rank | server_rank)
 * The server then knows the client's rank; every frame on the stream comes from that rank,
 * whatever a frame claims. The client checks it reached the rank it wanted.
 * On RPC streams the HELLO carries a ticket (80 B: the HELLO, then
 *   ticket = HMAC(K, "tdist/1 hello" | nonce_c | client_rank | wanted_rank)),
 * so that a server tells a member from a stranger at the first message: a stranger's stream is
 * refused there and never holds a slot of the members' handshakes (grpc_stream.c). A ticket can
 * be replayed by whoever saw it on the wire; it only gets the replayer a CHALLENGE it cannot
 * answer (the transport also refuses a nonce it saw recently). The collectives' ring sends
 * plain 48-byte HELLOs.
 *
 * Store (unary /tdist.Store/Op calls): a session is opened with
 *   OPEN       client -> server  "TDS1" 1 0 0 0  nonce_c                                  40 B
 *   reply                        "TDS1" 1 mode 0 0 sid nonce_s mac                         80 B
 *   mac = HMAC(K, "tdist/1 store" | nonce_c | nonce_s | sid), session key
 *   Ks = HMAC(K, "tdist/1 store session" | nonce_c | nonce_s | sid)
 * and every operation carries a sequence number (a window of 64 catches replays while letting
 * concurrent calls overtake each other) and a MAC over it and the request; the reply is MAC'd
 * with the same sequence number, so a worker also knows the store is the group's:
 *   OP         "TDS1" 2 0 0 0  sid seq  HMAC(Ks, "req" | sid | seq | body)  body
 *   reply      "TDS1" 2 0 0 0  HMAC(Ks, "rep" | sid | seq | SHA-256(body))  body
 * (a reply's MAC covers the SHA-256 of its body: rank 0 serves the same table of N records to N
 * workers at start-up, and hashes it once for all, td__auth_store_body_digest)
 * A server keeps at most TD__AUTH_MAX_SESSIONS sessions that were never used with a valid MAC
 * (all an outsider can open: the least recently opened go first, and never a member's) and at
 * most td__auth_sessions_members(group) used ones (twice the group, at least
 * TD__AUTH_MAX_SESSIONS: the least recently used go first, and a member that comes back opens a
 * new one). A group larger than a fixed table made its members push each other out ("the store
 * keeps forgetting this worker's session" at 4,096 simulated workers).
 *
 * Insecure mode (no secret, explicitly allowed): the same messages with all-zero MACs, unchecked:
 * ranks are still taken from the handshake. A secure and an insecure worker refuse each other
 * with a message that says so.
 *
 * THREAD SAFETY: a td__auth is immutable after td__auth_init; the handshake state belongs to its
 * stream; the session table and a client session lock themselves.
 */
#ifndef TD_RPC_AUTH_H
#define TD_RPC_AUTH_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"

#define TD__AUTH_KEY 32
#define TD__AUTH_NONCE 32
#define TD__AUTH_MAC 32
#define TD__AUTH_DIGEST 32 /* SHA-256 */
/* Shortest secret accepted (characters): shorter ones are easy to guess offline from a recorded
 * handshake. */
#define TD__AUTH_MIN_SECRET 16
#define TD__AUTH_MAX_SESSIONS 1024

typedef struct td__auth {
  bool secure;
  uint8_t key[TD__AUTH_KEY];
} td__auth;

/* td__auth_init derives the key from secret (len bytes, at least TD__AUTH_MIN_SECRET); NULL
 * secret: insecure mode. */
td_status td__auth_init(td__auth *a, const char *secret, size_t len);
/* td__auth_crypto_init initialises libcrypto without its exit-time cleanup (auth.c) and fetches
 * HMAC; idempotent, any thread. td_rpc_init calls it first. */
void td__auth_crypto_init(void);

/* td__auth_derive makes out a key of its own for one purpose and context: K' = HMAC(K,
 * "tdist/1 derive " | label | NUL | ctx[0..n)), so that a handshake made under it proves
 * knowledge of the job secret *and* binds the peers to that context (the collectives' ring:
 * label "ring", ctx the group's id, size and member ranks): a handshake captured in one group
 * or one position fails in any other. Insecure in, insecure out. */
td_status td__auth_derive(const td__auth *a, const char *label, const void *ctx, size_t n,
                          td__auth *out);
/* td__auth_random fills out with n cryptographically random bytes (TD_ERR_INTERNAL if the system
 * has none to give). */
td_status td__auth_random(void *out, size_t n);
/* td__auth_read_file reads a whole file (NUL-terminated, *len bytes; *out td__malloc'd) of at
 * most max bytes, refusing links and non-regular files; private_file also refuses a file that is
 * not this user's or that others may read or write. */
td_status td__auth_read_file(const char *path, bool private_file, size_t max, char **out,
                             size_t *len);
/* td__auth_secret_from_file reads a secret from path, refusing a file that is not a regular file
 * owned by this user with no group or other permission bits. *out is td__malloc'd. */
td_status td__auth_secret_from_file(const char *path, char **out);

/* ---- the stream handshake ---- */
#define TD__HS_HELLO_LEN 48
#define TD__HS_CHALLENGE_LEN 76
#define TD__HS_PROOF_LEN 40
#define TD__HS_TICKET_LEN 80 /* a HELLO with its ticket */
#define TD__HS_MAX_LEN 80 /* no handshake message is longer */

typedef struct td__hs {
  const td__auth *auth;
  int self_rank, peer_rank; /* client: peer_rank is the rank it wants to reach */
  uint8_t nonce_c[TD__AUTH_NONCE], nonce_s[TD__AUTH_NONCE];
  int state; /* internal */
  bool ticketed; /* server: the HELLO carried a valid ticket (the client knows K) */
} td__hs;

/* Client: the HELLO to send first (out: TD__HS_HELLO_LEN bytes). */
td_status td__hs_client_hello(td__hs *h, const td__auth *a, int self_rank, int peer_rank,
                              uint8_t *out);
/* Client: the HELLO with its ticket (out: TD__HS_TICKET_LEN bytes), from the HELLO that
 * td__hs_client_hello wrote. */
td_status td__hs_client_ticket(const td__hs *h, const uint8_t *hello, uint8_t *out);
/* Client: checks the server's CHALLENGE (its proof and its rank) and writes the PROOF (out:
 * TD__HS_PROOF_LEN bytes). Errors name what failed (TD_ERR_PERMISSION_DENIED style text in
 * td_last_error, status TD_ERR_UNAUTHENTICATED). */
td_status td__hs_client_challenge(td__hs *h, const uint8_t *in, size_t n, uint8_t *out);
/* Server: reads a HELLO (plain, or with a ticket, which must then be valid: h->ticketed) and
 * writes the CHALLENGE (out: TD__HS_CHALLENGE_LEN bytes). */
td_status td__hs_server_hello(td__hs *h, const td__auth *a, int self_rank, const uint8_t *in,
                              size_t n, uint8_t *out);
/* Server: checks the PROOF; on TD_OK *peer_rank is the authenticated rank of the client. */
td_status td__hs_server_proof(td__hs *h, const uint8_t *in, size_t n, int *peer_rank);

/* ---- store sessions, server side ---- */
typedef struct td__auth_sessions td__auth_sessions;
/* group: the most workers the store serves (its max world size), which bounds the sessions in
 * use that it keeps. */
td_status td__auth_sessions_create(const td__auth *a, int group, td__auth_sessions **out);
int td__auth_sessions_members(int group);
void td__auth_sessions_destroy(td__auth_sessions *s);
/* td__auth_store_serve handles one store call: an OPEN is answered here; an OP is verified and
 * its body passed to handle (its reply is then MAC'd). *reply is td__malloc'd. Fails with
 * TD_ERR_UNAUTHENTICATED (unknown or expired session: the client opens a new one) or
 * TD_ERR_PERMISSION (bad MAC, replay, malformed). */
typedef td_status (*td__store_body_fn)(void *ctx, const uint8_t *req, size_t len,
                                       uint8_t **reply, size_t *reply_len);
td_status td__auth_store_serve(td__auth_sessions *s, const uint8_t *req, size_t len,
                               td__store_body_fn handle, void *ctx, uint8_t **reply,
                               size_t *reply_len);

/* What a reply to one verified store operation is MAC'd with. A handler that answers later (a
 * parked wait, store.h) takes it with td__auth_store_current_seal while td__auth_store_serve
 * runs it, returns any reply (discarded by its caller), and later seals its real reply with
 * td__auth_store_seal (which takes body, td__malloc'd, and gives *reply, td__malloc'd). */
typedef struct td__auth_seal {
  uint8_t key[TD__AUTH_KEY];
  uint64_t sid, seq;
  bool secure;
} td__auth_seal;
void td__auth_store_current_seal(td__auth_seal *out);
/* A handler run by td__auth_store_serve may give the SHA-256 of the body it returns (one it
 * serves often, hashed once): the reply's MAC then covers it without hashing the body again. */
void td__auth_store_body_digest(const uint8_t digest[TD__AUTH_DIGEST]);
/* SHA-256 of len bytes at p. */
td_status td__auth_sha256(const uint8_t *p, size_t len, uint8_t out[TD__AUTH_DIGEST]);
td_status td__auth_store_seal(const td__auth_seal *seal, uint8_t *body, size_t n, uint8_t **reply,
                              size_t *reply_len);

/* ---- store sessions, client side ---- */
typedef struct td__auth_client {
  const td__auth *auth;
  pthread_mutex_t mu;
  bool open;
  uint64_t sid, seq;
  uint8_t key[TD__AUTH_KEY];
} td__auth_client;
void td__auth_client_init(td__auth_client *c, const td__auth *a);
void td__auth_client_fini(td__auth_client *c);
/* One unary exchange: sends req (len bytes) and returns the reply (td__malloc'd). */
typedef td_status (*td__unary_fn)(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                                  size_t *reply_len);
/* td__auth_store_call wraps body in an OP of the client's session (opening one first when
 * needed, and again once if the server forgot it), sends it through send, checks the reply's MAC
 * and returns its body (*reply, td__malloc'd). */
td_status td__auth_store_call(td__auth_client *c, td__unary_fn send, void *ctx,
                              const uint8_t *body, size_t len, uint8_t **reply,
                              size_t *reply_len);

#endif
