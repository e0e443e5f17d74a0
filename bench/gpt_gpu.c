/* gpt_gpu.c - training throughput of GPT-2 124M shapes on one GPU: tokens/s, step time, peak
 * device memory and MFU, llm.c's measure (issue 25's anchor: GPT-2 124M on H100s, about 460k
 * tokens/s per GPU, about 40% of the dense bfloat16 peak).
 *
 * The model is td_gpt_create with GPT-2 124M's shapes (12 layers, width 768, 12 heads, context
 * 1024, vocabulary 50257 padded to 50304, tied embedding / head: 124M parameters), float32
 * weights and AdamW state (master weights) on the device, the forward under autocast (--dtype
 * bf16: cuBLASLt GEMMs and the tensor-core attention in bfloat16, layer norm, softmax and the
 * loss in float32), no activation checkpointing. A step is what nanoGPT's does: zero the
 * gradients, forward with the loss, backward, clip the gradient norm to 1, AdamW (lr 6e-4,
 * weight decay 0.1 on the >= 2-d weights), read the loss. The batch is one fixed [B, T] batch of
 * random tokens (seeded), so the data costs nothing and the loss must fall (a sanity check of the
 * run: first_loss is about ln(50304) = 10.8, last_loss lower). --warmup steps first (cuBLASLt
 * heuristics, the caching allocator's first blocks), then --steps timed ones.
 *
 * MFU as nanoGPT's estimate_mfu (and llm.c) counts it: flops per token 6 N + 12 L H Q T (N the
 * parameters without the position embeddings, L layers, H heads, Q the head size, T the context;
 * the attention term counts the full T x T scores), times tokens per second, over the device's
 * dense bfloat16 peak from peak_tflops() below (null for a device not in the table, or a CPU).
 *
 * Peer: none runs here (Debian's PyTorch has no CUDA); the comparison is with llm.c's published
 * figures (README, "Benchmarks"). The program also runs on the CPU (--device cpu, small shapes)
 * so its code is tested without a GPU.
 *
 * Output (BENCH.md): one JSON line
 *   {"bench": "gpt_gpu", "config": {...}, "results": {"tokens_per_s", "step_s", "peak_device_mb",
 *    "mfu", "flops_per_token", "peak_tflops", "device_name", "first_loss", "last_loss", ...}}
 * Options: --device D (cuda:0), --dtype bf16|f16|f32 (bf16), --batch-size B (16), --steps N (10),
 * --warmup N (3), --n-layer, --n-head, --n-embd, --block-size, --vocab (GPT-2 124M), --seed,
 * --phases (waits for the device after the forward, the backward, the clipping and the step and
 * reports each phase's mean time as "phase_ms": where a step's time goes; the waits cost a little,
 * so tokens_per_s of such a run is not the figure to quote).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/tensor.h"

#define BENCH_PROG "gpt_gpu"
#include "bench_util.h"


/* Dense (no sparsity) bfloat16 tensor-core peaks in TFLOP/s by device name, from NVIDIA's data
 * sheets, whose tables list the sparse figure (twice these) with a footnote:
 *   H100 SXM5 989.4 and H100 PCIe 756 ("NVIDIA H100 Tensor Core GPU" datasheet, 2023:
 *     BF16 Tensor Core 1,979 / 1,513 teraFLOPS with sparsity);
 *   H200 SXM 989 ("NVIDIA H200 Tensor Core GPU" datasheet, 2024: 1,979 with sparsity; the same
 *     GH100 chip and clocks as H100 SXM);
 *   A100 312 ("NVIDIA A100 Tensor Core GPU" datasheet, 2021: BF16 Tensor Core 312 / 624 sparse,
 *     SXM and PCIe alike).
 * Returns NAN for other devices (H100 NVL and others: no figure is claimed). */
static double peak_tflops(const char *name) {
  if (strstr(name, "H200")) return 989.0;
  if (strstr(name, "H100")) {
    if (strstr(name, "PCIe")) return 756.0;
    if (strstr(name, "NVL")) return NAN;
    return 989.4; /* "H100 80GB HBM3", "H100 SXM5 ...": the SXM part */
  }
  if (strstr(name, "A100")) return 312.0;
  return NAN;
}

static void json_num(const char *key, double v, bool comma) {
  if (isfinite(v)) printf("\"%s\": %.6g%s", key, v, comma ? ", " : "");
  else printf("\"%s\": null%s", key, comma ? ", " : "");
}

