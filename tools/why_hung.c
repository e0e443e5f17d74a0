/* why_hung.c - `tdist-trace why-hung DIR`: reads the flight recorder dumps of a job's workers
 * (DIR/<worker>.flight, written by core/flight.c) and says in plain words what holds the job.
 *
 * It prints, per worker, what each of its threads waits in (the dump's open records, outermost
 * first, with how long on the worker's clock), then the root causes it finds, each on a line
 * starting "culprit: ":
 *   - collectives: for each group with a member inside an operation, the members that never
 *     entered that operation (their last one on the group, and what they wait in instead; a member
 *     without a dump is called dead or stopped) and the members that entered it with another kind,
 *     size or dtype than the majority (a mismatch);
 *   - RPC waits: from each thread waiting on a call, the chain caller -> callee's handler -> what
 *     that handler waits on, through calls received but queued behind busy handler threads, until
 *     a thread that waits on nothing tdist records, a worker without a dump, or a cycle.
 * Dump times are put on rank 0's clock with each worker's offset (as `merge` does).
 *
 * Plain C, no library: it relies on the dump's line format ("key value" header lines, then
 * "open"/"ev" records: tag depth ts tid kind peer a b c x y name) and on the numbering of dtypes
 * (tdist/tensor.h) and algorithms (collectives/coll_impl.h), mirrored in the tables below.
 *
 * Exit status: 0 report printed, 1 no readable dump, 2 usage.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "why_hung.h"

#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { K_NONE, K_COLL_ENTER, K_COLL_EXIT, K_RPC_SEND, K_RPC_DONE, K_RPC_RECV, K_HANDLER_START,
       K_HANDLER_END, K_WAIT_BEGIN, K_WAIT_END, K_DUMP, K_SCOPE_BEGIN, K_SCOPE_END, K_RREF_FORK,
       K_RREF_CONFIRM, K_RREF_DELETE, K_BWD_SEND, K_BWD_RECV, K_COUNT };
static const char *const kind_words[K_COUNT] = {
    "none",        "coll_enter",   "coll_exit",   "rpc_send",  "rpc_done",    "rpc_recv",
    "handler_start", "handler_end", "wait_begin", "wait_end",  "dump",        "scope_begin",
    "scope_end",   "rref_fork",    "rref_confirm", "rref_delete", "bwd_send", "bwd_recv"};
/* subjects (a record's y where its kind has one; the id in b), and the statuses (tdist/status.h)
 * a call can end with */
enum { SUBJ_NONE, SUBJ_RREF, SUBJ_CTX };
enum { ST_OK = 0, ST_TIMEOUT = 9, ST_UNAVAILABLE = 14 };
static const char *const dtype_names[] = {"float32", "float64", "int64",  "float16",
                                          "bfloat16", "int32",   "uint8", "bool"};
static const char *const algo_names[] = {
    "local", "nccl", "ring", "shm_direct", "shm_rsag", "shm_bcast", "shm_gather",
    "shm_scatter", "shm_barrier", "cma_rsag", "cma_bcast", "cma_gather", "cma_scatter"};

typedef struct rec {
  unsigned long long ts, a, b;
  int tid, kind, peer, depth;
  unsigned c, x, y;
  char name[40];
} rec;

typedef struct group {
  unsigned long long id;
  int size, grank;
  int *ranks;
} group;

typedef struct dump {
  char path[1100];
  int rank, world, pid;
  char name[160];
  long long offset;
  unsigned long long now;
  char reason[600];
  int pool; /* handler threads of its agent (0: unknown) */
  char (*wnames)[160]; /* world names, when the dump lists them */
  int nwnames;
  group *groups;
  int ngroups;
  rec *open, *ev;
  int nopen, nev;
} dump;

typedef struct job {
  const char *dir;
  dump *d;
  int n, world;
  char (*names)[160]; /* by rank, from any dump */
  unsigned long long t0; /* the earliest dump time on rank 0's clock: "+s" times count from it */
} job;

/* ---- reading ---- */

static int kind_of(const char *w) {
  for (int k = 0; k < K_COUNT; k++)
    if (strcmp(w, kind_words[k]) == 0) return k;
  return K_NONE;
}

static int push(void **arr, int *n, size_t size) {
  if ((*n & (*n - 1)) == 0) { /* capacity doubles at powers of two */
    void *p = realloc(*arr, (size_t)(*n ? *n * 2 : 1) * size);
    if (!p) return -1;
    *arr = p;
  }
  return (*n)++;
}

static int read_rec(const char *line, dump *d) {
  rec r;
  char tag[8], kind[32];
  memset(&r, 0, sizeof r);
  if (sscanf(line, "%7s %d %llu %d %31s %d %llu %llu %u %u %u %39s", tag, &r.depth, &r.ts, &r.tid,
             kind, &r.peer, &r.a, &r.b, &r.c, &r.x, &r.y, r.name) != 12)
    return -1;
  r.kind = kind_of(kind);
  bool is_open = strcmp(tag, "open") == 0;
  int i = is_open ? push((void **)&d->open, &d->nopen, sizeof r)
                  : push((void **)&d->ev, &d->nev, sizeof r);
  if (i < 0) return -1;
  (is_open ? d->open : d->ev)[i] = r;
  return 0;
}

