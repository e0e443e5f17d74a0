/* test_ft_ddp.c - fault-tolerant data parallelism (td_ft_ddp) under injected faults, 4 real
 * processes: a SIGKILL or a closed connection at a chosen rank and step, before, during (after
 * the first of several buckets) or after the gradient reduction, and two kills in one run.
 * Every run must finish, every survivor exits 0 as the process that started (its pid at the end
 * is the one it had at the start, and it started once), and the float64 parameters of every
 * survivor after 6 AdamW steps equal the failure-free run's bit for bit; a second kill while the
 * survivors recover from the first ends the same way. The failure-free run
 * takes the ordered reduction's identity path (one all_reduce per bucket on shared memory);
 * after a kill the survivors hold 4 shards among 3 and take the gather path, so equality also
 * shows that the two paths fold alike. Each survivor's report (generation, members, lost,
 * moved shards, healed) is checked against what the fault must cause.
 *
 * The coordinator (rank 0, the store's host) killed: the survivors' step fails naming it, soon,
 * and they end by themselves (the limit of the scheme, stated in collectives.h).
 * Also: td_process_group_reform refuses a member that calls it after the new generation was
 * formed (stale), a member of the new generation cannot be reached by the old group, and the
 * lost-member notice names a killed member without any collective in flight.
 *
 * TD_COLL_ALGO=ring (test_ft_ddp_ring) runs it all on the TCP ring, where every step takes the
 * gather path, a closed connection makes the neighbours note the member lost, and a member's
 * death is seen through the pid of its same-host record.
 */
#include <signal.h>
#include <sys/stat.h>

#include "ft_test_util.h"

#define WORLD 4
#define STEPS 6

typedef struct ft_case {
  const char *name;
  fault f[2];
  int nf;
  /* what the survivors must report at the end */
  uint64_t generation;
  int members;
  int lost;  /* members lost in the run */
  int moved; /* shards moved to survivors in the run */
  int healed_rank; /* the member that closes after the reduction: healed when anyone committed;
                      -1: nobody is healed */
  char dir[256];
  bool ordered; /* without the module: every step on the ordered reduction, no fast path */
  int n_shards; /* 0: one per member; 8: two per member, every step on the gather path (their
                   own baseline: another cut of the batch is another sum) */
  int64_t timeout_ms; /* the group's timeout (0: 20 s); a stopped member is seen only there */
} ft_case;

/* Shard s of step k (ft_test_util.h). */
static td_status shard_fn(void *user, int64_t step, int s, int n_shards) {
  (void)n_shards;
  return ft_shard_backward(user, step, s, 1.0);
}

/* One replica: its agent, the world's group, the model, the optimizer and the td_ft_ddp. */
typedef struct replica {
  td_rpc_agent *a;
  td_process_group *pg;
  td_module *m;
  td_tensor_list ps;
  td_optim *opt;
  td_ft_ddp *ft;
} replica;

/* overlap: give td_ft_ddp the module (the overlapped fast path while nothing failed). */
/* The model, its parameters and the optimizer of a replica whose agent and group exist. */
static void replica_model(replica *x, td_optim_kind kind, double lr) {
  x->m = ft_build();
  td_tensor_list_init(&x->ps);
  MP_CHECK_OK(td_module_parameters(x->m, &x->ps));
  td_optim_options oo;
  td_optim_options_init(&oo, kind);
  oo.lr = lr;
  MP_CHECK_OK(td_optim_create(&oo, x->ps.tensors, x->ps.n, &x->opt));
}

static void replica_start(replica *x, int rank, int world, const char *method, td_optim_kind kind,
                          double lr, const td_ft_ddp_options *opts, bool overlap,
                          int64_t timeout_ms) {
  x->a = coll_join(rank, world, method);
  MP_CHECK_OK(td_process_group_create(x->a, NULL, 0, TD_PG_BACKEND_CPU,
                                      timeout_ms ? timeout_ms : 20000, &x->pg));
  replica_model(x, kind, lr);
  td_ft_ddp_options fo = *opts;
  if (overlap) fo.module = x->m;
  MP_CHECK_OK(td_ft_ddp_create(x->pg, x->opt, &fo, &x->ft));
}

