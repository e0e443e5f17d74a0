/* ps_common.h - pieces shared by the Fashion-MNIST examples (not part of the library).
 *
 *   psx_make_model     the MLP (784-256-10) or the CNN of train_local, built with a seed.
 *   psx_load_mnist     Fashion-MNIST train and test splits, normalised like train_local.
 *   psx_accuracy       test accuracy of any forward function (no gradients).
 *   psx_evaluate       test accuracy of a local module (evaluation mode).
 *   psx_spawn_if_alone when neither RANK nor a launcher's rank (srun's SLURM_PROCID, mpirun's
 *                      OMPI_COMM_WORLD_RANK) is in the environment, forks nproc-1 copies of this
 *                      process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (a free port on
 *                      127.0.0.1), so `build/examples/param_server` alone works like
 *                      `tdistrun --standalone --nproc-per-node 3 build/examples/param_server`.
 *                      As under tdistrun, a copy that fails stops the job at once (rank 0 names
 *                      it and exits 1) and the copies die with rank 0.
 *   psx_wait_children  waits for those copies and folds their exit status into the caller's.
 *
 * Everything dies with a message (ex_die) on failure. Main thread only.
 */
#ifndef TD_PS_COMMON_H
#define TD_PS_COMMON_H

#include <stdbool.h>
#include <stdint.h>

#include "example_util.h"
#include "tdist/data.h"
#include "tdist/nn.h"
#include "tdist/tensor.h"

/* psx_append appends child to the Sequential seq and drops the caller's reference to it. */
void psx_append(td_module *seq, td_module *child);

/* psx_to_device moves *t to dev (a copy recorded for autograd), replacing *t; nothing when it is
 * there already. */
void psx_to_device(td_tensor **t, td_device dev);

/* psx_make_model returns a new module: "mlp" Linear(784, 256), ReLU, Linear(256, 10); "cnn" the
 * two-convolution network of train_local; parameters drawn from a generator seeded with seed.
 * Dies on an unknown name. */
td_module *psx_make_model(const char *kind, uint64_t seed);

/* psx_load_mnist loads the split (normalised with the Fashion-MNIST mean and std) or dies with a
 * hint about where the files go. */
td_mnist *psx_load_mnist(td_mnist_split split, const char *dir);

/* psx_shard_loader returns a loader over trainer tid's shard of ds (of trainers shards, all the
 * same length: even_shards), shuffled per epoch with a->seed, in batches of a->batch_size; *nb
 * gets the batches per epoch, cut at a->max_batches. */
td_mnist_loader *psx_shard_loader(const td_mnist *ds, const ex_args *a, int tid, int trainers,
                                  bool flatten, int64_t *nb);

/* A model's forward pass for psx_accuracy: *logits gets [n, 10] (new reference). */
typedef td_status (*psx_forward_fn)(void *ctx, td_tensor *x, td_tensor **logits);

/* psx_accuracy returns the fraction of ds that forward classifies right, in batches of batch
 * (images flattened to 784 when flatten), with autograd off. */
double psx_accuracy(const td_mnist *ds, bool flatten, int64_t batch, psx_forward_fn forward,
                    void *ctx);

/* psx_evaluate returns model's accuracy on ds in evaluation mode (restored after), on the device
 * of model's parameters. The caller makes sure nothing updates the parameters meanwhile. */
double psx_evaluate(td_module *model, const td_mnist *ds, bool flatten);

/* psx_spawn_if_alone: see above; the parent becomes rank 0. Does nothing when RANK is set
 * (started by tdistrun or torchrun); under srun or mpirun it only copies their rank to RANK. */
void psx_spawn_if_alone(int nproc);

/* psx_tolerate_failures(true): a child of psx_spawn_if_alone that fails no longer stops the job
 * (programs that survive a lost member: gpt --ft); psx_wait_children then ignores it. */
void psx_tolerate_failures(bool on);
/* psx_wait_children waits for the children of psx_spawn_if_alone; returns rc, or 1 when rc is 0
 * and a child failed. */
int psx_wait_children(int rc);

#endif
