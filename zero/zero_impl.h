/* zero_impl.h - ZeRO's internals, shared by zero.c (stages 1 and 2, the step, overlap),
 * zero3.c (stage 3: units gathered around their forward and backward) and zero_ckpt.c (sharded
 * checkpoints). ZeRO is a layer above collectives/ (the public process-group API and replicas.h)
 * and optim/ (the optimizer over the shard); nothing below it calls into it.
 */
#ifndef TD_ZERO_IMPL_H
#define TD_ZERO_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../collectives/replicas.h"
#include "../core/core.h"
#include "tdist/collectives.h"
#include "tdist/optim.h"


/* A ZeRO bucket: parameters order[first, first + count) laid end to end (numel elements), padded
 * to size * chunk; member r owns elements [r * chunk, (r + 1) * chunk) of it, which sit at
 * shard_off in its shard gradient. */
typedef struct td__zbucket {
  size_t first, count;
  int64_t numel, chunk, shard_off;
  /* overlapped pass (stage 2 with overlap) */
  td_tensor *buf;   /* size * chunk elements, from the first gradient to the start; else NULL */
  size_t ready;     /* parameters whose gradient arrived */
  td_future *work;  /* its reduce_scatter, once started */
  bool late;        /* a gradient arrived after the start: reduced again at the step */
  int64_t nbytes;   /* its buffer's bytes */
  bool released;    /* its bytes no longer counted in owner->inflight (atomic) */
  struct td_zero *owner;
} td__zbucket;

/* A piece of a parameter in this member's shard: elements [off, off + len) of parameter param
 * (flat, row-major), at shard_off in the shard, in bucket bucket. */
typedef struct td__zseg {
  size_t param, bucket;
  int64_t off, len, shard_off;
} td__zseg;

struct td_zero {
  td_process_group *pg;
  td_zero_options zo;
  size_t np;
  td_tensor **params;   /* owned references, in flat order (the groups' order) */
  size_t *order;        /* bucket layout: order[k] is the parameter at position k */
  size_t *bucket_of;    /* per parameter */
  int64_t *offset;      /* per parameter: element offset in its bucket */
  td__zbucket *b;
  size_t nb;
  size_t nseg;
  td__zseg *segs;
  td_tensor **seg;      /* per segment: the 1-D master values (owned) */
  td_optim *opt;        /* over seg (NULL when this member owns no element) */
  td_optim_kind okind;  /* its kind (checkpoints) */
  double *norm_w;       /* per parameter: weight of its squares in the clipping norm, or NULL */
  td_dtype dt;
  td_device dev;
  /* overlapped passes */
  void *hctx;           /* per parameter: hook context */
  int *hook_handle;
  bool *seen, *late;    /* per parameter, this pass */
  bool armed;
  bool no_sync;         /* td_zero_no_sync: passes prepared now accumulate */
  bool pass_sync;       /* the armed pass reduces (else it accumulates into the buckets) */
  bool window;          /* bucket buffers hold gradients of no_sync passes not reduced yet */
  size_t pending;       /* parameter whose .grad is dropped at the next hook (np: none) */
  size_t next_bucket;
  size_t oldest;        /* started buckets [oldest, next_bucket) may still be in flight */
  td_tensor *sgrad;     /* the pass's shard gradient (S elements) */
  int64_t inflight;     /* bytes of bucket buffers allocated and not yet reduced (atomic: the
                           group's worker thread subtracts) */
  td_status hook_st;
  char hook_msg[512];
  td_zero_stats stats;
  /* stage 3 (zero3.c) */
  size_t nu;             /* units */
  size_t nub;            /* their buckets: b[0..nub), the last unit's first */
  struct td__zunit *u;
  int *unit_of;          /* per parameter: its unit, or -1 */
  bool pinned;           /* td_zero_gather_params: units stay gathered */
  int64_t live_bytes;    /* bytes of unit parameters gathered now */
  int64_t gather_bytes;  /* bytes of all_gather output buffers alive now (gathers in flight) */
};

/* td__zero_bucket_part returns this member's part of bucket k (chunk elements: its segments'
 * master values, zeros in the padding), what the all_gathers of the parameters send. (zero.c) */
td_status td__zero_bucket_part(td_zero *z, size_t k, td_tensor **out);

/* ---- zero3.c: stage 3 ---- */

/* td__zero3_plan lays out the buckets of a stage-3 td_zero (each unit's parameters in buckets of
 * bucket_bytes of their own, last unit first, then the other parameters) and returns S. z->params set; units from
 * z->zo. */
