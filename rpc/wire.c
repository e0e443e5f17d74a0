/* wire.c - encode messages into frames; decode frames incrementally from a byte stream.
 *
 * Encoding flattens the value trees into a pre-order node list (Envelope.nodes) with an explicit
 * stack, collecting tensors (made contiguous) as the payload. Decoding is a state machine over
 * PREFIX -> HEADER -> PAYLOAD (or SKIP); the payload is copied chunk by chunk straight into the
 * storage of tensors allocated from the header's metadata, and the trees are rebuilt with an
 * explicit stack, so neither direction recurses on untrusted input.
 *
 * Device maps: a CUDA tensor is encoded only when the context's map has an entry for its device;
 * it is copied to host memory (staging) and its node carries the target device. The decoder
 * receives every tensor into host memory and moves a marked one to its CUDA device while it
 * rebuilds the trees; a device this process lacks makes the frame bad (TD_ERR_DEVICE), so a
 * request is answered with an error and a reply fails its call.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include "wire.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/uio.h>
#endif

#include "tdist.pb-c.h"
#include "tdist/autograd.h"

void td__msg_clear(td__msg *m) {
  if (!m) return;
  td__free(m->fn);
  td__free(m->message);
  for (int i = 0; i < m->nvalues; i++) td_value_unref(m->values[i]);
  td__free(m->values);
  td__free(m->aux);
  memset(m, 0, sizeof *m);
}

void td__frame_clear(td__frame *f) {
  if (!f) return;
  td__free(f->head);
  for (int i = 0; i < f->ntensors; i++) td_tensor_unref(f->tensors[i]);
  td__free(f->tensors);
  memset(f, 0, sizeof *f);
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* ---- encoding ---- */

bool td__devmap_lookup(const td__devmap *m, td_device from, td_device *to) {
  for (int i = 0; m && i < m->n; i++) {
    if (td_device_equal(m->e[i].from, from)) {
      *to = m->e[i].to;
      return true;
    }
  }
  return false;
}

typedef struct {
  int kind; /* the message's (TD__MSG_*) */
  Tdist__Node *nodes;
  size_t n, cap;
  td_tensor **tensors;
  int nt, tcap;
  uint64_t payload;
  td_value **temps; /* extension representations kept alive until packing is done */
  int ntemps, tmpcap;
} enc;

