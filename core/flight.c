/* flight.c - the flight recorder: a fixed ring of binary records, always on, dumped as text when a
 * blocking call reaches its deadline, on SIGUSR1, and on td_debug_dump.
 *
 * Design:
 *   - The ring is a static array of TD__FLIGHT_RING 64-byte records (1 MiB of .bss, touched only
 *     as it fills). A writer claims a slot with one atomic increment of `claimed`, takes the
 *     slot by swapping its stamp for SLOT_BUSY (compare-and-swap, only from an older claim's
 *     stamp), writes the record word by word and publishes it by storing its stamp (claim index
 *     + 1) with release order. A writer that cannot take its slot (another writer is in it, or a
 *     newer claim is there: it was preempted for a lap of the ring) drops its record and counts
 *     it, never waits. A reader (the dump) takes a record only when its stamp is the one it
 *     expects before and after copying it (a seqlock per slot, one writer at a time), so a record
 *     being overwritten is skipped, never half-read. No lock anywhere on the recording path.
 *   - Open records: each recording thread owns one of TD__FLIGHT_THREADS slots (claimed at its
 *     first push, released by a pthread key's destructor at its exit), holding a stack of up to
 *     TD__FLIGHT_OPEN_DEPTH open records under a per-slot generation counter (odd while written),
 *     so a dump sees what every thread waits in even after the ring wrapped past its start.
 *     Deeper pushes are counted but not kept, and their pops match.
 *   - SIGUSR1: the handler only write(2)s one byte to a pipe (async-signal-safe); a small dumper
 *     thread reads it and writes the dump. Formatting (snprintf) and opening files are not
 *     async-signal-safe, and a handler interrupting a thread inside malloc or inside a record
 *     must not touch either. The dumper thread is neither the network thread nor a pool thread,
 *     and a dump reads only the ring and the slots: it never waits on the network.
 *   - Deadline dumps run on the thread that waited (never the network thread, which detects RPC
 *     timeouts but only completes the future), before it closes its open record.
 *
 * Invariants: a slot with stamp i + 1 holds claim i complete; a slot's stamp only grows, except
 * to SLOT_BUSY and back while its one writer writes; `claimed` only grows.
 * Lock order: meta_mu (process identity, worker names, groups), then nothing. The recording path
 * takes no lock.
 */
#include "flight_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core.h"
#include "tdist/trace.h"

#define TD__FLIGHT_THREADS 256
#define TD__FLIGHT_GROUPS 64

int td__flight_state = -1;

/* a record per cache line */
static td__flight_rec ring[TD__FLIGHT_RING] __attribute__((aligned(64)));
static uint64_t claimed;
static uint64_t dropped; /* records a writer gave up (td__flight_write) */
#define SLOT_BUSY UINT64_MAX /* a slot's stamp while a writer owns it */

typedef struct open_slot {
  uint64_t gen;  /* odd while the owner changes the stack */
  int32_t used;  /* 1 while a thread owns it */
  int32_t tid;
  int32_t depth; /* pushes minus pops, may exceed TD__FLIGHT_OPEN_DEPTH */
  int32_t pad;
  td__flight_rec stack[TD__FLIGHT_OPEN_DEPTH];
} open_slot;

static open_slot slots[TD__FLIGHT_THREADS];
static __thread open_slot *my_slot;
static __thread int32_t my_tid;
static __thread td__flight_subj my_subject;
static pthread_key_t slot_key;
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* process identity, guarded by meta_mu */
static pthread_mutex_t meta_mu = PTHREAD_MUTEX_INITIALIZER;
static int proc_rank = -1, proc_world = 0, proc_pool = 0;
static char proc_name[128];
static int64_t clock_offset, clock_residual;
static char *worker_names; /* world entries of worker_stride bytes */
static size_t worker_stride;
static int worker_count;
static char dump_dir[512]; /* td_debug_set_dump_dir; empty: TD_FLIGHT_DIR */
typedef struct group_ent {
  uint64_t id;
  int grank, size;
  int *ranks;
} group_ent;
static group_ent groups[TD__FLIGHT_GROUPS];
static uint64_t last_deadline_dump_ns;