static int read_group(const char *line, dump *d) {
  group g = {0};
  int off = 0;
  if (sscanf(line, "group %llu %d %d%n", &g.id, &g.size, &g.grank, &off) != 3 || g.size <= 0 ||
      g.size > 1 << 20)
    return -1;
  g.ranks = calloc((size_t)g.size, sizeof *g.ranks);
  if (!g.ranks) return -1;
  const char *p = line + off;
  for (int k = 0; k < g.size; k++) {
    int used = 0;
    if (sscanf(p, "%d%n", &g.ranks[k], &used) != 1) return free(g.ranks), -1;
    p += used;
  }
  int i = push((void **)&d->groups, &d->ngroups, sizeof g);
  if (i < 0) return free(g.ranks), -1;
  d->groups[i] = g;
  return 0;
}

static int read_header(const char *line, dump *d) {
  int r;
  char w[160];
  if (sscanf(line, "rank %d", &d->rank) == 1) return 0;
  if (sscanf(line, "world %d", &d->world) == 1) return 0;
  if (sscanf(line, "pid %d", &d->pid) == 1) return 0;
  if (sscanf(line, "name %159s", d->name) == 1) return 0;
  if (sscanf(line, "clock_offset_ns %lld", &d->offset) == 1) return 0;
  if (sscanf(line, "now_ns %llu", &d->now) == 1) return 0;
  if (sscanf(line, "pool %d", &d->pool) == 1) return 0;
  if (strncmp(line, "reason ", 7) == 0) {
    snprintf(d->reason, sizeof d->reason, "%.*s", (int)sizeof d->reason - 1, line + 7);
    d->reason[strcspn(d->reason, "\n")] = 0;
    return 0;
  }
  if (sscanf(line, "worker %d %159s", &r, w) == 2) {
    if (r < 0 || r > 1 << 20) return -1;
    if (r >= d->nwnames) {
      void *p = realloc(d->wnames, (size_t)(r + 1) * sizeof *d->wnames);
      if (!p) return -1;
      d->wnames = p;
      for (int k = d->nwnames; k <= r; k++) d->wnames[k][0] = 0;
      d->nwnames = r + 1;
    }
    snprintf(d->wnames[r], sizeof d->wnames[r], "%s", w);
  }
  return 0;
}

/* Reads one dump; -1 when it is not a complete one (no "end" line). */
static int read_dump(dump *d) {
  FILE *f = fopen(d->path, "r");
  if (!f) return -1;
  char line[2048];
  int rc = -1;
  d->rank = -1;
  if (!fgets(line, sizeof line, f) || strncmp(line, "tdist-flight 1", 14) != 0) goto out;
  while (fgets(line, sizeof line, f)) {
    if (strcmp(line, "end\n") == 0) {
      rc = 0;
      break;
    }
    int st = strncmp(line, "open ", 5) == 0 || strncmp(line, "ev ", 3) == 0 ? read_rec(line, d)
             : strncmp(line, "group ", 6) == 0                              ? read_group(line, d)
                                                                            : read_header(line, d);
    if (st != 0) break;
  }
out:
  fclose(f);
  return rc;
}

static int load(const char *dir, job *j) {
  DIR *dd = opendir(dir);
  if (!dd) {
    fprintf(stderr, "tdist-trace: cannot open %s: %s\n", dir, strerror(errno));
    return -1;
  }
  struct dirent *e;
  while ((e = readdir(dd))) {
    size_t l = strlen(e->d_name);
    if (l < 8 || strcmp(e->d_name + l - 7, ".flight") != 0 || e->d_name[0] == '.') continue;
    dump d;
    memset(&d, 0, sizeof d);
    snprintf(d.path, sizeof d.path, "%s/%s", dir, e->d_name);
    if (read_dump(&d) != 0) {
      fprintf(stderr, "tdist-trace: %s is not a complete flight dump (skipped)\n", d.path);
      continue;
    }
    int i = push((void **)&j->d, &j->n, sizeof d);
    if (i < 0) break;
    j->d[i] = d;
  }
  closedir(dd);
  for (int i = 0; i < j->n; i++)
    if (j->d[i].world > j->world) j->world = j->d[i].world;
  j->names = calloc((size_t)(j->world > 0 ? j->world : 1), sizeof *j->names);
  for (int i = 0; j->names && i < j->n; i++) {
    dump *d = &j->d[i];
    for (int r = 0; r < d->nwnames && r < j->world; r++)
      if (d->wnames[r][0] && !j->names[r][0]) snprintf(j->names[r], 160, "%s", d->wnames[r]);
    if (d->rank >= 0 && d->rank < j->world) snprintf(j->names[d->rank], 160, "%s", d->name);
  }
  j->t0 = ~0ull;
  for (int i = 0; i < j->n; i++)
    if (j->d[i].now + (unsigned long long)j->d[i].offset < j->t0)
      j->t0 = j->d[i].now + (unsigned long long)j->d[i].offset;
  return j->names ? 0 : -1;
}

/* ---- words ---- */

static const char *who(const job *j, int rank, char *buf, size_t n) {
  if (rank >= 0 && rank < j->world && j->names[rank][0])
    snprintf(buf, n, "%s (rank %d)", j->names[rank], rank);
  else snprintf(buf, n, "rank %d", rank);
  return buf;
}

static dump *dump_of(const job *j, int rank) {
  for (int i = 0; i < j->n; i++)
    if (j->d[i].rank == rank) return &j->d[i];
  return NULL;
}

/* A record's time in seconds after the job's first dump (rank 0's clock; earlier: negative). */
static double rel_s(const job *j, const dump *d, unsigned long long ts) {
  return ((double)(long long)(ts + (unsigned long long)d->offset) - (double)(long long)j->t0) * 1e-9;
}

