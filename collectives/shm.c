/* shm.c - the same-host shared-memory transport of CPU process groups: deciding whether it
 * applies, the segment, and the round protocol's post / wait with liveness and deadlines.
 *
 * Setup (td__shm_setup, collective, at group creation, after the ring is connected):
 *   1. Every member publishes "pg/<id>/host/<rank>" = its same-host record (core/samehost.h,
 *      the probe the RPC layer's direct copy uses too: pid, a random nonce and its address, boot
 *      id, pid namespace, the host part of its RPC address; "-" when it cannot or must not share
 *      memory, e.g. TD_COLL_ALGO=ring). Shared memory is used only when every member's record
 *      names this host, boot and pid namespace; single-copy reads only when every member could
 *      read every other's nonce with process_vm_readv.
 *   2. Group rank 0 creates a POSIX shm segment with a random name (O_EXCL, mode 0600), sizes and
 *      initialises it, and publishes the name under "pg/<id>/shm". The others map it and check
 *      its header. Everyone publishes "pg/<id>/shmok/<rank>" = 1 or 0 and reads all of them: the
 *      group uses the segment only if every member mapped it (all decide alike), and each member
 *      unlinks the name as soon as it has seen every answer, so nothing is left in /dev/shm once
 *      creation is over, even if a process dies later.
 *
 * Waiting: a member polls, calling sched_yield() between looks, for up to yield_ns (default
 * YIELD_US_DEFAULT), then sleeps on a futex word in the segment (`bell`); a post bumps the bell
 * and wakes sleepers only when `sleepers` says there are any, so while everyone is awake no
 * wake-up system call is made. Yielding hands the CPU to whoever is runnable - often the member
 * being waited for when members share CPUs, with other processes or with each other - and costs
 * little when nobody is (measured with bench/collectives on 2 CPUs: 4 KiB all_reduce with 4
 * processes 32 us with futex sleeps at once, 5 us yielding first; with 2 processes and another
 * program busy on the host, busy-waiting 50 us before yielding took 50-90 us per call against
 * 1-2 us yielding at once). Before yielding, a member spins (pause instructions, no system
 * call) for up to SPIN_ADAPT_NS when the members do not outnumber the host's CPUs, adaptively: a
 * wait that outlasts its spin (the member waited for is busy, or descheduled) makes the next 1,
 * 2, 4, ... up to SKIP_MAX waits yield at once, and a wait that ends while spinning resets that,
 * so back-to-back small collectives stay in the spin (a sched_yield is a system call, 0.3-1 us
 * in a VM) while a member that waits for others' compute, or shares its CPU, gives the CPU up
 * almost at once. Measured with bench/collectives, 2 processes on 2 CPUs, 4 KiB: all_gather 4.2
 * -> 1.3 us, reduce_scatter 2.2 -> 1.5, all_reduce 2.6 -> 2.0, broadcast 1.5 -> 1.2 (yielding
 * at once before; Open MPI's shared memory 1.4, 1.5, 2.9, 4.2 in the same runs). Crowded
 * groups (more members than CPUs) never spin. TD_COLL_SPIN_US fixes the spin (0: never) and
 * TD_COLL_YIELD_US the yielding. Lost wake-ups are excluded by the order
 * of the sequentially consistent operations: a poster stores its round then reads `sleepers`; a
 * sleeper increments `sleepers`, reads the bell, re-reads the round, then futex-waits on the bell
 * value it read.
 *
 * Liveness: a waiter checks every few milliseconds (and after each futex timeout) that the
 * members it waits for still run (pidfd when available, else kill(pid, 0) and /proc state) and
 * that no member marked the group failed (`failed`, set by td__pg_fail after it recorded the
 * reason in the store, so the others report that root cause; its value, 2 + the member it
 * blamed, names that member when the store is gone with its host). At the deadline the message
 * names every member that has not posted the round, with the operation it is in.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "shm_impl.h"
#include "../core/netaddr.h"
#include "../core/samehost.h"

#define SEG_MAGIC 0x54445348u /* "TDSH" */
#define SEG_VERSION 1u
#define SPIN_ADAPT_NS 5000 /* the most an adaptive spin lasts */
#define SKIP_MAX 256        /* the most waits that yield at once after a spin that failed */
#define YIELD_US_DEFAULT 200
#define LIVENESS_NS 2000000ull  /* how often a waiter checks processes and the failed flag */
#define SLEEP_SLICE_NS 20000000ll /* longest futex sleep between checks */
#define BUF_MAX ((size_t)1 << 20)
#define BUF_MIN ((size_t)64 << 10)
#define SEG_BUFS_MAX ((size_t)64 << 20) /* all members' round buffers together, at most */

