/* ft_ddp.c - fault-tolerant data parallelism (td_ft_ddp, include/tdist/collectives.h): steps
 * that survive lost replicas with the result unchanged, bitwise.
 *
 * A step, on the current group (generation g), takes one of two paths, alike on every member:
 *   fast (the module given, each member holding the shard of its own rank, a same-host group,
 *   no recovery and no injection before or during the reduction in this step): the shard is
 *   computed under td_ddp's overlapped hooks, whose AVG all_reduce on shared memory folds the
 *   members, i.e. the shards, in order: the ordered reduction's bits. The local gradient is
 *   copied out of .grad before td_ddp_finish writes the average, for a reduction that fails;
 *   ordered: 1. compute: for each shard this member holds (owner[s], global ranks) and has no
 *   gradient of yet, clear the .grads, run the caller's shard function, copy the .grads into
 *   the shard's flat gradient (P elements; a parameter without .grad counts as zeros);
 *   2. reduce: bucket by bucket (bucket_bytes), td_process_group_all_reduce_ordered (AVG over
 *   n_shards) of every shard's bucket into the flat average.
 * Then the commit, unless this member's group failed meanwhile: the .grads hold the average
 * (views of it on the ordered path), clipping, the optimizer's step; the shard gradients go.
 * A failed reduction (the group names the lost member and the generation) starts recover():
 *   a. the survivors re-form the group (td_process_group_reform, generation g + 1);
 *   b. the lost members' shards go, in shard order, each to the survivor holding the fewest
 *      (ties: the lowest global rank), computed alike on every survivor from the old assignment
 *      and the new membership; the others keep their shards and their gradients;
 *   c. they agree on the last committed step: an all_reduce MAX of (committed, -committed). A
 *      member can have committed a step another did not (the reduction ended on one and failed
 *      on the other: a member lost in its last moments, or a member whose own group failed
 *      after it reduced); the lowest group rank among those at the maximum then broadcasts the
 *      parameters and the optimizer state (each tensor, the state's step counts): it is the
 *      very state a recomputation would give, the reduction being deterministic. Members that
 *      took it return from their step, which is now committed everywhere;
 *   d. the fast path's td_ddp is made again for the new group when it still applies;
 *   e. the step is attempted again on the ordered path: only the moved shards are computed
 *      (recomputed: their holder was lost), and the ordered reduction gives the same bits.
 * A failure in b-d (the new generation lost a member too) makes the next attempt fail at once
 * and recover again. Commit on all or none, then: a step that one survivor committed stands on
 * every survivor once recover() ran, and one no survivor committed is redone by all.
 *
 * Injection (td_ft_ddp_inject) fires at the points the header names: after compute (BEFORE),
 * after the first bucket (DURING), after the reduction (AFTER), between the re-formation (a)
 * and the agreement (c) of a recovery (RECOVERY).
 *
 * Threads: a td_ft_ddp is used by one thread (td_ddp's worker thread runs the fast path's
 * all_reduces); no lock of its own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tdist/autograd.h"
#include "coll_impl.h"
#include "ft_impl.h"

#define NO_LOSS_TRIES 3 /* failures in a row that lost no member before a step gives up */

struct td_ft_ddp {
  td_process_group *given; /* the caller's group (never destroyed here) */
  td_process_group *pg;    /* the current generation */
  td_optim *opt;
  td_ft_ddp_options o;
  int M;                   /* shards per step */
  size_t np;               /* parameters */
  td_tensor **params;      /* borrowed from opt */
  int64_t P;               /* elements of all parameters */
  td_dtype dt;
  int *owner;              /* shard -> global rank */
  td_tensor **grad;        /* shard -> its flat gradient on this member (NULL: not computed) */
  int64_t grad_step;       /* the step the shard gradients belong to */
  td_tensor *avg;          /* the flat average (P elements) */
  int64_t committed;       /* the last committed step; INT64_MIN before the first */
  td__ft_injector inj;
  td_ddp *ddp;             /* the fast path's reducer (see overlap_setup), or NULL */
  int64_t slow_step;       /* the step the survivors of a recovery go on with: every member
                              takes the ordered path in it (some hold its shards' gradients
                              already, a healed member does not: the paths must agree) */
  td_ft_ddp_stats stats;   /* heals (td_ft_ddp_get_stats) */
  bool joining;            /* a spare admitted to the group (td_process_group_joined), not yet
                              healed: it has no step, no shard table and no n_shards of its own */
};

