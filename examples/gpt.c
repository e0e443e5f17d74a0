/* gpt.c - a character-level GPT trained in one process: nanoGPT's small CPU recipe on the
 * fortunes corpus that Debian's `fortunes` package installs, with sampling from checkpoints.
 *
 *   build/examples/gpt [--steps 2000] [--batch-size 12] [--threads 1] [--save ckpt.safetensors]
 *                      [--device cpu|cuda|cuda:N] [--dtype f32|f64|bf16|f16]
 *   build/examples/gpt --load ckpt.safetensors --generate 500 [--prompt TEXT] [--top-k 20]
 *
 * Data: every regular file of --corpus (default /usr/share/games/fortunes; names ending in .dat
 * and symlinks skipped) in byte order of the names, cleaned byte by byte: a "%" line (the
 * separator between fortunes) becomes an empty line, a backspace deletes itself and the
 * character before it (the overstrike markup of a few files), and only newline, tab and
 * printable ASCII are kept. The vocabulary is the set of remaining bytes (sorted); the first 90%
 * of the text trains, the rest validates. A batch is --batch-size windows of --block-size tokens
 * starting at next_u64() % (len - block_size) of a td_generator seeded with --seed + 1 (one
 * stream for the run); every evaluation reseeds one with --seed + 2 and averages the loss of
 * --eval-iters batches of each split, so all evaluations see the same batches. The weights are
 * initialised from a generator seeded with --seed, or loaded with --init.
 *
 * Model and recipe: td_gpt_create (4 layers, 4 heads, width 128, context 64, tied embedding /
 * head), AdamW (lr 1e-3, betas (0.9, 0.99), eps 1e-8) with weight decay 0.1 on the parameters of
 * two or more dims and none on biases and LayerNorm, nanoGPT's warmup (100 steps) + cosine
 * schedule down to 1e-4 at the last step, gradient norm clipped to 1.0.
 *
 * bench/peers/torch/gpt.py is the same program in PyTorch (same cleaning, the same generator
 * reimplemented, the weights of `gpt --steps 0 --save FILE` through --init), and
 * bench/compare.sh gpt runs the two side by side. Both print results.batch_hash, a hash of
 * every training batch offset, so a comparison can check that they saw the same data.
 *
 * Data parallel: --nproc N (or a launcher's RANK/WORLD_SIZE: tdistrun, srun, mpirun) trains N
 * replicas, each on its own batch stream (seed + 1 + rank), a global batch of N x --batch-size;
 * --dp picks how they agree: "ddp" (td_ddp with backward overlap: bucket all_reduces start from
 * gradient hooks), "zero1" or "zero2" (td_zero: each rank keeps the AdamW state of one shard of
 * the parameters; zero2 reduce_scatters gradient buckets from hooks during backward, at most
 * --zero-inflight-mb of them in flight, unless --zero-after-backward) or "zero3" (zero2 and each
 * block's parameters sharded too: gathered before the block's forward and backward, freed after,
 * the next block's prefetched; every rank then runs the evaluations, which gather too). Rank 0
 * evaluates, prints and saves; its JSON adds every rank's peak RSS, the
 * DDP counters (the share of gradient bytes whose all_reduce started before backward ended) or
 * the ZeRO shard sizes.
 *
 * --activation-checkpointing full|selective (td_gpt_set_activation_checkpointing): every block
 * keeps only its input and runs again in backward, or every attention core is recomputed; the
 * training is the same bits (results.losses_hash hashes every step's loss). In one process the
 * JSON adds the activation memory measured by probes before training (see activation_probe): the
 * model's peak over a forward + backward, one block's, the head's, and with full checkpointing
 * the formula (stored block inputs + the larger of one block's and the head's peak) and the ratio.
 * Gradient accumulation: --grad-accum K makes each optimizer step K micro-batches of
 * --batch-size windows, drawn one after the other from the batch stream, so a step sees exactly
 * the windows of a run with K x --batch-size (the same batch_hash, and losses equal to rounding);
 * each micro-batch's loss is divided by K (the caller's share of the convention, as in PyTorch)
 * and the replicas reduce once per step: DDP and ZeRO stages 2/3 run the first K-1 backward
 * passes under td_ddp_no_sync / td_zero_no_sync (gradients kept in the buckets), ZeRO-1 lets
 * .grad accumulate. Evaluations draw their batches the same way (K micro-batches per batch).
 * tokens_per_s counts every micro-batch.
 *
 * Loss scaling: --loss-scale dynamic (td_grad_scaler: init --loss-scale-init, 65536; doubled after
 * --loss-scale-growth-interval good steps, halved and the step skipped on an inf or a NaN), a
 * number (a constant scale, overflowing steps still skipped) or none; the default ("auto",
 * loss_scale_default) is dynamic for float16 compute and none otherwise. The scaled loss is
 * backpropagated, gradients are unscaled before clipping; with DDP the found_inf decision is
 * agreed over the group (td_grad_scaler_set_process_group), with ZeRO by td_zero_step_scaled;
 * under --ft the step itself decides from the averaged gradient (td_ft_ddp_options.scaler,
 * td_ft_zero_options.scaler), alike on every survivor.
 * The JSON reports skipped_steps and the final loss_scale.
 *
 * GPUs: --device cuda:N trains there (model, optimizer state, batches; the corpus and the batch
 * offsets stay on the host, so the batches are the CPU run's). With --nproc N (or --dp zero1/2/3
 * alone, a group of one) rank r takes cuda:((N + r) % GPUs) and the group is an NCCL one. The JSON
 * then reports the CUDA caching allocator's peak over training (device_peak_mb) instead of the CPU
 * allocator's figures. bench/gpt_gpu.c measures GPT-2 124M shapes on a GPU.
 *
 * Output: progress on stderr, then (generation only) the sampled text, then one JSON line
 * {"bench": "gpt", "config": {...}, "results": {"val_loss", "train_loss", "tokens_per_s",
 * "samples_per_s", "wall_s", "evals": [{"step", "train_loss", "val_loss"}], ...}}; tokens_per_s
 * counts training tokens over the time of the training steps (evaluations excluded),
 * tokens_per_cpu_s over the CPU time they took.
 */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "text_corpus.h"
#include "tdist/autograd.h"
#include "tdist/collectives.h"
#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/tensor.h"

/* ---- options: one table is the parser, the help and the defaults ---- */

typedef struct opts {
  int64_t steps, batch_size, block_size, n_embd, warmup, eval_interval, eval_iters;
  int n_layer, n_head, threads, nproc;
  double lr, min_lr, weight_decay, beta2, grad_clip, temperature;
  uint64_t seed;
  const char *corpus, *init, *save, *load, *dtype, *prompt, *metrics, *dp, *ckpt;
  const char *reduce_dtype; /* ddp: the buckets' dtype on the wire (f32, bf16, f16) */
  const char *device;       /* cpu, cuda or cuda:N */
  int64_t generate, top_k;
  bool zero_after_backward;
  double bucket_mb, zero_inflight_mb;
  int64_t grad_accum;      /* micro-batches per optimizer step */
  const char *loss_scale;  /* auto, dynamic, none or a number */
  double loss_scale_init;  /* dynamic: the first scale */
  int64_t loss_scale_growth_interval;
  bool ft;                 /* --ft: fault-tolerant DDP or ZeRO (td_ft_ddp, td_ft_zero) */
  const char *ft_inject;   /* --ft-inject: "rank:step:when:what[,...]" (tests, benchmarks) */
  int wait_spares;         /* --wait-spares: members wait until N spares stand by */
  int spares;              /* --spares: the last S ranks wait outside the group to replace lost
                              members (td_process_group_spare; --ft) */
} opts;

static void opts_defaults(opts *o) {
  memset(o, 0, sizeof *o);
  *o = (opts){.steps = 2000, .batch_size = 12, .block_size = 64, .n_embd = 128, .warmup = 100,
              .eval_interval = 250, .eval_iters = 20, .n_layer = 4, .n_head = 4, .threads = 1,
              .lr = 1e-3, .min_lr = 1e-4, .weight_decay = 0.1, .beta2 = 0.99, .grad_clip = 1.0,
              .temperature = 0.8, .seed = 1337, .corpus = "/usr/share/games/fortunes",
              .dtype = "f32", .prompt = "\n", .top_k = 0, .nproc = 1, .dp = "ddp",
              .zero_inflight_mb = 8, .grad_accum = 1, .loss_scale = "auto", .reduce_dtype = "f32",
              .loss_scale_init = 65536, .loss_scale_growth_interval = 2000, .ckpt = "none",
              .device = "cpu"};
}

/* loss_scale_default: the --loss-scale of "auto" for a compute dtype: dynamic scaling where
 * gradients underflow (float16), none where the exponent range is float32's or wider (bfloat16,
 * float32, float64), as PyTorch's recipes do. */
static const char *loss_scale_default(const char *dtype) {
  return !strcmp(dtype, "f16") ? "dynamic" : "none";
}

