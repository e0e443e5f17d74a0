/* lane.c - the same-host lane: shared-memory rings carrying a stream's frames, their hand-over
 * through a unix socket, the doorbell and the lane thread (lane.h).
 *
 * Memory. A lane is one sealed memfd the client creates (F_SEAL_SHRINK | F_SEAL_GROW, so neither
 * side can truncate it under the other's mapping and make it fault):
 *   [header, two ring control blocks: RING_OFF bytes][ring 0 data: client -> server][ring 1 data]
 * Ring 0 starts inside the header's page, so a lane that carries a few small frames each way
 * makes two pages resident, not three (at 512 workers on one host, 150k lanes: 0.6 GB).
 * A ring is a single-producer single-consumer byte ring with free-running 64-bit positions: the
 * producer publishes tail (release) after writing, the consumer publishes head after reading.
 * Frames are written as bytes, so one larger than the ring goes through in pieces and the
 * receiving decoder (which accepts any chunking) never needs it whole.
 *
 * Hostile peer. Everything in the shared pages is the peer's to scribble on, so each side keeps
 * its own positions privately and only publishes them; what it reads from the peer (the other
 * position) is checked before use: a consumer accepts tail - head in [0, ring] and a producer
 * head within [tail - ring, tail], anything else closes the stream. Bytes are fed to the stream's
 * ordinary decoder, which copies each byte into private memory before it looks at it (prefix,
 * envelope, descriptor, tensor storage), so bytes changing under it cannot make it read out of
 * bounds, and which bounds what a frame may make it allocate exactly as on the gRPC stream. The
 * lane thread takes at most 256 KiB from one ring before it looks at the others, and sleeps with
 * a timeout, so no peer can hold it. Received file descriptors must be sealed memfds of exactly
 * the expected size.
 *
 * Doorbell. Each process has a page (a sealed memfd) whose first word is a futex its lane thread
 * sleeps on; it hands the page to every lane peer. The lane thread polls its rings while there is
 * work and for the busy-poll window after it (the transport's adaptive window: off when the host
 * has more workers than CPUs), then sleeps: it reads the bell, sets "consumer sleeping" on every
 * ring it reads (and "producer waiting" on rings it waits to write), re-checks them, and waits on
 * the bell (futex, 100 ms at most after work, up to 1 s once idle: NAP_MS). A producer publishes
 * tail, fences, and rings the peer's bell (increment + FUTEX_WAKE) only when the flag is set:
 * while both sides poll, a frame costs no system call. A consumer does the same for a waiting
 * producer after it frees room. Each pass over the rings is bracketed by the burst callback, so
 * the agent hands the pool what one pass delivered as one task.
 *
 * Hand-over (lane.h has the message order). The socket has an abstract name, so no file is left
 * behind; anyone on the host may connect, so a connection counts only when SO_PEERCRED names the
 * process verified for the offering stream's rank (its same-host record) AND it presents the
 * 32-byte secret the server sent on that authenticated stream. Everything else is closed and
 * counted as refused. The client checks the listening end the same way (SO_PEERCRED of a
 * connected socket is the listener's), so a squatter on the name gets nothing.
 *
 * Mailbox lanes (section "mailbox lanes" below) need no hand-over at all: each process has an
 * arena with a ring slot per rank, and a pair's lane is one slot in each arena, reached with
 * pidfd_getfd where the kernel's ptrace check allows it.
 *
 * Lock order: ls->mbox_mu, then the transport's locks (its dialed callback), (the stream's c->mu),
 * then l->txmu; ls->mu is a leaf.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, SCM_CREDENTIALS / ucred, accept4 */
#endif
#include "lane.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../core/refcount.h"
#include "../core/samehost.h"
#include "auth.h"
#include "future_impl.h"

#define LANE_MAGIC "TDLANE2" /* (TDLANE1: the rings started on page 1) */
#define HDR_BYTES 4096u
#define RING_OFF 1024u /* where ring 0's data starts (ring 1's is TD__LANE_RING further) */
#define MAP_BYTES ((size_t)HDR_BYTES + 2u * TD__LANE_RING)
#define BELL_BYTES 4096u
#define JOIN_MAGIC 0x4a4c4454u /* "TDLJ": client -> server on the socket, with 2 fds */
#define BELL_MAGIC 0x424c4454u /* "TDLB": server -> client, with 1 fd */
#define RX_BUDGET (256u << 10) /* most bytes taken from one ring before looking at the others */
/* How long the lane thread sleeps on its bell at most: 100 ms after it last found work, doubling
 * with every sleep that timed out, up to 1 s. The bell wakes it for every frame; the timeout
 * is there for what a wake-up cannot announce (hints a peer cleared, below) and, under
 * ThreadSanitizer, a lost wake-up (FULL_FENCE), so there it stays at 100 ms. An idle worker's
 * thread woke 10 times a second for nothing: 1,024 workers on 2 CPUs spent a fifth of their
 * start-up's CPU on such wake-ups. */
#define NAP_MS 100
#define NAP_MAX_MS 1000
/* The doorbell page: word 0 is the futex its lane thread sleeps on; word BELL_SLEEP (its own
 * cache line) is 1 while that thread sleeps with nobody polling for it, for every lane at once:
 * a producer that finds it set after publishing rings. (One word, not a flag per ring: a process
 * with hundreds of lanes set and cleared hundreds of shared cache lines per sleep.) */
#define BELL_SLEEP 16
/* Hints (a process with many lanes): word BELL_HINTS_ON is 1 while its lane thread reads only
 * the lanes whose bits are set in the bitmap that starts at byte HINT_BYTE; each lane has a slot
 * there, published in the shared header (ring control blocks), and a peer sets the slot's bit
 * before it checks BELL_SLEEP. The bits are hints from peers (a peer may set or clear any): the
 * lane thread still reads every lane at least every FULL_PASS_NS. */
#define BELL_HINTS_ON 32
#define HINT_BYTE 512u
#define HINT_WORDS ((4096u - HINT_BYTE) / 8u)
#define MAX_SLOTS (HINT_WORDS * 64u)
#define HINT_MIN 16 /* lanes at which the thread reads by hints */
#define FULL_PASS_NS 100000000ull
#define FULL_PASS_LANES 64 /* ... per this many lanes of the set (each pass reads them all) */
/* A wake-up that no hint explains brings a pass over every lane at most every REPASS_NS, or
 * REPASS_LANE_NS per lane of the set when that is longer (lane_main). */
#define REPASS_NS 1000000ull
#define REPASS_LANE_NS 20000ull

struct td__ring_ctl {
  _Alignas(64) uint64_t tail;  /* producer */
  uint32_t producer_waiting;   /* producer: wake me when head moves */
  uint32_t producer_slot;      /* producer: its slot in its doorbell's hints, plus 1 (0: none) */
  uint32_t producer_gone;      /* mailbox lanes: the producer closed its side */
  _Alignas(64) uint64_t head;  /* consumer */
  uint32_t consumer_slot;      /* consumer: its slot in its doorbell's hints, plus 1 (0: none) */
  uint32_t consumer_gone;      /* mailbox lanes: the consumer closed its side */
  _Alignas(64) char end[1];
};

typedef struct lane_hdr {
  char magic[8];
  uint32_t version, ring_bytes;
  _Alignas(128) td__ring_ctl ring[2];
} lane_hdr;

_Static_assert(sizeof(lane_hdr) <= RING_OFF, "lane header ends before ring 0's data");
_Static_assert(RING_OFF + 2u * (size_t)TD__LANE_RING <= MAP_BYTES, "the rings fit the lane");

enum { L_OFFERED = 1, L_JOINED, L_ACCEPTED, L_CLOSED, L_DIALING };
/* A dialled lane's handshake (socket thread): what it waits for. */
enum { D_NONE = 0, D_C_CHALLENGE, D_C_BELL, D_S_HELLO, D_S_PROOF, D_UP };
#define DIAL_BELL_MAGIC 0x32424c54u /* "TLB2": server -> client, with its doorbell and whether it
                                    * reads the client's memory ("TLBD": before that byte) */
#define KA_PING 0x70 /* keepalive on an up lane's socket: one byte, answered by the other */
#define KA_PONG 0x71

/* Mailbox (lane.h): one sealed memfd per process, its arena:
 *   [header page: mbox_hdr, then the knock bitmap at MBOX_BITS_OFF][slot 0][slot 1]...
 * Slot r is the ring rank r writes to this process: its control block at the slot's start and
 * its data from RING_OFF, like a lane's ring 0, so a pair exchanging a few small frames makes
 * one page resident per direction. */
#define MBOX_MAGIC "TDMBOX1"
#define MBOX_HDR 4096u
#define MBOX_SLOT ((size_t)TD__LANE_RING + 4096u)
#define MBOX_BITS_OFF 256u
#define MBOX_MAX_WORLD ((int)((MBOX_HDR - MBOX_BITS_OFF) * 8u))

typedef struct mbox_hdr {
  char magic[8];
  uint64_t nonce;      /* the owner's same-host nonce (its record's) */
  uint32_t world;      /* slots */
  uint32_t slot_bytes;
  uint32_t ka_ms;      /* the owner's keepalive interval (0: it keeps no beat) */
  _Alignas(64) uint32_t knocks; /* bumped by a sender after it set its bit */
  _Alignas(64) uint64_t beat;   /* bumped by the owner's socket thread every keepalive round */
} mbox_hdr;

_Static_assert(sizeof(mbox_hdr) <= MBOX_BITS_OFF, "the knock bitmap follows the header");
_Static_assert(RING_OFF + (size_t)TD__LANE_RING <= MBOX_SLOT, "a slot holds its ring");

static uint64_t *mbox_bits(uint8_t *hdr) { return (uint64_t *)(hdr + MBOX_BITS_OFF); }
static size_t mbox_slot_off(int rank) { return MBOX_HDR + (size_t)rank * MBOX_SLOT; }

/* A frame (or its rest) waiting for room in the ring. */
typedef struct txq {
  struct txq *next;
  td__lane_msg m;
  int part;     /* 0 head, 1 extra, 2.. tensor part-2 */
  size_t off;   /* bytes of that part already written */
} txq;

struct td__lane {
  td__refcnt rc;
  td__lanes *ls;
  int peer;
  bool server;
  int state; /* atomic: L_* */
  uint8_t secret[TD__LANE_SECRET];
  int sock; /* server: a stashed accepted connection; client: ours until READY */
  uint8_t *map;
  uint32_t *peer_bell; /* the peer's doorbell page, once known */
  td__ring_ctl *tx, *rx;
  uint8_t *tx_data, *rx_data;
  /* send side, under txmu */
  pthread_mutex_t txmu;
  bool tx_on; /* atomic */
  uint64_t tx_tail;
  txq *q_head, *q_tail;
  int qlen; /* atomic: frames queued */
  /* receive side: the lane thread only */
  bool rx_on;          /* atomic: the thread reads it */
  uint64_t rx_head;
  bool rx_paused; /* atomic: the decoder waits for td__lane_resume on another thread */
  td__decoder *dec;
  void *ud;
  bool failed;
  bool counted; /* atomic: counted in ls->up */
  struct td__lane *next, *prev; /* ls->lanes (ls->mu); next also links a refresh's drops */
  bool listed;                   /* on ls->lanes (ls->mu) */
  struct td__lane *dirty_next;   /* ls->dirty (ls->mu) */
  bool dirty_q;                  /* on ls->dirty (ls->mu) */
  int set_idx;                   /* its index in ls->set, or -1 (rx_mu) */
  int set_slot;                  /* its slot in ls->by_slot while in the set, or -1 (rx_mu) */
  /* dialled lanes (no stream): the socket stays open while the lane lives; only the socket
   * thread closes it (under txmu; others may shut it down) */
  bool pw_set;           /* tx->producer_waiting as last written (rx_mu) */
  int slot;              /* in this process's hints, or -1 (ls->mu) */
  bool in_set;           /* has been in the lane thread's set (rx_mu) */
  bool direct;
  int dial;              /* D_*: socket thread */
  bool in_ep;            /* registered with the socket thread's epoll (a reference) */
  bool eof;              /* atomic: the peer's end of the socket closed */
  bool ended;            /* atomic: ended was reported */
  uint64_t born_ns;
  td__hs hs;
  uint8_t in[TD__HS_MAX_LEN];
  size_t inlen;
  int infd[2], ninfd;
  char why[200];         /* why it closed (txmu; first reason) */
  uint64_t tx_frames;    /* atomic: frames sent (keepalive: pinged only after sending) */
  uint64_t ping_mark;    /* socket thread: tx_frames when the last ping went */
  uint64_t ping_ns;      /* socket thread: when the unanswered ping went (0: none) */
  struct td__lane *reg_next, *reg_prev; /* the socket thread's list of registered lanes */
  struct td__lane *hs_next, *hs_prev;   /* ... and of those in their handshake (swept) */
  bool in_hs;
  struct td__lane *grave_next;          /* ... dropped in this round (unreferenced after it) */
  struct td__lane *dq_next;  /* ls->dialq (ls->mu) */
  /* mailbox lanes: sock is a pidfd of the peer's process (its end is the lane's) */
  bool mbox;
  uint8_t *mb_hdr;           /* the peer's arena header page */
  uint8_t *mb_slot;          /* our slot in the peer's arena (our tx ring) */
  uint64_t beat_seen;        /* socket thread: the peer's beat when the "ping" began */
};

