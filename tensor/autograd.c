/* autograd.c - backward nodes, the local backward engine, gradient maps and hooks.
 *
 * Engine: a pass first walks the graph from its roots and counts, for every node, how many edges
 * point at it (dependencies). Each node has an input buffer with one slot per output; gradients
 * arriving on the same slot are summed. A node becomes ready when its count reaches zero; ready
 * nodes run in decreasing creation order (seq), which keeps memory low for chains. Leaf
 * gradients are accumulated by AccumulateGrad nodes, into the leaf's `.grad` under the leaf's
 * grad_mu, or into the caller's td_grad_map under the map's lock. Each pass is single-threaded on
 * the caller's thread and keeps all its bookkeeping in local tables, so passes on different
 * threads are independent except at the leaves. A node's backward may run a nested pass (a
 * checkpoint's recompute): each thread keeps the options of its innermost running pass
 * (pass_opts), which td__autograd_pass_opts returns to it.
 *
 * Lock order: node->mu and tensor->grad_mu and map->mu are leaves (never held together, and
 * never held while running user hooks or op backward functions).
 */
#include <stdio.h>
#include <string.h>

#include "tensor_impl.h"

static _Thread_local bool grad_disabled;
static _Thread_local const td_backward_opts *pass_opts; /* the innermost pass on this thread */
static uint64_t next_seq;
static int next_hook_handle;

bool td_autograd_is_enabled(void) { return !grad_disabled; }

const td_backward_opts *td__autograd_pass_opts(void) { return pass_opts; }

bool td_autograd_set_enabled(bool enabled) {
  bool prev = !grad_disabled;
  grad_disabled = !enabled;
  return prev;
}

/* ---- pointer hash table (open addressing, linear probing) ---- */

typedef struct {
  const void *key;
  void *val;
} ptab_slot;

typedef struct {
  ptab_slot *slots;
  size_t cap, len;
} ptab;

static size_t ptr_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x;
}

static bool ptab_grow(ptab *t) {
  size_t ncap = t->cap ? t->cap * 2 : 64;
  ptab_slot *ns = td__calloc(ncap, sizeof *ns);
  if (!ns) return false;
  for (size_t i = 0; i < t->cap; i++) {
    if (!t->slots[i].key) continue;
    size_t j = ptr_hash(t->slots[i].key) & (ncap - 1);
    while (ns[j].key) j = (j + 1) & (ncap - 1);
    ns[j] = t->slots[i];
  }
  td__free(t->slots);
  t->slots = ns;
  t->cap = ncap;
  return true;
}

static ptab_slot *ptab_find(const ptab *t, const void *key) {
  if (!t->cap) return NULL;
  size_t j = ptr_hash(key) & (t->cap - 1);
  while (t->slots[j].key) {
    if (t->slots[j].key == key) return &t->slots[j];
    j = (j + 1) & (t->cap - 1);
  }
  return NULL;
}

/* Returns the slot for key, inserting it with val NULL when absent; NULL on allocation failure. */
static ptab_slot *ptab_insert(ptab *t, const void *key, bool *inserted) {
  ptab_slot *s = ptab_find(t, key);
  *inserted = false;
  if (s) return s;
  if ((t->len + 1) * 2 > t->cap && !ptab_grow(t)) return NULL;
  size_t j = ptr_hash(key) & (t->cap - 1);
  while (t->slots[j].key) j = (j + 1) & (t->cap - 1);
  t->slots[j].key = key;
  t->slots[j].val = NULL;
  t->len++;
  *inserted = true;
  return &t->slots[j];
}

static void ptab_free(ptab *t) {
  td__free(t->slots);
  t->slots = NULL;
  t->cap = t->len = 0;
}

/* ---- nodes ---- */

static td_status accumulate_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  TD_PANIC("AccumulateGrad is run by the engine");
}
static const td__node_ops accumulate_ops = {"AccumulateGrad", accumulate_backward, NULL, NULL};

td_node *td__node_new(size_t size, const td__node_ops *ops, int n_outputs, int n_inputs) {
  TD_ASSERT(size >= sizeof(td_node) && n_outputs >= 0 && n_inputs >= 0);
  td_node *n = td__calloc(1, size);
  if (!n) return NULL;
  n->next = td__calloc((size_t)(n_inputs ? n_inputs : 1), sizeof(td__edge));
  n->outs = td__calloc((size_t)(n_outputs ? n_outputs : 1), sizeof(td__out_meta));
  if (!n->next || !n->outs) {
    td__free(n->next);
    td__free(n->outs);
    td__free(n);
    return NULL;
  }
  td__ref_init(&n->rc);
  n->ops = ops;
  n->n_outputs = n_outputs;
  n->n_inputs = n_inputs;
  n->seq = __atomic_add_fetch(&next_seq, 1, __ATOMIC_RELAXED);
  pthread_mutex_init(&n->mu, NULL);
  return n;
}

