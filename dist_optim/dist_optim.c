/* dist_optim.c - the distributed optimizer: one functional optimizer per parameter owner, stepped
 * remotely with a distributed autograd context's gradients.
 *
 * Design: create() groups the parameter RRefs by owner and runs __dist_optim_create on each owner
 * through td_remote, so the owner's optimizer is an opaque object (type "dist_optim.Optimizer",
 * destroyed with td_optim_destroy) behind an RRef that this object holds; its lifetime follows
 * the RRef protocol (freed on the owner when the last user is gone). step() makes the context
 * current for the duration of the sends and calls __dist_optim_step through each owner's RRef
 * (proxy calls); the owner resolves the context by id and steps with td_optim_step_grad_map, whose
 * mutex serialises concurrent steps of the same optimizer. Parameters are the owners' tensors
 * themselves (RRefs whose owner value is the parameter), so a step updates the live module.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../core/core.h"
#include "../core/flight_impl.h"
#include "../rpc/agent_impl.h"
#include "../core/trace_impl.h"
#include "tdist/dist_optim.h"
#include "tdist/nn.h"

#define OPT_TYPE "dist_optim.Optimizer"

struct td_dist_optimizer {
  td_rpc_agent *agent;
  td_rref **params;
  size_t nparams;
  td_rref **owners; /* one RRef per owner to its optimizer */
  int nowners;
};

/* ---- options as a value ---- */

static td_status put_d(td_value *d, const char *k, double v) {
  td_value *x = td_value_double(v);
  if (!x) return td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  td_status st = td_value_dict_set(d, k, x);
  if (st != TD_OK) td_value_unref(x);
  return st;
}

static td_status put_b(td_value *d, const char *k, bool v) {
  return td_value_dict_set(d, k, td_value_bool(v));
}

static td_status opts_to_value(const td_optim_options *o, td_value **out) {
  td_value *d = td_value_dict();
  if (!d) return td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  td_status st = put_d(d, "kind", (double)o->kind);
  if (st == TD_OK) st = put_d(d, "lr", o->lr);
  if (st == TD_OK) st = put_d(d, "weight_decay", o->weight_decay);
  if (st == TD_OK) st = put_b(d, "maximize", o->maximize);
  if (st == TD_OK) st = put_d(d, "momentum", o->momentum);
  if (st == TD_OK) st = put_d(d, "dampening", o->dampening);
  if (st == TD_OK) st = put_b(d, "nesterov", o->nesterov);
  if (st == TD_OK) st = put_d(d, "beta1", o->beta1);
  if (st == TD_OK) st = put_d(d, "beta2", o->beta2);
  if (st == TD_OK) st = put_d(d, "eps", o->eps);
  if (st == TD_OK) st = put_b(d, "amsgrad", o->amsgrad);
  if (st == TD_OK) st = put_d(d, "lr_decay", o->lr_decay);
  if (st == TD_OK) st = put_d(d, "initial_accumulator_value", o->initial_accumulator_value);
  if (st == TD_OK) st = put_d(d, "alpha", o->alpha);
  if (st == TD_OK) st = put_b(d, "centered", o->centered);
  if (st != TD_OK) {
    td_value_unref(d);
    return st;
  }
  *out = d;
  return TD_OK;
}

static td_status get_d(const td_value *d, const char *k, double *v) {
  td_value *x = td_value_dict_get(d, k);
  if (!x) return td_set_error(TD_ERR_FORMAT, "dist_optim: options lack '%s'", k);
  return td_value_as_double(x, v);
}

static td_status get_b(const td_value *d, const char *k, bool *v) {
  td_value *x = td_value_dict_get(d, k);
  if (!x) return td_set_error(TD_ERR_FORMAT, "dist_optim: options lack '%s'", k);
  return td_value_as_bool(x, v);
}

