/* test_rpc_slow.c - long-running multi-process RPC tests (label "slow", not in the default run):
 * a 2.5 GiB float32 tensor checked element by element on the receiver and echoed back (past the
 * 2^31 and 2^32-byte marks), 0-byte tensors, and a soak of 1,000,000 small calls in async windows
 * of 64 whose caller's resident memory must stay flat after a warm-up. Timings go to stderr. */
#include "rpc_test_fns.h"
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define TD_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TD_UNDER_ASAN 1
#endif
#endif

/* A "VmRSS:" / "VmHWM:" figure of this process from /proc/self/status in KiB, or -1. */
static long status_kib(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long kib = -1;
  size_t n = strlen(field);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, n) == 0) kib = strtol(line + n, NULL, 10);
  fclose(f);
  return kib;
}

/* rss() / hwm(): the current / peak resident memory of the callee in KiB */
static td_status fn_rss(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  *res = td_value_int(status_kib("VmRSS:"));
  return TD_OK;
}

static td_status fn_hwm(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  *res = td_value_int(status_kib("VmHWM:"));
  return TD_OK;
}

static long remote_kib(td_rpc_agent *a, const char *fn) {
  td_value *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, "worker1", fn, NULL, 0, NULL, &r));
  int64_t v = -1;
  MP_CHECK_OK(td_value_as_int(r, &v));
  td_value_unref(r);
  return (long)v;
}

/* ---- a 2.5 GiB tensor ---- */

#define BIG_NUMEL (((int64_t)5 << 30) / 2 / 4) /* 2.5 GiB of float32 = 671,088,640 elements */

/* The value of element i: 24 bits of a multiplicative hash, exact in float32, so a block that
 * lands at the wrong offset shows. */
static inline float pattern(int64_t i) {
  return (float)(((uint64_t)i * 0x9E3779B97F4A7C15ull) >> 40);
}

/* verify(t): counts the elements of t that differ from pattern(); returns [numel, mismatches,
 * first bad index or -1]. */
static td_status fn_verify(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  td_tensor *t;
  td_status st = td_value_as_tensor(args[0], &t);
  if (st != TD_OK) return st;
  if (td_tensor_dtype(t) != TD_DTYPE_F32 || !td_tensor_is_contiguous(t))
    return td_set_error(TD_ERR_INVALID, "verify: want a contiguous float32 tensor");
  const float *p = td_tensor_data(t);
  int64_t numel = td_tensor_numel(t), bad = 0, first = -1;
  for (int64_t i = 0; i < numel; i++) {
    if (p[i] != pattern(i)) {
      if (first < 0) first = i;
      bad++;
    }
  }
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_int(numel));
  td_value_list_append(l, td_value_int(bad));
  td_value_list_append(l, td_value_int(first));
  *res = l;
  return TD_OK;
}

static int64_t list_int(td_value *l, size_t i) {
  int64_t v = -999;
  MP_CHECK_OK(td_value_as_int(td_value_list_get(l, i), &v));
  return v;
}

