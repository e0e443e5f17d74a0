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
 * distributed optimizer (SGD, Nesterov momentum 0.9), and then, for every batch of its own shard of the
 * training set (a td_sampler over trainer index / number of trainers), inside a distributed
 * autograd context:
 *   logits = rpc(model_rref, "ps_forward", x)      the forward runs on the server
 *   loss   = cross_entropy(logits, y)               on the trainer
 *   td_dist_autograd_backward(ctx, loss)            gradients flow back to the server
 *   td_dist_optimizer_step(opt, ctx)                the server steps with this context's grads
 * Trainers update the shared parameters without locks between them (as in PyTorch's example);
 * the server serialises the optimizer steps. Recipe (both models): SGD with Nesterov momentum 0.9
 * and a learning rate following a cosine from --lr (0.02) down to 0 over the whole run; each
 * trainer keeps one distributed optimizer (its momentum buffers live on the server) and sets the
 * rate at the middle of every stretch of --lr-every batches (default 50) with
 * td_dist_optimizer_set_lr. --schedule constant keeps --lr. After 3 epochs with 2 trainers (test
 * accuracy, over seeds): lr 0.1 with momentum 0.5 gave 0.880 / 0.899-0.903 with the MLP / CNN,
 * lr 0.02 with momentum 0.9 0.879-0.884 / 0.913-0.914, and with Nesterov momentum 0.881-0.886
 * for the MLP.
 *
 * Synchronisation: trainers call "ps_sync" on the server at the start and at the end of every
 * epoch with their statistics; the call's future completes (batch-RPC style, no thread waiting on
 * the server) when every trainer has arrived and, at an epoch's end, the server has evaluated.
 *
 * Output: progress on standard error (trainer 1 draws a bar; the server prints a line per epoch),
 * then rank 0 prints the JSON line (docs/BENCH.md): test_accuracy, samples_per_s, wall_s,
 * epochs, epoch_test_accuracy, epoch_wall_s (mean over epochs of the slowest trainer's training
 * time), first_loss (mean training loss over the first 5 batches of every trainer) and last_loss
 * (over the last 5 batches).
 *
 * Checkpoints (--checkpoint-dir DIR, --checkpoint-every N): a step is one batch of every trainer;
 * the global step before batch b of epoch e is e * batches_per_epoch + b. Every N global steps
 * the trainers meet at a barrier ("ps_ckpt") and the server writes DIR/param_server.safetensors:
 * the model's state dict, with the progress record (epoch, step, batches per epoch, trainers) in
 * the file's metadata, so model and progress change together in one atomic write (temporary file
 * renamed into place). At start (a fresh run or a launcher's restart, TD_RESTART_COUNT > 0) the
 * server loads that file when it exists, and the trainers ("ps_resume") continue from the
 * recorded epoch and step; the JSON line then carries resumed_from_epoch / resumed_from_step /
 * resumed_from_global_step. The optimizer's momentum is not saved: a resumed run restarts it from
 * zero (the learning rate continues on the schedule).
 *
 * Failures: with --keepalive-ms / --keepalive-timeout-ms (or TD_KEEPALIVE_MS /
 * TD_KEEPALIVE_TIMEOUT_MS) the RPC agent uses those keepalive settings and the server pings every
 * trainer at that interval ("ps_ping"); a trainer that stops answering (its host cut off) is
 * declared failed within the keepalive timeout: the server fails every trainer's pending and next
 * call with a message naming it and exits with status 1, so a launcher can restart the group.
 *
 * usage: param_server [--model mlp|cnn] [--epochs N] [--max-batches N] [--batch-size N] [--lr X]
 *                     [--momentum X] [--nesterov 0|1] [--schedule cosine|constant] [--lr-every N]
 *                     [--seed N] [--nproc N]
 *                     [--data-dir DIR] [--threads N] [--checkpoint-dir DIR] [--checkpoint-every N]
 *                     [--keepalive-ms MS] [--keepalive-timeout-ms MS]
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "example_util.h"
#include "ps_common.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

#define LOSS_WINDOW 5
/* PS_TRY returns the status of expr from the enclosing function unless it is TD_OK. */
#define PS_TRY(expr)                   \
  do {                                 \
    td_status ps_s_ = (expr);          \
    if (ps_s_ != TD_OK) return ps_s_;  \
  } while (0)
#define MAX_EPOCHS 1000

/* ---- the server's state (rank 0) ---- */

typedef struct epoch_stats {
  int arrived;
  double loss_sum, first_loss_sum, last_loss_sum, max_train_s;
  int64_t batches, samples;
  td_future *done; /* completed by the server's main thread */
} epoch_stats;

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  td_rref *model_rref;            /* owner handle; NULL before it exists and after training */
  td_module *model;               /* the module inside the RRef's value */
  epoch_stats ep[MAX_EPOCHS + 1]; /* [0]: start barrier, [e + 1]: end of epoch e */
  /* checkpoints (--checkpoint-dir); ckpt_path is NULL without one */
  const char *ckpt_path, *model_kind;
  int trainers;
  int64_t resume_epoch, resume_step, resume_nb; /* from the loaded checkpoint; 0 without */
  int ck_arrived;                               /* trainers at the current ps_ckpt barrier */
  td_future *ck_done;                           /* completed once the checkpoint is written */
  /* failure of a trainer, seen by the watchdog: failed is read without the lock */
  int failed;
  char failed_msg[640];
} ps = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, {{0}}, NULL, NULL, 0,
        0, 0, 0, 0, NULL, 0, {0}};

