/* rnn.c - word-level language model with PyTorch's RNN model-parallel layout ("Distributed RNN
 * using Distributed Autograd and Distributed Optimizer"), in C.
 *
 *   build/tools/tdistrun --standalone --nproc-per-node 2 build/examples/rnn --epochs 4
 *   build/examples/rnn --epochs 4          (forks --nproc processes itself when RANK is unset)
 *
 * Rank 0 is the parameter server: it holds the embedding table (Embedding(V, E)) and the decoder
 * (Linear(H, V)) as "nn.Module" objects behind owner RRefs. Ranks 1..N-1 are trainers: each asks
 * the server for the two module RRefs ("rnn_get_modules"), makes RemoteModule handles for them
 * (td_remote_module_from_rref) and holds its own LSTM(E, H). For every chunk of bptt tokens
 * (truncated back-propagation through time), inside a distributed autograd context:
 *   emb    = embedding.forward(x)            on the server         [T, B, E]
 *   out    = lstm(emb, (h, c))               on the trainer        [T, B, H]
 *   logits = decoder.forward(out)            on the server         [T * B, V]
 *   loss   = cross_entropy(logits, y)        on the trainer
 *   td_dist_autograd_backward(ctx, loss); td_dist_optimizer_step(opt, ctx)
 * The distributed optimizer (Adam) covers the server's parameters (td_remote_module_parameters)
 * and the trainer's LSTM parameters as local RRefs, as in PyTorch's example; the hidden state is
 * detached between chunks. With several trainers each one trains its own LSTM on its own shard
 * of the token stream while they share (and update without locks) the server's two modules.
 *
 * Data: examples/data/rnn_corpus.txt (or --corpus FILE): whitespace tokens, "<eos>" at the end of
 * each line, the vocabulary of the whole file; the last 10% of the lines are the validation set.
 * Each trainer evaluates the validation perplexity after every epoch and reports it to the
 * server, which prints it (mean loss over the trainers' token counts).
 *
 * Output: progress on standard error, then rank 0 prints the JSON line (docs/BENCH.md):
 * perplexity (validation, last epoch), samples_per_s (training tokens per second of training
 * time, all trainers), wall_s, epoch_perplexity, first_loss / last_loss (mean training loss of the
 * first / last 5 chunks; the short-mode test checks that it fell) and first_perplexity (the
 * validation perplexity of the untrained model).
 *
 * usage: rnn [--epochs N] [--max-batches N] [--batch-size N] [--lr X] [--bptt N] [--emsize N]
 *            [--nhid N] [--corpus FILE] [--seed N] [--nproc N] [--threads N]
 */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "example_util.h"
#include "metrics.h"
#include "ps_common.h"
#include "watchdog.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/remote_module.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

#define MAX_EPOCHS 1000
#define NFIELDS 8 /* report fields, see rep_field */
#define RNN_TRY(expr)                  \
  do {                                 \
    td_status rnn_s_ = (expr);         \
    if (rnn_s_ != TD_OK) return rnn_s_; \
  } while (0)

enum rep_field { VAL_LOSS_SUM, VAL_TOKENS, TRAIN_LOSS_SUM, BATCHES, TOKENS, TRAIN_S, FIRST, LAST };

/* ---- corpus ---- */

typedef struct corpus {
  char **words; /* vocabulary, index = token id */
  int64_t nvocab, cap;
  int64_t *train, *valid;
  int64_t ntrain, nvalid;
} corpus;

static int64_t vocab_id(corpus *c, const char *w) {
  for (int64_t i = 0; i < c->nvocab; i++) /* small vocabularies: a linear scan is enough */
    if (!strcmp(c->words[i], w)) return i;
  if (c->nvocab == c->cap) {
    c->cap = c->cap ? 2 * c->cap : 256;
    c->words = realloc(c->words, (size_t)c->cap * sizeof *c->words);
    if (!c->words) ex_die("out of memory");
  }
  c->words[c->nvocab] = strdup(w);
  if (!c->words[c->nvocab]) ex_die("out of memory");
  return c->nvocab++;
}

/* find_corpus returns the corpus path: path when given, else examples/data/rnn_corpus.txt
 * relative to the working directory or to the executable (build/examples/rnn in a build tree
 * under the repository). */
