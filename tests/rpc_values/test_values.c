/* test_values.c - td_value: every kind, lists, dicts, equality, to_string, kind errors, extension
 * values and the tensor walk. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/value_impl.h"
#include "test_util.h"

static void test_value_scalars(void **state) {
  td_value *n = td_value_none();
  td_value *t = td_value_bool(true);
  td_value *i = td_value_int(-42);
  td_value *d = td_value_double(2.5);
  assert_non_null(n);
  assert_non_null(i);
  assert_non_null(d);
  assert_int_equal(td_value_kind_of(n), TD_VALUE_NONE);
  assert_int_equal(td_value_kind_of(t), TD_VALUE_BOOL);
  assert_int_equal(td_value_kind_of(i), TD_VALUE_INT);
  assert_int_equal(td_value_kind_of(d), TD_VALUE_DOUBLE);
  assert_int_equal(td_value_kind_of(NULL), TD_VALUE_NONE);
  assert_string_equal(td_value_kind_name(n), "none");
  assert_string_equal(td_value_kind_name(t), "bool");
  assert_string_equal(td_value_kind_name(i), "int");
  assert_string_equal(td_value_kind_name(d), "double");

  bool b = false;
  int64_t x = 0;
  double y = 0;
  TD_ASSERT_OK(td_value_as_bool(t, &b));
  assert_true(b);
  TD_ASSERT_OK(td_value_as_int(i, &x));
  assert_int_equal(x, -42);
  TD_ASSERT_OK(td_value_as_int(t, &x)); /* int accepts bool */
  assert_int_equal(x, 1);
  TD_ASSERT_OK(td_value_as_double(d, &y));
  assert_true(y == 2.5);
  TD_ASSERT_OK(td_value_as_double(i, &y)); /* double accepts int */
  assert_true(y == -42.0);

  /* Extremes survive. */
  td_value *big = td_value_int(INT64_MIN);
  TD_ASSERT_OK(td_value_as_int(big, &x));
  assert_true(x == INT64_MIN);

  /* Refcounting on singletons and on heap values. */
  td_value *n2 = td_value_ref(n);
  td_value_unref(n2);
  td_value *i2 = td_value_ref(i);
  td_value_unref(i);
  TD_ASSERT_OK(td_value_as_int(i2, &x));
  assert_int_equal(x, -42);
  td_value_unref(i2);
  td_value_unref(n);
  td_value_unref(t);
  td_value_unref(d);
  td_value_unref(big);
  td_value_unref(NULL);
}