td_node *td_node_ref(td_node *n) {
  if (n) td__ref_inc(&n->rc);
  return n;
}

void td_node_unref(td_node *n) {
  /* Iterative over long chains of nodes whose last reference is held by the previous one, so
   * freeing a 100k-step graph cannot overflow the stack. */
  td_node *stack_small[64];
  td_node **stack = stack_small;
  size_t sp = 0, cap = 64;
  while (n || sp) {
    if (!n) n = stack[--sp];
    if (!td__ref_dec(&n->rc)) {
      n = NULL;
      continue;
    }
    if (n->leaf) { /* the leaf's weak pointer to this AccumulateGrad node */
      pthread_mutex_lock(&n->leaf->grad_mu);
      if (n->leaf->grad_acc == n) n->leaf->grad_acc = NULL;
      pthread_mutex_unlock(&n->leaf->grad_mu);
    }
    if (n->ops->release_saved) n->ops->release_saved(n);
    if (n->ops->destroy) n->ops->destroy(n);
    for (int i = 0; i < n->n_inputs; i++) {
      td_node *c = n->next[i].node;
      if (!c) continue;
      if (sp == cap) {
        size_t ncap = cap * 2;
        td_node **ns = td__malloc(ncap * sizeof *ns);
        if (!ns) TD_PANIC("out of memory while freeing an autograd graph");
        memcpy(ns, stack, sp * sizeof *ns);
        if (stack != stack_small) td__free(stack);
        stack = ns;
        cap = ncap;
      }
      stack[sp++] = c;
    }
    td_tensor_unref(n->leaf);
    for (td__hook *h = n->hooks, *nx; h; h = nx) {
      nx = h->next;
      td__free(h);
    }
    pthread_mutex_destroy(&n->mu);
    td__free(n->next);
    td__free(n->outs);
    td__free(n);
    n = NULL;
  }
  if (stack != stack_small) td__free(stack);
}

const char *td_node_name(const td_node *n) {
  return n && n->ops && n->ops->name ? n->ops->name : "(null)";
}
int td_node_num_inputs(const td_node *n) { return n ? n->n_inputs : 0; }
td_node *td_node_next(const td_node *n, int i) {
  return (n && i >= 0 && i < n->n_inputs) ? n->next[i].node : NULL;
}

bool td__needs_grad(const td_tensor *t) { return t && !grad_disabled && t->requires_grad; }
bool td__needs_grad2(const td_tensor *a, const td_tensor *b) {
  return td__needs_grad(a) || td__needs_grad(b);
}
bool td__node_needs_grad(const td_node *node, int i) {
  return i >= 0 && i < node->n_inputs && node->next[i].node != NULL;
}

td_status td__node_set_next(td_node *node, int i, const td_tensor *input) {
  TD_ASSERT(i >= 0 && i < node->n_inputs);
  td__edge *e = &node->next[i];
  td_node_unref(e->node);
  e->node = NULL;
  e->input_nr = 0;
  if (!input || !input->requires_grad) return TD_OK;
  if (input->grad_fn) {
    e->node = td_node_ref(input->grad_fn);
    e->input_nr = input->output_nr;
    return TD_OK;
  }
  /* a leaf has one AccumulateGrad node while any graph uses it: its uses' gradients are summed
   * by the engine before the leaf's hooks run and .grad is updated, once per backward */
  td_tensor *leaf = (td_tensor *)input;
  pthread_mutex_lock(&leaf->grad_mu);
  td_node *acc = leaf->grad_acc;
  if (acc && td__ref_try_inc(&acc->rc)) {
    pthread_mutex_unlock(&leaf->grad_mu);
    e->node = acc;
    return TD_OK;
  }
  acc = td__node_new(sizeof(td_node), &accumulate_ops, 1, 0);
  if (!acc) {
    pthread_mutex_unlock(&leaf->grad_mu);
    return td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
  }
  acc->leaf = td_tensor_ref(leaf);
  acc->outs[0].valid = true;
  acc->outs[0].ndim = input->ndim;
  memcpy(acc->outs[0].shape, input->shape, sizeof input->shape);
  acc->outs[0].dtype = input->dtype;
  acc->outs[0].device = input->storage->device;
  leaf->grad_acc = acc;
  pthread_mutex_unlock(&leaf->grad_mu);
  e->node = acc;
  return TD_OK;
}

void td__tensor_set_history(td_tensor *out, td_node *node, int output_nr) {
  TD_ASSERT(output_nr >= 0 && output_nr < node->n_outputs);
  td_node_unref(out->grad_fn);
  out->grad_fn = td_node_ref(node);
  out->output_nr = output_nr;
  out->requires_grad = true;
  td__out_meta *m = &node->outs[output_nr];
  m->valid = true;
  m->ndim = out->ndim;
  memcpy(m->shape, out->shape, sizeof out->shape);
  m->dtype = out->dtype;
  m->device = out->storage->device;
}

