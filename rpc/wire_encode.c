/* wire_encode.c - encoding messages into frames (wire.h).
 *
 * The value trees are flattened into a pre-order node list (Envelope.nodes) with an explicit
 * stack, so encoding never recurses; tensors (made contiguous) become the payload, sent from
 * their storage by reference.
 *
 * Device maps: a CUDA tensor is encoded only when the context's map has an entry for its device;
 * it is copied to host memory (staging) and its node carries the target device.
 *
 * Per call it allocates only the frame's head (and the tensor list when there are tensors): the
 * nodes, the walk's stack and the node pointers of a small message live on the stack, and the
 * envelope is packed by wire_small.c's packer (protobuf-c's bytes, without its general path).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "tdist.pb-c.h"
#include "tdist/autograd.h"
#include "wire.h"
#include "wire_small.h"

bool td__devmap_lookup(const td__devmap *m, td_device from, td_device *to) {
  for (int i = 0; m && i < m->n; i++) {
    if (td_device_equal(m->e[i].from, from)) {
      *to = m->e[i].to;
      return true;
    }
  }
  return false;
}

#define ENC_INLINE_NODES 16 /* nodes of a message encoded without an allocation */

typedef struct {
  int kind; /* the message's (TD__MSG_*) */
  Tdist__Node *nodes; /* nodes_in, or allocated once there are more */
  size_t n, cap;
  td_tensor **tensors;
  int nt, tcap;
  uint64_t payload;
  td_value **temps; /* extension representations kept alive until packing is done */
  int ntemps, tmpcap;
  Tdist__Node nodes_in[ENC_INLINE_NODES];
} enc;

static Tdist__Node *enc_node(enc *e) {
  if (e->n == e->cap) {
    size_t nc = e->cap * 2;
    Tdist__Node *nn = td__malloc(nc * sizeof *nn);
    if (!nn) return NULL;
    memcpy(nn, e->nodes, e->n * sizeof *nn);
    if (e->nodes != e->nodes_in) td__free(e->nodes);
    e->nodes = nn;
    e->cap = nc;
  }
  Tdist__Node *node = &e->nodes[e->n++];
  tdist__node__init(node);
  return node;
}

/* Refuses a tensor on a device the map does not cover (the message names the device and the
 * peer, and which map applies). */
static td_status unmapped(const enc *e, const td__wire_ctx *ctx, td_device dev) {
  char dn[32], who[160];
  td_device_str(dev, dn, sizeof dn);
  if (ctx && ctx->peer_name) snprintf(who, sizeof who, "%s (rank %d)", ctx->peer_name,
                                      ctx->peer_rank);
  else snprintf(who, sizeof who, "rank %d", ctx ? ctx->peer_rank : -1);
  if (e->kind == TD__MSG_RESPONSE)
    return td_set_error(TD_ERR_DEVICE, "rpc: a tensor on %s cannot be sent back to %s: replies "
                        "follow the caller's device map in reverse, and no device of %s is mapped "
                        "to %s here (add an entry to its td_rpc_options.device_maps, or move the "
                        "tensor with td_tensor_to)", dn, who, who, dn);
  return td_set_error(TD_ERR_DEVICE, "rpc: a tensor on %s cannot be sent to %s: the device map to "
                      "it has no entry for %s (add one to td_rpc_options.device_maps, or move the "
                      "tensor with td_tensor_to)", dn, who, dn);
}

/* Adds t to the payload: contiguous, on the host (a CUDA tensor is copied there), and marks in
 * node where the receiver places it. */
static td_status enc_tensor(enc *e, const td__wire_ctx *ctx, td_tensor *t, Tdist__Node *node) {
  td_device dev = td_tensor_device(t), to = td_device_cpu();
  bool mapped = ctx && td__devmap_lookup(ctx->devmap, dev, &to);
  if (!mapped && dev.type != TD_DEVICE_CPU) return unmapped(e, ctx, dev);
  if (e->nt == e->tcap) {
    int nc = e->tcap ? e->tcap * 2 : 8;
    td_tensor **nt = td__realloc(e->tensors, (size_t)nc * sizeof *nt);
    if (!nt) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    e->tensors = nt;
    e->tcap = nc;
  }
  td_tensor *c;
  bool prev = td_autograd_set_enabled(false);
  /* td_tensor_to gives a contiguous host copy (staging: the bytes travel from host memory) */
  td_status st = dev.type == TD_DEVICE_CPU ? td_tensor_contiguous(t, &c)
                                           : td_tensor_to(t, td_device_cpu(), &c);
  td_autograd_set_enabled(prev);
  if (st != TD_OK) return st;
  e->tensors[e->nt++] = c;
  e->payload += td_tensor_nbytes(c);
  node->device = to.type == TD_DEVICE_CPU ? 0 : (uint32_t)to.index + 1;
  return TD_OK;
}

