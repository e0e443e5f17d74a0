/* test_data.c - IDX reading, MNIST data sets, samplers and loaders.
 *
 * Each test writes its own small IDX files (gzip via gzopen, or raw) into a fresh temporary
 * directory and removes it at the end. The last test loads the real Fashion-MNIST files when they
 * are installed and skips otherwise.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "tdist/data.h"
#include "test_util.h"

/* ---- helpers ---- */

typedef struct tmpdir {
  char path[256];
} tmpdir;

static void tmpdir_make(tmpdir *d) {
  const char *base = getenv("TMPDIR");
  snprintf(d->path, sizeof d->path, "%s/td_data_XXXXXX", base && *base ? base : "/tmp");
  assert_non_null(mkdtemp(d->path));
}

static const char *tmpdir_file(const tmpdir *d, const char *name, char *buf, size_t n) {
  snprintf(buf, n, "%s/%s", d->path, name);
  return buf;
}

static void tmpdir_remove(tmpdir *d) {
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", d->path);
  assert_int_equal(system(cmd), 0);
}

static void put_be32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

/* write_idx writes an IDX file with magic (0, 0, type, ndim), the dims and n data bytes; gzip
 * compressed when gz. */
static void write_idx(const char *path, bool gz, uint8_t type, int ndim, const uint32_t *dims,
                      const uint8_t *data, size_t n) {
  uint8_t hdr[4 + 4 * 8] = {0, 0, type, (uint8_t)ndim};
  for (int i = 0; i < ndim; i++) put_be32(hdr + 4 + 4 * i, dims[i]);
  size_t hn = 4 + 4 * (size_t)ndim;
  if (gz) {
    gzFile f = gzopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(gzwrite(f, hdr, (unsigned)hn), (int)hn);
    if (n) assert_int_equal(gzwrite(f, data, (unsigned)n), (int)n);
    assert_int_equal(gzclose(f), Z_OK);
  } else {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(hdr, 1, hn, f), hn);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
  }
}

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  if (n) assert_int_equal(fwrite(data, 1, n, f), n);
  assert_int_equal(fclose(f), 0);
}

static long file_size(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fclose(f);
  return n;
}

/* Pixel of image i at (r, c) in the synthetic data sets: every byte value occurs. */
static uint8_t pixel(int64_t i, int64_t r, int64_t c) {
  return (uint8_t)((i * 37 + r * 11 + c * 5 + (i * r * c) % 7) & 0xff);
}
static uint8_t label(int64_t i) { return (uint8_t)((i * 7 + 3) % 10); }

/* write_mnist writes images [n, rows, cols] and labels [n_labels] under the given names. */
static void write_mnist(const char *ipath, const char *lpath, uint32_t n, uint32_t rows,
                        uint32_t cols, uint32_t n_labels) {
  size_t np = (size_t)n * rows * cols;
  uint8_t *px = malloc(np ? np : 1);
  uint8_t *lb = malloc(n_labels ? n_labels : 1);
  assert_non_null(px);
  assert_non_null(lb);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t r = 0; r < rows; r++)
      for (uint32_t c = 0; c < cols; c++) px[((size_t)i * rows + r) * cols + c] = pixel(i, r, c);
  for (uint32_t i = 0; i < n_labels; i++) lb[i] = label(i);
  uint32_t idims[3] = {n, rows, cols};
  write_idx(ipath, true, 0x08, 3, idims, px, np);
  write_idx(lpath, true, 0x08, 1, &n_labels, lb, n_labels);
  free(px);
  free(lb);
}

/* assert_error checks status want and that td_last_error() mentions needle. */
#define assert_error(expr, want, needle)                                                      \
  do {                                                                                        \
    TD_ASSERT_STATUS(expr, want);                                                             \
    if (!strstr(td_last_error(), (needle)))                                                   \
      fail_msg("error message \"%s\" does not mention \"%s\"", td_last_error(), (needle));    \
  } while (0)

/* ---- IDX ---- */

