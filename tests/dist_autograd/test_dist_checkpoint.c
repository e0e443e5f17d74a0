/* test_dist_checkpoint.c - activation checkpointing under distributed autograd, with 2 real
 * worker processes: worker1 runs two GPT blocks with Dropout between them for worker0's input,
 * inside worker0's distributed autograd context, plainly, with every block checkpointed, or with
 * every attention core checkpointed. The distributed backward reaches the checkpoint nodes in
 * worker1's engine pass, whose recompute's inner pass must write the parameters' gradients into
 * the context's gradient map (not `.grad`): they, and the input's gradient on worker0, equal the
 * plain run's bit for bit. And the refusals: an RPC from inside a checkpointed function, in its
 * forward or in its recompute, and from a checkpointed module's forward, fails with the region
 * named and why, and makes no call. */
#include <stdio.h>
#include <string.h>

#include "da_test_fns.h"
#include "test_util.h"

enum { B2 = 2, T = 4, C = 8 };

/* worker1's models: [0] plain, [1] every block checkpointed, [2] every attention core */
static td_module *models[3];

static td_status build_model(int mode, td_module **out) {
  td_gpt_config c;
  td_gpt_config_init(&c);
  c.block_size = T, c.n_layer = 2, c.n_head = 2, c.n_embd = C;
  td_generator *g = NULL;
  td_module *seq = NULL, *b0 = NULL, *dr = NULL, *b1 = NULL;
  DA_TRY(td_generator_create(42, &g));
  td_status st = td_sequential_create(&seq);
  if (st == TD_OK) st = td_gpt_block_create(&c, g, &b0);
  if (st == TD_OK) st = td_dropout_create(0.3, g, &dr);
  if (st == TD_OK) st = td_gpt_block_create(&c, g, &b1);
  td_module *ch[3] = {b0, dr, b1};
  for (int i = 0; i < 3 && st == TD_OK; i++) st = td_sequential_append(seq, ch[i]);
  if (st == TD_OK) st = td_module_to_dtype(seq, TD_DTYPE_F64);
  for (int i = 0; i < 3 && st == TD_OK; i += 2) {
    if (mode == 1) st = td_module_set_checkpoint(ch[i], TD_CHECKPOINT_FULL);
    if (mode == 2) st = td_module_set_checkpoint(td_module_child(ch[i], "attn"),
                                                 TD_CHECKPOINT_SELECTIVE);
  }
  for (int i = 0; i < 3; i++) td_module_unref(ch[i]);
  td_generator_destroy(g);
  if (st != TD_OK) {
    td_module_unref(seq);
    return st;
  }
  *out = seq;
  return TD_OK;
}

/* ck_fwd(mode, x) -> models[mode](x), recorded in the caller's context */
static td_status fn_fwd(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)c, (void)fut;
  int64_t mode = 0;
  td_tensor *x = NULL, *y = NULL;
  if (n != 2 || td_value_as_int(args[0], &mode) != TD_OK || mode < 0 || mode > 2 ||
      td_value_as_tensor(args[1], &x) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "ck_fwd: expected (mode, x)");
  DA_TRY(td_module_forward(models[mode], x, &y));
  int regions = td_test_count_nodes(y, "CheckpointBackward");
  if (regions != (mode ? 2 : 0)) {
    td_tensor_unref(y);
    return td_set_error(TD_ERR_STATE, "ck_fwd: %d checkpointed regions in mode %d", regions,
                        (int)mode);
  }
  *res = td_value_tensor(y);
  td_tensor_unref(y);
  return *res ? TD_OK : td_set_error(TD_ERR_NOMEM, "ck_fwd: out of memory");
}

/* ck_grads(mode) -> [the context's gradient of each parameter of models[mode]], after checking
 * that no `.grad` was written */
