/* wire_small.h - fast paths of the envelope codec (wire_small.c), internal to the wire code: a
 * parser for small envelopes and a packer for every envelope the encoder builds.
 *
 * Most frames carry a small envelope: a function name, a few scalar values, a tensor or two.
 * protobuf-c's general unpacker allocates the envelope, every node, every string and every array
 * separately (and frees them one by one after); td__small_env_parse reads such an envelope into
 * storage of its own instead, and declines (returns false) anything it does not take exactly as
 * protobuf-c would: then the frame goes through protobuf-c as before, which accepts it or reports
 * it malformed. What the fast path accepts: single-byte tags of the fields tdist.proto declares,
 * each with its declared wire type, every scalar field at most once (protobuf-c keeps the last of
 * several; declining keeps the two equal without copying that rule), packed repeated integers,
 * at most TD__SMALL_NODES nodes, TD__SMALL_DIMS shape entries and TD__SMALL_AUX aux ids in all,
 * and envelopes of at most TD__SMALL_HEADER bytes. Every value it returns is the one protobuf-c
 * gives for the same bytes (varints truncated the same way, bools true when any payload bit is
 * set, strings copied with a NUL after their bytes, empty bytes fields with a NULL data pointer);
 * the wire fuzzer checks this on every input the fast path takes.
 */
#ifndef TD_RPC_WIRE_SMALL_H
#define TD_RPC_WIRE_SMALL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist.pb-c.h"

#define TD__SMALL_HEADER 512 /* envelope bytes the fast path takes at most */
#define TD__SMALL_NODES 16
#define TD__SMALL_DIMS 32
#define TD__SMALL_AUX 16

typedef struct td__small_env {
  Tdist__Envelope env; /* the result; its pointers point into this struct */
  Tdist__Node *ptrs[TD__SMALL_NODES];
  Tdist__Node nodes[TD__SMALL_NODES];
  int64_t dims[TD__SMALL_DIMS];
  uint64_t aux[TD__SMALL_AUX];
  /* the strings and bytes, copied: at most the envelope's bytes plus a NUL per string */
  char text[TD__SMALL_HEADER + 2 * TD__SMALL_NODES + 2];
} td__small_env;

/* td__small_env_parse parses the envelope p[0..n) into s (s->env is the result, valid while s
 * is). False when the fast path declines it (nothing is reported): parse it with protobuf-c. */
bool td__small_env_parse(td__small_env *s, const uint8_t *p, size_t n);

/* td__env_packed_size / td__env_pack: tdist__envelope__get_packed_size / _pack (the same bytes)
 * for an envelope built by the encoder (no unknown fields), without protobuf-c's general path. */
size_t td__env_packed_size(const Tdist__Envelope *e);
size_t td__env_pack(const Tdist__Envelope *e, uint8_t *out);
/* td__env_pack_into packs e into out[0..cap) in one pass and returns its packed size: when that is
 * at most cap, out holds the bytes td__env_pack writes; else what out holds is unspecified (never
 * written past cap) and the caller packs again into room of the size returned. */
size_t td__env_pack_into(const Tdist__Envelope *e, uint8_t *out, size_t cap);

#endif
