/* ft_zero.c - fault-tolerant ZeRO stages 1 and 2 (td_ft_zero, include/tdist/collectives.h): the
 * optimizer state sharded in fixed blocks, each held by two members, and steps that survive lost
 * members with the result unchanged, bitwise. Stage 3 (ft_zero3.c) is this with the blocks'
 * optimizers over master values of their own (not views of the parameters), the units' shard
 * passes and gathers, and the commit's gather limited to the parameters outside the units.
 *
 * Layout. The parameters (the groups' flat order, P elements) are cut into B fixed blocks of
 * P / B elements (the first P % B one more: td_ft_shard_range). A block's segments are its pieces of the parameters;
 * a member that holds the block has a td_optim over views of those segments (stepping it updates
 * the parameters in place), so a block's update is the same computation on whichever member
 * runs it. Each block has two holders, own (which contributes the block's squares to the vote
 * and is the root of its gather) and bak; both step it. The batch is cut into M fixed shards
 * (owner[s]: a global rank), as in ft_ddp.c.
 *
 * A step (attempt()): 1. compute this member's shards without a gradient (the caller's
 * function; a flat copy of the .grads is kept per shard until the commit); 2. the ordered
 * all_reduce (AVG over M) bucket by bucket: stage 1 into the flat average, stage 2 into a bucket
 * buffer whose parts in held blocks are kept (b->grad; gstep = the step once every bucket is in);
 * 3. the vote: an all_reduce SUM of B doubles, the owner of each block giving its sum of squares
 * (0 from the others: x + 0 is exact, so the SUM is exact), folded in block order into the norm:
 * a member that receives it knows every member finished step 2 (voted = step, coef = the clip
 * factor); 4. every held block stepped (b->ver = step, its gradient dropped); 5. the gather:
 * one all_gather per piece when every member owns one block (the layout at creation, or it with
 * spares in the places of lost members), else a broadcast per block from its owner; then
 * committed = step.
 *
 * Recovery (ft_zero_recover.c), after any collective failed: re-form (generation + 1); exchange rows
 * (an all_gather of int64): committed, voted, coef's bits, the shard owners, and per block
 * (held, ver, gstep). Everything after is a function of the table alone, so every survivor
 * decides alike even if an earlier recovery ended half done on some of them:
 *   k = min(committed) + 1 (members differ by at most one: a vote needs everyone's step);
 *   roll forward when a survivor voted k: the holders at k - 1 with the gradient of k step with
 *     the voter's coef, the parameters are gathered again, k is committed. Safe: that vote
 *     reached every member after its reduction, so every held block's gradient exists on every
 *     live holder;
 *   else redo: no survivor stepped or gathered anything of step k (both follow the vote), so
 *     every parameter is still at k - 1: the lost members' shards of the batch go to the
 *     survivors (td__ft_reassign, from group rank 0's owner array), the kept gradients stay,
 *     the reduction runs again (same bits).
 *   Blocks: the valid holders of b are those at the target step (or able to reach it: roll
 *   forward with the gradient); own = the first in ring order from the block's home rank
 *   (b * n / B), bak = the next; without a second one, the
 *   survivor holding the fewest blocks (ties: the lowest group rank) becomes bak and gets a copy
 *   of the state and values from own (two broadcasts). No valid holder: the block's state is
 *   gone (both holders lost at once): TD_ERR_UNAVAILABLE on every survivor.
 *   Spares (td_process_group_spare): the recovery agrees on the layout first (one all_reduce),
 *   so a spare admitted to the group can enter it there (join(), at creation): it takes the
 *   roles of a lost member in the layout, with copies of its blocks from their other holders,
 *   its shards of the batch, and the parameters of the last committed step
 *   (ft_zero_recover.c).
 *
 * Threads: a td_ft_zero is used by one thread; no lock of its own.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../tensor/storage.h"
#include "tdist/autograd.h"
#include "zero_impl.h"

#define NO_LOSS_TRIES 3

void td_ft_zero_options_init(td_ft_zero_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->stage = 2;
  o->reform_timeout = TD_TIMEOUT_DEFAULT;
}

td_process_group *td_ft_zero_group(const td_ft_zero *z) { return z ? z->pg : NULL; }

int td__ftz_me(const td_ft_zero *z) {
  return td_process_group_global_rank(z->pg, td_process_group_rank(z->pg));
}

/* ---- the flat parameter space ---- */

/* Copies flat elements [lo, lo + n) of the parameters into dst (to_params false) or from src
 * into them (true). */
void td__ftz_flat_io(td_ft_zero *z, int64_t lo, int64_t n, void *buf, bool to_params) {
  size_t es = td_dtype_size(z->dt);
  char *p = buf;
  for (size_t i = 0; n > 0 && i < z->np; i++) {
    int64_t a = z->poff[i], e = a + td_tensor_numel(z->params[i]);
    if (lo >= e) continue;
    int64_t k = (e - lo < n ? e - lo : n);
    char *q = (char *)td_tensor_data(z->params[i]) + (size_t)(lo - a) * es;
    if (to_params) memcpy(q, p, (size_t)k * es);
    else memcpy(p, q, (size_t)k * es);
    p += (size_t)k * es, lo += k, n -= k;
  }
}

/* ---- blocks ---- */

void td__ftz_block_drop(td__zfblock *b) {
  td_optim_destroy(b->opt);
  b->opt = NULL;
  for (size_t j = 0; b->view && j < b->nseg; j++) td_tensor_unref(b->view[j]);
  td__free(b->view);
  b->view = NULL;
  td_tensor_unref(b->grad);
  b->grad = NULL;
  b->gstep = INT64_MIN;
  b->held = false;
}