/* An RRef or context id as tdist prints them: "creator rank:counter". */
static const char *subj_words(int kind, unsigned long long id, char *buf, size_t n) {
  if (kind == SUBJ_RREF) snprintf(buf, n, "RRef %llu:%llu", id >> 48, id & ((1ull << 48) - 1));
  else if (kind == SUBJ_CTX)
    snprintf(buf, n, "context %llu:%llu", id >> 48, id & ((1ull << 48) - 1));
  else buf[0] = 0;
  return buf;
}

/* ", about RRef 0:3" after a call's words, or "". */
static const char *about(int kind, unsigned long long id, char *buf, size_t n) {
  char s[80];
  if (kind == SUBJ_RREF || kind == SUBJ_CTX)
    snprintf(buf, n, ", %s%s", kind == SUBJ_CTX ? "in " : "about ", subj_words(kind, id, s, sizeof s));
  else buf[0] = 0;
  return buf;
}

/* about() for a call: an RRef request goes to the RRef's owner (__rref_confirm goes from it). */
static const char *about_call(const job *j, const char *fn, int callee, int kind,
                              unsigned long long id, char *buf, size_t n) {
  char w[200];
  about(kind, id, buf, n);
  if (kind == SUBJ_RREF && strncmp(fn, "__rref_", 7) == 0 && strcmp(fn, "__rref_confirm") != 0) {
    size_t l = strlen(buf);
    snprintf(buf + l, n - l, " (owned by %s)", who(j, callee, w, sizeof w));
  }
  return buf;
}

static void describe_coll(const rec *r, char *buf, size_t n) {
  const char *dt = r->x < sizeof dtype_names / sizeof *dtype_names ? dtype_names[r->x] : "?";
  const char *al = r->y < sizeof algo_names / sizeof *algo_names ? algo_names[r->y] : "?";
  if (strcmp(r->name, "barrier") == 0)
    snprintf(buf, n, "barrier #%llu (group %d)", r->a, r->peer);
  else
    snprintf(buf, n, "%s #%llu (%s x %u, %llu bytes, group %d, algorithm %s)", r->name, r->a, dt,
             r->c, r->b, r->peer, al);
}

static void describe(const job *j, const rec *r, char *buf, size_t n) {
  char w[200], ab[120];
  switch (r->kind) {
    case K_COLL_ENTER: {
      char c[200];
      describe_coll(r, c, sizeof c);
      snprintf(buf, n, "in %s", c);
      break;
    }
    case K_HANDLER_START:
      if (r->a)
        snprintf(buf, n, "in handler %s (call #%llu from %s%s)", r->name, r->a,
                 who(j, r->peer, w, sizeof w), about(r->y, r->b, ab, sizeof ab));
      else /* a function an RRef request runs on the pool (its creation, a proxy call) */
        snprintf(buf, n, "running %s for %s%s", r->name, who(j, r->peer, w, sizeof w),
                 about(r->y, r->b, ab, sizeof ab));
      break;
    case K_WAIT_BEGIN: {
      char set[64] = "";
      if (r->x == 1) snprintf(set, sizeof set, " (td_future_wait_all of %u, first not done)", r->c);
      if (r->peer >= 0)
        snprintf(buf, n, "waiting on call %s #%llu to %s%s%s", r->name, r->a,
                 who(j, r->peer, w, sizeof w),
                 about_call(j, r->name, r->peer, r->y, r->b, ab, sizeof ab), set);
      else snprintf(buf, n, "waiting on a future%s%s", about(r->y, r->b, ab, sizeof ab), set);
      break;
    }
    case K_SCOPE_BEGIN:
      snprintf(buf, n, "in %s%s", r->name, about(r->y, r->b, ab, sizeof ab));
      break;
    default: snprintf(buf, n, "%s %s", kind_words[r->kind], r->name);
  }
}

/* The open records of thread tid in d, outermost first (indices into d->open). */
static int thread_stack(const dump *d, int tid, int *idx, int max) {
  int k = 0;
  for (int i = 0; i < d->nopen && k < max; i++)
    if (d->open[i].tid == tid) idx[k++] = i;
  return k;
}

static const rec *innermost(const dump *d, int tid) {
  int idx[16];
  int k = thread_stack(d, tid, idx, 16);
  return k ? &d->open[idx[k - 1]] : NULL;
}

/* ---- workers without a dump ---- */

/* What became of a worker that left no dump, from DIR/<name>.proc (pid, host, start time, written
 * at its start) and /proc on this host: "dead: ...", "stopped: ..." or why it cannot be told. */
static void fate(const job *j, int rank, char *buf, size_t n) {
  char path[1200], line[300], host[256] = "", here[256] = "";
  int pid = 0;
  unsigned long long start = 0;
  const char *name = rank >= 0 && rank < j->world && j->names[rank][0] ? j->names[rank] : NULL;
  snprintf(path, sizeof path, "%s/%s.proc", j->dir, name ? name : "-");
  FILE *f = name ? fopen(path, "r") : NULL;
  while (f && fgets(line, sizeof line, f)) {
    if (sscanf(line, "pid %d", &pid) == 1) continue;
    if (sscanf(line, "host %255s", host) == 1) continue;
    sscanf(line, "start %llu", &start);
  }
  if (f) fclose(f);
  if (pid <= 0) {
    snprintf(buf, n, "dead, stopped, or it never started (no process record)");
    return;
  }
  gethostname(here, sizeof here - 1);
  if (strcmp(host, here) != 0) {
    snprintf(buf, n, "dead or stopped (its process %d runs on %s, not checked from here)", pid,
             host);
    return;
  }
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  f = fopen(path, "r");
  char st[1024] = "";
  size_t got = f ? fread(st, 1, sizeof st - 1, f) : 0;
  if (f) fclose(f);
  st[got] = 0;
  char *p = strrchr(st, ')'), state = 0;
  unsigned long long t = 0;
  if (p && p[1] == ' ') {
    state = p[2];
    int field = 2;
    for (char *q = p + 1; *q; q++)
      if (*q == ' ' && ++field == 22) {
        t = strtoull(q + 1, NULL, 10);
        break;
      }
  }
  if (!state || (start && t != start) || state == 'Z' || state == 'X')
    snprintf(buf, n, "dead: its process %d is gone%s", pid, state == 'Z' ? " (exited)" : "");
  else if (state == 'T' || state == 't')
    snprintf(buf, n, "stopped: its process %d is stopped (SIGSTOP, or a debugger)", pid);
  else
    snprintf(buf, n, "alive but silent: its process %d (state %c) wrote no dump (SIGUSR1 "
             "handled by the program, or blocked in the kernel)", pid, state);
}

