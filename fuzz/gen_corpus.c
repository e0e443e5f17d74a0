/* gen_corpus.c - writes the seed corpus of fuzz_wire_decoder: a few valid frames made by the real
 * encoder (every value kind, nested containers, tensors of each dtype including 0-d and 0-byte
 * ones, an extension value, an error reply, a hashed dict, a tree one level deeper than the
 * decoder accepts, frames back to back, a tensor marked for a CUDA device by a device map).
 *
 * Usage: gen_corpus OUTDIR. Each seed is one selector byte (where the fuzzer splits the stream)
 * followed by whole frames. Built and run at build time, so the seeds follow the wire format.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

typedef struct {
  uint8_t *p;
  size_t n, cap;
} buf;

static void die(const char *what) {
  fprintf(stderr, "gen_corpus: %s: %s\n", what, td_last_error());
  exit(1);
}

static void put(buf *b, const void *p, size_t n) {
  if (b->n + n > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n) cap *= 2;
    uint8_t *q = realloc(b->p, cap);
    if (!q) die("out of memory");
    b->p = q;
    b->cap = cap;
  }
  if (n) memcpy(b->p + b->n, p, n);
  b->n += n;
}

/* put_msg_map appends the frame of a message carrying values (references taken over), encoded
 * with device map map (NULL: none). */
static void put_msg_map(buf *b, uint64_t id, int kind, const char *fn, td_value **values, int n,
                        const td__devmap *map) {
  td__msg m = {0};
  m.id = id;
  m.kind = kind;
  m.fn = (char *)fn;
  m.from_rank = 1;
  m.values = values;
  m.nvalues = n;
  m.timeout_ms = 5000;
  m.ctx_id = 7;
  m.autograd_msg_id = 9;
  if (kind == TD__MSG_ERROR) {
    m.status = TD_ERR_INVALID;
    m.message = (char *)"worker1 (rank 1): bad argument";
  }
  td__wire_ctx ctx = {NULL, 1, 0, map, "worker1"};
  td__frame f;
  if (td__wire_encode(&m, &ctx, &f) != TD_OK) die("encode");
  put(b, f.head, f.head_len);
  for (int i = 0; i < f.ntensors; i++)
    put(b, td_tensor_data(f.tensors[i]), td_tensor_nbytes(f.tensors[i]));
  td__frame_clear(&f);
  for (int i = 0; i < n; i++) td_value_unref(values[i]);
}

static void put_msg(buf *b, uint64_t id, int kind, const char *fn, td_value **values, int n) {
  put_msg_map(b, id, kind, fn, values, n, NULL);
}

static td_value *tensor_value(td_dtype dt, const int64_t *shape, int ndim) {
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) numel *= shape[i];
  td_tensor *t = NULL, *r = NULL;
  if (td_tensor_arange(0, (double)numel, 1, dt, td_device_cpu(), &t) != TD_OK) die("arange");
  if (td_tensor_reshape(t, shape, ndim, &r) != TD_OK) die("reshape");
  td_tensor_unref(t);
  td_value *v = td_value_tensor(r);
  td_tensor_unref(r);
  return v;
}

static void add(td_value *list, td_value *item) {
  if (td_value_list_append(list, item) != TD_OK) die("append");
}

static void set(td_value *dict, const char *key, td_value *item) {
  if (td_value_dict_set(dict, key, item) != TD_OK) die("dict_set");
}

