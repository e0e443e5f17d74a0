/* sampler.c - epoch orders, sharding and batching of sample indices; MNIST batch loaders.
 *
 * Each epoch starts from the order 0..n-1, shuffled (when asked) by Fisher-Yates with a
 * td_generator seeded from (seed, epoch), so every rank computes the same permutation without
 * talking to the others. Rank r then takes positions r, r + world, r + 2*world, ... of that order
 * (the layout of PyTorch's DistributedSampler), up to n, or up to n - n mod world with
 * even_shards. The shards are therefore disjoint, and without even_shards they cover 0..n-1.
 * Batches are consecutive runs of batch_size entries of the shard.
 */
#include <string.h>

#include "../core/core.h"
#include "tdist/data.h"

struct td_sampler {
  td_sampler_opts o;
  int64_t n;
  int64_t *order; /* n entries: this epoch's permutation */
  int64_t *shard; /* shard_n entries: this rank's part of the order */
  int64_t shard_n;
  int64_t pos; /* next position in shard */
  uint64_t epoch;
};

void td_sampler_opts_init(td_sampler_opts *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->batch_size = 64;
  o->world = 1;
}

/* bounded returns a uniform integer in [0, bound) (bound > 0) without modulo bias. */
static uint64_t bounded(td_generator *g, uint64_t bound) {
  uint64_t threshold = (0 - bound) % bound; /* 2^64 mod bound */
  for (;;) {
    uint64_t r = td_generator_next_u64(g);
    if (r >= threshold) return r % bound;
  }
}

/* epoch_seed mixes seed and epoch (splitmix64 finaliser) so nearby pairs give unrelated streams. */
static uint64_t epoch_seed(uint64_t seed, uint64_t epoch) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (epoch + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static td_status build_epoch(td_sampler *s) {
  for (int64_t i = 0; i < s->n; i++) s->order[i] = i;
  if (s->o.shuffle && s->n > 1) {
    td_generator *g = NULL;
    TD_TRY(td_generator_create(epoch_seed(s->o.seed, s->epoch), &g));
    for (int64_t i = s->n - 1; i > 0; i--) {
      int64_t j = (int64_t)bounded(g, (uint64_t)i + 1);
      int64_t t = s->order[i];
      s->order[i] = s->order[j];
      s->order[j] = t;
    }
    td_generator_destroy(g);
  }
  int64_t k = 0;
  int64_t limit = s->o.even_shards ? s->n - s->n % s->o.world : s->n;
  for (int64_t p = s->o.rank; p < limit; p += s->o.world) s->shard[k++] = s->order[p];
  TD_ASSERT(k == s->shard_n);
  s->pos = 0;
  return TD_OK;
}

td_status td_sampler_create(int64_t n, const td_sampler_opts *opts, td_sampler **out) {
  TD_CHECK_ARG(out, "td_sampler_create: out must not be NULL");
  td_sampler_opts def;
  td_sampler_opts_init(&def);
  if (!opts) opts = &def;
  TD_CHECK_ARG(n >= 0, "td_sampler_create: negative sample count %lld", (long long)n);
  TD_CHECK_ARG(opts->batch_size > 0, "td_sampler_create: batch_size must be > 0 (got %lld)",
               (long long)opts->batch_size);
  TD_CHECK_ARG(opts->world >= 1 && opts->rank >= 0 && opts->rank < opts->world,
               "td_sampler_create: need 0 <= rank < world (got rank %d, world %d)", opts->rank,
               opts->world);
  td_sampler *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "td_sampler_create: out of memory");
  s->o = *opts;
  s->n = n;
  int64_t limit = opts->even_shards ? n - n % opts->world : n;
  s->shard_n = limit > opts->rank ? (limit - opts->rank + opts->world - 1) / opts->world : 0;
  s->order = td__malloc((size_t)(n ? n : 1) * sizeof(int64_t));
  s->shard = td__malloc((size_t)(s->shard_n ? s->shard_n : 1) * sizeof(int64_t));
  td_status st;
  if (!s->order || !s->shard) {
    st = td_set_error(TD_ERR_NOMEM, "td_sampler_create: cannot allocate %lld indices",
                      (long long)n);
    goto fail;
  }
  if ((st = build_epoch(s)) != TD_OK) goto fail;
  *out = s;
  return TD_OK;
fail:
  td_sampler_destroy(s);
  return st;
}