static void test_idx_read_gzip_and_raw(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char p[512];
  uint8_t data[5 * 4 * 3];
  for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 13 + 1);
  uint32_t dims[3] = {5, 4, 3};
  for (int gz = 0; gz < 2; gz++) {
    tmpdir_file(&d, gz ? "a.gz" : "a.raw", p, sizeof p);
    write_idx(p, gz, 0x08, 3, dims, data, sizeof data);
    td_idx a;
    TD_ASSERT_OK(td_idx_read(p, 3, &a));
    assert_int_equal(a.ndim, 3);
    assert_int_equal(a.dims[0], 5);
    assert_int_equal(a.dims[1], 4);
    assert_int_equal(a.dims[2], 3);
    assert_int_equal(a.nbytes, sizeof data);
    assert_memory_equal(a.data, data, sizeof data);
    td_idx_fini(&a);
    assert_null(a.data);
    td_idx_fini(&a); /* twice is harmless */
    /* Any dimension count is accepted with expect_ndim 0. */
    TD_ASSERT_OK(td_idx_read(p, 0, &a));
    assert_int_equal(a.ndim, 3);
    td_idx_fini(&a);
  }
  /* A zero-sized array is valid. */
  uint32_t zdims[2] = {0, 28};
  tmpdir_file(&d, "zero.gz", p, sizeof p);
  write_idx(p, true, 0x08, 2, zdims, NULL, 0);
  td_idx z;
  TD_ASSERT_OK(td_idx_read(p, 2, &z));
  assert_int_equal(z.nbytes, 0);
  assert_int_equal(z.dims[1], 28);
  td_idx_fini(&z);
  tmpdir_remove(&d);
}

static void test_idx_read_rejects_corrupt_files(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char p[512];
  uint8_t data[40 * 50];
  uint64_t x = 12345;
  for (size_t i = 0; i < sizeof data; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    data[i] = (uint8_t)(x >> 56);
  }
  uint32_t dims[2] = {40, 50};
  td_idx a;
  memset(&a, 0x5a, sizeof a); /* untouched on failure */
  td_idx before = a;

  /* Missing file. */
  assert_error(td_idx_read(tmpdir_file(&d, "missing.gz", p, sizeof p), 0, &a), TD_ERR_NOT_FOUND,
               "missing.gz");
  /* A directory is not a file. */
  assert_error(td_idx_read(d.path, 0, &a), TD_ERR_IO, d.path);
  /* Empty file. */
  write_bytes(tmpdir_file(&d, "empty.gz", p, sizeof p), "", 0);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "empty.gz");
  /* Not gzip and not IDX. */
  const char text[] = "this is not a gzip file, nor an IDX file\n";
  write_bytes(tmpdir_file(&d, "text.gz", p, sizeof p), text, sizeof text - 1);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "neither a gzip file");
  assert_non_null(strstr(td_last_error(), "text.gz"));
  /* Bad magic inside a valid gzip stream. */
  write_idx(tmpdir_file(&d, "magic.gz", p, sizeof p), true, 0x08, 2, dims, data, sizeof data);
  {
    gzFile f = gzopen(p, "wb");
    uint8_t bad[12] = {0x12, 0x34, 0x08, 0x02};
    put_be32(bad + 4, 40);
    put_be32(bad + 8, 50);
    gzwrite(f, bad, sizeof bad);
    gzwrite(f, data, sizeof data);
    gzclose(f);
  }
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "bad IDX magic");
  /* Unsupported element type (float, 0x0D). */
  write_idx(tmpdir_file(&d, "float.gz", p, sizeof p), true, 0x0D, 2, dims, data, sizeof data);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "element type 0x0d");
  /* Wrong number of dimensions for what the caller expects. */
  write_idx(tmpdir_file(&d, "dims.gz", p, sizeof p), true, 0x08, 2, dims, data, sizeof data);
  assert_error(td_idx_read(p, 3, &a), TD_ERR_FORMAT, "2 dimensions, expected 3");
  /* Zero dimensions and too many. */
  write_idx(tmpdir_file(&d, "nodim.gz", p, sizeof p), true, 0x08, 0, dims, data, 10);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "nodim.gz");
  {
    uint8_t hdr[4 + 36] = {0, 0, 0x08, 9};
    for (int i = 0; i < 9; i++) put_be32(hdr + 4 + 4 * i, 1);
    gzFile f = gzopen(tmpdir_file(&d, "ninedims.gz", p, sizeof p), "wb");
    gzwrite(f, hdr, sizeof hdr);
    gzwrite(f, data, 1);
    gzclose(f);
  }
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "9 dimensions");
  /* Header declares more data than present (a valid gzip stream, short content). */
  write_idx(tmpdir_file(&d, "short.gz", p, sizeof p), true, 0x08, 2, dims, data,
            sizeof data - 7);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "truncated");
  /* Header declares an absurd size: rejected without allocating it. */
  uint32_t huge[3] = {0xffffffffu, 0xffffffffu, 0xffffffffu};
  write_idx(tmpdir_file(&d, "huge.gz", p, sizeof p), true, 0x08, 3, huge, data, 100);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "huge.gz");
  uint32_t big[2] = {1u << 20, 1u << 10}; /* 1 GiB declared, 100 bytes present */
  write_idx(tmpdir_file(&d, "big.gz", p, sizeof p), true, 0x08, 2, big, data, 100);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "truncated");
  /* Header declares less data than present. */
  uint32_t fewer[2] = {39, 50};
  write_idx(tmpdir_file(&d, "long.gz", p, sizeof p), true, 0x08, 2, fewer, data, sizeof data);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "after the");
  /* A gzip file cut in the middle of its compressed stream, and cut in its header. */
  write_idx(tmpdir_file(&d, "cut.gz", p, sizeof p), true, 0x08, 2, dims, data, sizeof data);
  long full = file_size(p);
  long cuts[] = {full - 4, full / 2, 12, 3, 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    assert_int_equal(truncate(p, cuts[i]), 0);
    td_status s = td_idx_read(p, 0, &a);
    if (s != TD_ERR_FORMAT)
      fail_msg("cut at %ld of %ld: got %s (%s)", cuts[i], full, td_status_name(s),
               td_last_error());
    assert_non_null(strstr(td_last_error(), "cut.gz"));
  }
  /* A flipped byte inside the compressed data: zlib's data or CRC check catches it. */
  write_idx(tmpdir_file(&d, "flip.gz", p, sizeof p), true, 0x08, 2, dims, data, sizeof data);
  {
    FILE *f = fopen(p, "r+b");
    long n = file_size(p);
    fseek(f, n / 2, SEEK_SET);
    int c = fgetc(f);
    fseek(f, n / 2, SEEK_SET);
    fputc(c ^ 0x40, f);
    fclose(f);
  }
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "flip.gz");
  /* A raw IDX file cut short. */
  write_idx(tmpdir_file(&d, "cut.raw", p, sizeof p), false, 0x08, 2, dims, data, sizeof data);
  assert_int_equal(truncate(p, 500), 0);
  assert_error(td_idx_read(p, 0, &a), TD_ERR_FORMAT, "truncated");

  assert_memory_equal(&a, &before, sizeof a);
  TD_ASSERT_STATUS(td_idx_read(NULL, 0, &a), TD_ERR_INVALID);
  tmpdir_remove(&d);
}