td_node *td__record(td_tensor *out, size_t size, const td__node_ops *ops,
                    const td_tensor *const *inputs, int n_inputs, td_status *st) {
  if (grad_disabled) return NULL;
  bool any = false;
  for (int i = 0; i < n_inputs; i++) any = any || (inputs[i] && inputs[i]->requires_grad);
  if (!any) return NULL;
  td_node *n = td__node_new(size, ops, 1, n_inputs);
  if (!n) {
    *st = td_set_error(TD_ERR_NOMEM, "autograd: out of memory recording %s", ops->name);
    return NULL;
  }
  for (int i = 0; i < n_inputs; i++) {
    td_status s = td__node_set_next(n, i, inputs[i]);
    if (s != TD_OK) {
      td_node_unref(n);
      *st = s;
      return NULL;
    }
  }
  td__tensor_set_history(out, n, 0);
  td_node_unref(n);
  return n;
}

/* ---- per-tensor autograd state ---- */

bool td_tensor_requires_grad(const td_tensor *t) { return t && t->requires_grad; }
bool td_tensor_is_leaf(const td_tensor *t) { return t && t->grad_fn == NULL; }
td_node *td_tensor_grad_fn(const td_tensor *t) { return t ? t->grad_fn : NULL; }
int td_tensor_output_nr(const td_tensor *t) { return t ? t->output_nr : 0; }

td_status td_tensor_set_requires_grad(td_tensor *t, bool requires_grad) {
  TD_CHECK_ARG(t, "tensor_set_requires_grad: NULL tensor");
  if (t->grad_fn)
    return td_set_error(TD_ERR_STATE,
                        "tensor_set_requires_grad: only leaf tensors can change requires_grad "
                        "(this one comes from %s)", td_node_name(t->grad_fn));
  if (requires_grad && !td_dtype_is_float(t->dtype))
    return td_set_error(TD_ERR_DTYPE, "tensor_set_requires_grad: %s tensors cannot require grad "
                        "(float dtypes only)", td_dtype_name(t->dtype));
  t->requires_grad = requires_grad;
  return TD_OK;
}

td_tensor *td_tensor_grad(const td_tensor *t) {
  if (!t) return NULL;
  td_tensor *mt = (td_tensor *)t;
  pthread_mutex_lock(&mt->grad_mu);
  td_tensor *g = td_tensor_ref(mt->grad);
  pthread_mutex_unlock(&mt->grad_mu);
  return g;
}

td_status td_tensor_set_grad(td_tensor *t, td_tensor *grad) {
  TD_CHECK_ARG(t, "tensor_set_grad: NULL tensor");
  if (grad && !td_tensor_same_shape(t, grad)) {
    char a[128], b[128];
    return td_set_error(TD_ERR_SHAPE, "tensor_set_grad: gradient shape %s does not match %s",
                        td_tensor_shape_str(grad, a, sizeof a), td_tensor_shape_str(t, b, sizeof b));
  }
  td_tensor_ref(grad);
  pthread_mutex_lock(&t->grad_mu);
  td_tensor *old = t->grad;
  t->grad = grad;
  pthread_mutex_unlock(&t->grad_mu);
  td_tensor_unref(old);
  return TD_OK;
}

/* Returns g itself when nobody else can see it (so accumulation may keep and modify it), else a
 * contiguous copy. */
static td_status own_grad(td_tensor *g, td_tensor **out) {
  if (td__ref_get(&g->rc) == 1 && td__ref_get(&g->storage->rc) == 1 && !g->grad_fn &&
      td_tensor_is_contiguous(g)) {
    *out = td_tensor_ref(g);
    return TD_OK;
  }
  return td_tensor_clone(g, out);
}

/* ---- gradient maps ---- */

struct td_grad_map {
  pthread_mutex_t mu;
  ptab tab; /* key: td_tensor* (ref held), val: td_tensor* gradient (ref held) */
};

td_status td_grad_map_create(td_grad_map **out) {
  TD_CHECK_ARG(out, "grad_map_create: NULL out");
  td_grad_map *m = td__calloc(1, sizeof *m);
  if (!m) return td_set_error(TD_ERR_NOMEM, "grad_map_create: out of memory");
  pthread_mutex_init(&m->mu, NULL);
  *out = m;
  return TD_OK;
}

void td_grad_map_clear(td_grad_map *m) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  for (size_t i = 0; i < m->tab.cap; i++) {
    if (!m->tab.slots[i].key) continue;
    td_tensor_unref((td_tensor *)m->tab.slots[i].key);
    td_tensor_unref(m->tab.slots[i].val);
  }
  ptab_free(&m->tab);
  pthread_mutex_unlock(&m->mu);
}

