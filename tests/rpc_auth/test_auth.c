/* test_auth.c - group authentication (rpc/auth.c): the stream handshake between two ends that
 * share a secret (and ends that do not, or that tamper with it), store sessions (replays,
 * reordering, tampering, forgotten sessions, the bounded table), secret files, and the
 * agent-level policy (no secret, no start). */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "rpc/auth.h"
#include "tdist/rpc.h"
#include "test_util.h"

static const char *S1 = "a-first-job-secret-0123456789";
static const char *S2 = "another-job-secret-0123456789";

/* Runs a whole handshake between a client (auth ca, rank 3, wanting rank 5) and a server (auth
 * sa, rank 5). Returns the first failure, and the authenticated rank in *rank. tamper: byte index
 * of the CHALLENGE (0..75) or, with 100 added, of the PROOF to flip; -1 for none. */
static td_status handshake(const td__auth *ca, const td__auth *sa, int tamper, int *rank) {
  td__hs c, s;
  uint8_t hello[TD__HS_HELLO_LEN], chal[TD__HS_CHALLENGE_LEN], proof[TD__HS_PROOF_LEN];
  TD_TRY(td__hs_client_hello(&c, ca, 3, 5, hello));
  TD_TRY(td__hs_server_hello(&s, sa, 5, hello, sizeof hello, chal));
  if (tamper >= 0 && tamper < 100) chal[tamper] ^= 0x40;
  TD_TRY(td__hs_client_challenge(&c, chal, sizeof chal, proof));
  if (tamper >= 100) proof[tamper - 100] ^= 0x40;
  return td__hs_server_proof(&s, proof, sizeof proof, rank);
}

static void test_auth_handshake_proves_both_ends(void **state) {
  (void)state;
  td__auth a, b, none;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&b, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&none, NULL, 0));
  int rank = -1;
  TD_ASSERT_OK(handshake(&a, &b, -1, &rank));
  assert_int_equal(rank, 3);
  /* insecure on both ends: ranks still exchanged */
  rank = -1;
  TD_ASSERT_OK(handshake(&none, &none, -1, &rank));
  assert_int_equal(rank, 3);
}

static void test_auth_handshake_refuses_other_secret(void **state) {
  (void)state;
  td__auth a, b, none;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&b, S2, strlen(S2)));
  TD_ASSERT_OK(td__auth_init(&none, NULL, 0));
  int rank = -1;
  /* the client sees the server's proof fail first */
  assert_int_equal(handshake(&a, &b, -1, &rank), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "could not prove"));
  assert_int_equal(handshake(&a, &none, -1, &rank), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "TD_RPC_INSECURE"));
  assert_int_equal(handshake(&none, &a, -1, &rank), TD_ERR_AUTH);
  assert_int_equal(rank, -1);
}

/* Any bit flipped in the server's nonce or proof, or in the client's proof, fails. */
static void test_auth_handshake_detects_tampering(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  int rank;
  for (int i = 12; i < TD__HS_CHALLENGE_LEN; i++)
    assert_int_equal(handshake(&a, &a, i, &rank), TD_ERR_AUTH);
  for (int i = 8; i < TD__HS_PROOF_LEN; i++)
    assert_int_equal(handshake(&a, &a, 100 + i, &rank), TD_ERR_AUTH);
  /* the server's rank (bytes 8..11) is bound into its proof */
  assert_int_equal(handshake(&a, &a, 8, &rank), TD_ERR_AUTH);
}

