/* test_netaddr.c - Slurm node-list expansion, job-derived ports, TD_SOCKET_IFNAME matching over
 * made-up interface lists, and a real listen-address choice on loopback (core/netaddr.c). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "core/netaddr.h"
#include "test_util.h"

/* expect_hosts expands list and compares with the space-separated names in want. */
static void expect_hosts(const char *list, const char *want) {
  char **h = NULL;
  size_t n = 0;
  td_status st = td__slurm_expand(list, &h, &n);
  if (st != TD_OK) fail_msg("'%s': %s: %s", list, td_status_name(st), td_last_error());
  char got[4096] = "";
  size_t gl = 0;
  for (size_t i = 0; i < n; i++)
    gl += (size_t)snprintf(got + gl, sizeof got - gl, "%s%s", i ? " " : "", h[i]);
  if (strcmp(got, want) != 0) fail_msg("'%s' expanded to '%s', expected '%s'", list, got, want);
  /* the first host agrees with the full expansion */
  char first[TD__SLURM_MAX_NAME];
  TD_ASSERT_OK(td__slurm_first_host(list, first, sizeof first));
  assert_string_equal(first, h[0]);
  td__slurm_hosts_free(h, n);
}

/* expect_invalid checks that list is refused with a message containing needle, and that the
 * outputs stay untouched. */
static void expect_invalid(const char *list, const char *needle) {
  char **h = (char **)0x1;
  size_t n = 77;
  td_status st = td__slurm_expand(list, &h, &n);
  if (st != TD_ERR_INVALID)
    fail_msg("'%s' gave %s, expected TD_ERR_INVALID", list ? list : "(null)", td_status_name(st));
  if (!strstr(td_last_error(), needle))
    fail_msg("'%s': message '%s' lacks '%s'", list ? list : "(null)", td_last_error(), needle);
  assert_true(h == (char **)0x1 && n == 77);
  char first[64] = "untouched";
  assert_int_equal(td__slurm_first_host(list, first, sizeof first), TD_ERR_INVALID);
  assert_string_equal(first, "untouched");
}

static void test_slurm_expand_issue_examples(void **state) {
  (void)state;
  expect_hosts("h[1-3]", "h1 h2 h3");
  expect_hosts("gpu[01-04,07]", "gpu01 gpu02 gpu03 gpu04 gpu07");
  expect_hosts("a1,b[2-3]", "a1 b2 b3");
}

static void test_slurm_expand_forms(void **state) {
  (void)state;
  expect_hosts("vm", "vm");
  expect_hosts("node-1.cluster", "node-1.cluster");
  expect_hosts("a,b,c", "a b c");
  expect_hosts("h[5]", "h5");
  expect_hosts("h[007]", "h007");
  expect_hosts("n[8-11]", "n8 n9 n10 n11");
  expect_hosts("n[08-11]", "n08 n09 n10 n11");
  expect_hosts("n[098-101]", "n098 n099 n100 n101");
  expect_hosts("n[9-10]x", "n9x n10x");
  expect_hosts("[1-2]", "1 2");
  expect_hosts("r[1-2]n[1-2]", "r1n1 r1n2 r2n1 r2n2");
  expect_hosts("a[1,3],b,c[10-11,2]", "a1 a3 b c10 c11 c2");
  expect_hosts("x[1-2],x[1-2]", "x1 x2 x1 x2"); /* duplicates are kept, order too */
  expect_hosts("gpu-[0-1]-ib", "gpu-0-ib gpu-1-ib");
  expect_hosts("h[0-0]", "h0");
}

static void test_slurm_expand_large(void **state) {
  (void)state;
  char **h;
  size_t n;
  TD_ASSERT_OK(td__slurm_expand("c[00000-65535]", &h, &n));
  assert_int_equal(n, 65536);
  assert_string_equal(h[0], "c00000");
  assert_string_equal(h[12345], "c12345");
  assert_string_equal(h[65535], "c65535");
  td__slurm_hosts_free(h, n);
  td__slurm_hosts_free(NULL, 0);
  char first[32];
  TD_ASSERT_OK(td__slurm_first_host("big[0-60000],other", first, sizeof first));
  assert_string_equal(first, "big0");
}

