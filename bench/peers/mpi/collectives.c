/* collectives.c - Open MPI peer of bench/collectives.c: MPI_Allreduce, MPI_Bcast, MPI_Allgather
 * and MPI_Reduce_scatter_block on float32, with the same loop and figures as the tdist benchmark.
 *
 * Built by CMake only when MPI's C bindings are found (build/bench/peers/mpi/collectives); run
 * through bench/peers/mpi/collectives.sh, which starts it with mpirun once per process count and
 * picks the transport (shared memory: --mca btl self,vader; TCP: --mca btl self,tcp on lo).
 * For one process count (MPI_COMM_WORLD's size P), for each operation and size: warm-up calls;
 * rank 0 times 3 calls and broadcasts an iteration count that fills about --min-time-ms; barrier;
 * the timed calls back to back; the maximum over ranks of the mean time per call is time_us.
 * `bytes` is the whole buffer (all_gather: output; reduce_scatter: input), as in nccl-tests;
 * busbw factors: all_reduce 2(P-1)/P, all_gather and reduce_scatter (P-1)/P, broadcast 1.
 *
 * Rank 0 prints one JSON line: {"bench": "collectives", "config": {...}, "results": {"runs":
 * [{"op", "nprocs", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "iters", "algo"}, ...]}}.
 * Options: --sizes LIST, --ops LIST, --min-time-ms N (200), --max-iters N (2000), --warmup N (3),
 * --transport NAME (recorded in config and algo only).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER, N_OPS };
static const char *op_names[N_OPS] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter"};

typedef struct cfg {
  long long sizes[16];
  int n_sizes, ops[N_OPS], n_ops;
  long long min_time_ms, max_iters, warmup;
  const char *transport;
} cfg;

static void call(int op, float *a, float *b, int part, int p) {
  switch (op) {
    case OP_ALL_REDUCE: MPI_Allreduce(MPI_IN_PLACE, a, part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
    case OP_BROADCAST: MPI_Bcast(a, part, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
    case OP_ALL_GATHER: MPI_Allgather(a, part, MPI_FLOAT, b, part, MPI_FLOAT, MPI_COMM_WORLD); break;
    case OP_REDUCE_SCATTER:
      MPI_Reduce_scatter_block(b, a, part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
  }
  (void)p;
}

static float *alloc_ones(long long n) {
  float *x = malloc((size_t)(n ? n : 1) * sizeof *x);
  if (!x) MPI_Abort(MPI_COMM_WORLD, 1);
  for (long long i = 0; i < n; i++) x[i] = 1.0f;
  return x;
}

/* measure runs one point; returns the max over ranks of the mean time per call (us). */
static double measure(const cfg *c, int op, long long bytes, int p, long long *iters_out,
                      long long *bytes_out) {
  long long count = bytes / 4;
  long long part = op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER ? count / p : count;
  float *a = alloc_ones(part), *b = NULL;
  if (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER) b = alloc_ones(part * p);
  for (long long i = 0; i < c->warmup; i++) call(op, a, b, (int)part, p);
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  for (int i = 0; i < 3; i++) call(op, a, b, (int)part, p);
  double est = (MPI_Wtime() - t0) / 3;
  long long iters = (long long)((double)c->min_time_ms * 1e-3 / (est > 1e-9 ? est : 1e-9));
  if (iters < 3) iters = 3;
  if (iters > c->max_iters) iters = c->max_iters;
  MPI_Bcast(&iters, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = MPI_Wtime();
  for (long long i = 0; i < iters; i++) call(op, a, b, (int)part, p);
  double mine = (MPI_Wtime() - t0) * 1e6 / (double)iters, worst = 0;
  MPI_Allreduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  free(a);
  free(b);
  *iters_out = iters;
  *bytes_out = part * (op == OP_ALL_GATHER || op == OP_REDUCE_SCATTER ? p : 1) * 4;
  return worst;
}

static int parse_args(int argc, char **argv, cfg *c) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *v = argv[i + 1];
    if (strcmp(argv[i], "--sizes") == 0) {
      c->n_sizes = 0;
      char *dup = strdup(v), *save = NULL;
      for (char *t = strtok_r(dup, ",", &save); t && c->n_sizes < 16; t = strtok_r(NULL, ",", &save))
        c->sizes[c->n_sizes++] = atoll(t);
      free(dup);
    } else if (strcmp(argv[i], "--ops") == 0) {
      c->n_ops = 0;
      char *dup = strdup(v), *save = NULL;
      for (char *t = strtok_r(dup, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int k = 0;
        while (k < N_OPS && strcmp(op_names[k], t) != 0) k++;
        if (k == N_OPS || c->n_ops == N_OPS) return -1;
        c->ops[c->n_ops++] = k;
      }
      free(dup);
    } else if (strcmp(argv[i], "--min-time-ms") == 0) c->min_time_ms = atoll(v);
    else if (strcmp(argv[i], "--max-iters") == 0) c->max_iters = atoll(v);
    else if (strcmp(argv[i], "--warmup") == 0) c->warmup = atoll(v);
    else if (strcmp(argv[i], "--transport") == 0) c->transport = v;
    else return -1;
  }
  return (argc % 2 == 1 && c->n_sizes > 0 && c->n_ops > 0 && c->max_iters >= 3) ? 0 : -1;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, p;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  cfg c = {.sizes = {4096, 1 << 20, 16 << 20, 64 << 20}, .n_sizes = 4,
           .ops = {OP_ALL_REDUCE, OP_BROADCAST, OP_ALL_GATHER, OP_REDUCE_SCATTER}, .n_ops = 4,
           .min_time_ms = 200, .max_iters = 2000, .warmup = 3, .transport = "default"};
  if (parse_args(argc, argv, &c) != 0) {
    if (rank == 0)
      fprintf(stderr, "usage: collectives [--sizes LIST] [--ops LIST] [--min-time-ms N] "
                      "[--max-iters N] [--warmup N] [--transport NAME]\n");
    MPI_Finalize();
    return 2;
  }
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int liblen = 0;
  MPI_Get_library_version(lib, &liblen);
  lib[strcspn(lib, ",\n\"")] = 0;
  if (rank == 0)
    printf("{\"bench\": \"collectives\", \"config\": {\"impl\": \"mpi\", \"library\": \"%s\", "
           "\"transport\": \"%s\", \"dtype\": \"float32\", \"reduce_op\": \"sum\", "
           "\"broadcast_root\": 0, \"nprocs\": [%d], \"min_time_ms\": %lld, \"max_iters\": %lld, "
           "\"warmup\": %lld}, \"results\": {\"runs\": [",
           lib, c.transport, p, c.min_time_ms, c.max_iters, c.warmup);
  int k = 0;
  for (int i = 0; i < c.n_ops; i++)
    for (int j = 0; j < c.n_sizes; j++) {
      int op = c.ops[i];
      long long iters = 0, bytes = 0;
      double us = measure(&c, op, c.sizes[j], p, &iters, &bytes);
      double alg = (double)bytes / (us * 1e3);
      double f = op == OP_ALL_REDUCE ? 2.0 * (p - 1) / p : op == OP_BROADCAST ? 1.0
                                                                              : (double)(p - 1) / p;
      if (rank == 0)
        printf("%s{\"op\": \"%s\", \"nprocs\": %d, \"bytes\": %lld, \"time_us\": %.3f, "
               "\"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f, \"iters\": %lld, \"algo\": \"mpi-%s\"}",
               k++ ? ", " : "", op_names[op], p, bytes, us, alg, alg * f, iters, c.transport);
    }
  if (rank == 0) {
    printf("]}}\n");
    fflush(stdout);
  }
  MPI_Finalize();
  return 0;
}
