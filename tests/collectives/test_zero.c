/* test_zero.c - ZeRO stages 1 and 2 across 3 real processes: 10 AdamW steps with two parameter
 * groups (decay on the weights only) and gradient clipping give, on every member, the
 * parameters of a single process that averages the members' gradients, clips and steps the
 * same optimizer (float64, 1e-10); each member's optimizer holds only its shard (the shards
 * cut through parameters: 66 elements in 3 shards of 22); stage 1 leaves the group-average
 * gradients in .grad, stage 2 clears them; stage 2 overlapped with backward (buckets
 * reduce_scattered from gradient hooks) gives the parameters of stage 2 after backward (1e-10),
 * keeps at most one full gradient through backward, starts every bucket from a hook, and reduces
 * gradients that come after their bucket started (two backward passes) at the step; a member with
 * other parameters is refused on every member; invalid options are refused before any
 * collective. Checkpoints: 3 members train 4 steps and save their shards; the shards consolidate
 * (in any order; a missing or repeated rank, or a shard missing state, is refused) into a file whose parameters are the
 * model's; 2 members load the consolidated file, 1 member the 3 shard files, and 4 more steps
 * match a process that never stopped (1e-10); a td_zero over other shapes refuses the file.
 * With TD_ZERO_CKPT_DIR the files stay there for check_zero_ckpt.py (PyTorch).
 * Stage 3 with activation checkpointing (2 members, a tiny GPT whose blocks are the units): every
 * block checkpointed (float64 and float32), every attention core, or the whole stack of blocks
 * as one region (whose recompute gathers each unit in its pre-forward hook, the units' identity
 * nodes being then inside the region): 3 steps give the plain GPT's parameters bit for bit, with
 * as many unit gathers and prefetches as without checkpointing. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "coll_test_util.h"
#include "tdist/autograd.h"
#include "test_util.h"

enum { WORLD = 3, STEPS = 10 };
#define LR 0.05
#define DECAY 0.1
#define MAX_NORM 0.1

/* 5 -> 7 -> tanh -> 3: W1 35, b1 7, W2 21, b2 3 = 66 elements */
static td_module *build(uint64_t seed, bool other) {
  MP_CHECK_OK(td_nn_manual_seed(seed));
  td_module *seq = NULL, *l1 = NULL, *act = NULL, *l2 = NULL;
  MP_CHECK_OK(td_sequential_create(&seq));
  MP_CHECK_OK(td_linear_create(5, other ? 6 : 7, true, NULL, &l1));
  MP_CHECK_OK(td_tanh_create(&act));
  MP_CHECK_OK(td_linear_create(other ? 6 : 7, 3, true, NULL, &l2));
  MP_CHECK_OK(td_sequential_append(seq, l1));
  MP_CHECK_OK(td_sequential_append(seq, act));
  MP_CHECK_OK(td_sequential_append(seq, l2));
  td_module_unref(l1);
  td_module_unref(act);
  td_module_unref(l2);
  MP_CHECK_OK(td_module_to_dtype(seq, TD_DTYPE_F64));
  return seq;
}

static void backward_on(td_module *m, int data_rank, int step) {
  int64_t xs[2] = {8, 5}, ys[2] = {8, 3};
  uint64_t seed = 1000 * (uint64_t)step + (uint64_t)data_rank;
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 77 + seed, false);
  td_tensor *y = td_test_randn(ys, 2, TD_DTYPE_F64, 99 + seed, false);
  td_tensor *out = NULL, *loss = NULL;
  MP_CHECK_OK(td_module_forward(m, x, &out));
  MP_CHECK_OK(td_tensor_mse_loss(out, y, TD_REDUCTION_MEAN, &loss));
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(out);
  td_tensor_unref(loss);
}

/* weights (decay) and biases (none), as GPT recipes group them */
static void groups_of(td_tensor_list *p, td_tensor **w, td_tensor **b, td_optim_group g[2]) {
  w[0] = p->tensors[0], w[1] = p->tensors[2];
  b[0] = p->tensors[1], b[1] = p->tensors[3];
  td_optim_group_init(&g[0], w, 2);
  g[0].weight_decay = DECAY;
  td_optim_group_init(&g[1], b, 2);
  g[1].weight_decay = 0.0;
}

static void adamw(td_optim_options *o) {
  td_optim_options_init(o, TD_OPTIM_ADAMW);
  o->lr = LR;
}

static bool close_to(const td_tensor *a, const td_tensor *b) {
  bool ok = false;
  MP_CHECK_OK(td_tensor_allclose(a, b, 1e-10, 1e-12, &ok));
  return ok;
}

/* The reference step: the average of data ranks [0, data_world)'s gradients, clipped, one
 * optimizer step in one process. avg (may be NULL) receives copies of the averaged gradients.
 * Returns the global norm. */
static double ref_step(td_module *ref, td_optim *ropt, td_tensor_list *pr, int data_world,
                       int step, td_tensor **avg) {
  td_optim_zero_grad(ropt);
  for (int d = 0; d < data_world; d++) backward_on(ref, d, step);
  for (size_t i = 0; i < pr->n; i++) {
    td_tensor *gr = td_tensor_grad(pr->tensors[i]);
    MP_CHECK(gr != NULL);
    MP_CHECK_OK(td_tensor_mul_scalar_(gr, 1.0 / data_world));
    if (avg) MP_CHECK_OK(td_tensor_clone(gr, &avg[i]));
    td_tensor_unref(gr);
  }
  double total = 0;
  MP_CHECK_OK(td_optim_clip_grad_norm(ropt, MAX_NORM, 2.0, &total));
  MP_CHECK(total > MAX_NORM); /* the clipping is exercised */
  MP_CHECK_OK(td_optim_step(ropt));
  return total;
}

/* A td_zero over the groups of pm (AdamW, clipping); per_param: a bucket per parameter, else
 * the default bucket size (one bucket for these 66 elements). */
static td_zero *zero_over(td_process_group *pg, td_tensor_list *pm, int stage, bool overlap,
                          bool per_param) {
  td_tensor *w[2], *b[2];
  td_optim_group g[2];
  groups_of(pm, w, b, g);
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = stage;
  zo.max_grad_norm = MAX_NORM;
  zo.overlap = overlap;
  if (per_param) zo.bucket_bytes = zo.first_bucket_bytes = 1;
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &z));
  return z;
}

