/* test_safetensors.c - safetensors encoding and decoding, a file written by Python, corrupt
 * inputs (each must give TD_ERR_FORMAT, never a crash), and module save/load with strict key,
 * shape and dtype checks. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fixture.h"
#include "tdist/nn.h"
#include "test_util.h"

static char tmpdir[256];

static int setup_dir(void **state) {
  (void)state;
  snprintf(tmpdir, sizeof tmpdir, "/tmp/td_safetensors_XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_dir(void **state) {
  (void)state;
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

static const char *tmp_path(const char *name, char *buf, size_t n) {
  snprintf(buf, n, "%s/%s", tmpdir, name);
  return buf;
}

/* make_file builds "<8-byte len><header><data_len zero bytes>" in a new buffer. */
static uint8_t *make_file(const char *header, size_t data_len, size_t *len) {
  size_t h = strlen(header);
  *len = 8 + h + data_len;
  uint8_t *b = calloc(1, *len);
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> (8 * i));
  memcpy(b + 8, header, h);
  return b;
}

static td_status parse_buf(const void *buf, size_t len) {
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  td_status st = td_safetensors_parse(buf, len, &l, &meta);
  if (st != TD_OK) {
    assert_int_equal(l.n, 0); /* untouched on failure */
    assert_int_equal(meta.n, 0);
  }
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&meta);
  return st;
}

static td_status parse_header(const char *header, size_t data_len) {
  size_t len;
  uint8_t *b = make_file(header, data_len, &len);
  td_status st = parse_buf(b, len);
  free(b);
  return st;
}

/* sample_list fills l with tensors of every dtype, a scalar, an empty and a strided view. */
static void sample_list(td_tensor_list *l) {
  td_tensor_list_init(l);
  td_tensor *a = td_test_randn((int64_t[]){3, 4}, 2, TD_DTYPE_F32, 1, false);
  td_tensor *b = td_test_randn((int64_t[]){5}, 1, TD_DTYPE_F64, 2, false);
  int64_t iv[] = {-3, 0, 1ll << 50};
  td_tensor *c = NULL, *s = NULL, *e = NULL, *tr = NULL;
  TD_ASSERT_OK(td_tensor_from_buffer(iv, (int64_t[]){3}, 1, TD_DTYPE_I64, &c));
  TD_ASSERT_OK(td_tensor_scalar(2.5, TD_DTYPE_F64, td_device_cpu(), &s));
  TD_ASSERT_OK(td_tensor_zeros((int64_t[]){0, 2}, 2, TD_DTYPE_F32, td_device_cpu(), &e));
  TD_ASSERT_OK(td_tensor_transpose(a, 0, 1, &tr));
  TD_ASSERT_OK(td_tensor_list_append(l, "layer.a", a));
  TD_ASSERT_OK(td_tensor_list_append(l, "b", b));
  TD_ASSERT_OK(td_tensor_list_append(l, "ints", c));
  TD_ASSERT_OK(td_tensor_list_append(l, "scalar", s));
  TD_ASSERT_OK(td_tensor_list_append(l, "empty", e));
  TD_ASSERT_OK(td_tensor_list_append(l, "transposed \"view\"\n", tr));
  td_tensor_unref(a);
  td_tensor_unref(b);
  td_tensor_unref(c);
  td_tensor_unref(s);
  td_tensor_unref(e);
  td_tensor_unref(tr);
}

static void assert_lists_equal(const td_tensor_list *a, const td_tensor_list *b) {
  assert_int_equal(a->n, b->n);
  for (size_t i = 0; i < a->n; i++) {
    assert_string_equal(a->names[i], b->names[i]);
    assert_int_equal(td_tensor_dtype(a->tensors[i]), td_tensor_dtype(b->tensors[i]));
    td_test_assert_close(a->names[i], a->tensors[i], b->tensors[i], 0, 0);
  }
}