static void opts_parse(int argc, char **argv, opts *o) {
  const ex_opt table[] = {
      {"steps", EX_OPT_I64, &o->steps, "training steps"},
      {"batch-size", EX_OPT_I64, &o->batch_size,
       "sequences per micro-batch (a step trains on grad-accum x this)"},
      {"grad-accum", EX_OPT_I64, &o->grad_accum,
       "micro-batches of --batch-size per optimizer step (gradient accumulation, one reduction)"},
      {"block-size", EX_OPT_I64, &o->block_size, "context length"},
      {"n-layer", EX_OPT_INT, &o->n_layer, "transformer blocks"},
      {"n-head", EX_OPT_INT, &o->n_head, "attention heads"},
      {"n-embd", EX_OPT_I64, &o->n_embd, "model width"},
      {"lr", EX_OPT_DOUBLE, &o->lr, "peak learning rate (AdamW)"},
      {"min-lr", EX_OPT_DOUBLE, &o->min_lr, "learning rate at the end of the cosine"},
      {"warmup", EX_OPT_I64, &o->warmup, "linear warmup steps"},
      {"weight-decay", EX_OPT_DOUBLE, &o->weight_decay, "AdamW decay of the >= 2-d weights"},
      {"beta2", EX_OPT_DOUBLE, &o->beta2, "AdamW beta2 (beta1 is 0.9)"},
      {"grad-clip", EX_OPT_DOUBLE, &o->grad_clip, "gradient norm limit (0: no clipping)"},
      {"eval-interval", EX_OPT_I64, &o->eval_interval, "steps between evaluations"},
      {"eval-iters", EX_OPT_I64, &o->eval_iters, "batches per split and evaluation"},
      {"seed", EX_OPT_U64, &o->seed, "init seed; batches use seed+1, evaluations seed+2"},
      {"threads", EX_OPT_INT, &o->threads, "BLAS threads"},
      {"corpus", EX_OPT_STRING, &o->corpus, "text file, or directory of fortune files"},
      {"dtype", EX_OPT_STRING, &o->dtype,
       "compute dtype: f32, f64, or bf16 / f16 (autocast: float32 weights and optimizer state, "
       "16-bit matmuls and attention)"},
      {"init", EX_OPT_STRING, &o->init, "load the initial weights from this safetensors file"},
      {"save", EX_OPT_STRING, &o->save, "write the trained model (with its vocabulary) here"},
      {"load", EX_OPT_STRING, &o->load, "sample from this checkpoint instead of training"},
      {"generate", EX_OPT_I64, &o->generate, "characters to sample (after training or --load)"},
      {"prompt", EX_OPT_STRING, &o->prompt, "text the sample starts from"},
      {"temperature", EX_OPT_DOUBLE, &o->temperature, "sampling temperature"},
      {"top-k", EX_OPT_I64, &o->top_k, "sample among the k likeliest characters (0: all)"},
      {"nproc", EX_OPT_INT, &o->nproc,
       "data-parallel replicas to fork when not started by a launcher (RANK unset)"},
      {"dp", EX_OPT_STRING, &o->dp, "data parallelism: ddp, zero1, zero2 or zero3"},
      {"bucket-mb", EX_OPT_DOUBLE, &o->bucket_mb,
       "gradient bucket size of ddp and zero2 in MiB (0: the defaults, ddp 25 MiB, zero2 4 MiB; the "
       "first bucket holds 1 MiB or less)"},
      {"zero-inflight-mb", EX_OPT_DOUBLE, &o->zero_inflight_mb,
       "zero2: MiB of gradient buckets in flight before backward waits for the oldest (0: no cap)"},
      {"zero-after-backward", EX_OPT_FLAG, &o->zero_after_backward,
       "zero2: reduce_scatter after backward instead of during it"},
      {"activation-checkpointing", EX_OPT_STRING, &o->ckpt,
       "recompute activations in backward: none, full (every block keeps only its input) or "
       "selective (every attention core)"},
      {"reduce-dtype", EX_OPT_STRING, &o->reduce_dtype,
       "ddp: the dtype gradients travel in: f32 (the gradients' own), or bf16 / f16 (half the "
       "bytes, float32 accumulation, float32 .grads)"},
      {"loss-scale", EX_OPT_STRING, &o->loss_scale,
       "auto (dynamic for f16, else none), dynamic, none, or a constant scale"},
      {"loss-scale-init", EX_OPT_DOUBLE, &o->loss_scale_init, "dynamic loss scaling's first scale"},
      {"loss-scale-growth-interval", EX_OPT_I64, &o->loss_scale_growth_interval,
       "dynamic loss scaling: good steps in a row before the scale doubles"},
      {"device", EX_OPT_STRING, &o->device,
       "cpu, cuda or cuda:N: where the model trains; with --nproc (or zero1/2/3 alone) each rank "
       "takes cuda:((N + rank) % GPUs) and the replicas agree through NCCL"},
      {"ft", EX_OPT_FLAG, &o->ft,
       "ddp, zero1, zero2, zero3: fault tolerant (td_ft_ddp, td_ft_zero): a lost worker costs one "
       "step, its shard of the batch is recomputed by the survivors (zero: its optimizer blocks, "
       "zero3 also their parameters, are held by a neighbour too), the result is unchanged; "
       "rank 0 (the store) must live"},
      {"ft-inject", EX_OPT_STRING, &o->ft_inject,
       "--ft: inject faults, \"rank:step:when:what[,...]\" (when: before, during, after the "
       "reduction, or recovery; zero1/2/3 also before_gather, during_gather, after_gather, "
       "after_vote; zero3 also unit_gather; what: kill, close, stop)"},
      {"spares", EX_OPT_INT, &o->spares,
       "--ft: the last S workers of the world are spares: they wait outside the data-parallel "
       "group and one joins in place of each lost member, healed from the survivors (zero: the "
       "lost member's optimizer blocks from their other holder; the world is nproc + S when "
       "forking)"},
      {"wait-spares", EX_OPT_INT, &o->wait_spares,
       "--ft: the members start training once N spares stand by (--spares, or workers joining "
       "the running group: tdistrun --nnodes MIN:MAX), waiting at most 120 s"},
      {"metrics", EX_OPT_STRING, &o->metrics,
       "write JSON lines of every step and evaluation to FILE (scripts/plot.py draws them)"},
  };
  ex_opts_parse(argc, argv, table, (int)(sizeof table / sizeof table[0]),
                "gpt: a character-level GPT (nanoGPT's small recipe) on the fortunes corpus");
  if (o->steps < 0 || o->batch_size < 1 || o->block_size < 1 || o->n_layer < 1 ||
      o->n_head < 1 || o->n_embd < 1 || o->n_embd % o->n_head || o->warmup < 0 ||
      o->eval_interval < 1 || o->eval_iters < 1 || o->threads < 0 || o->generate < 0 ||
      o->top_k < 0 || !(o->temperature > 0) || !(o->lr >= 0) || !(o->grad_clip >= 0) ||
      !(o->bucket_mb >= 0) || !(o->zero_inflight_mb >= 0) || o->grad_accum < 1)
    ex_die("bad option values (see --help): sizes must be positive, n-embd a multiple of "
           "n-head, temperature > 0");
  if (strcmp(o->dtype, "f32") && strcmp(o->dtype, "f64") && strcmp(o->dtype, "bf16") &&
      strcmp(o->dtype, "f16"))
    ex_die("--dtype must be f32, f64, bf16 or f16");
  if (o->nproc < 1 || o->nproc > 64) ex_die("--nproc must be in 1..64");
  if (!strcmp(o->loss_scale, "auto")) o->loss_scale = loss_scale_default(o->dtype);
  char *end = NULL;
  double v = strtod(o->loss_scale, &end);
  if (strcmp(o->loss_scale, "dynamic") && strcmp(o->loss_scale, "none") &&
      (end == o->loss_scale || *end || !(v > 0) || v > 3.4e38))
    ex_die("--loss-scale must be auto, dynamic, none or a positive number (a float32)");
  if (strcmp(o->dp, "ddp") && strcmp(o->dp, "zero1") && strcmp(o->dp, "zero2") &&
      strcmp(o->dp, "zero3"))
    ex_die("--dp must be ddp, zero1, zero2 or zero3");
  if (strcmp(o->ckpt, "none") && strcmp(o->ckpt, "full") && strcmp(o->ckpt, "selective"))
    ex_die("--activation-checkpointing must be none, full or selective");
  if (strcmp(o->reduce_dtype, "f32") && strcmp(o->reduce_dtype, "bf16") &&
      strcmp(o->reduce_dtype, "f16"))
    ex_die("--reduce-dtype must be f32, bf16 or f16");
  if (strcmp(o->reduce_dtype, "f32") && strcmp(o->dp, "ddp"))
    ex_die("--reduce-dtype bf16/f16 is a ddp option (ZeRO reduces in the gradients' dtype)");
  if (o->ft && strcmp(o->reduce_dtype, "f32"))
    ex_die("--ft runs without --reduce-dtype (not yet)");
  if (o->ft && !strcmp(o->dp, "zero3") && (o->grad_accum != 1 || strcmp(o->ckpt, "none")))
    ex_die("--dp zero3 --ft: one forward and backward per shard, without activation "
           "checkpointing (td_ft_zero stage 3; not yet with --grad-accum or "
           "--activation-checkpointing)");
  if (o->ft_inject && !o->ft) ex_die("--ft-inject needs --ft");
  if (o->spares < 0 || (o->spares && !o->ft)) ex_die("--spares S (S >= 0) needs --ft");
  if (o->wait_spares < 0 || (o->wait_spares && !o->ft))
    ex_die("--wait-spares N (N >= 0) needs --ft");
}

static td_checkpoint_mode ckpt_mode(const opts *o) {
  return !strcmp(o->ckpt, "full")        ? TD_CHECKPOINT_FULL
         : !strcmp(o->ckpt, "selective") ? TD_CHECKPOINT_SELECTIVE
                                         : TD_CHECKPOINT_NONE;
}

/* The device the model trains on (--device; per rank with data parallelism: see main). */
static td_device run_dev;

/* batch_to_dev moves a batch's tokens to run_dev (nothing on the CPU). */
static void batch_to_dev(batch *b) {
  if (run_dev.type == TD_DEVICE_CPU) return;
  td_tensor *x = NULL, *y = NULL;
  EX_CHECK(td_tensor_to(b->x, run_dev, &x));
  EX_CHECK(td_tensor_to(b->y, run_dev, &y));
  td_tensor_unref(b->x);
  td_tensor_unref(b->y);
  b->x = x;
  b->y = y;
}

/* ---- model, checkpoints ---- */

static td_gpt_config model_config(const opts *o, int nvocab) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.vocab_size = nvocab;
  c.block_size = o->block_size;
  c.n_layer = o->n_layer;
  c.n_head = o->n_head;
  c.n_embd = o->n_embd;
  return c;
}

/* load_weights reads a safetensors state dict into m (converted to m's dtype), checking the
 * vocabulary recorded in the file (when there is one) against vocab (when not NULL). */
static void load_weights(td_module *m, const char *path, const char *vocab, td_dtype dt) {
  td_tensor_list sd, conv;
  td_safetensors_meta meta;
  td_tensor_list_init(&sd);
  td_tensor_list_init(&conv);
  td_safetensors_meta_init(&meta);
  EX_CHECK(td_safetensors_read(path, &sd, &meta));
  const char *fv = td_safetensors_meta_get(&meta, "vocab");
  if (vocab && fv && strcmp(fv, vocab) != 0)
    ex_die("%s was made for another vocabulary (%zu characters, this corpus has %zu)", path,
           strlen(fv), strlen(vocab));
  for (size_t i = 0; i < sd.n; i++) {
    td_tensor *t;
    EX_CHECK(td_tensor_to_dtype(sd.tensors[i], dt, &t));
    EX_CHECK(td_tensor_list_append(&conv, sd.names[i], t));
    td_tensor_unref(t);
  }
  EX_CHECK(td_module_load_state_dict(m, &conv, true));
  td_tensor_list_fini(&conv);
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
}

static void save_checkpoint(td_module *m, const char *path, const char *vocab) {
  td_gpt_config c;
  EX_CHECK(td_gpt_config_get(m, &c));
  td_tensor_list sd;
  td_safetensors_meta meta;
  td_tensor_list_init(&sd);
  td_safetensors_meta_init(&meta);
  EX_CHECK(td_module_state_dict(m, &sd));
  char v[32];
  EX_CHECK(td_safetensors_meta_set(&meta, "format", "pt"));
  EX_CHECK(td_safetensors_meta_set(&meta, "tdist.module", "GPT"));
  EX_CHECK(td_safetensors_meta_set(&meta, "vocab", vocab));
#define META_INT(key, val)                              \
  snprintf(v, sizeof v, "%lld", (long long)(val));      \
  EX_CHECK(td_safetensors_meta_set(&meta, key, v))
  META_INT("vocab_size", c.vocab_size);
  META_INT("block_size", c.block_size);
  META_INT("n_layer", c.n_layer);
  META_INT("n_head", c.n_head);
  META_INT("n_embd", c.n_embd);
#undef META_INT
  EX_CHECK(td_safetensors_write(path, &sd, &meta));
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
}

