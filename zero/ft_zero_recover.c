/* ft_zero_recover.c - the recovery of a td_ft_zero step (ft_zero.c has the design): after a
 * failed attempt the survivors re-form the group, exchange what each holds (one all_gather of an
 * int64 row per member), decide from that table alone (so every survivor decides alike, even
 * after an earlier recovery ended half done on some of them) whether the step rolls forward or
 * is redone, which survivors hold each optimizer block, and which blocks need a copy of their
 * state on a new backup; then they apply it.
 *
 * Row of a member: committed, voted, coef's bits (ROW_HEAD), the M shard owners (global ranks),
 * then per block: held, ver, gstep, and the block's holders (own, bak: global ranks) as this
 * member knows them. Before it, one all_reduce MAX agrees on the layout (n_shards,
 * n_blocks, stage, elements): a spare admitted to the group (td_process_group_spare) enters the
 * recovery there, learns the layout, reports TD__FTZ_JOINER as its committed step and no block,
 * is left out of the decision, and takes the roles of a lost member in the layout (the i-th lost
 * holder, in global rank order, to the i-th joining spare, in group rank order): it gets copies
 * of the lost member's blocks from their other holder (the neighbour's copy of its state), so a
 * group made whole again has the layout it had (each member owning one block: the gather is one
 * all_gather again); also the lost members' shards of the batch, and the parameters and scaler
 * state of the last committed step.
 *
 * Threads: the thread that runs the td_ft_zero's steps; no lock.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "zero_impl.h"

#define ROW_HEAD 3
#define PER_BLOCK 5 /* held, ver, gstep, own, bak */

typedef struct table {
  td_tensor *t;
  const int64_t *v;
  int n, L;
} table;

static const int64_t *row(const table *T, int m) { return T->v + (size_t)m * (size_t)T->L; }

/* Every survivor's row: what it committed and voted, its shard owners, its blocks. */
static td_status exchange(td_ft_zero *z, table *T) {
  T->n = td_process_group_size(z->pg);
  T->L = ROW_HEAD + z->M + PER_BLOCK * z->B;
  int64_t L = T->L, nL = (int64_t)T->n * T->L;
  td_tensor *mine = NULL;
  TD_TRY(td_tensor_zeros(&L, 1, TD_DTYPE_I64, td_device_cpu(), &mine));
  int64_t *x = td_tensor_data(mine);
  x[0] = z->joining ? TD__FTZ_JOINER : z->committed, x[1] = z->voted;
  memcpy(&x[2], &z->coef, sizeof(double));
  for (int s = 0; s < z->M; s++) x[ROW_HEAD + s] = z->owner[s];
  for (int bi = 0; bi < z->B; bi++) {
    int64_t *e = &x[ROW_HEAD + z->M + PER_BLOCK * bi];
    e[0] = z->b[bi].held, e[1] = z->b[bi].ver, e[2] = z->b[bi].gstep;
    e[3] = z->b[bi].own, e[4] = z->b[bi].bak;
  }
  td_status st = td_tensor_zeros(&nL, 1, TD_DTYPE_I64, td_device_cpu(), &T->t);
  if (st == TD_OK) st = td_process_group_all_gather_into_tensor(z->pg, T->t, mine);
  td_tensor_unref(mine);
  if (st == TD_OK) T->v = td_tensor_data(T->t);
  return st;
}

/* The lowest group rank that is not a joining spare (decide() made sure there is one). */
static int first_member(const table *T) {
  int m = 0;
  while (m < T->n - 1 && row(T, m)[0] == TD__FTZ_JOINER) m++;
  return m;
}

/* With spares joining, per group rank m: the global rank of the lost holder whose roles the
 * spare at m takes (the i-th lost holder of the layout the lowest member knows, in global rank
 * order, to the i-th joining spare, in group rank order), or -1. All -1 without spares. NULL:
 * out of memory. */
