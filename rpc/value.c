/* value.c - td_value: reference-counted tagged trees (none, bool, int, double, string, bytes,
 * tensor, list, dict, extension objects) and the registry of extension types.
 *
 * Design:
 * - One heap block per value; strings and bytes live in the same block, after the struct, always
 *   followed by a NUL so that td_value_as_string can hand out a C string.
 * - none, true and false are immortal statics: ref/unref ignore them, so td_value_none() never
 *   fails and costs nothing. Every other value starts with one reference.
 * - A list is a growable array of owned children; a dict is an insertion-ordered array of
 *   (owned key copy, owned value) entries, plus an open-addressing index of entry positions once
 *   it holds more than DICT_INDEX_MIN entries (small dicts are scanned linearly).
 * - Destruction is iterative (an explicit list of dead values threaded through next_dead), so
 *   freeing a very deep tree cannot overflow the stack.
 * - Appending a container into itself (directly or through its children) is refused, so trees
 *   stay acyclic and reference counting stays exact. Only a container that has itself been stored
 *   in another container (adopted) can lie inside the item, so the walk that checks for a cycle
 *   runs only then: building a tree bottom-up costs O(1) per append.
 *
 * Invariants: a value reachable from several parents is never mutated (the public contract says a
 * value handed to a call must not be modified afterwards); ext values hold their type pointer for
 * their whole life, and registered types are never unregistered.
 *
 * THREAD SAFETY: ref/unref and every read may run on any thread at once; list_append and dict_set
 * need the caller to be the only user of the container at that moment.
 * Lock order: ext_mu only (the extension registry); values themselves have no lock.
 */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/refcount.h"
#include "../core/tcache.h"
#include "value_impl.h"

#define DICT_INDEX_MIN 8       /* build the hash index above this many entries */
#define TO_STRING_MAX_DEPTH 32 /* deeper levels print as "..." */

typedef struct dict_entry {
  char *key;
  td_value *val;
} dict_entry;

struct td_value {
  td__refcnt rc;
  td_value_kind kind;
  bool immortal;       /* static singleton: ref/unref do nothing */
  bool adopted;        /* container ever stored inside another container (atomic access) */
  td_value *next_dead; /* link in the destruction work list, unused otherwise */
  union {
    bool b;
    int64_t i;
    double d;
    struct {
      char *data; /* points just past the struct; data[len] == '\0' */
      size_t len;
    } buf;
    td_tensor *tensor;
    struct {
      td_value **items;
      size_t len, cap;
    } list;
    struct {
      dict_entry *items;
      size_t len, cap;
      uint32_t *index; /* entry position + 1, 0 = empty slot; NULL while small */
      size_t index_cap; /* power of two, > 2 * len when index != NULL */
    } dict;
    struct {
      const td__value_ext_type *type;
      void *obj;
    } ext;
  } u;
};

static td_value none_v = {.kind = TD_VALUE_NONE, .immortal = true};
static td_value true_v = {.kind = TD_VALUE_BOOL, .immortal = true, .u.b = true};
static td_value false_v = {.kind = TD_VALUE_BOOL, .immortal = true, .u.b = false};

/* ---- construction and lifetime ---- */

/* Values come from the thread's block cache (core/tcache.h): a call makes and drops several. */
static td_value *value_new(td_value_kind kind, size_t extra) {
  td_value *v = td__tc_calloc(sizeof *v + extra);
  if (!v) return NULL;
  td__ref_init(&v->rc);
  v->kind = kind;
  return v;
}

td_value *td_value_none(void) { return &none_v; }

td_value *td_value_bool(bool b) { return b ? &true_v : &false_v; }

td_value *td_value_int(int64_t x) {
  td_value *v = value_new(TD_VALUE_INT, 0);
  if (v) v->u.i = x;
  return v;
}

td_value *td_value_double(double x) {
  td_value *v = value_new(TD_VALUE_DOUBLE, 0);
  if (v) v->u.d = x;
  return v;
}

