/* train_local.c - train a classifier on Fashion-MNIST in one process.
 *
 * The non-distributed baseline every distributed example is compared against: the library's
 * modules, losses, autograd and optimizer on the CPU (or one GPU with --device cuda).
 *
 *   --model mlp  Linear(784, 256), ReLU, Linear(256, 10)                (default; lr 0.1)
 *   --model cnn  Conv2d(1, 32, 3, pad 1), ReLU, MaxPool2d(2),
 *                Conv2d(32, 64, 3, pad 1), ReLU, MaxPool2d(2), Flatten, Linear(3136, 10)
 *
 * SGD (batch 64, lr 0.1, momentum 0.5, learning rate decayed to 0 along a cosine over the whole
 * run; plain constant-lr SGD ends an epoch at 0.82-0.85 test accuracy for the MLP, in PyTorch as
 * here, because the last steps are noisy), shuffled per epoch with --seed; after each epoch the
 * test accuracy over the 10000 test images. Progress and per-epoch lines go to standard error; the last line
 * of standard output is the JSON result (docs/BENCH.md) with test_accuracy, samples_per_s and
 * epochs under "results" and also at the top level, and first_loss / last_loss (the mean
 * training loss of the first / last 5 batches).
 *
 * usage: train_local [--model mlp|cnn] [--epochs N] [--batch-size N] [--lr X] [--momentum X]
 *                    [--schedule cosine|constant] [--seed N] [--max-batches N] [--data-dir DIR]
 *                    [--threads N] [--device D]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "tdist/autograd.h"
#include "tdist/data.h"
#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/tensor.h"

/* One training run: its parts and what it measured. */
typedef struct run {
  const ex_args *a;
  td_module *model;
  td_optim *opt;
  td_mnist_loader *loader;
  td_device dev;
  int64_t nb; /* batches per epoch */
  bool cosine;
  double train_s, acc, last_loss; /* last_loss: the last epoch's mean */
  int64_t samples;
  ex_losses losses;
  ex_json epoch_acc, epoch_time, epoch_loss;
} run;

/* train_epoch runs one epoch of SGD (learning rate on a cosine over the run when r->cosine). */
static void train_epoch(run *r, int epoch) {
  const ex_args *a = r->a;
  EX_CHECK(td_mnist_loader_set_epoch(r->loader, (uint64_t)epoch));
  td_module_train(r->model, true);
  char label[32];
  snprintf(label, sizeof label, "epoch %d/%d", epoch + 1, a->epochs);
  ex_progress bar;
  ex_progress_start(&bar, label, r->nb);
  double loss_sum = 0;
  int64_t b = 0;
  for (; b < r->nb; b++) {
    double lr = a->lr, ts = ex_now_s();
    if (r->cosine) {
      double done = (double)(epoch * r->nb + b) / (double)(a->epochs * r->nb);
      lr = a->lr * 0.5 * (1.0 + cos(M_PI * done));
      EX_CHECK(td_optim_set_lr(r->opt, lr));
    }
    td_tensor *x = NULL, *y = NULL, *logits = NULL, *loss = NULL;
    EX_CHECK(td_mnist_loader_next(r->loader, &x, &y));
    if (!x) break;
    psx_to_device(&x, r->dev);
    psx_to_device(&y, r->dev);
    td_optim_zero_grad(r->opt);
    double t0 = ex_now_s();
    EX_CHECK(td_module_forward(r->model, x, &logits));
    EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
    double t1 = ex_now_s();
    EX_CHECK(td_tensor_backward(loss));
    double t2 = ex_now_s();
    EX_CHECK(td_optim_step(r->opt));
    double lv;
    EX_CHECK(td_tensor_item(loss, &lv));
    ex_phases ph = {0};
    ex_phases_add(&ph, "forward_s", t1 - t0);
    ex_phases_add(&ph, "backward_s", t2 - t1);
    ex_phases_add(&ph, "step_s", ex_now_s() - t2);
    ex_metrics_step(epoch, epoch * r->nb + b, lv, lr,
                    (double)td_tensor_size(x, 0) / (ex_now_s() - ts), &ph);
    if (!isfinite(lv))
      ex_die("the loss became %g at epoch %d batch %lld (try a lower --lr)", lv, epoch + 1,
             (long long)b);
    loss_sum += lv;
    ex_losses_add(&r->losses, lv);
    r->samples += td_tensor_size(x, 0);
    ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1));
    td_tensor_unref(loss);
    td_tensor_unref(logits);
    td_tensor_unref(x);
    td_tensor_unref(y);
  }
  r->last_loss = b ? loss_sum / (double)b : NAN;
  ex_progress_finish(&bar, "loss %.4f", r->last_loss);
}

