/* hybrid.c - data parallelism combined with a parameter server (PyTorch's "Combining Distributed
 * DataParallel with Distributed RPC Framework" example), on Fashion-MNIST, in C.
 *
 *   build/tools/tdistrun --standalone --nproc-per-node 3 build/examples/hybrid --epochs 2
 *   build/examples/hybrid --epochs 2          (forks 3 processes itself when RANK is unset)
 *
 * Rank 0 is the parameter server: it holds the model's first layer, Linear(784, 128) (the role of
 * the embedding table in PyTorch's example: the large, shared, remote part), as an "nn.Module"
 * behind an owner RRef. Ranks 1..N-1 are trainers: each gets the module RRef ("hy_get_module")
 * and makes a RemoteModule handle for it (td_remote_module_from_rref); each holds a replica of the
 * dense head, ReLU-Linear(128, 64)-ReLU-Linear(64, 10), kept equal across trainers by the DDP
 * helper (td_ddp_*) over a trainer-only process group (td_process_group_create with ranks
 * 1..N-1). One distributed optimizer (SGD) per trainer covers both parts: the server's
 * parameters (td_remote_module_parameters) and the head's as local RRefs. Per batch of the
 * trainer's shard, inside a distributed autograd context:
 *   h      = first.forward(x)                     on the server
 *   logits = head(h); loss = cross_entropy(...)    on the trainer
 *   td_dist_autograd_backward(ctx, loss)           gradients reach the server's layer
 *   head gradients averaged across the trainers    td_ddp_sync_gradients on the context's grads
 *   td_dist_optimizer_step(opt, ctx)               server and head step
 * The context's gradients of the head (td_dist_autograd_context_grad_map) are lent to the
 * parameters as .grad, so the DDP helper averages them in place and the distributed optimizer
 * steps the head with the averages, as DDP's hooks do inside a PyTorch distributed autograd
 * context. Each trainer updates the server's layer with its own gradients (as in PyTorch's
 * example). Trainer 1 evaluates the test accuracy after every epoch; at the end the trainers
 * check that their head replicas are bit-identical.
 *
 * --device cuda:N: the server's layer lives on cuda:N (the trainers' device map {worker0, cpu,
 * cuda:N} makes their inputs arrive there, and its outputs and their gradients travel back), and
 * trainer i keeps its head on cuda:((N + i - 1) % device count), averaging gradients over an
 * NCCL group, so it needs a GPU per trainer (on one GPU: --nproc 2).
 *
 * Output: progress on standard error, then rank 0 prints the JSON line (docs/BENCH.md):
 * test_accuracy, samples_per_s, wall_s, epoch_test_accuracy, first_loss / last_loss (mean
 * training loss of the first / last 5 batches over the trainers), replicas_identical.
 *
 * usage: hybrid [--epochs N] [--max-batches N] [--batch-size N] [--lr X] [--momentum X]
 *               [--seed N] [--nproc N] [--data-dir DIR] [--threads N] [--device D]
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
#include "tdist/collectives.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/remote_module.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

#define MAX_EPOCHS 1000
#define NFIELDS 8
#define HY_TRY(expr)                   \
  do {                                 \
    td_status hy_s_ = (expr);          \
    if (hy_s_ != TD_OK) return hy_s_;  \
  } while (0)

/* Report fields (ACC and REPLICAS_DIFFER come from trainer 1 only). */
enum rep_field { ACC, TRAIN_LOSS_SUM, BATCHES, SAMPLES, TRAIN_S, FIRST, LAST, REPLICAS_DIFFER };

/* ---- the server's state (rank 0) ---- */

static ex_handout handout; /* the first layer's RRef, for the trainers */

/* hy_get_module() -> the first layer's RRef as soon as the server made it (a future until
 * then: no pool thread waits). */
static td_status hy_get_module(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  return ex_handout_get(&handout, fut);
}


/* hy_report(slot, [NFIELDS numbers]) records a trainer's figures for epoch slot - 1. */
static ex_report_slot report_slots[MAX_EPOCHS + 1];
static ex_reports reports; /* TRAIN_S: the maximum over trainers, other fields: sums */

static td_status hy_report(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  td_status st = ex_reports_add(&reports, "hy_report", args, n, 1, NULL);
  if (st != TD_OK) return st;
  *res = td_value_none();
  return TD_OK;
}

static const ex_report_slot *wait_report(int slot, int trainers) {
  return ex_reports_wait(&reports, slot, trainers);
}

