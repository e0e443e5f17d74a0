/* batch_ps.c - a batch-updating parameter server (PyTorch's "batch RPC processing" example, in C).
 *
 *   build/tools/tdistrun --standalone --nproc-per-node 3 build/examples/batch_ps --epochs 1
 *   build/examples/batch_ps                      (forks 3 processes itself when RANK is unset)
 *
 * Rank 0 is the server; it holds the model (MLP 784-256-10) and a local SGD optimizer. Ranks
 * 1..N-1 are trainers, each with a local copy of the model and its own shard of Fashion-MNIST.
 * Every step, a trainer computes its gradients locally and sends them with td_rpc_async to the
 * server's "bps_update", a registered function that does not reply at once: it adds the
 * gradients to a running sum and hands back a future (the async_result of td_rpc_fn). When the
 * N-1 updates of a step have arrived, the handler that completed the batch averages them, steps
 * the optimizer once and completes every pending future with the new parameters, so all trainers
 * get their reply at the same moment and start the next step from the same parameters - no thread
 * on the server ever waits for a trainer.
 *
 * All trainers run the same number of steps (even shards), which the server computes too: after
 * the last step of every epoch it evaluates the model on the test set (inside the handler, before
 * replying, so no update runs meanwhile). Rank 0 prints the JSON line (docs/BENCH.md):
 * test_accuracy, samples_per_s, wall_s, epochs, epoch_test_accuracy, epoch_wall_s, first_loss
 * and last_loss (the trainers' mean loss over the first and the last 5 steps).
 *
 * usage: batch_ps [--epochs N] [--max-batches N] [--batch-size N] [--lr X] [--momentum X]
 *                 [--seed N] [--nproc N] [--data-dir DIR] [--threads N]
 *
 * Lock order: bps.mu is a leaf (the futures completed under it run the agent's reply
 * callbacks, which take no lock of this file).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "watchdog.h"
#include "tdist/optim.h"
#include "tdist/rpc.h"

#define LOSS_WINDOW 5

/* The server's state. Lock order: bps.mu only; the optimizer and the evaluation run with it
 * held, which serialises the steps (handlers of the next step wait on it). */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  td_module *model;
  td_tensor_list params;
  td_optim *opt;
  td_tensor **sum;       /* running gradient sums of the current step, NULL before the first */
  td_future **pending;   /* futures of the trainers that sent this step's update */
  int arrived, trainers;
  double loss_sum;       /* this step's trainer losses */
  int64_t step, steps_per_epoch, total_steps;
  /* statistics */
  const td_mnist *test;
  double epoch_t0, train_s, first_loss, last_loss, *step_loss;
  int64_t samples, epoch_samples;
  ex_json epoch_acc, epoch_time;
  double acc;
  bool started, finished;
} bps = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* params_value returns a list value holding copies of the parameters (the reply may still be
 * serialised while the next step updates the originals). */
static td_status params_value(td_value **out) {
  td_value *l = td_value_list();
  if (!l) return TD_ERR_NOMEM;
  bool prev = td_autograd_set_enabled(false);
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < bps.params.n; i++) {
    td_tensor *c = NULL;
    st = td_tensor_clone(bps.params.tensors[i], &c);
    if (st == TD_OK) st = td_value_list_append(l, td_value_tensor(c));
    td_tensor_unref(c);
  }
  td_autograd_set_enabled(prev);
  if (st != TD_OK) {
    td_value_unref(l);
    return st;
  }
  *out = l;
  return TD_OK;
}

/* bps_get_params() -> the current parameters (a trainer's starting point). */
static td_status bps_get_params(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                td_future **fut) {
  pthread_mutex_lock(&bps.mu);
  td_status st = params_value(res);
  pthread_mutex_unlock(&bps.mu);
  return st;
}

