/* wire_decode.c - the incremental frame decoder (wire.h).
 *
 * A byte-stream state machine (PREFIX -> HEADER -> PAYLOAD, or DESC for a direct-copy frame, or
 * SKIP for a refused one; see "the feed" below) that accepts any chunking. The payload is copied
 * chunk by chunk straight into the storage of tensors allocated from the header's metadata, and
 * the trees are rebuilt with an explicit stack, so decoding never recurses on untrusted input.
 *
 * Device maps: every tensor is received into host memory; one whose node names a CUDA device is
 * moved there while the trees are rebuilt; a device this process lacks makes the frame bad
 * (TD_ERR_DEVICE), so a request is answered with an error and a reply fails its call.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "direct.h"
#include "tdist.pb-c.h"
#include "tdist/autograd.h"
#include "wire.h"
#include "wire_small.h"

enum { ST_PREFIX, ST_HEADER, ST_PAYLOAD, ST_SKIP, ST_DESC, ST_WAIT, ST_CTRL };
#define CTRL_MAX 128 /* longest lane control body (rpc/lane.h) */
/* What a paused decoder waits to do on another thread: a direct copy's read, or the placement of
 * tensors on the CUDA devices their nodes name (a host-to-device copy queued behind whatever
 * the device is busy with). */
enum { WAIT_DIRECT_READ = 1, WAIT_PLACE = 2 };
#define INLINE_TENSORS 4 /* tensors of a frame tracked without an allocation */

/* A frame's storage while it is small (a header of at most TD__SMALL_HEADER bytes): the header's
 * bytes and the envelope parsed by the fast path (wire_small.h). A decoder holds one only from
 * its frame's header to the frame's end, then gives it to its thread's spare (one per thread)
 * for the next frame any decoder starts there: a frame allocates nothing for it, and the 3.6 KB
 * are not kept by every idle decoder (two per lane: at 512 workers on one host, 150k lanes,
 * they were 1.1 GB). */
typedef struct small_store {
  uint8_t header[TD__SMALL_HEADER];
  td__small_env env;
} small_store;

static __thread small_store *spare_small;
static __thread bool spare_keyed;
static pthread_key_t spare_key; /* its value: &spare_small, whose block is freed at thread exit */
static pthread_once_t spare_once = PTHREAD_ONCE_INIT;

static void spare_release(void *slot) {
  small_store **sp = slot;
  td__free(*sp);
  *sp = NULL;
}

static void spare_key_init(void) { (void)pthread_key_create(&spare_key, spare_release); }

static small_store *small_take(void) {
  small_store *s = spare_small;
  if (s) {
    spare_small = NULL;
    return s;
  }
  return td__malloc(sizeof *s);
}

static void small_give(small_store *s) {
  if (spare_small || (!spare_keyed && (pthread_once(&spare_once, spare_key_init) != 0 ||
                                       pthread_setspecific(spare_key, &spare_small) != 0))) {
    td__free(s);
    return;
  }
  spare_keyed = true;
  spare_small = s;
}

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
  small_store *small; /* from a small frame's header to its end (small_take), else NULL */
  /* payload routing */
  Tdist__Envelope *env; /* &small->env.env, or protobuf-c's */
  td_tensor **tensors;  /* allocated as their bytes begin to arrive (never from a header alone) */
  const Tdist__Node **tnode; /* each tensor's node in env (shape, dtype) */
  size_t *tbytes;            /* each tensor's size */
  int ntensors, cur;
  td_tensor *tensors_in[INLINE_TENSORS]; /* the arrays above when the frame has this few */
  const Tdist__Node *tnode_in[INLINE_TENSORS];
  size_t tbytes_in[INLINE_TENSORS];
  uint64_t payload_got; /* payload bytes consumed of the current frame */
  int wait_for;         /* ST_WAIT: what td__decoder_resume does (WAIT_*) */
  bool resuming;        /* inside td__decoder_resume: do the work here, do not pause again */
  uint64_t last_bytes;  /* the frame being delivered: its size and path (td__decoder_last_frame) */
  bool last_direct;
  uint64_t cur_off; /* bytes written into tensors[cur] */
  /* direct-copy frames */
  td__direct_hooks hooks;
  bool has_hooks;
  bool direct;       /* the current frame is one */
  uint8_t *desc;     /* its descriptor, payload_len bytes */
  td_status reject_st; /* TD_OK, or why the frame is refused (reported once the token is read) */
  char reject[256];
  uint8_t ctrl[CTRL_MAX]; /* a lane control frame's body */
  /* the peer's bytes of frames in progress (td__decoder_set_budget), and this frame's share */
  int64_t *held;
  uint64_t held_max, held_now;
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

