/* why_hung_read.c - reading the flight recorder's dumps for `tdist-trace why-hung` and putting
 * what they hold into words (tools/why_hung.c finds the root causes).
 *
 * Plain C, no library: it relies on the dump's line format ("key value" header lines, then
 * "open"/"ev" records: tag depth ts tid kind peer a b c x y name) and on the numbering of record
 * kinds (core/flight_impl.h), dtypes (tdist/tensor.h) and algorithms (collectives/coll_impl.h),
 * mirrored in the tables below. A worker without a dump is looked up in DIR/<name>.proc and, on
 * this host, in /proc.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "why_hung_impl.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *const kind_words[K_COUNT] = {
    "none",        "coll_enter",   "coll_exit",   "rpc_send",  "rpc_done",    "rpc_recv",
    "handler_start", "handler_end", "wait_begin", "wait_end",  "dump",        "scope_begin",
    "scope_end",   "rref_fork",    "rref_confirm", "rref_delete", "bwd_send", "bwd_recv"};
static const char *const dtype_names[] = {"float32", "float64", "int64",  "float16",
                                          "bfloat16", "int32",   "uint8", "bool"};
static const char *const algo_names[] = {
    "local", "nccl", "ring", "shm_direct", "shm_rsag", "shm_bcast", "shm_gather",
    "shm_scatter", "shm_barrier", "cma_rsag", "cma_bcast", "cma_gather", "cma_scatter"};

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
  if (sscanf(line, "dropped %llu", &d->dropped) == 1) return 0;
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

int td__wh_load(const char *dir, job *j) {
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

const char *td__wh_who(const job *j, int rank, char *buf, size_t n) {
  if (rank >= 0 && rank < j->world && j->names[rank][0])
    snprintf(buf, n, "%s (rank %d)", j->names[rank], rank);
  else snprintf(buf, n, "rank %d", rank);
  return buf;
}

dump *td__wh_dump_of(const job *j, int rank) {
  for (int i = 0; i < j->n; i++)
    if (j->d[i].rank == rank) return &j->d[i];
  return NULL;
}

/* A record's time in seconds after the job's first dump (rank 0's clock; earlier: negative). */
double td__wh_rel_s(const job *j, const dump *d, unsigned long long ts) {
  return ((double)(long long)(ts + (unsigned long long)d->offset) - (double)(long long)j->t0) * 1e-9;
}

/* An RRef or context id as tdist prints them: "creator rank:counter". */
const char *td__wh_subj_words(int kind, unsigned long long id, char *buf, size_t n) {
  if (kind == SUBJ_RREF) snprintf(buf, n, "RRef %llu:%llu", id >> 48, id & ((1ull << 48) - 1));
  else if (kind == SUBJ_CTX)
    snprintf(buf, n, "context %llu:%llu", id >> 48, id & ((1ull << 48) - 1));
  else buf[0] = 0;
  return buf;
}

/* ", about RRef 0:3" after a call's words, or "". */
const char *td__wh_about(int kind, unsigned long long id, char *buf, size_t n) {
  char s[80];
  if (kind == SUBJ_RREF || kind == SUBJ_CTX)
    snprintf(buf, n, ", %s%s", kind == SUBJ_CTX ? "in " : "about ", td__wh_subj_words(kind, id, s, sizeof s));
  else buf[0] = 0;
  return buf;
}

/* td__wh_about() for a call: an RRef request goes to the RRef's owner (__rref_confirm goes from it). */
const char *td__wh_about_call(const job *j, const char *fn, int callee, int kind,
                              unsigned long long id, char *buf, size_t n) {
  char w[200];
  td__wh_about(kind, id, buf, n);
  if (kind == SUBJ_RREF && strncmp(fn, "__rref_", 7) == 0 && strcmp(fn, "__rref_confirm") != 0) {
    size_t l = strlen(buf);
    snprintf(buf + l, n - l, " (owned by %s)", td__wh_who(j, callee, w, sizeof w));
  }
  return buf;
}

void td__wh_describe_coll(const rec *r, char *buf, size_t n) {
  const char *dt = r->x < sizeof dtype_names / sizeof *dtype_names ? dtype_names[r->x] : "?";
  const char *al = r->y < sizeof algo_names / sizeof *algo_names ? algo_names[r->y] : "?";
  if (strcmp(r->name, "barrier") == 0)
    snprintf(buf, n, "barrier #%llu (group %d)", r->a, r->peer);
  else
    snprintf(buf, n, "%s #%llu (%s x %u, %llu bytes, group %d, algorithm %s)", r->name, r->a, dt,
             r->c, r->b, r->peer, al);
}

