/* test_rpc_calls.c - multi-process tests of calls: sync/async, values and tensors, self and
 * nested calls, remote errors, unknown functions, timeouts, 1000 concurrent calls, a 20-hop chain
 * of async handlers on 4-thread pools; the same-host lane (order across the switch, options) and
 * the completions of one pass over it (a callback that blocks does not hold up the others); one
 * stream serving a pair both ways. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "rpc_test_fns.h"
#include "test_util.h"

static int64_t as_int(td_value *v) {
  int64_t x = -999;
  MP_CHECK_OK(td_value_as_int(v, &x));
  return x;
}

static int worker_calls(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    /* worker infos */
    td_worker_info wi;
    MP_CHECK_OK(td_rpc_get_worker_info(a, "worker2", &wi));
    MP_CHECK(wi.id == 2);
    MP_CHECK_OK(td_rpc_get_worker_info_by_rank(a, 1, &wi));
    MP_CHECK(strcmp(wi.name, "worker1") == 0);
    MP_CHECK_OK(td_rpc_self(a, &wi));
    MP_CHECK(wi.id == 0 && strcmp(wi.name, "worker0") == 0);
    MP_CHECK(td_rpc_get_worker_info(a, "nobody", &wi) == TD_ERR_NOT_FOUND);

    /* a nested value with tensors round-trips */
    td_value *d = td_value_dict(), *l = td_value_list();
    int64_t shape[2] = {3, 4};
    td_tensor *t, *e;
    MP_CHECK_OK(td_tensor_full(shape, 2, 1.5, TD_DTYPE_F32, td_device_cpu(), &t));
    MP_CHECK_OK(td_tensor_zeros(NULL, 0, TD_DTYPE_I64, td_device_cpu(), &e));
    MP_CHECK_OK(td_value_list_append(l, td_value_tensor(t)));
    MP_CHECK_OK(td_value_list_append(l, td_value_string("hello")));
    MP_CHECK_OK(td_value_list_append(l, td_value_bytes("\0\1\2", 3)));
    MP_CHECK_OK(td_value_list_append(l, td_value_tensor(e)));
    MP_CHECK_OK(td_value_dict_set(d, "list", l));
    MP_CHECK_OK(td_value_dict_set(d, "pi", td_value_double(3.25)));
    MP_CHECK_OK(td_value_dict_set(d, "none", td_value_none()));
    MP_CHECK_OK(td_value_dict_set(d, "yes", td_value_bool(true)));
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &d, 1, NULL, &r));
    MP_CHECK(td_value_equal(r, d));
    td_value_unref(r);
    /* self call */
    MP_CHECK_OK(td_rpc_sync(a, "worker0", "echo", &d, 1, NULL, &r));
    MP_CHECK(td_value_equal(r, d));
    td_value_unref(r);
    td_value_unref(d);
    td_tensor_unref(t);
    td_tensor_unref(e);

    /* arithmetic, caller identity */
    td_value *two[2] = {td_value_int(2), td_value_int(3)};
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "add", two, 2, NULL, &r));
    MP_CHECK(as_int(r) == 5);
    td_value_unref(r);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "whoami", NULL, 0, NULL, &r));
    const char *who;
    MP_CHECK_OK(td_value_as_string(r, &who, NULL));
    MP_CHECK(strcmp(who, "worker0") == 0);
    td_value_unref(r);

    /* TD_RPC_INLINE functions run on the poller thread; a blocking call from one is refused */
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "inline_add", two, 2, NULL, &r));
    MP_CHECK(as_int(r) == 5);
    td_value_unref(r);
    td_value *w1 = td_value_string("worker1");
    MP_CHECK(td_rpc_sync(a, "worker2", "inline_sync", &w1, 1, NULL, &r) == TD_ERR_STATE);
    MP_CHECK(strstr(td_last_error(), "TD_RPC_INLINE") != NULL);
    td_value_unref(w1);
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "add", two, 2, NULL, &r)); /* still serving */
    td_value_unref(r);
    MP_CHECK(td_rpc_register_ex("x", td_test_fn_echo, NULL, 8u) == TD_ERR_INVALID);

    /* remote error: status and message carry the remote worker and the handler's text */
    MP_CHECK(td_rpc_sync(a, "worker1", "fail", NULL, 0, NULL, &r) == TD_ERR_INVALID);
    MP_CHECK(strncmp(td_last_error(), "worker1 (rank 1): ", 18) == 0);
    MP_CHECK(strstr(td_last_error(), "boom 42") != NULL);
    /* wrong argument types fail remotely, not locally */
    td_value *bad[2] = {td_value_string("x"), td_value_int(1)};
    MP_CHECK(td_rpc_sync(a, "worker1", "add", bad, 2, NULL, &r) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    td_value_unref(bad[0]);
    td_value_unref(bad[1]);
    /* unknown function and unknown worker */
    MP_CHECK(td_rpc_sync(a, "worker1", "nope", NULL, 0, NULL, &r) == TD_ERR_NOT_FOUND);
    MP_CHECK(strstr(td_last_error(), "nope") && strstr(td_last_error(), "worker1") &&
             strstr(td_last_error(), "worker0"));
    MP_CHECK(td_rpc_sync(a, "worker9", "echo", NULL, 0, NULL, &r) == TD_ERR_NOT_FOUND);

    /* nested synchronous call inside a handler */
    td_value *to = td_value_string("worker2");
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "nested", &to, 1, NULL, &r));
    MP_CHECK(as_int(r) == 4);
    td_value_unref(r);
    td_value_unref(to);

    /* per-call timeout; the late reply is dropped and the agent keeps working */
    td_value *ms = td_value_int(400);
    td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
    co.timeout_ms = 50;
    double t0 = td_test_now_s();
    MP_CHECK(td_rpc_sync(a, "worker1", "slow", &ms, 1, &co, &r) == TD_ERR_TIMEOUT);
    double el = td_test_now_s() - t0;
    MP_CHECK(el >= 0.045 && el < td_test_s(0.35)); /* fires on time, not long after */
    MP_CHECK(strstr(td_last_error(), "timed out") && strstr(td_last_error(), "worker1"));
    /* default timeout: applies to calls made after the change only */
    td_future *inflight;
    td_value *ms150 = td_value_int(150);
    MP_CHECK_OK(td_rpc_async(a, "worker2", "slow", &ms150, 1, NULL, &inflight));
    td_rpc_set_default_timeout(a, 30);
    MP_CHECK(td_rpc_get_default_timeout(a) == 30);
    MP_CHECK(td_rpc_sync(a, "worker1", "slow", &ms150, 1, NULL, &r) == TD_ERR_TIMEOUT);
    MP_CHECK_OK(td_future_wait(inflight, td_test_ms(5000)));
    td_future_unref(inflight);
    MP_CHECK_OK(td_rpc_set_default_timeout(a, TD_TIMEOUT_DEFAULT)); /* back to the option */
    MP_CHECK(td_rpc_get_default_timeout(a) == td_test_ms(30000));
    MP_CHECK(td_rpc_set_default_timeout(a, -3) == TD_ERR_INVALID);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "slow", &ms150, 1, NULL, &r));
    td_value_unref(r);
    /* the one timeout rule (tdist/timeout.h): ZERO expires at once, other negatives are invalid */
    td_rpc_call_opts zero = TD_RPC_CALL_OPTS_INIT, invalid = TD_RPC_CALL_OPTS_INIT,
                     inf = TD_RPC_CALL_OPTS_INIT;
    zero.timeout_ms = TD_TIMEOUT_ZERO;
    invalid.timeout_ms = -3;
    inf.timeout_ms = TD_TIMEOUT_INFINITE;
    td_future *nf = NULL;
    MP_CHECK(td_rpc_async(a, "worker1", "slow", &ms150, 1, &zero, &nf) == TD_ERR_TIMEOUT && !nf);
    MP_CHECK(td_rpc_async(a, "worker1", "slow", &ms150, 1, &invalid, &nf) == TD_ERR_INVALID && !nf);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "slow", &ms150, 1, &inf, &r));
    td_value_unref(r);
    td_value_unref(ms150);
    td_value_unref(ms);
    td_test_sleep_ms(td_test_ms(400)); /* the dropped reply arrives meanwhile */
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "add", two, 2, NULL, &r));
    MP_CHECK(as_int(r) == 5);
    td_value_unref(r);
    td_value_unref(two[0]);
    td_value_unref(two[1]);

    /* 1000 concurrent async calls */
    enum { N = 1000 };
    td_future **fs = calloc(N, sizeof *fs);
    for (int i = 0; i < N; i++) {
      td_value *args[2] = {td_value_int(i), td_value_int(1000)};
      MP_CHECK_OK(td_rpc_async(a, i % 2 ? "worker1" : "worker2", "add", args, 2, NULL, &fs[i]));
      td_value_unref(args[0]);
      td_value_unref(args[1]);
    }
    MP_CHECK_OK(td_future_wait_all(fs, N, td_test_ms(30000)));
    for (int i = 0; i < N; i++) {
      MP_CHECK(as_int(td_future_value(fs[i])) == i + 1000);
      td_future_unref(fs[i]);
    }
    free(fs);

    /* a 20-hop chain of async handlers around the ring; every pool has 4 threads */
    td_value *hops = td_value_int(20);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "chain", &hops, 1, NULL, &r));
    MP_CHECK(as_int(r) == 20);
    td_value_unref(r);
    td_value_unref(hops);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_calls(void **state) {
  TD_MP_RUN(3, worker_calls, NULL, 90);
}

