/* pipeline_split.c - an MLP split across two workers and driven as a pipeline by a master.
 *
 * Layout (3 processes): rank 0 "master" holds the data and drives; rank 1 "worker1" holds
 * Linear(784, 1024) + ReLU, rank 2 "worker2" holds Linear(1024, 512) + ReLU + Linear(512, 10)
 * (stages of equal training cost, see make_part), each a RemoteModule
 * (include/tdist/remote_module.h). A batch goes through td_pipeline_forward as m micro-batches:
 * worker2 fetches worker1's activations directly by RRef, the master only sees the logits.
 *
 * First the master measures samples/s of a training pass (pipelined forward, loss, distributed
 * backward; no update) with 1, 2, 4 and 8 micro-batches on --bench-batches batches of
 * --bench-batch-size each, run in --bench-rounds rounds that cycle through the four counts (so a
 * change in the machine's load while it measures touches every count alike); then it trains for
 * --epochs with distributed autograd and a distributed SGD optimizer (momentum; learning rate
 * decayed along a cosine over the run through td_dist_optimizer_set_lr) over both workers'
 * parameters, using --micro-batches, and reports the test accuracy. The last line of standard
 * output is the JSON result (docs/BENCH.md) with test_accuracy, samples_per_s (training),
 * wall_s, runs [{"micro_batches", "samples_per_s"}] and speedup_4_vs_1 (samples/s with 4
 * micro-batches over that with 1).
 *
 * usage: tdistrun --standalone --nproc-per-node 3 build/examples/pipeline_split [--epochs N]
 *        [--max-batches N] [--batch-size N] [--lr X] [--momentum X] [--micro-batches M]
 *        [--bench-batches N] [--bench-batch-size N] [--bench-rounds N] [--seed N] [--data-dir DIR]
 * Without RANK in the environment it starts the two workers itself (fork) on a free port.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "tdist/autograd.h"
#include "tdist/data.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/nn.h"
#include "tdist/remote_module.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"
#include "tdist/tensor.h"

/* Factories (args: [seed]): "ps_body" = Sequential(Linear(784, 1024), ReLU), "ps_head" =
 * Sequential(Linear(1024, 512), ReLU, Linear(512, 10)); initialised like PyTorch from a generator
 * seeded with seed. The two stages cost about the same in a training pass, which is what lets
 * micro-batches overlap (a tiny second stage would leave nothing to pipeline, a heavy one would
 * bound the throughput): per sample the body does 0.80M multiply-adds forward and 0.80M for its
 * weight gradient (its input needs none), the head 0.53M forward and 1.05M backward (input and
 * weight gradients), 1.61M against 1.58M; at batch 1024 on one core about 26 and 23 ms. (A
 * 1024-768-10 head, equal to the body in the forward only, costs 2.38M: 36 ms.) */
static td_status make_part(const void *args, bool body, td_module **out) {
  int64_t seed = 0;
  if (args) td_value_as_int(td_value_list_get(args, 0), &seed);
  td_generator *g = NULL;
  td_status st = td_generator_create((uint64_t)seed, &g);
  td_module *m = NULL, *lin = NULL, *relu = NULL, *lin2 = NULL;
  if (st == TD_OK) st = td_sequential_create(&m);
  if (st == TD_OK && body) {
    if (st == TD_OK) st = td_linear_create(784, 1024, true, g, &lin);
    if (st == TD_OK) st = td_relu_create(&relu);
    if (st == TD_OK) st = td_sequential_append(m, lin);
    if (st == TD_OK) st = td_sequential_append(m, relu);
  } else if (st == TD_OK) {
    if (st == TD_OK) st = td_linear_create(1024, 512, true, g, &lin);
    if (st == TD_OK) st = td_relu_create(&relu);
    if (st == TD_OK) st = td_linear_create(512, 10, true, g, &lin2);
    if (st == TD_OK) st = td_sequential_append(m, lin);
    if (st == TD_OK) st = td_sequential_append(m, relu);
    if (st == TD_OK) st = td_sequential_append(m, lin2);
  }
  td_module_unref(lin2);
  td_module_unref(lin);
  td_module_unref(relu);
  td_generator_destroy(g);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}