/* What the others recorded about a worker without a dump: the last time one heard from it, and
 * the calls to it that failed because it was gone. */
static void peers_view(const job *j, int rank, char *buf, size_t n) {
  double last = 0;
  const dump *ld = NULL;
  const rec *lr = NULL;
  int lost = 0;
  char w[200];
  for (int i = 0; i < j->n; i++) {
    const dump *d = &j->d[i];
    for (int k = 0; k < d->nev; k++) {
      const rec *r = &d->ev[k];
      if (r->peer != rank) continue;
      bool heard = (r->kind == K_RPC_RECV) || (r->kind == K_RPC_DONE && r->x == ST_OK);
      if (r->kind == K_RPC_DONE && r->x == ST_UNAVAILABLE) lost++;
      if (heard && (!lr || rel_s(j, d, r->ts) > last)) last = rel_s(j, d, r->ts), ld = d, lr = r;
    }
  }
  size_t len = 0;
  buf[0] = 0;
  if (lr)
    len = (size_t)snprintf(buf, n, "last heard from at %+.3f s (%s %s #%llu at %s)", last,
                           lr->kind == K_RPC_RECV ? "request" : "reply to", lr->name, lr->a,
                           who(j, ld->rank, w, sizeof w));
  if (lost && len < n)
    snprintf(buf + len, n - len, "%s%d call%s to it failed with its connection lost",
             len ? "; " : "", lost, lost == 1 ? "" : "s");
}

static void print_workers(const job *j) {
  char w[200], line[400];
  for (int r = 0; r < j->world; r++) {
    dump *d = dump_of(j, r);
    if (!d) {
      char f[300], pv[400];
      fate(j, r, f, sizeof f);
      peers_view(j, r, pv, sizeof pv);
      printf("%s: no dump: %s%s%s\n", who(j, r, w, sizeof w), f, pv[0] ? "; peers: " : "", pv);
      continue;
    }
    printf("%s, pid %d, dumped at %+.3f s (%s):\n", who(j, r, w, sizeof w), d->pid,
           rel_s(j, d, d->now), d->reason);
    int shown = 0;
    for (int i = 0; i < d->nopen; i++) {
      if (i > 0 && d->open[i].tid == d->open[i - 1].tid) continue;
      int idx[16], k = thread_stack(d, d->open[i].tid, idx, 16);
      printf("  thread %d:", d->open[i].tid);
      for (int m = 0; m < k; m++) {
        const rec *o = &d->open[idx[m]];
        describe(j, o, line, sizeof line);
        printf("%s %s for %.3f s", m ? "," : "", line, (double)(d->now - o->ts) * 1e-9);
      }
      printf("\n");
      shown++;
    }
    if (!shown) printf("  no thread waits in tdist (running user code, or idle)\n");
  }
}

/* ---- collectives ---- */

static const group *find_group(const job *j, unsigned long long id) {
  for (int i = 0; i < j->n; i++)
    for (int g = 0; g < j->d[i].ngroups; g++)
      if (j->d[i].groups[g].id == id) return &j->d[i].groups[g];
  return NULL;
}

/* The member's open operation on group gid, or NULL. */
static const rec *open_coll(const dump *d, int gid) {
  for (int i = 0; d && i < d->nopen; i++)
    if (d->open[i].kind == K_COLL_ENTER && d->open[i].peer == gid) return &d->open[i];
  return NULL;
}

/* The member's last recorded operation on group gid (entered), or NULL. */
static const rec *last_coll(const dump *d, int gid) {
  const rec *best = NULL;
  for (int i = 0; i < d->nev; i++)
    if (d->ev[i].kind == K_COLL_ENTER && d->ev[i].peer == gid && (!best || d->ev[i].a > best->a))
      best = &d->ev[i];
  return best;
}

static bool same_op(const rec *a, const rec *b) {
  return strcmp(a->name, b->name) == 0 && a->c == b->c && a->x == b->x;
}

/* What a member that is not in the operation does instead, in words. */
static void elsewhere(const job *j, const dump *d, char *buf, size_t n) {
  for (int i = d->nopen - 1; i >= 0; i--) {
    if (i + 1 < d->nopen && d->open[i + 1].tid == d->open[i].tid) continue;
    describe(j, innermost(d, d->open[i].tid), buf, n);
    return;
  }
  snprintf(buf, n, "it waits in nothing tdist records (user code, or a wait outside tdist)");
}