static void test_safetensors_round_trip(void **state) {
  (void)state;
  td_tensor_list l, back;
  sample_list(&l);
  td_safetensors_meta meta, meta_back;
  td_safetensors_meta_init(&meta);
  TD_ASSERT_OK(td_safetensors_meta_set(&meta, "format", "pt"));
  TD_ASSERT_OK(td_safetensors_meta_set(&meta, "note", "quote \" backslash \\ tab \t é"));
  TD_ASSERT_OK(td_safetensors_meta_set(&meta, "format", "pt2")); /* replaces */
  assert_int_equal(meta.n, 2);

  void *buf = NULL;
  size_t len = 0;
  TD_ASSERT_OK(td_safetensors_serialize(&l, &meta, &buf, &len));
  const uint8_t *b = buf;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
  assert_int_equal(hlen % 8, 0); /* header padded so the data is aligned */
  assert_int_equal(b[8], '{');

  td_tensor_list_init(&back);
  td_safetensors_meta_init(&meta_back);
  TD_ASSERT_OK(td_safetensors_parse(buf, len, &back, &meta_back));
  assert_lists_equal(&l, &back);
  assert_string_equal(td_safetensors_meta_get(&meta_back, "format"), "pt2");
  assert_string_equal(td_safetensors_meta_get(&meta_back, "note"),
                      "quote \" backslash \\ tab \t é");
  assert_null(td_safetensors_meta_get(&meta_back, "missing"));
  assert_int_equal(td_tensor_ndim(td_tensor_list_find(&back, "scalar")), 0);
  td_tensor_list_fini(&back);
  td_safetensors_meta_fini(&meta_back);
  free(buf);

  /* through a file, appending to a non-empty list */
  char path[512];
  tmp_path("round.safetensors", path, sizeof path);
  TD_ASSERT_OK(td_safetensors_write(path, &l, NULL));
  td_tensor_list_init(&back);
  td_tensor *first = td_test_randn((int64_t[]){1}, 1, TD_DTYPE_F32, 3, false);
  TD_ASSERT_OK(td_tensor_list_append(&back, "already", first));
  TD_ASSERT_OK(td_safetensors_read(path, &back, NULL));
  assert_int_equal(back.n, l.n + 1);
  assert_string_equal(back.names[0], "already");
  for (size_t i = 0; i < l.n; i++) {
    assert_string_equal(back.names[i + 1], l.names[i]);
    td_test_assert_close(l.names[i], back.tensors[i + 1], l.tensors[i], 0, 0);
  }
  char tmpname[600];
  snprintf(tmpname, sizeof tmpname, "%s.tmp.%ld", path, (long)getpid());
  struct stat sb;
  assert_int_not_equal(stat(tmpname, &sb), 0); /* no temporary left behind */
  td_tensor_unref(first);
  td_tensor_list_fini(&back);

  /* empty list */
  td_tensor_list empty;
  td_tensor_list_init(&empty);
  TD_ASSERT_OK(td_safetensors_serialize(&empty, NULL, &buf, &len));
  TD_ASSERT_OK(td_safetensors_parse(buf, len, &empty, NULL));
  assert_int_equal(empty.n, 0);
  free(buf);

  td_safetensors_meta_fini(&meta);
  td_tensor_list_fini(&l);
}