static bool small_header(const td__decoder *d) {
  return d->small && d->header == d->small->header;
}

static void free_header(td__decoder *d) {
  if (!small_header(d)) td__free(d->header);
  d->header = NULL;
}

static void reset_frame(td__decoder *d) {
  if (d->held_now) __atomic_sub_fetch(d->held, (int64_t)d->held_now, __ATOMIC_RELAXED);
  d->held_now = 0;
  td__free(d->desc);
  d->desc = NULL;
  d->direct = false;
  d->reject_st = TD_OK;
  d->reject[0] = 0;
  free_header(d);
  if (d->env && !(d->small && d->env == &d->small->env.env))
    tdist__envelope__free_unpacked(d->env, NULL);
  d->env = NULL;
  if (d->small) {
    small_give(d->small);
    d->small = NULL;
  }
  for (int i = 0; i < d->ntensors; i++) td_tensor_unref(d->tensors[i]);
  if (d->tensors != d->tensors_in) {
    td__free(d->tensors);
    td__free(d->tnode);
    td__free(d->tbytes);
  } else {
    memset(d->tensors_in, 0, sizeof d->tensors_in);
  }
  d->tensors = NULL;
  d->tnode = NULL;
  d->tbytes = NULL;
  d->ntensors = d->cur = 0;
  d->payload_got = 0;
  d->cur_off = 0;
  d->have = 0;
  d->state = ST_PREFIX;
}

/* Drops the current frame, skips its remaining bytes (total, after the prefix) and reports it. */
static void skip_frame(td__decoder *d, uint64_t total, td_status st, const char *why) {
  uint64_t id = d->id;
  reset_frame(d);
  d->skip_left = total;
  d->state = total ? ST_SKIP : ST_PREFIX;
  if (d->on_bad) d->on_bad(d->ud, id, st, why);
}

void td__decoder_destroy(td__decoder *d) {
  if (!d) return;
  reset_frame(d);
  td__free(d->small);
  td__free(d);
}

void td__decoder_last_frame(const td__decoder *d, uint64_t *bytes, bool *direct) {
  *bytes = d->last_bytes;
  *direct = d->last_direct;
}

void td__decoder_set_peer(td__decoder *d, int rank) { d->ctx.peer_rank = rank; }

void td__decoder_set_budget(td__decoder *d, int64_t *held, uint64_t max) {
  d->held = held;
  d->held_max = max;
}

bool td__decoder_idle(const td__decoder *d) { return d->state == ST_PREFIX && d->have == 0; }

static td_status check_tensor_node(const Tdist__Node *n, size_t *nbytes) {
  if (n->dtype < 0 || n->dtype >= TD_DTYPE_COUNT) return TD_ERR_FORMAT;
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
  /* a small envelope through the fast path when it takes it, else protobuf-c */
  if (small_header(d) && td__small_env_parse(&d->small->env, d->header, d->header_len))
    d->env = &d->small->env.env;
  else
    d->env = tdist__envelope__unpack(NULL, d->header_len, d->header);
  free_header(d);
  if (!d->env) return "envelope is not a valid protobuf message";
  Tdist__Envelope *e = d->env;
  if (e->kind < TD__MSG_REQUEST || e->kind > TD__MSG_ERROR) return "unknown message kind";
  uint64_t total = 0;
  int nt = 0;
  for (size_t i = 0; i < e->n_nodes; i++) {
    if (e->nodes[i]->kind == TD_VALUE_TENSOR) nt++;
  }
  if (nt <= INLINE_TENSORS) {
    d->tensors = d->tensors_in;
    d->tnode = d->tnode_in;
    d->tbytes = d->tbytes_in;
  } else {
    d->tensors = td__calloc((size_t)nt, sizeof *d->tensors);
    d->tnode = td__calloc((size_t)nt, sizeof *d->tnode);
    d->tbytes = td__calloc((size_t)nt, sizeof *d->tbytes);
    if (!d->tensors || !d->tnode || !d->tbytes) {
      td__free(d->tensors);
      td__free(d->tnode);
      td__free(d->tbytes);
      d->tensors = NULL;
      d->tnode = NULL;
      d->tbytes = NULL;
      return "out of memory";
    }
  }
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
    d->tnode[d->ntensors] = n;
    d->tbytes[d->ntensors++] = nb;
  }
  if (d->direct) {
    if (d->payload_len != td__direct_desc_size(d->ntensors))
      return "direct-copy descriptor does not match the tensors described";
    return NULL;
  }
  if (total != d->payload_len) return "payload length does not match the tensors described";
  return NULL;
}

