/* store.c - rendezvous key-value store: the server-side map and the client operations.
 *
 * The map is a small open hash table of string -> bytes under one mutex; the server handles each
 * request on the transport's poller thread without blocking. Clients issue one unary call per
 * operation; waits poll with backoff.
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
  char *key;
  uint8_t *val;
  size_t len;
} kv;

struct td__store {
  pthread_mutex_t mu;
  kv *tab;
  size_t cap, len;
  uint64_t bytes; /* keys and values held */
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

void td__store_destroy(td__store *s) {
  if (!s) return;
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
      size_t j = str_hash(s->tab[i].key) & (nc - 1);
      while (nt[j].key) j = (j + 1) & (nc - 1);
      nt[j] = s->tab[i];
    }
    td__free(s->tab);
    s->tab = nt;
    s->cap = nc;
  }
  if (!s->cap) return NULL;
  size_t j = str_hash(key) & (s->cap - 1);
  while (s->tab[j].key) {
    if (strcmp(s->tab[j].key, key) == 0) return &s->tab[j];
    j = (j + 1) & (s->cap - 1);
  }
  if (!insert) return NULL;
  s->tab[j].key = td__strdup(key);
  if (!s->tab[j].key) return NULL;
  s->tab[j].val = NULL;
  s->tab[j].len = 0;
  s->len++;
  return &s->tab[j];
}

