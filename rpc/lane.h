/* lane.h - the same-host lane (internal): frames between two workers on one host move through
 * shared memory instead of the gRPC stream they were authenticated on.
 *
 * A lane belongs to one stream (td__conn): a memfd holding two byte rings (client -> server and
 * server -> client) that carry the stream's ordinary frames (wire.h), decoded by a decoder of the
 * lane's own. Each process has one td__lanes: a unix listening socket (abstract name) through
 * which lanes are handed over, a doorbell page (a memfd with a futex word) that its peers ring,
 * and one thread that polls every lane's receive ring and drains send queues. See rpc/lane.c for
 * the protocol, the doorbell and the bounds, and docs/ARCHITECTURE.md ("Same-host lane").
 *
 * Set-up, driven by control frames (TD__FRAME_MAGIC_LANE) on the authenticated gRPC stream:
 *   client: ASK                          - after the stream's handshake, when the server's
 *                                          process is known on this host
 *   server: OFFER {secret, socket name}
 *   client: connects to the socket (its owner must be the verified pid of the server's rank),
 *           sends the secret with the lane memfd and its doorbell; ATTACH
 *   server: accepts only the verified pid of the client's rank proving the secret, maps the
 *           lane, answers with its doorbell; READY (its own frames go to the lane from here)
 *   client: takes the server's doorbell; SWITCH (its frames go to the lane from here)
 * Either side may answer DECLINE instead; the stream then stays the only path. Each side's last
 * frame on the stream before its switch is its READY / SWITCH, and the receiver reads the lane
 * only after it has read that frame from the stream, so frames keep their order per direction.
 *
 * Dialled lanes (td__lane_dial): two members on one host need no gRPC stream at all. The client
 * connects to the peer's dial socket (a second abstract name, "tdist-dial-<pid>-<nonce>", both
 * from the peer's same-host record) and runs the stream handshake of auth.h on it, under a key
 * derived for this purpose:
 *   client: HELLO (48 B)                 - socket peer checked: the verified pid of the rank
 *   server: CHALLENGE (76 B)             - only from a member's pid; rank's pid checked
 *   client: PROOF (40 B) + 1 B + lane memfd + its doorbell
 *   server: BELL (4 B) + 1 B + its doorbell - the lane is up on both sides
 * The byte after PROOF and BELL says whether the sender reads the other's memory (its probe,
 * opts.probe, once the other proved itself): the pair settles same-host direct copy there.
 * The client writes frames into its ring from the start (the server reads them only once the
 * client proved itself; the memfd reaches the server only after the server proved itself). The
 * socket stays open while the lane lives: its end (the peer exited, or closed the lane) is the
 * lane's end, after what the peer wrote before it has been read; and it carries keepalive pings
 * (one byte each way) for lanes that sent frames, so a stopped or hung peer ends the lane as
 * gRPC's keepalive ends a stream. One thread per process (the
 * socket thread, epoll) accepts, runs the handshakes and watches the sockets.
 *
 * Mailbox lanes (td__lanes_mbox): no socket and no handshake either; each process's arena holds a
 * ring slot per rank, reached with pidfd_getfd (below, and rpc/lane.c).
 *
 * All in rpc/lane.c. THREAD SAFETY: set-up functions run on the transport's poller thread;
 * td__lane_send from any thread; the decoders' callbacks run on the lane thread, or on a thread
 * about to block in td_future_wait that drives the receive side meanwhile (one at a time).
 */
#ifndef TD_RPC_LANE_H
#define TD_RPC_LANE_H

#include <stdbool.h>
#include <stdint.h>

#include "wire.h"

#define TD__LANE_RING (256u << 10) /* bytes in each direction's ring */
#define TD__LANE_MAX 64            /* lanes one process holds at once (memory: 516 KiB each) */
/* Dialled lanes one process holds at once (each a socket, and 516 KiB of shared memory whose
 * pages become resident as bytes pass), and server handshakes in progress at once. */
#define TD__LANE_DIAL_MAX 4096
#define TD__LANE_DIAL_PENDING 1024
#define TD__LANE_SECRET 32

