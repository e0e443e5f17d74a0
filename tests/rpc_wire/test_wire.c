/* test_wire.c - the frame codec (rpc/wire*.c, rpc/direct.c): round trips of every value kind, tensors of every
 * dtype and layout, extension values; the incremental decoder under every chunking; malformed,
 * oversized and corrupt frames (each reported by id while the next frame still decodes); and
 * regressions found by fuzz/fuzz_wire_decoder; device maps (marked tensors, placement, refusal).
 *
 * Malformed envelopes are built with the generated protobuf code, so each case breaks exactly one
 * rule. Every test releases what it made (CI runs this under ASan's leak check).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rpc/direct.h"
#include "rpc/wire.h"
#include "tdist.pb-c.h"
#include "test_util.h"

/* ======================================================================================== */
/* helpers                                                                                   */
/* ======================================================================================== */

typedef struct {
  uint8_t *p;
  size_t n, cap;
} bytes;

static void bytes_put(bytes *b, const void *p, size_t n) {
  if (b->n + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n) cap *= 2;
    uint8_t *q = realloc(b->p, cap);
    assert_non_null(q);
    b->p = q;
    b->cap = cap;
  }
  if (n) memcpy(b->p + b->n, p, n);
  b->n += n;
}

static void bytes_zeros(bytes *b, size_t n) {
  uint8_t z[256] = {0};
  while (n) {
    size_t k = n < sizeof z ? n : sizeof z;
    bytes_put(b, z, k);
    n -= k;
  }
}

static void bytes_free(bytes *b) {
  free(b->p);
  memset(b, 0, sizeof *b);
}

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void prefix_put(bytes *b, uint32_t magic, uint32_t header_len, uint64_t payload_len,
                       uint64_t id) {
  uint8_t p[TD__FRAME_PREFIX];
  put_le(p, magic, 4);
  put_le(p + 4, header_len, 4);
  put_le(p + 8, payload_len, 8);
  put_le(p + 16, id, 8);
  bytes_put(b, p, sizeof p);
}

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* ---- encoding ---- */

static const td__wire_ctx enc_ctx = {NULL, 1, 0};
static const td__wire_ctx dec_ctx = {NULL, 0, 1};

/* msg_init fills m with a request carrying vals (borrowed) and distinct header fields. */
static td__msg msg_init(uint64_t id, const char *fn, td_value **vals, int n) {
  td__msg m = {0};
  m.id = id;
  m.kind = TD__MSG_REQUEST;
  m.fn = (char *)fn;
  m.from_rank = 3;
  m.values = vals;
  m.nvalues = n;
  m.timeout_ms = 1500 + (int64_t)id;
  m.ctx_id = 0x1234567890abcdefull ^ id;
  m.autograd_msg_id = id * 7;
  return m;
}

/* encode_msg appends m's frame (prefix + header + tensor bytes) to b. */
static void encode_msg(bytes *b, const td__msg *m) {
  td__wire_ctx ctx = enc_ctx;
  td__frame f;
  TD_ASSERT_OK(td__wire_encode(m, &ctx, &f));
  assert_true(f.head_len >= TD__FRAME_PREFIX);
  uint32_t hl = (uint32_t)f.head[4] | (uint32_t)f.head[5] << 8 | (uint32_t)f.head[6] << 16 |
                (uint32_t)f.head[7] << 24;
  assert_int_equal(f.head_len, TD__FRAME_PREFIX + hl);
  bytes_put(b, f.head, f.head_len);
  uint64_t payload = 0;
  for (int i = 0; i < f.ntensors; i++) {
    size_t nb = td_tensor_nbytes(f.tensors[i]);
    /* (td_tensor_is_contiguous says false for some empty shapes such as [3, 0]; nothing of an
     * empty tensor is sent anyway) */
    if (nb) assert_true(td_tensor_is_contiguous(f.tensors[i]));
    assert_int_equal(td_tensor_device(f.tensors[i]).type, TD_DEVICE_CPU);
    bytes_put(b, td_tensor_data(f.tensors[i]), nb);
    payload += nb;
  }
  assert_int_equal(payload, f.payload_len);
  td__frame_clear(&f);
}

static void encode_values(bytes *b, uint64_t id, td_value **vals, int n) {
  td__msg m = msg_init(id, "fn", vals, n);
  encode_msg(b, &m);
}

/* ---- decoding into a sink ---- */

typedef struct {
  bool bad;
  uint64_t id;
  td_status st;
  char why[256];
  td__msg msg; /* when !bad */
} event;

typedef struct {
  event *ev;
  int n, cap;
  td_status last; /* status of the last feed */
  bool idle;      /* decoder idle after the last feed */
} sink;

static event *sink_add(sink *s) {
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 16;
    s->ev = realloc(s->ev, (size_t)s->cap * sizeof *s->ev);
    assert_non_null(s->ev);
  }
  event *e = &s->ev[s->n++];
  memset(e, 0, sizeof *e);
  return e;
}

static void sink_on_msg(void *ud, td__msg *m) {
  event *e = sink_add(ud);
  e->id = m->id;
  e->msg = *m;
}

static void sink_on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  event *e = sink_add(ud);
  e->bad = true;
  e->id = id;
  e->st = st;
  snprintf(e->why, sizeof e->why, "%s", why ? why : "");
}

static void sink_clear(sink *s) {
  for (int i = 0; i < s->n; i++)
    if (!s->ev[i].bad) td__msg_clear(&s->ev[i].msg);
  free(s->ev);
  memset(s, 0, sizeof *s);
}

enum { FEED_ALL, FEED_BYTES, FEED_RANDOM, FEED_SPLIT };

/* direct-copy hooks given to decode()'s decoder when set (see test_wire_direct_copy) */
static const td__direct_hooks *g_direct_hooks;

/* decode feeds in to a new decoder, chunked by mode (FEED_RANDOM: arg is the seed; FEED_SPLIT:
 * two chunks, the first of arg bytes), stopping at the first failing feed. */
static void decode(const bytes *in, uint64_t max_msg, int mode, uint64_t arg, sink *s) {
  memset(s, 0, sizeof *s);
  td__decoder *d = NULL;
  TD_ASSERT_OK(td__decoder_create(&dec_ctx, max_msg, sink_on_msg, sink_on_bad, s, &d));
  if (g_direct_hooks) td__decoder_set_direct(d, g_direct_hooks);
  assert_true(td__decoder_idle(d));
  td_status st = TD_OK;
  size_t off = 0;
  uint64_t rng = arg;
  bool first = true;
  while (st == TD_OK && (off < in->n || first)) {
    size_t left = in->n - off, k = left;
    if (mode == FEED_BYTES) {
      k = left ? 1 : 0;
    } else if (mode == FEED_RANDOM) {
      uint64_t r = rng_next(&rng);
      switch (r % 4) { /* zero-length feeds, tiny, small and large chunks */
        case 0: k = 0; break;
        case 1: k = 1 + (r >> 8) % 3; break;
        case 2: k = 1 + (r >> 8) % 40; break;
        default: k = 1 + (r >> 8) % 5000; break;
      }
      if (k > left) k = left;
    } else if (mode == FEED_SPLIT && first) {
      k = arg < left ? (size_t)arg : left;
    }
    first = false;
    /* a private copy of each chunk lets ASan catch reads past it */
    uint8_t *chunk = malloc(k ? k : 1);
    assert_non_null(chunk);
    memcpy(chunk, in->p + off, k);
    st = td__decoder_feed(d, chunk, k);
    free(chunk);
    off += k;
  }
  s->last = st;
  s->idle = td__decoder_idle(d);
  td__decoder_destroy(d);
}

static bool str_same(const char *a, const char *b) {
  return strcmp(a ? a : "", b ? b : "") == 0;
}

static void assert_msg_equal(const td__msg *a, const td__msg *b) {
  assert_int_equal(a->id, b->id);
  assert_int_equal(a->kind, b->kind);
  if (!str_same(a->fn, b->fn)) fail_msg("fn '%s' != '%s'", a->fn, b->fn);
  assert_int_equal(a->from_rank, b->from_rank);
  assert_int_equal(a->status, b->status);
  if (!str_same(a->message, b->message))
    fail_msg("message '%s' != '%s'", a->message, b->message);
  assert_int_equal(a->timeout_ms, b->timeout_ms);
  assert_int_equal(a->ctx_id, b->ctx_id);
  assert_int_equal(a->autograd_msg_id, b->autograd_msg_id);
  assert_int_equal(a->nvalues, b->nvalues);
  for (int i = 0; i < a->nvalues; i++) {
    if (!td_value_equal(a->values[i], b->values[i])) {
      char x[512], y[512];
      fail_msg("value %d differs: %s vs %s", i, td_value_to_string(a->values[i], x, sizeof x),
               td_value_to_string(b->values[i], y, sizeof y));
    }
  }
}

/* assert_same_events checks that two decodings of one stream gave the same callbacks. */
static void assert_same_events(const sink *a, const sink *b) {
  assert_int_equal(a->n, b->n);
  assert_int_equal(a->last, b->last);
  for (int i = 0; i < a->n; i++) {
    assert_int_equal(a->ev[i].bad, b->ev[i].bad);
    assert_int_equal(a->ev[i].id, b->ev[i].id);
    if (a->ev[i].bad) assert_int_equal(a->ev[i].st, b->ev[i].st);
    else assert_msg_equal(&a->ev[i].msg, &b->ev[i].msg);
  }
}

/* decode_one decodes a stream holding exactly one good frame in every chunking and returns the
 * message of the all-at-once decoding in *out (caller clears it). */
