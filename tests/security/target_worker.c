/* target_worker.c - a worker of a small group that test_outsider.py attacks.
 *
 *   target_worker RUN_DIR
 * Joins the group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the job
 * secret in TD_RPC_SECRET), writes RUN_DIR/<rank>.addr ("host:port pid") once init returned, and
 * serves until RUN_DIR/stop exists. Meanwhile rank 0 calls rank 1's "echo" every 50 ms and keeps
 * the slowest round trip; every rank counts calls of "secret_fn", which only an intruder would
 * make. At the end each rank writes RUN_DIR/<rank>.json: {"secret_fn_calls", "echo_calls",
 * "echo_failures", "echo_max_ms", "refused", "rss_kb"} and shuts down gracefully; exit status 0
 * when that succeeded. Once RUN_DIR/call21 exists, rank 2 makes 10 calls of rank 1's "echo" (its
 * first: a new stream, opened while the test attacks rank 1) and writes RUN_DIR/2.call21:
 * "ok failed max_ms".
 *
 * With TD_TARGET_RING=1 (test_outsider_ring.py) the workers also form a CPU process group once
 * RUN_DIR/pg_go exists (rank 1 waits for RUN_DIR/pg_go1 instead, so that the test can attack the
 * listener of rank 1's right neighbour, rank 2, before rank 1 connects), write RUN_DIR/<rank>.pg,
 * run all_reduces of known values over the TCP ring (the workers run with TD_COLL_ALGO=ring) and
 * report "pg_ok" (group created, every result exact) and "pg_ops" in their JSON.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tdist/tdist.h"

/* ring_phase forms the group and runs all_reduces whose exact sums are known: every element of
 * member r is r + 1 + i % 7 (small integers: float32 sums are exact). Returns the ops that were
 * exact, -1 when the group could not be formed. */
static int ring_phase(td_rpc_agent *a, const char *dir, int rank) {
  char path[512];
  snprintf(path, sizeof path, "%s/pg_go%s", dir, rank == 1 ? "1" : "");
  while (access(path, F_OK) != 0) usleep(20000);
  td_process_group *pg = NULL;
  if (td_process_group_create(a, NULL, 0, TD_PG_BACKEND_CPU, 60000, &pg) != TD_OK) {
    fprintf(stderr, "target_worker: process group: %s\n", td_last_error());
    return -1;
  }
  snprintf(path, sizeof path, "%s/%d.pg", dir, rank);
  FILE *f = fopen(path, "w");
  if (f) fclose(f);
  int world = td_process_group_size(pg), good = 0;
  int64_t sizes[2] = {4096, 1 << 18};
  for (int op = 0; op < 10; op++) {
    int64_t n = sizes[op % 2];
    td_tensor *t = NULL;
    if (td_tensor_empty(&n, 1, TD_DTYPE_F32, td_device_cpu(), &t) != TD_OK) break;
    float *d = td_tensor_data(t);
    for (int64_t i = 0; i < n; i++) d[i] = (float)(rank + 1 + i % 7);
    bool ok = td_process_group_all_reduce(pg, t, TD_REDUCE_SUM) == TD_OK;
    for (int64_t i = 0; ok && i < n; i++)
      ok = d[i] == (float)(world * (world + 1) / 2 + world * (i % 7));
    if (!ok) fprintf(stderr, "target_worker: all_reduce %d not exact: %s\n", op, td_last_error());
    good += ok;
    td_tensor_unref(t);
  }
  td_process_group_destroy(pg);
  return good;
}

static atomic_long secret_calls;

static td_status echo(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **result,
                      td_future **async_result) {
  (void)ctx;
  (void)async_result;
  *result = n > 0 ? td_value_ref(args[0]) : td_value_none();
  return TD_OK;
}

static td_status secret_fn(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **result,
                           td_future **async_result) {
  (void)ctx;
  (void)args;
  (void)n;
  (void)async_result;
  atomic_fetch_add(&secret_calls, 1);
  *result = td_value_string("the secret");
  return TD_OK;
}