/* Control messages (the id of a TD__FRAME_MAGIC_LANE frame). */
enum {
  TD__LANE_OFFER = 1,
  TD__LANE_ATTACH = 2,
  TD__LANE_READY = 3,
  TD__LANE_SWITCH = 4,
  TD__LANE_DECLINE = 5,
  TD__LANE_ASK = 6,
};
#define TD__LANE_CTRL_MAX 128 /* longest control body */

struct td__auth;
typedef struct td__lanes td__lanes;
typedef struct td__lane td__lane;

typedef struct td__lanes_opts {
  /* A connection attempt on the socket was refused (a stranger, a wrong secret): counted with
   * the transport's refusals. Called on the poller thread. */
  void (*refused)(void *ud, const char *why);
  /* The lane of ud (a stream) failed (corrupt ring, peer misbehaving): close the stream. Called
   * on the lane thread. */
  void (*failed)(void *ud, const char *why);
  /* A lane holds a reference on its stream (ud, given by the caller of _offer / _join) until the
   * lane is closed and dropped; this gives it back. Any thread. */
  void (*release)(void *ud);
  /* The lane's decoder paused for a large direct copy (or a frame going to a CUDA device): run
   * td__lane_resume(l) on another thread (the transport's bulk thread), holding what ud needs
   * meanwhile; the lane's reference l is the callee's to give back after td__lane_resume. The
   * lane reads nothing more of its ring until then, and the lane thread serves the other lanes.
   * Called on the receiving thread. */
  void (*offload)(void *ud, td__lane *l);
  void *refused_ud;
  /* Optional: called with refused_ud before (end false) and after (end true) every pass over
   * the receive rings, on the thread making it (the lane thread or a waiter). */
  void (*burst)(void *ud, bool end);
  /* Dialled lanes. A member's dial was accepted (socket thread): make the server's side of it
   * for rank peer and give the lane its decoder and owner (*dec, *ud; the lane takes them over
   * and gives ud back through release). Not TD_OK: the lane is closed. */
  td_status (*dialed)(void *refused_ud, td__lane *l, int peer, td__decoder **dec, void **ud);
  /* A dialled lane ended (closed by either side, its peer gone, its handshake failed): called
   * once, just before release, with the reason. Any thread but one holding a lane lock. */
  void (*ended)(void *ud, const char *why);
  /* Dialled lanes and same-host direct copy (optional; socket thread; called with refused_ud).
   * Once the peer proved itself in a lane's handshake, probe(rank) says whether this process
   * reads that rank's memory (the transport then takes its direct-copy frames); the answer
   * goes to the peer with the handshake's next message (the client's PROOF, the server's
   * doorbell), and peer_reads(rank) tells this side that the peer reads its memory
   * (direct-copy frames may go to it). Both before the lane carries frames of its side.
   * A mailbox lane calls probe with proven: taking the peer's descriptors (pidfd_getfd) passed
   * the kernel's check that reading its memory (process_vm_readv) makes, and its arena carries
   * the nonce of its record, so the probe need not read it; a knock from the peer is its
   * peer_reads. */
  bool (*probe)(void *refused_ud, int rank, bool proven);
  void (*peer_reads)(void *refused_ud, int rank);
} td__lanes_opts;

/* td__lanes_create opens the socket and the doorbell and starts the lane thread. */
td_status td__lanes_create(const td__lanes_opts *o, td__lanes **out);
/* td__lanes_stop stops the thread (lanes still open are dropped); td__lanes_destroy frees. */
void td__lanes_stop(td__lanes *ls);
void td__lanes_destroy(td__lanes *ls);
/* td__lanes_set_pids: a lane is made with rank r only when its socket peer is pid_of[r] (0:
 * never). Once, at init. */