/* load_checkpoint makes the model a checkpoint describes; *vocab gets a copy of its vocabulary. */
static td_module *load_checkpoint(const char *path, char **vocab) {
  td_tensor_list sd;
  td_safetensors_meta meta;
  td_tensor_list_init(&sd);
  td_safetensors_meta_init(&meta);
  EX_CHECK(td_safetensors_read(path, &sd, &meta));
  const char *keys[] = {"vocab", "block_size", "n_layer", "n_head", "n_embd"};
  for (int i = 0; i < 5; i++)
    if (!td_safetensors_meta_get(&meta, keys[i]))
      ex_die("%s is not a gpt checkpoint (no \"%s\" in its metadata)", path, keys[i]);
  td_gpt_config c;
  td_gpt_config_init(&c);
  *vocab = strdup(td_safetensors_meta_get(&meta, "vocab"));
  c.vocab_size = (int64_t)strlen(*vocab);
  c.block_size = atoll(td_safetensors_meta_get(&meta, "block_size"));
  c.n_layer = atoi(td_safetensors_meta_get(&meta, "n_layer"));
  c.n_head = atoi(td_safetensors_meta_get(&meta, "n_head"));
  c.n_embd = atoll(td_safetensors_meta_get(&meta, "n_embd"));
  td_dtype dt = sd.n ? td_tensor_dtype(sd.tensors[0]) : TD_DTYPE_F32;
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
  td_module *m;
  EX_CHECK(td_gpt_create(&c, NULL, &m));
  if (dt != TD_DTYPE_F32) EX_CHECK(td_module_to_dtype(m, dt));
  load_weights(m, path, *vocab, dt);
  return m;
}

/* ---- training ---- */

/* make_optimizer: AdamW, decay on parameters of >= 2 dims (weights, embeddings), none on the
 * others (biases, LayerNorm), as nanoGPT's configure_optimizers. */
typedef struct optim_setup {
  td_optim_options oo;
  td_optim_group g[2];
  td_tensor_list ps;
  td_tensor **decay, **plain;
} optim_setup;

static void optim_setup_make(td_module *m, const opts *o, optim_setup *s) {
  td_tensor_list_init(&s->ps);
  EX_CHECK(td_module_parameters(m, &s->ps));
  s->decay = malloc((s->ps.n + 1) * sizeof *s->decay);
  s->plain = malloc((s->ps.n + 1) * sizeof *s->plain);
  if (!s->decay || !s->plain) ex_die("out of memory");
  size_t nd = 0, np = 0;
  for (size_t i = 0; i < s->ps.n; i++) {
    if (td_tensor_ndim(s->ps.tensors[i]) >= 2) s->decay[nd++] = s->ps.tensors[i];
    else s->plain[np++] = s->ps.tensors[i];
  }
  td_optim_options_init(&s->oo, TD_OPTIM_ADAMW);
  s->oo.lr = o->lr;
  s->oo.beta1 = 0.9;
  s->oo.beta2 = o->beta2;
  s->oo.eps = 1e-8;
  td_optim_group_init(&s->g[0], s->decay, nd);
  s->g[0].weight_decay = o->weight_decay;
  td_optim_group_init(&s->g[1], s->plain, np);
  s->g[1].weight_decay = 0.0;
}

static void optim_setup_free(optim_setup *s) {
  free(s->decay);
  free(s->plain);
  td_tensor_list_fini(&s->ps);
}

static td_optim *make_optimizer(td_module *m, const opts *o) {
  optim_setup s;
  optim_setup_make(m, o, &s);
  td_optim *opt;
  EX_CHECK(td_optim_create_groups(&s.oo, s.g, 2, &opt));
  optim_setup_free(&s);
  return opt;
}

/* The data-parallel side of a run (NULL members when training alone). */
typedef struct dp_run {
  td_process_group *pg; /* NULL: one process */
  int rank, world;
  td_ddp *ddp;          /* --dp ddp */
  td_zero *zero;        /* --dp zero1 / zero2 / zero3 */
  /* memory (MiB): resident before the model was made, the peak until training starts (model,
   * optimizer, sharding set up), and whether the peak was reset there (else the training peak
   * below is the whole run's) */
  double rss_before_model, peak_setup;
  bool peak_reset;
  /* the CPU allocator's bytes (MiB, td_cpu_memory_info) in use before the model was made and at
   * the start of training: tensor memory, the figure the model-state formulas count */
  double tensors_before_model, tensors_at_start;
  double activations; /* tensor memory a training forward added (first step): saved activations */
  /* --ft: the fault-tolerant DDP and what it survived */
  td_ft_ddp *ft;
  td_ft_zero *ftz;         /* --ft with --dp zero1 / zero2 / zero3 */
  td_rpc_agent *agent;
  bool spare;              /* --spares: this worker waits to replace a lost member */
  bool spare_released;     /* ... and was not needed */
  bool members_lost;       /* ... while the group lost members (its shutdown follows theirs) */
  bool joined;             /* this worker joined the group as a spare */
  int ft_joined;           /* spares that joined, as the steps report them */
  int ft_blocks_copied;
  int ft_failures, ft_lost, ft_members, ft_shards_recomputed, ft_steps_with_failure;
  uint64_t ft_generation;
  double ft_recovery_max_s;
  double ft_first_commit_unix_s; /* wall clock of the first step committed after a failure */
  double ft_machinery_s;         /* td_ft_step_info.machinery_s, summed over the steps */
} dp_run;

/* estimate returns the mean loss of eval_iters batches of each split (train, val) from a
 * generator reseeded with seed + 2, without recording gradients; a batch is grad_accum
 * micro-batches (the windows of one batch of grad_accum x batch_size). */
static void estimate(td_module *m, const corpus *c, const opts *o, double *train, double *val) {
  bool prev = td_autograd_set_enabled(false);
  td_generator *g;
  EX_CHECK(td_generator_create(o->seed + 2, &g));
  for (int split = 0; split < 2; split++) {
    const uint8_t *d = split ? c->tok + c->n_train : c->tok;
    int64_t len = split ? c->n - c->n_train : c->n_train;
    double total = 0;
    for (int64_t i = 0; i < o->eval_iters * o->grad_accum; i++) {
      batch b; /* a batch of grad_accum x batch_size windows, in micro-batches */
      batch_make(d, len, g, o->batch_size, o->block_size, NULL, &b);
      batch_to_dev(&b);
      td_tensor *logits, *loss;
      double v;
      EX_CHECK(td_gpt_forward(m, b.x, b.y, &logits, &loss));
      EX_CHECK(td_tensor_item(loss, &v));
      total += v;
      td_tensor_unref(logits);
      td_tensor_unref(loss);
      batch_free(&b);
    }
    *(split ? val : train) = total / (double)(o->eval_iters * o->grad_accum);
  }
  td_generator_destroy(g);
  td_autograd_set_enabled(prev);
}

/* ---- activation memory (one process) ----
 * The CPU allocator's peak over one forward + backward, less what was in use before it, with the
 * parameters' gradients allocated by a first pass (the measured pass adds into them in place, so
 * they do not count): the activations, the backward's transient gradients and each parameter's
 * incoming gradient before it is added. Measured on a probe batch (its own generator: the training
 * batches stay the same) for the model as configured, for one block alone (not checkpointed, on a
 * [B, T, C] input) and for the model's head alone (a GPT without blocks: embeddings, ln_f, the tied
 * head, the cross entropy). With full checkpointing the model's peak should be
 *   the blocks' stored inputs (n_layer [B, T, C] tensors) + max(one block's peak, the head's peak):
 * the inputs stay until each block's backward, and a block's recompute and backward, or the head's
 * backward, run on top of them one at a time. */
typedef struct act_probe {
  double forward_mb;    /* what the model's forward kept */
  double peak_mb;       /* the model's forward + backward */
  double block_peak_mb; /* one block, not checkpointed */
  double head_peak_mb;  /* the GPT without blocks */
  double inputs_mb;     /* n_layer [B, T, C] tensors as the allocator counts them (4 KiB pages) */
} act_probe;

typedef struct probe_ctx {
  td_module *m;   /* the model, a block or the head */
  const batch *b; /* tokens (model, head) */
  td_tensor *x;   /* the block's input (requires grad), or NULL */
  double kept_mb; /* set by each pass: what its forward kept */
  td_dtype ac;    /* bf16 / f16: the forward in an autocast scope of it (as the model's) */
} probe_ctx;

static void probe_pass(probe_ctx *c) {
  double before = ex_tensor_mb(false);
  td_tensor *out = NULL, *loss = NULL;
  bool ac = c->ac == TD_DTYPE_BF16 || c->ac == TD_DTYPE_F16;
  if (ac) EX_CHECK(td_autocast_begin(c->ac));
  if (c->x) {
    EX_CHECK(td_module_forward(c->m, c->x, &out));
    EX_CHECK(td_tensor_sum_all(out, &loss));
  } else {
    EX_CHECK(td_gpt_forward(c->m, c->b->x, c->b->y, &out, &loss));
  }
  if (ac) td_autocast_end(); /* a scope per forward: its weight casts go with it */
  c->kept_mb = ex_tensor_mb(false) - before;
  EX_CHECK(td_tensor_backward(loss));
  td_tensor_unref(out);
  td_tensor_unref(loss);
}

/* The second of two passes' peak over what was in use before it (MiB). */
static double probe_peak(probe_ctx *c) {
  probe_pass(c);
  double before = ex_tensor_mb(false);
  td_cpu_reset_peak_memory();
  probe_pass(c);
  return ex_tensor_mb(true) - before;
}