static void report_group(const job *j, int gid) {
  const group *g = find_group(j, (unsigned long long)gid);
  if (!g) return;
  unsigned long long seq = ~0ull;
  for (int m = 0; m < g->size; m++) {
    const rec *o = open_coll(dump_of(j, g->ranks[m]), gid);
    if (o && o->a < seq) seq = o->a;
  }
  const rec *ref = NULL; /* the majority's version of operation #seq */
  int best = 0;
  for (int m = 0; m < g->size; m++) {
    const rec *o = open_coll(dump_of(j, g->ranks[m]), gid);
    if (!o || o->a != seq) continue;
    int votes = 0;
    for (int k = 0; k < g->size; k++) {
      const rec *p = open_coll(dump_of(j, g->ranks[k]), gid);
      if (p && p->a == seq && same_op(o, p)) votes++;
    }
    if (votes > best) best = votes, ref = o;
  }
  if (!ref) return; /* the member inside an operation is not listed in the group's members */
  char op[300], w[200], what[300];
  describe_coll(ref, op, sizeof op);
  for (int m = 0; m < g->size; m++) {
    int r = g->ranks[m];
    dump *d = dump_of(j, r);
    const rec *o = open_coll(d, gid);
    who(j, r, w, sizeof w);
    if (!d) {
      char f[300];
      fate(j, r, f, sizeof f);
      printf("culprit: %s never entered %s: it left no dump: %s\n", w, op, f);
    } else if (o && o->a == seq && !same_op(o, ref)) {
      describe_coll(o, what, sizeof what);
      printf("culprit: %s entered %s where %d other member%s entered %s: mismatched "
             "collectives\n", w, what, best, best == 1 ? "" : "s", op);
    } else if (!o || o->a != seq) {
      const rec *l = last_coll(d, gid);
      char last[300] = "none recorded";
      if (o) describe_coll(o, last, sizeof last);
      else if (l) describe_coll(l, last, sizeof last);
      elsewhere(j, d, what, sizeof what);
      printf("culprit: %s never entered %s: its %s operation on group %d is %s; %s\n", w, op,
             o ? "current" : "last", gid, last, o ? "it is ahead" : what);
    }
  }
}

/* Collectives called in different orders: rank r waits in an operation of group g that a member
 * m never entered because m waits in an operation of another group, which r never entered (or
 * longer cycles through more groups). Edges r -> m, one per waiting rank (its first such m). */
static void report_coll_cycles(const job *j) {
  int n = j->world, *next = calloc((size_t)(n > 0 ? n : 1), sizeof *next);
  const rec **in = calloc((size_t)(n > 0 ? n : 1), sizeof *in);
  if (!next || !in) goto out;
  for (int r = 0; r < n; r++) {
    next[r] = -1;
    const dump *d = dump_of(j, r);
    for (int k = 0; d && k < d->nopen && next[r] < 0; k++) {
      const rec *o = &d->open[k];
      const group *g = o->kind == K_COLL_ENTER ? find_group(j, (unsigned long long)o->peer) : NULL;
      for (int m = 0; g && m < g->size && next[r] < 0; m++) {
        const dump *md = dump_of(j, g->ranks[m]);
        const rec *mo = open_coll(md, o->peer);
        if (g->ranks[m] == r || !md || (mo && mo->a >= o->a)) continue;
        for (int q = 0; q < md->nopen; q++) /* m waits in another group's operation */
          if (md->open[q].kind == K_COLL_ENTER && md->open[q].peer != o->peer)
            next[r] = g->ranks[m], in[r] = o;
      }
    }
  }
  for (int s = 0; s < n; s++) { /* print each cycle once, from its lowest rank */
    int r = next[s], len = 1;
    while (r >= 0 && r != s && len <= n) r = next[r], len++;
    if (r != s) continue;
    bool lowest = true;
    for (int q = next[s]; q != s; q = next[q]) lowest = lowest && q > s;
    if (!lowest) continue;
    char a[200], b[200], op[300];
    printf("culprit: collectives called in different orders (a cycle): ");
    int q = s;
    do {
      describe_coll(in[q], op, sizeof op);
      printf("%s%s waits in %s, which %s never entered", q == s ? "" : "; ",
             who(j, q, a, sizeof a), op, who(j, next[q], b, sizeof b));
      q = next[q];
    } while (q != s);
    printf("\n");
  }
out:
  free(next);
  free(in);
}

static void report_collectives(const job *j) {
  int seen[256], ns = 0;
  for (int i = 0; i < j->n; i++)
    for (int k = 0; k < j->d[i].nopen; k++) {
      const rec *o = &j->d[i].open[k];
      if (o->kind != K_COLL_ENTER) continue;
      bool dup = false;
      for (int s = 0; s < ns; s++) dup = dup || seen[s] == o->peer;
      if (dup || ns == 256) continue;
      seen[ns++] = o->peer;
      report_group(j, o->peer);
    }
  report_coll_cycles(j);
}

/* ---- RPC waits ---- */

typedef struct node {
  const dump *d;
  int tid;
} node;

/* A call between two workers, as the caller recorded it. */
typedef struct call {
  const dump *from;
  int callee;
  unsigned long long id, sid;
  int sk;
  char name[40];
} call;

/* The thread of d serving call (caller, id), or -1. */
static int serving_thread(const dump *d, int caller, unsigned long long id) {
  for (int i = 0; i < d->nopen; i++)
    if (d->open[i].kind == K_HANDLER_START && d->open[i].peer == caller && d->open[i].a == id)
      return d->open[i].tid;
  return -1;
}

/* The last record of kind about (peer, id) in d's ring, or NULL. */
static const rec *find_ev(const dump *d, int kind, int peer, unsigned long long id) {
  for (int i = d->nev - 1; i >= 0; i--)
    if (d->ev[i].kind == kind && d->ev[i].peer == peer && d->ev[i].a == id) return &d->ev[i];
  return NULL;
}