void td_grad_map_destroy(td_grad_map *m) {
  if (!m) return;
  td_grad_map_clear(m);
  pthread_mutex_destroy(&m->mu);
  td__free(m);
}

/* Adds g into the entry for t. adopt: g may be kept as the entry itself when nobody else holds
 * it (the engine's own gradients); otherwise a new entry gets a copy. */
static td_status grad_map_add(td_grad_map *m, td_tensor *t, td_tensor *g, bool adopt) {
  td_status st = TD_OK;
  pthread_mutex_lock(&m->mu);
  bool inserted;
  ptab_slot *s = ptab_insert(&m->tab, t, &inserted);
  if (!s) {
    st = td_set_error(TD_ERR_NOMEM, "grad_map: out of memory");
  } else if (inserted) {
    td_tensor *owned = NULL;
    st = adopt ? own_grad(g, &owned) : td_tensor_clone(g, &owned);
    if (st != TD_OK) {
      /* Remove the half-made entry: rebuild without it. */
      s->key = NULL;
      m->tab.len--;
      ptab old = m->tab;
      m->tab = (ptab){0};
      for (size_t i = 0; i < old.cap; i++) {
        if (!old.slots[i].key) continue;
        bool ins;
        ptab_insert(&m->tab, old.slots[i].key, &ins)->val = old.slots[i].val;
      }
      ptab_free(&old);
    } else {
      td_tensor_ref(t);
      s->val = owned;
    }
  } else {
    st = td_tensor_add_((td_tensor *)s->val, g, 1.0);
  }
  pthread_mutex_unlock(&m->mu);
  return st;
}

td_status td_grad_map_accumulate(td_grad_map *m, td_tensor *t, const td_tensor *grad) {
  TD_CHECK_ARG(m && t && grad, "grad_map_accumulate: NULL argument");
  if (!td_tensor_same_shape(t, grad)) {
    char a[128], b[128];
    return td_set_error(TD_ERR_SHAPE, "grad_map_accumulate: gradient %s for tensor %s",
                        td_tensor_shape_str(grad, a, sizeof a), td_tensor_shape_str(t, b, sizeof b));
  }
  bool prev = td_autograd_set_enabled(false);
  td_status st = grad_map_add(m, t, (td_tensor *)grad, false);
  td_autograd_set_enabled(prev);
  return st;
}

td_tensor *td_grad_map_get(td_grad_map *m, const td_tensor *t) {
  if (!m || !t) return NULL;
  pthread_mutex_lock(&m->mu);
  ptab_slot *s = ptab_find(&m->tab, t);
  td_tensor *g = s ? td_tensor_ref(s->val) : NULL;
  pthread_mutex_unlock(&m->mu);
  return g;
}

size_t td_grad_map_size(td_grad_map *m) {
  if (!m) return 0;
  pthread_mutex_lock(&m->mu);
  size_t n = m->tab.len;
  pthread_mutex_unlock(&m->mu);
  return n;
}

td_status td_grad_map_foreach(td_grad_map *m, td_grad_map_fn fn, void *ctx) {
  TD_CHECK_ARG(m && fn, "grad_map_foreach: NULL argument");
  td_status st = TD_OK;
  pthread_mutex_lock(&m->mu);
  for (size_t i = 0; i < m->tab.cap && st == TD_OK; i++)
    if (m->tab.slots[i].key) st = fn(ctx, (td_tensor *)m->tab.slots[i].key, m->tab.slots[i].val);
  pthread_mutex_unlock(&m->mu);
  return st;
}

/* ---- hooks ---- */

td_status td_tensor_register_hook(td_tensor *t, td_grad_hook_fn fn, void *ctx, int *handle) {
  TD_CHECK_ARG(t && fn, "tensor_register_hook: NULL argument");
  if (!t->requires_grad)
    return td_set_error(TD_ERR_STATE, "tensor_register_hook: tensor does not require grad");
  td__hook *h = td__calloc(1, sizeof *h);
  if (!h) return td_set_error(TD_ERR_NOMEM, "tensor_register_hook: out of memory");
  h->fn = fn;
  h->ctx = ctx;
  h->handle = __atomic_add_fetch(&next_hook_handle, 1, __ATOMIC_RELAXED);
  h->output_nr = t->output_nr;
  pthread_mutex_t *mu = t->grad_fn ? &t->grad_fn->mu : &t->grad_mu;
  td__hook **list = t->grad_fn ? &t->grad_fn->hooks : &t->hooks;
  pthread_mutex_lock(mu);
  td__hook **p = list;
  while (*p) p = &(*p)->next;
  *p = h;
  pthread_mutex_unlock(mu);
  if (handle) *handle = h->handle;
  return TD_OK;
}

