/* tdistrun.c - tdist's process launcher (the counterpart of PyTorch's torchrun).
 *
 *   tdistrun [options] PROGRAM [ARGS...]
 *
 * starts --nproc-per-node copies of PROGRAM on this node with the rendezvous variables (RANK,
 * LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT,
 * TD_RESTART_COUNT) in their environment, prefixes every line they print with "[rank]: ", and
 * supervises them: when one fails the whole group is stopped and, while restarts remain, started
 * again. See usage() for the options.
 *
 * Design. One thread, one poll() loop per attempt. Each worker's stdout and stderr are pipes
 * (created O_CLOEXEC, so workers never inherit each other's ends); the loop reads them, splits on
 * '\n' and writes whole prefixed lines to our own stdout/stderr with one write per batch, so lines
 * of different workers never interleave. Partial lines wait in a per-stream buffer and are
 * flushed (with a '\n' added) at EOF; a line longer than MAX_LINE (1 MiB) is cut into pieces of
 * about that size. Signal handlers only record the signal and write a byte to a self-pipe that
 * is part of the poll set (SIGCHLD too), so the loop wakes at once; --monitor-interval is only
 * the fallback polling period.
 * Workers are started with fork() + execvpe(); the child first asks to be killed when tdistrun
 * dies (PR_SET_PDEATHSIG, then checks tdistrun is still its parent, for a launcher killed in
 * between), so a `kill -9` of tdistrun never leaves workers running under init; it also resets
 * the signal mask and the dispositions we change (SIGPIPE is ignored here, default there).
 *
 * Process groups. Workers stay in tdistrun's process group and are always signalled one by one,
 * by pid. Staying in the group means a terminal's Ctrl-C (or a job-control stop) reaches workers
 * directly, as it does for any pipeline, and that a kill of the launcher's group by a batch
 * system reaches them even when tdistrun itself is SIGKILLed. Because such a terminal SIGINT
 * already went to every worker, a SIGINT/SIGTERM/SIGHUP that the kernel generated (si_code
 * SI_KERNEL, i.e. from the tty) is not forwarded a second time; one sent with kill() is
 * forwarded. Either way the stop timer runs and stragglers get SIGKILL; a second signal sends
 * SIGKILL at once. (A group per worker would shield workers from the terminal but leave them
 * running when tdistrun is SIGKILLed.)
 *
 * Output ordering: writes to our stdout/stderr block, so a reader that stops reading stalls the
 * supervisor too (as with torchrun). A worker's stdin is tdistrun's stdin. After the last worker
 * exits, its pipes are drained for at most DRAIN_MS in case a grandchild still holds them.
 *
 * Invariants. tdistrun signals only pids it spawned and only while they are unreaped, so a pid
 * cannot have been recycled by then. Every spawned worker is reaped (waitpid by pid) before an
 * attempt ends; nothing but workers is ever forked, and `tdist-trace why-hung` once a hang is
 * found (--hang-timeout), waited for by its pid.
 *
 * Hangs (--hang-timeout S): the workers' flight recorders (the library's, core/flight.c) write
 * how many events they recorded into TD_FLIGHT_PROGRESS_DIR/.progress.<pid> every second; when
 * none of those numbers moves for S seconds (a worker that never wrote one counts as not
 * moving), every worker gets SIGUSR1 and dumps into TD_FLIGHT_DIR, tdistrun prints `tdist-trace
 * why-hung`'s report and stops the group (exit status 3, no restart). A phase longer than S in
 * which no worker calls into tdist (a long local computation) looks like a hang: pick S above
 * it. The first failure seen (in rank order within one
 * sweep) is the one reported.
 *
 * Under srun (SLURM_NODEID and SLURM_STEP_NUM_NODES or SLURM_NNODES set, no --standalone), the
 * options not given come from Slurm: --nnodes from SLURM_STEP_NUM_NODES (else SLURM_NNODES),
 * --node-rank from SLURM_NODEID, --master-addr from the first host of SLURM_STEP_NODELIST (else
 * SLURM_JOB_NODELIST), --master-port derived from SLURM_JOB_ID (core/netaddr.c, compiled in
 * without the library). srun must then start one tdistrun per node.
 *
 * Exit status: 0 when every worker of an attempt exited 0; 1 when a worker failed and no restarts
 * were left; 128+N when stopped by signal N; 2 for usage errors; 126/127 when PROGRAM cannot be
 * executed / found.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/netaddr.h"

extern char **environ;

#define EXIT_USAGE 2
#define EXIT_HUNG 3
#define HANG_CHECK_MS 500  /* how often --hang-timeout reads the workers' progress */
#define HANG_DUMP_MS 3000  /* after SIGUSR1, how long the workers get to write their dumps */
#define MAX_NPROC 4096     /* workers per node */
#define MAX_LINE (1 << 20) /* bytes; longer lines are cut */
#define READ_CHUNK 65536   /* bytes per read() */
#define DRAIN_MS 1000      /* after the last worker exits, how long to wait for pipe EOF */

/* ---- options ---- */

typedef struct options {
  int nproc;             /* workers on this node; default 1 */
  int nnodes;            /* default 1; --nnodes MIN:MAX: MIN */
  int nnodes_max;        /* --nnodes MIN:MAX: MAX (nodes MIN..MAX-1 join the running group);
                            default nnodes */
  int node_rank;         /* default 0 */
  const char *master_addr; /* default "127.0.0.1" */
  int master_port;       /* 1..65535; -1 = unset (29500, or a free port with --standalone) */
  bool standalone;
  int max_restarts;      /* default 0 */
  int tolerate_failures; /* --tolerate-failures: failed workers (rank > 0) that do not stop the
                            others; default 0 */
  int monitor_ms;        /* fallback polling period, ms; default 100 */
  double stop_timeout_s; /* SIGTERM -> SIGKILL grace, seconds; default 5 */
  bool prefix;           /* default true; --no-prefix clears it */
  const char *rdzv_id;   /* --rdzv-id; NULL: see ensure_run_id */
  bool summary;          /* --summary: a per-worker table at the end */
  double hang_timeout_s; /* --hang-timeout: no progress for this long is a hang; 0: off */
  char **argv;           /* PROGRAM ARGS..., NULL-terminated */
} options;

