/* store_sim.c - the rendezvous store's protocol played by N simulated workers (store_sim.h).
 *
 * One thread per worker runs the store requests of rendezvous.c and shutdown.c in their order;
 * each step names the function it follows. Requests go through the real client (store.c) and a
 * real session (auth.c) to sim_unary, which stands for rank 0's poller: one request at a time,
 * through the authenticated server (td__auth_store_serve) into the real table, counting
 * requests, bytes and server time for the phase the worker is in. Waits are parked as rank 0
 * parks them (store_park.c): the worker's thread sleeps until the request that ends its wait, or
 * the simulated tick (10 ms) that finds its time passed, answers it.
 *
 * Lock order: server_mu (the simulated poller) only.
 */
#include "store_sim.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth.h"
#include "store.h"

/* A parked request: its worker's thread waits on cv (server_mu) until answered. */
typedef struct sim_wait {
  pthread_cond_t cv;
  bool done;
  uint8_t *reply;
  size_t len;
  td__auth_seal seal;
} sim_wait;

typedef struct sim {
  const td__store_sim_opts *o;
  td__store_parker parker;
  bool stop_tick;      /* server_mu */
  td__auth auth;
  td__store *store;
  td__auth_sessions *sessions;
  pthread_mutex_t server_mu; /* the store is served by one thread */
  td__store_sim_phase phase[TD__SIM_PHASES]; /* server_mu */
  uint64_t t0_ns, end_ns;                     /* server_mu (end_ns) */
  td_status st;                               /* first failure (server_mu) */
  char why[512];
} sim;

typedef struct sim_worker {
  sim *s;
  int rank;
  int phase; /* where this worker is (its own thread) */
  td__auth_client ac;
  td__store_client sc;
} sim_worker;

static const char *const phase_names[TD__SIM_PHASES] = {"check", "publish", "join", "read",
                                                         "ready", "passed", "shutdown"};

const char *td__store_sim_phase_name(int p) {
  return p >= 0 && p < TD__SIM_PHASES ? phase_names[p] : "?";
}

/* The request being served (server_mu): what park() holds, and whether it did. */
static _Thread_local sim_wait *serving;
static _Thread_local bool serving_parked;

static void *sim_park(void *ud) {
  (void)ud;
  if (!serving) return NULL;
  td__auth_store_current_seal(&serving->seal);
  return serving;
}

/* Runs under server_mu (inside another request, or the tick). */
static void sim_answer(void *token, uint8_t *reply, size_t len) {
  sim_wait *sw = token;
  sw->reply = NULL;
  sw->len = 0;
  if (reply) td__auth_store_seal(&sw->seal, reply, len, &sw->reply, &sw->len);
  sw->done = true;
  pthread_cond_signal(&sw->cv);
}

static td_status sim_body(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                          size_t *reply_len) {
  sim *s = ctx;
  bool parked = false;
  td_status st = td__store_handle_park(s->store, req, len, reply, reply_len, &s->parker, &parked);
  if (st == TD_OK && parked) {
    *reply = NULL;
    *reply_len = 0;
  }
  serving_parked = st == TD_OK && parked;
  return st;
}

/* Rank 0's poller: one request at a time, counted for the sender's phase; a parked one's thread
 * waits for its answer. */
static td_status sim_unary(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len) {
  sim_worker *w = ctx;
  sim *s = w->s;
  sim_wait sw = {.done = false};
  pthread_cond_init(&sw.cv, NULL);
  pthread_mutex_lock(&s->server_mu);
  uint64_t t0 = td__now_ns();
  serving = &sw;
  serving_parked = false;
  td_status st = td__auth_store_serve(s->sessions, req, len, sim_body, s, reply, reply_len);
  bool parked = serving_parked; /* (its token is sw: wait for the answer in every case) */
  serving = NULL;
  td__store_sim_phase *ph = &s->phase[w->phase];
  ph->server_ns += td__now_ns() - t0;
  ph->requests++;
  ph->bytes_out += len;
  if (parked) {
    if (st == TD_OK) td__free(*reply); /* the empty reply of a parked wait */
    while (!sw.done) pthread_cond_wait(&sw.cv, &s->server_mu);
    if (st == TD_OK) {
      *reply = sw.reply;
      *reply_len = sw.len;
      if (!sw.reply) st = td_set_error(TD_ERR_UNAVAILABLE, "store sim: no answer");
    } else {
      td__free(sw.reply);
    }
  }
  ph = &s->phase[w->phase];
  ph->bytes_in += st == TD_OK ? *reply_len : 0;
  pthread_mutex_unlock(&s->server_mu);
  pthread_cond_destroy(&sw.cv);
  memset(&sw.seal, 0, sizeof sw.seal);
  return st;
}