/* end_epoch records an epoch's time and test accuracy (bps.mu held). */
static void end_epoch(void) {
  double et = ex_now_s() - bps.epoch_t0;
  bps.train_s += et;
  bps.samples += bps.epoch_samples;
  double t0 = ex_now_s();
  bps.acc = psx_evaluate(bps.model, bps.test, true);
  int epoch = (int)(bps.step / bps.steps_per_epoch);
  fprintf(stderr, "epoch %d: test accuracy %.4f (epoch %.2fs, %lld steps of %d trainers, "
          "eval %.1fs)\n", epoch, bps.acc, et, (long long)bps.steps_per_epoch, bps.trainers,
          ex_now_s() - t0);
  ex_metrics_eval(epoch, "test_accuracy", bps.acc);
  ex_json_num(&bps.epoch_acc, NULL, bps.acc);
  ex_json_num(&bps.epoch_time, NULL, et);
  bps.epoch_samples = 0;
  bps.epoch_t0 = ex_now_s();
}

/* finish_step averages the summed gradients, steps, and completes every pending future with
 * the new parameters (bps.mu held). */
static td_status finish_step(void) {
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < bps.params.n; i++)
    st = td_tensor_mul_scalar_(bps.sum[i], 1.0 / bps.trainers);
  if (st == TD_OK) st = td_optim_step_grads(bps.opt, bps.sum, bps.params.n);
  bps.step_loss[bps.step] = bps.loss_sum / bps.trainers;
  bps.step++;
  if (st == TD_OK && bps.step % bps.steps_per_epoch == 0) end_epoch();
  td_value *v = NULL;
  if (st == TD_OK) st = params_value(&v);
  for (int i = 0; i < bps.arrived; i++) {
    if (st == TD_OK) td_future_complete(bps.pending[i], td_value_ref(v));
    else td_future_fail(bps.pending[i], st, "batch_ps: step failed: %s", td_last_error());
    td_future_unref(bps.pending[i]);
    bps.pending[i] = NULL;
  }
  td_value_unref(v);
  for (size_t i = 0; i < bps.params.n; i++) {
    td_tensor_unref(bps.sum[i]);
    bps.sum[i] = NULL;
  }
  bps.arrived = 0;
  bps.loss_sum = 0;
  if (bps.step == bps.total_steps) {
    bps.finished = true;
    pthread_cond_broadcast(&bps.cv);
  }
  return st;
}

/* bps_update(grads, loss, samples) -> future of the parameters after this step's batch. */
static td_status bps_update(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  double loss;
  int64_t samples;
  if (n != 3 || td_value_list_len(args[0]) != bps.params.n)
    return td_set_error(TD_ERR_INVALID, "bps_update: expected (grads[%zu], loss, samples)",
                        bps.params.n);
  if (td_value_as_double(args[1], &loss) != TD_OK || td_value_as_int(args[2], &samples) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "bps_update: bad loss or sample count");
  td_future *f = td_future_create();
  if (!f) return TD_ERR_NOMEM;
  pthread_mutex_lock(&bps.mu);
  td_status st = TD_OK;
  if (bps.step >= bps.total_steps) st = td_set_error(TD_ERR_STATE, "bps_update: training is over");
  bool prev = td_autograd_set_enabled(false);
  for (size_t i = 0; st == TD_OK && i < bps.params.n; i++) {
    td_tensor *g;
    st = td_value_as_tensor(td_value_list_get(args[0], i), &g);
    if (st != TD_OK) break;
    if (!bps.sum[i]) st = td_tensor_clone(g, &bps.sum[i]); /* the first trainer of the step */
    else st = td_tensor_add_(bps.sum[i], g, 1.0);
  }
  td_autograd_set_enabled(prev);
  if (st == TD_OK) {
    if (!bps.started) { /* the first epoch starts with the first update */
      bps.started = true;
      bps.epoch_t0 = ex_now_s();
    }
    bps.pending[bps.arrived++] = td_future_ref(f);
    bps.loss_sum += loss;
    bps.epoch_samples += samples;
    if (bps.arrived == bps.trainers) st = finish_step();
  }
  pthread_mutex_unlock(&bps.mu);
  if (st != TD_OK) {
    td_future_unref(f);
    return st;
  }
  *fut = f;
  return TD_OK;
}

