/* fuzz_auth.c - libFuzzer target for everything a process without the job secret can send:
 * the stream handshake (both ends) and the store's session layer, plus the store protocol behind
 * it (what a member can send).
 *
 * Input: a selector byte, then messages, each preceded by its length (one byte). Modes:
 *   0  server handshake: the first message as a HELLO, the second as a PROOF
 *   1  client handshake: a HELLO is made, the first message is taken as the server's CHALLENGE
 *   2  store sessions: every message is served by the session layer in turn
 *   3  store protocol: every message is a store request body from a member
 * Oracles besides the sanitizers: with a secret, no input may complete a handshake (a valid
 * HMAC-SHA256 without the key) and no store request may reach the store; the store stays within
 * its limits whatever members send.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/auth.h"
#include "rpc/store.h"

#define FUZZ_CHECK(cond)                                                           \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);     \
      abort();                                                                     \
    }                                                                              \
  } while (0)

static const char *SECRET = "fuzzing-secret-0123456789";

/* Splits the input into at most n messages. */
static int split(const uint8_t *p, size_t len, const uint8_t **msg, size_t *mlen, int n) {
  int k = 0;
  while (len > 0 && k < n) {
    size_t l = p[0];
    p++;
    len--;
    if (l > len) l = len;
    msg[k] = p;
    mlen[k++] = l;
    p += l;
    len -= l;
  }
  return k;
}

static int body_calls;

static td_status count_body(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                            size_t *reply_len) {
  (void)ctx;
  (void)req;
  (void)len;
  body_calls++;
  *reply = td__malloc(1);
  *reply_len = 0;
  return *reply ? TD_OK : TD_ERR_NOMEM;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  int mode = data[0] & 3;
  bool secure = (data[0] & 4) == 0;
  td__auth a;
  FUZZ_CHECK(td__auth_init(&a, secure ? SECRET : NULL, secure ? strlen(SECRET) : 0) == TD_OK);
  const uint8_t *msg[64];
  size_t mlen[64];
  int n = split(data + 1, size - 1, msg, mlen, 64);
  uint8_t out[TD__HS_MAX_LEN];
  switch (mode) {
    case 0: {
      td__hs h;
      if (n < 1 || td__hs_server_hello(&h, &a, 0, msg[0], mlen[0], out) != TD_OK) break;
      int rank = -1;
      td_status st = n >= 2 ? td__hs_server_proof(&h, msg[1], mlen[1], &rank) : TD_ERR_AUTH;
      if (secure) FUZZ_CHECK(st != TD_OK);
      break;
    }
    case 1: {
      td__hs h;
      FUZZ_CHECK(td__hs_client_hello(&h, &a, 1, 0, out) == TD_OK);
      if (n < 1) break;
      td_status st = td__hs_client_challenge(&h, msg[0], mlen[0], out);
      if (secure) FUZZ_CHECK(st != TD_OK);
      break;
    }
    case 2: {
      td__auth_sessions *s;
      FUZZ_CHECK(td__auth_sessions_create(&a, 4, &s) == TD_OK);
      body_calls = 0;
      for (int i = 0; i < n; i++) {
        uint8_t *rep = NULL;
        size_t rl = 0;
        if (td__auth_store_serve(s, msg[i], mlen[i], count_body, NULL, &rep, &rl) == TD_OK)
          td__free(rep);
      }
      if (secure) FUZZ_CHECK(body_calls == 0);
      td__auth_sessions_destroy(s);
      break;
    }
    default: {
      td__store *st;
      FUZZ_CHECK(td__store_create(&st) == TD_OK);
      for (int i = 0; i < n; i++) {
        uint8_t *rep = NULL;
        size_t rl = 0;
        if (td__store_handle(st, msg[i], mlen[i], &rep, &rl) == TD_OK) td__free(rep);
      }
      td__store_destroy(st);
      break;
    }
  }
  return 0;
}