/* Makes this member a holder of block bi: views of its segments, an optimizer over them in the
 * parameters' groups (fresh state), ver = v. */
td_status td__ftz_block_hold(td_ft_zero *z, int bi, int64_t v) {
  td__zfblock *b = &z->b[bi];
  if (b->held) return TD_OK;
  b->view = td__calloc(b->nseg, sizeof *b->view);
  td_optim_group *sg = td__calloc(z->n_groups, sizeof *sg);
  td_status st = b->view && sg ? TD_OK : td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  bool prev = td_autograd_set_enabled(false);
  for (size_t j = 0; st == TD_OK && j < b->nseg; j++) {
    const td__zfseg *s = &z->segs[b->seg0 + j];
    if (z->o.stage == 3) { /* its own master values (the caller fills them) */
      st = td_tensor_zeros(&s->len, 1, z->dt, td_device_cpu(), &b->view[j]);
      continue;
    }
    td_tensor *flat = NULL;
    int64_t n = td_tensor_numel(z->params[s->param]);
    st = td_tensor_reshape(z->params[s->param], &n, 1, &flat);
    if (st == TD_OK) st = td_tensor_narrow(flat, 0, s->off, s->len, &b->view[j]);
    td_tensor_unref(flat);
  }
  /* segments are in parameter order and groups hold consecutive parameters */
  size_t j = 0, first = 0;
  for (size_t g = 0; st == TD_OK && g < z->n_groups; g++) {
    size_t start = j;
    while (j < b->nseg && z->segs[b->seg0 + j].param < first + z->gcount[g]) j++;
    td_optim_group_init(&sg[g], b->view + start, j - start);
    sg[g].lr = z->glr[g];
    sg[g].weight_decay = z->gwd[g];
    first += z->gcount[g];
  }
  if (st == TD_OK) st = td_optim_create_groups(&z->oo, sg, z->n_groups, &b->opt);
  if (st == TD_OK && !isnan(z->lr)) st = td_optim_set_lr(b->opt, z->lr);
  td_autograd_set_enabled(prev);
  td__free(sg);
  b->held = true;
  b->ver = v;
  b->gstep = INT64_MIN;
  if (st != TD_OK) td__ftz_block_drop(b);
  return st;
}

/* ---- creation ---- */

static td_status take_params(td_ft_zero *z, const td_optim_group *groups, size_t n_groups) {
  z->n_groups = n_groups;
  z->glr = td__calloc(n_groups + 1, sizeof *z->glr);
  z->gwd = td__calloc(n_groups + 1, sizeof *z->gwd);
  z->gcount = td__calloc(n_groups + 1, sizeof *z->gcount);
  if (!z->glr || !z->gwd || !z->gcount) return td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  for (size_t g = 0; g < n_groups; g++) {
    TD_CHECK_ARG(!groups[g].n || groups[g].params, "ft_zero_create: group %zu has no parameters", g);
    z->np += groups[g].n;
    z->glr[g] = groups[g].lr, z->gwd[g] = groups[g].weight_decay, z->gcount[g] = groups[g].n;
  }
  TD_CHECK_ARG(z->np > 0, "ft_zero_create: no parameters");
  z->params = td__calloc(z->np, sizeof *z->params);
  z->poff = td__calloc(z->np, sizeof *z->poff);
  if (!z->params || !z->poff) return td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  for (size_t g = 0, i = 0; g < n_groups; g++) {
    for (size_t j = 0; j < groups[g].n; j++, i++) {
      td_tensor *p = groups[g].params[j];
      TD_CHECK_ARG(p, "ft_zero_create: group %zu, parameter %zu is NULL", g, j);
      td_dtype dt = td_tensor_dtype(p);
      TD_CHECK_ARG((dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64) && td_tensor_is_contiguous(p) &&
                       td_tensor_device(p).type == TD_DEVICE_CPU && (i == 0 || dt == z->dt),
                   "ft_zero_create: parameter %zu must be a contiguous CPU float32 or float64 "
                   "tensor, of one dtype with the others", i);
      z->dt = dt;
      z->params[i] = td_tensor_ref(p);
      z->poff[i] = z->P;
      z->P += td_tensor_numel(p);
    }
  }
  return TD_OK;
}

void td__ftz_block_io(td_ft_zero *z, int bi, void *buf, bool to_block) {
  const td__zfblock *b = &z->b[bi];
  if (z->o.stage != 3) {
    td__ftz_flat_io(z, b->lo, b->hi - b->lo, buf, to_block);
    return;
  }
  size_t es = td_dtype_size(z->dt);
  char *p = buf;
  for (size_t j = 0; j < b->nseg; j++) {
    size_t nb = (size_t)z->segs[b->seg0 + j].len * es;
    if (to_block) memcpy(td_tensor_data(b->view[j]), p, nb);
    else memcpy(p, td_tensor_data(b->view[j]), nb);
    p += nb;
  }
}

/* Cuts the blocks and their segments; gives each its holders at creation (stage 3: with their
 * master values from the parameters, which are whole here), unless this member is a joining
 * spare (it holds none until a recovery copies some to it). */
