/* c_param_server.c - the C parameter server of bindings/python/examples/param_server.py: holds
 * the model of examples/param_server (MLP 784-256-10, the same seeded initialisation) and serves
 * Python trainers that compute gradients with PyTorch.
 *
 *   ps_get_params() -> [W1 [256, 784], b1 [256], W2 [10, 256], b2 [10]]: a copy of the current
 *                      parameters (taken under the lock, so no step tears it)
 *   ps_push(grads, lr) -> steps taken so far: one SGD step (Nesterov momentum --momentum, the
 *                      learning rate the trainer's schedule gives) with the caller's gradients;
 *                      every trainer has its own momentum buffers, as each trainer's distributed
 *                      optimizer of examples/param_server has on the server
 *   ps_evaluate() -> test accuracy of the current parameters on the Fashion-MNIST test set
 *   ps_barrier() -> none, once every trainer (world size - 1) has called it: answered with a
 *                      future (no thread waits), so the trainers start every epoch together, as
 *                      the C example's trainers do
 *
 * It joins the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
 * TD_RPC_SECRET) as worker "ps" and leaves with a graceful shutdown once every trainer left.
 * Options: --seed N (model initialisation, 0), --momentum M (0.9), --data-dir D.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_common.h"
#include "tdist/tdist.h"

#define MAX_TRAINERS 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* the model and the optimizers */
static td_module *model;
static td_tensor_list params;
static td_optim *opts[MAX_TRAINERS]; /* by the trainer's rank, made on its first push */
static double momentum = 0.9;
static int64_t steps;
static td_mnist *test_set;
static td_future *arrived[MAX_TRAINERS]; /* ps_barrier: the replies of the trainers waiting */
static int n_arrived;

static td_status fn_get_params(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  td_value *l = td_value_list();
  td_status st = l ? TD_OK : TD_ERR_NOMEM;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; st == TD_OK && i < params.n; i++) {
    td_tensor *copy = NULL;
    bool prev = td_autograd_set_enabled(false);
    st = td_tensor_clone(params.tensors[i], &copy);
    td_autograd_set_enabled(prev);
    if (st == TD_OK) st = td_value_list_append(l, td_value_tensor(copy));
    td_tensor_unref(copy);
  }
  pthread_mutex_unlock(&mu);
  if (st == TD_OK) *res = td_value_ref(l);
  td_value_unref(l);
  return st;
}

/* The caller's optimizer (mu held). */
static td_status trainer_optim(int rank, td_optim **out) {
  if (rank < 0 || rank >= MAX_TRAINERS)
    return td_set_error(TD_ERR_INVALID, "ps_push: rank %d out of range", rank);
  if (!opts[rank]) {
    td_optim_options o;
    td_optim_options_init(&o, TD_OPTIM_SGD);
    o.lr = 0.0; /* every push sets it */
    o.momentum = momentum;
    o.nesterov = momentum > 0;
    td_status st = td_optim_create(&o, params.tensors, params.n, &opts[rank]);
    if (st != TD_OK) return st;
  }
  *out = opts[rank];
  return TD_OK;
}

static td_status fn_push(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)fut;
  double lr;
  if (n != 2 || td_value_list_len(args[0]) != params.n)
    return td_set_error(TD_ERR_INVALID, "ps_push: expected ([%zu gradients], lr)", params.n);
  td_status st = td_value_as_double(args[1], &lr);
  td_tensor *grads[8];
  for (size_t i = 0; st == TD_OK && i < params.n; i++)
    st = td_value_as_tensor(td_value_list_get(args[0], i), &grads[i]);
  if (st != TD_OK) return st;
  pthread_mutex_lock(&mu);
  td_optim *o = NULL;
  st = trainer_optim(td_rpc_ctx_caller_rank(c), &o);
  if (st == TD_OK) st = td_optim_set_lr(o, lr);
  if (st == TD_OK) st = td_optim_step_grads(o, grads, params.n);
  int64_t done = st == TD_OK ? ++steps : steps;
  pthread_mutex_unlock(&mu);
  if (st == TD_OK) *res = td_value_int(done);
  return st;
}

static td_status fn_evaluate(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                             td_future **fut) {
  (void)c, (void)args, (void)n, (void)fut;
  pthread_mutex_lock(&mu);
  double acc = psx_evaluate(model, test_set, true);
  pthread_mutex_unlock(&mu);
  *res = td_value_double(acc);
  return TD_OK;
}

static td_status fn_barrier(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  (void)args, (void)n, (void)res;
  int trainers = td_rpc_world_size(td_rpc_ctx_agent(c)) - 1;
  td_future *f = td_future_create();
  if (!f) return TD_ERR_NOMEM;
  td_future *done[MAX_TRAINERS];
  int k = 0;
  pthread_mutex_lock(&mu);
  if (n_arrived >= MAX_TRAINERS) {
    pthread_mutex_unlock(&mu);
    td_future_unref(f);
    return td_set_error(TD_ERR_STATE, "ps_barrier: too many trainers");
  }
  arrived[n_arrived++] = td_future_ref(f);
  if (n_arrived == trainers) { /* the last one: release everybody */
    for (k = 0; k < n_arrived; k++) done[k] = arrived[k];
    n_arrived = 0;
  }
  pthread_mutex_unlock(&mu);
  for (int i = 0; i < k; i++) {
    td_future_complete(done[i], NULL);
    td_future_unref(done[i]);
  }
  *fut = f;
  return TD_OK;
}

int main(int argc, char **argv) {
  uint64_t seed = 0;
  const char *data_dir = NULL;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--momentum")) momentum = strtod(argv[i + 1], NULL);
    else if (!strcmp(argv[i], "--data-dir")) data_dir = argv[i + 1];
    else ex_die("unknown option %s (--seed N, --momentum M, --data-dir D)", argv[i]);
  }
  model = psx_make_model("mlp", seed);
  td_tensor_list_init(&params);
  EX_CHECK(td_module_parameters(model, &params));
  if (params.n != 4) ex_die("expected 4 parameters, got %zu", params.n);
  test_set = psx_load_mnist(TD_MNIST_TEST, data_dir);
  EX_CHECK(td_rpc_register("ps_get_params", fn_get_params, NULL));
  EX_CHECK(td_rpc_register("ps_push", fn_push, NULL));
  EX_CHECK(td_rpc_register("ps_evaluate", fn_evaluate, NULL));
  EX_CHECK(td_rpc_register("ps_barrier", fn_barrier, NULL));
  td_rpc_options o;
  td_rpc_options_init(&o);
  td_rpc_agent *a = NULL;
  EX_CHECK(td_rpc_init_from_env("ps", &o, &a));
  td_status st = td_rpc_shutdown(a, true, 600000); /* serves until every trainer left */
  if (st != TD_OK) fprintf(stderr, "c_param_server: shutdown: %s\n", td_last_error());
  td_rpc_destroy(a);
  for (int i = 0; i < MAX_TRAINERS; i++) td_optim_destroy(opts[i]);
  td_tensor_list_fini(&params);
  td_module_unref(model);
  td_mnist_destroy(test_set);
  return st == TD_OK ? 0 : 1;
}
