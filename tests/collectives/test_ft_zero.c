/* test_ft_zero.c - fault-tolerant ZeRO stages 1 and 2 (td_ft_zero) under injected faults, 4 real
 * processes: a SIGKILL, a closed connection or a SIGSTOP at a chosen rank and step, before,
 * during or after the gradient reduction and before, during or after the all-gather of the
 * parameters, a second kill in a later step or in the recovery from the first. Every run must
 * finish, every survivor exits 0 as the process that started, and the float64 parameters of
 * every survivor after 6 AdamW steps (two parameter groups, clipping) equal the failure-free
 * run's bit for bit, at both stages (stage 1 and stage 2 give the same bits too). After each
 * loss the blocks are held twice again: over the survivors, every block has one owner and one
 * backup (the stats' sums), and each lost holder's block was copied to a new one.
 *
 * Loss scaling: the scaled steps train the unscaled parameters exactly, and an overflow is
 * skipped by every member of td_ft_zero and td_ft_ddp alike. Each member's own time (td_ft_step_info.machinery_s, td_ft_zero_stats) is set in every
 * failure-free step and within it, 0 in a step that recovered, and the stats sum it.
 *
 * Two neighbours lost at once (both holders of a block): every survivor's step fails with
 * TD_ERR_UNAVAILABLE naming the block, soon, instead of hanging or going on with wrong state.
 * Without clipping, td_ft_zero's parameters equal td_ft_ddp's bit for bit: sharding the
 * optimizer changes nothing in the numbers.
 *
 * Spares (6 processes: 4 members, 2 spares): a spare admitted in place of a lost member is
 * healed from the survivors (the lost member's blocks from their other holder, the parameters,
 * the scaler state) at every stage, and the run ends with the failure-free parameters bitwise,
 * one block owned and one backed by each member.
 */
#include <math.h>
#include <signal.h>
#include <sys/stat.h>

#include "ft_test_util.h"

#define WORLD 4
#define STEPS 6

typedef struct zcase {
  const char *name;
  int stage;
  fault f[2];
  int nf;
  uint64_t generation; /* what the survivors report at the end */
  int members;
  int lost;
  int moved;           /* shards recomputed in the run; -1: 0 or 1 per lost member (the step
                          is completed from the survivors' state when one of them passed the
                          vote, redone otherwise: a race between the kill and the vote) */
  int copied;          /* blocks copied to a new holder; -1: at least one */
  int64_t timeout_ms;  /* the group's timeout (0: 20 s) */
  bool fails;          /* both holders of a block lost: the survivors' step fails */
  int n_units;         /* stage 3: 2 (0), both linear layers; 1: the first, the second's 51
                          parameters whole, gathered at the commit as at stage 2 */
  char dir[256];
} zcase;

/* Shard s of step k (ft_test_util.h), its loss tripled: gradient norms above the clip's 0.5. */
static td_status shard_fn(void *user, int64_t step, int s, int n_shards) {
  (void)n_shards;
  return ft_shard_backward(user, step, s, 3.0);
}

/* The optimizer's two groups: the weights (decay 0.1) and the biases (none). */
typedef struct groups {
  td_tensor_list ps;
  td_tensor *w[2], *b[2];
  td_optim_group g[2];
  td_optim_options oo;
} groups;

static void groups_make(td_module *m, groups *g, double lr) {
  td_tensor_list_init(&g->ps);
  MP_CHECK_OK(td_module_parameters(m, &g->ps));
  MP_CHECK(g->ps.n == 4);
  g->w[0] = g->ps.tensors[0], g->w[1] = g->ps.tensors[2];
  g->b[0] = g->ps.tensors[1], g->b[1] = g->ps.tensors[3];
  td_optim_group_init(&g->g[0], g->w, 2);
  g->g[0].weight_decay = 0.1;
  td_optim_group_init(&g->g[1], g->b, 2);
  g->g[1].weight_decay = 0.0;
  td_optim_options_init(&g->oo, TD_OPTIM_ADAMW);
  g->oo.lr = lr;
}

static void write_params(const char *dir, const char *what, int rank, const td_tensor_list *ps) {
  for (size_t i = 0; i < ps->n; i++)
    ft_write_file(dir, what, rank, td_tensor_data(ps->tensors[i]), td_tensor_nbytes(ps->tensors[i]),
               i ? "a" : "w");
}

/* A survivor's lowest group rank ends a stopped member (the test started it). */
static void end_stopped(const zcase *c, td_process_group *cur, int rank) {
  for (int i = 0; i < c->nf && td_process_group_global_rank(cur, 0) == rank; i++) {
    if (c->f[i].what != TD_FT_STOP) continue;
    char pid[32] = "", path[400];
    snprintf(path, sizeof path, "%s/start.%d", c->dir, c->f[i].rank);
    FILE *f = fopen(path, "r");
    MP_CHECK(f && fgets(pid, sizeof pid, f));
    fclose(f);
    MP_CHECK(atoi(pid) > 0 && kill(atoi(pid), SIGKILL) == 0);
  }
}