static td_status enc_keep(enc *e, td_value *v) {
  if (e->ntemps == e->tmpcap) {
    int nc = e->tmpcap ? e->tmpcap * 2 : 4;
    td_value **nt = td__realloc(e->temps, (size_t)nc * sizeof *nt);
    if (!nt) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    e->temps = nt;
    e->tmpcap = nc;
  }
  e->temps[e->ntemps++] = v;
  return TD_OK;
}

typedef struct {
  const td_value *v;
  const char *key;
} enc_item;

/* The explicit stack of enc_value (items pop in pre-order): items_in until it outgrows them. */
typedef struct {
  enc_item *items;
  size_t n, cap;
  enc_item items_in[16];
} enc_stack;

static td_status stack_room(enc_stack *s, size_t more) {
  if (s->n + more <= s->cap) return TD_OK;
  size_t nc = s->cap * 2;
  while (s->n + more > nc) nc *= 2;
  enc_item *ni = td__malloc(nc * sizeof *ni);
  if (!ni) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  memcpy(ni, s->items, s->n * sizeof *ni);
  if (s->items != s->items_in) td__free(s->items);
  s->items = ni;
  s->cap = nc;
  return TD_OK;
}

/* Leaf state: none, bool, int, double, string, bytes and tensor fill their node in place. */
static td_status enc_leaf(enc *e, td__wire_ctx *ctx, const td_value *v, td_value_kind k,
                          Tdist__Node *node) {
  switch (k) {
    case TD_VALUE_NONE: return TD_OK;
    case TD_VALUE_BOOL: {
      bool b = false;
      td_value_as_bool(v, &b);
      node->b = b;
      return TD_OK;
    }
    case TD_VALUE_INT: td_value_as_int(v, &node->i); return TD_OK;
    case TD_VALUE_DOUBLE:
      td_value_as_double(v, &node->d);
      /* proto3 omits a zero double, sign included: b marks -0.0 */
      node->b = node->d == 0 && signbit(node->d);
      return TD_OK;
    case TD_VALUE_STRING: {
      const char *s = NULL;
      size_t len = 0;
      td_value_as_string(v, &s, &len);
      /* protobuf strings stop at a NUL: a string holding one travels in the bytes field */
      if (memchr(s, '\0', len)) {
        node->by.data = (uint8_t *)s;
        node->by.len = len;
      } else {
        node->s = (char *)s;
      }
      return TD_OK;
    }
    case TD_VALUE_BYTES: {
      const void *d = NULL;
      size_t n = 0;
      td_value_as_bytes(v, &d, &n);
      node->by.data = (uint8_t *)d;
      node->by.len = n;
      return TD_OK;
    }
    case TD_VALUE_TENSOR: {
      td_tensor *t = NULL;
      td_value_as_tensor(v, &t);
      node->dtype = (int32_t)td_tensor_dtype(t);
      node->n_shape = (size_t)td_tensor_ndim(t);
      node->shape = (int64_t *)td_tensor_shape(t);
      return enc_tensor(e, ctx, t, node);
    }
    default: return td_set_error(TD_ERR_INTERNAL, "rpc: enc_leaf on a %s", td_value_kind_name(v));
  }
}

/* Extension state: the value becomes an EXT node whose only child is its plain representation
 * (to_wire), kept alive until packing is done and pushed to be walked next. */
static td_status enc_ext(enc *e, td__wire_ctx *ctx, const td_value *v, Tdist__Node *node,
                         enc_stack *s) {
  const td__value_ext_type *type = td__value_ext_type_of(v);
  if (!type || !type->to_wire)
    return td_set_error(TD_ERR_INVALID, "rpc: value of kind %s cannot be sent",
                        td_value_kind_name(v));
  td_value *repr = NULL;
  TD_TRY(type->to_wire(td__value_ext_obj(v), ctx, &repr));
  td_status st = enc_keep(e, repr);
  if (st != TD_OK) {
    td_value_unref(repr);
    return st;
  }
  node->kind = TD_VALUE_EXT;
  node->s = (char *)type->name;
  node->count = 1;
  TD_TRY(stack_room(s, 1));
  s->items[s->n++] = (enc_item){repr, NULL};
  return TD_OK;
}

/* Container state: a list or dict pushes its children in reverse, so they pop in order. */
static td_status enc_children(const td_value *v, td_value_kind k, size_t children, enc_stack *s) {
  TD_TRY(stack_room(s, children));
  for (size_t i = children; i-- > 0;) {
    if (k == TD_VALUE_LIST) {
      s->items[s->n++] = (enc_item){td_value_list_get(v, i), NULL};
    } else {
      const char *key = NULL;
      td_value *item = NULL;
      td_value_dict_entry(v, i, &key, &item);
      s->items[s->n++] = (enc_item){item, key};
    }
  }
  return TD_OK;
}

/* Appends the pre-order nodes of root. Each popped item is one node, handled by the state of its
 * kind: leaf (enc_leaf), container (enc_children) or extension (enc_ext). Node pointers move when
 * the node array grows: none is kept across items. */
