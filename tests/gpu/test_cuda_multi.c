/* test_cuda_multi.c - the CUDA backend beyond one thread on one device (label gpu): copies between
 * two devices (peer copies, cross-device copy_, ops on cuda:1, mixed devices refused), GPU ops
 * from several host threads at once (results bit-identical to a single-threaded run), the caching
 * allocator giving memory back (td_cuda_empty_cache, td_cuda_memory_info), and the determinism
 * of the kernels that scatter with atomics (index_add, i.e. embedding backward, and max-pooling
 * backward): exact for integer-valued gradients, within float tolerance of the CPU otherwise, and
 * a printed note of how many repeated runs differ in the last bits.
 *
 * Without a CUDA device every test skips and the program exits 77; the two-device test skips
 * with a message on a machine with one GPU. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_util.h"

static int ndev;

static td_tensor *to_dev(const td_tensor *t, td_device d) {
  td_tensor *o = NULL;
  TD_ASSERT_OK(td_tensor_to(t, d, &o));
  return o;
}

/* fresh_leaf makes a new leaf copy of t on dev that requires grad. Not td_tensor_to alone: it
 * returns t itself for t's own device (whose gradient would then pile up across calls), and once
 * t requires grad a copy of it is not a leaf. */
static td_status fresh_leaf(const td_tensor *t, td_device dev, td_tensor **out) {
  td_tensor *d = NULL, *v = NULL;
  td_status st = td_tensor_to(t, dev, &d);
  if (st == TD_OK) st = td_tensor_detach(d, &v);
  if (st == TD_OK) st = td_tensor_clone(v, out);
  if (st == TD_OK) st = td_tensor_set_requires_grad(*out, true);
  td_tensor_unref(d);
  td_tensor_unref(v);
  return st;
}

/* The bytes of t (any device) in a malloc'd host buffer. */
static void *host_bytes(const td_tensor *t, size_t *n) {
  *n = td_tensor_nbytes(t);
  void *b = malloc(*n ? *n : 1);
  TD_ASSERT_OK(td_tensor_copy_to_buffer(t, b, *n));
  return b;
}

static bool same_bits(const td_tensor *a, const td_tensor *b) {
  size_t na, nb;
  void *x = host_bytes(a, &na), *y = host_bytes(b, &nb);
  bool eq = na == nb && memcmp(x, y, na) == 0;
  free(x);
  free(y);
  return eq;
}

/* ---- two devices ---- */

static void test_cuda_two_devices(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(2);
  int64_t shape[2] = {300, 200};
  td_tensor *h = td_test_randn(shape, 2, TD_DTYPE_F32, 11, false);
  td_tensor *g0 = to_dev(h, td_device_cuda(0)), *g1 = to_dev(g0, td_device_cuda(1));
  assert_true(td_device_equal(td_tensor_device(g1), td_device_cuda(1)));
  assert_true(same_bits(g1, h)); /* peer copy */
  /* copy_ across devices, from a strided (transposed) source */
  td_tensor *t0 = NULL, *dst = NULL, *ht = NULL;
  int64_t tshape[2] = {200, 300};
  TD_ASSERT_OK(td_tensor_transpose(g0, 0, 1, &t0));
  TD_ASSERT_OK(td_tensor_zeros(tshape, 2, TD_DTYPE_F32, td_device_cuda(1), &dst));
  TD_ASSERT_OK(td_tensor_copy_(dst, t0));
  TD_ASSERT_OK(td_tensor_transpose(h, 0, 1, &ht));
  td_test_assert_close("copy_ cuda:0 -> cuda:1", dst, ht, 0, 0);
  /* ops on cuda:1 against the CPU */
  td_tensor *w = td_test_randn((int64_t[]){200, 50}, 2, TD_DTYPE_F32, 12, false);
  td_tensor *w1 = to_dev(w, td_device_cuda(1)), *y1 = NULL, *s1 = NULL, *y = NULL, *s = NULL;
  TD_ASSERT_OK(td_tensor_matmul(g1, w1, &y1));
  TD_ASSERT_OK(td_tensor_log_softmax(y1, 1, &s1));
  TD_ASSERT_OK(td_tensor_matmul(h, w, &y));
  TD_ASSERT_OK(td_tensor_log_softmax(y, 1, &s));
  assert_true(td_device_equal(td_tensor_device(s1), td_device_cuda(1)));
  td_test_assert_close("matmul + log_softmax on cuda:1", s1, s, 1e-4, 1e-4);
  /* operands on different devices are refused */
  td_tensor *bad = NULL;
  TD_ASSERT_STATUS(td_tensor_add(g0, g1, &bad), TD_ERR_DEVICE);
  td_tensor *arr[] = {h, g0, g1, t0, dst, ht, w, w1, y1, s1, y, s};
  for (size_t i = 0; i < sizeof arr / sizeof *arr; i++) td_tensor_unref(arr[i]);
}

