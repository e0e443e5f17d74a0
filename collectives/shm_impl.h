/* shm_impl.h - the round protocol of the same-host shared-memory transport, shared by shm.c (the
 * segment, posting, waiting, liveness), shm_coll.c (the staged algorithms: the shared-memory
 * backend) and shm_cma.c (the single-copy algorithms: the CMA backend).
 *
 * The segment holds a control block per member and two round buffers per member. An operation is
 * a sequence of rounds, numbered by one counter that runs on across operations (every member runs
 * the same rounds: their number depends only on the operation's header, which members check to be
 * equal). In round k a member
 *   1. waits until every member has posted round k - 1 (td__shm_reuse): then nobody still reads
 *      the buffer of round k - 2, which round k reuses (buffers alternate by round parity);
 *   2. writes its contribution into its buffer of round k (first round of an operation: also its
 *      header, td__shm_put_header);
 *   3. posts k (td__shm_post: a release store of its round counter, and a futex wake when someone
 *      sleeps);
 *   4. waits until the members it reads from have posted k (td__shm_wait), checks the headers in
 *      the first round of an operation (td__shm_check_headers), and reads their buffers.
 * Reading round k's buffers is over before a member posts k + 1, which is what step 1 relies on.
 */
#ifndef TD_COLLECTIVES_SHM_IMPL_H
#define TD_COLLECTIVES_SHM_IMPL_H

#include "coll_impl.h"

/* ---- shm.c: the transport (setup, teardown, failure) ---- */

/* td__shm_setup decides, collectively with the other members (through the store), whether every
 * member runs on this host and can map one shared segment; sets pg->shm (and pg->shm_buf_bytes,
 * pg->shm_crowded) and *serves, or leaves them unset (then the ring serves). Fails only when the
 * store does, the deadline passes, or TD_COLL_ALGO demands shared memory that cannot be had. */
td_status td__shm_setup(td_process_group *pg, uint64_t deadline, bool *serves);
void td__shm_destroy(td_process_group *pg);
/* td__shm_fail tells the other members' waits that this group failed (after the failure was
 * recorded in the store). */
void td__shm_fail(td_process_group *pg);
/* td__shm_member_alive: the backend table's member_alive (pidfd, else kill and /proc). */
int td__shm_member_alive(td_process_group *pg, int m);
/* td__shm_buf_bytes is the size of one member's buffer for one round. */
size_t td__shm_buf_bytes(const td__shm *s);
/* td__shm_cma: every member can read every other's memory (probed at setup). */
bool td__shm_cma(const td__shm *s);

/* ---- shm_coll.c: the algorithms over the rounds (pg->mu held; h: this member's numbered
 * header, checked against every member's in the first round). direct: all_reduce in one round
 * (the message must fit one buffer). ---- */
td_status td__shm_all_reduce(td_process_group *pg, const td__op_hdr *h, void *data, size_t count,
                             td_dtype dt, td_reduce_op op, bool direct, uint64_t dl);
td_status td__shm_broadcast(td_process_group *pg, const td__op_hdr *h, void *data, size_t nbytes,
                            int root, uint64_t dl);
td_status td__shm_all_gather(td_process_group *pg, const td__op_hdr *h, td__chunk *outs,
                             const void *in, size_t nbytes, uint64_t dl);
td_status td__shm_reduce_scatter(td_process_group *pg, const td__op_hdr *h, void *out,
                                 const char *const *ins, size_t count, td_dtype dt,
                                 td_reduce_op op, uint64_t dl);
td_status td__shm_barrier(td_process_group *pg, const td__op_hdr *h, uint64_t dl);

/* ---- shm.c: the round protocol ---- */

/* td__shm_next_round returns the number of this member's next round (not yet posted). */
uint64_t td__shm_next_round(const td__shm *s);
/* td__shm_buf returns member m's buffer of round k (td__shm_buf_bytes bytes). */
char *td__shm_buf(const td__shm *s, int m, uint64_t k);
/* td__shm_reuse waits until every member posted round k - 1 (step 1 above). */
td_status td__shm_reuse(td_process_group *pg, uint64_t k, const td__op_hdr *h, uint64_t dl);
/* td__shm_put_header publishes h as this member's header of the operation starting in round k. */
void td__shm_put_header(td__shm *s, uint64_t k, const td__op_hdr *h);
/* td__shm_post posts round k (k must be the next round). */
void td__shm_post(td__shm *s, uint64_t k);
/* td__shm_wait waits until member who (or every member when who < 0) posted round k, or fails
 * the group: deadline (naming the members that did not arrive and what they last called), a
 * member's process gone, or another member's failure. h describes the operation for messages. */
td_status td__shm_wait(td_process_group *pg, uint64_t k, int who, const td__op_hdr *h,
                       uint64_t dl);
/* td__shm_check_headers compares every member's header of the operation starting in round k
 * with h (after td__shm_wait(k, all)); a mismatch fails the group with TD_ERR_STATE. */
td_status td__shm_check_headers(td_process_group *pg, uint64_t k, const td__op_hdr *h);

/* Single-copy reads (shm_cma.c): every member may read every other member's memory with
 * process_vm_readv (probed at setup, TD_COLL_CMA=0 turns it off). An operation exposes up to two
 * of its buffers in its first round (td__shm_expose: k is that round); after waiting for that
 * round a member reads them (td__shm_exposed) with td__shm_read, and the owner keeps them
 * unchanged until every reader has posted a later round. */
void td__shm_expose(td__shm *s, uint64_t k, const void *a, const void *b);
const char *td__shm_exposed(const td__shm *s, int m, uint64_t k, int i);
/* td__shm_read copies n bytes at src in member m's memory to dst; failure fails the group. */
td_status td__shm_read(td_process_group *pg, int m, void *dst, const char *src, size_t n,
                       const td__op_hdr *h);

#endif
