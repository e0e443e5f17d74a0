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
 * --ft: a lost trainer costs the server one step, not the job. Each trainer's forward call also
 * says which batch of its shard it starts (ps_forward's extra arguments), so the server knows the
 * batches that trainer had finished. The watchdog (in its tolerant mode on the server) reports the
 * loss; the server prints one line (who, at which epoch and step, what is recomputed), takes the
 * lost trainer's remaining batches of that epoch's shard, the one in flight included, and runs
 * them itself (forward, backward and an SGD step of its own on the shared model, as one more
 * trainer would) while the survivors finish theirs; the epoch's barrier then waits for the live
 * trainers only, and its answer re-shards the next epochs over them (the answer carries the
 * sharding: [accuracy, trainers, shard of each trainer]). The JSON adds the losses, the batches
 * recomputed and, per epoch, the batches applied against the batches the epoch's sharding holds
 * (equal: no batch lost). Rank 0 (the server) remains the limit: its loss ends the job.
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
#include <time.h>

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
#define MAX_TRAINERS 63
/* PS_TRY returns the status of expr from the enclosing function unless it is TD_OK. */
#define PS_TRY(expr)                   \
  do {                                 \
    td_status ps_s_ = (expr);          \
    if (ps_s_ != TD_OK) return ps_s_;  \
  } while (0)

/* ---- the server (rank 0) ---- */

/* What a trainer reports at the end of an epoch (ps_sync); the server adds them up. */
enum rep_field { LOSS_SUM, BATCHES, SAMPLES, TRAIN_S, FIRST, LAST, NB, NFIELDS };

/* The recipe, shared by both sides for the JSON line. */
typedef struct recipe {
  double momentum;
  int nesterov;
  const char *schedule;
  int64_t lr_every;
} recipe;

/* cosine_lr: the rate at the middle of the stretch of lr_every batches holding batch b (cut at
 * the epoch's end), on a cosine from lr to 0 over epochs * nb batches. */
static double cosine_lr(double lr, int epoch, int64_t b, int64_t nb, int epochs, int64_t every) {
  int64_t s0 = b - b % every, s1 = s0 + every < nb ? s0 + every : nb;
  double mid = (double)epoch * nb + 0.5 * (double)(s0 + s1);
  return lr * 0.5 * (1.0 + cos(M_PI * mid / ((double)epochs * nb)));
}

static struct {
  ex_handout model_rref; /* the model's RRef, for the trainers */
  td_module *model;      /* the module inside the RRef's value */
  ex_report_slot slots[MAX_EPOCHS + 1]; /* [0]: start, [e + 1]: end of epoch e */
  ex_reports sync;       /* TRAIN_S: the slowest trainer's, other fields: sums */
} ps;

/* --ft: what the server knows of its trainers (psf.mu guards everything but `on`). */
typedef struct lost_work {
  int tid, epoch, shard, n; /* the lost trainer, the epoch, its shard (of n) in that epoch */
  int64_t begin;            /* the first batch not known to be applied (the one in flight) */
} lost_work;

static struct {
  bool on;                     /* --ft */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int trainers;                /* at start */
  bool alive[MAX_TRAINERS];
  int alive_n;
  int shard_of[MAX_TRAINERS];  /* each trainer's shard in the epoch in progress, -1: none */
  int shard_n;                 /* the shards of the epoch in progress */
  int epoch;                   /* the epoch in progress (-1: not started) */
  int64_t at[MAX_TRAINERS];    /* the batch of its shard each trainer last started, -1 */
  int reported[MAX_TRAINERS];  /* the last slot each trainer reported, -1 */
  int arrived[MAX_EPOCHS + 1]; /* reports per slot */
  lost_work todo[MAX_TRAINERS];
  int ntodo;
  int lost;                    /* trainers lost in the run */
  int64_t lost_done[MAX_EPOCHS];   /* batches lost trainers finished before dying, per epoch */
  int64_t recomputed[MAX_EPOCHS];  /* batches the server ran in their place, per epoch */
  int64_t recomputed_samples[MAX_EPOCHS];
  int sharded[MAX_EPOCHS];         /* shards of each epoch */
} psf = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .epoch = -1};

/* ps_get_model() -> the model RRef (trainers fork it), as soon as the server made it. */
static td_status ps_get_model(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  return ex_handout_get(&ps.model_rref, fut);
}

/* ps_forward(module, x[, trainer, epoch, batch]) -> module(x), run in the caller's distributed
 * autograd context; with --ft the trainer also says which batch of its shard it starts. */