/* What a joining spare reports as its last committed step in agree(): below any real one, so
 * the survivors always heal it. */
#define JOINER_STEP (-((int64_t)1 << 62))

void td_ft_ddp_options_init(td_ft_ddp_options *o) {
  memset(o, 0, sizeof *o);
  o->reform_timeout = TD_TIMEOUT_DEFAULT;
}

void td_ft_shard_range(int64_t batch, int n_shards, int s, int64_t *begin, int64_t *end) {
  int64_t q = batch / n_shards, r = batch % n_shards;
  *begin = (int64_t)s * q + (s < r ? s : r);
  *end = *begin + q + (s < r ? 1 : 0);
}

td_process_group *td_ft_ddp_group(const td_ft_ddp *ft) { return ft ? ft->pg : NULL; }

static td_status overlap_setup(td_ft_ddp *ft);

/* ---- creation ---- */

/* Shard s on the member of group rank s * size / M: each its own when M == size. */
static void initial_owners(td_ft_ddp *ft) {
  int n = ft->pg->size;
  for (int s = 0; s < ft->M; s++) ft->owner[s] = ft->pg->ranks[(int64_t)s * n / ft->M];
}

/* The shard table and the flat average, once M is known. */
static td_status shards_setup(td_ft_ddp *ft) {
  ft->owner = td__calloc((size_t)ft->M, sizeof *ft->owner);
  ft->grad = td__calloc((size_t)ft->M, sizeof *ft->grad);
  if (!ft->owner || !ft->grad) return td_set_error(TD_ERR_NOMEM, "ft_ddp_create: out of memory");
  initial_owners(ft);
  return td_tensor_zeros(&ft->P, 1, ft->dt, td_device_cpu(), &ft->avg);
}

/* The parameters (np, P, dtype). */
static td_status params_setup(td_ft_ddp *ft) {
  ft->np = td_optim_num_params(ft->opt);
  TD_CHECK_ARG(ft->np > 0, "ft_ddp_create: the optimizer has no parameters");
  ft->params = td__calloc(ft->np, sizeof *ft->params);
  if (!ft->params) return td_set_error(TD_ERR_NOMEM, "ft_ddp_create: out of memory");
  for (size_t i = 0; i < ft->np; i++) {
    td_tensor *p = td_optim_param(ft->opt, i);
    td_dtype dt = td_tensor_dtype(p);
    TD_CHECK_ARG((dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64) && td_tensor_is_contiguous(p) &&
                     td_tensor_device(p).type == TD_DEVICE_CPU && (i == 0 || dt == ft->dt),
                 "ft_ddp_create: parameter %zu must be a contiguous CPU float32 or float64 "
                 "tensor, of one dtype with the others", i);
    ft->dt = dt;
    ft->params[i] = p;
    ft->P += td_tensor_numel(p);
  }
  return TD_OK;
}

static td_status ft_setup(td_ft_ddp *ft) {
  TD_TRY(params_setup(ft));
  TD_TRY(shards_setup(ft));
  for (size_t i = 0; i < ft->np; i++) /* every member starts from group rank 0's values */
    TD_TRY(td_process_group_broadcast(ft->pg, ft->params[i], 0));
  return overlap_setup(ft);
}

static td_status join(td_ft_ddp *ft);

td_status td_ft_ddp_create(td_process_group *pg, td_optim *opt, const td_ft_ddp_options *opts,
                           td_ft_ddp **out) {
  TD_CHECK_ARG(pg && opt && out, "ft_ddp_create: NULL group, optimizer or out");
  TD_CHECK_ARG(pg->backend == TD_PG_BACKEND_CPU, "ft_ddp_create: CPU groups only");
  td_ft_ddp_options o;
  td_ft_ddp_options_init(&o);
  if (opts) o = *opts;
  if (!o.n_shards && !pg->joined) o.n_shards = pg->size; /* a spare learns it when it joins */
  if (!o.bucket_bytes) o.bucket_bytes = (size_t)4 << 20;
  TD_CHECK_ARG((o.n_shards >= 1 || pg->joined) && o.max_failures >= 0 && o.max_grad_norm >= 0 &&
                   td__timeout_valid(o.reform_timeout),
               "ft_ddp_create: invalid options (n_shards %d, max_failures %d)", o.n_shards,
               o.max_failures);
  td_ft_ddp *ft = td__calloc(1, sizeof *ft);
  if (!ft) return td_set_error(TD_ERR_NOMEM, "ft_ddp_create: out of memory");
  ft->given = ft->pg = pg;
  ft->opt = opt;
  ft->o = o;
  ft->M = o.n_shards;
  ft->committed = INT64_MIN;
  ft->grad_step = INT64_MIN;
  ft->slow_step = INT64_MIN;
  ft->joining = pg->joined;
  td_status st = ft->joining ? join(ft) : ft_setup(ft);
  if (st != TD_OK) {
    td_ft_ddp_destroy(ft);
    return st;
  }
  *out = ft;
  return TD_OK;
}