td_status td_tensor_remove_hook(td_tensor *t, int handle) {
  TD_CHECK_ARG(t, "tensor_remove_hook: NULL tensor");
  pthread_mutex_t *mu = t->grad_fn ? &t->grad_fn->mu : &t->grad_mu;
  td__hook **list = t->grad_fn ? &t->grad_fn->hooks : &t->hooks;
  pthread_mutex_lock(mu);
  for (td__hook **p = list; *p; p = &(*p)->next) {
    if ((*p)->handle == handle) {
      td__hook *h = *p;
      *p = h->next;
      pthread_mutex_unlock(mu);
      td__free(h);
      return TD_OK;
    }
  }
  pthread_mutex_unlock(mu);
  return td_set_error(TD_ERR_NOT_FOUND, "tensor_remove_hook: no hook with handle %d", handle);
}

/* Runs the hooks of list (matching output_nr unless -1) on *g, replacing it as they ask. */
static td_status run_hooks(pthread_mutex_t *mu, td__hook *const *list, int output_nr,
                           td_tensor **g) {
  enum { MAXH = 32 };
  td__hook snap[MAXH];
  int n = 0;
  pthread_mutex_lock(mu);
  for (td__hook *h = *list; h && n < MAXH; h = h->next)
    if (output_nr < 0 || h->output_nr == output_nr) snap[n++] = *h;
  pthread_mutex_unlock(mu);
  for (int i = 0; i < n; i++) {
    td_tensor *rep = NULL;
    td_status st = snap[i].fn(snap[i].ctx, *g, &rep);
    if (st != TD_OK) {
      td_tensor_unref(rep);
      return st;
    }
    if (rep) {
      if (!td_tensor_same_shape(rep, *g)) {
        td_tensor_unref(rep);
        return td_set_error(TD_ERR_SHAPE, "autograd: a hook returned a gradient of another shape");
      }
      td_tensor_unref(*g);
      *g = rep;
    }
  }
  return TD_OK;
}

/* ---- external nodes ---- */

typedef struct {
  td_node base;
  td_external_backward_fn fn;
  void *ctx;
  void (*destroy_ctx)(void *ctx);
} external_node;

static td_status external_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  external_node *n = (external_node *)self;
  return n->fn(n->ctx, gout, self->n_outputs, gin, self->n_inputs);
}

/* Frees the context and the node's own vtable; td_node_unref touches no vtable entry after
 * calling destroy. */
static void external_destroy(td_node *self) {
  external_node *n = (external_node *)self;
  if (n->destroy_ctx) n->destroy_ctx(n->ctx);
  td__node_ops *ops = (td__node_ops *)self->ops;
  td__free((char *)ops->name);
  td__free(ops);
}

td_status td_node_create_external(const char *name, int n_outputs, td_tensor *const *inputs,
                                  int n_inputs, td_external_backward_fn fn, void *ctx,
                                  void (*destroy)(void *ctx), td_node **out) {
  td_status st;
  if (!out || !fn || n_outputs < 0 || n_inputs < 0 || (n_inputs > 0 && !inputs)) {
    st = td_set_error(TD_ERR_INVALID, "node_create_external: invalid argument");
    goto fail;
  }
  td__node_ops *ops = td__calloc(1, sizeof *ops);
  if (!ops) {
    st = td_set_error(TD_ERR_NOMEM, "node_create_external: out of memory");
    goto fail;
  }
  /* The vtable is per node so the node can carry its own name; it is freed with the node. */
  external_node *n = NULL;
  char *nm = td__strdup(name ? name : "ExternalBackward");
  if (nm) n = (external_node *)td__node_new(sizeof(external_node), ops, n_outputs, n_inputs);
  if (!n) {
    td__free(nm);
    td__free(ops);
    st = td_set_error(TD_ERR_NOMEM, "node_create_external: out of memory");
    goto fail;
  }
  ops->name = nm;
  ops->backward = external_backward;
  ops->destroy = external_destroy;
  n->fn = fn;
  n->ctx = ctx;
  n->destroy_ctx = destroy;
  for (int i = 0; i < n_inputs; i++) {
    st = td__node_set_next(&n->base, i, inputs[i]);
    if (st != TD_OK) {
      td_node_unref(&n->base);
      return st;
    }
  }
  *out = &n->base;
  return TD_OK;
fail:
  if (destroy) destroy(ctx);
  return st;
}