static void activation_probe(td_module *m, const corpus *c, const opts *o, td_dtype dt,
                             act_probe *ap) {
  td_generator *g;
  EX_CHECK(td_generator_create(o->seed + 4, &g));
  batch b;
  batch_make(c->tok, c->n_train, g, o->batch_size, o->block_size, NULL, &b);
  td_dtype ac = !strcmp(o->dtype, "bf16")  ? TD_DTYPE_BF16
                : !strcmp(o->dtype, "f16") ? TD_DTYPE_F16
                                           : TD_DTYPE_F32; /* the model's own autocast */
  probe_ctx pm = {m, &b, NULL, 0, TD_DTYPE_F32};
  ap->peak_mb = probe_peak(&pm);
  ap->forward_mb = pm.kept_mb;
  td_module_zero_grad(m);
  /* one block as it is without checkpointing */
  td_module *blk = td_module_child(td_module_child(td_module_child(m, "transformer"), "h"), "0");
  td_module *attn = td_module_child(blk, "attn");
  td_checkpoint_mode mb = td_module_get_checkpoint(blk), ma = td_module_get_checkpoint(attn);
  EX_CHECK(td_module_set_checkpoint(blk, TD_CHECKPOINT_NONE));
  EX_CHECK(td_module_set_checkpoint(attn, TD_CHECKPOINT_NONE));
  int64_t shape[3] = {o->batch_size, o->block_size, o->n_embd};
  td_tensor *x;
  EX_CHECK(td_tensor_uniform(shape, 3, -1, 1, dt, td_device_cpu(), g, &x));
  EX_CHECK(td_tensor_set_requires_grad(x, true));
  probe_ctx pb = {blk, NULL, x, 0, ac};
  ap->block_peak_mb = probe_peak(&pb);
  EX_CHECK(td_module_set_checkpoint(blk, mb));
  EX_CHECK(td_module_set_checkpoint(attn, ma));
  td_module_zero_grad(blk);
  td_tensor_unref(x);
  /* the head: the same GPT without blocks */
  td_gpt_config hc = model_config(o, c->nvocab);
  hc.n_layer = 0;
  td_module *head;
  EX_CHECK(td_gpt_create(&hc, g, &head));
  if (dt != TD_DTYPE_F32) EX_CHECK(td_module_to_dtype(head, dt));
  probe_ctx ph = {head, &b, NULL, 0, ac};
  ap->head_peak_mb = probe_peak(&ph);
  td_module_unref(head);
  double bytes = (double)(o->batch_size * o->block_size * o->n_embd) * (double)td_dtype_size(dt);
  ap->inputs_mb = o->n_layer * ceil(bytes / 4096.0) * 4096.0 / 1048576.0;
  batch_free(&b);
  td_generator_destroy(g);
}

/* activation_json adds the probes' figures (MiB) and, with full checkpointing, the formula. */
static void activation_json(const act_probe *ap, const opts *o, ex_json *res) {
  ex_json_num(res, "activation_peak_mb", ap->peak_mb);
  ex_json_num(res, "probe_forward_kept_mb", ap->forward_mb);
  ex_json_num(res, "block_activation_peak_mb", ap->block_peak_mb);
  ex_json_num(res, "head_activation_peak_mb", ap->head_peak_mb);
  ex_json_num(res, "stored_block_inputs_mb", ap->inputs_mb);
  if (ckpt_mode(o) != TD_CHECKPOINT_FULL) return;
  double f = ap->inputs_mb + fmax(ap->block_peak_mb, ap->head_peak_mb);
  ex_json_num(res, "activation_formula_mb", f);
  ex_json_num(res, "activation_peak_over_formula", ap->peak_mb / f);
}

/* cpu_now_s returns the CPU time of this process (all threads), in seconds. */
static double cpu_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct train_result {
  double train_loss, val_loss, last_loss, train_s, train_cpu_s;
  uint64_t hash;
  uint64_t loss_hash; /* the bits of every step's training loss on this rank (FNV-1a) */
  ex_json evals;
  double grad_norm;       /* the last step's gradient norm before clipping (NAN without) */
  uint64_t skipped_steps; /* loss scaling: steps skipped for an inf or a NaN */
  double loss_scale;      /* loss scaling: the final scale (NAN without) */
} train_result;

static bool zero_overlaps(const td_zero *z) {
  td_zero_stats st;
  EX_CHECK(td_zero_get_stats(z, &st));
  return st.overlap;
}

/* record_eval keeps and prints one evaluation (rank 0). */
static void record_eval(train_result *r, const ex_progress *p, int64_t it, double tl, double vl) {
  r->train_loss = tl, r->val_loss = vl;
  ex_json e;
  ex_json_object(&e);
  ex_json_int(&e, "step", it);
  ex_json_num(&e, "train_loss", tl);
  ex_json_num(&e, "val_loss", vl);
  ex_json_child(&r->evals, NULL, &e);
  ex_json_fini(&e);
  fprintf(stderr, "%sstep %lld: train loss %.4f, val loss %.4f\n", p->tty ? "\r" : "",
          (long long)it, tl, vl);
  ex_metrics_eval_step(it, "val_loss", vl);
}

/* make_scaler returns the loss scaler of --loss-scale (NULL for none); with DDP its found_inf is
 * agreed over the group (ZeRO agrees in td_zero_step_scaled). */
static td_grad_scaler *make_scaler(const opts *o, const dp_run *dp) {
  if (!strcmp(o->loss_scale, "none")) return NULL;
  td_grad_scaler_options so;
  td_grad_scaler_options_init(&so);
  if (!strcmp(o->loss_scale, "dynamic")) {
    so.init_scale = o->loss_scale_init;
    so.growth_interval = o->loss_scale_growth_interval;
  } else {
    so.dynamic = false;
    so.init_scale = strtod(o->loss_scale, NULL);
  }
  td_grad_scaler *sc = NULL;
  EX_CHECK(td_grad_scaler_create(&so, &sc));
  if (dp->ddp) EX_CHECK(td_grad_scaler_set_process_group(sc, dp->pg));
  return sc;
}

typedef struct step_times {
  double batch_s, forward_s, backward_s;
} step_times;

/* micro_step runs micro-batch k of the step's grad_accum: draws its windows (after the previous
 * micro-batch's, so a step draws the windows of one grad_accum x batch_size batch), forward,
 * clears the gradients before the step's first backward, and backpropagates its share of the
 * step's mean loss (loss / grad_accum, times the loss scale); DDP and ZeRO keep the gradients of
 * all but the last micro-batch local (no_sync) and reduce the sum once. Returns the
 * micro-batch's mean loss. */
static double micro_step(td_module *m, const corpus *c, const opts *o, dp_run *dp, td_optim *opt,
                         td_grad_scaler *sc, td_generator *g, int64_t k, bool measure,
                         uint64_t *hash, step_times *t) {
  double t0 = ex_now_s();
  batch b;
  batch_make(c->tok, c->n_train, g, o->batch_size, o->block_size, hash, &b);
  batch_to_dev(&b);
  td_tensor *logits = NULL, *loss = NULL, *share = NULL, *scaled = NULL;
  double tf = ex_now_s();
  double before_fwd = ex_tensor_mb(false);
  EX_CHECK(td_gpt_forward(m, b.x, b.y, &logits, &loss));
  if (measure) dp->activations = ex_tensor_mb(false) - before_fwd;
  if (k == 0 && opt) td_optim_zero_grad(opt);
  if (k == 0 && dp->zero) td_zero_zero_grad(dp->zero);
  bool last = k == o->grad_accum - 1;
  if (dp->ddp) td_ddp_no_sync(dp->ddp, !last);
  if (dp->zero) td_zero_no_sync(dp->zero, !last);
  if (dp->ddp) EX_CHECK(td_ddp_prepare(dp->ddp));
  if (dp->zero && zero_overlaps(dp->zero)) EX_CHECK(td_zero_prepare(dp->zero));
  td_tensor *obj = loss;
  if (o->grad_accum > 1) EX_CHECK(td_tensor_mul_scalar(loss, 1.0 / (double)o->grad_accum, &share));
  if (share) obj = share;
  if (sc) EX_CHECK(td_grad_scaler_scale(sc, obj, &scaled));
  if (scaled) obj = scaled;
  double tb = ex_now_s();
  EX_CHECK(td_tensor_backward(obj));
  if (dp->ddp) EX_CHECK(td_ddp_finish(dp->ddp));
  double v = NAN;
  EX_CHECK(td_tensor_item(loss, &v));
  td_tensor *all[] = {logits, loss, share, scaled};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  batch_free(&b);
  t->batch_s += tf - t0, t->forward_s += tb - tf, t->backward_s += ex_now_s() - tb;
  return v;
}

/* optimizer_step: ZeRO reduces, unscales (agreeing on overflows), clips, steps its shard and
 * gathers; the local optimizer (one process, DDP) is unscaled, clipped and stepped unless the
 * scaler found an inf or a NaN; then the scaler's rule. Returns the gradient norm before
 * clipping (NAN without clipping). */
static double optimizer_step(const opts *o, dp_run *dp, td_optim *opt, td_grad_scaler *sc) {
  double norm = NAN;
  if (dp->zero) {
    EX_CHECK(td_zero_step_scaled(dp->zero, sc));
    td_zero_stats zs;
    EX_CHECK(td_zero_get_stats(dp->zero, &zs));
    norm = zs.last_grad_norm;
  } else {
    if (sc) EX_CHECK(td_grad_scaler_unscale_(sc, opt)); /* before clipping */
    if (o->grad_clip > 0) EX_CHECK(td_optim_clip_grad_norm(opt, o->grad_clip, 2.0, &norm));
    if (sc) EX_CHECK(td_grad_scaler_step(sc, opt, NULL));
    else EX_CHECK(td_optim_step(opt));
  }
  if (sc) EX_CHECK(td_grad_scaler_update(sc));
  return norm;
}

/* params_hash: FNV-1a over the bytes of every parameter (equal hashes: bitwise equal models). */
static uint64_t params_hash(td_module *m) {
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  EX_CHECK(td_module_parameters(m, &ps));
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < ps.n; i++) {
    td_tensor *t = NULL;
    /* the bytes on the host: a CUDA parameter through a copy (its data pointer is the device's) */
    if (td_tensor_device(ps.tensors[i]).type == TD_DEVICE_CPU)
      EX_CHECK(td_tensor_contiguous(ps.tensors[i], &t));
    else EX_CHECK(td_tensor_to(ps.tensors[i], td_device_cpu(), &t));
    const unsigned char *b = td_tensor_data(t);
    for (size_t k = 0, n = td_tensor_nbytes(t); k < n; k++) h = (h ^ b[k]) * 0x100000001b3ull;
    td_tensor_unref(t);
  }
  td_tensor_list_fini(&ps);
  return h;
}

/* ---- --ft: fault-tolerant DDP ---- */

/* A shard of a step's global batch (world x grad_accum x batch_size windows, world shards): its
 * windows are drawn from a generator seeded by (seed + 1, step, shard) alone, so whichever
 * replica computes it, after a failure too, it is the same batch. With --grad-accum K the shard
 * is K micro-batches of batch_size windows drawn one after the other, each backpropagating its
 * loss / K: the shard's .grad is the gradient of its mean loss, which the step reduces once; a
 * lost member's shard is recomputed with all K of them. */
typedef struct ft_shard_ctx {
  td_module *m;
  const corpus *c;
  const opts *o;
  td_grad_scaler *sc; /* loss scaling (the step unscales and decides on skips), or NULL */
  double loss_sum;
  int shards;
} ft_shard_ctx;