static void drop_grads(td_ft_ddp *ft) {
  for (int s = 0; ft->grad && s < ft->M; s++) {
    td_tensor_unref(ft->grad[s]);
    ft->grad[s] = NULL;
  }
}

void td_ft_ddp_destroy(td_ft_ddp *ft) {
  if (!ft) return;
  td_ddp_destroy(ft->ddp);
  if (ft->grad) drop_grads(ft);
  if (ft->pg != ft->given) td_process_group_destroy(ft->pg);
  td_tensor_unref(ft->avg);
  td__free(ft->grad);
  td__free(ft->owner);
  td__free(ft->params);
  td__free(ft);
}

/* ---- fault injection ---- */

td_status td_ft_ddp_inject(td_ft_ddp *ft, int rank, int64_t step, td_ft_when when,
                           td_ft_what what) {
  TD_CHECK_ARG(ft, "ft_ddp_inject: NULL");
  return td__ft_inject_add(&ft->inj, rank, step, when, what, TD_FT_RECOVERY, "ft_ddp_inject");
}

static void inject_at(td_ft_ddp *ft, int64_t step, td_ft_when when) {
  td__ft_inject_at(&ft->inj, ft->pg, step, when);
}

/* ---- one attempt of a step ---- */

static td_status take_grads(td_ft_ddp *ft, td_tensor **out, double *own_s) {
  return td__ft_take_grads(ft->params, ft->np, ft->P, ft->dt, out, own_s);
}

/* Whether every shard sits on the group rank of its number (each member holds one shard). */
static bool identity(const td_ft_ddp *ft) {
  if (ft->M != ft->pg->size) return false;
  for (int s = 0; s < ft->M; s++)
    if (ft->owner[s] != ft->pg->ranks[s]) return false;
  return true;
}

/* The fast path: with the module given, while every shard sits on its own rank and the group
 * reduces on shared memory (whose all_reduce algorithms all fold members 0..n-1 left to right, as
 * the ordered reduction does), the reduction is td_ddp's, overlapped with backward: its AVG
 * all_reduce of buckets gives the ordered reduction's bits. (Re)made after each re-formation. */
static td_status overlap_setup(td_ft_ddp *ft) {
  td_ddp_destroy(ft->ddp);
  ft->ddp = NULL;
  if (!ft->o.module || !identity(ft) || (ft->pg->size > 1 && !ft->pg->tp[TD__TP_SHM]))
    return TD_OK;
  td_ddp_options d;
  td_ddp_options_init(&d);
  d.overlap = true;
  d.find_unused_parameters = true; /* as take_grads: a parameter without .grad counts as zeros */
  return td_ddp_create_ex(ft->pg, ft->o.module, &d, &ft->ddp);
}

/* Whether an injection at `when` is due at step (any rank: every member registers the same). */
static bool injection_due(const td_ft_ddp *ft, int64_t step, td_ft_when when) {
  return td__ft_inject_due(&ft->inj, step, when);
}

/* The fast path of one attempt: this member's shard computed under td_ddp's hooks (its buckets'
 * all_reduces start during backward), its local gradient kept (the shard's, should the reduction
 * fail), and the averages written into the .grads by td_ddp_finish. */