static call call_of(const dump *d, const rec *r) {
  call c = {d, r->peer, r->a, r->b, r->y, ""};
  snprintf(c.name, sizeof c.name, "%s", r->name);
  return c;
}

/* The calls d made (about subject (sk, sid); any when sk < 0) that are outstanding (sent, never
 * done) or failed by a timeout or a lost connection, newest first, outstanding ones first, into
 * out (at most max); returns how many. */
static int pending_calls(const dump *d, int sk, unsigned long long sid, call *out, int max) {
  int n = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int i = d->nev - 1; i >= 0 && n < max; i--) {
      const rec *r = &d->ev[i];
      if (r->kind != K_RPC_SEND || (sk >= 0 && ((int)r->y != sk || r->b != sid))) continue;
      const rec *done = find_ev(d, K_RPC_DONE, r->peer, r->a);
      bool hit = pass == 0 ? !done
                           : done && (done->x == ST_TIMEOUT || done->x == ST_UNAVAILABLE);
      if (hit) out[n++] = call_of(d, r);
    }
  return n;
}

/* The innermost record of tid's stack with a subject, or NULL. */
static const rec *stack_subject(const dump *d, int tid) {
  int idx[16], k = thread_stack(d, tid, idx, 16);
  for (int m = k - 1; m >= 0; m--)
    if (d->open[idx[m]].y == SUBJ_RREF || d->open[idx[m]].y == SUBJ_CTX) {
      int kd = d->open[idx[m]].kind;
      if (kd == K_WAIT_BEGIN || kd == K_SCOPE_BEGIN || kd == K_HANDLER_START)
        return &d->open[idx[m]];
    }
  return NULL;
}

/* A busy handler thread of d that itself waits on a call (the next link of a chain through a
 * queued call), or the first busy one; lists the busy handlers into buf, counts them in *busy
 * and, in *nested, those waiting on a call to d's own worker (queued behind them). */
static int busy_handlers(const job *j, const dump *d, char *buf, size_t n, int *busy,
                         int *nested) {
  int pick = -1;
  size_t len = 0;
  buf[0] = 0;
  *busy = *nested = 0;
  for (int i = 0; i < d->nopen; i++) {
    const rec *o = &d->open[i];
    if (o->kind != K_HANDLER_START || (i > 0 && d->open[i - 1].tid == o->tid)) continue;
    const rec *in = innermost(d, o->tid);
    (*busy)++;
    if (in && in->kind == K_WAIT_BEGIN && in->peer == d->rank) (*nested)++;
    if (pick < 0 || (in && in->kind == K_WAIT_BEGIN)) pick = o->tid;
    char w[200];
    int k = snprintf(buf + len, n - len, "%shandler %s (from %s)", len ? ", " : "", o->name,
                     who(j, o->peer, w, sizeof w));
    if (k > 0 && (size_t)k < n - len) len += (size_t)k;
  }
  return pick;
}

/* An RRef fork d received and its owner never confirmed (the newest), or NULL. */
static const rec *unconfirmed_fork(const dump *d) {
  for (int i = d->nev - 1; i >= 0; i--) {
    const rec *r = &d->ev[i];
    if (r->kind != K_RREF_FORK || r->x != 1) continue;
    bool confirmed = false;
    for (int k = i + 1; k < d->nev && !confirmed; k++)
      confirmed = d->ev[k].kind == K_RREF_CONFIRM && d->ev[k].b == r->b;
    if (!confirmed) return r;
  }
  return NULL;
}

static node follow_call(const job *j, const call *c, int depth, char *end, size_t n);

/* A call received but never started: the handler threads are busy (the next link is one of them,
 * or the pool is exhausted by calls queued behind their own handlers), or the request waits for
 * the confirmation of an RRef among its arguments (the next link is the fork's parent). */
static node queued(const job *j, const call *c, const dump *p, int depth, char *end, size_t n) {
  char a[200], b[600], o[200], ab[120];
  node none = {NULL, 0};
  int busy, nested;
  int q = busy_handlers(j, p, b, sizeof b, &busy, &nested);
  who(j, p->rank, a, sizeof a);
  if (busy && nested == busy && (p->pool <= 0 || busy >= p->pool)) {
    snprintf(end, n, "%s's handler pool is exhausted by nested calls: all %d of its handler "
             "threads (%s) wait on calls to %s itself, which are queued behind them (%s #%llu "
             "among them); a handler that needs another call's result must return a future",
             a, busy, b, p->name, c->name, c->id);
    return none;
  }
  if (busy) {
    printf("    %s received %s #%llu but never started it: its handler threads are busy "
           "with %s\n", a, c->name, c->id, b);
    if (q >= 0) return (node){p, q};
  }
  const rec *u = unconfirmed_fork(p);
  if (u) {
    char rs[80];
    subj_words(SUBJ_RREF, u->a, rs, sizeof rs);
    printf("    %s received %s #%llu but holds %s (from %s) that its owner %s never confirmed: "
           "the request waits for the confirmation\n", a, c->name, c->id, rs,
           who(j, (int)u->c, b, sizeof b), who(j, u->peer, o, sizeof o));
    const dump *parent = dump_of(j, (int)u->c);
    call fk[4];
    memset(fk, 0, sizeof fk);
    int k = parent ? pending_calls(parent, SUBJ_RREF, u->a, fk, 4) : 0;
    for (int i = 0; i < k && i < 4; i++) {
      const call *x = &fk[i];
      if (x->callee != u->peer || strncmp(x->name, "__rref_fork", sizeof x->name) != 0) continue;
      printf("    %s sent %s #%llu to %s%s, still unanswered\n", who(j, parent->rank, b, sizeof b),
             x->name, x->id, o, about_call(j, x->name, x->callee, x->sk, x->sid, ab, sizeof ab));
      return follow_call(j, x, depth + 1, end, n);
    }
    snprintf(end, n, "%s never confirmed %s to %s (no outstanding fork recorded)", o, rs, a);
    return none;
  }
  snprintf(end, n, "%s queued %s #%llu with no busy handler recorded", a, c->name, c->id);
  return none;
}

