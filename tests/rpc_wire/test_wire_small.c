/* test_wire_small.c - the fast paths of the envelope codec (rpc/wire_small.c) against protobuf-c,
 * the reference for what envelope bytes mean: the packer must write protobuf-c's bytes; on every
 * envelope the parser takes, protobuf-c must give the same fields; the envelopes tdist itself
 * sends (small ones) must be taken; and what it declines (repeated scalars, unknown fields, long
 * tags, other wire types, unpacked arrays, too many nodes, long envelopes, truncations) must
 * still decode, through protobuf-c, to what protobuf-c says, in a real decoder.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/wire.h"
#include "rpc/wire_small.h"
#include "tdist.pb-c.h"
#include "test_util.h"

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static bool bin_same(ProtobufCBinaryData a, ProtobufCBinaryData b) {
  return a.len == b.len && (a.len == 0 ? a.data == NULL && b.data == NULL
                                       : memcmp(a.data, b.data, a.len) == 0);
}

static void assert_node_same(const Tdist__Node *a, const Tdist__Node *b) {
  assert_int_equal(a->kind, b->kind);
  assert_int_equal(a->b, b->b);
  assert_int_equal(a->i, b->i);
  assert_memory_equal(&a->d, &b->d, sizeof a->d);
  assert_string_equal(a->s, b->s);
  assert_true(bin_same(a->by, b->by));
  assert_int_equal(a->dtype, b->dtype);
  assert_int_equal(a->n_shape, b->n_shape);
  if (a->n_shape) assert_memory_equal(a->shape, b->shape, a->n_shape * sizeof *a->shape);
  assert_int_equal(a->count, b->count);
  assert_string_equal(a->key, b->key);
  assert_int_equal(a->device, b->device);
}

/* Parses p[0..n) both ways; returns whether the fast path took it (then the two agree). */
static bool check_both(const uint8_t *p, size_t n) {
  static td__small_env s;
  bool took = td__small_env_parse(&s, p, n);
  Tdist__Envelope *ref = tdist__envelope__unpack(NULL, n, p);
  if (took) {
    assert_non_null(ref);
    const Tdist__Envelope *e = &s.env;
    assert_int_equal(e->kind, ref->kind);
    assert_string_equal(e->fn, ref->fn);
    assert_int_equal(e->from_rank, ref->from_rank);
    assert_int_equal(e->nargs, ref->nargs);
    assert_int_equal(e->status, ref->status);
    assert_string_equal(e->message, ref->message);
    assert_int_equal(e->timeout_ms, ref->timeout_ms);
    assert_int_equal(e->ctx_id, ref->ctx_id);
    assert_int_equal(e->autograd_msg_id, ref->autograd_msg_id);
    assert_int_equal(e->n_aux, ref->n_aux);
    if (e->n_aux) assert_memory_equal(e->aux, ref->aux, e->n_aux * sizeof *e->aux);
    assert_int_equal(e->n_nodes, ref->n_nodes);
    for (size_t i = 0; i < e->n_nodes; i++) assert_node_same(e->nodes[i], ref->nodes[i]);
    assert_int_equal(ref->base.n_unknown_fields, 0);
  }
  if (ref) tdist__envelope__free_unpacked(ref, NULL);
  return took;
}

/* A value likely to sit at an edge: 0, small, negative, the largest of its width. */
static uint64_t edge(uint64_t *rs) {
  static const uint64_t edges[] = {0, 1, 127, 128, 16383, 16384, 0x7fffffffu, 0x80000000u,
                                   0xffffffffu, 0x100000000ull, (uint64_t)-1, (uint64_t)-2,
                                   0x8000000000000000ull};
  uint64_t r = rng_next(rs);
  return r % 3 ? edges[r % (sizeof edges / sizeof edges[0])] : rng_next(rs);
}

static char text_pool[64][24];

/* A string of up to 12 bytes, sometimes holding a NUL (protobuf-c keeps the bytes; C reads up
 * to the NUL) or a byte above 0x7f. */
static char *rand_text(uint64_t *rs, int slot, size_t *len) {
  char *t = text_pool[slot % 64];
  size_t n = rng_next(rs) % 13;
  for (size_t i = 0; i < n; i++) t[i] = (char)(rng_next(rs) % 7 == 0 ? rng_next(rs) : 'a' + i);
  t[n] = 0;
  *len = n;
  return t;
}

/* A random envelope with every field (edge values, strings with NULs, empty and full bytes,
 * shapes, aux ids, 0 to 11 nodes), in storage of its own. */