/* A PROOF recorded from one handshake does not open another (the server's nonce is fresh). */
static void test_auth_handshake_proof_not_replayable(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  td__hs c, s1, s2;
  uint8_t hello[TD__HS_HELLO_LEN], chal[TD__HS_CHALLENGE_LEN], proof[TD__HS_PROOF_LEN];
  uint8_t chal2[TD__HS_CHALLENGE_LEN];
  TD_ASSERT_OK(td__hs_client_hello(&c, &a, 1, 0, hello));
  TD_ASSERT_OK(td__hs_server_hello(&s1, &a, 0, hello, sizeof hello, chal));
  TD_ASSERT_OK(td__hs_client_challenge(&c, chal, sizeof chal, proof));
  int rank;
  TD_ASSERT_OK(td__hs_server_proof(&s1, proof, sizeof proof, &rank));
  /* an eavesdropper replays HELLO and PROOF to a new stream */
  TD_ASSERT_OK(td__hs_server_hello(&s2, &a, 0, hello, sizeof hello, chal2));
  assert_memory_not_equal(chal + 12, chal2 + 12, TD__AUTH_NONCE);
  assert_int_equal(td__hs_server_proof(&s2, proof, sizeof proof, &rank), TD_ERR_AUTH);
}

/* The HELLO's ticket proves the client knows the key before the server answers: valid, it marks
 * the handshake ticketed; made with another secret, or with a changed nonce or rank, it is
 * refused at the HELLO; a plain HELLO stays unticketed (RPC streams refuse it: grpc_stream.c). */
static void test_auth_hello_ticket_proves_membership(void **state) {
  (void)state;
  td__auth a, b;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&b, S2, strlen(S2)));
  td__hs c, s;
  uint8_t hello[TD__HS_HELLO_LEN], t[TD__HS_TICKET_LEN], chal[TD__HS_CHALLENGE_LEN];
  TD_ASSERT_OK(td__hs_client_hello(&c, &a, 1, 0, hello));
  TD_ASSERT_OK(td__hs_client_ticket(&c, hello, t));
  TD_ASSERT_OK(td__hs_server_hello(&s, &a, 0, t, sizeof t, chal));
  assert_true(s.ticketed);
  assert_int_equal(td__hs_server_hello(&s, &b, 0, t, sizeof t, chal), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "does not prove"));
  for (size_t i = 8; i < TD__HS_TICKET_LEN; i += 9) { /* ranks, nonce, ticket */
    uint8_t bad[TD__HS_TICKET_LEN];
    memcpy(bad, t, sizeof bad);
    bad[i] ^= 4;
    assert_int_equal(td__hs_server_hello(&s, &a, 0, bad, sizeof bad, chal), TD_ERR_AUTH);
  }
  TD_ASSERT_OK(td__hs_server_hello(&s, &a, 0, hello, sizeof hello, chal));
  assert_false(s.ticketed);
}

static void test_auth_handshake_checks_shape_and_ranks(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  td__hs c, s;
  uint8_t hello[TD__HS_HELLO_LEN], chal[TD__HS_CHALLENGE_LEN], junk[TD__HS_HELLO_LEN];
  TD_ASSERT_OK(td__hs_client_hello(&c, &a, 1, 2, hello));
  /* a client looking for rank 2 that reached rank 0 */
  assert_int_equal(td__hs_server_hello(&s, &a, 0, hello, sizeof hello, chal), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "looking for rank 2"));
  /* wrong length, wrong magic, a negative rank */
  assert_int_equal(td__hs_server_hello(&s, &a, 2, hello, sizeof hello - 1, chal), TD_ERR_AUTH);
  memcpy(junk, hello, sizeof junk);
  junk[0] ^= 1;
  assert_int_equal(td__hs_server_hello(&s, &a, 2, junk, sizeof junk, chal), TD_ERR_AUTH);
  memcpy(junk, hello, sizeof junk);
  memset(junk + 8, 0xff, 4);
  assert_int_equal(td__hs_server_hello(&s, &a, 2, junk, sizeof junk, chal), TD_ERR_AUTH);
  /* a proof before any challenge */
  td__hs fresh;
  memset(&fresh, 0, sizeof fresh);
  int rank;
  uint8_t proof[TD__HS_PROOF_LEN] = {0};
  assert_int_equal(td__hs_server_proof(&fresh, proof, sizeof proof, &rank), TD_ERR_AUTH);
  /* the client rejects a challenge from another rank than it wanted */
  TD_ASSERT_OK(td__hs_server_hello(&s, &a, 2, hello, sizeof hello, chal));
  td__hs c2;
  uint8_t hello2[TD__HS_HELLO_LEN];
  TD_ASSERT_OK(td__hs_client_hello(&c2, &a, 1, 3, hello2));
  memcpy(c2.nonce_c, c.nonce_c, TD__AUTH_NONCE); /* as if it had sent the first HELLO */
  assert_int_equal(td__hs_client_challenge(&c2, chal, sizeof chal, proof), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "instead of rank 3"));
}

