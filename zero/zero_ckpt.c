/* zero_ckpt.c - sharded checkpoints of a td_zero (tdist/collectives.h, "ZeRO checkpoints").
 *
 * td_zero_save: every member writes its own safetensors file (td_zero_shard_path) with the
 * master values, the optimizer state and the step count of each of its segments, named
 * "param.<i>@<off>" (elements [off, off + len) of flat parameter i), "param.<i>@<off>.<state>"
 * (torch's state names: exp_avg, exp_avg_sq, ...) and "param.<i>@<off>.step" (int64 [1]), and the
 * layout in the metadata (format "tdist.zero.shard", world, rank, optimizer, numel, params,
 * steps, "param.<i>.shape"). No collective is needed to write; the members agree on the outcome
 * at the end so that a failure on one fails all.
 *
 * Consolidation (td_zero_consolidate, and td_zero_load given shard files) reads the files of
 * every rank of one save, checks that they belong together (same world, every rank once, same
 * layout) and that their segments cover every element of every parameter exactly once, and
 * assembles per parameter "param.<i>" (the values, in the parameter's shape), "param.<i>.<state>"
 * and "param.<i>.step" (format "tdist.zero.full"). Anything else in a file is TD_ERR_FORMAT with
 * the file and the reason.
 *
 * td_zero_load takes such a full state (or assembles it from shard files of any world size),
 * checks it against the td_zero's parameters and optimizer before changing anything, then cuts
 * this member's segments out of it (master values and state) and writes the full values into
 * the parameters. Every member reads the whole state (the files hold P elements per tensor).
 * No locks: a td_zero is used by one thread at a time.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zero_impl.h"
#include "tdist/autograd.h"
#include "tdist/nn.h"

#define SHARD_FORMAT "tdist.zero.shard"
#define FULL_FORMAT "tdist.zero.full"

/* torch.optim's names of the state tensors buf[0..3) of td_optim (see optim.c). */
static const char *state_name(td_optim_kind k, int b) {
  static const char *const names[5][3] = {
      [TD_OPTIM_SGD] = {"momentum_buffer", NULL, NULL},
      [TD_OPTIM_ADAM] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
      [TD_OPTIM_ADAMW] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
      [TD_OPTIM_ADAGRAD] = {"sum", NULL, NULL},
      [TD_OPTIM_RMSPROP] = {"square_avg", "momentum_buffer", "grad_avg"},
  };
  return (unsigned)k < 5 && b >= 0 && b < 3 ? names[k][b] : NULL;
}

static td_optim_kind kind_of(const char *name) {
  for (int k = 0; k < 5; k++)
    if (name && !strcmp(name, td_optim_kind_name((td_optim_kind)k))) return (td_optim_kind)k;
  return (td_optim_kind)-1;
}

td_status td_zero_shard_path(const char *prefix, int rank, int world, char *buf, size_t n) {
  TD_CHECK_ARG(prefix && buf && n, "zero_shard_path: NULL prefix or buffer");
  TD_CHECK_ARG(world > 0 && rank >= 0 && rank < world, "zero_shard_path: rank %d of %d", rank,
               world);
  int len = snprintf(buf, n, "%s.zero-%d-of-%d.safetensors", prefix, rank, world);
  if (len < 0 || (size_t)len >= n)
    return td_set_error(TD_ERR_INVALID, "zero_shard_path: %zu bytes are too few for \"%s\"", n,
                        prefix);
  return TD_OK;
}

/* ---- metadata helpers ---- */

static td_status meta_int(td_safetensors_meta *m, const char *key, int64_t v) {
  char s[32];
  snprintf(s, sizeof s, "%" PRId64, v);
  return td_safetensors_meta_set(m, key, s);
}

/* The integer value of key in m, >= 0. */
static td_status meta_get_int(const td_safetensors_meta *m, const char *key, const char *path,
                              int64_t *out) {
  const char *s = td_safetensors_meta_get(m, key);
  char *end = NULL;
  long long v = s ? strtoll(s, &end, 10) : -1;
  if (!s || end == s || *end || v < 0)
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: metadata \"%s\" is %s%s%s; want an "
                        "integer >= 0", path, key, s ? "\"" : "missing", s ? s : "",
                        s ? "\"" : "");
  *out = v;
  return TD_OK;
}