typedef struct shm_member {
  _Alignas(64) _Atomic uint64_t round; /* last round posted */
  _Alignas(64) td__op_hdr hdr[2];      /* header of the operation that started in a round of
                                           this parity */
  uint64_t hdr_round[2];               /* ... and that round */
  uint64_t addr[2][2];                 /* buffers exposed to single-copy reads by that
                                           operation (td__shm_expose) */
  _Atomic uint64_t cur_seq;            /* the operation this member is in (for messages) */
  _Atomic uint32_t cur_kind;
  int32_t pid;
} shm_member;

typedef struct shm_seg {
  uint32_t magic, version;
  uint64_t group_id;
  int32_t size;
  int32_t crowded;      /* group rank 0 saw more members than CPUs (so all choose alike) */
  uint64_t buf_bytes;   /* one member's buffer for one round */
  uint64_t data_offset; /* of the first buffer, from the segment start */
  uint64_t total_bytes;
  _Alignas(64) _Atomic uint32_t bell;
  _Atomic uint32_t sleepers;
  _Atomic uint32_t failed;
  _Alignas(64) shm_member m[];
} shm_seg;

struct td__shm {
  shm_seg *seg;
  size_t len;
  char *data;
  size_t buf_bytes;
  int n, me;
  uint64_t round; /* rounds posted by this member */
  int *pid;       /* per member */
  int *pidfd;     /* per member, -1 when unavailable (then kill + /proc) */
  int64_t spin_ns;  /* how long a wait spins (adaptive: the most) */
  bool spin_adapt;  /* spinning adapts (TD_COLL_SPIN_US unset, members <= CPUs) */
  uint32_t skip, skip_len; /* adaptive: waits left that do not spin; the next such run */
  int64_t yield_ns; /* after spinning, sched_yield() for this long before sleeping */
  bool cma;         /* every member can read every other's memory (process_vm_readv) */
  bool crowded;     /* more members than CPUs on this host */
  uint64_t nonce;   /* the others read it from our memory to prove they can */
};

/* ---- small helpers ---- */

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static long futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

size_t td__shm_buf_bytes(const td__shm *s) { return s->buf_bytes; }
uint64_t td__shm_next_round(const td__shm *s) { return s->round + 1; }

char *td__shm_buf(const td__shm *s, int m, uint64_t k) {
  return s->data + ((size_t)m * 2 + (size_t)(k & 1)) * s->buf_bytes;
}

void td__shm_put_header(td__shm *s, uint64_t k, const td__op_hdr *h) {
  shm_member *me = &s->seg->m[s->me];
  me->hdr[k & 1] = *h;
  me->hdr_round[k & 1] = k;
  atomic_store_explicit(&me->cur_seq, h->seq, memory_order_relaxed);
  atomic_store_explicit(&me->cur_kind, h->kind, memory_order_relaxed);
}

bool td__shm_cma(const td__shm *s) { return s->cma; }

void td__shm_expose(td__shm *s, uint64_t k, const void *a, const void *b) {
  shm_member *me = &s->seg->m[s->me];
  me->addr[k & 1][0] = (uint64_t)(uintptr_t)a;
  me->addr[k & 1][1] = (uint64_t)(uintptr_t)b;
}

const char *td__shm_exposed(const td__shm *s, int m, uint64_t k, int i) {
  return (const char *)(uintptr_t)s->seg->m[m].addr[k & 1][i];
}