static td_value *value_buf(td_value_kind kind, const void *data, size_t n) {
  if (!data && n) return NULL;
  if (n > SIZE_MAX - sizeof(td_value) - 1) return NULL;
  td_value *v = value_new(kind, n + 1);
  if (!v) return NULL;
  v->u.buf.data = (char *)(v + 1);
  if (n) memcpy(v->u.buf.data, data, n);
  v->u.buf.data[n] = '\0';
  v->u.buf.len = n;
  return v;
}

td_value *td_value_string(const char *s) {
  return s ? value_buf(TD_VALUE_STRING, s, strlen(s)) : NULL;
}

td_value *td_value_string_n(const char *s, size_t n) { return value_buf(TD_VALUE_STRING, s, n); }

td_value *td_value_bytes(const void *data, size_t n) { return value_buf(TD_VALUE_BYTES, data, n); }

td_value *td_value_tensor(td_tensor *t) {
  if (!t) return NULL;
  td_value *v = value_new(TD_VALUE_TENSOR, 0);
  if (v) v->u.tensor = td_tensor_ref(t);
  return v;
}

td_value *td_value_list(void) { return value_new(TD_VALUE_LIST, 0); }

td_value *td_value_dict(void) { return value_new(TD_VALUE_DICT, 0); }

td_value *td__value_ext(const td__value_ext_type *type, void *obj) {
  if (!type) return NULL;
  td_value *v = value_new(TD_VALUE_EXT, 0);
  if (!v) {
    if (type->destroy) type->destroy(obj);
    return NULL;
  }
  v->u.ext.type = type;
  v->u.ext.obj = obj;
  return v;
}

td_value *td_value_ref(td_value *v) {
  if (v && !v->immortal) td__ref_inc(&v->rc);
  return v;
}

/* drop releases one reference to a child and reports whether it was the last. */
static bool drop(td_value *v) { return !v->immortal && td__ref_dec(&v->rc); }

void td_value_unref(td_value *v) {
  if (!v || !drop(v)) return;
  td_value *work = v;
  v->next_dead = NULL;
  while (work) {
    td_value *cur = work;
    work = cur->next_dead;
    switch (cur->kind) {
      case TD_VALUE_TENSOR:
        td_tensor_unref(cur->u.tensor);
        break;
      case TD_VALUE_LIST:
        for (size_t i = 0; i < cur->u.list.len; i++) {
          td_value *c = cur->u.list.items[i];
          if (drop(c)) {
            c->next_dead = work;
            work = c;
          }
        }
        td__free(cur->u.list.items);
        break;
      case TD_VALUE_DICT:
        for (size_t i = 0; i < cur->u.dict.len; i++) {
          td_value *c = cur->u.dict.items[i].val;
          td__free(cur->u.dict.items[i].key);
          if (drop(c)) {
            c->next_dead = work;
            work = c;
          }
        }
        td__free(cur->u.dict.items);
        td__free(cur->u.dict.index);
        break;
      case TD_VALUE_EXT:
        if (cur->u.ext.type->destroy) cur->u.ext.type->destroy(cur->u.ext.obj);
        break;
      default:
        break;
    }
    bool buf = cur->kind == TD_VALUE_STRING || cur->kind == TD_VALUE_BYTES;
    td__tc_free(cur, sizeof *cur + (buf ? cur->u.buf.len + 1 : 0));
  }
}

/* ---- kinds ---- */

static const char *kind_str(td_value_kind k) {
  switch (k) {
    case TD_VALUE_NONE: return "none";
    case TD_VALUE_BOOL: return "bool";
    case TD_VALUE_INT: return "int";
    case TD_VALUE_DOUBLE: return "double";
    case TD_VALUE_STRING: return "string";
    case TD_VALUE_BYTES: return "bytes";
    case TD_VALUE_TENSOR: return "tensor";
    case TD_VALUE_LIST: return "list";
    case TD_VALUE_DICT: return "dict";
    case TD_VALUE_EXT: return "ext";
  }
  return "unknown";
}