static const char *find_corpus(const char *path, char *buf, size_t n) {
  if (path) return path;
  const char *rel = "examples/data/rnn_corpus.txt";
  if (access(rel, R_OK) == 0) return rel;
  char exe[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len > 0) {
    exe[len] = 0;
    for (int up = 0; up < 4; up++) {
      char *slash = strrchr(exe, '/');
      if (!slash) break;
      *slash = 0;
      snprintf(buf, n, "%s/%s", exe, rel);
      if (access(buf, R_OK) == 0) return buf;
    }
  }
  return rel;
}

static void corpus_load(corpus *c, const char *path) {
  memset(c, 0, sizeof *c);
  FILE *f = fopen(path, "r");
  if (!f) ex_die("cannot open the corpus %s (pass --corpus FILE)", path);
  int64_t nlines = 0, ntok = 0, cap = 1 << 16;
  int64_t *toks = malloc((size_t)cap * sizeof *toks);
  int64_t *line_end = NULL, line_cap = 0;
  char line[1 << 14];
  if (!toks) ex_die("out of memory");
  vocab_id(c, "<eos>");
  while (fgets(line, sizeof line, f)) {
    for (char *save = NULL, *w = strtok_r(line, " \t\r\n", &save); ;
         w = strtok_r(NULL, " \t\r\n", &save)) {
      if (ntok + 1 >= cap) {
        cap *= 2;
        toks = realloc(toks, (size_t)cap * sizeof *toks);
        if (!toks) ex_die("out of memory");
      }
      toks[ntok++] = w ? vocab_id(c, w) : 0; /* 0: <eos> */
      if (!w) break;
    }
    if (nlines == line_cap) {
      line_cap = line_cap ? 2 * line_cap : 1024;
      line_end = realloc(line_end, (size_t)line_cap * sizeof *line_end);
      if (!line_end) ex_die("out of memory");
    }
    line_end[nlines++] = ntok;
  }
  fclose(f);
  if (nlines < 10) ex_die("corpus %s: need at least 10 lines", path);
  int64_t split = line_end[nlines - nlines / 10 - 1];
  c->train = toks;
  c->ntrain = split;
  c->valid = malloc((size_t)(ntok - split) * sizeof *c->valid);
  if (!c->valid) ex_die("out of memory");
  memcpy(c->valid, toks + split, (size_t)(ntok - split) * sizeof *toks);
  c->nvalid = ntok - split;
  free(line_end);
}

static void corpus_fini(corpus *c) {
  for (int64_t i = 0; i < c->nvocab; i++) free(c->words[i]);
  free(c->words);
  free(c->train);
  free(c->valid);
}

/* A token stream laid out in B columns (PyTorch's batchify): data[t * B + b] = s[b * len + t]. */
typedef struct stream {
  int64_t *data;
  int64_t len, b;
} stream;

static void batchify(const int64_t *s, int64_t n, int64_t b, stream *out) {
  out->b = b;
  out->len = n / b;
  if (out->len < 2) ex_die("token stream too short (%lld tokens for %lld columns)",
                           (long long)n, (long long)b);
  out->data = malloc((size_t)(out->len * b) * sizeof *out->data);
  if (!out->data) ex_die("out of memory");
  for (int64_t t = 0; t < out->len; t++)
    for (int64_t j = 0; j < b; j++) out->data[t * b + j] = s[j * out->len + t];
}

/* get_chunk returns x [T, B] and y [T * B] (the next tokens) for the chunk starting at row i. */
static int64_t get_chunk(const stream *s, int64_t i, int64_t bptt, td_tensor **x, td_tensor **y) {
  int64_t t = bptt < s->len - 1 - i ? bptt : s->len - 1 - i;
  int64_t xs[2] = {t, s->b}, ys[1] = {t * s->b};
  EX_CHECK(td_tensor_from_buffer(s->data + i * s->b, xs, 2, TD_DTYPE_I64, x));
  EX_CHECK(td_tensor_from_buffer(s->data + (i + 1) * s->b, ys, 1, TD_DTYPE_I64, y));
  return t;
}

/* ---- the model ---- */