td_status td__shm_read(td_process_group *pg, int m, void *dst, const char *src, size_t n,
                       const td__op_hdr *h) {
  td__shm *s = pg->shm;
  size_t done = 0;
  while (done < n) {
    struct iovec l = {(char *)dst + done, n - done}, r = {(char *)src + done, n - done};
    ssize_t k = process_vm_readv(s->pid[m], &l, 1, &r, 1, 0);
    if (k > 0) {
      done += (size_t)k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    char desc[160], me[160], who[160], msg[700];
    td__op_describe(h, desc, sizeof desc);
    snprintf(msg, sizeof msg, "%s: cannot read the memory of %s (pid %d): %s (seen by %s)", desc,
             td__pg_who(pg, m, who, sizeof who), s->pid[m], k < 0 ? strerror(errno) : "no data",
             td__pg_who(pg, pg->rank, me, sizeof me));
    bool gone = k < 0 && errno == ESRCH;
    return td__pg_fail_member(pg, gone ? TD_ERR_UNAVAILABLE : TD_ERR_IO, gone ? m : -1, msg);
  }
  return TD_OK;
}

void td__shm_post(td__shm *s, uint64_t k) {
  s->round = k;
  atomic_store(&s->seg->m[s->me].round, k); /* seq_cst: ordered before the sleepers load */
  if (atomic_load(&s->seg->sleepers)) {
    atomic_fetch_add(&s->seg->bell, 1);
    futex(&s->seg->bell, FUTEX_WAKE, INT_MAX, NULL);
  }
}

void td__shm_fail(td_process_group *pg) {
  td__shm *s = pg->shm;
  if (!s) return;
  /* 1, or the member blamed + 2; the first failure's stays */
  int c = pg->fail_culprit;
  uint32_t zero = 0, v = c >= 0 && c < s->n ? (uint32_t)c + 2 : 1;
  atomic_compare_exchange_strong(&s->seg->failed, &zero, v);
  atomic_fetch_add(&s->seg->bell, 1);
  futex(&s->seg->bell, FUTEX_WAKE, INT_MAX, NULL);
}

/* ---- liveness and failure ---- */

static bool member_alive(const td__shm *s, int m) {
  if (s->pidfd[m] >= 0) {
    struct pollfd p = {s->pidfd[m], POLLIN, 0};
    return poll(&p, 1, 0) == 0; /* readable: the process exited */
  }
  return td__pid_alive(s->pid[m]);
}

int td__shm_member_alive(td_process_group *pg, int m) {
  const td__shm *s = pg->shm;
  if (!s || m < 0 || m >= s->n) return -1;
  return m == s->me || member_alive(s, m) ? 1 : 0;
}

static bool arrived(const td__shm *s, int m, uint64_t k) {
  return atomic_load_explicit(&s->seg->m[m].round, memory_order_acquire) >= k;
}

static bool all_arrived(const td__shm *s, uint64_t k, int who) {
  if (who >= 0) return arrived(s, who, k);
  for (int m = 0; m < s->n; m++)
    if (!arrived(s, m, k)) return false;
  return true;
}

/* What member m is doing, for messages: "it is in barrier (#6)". */
static void member_state(const td__shm *s, int m, char *buf, size_t n) {
  const shm_member *x = &s->seg->m[m];
  uint64_t seq = atomic_load_explicit(&x->cur_seq, memory_order_relaxed);
  uint32_t kind = atomic_load_explicit(&x->cur_kind, memory_order_relaxed);
  if (!seq) snprintf(buf, n, "it has not called any collective on this group yet");
  else snprintf(buf, n, "its latest collective is %s (#%llu)", td__kind_name(kind),
                (unsigned long long)seq);
}

static td_status fail_timeout(td_process_group *pg, uint64_t k, int who, const td__op_hdr *h) {
  td__shm *s = pg->shm;
  char desc[160], me[160], who_s[160], state[96], msg[1400];
  td__op_describe(h, desc, sizeof desc);
  size_t len = (size_t)snprintf(msg, sizeof msg, "%s timed out after %lld ms: ", desc,
                                (long long)pg->timeout_ms);
  int missing = 0;
  for (int m = 0; m < s->n && len < sizeof msg; m++) {
    if ((who >= 0 && m != who) || arrived(s, m, k)) continue;
    member_state(s, m, state, sizeof state);
    len += (size_t)snprintf(msg + len, sizeof msg - len, "%s%s did not arrive (%s)",
                            missing++ ? "; " : "", td__pg_who(pg, m, who_s, sizeof who_s), state);
  }
  if (len < sizeof msg)
    snprintf(msg + len, sizeof msg - len, " (seen by %s)", td__pg_who(pg, pg->rank, me, sizeof me));
  return td__pg_fail(pg, TD_ERR_TIMEOUT, msg);
}

/* Checks the processes being waited for and the failed flag. */
static td_status check_health(td_process_group *pg, uint64_t k, int who, const td__op_hdr *h) {
  td__shm *s = pg->shm;
  char desc[160], me[160], who_s[160], msg[700];
  uint32_t f = atomic_load(&s->seg->failed);
  if (f) {
    td__op_describe(h, desc, sizeof desc);
    /* the member the failing one blamed (a member's word: bounded), so every survivor's error
     * names who is gone even when the store, which holds the first failure's record, went with
     * its host (the member that failed the group may have exited since) */
    int c = f >= 2 && f - 2 < (uint32_t)s->n ? (int)(f - 2) : -1;
    if (c >= 0 && c != s->me) {
      snprintf(msg, sizeof msg, "%s is unavailable: another member lost it and failed the group "
               "(seen by %s during %s)", td__pg_who(pg, c, who_s, sizeof who_s),
               td__pg_who(pg, pg->rank, me, sizeof me), desc);
      return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, c, msg);
    }
    snprintf(msg, sizeof msg, "another member failed the group during %s (seen by %s)", desc,
             td__pg_who(pg, pg->rank, me, sizeof me));
    return td__pg_fail(pg, TD_ERR_UNAVAILABLE, msg);
  }
  for (int m = 0; m < s->n; m++) {
    if (m == s->me || (who >= 0 && m != who) || arrived(s, m, k) || member_alive(s, m)) continue;
    td__op_describe(h, desc, sizeof desc);
    snprintf(msg, sizeof msg, "%s is unavailable: its process (pid %d) exited (seen by %s "
             "during %s)", td__pg_who(pg, m, who_s, sizeof who_s), s->pid[m],
             td__pg_who(pg, pg->rank, me, sizeof me), desc);
    return td__pg_fail_member(pg, TD_ERR_UNAVAILABLE, m, msg);
  }
  return TD_OK;
}