static td_status ft_shard(void *user, int64_t step, int s, int n_shards) {
  (void)n_shards;
  ft_shard_ctx *x = user;
  uint64_t seed = (x->o->seed + 1) ^ (((uint64_t)step + 1) * 0x9e3779b97f4a7c15ull) ^
                  (((uint64_t)s + 1) * 0xc2b2ae3d27d4eb4full);
  td_generator *g = NULL;
  td_status st = td_generator_create(seed, &g);
  if (st != TD_OK) return st;
  int64_t K = x->o->grad_accum;
  double sum = 0;
  for (int64_t k = 0; st == TD_OK && k < K; k++) {
    batch b;
    batch_make(x->c->tok, x->c->n_train, g, x->o->batch_size, x->o->block_size, NULL, &b);
    td_tensor *logits = NULL, *loss = NULL, *share = NULL, *scaled = NULL;
    st = td_gpt_forward(x->m, b.x, b.y, &logits, &loss);
    if (st == TD_OK && K > 1) st = td_tensor_mul_scalar(loss, 1.0 / (double)K, &share);
    if (st == TD_OK && x->sc) st = td_grad_scaler_scale(x->sc, share ? share : loss, &scaled);
    if (st == TD_OK) st = td_tensor_backward(scaled ? scaled : share ? share : loss);
    double v = NAN;
    if (st == TD_OK) st = td_tensor_item(loss, &v);
    sum += v;
    td_tensor_unref(logits);
    td_tensor_unref(loss);
    td_tensor_unref(share);
    td_tensor_unref(scaled);
    batch_free(&b);
  }
  if (st == TD_OK) x->loss_sum += sum / (double)K, x->shards++;
  td_generator_destroy(g);
  return st;
}

static void ft_inject_all(td_ft_ddp *ft, td_ft_zero *ftz, const char *specs) {
  char buf[512];
  snprintf(buf, sizeof buf, "%s", specs);
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    int rank;
    int64_t step;
    td_ft_when when;
    td_ft_what what;
    EX_CHECK(td_ft_inject_parse(t, &rank, &step, &when, &what));
    EX_CHECK(ft ? td_ft_ddp_inject(ft, rank, step, when, what)
                : td_ft_zero_inject(ftz, rank, step, when, what));
  }
}

/* gpt_blocks puts the model's blocks (transformer.h.0, .1, ...) into blocks[0..cap) and returns
 * how many: ZeRO stage 3's units. */
static size_t gpt_blocks(td_module *m, td_module **blocks, size_t cap) {
  td_module *h = td_module_child(td_module_child(m, "transformer"), "h");
  size_t nb = 0;
  char name[24];
  for (; nb < cap; nb++) {
    snprintf(name, sizeof name, "%zu", nb);
    if (!(blocks[nb] = td_module_child(h, name))) break;
  }
  return nb;
}

/* train_ft: train() for --ft (td_ft_ddp, or td_ft_zero for zero1 / zero2 / zero3). A step's loss
 * is the mean of the shards this rank computed. */
static void ft_create(td_module *m, const opts *o, dp_run *dp, td_grad_scaler *sc,
                      td_optim **opt) {
  *opt = NULL;
  if (!strcmp(o->dp, "ddp")) {
    *opt = make_optimizer(m, o);
    td_ft_ddp_options fo;
    td_ft_ddp_options_init(&fo);
    fo.max_grad_norm = o->grad_clip;
    if (o->bucket_mb > 0) fo.bucket_bytes = (size_t)(o->bucket_mb * 1048576.0);
    /* failure-free steps overlap the reduction with backward; that path expects one backward
     * per shard, so with --grad-accum the reduction follows the shard's K backward passes */
    if (o->grad_accum == 1) fo.module = m;
    fo.scaler = sc;
    EX_CHECK(td_ft_ddp_create(dp->pg, *opt, &fo, &dp->ft));
  } else {
    optim_setup s;
    optim_setup_make(m, o, &s);
    td_ft_zero_options zo;
    td_ft_zero_options_init(&zo);
    zo.stage = !strcmp(o->dp, "zero1") ? 1 : !strcmp(o->dp, "zero2") ? 2 : 3;
    zo.max_grad_norm = o->grad_clip;
    td_module *blocks[256]; /* stage 3: the blocks are the units, as for td_zero */
    size_t nb = gpt_blocks(m, blocks, 256);
    if (zo.stage == 3) zo.units = blocks, zo.n_units = nb;
    if (o->bucket_mb > 0) zo.bucket_bytes = (size_t)(o->bucket_mb * 1048576.0);
    zo.scaler = sc;
    EX_CHECK(td_ft_zero_create(dp->pg, &s.oo, s.g, 2, &zo, &dp->ftz));
    optim_setup_free(&s);
  }
  if (o->ft_inject) ft_inject_all(dp->ft, dp->ftz, o->ft_inject);
}

static td_process_group *ft_group(const dp_run *dp) {
  return dp->ft ? td_ft_ddp_group(dp->ft) : td_ft_zero_group(dp->ftz);
}

/* What a step survived: one line per failure from the lowest surviving rank, the counters. */
static void ft_note(dp_run *dp, const td_ft_step_info *info, bool tty) {
  dp->ft_machinery_s += info->machinery_s;
  if (!info->failures) return;
  if (td_process_group_rank(ft_group(dp)) == 0)
    fprintf(stderr, "%sgpt: %s\n", tty ? "\n" : "", info->message);
  dp->ft_failures += info->failures;
  dp->ft_lost += info->lost;
  dp->ft_joined += info->joined;
  dp->ft_shards_recomputed += info->shards_recomputed;
  dp->ft_blocks_copied += info->blocks_copied;
  dp->ft_steps_with_failure++;
  if (info->recovery_s > dp->ft_recovery_max_s) dp->ft_recovery_max_s = info->recovery_s;
  if (dp->ft_first_commit_unix_s == 0) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    dp->ft_first_commit_unix_s = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
  }
}

static void train_ft(td_module *m, const corpus *c, const opts *o, dp_run *dp, train_result *r) {
  td_optim *opt = NULL;
  td_grad_scaler *sc = make_scaler(o, dp); /* no agreement: the step decides alike everywhere */
  bool lead = dp->rank == 0;
  ex_json_array(&r->evals);
  r->hash = r->loss_hash = 0xcbf29ce484222325ull;
  r->train_s = r->train_cpu_s = 0;
  r->grad_norm = NAN;
  r->last_loss = r->train_loss = r->val_loss = NAN;
  r->skipped_steps = 0;
  r->loss_scale = NAN;
  if (dp->spare) { /* wait outside the group until a lost member's place is ours, or the end */
    int *members = malloc((size_t)dp->world * sizeof *members);
    if (!members) ex_die("out of memory");
    for (int i = 0; i < dp->world; i++) members[i] = i;
    EX_CHECK(td_process_group_spare(dp->agent, members, dp->world, TD_PG_BACKEND_CPU,
                                    TD_TIMEOUT_DEFAULT, TD_TIMEOUT_INFINITE, &dp->pg,
                                    &dp->members_lost));
    free(members);
    if (!dp->pg) {
      dp->spare_released = true;
      td_optim_destroy(opt);
      td_grad_scaler_destroy(sc);
      return;
    }
    dp->joined = true;
  }
  ft_create(m, o, dp, sc, &opt); /* a spare that joined is healed here by the survivors */
  if (!dp->joined && o->wait_spares > 0) { /* --wait-spares: the spares first */
    int waiting = 0;
    double until = ex_now_s() + 120;
    while (td_process_group_spares_waiting(ft_group(dp), &waiting) == TD_OK &&
           waiting < o->wait_spares && ex_now_s() < until)
      usleep(10000);
    if (waiting < o->wait_spares)
      ex_die("--wait-spares %d: %d spares stood by after 120 s", o->wait_spares, waiting);
  }
  int64_t first = dp->ft ? td_ft_ddp_next_step(dp->ft) : td_ft_zero_next_step(dp->ftz);
  if (dp->joined) {
    int64_t bytes = 0;
    double secs = 0;
    if (dp->ft) {
      td_ft_ddp_stats js;
      EX_CHECK(td_ft_ddp_get_stats(dp->ft, &js));
      bytes = js.heal_bytes, secs = js.heal_s;
    } else {
      td_ft_zero_stats zs;
      EX_CHECK(td_ft_zero_get_stats(dp->ftz, &zs));
      bytes = zs.heal_bytes, secs = zs.heal_s;
    }
    fprintf(stderr, "gpt: worker%d (rank %d) joined generation %llu as a spare before step %lld: "
            "took %.2f MiB of parameters and optimizer state in %.4f s (%.2f GB/s)\n", dp->rank,
            dp->rank, (unsigned long long)td_process_group_generation(ft_group(dp)),
            (long long)first, (double)bytes / 1048576.0, secs,
            secs > 0 ? (double)bytes / secs * 1e-9 : 0.0);
  }
  ex_progress p;
  ex_progress_start(&p, "gpt", lead ? o->steps : 0);
  ft_shard_ctx ctx = {m, c, o, sc, 0, 0};
  bool zero3 = !strcmp(o->dp, "zero3");
  for (int64_t it = first;; it++) {
    bool eval = it % o->eval_interval == 0 || it == o->steps;
    if (zero3 && eval) { /* every rank: the blocks gathered (until the next step) */
      td_ft_step_info si;
      EX_CHECK(td_ft_zero_sync(dp->ftz, &si));
      ft_note(dp, &si, p.tty);
    }
    if (lead && eval) {
      double tl = NAN, vl = NAN;
      estimate(m, c, o, &tl, &vl);
      record_eval(r, &p, it, tl, vl);
    }
    if (it == o->steps) break;
    double t0 = ex_now_s(), c0 = cpu_now_s();
    double lr = td_optim_lr_warmup_cosine(it, o->warmup, o->steps, o->lr, o->min_lr);
    EX_CHECK(opt ? td_optim_set_lr(opt, lr) : td_ft_zero_set_lr(dp->ftz, lr));
    ctx.loss_sum = 0, ctx.shards = 0;
    td_ft_step_info info;
    EX_CHECK(dp->ft ? td_ft_ddp_step(dp->ft, it, ft_shard, &ctx, &info)
                    : td_ft_zero_step(dp->ftz, it, ft_shard, &ctx, &info));
    ft_note(dp, &info, p.tty);
    r->last_loss = ctx.shards ? ctx.loss_sum / ctx.shards : NAN;
    ex_hash_double(&r->loss_hash, r->last_loss);
    r->train_s += ex_now_s() - t0;
    r->train_cpu_s += cpu_now_s() - c0;
    if (lead) ex_progress_update(&p, it + 1, "loss %.4f", r->last_loss);
  }
  td_ft_step_info si;
  EX_CHECK(dp->ft ? td_ft_ddp_sync(dp->ft, &si) : td_ft_zero_sync(dp->ftz, &si));
  dp->ft_failures += si.failures;
  dp->ft_lost += si.lost;
  dp->ft_blocks_copied += si.blocks_copied;
  td_process_group *g = ft_group(dp);
  /* the lowest member (rank 0, the store's host) answers the spares not needed */
  if (o->spares && td_process_group_rank(g) == 0) EX_CHECK(td_process_group_release_spares(g));
  dp->ft_members = td_process_group_size(g);
  dp->ft_generation = td_process_group_generation(g);
  if (lead) ex_progress_finish(&p, "val loss %.4f", r->val_loss);
  if (sc) {
    td_grad_scaler_stats st;
    EX_CHECK(td_grad_scaler_get_stats(sc, &st));
    r->skipped_steps = st.skipped_steps;
    r->loss_scale = td_grad_scaler_get_scale(sc);
  }
  td_ft_ddp_destroy(dp->ft); /* the parameters stay; the groups it re-formed go */
  td_ft_zero_destroy(dp->ftz);
  dp->ft = NULL;
  dp->ftz = NULL;
  td_optim_destroy(opt);
  td_grad_scaler_destroy(sc);
}

