/* context.c - distributed autograd contexts: ids, the per-thread current context, propagation
 * through the RPC agent (message middleware), cleanup across workers, and the user API.
 *
 * Design:
 * - One da_state per agent holds the live contexts (a small array: a worker has a handful of
 *   contexts alive at a time) and a ring of tombstones (ids of contexts that ended here).
 * - The creator makes a context with begin(); any other worker creates its part lazily when a
 *   request carrying the id arrives (never for an id this worker created, never for a tombstoned
 *   id, so a straggler that arrives after the cleanup cannot revive a context).
 * - Middleware (registered with the agent at library load): a request sent from a thread whose
 *   current context belongs to that agent carries the context id; a response carries the id of
 *   the request it answers. Both ends remember the peer as a participant, the sender records a
 *   send function and the receiver attaches a recv function (backward.c) when tensors that
 *   require grad travel. The handler serving a request runs with its context current, so nested
 *   calls carry it on. Calls to self carry the id but record nothing: their values are shared,
 *   so the local graph already connects them. Internal "__dist_" messages never carry a context.
 * - Cleanup: ending a context on its creator removes it (leaving a tombstone) and sends
 *   __dist_cleanup to every participant; each removes its part and forwards the cleanup to its own
 *   participants except the sender, replying only when those replies came back (futures chained,
 *   no thread waits). Cycles end at tombstones, so the creator's call returns when the whole tree
 *   is clean.
 *
 * Invariants: a context in the table has ended == false; every reference to a context is counted
 * (the table's, user handles, handler scopes, lookups in progress); send functions live exactly as
 * long as their context. Lock order: state mu, then context mu.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_autograd_impl.h"

static pthread_mutex_t states_mu = PTHREAD_MUTEX_INITIALIZER;
static da_state *states; /* live agents' states; retired states stay reachable (tiny, rare) */
static da_state *retired;

static _Thread_local td_dist_autograd_context *tl_cur;

const char *td__da_id_str(uint64_t id, char *buf, size_t n) {
  snprintf(buf, n, "%llu:%llu", (unsigned long long)(id >> 48),
           (unsigned long long)(id & ((1ull << 48) - 1)));
  return buf;
}

da_state *td__da_state_of(td_rpc_agent *a) {
  pthread_mutex_lock(&states_mu);
  da_state *s = states;
  while (s && s->agent != a) s = s->next;
  if (!s) {
    s = td__calloc(1, sizeof *s);
    if (s) {
      s->agent = a;
      s->rank = td_rpc_rank(a);
      s->world = td_rpc_world_size(a);
      pthread_mutex_init(&s->mu, NULL);
      s->next = states;
      states = s;
    }
  }
  pthread_mutex_unlock(&states_mu);
  return s;
}

void td__da_worker_name(da_state *s, int rank, char *buf, size_t n) {
  td_worker_info wi;
  if (td_rpc_get_worker_info_by_rank(s->agent, rank, &wi) == TD_OK) snprintf(buf, n, "%s", wi.name);
  else snprintf(buf, n, "rank %d", rank);
}

/* ---- contexts ---- */

static void ctx_free(td_dist_autograd_context *c) {
  for (size_t i = 0; i < c->nsends; i++) td_node_unref(c->sends[i].node);
  td__free(c->sends);
  td_grad_map_destroy(c->grads);
  td__free(c->workers);
  pthread_mutex_destroy(&c->mu);
  td__free(c);
}

td_dist_autograd_context *td_dist_autograd_context_ref(td_dist_autograd_context *c) {
  if (c) td__ref_inc(&c->rc);
  return c;
}

void td_dist_autograd_context_unref(td_dist_autograd_context *c) {
  if (c && td__ref_dec(&c->rc)) ctx_free(c);
}

static td_dist_autograd_context *ctx_new(da_state *s, uint64_t id) {
  td_dist_autograd_context *c = td__calloc(1, sizeof *c);
  if (!c) return NULL;
  c->workers = td__calloc((size_t)(s->world > 0 ? s->world : 1), 1);
  if (!c->workers || td_grad_map_create(&c->grads) != TD_OK) {
    td__free(c->workers);
    td__free(c);
    return NULL;
  }
  pthread_mutex_init(&c->mu, NULL);
  td__ref_init(&c->rc);
  c->id = id;
  c->st = s;
  return c;
}