static void test_value_kind_mismatch(void **state) {
  td_value *s = td_value_string("hi");
  td_value *d = td_value_double(1.0);
  td_value *b = td_value_bool(false);
  int64_t x = 7;
  double y = 3;
  bool bb = true;
  const char *str = "untouched";
  td_tensor *t = NULL;
  const void *data = NULL;
  TD_ASSERT_STATUS(td_value_as_int(s, &x), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected int, got string");
  assert_int_equal(x, 7);
  TD_ASSERT_STATUS(td_value_as_int(d, &x), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected int, got double");
  assert_int_equal(x, 7);
  TD_ASSERT_STATUS(td_value_as_double(s, &y), TD_ERR_INVALID);
  assert_true(y == 3);
  TD_ASSERT_STATUS(td_value_as_double(b, &y), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected double, got bool");
  TD_ASSERT_STATUS(td_value_as_bool(d, &bb), TD_ERR_INVALID);
  assert_true(bb);
  TD_ASSERT_STATUS(td_value_as_string(d, &str, NULL), TD_ERR_INVALID);
  assert_string_equal(str, "untouched");
  TD_ASSERT_STATUS(td_value_as_bytes(s, &data, NULL), TD_ERR_INVALID);
  assert_null(data);
  TD_ASSERT_STATUS(td_value_as_tensor(s, &t), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected tensor, got string");
  assert_null(t);
  TD_ASSERT_STATUS(td_value_as_int(NULL, &x), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_value_list_append(s, td_value_none()), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected list, got string");
  TD_ASSERT_STATUS(td_value_dict_set(d, "k", td_value_none()), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected dict, got double");
  assert_int_equal(td_value_list_len(s), 0);
  assert_null(td_value_list_get(s, 0));
  assert_int_equal(td_value_dict_len(s), 0);
  assert_null(td_value_dict_get(s, "k"));
  td_value_unref(s);
  td_value_unref(d);
  td_value_unref(b);
}

static void test_value_string_bytes(void **state) {
  td_value *s = td_value_string("héllo");
  const char *p = NULL;
  size_t len = 0;
  TD_ASSERT_OK(td_value_as_string(s, &p, &len));
  assert_string_equal(p, "héllo");
  assert_int_equal(len, strlen("héllo"));

  /* string_n copies exactly n bytes (embedded NUL kept) and NUL-terminates. */
  td_value *sn = td_value_string_n("ab\0cd", 5);
  TD_ASSERT_OK(td_value_as_string(sn, &p, &len));
  assert_int_equal(len, 5);
  assert_memory_equal(p, "ab\0cd", 6);
  td_value *empty = td_value_string_n(NULL, 0);
  assert_non_null(empty);
  TD_ASSERT_OK(td_value_as_string(empty, &p, &len));
  assert_string_equal(p, "");
  assert_int_equal(len, 0);
  assert_null(td_value_string(NULL));

  /* Strings are copied: changing the source afterwards changes nothing. */
  char src[] = "mutable";
  td_value *c = td_value_string(src);
  src[0] = 'X';
  TD_ASSERT_OK(td_value_as_string(c, &p, NULL));
  assert_string_equal(p, "mutable");

  unsigned char raw[4] = {0, 1, 0xff, 7};
  td_value *by = td_value_bytes(raw, sizeof raw);
  const void *data = NULL;
  TD_ASSERT_OK(td_value_as_bytes(by, &data, &len));
  assert_int_equal(len, 4);
  assert_memory_equal(data, raw, 4);
  assert_int_equal(td_value_kind_of(by), TD_VALUE_BYTES);
  assert_string_equal(td_value_kind_name(by), "bytes");
  td_value *by0 = td_value_bytes(NULL, 0);
  assert_non_null(by0);

  /* A string and bytes with the same content are different kinds. */
  td_value *sb = td_value_bytes("mutable", 7);
  assert_false(td_value_equal(c, sb));
  td_value_unref(sb);
  td_value_unref(s);
  td_value_unref(sn);
  td_value_unref(empty);
  td_value_unref(c);
  td_value_unref(by);
  td_value_unref(by0);
}

static void test_value_tensor(void **state) {
  const double vals[] = {1, 2, 3, 4, 5, 6};
  const int64_t shape[] = {2, 3};
  td_tensor *t = td_test_tensor(vals, shape, 2, TD_DTYPE_F32, false);
  td_value *v = td_value_tensor(t);
  assert_non_null(v);
  td_tensor_unref(t); /* the value holds its own reference */
  td_tensor *got = NULL;
  TD_ASSERT_OK(td_value_as_tensor(v, &got));
  assert_int_equal(td_tensor_ndim(got), 2);
  assert_int_equal(td_tensor_size(got, 1), 3);
  double x;
  const int64_t idx[] = {1, 2};
  TD_ASSERT_OK(td_tensor_get(got, idx, &x));
  assert_true(x == 6);
  assert_null(td_value_tensor(NULL));
  td_value_unref(v);
}

static void test_value_list_nested(void **state) {
  td_value *l = td_value_list();
  assert_int_equal(td_value_list_len(l), 0);
  TD_ASSERT_OK(td_value_list_append(l, td_value_int(1)));
  TD_ASSERT_OK(td_value_list_append(l, td_value_string("a")));
  td_value *inner = td_value_list();
  for (int i = 0; i < 100; i++) TD_ASSERT_OK(td_value_list_append(inner, td_value_int(i)));
  TD_ASSERT_OK(td_value_list_append(l, inner));
  td_value *d = td_value_dict();
  TD_ASSERT_OK(td_value_dict_set(d, "x", td_value_double(0.5)));
  TD_ASSERT_OK(td_value_list_append(l, d));
  assert_int_equal(td_value_list_len(l), 4);
  assert_ptr_equal(td_value_list_get(l, 2), inner);
  assert_null(td_value_list_get(l, 4));
  assert_int_equal(td_value_list_len(td_value_list_get(l, 2)), 100);
  int64_t x;
  TD_ASSERT_OK(td_value_as_int(td_value_list_get(inner, 99), &x));
  assert_int_equal(x, 99);
  double y;
  TD_ASSERT_OK(td_value_as_double(td_value_dict_get(td_value_list_get(l, 3), "x"), &y));
  assert_true(y == 0.5);

  /* Failure leaves ownership with the caller; cycles are refused. */
  td_value *keep = td_value_int(5);
  TD_ASSERT_STATUS(td_value_list_append(NULL, keep), TD_ERR_INVALID);
  td_value_unref(keep);
  TD_ASSERT_STATUS(td_value_list_append(l, NULL), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_value_list_append(l, l), TD_ERR_INVALID);
  TD_ASSERT_STATUS(td_value_list_append(inner, td_value_ref(l)), TD_ERR_INVALID);
  td_value_unref(l); /* the extra reference from the refused append */
  TD_ASSERT_STATUS(td_value_dict_set(d, "self", l), TD_ERR_INVALID);

  /* The same child may appear twice (a DAG, not a cycle). */
  td_value *shared = td_value_string("shared");
  TD_ASSERT_OK(td_value_list_append(l, td_value_ref(shared)));
  TD_ASSERT_OK(td_value_list_append(l, shared));
  assert_int_equal(td_value_list_len(l), 6);
  td_value_unref(l);
}

static void test_value_deep_tree_frees(void **state) {
  /* 100000 nested lists: freeing must not recurse. */
  td_value *v = td_value_int(0);
  for (int i = 0; i < 100000; i++) {
    td_value *l = td_value_list();
    TD_ASSERT_OK(td_value_list_append(l, v));
    v = l;
  }
  td_value_unref(v);
}

static void test_value_dict_order_replace(void **state) {
  td_value *d = td_value_dict();
  TD_ASSERT_OK(td_value_dict_set(d, "b", td_value_int(1)));
  TD_ASSERT_OK(td_value_dict_set(d, "a", td_value_int(2)));
  TD_ASSERT_OK(td_value_dict_set(d, "c", td_value_int(3)));
  TD_ASSERT_OK(td_value_dict_set(d, "a", td_value_string("two"))); /* replace keeps position */
  assert_int_equal(td_value_dict_len(d), 3);
  const char *k = NULL;
  td_value *v = NULL;
  const char *want[] = {"b", "a", "c"};
  for (size_t i = 0; i < 3; i++) {
    TD_ASSERT_OK(td_value_dict_entry(d, i, &k, &v));
    assert_string_equal(k, want[i]);
  }
  TD_ASSERT_OK(td_value_dict_entry(d, 1, &k, &v));
  assert_int_equal(td_value_kind_of(v), TD_VALUE_STRING);
  k = "untouched";
  TD_ASSERT_STATUS(td_value_dict_entry(d, 3, &k, &v), TD_ERR_INVALID);
  assert_string_equal(k, "untouched");
  assert_null(td_value_dict_get(d, "zz"));
  assert_null(td_value_dict_get(d, NULL));
  td_value *keep = td_value_int(9);
  TD_ASSERT_STATUS(td_value_dict_set(d, NULL, keep), TD_ERR_INVALID);
  td_value_unref(keep);

  /* Keys are copied. */
  char key[] = "dyn";
  TD_ASSERT_OK(td_value_dict_set(d, key, td_value_none()));
  key[0] = 'X';
  assert_non_null(td_value_dict_get(d, "dyn"));
  assert_null(td_value_dict_get(d, "Xyn"));

  /* Replacing a value with itself keeps exactly one reference in the dict. */
  td_value *same = td_value_list();
  TD_ASSERT_OK(td_value_dict_set(d, "same", td_value_ref(same)));
  TD_ASSERT_OK(td_value_dict_set(d, "same", td_value_ref(same)));
  assert_ptr_equal(td_value_dict_get(d, "same"), same);
  td_value_unref(same);
  td_value_unref(d);
}

static void test_value_dict_large(void **state) {
  /* Crosses the hashed-index threshold many times; order and replacement still hold. */
  td_value *d = td_value_dict();
  char key[32];
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "key%d", i);
    TD_ASSERT_OK(td_value_dict_set(d, key, td_value_int(i)));
  }
  for (int i = 0; i < 2000; i += 7) {
    snprintf(key, sizeof key, "key%d", i);
    TD_ASSERT_OK(td_value_dict_set(d, key, td_value_int(-i)));
  }
  assert_int_equal(td_value_dict_len(d), 2000);
  for (int i = 0; i < 2000; i++) {
    snprintf(key, sizeof key, "key%d", i);
    int64_t x;
    TD_ASSERT_OK(td_value_as_int(td_value_dict_get(d, key), &x));
    assert_int_equal(x, i % 7 == 0 ? -i : i);
    const char *k;
    TD_ASSERT_OK(td_value_dict_entry(d, (size_t)i, &k, NULL));
    assert_string_equal(k, key);
  }
  assert_null(td_value_dict_get(d, "key2000"));
  assert_null(td_value_dict_get(d, ""));
  TD_ASSERT_OK(td_value_dict_set(d, "", td_value_bool(true)));
  assert_non_null(td_value_dict_get(d, ""));
  td_value_unref(d);
}

/* build_sample returns [1, 'a', {'t': tensor, 'n': None, 'f': 1.5}, [True, b'\x00']] */
static td_value *build_sample(double last_elem, double f) {
  const double vals[] = {1, 2, last_elem};
  const int64_t shape[] = {3};
  td_tensor *t = td_test_tensor(vals, shape, 1, TD_DTYPE_F64, false);
  td_value *l = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l, td_value_int(1)));
  TD_ASSERT_OK(td_value_list_append(l, td_value_string("a")));
  td_value *d = td_value_dict();
  TD_ASSERT_OK(td_value_dict_set(d, "t", td_value_tensor(t)));
  TD_ASSERT_OK(td_value_dict_set(d, "n", td_value_none()));
  TD_ASSERT_OK(td_value_dict_set(d, "f", td_value_double(f)));
  TD_ASSERT_OK(td_value_list_append(l, d));
  td_value *in = td_value_list();
  TD_ASSERT_OK(td_value_list_append(in, td_value_bool(true)));
  TD_ASSERT_OK(td_value_list_append(in, td_value_bytes("\0", 1)));
  TD_ASSERT_OK(td_value_list_append(l, in));
  td_tensor_unref(t);
  return l;
}

static void test_value_equal(void **state) {
  td_value *a = build_sample(3, 1.5);
  td_value *b = build_sample(3, 1.5);
  td_value *c = build_sample(4, 1.5); /* differs in one tensor element */
  td_value *e = build_sample(3, 2.5); /* differs in a double */
  assert_true(td_value_equal(a, a));
  assert_true(td_value_equal(a, b));
  assert_false(td_value_equal(a, c));
  assert_false(td_value_equal(a, e));

  /* Kinds are not coerced. */
  td_value *i1 = td_value_int(1), *d1 = td_value_double(1.0), *i1b = td_value_int(1);
  assert_false(td_value_equal(i1, d1));
  assert_true(td_value_equal(i1, i1b));
  assert_false(td_value_equal(i1, td_value_bool(true)));
  assert_true(td_value_equal(NULL, td_value_none()));
  assert_false(td_value_equal(NULL, i1));

  /* Doubles: NaN equals NaN. */
  td_value *n1 = td_value_double(NAN), *n2 = td_value_double(NAN);
  assert_true(td_value_equal(n1, n2));

  /* Tensors: dtype, shape and elements matter; layout and storage do not. */
  const double v6[] = {1, 2, 3, 4, 5, 6};
  const int64_t s23[] = {2, 3}, s32[] = {3, 2};
  td_tensor *t23 = td_test_tensor(v6, s23, 2, TD_DTYPE_F32, false);
  td_tensor *t32 = td_test_tensor(v6, s32, 2, TD_DTYPE_F32, false);
  td_tensor *t23d = td_test_tensor(v6, s23, 2, TD_DTYPE_F64, false);
  const double v6t[] = {1, 4, 2, 5, 3, 6};
  td_tensor *t32b = td_test_tensor(v6t, s32, 2, TD_DTYPE_F32, false);
  td_tensor *tr = NULL; /* transpose of t32b: a non-contiguous [2, 3] view equal to t23 */
  TD_ASSERT_OK(td_tensor_transpose(t32b, 0, 1, &tr));
  assert_false(td_tensor_is_contiguous(tr));
  td_value *vt23 = td_value_tensor(t23), *vt32 = td_value_tensor(t32),
           *vt23d = td_value_tensor(t23d), *vtr = td_value_tensor(tr);
  assert_false(td_value_equal(vt23, vt32));
  assert_false(td_value_equal(vt23, vt23d));
  assert_true(td_value_equal(vt23, vtr));
  assert_true(td_value_equal(vtr, vt23));

  /* Lists and dicts: length, order and keys matter. */
  td_value *l1 = td_value_list(), *l2 = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l1, td_value_int(1)));
  assert_false(td_value_equal(l1, l2));
  TD_ASSERT_OK(td_value_list_append(l2, td_value_int(1)));
  assert_true(td_value_equal(l1, l2));
  td_value *d1x = td_value_dict(), *d2x = td_value_dict();
  TD_ASSERT_OK(td_value_dict_set(d1x, "a", td_value_int(1)));
  TD_ASSERT_OK(td_value_dict_set(d1x, "b", td_value_int(2)));
  TD_ASSERT_OK(td_value_dict_set(d2x, "b", td_value_int(2)));
  TD_ASSERT_OK(td_value_dict_set(d2x, "a", td_value_int(1)));
  assert_false(td_value_equal(d1x, d2x)); /* insertion order is part of a dict */
  td_value *s1 = td_value_string_n("a\0b", 3), *s2 = td_value_string_n("a\0c", 3);
  assert_false(td_value_equal(s1, s2));

  td_value *all[] = {a, b, c, e, i1, d1, i1b, n1, n2, vt23, vt32, vt23d, vtr, l1, l2, d1x, d2x,
                     s1, s2};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) td_value_unref(all[i]);
  td_tensor_unref(t23);
  td_tensor_unref(t32);
  td_tensor_unref(t23d);
  td_tensor_unref(t32b);
  td_tensor_unref(tr);
}

