/* flight_impl.h - the flight recorder inside tdist (core/flight.c; public part in tdist/trace.h:
 * td_debug_dump, td_debug_set_dump_dir).
 *
 * Always on (TD_FLIGHT=0 turns it off): every layer records what it starts and ends at its one
 * choke point (collectives/execute.c, rpc/call.c, rpc/serve.c, rpc/future.c, rpc/shutdown.c; RRef
 * forks, confirmations and deletes in rref/, backward hops in dist_autograd/) as fixed-size binary
 * records in a process-wide ring of TD__FLIGHT_RING records. Blocking states are also pushed on a
 * small per-thread stack of open records ("open waits"), so a dump says what every thread waits
 * in now even after the ring has wrapped past the record that began the wait.
 *
 * Record fields by kind (peer: a global rank unless said otherwise; name: up to 15 bytes; subject:
 * b = the id of what the operation is about, y = its kind, td__flight_subj_kind):
 *   COLL_ENTER / COLL_EXIT  peer = group id, a = sequence, b = bytes, c = element count,
 *                           x = dtype, y = algorithm (td__algo), name = op kind; EXIT's x = status
 *   RPC_SEND / RPC_DONE     peer = callee, a = call id, name = function, SEND: subject, c = timeout
 *                           in ms (UINT32_MAX: none); DONE's x = status
 *   RPC_RECV                peer = caller, a = call id, name = function, subject (arrived, maybe
 *                           queued)
 *   HANDLER_START / _END    peer = caller, a = call id, name = function, START: subject (set by
 *                           the handler with td__flight_annotate); END: x = status, y = 1 when
 *                           the handler returned a future (the reply waits on it), b and c = the
 *                           subject's id and kind
 *   WAIT_BEGIN / WAIT_END   peer = callee (-1: a future not from a call), a = call id, name = fn,
 *                           subject, c = timeout in ms (UINT32_MAX: none) or, for
 *                           td_future_wait_all, x = 1 and c = the number of futures (the record
 *                           names the first one not done); END's b = status
 *   SCOPE_BEGIN / _END      a blocking operation made of other waits: name = what
 *                           ("dist_backward", "dist_optim_step", "rpc_shutdown"), subject
 *   RREF_FORK               peer = owner, a = RRef id, b = fork id, c = the other worker (the
 *                           child the fork is sent to, or the parent it came from), x = 0 sent to
 *                           the owner, 1 received (an unconfirmed user RRef), 2 added by the owner
 *   RREF_CONFIRM            peer = owner, a = RRef id, b = fork id, x = status (a user's fork
 *                           accepted by its owner)
 *   RREF_DELETE             peer = owner, a = RRef id, b = fork id (a user RRef released)
 *   BWD_SEND / BWD_RECV     a distributed backward hop: peer = the other worker, a = context id,
 *                           b = autograd message id, c = number of gradients
 *   DUMP                    a = 1 for an explicit request, name = the reason's start
 */
#ifndef TD_CORE_FLIGHT_IMPL_H
#define TD_CORE_FLIGHT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Records in the ring (64 bytes each: 1 MiB), and open records kept per thread. */
#define TD__FLIGHT_RING 16384u
#define TD__FLIGHT_OPEN_DEPTH 8
#define TD__FLIGHT_NAME 16

typedef enum td__flight_kind {
  TD__FL_NONE = 0,
  TD__FL_COLL_ENTER,
  TD__FL_COLL_EXIT,
  TD__FL_RPC_SEND,
  TD__FL_RPC_DONE,
  TD__FL_RPC_RECV,
  TD__FL_HANDLER_START,
  TD__FL_HANDLER_END,
  TD__FL_WAIT_BEGIN,
  TD__FL_WAIT_END,
  TD__FL_DUMP,
  TD__FL_SCOPE_BEGIN,
  TD__FL_SCOPE_END,
  TD__FL_RREF_FORK,
  TD__FL_RREF_CONFIRM,
  TD__FL_RREF_DELETE,
  TD__FL_BWD_SEND,
  TD__FL_BWD_RECV,
  TD__FL_KIND_COUNT
} td__flight_kind;

/* What a record is about (its y field where the kind has a subject; the id in b). */
typedef enum td__flight_subj_kind {
  TD__FL_SUBJ_NONE = 0,
  TD__FL_SUBJ_RREF = 1, /* an RRef id */
  TD__FL_SUBJ_CTX = 2   /* a distributed autograd context id */
} td__flight_subj_kind;

typedef struct td__flight_subj {
  uint8_t kind;
  uint64_t id;
} td__flight_subj;

/* One record: eight 64-bit words, so readers copy it word by word with atomic loads (a dump runs
 * beside the writers). stamp is the claim index + 1 once the record is complete, UINT64_MAX
 * while its one writer writes it, 0 before any. */
typedef struct td__flight_rec {
  uint64_t stamp;
  uint64_t ts; /* td__now_ns() */
  uint64_t a, b;
  int32_t tid, peer;
  uint16_t kind;
  uint8_t x, y;
  uint32_t c;
  char name[TD__FLIGHT_NAME]; /* NUL-terminated, truncated */
} td__flight_rec;