static void decode_one(const bytes *in, td__msg *out) {
  sink ref;
  decode(in, 0, FEED_ALL, 0, &ref);
  assert_int_equal(ref.last, TD_OK);
  assert_true(ref.idle);
  assert_int_equal(ref.n, 1);
  if (ref.ev[0].bad) fail_msg("frame %llu rejected: %s", (unsigned long long)ref.ev[0].id,
                              ref.ev[0].why);
  int modes[] = {FEED_BYTES, FEED_RANDOM};
  for (size_t i = 0; i < sizeof modes / sizeof *modes; i++) {
    sink s;
    decode(in, 0, modes[i], 42, &s);
    assert_true(s.idle);
    assert_same_events(&ref, &s);
    sink_clear(&s);
  }
  *out = ref.ev[0].msg;
  ref.n = 0; /* the message now belongs to the caller */
  sink_clear(&ref);
}

/* round_trip encodes vals as one request, decodes it and checks that everything came back. The
 * decoded message goes to *out when out is not NULL. */
static void round_trip(td_value **vals, int n, td__msg *out) {
  bytes b = {0};
  td__msg m = msg_init(11, "some.function", vals, n);
  encode_msg(&b, &m);
  td__msg got;
  decode_one(&b, &got);
  assert_msg_equal(&m, &got);
  if (out) *out = got;
  else td__msg_clear(&got);
  bytes_free(&b);
}

static void unref_all(td_value **v, int n) {
  for (int i = 0; i < n; i++) td_value_unref(v[i]);
}

static td_value *tensor_value(td_tensor *t) {
  td_value *v = td_value_tensor(t);
  assert_non_null(v);
  td_tensor_unref(t);
  return v;
}

static td_value *tensor_of(const void *data, const int64_t *shape, int ndim, td_dtype dt) {
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(data, shape, ndim, dt, &t));
  return tensor_value(t);
}

static void append(td_value *list, td_value *item) {
  assert_non_null(item);
  TD_ASSERT_OK(td_value_list_append(list, item));
}

static void set(td_value *dict, const char *key, td_value *item) {
  assert_non_null(item);
  TD_ASSERT_OK(td_value_dict_set(dict, key, item));
}

/* ---- an extension type: a 2-d point ---- */

typedef struct {
  int64_t x, y;
} point;

static int point_live;                         /* points not yet destroyed */
static int to_wire_peer = -1, from_wire_peer = -1; /* ctx->peer_rank seen by the hooks */

static void point_destroy(void *obj) {
  point_live--;
  free(obj);
}

static point *point_new(int64_t x, int64_t y) {
  point *p = malloc(sizeof *p);
  assert_non_null(p);
  p->x = x;
  p->y = y;
  point_live++;
  return p;
}

static td_status point_to_wire(void *obj, td__wire_ctx *ctx, td_value **out) {
  const point *p = obj;
  to_wire_peer = ctx->peer_rank;
  td_value *d = td_value_dict();
  if (!d) return td_set_error(TD_ERR_NOMEM, "point: out of memory");
  td_status st = td_value_dict_set(d, "x", td_value_int(p->x));
  if (st == TD_OK) st = td_value_dict_set(d, "y", td_value_int(p->y));
  if (st != TD_OK) {
    td_value_unref(d);
    return st;
  }
  *out = d;
  return TD_OK;
}

static td_status point_from_wire(const td_value *repr, td__wire_ctx *ctx, void **obj) {
  from_wire_peer = ctx->peer_rank;
  int64_t x, y;
  if (td_value_as_int(td_value_dict_get(repr, "x"), &x) != TD_OK ||
      td_value_as_int(td_value_dict_get(repr, "y"), &y) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "point: expected {'x': int, 'y': int}");
  *obj = point_new(x, y);
  return TD_OK;
}

static bool point_equal(const void *a, const void *b) {
  const point *p = a, *q = b;
  return p->x == q->x && p->y == q->y;
}

static const td__value_ext_type point_type = {
    .name = "test_wire.point",
    .destroy = point_destroy,
    .to_wire = point_to_wire,
    .from_wire = point_from_wire,
    .equal = point_equal,
};

/* A type that cannot be sent, and one whose to_wire fails. */
static const td__value_ext_type local_type = {.name = "test_wire.local",
                                              .destroy = point_destroy};

static td_status failing_to_wire(void *obj, td__wire_ctx *ctx, td_value **out) {
  return td_set_error(TD_ERR_STATE, "failing: refuses to be sent");
}
static const td__value_ext_type failing_type = {
    .name = "test_wire.failing", .destroy = point_destroy, .to_wire = failing_to_wire};

static td_value *point_value(int64_t x, int64_t y) {
  td_value *v = td__value_ext(&point_type, point_new(x, y));
  assert_non_null(v);
  return v;
}

static int group_setup(void **state) {
  if (td__value_ext_register(&point_type) != TD_OK) return -1;
  if (td__value_ext_register(&local_type) != TD_OK) return -1;
  if (td__value_ext_register(&failing_type) != TD_OK) return -1;
  return 0;
}

/* ---- raw envelopes for malformed frames ---- */

#define RAW_MAX_NODES 1100

typedef struct {
  Tdist__Envelope env;
  Tdist__Node nodes[RAW_MAX_NODES];
  Tdist__Node *ptrs[RAW_MAX_NODES];
  int64_t shapes[RAW_MAX_NODES][TD_MAX_DIMS + 2];
} raw_env;

/* raw_new returns a request envelope with nargs trees and no nodes yet (free with free()). */
static raw_env *raw_new(uint32_t nargs) {
  raw_env *r = calloc(1, sizeof *r);
  assert_non_null(r);
  tdist__envelope__init(&r->env);
  r->env.kind = TD__MSG_REQUEST;
  r->env.fn = (char *)"f";
  r->env.nargs = nargs;
  r->env.nodes = r->ptrs;
  return r;
}

static Tdist__Node *raw_node(raw_env *r, uint32_t kind) {
  assert_true(r->env.n_nodes < RAW_MAX_NODES);
  size_t i = r->env.n_nodes++;
  Tdist__Node *n = &r->nodes[i];
  tdist__node__init(n);
  n->kind = kind;
  r->ptrs[i] = n;
  return n;
}

static Tdist__Node *raw_tensor(raw_env *r, int32_t dtype, const int64_t *shape, size_t ndim) {
  Tdist__Node *n = raw_node(r, TD_VALUE_TENSOR);
  assert_true(ndim <= TD_MAX_DIMS + 2);
  size_t i = (size_t)(n - r->nodes);
  memcpy(r->shapes[i], shape, ndim * sizeof *shape);
  n->dtype = dtype;
  n->shape = r->shapes[i];
  n->n_shape = ndim;
  return n;
}

/* raw_frame appends a frame with r's envelope and payload_len zero bytes of payload. */
static void raw_frame(bytes *b, uint64_t id, const raw_env *r, uint64_t payload_len) {
  size_t hl = tdist__envelope__get_packed_size(&r->env);
  uint8_t *h = malloc(hl ? hl : 1);
  assert_non_null(h);
  assert_int_equal(tdist__envelope__pack(&r->env, h), hl);
  prefix_put(b, TD__FRAME_MAGIC, (uint32_t)hl, payload_len, id);
  bytes_put(b, h, hl);
  bytes_zeros(b, (size_t)payload_len);
  free(h);
}

/* ======================================================================================== */
/* round trips                                                                               */
/* ======================================================================================== */

static void test_wire_roundtrip_scalars(void **state) {
  const char utf8[] = "h\xc3\xa9llo w\xc3\xb6rld \xe2\x82\xac";
  const uint8_t raw[] = {0, 1, 2, 0xff, 0, 0x80};
  td_value *v[] = {
      td_value_none(),          td_value_bool(true),       td_value_bool(false),
      td_value_int(0),          td_value_int(INT64_MIN),   td_value_int(INT64_MAX),
      td_value_int(-1),         td_value_double(2.5),      td_value_double(-0.0),
      td_value_double(NAN),     td_value_double(INFINITY), td_value_double(-INFINITY),
      td_value_double(5e-324),  td_value_string(""),       td_value_string(utf8),
      td_value_bytes(NULL, 0),  td_value_bytes(raw, sizeof raw),
  };
  int n = (int)(sizeof v / sizeof *v);
  for (int i = 0; i < n; i++) assert_non_null(v[i]);
  td__msg got;
  round_trip(v, n, &got);
  /* kinds are exact: int 0 is not double 0, false is not int 0 */
  assert_int_equal(td_value_kind_of(got.values[3]), TD_VALUE_INT);
  assert_int_equal(td_value_kind_of(got.values[2]), TD_VALUE_BOOL);
  double d = 0;
  TD_ASSERT_OK(td_value_as_double(got.values[8], &d));
  assert_true(d == 0 && signbit(d)); /* proto3 drops a zero double: the sign needs a flag */
  const void *data = NULL;
  size_t len = 99;
  TD_ASSERT_OK(td_value_as_bytes(got.values[16], &data, &len));
  assert_int_equal(len, sizeof raw);
  assert_memory_equal(data, raw, sizeof raw);
  td__msg_clear(&got);
  unref_all(v, n);
}

/* A string holding NUL bytes used to be cut at the first NUL (protobuf strings are C strings in
 * protobuf-c); such strings now travel in the node's bytes field. */