static void usage(FILE *f) {
  fprintf(f,
    "usage: tdistrun [options] PROGRAM [ARGS...]\n"
    "\n"
    "Starts --nproc-per-node copies of PROGRAM on this node and supervises them.\n"
    "Each worker gets in its environment:\n"
    "  RANK=node_rank*nproc+local_rank  LOCAL_RANK  WORLD_SIZE=nnodes*nproc  LOCAL_WORLD_SIZE\n"
    "  (--nnodes MIN:MAX: WORLD_SIZE=MIN*nproc, TD_RPC_MAX_WORLD_SIZE=MAX*nproc, and RANK=-1 on\n"
    "  the nodes MIN..MAX-1: their workers take free places of the running group)\n"
    "  NODE_RANK  MASTER_ADDR  MASTER_PORT  TD_RESTART_COUNT (attempt number, from 0)\n"
    "  TD_RPC_SECRET: the job secret the workers authenticate each other with; a new random one\n"
    "  per job unless TD_RPC_SECRET or TD_RPC_SECRET_FILE is set (required with --nnodes > 1)\n"
    "  TD_RUN_ID: the job's run id; rank 0 refuses workers of another run at once (two jobs\n"
    "  given the same --master-port never mix)\n"
    "Workers die with tdistrun, even when it is killed with SIGKILL.\n"
    "\n"
    "options (also accepted as --opt=VALUE and with '_' for '-'):\n"
    "  --nproc-per-node N    workers on this node (default 1)\n"
    "  --nnodes N            nodes in the job (default 1)\n"
    "  --nnodes MIN:MAX      an elastic job: nodes 0..MIN-1 start the group, a node started\n"
    "                        later with --node-rank MIN..MAX-1 joins it while it runs (its\n"
    "                        workers wait as spares in gpt --ft; a place is never reused, so a\n"
    "                        replacement node takes a node rank not used before)\n"
    "  --node-rank R         this node's index, 0 <= R < nnodes (default 0)\n"
    "  --master-addr A       rendezvous host (default 127.0.0.1)\n"
    "  --master-port P       rendezvous port, 1..65535 (default 29500)\n"
    "  --standalone          single node; MASTER_PORT is a free port on 127.0.0.1, picked\n"
    "                        again for every restart, unless --master-port is given\n"
    "  --rdzv-id ID          run id shared by every node of the job (default: TD_RUN_ID, else\n"
    "                        the Slurm job and step, else a random id with --nnodes 1)\n"
    "  --max-restarts K      restart the whole group up to K times after a failure (default 0)\n"
    "  --tolerate-failures K up to K workers other than rank 0 may fail without stopping the\n"
    "                        others (programs that survive a lost member, e.g. td_ft_ddp: gpt\n"
    "                        --ft); the job then succeeds when every other worker does (default 0)\n"
    "  --monitor-interval MS fallback period for checking workers, in ms (default 100)\n"
    "  --stop-timeout S      seconds between SIGTERM and SIGKILL when stopping (default 5)\n"
    "  --no-prefix           pass worker output through without the \"[rank]: \" prefix\n"
    "  --summary             at the end, print a table of this node's workers: calls made and\n"
    "                        failed, requests served, bytes sent and received, time in\n"
    "                        handlers, blocked in any wait (futures, RRef fetches, distributed\n"
    "                        backward, collectives) and inside collectives, a straggler score\n"
    "                        (about how long the others waited for it in collectives), restarts\n"
    "  --hang-timeout S      when no worker's flight recorder moves for S seconds, SIGUSR1\n"
    "                        every worker (each dumps it into TD_FLIGHT_DIR, else a new\n"
    "                        directory in ${TMPDIR:-/tmp}), print `tdist-trace why-hung`'s\n"
    "                        report and stop the job with exit status 3 (no restart)\n"
    "  -h, --help            show this text\n"
    "  --                    end of options\n"
    "\n"
    "Under srun (SLURM_NODEID set), options not given come from Slurm: --nnodes from\n"
    "SLURM_STEP_NUM_NODES (or SLURM_NNODES), --node-rank from SLURM_NODEID, --master-addr\n"
    "from the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), --master-port\n"
    "20000 + SLURM_JOB_ID %% 12000. Start one tdistrun per node (srun --ntasks-per-node=1).\n"
    "\n"
    "Output: every line a worker writes is printed as \"[RANK]: line\", stdout to stdout and\n"
    "stderr to stderr. Workers whose stdout is a pipe may buffer it; flush or use line\n"
    "buffering in the worker to see lines as they happen.\n"
    "\n"
    "Failures: when a worker exits non-zero or is killed by a signal, the others get SIGTERM,\n"
    "then SIGKILL after --stop-timeout; the group restarts while restarts remain.\n"
    "SIGINT/SIGTERM/SIGHUP are forwarded to the workers (no restart); a second one kills\n"
    "them.\n"
    "\n"
    "Exit status: 0 all workers succeeded, 1 a worker failed, 128+N stopped by signal N,\n"
    "2 usage error, 3 hung (--hang-timeout), 126/127 PROGRAM could not be executed/found.\n");
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...) {
  va_list ap;
  fputs("tdistrun: ", stderr);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\ntry 'tdistrun --help' for more information\n", stderr);
  return EXIT_USAGE;
}

/* parse_int parses a whole decimal string into [lo, hi]; false otherwise. */
static bool parse_int(const char *s, long lo, long hi, int *out) {
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || errno == ERANGE || v < lo || v > hi) return false;
  *out = (int)v;
  return true;
}

static bool parse_seconds(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (*s == '\0' || *end != '\0' || errno == ERANGE || !(v >= 0) || v > 86400.0) return false;
  *out = v;
  return true;
}

/* ---- Slurm ---- */