/* the SIGUSR1 wake-up pipe and the pid that owns the dumper thread reading it */
static int sig_pipe[2] = {-1, -1};
static pid_t dumper_pid; /* atomic: stored after sig_pipe, loaded by the handler first */
static int progress_fd = -1; /* in TD_FLIGHT_PROGRESS_DIR, written by the dumper thread */

/* ---- recording ---- */

static void slot_release(void *p) {
  open_slot *s = p;
  __atomic_store_n(&s->depth, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->used, 0, __ATOMIC_RELEASE);
}

/* A forked child keeps none of its parent's records or open waits: they describe threads it
 * does not have, and its dumps would blame them. */
static void fork_child(void) {
  uint64_t n = claimed < TD__FLIGHT_RING ? claimed : TD__FLIGHT_RING;
  memset(ring, 0, (size_t)n * sizeof ring[0]);
  claimed = 0;
  memset(slots, 0, sizeof slots);
  my_slot = NULL, my_tid = 0, my_subject = (td__flight_subj){0};
  pthread_setspecific(slot_key, NULL);
  last_deadline_dump_ns = 0;
  if (progress_fd >= 0) close(progress_fd); /* the parent's file, not ours */
  progress_fd = -1;
}

static void init_once(void) {
  const char *e = getenv("TD_FLIGHT");
  pthread_key_create(&slot_key, slot_release);
  pthread_atfork(NULL, NULL, fork_child);
  __atomic_store_n(&td__flight_state, e && strcmp(e, "0") == 0 ? 0 : 1, __ATOMIC_RELEASE);
}

static bool flight_on(void) {
  int s = __atomic_load_n(&td__flight_state, __ATOMIC_RELAXED);
  if (__builtin_expect(s < 0, 0)) {
    pthread_once(&once, init_once);
    s = __atomic_load_n(&td__flight_state, __ATOMIC_ACQUIRE);
  }
  return s > 0;
}

static int32_t this_tid(void) {
  if (!my_tid) my_tid = (int32_t)syscall(SYS_gettid);
  return my_tid;
}

static void fill(td__flight_rec *r, const td__flight_ev *e, const char *name) {
  memset(r, 0, sizeof *r);
  r->ts = td__now_ns();
  r->a = e->a;
  r->b = e->b;
  r->c = e->c;
  r->tid = this_tid();
  r->peer = e->peer;
  r->kind = e->kind;
  r->x = e->x;
  r->y = e->y;
  if (name) {
    size_t i = 0;
    for (; i + 1 < TD__FLIGHT_NAME && name[i]; i++) r->name[i] = name[i];
  }
}

/* Word-wise copies with atomic accesses: records are read while they may be written. The seqlocks
 * need the words ordered after the stamp (or generation) that opens a change and before the one
 * that closes it: release stores and acquire loads give that word by word (plain moves on x86,
 * and unlike standalone fences, understood by ThreadSanitizer). */
static void rec_store(td__flight_rec *dst, const td__flight_rec *src) {
  uint64_t *d = (uint64_t *)dst;
  const uint64_t *s = (const uint64_t *)src;
  for (size_t i = 1; i < sizeof *dst / 8; i++) __atomic_store_n(&d[i], s[i], __ATOMIC_RELEASE);
}

static void rec_load(const td__flight_rec *src, td__flight_rec *dst) {
  uint64_t *d = (uint64_t *)dst;
  const uint64_t *s = (const uint64_t *)src;
  for (size_t i = 1; i < sizeof *dst / 8; i++) d[i] = __atomic_load_n(&s[i], __ATOMIC_ACQUIRE);
}

uint64_t td__flight_claim(void) { return __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED); }

