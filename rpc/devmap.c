/* devmap.c - RPC device maps (td_rpc_options.device_maps, PyTorch's set_device_map semantics):
 * published and checked at rendezvous, immutable afterwards.
 *
 * Every worker publishes devmap/<r> = "<its CUDA device count>\n" followed by one line
 * "worker\tfrom\tto\n" per entry of its td_rpc_options.device_maps, as given (NULL strings become
 * "", tabs and newlines '?'). After the join barrier every worker reads every record and checks
 * all maps in rank order and entry order, so all of them find the same first error and fail with
 * the same message. Each then keeps its own map toward every peer (for its requests) and the
 * inverse of every peer's map toward itself (for its replies to that peer). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent_state.h"
#include "tdist/tensor.h"

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *q = td__realloc(b->p, cap);
    if (!q) {
      b->oom = true;
      return;
    }
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

/* Appends s (NULL: "") with tabs and newlines replaced, then end. */
static void sb_field(sbuf *b, const char *s, char end) {
  for (const char *q = s ? s : ""; *q; q++) sb_put(b, *q == '\t' || *q == '\n' ? "?" : q, 1);
  sb_put(b, &end, 1);
}

td_status td__devmap_record(td_rpc_agent *a, char key[64], char **val, size_t *n) {
  sbuf b = {0};
  char head[32];
  int hn = snprintf(head, sizeof head, "%d\n", td_cuda_device_count());
  sb_put(&b, head, (size_t)hn);
  for (int i = 0; i < a->opts.num_device_maps; i++) {
    const td_rpc_device_map_entry *e = &a->opts.device_maps[i];
    sb_field(&b, e->worker, '\t');
    sb_field(&b, e->from, '\t');
    sb_field(&b, e->to, '\n');
  }
  if (b.oom) {
    td__free(b.p);
    return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  }
  snprintf(key, 64, "devmap/%d", a->rank);
  *val = b.p;
  *n = b.n;
  return TD_OK;
}

static td_status devmap_add(td__devmap *m, td_device from, td_device to) {
  td__devmap_entry *e = td__realloc(m->e, (size_t)(m->n + 1) * sizeof *e);
  if (!e) return td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  m->e = e;
  m->e[m->n++] = (td__devmap_entry){from, to};
  return TD_OK;
}

/* Checks one entry of rank q's map (line `line`, entry number i) and adds it to maps[dest]
 * (*dest_out = dest). counts: every rank's CUDA device count. */
static td_status devmap_entry(td_rpc_agent *a, int q, int i, char *line, const int *counts,
                              td__devmap *maps, int *dest_out) {
  char *from = strchr(line, '\t'), *to = from ? strchr(from + 1, '\t') : NULL;
  if (!from || !to)
    return td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", q);
  *from++ = 0;
  *to++ = 0;
  const char *worker = line, *qn = a->peers[q].info.name;
  char where[700];
  snprintf(where, sizeof where, "rpc init: device map of %s (rank %d), entry %d {\"%.128s\", "
           "\"%.64s\", \"%.64s\"}", qn, q, i, worker, from, to);
  int dest = td__agent_rank_of(a, worker);
  *dest_out = dest;
  if (dest < 0)
    return td_set_error(TD_ERR_INVALID, "%s: there is no worker named '%.128s'", where, worker);
  if (dest == q)
    return td_set_error(TD_ERR_INVALID, "%s: a worker cannot map devices to itself (calls to "
                        "self share their tensors)", where);
  const char *dn = a->peers[dest].info.name;
  td_device f, t;
  if (td_device_parse(from, &f) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "%s: local device '%.64s' is malformed (use cpu, cuda or "
                        "cuda:N)", where, from);
  if (td_device_parse(to, &t) != TD_OK)
    return td_set_error(TD_ERR_INVALID, "%s: remote device '%.64s' is malformed (use cpu, cuda or "
                        "cuda:N)", where, to);
  /* the map's shape first (it does not depend on the machines), then whether the devices exist */
  td__devmap *m = &maps[dest];
  char b1[32], b2[32], b3[32];
  for (int k = 0; k < m->n; k++) {
    bool same_from = td_device_equal(m->e[k].from, f), same_to = td_device_equal(m->e[k].to, t);
    if (same_from && same_to) return TD_OK; /* given twice */
    if (same_from)
      return td_set_error(TD_ERR_INVALID, "%s: %s is already mapped to %s on %s", where,
                          td_device_str(f, b1, sizeof b1),
                          td_device_str(m->e[k].to, b2, sizeof b2), dn);
    if (same_to)
      return td_set_error(TD_ERR_INVALID, "%s: %s and %s both map to %s on %s, so replies from %s "
                          "could not be mapped back", where,
                          td_device_str(m->e[k].from, b1, sizeof b1),
                          td_device_str(f, b2, sizeof b2), td_device_str(t, b3, sizeof b3), dn,
                          dn);
  }
  if (f.type == TD_DEVICE_CUDA && f.index >= counts[q])
    return td_set_error(TD_ERR_DEVICE, "%s: local device cuda:%d does not exist on %s (it has %d "
                        "CUDA devices)", where, f.index, qn, counts[q]);
  if (t.type == TD_DEVICE_CUDA && t.index >= counts[dest])
    return td_set_error(TD_ERR_DEVICE, "%s: remote device cuda:%d does not exist on %s (it has %d "
                        "CUDA devices)", where, t.index, dn, counts[dest]);
  return devmap_add(m, f, t);
}