td_status td__lanes_set_pids(td__lanes *ls, const int *pid_of, int world);
/* The busy-poll window of the lane thread after its last work (ns; 0: sleep at once). */
void td__lanes_set_spin(td__lanes *ls, int64_t ns);
/* Lanes carrying frames now (both directions switched). THREAD SAFETY: any thread. */
int td__lanes_up(const td__lanes *ls);
/* td__lanes_listen_dial: opens this process's dial socket (named from self_nonce) and starts the
 * socket thread; dials go to rank r at "tdist-dial-<pid_of[r]>-<nonce_of[r]>". auth: the group's
 * key (copied; insecure: the pids alone identify the peers); handshake_ms bounds a handshake;
 * ka_ms / kt_ms: a lane that sent frames is pinged on its socket every ka_ms, and ends when a
 * ping waits kt_ms for its answer (0: no pings). Once, after td__lanes_set_pids. */
td_status td__lanes_listen_dial(td__lanes *ls, int self_rank, const struct td__auth *auth,
                                uint64_t self_nonce, const uint64_t *nonce_of, int world,
                                int64_t handshake_ms, int64_t ka_ms, int64_t kt_ms);
/* Whether this process dials lanes (its dial socket listens). */
bool td__lanes_dialing(const td__lanes *ls);
/* Mailbox lanes (rpc/lane.c has the design): a lane with no handshake, through slots of the two
 * processes' arenas, where this process may take the peer's descriptors (pidfd_getfd: the
 * kernel's ptrace-attach check). td__lanes_mbox_open creates this process's arena (a group of
 * world ranks) and gives the descriptors its same-host record publishes (its doorbell, its
 * arena); td__lanes_set_mbox, after td__lanes_listen_dial, takes every rank's (-1: none) and
 * turns them on. */
td_status td__lanes_mbox_open(td__lanes *ls, int world, uint64_t nonce, int *bell_fd,
                              int *arena_fd);
td_status td__lanes_set_mbox(td__lanes *ls, const int *bell_fd_of, const int *arena_fd_of,
                             int world);
/* Whether a mailbox lane may be tried with rank. */
bool td__lanes_can_mbox(td__lanes *ls, int rank);
/* Makes sure the mailbox lane with rank exists (made here, or already by either side: its
 * transport owner came through dialed), and gives *owner = grab(its owner) (NULL when it has
 * none now); TD_ERR_UNAVAILABLE when it cannot be (once failed or ended, never again). Call
 * holding none of the transport's locks. */
td_status td__lanes_mbox(td__lanes *ls, int rank, void *(*grab)(void *), void **owner);
/* Whether l is a mailbox lane (the two sides' owners tell their directions by rank). */
bool td__lane_is_mbox(const td__lane *l);
/* Mailbox lanes up now (counted in td__lanes_dialed too). */
int td__lanes_mboxes(const td__lanes *ls);
/* Whether a lane can be dialled to rank (its process on this host, its socket known). */
bool td__lanes_can_dial(td__lanes *ls, int rank);
/* Dialled lanes up now. */
int td__lanes_dialed(const td__lanes *ls);
/* Whether the lane thread reads by hints now (more than 64 lanes; tests). */
bool td__lanes_by_hints(td__lanes *ls);
/* The lane thread's next sleep at most, ms: 100 after work, doubling while idle up to 1,000
 * (100 under ThreadSanitizer; tests). */
int td__lanes_nap_ms(td__lanes *ls);
/* td__lanes_refresh_looked: lanes the lane thread's set refreshes looked at, in all (tests). */
uint64_t td__lanes_refresh_looked(td__lanes *ls);
/* While on, frames ls sends set no hint bit for their peer, as if a peer had cleared it before
 * the reader took it (any peer can; tests). */
void td__lanes_test_withhold_hints(td__lanes *ls, bool on);
/* Whether rank has a known process on this host (a lane may be asked for). */
bool td__lanes_knows(td__lanes *ls, int rank);
/* Closes the connections strangers left on the socket (poller, about once a second). */
void td__lanes_sweep(td__lanes *ls);

/* ---- one lane (the stream's side; dec: the lane's decoder, taken over; ud: the stream, whose
 * reference the lane takes over on TD_OK with a lane, and gives back through release) ---- */
/* Server, after the handshake: a lane offered to rank peer; body (TD__LANE_CTRL_MAX bytes) gets
 * the OFFER, *len its length. NULL lane when not possible (no pid for peer, lane limit). */
td_status td__lane_offer(td__lanes *ls, int peer, td__decoder *dec, void *ud, uint8_t *body,
                         size_t *len, td__lane **out);