/* ---- waiting ---- */

static void sleep_on_bell(td__shm *s, uint64_t k, int who, uint64_t until_ns) {
  atomic_fetch_add(&s->seg->sleepers, 1);
  uint32_t v = atomic_load(&s->seg->bell);
  if (!all_arrived(s, k, who) && !atomic_load(&s->seg->failed)) {
    uint64_t now = td__now_ns();
    int64_t ns = until_ns > now ? (int64_t)(until_ns - now) : 0;
    if (ns > SLEEP_SLICE_NS) ns = SLEEP_SLICE_NS;
    struct timespec ts = {ns / 1000000000ll, ns % 1000000000ll};
    if (ns > 0) futex(&s->seg->bell, FUTEX_WAIT, v, &ts);
  }
  atomic_fetch_sub(&s->seg->sleepers, 1);
}

td_status td__shm_wait(td_process_group *pg, uint64_t k, int who, const td__op_hdr *h,
                       uint64_t dl) {
  td__shm *s = pg->shm;
  /* a group another member failed fails here even when everyone had posted already */
  if (atomic_load_explicit(&s->seg->failed, memory_order_relaxed))
    return check_health(pg, k, who, h);
  if (all_arrived(s, k, who)) return TD_OK;
  uint64_t now = td__now_ns(), next_check = now + LIVENESS_NS;
  int64_t spin = s->spin_ns;
  if (s->spin_adapt && s->skip) {
    s->skip--;
    spin = 0;
  }
  uint64_t spin_until = now + (uint64_t)spin;
  bool spun_out = false;
  for (;;) {
    if (all_arrived(s, k, who)) {
      if (s->spin_adapt && spin && !spun_out) s->skip_len = 1; /* the spin paid off */
      return TD_OK;
    }
    now = td__now_ns();
    if (now >= next_check || now >= dl) {
      if (now >= dl) return fail_timeout(pg, k, who, h);
      TD_TRY(check_health(pg, k, who, h));
      next_check = now + LIVENESS_NS;
    }
    if (now < spin_until) {
      for (int i = 0; i < 32 && !all_arrived(s, k, who); i++) cpu_relax();
      continue;
    }
    if (spin && !spun_out && s->spin_adapt) { /* it did not: yield at once for a while */
      spun_out = true;
      s->skip = s->skip_len;
      s->skip_len = s->skip_len < SKIP_MAX ? s->skip_len * 2 : SKIP_MAX;
    }
    if (now < spin_until + (uint64_t)s->yield_ns) {
      sched_yield();
      continue;
    }
    sleep_on_bell(s, k, who, next_check < dl ? next_check : dl);
  }
}