static void test_wire_string_with_nul(void **state) {
  const char s[] = "a\0b\0\0c";
  td_value *v[] = {td_value_string_n(s, sizeof s - 1), td_value_string_n("\0", 1),
                   td_value_string("plain")};
  td__msg got;
  round_trip(v, 3, &got);
  const char *out = NULL;
  size_t len = 0;
  TD_ASSERT_OK(td_value_as_string(got.values[0], &out, &len));
  assert_int_equal(len, sizeof s - 1);
  assert_memory_equal(out, s, sizeof s - 1);
  TD_ASSERT_OK(td_value_as_string(got.values[1], &out, &len));
  assert_int_equal(len, 1);
  td__msg_clear(&got);
  unref_all(v, 3);
}

static void test_wire_roundtrip_containers(void **state) {
  /* [[], {}, [1, [2, [3, {}]]], {'a': [None, {'': 'empty key'}], 'b': {'c': {'d': []}}},
   *  a dict of 40 entries (hashed), a list of 300 ints] */
  td_value *l = td_value_list();
  append(l, td_value_list());
  append(l, td_value_dict());
  td_value *n3 = td_value_list();
  append(n3, td_value_int(3));
  append(n3, td_value_dict());
  td_value *n2 = td_value_list();
  append(n2, td_value_int(2));
  append(n2, n3);
  td_value *n1 = td_value_list();
  append(n1, td_value_int(1));
  append(n1, n2);
  append(l, n1);
  td_value *a = td_value_list();
  append(a, td_value_none());
  td_value *ek = td_value_dict();
  set(ek, "", td_value_string("empty key"));
  append(a, ek);
  td_value *dd = td_value_dict();
  set(dd, "d", td_value_list());
  td_value *dc = td_value_dict();
  set(dc, "c", dd);
  td_value *top = td_value_dict();
  set(top, "a", a);
  set(top, "b", dc);
  append(l, top);
  td_value *big = td_value_dict();
  for (int i = 0; i < 40; i++) {
    char key[16];
    snprintf(key, sizeof key, "key%d", 39 - i); /* insertion order differs from sorted order */
    set(big, key, td_value_int(i));
  }
  append(l, big);
  td_value *ints = td_value_list();
  for (int i = 0; i < 300; i++) append(ints, td_value_int(i * 1000003));
  append(l, ints);

  td_value *v[] = {l, td_value_list(), td_value_dict()};
  td__msg got;
  round_trip(v, 3, &got);
  assert_int_equal(td_value_list_len(got.values[0]), 6);
  assert_int_equal(td_value_list_len(got.values[1]), 0);
  assert_int_equal(td_value_kind_of(got.values[1]), TD_VALUE_LIST);
  assert_int_equal(td_value_dict_len(got.values[2]), 0);
  assert_int_equal(td_value_kind_of(got.values[2]), TD_VALUE_DICT);
  const char *key = NULL;
  TD_ASSERT_OK(td_value_dict_entry(td_value_list_get(got.values[0], 4), 0, &key, NULL));
  assert_string_equal(key, "key39");
  td__msg_clear(&got);
  unref_all(v, 3);

  /* A message with no values at all. */
  round_trip(NULL, 0, NULL);
}

static void test_wire_roundtrip_tensors(void **state) {
  const float f32[] = {1.5f, -2.25f, 0.0f, 3e38f, -1e-38f, 7.0f};
  const double f64[] = {1.0 / 3, -2.0, NAN, INFINITY, 5e-324, 1e308};
  const int64_t i64[] = {INT64_MIN, -1, 0, 1, INT64_MAX, 42};
  int64_t s23[] = {2, 3}, s6[] = {6}, s321[] = {3, 2, 1}, s0[] = {0}, s203[] = {2, 0, 3};
  int64_t s8[] = {1, 1, 2, 1, 3, 1, 1, 1};
  td_tensor *scalar = NULL, *iscalar = NULL, *empty = NULL, *empty3 = NULL;
  TD_ASSERT_OK(td_tensor_scalar(3.5, TD_DTYPE_F64, td_device_cpu(), &scalar));
  TD_ASSERT_OK(td_tensor_scalar(-7, TD_DTYPE_I64, td_device_cpu(), &iscalar));
  TD_ASSERT_OK(td_tensor_empty(s0, 1, TD_DTYPE_F32, td_device_cpu(), &empty));
  TD_ASSERT_OK(td_tensor_empty(s203, 3, TD_DTYPE_I64, td_device_cpu(), &empty3));
  td_value *d = td_value_dict();
  set(d, "weight", tensor_of(f32, s23, 2, TD_DTYPE_F32));
  set(d, "zero_bytes", tensor_value(empty));
  td_value *v[] = {
      tensor_of(f32, s23, 2, TD_DTYPE_F32), tensor_of(f64, s6, 1, TD_DTYPE_F64),
      tensor_of(i64, s321, 3, TD_DTYPE_I64), tensor_value(scalar), tensor_value(iscalar),
      tensor_value(empty3), tensor_of(f64, s8, 8, TD_DTYPE_F64), d,
  };
  int n = (int)(sizeof v / sizeof *v);
  td__msg got;
  round_trip(v, n, &got);
  for (int i = 0; i < 7; i++) {
    td_tensor *a = NULL, *b = NULL;
    TD_ASSERT_OK(td_value_as_tensor(v[i], &a));
    TD_ASSERT_OK(td_value_as_tensor(got.values[i], &b));
    assert_int_equal(td_tensor_dtype(a), td_tensor_dtype(b));
    assert_int_equal(td_tensor_ndim(a), td_tensor_ndim(b));
    assert_true(td_tensor_same_shape(a, b));
    if (td_tensor_nbytes(b)) assert_true(td_tensor_is_contiguous(b));
    assert_int_equal(td_tensor_device(b).type, TD_DEVICE_CPU);
    assert_true(a != b);
    if (td_tensor_nbytes(a))
      assert_memory_equal(td_tensor_data(a), td_tensor_data(b), td_tensor_nbytes(a));
  }
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_value_as_tensor(got.values[3], &t));
  assert_int_equal(td_tensor_ndim(t), 0);
  double x = 0;
  TD_ASSERT_OK(td_tensor_item(t, &x));
  assert_true(x == 3.5);
  TD_ASSERT_OK(td_value_as_tensor(got.values[2], &t));
  assert_memory_equal(td_tensor_data(t), i64, sizeof i64); /* int64 bits exact */
  td__msg_clear(&got);
  unref_all(v, n);
}

static void test_wire_roundtrip_many_tensors(void **state) {
  enum { N = 400 };
  td_value *l = td_value_list();
  uint64_t rng = 7;
  uint64_t expect_payload = 0;
  for (int i = 0; i < N; i++) {
    int64_t shape[2] = {(int64_t)(rng_next(&rng) % 5), (int64_t)(rng_next(&rng) % 7)};
    td_dtype dt = (td_dtype)(i % 3);
    td_tensor *t = NULL;
    TD_ASSERT_OK(td_tensor_arange(i * 100.0, i * 100.0 + (double)(shape[0] * shape[1]), 1, dt,
                                  td_device_cpu(), &t));
    td_tensor *r = NULL;
    TD_ASSERT_OK(td_tensor_reshape(t, shape, 2, &r));
    td_tensor_unref(t);
    expect_payload += td_tensor_nbytes(r);
    append(l, tensor_value(r));
  }
  td_value *v[] = {l};
  bytes b = {0};
  td__msg m = msg_init(5, "many", v, 1);
  td__wire_ctx ctx = enc_ctx;
  td__frame f;
  TD_ASSERT_OK(td__wire_encode(&m, &ctx, &f));
  assert_int_equal(f.ntensors, N);
  assert_int_equal(f.payload_len, expect_payload);
  td__frame_clear(&f);
  encode_msg(&b, &m);
  td__msg got;
  decode_one(&b, &got);
  assert_msg_equal(&m, &got);
  td__msg_clear(&got);
  bytes_free(&b);
  td_value_unref(l);
}

/* Views travel as their elements in row-major order, whatever their strides. */
static void test_wire_noncontiguous_tensor(void **state) {
  int64_t s34[] = {3, 4}, s13[] = {1, 3}, s43[] = {4, 3};
  td_tensor *base = NULL, *m = NULL, *tr = NULL, *nar = NULL, *row = NULL, *row2 = NULL,
            *ex = NULL;
  TD_ASSERT_OK(td_tensor_arange(0, 12, 1, TD_DTYPE_F32, td_device_cpu(), &base));
  TD_ASSERT_OK(td_tensor_reshape(base, s34, 2, &m)); /* m[i][j] = 4i + j */
  TD_ASSERT_OK(td_tensor_transpose(m, 0, 1, &tr));   /* tr[i][j] = 4j + i, shape [4, 3] */
  TD_ASSERT_OK(td_tensor_narrow(m, 1, 1, 2, &nar));  /* nar[i][j] = 4i + j + 1, shape [3, 2] */
  TD_ASSERT_OK(td_tensor_arange(10, 13, 1, TD_DTYPE_I64, td_device_cpu(), &row));
  TD_ASSERT_OK(td_tensor_reshape(row, s13, 2, &row2));
  TD_ASSERT_OK(td_tensor_expand(row2, s43, 2, &ex)); /* stride 0 along dim 0 */
  assert_false(td_tensor_is_contiguous(tr));
  assert_false(td_tensor_is_contiguous(nar));
  assert_false(td_tensor_is_contiguous(ex));
  td_value *v[] = {tensor_value(tr), tensor_value(nar), tensor_value(ex)};
  td__msg got;
  round_trip(v, 3, &got);

  td_tensor *t = NULL;
  TD_ASSERT_OK(td_value_as_tensor(got.values[0], &t));
  assert_int_equal(td_tensor_size(t, 0), 4);
  assert_int_equal(td_tensor_size(t, 1), 3);
  assert_true(td_tensor_is_contiguous(t));
  const float *pf = td_tensor_data(t);
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) assert_true(pf[i * 3 + j] == (float)(4 * j + i));
  TD_ASSERT_OK(td_value_as_tensor(got.values[1], &t));
  pf = td_tensor_data(t);
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 2; j++) assert_true(pf[i * 2 + j] == (float)(4 * i + j + 1));
  TD_ASSERT_OK(td_value_as_tensor(got.values[2], &t));
  const int64_t *pi = td_tensor_data(t);
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) assert_int_equal(pi[i * 3 + j], 10 + j);
  /* the sender's views are untouched */
  const float *src = td_tensor_data(base);
  for (int i = 0; i < 12; i++) assert_true(src[i] == (float)i);

  td__msg_clear(&got);
  unref_all(v, 3);
  td_tensor_unref(base);
  td_tensor_unref(m);
  td_tensor_unref(row);
  td_tensor_unref(row2);
}