static void replica_end(replica *x, bool graceful) {
  td_ft_ddp_destroy(x->ft);
  td_process_group_destroy(x->pg);
  td_optim_destroy(x->opt);
  td_tensor_list_fini(&x->ps);
  td_module_unref(x->m);
  td_status st = td_rpc_shutdown(x->a, graceful, 30000);
  MP_CHECK(!graceful || st == TD_OK);
  td_rpc_destroy(x->a);
  CHECK_NO_LEAKS();
}

static int worker(int rank, int world, const char *method, void *arg) {
  ft_case *c = arg;
  ft_record_start(c->dir, rank);
  td_ft_ddp_options fo;
  td_ft_ddp_options_init(&fo);
  fo.bucket_bytes = 64 * sizeof(double); /* 163 parameters: 3 buckets, so DURING is mid-way */
  fo.max_grad_norm = 1.0;
  fo.reform_timeout = 20000;
  fo.n_shards = c->n_shards;
  replica x;
  /* scaled: it must expire for the stopped member and never for a slow live one */
  int64_t tmo = c->timeout_ms ? td_test_ms(c->timeout_ms) : 0;
  if (tmo) fo.reform_timeout = 2 * tmo;
  replica_start(&x, rank, world, method, TD_OPTIM_ADAMW, 1e-2, &fo, !c->ordered, tmo);
  td_ft_ddp *ft = x.ft;
  td_tensor_list ps = x.ps;
  for (int i = 0; i < c->nf; i++)
    MP_CHECK_OK(td_ft_ddp_inject(ft, c->f[i].rank, c->f[i].step, c->f[i].when, c->f[i].what));
  int lost = 0, moved = 0, healed = 0;
  for (int64_t step = 0; step < STEPS; step++) {
    td_ft_step_info info;
    MP_CHECK_OK(td_ft_ddp_step(ft, step, shard_fn, x.m, &info));
    MP_CHECK(info.step == step);
    if (info.failures) fprintf(stderr, "[rank %d] %s\n", rank, info.message);
    lost += info.lost;
    moved += info.shards_recomputed;
    healed += info.healed;
  }
  td_ft_step_info sync;
  MP_CHECK_OK(td_ft_ddp_sync(ft, &sync));
  lost += sync.lost;
  healed += sync.healed;
  MP_CHECK(sync.step == STEPS - 1);
  td_process_group *cur = td_ft_ddp_group(ft);
  char rep[256];
  int k = snprintf(rep, sizeof rep, "%llu %d %d %d %d %d\n",
               (unsigned long long)td_process_group_generation(cur),
               td_process_group_size(cur), lost, moved, healed, (int)getpid());
  ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
  for (size_t i = 0; i < ps.n; i++)
    ft_write_file(c->dir, "params", rank, td_tensor_data(ps.tensors[i]),
               td_tensor_nbytes(ps.tensors[i]), i ? "a" : "w");
  /* a stopped member was left out, and lives on stopped: the lowest survivor ends it (the test
   * started it: its pid is in its start file) */
  for (int i = 0; i < c->nf && td_process_group_global_rank(cur, 0) == rank; i++) {
    if (c->f[i].what != TD_FT_STOP) continue;
    char pid[32];
    char path[400];
    snprintf(path, sizeof path, "%s/start.%d", c->dir, c->f[i].rank);
    FILE *f = fopen(path, "r");
    MP_CHECK(f && fgets(pid, sizeof pid, f));
    fclose(f);
    MP_CHECK(atoi(pid) > 0 && kill(atoi(pid), SIGKILL) == 0);
  }
  /* with a member gone the graceful shutdown's barrier cannot complete */
  replica_end(&x, td_process_group_size(cur) == world);
  return 0;
}

static char baseline[2][4096]; /* the first run's parameters: one shard per member, two */
static size_t baseline_n[2];