td_status td__shm_reuse(td_process_group *pg, uint64_t k, const td__op_hdr *h, uint64_t dl) {
  return k > 1 ? td__shm_wait(pg, k - 1, -1, h, dl) : TD_OK;
}

td_status td__shm_check_headers(td_process_group *pg, uint64_t k, const td__op_hdr *h) {
  td__shm *s = pg->shm;
  for (int m = 0; m < s->n; m++) {
    const shm_member *x = &s->seg->m[m];
    td__op_hdr theirs = x->hdr[k & 1];
    bool same_round = x->hdr_round[k & 1] == k;
    if (same_round && memcmp(&theirs, h, sizeof theirs) == 0) continue;
    if (!same_round) theirs.magic = 0; /* out of step: another round, described as unreadable */
    return td__op_mismatch(pg, h, m, &theirs);
  }
  return TD_OK;
}

/* ---- setup ---- */

/* This member's same-host record (core/samehost.h), or "-" when it cannot make one. Published
 * with TD_COLL_ALGO=ring too: the ring then does not share memory, but learns which members run
 * on this host and their pids (pg->host_pid, the ring's member_alive). */
static void my_record(td_process_group *pg, const td__shm *s, char *buf, size_t n) {
  td_worker_info wi;
  char host[256] = "";
  if (td_rpc_self(pg->agent, &wi) == TD_OK) td__addr_host(wi.address, host, sizeof host);
  if (!host[0]) snprintf(buf, n, "-");
  else td__samehost_record(host, &s->nonce, buf, n);
}

static td_status store_wait(td_process_group *pg, const char *suffix, uint64_t deadline,
                            const char *what, uint8_t **v) {
  char key[96];
  td_status st = td__store_wait_key(pg->sc, td__pg_key(pg, suffix, key, sizeof key), deadline,
                                    NULL, v, NULL);
  if (st == TD_ERR_TIMEOUT)
    return td_set_error(TD_ERR_TIMEOUT, "process_group_create: timed out waiting for %s", what);
  return st;
}

static td_status store_put(td_process_group *pg, const char *suffix, const char *v) {
  char key[96];
  return td__store_set(pg->sc, td__pg_key(pg, suffix, key, sizeof key), v, strlen(v));
}

/* Publishes our record and reads everyone's: *same is true when every member shares this host,
 * boot and pid namespace (s->pid[m] gets member m's pid then); *cma when this member could also
 * read every other member's memory (TD_COLL_CMA=0 turns that off). */
static td_status exchange_records(td_process_group *pg, td__shm *s, uint64_t deadline,
                                  bool *same, bool *cma) {
  char mine[400], suffix[48], what[200], who[160];
  my_record(pg, s, mine, sizeof mine);
  snprintf(suffix, sizeof suffix, "host/%d", pg->rank);
  TD_TRY(store_put(pg, suffix, mine));
  td__host_rec me;
  const char *e = getenv("TD_COLL_CMA");
  bool have_me = td__samehost_parse(mine, &me);
  *same = have_me && pg->mode != TD__MODE_RING;
  *cma = !(e && strcmp(e, "0") == 0);
  for (int m = 0; m < pg->size; m++) {
    uint8_t *v = NULL;
    snprintf(suffix, sizeof suffix, "host/%d", m);
    snprintf(what, sizeof what, "%s to describe its host", td__pg_who(pg, m, who, sizeof who));
    TD_TRY(store_wait(pg, suffix, deadline, what, &v));
    td__host_rec peer;
    bool here = have_me && td__samehost_parse((char *)v, &peer) && td__samehost_same(&me, &peer);
    if (pg->host_pid && m != pg->rank) pg->host_pid[m] = here ? peer.pid : 0;
    if (!*same || !here)
      *same = false;
    else if (m != pg->rank && *cma && !td__samehost_readable(&peer))
      *cma = false;
    s->pid[m] = *same ? peer.pid : 0;
    td__free(v);
  }
  return TD_OK;
}

static size_t layout(int n, size_t buf, size_t *data_offset) {
  size_t ctl = sizeof(shm_seg) + (size_t)n * sizeof(shm_member);
  *data_offset = (ctl + 4095) / 4096 * 4096;
  return *data_offset + 2 * (size_t)n * buf;
}

