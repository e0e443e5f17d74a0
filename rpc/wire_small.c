/* wire_small.c - the small-frame fast path of the envelope parser (wire_small.h).
 *
 * A reader over the envelope's bytes (every read bounds-checked against the end), filling a
 * td__small_env: the envelope, its nodes, shapes, aux ids and a text arena for the strings, all
 * inside the struct, so parsing allocates nothing and freeing is nothing. Anything outside the
 * subset wire_small.h describes makes the parser decline, and the caller hands the same bytes to
 * protobuf-c, the reference for what they mean. The rules copied from protobuf-c (1.4) are those
 * of its parse_uint32 / parse_uint64 (a varint of up to 10 bytes, truncated to the field's width),
 * parse_boolean (any payload bit set), scan_length_prefixed_data (a length of up to 5 bytes) and
 * parse_required_member (strings copied and NUL-terminated, an empty bytes field has NULL data).
 */
#include "wire_small.h"

#include <string.h>

/* protobuf's wire types */
enum { WT_VARINT = 0, WT_64BIT = 1, WT_LEN = 2 };

typedef struct rd {
  const uint8_t *p, *end;
} rd;

/* A varint of at most 10 bytes (its low 64 bits) and whether any payload bit was set. */
static bool rd_varint(rd *r, uint64_t *v, bool *any) {
  uint64_t x = 0;
  bool nz = false;
  for (unsigned i = 0; i < 10; i++) {
    if (r->p >= r->end) return false;
    uint8_t b = *r->p++;
    x |= (uint64_t)(b & 0x7f) << (7 * i); /* bits past 64 drop, as in protobuf-c */
    nz |= (b & 0x7f) != 0;
    if (!(b & 0x80)) {
      *v = x;
      if (any) *any = nz;
      return true;
    }
  }
  return false; /* unterminated */
}

/* The payload of a length-prefixed field: its length takes at most 5 bytes. */
static bool rd_len(rd *r, const uint8_t **data, size_t *len) {
  uint64_t v = 0;
  for (unsigned i = 0; i < 5; i++) {
    if (r->p >= r->end) return false;
    uint8_t b = *r->p++;
    v |= (uint64_t)(b & 0x7f) << (7 * i);
    if (!(b & 0x80)) {
      if (v > (uint64_t)(r->end - r->p)) return false;
      *data = r->p;
      *len = (size_t)v;
      r->p += v;
      return true;
    }
  }
  return false;
}

/* The text arena of s: strings are copied with a NUL after them. */
typedef struct arena {
  char *at, *end;
} arena;

static bool copy_string(arena *a, const uint8_t *p, size_t n, char **out) {
  if ((size_t)(a->end - a->at) < n + 1) return false;
  memcpy(a->at, p, n);
  a->at[n] = 0;
  *out = a->at;
  a->at += n + 1;
  return true;
}

static bool copy_bytes(arena *a, const uint8_t *p, size_t n, ProtobufCBinaryData *out) {
  out->len = n;
  out->data = NULL;
  if (!n) return true;
  if ((size_t)(a->end - a->at) < n) return false;
  memcpy(a->at, p, n);
  out->data = (uint8_t *)a->at;
  a->at += n;
  return true;
}

/* Packed varints into dst (room for *left more): the low 64 bits of each. */
static bool packed(const uint8_t *p, size_t n, uint64_t *dst, size_t *count, size_t *left) {
  rd r = {p, p + n};
  size_t k = 0;
  while (r.p < r.end) {
    if (k == *left) return false;
    if (!rd_varint(&r, &dst[k], NULL)) return false;
    k++;
  }
  *count = k;
  *left -= k;
  return true;
}

/* One tag: a single byte naming field 1..15 (longer tags: decline). */
static bool rd_tag(rd *r, unsigned *field, unsigned *wt) {
  uint8_t t = *r->p;
  if (t & 0x80 || (t >> 3) == 0) return false;
  r->p++;
  *field = t >> 3;
  *wt = t & 7;
  return true;
}

typedef struct budget {
  arena text;
  size_t dims_left, aux_left;
  int64_t *dims;
  uint64_t *aux;
} budget;