/* ---- data sets ---- */

static void check_batch(const td_mnist *ds, const int64_t *idx, int64_t n, bool flatten,
                        double mean, double std, int64_t rows, int64_t cols) {
  td_tensor *x = NULL, *y = NULL;
  TD_ASSERT_OK(td_mnist_batch(ds, idx, n, flatten, &x, &y));
  assert_int_equal(td_tensor_dtype(x), TD_DTYPE_F32);
  assert_int_equal(td_tensor_dtype(y), TD_DTYPE_I64);
  if (flatten) {
    assert_int_equal(td_tensor_ndim(x), 2);
    assert_int_equal(td_tensor_size(x, 1), rows * cols);
  } else {
    assert_int_equal(td_tensor_ndim(x), 4);
    assert_int_equal(td_tensor_size(x, 1), 1);
    assert_int_equal(td_tensor_size(x, 2), rows);
    assert_int_equal(td_tensor_size(x, 3), cols);
  }
  assert_int_equal(td_tensor_size(x, 0), n);
  assert_int_equal(td_tensor_ndim(y), 1);
  assert_int_equal(td_tensor_size(y, 0), n);
  const float *xd = td_tensor_data(x);
  const int64_t *yd = td_tensor_data(y);
  for (int64_t b = 0; b < n; b++) {
    assert_int_equal(yd[b], label(idx[b]));
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) {
        double want = (pixel(idx[b], r, c) / 255.0 - mean) / std;
        double got = xd[(b * rows + r) * cols + c];
        if (!(got >= want - 1e-5 && got <= want + 1e-5))
          fail_msg("sample %lld (%lld, %lld): got %g want %g", (long long)idx[b], (long long)r,
                   (long long)c, got, want);
      }
  }
  td_tensor_unref(x);
  td_tensor_unref(y);
}

