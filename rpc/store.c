/* store.c - rendezvous key-value store: the server-side map and the client operations.
 *
 * The map is an open-addressing hash table of string -> bytes (linear probing, at most half
 * full, capacity a power of two, each slot keeping its key's hash) under one mutex; the server
 * handles each request on the transport's poller thread without blocking. Every operation
 * touches one probe run: a delete uses backward-shift deletion (the entries after the hole that
 * may move back do, so no lookup meets an empty slot before its key) instead of tombstones or a
 * rebuild, so it costs O(1) expected and the table holds only live keys; only an insert that
 * doubles the table touches every entry (amortised O(1)). The table never shrinks: its size
 * follows the most keys held at once. Clients issue one unary call per operation; waits poll with
 * backoff.
 *
 * Range reads (op 7) are remembered: at start-up every worker of a group reads the same tables
 * (worker/0..N-1, registry/0..N-1, ...), and gathering a table of N records costs N key lookups,
 * so serving it to N workers cost rank 0 N^2 lookups (5.3 s of its time at 1,024 simulated
 * workers). The store keeps the last few ranges it gathered (RANGE_MEMO of them, copies of their
 * values) and serves a repeated request from the copy; any change to a key under a remembered
 * prefix forgets that range first, so a reply is always what a gathering would give.
 */
#include "store.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth.h"
#include "tdist.pb-c.h"

typedef struct kv {
  char *key; /* NULL: an empty slot */
  uint8_t *val;
  size_t len;
  size_t hash; /* str_hash(key) */
} kv;

/* A wait (op 8) the server holds until it is answered (td__store_handle_park). Each is on the
 * list of all waits and on its key's group (and its watch key's), so a change to a key looks at
 * the waits about that key only: with every worker of a group waiting on one counter ("joined",
 * "ready"), scanning all waits at every change cost rank 0 O(N^2) (4,096 simulated workers:
 * 1.7 s of its time in the publish phase). */
struct wgroup;
typedef struct parked {
  struct parked *prev, *next;   /* all waits (td__store.waits) */
  struct parked *kprev, *knext; /* the waits on its key (kg->on_key) */
  struct parked *wprev, *wnext; /* the waits watching its watch key (wg->on_watch) */
  struct wgroup *kg, *wg;       /* wg: NULL without a watch key */
  char *key, *watch;    /* watch: NULL for none */
  int64_t target;       /* counter >= target; 0: the key exists */
  uint64_t until_ns;    /* answered unsatisfied then */
  void *token;          /* the parker's */
  const td__store_parker *pk;
} parked;

/* The waits about one key: those on it, with a lower bound of their targets (a change that
 * leaves the counter below it ends none of them: one comparison), and those watching it. */
typedef struct wgroup {
  struct wgroup *next; /* in its bucket */
  char *name;
  size_t hash;
  parked *on_key, *on_watch;
  int64_t min_target;  /* <= every target on_key */
} wgroup;
#define WAIT_BUCKETS 1024

/* A range read remembered (mu): the request (prefix, first, count) and a copy of what it got. */
typedef struct range_memo {
  char *prefix; /* NULL: an unused slot */
  size_t plen;
  int32_t first, count;
  int n;        /* values */
  size_t total; /* their bytes, in buf one after another */
  uint8_t *buf;
  size_t *lens;
} range_memo;
#define RANGE_MEMO 8

/* The last ranges reply (op 10) as packed, for the same request asked again while no remembered
 * range changed (gen), with the SHA-256 its MAC covers: at start-up every worker asks for the
 * same four tables of N records, and building, packing and hashing each reply again made rank 0
 * spend O(N) per worker on work done once (4,096 simulated workers: 2.4 s of its time in the
 * read phase). Only for a request whose watch key is not set (a set one adds its value). */
typedef struct packed_reply {
  char *keys[TD__STORE_RANGES_MAX]; /* the request: prefixes, first, count */
  size_t n_keys;
  int32_t first, count;
  uint8_t *bytes; /* NULL: none */
  size_t len;
  uint8_t digest[TD__AUTH_DIGEST];
  uint64_t gen;
  int found; /* prefixes that brought values: all (the stats a rebuild would count) */
} packed_reply;

struct td__store {
  pthread_mutex_t mu;
  range_memo memo[RANGE_MEMO];
  unsigned memo_next; /* the slot the next new range takes */
  parked *waits; /* waits held (mu) */
  size_t nparked;
  wgroup *wbuckets[WAIT_BUCKETS]; /* the waits' groups, by their key's hash (mu) */
  kv *tab;
  size_t cap, len;
  uint64_t bytes;        /* keys and values held */
  uint64_t moves; /* entries moved to another slot, by growth or by deletes (tests) */
  /* requests served; gets that found their key; range requests that returned values, and those
   * served from a remembered range (tests) */
  uint64_t requests, gets_found, ranges_found, ranges_remembered;
  uint64_t wait_checks; /* parked waits a change looked at (tests) */
  uint64_t range_gen;   /* bumped when a remembered range is forgotten or replaced */
  packed_reply packed;
  uint64_t ranges_packed; /* ranges requests answered from packed (tests) */
};

static size_t str_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
  return (size_t)h;
}

td_status td__store_create(td__store **out) {
  td__store *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  pthread_mutex_init(&s->mu, NULL);
  *out = s;
  return TD_OK;
}

static void memo_clear(range_memo *m) {
  td__free(m->prefix);
  td__free(m->buf);
  td__free(m->lens);
  *m = (range_memo){0};
}

/* Forgets every remembered range that key could belong to (before key changes). mu held. */
static void memo_forget(td__store *s, const char *key) {
  for (int i = 0; i < RANGE_MEMO; i++)
    if (s->memo[i].prefix && strncmp(key, s->memo[i].prefix, s->memo[i].plen) == 0) {
      memo_clear(&s->memo[i]);
      s->range_gen++;
    }
}

static void packed_clear(packed_reply *p) {
  for (size_t i = 0; i < p->n_keys; i++) td__free(p->keys[i]);
  td__free(p->bytes);
  *p = (packed_reply){0};
}

/* Whether the packed reply answers r as a rebuild would now. mu held. */
static bool packed_matches(const td__store *s, const Tdist__StoreRequest *r) {
  const packed_reply *p = &s->packed;
  if (!p->bytes || p->gen != s->range_gen || p->n_keys != r->n_keys || p->first != r->first ||
      p->count != r->count)
    return false;
  for (size_t i = 0; i < r->n_keys; i++)
    if (strcmp(p->keys[i], r->keys[i]) != 0) return false;
  return true;
}

static void parked_free(parked *w) {
  td__free(w->key);
  td__free(w->watch);
  td__free(w);
}