void td_sampler_destroy(td_sampler *s) {
  if (!s) return;
  td__free(s->order);
  td__free(s->shard);
  td__free(s);
}

td_status td_sampler_set_epoch(td_sampler *s, uint64_t epoch) {
  TD_CHECK_ARG(s, "td_sampler_set_epoch: s must not be NULL");
  s->epoch = epoch;
  return build_epoch(s);
}

td_status td_sampler_next(td_sampler *s, const int64_t **idx, int64_t *n) {
  TD_CHECK_ARG(s && idx && n, "td_sampler_next: arguments must not be NULL");
  int64_t left = s->shard_n - s->pos;
  int64_t take = left < s->o.batch_size ? left : s->o.batch_size;
  if (take <= 0 || (s->o.drop_last && take < s->o.batch_size)) {
    s->pos = s->shard_n;
    *idx = NULL;
    *n = 0;
    return TD_OK;
  }
  *idx = s->shard + s->pos;
  *n = take;
  s->pos += take;
  return TD_OK;
}

int64_t td_sampler_shard_size(const td_sampler *s) { return s ? s->shard_n : 0; }

int64_t td_sampler_num_batches(const td_sampler *s) {
  if (!s) return 0;
  int64_t b = s->o.batch_size;
  return s->o.drop_last ? s->shard_n / b : (s->shard_n + b - 1) / b;
}

uint64_t td_sampler_epoch(const td_sampler *s) { return s ? s->epoch : 0; }

/* ---- MNIST loader ---- */

struct td_mnist_loader {
  const td_mnist *ds;
  td_sampler *sampler;
  bool flatten;
};

td_status td_mnist_loader_create(const td_mnist *ds, const td_sampler_opts *opts, bool flatten,
                                 td_mnist_loader **out) {
  TD_CHECK_ARG(ds && out, "td_mnist_loader_create: ds and out must not be NULL");
  td_mnist_loader *l = td__calloc(1, sizeof *l);
  if (!l) return td_set_error(TD_ERR_NOMEM, "td_mnist_loader_create: out of memory");
  td_status s = td_sampler_create(td_mnist_count(ds), opts, &l->sampler);
  if (s != TD_OK) {
    td__free(l);
    return s;
  }
  l->ds = ds;
  l->flatten = flatten;
  *out = l;
  return TD_OK;
}

void td_mnist_loader_destroy(td_mnist_loader *l) {
  if (!l) return;
  td_sampler_destroy(l->sampler);
  td__free(l);
}

td_status td_mnist_loader_set_epoch(td_mnist_loader *l, uint64_t epoch) {
  TD_CHECK_ARG(l, "td_mnist_loader_set_epoch: l must not be NULL");
  return td_sampler_set_epoch(l->sampler, epoch);
}

td_status td_mnist_loader_next(td_mnist_loader *l, td_tensor **x, td_tensor **y) {
  TD_CHECK_ARG(l && x && y, "td_mnist_loader_next: arguments must not be NULL");
  const int64_t *idx;
  int64_t n;
  TD_TRY(td_sampler_next(l->sampler, &idx, &n));
  if (n == 0) {
    *x = NULL;
    *y = NULL;
    return TD_OK;
  }
  return td_mnist_batch(l->ds, idx, n, l->flatten, x, y);
}

td_sampler *td_mnist_loader_sampler(td_mnist_loader *l) { return l ? l->sampler : NULL; }