static const char *env_nonempty(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

/* apply_slurm fills the options the user did not give from srun's variables (see the file
 * comment). Returns -1 to go on, or an exit status. */
static int apply_slurm(options *o, bool nnodes_given, bool node_rank_given, bool port_given) {
  const char *nodeid = env_nonempty("SLURM_NODEID");
  const char *nn_name = env_nonempty("SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES"
                                                             : "SLURM_NNODES";
  const char *nnodes = env_nonempty(nn_name);
  if (o->standalone || !nodeid || !nnodes) return -1;
  static char master[TD__SLURM_MAX_NAME];
  if (!nnodes_given && !parse_int(nnodes, 1, INT_MAX / MAX_NPROC, &o->nnodes))
    return usage_error("%s='%s' is not a node count", nn_name, nnodes);
  if (!node_rank_given && !parse_int(nodeid, 0, INT_MAX, &o->node_rank))
    return usage_error("SLURM_NODEID='%s' is not a node index", nodeid);
  if (!nnodes_given || !node_rank_given) {
    /* one launcher per node: more tasks than nodes would start the same ranks twice */
    const char *nt_name = env_nonempty("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS"
                                                               : "SLURM_NTASKS";
    const char *nt = env_nonempty(nt_name);
    int ntasks;
    if (nt && parse_int(nt, 1, INT_MAX, &ntasks) && ntasks > o->nnodes)
      return usage_error("under srun tdistrun runs once per node, but this step has %s=%d on "
                         "%d nodes; use srun --ntasks-per-node=1 (or give --nnodes and "
                         "--node-rank)", nt_name, ntasks, o->nnodes);
  }
  if (!o->master_addr) {
    const char *ln = env_nonempty("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST"
                                                         : "SLURM_JOB_NODELIST";
    const char *list = env_nonempty(ln);
    if (list) {
      if (td__slurm_first_host(list, master, sizeof master) != TD_OK)
        return usage_error("cannot take --master-addr from %s: %s", ln, td_last_error());
      o->master_addr = master;
    }
  }
  const char *job = env_nonempty("SLURM_JOB_ID");
  if (!port_given && job && td__slurm_port(job, &o->master_port) != TD_OK)
    return usage_error("cannot derive --master-port: %s", td_last_error());
  fprintf(stderr, "tdistrun: under Slurm: node %d of %d, MASTER_ADDR %s, MASTER_PORT %d\n",
          o->node_rank, o->nnodes, o->master_addr ? o->master_addr : "127.0.0.1",
          o->master_port > 0 ? o->master_port : 29500);
  return -1;
}

/* parse_args fills o from argv. Returns -1 to go on, or an exit status (0 after --help). */
static int parse_args(int argc, char **argv, options *o) {
  *o = (options){.nproc = 1, .nnodes = 1, .nnodes_max = 1, .node_rank = 0, .master_addr = NULL,
                 .master_port = -1, .max_restarts = 0, .monitor_ms = 100,
                 .stop_timeout_s = 5.0, .prefix = true};
  int i = 1;
  bool node_rank_given = false, nnodes_given = false;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--") == 0) {
      i++;
      break;
    }
    if (a[0] != '-' || a[1] == '\0') break; /* PROGRAM */
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    }
    if (a[1] != '-') return usage_error("unknown option '%s'", a);
    /* Normalize: name without "--", '_' -> '-', split "=value". */
    char name[64];
    const char *eq = strchr(a + 2, '=');
    size_t n = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
    if (n == 0 || n >= sizeof name) return usage_error("unknown option '%s'", a);
    for (size_t k = 0; k < n; k++) name[k] = a[2 + k] == '_' ? '-' : a[2 + k];
    name[n] = '\0';

    bool is_flag = strcmp(name, "standalone") == 0 || strcmp(name, "no-prefix") == 0 ||
                   strcmp(name, "summary") == 0;
    if (is_flag) {
      if (eq) return usage_error("option '--%s' takes no value", name);
      if (!strcmp(name, "standalone")) o->standalone = true;
      else if (!strcmp(name, "summary")) o->summary = true;
      else o->prefix = false;
      continue;
    }
    const char *val = eq ? eq + 1 : NULL;
    if (!val) {
      if (i + 1 >= argc) return usage_error("option '--%s' needs a value", name);
      val = argv[++i];
    }
    if (strcmp(name, "nproc-per-node") == 0) {
      if (!parse_int(val, 1, MAX_NPROC, &o->nproc))
        return usage_error("--nproc-per-node must be an integer in 1..%d, got '%s'", MAX_NPROC,
                           val);
    } else if (strcmp(name, "nnodes") == 0) {
      const char *colon = strchr(val, ':');
      char lo[32];
      snprintf(lo, sizeof lo, "%.*s", colon ? (int)(colon - val) : (int)strlen(val), val);
      if (!parse_int(lo, 1, INT_MAX / MAX_NPROC, &o->nnodes) ||
          (colon && (!parse_int(colon + 1, 1, INT_MAX / MAX_NPROC, &o->nnodes_max) ||
                     o->nnodes_max < o->nnodes)))
        return usage_error("--nnodes must be an integer >= 1 or MIN:MAX with 1 <= MIN <= MAX, "
                           "got '%s'", val);
      if (!colon) o->nnodes_max = o->nnodes;
      nnodes_given = true;
    } else if (strcmp(name, "node-rank") == 0) {
      if (!parse_int(val, 0, INT_MAX, &o->node_rank))
        return usage_error("--node-rank must be an integer >= 0, got '%s'", val);
      node_rank_given = true;
    } else if (strcmp(name, "master-addr") == 0) {
      if (val[0] == '\0') return usage_error("--master-addr must not be empty");
      o->master_addr = val;
    } else if (strcmp(name, "master-port") == 0) {
      if (!parse_int(val, 1, 65535, &o->master_port))
        return usage_error("--master-port must be an integer in 1..65535, got '%s'", val);
    } else if (strcmp(name, "rdzv-id") == 0) {
      if (val[0] == '\0' || strlen(val) > 100)
        return usage_error("--rdzv-id must be 1..100 characters, got '%s'", val);
      o->rdzv_id = val;
    } else if (strcmp(name, "tolerate-failures") == 0) {
      if (!parse_int(val, 0, 1000000, &o->tolerate_failures))
        return usage_error("--tolerate-failures must be an integer >= 0, got '%s'", val);
    } else if (strcmp(name, "max-restarts") == 0) {
      if (!parse_int(val, 0, 1000000, &o->max_restarts))
        return usage_error("--max-restarts must be an integer >= 0, got '%s'", val);
    } else if (strcmp(name, "monitor-interval") == 0) {
      if (!parse_int(val, 1, 60000, &o->monitor_ms))
        return usage_error("--monitor-interval must be an integer in 1..60000 (ms), got '%s'",
                           val);
    } else if (strcmp(name, "stop-timeout") == 0) {
      if (!parse_seconds(val, &o->stop_timeout_s))
        return usage_error("--stop-timeout must be a number of seconds in 0..86400, got '%s'",
                           val);
    } else if (strcmp(name, "hang-timeout") == 0) {
      if (!parse_seconds(val, &o->hang_timeout_s) || o->hang_timeout_s <= 0)
        return usage_error("--hang-timeout must be a number of seconds in (0, 86400], got '%s'",
                           val);
    } else {
      return usage_error("unknown option '--%s'", name);
    }
  }
  if (i >= argc) return usage_error("missing PROGRAM");
  if (o->standalone) {
    if ((nnodes_given && (o->nnodes != 1 || o->nnodes_max != 1)) ||
        (node_rank_given && o->node_rank != 0))
      return usage_error("--standalone runs a single node (--nnodes 1, --node-rank 0)");
    if (o->master_addr && strcmp(o->master_addr, "127.0.0.1") != 0)
      return usage_error("--standalone uses MASTER_ADDR 127.0.0.1; drop --master-addr");
  }
  int rc = apply_slurm(o, nnodes_given, node_rank_given, o->master_port > 0);
  if (rc >= 0) return rc;
  if (o->nnodes_max < o->nnodes) o->nnodes_max = o->nnodes; /* (Slurm gave the count) */
  if (o->node_rank >= o->nnodes_max)
    return usage_error("--node-rank %d is out of range for --nnodes %d%s%.0d (must be < %d)",
                       o->node_rank, o->nnodes, o->nnodes_max > o->nnodes ? ":" : "",
                       o->nnodes_max > o->nnodes ? o->nnodes_max : 0, o->nnodes_max);
  if (!o->master_addr) o->master_addr = "127.0.0.1";
  o->argv = argv + i;
  return -1;
}

/* ---- clocks, signals ---- */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int g_wake[2] = {-1, -1};            /* self-pipe: read end polled, write end in handlers */
static volatile sig_atomic_t g_sig_count;   /* SIGINT/SIGTERM/SIGHUP received so far */
static volatile sig_atomic_t g_first_sig;   /* the first of them */
static volatile sig_atomic_t g_first_from_tty; /* 1 when the kernel (tty) sent the first one */

static void wake(void) {
  int saved = errno;
  char c = 0;
  ssize_t r = write(g_wake[1], &c, 1); /* EAGAIN when full: a wake-up is pending anyway */
  (void)r;
  errno = saved;
}

static void on_stop_signal(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  if (g_sig_count == 0) {
    g_first_sig = sig;
    g_first_from_tty = si && si->si_code == SI_KERNEL;
  }
  g_sig_count = g_sig_count + 1;
  wake();
}

static void on_sigchld(int sig) {
  (void)sig;
  wake();
}

static int install_signals(void) {
  if (pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) != 0) return -1;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  sa.sa_sigaction = on_stop_signal;
  if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0 ||
      sigaction(SIGHUP, &sa, NULL) != 0)
    return -1;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sa.sa_handler = on_sigchld;
  if (sigaction(SIGCHLD, &sa, NULL) != 0) return -1;
  signal(SIGPIPE, SIG_IGN); /* a closed stdout must not kill the supervisor */
  return 0;
}