void td__store_destroy(td__store *s) {
  if (!s) return;
  td__store_unpark_all(s);
  for (int i = 0; i < RANGE_MEMO; i++) memo_clear(&s->memo[i]);
  packed_clear(&s->packed);
  for (size_t i = 0; i < s->cap; i++) {
    td__free(s->tab[i].key);
    td__free(s->tab[i].val);
  }
  td__free(s->tab);
  pthread_mutex_destroy(&s->mu);
  td__free(s);
}

static kv *find(td__store *s, const char *key, bool insert) {
  if (insert && (s->len + 1) * 2 > s->cap) {
    size_t nc = s->cap ? s->cap * 2 : 64;
    kv *nt = td__calloc(nc, sizeof *nt);
    if (!nt) return NULL;
    for (size_t i = 0; i < s->cap; i++) {
      if (!s->tab[i].key) continue;
      size_t j = s->tab[i].hash & (nc - 1);
      while (nt[j].key) j = (j + 1) & (nc - 1);
      nt[j] = s->tab[i];
      s->moves++;
    }
    td__free(s->tab);
    s->tab = nt;
    s->cap = nc;
  }
  if (!s->cap) return NULL;
  size_t h = str_hash(key), j = h & (s->cap - 1);
  while (s->tab[j].key) {
    if (s->tab[j].hash == h && strcmp(s->tab[j].key, key) == 0) return &s->tab[j];
    j = (j + 1) & (s->cap - 1);
  }
  if (!insert) return NULL;
  s->tab[j].key = td__strdup(key);
  if (!s->tab[j].key) return NULL;
  s->tab[j].val = NULL;
  s->tab[j].len = 0;
  s->tab[j].hash = h;
  s->len++;
  return &s->tab[j];
}

/* Removes the entry at slot i by backward-shift deletion: walking the probe run after the hole,
 * each entry whose home slot is not cyclically in (hole, its slot] moves into the hole, which
 * moves to where it was. The run ends at the first empty slot; with the table at most half full
 * that is a few slots on average. mu held. */
static void remove_at(td__store *s, size_t i) {
  memo_forget(s, s->tab[i].key);
  size_t m = s->cap - 1;
  s->bytes -= strlen(s->tab[i].key) + s->tab[i].len;
  td__free(s->tab[i].key);
  td__free(s->tab[i].val);
  for (size_t j = (i + 1) & m; s->tab[j].key; j = (j + 1) & m) {
    size_t home = s->tab[j].hash & m;
    bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    s->tab[i] = s->tab[j];
    s->moves++;
    i = j;
  }
  s->tab[i] = (kv){0};
  s->len--;
}

void td__store_stats_get(td__store *s, td__store_stats *out) {
  pthread_mutex_lock(&s->mu);
  *out = (td__store_stats){.keys = s->len, .slots = s->cap, .bytes = s->bytes,
                             .moves = s->moves, .requests = s->requests,
                             .gets_found = s->gets_found, .ranges_found = s->ranges_found,
                             .ranges_remembered = s->ranges_remembered,
                             .wait_checks = s->wait_checks,
                             .ranges_packed = s->ranges_packed};
  pthread_mutex_unlock(&s->mu);
}

static bool set_val(td__store *s, kv *e, const void *v, size_t n) {
  memo_forget(s, e->key);
  uint8_t *b = td__malloc(n + 1);
  if (!b) return false;
  if (n) memcpy(b, v, n);
  b[n] = 0;
  s->bytes = s->bytes - e->len + n;
  td__free(e->val);
  e->val = b;
  e->len = n;
  return true;
}

/* Refuses a set of key to n bytes that would break the store's limits. mu held. */
static td_status check_room(td__store *s, const char *key, size_t n) {
  size_t kl = strlen(key);
  if (kl > TD__STORE_MAX_KEY)
    return td_set_error(TD_ERR_INVALID, "store: key of %zu bytes (limit %d)", kl,
                        TD__STORE_MAX_KEY);
  if (n > TD__STORE_MAX_VALUE)
    return td_set_error(TD_ERR_INVALID, "store: value of %zu bytes for '%.64s' (limit %u)", n,
                        key, TD__STORE_MAX_VALUE);
  kv *e = find(s, key, false);
  uint64_t after = s->bytes + n - (e ? e->len : 0) + (e ? 0 : kl);
  if ((!e && s->len >= TD__STORE_MAX_KEYS) || after > TD__STORE_MAX_BYTES)
    return td_set_error(TD_ERR_NOMEM, "store: full (%zu keys, %llu bytes; limits %d keys, %llu "
                        "bytes)", s->len, (unsigned long long)s->bytes, TD__STORE_MAX_KEYS,
                        (unsigned long long)TD__STORE_MAX_BYTES);
  return TD_OK;
}

/* Sets key to n bytes at v, the key inserted when new (its limits checked by the caller). mu
 * held. */
static td_status put(td__store *s, const char *key, const void *v, size_t n) {
  kv *e = find(s, key, true);
  if (e && !e->val) s->bytes += strlen(key);
  if (!e || !set_val(s, e, v, n)) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  return TD_OK;
}

/* Op 3 (and op 9's end): adds delta to the counter at key, rep->number the result. mu held. */
static td_status add_op(td__store *s, const char *key, int64_t delta, Tdist__StoreReply *rep) {
  TD_TRY(check_room(s, key, 24));
  kv *e = find(s, key, true);
  if (e && !e->val) s->bytes += strlen(key);
  if (!e) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  int64_t cur = e->val ? strtoll((const char *)e->val, NULL, 10) : 0;
  cur += delta;
  char num[32];
  int n = snprintf(num, sizeof num, "%lld", (long long)cur);
  if (!set_val(s, e, num, (size_t)n)) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  rep->number = cur;
  rep->found = true;
  return TD_OK;
}

/* Op 9's limits, checked before any of its sets (so a refused publish changes nothing): every
 * key and value as for a set, and room for all of them at once. mu held. */
static td_status publish_room(td__store *s, const Tdist__StoreRequest *r) {
  if (r->n_keys != r->n_values || r->n_keys > TD__STORE_PUBLISH_MAX)
    return td_set_error(TD_ERR_INVALID, "store: publish of %zu keys and %zu values (at most %d "
                        "pairs)", r->n_keys, r->n_values, TD__STORE_PUBLISH_MAX);
  uint64_t bytes = 0;
  for (size_t i = 0; i < r->n_keys; i++) {
    TD_TRY(check_room(s, r->keys[i], r->values[i].len));
    bytes += strlen(r->keys[i]) + r->values[i].len;
  }
  if (s->len + r->n_keys > TD__STORE_MAX_KEYS || s->bytes + bytes > TD__STORE_MAX_BYTES)
    return td_set_error(TD_ERR_NOMEM, "store: full (%zu keys, %llu bytes; limits %d keys, %llu "
                        "bytes)", s->len, (unsigned long long)s->bytes, TD__STORE_MAX_KEYS,
                        (unsigned long long)TD__STORE_MAX_BYTES);
  return TD_OK;
}