static void train(td_module *m, const corpus *c, const opts *o, dp_run *dp, train_result *r) {
  if (o->ft) {
    train_ft(m, c, o, dp, r);
    return;
  }
  td_optim *opt = NULL;
  if (dp->pg && strcmp(o->dp, "ddp")) {
    optim_setup s;
    optim_setup_make(m, o, &s);
    td_zero_options zo;
    td_zero_options_init(&zo);
    zo.stage = !strcmp(o->dp, "zero1") ? 1 : !strcmp(o->dp, "zero2") ? 2 : 3;
    zo.max_grad_norm = o->grad_clip;
    /* stage 3: the blocks are the units (the embeddings, tied to the head, and ln_f stay whole) */
    td_module *blocks[256];
    size_t nb = gpt_blocks(m, blocks, 256);
    if (zo.stage == 3) zo.units = blocks, zo.n_units = nb;
    /* stage 2 overlaps with backward; gradients arrive roughly in reverse module order */
    td_tensor **rev = malloc((s.ps.n + 1) * sizeof *rev);
    if (!rev) ex_die("out of memory");
    for (size_t i = 0; i < s.ps.n; i++) rev[i] = s.ps.tensors[s.ps.n - 1 - i];
    zo.overlap = zo.stage == 2 && !o->zero_after_backward;
    zo.grad_order = rev;
    zo.bucket_bytes = (size_t)(o->bucket_mb * 1048576.0);
    if (zo.bucket_bytes && zo.bucket_bytes < ((size_t)1 << 20))
      zo.first_bucket_bytes = zo.bucket_bytes;
    zo.n_grad_order = s.ps.n;
    zo.max_inflight_bytes = (size_t)(o->zero_inflight_mb * 1048576.0);
    EX_CHECK(td_zero_create(dp->pg, &s.oo, s.g, 2, &zo, &dp->zero));
    free(rev);
    optim_setup_free(&s);
  } else {
    opt = make_optimizer(m, o);
  }
  if (dp->pg && !dp->zero) {
    td_ddp_options d;
    td_ddp_options_init(&d);
    d.overlap = true;
    d.gradient_as_bucket_view = true; /* the gradients live in the buckets: no second copy */
    if (strcmp(o->reduce_dtype, "f32"))
      d.reduce_dtype = o->reduce_dtype[0] == 'b' ? TD_DTYPE_BF16 : TD_DTYPE_F16;
    if (o->bucket_mb > 0) d.bucket_bytes = (size_t)(o->bucket_mb * 1048576.0);
    if (d.bucket_bytes < d.first_bucket_bytes) d.first_bucket_bytes = d.bucket_bytes;
    EX_CHECK(td_ddp_create_ex(dp->pg, m, &d, &dp->ddp));
  }
  td_grad_scaler *sc = make_scaler(o, dp);
  bool lead = dp->rank == 0;
  dp->peak_setup = ex_peak_rss_mb();
  dp->peak_reset = ex_reset_peak_rss(); /* the training peak from here */
  dp->tensors_at_start = ex_tensor_mb(false);
  td_cpu_reset_peak_memory();
  td_generator *g;
  EX_CHECK(td_generator_create(o->seed + 1 + (uint64_t)dp->rank, &g));
  ex_json_array(&r->evals);
  r->hash = r->loss_hash = 0xcbf29ce484222325ull;
  r->train_s = r->train_cpu_s = 0;
  r->grad_norm = NAN;
  r->last_loss = r->train_loss = r->val_loss = NAN; /* evaluations: rank 0 only */
  ex_progress p;
  ex_progress_start(&p, "gpt", lead ? o->steps : 0);
  for (int64_t it = 0;; it++) {
    /* zero3: every rank runs the evaluation forwards (they gather the blocks: collective) */
    bool evaluates = lead || (dp->zero && !strcmp(o->dp, "zero3"));
    if (evaluates && (it % o->eval_interval == 0 || it == o->steps)) {
      double tl = NAN, vl = NAN;
      estimate(m, c, o, &tl, &vl);
      if (lead) record_eval(r, &p, it, tl, vl);
    }
    if (it == o->steps) break;
    double t0 = ex_now_s(), c0 = cpu_now_s();
    double lr = td_optim_lr_warmup_cosine(it, o->warmup, o->steps, o->lr, o->min_lr);
    if (opt) EX_CHECK(td_optim_set_lr(opt, lr));
    if (dp->zero) EX_CHECK(td_zero_set_lr(dp->zero, lr));
    step_times tm = {0};
    double sum = 0; /* the step's loss: the mean of its micro-batches' */
    for (int64_t k = 0; k < o->grad_accum; k++)
      sum += micro_step(m, c, o, dp, opt, sc, g, k, it == 0 && k == 0, &r->hash, &tm);
    double ts = ex_now_s();
    r->grad_norm = optimizer_step(o, dp, opt, sc);
    r->last_loss = sum / (double)o->grad_accum;
    ex_hash_double(&r->loss_hash, r->last_loss);
    if (ex_metrics_on()) {
      double now = ex_now_s();
      ex_phases ph = {0};
      ex_phases_add(&ph, "batch_s", tm.batch_s);
      ex_phases_add(&ph, "forward_s", tm.forward_s);
      ex_phases_add(&ph, "backward_s", tm.backward_s);
      ex_phases_add(&ph, "step_s", now - ts);
      ex_metrics_step(0, it, r->last_loss, lr,
                      (double)(o->grad_accum * o->batch_size * o->block_size) / (now - t0), &ph);
    }
    r->train_s += ex_now_s() - t0;
    r->train_cpu_s += cpu_now_s() - c0;
    if (lead) ex_progress_update(&p, it + 1, "loss %.4f", r->last_loss);
  }
  if (lead) ex_progress_finish(&p, "val loss %.4f", r->val_loss);
  r->skipped_steps = 0;
  r->loss_scale = NAN;
  if (sc) {
    td_grad_scaler_stats st;
    EX_CHECK(td_grad_scaler_get_stats(sc, &st));
    r->skipped_steps = st.skipped_steps;
    r->loss_scale = td_grad_scaler_get_scale(sc);
  }
  td_grad_scaler_destroy(sc);
  td_generator_destroy(g);
  td_optim_destroy(opt);
}

/* Adds the data-parallel figures to rank 0's results: every rank's peak RSS, the DDP counters
 * or the ZeRO sizes. Collective over the group. */
static void dp_results(dp_run *dp, const opts *o, int64_t params, ex_json *res) {
  enum { K = 7 };
  int64_t k = K, all = (int64_t)K * dp->world;
  double train_peak = ex_peak_rss_mb();
  double mine[K] = {train_peak > dp->peak_setup ? train_peak : dp->peak_setup, train_peak,
                    dp->rss_before_model, ex_tensor_mb(true), dp->tensors_before_model,
                    dp->tensors_at_start, dp->activations};
  td_tensor *t = NULL, *every = NULL, *tg = NULL, *eg = NULL;
  EX_CHECK(td_tensor_from_buffer(mine, &k, 1, TD_DTYPE_F64, &t));
  /* an NCCL group gathers CUDA tensors on its device */
  td_device gd = td_process_group_backend(dp->pg) == TD_PG_BACKEND_NCCL ? run_dev : td_device_cpu();
  EX_CHECK(td_tensor_to(t, gd, &tg));
  EX_CHECK(td_tensor_empty(&all, 1, TD_DTYPE_F64, gd, &eg));
  EX_CHECK(td_process_group_all_gather_into_tensor(dp->pg, eg, tg));
  EX_CHECK(td_tensor_to(eg, td_device_cpu(), &every));
  td_tensor_unref(tg);
  td_tensor_unref(eg);
  const double *v = td_tensor_data(every);
  /* RSS: the run's peak; the training peak (from the first step on: the model building's
   * transients left out); what training added to the process as it was before the model existed.
   * Tensors (the CPU allocator): the training peak less what was in use before the model
   * existed (model states + activations + buffers: what the formulas count), and the model
   * states at rest when training starts. */
  static const char *keys[] = {"peak_rss_mb_per_rank", "peak_rss_train_mb_per_rank",
                               "train_memory_mb_per_rank", "train_tensor_peak_mb_per_rank",
                               "tensors_at_start_mb_per_rank", "activations_mb_per_rank"};
  double peak = 0, act = 0; /* the worst rank's tensor peak and activations */
  for (int i = 0; i < dp->world; i++) {
    peak = fmax(peak, v[K * i + 3] - v[K * i + 4]);
    act = fmax(act, v[K * i + 6]);
  }
  for (int j = 0; j < 6; j++) {
    if ((j == 1 || j == 2) && !dp->peak_reset) continue;
    ex_json arr;
    ex_json_array(&arr);
    for (int i = 0; i < dp->world; i++) {
      const double *r = v + K * i;
      double x = j < 2 ? r[j] : j == 2 ? r[1] - r[2] : j == 3 ? r[3] - r[4] : j == 4 ? r[5] - r[4]
                                                                              : r[6];
      ex_json_num(&arr, NULL, x);
    }
    ex_json_child(res, keys[j], &arr);
    ex_json_fini(&arr);
  }
  td_tensor_unref(t);
  td_tensor_unref(every);
  /* model states in bytes (Adam, e bytes an element: 4 for float32, 8 for float64): parameters e,
   * gradients e, moments 2e per element, 16 bytes in float32; ZeRO-1 shards the moments, ZeRO-2
   * the gradients too, ZeRO-3 the parameters too (DeepSpeed's accounting) */
  double psi = (double)params, n = dp->world, e = strcmp(o->dtype, "f64") ? 4 : 8;
  double formula = !strcmp(o->dp, "ddp") ? 4 * e * psi
                   : !strcmp(o->dp, "zero1") ? 2 * e * psi + 2 * e * psi / n
                   : !strcmp(o->dp, "zero2") ? e * psi + 3 * e * psi / n : 4 * e * psi / n;
  ex_json_num(res, "model_state_formula_mb", formula / 1048576.0);
  /* what the formulas leave out, as measured: activations, and the buffers the layout holds
   * beyond the model states (ZeRO-2/3: gradient buckets in flight; ZeRO-3: full-size parameters
   * of gathered units and of prefetches; DDP's buckets are its gradients, ZeRO-1 reduces one
   * bucket at a time) */
  double buffers = 0;
  if (dp->ddp) {
    td_ddp_stats st;
    EX_CHECK(td_ddp_get_stats(dp->ddp, &st));
    ex_json_int(res, "ddp_buckets", td_ddp_num_buckets(dp->ddp));
    ex_json_num(res, "ddp_bytes_started_in_backward_share",
                st.bytes_reduced ? (double)st.bytes_started_in_backward / (double)st.bytes_reduced
                                 : NAN);
  }
  if (dp->zero) {
    td_zero_stats st;
    EX_CHECK(td_zero_get_stats(dp->zero, &st));
    buffers = (double)(st.peak_bucket_bytes + st.peak_gather_bytes);
    ex_json_int(res, "zero_stage", st.stage);
    ex_json_int(res, "zero_shard_numel", st.shard_numel);
    ex_json_int(res, "zero_numel", st.numel);
    ex_json_int(res, "zero_buckets", (int64_t)st.buckets);
    if (st.stage == 3) {
      ex_json_int(res, "zero_units", (int64_t)st.units);
      ex_json_num(res, "zero_peak_unit_mb", (double)st.peak_unit_bytes / 1048576.0);
      ex_json_num(res, "zero_peak_gather_mb", (double)st.peak_gather_bytes / 1048576.0);
      ex_json_int(res, "zero_unit_gathers", (int64_t)st.unit_gathers);
      ex_json_int(res, "zero_unit_gathers_prefetched", (int64_t)st.prefetched);
    }
    if (st.overlap) {
      ex_json_num(res, "zero_peak_bucket_mb", (double)st.peak_bucket_bytes / 1048576.0);
      ex_json_num(res, "zero_bytes_started_in_backward_share",
                  st.bytes_reduced ? (double)st.bytes_started_in_backward / (double)st.bytes_reduced
                                   : NAN);
    }
  }
  double expected = formula / 1048576.0 + buffers / 1048576.0 + act;
  ex_json_num(res, "layout_buffers_mb", buffers / 1048576.0);
  ex_json_num(res, "expected_tensor_peak_mb", expected);
  ex_json_num(res, "tensor_peak_over_formula", peak / (formula / 1048576.0));
  ex_json_num(res, "tensor_peak_over_expected", peak / expected);
}