/* Every element of the 66 is owned by exactly one member. Collective. */
static void owned_once(td_process_group *pg, int64_t owned) {
  int64_t one = 1;
  td_tensor *sum = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(&owned, &one, 1, TD_DTYPE_I64, &sum));
  MP_CHECK_OK(td_process_group_all_reduce(pg, sum, TD_REDUCE_SUM));
  MP_CHECK(*(const int64_t *)td_tensor_data(sum) == 66);
  td_tensor_unref(sum);
}

/* One run of `stage` (after backward) against the single-process reference; per_param: a bucket
 * per parameter in the flat order, else one bucket. */
static void run_stage(td_process_group *pg, int rank, int stage, bool per_param) {
  td_module *m = build(1000 + (uint64_t)rank, false), *ref = build(1000, false);
  td_tensor_list pm, pr;
  td_tensor_list_init(&pm);
  td_tensor_list_init(&pr);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  MP_CHECK_OK(td_module_parameters(ref, &pr));
  MP_CHECK(pm.n == 4 && pr.n == 4);
  td_tensor *rw[2], *rb[2];
  td_optim_group rg[2];
  groups_of(&pr, rw, rb, rg);
  td_optim_options o;
  adamw(&o);
  td_zero *z = zero_over(pg, &pm, stage, false, per_param);
  td_optim *ropt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&o, rg, 2, &ropt));

  /* the flat order is the groups' order: W1 W2 | b1 b2 = 35 + 21 + 7 + 3; shards of 22 in one
   * bucket; per parameter, chunks of 12 + 7 + 3 + 1 (the last member owns 11 + 7 + 1 + 1) */
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.stage == stage && zs.numel == 66 && zs.buckets == (per_param ? 4u : 1u));
  MP_CHECK(zs.shard_numel == (per_param ? 23 : 22));
  MP_CHECK(zs.owned_numel == (per_param ? (rank == 2 ? 20 : 23) : 22));
  static const size_t pieces[WORLD] = {1, 2, 3}; /* W1 | W1 W2 | W2 b1 b2 */
  if (zs.optim_params != (per_param ? 4 : pieces[rank])) {
    fprintf(stderr, "[rank %d] the local optimizer holds %zu pieces, want %zu\n", rank,
            zs.optim_params, per_param ? 4 : pieces[rank]);
    MP_CHECK(0);
  }
  owned_once(pg, zs.owned_numel);

  for (int step = 0; step < STEPS; step++) {
    td_zero_zero_grad(z);
    backward_on(m, rank, step);
    MP_CHECK_OK(td_zero_step(z));

    td_tensor *avg[4] = {0};
    double total = ref_step(ref, ropt, &pr, WORLD, step, avg);
    MP_CHECK_OK(td_zero_get_stats(z, &zs));
    MP_CHECK(zs.steps == (uint64_t)step + 1);
    if (!(fabs(zs.last_grad_norm - total) <= 1e-10 * total)) {
      fprintf(stderr, "[rank %d] step %d: global norm %.17g, want %.17g\n", rank, step,
              zs.last_grad_norm, total);
      MP_CHECK(0);
    }
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(pm.tensors[i], pr.tensors[i])) {
        fprintf(stderr, "[rank %d] stage %d step %d: parameter %s differs from DDP + AdamW\n",
                rank, stage, step, pm.names[i]);
        MP_CHECK(0);
      }
      td_tensor *gm = td_tensor_grad(pm.tensors[i]);
      if (stage == 1) { /* the group average, clipped as torch's clip_grad_norm_ leaves it */
        MP_CHECK_OK(td_tensor_mul_scalar_(avg[i], MAX_NORM / (total + 1e-6)));
        MP_CHECK(gm != NULL && close_to(gm, avg[i]));
      } else {
        MP_CHECK(gm == NULL); /* stage 2 keeps no full gradient */
      }
      td_tensor_unref(gm);
      td_tensor_unref(avg[i]);
    }
  }
  td_zero_destroy(z);
  td_optim_destroy(ropt);
  td_tensor_list_fini(&pm);
  td_tensor_list_fini(&pr);
  td_module_unref(m);
  td_module_unref(ref);
}

/* Parameters with a .grad (overlap keeps at most the last one hooked until the step). */
static int grads_held(td_tensor_list *p) {
  int n = 0;
  for (size_t i = 0; i < p->n; i++) {
    td_tensor *g = td_tensor_grad(p->tensors[i]);
    n += g != NULL;
    td_tensor_unref(g);
  }
  return n;
}

/* Stage 2 with overlap against stage 2 after backward: the same parameters (1e-10) and global
 * norms at every step. twice: two backward passes per step (the second one's gradients all come
 * after their buckets started, so every bucket is reduced again at the step); else one pass with
 * the module's parameters reversed as the gradient order. One bucket per parameter. */
