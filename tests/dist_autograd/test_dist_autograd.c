/* test_dist_autograd.c - multi-process tests of distributed autograd and the distributed
 * optimizer: parity of an MLP split across 2 and 3 workers with the same model trained in one
 * process (loss, gradients, parameters after 10 steps of every optimizer kind), errors from a
 * backward function two hops away, retain_graph accumulation, several roots, cleanup reaching
 * workers met only through nested calls, and 3 trainers x 4 threads against one parameter server.
 * Every worker runs in strict RRef mode and checks that no context or backward pass is left.
 * Lock order: ps_mu is a leaf (the parameter server's count of finished trainers). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "da_test_fns.h"
#include "test_util.h"

static td_rpc_agent *start(int rank, int world, const char *method, int threads) {
  da_register_all();
  da_param(rank);
  td_rref_set_strict(true);
  td_dist_autograd_set_strict(true); /* a context left behind fails the graceful shutdown */
  td_rpc_options o = td_mp_rpc_options(method, threads);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  return a;
}

static void finish(td_rpc_agent *a) { td_mp_finish(a, 60); }

/* Asserts that no worker holds a context, a running pass or a send function. */
static void check_clean(td_rpc_agent *a) { da_check_clean(a); }

static td_tensor *tensor_f64(const double *d, const int64_t *shape, int ndim) {
  td_tensor *t;
  MP_CHECK_OK(td_tensor_from_buffer(d, shape, ndim, TD_DTYPE_F64, &t));
  return t;
}

static void check_close(const td_tensor *a, const td_tensor *b, double rtol, const char *what) {
  bool ok = false;
  MP_CHECK(a && b);
  MP_CHECK_OK(td_tensor_allclose(a, b, rtol, 1e-12, &ok));
  if (!ok) fprintf(stderr, "mismatch: %s\n", what);
  MP_CHECK(ok);
}

/* ---- parity: MLP split across workers vs. one process ---- */

typedef struct batch {
  td_tensor *x;   /* [N, D] float64 (2-worker model) */
  td_tensor *idx; /* [N] int64 (3-worker model) */
  td_tensor *y;   /* [N] int64 labels */
} batch;

static batch make_batch(int step) {
  batch b;
  double x[DA_N * DA_D];
  int64_t idx[DA_N], y[DA_N];
  for (int i = 0; i < DA_N * DA_D; i++) x[i] = cos(0.37 * i + 0.11 * step);
  for (int i = 0; i < DA_N; i++) {
    idx[i] = (i * 3 + step) % DA_V;
    y[i] = (i + step) % DA_C;
  }
  int64_t sx[2] = {DA_N, DA_D}, sn[1] = {DA_N};
  b.x = tensor_f64(x, sx, 2);
  MP_CHECK_OK(td_tensor_from_buffer(idx, sn, 1, TD_DTYPE_I64, &b.idx));
  MP_CHECK_OK(td_tensor_from_buffer(y, sn, 1, TD_DTYPE_I64, &b.y));
  return b;
}

static void batch_free(batch *b) {
  td_tensor_unref(b->x);
  td_tensor_unref(b->idx);
  td_tensor_unref(b->y);
}

static td_tensor *remote_fwd(td_rref *m, td_tensor *x) {
  td_value *xv = td_value_tensor(x), *r;
  MP_CHECK_OK(td_rref_rpc_sync(m, "fwd", &xv, 1, NULL, &r));
  td_value_unref(xv);
  td_tensor *t;
  MP_CHECK_OK(td_value_as_tensor(r, &t));
  td_tensor_ref(t);
  td_value_unref(r);
  return t;
}

static td_rref *make_remote(td_rpc_agent *a, const char *to, const char *kind, int64_t seed) {
  td_value *args[2] = {td_value_string(kind), td_value_int(seed)};
  td_rref *r;
  MP_CHECK_OK(td_remote(a, to, "make_part", args, 2, NULL, &r));
  td_value_unref(args[0]);
  td_value_unref(args[1]);
  return r;
}

