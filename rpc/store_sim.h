/* store_sim.h - the rendezvous store's protocol played by N simulated workers in one process
 * (internal; bench/rpc_scale and tests/rpc/test_store use it).
 *
 * Groups larger than a machine can start (1,024 workers on 2 CPUs) are measured here: one thread
 * per simulated worker sends the store requests a worker sends (rendezvous.c: check, claim,
 * publish, join, read, ready, passed; shutdown.c: the graceful barrier), with the same waits and
 * backoff, through the real client (store.c) and the real authenticated sessions (auth.c) to the
 * real server table, handled one request at a time as rank 0's poller does. Each request and its
 * reply are counted per phase (requests, bytes both ways, time the server spent on them), so the
 * growth of store traffic with N can be read and checked. The network, gRPC and the processes
 * themselves are not simulated. The sequence mirrors rendezvous.c and shutdown.c step by step
 * (store_sim.c names the function each step follows): change them together.
 *
 * THREAD SAFETY: td__store_sim_run blocks until every simulated worker is done; one at a time.
 */
#ifndef TD_RPC_STORE_SIM_H
#define TD_RPC_STORE_SIM_H

#include "../core/core.h"

enum {
  TD__SIM_CHECK,    /* world size and run id */
  TD__SIM_PUBLISH,  /* claim, worker/, registry/, direct/, devmap/ records */
  TD__SIM_JOIN,     /* the joined counter, waiting for every worker */
  TD__SIM_READ,     /* every worker's records in range requests, directok/ */
  TD__SIM_READY,    /* the ready barrier, then who reads us directly */
  TD__SIM_PASSED,   /* the passed counter (rank 0 waits for it) */
  TD__SIM_SHUTDOWN, /* the graceful barrier to sd/go and sd/exited */
  TD__SIM_PHASES
};

typedef struct td__store_sim_opts {
  int world;          /* simulated workers */
  int registry_bytes; /* each worker's registry record (function names; default 600) */
  int stagger_ms;     /* workers start spread evenly over this (process start-up; default 0) */
  int64_t timeout_ms; /* every wait's deadline (default 120000) */
  bool probe_at_init; /* workers without mailboxes: each reads every worker's directok/ */
} td__store_sim_opts;

typedef struct td__store_sim_phase {
  uint64_t requests;  /* store requests, session openings included */
  uint64_t bytes_out; /* request bytes (client -> store), MACs and session headers included */
  uint64_t bytes_in;  /* reply bytes */
  uint64_t server_ns; /* time the server spent handling them */
} td__store_sim_phase;

typedef struct td__store_sim_result {
  td__store_sim_phase phase[TD__SIM_PHASES];
  double wall_s; /* from the first worker's start to the last worker's end */
} td__store_sim_result;

/* td__store_sim_run plays the protocol with o->world workers and fills *out. Fails when a
 * simulated worker's step fails (its error in td_last_error). */
td_status td__store_sim_run(const td__store_sim_opts *o, td__store_sim_result *out);
/* td__store_sim_phase_name: "check", "publish", ... (never NULL). */
const char *td__store_sim_phase_name(int phase);

#endif