struct td__lanes {
  td__lanes_opts o;
  int listen_fd;
  struct sockaddr_un addr;
  socklen_t addr_len;
  char name[64]; /* the abstract name without its leading NUL */
  int bell_fd;
  uint32_t *bell;
  pthread_mutex_t mu;
  td__lane *lanes; /* every lane not yet dropped (ls->mu) */
  td__lane *dirty; /* lanes whose place in the set may have changed, referenced (ls->mu) */
  td__lane **work; /* refresh's copy of them (rx_mu) */
  int workcap;
  uint64_t looked; /* lanes refresh looked at, in all (rx_mu; tests) */
  int nlanes;      /* (ls->mu) */
  int up;          /* atomic: both directions switched */
  uint32_t gen;    /* atomic: bumped when the thread's set changes */
  int *pid_of;     /* atomic pointer; [world] */
  int world;
  int64_t spin_ns; /* atomic */
  bool sleeping;   /* atomic: the lane thread waits on its bell */
  int waiters;     /* atomic: threads polling in td_future_wait */
  /* the receive side, driven by whoever holds rx_mu (the lane thread or a waiter) */
  pthread_mutex_t rx_mu;
  td__lane **set; /* lanes that receive or send (references) */
  int nset, setcap;
  uint32_t set_gen; /* ls->gen when set was built */
  bool stop;       /* atomic */
  pthread_t thread;
  bool started;
  /* dialled lanes: the dial socket and the socket thread (td__lanes_listen_dial) */
  int dial_fd, ep, wake_fd;
  char dial_name[64];
  td__auth dial_auth;
  int self_rank;
  uint64_t *nonce_of;  /* atomic pointer; [world] */
  int64_t hs_ns;
  int64_t ka_ns, kt_ns; /* keepalive of dialled lanes: interval, how long a ping may wait */
  uint64_t ka_round_ns; /* socket thread: the last keepalive round */
  pthread_t sock_thread;
  bool sock_started;
  bool sock_stop;      /* atomic */
  td__lane *dialq;     /* client lanes for the socket thread to register (ls->mu) */
  td__lane *reg;       /* lanes registered with ep (socket thread) */
  td__lane *hs;        /* ... of them, those in their handshake (deadlines swept) */
  td__lane *grave;     /* lanes it dropped this round: their references go after the round, so an
                        * event of the same round still finds the lane (not registered) */
  int pending;         /* server handshakes in progress (socket thread) */
  int ndirect;         /* atomic: dialled lanes not yet dropped */
  /* hints (BELL_HINTS_ON): slots given to lanes (ls->mu), the set by slot (rx_mu) */
  int *free_slots, nfree, next_slot;
  td__lane **by_slot;
  int nby, bycap;
  int slotless;        /* lanes of the set without a slot (rx_mu) */
  bool hints;          /* reading by hints now (rx_mu) */
  int npw;             /* lanes of the set whose producer flag is up (rx_mu) */
  td__lane **fresh;    /* lanes new in the set since the last pass (rx_mu): read once each, as a
                        * bit set for them before they were in the set was dropped */
  int nfresh, freshcap;
  uint64_t full_ns;    /* the last pass over every lane (rx_mu) */
  uint64_t repass_at;  /* atomic: a pass over every lane is due then (0: none; rx_mu) */
  int nap_ms;          /* the lane thread's next sleep at most (NAP_MS; lane thread) */
  bool test_withhold;  /* atomic: our frames set no hint bit for the peer (tests) */
  int nqueued;         /* atomic: lanes with frames queued to send */
  int dialed_up;       /* atomic: dialled lanes up */
  /* mailbox: this process's arena, and the lanes made through peers' arenas */
  int arena_fd;
  uint8_t *arena;
  size_t arena_bytes;
  int arena_world;
  uint32_t knocks_lt;  /* the lane thread: knocks when it last woke the socket thread (rx_mu) */
  bool knocked;        /* a pass saw the knocks move (rx_mu) */
  uint32_t knocks_st;  /* the socket thread: knocks it last read the bitmap for */
  pthread_mutex_t mbox_mu; /* before the transport's locks; nothing is taken under it but those */
  td__lane **mbox_lane;    /* [arena_world] (mbox_mu; references) */
  uint8_t *mbox_dead;      /* [arena_world] (mbox_mu): no (more) mailbox lane with this rank */
  int *mb_bell_of, *mb_arena_of; /* [world] peers' published descriptors (atomic pointer) */
  td__lane *mbq;       /* mailbox lanes whose pidfd the socket thread is to watch (ls->mu) */
  int mbox_up;         /* atomic: mailbox lanes up */
  bool mbox_on;        /* atomic: the arena is published and peers' are known (set once) */
};

/* This process's arena once mailbox lanes are on, else NULL. */
static mbox_hdr *mbox_live(const td__lanes *ls) {
  return __atomic_load_n(&ls->mbox_on, __ATOMIC_ACQUIRE) ? (mbox_hdr *)ls->arena : NULL;
}

/* ---- small helpers ---- */

/* A full barrier between a store and a later load (the doorbell's check). ThreadSanitizer does
 * not support fences: there a sequentially consistent read-modify-write stands in (the doorbell's
 * 100 ms sleep bounds what a lost wake-up could cost anyway). */
#if defined(__SANITIZE_THREAD__)
#define LANE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LANE_TSAN 1
#endif
#endif
#ifdef LANE_TSAN
static int fence_word;
#define FULL_FENCE() ((void)__atomic_fetch_add(&fence_word, 0, __ATOMIC_SEQ_CST))
#else
#define FULL_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

static long futex(uint32_t *w, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, w, op, val, ts, NULL, 0);
}

static void ring_bell(uint32_t *bell) {
  __atomic_add_fetch(bell, 1, __ATOMIC_SEQ_CST);
  futex(bell, FUTEX_WAKE, 1, NULL);
}

static void kick_self(td__lanes *ls) {
  __atomic_add_fetch(ls->bell, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&ls->sleeping, __ATOMIC_SEQ_CST)) futex(ls->bell, FUTEX_WAKE, 1, NULL);
}

static uint64_t *hint_words(uint32_t *bell) { return (uint64_t *)((uint8_t *)bell + HINT_BYTE); }

/* Sets the bit of a slot (as published: plus 1; 0 or out of range: nothing) in bell's hints. */
static void hint_set(uint32_t *bell, uint32_t slot1) {
  if (slot1 == 0 || slot1 > MAX_SLOTS) return;
  __atomic_fetch_or(&hint_words(bell)[(slot1 - 1) / 64], 1ull << ((slot1 - 1) % 64),
                    __ATOMIC_SEQ_CST);
}

/* After publishing to a peer (or freeing room for it): its hint for the lane, if it reads by
 * hints. slotp: where the peer published its slot for the lane. */
static void hint_peer(uint32_t *pb, const uint32_t *slotp) {
  if (__atomic_load_n(&pb[BELL_HINTS_ON], __ATOMIC_SEQ_CST))
    hint_set(pb, __atomic_load_n(slotp, __ATOMIC_RELAXED));
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* A memfd of n bytes that can neither shrink nor grow, mapped shared. */
static int sealed_memfd(const char *name, size_t n, uint8_t **map) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, (off_t)n) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    close(fd);
    return -1;
  }
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  *map = p;
  return fd;
}

/* Maps a descriptor received from a peer: a sealed memfd of exactly n bytes, or NULL. */
static uint8_t *map_received(int fd, size_t n, const char **why) {
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != n) {
    *why = "the shared memory has the wrong kind or size";
    return NULL;
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    *why = "the shared memory is not sealed against resizing";
    return NULL;
  }
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = "cannot map the shared memory";
    return NULL;
  }
  return p;
}

static bool secret_eq(const uint8_t *a, const uint8_t *b) {
  uint8_t d = 0;
  for (int i = 0; i < TD__LANE_SECRET; i++) d |= (uint8_t)(a[i] ^ b[i]);
  return d == 0;
}

static int pid_for(td__lanes *ls, int rank) {
  int *p = __atomic_load_n(&ls->pid_of, __ATOMIC_ACQUIRE);
  return p && rank >= 0 && rank < ls->world ? p[rank] : 0;
}

/* ---- the ring ---- */

size_t td__ring_ctl_size(void) { return sizeof(td__ring_ctl); }
uint64_t *td__ring_tail_word(td__ring_ctl *r) { return &r->tail; }
uint64_t *td__ring_head_word(td__ring_ctl *r) { return &r->head; }

int64_t td__ring_readable(const td__ring_ctl *r, uint64_t head) {
  uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
  uint64_t avail = tail - head; /* wraps to a huge number when tail is behind head */
  return avail > TD__LANE_RING ? -1 : (int64_t)avail;
}

int64_t td__ring_writable(const td__ring_ctl *r, uint64_t tail) {
  uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
  uint64_t used = tail - head;
  return used > TD__LANE_RING ? -1 : (int64_t)(TD__LANE_RING - used);
}

int64_t td__ring_consume(td__ring_ctl *r, const uint8_t *data, uint64_t *head, td__decoder *dec,
                         uint64_t max) {
  int64_t avail = td__ring_readable(r, *head);
  if (avail < 0) {
    td_set_error(TD_ERR_FORMAT, "lane ring corrupt (the peer's write position is out of range)");
    return -1;
  }
  uint64_t n = (uint64_t)avail < max ? (uint64_t)avail : max;
  if (n == 0) return 0; /* (no store to the shared head: a pass over idle rings writes nothing) */
  uint64_t done = 0;
  while (done < n) {
    size_t off = (size_t)((*head + done) % TD__LANE_RING);
    size_t piece = TD__LANE_RING - off;
    if (piece > n - done) piece = (size_t)(n - done);
    size_t used = 0;
    if (td__decoder_feed_some(dec, data + off, piece, &used) != TD_OK) return -1;
    done += used;
    if (td__decoder_paused(dec)) break; /* the rest waits for td__decoder_resume */
  }
  if (done) {
    *head += done;
    __atomic_store_n(&r->head, *head, __ATOMIC_RELEASE);
  }
  return (int64_t)done;
}

void td__lane_rings(td__lane *l, td__ring_ctl **tx, td__ring_ctl **rx) {
  *tx = l->tx;
  *rx = l->rx;
}

/* ---- sending (l->txmu held) ---- */

static void msg_free(td__lane_msg *m) {
  td__free(m->head);
  td__free(m->extra);
  for (int i = 0; i < m->ntensors; i++) td_tensor_unref(m->tensors[i]);
  td__free(m->tensors);
  memset(m, 0, sizeof *m);
}

static void part_of(const td__lane_msg *m, int part, const uint8_t **p, size_t *n) {
  if (part == 0) {
    *p = m->head;
    *n = m->head_len;
  } else if (part == 1) {
    *p = m->extra;
    *n = m->extra ? m->extra_len : 0;
  } else {
    td_tensor *t = m->tensors[part - 2];
    *p = td_tensor_data(t);
    *n = td_tensor_nbytes(t);
  }
}

/* Copies what fits of m (from part/off) into the ring; true when m is all written. Publishes the
 * new tail; *wrote tells whether anything moved. -1 room: corrupt. */
static int write_msg(td__lane *l, td__lane_msg *m, int *part, size_t *off, bool *wrote) {
  int64_t room = td__ring_writable(l->tx, l->tx_tail);
  if (room < 0) return -1;
  int nparts = 2 + m->ntensors;
  while (*part < nparts) {
    const uint8_t *p;
    size_t n;
    part_of(m, *part, &p, &n);
    while (*off < n && room > 0) {
      size_t pos = (size_t)(l->tx_tail % TD__LANE_RING);
      size_t k = TD__LANE_RING - pos;
      if (k > n - *off) k = n - *off;
      if ((int64_t)k > room) k = (size_t)room;
      memcpy(l->tx_data + pos, p + *off, k);
      *off += k;
      l->tx_tail += k;
      room -= (int64_t)k;
      *wrote = true;
    }
    if (*off < n) break;
    (*part)++;
    *off = 0;
  }
  if (*wrote) __atomic_store_n(&l->tx->tail, l->tx_tail, __ATOMIC_RELEASE);
  return *part == nparts ? 1 : 0;
}

/* After publishing: ring the peer when it sleeps. */
static void tx_notify(td__lane *l) {
  FULL_FENCE();
  uint32_t *pb = __atomic_load_n(&l->peer_bell, __ATOMIC_ACQUIRE);
  if (!pb) return;
  if (!__atomic_load_n(&l->ls->test_withhold, __ATOMIC_RELAXED))
    hint_peer(pb, &l->tx->consumer_slot);
  if (__atomic_load_n(&pb[BELL_SLEEP], __ATOMIC_SEQ_CST)) ring_bell(pb);
}

/* Writes queued frames while there is room (txmu held). Returns true when something moved. */
static bool drain_locked(td__lane *l, bool *corrupt) {
  bool wrote = false;
  while (l->q_head) {
    txq *e = l->q_head;
    int r = write_msg(l, &e->m, &e->part, &e->off, &wrote);
    if (r < 0) {
      *corrupt = true;
      break;
    }
    if (r == 0) break;
    l->q_head = e->next;
    if (!l->q_head) l->q_tail = NULL;
    if (__atomic_sub_fetch(&l->qlen, 1, __ATOMIC_RELEASE) == 0)
      __atomic_sub_fetch(&l->ls->nqueued, 1, __ATOMIC_RELEASE);
    msg_free(&e->m);
    td__free(e);
  }
  return wrote;
}

/* Our own lane has work for the lane thread (frames queued, a decoder resumed, its end). */
static void hint_self(td__lane *l) {
  int slot = __atomic_load_n(&l->slot, __ATOMIC_RELAXED);
  if (slot >= 0) hint_set(l->ls->bell, (uint32_t)slot + 1);
  kick_self(l->ls);
}

td_status td__lane_send(td__lane *l, td__lane_msg *m) {
  if (l->direct) __atomic_add_fetch(&l->tx_frames, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&l->txmu);
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) {
    pthread_mutex_unlock(&l->txmu);
    msg_free(m);
    return td_set_error(TD_ERR_UNAVAILABLE, "the lane to rank %d is closed", l->peer);
  }
  bool wrote = false, corrupt = false;
  int part = 0;
  size_t off = 0;
  int r = 0;
  /* in order: behind anything queued, else straight into the ring (no thread hand-off) */
  if (!l->q_head) {
    r = write_msg(l, m, &part, &off, &wrote);
    if (r < 0) corrupt = true;
  }
  if (r == 1) {
    msg_free(m);
  } else if (!corrupt) {
    txq *e = td__calloc(1, sizeof *e);
    if (!e) {
      /* a frame half in the ring cannot be taken back: the stream is unusable */
      pthread_mutex_unlock(&l->txmu);
      msg_free(m);
      if (wrote) /* half a frame is in the ring and cannot be taken back */
        return td_set_error(TD_ERR_FORMAT, "rpc lane: out of memory in the middle of a frame");
      return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory queueing a frame");
    }
    e->m = *m;
    memset(m, 0, sizeof *m);
    e->part = part;
    e->off = off;
    if (l->q_tail) l->q_tail->next = e;
    else l->q_head = e;
    l->q_tail = e;
    if (__atomic_add_fetch(&l->qlen, 1, __ATOMIC_RELEASE) == 1)
      __atomic_add_fetch(&l->ls->nqueued, 1, __ATOMIC_RELEASE);
  } else {
    msg_free(m);
  }
  pthread_mutex_unlock(&l->txmu);
  if (corrupt)
    return td_set_error(TD_ERR_FORMAT, "lane ring corrupt (the peer's read position is out of "
                        "range)");
  if (wrote) tx_notify(l);
  if (r != 1) hint_self(l); /* the lane thread writes the rest as room frees up */
  return TD_OK;
}

/* ---- lifecycle of one lane ---- */

static td__lane *lane_new(td__lanes *ls, int peer, bool server, td__decoder *dec, void *ud) {
  td__lane *l = td__calloc(1, sizeof *l);
  if (!l) return NULL;
  td__ref_init(&l->rc);
  l->ls = ls;
  l->peer = peer;
  l->server = server;
  l->sock = -1;
  l->slot = -1;
  l->set_idx = l->set_slot = -1;
  l->dec = dec;
  l->ud = ud;
  pthread_mutex_init(&l->txmu, NULL);
  return l;
}

/* Publishes the lane's slot in our hints to the peer (once both are known). */
static void publish_slot(td__lane *l) {
  int slot = __atomic_load_n(&l->slot, __ATOMIC_RELAXED);
  if (slot < 0 || !l->rx) return;
  __atomic_store_n(&l->rx->consumer_slot, (uint32_t)slot + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&l->tx->producer_slot, (uint32_t)slot + 1, __ATOMIC_RELEASE);
}

/* Points the lane at its rings (client: producer of ring 0; server: of ring 1). */
static void lane_bind(td__lane *l) {
  lane_hdr *h = (lane_hdr *)l->map;
  int t = l->server ? 1 : 0;
  l->tx = &h->ring[t];
  l->rx = &h->ring[1 - t];
  l->tx_data = l->map + RING_OFF + (size_t)t * TD__LANE_RING;
  l->rx_data = l->map + RING_OFF + (size_t)(1 - t) * TD__LANE_RING;
  /* our own positions start where the peer left them at zero; never read back afterwards */
  l->tx_tail = 0;
  l->rx_head = 0;
  publish_slot(l);
}

td__lane *td__lane_ref(td__lane *l) {
  if (l) td__ref_inc(&l->rc);
  return l;
}

void td__lane_unref(td__lane *l) {
  if (!l || !td__ref_dec(&l->rc)) return;
  for (txq *e = l->q_head, *n; e; e = n) {
    n = e->next;
    msg_free(&e->m);
    td__free(e);
  }
  if (l->sock >= 0) close(l->sock);
  if (l->map) munmap(l->map, MAP_BYTES);
  if (l->peer_bell) munmap(l->peer_bell, BELL_BYTES);
  if (l->mb_hdr) munmap(l->mb_hdr, MBOX_HDR);
  if (l->mb_slot) munmap(l->mb_slot, MBOX_SLOT);
  td__decoder_destroy(l->dec);
  pthread_mutex_destroy(&l->txmu);
  td__free(l);
}

