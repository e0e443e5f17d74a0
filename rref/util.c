/* util.c - small pieces of the RRef layer: containers (u64 map, u64 vector, ring of finished
 * forks), control messages with retries, outcome values and opaque objects.
 *
 * Retries: a control message (__rref_fork, __rref_delete, __rref_confirm) that fails with
 * TD_ERR_UNAVAILABLE (its stream broke, so it may or may not have arrived) is sent again after
 * 20, 80, 320 ms; the owner's handlers are idempotent per fork id, so a duplicate is harmless. The
 * delays are kept by one process-wide timer thread started on first use (a condition variable on
 * CLOCK_MONOTONIC and a list sorted by due time); it never runs user code and never blocks on
 * anything but its own lock.
 *
 * Lock order: timer_mu and obj_mu are leaves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rref_impl.h"

/* ---- u64 map ---- */

static size_t h64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return (size_t)k;
}

void *td__u64map_get(const td__u64map *m, uint64_t k) {
  if (!m->cap) return NULL;
  for (size_t j = h64(k) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
    if (m->keys[j] == k) return m->vals[j];
    if (m->keys[j] == 0) return NULL;
  }
}

static bool grow(td__u64map *m) {
  size_t nc = m->cap ? m->cap * 2 : 16;
  uint64_t *nk = td__calloc(nc, sizeof *nk);
  void **nv = td__calloc(nc, sizeof *nv);
  if (!nk || !nv) {
    td__free(nk);
    td__free(nv);
    return false;
  }
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->keys[i]) continue;
    size_t j = h64(m->keys[i]) & (nc - 1);
    while (nk[j]) j = (j + 1) & (nc - 1);
    nk[j] = m->keys[i];
    nv[j] = m->vals[i];
  }
  td__free(m->keys);
  td__free(m->vals);
  m->keys = nk;
  m->vals = nv;
  m->cap = nc;
  return true;
}

bool td__u64map_put(td__u64map *m, uint64_t k, void *v) {
  TD_ASSERT(k != 0);
  if ((m->len + 1) * 4 > m->cap * 3 && !grow(m)) return false;
  size_t j = h64(k) & (m->cap - 1);
  while (m->keys[j] && m->keys[j] != k) j = (j + 1) & (m->cap - 1);
  if (!m->keys[j]) m->len++;
  m->keys[j] = k;
  m->vals[j] = v;
  return true;
}

void *td__u64map_del(td__u64map *m, uint64_t k) {
  if (!m->cap) return NULL;
  size_t j = h64(k) & (m->cap - 1);
  while (m->keys[j] && m->keys[j] != k) j = (j + 1) & (m->cap - 1);
  if (!m->keys[j]) return NULL;
  void *v = m->vals[j];
  m->keys[j] = 0;
  m->vals[j] = NULL;
  m->len--;
  /* backward-shift deletion keeps probe chains intact */
  for (size_t i = (j + 1) & (m->cap - 1); m->keys[i]; i = (i + 1) & (m->cap - 1)) {
    uint64_t kk = m->keys[i];
    void *vv = m->vals[i];
    m->keys[i] = 0;
    m->vals[i] = NULL;
    size_t t = h64(kk) & (m->cap - 1);
    while (m->keys[t]) t = (t + 1) & (m->cap - 1);
    m->keys[t] = kk;
    m->vals[t] = vv;
  }
  return v;
}

void td__u64map_fini(td__u64map *m) {
  td__free(m->keys);
  td__free(m->vals);
  memset(m, 0, sizeof *m);
}

/* ---- u64 vector ---- */

bool td__u64vec_has(const td__u64vec *v, uint64_t x) {
  for (size_t i = 0; i < v->n; i++)
    if (v->v[i] == x) return true;
  return false;
}

bool td__u64vec_push(td__u64vec *v, uint64_t x) {
  if (v->n == v->cap) {
    size_t nc = v->cap ? v->cap * 2 : 4;
    uint64_t *nv = td__realloc(v->v, nc * sizeof *nv);
    if (!nv) return false;
    v->v = nv;
    v->cap = nc;
  }
  v->v[v->n++] = x;
  return true;
}

bool td__u64vec_remove(td__u64vec *v, uint64_t x) {
  for (size_t i = 0; i < v->n; i++) {
    if (v->v[i] == x) {
      v->v[i] = v->v[--v->n];
      if (v->n == 0 && v->cap > 16) { /* long-lived entries shed a burst's memory */
        td__free(v->v);
        v->v = NULL;
        v->cap = 0;
      }
      return true;
    }
  }
  return false;
}