static int *roles(const td_ft_zero *z, const table *T) {
  int *role = td__malloc((size_t)T->n * sizeof *role);
  if (!role) return NULL;
  for (int m = 0; m < T->n; m++) role[m] = -1;
  const int64_t *r0 = row(T, first_member(T)) + ROW_HEAD + z->M;
  int next = 0; /* the next joining spare's group rank to look from */
  for (int64_t last = -1;;) {
    int64_t g = INT64_MAX; /* the lowest lost holder above `last` */
    for (int bi = 0; bi < z->B; bi++)
      for (int q = 3; q <= 4; q++) {
        int64_t h = r0[PER_BLOCK * bi + q];
        if (h > last && h < g && h >= 0 && td__ft_group_rank(z->pg, (int)h) < 0) g = h;
      }
    if (g == INT64_MAX) break;
    while (next < T->n && row(T, next)[0] != TD__FTZ_JOINER) next++;
    if (next >= T->n) break;
    role[next++] = (int)g;
    last = g;
  }
  return role;
}

/* The group rank that takes the roles of holder g (a global rank) in the new layout: its own
 * when it lives, the spare taking them when it was lost, else -1. */
static int role_of(const td_ft_zero *z, const table *T, const int *role, int64_t g) {
  if (g < 0) return -1;
  int m = td__ft_group_rank(z->pg, (int)g);
  for (int j = 0; m < 0 && j < T->n; j++)
    if (role[j] == g) m = j;
  return m;
}

/* The decision, alike on every survivor. */
typedef struct plan {
  int64_t k;        /* the step in question */
  bool forward;     /* a survivor voted k: complete it */
  double coef;
  int *own, *bak;   /* per block: group ranks; bak -1 */
  int *src;         /* per block: the valid holder the copies come from */
  bool *copy_own;   /* per block: own needs a copy of the state from src */
  bool *copy;       /* per block: bak needs a copy of the state from src */
} plan;

static bool valid(const table *T, const plan *p, int M, int m, int bi) {
  const int64_t *e = row(T, m) + ROW_HEAD + M + PER_BLOCK * bi;
  if (!e[0]) return false;
  if (!p->forward) return e[1] == p->k - 1;
  return e[1] == p->k || (e[1] == p->k - 1 && e[2] == p->k);
}

/* Fills p from the table; TD_ERR_UNAVAILABLE naming a block no survivor can restore. */
static td_status decide(td_ft_zero *z, const table *T, plan *p) {
  p->k = INT64_MAX;
  for (int m = 0; m < T->n; m++) {
    int64_t c = row(T, m)[0];
    if (c != TD__FTZ_JOINER && c + 1 < p->k) p->k = c + 1;
  }
  if (p->k == INT64_MAX)
    return td_set_error(TD_ERR_STATE, "ft_zero: a spare joined a group with no member holding "
                        "the training's state");
  p->forward = false, p->coef = 1.0;
  for (int m = 0; m < T->n && !p->forward; m++)
    if (row(T, m)[1] == p->k) {
      p->forward = true;
      memcpy(&p->coef, &row(T, m)[2], sizeof(double));
    }
  bool joiners = false;
  for (int m = 0; m < T->n; m++) joiners |= row(T, m)[0] == TD__FTZ_JOINER;
  int *load = td__calloc((size_t)T->n, sizeof *load);
  int *role = roles(z, T);
  td_status st = load && role ? TD_OK : td_set_error(TD_ERR_NOMEM, "ft_zero_step: out of memory");
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    /* the valid holders in ring order from the block's home rank (bi * n / B: at full size the
     * layout at creation, own = bi and bak = bi + 1, so its gather is one all_gather again) */
    int home = (int)((int64_t)bi * T->n / z->B);
    p->own[bi] = p->bak[bi] = p->src[bi] = -1;
    p->copy_own[bi] = p->copy[bi] = false;
    for (int i = 0; i < T->n; i++) {
      int m = (home + i) % T->n;
      if (!valid(T, p, z->M, m, bi)) continue;
      if (p->own[bi] < 0) p->own[bi] = m;
      else if (p->bak[bi] < 0) p->bak[bi] = m;
    }
    p->src[bi] = p->own[bi];
    /* spares joining: the holders this block had, a lost one replaced by the spare taking its
     * roles; each that is not a valid holder gets a copy from one */
    const int64_t *e = row(T, first_member(T)) + ROW_HEAD + z->M + PER_BLOCK * bi;
    int ro = role_of(z, T, role, e[3]), rb = role_of(z, T, role, e[4]);
    if (joiners && p->src[bi] >= 0 && ro >= 0 && rb >= 0 && ro != rb) {
      p->own[bi] = ro, p->bak[bi] = rb;
      p->copy_own[bi] = !valid(T, p, z->M, ro, bi);
      p->copy[bi] = !valid(T, p, z->M, rb, bi);
    }
    if (p->own[bi] < 0)
      st = td_set_error(TD_ERR_UNAVAILABLE, "optimizer block %d (elements [%lld, %lld)) was "
                        "held only by lost members (global ranks %d and %d): its state is gone "
                        "(both holders lost at once); restart from a checkpoint", bi,
                        (long long)z->b[bi].lo, (long long)z->b[bi].hi, (int)e[3], (int)e[4]);
    if (st != TD_OK) break;
    load[p->own[bi]]++;
    if (p->bak[bi] >= 0) load[p->bak[bi]]++;
  }
  for (int bi = 0; st == TD_OK && bi < z->B; bi++) {
    if (p->bak[bi] >= 0 || T->n < 2) continue;
    int best = -1;
    for (int m = 0; m < T->n; m++)
      if (m != p->own[bi] && (best < 0 || load[m] < load[best])) best = m;
    p->bak[bi] = best;
    p->copy[bi] = true;
    load[best]++;
  }
  td__free(load);
  td__free(role);
  return st;
}