/* A slot in our hints for l (ls->mu held); none past MAX_SLOTS (the lane is then read on
 * every pass). */
static void slot_take(td__lanes *ls, td__lane *l) {
  int slot = ls->nfree ? ls->free_slots[--ls->nfree]
                       : ls->next_slot < (int)MAX_SLOTS ? ls->next_slot++ : -1;
  __atomic_store_n(&l->slot, slot, __ATOMIC_RELAXED);
}

/* l leaves the list: its slot goes back (ls->mu held). */
static void slot_give(td__lanes *ls, td__lane *l) {
  int slot = __atomic_exchange_n(&l->slot, -1, __ATOMIC_RELAXED);
  if (slot < 0) return;
  if (ls->nfree % 64 == 0) {
    int *nf = td__realloc(ls->free_slots, (size_t)(ls->nfree + 64) * sizeof *nf);
    if (!nf) return; /* (the slot is lost: the next ones come from next_slot) */
    ls->free_slots = nf;
  }
  ls->free_slots[ls->nfree++] = slot;
}

/* l goes on ls->dirty for the next refresh (ls->mu held). */
static void dirty_locked(td__lanes *ls, td__lane *l) {
  if (l->dirty_q) return;
  l->dirty_q = true;
  l->dirty_next = ls->dirty;
  ls->dirty = td__lane_ref(l);
}

/* l was added, switched on or closed: the lane thread's next refresh looks at it (any thread
 * not holding ls->mu). Refresh looks at these lanes only: walking every lane at each change
 * (a lane made or closed, N of each per process in a group's all-to-all) was O(N) per change. */
static void lane_changed(td__lane *l) {
  td__lanes *ls = l->ls;
  pthread_mutex_lock(&ls->mu);
  dirty_locked(ls, l);
  pthread_mutex_unlock(&ls->mu);
  __atomic_add_fetch(&ls->gen, 1, __ATOMIC_RELEASE);
}

static void lanes_add(td__lanes *ls, td__lane *l) {
  pthread_mutex_lock(&ls->mu);
  l->prev = NULL;
  l->next = ls->lanes;
  if (ls->lanes) ls->lanes->prev = l;
  ls->lanes = td__lane_ref(l);
  l->listed = true;
  ls->nlanes++;
  slot_take(ls, l);
  publish_slot(l);
  dirty_locked(ls, l);
  pthread_mutex_unlock(&ls->mu);
  __atomic_add_fetch(&ls->gen, 1, __ATOMIC_RELEASE);
}

void td__lane_close_why(td__lane *l, const char *why) {
  if (!l) return;
  pthread_mutex_lock(&l->txmu);
  if (why && !l->why[0]) snprintf(l->why, sizeof l->why, "%s", why);
  int was = __atomic_exchange_n(&l->state, L_CLOSED, __ATOMIC_ACQ_REL);
  __atomic_store_n(&l->tx_on, false, __ATOMIC_RELEASE);
  for (txq *e = l->q_head, *n; e; e = n) {
    n = e->next;
    msg_free(&e->m);
    td__free(e);
  }
  l->q_head = l->q_tail = NULL;
  if (__atomic_exchange_n(&l->qlen, 0, __ATOMIC_ACQ_REL) > 0)
    __atomic_sub_fetch(&l->ls->nqueued, 1, __ATOMIC_RELEASE);
  /* a dialled lane's socket ends with it: the peer's socket thread sees it (the fd itself is
   * the socket thread's to close) */
  if (l->direct && !l->mbox && l->sock >= 0 && was != L_CLOSED) shutdown(l->sock, SHUT_RDWR);
  /* a mailbox lane has no socket: both its rings say so, and the peer is rung to read it (it
   * closes its side once it has read what we wrote); the socket thread lets go of the pidfd */
  if (l->mbox && was != L_CLOSED && l->tx) {
    __atomic_store_n(&l->tx->producer_gone, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&l->rx->consumer_gone, 1, __ATOMIC_RELEASE);
    FULL_FENCE();
    hint_peer(l->peer_bell, &l->tx->consumer_slot);
    ring_bell(l->peer_bell);
  }
  pthread_mutex_unlock(&l->txmu);
  if (__atomic_exchange_n(&l->counted, false, __ATOMIC_ACQ_REL)) {
    __atomic_sub_fetch(&l->ls->up, 1, __ATOMIC_RELAXED);
    if (l->direct) __atomic_sub_fetch(&l->ls->dialed_up, 1, __ATOMIC_RELAXED);
    if (l->mbox) __atomic_sub_fetch(&l->ls->mbox_up, 1, __ATOMIC_RELAXED);
  }
  lane_changed(l);
  kick_self(l->ls); /* the thread drops it */
}

void td__lane_close(td__lane *l) { td__lane_close_why(l, NULL); }

static void lane_fail(td__lane *l, const char *why) {
  /* (the lane thread, or the socket thread for a dialled lane) */
  if (__atomic_exchange_n(&l->failed, true, __ATOMIC_ACQ_REL)) return;
  td_log(TD_LOG_WARN, "rpc: closing the %s %s rank %d: %s", l->direct ? "lane" : "stream",
         l->server ? "from" : "to", l->peer, why);
  td__lane_close_why(l, why);
  if (!l->direct && l->ls->o.failed) l->ls->o.failed(l->ud, why);
}

bool td__lane_tx_on(const td__lane *l) { return __atomic_load_n(&l->tx_on, __ATOMIC_ACQUIRE); }

/* Both directions on: the lane counts as up (once). Poller thread. */
static void count_up(td__lane *l) {
  if (__atomic_load_n(&l->tx_on, __ATOMIC_ACQUIRE) && __atomic_load_n(&l->rx_on, __ATOMIC_ACQUIRE) &&
      __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) != L_CLOSED &&
      (!l->direct || __atomic_load_n(&l->dial, __ATOMIC_ACQUIRE) == D_UP) &&
      !__atomic_exchange_n(&l->counted, true, __ATOMIC_ACQ_REL)) {
    __atomic_add_fetch(&l->ls->up, 1, __ATOMIC_RELAXED);
    if (l->direct) __atomic_add_fetch(&l->ls->dialed_up, 1, __ATOMIC_RELAXED);
    if (l->mbox) __atomic_add_fetch(&l->ls->mbox_up, 1, __ATOMIC_RELAXED);
  }
}

void td__lane_start_tx(td__lane *l) {
  __atomic_store_n(&l->tx_on, true, __ATOMIC_RELEASE);
  count_up(l);
  lane_changed(l);
  kick_self(l->ls);
}

void td__lane_start_rx(td__lane *l) {
  __atomic_store_n(&l->rx_on, true, __ATOMIC_RELEASE);
  count_up(l);
  lane_changed(l);
  kick_self(l->ls);
}

/* ---- set-up ---- */

td_status td__lane_offer(td__lanes *ls, int peer, td__decoder *dec, void *ud, uint8_t *body,
                         size_t *len, td__lane **out) {
  *out = NULL;
  if (pid_for(ls, peer) <= 0) {
    td__decoder_destroy(dec);
    return TD_OK;
  }
  pthread_mutex_lock(&ls->mu);
  bool full = ls->nlanes >= TD__LANE_MAX;
  pthread_mutex_unlock(&ls->mu);
  if (full) {
    td__decoder_destroy(dec);
    return TD_OK;
  }
  td__lane *l = lane_new(ls, peer, true, dec, ud);
  if (!l) {
    td__decoder_destroy(dec);
    return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  }
  for (int i = 0; i < TD__LANE_SECRET; i += 8) {
    uint64_t v = td__samehost_nonce(l);
    memcpy(l->secret + i, &v, 8);
  }
  l->state = L_OFFERED;
  /* body: secret, name length (1 byte), abstract name */
  size_t nl = strlen(ls->name);
  memcpy(body, l->secret, TD__LANE_SECRET);
  body[TD__LANE_SECRET] = (uint8_t)nl;
  memcpy(body + TD__LANE_SECRET + 1, ls->name, nl);
  *len = TD__LANE_SECRET + 1 + nl;
  lanes_add(ls, l);
  *out = l;
  return TD_OK;
}

/* Reads an OFFER body: the secret and the socket address. */
static bool parse_offer(const uint8_t *body, size_t len, uint8_t *secret, struct sockaddr_un *a,
                        socklen_t *alen) {
  if (len < TD__LANE_SECRET + 2) return false;
  size_t nl = body[TD__LANE_SECRET];
  if (nl == 0 || nl > 60 || len != TD__LANE_SECRET + 1 + nl) return false;
  memcpy(secret, body, TD__LANE_SECRET);
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  a->sun_path[0] = 0; /* abstract */
  memcpy(a->sun_path + 1, body + TD__LANE_SECRET + 1, nl);
  *alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl);
  return true;
}

static int peer_pid(int fd) {
  struct ucred cr;
  socklen_t n = sizeof cr;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &n) != 0 || n != sizeof cr) return -1;
  return (int)cr.pid;
}

/* Sends n bytes of buf with nfd (1 or 2) descriptors over fd, all at once. */
static bool send_fds(int fd, const void *buf, size_t n, const int *fds, int nfd) {
  struct iovec iov = {(void *)buf, n};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(2 * sizeof(int))];
  } cm;
  memset(&cm, 0, sizeof cm);
  struct msghdr mh = {0};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.b;
  mh.msg_controllen = CMSG_SPACE((size_t)nfd * sizeof(int));
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN((size_t)nfd * sizeof(int));
  memcpy(CMSG_DATA(c), fds, (size_t)nfd * sizeof(int));
  return sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)n;
}

/* Sends magic (u32) and an optional secret with fds over fd, all at once. */
static bool send_with_fds(int fd, uint32_t magic, const uint8_t *secret, const int *fds, int nfd) {
  uint8_t buf[4 + TD__LANE_SECRET];
  td__put_u32(buf, magic);
  size_t n = 4;
  if (secret) {
    memcpy(buf + 4, secret, TD__LANE_SECRET);
    n += TD__LANE_SECRET;
  }
  return send_fds(fd, buf, n, fds, nfd);
}

/* The descriptors a received message carried: up to max into fds (the rest closed); returns how
 * many. */
static int take_rights(struct msghdr *mh, int *fds, int max) {
  int n = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int x;
      memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
      if (n < max) fds[n++] = x;
      else close(x);
    }
  }
  return n;
}

/* Receives magic + payload (want bytes in all) and up to 2 fds without waiting. Returns the
 * number of fds (their descriptors in fds), -1 when nothing is there yet, -2 when malformed. */
/* One recvmsg without waiting: up to n bytes into buf and up to 2 descriptors into fds (*nfd of
 * them); *flags gets the message's flags. Returns what recvmsg returned (-1 with errno). */
static ssize_t recv_some(int fd, void *buf, size_t n, int *fds, int *nfd, int *flags) {
  struct iovec iov = {buf, n};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(4 * sizeof(int))];
  } cm;
  struct msghdr mh = {0};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = cm.b;
  mh.msg_controllen = sizeof cm.b;
  ssize_t got = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  *nfd = got >= 0 ? take_rights(&mh, fds, 2) : 0;
  *flags = got >= 0 ? mh.msg_flags : 0;
  return got;
}

static int recv_with_fds(int fd, uint8_t *buf, size_t want, int *fds) {
  int n, flags;
  ssize_t got = recv_some(fd, buf, want, fds, &n, &flags);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return -1;
  if (got != (ssize_t)want || (flags & (MSG_CTRUNC | MSG_TRUNC))) {
    for (int i = 0; i < n; i++) close(fds[i]);
    return -2;
  }
  return n;
}

td_status td__lane_join(td__lanes *ls, int peer, const uint8_t *body, size_t len,
                        td__decoder *dec, void *ud, td__lane **out) {
  *out = NULL;
  uint8_t secret[TD__LANE_SECRET];
  struct sockaddr_un sa;
  socklen_t salen;
  int want = pid_for(ls, peer);
  if (want <= 0 || !parse_offer(body, len, secret, &sa, &salen)) {
    td__decoder_destroy(dec);
    return td_set_error(TD_ERR_UNAVAILABLE, want <= 0 ? "rank %d is not known on this host"
                        : "malformed lane offer from rank %d", peer);
  }
  td__lane *l = lane_new(ls, peer, false, dec, ud);
  if (!l) {
    td__decoder_destroy(dec);
    return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  }
  const char *why = NULL;
  int mfd = -1;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, salen) != 0) why = "cannot connect";
  int got = why ? -1 : peer_pid(fd);
  if (!why && got != want) why = "the socket is not held by the verified process";
  if (!why && (mfd = sealed_memfd("tdist-lane", MAP_BYTES, &l->map)) < 0)
    why = "cannot create the shared memory";
  if (!why) {
    lane_hdr *h = (lane_hdr *)l->map;
    memcpy(h->magic, LANE_MAGIC, sizeof LANE_MAGIC);
    h->version = 2;
    h->ring_bytes = TD__LANE_RING;
    lane_bind(l);
    int fds[2] = {mfd, ls->bell_fd};
    if (!send_with_fds(fd, JOIN_MAGIC, secret, fds, 2)) why = "cannot hand the lane over";
  }
  if (mfd >= 0) close(mfd);
  if (why) {
    if (fd >= 0) close(fd);
    td__lane_unref(l);
    return td_set_error(TD_ERR_UNAVAILABLE, "lane to rank %d: %s", peer, why);
  }
  l->sock = fd;
  l->state = L_JOINED;
  lanes_add(ls, l);
  *out = l;
  return TD_OK;
}

/* The offered lane of the process pid (ls->mu held), or NULL. */
static td__lane *offered_to(td__lanes *ls, int pid) {
  for (td__lane *l = ls->lanes; l; l = l->next)
    if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_OFFERED && pid_for(ls, l->peer) == pid)
      return l;
  return NULL;
}

/* take_lane maps a peer's lane (fds[0]) and doorbell (fds[1]), checks the lane's magic and answers
 * on sock with our doorbell under magic (the server's last step of both set-ups), followed for a
 * dialled lane by one byte, reads (0 or 1: whether we read the peer's memory; -1: no byte). NULL
 * when done (*map, *bell mapped), else why (nothing stays mapped). */
static const char *take_lane(td__lanes *ls, int sock, const int *fds, uint32_t magic, int reads,
                             uint8_t **map, uint8_t **bell) {
  const char *why = NULL;
  *bell = NULL;
  *map = map_received(fds[0], MAP_BYTES, &why);
  if (!why) *bell = map_received(fds[1], BELL_BYTES, &why);
  if (!why && memcmp(((lane_hdr *)*map)->magic, LANE_MAGIC, sizeof LANE_MAGIC) != 0)
    why = "not a lane";
  if (!why) {
    /* the answer: magic, then (a dialled lane) whether we read the peer's memory, 0 or 1 */
    uint8_t msg[5];
    td__put_u32(msg, magic);
    msg[4] = (uint8_t)(reads > 0);
    if (!send_fds(sock, msg, reads < 0 ? 4 : 5, &ls->bell_fd, 1))
      why = "cannot answer the hand-over";
  }
  if (why) {
    if (*map) munmap(*map, MAP_BYTES);
    if (*bell) munmap(*bell, BELL_BYTES);
    *map = *bell = NULL;
  }
  return why;
}