static void test_auth_secret_rules(void **state) {
  (void)state;
  td__auth a;
  assert_int_equal(td__auth_init(&a, "short", 5), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "at least"));
  char path[] = "/tmp/td_secret_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "file-secret-0123456789\n", 23), 23);
  close(fd);
  char *s = NULL;
  assert_int_equal(chmod(path, 0644), 0);
  assert_int_equal(td__auth_secret_from_file(path, &s), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "chmod 600"));
  assert_int_equal(chmod(path, 0600), 0);
  TD_ASSERT_OK(td__auth_secret_from_file(path, &s));
  assert_string_equal(s, "file-secret-0123456789"); /* the newline is not part of it */
  td__free(s);
  char link[64];
  snprintf(link, sizeof link, "%s.lnk", path);
  assert_int_equal(symlink(path, link), 0);
  assert_int_not_equal(td__auth_secret_from_file(link, &s), TD_OK);
  unlink(link);
  unlink(path);
  assert_int_equal(td__auth_secret_from_file(path, &s), TD_ERR_IO);
  char buf[65];
  TD_ASSERT_OK(td_rpc_secret_generate(buf, sizeof buf));
  assert_int_equal(strlen(buf), 64);
  assert_int_equal(strspn(buf, "0123456789abcdef"), 64);
  assert_int_equal(td_rpc_secret_generate(buf, 64), TD_ERR_INVALID);
}

/* ---- store sessions, with the server called directly as the "network" ---- */

typedef struct net {
  td__auth_sessions *srv;
  int calls;
  /* the last request and reply, for replay and tampering */
  uint8_t last_req[256];
  size_t last_req_len;
  int tamper_reply;  /* flip this byte of the next reply (-1: none) */
} net;

static td_status echo_body(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len) {
  (void)ctx;
  uint8_t *b = td__malloc(len + 1);
  if (!b) return TD_ERR_NOMEM;
  memcpy(b, req, len);
  b[len] = '!';
  *reply = b;
  *reply_len = len + 1;
  return TD_OK;
}

static td_status send_to(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                         size_t *reply_len) {
  net *n = ctx;
  n->calls++;
  if (len <= sizeof n->last_req) {
    memcpy(n->last_req, req, len);
    n->last_req_len = len;
  }
  TD_TRY(td__auth_store_serve(n->srv, req, len, echo_body, NULL, reply, reply_len));
  if (n->tamper_reply >= 0 && (size_t)n->tamper_reply < *reply_len) {
    (*reply)[n->tamper_reply] ^= 0x01;
    n->tamper_reply = -1;
  }
  return TD_OK;
}