static void run_overlap(td_process_group *pg, int rank, bool twice) {
  td_module *ma = build(1000 + (uint64_t)rank, false), *mo = build(1000 + (uint64_t)rank, false);
  td_tensor_list pa, po;
  td_tensor_list_init(&pa);
  td_tensor_list_init(&po);
  MP_CHECK_OK(td_module_parameters(ma, &pa));
  MP_CHECK_OK(td_module_parameters(mo, &po));
  td_tensor *w[2], *b[2], *ow[2], *ob[2], *rev[4];
  td_optim_group g[2], og[2];
  groups_of(&pa, w, b, g);
  groups_of(&po, ow, ob, og);
  for (size_t i = 0; i < 4; i++) rev[i] = po.tensors[3 - i];
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.max_grad_norm = MAX_NORM;
  td_zero *za = NULL, *zv = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &za));
  MP_CHECK(td_zero_prepare(za) == TD_ERR_STATE); /* created without overlap */
  zo.overlap = true;
  zo.bucket_bytes = zo.first_bucket_bytes = 1; /* a bucket per parameter */
  if (!twice) zo.grad_order = rev, zo.n_grad_order = 4;
  if (!twice) zo.max_inflight_bytes = 1; /* wait for every started bucket before a new one */
  MP_CHECK_OK(td_zero_create(pg, &o, og, 2, &zo, &zv));
  td_zero_stats sa, sv;
  MP_CHECK_OK(td_zero_get_stats(zv, &sv));
  /* W1 35, b1 7, W2 21, b2 3 elements in parts of 12 + 3 + 7 + 1 */
  MP_CHECK(sv.buckets == 4 && sv.numel == 66 && sv.shard_numel == 23);
  owned_once(pg, sv.owned_numel);
  for (int step = 0; step < STEPS; step++) {
    backward_on(ma, rank, step);
    if (twice) backward_on(ma, rank, step + 100);
    MP_CHECK_OK(td_zero_step(za));
    MP_CHECK_OK(td_zero_prepare(zv));
    MP_CHECK(td_zero_prepare(zv) == TD_ERR_STATE);
    backward_on(mo, rank, step);
    if (!twice) MP_CHECK(grads_held(&po) <= 1); /* no full gradient kept but the last one */
    if (twice) backward_on(mo, rank, step + 100);
    MP_CHECK_OK(td_zero_step(zv));
    MP_CHECK(grads_held(&po) == 0);
    MP_CHECK_OK(td_zero_get_stats(za, &sa));
    MP_CHECK_OK(td_zero_get_stats(zv, &sv));
    if (!(fabs(sa.last_grad_norm - sv.last_grad_norm) <= 1e-10 * sa.last_grad_norm)) {
      fprintf(stderr, "[rank %d] step %d: global norm %.17g with overlap, %.17g without\n", rank,
              step, sv.last_grad_norm, sa.last_grad_norm);
      MP_CHECK(0);
    }
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(po.tensors[i], pa.tensors[i])) {
        fprintf(stderr, "[rank %d] step %d%s: parameter %s differs with overlap\n", rank, step,
                twice ? " (two passes)" : "", po.names[i]);
        MP_CHECK(0);
      }
    }
  }
  MP_CHECK(sv.passes_overlapped == STEPS && sv.steps == STEPS);
  MP_CHECK(sv.bytes_reduced > 0);
  if (twice) {
    MP_CHECK(sv.late_buckets == 4 * STEPS && sv.waits_for_room == 0);
    MP_CHECK(sv.peak_bucket_bytes > 0 && sv.peak_bucket_bytes <= 69 * 8);
  } else {
    MP_CHECK(sv.late_buckets == 0);
    MP_CHECK(sv.bytes_started_in_backward * 2 >= sv.bytes_reduced);
    /* buffers of 36 + 9 + 21 + 3 doubles; a step's worth of buckets reduced */
    /* max_inflight_bytes: never two buffers alive, the largest being 36 doubles */
    MP_CHECK(sv.peak_bucket_bytes > 0 && sv.peak_bucket_bytes <= 36 * 8);
    MP_CHECK(sv.waits_for_room > 0);
    MP_CHECK(sv.bytes_reduced == (uint64_t)STEPS * 69 * 8);
  }
  td_zero_destroy(za);
  td_zero_destroy(zv);
  td_tensor_list_fini(&pa);
  td_tensor_list_fini(&po);
  td_module_unref(ma);
  td_module_unref(mo);
}

/* Stage 3 with each Linear a unit (in one bucket, or with prefetch in a bucket per parameter)
 * against the single-process reference: the same parameters
 * (1e-10) and global norms at every step; between steps the units' parameters have no memory;
 * a forward gathers one unit at a time (the other is freed before or prefetched into a buffer)
 * and 4 gathers run per step, 2 of them prefetched; an evaluation forward without autograd
 * gives the reference's output; its checkpoint resumes at stages 3 and 2. */