static void test_mnist_load_values_and_batches(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char ip[512], lp[512];
  tmpdir_file(&d, "imgs.gz", ip, sizeof ip);
  tmpdir_file(&d, "lbls.gz", lp, sizeof lp);
  write_mnist(ip, lp, 37, 5, 6, 37);

  td_mnist *ds = NULL;
  TD_ASSERT_OK(td_mnist_load_files(ip, lp, NULL, &ds));
  assert_int_equal(td_mnist_count(ds), 37);
  assert_int_equal(td_mnist_rows(ds), 5);
  assert_int_equal(td_mnist_cols(ds), 6);
  assert_int_equal(td_mnist_num_classes(ds), 10);
  assert_int_equal(td_mnist_pixels(ds)[(3 * 5 + 2) * 6 + 4], pixel(3, 2, 4));
  assert_int_equal(td_mnist_labels(ds)[36], label(36));
  int64_t idx[] = {0, 36, 5, 5, 17};
  check_batch(ds, idx, 5, false, 0.0, 1.0, 5, 6);
  check_batch(ds, idx, 5, true, 0.0, 1.0, 5, 6);
  /* Scaled values are in [0, 1] and reach both ends for bytes 0 and 255. */
  int64_t bad = 37;
  td_tensor *x = NULL;
  TD_ASSERT_STATUS(td_mnist_batch(ds, &bad, 1, false, &x, NULL), TD_ERR_INVALID);
  assert_null(x);
  /* Labels only. */
  td_tensor *y = NULL;
  TD_ASSERT_OK(td_mnist_batch(ds, idx, 2, false, NULL, &y));
  assert_int_equal(((int64_t *)td_tensor_data(y))[1], label(36));
  td_tensor_unref(y);
  td_mnist_destroy(ds);

  /* Normalisation and limit. */
  td_mnist_opts o;
  td_mnist_opts_init(&o);
  o.mean = TD_FASHION_MNIST_MEAN;
  o.std = TD_FASHION_MNIST_STD;
  o.limit = 20;
  TD_ASSERT_OK(td_mnist_load_files(ip, lp, &o, &ds));
  assert_int_equal(td_mnist_count(ds), 20);
  int64_t idx2[] = {19, 0, 7};
  check_batch(ds, idx2, 3, false, TD_FASHION_MNIST_MEAN, TD_FASHION_MNIST_STD, 5, 6);
  int64_t past = 20;
  TD_ASSERT_STATUS(td_mnist_batch(ds, &past, 1, true, &x, NULL), TD_ERR_INVALID);
  td_mnist_destroy(ds);
  o.std = 0;
  TD_ASSERT_STATUS(td_mnist_load_files(ip, lp, &o, &ds), TD_ERR_INVALID);
  tmpdir_remove(&d);
}

static void test_mnist_load_from_dir_and_env(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char ip[512], lp[512];
  write_mnist(tmpdir_file(&d, "train-images-idx3-ubyte.gz", ip, sizeof ip),
              tmpdir_file(&d, "train-labels-idx1-ubyte.gz", lp, sizeof lp), 12, 28, 28, 12);
  /* The test split uncompressed: found under the name without .gz. */
  {
    uint8_t px[3 * 28 * 28], lb[3] = {1, 2, 3};
    for (size_t i = 0; i < sizeof px; i++) px[i] = (uint8_t)i;
    uint32_t idims[3] = {3, 28, 28}, ldims[1] = {3};
    write_idx(tmpdir_file(&d, "t10k-images-idx3-ubyte", ip, sizeof ip), false, 0x08, 3, idims,
              px, sizeof px);
    write_idx(tmpdir_file(&d, "t10k-labels-idx1-ubyte", lp, sizeof lp), false, 0x08, 1, ldims,
              lb, sizeof lb);
  }
  td_mnist_opts o;
  td_mnist_opts_init(&o);
  o.dir = d.path;
  td_mnist *ds = NULL;
  TD_ASSERT_OK(td_mnist_load(TD_MNIST_TRAIN, &o, &ds));
  assert_int_equal(td_mnist_count(ds), 12);
  td_mnist_destroy(ds);
  TD_ASSERT_OK(td_mnist_load(TD_MNIST_TEST, &o, &ds));
  assert_int_equal(td_mnist_count(ds), 3);
  assert_int_equal(td_mnist_num_classes(ds), 4);
  td_mnist_destroy(ds);

  /* TD_DATA_DIR is used when no directory is given, and an argument overrides it. */
  const char *old = getenv("TD_DATA_DIR");
  char *saved = old ? strdup(old) : NULL;
  setenv("TD_DATA_DIR", d.path, 1);
  char buf[512];
  assert_string_equal(td_mnist_data_dir(NULL, buf, sizeof buf), d.path);
  assert_string_equal(td_mnist_data_dir("/elsewhere", buf, sizeof buf), "/elsewhere");
  TD_ASSERT_OK(td_mnist_load(TD_MNIST_TRAIN, NULL, &ds));
  assert_int_equal(td_mnist_count(ds), 12);
  td_mnist_destroy(ds);
  o.dir = "/nonexistent/td_data_dir";
  ds = NULL;
  assert_error(td_mnist_load(TD_MNIST_TRAIN, &o, &ds), TD_ERR_NOT_FOUND,
               "/nonexistent/td_data_dir/train-images-idx3-ubyte.gz");
  assert_null(ds);
  unsetenv("TD_DATA_DIR");
  assert_string_equal(td_mnist_data_dir("", buf, sizeof buf), TD_MNIST_DEFAULT_DIR);
  if (saved) {
    setenv("TD_DATA_DIR", saved, 1);
    free(saved);
  }
  tmpdir_remove(&d);
}