static void refuse(td__lanes *ls, const char *why) {
  if (ls->o.refused) ls->o.refused(ls->o.refused_ud, why);
}

/* Server: reads the client's hand-over from l->sock (a connection from its verified process).
 * True when done (accepted or refused); false when its bytes are not there yet. */
static bool take_handover(td__lanes *ls, td__lane *l) {
  uint8_t buf[4 + TD__LANE_SECRET];
  int fds[2] = {-1, -1};
  int n = recv_with_fds(l->sock, buf, sizeof buf, fds);
  if (n == -1) return false;
  const char *why = NULL;
  if (n != 2 || td__get_u32(buf) != JOIN_MAGIC) why = "malformed lane hand-over";
  else if (!secret_eq(buf + 4, l->secret)) why = "wrong lane secret";
  uint8_t *map = NULL, *bell = NULL;
  if (!why) why = take_lane(ls, l->sock, fds, BELL_MAGIC, -1, &map, &bell);
  for (int i = 0; i < n; i++) close(fds[i]);
  close(l->sock);
  l->sock = -1;
  if (why) {
    char msg[160];
    snprintf(msg, sizeof msg, "lane socket: %s (from the process of rank %d)", why, l->peer);
    refuse(ls, msg);
    __atomic_store_n(&l->state, L_CLOSED, __ATOMIC_RELEASE);
    lane_changed(l);
    return true;
  }
  l->map = map;
  l->peer_bell = (uint32_t *)bell;
  lane_bind(l);
  __atomic_store_n(&l->state, L_ACCEPTED, __ATOMIC_RELEASE);
  return true;
}

/* Accepts every waiting connection: one from the verified process of an offered lane is kept
 * on that lane; any other is closed and counted. */
static void accept_all(td__lanes *ls) {
  for (int i = 0; i < 256; i++) {
    int fd = accept4(ls->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    int pid = peer_pid(fd);
    pthread_mutex_lock(&ls->mu);
    td__lane *l = pid > 0 ? offered_to(ls, pid) : NULL;
    if (l) {
      if (l->sock >= 0) close(l->sock);
      l->sock = fd;
      td__lane_ref(l);
    }
    pthread_mutex_unlock(&ls->mu);
    if (!l) {
      close(fd);
      char msg[120];
      snprintf(msg, sizeof msg, "lane socket: a connection from process %d, which was offered "
               "no lane", pid);
      refuse(ls, msg);
      continue;
    }
    take_handover(ls, l);
    td__lane_unref(l);
  }
}

td_status td__lane_accept(td__lane *l) {
  td__lanes *ls = l->ls;
  accept_all(ls);
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_OFFERED && l->sock >= 0)
    take_handover(ls, l);
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) != L_ACCEPTED) {
    td__lane_close(l);
    return td_set_error(TD_ERR_UNAVAILABLE, "lane from rank %d: no valid hand-over", l->peer);
  }
  return TD_OK;
}

td_status td__lane_ready(td__lane *l) {
  uint8_t buf[4];
  int fds[2] = {-1, -1};
  int n = l->sock >= 0 ? recv_with_fds(l->sock, buf, sizeof buf, fds) : -2;
  const char *why = NULL;
  uint8_t *bell = NULL;
  if (n != 1 || td__get_u32(buf) != BELL_MAGIC) why = "no doorbell came with READY";
  else bell = map_received(fds[0], BELL_BYTES, &why);
  for (int i = 0; i < n; i++) close(fds[i]);
  if (l->sock >= 0) close(l->sock);
  l->sock = -1;
  if (why) {
    td__lane_close(l);
    return td_set_error(TD_ERR_UNAVAILABLE, "lane to rank %d: %s", l->peer, why);
  }
  l->peer_bell = (uint32_t *)bell;
  __atomic_store_n(&l->state, L_ACCEPTED, __ATOMIC_RELEASE);
  return TD_OK;
}

/* ---- receiving: the lane thread, or a thread waiting for a future ----
 *
 * The receive side of every lane (the set, the decoders) is driven by whoever holds ls->rx_mu:
 * the lane thread, or a thread about to block in td_future_wait (the wait poller, registered
 * while the busy-poll window is on): that thread takes the reply it waits for itself, with no
 * wake-up of a sleeping thread in between. While a waiter polls, the lane thread sleeps; the last
 * waiter to leave hands the rings back to the sleeping thread (doorbell flags set, re-checked). */

/* A closed lane leaves: its stream reference goes back (it may free the stream, which drops
 * its own reference to the lane), then the list's reference. */
static void lane_release(td__lane *l) {
  /* (a mailbox lane's owner is lent out under mbox_mu: td__lanes_mbox) */
  if (l->mbox) pthread_mutex_lock(&l->ls->mbox_mu);
  void *ud = l->ud;
  l->ud = NULL;
  if (l->mbox) pthread_mutex_unlock(&l->ls->mbox_mu);
  if (l->direct) {
    __atomic_sub_fetch(&l->ls->ndirect, 1, __ATOMIC_RELAXED);
    if (ud && l->ls->o.ended && !__atomic_exchange_n(&l->ended, true, __ATOMIC_ACQ_REL)) {
      char why[200];
      pthread_mutex_lock(&l->txmu);
      snprintf(why, sizeof why, "%s", l->why[0] ? l->why : "the lane was closed");
      pthread_mutex_unlock(&l->txmu);
      l->ls->o.ended(ud, why);
    }
  }
  if (ud && l->ls->o.release) l->ls->o.release(ud);
  td__lane_unref(l);
}

/* The peer is gone: its socket ended, or (a mailbox lane) it closed its side. */
static bool peer_ended(td__lane *l) {
  return __atomic_load_n(&l->eof, __ATOMIC_ACQUIRE) ||
         (l->mbox && (__atomic_load_n(&l->rx->producer_gone, __ATOMIC_ACQUIRE) ||
                      __atomic_load_n(&l->tx->consumer_gone, __ATOMIC_ACQUIRE)));
}

static void wake_sock(td__lanes *ls);

/* Reads what the peer wrote; true when something was consumed. rx_mu held. */
static bool poll_rx(td__lane *l) {
  if (!__atomic_load_n(&l->rx_on, __ATOMIC_ACQUIRE) || __atomic_load_n(&l->failed, __ATOMIC_ACQUIRE) ||
      __atomic_load_n(&l->rx_paused, __ATOMIC_ACQUIRE))
    return false;
  /* a dialled lane whose peer closed its socket (a mailbox lane: its side, or its process
   * ended): what it wrote before is read first */
  bool eof = peer_ended(l);
  if (eof && td__ring_readable(l->rx, l->rx_head) == 0) {
    char why[120];
    snprintf(why, sizeof why, "rank %d closed the lane (its process ended or closed it)", l->peer);
    __atomic_store_n(&l->failed, true, __ATOMIC_RELEASE); /* (once; a peer leaving is no warning) */
    td__lane_close_why(l, why);
    return false;
  }
  int64_t got = td__ring_consume(l->rx, l->rx_data, &l->rx_head, l->dec, RX_BUDGET);
  if (got < 0) {
    char why[300];
    snprintf(why, sizeof why, "%s", td_last_error());
    lane_fail(l, why);
    return false;
  }
  if (td__decoder_paused(l->dec)) {
    /* a large copy: another thread makes it, as the gRPC stream's do, so the lanes of every other
     * peer (and the calls waiting on them) do not wait for it */
    __atomic_store_n(&l->rx_paused, true, __ATOMIC_RELEASE);
    if (l->ls->o.offload && l->ud) l->ls->o.offload(l->ud, td__lane_ref(l));
    else td__lane_resume(l);
  }
  if (got == 0) return false;
  /* more than one pass takes from a ring: the next pass (by hints too) comes back to it */
  if ((uint64_t)got >= RX_BUDGET) {
    int slot = __atomic_load_n(&l->slot, __ATOMIC_RELAXED);
    if (slot >= 0) hint_set(l->ls->bell, (uint32_t)slot + 1);
  }
  /* room freed: wake a producer that waits for it */
  FULL_FENCE();
  uint32_t *pb = __atomic_load_n(&l->peer_bell, __ATOMIC_ACQUIRE);
  if (__atomic_load_n(&l->rx->producer_waiting, __ATOMIC_RELAXED) && pb) {
    hint_peer(pb, &l->rx->producer_slot);
    ring_bell(pb);
  }
  return true;
}

static bool poll_tx(td__lane *l) {
  if (!__atomic_load_n(&l->qlen, __ATOMIC_ACQUIRE)) return false;
  bool corrupt = false;
  pthread_mutex_lock(&l->txmu);
  bool wrote = drain_locked(l, &corrupt);
  pthread_mutex_unlock(&l->txmu);
  if (corrupt) lane_fail(l, "lane ring corrupt (the peer's read position is out of range)");
  if (wrote) tx_notify(l);
  return wrote;
}

void td__lane_resume(td__lane *l) {
  td__decoder_resume(l->dec);
  __atomic_store_n(&l->rx_paused, false, __ATOMIC_RELEASE);
  hint_self(l); /* the rest of the ring */
}

/* Whether l has work for the thread (rx_mu held). */
static bool lane_work(td__lane *l) {
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) return true;
  if (__atomic_load_n(&l->rx_on, __ATOMIC_ACQUIRE) && !__atomic_load_n(&l->failed, __ATOMIC_ACQUIRE) &&
      !__atomic_load_n(&l->rx_paused, __ATOMIC_ACQUIRE) &&
      (td__ring_readable(l->rx, l->rx_head) != 0 || peer_ended(l)))
    return true;
  return __atomic_load_n(&l->qlen, __ATOMIC_ACQUIRE) && __atomic_load_n(&l->tx_on, __ATOMIC_ACQUIRE) &&
         td__ring_writable(l->tx, l->tx_tail) != 0;
}

/* Work there is now (rx_mu held, after the sleep flags are set). By hints: a bit set, a lane
 * without a slot with work, or a lane with frames queued whose ring has room; else every lane. */
static bool has_work(td__lanes *ls) {
  if (__atomic_load_n(&ls->gen, __ATOMIC_ACQUIRE) != ls->set_gen) return true;
  mbox_hdr *mh = mbox_live(ls);
  if (mh && __atomic_load_n(&mh->knocks, __ATOMIC_ACQUIRE) != ls->knocks_lt) return true;
  if (ls->hints) {
    uint64_t *h = hint_words(ls->bell);
    for (int w = 0; w < (ls->nby + 63) / 64; w++)
      if (__atomic_load_n(&h[w], __ATOMIC_SEQ_CST)) return true;
    bool queued = __atomic_load_n(&ls->nqueued, __ATOMIC_ACQUIRE) > 0;
    if (!queued && !ls->slotless) return false;
    for (int i = 0; i < ls->nset; i++) {
      td__lane *l = ls->set[i];
      if ((__atomic_load_n(&l->slot, __ATOMIC_RELAXED) < 0 || __atomic_load_n(&l->qlen, __ATOMIC_ACQUIRE)) &&
          lane_work(l))
        return true;
    }
    return false;
  }
  for (int i = 0; i < ls->nset; i++)
    if (lane_work(ls->set[i])) return true;
  return false;
}

/* The doorbell flags (rx_mu held): 1 asks the peers to ring when they write (or, for rings with
 * queued frames, when they free room). */
static void set_flags(td__lanes *ls, uint32_t v) {
  __atomic_store_n(&ls->bell[BELL_SLEEP], v, __ATOMIC_SEQ_CST);
  /* a ring's producer flag is written only when it changes: most rings never wait, and with
   * nothing queued anywhere and no flag left up there is nothing to look at */
  if (!__atomic_load_n(&ls->nqueued, __ATOMIC_ACQUIRE) && !ls->npw) return;
  for (int i = 0; i < ls->nset; i++) {
    td__lane *l = ls->set[i];
    bool want = v && __atomic_load_n(&l->tx_on, __ATOMIC_ACQUIRE) &&
                __atomic_load_n(&l->qlen, __ATOMIC_ACQUIRE);
    if (want != l->pw_set && l->tx) {
      __atomic_store_n(&l->tx->producer_waiting, want ? 1 : 0, __ATOMIC_SEQ_CST);
      l->pw_set = want;
      ls->npw += want ? 1 : -1;
    }
  }
}

/* l joins the lane thread's set (rx_mu held); false when out of memory. */
static bool set_insert(td__lanes *ls, td__lane *l) {
  if (ls->nset == ls->setcap) {
    int nc = ls->setcap ? ls->setcap * 2 : 16;
    td__lane **ns = td__realloc(ls->set, (size_t)nc * sizeof *ns);
    if (!ns) return false;
    ls->set = ns;
    ls->setcap = nc;
  }
  int slot = __atomic_load_n(&l->slot, __ATOMIC_RELAXED);
  if (slot >= ls->bycap) {
    int nc = ls->bycap ? ls->bycap : 64;
    while (nc <= slot) nc *= 2;
    td__lane **nb = td__realloc(ls->by_slot, (size_t)nc * sizeof *nb);
    if (nb) {
      memset(nb + ls->bycap, 0, (size_t)(nc - ls->bycap) * sizeof *nb);
      ls->by_slot = nb;
      ls->bycap = nc;
    } else {
      slot = -1; /* read on every pass, as a lane without a slot */
    }
  }
  ls->set[ls->nset] = td__lane_ref(l);
  l->set_idx = ls->nset++;
  if (l->pw_set) ls->npw++;
  l->set_slot = slot;
  if (slot < 0) {
    ls->slotless++;
  } else {
    ls->by_slot[slot] = l;
    if (slot + 1 > ls->nby) ls->nby = slot + 1;
  }
  if (!l->in_set) {
    l->in_set = true;
    if (ls->nfresh == ls->freshcap) {
      int nc = ls->freshcap ? ls->freshcap * 2 : 16;
      td__lane **nf = td__realloc(ls->fresh, (size_t)nc * sizeof *nf);
      if (nf) {
        ls->fresh = nf;
        ls->freshcap = nc;
      } else {
        ls->full_ns = 0; /* (the next pass reads every lane instead) */
      }
    }
    if (ls->nfresh < ls->freshcap) ls->fresh[ls->nfresh++] = l;
  }
  return true;
}

/* l leaves the set (rx_mu held): the last lane takes its place. */
static void set_remove(td__lanes *ls, td__lane *l) {
  int i = l->set_idx;
  td__lane *last = ls->set[--ls->nset];
  ls->set[i] = last;
  last->set_idx = i;
  l->set_idx = -1;
  if (l->pw_set) ls->npw--;
  if (l->set_slot < 0) ls->slotless--;
  else if (ls->by_slot[l->set_slot] == l) ls->by_slot[l->set_slot] = NULL;
  l->set_slot = -1;
  td__lane_unref(l);
}

/* Brings the set of lanes that receive or send up to date with the lanes that changed since the
 * last refresh (rx_mu held): closed ones leave the list and go to *drop, released by the caller
 * once it let go of rx_mu (release may call the agent). The set is also indexed by slot, and
 * reading by hints starts (or stops) with its size. */