td_status td__store_local_set(td__store *s, const char *key, const void *v, size_t n) {
  pthread_mutex_lock(&s->mu);
  td_status st = put(s, key, v, n);
  pthread_mutex_unlock(&s->mu);
  return st;
}

/* What a range reply points into (freed after packing). */
typedef struct range_buf {
  uint8_t *buf;
  ProtobufCBinaryData *vals;
} range_buf;

/* key = prefix + decimal i into key[] (room for TD__STORE_MAX_KEY + 1; the caller checked
 * that prefix leaves 12 bytes), without printf's cost: a range does this once per value. */
static void range_key(char *key, const char *prefix, size_t plen, int64_t i) {
  char d[24];
  int nd = 0;
  do d[nd++] = (char)('0' + i % 10);
  while ((i /= 10) > 0);
  memcpy(key, prefix, plen);
  for (int k = 0; k < nd; k++) key[plen + (size_t)k] = d[nd - 1 - k];
  key[plen + (size_t)nd] = 0;
}

/* The reply's values: a copy of m's (which stays the store's). mu held. */
static td_status range_fill(const range_memo *m, Tdist__StoreReply *rep, range_buf *rg) {
  rg->vals = td__calloc((size_t)(m->n ? m->n : 1), sizeof *rg->vals);
  rg->buf = td__malloc(m->total ? m->total : 1);
  if (!rg->vals || !rg->buf) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  if (m->total) memcpy(rg->buf, m->buf, m->total);
  size_t off = 0;
  for (int i = 0; i < m->n; i++) {
    rg->vals[i] = (ProtobufCBinaryData){m->lens[i], rg->buf + off};
    off += m->lens[i];
  }
  rep->n_values = (size_t)m->n;
  rep->values = rg->vals;
  rep->number = m->n;
  rep->found = m->n == m->count;
  return TD_OK;
}

/* Op 7: copies the values of prefix+first, prefix+first+1, ... while they exist, at most count of
 * them (TD__STORE_RANGE_MAX) and, past the first, at most TD__STORE_RANGE_BYTES in all, so one
 * reply stays far below a message's limit whatever the values. mu held. */
static td_status range_get(td__store *s, const char *prefix, int32_t first, int32_t count,
                           Tdist__StoreReply *rep, range_buf *rg) {
  size_t plen = strlen(prefix);
  if (first < 0 || count < 0 || plen > TD__STORE_MAX_KEY - 12)
    return td_set_error(TD_ERR_INVALID, "store: bad range (first %d, count %d)", first, count);
  if (count > TD__STORE_RANGE_MAX) count = TD__STORE_RANGE_MAX;
  for (int i = 0; i < RANGE_MEMO; i++) {
    range_memo *m = &s->memo[i];
    if (m->prefix && m->first == first && m->count == count && strcmp(m->prefix, prefix) == 0) {
      s->ranges_remembered++;
      return range_fill(m, rep, rg);
    }
  }
  char key[TD__STORE_MAX_KEY + 1];
  kv **got = td__malloc((size_t)(count ? count : 1) * sizeof *got);
  if (!got) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  size_t total = 0;
  int n = 0;
  for (; n < count && first + (int64_t)n <= INT32_MAX; n++) {
    range_key(key, prefix, plen, first + (int64_t)n);
    kv *e = find(s, key, false);
    if (!e || (n > 0 && total + e->len > TD__STORE_RANGE_BYTES)) break;
    got[n] = e;
    total += e->len;
  }
  range_memo m = {.plen = plen, .first = first, .count = count, .n = n, .total = total};
  m.prefix = td__strdup(prefix);
  m.buf = td__malloc(total ? total : 1);
  m.lens = td__malloc((size_t)(n ? n : 1) * sizeof *m.lens);
  td_status st = TD_OK;
  if (!m.prefix || !m.buf || !m.lens) st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
  size_t off = 0;
  for (int i = 0; st == TD_OK && i < n; i++) {
    if (got[i]->len) memcpy(m.buf + off, got[i]->val, got[i]->len);
    m.lens[i] = got[i]->len;
    off += got[i]->len;
  }
  td__free(got);
  if (st == TD_OK) st = range_fill(&m, rep, rg);
  if (st == TD_OK && n > 0) { /* kept: the range remembered first gives way */
    range_memo *slot = &s->memo[s->memo_next++ % RANGE_MEMO];
    if (slot->prefix) s->range_gen++;
    memo_clear(slot);
    *slot = m;
  } else {
    memo_clear(&m);
  }
  return st;
}

/* What a ranges reply (op 10) points into. */
typedef struct ranges_buf {
  range_buf part[TD__STORE_RANGES_MAX];
  ProtobufCBinaryData *vals;
  int32_t counts[TD__STORE_RANGES_MAX];
} ranges_buf;

static void ranges_free(ranges_buf *b) {
  for (int i = 0; i < TD__STORE_RANGES_MAX; i++) {
    td__free(b->part[i].buf);
    td__free(b->part[i].vals);
  }
  td__free(b->vals);
}

/* Op 10: op 7 for each prefix (each from the remembered ranges when it can), the values one
 * after another; past the first prefix, one that would take the reply past TD__STORE_RANGE_BYTES
 * gets none, nor do those after it. mu held. */
static td_status ranges_get(td__store *s, const Tdist__StoreRequest *r, Tdist__StoreReply *rep,
                            ranges_buf *b) {
  if (r->n_keys < 1 || r->n_keys > TD__STORE_RANGES_MAX)
    return td_set_error(TD_ERR_INVALID, "store: ranges of %zu prefixes (1 to %d)", r->n_keys,
                        TD__STORE_RANGES_MAX);
  size_t nvals = 0, bytes = 0;
  size_t k = 0;
  for (; k < r->n_keys; k++) {
    Tdist__StoreReply one = TDIST__STORE_REPLY__INIT;
    TD_TRY(range_get(s, r->keys[k], r->first, r->count, &one, &b->part[k]));
    size_t more = 0;
    for (size_t i = 0; i < one.n_values; i++) more += one.values[i].len;
    if (k > 0 && bytes + more > TD__STORE_RANGE_BYTES) break;
    s->ranges_found += one.n_values > 0;
    b->counts[k] = (int32_t)one.n_values;
    nvals += one.n_values;
    bytes += more;
  }
  for (size_t j = k; j < r->n_keys; j++) b->counts[j] = 0;
  b->vals = td__calloc(nvals ? nvals : 1, sizeof *b->vals);
  if (!b->vals) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  size_t at = 0;
  for (size_t j = 0; j < k; j++)
    for (int32_t i = 0; i < b->counts[j]; i++) b->vals[at++] = b->part[j].vals[i];
  rep->n_values = nvals;
  rep->values = b->vals;
  rep->n_counts = r->n_keys;
  rep->counts = b->counts;
  rep->number = (int64_t)nvals;
  return TD_OK;
}