static void test_mnist_load_rejects_mismatched_files(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char ip[512], lp[512];
  tmpdir_file(&d, "imgs.gz", ip, sizeof ip);
  tmpdir_file(&d, "lbls.gz", lp, sizeof lp);
  td_mnist *ds = NULL;
  /* Count mismatch between images and labels. */
  write_mnist(ip, lp, 10, 4, 4, 9);
  assert_error(td_mnist_load_files(ip, lp, NULL, &ds), TD_ERR_FORMAT, "10 images");
  assert_non_null(strstr(td_last_error(), "9 labels"));
  /* Files swapped: the labels file has 1 dimension where 3 are needed. */
  write_mnist(ip, lp, 10, 4, 4, 10);
  assert_error(td_mnist_load_files(lp, ip, NULL, &ds), TD_ERR_FORMAT, "lbls.gz");
  /* Images of zero width. */
  write_mnist(ip, lp, 10, 4, 0, 10);
  assert_error(td_mnist_load_files(ip, lp, NULL, &ds), TD_ERR_FORMAT, "4x0");
  /* A truncated labels file. */
  write_mnist(ip, lp, 10, 4, 4, 10);
  assert_int_equal(truncate(lp, file_size(lp) - 3), 0);
  assert_error(td_mnist_load_files(ip, lp, NULL, &ds), TD_ERR_FORMAT, "lbls.gz");
  assert_null(ds);
  tmpdir_remove(&d);
}

/* ---- samplers ---- */

/* collect runs one epoch of s into out (capacity cap) and returns how many indices came. */
static int64_t collect(td_sampler *s, int64_t *out, int64_t cap, int64_t *batches) {
  int64_t k = 0, nb = 0;
  for (;;) {
    const int64_t *idx;
    int64_t n;
    TD_ASSERT_OK(td_sampler_next(s, &idx, &n));
    if (n == 0) {
      assert_null(idx);
      break;
    }
    assert_true(k + n <= cap);
    memcpy(out + k, idx, (size_t)n * sizeof *idx);
    k += n;
    nb++;
  }
  if (batches) *batches = nb;
  return k;
}

static void assert_permutation(const int64_t *v, int64_t n) {
  char *seen = calloc((size_t)n + 1, 1);
  for (int64_t i = 0; i < n; i++) {
    assert_true(v[i] >= 0 && v[i] < n);
    assert_false(seen[v[i]]);
    seen[v[i]] = 1;
  }
  free(seen);
}

