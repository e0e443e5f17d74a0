/* tensor.c - storage, tensor lifecycle, metadata, creation, devices and generators.
 *
 * A tensor owns one reference to its storage and (when it is a non-leaf) one to its grad_fn.
 * Storage memory comes from the device's backend (td__backend.alloc) unless borrowed from the
 * caller, in which case the caller's release callback runs when the storage dies.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_impl.h"
#include "storage.h"

#ifndef TD_HAVE_CUDA
const td__backend *td__cuda_backend = NULL;
#endif

/* ---- devices and dtypes ---- */

td_device td_device_cpu(void) { return (td_device){TD_DEVICE_CPU, 0}; }
td_device td_device_cuda(int index) { return (td_device){TD_DEVICE_CUDA, index}; }

bool td_device_equal(td_device a, td_device b) {
  return a.type == b.type && (a.type == TD_DEVICE_CPU || a.index == b.index);
}

td_status td_device_parse(const char *text, td_device *out) {
  TD_CHECK_ARG(text && out, "device_parse: NULL argument");
  if (strcmp(text, "cpu") == 0) {
    *out = td_device_cpu();
    return TD_OK;
  }
  if (strcmp(text, "cuda") == 0) {
    *out = td_device_cuda(0);
    return TD_OK;
  }
  if (strncmp(text, "cuda:", 5) == 0 && text[5]) {
    char *end = NULL;
    long v = strtol(text + 5, &end, 10);
    if (*end == '\0' && v >= 0 && v < 1024) {
      *out = td_device_cuda((int)v);
      return TD_OK;
    }
  }
  return td_set_error(TD_ERR_INVALID, "device_parse: '%s' is not a device (use cpu, cuda or cuda:N)",
                      text);
}

const char *td_device_str(td_device d, char *buf, size_t n) {
  if (d.type == TD_DEVICE_CPU) snprintf(buf, n, "cpu");
  else snprintf(buf, n, "cuda:%d", d.index);
  return buf;
}

bool td_device_available(td_device d) {
  if (d.type == TD_DEVICE_CPU) return true;
  return td__cuda_backend != NULL && d.index >= 0 && d.index < td_cuda_device_count();
}

const td__backend *td__backend_for(td_device d) {
  if (d.type == TD_DEVICE_CPU) return &td__cpu_backend;
  if (d.type == TD_DEVICE_CUDA && td__cuda_backend) {
    if (d.index < 0 || d.index >= td_cuda_device_count()) {
      td_set_error(TD_ERR_DEVICE, "device cuda:%d is not available (%d CUDA devices)", d.index,
                   td_cuda_device_count());
      return NULL;
    }
    return td__cuda_backend;
  }
  td_set_error(TD_ERR_UNSUPPORTED, "this build of tdist has no CUDA support");
  return NULL;
}

const td__backend *td__backend_of(const td_tensor *t) {
  if (t->storage->device.type == TD_DEVICE_CPU) return &td__cpu_backend;
  return td__cuda_backend;
}

size_t td_dtype_size(td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F64:
    case TD_DTYPE_I64: return 8;
    case TD_DTYPE_F32:
    case TD_DTYPE_I32: return 4;
    case TD_DTYPE_F16:
    case TD_DTYPE_BF16: return 2;
    case TD_DTYPE_U8:
    case TD_DTYPE_BOOL: return 1;
  }
  return 0;
}

const char *td_dtype_name(td_dtype dt) {
  switch (dt) {
    case TD_DTYPE_F32: return "float32";
    case TD_DTYPE_F64: return "float64";
    case TD_DTYPE_I64: return "int64";
    case TD_DTYPE_F16: return "float16";
    case TD_DTYPE_BF16: return "bfloat16";
    case TD_DTYPE_I32: return "int32";
    case TD_DTYPE_U8: return "uint8";
    case TD_DTYPE_BOOL: return "bool";
  }
  return "unknown";
}

static bool dtype_valid(td_dtype dt) { return (unsigned)dt < TD_DTYPE_COUNT; }

td_dtype td__promote_float(td_dtype a, td_dtype b) {
  if (a == b) return a;
  if (a == TD_DTYPE_F64 || b == TD_DTYPE_F64) return TD_DTYPE_F64;
  return TD_DTYPE_F32; /* float32 with a 16-bit float, or the two 16-bit floats */
}

bool td_dtype_is_float(td_dtype dt) {
  return dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64 || dt == TD_DTYPE_BF16 || dt == TD_DTYPE_F16;
}

/* ---- generator: PCG-XSL-RR 128/64 ---- */