static void optim_opts(td_optim_kind kind, td_optim_options *o) {
  td_optim_options_init(o, kind);
  switch (kind) {
    case TD_OPTIM_SGD:
      o->lr = 0.1;
      o->momentum = 0.9;
      break;
    case TD_OPTIM_ADAM: o->lr = 0.01; break;
    case TD_OPTIM_ADAMW: o->lr = 0.01; break;
    case TD_OPTIM_ADAGRAD: o->lr = 0.1; break;
    case TD_OPTIM_RMSPROP: o->lr = 0.01; break;
  }
}

/* Appends the RRefs of every parameter of a remote module (list value) to refs. */
static void append_param_rrefs(td_value *list, td_rref **refs, size_t *n) {
  for (size_t i = 0; i < td_value_list_len(list); i++)
    MP_CHECK_OK(td_value_as_rref(td_value_list_get(list, i), &refs[(*n)++]));
}

/* world 2: worker1 holds mlp1 (RRef'd module), worker0 the head locally.
 * world 3: worker1 holds the embedding table, worker2 mlp2; worker0 only the loss. */
static td_tensor *forward_dist(int world, td_rref *p1, td_rref *p2, td_module *head,
                               const batch *b) {
  td_tensor *out;
  if (world == 2) {
    td_tensor *h = remote_fwd(p1, b->x);
    MP_CHECK(td_tensor_requires_grad(h));
    MP_CHECK_OK(td_module_forward(head, h, &out));
    td_tensor_unref(h);
  } else {
    td_tensor *e = remote_fwd(p1, b->idx);
    MP_CHECK(td_tensor_requires_grad(e));
    out = remote_fwd(p2, e);
    td_tensor_unref(e);
  }
  td_tensor *loss;
  MP_CHECK_OK(td_tensor_cross_entropy(out, b->y, TD_REDUCTION_MEAN, -100, &loss));
  td_tensor_unref(out);
  return loss;
}

static td_tensor *forward_ref(int world, td_module *r1, td_module *r2, const batch *b) {
  td_tensor *h, *out, *loss;
  MP_CHECK_OK(td_module_forward(r1, world == 2 ? b->x : b->idx, &h));
  MP_CHECK_OK(td_module_forward(r2, h, &out));
  MP_CHECK_OK(td_tensor_cross_entropy(out, b->y, TD_REDUCTION_MEAN, -100, &loss));
  td_tensor_unref(h);
  td_tensor_unref(out);
  return loss;
}

static void check_remote_grads(td_rref *m, td_module *ref) {
  td_value *g;
  MP_CHECK_OK(td_rref_rpc_sync(m, "grads_of", NULL, 0, NULL, &g));
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  MP_CHECK_OK(td_module_parameters(ref, &ps));
  MP_CHECK(td_value_list_len(g) == ps.n);
  for (size_t i = 0; i < ps.n; i++) {
    td_tensor *t, *rg = td_tensor_grad(ps.tensors[i]);
    MP_CHECK_OK(td_value_as_tensor(td_value_list_get(g, i), &t));
    check_close(t, rg, 1e-6, "remote gradient");
    td_tensor_unref(rg);
  }
  td_tensor_list_fini(&ps);
  td_value_unref(g);
}

static void check_params(td_rref *const *refs, size_t n, td_module *const *ref_mods, int nmods) {
  size_t k = 0;
  for (int mi = 0; mi < nmods; mi++) {
    td_tensor_list ps;
    td_tensor_list_init(&ps);
    MP_CHECK_OK(td_module_parameters(ref_mods[mi], &ps));
    for (size_t i = 0; i < ps.n; i++, k++) {
      MP_CHECK(k < n);
      td_value *v;
      MP_CHECK_OK(td_rref_to_here(refs[k], 10000, &v));
      td_tensor *t;
      MP_CHECK_OK(td_value_as_tensor(v, &t));
      check_close(t, ps.tensors[i], 1e-6, "parameter after training");
      td_value_unref(v);
    }
    td_tensor_list_fini(&ps);
  }
  MP_CHECK(k == n);
}