static void run_stage3(td_process_group *pg, int rank, bool prefetch) {
  td_module *m = build(1000 + (uint64_t)rank, false), *ref = build(1000, false);
  td_tensor_list pm, pr;
  td_tensor_list_init(&pm);
  td_tensor_list_init(&pr);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  MP_CHECK_OK(td_module_parameters(ref, &pr));
  td_tensor *w[2], *b[2], *rw[2], *rb[2];
  td_optim_group g[2], rg[2];
  groups_of(&pm, w, b, g);
  groups_of(&pr, rw, rb, rg);
  td_optim_options o;
  adamw(&o);
  td_module *units[2] = {td_module_child(m, "0"), td_module_child(m, "2")};
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = 3;
  zo.max_grad_norm = MAX_NORM;
  zo.units = units;
  zo.n_units = 2;
  zo.no_prefetch = !prefetch;
  if (prefetch) zo.bucket_bytes = 1; /* a bucket per parameter: two per unit */
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &z));
  td_optim *ropt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&o, rg, 2, &ropt));
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.stage == 3 && zs.units == 2 && zs.buckets == (prefetch ? 4u : 2u) && zs.overlap);
  owned_once(pg, zs.owned_numel);
  for (size_t i = 0; i < 4; i++) MP_CHECK(td_tensor_data(pm.tensors[i]) == NULL); /* freed */

  for (int step = 0; step < STEPS; step++) {
    MP_CHECK_OK(td_zero_prepare(z));
    backward_on(m, rank, step);
    MP_CHECK_OK(td_zero_step(z));
    double total = ref_step(ref, ropt, &pr, WORLD, step, NULL);
    MP_CHECK_OK(td_zero_get_stats(z, &zs));
    if (!(fabs(zs.last_grad_norm - total) <= 1e-10 * total)) {
      fprintf(stderr, "[rank %d] stage 3 step %d: global norm %.17g, want %.17g\n", rank, step,
              zs.last_grad_norm, total);
      MP_CHECK(0);
    }
    for (size_t i = 0; i < 4; i++) {
      MP_CHECK(td_tensor_data(pm.tensors[i]) == NULL); /* no full parameter between steps */
      td_tensor *gm = td_tensor_grad(pm.tensors[i]);
      MP_CHECK(gm == NULL);
    }
    MP_CHECK_OK(td_zero_gather_params(z));
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(pm.tensors[i], pr.tensors[i])) {
        fprintf(stderr, "[rank %d] stage 3%s step %d: parameter %s differs from DDP + AdamW\n",
                rank, prefetch ? "" : " (no prefetch)", step, pm.names[i]);
        MP_CHECK(0);
      }
    }
    MP_CHECK_OK(td_zero_release_params(z));
    MP_CHECK(td_tensor_data(pm.tensors[0]) == NULL);
  }
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.steps == STEPS && zs.passes_overlapped == STEPS);
  /* per step 2 gathers in forward and 2 in backward, plus one per unit for each inspection */
  MP_CHECK(zs.unit_gathers == (uint64_t)STEPS * 6);
  MP_CHECK(zs.prefetched == (prefetch ? (uint64_t)STEPS * 2 : 0));
  /* W1 + b1 = 42 doubles, W2 + b2 = 24: both at once only when inspecting (after the loop the
   * peak includes those) */
  MP_CHECK(zs.peak_unit_bytes == 66 * 8);

  /* a stage-3 checkpoint resumes at stage 3 and at stage 2: one more step on each ends where
   * this td_zero's does (the shard files name no layout; the freed units load from segments) */
  if (prefetch) {
    char dir[64], prefix[96], paths[WORLD][160];
    snprintf(dir, sizeof dir, "/tmp/td_zero3_%d", (int)getppid()); /* the same for all members */
    MP_CHECK(mkdir(dir, 0700) == 0 || errno == EEXIST);
    snprintf(prefix, sizeof prefix, "%s/ck", dir);
    MP_CHECK_OK(td_zero_save(z, prefix));
    const char *shards[WORLD];
    for (int r = 0; r < WORLD; r++) {
      MP_CHECK_OK(td_zero_shard_path(prefix, r, WORLD, paths[r], sizeof paths[r]));
      shards[r] = paths[r];
    }
    for (int stage = 3; stage >= 2; stage--) {
      td_module *m2 = build(7, false);
      td_tensor_list p2;
      td_tensor_list_init(&p2);
      MP_CHECK_OK(td_module_parameters(m2, &p2));
      td_tensor *w2[2], *b2[2];
      td_optim_group g2[2];
      groups_of(&p2, w2, b2, g2);
      td_module *units2[2] = {td_module_child(m2, "0"), td_module_child(m2, "2")};
      td_zero_options z2o = zo;
      z2o.stage = stage;
      z2o.units = stage == 3 ? units2 : NULL;
      z2o.n_units = stage == 3 ? 2 : 0;
      z2o.overlap = true;
      td_zero *z2 = NULL;
      MP_CHECK_OK(td_zero_create(pg, &o, g2, 2, &z2o, &z2));
      MP_CHECK_OK(td_zero_load(z2, shards, WORLD));
      MP_CHECK_OK(td_zero_prepare(z2));
      backward_on(m2, rank, STEPS + 1);
      MP_CHECK_OK(td_zero_step(z2));
      MP_CHECK_OK(td_zero_gather_params(z2));
      if (stage == 3) { /* the original takes the same step once */
        MP_CHECK_OK(td_zero_prepare(z));
        backward_on(m, rank, STEPS + 1);
        MP_CHECK_OK(td_zero_step(z));
        MP_CHECK_OK(td_zero_gather_params(z));
        ref_step(ref, ropt, &pr, WORLD, STEPS + 1, NULL); /* and the reference */
      }
      for (size_t i = 0; i < 4; i++)
        if (!close_to(p2.tensors[i], pm.tensors[i])) {
          fprintf(stderr, "[rank %d] resumed at stage %d: parameter %s differs\n", rank, stage,
                  p2.names[i]);
          MP_CHECK(0);
        }
      td_zero_destroy(z2);
      td_tensor_list_fini(&p2);
      td_module_unref(m2);
    }
    MP_CHECK_OK(td_zero_release_params(z));
    MP_CHECK_OK(td_process_group_barrier(pg)); /* every member has read the shards */
    if (rank == 0) {
      for (int r = 0; r < WORLD; r++) unlink(paths[r]);
      rmdir(dir);
    }
  }

  /* evaluation: a forward with autograd off gathers and frees again */
  int64_t xs[2] = {4, 5};
  td_tensor *x = td_test_randn(xs, 2, TD_DTYPE_F64, 4242, false), *y = NULL, *yr = NULL;
  bool prev = td_autograd_set_enabled(false);
  MP_CHECK_OK(td_module_forward(m, x, &y));
  MP_CHECK_OK(td_module_forward(ref, x, &yr));
  td_autograd_set_enabled(prev);
  MP_CHECK(close_to(y, yr));
  MP_CHECK(td_tensor_data(pm.tensors[2]) == NULL);
  td_tensor_unref(x);
  td_tensor_unref(y);
  td_tensor_unref(yr);
  td_tensor *kept = NULL;
  MP_CHECK_OK(td_zero_gather_params(z)); /* the trained values stay in the module */
  MP_CHECK_OK(td_tensor_clone(pm.tensors[3], &kept));
  td_zero_destroy(z);
  MP_CHECK(close_to(pm.tensors[3], kept));
  td_tensor_unref(kept);
  td_optim_destroy(ropt);
  td_tensor_list_fini(&pm);
  td_tensor_list_fini(&pr);
  td_module_unref(m);
  td_module_unref(ref);
}

/* ---- stage 3: a unit with more outputs than any fixed table ---- */

enum { FAN = 40 }; /* outputs of the unit: more than the 16 wrap_outputs once handled */

/* Fan: outputs[i] = x * w[i] for a 2-element input x and a FAN-element parameter w. */
static td_status fan_forward(td_module *self, td_tensor *const *inputs, int n_inputs,
                             td_tensor **outputs, int n_outputs) {
  if (n_inputs != 1 || n_outputs != FAN)
    return td_set_error(TD_ERR_INVALID, "Fan: 1 input and %d outputs", FAN);
  td_tensor *w = NULL;
  td_status st = td_module_get_parameter(self, "w", &w);
  if (st != TD_OK) return st;
  int i = 0;
  for (; st == TD_OK && i < FAN; i++) {
    td_tensor *wi = NULL;
    st = td_tensor_narrow(w, 0, i, 1, &wi);
    if (st == TD_OK) st = td_tensor_mul(inputs[0], wi, &outputs[i]);
    td_tensor_unref(wi);
  }
  if (st != TD_OK)
    for (int k = 0; k < i - 1; k++) td_tensor_unref(outputs[k]), outputs[k] = NULL;
  td_tensor_unref(w);
  return st;
}