td_status td_autograd_attach(const td_tensor *t, td_node *node, int output_nr, td_tensor **out) {
  TD_CHECK_ARG(t && node && out, "autograd_attach: NULL argument");
  TD_CHECK_ARG(output_nr >= 0 && output_nr < node->n_outputs,
               "autograd_attach: output %d out of range (node has %d)", output_nr,
               node->n_outputs);
  if (t->requires_grad)
    return td_set_error(TD_ERR_STATE, "autograd_attach: tensor already requires grad");
  if (!td_dtype_is_float(t->dtype))
    return td_set_error(TD_ERR_DTYPE, "autograd_attach: %s tensors cannot carry gradients",
                        td_dtype_name(t->dtype));
  td_tensor *v;
  TD_TRY(td__tensor_view(t, t->shape, t->strides, t->ndim, t->offset, &v));
  td__tensor_set_history(v, node, output_nr);
  *out = v;
  return TD_OK;
}

/* ---- the engine ---- */

typedef struct {
  td_node *node;
  int deps;
  td_tensor **buf; /* n_outputs slots */
} entry;

typedef struct {
  ptab nodes; /* td_node* -> entry* */
  entry **heap;
  size_t heap_len, heap_cap;
  const td_backward_opts *opts;
} pass;

static entry *pass_entry(pass *p, td_node *n, bool *created) {
  ptab_slot *s = ptab_insert(&p->nodes, n, created);
  if (!s) return NULL;
  if (*created) {
    entry *e = td__calloc(1, sizeof *e);
    td_tensor **buf = td__calloc((size_t)(n->n_outputs ? n->n_outputs : 1), sizeof *buf);
    if (!e || !buf) {
      td__free(e);
      td__free(buf);
      /* Leave a tombstone-free table: the caller fails the pass, which frees everything. */
      s->val = NULL;
      return NULL;
    }
    e->node = n;
    e->buf = buf;
    s->val = e;
  }
  return s->val;
}

static void pass_free(pass *p) {
  for (size_t i = 0; i < p->nodes.cap; i++) {
    entry *e = p->nodes.slots[i].val;
    if (!e) continue;
    for (int k = 0; k < e->node->n_outputs; k++) td_tensor_unref(e->buf[k]);
    td__free(e->buf);
    td__free(e);
  }
  ptab_free(&p->nodes);
  td__free(p->heap);
}

static bool heap_push(pass *p, entry *e) {
  if (p->heap_len == p->heap_cap) {
    size_t nc = p->heap_cap ? p->heap_cap * 2 : 64;
    entry **nh = td__realloc(p->heap, nc * sizeof *nh);
    if (!nh) return false;
    p->heap = nh;
    p->heap_cap = nc;
  }
  size_t i = p->heap_len++;
  p->heap[i] = e;
  while (i > 0) {
    size_t up = (i - 1) / 2;
    if (p->heap[up]->node->seq >= p->heap[i]->node->seq) break;
    entry *t = p->heap[up];
    p->heap[up] = p->heap[i];
    p->heap[i] = t;
    i = up;
  }
  return true;
}

static entry *heap_pop(pass *p) {
  if (!p->heap_len) return NULL;
  entry *top = p->heap[0];
  p->heap[0] = p->heap[--p->heap_len];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < p->heap_len && p->heap[l]->node->seq > p->heap[m]->node->seq) m = l;
    if (r < p->heap_len && p->heap[r]->node->seq > p->heap[m]->node->seq) m = r;
    if (m == i) break;
    entry *t = p->heap[m];
    p->heap[m] = p->heap[i];
    p->heap[i] = t;
    i = m;
  }
  return top;
}

/* Counts dependencies of every node reachable from the root. */
static td_status discover(pass *p, td_node *root) {
  bool created;
  entry *re = pass_entry(p, root, &created);
  if (!re) return td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
  if (!created) return TD_OK;
  size_t sp = 0, cap = 64;
  td_node **stack = td__malloc(cap * sizeof *stack);
  if (!stack) return td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
  stack[sp++] = root;
  td_status st = TD_OK;
  while (sp && st == TD_OK) {
    td_node *n = stack[--sp];
    for (int i = 0; i < n->n_inputs; i++) {
      td_node *c = n->next[i].node;
      if (!c) continue;
      entry *ce = pass_entry(p, c, &created);
      if (!ce) {
        st = td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
        break;
      }
      ce->deps++;
      if (!created) continue;
      if (sp == cap) {
        td_node **ns = td__realloc(stack, cap * 2 * sizeof *ns);
        if (!ns) {
          st = td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
          break;
        }
        stack = ns;
        cap *= 2;
      }
      stack[sp++] = c;
    }
  }
  td__free(stack);
  return st;
}

/* Adds g (borrowed) into slot k of e's buffer. */
static td_status buffer_add(entry *e, int k, td_tensor *g) {
  td__out_meta *m = &e->node->outs[k];
  if (m->valid && (m->ndim != g->ndim ||
                   memcmp(m->shape, g->shape, (size_t)g->ndim * sizeof(int64_t)) != 0)) {
    char a[128], b[128];
    return td_set_error(TD_ERR_SHAPE, "autograd: %s received a gradient of shape %s for an output "
                        "of shape %s", td_node_name(e->node), td_tensor_shape_str(g, a, sizeof a),
                        td__shape_str(m->shape, m->ndim, b, sizeof b));
  }
  if (!e->buf[k]) {
    e->buf[k] = td_tensor_ref(g);
    return TD_OK;
  }
  td_tensor *sum;
  TD_TRY(td_tensor_add(e->buf[k], g, &sum));
  td_tensor_unref(e->buf[k]);
  e->buf[k] = sum;
  return TD_OK;
}