/* The descriptor of a direct-copy frame is complete: copy the tensors out of the sender (unless
 * the frame is refused), acknowledge the token either way, then deliver or report the frame. */
/* Allocates tensor i (a no-op once done). Memory is taken only when the tensor's bytes begin to
 * arrive, so a header that merely declares large tensors costs nothing. */
static td_status alloc_tensor(td__decoder *d, int i) {
  if (d->tensors[i]) return TD_OK;
  const Tdist__Node *n = d->tnode[i];
  /* bytes a peer could withhold (a direct copy is read at once from the sender's memory) */
  uint64_t nb = d->tbytes[i];
  if (d->held && !d->direct && nb > 0) {
    int64_t after = __atomic_add_fetch(d->held, (int64_t)nb, __ATOMIC_RELAXED);
    if ((uint64_t)after > d->held_max) {
      __atomic_sub_fetch(d->held, (int64_t)nb, __ATOMIC_RELAXED);
      return td_set_error(TD_ERR_NOMEM, "rank %d already has %llu bytes of frames in progress "
                          "here: a tensor of %llu bytes more exceeds the bound of %llu bytes per "
                          "member", d->ctx.peer_rank, (unsigned long long)((uint64_t)after - nb),
                          (unsigned long long)nb, (unsigned long long)d->held_max);
    }
    d->held_now += nb;
  }
  td_status st = td_tensor_empty(n->shape, (int)n->n_shape, (td_dtype)n->dtype, td_device_cpu(),
                                 &d->tensors[i]);
  if (st != TD_OK)
    return td_set_error(TD_ERR_NOMEM, "cannot allocate a received tensor of %zu bytes",
                        d->tbytes[i]);
  return TD_OK; /* (a failed allocation's share goes back with its frame: reset_frame) */
}

static void deliver(td__decoder *d);

/* The last step of a direct-copy frame: acknowledge the token (the sender may release its
 * tensors), then deliver the message or report why it was refused. */
static void direct_done(td__decoder *d) {
  if (d->has_hooks && d->hooks.send_ack) d->hooks.send_ack(d->ud, td__direct_desc_token(d->desc));
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
  d->cur = d->ntensors;
  deliver(d);
}

/* Copies the tensors out of the sender (the bulk of a direct-copy frame). */
static void direct_read(td__decoder *d) {
  if (d->reject_st != TD_OK) return;
  td_status st = td__direct_read(d->desc, d->tensors, d->ntensors);
  if (st != TD_OK) {
    snprintf(d->reject, sizeof d->reject, "%s", td_last_error());
    d->reject_st = st;
  }
}

/* The descriptor of a direct-copy frame is complete: check the sender may be read, allocate the
 * tensors, then copy them here, or - for TD__DIRECT_OFFLOAD_MIN bytes and more, when the owner
 * can run it elsewhere - pause (ST_WAIT) and let td__decoder_resume copy them on another thread,
 * so a large copy never holds up the thread that serves every other stream. */