/* The abort key a polling request names: whether it is set, and to what. mu held. */
static td_status watch_get(td__store *s, const char *key, Tdist__StoreReply *rep,
                           uint8_t **copy) {
  kv *e = find(s, key, false);
  if (!e) return TD_OK;
  *copy = td__malloc(e->len + 1);
  if (!*copy) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  memcpy(*copy, e->val, e->len);
  rep->watched = true;
  rep->watch_value = (ProtobufCBinaryData){e->len, *copy};
  return TD_OK;
}

/* Whether the wait w is over: its condition holds or its abort key is set (mu held). */
static bool wait_over(td__store *s, const char *key, int64_t target, const char *watch) {
  kv *e = find(s, key, false);
  if (e && (target <= 0 || (e->val && strtoll((const char *)e->val, NULL, 10) >= target)))
    return true;
  return watch && watch[0] && find(s, watch, false);
}

/* The reply to a wait (op 8) as it stands (mu held): found when its condition holds, the
 * counter in number, the value, and the abort key's value. *reply: td__malloc'd. */
static td_status wait_reply(td__store *s, const char *key, int64_t target, const char *watch,
                            uint8_t **reply, size_t *reply_len) {
  Tdist__StoreReply rep = TDIST__STORE_REPLY__INIT;
  kv *e = find(s, key, false);
  if (e) {
    rep.number = e->val ? strtoll((const char *)e->val, NULL, 10) : 0;
    rep.found = target <= 0 || rep.number >= target;
    rep.value = (ProtobufCBinaryData){e->len, e->val};
  }
  kv *w = watch && watch[0] ? find(s, watch, false) : NULL;
  if (w) {
    rep.watched = true;
    rep.watch_value = (ProtobufCBinaryData){w->len, w->val};
  }
  size_t n = tdist__store_reply__get_packed_size(&rep);
  uint8_t *out = td__malloc(n ? n : 1);
  if (!out) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  tdist__store_reply__pack(&rep, out);
  *reply = out;
  *reply_len = n;
  return TD_OK;
}

/* A parked wait's answer, ready to send once the lock is released. */
typedef struct answer {
  void *token;
  const td__store_parker *pk;
  uint8_t *reply;
  size_t len;
} answer;

/* The group of name (created when make; NULL when there is none or out of memory). mu held. */
static wgroup *group_of(td__store *s, const char *name, bool make) {
  size_t h = str_hash(name);
  wgroup **b = &s->wbuckets[h & (WAIT_BUCKETS - 1)];
  for (wgroup *g = *b; g; g = g->next)
    if (g->hash == h && strcmp(g->name, name) == 0) return g;
  if (!make) return NULL;
  wgroup *g = td__calloc(1, sizeof *g);
  if (!g || !(g->name = td__strdup(name))) {
    td__free(g);
    return NULL;
  }
  g->hash = h;
  g->min_target = INT64_MAX;
  g->next = *b;
  *b = g;
  return g;
}

/* Frees g when no wait is about it any more. mu held. */
static void group_release(td__store *s, wgroup *g) {
  if (!g || g->on_key || g->on_watch) return;
  for (wgroup **pp = &s->wbuckets[g->hash & (WAIT_BUCKETS - 1)]; *pp; pp = &(*pp)->next)
    if (*pp == g) {
      *pp = g->next;
      break;
    }
  td__free(g->name);
  td__free(g);
}

/* Puts w on the lists (its groups made already). mu held. */
static void park_link(td__store *s, parked *w) {
  w->prev = NULL;
  w->next = s->waits;
  if (s->waits) s->waits->prev = w;
  s->waits = w;
  w->kprev = NULL;
  w->knext = w->kg->on_key;
  if (w->knext) w->knext->kprev = w;
  w->kg->on_key = w;
  if (w->target < w->kg->min_target) w->kg->min_target = w->target;
  if (w->wg) {
    w->wprev = NULL;
    w->wnext = w->wg->on_watch;
    if (w->wnext) w->wnext->wprev = w;
    w->wg->on_watch = w;
  }
  s->nparked++;
}

/* Takes w off every list and frees it; its groups go too once empty, except keep (the group a
 * caller walks). mu held. */
static void park_unlink(td__store *s, parked *w, wgroup *keep) {
  if (w->prev) w->prev->next = w->next;
  else s->waits = w->next;
  if (w->next) w->next->prev = w->prev;
  if (w->kprev) w->kprev->knext = w->knext;
  else w->kg->on_key = w->knext;
  if (w->knext) w->knext->kprev = w->kprev;
  if (w->wg) {
    if (w->wprev) w->wprev->wnext = w->wnext;
    else w->wg->on_watch = w->wnext;
    if (w->wnext) w->wnext->wprev = w->wprev;
  }
  s->nparked--;
  if (w->kg != keep) group_release(s, w->kg);
  if (w->wg && w->wg != keep) group_release(s, w->wg);
  parked_free(w);
}

/* Moves wait w to *out as an answer built now, and frees it; false when out of memory (the
 * wait stays, answered by the next change or its time). mu held. */
static bool take_answer(td__store *s, parked *w, wgroup *keep, answer **out, size_t *n) {
  answer *grown = td__realloc(*out, (*n + 1) * sizeof **out);
  if (!grown) return false;
  *out = grown;
  answer *a = &(*out)[(*n)++];
  a->token = w->token;
  a->pk = w->pk;
  a->reply = NULL;
  a->len = 0;
  wait_reply(s, w->key, w->target, w->watch, &a->reply, &a->len);
  park_unlink(s, w, keep);
  return true;
}

/* Takes out every wait that is over: all of them (all), or those past their time (now). mu
 * held. */
static void collect_answers(td__store *s, uint64_t now, bool all, answer **out, size_t *n) {
  for (parked *w = s->waits, *nx; w; w = nx) {
    nx = w->next;
    if ((all || now >= w->until_ns) && !take_answer(s, w, NULL, out, n)) return;
  }
}

/* Takes out the waits that a change to key ended: those on key whose condition now holds, and
 * those watching key now that it is set. mu held. */
static void collect_key(td__store *s, const char *key, answer **out, size_t *n) {
  wgroup *g = group_of(s, key, false);
  if (!g) return;
  if (g->on_key && wait_over(s, key, g->min_target, NULL)) {
    int64_t min = INT64_MAX;
    for (parked *w = g->on_key, *nx; w; w = nx) {
      nx = w->knext;
      s->wait_checks++;
      if (wait_over(s, w->key, w->target, w->watch)) {
        if (take_answer(s, w, g, out, n)) continue;
      }
      if (w->target < min) min = w->target;
    }
    g->min_target = min;
  }
  if (g->on_watch && find(s, key, false))
    for (parked *w = g->on_watch, *nx; w; w = nx) {
      nx = w->wnext;
      s->wait_checks++;
      if (!take_answer(s, w, g, out, n)) break;
    }
  group_release(s, g);
}