td_value_kind td_value_kind_of(const td_value *v) { return v ? v->kind : TD_VALUE_NONE; }

const char *td_value_kind_name(const td_value *v) {
  if (!v) return "none";
  if (v->kind == TD_VALUE_EXT) return v->u.ext.type->name;
  return kind_str(v->kind);
}

const td__value_ext_type *td__value_ext_type_of(const td_value *v) {
  return v && v->kind == TD_VALUE_EXT ? v->u.ext.type : NULL;
}

void *td__value_ext_obj(const td_value *v) {
  return v && v->kind == TD_VALUE_EXT ? v->u.ext.obj : NULL;
}

/* mismatch sets "value: expected <want>, got <actual>" and returns TD_ERR_INVALID. */
static td_status mismatch(const char *want, const td_value *v) {
  if (!v) return td_set_error(TD_ERR_INVALID, "value: expected %s, got NULL", want);
  return td_set_error(TD_ERR_INVALID, "value: expected %s, got %s", want, td_value_kind_name(v));
}

/* ---- accessors ---- */

td_status td_value_as_bool(const td_value *v, bool *out) {
  TD_CHECK_ARG(out, "value_as_bool: NULL out");
  if (!v || v->kind != TD_VALUE_BOOL) return mismatch("bool", v);
  *out = v->u.b;
  return TD_OK;
}

td_status td_value_as_int(const td_value *v, int64_t *out) {
  TD_CHECK_ARG(out, "value_as_int: NULL out");
  if (v && v->kind == TD_VALUE_INT) *out = v->u.i;
  else if (v && v->kind == TD_VALUE_BOOL) *out = v->u.b ? 1 : 0;
  else return mismatch("int", v);
  return TD_OK;
}

td_status td_value_as_double(const td_value *v, double *out) {
  TD_CHECK_ARG(out, "value_as_double: NULL out");
  if (v && v->kind == TD_VALUE_DOUBLE) *out = v->u.d;
  else if (v && v->kind == TD_VALUE_INT) *out = (double)v->u.i;
  else return mismatch("double", v);
  return TD_OK;
}

td_status td_value_as_string(const td_value *v, const char **out, size_t *len) {
  TD_CHECK_ARG(out, "value_as_string: NULL out");
  if (!v || v->kind != TD_VALUE_STRING) return mismatch("string", v);
  *out = v->u.buf.data;
  if (len) *len = v->u.buf.len;
  return TD_OK;
}

td_status td_value_as_bytes(const td_value *v, const void **data, size_t *len) {
  TD_CHECK_ARG(data, "value_as_bytes: NULL data");
  if (!v || v->kind != TD_VALUE_BYTES) return mismatch("bytes", v);
  *data = v->u.buf.data;
  if (len) *len = v->u.buf.len;
  return TD_OK;
}

td_status td_value_as_tensor(const td_value *v, td_tensor **out) {
  TD_CHECK_ARG(out, "value_as_tensor: NULL out");
  if (!v || v->kind != TD_VALUE_TENSOR) return mismatch("tensor", v);
  *out = v->u.tensor;
  return TD_OK;
}

/* ---- lists ---- */

/* reaches reports whether target is root or lies inside root's tree. */
static bool reaches(const td_value *root, const td_value *target) {
  if (root == target) return true;
  if (root->kind == TD_VALUE_LIST) {
    for (size_t i = 0; i < root->u.list.len; i++)
      if (reaches(root->u.list.items[i], target)) return true;
  } else if (root->kind == TD_VALUE_DICT) {
    for (size_t i = 0; i < root->u.dict.len; i++)
      if (reaches(root->u.dict.items[i].val, target)) return true;
  }
  return false;
}

static bool is_adopted(const td_value *c) { return __atomic_load_n(&c->adopted, __ATOMIC_RELAXED); }