static td_status opts_from_value(const td_value *d, td_optim_options *o) {
  double kind;
  TD_TRY(get_d(d, "kind", &kind));
  if (kind < TD_OPTIM_SGD || kind > TD_OPTIM_RMSPROP)
    return td_set_error(TD_ERR_INVALID, "dist_optim: unknown optimizer kind %g", kind);
  td_optim_options_init(o, (td_optim_kind)(int)kind);
  TD_TRY(get_d(d, "lr", &o->lr));
  TD_TRY(get_d(d, "weight_decay", &o->weight_decay));
  TD_TRY(get_b(d, "maximize", &o->maximize));
  TD_TRY(get_d(d, "momentum", &o->momentum));
  TD_TRY(get_d(d, "dampening", &o->dampening));
  TD_TRY(get_b(d, "nesterov", &o->nesterov));
  TD_TRY(get_d(d, "beta1", &o->beta1));
  TD_TRY(get_d(d, "beta2", &o->beta2));
  TD_TRY(get_d(d, "eps", &o->eps));
  TD_TRY(get_b(d, "amsgrad", &o->amsgrad));
  TD_TRY(get_d(d, "lr_decay", &o->lr_decay));
  TD_TRY(get_d(d, "initial_accumulator_value", &o->initial_accumulator_value));
  TD_TRY(get_d(d, "alpha", &o->alpha));
  TD_TRY(get_b(d, "centered", &o->centered));
  return TD_OK;
}

/* ---- owner side ---- */

static void opt_destroy(void *p) { td_optim_destroy(p); }

/* __dist_optim_create [options, [param RRefs owned here]] -> optimizer object */
static td_status h_create(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  if (n != 2 || td_value_kind_of(args[0]) != TD_VALUE_DICT ||
      td_value_kind_of(args[1]) != TD_VALUE_LIST)
    return td_set_error(TD_ERR_FORMAT, "__dist_optim_create: malformed request");
  td_optim_options o;
  TD_TRY(opts_from_value(args[0], &o));
  size_t np = td_value_list_len(args[1]);
  td_value **vals = td__calloc(np ? np : 1, sizeof *vals);
  td_tensor **ps = td__calloc(np ? np : 1, sizeof *ps);
  td_status st = vals && ps ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  for (size_t i = 0; i < np && st == TD_OK; i++) {
    td_rref *r;
    st = td_value_as_rref(td_value_list_get(args[1], i), &r);
    if (st == TD_OK) st = td_rref_local_value(r, &vals[i]);
    if (st == TD_OK && td_value_as_tensor(vals[i], &ps[i]) != TD_OK)
      st = td_set_error(TD_ERR_INVALID, "dist_optim: parameter %zu is a %s, not a tensor", i,
                        td_value_kind_name(vals[i]));
  }
  td_optim *opt = NULL;
  if (st == TD_OK) st = td_optim_create(&o, ps, np, &opt);
  for (size_t i = 0; vals && i < np; i++) td_value_unref(vals[i]);
  td__free(vals);
  td__free(ps);
  if (st != TD_OK) return st;
  st = td_value_object(OPT_TYPE, opt, res);
  if (st != TD_OK) td_optim_destroy(opt);
  return st;
}