static td_status make_blocks(td_ft_zero *z) {
  z->b = td__calloc((size_t)z->B, sizeof *z->b);
  z->segs = td__calloc(z->np + (size_t)z->B, sizeof *z->segs);
  if (!z->b || !z->segs) return td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  int n = td_process_group_size(z->pg);
  size_t ns = 0;
  for (int bi = 0; bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    td_ft_shard_range(z->P, z->B, bi, &b->lo, &b->hi); /* never empty: P >= B */
    b->seg0 = ns;
    for (size_t i = 0; i < z->np; i++) {
      int64_t a = z->poff[i], e = a + td_tensor_numel(z->params[i]);
      int64_t s0 = a > b->lo ? a : b->lo, e0 = e < b->hi ? e : b->hi;
      if (s0 < e0) z->segs[ns++] = (td__zfseg){i, s0 - a, e0 - s0};
    }
    b->nseg = ns - b->seg0;
    int r = (int)((int64_t)bi * n / z->B);
    b->own = td_process_group_global_rank(z->pg, r);
    b->bak = n > 1 ? td_process_group_global_rank(z->pg, (r + 1) % n) : -1;
    b->gstep = INT64_MIN;
    if (z->joining || (b->own != td__ftz_me(z) && b->bak != td__ftz_me(z))) continue;
    TD_TRY(td__ftz_block_hold(z, bi, INT64_MIN));
    if (z->o.stage != 3) continue;
    size_t es = td_dtype_size(z->dt);
    for (size_t j = 0; j < b->nseg; j++) {
      const td__zfseg *s = &z->segs[b->seg0 + j];
      const char *src = td_tensor_data(z->params[s->param]);
      memcpy(td_tensor_data(b->view[j]), src + (size_t)s->off * es, (size_t)s->len * es);
    }
  }
  return TD_OK;
}

td_status td__ftz_learn(td_ft_zero *z, int M, int B) {
  if (z->P < B)
    return td_set_error(TD_ERR_INVALID, "ft_zero_create: %lld elements in %d blocks (more "
                        "blocks than elements)", (long long)z->P, B);
  z->M = z->o.n_shards = M;
  z->B = z->o.n_blocks = B;
  z->owner = td__calloc((size_t)z->M, sizeof *z->owner);
  z->grad = td__calloc((size_t)z->M, sizeof *z->grad);
  if (!z->owner || !z->grad) return td_set_error(TD_ERR_NOMEM, "ft_zero_create: out of memory");
  TD_TRY(make_blocks(z));
  if (z->o.stage == 1) TD_TRY(td_tensor_zeros(&z->P, 1, z->dt, td_device_cpu(), &z->avg));
  if (z->o.stage == 3) TD_TRY(td__ftz3_setup(z)); /* the masters come with the blocks' copies */
  return TD_OK;
}

static td_status scaler_end(td_ft_zero *z, int64_t step);

/* A spare admitted to the group joins the survivors' recovery, which waits for it after their
 * re-formation (td__ftz_settle): it learns the layout, gets copies of the blocks the loss left
 * with one holder, the lost members' shards of the batch, and the parameters (and scaler state)
 * of the last committed step. Should a member be lost meanwhile, it drops what it took,
 * re-forms with the survivors and tries again, as they do. */
static td_status join(td_ft_zero *z) {
  char msg[1024] = "";
  uint64_t t0 = td__now_ns();
  for (int tries = 0;; tries++) {
    td_ft_step_info info;
    memset(&info, 0, sizeof info);
    bool done = false, again = false;
    td_status st = td__ftz_settle(z, 0, &info, &done, &again);
    if (st == TD_OK) {
      z->joining = false;
      z->heals++;
      z->heal_s += (double)(td__now_ns() - t0) * 1e-9;
      /* rolled forward to the step it was healed to: its scaler ends that step's iteration,
       * as the members that had not committed it do */
      if (z->dec_step == z->committed) TD_TRY(scaler_end(z, z->committed));
      int held = 0;
      for (int bi = 0; bi < z->B; bi++) held += z->b[bi].held;
      td_log(TD_LOG_INFO, "ft_zero: joined at generation %llu, healed to step %lld (%d shards "
             "and %d blocks over %d members, %d blocks copied here)",
             (unsigned long long)td_process_group_generation(z->pg), (long long)z->committed,
             z->M, z->B, td_process_group_size(z->pg), held);
      return TD_OK;
    }
    if (!again || tries >= NO_LOSS_TRIES) return st;
    for (int bi = 0; z->b && bi < z->B; bi++) td__ftz_block_drop(&z->b[bi]);
    z->committed = INT64_MIN, z->dec_step = INT64_MIN;
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    size_t len = 0;
    int lost = 0;
    TD_TRY(td__ft_reform(z->given, &z->pg, z->o.reform_timeout, 0, why, msg, sizeof msg, &len,
                         &lost, NULL));
  }
}

int64_t td_ft_zero_next_step(const td_ft_zero *z) {
  return !z || z->committed == INT64_MIN ? 0 : z->committed + 1;
}