/* Answers what collect_answers took (no lock held). */
static void send_answers(answer *as, size_t n) {
  for (size_t i = 0; i < n; i++) as[i].pk->answer(as[i].token, as[i].reply, as[i].len);
  td__free(as);
}

void td__store_expire(td__store *s, uint64_t now_ns) {
  answer *as = NULL;
  size_t n = 0;
  pthread_mutex_lock(&s->mu);
  if (s->nparked) collect_answers(s, now_ns ? now_ns : 1, false, &as, &n);
  pthread_mutex_unlock(&s->mu);
  send_answers(as, n);
}

void td__store_unpark_all(td__store *s) {
  answer *as = NULL;
  size_t n = 0;
  pthread_mutex_lock(&s->mu);
  collect_answers(s, 0, true, &as, &n);
  pthread_mutex_unlock(&s->mu);
  send_answers(as, n);
}

size_t td__store_parked(td__store *s) {
  pthread_mutex_lock(&s->mu);
  size_t n = s->nparked;
  pthread_mutex_unlock(&s->mu);
  return n;
}

/* Op 8: the wait's reply at once, or (with a parker, when it is not over) the wait parked, for at
 * most park_ms (TD__STORE_PARK_MAX_MS). mu held. */
static td_status wait_op(td__store *s, const Tdist__StoreRequest *r, const td__store_parker *pk,
                         uint8_t **reply, size_t *reply_len, bool *parked_out) {
  const char *key = r->key ? r->key : "", *watch = r->watch_key;
  if (strlen(key) > TD__STORE_MAX_KEY || (watch && strlen(watch) > TD__STORE_MAX_KEY))
    return td_set_error(TD_ERR_INVALID, "store: key too long");
  int64_t ms = r->count < TD__STORE_PARK_MAX_MS ? r->count : TD__STORE_PARK_MAX_MS;
  if (!pk || ms <= 0 || s->nparked >= TD__STORE_MAX_PARKED ||
      wait_over(s, key, r->delta, watch))
    return wait_reply(s, key, r->delta, watch, reply, reply_len);
  parked *w = td__calloc(1, sizeof *w);
  void *token = NULL;
  if (w && (w->key = td__strdup(key)) && (!watch || !watch[0] || (w->watch = td__strdup(watch))) &&
      (w->kg = group_of(s, key, true)) && (!w->watch || (w->wg = group_of(s, watch, true))))
    token = pk->park(pk->ud);
  if (!token) { /* cannot hold it: answer now */
    if (w) {
      group_release(s, w->kg);
      group_release(s, w->wg);
      parked_free(w);
    }
    return wait_reply(s, key, r->delta, watch, reply, reply_len);
  }
  w->target = r->delta;
  w->until_ns = td__now_ns() + (uint64_t)ms * 1000000ull;
  w->token = token;
  w->pk = pk;
  park_link(s, w);
  *parked_out = true;
  return TD_OK;
}

/* Keeps a ranges reply just packed (out, n bytes) for the same request asked again, unless a
 * remembered range changed since it was built (gen); gives the auth layer its digest. Only a
 * reply whose every prefix brought values: each then has a remembered range, whose prefix any
 * change of a key under it bumps gen for (a prefix without values has none, and a key added
 * under it would not). Best effort: out of memory, nothing is kept. */
static void packed_keep(td__store *s, const Tdist__StoreRequest *r, uint64_t gen,
                        const ranges_buf *b, const uint8_t *out, size_t n) {
  uint8_t d[TD__AUTH_DIGEST];
  if (td__auth_sha256(out, n, d) != TD_OK) return;
  td__auth_store_body_digest(d);
  for (size_t i = 0; i < r->n_keys; i++)
    if (b->counts[i] <= 0) return;
  packed_reply p = {.n_keys = r->n_keys, .first = r->first, .count = r->count, .len = n,
                    .gen = gen, .found = (int)r->n_keys};
  memcpy(p.digest, d, sizeof d);
  bool ok = (p.bytes = td__malloc(n ? n : 1)) != NULL;
  for (size_t i = 0; ok && i < r->n_keys; i++) ok = (p.keys[i] = td__strdup(r->keys[i])) != NULL;
  if (ok) memcpy(p.bytes, out, n);
  pthread_mutex_lock(&s->mu);
  if (ok && s->range_gen == gen) {
    packed_clear(&s->packed);
    s->packed = p;
  } else {
    packed_clear(&p);
  }
  pthread_mutex_unlock(&s->mu);
}

td_status td__store_handle(td__store *s, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len) {
  bool parked_out = false;
  return td__store_handle_park(s, req, len, reply, reply_len, NULL, &parked_out);
}