/* ---- sampling ---- */

/* sample_next draws the next token from the logits row (V values) with temperature and top-k. */
static int sample_next(const td_tensor *row, int64_t V, const opts *o, td_generator *g) {
  double *l = malloc((size_t)V * sizeof *l);
  for (int64_t i = 0; i < V; i++) {
    EX_CHECK(td_tensor_get(row, &i, &l[i]));
    l[i] /= o->temperature;
  }
  if (o->top_k > 0 && o->top_k < V) { /* keep the k largest: threshold = k-th largest value */
    double *s = malloc((size_t)V * sizeof *s);
    memcpy(s, l, (size_t)V * sizeof *s);
    for (int64_t i = 0; i < o->top_k; i++) /* partial selection sort, k is small */
      for (int64_t j = i + 1; j < V; j++)
        if (s[j] > s[i]) {
          double t = s[i];
          s[i] = s[j];
          s[j] = t;
        }
    double th = s[o->top_k - 1];
    for (int64_t i = 0; i < V; i++)
      if (l[i] < th) l[i] = -INFINITY;
    free(s);
  }
  double mx = -INFINITY, sum = 0;
  for (int64_t i = 0; i < V; i++) mx = l[i] > mx ? l[i] : mx;
  for (int64_t i = 0; i < V; i++) sum += (l[i] = exp(l[i] - mx));
  double u = td_generator_next_double(g) * sum;
  int64_t pick = V - 1;
  for (int64_t i = 0; i < V; i++) {
    u -= l[i];
    if (u < 0 && l[i] > 0) {
      pick = i;
      break;
    }
  }
  free(l);
  return (int)pick;
}

/* generate appends n sampled characters to out (capacity n + 1) from the prompt. */
static void generate(td_module *m, const char *vocab, const opts *o, char *out) {
  td_gpt_config c;
  EX_CHECK(td_gpt_config_get(m, &c));
  int stoi[256];
  for (int b = 0; b < 256; b++) stoi[b] = -1;
  for (int i = 0; vocab[i]; i++) stoi[(unsigned char)vocab[i]] = i;
  size_t plen = strlen(o->prompt);
  if (plen == 0) ex_die("--prompt must not be empty");
  int64_t cap = (int64_t)plen + o->generate, len = 0;
  int64_t *ctx = malloc((size_t)cap * sizeof *ctx);
  for (size_t i = 0; i < plen; i++) {
    int id = stoi[(unsigned char)o->prompt[i]];
    if (id < 0) ex_die("the prompt has a character the model does not know: 0x%02x",
                       (unsigned char)o->prompt[i]);
    ctx[len++] = id;
  }
  td_generator *g;
  EX_CHECK(td_generator_create(o->seed + 3, &g));
  bool prev = td_autograd_set_enabled(false);
  for (int64_t k = 0; k < o->generate; k++) {
    int64_t T = len < c.block_size ? len : c.block_size, shape[2] = {1, T};
    td_tensor *idx, *logits, *flat, *row;
    EX_CHECK(td_tensor_from_buffer(ctx + len - T, shape, 2, TD_DTYPE_I64, &idx));
    if (run_dev.type != TD_DEVICE_CPU) {
      td_tensor *di = NULL;
      EX_CHECK(td_tensor_to(idx, run_dev, &di));
      td_tensor_unref(idx);
      idx = di;
    }
    EX_CHECK(td_gpt_forward(m, idx, NULL, &logits, NULL));
    int64_t s2[2] = {T, c.vocab_size};
    EX_CHECK(td_tensor_reshape(logits, s2, 2, &flat));
    EX_CHECK(td_tensor_narrow(flat, 0, T - 1, 1, &row));
    int64_t s1[1] = {c.vocab_size};
    td_tensor *r1, *rd;
    EX_CHECK(td_tensor_reshape(row, s1, 1, &rd));
    EX_CHECK(td_tensor_to(rd, td_device_cpu(), &r1)); /* read on the host */
    td_tensor_unref(rd);
    int id = sample_next(r1, c.vocab_size, o, g);
    ctx[len++] = id;
    out[k] = vocab[id];
    td_tensor *all[] = {idx, logits, flat, row, r1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) td_tensor_unref(all[i]);
  }
  out[o->generate] = '\0';
  td_autograd_set_enabled(prev);
  td_generator_destroy(g);
  free(ctx);
}

/* ---- main ---- */

/* add_config records the model and, for a training run (trained), the data and the recipe. */
static void add_config(ex_json *cfg, const opts *o, const td_gpt_config *c, int64_t chars,
                       td_module *m, bool trained) {
  ex_json_str(cfg, "impl", "tdist");
  ex_json_int(cfg, "block_size", c->block_size);
  ex_json_int(cfg, "n_layer", c->n_layer);
  ex_json_int(cfg, "n_head", c->n_head);
  ex_json_int(cfg, "n_embd", c->n_embd);
  ex_json_int(cfg, "vocab_size", c->vocab_size);
  ex_json_int(cfg, "params", td_module_num_parameters(m));
  ex_json_int(cfg, "seed", (int64_t)o->seed);
  ex_json_int(cfg, "threads", o->threads);
  ex_json_str(cfg, "activation_checkpointing", o->ckpt);
  ex_json_int(cfg, "openblas_num_threads", ex_blas_threads());
  if (o->generate > 0) {
    ex_json_str(cfg, "load", o->load);
    ex_json_num(cfg, "temperature", o->temperature);
    ex_json_int(cfg, "top_k", o->top_k);
  }
  if (!trained) return;
  ex_json_int(cfg, "steps", o->steps);
  ex_json_int(cfg, "batch_size", o->batch_size);
  ex_json_int(cfg, "grad_accum", o->grad_accum);
  ex_json_str(cfg, "loss_scale", o->loss_scale);
  ex_json_int(cfg, "corpus_chars", chars);
  ex_json_num(cfg, "lr", o->lr);
  ex_json_num(cfg, "min_lr", o->min_lr);
  ex_json_int(cfg, "warmup", o->warmup);
  ex_json_num(cfg, "weight_decay", o->weight_decay);
  ex_json_num(cfg, "beta2", o->beta2);
  ex_json_num(cfg, "grad_clip", o->grad_clip);
  ex_json_int(cfg, "eval_interval", o->eval_interval);
  ex_json_int(cfg, "eval_iters", o->eval_iters);
  ex_json_str(cfg, "dtype", o->dtype);
  ex_json_str(cfg, "reduce_dtype", o->reduce_dtype);
  ex_json_str(cfg, "param_dtype", strcmp(o->dtype, "f64") ? "f32" : "f64");
  ex_json_bool(cfg, "init", o->init != NULL);
}

