/* fuzz_wire_decoder.c - libFuzzer target for the frame decoder (rpc/wire_decode.c).
 *
 * Input: one selector byte, then the byte stream. The stream is fed to a decoder in two chunks,
 * split at a position derived from the selector, so the state machine sees frames cut at every
 * possible point. The decoder has a 1 MiB message limit (a peer may claim any payload length; the
 * limit is what bounds the memory allocated for it).
 *
 * Oracles besides the sanitizers: every frame ends in exactly one callback or a TD_ERR_FORMAT from
 * feed; every delivered message is encoded again and decoded by a fresh decoder, which must give
 * back an equal message (decode(encode(decode(x))) == decode(x)) with no bad-frame report. The
 * same bytes are also read as an envelope by the small-frame fast path (rpc/wire_small.h): when
 * it takes them, protobuf-c must take them too and give the same fields, to the last bit; and
 * every envelope either of them parsed must be packed by the encoder's packer into the bytes
 * protobuf-c's packer writes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "rpc/wire_small.h"

#define FUZZ_MAX_MSG (1u << 20)

static const td__wire_ctx fuzz_ctx = {NULL, 1, 0};

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "%s:%d: check failed: %s (%s)\n", __FILE__, __LINE__, #cond,    \
              td_last_error());                                                       \
      abort();                                                                        \
    }                                                                                 \
  } while (0)

typedef struct {
  td__msg msg;
  int nmsg, nbad;
} redecode;

static void re_on_msg(void *ud, td__msg *m) {
  redecode *r = ud;
  if (r->nmsg++ == 0) r->msg = *m;
  else td__msg_clear(m);
}

static void re_on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  (void)id;
  (void)st;
  fprintf(stderr, "re-encoded frame rejected: %s\n", why);
  ((redecode *)ud)->nbad++;
}

static bool str_same(const char *a, const char *b) {
  return strcmp(a ? a : "", b ? b : "") == 0;
}

static bool msg_same(const td__msg *a, const td__msg *b) {
  if (a->id != b->id || a->kind != b->kind || !str_same(a->fn, b->fn) ||
      a->from_rank != b->from_rank || a->nvalues != b->nvalues || a->status != b->status ||
      !str_same(a->message, b->message) || a->timeout_ms != b->timeout_ms ||
      a->ctx_id != b->ctx_id || a->autograd_msg_id != b->autograd_msg_id)
    return false;
  for (int i = 0; i < a->nvalues; i++)
    if (!td_value_equal(a->values[i], b->values[i])) return false;
  return true;
}

/* Encodes m, decodes the bytes again and checks that the same message comes back. */
static void check_round_trip(const td__msg *m) {
  td__wire_ctx ctx = fuzz_ctx;
  td__frame f;
  FUZZ_CHECK(td__wire_encode(m, &ctx, &f) == TD_OK);
  redecode r = {0};
  td__decoder *d = NULL;
  FUZZ_CHECK(td__decoder_create(&ctx, 0, re_on_msg, re_on_bad, &r, &d) == TD_OK);
  FUZZ_CHECK(td__decoder_feed(d, f.head, f.head_len) == TD_OK);
  for (int i = 0; i < f.ntensors; i++) {
    size_t nb = td_tensor_nbytes(f.tensors[i]);
    if (nb) FUZZ_CHECK(td__decoder_feed(d, td_tensor_data(f.tensors[i]), nb) == TD_OK);
  }
  FUZZ_CHECK(td__decoder_idle(d));
  FUZZ_CHECK(r.nmsg == 1 && r.nbad == 0);
  FUZZ_CHECK(msg_same(m, &r.msg));
  td__msg_clear(&r.msg);
  td__decoder_destroy(d);
  td__frame_clear(&f);
}

typedef struct {
  int nmsg, nbad;
} counts;

static void on_msg(void *ud, td__msg *m) {
  ((counts *)ud)->nmsg++;
  FUZZ_CHECK(m->nvalues >= 0 && (m->nvalues == 0 || m->values));
  for (int i = 0; i < m->nvalues; i++) FUZZ_CHECK(m->values[i] != NULL);
  FUZZ_CHECK(m->fn);
  check_round_trip(m);
  td__msg_clear(m);
}

static void on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  (void)id;
  ((counts *)ud)->nbad++;
  FUZZ_CHECK(st != TD_OK && why && why[0]);
}

/* ---- the fast path against protobuf-c ---- */

static bool bin_same(ProtobufCBinaryData a, ProtobufCBinaryData b) {
  return a.len == b.len && (a.len == 0 ? a.data == NULL && b.data == NULL
                                       : memcmp(a.data, b.data, a.len) == 0);
}

/* Strings as protobuf-c gives them: NUL-terminated copies (compared up to the first NUL, as C
 * code reads them). */