td_status td__store_handle_park(td__store *s, const uint8_t *req, size_t len, uint8_t **reply,
                                size_t *reply_len, const td__store_parker *pk, bool *parked_out) {
  *parked_out = false;
  Tdist__StoreRequest *r = tdist__store_request__unpack(NULL, len, req);
  if (!r) return td_set_error(TD_ERR_FORMAT, "store: malformed request");
  Tdist__StoreReply rep = TDIST__STORE_REPLY__INIT;
  td_status st = TD_OK;
  uint8_t *copy = NULL, *watch_copy = NULL, *packed = NULL;
  range_buf rg = {0};
  ranges_buf rgs = {0};
  size_t packed_len = 0;
  uint8_t digest[TD__AUTH_DIGEST];
  uint64_t gen = 0; /* (op 10: the ranges' generation its reply was built from) */
  pthread_mutex_lock(&s->mu);
  s->requests++;
  const char *key = r->key ? r->key : "";
  switch (r->op) {
    case 1: /* set */
      if ((st = check_room(s, key, r->value.len)) == TD_OK)
        st = put(s, key, r->value.data, r->value.len);
      break;
    case 2:   /* get */
    case 4: { /* check */
      kv *e = find(s, key, false);
      rep.found = e != NULL;
      s->gets_found += e && r->op == 2;
      if (e && r->op == 2) {
        copy = td__malloc(e->len + 1);
        if (!copy) {
          st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
          break;
        }
        memcpy(copy, e->val, e->len);
        rep.value.data = copy;
        rep.value.len = e->len;
      }
      break;
    }
    case 3: /* add */
      st = add_op(s, key, r->delta, &rep);
      break;
    case 9: /* publish: sets, then an add */
      if ((st = publish_room(s, r)) != TD_OK) break;
      for (size_t i = 0; i < r->n_keys && st == TD_OK; i++)
        st = put(s, r->keys[i], r->values[i].data, r->values[i].len);
      if (st == TD_OK && key[0]) st = add_op(s, key, r->delta, &rep);
      break;
    case 6: /* now: the server's clock (aligning traces) */
      rep.number = (int64_t)td__now_ns();
      rep.found = true;
      break;
    case 5: { /* delete: found tells whether the key was there */
      kv *e = find(s, key, false);
      if (e) remove_at(s, (size_t)(e - s->tab));
      rep.found = e != NULL;
      break;
    }
    case 7: /* range */
      st = range_get(s, key, r->first, r->count, &rep, &rg);
      s->ranges_found += rep.n_values > 0;
      break;
    case 10: /* ranges */
      if (packed_matches(s, r) &&
          !(r->watch_key && r->watch_key[0] && find(s, r->watch_key, false))) {
        packed = td__malloc(s->packed.len);
        if (!packed) {
          st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
          break;
        }
        memcpy(packed, s->packed.bytes, s->packed.len);
        packed_len = s->packed.len;
        memcpy(digest, s->packed.digest, sizeof digest);
        s->ranges_found += (uint64_t)s->packed.found;
        s->ranges_remembered += (uint64_t)s->packed.found;
        s->ranges_packed++;
        break;
      }
      gen = s->range_gen;
      st = ranges_get(s, r, &rep, &rgs);
      break;
    case 8: { /* wait: its own reply (or none yet: parked) */
      st = wait_op(s, r, pk, reply, reply_len, parked_out);
      pthread_mutex_unlock(&s->mu);
      tdist__store_request__free_unpacked(r, NULL);
      return st;
    }
    default: st = td_set_error(TD_ERR_INVALID, "store: unknown operation %u", r->op);
  }
  if (st == TD_OK && r->watch_key && r->watch_key[0] && r->op != 5 && r->op != 6)
    st = watch_get(s, r->watch_key, &rep, &watch_copy);
  /* a change may end parked waits on that key (or whose abort key it is) */
  answer *as = NULL;
  size_t nas = 0;
  if (st == TD_OK && s->nparked && (r->op == 1 || (r->op == 3 && r->delta) || r->op == 5 ||
                                    (r->op == 9 && key[0] && r->delta)))
    collect_key(s, key, &as, &nas);
  for (size_t i = 0; st == TD_OK && s->nparked && r->op == 9 && i < r->n_keys; i++)
    collect_key(s, r->keys[i], &as, &nas);
  pthread_mutex_unlock(&s->mu);
  send_answers(as, nas);
  if (st == TD_OK && packed) {
    td__auth_store_body_digest(digest);
    *reply = packed;
    *reply_len = packed_len;
    packed = NULL;
  } else if (st == TD_OK) {
    size_t n = tdist__store_reply__get_packed_size(&rep);
    uint8_t *out = td__malloc(n ? n : 1);
    if (!out) st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
    else {
      tdist__store_reply__pack(&rep, out);
      *reply = out;
      *reply_len = n;
      if (r->op == 10 && !rep.watched) packed_keep(s, r, gen, &rgs, out, n);
    }
  }
  td__free(packed);
  tdist__store_request__free_unpacked(r, NULL);
  td__free(copy);
  td__free(watch_copy);
  td__free(rg.buf);
  td__free(rg.vals);
  ranges_free(&rgs);
  return st;
}

/* ---- client ---- */

void td__store_set_owner(td__store_client *c, const char *name) {
  snprintf(c->owner_buf, sizeof c->owner_buf, "%s", name);
  __atomic_store_n(&c->owner, c->owner_buf, __ATOMIC_RELEASE);
}

void td__store_set_deadline(td__store_client *c, uint64_t deadline_ns) {
  __atomic_store_n(&c->deadline_ns, deadline_ns, __ATOMIC_RELEASE);
}

/* One unary exchange with the store's server (the auth layer's transport), within the client's
 * deadline. A failure names the worker that serves the store. */
static td_status unary(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                       size_t *reply_len) {
  const td__store_client *c = ctx;
  const char *owner = __atomic_load_n(&c->owner, __ATOMIC_ACQUIRE);
  if (!owner) owner = "rank 0";
  bool wfr = __atomic_load_n(&c->wait_for_ready, __ATOMIC_RELAXED);
  int64_t tmo = __atomic_load_n(&c->call_timeout_ms, __ATOMIC_RELAXED); /* (shutdown.c) */
  uint64_t dl = __atomic_load_n(&c->deadline_ns, __ATOMIC_ACQUIRE);
  if (dl && dl != TD__NO_DEADLINE) {
    uint64_t now = td__now_ns();
    if (now >= dl)
      return td_set_error(TD_ERR_TIMEOUT, "the deadline passed before %s's rendezvous store at "
                          "%s answered", owner, c->address);
    int64_t left = (int64_t)((dl - now + 999999u) / 1000000u);
    if (tmo <= 0 || left < tmo) tmo = left;
  }
  td_status st = c->unary_fn ? c->unary_fn(c->unary_ctx, req, len, reply, reply_len)
                             : td__transport_unary(c->tr, c->address, TD__STORE_METHOD, req, len,
                                                   tmo, wfr, reply, reply_len);
  if (st == TD_ERR_UNAVAILABLE || (st == TD_ERR_TIMEOUT && !wfr))
    return td__error_prefix(st, "%s, which serves the rendezvous store at %s, is unreachable",
                            owner, c->address);
  if (st == TD_ERR_TIMEOUT)
    return td__error_prefix(st, "%s's rendezvous store at %s did not answer in time", owner,
                            c->address);
  if (st != TD_OK) return td__error_prefix(st, "rendezvous store of %s", owner);
  return TD_OK;
}

static td_status call(const td__store_client *c, Tdist__StoreRequest *r, Tdist__StoreReply **out) {
  size_t n = tdist__store_request__get_packed_size(r);
  uint8_t *buf = td__malloc(n ? n : 1);
  if (!buf) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  tdist__store_request__pack(r, buf);
  uint8_t *rep = NULL;
  size_t rl = 0;
  td_status st = c->auth ? td__auth_store_call(c->auth, unary, (void *)c, buf, n, &rep, &rl)
                         : unary((void *)c, buf, n, &rep, &rl);
  td__free(buf);
  if (st != TD_OK) return st;
  *out = tdist__store_reply__unpack(NULL, rl, rep);
  td__free(rep);
  if (!*out) return td_set_error(TD_ERR_FORMAT, "store: malformed reply from %s", c->address);
  return TD_OK;
}

td_status td__store_set_watch(const td__store_client *c, const char *key, const void *v,
                              size_t n, const char *watch_key, bool *watched) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 1;
  r.key = (char *)key;
  r.value.data = (uint8_t *)v;
  r.value.len = n;
  r.watch_key = (char *)(watch_key ? watch_key : "");
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  if (watched) *watched = rep->watched;
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

td_status td__store_set(const td__store_client *c, const char *key, const void *v, size_t n) {
  return td__store_set_watch(c, key, v, n, NULL, NULL);
}

/* A NUL-terminated td__malloc'd copy of d. */
static uint8_t *bytes_copy(ProtobufCBinaryData d) {
  uint8_t *b = td__malloc(d.len + 1);
  if (!b) return NULL;
  if (d.len) memcpy(b, d.data, d.len);
  b[d.len] = 0;
  return b;
}