static Tdist__Node *enc_node(enc *e) {
  if (e->n == e->cap) {
    size_t nc = e->cap ? e->cap * 2 : 16;
    Tdist__Node *nn = td__realloc(e->nodes, nc * sizeof *nn);
    if (!nn) return NULL;
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

/* Appends the pre-order nodes of v. */
static td_status enc_value(enc *e, const td_value *root, td__wire_ctx *ctx) {
  size_t cap = 32, sp = 0;
  enc_item *stack = td__malloc(cap * sizeof *stack);
  if (!stack) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  stack[sp++] = (enc_item){root, NULL};
  td_status st = TD_OK;
  while (sp && st == TD_OK) {
    enc_item it = stack[--sp];
    const td_value *v = it.v;
    Tdist__Node *node = enc_node(e);
    if (!node) {
      st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
      break;
    }
    if (it.key) node->key = (char *)it.key;
    td_value_kind k = td_value_kind_of(v);
    node->kind = (uint32_t)k;
    size_t children = 0;
    switch (k) {
      case TD_VALUE_NONE: break;
      case TD_VALUE_BOOL: {
        bool b = false;
        td_value_as_bool(v, &b);
        node->b = b;
        break;
      }
      case TD_VALUE_INT: td_value_as_int(v, &node->i); break;
      case TD_VALUE_DOUBLE:
        td_value_as_double(v, &node->d);
        /* proto3 omits a zero double, sign included: b marks -0.0 */
        node->b = node->d == 0 && signbit(node->d);
        break;
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
        break;
      }
      case TD_VALUE_BYTES: {
        const void *d = NULL;
        size_t n = 0;
        td_value_as_bytes(v, &d, &n);
        node->by.data = (uint8_t *)d;
        node->by.len = n;
        break;
      }
      case TD_VALUE_TENSOR: {
        td_tensor *t = NULL;
        td_value_as_tensor(v, &t);
        node->dtype = (int32_t)td_tensor_dtype(t);
        node->n_shape = (size_t)td_tensor_ndim(t);
        node->shape = (int64_t *)td_tensor_shape(t);
        st = enc_tensor(e, ctx, t, node);
        break;
      }
      case TD_VALUE_LIST: children = td_value_list_len(v); break;
      case TD_VALUE_DICT: children = td_value_dict_len(v); break;
      default: {
        const td__value_ext_type *type = td__value_ext_type_of(v);
        if (!type || !type->to_wire) {
          st = td_set_error(TD_ERR_INVALID, "rpc: value of kind %s cannot be sent",
                            td_value_kind_name(v));
          break;
        }
        td_value *repr = NULL;
        st = type->to_wire(td__value_ext_obj(v), ctx, &repr);
        if (st != TD_OK) break;
        if ((st = enc_keep(e, repr)) != TD_OK) {
          td_value_unref(repr);
          break;
        }
        node->kind = TD_VALUE_EXT;
        node->s = (char *)type->name;
        node->count = 1;
        /* node pointers move on realloc: do not keep `node` past here */
        if (sp + 1 > cap) {
          cap *= 2;
          enc_item *ns = td__realloc(stack, cap * sizeof *ns);
          if (!ns) {
            st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
            break;
          }
          stack = ns;
        }
        stack[sp++] = (enc_item){repr, NULL};
        continue;
      }
    }
    if (st != TD_OK) break;
    node->count = (uint32_t)children;
    if (!children) continue;
    if (sp + children > cap) {
      while (sp + children > cap) cap *= 2;
      enc_item *ns = td__realloc(stack, cap * sizeof *ns);
      if (!ns) {
        st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
        break;
      }
      stack = ns;
    }
    /* push children in reverse so they pop in order */
    for (size_t i = children; i-- > 0;) {
      if (k == TD_VALUE_LIST) {
        stack[sp++] = (enc_item){td_value_list_get(v, i), NULL};
      } else {
        const char *key = NULL;
        td_value *item = NULL;
        td_value_dict_entry(v, i, &key, &item);
        stack[sp++] = (enc_item){item, key};
      }
    }
  }
  td__free(stack);
  return st;
}

td_status td__wire_encode(const td__msg *m, td__wire_ctx *ctx, td__frame *out) {
  enc e = {0};
  e.kind = m->kind;
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
  Tdist__Node **ptrs = td__malloc((e.n ? e.n : 1) * sizeof *ptrs);
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
  size_t hl = tdist__envelope__get_packed_size(&env);
  if (hl > TD__MAX_HEADER) {
    td__free(ptrs);
    st = td_set_error(TD_ERR_INVALID, "rpc: message envelope of %zu bytes exceeds %u bytes (send "
                      "large data as tensors)", hl, TD__MAX_HEADER);
    goto out;
  }
  uint8_t *head = td__malloc(TD__FRAME_PREFIX + hl);
  if (!head) {
    td__free(ptrs);
    st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    goto out;
  }
  put_u32(head, TD__FRAME_MAGIC);
  put_u32(head + 4, (uint32_t)hl);
  put_u64(head + 8, e.payload);
  put_u64(head + 16, m->id);
  tdist__envelope__pack(&env, head + TD__FRAME_PREFIX);
  td__free(ptrs);
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
  td__free(e.nodes);
  return st;
}

td_status td__frame_make_direct(td__frame *f, uint64_t token, int pid, uint8_t **desc,
                                size_t *desc_len) {
  size_t dl = 16 + 16 * (size_t)f->ntensors;
  uint8_t *d = td__malloc(dl);
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  put_u64(d, token);
  put_u32(d + 8, (uint32_t)pid);
  put_u32(d + 12, 0);
  for (int i = 0; i < f->ntensors; i++) {
    put_u64(d + 16 + 16 * (size_t)i, (uint64_t)(uintptr_t)td_tensor_data(f->tensors[i]));
    put_u64(d + 24 + 16 * (size_t)i, (uint64_t)td_tensor_nbytes(f->tensors[i]));
  }
  put_u32(f->head, TD__FRAME_MAGIC_DIRECT);
  put_u64(f->head + 8, dl);
  *desc = d;
  *desc_len = dl;
  return TD_OK;
}

void td__ack_frame(uint8_t out[TD__FRAME_PREFIX], uint64_t token) {
  put_u32(out, TD__FRAME_MAGIC_ACK);
  put_u32(out + 4, 0);
  put_u64(out + 8, 0);
  put_u64(out + 16, token);
}

/* ---- decoding ---- */

enum { ST_PREFIX, ST_HEADER, ST_PAYLOAD, ST_SKIP, ST_DESC };

/* most tensors one direct-copy frame may describe (bounds the descriptor buffer to 16 MiB) */
#define MAX_DIRECT_TENSORS (1u << 20)

struct td__decoder {
  td__wire_ctx ctx;
  uint64_t max_msg;
  td__on_msg_fn on_msg;
  td__on_bad_fn on_bad;
  void *ud;
  int state;
  uint8_t prefix[TD__FRAME_PREFIX];
  size_t have; /* bytes of the current prefix/header gathered */
  uint32_t header_len;
  uint64_t payload_len, id;
  uint8_t *header;
  uint64_t skip_left;
  /* payload routing */
  Tdist__Envelope *env;
  td_tensor **tensors;
  int ntensors, cur;
  uint64_t cur_off; /* bytes written into tensors[cur] */
  /* direct-copy frames */
  td__direct_hooks hooks;
  bool has_hooks;
  bool direct;       /* the current frame is one */
  uint8_t *desc;     /* its descriptor, payload_len bytes */
  td_status reject_st; /* TD_OK, or why the frame is refused (reported once the token is read) */
  char reject[256];
};

td_status td__decoder_create(const td__wire_ctx *ctx, uint64_t max_message_bytes,
                             td__on_msg_fn on_msg, td__on_bad_fn on_bad, void *ud,
                             td__decoder **out) {
  td__decoder *d = td__calloc(1, sizeof *d);
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  d->ctx = *ctx;
  d->max_msg = max_message_bytes;
  d->on_msg = on_msg;
  d->on_bad = on_bad;
  d->ud = ud;
  *out = d;
  return TD_OK;
}

void td__decoder_set_direct(td__decoder *d, const td__direct_hooks *h) {
  d->has_hooks = h != NULL;
  if (h) d->hooks = *h;
}

static void reset_frame(td__decoder *d) {
  td__free(d->desc);
  d->desc = NULL;
  d->direct = false;
  d->reject_st = TD_OK;
  d->reject[0] = 0;
  td__free(d->header);
  d->header = NULL;
  if (d->env) tdist__envelope__free_unpacked(d->env, NULL);
  d->env = NULL;
  for (int i = 0; i < d->ntensors; i++) td_tensor_unref(d->tensors[i]);
  td__free(d->tensors);
  d->tensors = NULL;
  d->ntensors = d->cur = 0;
  d->cur_off = 0;
  d->have = 0;
  d->state = ST_PREFIX;
}

void td__decoder_destroy(td__decoder *d) {
  if (!d) return;
  reset_frame(d);
  td__free(d);
}

bool td__decoder_idle(const td__decoder *d) { return d->state == ST_PREFIX && d->have == 0; }

static td_status check_tensor_node(const Tdist__Node *n, size_t *nbytes) {
  if (n->dtype < 0 || n->dtype > TD_DTYPE_I64) return TD_ERR_FORMAT;
  if (n->device > TD__MAX_CUDA_INDEX + 1u) return TD_ERR_FORMAT;
  if (n->n_shape > TD_MAX_DIMS) return TD_ERR_FORMAT;
  uint64_t numel = 1;
  for (size_t i = 0; i < n->n_shape; i++) {
    if (n->shape[i] < 0 || (uint64_t)n->shape[i] > (1ull << 40)) return TD_ERR_FORMAT;
    if (n->shape[i] && numel > (UINT64_MAX / 16) / (uint64_t)n->shape[i]) return TD_ERR_FORMAT;
    numel *= (uint64_t)n->shape[i];
  }
  *nbytes = (size_t)(numel * td_dtype_size((td_dtype)n->dtype));
  return TD_OK;
}

/* Parses the header, allocates the payload tensors. Returns a message for a bad frame or NULL. */
static const char *parse_header(td__decoder *d) {
  d->env = tdist__envelope__unpack(NULL, d->header_len, d->header);
  td__free(d->header);
  d->header = NULL;
  if (!d->env) return "envelope is not a valid protobuf message";
  Tdist__Envelope *e = d->env;
  if (e->kind < TD__MSG_REQUEST || e->kind > TD__MSG_ERROR) return "unknown message kind";
  uint64_t total = 0;
  int nt = 0;
  for (size_t i = 0; i < e->n_nodes; i++) {
    if (e->nodes[i]->kind == TD_VALUE_TENSOR) nt++;
  }
  d->tensors = td__calloc((size_t)(nt ? nt : 1), sizeof *d->tensors);
  if (!d->tensors) return "out of memory";
  for (size_t i = 0; i < e->n_nodes; i++) {
    const Tdist__Node *n = e->nodes[i];
    if (n->kind != TD_VALUE_TENSOR) {
      if (n->device) return "a device is set on a value that is not a tensor";
      continue;
    }
    size_t nb;
    if (check_tensor_node(n, &nb) != TD_OK) return "invalid tensor metadata";
    if (d->direct) {
      /* the bytes are not in the stream: the limit applies to what they would have been */
      if (nb > UINT64_MAX - total) return "tensor sizes overflow";
      if (d->max_msg && (uint64_t)d->header_len + total + nb > d->max_msg) {
        snprintf(d->reject, sizeof d->reject, "message of more than %llu bytes exceeds the limit "
                 "of %llu bytes", (unsigned long long)(d->header_len + total + nb),
                 (unsigned long long)d->max_msg);
        d->reject_st = TD_ERR_INVALID;
        return d->reject;
      }
    } else if (nb > d->payload_len - total) {
      return "tensor sizes exceed the frame's payload";
    }
    total += nb;
    td_tensor *t;
    if (td_tensor_empty(n->shape, (int)n->n_shape, (td_dtype)n->dtype, td_device_cpu(), &t) !=
        TD_OK)
      return "cannot allocate a received tensor";
    d->tensors[d->ntensors++] = t;
  }
  if (d->direct) {
    if (d->payload_len != 16 + 16 * (uint64_t)d->ntensors)
      return "direct-copy descriptor does not match the tensors described";
    return NULL;
  }
  if (total != d->payload_len) return "payload length does not match the tensors described";
  return NULL;
}

/* Copies len bytes at addr in process pid into dst. */
static td_status read_remote(int pid, uint64_t addr, void *dst, uint64_t len) {
#if defined(__linux__)
  uint8_t *out = dst;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    struct iovec l = {out, chunk}, r = {(void *)(uintptr_t)addr, chunk};
    ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got <= 0)
      return td_set_error(TD_ERR_UNAVAILABLE, "cannot read %llu bytes from process %d: %s",
                          (unsigned long long)chunk, pid, got < 0 ? strerror(errno) : "no data");
    out += got;
    addr += (uint64_t)got;
    len -= (uint64_t)got;
  }
  return TD_OK;