typedef struct rand_env {
  Tdist__Envelope env;
  Tdist__Node nodes[12], *ptrs[12];
  int64_t shapes[12][5];
  uint64_t aux[10];
} rand_env;

static void rand_env_fill(rand_env *r, uint64_t *rs) {
  Tdist__Envelope *env = &r->env;
  tdist__envelope__init(env);
  size_t len;
  int slot = 0;
  env->kind = (uint32_t)edge(rs);
  if (rng_next(rs) & 1) env->fn = rand_text(rs, slot++, &len);
  env->from_rank = (int32_t)edge(rs);
  env->nargs = (uint32_t)edge(rs);
  env->status = (int32_t)edge(rs);
  if (rng_next(rs) % 4 == 0) env->message = rand_text(rs, slot++, &len);
  env->timeout_ms = (int64_t)edge(rs);
  env->ctx_id = edge(rs);
  env->autograd_msg_id = edge(rs);
  env->n_aux = rng_next(rs) % 3 == 0 ? rng_next(rs) % 10 : 0;
  for (size_t i = 0; i < env->n_aux; i++) r->aux[i] = edge(rs);
  env->aux = r->aux;
  env->n_nodes = rng_next(rs) % 12;
  for (size_t i = 0; i < env->n_nodes; i++) {
    Tdist__Node *n = &r->nodes[i];
    tdist__node__init(n);
    n->kind = (uint32_t)(rng_next(rs) % 12);
    n->b = rng_next(rs) & 1;
    n->i = (int64_t)edge(rs);
    uint64_t dbits = rng_next(rs) % 3 ? edge(rs) : 0x8000000000000000ull; /* -0.0 too */
    memcpy(&n->d, &dbits, sizeof dbits);
    if (rng_next(rs) & 1) n->s = rand_text(rs, slot++, &len);
    if (rng_next(rs) % 3 == 0) {
      n->by.data = (uint8_t *)rand_text(rs, slot++, &len);
      n->by.len = len;
    }
    n->dtype = (int32_t)edge(rs);
    n->n_shape = rng_next(rs) % 6;
    for (size_t k = 0; k < n->n_shape; k++) r->shapes[i][k] = (int64_t)edge(rs);
    n->shape = r->shapes[i];
    n->count = (uint32_t)edge(rs);
    if (rng_next(rs) % 3 == 0) n->key = rand_text(rs, slot++, &len);
    n->device = (uint32_t)edge(rs);
    r->ptrs[i] = n;
  }
  env->nodes = r->ptrs;
}

/* Envelopes of every field, packed by protobuf-c, and (odd rounds) with one byte changed. */
static void test_wire_small_matches_protobuf_c(void **state) {
  (void)state;
  uint64_t rs = 27;
  int took = 0, small_sent = 0;
  for (int round = 0; round < 4000; round++) {
    static rand_env r;
    rand_env_fill(&r, &rs);
    size_t hl = tdist__envelope__get_packed_size(&r.env);
    uint8_t *buf = malloc(hl ? hl : 1);
    assert_non_null(buf);
    assert_int_equal(tdist__envelope__pack(&r.env, buf), hl);
    size_t dims = 0;
    for (size_t i = 0; i < r.env.n_nodes; i++) dims += r.nodes[i].n_shape;
    bool fits = hl <= TD__SMALL_HEADER && r.env.n_nodes <= TD__SMALL_NODES &&
                dims <= TD__SMALL_DIMS && r.env.n_aux <= TD__SMALL_AUX;
    if (round & 1 && hl) buf[rng_next(&rs) % hl] ^= (uint8_t)(1 + rng_next(&rs) % 255);
    bool t = check_both(buf, hl);
    took += t;
    /* what protobuf-c itself packs within the limits is always taken */
    if (!(round & 1) && fits) {
      assert_true(t);
      small_sent++;
    }
    for (size_t cut = 0; round % 16 == 0 && cut < hl; cut++) check_both(buf, cut);
    free(buf);
  }
  print_message("fast path took %d of 4000 envelopes (%d of the unchanged ones within its "
                "limits)\n", took, small_sent);
  assert_true(small_sent > 500);
}