td_status td__store_get2(const td__store_client *c, const char *key, uint8_t **v, size_t *n,
                         bool *found, const char *key2, uint8_t **v2, bool *found2) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 2;
  r.key = (char *)key;
  r.watch_key = (char *)(key2 ? key2 : "");
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  uint8_t *b = rep->found && v ? bytes_copy(rep->value) : NULL;
  uint8_t *b2 = key2 && rep->watched && v2 ? bytes_copy(rep->watch_value) : NULL;
  bool oom = (rep->found && v && !b) || (key2 && rep->watched && v2 && !b2);
  *found = rep->found;
  if (n && b) *n = rep->value.len;
  if (found2) *found2 = key2 && rep->watched;
  tdist__store_reply__free_unpacked(rep, NULL);
  if (oom) {
    td__free(b);
    td__free(b2);
    return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  }
  if (b) *v = b;
  if (b2) *v2 = b2;
  return TD_OK;
}

td_status td__store_get(const td__store_client *c, const char *key, uint8_t **v, size_t *n,
                        bool *found) {
  return td__store_get2(c, key, v, n, found, NULL, NULL, NULL);
}

td_status td__store_add(const td__store_client *c, const char *key, int64_t delta, int64_t *out) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 3;
  r.key = (char *)key;
  r.delta = delta;
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  if (out) *out = rep->number;
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

td_status td__store_publish(const td__store_client *c, size_t n, char *const *keys,
                            const void *const *vals, const size_t *lens, const char *add_key,
                            int64_t delta, int64_t *out) {
  if (n > TD__STORE_PUBLISH_MAX)
    return td_set_error(TD_ERR_INVALID, "store: publish of %zu keys (at most %d)", n,
                        TD__STORE_PUBLISH_MAX);
  ProtobufCBinaryData v[TD__STORE_PUBLISH_MAX];
  for (size_t i = 0; i < n; i++) v[i] = (ProtobufCBinaryData){lens[i], (uint8_t *)vals[i]};
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 9;
  r.key = (char *)(add_key ? add_key : "");
  r.delta = delta;
  r.n_keys = n;
  r.keys = (char **)keys;
  r.n_values = n;
  r.values = v;
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  if (out) *out = rep->number;
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

td_status td__store_delete(const td__store_client *c, const char *key, bool *existed) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 5;
  r.key = (char *)key;
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  if (existed) *existed = rep->found;
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

td_status td__store_now(const td__store_client *c, int64_t *server_ns) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 6;
  r.key = (char *)"";
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  *server_ns = rep->number;
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* A polling request's abort check, folded into it (the abort key as its watch_key): the message
 * the worker that gave up left there. */
static td_status reply_aborted(const Tdist__StoreReply *rep) {
  if (!rep->watched) return TD_OK;
  int n = rep->watch_value.len > 1000 ? 1000 : (int)rep->watch_value.len;
  return td_set_error(TD_ERR_REMOTE, "%.*s", n, (const char *)rep->watch_value.data);
}

/* One poll: op (2 get or 3 add of 0) on key, with the abort check; *rep the reply. */
static td_status poll_once(const td__store_client *c, uint32_t op, const char *key,
                           const char *abort_key, Tdist__StoreReply **rep) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = op;
  r.key = (char *)key;
  r.watch_key = (char *)(abort_key ? abort_key : "");
  return call(c, &r, rep);
}

/* One wait parked at the server (op 8) for at most c->park_ms and what is left before deadline:
 * *rep the reply; *held tells whether the server held it (else the client backs off before the
 * next one, as a poll). target 0: until key exists. The server is asked to answer 50 ms before
 * the call itself times out (the client's deadline_ns and call_timeout_ms), and at the latest
 * at deadline_ns: a caller that waits in slices (rdv_wait) gives its calls a deadline past the
 * slice's, so a loaded server answering a slice's end late (its tick grows to 100 ms with the
 * host's load) still answers the call instead of letting it fail with DEADLINE_EXCEEDED (at 256
 * workers on 2 CPUs, 4 cancelled calls per worker at init). */
static td_status park_once(const td__store_client *c, const char *key, int64_t target,
                           const char *abort_key, uint64_t deadline_ns, Tdist__StoreReply **rep,
                           bool *held) {
  uint64_t now = td__now_ns();
  int64_t left = deadline_ns > now ? (int64_t)((deadline_ns - now) / 1000000u) : 0;
  uint64_t cd = __atomic_load_n(&c->deadline_ns, __ATOMIC_ACQUIRE);
  int64_t call_left = __atomic_load_n(&c->call_timeout_ms, __ATOMIC_RELAXED);
  if (call_left <= 0) call_left = left;
  if (cd && cd != TD__NO_DEADLINE) {
    int64_t l = cd > now ? (int64_t)((cd - now) / 1000000u) : 0;
    if (l < call_left) call_left = l;
  }
  int64_t ms = call_left - 50 < left ? call_left - 50 : left; /* answered before the call ends */
  if (c->park_ms < ms) ms = c->park_ms;
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = ms > 0 ? 8 : (target > 0 ? 3 : 2);
  r.key = (char *)key;
  r.delta = r.op == 8 ? target : 0;
  r.count = ms > 0 ? (int32_t)ms : 0;
  r.watch_key = (char *)(abort_key ? abort_key : "");
  TD_TRY(call(c, &r, rep));
  /* held when it came back after at least half its time (else the server answered at once) */
  *held = ms > 0 && td__now_ns() - now >= (uint64_t)ms * 500000u;
  return TD_OK;
}

static td_status poll_wait(const td__store_client *c, int64_t *backoff, uint64_t deadline_ns) {
  if (td__now_ns() >= deadline_ns) return TD_ERR_TIMEOUT;
  sleep_ms(*backoff);
  int64_t most = c->max_backoff_ms > 0 ? c->max_backoff_ms : 50;
  *backoff = *backoff * 2 > most ? most : *backoff * 2;
  return TD_OK;
}

td_status td__store_wait_ge(const td__store_client *c, const char *key, int64_t target,
                            uint64_t deadline_ns, const char *abort_key) {
  int64_t backoff = 1;
  return td__store_poll_ge(c, key, target, deadline_ns, abort_key, &backoff);
}

