/* module.c - the td_module object and everything generic about it.
 *
 * A module holds three ordered tables of (name, value): parameters, buffers and children. Names
 * are unique across the three tables of one module and contain no '.'; a dotted path walks the
 * children ("encoder.layers.0.weight"). The tables are plain arrays: modules have few entries and
 * keeping registration order is what gives PyTorch-compatible state-dict keys.
 *
 * Invariants: every parameter is a float leaf tensor; a module never appears inside its own
 * subtree (checked when a child is registered), so every recursion here terminates.
 *
 * The factory registry is a process-wide array guarded by one mutex (reg_mu). Factories run
 * outside the lock, so a factory may itself create modules through the registry.
 *
 * Lock order: reg_mu is a leaf (modules themselves have no lock: see each declaration in nn.h
 * for which calls may run concurrently).
 *
 * Also here: td_tensor_list, the caller-owned list used for parameters and state dicts. Forward
 * (hooks, activation checkpointing) is in forward.c.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "modules_impl.h"

typedef td__mslot slot;
typedef td__mchild child_slot;

/* ---- td_tensor_list ---- */

void td_tensor_list_init(td_tensor_list *l) {
  if (l) memset(l, 0, sizeof *l);
}

void td_tensor_list_fini(td_tensor_list *l) {
  if (!l) return;
  for (size_t i = 0; i < l->n; i++) {
    td_tensor_unref(l->tensors[i]);
    td__free(l->names[i]);
  }
  td__free(l->tensors);
  td__free(l->names);
  memset(l, 0, sizeof *l);
}

td_status td_tensor_list_append(td_tensor_list *l, const char *name, td_tensor *t) {
  TD_CHECK_ARG(l && t, "td_tensor_list_append: NULL list or tensor");
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 8;
    td_tensor **ts = td__realloc(l->tensors, cap * sizeof *ts);
    if (!ts) return td_set_error(TD_ERR_NOMEM, "td_tensor_list_append: out of memory");
    l->tensors = ts;
    char **ns = td__realloc(l->names, cap * sizeof *ns);
    if (!ns) return td_set_error(TD_ERR_NOMEM, "td_tensor_list_append: out of memory");
    l->names = ns;
    l->cap = cap;
  }
  char *copy = NULL;
  if (name) {
    copy = td__strdup(name);
    if (!copy) return td_set_error(TD_ERR_NOMEM, "td_tensor_list_append: out of memory");
  }
  l->tensors[l->n] = td_tensor_ref(t);
  l->names[l->n] = copy;
  l->n++;
  return TD_OK;
}

td_tensor *td_tensor_list_find(const td_tensor_list *l, const char *name) {
  if (!l || !name) return NULL;
  for (size_t i = 0; i < l->n; i++)
    if (l->names[i] && strcmp(l->names[i], name) == 0) return l->tensors[i];
  return NULL;
}

/* ---- lifecycle ---- */

td_status td_module_create(const td_module_type *type, void *state, td_module **out) {
  TD_CHECK_ARG(type && out, "td_module_create: NULL type or out");
  TD_CHECK_ARG(type->name && type->forward, "td_module_create: type needs a name and a forward");
  td_module *m = td__calloc(1, sizeof *m);
  if (!m) return td_set_error(TD_ERR_NOMEM, "td_module_create(%s): out of memory", type->name);
  td__ref_init(&m->rc);
  m->type = type;
  m->state = state;
  m->training = true;
  *out = m;
  return TD_OK;
}

td_module *td_module_ref(td_module *m) {
  if (m) td__ref_inc(&m->rc);
  return m;
}

void td_module_unref(td_module *m) {
  if (!m || !td__ref_dec(&m->rc)) return;
  for (int i = 0; i < m->n_params; i++) {
    td_tensor_unref(m->params[i].t);
    td__free(m->params[i].name);
  }
  for (int i = 0; i < m->n_buffers; i++) {
    td_tensor_unref(m->buffers[i].t);
    td__free(m->buffers[i].name);
  }
  for (int i = 0; i < m->n_children; i++) {
    td_module_unref(m->children[i].m);
    td__free(m->children[i].name);
  }
  td__free(m->params);
  td__free(m->buffers);
  td__free(m->children);
  td__free(m->hooks);
  if (m->type->destroy && m->state) m->type->destroy(m->state);
  td__free(m);
}