/* Writes claim i's record into its slot. The writer owns the slot while it writes: it swaps the
 * stamp for SLOT_BUSY, and only from a stamp older than its own claim. A writer that finds the
 * slot busy (another writer, lapped or lapping, is in it) or already holding a newer claim (it
 * was itself preempted for a whole lap of the ring) drops its record: two writers never write
 * one slot at once, and an older record never replaces a newer one. Nothing here waits, so a
 * signal handler may record. */
void td__flight_write(uint64_t i, const td__flight_rec *r) {
  td__flight_rec *slot = &ring[i & (TD__FLIGHT_RING - 1)];
  /* expect the previous lap's claim (the usual case): no separate load of the line */
  uint64_t s = i >= TD__FLIGHT_RING ? i + 1 - TD__FLIGHT_RING : 0;
  while (!__atomic_compare_exchange_n(&slot->stamp, &s, SLOT_BUSY, false, __ATOMIC_ACQUIRE,
                                      __ATOMIC_RELAXED)) {
    if (s > i) { /* SLOT_BUSY, or claim s - 1 > i is there */
      __atomic_fetch_add(&dropped, 1, __ATOMIC_RELAXED);
      return;
    }
  }
  rec_store(slot, r); /* release stores: ordered after the swap, before the publishing stamp */
  __atomic_store_n(&slot->stamp, i + 1, __ATOMIC_RELEASE);
}

uint64_t td__flight_dropped(void) { return __atomic_load_n(&dropped, __ATOMIC_RELAXED); }

/* Claims, fills *r and writes it: the slot's line is fetched for writing while fill works. */
static void append(td__flight_rec *r, const td__flight_ev *e, const char *name) {
  uint64_t i = td__flight_claim();
  __builtin_prefetch(&ring[i & (TD__FLIGHT_RING - 1)], 1);
  fill(r, e, name);
  td__flight_write(i, r);
}

void td__flight_record(const td__flight_ev *e, const char *name) {
  if (!flight_on()) return;
  td__flight_rec r;
  append(&r, e, name);
}

static open_slot *thread_slot(void) {
  if (my_slot) return my_slot;
  for (int i = 0; i < TD__FLIGHT_THREADS; i++) {
    int32_t zero = 0;
    if (__atomic_compare_exchange_n(&slots[i].used, &zero, 1, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
      __atomic_store_n(&slots[i].tid, this_tid(), __ATOMIC_RELAXED);
      __atomic_store_n(&slots[i].depth, 0, __ATOMIC_RELAXED);
      my_slot = &slots[i];
      pthread_setspecific(slot_key, my_slot);
      return my_slot;
    }
  }
  return NULL; /* more threads than slots: this one records events only */
}

/* Changes the stack under the slot's generation counter (seqlock). */
static void slot_begin(open_slot *s) {
  __atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELAXED); /* before the release stores below */
}

static void slot_end(open_slot *s) { __atomic_store_n(&s->gen, s->gen + 1, __ATOMIC_RELEASE); }

void td__flight_push(const td__flight_ev *e, const char *name) {
  if (!flight_on()) return;
  td__flight_rec r;
  append(&r, e, name);
  open_slot *s = thread_slot();
  if (!s) return;
  int32_t d = s->depth;
  slot_begin(s);
  if (d < TD__FLIGHT_OPEN_DEPTH) rec_store(&s->stack[d], &r);
  __atomic_store_n(&s->depth, d + 1, __ATOMIC_RELEASE);
  slot_end(s);
}

void td__flight_pop(const td__flight_ev *end, const char *name) {
  if (!flight_on()) return;
  td__flight_record(end, name);
  open_slot *s = my_slot;
  if (!s || s->depth <= 0) return;
  slot_begin(s);
  __atomic_store_n(&s->depth, s->depth - 1, __ATOMIC_RELEASE);
  slot_end(s);
}

td__flight_subj td__flight_subject_set(td__flight_subj s) {
  td__flight_subj prev = my_subject;
  my_subject = s;
  return prev;
}

td__flight_subj td__flight_subject(void) { return my_subject; }