#else
  (void)addr; (void)dst; (void)len;
  return td_set_error(TD_ERR_UNSUPPORTED, "direct copy from process %d: not on this system", pid);
#endif
}

/* The descriptor of a direct-copy frame is complete: copy the tensors out of the sender (unless
 * the frame is refused), acknowledge the token either way, then deliver or report the frame. */
static void finish_direct(td__decoder *d) {
  uint64_t token = get_u64(d->desc);
  int pid = (int)get_u32(d->desc + 8);
  if (d->reject_st == TD_OK) {
    if (!d->has_hooks || !d->hooks.allowed || !d->hooks.allowed(d->ud, pid)) {
      snprintf(d->reject, sizeof d->reject, "direct copy from process %d is not allowed", pid);
      d->reject_st = TD_ERR_FORMAT;
    }
  }
  for (int i = 0; d->reject_st == TD_OK && i < d->ntensors; i++) {
    uint64_t addr = get_u64(d->desc + 16 + 16 * (size_t)i);
    uint64_t len = get_u64(d->desc + 24 + 16 * (size_t)i);
    td_tensor *t = d->tensors[i];
    if (len != (uint64_t)td_tensor_nbytes(t)) {
      snprintf(d->reject, sizeof d->reject, "direct-copy descriptor: tensor %d has %llu bytes, "
               "not %zu", i, (unsigned long long)len, td_tensor_nbytes(t));
      d->reject_st = TD_ERR_FORMAT;
    } else if (len && read_remote(pid, addr, td_tensor_data(t), len) != TD_OK) {
      snprintf(d->reject, sizeof d->reject, "%s", td_last_error());
      d->reject_st = TD_ERR_UNAVAILABLE;
    }
  }
  if (d->has_hooks && d->hooks.send_ack) d->hooks.send_ack(d->ud, token);
  if (d->reject_st != TD_OK) {
    char why[256];
    snprintf(why, sizeof why, "%s", d->reject);
    td_status st = d->reject_st;
    uint64_t id = d->id;
    reset_frame(d);
    if (d->on_bad) d->on_bad(d->ud, id, st, why);
    return;
  }
  td__free(d->desc);
  d->desc = NULL;
  d->state = ST_PAYLOAD;
  d->cur = d->ntensors; /* complete: the feed loop delivers it */
}