/* rank 0's poller tick: parked waits whose time passed are answered */
static void *tick_main(void *arg) {
  sim *s = arg;
  pthread_mutex_lock(&s->server_mu);
  while (!s->stop_tick) {
    pthread_mutex_unlock(&s->server_mu);
    struct timespec ts = {0, 10000000L};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&s->server_mu);
    td__store_expire(s->store, td__now_ns());
  }
  pthread_mutex_unlock(&s->server_mu);
  return NULL;
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* rdv_prefetch: the four prefixes' records in one request; *whole[k] tells which came whole
 * (the others are read again by read_all, as td__rdv_read_all does). */
static td_status prefetch(sim_worker *w, const char *const *pre, bool *whole) {
  int n = w->s->o->world;
  uint8_t **vals[4] = {0};
  size_t *lens[4] = {0};
  int got[4] = {0};
  td_status st = TD_OK;
  for (int k = 0; k < 4; k++) {
    vals[k] = td__calloc((size_t)n, sizeof *vals[k]);
    lens[k] = td__calloc((size_t)n, sizeof *lens[k]);
    if (!vals[k] || !lens[k]) st = td_set_error(TD_ERR_NOMEM, "store sim: out of memory");
  }
  if (st == TD_OK) st = td__store_ranges(&w->sc, 4, pre, 0, n, vals, lens, got);
  for (int k = 0; k < 4; k++) {
    whole[k] = st == TD_OK && got[k] == n;
    for (int i = 0; vals[k] && i < got[k]; i++) td__free(vals[k][i]);
    td__free(vals[k]);
    td__free(lens[k]);
  }
  return st;
}

/* Waits for every value of prefix0 .. prefix<world-1> and frees them (td__rdv_read_all). */
static td_status read_all(sim_worker *w, const char *prefix, uint64_t deadline) {
  int n = w->s->o->world;
  uint8_t **vals = td__calloc((size_t)n, sizeof *vals);
  size_t *lens = td__calloc((size_t)n, sizeof *lens);
  td_status st = vals && lens ? td__store_wait_range(&w->sc, prefix, 0, n, deadline, "abort",
                                                     vals, lens)
                              : td_set_error(TD_ERR_NOMEM, "store sim: out of memory");
  for (int i = 0; vals && st == TD_OK && i < n; i++) td__free(vals[i]);
  td__free(vals);
  td__free(lens);
  return st;
}

/* rendezvous.c: rdv_wait (slices of 250 ms or world ms, the backoff carried across them). */
static td_status wait_slices(sim_worker *w, const char *key, int64_t target, uint64_t deadline) {
  int64_t backoff = 1;
  int world = w->s->o->world;
  for (;;) {
    uint64_t now = td__now_ns(), until = now + (uint64_t)(world > 250 ? world : 250) * 1000000ull;
    if (until > deadline) until = deadline;
    uint8_t *v = NULL;
    td_status st = target < 0 ? td__store_poll_key(&w->sc, key, until, "abort", &backoff, &v, NULL)
                              : td__store_poll_ge(&w->sc, key, target, until, "abort", &backoff);
    td__free(v);
    if (st != TD_ERR_TIMEOUT || td__now_ns() >= deadline) return st;
  }
}

