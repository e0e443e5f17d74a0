/* why_hung_impl.h - what the files of `tdist-trace why-hung` share (tools/why_hung_read.c reads
 * the dumps and words what they hold; tools/why_hung.c finds the root causes). */
#ifndef TD_TOOLS_WHY_HUNG_IMPL_H
#define TD_TOOLS_WHY_HUNG_IMPL_H

#include <stdbool.h>
#include <stddef.h>

/* record kinds, in core/flight_impl.h's order (td__flight_kind) */
enum { K_NONE, K_COLL_ENTER, K_COLL_EXIT, K_RPC_SEND, K_RPC_DONE, K_RPC_RECV, K_HANDLER_START,
       K_HANDLER_END, K_WAIT_BEGIN, K_WAIT_END, K_DUMP, K_SCOPE_BEGIN, K_SCOPE_END, K_RREF_FORK,
       K_RREF_CONFIRM, K_RREF_DELETE, K_BWD_SEND, K_BWD_RECV, K_COUNT };

/* subjects (a record's y where its kind has one; the id in b), and the statuses (tdist/status.h)
 * a call can end with */
enum { SUBJ_NONE, SUBJ_RREF, SUBJ_CTX };
enum { ST_OK = 0, ST_TIMEOUT = 9, ST_UNAVAILABLE = 14 };

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
  unsigned long long dropped; /* records its writers dropped (the ring may miss them) */
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

/* td__wh_load reads DIR's dumps into j (j->dir set by the caller); 0, or -1 said on stderr. */
int td__wh_load(const char *dir, job *j);
void td__wh_free(job *j);

/* Words: "worker1 (rank 1)"; a record's time on rank 0's clock after the job's first dump; an
 * RRef or context id; ", about RRef 0:3" (and for an RRef request, its owner); a collective; any
 * open record. Each writes into buf and returns it. */
const char *td__wh_who(const job *j, int rank, char *buf, size_t n);
dump *td__wh_dump_of(const job *j, int rank);
double td__wh_rel_s(const job *j, const dump *d, unsigned long long ts);
const char *td__wh_subj_words(int kind, unsigned long long id, char *buf, size_t n);
const char *td__wh_about(int kind, unsigned long long id, char *buf, size_t n);
const char *td__wh_about_call(const job *j, const char *fn, int callee, int kind,
                              unsigned long long id, char *buf, size_t n);
void td__wh_describe_coll(const rec *r, char *buf, size_t n);
void td__wh_describe(const job *j, const rec *r, char *buf, size_t n);

/* A thread's open records, outermost first (indices into d->open); its innermost or NULL. */
int td__wh_thread_stack(const dump *d, int tid, int *idx, int max);
const rec *td__wh_innermost(const dump *d, int tid);

/* A worker without a dump: what became of it (dead, stopped, alive but silent: its .proc file and
 * /proc), and what its peers recorded of it. */
void td__wh_fate(const job *j, int rank, char *buf, size_t n);
void td__wh_peers_view(const job *j, int rank, char *buf, size_t n);
/* Every worker's threads and what they wait in. */
void td__wh_print_workers(const job *j);

#endif