/* The encoder's packer writes the bytes protobuf-c writes, for envelopes of every field. */
static void test_wire_small_pack_matches_protobuf_c(void **state) {
  (void)state;
  uint64_t rs = 2027;
  for (int round = 0; round < 4000; round++) {
    static rand_env r;
    rand_env_fill(&r, &rs);
    size_t hl = tdist__envelope__get_packed_size(&r.env);
    assert_int_equal(td__env_packed_size(&r.env), hl);
    uint8_t *want = malloc(hl + 1), *got = malloc(hl + 1);
    assert_true(want && got);
    got[hl] = 0xa5; /* nothing written past the size */
    assert_int_equal(tdist__envelope__pack(&r.env, want), hl);
    assert_int_equal(td__env_pack(&r.env, got), hl);
    assert_memory_equal(got, want, hl);
    assert_int_equal(got[hl], 0xa5);
    /* one pass into room of its own: the same bytes when they fit, the size and nothing written
     * past the room when they do not */
    memset(got, 0xa5, hl + 1);
    assert_int_equal(td__env_pack_into(&r.env, got, hl), hl);
    assert_memory_equal(got, want, hl);
    assert_int_equal(got[hl], 0xa5);
    if (hl) {
      memset(got, 0xa5, hl + 1);
      assert_int_equal(td__env_pack_into(&r.env, got, hl - 1), hl);
      assert_int_equal(got[hl - 1], 0xa5);
    }
    free(want);
    free(got);
  }
}

/* Nodes of 128 bytes and more (a length of two and three bytes before them) are packed as
 * protobuf-c packs them, by td__env_pack and by td__env_pack_into in room of every size around
 * the node boundaries. */
static void test_wire_small_pack_long_nodes(void **state) {
  (void)state;
  static char s1[200], s2[20000];
  memset(s1, 'x', sizeof s1 - 1);
  memset(s2, 'y', sizeof s2 - 1);
  Tdist__Node n0 = TDIST__NODE__INIT, n1 = TDIST__NODE__INIT, n2 = TDIST__NODE__INIT;
  n0.kind = 3;
  n0.i = 5;
  n1.kind = 4;
  n1.s = s1;
  n2.kind = 4;
  n2.key = s2;
  Tdist__Node *nodes[] = {&n0, &n1, &n2, &n0};
  Tdist__Envelope env = TDIST__ENVELOPE__INIT;
  env.kind = 1;
  env.fn = "f";
  env.nargs = 4;
  env.n_nodes = 4;
  env.nodes = nodes;
  size_t hl = tdist__envelope__get_packed_size(&env);
  assert_true(hl > sizeof s2);
  uint8_t *want = malloc(hl), *got = malloc(hl + 1);
  assert_true(want && got);
  assert_int_equal(tdist__envelope__pack(&env, want), hl);
  assert_int_equal(td__env_packed_size(&env), hl);
  assert_int_equal(td__env_pack(&env, got), hl);
  assert_memory_equal(got, want, hl);
  for (size_t cap = 0; cap <= hl; cap += cap < 260 || cap > hl - 260 ? 1 : 97) {
    memset(got, 0xa5, hl + 1);
    assert_int_equal(td__env_pack_into(&env, got, cap), hl);
    if (cap == hl) assert_memory_equal(got, want, hl);
    assert_int_equal(got[cap], 0xa5);
  }
  free(want);
  free(got);
}

/* ---- what the fast path declines, and what the decoder then makes of it ---- */

typedef struct {
  td__msg msg;
  int nmsg, nbad;
} got;

static void on_msg(void *ud, td__msg *m) {
  got *g = ud;
  if (g->nmsg++ == 0) g->msg = *m;
  else td__msg_clear(m);
}

static void on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  (void)id;
  (void)st;
  (void)why;
  ((got *)ud)->nbad++;
}

/* Feeds a frame with envelope h[0..n) and no payload to a decoder: the message protobuf-c makes of
 * it, or a bad-frame report when protobuf-c refuses it. Returns the number of messages. */
static int decode_frame(const uint8_t *h, size_t n, got *g) {
  uint8_t pre[TD__FRAME_PREFIX];
  td__put_u32(pre, TD__FRAME_MAGIC);
  td__put_u32(pre + 4, (uint32_t)n);
  td__put_u64(pre + 8, 0);
  td__put_u64(pre + 16, 77);
  td__wire_ctx ctx = {NULL, 0, 1};
  td__decoder *d = NULL;
  TD_ASSERT_OK(td__decoder_create(&ctx, 0, on_msg, on_bad, g, &d));
  TD_ASSERT_OK(td__decoder_feed(d, pre, sizeof pre));
  TD_ASSERT_OK(td__decoder_feed(d, h, n));
  td__decoder_destroy(d);
  return g->nmsg;
}