const char *td_module_type_name(const td_module *m) { return m ? m->type->name : "(null)"; }
const td_module_type *td_module_get_type(const td_module *m) { return m ? m->type : NULL; }
void *td_module_state(const td_module *m) { return m ? m->state : NULL; }

/* ---- registration ---- */

static bool name_taken(const td_module *m, const char *name) {
  for (int i = 0; i < m->n_params; i++)
    if (strcmp(m->params[i].name, name) == 0) return true;
  for (int i = 0; i < m->n_buffers; i++)
    if (strcmp(m->buffers[i].name, name) == 0) return true;
  for (int i = 0; i < m->n_children; i++)
    if (strcmp(m->children[i].name, name) == 0) return true;
  return false;
}

static td_status check_name(const td_module *m, const char *what, const char *name) {
  TD_CHECK_ARG(m && name, "td_module_register_%s: NULL module or name", what);
  TD_CHECK_ARG(name[0] != '\0', "%s: empty %s name", m->type->name, what);
  TD_CHECK_ARG(strchr(name, '.') == NULL, "%s: %s name \"%s\" must not contain '.'",
               m->type->name, what, name);
  if (name_taken(m, name))
    return td_set_error(TD_ERR_EXISTS, "%s: name \"%s\" is already registered", m->type->name,
                        name);
  return TD_OK;
}

static td_status slot_push(slot **arr, int *n, int *cap, const char *name, td_tensor *t) {
  if (*n == *cap) {
    int c = *cap ? *cap * 2 : 4;
    slot *a = td__realloc(*arr, (size_t)c * sizeof *a);
    if (!a) return td_set_error(TD_ERR_NOMEM, "module: out of memory");
    *arr = a;
    *cap = c;
  }
  char *copy = td__strdup(name);
  if (!copy) return td_set_error(TD_ERR_NOMEM, "module: out of memory");
  (*arr)[*n].name = copy;
  (*arr)[*n].t = td_tensor_ref(t);
  (*n)++;
  return TD_OK;
}

static bool is_float(td_dtype dt) { return dt == TD_DTYPE_F32 || dt == TD_DTYPE_F64; }

td_status td_module_register_parameter(td_module *m, const char *name, td_tensor *t) {
  TD_TRY(check_name(m, "parameter", name));
  TD_CHECK_ARG(t, "%s: NULL tensor for parameter \"%s\"", m->type->name, name);
  if (!is_float(td_tensor_dtype(t)))
    return td_set_error(TD_ERR_DTYPE, "%s: parameter \"%s\" must be float32 or float64, not %s",
                        m->type->name, name, td_dtype_name(td_tensor_dtype(t)));
  if (!td_tensor_is_leaf(t))
    return td_set_error(TD_ERR_INVALID, "%s: parameter \"%s\" must be a leaf tensor (detach it)",
                        m->type->name, name);
  TD_TRY(td_tensor_set_requires_grad(t, true));
  return slot_push(&m->params, &m->n_params, &m->cap_params, name, t);
}

td_status td_module_register_buffer(td_module *m, const char *name, td_tensor *t) {
  TD_TRY(check_name(m, "buffer", name));
  TD_CHECK_ARG(t, "%s: NULL tensor for buffer \"%s\"", m->type->name, name);
  if (td_tensor_requires_grad(t))
    return td_set_error(TD_ERR_INVALID, "%s: buffer \"%s\" must not require grad", m->type->name,
                        name);
  return slot_push(&m->buffers, &m->n_buffers, &m->cap_buffers, name, t);
}

static bool contains(const td_module *root, const td_module *x) {
  if (root == x) return true;
  for (int i = 0; i < root->n_children; i++)
    if (contains(root->children[i].m, x)) return true;
  return false;
}

static void set_training(td_module *m, bool training) {
  m->training = training;
  for (int i = 0; i < m->n_children; i++) set_training(m->children[i].m, training);
}