static td_status fast_attempt(td_ft_ddp *ft, int64_t step, td_ft_shard_fn fn, void *user,
                              td_ft_step_info *info, bool *user_failed) {
  int s = ft->pg->rank;
  td_optim_zero_grad(ft->opt);
  TD_TRY(td_ddp_prepare(ft->ddp));
  td_status st = fn(user, step, s, ft->M);
  if (st != TD_OK) {
    *user_failed = true;
    td_ddp_finish(ft->ddp); /* ends the pass (its reductions run to the end) */
    return st;
  }
  st = take_grads(ft, &ft->grad[s], &info->machinery_s);
  if (st == TD_OK) info->shards_computed++;
  td_status fs = td_ddp_finish(ft->ddp);
  return st != TD_OK ? st : fs;
}

/* Runs the shard function for this member's shards that have no gradient yet. */
static td_status compute(td_ft_ddp *ft, int64_t step, td_ft_shard_fn fn, void *user,
                         td_ft_step_info *info) {
  int me = ft->pg->ranks[ft->pg->rank];
  for (int s = 0; s < ft->M; s++) {
    if (ft->owner[s] != me || ft->grad[s]) continue;
    td_optim_zero_grad(ft->opt);
    TD_TRY(fn(user, step, s, ft->M));
    TD_TRY(take_grads(ft, &ft->grad[s], NULL));
    info->shards_computed++;
  }
  td_optim_zero_grad(ft->opt);
  return TD_OK;
}

/* The ordered reduction of every bucket into ft->avg. */
static td_status reduce(td_ft_ddp *ft, int64_t step) {
  td_process_group *pg = ft->pg;
  int *gowner = td__malloc((size_t)ft->M * sizeof *gowner), n_mine = 0;
  td_tensor **mine = td__calloc((size_t)ft->M, sizeof *mine);
  td_status st = gowner && mine ? TD_OK : td_set_error(TD_ERR_NOMEM, "ft_ddp_step: out of memory");
  for (int s = 0; st == TD_OK && s < ft->M; s++) gowner[s] = td__ft_group_rank(pg, ft->owner[s]);
  int64_t per = (int64_t)(ft->o.bucket_bytes / td_dtype_size(ft->dt));
  if (per < 1) per = 1;
  for (int64_t off = 0, b = 0; st == TD_OK && off < ft->P; off += per, b++) {
    int64_t len = ft->P - off < per ? ft->P - off : per;
    td_tensor *out = NULL;
    n_mine = 0;
    st = td_tensor_narrow(ft->avg, 0, off, len, &out);
    for (int s = 0; st == TD_OK && s < ft->M; s++)
      if (gowner[s] == pg->rank) st = td_tensor_narrow(ft->grad[s], 0, off, len, &mine[n_mine++]);
    if (st == TD_OK)
      st = td_process_group_all_reduce_ordered(pg, out, mine, n_mine, gowner, ft->M,
                                               TD_REDUCE_AVG);
    for (int j = 0; j < n_mine; j++) {
      td_tensor_unref(mine[j]);
      mine[j] = NULL;
    }
    td_tensor_unref(out);
    if (st == TD_OK && b == 0) inject_at(ft, step, TD_FT_DURING);
  }
  td__free(gowner);
  td__free(mine);
  return st;
}

/* The .grads become views of the average; clipping; the optimizer's step. */
static td_status commit(td_ft_ddp *ft, int64_t step, bool grads_set) {
  int64_t off = 0;
  for (size_t i = 0; !grads_set && i < ft->np; i++) {
    td_tensor *p = ft->params[i], *flat = NULL, *g = NULL;
    int64_t shape[16];
    int nd = td_tensor_ndim(p);
    for (int d = 0; d < nd && d < 16; d++) shape[d] = td_tensor_size(p, d);
    td_status st = td_tensor_narrow(ft->avg, 0, off, td_tensor_numel(p), &flat);
    if (st == TD_OK) st = td_tensor_reshape(flat, shape, nd, &g);
    if (st == TD_OK) st = td_tensor_set_grad(p, g);
    td_tensor_unref(flat);
    td_tensor_unref(g);
    TD_TRY(st);
    off += td_tensor_numel(p);
  }
  td_grad_scaler *sc = ft->o.scaler;
  /* the decision is the averaged gradient's: the same bits on every member */
  if (sc) TD_TRY(td_grad_scaler_unscale_(sc, ft->opt));
  if (ft->o.max_grad_norm > 0)
    TD_TRY(td_optim_clip_grad_norm(ft->opt, ft->o.max_grad_norm, 2.0, NULL));
  if (sc) {
    TD_TRY(td_grad_scaler_step(sc, ft->opt, NULL));
    TD_TRY(td_grad_scaler_update(sc));
  } else {
    TD_TRY(td_optim_step(ft->opt));
  }
  ft->committed = step;
  return TD_OK;
}