static int worker_big(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("verify", fn_verify, NULL));
  MP_CHECK_OK(td_rpc_register("hwm", fn_hwm, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.max_message_bytes = 3ull << 30; /* above the default: its own setting */
  o.rpc_timeout_ms = TD_TIMEOUT_INFINITE; /* the transfers below are bounded by the test's own timeout */
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    /* 0-byte tensors, alone and between others (payload order), keep dtype and shape */
    int64_t s0[1] = {0}, s1[3] = {4, 0, 3}, s2[1] = {5};
    td_tensor *e0, *e1, *mid;
    MP_CHECK_OK(td_tensor_empty(s0, 1, TD_DTYPE_F32, td_device_cpu(), &e0));
    MP_CHECK_OK(td_tensor_empty(s1, 3, TD_DTYPE_F64, td_device_cpu(), &e1));
    MP_CHECK_OK(td_tensor_full(s2, 1, 7.0, TD_DTYPE_I64, td_device_cpu(), &mid));
    td_value *v = td_value_tensor(e0), *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &r));
    td_tensor *rt;
    MP_CHECK_OK(td_value_as_tensor(r, &rt));
    MP_CHECK(td_tensor_ndim(rt) == 1 && td_tensor_shape(rt)[0] == 0 && td_tensor_nbytes(rt) == 0);
    MP_CHECK(td_tensor_dtype(rt) == TD_DTYPE_F32);
    td_value_unref(r);
    td_value_unref(v);
    v = td_value_list();
    MP_CHECK_OK(td_value_list_append(v, td_value_tensor(e1)));
    MP_CHECK_OK(td_value_list_append(v, td_value_tensor(mid)));
    MP_CHECK_OK(td_value_list_append(v, td_value_tensor(e0)));
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &r));
    MP_CHECK(td_value_equal(r, v));
    MP_CHECK_OK(td_value_as_tensor(td_value_list_get(r, 0), &rt));
    MP_CHECK(td_tensor_ndim(rt) == 3 && td_tensor_shape(rt)[1] == 0 &&
             td_tensor_shape(rt)[2] == 3 && td_tensor_dtype(rt) == TD_DTYPE_F64);
    td_value_unref(r);
    td_value_unref(v);
    td_tensor_unref(e0);
    td_tensor_unref(e1);
    td_tensor_unref(mid);

    /* 2.5 GiB */
    int64_t numel = BIG_NUMEL;
    td_tensor *big;
    double t0 = td_test_now_s();
    MP_CHECK_OK(td_tensor_empty(&numel, 1, TD_DTYPE_F32, td_device_cpu(), &big));
    float *p = td_tensor_data(big);
    for (int64_t i = 0; i < numel; i++) p[i] = pattern(i);
    double t_fill = td_test_now_s();
    v = td_value_tensor(big);
    /* the receiver checks every element */
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "verify", &v, 1, NULL, &r));
    double t_verify = td_test_now_s();
    MP_CHECK(list_int(r, 0) == numel);
    if (list_int(r, 1) != 0)
      fprintf(stderr, "verify: %lld bad elements, first at %lld\n", (long long)list_int(r, 1),
              (long long)list_int(r, 2));
    MP_CHECK(list_int(r, 1) == 0);
    td_value_unref(r);
    /* and sends it all back */
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &r));
    double t_echo = td_test_now_s();
    MP_CHECK_OK(td_value_as_tensor(r, &rt));
    MP_CHECK(td_tensor_dtype(rt) == TD_DTYPE_F32 && td_tensor_ndim(rt) == 1);
    MP_CHECK(td_tensor_shape(rt)[0] == numel && td_tensor_nbytes(rt) == (size_t)numel * 4);
    const float *q = td_tensor_data(rt);
    MP_CHECK(q != p);
    /* element values at chosen offsets: ends, around the 2^31- and 2^32-byte marks (elements
     * 2^29 and 2^30 would be 2^31 and 2^32 bytes in; the latter is past the end here, so the
     * last elements stand in) and an 8 MiB message boundary */
    const int64_t at[] = {0, 1, 2, (1 << 21) - 1, 1 << 21, ((int64_t)1 << 29) - 1,
                          (int64_t)1 << 29, ((int64_t)1 << 29) + 1, ((int64_t)1 << 29) + 12345,
                          numel / 2, numel - 2, numel - 1};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
      if (q[at[k]] != pattern(at[k]))
        fprintf(stderr, "element %lld: got %g, want %g\n", (long long)at[k], q[at[k]],
                pattern(at[k]));
      MP_CHECK(q[at[k]] == pattern(at[k]));
    }
    MP_CHECK(memcmp(p, q, (size_t)numel * 4) == 0);
    double t_cmp = td_test_now_s();
    fprintf(stderr, "big tensor: 2.5 GiB fill %.2f s, send + verify on worker1 %.2f s, echo "
            "round trip %.2f s (%.2f GB/s counting both directions), compare %.2f s\n",
            t_fill - t0, t_verify - t_fill, t_echo - t_verify,
            2.0 * (double)numel * 4 / (t_echo - t_verify) / 1e9, t_cmp - t_echo);
    /* nothing holds a whole extra copy of the message on the way: peaks are the tensors (two
     * here: sent and received; one at a time on worker1) plus a margin */
    long hwm = status_kib("VmHWM:"), rhwm = remote_kib(a, "hwm");
    const long gib = 1024L * 1024;
    fprintf(stderr, "big tensor: peak resident memory worker0 %.2f GiB, worker1 %.2f GiB\n",
            (double)hwm / (double)gib, (double)rhwm / (double)gib);