struct td_generator {
  unsigned __int128 state;
  unsigned __int128 inc;
  bool has_spare;
  double spare;
};

#define PCG_MULT ((((unsigned __int128)2549297995355413924ull) << 64) | 4865540595714422341ull)

uint64_t td_generator_next_u64(td_generator *g) {
  g->state = g->state * PCG_MULT + g->inc;
  uint64_t x = (uint64_t)(g->state >> 64) ^ (uint64_t)g->state;
  unsigned rot = (unsigned)(g->state >> 122);
  return (x >> rot) | (x << ((-rot) & 63));
}

double td_generator_next_double(td_generator *g) {
  return (double)(td_generator_next_u64(g) >> 11) * (1.0 / 9007199254740992.0);
}

td_status td_generator_create(uint64_t seed, td_generator **out) {
  TD_CHECK_ARG(out, "generator_create: NULL out");
  td_generator *g = td__calloc(1, sizeof *g);
  if (!g) return td_set_error(TD_ERR_NOMEM, "generator_create: out of memory");
  g->inc = ((((unsigned __int128)0xda3e39cb94b95bdbull) << 64) | 0x5851f42d4c957f2dull) | 1u;
  g->state = 0;
  td_generator_next_u64(g);
  g->state += ((unsigned __int128)seed << 64) | (seed * 0x9e3779b97f4a7c15ull);
  td_generator_next_u64(g);
  *out = g;
  return TD_OK;
}

void td_generator_destroy(td_generator *g) { td__free(g); }

td_status td__generator_clone(const td_generator *g, td_generator **out) {
  td_generator *c = td__malloc(sizeof *c);
  if (!c) return td_set_error(TD_ERR_NOMEM, "generator: out of memory");
  *c = *g;
  *out = c;
  return TD_OK;
}

void td__generator_copy_state(td_generator *dst, const td_generator *src) { *dst = *src; }

static double gen_normal(td_generator *g) {
  if (g->has_spare) {
    g->has_spare = false;
    return g->spare;
  }
  double u1, u2;
  do u1 = td_generator_next_double(g);
  while (u1 <= 1e-300);
  u2 = td_generator_next_double(g);
  double r = sqrt(-2.0 * log(u1));
  g->spare = r * sin(2.0 * M_PI * u2);
  g->has_spare = true;
  return r * cos(2.0 * M_PI * u2);
}

/* ---- geometry helpers ---- */

int64_t td__shape_numel(const int64_t *shape, int ndim) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

void td__contiguous_strides(const int64_t *shape, int ndim, int64_t *strides) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
}

int td__norm_dim(int dim, int ndim) {
  if (dim < 0) dim += ndim;
  return (dim < 0 || dim >= (ndim > 0 ? ndim : 1)) ? -1 : dim;
}

