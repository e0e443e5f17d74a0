/* c_worker.c - the C worker of the binding's mixed-language tests: joins the group from the
 * environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TD_RPC_SECRET; name "c<rank>" unless
 * argv[1] gives one), registers the functions below, and leaves with a graceful shutdown once
 * every worker has called shutdown. Exits 0 when everything went well (under ASan also checked
 * for leaks at exit), 1 otherwise.
 *
 *   c_echo(x) -> x                    c_add(a, b) -> a + b (ints or doubles)
 *   c_fail() -> TD_ERR_INVALID        c_sleep(ms) -> ms, after sleeping on a pool thread
 *   c_describe(t) -> [dtype name, shape, sum of the elements as float64]
 *   c_call(to, fn, [args]) -> the result of fn(args) on worker `to`, asynchronously (the
 *                                reply follows the call's future; no thread waits)
 *   c_square_loss(x) -> sum(x * x) with autograd history (distributed autograd tests)
 *   c_scale(t, s) -> t * s            c_stats() -> {"requests_received": n}
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tdist/tdist.h>

static td_status arg_count(const char *fn, int n, int want) {
  if (n == want) return TD_OK;
  return td_set_error(TD_ERR_INVALID, "%s: expected %d arguments, got %d", fn, want, n);
}

static td_status c_echo(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)c, (void)fut;
  *res = n ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

static td_status c_add(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                       td_future **fut) {
  (void)c, (void)fut;
  td_status st = arg_count("c_add", n, 2);
  if (st != TD_OK) return st;
  int64_t a, b;
  if (td_value_kind_of(args[0]) == TD_VALUE_INT && td_value_kind_of(args[1]) == TD_VALUE_INT &&
      td_value_as_int(args[0], &a) == TD_OK && td_value_as_int(args[1], &b) == TD_OK) {
    *res = td_value_int(a + b);
    return TD_OK;
  }
  double x, y;
  st = td_value_as_double(args[0], &x);
  if (st == TD_OK) st = td_value_as_double(args[1], &y);
  if (st == TD_OK) *res = td_value_double(x + y);
  return st;
}

static td_status c_fail(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)c, (void)args, (void)n, (void)res, (void)fut;
  return td_set_error(TD_ERR_INVALID, "c_fail: failing as asked");
}

static td_status c_sleep(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c, (void)fut;
  int64_t ms = 0;
  td_status st = arg_count("c_sleep", n, 1);
  if (st == TD_OK) st = td_value_as_int(args[0], &ms);
  if (st != TD_OK) return st;
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) != 0) {
  }
  *res = td_value_int(ms);
  return TD_OK;
}

static td_status c_describe(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  (void)c, (void)fut;
  td_tensor *t, *d = NULL, *cd = NULL;
  td_value *out = td_value_list(), *shape = td_value_list();
  td_status st = out && shape ? arg_count("c_describe", n, 1) : TD_ERR_NOMEM;
  if (st == TD_OK) st = td_value_as_tensor(args[0], &t);
  if (st == TD_OK) st = td_tensor_to_dtype(t, TD_DTYPE_F64, &d); /* every dtype converts */
  if (st == TD_OK) st = td_tensor_contiguous(d, &cd);
  double sum = 0;
  for (int64_t i = 0; st == TD_OK && i < td_tensor_numel(cd); i++)
    sum += ((const double *)td_tensor_data(cd))[i];
  for (int i = 0; st == TD_OK && i < td_tensor_ndim(t); i++)
    st = td_value_list_append(shape, td_value_int(td_tensor_shape(t)[i]));
  if (st == TD_OK)
    st = td_value_list_append(out, td_value_string(td_dtype_name(td_tensor_dtype(t))));
  if (st == TD_OK && (st = td_value_list_append(out, shape)) == TD_OK) shape = NULL;
  if (st == TD_OK) st = td_value_list_append(out, td_value_double(sum));
  if (st == TD_OK) *res = td_value_ref(out);
  td_value_unref(out), td_value_unref(shape);
  td_tensor_unref(cd), td_tensor_unref(d);
  return st;
}