static void print_result(run *r, double momentum, const char *schedule, int64_t ntrain,
                         int64_t ntest, double t_start) {
  const ex_args *a = r->a;
  ex_json config, results;
  ex_json_object(&config);
  ex_json_str(&config, "model", a->model);
  ex_json_int(&config, "epochs", a->epochs);
  ex_json_int(&config, "batch_size", a->batch_size);
  ex_json_num(&config, "lr", a->lr);
  ex_json_num(&config, "momentum", momentum);
  ex_json_str(&config, "schedule", schedule);
  ex_json_int(&config, "seed", (int64_t)a->seed);
  ex_json_int(&config, "max_batches", a->max_batches);
  ex_json_str(&config, "device", a->device);
  ex_json_int(&config, "threads", ex_blas_threads());
  ex_json_int(&config, "train_samples", ntrain);
  ex_json_int(&config, "test_samples", ntest);
  ex_json_int(&config, "parameters", td_module_num_parameters(r->model));
  ex_json_object(&results);
  ex_json_num(&results, "test_accuracy", r->acc);
  ex_json_num(&results, "samples_per_s", r->train_s > 0 ? (double)r->samples / r->train_s : 0.0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_int(&results, "epochs", a->epochs);
  ex_json_num(&results, "train_s", r->train_s);
  ex_json_num(&results, "final_train_loss", r->last_loss);
  ex_json_num(&results, "first_loss", ex_losses_first(&r->losses));
  ex_json_num(&results, "last_loss", ex_losses_last(&r->losses));
  ex_json_child(&results, "epoch_test_accuracy", &r->epoch_acc);
  ex_json_child(&results, "epoch_train_loss", &r->epoch_loss);
  ex_json_child(&results, "epoch_train_s", &r->epoch_time);
  ex_json_num(&results, "peak_rss_mb", ex_peak_rss_mb());
  const char *const promote[] = {"test_accuracy", "samples_per_s", "epochs", "wall_s", NULL};
  ex_json_print_result("train_local", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  ex_args a;
  ex_args_init(&a);
  double momentum = 0.5;
  const char *schedule = "cosine";
  const ex_opt extra[] = {
      {"momentum", EX_OPT_DOUBLE, &momentum, "SGD momentum"},
      {"schedule", EX_OPT_STRING, &schedule,
       "learning rate schedule: cosine (decay to 0 over the run) or constant"},
  };
  ex_args_parse(argc, argv, &a, extra, 2,
                "train_local: train an MLP or a CNN on Fashion-MNIST in one process");
  bool cosine;
  if (!strcmp(schedule, "cosine")) cosine = true;
  else if (!strcmp(schedule, "constant")) cosine = false;
  else ex_die("unknown --schedule '%s' (cosine or constant)", schedule);
  bool cnn;
  if (!strcmp(a.model, "mlp")) cnn = false;
  else if (!strcmp(a.model, "cnn")) cnn = true;
  else ex_die("unknown --model '%s' (mlp or cnn)", a.model);
  td_device dev;
  EX_CHECK(td_device_parse(a.device, &dev));
  if (!td_device_available(dev)) ex_die("device %s is not available in this build", a.device);

  td_mnist *train = psx_load_mnist(TD_MNIST_TRAIN, a.data_dir);
  td_mnist *test = psx_load_mnist(TD_MNIST_TEST, a.data_dir);
  bool flatten = !cnn;

  /* Model and optimizer. */
  td_module *model = psx_make_model(a.model, a.seed);
  EX_CHECK(td_module_to(model, dev));
  td_tensor_list params;
  td_tensor_list_init(&params);
  EX_CHECK(td_module_parameters(model, &params));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = a.lr;
  oo.momentum = momentum;
  td_optim *opt = NULL;
  EX_CHECK(td_optim_create(&oo, params.tensors, params.n, &opt));

  int64_t nb;
  td_mnist_loader *loader = psx_shard_loader(train, &a, 0, 1, flatten, &nb); /* all of it */

  fprintf(stderr, "train_local: %s, %lld parameters, %lld train / %lld test samples, batch %lld, "
          "SGD lr %g (%s) momentum %g, device %s, BLAS threads %d\n",
          a.model, (long long)td_module_num_parameters(model), (long long)td_mnist_count(train),
          (long long)td_mnist_count(test), (long long)a.batch_size, a.lr, schedule, momentum,
          a.device, ex_blas_threads());

  ex_metrics_open(a.metrics, 0, 1, "local", "train_local", NULL);
  run r = {.a = &a, .model = model, .opt = opt, .loader = loader, .dev = dev, .nb = nb,
           .cosine = cosine};
  ex_json_array(&r.epoch_acc);
  ex_json_array(&r.epoch_time);
  ex_json_array(&r.epoch_loss);
  for (int epoch = 0; epoch < a.epochs; epoch++) {
    double t0 = ex_now_s();
    train_epoch(&r, epoch);
    double et = ex_now_s() - t0, te0 = ex_now_s();
    r.train_s += et;
    r.acc = psx_evaluate(model, test, flatten);
    fprintf(stderr, "epoch %d: train loss %.4f, test accuracy %.4f (train %.1fs, eval %.1fs)\n",
            epoch + 1, r.last_loss, r.acc, et, ex_now_s() - te0);
    ex_metrics_eval(epoch + 1, "test_accuracy", r.acc);
    ex_json_num(&r.epoch_acc, NULL, r.acc);
    ex_json_num(&r.epoch_time, NULL, et);
    ex_json_num(&r.epoch_loss, NULL, r.last_loss);
  }
  if (a.epochs == 0) r.acc = psx_evaluate(model, test, flatten);
  print_result(&r, momentum, schedule, td_mnist_count(train), td_mnist_count(test), t_start);
  ex_metrics_close();
  ex_json_fini(&r.epoch_acc);
  ex_json_fini(&r.epoch_time);
  ex_json_fini(&r.epoch_loss);
  td_mnist_loader_destroy(loader);
  td_optim_destroy(opt);
  td_tensor_list_fini(&params);
  td_module_unref(model);
  td_mnist_destroy(train);
  td_mnist_destroy(test);
  return 0;
}