int main(int argc, char **argv) {
  const char *device = "cuda:0", *dtype = "bf16";
  long long B = 16, steps = 10, warmup = 3, n_layer = 12, n_head = 12, n_embd = 768, T = 1024,
            V = 50304, seed = 1337;
  bool phases = false;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf("usage: gpt_gpu [--device cuda:0] [--dtype bf16|f16|f32] [--batch-size 16] "
             "[--steps 10] [--warmup 3] [--n-layer 12] [--n-head 12] [--n-embd 768] "
             "[--block-size 1024] [--vocab 50304] [--seed 1337] [--phases]\n");
      return 0;
    }
    if (!strcmp(a, "--phases")) {
      phases = true;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "gpt_gpu: %s needs a value\n", a);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--device")) device = v;
    else if (!strcmp(a, "--dtype")) dtype = v;
    else if (!strcmp(a, "--batch-size")) B = bench_arg_int(a, v);
    else if (!strcmp(a, "--steps")) steps = bench_arg_int(a, v);
    else if (!strcmp(a, "--warmup")) warmup = bench_arg_int(a, v);
    else if (!strcmp(a, "--n-layer")) n_layer = bench_arg_int(a, v);
    else if (!strcmp(a, "--n-head")) n_head = bench_arg_int(a, v);
    else if (!strcmp(a, "--n-embd")) n_embd = bench_arg_int(a, v);
    else if (!strcmp(a, "--block-size")) T = bench_arg_int(a, v);
    else if (!strcmp(a, "--vocab")) V = bench_arg_int(a, v);
    else if (!strcmp(a, "--seed")) seed = bench_arg_int(a, v);
    else {
      fprintf(stderr, "gpt_gpu: unknown option %s\n", a);
      return 2;
    }
  }
  td_dtype ac = !strcmp(dtype, "bf16") ? TD_DTYPE_BF16 : !strcmp(dtype, "f16") ? TD_DTYPE_F16
                                                                                : TD_DTYPE_F32;
  if (strcmp(dtype, "bf16") && strcmp(dtype, "f16") && strcmp(dtype, "f32")) {
    fprintf(stderr, "gpt_gpu: --dtype must be bf16, f16 or f32\n");
    return 2;
  }
  if (B < 1 || steps < 1 || n_layer < 1 || n_head < 1 || n_embd < 1 || n_embd % n_head || T < 1 ||
      V < 2) {
    fprintf(stderr, "gpt_gpu: sizes must be positive, n-embd a multiple of n-head\n");
    return 2;
  }
  td_device dev;
  BENCH_CHECK(td_device_parse(device, &dev));
  if (!td_device_available(dev)) {
    fprintf(stderr, "gpt_gpu: device %s is not available\n", device);
    return 1;
  }
  bool gpu = dev.type == TD_DEVICE_CUDA;

  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = V, c.block_size = T, c.n_layer = (int)n_layer, c.n_head = (int)n_head;
  c.n_embd = n_embd;
  td_generator *g;
  BENCH_CHECK(td_generator_create((uint64_t)seed, &g));
  td_module *m;
  BENCH_CHECK(td_gpt_create(&c, g, &m));
  if (gpu) BENCH_CHECK(td_module_to(m, dev));
  if (ac != TD_DTYPE_F32) BENCH_CHECK(td_module_set_autocast(m, true, ac));
  int64_t params = td_module_num_parameters(m);
  int64_t wpe = td_tensor_numel(
      td_module_param(td_module_child(td_module_child(m, "transformer"), "wpe"), "weight"));

  /* AdamW as nanoGPT's configure_optimizers: decay on >= 2-d parameters */
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  BENCH_CHECK(td_module_parameters(m, &ps));
  td_tensor **decay = calloc(ps.n + 1, sizeof *decay), **plain = calloc(ps.n + 1, sizeof *plain);
  if (!decay || !plain) return 1;
  size_t nd = 0, np = 0;
  for (size_t i = 0; i < ps.n; i++) {
    if (td_tensor_ndim(ps.tensors[i]) >= 2) decay[nd++] = ps.tensors[i];
    else plain[np++] = ps.tensors[i];
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_ADAMW);
  oo.lr = 6e-4;
  oo.beta1 = 0.9;
  oo.beta2 = 0.95;
  oo.eps = 1e-8;
  td_optim_group grp[2];
  td_optim_group_init(&grp[0], decay, nd);
  grp[0].weight_decay = 0.1;
  td_optim_group_init(&grp[1], plain, np);
  grp[1].weight_decay = 0.0;
  td_optim *opt;
  BENCH_CHECK(td_optim_create_groups(&oo, grp, 2, &opt));
  free(decay);
  free(plain);
  td_tensor_list_fini(&ps);

  /* one fixed batch of random tokens: x and y = x shifted by one (a next-token task) */
  int64_t shape[2] = {B, T};
  td_tensor *hx, *hy, *x, *y;
  BENCH_CHECK(td_tensor_empty(shape, 2, TD_DTYPE_I64, td_device_cpu(), &hx));
  BENCH_CHECK(td_tensor_empty(shape, 2, TD_DTYPE_I64, td_device_cpu(), &hy));
  int64_t *px = td_tensor_data(hx), *py = td_tensor_data(hy);
  for (int64_t i = 0; i < B * T; i++) px[i] = (int64_t)(td_generator_next_u64(g) % (uint64_t)V);
  for (int64_t i = 0; i < B * T; i++) py[i] = (i + 1) % T ? px[i + 1] : px[i - T + 1];
  BENCH_CHECK(td_tensor_to(hx, dev, &x));
  BENCH_CHECK(td_tensor_to(hy, dev, &y));
  td_generator_destroy(g);

  double first_loss = NAN, last_loss = NAN, t_steps = 0, t_min = INFINITY;
  /* --phases: forward, backward, clipping, step (seconds summed over the timed steps) */
  double ph[4] = {0, 0, 0, 0}, tp = 0, pv;
  for (long long it = 0; it < warmup + steps; it++) {
    if (it == warmup && gpu) BENCH_CHECK(td_cuda_memory_peak(dev.index, true, NULL));
    double t0 = bench_now_s();
    td_optim_zero_grad(opt);
    td_tensor *logits, *loss;
    BENCH_CHECK(td_gpt_forward(m, x, y, &logits, &loss));
    td_tensor_unref(logits); /* the graph keeps what backward needs */
    /* td_tensor_item waits for every kernel queued before it */
#define PHASE(k)                                                                                 \
  if (phases) {                                                                                  \
    BENCH_CHECK(td_tensor_item(loss, &pv));                                                      \
    double tn = bench_now_s();                                                                   \
    if (it >= warmup) ph[k] += tn - (k ? tp : t0);                                               \
    tp = tn;                                                                                     \
  }
    PHASE(0)
    BENCH_CHECK(td_tensor_backward(loss));
    PHASE(1)
    double norm = 0;
    BENCH_CHECK(td_optim_clip_grad_norm(opt, 1.0, 2.0, &norm));
    PHASE(2)
    BENCH_CHECK(td_optim_step(opt));
    PHASE(3)
#undef PHASE
    double v = NAN;
    BENCH_CHECK(td_tensor_item(loss, &v)); /* waits for the step's kernels */
    td_tensor_unref(loss);
    double dt = bench_now_s() - t0;
    if (it == 0) first_loss = v;
    last_loss = v;
    if (it >= warmup) {
      t_steps += dt;
      if (dt < t_min) t_min = dt;
    }
    fprintf(stderr, "step %lld: loss %.4f, %.1f ms%s\n", it, v, dt * 1e3,
            it < warmup ? " (warm-up)" : "");
  }
  double step_s = t_steps / (double)steps;
  double tokens_per_s = (double)(B * T) / step_s;
  double N = (double)(params - wpe);
  double flops_per_token =
      6.0 * N + 12.0 * (double)n_layer * (double)n_head * (double)(n_embd / n_head) * (double)T;
  char name[128] = "cpu";
  size_t peak = 0;
  if (gpu) {
    BENCH_CHECK(td_cuda_device_name(dev.index, name, sizeof name));
    BENCH_CHECK(td_cuda_memory_peak(dev.index, false, &peak));
  }
  double peak_tf = gpu ? peak_tflops(name) : NAN;
  double mfu = flops_per_token * tokens_per_s / (peak_tf * 1e12);
  char devs[32];
  printf("{\"bench\": \"gpt_gpu\", \"config\": {\"impl\": \"tdist\", \"device\": \"%s\", "
         "\"dtype\": \"%s\", \"batch_size\": %lld, \"block_size\": %lld, \"n_layer\": %lld, "
         "\"n_head\": %lld, \"n_embd\": %lld, \"vocab_size\": %lld, \"params\": %lld, "
         "\"steps\": %lld, \"warmup\": %lld, \"activation_checkpointing\": \"none\", "
         "\"seed\": %lld}, \"results\": {",
         td_device_str(dev, devs, sizeof devs), dtype, B, T, n_layer, n_head, n_embd, V,
         (long long)params, steps, warmup, seed);
  json_num("tokens_per_s", tokens_per_s, true);
  json_num("step_s", step_s, true);
  json_num("best_step_s", t_min, true);
  json_num("peak_device_mb", gpu ? (double)peak / 1048576.0 : NAN, true);
  json_num("flops_per_token", flops_per_token, true);
  json_num("achieved_tflops", flops_per_token * tokens_per_s / 1e12, true);
  json_num("peak_tflops", peak_tf, true);
  json_num("mfu", mfu, true);
  json_num("first_loss", first_loss, true);
  json_num("last_loss", last_loss, true);
  if (phases)
    printf("\"phase_ms\": {\"forward\": %.3f, \"backward\": %.3f, \"clip\": %.3f, "
           "\"step\": %.3f}, ",
           ph[0] * 1e3 / (double)steps, ph[1] * 1e3 / (double)steps, ph[2] * 1e3 / (double)steps,
           ph[3] * 1e3 / (double)steps);
  printf("\"device_name\": \"%s\"}}\n", name);
  td_optim_destroy(opt);
  td_tensor_unref(hx);
  td_tensor_unref(hy);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_module_unref(m);
  return isfinite(last_loss) ? 0 : 1;
}
