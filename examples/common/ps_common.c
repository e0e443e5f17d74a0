/* ps_common.c - the Fashion-MNIST examples' shared pieces (see ps_common.h). */
#define _GNU_SOURCE
#include "ps_common.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tdist/autograd.h"

void psx_append(td_module *seq, td_module *child) {
  EX_CHECK(td_sequential_append(seq, child));
  td_module_unref(child);
}

/* psx_make_model returns a new module: "mlp" Linear(784, 256), ReLU, Linear(256, 10); "cnn" the
 * two-convolution network of train_local. Dies on an unknown name. */
td_module *psx_make_model(const char *kind, uint64_t seed) {
  td_generator *g = NULL;
  EX_CHECK(td_generator_create(seed, &g));
  td_module *seq = NULL, *m = NULL;
  EX_CHECK(td_sequential_create(&seq));
  if (!strcmp(kind, "mlp")) {
    EX_CHECK(td_linear_create(784, 256, true, g, &m));
    psx_append(seq, m);
    EX_CHECK(td_relu_create(&m));
    psx_append(seq, m);
    EX_CHECK(td_linear_create(256, 10, true, g, &m));
    psx_append(seq, m);
  } else if (!strcmp(kind, "cnn")) {
    td_conv2d_opts co;
    td_conv2d_opts_init(&co, 3);
    co.pad_h = co.pad_w = 1;
    EX_CHECK(td_conv2d_create(1, 32, &co, g, &m));
    psx_append(seq, m);
    EX_CHECK(td_relu_create(&m));
    psx_append(seq, m);
    EX_CHECK(td_max_pool2d_create(2, 2, 0, 0, &m));
    psx_append(seq, m);
    EX_CHECK(td_conv2d_create(32, 64, &co, g, &m));
    psx_append(seq, m);
    EX_CHECK(td_relu_create(&m));
    psx_append(seq, m);
    EX_CHECK(td_max_pool2d_create(2, 2, 0, 0, &m));
    psx_append(seq, m);
    EX_CHECK(td_flatten_create(1, -1, &m));
    psx_append(seq, m);
    EX_CHECK(td_linear_create(64 * 7 * 7, 10, true, g, &m));
    psx_append(seq, m);
  } else {
    ex_die("unknown --model '%s' (mlp or cnn)", kind);
  }
  td_generator_destroy(g);
  return seq;
}

/* psx_load_mnist loads the split (normalised with the Fashion-MNIST mean and std) or dies with a
 * hint about where the files go. */
td_mnist *psx_load_mnist(td_mnist_split split, const char *dir) {
  td_mnist_opts mo;
  td_mnist_opts_init(&mo);
  mo.dir = dir;
  mo.mean = TD_FASHION_MNIST_MEAN;
  mo.std = TD_FASHION_MNIST_STD;
  td_mnist *ds = NULL;
  td_status s = td_mnist_load(split, &mo, &ds);
  if (s == TD_ERR_NOT_FOUND)
    ex_die("%s\n(put the Fashion-MNIST .gz files there, or pass --data-dir / set TD_DATA_DIR)",
           td_last_error());
  EX_CHECK(s);
  return ds;
}

td_mnist_loader *psx_shard_loader(const td_mnist *ds, const ex_args *a, int tid, int trainers,
                                  bool flatten, int64_t *nb) {
  td_sampler_opts so;
  td_sampler_opts_init(&so);
  so.batch_size = a->batch_size;
  so.shuffle = true;
  so.seed = a->seed;
  so.rank = tid;
  so.world = trainers;
  so.even_shards = true; /* every trainer runs the same number of steps */
  td_mnist_loader *loader = NULL;
  EX_CHECK(td_mnist_loader_create(ds, &so, flatten, &loader));
  *nb = td_sampler_num_batches(td_mnist_loader_sampler(loader));
  if (a->max_batches > 0 && a->max_batches < *nb) *nb = a->max_batches;
  return loader;
}