#ifndef TD_UNDER_ASAN
    MP_CHECK(hwm > 0 && hwm < 5 * gib + gib / 2);
    MP_CHECK(rhwm > 0 && rhwm < 5 * gib / 2 + gib / 2);
#endif
    td_value_unref(r);
    td_value_unref(v);
    td_tensor_unref(big);
  }
  td_status st = td_rpc_shutdown(a, true, td_test_ms(120000));
  if (st != TD_OK) fprintf(stderr, "rank %d shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rpc_tensor_2_5_gib_and_empty(void **state) {
  TD_MP_RUN(2, worker_big, NULL, 600);
}

/* ---- a soak of a million small calls ---- */

enum { SOAK_CALLS = 1000000, SOAK_WARMUP = 50000, SOAK_WINDOW = 64 };

/* Runs calls [from, to) in windows of SOAK_WINDOW async calls. */
static void soak_calls(td_rpc_agent *a, int from, int to) {
  td_future *fs[SOAK_WINDOW];
  for (int i = from; i < to; i += SOAK_WINDOW) {
    int n = to - i < SOAK_WINDOW ? to - i : SOAK_WINDOW;
    for (int k = 0; k < n; k++) {
      td_value *args[2] = {td_value_int(i + k), td_value_int(1)};
      MP_CHECK_OK(td_rpc_async(a, "worker1", "add", args, 2, NULL, &fs[k]));
      td_value_unref(args[0]);
      td_value_unref(args[1]);
    }
    MP_CHECK_OK(td_future_wait_all(fs, n, td_test_ms(60000)));
    for (int k = 0; k < n; k++) {
      int64_t v = -1;
      MP_CHECK_OK(td_value_as_int(td_future_value(fs[k]), &v));
      MP_CHECK(v == i + k + 1);
      td_future_unref(fs[k]);
    }
  }
}

static int worker_soak(int rank, int world, const char *method, void *arg) {
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("rss", fn_rss, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    double t0 = td_test_now_s();
    soak_calls(a, 0, SOAK_WARMUP);
    double t1 = td_test_now_s();
    long before = status_kib("VmRSS:"), rbefore = remote_kib(a, "rss");
    MP_CHECK(before > 0 && rbefore > 0);
    soak_calls(a, SOAK_WARMUP, SOAK_CALLS);
    double t2 = td_test_now_s();
    long after = status_kib("VmRSS:"), rafter = remote_kib(a, "rss");
    fprintf(stderr, "soak: %d calls in %.1f s (%.0f calls/s after warm-up); VmRSS caller %ld -> "
            "%ld KiB (%+ld), callee %ld -> %ld KiB (%+ld)\n", SOAK_CALLS, t2 - t0,
            (SOAK_CALLS - SOAK_WARMUP) / (t2 - t1), before, after, after - before, rbefore,
            rafter, rafter - rbefore);
#ifndef TD_UNDER_ASAN /* ASan's quarantine holds freed memory on purpose */
    MP_CHECK(after - before < 10 * 1024);
    MP_CHECK(rafter - rbefore < 10 * 1024);
#endif
  }
  td_status st = td_rpc_shutdown(a, true, td_test_ms(60000));
  if (st != TD_OK) fprintf(stderr, "rank %d shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rpc_soak_million_calls_flat_memory(void **state) {
  TD_MP_RUN(2, worker_soak, NULL, 1200);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_tensor_2_5_gib_and_empty),
      cmocka_unit_test(test_rpc_soak_million_calls_flat_memory),
  };
  return cmocka_run_group_tests_name("rpc_slow", tests, NULL, NULL);
}
