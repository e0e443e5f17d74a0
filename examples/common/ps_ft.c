/* ps_ft.c - checkpoints, resuming and the watchdog of the parameter-server example (see ps_ft.h;
 * the pings themselves are watchdog.c's).
 *
 * Lock order: ft.mu is a leaf (held while a checkpoint is written: the trainers all wait at the
 * barrier meanwhile, so nothing changes the parameters); on_fail runs with it released.
 */
#define _GNU_SOURCE
#include "ps_ft.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "watchdog.h"

static struct {
  pthread_mutex_t mu;
  /* the server's checkpoints; path[0] == 0 without */
  char path[4096];
  td_module *model;
  const char *model_kind;
  int trainers;
  int64_t resume_epoch, resume_step, resume_nb; /* from the loaded checkpoint; 0 without */
  int ck_arrived;                               /* trainers at the current ps_ckpt barrier */
  td_future *ck_done;                           /* completed once the checkpoint is written */
  /* a lost trainer; failed is read without the lock */
  int failed;
  char failed_msg[640];
  void (*on_fail)(const char *msg);
  int dying; /* psft_die_failed ran */
} ft = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* ---- options ---- */

void psft_options_init(psft_options *o, ex_opt opts[PSFT_NOPTS]) {
  memset(o, 0, sizeof *o);
  const char *ka = getenv("TD_KEEPALIVE_MS"), *kt = getenv("TD_KEEPALIVE_TIMEOUT_MS");
  if (ka) o->keepalive_ms = atoll(ka);
  if (kt) o->keepalive_timeout_ms = atoll(kt);
  const ex_opt tab[PSFT_NOPTS] = {
      {"checkpoint-dir", EX_OPT_STRING, &o->ckpt_dir,
       "save param_server.safetensors there every --checkpoint-every steps and resume from it "
       "when it exists (no checkpoints when not given)"},
      {"checkpoint-every", EX_OPT_I64, &o->ckpt_every,
       "global steps (batches of every trainer) between checkpoints (0: 100 with "
       "--checkpoint-dir)"},
      {"keepalive-ms", EX_OPT_I64, &o->keepalive_ms,
       "RPC keepalive interval, at which the watchdog also pings (0: 2000; env "
       "TD_KEEPALIVE_MS; TD_WATCHDOG=0 turns the watchdog off)"},
      {"keepalive-timeout-ms", EX_OPT_I64, &o->keepalive_timeout_ms,
       "how long a keepalive or a ping may go unanswered before the peer is failed (0: 20000; "
       "env TD_KEEPALIVE_TIMEOUT_MS)"},
  };
  memcpy(opts, tab, sizeof tab);
}

void psft_options_apply(psft_options *o, td_rpc_options *ro) {
  if (o->ckpt_every < 0 || o->keepalive_ms < 0 || o->keepalive_timeout_ms < 0)
    ex_die("--checkpoint-every, --keepalive-ms and --keepalive-timeout-ms must be >= 0");
  if (o->ckpt_dir && o->ckpt_every == 0) o->ckpt_every = 100;
  if (!o->ckpt_dir) o->ckpt_every = 0;
  if (o->keepalive_ms > 0) ro->keepalive_ms = o->keepalive_ms;
  if (o->keepalive_timeout_ms > 0) ro->keepalive_timeout_ms = o->keepalive_timeout_ms;
}

/* ---- checkpoints ---- */

/* meta_int reads the integer metadata key of the checkpoint or dies. */
static int64_t meta_int(const td_safetensors_meta *m, const char *key) {
  const char *v = td_safetensors_meta_get(m, key);
  char *end = NULL;
  long long x = v ? strtoll(v, &end, 10) : 0;
  if (!v || end == v || *end) ex_die("checkpoint %s: no integer '%s' in its metadata", ft.path, key);
  return (int64_t)x;
}

/* ckpt_save writes the model and the progress record (the trainers are at epoch, step) to
 * ft.path, atomically. ft.mu held, every trainer waiting at the barrier. */
static td_status ckpt_save(int64_t epoch, int64_t step, int64_t nb) {
  td_tensor_list sd = {0};
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  const char *keys[4] = {"ps.epoch", "ps.step", "ps.batches_per_epoch", "ps.trainers"};
  const int64_t vals[4] = {epoch, step, nb, ft.trainers};
  double t0 = ex_now_s();
  td_status s = td_module_state_dict(ft.model, &sd);
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "format", "pt");
  if (s == TD_OK) s = td_safetensors_meta_set(&meta, "ps.model", ft.model_kind);
  for (int i = 0; i < 4 && s == TD_OK; i++) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)vals[i]);
    s = td_safetensors_meta_set(&meta, keys[i], buf);
  }
  if (s == TD_OK) s = td_safetensors_write(ft.path, &sd, &meta);
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
  if (s == TD_OK)
    fprintf(stderr, "param_server: checkpoint at epoch %lld step %lld (global step %lld) -> %s "
            "(%.0f ms)\n", (long long)epoch, (long long)step, (long long)(epoch * nb + step),
            ft.path, 1e3 * (ex_now_s() - t0));
  return s;
}

