/* test_cuda_host.c - the host-side logic of the CUDA backend, which runs without a GPU (built only
 * with CUDA; label unit): the caching allocator's bookkeeping over a budgeted host-memory "device"
 * (size classes, reuse, emptying the cache and retrying on out-of-memory, giving memory back
 * outside the lock, concurrent use), the order keys that make NCCL's MAX propagate NaN, and cuBLAS
 * loaded on first use (cuda_blas.h), not at start-up. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cuda/cuda_alloc.h"
#include "tensor/cuda/cuda_blas.h"
#include "tensor/cuda/cuda_collective.h"
#include "test_util.h"

/* ---- cuBLAS, loaded on first use ---- */

/* Whether a file whose name contains lib is mapped into this process. */
static bool mapped(const char *lib) {
  FILE *f = fopen("/proc/self/maps", "r");
  assert_non_null(f);
  char line[4096];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, lib) != NULL;
  fclose(f);
  return found;
}

/* Runs first: nothing before it creates a cuBLAS handle. */
static void test_cublas_is_loaded_on_first_use_not_at_start(void **state) {
  (void)state;
  assert_false(mapped("libcublasLt.so"));
  assert_false(mapped("libcublas.so"));
  TD_ASSERT_OK(td__cublas_load());
  assert_true(mapped("libcublasLt.so"));
  assert_true(mapped("libcublas.so"));
  void *entries[sizeof td__cublas / sizeof(void *)];
  memcpy(entries, &td__cublas, sizeof entries);
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) assert_non_null(entries[i]);
  TD_ASSERT_OK(td__cublas_load()); /* once */
  /* a call through the table (cuda_blas.h's macros), one that needs no GPU */
  assert_string_equal(cublasGetStatusString(CUBLAS_STATUS_NOT_INITIALIZED),
                      "the library was not initialized");
}

/* ---- a budgeted host "device" ---- */

typedef struct host_dev {
  td__cu_cache *cache; /* the cache using this device, to check its lock from inside free */
  atomic_size_t budget, used;
  atomic_int allocs, frees, nomem, freed_under_lock, allocated_under_lock;
} host_dev;

static td_status host_alloc(void *ctx, int device, size_t n, void **out) {
  host_dev *d = ctx;
  if (d->cache && td__cu_cache_locked(d->cache)) atomic_fetch_add(&d->allocated_under_lock, 1);
  if (atomic_load(&d->used) + n > atomic_load(&d->budget)) {
    atomic_fetch_add(&d->nomem, 1);
    return td_set_error(TD_ERR_NOMEM, "host device %d: out of memory (%zu bytes)", device, n);
  }
  void *p = malloc(n);
  if (!p) return td_set_error(TD_ERR_NOMEM, "host device: malloc failed");
  atomic_fetch_add(&d->used, n);
  atomic_fetch_add(&d->allocs, 1);
  memcpy(p, &n, sizeof n); /* remember the size for free */
  *out = p;
  return TD_OK;
}

static void host_free(void *ctx, int device, void *p) {
  (void)device;
  host_dev *d = ctx;
  if (d->cache && td__cu_cache_locked(d->cache)) atomic_fetch_add(&d->freed_under_lock, 1);
  size_t n;
  memcpy(&n, p, sizeof n);
  atomic_fetch_sub(&d->used, n);
  atomic_fetch_add(&d->frees, 1);
  free(p);
}

static td__cu_cache *make_cache(host_dev *d, size_t budget) {
  memset(d, 0, sizeof *d);
  atomic_store(&d->budget, budget);
  td__cu_raw_ops ops = {host_alloc, host_free, d};
  td__cu_cache *c = NULL;
  TD_ASSERT_OK(td__cu_cache_create(&ops, &c));
  d->cache = c;
  return c;
}