td_status td__zero3_plan(td_zero *z, int64_t *S);
/* td__zero3_start sets the units' forward hooks and frees their parameters (after the segments
 * were made from them). */
td_status td__zero3_start(td_zero *z);
/* td__zero3_unit_ready: bucket k's gradients are all in (a hook): frees its unit's parameters. */
void td__zero3_unit_ready(td_zero *z, size_t k);
/* td__zero3_begin_pass: a pass is prepared; each unit's count of complete buckets restarts (so a
 * unit is freed once per backward, also in the passes of a gradient-accumulation window). */
void td__zero3_begin_pass(td_zero *z);
/* td__zero3_end_pass waits for gathers in flight and frees every gathered unit (unless pinned):
 * at a step, after the reduction. */
td_status td__zero3_end_pass(td_zero *z);
/* td__zero3_param_live: parameter i has memory now (always, outside stage 3). */
bool td__zero3_param_live(const td_zero *z, size_t i);
/* td__zero3_destroy clears the hooks and frees the units (parameters' memory restored). */
void td__zero3_destroy(td_zero *z);

/* td__zero_agree returns TD_OK when every member passes mine == TD_OK (an all_reduce MAX of a
 * flag), so that a failure on one member fails every member: the member that failed keeps its
 * status and message, the others get TD_ERR_STATE "<what>: failed on another member".
 * Collective. (zero.c) */
td_status td__zero_agree(td_zero *z, td_status mine, const char *what);

/* ---- ft_zero.c, ft_zero_recover.c, ft_zero3.c: fault-tolerant ZeRO (td_ft_zero) ---- */

#include "../collectives/ft_impl.h"

/* The vote's factor of a step skipped by loss scaling (an inf or a NaN): no block is stepped.
 * Never a clip factor (those are >= 0 or NaN). */
#define TD__FTZ_SKIP (-1.0)

/* What a spare that joins (td_process_group_spare) reports as its last committed step in the
 * recovery's exchange: below any real one, and never counted in the survivors' decision. */
#define TD__FTZ_JOINER (-((int64_t)1 << 62))

typedef struct td__zfseg {
  size_t param;
  int64_t off, len; /* elements [off, off + len) of the parameter (flat) */
} td__zfseg;

typedef struct td__zfblock {
  int64_t lo, hi;   /* flat elements [lo, hi) */
  size_t seg0, nseg;
  int own, bak;     /* global ranks; bak -1 in a group of one */
  /* on this member, while it holds the block */
  bool held;
  td_optim *opt;    /* over view[0..nseg) */
  td_tensor **view; /* the segments: views of the parameters */
  int64_t ver;      /* the last step its state reflects */
  td_tensor *grad;  /* the averaged gradient of step gstep (hi - lo elements), or NULL */
  int64_t gstep;
} td__zfblock;

struct td_ft_zero {
  td_process_group *given, *pg;
  td_ft_zero_options o;
  td_optim_options oo;
  size_t n_groups;
  double *glr, *gwd; /* per group, as given */
  size_t *gcount;
  double lr;         /* td_ft_zero_set_lr's, NAN before */
  size_t np;
  td_tensor **params; /* owned references, flat order */
  int64_t *poff;      /* per parameter: its first flat element */
  int64_t P;
  td_dtype dt;
  int M;
  int *owner;         /* shard -> global rank */
  td_tensor **grad;   /* shard -> its flat gradient here (NULL: not computed) */
  int64_t grad_step;
  int B;
  td__zfblock *b;
  td__zfseg *segs;
  td_tensor *avg;     /* stage 1: the flat average; NULL at stage 2 */
  int64_t committed;  /* INT64_MIN before the first step */
  int64_t voted;      /* the last step whose vote this member received */
  double coef;        /* that step's clip factor (1: none) */
  td__ft_injector inj;
  int64_t dec_step;   /* loss scaling: the last step whose vote's factor is known here */
  double dec_coef;    /* that factor (TD__FTZ_SKIP: skipped) */
  bool joining;       /* a spare admitted to the group, not yet healed: no n_shards, no
                         n_blocks, no layout of its own until a recovery gives them */
  int64_t heals;      /* layouts, blocks and parameters taken as a joining spare */
  int64_t heal_bytes;
  double heal_s;
  int64_t own_steps;  /* steps committed without a failure */
  double own_s;       /* their td_ft_step_info.machinery_s, summed */
  /* stage 3 (ft_zero3.c): the blocks' views are their master values (owned tensors) */
  size_t nu;
  struct td__fzunit *u;
  int *unit_of;       /* per parameter: its unit, or -1 */
  int64_t cur_step;   /* the step whose shard passes run (injections) */
  bool in_pass;       /* a shard pass runs (outside one the units' hooks do nothing) */
  size_t seq;         /* unit gathers run in this shard pass */
  td_status gst;      /* a gather of this pass failed (TD_OK: none): the pass's result is dropped */
  char gmsg[512];
  int64_t unit_gathers;
  struct td__fzparam *ph; /* per parameter: its gradient hook's context and handle */
  int64_t live_numel;  /* elements of unit parameters with memory now */
  int64_t peak_numel;  /* the most of them at once in a shard pass */
};