/* ---- several host threads ---- */

typedef struct thread_case {
  td_device dev;
  td_tensor *a, *b;  /* inputs on dev */
  td_tensor *ref;    /* single-threaded result on dev */
  int iters;
  int mismatches, errors;
} thread_case;

/* softmax(a @ b) summed over dim 0, plus allocator churn. */
static td_status pipeline(const td_tensor *a, const td_tensor *b, td_tensor **out) {
  td_tensor *c = NULL, *s = NULL;
  int dim0 = 0;
  td_status st = td_tensor_matmul(a, b, &c);
  if (st == TD_OK) st = td_tensor_softmax(c, 1, &s);
  if (st == TD_OK) st = td_tensor_sum(s, &dim0, 1, false, out);
  td_tensor_unref(c);
  td_tensor_unref(s);
  return st;
}

static void *thread_body(void *p) {
  thread_case *tc = p;
  for (int i = 0; i < tc->iters; i++) {
    td_tensor *r = NULL, *junk = NULL;
    int64_t n = 1000 + 977 * (i % 13);
    if (td_tensor_zeros(&n, 1, TD_DTYPE_F32, tc->dev, &junk) != TD_OK ||
        pipeline(tc->a, tc->b, &r) != TD_OK) {
      tc->errors++;
    } else if (!same_bits(r, tc->ref)) {
      tc->mismatches++;
    }
    td_tensor_unref(r);
    td_tensor_unref(junk);
  }
  return NULL;
}

static void test_cuda_ops_from_several_threads(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  enum { NT = 8 };
  thread_case tc[NT];
  pthread_t th[NT];
  for (int i = 0; i < NT; i++) {
    td_device d = td_device_cuda(i % (ndev > 1 ? 2 : 1));
    td_tensor *ha = td_test_randn((int64_t[]){256, 128}, 2, TD_DTYPE_F32, 100 + (uint64_t)i, false);
    td_tensor *hb = td_test_randn((int64_t[]){128, 96}, 2, TD_DTYPE_F32, 200 + (uint64_t)i, false);
    tc[i] = (thread_case){d, to_dev(ha, d), to_dev(hb, d), NULL, 40, 0, 0};
    TD_ASSERT_OK(pipeline(tc[i].a, tc[i].b, &tc[i].ref));
    td_tensor *href = NULL;
    TD_ASSERT_OK(pipeline(ha, hb, &href));
    td_test_assert_close("GPU pipeline against the CPU", tc[i].ref, href, 1e-4, 1e-5);
    td_tensor_unref(ha);
    td_tensor_unref(hb);
    td_tensor_unref(href);
  }
  for (int i = 0; i < NT; i++) assert_int_equal(pthread_create(&th[i], NULL, thread_body, &tc[i]), 0);
  for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < NT; i++) {
    if (tc[i].errors || tc[i].mismatches)
      fail_msg("thread %d: %d errors, %d results differing from the single-threaded run", i,
               tc[i].errors, tc[i].mismatches);
    td_tensor_unref(tc[i].a);
    td_tensor_unref(tc[i].b);
    td_tensor_unref(tc[i].ref);
  }
}

/* Backward passes through Linear layers from several threads at once, starting cold, as a
 * parameter server's RPC threads run its trainers' first backward passes (GEMMs with transposed
 * operands): right results and no errors. Every round runs in a fresh child process whose threads
 * make their first GEMMs together.
 * What this does not catch: with one cuBLAS handle shared by every thread, the parameter server
 * example failed its first backward on an H100 in 6 of 6 runs (CUBLAS_STATUS_INTERNAL_ERROR in
 * LinearBackward, m=32 n=256 k=10) and passed 6 of 6 with a handle per thread, but this test
 * passed 12 cold rounds with the shared handle. The guard for that is scripts/test-gpu.sh's
 * param_server run. */