static size_t choose_buf_bytes(int n) {
  size_t b = SEG_BUFS_MAX / (2 * (size_t)n);
  b = b > BUF_MAX ? BUF_MAX : b < BUF_MIN ? BUF_MIN : b;
  const char *e = getenv("TD_COLL_SHM_BUF");
  if (e && *e) {
    unsigned long long v = strtoull(e, NULL, 10);
    if (v >= 4096 && v <= ((unsigned long long)1 << 30)) b = (size_t)v;
  }
  return b / 4096 * 4096;
}

static bool name_ok(const char *name) {
  if (strncmp(name, "/tdist-", 7) != 0 || strlen(name) > 64) return false;
  return strspn(name + 7, "0123456789abcdef-") == strlen(name + 7);
}

static int cpus_available(void) {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

/* Group rank 0: creates and initialises the segment; *name gets its name ("-" on failure). */
static void create_segment(td_process_group *pg, td__shm *s, char *name, size_t name_n) {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) r = td__now_ns() ^ (uint64_t)getpid() << 20;
  snprintf(name, name_n, "/tdist-%d-%016llx", (int)getpid(), (unsigned long long)r);
  size_t off, buf = choose_buf_bytes(pg->size), len = layout(pg->size, buf, &off);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  void *p = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)len) == 0)
    p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) {
    td_log(TD_LOG_INFO, "process group %llu: no shared memory (%s: %s); using the TCP ring",
           (unsigned long long)pg->id, name, strerror(errno));
    if (fd >= 0) shm_unlink(name);
    snprintf(name, name_n, "-");
    return;
  }
  shm_seg *seg = p;
  seg->magic = SEG_MAGIC;
  seg->version = SEG_VERSION;
  seg->group_id = pg->id;
  seg->size = pg->size;
  seg->buf_bytes = buf;
  seg->crowded = pg->size > cpus_available();
  seg->data_offset = off;
  seg->total_bytes = len;
  s->seg = seg;
  s->len = len;
}