/* Accumulates into leaf, consuming the caller's reference to g (so a gradient nobody else holds
 * can be adopted without a copy). */
static td_status accumulate_leaf(pass *p, td_tensor *leaf, td_tensor *g) {
  td_tensor *grad = g;
  td_status st = run_hooks(&leaf->grad_mu, &leaf->hooks, -1, &grad);
  if (st != TD_OK) goto out;
  if (p->opts && p->opts->grad_map) {
    st = grad_map_add(p->opts->grad_map, leaf, grad, true);
    goto out;
  }
  pthread_mutex_lock(&leaf->grad_mu);
  if (!leaf->grad) {
    td_tensor *owned;
    st = own_grad(grad, &owned);
    if (st == TD_OK) leaf->grad = owned;
  } else {
    st = td_tensor_add_(leaf->grad, grad, 1.0);
  }
  pthread_mutex_unlock(&leaf->grad_mu);
out:
  td_tensor_unref(grad);
  return st;
}

static td_status run_node(pass *p, entry *e) {
  td_node *n = e->node;
  td_status st = TD_OK;
  /* Missing gradients are zeros of the output's shape. */
  for (int k = 0; k < n->n_outputs; k++) {
    if (e->buf[k] || !n->outs[k].valid) continue;
    td__out_meta *m = &n->outs[k];
    TD_TRY(td_tensor_zeros(m->shape, m->ndim, m->dtype, m->device, &e->buf[k]));
  }
  if (n->hooks) {
    for (int k = 0; k < n->n_outputs; k++) {
      if (!e->buf[k]) continue;
      TD_TRY(run_hooks(&n->mu, &n->hooks, k, &e->buf[k]));
    }
  }
  if (n->leaf) {
    td_tensor *g = e->buf[0];
    e->buf[0] = NULL;
    return accumulate_leaf(p, n->leaf, g);
  }

  pthread_mutex_lock(&n->mu);
  bool released = n->released;
  pthread_mutex_unlock(&n->mu);
  if (released)
    return td_set_error(TD_ERR_STATE,
                        "autograd: trying to backward through %s a second time (its saved "
                        "tensors were freed; use retain_graph)", td_node_name(n));
  td_tensor *gin_small[8] = {0};
  td_tensor **gin = gin_small;
  if (n->n_inputs > 8) {
    gin = td__calloc((size_t)n->n_inputs, sizeof *gin);
    if (!gin) return td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
  }
  st = n->ops->backward(n, e->buf, gin);
  if (st != TD_OK) td__error_prefix(st, "autograd: %s failed", td_node_name(n));
  for (int k = 0; k < n->n_outputs; k++) {
    td_tensor_unref(e->buf[k]);
    e->buf[k] = NULL;
  }
  if (st == TD_OK && !(p->opts && p->opts->retain_graph)) {
    pthread_mutex_lock(&n->mu);
    n->released = true;
    pthread_mutex_unlock(&n->mu);
    if (n->ops->release_saved) n->ops->release_saved(n);
  }
  for (int i = 0; i < n->n_inputs; i++) {
    td__edge *edge = &n->next[i];
    if (st == TD_OK && edge->node) {
      ptab_slot *s = ptab_find(&p->nodes, edge->node);
      entry *ce = s ? s->val : NULL;
      TD_ASSERT(ce);
      if (gin[i]) st = buffer_add(ce, edge->input_nr, gin[i]);
      if (st == TD_OK && --ce->deps == 0 && !heap_push(p, ce))
        st = td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
    }
    td_tensor_unref(gin[i]);
  }
  if (gin != gin_small) td__free(gin);
  return st;
}

typedef struct {
  td_node *node; /* NULL: leaf root */
  int slot;
  td_tensor *leaf;
  td_tensor *grad; /* owned */
} root_spec;