typedef struct backward_case {
  td_device dev;
  td_tensor *x_h, *w_h; /* host inputs */
  td_tensor *gx, *gw;   /* the CPU's gradients */
  pthread_barrier_t *start;
  int iters, errors, mismatches;
} backward_case;

/* d sum(linear(x, w)^2) / d(x, w) on dev, copied to the host. */
static td_status linear_grads(td_device dev, const td_tensor *x_h, const td_tensor *w_h,
                              td_tensor **gx_h, td_tensor **gw_h) {
  td_tensor *x = NULL, *w = NULL, *y = NULL, *y2 = NULL, *s = NULL, *gx = NULL, *gw = NULL;
  td_status st = fresh_leaf(x_h, dev, &x);
  if (st == TD_OK) st = fresh_leaf(w_h, dev, &w);
  if (st == TD_OK) st = td_tensor_linear(x, w, NULL, &y);
  if (st == TD_OK) st = td_tensor_mul(y, y, &y2);
  if (st == TD_OK) st = td_tensor_sum_all(y2, &s);
  if (st == TD_OK) st = td_tensor_backward(s);
  if (st == TD_OK) {
    gx = td_tensor_grad(x);
    gw = td_tensor_grad(w);
    if (!gx || !gw) st = TD_ERR_INTERNAL;
  }
  if (st == TD_OK) st = td_tensor_to(gx, td_device_cpu(), gx_h);
  if (st == TD_OK) st = td_tensor_to(gw, td_device_cpu(), gw_h);
  td_tensor *all[] = {x, w, y, y2, s, gx, gw};
  for (int i = 0; i < 7; i++) td_tensor_unref(all[i]);
  return st;
}

/* far_from counts the elements of float32 host tensor a outside |a - b| <= 1e-4 + 1e-3 |b| of b
 * (td_test_assert_close's GEMM tolerance; NaN counts; every element when the sizes differ). */
static size_t far_from(const td_tensor *a, const td_tensor *b) {
  size_t na = 0, nb = 0, bad = 0;
  float *pa = host_bytes(a, &na), *pb = host_bytes(b, &nb);
  if (na != nb) bad = na / sizeof(float) + 1;
  for (size_t i = 0; na == nb && i < na / sizeof(float); i++)
    bad += !(fabs((double)pa[i] - pb[i]) <= 1e-4 + 1e-3 * fabs((double)pb[i]));
  free(pa);
  free(pb);
  return bad;
}

static void *backward_body(void *p) {
  backward_case *bc = p;
  pthread_barrier_wait(bc->start);
  for (int i = 0; i < bc->iters; i++) {
    td_tensor *gx = NULL, *gw = NULL;
    if (linear_grads(bc->dev, bc->x_h, bc->w_h, &gx, &gw) != TD_OK) {
      if (bc->errors++ == 0) fprintf(stderr, "backward thread: %s\n", td_last_error());
    } else if (far_from(gx, bc->gx) || far_from(gw, bc->gw)) {
      bc->mismatches++;
    }
    td_tensor_unref(gx);
    td_tensor_unref(gw);
  }
  return NULL;
}

/* One cold round in this (fresh) process: NT threads, first GEMMs together. Returns the number of
 * failed or wrong passes. */
static int backward_round(void) {
  enum { NT = 8 };
  backward_case bc[NT];
  pthread_t th[NT];
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, NT);
  for (int i = 0; i < NT; i++) {
    td_device d = td_device_cuda(i % (ndev > 1 ? 2 : 1));
    bc[i] = (backward_case){d, NULL, NULL, NULL, NULL, &start, 30, 0, 0};
    bc[i].x_h = td_test_randn((int64_t[]){32, 256}, 2, TD_DTYPE_F32, 300 + (uint64_t)i, false);
    bc[i].w_h = td_test_randn((int64_t[]){10 + 3 * i, 256}, 2, TD_DTYPE_F32, 400 + (uint64_t)i,
                              false);
    TD_ASSERT_OK(linear_grads(td_device_cpu(), bc[i].x_h, bc[i].w_h, &bc[i].gx, &bc[i].gw));
  }
  for (int i = 0; i < NT; i++)
    assert_int_equal(pthread_create(&th[i], NULL, backward_body, &bc[i]), 0);
  for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
  int bad = 0;
  for (int i = 0; i < NT; i++) {
    if (bc[i].errors || bc[i].mismatches)
      fprintf(stderr, "backward thread %d: %d errors, %d results off the CPU's\n", i,
              bc[i].errors, bc[i].mismatches);
    bad += bc[i].errors + bc[i].mismatches;
    td_tensor *all[] = {bc[i].x_h, bc[i].w_h, bc[i].gx, bc[i].gw};
    for (int k = 0; k < 4; k++) td_tensor_unref(all[k]);
  }
  pthread_barrier_destroy(&start);
  return bad;
}