const char *td__shape_str(const int64_t *shape, int ndim, char *buf, size_t n) {
  size_t used = 0;
  used += (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < ndim && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

const char *td_tensor_shape_str(const td_tensor *t, char *buf, size_t n) {
  if (!t) {
    snprintf(buf, n, "(null)");
    return buf;
  }
  return td__shape_str(t->shape, t->ndim, buf, n);
}

td_status td__broadcast_shape(const char *op, const int64_t *a, int an, const int64_t *b, int bn,
                              int64_t *out, int *out_ndim) {
  int n = an > bn ? an : bn;
  for (int i = 0; i < n; i++) {
    int64_t da = i < n - an ? 1 : a[i - (n - an)];
    int64_t db = i < n - bn ? 1 : b[i - (n - bn)];
    if (da != db && da != 1 && db != 1) {
      char sa[128], sb[128];
      return td_set_error(TD_ERR_SHAPE, "%s: shapes %s and %s cannot be broadcast", op,
                          td__shape_str(a, an, sa, sizeof sa), td__shape_str(b, bn, sb, sizeof sb));
    }
    out[i] = da == 1 ? db : da;
  }
  *out_ndim = n;
  return TD_OK;
}

td_status td__check_same_device(const char *op, const td_tensor *a, const td_tensor *b) {
  if (td_device_equal(a->storage->device, b->storage->device)) return TD_OK;
  char da[16], db[16];
  return td_set_error(TD_ERR_DEVICE, "%s: tensors on different devices (%s and %s)", op,
                      td_device_str(a->storage->device, da, sizeof da),
                      td_device_str(b->storage->device, db, sizeof db));
}

td_status td__check_compute(const char *op, const td_tensor *t) {
  if (t->dtype <= TD_DTYPE_BF16) return TD_OK;
  return td_set_error(TD_ERR_DTYPE,
                      "%s: %s is a transport-only dtype in tdist (create, view, copy, convert, "
                      "send); convert to a float dtype or int64 first (td_tensor_to_dtype)",
                      op, td_dtype_name(t->dtype));
}

td_status td__check_float(const char *op, const td_tensor *t) {
  if (td_dtype_is_float(t->dtype)) return TD_OK;
  return td_set_error(TD_ERR_DTYPE, "%s: expected a float tensor (float32, float64, bfloat16 or "
                      "float16), got %s", op, td_dtype_name(t->dtype));
}

td_status td__check_same_dtype(const char *op, const td_tensor *a, const td_tensor *b) {
  if (a->dtype == b->dtype) return TD_OK;
  return td_set_error(TD_ERR_DTYPE, "%s: dtypes differ (%s and %s)", op, td_dtype_name(a->dtype),
                      td_dtype_name(b->dtype));
}

/* ---- storage ---- */

static void storage_unref(td__storage *s) {
  if (!s || !td__ref_dec(&s->rc)) return;
  if (s->borrowed) {
    if (s->release) s->release(s->release_ctx, s->data);
  } else if (s->data) {
    const td__backend *be = s->device.type == TD_DEVICE_CPU ? &td__cpu_backend : td__cuda_backend;
    be->free(s->device.index, s->data);
  }
  td__free(s);
}

static td_status storage_new(size_t nbytes, td_device dev, td__storage **out) {
  const td__backend *be = td__backend_for(dev);
  if (!be) return TD_ERR_DEVICE;
  td__storage *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "tensor: out of memory");
  td__ref_init(&s->rc);
  s->nbytes = nbytes;
  s->device = dev;
  if (nbytes) {
    td_status st = be->alloc(dev.index, nbytes, &s->data);
    if (st != TD_OK) {
      td__free(s);
      return st;
    }
  }
  *out = s;
  return TD_OK;
}

static td_tensor *tensor_alloc(void) {
  td_tensor *t = td__calloc(1, sizeof *t);
  if (!t) return NULL;
  td__ref_init(&t->rc);
  pthread_mutex_init(&t->grad_mu, NULL);
  return t;
}

static td_status check_shape(const char *op, const int64_t *shape, int ndim) {
  if (ndim < 0 || ndim > TD_MAX_DIMS)
    return td_set_error(TD_ERR_INVALID, "%s: ndim %d out of range [0, %d]", op, ndim, TD_MAX_DIMS);
  if (ndim > 0 && !shape) return td_set_error(TD_ERR_INVALID, "%s: NULL shape", op);
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return td_set_error(TD_ERR_INVALID, "%s: negative size %lld in dim %d", op,
                          (long long)shape[i], i);
  return TD_OK;
}

td_status td__tensor_new(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                         td_tensor **out) {
  TD_TRY(check_shape("tensor", shape, ndim));
  if (!dtype_valid(dt)) return td_set_error(TD_ERR_DTYPE, "tensor: invalid dtype %d", (int)dt);
  if (dt > TD_DTYPE_BF16 && dev.type != TD_DEVICE_CPU)
    return td_set_error(TD_ERR_DTYPE, "tensor: %s tensors live on the CPU only (transport dtype)",
                        td_dtype_name(dt));
  int64_t numel = td__shape_numel(shape, ndim);
  if (numel > (INT64_MAX / 8))
    return td_set_error(TD_ERR_INVALID, "tensor: %lld elements is too many", (long long)numel);
  td_tensor *t = tensor_alloc();
  if (!t) return td_set_error(TD_ERR_NOMEM, "tensor: out of memory");
  td_status st = storage_new((size_t)numel * td_dtype_size(dt), dev, &t->storage);
  if (st != TD_OK) {
    pthread_mutex_destroy(&t->grad_mu);
    td__free(t);
    return st;
  }
  t->ndim = ndim;
  if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
  td__contiguous_strides(t->shape, ndim, t->strides);
  t->dtype = dt;
  *out = t;
  return TD_OK;
}

td_status td__tensor_new_like(const td_tensor *t, td_tensor **out) {
  return td__tensor_new(t->shape, t->ndim, t->dtype, t->storage->device, out);
}

td_status td__tensor_view(const td_tensor *t, const int64_t *shape, const int64_t *strides,
                          int ndim, int64_t offset, td_tensor **out) {
  td_tensor *v = tensor_alloc();
  if (!v) return td_set_error(TD_ERR_NOMEM, "tensor view: out of memory");
  td__ref_inc(&t->storage->rc);
  v->storage = t->storage;
  v->offset = offset;
  v->ndim = ndim;
  if (ndim) {
    memcpy(v->shape, shape, (size_t)ndim * sizeof(int64_t));
    memcpy(v->strides, strides, (size_t)ndim * sizeof(int64_t));
  }
  v->dtype = t->dtype;
  *out = v;
  return TD_OK;
}

/* ---- refcount and metadata ---- */

td_tensor *td_tensor_ref(td_tensor *t) {
  if (t) td__ref_inc(&t->rc);
  return t;
}

void td_tensor_unref(td_tensor *t) {
  if (!t || !td__ref_dec(&t->rc)) return;
  storage_unref(t->storage);
  td_node_unref(t->grad_fn);
  td_tensor_unref(t->grad);
  for (td__hook *h = t->hooks, *n; h; h = n) {
    n = h->next;
    td__free(h);
  }
  pthread_mutex_destroy(&t->grad_mu);
  td__free(t);
}

int td_tensor_ndim(const td_tensor *t) { return t ? t->ndim : 0; }
const int64_t *td_tensor_shape(const td_tensor *t) { return t->shape; }
const int64_t *td_tensor_strides(const td_tensor *t) { return t->strides; }
int64_t td_tensor_size(const td_tensor *t, int dim) {
  if (!t) return -1;
  int d = td__norm_dim(dim, t->ndim);
  return (d < 0 || t->ndim == 0) ? -1 : t->shape[d];
}
int64_t td_tensor_numel(const td_tensor *t) { return t ? td__shape_numel(t->shape, t->ndim) : 0; }
td_dtype td_tensor_dtype(const td_tensor *t) { return t->dtype; }
td_device td_tensor_device(const td_tensor *t) { return t->storage->device; }
size_t td_tensor_nbytes(const td_tensor *t) {
  return (size_t)td_tensor_numel(t) * td_dtype_size(t->dtype);
}

bool td_tensor_is_contiguous(const td_tensor *t) {
  if (td_tensor_numel(t) == 0) return true; /* nothing to lay out */
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 1) continue;
    if (t->strides[i] != s) return false;
    s *= t->shape[i];
  }
  return true;
}