typedef struct {
  td_value *v;      /* container being filled */
  uint32_t left;    /* children still expected */
  bool dict, ext;
  const char *ext_type;
  const char *key;  /* key of this container in its parent dict */
} dec_frame;

/* Attaches child to the top container, or to the roots when the stack is empty. */
static td_status attach(dec_frame *top, td_value *child, const char *key) {
  td_status st;
  if (top->dict) st = td_value_dict_set(top->v, key ? key : "", child);
  else st = td_value_list_append(top->v, child);
  if (st != TD_OK) td_value_unref(child);
  top->left--;
  return st;
}

/* Returns a value holding tensor number idx moved to cuda:(device-1) (the sender's device map
 * put it there), or NULL with *st set (TD_ERR_DEVICE when this process has no such device). */
static td_value *place_tensor(td_tensor *t, uint32_t device, int idx, td_status *st) {
  td_device dev = td_device_cuda((int)device - 1);
  char dn[32];
  td_device_str(dev, dn, sizeof dn);
  if (!td_device_available(dev)) {
    *st = td_set_error(TD_ERR_DEVICE, "tensor %d is to be placed on %s, which this process does "
                       "not have (%d CUDA devices)", idx, dn, td_cuda_device_count());
    return NULL;
  }
  td_tensor *moved = NULL;
  bool prev = td_autograd_set_enabled(false);
  td_status ms = td_tensor_to(t, dev, &moved);
  td_autograd_set_enabled(prev);
  if (ms != TD_OK) {
    char why[400];
    snprintf(why, sizeof why, "%s", td_last_error());
    *st = td_set_error(TD_ERR_DEVICE, "tensor %d cannot be placed on %s: %s", idx, dn, why);
    return NULL;
  }
  td_value *v = td_value_tensor(moved);
  td_tensor_unref(moved);
  if (!v) *st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  return v;
}