static const td_module_type fan_type = {"Fan", fan_forward, NULL};

/* Every output of a 40-output unit goes through the unit's gather in backward (the x gradient
 * reads w, which is freed between forward and backward), and one SGD step matches the formula:
 * loss = sum_i (i + 1) * sum(x * w[i]) with x = [rank + 1, 1] gives dw[i] = (i + 1)(rank + 2),
 * averaged over the members, and dx = sum_i (i + 1) w[i] in both entries. */
static void run_stage3_many_outputs(td_process_group *pg, int rank, int world) {
  td_module *fan = NULL;
  MP_CHECK_OK(td_module_create(&fan_type, NULL, &fan));
  int64_t wn = FAN, xn = 2;
  td_tensor *w = NULL;
  MP_CHECK_OK(td_tensor_full(&wn, 1, 0.0, TD_DTYPE_F64, td_device_cpu(), &w));
  double *wd = td_tensor_data(w), w0[FAN];
  for (int i = 0; i < FAN; i++) wd[i] = w0[i] = 0.5 + 0.01 * i;
  MP_CHECK_OK(td_module_register_parameter(fan, "w", w));
  td_optim_options o;
  td_optim_options_init(&o, TD_OPTIM_SGD);
  o.lr = 0.1;
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = 3;
  zo.units = &fan;
  zo.n_units = 1;
  td_optim_group g;
  td_optim_group_init(&g, &w, 1);
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, &g, 1, &zo, &z));
  MP_CHECK(td_tensor_data(w) == NULL); /* freed until its forward */

  double xv[2] = {rank + 1.0, 1.0};
  td_tensor *x = NULL, *outs[FAN] = {0}, *loss = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(xv, &xn, 1, TD_DTYPE_F64, &x));
  MP_CHECK_OK(td_tensor_set_requires_grad(x, true));
  MP_CHECK_OK(td_zero_prepare(z));
  MP_CHECK_OK(td_module_forward_multi(fan, &x, 1, outs, FAN));
  MP_CHECK(td_tensor_data(w) == NULL); /* freed after it */
  for (int i = 0; i < FAN; i++) {
    const td_node *fn = td_tensor_grad_fn(outs[i]);
    if (!fn || strcmp(td_node_name(fn), "ZeroUnitGather") != 0) {
      fprintf(stderr, "[rank %d] output %d of %d: grad_fn %s, want ZeroUnitGather\n", rank, i,
              FAN, fn ? td_node_name(fn) : "(none)");
      MP_CHECK(0);
    }
    td_tensor *s = NULL, *si = NULL, *sum = NULL;
    MP_CHECK_OK(td_tensor_sum_all(outs[i], &s));
    MP_CHECK_OK(td_tensor_mul_scalar(s, i + 1.0, &si));
    if (loss) MP_CHECK_OK(td_tensor_add(loss, si, &sum));
    td_tensor_unref(loss);
    loss = sum ? sum : td_tensor_ref(si);
    td_tensor_unref(s);
    td_tensor_unref(si);
    td_tensor_unref(outs[i]);
  }
  MP_CHECK_OK(td_tensor_backward(loss));
  td_tensor *gxt = td_tensor_grad(x);
  MP_CHECK(gxt != NULL);
  const double *gx = td_tensor_data(gxt);
  double want_gx = 0;
  for (int i = 0; i < FAN; i++) want_gx += (i + 1.0) * w0[i];
  MP_CHECK(fabs(gx[0] - want_gx) <= 1e-12 * want_gx && fabs(gx[1] - want_gx) <= 1e-12 * want_gx);
  td_tensor_unref(gxt);
  MP_CHECK_OK(td_zero_step(z));
  MP_CHECK_OK(td_zero_gather_params(z));
  double mean_r2 = 0; /* the average of rank + 2 */
  for (int r = 0; r < world; r++) mean_r2 += (r + 2.0) / world;
  wd = td_tensor_data(w);
  for (int i = 0; i < FAN; i++) {
    double want = w0[i] - 0.1 * (i + 1.0) * mean_r2;
    if (fabs(wd[i] - want) > 1e-12) {
      fprintf(stderr, "[rank %d] w[%d] = %.17g after the step, want %.17g\n", rank, i, wd[i], want);
      MP_CHECK(0);
    }
  }
  MP_CHECK_OK(td_zero_release_params(z));
  td_tensor_unref(loss);
  td_tensor_unref(x);
  td_zero_destroy(z);
  td_tensor_unref(w);
  td_module_unref(fan);
}

static int worker_zero(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));

  /* options are checked before anything collective */
  td_optim_options o;
  adamw(&o);
  td_zero_options zo;
  td_zero_options_init(&zo);
  MP_CHECK(zo.stage == 2 && zo.max_grad_norm == 0);
  td_zero *z = NULL;
  zo.stage = 3;
  MP_CHECK(td_zero_create(pg, &o, NULL, 0, &zo, &z) == TD_ERR_INVALID && z == NULL);

  /* a member whose parameters differ is refused on every member */
  td_module *odd = build(5, rank == 2);
  td_tensor_list po;
  td_tensor_list_init(&po);
  MP_CHECK_OK(td_module_parameters(odd, &po));
  td_optim_group g;
  td_optim_group_init(&g, po.tensors, po.n);
  MP_CHECK(td_zero_create(pg, &o, &g, 1, NULL, &z) == TD_ERR_SHAPE && z == NULL);
  MP_CHECK(strstr(td_last_error(), "rank 2") != NULL);
  td_tensor_list_fini(&po);
  td_module_unref(odd);

  zo.stage = 1;
  zo.overlap = true; /* overlap is for stage 2 */
  MP_CHECK(td_zero_create(pg, &o, NULL, 0, &zo, &z) == TD_ERR_INVALID && z == NULL);

  run_stage(pg, rank, 1, false);
  run_stage(pg, rank, 2, false);
  run_stage(pg, rank, 1, true);
  run_stage(pg, rank, 2, true);
  run_overlap(pg, rank, false);
  run_overlap(pg, rank, true);
  run_stage3(pg, rank, true);
  run_stage3(pg, rank, false);
  run_stage3_many_outputs(pg, rank, world);
  td_process_group_destroy(pg);
  coll_leave(a);
  CHECK_NO_LEAKS();
  return 0;
}