td_status td_module_register_module(td_module *m, const char *name, td_module *child) {
  TD_TRY(check_name(m, "module", name));
  TD_CHECK_ARG(child, "%s: NULL child module \"%s\"", m->type->name, name);
  if (contains(child, m))
    return td_set_error(TD_ERR_INVALID, "%s: child \"%s\" (%s) contains the parent: a cycle",
                        m->type->name, name, child->type->name);
  if (m->n_children == m->cap_children) {
    int c = m->cap_children ? m->cap_children * 2 : 4;
    child_slot *a = td__realloc(m->children, (size_t)c * sizeof *a);
    if (!a) return td_set_error(TD_ERR_NOMEM, "module: out of memory");
    m->children = a;
    m->cap_children = c;
  }
  char *copy = td__strdup(name);
  if (!copy) return td_set_error(TD_ERR_NOMEM, "module: out of memory");
  m->children[m->n_children].name = copy;
  m->children[m->n_children].m = td_module_ref(child);
  m->n_children++;
  set_training(child, m->training);
  return TD_OK;
}

/* ---- lookup ---- */

td_tensor *td__module_param_at(const td_module *m, int i) {
  return (m && i >= 0 && i < m->n_params) ? m->params[i].t : NULL;
}

int td__module_num_params(const td_module *m) { return m ? m->n_params : 0; }

static slot *find_slot(slot *arr, int n, const char *name, size_t len) {
  for (int i = 0; i < n; i++)
    if (strlen(arr[i].name) == len && memcmp(arr[i].name, name, len) == 0) return &arr[i];
  return NULL;
}

static td_module *find_child(const td_module *m, const char *name, size_t len) {
  for (int i = 0; i < m->n_children; i++)
    if (strlen(m->children[i].name) == len && memcmp(m->children[i].name, name, len) == 0)
      return m->children[i].m;
  return NULL;
}

td_tensor *td_module_param(const td_module *m, const char *name) {
  if (!m || !name) return NULL;
  slot *s = find_slot(m->params, m->n_params, name, strlen(name));
  return s ? s->t : NULL;
}

td_tensor *td_module_buffer(const td_module *m, const char *name) {
  if (!m || !name) return NULL;
  slot *s = find_slot(m->buffers, m->n_buffers, name, strlen(name));
  return s ? s->t : NULL;
}

td_module *td_module_child(const td_module *m, const char *name) {
  if (!m || !name) return NULL;
  return find_child(m, name, strlen(name));
}

int td_module_num_children(const td_module *m) { return m ? m->n_children : 0; }

td_module *td_module_child_at(const td_module *m, int i, const char **name) {
  if (!m || i < 0 || i >= m->n_children) return NULL;
  if (name) *name = m->children[i].name;
  return m->children[i].m;
}

/* resolve walks a dotted path to the slot of a parameter (is_param) or buffer; NULL if none. */
static slot *resolve(td_module *m, const char *path, bool *is_param) {
  const char *p = path;
  for (;;) {
    const char *dot = strchr(p, '.');
    if (!dot) break;
    m = find_child(m, p, (size_t)(dot - p));
    if (!m) return NULL;
    p = dot + 1;
  }
  size_t len = strlen(p);
  slot *s = find_slot(m->params, m->n_params, p, len);
  if (s) {
    *is_param = true;
    return s;
  }
  *is_param = false;
  return find_slot(m->buffers, m->n_buffers, p, len);
}

td_status td_module_get_parameter(td_module *m, const char *path, td_tensor **out) {
  TD_CHECK_ARG(m && path && out, "td_module_get_parameter: NULL argument");
  bool is_param;
  slot *s = resolve(m, path, &is_param);
  if (!s)
    return td_set_error(TD_ERR_NOT_FOUND, "%s has no parameter or buffer \"%s\"", m->type->name,
                        path);
  *out = td_tensor_ref(s->t);
  return TD_OK;
}