/* s->mu held. */
static td_dist_autograd_context *table_find(da_state *s, uint64_t id) {
  for (size_t i = 0; i < s->nctxs; i++)
    if (s->ctxs[i]->id == id) return s->ctxs[i];
  return NULL;
}

static bool table_add(da_state *s, td_dist_autograd_context *c) {
  if (s->nctxs == s->capctxs) {
    size_t nc = s->capctxs ? s->capctxs * 2 : 16;
    td_dist_autograd_context **n = td__realloc(s->ctxs, nc * sizeof *n);
    if (!n) return false;
    s->ctxs = n;
    s->capctxs = nc;
  }
  s->ctxs[s->nctxs++] = td_dist_autograd_context_ref(c);
  return true;
}

static bool tombstoned(da_state *s, uint64_t id) {
  for (size_t i = 0; i < s->ntomb; i++)
    if (s->tomb[i] == id) return true;
  return false;
}

td_dist_autograd_context *td__da_lookup(da_state *s, uint64_t id) {
  if (!s || !id) return NULL;
  pthread_mutex_lock(&s->mu);
  td_dist_autograd_context *c = td_dist_autograd_context_ref(table_find(s, id));
  pthread_mutex_unlock(&s->mu);
  return c;
}

/* For a request from another worker: the context, created when this worker has not seen it. */
static td_dist_autograd_context *lookup_or_create(da_state *s, uint64_t id) {
  pthread_mutex_lock(&s->mu);
  td_dist_autograd_context *c = table_find(s, id);
  if (c) {
    td_dist_autograd_context_ref(c);
  } else if (!s->closed && (int)(id >> 48) != s->rank && !tombstoned(s, id)) {
    c = ctx_new(s, id);
    if (c && !table_add(s, c)) {
      td_dist_autograd_context_unref(c);
      c = NULL;
    }
  }
  pthread_mutex_unlock(&s->mu);
  return c;
}

/* Removes id from the table (tombstoning it either way) and returns the table's reference, or
 * NULL when it was not there. */
static td_dist_autograd_context *table_remove(da_state *s, uint64_t id) {
  td_dist_autograd_context *c = NULL;
  pthread_mutex_lock(&s->mu);
  for (size_t i = 0; i < s->nctxs; i++) {
    if (s->ctxs[i]->id == id) {
      c = s->ctxs[i];
      s->ctxs[i] = s->ctxs[--s->nctxs];
      break;
    }
  }
  if (!tombstoned(s, id)) {
    s->tomb[s->tomb_pos] = id;
    s->tomb_pos = (s->tomb_pos + 1) % DA_TOMBSTONES;
    if (s->ntomb < DA_TOMBSTONES) s->ntomb++;
  }
  pthread_mutex_unlock(&s->mu);
  if (c) {
    pthread_mutex_lock(&c->mu);
    c->ended = true;
    pthread_mutex_unlock(&c->mu);
  }
  return c;
}

td_node *td__da_send_find(td_dist_autograd_context *c, uint64_t msg_id) {
  td_node *n = NULL;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < c->nsends; i++)
    if (c->sends[i].msg_id == msg_id) {
      n = td_node_ref(c->sends[i].node);
      break;
    }
  pthread_mutex_unlock(&c->mu);
  return n;
}

td_status td__da_send_add(td_dist_autograd_context *c, uint64_t msg_id, td_node *node) {
  td_status st = TD_OK;
  pthread_mutex_lock(&c->mu);
  if (c->nsends == c->capsends) {
    size_t nc = c->capsends ? c->capsends * 2 : 8;
    da_send *n = td__realloc(c->sends, nc * sizeof *n);
    if (!n) {
      st = td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
      goto out;
    }
    c->sends = n;
    c->capsends = nc;
  }
  c->sends[c->nsends++] = (da_send){msg_id, td_node_ref(node)};
out:
  pthread_mutex_unlock(&c->mu);
  return st;
}

/* Marks rank as a participant; returns false when the context has ended. */
static bool ctx_touch(td_dist_autograd_context *c, int rank) {
  pthread_mutex_lock(&c->mu);
  bool live = !c->ended;
  if (live && rank >= 0 && rank < c->st->world) c->workers[rank] = 1;
  pthread_mutex_unlock(&c->mu);
  return live;
}

/* ---- middleware ---- */

static bool is_dist_fn(const char *fn) { return fn && strncmp(fn, "__dist_", 7) == 0; }

