/* ring_crypt.c - the TCP ring's encrypted records (when the agent runs with TLS, or
 * TD_COLL_ENCRYPT=1).
 *
 * Each ring connection carries data one way, from the member that opened it (the handshake's
 * client) to its right neighbour. After the handshake both ends derive the connection's key from
 * the group's ring key and the handshake's two fresh nonces, Kc = td__auth_derive(K_ring,
 * "ring data", nonce_c | nonce_s), so a key is never used on two connections. Every exchange
 * step then sends its bytes as records of at most TD__RING_PIECE bytes, each sealed with
 * AES-256-GCM under Kc with the IV 0^4 | counter (big endian, one counter per connection,
 * incremented per record), followed by its 16-byte tag. The receiver opens each record with the
 * next counter value: a modified, injected, reordered or replayed record fails its tag and fails
 * the group (TD_ERR_AUTH naming the left neighbour). Record lengths are not sent: both ends know
 * them from the operation (its header was checked first, itself in a record).
 *
 * Cost: one extra pass over the data on each side (AES-NI runs at several GB/s a core), and
 * steps of at most TD__RING_PIECE bytes each way. Off without TLS: on one host nobody else can
 * read or inject into an established loopback connection (docs/SECURITY.md).
 */
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#include "../rpc/auth.h"
#include "coll_impl.h"

struct td__ring_crypt {
  EVP_CIPHER_CTX *ctx;
  bool seal; /* this end seals (the sender) or opens */
  uint64_t counter;
};

td_status td__ring_crypt_create(const struct td__auth *ring_key, const uint8_t *nonce_c,
                                const uint8_t *nonce_s, bool seal, td__ring_crypt **out) {
  uint8_t ctx[2 * TD__AUTH_NONCE];
  memcpy(ctx, nonce_c, TD__AUTH_NONCE);
  memcpy(ctx + TD__AUTH_NONCE, nonce_s, TD__AUTH_NONCE);
  td__auth k;
  TD_TRY(td__auth_derive(ring_key, "ring data", ctx, sizeof ctx, &k));
  td__ring_crypt *c = td__calloc(1, sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "process group: out of memory");
  c->seal = seal;
  c->ctx = EVP_CIPHER_CTX_new();
  uint8_t iv[12] = {0};
  bool ok = c->ctx != NULL;
  if (ok && seal) ok = EVP_EncryptInit_ex(c->ctx, EVP_aes_256_gcm(), NULL, k.key, iv) == 1;
  if (ok && !seal) ok = EVP_DecryptInit_ex(c->ctx, EVP_aes_256_gcm(), NULL, k.key, iv) == 1;
  memset(&k, 0, sizeof k);
  if (!ok) {
    td__ring_crypt_destroy(c);
    return td_set_error(TD_ERR_INTERNAL, "process group: AES-256-GCM unavailable in libcrypto");
  }
  *out = c;
  return TD_OK;
}

void td__ring_crypt_destroy(td__ring_crypt *c) {
  if (!c) return;
  EVP_CIPHER_CTX_free(c->ctx);
  td__free(c);
}

static void next_iv(td__ring_crypt *c, uint8_t iv[12]) {
  uint64_t k = c->counter++;
  memset(iv, 0, 4);
  for (int i = 0; i < 8; i++) iv[4 + i] = (uint8_t)(k >> (56 - 8 * i));
}

td_status td__ring_seal(td__ring_crypt *c, const void *in, size_t n, uint8_t *out) {
  uint8_t iv[12];
  int len = 0;
  next_iv(c, iv);
  if (n > TD__RING_PIECE || !c->seal || EVP_EncryptInit_ex(c->ctx, NULL, NULL, NULL, iv) != 1 ||
      (n && EVP_EncryptUpdate(c->ctx, out, &len, in, (int)n) != 1) ||
      EVP_EncryptFinal_ex(c->ctx, out + len, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(c->ctx, EVP_CTRL_GCM_GET_TAG, TD__RING_TAG, out + n) != 1)
    return td_set_error(TD_ERR_INTERNAL, "process group: sealing a ring record failed");
  return TD_OK;
}

td_status td__ring_open(td__ring_crypt *c, const uint8_t *in, size_t n, void *out) {
  uint8_t iv[12], tag[TD__RING_TAG];
  int len = 0;
  if (n < TD__RING_TAG || n - TD__RING_TAG > TD__RING_PIECE || c->seal)
    return td_set_error(TD_ERR_INTERNAL, "process group: a ring record of %zu bytes", n);
  size_t m = n - TD__RING_TAG;
  memcpy(tag, in + m, sizeof tag);
  next_iv(c, iv);
  if (EVP_DecryptInit_ex(c->ctx, NULL, NULL, NULL, iv) != 1 ||
      (m && EVP_DecryptUpdate(c->ctx, out, &len, in, (int)m) != 1) ||
      EVP_CIPHER_CTX_ctrl(c->ctx, EVP_CTRL_GCM_SET_TAG, TD__RING_TAG, tag) != 1)
    return td_set_error(TD_ERR_INTERNAL, "process group: opening a ring record failed");
  if (EVP_DecryptFinal_ex(c->ctx, (uint8_t *)out + len, &len) != 1)
    return td_set_error(TD_ERR_AUTH, "a ring record failed its authentication tag (modified, "
                        "injected, reordered or replayed)");
  return TD_OK;
}