double psx_accuracy(const td_mnist *ds, bool flatten, int64_t batch, psx_forward_fn forward,
                    void *ctx) {
  td_sampler_opts so;
  td_sampler_opts_init(&so);
  so.batch_size = batch;
  td_mnist_loader *l = NULL;
  EX_CHECK(td_mnist_loader_create(ds, &so, flatten, &l));
  int64_t *pred = malloc((size_t)batch * sizeof *pred);
  if (!pred) ex_die("out of memory");
  bool prev = td_autograd_set_enabled(false);
  int64_t correct = 0, total = 0;
  for (;;) {
    td_tensor *x = NULL, *y = NULL, *logits = NULL, *am = NULL;
    EX_CHECK(td_mnist_loader_next(l, &x, &y));
    if (!x) break;
    EX_CHECK(forward(ctx, x, &logits));
    EX_CHECK(td_tensor_argmax(logits, 1, false, &am));
    int64_t n = td_tensor_size(y, 0);
    EX_CHECK(td_tensor_copy_to_buffer(am, pred, (size_t)n * sizeof *pred));
    const int64_t *labels = td_tensor_data(y);
    for (int64_t i = 0; i < n; i++) correct += pred[i] == labels[i];
    total += n;
    td_tensor_unref(am);
    td_tensor_unref(logits);
    td_tensor_unref(x);
    td_tensor_unref(y);
  }
  td_autograd_set_enabled(prev);
  free(pred);
  td_mnist_loader_destroy(l);
  return total ? (double)correct / (double)total : 0.0;
}

void psx_to_device(td_tensor **t, td_device dev) {
  if (td_device_equal(td_tensor_device(*t), dev)) return;
  td_tensor *moved = NULL;
  EX_CHECK(td_tensor_to(*t, dev, &moved));
  td_tensor_unref(*t);
  *t = moved;
}

/* A module on a device (that of its parameters), for psx_accuracy. */
typedef struct on_device {
  td_module *model;
  td_device dev;
} on_device;

static td_status forward_on_device(void *ctx, td_tensor *x, td_tensor **logits) {
  on_device *o = ctx;
  td_tensor *xd = td_tensor_ref(x);
  psx_to_device(&xd, o->dev);
  td_status st = td_module_forward(o->model, xd, logits);
  td_tensor_unref(xd);
  return st;
}

double psx_evaluate(td_module *model, const td_mnist *ds, bool flatten) {
  td_tensor_list params;
  td_tensor_list_init(&params);
  EX_CHECK(td_module_parameters(model, &params));
  on_device o = {model, params.n ? td_tensor_device(params.tensors[0]) : td_device_cpu()};
  td_tensor_list_fini(&params);
  bool was_training = td_module_is_training(model);
  td_module_train(model, false);
  double acc = psx_accuracy(ds, flatten, 500, forward_on_device, &o);
  td_module_train(model, was_training);
  return acc;
}

/* Children forked by psx_spawn_if_alone (rank i at psx_children[i - 1]), their wait statuses
 * once reaped, and the parent's watcher thread that reaps them. */
static pid_t psx_children[63];
static int psx_status[63];
static bool psx_reaped[63];
static int psx_nchildren;
static pthread_t psx_watcher;
static bool psx_watching;
static bool psx_tolerant; /* psx_tolerate_failures: a failed child does not stop the job */

void psx_tolerate_failures(bool on) { psx_tolerant = on; }

static void describe(int st, char *buf, size_t n) {
  if (WIFSIGNALED(st)) snprintf(buf, n, "was killed by signal %d (%s)", WTERMSIG(st),
                                strsignal(WTERMSIG(st)));
  else snprintf(buf, n, "exited with status %d", WEXITSTATUS(st));
}

/* The watcher: a child that fails (signal, non-zero exit) stops the whole job at once, naming it,
 * instead of leaving the others waiting for it. Children that exit 0 are only recorded. */