static td_status mw_on_send(td_rpc_agent *a, int peer, td__msg *m) {
  td_dist_autograd_context *c;
  if (m->kind == TD__MSG_REQUEST) {
    if (is_dist_fn(m->fn)) return TD_OK;
    c = tl_cur;
    if (!c || c->st->agent != a) return TD_OK;
    td_dist_autograd_context_ref(c);
  } else {
    c = td__da_lookup(td__da_state_of(a), m->ctx_id);
    m->ctx_id = 0;
    if (!c) return TD_OK;
  }
  td_status st = TD_OK;
  if (ctx_touch(c, peer)) {
    m->ctx_id = c->id;
    if (peer != c->st->rank) st = td__da_record_send(c, peer, m);
  }
  td_dist_autograd_context_unref(c);
  return st;
}

static td_status mw_on_recv(td_rpc_agent *a, int peer, td__msg *m) {
  if (!m->ctx_id || (m->kind == TD__MSG_REQUEST && is_dist_fn(m->fn))) return TD_OK;
  da_state *s = td__da_state_of(a);
  if (!s) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  if (peer == s->rank) return TD_OK; /* a call to self: values are shared, the graph connects */
  td_dist_autograd_context *c = m->kind == TD__MSG_REQUEST ? lookup_or_create(s, m->ctx_id)
                                                           : td__da_lookup(s, m->ctx_id);
  td_status st = TD_OK;
  if (c && ctx_touch(c, peer)) {
    if (m->naux) st = td__da_attach_recv(c, peer, m);
  } else {
    m->ctx_id = 0; /* the context ended here: the values arrive without history */
  }
  td_dist_autograd_context_unref(c);
  return st;
}

static void mw_enter(td_rpc_agent *a, const td__msg *m, td__mw_scope *scope) {
  scope->cur = NULL;
  scope->prev = tl_cur;
  if (!m->ctx_id || is_dist_fn(m->fn)) return;
  td_dist_autograd_context *c = td__da_lookup(td__da_state_of(a), m->ctx_id);
  if (!c) return;
  scope->cur = c;
  tl_cur = c;
}

static void mw_leave(td__mw_scope *scope) {
  if (!scope->cur) return;
  tl_cur = scope->prev;
  td_dist_autograd_context_unref(scope->cur);
}

static const td__rpc_middleware da_middleware = {mw_on_send, mw_on_recv, mw_enter, mw_leave};

/* ---- cleanup ---- */

/* Removes id here and sends the cleanup to its participants other than `from` (-1: none).
 * *out: a future completing when they all replied, or NULL when there was nobody to tell. */
static td_status cleanup_here(da_state *s, uint64_t id, int from, td_future **out) {
  *out = NULL;
  td_dist_autograd_context *c = table_remove(s, id);
  if (!c) return TD_OK;
  int n = 0;
  td_future **fs = td__calloc((size_t)s->world, sizeof *fs);
  td_status st = fs ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  char first[700] = "";
  td_status first_st = TD_OK;
  for (int r = 0; r < s->world && st == TD_OK; r++) {
    pthread_mutex_lock(&c->mu);
    bool w = c->workers[r];
    pthread_mutex_unlock(&c->mu);
    if (!w || r == from || r == s->rank) continue;
    char name[128];
    td__da_worker_name(s, r, name, sizeof name);
    td_value *arg = td_value_int((int64_t)id);
    if (!arg) {
      st = td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
      break;
    }
    td_status rs = td_rpc_async(s->agent, name, "__dist_cleanup", &arg, 1, NULL, &fs[n]);
    td_value_unref(arg);
    if (rs == TD_OK) {
      n++;
    } else if (first_st == TD_OK) {
      first_st = rs;
      snprintf(first, sizeof first, "cannot send the cleanup to %s (rank %d): %s", name, r,
               td_last_error());
    }
  }
  td_dist_autograd_context_unref(c);
  if (st != TD_OK) {
    for (int i = 0; i < n; i++) td_future_unref(fs[i]);
    td__free(fs);
    return st;
  }
  if (n || first_st != TD_OK) st = td__da_join(fs, n, first_st, first, NULL, NULL, out);
  else td__free(fs);
  return st;
}

