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

enum { K_NONE, K_COLL_ENTER, K_COLL_EXIT, K_RPC_SEND, K_RPC_DONE, K_RPC_RECV, K_HANDLER_START,
       K_HANDLER_END, K_WAIT_BEGIN, K_WAIT_END, K_DUMP, K_COUNT };
static const char *const kind_words[K_COUNT] = {
    "none", "coll_enter", "coll_exit", "rpc_send", "rpc_done", "rpc_recv",
    "handler_start", "handler_end", "wait_begin", "wait_end", "dump"};
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
  char (*wnames)[160]; /* world names, when the dump lists them */
  int nwnames;
  group *groups;
  int ngroups;
  rec *open, *ev;
  int nopen, nev;
} dump;

typedef struct job {
  dump *d;
  int n, world;
  char (*names)[160]; /* by rank, from any dump */
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
  char w[200];
  switch (r->kind) {
    case K_COLL_ENTER: {
      char c[200];
      describe_coll(r, c, sizeof c);
      snprintf(buf, n, "in %s", c);
      break;
    }
    case K_HANDLER_START:
      snprintf(buf, n, "in handler %s (call #%llu from %s)", r->name, r->a,
               who(j, r->peer, w, sizeof w));
      break;
    case K_WAIT_BEGIN:
      if (r->peer >= 0)
        snprintf(buf, n, "waiting on call %s #%llu to %s", r->name, r->a,
                 who(j, r->peer, w, sizeof w));
      else if (!strcmp(r->name, "pg_reform")) /* td_process_group_reform: a bounded store wait */
        snprintf(buf, n, "re-forming process group %llu as generation %llu (waiting for the "
                 "survivors through the store)", r->a, r->b);
      else snprintf(buf, n, "waiting on a future");
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

static void print_workers(const job *j) {
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < j->n; i++)
    if (j->d[i].now + (unsigned long long)j->d[i].offset < t0)
      t0 = j->d[i].now + (unsigned long long)j->d[i].offset;
  char w[200], line[400];
  for (int r = 0; r < j->world; r++) {
    dump *d = dump_of(j, r);
    if (!d) {
      printf("%s: no dump: dead, stopped (SIGSTOP), or it never started\n", who(j, r, w, sizeof w));
      continue;
    }
    printf("%s, pid %d, dumped at +%.3f s (%s):\n", who(j, r, w, sizeof w), d->pid,
           (double)(d->now + (unsigned long long)d->offset - t0) * 1e-9, d->reason);
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
      printf("culprit: %s never entered %s: it left no dump (dead, or stopped)\n", w, op);
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
}

/* ---- RPC waits ---- */

typedef struct node {
  const dump *d;
  int tid;
} node;

/* The thread of d serving call (caller, id), or -1. */
static int serving_thread(const dump *d, int caller, unsigned long long id) {
  for (int i = 0; i < d->nopen; i++)
    if (d->open[i].kind == K_HANDLER_START && d->open[i].peer == caller && d->open[i].a == id)
      return d->open[i].tid;
  return -1;
}

static bool has_ev(const dump *d, int kind, int peer, unsigned long long id) {
  for (int i = 0; i < d->nev; i++)
    if (d->ev[i].kind == kind && d->ev[i].peer == peer && d->ev[i].a == id) return true;
  return false;
}

/* A busy handler thread of d that itself waits on a call (the next link of a chain through a
 * queued call), or the first busy one; lists the busy handlers into buf. */
static int busy_handlers(const job *j, const dump *d, char *buf, size_t n) {
  int pick = -1;
  size_t len = 0;
  buf[0] = 0;
  for (int i = 0; i < d->nopen; i++) {
    const rec *o = &d->open[i];
    if (o->kind != K_HANDLER_START) continue;
    const rec *in = innermost(d, o->tid);
    if (pick < 0 || (in && in->kind == K_WAIT_BEGIN)) pick = o->tid;
    char w[200];
    int k = snprintf(buf + len, n - len, "%shandler %s (from %s)", len ? ", " : "", o->name,
                     who(j, o->peer, w, sizeof w));
    if (k > 0 && (size_t)k < n - len) len += (size_t)k;
  }
  return pick;
}

/* One step of a chain from thread cur: prints the link and returns the next thread, or a node
 * with d NULL at the end of the chain. */
static node step(const job *j, node cur, char *end, size_t n) {
  const rec *w = innermost(cur.d, cur.tid);
  char a[200], b[400];
  node none = {NULL, 0};
  if (!w) {
    snprintf(end, n, "a thread without an open record (the dump changed under the reader)");
    return none;
  }
  describe(j, w, b, sizeof b);
  printf("    %s thread %d: %s\n", who(j, cur.d->rank, a, sizeof a), cur.tid, b);
  if (w->kind != K_WAIT_BEGIN || w->peer < 0) {
    snprintf(end, n, "%s thread %d is %s and waits on no other worker", a, cur.tid, b);
    return none;
  }
  const dump *p = dump_of(j, w->peer);
  who(j, w->peer, a, sizeof a);
  if (!p) {
    snprintf(end, n, "%s left no dump (dead, or stopped) while serving %s #%llu", a, w->name,
             w->a);
    return none;
  }
  int t = serving_thread(p, cur.d->rank, w->a);
  if (t >= 0) return (node){p, t};
  if (has_ev(p, K_HANDLER_END, cur.d->rank, w->a)) {
    snprintf(end, n, "%s finished %s #%llu: its reply is lost or late", a, w->name, w->a);
    return none;
  }
  if (has_ev(p, K_RPC_RECV, cur.d->rank, w->a)) {
    int q = busy_handlers(j, p, b, sizeof b);
    printf("    %s received %s #%llu but never started it: its handler threads are busy "
           "with %s\n", a, w->name, w->a, b[0] ? b : "nothing it recorded");
    if (q >= 0) return (node){p, q};
    snprintf(end, n, "%s queued %s #%llu with no busy handler recorded", a, w->name, w->a);
    return none;
  }
  snprintf(end, n, "%s has no record of %s #%llu: it never arrived", a, w->name, w->a);
  return none;
}

static void report_chain(const job *j, node start) {
  node seen[64];
  int ns = 0;
  char end[1200], a[200];
  printf("  wait chain:\n");
  for (node cur = start; cur.d; ) {
    for (int i = 0; i < ns; i++)
      if (seen[i].d == cur.d && seen[i].tid == cur.tid) {
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
        return;
      }
    if (ns == 64) break;
    seen[ns++] = cur;
    cur = step(j, cur, end, sizeof end);
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
      if (o->depth != 0 || o->kind != K_WAIT_BEGIN || o->peer < 0) continue;
      char a[200];
      printf("%s thread %d waits on a call:\n", who(j, d->rank, a, sizeof a), o->tid);
      report_chain(j, (node){d, o->tid});
    }
  }
}

int td_why_hung_main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: tdist-trace why-hung DIR   (DIR holds the workers' *.flight dumps)\n");
    return 2;
  }
  job j = {0};
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
  for (int i = 0; i < j.n; i++) {
    dump *d = &j.d[i];
    for (int g = 0; g < d->ngroups; g++) free(d->groups[g].ranks);
    free(d->groups), free(d->open), free(d->ev), free(d->wnames);
  }
  free(j.d), free(j.names);
  return 0;
}