static td_status rendezvous(sim_worker *w, uint64_t deadline) {
  const td__store_sim_opts *o = w->s->o;
  char key[64], val[600];
  int r = w->rank;
  /* rdv_check_world */
  w->phase = TD__SIM_CHECK;
  TD_TRY(wait_slices(w, "world_size", -1, deadline));
  uint8_t *rid = NULL, *mw = NULL;
  bool found = false, mw_found = false;
  TD_TRY(td__store_get2(&w->sc, "run_id", &rid, NULL, &found, "max_world_size", &mw, &mw_found));
  td__free(rid);
  td__free(mw);
  /* rdv_claim, rdv_publish (worker/, the registry, registry/, direct/, devmap/ and the count in
   * "joined": one request) */
  w->phase = TD__SIM_PUBLISH;
  snprintf(key, sizeof key, "claim/%d", r);
  TD_TRY(td__store_add(&w->sc, key, 1, NULL));
  char wkey[64], rkey[64], dkey[64], mkey[64], dval[600];
  snprintf(wkey, sizeof wkey, "worker/%d", r);
  int n = snprintf(val, sizeof val, "worker%d\t127.0.0.1:%d", r, 20000 + r);
  size_t rb = (size_t)(o->registry_bytes > 0 ? o->registry_bytes : 600);
  char *reg = td__malloc(rb);
  if (!reg) return td_set_error(TD_ERR_NOMEM, "store sim: out of memory");
  for (size_t i = 0; i < rb; i++) reg[i] = i % 20 == 19 ? '\n' : (char)('a' + i % 26);
  /* every simulated worker registers the same functions: one text, named by its hash */
  static char regname[] = "regblob/0123456789abcdef0123456789abcdef258";
  snprintf(rkey, sizeof rkey, "registry/%d", r);
  snprintf(dkey, sizeof dkey, "direct/%d", r);
  int dn = snprintf(dval, sizeof dval, "%d 0x7ffd%08x 123456789abcdef0 "
                    "0123456789abcdef0123456789abcdef 4026531836 localhost-simulated",
                    100000 + r, r * 64);
  snprintf(mkey, sizeof mkey, "devmap/%d", r);
  char *keys[5] = {wkey, regname, rkey, dkey, mkey};
  const void *vals[5] = {val, reg, regname, dval, "0\n"};
  size_t lens[5] = {(size_t)n, rb, sizeof regname - 1, (size_t)dn, 2};
  td_status st = td__store_publish(&w->sc, 5, keys, vals, lens, "joined", 1, NULL);
  td__free(reg);
  TD_TRY(st);
  /* rdv_join */
  w->phase = TD__SIM_JOIN;
  TD_TRY(wait_slices(w, "joined", o->world, deadline));
  /* rdv_read: parse_peers, td__devmap_setup, td__direct_probe (every peer on this host) */
  w->phase = TD__SIM_READ;
  static const char *const pre[4] = {"worker/", "registry/", "devmap/", "direct/"};
  bool whole[4];
  TD_TRY(prefetch(w, pre, whole));
  for (int k = 0; k < 2; k++)
    if (!whole[k]) TD_TRY(read_all(w, pre[k], deadline));
  uint8_t *blob = NULL;
  TD_TRY(td__store_get(&w->sc, regname, &blob, NULL, &found));
  td__free(blob);
  for (int k = 2; k < 4; k++)
    if (!whole[k]) TD_TRY(read_all(w, pre[k], deadline));
  /* init_trace's clock exchange (the flight recorder is on by default), before the barrier */
  for (int i = 0; r != 0 && i < (o->world <= 64 ? 8 : 2); i++) {
    int64_t now;
    TD_TRY(td__store_now(&w->sc, &now));
  }
  /* rdv_ready (directok/ and the count: one request), td__direct_learn: where workers probe
   * each other at init (no mailboxes, o->probe_at_init) each reads every worker's directok/;
   * with mailboxes (the default) pairs settle direct copy when they meet, directok/ is empty
   * and nobody reads it */
  w->phase = TD__SIM_READY;
  snprintf(key, sizeof key, "directok/%d", r);
  n = o->probe_at_init ? snprintf(val, sizeof val, "0-%d", o->world - 1) : 0;
  val[n] = 0;
  char *okkey[1] = {key};
  const void *okval[1] = {val};
  size_t oklen[1] = {(size_t)n};
  TD_TRY(td__store_publish(&w->sc, 1, okkey, okval, oklen, "ready", 1, NULL));
  TD_TRY(td__store_wait_ge(&w->sc, "ready", o->world, deadline, "abort"));
  if (o->probe_at_init) TD_TRY(read_all(w, "directok/", deadline));
  /* rdv_passed */
  w->phase = TD__SIM_PASSED;
  TD_TRY(td__store_add(&w->sc, "passed", 1, NULL));
  if (r == 0) return td__store_wait_ge(&w->sc, "passed", o->world, deadline, "abort");
  return TD_OK;
}

