/* backward.c - send and recv functions and the distributed backward pass (FAST mode).
 *
 * Recording (called by the middleware in context.c):
 * - Sender: the tensors of a message that require grad (in td__value_walk_tensors order) become
 *   the inputs of one "SendRpcBackward" external node, stored in the context under a fresh
 *   autograd message id ((rank << 48) | counter). The envelope carries the id and, in aux, the
 *   walk indices of those tensors.
 * - Receiver: the listed tensors become outputs 0..k-1 of one "RecvRpcBackward" node with no
 *   inputs (td_autograd_attach). The node keeps only ids (context, message, peer), never a
 *   pointer to the context, so contexts and graphs form no cycle.
 *
 * Backward: a pass (the root's call, or one __dist_backward request) runs the local engine with
 * the context's grad map and a thread-local `da_pass`. A recv function reached by the engine
 * sends its gradients to its peer with __dist_backward {ctx, msg, retain, grads} (asynchronously)
 * and records the future in the pass. The peer resumes from the send function
 * (td_autograd_backward_node) in a pass of its own, and replies once its pass and every
 * __dist_backward it sent in turn have finished: the reply is a future joined over them, so no
 * thread waits. The root waits for its own join, hence returns when the whole tree is done.
 * Each incoming gradient batch runs its own engine pass (FAST mode): a local graph reached by
 * several send functions of one context runs once per batch, which needs retain_graph when those
 * graphs share non-leaf nodes (as in PyTorch's FAST mode).
 *
 * Errors: a failing node fails its pass; the error travels back through the replies, each hop
 * prefixed by the agent with the worker's name and rank, so the root's message names them all.
 *
 * Lock order: a join's mu and a context's mu are leaves here (never held together, never across
 * a call into the agent, the engine or a future).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_autograd_impl.h"
#include "../core/trace_impl.h"

typedef struct da_pass {
  da_state *st;
  uint64_t ctx_id;
  bool retain;
  td_future **outs;
  int n, cap;
} da_pass;

static _Thread_local da_pass *tl_pass;

/* ---- joining futures ---- */

typedef struct join {
  td_future *out;
  td_future **fs;
  int n;
  int left; /* atomic */
  pthread_mutex_t mu;
  td_status st;
  char *msg;
  void (*done)(void *ud);
  void *ud;
} join;

static void join_finish(join *j) {
  if (j->done) j->done(j->ud);
  if (j->st != TD_OK) td__future_fail_msg(j->out, j->st, j->msg ? j->msg : "");
  else td_future_complete(j->out, td_value_none());
  for (int i = 0; i < j->n; i++) td_future_unref(j->fs[i]);
  td__free(j->fs);
  td__free(j->msg);
  td_future_unref(j->out);
  pthread_mutex_destroy(&j->mu);
  td__free(j);
}

static void join_fail(join *j, td_status st, const char *msg) {
  pthread_mutex_lock(&j->mu);
  if (j->st == TD_OK) {
    j->st = st;
    j->msg = td__strdup(msg ? msg : "");
  }
  pthread_mutex_unlock(&j->mu);
}

static void join_cb(td_future *f, void *ud) {
  join *j = ud;
  if (td_future_status(f) != TD_OK) join_fail(j, td_future_status(f), td_future_message(f));
  if (__atomic_sub_fetch(&j->left, 1, __ATOMIC_ACQ_REL) == 0) join_finish(j);
}

td_status td__da_join(td_future **fs, int n, td_status first_error, const char *first_msg,
                      void (*done)(void *ud), void *ud, td_future **out) {
  join *j = td__calloc(1, sizeof *j);
  td_future *f = td_future_create();
  if (!j || !f) {
    td__free(j);
    td_future_unref(f);
    for (int i = 0; i < n; i++) td_future_unref(fs[i]);
    td__free(fs);
    if (done) done(ud);
    return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  }
  pthread_mutex_init(&j->mu, NULL);
  j->out = td_future_ref(f);
  j->fs = fs;
  j->n = n;
  j->left = n + 1;
  j->done = done;
  j->ud = ud;
  if (first_error != TD_OK) join_fail(j, first_error, first_msg);
  for (int i = 0; i < n; i++) {
    if (td_future_on_done(fs[i], join_cb, j) != TD_OK) {
      join_fail(j, TD_ERR_NOMEM, "dist_autograd: out of memory");
      __atomic_sub_fetch(&j->left, 1, __ATOMIC_ACQ_REL);
    }
  }
  if (__atomic_sub_fetch(&j->left, 1, __ATOMIC_ACQ_REL) == 0) join_finish(j);
  *out = f;
  return TD_OK;
}