td_status td_ft_zero_create(td_process_group *pg, const td_optim_options *opts,
                            const td_optim_group *groups, size_t n_groups,
                            const td_ft_zero_options *zopts, td_ft_zero **out) {
  TD_CHECK_ARG(pg && opts && groups && n_groups && out,
               "ft_zero_create: NULL group, options, groups or out");
  TD_CHECK_ARG(td_process_group_backend(pg) == TD_PG_BACKEND_CPU, "ft_zero_create: CPU groups only");
  td_ft_zero_options o;
  td_ft_zero_options_init(&o);
  if (zopts) o = *zopts;
  bool joining = td_process_group_joined(pg); /* a spare: it learns n_shards and n_blocks */
  /* a spare's own counts are ignored: 1 passes the checks below, and the layout agreement of
   * its join sets the survivors' */
  if (joining) o.n_shards = o.n_blocks = 1;
  int n = td_process_group_size(pg);
  if (!o.n_shards) o.n_shards = n;
  if (!o.n_blocks) o.n_blocks = n;
  if (!o.bucket_bytes) o.bucket_bytes = (size_t)4 << 20;
  TD_CHECK_ARG(o.stage >= 1 && o.stage <= 3 && o.n_shards >= 1 && o.n_blocks >= 1 &&
                   o.max_failures >= 0 && o.max_grad_norm >= 0 && !isinf(o.max_grad_norm) &&
                   td__timeout_valid(o.reform_timeout),
               "ft_zero_create: invalid options (stage %d: 1, 2 or 3; n_shards %d, n_blocks %d, "
               "max_failures %d)", o.stage, o.n_shards, o.n_blocks, o.max_failures);
  TD_CHECK_ARG(o.stage == 3 ? o.units && o.n_units > 0 : !o.n_units,
               "ft_zero_create: stage 3 needs units (and only stage 3 takes them)");
  td_ft_zero *z = td__calloc(1, sizeof *z);
  if (!z) return td_set_error(TD_ERR_NOMEM, "ft_zero_create: out of memory");
  z->given = z->pg = pg;
  z->o = o;
  z->oo = *opts;
  z->lr = NAN;
  z->M = o.n_shards;
  z->B = o.n_blocks;
  z->committed = z->voted = z->grad_step = INT64_MIN;
  z->coef = 1.0;
  z->dec_step = INT64_MIN;
  z->joining = joining;
  td_status st = take_params(z, groups, n_groups);
  if (st == TD_OK && joining) {
    z->M = z->B = 0;
    st = join(z);
    if (st != TD_OK) {
      td_ft_zero_destroy(z);
      return st;
    }
    *out = z;
    return TD_OK;
  }
  if (st == TD_OK && z->P < z->B)
    st = td_set_error(TD_ERR_INVALID, "ft_zero_create: %lld elements in %d blocks (more blocks "
                      "than elements)", (long long)z->P, z->B);
  if (st == TD_OK) {
    z->owner = td__calloc((size_t)z->M, sizeof *z->owner);
    z->grad = td__calloc((size_t)z->M, sizeof *z->grad);
    if (!z->owner || !z->grad) st = td_set_error(TD_ERR_NOMEM, "ft_zero_create: out of memory");
  }
  for (int s = 0; st == TD_OK && s < z->M; s++)
    z->owner[s] = td_process_group_global_rank(pg, (int)((int64_t)s * n / z->M));
  for (size_t i = 0; st == TD_OK && i < z->np; i++) /* group rank 0's values everywhere */
    st = td_process_group_broadcast(pg, z->params[i], 0);
  if (st == TD_OK) st = make_blocks(z);
  if (st == TD_OK && o.stage == 3) st = td__ftz3_setup(z);
  if (st == TD_OK && o.stage == 1) st = td_tensor_zeros(&z->P, 1, z->dt, td_device_cpu(), &z->avg);
  if (st != TD_OK) {
    td_ft_zero_destroy(z);
    return st;
  }
  *out = z;
  return TD_OK;
}

static void drop_grads(td_ft_zero *z) {
  for (int s = 0; z->grad && s < z->M; s++) {
    td_tensor_unref(z->grad[s]);
    z->grad[s] = NULL;
  }
}

void td_ft_zero_destroy(td_ft_zero *z) {
  if (!z) return;
  drop_grads(z);
  td__ftz3_destroy(z);
  for (int bi = 0; z->b && bi < z->B; bi++) td__ftz_block_drop(&z->b[bi]);
  if (z->pg != z->given) td_process_group_destroy(z->pg);
  for (size_t i = 0; z->params && i < z->np; i++) td_tensor_unref(z->params[i]);
  td_tensor_unref(z->avg);
  td__free(z->params);
  td__free(z->poff);
  td__free(z->glr);
  td__free(z->gwd);
  td__free(z->gcount);
  td__free(z->owner);
  td__free(z->grad);
  td__free(z->b);
  td__free(z->segs);
  td__free(z);
}

td_status td_ft_zero_set_lr(td_ft_zero *z, double lr) {
  TD_CHECK_ARG(z && lr >= 0, "ft_zero_set_lr: NULL or an invalid lr");
  z->lr = lr;
  for (int bi = 0; bi < z->B; bi++)
    if (z->b[bi].held) TD_TRY(td_optim_set_lr(z->b[bi].opt, lr));
  return TD_OK;
}

td_status td_ft_zero_inject(td_ft_zero *z, int rank, int64_t step, td_ft_when when,
                            td_ft_what what) {
  TD_CHECK_ARG(z, "ft_zero_inject: NULL");
  TD_CHECK_ARG(when != TD_FT_UNIT_GATHER || z->o.stage == 3,
               "ft_zero_inject: unit_gather is a point of stage 3");
  return td__ft_inject_add(&z->inj, rank, step, when, what, TD_FT_UNIT_GATHER, "ft_zero_inject");
}