/* The other members: maps and checks the segment named name. */
static bool map_segment(td_process_group *pg, td__shm *s, const char *name) {
  if (!name_ok(name)) return false;
  int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return false;
  struct stat stt;
  void *p = MAP_FAILED;
  if (fstat(fd, &stt) == 0 && (size_t)stt.st_size >= sizeof(shm_seg))
    p = mmap(NULL, (size_t)stt.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return false;
  shm_seg *seg = p;
  size_t off = 0, len = seg->buf_bytes >= 4096 && seg->buf_bytes <= ((size_t)1 << 30)
                            ? layout(pg->size, seg->buf_bytes, &off) : 0;
  if (seg->magic != SEG_MAGIC || seg->version != SEG_VERSION || seg->group_id != pg->id ||
      seg->size != pg->size || !len || seg->data_offset != off || seg->total_bytes != len ||
      (size_t)stt.st_size != len) {
    munmap(p, (size_t)stt.st_size);
    return false;
  }
  s->seg = seg;
  s->len = len;
  return true;
}

static int64_t env_us(const char *name, int64_t dflt) {
  const char *e = getenv(name);
  return (e && *e ? strtoll(e, NULL, 10) : dflt) * 1000;
}

static void open_pidfds(td__shm *s) {
  for (int m = 0; m < s->n; m++) {
    s->pidfd[m] = -1;
#ifdef SYS_pidfd_open
    if (m != s->me) s->pidfd[m] = (int)syscall(SYS_pidfd_open, s->pid[m], 0);
#endif
    if (s->pidfd[m] >= 0) fcntl(s->pidfd[m], F_SETFD, FD_CLOEXEC);
  }
}

/* The segment, everyone's answer ("0": not mapped, "1": mapped, "2": mapped and every other
 * member's memory readable), the unlink. */
static td_status share_segment(td_process_group *pg, td__shm *s, uint64_t deadline, bool cma,
                               bool *ok) {
  char name[96] = "-", suffix[48], what[200], who[160];
  td_status st = TD_OK;
  if (pg->rank == 0) {
    create_segment(pg, s, name, sizeof name);
    st = store_put(pg, "shm", name);
  } else {
    uint8_t *v = NULL;
    snprintf(what, sizeof what, "%s to share memory", td__pg_who(pg, 0, who, sizeof who));
    st = store_wait(pg, "shm", deadline, what, &v);
    if (st == TD_OK) {
      snprintf(name, sizeof name, "%s", (char *)v);
      if (strcmp(name, "-") != 0 && !map_segment(pg, s, name))
        td_log(TD_LOG_INFO, "process group %llu: cannot map %s (%s); using the TCP ring",
               (unsigned long long)pg->id, name, strerror(errno));
    }
    td__free(v);
  }
  snprintf(suffix, sizeof suffix, "shmok/%d", pg->rank);
  if (st == TD_OK) st = store_put(pg, suffix, !s->seg ? "0" : cma ? "2" : "1");
  *ok = true;
  s->cma = true;
  for (int m = 0; st == TD_OK && m < pg->size; m++) {
    uint8_t *v = NULL;
    snprintf(suffix, sizeof suffix, "shmok/%d", m);
    snprintf(what, sizeof what, "%s to map shared memory", td__pg_who(pg, m, who, sizeof who));
    st = store_wait(pg, suffix, deadline, what, &v);
    if (st == TD_OK && strcmp((char *)v, "1") != 0 && strcmp((char *)v, "2") != 0) *ok = false;
    if (st == TD_OK && strcmp((char *)v, "2") != 0) s->cma = false;
    td__free(v);
  }
  if (name_ok(name)) shm_unlink(name); /* every member tries; the first one removes it */
  return st;
}

static void shm_free(td__shm *s);

td_status td__shm_setup(td_process_group *pg, uint64_t deadline, bool *serves) {
  *serves = false;
  if (pg->backend != TD_PG_BACKEND_CPU || pg->size < 2) return TD_OK;
  td__shm *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  s->n = pg->size;
  s->me = pg->rank;
  if (!pg->host_pid) pg->host_pid = td__calloc((size_t)pg->size, sizeof *pg->host_pid);
  s->pid = td__calloc((size_t)s->n, sizeof *s->pid);
  s->pidfd = td__calloc((size_t)s->n, sizeof *s->pidfd);
  for (int m = 0; s->pidfd && m < s->n; m++) s->pidfd[m] = -1;
  bool same = false, ok = false, cma = false;
  s->nonce = td__samehost_nonce(s);
  td_status st = s->pid && s->pidfd ? TD_OK
                                    : td_set_error(TD_ERR_NOMEM, "process_group_create: out of memory");
  if (st == TD_OK) st = exchange_records(pg, s, deadline, &same, &cma);
  if (st == TD_OK && same) st = share_segment(pg, s, deadline, cma, &ok);
  if (st == TD_OK && !ok && pg->mode >= TD__MODE_SHM)
    st = td_set_error(TD_ERR_UNSUPPORTED, "process_group_create: TD_COLL_ALGO asks for shared "
                      "memory, but %s", same ? "not every member could map the segment"
                                             : "the members are not all on this host");
  if (st != TD_OK || !ok) {
    shm_free(s);
    return st;
  }
  s->buf_bytes = s->seg->buf_bytes;
  s->data = (char *)s->seg + s->seg->data_offset;
  s->seg->m[s->me].pid = (int32_t)getpid();
  s->crowded = s->seg->crowded != 0;
  const char *spin_env = getenv("TD_COLL_SPIN_US");
  s->spin_adapt = !(spin_env && *spin_env) && !s->crowded;
  s->spin_ns = s->spin_adapt ? SPIN_ADAPT_NS : env_us("TD_COLL_SPIN_US", 0);
  s->skip_len = 1;
  s->yield_ns = env_us("TD_COLL_YIELD_US", YIELD_US_DEFAULT);
  open_pidfds(s);
  pg->shm = s;
  pg->shm_buf_bytes = s->buf_bytes;
  pg->shm_crowded = s->crowded;
  *serves = true;
  td_log(TD_LOG_DEBUG, "process group %llu: shared memory, %zu-byte round buffers, spin %lld us, "
         "single-copy reads %s", (unsigned long long)pg->id, s->buf_bytes,
         (long long)(s->spin_ns / 1000), s->cma ? "on" : "off");
  return TD_OK;
}

void td__shm_destroy(td_process_group *pg) {
  shm_free(pg->shm);
  pg->shm = NULL;
}

static void shm_free(td__shm *s) {
  if (!s) return;
  if (s->seg) munmap(s->seg, s->len);
  for (int m = 0; s->pidfd && m < s->n; m++)
    if (s->pidfd[m] >= 0) close(s->pidfd[m]);
  td__free(s->pidfd);
  td__free(s->pid);
  td__free(s);
}