/* failed_status: TD_OK, or the failure of a trainer (sets td_last_error to its message). */
static td_status failed_status(void) {
  if (!__atomic_load_n(&ps.failed, __ATOMIC_ACQUIRE)) return TD_OK;
  return td_set_error(TD_ERR_UNAVAILABLE, "param_server: %s", ps.failed_msg);
}

/* ps_get_model() -> the model RRef (trainers fork it). Waits up to 60 s for the server to make
 * it (a trainer may ask as soon as the group is up). */
static td_status ps_get_model(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                              td_future **fut) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 60;
  pthread_mutex_lock(&ps.mu);
  while (!ps.model_rref && pthread_cond_timedwait(&ps.cv, &ps.mu, &dl) == 0) {
  }
  td_value *v = ps.model_rref ? td_value_rref(ps.model_rref) : NULL;
  bool ready = ps.model_rref != NULL;
  pthread_mutex_unlock(&ps.mu);
  if (!ready) return td_set_error(TD_ERR_STATE, "ps_get_model: the model is not ready");
  if (!v) return TD_ERR_NOMEM;
  *res = v;
  return TD_OK;
}

/* ps_forward(module, x) -> module(x), run in the caller's distributed autograd context. */
static td_status ps_forward(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  void *m;
  td_tensor *x, *y;
  if (n != 2) return td_set_error(TD_ERR_INVALID, "ps_forward: expected (module, x)");
  PS_TRY(failed_status());
  PS_TRY(td_value_as_object(args[0], "nn.Module", &m));
  PS_TRY(td_value_as_tensor(args[1], &x));
  PS_TRY(td_module_forward(m, x, &y));
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return *res ? TD_OK : TD_ERR_NOMEM;
}

/* ps_sync(slot, loss_sum, batches, samples, train_s, first_loss, last_loss) -> future completed
 * when every trainer reached slot (0: start, e + 1: end of epoch e) with the test accuracy. */
static td_status ps_sync(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  int64_t slot, batches, samples;
  double loss_sum, train_s, first, last;
  if (n != 7) return td_set_error(TD_ERR_INVALID, "ps_sync: expected 7 arguments");
  PS_TRY(td_value_as_int(args[0], &slot));
  PS_TRY(td_value_as_double(args[1], &loss_sum));
  PS_TRY(td_value_as_int(args[2], &batches));
  PS_TRY(td_value_as_int(args[3], &samples));
  PS_TRY(td_value_as_double(args[4], &train_s));
  PS_TRY(td_value_as_double(args[5], &first));
  PS_TRY(td_value_as_double(args[6], &last));
  if (slot < 0 || slot > MAX_EPOCHS) return td_set_error(TD_ERR_INVALID, "ps_sync: bad slot");
  PS_TRY(failed_status());
  pthread_mutex_lock(&ps.mu);
  epoch_stats *e = &ps.ep[slot];
  if (!e->done) e->done = td_future_create();
  if (!e->done) {
    pthread_mutex_unlock(&ps.mu);
    return TD_ERR_NOMEM;
  }
  e->arrived++;
  e->loss_sum += loss_sum;
  e->batches += batches;
  e->samples += samples;
  e->first_loss_sum += first;
  e->last_loss_sum += last;
  if (train_s > e->max_train_s) e->max_train_s = train_s;
  *fut = td_future_ref(e->done);
  pthread_cond_broadcast(&ps.cv);
  pthread_mutex_unlock(&ps.mu);
  return TD_OK;
}

/* ---- checkpoints ---- */

/* meta_int reads the integer metadata key of a checkpoint or dies. */
static int64_t meta_int(const td_safetensors_meta *m, const char *key, const char *path) {
  const char *v = td_safetensors_meta_get(m, key);
  char *end = NULL;
  long long x = v ? strtoll(v, &end, 10) : 0;
  if (!v || end == v || *end) ex_die("checkpoint %s: no integer '%s' in its metadata", path, key);
  return (int64_t)x;
}

/* ckpt_save writes the model and the progress record (the trainers are at epoch, step) to
 * ps.ckpt_path, atomically. Called with every trainer waiting at the ps_ckpt barrier. */
