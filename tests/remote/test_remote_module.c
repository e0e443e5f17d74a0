/* test_remote_module.c - multi-process tests of RemoteModule and the pipeline driver: creation
 * from a factory by worker name and by rank, device-string errors, forward and forward_async
 * against the same module run locally, train/eval, remote parameters driving a distributed
 * optimizer, passing the module to a third worker, and the pipeline's outputs and gradients
 * against the stages run in one process for 1, 2 and 4 micro-batches. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mp_util.h"
#include "test_fns.h"
#include "test_util.h"
#include "tdist/dist_autograd.h"
#include "tdist/dist_optim.h"
#include "tdist/nn.h"
#include "tdist/remote_module.h"
#include "tdist/rpc.h"
#include "tdist/rref.h"

enum { N = 8, D = 6, H = 5, C = 3 };

#define TRY(expr)                     \
  do {                                \
    td_status try_s_ = (expr);        \
    if (try_s_ != TD_OK) return try_s_; \
  } while (0)

/* build(kind, seed): "body" = Sequential(Linear(D, H), ReLU), "head" = Linear(H, C); float64,
 * parameters filled deterministically from seed. */
static td_status build(const char *kind, int64_t seed, td_module **out) {
  td_module *m = NULL, *a = NULL, *b = NULL;
  td_status st;
  if (!strcmp(kind, "head")) {
    st = td_linear_create(H, C, true, NULL, &m);
  } else if (!strcmp(kind, "body")) {
    st = td_sequential_create(&m);
    if (st == TD_OK) st = td_linear_create(D, H, true, NULL, &a);
    if (st == TD_OK) st = td_relu_create(&b);
    if (st == TD_OK) st = td_sequential_append(m, a);
    if (st == TD_OK) st = td_sequential_append(m, b);
  } else {
    return td_set_error(TD_ERR_INVALID, "no part '%s'", kind);
  }
  td_module_unref(a);
  td_module_unref(b);
  if (st == TD_OK) st = td_module_to_dtype(m, TD_DTYPE_F64);
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  if (st == TD_OK) st = td_module_parameters(m, &ps);
  for (size_t i = 0; i < ps.n && st == TD_OK; i++) {
    double *d = td_tensor_data(ps.tensors[i]);
    for (int64_t k = 0; k < td_tensor_numel(ps.tensors[i]); k++)
      d[k] = 0.5 * sin(0.7 * (double)seed + 1.3 * (double)i + 0.913 * (double)k);
  }
  td_tensor_list_fini(&ps);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

/* Factory "rm_part": args is a list value [kind, seed]. */
static td_status part_factory(void *ctx, const void *args, td_module **out) {
  const td_value *v = args;
  const char *kind;
  int64_t seed;
  if (!v || td_value_as_string(td_value_list_get(v, 0), &kind, NULL) != TD_OK ||
      td_value_as_int(td_value_list_get(v, 1), &seed) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "rm_part: expected [kind, seed]");
  return build(kind, seed, out);
}

static td_value *part_args(const char *kind, int64_t seed) {
  td_value *l = td_value_list();
  td_value_list_append(l, td_value_string(kind));
  td_value_list_append(l, td_value_int(seed));
  return l;
}

static td_tensor *input_x(int salt) {
  double x[N * D];
  for (int i = 0; i < N * D; i++) x[i] = cos(0.37 * i + 0.11 * salt);
  int64_t s[2] = {N, D};
  td_tensor *t;
  MP_CHECK_OK(td_tensor_from_buffer(x, s, 2, TD_DTYPE_F64, &t));
  return t;
}

static td_tensor *labels(void) {
  int64_t y[N], s[1] = {N};
  for (int i = 0; i < N; i++) y[i] = (i * 2 + 1) % C;
  td_tensor *t;
  MP_CHECK_OK(td_tensor_from_buffer(y, s, 1, TD_DTYPE_I64, &t));
  return t;
}

/* rm_use(module rref) on a third worker: builds a handle from the RRef and runs forward. */
static td_status fn_use(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  td_rref *r;
  TRY(td_value_as_rref(args[0], &r));
  td_remote_module *rm;
  TRY(td_remote_module_from_rref(td_rpc_ctx_agent(c), r, &rm));
  td_tensor *x = input_x(3), *y = NULL;
  td_status st = td_remote_module_forward(rm, x, &y);
  td_tensor_unref(x);
  td_remote_module_destroy(rm);
  if (st != TD_OK) return st;
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return TD_OK;
}

static void check_close(const td_tensor *a, const td_tensor *b, const char *what) {
  bool ok = false;
  MP_CHECK(a && b);
  MP_CHECK_OK(td_tensor_allclose(a, b, 1e-9, 1e-12, &ok));
  if (!ok) fprintf(stderr, "mismatch: %s\n", what);
  MP_CHECK(ok);
}

static td_rpc_agent *start(int rank, int world, const char *method) {
  td_module_factory_register("rm_part", part_factory, NULL);
  td_rpc_register("rm_grads_of", td_test_fn_grads_of, NULL);
  td_rpc_register("rm_use", fn_use, NULL);
  td_rref_set_strict(true);
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

static void finish(td_rpc_agent *a) { td_mp_finish(a, 60); }

static td_tensor *local_forward(const char *kind, int64_t seed, td_tensor *x) {
  td_module *m;
  MP_CHECK_OK(build(kind, seed, &m));
  td_tensor *y;
  MP_CHECK_OK(td_module_forward(m, x, &y));
  td_module_unref(m);
  return y;
}

/* ---- RemoteModule behaviours ---- */

static int w_basics(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method);
  if (rank == 0) {
    td_value *args = part_args("body", 1);
    td_remote_module *rm = NULL, *rm2 = NULL;
    MP_CHECK_OK(td_remote_module_create(a, "worker1/cpu", "rm_part", args, &rm));
    MP_CHECK(!strcmp(td_remote_module_owner(rm), "worker1"));
    MP_CHECK(td_rref_owner(td_remote_module_rref(rm)) == 1);
    MP_CHECK(td_device_equal(td_remote_module_device(rm), td_device_cpu()));
    MP_CHECK_OK(td_remote_module_create(a, "rank:2/cpu", "rm_part", args, &rm2));
    MP_CHECK(td_rref_owner(td_remote_module_rref(rm2)) == 2);

    /* forward (sync and async) equals the local module */
    td_tensor *x = input_x(0), *y = NULL, *want = local_forward("body", 1, x);
    MP_CHECK_OK(td_remote_module_forward(rm, x, &y));
    check_close(y, want, "forward");
    td_value *xv = td_value_tensor(x);
    td_future *f = NULL;
    MP_CHECK_OK(td_remote_module_forward_async(rm2, &xv, 1, &f));
    MP_CHECK_OK(td_future_wait(f, td_test_ms(30000)));
    MP_CHECK_OK(td_future_status(f));
    td_tensor *ya;
    MP_CHECK_OK(td_value_as_tensor(td_future_value(f), &ya));
    check_close(ya, want, "forward_async");
    td_future_unref(f);
    /* forward_remote + an RRef input: the second module fetches the first one's output */
    td_value *hargs = part_args("head", 2);
    td_remote_module *head = NULL;
    MP_CHECK_OK(td_remote_module_create(a, "worker2/cpu", "rm_part", hargs, &head));
    td_rref *hid = NULL;
    MP_CHECK_OK(td_remote_module_forward_remote(rm, &xv, 1, &hid));
    td_value *hv = td_value_rref(hid), *ov = NULL;
    MP_CHECK_OK(td_rref_rpc_sync(td_remote_module_rref(head), "__rm_forward", &hv, 1, NULL, &ov));
    td_tensor *o, *want2 = local_forward("head", 2, want);
    MP_CHECK_OK(td_value_as_tensor(ov, &o));
    check_close(o, want2, "body -> head by RRef");
    td_value_unref(ov);
    td_value_unref(hv);
    td_rref_unref(hid);
    td_tensor_unref(want2);
    /* a bad input is the owner's error, naming it */
    td_value *bad = td_value_int(3);
    td_tensor *yb = NULL;
    MP_CHECK(td_remote_module_forward_async(rm, &bad, 1, &f) == TD_OK);
    td_future_wait(f, td_test_ms(30000));
    MP_CHECK(td_future_status(f) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_future_message(f), "worker1") && strstr(td_future_message(f), "input 0"));
    td_future_unref(f);
    td_value_unref(bad);
    (void)yb;

    /* train / eval */
    bool tr = false;
    MP_CHECK_OK(td_remote_module_is_training(rm, &tr));
    MP_CHECK(tr);
    MP_CHECK_OK(td_remote_module_train(rm, false));
    MP_CHECK_OK(td_remote_module_is_training(rm, &tr));
    MP_CHECK(!tr);
    MP_CHECK_OK(td_remote_module_train(rm, true));
    MP_CHECK_OK(td_remote_module_is_training(rm, &tr));
    MP_CHECK(tr);

    /* remote parameters: RRefs owned by worker1, usable by a distributed optimizer that moves
     * the remote weights after a backward through the module */
    td_value *pl = NULL;
    MP_CHECK_OK(td_remote_module_parameters(rm, &pl));
    MP_CHECK(td_value_list_len(pl) == 2);
    td_rref *prs[2];
    for (int i = 0; i < 2; i++) {
      MP_CHECK_OK(td_value_as_rref(td_value_list_get(pl, (size_t)i), &prs[i]));
      MP_CHECK(td_rref_owner(prs[i]) == 1);
    }
    td_optim_options oo;
    td_optim_options_init(&oo, TD_OPTIM_SGD);
    oo.lr = 0.5;
    td_dist_optimizer *opt = NULL;
    MP_CHECK_OK(td_dist_optimizer_create(a, &oo, prs, 2, &opt));
    td_dist_autograd_context *ctx = NULL;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_tensor *yc = NULL, *loss = NULL;
    MP_CHECK_OK(td_remote_module_forward(rm, x, &yc));
    const int all[2] = {0, 1};
    MP_CHECK_OK(td_tensor_sum(yc, all, 2, false, &loss));
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
    td_value *gl = NULL;
    MP_CHECK_OK(td_rref_rpc_sync(td_remote_module_rref(rm), "rm_grads_of", NULL, 0, NULL, &gl));
    MP_CHECK(td_value_kind_of(td_value_list_get(gl, 0)) == TD_VALUE_TENSOR);
    MP_CHECK_OK(td_dist_optimizer_step(opt, ctx));
    td_value_unref(gl);
    td_tensor_unref(yc);
    td_tensor_unref(loss);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    td_tensor *y2 = NULL;
    MP_CHECK_OK(td_remote_module_forward(rm, x, &y2));
    bool same = true;
    MP_CHECK_OK(td_tensor_allclose(y2, want, 1e-9, 1e-12, &same));
    MP_CHECK(!same); /* the step changed the remote weights */
    td_tensor_unref(y2);
    td_dist_optimizer_destroy(opt);
    td_value_unref(pl);

    /* passing the module to a third worker */
    td_value *rv = td_value_rref(td_remote_module_rref(rm2)), *res = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "rm_use", &rv, 1, NULL, &res));
    td_tensor *x3 = input_x(3), *w3 = local_forward("body", 1, x3), *r3;
    MP_CHECK_OK(td_value_as_tensor(res, &r3));
    check_close(r3, w3, "forward from a third worker");
    td_value_unref(res);
    td_value_unref(rv);
    td_tensor_unref(x3);
    td_tensor_unref(w3);

    /* device strings and creation errors */
    const char *bad_devs[] = {"worker1", "/cpu", "rank:/cpu", "rank:x/cpu", "rank:-1/cpu",
                              "worker1/tpu", "worker1/cpu/0", "worker1/", "work er/cpu", NULL};
    for (int i = 0; bad_devs[i]; i++) {
      td_remote_module *bad_rm = NULL;
      td_status s = td_remote_module_create(a, bad_devs[i], "rm_part", args, &bad_rm);
      if (s != TD_ERR_INVALID) fprintf(stderr, "'%s' gave %s\n", bad_devs[i], td_status_name(s));
      MP_CHECK(s == TD_ERR_INVALID && bad_rm == NULL);
      MP_CHECK(strstr(td_last_error(), "remote device"));
    }
    td_remote_device d;
    MP_CHECK_OK(td_remote_device_parse("rank:12/cuda:1", &d));
    MP_CHECK(d.rank == 12 && d.device.type == TD_DEVICE_CUDA && d.device.index == 1);
    MP_CHECK_OK(td_remote_device_parse("ps/cpu", &d));
    MP_CHECK(d.rank == -1 && !strcmp(d.worker, "ps"));
    td_remote_module *nr = NULL;
    MP_CHECK(td_remote_module_create(a, "nobody/cpu", "rm_part", args, &nr) == TD_ERR_NOT_FOUND);
    MP_CHECK(td_remote_module_create(a, "rank:7/cpu", "rm_part", args, &nr) == TD_ERR_NOT_FOUND);
    td_status s = td_remote_module_create(a, "worker1/cpu", "no_such_factory", args, &nr);
    MP_CHECK(s != TD_OK && strstr(td_last_error(), "no_such_factory") &&
             strstr(td_last_error(), "worker1"));
    if (!td_device_available(td_device_cuda(0))) {
      MP_CHECK(td_remote_module_create(a, "worker1/cuda:0", "rm_part", args, &nr) != TD_OK);
      MP_CHECK(strstr(td_last_error(), "not available"));
    }

    td_value_unref(xv);
    td_value_unref(args);
    td_value_unref(hargs);
    td_tensor_unref(x);
    td_tensor_unref(y);
    td_tensor_unref(want);
    td_remote_module_destroy(head);
    td_remote_module_destroy(rm);
    td_remote_module_destroy(rm2);
  }
  finish(a);
  return 0;
}