/* ---- recovery ---- */

/* Broadcasts the parameters and the optimizer state from group rank root. */
static td_status heal_from(td_ft_ddp *ft, int root) {
  td_process_group *pg = ft->pg;
  uint64_t t0 = td__now_ns();
  int64_t bytes = 0;
  int64_t n = (int64_t)ft->np * 4;
  td_tensor *meta = NULL;
  TD_TRY(td_tensor_zeros(&n, 1, TD_DTYPE_I64, td_device_cpu(), &meta));
  int64_t *mv = td_tensor_data(meta);
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < ft->np; i++) {
    td_tensor *bufs[3] = {NULL, NULL, NULL};
    st = td_optim_state_get(ft->opt, i, bufs, &mv[4 * i + 3]);
    for (int j = 0; j < 3; j++) {
      mv[4 * i + j] = bufs[j] != NULL;
      td_tensor_unref(bufs[j]);
    }
  }
  if (st == TD_OK) st = td_process_group_broadcast(pg, meta, root);
  /* the shard table: the same on every member that has one; a joining spare has none */
  td_tensor *tab = NULL;
  int64_t M = ft->M;
  if (st == TD_OK) st = td_tensor_zeros(&M, 1, TD_DTYPE_I64, td_device_cpu(), &tab);
  if (st == TD_OK) {
    int64_t *t = td_tensor_data(tab);
    for (int s = 0; s < ft->M; s++) t[s] = ft->owner[s];
    st = td_process_group_broadcast(pg, tab, root);
    for (int s = 0; st == TD_OK && s < ft->M; s++) ft->owner[s] = (int)t[s];
  }
  td_tensor_unref(tab);
  /* every parameter and its state buffers (a member without them makes them), in one list,
   * sent packed: the state is tens to hundreds of tensors, most small */
  size_t nt = 0;
  td_tensor **ts = td__calloc(ft->np * 4, sizeof *ts), **state = td__calloc(ft->np * 3,
                                                                            sizeof *state);
  bool *live = td__calloc(ft->np, sizeof *live); /* the broadcast writes the live state */
  if (st == TD_OK && (!ts || !state || !live))
    st = td_set_error(TD_ERR_NOMEM, "ft_ddp: out of memory");
  for (size_t i = 0; st == TD_OK && i < ft->np; i++) {
    ts[nt++] = ft->params[i];
    st = td_optim_state_get(ft->opt, i, &state[3 * i], NULL);
    live[i] = true;
    for (int j = 0; st == TD_OK && j < 3; j++) {
      td_tensor **b = &state[3 * i + j];
      if (!mv[4 * i + j]) { /* the giver has none: neither will we */
        live[i] = live[i] && !*b;
        td_tensor_unref(*b);
        *b = NULL;
        continue;
      }
      int64_t pn = td_tensor_numel(ft->params[i]);
      if (!*b) { /* a member without it (a spare): a new tensor, adopted below */
        live[i] = false;
        st = td_tensor_empty(&pn, 1, ft->dt, td_device_cpu(), b);
      }
      if (st == TD_OK) ts[nt++] = *b;
    }
  }
  if (st == TD_OK) st = td__ft_bcast_packed(pg, ts, nt, root, &bytes);
  for (size_t i = 0; st == TD_OK && i < ft->np; i++)
    st = live[i] ? td_optim_state_set_step(ft->opt, i, mv[4 * i + 3])
                 : td_optim_state_adopt(ft->opt, i, &state[3 * i], mv[4 * i + 3]);
  td__free(live);
  for (size_t k = 0; state && k < ft->np * 3; k++) td_tensor_unref(state[k]);
  td__free(state);
  td__free(ts);
  td_tensor_unref(meta);
  if (st == TD_OK && ft->o.scaler) { /* the scale and growth tracker after the root's commit */
    int64_t two = 2;
    td_tensor *sv = NULL;
    td_grad_scaler_state gs;
    st = td_grad_scaler_get_state(ft->o.scaler, &gs);
    if (st == TD_OK) st = td_tensor_zeros(&two, 1, TD_DTYPE_F64, td_device_cpu(), &sv);
    if (st == TD_OK) {
      double *x = td_tensor_data(sv);
      x[0] = gs.scale, x[1] = (double)gs.growth_tracker;
      st = td_process_group_broadcast(pg, sv, root);
      gs.scale = x[0], gs.growth_tracker = (int64_t)x[1];
    }
    if (st == TD_OK && pg->rank != root) st = td_grad_scaler_set_state(ft->o.scaler, &gs);
    td_tensor_unref(sv);
  }
  if (st == TD_OK && pg->rank != root) {
    ft->stats.heals++;
    ft->stats.heal_bytes += bytes;
    ft->stats.heal_s += (double)(td__now_ns() - t0) * 1e-9;
  }
  return st;
}