static td_status ckpt_save(int64_t epoch, int64_t step, int64_t nb) {
  td_tensor_list sd = {0};
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  char buf[4][32];
  snprintf(buf[0], sizeof buf[0], "%lld", (long long)epoch);
  snprintf(buf[1], sizeof buf[1], "%lld", (long long)step);
  snprintf(buf[2], sizeof buf[2], "%lld", (long long)nb);
  snprintf(buf[3], sizeof buf[3], "%d", ps.trainers);
  double t0 = ex_now_s();
  td_status s = td_module_state_dict(ps.model, &sd);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "format", "pt");
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.model", ps.model_kind);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.epoch", buf[0]);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.step", buf[1]);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.batches_per_epoch", buf[2]);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.trainers", buf[3]);
  if (s == TD_OK) s = td_safetensors_write(ps.ckpt_path, &sd, &meta);
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
  if (s == TD_OK)
    fprintf(stderr, "param_server: checkpoint at epoch %lld step %lld (global step %lld) -> %s "
            "(%.0f ms)\n", (long long)epoch, (long long)step, (long long)(epoch * nb + step),
            ps.ckpt_path, 1e3 * (ex_now_s() - t0));
  return s;
}

/* ckpt_load loads ps.ckpt_path into ps.model when it exists and records where to resume. */
static void ckpt_load(void) {
  if (access(ps.ckpt_path, F_OK) != 0) return;
  td_tensor_list sd = {0};
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  EX_CHECK(td_safetensors_read(ps.ckpt_path, &sd, &meta));
  const char *kind = td_safetensors_meta_get(&meta, "ps.model");
  if (!kind || strcmp(kind, ps.model_kind))
    ex_die("checkpoint %s holds model '%s', not '%s'", ps.ckpt_path, kind ? kind : "?",
           ps.model_kind);
  int64_t tr = meta_int(&meta, "ps.trainers", ps.ckpt_path);
  if (tr != ps.trainers)
    ex_die("checkpoint %s was made with %lld trainers, this run has %d", ps.ckpt_path,
           (long long)tr, ps.trainers);
  ps.resume_epoch = meta_int(&meta, "ps.epoch", ps.ckpt_path);
  ps.resume_step = meta_int(&meta, "ps.step", ps.ckpt_path);
  ps.resume_nb = meta_int(&meta, "ps.batches_per_epoch", ps.ckpt_path);
  if (ps.resume_epoch < 0 || ps.resume_epoch > MAX_EPOCHS || ps.resume_step < 0)
    ex_die("checkpoint %s: bad progress record", ps.ckpt_path);
  EX_CHECK(td_module_load_state_dict(ps.model, &sd, true));
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
  const char *rc = getenv("TD_RESTART_COUNT");
  fprintf(stderr, "param_server: resuming from checkpoint %s: epoch %lld step %lld (global step "
          "%lld), restart %s\n", ps.ckpt_path, (long long)ps.resume_epoch,
          (long long)ps.resume_step, (long long)(ps.resume_epoch * ps.resume_nb + ps.resume_step),
          rc ? rc : "0");
}

/* ps_resume() -> [epoch, step, batches_per_epoch] the trainers start from ([0, 0, 0]: the
 * beginning). */
static td_status ps_resume(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  td_value *l = td_value_list();
  if (!l) return TD_ERR_NOMEM;
  int64_t v[3] = {ps.resume_epoch, ps.resume_step, ps.resume_nb};
  for (int i = 0; i < 3; i++) {
    td_value *x = td_value_int(v[i]);
    td_status s = x ? td_value_list_append(l, x) : TD_ERR_NOMEM; /* takes x on TD_OK */
    if (s != TD_OK) {
      td_value_unref(x);
      td_value_unref(l);
      return s;
    }
  }
  *res = l;
  return TD_OK;
}

/* ps_ckpt(epoch, step, batches_per_epoch) -> future completed when every trainer arrived and the
 * server wrote the checkpoint (the last one to arrive writes it, on its handler thread, while
 * every trainer waits: nothing changes the parameters meanwhile). */
static td_status ps_ckpt(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  int64_t epoch, step, nb;
  if (n != 3) return td_set_error(TD_ERR_INVALID, "ps_ckpt: expected 3 arguments");
  PS_TRY(td_value_as_int(args[0], &epoch));
  PS_TRY(td_value_as_int(args[1], &step));
  PS_TRY(td_value_as_int(args[2], &nb));
  if (!ps.ckpt_path) return td_set_error(TD_ERR_STATE, "ps_ckpt: no --checkpoint-dir");
  PS_TRY(failed_status());
  pthread_mutex_lock(&ps.mu);
  if (!ps.ck_done) ps.ck_done = td_future_create();
  if (!ps.ck_done) {
    pthread_mutex_unlock(&ps.mu);
    return TD_ERR_NOMEM;
  }
  *fut = td_future_ref(ps.ck_done);
  if (++ps.ck_arrived == ps.trainers) {
    td_status s = ckpt_save(epoch, step, nb);
    if (s == TD_OK) td_future_complete(ps.ck_done, td_value_none());
    else td_future_fail(ps.ck_done, s, "checkpoint: %s", td_last_error());
    td_future_unref(ps.ck_done);
    ps.ck_done = NULL;
    ps.ck_arrived = 0;
  }
  pthread_mutex_unlock(&ps.mu);
  return TD_OK;
}