/* Copies block bi's state and values from group rank src to group rank dst (two broadcasts
 * from src; every member takes part). */
static td_status copy_block(td_ft_zero *z, int bi, int src, int dst, int64_t ver) {
  td__zfblock *b = &z->b[bi];
  int r = td_process_group_rank(z->pg);
  int64_t nm = (int64_t)b->nseg * 4;
  td_tensor *meta = NULL, *data = NULL;
  TD_TRY(td_tensor_zeros(&nm, 1, TD_DTYPE_I64, td_device_cpu(), &meta));
  int64_t *mv = td_tensor_data(meta);
  td_status st = TD_OK;
  for (size_t j = 0; r == src && st == TD_OK && j < b->nseg; j++) {
    td_tensor *bufs[3] = {NULL, NULL, NULL};
    st = td_optim_state_get(b->opt, j, bufs, &mv[4 * j + 3]);
    for (int q = 0; q < 3; q++) {
      mv[4 * j + q] = bufs[q] != NULL;
      if (bufs[q] && td_tensor_dtype(bufs[q]) != z->dt)
        st = td_set_error(TD_ERR_DTYPE, "ft_zero: optimizer state in another dtype");
      td_tensor_unref(bufs[q]);
    }
  }
  if (st == TD_OK) st = td_process_group_broadcast(z->pg, meta, src);
  int64_t count = b->hi - b->lo;
  for (size_t j = 0; j < b->nseg; j++)
    for (int q = 0; q < 3; q++) count += mv[4 * j + q] ? z->segs[b->seg0 + j].len : 0;
  if (st == TD_OK) st = td_tensor_zeros(&count, 1, z->dt, td_device_cpu(), &data);
  size_t es = td_dtype_size(z->dt);
  char *d = st == TD_OK ? td_tensor_data(data) : NULL;
  if (st == TD_OK && r == src) {
    td__ftz_block_io(z, bi, d, false);
    char *at = d + (size_t)(b->hi - b->lo) * es;
    for (size_t j = 0; st == TD_OK && j < b->nseg; j++) {
      td_tensor *bufs[3] = {NULL, NULL, NULL};
      st = td_optim_state_get(b->opt, j, bufs, NULL);
      for (int q = 0; q < 3; q++) {
        if (st == TD_OK && mv[4 * j + q] && bufs[q]) {
          st = td_tensor_copy_to_buffer(bufs[q], at, (size_t)z->segs[b->seg0 + j].len * es);
          at += (size_t)z->segs[b->seg0 + j].len * es;
        }
        td_tensor_unref(bufs[q]);
      }
    }
  }
  if (st == TD_OK) st = td_process_group_broadcast(z->pg, data, src);
  if (st == TD_OK && r == dst && z->joining) z->heal_bytes += (int64_t)((size_t)count * es);
  if (st == TD_OK && r == dst) {
    td__ftz_block_drop(b);
    st = td__ftz_block_hold(z, bi, ver);
    if (st == TD_OK) td__ftz_block_io(z, bi, d, true);
    int64_t at = b->hi - b->lo;
    for (size_t j = 0; st == TD_OK && j < b->nseg; j++) {
      td_tensor *set[3] = {NULL, NULL, NULL};
      int64_t len = z->segs[b->seg0 + j].len;
      for (int q = 0; st == TD_OK && q < 3; q++) {
        if (!mv[4 * j + q]) continue;
        st = td_tensor_narrow(data, 0, at, len, &set[q]);
        at += len;
      }
      if (st == TD_OK) st = td_optim_state_set(b->opt, j, set, mv[4 * j + 3]);
      for (int q = 0; q < 3; q++) td_tensor_unref(set[q]);
    }
  }
  td_tensor_unref(meta);
  td_tensor_unref(data);
  return st;
}