static void write_seed(const char *dir, int k, uint8_t selector, const buf *b) {
  char path[4096];
  snprintf(path, sizeof path, "%s/seed_%02d", dir, k);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(&selector, 1, 1, f) != 1 || fwrite(b->p, 1, b->n, f) != b->n || fclose(f))
    die(path);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: gen_corpus OUTDIR\n");
    return 2;
  }
  if (td__value_ext_register(&fuzz_box_type) != TD_OK) die("register");
  const char *dir = argv[1];
  int k = 0;
  buf all = {0};

  /* 1: scalars of every kind. */
  {
    buf b = {0};
    td_value *v[] = {td_value_none(), td_value_bool(true), td_value_int(-3),
                     td_value_double(2.5), td_value_string("hi"), td_value_bytes("\0\1", 2)};
    put_msg(&b, 1, TD__MSG_REQUEST, "echo", v, 6);
    write_seed(dir, k++, 0, &b);
    put(&all, b.p, b.n);
    free(b.p);
  }
  /* 2: nested containers with tensors of each dtype, a 0-d and a 0-byte tensor. */
  {
    buf b = {0};
    td_value *l = td_value_list(), *d = td_value_dict(), *inner = td_value_list();
    int64_t s23[] = {2, 3}, s0[] = {0}, s3[] = {3};
    add(inner, tensor_value(TD_DTYPE_I64, s3, 1));
    add(inner, td_value_dict());
    add(inner, td_value_list());
    set(d, "w", tensor_value(TD_DTYPE_F32, s23, 2));
    set(d, "empty", tensor_value(TD_DTYPE_F64, s0, 1));
    set(d, "", inner);
    add(l, d);
    add(l, tensor_value(TD_DTYPE_F64, NULL, 0));
    td_value *v[] = {l, td_value_int(4)};
    put_msg(&b, 2, TD__MSG_REQUEST, "train_step", v, 2);
    write_seed(dir, k++, 128, &b);
    put(&all, b.p, b.n);
    free(b.p);
  }
  /* 3: a response holding an extension value around a dict. */
  {
    buf b = {0};
    td_value *repr = td_value_dict();
    set(repr, "owner", td_value_int(1));
    set(repr, "id", td_value_int(42));
    td_value *box = td__value_ext(&fuzz_box_type, repr);
    if (!box) die("ext");
    td_value *l = td_value_list();
    add(l, box);
    td_value *v[] = {l};
    put_msg(&b, 3, TD__MSG_RESPONSE, "", v, 1);
    write_seed(dir, k++, 200, &b);
    put(&all, b.p, b.n);
    free(b.p);
  }
  /* 4: an error reply. */
  {
    buf b = {0};
    put_msg(&b, 4, TD__MSG_ERROR, "", NULL, 0);
    write_seed(dir, k++, 30, &b);
    put(&all, b.p, b.n);
    free(b.p);
  }
  /* 5: every frame above back to back, split near the middle. */
  write_seed(dir, k++, 127, &all);
  free(all.p);
  /* 6: a dict big enough to be hashed, with a string holding NUL bytes and a -0.0. */
  {
    buf b = {0};
    td_value *d = td_value_dict();
    for (int i = 0; i < 12; i++) {
      char key[8];
      snprintf(key, sizeof key, "k%d", i);
      set(d, key, td_value_int(i));
    }
    set(d, "nul", td_value_string_n("a\0b", 3));
    set(d, "negzero", td_value_double(-0.0));
    td_value *v[] = {d};
    put_msg(&b, 6, TD__MSG_REQUEST, "dict", v, 1);
    write_seed(dir, k++, 64, &b);
    free(b.p);
  }
  /* 7: lists nested TD__MAX_DEPTH + 1 deep (refused), then a good frame. */
  {
    buf b = {0};
    td_value *v = td_value_none();
    for (int i = 0; i <= TD__MAX_DEPTH; i++) {
      td_value *l = td_value_list();
      add(l, v);
      v = l;
    }
    td_value *deep[] = {v};
    put_msg(&b, 7, TD__MSG_REQUEST, "deep", deep, 1);
    td_value *next[] = {td_value_int(8)};
    put_msg(&b, 8, TD__MSG_REQUEST, "next", next, 1);
    write_seed(dir, k++, 250, &b);
    free(b.p);
  }
  /* 8: a tensor marked for cuda:0 by a device map (refused where there is no such device), a
   * CPU tensor beside it, then a good frame. */
  {
    buf b = {0};
    td__devmap_entry e[] = {{td_device_cpu(), td_device_cuda(0)}};
    td__devmap map = {e, 1};
    int64_t s4[] = {4};
    td_value *l = td_value_list();
    add(l, tensor_value(TD_DTYPE_F32, s4, 1));
    add(l, td_value_string("x"));
    td_value *v[] = {l};
    put_msg_map(&b, 9, TD__MSG_REQUEST, "to_gpu", v, 1, &map);
    td_value *next[] = {tensor_value(TD_DTYPE_I64, s4, 1)};
    put_msg(&b, 10, TD__MSG_RESPONSE, "", next, 1);
    write_seed(dir, k++, 90, &b);
    free(b.p);
  }
  printf("gen_corpus: %d seeds in %s\n", k, dir);
  return 0;
}