/* Rebuilds the nvalues trees from the node list. */
static td_status build_values(td__decoder *d, td__msg *m) {
  Tdist__Envelope *e = d->env;
  if (e->nargs > e->n_nodes) return td_set_error(TD_ERR_FORMAT, "more trees than nodes");
  m->values = td__calloc(e->nargs ? e->nargs : 1, sizeof *m->values);
  if (!m->values) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  dec_frame stack[TD__MAX_DEPTH + 1];
  int sp = 0, tcur = 0;
  size_t ni = 0;
  td_status st = TD_OK;
  /* A sentinel list collects the roots. */
  td_value *roots = td_value_list();
  if (!roots) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  stack[sp++] = (dec_frame){roots, e->nargs, false, false, NULL, NULL};
  while (st == TD_OK && sp > 0) {
    dec_frame *top = &stack[sp - 1];
    if (top->left == 0) {
      if (sp == 1) break;
      dec_frame done = *top;
      sp--;
      td_value *v = done.v;
      if (done.ext) {
        const td__value_ext_type *type = td__value_ext_find(done.ext_type);
        td_value *repr = td_value_list_get(v, 0);
        void *obj = NULL;
        if (!type || !type->from_wire) {
          td_value_unref(v);
          st = td_set_error(TD_ERR_FORMAT, "unknown value type '%s'", done.ext_type);
          break;
        }
        st = type->from_wire(repr, &d->ctx, &obj);
        td_value_unref(v);
        if (st != TD_OK) break;
        v = td__value_ext(type, obj);
        if (!v) {
          st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
          break;
        }
      }
      st = attach(&stack[sp - 1], v, done.key);
      continue;
    }
    if (ni >= e->n_nodes) {
      st = td_set_error(TD_ERR_FORMAT, "value tree truncated");
      break;
    }
    const Tdist__Node *n = e->nodes[ni++];
    const char *key = n->key;
    td_value *v = NULL;
    switch (n->kind) {
      case TD_VALUE_NONE: v = td_value_none(); break;
      case TD_VALUE_BOOL: v = td_value_bool(n->b); break;
      case TD_VALUE_INT: v = td_value_int(n->i); break;
      case TD_VALUE_DOUBLE: v = td_value_double(n->d == 0 && n->b ? -0.0 : n->d); break;
      case TD_VALUE_STRING:
        if (n->by.len) v = td_value_string_n((const char *)n->by.data, n->by.len);
        else v = td_value_string(n->s ? n->s : "");
        break;
      case TD_VALUE_BYTES: v = td_value_bytes(n->by.data, n->by.len); break;
      case TD_VALUE_TENSOR:
        if (tcur >= d->ntensors) {
          st = td_set_error(TD_ERR_FORMAT, "tensor count mismatch");
          break;
        }
        v = n->device ? place_tensor(d->tensors[tcur], n->device, tcur, &st)
                      : td_value_tensor(d->tensors[tcur]);
        tcur++;
        break;
      case TD_VALUE_LIST:
      case TD_VALUE_DICT:
      case TD_VALUE_EXT:
        if (sp > TD__MAX_DEPTH) {
          st = td_set_error(TD_ERR_FORMAT, "value nested deeper than %d", TD__MAX_DEPTH);
          break;
        }
        if (n->kind == TD_VALUE_EXT && n->count != 1) {
          st = td_set_error(TD_ERR_FORMAT, "extension value without exactly one child");
          break;
        }
        v = n->kind == TD_VALUE_DICT ? td_value_dict() : td_value_list();
        if (!v) break;
        if (n->count > e->n_nodes - ni) {
          td_value_unref(v);
          st = td_set_error(TD_ERR_FORMAT, "container claims more children than nodes left");
          break;
        }
        stack[sp++] = (dec_frame){v, n->count, n->kind == TD_VALUE_DICT, n->kind == TD_VALUE_EXT,
                                  n->s, key};
        continue;
      default:
        st = td_set_error(TD_ERR_FORMAT, "unknown value kind %u", n->kind);
        break;
    }
    if (st != TD_OK) break;
    if (!v) {
      st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
      break;
    }
    st = attach(top, v, key);
  }
  if (st == TD_OK && (ni != e->n_nodes || tcur != d->ntensors))
    st = td_set_error(TD_ERR_FORMAT, "trailing nodes or tensors after the value trees");
  while (sp > 1) td_value_unref(stack[--sp].v);
  if (st == TD_OK) {
    for (uint32_t i = 0; i < e->nargs; i++) m->values[i] = td_value_ref(td_value_list_get(roots, i));
    m->nvalues = (int)e->nargs;
  }
  td_value_unref(roots);
  return st;
}

