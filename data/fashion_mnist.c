/* fashion_mnist.c - MNIST-layout image classification data sets (Fashion-MNIST, MNIST).
 *
 * A td_mnist holds the raw pixel bytes and labels of one split as read by td_idx_read(), plus a
 * 256-entry table mapping a byte to its scaled and normalised float, so a batch is a gather
 * through that table (no per-pixel division). Immutable after loading: any number of threads may
 * gather batches at once.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../core/core.h"
#include "tdist/data.h"

struct td_mnist {
  td_idx images; /* [count, rows, cols] */
  td_idx labels; /* [count] */
  int64_t count;
  int64_t rows, cols;
  int num_classes;
  float lut[256]; /* byte -> (v / 255 - mean) / std */
};

static const char *const split_images[] = {"train-images-idx3-ubyte", "t10k-images-idx3-ubyte"};
static const char *const split_labels[] = {"train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"};

void td_mnist_opts_init(td_mnist_opts *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->mean = 0.0;
  o->std = 1.0;
}

const char *td_mnist_data_dir(const char *dir, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  if (!dir || !*dir) dir = getenv("TD_DATA_DIR");
  if (!dir || !*dir) dir = TD_MNIST_DEFAULT_DIR;
  snprintf(buf, n, "%s", dir);
  return buf;
}

/* find_file writes dir/base.gz into buf when it exists, else dir/base when that exists, else
 * dir/base.gz (so the error names the preferred file). */
static void find_file(const char *dir, const char *base, char *buf, size_t n) {
  struct stat st;
  snprintf(buf, n, "%s/%s.gz", dir, base);
  if (stat(buf, &st) == 0) return;
  snprintf(buf, n, "%s/%s", dir, base);
  if (stat(buf, &st) == 0) return;
  snprintf(buf, n, "%s/%s.gz", dir, base);
}

td_status td_mnist_load(td_mnist_split split, const td_mnist_opts *opts, td_mnist **out) {
  TD_CHECK_ARG(out, "td_mnist_load: out must not be NULL");
  TD_CHECK_ARG(split == TD_MNIST_TRAIN || split == TD_MNIST_TEST,
               "td_mnist_load: unknown split %d", (int)split);
  char dir[4096], images[4200], labels[4200];
  td_mnist_data_dir(opts ? opts->dir : NULL, dir, sizeof dir);
  find_file(dir, split_images[split], images, sizeof images);
  find_file(dir, split_labels[split], labels, sizeof labels);
  return td_mnist_load_files(images, labels, opts, out);
}

td_status td_mnist_load_files(const char *images_path, const char *labels_path,
                              const td_mnist_opts *opts, td_mnist **out) {
  TD_CHECK_ARG(images_path && labels_path && out,
               "td_mnist_load_files: paths and out must not be NULL");
  td_mnist_opts def;
  td_mnist_opts_init(&def);
  if (!opts) opts = &def;
  TD_CHECK_ARG(opts->std > 0, "td_mnist_load: std must be > 0 (got %g)", opts->std);
  TD_CHECK_ARG(opts->limit >= 0, "td_mnist_load: limit must be >= 0 (got %lld)",
               (long long)opts->limit);

  td_mnist *ds = td__calloc(1, sizeof *ds);
  if (!ds) return td_set_error(TD_ERR_NOMEM, "td_mnist_load: out of memory");
  td_status s = td_idx_read(images_path, 3, &ds->images);
  if (s != TD_OK) goto fail;
  if ((s = td_idx_read(labels_path, 1, &ds->labels)) != TD_OK) goto fail;

  int64_t n = ds->images.dims[0];
  ds->rows = ds->images.dims[1];
  ds->cols = ds->images.dims[2];
  if (ds->labels.dims[0] != n) {
    s = td_set_error(TD_ERR_FORMAT, "%s holds %lld images but %s holds %lld labels", images_path,
                     (long long)n, labels_path, (long long)ds->labels.dims[0]);
    goto fail;
  }
  if (ds->rows <= 0 || ds->cols <= 0) {
    s = td_set_error(TD_ERR_FORMAT, "%s: images of size %lldx%lld", images_path,
                     (long long)ds->rows, (long long)ds->cols);
    goto fail;
  }
  ds->count = opts->limit > 0 && opts->limit < n ? opts->limit : n;
  int maxl = -1;
  for (int64_t i = 0; i < ds->count; i++)
    if (ds->labels.data[i] > maxl) maxl = ds->labels.data[i];
  ds->num_classes = maxl + 1;
  for (int v = 0; v < 256; v++)
    ds->lut[v] = (float)(((double)v / 255.0 - opts->mean) / opts->std);
  *out = ds;
  return TD_OK;
fail:
  td_mnist_destroy(ds);
  return s;
}

void td_mnist_destroy(td_mnist *ds) {
  if (!ds) return;
  td_idx_fini(&ds->images);
  td_idx_fini(&ds->labels);
  td__free(ds);
}

int64_t td_mnist_count(const td_mnist *ds) { return ds ? ds->count : 0; }
int64_t td_mnist_rows(const td_mnist *ds) { return ds ? ds->rows : 0; }
int64_t td_mnist_cols(const td_mnist *ds) { return ds ? ds->cols : 0; }
int td_mnist_num_classes(const td_mnist *ds) { return ds ? ds->num_classes : 0; }
const uint8_t *td_mnist_pixels(const td_mnist *ds) { return ds ? ds->images.data : NULL; }
const uint8_t *td_mnist_labels(const td_mnist *ds) { return ds ? ds->labels.data : NULL; }

td_status td_mnist_batch(const td_mnist *ds, const int64_t *idx, int64_t n, bool flatten,
                         td_tensor **x, td_tensor **y) {
  TD_CHECK_ARG(ds && (idx || n == 0), "td_mnist_batch: ds and idx must not be NULL");
  TD_CHECK_ARG(n >= 0, "td_mnist_batch: negative batch size %lld", (long long)n);
  for (int64_t i = 0; i < n; i++)
    TD_CHECK_ARG(idx[i] >= 0 && idx[i] < ds->count,
                 "td_mnist_batch: index %lld (position %lld) out of range [0, %lld)",
                 (long long)idx[i], (long long)i, (long long)ds->count);
  const int64_t pix = ds->rows * ds->cols;
  td_tensor *xt = NULL, *yt = NULL;
  td_status s = TD_OK;
  if (x) {
    int64_t shape4[4] = {n, 1, ds->rows, ds->cols};
    int64_t shape2[2] = {n, pix};
    s = flatten ? td_tensor_empty(shape2, 2, TD_DTYPE_F32, td_device_cpu(), &xt)
                : td_tensor_empty(shape4, 4, TD_DTYPE_F32, td_device_cpu(), &xt);
    if (s != TD_OK) goto out;
    float *dst = td_tensor_data(xt);
    for (int64_t i = 0; i < n; i++) {
      const uint8_t *src = ds->images.data + idx[i] * pix;
      float *d = dst + i * pix;
      for (int64_t j = 0; j < pix; j++) d[j] = ds->lut[src[j]];
    }
  }
  if (y) {
    int64_t shape1[1] = {n};
    if ((s = td_tensor_empty(shape1, 1, TD_DTYPE_I64, td_device_cpu(), &yt)) != TD_OK) goto out;
    int64_t *dst = td_tensor_data(yt);
    for (int64_t i = 0; i < n; i++) dst[i] = ds->labels.data[idx[i]];
  }
  if (x) *x = xt;
  if (y) *y = yt;
  return TD_OK;
out:
  td_tensor_unref(xt);
  td_tensor_unref(yt);
  return s;
}
