/* gpt_3d.c - the character-level GPT of examples/gpt trained with data x pipeline x tensor
 * parallelism (Megatron's "3D" layout) on one or many hosts.
 *
 *   build/examples/gpt_3d --dp 2 --pp 2 --tp 2 [--steps 20] [--micro-batches 4] [--check]
 *   tdistrun --standalone --nproc-per-node 8 build/examples/gpt_3d --dp 2 --pp 2 --tp 2
 *
 * Ranks: world = dp x pp x tp; rank = (pipeline stage x dp + data rank) x tp + tensor rank, so the
 * members of a tensor-parallel group are neighbours (the group that talks most stays on one host
 * when hosts hold multiples of tp ranks). Every rank builds its groups from this one description:
 *   tensor    the tp ranks of one (stage, data rank): the layers of parallel/ (td_tp_gpt_from)
 *   data      the dp ranks of one (stage, tensor rank): ZeRO-1 (td_zero, stage 1) averages the
 *             gradients and keeps 1/dp of the AdamW state per rank
 *   pipeline  for each (data rank, tensor rank) and stage s < pp-1, two 2-member groups {s, s+1}:
 *             one carries activations forward, the other gradients backward (a member sends with
 *             an asynchronous broadcast from itself, the other receives with a blocking one; two
 *             groups so that the two directions never wait on each other's order)
 *   embedding for pp > 1, {first stage, last stage}: the token table is used by both (input
 *             embedding and tied output head), and their gradients are summed, as Megatron does.
 * Stages own blocks [s L/pp, (s+1) L/pp); the first also the embeddings, the last ln_f and the head.
 *
 * --sequence-parallel: Megatron's sequence parallelism inside each tensor group (td_tp_gpt_options):
 * between the tensor-parallel regions a member holds T/tp positions, so the activations that
 * stages exchange are 1/tp as large too; the whole parameters' gradients are summed over the
 * tensor group after the schedule (td_tp_sync_sequence_parallel_grads).
 *
 * Schedule (--schedule): "gpipe" runs every micro-batch forward, then every backward; "1f1b"
 * (PipeDream-flush) runs pp - s - 1 forwards, then alternates one forward and one backward, then
 * the remaining backwards, so a stage holds at most pp - s micro-batches' activations (GPipe: m).
 * The JSON reports each stage's peak.
 *
 * Data: the corpus and batches of examples/gpt (common/text_corpus.h); each step draws one global
 * batch of --batch-size windows from a generator seeded with --seed + 1 on every rank, data rank d
 * takes rows [d B/dp, (d+1) B/dp) and cuts them into --micro-batches equal micro-batches. The loss
 * of a micro-batch is scaled by 1/m and ZeRO averages over dp, so the gradient is the one-process
 * gradient of the mean loss over the global batch. AdamW with a constant learning rate (--lr),
 * weight decay on the >= 2-d weights, clipping as below.
 *
 * Gradient accumulation (--grad-accum K): a step runs the schedule on K global batches of
 * --batch-size, one after the other (drawn in sequence, so the step sees the windows of one batch
 * of K x --batch-size), each micro-batch's loss scaled by 1/(m K); the gradients accumulate in
 * .grad (the schedule's backward passes add to them, ZeRO-1 has no hooks) and the tied-table,
 * sequence-parallel and ZeRO reductions run once per step, on the sums. --check's reference
 * trains on the concatenated K x --batch-size batch in one backward, so its loss difference
 * checks the accumulation.
 *
 * Clipping (--grad-clip, 1.0): by the whole model's gradient norm, as one process clips: ZeRO sums
 * the squares over the data group and then over the data rank's model group (every stage and
 * tensor rank), each element counted once (td_zero_options.norm_weights: 1/tp for whole tensors,
 * 1/2 for the token table held by the first and the last stage).
 *
 * Checkpoints: --save DIR writes every (stage, tensor rank)'s ZeRO shards (td_zero_save: master
 * values, AdamW state, step count) as DIR/stage<s>-tp<t>.zero-<d>-of-<dp>.safetensors; --resume DIR
 * loads them (td_zero_load: any dp, the same pp and tp), replays the batch stream to the saved
 * step and trains on to --steps.
 *
 * --activation-checkpointing full|selective: every block of the stage keeps only its input (its
 * forward runs again in its backward) or every attention core is recomputed
 * (td_gpt_set_activation_checkpointing on the tensor-parallel GPT); the losses are the same bits
 * (results.losses_hash), and results.forward_kept_mb_per_stage / schedule_tensor_peak_mb_per_stage
 * show the memory a micro-batch's forward keeps and a step's schedule's peak on each stage.
 *
 * --check: the reporting rank (last stage, data rank 0, tensor rank 0) also trains the whole
 * model in one process on the same global batches, reports the largest difference of the
 * losses (results.max_abs_loss_diff_vs_one_process) and prints a verdict: float64 runs agree to
 * ~1e-15 (tolerance 1e-10), float32 to ~2e-7 (tolerance 1e-4), bf16/f16 to about 2e-4 over 10
 * steps (tolerance 2e-3); past the tolerance the reporting rank exits 1.
 *
 * Output: progress on stderr, one JSON line from the reporting rank: {"bench": "gpt_3d", "config",
 * "results": {"losses", "final_loss", "tokens_per_s", "peak_live_microbatches_per_stage", ...}}.
 */
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "example_util.h"
#include "ps_common.h"
#include "tdist/autograd.h"
#include "tdist/collectives.h"
#include "tdist/future.h"
#include "tdist/nn.h"
#include "tdist/optim.h"
#include "tdist/parallel.h"
#include "tdist/tensor.h"
#include "text_corpus.h"

typedef struct opts {
  int64_t steps, batch_size, block_size, n_embd, micro_batches, grad_accum;
  int n_layer, n_head, dp, pp, tp, threads;
  double lr, weight_decay, grad_clip;
  uint64_t seed;
  const char *corpus, *dtype, *schedule, *save, *resume, *ckpt;
  bool check, sequence_parallel;
} opts;