static void shape_str(const td_tensor *t, char *buf, size_t n) {
  size_t k = 0;
  buf[0] = 0;
  for (int d = 0; d < td_tensor_ndim(t) && k < n; d++)
    k += (size_t)snprintf(buf + k, n - k, "%s%" PRId64, d ? "," : "", td_tensor_shape(t)[d]);
}

/* The layout metadata common to both formats. */
static td_status layout_meta(td_zero *z, const char *format, td_safetensors_meta *m) {
  char key[64], shp[256];
  td_status st = td_safetensors_meta_set(m, "format", format);
  if (st == TD_OK) st = td_safetensors_meta_set(m, "tdist.zero.version", "1");
  if (st == TD_OK) st = td_safetensors_meta_set(m, "optimizer", td_optim_kind_name(z->okind));
  if (st == TD_OK) st = meta_int(m, "numel", z->stats.numel);
  if (st == TD_OK) st = meta_int(m, "params", (int64_t)z->np);
  if (st == TD_OK) st = meta_int(m, "steps", (int64_t)z->stats.steps);
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    snprintf(key, sizeof key, "param.%zu.shape", i);
    shape_str(z->params[i], shp, sizeof shp);
    st = td_safetensors_meta_set(m, key, shp);
  }
  return st;
}

/* ---- save ---- */

static td_status step_tensor(int64_t step, td_tensor **out) {
  int64_t one = 1;
  return td_tensor_from_buffer(&step, &one, 1, TD_DTYPE_I64, out);
}

/* Appends segment k's values, state and step to l. */
static td_status add_segment(td_zero *z, size_t k, td_tensor_list *l) {
  char name[96];
  const td__zseg *g = &z->segs[k];
  td_tensor *bufs[3] = {0}, *stp = NULL;
  int64_t step = 0;
  snprintf(name, sizeof name, "param.%zu@%" PRId64, g->param, g->off);
  td_status st = td_tensor_list_append(l, name, z->seg[k]);
  if (st == TD_OK) st = td_optim_state_get(z->opt, k, bufs, &step);
  for (int b = 0; st == TD_OK && b < 3; b++) {
    if (!bufs[b] || !state_name(z->okind, b)) continue;
    snprintf(name, sizeof name, "param.%zu@%" PRId64 ".%s", g->param, g->off,
             state_name(z->okind, b));
    st = td_tensor_list_append(l, name, bufs[b]);
  }
  if (st == TD_OK) st = step_tensor(step, &stp);
  snprintf(name, sizeof name, "param.%zu@%" PRId64 ".step", g->param, g->off);
  if (st == TD_OK) st = td_tensor_list_append(l, name, stp);
  td_tensor_unref(stp);
  for (int b = 0; b < 3; b++) td_tensor_unref(bufs[b]);
  return st;
}

td_status td_zero_save(td_zero *z, const char *prefix) {
  TD_CHECK_ARG(z && prefix, "zero_save: NULL td_zero or prefix");
  if (z->armed)
    return td_set_error(TD_ERR_STATE, "zero_save: a pass is prepared; save after td_zero_step");
  int r = td_process_group_rank(z->pg), n = td_process_group_size(z->pg);
  char path[4096];
  td_tensor_list l;
  td_safetensors_meta m;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&m);
  td_status st = td_zero_shard_path(prefix, r, n, path, sizeof path);
  if (st == TD_OK) st = layout_meta(z, SHARD_FORMAT, &m);
  if (st == TD_OK) st = meta_int(&m, "world", n);
  if (st == TD_OK) st = meta_int(&m, "rank", r);
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) st = add_segment(z, k, &l);
  if (st == TD_OK) st = td_safetensors_write(path, &l, &m);
  if (st != TD_OK) td__error_prefix(st, "zero_save: rank %d", r);
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&m);
  return td__zero_agree(z, st, "zero_save");
}

/* ---- consolidation ---- */