static void finish_direct(td__decoder *d) {
  int pid = td__direct_desc_pid(d->desc);
  if (d->reject_st == TD_OK) {
    if (!d->has_hooks || !d->hooks.allowed || !d->hooks.allowed(d->ud, pid)) {
      snprintf(d->reject, sizeof d->reject, "direct copy from process %d is not allowed", pid);
      d->reject_st = TD_ERR_FORMAT;
    }
  }
  uint64_t bytes = 0;
  for (int i = 0; d->reject_st == TD_OK && i < d->ntensors; i++) {
    bytes += d->tbytes[i];
    if (alloc_tensor(d, i) != TD_OK) {
      snprintf(d->reject, sizeof d->reject, "%s", td_last_error());
      d->reject_st = TD_ERR_NOMEM;
    }
  }
  if (d->reject_st == TD_OK && bytes >= TD__DIRECT_OFFLOAD_MIN && d->has_hooks &&
      d->hooks.offload && !d->resuming) {
    d->state = ST_WAIT;
    d->wait_for = WAIT_DIRECT_READ;
    d->hooks.offload(d->ud);
    return;
  }
  direct_read(d);
  direct_done(d);
}

static void deliver_now(td__decoder *d);

void td__decoder_resume(td__decoder *d) {
  if (d->state != ST_WAIT) return;
  d->resuming = true;
  if (d->wait_for == WAIT_DIRECT_READ) {
    direct_read(d);
    direct_done(d);
  } else {
    deliver_now(d);
  }
  d->resuming = false;
}

bool td__decoder_paused(const td__decoder *d) { return d->state == ST_WAIT; }

typedef struct {
  td_value *v;      /* container being filled */
  uint32_t left;    /* children still expected */
  bool dict, ext;
  const char *ext_type;
  const char *key;  /* key of this container in its parent dict */
} dec_frame;

/* Attaches child to the top container, or to the message's roots (the bottom frame, v NULL). */
static td_status attach(dec_frame *top, td_value *child, const char *key, td__msg *m) {
  td_status st;
  if (!top->v) {
    m->values[m->nvalues++] = child; /* the message owns it from here, even on a later error */
    top->left--;
    return TD_OK;
  }
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
    *st = td__error_prefix(TD_ERR_DEVICE, "tensor %d cannot be placed on %s", idx, dn);
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
  m->nvalues = 0;
  dec_frame stack[TD__MAX_DEPTH + 1];
  int sp = 0, tcur = 0;
  size_t ni = 0;
  td_status st = TD_OK;
  /* the bottom frame collects the roots straight into m->values */
  stack[sp++] = (dec_frame){NULL, e->nargs, false, false, NULL, NULL};
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
      st = attach(&stack[sp - 1], v, done.key, m);
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
    st = attach(top, v, key, m);
  }
  if (st == TD_OK && (ni != e->n_nodes || tcur != d->ntensors))
    st = td_set_error(TD_ERR_FORMAT, "trailing nodes or tensors after the value trees");
  while (sp > 1) td_value_unref(stack[--sp].v);
  return st;
}

/* Whether some tensor of the frame goes to a CUDA device. */
static bool frame_places(const td__decoder *d) {
  for (int i = 0; i < d->ntensors; i++)
    if (d->tnode[i]->device) return true;
  return false;
}

/* Delivers the complete frame; one whose tensors go to CUDA devices waits for
 * td__decoder_resume on another thread when the owner can offload (the copies to the device
 * queue behind its kernels, and the network thread must not wait for them). */
static void deliver(td__decoder *d) {
  if (!d->resuming && d->has_hooks && d->hooks.offload && frame_places(d)) {
    d->state = ST_WAIT;
    d->wait_for = WAIT_PLACE;
    d->hooks.offload(d->ud);
    return;
  }
  deliver_now(d);
}

