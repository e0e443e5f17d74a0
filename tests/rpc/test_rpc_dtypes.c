/* test_rpc_dtypes.c - tensors of every dtype cross the wire unchanged: small ones through the
 * stream and large ones (>= 32 KiB) through same-host direct copy, contiguous and strided, in both
 * directions; the receiver sees the dtype, shape and bytes the sender had (its own hash of the
 * bytes comes back), and td_value_equal compares float16/bfloat16 elements as floats (+0 == -0,
 * NaN == NaN). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_test_fns.h"
#include "test_util.h"

static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
  return h;
}

/* describe(t) -> [dtype name, numel, fnv hash of the bytes] as the receiver sees them. */
static td_status fn_describe(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  (void)c, (void)fut;
  td_tensor *t;
  if (n != 1) return td_set_error(TD_ERR_INVALID, "describe: 1 argument");
  td_status st = td_value_as_tensor(args[0], &t);
  if (st != TD_OK) return st;
  if (!td_tensor_is_contiguous(t)) return td_set_error(TD_ERR_STATE, "describe: not contiguous");
  td_value *l = td_value_list();
  if (!l) return TD_ERR_NOMEM;
  st = td_value_list_append(l, td_value_string(td_dtype_name(td_tensor_dtype(t))));
  if (st == TD_OK) st = td_value_list_append(l, td_value_int(td_tensor_numel(t)));
  uint64_t h = fnv(td_tensor_data(t), td_tensor_nbytes(t));
  if (st == TD_OK) st = td_value_list_append(l, td_value_int((int64_t)h));
  if (st != TD_OK) {
    td_value_unref(l);
    return st;
  }
  *res = l;
  return TD_OK;
}

/* A [rows, 24] tensor of dt whose bytes are a pattern (bool: 0/1; floats: no NaN, so that value
 * equality and byte equality agree). */
static td_tensor *pattern(td_dtype dt, int64_t rows) {
  int64_t shape[2] = {rows, 24};
  td_tensor *t = NULL;
  MP_CHECK_OK(td_tensor_empty(shape, 2, dt, td_device_cpu(), &t));
  unsigned char *p = td_tensor_data(t);
  size_t nb = td_tensor_nbytes(t), es = td_dtype_size(dt);
  for (size_t i = 0; i < nb; i++) p[i] = (unsigned char)(i * 31 + 7);
  for (size_t i = 0; i < nb / es; i++) {
    if (dt == TD_DTYPE_BOOL) p[i] &= 1;
    if (dt == TD_DTYPE_F16) p[i * 2 + 1] &= 0x3b; /* exponent below all-ones */
    if (dt == TD_DTYPE_BF16) p[i * 2 + 1] &= 0x3f;
    if (dt == TD_DTYPE_F32) p[i * 4 + 3] &= 0x3f;
    if (dt == TD_DTYPE_F64) p[i * 8 + 7] &= 0x3f;
  }
  return t;
}

/* Sends t to worker1: describe must report its dtype, numel and bytes; echo must return it. */
static void round_trip(td_rpc_agent *a, td_tensor *t, const char *what) {
  td_tensor *c = NULL;
  MP_CHECK_OK(td_tensor_contiguous(t, &c));
  td_value *arg = td_value_tensor(t), *r = NULL, *e = NULL;
  MP_CHECK(arg);
  MP_CHECK_OK(td_rpc_sync(a, "worker1", "describe", &arg, 1, NULL, &r));
  const char *name = NULL;
  int64_t numel = -1, hash = 0;
  MP_CHECK_OK(td_value_as_string(td_value_list_get(r, 0), &name, NULL));
  MP_CHECK_OK(td_value_as_int(td_value_list_get(r, 1), &numel));
  MP_CHECK_OK(td_value_as_int(td_value_list_get(r, 2), &hash));
  if (strcmp(name, td_dtype_name(td_tensor_dtype(t))) != 0 || numel != td_tensor_numel(t) ||
      (uint64_t)hash != fnv(td_tensor_data(c), td_tensor_nbytes(c))) {
    fprintf(stderr, "%s: worker1 saw %s[%lld] hash %llx\n", what, name, (long long)numel,
            (unsigned long long)hash);
    MP_CHECK(!"the receiver saw different bytes");
  }
  MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &arg, 1, NULL, &e));
  td_tensor *back;
  MP_CHECK_OK(td_value_as_tensor(e, &back));
  MP_CHECK(td_tensor_dtype(back) == td_tensor_dtype(t) && td_tensor_same_shape(back, t));
  MP_CHECK(td_tensor_is_contiguous(back));
  MP_CHECK(memcmp(td_tensor_data(back), td_tensor_data(c), td_tensor_nbytes(c)) == 0);
  MP_CHECK(td_value_equal(e, arg));
  td_value_unref(e), td_value_unref(r), td_value_unref(arg), td_tensor_unref(c);
}