/* ft_zero.c: this member's global rank; flat elements [lo, lo + n) of the parameters copied into
 * buf (to_params false) or from it; a block held (fresh optimizer state, version v) or dropped;
 * the held blocks at step - 1 with the step's gradient stepped (scaled by coef); the parameters
 * gathered from the blocks' owners; injections. */
int td__ftz_me(const td_ft_zero *z);
void td__ftz_flat_io(td_ft_zero *z, int64_t lo, int64_t n, void *buf, bool to_params);
td_status td__ftz_block_hold(td_ft_zero *z, int bi, int64_t v);
void td__ftz_block_drop(td__zfblock *b);
td_status td__ftz_step_held(td_ft_zero *z, int64_t step, double coef, double *own_s);
td_status td__ftz_gather(td_ft_zero *z, int64_t step);
void td__ftz_inject_at(td_ft_zero *z, int64_t step, td_ft_when when);
/* A joining spare's layout once the survivors gave M and B: the shard table, the blocks cut
 * (none held) and stage 1's flat average. */
td_status td__ftz_learn(td_ft_zero *z, int M, int B);
/* Block bi's values (hi - lo elements) copied into buf (to_block false) or from it: the
 * parameters at stages 1 and 2, its master values at stage 3. */
void td__ftz_block_io(td_ft_zero *z, int bi, void *buf, bool to_block);
/* ft_zero3.c: stage 3. setup: the units checked, their hooks set, their parameters freed (the
 * blocks hold their masters); compute: the attempt's shard passes (*user_failed: the shard
 * function's own failure or a pass out of order, not a lost member); gather_rest: the
 * parameters outside the units from the blocks' owners (the commit's gather); gather_units:
 * every unit gathered (td_ft_zero_sync); free_units; destroy: hooks removed, free units' memory
 * given back zero-filled. */
td_status td__ftz3_setup(td_ft_zero *z);
td_status td__ftz3_compute(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                           td_ft_step_info *info, bool *user_failed);
td_status td__ftz3_gather_rest(td_ft_zero *z, int64_t step);
td_status td__ftz3_gather_units(td_ft_zero *z);
void td__ftz3_free_units(td_ft_zero *z);
void td__ftz3_destroy(td_ft_zero *z);
/* ft_zero_recover.c: the recovery after a failed attempt of step `step` (see ft_zero.c): re-form,
 * exchange, decide, apply. *done: the step is committed here; *again: the new generation failed
 * too (recover again). */
td_status td__ftz_recover(td_ft_zero *z, int64_t step, const char *why, td_ft_step_info *info,
                          bool *done, bool *again);
/* The recovery after its re-formation (what a joining spare enters: the survivors wait for it
 * there): the layout agreed (a joining spare learns it), exchange, decide, apply; a joining spare
 * then takes the parameters and the scaler state of the last committed step. */
td_status td__ftz_settle(td_ft_zero *z, int64_t step, td_ft_step_info *info, bool *done,
                         bool *again);

/* td__zero_units_map sets unit_of[i] to the index of the unit (units[0..nu)) whose module holds
 * params[i], -1 for none; TD_ERR_INVALID (messages prefixed fn) for a NULL unit, one without
 * parameters, a unit parameter that is not in params, or one in two units. */
td_status td__zero_units_map(td_module *const *units, size_t nu, td_tensor *const *params,
                             size_t np, int *unit_of, const char *fn);

/* td__zero_wrap_outputs puts the outputs of a unit's forward that require grad (outputs[0..n),
 * replaced in place) through one identity node named name whose backward is backward(ctx, ...):
 * a stage-3 unit gathers its parameters again there. Takes ctx (malloc'd; the node frees it,
 * or this call when no output requires grad or on failure). */
td_status td__zero_wrap_outputs(const char *name, td_tensor **outputs, int n_outputs,
                                td_external_backward_fn backward, void *ctx);

#endif