static int worker(int rank, int world, const char *method, void *arg) {
  zcase *c = arg;
  ft_record_start(c->dir, rank);
  int64_t tmo = c->timeout_ms ? td_test_ms(c->timeout_ms) : 20000;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, tmo, &pg));
  td_module *m = ft_build();
  groups g;
  groups_make(m, &g, 1e-2);
  td_ft_zero_options zo;
  td_ft_zero_options_init(&zo);
  zo.stage = c->stage;
  zo.bucket_bytes = 64 * sizeof(double); /* 163 parameters: 3 reduction buckets, 3 gather pieces */
  zo.max_grad_norm = 0.5;
  zo.reform_timeout = c->timeout_ms ? 2 * tmo : 20000;
  td_module *units[2] = {td_module_child_at(m, 0, NULL), td_module_child_at(m, 2, NULL)};
  int nu = c->n_units ? c->n_units : 2;
  if (c->stage == 3) zo.units = units, zo.n_units = (size_t)nu; /* the linear layers */
  td_ft_zero *z = NULL;
  MP_CHECK_OK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z));
  td_ft_zero_stats zs;
  MP_CHECK_OK(td_ft_zero_get_stats(z, &zs));
  MP_CHECK(zs.owned == 1 && zs.backed == 1 && zs.numel == 163 && zs.n_blocks == WORLD);
  MP_CHECK(zs.state_numel >= 2 * (163 / WORLD) && zs.state_numel <= 2 * (163 / WORLD + 1));
  for (int i = 0; i < c->nf; i++)
    MP_CHECK_OK(td_ft_zero_inject(z, c->f[i].rank, c->f[i].step, c->f[i].when, c->f[i].what));
  int lost = 0, moved = 0, copied = 0, plain = 0;
  double own = 0;
  int64_t gathers = 0;
  td_status st = TD_OK;
  for (int64_t step = 0; st == TD_OK && step < STEPS; step++) {
    MP_CHECK_OK(td_ft_zero_set_lr(z, 1e-2 * (1.0 - 0.1 * (double)step)));
    td_ft_step_info info;
    double t0 = td_test_now_s();
    st = td_ft_zero_step(z, step, shard_fn, m, &info);
    double wall = td_test_now_s() - t0;
    if (st != TD_OK) break;
    MP_CHECK(info.step == step);
    /* its own time: set in a failure-free step (a gradient copy, the vote, the backed block's
     * step: more than nothing), a part of the step; 0 in a step that recovered */
    if (!info.failures) MP_CHECK(info.machinery_s > 0 && info.machinery_s < wall);
    else MP_CHECK(info.machinery_s == 0);
    plain += !info.failures;
    own += info.machinery_s;
    if (c->stage == 3) { /* between steps no parameter has memory; a plain step gathers each
                            unit twice (forward, backward) per shard pass, and every member runs
                            as many passes as the member with the most shards */
      MP_CHECK_OK(td_ft_zero_get_stats(z, &zs));
      MP_CHECK(zs.units == nu && zs.param_numel == (nu == 2 ? 0 : 51));
      int n = info.members;
      MP_CHECK(info.failures || zs.unit_gathers - gathers == 2 * nu * ((WORLD + n - 1) / n));
      /* one unit at a time: the first layer's 112 elements (the second's 51 freed in backward
         before the first is gathered again) */
      MP_CHECK(zs.peak_unit_numel == 112);
      gathers = zs.unit_gathers;
    }
    if (info.failures) fprintf(stderr, "[rank %d] %s\n", rank, info.message);
    lost += info.lost;
    moved += info.shards_recomputed;
    copied += info.blocks_copied;
  }
  if (c->fails) { /* the block's state is gone: a clear error on every survivor, no hang */
    fprintf(stderr, "[rank %d] %s\n", rank, td_last_error());
    MP_CHECK(st == TD_ERR_UNAVAILABLE);
    MP_CHECK(strstr(td_last_error(), "optimizer block 1") && strstr(td_last_error(), "gone"));
    td_ft_zero_destroy(z);
    td_process_group_destroy(pg);
    td_tensor_list_fini(&g.ps);
    td_module_unref(m);
    td_rpc_shutdown(a, false, 5000);
    td_rpc_destroy(a);
    return 0;
  }
  MP_CHECK_OK(st);
  td_ft_step_info sync;
  MP_CHECK_OK(td_ft_zero_sync(z, &sync));
  lost += sync.lost;
  copied += sync.blocks_copied;
  MP_CHECK(sync.step == STEPS - 1);
  td_process_group *cur = td_ft_zero_group(z);
  MP_CHECK_OK(td_ft_zero_get_stats(z, &zs));
  MP_CHECK(zs.plain_steps == plain && plain >= STEPS - c->nf); /* a fault costs one step */
  MP_CHECK(fabs(zs.machinery_s - own) <= 1e-12 * (own + 1)); /* the same sum */
  MP_CHECK(zs.param_numel == 163); /* stage 3: the sync gathered every unit */
  char rep[256];
  int k = snprintf(rep, sizeof rep, "%llu %d %d %d %d %d %d %d\n",
               (unsigned long long)td_process_group_generation(cur), td_process_group_size(cur),
               lost, moved, copied, zs.owned, zs.backed, (int)getpid());
  ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
  write_params(c->dir, "params", rank, &g.ps);
  end_stopped(c, cur, rank);
  bool whole = td_process_group_size(cur) == world;
  td_ft_zero_destroy(z);
  td_process_group_destroy(pg);
  td_tensor_list_fini(&g.ps);
  td_module_unref(m);
  /* with a member gone the graceful shutdown's barrier cannot complete */
  td_status sd = td_rpc_shutdown(a, whole, 30000);
  MP_CHECK(!whole || sd == TD_OK);
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static char baseline[4096]; /* the first run's parameters (stage 2, no failure) */
static size_t baseline_n;

