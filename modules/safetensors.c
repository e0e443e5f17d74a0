/* safetensors.c - reading and writing safetensors files, and module save/load on top of them.
 *
 * Layout of a file (https://github.com/huggingface/safetensors):
 *   [8 bytes]  N, the header length, unsigned little-endian
 *   [N bytes]  a JSON object: {"__metadata__": {"k": "v", ...},
 *                              "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}}
 *              possibly padded with trailing spaces
 *   [rest]     the data; tensor bytes are [b, e) relative to the start of this section,
 *              row-major, little-endian
 *
 * Reading treats the file as untrusted: the header length is bounded by the file size and by
 * MAX_HEADER, the JSON is parsed strictly (json.c), every entry must have exactly the three
 * fields with the right types, offsets must lie inside the data section and not overlap, and
 * the byte length must equal numel * element size (computed without overflow). Anything else is
 * TD_ERR_FORMAT with the reason; a structurally valid file with a dtype this library does not
 * have (F16, BF16, I32, ...) is TD_ERR_DTYPE. Tensors are copied out of the buffer, so the buffer
 * can be freed right after parsing.
 *
 * Writing puts the header entries in the caller's order but lays the data out 8-byte elements
 * first, so every tensor starts aligned to its element size (the header is padded to 8 bytes).
 * A file is written to "<path>.tmp.<pid>" and renamed into place.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "modules_impl.h"

/* Same bound as the reference implementation (100 MB). */
#define MAX_HEADER ((uint64_t)100 * 1000 * 1000)

static bool host_is_little_endian(void) {
  const uint16_t one = 1;
  return *(const uint8_t *)&one == 1;
}

/* ---- dtypes ---- */

typedef struct dtype_info {
  const char *name;
  size_t size;
  bool supported;
  td_dtype dt;
} dtype_info;

static const dtype_info dtypes[] = {
    {"F32", 4, true, TD_DTYPE_F32},   {"F64", 8, true, TD_DTYPE_F64},
    {"I64", 8, true, TD_DTYPE_I64},   {"BOOL", 1, false, TD_DTYPE_F32},
    {"U8", 1, false, TD_DTYPE_F32},   {"I8", 1, false, TD_DTYPE_F32},
    {"F8_E5M2", 1, false, TD_DTYPE_F32}, {"F8_E4M3", 1, false, TD_DTYPE_F32},
    {"I16", 2, false, TD_DTYPE_F32},  {"U16", 2, false, TD_DTYPE_F32},
    {"F16", 2, false, TD_DTYPE_F32},  {"BF16", 2, false, TD_DTYPE_F32},
    {"I32", 4, false, TD_DTYPE_F32},  {"U32", 4, false, TD_DTYPE_F32},
    {"U64", 8, false, TD_DTYPE_F32},
};

static const dtype_info *dtype_lookup(const char *name) {
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
    if (strcmp(dtypes[i].name, name) == 0) return &dtypes[i];
  return NULL;
}

static const char *dtype_code(td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F32: return "F32";
    case TD_DTYPE_F64: return "F64";
    case TD_DTYPE_I64: return "I64";
    default: break; /* transport dtypes (tensor.h) are not saved yet */
  }
  return NULL;
}

/* ---- metadata ---- */

void td_safetensors_meta_init(td_safetensors_meta *m) {
  if (m) memset(m, 0, sizeof *m);
}

void td_safetensors_meta_fini(td_safetensors_meta *m) {
  if (!m) return;
  for (size_t i = 0; i < m->n; i++) {
    td__free(m->keys[i]);
    td__free(m->values[i]);
  }
  td__free(m->keys);
  td__free(m->values);
  memset(m, 0, sizeof *m);
}

const char *td_safetensors_meta_get(const td_safetensors_meta *m, const char *key) {
  if (!m || !key) return NULL;
  for (size_t i = 0; i < m->n; i++)
    if (strcmp(m->keys[i], key) == 0) return m->values[i];
  return NULL;
}