static void run_case(ft_case *c) {
  int codes[WORLD];
  char label[400];
  snprintf(label, sizeof label, "case %s", c->name);
  int bad = ft_run_workers(c->dir, sizeof c->dir, "/tmp/td_ft_ddp_XXXXXX", WORLD, worker, c,
                           codes, label);
  int killed = 0, healed_sum = 0, closer_healed = 0;
  for (int r = 0; r < WORLD; r++) {
    if (ft_victim(c->f, c->nf, r)) {
      assert_int_equal(codes[r], 128 + SIGKILL);
      killed++;
      continue;
    }
    assert_int_equal(codes[r], 0); /* every survivor finished by itself */
    char buf[4096], rep[256];
    int pid0 = ft_started_once(c->dir, r);
    size_t n = ft_read_file(c->dir, "report", r, rep, sizeof rep - 1);
    rep[n] = 0;
    unsigned long long gen = 0;
    int members = 0, lost = 0, moved = 0, healed = 0, pid1 = 0;
    assert_int_equal(sscanf(rep, "%llu %d %d %d %d %d", &gen, &members, &lost, &moved, &healed,
                            &pid1), 6);
    assert_int_equal(pid1, pid0); /* the process that started is the one that finished */
    assert_int_equal(gen, c->generation);
    assert_int_equal(members, c->members);
    assert_int_equal(lost, c->lost);
    assert_int_equal(moved, c->moved);
    /* a close after the reduction: the closing member did not commit; the others did unless the
     * close reached them before they left the all_reduce (shared memory fails a wait on a group
     * marked failed), so any may have been healed, at most once, and the closing member was
     * whenever anyone committed (its parameters equal the others', checked below) */
    if (c->healed_rank < 0) assert_int_equal(healed, 0);
    else assert_true(healed == 0 || healed == 1);
    healed_sum += healed;
    if (r == c->healed_rank) closer_healed = healed;
    n = ft_read_file(c->dir, "params", r, buf, sizeof buf);
    assert_true(n > 0);
    int b = c->n_shards ? 1 : 0;
    if (!baseline_n[b]) {
      memcpy(baseline[b], buf, n);
      baseline_n[b] = n;
    }
    assert_int_equal(n, baseline_n[b]);
    assert_memory_equal(buf, baseline[b], n); /* bitwise the failure-free run */
  }
  assert_int_equal(bad, killed);
  /* whoever was healed, the closing member was among them (it alone surely did not commit) */
  if (c->healed_rank >= 0 && healed_sum > 0) assert_int_equal(closer_healed, 1);
  ft_remove_dir(c->dir);
}