static void test_wire_small_declines(void **state) {
  (void)state;
  static td__small_env s;
  /* kind 1 then kind 2: protobuf-c keeps the last; the fast path declines */
  const uint8_t twice[] = {0x08, 0x01, 0x08, 0x02, 0x20, 0x00};
  assert_false(td__small_env_parse(&s, twice, sizeof twice));
  got g = {0};
  assert_int_equal(decode_frame(twice, sizeof twice, &g), 1);
  assert_int_equal(g.msg.kind, 2);
  td__msg_clear(&g.msg);
  /* an unknown field (12), kept aside by protobuf-c */
  const uint8_t unknown[] = {0x08, 0x02, 0x60, 0x05};
  assert_false(td__small_env_parse(&s, unknown, sizeof unknown));
  assert_true(check_both(unknown, sizeof unknown) == false);
  /* field 1 with a two-byte tag (0x88 0x00 is tag 1, varint, not minimal) */
  const uint8_t long_tag[] = {0x88, 0x00, 0x02};
  assert_false(td__small_env_parse(&s, long_tag, sizeof long_tag));
  g = (got){0};
  assert_int_equal(decode_frame(long_tag, sizeof long_tag, &g), 1);
  assert_int_equal(g.msg.kind, 2);
  td__msg_clear(&g.msg);
  /* kind as a fixed64 instead of a varint: protobuf-c refuses it, the decoder reports it */
  const uint8_t wrong_type[] = {0x09, 1, 0, 0, 0, 0, 0, 0, 0};
  assert_false(td__small_env_parse(&s, wrong_type, sizeof wrong_type));
  g = (got){0};
  assert_int_equal(decode_frame(wrong_type, sizeof wrong_type, &g), 0);
  assert_int_equal(g.nbad, 1);
  /* an unterminated varint */
  const uint8_t unterminated[] = {0x08, 0x82, 0x80, 0x80};
  assert_false(td__small_env_parse(&s, unterminated, sizeof unterminated));
  g = (got){0};
  assert_int_equal(decode_frame(unterminated, sizeof unterminated, &g), 0);
  assert_int_equal(g.nbad, 1);
  /* a length running past the end */
  const uint8_t past_end[] = {0x08, 0x02, 0x12, 0x05, 'a', 'b'};
  assert_false(td__small_env_parse(&s, past_end, sizeof past_end));
  /* a node's shape unpacked (one varint per entry): protobuf-c takes it, the fast path not */
  const uint8_t unpacked[] = {0x08, 0x02, 0x2a, 0x04, 0x40, 0x03, 0x40, 0x04};
  assert_false(td__small_env_parse(&s, unpacked, sizeof unpacked));
  Tdist__Envelope *ref = tdist__envelope__unpack(NULL, sizeof unpacked, unpacked);
  assert_non_null(ref);
  assert_int_equal(ref->nodes[0]->n_shape, 2);
  tdist__envelope__free_unpacked(ref, NULL);
  /* one node more than the fast path holds */
  uint8_t many[2 + 2 * (TD__SMALL_NODES + 1)];
  many[0] = 0x08;
  many[1] = 0x02;
  for (int i = 0; i <= TD__SMALL_NODES; i++) {
    many[2 + 2 * i] = 0x2a;
    many[3 + 2 * i] = 0x00;
  }
  assert_false(td__small_env_parse(&s, many, sizeof many));
  assert_true(td__small_env_parse(&s, many, sizeof many - 2)); /* at the limit: taken */
  assert_true(check_both(many, sizeof many - 2));
  /* an envelope longer than the fast path takes, with a valid string field */
  uint8_t big[TD__SMALL_HEADER + 8];
  memset(big, 'x', sizeof big);
  big[0] = 0x12;
  big[1] = (uint8_t)(0x80 | ((sizeof big - 3) & 0x7f));
  big[2] = (uint8_t)((sizeof big - 3) >> 7);
  assert_false(td__small_env_parse(&s, big, sizeof big));
  g = (got){0};
  assert_int_equal(decode_frame(big, sizeof big, &g), 0); /* kind 0: refused, and reported */
  assert_int_equal(g.nbad, 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_wire_small_matches_protobuf_c),
      cmocka_unit_test(test_wire_small_pack_matches_protobuf_c),
      cmocka_unit_test(test_wire_small_pack_long_nodes),
      cmocka_unit_test(test_wire_small_declines),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