/* ---- send functions ---- */

static td_status send_backward(void *ctx, td_tensor *const *gout, int n_out, td_tensor **gin,
                               int n_in) {
  for (int i = 0; i < n_in; i++) gin[i] = i < n_out && gout[i] ? td_tensor_ref(gout[i]) : NULL;
  return TD_OK;
}

typedef struct collect {
  td_tensor **ts;
  uint64_t *idx;
  int n, cap;
  uint64_t pos;
} collect;

static td_status collect_visit(void *ud, td_tensor *t) {
  collect *c = ud;
  uint64_t pos = c->pos++;
  if (!td_tensor_requires_grad(t)) return TD_OK;
  if (c->n == c->cap) {
    int nc = c->cap ? c->cap * 2 : 8;
    td_tensor **ts = td__realloc(c->ts, (size_t)nc * sizeof *ts);
    if (!ts) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
    c->ts = ts;
    uint64_t *idx = td__realloc(c->idx, (size_t)nc * sizeof *idx);
    if (!idx) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
    c->idx = idx;
    c->cap = nc;
  }
  c->ts[c->n] = t;
  c->idx[c->n++] = pos;
  return TD_OK;
}

td_status td__da_record_send(td_dist_autograd_context *c, int peer, td__msg *m) {
  collect col = {0};
  td_status st = TD_OK;
  for (int i = 0; i < m->nvalues && st == TD_OK; i++)
    st = td__value_walk_tensors(m->values[i], collect_visit, &col);
  if (st != TD_OK || col.n == 0) goto out;
  da_state *s = c->st;
  uint64_t msg_id = ((uint64_t)s->rank << 48) |
                    (__atomic_add_fetch(&s->next_msg, 1, __ATOMIC_RELAXED) & ((1ull << 48) - 1));
  td_node *node;
  st = td_node_create_external("SendRpcBackward", col.n, col.ts, col.n, send_backward, NULL, NULL,
                               &node);
  if (st != TD_OK) goto out;
  st = td__da_send_add(c, msg_id, node);
  td_node_unref(node);
  if (st != TD_OK) goto out;
  m->autograd_msg_id = msg_id;
  m->aux = col.idx;
  m->naux = col.n;
  col.idx = NULL;
out:
  td__free(col.ts);
  td__free(col.idx);
  return st;
}

/* ---- recv functions ---- */

typedef struct recv_fn {
  da_state *st;
  uint64_t ctx_id, msg_id;
  int peer;
  bool from_request; /* the tensors came as arguments of the peer's request (else in a reply) */
} recv_fn;

