/* dist_autograd_mlp.c - training steps per second of an MLP split across two workers with
 * distributed autograd and the distributed optimizer.
 *
 * Two workers on 127.0.0.1 (rank 1 forked by rpc_bench_util.h). Rank 1 holds Linear(784, H) +
 * ReLU as an RRef'd module ("nn.Module" object created with td_remote); rank 0 holds
 * Linear(H, 10) and computes the loss (H = --hidden, 512 by default: the step is then mostly the
 * layers' arithmetic; --hidden 8 --batch 1 leaves mostly the RPCs of a step). One step: begin a context; h = module(x) on rank 1
 * (td_rref_rpc_sync); logits = head(h) on rank 0; cross-entropy against fixed labels;
 * td_dist_autograd_backward (the gradient of h travels back to rank 1); distributed SGD step
 * (lr 0.01) on both owners; end the context (cleanup sent to rank 1, not waited for, as PyTorch's
 * context exit does). Batch 64, float32, fixed
 * random data. The PyTorch peer (bench/peers/torch/dist_autograd_mlp.py) does the same with
 * torch.distributed.autograd and DistributedOptimizer.
 *
 * usage: dist_autograd_mlp [--steps N] [--warmup N] [--threads N] [--batch N] [--hidden H]
 * Prints one JSON line (docs/BENCH.md): results.steps_per_s (and ms_per_step, final_loss).
 */
#include <math.h>

#include "rpc_bench_util.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/nn.h"
#include "tdist/rref.h"

static td_status bench_make_mlp1(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                 td_future **fut) {
  td_module *seq, *lin, *relu;
  td_generator *g;
  int64_t hidden = 512;
  if (n > 0 && (td_value_as_int(args[0], &hidden) != TD_OK || hidden < 1))
    return td_set_error(TD_ERR_INVALID, "bench_make_mlp1: the hidden width must be an int >= 1");
  td_status st = td_generator_create(1, &g);
  if (st != TD_OK) return st;
  st = td_sequential_create(&seq);
  if (st == TD_OK) st = td_linear_create(784, hidden, true, g, &lin);
  if (st == TD_OK) st = td_relu_create(&relu);
  if (st == TD_OK) st = td_sequential_append(seq, lin);
  if (st == TD_OK) st = td_sequential_append(seq, relu);
  td_module_unref(lin);
  td_module_unref(relu);
  td_generator_destroy(g);
  if (st == TD_OK) st = td_value_object("nn.Module", seq, res);
  if (st != TD_OK) td_module_unref(seq);
  return st;
}

static td_status bench_forward(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  void *m;
  td_tensor *x, *y;
  td_status st = td_value_as_object(args[0], "nn.Module", &m);
  if (st == TD_OK) st = td_value_as_tensor(args[1], &x);
  if (st == TD_OK) st = td_module_forward(m, x, &y);
  if (st != TD_OK) return st;
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return TD_OK;
}

typedef struct model {
  td_rref *mlp1;
  td_module *head;
  td_dist_optimizer *opt;
  td_value *prefs;
  td_rref *local[2];
} model;

/* time spent in each phase of the measured steps (seconds), reported as ms per step */
static double ph_fwd, ph_head, ph_bwd, ph_opt;

static double step(rb_pair *p, model *m, td_tensor *x, td_tensor *y) {
  uint64_t t0 = rb_now_ns();
  td_dist_autograd_context *ctx;
  RB_CHECK(td_dist_autograd_context_begin(p->agent, &ctx));
  td_value *xv = td_value_tensor(x), *hv;
  RB_CHECK(td_rref_rpc_sync(m->mlp1, "bench_forward", &xv, 1, NULL, &hv));
  uint64_t t1 = rb_now_ns();
  td_tensor *h, *logits, *loss;
  RB_CHECK(td_value_as_tensor(hv, &h));
  RB_CHECK(td_module_forward(m->head, h, &logits));
  RB_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
  uint64_t t2 = rb_now_ns();
  RB_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
  uint64_t t3 = rb_now_ns();
  RB_CHECK(td_dist_optimizer_step(m->opt, ctx));
  uint64_t t4 = rb_now_ns();
  ph_fwd += (double)(t1 - t0) * 1e-9;
  ph_head += (double)(t2 - t1) * 1e-9;
  ph_bwd += (double)(t3 - t2) * 1e-9;
  ph_opt += (double)(t4 - t3) * 1e-9;
  double l = NAN;
  td_tensor_item(loss, &l);
  td_tensor_unref(loss);
  td_tensor_unref(logits);
  td_value_unref(hv);
  td_value_unref(xv);
  /* like PyTorch's context exit, the cleanup is not waited for */
  RB_CHECK(td_dist_autograd_context_end_async(ctx, NULL));
  return l;
}