static td_status body_factory(void *ctx, const void *args, td_module **out) {
  return make_part(args, true, out);
}
static td_status head_factory(void *ctx, const void *args, td_module **out) {
  return make_part(args, false, out);
}

static td_tensor *ce_loss(td_tensor *logits, td_tensor *y) {
  td_tensor *loss = NULL;
  EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
  return loss;
}

/* One pass (pipelined forward, loss, distributed backward and, when opt, a step) on (x, y).
 * Returns the loss. */
static double step(td_rpc_agent *a, td_pipeline *p, td_dist_optimizer *opt, td_tensor *x,
                   td_tensor *y, int m) {
  td_dist_autograd_context *ctx = NULL;
  EX_CHECK(td_dist_autograd_context_begin(a, &ctx));
  td_tensor *logits = NULL;
  EX_CHECK(td_pipeline_forward(p, x, m, &logits));
  td_tensor *loss = ce_loss(logits, y);
  EX_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
  if (opt) EX_CHECK(td_dist_optimizer_step(opt, ctx));
  double lv = NAN;
  EX_CHECK(td_tensor_item(loss, &lv));
  td_tensor_unref(loss);
  td_tensor_unref(logits);
  EX_CHECK(td_dist_autograd_context_end(ctx));
  return lv;
}

/* The pipeline's forward in evaluation, for psx_accuracy. */
typedef struct pipe_eval {
  td_pipeline *p;
  int m; /* micro-batches */
} pipe_eval;

static td_status pipe_forward(void *ctx, td_tensor *x, td_tensor **logits) {
  pipe_eval *e = ctx;
  return td_pipeline_forward(e->p, x, e->m, logits);
}

static double evaluate(td_pipeline *p, td_remote_module *const *st, const td_mnist *ds, int m) {
  for (int k = 0; k < 2; k++) EX_CHECK(td_remote_module_train(st[k], false));
  pipe_eval e = {p, m};
  double acc = psx_accuracy(ds, true, 1000, pipe_forward, &e);
  for (int k = 0; k < 2; k++) EX_CHECK(td_remote_module_train(st[k], true));
  return acc;
}

/* The settings of a run (options). */
typedef struct run_cfg {
  ex_args a;
  double momentum;
  int micro, bench_batches, bench_rounds;
  int64_t bench_bs;
} run_cfg;

/* bench_runs measures samples/s of a training pass (no update) with 1, 2, 4, 8 micro-batches,
 * in rounds that cycle through the counts; adds {micro_batches, samples_per_s} to runs and
 * returns the speedup of 4 over 1 (0 when not measured). */
