/* param_server.c - parameter-server training on Fashion-MNIST with RRefs, distributed autograd
 * and the distributed optimizer (PyTorch's "parameter server with RPC" tutorial, in C).
 *
 *   build/tools/tdistrun --standalone --nproc-per-node 3 build/examples/param_server --epochs 3
 *   build/examples/param_server --epochs 3          (forks 3 processes itself when RANK is unset)
 *
 * Rank 0 is the parameter server: it holds the model (--model mlp: 784-256-10, or cnn: the CNN
 * of train_local) as an "nn.Module" object behind an owner RRef and evaluates it on the test set
 * after every epoch. Ranks 1..N-1 are trainers, running concurrently: each one asks the server
 * for the model RRef, gets RRefs to its parameters (td_dist_module_parameter_rrefs) for a
 * distributed optimizer, and then, for every batch of its own shard of the training set (a
 * td_sampler over trainer index / number of trainers), inside a distributed autograd context:
 *   logits = rpc(model_rref, "ps_forward", x)      the forward runs on the server
 *   loss   = cross_entropy(logits, y)               on the trainer
 *   td_dist_autograd_backward(ctx, loss)            gradients flow back to the server
 *   td_dist_optimizer_step(opt, ctx)                the server steps with this context's grads
 * Trainers update the shared parameters without locks between them (as in PyTorch's example);
 * the server serialises the optimizer steps. Recipe (both models): SGD with Nesterov momentum 0.9
 * and a learning rate following a cosine from --lr (0.02) down to 0 over the whole run, set at
 * the middle of every stretch of --lr-every batches with td_dist_optimizer_set_lr (each trainer
 * keeps one distributed optimizer; its momentum buffers live on the server). After 3 epochs with
 * 2 trainers: test accuracy 0.881-0.886 (MLP), 0.913-0.914 (CNN) over seeds.
 *
 * No handler waits: "ps_get_model" answers with a future the server completes once the model's
 * RRef exists (ex_handout), and "ps_sync", the trainers' meeting point at the start and end of
 * every epoch, answers with a future completed when every trainer has arrived and, at an epoch's
 * end, the server has evaluated (batch-RPC style).
 *
 * --device cuda:N puts the model on the server's cuda:N: the trainers' device map {worker0, cpu,
 * cuda:N} makes their batches arrive there, the logits come back to their CPU and the gradients
 * go back to the GPU, where the optimizer steps; the server evaluates there too.
 *
 * Checkpoints and the failure watchdog (on by default; --checkpoint-dir, --keepalive-ms, ...) live
 * in common/ps_ft.c and common/watchdog.c; this file only calls their hooks.
 *
 * Output: progress on standard error (trainer 1 draws a bar; the server prints a line per epoch),
 * then rank 0 prints the JSON line (docs/BENCH.md): test_accuracy, samples_per_s, wall_s,
 * epochs, epoch_test_accuracy, epoch_wall_s (mean over epochs of the slowest trainer's training
 * time), first_loss (mean training loss over the first 5 batches of every trainer) and last_loss
 * (over the last 5 batches). `param_server --help` lists the options and their defaults.
 *
 * Lock order: no lock of its own (ex_handout and ex_reports have leaf locks).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "ps_ft.h"
#include "watchdog.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

#define MAX_EPOCHS 1000
/* PS_TRY returns the status of expr from the enclosing function unless it is TD_OK. */
#define PS_TRY(expr)                   \
  do {                                 \
    td_status ps_s_ = (expr);          \
    if (ps_s_ != TD_OK) return ps_s_;  \
  } while (0)

/* ---- the server (rank 0) ---- */

/* What a trainer reports at the end of an epoch (ps_sync); the server adds them up. */
enum rep_field { LOSS_SUM, BATCHES, SAMPLES, TRAIN_S, FIRST, LAST, NFIELDS };