/* ---- failure detection (--keepalive-ms) ---- */

/* ps_ping() -> none: the server's liveness probe of a trainer. */
static td_status ps_ping(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  *res = td_value_none();
  return *res ? TD_OK : TD_ERR_NOMEM;
}

/* ps_fail records the first failure and fails every barrier a trainer waits on with it. */
static void ps_fail(const char *msg) {
  pthread_mutex_lock(&ps.mu);
  if (!ps.failed) {
    snprintf(ps.failed_msg, sizeof ps.failed_msg, "%s", msg);
    __atomic_store_n(&ps.failed, 1, __ATOMIC_RELEASE);
    for (int i = 0; i <= MAX_EPOCHS; i++)
      if (ps.ep[i].done && !td_future_done(ps.ep[i].done))
        td_future_fail(ps.ep[i].done, TD_ERR_UNAVAILABLE, "param_server: %s", msg);
    if (ps.ck_done) td_future_fail(ps.ck_done, TD_ERR_UNAVAILABLE, "param_server: %s", msg);
  }
  pthread_cond_broadcast(&ps.cv);
  pthread_mutex_unlock(&ps.mu);
}

/* die_failed: the server's exit after a trainer failed. Gives the live trainers a moment to
 * receive the error naming the failed one, then exits with status 1 (at once: a graceful RPC
 * shutdown would wait for the lost trainer). */
_Noreturn static void die_failed(void) {
  fprintf(stderr, "param_server: %s; stopping\n", ps.failed_msg);
  fflush(stderr);
  usleep(1000 * 1000);
  _exit(1);
}

static struct {
  pthread_t thread;
  bool running, stop;
  td_rpc_agent *agent;
  int64_t interval_ms, timeout_ms;
} wd;

/* watchdog pings every trainer each interval; a ping that fails (the agent's keepalive declared
 * the trainer unreachable, or no answer within interval + keepalive timeout) is a failure. */
static void *watchdog(void *arg) {
  (void)arg;
  td_future *f[64];
  for (;;) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += wd.interval_ms / 1000;
    dl.tv_nsec += (wd.interval_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
      dl.tv_sec++;
      dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ps.mu);
    while (!wd.stop && pthread_cond_timedwait(&ps.cv, &ps.mu, &dl) == 0) {
    }
    bool stop = wd.stop;
    pthread_mutex_unlock(&ps.mu);
    if (stop) return NULL;
    td_rpc_call_opts co = {.timeout_ms = wd.interval_ms + wd.timeout_ms};
    int n = ps.trainers < 64 ? ps.trainers : 64;
    for (int r = 0; r < n; r++) {
      char to[32];
      snprintf(to, sizeof to, "worker%d", r + 1);
      f[r] = NULL;
      if (td_rpc_async(wd.agent, to, "ps_ping", NULL, 0, &co, &f[r]) != TD_OK) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s (rank %d) failed: %s", to, r + 1, td_last_error());
        ps_fail(msg);
      }
    }
    for (int r = 0; r < n; r++) {
      if (!f[r]) continue;
      td_future_wait(f[r], -1);
      td_status s = td_future_status(f[r]);
      pthread_mutex_lock(&ps.mu);
      bool stopping = wd.stop;
      pthread_mutex_unlock(&ps.mu);
      if (s != TD_OK && !stopping) {
        char msg[600];
        snprintf(msg, sizeof msg, "worker%d (rank %d) failed: %s", r + 1, r + 1,
                 td_future_message(f[r]));
        ps_fail(msg);
      }
      td_future_unref(f[r]);
    }
  }
}

/* watchdog_stop ends the pings (before the trainers may leave: a trainer that finished and shut
 * down does not answer either). */
static void watchdog_stop(void) {
  if (!wd.running) return;
  pthread_mutex_lock(&ps.mu);
  wd.stop = true;
  pthread_cond_broadcast(&ps.cv);
  pthread_mutex_unlock(&ps.mu);
  pthread_join(wd.thread, NULL);
  wd.running = false;
}

/* wait_slot blocks until every trainer reached slot (dies after 30 minutes, or when a trainer
 * failed). */
static epoch_stats *wait_slot(int slot, int trainers) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 1800;
  pthread_mutex_lock(&ps.mu);
  while (ps.ep[slot].arrived < trainers && !ps.failed)
    if (pthread_cond_timedwait(&ps.cv, &ps.mu, &dl) != 0) ex_die("trainers never reached sync");
  bool failed = ps.failed;
  pthread_mutex_unlock(&ps.mu);
  if (failed) die_failed();
  return &ps.ep[slot];
}