void *td_tensor_data(const td_tensor *t) {
  if (!t || !t->storage->data) return NULL;
  return (char *)t->storage->data + t->offset * (int64_t)td_dtype_size(t->dtype);
}

bool td_tensor_same_shape(const td_tensor *a, const td_tensor *b) {
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* ---- creation ---- */

td_status td_tensor_empty(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                          td_tensor **out) {
  TD_CHECK_ARG(out, "tensor_empty: NULL out");
  return td__tensor_new(shape, ndim, dt, dev, out);
}

td_status td_tensor_full(const int64_t *shape, int ndim, double value, td_dtype dt, td_device dev,
                         td_tensor **out) {
  TD_CHECK_ARG(out, "tensor_full: NULL out");
  td_tensor *t;
  TD_TRY(td__tensor_new(shape, ndim, dt, dev, &t));
  td_status st = td__backend_of(t)->fill(t, value);
  if (st != TD_OK) {
    td_tensor_unref(t);
    return st;
  }
  *out = t;
  return TD_OK;
}

td_status td_tensor_zeros(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                          td_tensor **out) {
  return td_tensor_full(shape, ndim, 0.0, dt, dev, out);
}

td_status td_tensor_ones(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                         td_tensor **out) {
  return td_tensor_full(shape, ndim, 1.0, dt, dev, out);
}

td_status td_tensor_scalar(double value, td_dtype dt, td_device dev, td_tensor **out) {
  return td_tensor_full(NULL, 0, value, dt, dev, out);
}

/* Builds a CPU tensor with fill(i) for each element, then moves it to dev. */
static td_status host_fill_to(const int64_t *shape, int ndim, td_dtype dt, td_device dev,
                              double (*fn)(void *ctx, int64_t i), void *ctx, td_tensor **out) {
  td_tensor *h = NULL;
  TD_TRY(td__tensor_new(shape, ndim, dt, td_device_cpu(), &h));
  int64_t n = td_tensor_numel(h);
  void *d = td_tensor_data(h);
  for (int64_t i = 0; i < n; i++) td__store(d, dt, i, fn(ctx, i));
  if (dev.type == TD_DEVICE_CPU) {
    *out = h;
    return TD_OK;
  }
  td_status st = td_tensor_to(h, dev, out);
  td_tensor_unref(h);
  return st;
}

typedef struct {
  double start, step;
} arange_ctx;
static double arange_fn(void *c, int64_t i) {
  arange_ctx *a = c;
  return a->start + (double)i * a->step;
}

td_status td_tensor_arange(double start, double end, double step, td_dtype dt, td_device dev,
                           td_tensor **out) {
  TD_CHECK_ARG(out, "tensor_arange: NULL out");
  TD_CHECK_ARG(step != 0 && isfinite(start) && isfinite(end) && isfinite(step),
               "tensor_arange: step must be non-zero and bounds finite");
  double cnt = ceil((end - start) / step);
  int64_t n = cnt > 0 ? (int64_t)cnt : 0;
  arange_ctx c = {start, step};
  return host_fill_to(&n, 1, dt, dev, arange_fn, &c, out);
}

typedef struct {
  td_generator *g;
  double a, b;
  bool normal;
} rand_ctx;
static double rand_fn(void *c, int64_t i) {
  rand_ctx *r = c;
  if (r->normal) return r->a + r->b * gen_normal(r->g);
  return r->a + (r->b - r->a) * td_generator_next_double(r->g);
}

td_status td_tensor_uniform(const int64_t *shape, int ndim, double lo, double hi, td_dtype dt,
                            td_device dev, td_generator *g, td_tensor **out) {
  TD_CHECK_ARG(out && g, "tensor_uniform: NULL out or generator");
  TD_CHECK_ARG(td_dtype_is_float(dt), "tensor_uniform: a float dtype is required");
  td__rng_note(g);
  rand_ctx c = {g, lo, hi, false};
  return host_fill_to(shape, ndim, dt, dev, rand_fn, &c, out);
}

td_status td_tensor_normal(const int64_t *shape, int ndim, double mean, double std, td_dtype dt,
                           td_device dev, td_generator *g, td_tensor **out) {
  TD_CHECK_ARG(out && g, "tensor_normal: NULL out or generator");
  TD_CHECK_ARG(td_dtype_is_float(dt), "tensor_normal: a float dtype is required");
  td__rng_note(g);
  rand_ctx c = {g, mean, std, true};
  return host_fill_to(shape, ndim, dt, dev, rand_fn, &c, out);
}

static td_status refill(td_tensor *t, rand_ctx *c) {
  td_tensor *tmp;
  TD_TRY(host_fill_to(t->shape, t->ndim, t->dtype, t->storage->device, rand_fn, c, &tmp));
  td_status st = td__backend_of(t)->copy(t, tmp);
  td_tensor_unref(tmp);
  return st;
}

td_status td_tensor_uniform_(td_tensor *t, double lo, double hi, td_generator *g) {
  TD_CHECK_ARG(t && g, "tensor_uniform_: NULL tensor or generator");
  TD_TRY(td__check_float("tensor_uniform_", t));
  td__rng_note(g);
  rand_ctx c = {g, lo, hi, false};
  return refill(t, &c);
}

td_status td_tensor_normal_(td_tensor *t, double mean, double std, td_generator *g) {
  TD_CHECK_ARG(t && g, "tensor_normal_: NULL tensor or generator");
  TD_TRY(td__check_float("tensor_normal_", t));
  td__rng_note(g);
  rand_ctx c = {g, mean, std, true};
  return refill(t, &c);
}

td_status td_tensor_from_buffer(const void *data, const int64_t *shape, int ndim, td_dtype dt,
                                td_tensor **out) {
  TD_CHECK_ARG(out, "tensor_from_buffer: NULL out");
  td_tensor *t;
  TD_TRY(td__tensor_new(shape, ndim, dt, td_device_cpu(), &t));
  size_t nb = td_tensor_nbytes(t);
  if (nb) {
    if (!data) {
      td_tensor_unref(t);
      return td_set_error(TD_ERR_INVALID, "tensor_from_buffer: NULL data for %zu bytes", nb);
    }
    memcpy(t->storage->data, data, nb);
  }
  *out = t;
  return TD_OK;
}

td_status td_tensor_from_borrowed(void *data, const int64_t *shape, int ndim, td_dtype dt,
                                  td_tensor_release_fn release, void *ctx, td_tensor **out) {
  TD_CHECK_ARG(out, "tensor_from_borrowed: NULL out");
  TD_TRY(check_shape("tensor_from_borrowed", shape, ndim));
  if (!dtype_valid(dt)) return td_set_error(TD_ERR_DTYPE, "tensor_from_borrowed: invalid dtype");
  int64_t numel = td__shape_numel(shape, ndim);
  TD_CHECK_ARG(data || numel == 0, "tensor_from_borrowed: NULL data");
  td_tensor *t = tensor_alloc();
  td__storage *s = td__calloc(1, sizeof *s);
  if (!t || !s) {
    if (t) pthread_mutex_destroy(&t->grad_mu);
    td__free(t);
    td__free(s);
    return td_set_error(TD_ERR_NOMEM, "tensor_from_borrowed: out of memory");
  }
  td__ref_init(&s->rc);
  s->data = data;
  s->nbytes = (size_t)numel * td_dtype_size(dt);
  s->device = td_device_cpu();
  s->borrowed = true;
  s->release = release;
  s->release_ctx = ctx;
  t->storage = s;
  t->ndim = ndim;
  if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
  td__contiguous_strides(t->shape, ndim, t->strides);
  t->dtype = dt;
  *out = t;
  return TD_OK;
}

/* Copies any tensor into a contiguous host buffer. */
td_status td_tensor_copy_to_buffer(const td_tensor *t, void *buf, size_t nbytes) {
  TD_CHECK_ARG(t && (buf || td_tensor_nbytes(t) == 0), "tensor_copy_to_buffer: NULL argument");
  size_t need = td_tensor_nbytes(t);
  if (nbytes < need)
    return td_set_error(TD_ERR_INVALID, "tensor_copy_to_buffer: buffer of %zu bytes < %zu", nbytes,
                        need);
  if (need == 0) return TD_OK;
  const td__backend *be = td__backend_of(t);
  td_tensor *c = NULL;
  TD_TRY(td_tensor_contiguous(t, &c));
  td_status st = be->copy_d2h(c->storage->device.index, buf, td_tensor_data(c), need);
  td_tensor_unref(c);
  return st;
}

td_status td_tensor_get(const td_tensor *t, const int64_t *index, double *out) {
  TD_CHECK_ARG(t && out && (index || t->ndim == 0), "tensor_get: NULL argument");
  int64_t off = t->offset;
  for (int i = 0; i < t->ndim; i++) {
    if (index[i] < 0 || index[i] >= t->shape[i])
      return td_set_error(TD_ERR_INVALID, "tensor_get: index %lld out of range for dim %d (size %lld)",
                          (long long)index[i], i, (long long)t->shape[i]);
    off += index[i] * t->strides[i];
  }
  size_t es = td_dtype_size(t->dtype);
  char tmp[8];
  const char *src = (const char *)t->storage->data + off * (int64_t)es;
  TD_TRY(td__backend_of(t)->copy_d2h(t->storage->device.index, tmp, src, es));
  *out = td__load(tmp, t->dtype, 0);
  return TD_OK;
}

td_status td_tensor_item(const td_tensor *t, double *out) {
  TD_CHECK_ARG(t && out, "tensor_item: NULL argument");
  if (td_tensor_numel(t) != 1) {
    char s[128];
    return td_set_error(TD_ERR_SHAPE, "tensor_item: tensor of shape %s has %lld elements, not 1",
                        td_tensor_shape_str(t, s, sizeof s), (long long)td_tensor_numel(t));
  }
  int64_t idx[TD_MAX_DIMS] = {0};
  return td_tensor_get(t, idx, out);
}

/* ---- in-place ---- */

/* byte_range gives the bytes [*lo, *hi) of t's storage that its elements span (t not empty). */
static void byte_range(const td_tensor *t, int64_t *lo, int64_t *hi) {
  int64_t a = t->offset, b = t->offset, es = (int64_t)td_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; d++) {
    int64_t ext = (t->shape[d] - 1) * t->strides[d];
    if (ext >= 0) b += ext;
    else a += ext;
  }
  *lo = a * es;
  *hi = (b + 1) * es;
}