td_status td_module_set_parameter(td_module *m, const char *path, td_tensor *t) {
  TD_CHECK_ARG(m && path && t, "td_module_set_parameter: NULL argument");
  bool is_param;
  slot *s = resolve(m, path, &is_param);
  if (!s)
    return td_set_error(TD_ERR_NOT_FOUND, "%s has no parameter or buffer \"%s\"", m->type->name,
                        path);
  char a[96], b[96];
  if (!td_tensor_same_shape(s->t, t))
    return td_set_error(TD_ERR_SHAPE, "set_parameter \"%s\": new shape %s, expected %s", path,
                        td_tensor_shape_str(t, a, sizeof a), td_tensor_shape_str(s->t, b, sizeof b));
  if (td_tensor_dtype(s->t) != td_tensor_dtype(t))
    return td_set_error(TD_ERR_DTYPE, "set_parameter \"%s\": new dtype %s, expected %s", path,
                        td_dtype_name(td_tensor_dtype(t)), td_dtype_name(td_tensor_dtype(s->t)));
  if (!td_tensor_is_leaf(t))
    return td_set_error(TD_ERR_INVALID, "set_parameter \"%s\": tensor must be a leaf", path);
  if (s->t == t) return TD_OK;
  if (td_tensor_requires_grad(t) != td_tensor_requires_grad(s->t))
    TD_TRY(td_tensor_set_requires_grad(t, td_tensor_requires_grad(s->t)));
  td_tensor_unref(s->t);
  s->t = td_tensor_ref(t);
  return TD_OK;
}

/* ---- enumeration ---- */

static bool list_has_tensor(const td_tensor_list *l, const td_tensor *t) {
  for (size_t i = 0; i < l->n; i++)
    if (l->tensors[i] == t) return true;
  return false;
}

/* walk appends params (and buffers when with_buffers) under prefix; dedup skips tensors already
 * listed. */
static td_status walk(td_module *m, const char *prefix, bool with_buffers, bool dedup,
                      td_tensor_list *out) {
  char name[1024];
  for (int i = 0; i < m->n_params; i++) {
    if (dedup && list_has_tensor(out, m->params[i].t)) continue;
    int n = snprintf(name, sizeof name, "%s%s", prefix, m->params[i].name);
    if (n < 0 || (size_t)n >= sizeof name)
      return td_set_error(TD_ERR_INVALID, "parameter path too long: %s...", prefix);
    TD_TRY(td_tensor_list_append(out, name, m->params[i].t));
  }
  if (with_buffers) {
    for (int i = 0; i < m->n_buffers; i++) {
      int n = snprintf(name, sizeof name, "%s%s", prefix, m->buffers[i].name);
      if (n < 0 || (size_t)n >= sizeof name)
        return td_set_error(TD_ERR_INVALID, "buffer path too long: %s...", prefix);
      TD_TRY(td_tensor_list_append(out, name, m->buffers[i].t));
    }
  }
  for (int i = 0; i < m->n_children; i++) {
    int n = snprintf(name, sizeof name, "%s%s.", prefix, m->children[i].name);
    if (n < 0 || (size_t)n >= sizeof name)
      return td_set_error(TD_ERR_INVALID, "module path too long: %s...", prefix);
    TD_TRY(walk(m->children[i].m, name, with_buffers, dedup, out));
  }
  return TD_OK;
}

/* collect runs walk into a scratch list and appends it to out only on success, so out is left
 * unchanged on failure. */
static td_status collect(td_module *m, bool with_buffers, bool dedup, td_tensor_list *out) {
  TD_CHECK_ARG(m && out, "td_module: NULL module or list");
  td_tensor_list tmp;
  td_tensor_list_init(&tmp);
  td_status st = walk(m, "", with_buffers, dedup, &tmp);
  size_t before = out->n;
  for (size_t i = 0; st == TD_OK && i < tmp.n; i++)
    st = td_tensor_list_append(out, tmp.names[i], tmp.tensors[i]);
  while (st != TD_OK && out->n > before) { /* roll back */
    out->n--;
    td_tensor_unref(out->tensors[out->n]);
    td__free(out->names[out->n]);
  }
  td_tensor_list_fini(&tmp);
  return st;
}

td_status td_module_named_parameters(td_module *m, td_tensor_list *out) {
  return collect(m, false, true, out);
}

td_status td_module_parameters(td_module *m, td_tensor_list *out) {
  return collect(m, false, true, out);
}

td_status td_module_state_dict(td_module *m, td_tensor_list *out) {
  return collect(m, true, false, out);
}

