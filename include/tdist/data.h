/* data.h - IDX files, the (Fashion-)MNIST data sets and batch iteration over them.
 *
 * Three layers, each usable alone:
 *   td_idx_*      reads one IDX file of unsigned bytes (gzip-compressed or raw), validating the
 *                 magic number, the dimensions and the amount of data against its header.
 *   td_mnist_*    an in-memory image classification data set built from an images file and a
 *                 labels file in the MNIST layout (Fashion-MNIST, MNIST, KMNIST share it). Pixels
 *                 are kept as bytes; batches come out as float32 scaled to [0, 1] and optionally
 *                 normalised, labels as int64.
 *   td_sampler_*  the order in which sample indices are visited: seeded Fisher-Yates shuffling
 *                 (a fresh permutation per epoch), sharding over (rank, world) so data-parallel
 *                 workers see disjoint parts, batching with or without the last partial batch.
 *                 Data-set independent.
 *   td_mnist_loader_* ties a sampler to a td_mnist and yields (x, y) tensor batches.
 *
 * Errors: a file that does not exist gives TD_ERR_NOT_FOUND, one that cannot be read TD_ERR_IO,
 * one whose content is wrong (not gzip, bad magic, truncated, sizes that disagree) TD_ERR_FORMAT;
 * td_last_error() names the file and what was wrong.
 *
 * THREAD SAFETY: a td_mnist is immutable after loading and may be read by any number of threads
 * (td_mnist_batch included). A sampler or loader must not be used by two threads at once.
 */
#ifndef TDIST_DATA_H
#define TDIST_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- IDX files ---- */

/* Type code of unsigned-byte IDX files (the only element type read here). */
#define TD_IDX_TYPE_U8 0x08

/* An IDX array of bytes: ndim dimensions and their product bytes of data, row major. */
typedef struct td_idx {
  int ndim;                  /* 1 .. TD_MAX_DIMS */
  int64_t dims[TD_MAX_DIMS]; /* sizes, each >= 0 */
  uint8_t *data;             /* nbytes bytes; owned, freed by td_idx_fini() */
  size_t nbytes;             /* product of dims */
} td_idx;

/* td_idx_read reads the unsigned-byte IDX file at path into *out. The file may be
 * gzip-compressed (detected by content, not by name) or raw. When expect_ndim > 0 the file must
 * have exactly that many dimensions. The whole file is checked: the magic number (0x0000 0x08
 * ndim), the header, exactly prod(dims) bytes of data and nothing after them, and for gzip the
 * CRC. TD_ERR_NOT_FOUND when path does not exist, TD_ERR_IO when it cannot be read,
 * TD_ERR_FORMAT when the content is wrong; td_last_error() names path. On TD_OK the caller owns
 * *out; release with td_idx_fini(). THREAD SAFETY: any thread; blocks on file I/O. */
TD_API td_status td_idx_read(const char *path, int expect_ndim, td_idx *out);

/* td_idx_fini frees the data of an array filled by td_idx_read() and zeroes it. NULL, or an
 * already finalised array, does nothing. */
TD_API void td_idx_fini(td_idx *a);

/* ---- MNIST-layout data sets ---- */

/* Directory searched when neither an argument nor TD_DATA_DIR names one. */
#define TD_MNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
/* Mean and standard deviation of Fashion-MNIST training pixels scaled to [0, 1]. */
#define TD_FASHION_MNIST_MEAN 0.2860
#define TD_FASHION_MNIST_STD 0.3530
/* Same for MNIST. */
#define TD_MNIST_MEAN 0.1307
#define TD_MNIST_STD 0.3081

typedef struct td_mnist td_mnist;

typedef enum td_mnist_split {
  TD_MNIST_TRAIN = 0, /* train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz */
  TD_MNIST_TEST = 1,  /* t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz */
} td_mnist_split;

/* Options of td_mnist_load(); fill with td_mnist_opts_init() first. */
typedef struct td_mnist_opts {
  /* Directory holding the four files. NULL or "": $TD_DATA_DIR when set and not empty, else
   * TD_MNIST_DEFAULT_DIR. Default NULL. In each directory the `.gz` name is tried first, then
   * the same name without `.gz`. */
  const char *dir;
  /* Pixels v in 0..255 become (v / 255 - mean) / std. Defaults 0 and 1 (plain [0, 1] scaling);
   * use TD_FASHION_MNIST_MEAN/STD to normalise. std must be > 0. */
  double mean;
  double std;
  /* Keep only the first `limit` samples; 0 (default) keeps all. */
  int64_t limit;
} td_mnist_opts;

/* td_mnist_opts_init fills *o with the defaults. */
TD_API void td_mnist_opts_init(td_mnist_opts *o);

/* td_mnist_data_dir writes the directory td_mnist_load() would use for dir (which may be NULL)
 * into buf (n bytes) and returns buf; an over-long path is truncated. */
TD_API const char *td_mnist_data_dir(const char *dir, char *buf, size_t n);

/* td_mnist_load reads one split from the directory chosen by opts (NULL for the defaults). The
 * images file must be a 3-d IDX file (count, rows, cols) and the labels file a 1-d one with the
 * same count. Errors as td_idx_read(), plus TD_ERR_FORMAT when the two files disagree. Returns a
 * new data set in *out; release with td_mnist_destroy(). THREAD SAFETY: any thread; blocks on
 * file I/O (about half a second for the 60000 Fashion-MNIST training images). */
TD_API td_status td_mnist_load(td_mnist_split split, const td_mnist_opts *opts, td_mnist **out);

/* td_mnist_load_files is td_mnist_load() with explicit file paths; opts->dir is ignored. */
TD_API td_status td_mnist_load_files(const char *images_path, const char *labels_path,
                                     const td_mnist_opts *opts, td_mnist **out);