/* Runs first in this program: its children need a parent that has not initialised CUDA. */
static void test_cuda_backward_from_several_threads(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  int failed_rounds = 0;
  for (int round = 0; round < 4; round++) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      int bad = backward_round();
      fflush(NULL);
      _exit(bad ? 1 : 0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed_rounds++;
  }
  if (failed_rounds) fail_msg("%d of 4 cold rounds had failed or wrong backward passes", failed_rounds);
}

/* ---- the caching allocator ---- */

static void test_cuda_empty_cache_gives_memory_back(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  int64_t n = 64 << 20; /* 256 MiB of float32 */
  td_tensor *t = NULL;
  size_t used0 = 0, cached0 = 0, used = 0, cached = 0;
  TD_ASSERT_OK(td_cuda_memory_info(0, &used0, &cached0));
  TD_ASSERT_OK(td_tensor_zeros(&n, 1, TD_DTYPE_F32, td_device_cuda(0), &t));
  TD_ASSERT_OK(td_cuda_memory_info(0, &used, &cached));
  assert_true(used >= used0 + ((size_t)n * 4));
  td_tensor_unref(t);
  TD_ASSERT_OK(td_cuda_memory_info(0, &used, &cached));
  assert_true(cached >= (size_t)n * 4);
  TD_ASSERT_OK(td_cuda_empty_cache());
  TD_ASSERT_OK(td_cuda_memory_info(0, &used, &cached));
  assert_int_equal(cached, 0);
  assert_int_equal(used, used0);
  TD_ASSERT_OK(td_tensor_zeros(&n, 1, TD_DTYPE_F32, td_device_cuda(0), &t)); /* still works */
  td_tensor_unref(t);
  TD_ASSERT_STATUS(td_cuda_memory_info(ndev, &used, &cached), TD_ERR_DEVICE);
}

/* ---- atomics: exact where order does not matter, and how often bits differ ---- */

typedef td_status (*grad_fn)(td_tensor *param, const td_tensor *g, td_tensor **grad);

/* d/dw of sum(embedding(w, idx) * g) for idx[i] = i % V: an index_add of g's rows. */
static td_status embedding_grad(td_tensor *w, const td_tensor *g, td_tensor **grad) {
  int64_t n = td_tensor_size(g, 0), v = td_tensor_size(w, 0);
  td_tensor *idx_h = NULL, *idx = NULL, *e = NULL, *m = NULL, *s = NULL;
  td_status st = td_tensor_arange(0, (double)n, 1, TD_DTYPE_I64, td_device_cpu(), &idx_h);
  if (st != TD_OK) return st;
  int64_t *p = td_tensor_data(idx_h);
  for (int64_t i = 0; i < n; i++) p[i] %= v;
  st = td_tensor_to(idx_h, td_tensor_device(w), &idx);
  if (st == TD_OK) st = td_tensor_embedding(w, idx, &e);
  if (st == TD_OK) st = td_tensor_mul(e, g, &m);
  if (st == TD_OK) st = td_tensor_sum_all(m, &s);
  if (st == TD_OK) st = td_tensor_backward(s);
  if (st == TD_OK) *grad = td_tensor_grad(w);
  td_tensor *all[] = {idx_h, idx, e, m, s};
  for (int i = 0; i < 5; i++) td_tensor_unref(all[i]);
  return st;
}

/* d/dx of sum(max_pool2d(x, 3x3, stride 1) * g): overlapping windows scatter into shared inputs. */
static td_status pool_grad(td_tensor *x, const td_tensor *g, td_tensor **grad) {
  td_tensor *y = NULL, *m = NULL, *s = NULL;
  td_status st = td_tensor_max_pool2d(x, 3, 3, 1, 1, &y);
  if (st == TD_OK) st = td_tensor_mul(y, g, &m);
  if (st == TD_OK) st = td_tensor_sum_all(m, &s);
  if (st == TD_OK) st = td_tensor_backward(s);
  if (st == TD_OK) *grad = td_tensor_grad(x);
  td_tensor_unref(y);
  td_tensor_unref(m);
  td_tensor_unref(s);
  return st;
}