int64_t td_module_num_parameters(td_module *m) {
  if (!m) return 0;
  td_tensor_list l;
  td_tensor_list_init(&l);
  int64_t total = 0;
  if (collect(m, false, true, &l) == TD_OK)
    for (size_t i = 0; i < l.n; i++) total += td_tensor_numel(l.tensors[i]);
  td_tensor_list_fini(&l);
  return total;
}

/* ---- load ---- */

/* names_append adds name to a comma-separated report, at most 8 names then "...". */
static void names_append(char *buf, size_t n, int *count, const char *name) {
  size_t len = strlen(buf);
  if (*count == 8) snprintf(buf + len, n - len, ", ...");
  else if (*count < 8) snprintf(buf + len, n - len, "%s\"%s\"", *count ? ", " : "", name);
  (*count)++;
}

td_status td_module_load_state_dict(td_module *m, const td_tensor_list *sd, bool strict) {
  TD_CHECK_ARG(m && sd, "td_module_load_state_dict: NULL module or state dict");
  td_tensor_list own;
  td_tensor_list_init(&own);
  td_status st = collect(m, true, false, &own);
  if (st != TD_OK) return st;
  char missing[512] = "", unexpected[512] = "";
  int n_missing = 0, n_unexpected = 0;
  /* 1. check everything */
  for (size_t i = 0; i < own.n && st == TD_OK; i++) {
    td_tensor *src = td_tensor_list_find(sd, own.names[i]);
    if (!src) {
      names_append(missing, sizeof missing, &n_missing, own.names[i]);
      continue;
    }
    char a[96], b[96];
    if (!td_tensor_same_shape(src, own.tensors[i]))
      st = td_set_error(TD_ERR_SHAPE, "load_state_dict(%s): \"%s\" has shape %s in the state "
                        "dict but %s in the module", m->type->name, own.names[i],
                        td_tensor_shape_str(src, a, sizeof a),
                        td_tensor_shape_str(own.tensors[i], b, sizeof b));
    else if (td_tensor_dtype(src) != td_tensor_dtype(own.tensors[i]))
      st = td_set_error(TD_ERR_DTYPE, "load_state_dict(%s): \"%s\" is %s in the state dict but "
                        "%s in the module", m->type->name, own.names[i],
                        td_dtype_name(td_tensor_dtype(src)),
                        td_dtype_name(td_tensor_dtype(own.tensors[i])));
  }
  for (size_t i = 0; i < sd->n && st == TD_OK; i++) {
    const char *name = sd->names[i] ? sd->names[i] : "(unnamed)";
    if (!sd->names[i] || !td_tensor_list_find(&own, sd->names[i]))
      names_append(unexpected, sizeof unexpected, &n_unexpected, name);
  }
  if (st == TD_OK && strict && (n_missing || n_unexpected)) {
    st = td_set_error(n_missing ? TD_ERR_NOT_FOUND : TD_ERR_INVALID,
                      "load_state_dict(%s): %d missing key(s)%s%s, %d unexpected key(s)%s%s",
                      m->type->name, n_missing, n_missing ? ": " : "", missing, n_unexpected,
                      n_unexpected ? ": " : "", unexpected);
  }
  /* 2. copy */
  bool prev = td_autograd_set_enabled(false);
  for (size_t i = 0; i < own.n && st == TD_OK; i++) {
    td_tensor *src = td_tensor_list_find(sd, own.names[i]);
    if (!src) continue;
    td_tensor *moved = NULL;
    st = td_tensor_to(src, td_tensor_device(own.tensors[i]), &moved);
    if (st == TD_OK) st = td_tensor_copy_(own.tensors[i], moved);
    td_tensor_unref(moved);
  }
  td_autograd_set_enabled(prev);
  td_tensor_list_fini(&own);
  return st;
}

/* ---- modes and devices ---- */

void td_module_train(td_module *m, bool training) {
  if (m) set_training(m, training);
}

bool td_module_is_training(const td_module *m) { return m ? m->training : false; }

void td_module_zero_grad(td_module *m) {
  if (!m) return;
  for (int i = 0; i < m->n_params; i++) td_tensor_set_grad(m->params[i].t, NULL);
  for (int i = 0; i < m->n_children; i++) td_module_zero_grad(m->children[i].m);
}