static void test_safetensors_serialize_misuse(void **state) {
  (void)state;
  td_tensor_list l;
  td_tensor_list_init(&l);
  td_tensor *t = td_test_randn((int64_t[]){2}, 1, TD_DTYPE_F32, 1, false);
  void *buf = NULL;
  size_t len = 0;
  TD_ASSERT_OK(td_tensor_list_append(&l, NULL, t));
  TD_ASSERT_STATUS(td_safetensors_serialize(&l, NULL, &buf, &len), TD_ERR_INVALID);
  td_tensor_list_fini(&l);
  TD_ASSERT_OK(td_tensor_list_append(&l, "x", t));
  TD_ASSERT_OK(td_tensor_list_append(&l, "x", t));
  TD_ASSERT_STATUS(td_safetensors_serialize(&l, NULL, &buf, &len), TD_ERR_INVALID);
  td_tensor_list_fini(&l);
  TD_ASSERT_OK(td_tensor_list_append(&l, "__metadata__", t));
  TD_ASSERT_STATUS(td_safetensors_serialize(&l, NULL, &buf, &len), TD_ERR_INVALID);
  td_tensor_list_fini(&l);
  TD_ASSERT_STATUS(td_safetensors_write("/nonexistent-dir/x.safetensors", &l, NULL), TD_ERR_IO);
  TD_ASSERT_STATUS(td_safetensors_read("/nonexistent-dir/x.safetensors", &l, NULL), TD_ERR_IO);
  assert_non_null(strstr(td_last_error(), "/nonexistent-dir/x.safetensors"));
  TD_ASSERT_STATUS(td_safetensors_read(tmpdir, &l, NULL), TD_ERR_IO); /* a directory */
  assert_int_equal(l.n, 0);
  assert_null(buf);
  td_tensor_unref(t);
}

static void test_safetensors_python_file(void **state) {
  (void)state;
  td_tensor_list l;
  td_safetensors_meta meta;
  fixture_load("py_written", &l, &meta);
  const char *names[] = {"b", "a", "c", "scalar", "empty", "name with \"quotes\" and \xc3\xa9"};
  assert_int_equal(l.n, 6);
  for (int i = 0; i < 6; i++) assert_string_equal(l.names[i], names[i]);
  assert_string_equal(td_safetensors_meta_get(&meta, "format"), "pt");
  assert_string_equal(td_safetensors_meta_get(&meta, "creator"), "gen_fixtures.py");

  double bv[] = {0.5, -1.25, 3.0, 1e-300};
  td_tensor *e = td_test_tensor(bv, (int64_t[]){4}, 1, TD_DTYPE_F64, false);
  td_test_assert_close("b", fixture_get(&l, "b"), e, 0, 0);
  assert_int_equal(td_tensor_dtype(fixture_get(&l, "b")), TD_DTYPE_F64);
  td_tensor_unref(e);
  double av[] = {0, 0.25, 0.5, 0.75, 1.0, 1.25};
  e = td_test_tensor(av, (int64_t[]){2, 3}, 2, TD_DTYPE_F32, false);
  td_test_assert_close("a", fixture_get(&l, "a"), e, 0, 0);
  assert_int_equal(td_tensor_dtype(fixture_get(&l, "a")), TD_DTYPE_F32);
  td_tensor_unref(e);
  int64_t cv[3];
  td_tensor *c = fixture_get(&l, "c");
  assert_int_equal(td_tensor_dtype(c), TD_DTYPE_I64);
  TD_ASSERT_OK(td_tensor_copy_to_buffer(c, cv, sizeof cv));
  assert_int_equal(cv[0], -1);
  assert_int_equal(cv[1], 0);
  assert_int_equal(cv[2], 1ll << 40);
  double sv;
  TD_ASSERT_OK(td_tensor_item(fixture_get(&l, "scalar"), &sv));
  assert_true(sv == 3.5);
  assert_int_equal(td_tensor_ndim(fixture_get(&l, "scalar")), 0);
  assert_int_equal(td_tensor_numel(fixture_get(&l, "empty")), 0);
  assert_int_equal(td_tensor_size(fixture_get(&l, "empty"), 1), 3);
  TD_ASSERT_OK(td_tensor_item(fixture_get(&l, names[5]), &sv));
  assert_true(sv == 7.0);
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&meta);
}

#define ENTRY(name, dtype, shape, b, e) \
  "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" b "," e "]}"