/* The shard files of one save, being assembled. */
typedef struct asm_state {
  td_safetensors_meta meta; /* the first file's */
  td_optim_kind kind;
  int64_t np, numel, world;
  td_tensor **value, **state[3], **step; /* per parameter, full (NULL until a segment arrives) */
  uint8_t **covered;                     /* per parameter, per element */
  int64_t *covered_n, *state_n[3];       /* per parameter: elements of values, of each state */
  bool *rank_seen;
} asm_state;

static void asm_fini(asm_state *a) {
  for (int64_t i = 0; i < a->np; i++) {
    if (a->value) td_tensor_unref(a->value[i]);
    if (a->step) td_tensor_unref(a->step[i]);
    for (int b = 0; b < 3; b++)
      if (a->state[b]) td_tensor_unref(a->state[b][i]);
    if (a->covered) td__free(a->covered[i]);
  }
  td__free(a->value);
  td__free(a->step);
  for (int b = 0; b < 3; b++) td__free(a->state[b]);
  td__free(a->covered);
  td__free(a->covered_n);
  for (int b = 0; b < 3; b++) td__free(a->state_n[b]);
  td__free(a->rank_seen);
  td_safetensors_meta_fini(&a->meta);
}

/* The shape of parameter i from the metadata ("7,5"). */
static td_status meta_shape(const td_safetensors_meta *m, int64_t i, const char *path,
                            int64_t *shape, int *ndim, int64_t *numel) {
  char key[64];
  snprintf(key, sizeof key, "param.%" PRId64 ".shape", i);
  const char *s = td_safetensors_meta_get(m, key);
  if (!s) return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: no metadata \"%s\"", path, key);
  *ndim = 0;
  *numel = 1;
  while (*s) {
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (end == s || v < 0 || *ndim == 8 || (*end && *end != ',') ||
        (v > 0 && *numel > INT64_MAX / v))
      return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: bad \"%s\"", path, key);
    shape[(*ndim)++] = v;
    *numel *= v;
    s = *end ? end + 1 : end;
  }
  return TD_OK;
}

/* Reads the first file's layout and allocates the full tensors. */
static td_status asm_begin(asm_state *a, const td_safetensors_meta *m, const char *path) {
  const char *fmt = td_safetensors_meta_get(m, "format");
  if (!fmt || strcmp(fmt, SHARD_FORMAT))
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: format \"%s\", not a shard of "
                        "td_zero_save (\"" SHARD_FORMAT "\")", path, fmt ? fmt : "");
  TD_TRY(meta_get_int(m, "params", path, &a->np));
  TD_TRY(meta_get_int(m, "numel", path, &a->numel));
  TD_TRY(meta_get_int(m, "world", path, &a->world));
  a->kind = kind_of(td_safetensors_meta_get(m, "optimizer"));
  if ((int)a->kind < 0)
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: unknown optimizer", path);
  for (size_t k = 0; k < m->n; k++) TD_TRY(td_safetensors_meta_set(&a->meta, m->keys[k], m->values[k]));
  size_t np = (size_t)a->np + 1;
  a->value = td__calloc(np, sizeof *a->value);
  a->step = td__calloc(np, sizeof *a->step);
  for (int b = 0; b < 3; b++) a->state[b] = td__calloc(np, sizeof *a->state[b]);
  for (int b = 0; b < 3; b++) a->state_n[b] = td__calloc(np, sizeof *a->state_n[b]);
  a->covered = td__calloc(np, sizeof *a->covered);
  a->covered_n = td__calloc(np, sizeof *a->covered_n);
  a->rank_seen = td__calloc((size_t)a->world + 1, sizeof *a->rank_seen);
  if (!a->value || !a->step || !a->state[0] || !a->state[1] || !a->state[2] || !a->covered ||
      !a->covered_n || !a->state_n[0] || !a->state_n[1] || !a->state_n[2] || !a->rank_seen)
    return td_set_error(TD_ERR_NOMEM, "zero checkpoint: out of memory");
  int64_t total = 0;
  for (int64_t i = 0; i < a->np; i++) {
    int64_t shape[8], numel;
    int ndim;
    TD_TRY(meta_shape(m, i, path, shape, &ndim, &numel));
    total += numel;
    a->covered[i] = td__calloc((size_t)numel + 1, 1);
    if (!a->covered[i]) return td_set_error(TD_ERR_NOMEM, "zero checkpoint: out of memory");
  }
  if (total != a->numel)
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: the shapes hold %" PRId64 " elements, "
                        "numel says %" PRId64, path, total, a->numel);
  return TD_OK;
}