static struct {
  ex_handout model_rref; /* the model's RRef, for the trainers */
  td_module *model;      /* the module inside the RRef's value */
  ex_report_slot slots[MAX_EPOCHS + 1]; /* [0]: start, [e + 1]: end of epoch e */
  ex_reports sync;       /* TRAIN_S: the slowest trainer's, other fields: sums */
} ps;

/* ps_get_model() -> the model RRef (trainers fork it), as soon as the server made it. */
static td_status ps_get_model(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  return ex_handout_get(&ps.model_rref, fut);
}

/* ps_forward(module, x) -> module(x), run in the caller's distributed autograd context. */
static td_status ps_forward(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  void *m;
  td_tensor *x, *y;
  if (n != 2) return td_set_error(TD_ERR_INVALID, "ps_forward: expected (module, x)");
  PS_TRY(psft_check_alive());
  PS_TRY(td_value_as_object(args[0], "nn.Module", &m));
  PS_TRY(td_value_as_tensor(args[1], &x));
  PS_TRY(td_module_forward(m, x, &y));
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return *res ? TD_OK : TD_ERR_NOMEM;
}

/* ps_sync(slot, [NFIELDS numbers]) -> future completed with the test accuracy once every trainer
 * reached slot (0: start, e + 1: end of epoch e) and the server evaluated. */
static td_status ps_sync(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  PS_TRY(psft_check_alive());
  return ex_reports_add(&ps.sync, "ps_sync", args, n, 0, fut);
}

/* trainer_lost (ps_ft's watchdog) fails every meeting point a trainer waits on. */
static void trainer_lost(const char *msg) {
  char m[700];
  snprintf(m, sizeof m, "param_server: %s", msg);
  ex_reports_fail(&ps.sync, m);
}

/* wait_slot blocks the server's main thread until every trainer reached slot. */
static const ex_report_slot *wait_slot(int slot, int trainers) {
  const ex_report_slot *s = ex_reports_wait(&ps.sync, slot, trainers);
  if (!s) psft_die_failed();
  return s;
}

/* The recipe, shared by both sides for the JSON line. */
typedef struct recipe {
  double momentum;
  int nesterov;
  const char *schedule;
  int64_t lr_every;
} recipe;

