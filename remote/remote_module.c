/* remote_module.c - RemoteModule: a module created on another worker, used through its RRef.
 *
 * Design: td_remote_module_create parses the device string, resolves the worker and runs
 * __rm_create there through td_remote; the owner builds the module with its registered factory,
 * moves it to the device and keeps it as an "nn.Module" object behind the RRef. Everything else
 * is an RRef proxy call on that object (__rm_forward, __rm_train, __rm_info, and dist_optim's
 * __dist_param_rrefs), so distributed autograd records forward like any other RPC made inside a
 * context.
 *
 * __rm_forward accepts tensors and RRefs to tensors. RRef inputs are fetched by the owner with
 * td_rref_to_here_async from the handler's thread (which has the caller's autograd context
 * current, so the fetch is recorded), and the forward runs in the completion callback of the last
 * fetch; the handler returns a future, so no pool thread waits. This is what lets the pipeline
 * hand a stage's output to the next stage without passing through the driver.
 *
 * Invariants: a handle owns one reference to the module RRef; a forward state owns a reference
 * to the module value and to the arguments until it has completed its reply future.
 */
#include <ctype.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/core.h"
#include "../rpc/agent_impl.h"
#include "tdist/dist_optim.h"
#include "tdist/remote_module.h"
#include "remote_impl.h"

#define MODULE_TYPE "nn.Module"

struct td_remote_module {
  td_rpc_agent *agent;
  td_rref *rref;
  char owner[128];
  td_device device;
};

/* ---- device strings ---- */

static td_status bad_rank(const char *text) {
  return td_set_error(TD_ERR_INVALID,
                      "remote device '%s': 'rank:' must be followed by a non-negative integer",
                      text);
}

td_status td_remote_device_parse(const char *text, td_remote_device *out) {
  TD_CHECK_ARG(out, "remote_device_parse: NULL argument");
  if (!text) return td_set_error(TD_ERR_INVALID, "remote device: NULL string");
  const char *slash = strchr(text, '/');
  if (!slash)
    return td_set_error(TD_ERR_INVALID,
                        "remote device '%s': expected '<worker>/<device>' (e.g. 'worker1/cpu', "
                        "'rank:1/cuda:0')", text);
  size_t wlen = (size_t)(slash - text);
  if (wlen == 0) return td_set_error(TD_ERR_INVALID, "remote device '%s': empty worker name", text);
  if (strchr(slash + 1, '/'))
    return td_set_error(TD_ERR_INVALID, "remote device '%s': more than one '/'", text);
  td_remote_device d;
  memset(&d, 0, sizeof d);
  d.rank = -1;
  if (wlen >= 5 && strncmp(text, "rank:", 5) == 0) {
    if (wlen == 5) return bad_rank(text);
    long r = 0;
    for (const char *p = text + 5; p < slash; p++) {
      if (!isdigit((unsigned char)*p) || r > 1000000) return bad_rank(text);
      r = r * 10 + (*p - '0');
    }
    d.rank = (int)r;
  } else {
    if (wlen >= sizeof d.worker)
      return td_set_error(TD_ERR_INVALID, "remote device '%s': worker name too long", text);
    for (size_t i = 0; i < wlen; i++)
      if (isspace((unsigned char)text[i]))
        return td_set_error(TD_ERR_INVALID, "remote device '%s': space in the worker name", text);
    memcpy(d.worker, text, wlen);
    d.worker[wlen] = '\0';
  }
  if (td_device_parse(slash + 1, &d.device) != TD_OK)
    return td_set_error(TD_ERR_INVALID,
                        "remote device '%s': unknown device '%s' (expected cpu, cuda or cuda:N)",
                        text, slash + 1);
  *out = d;
  return TD_OK;
}

/* ---- owner side ---- */

td_device td__rm_module_device(td_module *m) {
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  td_device d = td_device_cpu();
  if (td_module_parameters(m, &ps) == TD_OK && ps.n > 0) d = td_tensor_device(ps.tensors[0]);
  td_tensor_list_fini(&ps);
  return d;
}