void td__u64vec_fini(td__u64vec *v) {
  td__free(v->v);
  memset(v, 0, sizeof *v);
}

/* ---- ring of finished forks ---- */

bool td__fork_ring_has(const td__fork_ring *r, uint64_t f) {
  return td__u64map_get(&r->set, f) != NULL;
}

void td__fork_ring_push(td__fork_ring *r, uint64_t f) {
  if (td__fork_ring_has(r, f)) return;
  if (r->len == TD__RREF_DONE_CAP) {
    td__u64map_del(&r->set, r->ring[r->head]);
    r->len--;
    r->head = (r->head + 1) % TD__RREF_DONE_CAP;
  }
  /* out of memory: the fork is simply not remembered (a later duplicate would be misread) */
  if (!td__u64map_put(&r->set, f, (void *)1)) return;
  r->ring[(r->head + r->len) % TD__RREF_DONE_CAP] = f;
  r->len++;
}

const char *td__rref_id_str(uint64_t id, char *buf, size_t n) {
  snprintf(buf, n, "%llu:%llu", (unsigned long long)(id >> 48),
           (unsigned long long)(id & ((1ull << 48) - 1)));
  return buf;
}

/* ---- outcomes ---- */

td_value *td__rref_outcome_ok(td_value *value) {
  td_value *l = td_value_list();
  if (!value) value = td_value_none();
  td_value *z = td_value_int(0);
  if (!l || !z || td_value_list_append(l, z) != TD_OK) {
    td_value_unref(z);
    td_value_unref(l);
    td_value_unref(value);
    return NULL;
  }
  if (td_value_list_append(l, value) != TD_OK) {
    td_value_unref(value);
    td_value_unref(l);
    return NULL;
  }
  return l;
}

td_value *td__rref_outcome_err(td_status st, const char *msg) {
  td_value *l = td_value_list();
  td_value *s = td_value_int((int64_t)st), *m = td_value_string(msg ? msg : "");
  if (!l || !s || !m || td_value_list_append(l, s) != TD_OK) {
    td_value_unref(l);
    td_value_unref(s);
    td_value_unref(m);
    return NULL;
  }
  if (td_value_list_append(l, m) != TD_OK) {
    td_value_unref(l);
    td_value_unref(m);
    return NULL;
  }
  return l;
}

td_status td__rref_outcome_take(const td_value *o, td_value **value) {
  int64_t st = -1;
  td_value *item = td_value_list_get(o, 1);
  if (td_value_list_len(o) != 2 || td_value_as_int(td_value_list_get(o, 0), &st) != TD_OK || !item)
    return td_set_error(TD_ERR_FORMAT, "rref: malformed reply from the owner");
  if (st == TD_OK) {
    *value = td_value_ref(item);
    return TD_OK;
  }
  const char *msg = "";
  td_value_as_string(item, &msg, NULL);
  td_status s = st > 0 && st <= TD_ERR_INTERNAL ? (td_status)st : TD_ERR_REMOTE;
  return td_set_error(s, "%s", msg);
}

/* ---- control messages ---- */

typedef struct ctl {
  td__rref_ctx *c;
  int to;
  char fn[32];
  td_value *args;
  td_rref *hold;
  td_future *outcome; /* completed (or failed) when the message ends; may be NULL */
  int attempt;
  uint64_t due_ns;
  struct ctl *next;
} ctl;

static pthread_once_t timer_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t timer_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t timer_cv;
static ctl *timer_list; /* sorted by due_ns */
static bool timer_ok;

static td_status ctl_send(ctl *m);

/* Ends m: its outcome (st, msg) goes to m->outcome, its references are released. */
static void ctl_finish(ctl *m, td_status st, const char *msg) {
  if (m->outcome) {
    if (st == TD_OK) td_future_complete(m->outcome, NULL);
    else td__future_fail_msg(m->outcome, st, msg);
    td_future_unref(m->outcome);
  }
  if (m->hold) {
    __atomic_sub_fetch(&m->hold->children, 1, __ATOMIC_ACQ_REL);
    td_rref_unref(m->hold);
  }
  td_value_unref(m->args);
  td__rref_ctx_unref(m->c);
  td__free(m);
}