static bool text_same(const char *a, const char *b) { return strcmp(a, b) == 0; }

static bool node_same(const Tdist__Node *a, const Tdist__Node *b) {
  if (a->kind != b->kind || a->b != b->b || a->i != b->i ||
      memcmp(&a->d, &b->d, sizeof a->d) != 0 || !text_same(a->s, b->s) || !bin_same(a->by, b->by) ||
      a->dtype != b->dtype || a->n_shape != b->n_shape || a->count != b->count ||
      !text_same(a->key, b->key) || a->device != b->device)
    return false;
  if (a->n_shape && memcmp(a->shape, b->shape, a->n_shape * sizeof *a->shape) != 0) return false;
  return a->n_shape || (!a->shape && !b->shape);
}

/* The encoder's packer against protobuf-c's on an envelope protobuf-c parsed: the same bytes. */
static void check_pack(const Tdist__Envelope *e) {
  if (e->base.n_unknown_fields) return; /* the encoder never builds those */
  for (size_t i = 0; i < e->n_nodes; i++)
    if (e->nodes[i]->base.n_unknown_fields) return; /* nor those in a node */
  size_t n = tdist__envelope__get_packed_size(e);
  FUZZ_CHECK(td__env_packed_size(e) == n);
  uint8_t *want = malloc(n ? n : 1), *got = malloc(n ? n : 1);
  FUZZ_CHECK(want && got);
  FUZZ_CHECK(tdist__envelope__pack(e, want) == n && td__env_pack(e, got) == n);
  FUZZ_CHECK(memcmp(want, got, n) == 0);
  /* the one-pass packer: the same bytes in room of exactly n, the size in room of less */
  FUZZ_CHECK(td__env_pack_into(e, got, n) == n && memcmp(want, got, n) == 0);
  if (n) FUZZ_CHECK(td__env_pack_into(e, got, n / 2) == n);
  free(want);
  free(got);
}

static void check_small_path(const uint8_t *p, size_t n) {
  static td__small_env s;
  if (!td__small_env_parse(&s, p, n)) {
    Tdist__Envelope *ref = tdist__envelope__unpack(NULL, n, p);
    if (ref) check_pack(ref);
    tdist__envelope__free_unpacked(ref, NULL);
    return;
  }
  check_pack(&s.env);
  Tdist__Envelope *ref = tdist__envelope__unpack(NULL, n, p);
  FUZZ_CHECK(ref != NULL);
  const Tdist__Envelope *e = &s.env;
  FUZZ_CHECK(e->kind == ref->kind && text_same(e->fn, ref->fn) && e->from_rank == ref->from_rank &&
             e->nargs == ref->nargs && e->n_nodes == ref->n_nodes && e->status == ref->status &&
             text_same(e->message, ref->message) && e->timeout_ms == ref->timeout_ms &&
             e->ctx_id == ref->ctx_id && e->autograd_msg_id == ref->autograd_msg_id &&
             e->n_aux == ref->n_aux && ref->base.n_unknown_fields == 0);
  for (size_t i = 0; i < e->n_nodes; i++) FUZZ_CHECK(node_same(e->nodes[i], ref->nodes[i]));
  if (e->n_aux) FUZZ_CHECK(memcmp(e->aux, ref->aux, e->n_aux * sizeof *e->aux) == 0);
  tdist__envelope__free_unpacked(ref, NULL);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  if (td__value_ext_register(&fuzz_box_type) != TD_OK) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  size_t len = size - 1;
  size_t split = (size_t)data[0] * (len + 1) / 256;
  const uint8_t *p = data + 1;
  check_small_path(p, len);
  if (len >= TD__FRAME_PREFIX) { /* the envelope of a frame, as the decoder meets it */
    size_t hl = td__get_u32(p + 4);
    size_t rest = len - TD__FRAME_PREFIX;
    check_small_path(p + TD__FRAME_PREFIX, hl < rest ? hl : rest);
  }
  counts c = {0};
  td__decoder *d = NULL;
  if (td__decoder_create(&fuzz_ctx, FUZZ_MAX_MSG, on_msg, on_bad, &c, &d) != TD_OK) abort();
  /* Copies make ASan catch any read past either chunk. */
  uint8_t *a = malloc(split ? split : 1), *b = malloc(len - split ? len - split : 1);
  FUZZ_CHECK(a && b);
  memcpy(a, p, split);
  memcpy(b, p + split, len - split);
  td_status st = td__decoder_feed(d, a, split);
  if (st == TD_OK) st = td__decoder_feed(d, b, len - split);
  FUZZ_CHECK(st == TD_OK || st == TD_ERR_FORMAT);
  free(a);
  free(b);
  td__decoder_destroy(d);
  return 0;
}