static void test_safetensors_corrupt_headers(void **state) {
  (void)state;
  struct {
    const char *header;
    size_t data;
    td_status want;
    const char *why;
  } cases[] = {
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "}", 8, TD_OK, "control"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "}    ", 8, TD_OK, "padding spaces"},
      {"{}", 0, TD_OK, "empty object"},
      {"{\"__metadata__\":{\"k\":\"v\"}}", 0, TD_OK, "metadata only"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "}", 4, TD_ERR_FORMAT, "offsets past the end"},
      {"{" ENTRY("a", "F32", "[2]", "8", "16") "}", 12, TD_ERR_FORMAT, "offsets past the end 2"},
      {"{" ENTRY("a", "F32", "[2]", "8", "0") "}", 8, TD_ERR_FORMAT, "reversed offsets"},
      {"{" ENTRY("a", "F32", "[3]", "0", "8") "}", 8, TD_ERR_FORMAT, "shape vs bytes"},
      {"{" ENTRY("a", "F64", "[2]", "0", "8") "}", 8, TD_ERR_FORMAT, "dtype size vs bytes"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "," ENTRY("b", "F32", "[2]", "4", "12") "}", 12,
       TD_ERR_FORMAT, "overlapping"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "," ENTRY("b", "F32", "[2]", "0", "8") "}", 8,
       TD_ERR_FORMAT, "identical ranges"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "," ENTRY("b", "F32", "[0]", "4", "4") "}", 8,
       TD_ERR_FORMAT, "empty tensor inside another's range"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "," ENTRY("b", "F32", "[0]", "8", "8") "}", 8,
       TD_OK, "empty tensor at the end"},
      {"{" ENTRY("a", "X99", "[2]", "0", "8") "}", 8, TD_ERR_FORMAT, "unknown dtype"},
      {"{" ENTRY("a", "F16", "[4]", "0", "8") "}", 8, TD_ERR_DTYPE, "unsupported dtype"},
      {"{" ENTRY("a", "F16", "[3]", "0", "8") "}", 8, TD_ERR_FORMAT, "F16 with bad size"},
      {"{" ENTRY("a", "F32", "[-2]", "0", "8") "}", 8, TD_ERR_FORMAT, "negative dim"},
      {"{" ENTRY("a", "F32", "[2.0]", "0", "8") "}", 8, TD_ERR_FORMAT, "fractional dim"},
      {"{" ENTRY("a", "F32", "[1e0]", "0", "8") "}", 8, TD_ERR_FORMAT, "exponent dim"},
      {"{" ENTRY("a", "F32", "[\"2\"]", "0", "8") "}", 8, TD_ERR_FORMAT, "string dim"},
      {"{" ENTRY("a", "F32", "2", "0", "8") "}", 8, TD_ERR_FORMAT, "shape not an array"},
      {"{" ENTRY("a", "F32", "[4294967296,4294967296,4294967296]", "0", "8") "}", 8,
       TD_ERR_FORMAT, "shape product overflows"},
      {"{" ENTRY("a", "F32", "[99999999999999999999]", "0", "8") "}", 8, TD_ERR_FORMAT,
       "dim overflows uint64"},
      {"{" ENTRY("a", "F32", "[1,1,1,1,1,1,1,1,1]", "0", "4") "}", 4, TD_ERR_UNSUPPORTED,
       "more dims than supported"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, TD_ERR_FORMAT, "missing data_offsets"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, TD_ERR_FORMAT,
       "one offset"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
       TD_ERR_FORMAT, "unknown field"},
      {"{\"a\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, TD_ERR_FORMAT,
       "dtype not a string"},
      {"{\"a\":[1,2]}", 0, TD_ERR_FORMAT, "entry not an object"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "," ENTRY("a", "F32", "[2]", "0", "8") "}", 8,
       TD_ERR_FORMAT, "duplicate key"},
      {"{\"__metadata__\":{\"k\":1}}", 0, TD_ERR_FORMAT, "metadata value not a string"},
      {"{\"__metadata__\":[]}", 0, TD_ERR_FORMAT, "metadata not an object"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8"), 8, TD_ERR_FORMAT, "unterminated object"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "}}", 8, TD_ERR_FORMAT, "trailing brace"},
      {"{" ENTRY("a", "F32", "[2]", "0", "8") "} x", 8, TD_ERR_FORMAT, "trailing garbage"},
      {"{\"a\" " ENTRY("b", "F32", "[2]", "0", "8") "}", 8, TD_ERR_FORMAT, "missing colon"},
      {"{\"a:{}}", 0, TD_ERR_FORMAT, "unterminated string"},
      {"{\"a\\q\":{}}", 0, TD_ERR_FORMAT, "bad escape"},
      {"{\"a\\ud800\":{}}", 0, TD_ERR_FORMAT, "lone surrogate"},
      {"{\"a\xff\":{}}", 0, TD_ERR_FORMAT, "invalid UTF-8"},
      {"{\"a\x01\":{}}", 0, TD_ERR_FORMAT, "control character"},
      {"{\"a\\u0000b\":{}}", 0, TD_ERR_FORMAT, "NUL in a name"},
      {"{" ENTRY("a", "F32", "[2]", "00", "8") "}", 8, TD_ERR_FORMAT, "leading zero"},
      {"{" ENTRY("a", "F32", "[2]", "-0", "8") "}", 8, TD_ERR_FORMAT, "negative offset"},
      {"{,}", 0, TD_ERR_FORMAT, "lone comma"},
      {"{\"a\":tru}", 0, TD_ERR_FORMAT, "bad literal"},
      {"[]", 0, TD_ERR_FORMAT, "array at the top"},
      {"  {}", 0, TD_ERR_FORMAT, "header must start with {"},
      {"{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
       "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
       0, TD_ERR_FORMAT, "nesting too deep"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    td_status st = parse_header(cases[i].header, cases[i].data);
    if (st != cases[i].want)
      fail_msg("case \"%s\": got %s (%s), expected %s", cases[i].why, td_status_name(st),
               td_last_error(), td_status_name(cases[i].want));
    if (st == TD_ERR_FORMAT && strstr(td_last_error(), "safetensors") == NULL)
      fail_msg("case \"%s\": message \"%s\" does not say safetensors", cases[i].why,
               td_last_error());
  }
  /* a pathological nesting depth must not exhaust the stack */
  size_t depth = 100000;
  char *deep = malloc(2 * depth + 16);
  size_t k = 0;
  memcpy(deep, "{\"a\":", 5);
  k = 5;
  for (size_t i = 0; i < depth; i++) deep[k++] = '[';
  for (size_t i = 0; i < depth; i++) deep[k++] = ']';
  deep[k++] = '}';
  deep[k] = '\0';
  TD_ASSERT_STATUS(parse_header(deep, 0), TD_ERR_FORMAT);
  free(deep);
}