static void deliver(td__decoder *d) {
  Tdist__Envelope *e = d->env;
  td__msg m = {0};
  m.id = d->id;
  m.kind = (int)e->kind;
  m.from_rank = e->from_rank;
  m.status = (td_status)e->status;
  m.timeout_ms = e->timeout_ms;
  m.ctx_id = e->ctx_id;
  m.autograd_msg_id = e->autograd_msg_id;
  td_status st = build_values(d, &m);
  if (st == TD_OK && e->n_aux) {
    if (e->n_aux > (size_t)INT32_MAX) {
      st = td_set_error(TD_ERR_FORMAT, "too many aux ids (%zu)", e->n_aux);
    } else if (!(m.aux = td__malloc(e->n_aux * sizeof *m.aux))) {
      st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
    } else {
      memcpy(m.aux, e->aux, e->n_aux * sizeof *m.aux);
      m.naux = (int)e->n_aux;
    }
  }
  if (st == TD_OK) {
    m.fn = td__strdup(e->fn ? e->fn : "");
    m.message = td__strdup(e->message ? e->message : "");
    if (!m.fn || !m.message) st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  }
  if (st != TD_OK) {
    char why[512];
    snprintf(why, sizeof why, "%s", td_last_error());
    td__msg_clear(&m);
    uint64_t id = d->id;
    reset_frame(d);
    if (d->on_bad)
      d->on_bad(d->ud, id, st == TD_ERR_NOMEM || st == TD_ERR_DEVICE ? st : TD_ERR_FORMAT, why);
    return;
  }
  reset_frame(d);
  d->on_msg(d->ud, &m);
}