td_status td_module_set_requires_grad(td_module *m, bool requires_grad) {
  TD_CHECK_ARG(m, "td_module_set_requires_grad: NULL module");
  for (int i = 0; i < m->n_params; i++)
    TD_TRY(td_tensor_set_requires_grad(m->params[i].t, requires_grad));
  for (int i = 0; i < m->n_children; i++)
    TD_TRY(td_module_set_requires_grad(m->children[i].m, requires_grad));
  return TD_OK;
}

/* convert_fn makes the converted copy of t (or a new reference to t when nothing changes). */
typedef td_status (*convert_fn)(const td_tensor *t, const void *arg, td_tensor **out);

static td_status conv_device(const td_tensor *t, const void *arg, td_tensor **out) {
  return td_tensor_to(t, *(const td_device *)arg, out);
}

static td_status conv_dtype(const td_tensor *t, const void *arg, td_tensor **out) {
  if (!is_float(td_tensor_dtype(t))) {
    *out = td_tensor_ref((td_tensor *)t);
    return TD_OK;
  }
  return td_tensor_to_dtype(t, *(const td_dtype *)arg, out);
}

/* A conversion pass remembers old -> new tensors so that a tensor shared by several slots (tied
 * weights) stays shared after the conversion. */
typedef struct conversion {
  convert_fn fn;
  const void *arg;
  td_tensor_list done; /* tensors[2k] = old (reference held), tensors[2k + 1] = new */
} conversion;

/* convert_slot replaces s->t by its conversion: a fresh leaf with the same requires_grad and a
 * converted gradient. */
static td_status convert_slot(slot *s, conversion *cv) {
  for (size_t k = 0; k + 1 < cv->done.n; k += 2) {
    if (cv->done.tensors[k] == s->t) {
      td_tensor *nt = td_tensor_ref(cv->done.tensors[k + 1]);
      td_tensor_unref(s->t);
      s->t = nt;
      return TD_OK;
    }
  }
  td_tensor *conv = NULL, *leaf = NULL, *grad = NULL, *grad_conv = NULL;
  td_status st = cv->fn(s->t, cv->arg, &conv);
  if (st != TD_OK) goto out;
  if (conv == s->t) goto out;
  st = td_tensor_detach(conv, &leaf);
  if (st != TD_OK) goto out;
  if (td_tensor_requires_grad(s->t)) {
    st = td_tensor_set_requires_grad(leaf, true);
    if (st != TD_OK) goto out;
  }
  grad = td_tensor_grad(s->t);
  if (grad) {
    st = cv->fn(grad, cv->arg, &grad_conv);
    if (st == TD_OK) st = td_tensor_set_grad(leaf, grad_conv);
    if (st != TD_OK) goto out;
  }
  st = td_tensor_list_append(&cv->done, NULL, s->t);
  if (st == TD_OK) st = td_tensor_list_append(&cv->done, NULL, leaf);
  if (st != TD_OK) goto out;
  td_tensor_unref(s->t);
  s->t = leaf;
  leaf = NULL;
out:
  td_tensor_unref(conv);
  td_tensor_unref(leaf);
  td_tensor_unref(grad);
  td_tensor_unref(grad_conv);
  return st;
}

static td_status convert_tree(td_module *m, conversion *cv) {
  for (int i = 0; i < m->n_params; i++) TD_TRY(convert_slot(&m->params[i], cv));
  for (int i = 0; i < m->n_buffers; i++) TD_TRY(convert_slot(&m->buffers[i], cv));
  for (int i = 0; i < m->n_children; i++) TD_TRY(convert_tree(m->children[i].m, cv));
  return TD_OK;
}

static td_status convert_all(td_module *m, convert_fn fn, const void *arg) {
  conversion cv = {fn, arg, {0}};
  bool prev = td_autograd_set_enabled(false);
  td_status st = convert_tree(m, &cv);
  td_autograd_set_enabled(prev);
  td_tensor_list_fini(&cv.done);
  return st;
}