/* shutdown.c: barrier (barrier_publish, barrier_judge), then sd/exited. Every simulated worker is
 * idle with balanced totals, as after a finished round of calls. */
static td_status shutdown_barrier(sim_worker *w, uint64_t deadline) {
  int world = w->s->o->world, r = w->rank;
  char key[64], status[64], last[64] = "";
  w->phase = TD__SIM_SHUTDOWN;
  snprintf(key, sizeof key, "sd/arrived/%d", r);
  TD_TRY(td__store_set(&w->sc, key, "1", 1));
  int n = snprintf(status, sizeof status, "1:%d:%d", world - 1, world - 1);
  uint8_t **vals = r == 0 ? td__calloc((size_t)world, sizeof *vals) : NULL;
  size_t *lens = r == 0 ? td__calloc((size_t)world, sizeof *lens) : NULL;
  if (r == 0 && (!vals || !lens)) {
    td__free(vals);
    td__free(lens);
    return td_set_error(TD_ERR_NOMEM, "store sim: out of memory");
  }
  int64_t backoff = 1;
  bool have_prev = false;
  td_status st = TD_OK;
  for (;;) {
    bool go = false, waited = false;
    int64_t wait_ms = r == 0 ? 0 : backoff;
    if (strcmp(status, last) == 0 && wait_ms > 100) { /* barrier_publish: parked */
      waited = true;
      st = td__store_wait_key(&w->sc, "sd/go", td__now_ns() + (uint64_t)wait_ms * 1000000ull,
                              NULL, NULL, NULL);
      go = st == TD_OK;
      if (st == TD_ERR_TIMEOUT) st = TD_OK;
    } else if (strcmp(status, last) == 0) {
      st = td__store_get(&w->sc, "sd/go", NULL, NULL, &go);
    } else {
      snprintf(key, sizeof key, "sd/status/%d", r);
      st = td__store_set_watch(&w->sc, key, status, (size_t)n, "sd/go", &go);
      snprintf(last, sizeof last, "%s", status);
    }
    if (st != TD_OK || go) break;
    if (r == 0) { /* barrier_judge: every status, in range requests */
      int got = 0;
      while (got < world && st == TD_OK) {
        int k = 0;
        st = td__store_range(&w->sc, "sd/status/", got, world - got, vals + got, lens + got, &k);
        if (k == 0) break;
        got += k;
      }
      for (int i = 0; i < got; i++) td__free(vals[i]);
      if (st != TD_OK) break;
      bool all = got == world;
      if (all && have_prev) {
        st = td__store_set(&w->sc, "sd/go", "1", 1);
        break;
      }
      have_prev = all;
      if (all) backoff = 1;
    }
    if (td__now_ns() >= deadline) {
      st = td_set_error(TD_ERR_TIMEOUT, "store sim: rank %d: the shutdown barrier timed out", r);
      break;
    }
    if (!waited) sleep_ms(backoff);
    int64_t most = world > 20 ? world : 20;
    backoff = backoff * 2 > most ? most : backoff * 2;
  }
  td__free(vals);
  td__free(lens);
  TD_TRY(st);
  TD_TRY(td__store_add(&w->sc, "sd/exited", 1, NULL));
  if (r == 0) {
    uint64_t dl = td__now_ns() + 5000000000ull;
    return td__store_wait_ge(&w->sc, "sd/exited", world, dl < deadline ? dl : deadline, NULL);
  }
  return TD_OK;
}

static void *worker_main(void *arg) {
  sim_worker *w = arg;
  sim *s = w->s;
  const td__store_sim_opts *o = s->o;
  if (o->stagger_ms > 0 && o->world > 1)
    sleep_ms((int64_t)o->stagger_ms * w->rank / (o->world - 1));
  uint64_t deadline = td__now_ns() + (uint64_t)(o->timeout_ms > 0 ? o->timeout_ms : 120000) *
                                         1000000ull;
  td_status st = rendezvous(w, deadline);
  if (st == TD_OK) st = shutdown_barrier(w, deadline);
  pthread_mutex_lock(&s->server_mu);
  uint64_t now = td__now_ns();
  if (now > s->end_ns) s->end_ns = now;
  if (st != TD_OK && s->st == TD_OK) {
    s->st = st;
    snprintf(s->why, sizeof s->why, "rank %d: %s", w->rank, td_last_error());
  }
  pthread_mutex_unlock(&s->server_mu);
  return NULL;
}