static void test_safetensors_bad_length_and_truncation(void **state) {
  (void)state;
  td_tensor_list l;
  sample_list(&l);
  void *buf = NULL;
  size_t len = 0;
  TD_ASSERT_OK(td_safetensors_serialize(&l, NULL, &buf, &len));
  uint8_t *b = buf;
  /* every proper prefix is malformed */
  for (size_t n = 0; n < len; n++) {
    td_status st = parse_buf(b, n);
    if (st != TD_ERR_FORMAT)
      fail_msg("prefix of %zu/%zu bytes: got %s (%s)", n, len, td_status_name(st),
               td_last_error());
  }
  TD_ASSERT_OK(parse_buf(b, len));
  /* header length too large, enormous, or zero */
  uint8_t *c = malloc(len);
  uint64_t bad_lengths[] = {len - 7, (uint64_t)1 << 40, UINT64_MAX, 0, 1};
  for (size_t i = 0; i < sizeof bad_lengths / sizeof bad_lengths[0]; i++) {
    memcpy(c, b, len);
    for (int k = 0; k < 8; k++) c[k] = (uint8_t)(bad_lengths[i] >> (8 * k));
    td_status st = parse_buf(c, len);
    if (st != TD_ERR_FORMAT)
      fail_msg("header length %llu: got %s", (unsigned long long)bad_lengths[i],
               td_status_name(st));
  }
  /* random byte corruption: any status but never a crash (ASan watches) */
  td_generator *g = NULL;
  TD_ASSERT_OK(td_generator_create(77, &g));
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
  for (int trial = 0; trial < 2000; trial++) {
    memcpy(c, b, len);
    int flips = 1 + (int)(td_generator_next_u64(g) % 4);
    for (int f = 0; f < flips; f++) {
      size_t pos = 8 + (size_t)(td_generator_next_u64(g) % hlen); /* inside the header */
      c[pos] = (uint8_t)td_generator_next_u64(g);
    }
    td_status st = parse_buf(c, len);
    assert_true(st == TD_OK || st == TD_ERR_FORMAT || st == TD_ERR_DTYPE ||
                st == TD_ERR_UNSUPPORTED);
  }
  /* a truncated file on disk */
  char path[512];
  tmp_path("truncated.safetensors", path, sizeof path);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fwrite(b, 1, len - 3, f);
  fclose(f);
  td_tensor_list r;
  td_tensor_list_init(&r);
  TD_ASSERT_STATUS(td_safetensors_read(path, &r, NULL), TD_ERR_FORMAT);
  assert_non_null(strstr(td_last_error(), path));
  assert_int_equal(r.n, 0);
  td_generator_destroy(g);
  free(c);
  free(buf);
  td_tensor_list_fini(&l);
}

