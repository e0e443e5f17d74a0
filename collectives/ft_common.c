/* ft_common.c - the pieces the fault-tolerant data-parallel steps share (ft_impl.h): fault
 * injection, the re-formation and its report line, the flat copy of the .grads, the
 * reassignment of a lost member's shards of the batch, the accounting of their own time.
 *
 * Threads: each function is called by the one thread that runs a td_ft_ddp's or td_ft_zero's
 * steps; td__pg_inject_close and td__pg_is_broken take pg->mu (group.c); no lock of its own.
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coll_impl.h"
#include "ft_impl.h"

#define REFORM_TRIES 3

/* ---- fault injection ---- */

td_status td__ft_inject_add(td__ft_injector *fi, int rank, int64_t step, td_ft_when when,
                            td_ft_what what, td_ft_when last, const char *what_fn) {
  TD_CHECK_ARG(fi && fi->n < TD__FT_MAX_INJECT && (int)when >= 0 && when <= last &&
                   (int)what >= 0 && what <= TD_FT_STOP,
               "%s: NULL, too many injections or an unknown point or fault", what_fn);
  fi->inj[fi->n++] = (td__ft_inject){rank, step, when, what, false};
  return TD_OK;
}

void td__ft_inject_at(td__ft_injector *fi, td_process_group *pg, int64_t step, td_ft_when when) {
  int me = td_rpc_rank(pg->agent);
  for (int i = 0; i < fi->n; i++) {
    td__ft_inject *j = &fi->inj[i];
    if (j->fired || j->rank != me || j->step != step || j->when != when) continue;
    j->fired = true;
    static const char *const whens[] = {
        "before the reduction", "during the reduction", "after the reduction",
        "in the recovery after the reduction", "after the optimizer step, before the all-gather",
        "during the all-gather", "after the all-gather",
        "after the commit vote, before the optimizer step",
        "after its first gather of a unit's parameters (stage 3)"};
    static const char *const whats[] = {"SIGKILL", "closing the group", "SIGSTOP"};
    td_log(TD_LOG_WARN, "fault injection: rank %d, step %lld, %s: %s", me, (long long)step,
           whens[when], whats[j->what]);
    if (j->what == TD_FT_KILL || j->what == TD_FT_STOP) {
      fflush(NULL);
      raise(j->what == TD_FT_KILL ? SIGKILL : SIGSTOP);
    }
    if (j->what == TD_FT_CLOSE) td__pg_inject_close(pg);
  }
}

bool td__ft_inject_due(const td__ft_injector *fi, int64_t step, td_ft_when when) {
  for (int i = 0; i < fi->n; i++)
    if (!fi->inj[i].fired && fi->inj[i].step == step && fi->inj[i].when == when) return true;
  return false;
}

td_status td_ft_inject_parse(const char *spec, int *rank, int64_t *step, td_ft_when *when,
                             td_ft_what *what) {
  char w[24], f[16];
  int r = -1, used = 0;
  long long k = -1;
  if (!spec || sscanf(spec, "%d:%lld:%23[a-z_]:%15[a-z]%n", &r, &k, w, f, &used) != 4 ||
      spec[used] || r < 0 || k < 0)
    return td_set_error(TD_ERR_INVALID, "fault injection '%s': expected rank:step:when:what",
                        spec ? spec : "(null)");
  static const char *const names[] = {"before", "during", "after", "recovery",
                                      "before_gather", "during_gather", "after_gather",
                                      "after_vote", "unit_gather"};
  int wh = -1;
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (!strcmp(w, names[i])) wh = i;
  td_ft_what wt = !strcmp(f, "kill") ? TD_FT_KILL : !strcmp(f, "close") ? TD_FT_CLOSE
                  : !strcmp(f, "stop") ? TD_FT_STOP : (td_ft_what)-1;
  if (wh < 0 || (int)wt < 0)
    return td_set_error(TD_ERR_INVALID, "fault injection '%s': when is before, during, after, "
                        "recovery (the reduction), before_gather, during_gather, after_gather, "
                        "after_vote (ZeRO's all-gather and vote) or unit_gather (ZeRO stage 3); "
                        "what is kill, close or stop", spec);
  *rank = r, *step = k, *when = (td_ft_when)wh, *what = wt;
  return TD_OK;
}

/* ---- small pieces ---- */

size_t td__ft_say(char *buf, size_t n, size_t len, const char *fmt, ...) {
  if (len >= n) return len;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf + len, n - len, fmt, ap);
  va_end(ap);
  return k < 0 ? len : len + (size_t)k;
}