/* __dist_optim_step [optimizer, ctx id] */
static td_status h_step(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  void *opt;
  int64_t id;
  if (n != 2 || td_value_as_int(args[1], &id) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__dist_optim_step: malformed request");
  TD_TRY(td_value_as_object(args[0], OPT_TYPE, &opt));
  td_dist_autograd_context *c;
  td_dist_autograd_context_id cid = {(uint64_t)id};
  TD_TRY(td_dist_autograd_context_retrieve(td_rpc_ctx_agent(x), cid, &c));
  td_status st = td_optim_step_grad_map(opt, td_dist_autograd_context_grad_map(c));
  td_dist_autograd_context_unref(c);
  return st;
}

/* __dist_param_rrefs [module] -> [RRef per parameter] */
/* __dist_optim_set_lr(optimizer object, lr) */
static td_status h_set_lr(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  void *opt;
  double lr;
  if (n != 2 || td_value_as_double(args[1], &lr) != TD_OK)
    return td_set_error(TD_ERR_FORMAT, "__dist_optim_set_lr: malformed request");
  TD_TRY(td_value_as_object(args[0], OPT_TYPE, &opt));
  TD_TRY(td_optim_set_lr(opt, lr));
  *res = td_value_none();
  return TD_OK;
}

static td_status h_param_rrefs(td_rpc_ctx *x, td_value *const *args, int n, td_value **res,
                               td_future **fut) {
  void *m;
  if (n < 1) return td_set_error(TD_ERR_FORMAT, "__dist_param_rrefs: malformed request");
  TD_TRY(td_value_as_object(args[0], "nn.Module", &m));
  td_tensor_list ps;
  td_tensor_list_init(&ps);
  td_status st = td_module_parameters(m, &ps);
  td_value *list = st == TD_OK ? td_value_list() : NULL;
  if (st == TD_OK && !list) st = td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  for (size_t i = 0; i < ps.n && st == TD_OK; i++) {
    td_value *tv = td_value_tensor(ps.tensors[i]);
    td_rref *r = NULL;
    st = tv ? td_rref_create_local(td_rpc_ctx_agent(x), tv, &r)
            : td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
    td_value_unref(tv);
    if (st != TD_OK) break;
    td_value *rv = td_value_rref(r);
    td_rref_unref(r);
    if (!rv) st = td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
    else if ((st = td_value_list_append(list, rv)) != TD_OK) td_value_unref(rv);
  }
  td_tensor_list_fini(&ps);
  if (st != TD_OK) {
    td_value_unref(list);
    return st;
  }
  *res = list;
  return TD_OK;
}

/* ---- user side ---- */

/* Parameters whose td_remote() creation is still in flight: the owners read their values, so wait
 * for every creation first (all within one default timeout), as PyTorch's owners wait for pending
 * values. A failed creation is returned naming its owner. */
static td_status wait_created(td_rpc_agent *a, td_rref *const *params, size_t n) {
  int64_t tmo = td_rpc_get_default_timeout(a);
  uint64_t end = tmo > 0 ? td__now_ns() + (uint64_t)tmo * 1000000u : 0;
  for (size_t i = 0; i < n; i++) {
    td_future *f;
    td_status st = td_rref_creation_future(params[i], &f);
    if (st != TD_OK) return st;
    int64_t left = -1;
    if (end) {
      uint64_t now = td__now_ns();
      left = now >= end ? 0 : (int64_t)((end - now) / 1000000u);
    }
    st = td_future_wait(f, left);
    if (st != TD_OK)
      td_set_error(st, "dist_optimizer_create: parameter %zu (owned by %s) was not created: %s", i,
                   td_rref_owner_name(params[i]),
                   st == TD_ERR_TIMEOUT ? "timed out waiting for it" : td_future_message(f));
    td_future_unref(f);
    if (st != TD_OK) return st;
  }
  return TD_OK;
}

td_status td_dist_optimizer_create(td_rpc_agent *a, const td_optim_options *opts,
                                   td_rref *const *params, size_t n, td_dist_optimizer **out) {
  TD_CHECK_ARG(a && opts && out && (params || n == 0), "dist_optimizer_create: NULL argument");
  for (size_t i = 0; i < n; i++)
    TD_CHECK_ARG(params[i], "dist_optimizer_create: parameter %zu is NULL", i);
  int world = td_rpc_world_size(a);
  td_dist_optimizer *o = td__calloc(1, sizeof *o);
  td_value **lists = td__calloc((size_t)world, sizeof *lists);
  td_value *ov = NULL;
  td_status st = o && lists ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  if (st == TD_OK) {
    o->agent = a;
    o->params = td__calloc(n ? n : 1, sizeof *o->params);
    o->owners = td__calloc((size_t)world, sizeof *o->owners);
    if (!o->params || !o->owners) st = td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  }
  if (st == TD_OK) st = opts_to_value(opts, &ov);
  if (st == TD_OK) st = wait_created(a, params, n);
  for (size_t i = 0; i < n && st == TD_OK; i++) {
    o->params[o->nparams++] = td_rref_ref(params[i]);
    int r = td_rref_owner(params[i]);
    if (r < 0 || r >= world) {
      st = td_set_error(TD_ERR_INVALID, "dist_optimizer_create: parameter %zu has owner %d", i, r);
      break;
    }
    if (!lists[r] && !(lists[r] = td_value_list())) {
      st = td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
      break;
    }
    td_value *rv = td_value_rref(params[i]);
    if (!rv) st = td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
    else if ((st = td_value_list_append(lists[r], rv)) != TD_OK) td_value_unref(rv);
  }
  for (int r = 0; r < world && st == TD_OK; r++) {
    if (!lists[r]) continue;
    td_worker_info wi;
    st = td_rpc_get_worker_info_by_rank(a, r, &wi);
    td_value *args[2] = {ov, lists[r]};
    if (st == TD_OK) st = td_remote(a, wi.name, "__dist_optim_create", args, 2, NULL, &o->owners[o->nowners]);
    if (st == TD_OK) o->nowners++;
  }
  /* wait for every owner; report the first failure */
  for (int i = 0; i < o->nowners && st == TD_OK; i++) {
    td_future *f;
    st = td_rref_creation_future(o->owners[i], &f);
    if (st == TD_OK) {
      st = td_future_wait(f, TD_TIMEOUT_INFINITE);
      if (st != TD_OK)
        td_set_error(st, "dist_optimizer_create: on %s: %s", td_rref_owner_name(o->owners[i]),
                     td_future_message(f));
      td_future_unref(f);
    }
  }
  for (int r = 0; lists && r < world; r++) td_value_unref(lists[r]);
  td__free(lists);
  td_value_unref(ov);
  if (st != TD_OK) {
    td_dist_optimizer_destroy(o);
    return st;
  }
  *out = o;
  return TD_OK;
}

td_status td_dist_optimizer_set_lr(td_dist_optimizer *o, double lr) {
  TD_CHECK_ARG(o, "dist_optimizer_set_lr: NULL optimizer");
  if (!(lr >= 0) || lr > 1e300)
    return td_set_error(TD_ERR_INVALID, "dist_optimizer_set_lr: invalid learning rate %g", lr);
  td_value *lv = td_value_double(lr);
  if (!lv) return td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  td_future **fs = td__calloc((size_t)(o->nowners ? o->nowners : 1), sizeof *fs);
  td_status st = fs ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  int started = 0;
  for (int i = 0; i < o->nowners && st == TD_OK; i++) {
    st = td_rref_rpc_async(o->owners[i], "__dist_optim_set_lr", &lv, 1, NULL, &fs[i]);
    if (st == TD_OK) started++;
  }
  td_status wst = started ? td_future_wait_all(fs, started, TD_TIMEOUT_INFINITE) : TD_OK;
  if (st == TD_OK) st = wst;
  for (int i = 0; i < started; i++) td_future_unref(fs[i]);
  td__free(fs);
  td_value_unref(lv);
  return st;
}

static td_status optimizer_step_impl(td_dist_optimizer *o, td_dist_autograd_context *ctx) {
  TD_CHECK_ARG(o && ctx, "dist_optimizer_step: NULL argument");
  td_future **fs = td__calloc((size_t)(o->nowners ? o->nowners : 1), sizeof *fs);
  if (!fs) return td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  td_value *idv = td_value_int((int64_t)td_dist_autograd_context_get_id(ctx).v);
  td_status st = idv ? TD_OK : td_set_error(TD_ERR_NOMEM, "dist_optim: out of memory");
  /* the calls carry the context, so an owner that never took part creates an empty part (no
   * gradients, nothing to step) and the context's cleanup reaches it */
  td_dist_autograd_context *prev = td_dist_autograd_set_current(ctx);
  int nf = 0, local = -1;
  for (int i = 0; i < o->nowners && st == TD_OK; i++) {
    if (td_rref_is_owner(o->owners[i])) {
      local = i; /* stepped below, on this thread, while the others run */
      continue;
    }
    st = td_rref_rpc_async(o->owners[i], "__dist_optim_step", &idv, 1, NULL, &fs[nf]);
    if (st == TD_OK) nf++;
  }
  td_dist_autograd_set_current(prev);
  td_value_unref(idv);
  char msg[1200] = "";
  if (st == TD_OK && local >= 0) {
    td_value *ov = NULL;
    void *opt;
    st = td_rref_local_value(o->owners[local], &ov);
    if (st == TD_OK) st = td_value_as_object(ov, OPT_TYPE, &opt);
    if (st == TD_OK) st = td_optim_step_grad_map(opt, td_dist_autograd_context_grad_map(ctx));
    td_value_unref(ov);
    if (st != TD_OK) {
      td_worker_info wi;
      td_rpc_self(o->agent, &wi);
      td__error_prefix(st, "%s (rank %d)", wi.name, wi.id);
    }
  }
  if (st != TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
  for (int i = 0; i < nf; i++) {
    td_status s = td_future_wait(fs[i], TD_TIMEOUT_INFINITE);
    if (s != TD_OK && st == TD_OK) {
      st = s;
      snprintf(msg, sizeof msg, "%s", td_future_message(fs[i]));
    }
    td_future_unref(fs[i]);
  }
  td__free(fs);
  if (st != TD_OK) return td_set_error(st, "dist_optimizer_step: %s", msg);
  return TD_OK;
}

int td_dist_optimizer_num_owners(const td_dist_optimizer *o) { return o ? o->nowners : 0; }

void td_dist_optimizer_destroy(td_dist_optimizer *o) {
  if (!o) return;
  for (int i = 0; o->owners && i < o->nowners; i++) td_rref_unref(o->owners[i]);
  for (size_t i = 0; o->params && i < o->nparams; i++) td_rref_unref(o->params[i]);
  td__free(o->owners);
  td__free(o->params);
  td__free(o);
}

td_status td_dist_module_parameter_rrefs(td_rref *module_rref, td_timeout_ms timeout_ms,
                                         td_value **out) {
  TD_CHECK_ARG(module_rref && out, "dist_module_parameter_rrefs: NULL argument");
  td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
  co.timeout_ms = timeout_ms;
  return td_rref_rpc_sync(module_rref, "__dist_param_rrefs", NULL, 0, &co, out);
}

static void module_destroy(void *m) { td_module_unref(m); }

static void layer_init_once(void) {
  /* "nn.Module": modules held by RRefs (parameter servers, RemoteModule); this layer is the
   * lowest that knows both modules and RRefs, and reads such objects in __dist_param_rrefs. */
  td_object_type_register("nn.Module", module_destroy);
  td_object_type_register(OPT_TYPE, opt_destroy);
  td__rpc_register_internal("__dist_optim_create", h_create, NULL);
  td__rpc_register_internal("__dist_optim_step", h_step, NULL);
  td__rpc_register_internal("__dist_optim_set_lr", h_set_lr, NULL);
  td__rpc_register_internal("__dist_param_rrefs", h_param_rrefs, NULL);
}

/* td__dist_optim_layer_init registers this layer with the agent; td_rpc_init calls it (runtime/init.c)
 * before it starts the agent, the only registration path (no load-time constructor: static
 * programs need no dummy reference, and a dlopen()ed library registers nothing behind the
 * caller's back). Idempotent. */
void td__dist_optim_layer_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, layer_init_once);
}

/* A distributed optimizer step, as one span in traces and one open record of the flight recorder
 * about the context (the owners' steps are the calls it waits on). */
td_status td_dist_optimizer_step(td_dist_optimizer *o, td_dist_autograd_context *ctx) {
  uint64_t t0 = TD__TRACE_ON() ? td__now_ns() : 0;
  uint64_t id = ctx ? td_dist_autograd_context_get_id(ctx).v : 0;
  td__flight_ev fl = {.kind = TD__FL_SCOPE_BEGIN, .peer = -1, .b = id, .y = TD__FL_SUBJ_CTX,
                      .c = UINT32_MAX};
  td__flight_push(&fl, "dist_optim_step");
  td_status st = optimizer_step_impl(o, ctx);
  fl.kind = TD__FL_SCOPE_END;
  fl.x = (uint8_t)st;
  td__flight_pop(&fl, "dist_optim_step");
  if (t0) td__trace_complete("optim", "dist_optimizer step", t0, td__now_ns(), NULL);
  return st;
}