static void test_value_to_string(void **state) {
  char buf[256];
  td_value *a = build_sample(3, 1.5);
  assert_string_equal(td_value_to_string(a, buf, sizeof buf),
                      "[1, 'a', {'t': tensor(float64[3]), 'n': None, 'f': 1.5}, [True, b'\\x00']]");
  td_value *s = td_value_string("it's\n");
  assert_string_equal(td_value_to_string(s, buf, sizeof buf), "'it\\'s\\n'");
  td_value *d = td_value_double(2.0);
  assert_string_equal(td_value_to_string(d, buf, sizeof buf), "2.0");
  td_value *d2 = td_value_double(0.1);
  assert_string_equal(td_value_to_string(d2, buf, sizeof buf), "0.1");
  td_value *d3 = td_value_double(-INFINITY);
  assert_string_equal(td_value_to_string(d3, buf, sizeof buf), "-inf");
  assert_string_equal(td_value_to_string(NULL, buf, sizeof buf), "None");
  td_tensor *sc = NULL;
  TD_ASSERT_OK(td_tensor_scalar(1, TD_DTYPE_I64, td_device_cpu(), &sc));
  td_value *vs = td_value_tensor(sc);
  assert_string_equal(td_value_to_string(vs, buf, sizeof buf), "tensor(int64[])");
  td_tensor_unref(sc);
  td_value *empty = td_value_dict();
  assert_string_equal(td_value_to_string(empty, buf, sizeof buf), "{}");

  /* Truncation: always NUL-terminated, ends with "...", and never writes past n. */
  char small[16];
  memset(small, 'Z', sizeof small);
  td_value_to_string(a, small, 12);
  assert_int_equal(strlen(small), 11);
  assert_string_equal(small, "[1, 'a',...");
  assert_int_equal(small[12], 'Z');
  td_value_to_string(a, small, 1);
  assert_string_equal(small, "");
  td_value_to_string(a, small, 4);
  assert_string_equal(small, "...");
  assert_ptr_equal(td_value_to_string(a, NULL, 0), NULL);
  /* A multi-byte UTF-8 character is never cut in half. */
  td_value *u = td_value_string("ééééé");
  td_value_to_string(u, small, 9); /* "'" + 4 bytes of é's fit before "..." */
  assert_string_equal(small, "'éé...");
  td_value_to_string(u, small, 8);
  assert_string_equal(small, "'é...");

  /* A long list stops early and still ends with "...". */
  td_value *l = td_value_list();
  for (int i = 0; i < 10000; i++) TD_ASSERT_OK(td_value_list_append(l, td_value_int(i)));
  td_value_to_string(l, buf, sizeof buf);
  assert_int_equal(strlen(buf), sizeof buf - 1);
  assert_string_equal(buf + sizeof buf - 4, "...");
  assert_memory_equal(buf, "[0, 1, 2, 3", 11);

  td_value *all[] = {a, s, d, d2, d3, vs, empty, u, l};
  for (size_t i = 0; i < sizeof all / sizeof *all; i++) td_value_unref(all[i]);
}