/* Reads every worker's record, checks every map, keeps this worker's maps (see above). */
td_status td__devmap_setup(td_rpc_agent *a, uint64_t deadline) {
  int w = a->world0; /* (workers that join later have no device maps) */
  char **recs = NULL;
  size_t *lens = NULL;
  TD_TRY(td__rdv_read_all(a, "devmap/", deadline, &recs, &lens));
  int *counts = td__calloc((size_t)w, sizeof *counts);
  td__devmap *maps = td__calloc((size_t)w, sizeof *maps);
  /* the ranks rank q's map names (touched[0..nt), mark[r] = q + 1 once listed): only those are
   * visited, so a group without device maps costs O(world) here, not O(world^2) per worker */
  int *touched = td__calloc((size_t)w, sizeof *touched);
  int *mark = td__calloc((size_t)w, sizeof *mark);
  td_status st = counts && maps && touched && mark
                     ? TD_OK
                     : td_set_error(TD_ERR_NOMEM, "rpc init: out of memory");
  for (int r = 0; r < w && st == TD_OK; r++) {
    char *end;
    long c = strtol(recs[r], &end, 10);
    if (*end != '\n' || c < 0 || c > TD__MAX_CUDA_INDEX + 1) {
      st = td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", r);
      break;
    }
    counts[r] = (int)c;
  }
  for (int q = 0; q < w && st == TD_OK; q++) {
    char *line = strchr(recs[q], '\n') + 1;
    int nt = 0;
    for (int i = 0; *line && st == TD_OK; i++) {
      char *nl = strchr(line, '\n');
      if (!nl) {
        st = td_set_error(TD_ERR_FORMAT, "rpc init: bad device map record of rank %d", q);
        break;
      }
      *nl = 0;
      int dest = -1;
      st = devmap_entry(a, q, i, line, counts, maps, &dest);
      if (dest >= 0 && dest < w && mark[dest] != q + 1) {
        mark[dest] = q + 1;
        touched[nt++] = dest;
      }
      line = nl + 1;
    }
    for (int j = 0; j < nt; j++) {
      int r = touched[j];
      if (st == TD_OK && q == a->rank) {
        a->peers[r].out_map = maps[r]; /* moved */
      } else if (st == TD_OK && r == a->rank) {
        td__devmap *rm = &a->peers[q].reply_map;
        for (int k = 0; k < maps[r].n && st == TD_OK; k++)
          st = devmap_add(rm, maps[r].e[k].to, maps[r].e[k].from);
        td__free(maps[r].e);
      } else {
        td__free(maps[r].e);
      }
      maps[r] = (td__devmap){0};
    }
  }
  td__rdv_free_all(a, recs, lens);
  td__free(counts);
  td__free(maps);
  td__free(touched);
  td__free(mark);
  if (st == TD_OK && a->opts.num_device_maps)
    td_log(TD_LOG_DEBUG, "rpc: %s: %d device map entries checked", a->name,
           a->opts.num_device_maps);
  return st;
}

void td__devmap_free_all(td_rpc_agent *a) {
  for (int r = 0; a->peers && r < a->world; r++) {
    td__free(a->peers[r].out_map.e);
    td__free(a->peers[r].reply_map.e);
    a->peers[r].out_map = a->peers[r].reply_map = (td__devmap){0};
  }
}