/* same_view says whether a and b (same shape) read the same elements in the same order. */
static bool same_view(const td_tensor *a, const td_tensor *b) {
  if (a->storage != b->storage || a->offset != b->offset || a->dtype != b->dtype) return false;
  for (int d = 0; d < a->ndim; d++)
    if (a->shape[d] > 1 && a->strides[d] != b->strides[d]) return false;
  return true;
}

/* Copy semantics are the same on every device, whatever the overlap: the result is as if src were
 * read completely before dst is written. A source that is the destination itself is a no-op; a
 * source that overlaps the destination otherwise (x[1:] from x[:-1]) is staged through a
 * temporary (PyTorch refuses it; a plain kernel would smear it on the CPU and race on a GPU). A
 * destination whose elements share memory (an expanded view) is refused, as in PyTorch. */
td_status td_tensor_copy_(td_tensor *dst, const td_tensor *src) {
  TD_CHECK_ARG(dst && src, "tensor_copy_: NULL tensor");
  for (int d = 0; d < dst->ndim; d++)
    if (dst->shape[d] > 1 && dst->strides[d] == 0)
      return td_set_error(TD_ERR_INVALID, "tensor_copy_: several elements of the destination "
                          "share one memory location (an expanded view, dim %d); copy into a "
                          "contiguous tensor instead", d);
  td_tensor *s = NULL;
  td_status st;
  if (!td_tensor_same_shape(dst, src)) {
    TD_TRY(td__expand_view(src, dst->shape, dst->ndim, &s));
  } else {
    s = td_tensor_ref((td_tensor *)src);
  }
  if (!td_device_equal(dst->storage->device, src->storage->device)) {
    td_tensor *moved;
    bool prev = td_autograd_set_enabled(false);
    st = td_tensor_to(s, dst->storage->device, &moved);
    td_autograd_set_enabled(prev);
    td_tensor_unref(s);
    if (st != TD_OK) return st;
    s = moved;
  }
  if (s->storage == dst->storage && td_tensor_numel(dst) > 0) {
    int64_t dlo, dhi, slo, shi;
    byte_range(dst, &dlo, &dhi);
    byte_range(s, &slo, &shi);
    if (same_view(dst, s)) {
      td_tensor_unref(s);
      return TD_OK;
    }
    if (dlo < shi && slo < dhi) { /* may overlap: read everything first */
      td_tensor *tmp = NULL;
      st = td__tensor_new(s->shape, s->ndim, s->dtype, s->storage->device, &tmp);
      if (st == TD_OK) st = td__backend_of(tmp)->copy(tmp, s);
      td_tensor_unref(s);
      if (st != TD_OK) {
        td_tensor_unref(tmp);
        return st;
      }
      s = tmp;
    }
  }
  st = td__backend_of(dst)->copy(dst, s);
  td_tensor_unref(s);
  return st;
}