/* ---- extension values ---- */

typedef struct dummy {
  int id;
} dummy;

static int dummy_destroyed;

static void dummy_destroy(void *obj) {
  dummy_destroyed++;
  free(obj);
}

static td_status dummy_to_wire(void *obj, td__wire_ctx *ctx, td_value **out) {
  *out = td_value_int(((dummy *)obj)->id);
  return *out ? TD_OK : TD_ERR_NOMEM;
}

static td_status dummy_from_wire(const td_value *repr, td__wire_ctx *ctx, void **obj) {
  int64_t id;
  TD_TRY(td_value_as_int(repr, &id));
  dummy *d = malloc(sizeof *d);
  if (!d) return TD_ERR_NOMEM;
  d->id = (int)id;
  *obj = d;
  return TD_OK;
}

static bool dummy_equal(const void *a, const void *b) {
  return ((const dummy *)a)->id == ((const dummy *)b)->id;
}

static void dummy_describe(const void *obj, char *buf, size_t n) {
  snprintf(buf, n, "Dummy(%d)", ((const dummy *)obj)->id);
}

static const td__value_ext_type dummy_type = {
    .name = "test.Dummy",
    .destroy = dummy_destroy,
    .to_wire = dummy_to_wire,
    .from_wire = dummy_from_wire,
    .equal = dummy_equal,
    .describe = dummy_describe,
};

