/* test_tls.c - optional mutual TLS: a group whose members carry certificates of the job's CA
 * works (calls, tensors, the store, and a process group whose TCP ring is then encrypted: no
 * byte it sends shows the tensors' values); a worker with a certificate of another CA, or without TLS,
 * cannot join it; half a TLS configuration is refused at once. Certificates are made with the
 * openssl command line tool (skipped without it). */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "mp_util.h"
#include "tdist/tdist.h"
#include "test_util.h"

/* The ring's test hook (collectives/ring.c): every byte it sends to the right. */
extern void (*td__ring_test_sent)(td_process_group *pg, const void *p, size_t n);
static long ring_sent, ring_clear;
static void watch_ring(td_process_group *pg, const void *p, size_t n) {
  (void)pg;
  float v = 1.5f;
  ring_sent += (long)n;
  if (memmem(p, n, &v, sizeof v)) ring_clear++;
}

static char dir[64];
static char good_cert[128], good_key[128], ca[128], rogue_cert[128], rogue_key[128];

static td_status echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                      td_future **fut) {
  (void)c;
  (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

/* Makes a CA, and a certificate for the name "tdist" signed by it; another CA signs the rogue
 * certificate. Returns false when openssl is missing or fails. */
static bool make_certs(void) {
  snprintf(dir, sizeof dir, "/tmp/td_tls_XXXXXX");
  if (!mkdtemp(dir)) return false;
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "cd %s && umask 077 && "
           "printf 'subjectAltName=DNS:tdist\\n' > ext && "
           "for who in ca rogue_ca; do openssl req -x509 -newkey rsa:2048 -nodes -days 2 "
           "-subj /CN=$who -keyout $who.key -out $who.pem; done && "
           "for who in good rogue; do openssl req -newkey rsa:2048 -nodes -subj /CN=tdist "
           "-keyout $who.key -out $who.csr; done && "
           "openssl x509 -req -in good.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
           "-extfile ext -out good.pem && "
           "openssl x509 -req -in rogue.csr -CA rogue_ca.pem -CAkey rogue_ca.key "
           "-CAcreateserial -days 2 -extfile ext -out rogue.pem",
           dir);
  snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " > %s/openssl.log 2>&1", dir);
  if (system(cmd) != 0) return false;
  snprintf(good_cert, sizeof good_cert, "%s/good.pem", dir);
  snprintf(good_key, sizeof good_key, "%s/good.key", dir);
  snprintf(ca, sizeof ca, "%s/ca.pem", dir);
  snprintf(rogue_cert, sizeof rogue_cert, "%s/rogue.pem", dir);
  snprintf(rogue_key, sizeof rogue_key, "%s/rogue.key", dir);
  return true;
}

static int setup(void **state) {
  (void)state;
  if (system("command -v openssl > /dev/null 2>&1") != 0 || !make_certs()) {
    dir[0] = 0;
    return 0;
  }
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (dir[0]) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) return -1;
  }
  return 0;
}

typedef struct tls_case {
  const char *cert1, *key1; /* rank 1's certificate and key (NULL: no TLS on rank 1) */
  bool expect_ok;
} tls_case;

static int worker_tls(int rank, int world, const char *method, void *arg) {
  const tls_case *k = arg;
  MP_CHECK_OK(td_rpc_register("echo", echo, NULL));
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = method;
  o.init_timeout_ms = k->expect_ok ? (int64_t)(30000 * td_test_timeout_scale()) : 4000;
  if (rank == 0) {
    o.tls_cert_file = good_cert;
    o.tls_key_file = good_key;
    o.tls_ca_file = ca;
  } else if (k->cert1) {
    o.tls_cert_file = k->cert1;
    o.tls_key_file = k->key1;
    o.tls_ca_file = ca;
  }
  td_rpc_agent *a = NULL;
  td_status st = td_rpc_init(NULL, rank, world, &o, &a);
  if (!k->expect_ok) {
    fprintf(stderr, "rank %d init: %s: %s\n", rank, td_status_name(st), td_last_error());
    MP_CHECK(st != TD_OK);
    return 0;
  }
  MP_CHECK_OK(st);
  char peer[32];
  snprintf(peer, sizeof peer, "worker%d", 1 - rank);
  int64_t shape[1] = {100000};
  td_tensor *t;
  MP_CHECK_OK(td_tensor_full(shape, 1, 1.5, TD_DTYPE_F32, td_device_cpu(), &t));
  td_value *v = td_value_tensor(t), *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, peer, "echo", &v, 1, NULL, &r));
  MP_CHECK(td_value_equal(v, r));
  td_value_unref(r);
  td_value_unref(v);
  /* a process group of TLS workers encrypts its ring (TD_COLL_ALGO=ring: not shared memory) */
  setenv("TD_COLL_ALGO", "ring", 1);
  td__ring_test_sent = watch_ring;
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  MP_CHECK_OK(td_process_group_all_reduce(pg, t, TD_REDUCE_SUM));
  for (int64_t i = 0; i < shape[0]; i++) MP_CHECK(((const float *)td_tensor_data(t))[i] == 3.0f);
  MP_CHECK(ring_sent >= shape[0] * 2 && ring_clear == 0);
  td_process_group_destroy(pg);
  td__ring_test_sent = NULL;
  td_tensor_unref(t);
  MP_CHECK_OK(td_rpc_shutdown(a, true, (int64_t)(30000 * td_test_timeout_scale())));
  td_rpc_destroy(a);
  return 0;
}

static void run_case(const tls_case *k) {
  int codes[2];
  int fails = td_mp_run(2, worker_tls, (void *)k, 90, codes);
  if (fails) fail_msg("%d workers failed (codes %d %d)", fails, codes[0], codes[1]);
}

static void test_tls_group_of_one_ca_works(void **state) {
  (void)state;
  if (!dir[0]) skip();
  tls_case k = {good_cert, good_key, true};
  run_case(&k);
}

static void test_tls_other_ca_cannot_join(void **state) {
  (void)state;
  if (!dir[0]) skip();
  tls_case k = {rogue_cert, rogue_key, false};
  run_case(&k);
}

static void test_tls_plain_worker_cannot_join(void **state) {
  (void)state;
  if (!dir[0]) skip();
  tls_case k = {NULL, NULL, false};
  run_case(&k);
}

static void test_tls_half_configuration_refused(void **state) {
  (void)state;
  if (!dir[0]) skip();
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_method = "tcp://127.0.0.1:0";
  o.tls_cert_file = good_cert;
  td_rpc_agent *a = NULL;
  assert_int_equal(td_rpc_init("w", 0, 1, &o, &a), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "1 of 3"));
  /* a private key others can read is refused */
  o.tls_key_file = good_key;
  o.tls_ca_file = ca;
  assert_int_equal(chmod(good_key, 0644), 0);
  assert_int_not_equal(td_rpc_init("w", 0, 1, &o, &a), TD_OK);
  assert_non_null(strstr(td_last_error(), "chmod 600"));
  assert_int_equal(chmod(good_key, 0600), 0);
  TD_ASSERT_OK(td_rpc_init("w", 0, 1, &o, &a));
  TD_ASSERT_OK(td_rpc_shutdown(a, true, 10000));
  td_rpc_destroy(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tls_group_of_one_ca_works),
      cmocka_unit_test(test_tls_other_ca_cannot_join),
      cmocka_unit_test(test_tls_plain_worker_cannot_join),
      cmocka_unit_test(test_tls_half_configuration_refused),
  };
  return cmocka_run_group_tests_name("tls", tests, setup, teardown);
}