static void test_wire_message_fields(void **state) {
  /* an error reply */
  td__msg e = {0};
  e.id = UINT64_MAX;
  e.kind = TD__MSG_ERROR;
  e.from_rank = 17;
  e.status = TD_ERR_TIMEOUT;
  e.message = (char *)"worker2 (rank 2): deadline exceeded";
  e.ctx_id = 1;
  e.autograd_msg_id = UINT64_MAX;
  e.timeout_ms = -5;
  /* a response with one value and a long function name */
  char *longfn = malloc(20001);
  assert_non_null(longfn);
  memset(longfn, 'f', 20000);
  longfn[20000] = '\0';
  td_value *v[] = {td_value_int(99)};
  td__msg r = msg_init(0, longfn, v, 1);
  r.kind = TD__MSG_RESPONSE;

  bytes b = {0};
  encode_msg(&b, &e);
  encode_msg(&b, &r);
  sink s;
  decode(&b, 0, FEED_ALL, 0, &s);
  assert_int_equal(s.n, 2);
  assert_false(s.ev[0].bad);
  assert_false(s.ev[1].bad);
  assert_int_equal(s.ev[0].msg.timeout_ms, 0); /* a negative timeout from the wire reads as none */
  e.timeout_ms = 0;
  assert_msg_equal(&e, &s.ev[0].msg);
  assert_int_equal(s.ev[0].msg.nvalues, 0);
  assert_msg_equal(&r, &s.ev[1].msg);
  assert_string_equal(s.ev[1].msg.fn, longfn);
  sink_clear(&s);
  bytes_free(&b);
  free(longfn);
  unref_all(v, 1);
}

static void test_wire_extension_roundtrip(void **state) {
  int live0 = point_live;
  td_value *d = td_value_dict();
  set(d, "p", point_value(-5, 6));
  td_value *l = td_value_list();
  append(l, point_value(1, 2));
  append(l, d);
  append(l, td_value_int(7));
  td_value *v[] = {point_value(INT64_MIN, INT64_MAX), l};
  to_wire_peer = from_wire_peer = -1;
  td__msg got;
  round_trip(v, 2, &got);
  assert_int_equal(to_wire_peer, enc_ctx.peer_rank); /* the hooks see each side's context */
  assert_int_equal(from_wire_peer, dec_ctx.peer_rank);
  assert_true(td__value_ext_type_of(got.values[0]) == &point_type);
  const point *p = td__value_ext_obj(got.values[0]);
  assert_true(p->x == INT64_MIN && p->y == INT64_MAX);
  assert_true(p != td__value_ext_obj(v[0])); /* rebuilt, not shared */
  p = td__value_ext_obj(td_value_dict_get(td_value_list_get(got.values[1], 1), "p"));
  assert_non_null(p);
  assert_true(p->x == -5 && p->y == 6);
  td__msg_clear(&got);
  unref_all(v, 2);
  assert_int_equal(point_live, live0); /* every received point was destroyed */
}

static void test_wire_encode_errors(void **state) {
  td__wire_ctx ctx = enc_ctx;
  td__frame f;
  memset(&f, 0xab, sizeof f);
  td__frame untouched = f;
  int live0 = point_live;

  /* a NULL argument */
  td_value *v1[] = {td_value_int(1), NULL};
  td__msg m = msg_init(1, "f", v1, 2);
  TD_ASSERT_STATUS(td__wire_encode(&m, &ctx, &f), TD_ERR_INVALID);
  assert_memory_equal(&f, &untouched, sizeof f);

  /* an extension type without to_wire, deep inside a tree that also holds tensors */
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_scalar(1, TD_DTYPE_F32, td_device_cpu(), &t));
  td_value *l = td_value_list();
  append(l, tensor_value(t));
  td_value *local = td__value_ext(&local_type, point_new(0, 0));
  assert_non_null(local);
  append(l, local);
  td_value *v2[] = {l};
  m = msg_init(2, "f", v2, 1);
  TD_ASSERT_STATUS(td__wire_encode(&m, &ctx, &f), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "test_wire.local"));
  assert_memory_equal(&f, &untouched, sizeof f);

  /* to_wire failing: its status comes back, after a successful extension value */
  td_value *l2 = td_value_list();
  append(l2, point_value(1, 1));
  td_value *failing = td__value_ext(&failing_type, point_new(0, 0));
  assert_non_null(failing);
  append(l2, failing);
  td_value *v3[] = {l2};
  m = msg_init(3, "f", v3, 1);
  TD_ASSERT_STATUS(td__wire_encode(&m, &ctx, &f), TD_ERR_STATE);
  assert_memory_equal(&f, &untouched, sizeof f);

  td_value_unref(v1[0]);
  td_value_unref(l);
  td_value_unref(l2);
  assert_int_equal(point_live, live0);
}

/* ======================================================================================== */
/* chunking                                                                                  */
/* ======================================================================================== */

static td_value *random_value(uint64_t *rng, int depth) {
  uint64_t r = rng_next(rng);
  int kind = (int)(r % (depth < 4 ? 10 : 7));
  switch (kind) {
    case 0: return td_value_none();
    case 1: return td_value_bool(r & 256);
    case 2: return td_value_int((int64_t)rng_next(rng));
    case 3: return td_value_double((double)(int64_t)rng_next(rng) / 1e6);
    case 4:
    case 5: {
      char s[24];
      size_t n = (r >> 8) % sizeof s;
      for (size_t i = 0; i < n; i++) {
        uint64_t c = rng_next(rng);
        /* strings: letters and the odd NUL; bytes: anything */
        s[i] = (char)(kind == 5 ? c : c % 8 == 0 ? 0 : 'a' + (c >> 8) % 26);
      }
      return kind == 4 ? td_value_string_n(s, n) : td_value_bytes(s, n);
    }
    case 6: {
      int ndim = (int)((r >> 8) % 4);
      int64_t shape[3];
      int64_t numel = 1;
      for (int i = 0; i < ndim; i++) {
        shape[i] = (int64_t)(rng_next(rng) % 4);
        numel *= shape[i];
      }
      td_dtype dt = (td_dtype)((r >> 16) % 3);
      double buf[27];
      int64_t ibuf[27];
      float fbuf[27];
      for (int64_t i = 0; i < numel; i++) {
        ibuf[i] = (int64_t)rng_next(rng);
        buf[i] = (double)ibuf[i] / 3.0;
        fbuf[i] = (float)buf[i];
      }
      const void *data = dt == TD_DTYPE_F32 ? (const void *)fbuf
                         : dt == TD_DTYPE_F64 ? (const void *)buf
                                              : (const void *)ibuf;
      return tensor_of(data, shape, ndim, dt);
    }
    case 7:
    case 8: {
      td_value *l = td_value_list();
      int n = (int)((r >> 8) % 5);
      for (int i = 0; i < n; i++) append(l, random_value(rng, depth + 1));
      return l;
    }
    default: {
      td_value *d = td_value_dict();
      int n = (int)((r >> 8) % 5);
      for (int i = 0; i < n; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", (int)(rng_next(rng) % 8)); /* repeats replace */
        set(d, key, random_value(rng, depth + 1));
      }
      return d;
    }
  }
}

/* build_stream writes nframes frames (every 5th one malformed) and returns the messages sent. */
static void build_stream(bytes *b, int nframes, uint64_t seed, td__msg *sent) {
  uint64_t rng = seed;
  for (int i = 0; i < nframes; i++) {
    uint64_t id = 1000 + (uint64_t)i;
    if (i % 5 == 4) {
      /* a tensor that claims more bytes than the payload */
      raw_env *r = raw_new(1);
      int64_t shape[] = {3};
      raw_tensor(r, TD_DTYPE_F64, shape, 1);
      raw_frame(b, id, r, 16);
      free(r);
      memset(&sent[i], 0, sizeof sent[i]);
      sent[i].id = id;
      continue;
    }
    int n = (int)(rng_next(&rng) % 4);
    td_value **vals = calloc(4, sizeof *vals);
    assert_non_null(vals);
    for (int k = 0; k < n; k++) vals[k] = random_value(&rng, 0);
    sent[i] = msg_init(id, i % 2 ? "odd" : "even", vals, n);
    sent[i].fn = strdup(sent[i].fn);
    encode_msg(b, &sent[i]);
  }
}