/* __dist_cleanup [ctx id] */
static td_status h_cleanup(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  int64_t id;
  if (n != 1 || td_value_as_int(args[0], &id) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__dist_cleanup: malformed request");
  da_state *s = td__da_state_of(td_rpc_ctx_agent(x));
  if (!s) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  TD_TRY(cleanup_here(s, (uint64_t)id, td_rpc_ctx_caller_rank(x), fut));
  return TD_OK;
}

/* ---- user API ---- */

td_status td_dist_autograd_context_begin(td_rpc_agent *a, td_dist_autograd_context **out) {
  TD_CHECK_ARG(a && out, "dist_autograd_context_begin: NULL argument");
  if (tl_cur) {
    char b[40];
    return td_set_error(TD_ERR_STATE, "dist_autograd_context_begin: this thread already has "
                        "context %s (end it first)", td__da_id_str(tl_cur->id, b, sizeof b));
  }
  da_state *s = td__da_state_of(a);
  if (!s) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  uint64_t id = ((uint64_t)s->rank << 48) |
                (__atomic_add_fetch(&s->next_ctx, 1, __ATOMIC_RELAXED) & ((1ull << 48) - 1));
  td_dist_autograd_context *c = ctx_new(s, id);
  if (!c) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  pthread_mutex_lock(&s->mu);
  bool closed = s->closed, ok = !closed && table_add(s, c);
  pthread_mutex_unlock(&s->mu);
  if (!ok) {
    td_dist_autograd_context_unref(c);
    return closed ? td_set_error(TD_ERR_STATE, "dist_autograd_context_begin: the agent has shut "
                                 "down")
                  : td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  }
  tl_cur = c;
  *out = c;
  return TD_OK;
}

td_status td_dist_autograd_context_end_async(td_dist_autograd_context *c, td_future **out) {
  if (out) *out = NULL;
  if (!c) return TD_OK;
  da_state *s = c->st;
  char b[40];
  if ((int)(c->id >> 48) != s->rank) {
    td_status st = td_set_error(TD_ERR_STATE, "dist_autograd_context_end: context %s was created "
                                "by rank %d, not here (rank %d)",
                                td__da_id_str(c->id, b, sizeof b), (int)(c->id >> 48), s->rank);
    td_dist_autograd_context_unref(c);
    return st;
  }
  if (tl_cur == c) tl_cur = NULL;
  td_future *f = NULL;
  td_status st = cleanup_here(s, c->id, -1, &f);
  td_dist_autograd_context_unref(c);
  if (st == TD_OK && out) *out = f ? f : td_future_create();
  else td_future_unref(f);
  if (st == TD_OK && out && !*out) {
    st = td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  } else if (st == TD_OK && out && !f) {
    td_future_complete(*out, NULL);
  }
  return st;
}

td_status td_dist_autograd_context_end(td_dist_autograd_context *c) {
  if (!c) return TD_OK;
  uint64_t id = c->id;
  td_future *f = NULL;
  td_status st = td_dist_autograd_context_end_async(c, &f);
  if (st == TD_OK && f) {
    st = td_future_wait(f, TD_TIMEOUT_INFINITE);
    char b[40];
    if (st != TD_OK)
      td_set_error(st, "dist_autograd_context_end: cleanup of context %s: %s",
                   td__da_id_str(id, b, sizeof b), td_future_message(f));
  }
  td_future_unref(f);
  return st;
}

td_dist_autograd_context *td_dist_autograd_current(void) { return tl_cur; }

td_dist_autograd_context *td_dist_autograd_set_current(td_dist_autograd_context *c) {
  td_dist_autograd_context *prev = tl_cur;
  tl_cur = c;
  return prev;
}

td_status td_dist_autograd_context_retrieve(td_rpc_agent *a, td_dist_autograd_context_id id,
                                            td_dist_autograd_context **out) {
  TD_CHECK_ARG(a && out, "dist_autograd_context_retrieve: NULL argument");
  td_dist_autograd_context *c = td__da_lookup(td__da_state_of(a), id.v);
  if (!c) {
    char b[40];
    return td_set_error(TD_ERR_NOT_FOUND, "dist_autograd: no context %s on rank %d (unknown id, "
                        "or it ended)", td__da_id_str(id.v, b, sizeof b), td_rpc_rank(a));
  }
  *out = c;
  return TD_OK;
}

td_dist_autograd_context_id td_dist_autograd_context_get_id(const td_dist_autograd_context *c) {
  td_dist_autograd_context_id id = {c ? c->id : 0};
  return id;
}

static td_status copy_grad(void *ud, td_tensor *t, td_tensor *g) {
  return td_grad_map_accumulate(ud, t, g);
}

td_status td_dist_autograd_get_gradients(td_dist_autograd_context *c, td_grad_map **out) {
  TD_CHECK_ARG(c && out, "dist_autograd_get_gradients: NULL argument");
  td_grad_map *m;
  TD_TRY(td_grad_map_create(&m));
  td_status st = td_grad_map_foreach(c->grads, copy_grad, m);
  if (st != TD_OK) {
    td_grad_map_destroy(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_grad_map *td_dist_autograd_context_grad_map(td_dist_autograd_context *c) {
  return c ? c->grads : NULL;
}

td_status td_dist_autograd_get_debug_info(td_rpc_agent *a, td_dist_autograd_debug_info *out) {
  TD_CHECK_ARG(a && out, "dist_autograd_get_debug_info: NULL argument");
  da_state *s = td__da_state_of(a);
  if (!s) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&s->mu);
  out->num_contexts = (int64_t)s->nctxs;
  for (size_t i = 0; i < s->nctxs; i++) {
    pthread_mutex_lock(&s->ctxs[i]->mu);
    out->num_send_functions += (int64_t)s->ctxs[i]->nsends;
    pthread_mutex_unlock(&s->ctxs[i]->mu);
  }
  pthread_mutex_unlock(&s->mu);
  out->num_backward_passes = __atomic_load_n(&s->running, __ATOMIC_ACQUIRE);
  return TD_OK;
}

/* ---- agent hooks ---- */

static bool strict_mode;

void td_dist_autograd_set_strict(bool on) {
  __atomic_store_n(&strict_mode, on, __ATOMIC_RELEASE);
}

static bool strict_now(void) {
  const char *e = getenv("TD_DIST_AUTOGRAD_STRICT");
  return __atomic_load_n(&strict_mode, __ATOMIC_ACQUIRE) || (e && strcmp(e, "1") == 0);
}

static td_status hook_shutdown(td_rpc_agent *a, bool graceful) {
  pthread_mutex_lock(&states_mu);
  da_state **pp = &states;
  while (*pp && (*pp)->agent != a) pp = &(*pp)->next;
  da_state *s = *pp;
  if (s) {
    *pp = s->next;
    s->next = retired;
    retired = s;
  }
  pthread_mutex_unlock(&states_mu);
  if (!s) return TD_OK;
  pthread_mutex_lock(&s->mu);
  s->closed = true;
  td_dist_autograd_context **cs = s->ctxs;
  size_t n = s->nctxs;
  s->ctxs = NULL;
  s->nctxs = s->capctxs = 0;
  pthread_mutex_unlock(&s->mu);
  td_status st = TD_OK;
  if (n) {
    /* name the first few: a context still alive after a graceful shutdown was never ended */
    char ids[200] = "", b[48];
    size_t used = 0;
    for (size_t i = 0; i < n && i < 5 && used < sizeof ids; i++)
      used += (size_t)snprintf(ids + used, sizeof ids - used, "%s%s", i ? ", " : "",
                               td__da_id_str(cs[i]->id, b, sizeof b));
    td_log(TD_LOG_WARN, "dist_autograd: rank %d shut down with %zu live context(s) (%s%s); "
           "freeing them", s->rank, n, ids, n > 5 ? ", ..." : "");
    if (graceful && strict_now())
      st = td_set_error(TD_ERR_STATE, "dist_autograd: rank %d: %zu context(s) left at shutdown "
                        "(strict mode): %s%s", s->rank, n, ids, n > 5 ? ", ..." : "");
  }
  for (size_t i = 0; i < n; i++) {
    pthread_mutex_lock(&cs[i]->mu);
    cs[i]->ended = true;
    pthread_mutex_unlock(&cs[i]->mu);
    td_dist_autograd_context_unref(cs[i]);
  }
  td__free(cs);
  s->agent = NULL; /* a later agent at the same address gets a fresh state */
  return st;
}

static void layer_init_once(void) {
  td__rpc_set_middleware(&da_middleware);
  td__rpc_register_internal("__dist_cleanup", h_cleanup, NULL);
  td__da_backward_register();
  td__agent_hooks h = {NULL, hook_shutdown};
  td__agent_add_hooks(&h);
}

/* td__dist_autograd_layer_init registers this layer with the agent; td_rpc_init calls it (runtime/init.c)
 * before it starts the agent, the only registration path (no load-time constructor: static
 * programs need no dummy reference, and a dlopen()ed library registers nothing behind the
 * caller's back). Idempotent. */
void td__dist_autograd_layer_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, layer_init_once);
}