/* __rm_create [factory, args, device] -> nn.Module object */
static td_status h_create(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  const char *factory, *devs;
  if (n != 3 || td_value_as_string(args[0], &factory, NULL) != TD_OK ||
      td_value_as_string(args[2], &devs, NULL) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__rm_create: malformed request");
  td_device dev;
  TD_TRY(td_device_parse(devs, &dev));
  if (!td_device_available(dev))
    return td_set_error(TD_ERR_DEVICE, "remote module: device %s is not available here", devs);
  if (!td_module_factory_exists(factory))
    return td_set_error(TD_ERR_NOT_FOUND, "remote module: no module factory '%s' registered",
                        factory);
  const td_value *fa = td_value_kind_of(args[1]) == TD_VALUE_NONE ? NULL : args[1];
  td_module *m = NULL;
  TD_TRY(td_module_factory_create(factory, fa, &m));
  td_status st = td_module_to(m, dev);
  if (st == TD_OK) st = td_value_object(MODULE_TYPE, m, res);
  if (st != TD_OK) td_module_unref(m);
  return st;
}

/* run_forward runs m on the tensors of vals[0..n): moved to m's device, output back on the CPU. */
static td_status run_forward(td_module *m, td_value *const *vals, int n, td_value **res) {
  td_device dev = td__rm_module_device(m);
  td_tensor **in = td__calloc((size_t)(n ? n : 1), sizeof *in);
  if (!in) return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  td_status st = TD_OK;
  for (int i = 0; i < n && st == TD_OK; i++) {
    td_tensor *t;
    if (td_value_as_tensor(vals[i], &t) != TD_OK) {
      st = td_set_error(TD_ERR_INVALID, "remote module forward: input %d is a %s, expected a "
                        "tensor or an RRef to one", i, td_value_kind_name(vals[i]));
      break;
    }
    st = td_tensor_to(t, dev, &in[i]);
  }
  td_tensor *y = NULL, *yc = NULL;
  if (st == TD_OK) st = n == 1 ? td_module_forward(m, in[0], &y)
                               : td_module_forward_multi(m, in, n, &y, 1);
  if (st == TD_OK) st = td_tensor_to(y, td_device_cpu(), &yc);
  if (st == TD_OK) {
    *res = td_value_tensor(yc);
    if (!*res) st = td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  }
  td_tensor_unref(y);
  td_tensor_unref(yc);
  for (int i = 0; i < n; i++) td_tensor_unref(in[i]);
  td__free(in);
  return st;
}

/* A forward waiting for its RRef inputs. */
typedef struct fwd_state {
  td_value *mval;     /* the module object value (reference) */
  int n;
  td_value **inputs;  /* the arguments: tensors or RRefs (references) */
  td_future **fetch;  /* to_here futures of the RRef inputs (references), NULL for tensors */
  atomic_int pending; /* fetches not finished, plus one while they are being started */
  td_future *out;     /* the handler's reply */
} fwd_state;

static void fwd_state_free(fwd_state *s) {
  for (int i = 0; i < s->n; i++) {
    td_value_unref(s->inputs[i]);
    td_future_unref(s->fetch[i]);
  }
  td__free(s->inputs);
  td__free(s->fetch);
  td_value_unref(s->mval);
  td_future_unref(s->out);
  td__free(s);
}

/* fwd_fetched runs when one fetch finished; the last one runs the forward and replies. */
static void fwd_fetched(td_future *f, void *arg) {
  (void)f;
  fwd_state *s = arg;
  if (atomic_fetch_sub(&s->pending, 1) != 1) return;
  if (td_future_done(s->out)) { /* failed while starting the fetches */
    fwd_state_free(s);
    return;
  }
  td_value **vals = td__calloc((size_t)s->n, sizeof *vals);
  if (!vals) {
    td_future_fail(s->out, TD_ERR_NOMEM, "remote module: out of memory");
    fwd_state_free(s);
    return;
  }
  td_status st = TD_OK;
  for (int i = 0; i < s->n && st == TD_OK; i++) {
    if (!s->fetch[i]) {
      vals[i] = s->inputs[i];
    } else if ((st = td_future_status(s->fetch[i])) != TD_OK) {
      td_future_fail(s->out, st, "remote module forward: fetching input %d: %s", i,
                     td_future_message(s->fetch[i]));
    } else {
      vals[i] = td_future_value(s->fetch[i]);
    }
  }
  if (st == TD_OK) {
    void *m = NULL;
    td_value *res = NULL;
    td_clear_error();
    st = td_value_as_object(s->mval, MODULE_TYPE, &m);
    if (st == TD_OK) st = run_forward(m, vals, s->n, &res);
    if (st == TD_OK) td_future_complete(s->out, res);
    else td_future_fail(s->out, st, "%s", td_last_error());
  }
  td__free(vals);
  fwd_state_free(s);
}

/* __rm_forward [module, input...] -> tensor; inputs are tensors or RRefs to tensors. */
static td_status h_forward(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  (void)x;
  if (n < 2) return td_set_error(TD_ERR_INVALID, "remote module forward: no input");
  void *m;
  TD_TRY(td_value_as_object(args[0], MODULE_TYPE, &m));
  int nin = n - 1, nref = 0;
  for (int i = 0; i < nin; i++) {
    td_rref *r;
    nref += td_value_as_rref(args[i + 1], &r) == TD_OK;
  }
  td_clear_error();
  if (nref == 0) return run_forward(m, args + 1, nin, res);

  fwd_state *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  s->inputs = td__calloc((size_t)nin, sizeof *s->inputs);
  s->fetch = td__calloc((size_t)nin, sizeof *s->fetch);
  s->out = td_future_create();
  s->mval = td_value_ref(args[0]);
  if (!s->inputs || !s->fetch || !s->out) {
    fwd_state_free(s);
    return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  }
  s->n = nin;
  for (int i = 0; i < nin; i++) s->inputs[i] = td_value_ref(args[i + 1]);
  /* Every fetch starts from this thread: the caller's autograd context is current here, so the
   * fetches are recorded. The extra count keeps s alive until all have been started. */
  atomic_init(&s->pending, nref + 1);
  td_status st = TD_OK;
  int started = 0;
  for (int i = 0; i < nin && st == TD_OK; i++) {
    td_rref *r;
    if (td_value_as_rref(s->inputs[i], &r) != TD_OK) continue;
    st = td_rref_to_here_async(r, TD_TIMEOUT_DEFAULT, &s->fetch[i]);
    if (st == TD_OK && td_future_on_done(s->fetch[i], fwd_fetched, s) != TD_OK)
      st = td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
    if (st == TD_OK) started++;
  }
  td_clear_error();
  *fut = td_future_ref(s->out);
  if (st != TD_OK) {
    td_future_fail(s->out, st, "remote module forward: %s", td_last_error());
    atomic_fetch_sub(&s->pending, nref - started); /* callbacks that will never run */
  }
  fwd_fetched(NULL, s); /* drops the extra count; replies when every fetch is done */
  return TD_OK;
}

/* __rm_train [module, bool] */
static td_status h_train(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  void *m;
  bool on;
  if (n != 2 || td_value_as_bool(args[1], &on) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__rm_train: malformed request");
  TD_TRY(td_value_as_object(args[0], MODULE_TYPE, &m));
  td_module_train(m, on);
  return TD_OK;
}

/* __rm_info [module] -> [training, device] */
static td_status h_info(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  void *m;
  if (n != 1) return td_set_error(TD_ERR_FORMAT, "__rm_info: malformed request");
  TD_TRY(td_value_as_object(args[0], MODULE_TYPE, &m));
  char buf[32];
  td_device_str(td__rm_module_device(m), buf, sizeof buf);
  td_value *l = td_value_list();
  td_value *a = td_value_bool(td_module_is_training(m)), *b = td_value_string(buf);
  if (!l || !a || !b || td_value_list_append(l, a) != TD_OK ||
      (a = NULL, td_value_list_append(l, b) != TD_OK)) {
    td_value_unref(a);
    td_value_unref(b);
    td_value_unref(l);
    return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  }
  *res = l;
  return TD_OK;
}

/* ---- user side ---- */

static td_remote_module *handle_new(td_rpc_agent *a, td_rref *r, td_device dev) {
  td_remote_module *rm = td__calloc(1, sizeof *rm);
  if (!rm) return NULL;
  rm->agent = a;
  rm->rref = r;
  rm->device = dev;
  snprintf(rm->owner, sizeof rm->owner, "%s", td_rref_owner_name(r));
  return rm;
}

td_status td_remote_module_create(td_rpc_agent *a, const char *remote_device,
                                  const char *factory, td_value *args, td_remote_module **out) {
  TD_CHECK_ARG(a && factory && out, "remote_module_create: NULL argument");
  td_remote_device d;
  TD_TRY(td_remote_device_parse(remote_device, &d));
  td_worker_info wi;
  if (d.rank >= 0) {
    if (d.rank >= td_rpc_world_size(a) || td_rpc_get_worker_info_by_rank(a, d.rank, &wi) != TD_OK)
      return td_set_error(TD_ERR_NOT_FOUND, "remote device '%s': no worker of rank %d (world "
                          "size %d)", remote_device, d.rank, td_rpc_world_size(a));
  } else if (td_rpc_get_worker_info(a, d.worker, &wi) != TD_OK) {
    return td_set_error(TD_ERR_NOT_FOUND, "remote device '%s': no worker named '%s'",
                        remote_device, d.worker);
  }
  char devs[32];
  td_device_str(d.device, devs, sizeof devs);
  td_value *argv[3] = {td_value_string(factory), args ? td_value_ref(args) : td_value_none(),
                       td_value_string(devs)};
  td_rref *r = NULL;
  td_status st = argv[0] && argv[1] && argv[2]
                     ? td_remote(a, wi.name, "__rm_create", argv, 3, NULL, &r)
                     : td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  for (int i = 0; i < 3; i++) td_value_unref(argv[i]);
  if (st != TD_OK) return st;
  td_future *f = NULL;
  st = td_rref_creation_future(r, &f);
  if (st == TD_OK && (st = td_future_wait(f, TD_TIMEOUT_INFINITE)) == TD_OK)
    st = td_future_status(f);
  if (st != TD_OK && f)
    td_set_error(st, "remote_module_create('%s', '%s'): %s", remote_device, factory,
                 td_future_message(f));
  else if (st != TD_OK)
    td__error_prefix(st, "remote_module_create('%s', '%s')", remote_device, factory);
  td_future_unref(f);
  td_remote_module *rm = st == TD_OK ? handle_new(a, r, d.device) : NULL;
  if (st == TD_OK && !rm) st = td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  if (st != TD_OK) {
    td_rref_unref(r);
    return st;
  }
  *out = rm;
  return TD_OK;
}

/* remote_info fetches [training, device] from the owner. */
static td_status remote_info(td_rref *r, bool *training, td_device *dev) {
  td_value *v = NULL;
  TD_TRY(td_rref_rpc_sync(r, "__rm_info", NULL, 0, NULL, &v));
  const char *ds = NULL;
  bool tr = false;
  td_device d = td_device_cpu();
  td_status st = td_value_as_bool(td_value_list_get(v, 0), &tr);
  if (st == TD_OK) st = td_value_as_string(td_value_list_get(v, 1), &ds, NULL);
  if (st == TD_OK) st = td_device_parse(ds, &d);
  td_value_unref(v);
  if (st != TD_OK) return td_set_error(TD_ERR_FORMAT, "remote module: malformed info reply");
  if (training) *training = tr;
  if (dev) *dev = d;
  return TD_OK;
}

td_status td_remote_module_from_rref(td_rpc_agent *a, td_rref *module_rref,
                                     td_remote_module **out) {
  TD_CHECK_ARG(a && module_rref && out, "remote_module_from_rref: NULL argument");
  td_device dev = td_device_cpu();
  TD_TRY(remote_info(module_rref, NULL, &dev));
  td_remote_module *rm = handle_new(a, td_rref_ref(module_rref), dev);
  if (!rm) {
    td_rref_unref(module_rref);
    return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  }
  *out = rm;
  return TD_OK;
}

void td_remote_module_destroy(td_remote_module *rm) {
  if (!rm) return;
  td_rref_unref(rm->rref);
  td__free(rm);
}

td_rref *td_remote_module_rref(const td_remote_module *rm) { return rm ? rm->rref : NULL; }
const char *td_remote_module_owner(const td_remote_module *rm) { return rm ? rm->owner : NULL; }
td_device td_remote_module_device(const td_remote_module *rm) {
  return rm ? rm->device : td_device_cpu();
}

td_status td_remote_module_forward_async(td_remote_module *rm, td_value *const *args, int nargs,
                                         td_future **out) {
  TD_CHECK_ARG(rm && out && args && nargs > 0, "remote_module_forward_async: bad argument");
  return td_rref_rpc_async(rm->rref, "__rm_forward", args, nargs, NULL, out);
}

td_status td_remote_module_forward_remote(td_remote_module *rm, td_value *const *args, int nargs,
                                          td_rref **out) {
  TD_CHECK_ARG(rm && out && args && nargs > 0, "remote_module_forward_remote: bad argument");
  return td_rref_remote(rm->rref, "__rm_forward", args, nargs, NULL, out);
}

td_status td_remote_module_forward(td_remote_module *rm, td_tensor *x, td_tensor **y) {
  TD_CHECK_ARG(rm && x && y, "remote_module_forward: NULL argument");
  td_value *xv = td_value_tensor(x), *r = NULL;
  if (!xv) return td_set_error(TD_ERR_NOMEM, "remote module: out of memory");
  td_status st = td_rref_rpc_sync(rm->rref, "__rm_forward", &xv, 1, NULL, &r);
  td_value_unref(xv);
  td_tensor *t = NULL;
  if (st == TD_OK && (st = td_value_as_tensor(r, &t)) == TD_OK) *y = td_tensor_ref(t);
  td_value_unref(r);
  return st;
}

td_status td_remote_module_train(td_remote_module *rm, bool training) {
  TD_CHECK_ARG(rm, "remote_module_train: NULL argument");
  td_value *v = td_value_bool(training), *r = NULL;
  td_status st = td_rref_rpc_sync(rm->rref, "__rm_train", &v, 1, NULL, &r);
  td_value_unref(v);
  td_value_unref(r);
  return st;
}

td_status td_remote_module_is_training(td_remote_module *rm, bool *training) {
  TD_CHECK_ARG(rm && training, "remote_module_is_training: NULL argument");
  return remote_info(rm->rref, training, NULL);
}

td_status td_remote_module_parameters(td_remote_module *rm, td_value **out) {
  TD_CHECK_ARG(rm && out, "remote_module_parameters: NULL argument");
  return td_dist_module_parameter_rrefs(rm->rref, TD_TIMEOUT_DEFAULT, out);
}

/* ---- registration ---- */

static void layer_init_once(void) {
  /* td_rpc_init registers the distributed optimizer's layer first: it owns the "nn.Module"
   * object type and __dist_param_rrefs, which RemoteModules use. */
  td__rpc_register_internal("__rm_create", h_create, NULL);
  td__rpc_register_internal("__rm_forward", h_forward, NULL);
  td__rpc_register_internal("__rm_train", h_train, NULL);
  td__rpc_register_internal("__rm_info", h_info, NULL);
  td__pipe_stage_register(); /* pipeline schedules' stages (stage.c) */
}

/* td__remote_layer_init registers this layer with the agent; td_rpc_init calls it (runtime/init.c)
 * before it starts the agent, the only registration path (no load-time constructor: static
 * programs need no dummy reference, and a dlopen()ed library registers nothing behind the
 * caller's back). Idempotent. */
void td__remote_layer_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, layer_init_once);
}