static void test_cuda_cache_size_classes(void **state) {
  (void)state;
  size_t r = 0;
  assert_int_equal(td__cu_size_class(1, &r), 0);
  assert_int_equal(r, 512);
  assert_int_equal(td__cu_size_class(512, &r), 0);
  assert_int_equal(td__cu_size_class(513, &r), 1);
  assert_int_equal(r, 1024);
  assert_int_equal(td__cu_size_class(1 << 20, &r), 11);
  assert_int_equal(r, 1 << 20);
  int c = td__cu_size_class((1 << 20) + 1, &r); /* first class above 1 MiB: 1.25 MiB */
  assert_int_equal(c, 12);
  assert_int_equal(r, 5 << 18);
  assert_int_equal(td__cu_size_class(5 << 18, &r), 12);
  assert_int_equal(td__cu_size_class((5 << 18) + 1, &r), 13);
  assert_int_equal(r, 6 << 18);
  assert_int_equal(td__cu_size_class((size_t)1 << 48, &r), 12 + 27 * 4 + 3);
  assert_int_equal(td__cu_size_class(((size_t)1 << 48) + 1, &r), -1);
  /* every class's size maps back to the class, and at most 25% is wasted above 1 MiB */
  for (int k = 0; k < 12 + 28 * 4; k++) {
    size_t sz = td__cu_class_size(k), back = 0;
    assert_int_equal(td__cu_size_class(sz, &back), k);
    assert_int_equal(back, sz);
    if (k > 12) {
      size_t below = td__cu_class_size(k - 1) + 1;
      assert_int_equal(td__cu_size_class(below, &back), k);
      assert_true((double)back <= 1.25 * (double)below);
    }
  }
}

static void test_cuda_cache_reuses_blocks_per_device(void **state) {
  (void)state;
  host_dev d;
  td__cu_cache *c = make_cache(&d, 1 << 30);
  void *a = NULL, *b = NULL, *e = NULL;
  TD_ASSERT_OK(td__cu_cache_alloc(c, 0, 3000, &a));
  size_t used = 0, cached = 0;
  td__cu_cache_stats(c, 0, &used, &cached);
  assert_int_equal(used, 4096);
  assert_int_equal(cached, 0);
  td__cu_cache_free(c, a);
  td__cu_cache_stats(c, 0, &used, &cached);
  assert_int_equal(used, 0);
  assert_int_equal(cached, 4096);
  TD_ASSERT_OK(td__cu_cache_alloc(c, 0, 4000, &b)); /* same class: the same block */
  assert_ptr_equal(a, b);
  TD_ASSERT_OK(td__cu_cache_alloc(c, 1, 4000, &e)); /* other device: a new block */
  assert_ptr_not_equal(e, b);
  assert_int_equal(atomic_load(&d.allocs), 2);
  td__cu_cache_free(c, b);
  td__cu_cache_free(c, e);
  td__cu_cache_stats(c, 1, &used, &cached);
  assert_int_equal(cached, 4096);
  TD_ASSERT_OK(td__cu_cache_empty(c, 1)); /* one device only */
  td__cu_cache_stats(c, 1, &used, &cached);
  assert_int_equal(cached, 0);
  td__cu_cache_stats(c, 0, &used, &cached);
  assert_int_equal(cached, 4096);
  TD_ASSERT_OK(td__cu_cache_empty(c, -1));
  td__cu_cache_stats(c, 0, &used, &cached);
  assert_int_equal(cached, 0);
  assert_int_equal(atomic_load(&d.used), 0);
  assert_int_equal(atomic_load(&d.freed_under_lock), 0);
  assert_int_equal(atomic_load(&d.allocated_under_lock), 0);
  td__cu_cache_destroy(c);
}

/* Out of memory with blocks cached: the cache gives them back and the allocation succeeds. */
static void test_cuda_cache_empties_and_retries_on_oom(void **state) {
  (void)state;
  host_dev d;
  td__cu_cache *c = make_cache(&d, 3 << 20);
  void *p[2], *big = NULL;
  TD_ASSERT_OK(td__cu_cache_alloc(c, 0, 1 << 20, &p[0]));
  TD_ASSERT_OK(td__cu_cache_alloc(c, 0, 1 << 20, &p[1]));
  td__cu_cache_free(c, p[0]);
  td__cu_cache_free(c, p[1]); /* 2 MiB cached, 1 MiB of budget left */
  TD_ASSERT_OK(td__cu_cache_alloc(c, 0, 2 << 20, &big)); /* another class */
  assert_int_equal(atomic_load(&d.nomem), 1);            /* failed once, then retried */
  size_t used = 0, cached = 0;
  td__cu_cache_stats(c, 0, &used, &cached);
  assert_int_equal(used, 2 << 20);
  assert_int_equal(cached, 0);
  assert_int_equal(atomic_load(&d.freed_under_lock), 0);
  /* nothing cached and still too large: TD_ERR_NOMEM naming the device and the bytes in use */
  void *huge = NULL;
  TD_ASSERT_STATUS(td__cu_cache_alloc(c, 0, 2 << 20, &huge), TD_ERR_NOMEM);
  assert_null(huge);
  assert_non_null(strstr(td_last_error(), "cuda:0"));
  assert_non_null(strstr(td_last_error(), "2097152 bytes in use"));
  assert_non_null(strstr(td_last_error(), "out of memory"));
  td__cu_cache_free(c, big);
  td__cu_cache_destroy(c);
  assert_int_equal(atomic_load(&d.used), 0);
}