/* Follows call c to its callee: the thread serving it, or the end of the chain (in end). */
static node follow_call(const job *j, const call *c, int depth, char *end, size_t n) {
  char a[200], ab[120], f[300], pv[400];
  node none = {NULL, 0};
  int caller = c->from->rank;
  const dump *p = dump_of(j, c->callee);
  who(j, c->callee, a, sizeof a);
  about_call(j, c->name, c->callee, c->sk, c->sid, ab, sizeof ab);
  if (depth > 16) {
    snprintf(end, n, "the chain is too long to follow");
    return none;
  }
  if (!p) {
    fate(j, c->callee, f, sizeof f);
    peers_view(j, c->callee, pv, sizeof pv);
    snprintf(end, n, "%s left no dump: %s; it never answered %s #%llu%s%s%s", a, f, c->name,
             c->id, ab, pv[0] ? "; peers: " : "", pv);
    return none;
  }
  int t = serving_thread(p, caller, c->id);
  if (t >= 0) return (node){p, t};
  const rec *he = find_ev(p, K_HANDLER_END, caller, c->id);
  if (he && he->y == 1) { /* the handler returned a future: the reply waits on it */
    char sw[80];
    int sk = (int)he->c;
    subj_words(sk, he->b, sw, sizeof sw);
    printf("    %s finished handler %s #%llu; its reply waits on a future%s%s\n", a, c->name,
           c->id, sw[0] ? " about " : "", sw);
    if (sk == SUBJ_NONE) {
      snprintf(end, n, "%s: the reply to %s #%llu waits on a future nothing recorded explains", a,
               c->name, c->id);
      return none;
    }
    for (int i = 0; i < p->nopen; i++) { /* a thread working on the same RRef or context */
      const rec *o = &p->open[i];
      if ((int)o->y == sk && o->b == he->b && o->kind != K_COLL_ENTER &&
          !(o->kind == K_HANDLER_START && o->peer == caller && o->a == c->id))
        return (node){p, o->tid};
    }
    call next[1];
    if (pending_calls(p, sk, he->b, next, 1)) {
      printf("    %s's call %s #%llu to %s%s is %s\n", a, next[0].name, next[0].id,
             who(j, next[0].callee, f, sizeof f), about_call(j, next[0].name, next[0].callee, next[0].sk, next[0].sid, ab, sizeof ab),
             find_ev(p, K_RPC_DONE, next[0].callee, next[0].id) ? "the one that failed"
                                                               : "outstanding");
      return follow_call(j, &next[0], depth + 1, end, n);
    }
    snprintf(end, n, "%s: the reply to %s #%llu waits on %s, and nothing on %s works on it", a,
             c->name, c->id, sw, p->name);
    return none;
  }
  if (he) {
    snprintf(end, n, "%s finished %s #%llu: its reply is lost or late", a, c->name, c->id);
    return none;
  }
  if (find_ev(p, K_RPC_RECV, caller, c->id)) return queued(j, c, p, depth, end, n);
  snprintf(end, n, "%s has no record of %s #%llu: it never arrived", a, c->name, c->id);
  return none;
}

/* The call a thread waits on, from its innermost open record: the call itself, or for a wait
 * or scope about an RRef or context without a call of its own, this worker's pending call about
 * it (a distributed backward waits on its hops), or for a graceful shutdown any pending call.
 * Returns false (end set) when it waits on no other worker. */
static bool waited_call(const job *j, node cur, call *out, char *end, size_t n) {
  const rec *w = innermost(cur.d, cur.tid);
  char a[200], b[400];
  who(j, cur.d->rank, a, sizeof a);
  if (!w) {
    snprintf(end, n, "a thread without an open record (the dump changed under the reader)");
    return false;
  }
  describe(j, w, b, sizeof b);
  if (w->kind == K_WAIT_BEGIN && w->peer >= 0) {
    *out = call_of(cur.d, w);
    return true;
  }
  if (w->kind == K_WAIT_BEGIN || w->kind == K_SCOPE_BEGIN) {
    const rec *s = stack_subject(cur.d, cur.tid);
    bool any = w->kind == K_SCOPE_BEGIN && strcmp(w->name, "rpc_shutdown") == 0;
    if ((s || any) && pending_calls(cur.d, any ? -1 : (int)s->y, any ? 0 : s->b, out, 1)) {
      char c[200], ab[120];
      printf("    %s thread %d: %s; its pending call: %s #%llu to %s%s\n", a, cur.tid, b,
             out->name, out->id, who(j, out->callee, c, sizeof c),
             about_call(j, out->name, out->callee, out->sk, out->sid, ab, sizeof ab));
      return true;
    }
  }
  snprintf(end, n, "%s thread %d is %s and waits on no other worker", a, cur.tid, b);
  return false;
}

