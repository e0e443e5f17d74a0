/* test_ring_crypt.c - the encrypted TCP ring (collectives/ring_crypt.c).
 *
 * The record layer alone: records open in order under the connection's key; a flipped bit, a
 * replayed or reordered record, a record sealed under another connection's key fail with
 * TD_ERR_AUTH; the ciphertext does not show the plaintext.
 *
 * Then 3 real workers on the ring (TD_COLL_ALGO=ring) with TD_COLL_ENCRYPT=1: all_reduce,
 * broadcast, all_gather and reduce_scatter of tensors filled with a recognisable pattern are
 * exact, and every byte the ring sent (td__ring_test_sent) is free of the pattern; the same with
 * TD_COLL_ENCRYPT=0 does show it (so the check can fail); and members that disagree about
 * encryption fail to create the group (the setting is bound into the ring key) instead of
 * reading records as data.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "coll_test_util.h"
#include "test_util.h"
#include "collectives/coll_impl.h"
#include "rpc/auth.h"

/* ---- the record layer ---- */

static void pair(const char *secret, uint8_t tweak, td__ring_crypt **seal, td__ring_crypt **open) {
  td__auth k, ring;
  uint8_t nc[TD__AUTH_NONCE], ns[TD__AUTH_NONCE];
  memset(nc, 1, sizeof nc);
  memset(ns, 2, sizeof ns);
  assert_int_equal(td__auth_init(&k, secret, strlen(secret)), TD_OK);
  assert_int_equal(td__auth_derive(&k, "ring", "ctx", 3, &ring), TD_OK);
  assert_int_equal(td__ring_crypt_create(&ring, nc, ns, true, seal), TD_OK);
  ns[0] ^= tweak; /* another connection's nonces: another key */
  assert_int_equal(td__ring_crypt_create(&ring, nc, ns, false, open), TD_OK);
}

static void test_ring_records_detect_tampering_replay_and_foreign_keys(void **state) {
  (void)state;
  td__auth_crypto_init();
  enum { N = 1000 };
  char plain[3][N], got[N];
  uint8_t rec[3][N + TD__RING_TAG];
  td__ring_crypt *seal, *open;
  pair("a job secret of enough length", 0, &seal, &open);
  for (int r = 0; r < 3; r++) {
    for (int i = 0; i < N; i++) plain[r][i] = (char)('a' + (i + r) % 26);
    assert_int_equal(td__ring_seal(seal, plain[r], N, rec[r]), TD_OK);
    assert_null(memmem(rec[r], N, "abcdefgh", 8)); /* the text is not on the wire */
  }
  /* in order: each record opens to its plaintext */
  assert_int_equal(td__ring_open(open, rec[0], sizeof rec[0], got), TD_OK);
  assert_memory_equal(got, plain[0], N);
  /* a replay of record 0 where record 1 belongs fails, and so does record 2 out of order */
  assert_int_equal(td__ring_open(open, rec[0], sizeof rec[0], got), TD_ERR_AUTH);
  td__ring_crypt_destroy(open);
  td__ring_crypt_destroy(seal);

  pair("a job secret of enough length", 0, &seal, &open);
  for (int r = 0; r < 3; r++) assert_int_equal(td__ring_seal(seal, plain[r], N, rec[r]), TD_OK);
  assert_int_equal(td__ring_open(open, rec[0], sizeof rec[0], got), TD_OK);
  assert_int_equal(td__ring_open(open, rec[2], sizeof rec[2], got), TD_ERR_AUTH); /* reordered */
  td__ring_crypt_destroy(open);
  td__ring_crypt_destroy(seal);

  pair("a job secret of enough length", 0, &seal, &open);
  assert_int_equal(td__ring_seal(seal, plain[0], N, rec[0]), TD_OK);
  rec[0][N / 2] ^= 0x10; /* one bit on the way */
  assert_int_equal(td__ring_open(open, rec[0], sizeof rec[0], got), TD_ERR_AUTH);
  td__ring_crypt_destroy(open);
  td__ring_crypt_destroy(seal);

  pair("a job secret of enough length", 1, &seal, &open); /* another connection's key */
  assert_int_equal(td__ring_seal(seal, plain[0], N, rec[0]), TD_OK);
  assert_int_equal(td__ring_open(open, rec[0], sizeof rec[0], got), TD_ERR_AUTH);
  td__ring_crypt_destroy(open);
  td__ring_crypt_destroy(seal);
}

