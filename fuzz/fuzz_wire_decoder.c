/* fuzz_wire_decoder.c - libFuzzer target for the frame decoder (rpc/wire_decode.c).
 *
 * Input: one selector byte, then the byte stream. The stream is fed to a decoder in two chunks,
 * split at a position derived from the selector, so the state machine sees frames cut at every
 * possible point. The decoder has a 1 MiB message limit (a peer may claim any payload length; the
 * limit is what bounds the memory allocated for it).
 *
 * Oracles besides the sanitizers: every frame ends in exactly one callback or a TD_ERR_FORMAT from
 * feed; every delivered message is encoded again and decoded by a fresh decoder, which must give
 * back an equal message (decode(encode(decode(x))) == decode(x)) with no bad-frame report.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

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
  FUZZ_CHECK(m->fn && m->message);
  check_round_trip(m);
  td__msg_clear(m);
}

static void on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  (void)id;
  ((counts *)ud)->nbad++;
  FUZZ_CHECK(st != TD_OK && why && why[0]);
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