int td__ft_group_rank(const td_process_group *pg, int global) {
  for (int i = 0; i < pg->size; i++)
    if (pg->ranks[i] == global) return i;
  return -1;
}

const char *td__ft_who(const td_process_group *pg, int grank, char *buf, size_t n) {
  return td__pg_who(pg, grank, buf, n);
}

td_status td__ft_broken(td_process_group *pg) {
  if (!td__pg_is_broken(pg)) return TD_OK;
  return td_set_error(TD_ERR_UNAVAILABLE, "%s", pg->broken_msg ? pg->broken_msg : "");
}

/* ---- re-formation ---- */

td_status td__ft_reform(td_process_group *given, td_process_group **pg, td_timeout_ms timeout,
                        int64_t step, const char *why, char *msg, size_t n, size_t *len,
                        int *lost, int *joined) {
  td_process_group *old = *pg, *next = NULL;
  int old_size = old->size;
  int *old_ranks = td__malloc((size_t)old_size * sizeof *old_ranks);
  char(*old_names)[128] = td__malloc((size_t)old_size * sizeof *old_names);
  if (!old_ranks || !old_names) {
    td__free(old_ranks);
    td__free(old_names);
    return td_set_error(TD_ERR_NOMEM, "fault tolerance: out of memory");
  }
  memcpy(old_ranks, old->ranks, (size_t)old_size * sizeof *old_ranks);
  memcpy(old_names, old->names, (size_t)old_size * sizeof *old_names);
  uint64_t old_gen = old->generation;
  double t0 = (double)td__now_ns() * 1e-9;
  td_status st = TD_OK;
  for (int t = 0; t < REFORM_TRIES; t++) {
    st = td_process_group_reform(old, timeout, &next);
    if (st == TD_OK || st == TD_ERR_STATE) break;
  }
  *len = td__ft_say(msg, n, *len, "%sstep %lld, generation %llu: %s", *len ? " | " : "",
                    (long long)step, (unsigned long long)old_gen, why);
  *lost = 0;
  if (st == TD_OK) {
    if (old != given) td_process_group_destroy(old);
    *pg = next;
    for (int i = 0; i < old_size; i++) {
      if (td__ft_group_rank(next, old_ranks[i]) >= 0) continue;
      *len = td__ft_say(msg, n, *len, "%s%s (rank %d)", *lost ? ", " : "; lost: ", old_names[i],
                        old_ranks[i]);
      (*lost)++;
    }
    int nj = 0;
    for (int j = 0; j < next->size; j++) {
      bool old_member = false;
      for (int i = 0; i < old_size && !old_member; i++) old_member = old_ranks[i] == next->ranks[j];
      if (old_member) continue;
      *len = td__ft_say(msg, n, *len, "%s%s (rank %d)", nj++ ? ", " : "; joined (a spare): ",
                        next->names[j], next->ranks[j]);
    }
    if (joined) *joined = nj;
    *len = td__ft_say(msg, n, *len, "; generation %llu formed with %d of %d members in %.3f s",
                      (unsigned long long)next->generation, next->size, old_size,
                      (double)td__now_ns() * 1e-9 - t0);
  }
  td__free(old_ranks);
  td__free(old_names);
  return st;
}

/* ---- gradients and shards ---- */

void td__ft_own(double *own_s, uint64_t t0) {
  if (own_s) *own_s += (double)(td__now_ns() - t0) * 1e-9;
}

td_status td__ft_take_grads(td_tensor *const *params, size_t np, int64_t P, td_dtype dt,
                            td_tensor **out, double *own_s) {
  uint64_t t0 = td__now_ns();
  td_tensor *flat = NULL;
  TD_TRY(td_tensor_zeros(&P, 1, dt, td_device_cpu(), &flat));
  char *p = td_tensor_data(flat);
  size_t es = td_dtype_size(dt);
  td_status st = TD_OK;
  for (size_t i = 0; st == TD_OK && i < np; i++) {
    size_t nb = (size_t)td_tensor_numel(params[i]) * es;
    td_tensor *g = td_tensor_grad(params[i]);
    if (g && (td_tensor_dtype(g) != dt || td_tensor_numel(g) != td_tensor_numel(params[i])))
      st = td_set_error(TD_ERR_DTYPE, "fault-tolerant step: parameter %zu's .grad does not "
                        "match it", i);
    else if (g && td_tensor_is_contiguous(g))
      memcpy(p, td_tensor_data(g), nb);
    else if (g) {
      td_tensor *c = NULL;
      st = td_tensor_contiguous(g, &c);
      if (st == TD_OK) memcpy(p, td_tensor_data(c), nb);
      td_tensor_unref(c);
    }
    td_tensor_unref(g);
    p += nb;
  }
  if (st != TD_OK) {
    td_tensor_unref(flat);
    return st;
  }
  *out = flat;
  td__ft_own(own_s, t0);
  return TD_OK;
}