static void check_stream_events(const sink *s, const td__msg *sent, int nframes) {
  assert_int_equal(s->last, TD_OK);
  assert_true(s->idle);
  assert_int_equal(s->n, nframes);
  for (int i = 0; i < nframes; i++) {
    assert_int_equal(s->ev[i].id, sent[i].id);
    assert_int_equal(s->ev[i].bad, i % 5 == 4);
    if (s->ev[i].bad) assert_int_equal(s->ev[i].st, TD_ERR_FORMAT);
    else assert_msg_equal(&sent[i], &s->ev[i].msg);
  }
}

static void test_wire_decoder_chunkings(void **state) {
  enum { NF = 60 };
  td__msg sent[NF];
  bytes b = {0};
  build_stream(&b, NF, 12345, sent);
  sink ref;
  decode(&b, 0, FEED_ALL, 0, &ref);
  check_stream_events(&ref, sent, NF);
  sink s;
  decode(&b, 0, FEED_BYTES, 0, &s);
  assert_same_events(&ref, &s);
  sink_clear(&s);
  for (uint64_t seed = 1; seed <= 20; seed++) {
    decode(&b, 0, FEED_RANDOM, seed, &s);
    assert_true(s.idle);
    assert_same_events(&ref, &s);
    sink_clear(&s);
  }
  sink_clear(&ref);
  for (int i = 0; i < NF; i++) td__msg_clear(&sent[i]);
  bytes_free(&b);

  /* A shorter stream split in two at every position. */
  enum { NS = 5 };
  td__msg sent2[NS];
  bytes b2 = {0};
  build_stream(&b2, NS, 99, sent2);
  decode(&b2, 0, FEED_ALL, 0, &ref);
  check_stream_events(&ref, sent2, NS);
  for (size_t cut = 0; cut <= b2.n; cut++) {
    decode(&b2, 0, FEED_SPLIT, cut, &s);
    assert_true(s.idle);
    assert_same_events(&ref, &s);
    sink_clear(&s);
  }
  sink_clear(&ref);
  for (int i = 0; i < NS; i++) td__msg_clear(&sent2[i]);
  bytes_free(&b2);
}

/* ======================================================================================== */
/* malformed frames                                                                          */
/* ======================================================================================== */

typedef void (*bad_builder)(bytes *b, uint64_t id);

static void bad_garbage_header(bytes *b, uint64_t id) {
  uint8_t h[11];
  memset(h, 0xff, sizeof h); /* an endless varint */
  prefix_put(b, TD__FRAME_MAGIC, sizeof h, 0, id);
  bytes_put(b, h, sizeof h);
}

static void bad_truncated_protobuf(bytes *b, uint64_t id) {
  raw_env *r = raw_new(0);
  r->env.fn = (char *)"abcdefgh"; /* the last field packed: cut inside it */
  size_t hl = tdist__envelope__get_packed_size(&r->env);
  uint8_t h[64];
  assert_true(hl <= sizeof h);
  tdist__envelope__pack(&r->env, h);
  prefix_put(b, TD__FRAME_MAGIC, (uint32_t)(hl - 3), 0, id);
  bytes_put(b, h, hl - 3);
  free(r);
}

static void bad_payload_longer(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {2};
  raw_tensor(r, TD_DTYPE_F32, shape, 1); /* 8 bytes */
  raw_frame(b, id, r, 16);
  free(r);
}

static void bad_payload_shorter(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {4};
  raw_tensor(r, TD_DTYPE_F32, shape, 1); /* 16 bytes */
  raw_frame(b, id, r, 8);
  free(r);
}

static void bad_payload_shorter_second(bytes *b, uint64_t id) {
  raw_env *r = raw_new(2);
  int64_t s1[] = {1}, s2[] = {2, 2};
  raw_tensor(r, TD_DTYPE_F64, s1, 1);
  raw_tensor(r, TD_DTYPE_I64, s2, 2); /* 8 + 32 bytes */
  raw_frame(b, id, r, 39);
  free(r);
}

static void bad_dtype(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {1};
  raw_tensor(r, 3, shape, 1);
  raw_frame(b, id, r, 8);
  free(r);
}

static void bad_dtype_negative(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {1};
  raw_tensor(r, -1, shape, 1);
  raw_frame(b, id, r, 4);
  free(r);
}

static void bad_ndim(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[TD_MAX_DIMS + 1];
  for (int i = 0; i <= TD_MAX_DIMS; i++) shape[i] = 1;
  raw_tensor(r, TD_DTYPE_F32, shape, TD_MAX_DIMS + 1);
  raw_frame(b, id, r, 4);
  free(r);
}

static void bad_negative_dim(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {-2, -3}; /* the product is positive */
  raw_tensor(r, TD_DTYPE_F32, shape, 2);
  raw_frame(b, id, r, 24);
  free(r);
}