static td_status ps_forward(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  void *m;
  td_tensor *x, *y;
  if (n != 2 && n != 5)
    return td_set_error(TD_ERR_INVALID, "ps_forward: expected (module, x[, trainer, epoch, batch])");
  if (n == 5) {
    int64_t t = -1, e = -1, b = -1;
    PS_TRY(td_value_as_int(args[2], &t));
    PS_TRY(td_value_as_int(args[3], &e));
    PS_TRY(td_value_as_int(args[4], &b));
    pthread_mutex_lock(&psf.mu);
    if (psf.on && t >= 0 && t < psf.trainers && e == psf.epoch && b >= 0) psf.at[t] = b;
    pthread_mutex_unlock(&psf.mu);
  }
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
  int64_t t = -1, slot = -1;
  if (n == 3) { /* --ft: (slot, [numbers], trainer) */
    PS_TRY(td_value_as_int(args[2], &t));
    PS_TRY(td_value_as_int(args[0], &slot));
    if (!psf.on || t < 0 || t >= psf.trainers || slot < 0 || slot > MAX_EPOCHS)
      return td_set_error(TD_ERR_INVALID, "ps_sync: bad trainer %lld or slot %lld", (long long)t,
                          (long long)slot);
  }
  PS_TRY(ex_reports_add(&ps.sync, "ps_sync", args, n == 3 ? 2 : n, 0, fut));
  if (n == 3) {
    pthread_mutex_lock(&psf.mu);
    psf.reported[t] = (int)slot;
    psf.arrived[slot]++;
    pthread_cond_broadcast(&psf.cv);
    pthread_mutex_unlock(&psf.mu);
  }
  return TD_OK;
}

/* trainer_lost (ps_ft's watchdog) fails every meeting point a trainer waits on. */
static void trainer_lost(const char *msg) {
  char m[700];
  snprintf(m, sizeof m, "param_server: %s", msg);
  ex_reports_fail(&ps.sync, m);
}

/* ---- --ft on the server: lost trainers ---- */

/* trainer_gone (the watchdog's thread, tolerant mode): trainer rank is lost; its remaining
 * batches of the epoch in progress become the server's work. One line says it all. */
static void trainer_gone(int rank, const char *why) {
  int t = rank - 1;
  pthread_mutex_lock(&psf.mu);
  if (t < 0 || t >= psf.trainers || !psf.alive[t]) {
    pthread_mutex_unlock(&psf.mu);
    return;
  }
  psf.alive[t] = false;
  psf.alive_n--;
  psf.lost++;
  int e = psf.epoch, sh = e >= 0 ? psf.shard_of[t] : -1, n = psf.shard_n, left = psf.alive_n;
  bool mid = sh >= 0 && psf.reported[t] < e + 1; /* it had not reported the epoch's end */
  int64_t b = psf.at[t] < 0 ? 0 : psf.at[t];
  if (mid) {
    psf.todo[psf.ntodo++] = (lost_work){t, e, sh, n, b};
    psf.lost_done[e] += b;
  }
  pthread_cond_broadcast(&psf.cv);
  pthread_mutex_unlock(&psf.mu);
  char where[160];
  if (mid)
    snprintf(where, sizeof where, "at epoch %d step %lld: the server recomputes batches %lld.. of "
             "its shard %d of %d (the one in flight included)", e + 1, (long long)b, (long long)b,
             sh, n);
  else snprintf(where, sizeof where, "%s", e < 0 ? "before training" : "between epochs");
  fprintf(stderr, "param_server: worker%d (rank %d) lost %s; the next epochs are sharded over %d "
          "trainer%s (%s)\n", rank, rank, where, left, left == 1 ? "" : "s", why);
  if (left == 0) ex_die("no trainer left");
}

/* The slot's expected reports: the live trainers and those that reported it before dying. */
static int expected(int slot) {
  int k = 0;
  for (int t = 0; t < psf.trainers; t++) k += psf.alive[t] || psf.reported[t] >= slot;
  return k;
}

static td_optim *server_opt; /* --ft: the server's own SGD for the batches it recomputes */
static td_mnist *server_train;