/* Client, on an OFFER: connects and hands the lane over; then send ATTACH. */
td_status td__lane_join(td__lanes *ls, int peer, const uint8_t *body, size_t len,
                        td__decoder *dec, void *ud, td__lane **out);
/* Client, without a stream: connects to rank peer's dial socket and starts the handshake; frames
 * may be sent at once (td__lane_send). The lane's end is reported through ended and release.
 * Fails (nothing taken but dec, which is destroyed) when the socket cannot be reached: the
 * caller may use a gRPC stream instead. */
td_status td__lane_dial(td__lanes *ls, int peer, td__decoder *dec, void *ud, td__lane **out);
/* Records why the lane is being closed (the first reason wins), then closes it. */
void td__lane_close_why(td__lane *l, const char *why);
/* Server, on ATTACH: takes the lane from the socket (then send READY and switch). */
td_status td__lane_accept(td__lane *l);
/* Client, on READY: takes the server's doorbell (then send SWITCH and switch). */
td_status td__lane_ready(td__lane *l);
/* Starts receiving (after the peer's READY / SWITCH was read from the stream). */
void td__lane_start_rx(td__lane *l);
/* Sends go to the lane from now on. */
void td__lane_start_tx(td__lane *l);
bool td__lane_tx_on(const td__lane *l);

/* A frame for td__lane_send: a head buffer (td__malloc'd), an optional second buffer (a direct
 * copy's descriptor), then tensor bytes (references). */
typedef struct td__lane_msg {
  uint8_t *head;
  size_t head_len;
  uint8_t *extra;
  size_t extra_len;
  td_tensor **tensors; /* td__malloc'd array of references */
  int ntensors;
} td__lane_msg;
/* td__lane_send writes m into the ring, or queues what does not fit for the lane thread. Takes
 * ownership of m's buffers and references in every case. TD_ERR_UNAVAILABLE when closed,
 * TD_ERR_NOMEM when nothing was sent, TD_ERR_FORMAT when the lane is broken (the peer corrupted
 * the ring, or part of the frame went out before memory ran out): close the stream. */
td_status td__lane_send(td__lane *l, td__lane_msg *m);
/* td__lane_resume finishes the paused frame of l's decoder (the copy, its delivery) on the
 * calling thread, then lets the lane read its ring again. See td__lanes_opts.offload. */
void td__lane_resume(td__lane *l);
/* Closes the lane (no more sends; the thread drops it). Safe to call twice. */
void td__lane_close(td__lane *l);
td__lane *td__lane_ref(td__lane *l);
void td__lane_unref(td__lane *l);

/* ---- the ring (exposed for tests of its bounds) ---- */
typedef struct td__ring_ctl td__ring_ctl;
/* td__ring_readable: bytes the consumer at private position head may read, or -1 when the
 * producer's published tail is out of range (corrupt: the lane must close). */
int64_t td__ring_readable(const td__ring_ctl *r, uint64_t head);
/* td__ring_writable: room for the producer at private position tail, or -1 when the consumer's
 * published head is out of range. */
int64_t td__ring_writable(const td__ring_ctl *r, uint64_t tail);
/* The size of a ring control block, its tail and head words (tests forge them). */
size_t td__ring_ctl_size(void);
uint64_t *td__ring_tail_word(td__ring_ctl *r);
uint64_t *td__ring_head_word(td__ring_ctl *r);
/* td__ring_consume feeds up to max readable bytes of ring (data of TD__LANE_RING bytes) at
 * *head to dec and advances *head; -1 with td_last_error when the ring or a frame is corrupt,
 * else the bytes consumed. It stops early where dec pauses (td__decoder_paused): the rest stays
 * in the ring. */
int64_t td__ring_consume(td__ring_ctl *r, const uint8_t *data, uint64_t *head, td__decoder *dec,
                         uint64_t max);
/* The control blocks of a lane's rings as this side sees them (NULL before it is mapped): for
 * tests that play a hostile peer. */
void td__lane_rings(td__lane *l, td__ring_ctl **tx, td__ring_ctl **rx);

#endif