td_status td_ft_zero_get_stats(const td_ft_zero *z, td_ft_zero_stats *out) {
  TD_CHECK_ARG(z && out, "ft_zero_get_stats: NULL");
  memset(out, 0, sizeof *out);
  out->stage = z->o.stage;
  out->n_blocks = z->B;
  out->numel = z->P;
  int m = td__ftz_me(z);
  for (int bi = 0; bi < z->B; bi++) {
    const td__zfblock *b = &z->b[bi];
    out->owned += b->own == m;
    out->backed += b->bak == m;
    if (b->held) out->state_numel += b->hi - b->lo;
  }
  out->grad_numel = z->o.stage == 1 ? z->P : out->state_numel;
  out->plain_steps = z->own_steps;
  out->heals = z->heals;
  out->heal_bytes = z->heal_bytes;
  out->heal_s = z->heal_s;
  out->machinery_s = z->own_s;
  out->units = (int)z->nu;
  out->unit_gathers = z->unit_gathers;
  out->peak_unit_numel = z->peak_numel;
  for (size_t i = 0; i < z->np; i++)
    if (td__tensor_storage_live(z->params[i])) out->param_numel += td_tensor_numel(z->params[i]);
  return TD_OK;
}

void td__ftz_inject_at(td_ft_zero *z, int64_t step, td_ft_when when) {
  td__ft_inject_at(&z->inj, z->pg, step, when);
}

/* ---- one attempt of a step ---- */

static td_status clear_grads(td_ft_zero *z) {
  for (size_t i = 0; i < z->np; i++) TD_TRY(td_tensor_set_grad(z->params[i], NULL));
  return TD_OK;
}

/* Runs the shard function for this member's shards without a gradient. */
static td_status compute(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                         td_ft_step_info *info) {
  int m = td__ftz_me(z);
  for (int s = 0; s < z->M; s++) {
    if (z->owner[s] != m || z->grad[s]) continue;
    TD_TRY(clear_grads(z));
    TD_TRY(fn(user, step, s, z->M));
    TD_TRY(td__ft_take_grads(z->params, z->np, z->P, z->dt, &z->grad[s], &info->machinery_s));
    info->shards_computed++;
  }
  return clear_grads(z);
}

/* Stage 2: copies the parts of bucket [off, off + len) (in out) that fall in held blocks. */
static void keep_parts(td_ft_zero *z, const td_tensor *out, int64_t off, int64_t len) {
  size_t es = td_dtype_size(z->dt);
  for (int bi = 0; bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    int64_t s0 = b->lo > off ? b->lo : off, e0 = b->hi < off + len ? b->hi : off + len;
    if (!b->held || s0 >= e0) continue;
    memcpy((char *)td_tensor_data(b->grad) + (size_t)(s0 - b->lo) * es,
           (const char *)td_tensor_data(out) + (size_t)(s0 - off) * es, (size_t)(e0 - s0) * es);
  }
}

/* The ordered reduction, bucket by bucket; afterwards every held block has the step's averaged
 * gradient (gstep = step). */
static td_status reduce(td_ft_zero *z, int64_t step) {
  td_process_group *pg = z->pg;
  int *gowner = td__malloc((size_t)z->M * sizeof *gowner), n_mine = 0;
  td_tensor **mine = td__calloc((size_t)z->M, sizeof *mine), *buf = NULL;
  td_status st = gowner && mine ? TD_OK : td_set_error(TD_ERR_NOMEM, "ft_zero_step: out of memory");
  int r = td_process_group_rank(pg);
  for (int s = 0; st == TD_OK && s < z->M; s++) gowner[s] = td__ft_group_rank(pg, z->owner[s]);
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    td_tensor_unref(b->grad);
    b->grad = NULL;
    b->gstep = INT64_MIN;
    int64_t n = b->hi - b->lo;
    if (b->held && z->o.stage != 1) st = td_tensor_zeros(&n, 1, z->dt, td_device_cpu(), &b->grad);
  }
  int64_t per = (int64_t)(z->o.bucket_bytes / td_dtype_size(z->dt));
  if (per < 1) per = 1;
  if (per > z->P) per = z->P;
  if (st == TD_OK && z->o.stage != 1) st = td_tensor_zeros(&per, 1, z->dt, td_device_cpu(), &buf);
  for (int64_t off = 0, k = 0; st == TD_OK && off < z->P; off += per, k++) {
    int64_t len = z->P - off < per ? z->P - off : per;
    td_tensor *out = NULL;
    n_mine = 0;
    st = td_tensor_narrow(z->avg ? z->avg : buf, 0, z->avg ? off : 0, len, &out);
    for (int s = 0; st == TD_OK && s < z->M; s++)
      if (gowner[s] == r) st = td_tensor_narrow(z->grad[s], 0, off, len, &mine[n_mine++]);
    if (st == TD_OK)
      st = td_process_group_all_reduce_ordered(pg, out, mine, n_mine, gowner, z->M, TD_REDUCE_AVG);
    if (st == TD_OK && !z->avg) keep_parts(z, out, off, len);
    for (int j = 0; j < n_mine; j++) td_tensor_unref(mine[j]);
    td_tensor_unref(out);
    if (st == TD_OK && k == 0) td__ftz_inject_at(z, step, TD_FT_DURING);
  }
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    if (!b->held) continue;
    if (z->avg) st = td_tensor_narrow(z->avg, 0, b->lo, b->hi - b->lo, &b->grad);
    b->gstep = step;
  }
  td_tensor_unref(buf);
  td__free(gowner);
  td__free(mine);
  return st;
}