/* adopt records that item now has a parent (containers only; immortals are never containers). */
static void adopt(td_value *item) {
  if ((item->kind == TD_VALUE_LIST || item->kind == TD_VALUE_DICT) && !is_adopted(item))
    __atomic_store_n(&item->adopted, true, __ATOMIC_RELAXED);
}

size_t td_value_list_len(const td_value *list) {
  return list && list->kind == TD_VALUE_LIST ? list->u.list.len : 0;
}

td_value *td_value_list_get(const td_value *list, size_t i) {
  if (!list || list->kind != TD_VALUE_LIST || i >= list->u.list.len) return NULL;
  return list->u.list.items[i];
}

td_status td_value_list_append(td_value *list, td_value *item) {
  if (!list || list->kind != TD_VALUE_LIST) return mismatch("list", list);
  TD_CHECK_ARG(item, "value_list_append: NULL item (did a constructor run out of memory?)");
  TD_CHECK_ARG(item != list && (!is_adopted(list) || !reaches(item, list)),
               "value_list_append: the item contains the list (cycle)");
  if (list->u.list.len == list->u.list.cap) {
    size_t cap = list->u.list.cap ? list->u.list.cap * 2 : 4;
    td_value **items = td__realloc(list->u.list.items, cap * sizeof *items);
    if (!items) return td_set_error(TD_ERR_NOMEM, "value_list_append: out of memory");
    list->u.list.items = items;
    list->u.list.cap = cap;
  }
  list->u.list.items[list->u.list.len++] = item;
  adopt(item);
  return TD_OK;
}

/* ---- dicts ---- */

static uint64_t hash_key(const char *s) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 1099511628211ull;
  }
  return h;
}

/* dict_find returns the entry position of key, or -1. */
static ptrdiff_t dict_find(const td_value *d, const char *key) {
  if (!d->u.dict.index) {
    for (size_t i = 0; i < d->u.dict.len; i++)
      if (strcmp(d->u.dict.items[i].key, key) == 0) return (ptrdiff_t)i;
    return -1;
  }
  size_t mask = d->u.dict.index_cap - 1;
  for (size_t s = (size_t)hash_key(key) & mask;; s = (s + 1) & mask) {
    uint32_t e = d->u.dict.index[s];
    if (!e) return -1;
    if (strcmp(d->u.dict.items[e - 1].key, key) == 0) return (ptrdiff_t)(e - 1);
  }
}

static void index_insert(uint32_t *index, size_t cap, const char *key, size_t pos) {
  size_t mask = cap - 1;
  size_t s = (size_t)hash_key(key) & mask;
  while (index[s]) s = (s + 1) & mask;
  index[s] = (uint32_t)(pos + 1);
}

/* dict_reindex rebuilds the index so that it can hold want entries at load <= 1/2. */
static td_status dict_reindex(td_value *d, size_t want) {
  size_t cap = 16;
  while (cap < 2 * want + 2) cap *= 2;
  uint32_t *index = td__calloc(cap, sizeof *index);
  if (!index) return td_set_error(TD_ERR_NOMEM, "value_dict_set: out of memory");
  for (size_t i = 0; i < d->u.dict.len; i++) index_insert(index, cap, d->u.dict.items[i].key, i);
  td__free(d->u.dict.index);
  d->u.dict.index = index;
  d->u.dict.index_cap = cap;
  return TD_OK;
}

size_t td_value_dict_len(const td_value *dict) {
  return dict && dict->kind == TD_VALUE_DICT ? dict->u.dict.len : 0;
}

td_value *td_value_dict_get(const td_value *dict, const char *key) {
  if (!dict || dict->kind != TD_VALUE_DICT || !key) return NULL;
  ptrdiff_t i = dict_find(dict, key);
  return i < 0 ? NULL : dict->u.dict.items[i].val;
}