/* The gradient of a fresh leaf copy of param_h on dev. */
static td_tensor *grad_on(grad_fn fn, const td_tensor *param_h, const td_tensor *g_h,
                          td_device dev) {
  td_tensor *p = NULL, *g = to_dev(g_h, dev), *grad = NULL;
  TD_ASSERT_OK(fresh_leaf(param_h, dev, &p));
  TD_ASSERT_OK(fn(p, g, &grad));
  assert_non_null(grad);
  td_tensor_unref(p);
  td_tensor_unref(g);
  return grad;
}

/* Runs fn 20 times on cuda:0 with integer-valued, then random, upstream gradients. */
static void check_atomics(const char *what, grad_fn fn, const td_tensor *param_h,
                          const int64_t *gshape, int gndim) {
  td_device gpu = td_device_cuda(0);
  /* integer values: every order of additions gives the same, exact sum */
  td_tensor *gi = td_test_rand(gshape, gndim, TD_DTYPE_F32, -8, 8, 5, false), *gir = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(gi, TD_DTYPE_I64, &gir));
  td_tensor *gif = NULL;
  TD_ASSERT_OK(td_tensor_to_dtype(gir, TD_DTYPE_F32, &gif));
  td_tensor *cpu_i = grad_on(fn, param_h, gif, td_device_cpu());
  for (int run = 0; run < 5; run++) {
    td_tensor *gpu_i = grad_on(fn, param_h, gif, gpu);
    if (!same_bits(gpu_i, cpu_i)) fail_msg("%s: integer-valued gradients differ from the CPU", what);
    td_tensor_unref(gpu_i);
  }
  /* random values: within float tolerance of the CPU; count runs whose bits differ from the first */
  td_tensor *gr = td_test_randn(gshape, gndim, TD_DTYPE_F32, 6, false);
  td_tensor *cpu_r = grad_on(fn, param_h, gr, td_device_cpu()), *first = NULL;
  int differ = 0;
  for (int run = 0; run < 20; run++) {
    td_tensor *gpu_r = grad_on(fn, param_h, gr, gpu);
    td_test_assert_close(what, gpu_r, cpu_r, 1e-4, 1e-4);
    if (!first) first = gpu_r;
    else {
      differ += !same_bits(gpu_r, first);
      td_tensor_unref(gpu_r);
    }
  }
  print_message("determinism note: %s with float32 atomics: %d of 19 repeated runs differ in "
                "the last bits from the first run (integer-valued gradients: exact)\n", what,
                differ);
  td_tensor *all[] = {gi, gir, gif, cpu_i, gr, cpu_r, first};
  for (int i = 0; i < 7; i++) td_tensor_unref(all[i]);
}

static void test_cuda_atomics_determinism(void **state) {
  (void)state;
  TD_TEST_REQUIRE_CUDA(1);
  td_tensor *w = td_test_randn((int64_t[]){10, 64}, 2, TD_DTYPE_F32, 3, false);
  check_atomics("embedding backward (index_add)", embedding_grad, w, (int64_t[]){4096, 64}, 2);
  td_tensor_unref(w);
  td_tensor *x = td_test_randn((int64_t[]){2, 4, 48, 48}, 4, TD_DTYPE_F32, 4, false);
  check_atomics("max_pool2d backward (3x3, stride 1)", pool_grad, x, (int64_t[]){2, 4, 46, 46},
                4);
  td_tensor_unref(x);
}

int main(void) {
  ndev = td_cuda_device_count();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_backward_from_several_threads), /* first: it forks */
      cmocka_unit_test(test_cuda_two_devices),
      cmocka_unit_test(test_cuda_ops_from_several_threads),
      cmocka_unit_test(test_cuda_empty_cache_gives_memory_back),
      cmocka_unit_test(test_cuda_atomics_determinism),
  };
  int failed = cmocka_run_group_tests_name("cuda_multi", tests, NULL, NULL);
  if (failed) return 1;
  return ndev == 0 ? 77 : 0;
}