static void opts_parse(int argc, char **argv, opts *o) {
  *o = (opts){.steps = 20, .batch_size = 8, .block_size = 32, .n_embd = 64, .micro_batches = 4,
              .grad_accum = 1, .n_layer = 4, .n_head = 4, .dp = 2, .pp = 2, .tp = 2, .threads = 1, .lr = 1e-3,
              .weight_decay = 0.1, .grad_clip = 1.0, .seed = 1337, .corpus = "/usr/share/games/fortunes",
              .dtype = "f32", .schedule = "1f1b", .ckpt = "none"};
  const ex_opt table[] = {
      {"dp", EX_OPT_INT, &o->dp, "data-parallel size"},
      {"pp", EX_OPT_INT, &o->pp, "pipeline stages"},
      {"tp", EX_OPT_INT, &o->tp, "tensor-parallel size"},
      {"schedule", EX_OPT_STRING, &o->schedule, "pipeline schedule: gpipe or 1f1b"},
      {"micro-batches", EX_OPT_I64, &o->micro_batches, "micro-batches per step and data rank"},
      {"steps", EX_OPT_I64, &o->steps, "training steps"},
      {"batch-size", EX_OPT_I64, &o->batch_size, "sequences per global batch"},
      {"grad-accum", EX_OPT_I64, &o->grad_accum,
       "global batches per optimizer step (gradient accumulation, one reduction per step)"},
      {"block-size", EX_OPT_I64, &o->block_size, "context length"},
      {"n-layer", EX_OPT_INT, &o->n_layer, "transformer blocks (a multiple of pp)"},
      {"n-head", EX_OPT_INT, &o->n_head, "attention heads (a multiple of tp)"},
      {"n-embd", EX_OPT_I64, &o->n_embd, "model width"},
      {"lr", EX_OPT_DOUBLE, &o->lr, "learning rate (AdamW, constant)"},
      {"weight-decay", EX_OPT_DOUBLE, &o->weight_decay, "AdamW decay of the >= 2-d weights"},
      {"grad-clip", EX_OPT_DOUBLE, &o->grad_clip,
       "clip the whole model's gradient norm (over every group) to this; 0: no clipping"},
      {"save", EX_OPT_STRING, &o->save, "at the end, write the checkpoint (ZeRO shards) into DIR"},
      {"resume", EX_OPT_STRING, &o->resume,
       "continue from the checkpoint in DIR (same pp and tp; any dp) up to --steps in all"},
      {"seed", EX_OPT_U64, &o->seed, "init seed; batches use seed+1"},
      {"threads", EX_OPT_INT, &o->threads, "BLAS threads"},
      {"corpus", EX_OPT_STRING, &o->corpus, "text file, or directory of fortune files"},
      {"dtype", EX_OPT_STRING, &o->dtype,
       "compute dtype: f32, f64, or bf16 / f16 (autocast: float32 weights, optimizer state and "
       "stage-to-stage activations, 16-bit matmuls and attention)"},
      {"sequence-parallel", EX_OPT_FLAG, &o->sequence_parallel,
       "split the residual stream along the sequence over the tensor group (T % tp == 0)"},
      {"activation-checkpointing", EX_OPT_STRING, &o->ckpt,
       "recompute activations in backward: none, full (every block keeps only its input) or "
       "selective (every attention core)"},
      {"check", EX_OPT_FLAG, &o->check, "also train the whole model in one process and compare"},
  };
  ex_opts_parse(argc, argv, table, (int)(sizeof table / sizeof table[0]),
                "gpt_3d: the GPT with data x pipeline x tensor parallelism");
  if (o->dp < 1 || o->pp < 1 || o->tp < 1 || o->dp * o->pp * o->tp > 64)
    ex_die("--dp, --pp, --tp must be >= 1 with a product of at most 64");
  if (o->steps < 0 || o->micro_batches < 1 || o->grad_accum < 1 || o->block_size < 1 || o->n_embd < 1 ||
      o->n_head < 1 || o->n_embd % o->n_head || o->threads < 0 || !(o->lr >= 0) ||
      !(o->grad_clip >= 0))
    ex_die("bad option values (see --help)");
  if (o->n_layer < o->pp || o->n_layer % o->pp)
    ex_die("--n-layer %d must be a multiple of --pp %d (each stage takes n-layer/pp blocks)",
           o->n_layer, o->pp);
  if (o->grad_accum > 64) ex_die("--grad-accum must be at most 64");
  if (o->batch_size % ((int64_t)o->dp * o->micro_batches))
    ex_die("--batch-size %lld must be a multiple of dp x micro-batches = %lld",
           (long long)o->batch_size, (long long)o->dp * o->micro_batches);
  if (strcmp(o->schedule, "gpipe") && strcmp(o->schedule, "1f1b"))
    ex_die("--schedule must be gpipe or 1f1b");
  if (strcmp(o->dtype, "f32") && strcmp(o->dtype, "f64") && strcmp(o->dtype, "bf16") &&
      strcmp(o->dtype, "f16"))
    ex_die("--dtype must be f32, f64, bf16 or f16");
  if (strcmp(o->ckpt, "none") && strcmp(o->ckpt, "full") && strcmp(o->ckpt, "selective"))
    ex_die("--activation-checkpointing must be none, full or selective");
  if (o->sequence_parallel && o->block_size % o->tp)
    ex_die("--sequence-parallel splits the context: --block-size %lld must be a multiple of --tp "
           "%d", (long long)o->block_size, o->tp);
}

/* ---- the rank layout and its groups ---- */

typedef struct layout {
  int dp, pp, tp, rank, d, s, t; /* sizes, this rank and its coordinates */
  td_process_group *world, *tensor, *data, *emb;
  td_process_group *model; /* every stage and tensor rank of this data rank (clipping's norm) */
  td_process_group *fwd_prev, *fwd_next, *bwd_prev, *bwd_next; /* pipeline neighbours */
} layout;