td_status td_safetensors_meta_set(td_safetensors_meta *m, const char *key, const char *value) {
  TD_CHECK_ARG(m && key && value, "td_safetensors_meta_set: NULL argument");
  char *v = td__strdup(value);
  if (!v) return td_set_error(TD_ERR_NOMEM, "td_safetensors_meta_set: out of memory");
  for (size_t i = 0; i < m->n; i++) {
    if (strcmp(m->keys[i], key) == 0) {
      td__free(m->values[i]);
      m->values[i] = v;
      return TD_OK;
    }
  }
  char *k = td__strdup(key);
  char **ks = td__realloc(m->keys, (m->n + 1) * sizeof *ks);
  if (ks) m->keys = ks;
  char **vs = ks ? td__realloc(m->values, (m->n + 1) * sizeof *vs) : NULL;
  if (vs) m->values = vs;
  if (!k || !ks || !vs) {
    td__free(k);
    td__free(v);
    return td_set_error(TD_ERR_NOMEM, "td_safetensors_meta_set: out of memory");
  }
  m->keys[m->n] = k;
  m->values[m->n] = v;
  m->n++;
  return TD_OK;
}

/* ---- parsing ---- */

typedef struct entry {
  const char *name; /* borrowed from the JSON tree */
  const dtype_info *dtype;
  int ndim;
  int64_t shape[TD_MAX_DIMS];
  uint64_t begin, end;
} entry;

/* bad formats a TD_ERR_FORMAT naming the tensor. */
#define BAD(...) td_set_error(TD_ERR_FORMAT, "safetensors: " __VA_ARGS__)

static td_status parse_entry(const char *name, const td__json *v, uint64_t data_len, entry *e) {
  if (v->type != TD__JSON_OBJECT) return BAD("entry \"%s\" is not an object", name);
  for (size_t i = 0; i < v->n; i++) {
    const char *k = v->keys[i];
    if (strcmp(k, "dtype") != 0 && strcmp(k, "shape") != 0 && strcmp(k, "data_offsets") != 0)
      return BAD("entry \"%s\" has an unknown field \"%.64s\"", name, k);
  }
  const td__json *dt = td__json_get(v, "dtype"), *shape = td__json_get(v, "shape");
  const td__json *offs = td__json_get(v, "data_offsets");
  if (!dt || !shape || !offs)
    return BAD("entry \"%s\" lacks %s", name, !dt ? "\"dtype\"" : !shape ? "\"shape\""
                                                                        : "\"data_offsets\"");
  if (dt->type != TD__JSON_STRING) return BAD("entry \"%s\": dtype is not a string", name);
  e->name = name;
  e->dtype = dtype_lookup(dt->str);
  if (!e->dtype) return BAD("entry \"%s\": unknown dtype \"%.32s\"", name, dt->str);
  if (shape->type != TD__JSON_ARRAY) return BAD("entry \"%s\": shape is not an array", name);
  if (shape->n > TD_MAX_DIMS)
    return td_set_error(TD_ERR_UNSUPPORTED, "safetensors: entry \"%s\" has %zu dims (at most %d "
                        "supported)", name, shape->n, TD_MAX_DIMS);
  e->ndim = (int)shape->n;
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape->n; i++) {
    const td__json *d = &shape->items[i];
    if (d->type != TD__JSON_NUMBER || !d->is_uint || d->u > (uint64_t)INT64_MAX)
      return BAD("entry \"%s\": shape[%zu] is not a non-negative integer", name, i);
    e->shape[i] = (int64_t)d->u;
    if (__builtin_mul_overflow(numel, d->u, &numel)) overflow = true;
  }
  uint64_t nbytes = 0;
  if (overflow || __builtin_mul_overflow(numel, (uint64_t)e->dtype->size, &nbytes))
    return BAD("entry \"%s\": shape is too large", name);
  if (offs->type != TD__JSON_ARRAY || offs->n != 2)
    return BAD("entry \"%s\": data_offsets is not a [begin, end] pair", name);
  for (int i = 0; i < 2; i++)
    if (offs->items[i].type != TD__JSON_NUMBER || !offs->items[i].is_uint)
      return BAD("entry \"%s\": data_offsets[%d] is not a non-negative integer", name, i);
  e->begin = offs->items[0].u;
  e->end = offs->items[1].u;
  if (e->begin > e->end)
    return BAD("entry \"%s\": data_offsets [%llu, %llu] are reversed", name,
               (unsigned long long)e->begin, (unsigned long long)e->end);
  if (e->end > data_len)
    return BAD("entry \"%s\": data_offsets [%llu, %llu] run past the end of the data (%llu "
               "bytes)", name, (unsigned long long)e->begin, (unsigned long long)e->end,
               (unsigned long long)data_len);
  if (e->end - e->begin != nbytes)
    return BAD("entry \"%s\": %llu bytes for shape of %llu %s elements (%llu bytes expected)",
               name, (unsigned long long)(e->end - e->begin), (unsigned long long)numel,
               e->dtype->name, (unsigned long long)nbytes);
  return TD_OK;
}