int main(int argc, char **argv) {
  opts o;
  opts_defaults(&o);
  opts_parse(argc, argv, &o);
  ex_blas_set_threads(o.threads);
  dp_run dp = {.world = 1};
  td_rpc_agent *agent = NULL;
  char wname[32] = "gpt";
  EX_CHECK(td_device_parse(o.device, &run_dev));
  if (!td_device_available(run_dev)) /* counts without initialising CUDA (forks follow) */
    ex_die("device %s is not available (a build without CUDA, or no such GPU)", o.device);
  /* ZeRO with --nproc 1 runs as a group of one (the layout's code paths, one replica) */
  bool zero_alone = o.nproc == 1 && strcmp(o.dp, "ddp") != 0;
  if (!o.load && (o.nproc > 1 || zero_alone || getenv("RANK") || getenv("SLURM_PROCID") ||
                  getenv("OMPI_COMM_WORLD_RANK"))) {
    psx_tolerate_failures(o.ft); /* --ft: a lost worker does not stop the others */
    psx_spawn_if_alone(o.nproc + o.spares); /* a launcher's rank becomes RANK */
    dp.rank = atoi(getenv("RANK"));
    /* RANK=-1 (tdistrun --nnodes MIN:MAX, a node past MIN): this worker joins the running group
     * and serves as a spare; its rank (and default name) come from the group */
    if (dp.rank == TD_RPC_RANK_JOIN && !o.ft)
      ex_die("this worker joins a running group (RANK=-1), where it can only serve as a spare: "
             "that needs --ft");
    snprintf(wname, sizeof wname, "worker%d", dp.rank);
    if (run_dev.type == TD_DEVICE_CUDA) { /* one GPU per rank, the NCCL group's device too */
      const char *lr = getenv("LOCAL_RANK");
      int local = lr && *lr ? atoi(lr) : dp.rank, count = td_cuda_device_count();
      run_dev = td_device_cuda((run_dev.index + local) % count);
      EX_CHECK(td_cuda_set_device(run_dev.index));
    }
    EX_CHECK(td_rpc_init_from_env(dp.rank == TD_RPC_RANK_JOIN ? NULL : wname, NULL, &agent));
    dp.agent = agent;
    dp.rank = td_rpc_rank(agent);
    snprintf(wname, sizeof wname, "worker%d", dp.rank);
    /* --spares S: the data-parallel group is the first world - S ranks; the others wait, and
     * so do the workers that join the running group later (elastic: ranks past the start) */
    dp.world = td_rpc_initial_world_size(agent) - o.spares;
    if (dp.world < 1) ex_die("--spares %d leaves no member in a world of %d", o.spares,
                             td_rpc_initial_world_size(agent));
    int *members = malloc((size_t)dp.world * sizeof *members);
    if (!members) ex_die("out of memory");
    for (int i = 0; i < dp.world; i++) members[i] = i;
    dp.spare = dp.rank >= dp.world;
    if (!dp.spare)
      EX_CHECK(td_process_group_create(
          agent, members, dp.world,
          run_dev.type == TD_DEVICE_CUDA ? TD_PG_BACKEND_NCCL : TD_PG_BACKEND_CPU,
          TD_TIMEOUT_DEFAULT, &dp.pg));
    free(members);
  }
  bool on_gpu = run_dev.type == TD_DEVICE_CUDA;
  double t_start = ex_now_s();
  td_dtype dt = strcmp(o.dtype, "f64") ? TD_DTYPE_F32 : TD_DTYPE_F64;
  ex_json cfg, res;
  ex_json_object(&cfg);
  ex_json_object(&res);
  td_module *m = NULL;
  char *vocab = NULL;
  corpus c = {0};
  if (o.load) { /* sampling from a checkpoint */
    if (o.generate == 0) ex_die("--load samples from a checkpoint: give --generate N too");
    m = load_checkpoint(o.load, &vocab);
    if (on_gpu) EX_CHECK(td_module_to(m, run_dev));
  } else {
    corpus_load(o.corpus, &c);
    if (c.n - c.n_train <= o.block_size + 1)
      ex_die("the corpus is too short for a validation split of %lld-token windows",
             (long long)o.block_size);
    vocab = strdup(c.vocab);
    td_gpt_config mc = model_config(&o, c.nvocab);
    td_generator *g;
    EX_CHECK(td_generator_create(o.seed, &g));
    dp.rss_before_model = ex_rss_mb();
    dp.tensors_before_model = ex_tensor_mb(false);
    EX_CHECK(td_gpt_create(&mc, g, &m));
    td_generator_destroy(g);
    if (dt != TD_DTYPE_F32) EX_CHECK(td_module_to_dtype(m, dt));
    if (o.init) load_weights(m, o.init, vocab, dt);
    if (on_gpu) EX_CHECK(td_module_to(m, run_dev)); /* before the optimizer state exists */
    if (!strcmp(o.dtype, "bf16") || !strcmp(o.dtype, "f16")) /* autocast: float32 weights */
      EX_CHECK(td_module_set_autocast(m, true, o.dtype[1] == 'f' ? TD_DTYPE_BF16 : TD_DTYPE_F16));
    EX_CHECK(td_gpt_set_activation_checkpointing(m, ckpt_mode(&o)));
    act_probe ap = {0};
    /* the probes measure the CPU allocator: CPU runs only */
    if (!dp.pg && !dp.spare && !on_gpu) activation_probe(m, &c, &o, dt, &ap);
    if (on_gpu) EX_CHECK(td_cuda_memory_peak(run_dev.index, true, NULL));
    train_result r;
    ex_metrics_open(o.metrics, dp.rank, dp.world, wname, "gpt", NULL);
    ex_metrics_rate_name("tokens_per_s");
    train(m, &c, &o, &dp, &r);
    ex_metrics_close();
    /* every replica's tokens, every micro-batch */
    double tokens = (double)o.steps * (double)o.grad_accum * (double)o.batch_size *
                    (double)o.block_size * dp.world;
    ex_json_num(&res, "val_loss", r.val_loss);
    ex_json_num(&res, "train_loss", r.train_loss);
    ex_json_num(&res, "last_batch_loss", r.last_loss);
    ex_json_num(&res, "uniform_loss", log((double)c.nvocab));
    ex_json_num(&res, "tokens_per_s", r.train_s > 0 ? tokens / r.train_s : NAN);
    ex_json_num(&res, "samples_per_s",
                r.train_s > 0 ? (double)o.steps * (double)(o.grad_accum * o.batch_size) / r.train_s
                              : NAN);
    ex_json_num(&res, "last_grad_norm", r.grad_norm); /* before clipping; null without */
    ex_json_int(&res, "skipped_steps", (int64_t)r.skipped_steps);
    ex_json_num(&res, "loss_scale", r.loss_scale); /* null without loss scaling */
    ex_json_num(&res, "train_s", r.train_s);
    /* training tokens per second of CPU time: on a shared host, less sensitive than tokens_per_s
     * to other processes taking the CPU (with one thread) */
    ex_json_num(&res, "tokens_per_cpu_s", r.train_cpu_s > 0 ? tokens / r.train_cpu_s : NAN);
    ex_json_child(&res, "evals", &r.evals);
    char h[24];
    snprintf(h, sizeof h, "%016llx", (unsigned long long)r.hash);
    ex_json_str(&res, "batch_hash", h);
    snprintf(h, sizeof h, "%016llx", (unsigned long long)r.loss_hash);
    ex_json_str(&res, "losses_hash", h); /* equal bits: the same training, step for step */
    ex_json_fini(&r.evals);
    if (dp.pg && o.ft) {
      ex_json_int(&res, "ft_failures", dp.ft_failures);
      ex_json_int(&res, "ft_lost_workers", dp.ft_lost);
      if (o.spares || td_rpc_world_size(agent) > td_rpc_initial_world_size(agent))
        ex_json_int(&res, "ft_joined_workers", dp.ft_joined);
      ex_json_int(&res, "ft_steps_with_failure", dp.ft_steps_with_failure);
      ex_json_int(&res, "ft_shards_recomputed", dp.ft_shards_recomputed);
      if (strcmp(o.dp, "ddp")) ex_json_int(&res, "ft_blocks_copied", dp.ft_blocks_copied);
      ex_json_int(&res, "ft_members_at_end", dp.ft_members);
      ex_json_int(&res, "ft_generation", (int64_t)dp.ft_generation);
      ex_json_num(&res, "ft_recovery_max_s", dp.ft_recovery_max_s);
      /* the fault tolerance's own time per step (td_ft_step_info.machinery_s) and its share */
      ex_json_num(&res, "ft_machinery_s_per_step", o.steps ? dp.ft_machinery_s / (double)o.steps
                                                           : NAN);
      ex_json_num(&res, "ft_machinery_share", r.train_s > 0 ? dp.ft_machinery_s / r.train_s : NAN);
      ex_json_int(&res, "ft_first_commit_after_failure_unix_ms",
                  (int64_t)(dp.ft_first_commit_unix_s * 1000.0));
    } else if (dp.pg) {
      dp_results(&dp, &o, td_module_num_parameters(m), &res);
    } else if (!on_gpu) { /* the CPU allocator's figures (tensor memory; MiB): training peak
                             less what was in use before the model existed, and what the first
                             training forward added */
      ex_json_num(&res, "tensor_peak_mb", ex_tensor_mb(true) - dp.tensors_before_model);
      ex_json_num(&res, "activations_mb", dp.activations);
      activation_json(&ap, &o, &res);
    }
    if (on_gpu) { /* the CUDA caching allocator's peak over training (model, optimizer state,
                     activations, gradients: everything on the GPU) */
      size_t peak = 0;
      EX_CHECK(td_cuda_memory_peak(run_dev.index, false, &peak));
      ex_json_num(&res, "device_peak_mb", (double)peak / 1048576.0);
    }
    /* zero3: the blocks' parameters back into the model (after the memory was measured) */
    if (dp.zero) EX_CHECK(td_zero_gather_params(dp.zero));
    snprintf(h, sizeof h, "%016llx", (unsigned long long)params_hash(m));
    ex_json_str(&res, "params_hash", h); /* equal bits: the same parameters at the end */
    if (o.save && dp.rank == 0) save_checkpoint(m, o.save, vocab);
  }
  td_gpt_config mc;
  EX_CHECK(td_gpt_config_get(m, &mc));
  if (o.generate > 0 && dp.rank == 0) {
    char *text = malloc((size_t)o.generate + 1);
    double t0 = ex_now_s();
    generate(m, vocab, &o, text);
    double dt_gen = ex_now_s() - t0;
    fputs(o.prompt, stdout);
    fputs(text, stdout);
    fputc('\n', stdout);
    ex_json_int(&res, "generated_chars", o.generate);
    ex_json_num(&res, "generate_chars_per_s", dt_gen > 0 ? (double)o.generate / dt_gen : NAN);
    ex_json_str(&res, "sample", text);
    free(text);
  }
  add_config(&cfg, &o, &mc, c.n, m, o.load == NULL);
  char devname[32];
  ex_json_str(&cfg, "device", td_device_str(run_dev, devname, sizeof devname));
  if (dp.pg) {
    ex_json_int(&cfg, "nproc", dp.world);
    ex_json_str(&cfg, "dp", o.dp);
  }
  ex_json_num(&res, "wall_s", ex_now_s() - t_start);
  ex_json_num(&res, "peak_rss_mb", fmax(dp.peak_setup, ex_peak_rss_mb()));
  if (dp.rank == 0) ex_json_print_result("gpt", &cfg, &res, NULL);
  ex_json_fini(&cfg);
  ex_json_fini(&res);
  int rc = 0;
  if (agent) {
    td_ddp_destroy(dp.ddp);
    td_zero_destroy(dp.zero);
    td_process_group_destroy(dp.pg);
    /* with a worker lost (--ft) the graceful shutdown's barrier would wait for it (a spare
     * joined only in place of a lost one; one not needed knows whether any was lost) */
    bool graceful = dp.ft_lost == 0 && !dp.joined && !(dp.spare_released && dp.members_lost);
    if (td_rpc_shutdown(agent, graceful, TD_TIMEOUT_DEFAULT) != TD_OK) {
      fprintf(stderr, "worker%d: shutdown: %s\n", dp.rank, td_last_error());
      rc = 1;
    }
    td_rpc_destroy(agent);
  }
  td_module_unref(m);
  free(vocab);
  corpus_free(&c);
  return agent ? psx_wait_children(rc) : rc;
}