/* ---- checkpoints: saved by 3 members, resumed by 2 and by 1 ---- */

enum { SAVE_WORLD = 3, SAVED_STEPS = 4, MORE_STEPS = 4 };

typedef struct ckpt_arg {
  char dir[400];
} ckpt_arg;

static void ckpt_file(const ckpt_arg *c, const char *name, char *buf, size_t n) {
  snprintf(buf, n, "%s/%s", c->dir, name);
}

static void shard_file(const ckpt_arg *c, int rank, char *buf, size_t n) {
  char prefix[512];
  ckpt_file(c, "ckpt", prefix, sizeof prefix);
  MP_CHECK_OK(td_zero_shard_path(prefix, rank, SAVE_WORLD, buf, n));
}

/* The model's parameters in the flat order of the td_zero (W1 W2 b1 b2), as "param.<i>". */
static void write_model(td_tensor_list *pm, const char *path) {
  static const size_t flat[4] = {0, 2, 1, 3};
  td_tensor_list l;
  td_tensor_list_init(&l);
  for (size_t i = 0; i < 4; i++) {
    char name[32];
    snprintf(name, sizeof name, "param.%zu", i);
    MP_CHECK_OK(td_tensor_list_append(&l, name, pm->tensors[flat[i]]));
  }
  MP_CHECK_OK(td_safetensors_write(path, &l, NULL));
  td_tensor_list_fini(&l);
}

/* Rank 0 after the save: consolidation, its refusals, and its values against the model's. */
static void consolidate_on_rank0(const ckpt_arg *c, td_tensor_list *pm) {
  char sh[SAVE_WORLD][600], full[600], model[600];
  const char *paths[SAVE_WORLD + 1];
  for (int r = 0; r < SAVE_WORLD; r++) shard_file(c, r, sh[r], sizeof sh[r]);
  paths[0] = sh[2], paths[1] = sh[0], paths[2] = sh[1], paths[3] = sh[0]; /* any order */
  ckpt_file(c, "full.safetensors", full, sizeof full);
  ckpt_file(c, "model.safetensors", model, sizeof model);
  MP_CHECK(td_zero_consolidate(paths, 2, full) == TD_ERR_FORMAT); /* a rank missing */
  MP_CHECK(td_zero_consolidate(paths + 1, 3, full) == TD_ERR_FORMAT); /* rank 0 twice */
  MP_CHECK(strstr(td_last_error(), "rank 0 of 3 appears twice") != NULL);
  /* a shard whose exp_avg pieces are gone: the others' do not make a whole */
  char cut[600];
  ckpt_file(c, "cut.safetensors", cut, sizeof cut);
  td_tensor_list sl, kept;
  td_safetensors_meta sm;
  td_tensor_list_init(&sl);
  td_tensor_list_init(&kept);
  td_safetensors_meta_init(&sm);
  MP_CHECK_OK(td_safetensors_read(sh[1], &sl, &sm));
  for (size_t k = 0; k < sl.n; k++)
    if (!strstr(sl.names[k], ".exp_avg") || strstr(sl.names[k], ".exp_avg_sq"))
      MP_CHECK_OK(td_tensor_list_append(&kept, sl.names[k], sl.tensors[k]));
  MP_CHECK(kept.n < sl.n);
  MP_CHECK_OK(td_safetensors_write(cut, &kept, &sm));
  const char *with_cut[SAVE_WORLD] = {sh[0], cut, sh[2]};
  MP_CHECK(td_zero_consolidate(with_cut, 3, full) == TD_ERR_FORMAT);
  MP_CHECK(strstr(td_last_error(), "exp_avg for") != NULL);
  unlink(cut);
  td_tensor_list_fini(&sl);
  td_tensor_list_fini(&kept);
  td_safetensors_meta_fini(&sm);
  MP_CHECK_OK(td_zero_consolidate(paths, 3, full));
  write_model(pm, model);
  td_tensor_list l;
  td_safetensors_meta meta;
  td_tensor_list_init(&l);
  td_safetensors_meta_init(&meta);
  MP_CHECK_OK(td_safetensors_read(full, &l, &meta));
  MP_CHECK(!strcmp(td_safetensors_meta_get(&meta, "format"), "tdist.zero.full"));
  static const size_t flat[4] = {0, 2, 1, 3};
  for (size_t i = 0; i < 4; i++) {
    char name[48];
    snprintf(name, sizeof name, "param.%zu", i);
    td_tensor *v = td_tensor_list_find(&l, name);
    bool eq = false;
    MP_CHECK(v != NULL);
    MP_CHECK_OK(td_tensor_allclose(v, pm->tensors[flat[i]], 0, 0, &eq));
    MP_CHECK(eq); /* the shards' master values are the model's parameters */
    snprintf(name, sizeof name, "param.%zu.step", i);
    v = td_tensor_list_find(&l, name);
    MP_CHECK(v && *(const int64_t *)td_tensor_data(v) == SAVED_STEPS);
  }
  td_tensor_list_fini(&l);
  td_safetensors_meta_fini(&meta);
}

static int worker_save(int rank, int world, const char *method, void *arg) {
  ckpt_arg *c = arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  td_module *m = build(1000 + (uint64_t)rank, false);
  td_tensor_list pm;
  td_tensor_list_init(&pm);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  td_zero *z = zero_over(pg, &pm, 2, true, true);
  for (int step = 0; step < SAVED_STEPS; step++) {
    MP_CHECK_OK(td_zero_prepare(z));
    backward_on(m, rank, step);
    MP_CHECK_OK(td_zero_step(z));
  }
  char prefix[512];
  ckpt_file(c, "ckpt", prefix, sizeof prefix);
  MP_CHECK_OK(td_zero_save(z, prefix));
  MP_CHECK_OK(td_process_group_barrier(pg));
  if (rank == 0) consolidate_on_rank0(c, &pm);
  MP_CHECK_OK(td_process_group_barrier(pg));
  td_zero_destroy(z);
  td_tensor_list_fini(&pm);
  td_module_unref(m);
  td_process_group_destroy(pg);
  coll_leave(a);
  CHECK_NO_LEAKS();
  return 0;
}