/* ckpt_load loads ft.path into the model when it exists and records where to resume. */
static void ckpt_load(void) {
  if (access(ft.path, F_OK) != 0) return;
  td_tensor_list sd = {0};
  td_safetensors_meta meta;
  td_safetensors_meta_init(&meta);
  EX_CHECK(td_safetensors_read(ft.path, &sd, &meta));
  const char *kind = td_safetensors_meta_get(&meta, "ps.model");
  if (!kind || strcmp(kind, ft.model_kind))
    ex_die("checkpoint %s holds model '%s', not '%s'", ft.path, kind ? kind : "?", ft.model_kind);
  int64_t tr = meta_int(&meta, "ps.trainers");
  if (tr != ft.trainers)
    ex_die("checkpoint %s was made with %lld trainers, this run has %d", ft.path, (long long)tr,
           ft.trainers);
  ft.resume_epoch = meta_int(&meta, "ps.epoch");
  ft.resume_step = meta_int(&meta, "ps.step");
  ft.resume_nb = meta_int(&meta, "ps.batches_per_epoch");
  if (ft.resume_epoch < 0 || ft.resume_step < 0 || ft.resume_nb < 0)
    ex_die("checkpoint %s: bad progress record", ft.path);
  EX_CHECK(td_module_load_state_dict(ft.model, &sd, true));
  td_tensor_list_fini(&sd);
  td_safetensors_meta_fini(&meta);
  const char *rc = getenv("TD_RESTART_COUNT");
  fprintf(stderr, "param_server: resuming from checkpoint %s: epoch %lld step %lld (global step "
          "%lld), restart %s\n", ft.path, (long long)ft.resume_epoch, (long long)ft.resume_step,
          (long long)(ft.resume_epoch * ft.resume_nb + ft.resume_step), rc ? rc : "0");
}

void psft_server_init(const psft_options *o, td_module *model, const char *model_kind,
                      int trainers, int epochs) {
  ft.model = model;
  ft.model_kind = model_kind;
  ft.trainers = trainers;
  if (!o->ckpt_dir) return;
  if (mkdir(o->ckpt_dir, 0755) != 0 && errno != EEXIST)
    ex_die("cannot create --checkpoint-dir %s: %s", o->ckpt_dir, strerror(errno));
  snprintf(ft.path, sizeof ft.path, "%s/param_server.safetensors", o->ckpt_dir);
  ckpt_load();
  if (ft.resume_epoch > epochs)
    ex_die("checkpoint %s is at epoch %lld, past --epochs %d", ft.path,
           (long long)ft.resume_epoch, epochs);
}

int64_t psft_resume_epoch(void) { return ft.resume_epoch; }

void psft_server_results(ex_json *results) {
  if (!ft.resume_epoch && !ft.resume_step) return;
  ex_json_int(results, "resumed_from_epoch", ft.resume_epoch);
  ex_json_int(results, "resumed_from_step", ft.resume_step);
  ex_json_int(results, "resumed_from_global_step", ft.resume_epoch * ft.resume_nb + ft.resume_step);
}

/* ps_resume() -> [epoch, step, batches_per_epoch] the trainers start from ([0, 0, 0]: the
 * beginning). */
static td_status ps_resume(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                           td_future **fut) {
  td_value *l = td_value_list();
  if (!l) return TD_ERR_NOMEM;
  int64_t v[3] = {ft.resume_epoch, ft.resume_step, ft.resume_nb};
  for (int i = 0; i < 3; i++) {
    td_value *x = td_value_int(v[i]);
    td_status s = x ? td_value_list_append(l, x) : TD_ERR_NOMEM; /* takes x on TD_OK */
    if (s != TD_OK) {
      td_value_unref(x);
      td_value_unref(l);
      return s;
    }
  }
  *res = l;
  return TD_OK;
}

/* ps_ckpt(epoch, step, batches_per_epoch) -> future completed when every trainer arrived and the
 * server wrote the checkpoint (the last one to arrive writes it on its handler thread: a write,
 * not a wait on other work). */
static td_status ps_ckpt(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                         td_future **fut) {
  int64_t v[3];
  if (n != 3) return td_set_error(TD_ERR_INVALID, "ps_ckpt: expected 3 arguments");
  for (int i = 0; i < 3; i++) {
    td_status s = td_value_as_int(args[i], &v[i]);
    if (s != TD_OK) return s;
  }
  if (!ft.path[0]) return td_set_error(TD_ERR_STATE, "ps_ckpt: no --checkpoint-dir");
  td_status s = psft_check_alive();
  if (s != TD_OK) return s;
  pthread_mutex_lock(&ft.mu);
  if (!ft.ck_done) ft.ck_done = td_future_create();
  if (!ft.ck_done) {
    pthread_mutex_unlock(&ft.mu);
    return TD_ERR_NOMEM;
  }
  *fut = td_future_ref(ft.ck_done);
  if (++ft.ck_arrived == ft.trainers) {
    s = ckpt_save(v[0], v[1], v[2]);
    if (s == TD_OK) td_future_complete(ft.ck_done, td_value_none());
    else td_future_fail(ft.ck_done, s, "checkpoint: %s", td_last_error());
    td_future_unref(ft.ck_done);
    ft.ck_done = NULL;
    ft.ck_arrived = 0;
  }
  pthread_mutex_unlock(&ft.mu);
  return TD_OK;
}