td_status td_ft_ddp_get_stats(const td_ft_ddp *ft, td_ft_ddp_stats *out) {
  TD_CHECK_ARG(ft && out, "ft_ddp_get_stats: NULL");
  *out = ft->stats;
  return TD_OK;
}

/* Agrees on the last committed step; heals the members behind. *done: this member's step is
 * committed (it was, or it took the state of one that committed it). */
static td_status agree(td_ft_ddp *ft, int64_t step, td_ft_step_info *info, bool *done) {
  td_process_group *pg = ft->pg;
  int64_t three = 3;
  td_tensor *v = NULL;
  TD_TRY(td_tensor_zeros(&three, 1, TD_DTYPE_I64, td_device_cpu(), &v));
  int64_t *x = td_tensor_data(v);
  int64_t c = ft->joining ? JOINER_STEP : ft->committed == INT64_MIN ? step - 1 : ft->committed;
  x[0] = c, x[1] = -c, x[2] = ft->joining ? 0 : ft->M; /* a joining spare learns n_shards */
  td_status st = td_process_group_all_reduce(pg, v, TD_REDUCE_MAX);
  int64_t hi = x[0], lo = -x[1];
  if (st == TD_OK && ft->joining && !ft->owner) {
    ft->M = ft->o.n_shards = (int)x[2];
    st = ft->M >= 1 && hi > JOINER_STEP
             ? shards_setup(ft)
             : td_set_error(TD_ERR_STATE, "ft_ddp_create: a spare joined a group with no "
                            "member holding the training's state");
  }
  ft->slow_step = hi + 1;
  if (st == TD_OK && hi != lo) { /* the lowest group rank at hi hands its state to the others */
    x[0] = c == hi ? pg->size - pg->rank : 0, x[1] = 0;
    st = td_process_group_all_reduce(pg, v, TD_REDUCE_MAX);
    int root = pg->size - (int)x[0];
    if (st == TD_OK) st = heal_from(ft, root);
    if (st == TD_OK && c < hi) {
      info->healed = true;
      ft->committed = hi;
      ft->joining = false;
      drop_grads(ft);
    }
  }
  td_tensor_unref(v);
  *done = st == TD_OK && ft->committed != INT64_MIN && ft->committed >= step;
  return st;
}

/* Deals the shards as at creation over the current group (a spare joined): drops the gradients
 * of the shards that change hands and says where they go. Returns the shards moved. */
static int redeal(td_ft_ddp *ft, char *m, size_t n, size_t *len) {
  int *was = td__malloc((size_t)ft->M * sizeof *was), moved = 0;
  if (!was) return -1;
  memcpy(was, ft->owner, (size_t)ft->M * sizeof *was);
  initial_owners(ft);
  for (int s = 0; s < ft->M; s++) {
    if (ft->owner[s] == was[s]) continue;
    td_tensor_unref(ft->grad[s]);
    ft->grad[s] = NULL;
    char who[160];
    *len = td__ft_say(m, n, *len, "%sshard %d -> %s", moved++ ? ", " : "; re-dealt: ", s,
                      td__ft_who(ft->pg, td__ft_group_rank(ft->pg, ft->owner[s]), who,
                                 sizeof who));
  }
  td__free(was);
  return moved;
}

/* A spare admitted to the group joins the survivors' recovery, which waits for it in agree():
 * it learns n_shards and the shard table, takes the parameters and the optimizer state of the
 * last committed step, and makes the fast path's reducer as they do. Should a member be lost
 * meanwhile, it re-forms with the survivors and tries again, as they do. */