/* plain_type has no equal and no describe: defaults apply. */
static const td__value_ext_type plain_type = {
    .name = "test.Plain",
    .destroy = dummy_destroy,
};

static const td__value_ext_type clash_type = {
    .name = "test.Dummy",
    .destroy = dummy_destroy,
};

static td_value *make_dummy(const td__value_ext_type *type, int id) {
  dummy *d = malloc(sizeof *d);
  assert_non_null(d);
  d->id = id;
  return td__value_ext(type, d);
}

static void test_value_ext(void **state) {
  dummy_destroyed = 0;
  TD_ASSERT_OK(td__value_ext_register(&dummy_type));
  TD_ASSERT_OK(td__value_ext_register(&dummy_type)); /* same pointer: no-op */
  TD_ASSERT_STATUS(td__value_ext_register(&clash_type), TD_ERR_EXISTS);
  TD_ASSERT_STATUS(td__value_ext_register(NULL), TD_ERR_INVALID);
  assert_ptr_equal(td__value_ext_find("test.Dummy"), &dummy_type);
  assert_null(td__value_ext_find("test.Missing"));
  assert_null(td__value_ext_find(NULL));

  td_value *a = make_dummy(&dummy_type, 7);
  td_value *b = make_dummy(&dummy_type, 7);
  td_value *c = make_dummy(&dummy_type, 8);
  td_value *p1 = make_dummy(&plain_type, 7);
  td_value *p2 = make_dummy(&plain_type, 7);
  assert_int_equal(td_value_kind_of(a), TD_VALUE_EXT);
  assert_string_equal(td_value_kind_name(a), "test.Dummy");
  assert_ptr_equal(td__value_ext_type_of(a), &dummy_type);
  assert_int_equal(((dummy *)td__value_ext_obj(a))->id, 7);
  td_value *i = td_value_int(7);
  assert_null(td__value_ext_type_of(i));
  assert_null(td__value_ext_obj(i));
  int64_t x;
  TD_ASSERT_STATUS(td_value_as_int(a, &x), TD_ERR_INVALID);
  assert_string_equal(td_last_error(), "value: expected int, got test.Dummy");

  assert_true(td_value_equal(a, b));   /* type's equal */
  assert_false(td_value_equal(a, c));
  assert_false(td_value_equal(a, p1)); /* different types */
  assert_false(td_value_equal(p1, p2)); /* default: same object only */
  assert_true(td_value_equal(p1, p1));

  /* Round trip through the type's wire functions. */
  td_value *repr = NULL;
  TD_ASSERT_OK(dummy_type.to_wire(td__value_ext_obj(c), NULL, &repr));
  void *obj = NULL;
  TD_ASSERT_OK(td__value_ext_find("test.Dummy")->from_wire(repr, NULL, &obj));
  td_value *c2 = td__value_ext(&dummy_type, obj);
  assert_true(td_value_equal(c, c2));

  char buf[128];
  td_value *l = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l, td_value_ref(a)));
  TD_ASSERT_OK(td_value_list_append(l, td_value_ref(p1)));
  assert_string_equal(td_value_to_string(l, buf, sizeof buf), "[Dummy(7), test.Plain]");

  /* destroy runs exactly once per object, with the last reference. */
  td_value *all[] = {a, b, c, p1, p2, i, repr, c2};
  for (size_t k = 0; k < sizeof all / sizeof *all; k++) td_value_unref(all[k]);
  assert_int_equal(dummy_destroyed, 4); /* a and p1 still live inside l */
  td_value_unref(l);
  assert_int_equal(dummy_destroyed, 6);
  assert_null(td__value_ext(NULL, NULL));
}