void td__flight_annotate(td__flight_subj subj) {
  open_slot *s = my_slot;
  if (!s || s->depth <= 0 || s->depth > TD__FLIGHT_OPEN_DEPTH) return;
  td__flight_rec r = s->stack[s->depth - 1]; /* this thread's own writes: a plain read */
  r.b = subj.id;
  r.y = subj.kind;
  slot_begin(s);
  rec_store(&s->stack[s->depth - 1], &r);
  slot_end(s);
}

td__flight_subj td__flight_open_subject(void) {
  open_slot *s = my_slot;
  if (!s || s->depth <= 0 || s->depth > TD__FLIGHT_OPEN_DEPTH) return (td__flight_subj){0};
  return (td__flight_subj){s->stack[s->depth - 1].y, s->stack[s->depth - 1].b};
}

static td__wait_totals totals;

void td__flight_count_wait(uint64_t ns) {
  __atomic_add_fetch(&totals.wait_ns, ns, __ATOMIC_RELAXED);
}

void td__flight_count_coll(uint64_t ns) {
  __atomic_add_fetch(&totals.coll_ns, ns, __ATOMIC_RELAXED);
  __atomic_add_fetch(&totals.coll_n, 1, __ATOMIC_RELAXED);
}

void td__flight_wait_totals(td__wait_totals *out) {
  out->wait_ns = __atomic_load_n(&totals.wait_ns, __ATOMIC_RELAXED);
  out->coll_ns = __atomic_load_n(&totals.coll_ns, __ATOMIC_RELAXED);
  out->coll_n = __atomic_load_n(&totals.coll_n, __ATOMIC_RELAXED);
}

uint64_t td__flight_claimed(void) { return __atomic_load_n(&claimed, __ATOMIC_ACQUIRE); }

/* Claim i's record if it is still in the ring and complete. */
static bool read_claim(uint64_t i, td__flight_rec *out) {
  const td__flight_rec *slot = &ring[i & (TD__FLIGHT_RING - 1)];
  uint64_t s1 = __atomic_load_n(&slot->stamp, __ATOMIC_ACQUIRE);
  if (s1 != i + 1) return false;
  rec_load(slot, out); /* acquire loads: the stamp is read again after them */
  out->stamp = __atomic_load_n(&slot->stamp, __ATOMIC_RELAXED);
  return out->stamp == s1;
}

size_t td__flight_snapshot(td__flight_rec *out, size_t n) {
  uint64_t end = td__flight_claimed();
  uint64_t begin = end > TD__FLIGHT_RING ? end - TD__FLIGHT_RING : 0;
  if (end - begin > n) begin = end - n;
  size_t k = 0;
  for (uint64_t i = begin; i < end; i++)
    if (read_claim(i, &out[k])) k++;
  return k;
}

/* ---- process identity ---- */

void td__flight_set_process(int rank, const char *name, int world) {
  pthread_mutex_lock(&meta_mu);
  proc_rank = rank;
  proc_world = world;
  snprintf(proc_name, sizeof proc_name, "%s", name ? name : "");
  pthread_mutex_unlock(&meta_mu);
}

void td__flight_set_pool(int threads) {
  pthread_mutex_lock(&meta_mu);
  proc_pool = threads;
  pthread_mutex_unlock(&meta_mu);
}

void td__flight_set_clock(int64_t offset_ns, int64_t residual_ns) {
  pthread_mutex_lock(&meta_mu);
  clock_offset = offset_ns;
  clock_residual = residual_ns;
  pthread_mutex_unlock(&meta_mu);
}

void td__flight_set_workers(const char *names, size_t stride, int world) {
  char *copy = world > 0 ? td__malloc(stride * (size_t)world) : NULL;
  if (copy) memcpy(copy, names, stride * (size_t)world);
  pthread_mutex_lock(&meta_mu);
  td__free(worker_names);
  worker_names = copy;
  worker_stride = stride;
  worker_count = copy ? world : 0;
  pthread_mutex_unlock(&meta_mu);
}