static void refresh(td__lanes *ls, td__lane **dropp) {
  td__lane *drop = *dropp;
  ls->set_gen = __atomic_load_n(&ls->gen, __ATOMIC_ACQUIRE);
  pthread_mutex_lock(&ls->mu);
  int n = 0;
  for (td__lane *l = ls->dirty; l; l = l->dirty_next) n++;
  if (n > ls->workcap) {
    td__lane **nw = td__realloc(ls->work, (size_t)n * sizeof *nw);
    if (!nw) {
      pthread_mutex_unlock(&ls->mu);
      ls->set_gen--; /* try again on the next pass */
      return;
    }
    ls->work = nw;
    ls->workcap = n;
  }
  n = 0;
  for (td__lane *l = ls->dirty; l; l = l->dirty_next) {
    l->dirty_q = false;
    ls->work[n++] = l; /* (the list's reference moves to work) */
    if (l->listed && __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) {
      if (l->prev) l->prev->next = l->next;
      else ls->lanes = l->next;
      if (l->next) l->next->prev = l->prev;
      l->listed = false;
      ls->nlanes--;
      slot_give(ls, l);
      l->next = drop; /* (the list's reference moves to drop) */
      drop = l;
    }
  }
  ls->dirty = NULL;
  pthread_mutex_unlock(&ls->mu);
  *dropp = drop;
  ls->looked += (uint64_t)n;
  bool retry = false;
  for (int i = 0; i < n; i++) {
    td__lane *l = ls->work[i];
    bool in = __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) != L_CLOSED &&
              (__atomic_load_n(&l->rx_on, __ATOMIC_ACQUIRE) ||
               __atomic_load_n(&l->tx_on, __ATOMIC_ACQUIRE));
    if (in && l->set_idx < 0 && !set_insert(ls, l)) {
      pthread_mutex_lock(&ls->mu);
      dirty_locked(ls, l); /* (out of memory: the next pass tries again) */
      pthread_mutex_unlock(&ls->mu);
      retry = true;
    } else if (!in && l->set_idx >= 0) {
      set_remove(ls, l);
    }
    td__lane_unref(l);
  }
  if (retry) ls->set_gen--;
  /* reading by hints (a lane that has no slot is read on every pass) */
  bool want = ls->nset >= HINT_MIN;
  if (want != ls->hints) {
    /* from here on peers set bits (or no longer need to); what they published before they saw
     * the change is read by the full pass that follows */
    __atomic_store_n(&ls->bell[BELL_HINTS_ON], want ? 1u : 0u, __ATOMIC_SEQ_CST);
    ls->hints = want;
    ls->full_ns = 0;
  }
}

static void release_drops(td__lane *drop) {
  while (drop) {
    td__lane *l = drop;
    drop = l->next;
    lane_release(l);
  }
}

/* One pass (rx_mu held); true when something moved. Lanes that left: *drop. Over every lane,
 * or, reading by hints, over the lanes whose bits are set, those without a slot and those with
 * frames queued, and over every lane again at least every FULL_PASS_NS. */
static bool pass(td__lanes *ls, td__lane **drop) {
  if (__atomic_load_n(&ls->gen, __ATOMIC_ACQUIRE) != ls->set_gen) refresh(ls, drop);
  mbox_hdr *mh = mbox_live(ls);
  if (mh) {
    /* a peer knocked on our mailbox: the socket thread makes our side of its lane */
    uint32_t k = __atomic_load_n(&mh->knocks, __ATOMIC_ACQUIRE);
    if (k != ls->knocks_lt) {
      ls->knocks_lt = k;
      ls->knocked = true; /* (what the bell rang for: lane_main reads no lane for it) */
      wake_sock(ls);
    }
  }
  bool busy = false;
  if (ls->o.burst) ls->o.burst(ls->o.refused_ud, false);
  bool full = !ls->hints;
  if (!full) {
    /* the safety net's period grows with the set: a pass over N lanes every FULL_PASS_NS cost
     * a process O(N) per 100 ms whatever its traffic (with the passes after unexplained rings,
     * lane_main: 38.5 M reads of rings by 512 workers calling each other, 0.5 M by hints) */
    uint64_t now = td__now_ns(), due = __atomic_load_n(&ls->repass_at, __ATOMIC_RELAXED);
    uint64_t every = FULL_PASS_NS * (uint64_t)(1 + ls->nset / FULL_PASS_LANES);
    if (now - ls->full_ns >= every || (due && now >= due)) {
      full = true;
      ls->full_ns = now;
    }
  }
  if (full) {
    __atomic_store_n(&ls->repass_at, 0, __ATOMIC_RELAXED);
    for (int i = 0; i < ls->nset; i++) {
      busy |= poll_rx(ls->set[i]);
      busy |= poll_tx(ls->set[i]);
    }
  } else {
    for (int i = 0; i < ls->nfresh; i++) {
      busy |= poll_rx(ls->fresh[i]);
      busy |= poll_tx(ls->fresh[i]);
    }
    uint64_t *h = hint_words(ls->bell);
    for (int w = 0; w < (ls->nby + 63) / 64; w++) {
      if (!__atomic_load_n(&h[w], __ATOMIC_RELAXED)) continue;
      /* taken before the rings are read: a frame published after this sets the bit again */
      uint64_t bits = __atomic_exchange_n(&h[w], 0, __ATOMIC_SEQ_CST);
      while (bits) {
        int slot = w * 64 + __builtin_ctzll(bits);
        bits &= bits - 1;
        td__lane *l = slot < ls->nby ? ls->by_slot[slot] : NULL;
        if (!l) continue;
        busy |= poll_rx(l);
        busy |= poll_tx(l);
      }
    }
    bool queued = __atomic_load_n(&ls->nqueued, __ATOMIC_ACQUIRE) > 0;
    if (queued || ls->slotless) {
      for (int i = 0; i < ls->nset; i++) {
        td__lane *l = ls->set[i];
        if (__atomic_load_n(&l->slot, __ATOMIC_RELAXED) >= 0 && !__atomic_load_n(&l->qlen, __ATOMIC_ACQUIRE))
          continue;
        busy |= poll_rx(l);
        busy |= poll_tx(l);
      }
    }
  }
  ls->nfresh = 0;
  if (ls->o.burst) ls->o.burst(ls->o.refused_ud, true);
  return busy;
}

static void idle_relax(unsigned *idle);

/* True when the sleep ran its full nap (nothing rang the bell). */
static bool lane_sleep(td__lanes *ls) {
  bool timed_out = false;
  pthread_mutex_lock(&ls->rx_mu);
  uint32_t v = __atomic_load_n(ls->bell, __ATOMIC_SEQ_CST);
  __atomic_store_n(&ls->sleeping, true, __ATOMIC_SEQ_CST);
  /* while threads wait on futures they poll; the last to leave sets the flags (wait_leave) */
  bool polled = __atomic_load_n(&ls->waiters, __ATOMIC_SEQ_CST) > 0;
  if (!polled) set_flags(ls, 1);
  FULL_FENCE();
  bool work = (!polled && has_work(ls)) || __atomic_load_n(&ls->stop, __ATOMIC_ACQUIRE);
  pthread_mutex_unlock(&ls->rx_mu);
  if (!work) {
    int ms = __atomic_load_n(&ls->nap_ms, __ATOMIC_RELAXED);
    if (ms <= 0) ms = NAP_MS;
    uint64_t due = __atomic_load_n(&ls->repass_at, __ATOMIC_RELAXED), now = td__now_ns();
    if (due) {
      int64_t left = due > now ? (int64_t)((due - now) / 1000000) + 1 : 1;
      if (left < ms) ms = (int)left;
    }
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    timed_out = futex(ls->bell, FUTEX_WAIT, v, &ts) != 0 && errno == ETIMEDOUT;
  }
  __atomic_store_n(&ls->sleeping, false, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&ls->rx_mu);
  set_flags(ls, 0);
  pthread_mutex_unlock(&ls->rx_mu);
  return timed_out;
}

static void *lane_main(void *arg) {
  td__lanes *ls = arg;
  uint64_t last = 0;
  unsigned idle = 0;
  bool rung = false; /* woken by the bell rather than by the end of its nap */
  __atomic_store_n(&ls->nap_ms, NAP_MS, __ATOMIC_RELAXED);
  while (!__atomic_load_n(&ls->stop, __ATOMIC_ACQUIRE)) {
    if (__atomic_load_n(&ls->waiters, __ATOMIC_ACQUIRE) > 0) {
      lane_sleep(ls); /* a waiting thread polls meanwhile */
      last = 0;
      continue;
    }
    td__lane *drop = NULL, *drop2 = NULL;
    pthread_mutex_lock(&ls->rx_mu);
    uint32_t set_gen = ls->set_gen;
    ls->knocked = false;
    bool busy = pass(ls, &drop);
    if (!busy && rung && ls->hints && ls->set_gen == set_gen && !ls->knocked) {
      /* rung, and no hint said for what: a peer may have cleared its bit (peers can clear any),
       * so every lane is read soon rather than at the next full pass, a nap away: now, or a gap
       * after the last full pass when that is more recent (the thread naps no longer), the gap
       * growing with the set (1 ms, or 20 us a lane). Such wake-ups are mostly races (another
       * pass, a waiter's, took the bit or the knock and read the frame before the sender, which
       * saw the thread asleep, rang), and a pass over every lane for each cost a process with
       * N lanes O(N) per call in a group's all-to-all (most of the 38.5 M reads of rings of
       * 512 workers calling each other, against 0.5 M by hints). A knock on our mailbox rings
       * with no bit: no lane is read for it either. */
      uint64_t now = td__now_ns(), gap = (uint64_t)ls->nset * REPASS_LANE_NS;
      if (gap < REPASS_NS) gap = REPASS_NS;
      if (now - ls->full_ns >= gap) {
        ls->full_ns = 0;
        busy = pass(ls, &drop2);
      } else if (!__atomic_load_n(&ls->repass_at, __ATOMIC_RELAXED)) {
        __atomic_store_n(&ls->repass_at, ls->full_ns + gap, __ATOMIC_RELAXED);
      }
    }
    pthread_mutex_unlock(&ls->rx_mu);
    release_drops(drop);
    release_drops(drop2);
    rung = false;
    if (busy) {
      idle = 0;
      last = 0;
      __atomic_store_n(&ls->nap_ms, NAP_MS, __ATOMIC_RELAXED);
      continue;
    }
    uint64_t spin = (uint64_t)__atomic_load_n(&ls->spin_ns, __ATOMIC_RELAXED);
    uint64_t now = td__now_ns();
    if (!last) last = now;
    if (spin && now - last < spin) {
      idle_relax(&idle); /* a runnable thread on this CPU goes first now and then */
      continue;
    }
    if (!lane_sleep(ls)) {
      rung = true;
    } else {
#ifndef LANE_TSAN
      int nap = __atomic_load_n(&ls->nap_ms, __ATOMIC_RELAXED); /* nothing came for a whole nap */
      __atomic_store_n(&ls->nap_ms, nap * 2 < NAP_MAX_MS ? nap * 2 : NAP_MAX_MS, __ATOMIC_RELAXED);
#endif
    }
    last = 0;
  }
  return NULL;
}

/* ---- the wait poller (future_impl.h) ---- */

static void wait_enter(void *ud) {
  td__lanes *ls = ud;
  __atomic_add_fetch(&ls->waiters, 1, __ATOMIC_SEQ_CST);
  /* the waiter polls: peers need not ring (the lane thread clears the flags when it wakes) */
  if (pthread_mutex_trylock(&ls->rx_mu) == 0) {
    set_flags(ls, 0);
    pthread_mutex_unlock(&ls->rx_mu);
  }
}

/* Every 8 empty polls a poller lets a runnable thread on its CPU go first: on a machine with
 * fewer CPUs than busy threads the peer it waits for may be that thread (measured on the 2-vCPU
 * VM under load: never yielding, runs where the two landed on one CPU took 73 us a call instead
 * of 7; yielding every 256 polls 60-73 us, every 32 about 16, every 1 to 8 about 11-13). */
static void idle_relax(unsigned *idle) {
  if (++*idle % 8 == 0) sched_yield();
  else cpu_relax();
}

static _Thread_local unsigned waiter_idle;

static bool wait_poll(void *ud) {
  td__lanes *ls = ud;
  if (pthread_mutex_trylock(&ls->rx_mu) != 0) {
    idle_relax(&waiter_idle);
    return false;
  }
  td__lane *drop = NULL;
  bool busy = pass(ls, &drop);
  pthread_mutex_unlock(&ls->rx_mu);
  release_drops(drop);
  if (!busy) idle_relax(&waiter_idle);
  return busy;
}

static void wait_leave(void *ud) {
  td__lanes *ls = ud;
  if (__atomic_sub_fetch(&ls->waiters, 1, __ATOMIC_SEQ_CST) > 0) return;
  if (!__atomic_load_n(&ls->sleeping, __ATOMIC_SEQ_CST)) return;
  /* the lane thread sleeps without the flags: set them, and wake it if work slipped in */
  pthread_mutex_lock(&ls->rx_mu);
  set_flags(ls, 1);
  FULL_FENCE();
  bool work = has_work(ls);
  pthread_mutex_unlock(&ls->rx_mu);
  if (work) kick_self(ls);
}

static int64_t wait_window(void *ud) {
  td__lanes *ls = ud;
  return __atomic_load_n(&ls->up, __ATOMIC_RELAXED) > 0
             ? __atomic_load_n(&ls->spin_ns, __ATOMIC_RELAXED)
             : 0;
}

/* ---- dialled lanes: no stream under them (lane.h) ----
 *
 * The socket thread owns every dialled lane's socket once registered (reg list, epoll): it runs
 * both sides' handshakes, and after them watches the socket for its end. Other threads only
 * shut a socket down (td__lane_close_why), which the thread then sees. */

static int64_t dial_deadline_ns(td__lanes *ls) { return ls->hs_ns > 0 ? ls->hs_ns : 20000000000; }

static const char *pid_name(td__lanes *ls, int rank, char *buf, size_t n) {
  uint64_t *no = __atomic_load_n(&ls->nonce_of, __ATOMIC_ACQUIRE);
  int pid = pid_for(ls, rank);
  if (!no || pid <= 0 || !no[rank]) return NULL;
  snprintf(buf, n, "tdist-dial-%d-%016llx", pid, (unsigned long long)no[rank]);
  return buf;
}

bool td__lanes_dialing(const td__lanes *ls) {
  return ls && __atomic_load_n(&ls->sock_started, __ATOMIC_ACQUIRE);
}

bool td__lanes_can_dial(td__lanes *ls, int rank) {
  char name[64];
  return ls && __atomic_load_n(&ls->sock_started, __ATOMIC_ACQUIRE) && rank != ls->self_rank &&
         pid_name(ls, rank, name, sizeof name) != NULL &&
         __atomic_load_n(&ls->ndirect, __ATOMIC_RELAXED) < TD__LANE_DIAL_MAX;
}

bool td__lanes_by_hints(td__lanes *ls) {
  return ls && __atomic_load_n(&ls->bell[BELL_HINTS_ON], __ATOMIC_ACQUIRE) != 0;
}

uint64_t td__lanes_refresh_looked(td__lanes *ls) {
  pthread_mutex_lock(&ls->rx_mu);
  uint64_t n = ls->looked;
  pthread_mutex_unlock(&ls->rx_mu);
  return n;
}

int td__lanes_nap_ms(td__lanes *ls) {
  return ls ? __atomic_load_n(&ls->nap_ms, __ATOMIC_RELAXED) : 0;
}

void td__lanes_test_withhold_hints(td__lanes *ls, bool on) {
  __atomic_store_n(&ls->test_withhold, on, __ATOMIC_RELAXED);
}

int td__lanes_dialed(const td__lanes *ls) {
  return ls ? __atomic_load_n(&ls->dialed_up, __ATOMIC_RELAXED) : 0;
}

static void wake_sock(td__lanes *ls) {
  uint64_t one = 1;
  if (write(ls->wake_fd, &one, sizeof one) < 0) { /* full counter: it is awake anyway */
  }
}