int td__ft_reassign(td_process_group *pg, int *owner, int M, td_tensor **grad, char *msg,
                    size_t n, size_t *len) {
  int *load = td__calloc((size_t)pg->size, sizeof *load), moved = 0;
  if (!load) return -1;
  for (int s = 0; s < M; s++) {
    int g = td__ft_group_rank(pg, owner[s]);
    if (g >= 0) load[g]++;
  }
  for (int s = 0; s < M; s++) {
    if (td__ft_group_rank(pg, owner[s]) >= 0) continue;
    int best = 0;
    for (int g = 1; g < pg->size; g++)
      if (load[g] < load[best]) best = g;
    load[best]++;
    owner[s] = pg->ranks[best];
    if (grad) { /* a stale member's copy, if any: recomputed anyway */
      td_tensor_unref(grad[s]);
      grad[s] = NULL;
    }
    char who[160];
    *len = td__ft_say(msg, n, *len, "%sshard %d -> %s", moved ? ", " : "; re-sharded: ", s,
                      td__pg_who(pg, best, who, sizeof who));
    moved++;
  }
  td__free(load);
  return moved;
}

/* ---- moving state between members ---- */

#define PACK_BYTES ((size_t)8 << 20) /* the staging piece of td__ft_bcast_packed */
#define ALONE_BYTES ((size_t)256 << 10) /* a tensor this large goes alone: a broadcast's fixed
                                           cost is less than copying it in and out of a piece */

td_status td__ft_bcast_packed(td_process_group *pg, td_tensor *const *ts, size_t n, int root,
                              int64_t *bytes) {
  td_tensor *stage[2] = {NULL, NULL}; /* float32 and float64 pieces (bytes, as a broadcast) */
  td_status st = TD_OK;
  bool giver = td_process_group_rank(pg) == root;
  for (size_t i = 0; st == TD_OK && i < n;) {
    size_t nb = td_tensor_nbytes(ts[i]), es = td_dtype_size(td_tensor_dtype(ts[i]));
    if (nb >= ALONE_BYTES || !td_tensor_is_contiguous(ts[i]) || (es != 4 && es != 8)) {
      if (bytes) *bytes += (int64_t)nb;
      st = td_process_group_broadcast(pg, ts[i], root); /* large enough alone */
      i++;
      continue;
    }
    /* a run of small contiguous tensors of one element size, packed into one piece */
    size_t j = i, used = 0;
    while (j < n && td_tensor_is_contiguous(ts[j]) &&
           td_dtype_size(td_tensor_dtype(ts[j])) == es &&
           td_tensor_nbytes(ts[j]) < ALONE_BYTES && used + td_tensor_nbytes(ts[j]) <= PACK_BYTES)
      used += td_tensor_nbytes(ts[j++]);
    td_tensor **sp = &stage[es == 8], *piece = NULL;
    if (!*sp) {
      int64_t cap = (int64_t)(PACK_BYTES / es);
      st = td_tensor_empty(&cap, 1, es == 8 ? TD_DTYPE_F64 : TD_DTYPE_F32, td_device_cpu(), sp);
    }
    if (st == TD_OK) st = td_tensor_narrow(*sp, 0, 0, (int64_t)(used / es), &piece);
    char *p = piece ? td_tensor_data(piece) : NULL;
    size_t off = 0;
    for (size_t k = i; st == TD_OK && giver && k < j; k++) {
      memcpy(p + off, td_tensor_data(ts[k]), td_tensor_nbytes(ts[k]));
      off += td_tensor_nbytes(ts[k]);
    }
    if (st == TD_OK) st = td_process_group_broadcast(pg, piece, root);
    off = 0;
    for (size_t k = i; st == TD_OK && k < j; k++) {
      if (!giver) memcpy(td_tensor_data(ts[k]), p + off, td_tensor_nbytes(ts[k]));
      off += td_tensor_nbytes(ts[k]);
    }
    if (st == TD_OK && bytes) *bytes += (int64_t)used;
    td_tensor_unref(piece);
    i = j;
  }
  td_tensor_unref(stage[0]);
  td_tensor_unref(stage[1]);
  return st;
}