static void test_sampler_shuffle_deterministic_permutation(void **state) {
  (void)state;
  enum { N = 1000 };
  int64_t a[N], b[N], c[N];
  td_sampler_opts o;
  td_sampler_opts_init(&o);
  assert_int_equal(o.batch_size, 64);
  assert_int_equal(o.world, 1);
  td_sampler *s = NULL;
  /* No shuffling: 0..N-1 in order. */
  TD_ASSERT_OK(td_sampler_create(N, &o, &s));
  int64_t nb;
  assert_int_equal(collect(s, a, N, &nb), N);
  assert_int_equal(nb, (N + 63) / 64);
  assert_int_equal(td_sampler_num_batches(s), nb);
  for (int64_t i = 0; i < N; i++) assert_int_equal(a[i], i);
  /* The end of an epoch repeats until restarted. */
  const int64_t *idx;
  int64_t n;
  TD_ASSERT_OK(td_sampler_next(s, &idx, &n));
  assert_int_equal(n, 0);
  td_sampler_destroy(s);

  o.shuffle = true;
  o.seed = 42;
  o.batch_size = 10;
  TD_ASSERT_OK(td_sampler_create(N, &o, &s));
  assert_int_equal(collect(s, a, N, NULL), N);
  assert_permutation(a, N);
  int64_t fixed = 0;
  for (int64_t i = 0; i < N; i++) fixed += a[i] == i;
  assert_true(fixed < 20); /* a shuffle, not the identity */
  /* Same seed, same epoch: same order, from a fresh sampler and after a restart. */
  td_sampler *s2 = NULL;
  TD_ASSERT_OK(td_sampler_create(N, &o, &s2));
  assert_int_equal(collect(s2, b, N, NULL), N);
  assert_memory_equal(a, b, sizeof a);
  TD_ASSERT_OK(td_sampler_set_epoch(s2, 0));
  assert_int_equal(collect(s2, b, N, NULL), N);
  assert_memory_equal(a, b, sizeof a);
  /* Next epoch: another permutation. */
  TD_ASSERT_OK(td_sampler_set_epoch(s, 1));
  assert_int_equal(td_sampler_epoch(s), 1);
  assert_int_equal(collect(s, c, N, NULL), N);
  assert_permutation(c, N);
  assert_memory_not_equal(a, c, sizeof a);
  TD_ASSERT_OK(td_sampler_set_epoch(s2, 1));
  assert_int_equal(collect(s2, b, N, NULL), N);
  assert_memory_equal(b, c, sizeof b);
  td_sampler_destroy(s2);
  /* Another seed: another permutation. */
  o.seed = 43;
  TD_ASSERT_OK(td_sampler_create(N, &o, &s2));
  assert_int_equal(collect(s2, b, N, NULL), N);
  assert_memory_not_equal(a, b, sizeof a);
  td_sampler_destroy(s2);
  td_sampler_destroy(s);

  /* Position counts of a small shuffle are roughly uniform (catches a biased Fisher-Yates). */
  int counts[5][5] = {{0}};
  o.batch_size = 5;
  for (uint64_t seed = 0; seed < 5000; seed++) {
    o.seed = seed;
    TD_ASSERT_OK(td_sampler_create(5, &o, &s));
    int64_t v[5];
    assert_int_equal(collect(s, v, 5, NULL), 5);
    for (int i = 0; i < 5; i++) counts[i][v[i]]++;
    td_sampler_destroy(s);
  }
  for (int i = 0; i < 5; i++)
    for (int j = 0; j < 5; j++)
      if (counts[i][j] < 850 || counts[i][j] > 1150)
        fail_msg("value %d at position %d %d times out of 5000", j, i, counts[i][j]);
}

static void test_sampler_shards_disjoint_and_covering(void **state) {
  (void)state;
  enum { N = 103 };
  for (int even = 0; even < 2; even++)
    for (int world = 1; world <= 5; world++) {
      int seen[N] = {0};
      int64_t total = 0;
      for (int rank = 0; rank < world; rank++) {
        td_sampler_opts o;
        td_sampler_opts_init(&o);
        o.shuffle = true;
        o.seed = 7;
        o.batch_size = 8;
        o.rank = rank;
        o.world = world;
        o.even_shards = even;
        td_sampler *s = NULL;
        TD_ASSERT_OK(td_sampler_create(N, &o, &s));
        TD_ASSERT_OK(td_sampler_set_epoch(s, 3));
        int64_t v[N];
        int64_t k = collect(s, v, N, NULL);
        assert_int_equal(k, td_sampler_shard_size(s));
        if (even) assert_int_equal(k, N / world);
        else assert_true(k == N / world || k == N / world + 1);
        for (int64_t i = 0; i < k; i++) {
          assert_true(v[i] >= 0 && v[i] < N);
          assert_int_equal(seen[v[i]], 0); /* disjoint across ranks */
          seen[v[i]] = 1;
        }
        total += k;
        td_sampler_destroy(s);
      }
      if (even) assert_int_equal(total, N - N % world);
      else {
        assert_int_equal(total, N); /* covering */
        for (int i = 0; i < N; i++) assert_int_equal(seen[i], 1);
      }
    }
  /* Bad options. */
  td_sampler_opts o;
  td_sampler_opts_init(&o);
  td_sampler *s = NULL;
  o.rank = 2;
  o.world = 2;
  TD_ASSERT_STATUS(td_sampler_create(10, &o, &s), TD_ERR_INVALID);
  o.rank = 0;
  o.batch_size = 0;
  TD_ASSERT_STATUS(td_sampler_create(10, &o, &s), TD_ERR_INVALID);
  assert_null(s);
}