static int run_server(const ex_args *args, const recipe *rc, int trainers, double t_start) {
  bool flatten = strcmp(args->model, "cnn") != 0;
  td_mnist *test = psx_load_mnist(TD_MNIST_TEST, args->data_dir);
  td_module *model = ps.model;
  fprintf(stderr, "param_server: %s, %lld parameters on the server (%s), %d trainers, batch "
          "%lld, SGD lr %g (%s) momentum %g%s, BLAS threads %d\n",
          args->model, (long long)td_module_num_parameters(model), args->device, trainers,
          (long long)args->batch_size, args->lr, rc->schedule, rc->momentum,
          rc->nesterov ? " (Nesterov)" : "", ex_blas_threads());

  ex_json epoch_acc, epoch_time, epoch_loss;
  ex_json_array(&epoch_acc);
  ex_json_array(&epoch_time);
  ex_json_array(&epoch_loss);
  wait_slot(0, trainers);
  ex_reports_answer(&ps.sync, 0, td_value_double(0));
  double acc = 0, train_s = 0, first_loss = NAN, last_loss = NAN;
  int64_t samples = 0;
  int e0 = (int)psft_resume_epoch();
  for (int e = e0; e < args->epochs; e++) {
    ex_watchdog_note_step(e, -1); /* for the line a lost trainer makes the server print */
    const double *v = wait_slot(e + 1, trainers)->v;
    if (e + 1 == args->epochs) psft_watchdog_stop(); /* the trainers may leave after this sync */
    double mean_loss = v[BATCHES] > 0 ? v[LOSS_SUM] / v[BATCHES] : NAN;
    if (e == e0) first_loss = v[FIRST] / trainers;
    last_loss = v[LAST] / trainers;
    train_s += v[TRAIN_S];
    samples += (int64_t)v[SAMPLES];
    double t0 = ex_now_s();
    acc = psx_evaluate(model, test, flatten);
    fprintf(stderr, "epoch %d: train loss %.4f, test accuracy %.4f (epoch %.2fs, %lld batches, "
            "eval %.1fs)\n", e + 1, mean_loss, acc, v[TRAIN_S], (long long)v[BATCHES],
            ex_now_s() - t0);
    ex_metrics_eval(e + 1, "test_accuracy", acc);
    ex_json_num(&epoch_acc, NULL, acc);
    ex_json_num(&epoch_time, NULL, v[TRAIN_S]);
    ex_json_num(&epoch_loss, NULL, mean_loss);
    ex_reports_answer(&ps.sync, e + 1, td_value_double(acc));
  }
  psft_watchdog_stop();
  if (args->epochs <= e0) acc = psx_evaluate(model, test, flatten);
  int ran = args->epochs > e0 ? args->epochs - e0 : 0;

  ex_json config, results;
  ex_json_object(&config);
  ex_json_str(&config, "model", args->model);
  ex_json_int(&config, "trainers", trainers);
  ex_json_int(&config, "epochs", args->epochs);
  ex_json_int(&config, "batch_size", args->batch_size);
  ex_json_num(&config, "lr", args->lr);
  ex_json_num(&config, "momentum", rc->momentum);
  ex_json_bool(&config, "nesterov", rc->nesterov);
  ex_json_str(&config, "schedule", rc->schedule);
  ex_json_int(&config, "lr_every", rc->lr_every);
  ex_json_int(&config, "seed", (int64_t)args->seed);
  ex_json_int(&config, "max_batches", args->max_batches);
  ex_json_int(&config, "threads", ex_blas_threads());
  ex_json_str(&config, "device", args->device);
  ex_json_int(&config, "parameters", td_module_num_parameters(model));
  ex_json_object(&results);
  ex_json_num(&results, "test_accuracy", acc);
  ex_json_num(&results, "samples_per_s", train_s > 0 ? (double)samples / train_s : 0.0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_int(&results, "epochs", args->epochs);
  ex_json_num(&results, "epoch_wall_s", ran ? train_s / ran : 0.0);
  ex_json_num(&results, "train_s", train_s);
  ex_json_num(&results, "first_loss", first_loss);
  ex_json_num(&results, "last_loss", last_loss);
  ex_json_child(&results, "epoch_test_accuracy", &epoch_acc);
  ex_json_child(&results, "epoch_train_loss", &epoch_loss);
  ex_json_child(&results, "epoch_wall_s_list", &epoch_time);
  ex_json_num(&results, "peak_rss_mb", ex_peak_rss_mb());
  psft_server_results(&results);
  const char *const promote[] = {"test_accuracy", "samples_per_s", "epochs", "wall_s",
                                 "epoch_wall_s", NULL};
  ex_json_print_result("param_server", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
  ex_json_fini(&epoch_acc);
  ex_json_fini(&epoch_time);
  ex_json_fini(&epoch_loss);
  td_mnist_destroy(test);
  return 0;
}

/* ---- trainers (ranks 1..N-1) ---- */

/* sync_call reports at slot to the server and returns the test accuracy it answers. */
static double sync_call(td_rpc_agent *a, int slot, const double v[NFIELDS]) {
  td_value *r = ex_report_send(a, "ps_sync", slot, v, NFIELDS);
  double acc = 0;
  EX_CHECK(td_value_as_double(r, &acc));
  td_value_unref(r);
  return acc;
}

/* train_step runs one batch through the server's model and steps; returns the loss. */
static double train_step(td_rpc_agent *a, td_rref *model, td_dist_optimizer *opt, td_tensor *x,
                         td_tensor *y, ex_phases *ph) {
  double t0 = ex_now_s();
  td_dist_autograd_context *ctx = NULL;
  EX_CHECK(td_dist_autograd_context_begin(a, &ctx));
  td_value *xv = td_value_tensor(x), *r = NULL;
  if (!xv) ex_die("out of memory");
  td_tensor *logits = NULL, *loss = NULL;
  EX_CHECK(td_rref_rpc_sync(model, "ps_forward", &xv, 1, NULL, &r));
  EX_CHECK(td_value_as_tensor(r, &logits));
  EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
  double t1 = ex_now_s();
  EX_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
  double t2 = ex_now_s();
  EX_CHECK(td_dist_optimizer_step(opt, ctx));
  EX_CHECK(td_dist_autograd_context_end_async(ctx, NULL)); /* as PyTorch's context exit */
  ex_phases_add(ph, "forward_s", t1 - t0);
  ex_phases_add(ph, "backward_s", t2 - t1);
  ex_phases_add(ph, "step_s", ex_now_s() - t2);
  double lv;
  EX_CHECK(td_tensor_item(loss, &lv));
  td_tensor_unref(loss);
  td_value_unref(r);
  td_value_unref(xv);
  return lv;
}

/* make_opt creates the SGD distributed optimizer over the parameter RRefs of the model. */
static td_dist_optimizer *make_opt(td_rpc_agent *a, td_value *plist, double lr, const recipe *rc) {
  size_t np = td_value_list_len(plist);
  td_rref **prefs = calloc(np ? np : 1, sizeof *prefs);
  if (!prefs) ex_die("out of memory");
  for (size_t i = 0; i < np; i++) EX_CHECK(td_value_as_rref(td_value_list_get(plist, i), &prefs[i]));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = lr;
  oo.momentum = rc->momentum;
  oo.nesterov = rc->nesterov != 0;
  td_dist_optimizer *opt = NULL;
  EX_CHECK(td_dist_optimizer_create(a, &oo, prefs, np, &opt));
  free(prefs);
  return opt;
}

/* cosine_lr: the rate at the middle of the stretch of lr_every batches holding batch b (cut at
 * the epoch's end), on a cosine from lr to 0 over epochs * nb batches. */
static double cosine_lr(double lr, int epoch, int64_t b, int64_t nb, int epochs, int64_t every) {
  int64_t s0 = b - b % every, s1 = s0 + every < nb ? s0 + every : nb;
  double mid = (double)epoch * nb + 0.5 * (double)(s0 + s1);
  return lr * 0.5 * (1.0 + cos(M_PI * mid / ((double)epochs * nb)));
}

static int run_trainer(td_rpc_agent *a, const ex_args *args, const recipe *rc,
                       const psft_options *fo, int trainers) {
  int tid = td_rpc_rank(a) - 1;
  bool flatten = strcmp(args->model, "cnn") != 0, cosine = !strcmp(rc->schedule, "cosine");
  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);
  td_value *mv = NULL, *plist = NULL;
  td_rref *model = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_get_model", NULL, 0, NULL, &mv));
  EX_CHECK(td_value_as_rref(mv, &model));
  EX_CHECK(td_dist_module_parameter_rrefs(model, TD_TIMEOUT_DEFAULT, &plist));

  int64_t nb;
  td_mnist_loader *loader = psx_shard_loader(train, args, tid, trainers, flatten, &nb);
  ex_losses losses = {0};
  psft_trainer ft;
  psft_trainer_resume(a, fo, tid, nb, &ft); /* where a checkpoint left off, or the beginning */

  sync_call(a, 0, (const double[NFIELDS]){0});
  td_dist_optimizer *opt = make_opt(a, plist, args->lr, rc); /* one for the whole run */
  double lr = args->lr;
  for (int epoch = (int)ft.start_epoch; epoch < args->epochs; epoch++) {
    EX_CHECK(td_mnist_loader_set_epoch(loader, (uint64_t)epoch));
    int64_t b0 = psft_trainer_first_batch(&ft, epoch, td_mnist_loader_sampler(loader));
    ex_progress bar;
    char label[48];
    snprintf(label, sizeof label, "trainer %d epoch %d/%d", tid + 1, epoch + 1, args->epochs);
    if (tid == 0) ex_progress_start(&bar, label, nb);
    double t0 = ex_now_s(), loss_sum = 0;
    int64_t b = b0, samples = 0;
    for (; b < nb; b++) {
      psft_trainer_before_batch(a, &ft, epoch, b);
      td_tensor *x = NULL, *y = NULL;
      EX_CHECK(td_mnist_loader_next(loader, &x, &y));
      if (!x) break;
      if (cosine && (b % rc->lr_every == 0 || b == b0)) {
        lr = cosine_lr(args->lr, epoch, b, nb, args->epochs, rc->lr_every);
        EX_CHECK(td_dist_optimizer_set_lr(opt, lr));
      }
      ex_phases ph = {0};
      double ts = ex_now_s();
      double lv = train_step(a, model, opt, x, y, &ph);
      ex_metrics_step(epoch, (int64_t)epoch * nb + b, lv, lr,
                      (double)td_tensor_size(x, 0) / (ex_now_s() - ts), &ph);
      if (!isfinite(lv))
        ex_die("trainer %d: the loss became %g at epoch %d batch %lld (try a lower --lr)",
               tid + 1, lv, epoch + 1, (long long)b);
      ex_losses_add(&losses, lv);
      loss_sum += lv;
      samples += td_tensor_size(x, 0);
      if (tid == 0) ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1 - b0));
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    double et = ex_now_s() - t0;
    int64_t done = b - b0; /* batches run in this epoch by this process */
    if (tid == 0) ex_progress_finish(&bar, "loss %.4f", done ? loss_sum / (double)done : NAN);
    double rep[NFIELDS] = {[LOSS_SUM] = loss_sum, [BATCHES] = (double)done,
                           [SAMPLES] = (double)samples, [TRAIN_S] = et, [FIRST] = ex_losses_first(&losses),
                           [LAST] = ex_losses_last(&losses)};
    double acc = sync_call(a, epoch + 1, rep);
    if (tid == 0)
      fprintf(stderr, "trainer %d: epoch %d done in %.2fs, test accuracy %.4f\n", tid + 1,
              epoch + 1, et, acc);
  }
  td_dist_optimizer_destroy(opt);
  td_value_unref(plist);
  td_value_unref(mv);
  td_mnist_loader_destroy(loader);
  td_mnist_destroy(train);
  return 0;
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  ex_args a;
  ex_args_init(&a);
  /* per trainer: with the default 2 trainers the server sees 64 samples per step, like
   * train_local's batch (and it reaches 0.88 reliably where 64 per trainer hovers at 0.878-0.882) */
  a.batch_size = 32;
  a.lr = 0.02;
  recipe rc = {.momentum = 0.9, .nesterov = 1, .schedule = "cosine", .lr_every = 50};
  int nproc = 3;
  psft_options fo;
  ex_opt extra[5 + PSFT_NOPTS] = {
      {"momentum", EX_OPT_DOUBLE, &rc.momentum, "SGD momentum"},
      {"nesterov", EX_OPT_INT, &rc.nesterov, "1: Nesterov momentum, 0: plain momentum"},
      {"schedule", EX_OPT_STRING, &rc.schedule, "learning rate: cosine (to 0 over the run) or constant"},
      {"lr-every", EX_OPT_I64, &rc.lr_every, "batches between updates of the cosine schedule"},
      {"nproc", EX_OPT_INT, &nproc, "processes to fork when not started by tdistrun (RANK unset)"},
  };
  psft_options_init(&fo, extra + 5);
  ex_args_parse(argc, argv, &a, extra, 5 + PSFT_NOPTS,
                "param_server: rank 0 holds the model, ranks 1.. train it through RRefs, "
                "distributed autograd and the distributed optimizer (--batch-size is per trainer)");
  if (strcmp(rc.schedule, "cosine") && strcmp(rc.schedule, "constant"))
    ex_die("unknown --schedule '%s' (cosine or constant)", rc.schedule);
  if (strcmp(a.model, "mlp") && strcmp(a.model, "cnn"))
    ex_die("unknown --model '%s' (mlp or cnn)", a.model);
  if (rc.lr_every < 1) ex_die("--lr-every must be >= 1");
  if (rc.nesterov != 0 && rc.nesterov != 1) ex_die("--nesterov must be 0 or 1");
  if (rc.nesterov && rc.momentum <= 0) ex_die("--nesterov 1 needs --momentum > 0 (or --nesterov 0)");
  if (a.epochs > MAX_EPOCHS) ex_die("--epochs must be at most %d", MAX_EPOCHS);
  td_device dev;
  EX_CHECK(td_device_parse(a.device, &dev));
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  psft_options_apply(&fo, &ro);

  psx_spawn_if_alone(nproc); /* before anything initialises CUDA: the children use it too */
  if (!td_device_available(dev)) ex_die("device %s is not available", a.device);
  int rank = atoi(getenv("RANK"));
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  EX_CHECK(td_rpc_register("ps_get_model", ps_get_model, NULL));
  EX_CHECK(td_rpc_register("ps_forward", ps_forward, NULL));
  EX_CHECK(td_rpc_register("ps_sync", ps_sync, NULL));
  psft_register();
  /* trainers' batches arrive on the server's device; the logits come back to their CPU */
  td_rpc_device_map_entry map = {"worker0", "cpu", a.device};
  if (dev.type == TD_DEVICE_CUDA && rank != 0) {
    ro.device_maps = &map;
    ro.num_device_maps = 1;
  }
  ex_handout_init(&ps.model_rref); /* before init: a trainer may ask at once */
  ex_reports_init(&ps.sync, ps.slots, MAX_EPOCHS + 1, NFIELDS, TRAIN_S);
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(name, &ro, &agent));
  int world = td_rpc_world_size(agent);
  if (world < 2) ex_die("param_server needs at least 2 processes (a server and a trainer)");
  int trainers = world - 1, status;
  ex_metrics_open(a.metrics, rank, world, name, "param_server", NULL);
  if (rank == 0) {
    ps.model = psx_make_model(a.model, a.seed);
    EX_CHECK(td_module_to(ps.model, dev));
    psft_server_init(&fo, ps.model, a.model, trainers, a.epochs); /* may load a checkpoint */
    td_value *mv = NULL;
    EX_CHECK(td_value_object("nn.Module", td_module_ref(ps.model), &mv));
    td_rref *r = NULL;
    EX_CHECK(td_rref_create_local(agent, mv, &r));
    td_value_unref(mv);
    ex_handout_publish(&ps.model_rref, td_value_rref(r));
    td_rref_unref(r);
    psft_watchdog_start(agent, &fo, trainer_lost);
    status = run_server(&a, &rc, trainers, t_start);
  } else {
    psft_watchdog_start(agent, &fo, NULL);
    status = run_trainer(agent, &a, &rc, &fo, trainers);
  }
  psft_watchdog_stop(); /* before leaving: a worker that left is not lost */
  ex_handout_fini(&ps.model_rref); /* every trainer is past its last ps_sync */
  ex_metrics_counters(agent);
  ex_metrics_close();
  if (td_rpc_shutdown(agent, true, TD_TIMEOUT_DEFAULT) != TD_OK) {
    fprintf(stderr, "worker%d: shutdown: %s\n", rank, td_last_error());
    if (!status) status = 1;
  }
  ex_reports_fini(&ps.sync);
  td_module_unref(ps.model);
  td_rpc_destroy(agent);
  return psx_wait_children(status);
}