static void drain_wake(void) {
  char buf[256];
  while (read(g_wake[0], buf, sizeof buf) > 0) {
  }
}

/* ---- output ---- */

typedef struct stream {
  int fd;             /* read end of the worker's pipe; -1 when closed or unused */
  int dest;           /* STDOUT_FILENO or STDERR_FILENO */
  const char *prefix; /* "[rank]: ", owned by the worker */
  char *buf;          /* bytes read and not yet written: at most one partial line after emit */
  size_t len, cap;
} stream;

/* write_all writes n bytes to fd; output errors (EPIPE: nobody reads) drop the data. */
static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) { /* a non-blocking stdout we share with someone: wait */
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        poll(&pfd, 1, 100);
        continue;
      }
      return;
    }
    p += w;
    n -= (size_t)w;
  }
}

/* emit writes the complete lines pending in s, each prefixed, with one write, and keeps the
 * rest. At EOF (final), or when the pending partial line reaches MAX_LINE, the rest goes out too,
 * with a '\n' added. */
static void emit(stream *s, bool final) {
  size_t plen = strlen(s->prefix), start = 0, outlen = 0, nlines = 0;
  for (size_t k = 0; k < s->len; k++)
    if (s->buf[k] == '\n') nlines++;
  char *out = malloc(s->len + (nlines + 1) * plen + 1);
  if (!out) { /* no memory: pass the bytes through unprefixed rather than lose them */
    write_all(s->dest, s->buf, s->len);
    s->len = 0;
    return;
  }
  for (size_t k = 0; k < s->len; k++) {
    if (s->buf[k] != '\n') continue;
    memcpy(out + outlen, s->prefix, plen);
    memcpy(out + outlen + plen, s->buf + start, k + 1 - start);
    outlen += plen + k + 1 - start;
    start = k + 1;
  }
  size_t rest = s->len - start;
  if (rest > 0 && (final || rest >= MAX_LINE)) {
    memcpy(out + outlen, s->prefix, plen);
    memcpy(out + outlen + plen, s->buf + start, rest);
    outlen += plen + rest;
    out[outlen++] = '\n';
    start = s->len;
  }
  if (outlen) write_all(s->dest, out, outlen);
  free(out);
  memmove(s->buf, s->buf + start, s->len - start);
  s->len -= start;
}

/* stream_read reads what is available; at EOF or error it flushes the tail and closes fd. */
static void stream_read(stream *s) {
  if (s->cap - s->len < READ_CHUNK) {
    size_t cap = s->cap ? s->cap : READ_CHUNK;
    while (cap - s->len < READ_CHUNK) cap *= 2;
    char *nb = realloc(s->buf, cap);
    if (!nb) {
      emit(s, true); /* makes room by flushing everything */
      if (s->cap - s->len < READ_CHUNK) return;
    } else {
      s->buf = nb;
      s->cap = cap;
    }
  }
  ssize_t r = read(s->fd, s->buf + s->len, READ_CHUNK);
  if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (r <= 0) {
    emit(s, true);
    close(s->fd);
    s->fd = -1;
    return;
  }
  s->len += (size_t)r;
  emit(s, false);
}

/* ---- workers ---- */

typedef struct worker {
  int local_rank, rank;
  pid_t pid;      /* valid while running */
  bool running;   /* spawned and not yet reaped */
  int wstatus;    /* wait status once reaped */
  char prefix[24];
  stream out, err;
} worker;

typedef struct attempt_result {
  enum { ATTEMPT_OK, ATTEMPT_FAILED, ATTEMPT_SIGNALLED, ATTEMPT_SPAWN_ERROR, ATTEMPT_ERROR,
         ATTEMPT_HUNG } kind;
  int failed;  /* index of the failed worker (ATTEMPT_FAILED) */
  int wstatus; /* its wait status */
  int spawn_errno;
} attempt_result;

static const char *const k_env_names[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE",
                                          "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                                          "MASTER_PORT", "TD_RESTART_COUNT",
                                          "TD_RPC_MAX_WORLD_SIZE"};
#define N_ENV (sizeof k_env_names / sizeof k_env_names[0])

/* build_env returns a malloc'ed NULL-terminated copy of environ without our variables, plus
 * ours for worker w, formatted into the caller's vals. Free only the array. NULL on no memory. */
static char **build_env(const options *o, const worker *w, int attempt, int port,
                        char vals[N_ENV][320]) {
  size_t n = 0;
  for (char **e = environ; *e; e++) n++;
  char **env = malloc((n + N_ENV + 1) * sizeof *env);
  if (!env) return NULL;
  size_t k = 0;
  for (char **e = environ; *e; e++) {
    bool ours = false;
    for (size_t j = 0; j < N_ENV && !ours; j++) {
      size_t l = strlen(k_env_names[j]);
      ours = strncmp(*e, k_env_names[j], l) == 0 && (*e)[l] == '=';
    }
    if (!ours) env[k++] = *e;
  }
  long long values[] = {w->rank, w->local_rank, (long long)o->nnodes * o->nproc, o->nproc,
                        o->node_rank, 0, port, attempt, (long long)o->nnodes_max * o->nproc};
  for (size_t j = 0; j < N_ENV; j++) {
    /* (a job of fixed size leaves TD_RPC_MAX_WORLD_SIZE out: a group a worker starts by itself
     * with another world size must not inherit it) */
    if (strcmp(k_env_names[j], "TD_RPC_MAX_WORLD_SIZE") == 0 && o->nnodes_max == o->nnodes)
      continue;
    if (strcmp(k_env_names[j], "MASTER_ADDR") == 0)
      snprintf(vals[j], 320, "MASTER_ADDR=%.256s", o->master_addr);
    else
      snprintf(vals[j], 320, "%s=%lld", k_env_names[j], values[j]);
    env[k++] = vals[j];
  }
  env[k] = NULL;
  return env;
}

/* spawn_worker starts w: fork, then in the child: die with the launcher (PR_SET_PDEATHSIG, and
 * a parent check for a launcher that died before that), default signal handling, the output
 * pipes, exec. An exec failure travels back through a close-on-exec pipe. Returns 0 or an errno
 * value. The child runs only async-signal-safe calls before exec. */