static void test_sampler_drop_last(void **state) {
  (void)state;
  td_sampler_opts o;
  td_sampler_opts_init(&o);
  o.batch_size = 10;
  td_sampler *s = NULL;
  int64_t v[95], nb;
  TD_ASSERT_OK(td_sampler_create(95, &o, &s));
  assert_int_equal(collect(s, v, 95, &nb), 95);
  assert_int_equal(nb, 10);
  td_sampler_destroy(s);
  o.drop_last = true;
  TD_ASSERT_OK(td_sampler_create(95, &o, &s));
  assert_int_equal(td_sampler_num_batches(s), 9);
  assert_int_equal(collect(s, v, 95, &nb), 90);
  assert_int_equal(nb, 9);
  td_sampler_destroy(s);
  /* Fewer samples than one batch: nothing with drop_last. */
  TD_ASSERT_OK(td_sampler_create(5, &o, &s));
  assert_int_equal(collect(s, v, 95, &nb), 0);
  assert_int_equal(nb, 0);
  td_sampler_destroy(s);
  /* An empty data set. */
  o.drop_last = false;
  TD_ASSERT_OK(td_sampler_create(0, &o, &s));
  assert_int_equal(collect(s, v, 95, &nb), 0);
  td_sampler_destroy(s);
}

static void test_mnist_loader_epochs(void **state) {
  (void)state;
  tmpdir d;
  tmpdir_make(&d);
  char ip[512], lp[512];
  tmpdir_file(&d, "imgs.gz", ip, sizeof ip);
  tmpdir_file(&d, "lbls.gz", lp, sizeof lp);
  write_mnist(ip, lp, 50, 28, 28, 50);
  td_mnist *ds = NULL;
  TD_ASSERT_OK(td_mnist_load_files(ip, lp, NULL, &ds));
  td_sampler_opts o;
  td_sampler_opts_init(&o);
  o.batch_size = 16;
  o.shuffle = true;
  o.seed = 1;
  td_mnist_loader *l = NULL;
  TD_ASSERT_OK(td_mnist_loader_create(ds, &o, true, &l));
  assert_int_equal(td_sampler_num_batches(td_mnist_loader_sampler(l)), 4);
  int64_t first[2][50];
  for (int epoch = 0; epoch < 2; epoch++) {
    TD_ASSERT_OK(td_mnist_loader_set_epoch(l, (uint64_t)epoch));
    int64_t k = 0, nb = 0;
    int label_count[10] = {0};
    for (;;) {
      td_tensor *x = NULL, *y = NULL;
      TD_ASSERT_OK(td_mnist_loader_next(l, &x, &y));
      if (!x) {
        assert_null(y);
        break;
      }
      int64_t b = td_tensor_size(x, 0);
      assert_int_equal(td_tensor_ndim(x), 2);
      assert_int_equal(td_tensor_size(x, 1), 784);
      assert_int_equal(b, nb < 3 ? 16 : 2);
      const int64_t *yd = td_tensor_data(y);
      const float *xd = td_tensor_data(x);
      for (int64_t i = 0; i < b; i++) {
        /* Identify the sample by its first pixels and check the label goes with it. */
        int64_t id = -1;
        for (int64_t cand = 0; cand < 50; cand++)
          if (xd[i * 784 + 27 * 28 + 27] == pixel(cand, 27, 27) / 255.0f &&
              xd[i * 784 + 1 * 28 + 2] == pixel(cand, 1, 2) / 255.0f &&
              xd[i * 784] == pixel(cand, 0, 0) / 255.0f && label(cand) == yd[i]) {
            id = cand;
            break;
          }
        assert_true(id >= 0);
        first[epoch][k++] = id;
        label_count[yd[i]]++;
      }
      nb++;
      td_tensor_unref(x);
      td_tensor_unref(y);
    }
    assert_int_equal(nb, 4);
    assert_int_equal(k, 50);
    assert_permutation(first[epoch], 50);
    for (int c = 0; c < 10; c++) assert_int_equal(label_count[c], 5);
  }
  assert_memory_not_equal(first[0], first[1], sizeof first[0]);
  td_mnist_loader_destroy(l);
  /* [B, 1, 28, 28] when not flattened. */
  TD_ASSERT_OK(td_mnist_loader_create(ds, NULL, false, &l));
  td_tensor *x = NULL, *y = NULL;
  TD_ASSERT_OK(td_mnist_loader_next(l, &x, &y));
  assert_int_equal(td_tensor_ndim(x), 4);
  assert_int_equal(td_tensor_size(x, 0), 50);
  assert_int_equal(td_tensor_size(x, 1), 1);
  assert_int_equal(td_tensor_size(x, 2), 28);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_mnist_loader_destroy(l);
  td_mnist_destroy(ds);
  tmpdir_remove(&d);
}