static int cmp_begin(const void *a, const void *b) {
  const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static td_status parse_meta(const td__json *v, td_safetensors_meta *out) {
  if (v->type != TD__JSON_OBJECT) return BAD("__metadata__ is not an object");
  for (size_t i = 0; i < v->n; i++) {
    const td__json *s = &v->items[i];
    if (s->type != TD__JSON_STRING)
      return BAD("__metadata__ value of \"%.64s\" is not a string", v->keys[i]);
    if (strlen(v->keys[i]) != v->key_lens[i] || strlen(s->str) != s->len)
      return BAD("__metadata__ entry \"%.64s\" contains a NUL character", v->keys[i]);
    if (out) TD_TRY(td_safetensors_meta_set(out, v->keys[i], s->str));
  }
  return TD_OK;
}

/* move_list appends every entry of src to dst, or nothing on failure. */
static td_status move_list(td_tensor_list *src, td_tensor_list *dst) {
  size_t before = dst->n;
  td_status st = TD_OK;
  for (size_t i = 0; i < src->n && st == TD_OK; i++)
    st = td_tensor_list_append(dst, src->names[i], src->tensors[i]);
  while (st != TD_OK && dst->n > before) {
    dst->n--;
    td_tensor_unref(dst->tensors[dst->n]);
    td__free(dst->names[dst->n]);
  }
  return st;
}

td_status td_safetensors_parse(const void *buf, size_t len, td_tensor_list *tensors,
                               td_safetensors_meta *meta) {
  TD_CHECK_ARG(buf || len == 0, "td_safetensors_parse: NULL buffer");
  TD_CHECK_ARG(tensors, "td_safetensors_parse: NULL tensor list");
  if (!host_is_little_endian())
    return td_set_error(TD_ERR_UNSUPPORTED, "safetensors: big-endian hosts are not supported");
  const uint8_t *b = buf;
  if (len < 8) return BAD("%zu bytes is too short for the 8-byte header length", len);
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
  if (hlen > len - 8)
    return BAD("header length %llu exceeds the %zu bytes that follow it",
               (unsigned long long)hlen, len - 8);
  if (hlen > MAX_HEADER)
    return BAD("header length %llu exceeds the limit of %llu bytes", (unsigned long long)hlen,
               (unsigned long long)MAX_HEADER);
  if (hlen < 2 || b[8] != '{') return BAD("header does not start with a JSON object");
  const char *header = (const char *)b + 8;
  const uint8_t *data = b + 8 + hlen;
  uint64_t data_len = (uint64_t)(len - 8 - hlen);

  td__json *root = NULL;
  td_status st = td__json_parse(header, (size_t)hlen, &root);
  if (st != TD_OK) {
    return st == TD_ERR_FORMAT ? td__error_prefix(st, "safetensors") : st;
  }
  entry *entries = NULL, **order = NULL;
  td_safetensors_meta meta_tmp;
  td_safetensors_meta_init(&meta_tmp);
  td_tensor_list tmp;
  td_tensor_list_init(&tmp);
  size_t n = 0;
  bool unsupported = false;
  const char *unsupported_name = NULL, *unsupported_dtype = NULL;
  if (root->type != TD__JSON_OBJECT) {
    st = BAD("header is not a JSON object");
    goto out;
  }
  entries = td__calloc(root->n, sizeof *entries);
  order = td__calloc(root->n, sizeof *order);
  if (!entries || !order) {
    st = td_set_error(TD_ERR_NOMEM, "safetensors: out of memory");
    goto out;
  }
  for (size_t i = 0; i < root->n; i++) {
    const char *key = root->keys[i];
    if (strlen(key) != root->key_lens[i]) {
      st = BAD("a tensor name contains a NUL character");
      goto out;
    }
    if (strcmp(key, "__metadata__") == 0) {
      st = parse_meta(&root->items[i], meta ? &meta_tmp : NULL);
      if (st != TD_OK) goto out;
      continue;
    }
    st = parse_entry(key, &root->items[i], data_len, &entries[n]);
    if (st != TD_OK) goto out;
    if (!entries[n].dtype->supported && !unsupported) {
      unsupported = true;
      unsupported_name = key;
      unsupported_dtype = entries[n].dtype->name;
    }
    order[n] = &entries[n];
    n++;
  }
  qsort(order, n, sizeof *order, cmp_begin);
  for (size_t i = 1; i < n; i++) {
    if (order[i]->begin < order[i - 1]->end) {
      st = BAD("tensors \"%s\" [%llu, %llu) and \"%s\" [%llu, %llu) overlap", order[i - 1]->name,
               (unsigned long long)order[i - 1]->begin, (unsigned long long)order[i - 1]->end,
               order[i]->name, (unsigned long long)order[i]->begin,
               (unsigned long long)order[i]->end);
      goto out;
    }
  }
  if (unsupported) {
    st = td_set_error(TD_ERR_DTYPE, "safetensors: tensor \"%s\" has dtype %s; only F32, F64 and "
                      "I64 are supported", unsupported_name, unsupported_dtype);
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const entry *e = &entries[i];
    td_tensor *t = NULL;
    st = td_tensor_from_buffer(data + e->begin, e->shape, e->ndim, e->dtype->dt, &t);
    if (st == TD_OK) st = td_tensor_list_append(&tmp, e->name, t);
    td_tensor_unref(t);
    if (st != TD_OK) goto out;
  }
  st = move_list(&tmp, tensors);
  if (st == TD_OK && meta) {
    for (size_t i = 0; i < meta_tmp.n && st == TD_OK; i++)
      st = td_safetensors_meta_set(meta, meta_tmp.keys[i], meta_tmp.values[i]);
  }
out:
  td_tensor_list_fini(&tmp);
  td_safetensors_meta_fini(&meta_tmp);
  td__free(entries);
  td__free(order);
  td__json_free(root);
  return st;
}

/* ---- serialising ---- */

td_status td_safetensors_serialize(const td_tensor_list *tensors, const td_safetensors_meta *meta,
                                   void **buf, size_t *len) {
  TD_CHECK_ARG(tensors && buf && len, "td_safetensors_serialize: NULL argument");
  if (!host_is_little_endian())
    return td_set_error(TD_ERR_UNSUPPORTED, "safetensors: big-endian hosts are not supported");
  size_t n = tensors->n;
  for (size_t i = 0; i < n; i++) {
    const char *name = tensors->names ? tensors->names[i] : NULL;
    TD_CHECK_ARG(name && name[0], "td_safetensors_serialize: tensor %zu has no name", i);
    TD_CHECK_ARG(strcmp(name, "__metadata__") != 0,
                 "td_safetensors_serialize: \"__metadata__\" is reserved");
    TD_CHECK_ARG(tensors->tensors[i], "td_safetensors_serialize: tensor \"%s\" is NULL", name);
    for (size_t j = 0; j < i; j++)
      TD_CHECK_ARG(strcmp(tensors->names[j], name) != 0,
                   "td_safetensors_serialize: duplicate name \"%s\"", name);
    if (!dtype_code(td_tensor_dtype(tensors->tensors[i])))
      return td_set_error(TD_ERR_DTYPE, "td_safetensors_serialize: tensor \"%s\" has an unknown "
                          "dtype", name);
  }
  /* data layout: 8-byte elements first, then 4-byte ones, each group in list order */
  uint64_t *begin = td__calloc(n ? n : 1, sizeof *begin);
  if (!begin) return td_set_error(TD_ERR_NOMEM, "td_safetensors_serialize: out of memory");
  uint64_t data_len = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < n; i++) {
      size_t es = td_dtype_size(td_tensor_dtype(tensors->tensors[i]));
      if ((pass == 0) != (es == 8)) continue;
      begin[i] = data_len;
      data_len += td_tensor_nbytes(tensors->tensors[i]);
    }
  }
  td__json_buf h = {0};
  td__json_buf_append(&h, "{", 1);
  bool first = true;
  if (meta && meta->n) {
    td__json_buf_string(&h, "__metadata__", 12);
    td__json_buf_append(&h, ":{", 2);
    for (size_t i = 0; i < meta->n; i++) {
      if (i) td__json_buf_append(&h, ",", 1);
      td__json_buf_string(&h, meta->keys[i], strlen(meta->keys[i]));
      td__json_buf_append(&h, ":", 1);
      td__json_buf_string(&h, meta->values[i], strlen(meta->values[i]));
    }
    td__json_buf_append(&h, "}", 1);
    first = false;
  }
  for (size_t i = 0; i < n; i++) {
    const td_tensor *t = tensors->tensors[i];
    if (!first) td__json_buf_append(&h, ",", 1);
    first = false;
    td__json_buf_string(&h, tensors->names[i], strlen(tensors->names[i]));
    td__json_buf_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", dtype_code(td_tensor_dtype(t)));
    for (int d = 0; d < td_tensor_ndim(t); d++)
      td__json_buf_printf(&h, "%s%lld", d ? "," : "", (long long)td_tensor_shape(t)[d]);
    td__json_buf_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)begin[i],
                        (unsigned long long)(begin[i] + td_tensor_nbytes(t)));
  }
  td__json_buf_append(&h, "}", 1);
  while (!h.failed && h.len % 8 != 0) td__json_buf_append(&h, " ", 1);
  td_status st = TD_OK;
  uint8_t *out = NULL;
  if (h.failed) {
    st = td_set_error(TD_ERR_NOMEM, "td_safetensors_serialize: out of memory");
    goto out;
  }
  size_t total = 8 + h.len + (size_t)data_len;
  out = td__malloc(total);
  if (!out) {
    st = td_set_error(TD_ERR_NOMEM, "td_safetensors_serialize: out of memory (%zu bytes)", total);
    goto out;
  }
  uint64_t hl = h.len;
  for (int i = 0; i < 8; i++) out[i] = (uint8_t)(hl >> (8 * i));
  memcpy(out + 8, h.data, h.len);
  uint8_t *data = out + 8 + h.len;
  for (size_t i = 0; i < n; i++) {
    const td_tensor *t = tensors->tensors[i];
    size_t nb = td_tensor_nbytes(t);
    if (nb == 0) continue;
    st = td_tensor_copy_to_buffer(t, data + begin[i], nb);
    if (st != TD_OK) goto out;
  }
  *buf = out;
  *len = total;
  out = NULL;