/* ---- option structs not filled by their initialiser ---- */

static int hits; /* calls of "hits" that ran in this process */

static td_status fn_hits(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  *res = td_value_int(__atomic_add_fetch(&hits, 1, __ATOMIC_RELAXED));
  return TD_OK;
}

static bool says_not_initialised(const char *type, const char *init) {
  char want[160];
  snprintf(want, sizeof want, "%s not initialised: use %s", type, init);
  return strstr(td_last_error(), want) != NULL;
}

static int worker_uninit_opts(int rank, int world, const char *method, void *arg) {
  (void)arg;
  MP_CHECK_OK(td_rpc_register("hits", fn_hits, NULL));
  /* a zeroed td_rpc_options (its 0 ms timeouts) is refused before anything starts */
  td_rpc_options zo;
  memset(&zo, 0, sizeof zo);
  zo.init_method = method;
  td_rpc_agent *a = NULL;
  MP_CHECK(td_rpc_init(NULL, rank, world, &zo, &a) == TD_ERR_INVALID && !a);
  MP_CHECK(says_not_initialised("td_rpc_options", "td_rpc_options_init()"));
  MP_CHECK(td_rpc_init_from_env(NULL, &zo, &a) == TD_ERR_INVALID && !a);
  MP_CHECK(says_not_initialised("td_rpc_options", "td_rpc_options_init()"));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_rpc_stats before, after;
    MP_CHECK_OK(td_rpc_get_stats(a, &before));
    /* zeroed, and written field by field: refused, nothing sent, no future */
    td_rpc_call_opts zeroed = {0}, by_hand = {.timeout_ms = td_test_ms(10000)};
    td_future *f = NULL;
    td_value *r = NULL;
    MP_CHECK(td_rpc_async(a, "worker1", "hits", NULL, 0, &zeroed, &f) == TD_ERR_INVALID && !f);
    MP_CHECK(says_not_initialised("td_rpc_call_opts", "TD_RPC_CALL_OPTS_INIT"));
    MP_CHECK(td_rpc_sync(a, "worker1", "hits", NULL, 0, &zeroed, &r) == TD_ERR_INVALID && !r);
    MP_CHECK(says_not_initialised("td_rpc_call_opts", "TD_RPC_CALL_OPTS_INIT"));
    MP_CHECK(td_rpc_sync(a, "worker1", "hits", NULL, 0, &by_hand, &r) == TD_ERR_INVALID && !r);
    MP_CHECK(says_not_initialised("td_rpc_call_opts", "TD_RPC_CALL_OPTS_INIT"));
    MP_CHECK_OK(td_rpc_get_stats(a, &after));
    MP_CHECK(after.calls_started == before.calls_started);
    /* initialised (the macro, then the function): the calls run, the first is the first there */
    td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
    co.timeout_ms = td_test_ms(10000);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "hits", NULL, 0, &co, &r));
    int64_t n = 0;
    MP_CHECK_OK(td_value_as_int(r, &n));
    MP_CHECK(n == 1);
    td_value_unref(r);
    td_rpc_call_opts_init(&co);
    MP_CHECK(co.timeout_ms == TD_TIMEOUT_DEFAULT);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "hits", NULL, 0, &co, &r));
    MP_CHECK_OK(td_value_as_int(r, &n));
    MP_CHECK(n == 2);
    td_value_unref(r);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