/* Applies the plan: holders re-assigned, the step rolled forward or left to be redone, copies. */
static td_status apply(td_ft_zero *z, const table *T, const plan *p, td_ft_step_info *info,
                       char *msg, size_t n, size_t *len) {
  int r = td_process_group_rank(z->pg);
  int moved = 0;
  for (int bi = 0; bi < z->B; bi++) {
    td__zfblock *b = &z->b[bi];
    int own = td_process_group_global_rank(z->pg, p->own[bi]);
    int bak = p->bak[bi] >= 0 ? td_process_group_global_rank(z->pg, p->bak[bi]) : -1;
    if (own != b->own || bak != b->bak) {
      char w1[160], w2[160];
      *len = td__ft_say(msg, n, *len, "%sblock %d -> %s%s%s%s",
                        moved ? ", " : "; optimizer blocks: ", bi, p->copy_own[bi] ? "a copy to " : "",
                        td__ft_who(z->pg, p->own[bi], w1, sizeof w1),
                        bak >= 0 ? (p->copy[bi] ? " and a copy to " : " and ") : "",
                        bak >= 0 ? td__ft_who(z->pg, p->bak[bi], w2, sizeof w2) : "");
      moved++;
    }
    b->own = own, b->bak = bak;
    /* a holder that is no longer one goes now, or once it gave the copies */
    bool giver = (p->copy_own[bi] || p->copy[bi]) && r == p->src[bi];
    if (b->held && r != p->own[bi] && r != p->bak[bi] && !giver) td__ftz_block_drop(b);
    info->blocks_copied += p->copy_own[bi] + p->copy[bi];
  }
  (void)T;
  /* a roll forward steps here; a redo reduces again (reduce() resets) */
  if (p->forward) TD_TRY(td__ftz_step_held(z, p->k, p->coef, NULL));
  if (p->forward) z->dec_step = p->k, z->dec_coef = p->coef; /* the voter's decision */
  int64_t target = p->forward ? p->k : p->k - 1;
  for (int bi = 0; bi < z->B; bi++) {
    if (p->copy_own[bi]) TD_TRY(copy_block(z, bi, p->src[bi], p->own[bi], target));
    if (p->copy[bi]) TD_TRY(copy_block(z, bi, p->src[bi], p->bak[bi], target));
    if (z->b[bi].held && r != p->own[bi] && r != p->bak[bi]) td__ftz_block_drop(&z->b[bi]);
  }
  if (p->forward) {
    TD_TRY(td__ftz_gather(z, p->k));
    if (z->committed < p->k) info->rolled_forward = true;
    if (z->committed < p->k) z->committed = p->k;
  }
  return TD_OK;
}