static double bench_runs(td_rpc_agent *agent, td_pipeline *pipe, const td_mnist *train,
                         const run_cfg *c, ex_json *runs) {
  if (c->bench_batches <= 0) return 0;
  td_sampler_opts so;
  td_sampler_opts_init(&so);
  so.batch_size = c->bench_bs;
  td_mnist_loader *l = NULL;
  EX_CHECK(td_mnist_loader_create(train, &so, true, &l));
  td_tensor *bx = NULL, *by = NULL;
  EX_CHECK(td_mnist_loader_next(l, &bx, &by));
  const int ms[4] = {1, 2, 4, 8};
  double secs[4] = {0, 0, 0, 0}, sps[4];
  step(agent, pipe, NULL, bx, by, 1); /* warm-up */
  for (int r = 0; r < c->bench_rounds; r++) {
    /* round r runs its share of bench_batches for every count, in turn */
    int nr = (int)((int64_t)c->bench_batches * (r + 1) / c->bench_rounds -
                   (int64_t)c->bench_batches * r / c->bench_rounds);
    for (int i = 0; i < 4; i++) {
      double t0 = ex_now_s();
      for (int b = 0; b < nr; b++) step(agent, pipe, NULL, bx, by, ms[i]);
      secs[i] += ex_now_s() - t0;
    }
  }
  for (int i = 0; i < 4; i++) {
    sps[i] = (double)c->bench_batches * (double)td_tensor_size(bx, 0) / secs[i];
    fprintf(stderr, "micro-batches %d: %.0f samples/s\n", ms[i], sps[i]);
    ex_json run;
    ex_json_object(&run);
    ex_json_int(&run, "micro_batches", ms[i]);
    ex_json_num(&run, "samples_per_s", sps[i]);
    ex_json_child(runs, NULL, &run);
    ex_json_fini(&run);
  }
  td_tensor_unref(bx);
  td_tensor_unref(by);
  td_mnist_loader_destroy(l);
  return sps[2] / sps[0];
}

/* What the training reports. */
typedef struct train_stats {
  double train_s, acc;
  int64_t samples;
  ex_losses losses;
} train_stats;

/* make_opt creates the distributed SGD optimizer over both stages' parameters; *plists gets
 * their lists (release with td_value_unref). */