/* Factories (args: list [vocab, emsize, nhid, seed]): "rnn_embedding" = Embedding(vocab, emsize)
 * initialised U(-0.1, 0.1) as in PyTorch's word_language_model; "rnn_decoder" = Linear(nhid,
 * vocab) with weight U(-0.1, 0.1) and zero bias. */
static td_status make_part(const void *args, bool decoder, td_module **out) {
  int64_t v[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; i++) RNN_TRY(td_value_as_int(td_value_list_get(args, (size_t)i), &v[i]));
  td_generator *g = NULL;
  RNN_TRY(td_generator_create((uint64_t)v[3] + (decoder ? 1 : 0), &g));
  td_module *m = NULL;
  td_status st = decoder ? td_linear_create(v[2], v[0], true, g, &m)
                         : td_embedding_create(v[0], v[1], g, &m);
  if (st == TD_OK) st = td_nn_init_uniform_(td_module_param(m, "weight"), -0.1, 0.1, g);
  if (st == TD_OK && decoder) st = td_tensor_zero_(td_module_param(m, "bias"));
  td_generator_destroy(g);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}
static td_status embedding_factory(void *ctx, const void *args, td_module **out) {
  return make_part(args, false, out);
}
static td_status decoder_factory(void *ctx, const void *args, td_module **out) {
  return make_part(args, true, out);
}

/* ---- the server's state (rank 0) ---- */

static ex_handout handout; /* [embedding RRef, decoder RRef], for the trainers */

/* rnn_get_modules() -> [embedding RRef, decoder RRef] as soon as the server made it (a future until
 * then: no pool thread waits). */
static td_status rnn_get_modules(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                                 td_future **fut) {
  return ex_handout_get(&handout, fut);
}

/* rnn_report(slot, [NFIELDS doubles]) records a trainer's figures for slot. */
static ex_report_slot report_slots[MAX_EPOCHS + 1];
static ex_reports reports; /* TRAIN_S: the maximum over trainers, other fields: sums */

static td_status rnn_report(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  td_status st = ex_reports_add(&reports, "rnn_report", args, n, 0, NULL);
  if (st != TD_OK) return st;
  *res = td_value_none();
  return TD_OK;
}

static const ex_report_slot *wait_report(int slot, int trainers) {
  return ex_reports_wait(&reports, slot, trainers);
}

typedef struct rnn_cfg {
  int64_t bptt, emsize, nhid, vocab, ntrain, nvalid;
  const char *corpus;
} rnn_cfg;