/* A later file must describe the same save. */
static td_status asm_check_same(asm_state *a, const td_safetensors_meta *m, const char *path) {
  static const char *const keys[] = {"format", "optimizer", "numel", "params", "steps", "world"};
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
    const char *x = td_safetensors_meta_get(&a->meta, keys[k]), *y = td_safetensors_meta_get(m, keys[k]);
    if (!x || !y || strcmp(x, y))
      return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: \"%s\" is \"%s\", the first file's "
                          "\"%s\" (files of different saves?)", path, keys[k], y ? y : "",
                          x ? x : "");
  }
  return TD_OK;
}

/* full[i] (made on first use, zeros, the parameter's shape, dtype dt) */
static td_status full_of(asm_state *a, td_tensor **slot, int64_t i, td_dtype dt,
                         const char *path) {
  if (*slot) return TD_OK;
  int64_t shape[8], numel;
  int ndim;
  TD_TRY(meta_shape(&a->meta, i, path, shape, &ndim, &numel));
  return td_tensor_zeros(shape, ndim, dt, td_device_cpu(), slot);
}

/* Copies the 1-D segment t into elements [off, off + len) of the full tensor *slot. */
static td_status put(asm_state *a, td_tensor **slot, int64_t i, int64_t off, const td_tensor *t,
                     const char *path) {
  TD_TRY(full_of(a, slot, i, td_tensor_dtype(t), path));
  int64_t n = td_tensor_numel(*slot);
  td_tensor *flat = NULL, *piece = NULL;
  td_status st = td_tensor_reshape(*slot, &n, 1, &flat);
  if (st == TD_OK) st = td_tensor_narrow(flat, 0, off, td_tensor_numel(t), &piece);
  if (st == TD_OK) st = td_tensor_copy_(piece, t);
  td_tensor_unref(flat);
  td_tensor_unref(piece);
  return st;
}

/* One tensor of a shard file: "param.<i>@<off>[.<state>|.step]". */
static td_status asm_tensor(asm_state *a, const char *name, const td_tensor *t, const char *path) {
  unsigned long long i = 0;
  long long off = -1;
  int used = 0;
  if (sscanf(name, "param.%llu@%lld%n", &i, &off, &used) != 2 || i >= (unsigned long long)a->np ||
      off < 0 || td_tensor_ndim(t) != 1)
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: unexpected tensor \"%s\"", path, name);
  const char *rest = name + used;
  int64_t len = td_tensor_numel(t), pn = 0;
  int64_t shape[8];
  int ndim;
  TD_TRY(meta_shape(&a->meta, (int64_t)i, path, shape, &ndim, &pn));
  if (len > pn || off > pn - len)
    return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: \"%s\" runs past the %" PRId64
                        " elements of parameter %llu", path, name, pn, i);
  if (!*rest) { /* the values: the coverage is counted on them */
    td_dtype dt = td_tensor_dtype(t);
    if (dt != TD_DTYPE_F32 && dt != TD_DTYPE_F64)
      return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: \"%s\" is not float", path, name);
    for (int64_t e = off; e < off + len; e++) {
      if (a->covered[i][e])
        return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: element %" PRId64 " of parameter "
                            "%llu is in two segments", path, e, i);
      a->covered[i][e] = 1;
    }
    a->covered_n[i] += len;
    return put(a, &a->value[i], (int64_t)i, off, t, path);
  }
  if (!strcmp(rest, ".step")) {
    if (td_tensor_dtype(t) != TD_DTYPE_I64 || len != 1)
      return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: \"%s\" is not one int64", path, name);
    int64_t v = *(const int64_t *)td_tensor_data(t);
    if (a->step[i] && *(const int64_t *)td_tensor_data(a->step[i]) != v)
      return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: parameter %llu's segments have "
                          "different step counts", path, i);
    return a->step[i] ? TD_OK : step_tensor(v, &a->step[i]);
  }
  for (int b = 0; b < 3; b++)
    if (*rest == '.' && state_name(a->kind, b) && !strcmp(rest + 1, state_name(a->kind, b))) {
      a->state_n[b][i] += len; /* segments are disjoint (checked on the values) */
      return put(a, &a->state[b][i], (int64_t)i, off, t, path);
    }
  return td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: unexpected tensor \"%s\"", path, name);
}