/* td_mnist_destroy frees a data set. NULL does nothing. The caller must have destroyed every
 * loader over it. */
TD_API void td_mnist_destroy(td_mnist *ds);

/* td_mnist_count returns the number of samples. */
TD_API int64_t td_mnist_count(const td_mnist *ds);
/* td_mnist_rows and td_mnist_cols return the image size (28 and 28 for MNIST). */
TD_API int64_t td_mnist_rows(const td_mnist *ds);
TD_API int64_t td_mnist_cols(const td_mnist *ds);
/* td_mnist_num_classes returns the largest label plus one (10 for MNIST). */
TD_API int td_mnist_num_classes(const td_mnist *ds);
/* td_mnist_pixels returns the raw pixels, count * rows * cols bytes, row major. Borrowed; valid
 * while ds lives. */
TD_API const uint8_t *td_mnist_pixels(const td_mnist *ds);
/* td_mnist_labels returns the labels, count bytes. Borrowed; valid while ds lives. */
TD_API const uint8_t *td_mnist_labels(const td_mnist *ds);

/* td_mnist_batch gathers the samples idx[0..n) (each in [0, count)) into new CPU tensors: *x is
 * float32 [n, 1, rows, cols], or [n, rows * cols] when flatten is true, holding the scaled and
 * normalised pixels; *y is int64 [n]. Either out pointer may be NULL when not wanted. Returns new
 * references; release with td_tensor_unref(). THREAD SAFETY: any thread. */
TD_API td_status td_mnist_batch(const td_mnist *ds, const int64_t *idx, int64_t n, bool flatten,
                                td_tensor **x, td_tensor **y);

/* ---- samplers ---- */

typedef struct td_sampler td_sampler;

/* Options of td_sampler_create(); fill with td_sampler_opts_init() first. */
typedef struct td_sampler_opts {
  int64_t batch_size; /* samples per batch, > 0. Default 64. */
  bool shuffle;       /* visit samples in a random order. Default false. */
  uint64_t seed;      /* shuffling seed; epoch e uses a permutation derived from (seed, e) that
                         every rank computes identically. Default 0. */
  bool drop_last;     /* skip this rank's last batch when it is smaller than batch_size.
                         Default false. */
  int rank;           /* this worker's shard, 0 <= rank < world. Default 0. */
  int world;          /* number of shards, >= 1. Default 1. */
  /* When true, the last (n mod world) positions of each epoch's order are dropped so every rank
   * gets exactly floor(n / world) samples (and, with the same batch size, the same number of
   * batches: what synchronous data-parallel training needs). When false (default) the shards
   * together cover every sample once and their sizes differ by at most one. Either way the
   * shards of one epoch are disjoint. */
  bool even_shards;
} td_sampler_opts;

/* td_sampler_opts_init fills *o with the defaults. */
TD_API void td_sampler_opts_init(td_sampler_opts *o);

/* td_sampler_create makes a sampler over indices 0..n) positioned at the start of epoch 0.
 * TD_ERR_INVALID on bad options. Release with td_sampler_destroy(). */
TD_API td_status td_sampler_create(int64_t n, const td_sampler_opts *opts, td_sampler **out);
TD_API void td_sampler_destroy(td_sampler *s);

/* td_sampler_set_epoch restarts at the beginning of epoch `epoch` (shuffled again with that
 * epoch's permutation when shuffling). */
TD_API td_status td_sampler_set_epoch(td_sampler *s, uint64_t epoch);

/* td_sampler_next gives the next batch of this rank: *idx points to *n indices (borrowed; valid
 * until the next call on s). At the end of the epoch it returns TD_OK with *idx = NULL and
 * *n = 0, and keeps doing so until td_sampler_set_epoch(). */
TD_API td_status td_sampler_next(td_sampler *s, const int64_t **idx, int64_t *n);

/* td_sampler_shard_size returns how many samples this rank visits per epoch. */
TD_API int64_t td_sampler_shard_size(const td_sampler *s);
/* td_sampler_num_batches returns how many batches this rank yields per epoch. */
TD_API int64_t td_sampler_num_batches(const td_sampler *s);
/* td_sampler_epoch returns the current epoch. */
TD_API uint64_t td_sampler_epoch(const td_sampler *s);

/* ---- loaders ---- */

typedef struct td_mnist_loader td_mnist_loader;

/* td_mnist_loader_create iterates ds in batches chosen by a sampler with opts (NULL for the
 * defaults); flatten selects [B, rows*cols] instead of [B, 1, rows, cols]. ds is borrowed and must
 * outlive the loader. Release with td_mnist_loader_destroy(). */
TD_API td_status td_mnist_loader_create(const td_mnist *ds, const td_sampler_opts *opts,
                                        bool flatten, td_mnist_loader **out);
TD_API void td_mnist_loader_destroy(td_mnist_loader *l);

/* td_mnist_loader_set_epoch restarts at the beginning of epoch `epoch` (a new shuffle). */
TD_API td_status td_mnist_loader_set_epoch(td_mnist_loader *l, uint64_t epoch);

/* td_mnist_loader_next stores the next batch in *x (float32) and *y (int64 labels). At the end of
 * the epoch it returns TD_OK with *x = *y = NULL. Returns new references; release with
 * td_tensor_unref(). */
TD_API td_status td_mnist_loader_next(td_mnist_loader *l, td_tensor **x, td_tensor **y);

/* td_mnist_loader_sampler returns the loader's sampler (for its sizes). Borrowed; valid while l
 * lives. */
TD_API td_sampler *td_mnist_loader_sampler(td_mnist_loader *l);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_DATA_H */