td_status td_value_dict_set(td_value *dict, const char *key, td_value *item) {
  if (!dict || dict->kind != TD_VALUE_DICT) return mismatch("dict", dict);
  TD_CHECK_ARG(key, "value_dict_set: NULL key");
  TD_CHECK_ARG(item, "value_dict_set: NULL item for key '%s' (constructor out of memory?)", key);
  TD_CHECK_ARG(item != dict && (!is_adopted(dict) || !reaches(item, dict)),
               "value_dict_set: the item for key '%s' contains the dict (cycle)", key);
  ptrdiff_t found = dict_find(dict, key);
  if (found >= 0) {
    td_value *old = dict->u.dict.items[found].val;
    dict->u.dict.items[found].val = item;
    adopt(item);
    td_value_unref(old);
    return TD_OK;
  }
  size_t len = dict->u.dict.len;
  TD_CHECK_ARG(len < UINT32_MAX - 1, "value_dict_set: dict is full");
  if (len == dict->u.dict.cap) {
    size_t cap = dict->u.dict.cap ? dict->u.dict.cap * 2 : 4;
    dict_entry *items = td__realloc(dict->u.dict.items, cap * sizeof *items);
    if (!items) return td_set_error(TD_ERR_NOMEM, "value_dict_set: out of memory");
    dict->u.dict.items = items;
    dict->u.dict.cap = cap;
  }
  bool need_index = len + 1 > DICT_INDEX_MIN;
  if (need_index && (!dict->u.dict.index || dict->u.dict.index_cap < 2 * (len + 1) + 2))
    TD_TRY(dict_reindex(dict, len + 1));
  char *k = td__strdup(key);
  if (!k) return td_set_error(TD_ERR_NOMEM, "value_dict_set: out of memory");
  dict->u.dict.items[len].key = k;
  dict->u.dict.items[len].val = item;
  dict->u.dict.len = len + 1;
  if (dict->u.dict.index) index_insert(dict->u.dict.index, dict->u.dict.index_cap, k, len);
  adopt(item);
  return TD_OK;
}

td_status td_value_dict_entry(const td_value *dict, size_t i, const char **key, td_value **item) {
  if (!dict || dict->kind != TD_VALUE_DICT) return mismatch("dict", dict);
  TD_CHECK_ARG(i < dict->u.dict.len, "value_dict_entry: index %zu out of range (len %zu)", i,
               dict->u.dict.len);
  if (key) *key = dict->u.dict.items[i].key;
  if (item) *item = dict->u.dict.items[i].val;
  return TD_OK;
}

/* ---- equality ---- */

static bool double_same(double a, double b) { return a == b || (isnan(a) && isnan(b)); }

static bool elements_equal(const void *pa, const void *pb, int64_t numel, td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F32: {
      const float *a = pa, *b = pb;
      for (int64_t i = 0; i < numel; i++)
        if (!(a[i] == b[i] || (isnan(a[i]) && isnan(b[i])))) return false;
      return true;
    }
    case TD_DTYPE_F64: {
      const double *a = pa, *b = pb;
      for (int64_t i = 0; i < numel; i++)
        if (!double_same(a[i], b[i])) return false;
      return true;
    }
    case TD_DTYPE_I64:
    case TD_DTYPE_I32:
    case TD_DTYPE_U8:
    case TD_DTYPE_BOOL:
      return memcmp(pa, pb, (size_t)numel * td_dtype_size(dt)) == 0;
    case TD_DTYPE_F16:
    case TD_DTYPE_BF16: { /* by bits: equal, both NaN, or +0 and -0 */
      const uint16_t *a = pa, *b = pb, inf = dt == TD_DTYPE_F16 ? 0x7c00 : 0x7f80;
      for (int64_t i = 0; i < numel; i++) {
        uint16_t x = a[i] & 0x7fff, y = b[i] & 0x7fff;
        if (!(a[i] == b[i] || (x > inf && y > inf) || (x == 0 && y == 0))) return false;
      }
      return true;
    }
  }
  return false;
}

/* host_elements returns a host pointer to t's elements in row-major order: t's own memory when it
 * is a contiguous CPU tensor, else a copy stored in *copy (caller frees). NULL on failure. */