static int spawn_worker(const options *o, worker *w, int attempt, int port) {
  int pout[2] = {-1, -1}, perr[2] = {-1, -1}, perrno[2] = {-1, -1}, rc = 0;
  char vals[N_ENV][320];
  char **env = NULL;

  if (o->prefix && (pipe2(pout, O_CLOEXEC) != 0 || pipe2(perr, O_CLOEXEC) != 0)) {
    rc = errno;
    goto out;
  }
  if (pipe2(perrno, O_CLOEXEC) != 0) {
    rc = errno;
    goto out;
  }
  env = build_env(o, w, attempt, port, vals);
  if (!env) {
    rc = ENOMEM;
    goto out;
  }
  pid_t parent = getpid();
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    rc = errno;
    goto out;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(128 + SIGKILL); /* the launcher is already gone */
    static const int defaults[] = {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD};
    for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++) signal(defaults[i], SIG_DFL);
    sigset_t empty;
    sigemptyset(&empty);
    sigprocmask(SIG_SETMASK, &empty, NULL);
    /* dup2 onto 1/2 clears O_CLOEXEC there; every other pipe end stays close-on-exec */
    if (o->prefix && (dup2(pout[1], STDOUT_FILENO) < 0 || dup2(perr[1], STDERR_FILENO) < 0)) {
      int e = errno;
      ssize_t wr = write(perrno[1], &e, sizeof e);
      (void)wr;
      _exit(127);
    }
    execvpe(o->argv[0], o->argv, env);
    int e = errno;
    ssize_t wr = write(perrno[1], &e, sizeof e);
    (void)wr;
    _exit(127);
  }
  close(perrno[1]);
  perrno[1] = -1;
  int child_errno = 0;
  ssize_t got;
  do {
    got = read(perrno[0], &child_errno, sizeof child_errno);
  } while (got < 0 && errno == EINTR);
  if (got == (ssize_t)sizeof child_errno) { /* exec failed: reap the child, report why */
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    rc = child_errno;
    goto out;
  }
  w->pid = pid;
  w->running = true;
  if (o->prefix) {
    w->out = (stream){.fd = pout[0], .dest = STDOUT_FILENO, .prefix = w->prefix};
    w->err = (stream){.fd = perr[0], .dest = STDERR_FILENO, .prefix = w->prefix};
    pout[0] = perr[0] = -1;
  }
out:
  free(env);
  for (int k = 0; k < 2; k++) {
    if (pout[k] >= 0) close(pout[k]);
    if (perr[k] >= 0) close(perr[k]);
    if (perrno[k] >= 0) close(perrno[k]);
  }
  return rc;
}

static void signal_running(worker *ws, int n, int sig) {
  for (int i = 0; i < n; i++)
    if (ws[i].running) kill(ws[i].pid, sig);
}

static bool failed_status(int st) {
  return WIFSIGNALED(st) || (WIFEXITED(st) && WEXITSTATUS(st) != 0);
}

static void describe_status(int st, char *buf, size_t n) {
  if (WIFSIGNALED(st))
    snprintf(buf, n, "signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
  else
    snprintf(buf, n, "exit code %d", WEXITSTATUS(st));
}

/* free_port asks the kernel for a free TCP port on 127.0.0.1. Returns it, or -1. */
static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  int port = -1;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
    port = ntohs(sa.sin_port);
  close(fd);
  return port;
}

/* ---- --hang-timeout ---- */

/* The job's dump directory (TD_FLIGHT_DIR, exported to the workers), set by hang_setup. */
static char g_flight_dir[1100];

/* hang_setup gives the workers a dump directory (TD_FLIGHT_DIR, or a new one) and asks their
 * flight recorders for progress files there (TD_FLIGHT_PROGRESS_DIR). Returns -1 to go on, or an
 * exit status. */
static int hang_setup(const options *o) {
  if (o->hang_timeout_s <= 0) return -1;
  const char *d = getenv("TD_FLIGHT_DIR");
  if (d && *d) {
    snprintf(g_flight_dir, sizeof g_flight_dir, "%s", d);
    mkdir(g_flight_dir, 0777);
  } else {
    const char *t = getenv("TMPDIR");
    snprintf(g_flight_dir, sizeof g_flight_dir, "%s/tdistrun-flight-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(g_flight_dir)) {
      perror("tdistrun: cannot create a directory for the flight recorder's dumps");
      return 1;
    }
  }
  if (setenv("TD_FLIGHT_DIR", g_flight_dir, 1) != 0 ||
      setenv("TD_FLIGHT_PROGRESS_DIR", g_flight_dir, 1) != 0) {
    perror("tdistrun: setenv");
    return 1;
  }
  return -1;
}

typedef struct hang_watch {
  int64_t last_move_ms;  /* when a worker's progress last moved (or the attempt started) */
  int64_t next_check_ms;
  int64_t report_at_ms;  /* after SIGUSR1: when to read the dumps at the latest; -1: not hung */
  struct timespec signalled; /* CLOCK_REALTIME of the SIGUSR1s (dumps' mtimes compare to it) */
  int signalled_n;       /* workers signalled */
  long long *seen;       /* per worker: its last progress, -1 before its file exists */
} hang_watch;

/* The dumps in the job's directory written since t (each worker's replaces its older one). */
static int fresh_dumps(const struct timespec *t) {
  DIR *d = opendir(g_flight_dir);
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (e->d_name[0] == '.' || l < 8 || strcmp(e->d_name + l - 7, ".flight") != 0) continue;
    char p[1400];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", g_flight_dir, e->d_name);
    if (stat(p, &st) == 0 && (st.st_mtim.tv_sec > t->tv_sec ||
                              (st.st_mtim.tv_sec == t->tv_sec && st.st_mtim.tv_nsec >= t->tv_nsec)))
      n++;
  }
  if (d) closedir(d);
  return n;
}