static void check_survivor(const zcase *c, int r, int *owned, int *backed) {
  char buf[4096], rep[256];
  int pid0 = ft_started_once(c->dir, r);
  if (c->fails) return;
  size_t n = ft_read_file(c->dir, "report", r, rep, sizeof rep - 1);
  rep[n] = 0;
  unsigned long long gen = 0;
  int members = 0, lost = 0, moved = 0, copied = 0, own = 0, bak = 0, pid1 = 0;
  assert_int_equal(sscanf(rep, "%llu %d %d %d %d %d %d %d", &gen, &members, &lost, &moved,
                          &copied, &own, &bak, &pid1), 8);
  assert_int_equal(pid1, pid0); /* the process that started is the one that finished */
  assert_int_equal(gen, c->generation);
  assert_int_equal(members, c->members);
  assert_int_equal(lost, c->lost);
  if (c->moved >= 0) assert_int_equal(moved, c->moved);
  else assert_true(moved >= 0 && moved <= c->lost);
  if (c->copied >= 0) assert_int_equal(copied, c->copied);
  else assert_true(copied >= 1);
  *owned += own, *backed += bak;
  n = ft_read_file(c->dir, "params", r, buf, sizeof buf);
  assert_true(n > 0);
  if (!baseline_n) {
    memcpy(baseline, buf, n);
    baseline_n = n;
  }
  assert_int_equal(n, baseline_n);
  assert_memory_equal(buf, baseline, n); /* bitwise the failure-free run */
}

static void run_case(zcase *c) {
  int codes[WORLD];
  char label[400];
  snprintf(label, sizeof label, "case stage %d, %s", c->stage, c->name);
  int bad = ft_run_workers(c->dir, sizeof c->dir, "/tmp/td_ft_zero_XXXXXX", WORLD, worker, c,
                           codes, label);
  int killed = 0, owned = 0, backed = 0;
  for (int r = 0; r < WORLD; r++) {
    if (ft_victim(c->f, c->nf, r)) {
      assert_int_equal(codes[r], 128 + SIGKILL);
      killed++;
      continue;
    }
    assert_int_equal(codes[r], 0); /* every survivor finished by itself */
    check_survivor(c, r, &owned, &backed);
  }
  assert_int_equal(bad, killed);
  if (!c->fails) { /* every block held twice again, over the survivors */
    assert_int_equal(owned, WORLD);
    assert_int_equal(backed, WORLD);
  }
  ft_remove_dir(c->dir);
}