td_status td_tensor_fill_(td_tensor *t, double value) {
  TD_CHECK_ARG(t, "tensor_fill_: NULL tensor");
  return td__backend_of(t)->fill(t, value);
}

td_status td_tensor_zero_(td_tensor *t) { return td_tensor_fill_(t, 0.0); }

/* ---- device and dtype conversion ---- */

typedef struct {
  td_node base;
  td_device src_device;
  td_dtype src_dtype;
} convert_node;

static td_status convert_backward(td_node *self, td_tensor *const *gout, td_tensor **gin) {
  convert_node *n = (convert_node *)self;
  td_tensor *g = NULL;
  if (!td_device_equal(td_tensor_device(gout[0]), n->src_device)) {
    TD_TRY(td_tensor_to(gout[0], n->src_device, &g));
  } else {
    g = td_tensor_ref(gout[0]);
  }
  if (g->dtype != n->src_dtype) {
    td_tensor *h;
    td_status st = td_tensor_to_dtype(g, n->src_dtype, &h);
    td_tensor_unref(g);
    if (st != TD_OK) return st;
    g = h;
  }
  gin[0] = g;
  return TD_OK;
}

static const td__node_ops convert_ops = {"ToCopyBackward", convert_backward, NULL};

static td_status record_convert(td_tensor *out, const td_tensor *in) {
  td_status st = TD_OK;
  const td_tensor *ins[1] = {in};
  convert_node *n = (convert_node *)td__record(out, sizeof(convert_node), &convert_ops, ins, 1, &st);
  if (n) {
    n->src_device = in->storage->device;
    n->src_dtype = in->dtype;
  }
  return st;
}