static bool parse_node(Tdist__Node *n, const uint8_t *p, size_t len, budget *b) {
  tdist__node__init(n);
  rd r = {p, p + len};
  unsigned seen = 0;
  while (r.p < r.end) {
    unsigned f, wt;
    if (!rd_tag(&r, &f, &wt) || f > 11 || (seen & (1u << f))) return false;
    seen |= 1u << f;
    uint64_t v = 0;
    bool any = false;
    const uint8_t *d = NULL;
    size_t dl = 0;
    switch (f) {
      case 4: /* d: double, fixed64 */
        if (wt != WT_64BIT || r.end - r.p < 8) return false;
        memcpy(&n->d, r.p, 8);
        r.p += 8;
        continue;
      case 5: case 6: case 8: case 10:
        if (wt != WT_LEN || !rd_len(&r, &d, &dl)) return false;
        break;
      default:
        if (wt != WT_VARINT || !rd_varint(&r, &v, &any)) return false;
        break;
    }
    switch (f) {
      case 1: n->kind = (uint32_t)v; break;
      case 2: n->b = any; break;
      case 3: n->i = (int64_t)(v >> 1) ^ -(int64_t)(v & 1); break; /* sint64 */
      case 5: if (!copy_string(&b->text, d, dl, &n->s)) return false; break;
      case 6: if (!copy_bytes(&b->text, d, dl, &n->by)) return false; break;
      case 7: n->dtype = (int32_t)(uint32_t)v; break;
      case 8: {
        size_t k;
        if (!packed(d, dl, (uint64_t *)b->dims, &k, &b->dims_left)) return false;
        if (k) n->shape = b->dims;
        n->n_shape = k;
        b->dims += k;
        break;
      }
      case 9: n->count = (uint32_t)v; break;
      case 10: if (!copy_string(&b->text, d, dl, &n->key)) return false; break;
      case 11: n->device = (uint32_t)v; break;
      default: return false;
    }
  }
  return true;
}

bool td__small_env_parse(td__small_env *s, const uint8_t *p, size_t n) {
  if (n > TD__SMALL_HEADER) return false;
  Tdist__Envelope *e = &s->env;
  tdist__envelope__init(e);
  budget b = {{s->text, s->text + sizeof s->text}, TD__SMALL_DIMS, TD__SMALL_AUX, s->dims, s->aux};
  rd r = {p, p + n};
  unsigned seen = 0;
  size_t nn = 0;
  while (r.p < r.end) {
    unsigned f, wt;
    if (!rd_tag(&r, &f, &wt) || f > 11) return false;
    if (f != 5 && (seen & (1u << f))) return false;
    seen |= 1u << f;
    uint64_t v = 0;
    const uint8_t *d = NULL;
    size_t dl = 0;
    if (f == 2 || f == 5 || f == 7 || f == 11) {
      if (wt != WT_LEN || !rd_len(&r, &d, &dl)) return false;
    } else if (wt != WT_VARINT || !rd_varint(&r, &v, NULL)) {
      return false;
    }
    switch (f) {
      case 1: e->kind = (uint32_t)v; break;
      case 2: if (!copy_string(&b.text, d, dl, &e->fn)) return false; break;
      case 3: e->from_rank = (int32_t)(uint32_t)v; break;
      case 4: e->nargs = (uint32_t)v; break;
      case 5:
        if (nn == TD__SMALL_NODES || !parse_node(&s->nodes[nn], d, dl, &b)) return false;
        s->ptrs[nn] = &s->nodes[nn];
        nn++;
        break;
      case 6: e->status = (int32_t)(uint32_t)v; break;
      case 7: if (!copy_string(&b.text, d, dl, &e->message)) return false; break;
      case 8: e->timeout_ms = (int64_t)v; break;
      case 9: e->ctx_id = v; break;
      case 10: e->autograd_msg_id = v; break;
      case 11: {
        size_t k;
        if (!packed(d, dl, s->aux, &k, &b.aux_left)) return false;
        if (k) e->aux = s->aux;
        e->n_aux = k;
        break;
      }
      default: return false;
    }
  }
  if (nn) e->nodes = s->ptrs;
  e->n_nodes = nn;
  return true;
}

/* ---- packing (the encoder's side): protobuf-c's bytes without its general path ----
 * Fields in field-number order, zero scalars and empty strings, bytes and arrays left out (proto3),
 * a negative int32 as a 10-byte varint, repeated integers packed: byte for byte what
 * tdist__envelope__pack writes (test_wire_small compares the two). One function writes or, with
 * out NULL, only counts. */

typedef struct wr {
  uint8_t *out; /* bytes [0, cap) are written; past cap only counted (cap 0: count only) */
  size_t n, cap;
} wr;

static void put_byte(wr *w, uint8_t b) {
  if (w->n < w->cap) w->out[w->n] = b;
  w->n++;
}