static void parity_run(td_rpc_agent *a, int world, td_optim_kind kind) {
  /* distributed model */
  td_rref *p1, *p2 = NULL;
  td_module *head = NULL;
  if (world == 2) {
    p1 = make_remote(a, "worker1", "mlp1", 1);
    MP_CHECK_OK(da_build("head", 2, &head));
  } else {
    p1 = make_remote(a, "worker1", "emb", 3);
    p2 = make_remote(a, "worker2", "mlp2", 4);
  }
  /* the same model in this process */
  td_module *r1, *r2;
  MP_CHECK_OK(da_build(world == 2 ? "mlp1" : "emb", world == 2 ? 1 : 3, &r1));
  MP_CHECK_OK(da_build(world == 2 ? "head" : "mlp2", world == 2 ? 2 : 4, &r2));

  /* parameter RRefs: remote modules' parameters, and local ones for the head */
  td_rref *refs[16];
  size_t nrefs = 0;
  td_value *l1, *l2 = NULL;
  MP_CHECK_OK(td_dist_module_parameter_rrefs(p1, TD_TIMEOUT_DEFAULT, &l1));
  append_param_rrefs(l1, refs, &nrefs);
  td_rref *local_refs[4];
  int nlocal = 0;
  if (world == 2) {
    td_tensor_list ps;
    td_tensor_list_init(&ps);
    MP_CHECK_OK(td_module_parameters(head, &ps));
    for (size_t i = 0; i < ps.n; i++) {
      td_value *tv = td_value_tensor(ps.tensors[i]);
      MP_CHECK_OK(td_rref_create_local(a, tv, &local_refs[nlocal]));
      refs[nrefs++] = local_refs[nlocal++];
      td_value_unref(tv);
    }
    td_tensor_list_fini(&ps);
  } else {
    MP_CHECK_OK(td_dist_module_parameter_rrefs(p2, TD_TIMEOUT_DEFAULT, &l2));
    append_param_rrefs(l2, refs, &nrefs);
  }
  td_optim_options oo;
  optim_opts(kind, &oo);
  td_dist_optimizer *dopt;
  MP_CHECK_OK(td_dist_optimizer_create(a, &oo, refs, nrefs, &dopt));
  MP_CHECK(td_dist_optimizer_num_owners(dopt) == 2);
  td_tensor_list rps;
  td_tensor_list_init(&rps);
  MP_CHECK_OK(td_module_parameters(r1, &rps));
  MP_CHECK_OK(td_module_parameters(r2, &rps));
  td_optim *ropt;
  MP_CHECK_OK(td_optim_create(&oo, rps.tensors, rps.n, &ropt));

  for (int step = 0; step < 10; step++) {
    batch b = make_batch(step);
    td_dist_autograd_context *ctx;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_tensor *loss = forward_dist(world, p1, p2, head, &b);
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));

    td_tensor *rloss = forward_ref(world, r1, r2, &b);
    MP_CHECK_OK(td_tensor_backward(rloss));
    check_close(loss, rloss, 1e-9, "loss");
    if (step == 0 || step == 9) {
      check_remote_grads(p1, r1);
      if (world == 2) {
        /* the head's gradients are in this worker's context, never in .grad */
        td_grad_map *gm;
        MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
        td_tensor_list hp, rp;
        td_tensor_list_init(&hp);
        td_tensor_list_init(&rp);
        MP_CHECK_OK(td_module_parameters(head, &hp));
        MP_CHECK_OK(td_module_parameters(r2, &rp));
        MP_CHECK(td_grad_map_size(gm) == hp.n);
        for (size_t i = 0; i < hp.n; i++) {
          td_tensor *g = td_grad_map_get(gm, hp.tensors[i]), *rg = td_tensor_grad(rp.tensors[i]);
          MP_CHECK(td_tensor_grad(hp.tensors[i]) == NULL);
          check_close(g, rg, 1e-6, "local gradient");
          td_tensor_unref(g);
          td_tensor_unref(rg);
        }
        td_tensor_list_fini(&hp);
        td_tensor_list_fini(&rp);
        td_grad_map_destroy(gm);
      } else {
        check_remote_grads(p2, r2);
      }
    }
    MP_CHECK_OK(td_dist_optimizer_step(dopt, ctx));
    MP_CHECK_OK(td_optim_step(ropt));
    td_optim_zero_grad(ropt);
    td_tensor_unref(loss);
    td_tensor_unref(rloss);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    batch_free(&b);
  }
  td_module *mods[2] = {r1, r2};
  check_params(refs, nrefs, mods, 2);

  td_dist_optimizer_destroy(dopt);
  td_optim_destroy(ropt);
  td_tensor_list_fini(&rps);
  for (int i = 0; i < nlocal; i++) td_rref_unref(local_refs[i]);
  td_value_unref(l1);
  td_value_unref(l2);
  td_rref_unref(p1);
  td_rref_unref(p2);
  td_module_unref(head);
  td_module_unref(r1);
  td_module_unref(r2);
  check_clean(a);
}

