/* registry.c - the process-wide registry of callable functions, and the two registration points
 * upper layers use to hook into every agent: agent hooks (init, shutdown) and the message
 * middleware (distributed autograd).
 *
 * Functions are registered per process, not per agent (like PyTorch's module-level functions):
 * every worker publishes its sorted registry at init (td__reg_snapshot), so a call to a function
 * the callee lacks fails at the caller at once. Names starting "__" are reserved for tdist's own
 * layers (td__rpc_register_internal).
 *
 * Lock order: reg_lock and hooks_mu are leaves (nothing is called while holding them).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "agent_state.h"

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static td__reg *regs;
static int nregs, regcap;

static td_status reg_add(const char *name, td_rpc_fn fn, void *ud, bool internal,
                         unsigned flags) {
  if (!name || !*name || !fn) return td_set_error(TD_ERR_INVALID, "rpc_register: NULL name or fn");
  if (strlen(name) > 200) return td_set_error(TD_ERR_INVALID, "rpc_register: name too long");
  bool reserved = name[0] == '_' && name[1] == '_';
  if (reserved != internal)
    return td_set_error(TD_ERR_INVALID, "rpc_register: names starting with \"__\" are reserved "
                        "for tdist ('%s')", name);
  pthread_rwlock_wrlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      bool same = regs[i].fn == fn && regs[i].user_data == ud;
      pthread_rwlock_unlock(&reg_lock);
      if (internal && same) return TD_OK;
      return td_set_error(TD_ERR_EXISTS, "rpc_register: '%s' is already registered", name);
    }
  }
  if (nregs == regcap) {
    int nc = regcap ? regcap * 2 : 32;
    td__reg *nr = td__realloc(regs, (size_t)nc * sizeof *nr);
    if (!nr) {
      pthread_rwlock_unlock(&reg_lock);
      return td_set_error(TD_ERR_NOMEM, "rpc_register: out of memory");
    }
    regs = nr;
    regcap = nc;
  }
  char *n = td__strdup(name);
  if (!n) {
    pthread_rwlock_unlock(&reg_lock);
    return td_set_error(TD_ERR_NOMEM, "rpc_register: out of memory");
  }
  regs[nregs++] = (td__reg){n, fn, ud, flags};
  pthread_rwlock_unlock(&reg_lock);
  return TD_OK;
}

td_status td_rpc_register(const char *name, td_rpc_fn fn, void *user_data) {
  return reg_add(name, fn, user_data, false, 0);
}

td_status td_rpc_register_ex(const char *name, td_rpc_fn fn, void *user_data, unsigned flags) {
  if (flags & ~TD_RPC_INLINE)
    return td_set_error(TD_ERR_INVALID, "rpc_register_ex: unknown flags 0x%x", flags);
  return reg_add(name, fn, user_data, false, flags);
}

td_status td__rpc_register_internal(const char *name, td_rpc_fn fn, void *user_data) {
  return reg_add(name, fn, user_data, true, 0);
}

td_status td__rpc_register_internal_ex(const char *name, td_rpc_fn fn, void *user_data,
                                       unsigned flags) {
  return reg_add(name, fn, user_data, true, flags);
}

td_status td_rpc_unregister(const char *name) {
  if (!name) return td_set_error(TD_ERR_INVALID, "rpc_unregister: NULL name");
  pthread_rwlock_wrlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      td__free(regs[i].name);
      regs[i] = regs[--nregs];
      pthread_rwlock_unlock(&reg_lock);
      return TD_OK;
    }
  }
  pthread_rwlock_unlock(&reg_lock);
  return td_set_error(TD_ERR_NOT_FOUND, "rpc_unregister: '%s' is not registered", name);
}

bool td__reg_find(const char *name, td__reg *out) {
  pthread_rwlock_rdlock(&reg_lock);
  for (int i = 0; i < nregs; i++) {
    if (strcmp(regs[i].name, name) == 0) {
      *out = regs[i];
      pthread_rwlock_unlock(&reg_lock);
      return true;
    }
  }
  pthread_rwlock_unlock(&reg_lock);
  return false;
}

td_status td__rpc_lookup(const char *name, td__reg *out) {
  return td__reg_find(name, out) ? TD_OK : TD_ERR_NOT_FOUND;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

char *td__reg_snapshot(void) {
  pthread_rwlock_rdlock(&reg_lock);
  size_t len = 1;
  for (int i = 0; i < nregs; i++) len += strlen(regs[i].name) + 1;
  char **names = td__malloc((size_t)(nregs ? nregs : 1) * sizeof *names);
  char *out = td__malloc(len);
  if (!names || !out) {
    pthread_rwlock_unlock(&reg_lock);
    td__free(names);
    td__free(out);
    return NULL;
  }
  for (int i = 0; i < nregs; i++) names[i] = regs[i].name;
  qsort(names, (size_t)nregs, sizeof *names, cmp_str);
  char *p = out;
  for (int i = 0; i < nregs; i++) {
    size_t l = strlen(names[i]);
    memcpy(p, names[i], l);
    p[l] = '\n';
    p += l + 1;
  }
  *p = 0;
  pthread_rwlock_unlock(&reg_lock);
  td__free(names);
  return out;
}

static td__agent_hooks hooks[TD__MAX_AGENT_HOOKS];
static int nhooks;
static pthread_mutex_t hooks_mu = PTHREAD_MUTEX_INITIALIZER;

td_status td__agent_add_hooks(const td__agent_hooks *h) {
  pthread_mutex_lock(&hooks_mu);
  for (int i = 0; i < nhooks; i++) {
    if (hooks[i].on_init == h->on_init && hooks[i].on_shutdown == h->on_shutdown) {
      pthread_mutex_unlock(&hooks_mu);
      return TD_OK;
    }
  }
  if (nhooks == TD__MAX_AGENT_HOOKS) {
    pthread_mutex_unlock(&hooks_mu);
    return td_set_error(TD_ERR_NOMEM, "rpc: too many agent hooks");
  }
  hooks[nhooks++] = *h;
  pthread_mutex_unlock(&hooks_mu);
  return TD_OK;
}

int td__agent_hooks_get(td__agent_hooks *out) {
  pthread_mutex_lock(&hooks_mu);
  int n = nhooks;
  memcpy(out, hooks, (size_t)n * sizeof *out);
  pthread_mutex_unlock(&hooks_mu);
  return n;
}

static const td__rpc_middleware *middleware;

td_status td__rpc_set_middleware(const td__rpc_middleware *mw) {
  const td__rpc_middleware *expected = NULL;
  if (__atomic_compare_exchange_n(&middleware, &expected, mw, false, __ATOMIC_ACQ_REL,
                                  __ATOMIC_ACQUIRE) || expected == mw)
    return TD_OK;
  return td_set_error(TD_ERR_EXISTS, "rpc: another message middleware is registered");
}

const td__rpc_middleware *td__mw_get(void) {
  return __atomic_load_n(&middleware, __ATOMIC_ACQUIRE);
}

static td__arg_gate_fn arg_gate;

void td__rpc_set_arg_gate(td__arg_gate_fn fn) { __atomic_store_n(&arg_gate, fn, __ATOMIC_RELEASE); }

td__arg_gate_fn td__rpc_arg_gate(void) { return __atomic_load_n(&arg_gate, __ATOMIC_ACQUIRE); }

void td__rpc_enter_ctx(td_rpc_agent *a, uint64_t ctx_id, const char *fn, td__mw_scope *scope) {
  *scope = (td__mw_scope){0};
  const td__rpc_middleware *mw = ctx_id ? td__mw_get() : NULL;
  if (!mw) return;
  td__msg m = {0};
  m.ctx_id = ctx_id;
  m.fn = (char *)fn;
  mw->enter(a, &m, scope);
}

void td__rpc_leave_ctx(td_rpc_agent *a, uint64_t ctx_id, td__mw_scope *scope) {
  (void)a;
  const td__rpc_middleware *mw = ctx_id ? td__mw_get() : NULL;
  if (mw) mw->leave(scope);
}

_Thread_local bool td__rpc_inline_thread;