static bool set_val(td__store *s, kv *e, const void *v, size_t n) {
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

td_status td__store_local_set(td__store *s, const char *key, const void *v, size_t n) {
  pthread_mutex_lock(&s->mu);
  kv *e = find(s, key, true);
  if (e && !e->val) s->bytes += strlen(key);
  bool ok = e && set_val(s, e, v, n);
  pthread_mutex_unlock(&s->mu);
  return ok ? TD_OK : td_set_error(TD_ERR_NOMEM, "store: out of memory");
}

td_status td__store_handle(td__store *s, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len) {
  Tdist__StoreRequest *r = tdist__store_request__unpack(NULL, len, req);
  if (!r) return td_set_error(TD_ERR_FORMAT, "store: malformed request");
  Tdist__StoreReply rep = TDIST__STORE_REPLY__INIT;
  td_status st = TD_OK;
  char num[32];
  uint8_t *copy = NULL;
  pthread_mutex_lock(&s->mu);
  const char *key = r->key ? r->key : "";
  switch (r->op) {
    case 1: { /* set */
      if ((st = check_room(s, key, r->value.len)) != TD_OK) break;
      kv *e = find(s, key, true);
      if (e && !e->val) s->bytes += strlen(key);
      if (!e || !set_val(s, e, r->value.data, r->value.len))
        st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
      break;
    }
    case 2:   /* get */
    case 4: { /* check */
      kv *e = find(s, key, false);
      rep.found = e != NULL;
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
    case 3: { /* add */
      if ((st = check_room(s, key, 24)) != TD_OK) break;
      kv *e = find(s, key, true);
      if (e && !e->val) s->bytes += strlen(key);
      if (!e) {
        st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
        break;
      }
      int64_t cur = e->val ? strtoll((const char *)e->val, NULL, 10) : 0;
      cur += r->delta;
      int n = snprintf(num, sizeof num, "%lld", (long long)cur);
      if (!set_val(s, e, num, (size_t)n)) st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
      rep.number = cur;
      rep.found = true;
      break;
    }
    case 6: /* now: the server's clock (aligning traces) */
      rep.number = (int64_t)td__now_ns();
      rep.found = true;
      break;
    case 5: { /* delete */
      kv *e = find(s, key, false);
      if (e) {
        /* rebuild without the entry (deletes are rare) */
        s->bytes -= strlen(e->key) + e->len;
        td__free(e->key);
        td__free(e->val);
        e->key = NULL;
        s->len--;
        kv *old = s->tab;
        size_t oc = s->cap;
        s->tab = NULL;
        s->cap = s->len = 0;
        for (size_t i = 0; i < oc; i++) {
          if (!old[i].key) continue;
          kv *ne = find(s, old[i].key, true);
          if (ne) {
            td__free(ne->key);
            *ne = old[i];
          }
        }
        td__free(old);
        rep.found = true;
      }
      break;
    }
    default: st = td_set_error(TD_ERR_INVALID, "store: unknown operation %u", r->op);
  }
  pthread_mutex_unlock(&s->mu);
  tdist__store_request__free_unpacked(r, NULL);
  if (st == TD_OK) {
    size_t n = tdist__store_reply__get_packed_size(&rep);
    uint8_t *out = td__malloc(n ? n : 1);
    if (!out) st = td_set_error(TD_ERR_NOMEM, "store: out of memory");
    else {
      tdist__store_reply__pack(&rep, out);
      *reply = out;
      *reply_len = n;
    }
  }
  td__free(copy);
  return st;
}

/* ---- client ---- */

void td__store_set_deadline(td__store_client *c, uint64_t deadline_ns) {
  __atomic_store_n(&c->deadline_ns, deadline_ns, __ATOMIC_RELEASE);
}

/* One unary exchange with the store's server (the auth layer's transport), within the client's
 * deadline. A failure names the worker that serves the store. */
static td_status unary(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                       size_t *reply_len) {
  const td__store_client *c = ctx;
  const char *owner = c->owner[0] ? c->owner : "rank 0";
  int64_t tmo = c->call_timeout_ms;
  uint64_t dl = __atomic_load_n(&c->deadline_ns, __ATOMIC_ACQUIRE);
  if (dl && dl != TD__NO_DEADLINE) {
    uint64_t now = td__now_ns();
    if (now >= dl)
      return td_set_error(TD_ERR_TIMEOUT, "the deadline passed before %s's rendezvous store at "
                          "%s answered", owner, c->address);
    int64_t left = (int64_t)((dl - now + 999999u) / 1000000u);
    if (tmo <= 0 || left < tmo) tmo = left;
  }
  td_status st = td__transport_unary(c->tr, c->address, TD__STORE_METHOD, req, len, tmo,
                                     c->wait_for_ready, reply, reply_len);
  if (st == TD_ERR_UNAVAILABLE || (st == TD_ERR_TIMEOUT && !c->wait_for_ready))
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

td_status td__store_set(const td__store_client *c, const char *key, const void *v, size_t n) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 1;
  r.key = (char *)key;
  r.value.data = (uint8_t *)v;
  r.value.len = n;
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
}

td_status td__store_get(const td__store_client *c, const char *key, uint8_t **v, size_t *n,
                        bool *found) {
  Tdist__StoreRequest r = TDIST__STORE_REQUEST__INIT;
  r.op = 2;
  r.key = (char *)key;
  Tdist__StoreReply *rep;
  TD_TRY(call(c, &r, &rep));
  *found = rep->found;
  if (rep->found && v) {
    uint8_t *b = td__malloc(rep->value.len + 1);
    if (!b) {
      tdist__store_reply__free_unpacked(rep, NULL);
      return td_set_error(TD_ERR_NOMEM, "store: out of memory");
    }
    if (rep->value.len) memcpy(b, rep->value.data, rep->value.len);
    b[rep->value.len] = 0;
    *v = b;
    if (n) *n = rep->value.len;
  }
  tdist__store_reply__free_unpacked(rep, NULL);
  return TD_OK;
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

static td_status check_abort(const td__store_client *c, const char *abort_key) {
  if (!abort_key) return TD_OK;
  uint8_t *v = NULL;
  bool found = false;
  TD_TRY(td__store_get(c, abort_key, &v, NULL, &found));
  if (!found) return TD_OK;
  td_status st = td_set_error(TD_ERR_REMOTE, "%s", (const char *)v);
  td__free(v);
  return st;
}

td_status td__store_wait_ge(const td__store_client *c, const char *key, int64_t target,
                            uint64_t deadline_ns, const char *abort_key) {
  int64_t backoff = 1;
  for (;;) {
    int64_t cur;
    TD_TRY(td__store_add(c, key, 0, &cur));
    if (cur >= target) return TD_OK;
    TD_TRY(check_abort(c, abort_key));
    if (td__now_ns() >= deadline_ns)
      return td_set_error(TD_ERR_TIMEOUT, "store: timed out waiting for '%s' to reach %lld (now "
                          "%lld)", key, (long long)target, (long long)cur);
    sleep_ms(backoff);
    backoff = backoff * 2 > 50 ? 50 : backoff * 2;
  }
}

td_status td__store_wait_key(const td__store_client *c, const char *key, uint64_t deadline_ns,
                             const char *abort_key, uint8_t **v, size_t *n) {
  int64_t backoff = 1;
  for (;;) {
    bool found = false;
    TD_TRY(td__store_get(c, key, v, n, &found));
    if (found) return TD_OK;
    TD_TRY(check_abort(c, abort_key));
    if (td__now_ns() >= deadline_ns)
      return td_set_error(TD_ERR_TIMEOUT, "store: timed out waiting for key '%s'", key);
    sleep_ms(backoff);
    backoff = backoff * 2 > 50 ? 50 : backoff * 2;
  }
}