/* ---- concurrency ---- */

typedef struct churn_arg {
  td__cu_cache *c;
  int seed;
  atomic_int *errors;
} churn_arg;

static void *churn(void *p) {
  churn_arg *a = p;
  unsigned s = (unsigned)a->seed * 2654435761u + 1;
  void *held[8] = {0};
  for (int i = 0; i < 4000; i++) {
    s = s * 1103515245u + 12345u;
    int k = (int)((s >> 16) % 8);
    if (held[k]) {
      td__cu_cache_free(a->c, held[k]);
      held[k] = NULL;
    } else if (td__cu_cache_alloc(a->c, (int)(s % 2), 256u << ((s >> 8) % 14), &held[k]) !=
               TD_OK) {
      atomic_fetch_add(a->errors, 1);
    }
    if (i % 500 == 0) td__cu_cache_empty(a->c, -1);
  }
  for (int k = 0; k < 8; k++) td__cu_cache_free(a->c, held[k]);
  return NULL;
}

static void test_cuda_cache_threads_churn(void **state) {
  (void)state;
  host_dev d;
  td__cu_cache *c = make_cache(&d, (size_t)1 << 32);
  atomic_int errors = 0;
  pthread_t th[4];
  churn_arg args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (churn_arg){c, i, &errors};
    assert_int_equal(pthread_create(&th[i], NULL, churn, &args[i]), 0);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  assert_int_equal(atomic_load(&errors), 0);
  for (int dev = 0; dev < 2; dev++) {
    size_t used = 1, cached = 0;
    td__cu_cache_stats(c, dev, &used, &cached);
    assert_int_equal(used, 0);
  }
  assert_int_equal(atomic_load(&d.freed_under_lock), 0);
  assert_int_equal(atomic_load(&d.allocated_under_lock), 0);
  td__cu_cache_destroy(c);
  assert_int_equal(atomic_load(&d.used), 0);
  assert_int_equal(atomic_load(&d.allocs), atomic_load(&d.frees));
}

/* ---- order keys for NCCL MAX ---- */

static void test_cuda_order_keys_order_like_floats_with_nan_on_top(void **state) {
  (void)state;
  const double v[] = {-INFINITY, -1e300, -3.5, -1.0, -1e-310, -0.0, 0.0, 1e-310,
                      1e-30,     1.0,    2.0,  1e300, INFINITY};
  size_t n = sizeof v / sizeof *v;
  for (size_t i = 0; i + 1 < n; i++) {
    assert_true(td__cu_order_key_f64(v[i]) < td__cu_order_key_f64(v[i + 1]));
    assert_true(td__cu_order_key_f32((float)v[i]) <= td__cu_order_key_f32((float)v[i + 1]));
    if ((float)v[i] < (float)v[i + 1])
      assert_true(td__cu_order_key_f32((float)v[i]) < td__cu_order_key_f32((float)v[i + 1]));
  }
  for (size_t i = 0; i < n; i++) {
    double back = td__cu_order_unkey_f64(td__cu_order_key_f64(v[i]));
    assert_memory_equal(&back, &v[i], sizeof back); /* bit-exact, -0 included */
    float f = (float)v[i], fb = td__cu_order_unkey_f32(td__cu_order_key_f32(f));
    assert_memory_equal(&fb, &f, sizeof f);
  }
  /* every NaN (either sign, any payload) is above +inf and comes back as a NaN */
  double nans[2] = {NAN, -NAN};
  for (int i = 0; i < 2; i++) {
    assert_true(td__cu_order_key_f64(nans[i]) > td__cu_order_key_f64(INFINITY));
    assert_true(td__cu_order_key_f32((float)nans[i]) > td__cu_order_key_f32(INFINITY));
    assert_true(isnan(td__cu_order_unkey_f64(td__cu_order_key_f64(nans[i]))));
    assert_true(isnan(td__cu_order_unkey_f32(td__cu_order_key_f32((float)nans[i]))));
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cublas_is_loaded_on_first_use_not_at_start),
      cmocka_unit_test(test_cuda_cache_size_classes),
      cmocka_unit_test(test_cuda_cache_reuses_blocks_per_device),
      cmocka_unit_test(test_cuda_cache_empties_and_retries_on_oom),
      cmocka_unit_test(test_cuda_cache_threads_churn),
      cmocka_unit_test(test_cuda_order_keys_order_like_floats_with_nan_on_top),
  };
  return cmocka_run_group_tests_name("cuda_host", tests, NULL, NULL);
}