static void test_ft_zero_matrix(void **state) {
  (void)state;
  zcase cases[] = {
      {"no failure", 2, {{0}}, 0, 0, 4, 0, 0, 0},
      {"no failure", 1, {{0}}, 0, 0, 4, 0, 0, 0},
      {"kill rank 2 before the reduction of step 2", 2, {KILL(2, 2, TD_FT_BEFORE)}, 1, 1, 3, 1,
       1, 2},
      {"kill rank 1 during the reduction of step 3", 2, {KILL(1, 3, TD_FT_DURING)}, 1, 1, 3, 1,
       1, 2},
      {"kill rank 3 after the reduction (before the vote) of step 1", 1,
       {KILL(3, 1, TD_FT_AFTER)}, 1, 1, 3, 1, 1, 2},
      {"kill rank 2 after its optimizer step, before the all-gather of step 2", 2,
       {KILL(2, 2, TD_FT_BEFORE_GATHER)}, 1, 1, 3, 1, -1, 2},
      {"kill rank 1 during the all-gather of step 3", 1, {KILL(1, 3, TD_FT_DURING_GATHER)}, 1, 1,
       3, 1, -1, 2},
      {"kill rank 3 after the all-gather of step 4", 2, {KILL(3, 4, TD_FT_AFTER_GATHER)}, 1, 1,
       3, 1, -1, 2},
      {"close rank 2 before the all-gather of step 2", 2, {CLOSE(2, 2, TD_FT_BEFORE_GATHER)}, 1,
       1, 4, 0, 0, 0},
      {"close rank 1 during the reduction of step 1", 1, {CLOSE(1, 1, TD_FT_DURING)}, 1, 1, 4, 0,
       0, 0},
      {"close rank 3 after the all-gather of step 3", 2, {CLOSE(3, 3, TD_FT_AFTER_GATHER)}, 1, 1,
       4, 0, 0, 0},
      {"close rank 2 after the vote of step 2 (voted, not stepped: rolled forward)", 2,
       {CLOSE(2, 2, TD_FT_AFTER_VOTE)}, 1, 1, 4, 0, 0, 0},
      {"close rank 0 after the vote of step 4 (voted, not stepped: rolled forward)", 1,
       {CLOSE(0, 4, TD_FT_AFTER_VOTE)}, 1, 1, 4, 0, 0, 0},
      {"kill rank 3 before step 1, then rank 1 during the all-gather of step 3", 2,
       {KILL(3, 1, TD_FT_BEFORE), KILL(1, 3, TD_FT_DURING_GATHER)}, 2, 2, 2, 2, -1, -1},
      {"kill rank 3 before step 1, then rank 2 during the reduction of step 3 (block 2's state "
       "from the copy made at step 1)", 2, {KILL(3, 1, TD_FT_BEFORE), KILL(2, 3, TD_FT_DURING)},
       2, 2, 2, 2, 2, -1},
      {"kill rank 1 before the all-gather of step 3, then rank 3 in the recovery", 1,
       {KILL(1, 3, TD_FT_BEFORE_GATHER), KILL(3, 3, TD_FT_RECOVERY)}, 2, 2, 2, 2, -1, -1},
      {"kill ranks 1 and 3 at once, before step 2 (no block loses both holders)", 2,
       {KILL(1, 2, TD_FT_BEFORE), KILL(3, 2, TD_FT_BEFORE)}, 2, 1, 2, 2, 2, -1},
      {"stop rank 2 before the all-gather of step 2 (seen at the group's timeout)", 2,
       {{2, 2, TD_FT_BEFORE_GATHER, TD_FT_STOP}}, 1, 1, 3, 1, -1, 2, 3000},
      {"kill ranks 1 and 2 at once (both holders of block 1): a clear error", 2,
       {KILL(1, 2, TD_FT_BEFORE), KILL(2, 2, TD_FT_BEFORE)}, 2, 0, 0, 0, 0, 0, 0, true},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

/* Stage 3: the parameters sharded too, each block's master values on its two holders. The same
 * bits as stage 2's failure-free run (the first case of test_ft_zero_matrix when it runs first;
 * else this test's own first case), after a kill before the reduction, in the middle of a
 * forward (after the victim's first gather of a unit: the survivors' gathers fail; also a
 * stopped member there, seen at the group's timeout), after the
 * reduction, after the vote (the survivors commit without noticing: the next step finds it),
 * a closed member that voted and did not step (rolled forward), and two kills in a row (the
 * second makes a block's copy made after the first its owner: the units gather from it). */
static void test_ft_zero3_matrix(void **state) {
  (void)state;
  zcase cases[] = {
      {"no failure", 3, {{0}}, 0, 0, 4, 0, 0, 0},
      {"kill rank 2 before the reduction of step 2", 3, {KILL(2, 2, TD_FT_BEFORE)}, 1, 1, 3, 1,
       1, 2},
      {"kill rank 1 after its first unit gather of step 3 (mid-forward)", 3,
       {KILL(1, 3, TD_FT_UNIT_GATHER)}, 1, 1, 3, 1, 1, 2},
      {"kill rank 3 after the reduction of step 1", 3, {KILL(3, 1, TD_FT_AFTER)}, 1, 1, 3, 1, 1,
       2},
      {"kill rank 2 after the vote of step 2", 3, {KILL(2, 2, TD_FT_AFTER_VOTE)}, 1, 1, 3, 1, -1,
       2},
      {"close rank 0 after the vote of step 4 (voted, not stepped: rolled forward)", 3,
       {CLOSE(0, 4, TD_FT_AFTER_VOTE)}, 1, 1, 4, 0, 0, 0},
      {"kill rank 3 before step 1, then rank 2 mid-forward in step 3 (block 2's masters from "
       "the copy made at step 1)", 3, {KILL(3, 1, TD_FT_BEFORE), KILL(2, 3, TD_FT_UNIT_GATHER)},
       2, 2, 2, 2, 2, -1},
      {"stop rank 2 mid-forward in step 2 (seen at the group's timeout)", 3,
       {{2, 2, TD_FT_UNIT_GATHER, TD_FT_STOP}}, 1, 1, 3, 1, 1, 2, 3000},
      {"kill rank 1 mid-forward in step 2, then rank 3 in the recovery", 3,
       {KILL(1, 2, TD_FT_UNIT_GATHER), KILL(3, 2, TD_FT_RECOVERY)}, 2, 2, 2, 2, 2, -1},
      {"one unit: kill rank 2 during the commit's gather of the other parameters of step 2", 3,
       {KILL(2, 2, TD_FT_DURING_GATHER)}, 1, 1, 3, 1, -1, 2, 0, false, 1},
      {"one unit: close rank 1 after the vote of step 3 (rolled forward)", 3,
       {CLOSE(1, 3, TD_FT_AFTER_VOTE)}, 1, 1, 4, 0, 0, 0, 0, false, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

/* ---- stage 3: what a shard pass must do, options ---- */

/* A shard function with a forward and no backward: 2 of the pass's 4 gathers. */
static td_status forward_only_fn(void *user, int64_t step, int s, int n_shards) {
  (void)step, (void)s, (void)n_shards;
  int64_t xs[2] = {FT_SHARD_ROWS, 6};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 5, false), *out = NULL;
  td_status st = td_module_forward(user, x, &out);
  td_tensor_unref(x);
  td_tensor_unref(out);
  return st;
}

static int contract_worker(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 20000, &pg));
  td_module *m = ft_build();
  groups g;
  groups_make(m, &g, 1e-2);
  td_module *units[2] = {td_module_child_at(m, 0, NULL), td_module_child_at(m, 2, NULL)};
  td_ft_zero_options zo;
  td_ft_zero_options_init(&zo);
  td_ft_zero *z = NULL;
  zo.stage = 3; /* without units */
  MP_CHECK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z) == TD_ERR_INVALID && !z);
  zo.stage = 2, zo.units = units, zo.n_units = 2; /* units at stage 2 */
  MP_CHECK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z) == TD_ERR_INVALID && !z);
  zo.stage = 3;
  MP_CHECK_OK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z));
  /* a forward outside a step while the units are free: a clear error, no gather */
  int64_t xs[2] = {FT_SHARD_ROWS, 6};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 5, false), *out = NULL;
  MP_CHECK(td_module_forward(m, x, &out) == TD_ERR_STATE &&
           strstr(td_last_error(), "outside a step"));
  /* a pass without its backward: every member fails the step, alike, without a hang */
  MP_CHECK(td_ft_zero_step(z, 0, forward_only_fn, m, NULL) == TD_ERR_INVALID);
  MP_CHECK(strstr(td_last_error(), "ran 2 unit gathers, not 4"));
  /* the step was not committed: it runs again, properly */
  MP_CHECK_OK(td_ft_zero_step(z, 0, shard_fn, m, NULL));
  MP_CHECK_OK(td_ft_zero_sync(z, NULL));
  MP_CHECK_OK(td_module_forward(m, x, &out)); /* after the sync: whole, on this member alone */
  td_tensor_unref(out);
  td_tensor_unref(x);
  td_ft_zero_destroy(z);
  td_tensor_list_fini(&g.ps);
  td_module_unref(m);
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_ft_zero3_contract(void **state) {
  (void)state;
  int codes[2];
  assert_int_equal(td_mp_run(2, contract_worker, NULL, 60, codes), 0);
}