out:
  td__free(out);
  td__free(h.data);
  td__free(begin);
  return st;
}

/* ---- files ---- */

td_status td_safetensors_write(const char *path, const td_tensor_list *tensors,
                               const td_safetensors_meta *meta) {
  TD_CHECK_ARG(path && path[0], "td_safetensors_write: NULL or empty path");
  void *buf = NULL;
  size_t len = 0;
  TD_TRY(td_safetensors_serialize(tensors, meta, &buf, &len));
  size_t plen = strlen(path) + 32;
  char *tmp = td__malloc(plen);
  if (!tmp) {
    td__free(buf);
    return td_set_error(TD_ERR_NOMEM, "td_safetensors_write: out of memory");
  }
  snprintf(tmp, plen, "%s.tmp.%ld", path, (long)getpid());
  td_status st = TD_OK;
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    st = td_set_error(TD_ERR_IO, "safetensors: cannot create %s: %s", tmp, strerror(errno));
    goto out;
  }
  size_t w = fwrite(buf, 1, len, f);
  int werr = errno;
  int cerr = fclose(f);
  if (w != len || cerr != 0) {
    st = td_set_error(TD_ERR_IO, "safetensors: cannot write %s: %s", tmp,
                      strerror(w != len ? werr : errno));
    remove(tmp);
    goto out;
  }
  if (rename(tmp, path) != 0) {
    st = td_set_error(TD_ERR_IO, "safetensors: cannot rename %s to %s: %s", tmp, path,
                      strerror(errno));
    remove(tmp);
  }