/* steps_per_epoch is the number of batches each trainer's shard yields (the same for all). */
static int64_t steps_per_epoch(const td_mnist *train, const ex_args *args, int trainers,
                               int tid) {
  td_sampler_opts so;
  td_sampler_opts_init(&so);
  so.batch_size = args->batch_size;
  so.rank = tid;
  so.world = trainers;
  so.even_shards = true;
  td_sampler *s = NULL;
  EX_CHECK(td_sampler_create(td_mnist_count(train), &so, &s));
  int64_t nb = td_sampler_num_batches(s);
  td_sampler_destroy(s);
  if (args->max_batches > 0 && args->max_batches < nb) nb = args->max_batches;
  return nb;
}

/* server_setup loads the data and makes the model, the optimizer and the step bookkeeping, all
 * before td_rpc_init so that the handlers find everything ready. */
static void server_setup(const ex_args *args, int trainers, double momentum, td_mnist **train,
                         td_mnist **test) {
  *train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);
  *test = psx_load_mnist(TD_MNIST_TEST, args->data_dir);
  int64_t nb = steps_per_epoch(*train, args, trainers, 0);
  bps.trainers = trainers;
  bps.model = psx_make_model("mlp", args->seed);
  td_tensor_list_init(&bps.params);
  EX_CHECK(td_module_parameters(bps.model, &bps.params));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = args->lr;
  oo.momentum = momentum;
  EX_CHECK(td_optim_create(&oo, bps.params.tensors, bps.params.n, &bps.opt));
  bps.sum = calloc(bps.params.n, sizeof *bps.sum);
  bps.pending = calloc((size_t)trainers, sizeof *bps.pending);
  ex_json_array(&bps.epoch_acc);
  ex_json_array(&bps.epoch_time);
  bps.test = *test;
  bps.steps_per_epoch = nb > 0 ? nb : 1;
  bps.total_steps = nb * args->epochs;
  bps.step_loss = calloc((size_t)(bps.total_steps > 0 ? bps.total_steps : 1), sizeof(double));
  if (!bps.sum || !bps.pending || !bps.step_loss) ex_die("out of memory");
  bps.epoch_t0 = ex_now_s();
  if (bps.total_steps == 0) bps.finished = true;
}