static int run_server(const ex_args *a, const rnn_cfg *cfg, int trainers, double t_start) {
  fprintf(stderr, "rnn: vocabulary %lld, %lld training and %lld validation tokens, %d trainers, "
          "embedding %lld and decoder on the server, LSTM(%lld, %lld) on each trainer, batch %lld, "
          "bptt %lld, Adam lr %g\n", (long long)cfg->vocab, (long long)cfg->ntrain,
          (long long)cfg->nvalid, trainers, (long long)cfg->emsize, (long long)cfg->emsize,
          (long long)cfg->nhid, (long long)a->batch_size, (long long)cfg->bptt, a->lr);
  ex_json ppl_list, loss_list;
  ex_json_array(&ppl_list);
  ex_json_array(&loss_list);
  const ex_report_slot *r = wait_report(0, trainers);
  double first_ppl = exp(r->v[VAL_LOSS_SUM] / r->v[VAL_TOKENS]), ppl = first_ppl;
  fprintf(stderr, "epoch 0: valid perplexity %.2f (untrained)\n", first_ppl);
  double train_s = 0, tokens = 0, first_loss = NAN, last_loss = NAN;
  for (int e = 0; e < a->epochs; e++) {
    r = wait_report(e + 1, trainers);
    ppl = exp(r->v[VAL_LOSS_SUM] / r->v[VAL_TOKENS]);
    double mean_loss = r->v[BATCHES] > 0 ? r->v[TRAIN_LOSS_SUM] / r->v[BATCHES] : NAN;
    if (e == 0) first_loss = r->v[FIRST] / trainers;
    last_loss = r->v[LAST] / trainers;
    train_s += r->v[TRAIN_S];
    tokens += r->v[TOKENS];
    fprintf(stderr, "epoch %d: train loss %.4f (ppl %.2f), valid perplexity %.2f (%.2fs, %.0f "
            "chunks)\n", e + 1, mean_loss, exp(mean_loss), ppl, r->v[TRAIN_S], r->v[BATCHES]);
    ex_metrics_eval(e + 1, "perplexity", ppl);
    ex_json_num(&ppl_list, NULL, ppl);
    ex_json_num(&loss_list, NULL, mean_loss);
  }
  ex_json config, results;
  ex_json_object(&config);
  ex_json_str(&config, "corpus", cfg->corpus);
  ex_json_int(&config, "vocab", cfg->vocab);
  ex_json_int(&config, "train_tokens", cfg->ntrain);
  ex_json_int(&config, "valid_tokens", cfg->nvalid);
  ex_json_int(&config, "trainers", trainers);
  ex_json_int(&config, "epochs", a->epochs);
  ex_json_int(&config, "batch_size", a->batch_size);
  ex_json_int(&config, "bptt", cfg->bptt);
  ex_json_int(&config, "emsize", cfg->emsize);
  ex_json_int(&config, "nhid", cfg->nhid);
  ex_json_str(&config, "optimizer", "adam");
  ex_json_num(&config, "lr", a->lr);
  ex_json_int(&config, "seed", (int64_t)a->seed);
  ex_json_int(&config, "max_batches", a->max_batches);
  ex_json_int(&config, "threads", ex_blas_threads());
  ex_json_object(&results);
  ex_json_num(&results, "perplexity", ppl);
  ex_json_num(&results, "samples_per_s", train_s > 0 ? tokens / train_s : 0.0);
  ex_json_num(&results, "wall_s", ex_now_s() - t_start);
  ex_json_int(&results, "epochs", a->epochs);
  ex_json_num(&results, "train_s", train_s);
  ex_json_num(&results, "first_perplexity", first_ppl);
  ex_json_num(&results, "first_loss", first_loss);
  ex_json_num(&results, "last_loss", last_loss);
  ex_json_child(&results, "epoch_perplexity", &ppl_list);
  ex_json_child(&results, "epoch_train_loss", &loss_list);
  ex_json_num(&results, "peak_rss_mb", ex_peak_rss_mb());
  const char *const promote[] = {"perplexity", "samples_per_s", "epochs", "wall_s", NULL};
  ex_json_print_result("rnn", &config, &results, promote);
  ex_json_fini(&config);
  ex_json_fini(&results);
  ex_json_fini(&ppl_list);
  ex_json_fini(&loss_list);
  return 0;
}

/* ---- trainers (ranks 1..N-1) ---- */

typedef struct trainer {
  td_rpc_agent *agent;
  td_remote_module *emb, *dec;
  td_module *lstm;
  td_tensor *h, *c; /* hidden state carried between chunks (detached); NULL = zeros */
} trainer;

static void reset_state(trainer *t) {
  td_tensor_unref(t->h);
  td_tensor_unref(t->c);
  t->h = t->c = NULL;
}

/* forward runs one chunk and returns the mean loss tensor (new reference); keeps the detached
 * final state. */
static td_tensor *forward(trainer *t, td_tensor *x, td_tensor *y) {
  td_tensor *emb = NULL, *out = NULL, *flat = NULL, *logits = NULL, *loss = NULL, *hn = NULL,
            *cn = NULL;
  EX_CHECK(td_remote_module_forward(t->emb, x, &emb));
  EX_CHECK(td_lstm_forward(t->lstm, emb, t->h, t->c, &out, &hn, &cn));
  int64_t shape[2] = {-1, td_tensor_size(out, 2)};
  EX_CHECK(td_tensor_reshape(out, shape, 2, &flat));
  EX_CHECK(td_remote_module_forward(t->dec, flat, &logits));
  EX_CHECK(td_tensor_cross_entropy(logits, y, TD_REDUCTION_MEAN, -100, &loss));
  reset_state(t);
  EX_CHECK(td_tensor_detach(hn, &t->h));
  EX_CHECK(td_tensor_detach(cn, &t->c));
  td_tensor_unref(emb);
  td_tensor_unref(out);
  td_tensor_unref(flat);
  td_tensor_unref(logits);
  td_tensor_unref(hn);
  td_tensor_unref(cn);
  return loss;
}