/* ---- the real data set ---- */

static void test_mnist_real_fashion_mnist(void **state) {
  (void)state;
  char dir[4096], p[4200];
  td_mnist_data_dir(NULL, dir, sizeof dir);
  snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", dir);
  if (access(p, R_OK) != 0) {
    print_message("Fashion-MNIST not found in %s; skipping\n", dir);
    skip();
  }
  td_mnist *train = NULL, *test = NULL;
  TD_ASSERT_OK(td_mnist_load(TD_MNIST_TRAIN, NULL, &train));
  TD_ASSERT_OK(td_mnist_load(TD_MNIST_TEST, NULL, &test));
  assert_int_equal(td_mnist_count(train), 60000);
  assert_int_equal(td_mnist_count(test), 10000);
  assert_int_equal(td_mnist_rows(train), 28);
  assert_int_equal(td_mnist_cols(test), 28);
  assert_int_equal(td_mnist_num_classes(train), 10);
  assert_int_equal(td_mnist_num_classes(test), 10);
  /* Both splits are balanced: 6000 and 1000 per class. */
  int hist[2][10] = {{0}};
  for (int64_t i = 0; i < 60000; i++) hist[0][td_mnist_labels(train)[i]]++;
  for (int64_t i = 0; i < 10000; i++) hist[1][td_mnist_labels(test)[i]]++;
  for (int c = 0; c < 10; c++) {
    assert_int_equal(hist[0][c], 6000);
    assert_int_equal(hist[1][c], 1000);
  }
  /* The published mean and std of the training pixels (Fashion-MNIST, or MNIST when TD_DATA_DIR
   * points there). */
  double sum = 0, sq = 0;
  const uint8_t *px = td_mnist_pixels(train);
  for (int64_t i = 0; i < 60000LL * 784; i++) {
    double v = px[i] / 255.0;
    sum += v;
    sq += v * v;
  }
  double n = 60000.0 * 784, mean = sum / n, std = sqrt(sq / n - mean * mean);
  bool fashion = fabs(mean - TD_FASHION_MNIST_MEAN) < 5e-4 && fabs(std - TD_FASHION_MNIST_STD) < 5e-4;
  bool mnist = fabs(mean - TD_MNIST_MEAN) < 5e-4 && fabs(std - TD_MNIST_STD) < 5e-4;
  if (!fashion && !mnist) fail_msg("training pixels: mean %.4f std %.4f", mean, std);
  td_mnist_destroy(train);
  td_mnist_destroy(test);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_idx_read_gzip_and_raw),
      cmocka_unit_test(test_idx_read_rejects_corrupt_files),
      cmocka_unit_test(test_mnist_load_values_and_batches),
      cmocka_unit_test(test_mnist_load_from_dir_and_env),
      cmocka_unit_test(test_mnist_load_rejects_mismatched_files),
      cmocka_unit_test(test_sampler_shuffle_deterministic_permutation),
      cmocka_unit_test(test_sampler_shards_disjoint_and_covering),
      cmocka_unit_test(test_sampler_drop_last),
      cmocka_unit_test(test_mnist_loader_epochs),
      cmocka_unit_test(test_mnist_real_fashion_mnist),
  };
  return cmocka_run_group_tests_name("data", tests, NULL, NULL);
}