static td_status c_call(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  (void)res;
  const char *to, *fn;
  td_status st = arg_count("c_call", n, 3);
  if (st == TD_OK) st = td_value_as_string(args[0], &to, NULL);
  if (st == TD_OK) st = td_value_as_string(args[1], &fn, NULL);
  if (st != TD_OK) return st;
  size_t m = td_value_list_len(args[2]);
  td_value *items[16];
  if (m > 16) return td_set_error(TD_ERR_INVALID, "c_call: at most 16 arguments");
  for (size_t i = 0; i < m; i++) items[i] = td_value_list_get(args[2], i);
  return td_rpc_async(td_rpc_ctx_agent(c), to, fn, items, (int)m, NULL, fut);
}

static td_status c_square_loss(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  (void)c, (void)fut;
  td_tensor *x, *y = NULL, *s = NULL;
  td_status st = arg_count("c_square_loss", n, 1);
  if (st == TD_OK) st = td_value_as_tensor(args[0], &x);
  if (st == TD_OK) st = td_tensor_mul(x, x, &y);
  if (st == TD_OK) st = td_tensor_sum_all(y, &s);
  if (st == TD_OK) *res = td_value_tensor(s);
  td_tensor_unref(s);
  td_tensor_unref(y);
  return st;
}

static td_status c_scale(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)c, (void)fut;
  td_tensor *t, *y = NULL;
  double s;
  td_status st = arg_count("c_scale", n, 2);
  if (st == TD_OK) st = td_value_as_tensor(args[0], &t);
  if (st == TD_OK) st = td_value_as_double(args[1], &s);
  if (st == TD_OK) st = td_tensor_mul_scalar(t, s, &y);
  if (st == TD_OK) *res = td_value_tensor(y);
  td_tensor_unref(y);
  return st;
}

static td_status c_stats(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  (void)args, (void)n, (void)fut;
  td_rpc_stats s;
  td_status st = td_rpc_get_stats(td_rpc_ctx_agent(c), &s);
  td_value *d = st == TD_OK ? td_value_dict() : NULL;
  if (st == TD_OK && !d) st = TD_ERR_NOMEM;
  if (st == TD_OK)
    st = td_value_dict_set(d, "requests_received", td_value_int((int64_t)s.requests_received));
  if (st == TD_OK) *res = td_value_ref(d);
  td_value_unref(d);
  return st;
}

int main(int argc, char **argv) {
  static const struct {
    const char *name;
    td_rpc_fn fn;
  } fns[] = {{"c_echo", c_echo},       {"c_add", c_add},           {"c_fail", c_fail},
             {"c_sleep", c_sleep},     {"c_describe", c_describe}, {"c_call", c_call},
             {"c_square_loss", c_square_loss}, {"c_scale", c_scale}, {"c_stats", c_stats}};
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    if (td_rpc_register(fns[i].name, fns[i].fn, NULL) != TD_OK) {
      fprintf(stderr, "c_worker: register %s: %s\n", fns[i].name, td_last_error());
      return 1;
    }
  }
  const char *rank = getenv("RANK");
  char name[64];
  snprintf(name, sizeof name, "c%s", rank ? rank : "0");
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.num_worker_threads = 8;
  td_rpc_agent *a;
  if (td_rpc_init_from_env(argc > 1 ? argv[1] : name, &o, &a) != TD_OK) {
    fprintf(stderr, "c_worker: init: %s\n", td_last_error());
    return 1;
  }
  td_status st = td_rpc_shutdown(a, true, 120000);
  if (st != TD_OK) fprintf(stderr, "c_worker: shutdown: %s\n", td_last_error());
  td_rpc_destroy(a);
  return st == TD_OK ? 0 : 1;
}