static int worker_parity(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    for (int k = TD_OPTIM_SGD; k <= TD_OPTIM_RMSPROP; k++) parity_run(a, world, (td_optim_kind)k);
  }
  finish(a);
  return 0;
}

static void test_dist_autograd_parity_two_workers(void **state) {
  TD_MP_RUN(2, worker_parity, NULL, 180);
}
static void test_dist_autograd_parity_three_workers(void **state) {
  TD_MP_RUN(3, worker_parity, NULL, 180);
}

/* ---- small graphs: retain_graph, several roots, errors, cleanup ---- */

static td_tensor *rpc_tensor(td_rpc_agent *a, const char *to, const char *fn, td_value **args,
                             int n) {
  return da_rpc_tensor(a, to, fn, args, n);
}

static td_tensor *leaf_x(void) {
  double d[DA_D];
  for (int k = 0; k < DA_D; k++) d[k] = 0.5 + k;
  int64_t s[1] = {DA_D};
  td_tensor *x = tensor_f64(d, s, 1);
  MP_CHECK_OK(td_tensor_set_requires_grad(x, true));
  return x;
}

static double at(const td_tensor *t, int64_t k) {
  double v;
  MP_CHECK_OK(td_tensor_get(t, &k, &v));
  return v;
}

static td_tensor *sum(td_tensor *t, double scale) {
  td_tensor *s, *o;
  MP_CHECK_OK(td_tensor_sum_all(t, &s));
  MP_CHECK_OK(td_tensor_mul_scalar(s, scale, &o));
  td_tensor_unref(s);
  return o;
}

static td_tensor *remote_grad_p(td_rpc_agent *a, const char *to) {
  td_value *r;
  MP_CHECK_OK(td_rpc_sync(a, to, "grad_p", NULL, 0, NULL, &r));
  td_tensor *t = NULL;
  if (td_value_kind_of(r) == TD_VALUE_TENSOR) {
    MP_CHECK_OK(td_value_as_tensor(r, &t));
    td_tensor_ref(t);
  }
  td_value_unref(r);
  return t;
}