/* ---- tensor walk ---- */

typedef struct walk_log {
  td_tensor *seen[8];
  int n;
  int stop_at; /* return an error when n reaches this */
} walk_log;

static td_status visit(void *ctx, td_tensor *t) {
  walk_log *w = ctx;
  if (w->n == w->stop_at) return td_set_error(TD_ERR_IO, "stop");
  w->seen[w->n++] = t;
  return TD_OK;
}

static void test_value_walk_tensors(void **state) {
  td_tensor *ts[4];
  for (int i = 0; i < 4; i++)
    TD_ASSERT_OK(td_tensor_scalar(i, TD_DTYPE_F32, td_device_cpu(), &ts[i]));
  /* [t0, {'z': t1, 'a': [t2, 5]}, 'x', t3] */
  td_value *l = td_value_list();
  TD_ASSERT_OK(td_value_list_append(l, td_value_tensor(ts[0])));
  td_value *d = td_value_dict();
  TD_ASSERT_OK(td_value_dict_set(d, "z", td_value_tensor(ts[1])));
  td_value *in = td_value_list();
  TD_ASSERT_OK(td_value_list_append(in, td_value_tensor(ts[2])));
  TD_ASSERT_OK(td_value_list_append(in, td_value_int(5)));
  TD_ASSERT_OK(td_value_dict_set(d, "a", in));
  TD_ASSERT_OK(td_value_list_append(l, d));
  TD_ASSERT_OK(td_value_list_append(l, td_value_string("x")));
  TD_ASSERT_OK(td_value_list_append(l, td_value_tensor(ts[3])));

  walk_log w = {.stop_at = -1};
  TD_ASSERT_OK(td__value_walk_tensors(l, visit, &w));
  assert_int_equal(w.n, 4);
  for (int i = 0; i < 4; i++) assert_ptr_equal(w.seen[i], ts[i]);

  walk_log w2 = {.stop_at = 2};
  TD_ASSERT_STATUS(td__value_walk_tensors(l, visit, &w2), TD_ERR_IO);
  assert_int_equal(w2.n, 2);

  walk_log w3 = {.stop_at = -1};
  td_value *i = td_value_int(3);
  TD_ASSERT_OK(td__value_walk_tensors(i, visit, &w3));
  TD_ASSERT_OK(td__value_walk_tensors(NULL, visit, &w3));
  assert_int_equal(w3.n, 0);
  td_value_unref(i);
  td_value_unref(l);
  for (int k = 0; k < 4; k++) td_tensor_unref(ts[k]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_value_scalars),
      cmocka_unit_test(test_value_kind_mismatch),
      cmocka_unit_test(test_value_string_bytes),
      cmocka_unit_test(test_value_tensor),
      cmocka_unit_test(test_value_list_nested),
      cmocka_unit_test(test_value_deep_tree_frees),
      cmocka_unit_test(test_value_dict_order_replace),
      cmocka_unit_test(test_value_dict_large),
      cmocka_unit_test(test_value_equal),
      cmocka_unit_test(test_value_to_string),
      cmocka_unit_test(test_value_ext),
      cmocka_unit_test(test_value_walk_tensors),
  };
  return cmocka_run_group_tests_name("rpc_values", tests, NULL, NULL);
}
