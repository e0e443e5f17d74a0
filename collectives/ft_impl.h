/* ft_impl.h - what the fault-tolerant data-parallel steps share (ft_ddp.c here, zero/ft_zero.c):
 * fault injection, re-formation with its report line, the flat copy of the .grads, the
 * reassignment of a lost member's shards of the batch, and the check of a group this member
 * failed. Implemented in ft_common.c; nothing here is public API.
 */
#ifndef TD_COLLECTIVES_FT_IMPL_H
#define TD_COLLECTIVES_FT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/core.h"
#include "tdist/collectives.h"

#define TD__FT_MAX_INJECT 16

typedef struct td__ft_inject {
  int rank;
  int64_t step;
  td_ft_when when;
  td_ft_what what;
  bool fired;
} td__ft_inject;

/* The injections registered on one td_ft_ddp or td_ft_zero (each fires once). */
typedef struct td__ft_injector {
  td__ft_inject inj[TD__FT_MAX_INJECT];
  int n;
} td__ft_injector;

/* td__ft_inject_add registers an injection; TD_ERR_INVALID when full, or for a point after
 * `last` (DDP has no all-gather) or an unknown fault. what: the caller's name for messages. */
td_status td__ft_inject_add(td__ft_injector *fi, int rank, int64_t step, td_ft_when when,
                            td_ft_what what, td_ft_when last, const char *what_fn);
/* td__ft_inject_at fires the injections due on this member (its global rank in pg's agent) at
 * step and point `when`: SIGKILL or SIGSTOP of itself, or the group failed as a closed connection
 * would fail it. */
void td__ft_inject_at(td__ft_injector *fi, td_process_group *pg, int64_t step, td_ft_when when);
/* td__ft_inject_due says whether an injection at (step, when) is pending on any rank. */
bool td__ft_inject_due(const td__ft_injector *fi, int64_t step, td_ft_when when);

/* td__ft_say appends printf output to buf (n bytes, len used); returns the new length. */
size_t td__ft_say(char *buf, size_t n, size_t len, const char *fmt, ...) TD_PRINTF(4, 5);

/* td__ft_group_rank returns the group rank of global rank `global` in pg, or -1. */
int td__ft_group_rank(const td_process_group *pg, int global);

/* td__ft_reform re-forms *pg (generation + 1 among the live members; a few tries, a failure of
 * the new group while it connects forming the generation after), replaces *pg by the new group
 * (destroying the old one unless it is `given`, the caller's) and appends to msg "step k,
 * generation g: <why>; lost: workerN (rank N), ...; generation g+1 formed with a of b members in
 * t s" (and "; joined (a spare): ..." for spares admitted). *lost: the members lost; *joined
 * (may be NULL): the spares admitted (td_process_group_spare), members of the new group that
 * were not in the old one. */
td_status td__ft_reform(td_process_group *given, td_process_group **pg, td_timeout_ms timeout,
                        int64_t step, const char *why, char *msg, size_t n, size_t *len,
                        int *lost, int *joined);

/* td__ft_take_grads copies the .grads of params[0..np) (contiguous CPU tensors of dtype dt, P
 * elements in all) into a new flat tensor (zeros for a parameter without one); own_s (may be
 * NULL): the copy's time is added there (td__ft_own). */
td_status td__ft_take_grads(td_tensor *const *params, size_t np, int64_t P, td_dtype dt,
                            td_tensor **out, double *own_s);

/* td__ft_own adds the seconds since t0 (td__now_ns) to *own_s, unless own_s is NULL: the
 * accounting of td_ft_step_info.machinery_s, the fault tolerance's own time in a step. */
void td__ft_own(double *own_s, uint64_t t0);

/* td__ft_reassign gives the shards s of owner[0..M) (global ranks) whose holder is no longer in
 * pg each to the member holding the fewest (ties: the lowest group rank), in shard order, alike
 * on every member; drops grad[s] of each moved shard (grad may be NULL) and appends
 * "; re-sharded: shard s -> workerN (rank N), ..." to msg. Returns the shards moved, -1 out of
 * memory. */
int td__ft_reassign(td_process_group *pg, int *owner, int M, td_tensor **grad, char *msg,
                    size_t n, size_t *len);

/* td__ft_broken returns TD_ERR_UNAVAILABLE (with the group's failure message) when an operation
 * of this member failed pg, else TD_OK. */
td_status td__ft_broken(td_process_group *pg);

/* td__ft_who writes "workerN (rank N)" for group rank grank of pg into buf (160 bytes). */
const char *td__ft_who(const td_process_group *pg, int grank, char *buf, size_t n);

/* td__ft_bcast_packed broadcasts ts[0..n) (CPU tensors of the same shapes on every member) from
 * group rank root: runs of small contiguous tensors (under 256 KiB) of one element size go
 * packed into pieces of up to 8 MiB (one collective per piece instead of one per tensor),
 * larger ones alone. *bytes (may
 * be NULL): their bytes are added there. */
td_status td__ft_bcast_packed(td_process_group *pg, td_tensor *const *ts, size_t n, int root,
                              int64_t *bytes);

#endif