static td_status recv_backward(void *ctx, td_tensor *const *gout, int n_out, td_tensor **gin,
                               int n_in) {
  recv_fn *r = ctx;
  da_pass *p = tl_pass;
  char b[40];
  if (!p || p->ctx_id != r->ctx_id)
    return td_set_error(TD_ERR_STATE, "RecvRpcBackward of context %s reached outside a "
                        "distributed backward pass of that context (use td_dist_autograd_backward)",
                        td__da_id_str(r->ctx_id, b, sizeof b));
  if (p->n == p->cap) {
    int nc = p->cap ? p->cap * 2 : 8;
    td_future **o = td__realloc(p->outs, (size_t)nc * sizeof *o);
    if (!o) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
    p->outs = o;
    p->cap = nc;
  }
  td_value *grads = td_value_list();
  td_value *args[4] = {td_value_int((int64_t)r->ctx_id), td_value_int((int64_t)r->msg_id),
                       td_value_bool(p->retain), grads};
  td_status st = grads && args[0] && args[1] ? TD_OK
                                             : td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  for (int i = 0; i < n_out && st == TD_OK; i++) {
    td_value *g = gout[i] ? td_value_tensor(gout[i]) : td_value_none();
    if (!g) st = td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
    else if ((st = td_value_list_append(grads, g)) != TD_OK) td_value_unref(g);
  }
  if (st == TD_OK) {
    char name[128];
    td__da_worker_name(r->st, r->peer, name, sizeof name);
    /* gradients retrace the tensors' path: back along a request with the map its replies use
     * (PyTorch: the reverse device map), back along a reply with our own map */
    /* a backward hop: the call carries the context as its subject in the flight recorder */
    td__flight_record(&(td__flight_ev){.kind = TD__FL_BWD_SEND, .peer = r->peer, .a = r->ctx_id,
                                       .b = r->msg_id, .c = (uint32_t)n_out}, "__dist_backward");
    td__flight_subj prev = td__flight_subject_set((td__flight_subj){TD__FL_SUBJ_CTX, r->ctx_id});
    st = r->from_request ? td__rpc_async_reply_map(r->st->agent, name, "__dist_backward", args, 4,
                                                   NULL, &p->outs[p->n])
                         : td_rpc_async(r->st->agent, name, "__dist_backward", args, 4, NULL,
                                        &p->outs[p->n]);
    td__flight_subject_set(prev);
    if (st == TD_OK) p->n++;
  }
  for (int i = 0; i < 4; i++) td_value_unref(args[i]);
  return st;
}

typedef struct attach_state {
  td_node *node;
  const uint64_t *idx;
  int n, j;
  uint64_t pos;
} attach_state;

static td_status attach_visit(void *ud, td_tensor *t, td_tensor **repl) {
  attach_state *a = ud;
  uint64_t pos = a->pos++;
  if (a->j >= a->n || a->idx[a->j] != pos) return TD_OK;
  TD_TRY(td_autograd_attach(t, a->node, a->j, repl));
  a->j++;
  return TD_OK;
}

td_status td__da_attach_recv(td_dist_autograd_context *c, int peer, td__msg *m) {
  for (int i = 1; i < m->naux; i++)
    if (m->aux[i] <= m->aux[i - 1])
      return td_set_error(TD_ERR_FORMAT, "dist_autograd: malformed gradient tensor list");
  recv_fn *r = td__malloc(sizeof *r);
  if (!r) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  *r = (recv_fn){c->st, c->id, m->autograd_msg_id, peer, m->kind == TD__MSG_REQUEST};
  td_node *node;
  TD_TRY(td_node_create_external("RecvRpcBackward", m->naux, NULL, 0, recv_backward, r, td__free,
                                 &node));
  attach_state as = {node, m->aux, m->naux, 0, 0};
  td_status st = TD_OK;
  for (int i = 0; i < m->nvalues && st == TD_OK; i++)
    st = td__value_map_tensors(m->values[i], attach_visit, &as);
  if (st == TD_OK && as.j != as.n)
    st = td_set_error(TD_ERR_FORMAT, "dist_autograd: the message lists %d gradient tensors but "
                      "holds %d of them", as.n, as.j);
  td_node_unref(node);
  return st;
}

/* ---- passes ---- */

static void running_dec(void *ud) {
  da_state *s = ud;
  __atomic_sub_fetch(&s->running, 1, __ATOMIC_ACQ_REL);
}

/* Runs the local part: roots (root pass) or node with grads (forwarded pass). On return, p holds
 * the futures of the __dist_backward calls it made. */
static td_status run_local(da_pass *p, td_dist_autograd_context *c, td_tensor *const *roots,
                           int nroots, td_node *node, td_tensor *const *grads, int ngrads) {
  td_backward_opts o = {.retain_graph = p->retain, .grad_map = c->grads};
  da_pass *prev = tl_pass;
  tl_pass = p;
  td_status st = roots ? td_autograd_backward(roots, NULL, nroots, &o)
                       : td_autograd_backward_node(node, grads, ngrads, &o);
  tl_pass = prev;
  return st;
}