/* A worker's progress (records its flight recorder claimed), -1 when it wrote none yet. */
static long long read_progress(pid_t pid) {
  char p[1200], b[32];
  snprintf(p, sizeof p, "%s/.progress.%d", g_flight_dir, (int)pid);
  int fd = open(p, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  ssize_t r = pread(fd, b, sizeof b - 1, 0);
  close(fd);
  if (r <= 0) return -1;
  b[r] = 0;
  return atoll(b);
}

/* hang_due tells whether no running worker's progress moved for --hang-timeout. The clock runs
 * only once every running worker has written progress (its library is up): start-up has its own
 * deadline (the rendezvous'), and a slow start is not a hang. */
static bool hang_due(const options *o, hang_watch *h, const worker *ws, int n, int64_t t) {
  if (t < h->next_check_ms) return false;
  h->next_check_ms = t + HANG_CHECK_MS;
  bool all = true;
  for (int i = 0; i < n; i++) {
    if (!ws[i].running) continue;
    long long v = read_progress(ws[i].pid);
    if (v != h->seen[i]) h->seen[i] = v, h->last_move_ms = t;
    all = all && v >= 0;
  }
  if (!all) h->last_move_ms = t;
  return t - h->last_move_ms >= (int64_t)(o->hang_timeout_s * 1000);
}

/* hang_report runs `tdist-trace why-hung` (beside this program) on the dumps, its report on our
 * stdout; it reads local files only, so it is waited for without a bound. */
static void hang_report(const options *o) {
  char tool[4200];
  ssize_t k = readlink("/proc/self/exe", tool, sizeof tool - 16);
  if (k <= 0) k = 0;
  tool[k] = 0;
  char *slash = strrchr(tool, '/');
  snprintf(slash ? slash + 1 : tool, sizeof tool - (size_t)(slash ? slash + 1 - tool : 0),
           "tdist-trace");
  fprintf(stderr, "tdistrun: no worker made progress for %g s; their flight recorders are in %s\n",
          o->hang_timeout_s, g_flight_dir);
  fflush(stdout);
  fflush(stderr);
  pid_t p = fork();
  if (p == 0) {
    execl(tool, tool, "why-hung", g_flight_dir, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  while (p > 0 && waitpid(p, &st, 0) < 0 && errno == EINTR) {
  }
  if (p < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
    fprintf(stderr, "tdistrun: %s why-hung %s did not run to the end\n", tool, g_flight_dir);
}

/* hang_step watches for a hang (--hang-timeout) while the group runs: once due, every worker
 * gets SIGUSR1 and up to HANG_DUMP_MS to dump (less once every one has); then the report, and
 * the group stops. Returns true when the group must stop now. */
static bool hang_step(const options *o, hang_watch *h, worker *ws, int n) {
  int64_t t = now_ms();
  if (h->report_at_ms < 0) {
    if (!hang_due(o, h, ws, n, t)) return false;
    clock_gettime(CLOCK_REALTIME, &h->signalled);
    h->signalled.tv_sec -= 1; /* file times may trail the clock by a tick: count generously */
    h->signalled_n = 0;
    for (int i = 0; i < n; i++) h->signalled_n += ws[i].running;
    signal_running(ws, n, SIGUSR1);
    h->report_at_ms = t + HANG_DUMP_MS;
    h->next_check_ms = t + 100;
    return false;
  }
  if (t < h->report_at_ms && t < h->next_check_ms) return false;
  h->next_check_ms = t + 100;
  int alive = 0;
  for (int i = 0; i < n; i++) alive += ws[i].running;
  /* read them now when every worker has dumped, or none is left to (the loop ends with them) */
  if (t < h->report_at_ms && alive > 0 && fresh_dumps(&h->signalled) < h->signalled_n)
    return false;
  hang_report(o);
  return true;
}

/* run_attempt starts the group, supervises it until every worker is reaped and its output
 * drained, and says how it ended. */
static attempt_result run_attempt(const options *o, int attempt, int port) {
  attempt_result res = {.kind = ATTEMPT_OK, .failed = -1};
  int n = o->nproc;
  worker *ws = calloc((size_t)n, sizeof *ws);
  struct pollfd *pfds = calloc((size_t)(2 * n + 1), sizeof *pfds);
  stream **pstreams = calloc((size_t)(2 * n + 1), sizeof *pstreams);
  if (!ws || !pfds || !pstreams) {
    fprintf(stderr, "tdistrun: out of memory\n");
    exit(1);
  }
  int running = 0;
  bool stopping = false, killed = false;
  int64_t kill_at = 0, drain_until = -1;
  int sigs_seen = 0, tolerated = 0;
  bool sweep = true;     /* reap on this pass: set by SIGCHLD wake-ups and every monitor_ms */
  int64_t next_sweep = 0; /* when the fallback sweep is due */
  hang_watch hang = {.last_move_ms = now_ms(), .report_at_ms = -1,
                     .seen = malloc((size_t)n * sizeof(long long))};
  if (!hang.seen) {
    fprintf(stderr, "tdistrun: out of memory\n");
    exit(1);
  }
  for (int i = 0; i < n; i++) hang.seen[i] = -1;

  for (int i = 0; i < n; i++) {
    worker *w = &ws[i];
    w->local_rank = i;
    /* a node past MIN of --nnodes MIN:MAX joins the running group: its workers learn their
     * ranks there (RANK=-1); their output is prefixed with the node and local rank */
    w->rank = o->node_rank >= o->nnodes ? -1 : o->node_rank * o->nproc + i;
    w->out.fd = w->err.fd = -1;
    if (w->rank >= 0) snprintf(w->prefix, sizeof w->prefix, "[%d]: ", w->rank);
    else snprintf(w->prefix, sizeof w->prefix, "[node%d.%d]: ", o->node_rank, i);
  }
  for (int i = 0; i < n; i++) {
    worker *w = &ws[i];
    if (g_sig_count > 0) break; /* a stop signal during start-up: start no more */
    int rc = spawn_worker(o, w, attempt, port);
    if (rc != 0) {
      fprintf(stderr, "tdistrun: cannot start worker rank %d: %s: %s\n", w->rank, o->argv[0],
              strerror(rc));
      res.kind = ATTEMPT_SPAWN_ERROR;
      res.spawn_errno = rc;
      stopping = true;
      kill_at = now_ms() + (int64_t)(o->stop_timeout_s * 1000);
      signal_running(ws, n, SIGTERM);
      break;
    }
    running++;
  }

  for (;;) {
    /* 1. Stop signals (the loop wakes through the self-pipe). */
    int sc = g_sig_count;
    if (sc > sigs_seen) {
      if (res.kind != ATTEMPT_SPAWN_ERROR) res.kind = ATTEMPT_SIGNALLED;
      if (sc >= 2 && !killed) {
        signal_running(ws, n, SIGKILL);
        killed = true;
      } else if (sigs_seen == 0) {
        if (!g_first_from_tty) signal_running(ws, n, g_first_sig);
        if (!stopping) kill_at = now_ms() + (int64_t)(o->stop_timeout_s * 1000);
        stopping = true;
      }
      sigs_seen = sc;
    }
    /* 2. Reap, in rank order, after SIGCHLD or each --monitor-interval; the first failure stops
     *    the group. */
    if (now_ms() >= next_sweep) sweep = true;
    if (sweep) next_sweep = now_ms() + o->monitor_ms;
    for (int i = 0; sweep && i < n; i++) {
      worker *w = &ws[i];
      if (!w->running) continue;
      int st;
      pid_t r = waitpid(w->pid, &st, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      w->running = false; /* reaped (or ECHILD, which cannot happen: we never reap others) */
      w->wstatus = r < 0 ? 0 : st;
      running--;
      /* a worker that dies of the SIGUSR1 of a hang (no handler) is part of the hang's report */
      if (r > 0 && failed_status(st) && !stopping && hang.report_at_ms < 0 && w->rank != 0 &&
          tolerated < o->tolerate_failures) {
        char what[96];
        describe_status(st, what, sizeof what);
        tolerated++;
        fprintf(stderr, "tdistrun: worker rank %d (local %d) failed with %s; the others go on "
                "(%d of %d tolerated failures, --tolerate-failures)\n", w->rank, i, what,
                tolerated, o->tolerate_failures);
        continue;
      }
      if (r > 0 && failed_status(st) && !stopping && hang.report_at_ms < 0) {
        res.kind = ATTEMPT_FAILED;
        res.failed = i;
        res.wstatus = st;
        stopping = true;
        kill_at = now_ms() + (int64_t)(o->stop_timeout_s * 1000);
        signal_running(ws, n, SIGTERM);
      }
    }
    sweep = false;
    /* 2b. A hang (--hang-timeout): dumps, the report, then the group stops (also when workers
     *     died of the SIGUSR1 meanwhile). */
    if (o->hang_timeout_s > 0 && !stopping && (running > 0 || hang.report_at_ms >= 0) &&
        hang_step(o, &hang, ws, n)) {
      res.kind = ATTEMPT_HUNG;
      stopping = true;
      kill_at = now_ms() + (int64_t)(o->stop_timeout_s * 1000);
      signal_running(ws, n, SIGTERM);
    }
    /* 3. Escalate after the grace period. */
    int64_t t = now_ms();
    if (stopping && !killed && running > 0 && t >= kill_at) {
      signal_running(ws, n, SIGKILL);
      killed = true;
    }
    /* 4. Done when all are reaped and their pipes drained (bounded: a grandchild may hold a
     *    pipe open). */
    int np = 0;
    pfds[np++] = (struct pollfd){.fd = g_wake[0], .events = POLLIN};
    for (int i = 0; i < n; i++) {
      stream *ss[2] = {&ws[i].out, &ws[i].err};
      for (int k = 0; k < 2; k++) {
        if (ss[k]->fd < 0) continue;
        pstreams[np] = ss[k];
        pfds[np++] = (struct pollfd){.fd = ss[k]->fd, .events = POLLIN};
      }
    }
    if (running == 0) {
      if (drain_until < 0) drain_until = t + DRAIN_MS;
      if (np == 1 || t >= drain_until) break;
    }
    int timeout = o->monitor_ms;
    if (stopping && !killed && running > 0 && kill_at - t < timeout)
      timeout = (int)(kill_at - t > 0 ? kill_at - t : 0);
    if (running == 0 && drain_until - t < timeout) timeout = (int)(drain_until - t);
    int pr = poll(pfds, (nfds_t)np, timeout);
    if (pr < 0 && errno != EINTR) { /* cannot supervise any more: end the attempt hard */
      perror("tdistrun: poll");
      if (!killed) signal_running(ws, n, SIGKILL);
      killed = stopping = true;
      res.kind = ATTEMPT_ERROR;
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (pr <= 0) continue;
    if (pfds[0].revents) {
      drain_wake();
      sweep = true;
    }
    for (int k = 1; k < np; k++)
      if (pfds[k].revents) stream_read(pstreams[k]);
  }

  for (int i = 0; i < n; i++) {
    stream *ss[2] = {&ws[i].out, &ws[i].err};
    for (int k = 0; k < 2; k++) {
      if (ss[k]->fd >= 0) {
        emit(ss[k], true);
        close(ss[k]->fd);
      }
      free(ss[k]->buf);
    }
  }
  free(ws);
  free(pfds);
  free(pstreams);
  free(hang.seen);
  return res;
}

/* ---- the job secret ---- */

/* ensure_secret gives the workers a job secret (authentication of the group, see the library's
 * docs/SECURITY.md): the one in TD_RPC_SECRET / TD_RPC_SECRET_FILE when set, else a new random
 * one for a single-node job, handed to the workers through their environment (never on a command
 * line, never in the store). A job over several nodes needs the same secret on every node: then
 * the user must provide it. Returns -1 to go on, or an exit status. */
static int ensure_secret(const options *o) {
  const char *s = getenv("TD_RPC_SECRET"), *f = getenv("TD_RPC_SECRET_FILE");
  const char *ins = getenv("TD_RPC_INSECURE");
  if ((s && *s) || (f && *f) || (ins && strcmp(ins, "1") == 0)) return -1;
  if (o->nnodes_max > 1) {
    fprintf(stderr,
            "tdistrun: a job over %d nodes needs one secret on every node: put it in a file only "
            "you can read on a filesystem all nodes see, e.g.\n"
            "  (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n' > ~/.tdist-secret)\n"
            "and set TD_RPC_SECRET_FILE=~/.tdist-secret for every tdistrun (or TD_RPC_INSECURE=1 "
            "to run without authentication)\n", o->nnodes_max);
    return 2;
  }
  unsigned char b[32];
  size_t got = 0;
  while (got < sizeof b) {
    ssize_t n = getrandom(b + got, sizeof b - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      perror("tdistrun: getrandom");
      return 1;
    }
    got += (size_t)n;
  }
  char hex[65];
  for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", b[i]);
  memset(b, 0, sizeof b);
  int rc = setenv("TD_RPC_SECRET", hex, 1);
  memset(hex, 0, sizeof hex);
  if (rc != 0) {
    perror("tdistrun: setenv");
    return 1;
  }
  return -1;
}

/* ensure_run_id sets TD_RUN_ID for the workers: --rdzv-id, else TD_RUN_ID as given, else the
 * Slurm job and step (the same in every node's tdistrun), else a random id for a single node.
 * Several nodes without any of these share no id; they get a warning. Returns -1 to go on. */
static int ensure_run_id(const options *o) {
  char id[160];
  const char *job = env_nonempty("SLURM_JOB_ID"), *step = env_nonempty("SLURM_STEP_ID");
  if (o->rdzv_id) {
    snprintf(id, sizeof id, "%s", o->rdzv_id);
  } else if (env_nonempty("TD_RUN_ID")) {
    return -1;
  } else if (job && !o->standalone) {
    snprintf(id, sizeof id, "slurm:%s.%s", job, step ? step : "batch");
  } else if (o->nnodes_max == 1) {
    unsigned char b[8];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
      perror("tdistrun: getrandom");
      return 1;
    }
    snprintf(id, sizeof id, "tdistrun:%02x%02x%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2], b[3],
             b[4], b[5], b[6], b[7]);
  } else {
    fprintf(stderr, "tdistrun: no --rdzv-id for a job over %d nodes: another job given the same "
            "--master-port could join this one; pass the same --rdzv-id to every node\n",
            o->nnodes);
    return -1;
  }
  if (setenv("TD_RUN_ID", id, 1) != 0) {
    perror("tdistrun: setenv");
    return 1;
  }
  return -1;
}

/* ---- --summary: each worker's agent writes its totals at shutdown into TD_SUMMARY_DIR ---- */

static char g_summary_dir[64];
static int g_restarts; /* attempts started minus one */
static int run(const options *o);

static int summary_start(const options *o) {
  if (!o->summary) return -1;
  snprintf(g_summary_dir, sizeof g_summary_dir, "/tmp/tdistrun-summary.XXXXXX");
  if (!mkdtemp(g_summary_dir) || setenv("TD_SUMMARY_DIR", g_summary_dir, 1) != 0) {
    perror("tdistrun: --summary");
    return 1;
  }
  return -1;
}

/* summary_value reads "key value" from a worker's file (text holds the whole file). */
static const char *summary_value(const char *text, const char *key, char *buf, size_t n) {
  size_t k = strlen(key);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (strncmp(p, key, k) == 0 && p[k] == ' ') {
      size_t len = strcspn(p + k + 1, "\n");
      snprintf(buf, n, "%.*s", (int)len, p + k + 1);
      return buf;
    }
  }
  snprintf(buf, n, "-");
  return buf;
}

/* One worker's line of the summary: the keys below, read from its file ("-" when absent). */
enum { SK_NAME, SK_CALLS, SK_FAILED, SK_SERVED, SK_SENT, SK_RECV, SK_HANDLER, SK_WAIT,
       SK_DIRECT_RECV, SK_DIRECT_SENT, SK_COLL, SK_COUNT };
static const char *const summary_keys[SK_COUNT] = {
    "name",   "calls",     "calls_failed",          "requests",          "bytes_sent",
    "bytes_received", "handler_s", "wait_s", "direct_bytes_received", "direct_bytes_sent",
    "coll_s"};

/* The table: per worker, calls made and failed, requests served, megabytes out and in (streams
 * plus same-host copies), seconds in handlers, seconds blocked in any wait (futures, RRef
 * fetches, distributed backward, collectives), seconds inside collectives, and the straggler
 * score: how much less time it spent inside collectives than the node's worker that spent the
 * most, i.e. about how long the others waited for it to arrive (a synchronous collective ends at
 * the same moment on every member, so who enters last waits least). */
static void summary_print(const options *o, int restarts) {
  if (!o->summary || !g_summary_dir[0]) return;
  fprintf(stderr, "tdistrun: summary of node %d (%d restart%s; workers that never shut their agent "
          "down show '-')\n", o->node_rank, restarts, restarts == 1 ? "" : "s");
  fprintf(stderr, "  %5s %-16s %9s %7s %9s %11s %11s %11s %10s %9s %11s\n", "rank", "worker",
          "calls", "failed", "served", "sent MB", "recv MB", "handlers s", "waiting s", "coll s",
          "straggler s");
  char(*v)[SK_COUNT][160] = calloc((size_t)(o->nproc > 0 ? o->nproc : 1), sizeof *v);
  bool *have = calloc((size_t)(o->nproc > 0 ? o->nproc : 1), sizeof *have);
  double most_coll = 0;
  for (int l = 0; v && have && l < o->nproc; l++) {
    int rank = o->node_rank * o->nproc + l;
    char path[128], text[4096] = "";
    snprintf(path, sizeof path, "%s/%d.txt", g_summary_dir, rank);
    FILE *f = fopen(path, "r");
    if (f) {
      size_t got = fread(text, 1, sizeof text - 1, f);
      text[got] = 0;
      fclose(f);
      unlink(path);
    }
    have[l] = f != NULL;
    for (int k = 0; k < SK_COUNT; k++) summary_value(text, summary_keys[k], v[l][k], 160);
    if (have[l] && atof(v[l][SK_COLL]) > most_coll) most_coll = atof(v[l][SK_COLL]);
  }
  for (int l = 0; v && have && l < o->nproc; l++) {
    int rank = o->node_rank * o->nproc + l;
    if (!have[l]) {
      fprintf(stderr, "  %5d %-16s %9s %7s %9s %11s %11s %11s %10s %9s %11s\n", rank, "-", "-",
              "-", "-", "-", "-", "-", "-", "-", "-");
      continue;
    }
    /* bytes over the streams plus same-host direct copies */
    double mb_out = (atof(v[l][SK_SENT]) + atof(v[l][SK_DIRECT_SENT])) / 1e6;
    double mb_in = (atof(v[l][SK_RECV]) + atof(v[l][SK_DIRECT_RECV])) / 1e6;
    fprintf(stderr, "  %5d %-16.16s %9s %7s %9s %11.1f %11.1f %11s %10s %9s %11.3f\n", rank,
            v[l][SK_NAME], v[l][SK_CALLS], v[l][SK_FAILED], v[l][SK_SERVED], mb_out, mb_in,
            v[l][SK_HANDLER], v[l][SK_WAIT], v[l][SK_COLL], most_coll - atof(v[l][SK_COLL]));
  }
  free(v);
  free(have);
  rmdir(g_summary_dir);
}

int main(int argc, char **argv) {
  options o;
  int rc = parse_args(argc, argv, &o);
  if (rc >= 0) return rc;
  if ((rc = ensure_secret(&o)) >= 0) return rc;
  if ((rc = ensure_run_id(&o)) >= 0) return rc;
  if ((rc = summary_start(&o)) >= 0) return rc;
  rc = run(&o);
  summary_print(&o, g_restarts);
  return rc;
}

/* run supervises the attempts; returns tdistrun's exit status. */
static int run(const options *o_) {
  options o = *o_;
  int hs = hang_setup(&o);
  if (hs >= 0) return hs;
  if (install_signals() != 0) {
    perror("tdistrun: signal setup");
    return 1;
  }
  for (int attempt = 0;; attempt++) {
    if (g_sig_count > 0) {
      fprintf(stderr, "tdistrun: stopped by signal %d (%s)\n", (int)g_first_sig,
              strsignal(g_first_sig));
      return 128 + g_first_sig;
    }
    int port = o.master_port > 0 ? o.master_port : 29500;
    if (o.standalone && o.master_port < 0) {
      port = free_port();
      if (port < 0) {
        perror("tdistrun: cannot find a free port on 127.0.0.1");
        return 1;
      }
    }
    g_restarts = attempt;
    attempt_result r = run_attempt(&o, attempt, port);
    if (r.kind == ATTEMPT_SPAWN_ERROR) return r.spawn_errno == ENOENT ? 127 : 126;
    if (r.kind == ATTEMPT_ERROR) return 1;
    if (r.kind == ATTEMPT_SIGNALLED) {
      int sig = g_first_sig ? g_first_sig : SIGKILL;
      fprintf(stderr, "tdistrun: stopped by signal %d (%s)\n", sig, strsignal(sig));
      return 128 + sig;
    }
    if (r.kind == ATTEMPT_OK) return 0;
    if (r.kind == ATTEMPT_HUNG) {
      fprintf(stderr, "tdistrun: stopped the hung job (exit status %d, no restart)\n", EXIT_HUNG);
      return EXIT_HUNG;
    }
    char what[96];
    describe_status(r.wstatus, what, sizeof what);
    int rank = o.node_rank * o.nproc + r.failed;
    if (attempt < o.max_restarts) {
      fprintf(stderr,
              "tdistrun: worker rank %d (local %d) failed with %s; restarting the group "
              "(restart %d of %d)\n",
              rank, r.failed, what, attempt + 1, o.max_restarts);
      continue;
    }
    fprintf(stderr, "tdistrun: worker rank %d (local %d) failed with %s; no restarts left "
                    "(%d used)\n",
            rank, r.failed, what, attempt);
    return 1;
  }
}