/* Takes the shard owners of the lowest member that is not a joining spare, then gives the lost
 * members' shards to survivors (a joined spare, holding none, first). */
static int reshard(td_ft_zero *z, const table *T, char *msg, size_t n, size_t *len) {
  int m = td__ftz_me(z), src = first_member(T);
  for (int s = 0; s < z->M; s++) {
    z->owner[s] = (int)row(T, src)[ROW_HEAD + s];
    if (z->owner[s] != m && z->grad[s]) {
      td_tensor_unref(z->grad[s]);
      z->grad[s] = NULL;
    }
  }
  return td__ft_reassign(z->pg, z->owner, z->M, z->grad, msg, n, len);
}

/* The layout every member must share, agreed before the exchange (whose rows it sizes): a
 * joining spare reports none and learns it. *joiners: a member is joining. */
static td_status head(td_ft_zero *z, bool *joiners, bool *again) {
  int64_t seven = 7;
  td_tensor *v = NULL;
  TD_TRY(td_tensor_zeros(&seven, 1, TD_DTYPE_I64, td_device_cpu(), &v));
  int64_t *x = td_tensor_data(v);
  x[0] = z->joining ? 0 : z->M, x[1] = z->joining ? 0 : z->B;
  x[2] = z->o.stage, x[3] = -z->o.stage, x[4] = z->P, x[5] = -z->P, x[6] = z->joining;
  td_status st = td_process_group_all_reduce(z->pg, v, TD_REDUCE_MAX);
  *again = st != TD_OK;
  if (st == TD_OK) {
    *joiners = x[6] != 0;
    if (x[2] != -x[3] || x[4] != -x[5])
      st = td_set_error(TD_ERR_INVALID, "ft_zero: a spare joined with another model or stage "
                        "(%lld to %lld elements, stages %lld to %lld among the members)",
                        (long long)-x[5], (long long)x[4], (long long)-x[3], (long long)x[2]);
    else if (x[0] < 1 || x[1] < 1)
      st = td_set_error(TD_ERR_STATE, "ft_zero: a spare joined a group with no member holding "
                        "the training's state");
    else if (x[0] > INT32_MAX || x[1] > z->P)
      st = td_set_error(TD_ERR_STATE, "ft_zero: a member reports %lld shards and %lld blocks "
                        "for %lld elements", (long long)x[0], (long long)x[1], (long long)z->P);
    else if (z->joining && !z->b)
      st = td__ftz_learn(z, (int)x[0], (int)x[1]);
    else if (x[0] != z->M || x[1] != z->B)
      st = td_set_error(TD_ERR_STATE, "ft_zero: members differ in n_shards (%d, %lld) or "
                        "n_blocks (%d, %lld)", z->M, (long long)x[0], z->B, (long long)x[1]);
  }
  td_tensor_unref(v);
  return st;
}

/* What a joining spare takes beside its blocks' copies: the parameters of step k - 1 when the
 * step is redone (a roll forward's gather gave it those of k; stage 3: those outside the
 * units), from the lowest member; the
 * scaler state of step k - 1, from the lowest member at k - 1 (a roll forward's spare ends k's
 * iteration itself, as the members at k - 1 do). Every member takes part. */