static void *timer_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&timer_mu);
  for (;;) {
    if (!timer_list) {
      pthread_cond_wait(&timer_cv, &timer_mu);
      continue;
    }
    uint64_t now = td__now_ns();
    if (timer_list->due_ns > now) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      uint64_t wake = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec +
                      (timer_list->due_ns - now);
      ts.tv_sec = (time_t)(wake / 1000000000ull);
      ts.tv_nsec = (long)(wake % 1000000000ull);
      pthread_cond_timedwait(&timer_cv, &timer_mu, &ts);
      continue;
    }
    ctl *m = timer_list;
    timer_list = m->next;
    pthread_mutex_unlock(&timer_mu);
    (void)ctl_send(m);
    pthread_mutex_lock(&timer_mu);
  }
  return NULL;
}

static void timer_start(void) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&timer_cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_t t;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  timer_ok = pthread_create(&t, &at, timer_main, NULL) == 0;
  pthread_attr_destroy(&at);
}

/* Queues m for a later attempt; false when no timer thread could be started. */
static bool ctl_later(ctl *m, uint64_t delay_ms) {
  pthread_once(&timer_once, timer_start);
  if (!timer_ok) return false;
  m->due_ns = td__now_ns() + delay_ms * 1000000ull;
  pthread_mutex_lock(&timer_mu);
  ctl **p = &timer_list;
  while (*p && (*p)->due_ns <= m->due_ns) p = &(*p)->next;
  m->next = *p;
  *p = m;
  pthread_cond_signal(&timer_cv);
  pthread_mutex_unlock(&timer_mu);
  return true;
}

static void ctl_done(td_future *f, void *arg) {
  ctl *m = arg;
  td_status st = td_future_status(f);
  if (st == TD_ERR_UNAVAILABLE && m->attempt < 3) {
    uint64_t delay = 20ull << (2 * m->attempt); /* 20, 80, 320 ms */
    m->attempt++;
    if (ctl_later(m, delay)) return;
  }
  if (st != TD_OK)
    td_log(TD_LOG_DEBUG, "rref: %s to rank %d failed: %s", m->fn, m->to, td_future_message(f));
  ctl_finish(m, st, st == TD_OK ? NULL : td_future_message(f));
}

static td_status ctl_send(ctl *m) {
  td_future *f = NULL;
  td_status st = td__rref_call(m->c, m->to, m->fn, &m->args, 1, TD_TIMEOUT_DEFAULT, &f);
  if (st != TD_OK) {
    char why[600];
    snprintf(why, sizeof why, "%s", td_last_error());
    td_log(TD_LOG_DEBUG, "rref: cannot send %s to rank %d: %s", m->fn, m->to, why);
    ctl_finish(m, st, why);
    return td_set_error(st, "%s", why);
  }
  if (td_future_on_done(f, ctl_done, m) != TD_OK)
    ctl_finish(m, TD_ERR_NOMEM, "rref: out of memory waiting for a control message's reply");
  td_future_unref(f);
  return TD_OK;
}

td_status td__rref_control(td__rref_ctx *c, int to, const char *fn, td_value *args,
                           td_rref *hold) {
  return td__rref_control_ex(c, to, fn, args, hold, NULL);
}

td_status td__rref_control_ex(td__rref_ctx *c, int to, const char *fn, td_value *args,
                              td_rref *hold, td_future **outcome) {
  if (outcome) *outcome = NULL;
  ctl *m = args ? td__calloc(1, sizeof *m) : NULL;
  td_future *out = m && outcome ? td_future_create() : NULL;
  if (!m || (outcome && !out)) {
    td__free(m);
    if (hold) {
      __atomic_sub_fetch(&hold->children, 1, __ATOMIC_ACQ_REL);
      td_rref_unref(hold);
    }
    td_value_unref(args);
    td_status st = td_set_error(TD_ERR_NOMEM, "rref: out of memory sending %s", fn);
    if (out) {
      td__future_fail_msg(out, st, td_last_error());
      *outcome = out;
    }
    return st;
  }
  if (out) {
    m->outcome = td_future_ref(out);
    *outcome = out;
  }
  td__ref_inc(&c->rc);
  m->c = c;
  m->to = to;
  snprintf(m->fn, sizeof m->fn, "%s", fn);
  m->args = args;
  m->hold = hold;
  return ctl_send(m);
}

/* ---- opaque objects ---- */

typedef struct obj_type {
  char *name;
  td_object_destroy_fn destroy;
} obj_type;

typedef struct obj_box {
  const obj_type *type;
  void *obj;
} obj_box;