static td_status asm_file(asm_state *a, const char *path, bool first) {
  td_tensor_list l;
  td_safetensors_meta m;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&m);
  int64_t rank = -1;
  td_status st = td_safetensors_read(path, &l, &m);
  if (st == TD_OK) st = first ? asm_begin(a, &m, path) : asm_check_same(a, &m, path);
  if (st == TD_OK) st = meta_get_int(&m, "rank", path, &rank);
  if (st == TD_OK && (rank >= a->world || a->rank_seen[rank]))
    st = td_set_error(TD_ERR_FORMAT, "zero checkpoint %s: rank %" PRId64 " of %" PRId64 " %s",
                      path, rank, a->world, rank < a->world ? "appears twice" : "is out of range");
  if (st == TD_OK) a->rank_seen[rank] = true;
  for (size_t k = 0; st == TD_OK && k < l.n; k++)
    st = asm_tensor(a, l.names[k] ? l.names[k] : "", l.tensors[k], path);
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&m);
  return st;
}

/* Every parameter covered, every state complete, into out as the full format. */
static td_status asm_finish(asm_state *a, td_tensor_list *out, td_safetensors_meta *meta) {
  char name[96];
  td_status st = TD_OK;
  for (int64_t i = 0; st == TD_OK && i < a->np; i++) {
    int64_t shape[8], pn;
    int ndim;
    st = meta_shape(&a->meta, i, "(consolidation)", shape, &ndim, &pn);
    if (st == TD_OK && (a->covered_n[i] != pn || !a->step[i]))
      st = td_set_error(TD_ERR_FORMAT, "zero checkpoint: the files hold %" PRId64 " of the %" PRId64
                        " elements of parameter %" PRId64 "%s", a->covered_n[i], pn, i,
                        a->step[i] ? "" : " (or no step count)");
    snprintf(name, sizeof name, "param.%" PRId64, i);
    if (st == TD_OK) st = td_tensor_list_append(out, name, a->value[i]);
    for (int b = 0; st == TD_OK && b < 3; b++) {
      const char *sn = state_name(a->kind, b);
      if (!a->state[b][i] || !sn) continue;
      if (a->state_n[b][i] != pn)
        st = td_set_error(TD_ERR_FORMAT, "zero checkpoint: the files hold %s for %" PRId64 " of "
                          "the %" PRId64 " elements of parameter %" PRId64, sn,
                          a->state_n[b][i], pn, i);
      if (st != TD_OK) break;
      snprintf(name, sizeof name, "param.%" PRId64 ".%s", i, sn);
      st = td_tensor_list_append(out, name, a->state[b][i]);
    }
    snprintf(name, sizeof name, "param.%" PRId64 ".step", i);
    if (st == TD_OK) st = td_tensor_list_append(out, name, a->step[i]);
  }
  for (size_t k = 0; st == TD_OK && k < a->meta.n; k++) {
    const char *key = a->meta.keys[k];
    if (strcmp(key, "world") && strcmp(key, "rank"))
      st = td_safetensors_meta_set(meta, key, a->meta.values[k]);
  }
  if (st == TD_OK) st = td_safetensors_meta_set(meta, "format", FULL_FORMAT);
  return st;
}