void td__flight_group_add(uint64_t id, int grank, int size, const int *ranks) {
  int *copy = td__malloc(sizeof *copy * (size_t)(size > 0 ? size : 1));
  if (!copy) return;
  memcpy(copy, ranks, sizeof *copy * (size_t)size);
  pthread_mutex_lock(&meta_mu);
  for (int i = 0; i < TD__FLIGHT_GROUPS; i++) {
    if (groups[i].ranks) continue;
    groups[i] = (group_ent){id, grank, size, copy};
    copy = NULL;
    break;
  }
  pthread_mutex_unlock(&meta_mu);
  td__free(copy); /* table full: the group's members are not named in dumps */
}

void td__flight_group_remove(uint64_t id) {
  pthread_mutex_lock(&meta_mu);
  for (int i = 0; i < TD__FLIGHT_GROUPS; i++)
    if (groups[i].ranks && groups[i].id == id) {
      td__free(groups[i].ranks);
      groups[i] = (group_ent){0};
    }
  pthread_mutex_unlock(&meta_mu);
}

/* ---- dumps ---- */

const char *td__flight_kind_name(int kind) {
  static const char *const names[TD__FL_KIND_COUNT] = {
      "none",         "coll_enter",  "coll_exit",   "rpc_send",   "rpc_done",
      "rpc_recv",     "handler_start", "handler_end", "wait_begin", "wait_end",
      "dump",         "scope_begin", "scope_end",   "rref_fork",  "rref_confirm",
      "rref_delete",  "bwd_send",    "bwd_recv"};
  return kind >= 0 && kind < TD__FL_KIND_COUNT ? names[kind] : "?";
}

bool td__flight_dump_path(char *buf, size_t n, bool explicit_request) {
  char dir[512];
  pthread_mutex_lock(&meta_mu);
  snprintf(dir, sizeof dir, "%s", dump_dir);
  pthread_mutex_unlock(&meta_mu);
  if (!dir[0]) {
    const char *e = getenv("TD_FLIGHT_DIR");
    if (e && *e) snprintf(dir, sizeof dir, "%s", e);
  }
  if (!dir[0]) {
    if (!explicit_request) return false;
    const char *t = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/tdist-flight", t && *t ? t : "/tmp");
  }
  pthread_mutex_lock(&meta_mu);
  if (proc_name[0]) snprintf(buf, n, "%s/%s.flight", dir, proc_name);
  else snprintf(buf, n, "%s/pid%d.flight", dir, (int)getpid());
  pthread_mutex_unlock(&meta_mu);
  return true;
}

/* A buffered writer over a raw descriptor. */
typedef struct out_buf {
  int fd;
  bool failed;
  size_t len;
  char b[1 << 16];
} out_buf;

static void out_flush(out_buf *o) {
  size_t off = 0;
  while (off < o->len && !o->failed) {
    ssize_t w = write(o->fd, o->b + off, o->len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) o->failed = true;
    else off += (size_t)w;
  }
  o->len = 0;
}