static double sum_squares(const td_tensor *g) {
  int64_t n = td_tensor_numel(g);
  double acc = 0;
  if (td_tensor_dtype(g) == TD_DTYPE_F64) {
    const double *x = td_tensor_data(g);
    for (int64_t i = 0; i < n; i++) acc += x[i] * x[i];
  } else {
    const float *x = td_tensor_data(g);
    for (int64_t i = 0; i < n; i++) acc += (double)x[i] * (double)x[i];
  }
  return acc;
}

/* The commit vote: one all_reduce SUM of the owners' sums of squares, folded in block order.
 * Its time is added to *own_s (td_zero has no vote). */
static td_status vote(td_ft_zero *z, int64_t step, double *own_s) {
  uint64_t t0 = td__now_ns();
  int64_t nb = z->B;
  td_tensor *v = NULL;
  TD_TRY(td_tensor_zeros(&nb, 1, TD_DTYPE_F64, td_device_cpu(), &v));
  double *x = td_tensor_data(v);
  int m = td__ftz_me(z);
  td_grad_scaler *sc = z->o.scaler;
  for (int bi = 0; (z->o.max_grad_norm > 0 || sc) && bi < z->B; bi++)
    if (z->b[bi].own == m) x[bi] = sum_squares(z->b[bi].grad);
  td_status st = td_process_group_all_reduce(z->pg, v, TD_REDUCE_SUM);
  if (st == TD_OK) {
    double sq = 0;
    for (int bi = 0; bi < z->B; bi++) sq += x[bi];
    /* loss scaling: the norm of the unscaled gradient; the factor unscales too (1 / scale, a
     * power of two: exact); an inf or a NaN anywhere makes sq non-finite everywhere: skip */
    double inv = sc ? 1.0 / td_grad_scaler_get_scale(sc) : 1.0;
    double coef = z->o.max_grad_norm > 0 ? z->o.max_grad_norm / (sqrt(sq) * inv + 1e-6) : 1.0;
    z->coef = coef < 1.0 || isnan(coef) ? coef : 1.0;
    if (sc) z->coef = isfinite(sq) ? z->coef * inv : TD__FTZ_SKIP;
    z->voted = step;
    z->dec_step = step, z->dec_coef = z->coef;
  }
  td_tensor_unref(v);
  td__ft_own(own_s, t0);
  return st;
}

/* Steps held block bi with its gradient of `step` scaled by coef; drops the gradient. */
static td_status step_block(td_ft_zero *z, int bi, int64_t step, double coef) {
  td__zfblock *b = &z->b[bi];
  TD_ASSERT(b->held && b->grad && b->gstep == step && b->ver == step - 1);
  if (coef == TD__FTZ_SKIP) { /* loss scaling found an inf or a NaN: the state stays */
    b->ver = step;
    td_tensor_unref(b->grad);
    b->grad = NULL;
    b->gstep = INT64_MIN;
    return TD_OK;
  }
  td_tensor **g = td__calloc(b->nseg, sizeof *g);
  if (!g) return td_set_error(TD_ERR_NOMEM, "ft_zero_step: out of memory");
  bool prev = td_autograd_set_enabled(false);
  td_status st = coef != 1.0 ? td_tensor_mul_scalar_(b->grad, coef) : TD_OK;
  for (size_t j = 0, at = 0; st == TD_OK && j < b->nseg; j++) {
    int64_t len = z->segs[b->seg0 + j].len;
    st = td_tensor_narrow(b->grad, 0, (int64_t)at, len, &g[j]);
    at += (size_t)len;
  }
  if (st == TD_OK) st = td_optim_step_grads(b->opt, g, b->nseg);
  td_autograd_set_enabled(prev);
  for (size_t j = 0; j < b->nseg; j++) td_tensor_unref(g[j]);
  td__free(g);
  if (st != TD_OK) return st;
  b->ver = step;
  td_tensor_unref(b->grad);
  b->grad = NULL;
  b->gstep = INT64_MIN;
  return TD_OK;
}

/* Steps every held block still at step - 1 that has the step's gradient; the time of the
 * blocks this member backs (the second copy of the optimizer's work) is added to *own_s. */
td_status td__ftz_step_held(td_ft_zero *z, int64_t step, double coef, double *own_s) {
  int m = td__ftz_me(z);
  for (int bi = 0; bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    if (!b->held || b->ver != step - 1 || b->gstep != step) continue;
    uint64_t t0 = td__now_ns();
    TD_TRY(step_block(z, bi, step, coef));
    td__ft_own(b->bak == m ? own_s : NULL, t0);
  }
  return TD_OK;
}

/* Whether every member owns one block (the layout at creation, or it with spares in the places
 * of lost members): of[r], the block group rank r owns. */
static bool one_each(const td_ft_zero *z, int *of) {
  int n = td_process_group_size(z->pg);
  if (z->B != n) return false;
  for (int r = 0; r < n; r++) of[r] = -1;
  for (int bi = 0; bi < z->B; bi++) {
    int r = td__ft_group_rank(z->pg, z->b[bi].own);
    if (r < 0 || of[r] >= 0) return false;
    of[r] = bi;
  }
  return true;
}