static int worker_small(int rank, int world, const char *method, void *arg) {
  td_rpc_agent *a = start(rank, world, method, 4);
  if (rank == 0) {
    td_tensor *x = leaf_x();
    td_value *xv = td_value_tensor(x);
    double p1[DA_D], p2[DA_D];
    for (int k = 0; k < DA_D; k++) {
      p1[k] = 1.0 + k + 1;
      p2[k] = 1.0 + k + 2;
    }

    /* a second context on the same thread is an error; unknown ids are errors naming them */
    td_dist_autograd_context *ctx, *other;
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    MP_CHECK(td_dist_autograd_current() == ctx);
    MP_CHECK(td_dist_autograd_context_begin(a, &other) == TD_ERR_STATE);
    td_dist_autograd_context_id bogus = {((uint64_t)1 << 48) | 12345};
    MP_CHECK(td_dist_autograd_context_retrieve(a, bogus, &other) == TD_ERR_NOT_FOUND);
    MP_CHECK(strstr(td_last_error(), "1:12345") != NULL);
    MP_CHECK(td_dist_autograd_context_get_id(ctx).v >> 48 == 0);

    /* roots must have a gradient function, as in PyTorch: a leaf (even one requiring grad) and a
     * tensor without requires_grad are refused, and nothing is accumulated */
    MP_CHECK(td_dist_autograd_backward(ctx, &x, 1, false) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "does not have a valid gradient function") != NULL);
    td_tensor *plain = tensor_f64(p1, (int64_t[]){DA_D}, 1);
    MP_CHECK(td_dist_autograd_backward(ctx, &plain, 1, false) == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "requires_grad not set") != NULL);
    td_tensor_unref(plain);

    /* retain_graph: y = x * p on worker1, loss = sum(y); backward twice adds up */
    td_tensor *y = rpc_tensor(a, "worker1", "mulp", &xv, 1);
    MP_CHECK(td_tensor_requires_grad(y));
    td_tensor *loss = sum(y, 1.0);
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, true));
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
    td_grad_map *gm;
    MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
    td_tensor *gx = td_grad_map_get(gm, x);
    for (int k = 0; k < DA_D; k++) MP_CHECK(fabs(at(gx, k) - 2 * p1[k]) < 1e-12);
    MP_CHECK(td_tensor_grad(x) == NULL);
    td_tensor_unref(gx);
    td_grad_map_destroy(gm);
    td_tensor *gp = remote_grad_p(a, "worker1");
    for (int k = 0; k < DA_D; k++) MP_CHECK(fabs(at(gp, k) - 2 * (0.5 + k)) < 1e-12);
    td_tensor_unref(gp);
    /* a third time without retained graph fails, naming the worker */
    MP_CHECK(td_dist_autograd_backward(ctx, &loss, 1, false) != TD_OK);
    MP_CHECK(strstr(td_last_error(), "second time") != NULL);
    td_tensor_unref(loss);
    td_tensor_unref(y);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    MP_CHECK(td_dist_autograd_current() == NULL);
    check_clean(a);

    /* several roots across two workers */
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_tensor *y1 = rpc_tensor(a, "worker1", "mulp", &xv, 1);
    td_tensor *y2 = rpc_tensor(a, "worker2", "mulp", &xv, 1);
    td_tensor *roots[2] = {sum(y1, 1.0), sum(y2, 2.0)};
    MP_CHECK_OK(td_dist_autograd_backward(ctx, roots, 2, false));
    MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
    gx = td_grad_map_get(gm, x);
    for (int k = 0; k < DA_D; k++) MP_CHECK(fabs(at(gx, k) - (p1[k] + 2 * p2[k])) < 1e-12);
    td_tensor_unref(gx);
    td_grad_map_destroy(gm);
    gp = remote_grad_p(a, "worker2");
    for (int k = 0; k < DA_D; k++) MP_CHECK(fabs(at(gp, k) - 2 * (0.5 + k)) < 1e-12);
    td_tensor_unref(gp);
    for (int i = 0; i < 2; i++) td_tensor_unref(roots[i]);
    td_tensor_unref(y1);
    td_tensor_unref(y2);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    check_clean(a);

    /* nested: worker0 -> worker1 -> worker2 (worker0 never talks to worker2); gradients come
     * back over both hops, and the cleanup reaches worker2 through worker1 */
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_value *hargs[3] = {xv, td_value_string("worker2"), td_value_string("mulp")};
    y = rpc_tensor(a, "worker1", "hop", hargs, 3);
    loss = sum(y, 1.0);
    td_value *info;
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "da_info", NULL, 0, NULL, &info));
    int64_t nctx = -1;
    MP_CHECK_OK(td_value_as_int(td_value_list_get(info, 0), &nctx));
    MP_CHECK(nctx == 1);
    td_value_unref(info);
    MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
    MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
    gx = td_grad_map_get(gm, x);
    for (int k = 0; k < DA_D; k++) MP_CHECK(fabs(at(gx, k) - 1.5 * p2[k]) < 1e-12);
    td_tensor_unref(gx);
    td_grad_map_destroy(gm);
    td_tensor_unref(loss);
    td_tensor_unref(y);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    check_clean(a);

    /* a backward function failing two hops away (worker2, reached through worker1) */
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_value_unref(hargs[2]);
    hargs[2] = td_value_string("failing");
    y = rpc_tensor(a, "worker1", "hop", hargs, 3);
    loss = sum(y, 1.0);
    td_status st = td_dist_autograd_backward(ctx, &loss, 1, false);
    MP_CHECK(st == TD_ERR_INVALID);
    fprintf(stderr, "expected error: %s\n", td_last_error());
    MP_CHECK(strstr(td_last_error(), "worker2 (rank 2)") != NULL);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    MP_CHECK(strstr(td_last_error(), "boom in FailBackward") != NULL);
    td_tensor_unref(loss);
    td_tensor_unref(y);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    td_value_unref(hargs[1]);
    td_value_unref(hargs[2]);
    check_clean(a);

    /* a distributed optimizer over a parameter whose creation is still in flight (300 ms)
     * waits for it instead of failing */
    td_value *delay = td_value_int(300);
    td_rref *slow;
    MP_CHECK_OK(td_remote(a, "worker1", "slow_param", &delay, 1, NULL, &slow));
    td_value_unref(delay);
    MP_CHECK(!td_rref_confirmed_by_owner(slow));
    td_optim_options so;
    optim_opts(TD_OPTIM_SGD, &so);
    td_dist_optimizer *sopt;
    MP_CHECK_OK(td_dist_optimizer_create(a, &so, &slow, 1, &sopt));
    td_dist_optimizer_destroy(sopt);
    td_rref_unref(slow);

    /* recv functions outside a distributed backward pass are refused */
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    y = rpc_tensor(a, "worker1", "mulp", &xv, 1);
    loss = sum(y, 1.0);
    MP_CHECK(td_tensor_backward(loss) == TD_ERR_STATE);
    td_tensor_unref(loss);
    td_tensor_unref(y);
    MP_CHECK_OK(td_dist_autograd_context_end(ctx));
    check_clean(a);

    td_value_unref(xv);
    td_tensor_unref(x);
  }
  finish(a);
  return 0;
}