static void outf(out_buf *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void outf(out_buf *o, const char *fmt, ...) {
  if (sizeof o->b - o->len < 1024) out_flush(o);
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(o->b + o->len, sizeof o->b - o->len, fmt, ap);
  va_end(ap);
  if (k > 0) o->len += (size_t)k < sizeof o->b - o->len ? (size_t)k : sizeof o->b - o->len - 1;
}

/* A word for the dump's space-separated lines: printable, no spaces, never empty. */
static const char *word(const char *s, char *buf, size_t n) {
  size_t k = 0;
  for (; s && s[k] && k + 1 < n; k++)
    buf[k] = s[k] > ' ' && s[k] < 127 ? s[k] : '_';
  if (!k) buf[k++] = '-';
  buf[k] = 0;
  return buf;
}

static void out_rec(out_buf *o, const char *tag, int depth, const td__flight_rec *r) {
  char nm[TD__FLIGHT_NAME + 1], nm0[TD__FLIGHT_NAME + 1];
  memcpy(nm0, r->name, TD__FLIGHT_NAME);
  nm0[TD__FLIGHT_NAME] = 0;
  outf(o, "%s %d %llu %d %s %d %llu %llu %u %u %u %s\n", tag, depth,
       (unsigned long long)r->ts, (int)r->tid, td__flight_kind_name(r->kind), (int)r->peer,
       (unsigned long long)r->a, (unsigned long long)r->b, (unsigned)r->c, (unsigned)r->x,
       (unsigned)r->y, word(nm0, nm, sizeof nm));
}

static void out_header(out_buf *o, const char *reason) {
  char rs[256];
  pthread_mutex_lock(&meta_mu);
  outf(o, "tdist-flight 1\nrank %d\nname %s\nworld %d\npid %d\n", proc_rank,
       proc_name[0] ? proc_name : "-", proc_world, (int)getpid());
  outf(o, "clock_offset_ns %lld\nclock_residual_ns %lld\nnow_ns %llu\n", (long long)clock_offset,
       (long long)clock_residual, (unsigned long long)td__now_ns());
  snprintf(rs, sizeof rs, "%s", reason ? reason : "");
  for (char *p = rs; *p; p++)
    if (*p == '\n' || *p == '\r') *p = ' ';
  outf(o, "reason %s\nclaimed %llu\ndropped %llu\npool %d\n", rs,
       (unsigned long long)td__flight_claimed(), (unsigned long long)td__flight_dropped(),
       proc_pool);
  for (int i = 0; i < worker_count; i++) {
    char w[140];
    outf(o, "worker %d %s\n", i, word(worker_names + (size_t)i * worker_stride, w, sizeof w));
  }
  for (int i = 0; i < TD__FLIGHT_GROUPS; i++) {
    if (!groups[i].ranks) continue;
    outf(o, "group %llu %d %d", (unsigned long long)groups[i].id, groups[i].size,
         groups[i].grank);
    for (int k = 0; k < groups[i].size; k++) outf(o, " %d", groups[i].ranks[k]);
    outf(o, "\n");
  }
  pthread_mutex_unlock(&meta_mu);
}

/* Each thread's open records, innermost last ("open DEPTH ..."); a stack changing while it is
 * read is read again (a few times, then skipped). */
static void out_open(out_buf *o) {
  for (int i = 0; i < TD__FLIGHT_THREADS; i++) {
    open_slot *s = &slots[i];
    if (!__atomic_load_n(&s->used, __ATOMIC_ACQUIRE)) continue;
    for (int tries = 0; tries < 100; tries++) {
      td__flight_rec st[TD__FLIGHT_OPEN_DEPTH];
      uint64_t g1 = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
      if (g1 & 1) continue;
      int32_t d = __atomic_load_n(&s->depth, __ATOMIC_ACQUIRE);
      int n = d < TD__FLIGHT_OPEN_DEPTH ? d : TD__FLIGHT_OPEN_DEPTH;
      for (int k = 0; k < n; k++) rec_load(&s->stack[k], &st[k]); /* acquire, as depth */
      if (__atomic_load_n(&s->gen, __ATOMIC_RELAXED) != g1) continue;
      for (int k = 0; k < n; k++) out_rec(o, "open", k, &st[k]);
      break;
    }
  }
}

static void out_ring(out_buf *o) {
  uint64_t end = td__flight_claimed();
  uint64_t begin = end > TD__FLIGHT_RING ? end - TD__FLIGHT_RING : 0;
  for (uint64_t i = begin; i < end; i++) {
    td__flight_rec r = {0}; /* read_claim fills every word; said for the compiler */
    if (read_claim(i, &r)) out_rec(o, "ev", 0, &r);
  }
}

static int make_dir(const char *path) {
  char p[700];
  snprintf(p, sizeof p, "%s", path);
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    mkdir(p, 0777);
    *s = '/';
  }
  return mkdir(p, 0777) == 0 || errno == EEXIST ? 0 : -1;
}