static void test_slurm_expand_errors(void **state) {
  (void)state;
  expect_invalid(NULL, "empty");
  expect_invalid("", "empty");
  expect_invalid("h[1-3", "unbalanced '['");
  expect_invalid("h1-3]", "unbalanced ']'");
  expect_invalid("h[1-[2]]", "nested");
  expect_invalid("h[3-1]", "reversed range");
  expect_invalid("h[01-04,7-5]", "reversed range");
  expect_invalid("h[]", "empty brackets");
  expect_invalid("h[1-]", "upper bound");
  expect_invalid("h[-1]", "expected a number");
  expect_invalid("h[a-b]", "expected a number");
  expect_invalid("h[1,]", "empty element");
  expect_invalid("h[1,,2]", "expected a number");
  expect_invalid("h[1;2]", "unexpected character");
  expect_invalid("h[1234567890]", "at most 9 digits");
  expect_invalid("a,,b", "empty host name");
  expect_invalid(",a", "empty host name");
  expect_invalid("a,", "empty host name");
  expect_invalid("a b", "space");
  expect_invalid("h[0-999999999]", "more than 65536 hosts");
  expect_invalid("h[0-65536]", "more than 65536 hosts");
  expect_invalid("a[0-999]b[0-999]", "more than 65536 hosts");
  expect_invalid("a[0-40000],b[0-40000]", "more than 65536 hosts");
  expect_invalid("a[1]b[1]c[1]d[1]e[1]f[1]g[1]h[1]i[1]", "more than 8 bracket groups");
  char longname[400];
  memset(longname, 'x', 300);
  strcpy(longname + 300, "[1-2]");
  expect_invalid(longname, "longer than 255");
  /* the error names the position */
  assert_int_equal(td__slurm_first_host("ok,h[3-1]", (char[8]){0}, 8), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "position"));
  assert_non_null(strstr(td_last_error(), "'ok,h[3-1]'"));
}

static void test_slurm_first_host_small_buffer(void **state) {
  (void)state;
  char out[4] = "abc";
  assert_int_equal(td__slurm_first_host("node[01-02]", out, sizeof out), TD_ERR_INVALID);
  assert_string_equal(out, "abc");
  char ok[7];
  TD_ASSERT_OK(td__slurm_first_host("node[01-02]", ok, sizeof ok));
  assert_string_equal(ok, "node01");
}

/* Open MPI jobs: a hashed port, the same for the same job, in the range, spread out. */
static void test_job_port_derivation(void **state) {
  (void)state;
  assert_int_equal(td__job_port("1124597761"), td__job_port("1124597761"));
  assert_int_equal(td__job_port(""), 20000 + (int)(2166136261u % 12000));
  int same = 0;
  for (int j = 0; j < 1000; j++) {
    char a[32], b[32];
    snprintf(a, sizeof a, "%d", 1124597761 + (j << 16));
    snprintf(b, sizeof b, "prterun-host-%d@1", j);
    int pa = td__job_port(a), pb = td__job_port(b);
    assert_true(pa >= 20000 && pa < 32000 && pb >= 20000 && pb < 32000);
    same += pa == td__job_port(a + 1);
  }
  assert_true(same < 5);
}

static void test_slurm_port_derivation(void **state) {
  (void)state;
  int p = -1;
  TD_ASSERT_OK(td__slurm_port("0", &p));
  assert_int_equal(p, 20000);
  TD_ASSERT_OK(td__slurm_port("12345", &p));
  assert_int_equal(p, 20000 + 12345 % 12000);
  TD_ASSERT_OK(td__slurm_port("11999", &p));
  assert_int_equal(p, 31999);
  TD_ASSERT_OK(td__slurm_port("18446744073709551615", &p)); /* 2^64-1: no overflow */
  assert_int_equal(p, 20000 + (int)(18446744073709551615ull % 12000));
  /* consecutive jobs get different ports, all in range and below the ephemeral range */
  for (int j = 1000; j < 1000 + 12000; j += 7) {
    char id[16], id2[16];
    int a, b;
    snprintf(id, sizeof id, "%d", j);
    snprintf(id2, sizeof id2, "%d", j + 1);
    TD_ASSERT_OK(td__slurm_port(id, &a));
    TD_ASSERT_OK(td__slurm_port(id2, &b));
    assert_true(a != b);
    assert_true(a >= 20000 && a < 32768);
  }
  p = -1;
  assert_int_equal(td__slurm_port(NULL, &p), TD_ERR_INVALID);
  assert_int_equal(td__slurm_port("", &p), TD_ERR_INVALID);
  assert_int_equal(td__slurm_port("12a", &p), TD_ERR_INVALID);
  assert_int_equal(td__slurm_port("-5", &p), TD_ERR_INVALID);
  assert_int_equal(td__slurm_port(" 5", &p), TD_ERR_INVALID);
  assert_int_equal(td__slurm_port("123456789012345678901", &p), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "SLURM_JOB_ID"));
  assert_int_equal(p, -1);
}