/* ---- failure detection ---- */

void psft_register(void) {
  EX_CHECK(td_rpc_register("ps_resume", ps_resume, NULL));
  EX_CHECK(td_rpc_register("ps_ckpt", ps_ckpt, NULL));
  ex_watchdog_register();
}

td_status psft_check_alive(void) {
  if (!__atomic_load_n(&ft.failed, __ATOMIC_ACQUIRE)) return TD_OK;
  return td_set_error(TD_ERR_UNAVAILABLE, "param_server: %s", ft.failed_msg);
}

/* fail records the first failure, fails the checkpoint barrier and tells the example. */
static void fail(const char *msg) {
  pthread_mutex_lock(&ft.mu);
  bool first = !ft.failed;
  if (first) {
    snprintf(ft.failed_msg, sizeof ft.failed_msg, "%s", msg);
    __atomic_store_n(&ft.failed, 1, __ATOMIC_RELEASE);
    if (ft.ck_done) td_future_fail(ft.ck_done, TD_ERR_UNAVAILABLE, "param_server: %s", msg);
  }
  pthread_mutex_unlock(&ft.mu);
  if (first && ft.on_fail) ft.on_fail(msg);
}

_Noreturn void psft_die_failed(void) {
  if (!__atomic_exchange_n(&ft.dying, 1, __ATOMIC_ACQ_REL)) { /* main thread or watchdog: once */
    fprintf(stderr, "param_server: %s; stopping\n", ft.failed_msg);
    fflush(stderr);
  }
  struct timespec ts = {1, 0};
  nanosleep(&ts, NULL);
  _exit(1);
}

/* watchdog_failed: the examples' watchdog lost a worker (msg names it): fail what the trainers
 * wait on, tell the example, and stop the server. */
static void watchdog_failed(const char *msg) {
  fail(msg);
  psft_die_failed();
}

void psft_watchdog_start(td_rpc_agent *a, const psft_options *o, void (*on_fail)(const char *msg)) {
  ft.on_fail = on_fail;
  ex_watchdog_configure(o->keepalive_ms, o->keepalive_timeout_ms);
  ex_watchdog_start(a, on_fail ? watchdog_failed : NULL);
}

void psft_watchdog_stop(void) { ex_watchdog_stop(); }

/* ---- trainers ---- */

void psft_trainer_resume(td_rpc_agent *a, const psft_options *o, int tid, int64_t nb,
                         psft_trainer *t) {
  int64_t v[3] = {0, 0, 0};
  td_value *rv = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_resume", NULL, 0, NULL, &rv));
  for (int i = 0; i < 3; i++) EX_CHECK(td_value_as_int(td_value_list_get(rv, (size_t)i), &v[i]));
  td_value_unref(rv);
  t->start_epoch = v[0];
  t->start_step = v[1];
  t->nb = nb;
  t->every = o->ckpt_every;
  if (!v[0] && !v[1]) return;
  if (v[2] != nb || v[1] > nb)
    ex_die("trainer %d: the checkpoint has %lld batches per epoch, this run %lld (same "
           "--batch-size and --max-batches needed)", tid + 1, (long long)v[2], (long long)nb);
  fprintf(stderr, "trainer %d: resuming at epoch %lld step %lld (global step %lld)\n", tid + 1,
          (long long)v[0], (long long)v[1], (long long)(v[0] * nb + v[1]));
}

int64_t psft_trainer_first_batch(const psft_trainer *t, int epoch, td_sampler *s) {
  int64_t b0 = epoch == t->start_epoch ? t->start_step : 0;
  for (int64_t i = 0; i < b0; i++) { /* the batches the checkpoint already holds */
    const int64_t *idx = NULL;
    int64_t cnt = 0;
    EX_CHECK(td_sampler_next(s, &idx, &cnt));
  }
  return b0;
}

void psft_trainer_before_batch(td_rpc_agent *a, const psft_trainer *t, int epoch, int64_t b) {
  int64_t g = (int64_t)epoch * t->nb + b, g0 = t->start_epoch * t->nb + t->start_step;
  if (t->every <= 0 || g <= g0 || g % t->every) return;
  td_value *v[3] = {td_value_int(epoch), td_value_int(b), td_value_int(t->nb)};
  td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
  co.timeout_ms = TD_TIMEOUT_INFINITE; /* waits for the slowest trainer */
  td_value *r = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", "ps_ckpt", v, 3, &co, &r));
  td_value_unref(r);
  for (int i = 0; i < 3; i++) td_value_unref(v[i]);
}