static void put_varint(wr *w, uint64_t v) {
  while (v >= 0x80) {
    put_byte(w, (uint8_t)(v | 0x80));
    v >>= 7;
  }
  put_byte(w, (uint8_t)v);
}

static size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    n++;
  }
  return n;
}

/* All n bytes or none: once a write does not fit, n stays past cap and nothing more is written. */
static void put_raw(wr *w, const void *p, size_t n) {
  if (n && w->n + n <= w->cap) memcpy(w->out + w->n, p, n);
  w->n += n;
}

static void put_u64(wr *w, uint8_t tag, uint64_t v) {
  if (!v) return;
  put_byte(w, tag);
  put_varint(w, v);
}

/* int32: negative values as their 64-bit two's complement (10 bytes), as protobuf-c does */
static void put_i32(wr *w, uint8_t tag, int32_t v) { put_u64(w, tag, (uint64_t)(int64_t)v); }

static void put_str(wr *w, uint8_t tag, const char *s) {
  size_t n = s ? strlen(s) : 0;
  if (!n) return;
  put_byte(w, tag);
  put_varint(w, n);
  put_raw(w, s, n);
}

static void put_packed(wr *w, uint8_t tag, const uint64_t *v, size_t n) {
  if (!n) return;
  size_t len = 0;
  for (size_t i = 0; i < n; i++) len += varint_size(v[i]);
  put_byte(w, tag);
  put_varint(w, len);
  for (size_t i = 0; i < n; i++) put_varint(w, v[i]);
}

static void put_node(wr *w, const Tdist__Node *n) {
  put_u64(w, 0x08, n->kind);
  if (n->b) {
    put_byte(w, 0x10);
    put_byte(w, 1);
  }
  put_u64(w, 0x18, ((uint64_t)n->i << 1) ^ (uint64_t)(n->i >> 63)); /* sint64: zigzag */
  if (n->d != 0) { /* -0.0 too is left out (0 == -0.0), as protobuf-c does */
    put_byte(w, 0x21);
    put_raw(w, &n->d, 8);
  }
  put_str(w, 0x2a, n->s);
  if (n->by.len) {
    put_byte(w, 0x32);
    put_varint(w, n->by.len);
    put_raw(w, n->by.data, n->by.len);
  }
  put_i32(w, 0x38, n->dtype);
  put_packed(w, 0x42, (const uint64_t *)n->shape, n->n_shape);
  put_u64(w, 0x48, n->count);
  put_str(w, 0x52, n->key);
  put_u64(w, 0x58, n->device);
}

/* put_node_field writes node n as a length-delimited field in one pass: its bytes go one byte past
 * the tag, where a length under 128 fits; a longer node moves up by the length's extra bytes. */
static void put_node_field(wr *w, const Tdist__Node *n) {
  put_byte(w, 0x2a);
  size_t at = w->n++;
  put_node(w, n);
  size_t len = w->n - at - 1;
  if (len < 0x80) {
    if (at < w->cap) w->out[at] = (uint8_t)len;
    return;
  }
  size_t extra = varint_size(len) - 1;
  bool whole = w->n <= w->cap && w->n + extra <= w->cap; /* the node's bytes and room for them */
  if (whole) memmove(w->out + at + 1 + extra, w->out + at + 1, len);
  w->n = at;
  put_varint(w, len);
  w->n += len; /* not whole: n ends past cap, so the caller packs again */
}

static size_t env_write(const Tdist__Envelope *e, uint8_t *out, size_t cap) {
  wr w = {out, 0, cap};
  put_u64(&w, 0x08, e->kind);
  put_str(&w, 0x12, e->fn);
  put_i32(&w, 0x18, e->from_rank);
  put_u64(&w, 0x20, e->nargs);
  for (size_t i = 0; i < e->n_nodes; i++) put_node_field(&w, e->nodes[i]);
  put_i32(&w, 0x30, e->status);
  put_str(&w, 0x3a, e->message);
  put_u64(&w, 0x40, (uint64_t)e->timeout_ms);
  put_u64(&w, 0x48, e->ctx_id);
  put_u64(&w, 0x50, e->autograd_msg_id);
  put_packed(&w, 0x5a, e->aux, e->n_aux);
  return w.n;
}

size_t td__env_packed_size(const Tdist__Envelope *e) { return env_write(e, NULL, 0); }

size_t td__env_pack(const Tdist__Envelope *e, uint8_t *out) { return env_write(e, out, SIZE_MAX); }

size_t td__env_pack_into(const Tdist__Envelope *e, uint8_t *out, size_t cap) {
  return env_write(e, out, cap);
}