static td_status join(td_ft_ddp *ft) {
  TD_TRY(params_setup(ft));
  char msg[1024] = "";
  for (int tries = 0;; tries++) {
    td_ft_step_info info;
    memset(&info, 0, sizeof info);
    bool done = false;
    td_status st = agree(ft, 0, &info, &done);
    if (st == TD_OK) st = overlap_setup(ft);
    if (st == TD_OK) {
      td_log(TD_LOG_INFO, "ft_ddp: joined process group %llu at generation %llu, healed to "
             "step %lld (%d shards over %d members)", (unsigned long long)ft->pg->lineage,
             (unsigned long long)ft->pg->generation, (long long)ft->committed, ft->M,
             ft->pg->size);
      return TD_OK;
    }
    if ((st != TD_ERR_UNAVAILABLE && st != TD_ERR_TIMEOUT) || tries >= NO_LOSS_TRIES) return st;
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    size_t len = 0;
    int lost = 0;
    TD_TRY(td__ft_reform(ft->given, &ft->pg, ft->o.reform_timeout, ft->slow_step, why, msg,
                         sizeof msg, &len, &lost, NULL));
    if (ft->owner) /* a table taken before the failure: moved as the survivors move it */
      if (td__ft_reassign(ft->pg, ft->owner, ft->M, ft->grad, msg, sizeof msg, &len) < 0)
        return td_set_error(TD_ERR_NOMEM, "ft_ddp_create: out of memory");
  }
}

int64_t td_ft_ddp_next_step(const td_ft_ddp *ft) {
  return !ft || ft->committed == INT64_MIN ? 0 : ft->committed + 1;
}

/* After a failed attempt: re-form, agree, reassign. */
static td_status recover(td_ft_ddp *ft, int64_t step, const char *why, td_ft_step_info *info,
                         bool *done, bool *again) {
  td_ddp_destroy(ft->ddp); /* bound to the broken group */
  ft->ddp = NULL;
  char *m = info->message;
  size_t n = sizeof info->message, len = strlen(m);
  int lost = 0, joined = 0;
  TD_TRY(td__ft_reform(ft->given, &ft->pg, ft->o.reform_timeout, step, why, m, n, &len, &lost,
                       &joined));
  info->lost += lost;
  info->joined += joined;
  /* every survivor moves the same shards, whether or not its step is done: with spares
   * admitted, the shards are dealt again as at creation over the new members (each its own
   * again when the group is whole); else the lost members' go to those holding the fewest */
  int moved = joined ? redeal(ft, m, n, &len)
                     : td__ft_reassign(ft->pg, ft->owner, ft->M, ft->grad, m, n, &len);
  if (moved < 0) return td_set_error(TD_ERR_NOMEM, "ft_ddp_step: out of memory");
  if (!moved) len = td__ft_say(m, n, len, "; no shard moved (every holder lives)");
  info->shards_recomputed += moved;
  inject_at(ft, step, TD_FT_RECOVERY);
  td_status st = agree(ft, step, info, done);
  if (st == TD_OK) st = overlap_setup(ft); /* collective: every survivor, done or not */
  if (st != TD_OK) {
    *again = true; /* the new generation failed too: recover once more */
    return st;
  }
  if (info->healed)
    len = td__ft_say(m, n, len, "; took the committed step from a member that had it");
  if (*done) info->shards_recomputed -= moved; /* moved for the next steps, not recomputed */
  return TD_OK;
}

/* ---- the step ---- */

/* Fills what a committed step reports. */
static void step_done(const td_ft_ddp *ft, int64_t step, uint64_t t_fail, td_ft_step_info *info) {
  info->step = step;
  info->generation = ft->pg->generation;
  info->members = ft->pg->size;
  info->recovery_s = t_fail ? (double)(td__now_ns() - t_fail) * 1e-9 : 0;
  if (info->failures) {
    size_t len = strlen(info->message);
    td__ft_say(info->message, sizeof info->message, len, "; step %lld committed %.3f s after the failure",
        (long long)step, info->recovery_s);
  }
}