static void *watch_children(void *arg) {
  (void)arg;
  for (int left = psx_nchildren; left > 0;) {
    int st = 0;
    pid_t pid = waitpid(-1, &st, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < psx_nchildren; i++) {
      if (psx_children[i] != pid) continue;
      __atomic_store_n(&psx_status[i], st, __ATOMIC_RELAXED);
      __atomic_store_n(&psx_reaped[i], true, __ATOMIC_RELEASE);
      left--;
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0) break;
      char what[96];
      describe(st, what, sizeof what);
      if (psx_tolerant) {
        fprintf(stderr, "%s: worker rank %d (pid %d) %s; the others go on\n",
                program_invocation_short_name, i + 1, (int)pid, what);
        break;
      }
      fprintf(stderr, "%s: worker rank %d (pid %d) %s; stopping the job\n",
              program_invocation_short_name, i + 1, (int)pid, what);
      for (int k = 0; k < psx_nchildren; k++)
        if (!__atomic_load_n(&psx_reaped[k], __ATOMIC_ACQUIRE)) kill(psx_children[k], SIGTERM);
      _exit(1); /* the children die with us too (PR_SET_PDEATHSIG) */
    }
  }
  return NULL;
}

/* psx_spawn_if_alone: when RANK is unset, picks a free port, forks nproc - 1 children (ranks
 * 1..nproc-1; none for a job of one) and sets the rendezvous variables in every process; the parent becomes rank 0 and
 * watches the children (a failed one stops the job), the children die with the parent.
 * Does nothing when RANK is set (started by tdistrun or torchrun). Started by srun without a
 * launcher (SLURM_PROCID set), or by mpirun (OMPI_COMM_WORLD_RANK), it only copies that rank and
 * the task count to RANK and WORLD_SIZE (for the example's own use; td_rpc_init_from_env reads
 * the launcher's variables itself). */
void psx_spawn_if_alone(int nproc) {
  if (getenv("RANK")) return;
  const char *launched = getenv("SLURM_PROCID"), *size = getenv("SLURM_NTASKS");
  if (!launched || !*launched) {
    launched = getenv("OMPI_COMM_WORLD_RANK");
    size = getenv("OMPI_COMM_WORLD_SIZE");
  }
  if (launched && *launched) {
    setenv("RANK", launched, 1);
    if (size && *size && !getenv("WORLD_SIZE")) setenv("WORLD_SIZE", size, 1);
    return;
  }
  if (nproc < 1 || nproc > 64) ex_die("--nproc must be in 1..64 (got %d)", nproc);
  /* the workers we fork share a job secret (inherited through the environment) */
  EX_CHECK(td_rpc_secret_ensure_env());
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &len) != 0)
    ex_die("cannot find a free port on 127.0.0.1");
  close(fd);
  char port[16], world[16], rank[16];
  snprintf(port, sizeof port, "%d", ntohs(sa.sin_port));
  snprintf(world, sizeof world, "%d", nproc);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", port, 1);
  setenv("WORLD_SIZE", world, 1);
  fflush(stdout);
  fflush(stderr);
  pid_t parent = getpid();
  for (int r = 1; r < nproc; r++) {
    pid_t pid = fork();
    if (pid < 0) ex_die("fork failed");
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1); /* rank 0 is already gone */
      psx_nchildren = 0;
      snprintf(rank, sizeof rank, "%d", r);
      setenv("RANK", rank, 1);
      setenv("LOCAL_RANK", rank, 1);
      return;
    }
    psx_children[psx_nchildren++] = pid;
  }
  setenv("RANK", "0", 1);
  setenv("LOCAL_RANK", "0", 1);
  if (pthread_create(&psx_watcher, NULL, watch_children, NULL) != 0)
    ex_die("cannot start the thread that watches the workers");
  psx_watching = true;
}

/* psx_wait_children waits for the children of psx_spawn_if_alone (the watcher reaps them);
 * returns rc, or 1 when rc is 0 and a child failed. */
int psx_wait_children(int rc) {
  if (!psx_watching) return rc;
  pthread_join(psx_watcher, NULL);
  psx_watching = false;
  for (int i = 0; i < psx_nchildren; i++) {
    int st = __atomic_load_n(&psx_status[i], __ATOMIC_RELAXED);
    if (psx_tolerant && __atomic_load_n(&psx_reaped[i], __ATOMIC_ACQUIRE)) continue;
    if (!__atomic_load_n(&psx_reaped[i], __ATOMIC_ACQUIRE) || !WIFEXITED(st) ||
        WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d failed\n", i + 1);
      if (rc == 0) rc = 1;
    }
  }
  return rc;
}