out:
  td__free(tmp);
  td__free(buf);
  return st;
}

td_status td_safetensors_read(const char *path, td_tensor_list *tensors,
                              td_safetensors_meta *meta) {
  TD_CHECK_ARG(path && tensors, "td_safetensors_read: NULL path or list");
  FILE *f = fopen(path, "rb");
  if (!f) return td_set_error(TD_ERR_IO, "safetensors: cannot open %s: %s", path, strerror(errno));
  td_status st = TD_OK;
  uint8_t *buf = NULL;
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0) {
    st = td_set_error(TD_ERR_IO, "safetensors: cannot stat %s: %s", path, strerror(errno));
    goto out;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = td_set_error(TD_ERR_IO, "safetensors: %s is not a regular file", path);
    goto out;
  }
  off_t size = sb.st_size;
  buf = td__malloc((size_t)size);
  if (!buf) {
    st = td_set_error(TD_ERR_NOMEM, "safetensors: cannot allocate %lld bytes for %s",
                      (long long)size, path);
    goto out;
  }
  if (size > 0 && fread(buf, 1, (size_t)size, f) != (size_t)size) {
    st = td_set_error(TD_ERR_IO, "safetensors: short read from %s", path);
    goto out;
  }
  st = td_safetensors_parse(buf, (size_t)size, tensors, meta);
  if (st != TD_OK) td__error_prefix(st, "%s", path);
out:
  fclose(f);
  td__free(buf);
  return st;
}

/* ---- modules ---- */

td_status td_module_save(td_module *m, const char *path) {
  TD_CHECK_ARG(m && path, "td_module_save: NULL module or path");
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  td_status st = td_module_state_dict(m, &sd);
  if (st == TD_OK) st = td_safetensors_meta_set(&meta, "format", "pt");
  if (st == TD_OK) st = td_safetensors_meta_set(&meta, "tdist.module", td_module_type_name(m));
  if (st == TD_OK) st = td_safetensors_write(path, &sd, &meta);
  td_safetensors_meta_fini(&meta);
  td_tensor_list_fini(&sd);
  return st;
}

td_status td_module_load(td_module *m, const char *path) {
  TD_CHECK_ARG(m && path, "td_module_load: NULL module or path");
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  td_status st = td_safetensors_read(path, &sd, NULL);
  if (st == TD_OK) st = td_module_load_state_dict(m, &sd, true);
  td_tensor_list_fini(&sd);
  return st;
}