/* evaluate returns the summed loss over the validation stream in *loss_sum and its token count. */
static void evaluate(trainer *t, const stream *val, int64_t bptt, double *loss_sum,
                     double *tokens) {
  bool prev = td_autograd_set_enabled(false);
  reset_state(t);
  double sum = 0, n = 0;
  for (int64_t i = 0; i < val->len - 1; i += bptt) {
    td_tensor *x = NULL, *y = NULL;
    int64_t len = get_chunk(val, i, bptt, &x, &y);
    td_tensor *loss = forward(t, x, y);
    double lv = 0;
    EX_CHECK(td_tensor_item(loss, &lv));
    sum += lv * (double)(len * val->b);
    n += (double)(len * val->b);
    td_tensor_unref(loss);
    td_tensor_unref(x);
    td_tensor_unref(y);
  }
  reset_state(t);
  td_autograd_set_enabled(prev);
  *loss_sum = sum;
  *tokens = n;
}

static int run_trainer(td_rpc_agent *agent, const ex_args *a, const rnn_cfg *cfg,
                       const corpus *cp, int trainers) {
  int tid = td_rpc_rank(agent) - 1;
  trainer t = {agent, NULL, NULL, NULL, NULL, NULL};
  td_value *mods = NULL;
  EX_CHECK(td_rpc_sync(agent, "worker0", "rnn_get_modules", NULL, 0, NULL, &mods));
  td_rref *r = NULL;
  EX_CHECK(td_value_as_rref(td_value_list_get(mods, 0), &r));
  EX_CHECK(td_remote_module_from_rref(agent, r, &t.emb));
  EX_CHECK(td_value_as_rref(td_value_list_get(mods, 1), &r));
  EX_CHECK(td_remote_module_from_rref(agent, r, &t.dec));

  td_generator *g = NULL;
  EX_CHECK(td_generator_create(a->seed + 100 + (uint64_t)tid, &g));
  EX_CHECK(td_lstm_create(cfg->emsize, cfg->nhid, NULL, g, &t.lstm));
  td_generator_destroy(g);

  /* Parameter RRefs: the server's (embedding, decoder) and this trainer's LSTM as local RRefs. */
  td_value *pe = NULL, *pd = NULL;
  EX_CHECK(td_remote_module_parameters(t.emb, &pe));
  EX_CHECK(td_remote_module_parameters(t.dec, &pd));
  td_tensor_list lp;
  td_tensor_list_init(&lp);
  EX_CHECK(td_module_parameters(t.lstm, &lp));
  size_t np = td_value_list_len(pe) + td_value_list_len(pd) + lp.n, k = 0;
  td_rref **prefs = calloc(np, sizeof *prefs);
  if (!prefs) ex_die("out of memory");
  for (size_t i = 0; i < td_value_list_len(pe); i++, k++) {
    EX_CHECK(td_value_as_rref(td_value_list_get(pe, i), &prefs[k]));
    td_rref_ref(prefs[k]);
  }
  for (size_t i = 0; i < td_value_list_len(pd); i++, k++) {
    EX_CHECK(td_value_as_rref(td_value_list_get(pd, i), &prefs[k]));
    td_rref_ref(prefs[k]);
  }
  for (size_t i = 0; i < lp.n; i++, k++) {
    td_value *v = td_value_tensor(lp.tensors[i]);
    if (!v) ex_die("out of memory");
    EX_CHECK(td_rref_create_local(agent, v, &prefs[k]));
    td_value_unref(v);
  }
  td_optim_options oo;
  td_optim_options_init(&oo, TD_OPTIM_ADAM);
  oo.lr = a->lr;
  td_dist_optimizer *opt = NULL;
  EX_CHECK(td_dist_optimizer_create(agent, &oo, prefs, np, &opt));

  /* This trainer's shard of the training stream, and the validation stream. */
  int64_t shard = cfg->ntrain / trainers;
  stream tr, va;
  batchify(cp->train + (int64_t)tid * shard, shard, a->batch_size, &tr);
  batchify(cp->valid, cp->nvalid, 10, &va);
  int64_t nb = (tr.len - 1 + cfg->bptt - 1) / cfg->bptt;
  if (a->max_batches > 0 && a->max_batches < nb) nb = a->max_batches;
  ex_losses losses = {0};

  double rep[NFIELDS] = {0};
  evaluate(&t, &va, cfg->bptt, &rep[VAL_LOSS_SUM], &rep[VAL_TOKENS]);
  td_value_unref(ex_report_send(agent, "rnn_report", 0, rep, NFIELDS));
  for (int epoch = 0; epoch < a->epochs; epoch++) {
    ex_progress bar;
    char label[48];
    snprintf(label, sizeof label, "trainer %d epoch %d/%d", tid + 1, epoch + 1, a->epochs);
    if (tid == 0) ex_progress_start(&bar, label, nb);
    reset_state(&t);
    double t0 = ex_now_s(), loss_sum = 0, tokens = 0;
    int64_t b = 0;
    for (int64_t i = 0; b < nb && i < tr.len - 1; i += cfg->bptt, b++) {
      td_tensor *x = NULL, *y = NULL;
      int64_t len = get_chunk(&tr, i, cfg->bptt, &x, &y);
      double ts = ex_now_s();
      td_dist_autograd_context *ctx = NULL;
      EX_CHECK(td_dist_autograd_context_begin(agent, &ctx));
      td_tensor *loss = forward(&t, x, y);
      double t1 = ex_now_s();
      EX_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false));
      double t2 = ex_now_s();
      EX_CHECK(td_dist_optimizer_step(opt, ctx));
      EX_CHECK(td_dist_autograd_context_end_async(ctx, NULL));
      double lv = 0;
      EX_CHECK(td_tensor_item(loss, &lv));
      if (!isfinite(lv)) ex_die("trainer %d: loss became %g", tid + 1, lv);
      if (ex_metrics_on()) {
        ex_phases ph = {0};
        ex_phases_add(&ph, "forward_s", t1 - ts);
        ex_phases_add(&ph, "backward_s", t2 - t1);
        ex_phases_add(&ph, "step_s", ex_now_s() - t2);
        ex_metrics_step(epoch, epoch * nb + b, lv, NAN, NAN, &ph);
      }
      ex_losses_add(&losses, lv);
      loss_sum += lv;
      tokens += (double)(len * tr.b);
      if (tid == 0) ex_progress_update(&bar, b + 1, "loss %.4f", loss_sum / (double)(b + 1));
      td_tensor_unref(loss);
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    double et = ex_now_s() - t0;
    if (tid == 0) ex_progress_finish(&bar, "loss %.4f", b ? loss_sum / (double)b : NAN);
    memset(rep, 0, sizeof rep);
    evaluate(&t, &va, cfg->bptt, &rep[VAL_LOSS_SUM], &rep[VAL_TOKENS]);
    rep[TRAIN_LOSS_SUM] = loss_sum;
    rep[BATCHES] = (double)b;
    rep[TOKENS] = tokens;
    rep[TRAIN_S] = et;
    rep[FIRST] = ex_losses_first(&losses);
    rep[LAST] = ex_losses_last(&losses);
    td_value_unref(ex_report_send(agent, "rnn_report", epoch + 1, rep, NFIELDS));
  }
  td_dist_optimizer_destroy(opt);
  for (size_t i = 0; i < np; i++) td_rref_unref(prefs[i]);
  free(prefs);
  free(tr.data);
  free(va.data);
  reset_state(&t);
  td_tensor_list_fini(&lp);
  td_value_unref(pe);
  td_value_unref(pd);
  td_module_unref(t.lstm);
  td_remote_module_destroy(t.emb);
  td_remote_module_destroy(t.dec);
  td_value_unref(mods);
  return 0;
}