int main(int argc, char **argv) {
  rb_prog = "dist_autograd_mlp";
  long long steps = 300, warmup = 20, threads = 16, batch = 64, hidden = 512;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--steps") == 0) steps = rb_arg_int("--steps", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--warmup") == 0) warmup = rb_arg_int("--warmup", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--threads") == 0) threads = rb_arg_int("--threads", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--batch") == 0) batch = rb_arg_int("--batch", i + 1 < argc ? argv[++i] : NULL);
    else if (strcmp(argv[i], "--hidden") == 0) hidden = rb_arg_int("--hidden", i + 1 < argc ? argv[++i] : NULL);
    else {
      fprintf(stderr, "usage: dist_autograd_mlp [--steps N] [--warmup N] [--threads N] [--batch N] "
              "[--hidden H]\n");
      return 2;
    }
  }
  if (steps < 1 || threads < 1 || batch < 1 || hidden < 1) {
    fprintf(stderr, "dist_autograd_mlp: --steps, --threads, --batch and --hidden must be >= 1\n");
    return 2;
  }
  RB_CHECK(td_rpc_register("bench_make_mlp1", bench_make_mlp1, NULL));
  RB_CHECK(td_rpc_register("bench_forward", bench_forward, NULL));
  rb_pair p;
  rb_start(&p, (int)threads);
  long long busy_poll_us = (long long)td_rpc_busy_poll_us(p.agent);

  model m = {0};
  td_generator *g;
  RB_CHECK(td_generator_create(2, &g));
  td_value *hv = td_value_int(hidden);
  RB_CHECK(td_remote(p.agent, "worker1", "bench_make_mlp1", &hv, 1, NULL, &m.mlp1));
  td_value_unref(hv);
  RB_CHECK(td_linear_create(hidden, 10, true, g, &m.head));
  RB_CHECK(td_dist_module_parameter_rrefs(m.mlp1, TD_TIMEOUT_DEFAULT, &m.prefs));
  td_rref *refs[4];
  size_t nrefs = 0;
  for (size_t i = 0; i < td_value_list_len(m.prefs); i++)
    RB_CHECK(td_value_as_rref(td_value_list_get(m.prefs, i), &refs[nrefs++]));
  const char *names[2] = {"weight", "bias"};
  for (int i = 0; i < 2; i++) {
    td_value *tv = td_value_tensor(td_module_param(m.head, names[i]));
    RB_CHECK(td_rref_create_local(p.agent, tv, &m.local[i]));
    refs[nrefs++] = m.local[i];
    td_value_unref(tv);
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_SGD);
  oo.lr = 0.01;
  RB_CHECK(td_dist_optimizer_create(p.agent, &oo, refs, nrefs, &m.opt));

  int64_t xs[2] = {batch, 784}, ys[1] = {batch};
  td_tensor *x, *y;
  RB_CHECK(td_tensor_uniform(xs, 2, 0.0, 1.0, TD_DTYPE_F32, td_device_cpu(), g, &x));
  int64_t *labels = malloc((size_t)batch * sizeof *labels);
  for (long long i = 0; i < batch; i++) labels[i] = (int64_t)(td_generator_next_u64(g) % 10);
  RB_CHECK(td_tensor_from_buffer(labels, ys, 1, TD_DTYPE_I64, &y));
  free(labels);

  double loss = 0;
  for (long long i = 0; i < warmup; i++) loss = step(&p, &m, x, y);
  ph_fwd = ph_head = ph_bwd = ph_opt = 0;
  uint64_t t0 = rb_now_ns();
  for (long long i = 0; i < steps; i++) loss = step(&p, &m, x, y);
  double secs = (double)(rb_now_ns() - t0) * 1e-9;

  td_dist_optimizer_destroy(m.opt);
  for (int i = 0; i < 2; i++) td_rref_unref(m.local[i]);
  td_value_unref(m.prefs);
  td_rref_unref(m.mlp1);
  td_module_unref(m.head);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_generator_destroy(g);
  int rc = rb_finish(&p);

  char blas[16];
  printf("{\"bench\": \"dist_autograd_mlp\", \"config\": {\"impl\": \"tdist\", \"world_size\": 2, "
         "\"busy_poll_us\": %lld, \"threads\": %lld, \"batch\": %lld, \"hidden\": %lld, "
         "\"warmup\": %lld, \"steps\": %lld, "
         "\"model\": \"Linear(784,%lld)+ReLU on worker1, Linear(%lld,10) on worker0\", "
         "\"optimizer\": \"SGD lr=0.01\", \"openblas_num_threads\": %s}, "
         "\"results\": {\"steps_per_s\": %.2f, \"ms_per_step\": %.4f, \"final_loss\": %.6f, "
         "\"phase_ms\": {\"forward_rpc\": %.4f, \"head_loss\": %.4f, \"backward\": %.4f, "
         "\"optimizer_step\": %.4f}}}\n",
         busy_poll_us, threads, batch, hidden, warmup, steps, hidden, hidden,
         rb_blas_threads(blas, sizeof blas),
         (double)steps / secs, secs * 1e3 / (double)steps, loss, ph_fwd * 1e3 / (double)steps,
         ph_head * 1e3 / (double)steps, ph_bwd * 1e3 / (double)steps,
         ph_opt * 1e3 / (double)steps);
  fflush(stdout);
  return rc;
}