static void test_auth_store_session_round_trip_and_replay(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  net n = {.tamper_reply = -1};
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &n.srv));
  td__auth_client c;
  td__auth_client_init(&c, &a);
  uint8_t *rep = NULL;
  size_t rl = 0;
  TD_ASSERT_OK(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"get k", 5, &rep, &rl));
  assert_int_equal(rl, 6);
  assert_memory_equal(rep, "get k!", 6);
  td__free(rep);
  assert_int_equal(n.calls, 2); /* open + op */
  /* the recorded request, sent again, is refused (replay) */
  uint8_t replay[256];
  size_t replay_len = n.last_req_len;
  memcpy(replay, n.last_req, replay_len);
  assert_int_equal(td__auth_store_serve(n.srv, replay, replay_len, echo_body, NULL, &rep, &rl),
                   TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "replayed"));
  /* a fresh sequence number with the old MAC, or a flipped body byte: refused */
  replay[16] ^= 0x7f;
  assert_int_equal(td__auth_store_serve(n.srv, replay, replay_len, echo_body, NULL, &rep, &rl),
                   TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "bad MAC"));
  replay[16] ^= 0x7f;
  replay[replay_len - 1] ^= 1;
  assert_int_equal(td__auth_store_serve(n.srv, replay, replay_len, echo_body, NULL, &rep, &rl),
                   TD_ERR_AUTH);
  /* a tampered reply is caught by the client */
  n.tamper_reply = 41; /* the reply body (40 bytes of header, then "x!") */
  assert_int_equal(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"x", 1, &rep, &rl),
                   TD_ERR_AUTH);
  /* garbage and unknown types */
  const uint8_t junk[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  assert_int_equal(td__auth_store_serve(n.srv, junk, sizeof junk, echo_body, NULL, &rep, &rl),
                   TD_ERR_AUTH);
  td__auth_client_fini(&c);
  td__auth_sessions_destroy(n.srv);
}

/* Keeps the request instead of sending it (the call fails as if the network lost it). */
typedef struct held {
  uint8_t req[16][256];
  size_t len[16];
  int n;
} held;

static td_status hold_only(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len) {
  held *h = ctx;
  (void)reply;
  (void)reply_len;
  assert_true(h->n < 16 && len <= 256);
  memcpy(h->req[h->n], req, len);
  h->len[h->n++] = len;
  return td_set_error(TD_ERR_UNAVAILABLE, "held");
}

/* Requests of one session may arrive out of order within the window (concurrent threads), each
 * once; one older than the window is refused. */
static void test_auth_store_window_accepts_reordering(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  net n = {.tamper_reply = -1};
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &n.srv));
  td__auth_client c;
  td__auth_client_init(&c, &a);
  uint8_t *rep;
  size_t rl;
  TD_ASSERT_OK(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"a", 1, &rep, &rl));
  td__free(rep);
  held h = {0};
  for (int i = 0; i < 3; i++)
    assert_int_equal(td__auth_store_call(&c, hold_only, &h, (const uint8_t *)"b", 1, &rep, &rl),
                     TD_ERR_UNAVAILABLE);
  const int order[3] = {2, 0, 1};
  for (int k = 0; k < 3; k++) {
    int i = order[k];
    TD_ASSERT_OK(td__auth_store_serve(n.srv, h.req[i], h.len[i], echo_body, NULL, &rep, &rl));
    td__free(rep);
  }
  for (int i = 0; i < 3; i++)
    assert_int_equal(td__auth_store_serve(n.srv, h.req[i], h.len[i], echo_body, NULL, &rep, &rl),
                     TD_ERR_AUTH);
  /* one request held back while 70 newer ones go through: too old when it arrives */
  h.n = 0;
  assert_int_equal(td__auth_store_call(&c, hold_only, &h, (const uint8_t *)"d", 1, &rep, &rl),
                   TD_ERR_UNAVAILABLE);
  for (int i = 0; i < 70; i++) {
    TD_ASSERT_OK(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"c", 1, &rep, &rl));
    td__free(rep);
  }
  assert_int_equal(td__auth_store_serve(n.srv, h.req[0], h.len[0], echo_body, NULL, &rep, &rl),
                   TD_ERR_AUTH);
  td__auth_client_fini(&c);
  td__auth_sessions_destroy(n.srv);
}

/* A server that lost the session (restarted store, evicted entry): the client opens a new one
 * and the call succeeds. */
