/* train_step.c - time one training step of an MLP 784-256-10 on the CPU.
 *
 * A step is what a training loop does per batch: zero the gradients, forward (Linear, ReLU,
 * Linear), cross-entropy, backward, SGD update. The batch is fixed (random inputs and labels) so
 * only the step is measured. Warm-up steps first, then timed steps. Peer:
 * bench/peers/torch/train_step.py; compare with bench/compare.sh train_step.
 *
 * Output (docs/BENCH.md): one JSON line
 *   {"bench": "train_step", "config": {...}, "results": {"steps_per_s": x, "peak_rss_mb": y, ...}}
 * Options: --batch-size N (64), --hidden N (256), --warmup N (200), --steps N (2000),
 * --lr X (0.01), --seed N (0), --threads N (BLAS threads; default: leave OPENBLAS_NUM_THREADS).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/tensor.h"

#define BENCH_PROG "train_step"
#include "bench_util.h"

void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);


static double peak_rss_mb(void) {
  struct rusage ru;
  return getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0.0;
}

typedef struct step_ctx {
  td_module *model;
  td_optim *opt;
  td_tensor *x, *y;
  double last_loss;
} step_ctx;

static void step(step_ctx *c, bool read_loss) {
  td_tensor *logits = NULL, *loss = NULL;
  td_optim_zero_grad(c->opt);
  BENCH_CHECK(td_module_forward(c->model, c->x, &logits));
  BENCH_CHECK(td_tensor_cross_entropy(logits, c->y, TD_REDUCTION_MEAN, -100, &loss));
  BENCH_CHECK(td_tensor_backward(loss));
  BENCH_CHECK(td_optim_step(c->opt));
  if (read_loss) BENCH_CHECK(td_tensor_item(loss, &c->last_loss));
  td_tensor_unref(loss);
  td_tensor_unref(logits);
}

int main(int argc, char **argv) {
  long long batch = 64, hidden = 256, warmup = 200, steps = 2000, threads = 0;
  unsigned long long seed = 0;
  double lr = 0.01;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf("usage: train_step [--batch-size N] [--hidden N] [--warmup N] [--steps N] "
             "[--lr X] [--seed N] [--threads N]\n");
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "train_step: %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--batch-size")) batch = bench_arg_int(a, v);
    else if (!strcmp(a, "--hidden")) hidden = bench_arg_int(a, v);
    else if (!strcmp(a, "--warmup")) warmup = bench_arg_int(a, v);
    else if (!strcmp(a, "--steps")) steps = bench_arg_int(a, v);
    else if (!strcmp(a, "--seed")) seed = (unsigned long long)bench_arg_int(a, v);
    else if (!strcmp(a, "--threads")) threads = bench_arg_int(a, v);
    else if (!strcmp(a, "--lr")) lr = atof(v);
    else {
      fprintf(stderr, "train_step: unknown option %s\n", a);
      return 2;
    }
  }
  if (batch < 1 || hidden < 1 || steps < 1) {
    fprintf(stderr, "train_step: --batch-size, --hidden and --steps must be >= 1\n");
    return 2;
  }
  if (threads > 0) openblas_set_num_threads((int)threads);

  /* Model: Sequential(Linear(784, hidden), ReLU, Linear(hidden, 10)). */
  td_generator *g = NULL;
  BENCH_CHECK(td_generator_create(seed, &g));
  td_module *model = NULL, *fc1 = NULL, *relu = NULL, *fc2 = NULL;
  BENCH_CHECK(td_sequential_create(&model));
  BENCH_CHECK(td_linear_create(784, hidden, true, g, &fc1));
  BENCH_CHECK(td_relu_create(&relu));
  BENCH_CHECK(td_linear_create(hidden, 10, true, g, &fc2));
  BENCH_CHECK(td_sequential_append(model, fc1));
  BENCH_CHECK(td_sequential_append(model, relu));
  BENCH_CHECK(td_sequential_append(model, fc2));
  td_module_unref(fc1);
  td_module_unref(relu);
  td_module_unref(fc2);

  td_tensor_list params;
  td_tensor_list_init(&params);
  BENCH_CHECK(td_module_parameters(model, &params));
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = lr;
  td_optim *opt = NULL;
  BENCH_CHECK(td_optim_create(&oo, params.tensors, params.n, &opt));

  /* A fixed batch: x ~ N(0, 1), y uniform over the 10 classes. */
  int64_t xs[2] = {batch, 784};
  td_tensor *x = NULL, *y = NULL;
  BENCH_CHECK(td_tensor_normal(xs, 2, 0.0, 1.0, TD_DTYPE_F32, td_device_cpu(), g, &x));
  int64_t *labels = malloc((size_t)batch * sizeof *labels);
  if (!labels) return 1;
  for (long long i = 0; i < batch; i++) labels[i] = (int64_t)(td_generator_next_u64(g) % 10);
  int64_t ys[1] = {batch};
  BENCH_CHECK(td_tensor_from_buffer(labels, ys, 1, TD_DTYPE_I64, &y));
  free(labels);

  step_ctx c = {model, opt, x, y, 0.0};
  for (long long i = 0; i < warmup; i++) step(&c, false);
  double t0 = bench_now_s();
  for (long long i = 0; i < steps; i++) step(&c, i == steps - 1);
  double wall = bench_now_s() - t0;

  /* OPENBLAS_NUM_THREADS as set by the caller (a number, or null when unset or not a number). */
  const char *env = getenv("OPENBLAS_NUM_THREADS");
  char env_threads[32] = "null";
  if (env && *env && strspn(env, "0123456789") == strlen(env) && strlen(env) < 10)
    snprintf(env_threads, sizeof env_threads, "%s", env);
  printf("{\"bench\": \"train_step\", \"config\": {\"impl\": \"tdist\", "
         "\"model\": \"mlp 784-%lld-10\", \"batch_size\": %lld, \"warmup_steps\": %lld, "
         "\"steps\": %lld, \"lr\": %g, \"threads\": %d, \"openblas_num_threads\": %s}, "
         "\"results\": {\"steps_per_s\": %.3f, \"step_us\": %.3f, \"wall_s\": %.4f, "
         "\"final_loss\": %.6g, \"peak_rss_mb\": %.2f}}\n",
         hidden, batch, warmup, steps, lr, openblas_get_num_threads(), env_threads,
         (double)steps / wall, wall / (double)steps * 1e6, wall, c.last_loss, peak_rss_mb());
  fflush(stdout);

  td_tensor_unref(x);
  td_tensor_unref(y);
  td_optim_destroy(opt);
  td_tensor_list_fini(&params);
  td_module_unref(model);
  td_generator_destroy(g);
  return 0;
}