static void bad_huge_dims(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {(int64_t)1 << 40, (int64_t)1 << 40, 0}; /* numel 0, but absurd dims */
  raw_tensor(r, TD_DTYPE_F32, shape, 3);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_count_past_nodes(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, TD_VALUE_LIST)->count = 5;
  raw_node(r, TD_VALUE_INT);
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_nested_count_past_nodes(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, TD_VALUE_DICT)->count = 2;
  raw_node(r, TD_VALUE_LIST)->count = 1;
  raw_node(r, TD_VALUE_DICT)->count = UINT32_MAX;
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_tree_truncated(bytes *b, uint64_t id) {
  /* counts within the node list, but the first tree eats the second tree's nodes */
  raw_env *r = raw_new(2);
  raw_node(r, TD_VALUE_LIST)->count = 2;
  raw_node(r, TD_VALUE_INT);
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_device_huge(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {1};
  raw_tensor(r, TD_DTYPE_F32, shape, 1)->device = TD__MAX_CUDA_INDEX + 2; /* cuda:1024 */
  raw_frame(b, id, r, 4);
  free(r);
}

static void bad_device_max(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  int64_t shape[] = {1};
  raw_tensor(r, TD_DTYPE_F32, shape, 1)->device = UINT32_MAX;
  raw_frame(b, id, r, 4);
  free(r);
}

static void bad_device_on_int(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, TD_VALUE_INT)->device = 1;
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_kind_9(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, 9);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_kind_huge(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, TD_VALUE_LIST)->count = 1;
  raw_node(r, 1000);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_unknown_ext(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  Tdist__Node *n = raw_node(r, TD_VALUE_EXT);
  n->s = (char *)"test_wire.no_such_type";
  n->count = 1;
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_ext_no_from_wire(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  Tdist__Node *n = raw_node(r, TD_VALUE_EXT);
  n->s = (char *)"test_wire.local"; /* registered, but cannot be received */
  n->count = 1;
  raw_node(r, TD_VALUE_NONE);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_ext_two_children(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  Tdist__Node *n = raw_node(r, TD_VALUE_EXT);
  n->s = (char *)"test_wire.point";
  n->count = 2;
  raw_node(r, TD_VALUE_DICT);
  raw_node(r, TD_VALUE_DICT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_ext_from_wire_fails(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  Tdist__Node *n = raw_node(r, TD_VALUE_EXT);
  n->s = (char *)"test_wire.point";
  n->count = 1;
  raw_node(r, TD_VALUE_STRING)->s = (char *)"not a point";
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_nargs_past_nodes(bytes *b, uint64_t id) {
  raw_env *r = raw_new(3);
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_trailing_nodes(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  raw_node(r, TD_VALUE_INT);
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_trailing_tensor(bytes *b, uint64_t id) {
  raw_env *r = raw_new(0);
  int64_t shape[] = {2};
  raw_tensor(r, TD_DTYPE_F32, shape, 1);
  raw_frame(b, id, r, 8);
  free(r);
}

static void bad_message_kind_0(bytes *b, uint64_t id) {
  raw_env *r = raw_new(0);
  r->env.kind = 0;
  r->env.fn = (char *)"f";
  raw_frame(b, id, r, 0);
  free(r);
}

static void bad_message_kind_4(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  r->env.kind = 4;
  int64_t shape[] = {1};
  raw_tensor(r, TD_DTYPE_I64, shape, 1);
  raw_frame(b, id, r, 8);
  free(r);
}

static void bad_empty_header(bytes *b, uint64_t id) {
  prefix_put(b, TD__FRAME_MAGIC, 0, 0, id);
}

static void bad_empty_header_with_payload(bytes *b, uint64_t id) {
  prefix_put(b, TD__FRAME_MAGIC, 0, 5, id);
  bytes_put(b, "12345", 5);
}

static void bad_too_deep(bytes *b, uint64_t id) {
  raw_env *r = raw_new(1);
  for (int i = 0; i <= TD__MAX_DEPTH; i++) raw_node(r, TD_VALUE_LIST)->count = 1;
  raw_node(r, TD_VALUE_INT);
  raw_frame(b, id, r, 0);
  free(r);
}

static const struct {
  const char *name;
  bad_builder build;
} bad_cases[] = {
    {"garbage header", bad_garbage_header},
    {"truncated protobuf", bad_truncated_protobuf},
    {"payload longer than the tensors", bad_payload_longer},
    {"tensor larger than the payload", bad_payload_shorter},
    {"second tensor past the payload", bad_payload_shorter_second},
    {"dtype 3", bad_dtype},
    {"dtype -1", bad_dtype_negative},
    {"ndim 9", bad_ndim},
    {"negative dims", bad_negative_dim},
    {"huge dims", bad_huge_dims},
    {"list count past the nodes", bad_count_past_nodes},
    {"nested count past the nodes", bad_nested_count_past_nodes},
    {"tree eats the next tree", bad_tree_truncated},
    {"tensor device cuda:1024", bad_device_huge},
    {"tensor device 2^32-1", bad_device_max},
    {"device on an int", bad_device_on_int},
    {"value kind 9", bad_kind_9},
    {"value kind 1000", bad_kind_huge},
    {"unknown extension type", bad_unknown_ext},
    {"extension type without from_wire", bad_ext_no_from_wire},
    {"extension with two children", bad_ext_two_children},
    {"extension from_wire fails", bad_ext_from_wire_fails},
    {"nargs past the nodes", bad_nargs_past_nodes},
    {"trailing nodes", bad_trailing_nodes},
    {"trailing tensor", bad_trailing_tensor},
    {"message kind 0", bad_message_kind_0},
    {"message kind 4", bad_message_kind_4},
    {"empty header", bad_empty_header},
    {"empty header with payload", bad_empty_header_with_payload},
    {"nested deeper than TD__MAX_DEPTH", bad_too_deep},
};

/* Each malformed frame, between two good ones, is reported by its id and the stream goes on. */
static void test_wire_bad_frames_skipped(void **state) {
  int live0 = point_live;
  size_t ncases = sizeof bad_cases / sizeof *bad_cases;
  for (size_t c = 0; c < ncases; c++) {
    uint64_t bad_id = 200 + c;
    bytes b = {0};
    td_value *v1[] = {td_value_string("before")};
    td_value *v2[] = {point_value(3, 4)};
    encode_values(&b, 100, v1, 1);
    bad_cases[c].build(&b, bad_id);
    encode_values(&b, 300, v2, 1);
    int modes[] = {FEED_ALL, FEED_BYTES, FEED_RANDOM, FEED_RANDOM};
    for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
      sink s;
      decode(&b, 0, modes[k], k, &s);
      if (s.n != 3 || s.ev[0].bad || !s.ev[1].bad || s.ev[2].bad || s.last != TD_OK)
        fail_msg("case '%s', mode %zu: %d events (last feed %s)", bad_cases[c].name, k, s.n,
                 td_status_name(s.last));
      assert_int_equal(s.ev[0].id, 100);
      assert_int_equal(s.ev[1].id, bad_id);
      assert_int_equal(s.ev[1].st, TD_ERR_FORMAT);
      assert_true(s.ev[1].why[0] != '\0');
      assert_int_equal(s.ev[2].id, 300);
      assert_true(td_value_equal(s.ev[2].msg.values[0], v2[0]));
      assert_true(s.idle);
      sink_clear(&s);
    }
    bytes_free(&b);
    td_value_unref(v1[0]);
    td_value_unref(v2[0]);
  }
  assert_int_equal(point_live, live0);
}

/* A malformed frame at the very end of what arrived is reported at once, not when the next
 * frame's bytes come (an empty header used to wait for one more byte). */
static void test_wire_bad_frame_reported_at_once(void **state) {
  size_t ncases = sizeof bad_cases / sizeof *bad_cases;
  for (size_t c = 0; c < ncases; c++) {
    bytes b = {0};
    bad_cases[c].build(&b, 7);
    sink s;
    decode(&b, 0, FEED_ALL, 0, &s);
    if (s.n != 1 || !s.ev[0].bad || !s.idle)
      fail_msg("case '%s': %d events, idle %d", bad_cases[c].name, s.n, s.idle);
    assert_int_equal(s.ev[0].id, 7);
    sink_clear(&s);
    bytes_free(&b);
  }
}

/* TD__MAX_DEPTH nested containers (what the encoder makes) are accepted; one more is not. */
static void test_wire_depth_limit(void **state) {
  for (int extra = 0; extra <= 1; extra++) {
    int depth = TD__MAX_DEPTH + extra;
    td_value *v = td_value_int(1);
    for (int i = 0; i < depth; i++) {
      td_value *c = i % 3 == 2 ? td_value_dict() : td_value_list();
      if (td_value_kind_of(c) == TD_VALUE_DICT) set(c, "k", v);
      else append(c, v);
      v = c;
    }
    bytes b = {0};
    td_value *vals[] = {v};
    td_value *next[] = {td_value_int(5)};
    encode_values(&b, 1, vals, 1);
    encode_values(&b, 2, next, 1);
    sink s;
    decode(&b, 0, FEED_ALL, 0, &s);
    assert_int_equal(s.n, 2);
    assert_int_equal(s.ev[0].id, 1);
    if (extra) {
      assert_true(s.ev[0].bad);
      assert_int_equal(s.ev[0].st, TD_ERR_FORMAT);
      assert_non_null(strstr(s.ev[0].why, "deeper"));
    } else {
      assert_false(s.ev[0].bad);
      assert_true(td_value_equal(s.ev[0].msg.values[0], v));
    }
    assert_false(s.ev[1].bad);
    assert_int_equal(s.ev[1].id, 2);
    sink_clear(&s);
    bytes_free(&b);
    td_value_unref(v);
    td_value_unref(next[0]);
  }
}

/* ======================================================================================== */
/* limits and corruption                                                                     */
/* ======================================================================================== */

static void test_wire_max_message_bytes(void **state) {
  int64_t shape[] = {1000};
  td_tensor *big = NULL, *small = NULL;
  TD_ASSERT_OK(td_tensor_zeros(shape, 1, TD_DTYPE_F64, td_device_cpu(), &big)); /* 8000 B */
  shape[0] = 10;
  TD_ASSERT_OK(td_tensor_zeros(shape, 1, TD_DTYPE_F64, td_device_cpu(), &small));
  char longstr[3000];
  memset(longstr, 's', sizeof longstr - 1);
  longstr[sizeof longstr - 1] = '\0';
  td_value *vsmall[] = {tensor_value(small)}, *vbig[] = {tensor_value(big)},
           *vstr[] = {td_value_string(longstr)};
  bytes one = {0};
  encode_values(&one, 3, vsmall, 1);
  /* the limit counts envelope + payload; frame 3 (and 1 and 5, same size) is exactly at it */
  uint64_t limit = one.n - TD__FRAME_PREFIX;
  bytes b = {0};
  encode_values(&b, 1, vsmall, 1);
  encode_values(&b, 2, vbig, 1); /* the payload is over the limit */
  bytes_put(&b, one.p, one.n);
  encode_values(&b, 4, vstr, 1); /* the header alone is over the limit */
  encode_values(&b, 5, vsmall, 1);
  int modes[] = {FEED_ALL, FEED_BYTES, FEED_RANDOM};
  for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
    sink s;
    decode(&b, limit, modes[k], 3, &s);
    assert_int_equal(s.last, TD_OK);
    assert_true(s.idle);
    assert_int_equal(s.n, 5);
    for (int i = 0; i < 5; i++) {
      assert_int_equal(s.ev[i].id, (uint64_t)i + 1);
      bool want_bad = i == 1 || i == 3;
      assert_int_equal(s.ev[i].bad, want_bad);
      if (want_bad) {
        assert_int_equal(s.ev[i].st, TD_ERR_INVALID);
        assert_non_null(strstr(s.ev[i].why, "limit"));
      }
    }
    assert_true(td_value_equal(s.ev[4].msg.values[0], vsmall[0]));
    sink_clear(&s);
  }
  /* one byte less and the frames at the limit are refused too */
  sink s;
  decode(&b, limit - 1, FEED_ALL, 0, &s);
  assert_int_equal(s.n, 5);
  for (int i = 0; i < 5; i++) assert_true(s.ev[i].bad);
  sink_clear(&s);
  /* unlimited: everything decodes */
  decode(&b, 0, FEED_ALL, 0, &s);
  assert_int_equal(s.n, 5);
  for (int i = 0; i < 5; i++) assert_false(s.ev[i].bad);
  assert_true(td_value_equal(s.ev[1].msg.values[0], vbig[0]));
  sink_clear(&s);
  bytes_free(&b);
  bytes_free(&one);
  unref_all(vsmall, 1);
  unref_all(vbig, 1);
  unref_all(vstr, 1);
}

/* An envelope above TD__MAX_HEADER is refused from the prefix alone and skipped unread. */
static void test_wire_oversized_header(void **state) {
  bytes b = {0};
  uint64_t skip = (uint64_t)TD__MAX_HEADER + 1 + 100;
  prefix_put(&b, TD__FRAME_MAGIC, TD__MAX_HEADER + 1, 100, 9);
  bytes_zeros(&b, (size_t)skip);
  td_value *v[] = {td_value_int(77)};
  encode_values(&b, 10, v, 1);
  sink s;
  decode(&b, 0, FEED_RANDOM, 1, &s);
  assert_int_equal(s.last, TD_OK);
  assert_int_equal(s.n, 2);
  assert_true(s.ev[0].bad);
  assert_int_equal(s.ev[0].id, 9);
  assert_int_equal(s.ev[0].st, TD_ERR_INVALID);
  assert_false(s.ev[1].bad);
  assert_int_equal(s.ev[1].id, 10);
  assert_true(td_value_equal(s.ev[1].msg.values[0], v[0]));
  assert_true(s.idle);
  sink_clear(&s);
  bytes_free(&b);
  td_value_unref(v[0]);
}

static void test_wire_bad_magic(void **state) {
  td_value *v[] = {td_value_int(1)};
  bytes good = {0};
  encode_values(&good, 1, v, 1);
  /* a good frame, then a prefix with a wrong magic, then another good frame (never reached) */
  bytes b = {0};
  bytes_put(&b, good.p, good.n);
  prefix_put(&b, 0x31464455u, 2, 0, 2);
  bytes_put(&b, good.p, good.n);
  int modes[] = {FEED_ALL, FEED_BYTES, FEED_RANDOM};
  for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
    sink s;
    decode(&b, 0, modes[k], 5, &s);
    assert_int_equal(s.last, TD_ERR_FORMAT);
    assert_non_null(strstr(td_last_error(), "magic"));
    assert_int_equal(s.n, 1);
    assert_false(s.ev[0].bad);
    assert_int_equal(s.ev[0].id, 1);
    sink_clear(&s);
  }
  /* garbage from the first byte */
  bytes g = {0};
  bytes_put(&g, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27);
  sink s;
  decode(&g, 0, FEED_ALL, 0, &s);
  assert_int_equal(s.last, TD_ERR_FORMAT);
  assert_int_equal(s.n, 0);
  sink_clear(&s);
  bytes_free(&g);
  bytes_free(&b);
  bytes_free(&good);
  td_value_unref(v[0]);
}

/* Destroying a decoder in the middle of a frame (prefix, header, payload) frees what it holds. */
static void test_wire_destroy_mid_frame(void **state) {
  int64_t shape[] = {64};
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_zeros(shape, 1, TD_DTYPE_F32, td_device_cpu(), &t));
  td_value *l = td_value_list();
  append(l, tensor_value(t));
  append(l, point_value(1, 2));
  td_value *v[] = {l};
  bytes b = {0};
  encode_values(&b, 1, v, 1);
  size_t cuts[] = {1, TD__FRAME_PREFIX, TD__FRAME_PREFIX + 3, b.n - 256, b.n - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++) {
    sink s = {0};
    td__decoder *d = NULL;
    TD_ASSERT_OK(td__decoder_create(&dec_ctx, 0, sink_on_msg, sink_on_bad, &s, &d));
    TD_ASSERT_OK(td__decoder_feed(d, b.p, cuts[i]));
    assert_false(td__decoder_idle(d));
    assert_int_equal(s.n, 0);
    td__decoder_destroy(d);
    sink_clear(&s);
  }
  td__decoder_destroy(NULL);
  bytes_free(&b);
  td_value_unref(l);
}

/* Regression: header_len + payload_len wrapped around 2^64, so a frame claiming a payload of
 * nearly 2^64 bytes passed the max_message_bytes check and the decoder allocated the tensors it
 * described (2^62 bytes here; fuzz/fuzz_wire_decoder aborted on it). The same bytes are kept in
 * fuzz/corpus/wire_decoder/regress_payload_len_wraps_limit (after its selector byte). */
static void test_wire_regress_payload_len_wrap(void **state) {
  static const uint8_t frame[] = {
      0x54, 0x44, 0x46, 0x31, 0x15, 0x00, 0x00, 0x00, 0xf5, 0xff, 0xff, 0xff, 0xff, 0xff,
      0xff, 0xff, 0x4d, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x01, 0x20, 0x01,
      0x2a, 0x0f, 0x08, 0x06, 0x38, 0x01, 0x42, 0x09, 0x80, 0x80, 0x80, 0x80, 0x80, 0x20,
      0x80, 0x80, 0x20};
  bytes b = {0};
  bytes_put(&b, frame, sizeof frame);
  int modes[] = {FEED_ALL, FEED_BYTES};
  for (size_t k = 0; k < 2; k++) {
    sink s;
    decode(&b, 1u << 20, modes[k], 0, &s);
    assert_int_equal(s.last, TD_OK);
    assert_int_equal(s.n, 1);
    assert_true(s.ev[0].bad);
    assert_int_equal(s.ev[0].id, 77);
    assert_int_equal(s.ev[0].st, TD_ERR_INVALID);
    sink_clear(&s);
  }
  bytes_free(&b);
}

/* ---- direct-copy frames: the receiver reads the tensors from the sender's memory (here: this
 * process, which process_vm_readv allows) ---- */

static int dc_allowed_pid;
static uint64_t dc_sent_acks[64], dc_got_acks[64];
static int dc_nsent, dc_ngot;

static bool dc_allowed(void *ud, int pid) { return pid == dc_allowed_pid; }
static void dc_send_ack(void *ud, uint64_t token) {
  assert_true(dc_nsent < 64);
  dc_sent_acks[dc_nsent++] = token;
}
static void dc_acked(void *ud, uint64_t token) {
  assert_true(dc_ngot < 64);
  dc_got_acks[dc_ngot++] = token;
}
static const td__direct_hooks dc_hooks = {dc_allowed, dc_send_ack, dc_acked};

/* Appends m as a direct-copy frame with token; *f keeps the tensors the descriptor points to
 * (the caller clears it after decoding). addr_delta / len_delta corrupt the first tensor's entry. */
static void encode_direct(bytes *b, const td__msg *m, uint64_t token, td__frame *f,
                          uint64_t addr_override, int64_t len_delta) {
  td__wire_ctx ctx = enc_ctx;
  TD_ASSERT_OK(td__wire_encode(m, &ctx, f));
  uint8_t *desc;
  size_t dl;
  TD_ASSERT_OK(td__direct_encode(f, token, (int)getpid(), &desc, &dl));
  assert_int_equal(dl, 16 + 16 * (size_t)f->ntensors);
  if (addr_override) memcpy(desc + 16, &addr_override, 8); /* little-endian host */
  if (len_delta) {
    uint64_t len;
    memcpy(&len, desc + 24, 8);
    len += (uint64_t)len_delta;
    memcpy(desc + 24, &len, 8);
  }
  bytes_put(b, f->head, f->head_len);
  bytes_put(b, desc, dl);
  td__free(desc);
}

static void test_wire_direct_copy(void **state) {
  /* a message with a large tensor, an empty one and a small one inside a list */
  td_tensor *big, *empty, *small;
  int64_t bshape[2] = {100, 300}, eshape[2] = {3, 0}, sshape[1] = {5};
  TD_ASSERT_OK(td_tensor_arange(0, 30000, 1, TD_DTYPE_F32, td_device_cpu(), &big));
  td_tensor *bv;
  TD_ASSERT_OK(td_tensor_reshape(big, bshape, 2, &bv));
  TD_ASSERT_OK(td_tensor_zeros(eshape, 2, TD_DTYPE_F64, td_device_cpu(), &empty));
  TD_ASSERT_OK(td_tensor_full(sshape, 1, -2.5, TD_DTYPE_F64, td_device_cpu(), &small));
  td_value *l = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l, td_value_tensor(empty)));
  TD_ASSERT_OK(td_value_list_append(l, td_value_tensor(small)));
  td_value *vals[2] = {td_value_tensor(bv), l};
  td__msg m = msg_init(9, "fn", vals, 2);
  td_value *plain[1] = {td_value_int(5)};
  td__msg pm = msg_init(10, "after", plain, 1);
  g_direct_hooks = &dc_hooks;
  int modes[] = {FEED_ALL, FEED_BYTES, FEED_RANDOM};
  for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
    /* allowed: the values arrive intact, the token is acknowledged; the next frame decodes */
    dc_allowed_pid = (int)getpid();
    dc_nsent = dc_ngot = 0;
    bytes b = {0};
    td__frame f;
    encode_direct(&b, &m, 41, &f, 0, 0);
    encode_msg(&b, &pm);
    sink s;
    decode(&b, 0, modes[k], 7, &s);
    TD_ASSERT_OK(s.last);
    assert_true(s.idle);
    assert_int_equal(s.n, 2);
    assert_false(s.ev[0].bad);
    assert_msg_equal(&s.ev[0].msg, &m);
    assert_false(s.ev[1].bad);
    assert_msg_equal(&s.ev[1].msg, &pm);
    assert_int_equal(dc_nsent, 1);
    assert_int_equal(dc_sent_acks[0], 41);
    sink_clear(&s);
    td__frame_clear(&f);
    bytes_free(&b);
  }
  /* refused frames are reported by id, acknowledged, and the stream goes on */
  struct {
    int allowed_pid;
    uint64_t addr;
    int64_t len_delta;
    uint64_t max_msg;
    td_status st;
    const char *why;
  } bad[] = {
      {-1, 0, 0, 0, TD_ERR_FORMAT, "not allowed"},
      {0, 8, 0, 0, TD_ERR_UNAVAILABLE, "cannot read"},
      {0, 0, 4, 0, TD_ERR_FORMAT, "bytes, not"},
      {0, 0, 0, 1000, TD_ERR_INVALID, "exceeds the limit"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    dc_allowed_pid = bad[i].allowed_pid ? bad[i].allowed_pid : (int)getpid();
    dc_nsent = dc_ngot = 0;
    bytes b = {0};
    td__frame f;
    encode_direct(&b, &m, 100 + i, &f, bad[i].addr, bad[i].len_delta);
    encode_msg(&b, &pm);
    sink s;
    decode(&b, bad[i].max_msg, FEED_RANDOM, i, &s);
    TD_ASSERT_OK(s.last);
    assert_int_equal(s.n, 2);
    assert_true(s.ev[0].bad);
    assert_int_equal(s.ev[0].id, 9);
    assert_int_equal(s.ev[0].st, bad[i].st);
    if (!strstr(s.ev[0].why, bad[i].why)) fail_msg("case %zu: '%s'", i, s.ev[0].why);
    assert_false(s.ev[1].bad);
    assert_int_equal(dc_nsent, 1);
    assert_int_equal(dc_sent_acks[0], 100 + i);
    sink_clear(&s);
    td__frame_clear(&f);
    bytes_free(&b);
  }
  /* ack frames reach the hook; an ack with a body corrupts the stream */
  dc_nsent = dc_ngot = 0;
  bytes b = {0};
  uint8_t ack[TD__FRAME_PREFIX];
  td__direct_ack_frame(ack, 77);
  bytes_put(&b, ack, sizeof ack);
  encode_msg(&b, &pm);
  td__direct_ack_frame(ack, 78);
  bytes_put(&b, ack, sizeof ack);
  sink s;
  decode(&b, 0, FEED_BYTES, 0, &s);
  TD_ASSERT_OK(s.last);
  assert_int_equal(s.n, 1);
  assert_int_equal(dc_ngot, 2);
  assert_int_equal(dc_got_acks[0], 77);
  assert_int_equal(dc_got_acks[1], 78);
  sink_clear(&s);
  bytes_free(&b);
  prefix_put(&b, TD__FRAME_MAGIC_ACK, 4, 0, 79);
  decode(&b, 0, FEED_ALL, 0, &s);
  assert_int_equal(s.last, TD_ERR_FORMAT);
  sink_clear(&s);
  bytes_free(&b);
  /* without hooks (a decoder that was never told about direct copy) the frame is refused */
  g_direct_hooks = NULL;
  td__frame f;
  encode_direct(&b, &m, 5, &f, 0, 0);
  decode(&b, 0, FEED_ALL, 0, &s);
  TD_ASSERT_OK(s.last);
  assert_int_equal(s.n, 1);
  assert_true(s.ev[0].bad);
  sink_clear(&s);
  td__frame_clear(&f);
  bytes_free(&b);
  td_value_unref(plain[0]);
  td_value_unref(vals[0]);
  td_value_unref(vals[1]);
  td_tensor_unref(bv);
  td_tensor_unref(big);
  td_tensor_unref(empty);
  td_tensor_unref(small);
}

/* put_frame appends f (prefix + header + tensor bytes) to b. */
static void put_frame(bytes *b, const td__frame *f) {
  bytes_put(b, f->head, f->head_len);
  for (int i = 0; i < f->ntensors; i++)
    bytes_put(b, td_tensor_data(f->tensors[i]), td_tensor_nbytes(f->tensors[i]));
}

/* frame_devices stores the Node.device of the first n nodes of f's envelope in out. */
static void frame_devices(const td__frame *f, uint32_t *out, size_t n) {
  Tdist__Envelope *env = tdist__envelope__unpack(NULL, f->head_len - TD__FRAME_PREFIX,
                                                 f->head + TD__FRAME_PREFIX);
  assert_non_null(env);
  assert_true(env->n_nodes >= n);
  for (size_t i = 0; i < n; i++) out[i] = env->nodes[i]->device;
  tdist__envelope__free_unpacked(env, NULL);
}

/* Device maps (td__wire_ctx.devmap): a tensor on a mapped device is marked with its target; the
 * decoder places it there, or - without that device in this process - reports the frame with
 * TD_ERR_DEVICE and goes on with the next. CUDA tensors need an entry (checked with a GPU). */
static void test_wire_device_map(void **state) {
  int ncuda = td_cuda_device_count();
  const float data[] = {1, 2, 3, 4, 5, 6};
  int64_t shape[] = {2, 3};
  td_value *v[] = {tensor_of(data, shape, 2, TD_DTYPE_F32), td_value_int(5)};
  td_value *after[] = {td_value_string("after")};
  td__devmap_entry to_cuda[] = {{td_device_cpu(), td_device_cuda(0)}};
  td__devmap_entry to_cpu[] = {{td_device_cpu(), td_device_cpu()}};
  td__devmap map = {to_cuda, 1}, cpu_map = {to_cpu, 1}, empty = {NULL, 0};
  td__wire_ctx ctx = {NULL, 1, 0, &map, "peer1"};
  td__msg m = msg_init(21, "f", v, 2);
  td__frame f;
  uint32_t dev[2];

  /* cpu -> cpu (and no entry for cpu): nothing is marked, the tensor arrives on the CPU */
  td__devmap *plain_maps[] = {&cpu_map, &empty};
  for (int i = 0; i < 2; i++) {
    ctx.devmap = plain_maps[i];
    TD_ASSERT_OK(td__wire_encode(&m, &ctx, &f));
    frame_devices(&f, dev, 2);
    assert_int_equal(dev[0], 0);
    bytes b = {0};
    put_frame(&b, &f);
    td__frame_clear(&f);
    td__msg got;
    decode_one(&b, &got);
    assert_msg_equal(&m, &got);
    td_tensor *t;
    TD_ASSERT_OK(td_value_as_tensor(got.values[0], &t));
    assert_int_equal(td_tensor_device(t).type, TD_DEVICE_CPU);
    td__msg_clear(&got);
    bytes_free(&b);
  }

  /* cpu -> cuda:0: marked as device 1 (cuda:0); the int is not marked */
  ctx.devmap = &map;
  TD_ASSERT_OK(td__wire_encode(&m, &ctx, &f));
  frame_devices(&f, dev, 2);
  assert_int_equal(dev[0], 1);
  assert_int_equal(dev[1], 0);
  assert_int_equal(td_tensor_device(f.tensors[0]).type, TD_DEVICE_CPU);
  bytes b = {0};
  put_frame(&b, &f);
  td__frame_clear(&f);
  encode_values(&b, 22, after, 1);
  int modes[] = {FEED_ALL, FEED_BYTES, FEED_RANDOM};
  for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) {
    sink s;
    decode(&b, 0, modes[k], k, &s);
    TD_ASSERT_OK(s.last);
    assert_int_equal(s.n, 2);
    assert_int_equal(s.ev[0].id, 21);
    if (ncuda == 0) {
      assert_true(s.ev[0].bad);
      assert_int_equal(s.ev[0].st, TD_ERR_DEVICE);
      if (!strstr(s.ev[0].why, "cuda:0")) fail_msg("why: '%s'", s.ev[0].why);
    } else {
      assert_false(s.ev[0].bad);
      assert_msg_equal(&m, &s.ev[0].msg);
      td_tensor *t;
      TD_ASSERT_OK(td_value_as_tensor(s.ev[0].msg.values[0], &t));
      assert_true(td_device_equal(td_tensor_device(t), td_device_cuda(0)));
    }
    assert_false(s.ev[1].bad);
    assert_int_equal(s.ev[1].id, 22);
    sink_clear(&s);
  }
  bytes_free(&b);

  if (ncuda > 0) {
    /* a CUDA tensor: refused without an entry (request and reply wording), staged with one */
    td_tensor *gt;
    td_tensor *ht;
    TD_ASSERT_OK(td_value_as_tensor(v[0], &ht));
    TD_ASSERT_OK(td_tensor_to(ht, td_device_cuda(0), &gt));
    td_value *gv[] = {td_value_tensor(gt)};
    td__msg gm = msg_init(23, "f", gv, 1);
    ctx.devmap = &cpu_map;
    TD_ASSERT_STATUS(td__wire_encode(&gm, &ctx, &f), TD_ERR_DEVICE);
    assert_non_null(strstr(td_last_error(), "cuda:0"));
    assert_non_null(strstr(td_last_error(), "peer1 (rank 1)"));
    gm.kind = TD__MSG_RESPONSE;
    TD_ASSERT_STATUS(td__wire_encode(&gm, &ctx, &f), TD_ERR_DEVICE);
    assert_non_null(strstr(td_last_error(), "sent back to peer1"));
    gm.kind = TD__MSG_REQUEST;
    td__devmap_entry back[] = {{td_device_cuda(0), td_device_cpu()}};
    td__devmap back_map = {back, 1};
    ctx.devmap = &back_map;
    TD_ASSERT_OK(td__wire_encode(&gm, &ctx, &f));
    frame_devices(&f, dev, 1);
    assert_int_equal(dev[0], 0);
    assert_int_equal(td_tensor_device(f.tensors[0]).type, TD_DEVICE_CPU);
    put_frame(&b, &f);
    td__frame_clear(&f);
    td__msg got;
    decode_one(&b, &got);
    assert_msg_equal(&gm, &got);
    td_tensor *t;
    TD_ASSERT_OK(td_value_as_tensor(got.values[0], &t));
    assert_int_equal(td_tensor_device(t).type, TD_DEVICE_CPU);
    td__msg_clear(&got);
    bytes_free(&b);
    td_value_unref(gv[0]);
    td_tensor_unref(gt);
  } else {
    print_message("test_wire_device_map: no CUDA device; the CUDA-tensor cases are left to "
                  "test_rpc_devmap_gpu\n");
  }
  unref_all(v, 2);
  unref_all(after, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_wire_roundtrip_scalars),
      cmocka_unit_test(test_wire_string_with_nul),
      cmocka_unit_test(test_wire_roundtrip_containers),
      cmocka_unit_test(test_wire_roundtrip_tensors),
      cmocka_unit_test(test_wire_roundtrip_many_tensors),
      cmocka_unit_test(test_wire_noncontiguous_tensor),
      cmocka_unit_test(test_wire_message_fields),
      cmocka_unit_test(test_wire_extension_roundtrip),
      cmocka_unit_test(test_wire_encode_errors),
      cmocka_unit_test(test_wire_decoder_chunkings),
      cmocka_unit_test(test_wire_bad_frames_skipped),
      cmocka_unit_test(test_wire_bad_frame_reported_at_once),
      cmocka_unit_test(test_wire_depth_limit),
      cmocka_unit_test(test_wire_max_message_bytes),
      cmocka_unit_test(test_wire_oversized_header),
      cmocka_unit_test(test_wire_bad_magic),
      cmocka_unit_test(test_wire_destroy_mid_frame),
      cmocka_unit_test(test_wire_regress_payload_len_wrap),
      cmocka_unit_test(test_wire_direct_copy),
      cmocka_unit_test(test_wire_device_map),
  };
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