td_status td__lane_dial(td__lanes *ls, int peer, td__decoder *dec, void *ud, td__lane **out) {
  *out = NULL;
  char name[64];
  if (!td__lanes_can_dial(ls, peer) || !pid_name(ls, peer, name, sizeof name)) {
    td__decoder_destroy(dec);
    return td_set_error(TD_ERR_UNAVAILABLE, "no lane can be dialled to rank %d", peer);
  }
  td__lane *l = lane_new(ls, peer, false, dec, ud);
  if (!l) {
    td__decoder_destroy(dec);
    return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  }
  l->direct = true;
  l->born_ns = td__now_ns();
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  size_t nl = strlen(name);
  memcpy(sa.sun_path + 1, name, nl);
  socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl);
  const char *why = NULL;
  uint8_t hello[TD__HS_HELLO_LEN];
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr *)&sa, salen) != 0) why = "cannot connect";
  /* a squatter on the name gets nothing: the listener must be the rank's verified process */
  if (!why && peer_pid(fd) != pid_for(ls, peer)) why = "the socket is not held by the verified process";
  int mfd = -1;
  if (!why && (mfd = sealed_memfd("tdist-lane", MAP_BYTES, &l->map)) < 0)
    why = "cannot create the shared memory";
  if (!why && td__hs_client_hello(&l->hs, &ls->dial_auth, ls->self_rank, peer, hello) != TD_OK)
    why = "cannot start the handshake";
  if (!why && send(fd, hello, sizeof hello, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof hello)
    why = "cannot send the HELLO";
  if (why) {
    int e = errno;
    if (mfd >= 0) close(mfd);
    if (fd >= 0) close(fd);
    td__lane_unref(l); /* (destroys dec) */
    return td_set_error(TD_ERR_UNAVAILABLE, "lane to rank %d: %s (%s)", peer, why, strerror(e));
  }
  lane_hdr *h = (lane_hdr *)l->map;
  memcpy(h->magic, LANE_MAGIC, sizeof LANE_MAGIC);
  h->version = 2;
  h->ring_bytes = TD__LANE_RING;
  lane_bind(l);
  l->infd[0] = mfd; /* kept to hand over with the PROOF */
  l->ninfd = 1;
  l->sock = fd;
  l->dial = D_C_CHALLENGE;
  l->state = L_DIALING;
  /* frames may go into the ring now: the server reads them once the client proved itself */
  __atomic_store_n(&l->tx_on, true, __ATOMIC_RELEASE);
  __atomic_store_n(&l->rx_on, true, __ATOMIC_RELEASE);
  __atomic_add_fetch(&ls->ndirect, 1, __ATOMIC_RELAXED);
  lanes_add(ls, l);
  pthread_mutex_lock(&ls->mu);
  l->dq_next = ls->dialq;
  ls->dialq = td__lane_ref(l); /* the socket thread's */
  pthread_mutex_unlock(&ls->mu);
  wake_sock(ls);
  __atomic_add_fetch(&ls->gen, 1, __ATOMIC_RELEASE);
  kick_self(ls);
  *out = l;
  return TD_OK;
}

/* Registers l's socket with the socket thread (which holds the reference given). */
static void sock_register(td__lanes *ls, td__lane *l) {
  struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = l};
  if (epoll_ctl(ls->ep, EPOLL_CTL_ADD, l->sock, &ev) != 0) {
    td__lane_close_why(l, "cannot watch the lane's socket");
    pthread_mutex_lock(&l->txmu);
    close(l->sock);
    l->sock = -1;
    pthread_mutex_unlock(&l->txmu);
    td__lane_unref(l);
    return;
  }
  l->in_ep = true;
  l->reg_prev = NULL;
  l->reg_next = ls->reg;
  if (ls->reg) ls->reg->reg_prev = l;
  ls->reg = l;
  l->hs_prev = NULL;
  l->hs_next = ls->hs;
  if (ls->hs) ls->hs->hs_prev = l;
  ls->hs = l;
  l->in_hs = true;
}

/* l's handshake is over (up, or dropped): the sweep no longer looks at it. */
static void hs_leave(td__lanes *ls, td__lane *l) {
  if (!l->in_hs) return;
  if (l->hs_prev) l->hs_prev->hs_next = l->hs_next;
  else ls->hs = l->hs_next;
  if (l->hs_next) l->hs_next->hs_prev = l->hs_prev;
  l->hs_next = l->hs_prev = NULL;
  l->in_hs = false;
}

/* Closes l's socket and drops the thread's reference (socket thread). */
static void sock_drop(td__lanes *ls, td__lane *l) {
  if (l->in_ep) {
    if (l->reg_prev) l->reg_prev->reg_next = l->reg_next;
    else ls->reg = l->reg_next;
    if (l->reg_next) l->reg_next->reg_prev = l->reg_prev;
    l->reg_next = l->reg_prev = NULL;
  }
  hs_leave(ls, l);
  if (l->server && l->dial != D_UP && l->dial != D_NONE) ls->pending--;
  pthread_mutex_lock(&l->txmu);
  if (l->sock >= 0) {
    epoll_ctl(ls->ep, EPOLL_CTL_DEL, l->sock, NULL);
    close(l->sock);
    l->sock = -1;
  }
  pthread_mutex_unlock(&l->txmu);
  for (int i = 0; i < l->ninfd; i++) close(l->infd[i]);
  l->ninfd = 0;
  l->in_ep = false;
  l->grave_next = ls->grave;
  ls->grave = l;
}

static void bury(td__lanes *ls) {
  while (ls->grave) {
    td__lane *l = ls->grave;
    ls->grave = l->grave_next;
    td__lane_unref(l);
  }
}

/* A handshake failed: the lane closes (a client's calls through it fail with why). */
static void dial_fail(td__lanes *ls, td__lane *l, const char *why) {
  char msg[240];
  snprintf(msg, sizeof msg, "lane %s rank %d: %s", l->server ? "from" : "to", l->peer, why);
  if (l->server) refuse(ls, msg);
  else td_log(TD_LOG_WARN, "rpc: %s", msg);
  td__lane_close_why(l, msg);
  sock_drop(ls, l);
}

/* Reads toward want bytes (and fds) of the next handshake message: 1 when it is complete, 0 when
 * more must come, -1 when the socket failed or ended. */
static int dial_read(td__lane *l, size_t want) {
  while (l->inlen < want) {
    int fds[2] = {-1, -1}, n, flags;
    ssize_t got = recv_some(l->sock, l->in + l->inlen, want - l->inlen, fds, &n, &flags);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    for (int i = 0; i < n; i++) {
      if (l->ninfd < 2) l->infd[l->ninfd++] = fds[i];
      else close(fds[i]);
    }
    if (got <= 0 || (flags & MSG_CTRUNC)) return -1;
    l->inlen += (size_t)got;
  }
  return 1;
}

static void take_fds(td__lane *l, int *fds, int *n) {
  *n = l->ninfd;
  for (int i = 0; i < l->ninfd; i++) fds[i] = l->infd[i];
  l->ninfd = 0;
}

/* The rank whose verified process is pid, or -1 (a stranger). */
static int rank_of_pid(td__lanes *ls, int pid) {
  int *p = __atomic_load_n(&ls->pid_of, __ATOMIC_ACQUIRE);
  for (int r = 0; p && pid > 0 && r < ls->world; r++)
    if (p[r] == pid && r != ls->self_rank) return r;
  return -1;
}