/* ---- td_ft_zero and td_ft_ddp: the same numbers (no clipping) ---- */

static int same_worker(int rank, int world, const char *method, void *arg) {
  const char *dir = arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 20000, &pg));
  for (int run = 0; run < 2; run++) {
    td_module *m = ft_build();
    groups g;
    groups_make(m, &g, 1e-2);
    td_ft_zero *z = NULL;
    td_ft_ddp *d = NULL;
    td_optim *opt = NULL;
    if (run == 0) {
      MP_CHECK_OK(td_ft_zero_create(pg, &g.oo, g.g, 2, NULL, &z));
    } else {
      MP_CHECK_OK(td_optim_create_groups(&g.oo, g.g, 2, &opt));
      MP_CHECK_OK(td_ft_ddp_create(pg, opt, NULL, &d));
    }
    for (int64_t step = 0; step < STEPS; step++)
      MP_CHECK_OK(z ? td_ft_zero_step(z, step, shard_fn, m, NULL)
                    : td_ft_ddp_step(d, step, shard_fn, m, NULL));
    write_params(dir, run ? "ddp" : "zero", rank, &g.ps);
    td_ft_zero_destroy(z);
    td_ft_ddp_destroy(d);
    td_optim_destroy(opt);
    td_tensor_list_fini(&g.ps);
    td_module_unref(m);
  }
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_ft_zero_equals_ft_ddp(void **state) {
  (void)state;
  char dir[64];
  snprintf(dir, sizeof dir, "/tmp/td_ft_zero_same_XXXXXX");
  assert_non_null(mkdtemp(dir));
  int codes[WORLD];
  assert_int_equal(td_mp_run(WORLD, same_worker, dir, 60, codes), 0);
  static char a[4096], b[4096];
  for (int r = 0; r < WORLD; r++) {
    size_t na = ft_read_file(dir, "zero", r, a, sizeof a);
    size_t nb = ft_read_file(dir, "ddp", r, b, sizeof b);
    assert_true(na > 0);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
  }
  ft_remove_dir(dir);
}

/* ---- arguments ---- */

/* ---- loss scaling (td_ft_zero_options.scaler, td_ft_ddp_options.scaler) ---- */

typedef struct scale_ctx {
  td_module *m;
  td_grad_scaler *sc; /* NULL: no scaling */
  int64_t inf_step;   /* shard 1 of this step overflows (its loss times inf); -1: none */
} scale_ctx;

static td_status scaled_shard_fn(void *user, int64_t step, int s, int n_shards) {
  (void)n_shards;
  scale_ctx *x = user;
  double f = x->sc ? td_grad_scaler_get_scale(x->sc) : 1.0; /* a power of two: exact */
  if (step == x->inf_step && s == 1) f = INFINITY;
  return ft_shard_backward(x->m, step, s, 3.0 * f);
}

/* Runs: 0 td_ft_zero without a scaler; 1 / 2 td_ft_zero / td_ft_ddp with a dynamic scaler
 * (2^10, growth every 2 good steps), no overflow; 3 / 4 the same with shard 1 of step 2
 * overflowing. Each run's parameters and scaler figures go to files. */
static int scale_worker(int rank, int world, const char *method, void *arg) {
  const char *dir = arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 20000, &pg));
  for (int run = 0; run < 5; run++) {
    td_module *m = ft_build();
    groups g;
    groups_make(m, &g, 1e-2);
    td_grad_scaler_options so;
    td_grad_scaler_options_init(&so);
    so.init_scale = 1024, so.growth_interval = 2;
    scale_ctx x = {m, NULL, run >= 3 ? 2 : -1};
    if (run) MP_CHECK_OK(td_grad_scaler_create(&so, &x.sc));
    td_ft_zero *z = NULL;
    td_ft_ddp *d = NULL;
    td_optim *opt = NULL;
    if (run == 0 || run % 2 == 1) {
      td_ft_zero_options zo;
      td_ft_zero_options_init(&zo);
      zo.scaler = x.sc;
      MP_CHECK_OK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z));
    } else {
      td_ft_ddp_options fo;
      td_ft_ddp_options_init(&fo);
      fo.scaler = x.sc;
      MP_CHECK_OK(td_optim_create_groups(&g.oo, g.g, 2, &opt));
      MP_CHECK_OK(td_ft_ddp_create(pg, opt, &fo, &d));
    }
    for (int64_t step = 0; step < STEPS; step++)
      MP_CHECK_OK(z ? td_ft_zero_step(z, step, scaled_shard_fn, &x, NULL)
                    : td_ft_ddp_step(d, step, scaled_shard_fn, &x, NULL));
    char what[16], rep[64];
    snprintf(what, sizeof what, "run%d", run);
    write_params(dir, what, rank, &g.ps);
    td_grad_scaler_stats st = {0};
    if (x.sc) MP_CHECK_OK(td_grad_scaler_get_stats(x.sc, &st));
    int k = snprintf(rep, sizeof rep, "%llu %.1f\n", (unsigned long long)st.skipped_steps,
                     x.sc ? td_grad_scaler_get_scale(x.sc) : 0.0);
    snprintf(what, sizeof what, "scale%d", run);
    ft_write_file(dir, what, rank, rep, (size_t)k, "w");
    td_ft_zero_destroy(z);
    td_ft_ddp_destroy(d);
    td_optim_destroy(opt);
    td_grad_scaler_destroy(x.sc);
    td_tensor_list_fini(&g.ps);
    td_module_unref(m);
  }
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