/* ---- modules ---- */

static td_module *make_mlp(uint64_t seed, int64_t hidden) {
  td_generator *g = NULL;
  TD_ASSERT_OK(td_generator_create(seed, &g));
  td_module *seq = NULL, *c = NULL;
  TD_ASSERT_OK(td_sequential_create(&seq));
  TD_ASSERT_OK(td_linear_create(4, hidden, true, g, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_tanh_create(&c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  TD_ASSERT_OK(td_linear_create(hidden, 2, true, g, &c));
  TD_ASSERT_OK(td_sequential_append(seq, c));
  td_module_unref(c);
  td_generator_destroy(g);
  return seq;
}

static void assert_same_params(td_module *a, td_module *b, bool equal) {
  td_tensor_list la, lb;
  td_tensor_list_init(&la);
  td_tensor_list_init(&lb);
  TD_ASSERT_OK(td_module_state_dict(a, &la));
  TD_ASSERT_OK(td_module_state_dict(b, &lb));
  assert_int_equal(la.n, lb.n);
  bool all_equal = true;
  for (size_t i = 0; i < la.n; i++) {
    bool close = false;
    TD_ASSERT_OK(td_tensor_allclose(la.tensors[i], lb.tensors[i], 0, 0, &close));
    all_equal = all_equal && close;
  }
  assert_int_equal(all_equal, equal);
  td_tensor_list_fini(&la);
  td_tensor_list_fini(&lb);
}

static void test_module_save_load_round_trip(void **state) {
  (void)state;
  char path[512];
  tmp_path("mlp.safetensors", path, sizeof path);
  td_module *a = make_mlp(1, 8), *b = make_mlp(2, 8);
  assert_same_params(a, b, false);
  TD_ASSERT_OK(td_module_save(a, path));
  td_tensor *w_before = td_module_param(td_module_child(b, "0"), "weight");
  TD_ASSERT_OK(td_module_load(b, path));
  assert_same_params(a, b, true);
  /* loaded in place: the parameter tensors are the same objects (optimizers keep working) */
  assert_ptr_equal(td_module_param(td_module_child(b, "0"), "weight"), w_before);
  assert_true(td_tensor_requires_grad(w_before));
  assert_true(td_tensor_is_leaf(w_before));
  td_tensor *x = td_test_randn((int64_t[]){3, 4}, 2, TD_DTYPE_F32, 5, false), *ya, *yb;
  TD_ASSERT_OK(td_module_forward(a, x, &ya));
  TD_ASSERT_OK(td_module_forward(b, x, &yb));
  td_test_assert_close("loaded model output", yb, ya, 0, 0);
  td_tensor_unref(ya);
  td_tensor_unref(yb);
  td_tensor_unref(x);

  /* the file holds PyTorch state-dict keys and metadata */
  td_tensor_list l;
  td_safetensors_meta meta;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&meta);
  TD_ASSERT_OK(td_safetensors_read(path, &l, &meta));
  const char *keys[] = {"0.weight", "0.bias", "2.weight", "2.bias"};
  assert_int_equal(l.n, 4);
  for (int i = 0; i < 4; i++) assert_string_equal(l.names[i], keys[i]);
  assert_string_equal(td_safetensors_meta_get(&meta, "format"), "pt");
  assert_string_equal(td_safetensors_meta_get(&meta, "tdist.module"), "Sequential");
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&meta);
  td_module_unref(a);
  td_module_unref(b);
}

static void test_module_load_strict_errors(void **state) {
  (void)state;
  char path[512];
  tmp_path("strict.safetensors", path, sizeof path);
  td_module *a = make_mlp(1, 8);
  TD_ASSERT_OK(td_module_save(a, path));

  /* shape mismatch: hidden 6 instead of 8; the module stays unchanged */
  td_module *b = make_mlp(3, 6), *b_ref = make_mlp(3, 6);
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_SHAPE);
  assert_non_null(strstr(td_last_error(), "0.weight"));
  assert_same_params(b, b_ref, true);
  td_module_unref(b);
  td_module_unref(b_ref);

  /* dtype mismatch */
  b = make_mlp(3, 8);
  TD_ASSERT_OK(td_module_to_dtype(b, TD_DTYPE_F64));
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_DTYPE);
  td_module_unref(b);

  /* missing keys: the module has an extra layer */
  b = make_mlp(3, 8);
  td_module *extra = NULL;
  TD_ASSERT_OK(td_linear_create(2, 2, true, NULL, &extra));
  TD_ASSERT_OK(td_sequential_append(b, extra));
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_NOT_FOUND);
  assert_non_null(strstr(td_last_error(), "3.weight"));
  /* non-strict loading from a state dict accepts it */
  td_tensor_list sd;
  td_tensor_list_init(&sd);
  TD_ASSERT_OK(td_safetensors_read(path, &sd, NULL));
  TD_ASSERT_OK(td_module_load_state_dict(b, &sd, false));
  td_module_unref(extra);
  td_module_unref(b);

  /* unexpected keys: the module lacks the last layer */
  b = NULL;
  TD_ASSERT_OK(td_sequential_create(&b));
  TD_ASSERT_OK(td_linear_create(4, 8, true, NULL, &extra));
  TD_ASSERT_OK(td_sequential_append(b, extra));
  td_module_unref(extra);
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_INVALID);
  assert_non_null(strstr(td_last_error(), "2.bias"));
  TD_ASSERT_OK(td_module_load_state_dict(b, &sd, false));
  td_test_assert_close("non-strict load", td_module_param(td_module_child(b, "0"), "bias"),
                       td_tensor_list_find(&sd, "0.bias"), 0, 0);
  td_module_unref(b);
  td_tensor_list_fini(&sd);

  /* a corrupt file is a format error, and the module is unchanged */
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  fseek(f, 9, SEEK_SET);
  fputc('#', f);
  fclose(f);
  b = make_mlp(3, 8);
  td_module *b2 = make_mlp(3, 8);
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_FORMAT);
  assert_same_params(b, b2, true);
  tmp_path("does-not-exist.safetensors", path, sizeof path);
  TD_ASSERT_STATUS(td_module_load(b, path), TD_ERR_IO);
  TD_ASSERT_STATUS(td_module_load(NULL, path), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_module_save(b, NULL), TD_ERR_INVALID);
  td_module_unref(b);
  td_module_unref(b2);
  td_module_unref(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_safetensors_round_trip),
      cmocka_unit_test(test_safetensors_serialize_misuse),
      cmocka_unit_test(test_safetensors_python_file),
      cmocka_unit_test(test_safetensors_corrupt_headers),
      cmocka_unit_test(test_safetensors_bad_length_and_truncation),
      cmocka_unit_test(test_module_save_load_round_trip),
      cmocka_unit_test(test_module_load_strict_errors),
  };
  return cmocka_run_group_tests_name("safetensors", tests, setup_dir, remove_dir);
}