static pthread_mutex_t obj_mu = PTHREAD_MUTEX_INITIALIZER;
static obj_type **obj_types; /* never shrinks; entries live until exit */
static size_t obj_len, obj_cap;

static void box_destroy(void *p) {
  obj_box *b = p;
  if (b->type->destroy) b->type->destroy(b->obj);
  td__free(b);
}

static td_status box_to_wire(void *p, td__wire_ctx *ctx, td_value **out) {
  obj_box *b = p;
  return td_set_error(TD_ERR_INVALID, "value: an object of type '%s' cannot leave its process "
                      "(keep it on its owner and use an RRef)", b->type->name);
}

static void box_describe(const void *p, char *buf, size_t n) {
  const obj_box *b = p;
  snprintf(buf, n, "<%s object>", b->type->name);
}

static const td__value_ext_type box_type = {
    .name = "object", .destroy = box_destroy, .to_wire = box_to_wire, .describe = box_describe};

static const obj_type *obj_find(const char *name) {
  for (size_t i = 0; i < obj_len; i++)
    if (strcmp(obj_types[i]->name, name) == 0) return obj_types[i];
  return NULL;
}

td_status td_object_type_register(const char *name, td_object_destroy_fn destroy) {
  TD_CHECK_ARG(name && *name, "object_type_register: empty name");
  td_status st = TD_OK;
  pthread_mutex_lock(&obj_mu);
  const obj_type *t = obj_find(name);
  if (t) {
    if (t->destroy != destroy)
      st = td_set_error(TD_ERR_EXISTS, "object_type_register: '%s' is already registered with "
                        "another destructor", name);
    goto out;
  }
  if (obj_len == obj_cap) {
    size_t nc = obj_cap ? obj_cap * 2 : 8;
    obj_type **nt = td__realloc(obj_types, nc * sizeof *nt);
    if (!nt) {
      st = td_set_error(TD_ERR_NOMEM, "object_type_register: out of memory");
      goto out;
    }
    obj_types = nt;
    obj_cap = nc;
  }
  obj_type *nt = td__calloc(1, sizeof *nt);
  char *n = td__strdup(name);
  if (!nt || !n) {
    td__free(nt);
    td__free(n);
    st = td_set_error(TD_ERR_NOMEM, "object_type_register: out of memory");
    goto out;
  }
  nt->name = n;
  nt->destroy = destroy;
  obj_types[obj_len++] = nt;
out:
  pthread_mutex_unlock(&obj_mu);
  return st;
}

td_status td_value_object(const char *type, void *obj, td_value **out) {
  TD_CHECK_ARG(type && out, "value_object: NULL type or out");
  pthread_mutex_lock(&obj_mu);
  const obj_type *t = obj_find(type);
  pthread_mutex_unlock(&obj_mu);
  if (!t)
    return td_set_error(TD_ERR_NOT_FOUND, "value_object: no object type '%s' is registered "
                        "(td_object_type_register)", type);
  obj_box *b = td__calloc(1, sizeof *b);
  if (!b) return td_set_error(TD_ERR_NOMEM, "value_object: out of memory");
  /* td__value_ext destroys the box when it fails: until it succeeds the box points at a type
   * without destructor, so the caller keeps obj */
  static const obj_type detached = {"detached", NULL};
  b->type = &detached;
  b->obj = obj;
  td_value *v = td__value_ext(&box_type, b);
  if (!v) return td_set_error(TD_ERR_NOMEM, "value_object: out of memory");
  b->type = t;
  *out = v;
  return TD_OK;
}

td_status td_value_as_object(const td_value *v, const char *type, void **obj) {
  TD_CHECK_ARG(obj, "value_as_object: NULL out");
  if (td__value_ext_type_of(v) != &box_type)
    return td_set_error(TD_ERR_INVALID, "value: expected object, got %s", td_value_kind_name(v));
  obj_box *b = td__value_ext_obj(v);
  if (type && strcmp(type, b->type->name) != 0)
    return td_set_error(TD_ERR_INVALID, "value: expected object of type '%s', got '%s'", type,
                        b->type->name);
  *obj = b->obj;
  return TD_OK;
}

const char *td_value_object_type(const td_value *v) {
  if (td__value_ext_type_of(v) != &box_type) return NULL;
  return ((obj_box *)td__value_ext_obj(v))->type->name;
}

void td__rref_objects_init(void) { td__value_ext_register(&box_type); }