static void test_auth_store_reopens_forgotten_session(void **state) {
  (void)state;
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  td__auth_sessions *s1, *s2;
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &s1));
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &s2));
  net n = {.srv = s1, .tamper_reply = -1};
  td__auth_client c;
  td__auth_client_init(&c, &a);
  uint8_t *rep;
  size_t rl;
  TD_ASSERT_OK(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"a", 1, &rep, &rl));
  td__free(rep);
  n.srv = s2; /* another server: it has never seen the session */
  int before = n.calls;
  TD_ASSERT_OK(td__auth_store_call(&c, send_to, &n, (const uint8_t *)"b", 1, &rep, &rl));
  assert_memory_equal(rep, "b!", 2);
  td__free(rep);
  assert_int_equal(n.calls - before, 3); /* op (unknown), open, op */
  td__auth_client_fini(&c);
  td__auth_sessions_destroy(s1);
  td__auth_sessions_destroy(s2);
}

/* An outsider can open sessions (it cannot use them): filling the table evicts its own unused
 * sessions before a member's verified one. */
static void test_auth_store_table_bounded_members_kept(void **state) {
  (void)state;
  td__auth a, other;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&other, S2, strlen(S2)));
  net n = {.tamper_reply = -1};
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &n.srv));
  td__auth_client member;
  td__auth_client_init(&member, &a);
  uint8_t *rep;
  size_t rl;
  TD_ASSERT_OK(td__auth_store_call(&member, send_to, &n, (const uint8_t *)"m", 1, &rep, &rl));
  td__free(rep);
  /* 3 x the table's size of OPENs by somebody without the secret: each fails at the MAC check
   * on the client side, but the server has made a session for every one */
  for (int i = 0; i < 3 * TD__AUTH_MAX_SESSIONS; i++) {
    td__auth_client out;
    td__auth_client_init(&out, &other);
    assert_int_equal(td__auth_store_call(&out, send_to, &n, (const uint8_t *)"o", 1, &rep, &rl),
                     TD_ERR_AUTH);
    td__auth_client_fini(&out);
  }
  int before = n.calls;
  TD_ASSERT_OK(td__auth_store_call(&member, send_to, &n, (const uint8_t *)"m", 1, &rep, &rl));
  td__free(rep);
  assert_int_equal(n.calls - before, 1); /* its session survived: no reopen */
  td__auth_client_fini(&member);
  td__auth_sessions_destroy(n.srv);
}

/* A member's call: n->calls it took (1: its session was kept; 3: op refused, open, op). */
static int member_call(net *n, td__auth_client *c) {
  uint8_t *rep;
  size_t rl;
  int before = n->calls;
  TD_ASSERT_OK(td__auth_store_call(c, send_to, n, (const uint8_t *)"m", 1, &rep, &rl));
  assert_memory_equal(rep, "m!", 2);
  td__free(rep);
  return n->calls - before;
}

/* A group larger than TD__AUTH_MAX_SESSIONS keeps every member's session, also while an
 * outsider opens sessions (a fixed table of 1,024 made 4,096 members push each other out until
 * init failed: "the store keeps forgetting this worker's session"); and the sessions in use stay
 * bounded by the group: the least recently used member beyond the bound reopens. */