_Static_assert(sizeof(td__flight_rec) == 64, "a flight record is 64 bytes");

/* The fields of a record before it is stamped (kind, peer, a, b, c, x, y; name separately). */
typedef struct td__flight_ev {
  uint16_t kind;
  int32_t peer;
  uint64_t a, b;
  uint32_t c;
  uint8_t x, y;
} td__flight_ev;

extern int td__flight_state; /* 1 on, 0 off (TD_FLIGHT=0), -1 not decided yet */

/* td__flight_record appends one record; td__flight_push also opens it on the calling thread's
 * stack, td__flight_pop records the end and closes the innermost open record. Each costs one
 * atomic increment, a clock read and a 64-byte copy (see docs/ARCHITECTURE.md for the figure). */
void td__flight_record(const td__flight_ev *e, const char *name);
void td__flight_push(const td__flight_ev *e, const char *name);
void td__flight_pop(const td__flight_ev *end, const char *name);

/* The calling thread's subject: calls it makes while set carry it (rpc/call.c reads it at the
 * send, and tags the call's future with it). td__flight_subject_set returns the previous one, to
 * be restored with td__flight_subject_set(prev) when the calls are made. */
td__flight_subj td__flight_subject_set(td__flight_subj s);
td__flight_subj td__flight_subject(void);

/* td__flight_annotate sets the subject of the calling thread's innermost open record (a handler
 * that learns from its arguments which RRef or context it serves). */
void td__flight_annotate(td__flight_subj s);
/* td__flight_open_subject returns the subject of the calling thread's innermost open record. */
td__flight_subj td__flight_open_subject(void);

/* td__flight_timeout_field maps a timeout in ms to a record's c field (UINT32_MAX: none). */
static inline uint32_t td__flight_timeout_field(int64_t ms) {
  return ms < 0 || ms >= (int64_t)UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
}

/* Process-wide totals for tdistrun --summary (kept whether or not the recorder is on):
 * td__flight_count_wait adds a blocking wait of ns (td_future_wait and td_future_wait_all when
 * they block, a collective run on the caller's thread); td__flight_count_coll adds a collective's
 * time from entry to exit on this member (where it ran). Relaxed atomic additions. */
typedef struct td__wait_totals {
  uint64_t wait_ns, coll_ns, coll_n;
} td__wait_totals;
void td__flight_count_wait(uint64_t ns);
void td__flight_count_coll(uint64_t ns);
void td__flight_wait_totals(td__wait_totals *out);

/* td__flight_deadline is called by a thread whose blocking call reached its deadline (or failed
 * while blocked), before it closes its open record, with what happened (the dump's reason): it
 * dumps when a dump directory is set
 * (TD_FLIGHT_DIR or td_debug_set_dump_dir), at most once per TD__FLIGHT_DEADLINE_GAP_S per process
 * so one hang's cascade of expiries keeps its first, most telling snapshot. */
#define TD__FLIGHT_DEADLINE_GAP_S 10
void td__flight_deadline(const char *what);

/* Who this process is (written into dumps): rank, worker name, world size; the clock's offset to
 * rank 0 (ns to add to local times) with its uncertainty; the names of all workers (world of
 * them, stride bytes apart); the process groups this worker is a member of. */
void td__flight_set_process(int rank, const char *name, int world);
/* The RPC agent's handler threads (the dump's "pool" line: why-hung tells an exhausted pool). */
void td__flight_set_pool(int threads);
void td__flight_set_clock(int64_t offset_ns, int64_t residual_ns);
void td__flight_set_workers(const char *names, size_t stride, int world);
void td__flight_group_add(uint64_t id, int grank, int size, const int *ranks);
void td__flight_group_remove(uint64_t id);

/* td__flight_start installs the SIGUSR1 handler (when the program left SIGUSR1 at its default)
 * and starts the dumper thread it wakes. Idempotent per process (a forked child starts its own).
 * With a dump directory set it also writes DIR/<worker name>.proc (pid, host, the process's start
 * time), by which why-hung tells a worker without a dump dead from stopped. Called by
 * td_rpc_init. */
void td__flight_start(void);

/* Writes a dump now on the calling thread into the dump directory (explicit: the default one when
 * none is set). */
int td__flight_dump(const char *reason, bool explicit_request);

/* For tests: the records claimed so far, and a copy of the newest n into out (oldest first);
 * returns how many were copied (torn or overwritten records are skipped). */
uint64_t td__flight_claimed(void);
size_t td__flight_snapshot(td__flight_rec *out, size_t n);
/* td__flight_record is td__flight_write(td__flight_claim(), record): split for tests that play a
 * writer preempted between the two. td__flight_dropped counts records writers gave up (their
 * slot was busy or already held a newer claim); dumps print it. */
uint64_t td__flight_claim(void);
void td__flight_write(uint64_t claim, const td__flight_rec *r);
uint64_t td__flight_dropped(void);
const char *td__flight_kind_name(int kind);
/* Where the next dump goes, into buf; false when no directory is set and !explicit_request. */
bool td__flight_dump_path(char *buf, size_t n, bool explicit_request);

#endif