/* Advances past tensors that are already complete (including empty ones). */
static void settle_payload(td__decoder *d) {
  while (d->cur < d->ntensors && d->cur_off == td_tensor_nbytes(d->tensors[d->cur])) {
    d->cur++;
    d->cur_off = 0;
  }
}

td_status td__decoder_feed(td__decoder *d, const uint8_t *p, size_t n) {
  /* Besides consuming bytes, finish what needs none: an empty header, a complete payload. */
  while (n > 0 || (d->state == ST_HEADER && d->have == d->header_len) ||
         (d->state == ST_PAYLOAD && d->cur >= d->ntensors)) {
    switch (d->state) {
      case ST_PREFIX: {
        size_t take = TD__FRAME_PREFIX - d->have;
        if (take > n) take = n;
        memcpy(d->prefix + d->have, p, take);
        d->have += take;
        p += take;
        n -= take;
        if (d->have < TD__FRAME_PREFIX) break;
        uint32_t magic = get_u32(d->prefix);
        d->header_len = get_u32(d->prefix + 4);
        d->payload_len = get_u64(d->prefix + 8);
        d->id = get_u64(d->prefix + 16);
        d->have = 0;
        if (magic == TD__FRAME_MAGIC_ACK) {
          if (d->header_len || d->payload_len)
            return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (ack frame with a body)");
          if (d->has_hooks && d->hooks.acked) d->hooks.acked(d->ud, d->id);
          break;
        }
        if (magic != TD__FRAME_MAGIC && magic != TD__FRAME_MAGIC_DIRECT)
          return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (bad frame magic 0x%08x)",
                              magic);
        d->direct = magic == TD__FRAME_MAGIC_DIRECT;
        if (d->direct && (d->header_len > TD__MAX_HEADER || d->payload_len < 16 ||
                          (d->payload_len - 16) % 16 ||
                          (d->payload_len - 16) / 16 > MAX_DIRECT_TENSORS))
          /* without a readable token the sender could not be answered: the stream is unusable */
          return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (bad direct-copy frame)");
        /* saturated: a payload_len near 2^64 must not wrap past max_msg */
        uint64_t total = d->payload_len > UINT64_MAX - d->header_len
                             ? UINT64_MAX
                             : (uint64_t)d->header_len + d->payload_len;
        if (d->header_len > TD__MAX_HEADER) {
          uint64_t id = d->id;
          reset_frame(d);
          d->skip_left = total;
          d->state = ST_SKIP;
          if (d->on_bad) d->on_bad(d->ud, id, TD_ERR_INVALID, "message envelope too large");
          break;
        }
        if (d->max_msg && total > d->max_msg) {
          uint64_t id = d->id;
          char why[160];
          snprintf(why, sizeof why, "message of %llu bytes exceeds the limit of %llu bytes",
                   (unsigned long long)total, (unsigned long long)d->max_msg);
          reset_frame(d);
          d->skip_left = total;
          d->state = total ? ST_SKIP : ST_PREFIX;
          if (d->on_bad) d->on_bad(d->ud, id, TD_ERR_INVALID, why);
          break;
        }
        d->header = td__malloc(d->header_len ? d->header_len : 1);
        if (!d->header) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
        d->state = ST_HEADER;
        break;
      }
      case ST_HEADER: {
        size_t take = d->header_len - d->have;
        if (take > n) take = n;
        memcpy(d->header + d->have, p, take);
        d->have += take;
        p += take;
        n -= take;
        if (d->have < d->header_len) break;
        const char *why = parse_header(d);
        d->state = ST_PAYLOAD;
        d->cur = 0;
        d->cur_off = 0;
        if (d->direct) {
          /* read the descriptor in every case: its token must be acknowledged */
          if (why && d->reject_st == TD_OK) {
            snprintf(d->reject, sizeof d->reject, "%s", why);
            d->reject_st = TD_ERR_FORMAT;
          }
          d->desc = td__malloc((size_t)d->payload_len);
          if (!d->desc) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
          d->have = 0;
          d->state = ST_DESC;
          break;
        }
        if (why) {
          uint64_t id = d->id, pl = d->payload_len;
          reset_frame(d);
          d->skip_left = pl;
          d->state = pl ? ST_SKIP : ST_PREFIX;
          if (d->on_bad) d->on_bad(d->ud, id, TD_ERR_FORMAT, why);
          break;
        }
        settle_payload(d);
        break;
      }
      case ST_PAYLOAD: {
        if (d->cur >= d->ntensors) {
          deliver(d);
          break;
        }
        td_tensor *t = d->tensors[d->cur];
        size_t need = td_tensor_nbytes(t) - (size_t)d->cur_off;
        size_t take = need < n ? need : n;
        memcpy((uint8_t *)td_tensor_data(t) + d->cur_off, p, take);
        d->cur_off += take;
        p += take;
        n -= take;
        settle_payload(d);
        break;
      }
      case ST_DESC: {
        size_t take = (size_t)d->payload_len - d->have;
        if (take > n) take = n;
        memcpy(d->desc + d->have, p, take);
        d->have += take;
        p += take;
        n -= take;
        if (d->have == d->payload_len) finish_direct(d);
        break;
      }
      case ST_SKIP: {
        uint64_t take = d->skip_left < n ? d->skip_left : n;
        d->skip_left -= take;
        p += take;
        n -= (size_t)take;
        if (!d->skip_left) d->state = ST_PREFIX;
        break;
      }
    }
  }
  return TD_OK;
}