int td__flight_dump(const char *reason, bool explicit_request) {
  char path[700], tmp[760];
  if (!flight_on()) return -1;
  if (!td__flight_dump_path(path, sizeof path, explicit_request)) return -1;
  td__flight_record(&(td__flight_ev){.kind = TD__FL_DUMP, .a = explicit_request}, reason);
  char *slash = strrchr(path, '/');
  *slash = 0;
  int rc = make_dir(path);
  *slash = '/';
  snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
  int fd = rc == 0 ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666) : -1;
  if (fd < 0) return -1;
  out_buf *o = td__malloc(sizeof *o);
  if (!o) {
    close(fd);
    unlink(tmp);
    return -1;
  }
  o->fd = fd, o->failed = false, o->len = 0;
  out_header(o, reason);
  out_open(o);
  out_ring(o);
  outf(o, "end\n");
  out_flush(o);
  bool ok = !o->failed;
  td__free(o);
  if (close(fd) != 0) ok = false;
  if (ok && rename(tmp, path) == 0) return 0;
  unlink(tmp);
  return -1;
}

void td__flight_deadline(const char *what) {
  char path[700];
  if (!flight_on() || !td__flight_dump_path(path, sizeof path, false)) return;
  uint64_t now = td__now_ns(), last = __atomic_load_n(&last_deadline_dump_ns, __ATOMIC_RELAXED);
  if (last && now - last < (uint64_t)TD__FLIGHT_DEADLINE_GAP_S * 1000000000ull) return;
  if (!__atomic_compare_exchange_n(&last_deadline_dump_ns, &last, now, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_RELAXED))
    return; /* another thread of this process is dumping this very hang */
  if (td__flight_dump(what, false) != 0)
    td_log(TD_LOG_WARN, "flight recorder: cannot write %s: %s", path, strerror(errno));
}

/* ---- SIGUSR1 ---- */

static void on_sigusr1(int sig) {
  (void)sig;
  int saved = errno;
  if (getpid() == __atomic_load_n(&dumper_pid, __ATOMIC_ACQUIRE)) {
    char c = 'u';
    /* a full pipe means a dump is pending anyway */
    ssize_t w = write(__atomic_load_n(&sig_pipe[1], __ATOMIC_RELAXED), &c, 1);
    (void)w;
  }
  errno = saved;
}

/* Progress for a supervisor (tdistrun --hang-timeout): the records claimed so far, as 20 digits
 * and a newline at the start of $TD_FLIGHT_PROGRESS_DIR/.progress.<pid>, rewritten every second
 * by the dumper. A hung process records nothing, so the number stops moving. */

static void write_progress(void) {
  char b[32];
  int k = snprintf(b, sizeof b, "%020llu\n", (unsigned long long)td__flight_claimed());
  ssize_t w = pwrite(progress_fd, b, (size_t)k, 0);
  (void)w; /* a supervisor that cannot read it sees no progress and says so */
}

static void *dumper_main(void *arg) {
  struct pollfd p = {.fd = (int)(intptr_t)arg, .events = POLLIN};
  for (;;) {
    if (progress_fd >= 0) write_progress();
    int r = poll(&p, 1, progress_fd >= 0 ? 1000 : -1);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) continue;
    char c[16];
    ssize_t n = read(p.fd, c, sizeof c);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return NULL;
    td__flight_dump("SIGUSR1", true);
  }
}

/* This process's start time in clock ticks since boot (field 22 of /proc/self/stat), which tells
 * a reused pid from the process that wrote the .proc file; 0 when unreadable. */
static unsigned long long start_ticks(void) {
  char b[1024];
  int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? read(fd, b, sizeof b - 1) : -1;
  if (fd >= 0) close(fd);
  if (n <= 0) return 0;
  b[n] = 0;
  char *p = strrchr(b, ')'); /* the command name may hold spaces: fields count from after it */
  unsigned long long t = 0;
  for (int field = 2; p && *p; p++)
    if (*p == ' ' && ++field == 22) {
      t = strtoull(p + 1, NULL, 10);
      break;
    }
  return t;
}

/* DIR/<name>.proc: "pid P", "host H", "start T" (written once per process at start, when a dump
 * directory is set): why-hung looks up a worker that left no dump. */