/* Resumes at world 2 from the consolidated file (stage 2 with overlap) or at world 1 from the
 * three shard files (stage 1), against one process that runs the saved steps with 3 data ranks
 * and the rest with `world`. */
static int worker_resume(int rank, int world, const char *method, void *arg) {
  ckpt_arg *c = arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  char sh[SAVE_WORLD][600], full[600];
  for (int r = 0; r < SAVE_WORLD; r++) shard_file(c, r, sh[r], sizeof sh[r]);
  ckpt_file(c, "full.safetensors", full, sizeof full);
  const char *shards[SAVE_WORLD] = {sh[1], sh[2], sh[0]}, *one[1] = {full};

  /* a td_zero over other parameters is refused, on every member, before anything changes */
  td_module *odd = build(5, true);
  td_tensor_list po;
  td_tensor_list_init(&po);
  MP_CHECK_OK(td_module_parameters(odd, &po));
  td_zero *zo = zero_over(pg, &po, 2, false, true);
  MP_CHECK(td_zero_load(zo, one, 1) == TD_ERR_SHAPE);
  td_zero_destroy(zo);
  td_tensor_list_fini(&po);
  td_module_unref(odd);

  td_module *m = build(5000 + (uint64_t)rank, false), *ref = build(1000, false);
  td_tensor_list pm, pr;
  td_tensor_list_init(&pm);
  td_tensor_list_init(&pr);
  MP_CHECK_OK(td_module_parameters(m, &pm));
  MP_CHECK_OK(td_module_parameters(ref, &pr));
  td_zero *z = zero_over(pg, &pm, world == 1 ? 1 : 2, world != 1, true);
  if (world == 1) MP_CHECK_OK(td_zero_load(z, shards, SAVE_WORLD));
  else MP_CHECK_OK(td_zero_load(z, one, 1));
  td_zero_stats zs;
  MP_CHECK_OK(td_zero_get_stats(z, &zs));
  MP_CHECK(zs.steps == SAVED_STEPS);

  td_tensor *rw[2], *rb[2];
  td_optim_group rg[2];
  groups_of(&pr, rw, rb, rg);
  td_optim_options o;
  adamw(&o);
  td_optim *ropt = NULL;
  MP_CHECK_OK(td_optim_create_groups(&o, rg, 2, &ropt));
  for (int step = 0; step < SAVED_STEPS; step++) ref_step(ref, ropt, &pr, SAVE_WORLD, step, NULL);
  for (int step = SAVED_STEPS; step <= SAVED_STEPS + MORE_STEPS; step++) {
    for (size_t i = 0; i < 4; i++) {
      if (!close_to(pm.tensors[i], pr.tensors[i])) {
        fprintf(stderr, "[rank %d of %d] step %d: parameter %s differs from the uninterrupted "
                "run\n", rank, world, step, pm.names[i]);
        MP_CHECK(0);
      }
    }
    if (step == SAVED_STEPS + MORE_STEPS) break;
    td_zero_zero_grad(z); /* stage 1 leaves the averages in .grad */
    if (world != 1) MP_CHECK_OK(td_zero_prepare(z));
    backward_on(m, rank, step);
    MP_CHECK_OK(td_zero_step(z));
    ref_step(ref, ropt, &pr, world, step, NULL);
  }
  td_zero_destroy(z);
  td_optim_destroy(ropt);
  td_tensor_list_fini(&pm);
  td_tensor_list_fini(&pr);
  td_module_unref(m);
  td_module_unref(ref);
  td_process_group_destroy(pg);
  coll_leave(a);
  CHECK_NO_LEAKS();
  return 0;
}

/* ---- stage 3 with activation checkpointing ---- */

/* ZeRO-3 over the GPT m, its blocks the units (AdamW, decay on the matrices, clipping). */
static td_zero *zero3_gpt(td_process_group *pg, td_module *m, td_tensor_list *ps) {
  td_tensor_list_init(ps);
  MP_CHECK_OK(td_module_parameters(m, ps));
  td_tensor *w[64], *b[64];
  size_t nw = 0, nb = 0;
  for (size_t i = 0; i < ps->n && nw < 64 && nb < 64; i++) {
    if (td_tensor_ndim(ps->tensors[i]) >= 2) w[nw++] = ps->tensors[i];
    else b[nb++] = ps->tensors[i];
  }
  td_optim_group g[2];
  td_optim_group_init(&g[0], w, nw);
  g[0].weight_decay = DECAY;
  td_optim_group_init(&g[1], b, nb);
  td_optim_options o;
  adamw(&o);
  td_module *h = td_module_child(td_module_child(m, "transformer"), "h"), *units[3];
  for (int i = 0; i < 3; i++) units[i] = td_module_child_at(h, i, NULL);
  td_zero_options zo;
  td_zero_options_init(&zo);
  zo.stage = 3;
  zo.max_grad_norm = 1.0;
  zo.units = units;
  zo.n_units = 3;
  td_zero *z = NULL;
  MP_CHECK_OK(td_zero_create(pg, &o, g, 2, &zo, &z));
  return z;
}

static void zero3_gpt_step(td_zero *z, td_module *m, int rank, int step, int regions) {
  int64_t s[2] = {2, 8}, v[16], t[16];
  for (int i = 0; i < 16; i++) {
    v[i] = (int64_t)((7 * step + 3 * rank + 5 * i) % 13);
    t[i] = (v[i] * 2 + 1) % 13;
  }
  td_tensor *idx = NULL, *tgt = NULL, *logits = NULL, *loss = NULL;
  MP_CHECK_OK(td_tensor_from_buffer(v, s, 2, TD_DTYPE_I64, &idx));
  MP_CHECK_OK(td_tensor_from_buffer(t, s, 2, TD_DTYPE_I64, &tgt));
  td_zero_zero_grad(z);
  MP_CHECK_OK(td_zero_prepare(z));
  MP_CHECK_OK(td_gpt_forward(m, idx, tgt, &logits, &loss));
  MP_CHECK(td_test_count_nodes(loss, "CheckpointBackward") == regions);
  MP_CHECK_OK(td_tensor_backward(loss));
  MP_CHECK_OK(td_zero_step(z));
  td_tensor_unref(idx), td_tensor_unref(tgt), td_tensor_unref(logits), td_tensor_unref(loss);
}