static void test_ft_ddp_matrix(void **state) {
  (void)state;
  ft_case cases[] = {
      {"no failure", {{0}}, 0, 0, 4, 0, 0, -1, ""},
      {"no failure, ordered path (no module)", {{0}}, 0, 0, 4, 0, 0, -1, "", true},
      {"kill rank 2 before the reduction of step 2", {KILL(2, 2, TD_FT_BEFORE)}, 1, 1, 3, 1, 1, -1,
       ""},
      {"kill rank 1 during the reduction of step 3", {KILL(1, 3, TD_FT_DURING)}, 1, 1, 3, 1, 1, -1,
       ""},
      {"kill rank 3 after the reduction of step 1", {KILL(3, 1, TD_FT_AFTER)}, 1, 1, 3, 1, 1, -1,
       ""},
      {"close rank 2 before the reduction of step 2", {CLOSE(2, 2, TD_FT_BEFORE)}, 1, 1, 4, 0, 0,
       -1, ""},
      {"close rank 0 during the reduction of step 4", {CLOSE(0, 4, TD_FT_DURING)}, 1, 1, 4, 0, 0,
       -1, ""},
      {"close rank 1 after the reduction of step 2", {CLOSE(1, 2, TD_FT_AFTER)}, 1, 1, 4, 0, 0, 1,
       ""},
      {"kill rank 3 before step 1, then rank 1 during step 3",
       {KILL(3, 1, TD_FT_BEFORE), KILL(1, 3, TD_FT_DURING)}, 2, 2, 2, 2, 2, -1, ""},
      {"kill rank 2 before step 3, then rank 1 in the recovery",
       {KILL(2, 3, TD_FT_BEFORE), KILL(1, 3, TD_FT_RECOVERY)}, 2, 2, 2, 2, 2, -1, ""},
      {"stop rank 2 before step 2 (seen at the group's timeout, left out of generation 1)",
       {{2, 2, TD_FT_BEFORE, TD_FT_STOP}}, 1, 1, 3, 1, 1, -1, "", false, 0, 3000},
      {"kill ranks 1 and 2 at once, before step 2", {KILL(1, 2, TD_FT_BEFORE),
       KILL(2, 2, TD_FT_BEFORE)}, 2, 1, 2, 2, 2, -1, ""},
      {"8 shards, no failure", {{0}}, 0, 0, 4, 0, 0, -1, "", false, 8},
      {"8 shards, kill rank 1 during step 2 (its 2 shards to 2 survivors)",
       {KILL(1, 2, TD_FT_DURING)}, 1, 1, 3, 1, 2, -1, "", false, 8},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
}

/* ---- spares: ranks 4 and 5 wait outside the group of ranks 0-3 and replace the lost ---- */

#define SPARE_WORLD FT_SPARE_WORLD
#define SPARE_MEMBERS FT_SPARE_MEMBERS

typedef struct spare_case {
  const char *name;
  fault f[2];
  int nf;
  int joined[2];      /* whether spare 4, spare 5 is admitted */
  uint64_t generation; /* the survivors' last generation */
  int lost;           /* members lost, as every original survivor counts them */
  char dir[256];
  int dies_joining;   /* a spare that SIGKILLs itself once admitted, before it is healed (its
                         rank; 0: none) */
} spare_case;

static int spare_worker(int rank, int world, const char *method, void *arg) {
  spare_case *c = arg;
  ft_record_start(c->dir, rank);
  td_ft_ddp_options fo;
  td_ft_ddp_options_init(&fo);
  fo.bucket_bytes = 64 * sizeof(double);
  fo.max_grad_norm = 1.0;
  fo.reform_timeout = 20000;
  replica x = {0};
  x.a = coll_join(rank, world, method);
  const int members[SPARE_MEMBERS] = {0, 1, 2, 3};
  bool spare = rank >= SPARE_MEMBERS, members_lost = false;
  if (spare) {
    MP_CHECK_OK(td_process_group_spare(x.a, members, SPARE_MEMBERS, TD_PG_BACKEND_CPU, 20000,
                                       TD_TIMEOUT_INFINITE, &x.pg, &members_lost));
    if (!x.pg) { /* released: not needed */
      char rep[64];
      int k = snprintf(rep, sizeof rep, "released %d %d\n", members_lost, (int)getpid());
      ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
      td_status st = td_rpc_shutdown(x.a, !members_lost, 30000);
      MP_CHECK(members_lost || st == TD_OK);
      td_rpc_destroy(x.a);
      CHECK_NO_LEAKS();
      return 0;
    }
    MP_CHECK(td_process_group_joined(x.pg));
    if (rank == c->dies_joining) { /* the survivors are waiting to heal it */
      fflush(NULL);
      raise(SIGKILL);
    }
  } else {
    MP_CHECK_OK(td_process_group_create(x.a, members, SPARE_MEMBERS, TD_PG_BACKEND_CPU, 20000,
                                        &x.pg));
    MP_CHECK(!td_process_group_joined(x.pg));
    int waiting = 0; /* both spares stand by before the first step: admission is by rank */
    for (int t = 0; waiting < 2 && t < 3000; t++) {
      MP_CHECK_OK(td_process_group_spares_waiting(x.pg, &waiting));
      if (waiting < 2) td_test_sleep_ms(10);
    }
    MP_CHECK(waiting == 2);
  }
  replica_model(&x, TD_OPTIM_ADAMW, 1e-2);
  fo.module = x.m;
  MP_CHECK_OK(td_ft_ddp_create(x.pg, x.opt, &fo, &x.ft));
  for (int i = 0; i < c->nf; i++)
    MP_CHECK_OK(td_ft_ddp_inject(x.ft, c->f[i].rank, c->f[i].step, c->f[i].when, c->f[i].what));
  int64_t first = td_ft_ddp_next_step(x.ft);
  MP_CHECK(spare ? first > 0 : first == 0); /* a spare starts after the step it was healed to */
  int lost = 0, joined = 0;
  bool overlapped = false;
  for (int64_t step = first; step < STEPS; step++) {
    td_ft_step_info info;
    MP_CHECK_OK(td_ft_ddp_step(x.ft, step, shard_fn, x.m, &info));
    if (info.failures) fprintf(stderr, "[rank %d] %s\n", rank, info.message);
    lost += info.lost;
    joined += info.joined;
    overlapped = info.overlapped;
  }
  td_ft_step_info sync;
  MP_CHECK_OK(td_ft_ddp_sync(x.ft, &sync));
  lost += sync.lost;
  joined += sync.joined;
  td_process_group *cur = td_ft_ddp_group(x.ft);
  /* the lowest member (rank 0, the store's host) releases the spares not needed, and stays
   * until they have their answer */
  if (td_process_group_rank(cur) == 0) MP_CHECK_OK(td_process_group_release_spares(cur));
  char rep[256];
  int k = snprintf(rep, sizeof rep, "%s %llu %d %d %d %lld %d %d\n", spare ? "joined" : "member",
                   (unsigned long long)td_process_group_generation(cur),
                   td_process_group_size(cur), lost, joined, (long long)first, overlapped,
                   (int)getpid());
  ft_write_file(c->dir, "report", rank, rep, (size_t)k, "w");
  for (size_t i = 0; i < x.ps.n; i++)
    ft_write_file(c->dir, "params", rank, td_tensor_data(x.ps.tensors[i]),
                  td_tensor_nbytes(x.ps.tensors[i]), i ? "a" : "w");
  /* a spare was needed: someone was lost, so nobody can shut down gracefully */
  replica_end(&x, !spare && lost == 0);
  return 0;
}

static void run_spare_case(spare_case *c) {
  int codes[SPARE_WORLD];
  char label[400];
  snprintf(label, sizeof label, "spare case %s", c->name);
  int bad = ft_run_workers(c->dir, sizeof c->dir, "/tmp/td_ft_spare_XXXXXX", SPARE_WORLD,
                           spare_worker, c, codes, label);
  int killed = 0;
  ft_spare_want w = {c->f, c->nf, c->joined, c->generation, c->lost, c->dies_joining};
  for (int r = 0; r < SPARE_WORLD; r++) {
    char rep[256], role[16] = "";
    int pid0 = 0;
    if (!ft_spare_trained(c->dir, r, &w, codes, &killed, rep, sizeof rep, &pid0)) continue;
    unsigned long long gen = 0;
    int members = 0, lost = 0, joined = 0, overlapped = 0, pid1 = 0;
    long long first = -1;
    assert_int_equal(sscanf(rep, "%15s %llu %d %d %d %lld %d %d", role, &gen, &members, &lost,
                            &joined, &first, &overlapped, &pid1), 8);
    /* made whole, each member holds its own shard again: the last step overlaps the reduction
     * with backward as before the failure (on shared memory: the TCP ring has no fast path) */
    const char *algo = getenv("TD_COLL_ALGO");
    assert_int_equal(overlapped, !(algo && strcmp(algo, "ring") == 0));
    ft_spare_check(c->dir, r, &w, role, gen, members, lost, joined, pid0, pid1, baseline[0],
                   baseline_n[0]);
  }
  assert_int_equal(bad, killed);
  ft_remove_dir(c->dir);
}

static void test_ft_ddp_spares(void **state) {
  (void)state;
  if (!baseline_n[0]) { /* run alone: the failure-free run of 4 first */
    ft_case plain = {"no failure", {{0}}, 0, 0, 4, 0, 0, -1, ""};
    run_case(&plain);
  }
  spare_case cases[] = {
      {"kill rank 2 before step 2: spare 4 replaces it, spare 5 is released",
       {KILL(2, 2, TD_FT_BEFORE)}, 1, {1, 0}, 1, 1, ""},
      {"kill ranks 1 and 3 after the reduction of step 3: both spares join",
       {KILL(1, 3, TD_FT_AFTER), KILL(3, 3, TD_FT_AFTER)}, 2, {1, 1}, 1, 2, ""},
      {"kill rank 2 before step 2, then rank 1 in that recovery: the spare joins twice",
       {KILL(2, 2, TD_FT_BEFORE), KILL(1, 2, TD_FT_RECOVERY)}, 2, {1, 1}, 2, 2, ""},
      {"kill rank 3 during step 1, then the spare that replaced it during step 4",
       {KILL(3, 1, TD_FT_DURING), KILL(4, 4, TD_FT_DURING)}, 2, {1, 1}, 2, 2, ""},
      {"kill rank 1 before step 3; spare 4 dies before it is healed, spare 5 takes its place",
       {KILL(1, 3, TD_FT_BEFORE)}, 1, {1, 1}, 2, 2, "", 4},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_spare_case(&cases[i]);
}

/* ---- the coordinator: rank 0 hosts the store; its loss ends the job, clearly ---- */

static int coordinator_worker(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_ft_ddp_options fo;
  td_ft_ddp_options_init(&fo);
  fo.reform_timeout = 10000;
  replica x;
  replica_start(&x, rank, world, method, TD_OPTIM_SGD, 0.1, &fo, false, 0);
  MP_CHECK_OK(td_ft_ddp_inject(x.ft, 0, 1, TD_FT_BEFORE, TD_FT_KILL));
  td_status st = TD_OK;
  for (int64_t step = 0; st == TD_OK && step < STEPS; step++)
    st = td_ft_ddp_step(x.ft, step, shard_fn, x.m, NULL);
  /* the survivors fail the step, naming the store's host, well before the reform timeout */
  fprintf(stderr, "[rank %d] %s\n", rank, td_last_error());
  MP_CHECK(st != TD_OK);
  MP_CHECK(strstr(td_last_error(), "rendezvous store") != NULL);
  MP_CHECK(strstr(td_last_error(), "worker0 (rank 0)") != NULL);
  replica_end(&x, false);
  return 0;
}

static void test_ft_ddp_coordinator_lost(void **state) {
  (void)state;
  int codes[3];
  double t0 = td_test_now_s();
  td_mp_run(3, coordinator_worker, NULL, 60, codes);
  fprintf(stderr, "coordinator lost: the survivors ended %.2f s after the start\n",
          td_test_now_s() - t0);
  assert_int_equal(codes[0], 128 + SIGKILL);
  assert_int_equal(codes[1], 0);
  assert_int_equal(codes[2], 0);
}

/* ---- reform alone: the stale member, the notice ---- */

static int reform_worker(int rank, int world, const char *method, void *arg) {
  const char *flag = arg; /* rank 2 creates it once refused: rank 0 (the store) stays till then */
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 20000, &pg));
  MP_CHECK(td_process_group_generation(pg) == 0);
  td_pg_lost l;
  MP_CHECK(td_process_group_wait_lost(pg, TD_TIMEOUT_ZERO, &l) == TD_ERR_TIMEOUT);
  MP_CHECK_OK(td_process_group_barrier(pg));
  if (rank == 3) { /* dies between collectives */
    fflush(NULL);
    raise(SIGKILL);
  }
  /* the notice names it with no collective in flight (same host: its pidfd) */
  MP_CHECK_OK(td_process_group_wait_lost(pg, td_test_ms(10000), &l));
  MP_CHECK(l.global_rank == 3 && l.group_rank == 3 && l.generation == 0);
  MP_CHECK(strstr(l.reason, "worker3 (rank 3)") != NULL);
  if (rank == 2) td_test_sleep_ms(3000); /* too late for generation 1 */
  td_process_group *next = NULL;
  td_status st = td_process_group_reform(pg, 1500, &next);
  if (rank == 2) {
    if (st != TD_ERR_STATE)
      fprintf(stderr, "rank 2: reform: %s: %s\n", td_status_name(st), td_last_error());
    MP_CHECK(st == TD_ERR_STATE);
    MP_CHECK(strstr(td_last_error(), "stale") && strstr(td_last_error(), "generation 1"));
    FILE *f = fopen(flag, "w");
    MP_CHECK(f != NULL);
    fclose(f);
  } else {
    MP_CHECK_OK(st);
    MP_CHECK(td_process_group_generation(next) == 1 && td_process_group_size(next) == 2);
    MP_CHECK(td_process_group_global_rank(next, 0) == 0 &&
             td_process_group_global_rank(next, 1) == 1);
    int64_t one = 1;
    td_tensor *t = NULL;
    MP_CHECK_OK(td_tensor_full(&one, 1, 5.0, TD_DTYPE_F64, td_device_cpu(), &t));
    MP_CHECK_OK(td_process_group_all_reduce(next, t, TD_REDUCE_SUM));
    MP_CHECK(((double *)td_tensor_data(t))[0] == 10.0);
    td_tensor_unref(t);
    /* the old generation stays broken */
    MP_CHECK(td_process_group_barrier(pg) != TD_OK);
    td_process_group_destroy(next);
    TD_TEST_POLL(access(flag, F_OK) == 0, 20);
    MP_CHECK(access(flag, F_OK) == 0);
  }
  td_process_group_destroy(pg);
  td_rpc_shutdown(a, false, 5000);
  td_rpc_destroy(a);
  CHECK_NO_LEAKS();
  return 0;
}