static void dial_accept(td__lanes *ls) {
  for (int i = 0; i < 256; i++) {
    int fd = accept4(ls->dial_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    int pid = peer_pid(fd);
    const char *why = NULL;
    /* only members' processes get a handshake slot: a stranger on this host is closed here */
    if (rank_of_pid(ls, pid) < 0) why = "a connection from a process that is no member here";
    else if (ls->pending >= TD__LANE_DIAL_PENDING) why = "too many lane handshakes at once";
    td__lane *l = why ? NULL : lane_new(ls, -1, true, NULL, NULL);
    if (!why && !l) why = "out of memory";
    if (why) {
      close(fd);
      char msg[160];
      snprintf(msg, sizeof msg, "lane dial socket: %s (process %d)", why, pid);
      refuse(ls, msg);
      continue;
    }
    l->direct = true;
    l->born_ns = td__now_ns();
    l->sock = fd;
    l->dial = D_S_HELLO;
    l->state = L_DIALING;
    ls->pending++;
    __atomic_add_fetch(&ls->ndirect, 1, __ATOMIC_RELAXED);
    lanes_add(ls, l);
    sock_register(ls, td__lane_ref(l));
    td__lane_unref(l);
  }
}

/* Server: the client's PROOF (with its lane and doorbell) came; true when the lane is up. */
static const char *dial_server_proof(td__lanes *ls, td__lane *l) {
  int fds[2], n, rank = -1;
  take_fds(l, fds, &n);
  const char *why = NULL;
  uint8_t *map = NULL, *bell = NULL;
  uint8_t reads_us = l->in[TD__HS_PROOF_LEN]; /* the client reads our memory: 0 or 1 */
  if (td__hs_server_proof(&l->hs, l->in, TD__HS_PROOF_LEN, &rank) != TD_OK) why = td_last_error();
  else if (pid_for(ls, rank) != peer_pid(l->sock)) why = "the socket's process is not the rank's";
  else if (n != 2 || reads_us > 1) why = "malformed lane hand-over";
  bool we_read = !why && ls->o.probe && ls->o.probe(ls->o.refused_ud, rank, false);
  if (!why) why = take_lane(ls, l->sock, fds, DIAL_BELL_MAGIC, we_read, &map, &bell);
  for (int i = 0; i < n; i++) close(fds[i]);
  td__decoder *dec = NULL;
  void *ud = NULL;
  if (!why && (!ls->o.dialed || ls->o.dialed(ls->o.refused_ud, l, rank, &dec, &ud) != TD_OK))
    why = "the transport cannot take the lane";
  if (why) {
    if (map) munmap(map, MAP_BYTES);
    if (bell) munmap(bell, BELL_BYTES);
    return why;
  }
  if (reads_us && ls->o.peer_reads) ls->o.peer_reads(ls->o.refused_ud, rank);
  l->peer = rank;
  l->map = map;
  l->peer_bell = (uint32_t *)bell;
  l->dec = dec;
  l->ud = ud;
  lane_bind(l);
  ls->pending--;
  __atomic_store_n(&l->dial, D_UP, __ATOMIC_RELEASE);
  __atomic_store_n(&l->state, L_ACCEPTED, __ATOMIC_RELEASE);
  __atomic_store_n(&l->tx_on, true, __ATOMIC_RELEASE);
  __atomic_store_n(&l->rx_on, true, __ATOMIC_RELEASE);
  count_up(l);
  lane_changed(l);
  kick_self(ls);
  return NULL;
}

/* Client: the server's CHALLENGE came: PROOF, with the lane and our doorbell. */
static const char *dial_client_challenge(td__lanes *ls, td__lane *l) {
  uint8_t proof[TD__HS_PROOF_LEN + 1]; /* the proof, then whether we read the server's memory */
  if (l->ninfd != 1) return "unexpected descriptors from the server";
  if (td__hs_client_challenge(&l->hs, l->in, TD__HS_CHALLENGE_LEN, proof) != TD_OK)
    return td_last_error();
  proof[TD__HS_PROOF_LEN] = ls->o.probe && ls->o.probe(ls->o.refused_ud, l->peer, false) ? 1 : 0;
  int fds[2] = {l->infd[0], ls->bell_fd};
  if (!send_fds(l->sock, proof, sizeof proof, fds, 2)) return "cannot send the PROOF";
  close(l->infd[0]);
  l->ninfd = 0;
  return NULL;
}

/* Client: the server's doorbell came: the lane is up. */
static const char *dial_client_bell(td__lanes *ls, td__lane *l) {
  int fds[2], n;
  take_fds(l, fds, &n);
  const char *why = NULL;
  uint8_t *bell = NULL;
  if (n != 1 || td__get_u32(l->in) != DIAL_BELL_MAGIC || l->in[4] > 1)
    why = "no doorbell came with the answer";
  else bell = map_received(fds[0], BELL_BYTES, &why);
  for (int i = 0; i < n; i++) close(fds[i]);
  if (why) return why;
  if (l->in[4] && ls->o.peer_reads) ls->o.peer_reads(ls->o.refused_ud, l->peer);
  __atomic_store_n(&l->peer_bell, (uint32_t *)bell, __ATOMIC_RELEASE);
  __atomic_store_n(&l->dial, D_UP, __ATOMIC_RELEASE);
  __atomic_store_n(&l->state, L_ACCEPTED, __ATOMIC_RELEASE);
  count_up(l);
  /* frames written before the bell was known may have found the server asleep */
  ring_bell(l->peer_bell);
  (void)ls;
  return NULL;
}

/* One event on a registered lane's socket (socket thread). */
static void dial_event(td__lanes *ls, td__lane *l, uint32_t events) {
  if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) {
    sock_drop(ls, l); /* closed by this side (or its handshake failed) */
    return;
  }
  if (l->mbox) { /* its pidfd: the peer's process ended */
    __atomic_store_n(&l->eof, true, __ATOMIC_RELEASE);
    hint_self(l); /* the lane thread reads what is left, then closes it */
    sock_drop(ls, l);
    return;
  }
  for (;;) {
    int d = l->dial;
    size_t want = d == D_S_HELLO ? TD__HS_HELLO_LEN
                  : d == D_C_CHALLENGE ? TD__HS_CHALLENGE_LEN
                  : d == D_S_PROOF ? TD__HS_PROOF_LEN + 1
                  : d == D_C_BELL ? 5 : 1;
    if (d == D_UP) {
      /* once the lane is up the socket carries keepalive pings and pongs, then its end */
      uint8_t b[64];
      ssize_t got = recv(l->sock, b, sizeof b, MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
          !(events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)))
        return;
      const char *bad = NULL;
      bool gone = false;
      for (ssize_t i = 0; i < got && !bad && !gone; i++) {
        if (b[i] == KA_PING) {
          if (send(l->sock, &(uint8_t){KA_PONG}, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1) continue;
          /* a peer that pinged and then closed the lane is gone, not misbehaving (1,024 workers
           * shutting down logged 17,802 of these as "unexpected bytes") */
          if (errno == EAGAIN || errno == EWOULDBLOCK)
            bad = "the peer does not read the answers to its keepalive pings";
          else
            gone = true;
        } else if (b[i] == KA_PONG) {
          l->ping_ns = 0;
        } else {
          bad = "unexpected bytes on the lane's socket";
        }
      }
      if (got > 0 && !bad && !gone) {
        events = 0;
        continue; /* more may be there */
      }
      if (bad) {
        lane_fail(l, bad);
      } else {
        __atomic_store_n(&l->eof, true, __ATOMIC_RELEASE);
        hint_self(l); /* the lane thread reads what is left, then closes it */
      }
      sock_drop(ls, l);
      return;
    }
    int r = dial_read(l, want);
    if (r < 0) {
      dial_fail(ls, l, "the peer closed the socket during the handshake");
      return;
    }
    if (r == 0) return;
    const char *why = NULL;
    if (d == D_S_HELLO) {
      uint8_t chal[TD__HS_CHALLENGE_LEN];
      if (l->ninfd) why = "unexpected descriptors";
      else if (td__hs_server_hello(&l->hs, &ls->dial_auth, ls->self_rank, l->in, TD__HS_HELLO_LEN,
                                   chal) != TD_OK)
        why = td_last_error();
      else if (pid_for(ls, l->hs.peer_rank) != peer_pid(l->sock))
        why = "the socket's process is not the rank it claims";
      else if (send(l->sock, chal, sizeof chal, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof chal)
        why = "cannot send the CHALLENGE";
      else {
        l->peer = l->hs.peer_rank;
        l->dial = D_S_PROOF;
      }
    } else if (d == D_C_CHALLENGE) {
      why = dial_client_challenge(ls, l);
      if (!why) l->dial = D_C_BELL;
    } else if (d == D_S_PROOF) {
      why = dial_server_proof(ls, l);
    } else if (d == D_C_BELL) {
      why = dial_client_bell(ls, l);
    }
    l->inlen = 0;
    if (why) {
      char w[200];
      snprintf(w, sizeof w, "%s", why);
      dial_fail(ls, l, w);
      return;
    }
    if (l->dial == D_UP) hs_leave(ls, l);
  }
}

/* Keepalive (socket thread): a lane that sent frames since its last ping is pinged; a ping
 * unanswered for kt_ns ends the lane (its peer is stopped or hung: calls through it fail, as a
 * gRPC stream's keepalive fails them). The peer's socket thread answers. Idle lanes are not
 * pinged (a peer that hangs while idle is found at the next call). */
static void keepalive_round(td__lanes *ls, uint64_t now) {
  if (ls->ka_ns <= 0 || now - ls->ka_round_ns < (uint64_t)ls->ka_ns / 2) return;
  ls->ka_round_ns = now;
  mbox_hdr *mh = mbox_live(ls);
  if (mh) __atomic_add_fetch(&mh->beat, 1, __ATOMIC_RELEASE); /* our answer to every ping */
  for (td__lane *l = ls->reg, *n; l; l = n) {
    n = l->reg_next;
    if (l->dial != D_UP || __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) continue;
    /* a mailbox lane has no socket to ping: the peer's socket thread bumps its beat every round
     * of its own, so a beat that has not moved since the "ping" is a ping unanswered */
    mbox_hdr *ph = l->mbox ? (mbox_hdr *)l->mb_hdr : NULL;
    if (ph && !__atomic_load_n(&ph->ka_ms, __ATOMIC_ACQUIRE)) continue; /* it keeps no beat */
    uint64_t beat = ph ? __atomic_load_n(&ph->beat, __ATOMIC_ACQUIRE) : 0;
    if (ph && l->ping_ns && beat != l->beat_seen) l->ping_ns = 0;
    if (l->ping_ns && now - l->ping_ns > (uint64_t)ls->kt_ns) {
      char why[200];
      snprintf(why, sizeof why, "keepalive: rank %d did not answer %s within %lld ms (stopped or "
               "hung)", l->peer, ph ? "on its mailbox lane" : "a ping on its lane",
               (long long)(ls->kt_ns / 1000000));
      lane_fail(l, why);
      sock_drop(ls, l);
      continue;
    }
    uint64_t sent = __atomic_load_n(&l->tx_frames, __ATOMIC_RELAXED);
    if (!l->ping_ns && sent != l->ping_mark) {
      l->ping_mark = sent;
      l->beat_seen = beat;
      if (ph || send(l->sock, &(uint8_t){KA_PING}, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1)
        l->ping_ns = now;
    }
  }
}

/* Handshakes past their deadline fail (socket thread). */
static void dial_sweep(td__lanes *ls, uint64_t now) {
  keepalive_round(ls, now);
  for (td__lane *l = ls->reg, *n; l; l = n) { /* (a closed mailbox lane has no socket event) */
    n = l->reg_next;
    if (l->mbox && __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) sock_drop(ls, l);
  }
  for (td__lane *l = ls->hs, *n; l; l = n) {
    n = l->hs_next;
    if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) sock_drop(ls, l);
    else if (l->dial != D_UP && now - l->born_ns > (uint64_t)dial_deadline_ns(ls))
      dial_fail(ls, l, "the handshake did not finish in time");
  }
}

/* ---- mailbox lanes (lane.h) ----
 *
 * A lane with no set-up between the two processes: each process's arena has a slot (a ring) for
 * every rank, and a pair's lane is its two slots, ours in the peer's arena (we write) and the
 * peer's in ours (we read). A process reaches a peer's arena and doorbell with pidfd_getfd, which
 * the kernel allows only where it also allows ptrace attach and process_vm_writev (the access
 * under which the peer's memory is ours to write anyway), so the slots need no secret: the
 * descriptors' numbers come from the peer's same-host record (the authenticated store), and the
 * arena must carry the nonce of that record (a recycled pid finds another process). A sender
 * maps the arena's header page and its own slot, sets its bit in the knock bitmap, bumps the
 * knock count and rings the doorbell; the owner's lane thread sees the count move and wakes the
 * socket thread, which makes the owner's side of every lane knocked for (it maps the sender's
 * arena in turn). Frames written before that wait in the slot. One lane per rank and process,
 * made once: a mailbox lane that ended is not made again (the pair dials a lane, or uses gRPC).
 * Its end: the peer's process exits (its pidfd, watched by the socket thread), or either side
 * closes it (both rings' gone flags, then a ring of the bell); a stopped or hung peer is found
 * by the owner's beat (mbox_hdr.beat), which its socket thread bumps every keepalive round. */

static int sys_pidfd_open(int pid) { return (int)syscall(SYS_pidfd_open, pid, 0); }
static int sys_pidfd_getfd(int pidfd, int fd) { return (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0); }

/* The peer's arena, checked and mapped: its header page and our slot. NULL on success. */
static const char *mbox_map_peer(td__lanes *ls, int pfd, int rank, uint8_t **hdr, uint8_t **slot,
                                 uint8_t **bell) {
  int *bo = __atomic_load_n(&ls->mb_bell_of, __ATOMIC_ACQUIRE);
  int *ao = __atomic_load_n(&ls->mb_arena_of, __ATOMIC_ACQUIRE);
  uint64_t *no = __atomic_load_n(&ls->nonce_of, __ATOMIC_ACQUIRE);
  const char *why = NULL;
  int bfd = sys_pidfd_getfd(pfd, bo[rank]);
  int afd = bfd >= 0 ? sys_pidfd_getfd(pfd, ao[rank]) : -1;
  struct stat sb;
  size_t want = MBOX_HDR + (size_t)ls->arena_world * MBOX_SLOT;
  if (bfd < 0 || afd < 0) why = "cannot take its descriptors (no ptrace access to it)";
  else if (fstat(afd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != want)
    why = "its arena has the wrong kind or size";
  else if ((fcntl(afd, F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    why = "its arena is not sealed against resizing";
  if (!why) {
    void *h = mmap(NULL, MBOX_HDR, PROT_READ | PROT_WRITE, MAP_SHARED, afd, 0);
    void *s = h == MAP_FAILED ? MAP_FAILED
                              : mmap(NULL, MBOX_SLOT, PROT_READ | PROT_WRITE, MAP_SHARED, afd,
                                     (off_t)mbox_slot_off(ls->self_rank));
    if (h == MAP_FAILED || s == MAP_FAILED) {
      if (h != MAP_FAILED) munmap(h, MBOX_HDR);
      why = "cannot map its arena";
    } else {
      *hdr = h;
      *slot = s;
      mbox_hdr *mh = h;
      if (memcmp(mh->magic, MBOX_MAGIC, sizeof MBOX_MAGIC) != 0 || !no ||
          __atomic_load_n(&mh->nonce, __ATOMIC_ACQUIRE) != no[rank] ||
          mh->world != (uint32_t)ls->arena_world)
        why = "its arena is not the one its record names";
    }
  }
  if (!why && !(*bell = map_received(bfd, BELL_BYTES, &why))) why = why ? why : "no doorbell";
  if (why && *hdr) {
    munmap(*hdr, MBOX_HDR);
    munmap(*slot, MBOX_SLOT);
    *hdr = *slot = NULL;
  }
  if (bfd >= 0) close(bfd);
  if (afd >= 0) close(afd);
  return why;
}

/* Makes the mailbox lane with rank (mbox_mu held). NULL on success. */
static const char *mbox_make(td__lanes *ls, int rank) {
  mbox_hdr *me = mbox_live(ls);
  int pid = pid_for(ls, rank);
  if (!me || pid <= 0 || rank == ls->self_rank || rank >= ls->arena_world)
    return "no mailbox on this host";
  td__ring_ctl *rx = (td__ring_ctl *)((uint8_t *)me + mbox_slot_off(rank));
  uint8_t *hdr = NULL, *slot = NULL, *bell = NULL;
  int pfd = sys_pidfd_open(pid);
  const char *why = pfd < 0 ? "cannot open its process"
                            : mbox_map_peer(ls, pfd, rank, &hdr, &slot, &bell);
  td__lane *l = why ? NULL : lane_new(ls, rank, false, NULL, NULL);
  if (!why && !l) why = "out of memory";
  if (why) {
    if (hdr) munmap(hdr, MBOX_HDR);
    if (slot) munmap(slot, MBOX_SLOT);
    if (bell) munmap(bell, BELL_BYTES);
    if (pfd >= 0) close(pfd);
    /* a sender whose frames wait in our slot for a lane we cannot make learns it: its lane sees
     * the consumer gone at its next read of it */
    __atomic_store_n(&rx->consumer_gone, 1, __ATOMIC_RELEASE);
    return why;
  }
  l->direct = l->mbox = true;
  l->born_ns = td__now_ns();
  l->sock = pfd;
  l->mb_hdr = hdr;
  l->mb_slot = slot;
  l->peer_bell = (uint32_t *)bell;
  l->rx = rx;
  l->rx_data = (uint8_t *)rx + RING_OFF;
  l->tx = (td__ring_ctl *)slot;
  l->tx_data = slot + RING_OFF;
  l->dial = D_UP;
  l->state = L_ACCEPTED;
  td__decoder *dec = NULL;
  void *ud = NULL;
  if (!ls->o.dialed || ls->o.dialed(ls->o.refused_ud, l, rank, &dec, &ud) != TD_OK) {
    td__lane_unref(l); /* (unmaps, closes the pidfd) */
    return "the transport cannot take the lane";
  }
  l->dec = dec;
  l->ud = ud;
  /* direct copy settled per pair (opts.probe): taking the peer's descriptors needed the access
   * that reading its memory needs (no read of it here: process_vm_readv waits for the peer's
   * memory map lock, which a busy peer holds often); its knock (mbox_discover) tells that it
   * reads ours */
  if (ls->o.probe) ls->o.probe(ls->o.refused_ud, rank, true);
  __atomic_add_fetch(&ls->ndirect, 1, __ATOMIC_RELAXED);
  /* (on before it is added: the refresh that takes it in sees it on) */
  __atomic_store_n(&l->tx_on, true, __ATOMIC_RELEASE);
  __atomic_store_n(&l->rx_on, true, __ATOMIC_RELEASE);
  lanes_add(ls, l); /* (its slot in our hints, published in both rings) */
  count_up(l);
  ls->mbox_lane[rank] = td__lane_ref(l);
  /* knock: the peer makes its side (a no-op when it has, or makes it now) */
  mbox_hdr *ph = (mbox_hdr *)hdr;
  int me_rank = ls->self_rank;
  __atomic_fetch_or(&mbox_bits(hdr)[me_rank / 64], 1ull << (me_rank % 64), __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&ph->knocks, 1, __ATOMIC_SEQ_CST);
  ring_bell(l->peer_bell);
  pthread_mutex_lock(&ls->mu);
  l->dq_next = ls->mbq;
  ls->mbq = l; /* the lane's own reference moves to the socket thread's queue */
  pthread_mutex_unlock(&ls->mu);
  wake_sock(ls);
  __atomic_add_fetch(&ls->gen, 1, __ATOMIC_RELEASE);
  kick_self(ls);
  return NULL;
}

/* The mailbox lane with rank, made when there is none yet (any thread but one holding the
 * transport's locks); *owner (unless NULL): grab(its owner), NULL when it has none now. */
static td_status mbox_get(td__lanes *ls, int rank, void *(*grab)(void *), void **owner) {
  if (owner) *owner = NULL;
  if (!mbox_live(ls) || rank < 0 || rank >= ls->arena_world || rank == ls->self_rank)
    return td_set_error(TD_ERR_UNAVAILABLE, "no mailbox lane to rank %d", rank);
  pthread_mutex_lock(&ls->mbox_mu);
  td__lane *l = ls->mbox_lane[rank];
  if (l && __atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) ls->mbox_dead[rank] = 1;
  const char *why = ls->mbox_dead[rank] ? "it ended" : NULL;
  if (!why && !l) {
    why = mbox_make(ls, rank);
    if (why) ls->mbox_dead[rank] = 1;
    if (why) td_log(TD_LOG_DEBUG, "rpc: no mailbox lane with rank %d: %s", rank, why);
  }
  l = ls->mbox_lane[rank];
  if (!why && owner && l && l->ud) *owner = grab(l->ud);
  pthread_mutex_unlock(&ls->mbox_mu);
  if (why) return td_set_error(TD_ERR_UNAVAILABLE, "no mailbox lane to rank %d: %s", rank, why);
  return TD_OK;
}

/* Mailbox lanes made since the last round: their peers' pidfds are watched (socket thread). */
static void mbox_watch(td__lanes *ls) {
  pthread_mutex_lock(&ls->mu);
  td__lane *q = ls->mbq;
  ls->mbq = NULL;
  pthread_mutex_unlock(&ls->mu);
  while (q) {
    td__lane *l = q;
    q = l->dq_next;
    if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) {
      sock_drop(ls, l);
      continue;
    }
    sock_register(ls, l);
    hs_leave(ls, l); /* (no handshake) */
  }
}

/* Peers knocked: our side of their lanes (socket thread). Bits are taken before their lanes are
 * made; a knock counted after the count was read brings the thread back. */
static void mbox_discover(td__lanes *ls) {
  mbox_hdr *me = mbox_live(ls);
  if (!me) return;
  uint32_t k = __atomic_load_n(&me->knocks, __ATOMIC_ACQUIRE);
  if (k == ls->knocks_st) return;
  ls->knocks_st = k;
  uint64_t *bits = mbox_bits((uint8_t *)me);
  for (int w = 0; w < (ls->arena_world + 63) / 64; w++) {
    if (!__atomic_load_n(&bits[w], __ATOMIC_RELAXED)) continue;
    uint64_t b = __atomic_exchange_n(&bits[w], 0, __ATOMIC_SEQ_CST);
    while (b) {
      int r = w * 64 + __builtin_ctzll(b);
      b &= b - 1;
      if (r < ls->arena_world && r != ls->self_rank && mbox_get(ls, r, NULL, NULL) == TD_OK &&
          ls->o.peer_reads)
        ls->o.peer_reads(ls->o.refused_ud, r); /* it took our descriptors */
    }
  }
}

td_status td__lanes_mbox_open(td__lanes *ls, int world, uint64_t nonce, int *bell_fd,
                              int *arena_fd) {
  *bell_fd = *arena_fd = -1;
  if (ls && ls->arena && world == ls->arena_world) { /* (a record published again) */
    *bell_fd = ls->bell_fd;
    *arena_fd = ls->arena_fd;
    return TD_OK;
  }
  if (!ls || world < 2 || world > MBOX_MAX_WORLD || ls->arena)
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc lane: no mailbox for a group of %d", world);
  size_t n = MBOX_HDR + (size_t)world * MBOX_SLOT;
  uint8_t *map = NULL;
  int fd = sealed_memfd("tdist-mailbox", n, &map);
  if (fd < 0) return td_set_error(TD_ERR_UNAVAILABLE, "rpc lane: cannot create the mailbox");
  ls->mbox_lane = td__calloc((size_t)world, sizeof *ls->mbox_lane);
  ls->mbox_dead = td__calloc((size_t)world, 1);
  if (!ls->mbox_lane || !ls->mbox_dead) {
    munmap(map, n);
    close(fd);
    return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  }
  mbox_hdr *h = (mbox_hdr *)map;
  memcpy(h->magic, MBOX_MAGIC, sizeof MBOX_MAGIC);
  h->nonce = nonce;
  h->world = (uint32_t)world;
  h->slot_bytes = (uint32_t)MBOX_SLOT;
  ls->arena = map;
  ls->arena_fd = fd;
  ls->arena_bytes = n;
  ls->arena_world = world;
  *bell_fd = ls->bell_fd;
  *arena_fd = fd;
  return TD_OK;
}

td_status td__lanes_set_mbox(td__lanes *ls, const int *bell_fd_of, const int *arena_fd_of,
                             int world) {
  if (!ls || !ls->arena || world != ls->arena_world || !td__lanes_dialing(ls) ||
      __atomic_load_n(&ls->mbox_on, __ATOMIC_ACQUIRE))
    return TD_OK;
  int *b = td__calloc((size_t)world, sizeof *b), *a = td__calloc((size_t)world, sizeof *a);
  if (!b || !a) {
    td__free(b);
    td__free(a);
    return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  }
  memcpy(b, bell_fd_of, (size_t)world * sizeof *b);
  memcpy(a, arena_fd_of, (size_t)world * sizeof *a);
  ((mbox_hdr *)ls->arena)->ka_ms = (uint32_t)(ls->ka_ns / 1000000);
  __atomic_store_n(&ls->mb_bell_of, b, __ATOMIC_RELEASE);
  __atomic_store_n(&ls->mb_arena_of, a, __ATOMIC_RELEASE);
  __atomic_store_n(&ls->mbox_on, true, __ATOMIC_RELEASE);
  wake_sock(ls); /* (knocks that came before) */
  kick_self(ls);
  return TD_OK;
}

bool td__lanes_can_mbox(td__lanes *ls, int rank) {
  if (!ls || !mbox_live(ls) || rank < 0 || rank >= ls->arena_world || rank == ls->self_rank)
    return false;
  int *ao = __atomic_load_n(&ls->mb_arena_of, __ATOMIC_ACQUIRE);
  return ao && ao[rank] >= 0 && pid_for(ls, rank) > 0;
}

td_status td__lanes_mbox(td__lanes *ls, int rank, void *(*grab)(void *), void **owner) {
  return mbox_get(ls, rank, grab, owner);
}

bool td__lane_is_mbox(const td__lane *l) { return l && l->mbox; }

int td__lanes_mboxes(const td__lanes *ls) {
  return ls ? __atomic_load_n(&ls->mbox_up, __ATOMIC_RELAXED) : 0;
}

#define SWEEP_NS 200000000ull /* the socket thread's sweeps, at most this often */

/* How long the socket thread may wait for an event: 250 ms while handshakes are under way (their
 * deadlines are swept), else until the next keepalive round is due, 1 s at most (new handshakes
 * and dialled lanes wake it through their sockets and wake_fd). It waited 250 ms at most in
 * every case: 4 wake-ups a second in every idle worker. */
static int sock_timeout_ms(td__lanes *ls, uint64_t swept) {
  if (ls->hs) return 250;
  int64_t ms = 1000;
  if (ls->ka_ns > 0) {
    uint64_t due = ls->ka_round_ns + (uint64_t)ls->ka_ns / 2, sweep = swept + SWEEP_NS + 1;
    if (due < sweep) due = sweep; /* (rounds run from the sweep) */
    uint64_t now = td__now_ns();
    int64_t left = due > now ? (int64_t)((due - now) / 1000000) + 1 : 1;
    if (left < ms) ms = left;
  }
  return (int)ms;
}

static void *sock_main(void *arg) {
  td__lanes *ls = arg;
  struct epoll_event ev[64];
  uint64_t swept = td__now_ns();
  while (!__atomic_load_n(&ls->sock_stop, __ATOMIC_ACQUIRE)) {
    int n = epoll_wait(ls->ep, ev, 64, sock_timeout_ms(ls, swept));
    pthread_mutex_lock(&ls->mu);
    td__lane *q = ls->dialq;
    ls->dialq = NULL;
    pthread_mutex_unlock(&ls->mu);
    while (q) {
      td__lane *l = q;
      q = l->dq_next;
      if (__atomic_load_n(&l->state, __ATOMIC_ACQUIRE) == L_CLOSED) {
        sock_drop(ls, l); /* (not registered: removes nothing from the list) */
        continue;
      }
      sock_register(ls, l);
      dial_event(ls, l, 0); /* the answer may be there already */
    }
    mbox_watch(ls);
    mbox_discover(ls);
    for (int i = 0; i < n; i++) {
      void *p = ev[i].data.ptr;
      if (p == &ls->dial_fd) {
        dial_accept(ls);
      } else if (p == &ls->wake_fd) {
        uint64_t v;
        if (read(ls->wake_fd, &v, sizeof v) < 0) { /* nothing to drain */
        }
      } else {
        /* a lane dropped earlier in this round is still there (bury), no longer registered */
        td__lane *l = p;
        if (l->in_ep) dial_event(ls, l, ev[i].events);
      }
    }
    uint64_t now = td__now_ns();
    if (now - swept > SWEEP_NS) {
      dial_sweep(ls, now);
      swept = now;
    }
    bury(ls);
  }
  /* stopping: every socket closes (the lanes themselves are closed by td__lanes_stop) */
  while (ls->reg) sock_drop(ls, ls->reg);
  pthread_mutex_lock(&ls->mu);
  td__lane *q = ls->dialq;
  ls->dialq = NULL;
  pthread_mutex_unlock(&ls->mu);
  while (q) {
    td__lane *l = q;
    q = l->dq_next;
    sock_drop(ls, l);
  }
  pthread_mutex_lock(&ls->mu);
  q = ls->mbq;
  ls->mbq = NULL;
  pthread_mutex_unlock(&ls->mu);
  while (q) {
    td__lane *l = q;
    q = l->dq_next;
    sock_drop(ls, l);
  }
  bury(ls);
  return NULL;
}

td_status td__lanes_listen_dial(td__lanes *ls, int self_rank, const td__auth *auth,
                                uint64_t self_nonce, const uint64_t *nonce_of, int world,
                                int64_t handshake_ms, int64_t ka_ms, int64_t kt_ms) {
  if (!ls || ls->sock_started) return TD_OK;
  bool any = false;
  for (int r = 0; r < world && r < ls->world; r++)
    any |= r != self_rank && pid_for(ls, r) > 0 && nonce_of[r];
  if (!any || !self_nonce) return TD_OK; /* nobody to dial on this host */
  uint64_t *no = td__calloc((size_t)world, sizeof *no);
  if (!no) return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  memcpy(no, nonce_of, (size_t)world * sizeof *no);
  if (auth) TD_TRY(td__auth_derive(auth, "lane dial", NULL, 0, &ls->dial_auth));
  else ls->dial_auth.secure = false;
  ls->self_rank = self_rank;
  ls->hs_ns = handshake_ms > 0 ? handshake_ms * 1000000 : 0;
  ls->ka_ns = ka_ms > 0 ? ka_ms * 1000000 : 0;
  ls->kt_ns = kt_ms > 0 ? kt_ms * 1000000 : 20000000000;
  /* a lane is a socket per peer: a large group on one host needs more descriptors than the
   * usual soft limit of 1024 */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max &&
      rl.rlim_cur < (rlim_t)(4 * world + 1024)) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  const char *why = NULL;
  snprintf(ls->dial_name, sizeof ls->dial_name, "tdist-dial-%d-%016llx", (int)getpid(),
           (unsigned long long)self_nonce);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  size_t nl = strlen(ls->dial_name);
  memcpy(sa.sun_path + 1, ls->dial_name, nl);
  socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl);
  ls->dial_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (ls->dial_fd < 0 || bind(ls->dial_fd, (struct sockaddr *)&sa, salen) != 0 ||
      listen(ls->dial_fd, 4096) != 0)
    why = "cannot listen on the dial socket";
  if (!why && ((ls->ep = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
               (ls->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0))
    why = "cannot create the socket thread's events";
  if (!why) {
    struct epoll_event e1 = {.events = EPOLLIN, .data.ptr = &ls->dial_fd};
    struct epoll_event e2 = {.events = EPOLLIN, .data.ptr = &ls->wake_fd};
    if (epoll_ctl(ls->ep, EPOLL_CTL_ADD, ls->dial_fd, &e1) != 0 ||
        epoll_ctl(ls->ep, EPOLL_CTL_ADD, ls->wake_fd, &e2) != 0)
      why = "cannot watch the dial socket";
  }
  if (!why && pthread_create(&ls->sock_thread, NULL, sock_main, ls) != 0)
    why = "cannot start the socket thread";
  if (why) {
    int e = errno;
    td__free(no);
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc lane: %s: %s", why, strerror(e));
  }
  pthread_setname_np(ls->sock_thread, "td-lanesock");
  __atomic_store_n(&ls->nonce_of, no, __ATOMIC_RELEASE);
  __atomic_store_n(&ls->sock_started, true, __ATOMIC_RELEASE);
  return TD_OK;
}

static void sock_stop(td__lanes *ls) {
  if (!__atomic_load_n(&ls->sock_started, __ATOMIC_ACQUIRE)) return;
  __atomic_store_n(&ls->sock_stop, true, __ATOMIC_RELEASE);
  wake_sock(ls);
  pthread_join(ls->sock_thread, NULL);
  __atomic_store_n(&ls->sock_started, false, __ATOMIC_RELEASE);
}

/* ---- the process's part ---- */

td_status td__lanes_create(const td__lanes_opts *o, td__lanes **out) {
  td__lanes *ls = td__calloc(1, sizeof *ls);
  if (!ls) return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  ls->o = *o;
  ls->listen_fd = ls->bell_fd = -1;
  ls->dial_fd = ls->ep = ls->wake_fd = ls->arena_fd = -1;
  ls->set_gen = (uint32_t)-1;
  pthread_mutex_init(&ls->mu, NULL);
  pthread_mutex_init(&ls->mbox_mu, NULL);
  pthread_mutex_init(&ls->rx_mu, NULL);
  const char *why = NULL;
  uint8_t *bell = NULL;
  ls->bell_fd = sealed_memfd("tdist-bell", BELL_BYTES, &bell);
  ls->bell = (uint32_t *)bell;
  if (ls->bell_fd < 0) why = "cannot create the doorbell";
  if (!why) {
    snprintf(ls->name, sizeof ls->name, "tdist-lane-%d-%016llx", (int)getpid(),
             (unsigned long long)td__samehost_nonce(ls));
    memset(&ls->addr, 0, sizeof ls->addr);
    ls->addr.sun_family = AF_UNIX;
    size_t nl = strlen(ls->name);
    memcpy(ls->addr.sun_path + 1, ls->name, nl);
    ls->addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl);
    ls->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (ls->listen_fd < 0 || bind(ls->listen_fd, (struct sockaddr *)&ls->addr, ls->addr_len) != 0 ||
        listen(ls->listen_fd, 128) != 0)
      why = "cannot listen on a unix socket";
  }
  if (!why) {
    if (pthread_create(&ls->thread, NULL, lane_main, ls) != 0) why = "cannot start its thread";
    else {
      pthread_setname_np(ls->thread, "td-lane");
      ls->started = true;
      td__wait_poller wp = {wait_enter, wait_poll, wait_leave, wait_window, ls};
      td__future_set_wait_poller(&wp, ls);
    }
  }
  if (why) {
    char msg[200];
    snprintf(msg, sizeof msg, "rpc lane: %s: %s", why, strerror(errno));
    td__lanes_destroy(ls);
    return td_set_error(TD_ERR_UNAVAILABLE, "%s", msg);
  }
  *out = ls;
  return TD_OK;
}

td_status td__lanes_set_pids(td__lanes *ls, const int *pid_of, int world) {
  int *p = td__calloc((size_t)(world > 0 ? world : 1), sizeof *p);
  if (!p) return td_set_error(TD_ERR_NOMEM, "rpc lane: out of memory");
  if (world) memcpy(p, pid_of, (size_t)world * sizeof *p);
  ls->world = world;
  int *none = NULL;
  if (!__atomic_compare_exchange_n(&ls->pid_of, &none, p, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    td__free(p);
    return td_set_error(TD_ERR_STATE, "rpc lane: already configured");
  }
  return TD_OK;
}

void td__lanes_set_spin(td__lanes *ls, int64_t ns) {
  if (ls) __atomic_store_n(&ls->spin_ns, ns > 0 ? ns : 0, __ATOMIC_RELAXED);
}

bool td__lanes_knows(td__lanes *ls, int rank) { return pid_for(ls, rank) > 0; }

int td__lanes_up(const td__lanes *ls) { return ls ? __atomic_load_n(&ls->up, __ATOMIC_RELAXED) : 0; }

void td__lanes_sweep(td__lanes *ls) {
  if (ls) accept_all(ls);
}

static void sock_stop(td__lanes *ls);

void td__lanes_stop(td__lanes *ls) {
  if (!ls) return;
  td__future_set_wait_poller(NULL, ls); /* no waiter polls from here on */
  sock_stop(ls);
  if (ls->started) {
    __atomic_store_n(&ls->stop, true, __ATOMIC_RELEASE);
    kick_self(ls);
    pthread_join(ls->thread, NULL);
    ls->started = false;
  }
  /* every lane leaves (their streams are closed or closing): the streams' references go back */
  pthread_mutex_lock(&ls->mu);
  td__lane *all = ls->lanes;
  ls->lanes = NULL;
  ls->nlanes = 0;
  for (td__lane *l = all; l; l = l->next) l->listed = false;
  pthread_mutex_unlock(&ls->mu);
  while (all) {
    td__lane *l = all;
    all = l->next;
    td__lane_close(l);
    lane_release(l);
  }
}

void td__lanes_destroy(td__lanes *ls) {
  if (!ls) return;
  td__lanes_stop(ls);
  if (ls->listen_fd >= 0) close(ls->listen_fd);
  if (ls->dial_fd >= 0) close(ls->dial_fd);
  if (ls->ep >= 0) close(ls->ep);
  if (ls->wake_fd >= 0) close(ls->wake_fd);
  td__free(ls->nonce_of);
  td__free(ls->free_slots);
  td__free(ls->by_slot);
  td__free(ls->fresh);
  if (ls->bell) munmap(ls->bell, BELL_BYTES);
  if (ls->bell_fd >= 0) close(ls->bell_fd);
  td__free(ls->pid_of);
  for (int r = 0; ls->mbox_lane && r < ls->arena_world; r++) td__lane_unref(ls->mbox_lane[r]);
  td__free(ls->mbox_lane);
  td__free(ls->mbox_dead);
  td__free(ls->mb_bell_of);
  td__free(ls->mb_arena_of);
  if (ls->arena) munmap(ls->arena, ls->arena_bytes);
  if (ls->arena_fd >= 0) close(ls->arena_fd);
  pthread_mutex_lock(&ls->rx_mu);
  for (int i = 0; i < ls->nset; i++) td__lane_unref(ls->set[i]);
  td__free(ls->set);
  td__free(ls->work);
  pthread_mutex_unlock(&ls->rx_mu);
  pthread_mutex_lock(&ls->mu);
  for (td__lane *l = ls->dirty, *nx; l; l = nx) {
    nx = l->dirty_next;
    l->dirty_q = false;
    td__lane_unref(l);
  }
  ls->dirty = NULL;
  pthread_mutex_unlock(&ls->mu);
  pthread_mutex_destroy(&ls->rx_mu);
  pthread_mutex_destroy(&ls->mbox_mu);
  pthread_mutex_destroy(&ls->mu);
  td__free(ls);
}