/* Answers the caller's rank as this worker knows it (the stream's authenticated rank). */
static td_status whoami(td_rpc_ctx *ctx, td_value *const *args, int n, td_value **result,
                        td_future **async_result) {
  (void)args;
  (void)n;
  (void)async_result;
  *result = td_value_int(td_rpc_ctx_caller_rank(ctx));
  return TD_OK;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static long rss_kb(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: target_worker RUN_DIR\n");
    return 2;
  }
  const char *dir = argv[1];
  if (td_rpc_register("echo", echo, NULL) != TD_OK ||
      td_rpc_register("whoami", whoami, NULL) != TD_OK ||
      td_rpc_register("secret_fn", secret_fn, NULL) != TD_OK)
    return 1;
  td_rpc_options o;
  td_rpc_options_init(&o);
  o.init_timeout_ms = 60000;
  o.rpc_timeout_ms = 30000;
  td_rpc_agent *a;
  if (td_rpc_init_from_env(NULL, &o, &a) != TD_OK) {
    fprintf(stderr, "target_worker: init: %s\n", td_last_error());
    return 1;
  }
  int rank = td_rpc_rank(a);
  td_worker_info me;
  td_rpc_self(a, &me);
  char path[512], tmp[520];
  snprintf(path, sizeof path, "%s/%d.addr", dir, rank);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return 1;
  /* the outsider test widens its memory bounds under a sanitizer (shadow memory) */
  const char *sanitizer = "none";
#if defined(__SANITIZE_THREAD__)
  sanitizer = "thread";
#elif defined(__SANITIZE_ADDRESS__)
  sanitizer = "address";
#endif
  fprintf(f, "%s %d %s\n", me.address, (int)getpid(), sanitizer);
  fclose(f);
  rename(tmp, path);

  int pg_ops = getenv("TD_TARGET_RING") ? ring_phase(a, dir, rank) : 0;

  snprintf(path, sizeof path, "%s/stop", dir);
  char trigger[512];
  snprintf(trigger, sizeof trigger, "%s/call21", dir);
  bool called21 = rank != 2;
  long calls = 0, failures = 0;
  double worst = 0;
  while (access(path, F_OK) != 0) {
    if (!called21 && access(trigger, F_OK) == 0) {
      called21 = true;
      int ok = 0, bad = 0;
      double most = 0;
      for (int i = 0; i < 10; i++) {
        td_value *x = td_value_int(i), *r = NULL;
        double t0 = now_ms();
        if (td_rpc_sync(a, "worker1", "echo", &x, 1, NULL, &r) == TD_OK) ok++;
        else bad++, fprintf(stderr, "target_worker: rank 2's call failed: %s\n", td_last_error());
        if (now_ms() - t0 > most) most = now_ms() - t0;
        td_value_unref(r);
        td_value_unref(x);
      }
      snprintf(tmp, sizeof tmp, "%s/2.call21.tmp", dir);
      char done[520];
      snprintf(done, sizeof done, "%s/2.call21", dir);
      FILE *cf = fopen(tmp, "w");
      if (cf) {
        fprintf(cf, "%d %d %.1f\n", ok, bad, most);
        fclose(cf);
        rename(tmp, done);
      }
    }
    if (rank == 0) {
      td_value *x = td_value_int(calls), *r = NULL;
      double t0 = now_ms();
      if (td_rpc_sync(a, "worker1", "echo", &x, 1, NULL, &r) != TD_OK) {
        fprintf(stderr, "target_worker: echo failed: %s\n", td_last_error());
        failures++;
      }
      double dt = now_ms() - t0;
      if (dt > worst) worst = dt;
      calls++;
      td_value_unref(r);
      td_value_unref(x);
    }
    usleep(50000);
  }
  td_rpc_stats st;
  td_rpc_get_stats(a, &st);
  snprintf(path, sizeof path, "%s/%d.json", dir, rank);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  f = fopen(tmp, "w");
  if (!f) return 1;
  fprintf(f,
          "{\"secret_fn_calls\": %ld, \"echo_calls\": %ld, \"echo_failures\": %ld, "
          "\"echo_max_ms\": %.1f, \"refused\": %llu, \"rss_kb\": %ld, \"pg_ops\": %d, "
          "\"pg_ok\": %s}\n",
          atomic_load(&secret_calls), calls, failures, worst,
          (unsigned long long)st.refused_connections, rss_kb(), pg_ops,
          pg_ops == 10 ? "true" : "false");
  fclose(f);
  rename(tmp, path);
  td_status s = td_rpc_shutdown(a, true, 30000);
  if (s != TD_OK) fprintf(stderr, "target_worker: shutdown: %s\n", td_last_error());
  td_rpc_destroy(a);
  return s == TD_OK ? 0 : 1;
}