static int run_server(const ex_args *a, double momentum, int trainers, double t_start) {
  fprintf(stderr, "hybrid: Linear(784, 128) on the server, head 128-64-10 replicated on %d "
          "trainers (DDP), batch %lld per trainer, SGD lr %g momentum %g, device %s, BLAS "
          "threads %d\n", trainers, (long long)a->batch_size, a->lr, momentum, a->device,
          ex_blas_threads());
  ex_json acc_list, loss_list;
  ex_json_array(&acc_list);
  ex_json_array(&loss_list);
  double acc = NAN, train_s = 0, samples = 0, first_loss = NAN, last_loss = NAN, differ = 0;
  for (int e = 0; e < a->epochs; e++) {
    const ex_report_slot *r = wait_report(e + 1, trainers);
    acc = r->v[ACC];
    double mean_loss = r->v[BATCHES] > 0 ? r->v[TRAIN_LOSS_SUM] / r->v[BATCHES] : NAN;
    if (e == 0) first_loss = r->v[FIRST] / trainers;
    last_loss = r->v[LAST] / trainers;
    differ = r->v[REPLICAS_DIFFER];
    train_s += r->v[TRAIN_S];
    samples += r->v[SAMPLES];
    fprintf(stderr, "epoch %d: train loss %.4f, test accuracy %.4f (%.2fs, %.0f batches)\n",
            e + 1, mean_loss, acc, r->v[TRAIN_S], r->v[BATCHES]);
    ex_metrics_eval(e + 1, "test_accuracy", acc);
    ex_json_num(&acc_list, NULL, acc);
    ex_json_num(&loss_list, NULL, mean_loss);
  }
  ex_json config, results;
  ex_json_object(&config);
  ex_json_int(&config, "trainers", trainers);
  ex_json_int(&config, "epochs", a->epochs);
  ex_json_int(&config, "batch_size", a->batch_size);
  ex_json_num(&config, "lr", a->lr);
  ex_json_num(&config, "momentum", momentum);
  ex_json_int(&config, "seed", (int64_t)a->seed);
  ex_json_int(&config, "max_batches", a->max_batches);
  ex_json_int(&config, "threads", ex_blas_threads());
  ex_json_str(&config, "device", a->device);
  ex_json_object(&results);
  ex_json_num(&results, "test_accuracy", acc);
  ex_json_num(&results, "samples_per_s", train_s > 0 ? samples / train_s : 0.0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_int(&results, "epochs", a->epochs);
  ex_json_num(&results, "train_s", train_s);
  ex_json_num(&results, "first_loss", first_loss);
  ex_json_num(&results, "last_loss", last_loss);
  ex_json_bool(&results, "replicas_identical", a->epochs > 0 && differ == 0);
  ex_json_child(&results, "epoch_test_accuracy", &acc_list);
  ex_json_child(&results, "epoch_train_loss", &loss_list);
  ex_json_num(&results, "peak_rss_mb", ex_peak_rss_mb());
  const char *const promote[] = {"test_accuracy", "samples_per_s", "epochs", "wall_s", NULL};
  ex_json_print_result("hybrid", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
  ex_json_fini(&acc_list);
  ex_json_fini(&loss_list);
  return differ == 0 ? 0 : 1;
}

/* ---- trainers (ranks 1..N-1) ---- */

static td_module *make_head(uint64_t seed) {
  td_generator *g = NULL;
  EX_CHECK(td_generator_create(seed, &g));
  td_module *seq = NULL, *m = NULL;
  EX_CHECK(td_sequential_create(&seq));
  EX_CHECK(td_relu_create(&m));
  psx_append(seq, m);
  EX_CHECK(td_linear_create(128, 64, true, g, &m));
  psx_append(seq, m);
  EX_CHECK(td_relu_create(&m));
  psx_append(seq, m);
  EX_CHECK(td_linear_create(64, 10, true, g, &m));
  psx_append(seq, m);
  td_generator_destroy(g);
  return seq;
}

/* The model of a trainer: first (remote) + head (local, on dev), for psx_accuracy. */
typedef struct split_model {
  td_remote_module *first;
  td_module *head;
  td_device dev;
} split_model;

static td_status split_forward(void *ctx, td_tensor *x, td_tensor **logits) {
  split_model *m = ctx;
  td_tensor *h = NULL;
  td_status st = td_remote_module_forward(m->first, x, &h);
  if (st == TD_OK) psx_to_device(&h, m->dev);
  if (st == TD_OK) st = td_module_forward(m->head, h, logits);
  td_tensor_unref(h);
  return st;
}

/* evaluate returns the test accuracy of first (remote) + head (local, on dev). */
static double evaluate(td_remote_module *first, td_module *head, const td_mnist *ds,
                       td_device dev) {
  split_model m = {first, head, dev};
  return psx_accuracy(ds, true, 500, split_forward, &m);
}

/* replicas_differ returns whether the head's parameters differ between the trainers: every
 * member contributes (s, -s) for s = a checksum of its parameters, and after an all_reduce MAX
 * the two agree only when every s was the same. Collective over pg. */
static bool replicas_differ(td_process_group *pg, const td_tensor_list *params, td_device dev) {
  double s = 0;
  for (size_t i = 0; i < params->n; i++) {
    int64_t n = td_tensor_numel(params->tensors[i]);
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (!p) ex_die("out of memory");
    EX_CHECK(td_tensor_copy_to_buffer(params->tensors[i], p, (size_t)n * sizeof *p));
    for (int64_t j = 0; j < n; j++) s += (double)p[j] * (double)(j % 7 + 1);
    free(p);
  }
  double v[2] = {s, -s}, r[2];
  int64_t shape[1] = {2};
  td_tensor *t = NULL;
  EX_CHECK(td_tensor_from_buffer(v, shape, 1, TD_DTYPE_F64, &t));
  psx_to_device(&t, dev);
  EX_CHECK(td_process_group_all_reduce(pg, t, TD_REDUCE_MAX));
  EX_CHECK(td_tensor_copy_to_buffer(t, r, sizeof r));
  bool differ = r[0] != -r[1];
  td_tensor_unref(t);
  return differ;
}

/* train_step runs one batch; returns the loss. */
static double train_step(td_rpc_agent *agent, td_remote_module *first, td_module *head,
                         const td_tensor_list *hp, td_ddp *ddp, td_dist_optimizer *opt,
                         td_tensor *x, td_tensor *y, td_device dev) {
  td_dist_autograd_context *ctx = NULL;
  EX_CHECK(td_dist_autograd_context_begin(agent, &ctx));
  td_tensor *h = NULL, *logits = NULL, *loss = NULL, *yd = td_tensor_ref(y);
  EX_CHECK(td_remote_module_forward(first, x, &h));
  psx_to_device(&h, dev); /* its backward brings the gradient back to the CPU, for the server */
  psx_to_device(&yd, dev);
  EX_CHECK(td_module_forward(head, h, &logits));
  EX_CHECK(td_tensor_cross_entropy(logits, yd, TD_REDUCTION_MEAN, -100, &loss));
  EX_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
  /* Lend the context's head gradients to the parameters: DDP averages them in place. */
  td_grad_map *gm = td_dist_autograd_context_grad_map(ctx);
  for (size_t i = 0; i < hp->n; i++) {
    td_tensor *g = td_grad_map_get(gm, hp->tensors[i]);
    if (!g) ex_die("no gradient for head parameter %zu", i);
    EX_CHECK(td_tensor_set_grad(hp->tensors[i], g));
  }
  EX_CHECK(td_ddp_sync_gradients(ddp));
  EX_CHECK(td_dist_optimizer_step(opt, ctx));
  for (size_t i = 0; i < hp->n; i++) EX_CHECK(td_tensor_set_grad(hp->tensors[i], NULL));
  EX_CHECK(td_dist_autograd_context_end_async(ctx, NULL));
  double lv = 0;
  EX_CHECK(td_tensor_item(loss, &lv));
  td_tensor_unref(loss);
  td_tensor_unref(logits);
  td_tensor_unref(h);
  td_tensor_unref(yd);
  return lv;
}

static int run_trainer(td_rpc_agent *agent, const ex_args *a, double momentum, int trainers,
                       td_device dev) {
  int tid = td_rpc_rank(agent) - 1;
  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, a->data_dir);
  td_mnist *test = tid == 0 ? psx_load_mnist(TD_MNIST_TEST, a->data_dir) : NULL;
  if (dev.type == TD_DEVICE_CUDA) { /* this trainer's own GPU, which its NCCL group uses */
    int count = td_cuda_device_count();
    if (trainers > count)
      ex_die("--device %s: %d trainers need %d GPUs, this machine has %d (use --nproc %d)",
             a->device, trainers, trainers, count, count + 1);
    dev = td_device_cuda((dev.index + tid) % count);
    EX_CHECK(td_cuda_set_device(dev.index));
  }

  /* The trainer-only group and the replicated head. */
  int ranks[64];
  for (int i = 0; i < trainers; i++) ranks[i] = i + 1;
  td_process_group *pg = NULL;
  EX_CHECK(td_process_group_create(agent, ranks, trainers,
                                   dev.type == TD_DEVICE_CUDA ? TD_PG_BACKEND_NCCL
                                                              : TD_PG_BACKEND_CPU,
                                   TD_TIMEOUT_DEFAULT, &pg));
  /* different seeds on purpose: td_ddp_create copies trainer 1's parameters to the others */
  td_module *head = make_head(a->seed + 1 + (uint64_t)tid);
  EX_CHECK(td_module_to(head, dev));
  td_ddp *ddp = NULL;
  EX_CHECK(td_ddp_create(pg, head, 0, &ddp));
  td_tensor_list hp;
  td_tensor_list_init(&hp);
  EX_CHECK(td_module_parameters(head, &hp));

  /* The server's layer and one distributed optimizer over both parts. */
  td_value *mv = NULL, *pr = NULL;
  td_rref *mr = NULL;
  td_remote_module *first = NULL;
  EX_CHECK(td_rpc_sync(agent, "worker0", "hy_get_module", NULL, 0, NULL, &mv));
  EX_CHECK(td_value_as_rref(mv, &mr));
  EX_CHECK(td_remote_module_from_rref(agent, mr, &first));
  EX_CHECK(td_remote_module_parameters(first, &pr));
  size_t np = td_value_list_len(pr) + hp.n, k = 0;
  td_rref **prefs = calloc(np, sizeof *prefs);
  if (!prefs) ex_die("out of memory");
  for (size_t i = 0; i < td_value_list_len(pr); i++, k++) {
    EX_CHECK(td_value_as_rref(td_value_list_get(pr, i), &prefs[k]));
    td_rref_ref(prefs[k]);
  }
  for (size_t i = 0; i < hp.n; i++, k++) {
    td_value *v = td_value_tensor(hp.tensors[i]);
    if (!v) ex_die("out of memory");
    EX_CHECK(td_rref_create_local(agent, v, &prefs[k]));
    td_value_unref(v);
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = a->lr;
  oo.momentum = momentum;
  td_dist_optimizer *opt = NULL;
  EX_CHECK(td_dist_optimizer_create(agent, &oo, prefs, np, &opt));

  int64_t nb; /* the same on every trainer: DDP is collective */
  td_mnist_loader *loader = psx_shard_loader(train, a, tid, trainers, true, &nb);
  ex_losses losses = {0};
  for (int epoch = 0; epoch < a->epochs; epoch++) {
    EX_CHECK(td_mnist_loader_set_epoch(loader, (uint64_t)epoch));
    ex_progress bar;
    char label[48];
    snprintf(label, sizeof label, "trainer %d epoch %d/%d", tid + 1, epoch + 1, a->epochs);
    if (tid == 0) ex_progress_start(&bar, label, nb);
    double t0 = ex_now_s(), loss_sum = 0;
    int64_t b = 0, samples = 0;
    for (; b < nb; b++) {
      td_tensor *x = NULL, *y = NULL;
      EX_CHECK(td_mnist_loader_next(loader, &x, &y));
      if (!x) break;
      double ts = ex_now_s();
      double lv = train_step(agent, first, head, &hp, ddp, opt, x, y, dev);
      if (!isfinite(lv)) ex_die("trainer %d: loss became %g", tid + 1, lv);
      ex_metrics_step(epoch, epoch * nb + b, lv, NAN,
                      (double)td_tensor_size(x, 0) / (ex_now_s() - ts), NULL);
      ex_losses_add(&losses, lv);
      loss_sum += lv;
      samples += td_tensor_size(x, 0);
      if (tid == 0) ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1));
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    double et = ex_now_s() - t0;
    if (tid == 0) ex_progress_finish(&bar, "loss %.4f", b ? loss_sum / (double)b : NAN);
    bool differ = replicas_differ(pg, &hp, dev); /* collective: every trainer, every epoch */
    double rep[NFIELDS] = {0};
    rep[ACC] = tid == 0 ? evaluate(first, head, test, dev) : 0.0;
    rep[TRAIN_LOSS_SUM] = loss_sum;
    rep[BATCHES] = (double)b;
    rep[SAMPLES] = (double)samples;
    rep[TRAIN_S] = et;
    rep[FIRST] = ex_losses_first(&losses);
    rep[LAST] = ex_losses_last(&losses);
    rep[REPLICAS_DIFFER] = tid == 0 && differ ? 1.0 : 0.0;
    td_value_unref(ex_report_send(agent, "hy_report", epoch + 1, rep, NFIELDS));
  }
  td_dist_optimizer_destroy(opt);
  for (size_t i = 0; i < np; i++) td_rref_unref(prefs[i]);
  free(prefs);
  td_value_unref(pr);
  td_remote_module_destroy(first);
  td_value_unref(mv);
  td_tensor_list_fini(&hp);
  td_ddp_destroy(ddp);
  td_module_unref(head);
  td_process_group_destroy(pg);
  td_mnist_loader_destroy(loader);
  td_mnist_destroy(test);
  td_mnist_destroy(train);
  return 0;
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  ex_args a;
  ex_args_init(&a);
  a.omit = "model";
  a.batch_size = 32; /* per trainer */
  a.epochs = 2;
  double momentum = 0.5;
  int nproc = 3;
  const ex_opt extra[] = {
      {"momentum", EX_OPT_DOUBLE, &momentum, "SGD momentum"},
      {"nproc", EX_OPT_INT, &nproc,
       "processes to fork when not started by tdistrun (RANK unset)"},
  };
  ex_args_parse(argc, argv, &a, extra, 2,
                "hybrid: Linear(784, 128) on the parameter server (rank 0) through RemoteModule, "
                "a dense head replicated by DDP on the trainers (--batch-size is per trainer)");
  if (a.epochs < 0 || a.epochs > MAX_EPOCHS) ex_die("--epochs must be in 0..%d", MAX_EPOCHS);
  td_device dev;
  EX_CHECK(td_device_parse(a.device, &dev));

  psx_spawn_if_alone(nproc); /* before anything initialises CUDA: the children use it too */
  if (!td_device_available(dev)) ex_die("device %s is not available", a.device);
  int rank = atoi(getenv("RANK"));
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  EX_CHECK(td_rpc_register("hy_get_module", hy_get_module, NULL));
  ex_handout_init(&handout);
  ex_reports_init(&reports, report_slots, MAX_EPOCHS + 1, NFIELDS, TRAIN_S);
  EX_CHECK(td_rpc_register("hy_report", hy_report, NULL));
  ex_watchdog_register(); /* on by default: a lost worker stops the job (watchdog.h) */
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  /* trainers' inputs arrive on the server's device; its outputs come back to their CPU */
  td_rpc_device_map_entry map = {"worker0", "cpu", a.device};
  if (dev.type == TD_DEVICE_CUDA && rank != 0) {
    ro.device_maps = &map;
    ro.num_device_maps = 1;
  }
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(name, &ro, &agent));
  ex_watchdog_start(agent, NULL);
  int world = td_rpc_world_size(agent);
  if (world < 2 || world > 65) ex_die("hybrid needs 2..65 processes (a server and trainers)");
  int trainers = world - 1;
  ex_metrics_open(a.metrics, rank, world, name, "hybrid", NULL);

  int rc;
  if (rank == 0) {
    td_generator *g = NULL;
    td_module *m = NULL;
    td_value *v = NULL;
    td_rref *r = NULL;
    EX_CHECK(td_generator_create(a.seed, &g));
    EX_CHECK(td_linear_create(784, 128, true, g, &m));
    EX_CHECK(td_module_to(m, dev));
    td_generator_destroy(g);
    EX_CHECK(td_value_object("nn.Module", m, &v));
    EX_CHECK(td_rref_create_local(agent, v, &r));
    td_value_unref(v);
    ex_handout_publish(&handout, td_value_rref(r));
    td_rref_unref(r);
    rc = run_server(&a, momentum, trainers, t_start);
  } else {
    rc = run_trainer(agent, &a, momentum, trainers, dev);
  }
  ex_handout_fini(&handout); /* every trainer reported its last epoch: none asks again */
  ex_metrics_counters(agent);
  ex_metrics_close();
  ex_watchdog_stop(); /* before leaving: a worker that left is not lost */
  if (td_rpc_shutdown(agent, true, TD_TIMEOUT_DEFAULT) != TD_OK) {
    fprintf(stderr, "worker%d: shutdown: %s\n", rank, td_last_error());
    if (!rc) rc = 1;
  }
  td_rpc_destroy(agent);
  return psx_wait_children(rc);
}