static void print_cycle(const job *j, const node *seen, int i, int ns) {
  char a[200];
  printf("culprit: a cycle of RPC waits: ");
  for (int k = i; k < ns; k++) {
    const rec *w = innermost(seen[k].d, seen[k].tid);
    const rec *h = NULL;
    int idx[16], m = thread_stack(seen[k].d, seen[k].tid, idx, 16);
    for (int q = 0; q < m; q++)
      if (seen[k].d->open[idx[q]].kind == K_HANDLER_START) h = &seen[k].d->open[idx[q]];
    printf("%s%s%s%s waits on %s", k > i ? " -> " : "", who(j, seen[k].d->rank, a, sizeof a),
           h ? " in handler " : "", h ? h->name : "", w->name);
  }
  printf(" -> back to the start: no handler can finish\n");
}

/* Prints the chain from thread start (its first call: first, or the one it waits on) to its end,
 * and the end as a culprit line. */
static void report_chain(const job *j, node start, const call *first) {
  node seen[64];
  int ns = 0;
  char end[1600], a[200], b[400];
  printf("  wait chain:\n");
  for (node cur = start; cur.d;) {
    for (int i = 0; i < ns; i++)
      if (seen[i].d == cur.d && seen[i].tid == cur.tid) {
        print_cycle(j, seen, i, ns);
        return;
      }
    if (ns == 64) break;
    seen[ns++] = cur;
    call c;
    bool have = ns == 1 && first;
    if (have) {
      c = *first;
    } else {
      const rec *w = innermost(cur.d, cur.tid);
      if (w) {
        describe(j, w, b, sizeof b);
        if (w->kind == K_WAIT_BEGIN && w->peer >= 0)
          printf("    %s thread %d: %s\n", who(j, cur.d->rank, a, sizeof a), cur.tid, b);
      }
      have = waited_call(j, cur, &c, end, sizeof end);
    }
    cur = have ? follow_call(j, &c, 0, end, sizeof end) : (node){NULL, 0};
    if (!cur.d) {
      printf("culprit: %s\n", end);
      return;
    }
  }
}

static void report_rpc(const job *j) {
  for (int i = 0; i < j->n; i++) {
    const dump *d = &j->d[i];
    for (int k = 0; k < d->nopen; k++) {
      const rec *o = &d->open[k];
      /* chains start at threads that are not handlers themselves (the callers at the top) */
      if (o->depth != 0 || (o->kind != K_WAIT_BEGIN && o->kind != K_SCOPE_BEGIN)) continue;
      const rec *in = innermost(d, o->tid);
      char a[200], b[400], b2[400], ab[120], c[200];
      describe(j, o, b, sizeof b);
      describe(j, in, b2, sizeof b2);
      printf("%s thread %d is %s%s%s:\n", who(j, d->rank, a, sizeof a), o->tid, b,
             in != o ? ", " : "", in != o ? b2 : "");
      if (in->kind == K_SCOPE_BEGIN && strcmp(in->name, "rpc_shutdown") == 0) {
        call pc[4];
        int np = pending_calls(d, -1, 0, pc, 4);
        for (int q = 0; q < np; q++) { /* shutdown waits for every outstanding call */
          printf("  outstanding call %s #%llu to %s%s:\n", pc[q].name, pc[q].id,
                 who(j, pc[q].callee, c, sizeof c), about_call(j, pc[q].name, pc[q].callee, pc[q].sk, pc[q].sid, ab, sizeof ab));
          report_chain(j, (node){d, o->tid}, &pc[q]);
        }
        if (!np)
          printf("  no outstanding call of its own: it waits for the other workers' work\n");
        continue;
      }
      report_chain(j, (node){d, o->tid}, NULL);
    }
  }
}

/* RRefs a worker holds that their owners never confirmed, with what became of the fork. */
static void report_rrefs(const job *j) {
  for (int i = 0; i < j->n; i++) {
    const dump *d = &j->d[i];
    for (int k = 0; k < d->nev; k++) {
      const rec *r = &d->ev[k];
      if (r->kind != K_RREF_FORK || r->x != 1) continue;
      bool confirmed = false;
      for (int m = k + 1; m < d->nev && !confirmed; m++)
        confirmed = d->ev[m].kind == K_RREF_CONFIRM && d->ev[m].b == r->b;
      if (confirmed) continue;
      char a[200], o[200], pa[200], rs[80];
      subj_words(SUBJ_RREF, r->a, rs, sizeof rs);
      printf("unconfirmed: %s holds %s (fork %llu:%llu, from %s) that its owner %s never "
             "confirmed\n", who(j, d->rank, a, sizeof a), rs, r->b >> 48,
             r->b & ((1ull << 48) - 1), who(j, (int)r->c, pa, sizeof pa),
             who(j, r->peer, o, sizeof o));
    }
  }
}

int td_why_hung_main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: tdist-trace why-hung DIR   (DIR holds the workers' *.flight dumps)\n");
    return 2;
  }
  job j = {.dir = argv[2]};
  if (load(argv[2], &j) != 0) return 1;
  if (j.n == 0) {
    fprintf(stderr, "tdist-trace: no *.flight dumps in %s\n", argv[2]);
    return 1;
  }
  printf("why-hung: %d dump%s of %d worker%s in %s\n\n", j.n, j.n == 1 ? "" : "s", j.world,
         j.world == 1 ? "" : "s", argv[2]);
  print_workers(&j);
  printf("\nroot causes:\n");
  report_collectives(&j);
  report_rpc(&j);
  report_rrefs(&j);
  for (int i = 0; i < j.n; i++) {
    dump *d = &j.d[i];
    for (int g = 0; g < d->ngroups; g++) free(d->groups[g].ranks);
    free(d->groups), free(d->open), free(d->ev), free(d->wnames);
  }
  free(j.d), free(j.names);
  return 0;
}