static void test_remote_module_behaviours(void **state) {
  (void)state;
  TD_MP_RUN(3, w_basics, NULL, 90);
}

/* ---- pipeline vs. local ---- */

static int w_pipeline(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method);
  if (rank == 0) {
    td_value *ba = part_args("body", 4), *ha = part_args("head", 5);
    td_remote_module *st[2];
    MP_CHECK_OK(td_remote_module_create(a, "worker1/cpu", "rm_part", ba, &st[0]));
    MP_CHECK_OK(td_remote_module_create(a, "worker2/cpu", "rm_part", ha, &st[1]));
    td_pipeline *p = NULL;
    MP_CHECK_OK(td_pipeline_create(a, st, 2, &p));
    MP_CHECK(td_pipeline_num_stages(p) == 2);
    td_tensor *x = input_x(7), *y = labels(), *dummy = NULL;
    MP_CHECK(td_pipeline_forward(p, x, 0, &dummy) == TD_ERR_INVALID);

    /* local reference: the same stages in one process */
    td_module *lb, *lh;
    MP_CHECK_OK(build("body", 4, &lb));
    MP_CHECK_OK(build("head", 5, &lh));
    td_tensor *h = NULL, *want = NULL, *lloss = NULL;
    MP_CHECK_OK(td_module_forward(lb, x, &h));
    MP_CHECK_OK(td_module_forward(lh, h, &want));
    MP_CHECK_OK(td_tensor_cross_entropy(want, y, TD_REDUCTION_MEAN, -100, &lloss));
    MP_CHECK_OK(td_tensor_backward(lloss));
    td_tensor_list lbp, lhp;
    td_tensor_list_init(&lbp);
    td_tensor_list_init(&lhp);
    MP_CHECK_OK(td_module_parameters(lb, &lbp));
    MP_CHECK_OK(td_module_parameters(lh, &lhp));

    const int ms[] = {1, 2, 4, 3};
    for (int t = 0; t < 4; t++) {
      td_dist_autograd_context *ctx = NULL;
      MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
      td_tensor *out = NULL, *loss = NULL;
      MP_CHECK_OK(td_pipeline_forward(p, x, ms[t], &out));
      check_close(out, want, "pipeline output");
      MP_CHECK_OK(td_tensor_cross_entropy(out, y, TD_REDUCTION_MEAN, -100, &loss));
      MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
      for (int k = 0; k < 2; k++) {
        td_value *gl = NULL;
        MP_CHECK_OK(td_rref_rpc_sync(td_remote_module_rref(st[k]), "rm_grads_of", NULL, 0, NULL,
                                     &gl));
        td_tensor_list *lp = k == 0 ? &lbp : &lhp;
        MP_CHECK(td_value_list_len(gl) == lp->n);
        for (size_t i = 0; i < lp->n; i++) {
          td_tensor *g = NULL, *lg = td_tensor_grad(lp->tensors[i]);
          MP_CHECK_OK(td_value_as_tensor(td_value_list_get(gl, i), &g));
          check_close(g, lg, "pipeline gradient");
          td_tensor_unref(lg);
        }
        td_value_unref(gl);
      }
      td_tensor_unref(out);
      td_tensor_unref(loss);
      MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    }
    td_tensor_list_fini(&lbp);
    td_tensor_list_fini(&lhp);
    td_tensor_unref(h);
    td_tensor_unref(want);
    td_tensor_unref(lloss);
    td_module_unref(lb);
    td_module_unref(lh);
    td_tensor_unref(x);
    td_tensor_unref(y);
    td_pipeline_destroy(p);
    td_remote_module_destroy(st[0]);
    td_remote_module_destroy(st[1]);
    td_value_unref(ba);
    td_value_unref(ha);
  }
  finish(a);
  return 0;
}

static void test_pipeline_matches_local(void **state) {
  (void)state;
  TD_MP_RUN(3, w_pipeline, NULL, 90);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_remote_module_behaviours),
      cmocka_unit_test(test_pipeline_matches_local),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