static const void *host_elements(const td_tensor *t, void **copy) {
  *copy = NULL;
  if (td_tensor_device(t).type == TD_DEVICE_CPU && td_tensor_is_contiguous(t))
    return td_tensor_data(t);
  size_t nb = td_tensor_nbytes(t);
  *copy = td__malloc(nb);
  if (!*copy) return NULL;
  if (td_tensor_copy_to_buffer(t, *copy, nb) != TD_OK) {
    td__free(*copy);
    *copy = NULL;
    return NULL;
  }
  return *copy;
}

static bool tensor_equal(const td_tensor *a, const td_tensor *b) {
  if (a == b) return true;
  if (td_tensor_dtype(a) != td_tensor_dtype(b) || td_tensor_ndim(a) != td_tensor_ndim(b) ||
      !td_tensor_same_shape(a, b))
    return false;
  int64_t numel = td_tensor_numel(a);
  if (numel == 0) return true;
  void *ca = NULL, *cb = NULL;
  const void *pa = host_elements(a, &ca);
  const void *pb = pa ? host_elements(b, &cb) : NULL;
  bool eq = pa && pb && elements_equal(pa, pb, numel, td_tensor_dtype(a));
  td__free(ca);
  td__free(cb);
  return eq;
}

bool td_value_equal(const td_value *a, const td_value *b) {
  if (!a) a = &none_v;
  if (!b) b = &none_v;
  if (a == b) return true;
  if (a->kind != b->kind) return false;
  switch (a->kind) {
    case TD_VALUE_NONE: return true;
    case TD_VALUE_BOOL: return a->u.b == b->u.b;
    case TD_VALUE_INT: return a->u.i == b->u.i;
    case TD_VALUE_DOUBLE: return double_same(a->u.d, b->u.d);
    case TD_VALUE_STRING:
    case TD_VALUE_BYTES:
      return a->u.buf.len == b->u.buf.len &&
             memcmp(a->u.buf.data, b->u.buf.data, a->u.buf.len) == 0;
    case TD_VALUE_TENSOR: return tensor_equal(a->u.tensor, b->u.tensor);
    case TD_VALUE_LIST:
      if (a->u.list.len != b->u.list.len) return false;
      for (size_t i = 0; i < a->u.list.len; i++)
        if (!td_value_equal(a->u.list.items[i], b->u.list.items[i])) return false;
      return true;
    case TD_VALUE_DICT:
      if (a->u.dict.len != b->u.dict.len) return false;
      for (size_t i = 0; i < a->u.dict.len; i++) {
        const dict_entry *ea = &a->u.dict.items[i], *eb = &b->u.dict.items[i];
        if (strcmp(ea->key, eb->key) != 0 || !td_value_equal(ea->val, eb->val)) return false;
      }
      return true;
    case TD_VALUE_EXT:
      if (a->u.ext.type != b->u.ext.type) return false;
      if (a->u.ext.obj == b->u.ext.obj) return true;
      return a->u.ext.type->equal && a->u.ext.type->equal(a->u.ext.obj, b->u.ext.obj);
  }
  return false;
}

/* ---- to_string ---- */

typedef struct writer {
  char *buf;
  size_t n;   /* buffer size, > 0 */
  size_t pos; /* bytes written, < n */
  bool full;  /* something did not fit */
} writer;

static void put(writer *w, const char *s, size_t len) {
  if (w->full) return;
  size_t avail = w->n - 1 - w->pos;
  if (len > avail) {
    len = avail;
    w->full = true;
  }
  memcpy(w->buf + w->pos, s, len);
  w->pos += len;
}

static void puts_(writer *w, const char *s) { put(w, s, strlen(s)); }