/* ---- the ring ---- */

enum { WORLD = 3, N = 100003 }; /* 800 KB: several records per step, uneven chunks */
#define PATTERN 1234.5678 /* every element of the inputs: 8 recognisable bytes */

static int64_t sent_bytes, pattern_seen;

static void watch(td_process_group *pg, const void *p, size_t n) {
  (void)pg;
  double v = PATTERN;
  sent_bytes += (int64_t)n;
  if (memmem(p, n, &v, sizeof v)) pattern_seen++;
}

static td_tensor *filled(int64_t n) {
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_full(&n, 1, PATTERN, TD_DTYPE_F64, td_device_cpu(), &t));
  return t;
}

static void all_equal(const td_tensor *t, double want) {
  const double *d = td_tensor_data(t);
  for (int64_t i = 0; i < td_tensor_numel(t); i++)
    if (d[i] != want) {
      fprintf(stderr, "element %lld: %.17g, want %.17g\n", (long long)i, d[i], want);
      MP_CHECK(0);
    }
}

/* The four operations on one group; returns after checking their values. */
static void run_ops(td_process_group *pg) {
  td_tensor *t = filled(N);
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  all_equal(t, PATTERN * WORLD);
  td_tensor_unref(t);
  t = filled(N);
  MP_CHECK_OK(td_process_group_broadcast(pg, t, 1));
  all_equal(t, PATTERN);
  td_tensor *whole = NULL;
  int64_t wn = (int64_t)N * WORLD;
  MP_CHECK_OK(td_tensor_empty(&wn, 1, TD_DTYPE_F64, td_device_cpu(), &whole));
  MP_CHECK_OK(td_process_group_all_gather_into_tensor(pg, whole, t));
  all_equal(whole, PATTERN);
  td_tensor *part = filled(N);
  td_tensor_unref(whole);
  whole = filled(wn);
  MP_CHECK_OK(td_process_group_reduce_scatter_tensor(pg, part, whole, TD_REDUCE_SUM));
  all_equal(part, PATTERN * WORLD);
  td_tensor_unref(part);
  td_tensor_unref(whole);
  td_tensor_unref(t);
}

static int worker_ring(int rank, int world, const char *method, void *arg) {
  (void)arg;
  setenv("TD_COLL_ALGO", "ring", 1);
  td_rpc_agent *a = coll_join(rank, world, method);
  td__ring_test_sent = watch;

  setenv("TD_COLL_ENCRYPT", "1", 1);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  sent_bytes = pattern_seen = 0;
  run_ops(pg);
  if (sent_bytes < (int64_t)N * 8 || pattern_seen) {
    fprintf(stderr, "[rank %d] encrypted ring: %lld bytes sent, the pattern in %lld sends\n",
            rank, (long long)sent_bytes, (long long)pattern_seen);
    MP_CHECK(0);
  }
  td_process_group_destroy(pg);

  setenv("TD_COLL_ENCRYPT", "0", 1); /* the check sees clear text when there is some */
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  sent_bytes = pattern_seen = 0;
  run_ops(pg);
  MP_CHECK(pattern_seen > 0);
  td_process_group_destroy(pg);

  /* rank 2 disagrees: nobody reads records as data; creation fails everywhere */
  setenv("TD_COLL_ENCRYPT", rank == 2 ? "1" : "0", 1);
  pg = NULL;
  td_status st = td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 2000, &pg);
  fprintf(stderr, "[rank %d] disagreeing members: %s: %s\n", rank, td_status_name(st),
          td_last_error());
  MP_CHECK(st != TD_OK && pg == NULL);

  td__ring_test_sent = NULL;
  coll_leave(a);
  return 0;
}

static void test_ring_encrypted_hides_data_and_stays_exact(void **state) {
  (void)state;
  TD_MP_RUN(WORLD, worker_ring, NULL, 120);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ring_records_detect_tampering_replay_and_foreign_keys),
      cmocka_unit_test(test_ring_encrypted_hides_data_and_stays_exact),
  };
  return cmocka_run_group_tests_name("ring_crypt", tests, NULL, NULL);
}