static void test_dist_autograd_small_graphs(void **state) { TD_MP_RUN(3, worker_small, NULL, 120); }

/* ---- 3 trainers x 4 threads against one parameter server ---- */

typedef struct trainer {
  td_rpc_agent *a;
  td_rref *model;
  td_dist_optimizer *opt;
  int tid;
  int failed;
} trainer;

static void *trainer_thread(void *arg) {
  trainer *t = arg;
  for (int it = 0; it < 10; it++) {
    /* x differs per process, thread and iteration; loss = sum(W x + b) so dL/dW[i][j] = sum_b
     * x[b][j] whatever W is: the gradient seen on the server proves the contexts stay apart */
    double xd[2 * DA_D];
    double tag = td_rpc_rank(t->a) * 100 + t->tid * 10 + it;
    for (int k = 0; k < 2 * DA_D; k++) xd[k] = tag + 0.01 * k;
    int64_t s[2] = {2, DA_D};
    td_tensor *x = tensor_f64(xd, s, 2);
    td_dist_autograd_context *ctx;
    if (td_dist_autograd_context_begin(t->a, &ctx) != TD_OK) {
      t->failed = __LINE__;
      return NULL;
    }
    td_value *xv = td_value_tensor(x), *r, *g = NULL;
    td_status st = td_rref_rpc_sync(t->model, "fwd", &xv, 1, NULL, &r);
    td_tensor *y = NULL, *loss = NULL;
    if (st == TD_OK) st = td_value_as_tensor(r, &y);
    if (st == TD_OK) st = td_tensor_sum_all(y, &loss);
    if (st == TD_OK) st = td_dist_autograd_backward(ctx, &loss, 1, false);
    if (st == TD_OK) st = td_rref_rpc_sync(t->model, "grads_of", NULL, 0, NULL, &g);
    if (st == TD_OK) {
      /* mlp1 = Linear(D, H) + ReLU: check the bias gradient is the count of active units, and
       * the weight gradient row of an active unit equals sum_b x[b] */
      td_tensor *gw;
      st = td_value_as_tensor(td_value_list_get(g, 0), &gw);
      for (int j = 0; st == TD_OK && j < DA_D; j++) {
        double v = ((const double *)td_tensor_data(gw))[j], e = xd[j] + xd[DA_D + j];
        if (v != 0 && fabs(v - e) > 1e-9 * fabs(e) && fabs(v - xd[j]) > 1e-9 &&
            fabs(v - xd[DA_D + j]) > 1e-9)
          st = td_set_error(TD_ERR_INTERNAL, "weight gradient [0][%d] = %g; inputs %g and %g", j,
                            v, xd[j], xd[DA_D + j]);
      }
    }
    if (st == TD_OK) st = td_dist_optimizer_step(t->opt, ctx);
    if (st != TD_OK) {
      fprintf(stderr, "trainer %d.%d: %s\n", td_rpc_rank(t->a), t->tid, td_last_error());
      t->failed = __LINE__;
    }
    td_value_unref(g);
    td_tensor_unref(loss);
    td_value_unref(r);
    td_value_unref(xv);
    td_tensor_unref(x);
    if (td_dist_autograd_context_end(ctx) != TD_OK) t->failed = __LINE__;
    if (t->failed) return NULL;
  }
  return NULL;
}