td_status td__store_poll_ge(const td__store_client *c, const char *key, int64_t target,
                            uint64_t deadline_ns, const char *abort_key, int64_t *bo) {
  int64_t backoff = *bo > 0 ? *bo : 1;
  for (;;) {
    Tdist__StoreReply *rep;
    bool held = false;
    if (c->park_ms > 0 && target > 0) TD_TRY(park_once(c, key, target, abort_key, deadline_ns,
                                                        &rep, &held));
    else TD_TRY(poll_once(c, 3, key, abort_key, &rep));
    int64_t cur = rep->number;
    td_status st = cur >= target ? TD_OK : reply_aborted(rep);
    bool done = cur >= target || st != TD_OK;
    tdist__store_reply__free_unpacked(rep, NULL);
    if (done) return st;
    if (held && td__now_ns() < deadline_ns) continue; /* the server waited: ask again at once */
    td_status w = poll_wait(c, &backoff, deadline_ns);
    *bo = backoff;
    if (w != TD_OK)
      return td_set_error(TD_ERR_TIMEOUT, "store: timed out waiting for '%s' to reach %lld (now "
                          "%lld)", key, (long long)target, (long long)cur);
  }
}

/* Copies a reply's bytes to a malloc'd NUL-terminated buffer. */
static td_status dup_bytes(const ProtobufCBinaryData *b, uint8_t **v, size_t *n) {
  uint8_t *p = td__malloc(b->len + 1);
  if (!p) return td_set_error(TD_ERR_NOMEM, "store: out of memory");
  if (b->len) memcpy(p, b->data, b->len);
  p[b->len] = 0;
  *v = p;
  if (n) *n = b->len;
  return TD_OK;
}

td_status td__store_wait_key(const td__store_client *c, const char *key, uint64_t deadline_ns,
                             const char *abort_key, uint8_t **v, size_t *n) {
  int64_t backoff = 1;
  return td__store_poll_key(c, key, deadline_ns, abort_key, &backoff, v, n);
}

td_status td__store_poll_key(const td__store_client *c, const char *key, uint64_t deadline_ns,
                             const char *abort_key, int64_t *bo, uint8_t **v, size_t *n) {
  int64_t backoff = *bo > 0 ? *bo : 1;
  for (;;) {
    Tdist__StoreReply *rep;
    bool held = false;
    if (c->park_ms > 0) TD_TRY(park_once(c, key, 0, abort_key, deadline_ns, &rep, &held));
    else TD_TRY(poll_once(c, 2, key, abort_key, &rep));
    td_status st = rep->found ? (v ? dup_bytes(&rep->value, v, n) : TD_OK) : reply_aborted(rep);
    bool done = rep->found || st != TD_OK;
    tdist__store_reply__free_unpacked(rep, NULL);
    if (done) return st;
    if (held && td__now_ns() < deadline_ns) continue; /* the server waited: ask again at once */
    td_status w = poll_wait(c, &backoff, deadline_ns);
    *bo = backoff;
    if (w != TD_OK)
      return td_set_error(TD_ERR_TIMEOUT, "store: timed out waiting for key '%s'", key);
  }
}

/* Takes the values of one range reply into vals/lens from index *got on. */
static td_status range_take(const Tdist__StoreReply *rep, int count, int *got, uint8_t **vals,
                            size_t *lens) {
  if (rep->n_values > (size_t)(count - *got))
    return td_set_error(TD_ERR_FORMAT, "store: a range reply with more values than asked");
  for (size_t i = 0; i < rep->n_values; i++, (*got)++)
    TD_TRY(dup_bytes(&rep->values[i], &vals[*got], &lens[*got]));
  return TD_OK;
}

td_status td__store_range(const td__store_client *c, const char *prefix, int first, int count,
                          uint8_t **vals, size_t *lens, int *got) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 7;
  r.key = (char *)prefix;
  r.first = first;
  r.count = count;
  Tdist__StoreReply *rep;
  *got = 0;
  TD_TRY(call(c, &r, &rep));
  td_status st = range_take(rep, count, got, vals, lens);
  tdist__store_reply__free_unpacked(rep, NULL);
  for (int i = 0; st != TD_OK && i < *got; i++) {
    td__free(vals[i]);
    vals[i] = NULL;
  }
  if (st != TD_OK) *got = 0;
  return st;
}

td_status td__store_ranges(const td__store_client *c, int n, const char *const *prefixes,
                           int first, int count, uint8_t ***vals, size_t **lens, int *got) {
  if (n < 1 || n > TD__STORE_RANGES_MAX)
    return td_set_error(TD_ERR_INVALID, "store: ranges of %d prefixes (1 to %d)", n,
                        TD__STORE_RANGES_MAX);
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 10;
  r.key = (char *)"";
  r.first = first;
  r.count = count;
  r.n_keys = (size_t)n;
  r.keys = (char **)prefixes;
  Tdist__StoreReply *rep;
  for (int k = 0; k < n; k++) got[k] = 0;
  TD_TRY(call(c, &r, &rep));
  td_status st = TD_OK;
  size_t at = 0;
  if (rep->n_counts != (size_t)n)
    st = td_set_error(TD_ERR_FORMAT, "store: a ranges reply for %zu prefixes, not %d",
                      rep->n_counts, n);
  for (int k = 0; k < n && st == TD_OK; k++) {
    if (rep->counts[k] < 0 || rep->counts[k] > count || rep->n_values - at < (size_t)rep->counts[k]) {
      st = td_set_error(TD_ERR_FORMAT, "store: a ranges reply with more values than asked");
      break;
    }
    for (int32_t i = 0; i < rep->counts[k] && st == TD_OK; i++, at++) {
      st = dup_bytes(&rep->values[at], &vals[k][i], &lens[k][i]);
      if (st == TD_OK) got[k]++;
    }
  }
  tdist__store_reply__free_unpacked(rep, NULL);
  for (int k = 0; st != TD_OK && k < n; k++) {
    for (int i = 0; i < got[k]; i++) {
      td__free(vals[k][i]);
      vals[k][i] = NULL;
    }
    got[k] = 0;
  }
  return st;
}

td_status td__store_wait_range(const td__store_client *c, const char *prefix, int first,
                               int count, uint64_t deadline_ns, const char *abort_key,
                               uint8_t **vals, size_t *lens) {
  int64_t backoff = 1;
  int got = 0;
  td_status st = TD_OK;
  while (got < count && st == TD_OK) {
    Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
    r.op = 7;
    r.key = (char *)prefix;
    r.first = first + got;
    r.count = count - got;
    r.watch_key = (char *)(abort_key ? abort_key : "");
    Tdist__StoreReply *rep;
    if ((st = call(c, &r, &rep)) != TD_OK) break;
    int n = 0;
    st = range_take(rep, count - got, &n, vals + got, lens + got);
    got += n;
    if (st == TD_OK && n == 0) st = reply_aborted(rep);
    tdist__store_reply__free_unpacked(rep, NULL);
    if (st != TD_OK || n > 0) {
      backoff = 1; /* progress: ask for the rest at once */
      continue;
    }
    if (poll_wait(c, &backoff, deadline_ns) != TD_OK)
      st = td_set_error(TD_ERR_TIMEOUT, "store: timed out waiting for key '%s%d'", prefix,
                        first + got);
  }
  if (st != TD_OK)
    for (int i = 0; i < got; i++) {
      td__free(vals[i]);
      vals[i] = NULL;
    }
  return st;
}