/* __dist_backward [ctx id, msg id, retain, [grads]] */
static td_status h_backward(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  int64_t ctx_id, msg_id;
  bool retain;
  if (n != 4 || td_value_as_int(args[0], &ctx_id) != TD_OK ||
      td_value_as_int(args[1], &msg_id) != TD_OK || td_value_as_bool(args[2], &retain) != TD_OK ||
      td_value_kind_of(args[3]) != TD_VALUE_LIST)
    return td_set_error(TD_ERR_FORMAT, "__dist_backward: malformed request");
  td__flight_annotate((td__flight_subj){TD__FL_SUBJ_CTX, (uint64_t)ctx_id});
  td__flight_record(&(td__flight_ev){.kind = TD__FL_BWD_RECV, .peer = td_rpc_ctx_caller_rank(x),
                                     .a = (uint64_t)ctx_id, .b = (uint64_t)msg_id,
                                     .c = (uint32_t)td_value_list_len(args[3])},
                    "__dist_backward");
  da_state *s = td__da_state_of(td_rpc_ctx_agent(x));
  if (!s) return td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  char b1[40], b2[40];
  td_dist_autograd_context *c = td__da_lookup(s, (uint64_t)ctx_id);
  if (!c)
    return td_set_error(TD_ERR_NOT_FOUND, "dist_autograd: no context %s here (it ended or never "
                        "reached this worker)", td__da_id_str((uint64_t)ctx_id, b1, sizeof b1));
  td_node *node = td__da_send_find(c, (uint64_t)msg_id);
  if (!node) {
    td_dist_autograd_context_unref(c);
    return td_set_error(TD_ERR_NOT_FOUND, "dist_autograd: context %s has no send function %s",
                        td__da_id_str((uint64_t)ctx_id, b1, sizeof b1),
                        td__da_id_str((uint64_t)msg_id, b2, sizeof b2));
  }
  size_t ng = td_value_list_len(args[3]);
  td_tensor **grads = td__calloc(ng ? ng : 1, sizeof *grads);
  td_status st = grads ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_autograd: out of memory");
  for (size_t i = 0; i < ng && st == TD_OK; i++) {
    td_value *g = td_value_list_get(args[3], i);
    if (td_value_kind_of(g) == TD_VALUE_TENSOR) st = td_value_as_tensor(g, &grads[i]);
  }
  da_pass p = {s, (uint64_t)ctx_id, retain, NULL, 0, 0};
  __atomic_add_fetch(&s->running, 1, __ATOMIC_ACQ_REL);
  if (st == TD_OK) st = run_local(&p, c, NULL, 0, node, grads, (int)ng);
  td__free(grads);
  td_node_unref(node);
  td_dist_autograd_context_unref(c);
  if (p.n == 0) {
    td__free(p.outs);
    running_dec(s);
    if (st != TD_OK) return st;
    *res = td_value_none();
    return TD_OK;
  }
  char msg[1024] = "";
  if (st != TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
  return td__da_join(p.outs, p.n, st, msg, running_dec, s, fut);
}

/* prefix_then prefixes a failed pass's message with "dist_autograd_backward: ". */
static td_status prefix_then(void *ud, td_future *src, td_value **result, td_future **next) {
  (void)ud, (void)next, (void)result;
  if (td_future_status(src) == TD_OK) return TD_OK;
  return td_set_error(td_future_status(src), "dist_autograd_backward: %s",
                      td_future_message(src));
}

/* backward_start checks the arguments, runs the local part on the calling thread and returns in
 * *out a future completed when every worker's part has finished (the join over the
 * __dist_backward calls the local part made), or failed with the first error, which names the
 * worker where it happened. A failure of the checks is returned (nothing started). */
static td_status backward_start(td_dist_autograd_context *c, td_tensor *const *roots, int n,
                                bool retain_graph, td_future **out) {
  TD_CHECK_ARG(c && roots && n > 0 && out, "dist_autograd_backward: invalid argument");
  da_state *s = c->st;
  char b[40];
  pthread_mutex_lock(&c->mu);
  bool ended = c->ended;
  pthread_mutex_unlock(&c->mu);
  if (ended)
    return td_set_error(TD_ERR_STATE, "dist_autograd_backward: context %s has ended",
                        td__da_id_str(c->id, b, sizeof b));
  /* as PyTorch's distributed engine: every root requires grad and has a gradient function (a
   * leaf has none, so backward from it would do nothing) */
  for (int i = 0; i < n; i++) {
    TD_CHECK_ARG(roots[i], "dist_autograd_backward: root %d is NULL", i);
    if (!td_tensor_requires_grad(roots[i]))
      return td_set_error(TD_ERR_INVALID, "dist_autograd_backward: root %d does not require grad "
                          "(requires_grad not set on root)", i);
    if (td_tensor_is_leaf(roots[i]))
      return td_set_error(TD_ERR_INVALID, "dist_autograd_backward: root %d is a leaf: it does not "
                          "have a valid gradient function", i);
  }
  da_pass p = {s, c->id, retain_graph, NULL, 0, 0};
  __atomic_add_fetch(&s->running, 1, __ATOMIC_ACQ_REL);
  td_status st = run_local(&p, c, roots, n, NULL, NULL, 0);
  char msg[1200] = "";
  if (st != TD_OK) {
    char name[128];
    td__da_worker_name(s, s->rank, name, sizeof name);
    snprintf(msg, sizeof msg, "%s (rank %d): %s", name, s->rank, td_last_error());
  }
  td_future *j = NULL;
  /* the join takes p.outs (also when p.n == 0) and decrements the running count when done */
  td_status js = td__da_join(p.outs, p.n, st, msg, running_dec, s, &j);
  if (js != TD_OK) return js;
  td_future *f = NULL;
  js = td_future_then(j, prefix_then, NULL, &f);
  td_future_unref(j);
  if (js != TD_OK) return js;
  *out = f;
  return TD_OK;
}

static td_status backward_impl(td_dist_autograd_context *c, td_tensor *const *roots, int n,
                               bool retain_graph) {
  td_future *f = NULL;
  /* the whole pass is one open record about the context: why-hung follows its hops from it */
  td__flight_ev fl = {.kind = TD__FL_SCOPE_BEGIN, .peer = -1, .b = c ? c->id : 0,
                      .y = TD__FL_SUBJ_CTX, .c = UINT32_MAX};
  td__flight_push(&fl, "dist_backward");
  td_status st = backward_start(c, roots, n, retain_graph, &f);
  if (st == TD_OK) {
    td__future_set_flight_subject(f, TD__FL_SUBJ_CTX, c->id);
    st = td_future_wait(f, TD_TIMEOUT_INFINITE); /* each RPC is bounded by its timeout */
    if (st != TD_OK) td_set_error(st, "%s", td_future_message(f));
    td_future_unref(f);
  }
  fl.kind = TD__FL_SCOPE_END;
  fl.x = (uint8_t)st;
  td__flight_pop(&fl, "dist_backward");
  return st;
}

void td__da_backward_register(void) {
  td__rpc_register_internal("__dist_backward", h_backward, NULL);
}

/* The root's whole distributed backward, as one span in traces. */
td_status td_dist_autograd_backward(td_dist_autograd_context *c, td_tensor *const *roots, int n,
                                    bool retain_graph) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td_status st = backward_impl(c, roots, n, retain_graph);
  if (t0) td__trace_complete("autograd", "dist_autograd backward", t0, td__now_ns(), NULL);
  return st;
}

/* The async form: the span of the trace covers the local part only (the rest runs elsewhere). */
td_status td_dist_autograd_backward_async(td_dist_autograd_context *c, td_tensor *const *roots,
                                          int n, bool retain_graph, td_future **out) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  td_status st = backward_start(c, roots, n, retain_graph, out);
  if (t0) td__trace_complete("autograd", "dist_autograd backward (local part)", t0, td__now_ns(),
                             NULL);
  return st;
}