td_status td__store_sim_run(const td__store_sim_opts *o, td__store_sim_result *out) {
  TD_CHECK_ARG(o && out && o->world >= 1, "store sim: bad arguments");
  td__auth_crypto_init();
  sim s;
  memset(&s, 0, sizeof s);
  s.o = o;
  pthread_mutex_init(&s.server_mu, NULL);
  uint8_t rnd[32];
  char secret[65];
  td_status st = td__auth_random(rnd, sizeof rnd);
  for (int i = 0; i < 32; i++) snprintf(secret + 2 * i, 3, "%02x", rnd[i]);
  if (st == TD_OK) st = td__auth_init(&s.auth, secret, 64);
  if (st == TD_OK) st = td__store_create(&s.store);
  if (st == TD_OK) st = td__auth_sessions_create(&s.auth, o->world, &s.sessions);
  char ws[32];
  int n = snprintf(ws, sizeof ws, "%d", o->world);
  if (st == TD_OK) st = td__store_local_set(s.store, "world_size", ws, (size_t)n);
  if (st == TD_OK) st = td__store_local_set(s.store, "run_id", "", 0);
  sim_worker *ws_ = st == TD_OK ? td__calloc((size_t)o->world, sizeof *ws_) : NULL;
  pthread_t *th = st == TD_OK ? td__calloc((size_t)o->world, sizeof *th) : NULL;
  if (st == TD_OK && (!ws_ || !th)) st = td_set_error(TD_ERR_NOMEM, "store sim: out of memory");
  s.parker = (td__store_parker){sim_park, sim_answer, &s};
  pthread_t ticker;
  bool ticking = st == TD_OK && pthread_create(&ticker, NULL, tick_main, &s) == 0;
  if (st == TD_OK && !ticking) st = td_set_error(TD_ERR_NOMEM, "store sim: no tick thread");
  int started = 0;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setstacksize(&at, 256u << 10);
  s.t0_ns = td__now_ns();
  for (int r = 0; st == TD_OK && r < o->world; r++) {
    sim_worker *w = &ws_[r];
    w->s = &s;
    w->rank = r;
    td__auth_client_init(&w->ac, &s.auth);
    w->sc.auth = &w->ac;
    w->sc.unary_fn = sim_unary;
    w->sc.unary_ctx = w;
    snprintf(w->sc.address, sizeof w->sc.address, "simulated");
    w->sc.call_timeout_ms = 60000;
    /* init_transport: N workers polling a wait, at most about 1,000 requests a second */
    w->sc.max_backoff_ms = o->world > 50 ? o->world : 50;
    w->sc.park_ms = TD__STORE_PARK_MAX_MS;
    if (pthread_create(&th[r], &at, worker_main, w) != 0) {
      td__auth_client_fini(&w->ac);
      st = td_set_error(TD_ERR_NOMEM, "store sim: cannot start worker %d's thread", r);
      break;
    }
    started++;
  }
  pthread_attr_destroy(&at);
  for (int r = 0; r < started; r++) {
    pthread_join(th[r], NULL);
    td__auth_client_fini(&ws_[r].ac);
  }
  if (ticking) {
    pthread_mutex_lock(&s.server_mu);
    s.stop_tick = true;
    pthread_mutex_unlock(&s.server_mu);
    pthread_join(ticker, NULL);
  }
  if (st == TD_OK && s.st != TD_OK) st = td_set_error(s.st, "store sim: %s", s.why);
  if (st == TD_OK) {
    memcpy(out->phase, s.phase, sizeof out->phase);
    out->wall_s = (double)(s.end_ns - s.t0_ns) * 1e-9;
  }
  td__free(ws_);
  td__free(th);
  td__auth_sessions_destroy(s.sessions);
  td__store_destroy(s.store);
  pthread_mutex_destroy(&s.server_mu);
  return st;
}
