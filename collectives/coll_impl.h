/* coll_impl.h - internals shared by the process-group files:
 *   process_group.c  creation (group id and addresses through the store), ring connections,
 *                    the deadline-bound exchange primitive, failure reporting;
 *   ring.c           the CPU ring algorithms and the public operation entry points;
 *   ddp.c            the data-parallel gradient helper;
 *   nccl/nccl_backend.c  the NCCL backend (only in builds with NCCL; the only file including
 *                    CUDA or NCCL headers).
 */
#ifndef TD_COLLECTIVES_IMPL_H
#define TD_COLLECTIVES_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "../rpc/store.h"
#include "tdist/collectives.h"

#define TD__PG_DEFAULT_TIMEOUT_MS 60000

typedef struct td__nccl td__nccl;

struct td_process_group {
  td_rpc_agent *agent;
  const td__store_client *sc; /* the agent's store client (borrowed) */
  uint64_t id;                /* agreed through the store counter "pg/next_id" */
  int rank, size;             /* group rank and size */
  int *ranks;                 /* size global ranks, increasing */
  char (*names)[128];         /* worker names by group rank */
  td_pg_backend backend;
  int64_t timeout_ms;
  int send_fd; /* connection to the right neighbour (rank + 1), -1 when size == 1 */
  int recv_fd; /* connection from the left neighbour (rank - 1), -1 when size == 1 */
  pthread_mutex_t mu; /* one operation at a time; guards everything below */
  uint64_t seq;       /* operations started */
  bool broken;
  td_status broken_status;
  char *broken_msg;
  uint8_t *scratch; /* reused buffer for ring operations */
  size_t scratch_cap;
  td__nccl *nccl; /* NCCL communicator (TD_PG_BACKEND_NCCL) */
};

/* "worker2 (rank 2)" for group rank grank, written into buf (at least 160 bytes). */
const char *td__pg_who(const td_process_group *pg, int grank, char *buf, size_t n);

/* td__pg_deadline returns the monotonic deadline (ns) of an operation starting now. */
uint64_t td__pg_deadline(const td_process_group *pg);

/* td__pg_xchg sends sn bytes of sbuf to the right neighbour while receiving rn bytes from the
 * left one into rbuf, until both are done or deadline_ns passes. A closed connection is
 * TD_ERR_UNAVAILABLE, a deadline TD_ERR_TIMEOUT, both naming the neighbour and op; the group is
 * then failed (td__pg_fail). pg->mu held. */
td_status td__pg_xchg(td_process_group *pg, const void *sbuf, size_t sn, void *rbuf, size_t rn,
                      uint64_t deadline_ns, const char *op);

/* td__pg_fail marks the group broken after a local observation (status st, message msg) and
 * returns the status to report: when another member already recorded a failure in the store
 * (the root cause, e.g. the member that saw a peer die), that one is reported; otherwise this
 * one is recorded for the others. Closes the connections, so the neighbours notice at once.
 * Sets td_last_error. pg->mu held. */
td_status td__pg_fail(td_process_group *pg, td_status st, const char *msg);

/* td__pg_scratch makes pg->scratch at least n bytes. pg->mu held. */
td_status td__pg_scratch(td_process_group *pg, size_t n);

/* td__pg_store_prefix writes "pg/<id>/" + suffix into buf. */
const char *td__pg_key(const td_process_group *pg, const char *suffix, char *buf, size_t n);

#ifdef TD_HAVE_NCCL
/* NCCL backend (nccl/nccl_backend.c). create is collective over the group (readiness records and
 * the unique id over the ring, then a non-blocking communicator setup bounded by the group's
 * deadline); the operations take contiguous CUDA tensors on the communicator's device and wait
 * for completion with the group's deadline, watching the members (aborting the communicator and
 * failing the group on an error, a dead member or the deadline). */
td_status td__nccl_create(td_process_group *pg, td__nccl **out);
void td__nccl_destroy(td__nccl *c);
td_status td__nccl_all_reduce(td_process_group *pg, td_tensor *t, td_reduce_op op);
td_status td__nccl_broadcast(td_process_group *pg, td_tensor *t, int root);
td_status td__nccl_all_gather(td_process_group *pg, void *out, const void *in, size_t count,
                              td_dtype dt);
td_status td__nccl_reduce_scatter(td_process_group *pg, void *out, const void *in, size_t count,
                                  td_dtype dt, td_reduce_op op);
int td__nccl_device(const td__nccl *c);
/* td__nccl_test_before_enqueue, when set (tests only; NULL otherwise), runs in every NCCL
 * operation after the header check, right before the operation is enqueued: a fault-injection
 * point for tests of members that die inside a collective. */
extern void (*td__nccl_test_before_enqueue)(td_process_group *pg, const char *what);
#endif

#endif