/* The gather when every member owns one block: one all_gather per piece of the blocks. */
static td_status gather_pieces(td_ft_zero *z, int64_t step, const int *of) {
  int n = td_process_group_size(z->pg), r = td_process_group_rank(z->pg);
  int64_t S = z->b[0].hi - z->b[0].lo, q = (int64_t)(z->o.bucket_bytes / td_dtype_size(z->dt)) / n;
  if (q < 1) q = 1;
  if (q > S) q = S;
  int64_t nq = (int64_t)n * q;
  size_t es = td_dtype_size(z->dt);
  td_tensor *in = NULL, *all = NULL;
  td_status st = td_tensor_zeros(&q, 1, z->dt, td_device_cpu(), &in);
  if (st == TD_OK) st = td_tensor_zeros(&nq, 1, z->dt, td_device_cpu(), &all);
  for (int64_t off = 0; st == TD_OK && off < S; off += q) {
    int64_t len = S - off < q ? S - off : q;
    td_tensor *iv = NULL, *av = NULL;
    const td__zfblock *mb = &z->b[of[r]];
    int64_t mine = mb->hi - mb->lo - off;
    mine = mine < 0 ? 0 : mine > len ? len : mine;
    memset(td_tensor_data(in), 0, (size_t)len * es);
    td__ftz_flat_io(z, mb->lo + off, mine, td_tensor_data(in), false);
    st = td_tensor_narrow(in, 0, 0, len, &iv);
    if (st == TD_OK) st = td_tensor_narrow(all, 0, 0, (int64_t)n * len, &av);
    if (st == TD_OK) st = td_process_group_all_gather_into_tensor(z->pg, av, iv);
    for (int k = 0; st == TD_OK && k < n; k++) {
      const td__zfblock *b = &z->b[of[k]];
      int64_t valid = b->hi - b->lo - off;
      valid = valid < 0 ? 0 : valid > len ? len : valid;
      if (k != r) td__ftz_flat_io(z, b->lo + off, valid, (char *)td_tensor_data(all) + (size_t)(k * len) * es, true);
    }
    td_tensor_unref(iv);
    td_tensor_unref(av);
    if (st == TD_OK && off == 0) td__ftz_inject_at(z, step, TD_FT_DURING_GATHER);
  }
  td_tensor_unref(in);
  td_tensor_unref(all);
  return st;
}

/* The gather on any other layout: each block broadcast from its owner. */
static td_status gather_blocks(td_ft_zero *z, int64_t step) {
  int64_t S = z->b[0].hi - z->b[0].lo;
  td_tensor *t = NULL;
  TD_TRY(td_tensor_zeros(&S, 1, z->dt, td_device_cpu(), &t));
  td_status st = TD_OK;
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    const td__zfblock *b = &z->b[bi];
    int root = td__ft_group_rank(z->pg, b->own);
    td_tensor *v = NULL;
    st = td_tensor_narrow(t, 0, 0, b->hi - b->lo, &v);
    if (st == TD_OK && root == td_process_group_rank(z->pg))
      td__ftz_flat_io(z, b->lo, b->hi - b->lo, td_tensor_data(v), false);
    if (st == TD_OK) st = td_process_group_broadcast(z->pg, v, root);
    if (st == TD_OK && root != td_process_group_rank(z->pg))
      td__ftz_flat_io(z, b->lo, b->hi - b->lo, td_tensor_data(v), true);
    td_tensor_unref(v);
    if (st == TD_OK && bi == 0) td__ftz_inject_at(z, step, TD_FT_DURING_GATHER);
  }
  td_tensor_unref(t);
  return st;
}

td_status td__ftz_gather(td_ft_zero *z, int64_t step) {
  if (z->o.stage == 3) return td__ftz3_gather_rest(z, step);
  int n = td_process_group_size(z->pg);
  int *of = td__malloc((size_t)n * sizeof *of);
  if (!of) return td_set_error(TD_ERR_NOMEM, "ft_zero_step: out of memory");
  td_status st = one_each(z, of) ? gather_pieces(z, step, of) : gather_blocks(z, step);
  td__free(of);
  return st;
}

static td_status attempt(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                         td_ft_step_info *info, bool *user_failed) {
  if (z->o.stage == 3) {
    TD_TRY(td__ftz3_compute(z, step, fn, user, info, user_failed));
  } else {
    td_status st = compute(z, step, fn, user, info);
    if (st != TD_OK) {
      *user_failed = true; /* the caller's own failure: not a lost member */
      return st;
    }
  }
  td__ftz_inject_at(z, step, TD_FT_BEFORE);
  TD_TRY(reduce(z, step));
  td__ftz_inject_at(z, step, TD_FT_AFTER);
  TD_TRY(vote(z, step, &info->machinery_s));
  td__ftz_inject_at(z, step, TD_FT_AFTER_VOTE);
  /* a member whose own group failed after the vote does not step: the recovery rolls it
   * forward (as a member whose vote ended here but failed elsewhere) */
  TD_TRY(td__ft_broken(z->pg));
  TD_TRY(td__ftz_step_held(z, step, z->coef, &info->machinery_s));
  td__ftz_inject_at(z, step, TD_FT_BEFORE_GATHER);
  TD_TRY(td__ftz_gather(z, step));
  td__ftz_inject_at(z, step, TD_FT_AFTER_GATHER);
  TD_TRY(td__ft_broken(z->pg)); /* our own group failed after the gather */
  z->committed = step;
  return TD_OK;
}

/* ---- the step ---- */

static void first_step(td_ft_zero *z, int64_t step) {
  if (z->committed != INT64_MIN) return;
  z->committed = step - 1;
  for (int bi = 0; bi < z->B; bi++)
    if (z->b[bi].held) z->b[bi].ver = step - 1;
}

static bool retriable(td_status st) {
  return st == TD_ERR_UNAVAILABLE || st == TD_ERR_TIMEOUT || st == TD_ERR_STATE;
}

/* Recovers from the failure st (again while the new generation fails too); TD_OK with *done:
 * the step is committed. *no_loss counts recoveries in a row that lost no member. */