static int run_server(const ex_args *args, int trainers, double momentum, bool nesterov,
                      const char *schedule, int64_t lr_every, double t_start) {
  bool flatten = strcmp(args->model, "cnn") != 0;
  td_mnist *test = psx_load_mnist(TD_MNIST_TEST, args->data_dir);
  td_module *model = ps.model;
  fprintf(stderr, "param_server: %s, %lld parameters on the server, %d trainers, batch %lld, "
          "SGD lr %g (%s) momentum %g%s, BLAS threads %d\n",
          args->model, (long long)td_module_num_parameters(model), trainers,
          (long long)args->batch_size, args->lr, schedule, momentum,
          nesterov ? " (Nesterov)" : "", ex_blas_threads());

  ex_json epoch_acc, epoch_time, epoch_loss;
  ex_json_array(&epoch_acc);
  ex_json_array(&epoch_time);
  ex_json_array(&epoch_loss);
  epoch_stats *st = wait_slot(0, trainers);
  EX_CHECK(td_future_complete(st->done, td_value_double(0)));
  double acc = 0, train_s = 0, first_loss = NAN, last_loss = NAN;
  int64_t samples = 0;
  int e0 = (int)ps.resume_epoch;
  for (int e = e0; e < args->epochs; e++) {
    st = wait_slot(e + 1, trainers);
    if (e + 1 == args->epochs) watchdog_stop(); /* the trainers may leave after this sync */
    double mean_loss = st->batches ? st->loss_sum / (double)st->batches : NAN;
    if (e == e0) first_loss = st->first_loss_sum / trainers;
    last_loss = st->last_loss_sum / trainers;
    train_s += st->max_train_s;
    samples += st->samples;
    double t0 = ex_now_s();
    acc = psx_evaluate(model, test, flatten);
    fprintf(stderr, "epoch %d: train loss %.4f, test accuracy %.4f (epoch %.2fs, %lld batches, "
            "eval %.1fs)\n", e + 1, mean_loss, acc, st->max_train_s, (long long)st->batches,
            ex_now_s() - t0);
    ex_json_num(&epoch_acc, NULL, acc);
    ex_json_num(&epoch_time, NULL, st->max_train_s);
    ex_json_num(&epoch_loss, NULL, mean_loss);
    EX_CHECK(td_future_complete(st->done, td_value_double(acc)));
  }
  watchdog_stop();
  if (args->epochs <= e0) acc = psx_evaluate(model, test, flatten);
  int ran = args->epochs > e0 ? args->epochs - e0 : 0;

  ex_json config, results;
  ex_json_object(&config);
  ex_json_str(&config, "model", args->model);
  ex_json_int(&config, "trainers", trainers);
  ex_json_int(&config, "epochs", args->epochs);
  ex_json_int(&config, "batch_size", args->batch_size);
  ex_json_num(&config, "lr", args->lr);
  ex_json_num(&config, "momentum", momentum);
  ex_json_bool(&config, "nesterov", nesterov);
  ex_json_str(&config, "schedule", schedule);
  ex_json_int(&config, "lr_every", lr_every);
  ex_json_int(&config, "seed", (int64_t)args->seed);
  ex_json_int(&config, "max_batches", args->max_batches);
  ex_json_int(&config, "threads", ex_blas_threads());
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
  if (ps.resume_epoch || ps.resume_step) {
    ex_json_int(&results, "resumed_from_epoch", ps.resume_epoch);
    ex_json_int(&results, "resumed_from_step", ps.resume_step);
    ex_json_int(&results, "resumed_from_global_step",
                ps.resume_epoch * ps.resume_nb + ps.resume_step);
  }
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

/* sync_call runs ps_sync on the server and returns the accuracy it answers. */
static double sync_call(td_rpc_agent *a, int slot, double loss_sum, int64_t batches,
                        int64_t samples, double train_s, double first, double last) {
  td_value *v[7] = {td_value_int(slot),    td_value_double(loss_sum), td_value_int(batches),
                    td_value_int(samples), td_value_double(train_s),  td_value_double(first),
                    td_value_double(last)};
  td_rpc_call_opts co = {.timeout_ms = 0};
  td_value *r = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_sync", v, 7, &co, &r));
  double acc = 0;
  EX_CHECK(td_value_as_double(r, &acc));
  td_value_unref(r);
  for (int i = 0; i < 7; i++) td_value_unref(v[i]);
  return acc;
}

/* train_step runs one batch through the server's model and steps; returns the loss. */
static double train_step(td_rpc_agent *a, td_rref *model, td_dist_optimizer *opt, td_tensor *x,
                         td_tensor *y) {
  td_dist_autograd_context *ctx = NULL;
  EX_CHECK(td_dist_autograd_context_begin(a, &ctx));
  td_value *xv = td_value_tensor(x), *r = NULL;
  if (!xv) ex_die("out of memory");
  td_tensor *logits = NULL, *loss = NULL;
  EX_CHECK(td_rref_rpc_sync(model, "ps_forward", &xv, 1, NULL, &r));
  EX_CHECK(td_value_as_tensor(r, &logits));
  EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
  EX_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
  EX_CHECK(td_dist_optimizer_step(opt, ctx));
  EX_CHECK(td_dist_autograd_context_end_async(ctx, NULL)); /* as PyTorch's context exit */
  double lv;
  EX_CHECK(td_tensor_item(loss, &lv));
  td_tensor_unref(loss);
  td_value_unref(r);
  td_value_unref(xv);
  return lv;
}

/* make_opt creates an SGD distributed optimizer over prefs with learning rate lr. */
static td_dist_optimizer *make_opt(td_rpc_agent *a, td_rref *const *prefs, size_t np, double lr,
                                   double momentum, bool nesterov) {
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = lr;
  oo.momentum = momentum;
  oo.nesterov = nesterov;
  td_dist_optimizer *opt = NULL;
  EX_CHECK(td_dist_optimizer_create(a, &oo, prefs, np, &opt));
  return opt;
}

/* ckpt_call waits at the server's checkpoint barrier before batch step of epoch. */
static void ckpt_call(td_rpc_agent *a, int64_t epoch, int64_t step, int64_t nb) {
  td_value *v[3] = {td_value_int(epoch), td_value_int(step), td_value_int(nb)};
  td_rpc_call_opts co = {.timeout_ms = 0};
  td_value *r = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_ckpt", v, 3, &co, &r));
  td_value_unref(r);
  for (int i = 0; i < 3; i++) td_value_unref(v[i]);
}

static int run_trainer(td_rpc_agent *a, const ex_args *args, int trainers, double momentum,
                       bool nesterov, bool cosine, int64_t lr_every, int64_t ckpt_every) {
  int tid = td_rpc_rank(a) - 1;
  bool flatten = strcmp(args->model, "cnn") != 0;
  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, args->data_dir);

  td_value *mv = NULL, *plist = NULL;
  td_rref *model = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_get_model", NULL, 0, NULL, &mv));
  EX_CHECK(td_value_as_rref(mv, &model));
  EX_CHECK(td_dist_module_parameter_rrefs(model, -1, &plist));
  size_t np = td_value_list_len(plist);
  td_rref **prefs = calloc(np, sizeof *prefs);
  if (!prefs) ex_die("out of memory");
  for (size_t i = 0; i < np; i++)
    EX_CHECK(td_value_as_rref(td_value_list_get(plist, i), &prefs[i]));

  td_sampler_opts so;
  td_sampler_opts_init(&so);
  so.batch_size = args->batch_size;
  so.shuffle = true;
  so.seed = args->seed;
  so.rank = tid;
  so.world = trainers;
  so.even_shards = true;
  td_mnist_loader *loader = NULL;
  EX_CHECK(td_mnist_loader_create(train, &so, flatten, &loader));
  int64_t nb = td_sampler_num_batches(td_mnist_loader_sampler(loader));
  if (args->max_batches > 0 && args->max_batches < nb) nb = args->max_batches;
  double *losses = calloc((size_t)(nb > 0 ? nb : 1), sizeof *losses);
  if (!losses) ex_die("out of memory");

  /* where to start: [epoch, step, batches per epoch] of the server's checkpoint, or zeros */
  int64_t start_epoch = 0, start_step = 0, ck_nb = 0;
  td_value *rv = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_resume", NULL, 0, NULL, &rv));
  EX_CHECK(td_value_as_int(td_value_list_get(rv, 0), &start_epoch));
  EX_CHECK(td_value_as_int(td_value_list_get(rv, 1), &start_step));
  EX_CHECK(td_value_as_int(td_value_list_get(rv, 2), &ck_nb));
  td_value_unref(rv);
  if ((start_epoch || start_step) && (ck_nb != nb || start_step > nb))
    ex_die("trainer %d: the checkpoint has %lld batches per epoch, this run %lld (same "
           "--batch-size and --max-batches needed)", tid + 1, (long long)ck_nb, (long long)nb);
  if (start_epoch || start_step)
    fprintf(stderr, "trainer %d: resuming at epoch %lld step %lld (global step %lld)\n", tid + 1,
            (long long)start_epoch, (long long)start_step,
            (long long)(start_epoch * nb + start_step));
  int64_t start_global = start_epoch * nb + start_step;

  sync_call(a, 0, 0, 0, 0, 0, 0, 0);
  double first = NAN;
  /* one optimizer for the whole run (its momentum buffers live on the server); the schedule
   * changes its rate with td_dist_optimizer_set_lr */
  td_dist_optimizer *opt = make_opt(a, prefs, np, args->lr, momentum, nesterov);
  for (int epoch = (int)start_epoch; epoch < args->epochs; epoch++) {
    EX_CHECK(td_mnist_loader_set_epoch(loader, (uint64_t)epoch));
    int64_t b0 = epoch == start_epoch ? start_step : 0;
    for (int64_t i = 0; i < b0; i++) { /* the batches the checkpoint already holds */
      const int64_t *idx = NULL;
      int64_t cnt = 0;
      EX_CHECK(td_sampler_next(td_mnist_loader_sampler(loader), &idx, &cnt));
    }
    ex_progress bar;
    char label[48];
    snprintf(label, sizeof label, "trainer %d epoch %d/%d", tid + 1, epoch + 1, args->epochs);
    if (tid == 0) ex_progress_start(&bar, label, nb);
    double t0 = ex_now_s(), loss_sum = 0;
    int64_t b = b0, samples = 0;
    for (; b < nb; b++) {
      int64_t g = (int64_t)epoch * nb + b;
      if (ckpt_every > 0 && g > start_global && g % ckpt_every == 0) ckpt_call(a, epoch, b, nb);
      td_tensor *x = NULL, *y = NULL;
      EX_CHECK(td_mnist_loader_next(loader, &x, &y));
      if (!x) break;
      if (cosine && (b % lr_every == 0 || b == b0)) {
        /* the rate at the middle of this stretch of lr_every batches (cut at the epoch's end) */
        int64_t s0 = b - b % lr_every, s1 = s0 + lr_every < nb ? s0 + lr_every : nb;
        double mid = (double)epoch * nb + 0.5 * (double)(s0 + s1);
        double lr = args->lr * 0.5 * (1.0 + cos(M_PI * mid / ((double)args->epochs * nb)));
        EX_CHECK(td_dist_optimizer_set_lr(opt, lr));
      }
      double lv = train_step(a, model, opt, x, y);
      if (!isfinite(lv))
        ex_die("trainer %d: loss became %g at epoch %d batch %lld", tid + 1, lv, epoch + 1,
               (long long)b);
      losses[b - b0] = lv;
      loss_sum += lv;
      samples += td_tensor_size(x, 0);
      if (tid == 0) ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1 - b0));
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    double et = ex_now_s() - t0;
    int64_t done = b - b0; /* batches run in this epoch by this process */
    if (tid == 0) ex_progress_finish(&bar, "loss %.4f", done ? loss_sum / (double)done : NAN);
    int64_t w = done < LOSS_WINDOW ? done : LOSS_WINDOW;
    double f = 0, l = 0;
    for (int64_t i = 0; i < w; i++) {
      f += losses[i];
      l += losses[done - w + i];
    }
    if (epoch == start_epoch) first = w ? f / (double)w : NAN;
    double last = w ? l / (double)w : NAN;
    double acc = sync_call(a, epoch + 1, loss_sum, done, samples, et, first, last);
    if (tid == 0)
      fprintf(stderr, "trainer %d: epoch %d done in %.2fs, test accuracy %.4f\n", tid + 1,
              epoch + 1, et, acc);
  }
  td_dist_optimizer_destroy(opt);
  free(losses);
  free(prefs);
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
  double momentum = 0.9;
  int nesterov = 1;
  const char *schedule = "cosine";
  int nproc = 3;
  int64_t lr_every = 50;
  const char *ckpt_dir = NULL;
  int64_t ckpt_every = 0, keepalive_ms = 0, keepalive_timeout_ms = 0;
  const char *env_ka = getenv("TD_KEEPALIVE_MS"), *env_kt = getenv("TD_KEEPALIVE_TIMEOUT_MS");
  if (env_ka) keepalive_ms = atoll(env_ka);
  if (env_kt) keepalive_timeout_ms = atoll(env_kt);
  const ex_opt extra[] = {
      {"lr-every", EX_OPT_I64, &lr_every,
       "batches between learning-rate updates of the cosine schedule (default 50)"},
      {"momentum", EX_OPT_DOUBLE, &momentum, "SGD momentum (default 0.9)"},
      {"nesterov", EX_OPT_INT, &nesterov, "1: Nesterov momentum (default), 0: plain momentum"},
      {"schedule", EX_OPT_STRING, &schedule,
       "learning rate per epoch: cosine (default) or constant"},
      {"nproc", EX_OPT_INT, &nproc,
       "processes to fork when not started by tdistrun (RANK unset); default 3"},
      {"checkpoint-dir", EX_OPT_STRING, &ckpt_dir,
       "save param_server.safetensors there every --checkpoint-every steps and resume from it "
       "when it exists (default: no checkpoints)"},
      {"checkpoint-every", EX_OPT_I64, &ckpt_every,
       "global steps (batches of every trainer) between checkpoints (default 100 with "
       "--checkpoint-dir)"},
      {"keepalive-ms", EX_OPT_I64, &keepalive_ms,
       "RPC keepalive interval, and the server pings its trainers at it (default: the agent's, "
       "no pings; env TD_KEEPALIVE_MS)"},
      {"keepalive-timeout-ms", EX_OPT_I64, &keepalive_timeout_ms,
       "how long a keepalive may go unanswered before the peer is failed (default: the agent's; "
       "env TD_KEEPALIVE_TIMEOUT_MS)"},
  };
  ex_args_parse(argc, argv, &a, extra, 9,
                "param_server: rank 0 holds the model, ranks 1.. train it through RRefs, "
                "distributed autograd and the distributed optimizer (defaults here: batch size 32 "
                "per trainer, lr 0.02)");
  bool cosine;
  if (!strcmp(schedule, "cosine")) cosine = true;
  else if (!strcmp(schedule, "constant")) cosine = false;
  else ex_die("unknown --schedule '%s' (cosine or constant)", schedule);
  if (strcmp(a.model, "mlp") && strcmp(a.model, "cnn"))
    ex_die("unknown --model '%s' (mlp or cnn)", a.model);
  if (lr_every < 1) ex_die("--lr-every must be >= 1");
  if (nesterov != 0 && nesterov != 1) ex_die("--nesterov must be 0 or 1");
  if (nesterov && momentum <= 0) ex_die("--nesterov 1 needs --momentum > 0 (or --nesterov 0)");
  if (a.epochs < 0 || a.epochs > MAX_EPOCHS) ex_die("--epochs must be in 0..%d", MAX_EPOCHS);
  if (ckpt_every < 0 || keepalive_ms < 0 || keepalive_timeout_ms < 0)
    ex_die("--checkpoint-every, --keepalive-ms and --keepalive-timeout-ms must be >= 0");
  if (ckpt_dir && ckpt_every == 0) ckpt_every = 100;
  if (!ckpt_dir) ckpt_every = 0;

  psx_spawn_if_alone(nproc);
  int rank = atoi(getenv("RANK"));
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  EX_CHECK(td_rpc_register("ps_get_model", ps_get_model, NULL));
  EX_CHECK(td_rpc_register("ps_forward", ps_forward, NULL));
  EX_CHECK(td_rpc_register("ps_sync", ps_sync, NULL));
  EX_CHECK(td_rpc_register("ps_resume", ps_resume, NULL));
  EX_CHECK(td_rpc_register("ps_ckpt", ps_ckpt, NULL));
  EX_CHECK(td_rpc_register("ps_ping", ps_ping, NULL));
  if (rank == 0) ps.model = psx_make_model(a.model, a.seed);

  td_rpc_options ro;
  td_rpc_options_init(&ro);
  if (keepalive_ms > 0) ro.keepalive_ms = keepalive_ms;
  if (keepalive_timeout_ms > 0) ro.keepalive_timeout_ms = keepalive_timeout_ms;
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(name, &ro, &agent));
  int world = td_rpc_world_size(agent);
  if (world < 2) ex_die("param_server needs at least 2 processes (a server and a trainer)");
  int trainers = world - 1;
  char ckpt_path[4096];
  if (rank == 0) { /* before the model RRef exists: no trainer asks ps_resume earlier */
    ps.model_kind = a.model;
    ps.trainers = trainers;
    if (ckpt_dir) {
      if (mkdir(ckpt_dir, 0755) != 0 && errno != EEXIST)
        ex_die("cannot create --checkpoint-dir %s: %s", ckpt_dir, strerror(errno));
      snprintf(ckpt_path, sizeof ckpt_path, "%s/param_server.safetensors", ckpt_dir);
      ps.ckpt_path = ckpt_path;
      ckpt_load();
      if (ps.resume_epoch > a.epochs)
        ex_die("checkpoint %s is at epoch %lld, past --epochs %d", ckpt_path,
               (long long)ps.resume_epoch, a.epochs);
    }
  }

  int rc;
  if (rank == 0) {
    td_value *mv = NULL;
    EX_CHECK(td_value_object("nn.Module", td_module_ref(ps.model), &mv));
    td_rref *r = NULL;
    EX_CHECK(td_rref_create_local(agent, mv, &r));
    td_value_unref(mv);
    pthread_mutex_lock(&ps.mu);
    ps.model_rref = r;
    pthread_cond_broadcast(&ps.cv);
    pthread_mutex_unlock(&ps.mu);
    if (keepalive_ms > 0 || keepalive_timeout_ms > 0) { /* ping the trainers: see watchdog */
      wd.agent = agent;
      wd.interval_ms = ro.keepalive_ms > 0 ? ro.keepalive_ms : 2000;
      wd.timeout_ms = ro.keepalive_timeout_ms > 0 ? ro.keepalive_timeout_ms : 20000;
      if (pthread_create(&wd.thread, NULL, watchdog, NULL) != 0) ex_die("pthread_create failed");
      wd.running = true;
    }
    rc = run_server(&a, trainers, momentum, nesterov != 0, schedule, lr_every, t_start);
    pthread_mutex_lock(&ps.mu); /* every trainer is past its last ps_sync: none asks again */
    ps.model_rref = NULL;
    pthread_mutex_unlock(&ps.mu);
    td_rref_unref(r);
  } else {
    rc = run_trainer(agent, &a, trainers, momentum, nesterov != 0, cosine, lr_every, ckpt_every);
  }
  if (td_rpc_shutdown(agent, true, -1) != TD_OK) {
    fprintf(stderr, "worker%d: shutdown: %s\n", rank, td_last_error());
    if (!rc) rc = 1;
  }
  if (rank == 0) {
    for (int i = 0; i <= MAX_EPOCHS; i++) td_future_unref(ps.ep[i].done);
    td_module_unref(ps.model);
  }
  td_rpc_destroy(agent);
  return psx_wait_children(rc);
}