static td_status run_pass(root_spec *roots, int n, const td_backward_opts *opts) {
  pass p = {0};
  p.opts = opts;
  td_status st = TD_OK;
  bool prev = td_autograd_set_enabled(false);
  const td_backward_opts *outer = pass_opts; /* a nested pass (a recompute) restores it */
  pass_opts = opts;
  bool prev_ac = td__autocast_suspend(); /* nodes compute in the dtypes their forward saw */
  for (int i = 0; i < n && st == TD_OK; i++)
    if (roots[i].node) st = discover(&p, roots[i].node);
  for (int i = 0; i < n && st == TD_OK; i++) {
    if (roots[i].node) {
      entry *e = ptab_find(&p.nodes, roots[i].node)->val;
      if (roots[i].grad) st = buffer_add(e, roots[i].slot, roots[i].grad);
    } else if (roots[i].grad) {
      st = accumulate_leaf(&p, roots[i].leaf, td_tensor_ref(roots[i].grad));
    }
  }
  for (int i = 0; i < n && st == TD_OK; i++) {
    if (!roots[i].node) continue;
    entry *e = ptab_find(&p.nodes, roots[i].node)->val;
    if (e->deps == 0) {
      e->deps = -1; /* queued once even when several roots share the node */
      if (!heap_push(&p, e)) st = td_set_error(TD_ERR_NOMEM, "autograd: out of memory");
    }
  }
  entry *e;
  while (st == TD_OK && (e = heap_pop(&p)) != NULL) st = run_node(&p, e);
  pass_free(&p);
  pass_opts = outer;
  td__autocast_resume(prev_ac);
  td_autograd_set_enabled(prev);
  return st;
}

td_status td_autograd_backward(td_tensor *const *roots, td_tensor *const *grad_roots, int n,
                               const td_backward_opts *opts) {
  TD_CHECK_ARG(roots && n > 0, "autograd_backward: no roots");
  root_spec small[8];
  root_spec *rs = n <= 8 ? small : td__calloc((size_t)n, sizeof *rs);
  if (!rs) return td_set_error(TD_ERR_NOMEM, "autograd_backward: out of memory");
  memset(rs, 0, (size_t)n * sizeof *rs);
  td_status st = TD_OK;
  for (int i = 0; i < n && st == TD_OK; i++) {
    td_tensor *r = roots[i];
    if (!r) {
      st = td_set_error(TD_ERR_INVALID, "autograd_backward: root %d is NULL", i);
      break;
    }
    if (!r->requires_grad) {
      st = td_set_error(TD_ERR_STATE, "autograd_backward: root %d does not require grad and has "
                        "no grad_fn", i);
      break;
    }
    td_tensor *g = grad_roots ? grad_roots[i] : NULL;
    if (g) {
      if (!td_tensor_same_shape(g, r)) {
        char a[128], b[128];
        st = td_set_error(TD_ERR_SHAPE, "autograd_backward: gradient %s for root %d of shape %s",
                          td_tensor_shape_str(g, a, sizeof a), i,
                          td_tensor_shape_str(r, b, sizeof b));
        break;
      }
      rs[i].grad = td_tensor_ref(g);
    } else {
      if (td_tensor_numel(r) != 1) {
        char a[128];
        st = td_set_error(TD_ERR_SHAPE, "autograd_backward: root %d of shape %s is not a scalar; "
                          "pass its gradient", i, td_tensor_shape_str(r, a, sizeof a));
        break;
      }
      st = td_tensor_ones(r->shape, r->ndim, r->dtype, r->storage->device, &rs[i].grad);
    }
    rs[i].node = r->grad_fn;
    rs[i].slot = r->output_nr;
    rs[i].leaf = r->grad_fn ? NULL : r;
  }
  if (st == TD_OK) st = run_pass(rs, n, opts);
  for (int i = 0; i < n; i++) td_tensor_unref(rs[i].grad);
  if (rs != small) td__free(rs);
  return st;
}

td_status td_tensor_backward(td_tensor *root) {
  TD_CHECK_ARG(root, "tensor_backward: NULL root");
  return td_autograd_backward(&root, NULL, 1, NULL);
}

td_status td_autograd_backward_node(td_node *node, td_tensor *const *grad_outputs, int n,
                                    const td_backward_opts *opts) {
  TD_CHECK_ARG(node, "autograd_backward_node: NULL node");
  if (n != node->n_outputs)
    return td_set_error(TD_ERR_INVALID, "autograd_backward_node: %d gradients for %s with %d "
                        "outputs", n, td_node_name(node), node->n_outputs);
  root_spec small[8];
  root_spec *rs = n <= 8 ? small : td__calloc((size_t)n, sizeof *rs);
  if (!rs) return td_set_error(TD_ERR_NOMEM, "autograd_backward_node: out of memory");
  for (int i = 0; i < n; i++) {
    rs[i] = (root_spec){node, i, NULL, grad_outputs ? td_tensor_ref(grad_outputs[i]) : NULL};
  }
  if (n == 0) {
    root_spec r = {node, 0, NULL, NULL};
    td_status st = run_pass(&r, 1, opts);
    return st;
  }
  td_status st = run_pass(rs, n, opts);
  for (int i = 0; i < n; i++) td_tensor_unref(rs[i].grad);
  if (rs != small) td__free(rs);
  return st;
}