/* arg: TD_RPC_LANE_DIRECT_MIN_KB, or NULL: the big tensors take the same-host lane's ring (under
 * its 4 MiB bound), or with "32" direct copy as on the stream */
static int worker_dtypes(int rank, int world, const char *method, void *arg) {
  const char *lane_kb = arg;
  if (lane_kb) setenv("TD_RPC_LANE_DIRECT_MIN_KB", lane_kb, 1);
  else unsetenv("TD_RPC_LANE_DIRECT_MIN_KB");
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("describe", fn_describe, NULL));
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    /* meet worker1 first: a pair on one host settles direct copy in its lane's handshake, whose
     * last message may be handled just after this reply */
    td_value *w = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &w));
    td_value_unref(w);
    TD_TEST_POLL(td_rpc_direct_copy_peers(a) > 0, 2);
    td_rpc_stats before, after;
    MP_CHECK_OK(td_rpc_get_stats(a, &before));
    for (int d = 0; d < TD_DTYPE_COUNT; d++) {
      td_dtype dt = (td_dtype)d;
      char what[64];
      td_tensor *small = pattern(dt, 3), *big = pattern(dt, 4096), *tr = NULL;
      snprintf(what, sizeof what, "%s small", td_dtype_name(dt));
      round_trip(a, small, what);
      snprintf(what, sizeof what, "%s big", td_dtype_name(dt));
      round_trip(a, big, what); /* 4096 x 24 elements: 96 KiB and more */
      MP_CHECK_OK(td_tensor_transpose(small, 0, 1, &tr));
      snprintf(what, sizeof what, "%s strided", td_dtype_name(dt));
      round_trip(a, tr, what);
      td_tensor_unref(tr), td_tensor_unref(big), td_tensor_unref(small);
    }
    MP_CHECK_OK(td_rpc_get_stats(a, &after));
    uint64_t direct = after.traffic.direct_frames_sent - before.traffic.direct_frames_sent;
    uint64_t lane = after.traffic.lane_frames_sent - before.traffic.lane_frames_sent;
    if (td_rpc_direct_copy_peers(a) > 0 && (lane_kb || lane == 0))
      MP_CHECK(direct >= TD_DTYPE_COUNT * 2); /* the big tensors went the direct way */
    else if (lane > 0)
      MP_CHECK(direct == 0); /* through the lane's ring */
  }
  td_mp_finish(a, 30);
  return 0;
}

static void test_rpc_dtypes_round_trip(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_dtypes, NULL, 120);
  TD_MP_RUN(2, worker_dtypes, "32", 120);
}

/* Equality of half-precision tensors compares values: +0 == -0, NaN == NaN, 1 != 2. */
static void test_value_equal_half(void **state) {
  (void)state;
  static const struct {
    td_dtype dt;
    uint16_t a, b;
    bool eq;
  } cases[] = {
      {TD_DTYPE_F16, 0x0000, 0x8000, true},  {TD_DTYPE_F16, 0x7e00, 0x7c01, true},
      {TD_DTYPE_F16, 0x3c00, 0x4000, false}, {TD_DTYPE_F16, 0x7c00, 0x7e00, false},
      {TD_DTYPE_BF16, 0x8000, 0x0000, true}, {TD_DTYPE_BF16, 0x7fc0, 0xffc1, true},
      {TD_DTYPE_BF16, 0x3f80, 0x3f81, false}, {TD_DTYPE_BF16, 0x7f80, 0xff80, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int64_t shape[1] = {1};
    td_tensor *x = NULL, *y = NULL;
    TD_ASSERT_OK(td_tensor_from_buffer(&cases[i].a, shape, 1, cases[i].dt, &x));
    TD_ASSERT_OK(td_tensor_from_buffer(&cases[i].b, shape, 1, cases[i].dt, &y));
    td_value *vx = td_value_tensor(x), *vy = td_value_tensor(y);
    if (td_value_equal(vx, vy) != cases[i].eq)
      fail_msg("case %zu: %s %04x vs %04x should be %s", i, td_dtype_name(cases[i].dt),
               cases[i].a, cases[i].b, cases[i].eq ? "equal" : "different");
    td_value_unref(vx), td_value_unref(vy), td_tensor_unref(x), td_tensor_unref(y);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_value_equal_half),
      cmocka_unit_test(test_rpc_dtypes_round_trip),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