int main(int argc, char **argv) {
  double t_start = ex_now_s();
  ex_args a;
  ex_args_init(&a);
  a.omit = "model data-dir device";
  a.batch_size = 20;
  a.lr = 0.005;
  a.epochs = 4;
  rnn_cfg cfg = {.bptt = 25, .emsize = 64, .nhid = 128, .corpus = NULL};
  int nproc = 2;
  const ex_opt extra[] = {
      {"bptt", EX_OPT_I64, &cfg.bptt, "tokens per chunk of truncated BPTT"},
      {"emsize", EX_OPT_I64, &cfg.emsize, "embedding size"},
      {"nhid", EX_OPT_I64, &cfg.nhid, "LSTM hidden size"},
      {"corpus", EX_OPT_STRING, &cfg.corpus,
       "text file, one sentence a line (when not given: examples/data/rnn_corpus.txt)"},
      {"nproc", EX_OPT_INT, &nproc,
       "processes to fork when not started by tdistrun (RANK unset)"},
  };
  ex_args_parse(argc, argv, &a, extra, 5,
                "rnn: word-level LSTM language model; embedding and decoder on the parameter "
                "server (rank 0), the LSTM on the trainers (Adam)");
  if (a.epochs < 0 || a.epochs > MAX_EPOCHS) ex_die("--epochs must be in 0..%d", MAX_EPOCHS);
  if (cfg.bptt < 1 || cfg.emsize < 1 || cfg.nhid < 1 || a.batch_size < 1)
    ex_die("--bptt, --emsize, --nhid and --batch-size must be positive");
  char pathbuf[PATH_MAX + 64];
  cfg.corpus = find_corpus(cfg.corpus, pathbuf, sizeof pathbuf);
  corpus cp;
  corpus_load(&cp, cfg.corpus); /* before forking: every process reads the same vocabulary */
  cfg.vocab = cp.nvocab;
  cfg.ntrain = cp.ntrain;
  cfg.nvalid = cp.nvalid;

  psx_spawn_if_alone(nproc);
  int rank = atoi(getenv("RANK"));
  char name[32];
  snprintf(name, sizeof name, "worker%d", rank);
  EX_CHECK(td_rpc_register("rnn_get_modules", rnn_get_modules, NULL));
  ex_handout_init(&handout);
  ex_reports_init(&reports, report_slots, MAX_EPOCHS + 1, NFIELDS, TRAIN_S);
  EX_CHECK(td_rpc_register("rnn_report", rnn_report, NULL));
  ex_watchdog_register(); /* on by default: a lost worker stops the job (watchdog.h) */
  EX_CHECK(td_module_factory_register("rnn_embedding", embedding_factory, NULL));
  EX_CHECK(td_module_factory_register("rnn_decoder", decoder_factory, NULL));
  td_rpc_options ro;
  td_rpc_options_init(&ro);
  td_rpc_agent *agent = NULL;
  EX_CHECK(td_rpc_init_from_env(name, &ro, &agent));
  ex_watchdog_start(agent, NULL);
  int world = td_rpc_world_size(agent);
  if (world < 2) ex_die("rnn needs at least 2 processes (a server and a trainer)");
  int trainers = world - 1;
  ex_metrics_open(a.metrics, rank, world, name, "rnn", NULL);

  int rc;
  if (rank == 0) {
    td_value *margs = td_value_list();
    if (!margs) ex_die("out of memory");
    int64_t mv[4] = {cfg.vocab, cfg.emsize, cfg.nhid, (int64_t)a.seed};
    for (int i = 0; i < 4; i++) EX_CHECK(td_value_list_append(margs, td_value_int(mv[i])));
    td_value *list = td_value_list();
    if (!list) ex_die("out of memory");
    const char *factories[2] = {"rnn_embedding", "rnn_decoder"};
    for (int i = 0; i < 2; i++) {
      td_module *m = NULL;
      td_value *v = NULL;
      td_rref *rr = NULL;
      EX_CHECK(td_module_factory_create(factories[i], margs, &m));
      EX_CHECK(td_value_object("nn.Module", m, &v));
      EX_CHECK(td_rref_create_local(agent, v, &rr));
      EX_CHECK(td_value_list_append(list, td_value_rref(rr)));
      td_rref_unref(rr);
      td_value_unref(v);
    }
    td_value_unref(margs);
    ex_handout_publish(&handout, list);
    rc = run_server(&a, &cfg, trainers, t_start);
  } else {
    rc = run_trainer(agent, &a, &cfg, &cp, trainers);
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
  corpus_fini(&cp);
  return psx_wait_children(rc);
}
