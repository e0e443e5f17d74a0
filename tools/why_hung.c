/* why_hung.c - `tdist-trace why-hung DIR`: reads the flight recorder dumps of a job's workers
 * (DIR/<worker>.flight, written by core/flight.c; read by why_hung_read.c) and says in plain words
 * what holds the job.
 *
 * It prints, per worker, what each of its threads waits in (the dump's open records, outermost
 * first, with how long on the worker's clock; a worker without a dump: dead, stopped, or silent),
 * then the root causes it finds, each on a line starting "culprit: ":
 *   - collectives: for each group with a member inside an operation, the members that never
 *     entered that operation (their last one on the group, and what they wait in instead) and the
 *     members that entered it with another kind, size or dtype than the majority (a mismatch);
 *     then cycles of such waits across groups (collectives called in different orders);
 *   - RPC waits: from each thread at the top of a wait, a chain of links, each a call: the one the
 *     thread waits on, or this worker's pending call about the RRef or context its wait or scope
 *     is about, or a graceful shutdown's outstanding calls. A call leads to the callee's thread
 *     serving it; to the callee's work on the same RRef or context when its handler returned a
 *     future; through a call queued behind busy handler threads (or the verdict that nested calls
 *     exhausted the pool); through a request waiting for an RRef argument's confirmation to the
 *     fork's parent and owner. It ends at a thread that waits on no other worker, a worker
 *     without a dump, or a cycle;
 *   - RRefs a worker holds that their owner never confirmed.
 * Dump times are put on rank 0's clock with each worker's offset (as `merge` does).
 *
 * Exit status: 0 report printed, 1 no readable dump, 2 usage.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "why_hung.h"
#include "why_hung_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    td__wh_describe(j, td__wh_innermost(d, d->open[i].tid), buf, n);
    return;
  }
  snprintf(buf, n, "it waits in nothing tdist records (user code, or a wait outside tdist)");
}

static void report_group(const job *j, int gid) {
  const group *g = find_group(j, (unsigned long long)gid);
  if (!g) return;
  unsigned long long seq = ~0ull;
  for (int m = 0; m < g->size; m++) {
    const rec *o = open_coll(td__wh_dump_of(j, g->ranks[m]), gid);
    if (o && o->a < seq) seq = o->a;
  }
  const rec *ref = NULL; /* the majority's version of operation #seq */
  int best = 0;
  for (int m = 0; m < g->size; m++) {
    const rec *o = open_coll(td__wh_dump_of(j, g->ranks[m]), gid);
    if (!o || o->a != seq) continue;
    int votes = 0;
    for (int k = 0; k < g->size; k++) {
      const rec *p = open_coll(td__wh_dump_of(j, g->ranks[k]), gid);
      if (p && p->a == seq && same_op(o, p)) votes++;
    }
    if (votes > best) best = votes, ref = o;
  }
  if (!ref) return; /* the member inside an operation is not listed in the group's members */
  char op[300], w[200], what[300];
  td__wh_describe_coll(ref, op, sizeof op);
  for (int m = 0; m < g->size; m++) {
    int r = g->ranks[m];
    dump *d = td__wh_dump_of(j, r);
    const rec *o = open_coll(d, gid);
    td__wh_who(j, r, w, sizeof w);
    if (!d) {
      char f[300];
      td__wh_fate(j, r, f, sizeof f);
      printf("culprit: %s never entered %s: it left no dump: %s\n", w, op, f);
    } else if (o && o->a == seq && !same_op(o, ref)) {
      td__wh_describe_coll(o, what, sizeof what);
      printf("culprit: %s entered %s where %d other member%s entered %s: mismatched "
             "collectives\n", w, what, best, best == 1 ? "" : "s", op);
    } else if (!o || o->a != seq) {
      const rec *l = last_coll(d, gid);
      char last[300] = "none recorded";
      if (o) td__wh_describe_coll(o, last, sizeof last);
      else if (l) td__wh_describe_coll(l, last, sizeof last);
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
    const dump *d = td__wh_dump_of(j, r);
    for (int k = 0; d && k < d->nopen && next[r] < 0; k++) {
      const rec *o = &d->open[k];
      const group *g = o->kind == K_COLL_ENTER ? find_group(j, (unsigned long long)o->peer) : NULL;
      for (int m = 0; g && m < g->size && next[r] < 0; m++) {
        const dump *md = td__wh_dump_of(j, g->ranks[m]);
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
      td__wh_describe_coll(in[q], op, sizeof op);
      printf("%s%s waits in %s, which %s never entered", q == s ? "" : "; ",
             td__wh_who(j, q, a, sizeof a), op, td__wh_who(j, next[q], b, sizeof b));
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
  int idx[16], k = td__wh_thread_stack(d, tid, idx, 16);
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
    const rec *in = td__wh_innermost(d, o->tid);
    (*busy)++;
    if (in && in->kind == K_WAIT_BEGIN && in->peer == d->rank) (*nested)++;
    if (pick < 0 || (in && in->kind == K_WAIT_BEGIN)) pick = o->tid;
    char w[200];
    int k = snprintf(buf + len, n - len, "%shandler %s (from %s)", len ? ", " : "", o->name,
                     td__wh_who(j, o->peer, w, sizeof w));
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

/* The parent's outstanding __rref_fork for the unconfirmed fork of RRef id that d holds: false
 * when d holds none, or its parent left no dump or no such call. */
static bool fork_of(const job *j, const dump *d, unsigned long long id, call *out) {
  for (int i = d->nev - 1; i >= 0; i--) {
    const rec *u = &d->ev[i];
    if (u->kind != K_RREF_FORK || u->x != 1 || u->a != id) continue;
    const dump *parent = td__wh_dump_of(j, (int)u->c);
    call fk[4];
    memset(fk, 0, sizeof fk);
    int k = parent ? pending_calls(parent, SUBJ_RREF, id, fk, 4) : 0;
    for (int q = 0; q < k && q < 4; q++)
      if (fk[q].callee == u->peer && strncmp(fk[q].name, "__rref_fork", sizeof fk[q].name) == 0) {
        *out = fk[q];
        return true;
      }
    return false;
  }
  return false;
}

/* A call received but never started: the handler threads are busy (the next link is one of them,
 * or the pool is exhausted by calls queued behind their own handlers), or the request waits for
 * the confirmation of an RRef among its arguments (the next link is the fork's parent). */
static node queued(const job *j, const call *c, const dump *p, int depth, char *end, size_t n) {
  char a[200], b[600], o[200], ab[120];
  node none = {NULL, 0};
  int busy, nested;
  int q = busy_handlers(j, p, b, sizeof b, &busy, &nested);
  td__wh_who(j, p->rank, a, sizeof a);
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
    td__wh_subj_words(SUBJ_RREF, u->a, rs, sizeof rs);
    printf("    %s received %s #%llu but holds %s (from %s) that its owner %s never confirmed: "
           "the request waits for the confirmation\n", a, c->name, c->id, rs,
           td__wh_who(j, (int)u->c, b, sizeof b), td__wh_who(j, u->peer, o, sizeof o));
    const dump *parent = td__wh_dump_of(j, (int)u->c);
    call fk[4];
    memset(fk, 0, sizeof fk);
    int k = parent ? pending_calls(parent, SUBJ_RREF, u->a, fk, 4) : 0;
    for (int i = 0; i < k && i < 4; i++) {
      const call *x = &fk[i];
      if (x->callee != u->peer || strncmp(x->name, "__rref_fork", sizeof x->name) != 0) continue;
      printf("    %s sent %s #%llu to %s%s, still unanswered\n", td__wh_who(j, parent->rank, b, sizeof b),
             x->name, x->id, o, td__wh_about_call(j, x->name, x->callee, x->sk, x->sid, ab, sizeof ab));
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
  const dump *p = td__wh_dump_of(j, c->callee);
  td__wh_who(j, c->callee, a, sizeof a);
  td__wh_about_call(j, c->name, c->callee, c->sk, c->sid, ab, sizeof ab);
  if (depth > 16) {
    snprintf(end, n, "the chain is too long to follow");
    return none;
  }
  if (!p) {
    td__wh_fate(j, c->callee, f, sizeof f);
    td__wh_peers_view(j, c->callee, pv, sizeof pv);
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
    td__wh_subj_words(sk, he->b, sw, sizeof sw);
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
             td__wh_who(j, next[0].callee, f, sizeof f), td__wh_about_call(j, next[0].name, next[0].callee, next[0].sk, next[0].sid, ab, sizeof ab),
             find_ev(p, K_RPC_DONE, next[0].callee, next[0].id) ? "the one that failed"
                                                               : "outstanding");
      return follow_call(j, &next[0], depth + 1, end, n);
    }
    snprintf(end, n, "%s: the reply to %s #%llu waits on %s, and nothing on %s works on it", a,
             c->name, c->id, sw, p->name);
    return none;
  }
  if (he) {
    /* a reply sent moments before the caller's dump is on its way, not a cause */
    double age = td__wh_rel_s(j, c->from, c->from->now) - td__wh_rel_s(j, p, he->ts);
    if (age < 1.0)
      snprintf(end, n, "note: %s finished %s #%llu %.3f s before the caller's dump: its reply was "
               "on its way", a, c->name, c->id, age);
    else
      snprintf(end, n, "%s finished %s #%llu %.3f s before the caller's dump: its reply is lost or "
               "late", a, c->name, c->id, age);
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
  const rec *w = td__wh_innermost(cur.d, cur.tid);
  char a[200], b[400];
  td__wh_who(j, cur.d->rank, a, sizeof a);
  if (!w) {
    snprintf(end, n, "a thread without an open record (the dump changed under the reader)");
    return false;
  }
  td__wh_describe(j, w, b, sizeof b);
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
             out->name, out->id, td__wh_who(j, out->callee, c, sizeof c),
             td__wh_about_call(j, out->name, out->callee, out->sk, out->sid, ab, sizeof ab));
      return true;
    }
    if (s && s->y == SUBJ_RREF && fork_of(j, cur.d, s->b, out)) { /* waits for a confirmation */
      char c[200], o[200];
      printf("    %s thread %d: %s; the RRef's owner %s has not confirmed this worker's fork: "
             "its parent %s sent %s #%llu\n", a, cur.tid, b,
             td__wh_who(j, out->callee, o, sizeof o), td__wh_who(j, out->from->rank, c, sizeof c),
             out->name, out->id);
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
    const rec *w = td__wh_innermost(seen[k].d, seen[k].tid);
    const rec *h = NULL;
    int idx[16], m = td__wh_thread_stack(seen[k].d, seen[k].tid, idx, 16);
    for (int q = 0; q < m; q++)
      if (seen[k].d->open[idx[q]].kind == K_HANDLER_START) h = &seen[k].d->open[idx[q]];
    printf("%s%s%s%s waits on %s", k > i ? " -> " : "", td__wh_who(j, seen[k].d->rank, a, sizeof a),
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
      const rec *w = td__wh_innermost(cur.d, cur.tid);
      if (w) {
        td__wh_describe(j, w, b, sizeof b);
        if (w->kind == K_WAIT_BEGIN && w->peer >= 0)
          printf("    %s thread %d: %s\n", td__wh_who(j, cur.d->rank, a, sizeof a), cur.tid, b);
      }
      have = waited_call(j, cur, &c, end, sizeof end);
    }
    cur = have ? follow_call(j, &c, 0, end, sizeof end) : (node){NULL, 0};
    if (!cur.d) {
      printf("%s%s\n", strncmp(end, "note: ", 6) == 0 ? "" : "culprit: ", end);
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
      const rec *in = td__wh_innermost(d, o->tid);
      bool shutdown = in->kind == K_SCOPE_BEGIN && strcmp(in->name, "rpc_shutdown") == 0;
      if (in->kind != K_WAIT_BEGIN && in->kind != K_SCOPE_BEGIN) continue; /* e.g. a collective */
      if (!(in->kind == K_WAIT_BEGIN && in->peer >= 0) && !shutdown &&
          !stack_subject(d, o->tid))
        continue; /* a wait on a future nothing says more about (the listing shows it) */
      char a[200], b[400], b2[400], ab[120], c[200];
      td__wh_describe(j, o, b, sizeof b);
      td__wh_describe(j, in, b2, sizeof b2);
      printf("%s thread %d is %s%s%s:\n", td__wh_who(j, d->rank, a, sizeof a), o->tid, b,
             in != o ? ", " : "", in != o ? b2 : "");
      if (shutdown) {
        call pc[4];
        int np = pending_calls(d, -1, 0, pc, 4);
        for (int q = 0; q < np; q++) { /* shutdown waits for every outstanding call */
          printf("  outstanding call %s #%llu to %s%s:\n", pc[q].name, pc[q].id,
                 td__wh_who(j, pc[q].callee, c, sizeof c), td__wh_about_call(j, pc[q].name, pc[q].callee, pc[q].sk, pc[q].sid, ab, sizeof ab));
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
      td__wh_subj_words(SUBJ_RREF, r->a, rs, sizeof rs);
      printf("unconfirmed: %s holds %s (fork %llu:%llu, from %s) that its owner %s never "
             "confirmed\n", td__wh_who(j, d->rank, a, sizeof a), rs, r->b >> 48,
             r->b & ((1ull << 48) - 1), td__wh_who(j, (int)r->c, pa, sizeof pa),
             td__wh_who(j, r->peer, o, sizeof o));
    }
  }
}

int td_why_hung_main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: tdist-trace why-hung DIR   (DIR holds the workers' *.flight dumps)\n");
    return 2;
  }
  job j = {.dir = argv[2]};
  if (td__wh_load(argv[2], &j) != 0) return 1;
  if (j.n == 0) {
    fprintf(stderr, "tdist-trace: no *.flight dumps in %s\n", argv[2]);
    return 1;
  }
  printf("why-hung: %d dump%s of %d worker%s in %s\n\n", j.n, j.n == 1 ? "" : "s", j.world,
         j.world == 1 ? "" : "s", argv[2]);
  td__wh_print_workers(&j);
  printf("\nroot causes:\n");
  report_collectives(&j);
  report_rpc(&j);
  report_rrefs(&j);
  td__wh_free(&j);
  return 0;
}