td_status td_tensor_to(const td_tensor *t, td_device dev, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_to: NULL argument");
  if (td_device_equal(t->storage->device, dev)) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  td_tensor *c = NULL, *r = NULL;
  td_status st;
  bool prev = td_autograd_set_enabled(false);
  st = td_tensor_contiguous(t, &c);
  td_autograd_set_enabled(prev);
  if (st != TD_OK) return st;
  st = td__tensor_new(t->shape, t->ndim, t->dtype, dev, &r);
  if (st != TD_OK) goto out;
  size_t nb = td_tensor_nbytes(t);
  if (nb) {
    if (t->storage->device.type == TD_DEVICE_CPU) {
      st = td__backend_of(r)->copy_h2d(dev.index, td_tensor_data(r), td_tensor_data(c), nb);
    } else if (dev.type == TD_DEVICE_CPU) {
      st = td__backend_of(c)->copy_d2h(c->storage->device.index, td_tensor_data(r),
                                       td_tensor_data(c), nb);
    } else {
      /* GPU to GPU: the backend copies peer to peer (cudaMemcpyPeer), not through the host. */
      st = td__backend_of(r)->copy(r, c);
    }
    if (st != TD_OK) goto out;
  }
  if (td__needs_grad(t)) st = record_convert(r, t);
out:
  td_tensor_unref(c);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

td_status td_tensor_to_dtype(const td_tensor *t, td_dtype dt, td_tensor **out) {
  TD_CHECK_ARG(t && out, "tensor_to_dtype: NULL argument");
  if (!dtype_valid(dt)) return td_set_error(TD_ERR_DTYPE, "tensor_to_dtype: invalid dtype");
  if (t->dtype == dt) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  td_tensor *r;
  TD_TRY(td__tensor_new(t->shape, t->ndim, dt, t->storage->device, &r));
  td_status st = td__backend_of(t)->copy(r, t);
  if (st == TD_OK && td__needs_grad(t) && td_dtype_is_float(dt))
    st = record_convert(r, t);
  if (st != TD_OK) {
    td_tensor_unref(r);
    return st;
  }
  *out = r;
  return TD_OK;
}

/* ---- comparison ---- */

td_status td_tensor_allclose(const td_tensor *a, const td_tensor *b, double rtol, double atol,
                             bool *out) {
  TD_CHECK_ARG(a && b && out, "tensor_allclose: NULL argument");
  if (!td_tensor_same_shape(a, b)) {
    *out = false;
    return TD_OK;
  }
  int64_t n = td_tensor_numel(a);
  double *x = td__malloc((size_t)n * sizeof(double) + 1);
  double *y = td__malloc((size_t)n * sizeof(double) + 1);
  td_tensor *xa = NULL, *yb = NULL;
  td_status st = TD_OK;
  if (!x || !y) {
    st = td_set_error(TD_ERR_NOMEM, "tensor_allclose: out of memory");
    goto out;
  }
  bool prev = td_autograd_set_enabled(false);
  st = td_tensor_to_dtype(a, TD_DTYPE_F64, &xa);
  if (st == TD_OK) st = td_tensor_to_dtype(b, TD_DTYPE_F64, &yb);
  td_autograd_set_enabled(prev);
  if (st == TD_OK) st = td_tensor_copy_to_buffer(xa, x, (size_t)n * sizeof(double));
  if (st == TD_OK) st = td_tensor_copy_to_buffer(yb, y, (size_t)n * sizeof(double));
  if (st != TD_OK) goto out;
  bool ok = true;
  for (int64_t i = 0; i < n && ok; i++) {
    if (isnan(x[i]) || isnan(y[i])) ok = isnan(x[i]) && isnan(y[i]);
    else ok = fabs(x[i] - y[i]) <= atol + rtol * fabs(y[i]);
  }
  *out = ok;
out:
  td_tensor_unref(xa);
  td_tensor_unref(yb);
  td__free(x);
  td__free(y);
  return st;
}

/* ---- releasing and restoring storage (storage.h) ---- */

td_status td__tensor_storage_release(td_tensor *t) {
  TD_CHECK_ARG(t, "tensor_storage_release: NULL tensor");
  td__storage *s = t->storage;
  if (!s->data) return TD_OK;
  size_t want = (size_t)td__shape_numel(t->shape, t->ndim) * td_dtype_size(t->dtype);
  if (s->borrowed || t->offset != 0 || s->nbytes != want || !td_tensor_is_contiguous(t))
    return td_set_error(TD_ERR_INVALID, "tensor_storage_release: the tensor must own its storage "
                        "whole (contiguous, offset 0, not borrowed)");
  const td__backend *be = s->device.type == TD_DEVICE_CPU ? &td__cpu_backend : td__cuda_backend;
  be->free(s->device.index, s->data);
  s->data = NULL;
  return TD_OK;
}

td_status td__tensor_storage_restore(td_tensor *t) {
  TD_CHECK_ARG(t, "tensor_storage_restore: NULL tensor");
  td__storage *s = t->storage;
  if (s->data || !s->nbytes) return TD_OK;
  const td__backend *be = td__backend_for(s->device);
  if (!be) return TD_ERR_DEVICE;
  return be->alloc(s->device.index, s->nbytes, &s->data);
}

bool td__tensor_storage_live(const td_tensor *t) {
  return t && (t->storage->data || !t->storage->nbytes);
}