static td_status enc_value(enc *e, const td_value *root, td__wire_ctx *ctx) {
  enc_stack s;
  s.items = s.items_in;
  s.n = 0;
  s.cap = sizeof s.items_in / sizeof s.items_in[0];
  td_status st = stack_room(&s, 1);
  if (st == TD_OK) s.items[s.n++] = (enc_item){root, NULL};
  while (st == TD_OK && s.n) {
    enc_item it = s.items[--s.n];
    Tdist__Node *node = enc_node(e);
    if (!node) {
      st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
      break;
    }
    if (it.key) node->key = (char *)it.key;
    td_value_kind k = td_value_kind_of(it.v);
    node->kind = (uint32_t)k;
    if (k == TD_VALUE_LIST || k == TD_VALUE_DICT) {
      size_t children = k == TD_VALUE_LIST ? td_value_list_len(it.v) : td_value_dict_len(it.v);
      node->count = (uint32_t)children;
      st = enc_children(it.v, k, children, &s);
    } else if (k <= TD_VALUE_TENSOR) {
      st = enc_leaf(e, ctx, it.v, k, node);
    } else {
      st = enc_ext(e, ctx, it.v, node, &s);
    }
  }
  if (s.items != s.items_in) td__free(s.items);
  return st;
}

td_status td__wire_encode(const td__msg *m, td__wire_ctx *ctx, td__frame *out) {
  enc e;
  memset(&e, 0, offsetof(enc, nodes_in)); /* the inline nodes are initialised as they are used */
  e.kind = m->kind;
  e.nodes = e.nodes_in;
  e.cap = ENC_INLINE_NODES;
  td_status st = TD_OK;
  for (int i = 0; i < m->nvalues && st == TD_OK; i++) {
    if (!m->values[i]) {
      st = td_set_error(TD_ERR_INVALID, "rpc: argument %d is NULL", i);
      break;
    }
    st = enc_value(&e, m->values[i], ctx);
  }
  if (st != TD_OK) goto out;
  Tdist__Envelope env = TDIST__ENVELOPE__INIT;
  env.kind = (uint32_t)m->kind;
  env.fn = m->fn ? m->fn : (char *)"";
  env.from_rank = m->from_rank;
  env.nargs = (uint32_t)m->nvalues;
  Tdist__Node *ptrs_in[ENC_INLINE_NODES];
  Tdist__Node **ptrs = e.n <= ENC_INLINE_NODES ? ptrs_in : td__malloc(e.n * sizeof *ptrs);
  if (!ptrs) {
    st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    goto out;
  }
  for (size_t i = 0; i < e.n; i++) ptrs[i] = &e.nodes[i];
  env.n_nodes = e.n;
  env.nodes = ptrs;
  env.status = (int32_t)m->status;
  env.message = m->message ? m->message : (char *)"";
  env.timeout_ms = m->timeout_ms;
  env.ctx_id = m->ctx_id;
  env.autograd_msg_id = m->autograd_msg_id;
  env.n_aux = m->naux > 0 ? (size_t)m->naux : 0;
  env.aux = m->aux;
  /* protobuf-c's bytes, without its general path: packed once into the stack when they fit */
  uint8_t small[TD__SMALL_HEADER];
  size_t hl = td__env_pack_into(&env, small, sizeof small);
  if (hl > TD__MAX_HEADER) {
    if (ptrs != ptrs_in) td__free(ptrs);
    st = td_set_error(TD_ERR_INVALID, "rpc: message envelope of %zu bytes exceeds %u bytes (send "
                      "large data as tensors)", hl, TD__MAX_HEADER);
    goto out;
  }
  uint8_t *head = td__malloc(TD__FRAME_PREFIX + hl);
  if (!head) {
    if (ptrs != ptrs_in) td__free(ptrs);
    st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    goto out;
  }
  td__put_u32(head, TD__FRAME_MAGIC);
  td__put_u32(head + 4, (uint32_t)hl);
  td__put_u64(head + 8, e.payload);
  td__put_u64(head + 16, m->id);
  if (hl <= sizeof small) memcpy(head + TD__FRAME_PREFIX, small, hl);
  else td__env_pack(&env, head + TD__FRAME_PREFIX);
  if (ptrs != ptrs_in) td__free(ptrs);
  out->head = head;
  out->head_len = TD__FRAME_PREFIX + hl;
  out->tensors = e.tensors;
  out->ntensors = e.nt;
  out->payload_len = e.payload;
  e.tensors = NULL;
  e.nt = 0;
out:
  for (int i = 0; i < e.nt; i++) td_tensor_unref(e.tensors[i]);
  td__free(e.tensors);
  for (int i = 0; i < e.ntemps; i++) td_value_unref(e.temps[i]);
  td__free(e.temps);
  if (e.nodes != e.nodes_in) td__free(e.nodes);
  return st;
}