/* Assembles the full state from the shard files paths[0..n). */
static td_status consolidate(const char *const *paths, size_t n, td_tensor_list *out,
                             td_safetensors_meta *meta) {
  asm_state a;
  memset(&a, 0, sizeof a);
  td_safetensors_meta_init(&a.meta);
  td_status st = TD_OK;
  for (size_t f = 0; st == TD_OK && f < n; f++) st = asm_file(&a, paths[f], f == 0);
  if (st == TD_OK && a.world != (int64_t)n)
    st = td_set_error(TD_ERR_FORMAT, "zero checkpoint: %zu files for a save by %" PRId64
                      " members", n, a.world);
  if (st == TD_OK) st = asm_finish(&a, out, meta);
  asm_fini(&a);
  return st;
}

td_status td_zero_consolidate(const char *const *paths, size_t n, const char *out_path) {
  TD_CHECK_ARG(paths && n && out_path, "zero_consolidate: NULL paths, no file or NULL out_path");
  for (size_t f = 0; f < n; f++) TD_CHECK_ARG(paths[f], "zero_consolidate: paths[%zu] is NULL", f);
  td_tensor_list l;
  td_safetensors_meta m;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&m);
  td_status st = consolidate(paths, n, &l, &m);
  if (st == TD_OK) st = td_safetensors_write(out_path, &l, &m);
  if (st != TD_OK) td__error_prefix(st, "zero_consolidate");
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&m);
  return st;
}

/* ---- load ---- */

/* The full state from paths: one consolidated file, or the shard files of one save. */
static td_status read_full(const char *const *paths, size_t n, td_tensor_list *l,
                           td_safetensors_meta *m) {
  TD_TRY(td_safetensors_read(paths[0], l, m));
  const char *fmt = td_safetensors_meta_get(m, "format");
  if (fmt && !strcmp(fmt, FULL_FORMAT)) {
    if (n == 1) return TD_OK;
    return td_set_error(TD_ERR_INVALID, "zero_load: %s is a consolidated checkpoint; pass it "
                        "alone", paths[0]);
  }
  td_tensor_list_fini(l);
  td_safetensors_meta_fini(m);
  td_tensor_list_init(l);
  td_safetensors_meta_init(m);
  return consolidate(paths, n, l, m);
}

/* The full state fits z: same optimizer, parameters and shapes. */
static td_status check_full(td_zero *z, const td_tensor_list *l, const td_safetensors_meta *m) {
  int64_t np = 0, numel = 0;
  TD_TRY(meta_get_int(m, "params", "(full state)", &np));
  TD_TRY(meta_get_int(m, "numel", "(full state)", &numel));
  const char *opt = td_safetensors_meta_get(m, "optimizer");
  if (np != (int64_t)z->np || numel != z->stats.numel || kind_of(opt) != z->okind)
    return td_set_error(TD_ERR_SHAPE, "zero_load: the checkpoint holds %" PRId64 " parameters, %"
                        PRId64 " elements, optimizer %s; this td_zero %zu, %" PRId64 ", %s", np,
                        numel, opt ? opt : "?", z->np, z->stats.numel,
                        td_optim_kind_name(z->okind));
  char name[96], a[96], b[96];
  for (size_t i = 0; i < z->np; i++) {
    snprintf(name, sizeof name, "param.%zu", i);
    const td_tensor *v = td_tensor_list_find(l, name);
    if (!v || !td_tensor_same_shape(v, z->params[i]))
      return td_set_error(TD_ERR_SHAPE, "zero_load: checkpoint parameter %zu has shape %s, this "
                          "td_zero's %s", i, v ? td_tensor_shape_str(v, a, sizeof a) : "(none)",
                          td_tensor_shape_str(z->params[i], b, sizeof b));
    snprintf(name, sizeof name, "param.%zu.step", i);
    const td_tensor *s = td_tensor_list_find(l, name);
    if (!s || td_tensor_dtype(s) != TD_DTYPE_I64 || td_tensor_numel(s) != 1)
      return td_set_error(TD_ERR_FORMAT, "zero_load: no step count for parameter %zu", i);
    for (int k = 0; k < 3; k++) {
      if (!state_name(z->okind, k)) continue;
      snprintf(name, sizeof name, "param.%zu.%s", i, state_name(z->okind, k));
      const td_tensor *t = td_tensor_list_find(l, name);
      if (t && !td_tensor_same_shape(t, z->params[i]))
        return td_set_error(TD_ERR_FORMAT, "zero_load: \"%s\" has another shape than its "
                            "parameter", name);
    }
  }
  return TD_OK;
}