static td_dist_optimizer *make_opt(td_rpc_agent *agent, td_remote_module *const st[2],
                                   const run_cfg *c, td_value *plists[2]) {
  td_rref *prefs[8];
  size_t np = 0;
  for (int k = 0; k < 2; k++) {
    EX_CHECK(td_remote_module_parameters(st[k], &plists[k]));
    for (size_t i = 0; i < td_value_list_len(plists[k]) && np < 8; i++)
      EX_CHECK(td_value_as_rref(td_value_list_get(plists[k], i), &prefs[np++]));
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = c->a.lr;
  oo.momentum = c->momentum;
  td_dist_optimizer *opt = NULL;
  EX_CHECK(td_dist_optimizer_create(agent, &oo, prefs, np, &opt));
  return opt;
}

/* train runs the epochs with distributed autograd and the distributed optimizer, learning rate
 * on a cosine over the run, and evaluates after each. */
static void train(td_rpc_agent *agent, td_pipeline *pipe, td_remote_module *const st[2],
                  const td_mnist *train_ds, const td_mnist *test, const run_cfg *c,
                  train_stats *out) {
  const ex_args *a = &c->a;
  td_value *plists[2];
  td_dist_optimizer *opt = make_opt(agent, st, c, plists);
  int64_t nb;
  td_mnist_loader *loader = psx_shard_loader(train_ds, a, 0, 1, true, &nb); /* all of it */
  double lr = a->lr;
  for (int epoch = 0; epoch < a->epochs; epoch++) {
    EX_CHECK(td_mnist_loader_set_epoch(loader, (uint64_t)epoch));
    char label[32];
    snprintf(label, sizeof label, "epoch %d/%d", epoch + 1, a->epochs);
    ex_progress bar;
    ex_progress_start(&bar, label, nb);
    double t0 = ex_now_s(), sum = 0;
    int64_t b = 0;
    for (; b < nb; b++) {
      td_tensor *x = NULL, *y = NULL;
      EX_CHECK(td_mnist_loader_next(loader, &x, &y));
      if (!x) break;
      if (b % 25 == 0) { /* cosine decay of the learning rate over the whole run */
        double prog = (double)(epoch * nb + b) / (double)(a->epochs * nb);
        lr = a->lr * 0.5 * (1.0 + cos(M_PI * prog));
        EX_CHECK(td_dist_optimizer_set_lr(opt, lr));
      }
      double ts = ex_now_s();
      double lv = step(agent, pipe, opt, x, y, c->micro);
      ex_metrics_step(epoch, epoch * nb + b, lv, lr,
                      (double)td_tensor_size(x, 0) / (ex_now_s() - ts), NULL);
      if (!isfinite(lv)) ex_die("the loss became %g at batch %lld (try a lower --lr)", lv,
                                (long long)b);
      sum += lv;
      ex_losses_add(&out->losses, lv);
      out->samples += td_tensor_size(x, 0);
      ex_progress_update(&bar, b + 1, "loss %.4f", sum / (double)(b + 1));
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    out->train_s += ex_now_s() - t0;
    ex_progress_finish(&bar, "loss %.4f", b ? sum / (double)b : NAN);
    out->acc = evaluate(pipe, st, test, c->micro);
    ex_metrics_eval(epoch + 1, "test_accuracy", out->acc);
    fprintf(stderr, "epoch %d: test accuracy %.4f\n", epoch + 1, out->acc);
  }
  td_mnist_loader_destroy(loader);
  td_dist_optimizer_destroy(opt);
  td_value_unref(plists[0]);
  td_value_unref(plists[1]);
}

static void print_result(const run_cfg *c, const train_stats *t, ex_json *runs, double speedup,
                         double load_at_start, double t_start) {
  ex_json config, results;
  ex_json_object(&config);
  ex_json_int(&config, "world_size", 3);
  ex_json_int(&config, "epochs", c->a.epochs);
  ex_json_int(&config, "batch_size", c->a.batch_size);
  ex_json_int(&config, "micro_batches", c->micro);
  ex_json_num(&config, "lr", c->a.lr);
  ex_json_num(&config, "momentum", c->momentum);
  ex_json_int(&config, "max_batches", c->a.max_batches);
  ex_json_int(&config, "bench_batches", c->bench_batches);
  ex_json_int(&config, "bench_batch_size", c->bench_bs);
  ex_json_int(&config, "bench_rounds", c->bench_rounds);
  ex_json_int(&config, "threads", ex_blas_threads());
  /* the pipeline overlaps stages only on CPUs nothing else is using: record what the host had */
  ex_json_int(&config, "cpus", sysconf(_SC_NPROCESSORS_ONLN));
  ex_json_num(&config, "load_avg_1m_at_start", load_at_start);
  ex_json_object(&results);
  ex_json_num(&results, "test_accuracy", t->acc);
  ex_json_num(&results, "samples_per_s", t->train_s > 0 ? (double)t->samples / t->train_s : 0.0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_child(&results, "runs", runs);
  if (speedup > 0) ex_json_num(&results, "speedup_4_vs_1", speedup);
  ex_json_num(&results, "first_loss", ex_losses_first(&t->losses));
  ex_json_num(&results, "last_loss", ex_losses_last(&t->losses));
  /* the names of the PyTorch peer (bench/peers/torch/pipeline_split.py) */
  ex_json_num(&results, "first_train_loss", ex_losses_first(&t->losses));
  ex_json_num(&results, "final_train_loss", ex_losses_last(&t->losses));
  ex_json_num(&results, "train_s", t->train_s);
  const char *const promote[] = {"test_accuracy", "samples_per_s", "wall_s", "runs", NULL};
  ex_json_print_result("pipeline_split", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
}

/* run_master builds the two stages, measures, trains and prints the result. */
static void run_master(td_rpc_agent *agent, const run_cfg *c, double t_start) {
  td_mnist *train_ds = psx_load_mnist(TD_MNIST_TRAIN, c->a.data_dir);
  td_mnist *test = psx_load_mnist(TD_MNIST_TEST, c->a.data_dir);
  td_value *args[2] = {td_value_list(), td_value_list()};
  for (int k = 0; k < 2; k++) {
    if (!args[k] || td_value_list_append(args[k], td_value_int((int64_t)c->a.seed + k)) != TD_OK)
      ex_die("out of memory");
  }
  td_remote_module *st[2];
  EX_CHECK(td_remote_module_create(agent, "worker1/cpu", "ps_body", args[0], &st[0]));
  EX_CHECK(td_remote_module_create(agent, "rank:2/cpu", "ps_head", args[1], &st[1]));
  td_pipeline *pipe = NULL;
  EX_CHECK(td_pipeline_create(agent, st, 2, &pipe));
  fprintf(stderr, "pipeline_split: stage 0 on %s, stage 1 on %s, %lld train / %lld test\n",
          td_remote_module_owner(st[0]), td_remote_module_owner(st[1]),
          (long long)td_mnist_count(train_ds), (long long)td_mnist_count(test));
  double load_at_start = NAN;
  if (getloadavg(&load_at_start, 1) != 1) load_at_start = NAN;
  ex_json runs;
  ex_json_array(&runs);
  double speedup = bench_runs(agent, pipe, train_ds, c, &runs);
  train_stats t = {0};
  train(agent, pipe, st, train_ds, test, c, &t);
  print_result(c, &t, &runs, speedup, load_at_start, t_start);
  ex_json_fini(&runs);
  td_pipeline_destroy(pipe);
  for (int k = 0; k < 2; k++) {
    td_remote_module_destroy(st[k]);
    td_value_unref(args[k]);
  }
  td_mnist_destroy(train_ds);
  td_mnist_destroy(test);
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  run_cfg c = {.momentum = 0.5, .micro = 4, .bench_batches = 20, .bench_rounds = 5,
               .bench_bs = 1024};
  ex_args_init(&c.a);
  c.a.omit = "model device";
  const ex_opt extra[] = {
      {"momentum", EX_OPT_DOUBLE, &c.momentum, "SGD momentum"},
      {"micro-batches", EX_OPT_INT, &c.micro, "micro-batches per training batch"},
      {"bench-batches", EX_OPT_INT, &c.bench_batches,
       "batches per micro-batch count in the throughput runs; 0 skips them"},
      {"bench-batch-size", EX_OPT_I64, &c.bench_bs, "batch size of the throughput runs"},
      {"bench-rounds", EX_OPT_INT, &c.bench_rounds,
       "rounds the throughput runs are split into, each cycling through 1, 2, 4, 8 (at most "
       "--bench-batches)"},
  };
  ex_args_parse(argc, argv, &c.a, extra, 5,
                "pipeline_split: an MLP split across 2 workers, pipelined micro-batches");
  if (c.micro < 1) ex_die("--micro-batches must be >= 1");
  if (c.bench_batches < 0 || c.bench_bs < 1)
    ex_die("--bench-batches must be >= 0 and --bench-batch-size >= 1");
  if (c.bench_rounds < 1) ex_die("--bench-rounds must be >= 1");
  if (c.bench_rounds > c.bench_batches) c.bench_rounds = c.bench_batches > 0 ? c.bench_batches : 1;

  psx_spawn_if_alone(3); /* without a launcher: fork the two workers */
  int rank = atoi(getenv("RANK"));
  if (rank < 0 || rank > 2) ex_die("pipeline_split needs exactly 3 processes (got RANK %d)", rank);
  EX_CHECK(td_module_factory_register("ps_body", body_factory, NULL));
  EX_CHECK(td_module_factory_register("ps_head", head_factory, NULL));
  const char *names[3] = {"master", "worker1", "worker2"};
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  ro.num_worker_threads = 8;
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(names[rank], &ro, &agent));
  if (td_rpc_world_size(agent) != 3) ex_die("pipeline_split needs a world size of 3");
  ex_metrics_open(c.a.metrics, rank, 3, names[rank], "pipeline_split", NULL);
  if (rank == 0) run_master(agent, &c, t_start);
  ex_metrics_counters(agent);
  ex_metrics_close();
  EX_CHECK(td_rpc_shutdown(agent, true, 24 * 3600 * 1000LL));
  td_rpc_destroy(agent);
  return psx_wait_children(0);
}