td_status td_ft_ddp_step(td_ft_ddp *ft, int64_t step, td_ft_shard_fn fn, void *user,
                         td_ft_step_info *info) {
  TD_CHECK_ARG(ft && fn, "ft_ddp_step: NULL ft or shard function");
  TD_CHECK_ARG(ft->committed == INT64_MIN || step == ft->committed + 1,
               "ft_ddp_step: step %lld after committed step %lld (steps go up by one)",
               (long long)step, (long long)ft->committed);
  td_ft_step_info local;
  if (!info) info = &local;
  memset(info, 0, sizeof *info);
  if (ft->grad_step != step) drop_grads(ft);
  ft->grad_step = step;
  uint64_t t_fail = 0;
  int no_loss = 0;
  for (;;) {
    td_status st;
    /* an injection before or during the reduction needs the ordered path: the fast one starts
     * reducing inside backward */
    bool fast = ft->ddp && !ft->grad[ft->pg->rank] && step != ft->slow_step &&
                !injection_due(ft, step, TD_FT_BEFORE) && !injection_due(ft, step, TD_FT_DURING);
    if (fast) {
      bool user_failed = false;
      st = fast_attempt(ft, step, fn, user, info, &user_failed);
      if (user_failed) return st;
    } else {
      st = compute(ft, step, fn, user, info);
      if (st != TD_OK) return st; /* the caller's own failure: not a lost member */
      inject_at(ft, step, TD_FT_BEFORE);
      st = reduce(ft, step);
    }
    if (st == TD_OK) inject_at(ft, step, TD_FT_AFTER);
    if (st == TD_OK) st = td__ft_broken(ft->pg); /* our own group failed after we reduced */
    if (st == TD_OK) {
      TD_TRY(commit(ft, step, fast));
      info->overlapped = fast;
      uint64_t t0 = td__now_ns();
      drop_grads(ft); /* the step is committed: its shard gradients go */
      td__ft_own(fast ? &info->machinery_s : NULL, t0);
      break;
    }
    if (st != TD_ERR_UNAVAILABLE && st != TD_ERR_TIMEOUT && st != TD_ERR_STATE) return st;
    if (!t_fail) t_fail = td__now_ns();
    info->failures++;
    if (ft->o.max_failures && info->failures > ft->o.max_failures)
      return td__error_prefix(st, "ft_ddp_step: step %lld: failure %d, more than max_failures",
                              (long long)step, info->failures);
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    bool done = false;
    int lost_before = info->lost;
    bool again = false;
    st = recover(ft, step, why, info, &done, &again);
    if (st != TD_OK && !again)
      return td__error_prefix(st, "ft_ddp_step: step %lld: after \"%s\"", (long long)step, why);
    if (st == TD_OK && done) break; /* else the next attempt fails at once and recovers again */
    no_loss = info->lost == lost_before ? no_loss + 1 : 0;
    if (no_loss > (ft->o.max_failures ? ft->o.max_failures : NO_LOSS_TRIES))
      return td_set_error(TD_ERR_STATE, "ft_ddp_step: step %lld failed %d times in a row without "
                          "a lost member (a program error, such as members running different "
                          "collectives?): %s", (long long)step, no_loss, why);
  }
  step_done(ft, step, t_fail, info);
  return TD_OK;
}

td_status td_ft_ddp_sync(td_ft_ddp *ft, td_ft_step_info *info) {
  TD_CHECK_ARG(ft, "ft_ddp_sync: NULL");
  td_ft_step_info local;
  if (!info) info = &local;
  memset(info, 0, sizeof *info);
  int64_t next = ft->committed == INT64_MIN ? 0 : ft->committed + 1;
  for (int no_loss = 0;;) {
    td_status st = td_process_group_barrier(ft->pg);
    if (st == TD_OK && !td__pg_is_broken(ft->pg)) break;
    if (st == TD_OK) st = TD_ERR_UNAVAILABLE;
    if (st != TD_ERR_UNAVAILABLE && st != TD_ERR_TIMEOUT && st != TD_ERR_STATE) return st;
    info->failures++;
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    bool done = false, again = false;
    int lost_before = info->lost;
    td_status rs = recover(ft, next, why, info, &done, &again);
    if (rs != TD_OK && !again) return rs;
    no_loss = info->lost == lost_before ? no_loss + 1 : 0;
    if (no_loss > NO_LOSS_TRIES)
      return td_set_error(TD_ERR_STATE, "ft_ddp_sync: failed %d times in a row without a lost "
                          "member: %s", no_loss, why);
  }
  info->step = ft->committed == INT64_MIN ? -1 : ft->committed;
  info->generation = ft->pg->generation;
  info->members = ft->pg->size;
  return TD_OK;
}