static void putf(writer *w, const char *fmt, ...) TD_PRINTF(2, 3);
static void putf(writer *w, const char *fmt, ...) {
  char tmp[64];
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (k < 0) return;
  put(w, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* put_quoted writes 'text' with Python-style escapes; bytes also escape every byte >= 0x80. */
static void put_quoted(writer *w, const char *prefix, const char *s, size_t len, bool bytes) {
  puts_(w, prefix);
  put(w, "'", 1);
  for (size_t i = 0; i < len && !w->full; i++) {
    unsigned char c = (unsigned char)s[i];
    switch (c) {
      case '\\': puts_(w, "\\\\"); break;
      case '\'': puts_(w, "\\'"); break;
      case '\n': puts_(w, "\\n"); break;
      case '\r': puts_(w, "\\r"); break;
      case '\t': puts_(w, "\\t"); break;
      default:
        if (c < 0x20 || c == 0x7f || (bytes && c >= 0x80)) putf(w, "\\x%02x", c);
        else put(w, (const char *)&c, 1);
    }
  }
  put(w, "'", 1);
}

static void put_double(writer *w, double d) {
  char tmp[40];
  if (isnan(d)) {
    puts_(w, "nan");
    return;
  }
  if (isinf(d)) {
    puts_(w, d < 0 ? "-inf" : "inf");
    return;
  }
  snprintf(tmp, sizeof tmp, "%.15g", d);
  if (strtod(tmp, NULL) != d) snprintf(tmp, sizeof tmp, "%.17g", d);
  if (!strpbrk(tmp, ".e")) strcat(tmp, ".0");
  puts_(w, tmp);
}

static void put_value(writer *w, const td_value *v, int depth) {
  if (w->full) return;
  if (!v) v = &none_v;
  if (depth > TO_STRING_MAX_DEPTH && (v->kind == TD_VALUE_LIST || v->kind == TD_VALUE_DICT)) {
    puts_(w, v->kind == TD_VALUE_LIST ? "[...]" : "{...}");
    return;
  }
  switch (v->kind) {
    case TD_VALUE_NONE: puts_(w, "None"); break;
    case TD_VALUE_BOOL: puts_(w, v->u.b ? "True" : "False"); break;
    case TD_VALUE_INT: putf(w, "%" PRId64, v->u.i); break;
    case TD_VALUE_DOUBLE: put_double(w, v->u.d); break;
    case TD_VALUE_STRING: put_quoted(w, "", v->u.buf.data, v->u.buf.len, false); break;
    case TD_VALUE_BYTES: put_quoted(w, "b", v->u.buf.data, v->u.buf.len, true); break;
    case TD_VALUE_TENSOR: {
      char shape[TD_MAX_DIMS * 24 + 4], dev[32];
      td_device d = td_tensor_device(v->u.tensor);
      puts_(w, "tensor(");
      puts_(w, td_dtype_name(td_tensor_dtype(v->u.tensor)));
      puts_(w, td_tensor_shape_str(v->u.tensor, shape, sizeof shape));
      if (d.type != TD_DEVICE_CPU) {
        puts_(w, ", ");
        puts_(w, td_device_str(d, dev, sizeof dev));
      }
      puts_(w, ")");
      break;
    }
    case TD_VALUE_LIST:
      puts_(w, "[");
      for (size_t i = 0; i < v->u.list.len && !w->full; i++) {
        if (i) puts_(w, ", ");
        put_value(w, v->u.list.items[i], depth + 1);
      }
      puts_(w, "]");
      break;
    case TD_VALUE_DICT:
      puts_(w, "{");
      for (size_t i = 0; i < v->u.dict.len && !w->full; i++) {
        const dict_entry *e = &v->u.dict.items[i];
        if (i) puts_(w, ", ");
        put_quoted(w, "", e->key, strlen(e->key), false);
        puts_(w, ": ");
        put_value(w, e->val, depth + 1);
      }
      puts_(w, "}");
      break;
    case TD_VALUE_EXT:
      if (v->u.ext.type->describe) {
        char tmp[256];
        tmp[0] = '\0';
        v->u.ext.type->describe(v->u.ext.obj, tmp, sizeof tmp);
        tmp[sizeof tmp - 1] = '\0';
        puts_(w, tmp);
      } else {
        puts_(w, v->u.ext.type->name);
      }
      break;
  }
}

const char *td_value_to_string(const td_value *v, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  writer w = {buf, n, 0, false};
  put_value(&w, v, 0);
  buf[w.pos] = '\0';
  if (w.full && n >= 4) {
    /* End with "..." and never leave half of a UTF-8 sequence before it. */
    size_t cut = w.pos < n - 4 ? w.pos : n - 4;
    while (cut > 0 && ((unsigned char)buf[cut] & 0xC0) == 0x80) cut--;
    memcpy(buf + cut, "...", 4);
  }
  return buf;
}

/* ---- tensor walk ---- */

td_status td__value_walk_tensors(const td_value *v, td__tensor_visit_fn fn, void *ctx) {
  if (!v) return TD_OK;
  switch (v->kind) {
    case TD_VALUE_TENSOR: return fn(ctx, v->u.tensor);
    case TD_VALUE_LIST:
      for (size_t i = 0; i < v->u.list.len; i++)
        TD_TRY(td__value_walk_tensors(v->u.list.items[i], fn, ctx));
      return TD_OK;
    case TD_VALUE_DICT:
      for (size_t i = 0; i < v->u.dict.len; i++)
        TD_TRY(td__value_walk_tensors(v->u.dict.items[i].val, fn, ctx));
      return TD_OK;
    default: return TD_OK;
  }
}

td_status td__value_map_tensors(td_value *v, td__tensor_map_fn fn, void *ctx) {
  if (!v) return TD_OK;
  switch (v->kind) {
    case TD_VALUE_TENSOR: {
      td_tensor *repl = NULL;
      TD_TRY(fn(ctx, v->u.tensor, &repl));
      if (repl) {
        td_tensor_unref(v->u.tensor);
        v->u.tensor = repl;
      }
      return TD_OK;
    }
    case TD_VALUE_LIST:
      for (size_t i = 0; i < v->u.list.len; i++)
        TD_TRY(td__value_map_tensors(v->u.list.items[i], fn, ctx));
      return TD_OK;
    case TD_VALUE_DICT:
      for (size_t i = 0; i < v->u.dict.len; i++)
        TD_TRY(td__value_map_tensors(v->u.dict.items[i].val, fn, ctx));
      return TD_OK;
    default: return TD_OK;
  }
}

/* ---- extension registry ---- */

static pthread_mutex_t ext_mu = PTHREAD_MUTEX_INITIALIZER;
static const td__value_ext_type **ext_types; /* grows, never shrinks; reachable until exit */
static size_t ext_len, ext_cap;

td_status td__value_ext_register(const td__value_ext_type *type) {
  TD_CHECK_ARG(type && type->name && type->name[0], "value_ext_register: type needs a name");
  td_status st = TD_OK;
  pthread_mutex_lock(&ext_mu);
  for (size_t i = 0; i < ext_len; i++) {
    if (ext_types[i] == type) goto out;
    if (strcmp(ext_types[i]->name, type->name) == 0) {
      st = td_set_error(TD_ERR_EXISTS, "value_ext_register: another type is already called '%s'",
                        type->name);
      goto out;
    }
  }
  if (ext_len == ext_cap) {
    size_t cap = ext_cap ? ext_cap * 2 : 8;
    const td__value_ext_type **t = td__realloc((void *)ext_types, cap * sizeof *t);
    if (!t) {
      st = td_set_error(TD_ERR_NOMEM, "value_ext_register: out of memory");
      goto out;
    }
    ext_types = t;
    ext_cap = cap;
  }
  ext_types[ext_len++] = type;
out:
  pthread_mutex_unlock(&ext_mu);
  return st;
}

const td__value_ext_type *td__value_ext_find(const char *name) {
  if (!name) return NULL;
  const td__value_ext_type *found = NULL;
  pthread_mutex_lock(&ext_mu);
  for (size_t i = 0; i < ext_len && !found; i++)
    if (strcmp(ext_types[i]->name, name) == 0) found = ext_types[i];
  pthread_mutex_unlock(&ext_mu);
  return found;
}