static void test_reform_stale_and_notice(void **state) {
  (void)state;
  int codes[4];
  char flag[64];
  snprintf(flag, sizeof flag, "/tmp/td_ft_stale_%d", (int)getpid());
  unlink(flag);
  td_mp_run(4, reform_worker, flag, 60, codes);
  unlink(flag);
  assert_int_equal(codes[3], 128 + SIGKILL);
  for (int r = 0; r < 3; r++) assert_int_equal(codes[r], 0);
}

/* ---- the small pieces: shard ranges, injection specs ---- */

static void test_shard_range_and_inject_parse(void **state) {
  (void)state;
  int64_t b = -1, e = -1, next = 0;
  for (int s = 0; s < 4; s++) { /* 10 samples in 4 shards: 3, 3, 2, 2, back to back */
    td_ft_shard_range(10, 4, s, &b, &e);
    assert_int_equal(b, next);
    assert_int_equal(e - b, s < 2 ? 3 : 2);
    next = e;
  }
  assert_int_equal(next, 10);
  int rank = -1;
  int64_t step = -1;
  td_ft_when when = TD_FT_BEFORE;
  td_ft_what what = TD_FT_KILL;
  assert_int_equal(td_ft_inject_parse("2:17:during:close", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(rank, 2);
  assert_int_equal(step, 17);
  assert_int_equal(when, TD_FT_DURING);
  assert_int_equal(what, TD_FT_CLOSE);
  assert_int_equal(td_ft_inject_parse("1:3:recovery:kill", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(when, TD_FT_RECOVERY);
  assert_int_equal(td_ft_inject_parse("0:0:before:stop", &rank, &step, &when, &what), TD_OK);
  assert_int_equal(what, TD_FT_STOP);
  const char *bad[] = {"", "2:17", "2:17:during", "2:17:sometime:kill", "2:17:after:explode",
                       "-1:3:after:kill", "2:17:after:kill:extra", "x:1:after:kill"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    assert_int_equal(td_ft_inject_parse(bad[i], &rank, &step, &when, &what), TD_ERR_INVALID);
  assert_int_equal(rank, 0); /* untouched by the failures */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_shard_range_and_inject_parse),
      cmocka_unit_test(test_reform_stale_and_notice),
      cmocka_unit_test(test_ft_ddp_matrix),
      cmocka_unit_test(test_ft_ddp_coordinator_lost),
      cmocka_unit_test(test_ft_ddp_spares),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