static td_status fn_grads(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  (void)c, (void)fut;
  int64_t mode = 0;
  td_dist_autograd_context *ctx = td_dist_autograd_current();
  if (n != 1 || td_value_as_int(args[0], &mode) != TD_OK || mode < 0 || mode > 2 || !ctx)
    return td_set_error(TD_ERR_INVALID, "ck_grads: expected (mode) inside a context");
  td_grad_map *gm = td_dist_autograd_context_grad_map(ctx);
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  td_value *l = td_value_list();
  td_status st = td_module_parameters(models[mode], &ps);
  for (size_t i = 0; i < ps.n && st == TD_OK; i++) {
    td_tensor *dot = td_tensor_grad(ps.tensors[i]), *g = td_grad_map_get(gm, ps.tensors[i]);
    if (dot) st = td_set_error(TD_ERR_STATE, "ck_grads: %s has a .grad", ps.names[i]);
    else if (!g) st = td_set_error(TD_ERR_STATE, "ck_grads: no gradient of %s", ps.names[i]);
    else st = td_value_list_append(l, td_value_tensor(g));
    td_tensor_unref(dot), td_tensor_unref(g);
  }
  td_tensor_list_fini(&ps);
  if (st == TD_OK) *res = l;
  else td_value_unref(l);
  return st;
}

/* One pass of models[mode] on worker1 for x in a fresh context: the input's gradient and the
 * parameters' gradients (a list). */
static void pass(td_rpc_agent *a, int mode, td_tensor **gx, td_value **grads) {
  int64_t s[3] = {B2, T, C};
  td_tensor *x = td_test_randn(s, 3, TD_DTYPE_F64, 7, true), *y = NULL, *yy = NULL, *loss = NULL;
  td_dist_autograd_context *ctx = NULL;
  MP_CHECK_OK(td_dist_autograd_context_begin(a, &ctx));
  td_value *args[2] = {td_value_int(mode), td_value_tensor(x)}, *r = NULL, *gargs[1];
  MP_CHECK_OK(td_rpc_sync(a, "worker1", "ck_fwd", args, 2, NULL, &r));
  MP_CHECK_OK(td_value_as_tensor(r, &y));
  MP_CHECK_OK(td_tensor_mul(y, y, &yy));
  MP_CHECK_OK(td_tensor_sum_all(yy, &loss));
  MP_CHECK_OK(td_dist_autograd_backward(ctx, &loss, 1, false));
  td_grad_map *gm = NULL;
  MP_CHECK_OK(td_dist_autograd_get_gradients(ctx, &gm));
  *gx = td_grad_map_get(gm, x);
  MP_CHECK(*gx != NULL);
  gargs[0] = td_value_int(mode);
  MP_CHECK_OK(td_rpc_sync(a, "worker1", "ck_grads", gargs, 1, NULL, grads));
  MP_CHECK_OK(td_dist_autograd_context_end(ctx));
  td_grad_map_destroy(gm);
  td_value_unref(args[0]), td_value_unref(args[1]), td_value_unref(gargs[0]), td_value_unref(r);
  td_tensor_unref(x), td_tensor_unref(yy), td_tensor_unref(loss);
}

/* ---- refusals ---- */

typedef struct rpc_ctx {
  td_rpc_agent *a;
  bool only_in_recompute;
} rpc_ctx;

/* 2 x, after asking worker1 to echo (in the recompute only, when so asked). */
static td_status fn_calls_rpc(void *vctx, td_tensor *const *in, int n, td_tensor **out, int no) {
  (void)n, (void)no;
  rpc_ctx *c = vctx;
  if (!c->only_in_recompute || td_checkpoint_current(NULL) == TD_CHECKPOINT_PHASE_RECOMPUTE) {
    td_value *r = NULL;
    DA_TRY(td_rpc_sync(c->a, "worker1", "echo", NULL, 0, NULL, &r));
    td_value_unref(r);
  }
  return td_tensor_mul_scalar(in[0], 2.0, &out[0]);
}

static td_rpc_agent *lookup_agent;

/* A module whose forward asks worker1 (not replayable). */
static td_status remote_lookup_forward(td_module *self, td_tensor *const *in, int n_in,
                                       td_tensor **out, int n_out) {
  (void)self, (void)n_in, (void)n_out;
  rpc_ctx c = {lookup_agent, false};
  return fn_calls_rpc(&c, in, 1, out, 1);
}

static const td_module_type lookup_type = {"RemoteLookup", remote_lookup_forward, NULL};

static uint64_t calls_started(td_rpc_agent *a) {
  td_rpc_stats st;
  MP_CHECK_OK(td_rpc_get_stats(a, &st));
  return st.calls_started;
}