td_status td_module_to(td_module *m, td_device dev) {
  TD_CHECK_ARG(m, "td_module_to: NULL module");
  if (!td_device_available(dev)) {
    char buf[32];
    return td_set_error(TD_ERR_DEVICE, "td_module_to(%s): device %s is not available",
                        m->type->name, td_device_str(dev, buf, sizeof buf));
  }
  return convert_all(m, conv_device, &dev);
}

td_status td_module_to_dtype(td_module *m, td_dtype dt) {
  TD_CHECK_ARG(m, "td_module_to_dtype: NULL module");
  if (!is_float(dt))
    return td_set_error(TD_ERR_DTYPE, "td_module_to_dtype(%s): %s is not a float dtype",
                        m->type->name, td_dtype_name(dt));
  return convert_all(m, conv_dtype, &dt);
}

/* ---- factory registry ---- */

typedef struct factory {
  char *name;
  td_module_factory_fn fn;
  void *ctx;
} factory;

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static factory *reg;
static size_t reg_n, reg_cap;

static factory *reg_find(const char *name) {
  for (size_t i = 0; i < reg_n; i++)
    if (strcmp(reg[i].name, name) == 0) return &reg[i];
  return NULL;
}

td_status td_module_factory_register(const char *name, td_module_factory_fn fn, void *ctx) {
  TD_CHECK_ARG(name && name[0] && fn, "td_module_factory_register: NULL or empty name or fn");
  td_status st = TD_OK;
  pthread_mutex_lock(&reg_mu);
  if (reg_find(name)) {
    st = td_set_error(TD_ERR_EXISTS, "module factory \"%s\" is already registered", name);
    goto out;
  }
  if (reg_n == reg_cap) {
    size_t c = reg_cap ? reg_cap * 2 : 8;
    factory *a = td__realloc(reg, c * sizeof *a);
    if (!a) {
      st = td_set_error(TD_ERR_NOMEM, "td_module_factory_register: out of memory");
      goto out;
    }
    reg = a;
    reg_cap = c;
  }
  char *copy = td__strdup(name);
  if (!copy) {
    st = td_set_error(TD_ERR_NOMEM, "td_module_factory_register: out of memory");
    goto out;
  }
  reg[reg_n].name = copy;
  reg[reg_n].fn = fn;
  reg[reg_n].ctx = ctx;
  reg_n++;
out:
  pthread_mutex_unlock(&reg_mu);
  return st;
}

td_status td_module_factory_unregister(const char *name) {
  TD_CHECK_ARG(name, "td_module_factory_unregister: NULL name");
  td_status st = TD_OK;
  pthread_mutex_lock(&reg_mu);
  factory *f = reg_find(name);
  if (!f) {
    st = td_set_error(TD_ERR_NOT_FOUND, "no module factory \"%s\"", name);
  } else {
    td__free(f->name);
    size_t i = (size_t)(f - reg);
    memmove(&reg[i], &reg[i + 1], (reg_n - i - 1) * sizeof *reg);
    reg_n--;
    if (reg_n == 0) {
      td__free(reg);
      reg = NULL;
      reg_cap = 0;
    }
  }
  pthread_mutex_unlock(&reg_mu);
  return st;
}

bool td_module_factory_exists(const char *name) {
  if (!name) return false;
  pthread_mutex_lock(&reg_mu);
  bool found = reg_find(name) != NULL;
  pthread_mutex_unlock(&reg_mu);
  return found;
}

td_status td_module_factory_create(const char *name, const void *args, td_module **out) {
  TD_CHECK_ARG(name && out, "td_module_factory_create: NULL name or out");
  pthread_mutex_lock(&reg_mu);
  factory *f = reg_find(name);
  td_module_factory_fn fn = f ? f->fn : NULL;
  void *ctx = f ? f->ctx : NULL;
  pthread_mutex_unlock(&reg_mu);
  if (!fn) return td_set_error(TD_ERR_NOT_FOUND, "no module factory registered as \"%s\"", name);
  td_module *m = NULL;
  td_status st = fn(ctx, args, &m);
  if (st != TD_OK) return st;
  if (!m)
    return td_set_error(TD_ERR_INTERNAL, "module factory \"%s\" returned TD_OK without a module",
                        name);
  *out = m;
  return TD_OK;
}
