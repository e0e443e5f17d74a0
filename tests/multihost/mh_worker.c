/* mh_worker.c - one RPC worker of the multi-host test (test_multihost_rpc.sh), run inside one
 * fake host (network namespace) each.
 *
 * Joins the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR = host 1's address,
 * MASTER_PORT), listening on the address td__choose_address picks (TD_SOCKET_IFNAME, else the
 * route toward MASTER_ADDR), calls add on every other worker, checks every worker advertises a
 * non-loopback address, and shuts down gracefully. Exits 0 and prints "mh_worker rank R: OK"
 * on success; prints the failure and exits 1 otherwise.
 *
 * Environment read besides the rendezvous variables:
 *   MH_EXPECT_ADDR  the address this worker must end up listening on (checked when set)
 *   MH_TIMEOUT_S    bound for init and shutdown, seconds (default 30)
 *
 * Until td_rpc_init chooses the listen address itself, this program calls td__choose_address
 * and passes the result as td_rpc_options.listen_addr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/netaddr.h"
#include "test_fns.h"
#include "tdist/rpc.h"

#define CHECK_OK(expr)                                                                       \
  do {                                                                                       \
    td_status st_ = (expr);                                                                  \
    if (st_ != TD_OK) {                                                                      \
      fprintf(stderr, "mh_worker rank %d: %s failed: %s: %s\n", g_rank, #expr,               \
              td_status_name(st_), td_last_error());                                         \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

#define CHECK(cond, ...)                                                                     \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "mh_worker rank %d: check failed (%s): ", g_rank, #cond);              \
      fprintf(stderr, __VA_ARGS__);                                                          \
      fputc('\n', stderr);                                                                   \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

static int g_rank = -1;

/* host_of copies the host part of "host:port" or "[v6]:port". */
static void host_of(const char *address, char *out, size_t n) {
  const char *b = address, *e = strrchr(address, ':');
  if (*b == '[') {
    b++;
    e = strchr(b, ']');
  }
  size_t l = e ? (size_t)(e - b) : strlen(b);
  if (l >= n) l = n - 1;
  memcpy(out, b, l);
  out[l] = '\0';
}

static int run(void) {
  const char *rs = getenv("RANK");
  g_rank = rs ? atoi(rs) : -1;
  const char *ts = getenv("MH_TIMEOUT_S");
  int64_t timeout_ms = (ts ? atoll(ts) : 30) * 1000;
  CHECK_OK(td_rpc_register("add", td_test_fn_add, NULL));

  td_rpc_options o;
  td_rpc_options_init(&o); /* listen_addr NULL: init picks it (TD_SOCKET_IFNAME, else the route) */
  o.init_timeout_ms = timeout_ms;
  o.rpc_timeout_ms = timeout_ms;
  o.num_worker_threads = 2;
  td_rpc_agent *a = NULL;
  CHECK_OK(td_rpc_init_from_env(NULL, &o, &a));
  int rank = td_rpc_rank(a), world = td_rpc_world_size(a);
  CHECK(rank == g_rank, "agent rank %d, RANK %d", rank, g_rank);

  td_worker_info self;
  CHECK_OK(td_rpc_self(a, &self));
  char host[128];
  host_of(self.address, host, sizeof host);
  const char *want = getenv("MH_EXPECT_ADDR");
  CHECK(!want || strcmp(host, want) == 0, "listening on %s, expected %s", self.address, want);

  for (int r = 0; r < world; r++) {
    if (r == rank) continue;
    td_worker_info wi;
    CHECK_OK(td_rpc_get_worker_info_by_rank(a, r, &wi));
    host_of(wi.address, host, sizeof host);
    CHECK(strncmp(host, "127.", 4) != 0 && strcmp(host, "::1") != 0,
          "%s advertises loopback address %s", wi.name, wi.address);
    td_value *args[2] = {td_value_int(rank), td_value_int(1000 * r)};
    td_value *res = NULL;
    td_status st = td_rpc_sync(a, wi.name, "add", args, 2, NULL, &res);
    td_value_unref(args[0]);
    td_value_unref(args[1]);
    CHECK_OK(st);
    int64_t v = -1;
    td_value_as_int(res, &v);
    td_value_unref(res);
    CHECK(v == rank + 1000 * r, "add on %s gave %lld", wi.name, (long long)v);
    printf("mh_worker rank %d: add on %s (%s) = %lld\n", rank, wi.name, wi.address,
           (long long)v);
  }
  CHECK_OK(td_rpc_shutdown(a, true, timeout_ms));
  td_rpc_destroy(a);
  printf("mh_worker rank %d: OK (listened on %s)\n", rank, self.address);
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  return run();
}