static td_status recover_loop(td_ft_zero *z, int64_t step, td_status st, td_ft_step_info *info,
                              uint64_t *t_fail, int *no_loss, bool *done, const char *fn) {
  for (;;) {
    if (!retriable(st)) return st;
    if (!*t_fail) *t_fail = td__now_ns();
    info->failures++;
    if (z->o.max_failures && info->failures > z->o.max_failures)
      return td__error_prefix(st, "%s: step %lld: failure %d, more than max_failures", fn,
                              (long long)step, info->failures);
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    bool again = false;
    int lost_before = info->lost;
    st = td__ftz_recover(z, step, why, info, done, &again);
    if (st != TD_OK && !again)
      return td__error_prefix(st, "%s: step %lld: after \"%s\"", fn, (long long)step, why);
    *no_loss = info->lost == lost_before ? *no_loss + 1 : 0;
    if (*no_loss > (z->o.max_failures ? z->o.max_failures : NO_LOSS_TRIES))
      return td_set_error(TD_ERR_STATE, "%s: step %lld failed %d times in a row without a lost "
                          "member (members running different collectives?): %s", fn,
                          (long long)step, *no_loss, why);
    if (st == TD_OK) return TD_OK;
  }
}

/* Loss scaling: ends the scaler's iteration of committed step `step` with the step's decision
 * (the vote's, or the voter's in a roll forward: alike on every member), through a one-element
 * gradient that holds an inf exactly when the step was skipped. */
static td_status scaler_end(td_ft_zero *z, int64_t step) {
  td_grad_scaler *sc = z->o.scaler;
  if (!sc) return TD_OK;
  if (z->dec_step != step)
    return td_set_error(TD_ERR_STATE, "ft_zero_step: step %lld committed without its vote's "
                        "decision", (long long)step);
  int64_t one = 1;
  td_tensor *t = NULL;
  TD_TRY(td_tensor_zeros(&one, 1, TD_DTYPE_F64, td_device_cpu(), &t));
  *(double *)td_tensor_data(t) = z->dec_coef == TD__FTZ_SKIP ? INFINITY : 0.0;
  td_status st = td_grad_scaler_unscale_grads_(sc, &t, 1);
  if (st == TD_OK) st = td_grad_scaler_update(sc);
  td_tensor_unref(t);
  return st;
}

static void step_done(const td_ft_zero *z, int64_t step, uint64_t t_fail, td_ft_step_info *info) {
  info->step = step;
  info->generation = td_process_group_generation(z->pg);
  info->members = td_process_group_size(z->pg);
  info->recovery_s = t_fail ? (double)(td__now_ns() - t_fail) * 1e-9 : 0;
  if (info->failures)
    td__ft_say(info->message, sizeof info->message, strlen(info->message),
               "; step %lld committed %.3f s after the failure", (long long)step, info->recovery_s);
}

td_status td_ft_zero_step(td_ft_zero *z, int64_t step, td_ft_shard_fn fn, void *user,
                          td_ft_step_info *info) {
  TD_CHECK_ARG(z && fn, "ft_zero_step: NULL z or shard function");
  TD_CHECK_ARG(z->committed == INT64_MIN || step == z->committed + 1,
               "ft_zero_step: step %lld after committed step %lld (steps go up by one)",
               (long long)step, (long long)z->committed);
  td_ft_step_info local;
  if (!info) info = &local;
  memset(info, 0, sizeof *info);
  first_step(z, step);
  if (z->grad_step != step) drop_grads(z);
  z->grad_step = step;
  uint64_t t_fail = 0;
  int no_loss = 0;
  for (;;) {
    bool user_failed = false, done = false;
    td_status st = attempt(z, step, fn, user, info, &user_failed);
    if (user_failed) return st;
    if (st == TD_OK) break;
    TD_TRY(recover_loop(z, step, st, info, &t_fail, &no_loss, &done, "ft_zero_step"));
    if (done) break;
  }
  uint64_t t0 = td__now_ns();
  drop_grads(z); /* the step is committed: its shard gradients go */
  td__ft_own(&info->machinery_s, t0);
  if (info->failures) {
    info->machinery_s = 0; /* a recovery's work is not the failure-free cost */
  } else {
    z->own_s += info->machinery_s;
    z->own_steps++;
  }
  TD_TRY(scaler_end(z, step));
  step_done(z, step, t_fail, info);
  return TD_OK;
}

td_status td_ft_zero_sync(td_ft_zero *z, td_ft_step_info *info) {
  TD_CHECK_ARG(z, "ft_zero_sync: NULL");
  td_ft_step_info local;
  if (!info) info = &local;
  memset(info, 0, sizeof *info);
  first_step(z, 0);
  uint64_t t_fail = 0;
  int no_loss = 0;
  for (;;) {
    td_status st = td_process_group_barrier(z->pg);
    if (st == TD_OK) st = td__ft_broken(z->pg);
    if (st == TD_OK && z->o.stage == 3) st = td__ftz3_gather_units(z); /* whole parameters */
    if (st == TD_OK) st = td__ft_broken(z->pg);
    if (st == TD_OK) break;
    bool done = false;
    TD_TRY(recover_loop(z, z->committed + 1, st, info, &t_fail, &no_loss, &done, "ft_zero_sync"));
  }
  info->step = z->committed;
  info->generation = td_process_group_generation(z->pg);
  info->members = td_process_group_size(z->pg);
  return TD_OK;
}