/* Loss scaling: without an overflow the scaled runs train the unscaled run's parameters bit for
 * bit (the step unscales by a power of two); with one, every member of both td_ft_zero and
 * td_ft_ddp skips that step alone (the same parameters everywhere and in both, one skip, the
 * scale backed off and grown by the rule: 2^10 -> 2^11 after steps 0-1, 2^10 at step 2, 2^11
 * after steps 3-4). The faults around it (a skipped step healed, rolled forward, a kill) are
 * test_example_gpt_ft_scale_*'s. */
static void test_ft_scaler(void **state) {
  (void)state;
  char dir[64];
  snprintf(dir, sizeof dir, "/tmp/td_ft_scale_XXXXXX");
  assert_non_null(mkdtemp(dir));
  int codes[WORLD];
  assert_int_equal(td_mp_run(WORLD, scale_worker, dir, 60, codes), 0);
  static char p0[4096], p[4096], inf0[4096];
  size_t n0 = ft_read_file(dir, "run0", 0, p0, sizeof p0);
  size_t ni = ft_read_file(dir, "run3", 0, inf0, sizeof inf0);
  assert_true(n0 > 0);
  assert_int_equal(ni, n0);
  assert_memory_not_equal(inf0, p0, n0); /* the skip changed the training */
  for (int r = 0; r < WORLD; r++) {
    for (int run = 0; run < 5; run++) {
      char what[16], rep[64];
      snprintf(what, sizeof what, "run%d", run);
      size_t n = ft_read_file(dir, what, r, p, sizeof p);
      assert_int_equal(n, n0);
      assert_memory_equal(p, run >= 3 ? inf0 : p0, n0);
      snprintf(what, sizeof what, "scale%d", run);
      n = ft_read_file(dir, what, r, rep, sizeof rep - 1);
      rep[n] = 0;
      assert_string_equal(rep, run == 0 ? "0 0.0\n" : run <= 2 ? "0 8192.0\n" : "1 2048.0\n");
    }
  }
  ft_remove_dir(dir);
}

