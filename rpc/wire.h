/* wire.h - tdist's frame format: encoding messages into frames (wire_encode.c) and an incremental
 * decoder (wire_decode.c); wire.c holds what both share.
 *
 * Frame = 24-byte prefix (magic "TDF1", header_len u32, payload_len u64, id u64; little endian)
 *       + header (protobuf Envelope, see tdist.proto) + payload (raw tensor bytes, in the order the
 *       tensors appear in the pre-order walk of the value trees).
 * The decoder is a byte-stream state machine: feed it whatever chunks the transport delivers; it
 * copies payload bytes straight into freshly allocated tensors. Because id and lengths sit in the
 * fixed prefix, a frame whose header is malformed or too big is skipped and reported by id (the
 * stream stays usable); only a bad magic number corrupts the stream.
 * CUDA tensors travel only along a device map (td__wire_ctx.devmap): the encoder copies them to
 * host memory and marks the target device in their node; the decoder moves them there.
 */
#ifndef TD_RPC_WIRE_H
#define TD_RPC_WIRE_H

#include <stdbool.h>
#include <stdint.h>

#include "value_impl.h"

#define TD__FRAME_MAGIC 0x31464454u /* "TDF1" */
/* Direct-copy frames (same host, rpc/direct.h): the payload is a descriptor, not the bytes. */
#define TD__FRAME_MAGIC_DIRECT 0x32464454u /* "TDF2" */
/* Ack of a direct-copy frame: prefix only (header_len 0, payload_len 0, id = the token). */
#define TD__FRAME_MAGIC_ACK 0x31414454u /* "TDA1" */
/* Same-host lane control (rpc/lane.h), on the gRPC stream only: id = the message, payload = its
 * body of at most 128 bytes, no header. */
#define TD__FRAME_MAGIC_LANE 0x314c4454u /* "TDL1" */
#define TD__FRAME_PREFIX 24
#define TD__MAX_HEADER (64u << 20) /* envelopes above 64 MiB are refused */
#define TD__MAX_DEPTH 512          /* deepest value tree accepted */

enum { TD__MSG_REQUEST = 1, TD__MSG_RESPONSE = 2, TD__MSG_ERROR = 3 };

/* Little-endian fields of prefixes and descriptors. */
static inline void td__put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void td__put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t td__get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t td__get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

typedef struct td__msg {
  uint64_t id;
  int kind;
  char *fn; /* owned */
  int from_rank;
  td_value **values; /* owned references: request args, or the response's result */
  int nvalues;
  td_status status; /* errors */
  char *message;    /* owned; NULL means "" */
  int64_t timeout_ms; /* request: the caller's timeout in ms, 0 = none (never negative) */
  uint64_t ctx_id, autograd_msg_id;
  uint64_t *aux; /* owned (td__malloc); extra ids of upper layers (distributed autograd: the walk
                  * indices of the tensors that carry gradients) */
  int naux;
} td__msg;

/* td__msg_clear releases what m owns and zeroes it. */
void td__msg_clear(td__msg *m);

/* A device map toward one peer, checked at init by the agent (rpc/devmap.c): a tensor on
 * e[i].from here arrives on e[i].to there. At most one entry per `from` and per `to`. */
typedef struct td__devmap_entry {
  td_device from, to;
} td__devmap_entry;
typedef struct td__devmap {
  td__devmap_entry *e; /* owned by the agent */
  int n;
} td__devmap;
/* Highest CUDA ordinal a frame may name (td_device_parse accepts the same range). */
#define TD__MAX_CUDA_INDEX 1023

/* td__devmap_lookup finds the entry for from and stores its target in *to. */
bool td__devmap_lookup(const td__devmap *m, td_device from, td_device *to);

struct td__wire_ctx {
  void *agent;   /* the agent encoding or decoding (for extension types) */
  int peer_rank; /* the other end */
  int self_rank;
  /* Encoding only: where this message's tensors go on the peer - the agent's map to the peer for
   * requests, the inverse of the peer's map to this worker for responses. A tensor on a device
   * with an entry is staged through host memory and marked with the target device (Node.device);
   * without one a CPU tensor stays on the CPU and a CUDA tensor is refused (TD_ERR_DEVICE).
   * NULL: no map. */
  const td__devmap *devmap;
  const char *peer_name; /* for error messages; NULL: "rank N" */
};

