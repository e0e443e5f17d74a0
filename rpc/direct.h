/* direct.h - same-host direct copy (internal): a receiver copies large tensors straight out of
 * the sender's memory (process_vm_readv) instead of reading them from the stream.
 *
 * Frame side: a frame whose tensors total TD__DIRECT_MIN_BYTES or more goes to a peer that can
 * read us as a "TDF2" frame whose payload is a descriptor
 *   [token u64][sender pid u32][reserved u32] then per tensor [address u64][length u64]
 * (td__direct_encode). The receiver's decoder reads the descriptor, checks the sender may be read,
 * copies each tensor (td__direct_read) and answers with a "TDA1" ack carrying the token
 * (td__direct_ack_frame), after which the sender releases the tensors it kept alive
 * (td__direct_acks). Agent side (rendezvous): which pairs of workers can do this is probed once at
 * init (td__direct_record / _probe / _learn, declared in agent_state.h).
 *
 * All in rpc/direct.c.
 */
#ifndef TD_RPC_DIRECT_H
#define TD_RPC_DIRECT_H

#include <stdbool.h>
#include <stdint.h>

#include "wire.h"

#define TD__DIRECT_MIN_BYTES (32u << 10) /* smaller payloads go through the stream */
/* On a same-host lane the ring is the faster way up to a few MiB: a frame streams through the
 * 256 KiB ring with the sender's copy in and the receiver's copy out running at once on two CPUs
 * and in cache, while process_vm_readv pins every 4 KiB page it reads, which costs more than the
 * copy (1 MiB: 72 us against 18 us of memcpy on the 2-vCPU VM). Tensors of 4 MiB and more sit in
 * transparent huge pages (tensor/cpu_backend.c), where pinning is cheap and one copy beats two.
 * Measured there (bench/rpc_bandwidth, echo, GB/s both directions, ring vs direct): 64 KiB 14-18
 * vs 6.5-8.3, 1 MiB 24-25 vs 9.0-9.1, 2 MiB 21-25 vs 10.2-10.7, 4 MiB 24-26 vs 23-37, 16 MiB
 * 16-18 vs 21-22. TD_RPC_LANE_DIRECT_MIN_KB overrides it (td__transport_opts.lane_direct_min). */
#define TD__LANE_DIRECT_MIN_BYTES (4u << 20)
/* Direct copies of at least this many bytes run off the network thread (when the stream can
 * offload them). */
#define TD__DIRECT_OFFLOAD_MIN (1u << 20)
/* Most tensors one descriptor may describe (bounds its buffer to 16 MiB). */
#define TD__DIRECT_MAX_TENSORS (1u << 20)

/* ---- descriptors ---- */
/* The size of a descriptor for n tensors. */
static inline uint64_t td__direct_desc_size(int n) { return 16 + 16 * (uint64_t)n; }
/* Whether a TDF2 prefix's lengths can hold a descriptor (else the stream is corrupt). */
bool td__direct_desc_len_ok(uint32_t header_len, uint64_t payload_len);
uint64_t td__direct_desc_token(const uint8_t *desc);
int td__direct_desc_pid(const uint8_t *desc);
/* td__direct_encode turns an encoded frame into a direct-copy frame sent by process pid: rewrites
 * the prefix and returns the descriptor (*desc, td__malloc'd, *desc_len bytes). The frame keeps
 * its tensors; the caller must keep them alive until the ack for token. */
td_status td__direct_encode(td__frame *f, uint64_t token, int pid, uint8_t **desc,
                            size_t *desc_len);
/* td__direct_read copies the n tensors desc describes from the sender (its pid is in desc, and the
 * caller checked it may be read) into ts, allocated from the frame's header. TD_ERR_FORMAT when a
 * length differs from its tensor's, TD_ERR_UNAVAILABLE when the memory cannot be read. */
td_status td__direct_read(const uint8_t *desc, td_tensor *const *ts, int n);
/* td__direct_ack_frame fills the 24 bytes of an ack for token. */
void td__direct_ack_frame(uint8_t out[TD__FRAME_PREFIX], uint64_t token);

/* ---- the sender's table of frames awaiting their ack (one per stream) ---- */
typedef struct td__direct_acks {
  uint64_t next_token;
  struct td__direct_sent *e;
  int n, cap;
} td__direct_acks;
/* Room for one more entry (call before queueing anything of the frame). */
bool td__direct_acks_reserve(td__direct_acks *t);
/* Records the frame's tensors (taken over) under a new token, which it returns; reserve first. */
uint64_t td__direct_acks_add(td__direct_acks *t, td_tensor **ts, int n);
/* The next token add will use. */
static inline uint64_t td__direct_acks_peek(const td__direct_acks *t) { return t->next_token + 1; }
/* Removes token's entry; its tensors go to *ts / *n (release with td__direct_release). */
void td__direct_acks_take(td__direct_acks *t, uint64_t token, td_tensor ***ts, int *n);
void td__direct_release(td_tensor **ts, int n);
/* Releases every entry (the stream is gone). */
void td__direct_acks_clear(td__direct_acks *t);

#endif