static td_status heal(td_ft_zero *z, const table *T, const plan *p) {
  int root = first_member(T), sroot = root;
  while (sroot < T->n - 1 && row(T, sroot)[0] != p->k - 1) sroot++;
  int64_t bytes = 0;
  /* the parameters with memory between steps (stage 3: those outside the units; the units'
   * come from the blocks' masters at each use) */
  td_tensor **ps = td__calloc(z->np, sizeof *ps);
  if (!ps) return td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  size_t nps = 0;
  for (size_t i = 0; i < z->np; i++)
    if (z->o.stage != 3 || z->unit_of[i] < 0) ps[nps++] = z->params[i];
  td_status st = TD_OK;
  if (!p->forward) st = td__ft_bcast_packed(z->pg, ps, nps, root, &bytes);
  for (size_t i = 0; p->forward && i < nps; i++) bytes += (int64_t)td_tensor_nbytes(ps[i]);
  td__free(ps); /* (a roll forward's gather sent them) */
  if (st == TD_OK && z->o.scaler) {
    int64_t two = 2;
    td_tensor *sv = NULL;
    td_grad_scaler_state gs;
    st = td_grad_scaler_get_state(z->o.scaler, &gs);
    if (st == TD_OK) st = td_tensor_zeros(&two, 1, TD_DTYPE_F64, td_device_cpu(), &sv);
    if (st == TD_OK) {
      double *x = td_tensor_data(sv);
      x[0] = gs.scale, x[1] = (double)gs.growth_tracker;
      st = td_process_group_broadcast(z->pg, sv, sroot);
      gs.scale = x[0], gs.growth_tracker = (int64_t)x[1];
    }
    if (st == TD_OK && z->joining) st = td_grad_scaler_set_state(z->o.scaler, &gs);
    td_tensor_unref(sv);
  }
  if (st == TD_OK && z->joining) {
    z->committed = p->forward ? p->k : p->k - 1;
    z->heal_bytes += bytes;
  }
  return st;
}

td_status td__ftz_recover(td_ft_zero *z, int64_t step, const char *why, td_ft_step_info *info,
                         bool *done, bool *again) {
  char *m = info->message;
  size_t n = sizeof info->message, len = strlen(m);
  int lost = 0, joined = 0;
  TD_TRY(td__ft_reform(z->given, &z->pg, z->o.reform_timeout, step, why, m, n, &len, &lost,
                       &joined));
  info->lost += lost;
  info->joined += joined;
  td__ftz_inject_at(z, step, TD_FT_RECOVERY);
  return td__ftz_settle(z, step, info, done, again);
}

td_status td__ftz_settle(td_ft_zero *z, int64_t step, td_ft_step_info *info, bool *done,
                         bool *again) {
  char *m = info->message;
  size_t n = sizeof info->message, len = strlen(m);
  bool joiners = false;
  TD_TRY(head(z, &joiners, again));
  table T = {0};
  plan p = {0};
  p.own = td__calloc((size_t)z->B, sizeof *p.own);
  p.bak = td__calloc((size_t)z->B, sizeof *p.bak);
  p.copy = td__calloc((size_t)z->B, sizeof *p.copy);
  p.src = td__calloc((size_t)z->B, sizeof *p.src);
  p.copy_own = td__calloc((size_t)z->B, sizeof *p.copy_own);
  td_status st = p.own && p.bak && p.copy && p.src && p.copy_own
                     ? TD_OK : td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  if (st == TD_OK) {
    st = exchange(z, &T);
    *again = st != TD_OK; /* the new generation failed too: recover once more */
  }
  if (st == TD_OK) st = decide(z, &T, &p); /* a lost block: every survivor stops here */
  int moved = 0;
  if (st == TD_OK) {
    moved = reshard(z, &T, m, n, &len);
    if (moved < 0) st = td_set_error(TD_ERR_NOMEM, "ft_zero: out of memory");
  }
  if (st == TD_OK) {
    if (!moved) len = td__ft_say(m, n, len, "; no shard moved (every holder lives)");
    st = apply(z, &T, &p, info, m, n, &len);
    if (st == TD_OK && joiners) st = heal(z, &T, &p);
    if (st != TD_OK) *again = true;
  }
  if (st == TD_OK) {
    *done = z->committed >= step;
    len = td__ft_say(m, n, len, p.forward ? "; step %lld completed from the survivors' state"
                                          : "; step %lld goes on from the parameters before it",
                     (long long)p.k);
    info->shards_recomputed += *done ? 0 : moved;
  }
  td_tensor_unref(T.t);
  td__free(p.own);
  td__free(p.bak);
  td__free(p.copy);
  td__free(p.src);
  td__free(p.copy_own);
  return st;
}