void td__wh_describe(const job *j, const rec *r, char *buf, size_t n) {
  char w[200], ab[120];
  switch (r->kind) {
    case K_COLL_ENTER: {
      char c[200];
      td__wh_describe_coll(r, c, sizeof c);
      snprintf(buf, n, "in %s", c);
      break;
    }
    case K_HANDLER_START:
      if (r->a)
        snprintf(buf, n, "in handler %s (call #%llu from %s%s)", r->name, r->a,
                 td__wh_who(j, r->peer, w, sizeof w), td__wh_about(r->y, r->b, ab, sizeof ab));
      else /* a function an RRef request runs on the pool (its creation, a proxy call) */
        snprintf(buf, n, "running %s for %s%s", r->name, td__wh_who(j, r->peer, w, sizeof w),
                 td__wh_about(r->y, r->b, ab, sizeof ab));
      break;
    case K_WAIT_BEGIN: {
      char set[64] = "";
      if (r->x == 1) snprintf(set, sizeof set, " (td_future_wait_all of %u, first not done)", r->c);
      if (r->peer >= 0)
        snprintf(buf, n, "waiting on call %s #%llu to %s%s%s", r->name, r->a,
                 td__wh_who(j, r->peer, w, sizeof w),
                 td__wh_about_call(j, r->name, r->peer, r->y, r->b, ab, sizeof ab), set);
      else if (!strcmp(r->name, "pg_reform")) /* td_process_group_reform: a bounded store wait */
        snprintf(buf, n, "re-forming process group %llu as generation %llu (waiting for the "
                 "survivors through the store)", r->a, r->b);
      else snprintf(buf, n, "waiting on a future%s%s", td__wh_about(r->y, r->b, ab, sizeof ab), set);
      break;
    }
    case K_SCOPE_BEGIN:
      snprintf(buf, n, "in %s%s", r->name, td__wh_about(r->y, r->b, ab, sizeof ab));
      break;
    default: snprintf(buf, n, "%s %s", kind_words[r->kind], r->name);
  }
}

/* The open records of thread tid in d, outermost first (indices into d->open). */
int td__wh_thread_stack(const dump *d, int tid, int *idx, int max) {
  int k = 0;
  for (int i = 0; i < d->nopen && k < max; i++)
    if (d->open[i].tid == tid) idx[k++] = i;
  return k;
}

const rec *td__wh_innermost(const dump *d, int tid) {
  int idx[16];
  int k = td__wh_thread_stack(d, tid, idx, 16);
  return k ? &d->open[idx[k - 1]] : NULL;
}

/* ---- workers without a dump ---- */

/* What became of a worker that left no dump, from DIR/<name>.proc (pid, host, start time, written
 * at its start) and /proc on this host: "dead: ...", "stopped: ..." or why it cannot be told. */
void td__wh_fate(const job *j, int rank, char *buf, size_t n) {
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
void td__wh_peers_view(const job *j, int rank, char *buf, size_t n) {
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
      if (heard && (!lr || td__wh_rel_s(j, d, r->ts) > last)) last = td__wh_rel_s(j, d, r->ts), ld = d, lr = r;
    }
  }
  size_t len = 0;
  buf[0] = 0;
  if (lr)
    len = (size_t)snprintf(buf, n, "last heard from at %+.3f s (%s %s #%llu at %s)", last,
                           lr->kind == K_RPC_RECV ? "request" : "reply to", lr->name, lr->a,
                           td__wh_who(j, ld->rank, w, sizeof w));
  if (lost && len < n)
    snprintf(buf + len, n - len, "%s%d call%s to it failed with its connection lost",
             len ? "; " : "", lost, lost == 1 ? "" : "s");
}

void td__wh_print_workers(const job *j) {
  char w[200], line[400];
  for (int r = 0; r < j->world; r++) {
    dump *d = td__wh_dump_of(j, r);
    if (!d) {
      char f[300], pv[400];
      td__wh_fate(j, r, f, sizeof f);
      td__wh_peers_view(j, r, pv, sizeof pv);
      printf("%s: no dump: %s%s%s\n", td__wh_who(j, r, w, sizeof w), f, pv[0] ? "; peers: " : "", pv);
      continue;
    }
    printf("%s, pid %d, dumped at %+.3f s (%s)", td__wh_who(j, r, w, sizeof w), d->pid,
           td__wh_rel_s(j, d, d->now), d->reason);
    if (d->dropped) /* a record the ring lacks may be one of these (flight.c, td__flight_write) */
      printf(", %llu record%s dropped", d->dropped, d->dropped == 1 ? "" : "s");
    printf(":\n");
    int shown = 0;
    for (int i = 0; i < d->nopen; i++) {
      if (i > 0 && d->open[i].tid == d->open[i - 1].tid) continue;
      int idx[16], k = td__wh_thread_stack(d, d->open[i].tid, idx, 16);
      printf("  thread %d:", d->open[i].tid);
      for (int m = 0; m < k; m++) {
        const rec *o = &d->open[idx[m]];
        td__wh_describe(j, o, line, sizeof line);
        printf("%s %s for %.3f s", m ? "," : "", line, (double)(d->now - o->ts) * 1e-9);
      }
      printf("\n");
      shown++;
    }
    if (!shown) printf("  no thread waits in tdist (running user code, or idle)\n");
  }
}

void td__wh_free(job *j) {
  for (int i = 0; i < j->n; i++) {
    dump *d = &j->d[i];
    for (int g = 0; g < d->ngroups; g++) free(d->groups[g].ranks);
    free(d->groups), free(d->open), free(d->ev), free(d->wnames);
  }
  free(j->d), free(j->names);
}