static void test_ft_zero_inject_parse_gather_points(void **state) {
  (void)state;
  int rank = -1;
  int64_t step = -1;
  td_ft_when when = TD_FT_BEFORE;
  td_ft_what what = TD_FT_KILL;
  assert_int_equal(td_ft_inject_parse("1:4:during_gather:kill", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(when, TD_FT_DURING_GATHER);
  assert_int_equal(td_ft_inject_parse("2:0:before_gather:close", &rank, &step, &when, &what),
                   TD_OK);
  assert_int_equal(when, TD_FT_BEFORE_GATHER);
  assert_int_equal(what, TD_FT_CLOSE);
  assert_int_equal(td_ft_inject_parse("3:1:after_gather:stop", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(when, TD_FT_AFTER_GATHER);
  assert_int_equal(td_ft_inject_parse("3:2:after_vote:close", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(when, TD_FT_AFTER_VOTE);
  assert_int_equal(td_ft_inject_parse("3:3:unit_gather:kill", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(when, TD_FT_UNIT_GATHER);
  assert_int_equal(td_ft_inject_parse("3:1:gather:stop", &rank, &step, &when, &what),
                   TD_ERR_INVALID);
  assert_int_equal(td_ft_inject_parse("3:1:after-gather:stop", &rank, &step, &when, &what),
                   TD_ERR_INVALID);
  assert_int_equal(rank, 3);
}

/* ---- spares: ranks 4 and 5 wait outside the group of ranks 0-3 and replace the lost ---- */

#define SPARE_WORLD FT_SPARE_WORLD
#define SPARE_MEMBERS FT_SPARE_MEMBERS

typedef struct spare_case {
  const char *name;
  int stage;
  fault f[2];
  int nf;
  int joined[2];       /* whether spare 4, spare 5 is admitted */
  uint64_t generation; /* the survivors' last generation */
  int lost;            /* members lost, as every original survivor counts them */
  int dies_joining;    /* a spare that SIGKILLs itself once admitted, before it is healed (its
                          rank; 0: none) */
  char dir[256];
  bool scaled;         /* loss scaling (2^10, growth every 2 good steps): a spare takes the
                          scaler's state too (the same parameters: the scaling is exact) */
  int n_units;         /* stage 3: 2 (0), both linear layers; 1: the first, the second's
                          parameters whole between steps */
} spare_case;

static int spare_worker(int rank, int world, const char *method, void *arg) {
  spare_case *c = arg;
  ft_record_start(c->dir, rank);
  td_rpc_agent *a = coll_join(rank, world, method);
  const int members[SPARE_MEMBERS] = {0, 1, 2, 3};
  bool spare = rank >= SPARE_MEMBERS, members_lost = false;
  td_process_group *pg = NULL;
  if (spare) {
    MP_CHECK_OK(td_process_group_spare(a, members, SPARE_MEMBERS, TD_PG_BACKEND_CPU, 20000,
                                       TD_TIMEOUT_INFINITE, &pg, &members_lost));
    if (!pg) { /* released: not needed */
      char rep[64];
      int k = snprintf(rep, sizeof rep, "released %d %d\n", members_lost, (int)getpid());
      ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
      td_status st = td_rpc_shutdown(a, !members_lost, 30000);
      MP_CHECK(members_lost || st == TD_OK);
      td_rpc_destroy(a);
      CHECK_NO_LEAKS();
      return 0;
    }
    MP_CHECK(td_process_group_joined(pg));
    if (rank == c->dies_joining) { /* the survivors are waiting to heal it */
      fflush(NULL);
      raise(SIGKILL);
    }
  } else {
    MP_CHECK_OK(td_process_group_create(a, members, SPARE_MEMBERS, TD_PG_BACKEND_CPU, 20000,
                                        &pg));
    int waiting = 0; /* both spares stand by before the first step: admission is by rank */
    for (int t = 0; waiting < 2 && t < 3000; t++) {
      MP_CHECK_OK(td_process_group_spares_waiting(pg, &waiting));
      if (waiting < 2) td_test_sleep_ms(10);
    }
    MP_CHECK(waiting == 2);
  }
  td_module *m = ft_build();
  groups g;
  groups_make(m, &g, 1e-2);
  td_ft_zero_options zo;
  td_ft_zero_options_init(&zo);
  zo.stage = c->stage;
  zo.bucket_bytes = 64 * sizeof(double);
  zo.max_grad_norm = 0.5;
  zo.reform_timeout = 20000;
  if (spare) zo.n_shards = zo.n_blocks = 7; /* ignored: a spare takes the group's */
  td_module *units[2] = {td_module_child_at(m, 0, NULL), td_module_child_at(m, 2, NULL)};
  if (c->stage == 3) zo.units = units, zo.n_units = c->n_units ? (size_t)c->n_units : 2;
  scale_ctx x = {m, NULL, -1};
  if (c->scaled) {
    td_grad_scaler_options so;
    td_grad_scaler_options_init(&so);
    so.init_scale = 1024, so.growth_interval = 2;
    MP_CHECK_OK(td_grad_scaler_create(&so, &x.sc));
    zo.scaler = x.sc;
  }
  td_ft_zero *z = NULL;
  MP_CHECK_OK(td_ft_zero_create(pg, &g.oo, g.g, 2, &zo, &z));
  for (int i = 0; i < c->nf; i++)
    MP_CHECK_OK(td_ft_zero_inject(z, c->f[i].rank, c->f[i].step, c->f[i].when, c->f[i].what));
  td_ft_zero_stats zs;
  MP_CHECK_OK(td_ft_zero_get_stats(z, &zs));
  int64_t first = td_ft_zero_next_step(z);
  MP_CHECK(spare ? first > 0 : first == 0); /* a spare starts after the step it was healed to */
  /* healed: the layout of the group (4 blocks), the lost member's roles in it (it owned one block
   * and backed one: both copied here from their other holder), the parameters */
  MP_CHECK(zs.n_blocks == SPARE_MEMBERS && zs.heals == spare);
  MP_CHECK(!spare || (zs.owned == 1 && zs.backed == 1 && zs.heal_bytes > 0 && zs.heal_s > 0));
  int lost = 0, joined = 0;
  for (int64_t step = first; step < STEPS; step++) {
    MP_CHECK_OK(td_ft_zero_set_lr(z, 1e-2 * (1.0 - 0.1 * (double)step)));
    td_ft_step_info info;
    MP_CHECK_OK(c->scaled ? td_ft_zero_step(z, step, scaled_shard_fn, &x, &info)
                          : td_ft_zero_step(z, step, shard_fn, m, &info));
    if (info.failures) fprintf(stderr, "[rank %d] %s\n", rank, info.message);
    lost += info.lost;
    joined += info.joined;
  }
  td_ft_step_info sync;
  MP_CHECK_OK(td_ft_zero_sync(z, &sync));
  lost += sync.lost;
  joined += sync.joined;
  td_process_group *cur = td_ft_zero_group(z);
  if (td_process_group_rank(cur) == 0) MP_CHECK_OK(td_process_group_release_spares(cur));
  /* grown after steps 1, 3 and 5 on every member, the spare too */
  MP_CHECK(!c->scaled || td_grad_scaler_get_scale(x.sc) == 8192.0);
  MP_CHECK_OK(td_ft_zero_get_stats(z, &zs));
  char rep[256];
  int k = snprintf(rep, sizeof rep, "%s %llu %d %d %d %lld %d %d %d\n",
                   spare ? "joined" : "member",
                   (unsigned long long)td_process_group_generation(cur),
                   td_process_group_size(cur), lost, joined, (long long)first, zs.owned,
                   zs.backed, (int)getpid());
  ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
  write_params(c->dir, "params", rank, &g.ps);
  td_ft_zero_destroy(z);
  td_grad_scaler_destroy(x.sc);
  td_process_group_destroy(pg);
  td_tensor_list_fini(&g.ps);
  td_module_unref(m);
  td_rpc_shutdown(a, false, 5000); /* a spare was needed: someone was lost */
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void run_spare_case(spare_case *c) {
  int codes[SPARE_WORLD];
  char label[400];
  snprintf(label, sizeof label, "spare case stage %d, %s", c->stage, c->name);
  int bad = ft_run_workers(c->dir, sizeof c->dir, "/tmp/td_ftz_spare_XXXXXX", SPARE_WORLD,
                           spare_worker, c, codes, label);
  int killed = 0, owned = 0, backed = 0;
  ft_spare_want w = {c->f, c->nf, c->joined, c->generation, c->lost, c->dies_joining};
  for (int r = 0; r < SPARE_WORLD; r++) {
    char rep[256], role[16] = "";
    int pid0 = 0;
    if (!ft_spare_trained(c->dir, r, &w, codes, &killed, rep, sizeof rep, &pid0)) continue;
    unsigned long long gen = 0;
    int members = 0, lost = 0, joined = 0, own = 0, bak = 0, pid1 = 0;
    long long first = -1;
    assert_int_equal(sscanf(rep, "%15s %llu %d %d %d %lld %d %d %d", role, &gen, &members, &lost,
                            &joined, &first, &own, &bak, &pid1), 9);
    /* the layout a failure-free group has: the spare took a lost member's blocks */
    assert_int_equal(own, 1);
    assert_int_equal(bak, 1);
    owned += own, backed += bak;
    ft_spare_check(c->dir, r, &w, role, gen, members, lost, joined, pid0, pid1, baseline,
                   baseline_n);
  }
  assert_int_equal(bad, killed);
  assert_int_equal(owned, SPARE_MEMBERS); /* every block held twice again */
  assert_int_equal(backed, SPARE_MEMBERS);
  ft_remove_dir(c->dir);
}

/* Spares healed into the group: a spare admitted in place of a lost member learns the layout,
 * takes copies of the blocks the loss left with one holder (their optimizer state from the
 * surviving holder) and the parameters of the last committed step, and trains from the next:
 * the parameters of every member after the run (spares included) equal the failure-free run's
 * of 4 bitwise, and every block has two holders again. Also two kills with two spares, a spare
 * lost once it joined (the other replaces it), a spare lost before it is healed, a member lost
 * while a spare joins (it re-forms with the survivors and joins the next generation), and loss
 * scaling (the spare's scaler state, in a redone step and in one rolled forward), and stage 3
 * (the spare takes the lost member's blocks with their master values). */
static void test_ft_zero_spares(void **state) {
  (void)state;
  if (!baseline_n) { /* run alone: the failure-free run of 4 first */
    zcase plain = {"no failure", 2, {{0}}, 0, 0, 4, 0, 0, 0};
    run_case(&plain);
  }
  spare_case cases[] = {
      {"kill rank 2 before step 2: spare 4 replaces it, spare 5 is released", 2,
       {KILL(2, 2, TD_FT_BEFORE)}, 1, {1, 0}, 1, 1, 0, ""},
      {"kill ranks 1 and 3 after the reduction of step 3: both spares join", 1,
       {KILL(1, 3, TD_FT_AFTER), KILL(3, 3, TD_FT_AFTER)}, 2, {1, 1}, 1, 2, 0, ""},
      {"kill rank 3 during the all-gather of step 1, then the spare that replaced it before "
       "step 4", 2, {KILL(3, 1, TD_FT_DURING_GATHER), KILL(4, 4, TD_FT_BEFORE)}, 2, {1, 1}, 2, 2,
       0, ""},
      {"kill rank 1 before step 3; spare 4 dies before it is healed, spare 5 takes its place", 2,
       {KILL(1, 3, TD_FT_BEFORE)}, 1, {1, 1}, 2, 2, 4, ""},
      {"kill rank 3 before step 2, then rank 1 in that recovery: spare 4 re-forms with the "
       "survivors while joining, both spares join", 2,
       {KILL(3, 2, TD_FT_BEFORE), KILL(1, 2, TD_FT_RECOVERY)}, 2, {1, 1}, 2, 2, 0, ""},
      {"loss scaling: kill rank 2 before step 3 (redone: the spare takes the scaler's state of "
       "step 2)", 2, {KILL(2, 3, TD_FT_BEFORE)}, 1, {1, 0}, 1, 1, 0, "", true},
      {"loss scaling: kill rank 1 during the all-gather of step 2 (rolled forward: the spare "
       "ends step 2's scaler iteration itself)", 1, {KILL(1, 2, TD_FT_DURING_GATHER)}, 1,
       {1, 0}, 1, 1, 0, "", true},
      {"one unit: kill rank 2 mid-forward in step 2 (redone: the spare takes the masters "
       "of the lost member's blocks and the parameters outside the unit)", 3,
       {KILL(2, 2, TD_FT_UNIT_GATHER)}, 1, {1, 0}, 1, 1, 0, "", false, 1},
      {"kill rank 1 after the vote of step 3", 3, {KILL(1, 3, TD_FT_AFTER_VOTE)}, 1,
       {1, 0}, 1, 1, 0, ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_spare_case(&cases[i]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ft_zero_inject_parse_gather_points),
      cmocka_unit_test(test_ft_zero_equals_ft_ddp),
      cmocka_unit_test(test_ft_scaler),
      cmocka_unit_test(test_ft_zero_matrix),
      cmocka_unit_test(test_ft_zero_spares),
      cmocka_unit_test(test_ft_zero3_matrix),
      cmocka_unit_test(test_ft_zero3_contract),
  };
  if (getenv("TD_FT_ZERO_TEST_FILTER")) cmocka_set_test_filter(getenv("TD_FT_ZERO_TEST_FILTER"));
  return cmocka_run_group_tests(tests, NULL, NULL);
}