/* Trainers tell the server when they are done, so it can check its table before shutdown. */
static pthread_mutex_t ps_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ps_cv = PTHREAD_COND_INITIALIZER;
static int ps_done_count;

static td_status ps_done(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  pthread_mutex_lock(&ps_mu);
  ps_done_count++;
  pthread_cond_broadcast(&ps_cv);
  pthread_mutex_unlock(&ps_mu);
  return TD_OK;
}

static int worker_ps(int rank, int world, const char *method, void *arg) {
  td_rpc_register("ps_done", ps_done, NULL);
  td_rpc_agent *a = start(rank, world, method, 8);
  if (rank != 0) {
    td_rref *model = make_remote(a, "worker0", "mlp1", 7);
    td_value *pl;
    MP_CHECK_OK(td_dist_module_parameter_rrefs(model, TD_TIMEOUT_DEFAULT, &pl));
    td_rref *refs[4];
    size_t n = 0;
    append_param_rrefs(pl, refs, &n);
    td_optim_options oo;
    optim_opts(TD_OPTIM_SGD, &oo);
    oo.momentum = 0;
    oo.lr = 1e-4;
    td_dist_optimizer *opt;
    MP_CHECK_OK(td_dist_optimizer_create(a, &oo, refs, n, &opt));
    trainer ts[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
      ts[i] = (trainer){a, model, opt, i, 0};
      MP_CHECK(pthread_create(&th[i], NULL, trainer_thread, &ts[i]) == 0);
    }
    for (int i = 0; i < 4; i++) {
      pthread_join(th[i], NULL);
      if (ts[i].failed) fprintf(stderr, "trainer thread %d failed at line %d\n", i, ts[i].failed);
      MP_CHECK(!ts[i].failed);
    }
    td_dist_optimizer_destroy(opt);
    td_value_unref(pl);
    td_rref_unref(model);
    td_dist_autograd_debug_info di;
    MP_CHECK_OK(td_dist_autograd_get_debug_info(a, &di));
    MP_CHECK(di.num_contexts == 0 && di.num_backward_passes == 0 && di.num_send_functions == 0);
    td_value *r;
    MP_CHECK_OK(td_rpc_sync(a, "worker0", "ps_done", NULL, 0, NULL, &r));
    td_value_unref(r);
  } else {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)td_test_s(120);
    pthread_mutex_lock(&ps_mu);
    while (ps_done_count < world - 1)
      MP_CHECK(pthread_cond_timedwait(&ps_cv, &ps_mu, &dl) == 0);
    pthread_mutex_unlock(&ps_mu);
    td_dist_autograd_debug_info di;
    MP_CHECK_OK(td_dist_autograd_get_debug_info(a, &di));
    if (di.num_contexts || di.num_backward_passes)
      fprintf(stderr, "server: %lld contexts, %lld passes\n", (long long)di.num_contexts,
              (long long)di.num_backward_passes);
    MP_CHECK(di.num_contexts == 0 && di.num_backward_passes == 0 && di.num_send_functions == 0);
  }
  finish(a);
  return 0;
}