/* An encoded frame: prefix + header bytes, then the bytes of each tensor. */
typedef struct td__frame {
  uint8_t *head; /* owned */
  size_t head_len;
  td_tensor **tensors; /* owned references, contiguous CPU tensors (CUDA ones staged to host) */
  int ntensors;
  uint64_t payload_len;
  /* set by the agent after encoding: a request on a stream the peer opened, or a reply on one
   * this worker opened (a shared stream's reverse direction; counted apart, td__conn_reverse_sent) */
  bool reverse;
} td__frame;

/* td__wire_encode encodes m (values are walked, extension values converted with to_wire). */
td_status td__wire_encode(const td__msg *m, td__wire_ctx *ctx, td__frame *out);
void td__frame_clear(td__frame *f);

typedef struct td__decoder td__decoder;
/* Called for every complete frame; takes ownership of m's contents. A tensor whose node names a
 * CUDA device (Node.device) has been moved there (staged through host memory) before the call. */
typedef void (*td__on_msg_fn)(void *ud, td__msg *m);
/* Called for a skipped frame (malformed or oversized) with its id and why: st is TD_ERR_FORMAT
 * for a malformed frame, TD_ERR_INVALID for one over the size limit, TD_ERR_DEVICE when a tensor
 * names a CUDA device this process does not have (or cannot be placed there). */
typedef void (*td__on_bad_fn)(void *ud, uint64_t id, td_status st, const char *why);

td_status td__decoder_create(const td__wire_ctx *ctx, uint64_t max_message_bytes,
                             td__on_msg_fn on_msg, td__on_bad_fn on_bad, void *ud,
                             td__decoder **out);

/* Hooks for direct-copy frames (all called on the decoding thread with the decoder's ud). Without
 * them a direct-copy frame is reported bad and an ack frame is ignored. */
typedef struct td__direct_hooks {
  /* May bytes be read from process pid (a peer verified at init)? */
  bool (*allowed)(void *ud, int pid);
  /* The frame with this token has been read (or refused): the peer may release its tensors. */
  void (*send_ack)(void *ud, uint64_t token);
  /* The peer has read our frame with this token. */
  void (*acked)(void *ud, uint64_t token);
  /* Optional: a frame's copy is large; the decoder paused (td__decoder_paused) and the owner
   * arranges for td__decoder_resume to run on another thread, then feeds the rest. NULL: copies
   * run inline. */
  void (*offload)(void *ud);
  /* Optional: a lane control frame arrived (type = its id, body up to 128 bytes). NULL: such a
   * frame corrupts the stream. */
  void (*lane_control)(void *ud, uint64_t type, const uint8_t *body, size_t len);
} td__direct_hooks;
void td__decoder_set_direct(td__decoder *d, const td__direct_hooks *h);

/* td__decoder_feed_some consumes up to n bytes (*used of them): it stops early when it paused
 * for an offloaded copy (td__direct_hooks.offload). Errors as td__decoder_feed. */
td_status td__decoder_feed_some(td__decoder *d, const uint8_t *p, size_t n, size_t *used);
/* td__decoder_paused: a direct-copy frame waits for td__decoder_resume. */
bool td__decoder_paused(const td__decoder *d);
/* td__decoder_resume copies the paused frame's tensors from the sender, acknowledges it and
 * delivers it (on the calling thread); the decoder then takes bytes again. */
void td__decoder_resume(td__decoder *d);
/* td__decoder_feed consumes n bytes. Returns TD_ERR_FORMAT (with td_last_error) when the stream
 * is corrupt and must be closed; frames before the corruption were delivered. */
td_status td__decoder_feed(td__decoder *d, const uint8_t *p, size_t n);
/* td__decoder_last_frame tells, during the on_msg callback, the size of the frame delivered
 * (envelope + tensor bytes) and whether its tensors came by direct copy. */
void td__decoder_last_frame(const td__decoder *d, uint64_t *bytes, bool *direct);
/* td__decoder_set_peer sets the rank of the other end (once the stream's handshake proved it). */
void td__decoder_set_peer(td__decoder *d, int rank);
/* td__decoder_set_budget makes the tensors of frames in progress (received as bytes, not by
 * direct copy) count against *held (an atomic shared by every decoder of one peer): a tensor
 * that would take it past max is refused (its frame skipped and reported by id, TD_ERR_NOMEM),
 * and a frame's share is given back when it is delivered or dropped. held: borrowed; must
 * outlive d. */
void td__decoder_set_budget(td__decoder *d, int64_t *held, uint64_t max);
/* td__decoder_idle returns true between frames. */
bool td__decoder_idle(const td__decoder *d);
void td__decoder_destroy(td__decoder *d);

#endif