static void deliver_now(td__decoder *d) {
  Tdist__Envelope *e = d->env;
  td__msg m = {0};
  m.id = d->id;
  m.kind = (int)e->kind;
  m.from_rank = e->from_rank;
  m.status = (td_status)e->status;
  m.timeout_ms = e->timeout_ms > 0 ? e->timeout_ms : 0;
  m.ctx_id = e->ctx_id;
  m.autograd_msg_id = e->autograd_msg_id;
  d->last_direct = d->direct;
  d->last_bytes = d->header_len;
  for (int i = 0; i < d->ntensors; i++) d->last_bytes += d->tbytes[i];
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
    /* an empty message stays NULL (td__msg: NULL means "") */
    m.fn = td__strdup(e->fn ? e->fn : "");
    if (e->message && e->message[0]) m.message = td__strdup(e->message);
    if (!m.fn || (e->message && e->message[0] && !m.message))
      st = td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
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

/* Advances past tensors that are already complete (allocating empty ones). Out of memory: the
 * rest of the frame is skipped and reported. */
static void settle_payload(td__decoder *d) {
  while (d->cur < d->ntensors && d->cur_off == d->tbytes[d->cur]) {
    if (alloc_tensor(d, d->cur) != TD_OK) {
      char why[200];
      snprintf(why, sizeof why, "%s", td_last_error());
      skip_frame(d, d->payload_len - d->payload_got, TD_ERR_NOMEM, why);
      return;
    }
    d->cur++;
    d->cur_off = 0;
  }
}

/* ---- the feed: one function per decoder state ----
 * PREFIX  24 bytes: magic, lengths, id. An ack is handled at once; a bad magic corrupts the
 *         stream; an oversized envelope or message is skipped (reported by id).
 * HEADER  the protobuf envelope; parsing it allocates the payload's tensors. A direct-copy frame
 *         continues with DESC, a malformed one is skipped, others go on to PAYLOAD.
 * PAYLOAD tensor bytes, copied straight into the tensors; the complete frame is delivered.
 * DESC    a direct-copy descriptor; when complete the tensors are read from the sender.
 * SKIP    the rest of a refused frame.
 * Each takes what it needs from (*p, *n) and advances them. */

static td_status feed_prefix(td__decoder *d, const uint8_t **p, size_t *n) {
  size_t take = TD__FRAME_PREFIX - d->have;
  if (take > *n) take = *n;
  memcpy(d->prefix + d->have, *p, take);
  d->have += take;
  *p += take;
  *n -= take;
  if (d->have < TD__FRAME_PREFIX) return TD_OK;
  uint32_t magic = td__get_u32(d->prefix);
  d->header_len = td__get_u32(d->prefix + 4);
  d->payload_len = td__get_u64(d->prefix + 8);
  d->id = td__get_u64(d->prefix + 16);
  d->have = 0;
  if (magic == TD__FRAME_MAGIC_ACK) {
    if (d->header_len || d->payload_len)
      return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (ack frame with a body)");
    if (d->has_hooks && d->hooks.acked) d->hooks.acked(d->ud, d->id);
    return TD_OK;
  }
  if (magic == TD__FRAME_MAGIC_LANE) {
    if (d->header_len || d->payload_len > CTRL_MAX || !d->has_hooks || !d->hooks.lane_control)
      return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (unexpected lane control frame)");
    d->state = ST_CTRL;
    if (d->payload_len == 0) {
      d->state = ST_PREFIX;
      d->hooks.lane_control(d->ud, d->id, d->ctrl, 0);
    }
    return TD_OK;
  }
  if (magic != TD__FRAME_MAGIC && magic != TD__FRAME_MAGIC_DIRECT)
    return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (bad frame magic 0x%08x)", magic);
  d->direct = magic == TD__FRAME_MAGIC_DIRECT;
  if (d->direct && !td__direct_desc_len_ok(d->header_len, d->payload_len))
    /* without a readable token the sender could not be answered: the stream is unusable */
    return td_set_error(TD_ERR_FORMAT, "rpc: stream corrupt (bad direct-copy frame)");
  /* saturated: a payload_len near 2^64 must not wrap past max_msg */
  uint64_t total = d->payload_len > UINT64_MAX - d->header_len
                       ? UINT64_MAX
                       : (uint64_t)d->header_len + d->payload_len;
  if (d->header_len > TD__MAX_HEADER) {
    skip_frame(d, total, TD_ERR_INVALID, "message envelope too large");
    return TD_OK;
  }
  if (d->max_msg && total > d->max_msg) {
    char why[160];
    snprintf(why, sizeof why, "message of %llu bytes exceeds the limit of %llu bytes",
             (unsigned long long)total, (unsigned long long)d->max_msg);
    skip_frame(d, total, TD_ERR_INVALID, why);
    return TD_OK;
  }
  if (d->header_len <= TD__SMALL_HEADER && !d->small) d->small = small_take();
  d->header = d->header_len <= TD__SMALL_HEADER && d->small
                  ? d->small->header
                  : td__malloc(d->header_len ? d->header_len : 1);
  if (!d->header) return td_set_error(TD_ERR_NOMEM, "rpc: out of memory");
  d->state = ST_HEADER;
  return TD_OK;
}

static td_status feed_header(td__decoder *d, const uint8_t **p, size_t *n) {
  size_t take = d->header_len - d->have;
  if (take > *n) take = *n;
  memcpy(d->header + d->have, *p, take);
  d->have += take;
  *p += take;
  *n -= take;
  if (d->have < d->header_len) return TD_OK;
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
    return TD_OK;
  }
  if (why) {
    char msg[256];
    snprintf(msg, sizeof msg, "%s", why);
    skip_frame(d, d->payload_len, TD_ERR_FORMAT, msg);
    return TD_OK;
  }
  settle_payload(d);
  return TD_OK;
}