static void test_dist_autograd_parameter_server(void **state) {
  TD_MP_RUN(4, worker_ps, NULL, 180);
}

/* ---- strict mode: a context never ended makes the graceful shutdown fail on every worker that
 * holds it, naming it; without strict mode it is only logged ---- */

static int worker_leftover(int rank, int world, const char *method, void *arg) {
  bool strict = arg != NULL;
  td_rpc_agent *a = start(rank, world, method, 4);
  td_dist_autograd_set_strict(strict);
  td_dist_autograd_context *ctx = NULL;
  char id[64] = "";
  if (rank == 0) {
    MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
    td_dist_autograd_context_id cid = td_dist_autograd_context_get_id(ctx);
    snprintf(id, sizeof id, "%llu:%llu", (unsigned long long)(cid.v >> 48),
             (unsigned long long)(cid.v & 0xffffffffffffull));
    td_tensor *x = leaf_x();
    td_value *xv = td_value_tensor(x);
    td_tensor *y = rpc_tensor(a, "worker1", "mulp", &xv, 1); /* worker1 joins the context */
    td_tensor_unref(y);
    td_value_unref(xv);
    td_tensor_unref(x);
    td_dist_autograd_set_current(NULL); /* never ended */
  }
  td_status st = td_rpc_shutdown(a, true, td_test_ms(60000));
  if (strict) {
    MP_CHECK(st == TD_ERR_STATE);
    MP_CHECK(strstr(td_last_error(), "left at shutdown") != NULL);
    if (rank == 0) MP_CHECK(strstr(td_last_error(), id) != NULL);
  } else {
    MP_CHECK_OK(st);
  }
  td_rpc_destroy(a);
  td_dist_autograd_context_unref(ctx); /* the caller's reference (end was never called) */
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_dist_autograd_strict_leftover_context(void **state) {
  TD_MP_RUN(2, worker_leftover, (void *)1, 90); /* strict */
  TD_MP_RUN(2, worker_leftover, NULL, 90);      /* not strict */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dist_autograd_small_graphs),
      cmocka_unit_test(test_dist_autograd_parity_two_workers),
      cmocka_unit_test(test_dist_autograd_parity_three_workers),
      cmocka_unit_test(test_dist_autograd_parameter_server),
      cmocka_unit_test(test_dist_autograd_strict_leftover_context),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