/* recompute runs the batches [w.begin, end of the shard) of a lost trainer's shard here. */
static void recompute(const ex_args *args, const recipe *rc, const lost_work *w) {
  bool flatten = strcmp(args->model, "cnn") != 0;
  if (!server_train) server_train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);
  if (!server_opt) {
    td_tensor_list ps_list;
    td_tensor_list_init(&ps_list);
    EX_CHECK(td_module_parameters(ps.model, &ps_list));
    td_optim_options oo;
    td_optim_options_init(&oo, TD_OPTIM_SGD);
    oo.lr = args->lr;
    oo.momentum = rc->momentum;
    oo.nesterov = rc->nesterov != 0;
    EX_CHECK(td_optim_create(&oo, ps_list.tensors, ps_list.n, &server_opt));
    td_tensor_list_fini(&ps_list);
  }
  int64_t nb;
  td_mnist_loader *l = psx_shard_loader(server_train, args, w->shard, w->n, flatten, &nb);
  EX_CHECK(td_mnist_loader_set_epoch(l, (uint64_t)w->epoch));
  td_sampler *smp = td_mnist_loader_sampler(l);
  for (int64_t i = 0; i < w->begin && i < nb; i++) { /* the batches the trainer applied */
    const int64_t *idx = NULL;
    int64_t cnt = 0;
    EX_CHECK(td_sampler_next(smp, &idx, &cnt));
  }
  td_device dev = td_tensor_device(td_optim_param(server_opt, 0));
  double t0 = ex_now_s();
  int64_t done = 0, samples = 0;
  for (int64_t b = w->begin; b < nb; b++) {
    td_tensor *x = NULL, *y = NULL, *xd = NULL, *yd = NULL, *logits = NULL, *loss = NULL;
    EX_CHECK(td_mnist_loader_next(l, &x, &y));
    if (!x) break;
    if (!strcmp(rc->schedule, "cosine"))
      EX_CHECK(td_optim_set_lr(server_opt, cosine_lr(args->lr, w->epoch, b, nb, args->epochs,
                                                     rc->lr_every)));
    EX_CHECK(td_tensor_to(x, dev, &xd));
    EX_CHECK(td_tensor_to(y, dev, &yd));
    td_optim_zero_grad(server_opt);
    EX_CHECK(td_module_forward(ps.model, xd, &logits));
    EX_CHECK(td_tensor_cross_entropy(logits, yd, TD_REDUCTION_MEAN, -100, &loss));
    EX_CHECK(td_tensor_backward(loss));
    EX_CHECK(td_optim_step(server_opt));
    samples += td_tensor_size(x, 0);
    done++;
    td_tensor_unref(x), td_tensor_unref(y), td_tensor_unref(xd), td_tensor_unref(yd);
    td_tensor_unref(logits), td_tensor_unref(loss);
  }
  td_optim_zero_grad(server_opt);
  td_mnist_loader_destroy(l);
  pthread_mutex_lock(&psf.mu);
  psf.recomputed[w->epoch] += done;
  psf.recomputed_samples[w->epoch] += samples;
  pthread_mutex_unlock(&psf.mu);
  fprintf(stderr, "param_server: recomputed %lld batches (%lld samples) of worker%d's shard of "
          "epoch %d in %.2f s\n", (long long)done, (long long)samples, w->tid + 1, w->epoch + 1,
          ex_now_s() - t0);
}

/* ft_wait_slot: wait_slot under --ft: the live trainers' reports, running lost work meanwhile. */
static const ex_report_slot *ft_wait_slot(const ex_args *args, const recipe *rc, int slot) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 3600;
  pthread_mutex_lock(&psf.mu);
  for (;;) {
    while (!psf.ntodo && psf.arrived[slot] < expected(slot))
      if (pthread_cond_timedwait(&psf.cv, &psf.mu, &dl) != 0) ex_die("trainers never reported");
    if (!psf.ntodo) break;
    lost_work w = psf.todo[--psf.ntodo];
    pthread_mutex_unlock(&psf.mu);
    recompute(args, rc, &w);
    pthread_mutex_lock(&psf.mu);
  }
  int arrived = psf.arrived[slot];
  pthread_mutex_unlock(&psf.mu);
  const ex_report_slot *s = ex_reports_wait(&ps.sync, slot, arrived);
  if (!s) psft_die_failed();
  return s;
}

/* ft_answer: the answer to slot (the start of epoch `slot`): [accuracy, trainers, shard of each
 * trainer (-1: lost)], the next epoch sharded over the live trainers. */