/* Elements [off, off + len) of t, flat. New reference. */
static td_status flat_piece(const td_tensor *t, int64_t off, int64_t len, td_tensor **out) {
  int64_t n = td_tensor_numel(t);
  td_tensor *flat = NULL;
  TD_TRY(td_tensor_reshape(t, &n, 1, &flat));
  td_status st = td_tensor_narrow(flat, 0, off, len, out);
  td_tensor_unref(flat);
  return st;
}

/* Segment k's master values and optimizer state from the full state. */
static td_status load_segment(td_zero *z, size_t k, const td_tensor_list *l) {
  const td__zseg *g = &z->segs[k];
  char name[96];
  td_tensor *v = NULL, *moved = NULL, *bufs[3] = {0};
  snprintf(name, sizeof name, "param.%zu", g->param);
  td_status st = flat_piece(td_tensor_list_find(l, name), g->off, g->len, &v);
  if (st == TD_OK) st = td_tensor_to(v, z->dev, &moved);
  if (st == TD_OK) st = td_tensor_copy_(z->seg[k], moved);
  for (int b = 0; st == TD_OK && b < 3; b++) {
    if (!state_name(z->okind, b)) continue;
    snprintf(name, sizeof name, "param.%zu.%s", g->param, state_name(z->okind, b));
    const td_tensor *t = td_tensor_list_find(l, name);
    if (t) st = flat_piece(t, g->off, g->len, &bufs[b]);
  }
  snprintf(name, sizeof name, "param.%zu.step", g->param);
  int64_t step = *(const int64_t *)td_tensor_data(td_tensor_list_find(l, name));
  if (st == TD_OK) st = td_optim_state_set(z->opt, k, bufs, step);
  td_tensor_unref(v);
  td_tensor_unref(moved);
  for (int b = 0; b < 3; b++) td_tensor_unref(bufs[b]);
  return st;
}

static td_status load_full(td_zero *z, const td_tensor_list *l, const td_safetensors_meta *m) {
  int64_t steps = 0;
  TD_TRY(check_full(z, l, m));
  TD_TRY(meta_get_int(m, "steps", "(full state)", &steps));
  char name[96];
  td_status st = TD_OK;
  for (size_t k = 0; st == TD_OK && k < z->nseg; k++) st = load_segment(z, k, l);
  for (size_t i = 0; st == TD_OK && i < z->np; i++) {
    td_tensor *moved = NULL;
    if (!td__zero3_param_live(z, i)) continue; /* stage 3: gathered from the segments at use */
    snprintf(name, sizeof name, "param.%zu", i);
    st = td_tensor_to(td_tensor_list_find(l, name), z->dev, &moved);
    if (st == TD_OK) st = td_tensor_copy_(z->params[i], moved);
    td_tensor_unref(moved);
  }
  if (st == TD_OK) z->stats.steps = (uint64_t)steps;
  return st;
}

td_status td_zero_load(td_zero *z, const char *const *paths, size_t n) {
  TD_CHECK_ARG(z && paths && n, "zero_load: NULL td_zero or paths, or no file");
  for (size_t f = 0; f < n; f++) TD_CHECK_ARG(paths[f], "zero_load: paths[%zu] is NULL", f);
  if (z->armed)
    return td_set_error(TD_ERR_STATE, "zero_load: a pass is prepared; load before td_zero_prepare");
  td_tensor_list l;
  td_safetensors_meta m;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&m);
  bool prev = td_autograd_set_enabled(false);
  td_status st = read_full(paths, n, &l, &m);
  if (st == TD_OK) st = load_full(z, &l, &m);
  if (st != TD_OK) td__error_prefix(st, "zero_load: rank %d", td_process_group_rank(z->pg));
  td_autograd_set_enabled(prev);
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&m);
  return td__zero_agree(z, st, "zero_load");
}