static void test_auth_store_sessions_follow_the_group(void **state) {
  (void)state;
  enum { G = 3 * TD__AUTH_MAX_SESSIONS };
  td__auth a, other;
  TD_ASSERT_OK(td__auth_init(&a, S1, strlen(S1)));
  TD_ASSERT_OK(td__auth_init(&other, S2, strlen(S2)));
  net n = {.tamper_reply = -1};
  TD_ASSERT_OK(td__auth_sessions_create(&a, G, &n.srv));
  td__auth_client *m = td__calloc(G, sizeof *m);
  assert_non_null(m);
  for (int i = 0; i < G; i++) {
    td__auth_client_init(&m[i], &a);
    assert_int_equal(member_call(&n, &m[i]), 2); /* open, op */
  }
  for (int i = 0; i < 2 * TD__AUTH_MAX_SESSIONS; i++) { /* an outsider's opens */
    td__auth_client out;
    td__auth_client_init(&out, &other);
    uint8_t *rep;
    size_t rl;
    assert_int_equal(td__auth_store_call(&out, send_to, &n, (const uint8_t *)"o", 1, &rep, &rl),
                     TD_ERR_AUTH);
    td__auth_client_fini(&out);
  }
  for (int i = 0; i < G; i++) assert_int_equal(member_call(&n, &m[i]), 1);
  /* past its bound (a group of 4: TD__AUTH_MAX_SESSIONS sessions in use) the least recently
   * used member is the one that reopens */
  td__auth_sessions_destroy(n.srv);
  TD_ASSERT_OK(td__auth_sessions_create(&a, 4, &n.srv));
  assert_int_equal(td__auth_sessions_members(4), TD__AUTH_MAX_SESSIONS);
  for (int i = 0; i <= TD__AUTH_MAX_SESSIONS; i++) {
    td__auth_client_fini(&m[i]);
    td__auth_client_init(&m[i], &a);
    member_call(&n, &m[i]);
  }
  assert_int_equal(member_call(&n, &m[TD__AUTH_MAX_SESSIONS]), 1);
  assert_int_equal(member_call(&n, &m[1]), 1);
  assert_int_equal(member_call(&n, &m[0]), 3);
  for (int i = 0; i < G; i++) td__auth_client_fini(&m[i]);
  td__free(m);
  td__auth_sessions_destroy(n.srv);
}

/* The agent refuses to start a group of several workers without a secret, and says how. */
static void test_auth_agent_needs_a_secret(void **state) {
  (void)state;
  unsetenv("TD_RPC_SECRET");
  unsetenv("TD_RPC_SECRET_FILE");
  unsetenv("TD_RPC_INSECURE");
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:1";
  o.init_timeout_ms = 500;
  td_rpc_agent *a = NULL;
  unsetenv("SLURM_JOB_ID");
  unsetenv("OMPI_COMM_WORLD_RANK");
  assert_int_equal(td_rpc_init("w0", 0, 2, &o, &a), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "TD_RPC_SECRET"));
  assert_non_null(strstr(td_last_error(), "tdistrun"));
  assert_null(a);
  /* under srun and mpirun the message gives the line to paste, in that launcher's words */
  setenv("SLURM_JOB_ID", "4242", 1);
  assert_int_equal(td_rpc_init("w0", 0, 2, &o, &a), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "export TD_RPC_SECRET=$(head -c 32 /dev/urandom"));
  assert_non_null(strstr(td_last_error(), "before srun"));
  unsetenv("SLURM_JOB_ID");
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  assert_int_equal(td_rpc_init("w0", 0, 2, &o, &a), TD_ERR_AUTH);
  assert_non_null(strstr(td_last_error(), "mpirun -x TD_RPC_SECRET"));
  unsetenv("OMPI_COMM_WORLD_RANK");
  assert_null(a);
  /* a world of one needs none */
  o.init_method = "tcp://127.0.0.1:0";
  TD_ASSERT_OK(td_rpc_init("w0", 0, 1, &o, &a));
  TD_ASSERT_OK(td_rpc_shutdown(a, true, 10000));
  td_rpc_destroy(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_auth_handshake_proves_both_ends),
      cmocka_unit_test(test_auth_handshake_refuses_other_secret),
      cmocka_unit_test(test_auth_handshake_detects_tampering),
      cmocka_unit_test(test_auth_handshake_proof_not_replayable),
      cmocka_unit_test(test_auth_handshake_checks_shape_and_ranks),
      cmocka_unit_test(test_auth_hello_ticket_proves_membership),
      cmocka_unit_test(test_auth_secret_rules),
      cmocka_unit_test(test_auth_store_session_round_trip_and_replay),
      cmocka_unit_test(test_auth_store_window_accepts_reordering),
      cmocka_unit_test(test_auth_store_reopens_forgotten_session),
      cmocka_unit_test(test_auth_store_table_bounded_members_kept),
      cmocka_unit_test(test_auth_store_sessions_follow_the_group),
      cmocka_unit_test(test_auth_agent_needs_a_secret),
  };
  return cmocka_run_group_tests_name("auth", tests, NULL, NULL);
}