static void test_ifname_match_syntax(void **state) {
  (void)state;
  /* prefixes */
  assert_true(td__ifname_match("eth", "eth0"));
  assert_true(td__ifname_match("eth", "eth"));
  assert_false(td__ifname_match("eth", "veth0"));
  assert_true(td__ifname_match("ib,eth", "eth1"));
  assert_true(td__ifname_match("ib,eth", "ib0"));
  assert_false(td__ifname_match("ib,eth", "lo"));
  assert_true(td__ifname_match("eth0", "eth01")); /* prefix, as NCCL */
  /* exact */
  assert_true(td__ifname_match("=eth0", "eth0"));
  assert_false(td__ifname_match("=eth0", "eth01"));
  assert_false(td__ifname_match("=eth0", "eth"));
  assert_true(td__ifname_match("=eth0,ib0", "ib0"));
  /* exclusion */
  assert_true(td__ifname_match("^docker,lo", "eth0"));
  assert_false(td__ifname_match("^docker,lo", "docker0"));
  assert_false(td__ifname_match("^docker,lo", "lo"));
  assert_false(td__ifname_match("^docker,lo", "loop7"));
  assert_true(td__ifname_match("^=docker0", "docker1"));
  assert_false(td__ifname_match("^=docker0", "docker0"));
  /* empty elements are ignored; a spec with none selects nothing */
  assert_true(td__ifname_match(",eth,,", "eth2"));
  assert_false(td__ifname_match("", "eth0"));
  assert_false(td__ifname_match("^", "eth0"));
  assert_false(td__ifname_match("^=", "eth0"));
  assert_false(td__ifname_match(NULL, "eth0"));
  assert_false(td__ifname_match("eth", NULL));
  assert_true(td__ifname_spec_valid("eth"));
  assert_true(td__ifname_spec_valid("^=lo"));
  assert_false(td__ifname_spec_valid(""));
  assert_false(td__ifname_spec_valid("^"));
  assert_false(td__ifname_spec_valid("^=,,"));
  assert_false(td__ifname_spec_valid(NULL));
}

static const td__ifaddr k_fake[] = {
    {"lo", AF_INET, "127.0.0.1", true, true, false},
    {"lo", AF_INET6, "::1", true, true, false},
    {"docker0", AF_INET, "172.17.0.1", true, false, false},
    {"eth0", AF_INET6, "fe80::1%eth0", true, false, true},
    {"eth0", AF_INET6, "fd00::2", true, false, false},
    {"eth0", AF_INET, "10.0.0.2", true, false, false},
    {"eth1", AF_INET, "10.1.0.2", false, false, false}, /* down */
    {"ib0", AF_INET6, "fd01::2", true, false, false},
};
#define N_FAKE (sizeof k_fake / sizeof k_fake[0])

static void expect_pick(const char *spec, int prefer, const char *want_addr,
                        const char *want_if) {
  char addr[64] = "", name[16] = "";
  td_status st = td__ifaddr_pick(spec, k_fake, N_FAKE, prefer, addr, sizeof addr, name,
                                 sizeof name);
  if (st != TD_OK) fail_msg("pick '%s': %s: %s", spec, td_status_name(st), td_last_error());
  if (strcmp(addr, want_addr) != 0 || strcmp(name, want_if) != 0)
    fail_msg("pick '%s' gave %s (%s), expected %s (%s)", spec, addr, name, want_addr, want_if);
}