static int worker_zero3_checkpoint(int rank, int world, const char *method, void *arg) {
  (void)arg;
  td_rpc_agent *a = coll_join(rank, world, method);
  td_process_group *pg = NULL;
  MP_CHECK_OK(td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, TD_TIMEOUT_DEFAULT, &pg));
  /* 0, 1: every block (float64, float32); 2: every attention core; 3: the stack of blocks */
  for (int k = 0; k < 4; k++) {
    td_dtype dt = k == 1 ? TD_DTYPE_F32 : TD_DTYPE_F64;
    td_module *plain = td_test_tiny_gpt(dt, 3, 3), *ck = td_test_tiny_gpt(dt, 3, 3);
    td_module *h = td_module_child(td_module_child(ck, "transformer"), "h");
    if (k < 3)
      MP_CHECK_OK(td_gpt_set_activation_checkpointing(ck, k == 2 ? TD_CHECKPOINT_SELECTIVE
                                                                 : TD_CHECKPOINT_FULL));
    else
      MP_CHECK_OK(td_module_set_checkpoint(h, TD_CHECKPOINT_FULL));
    td_tensor_list pp, pc;
    td_zero *zp = zero3_gpt(pg, plain, &pp), *zc = zero3_gpt(pg, ck, &pc);
    for (int step = 0; step < 3; step++) {
      zero3_gpt_step(zp, plain, rank, step, 0);
      zero3_gpt_step(zc, ck, rank, step, k < 3 ? 3 : 1);
      MP_CHECK_OK(td_zero_gather_params(zp));
      MP_CHECK_OK(td_zero_gather_params(zc));
      for (size_t i = 0; i < pp.n; i++)
        if (memcmp(td_tensor_data(pp.tensors[i]), td_tensor_data(pc.tensors[i]),
                   td_tensor_nbytes(pp.tensors[i])) != 0) {
          fprintf(stderr, "[rank %d] zero3 + checkpointing (case %d) step %d: parameter %s "
                  "differs from the plain run\n", rank, k, step, pp.names[i]);
          MP_CHECK(0);
        }
      MP_CHECK_OK(td_zero_release_params(zp));
      MP_CHECK_OK(td_zero_release_params(zc));
    }
    td_zero_stats sp, sc;
    MP_CHECK_OK(td_zero_get_stats(zp, &sp));
    MP_CHECK_OK(td_zero_get_stats(zc, &sc));
    if (sc.unit_gathers != sp.unit_gathers || sc.prefetched != sp.prefetched) {
      fprintf(stderr, "[rank %d] zero3 + checkpointing (case %d): %llu gathers (%llu prefetched), "
              "plain %llu (%llu)\n", rank, k, (unsigned long long)sc.unit_gathers,
              (unsigned long long)sc.prefetched, (unsigned long long)sp.unit_gathers,
              (unsigned long long)sp.prefetched);
      MP_CHECK(0);
    }
    td_zero_destroy(zp), td_zero_destroy(zc);
    td_tensor_list_fini(&pp), td_tensor_list_fini(&pc);
    td_module_unref(plain), td_module_unref(ck);
  }
  td_process_group_destroy(pg);
  coll_leave(a);
  return 0;
}

static void test_zero3_checkpointed_gpt_matches_plain(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_zero3_checkpoint, NULL, 90);
}

/* TD_ZERO_CKPT_DIR keeps the files there (for check_zero_ckpt.py); else a temporary folder. */
static void test_zero_checkpoint_resumes_at_other_world_size(void **state) {
  (void)state;
  ckpt_arg c;
  const char *keep = getenv("TD_ZERO_CKPT_DIR");
  if (keep) {
    snprintf(c.dir, sizeof c.dir, "%s", keep);
    if (mkdir(c.dir, 0700) != 0 && errno != EEXIST) fail_msg("mkdir %s: %s", c.dir, strerror(errno));
  } else {
    snprintf(c.dir, sizeof c.dir, "/tmp/td_zero_ckpt_XXXXXX");
    if (!mkdtemp(c.dir)) fail_msg("mkdtemp: %s", strerror(errno));
  }
  int codes[SAVE_WORLD];
  int fails = td_mp_run(SAVE_WORLD, worker_save, &c, 90, codes);
  if (!fails) fails = td_mp_run(2, worker_resume, &c, 90, codes);
  if (!fails) fails = td_mp_run(1, worker_resume, &c, 90, codes);
  if (!keep) {
    char p[600], prefix[512];
    ckpt_file(&c, "ckpt", prefix, sizeof prefix);
    for (int r = 0; r < SAVE_WORLD; r++)
      if (td_zero_shard_path(prefix, r, SAVE_WORLD, p, sizeof p) == TD_OK) unlink(p);
    ckpt_file(&c, "full.safetensors", p, sizeof p);
    unlink(p);
    ckpt_file(&c, "model.safetensors", p, sizeof p);
    unlink(p);
    rmdir(c.dir);
  }
  if (fails) fail_msg("%d workers failed", fails);
}

static void test_zero_stages_match_ddp_with_sharded_state(void **state) {
  (void)state;
  int codes[WORLD];
  int fails = td_mp_run(WORLD, worker_zero, NULL, 90, codes);
  if (fails) fail_msg("%d workers failed", fails);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_zero_stages_match_ddp_with_sharded_state),
      cmocka_unit_test(test_zero_checkpoint_resumes_at_other_world_size),
      cmocka_unit_test(test_zero3_checkpointed_gpt_matches_plain),
  };
  return cmocka_run_group_tests_name("zero", tests, NULL, NULL);
}