static td_value *ft_answer(int slot, double acc) {
  td_value *l = td_value_list();
  if (!l) ex_die("out of memory");
  pthread_mutex_lock(&psf.mu);
  psf.shard_n = 0;
  for (int t = 0; t < psf.trainers; t++) {
    psf.shard_of[t] = psf.alive[t] ? psf.shard_n++ : -1;
    psf.at[t] = -1;
  }
  psf.epoch = slot;
  if (slot < MAX_EPOCHS) psf.sharded[slot] = psf.shard_n;
  double v[2] = {acc, psf.shard_n};
  for (int i = 0; i < 2 + psf.trainers; i++) {
    td_value *x = td_value_double(i < 2 ? v[i] : psf.shard_of[i - 2]);
    if (!x || td_value_list_append(l, x) != TD_OK) ex_die("out of memory");
  }
  pthread_mutex_unlock(&psf.mu);
  return l;
}

/* wait_slot blocks the server's main thread until every trainer reached slot. */
static const ex_report_slot *wait_slot(int slot, int trainers) {
  const ex_report_slot *s = ex_reports_wait(&ps.sync, slot, trainers);
  if (!s) psft_die_failed();
  return s;
}

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
  ex_json applied, expect;
  ex_json_array(&applied);
  ex_json_array(&expect);
  if (psf.on) ft_wait_slot(args, rc, 0);
  else wait_slot(0, trainers);
  ex_reports_answer(&ps.sync, 0, psf.on ? ft_answer(0, 0) : td_value_double(0));
  double acc = 0, train_s = 0, first_loss = NAN, last_loss = NAN;
  int64_t samples = 0;
  int e0 = (int)psft_resume_epoch();
  for (int e = e0; e < args->epochs; e++) {
    ex_watchdog_note_step(e, -1); /* for the line a lost trainer makes the server print */
    const ex_report_slot *sl = psf.on ? ft_wait_slot(args, rc, e + 1) : wait_slot(e + 1, trainers);
    const double *v = sl->v;
    int reporters = psf.on ? sl->arrived : trainers;
    if (e + 1 == args->epochs) psft_watchdog_stop(); /* the trainers may leave after this sync */
    double mean_loss = v[BATCHES] > 0 ? v[LOSS_SUM] / v[BATCHES] : NAN;
    if (e == e0) first_loss = v[FIRST] / reporters;
    last_loss = v[LAST] / reporters;
    train_s += v[TRAIN_S];
    samples += (int64_t)v[SAMPLES];
    if (psf.on) { /* every batch of the epoch's sharding applied once, whoever ran it */
      pthread_mutex_lock(&psf.mu);
      samples += psf.recomputed_samples[e];
      ex_json_int(&applied, NULL, (int64_t)v[BATCHES] + psf.lost_done[e] + psf.recomputed[e]);
      ex_json_int(&expect, NULL, (int64_t)psf.sharded[e] * (int64_t)(v[NB] / reporters));
      pthread_mutex_unlock(&psf.mu);
    }
    double t0 = ex_now_s();
    acc = psx_evaluate(model, test, flatten);
    fprintf(stderr, "epoch %d: train loss %.4f, test accuracy %.4f (epoch %.2fs, %lld batches, "
            "eval %.1fs)\n", e + 1, mean_loss, acc, v[TRAIN_S], (long long)v[BATCHES],
            ex_now_s() - t0);
    ex_metrics_eval(e + 1, "test_accuracy", acc);
    ex_json_num(&epoch_acc, NULL, acc);
    ex_json_num(&epoch_time, NULL, v[TRAIN_S]);
    ex_json_num(&epoch_loss, NULL, mean_loss);
    ex_reports_answer(&ps.sync, e + 1, psf.on ? ft_answer(e + 1, acc) : td_value_double(acc));
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
  if (psf.on) {
    int64_t rb = 0;
    for (int e = 0; e < args->epochs && e < MAX_EPOCHS; e++) rb += psf.recomputed[e];
    ex_json_int(&results, "ft_trainers_lost", psf.lost);
    ex_json_int(&results, "ft_batches_recomputed", rb);
    ex_json_int(&results, "ft_trainers_at_end", psf.alive_n);
    ex_json_child(&results, "epoch_batches_applied", &applied);
    ex_json_child(&results, "epoch_batches_expected", &expect);
  }
  const char *const promote[] = {"test_accuracy", "samples_per_s", "epochs", "wall_s",
                                 "epoch_wall_s", NULL};
  ex_json_print_result("param_server", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
  ex_json_fini(&epoch_acc);
  ex_json_fini(&epoch_time);
  ex_json_fini(&epoch_loss);
  ex_json_fini(&applied);
  ex_json_fini(&expect);
  td_optim_destroy(server_opt);
  td_mnist_destroy(server_train);
  td_mnist_destroy(test);
  return 0;
}

/* ---- trainers (ranks 1..N-1) ---- */

/* A trainer's shard: --ft re-shards the epochs over the live trainers (the sync's answer). */
typedef struct shard {
  int index, n; /* this trainer's shard of n (index -1: none) */
  bool shrunk;  /* a trainer was lost: the group cannot end gracefully */
} shard;

/* sync_call reports at slot to the server and returns the test accuracy it answers; with --ft
 * (sh not NULL) it also says which trainer reports and reads the next epoch's sharding. */
static double sync_call(td_rpc_agent *a, int slot, const double v[NFIELDS], int tid, shard *sh) {
  td_value *r = NULL;
  if (!sh) {
    r = ex_report_send(a, "ps_sync", slot, v, NFIELDS);
  } else {
    td_value *args[3] = {td_value_int(slot), td_value_list(), td_value_int(tid)};
    if (!args[0] || !args[1] || !args[2]) ex_die("out of memory");
    for (int i = 0; i < NFIELDS; i++) {
      td_value *x = td_value_double(v[i]);
      if (!x || td_value_list_append(args[1], x) != TD_OK) ex_die("out of memory");
    }
    td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
    co.timeout_ms = TD_TIMEOUT_INFINITE; /* the server may be evaluating or recomputing */
    EX_CHECK(td_rpc_sync(a, "worker0", "ps_sync", args, 3, &co, &r));
    for (int i = 0; i < 3; i++) td_value_unref(args[i]);
  }
  double acc = 0, x = 0;
  if (!sh) {
    EX_CHECK(td_value_as_double(r, &acc));
  } else {
    size_t len = td_value_list_len(r);
    if (len < 2 + (size_t)tid + 1) ex_die("trainer %d: a bad sharding from the server", tid + 1);
    EX_CHECK(td_value_as_double(td_value_list_get(r, 0), &acc));
    EX_CHECK(td_value_as_double(td_value_list_get(r, 1), &x));
    sh->shrunk = sh->shrunk || (int)x < (int)len - 2;
    sh->n = (int)x;
    EX_CHECK(td_value_as_double(td_value_list_get(r, 2 + (size_t)tid), &x));
    sh->index = (int)x;
  }
  td_value_unref(r);
  return acc;
}

/* train_step runs one batch through the server's model and steps; returns the loss. where:
 * NULL, or (with --ft) {trainer, epoch, batch}, told to the server with the forward. */
static double train_step(td_rpc_agent *a, td_rref *model, td_dist_optimizer *opt, td_tensor *x,
                         td_tensor *y, const int64_t *where, ex_phases *ph) {
  double t0 = ex_now_s();
  td_dist_autograd_context *ctx = NULL;
  EX_CHECK(td_dist_autograd_context_begin(a, &ctx));
  td_value *xv[4] = {td_value_tensor(x), NULL, NULL, NULL}, *r = NULL;
  if (!xv[0]) ex_die("out of memory");
  for (int i = 0; where && i < 3; i++)
    if (!(xv[1 + i] = td_value_int(where[i]))) ex_die("out of memory");
  td_tensor *logits = NULL, *loss = NULL;
  EX_CHECK(td_rref_rpc_sync(model, "ps_forward", xv, where ? 4 : 1, NULL, &r));
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
  for (int i = 0; i < 4; i++) td_value_unref(xv[i]);
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


static int run_trainer(td_rpc_agent *a, const ex_args *args, const recipe *rc,
                       const psft_options *fo, int trainers, bool ft_on, bool *shrunk) {
  int tid = td_rpc_rank(a) - 1;
  bool flatten = strcmp(args->model, "cnn") != 0, cosine = !strcmp(rc->schedule, "cosine");
  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);
  td_value *mv = NULL, *plist = NULL;
  td_rref *model = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_get_model", NULL, 0, NULL, &mv));
  EX_CHECK(td_value_as_rref(mv, &model));
  EX_CHECK(td_dist_module_parameter_rrefs(model, TD_TIMEOUT_DEFAULT, &plist));

  int64_t nb;
  shard sh = {tid, trainers, false}, cur = sh;
  td_mnist_loader *loader = psx_shard_loader(train, args, tid, trainers, flatten, &nb);
  ex_losses losses = {0};
  psft_trainer ft;
  psft_trainer_resume(a, fo, tid, nb, &ft); /* where a checkpoint left off, or the beginning */

  sync_call(a, 0, (const double[NFIELDS]){0}, tid, ft_on ? &sh : NULL);
  td_dist_optimizer *opt = make_opt(a, plist, args->lr, rc); /* one for the whole run */
  double lr = args->lr;
  for (int epoch = (int)ft.start_epoch; epoch < args->epochs; epoch++) {
    if (sh.index != cur.index || sh.n != cur.n) { /* --ft: re-sharded over the live trainers */
      td_mnist_loader_destroy(loader);
      loader = psx_shard_loader(train, args, sh.index, sh.n, flatten, &nb);
      cur = sh;
      if (tid == 0 || sh.index == 0)
        fprintf(stderr, "trainer %d: epoch %d on shard %d of %d (%lld batches)\n", tid + 1,
                epoch + 1, sh.index, sh.n, (long long)nb);
    }
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
      const int64_t where[3] = {tid, epoch, b};
      double lv = train_step(a, model, opt, x, y, ft_on ? where : NULL, &ph);
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
                           [LAST] = ex_losses_last(&losses), [NB] = (double)nb};
    double acc = sync_call(a, epoch + 1, rep, tid, ft_on ? &sh : NULL);
    /* the server may leave once it has answered the last sync (at once, without waiting for us,
     * when --ft lost a trainer): its absence is no failure from here on */
    if (epoch + 1 == args->epochs) psft_watchdog_stop();
    if (tid == 0)
      fprintf(stderr, "trainer %d: epoch %d done in %.2fs, test accuracy %.4f\n", tid + 1,
              epoch + 1, et, acc);
  }
  *shrunk = sh.shrunk;
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
  bool ft_on = false;
  psft_options fo;
  ex_opt extra[6 + PSFT_NOPTS] = {
      {"momentum", EX_OPT_DOUBLE, &rc.momentum, "SGD momentum"},
      {"nesterov", EX_OPT_INT, &rc.nesterov, "1: Nesterov momentum, 0: plain momentum"},
      {"schedule", EX_OPT_STRING, &rc.schedule, "learning rate: cosine (to 0 over the run) or constant"},
      {"lr-every", EX_OPT_I64, &rc.lr_every, "batches between updates of the cosine schedule"},
      {"nproc", EX_OPT_INT, &nproc, "processes to fork when not started by tdistrun (RANK unset)"},
      {"ft", EX_OPT_FLAG, &ft_on,
       "a lost trainer does not stop the job: the server recomputes its remaining batches of the "
       "epoch and re-shards the next epochs over the live trainers (under tdistrun add "
       "--tolerate-failures K); the server (rank 0) must live"},
  };
  psft_options_init(&fo, extra + 6);
  ex_args_parse(argc, argv, &a, extra, 6 + PSFT_NOPTS,
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
  if (ft_on && fo.ckpt_dir) ex_die("--ft and --checkpoint-dir do not go together (not yet)");
  td_device dev;
  EX_CHECK(td_device_parse(a.device, &dev));
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  psft_options_apply(&fo, &ro);

  psx_tolerate_failures(ft_on); /* --ft: a lost trainer does not stop the others */
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
  bool shrunk = false; /* --ft: a trainer was lost (the graceful shutdown would wait for it) */
  if (trainers > MAX_TRAINERS) ex_die("at most %d trainers", MAX_TRAINERS);
  psf.on = ft_on;
  psf.trainers = psf.alive_n = trainers;
  for (int t = 0; t < trainers; t++) psf.alive[t] = true, psf.reported[t] = -1, psf.at[t] = -1;
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
    if (ft_on) ex_watchdog_tolerate(trainer_gone);
    psft_watchdog_start(agent, &fo, trainer_lost);
    status = run_server(&a, &rc, trainers, t_start);
    shrunk = psf.lost > 0;
  } else {
    psft_watchdog_start(agent, &fo, NULL);
    status = run_trainer(agent, &a, &rc, &fo, trainers, ft_on, &shrunk);
  }
  psft_watchdog_stop(); /* before leaving: a worker that left is not lost */
  ex_handout_fini(&ps.model_rref); /* every trainer is past its last ps_sync */
  ex_metrics_counters(agent);
  ex_metrics_close();
  if (td_rpc_shutdown(agent, !shrunk, TD_TIMEOUT_DEFAULT) != TD_OK) {
    fprintf(stderr, "worker%d: shutdown: %s\n", rank, td_last_error());
    if (!status) status = 1;
  }
  ex_reports_fini(&ps.sync);
  td_module_unref(ps.model);
  td_rpc_destroy(agent);
  return psx_wait_children(status);
}