static void feed_payload(td__decoder *d, const uint8_t **p, size_t *n) {
  if (d->cur >= d->ntensors) {
    deliver(d);
    return;
  }
  if (alloc_tensor(d, d->cur) != TD_OK) {
    char why[200];
    snprintf(why, sizeof why, "%s", td_last_error());
    skip_frame(d, d->payload_len - d->payload_got, TD_ERR_NOMEM, why);
    return;
  }
  td_tensor *t = d->tensors[d->cur];
  size_t need = d->tbytes[d->cur] - (size_t)d->cur_off;
  size_t take = need < *n ? need : *n;
  memcpy((uint8_t *)td_tensor_data(t) + d->cur_off, *p, take);
  d->cur_off += take;
  d->payload_got += take;
  *p += take;
  *n -= take;
  settle_payload(d);
}

static void feed_desc(td__decoder *d, const uint8_t **p, size_t *n) {
  size_t take = (size_t)d->payload_len - d->have;
  if (take > *n) take = *n;
  memcpy(d->desc + d->have, *p, take);
  d->have += take;
  *p += take;
  *n -= take;
  if (d->have == d->payload_len) finish_direct(d);
}

static void feed_ctrl(td__decoder *d, const uint8_t **p, size_t *n) {
  size_t take = (size_t)d->payload_len - d->have;
  if (take > *n) take = *n;
  memcpy(d->ctrl + d->have, *p, take);
  d->have += take;
  *p += take;
  *n -= take;
  if (d->have < d->payload_len) return;
  d->have = 0;
  d->state = ST_PREFIX;
  d->hooks.lane_control(d->ud, d->id, d->ctrl, (size_t)d->payload_len);
}

static void feed_skip(td__decoder *d, const uint8_t **p, size_t *n) {
  uint64_t take = d->skip_left < *n ? d->skip_left : *n;
  d->skip_left -= take;
  *p += take;
  *n -= (size_t)take;
  if (!d->skip_left) d->state = ST_PREFIX;
}

td_status td__decoder_feed_some(td__decoder *d, const uint8_t *p, size_t n, size_t *used) {
  const uint8_t *start = p;
  /* Besides consuming bytes, finish what needs none: an empty header, a complete payload. */
  while (d->state != ST_WAIT &&
         (n > 0 || (d->state == ST_HEADER && d->have == d->header_len) ||
          (d->state == ST_PAYLOAD && d->cur >= d->ntensors))) {
    td_status st = TD_OK;
    switch (d->state) {
      case ST_PREFIX: st = feed_prefix(d, &p, &n); break;
      case ST_HEADER: st = feed_header(d, &p, &n); break;
      case ST_PAYLOAD: feed_payload(d, &p, &n); break;
      case ST_DESC: feed_desc(d, &p, &n); break;
      case ST_SKIP: feed_skip(d, &p, &n); break;
      case ST_CTRL: feed_ctrl(d, &p, &n); break;
      default: break;
    }
    if (st != TD_OK) {
      *used = (size_t)(p - start);
      return st;
    }
  }
  *used = (size_t)(p - start);
  return TD_OK;
}

td_status td__decoder_feed(td__decoder *d, const uint8_t *p, size_t n) {
  size_t used = 0;
  while (n > 0) {
    TD_TRY(td__decoder_feed_some(d, p, n, &used));
    p += used;
    n -= used;
    if (d->state == ST_WAIT) td__decoder_resume(d); /* no other thread to do it: here */
  }
  size_t none;
  return td__decoder_feed_some(d, p, 0, &none);
}