/* td_rpc_options and td_rpc_call_opts not filled by their initialisers (`{0}`, memset, fields
 * set by hand) are refused with a message naming the initialiser, before anything is sent; the
 * initialised ones work. */
static void test_rpc_uninitialised_options_refused(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_uninit_opts, NULL, 90);
}

/* ---- busy polling: the option, the environment override and the automatic choice ---- */

typedef struct bp_case {
  int64_t option;   /* td_rpc_options.busy_poll_us */
  const char *env;  /* TD_RPC_BUSY_POLL_US, or NULL */
  const char *cpus; /* TD_CPUS: the CPUs the process may use, as the rule sees them */
  int64_t expect;
} bp_case;

static int worker_busy_poll(int rank, int world, const char *method, void *arg) {
  const bp_case *k = arg;
  register_test_fns();
  if (k->env) setenv("TD_RPC_BUSY_POLL_US", k->env, 1);
  else unsetenv("TD_RPC_BUSY_POLL_US");
  setenv("TD_CPUS", k->cpus, 1);
  td_rpc_options o = td_mp_rpc_options(method, 4);
  o.busy_poll_us = k->option;
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  MP_CHECK(td_rpc_busy_poll_us(a) == k->expect);
  /* calls work the same either way */
  char peer[32];
  snprintf(peer, sizeof peer, "worker%d", (rank + 1) % world);
  for (int i = 0; i < 200; i++) {
    td_value *x = td_value_int(i), *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, peer, "echo", &x, 1, NULL, &r));
    MP_CHECK(as_int(r) == i);
    td_value_unref(r);
    td_value_unref(x);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_busy_poll(void **state) {
  /* explicit settings win; the automatic rule spins only when the local workers fit the CPUs
   * and there is more than one */
  const bp_case cases[] = {{0, NULL, "8", 0},   {333, "7", "8", 333}, {-1, "7", "1", 7},
                           {-1, NULL, "2", 50}, {-1, NULL, "1", 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TD_MP_RUN(2, worker_busy_poll, (void *)&cases[i], 60);
  }
  /* the automatic rule counts the workers on this host: 3 need 3 CPUs */
  const bp_case three[] = {{-1, NULL, "2", 0}, {-1, NULL, "3", 50}};
  for (size_t i = 0; i < 2; i++) TD_MP_RUN(3, worker_busy_poll, (void *)&three[i], 60);
}

/* ---- same-host direct copy: on by default between local workers, off by option or
 * environment; tensors arrive intact either way, also when the sender drops them at once. Where
 * workers have mailboxes (the default where the kernel allows them) each pair settles it when
 * it makes its mailbox lane, so a worker knows who reads it once it met them; without (or with
 * TD_RPC_DIRECT_SETTLE=0) every worker probes its host's peers at init; with
 * TD_RPC_DIRECT_SETTLE=1 dialled lanes settle it in their handshakes too ---- */

typedef struct dc_case {
  int option;      /* td_rpc_options.direct_copy */
  const char *env; /* TD_RPC_DIRECT_COPY, or NULL */
  bool expect_on;
  const char *lane_kb; /* TD_RPC_LANE_DIRECT_MIN_KB, or NULL (4 MiB) */
  const char *dial;    /* TD_RPC_LANE_DIAL, or NULL (dialled lanes) */
  bool settle;         /* TD_RPC_DIRECT_SETTLE=1: settled in the dialled lanes' handshakes */
  const char *mbox;    /* TD_RPC_MAILBOX, or NULL (mailboxes where the kernel allows them) */
} dc_case;

/* Yama's ptrace scope (0 without Yama; 1 when unreadable). */
static int yama_scope(void) {
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (!f) return 0;
  int scope = 1;
  if (fscanf(f, "%d", &scope) != 1) scope = 1;
  fclose(f);
  return scope;
}

/* Whether workers here get mailboxes by default (no Yama, or its ptrace scope 0). */
static bool mailboxes_here(void) { return yama_scope() == 0; }

/* Whether this machine lets a process read a sibling's memory (Yama ptrace scope 0, or root). */
static bool siblings_readable(void) {
  int scope = yama_scope();
  return scope == 0 || (scope == 1 && geteuid() == 0);
}

static int worker_direct(int rank, int world, const char *method, void *arg) {
  const dc_case *k = arg;
  register_test_fns();
  if (k->env) setenv("TD_RPC_DIRECT_COPY", k->env, 1);
  else unsetenv("TD_RPC_DIRECT_COPY");
  if (k->lane_kb) setenv("TD_RPC_LANE_DIRECT_MIN_KB", k->lane_kb, 1);
  else unsetenv("TD_RPC_LANE_DIRECT_MIN_KB");
  if (k->dial) setenv("TD_RPC_LANE_DIAL", k->dial, 1);
  else unsetenv("TD_RPC_LANE_DIAL");
  if (k->settle) setenv("TD_RPC_DIRECT_SETTLE", "1", 1);
  else unsetenv("TD_RPC_DIRECT_SETTLE");
  if (k->mbox) setenv("TD_RPC_MAILBOX", k->mbox, 1);
  else unsetenv("TD_RPC_MAILBOX");
  td_rpc_options o = td_mp_rpc_options(method, 4);
  o.direct_copy = k->option;
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  bool on = k->expect_on && siblings_readable();
  bool mailbox = mailboxes_here() && !(k->mbox && strcmp(k->mbox, "0") == 0) &&
                 !(k->dial && strcmp(k->dial, "0") == 0);
  bool lazily = k->settle || mailbox;
  int peers = td_rpc_direct_copy_peers(a);
  if (!lazily) MP_CHECK(peers == (on ? world - 1 : 0)); /* probed at init */
  else MP_CHECK(peers >= 0 && peers <= (on ? world - 1 : 0)); /* (a peer may have met us) */
  char peer[32];
  snprintf(peer, sizeof peer, "worker%d", (rank + 1) % world);
  /* one call: the pair meets (with TD_RPC_DIRECT_SETTLE=1 its lane's handshake settles it) */
  td_value *warm = NULL;
  MP_CHECK_OK(td_rpc_sync(a, peer, "echo", NULL, 0, NULL, &warm));
  td_value_unref(warm);
  /* (the handshake's last message, which says the peer reads us, may be handled just after the
   * reply: until then frames go through the ring) */
  if (on) TD_TEST_POLL(td_rpc_direct_copy_peers(a) == world - 1, 10);
  peers = td_rpc_direct_copy_peers(a);
  MP_CHECK(peers == (on ? world - 1 : 0));
  if (mailbox) TD_TEST_POLL(td_rpc_mailbox_lanes(a) == 1, 10);
  MP_CHECK(td_rpc_mailbox_lanes(a) == (mailbox ? 1 : 0)); /* (the path the case takes) */
  /* sizes around the 32 KiB threshold of the stream, one between it and the lane's (4 MiB by
   * default) and one past both; each tensor is dropped right after the call is sent, so only the
   * transport keeps it alive until the peer has copied it */
  int64_t sizes[] = {100, 8191, 8192, 300000, 2000000};
  enum { N = 40 };
  td_future *fs[N];
  double firsts[N];
  for (int i = 0; i < N; i++) {
    int64_t n = sizes[i % 5];
    td_tensor *t;
    MP_CHECK_OK(td_tensor_arange((double)i, (double)i + (double)n, 1, TD_DTYPE_F32, td_device_cpu(),
                                 &t));
    firsts[i] = (double)i;
    td_value *v = td_value_tensor(t);
    td_tensor_unref(t);
    MP_CHECK_OK(td_rpc_async(a, peer, "echo", &v, 1, NULL, &fs[i]));
    td_value_unref(v);
  }
  for (int i = 0; i < N; i++) {
    MP_CHECK_OK(td_future_wait(fs[i], td_test_ms(30000)));
    td_tensor *t;
    MP_CHECK_OK(td_value_as_tensor(td_future_value(fs[i]), &t));
    int64_t n = sizes[i % 5];
    MP_CHECK(td_tensor_numel(t) == n);
    const float *p = td_tensor_data(t);
    for (int64_t j = 0; j < n; j += 997) MP_CHECK(p[j] == (float)(firsts[i] + (double)j));
    MP_CHECK(p[n - 1] == (float)(firsts[i] + (double)(n - 1)));
    td_future_unref(fs[i]);
  }
  /* the counters show which path the bytes took (our requests, and the replies to the peer's,
   * which may still be sending): with direct copy, frames of 32 KiB of tensors or more go direct
   * on the stream; on the lane only those of its bound (4 MiB, or TD_RPC_LANE_DIRECT_MIN_KB) and
   * more, the ring carrying the rest */
  uint64_t lane_min = k->lane_kb ? (uint64_t)atoi(k->lane_kb) << 10 : 4u << 20;
  uint64_t big = 0, mid = 0;
  int nbig = 0;
  for (int i = 0; i < N; i++) {
    uint64_t b = (uint64_t)sizes[i % 5] * 4;
    if (b >= lane_min) big += b, nbig++;
    else if (b >= 32768) mid += b;
  }
  td_rpc_traffic tr;
  MP_CHECK_OK(td_rpc_get_peer_traffic(a, (rank + 1) % world, &tr));
  if (peers) {
    MP_CHECK(tr.direct_frames_sent >= (uint64_t)nbig);
    MP_CHECK(tr.direct_bytes_sent >= big);
    MP_CHECK(tr.direct_frames_received >= (uint64_t)nbig);
    MP_CHECK(tr.direct_bytes_received >= big);
    /* the frames past both bounds never went through the stream or the ring (the middle size
     * did: our requests and our replies to the peer's) */
    MP_CHECK(tr.bytes_sent + tr.lane_bytes_sent < 2 * mid + big / 8);
    if (tr.frames_sent == 0 && tr.lane_frames_sent > 0) {
      /* everything took the lane (dialled): the middle size through its ring */
      MP_CHECK(tr.lane_bytes_sent >= mid);
      MP_CHECK(tr.direct_frames_sent <= 2 * (uint64_t)nbig); /* requests and replies */
    }
  } else {
    MP_CHECK(tr.direct_frames_sent == 0 && tr.direct_frames_received == 0);
    MP_CHECK(tr.bytes_sent + tr.lane_bytes_sent >= big &&
             tr.bytes_received + tr.lane_bytes_received >= big);
  }
  td_rpc_stats st;
  MP_CHECK_OK(td_rpc_get_stats(a, &st));
  MP_CHECK(st.calls_started >= N && st.calls_succeeded >= N && st.calls_failed == 0);
  MP_CHECK(st.requests_received > 0 && st.requests_failed == 0 && st.requests_rejected == 0);
  MP_CHECK(st.traffic.direct_frames_sent == tr.direct_frames_sent); /* one peer */
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_direct_copy(void **state) {
  const dc_case cases[] = {
      {-1, NULL, true, NULL, NULL, false, NULL}, {0, NULL, false, NULL, NULL, false, NULL},
      {-1, "0", false, NULL, NULL, false, NULL},  {1, "0", true, NULL, NULL, false, NULL},
      {-1, NULL, true, "32", NULL, false, NULL},  {-1, NULL, true, NULL, "0", false, NULL},
      {-1, NULL, true, NULL, NULL, false, "0"},   {-1, NULL, true, NULL, NULL, true, "0"},
      {0, NULL, false, NULL, NULL, true, "0"},    {-1, NULL, true, "32", NULL, true, "0"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TD_MP_RUN(2, worker_direct, (void *)&cases[i], 60);
  }
}

/* Settled by the pairs that meet: 4 workers on one host, each calling the next; with mailboxes
 * a worker ends up read by the two it met (the one it called, the one that called it), not by
 * the one across the ring, even after the group's graceful shutdown; without (TD_RPC_MAILBOX=0:
 * the init probe) by all three. */
static int worker_direct_met(int rank, int world, const char *method, void *arg) {
  const char *mbox = arg;
  register_test_fns();
  unsetenv("TD_RPC_DIRECT_COPY");
  unsetenv("TD_RPC_DIRECT_SETTLE");
  unsetenv("TD_RPC_LANE_DIAL");
  if (mbox) setenv("TD_RPC_MAILBOX", mbox, 1);
  else unsetenv("TD_RPC_MAILBOX");
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  char peer[32];
  snprintf(peer, sizeof peer, "worker%d", (rank + 1) % world);
  td_tensor *t;
  MP_CHECK_OK(td_tensor_arange(0, 1 << 21, 1, TD_DTYPE_F32, td_device_cpu(), &t)); /* 8 MiB */
  td_value *v = td_value_tensor(t), *res = NULL;
  td_tensor_unref(t);
  MP_CHECK_OK(td_rpc_sync(a, peer, "echo", &v, 1, NULL, &res));
  td_value_unref(v);
  MP_CHECK_OK(td_value_as_tensor(res, &t));
  MP_CHECK(td_tensor_numel(t) == 1 << 21 && ((const float *)td_tensor_data(t))[12345] == 12345.f);
  td_value_unref(res);
  bool lazily = mbox == NULL && mailboxes_here();
  int want = !siblings_readable() ? 0 : lazily ? 2 : world - 1;
  TD_TEST_POLL(td_rpc_direct_copy_peers(a) == want, 10);
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  MP_CHECK(td_rpc_direct_copy_peers(a) == want);
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_direct_copy_settled_by_the_pairs_that_meet(void **state) {
  (void)state;
  TD_MP_RUN(4, worker_direct_met, NULL, 60);
  TD_MP_RUN(4, worker_direct_met, (void *)"0", 60);
}

/* ---- same-host lane: on by default between local workers, off by option or environment; every
 * frame after the switch goes through it, in order, including frames larger than its ring ---- */

typedef struct lane_case {
  int option;      /* td_rpc_options.shm_lane */
  const char *env; /* TD_RPC_SHM_LANE, or NULL */
  bool expect_on;
  const char *dial; /* TD_RPC_LANE_DIAL, or NULL (dialled lanes: no gRPC stream at all) */
  const char *mbox; /* TD_RPC_MAILBOX, or NULL (mailbox lanes where the kernel allows them) */
} lane_case;

/* seq(i): TD_RPC_INLINE; fails unless i is one more than the last i it saw from this caller
 * (frames delivered in the order they were sent, across the stream-to-lane switch). */
static int64_t lane_seq_last[8];
static td_status fn_seq(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)fut;
  int64_t v;
  int from = td_rpc_ctx_caller_rank(c);
  if (n != 1 || td_value_as_int(args[0], &v) != TD_OK || from < 0 || from >= 8)
    return td_set_error(TD_ERR_INVALID, "seq: bad call");
  if (v != lane_seq_last[from] + 1)
    return td_set_error(TD_ERR_STATE, "seq: got %lld after %lld", (long long)v,
                        (long long)lane_seq_last[from]);
  lane_seq_last[from] = v;
  *res = td_value_int(v);
  return TD_OK;
}

static int worker_lane(int rank, int world, const char *method, void *arg) {
  const lane_case *k = arg;
  register_test_fns();
  MP_CHECK_OK(td_rpc_register_ex("lane_seq", fn_seq, NULL, TD_RPC_INLINE));
  if (k->env) setenv("TD_RPC_SHM_LANE", k->env, 1);
  else unsetenv("TD_RPC_SHM_LANE");
  if (k->dial) setenv("TD_RPC_LANE_DIAL", k->dial, 1);
  else unsetenv("TD_RPC_LANE_DIAL");
  if (k->mbox) setenv("TD_RPC_MAILBOX", k->mbox, 1);
  else unsetenv("TD_RPC_MAILBOX");
  bool dialled = k->expect_on && !(k->dial && strcmp(k->dial, "0") == 0);
  /* a mailbox lane: the pair's one lane, whichever side calls first */
  bool mbox = dialled && !(k->mbox && strcmp(k->mbox, "0") == 0) && siblings_readable();
  td_rpc_options o = td_mp_rpc_options(method, 4);
  o.shm_lane = k->option;
  o.direct_copy = 0; /* every tensor byte goes through the path under test */
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  int to = (rank + 1) % world;
  char peer[32];
  snprintf(peer, sizeof peer, "worker%d", to);
  /* calls kept in flight (a sliding window of 64) while the lane is set up, so the switch falls
   * among calls still travelling on the stream: they arrive in the order they were sent */
  enum { N = 300, W = 64 };
  td_future *fs[N];
  for (int i = 0; i < N + W; i++) {
    if (i >= W) {
      MP_CHECK_OK(td_future_wait(fs[i - W], td_test_ms(30000)));
      td_future_unref(fs[i - W]);
    }
    if (i >= N) continue;
    td_value *v = td_value_int(i + 1);
    MP_CHECK_OK(td_rpc_async(a, peer, "lane_seq", &v, 1, NULL, &fs[i]));
    td_value_unref(v);
  }
  /* both streams of the pair (ours and the peer's) switched; or, dialled, the pair's lanes are
   * up (one or two: a worker whose peer dialled it first may call back on that lane) */
  if (k->expect_on && !dialled) TD_TEST_POLL(td_rpc_shm_lanes(a) == 2, 30);
  if (dialled) TD_TEST_POLL(td_rpc_shm_lanes(a) >= 1, 30);
  if (mbox) TD_TEST_POLL(td_rpc_mailbox_lanes(a) == 1, 30);
  MP_CHECK(td_rpc_mailbox_lanes(a) == (mbox ? 1 : 0));
  if (mbox) MP_CHECK(td_rpc_shm_lanes(a) == 1);
  /* then one call at a time, with tensors from one float to more than the ring holds
   * (256 KiB), which cross it in pieces */
  td_rpc_traffic before;
  MP_CHECK_OK(td_rpc_get_peer_traffic(a, to, &before));
  int64_t sizes[] = {1, 1000, 70000, 300000};
  for (int i = 0; i < 40; i++) {
    int64_t n = sizes[i % 4];
    td_tensor *t;
    MP_CHECK_OK(td_tensor_arange((double)i, (double)i + (double)n, 1, TD_DTYPE_F32,
                                 td_device_cpu(), &t));
    td_value *v = td_value_tensor(t), *r = NULL;
    td_tensor_unref(t);
    MP_CHECK_OK(td_rpc_sync(a, peer, "echo", &v, 1, NULL, &r));
    td_value_unref(v);
    MP_CHECK_OK(td_value_as_tensor(r, &t));
    MP_CHECK(td_tensor_numel(t) == n);
    const float *p = td_tensor_data(t);
    for (int64_t j = 0; j < n; j += 331) MP_CHECK(p[j] == (float)(i + j));
    MP_CHECK(p[n - 1] == (float)(i + n - 1));
    td_value_unref(r);
  }
  td_rpc_traffic tr;
  MP_CHECK_OK(td_rpc_get_peer_traffic(a, to, &tr));
  if (k->expect_on) {
    MP_CHECK(td_rpc_shm_lanes(a) >= 1);
    /* after the switch nothing of ours went through the stream */
    if (tr.frames_sent != before.frames_sent)
      fprintf(stderr, "stream frames %llu -> %llu, lane %llu -> %llu, lanes %d\n",
              (unsigned long long)before.frames_sent, (unsigned long long)tr.frames_sent,
              (unsigned long long)before.lane_frames_sent, (unsigned long long)tr.lane_frames_sent,
              td_rpc_shm_lanes(a));
    MP_CHECK(tr.frames_sent == before.frames_sent);
    /* dialled: no frame ever went through a gRPC stream, the first calls included */
    if (dialled) MP_CHECK(tr.frames_sent == 0 && tr.frames_received == 0);
    MP_CHECK(tr.lane_frames_sent - before.lane_frames_sent >= 40);
    MP_CHECK(tr.lane_frames_received - before.lane_frames_received >= 40);
  } else {
    MP_CHECK(td_rpc_shm_lanes(a) == 0);
    MP_CHECK(tr.lane_frames_sent == 0 && tr.lane_frames_received == 0);
    MP_CHECK(tr.frames_sent >= N + 40);
  }
  td_rpc_stats st;
  MP_CHECK_OK(td_rpc_get_stats(a, &st));
  MP_CHECK(st.calls_failed == 0 && st.requests_failed == 0 && st.requests_rejected == 0);
  /* one peer: the totals are its traffic (read between two reads of it, as our replies to the
   * peer's own calls may still be going out) */
  td_rpc_traffic tr2;
  MP_CHECK_OK(td_rpc_get_peer_traffic(a, to, &tr2));
  MP_CHECK(st.traffic.lane_frames_sent >= tr.lane_frames_sent &&
           st.traffic.lane_frames_sent <= tr2.lane_frames_sent);
  /* graceful shutdown balances sent and served across both paths */
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_shm_lane(void **state) {
  const lane_case cases[] = {{-1, NULL, true, NULL, NULL}, {-1, NULL, true, NULL, "0"},
                             {-1, NULL, true, "0", NULL}, {0, NULL, false, NULL, NULL},
                             {-1, "0", false, NULL, NULL}, {1, "0", true, NULL, NULL}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    TD_MP_RUN(2, worker_lane, (void *)&cases[i], 60);
  }
}

/* ---- replies that come through the lane in one pass complete on the pool as one task (a
 * burst); a callback of that task that blocks hands the rest of it to other pool threads ---- */

static int burst_slow_started; /* atomic */

/* burst_slow: TD_RPC_INLINE, blocks the lane thread of rank 0 for 300 ms (a test's abuse of an
 * inline handler: meanwhile the replies to rank 0's calls pile up in its rings) */
static td_status fn_burst_slow(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  __atomic_store_n(&burst_slow_started, 1, __ATOMIC_RELEASE);
  struct timespec ts = {0, 300 * 1000000L};
  nanosleep(&ts, NULL);
  *res = td_value_none();
  return TD_OK;
}

/* burst_trigger: TD_RPC_INLINE on rank 1, calls burst_slow on rank 0 and answers with its
 * outcome */
static td_status fn_burst_trigger(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                  td_future **fut) {
  (void)args, (void)n, (void)res;
  return td_rpc_async(td_rpc_ctx_agent(c), "worker0", "burst_slow", NULL, 0, NULL, fut);
}

static td_status fn_burst_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)c, (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

static td_future *burst_gate; /* completed by the second reply's callback */
static td_status burst_wait_status = TD_ERR_STATE; /* atomic */

static void burst_first_done(td_future *f, void *ud) {
  (void)f, (void)ud;
  /* waits for what the next completion of the same burst does */
  td_status st = td_future_wait(burst_gate, td_test_ms(5000));
  __atomic_store_n(&burst_wait_status, st, __ATOMIC_RELEASE);
}

static void burst_second_done(td_future *f, void *ud) {
  (void)f, (void)ud;
  td_future_complete(burst_gate, td_value_none());
}

static int worker_burst(int rank, int world, const char *method, void *arg) {
  (void)arg;
  MP_CHECK_OK(td_rpc_register_ex("burst_slow", fn_burst_slow, NULL, TD_RPC_INLINE));
  MP_CHECK_OK(td_rpc_register_ex("burst_trigger", fn_burst_trigger, NULL, TD_RPC_INLINE));
  MP_CHECK_OK(td_rpc_register_ex("burst_echo", fn_burst_echo, NULL, TD_RPC_INLINE));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  const char *peer = rank ? "worker0" : "worker1";
  td_value *v = td_value_int(rank), *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, peer, "burst_echo", &v, 1, NULL, &r)); /* each opens its stream */
  td_value_unref(r);
  TD_TEST_POLL(td_rpc_shm_lanes(a) == 2, 30);
  if (rank == 0) {
    td_future *trig, *f[2];
    MP_CHECK_OK(td_rpc_async(a, "worker1", "burst_trigger", NULL, 0, NULL, &trig));
    TD_TEST_POLL(__atomic_load_n(&burst_slow_started, __ATOMIC_ACQUIRE), 30);
    /* rank 0's lane thread is held in burst_slow: both replies arrive before it reads them */
    MP_CHECK((burst_gate = td_future_create()) != NULL);
    for (int i = 0; i < 2; i++)
      MP_CHECK_OK(td_rpc_async(a, "worker1", "burst_echo", &v, 1, NULL, &f[i]));
    MP_CHECK_OK(td_future_on_done(f[0], burst_first_done, NULL));
    MP_CHECK_OK(td_future_on_done(f[1], burst_second_done, NULL));
    MP_CHECK_OK(td_future_wait(trig, td_test_ms(30000)));
    for (int i = 0; i < 2; i++) MP_CHECK_OK(td_future_wait(f[i], td_test_ms(30000)));
    td_status st;
    TD_TEST_POLL((st = __atomic_load_n(&burst_wait_status, __ATOMIC_ACQUIRE)) != TD_ERR_STATE, 30);
    if (st != TD_OK) fprintf(stderr, "burst: the first callback's wait: %s\n", td_status_name(st));
    MP_CHECK(st == TD_OK);
    td_future_unref(trig);
    for (int i = 0; i < 2; i++) td_future_unref(f[i]);
    td_future_unref(burst_gate);
  }
  td_value_unref(v);
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_burst_callback_blocks(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_burst, NULL, 60);
}

/* ---- one stream serves a pair both ways: rank 1 calls rank 0, which then reaches rank 1 on the
 * stream rank 1 opened (no connection of its own): small, large (direct copy) and failing calls,
 * through the lane or gRPC, and a graceful shutdown whose totals still balance ---- */

typedef struct share_case {
  const char *share_env; /* TD_RPC_SHARE_STREAMS, or NULL */
  const char *lane_env;  /* TD_RPC_SHM_LANE, or NULL */
  bool expect_shared;
} share_case;

static int worker_share(int rank, int world, const char *method, void *arg) {
  const share_case *k = arg;
  register_test_fns();
  if (k->share_env) setenv("TD_RPC_SHARE_STREAMS", k->share_env, 1);
  else unsetenv("TD_RPC_SHARE_STREAMS");
  if (k->lane_env) setenv("TD_RPC_SHM_LANE", k->lane_env, 1);
  else unsetenv("TD_RPC_SHM_LANE");
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  td_rpc_stats st;
  if (rank == 1) {
    td_value *args[2] = {td_value_int(40), td_value_int(2)}, *res = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker0", "add", args, 2, NULL, &res));
    MP_CHECK(as_int(res) == 42);
    td_value_unref(res);
    td_value_unref(args[0]);
    td_value_unref(args[1]);
    MP_CHECK_OK(td_rpc_get_stats(a, &st));
    MP_CHECK(st.streams_opened == 1 && st.streams_shared == 0);
  } else {
    /* rank 1's stream is proven here once its request has arrived */
    for (int i = 0; i < 3000; i++) {
      MP_CHECK_OK(td_rpc_get_stats(a, &st));
      if (st.requests_received >= 1) break;
      usleep(10000);
    }
    MP_CHECK(st.requests_received >= 1);
    td_value *args[2] = {td_value_int(1), td_value_int(2)}, *res = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "add", args, 2, NULL, &res));
    MP_CHECK(as_int(res) == 3);
    td_value_unref(res);
    td_value_unref(args[0]);
    td_value_unref(args[1]);
    /* 2 MB: a direct copy on the same host, acknowledged on the same stream */
    td_tensor *t;
    MP_CHECK_OK(td_tensor_arange(0, 500000, 1, TD_DTYPE_F32, td_device_cpu(), &t));
    td_value *v = td_value_tensor(t);
    td_tensor_unref(t);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &res));
    td_value_unref(v);
    MP_CHECK_OK(td_value_as_tensor(res, &t));
    MP_CHECK(td_tensor_numel(t) == 500000 && ((const float *)td_tensor_data(t))[499999] == 499999.f);
    td_value_unref(res);
    /* an error travels back the same way */
    MP_CHECK(td_rpc_sync(a, "worker1", "fail", NULL, 0, NULL, &res) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "boom 42") != NULL);
    MP_CHECK_OK(td_rpc_get_stats(a, &st));
    MP_CHECK(st.calls_succeeded == 2 && st.calls_failed == 1);
    if (k->expect_shared) MP_CHECK(st.streams_opened == 0 && st.streams_shared == 1);
    else MP_CHECK(st.streams_opened == 1 && st.streams_shared == 0);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(30000)));
  td_rpc_destroy(a);
  return 0;
}

static void test_rpc_pair_shares_one_stream(void **state) {
  (void)state;
  const share_case cases[] = {{NULL, NULL, true}, {NULL, "0", true}, {"0", NULL, false}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    TD_MP_RUN(2, worker_share, (void *)&cases[i], 60);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_calls),
      cmocka_unit_test(test_rpc_uninitialised_options_refused),
      cmocka_unit_test(test_rpc_busy_poll),
      cmocka_unit_test(test_rpc_direct_copy),
      cmocka_unit_test(test_rpc_direct_copy_settled_by_the_pairs_that_meet),
      cmocka_unit_test(test_rpc_shm_lane),
      cmocka_unit_test(test_rpc_burst_callback_blocks),
      cmocka_unit_test(test_rpc_pair_shares_one_stream),
  };
  return cmocka_run_group_tests_name("rpc_calls", tests, NULL, NULL);
}