static void write_proc_file(void) {
  char path[700], tmp[760], host[256] = "-";
  if (!td__flight_dump_path(path, sizeof path, false)) return;
  size_t l = strlen(path);
  if (l < 7 || strcmp(path + l - 7, ".flight") != 0) return;
  snprintf(path + l - 7, sizeof path - (l - 7), ".proc");
  char *slash = strrchr(path, '/');
  *slash = 0;
  int rc = make_dir(path);
  *slash = '/';
  snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
  int fd = rc == 0 ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666) : -1;
  if (fd < 0) return;
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = 0;
  char b[400];
  int k = snprintf(b, sizeof b, "pid %d\nhost %s\nstart %llu\n", (int)getpid(), host,
                   start_ticks());
  bool ok = write(fd, b, (size_t)k) == k;
  if (close(fd) != 0) ok = false;
  if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

void td__flight_start(void) {
  if (!flight_on()) return;
  write_proc_file();
  pthread_mutex_lock(&meta_mu);
  if (__atomic_load_n(&dumper_pid, __ATOMIC_RELAXED) == getpid()) goto out;
  struct sigaction old;
  /* a program that handles SIGUSR1 itself keeps it (td_debug_dump is its way to dump) */
  bool handle = sigaction(SIGUSR1, NULL, &old) == 0 &&
                (old.sa_handler == SIG_DFL || old.sa_handler == on_sigusr1);
  const char *pd = getenv("TD_FLIGHT_PROGRESS_DIR");
  if (pd && *pd && progress_fd < 0) {
    char pf[600];
    snprintf(pf, sizeof pf, "%s/.progress.%d", pd, (int)getpid());
    progress_fd = open(pf, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
  }
  if (!handle && progress_fd < 0) goto out;
  int p[2];
  if (pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) goto out;
  int fl = fcntl(p[0], F_GETFL);
  fcntl(p[0], F_SETFL, fl & ~O_NONBLOCK); /* the dumper blocks, the handler never does */
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  /* the thread inherits a mask with SIGUSR1 blocked, so the handler runs on another thread */
  sigset_t all, prev;
  sigemptyset(&all);
  sigaddset(&all, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &all, &prev);
  int rc = pthread_create(&th, &at, dumper_main, (void *)(intptr_t)p[0]);
  pthread_sigmask(SIG_SETMASK, &prev, NULL);
  pthread_attr_destroy(&at);
  if (rc != 0) {
    close(p[0]), close(p[1]);
    goto out;
  }
  /* a forked child's inherited pipe belonged to its parent's dumper: left as is (the parent's
   * thread does not exist here; closing its read end would only matter to that parent) */
  sig_pipe[0] = p[0];
  __atomic_store_n(&sig_pipe[1], p[1], __ATOMIC_RELAXED);
  __atomic_store_n(&dumper_pid, getpid(), __ATOMIC_RELEASE);
  if (!handle) goto out;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigusr1;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, NULL);
out:
  pthread_mutex_unlock(&meta_mu);
}

/* ---- public ---- */

td_status td_debug_dump(const char *reason) {
  char path[700];
  if (!flight_on())
    return td_set_error(TD_ERR_STATE, "debug_dump: the flight recorder is off (TD_FLIGHT=0)");
  td__flight_dump_path(path, sizeof path, true);
  if (td__flight_dump(reason ? reason : "td_debug_dump", true) != 0)
    return td_set_error(TD_ERR_IO, "debug_dump: cannot write %s: %s", path, strerror(errno));
  return TD_OK;
}

td_status td_debug_set_dump_dir(const char *dir) {
  TD_CHECK_ARG(!dir || strlen(dir) < sizeof dump_dir, "debug_set_dump_dir: path too long");
  pthread_mutex_lock(&meta_mu);
  snprintf(dump_dir, sizeof dump_dir, "%s", dir ? dir : "");
  pthread_mutex_unlock(&meta_mu);
  return TD_OK;
}