static int rank_of(const layout *L, int s, int d, int t) { return (s * L->dp + d) * L->tp + t; }

/* group creates the group of ranks[0..n) (every rank calls it, in the same order) and stores it
 * in *slot when this rank is a member. */
static void group(td_rpc_agent *a, const int *ranks, int n, td_process_group **slot) {
  td_process_group *pg = NULL;
  EX_CHECK(td_process_group_create(a, ranks, n, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  if (pg) *slot = pg;
}

static void layout_make(td_rpc_agent *a, const opts *o, layout *L) {
  memset(L, 0, sizeof *L);
  L->dp = o->dp;
  L->pp = o->pp;
  L->tp = o->tp;
  L->rank = td_rpc_rank(a);
  L->t = L->rank % L->tp;
  L->d = (L->rank / L->tp) % L->dp;
  L->s = L->rank / (L->tp * L->dp);
  int r[64];
  group(a, NULL, 0, &L->world);
  for (int s = 0; s < L->pp; s++)
    for (int d = 0; d < L->dp; d++) {
      for (int t = 0; t < L->tp; t++) r[t] = rank_of(L, s, d, t);
      group(a, r, L->tp, &L->tensor);
    }
  for (int s = 0; s < L->pp; s++)
    for (int t = 0; t < L->tp; t++) {
      for (int d = 0; d < L->dp; d++) r[d] = rank_of(L, s, d, t);
      group(a, r, L->dp, &L->data);
    }
  for (int d = 0; d < L->dp; d++) {
    int n = 0;
    for (int s = 0; s < L->pp; s++)
      for (int t = 0; t < L->tp; t++) r[n++] = rank_of(L, s, d, t);
    group(a, r, n, &L->model);
  }
  for (int d = 0; d < L->dp; d++)
    for (int t = 0; t < L->tp; t++) {
      for (int s = 0; s + 1 < L->pp; s++) {
        int pair[2] = {rank_of(L, s, d, t), rank_of(L, s + 1, d, t)};
        td_process_group **f = L->s == s ? &L->fwd_next : &L->fwd_prev;
        td_process_group **b = L->s == s ? &L->bwd_next : &L->bwd_prev;
        group(a, pair, 2, f);
        group(a, pair, 2, b);
      }
      if (L->pp > 1) {
        int ends[2] = {rank_of(L, 0, d, t), rank_of(L, L->pp - 1, d, t)};
        group(a, ends, 2, &L->emb);
      }
    }
}

static void layout_free(layout *L) {
  td_process_group *all[] = {L->fwd_prev, L->fwd_next, L->bwd_prev, L->bwd_next,
                             L->emb,      L->data,     L->tensor,   L->model, L->world};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (all[i]) td_process_group_destroy(all[i]);
}

/* ---- the stage ---- */

typedef struct stage {
  td_module *model;       /* the tensor-parallel GPT (td_tp_gpt_from); this stage uses a part */
  td_module *wte, *wpe, *ln_f, *head;
  td_module **blocks;     /* this stage's blocks */
  int n_blocks;
  td_tensor_list params;  /* this stage's parameters, with their nanoGPT names */
  td_gpt_config c;
  td_dtype dt;
  bool sp;         /* sequence parallel: activations are [b, T/tp, C] */
  bool autocast;   /* --dtype bf16 / f16: forwards run in an autocast scope of ac_dt */
  td_dtype ac_dt;
} stage;

/* owned tells whether parameter `name` is used by stage s of pp (of a model of L layers). */
static bool owned(const char *name, int s, int pp, int L) {
  bool first = s == 0, last = s == pp - 1;
  if (!strncmp(name, "transformer.wte.", 16)) return first || last; /* tied to the head */
  if (!strncmp(name, "transformer.wpe.", 16)) return first;
  if (!strncmp(name, "transformer.ln_f.", 17) || !strncmp(name, "lm_head.", 8)) return last;
  if (!strncmp(name, "transformer.h.", 14)) {
    int i = atoi(name + 14), per = L / pp;
    return i >= s * per && i < (s + 1) * per;
  }
  return false;
}

static void stage_make(const layout *L, const td_module *whole, bool sp, stage *st) {
  memset(st, 0, sizeof *st);
  EX_CHECK(td_gpt_config_get(whole, &st->c));
  td_tp_gpt_options go;
  td_tp_gpt_options_init(&go);
  go.sequence_parallel = st->sp = sp;
  EX_CHECK(td_tp_gpt_from_ex(L->tensor, whole, &go, &st->model));
  td_module *tr = td_module_child(st->model, "transformer"), *h = td_module_child(tr, "h");
  st->wte = td_module_child(tr, "wte");
  st->wpe = td_module_child(tr, "wpe");
  st->ln_f = td_module_child(tr, "ln_f");
  st->head = td_module_child(st->model, "lm_head");
  int per = st->c.n_layer / L->pp;
  st->blocks = calloc((size_t)per, sizeof *st->blocks);
  if (!st->blocks) ex_die("out of memory");
  for (int i = 0; i < per; i++) {
    char name[16];
    snprintf(name, sizeof name, "%d", L->s * per + i);
    st->blocks[st->n_blocks++] = td_module_child(h, name);
  }
  td_tensor_list all;
  td_tensor_list_init(&all);
  td_tensor_list_init(&st->params);
  EX_CHECK(td_module_named_parameters(st->model, &all));
  for (size_t i = 0; i < all.n; i++)
    if (owned(all.names[i], L->s, L->pp, st->c.n_layer))
      EX_CHECK(td_tensor_list_append(&st->params, all.names[i], all.tensors[i]));
  td_tensor_list_fini(&all);
  st->dt = td_tensor_dtype(st->params.tensors[0]);
}

static void stage_free(stage *st) {
  td_tensor_list_fini(&st->params);
  free(st->blocks);
  td_module_unref(st->model);
}

/* groups_of splits params into AdamW groups: decay for >= 2-d tensors, none for the rest. */
static void groups_of(td_tensor *const *params, size_t n, double wd, td_tensor ***bufs,
                      td_optim_group g[2]) {
  bufs[0] = calloc(n + 1, sizeof(td_tensor *));
  bufs[1] = calloc(n + 1, sizeof(td_tensor *));
  if (!bufs[0] || !bufs[1]) ex_die("out of memory");
  size_t nd = 0, nn = 0;
  for (size_t i = 0; i < n; i++) {
    if (td_tensor_ndim(params[i]) >= 2) bufs[0][nd++] = params[i];
    else bufs[1][nn++] = params[i];
  }
  td_optim_group_init(&g[0], bufs[0], nd);
  td_optim_group_init(&g[1], bufs[1], nn);
  g[0].weight_decay = wd;
  g[1].weight_decay = 0.0;
}

static void adamw_options(const opts *o, td_optim_options *oo) {
  td_optim_options_init(oo, TD_OPTIM_ADAMW);
  oo->lr = o->lr;
  oo->beta2 = 0.99;
}

/* ---- point-to-point through 2-member groups ---- */

typedef struct sends {
  td_future **f;
  td_tensor **t;
  int n, cap;
} sends;

/* send_async sends a copy of x to the other member of pair (this member is `me` in it). */
static void send_async(td_process_group *pair, int me, const td_tensor *x, sends *q) {
  if (q->n == q->cap) {
    q->cap = q->cap ? 2 * q->cap : 16;
    q->f = realloc(q->f, (size_t)q->cap * sizeof *q->f);
    q->t = realloc(q->t, (size_t)q->cap * sizeof *q->t);
    if (!q->f || !q->t) ex_die("out of memory");
  }
  bool prev = td_autograd_set_enabled(false);
  EX_CHECK(td_tensor_clone(x, &q->t[q->n]));
  td_autograd_set_enabled(prev);
  EX_CHECK(td_process_group_broadcast_async(pair, q->t[q->n], me, &q->f[q->n]));
  q->n++;
}

static void sends_wait(sends *q) {
  for (int i = 0; i < q->n; i++) {
    EX_CHECK(td_future_wait(q->f[i], TD_TIMEOUT_INFINITE));
    EX_CHECK(td_future_status(q->f[i]));
    td_future_unref(q->f[i]);
    td_tensor_unref(q->t[i]);
  }
  q->n = 0;
}

/* recv receives a [B, T, C] tensor from the other member (group rank `from`) of pair. */
static td_tensor *recv(td_process_group *pair, int from, const int64_t *shape, td_dtype dt) {
  td_tensor *t = NULL;
  EX_CHECK(td_tensor_empty(shape, 3, dt, td_device_cpu(), &t));
  EX_CHECK(td_process_group_broadcast(pair, t, from));
  return t;
}

/* ---- one training step ---- */

typedef struct micro {
  td_tensor *idx, *tgt; /* int64 [b, T] */
  td_tensor *in;        /* the received activation (leaf requiring grad); NULL on stage 0 */
  td_tensor *out;       /* the stage's output, or the scaled loss on the last stage */
} micro;

typedef struct step_ctx {
  const layout *L;
  stage *st;
  micro *mb;
  int m;
  sends q;
  int live, peak;
  double share;    /* each micro-batch's loss is multiplied by this: 1 / (m x grad_accum) */
  double loss;     /* last stage: the sum of the scaled micro-batch losses */
  double *kept_mb; /* when not NULL: set to what the first forward kept (tensor MiB) */
} step_ctx;

static void forward_body(step_ctx *c, int i);

/* forward runs micro-batch i's forward of this stage, in the stage's autocast scope if any
 * (blocks, head and loss; what crosses to the next stage is the float32 residual stream). */
static void forward(step_ctx *c, int i) {
  double before = ex_tensor_mb(false);
  if (c->st->autocast) EX_CHECK(td_autocast_begin(c->st->ac_dt));
  forward_body(c, i);
  if (c->st->autocast) td_autocast_end(); /* drops the scope's weight casts */
  if (c->kept_mb && i == 0) *c->kept_mb = ex_tensor_mb(false) - before;
}

static void forward_body(step_ctx *c, int i) {
  const layout *L = c->L;
  stage *st = c->st;
  micro *u = &c->mb[i];
  int64_t T = td_tensor_size(u->idx, 1), Tl = st->sp ? T / L->tp : T, p0 = st->sp ? L->t * Tl : 0;
  int64_t shape[3] = {td_tensor_size(u->idx, 0), Tl, st->c.n_embd};
  td_tensor *x = NULL, *y = NULL;
  if (L->s == 0) { /* with sequence parallelism, this member's positions [p0, p0 + T/tp) */
    td_tensor *pos = NULL, *tok = NULL, *pe = NULL;
    EX_CHECK(td_tensor_arange((double)p0, (double)(p0 + Tl), 1, TD_DTYPE_I64, td_device_cpu(),
                              &pos));
    EX_CHECK(td_module_forward(st->wte, u->idx, &tok));
    EX_CHECK(td_module_forward(st->wpe, pos, &pe));
    EX_CHECK(td_tensor_add(tok, pe, &x));
    td_tensor_unref(pos);
    td_tensor_unref(tok);
    td_tensor_unref(pe);
  } else {
    u->in = recv(L->fwd_prev, 0, shape, st->dt);
    EX_CHECK(td_tensor_set_requires_grad(u->in, true));
    x = td_tensor_ref(u->in);
  }
  for (int b = 0; b < st->n_blocks; b++) {
    EX_CHECK(td_module_forward(st->blocks[b], x, &y));
    td_tensor_unref(x);
    x = y;
  }
  if (L->s == L->pp - 1) {
    td_tensor *xn = NULL, *logits = NULL, *l2 = NULL, *t1 = NULL, *loss = NULL;
    EX_CHECK(td_module_forward(st->ln_f, x, &xn));
    EX_CHECK(td_module_forward(st->head, xn, &logits));
    int64_t s2[2] = {-1, td_tensor_size(logits, 2)}, s1[1] = {-1};
    EX_CHECK(td_tensor_reshape(logits, s2, 2, &l2));
    EX_CHECK(td_tensor_reshape(u->tgt, s1, 1, &t1));
    EX_CHECK(td_tp_vocab_parallel_cross_entropy(L->tensor, l2, t1, st->c.vocab_size, -1, &loss));
    EX_CHECK(td_tensor_mul_scalar(loss, c->share, &u->out));
    double v = 0;
    EX_CHECK(td_tensor_item(u->out, &v));
    c->loss += v;
    td_tensor *all[] = {x, xn, logits, l2, t1, loss};
    for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) td_tensor_unref(all[k]);
  } else {
    send_async(L->fwd_next, 0, x, &c->q);
    u->out = x;
  }
  if (++c->live > c->peak) c->peak = c->live;
}

static void backward(step_ctx *c, int i) {
  const layout *L = c->L;
  micro *u = &c->mb[i];
  if (L->s == L->pp - 1) {
    EX_CHECK(td_tensor_backward(u->out));
  } else {
    td_tensor *g = recv(L->bwd_next, 1, td_tensor_shape(u->out), c->st->dt);
    EX_CHECK(td_autograd_backward(&u->out, &g, 1, NULL));
    td_tensor_unref(g);
  }
  if (L->s > 0) {
    td_tensor *gin = td_tensor_grad(u->in);
    if (!gin) ex_die("stage %d: no gradient reached the input of micro-batch %d", L->s, i);
    send_async(L->bwd_prev, 1, gin, &c->q);
    td_tensor_unref(gin);
  }
  td_tensor_unref(u->out);
  td_tensor_unref(u->in);
  u->out = u->in = NULL;
  c->live--;
}

/* run_schedule runs the stage's forwards and backwards of m micro-batches in the schedule's
 * order. */
static void run_schedule(step_ctx *c, const char *schedule) {
  int m = c->m;
  if (!strcmp(schedule, "gpipe")) {
    for (int i = 0; i < m; i++) forward(c, i);
    for (int i = 0; i < m; i++) backward(c, i);
  } else {
    int warm = c->L->pp - c->L->s - 1;
    if (warm > m) warm = m;
    for (int i = 0; i < warm; i++) forward(c, i);
    for (int i = 0; i < m - warm; i++) {
      forward(c, warm + i);
      backward(c, i);
    }
    for (int i = m - warm; i < m; i++) backward(c, i);
  }
  sends_wait(&c->q);
}

/* stage_memory returns [what one micro-batch's forward kept on each stage, each stage's schedule
 * peak] (MiB), the worst rank of each stage, on every rank (collective over the world). */
static td_tensor *stage_memory(const layout *L, double kept_mb, double sched_peak_mb) {
  td_tensor *mem = NULL;
  int64_t n2 = 2 * (int64_t)L->pp;
  EX_CHECK(td_tensor_zeros(&n2, 1, TD_DTYPE_F64, td_device_cpu(), &mem));
  ((double *)td_tensor_data(mem))[L->s] = kept_mb;
  ((double *)td_tensor_data(mem))[L->pp + L->s] = sched_peak_mb;
  EX_CHECK(td_process_group_all_reduce(L->world, mem, TD_REDUCE_MAX));
  return mem;
}

static void stage_memory_json(const layout *L, const td_tensor *mem, ex_json *res) {
  const char *keys[2] = {"forward_kept_mb_per_stage", "schedule_tensor_peak_mb_per_stage"};
  for (int k = 0; k < 2; k++) {
    ex_json arr;
    ex_json_array(&arr);
    for (int s = 0; s < L->pp; s++)
      ex_json_num(&arr, NULL, ((const double *)td_tensor_data(mem))[k * L->pp + s]);
    ex_json_child(res, keys[k], &arr);
    ex_json_fini(&arr);
  }
}

/* global_batch draws the step's global batch (every rank alike). */
static void global_batch(const corpus *cp, td_generator *g, const opts *o, batch *b) {
  batch_make(cp->tok, cp->n_train, g, o->batch_size, o->block_size, NULL, b);
}

/* rows returns rows [start, start + n) of t as a new contiguous tensor. */
static td_tensor *rows(const td_tensor *t, int64_t start, int64_t n) {
  td_tensor *v = NULL, *c = NULL;
  EX_CHECK(td_tensor_narrow(t, 0, start, n, &v));
  EX_CHECK(td_tensor_clone(v, &c));
  td_tensor_unref(v);
  return c;
}

/* accumulate draws the step's grad_accum global batches into bs and runs the schedule on each
 * (this data rank's rows, in micro-batches), every micro-batch's loss scaled by
 * 1 / (m x grad_accum): .grad ends with the gradient of the mean loss over all their windows.
 * Returns the last stage's sum of the scaled losses (0 elsewhere); *peak: the most micro-batches
 * this stage held. */
/* Tensor memory (MiB) of this stage: what one micro-batch's forward kept (the run's first), and
 * the most one schedule added (its live micro-batches' activations, the recomputes, the
 * gradients as they appear). */
typedef struct stage_mem {
  double kept_mb, sched_peak_mb;
  bool kept_done;
} stage_mem;

static double accumulate(const layout *L, stage *st, const opts *o, const corpus *cp,
                         td_generator *bg, batch *bs, micro *mb, int *peak, stage_mem *mem) {
  int m = (int)o->micro_batches, K = (int)o->grad_accum;
  int64_t per_rank = o->batch_size / o->dp, per_mb = per_rank / m;
  double loss = 0;
  for (int a = 0; a < K; a++) {
    global_batch(cp, bg, o, &bs[a]);
    for (int i = 0; i < m; i++) {
      int64_t start = L->d * per_rank + i * per_mb;
      mb[i] = (micro){rows(bs[a].x, start, per_mb), rows(bs[a].y, start, per_mb), NULL, NULL};
    }
    step_ctx c = {.L = L, .st = st, .mb = mb, .m = m, .share = 1.0 / ((double)m * K),
                  .kept_mb = mem->kept_done ? NULL : &mem->kept_mb};
    double before = ex_tensor_mb(false);
    td_cpu_reset_peak_memory();
    run_schedule(&c, o->schedule);
    mem->sched_peak_mb = fmax(mem->sched_peak_mb, ex_tensor_mb(true) - before);
    mem->kept_done = true;
    if (c.peak > *peak) *peak = c.peak;
    loss += c.loss;
    for (int i = 0; i < m; i++) {
      td_tensor_unref(mb[i].idx);
      td_tensor_unref(mb[i].tgt);
    }
  }
  return loss;
}

/* sum_partial_grads sums, once per step, the gradients that several members hold parts of: with
 * sequence parallelism the whole parameters' over the tensor group; the token table tied between
 * the first and the last stage (tied: NULL elsewhere) over the embedding group. */
static void sum_partial_grads(const layout *L, stage *st, td_tensor *tied) {
  if (st->sp) {
    td_module *parts[] = {st->wte, st->wpe, st->ln_f, st->head};
    for (int b = 0; b < st->n_blocks; b++)
      EX_CHECK(td_tp_sync_sequence_parallel_grads(L->tensor, st->blocks[b]));
    for (int k = 0; k < 4; k++) {
      bool used = k == 0 || k == 1 ? L->s == 0 : L->s == L->pp - 1;
      if (used) EX_CHECK(td_tp_sync_sequence_parallel_grads(L->tensor, parts[k]));
    }
  }
  if (tied) {
    td_tensor *gt = td_tensor_grad(tied);
    if (!gt) ex_die("no gradient for the tied token table");
    EX_CHECK(td_process_group_all_reduce(L->emb, gt, TD_REDUCE_SUM));
    td_tensor_unref(gt);
  }
}

/* ---- the one-process reference (--check) ---- */

typedef struct reference {
  td_module *model;
  td_optim *opt;
} reference;

static void reference_make(const td_module *whole_src, const opts *o, td_dtype dt,
                           reference *r) {
  td_gpt_config c;
  EX_CHECK(td_gpt_config_get(whole_src, &c));
  td_generator *g = NULL;
  EX_CHECK(td_generator_create(o->seed, &g));
  EX_CHECK(td_gpt_create(&c, g, &r->model));
  td_generator_destroy(g);
  if (dt != TD_DTYPE_F32) EX_CHECK(td_module_to_dtype(r->model, dt));
  td_tensor_list l;
  td_tensor_list_init(&l);
  EX_CHECK(td_module_parameters(r->model, &l));
  td_tensor **bufs[2];
  td_optim_group g2[2];
  groups_of(l.tensors, l.n, o->weight_decay, bufs, g2);
  td_optim_options oo;
  adamw_options(o, &oo);
  EX_CHECK(td_optim_create_groups(&oo, g2, 2, &r->opt));
  free(bufs[0]);
  free(bufs[1]);
  td_tensor_list_fini(&l);
}

/* cat_batches joins n batches along the rows (one batch of their windows, in order). */
static void cat_batches(const batch *bs, int n, batch *out) {
  td_tensor *xs[64], *ys[64];
  for (int i = 0; i < n; i++) xs[i] = bs[i].x, ys[i] = bs[i].y;
  EX_CHECK(td_tensor_cat(xs, n, 0, &out->x));
  EX_CHECK(td_tensor_cat(ys, n, 0, &out->y));
}

static double reference_step(reference *r, const batch *b, double clip) {
  td_tensor *logits = NULL, *loss = NULL;
  td_optim_zero_grad(r->opt);
  EX_CHECK(td_gpt_forward(r->model, b->x, b->y, &logits, &loss));
  EX_CHECK(td_tensor_backward(loss));
  if (clip > 0) EX_CHECK(td_optim_clip_grad_norm(r->opt, clip, 2.0, NULL));
  EX_CHECK(td_optim_step(r->opt));
  double v = 0;
  EX_CHECK(td_tensor_item(loss, &v));
  td_tensor_unref(logits);
  td_tensor_unref(loss);
  return v;
}

/* resume loads the ZeRO shards saved under prefix (any data-parallel size). */
static void resume(td_zero *z, const char *prefix) {
  char pat[4200];
  snprintf(pat, sizeof pat, "%s.zero-*-of-*.safetensors", prefix);
  glob_t g;
  if (glob(pat, 0, NULL, &g) != 0 || g.gl_pathc == 0)
    ex_die("no checkpoint %s (saved with other --pp/--tp, or not saved)", pat);
  EX_CHECK(td_zero_load(z, (const char *const *)g.gl_pathv, g.gl_pathc));
  globfree(&g);
}

/* ---- main ---- */

int main(int argc, char **argv) {
  opts o;
  opts_parse(argc, argv, &o);
  ex_blas_set_threads(o.threads);
  int world = o.dp * o.pp * o.tp;
  if (world == 1 && !getenv("RANK") && !getenv("SLURM_PROCID") && !getenv("OMPI_COMM_WORLD_RANK"))
    ex_die("dp x pp x tp is 1: examples/gpt trains the model in one process");
  psx_spawn_if_alone(world);
  char wname[32];
  snprintf(wname, sizeof wname, "worker%s", getenv("RANK"));
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(wname, NULL, &agent));
  if (td_rpc_world_size(agent) != world)
    ex_die("the job has %d workers but dp x pp x tp = %d", td_rpc_world_size(agent), world);
  layout L;
  layout_make(agent, &o, &L);
  bool reporter = L.s == L.pp - 1 && L.d == 0 && L.t == 0;
  td_dtype dt = strcmp(o.dtype, "f64") ? TD_DTYPE_F32 : TD_DTYPE_F64;

  corpus cp;
  corpus_load(o.corpus, &cp);
  td_gpt_config mc;
  td_gpt_config_init(&mc);
  mc.vocab_size = cp.nvocab;
  mc.block_size = o.block_size;
  mc.n_layer = o.n_layer;
  mc.n_head = o.n_head;
  mc.n_embd = o.n_embd;
  if (o.n_head % o.tp || (4 * o.n_embd) % o.tp)
    ex_die("--n-head %d and 4 x --n-embd must be multiples of --tp %d", o.n_head, o.tp);

  /* every rank builds the whole model from the seed and keeps its slice */
  td_module *whole = NULL;
  td_generator *g = NULL;
  EX_CHECK(td_generator_create(o.seed, &g));
  EX_CHECK(td_gpt_create(&mc, g, &whole));
  td_generator_destroy(g);
  if (dt != TD_DTYPE_F32) EX_CHECK(td_module_to_dtype(whole, dt));
  stage st;
  stage_make(&L, whole, o.sequence_parallel, &st);
  td_checkpoint_mode cm = !strcmp(o.ckpt, "full")        ? TD_CHECKPOINT_FULL
                          : !strcmp(o.ckpt, "selective") ? TD_CHECKPOINT_SELECTIVE
                                                         : TD_CHECKPOINT_NONE;
  EX_CHECK(td_gpt_set_activation_checkpointing(st.model, cm));
  reference ref = {0};
  if (reporter && o.check) reference_make(whole, &o, dt, &ref);
  td_module_unref(whole);
  if (!strcmp(o.dtype, "bf16") || !strcmp(o.dtype, "f16")) {
    st.autocast = true;
    st.ac_dt = o.dtype[1] == 'f' ? TD_DTYPE_BF16 : TD_DTYPE_F16;
    if (ref.model) EX_CHECK(td_module_set_autocast(ref.model, true, st.ac_dt));
  }

  td_tensor **bufs[2];
  td_optim_group og[2];
  groups_of(st.params.tensors, st.params.n, o.weight_decay, bufs, og);
  td_optim_options oo;
  adamw_options(&o, &oo);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = 1;
  /* clipping by the whole model's norm: squares summed over the data rank's model group, each
   * element once (whole tensors are on every tensor rank, the tied table on two stages) */
  size_t np = og[0].n + og[1].n;
  double *w = calloc(np + 1, sizeof *w);
  if (!w) ex_die("out of memory");
  for (size_t k = 0, i = 0; k < 2; k++)
    for (size_t j = 0; j < og[k].n; j++, i++) {
      td_tp_split sp;
      EX_CHECK(td_tp_param_split(st.model, og[k].params[j], &sp));
      w[i] = sp.dim < 0 ? 1.0 / L.tp : 1.0;
      if (L.emb && td_tensor_list_find(&st.params, "transformer.wte.weight") == og[k].params[j])
        w[i] *= 0.5;
    }
  zo.max_grad_norm = o.grad_clip;
  zo.norm_group = L.model;
  zo.norm_weights = w;
  zo.n_norm_weights = np;
  td_zero *zero = NULL;
  EX_CHECK(td_zero_create(L.data, &oo, og, 2, &zo, &zero));
  free(w);
  free(bufs[0]);
  free(bufs[1]);
  char prefix[4096];
  int64_t first = 0; /* steps already done (a resumed run) */
  if (o.resume) {
    snprintf(prefix, sizeof prefix, "%s/stage%d-tp%d", o.resume, L.s, L.t);
    resume(zero, prefix);
    td_zero_stats zs;
    EX_CHECK(td_zero_get_stats(zero, &zs));
    first = (int64_t)zs.steps;
    if (first > o.steps) ex_die("the checkpoint in %s is at step %lld, past --steps %lld",
                                o.resume, (long long)first, (long long)o.steps);
  }
  td_tensor *tied = L.emb ? td_tensor_list_find(&st.params, "transformer.wte.weight") : NULL;

  td_generator *bg = NULL;
  EX_CHECK(td_generator_create(o.seed + 1, &bg));
  micro *mb = calloc((size_t)o.micro_batches, sizeof *mb);
  ex_json losses;
  ex_json_array(&losses);
  double max_diff = 0, t0 = ex_now_s(), t1 = NAN, last = NAN;
  int peak = 0;
  stage_mem mem = {0};
  uint64_t loss_hash = 0xcbf29ce484222325ull; /* the bits of every step's loss (FNV-1a) */
  ex_progress p;
  int K = (int)o.grad_accum;
  batch *bs = calloc((size_t)K, sizeof *bs); /* a step's K global batches */
  if (!bs) ex_die("out of memory");
  for (int64_t it = 0; it < first; it++) { /* the batches the checkpoint's steps saw */
    for (int a = 0; a < K; a++) global_batch(&cp, bg, &o, &bs[a]);
    if (reporter && o.check) {
      batch whole;
      cat_batches(bs, K, &whole);
      reference_step(&ref, &whole, o.grad_clip);
      batch_free(&whole);
    }
    for (int a = 0; a < K; a++) batch_free(&bs[a]);
  }
  ex_progress_start(&p, "gpt_3d", reporter ? o.steps - first : 0);
  for (int64_t it = first; it < o.steps; it++) {
    td_zero_zero_grad(zero);
    double step_loss = accumulate(&L, &st, &o, &cp, bg, bs, mb, &peak, &mem);
    sum_partial_grads(&L, &st, tied);
    EX_CHECK(td_zero_step(zero));
    /* the step's loss: the last stage's, averaged over the data ranks */
    td_tensor *lt = NULL;
    int64_t one = 1;
    double lv = L.s == L.pp - 1 ? step_loss : 0;
    EX_CHECK(td_tensor_from_buffer(&lv, &one, 1, TD_DTYPE_F64, &lt));
    if (L.s == L.pp - 1) EX_CHECK(td_process_group_all_reduce(L.data, lt, TD_REDUCE_AVG));
    last = *(const double *)td_tensor_data(lt);
    td_tensor_unref(lt);
    if (reporter) {
      ex_json_num(&losses, NULL, last);
      ex_hash_double(&loss_hash, last);
      if (o.check) { /* one backward on the step's K x batch-size windows */
        batch whole;
        cat_batches(bs, K, &whole);
        double rl = reference_step(&ref, &whole, o.grad_clip);
        batch_free(&whole);
        if (!(fabs(rl - last) <= max_diff)) max_diff = fabs(rl - last);
      }
      ex_progress_update(&p, it + 1 - first, "loss %.4f", last);
    }
    for (int a = 0; a < K; a++) batch_free(&bs[a]);
    if (it == first) t1 = ex_now_s(); /* the steps after the first (warm-up) are timed apart */
  }
  double wall = ex_now_s() - t0, wall1 = ex_now_s() - t1;
  if (o.save) {
    if (mkdir(o.save, 0700) != 0 && errno != EEXIST) ex_die("cannot make %s", o.save);
    snprintf(prefix, sizeof prefix, "%s/stage%d-tp%d", o.save, L.s, L.t);
    EX_CHECK(td_zero_save(zero, prefix));
    if (reporter) fprintf(stderr, "gpt_3d: checkpoint of step %lld in %s\n", (long long)o.steps,
                          o.save);
  }
  if (reporter) ex_progress_finish(&p, "loss %.4f", last);

  /* every stage's peak of live micro-batches, gathered to every rank (MAX over a [pp] vector) */
  td_tensor *peaks = NULL;
  int64_t npp = L.pp;
  EX_CHECK(td_tensor_zeros(&npp, 1, TD_DTYPE_F64, td_device_cpu(), &peaks));
  ((double *)td_tensor_data(peaks))[L.s] = peak;
  EX_CHECK(td_process_group_all_reduce(L.world, peaks, TD_REDUCE_MAX));
  td_tensor *memt = stage_memory(&L, mem.kept_mb, mem.sched_peak_mb);
  if (reporter) {
    ex_json cfg, res, pk;
    ex_json_object(&cfg);
    ex_json_object(&res);
    ex_json_int(&cfg, "dp", o.dp);
    ex_json_int(&cfg, "pp", o.pp);
    ex_json_int(&cfg, "tp", o.tp);
    ex_json_int(&cfg, "world", world);
    ex_json_str(&cfg, "schedule", o.schedule);
    ex_json_int(&cfg, "micro_batches", o.micro_batches);
    ex_json_int(&cfg, "batch_size", o.batch_size);
    ex_json_int(&cfg, "grad_accum", o.grad_accum);
    ex_json_int(&cfg, "block_size", o.block_size);
    ex_json_int(&cfg, "n_layer", o.n_layer);
    ex_json_int(&cfg, "n_head", o.n_head);
    ex_json_int(&cfg, "n_embd", o.n_embd);
    ex_json_int(&cfg, "vocab_size", cp.nvocab);
    ex_json_int(&cfg, "steps", o.steps);
    ex_json_str(&cfg, "dtype", o.dtype);
    ex_json_num(&cfg, "grad_clip", o.grad_clip);
    ex_json_bool(&cfg, "sequence_parallel", o.sequence_parallel);
    ex_json_str(&cfg, "activation_checkpointing", o.ckpt);
    ex_json_child(&res, "losses", &losses);
    ex_json_num(&res, "final_loss", last);
    ex_json_int(&res, "first_step", first);
    ex_json_num(&res, "wall_s", wall);
    int64_t after = o.steps - first - 1;
    ex_json_num(&res, "samples_per_s_after_first_step",
                after > 0 && wall1 > 0 ? (double)(after * K * o.batch_size) / wall1 : 0);
    ex_json_num(&res, "tokens_per_s", /* every micro-batch of every global batch */
                wall > 0 ? (double)((o.steps - first) * K * o.batch_size * o.block_size) / wall
                         : 0);
    ex_json_array(&pk);
    for (int s = 0; s < L.pp; s++)
      ex_json_num(&pk, NULL, ((const double *)td_tensor_data(peaks))[s]);
    ex_json_child(&res, "peak_live_microbatches_per_stage", &pk);
    ex_json_fini(&pk);
    stage_memory_json(&L, memt, &res);
    char hash[24];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)loss_hash);
    ex_json_str(&res, "losses_hash", hash);
    if (o.check) ex_json_num(&res, "max_abs_loss_diff_vs_one_process", max_diff);
    ex_json_print_result("gpt_3d", &cfg, &res, NULL);
    ex_json_fini(&cfg);
    ex_json_fini(&res);
  }
  ex_json_fini(&losses);
  td_tensor_unref(peaks);
  td_tensor_unref(memt);
  if (ref.model) {
    td_optim_destroy(ref.opt);
    td_module_unref(ref.model);
  }
  free(mb);
  free(bs);
  td_generator_destroy(bg);
  td_zero_destroy(zero);
  int rc = 0;
  if (reporter && o.check) {
    /* the tolerance of the comparison with the one-process run: float64 agrees to rounding
     * (~1e-15 measured), float32 to ~2e-7, the 16-bit dtypes to their own precision (the
     * split model rounds its partial sums in other places) */
    double tol = dt == TD_DTYPE_F64 ? 1e-10 : st.autocast ? 2e-3 : 1e-4;
    bool ok = max_diff <= tol;
    fprintf(stderr, "gpt_3d: --check %s: the largest |loss - one-process loss| is %.3g (%s, "
            "tolerance %.0e)\n", ok ? "passed" : "FAILED", max_diff, o.dtype, tol);
    if (!ok) rc = 1;
  }
  stage_free(&st);
  corpus_free(&cp);
  layout_free(&L);
  EX_CHECK(td_rpc_shutdown(agent, true, TD_TIMEOUT_DEFAULT));
  td_rpc_destroy(agent);
  int crc = psx_wait_children(0);
  return rc ? rc : crc;
}