static void check_refusals(td_rpc_agent *a) {
  int64_t s[1] = {3};
  td_tensor *x = td_test_randn(s, 1, TD_DTYPE_F64, 1, true), *y = NULL, *sum = NULL;
  rpc_ctx c = {a, false};
  td_checkpoint_opts o = {.name = "lookup"};
  uint64_t before = calls_started(a);
  MP_CHECK(td_checkpoint(fn_calls_rpc, &c, &x, 1, &y, 1, &o) == TD_ERR_STATE && y == NULL);
  fprintf(stderr, "refused: %s\n", td_last_error());
  MP_CHECK(strstr(td_last_error(), "checkpointed region 'lookup'"));
  MP_CHECK(strstr(td_last_error(), "'echo' on worker1"));
  MP_CHECK(strstr(td_last_error(), "in its forward"));
  MP_CHECK(calls_started(a) == before); /* nothing was sent */
  /* an RPC in the recompute only: the backward fails, naming the phase */
  c.only_in_recompute = true;
  MP_CHECK_OK(td_checkpoint(fn_calls_rpc, &c, &x, 1, &y, 1, &o));
  MP_CHECK_OK(td_tensor_sum_all(y, &sum));
  MP_CHECK(td_tensor_backward(sum) == TD_ERR_STATE);
  MP_CHECK(strstr(td_last_error(), "in its recompute in backward"));
  MP_CHECK(calls_started(a) == before);
  td_tensor_unref(sum), td_tensor_unref(y);
  y = NULL;
  /* a checkpointed module's forward: the module's type is named */
  td_module *m = NULL;
  lookup_agent = a;
  MP_CHECK_OK(td_module_create(&lookup_type, NULL, &m));
  MP_CHECK_OK(td_module_set_checkpoint(m, TD_CHECKPOINT_FULL));
  MP_CHECK(td_module_forward(m, x, &y) == TD_ERR_STATE && y == NULL);
  MP_CHECK(strstr(td_last_error(), "checkpointed region 'RemoteLookup'"));
  MP_CHECK(calls_started(a) == before);
  /* the same module without checkpointing may call */
  MP_CHECK_OK(td_module_set_checkpoint(m, TD_CHECKPOINT_NONE));
  MP_CHECK_OK(td_module_forward(m, x, &y));
  MP_CHECK(calls_started(a) == before + 1);
  td_tensor_unref(y), td_tensor_unref(x);
  td_module_unref(m);
}

static int worker(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_register("ck_fwd", fn_fwd, NULL);
  td_rpc_register("ck_grads", fn_grads, NULL);
  td_rpc_register("echo", td_test_fn_echo, NULL);
  for (int mode = 0; mode < 3; mode++) MP_CHECK_OK(build_model(mode, &models[mode]));
  td_rref_set_strict(true);
  td_dist_autograd_set_strict(true);
  td_rpc_options o = td_mp_rpc_options(method, 4);
  td_rpc_agent *a = NULL;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    td_tensor *gx[3];
    td_value *grads[3];
    for (int mode = 0; mode < 3; mode++) pass(a, mode, &gx[mode], &grads[mode]);
    for (int mode = 1; mode < 3; mode++) {
      const char *what = mode == 1 ? "every block checkpointed" : "every attention core";
      if (!td_test_same_bits(gx[0], gx[mode])) {
        fprintf(stderr, "%s: the input's gradient differs\n", what);
        MP_CHECK(0);
      }
      MP_CHECK(td_value_list_len(grads[0]) == td_value_list_len(grads[mode]));
      for (size_t i = 0; i < td_value_list_len(grads[0]); i++) {
        td_tensor *g0 = NULL, *gm = NULL;
        MP_CHECK_OK(td_value_as_tensor(td_value_list_get(grads[0], i), &g0));
        MP_CHECK_OK(td_value_as_tensor(td_value_list_get(grads[mode], i), &gm));
        if (!td_test_same_bits(g0, gm)) {
          fprintf(stderr, "%s: parameter %zu's gradient in the context differs\n", what, i);
          MP_CHECK(0);
        }
      }
    }
    for (int mode = 0; mode < 3; mode++) td_tensor_unref(gx[mode]), td_value_unref(grads[mode]);
    check_refusals(a);
  }
  td_mp_finish(a, 60);
  for (int mode = 0; mode < 3; mode++) td_module_unref(models[mode]);
  return 0;
}

static void test_dist_checkpoint_grads_in_context_and_refusals(void **state) {
  (void)state;
  TD_MP_RUN(2, worker, NULL, 90);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dist_checkpoint_grads_in_context_and_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