static void test_ifaddr_pick_fake_interfaces(void **state) {
  (void)state;
  expect_pick("eth", AF_UNSPEC, "10.0.0.2", "eth0"); /* IPv4 first, link-local never */
  expect_pick("eth", AF_INET6, "fd00::2", "eth0");
  expect_pick("eth", AF_INET, "10.0.0.2", "eth0");
  expect_pick("^docker,lo", AF_UNSPEC, "10.0.0.2", "eth0");
  expect_pick("^docker,lo,eth", AF_UNSPEC, "fd01::2", "ib0"); /* only IPv6 left */
  expect_pick("ib", AF_INET, "fd01::2", "ib0");               /* other family as fallback */
  expect_pick("=lo", AF_UNSPEC, "127.0.0.1", "lo");
  expect_pick("=lo", AF_INET6, "::1", "lo");
  expect_pick("docker,eth", AF_UNSPEC, "172.17.0.1", "docker0"); /* list order within family */
  expect_pick("^=eth0,lo,docker", AF_UNSPEC, "172.17.0.1", "docker0"); /* exact: not a prefix */
  expect_pick("^=eth0,lo,docker0", AF_UNSPEC, "fd01::2", "ib0");      /* eth1 is down */

  char addr[64] = "keep", name[16] = "keep";
  assert_int_equal(td__ifaddr_pick("eth1", k_fake, N_FAKE, AF_UNSPEC, addr, sizeof addr, name,
                                   sizeof name),
                   TD_ERR_NOT_FOUND);
  assert_non_null(strstr(td_last_error(), "'eth1'"));
  assert_non_null(strstr(td_last_error(), "eth1 (down)"));
  assert_non_null(strstr(td_last_error(), "docker0"));
  assert_int_equal(td__ifaddr_pick("=eth", k_fake, N_FAKE, AF_UNSPEC, addr, sizeof addr, NULL, 0),
                   TD_ERR_NOT_FOUND);
  assert_int_equal(td__ifaddr_pick("^", k_fake, N_FAKE, AF_UNSPEC, addr, sizeof addr, NULL, 0),
                   TD_ERR_INVALID);
  assert_int_equal(td__ifaddr_pick("eth", NULL, 0, AF_UNSPEC, addr, sizeof addr, NULL, 0),
                   TD_ERR_NOT_FOUND);
  assert_int_equal(td__ifaddr_pick("eth", k_fake, N_FAKE, AF_UNSPEC, addr, 4, NULL, 0),
                   TD_ERR_INVALID);
  assert_string_equal(addr, "keep");
  assert_string_equal(name, "keep");
}

static void test_choose_address_loopback_master(void **state) {
  (void)state;
  char out[64];
  TD_ASSERT_OK(td__choose_address("127.0.0.1", NULL, out, sizeof out));
  assert_string_equal(out, "127.0.0.1");
  TD_ASSERT_OK(td__choose_address("127.0.0.1", "", out, sizeof out)); /* empty spec: unset */
  assert_string_equal(out, "127.0.0.1");
  TD_ASSERT_OK(td__choose_address("127.3.4.5", NULL, out, sizeof out));
  assert_string_equal(out, "127.0.0.1");
  TD_ASSERT_OK(td__choose_address("::1", NULL, out, sizeof out));
  assert_string_equal(out, "::1");
  TD_ASSERT_OK(td__choose_address("localhost", NULL, out, sizeof out));
  assert_true(strcmp(out, "127.0.0.1") == 0 || strcmp(out, "::1") == 0);
  TD_ASSERT_OK(td__choose_address(NULL, NULL, out, sizeof out));
  assert_string_equal(out, "127.0.0.1");
  /* the loopback interface named explicitly */
  TD_ASSERT_OK(td__choose_address("127.0.0.1", "=lo", out, sizeof out));
  assert_string_equal(out, "127.0.0.1");
  /* a spec that matches nothing on this host is an error, not a silent fallback */
  strcpy(out, "keep");
  assert_int_equal(td__choose_address("127.0.0.1", "=no-such-if0", out, sizeof out),
                   TD_ERR_NOT_FOUND);
  assert_non_null(strstr(td_last_error(), "lo"));
  assert_int_equal(td__choose_address("127.0.0.1", "^", out, sizeof out), TD_ERR_INVALID);
  assert_int_equal(td__choose_address("127.0.0.1", NULL, out, 4), TD_ERR_INVALID);
  assert_string_equal(out, "keep");
}

/* A non-loopback master that this host owns: the route toward it leaves from that address. Uses
 * the first non-loopback IPv4 address of an interface that is up, when there is one. */
static void test_choose_address_route_to_own_address(void **state) {
  (void)state;
  char own[64];
  /* any up IPv4 interface that is not loopback */
  if (td__choose_address("127.0.0.1", "^lo", own, sizeof own) != TD_OK ||
      strchr(own, ':') != NULL) {
    skip();
  }
  char out[64];
  TD_ASSERT_OK(td__choose_address(own, NULL, out, sizeof out));
  assert_string_equal(out, own);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_slurm_expand_issue_examples),
      cmocka_unit_test(test_slurm_expand_forms),
      cmocka_unit_test(test_slurm_expand_large),
      cmocka_unit_test(test_slurm_expand_errors),
      cmocka_unit_test(test_slurm_first_host_small_buffer),
      cmocka_unit_test(test_slurm_port_derivation),
      cmocka_unit_test(test_job_port_derivation),
      cmocka_unit_test(test_ifname_match_syntax),
      cmocka_unit_test(test_ifaddr_pick_fake_interfaces),
      cmocka_unit_test(test_choose_address_loopback_master),
      cmocka_unit_test(test_choose_address_route_to_own_address),
  };
  return cmocka_run_group_tests_name("netaddr", tests, NULL, NULL);
}