static int run_server(const ex_args *args, int trainers, double momentum, double t_start) {
  td_mnist *test = (td_mnist *)bps.test;
  int64_t nb = bps.steps_per_epoch;
  fprintf(stderr, "batch_ps: mlp, %lld parameters, %d trainers, %lld steps per epoch, batch %lld "
          "per trainer, SGD lr %g momentum %g, BLAS threads %d\n",
          (long long)td_module_num_parameters(bps.model), trainers, (long long)nb,
          (long long)args->batch_size, args->lr, momentum, ex_blas_threads());

  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 1800;
  pthread_mutex_lock(&bps.mu);
  while (!bps.finished)
    if (pthread_cond_timedwait(&bps.cv, &bps.mu, &dl) != 0) ex_die("training never finished");
  pthread_mutex_unlock(&bps.mu);
  if (args->epochs == 0) bps.acc = psx_evaluate(bps.model, test, true);

  int64_t ts = bps.total_steps, w = ts < LOSS_WINDOW ? ts : LOSS_WINDOW;
  double first = 0, last = 0;
  for (int64_t i = 0; i < w; i++) {
    first += bps.step_loss[i];
    last += bps.step_loss[ts - w + i];
  }
  ex_json config, results;
  ex_json_object(&config);
  ex_json_str(&config, "model", "mlp");
  ex_json_int(&config, "trainers", trainers);
  ex_json_int(&config, "epochs", args->epochs);
  ex_json_int(&config, "batch_size", args->batch_size);
  ex_json_num(&config, "lr", args->lr);
  ex_json_num(&config, "momentum", momentum);
  ex_json_int(&config, "seed", (int64_t)args->seed);
  ex_json_int(&config, "max_batches", args->max_batches);
  ex_json_int(&config, "threads", ex_blas_threads());
  ex_json_object(&results);
  ex_json_num(&results, "test_accuracy", bps.acc);
  ex_json_num(&results, "samples_per_s", bps.train_s > 0 ? (double)bps.samples / bps.train_s : 0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_int(&results, "epochs", args->epochs);
  ex_json_int(&results, "steps", ts);
  ex_json_num(&results, "epoch_wall_s", args->epochs ? bps.train_s / args->epochs : 0.0);
  ex_json_num(&results, "first_loss", w ? first / (double)w : NAN);
  ex_json_num(&results, "last_loss", w ? last / (double)w : NAN);
  ex_json_child(&results, "epoch_test_accuracy", &bps.epoch_acc);
  ex_json_child(&results, "epoch_wall_s_list", &bps.epoch_time);
  ex_json_num(&results, "peak_rss_mb", ex_peak_rss_mb());
  const char *const promote[] = {"test_accuracy", "samples_per_s", "epochs", "wall_s", NULL};
  ex_json_print_result("batch_ps", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
  return 0;
}

/* load_params copies a parameter list value into the trainer's model. */
static void load_params(const td_tensor_list *params, const td_value *v) {
  if (td_value_list_len(v) != params->n) ex_die("server sent %zu parameters, expected %zu",
                                                td_value_list_len(v), params->n);
  bool prev = td_autograd_set_enabled(false);
  for (size_t i = 0; i < params->n; i++) {
    td_tensor *t;
    EX_CHECK(td_value_as_tensor(td_value_list_get(v, i), &t));
    EX_CHECK(td_tensor_copy_(params->tensors[i], t));
  }
  td_autograd_set_enabled(prev);
}

static int run_trainer(td_rpc_agent *a, const ex_args *args, int trainers) {
  int tid = td_rpc_rank(a) - 1;
  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);
  td_module *model = psx_make_model("mlp", args->seed);
  td_tensor_list params;
  td_tensor_list_init(&params);
  EX_CHECK(td_module_parameters(model, &params));
  td_value *v = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "bps_get_params", NULL, 0, NULL, &v));
  load_params(&params, v);
  td_value_unref(v);

  int64_t nb;
  td_mnist_loader *loader = psx_shard_loader(train, args, tid, trainers, true, &nb);
  for (int epoch = 0; epoch < args->epochs; epoch++) {
    EX_CHECK(td_mnist_loader_set_epoch(loader, (uint64_t)epoch));
    ex_progress bar;
    char label[48];
    snprintf(label, sizeof label, "trainer %d epoch %d/%d", tid + 1, epoch + 1, args->epochs);
    if (tid == 0) ex_progress_start(&bar, label, nb);
    double loss_sum = 0;
    for (int64_t b = 0; b < nb; b++) {
      td_tensor *x = NULL, *y = NULL, *logits = NULL, *loss = NULL;
      EX_CHECK(td_mnist_loader_next(loader, &x, &y));
      if (!x) ex_die("trainer %d: shard ended after %lld batches", tid + 1, (long long)b);
      double ts = ex_now_s();
      td_module_zero_grad(model);
      EX_CHECK(td_module_forward(model, x, &logits));
      EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
      double t1 = ex_now_s();
      EX_CHECK(td_tensor_backward(loss));
      double t2 = ex_now_s();
      double lv;
      EX_CHECK(td_tensor_item(loss, &lv));
      if (!isfinite(lv)) ex_die("trainer %d: loss became %g", tid + 1, lv);
      td_value *grads = td_value_list();
      for (size_t i = 0; i < params.n; i++) {
        td_tensor *g = td_tensor_grad(params.tensors[i]);
        if (!g) ex_die("trainer %d: parameter %zu has no gradient", tid + 1, i);
        EX_CHECK(td_value_list_append(grads, td_value_tensor(g)));
        td_tensor_unref(g);
      }
      td_value *uargs[3] = {grads, td_value_double(lv), td_value_int(td_tensor_size(x, 0))};
      td_future *f = NULL;
      EX_CHECK(td_rpc_async(a, "worker0", "bps_update", uargs, 3, NULL, &f));
      EX_CHECK(td_future_wait(f, TD_TIMEOUT_INFINITE));
      EX_CHECK(td_future_status(f));
      load_params(&params, td_future_value(f));
      td_future_unref(f);
      for (int i = 0; i < 3; i++) td_value_unref(uargs[i]);
      ex_phases ph = {0};
      ex_phases_add(&ph, "forward_s", t1 - ts);
      ex_phases_add(&ph, "backward_s", t2 - t1);
      ex_phases_add(&ph, "update_s", ex_now_s() - t2); /* the server's batched step, round trip */
      ex_metrics_step(epoch, epoch * nb + b, lv, NAN,
                      (double)td_tensor_size(x, 0) / (ex_now_s() - ts), &ph);
      loss_sum += lv;
      if (tid == 0) ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1));
      td_tensor_unref(loss);
      td_tensor_unref(logits);
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    if (tid == 0) ex_progress_finish(&bar, "loss %.4f", nb ? loss_sum / (double)nb : NAN);
  }
  td_mnist_loader_destroy(loader);
  td_tensor_list_fini(&params);
  td_module_unref(model);
  td_mnist_destroy(train);
  return 0;
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  ex_args a;
  ex_args_init(&a);
  a.omit = "model device";
  double momentum = 0.5;
  int nproc = 3;
  const ex_opt extra[] = {
      {"momentum", EX_OPT_DOUBLE, &momentum, "SGD momentum"},
      {"nproc", EX_OPT_INT, &nproc,
       "processes to fork when not started by tdistrun (RANK unset)"},
  };
  ex_args_parse(argc, argv, &a, extra, 2,
                "batch_ps: a parameter server that batches the updates of all trainers");
  if (a.epochs < 0) ex_die("--epochs must be >= 0");

  psx_spawn_if_alone(nproc);
  int rank = atoi(getenv("RANK"));
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  EX_CHECK(td_rpc_register("bps_get_params", bps_get_params, NULL));
  EX_CHECK(td_rpc_register("bps_update", bps_update, NULL));
  ex_watchdog_register(); /* on by default: a lost worker stops the job (watchdog.h) */
  int world = atoi(getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "0");
  if (world < 2) ex_die("batch_ps needs at least 2 processes (a server and a trainer)");
  td_mnist *train = NULL, *test = NULL;
  if (rank == 0) server_setup(&a, world - 1, momentum, &train, &test);
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(name, &ro, &agent));
  ex_watchdog_start(agent, NULL);
  ex_metrics_open(a.metrics, rank, world, name, "batch_ps", NULL);
  int rc = rank == 0 ? run_server(&a, world - 1, momentum, t_start)
                     : run_trainer(agent, &a, world - 1);
  ex_metrics_counters(agent);
  ex_metrics_close();
  ex_watchdog_stop(); /* before leaving: a worker that left is not lost */
  if (td_rpc_shutdown(agent, true, TD_TIMEOUT_DEFAULT) != TD_OK) {
    fprintf(stderr, "worker%d: shutdown: %s\n", rank, td_last_error());
    if (!rc) rc = 1;
  }
  td_rpc_destroy(agent);
  if (rank == 0) {
    td_optim_destroy(bps.opt);
    td_tensor_list_fini(&bps.params);
    td_module_unref(bps.model);
    free(bps.sum);
    free(bps.pending);
    free(bps.step_loss);
    ex_json_fini(&bps.epoch_acc);
    ex_json_fini(&bps.epoch_time);
    td_mnist_destroy(train);
    td_mnist_destroy(test);
  }
  return psx_wait_children(rc);
}
