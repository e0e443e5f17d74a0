/* shutdown.c - the graceful shutdown barrier (PyTorch semantics), td_rpc_shutdown and
 * td_rpc_destroy.
 *
 * Every worker announces arrival in the store (sd/arrived/<r>), then keeps publishing
 * "idle:sent:served" (sd/status/<r>); rank 0 declares the group done (sd/go) once every worker has
 * arrived, all are idle, the totals balance, and two consecutive snapshots agree (so
 * fire-and-forget chains finish). The totals count frames the transport accepted (plus calls to
 * self); when a stream closes, the frames that went out on it are taken back out (serve.c), so a
 * request lost with a dead stream cannot unbalance the totals forever. After its deadline a
 * worker fails everything outstanding and reports the workers that never arrived.
 *
 * Lock order: a->mu only (briefly, to mark the agent shut).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

#include "../core/flight_impl.h"
#include "agent_state.h"
#include "tdist/trace.h"

/* How long past its deadline a shutdown may take to tear down (store kept up for the others,
 * handlers finishing, the transport closing). */
#define TD__SHUTDOWN_GRACE_MS 900

static void sleep_ms(int64_t ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ---- the graceful barrier ----
 * Each worker loops through: publish (its idle flag and totals), then go? (sd/go set: done).
 * Rank 0 adds a third step, judge: it reads every status; the group is done when all are idle,
 * sent == served, and this snapshot equals the previous one; then it sets sd/go. A round is one
 * store request per worker (rank 0's judge: a few range reads more). Between rounds a worker
 * sleeps with backoff (1 ms doubling to 20 ms, or world ms in groups past 20 workers, so the
 * store sees at most about 1,000 requests a second from the whole group) until the deadline. */

typedef struct judge {
  int64_t *prev, *cur; /* [world][sent, served] of the last two snapshots */
  char **vals;         /* [world] the statuses read this round */
  size_t *lens;
  bool have_prev;
  int members; /* places taken (an elastic group's joiners arrive too): this round's, the last */
  int members_prev;
} judge;

/* One request per round: the status when it changed since the last round (asking about sd/go in
 * the same request), else only whether sd/go is set: a wait for it parked at the store for up to
 * wait_ms (*waited: the round's pause is spent), or a plain read. last: the status published
 * last. */
static td_status barrier_publish(td_rpc_agent *a, char *last, size_t ln, int64_t wait_ms,
                                 bool *go, bool *waited) {
  char key[64], val[128];
  bool idle = __atomic_load_n(&a->pending_out, __ATOMIC_ACQUIRE) == 0 &&
              __atomic_load_n(&a->active_in, __ATOMIC_ACQUIRE) == 0;
  int n = snprintf(val, sizeof val, "%d:%lld:%lld", idle ? 1 : 0,
                   (long long)__atomic_load_n(&a->sent_total, __ATOMIC_ACQUIRE),
                   (long long)__atomic_load_n(&a->served_total, __ATOMIC_ACQUIRE));
  if (strcmp(val, last) == 0) {
    if (wait_ms <= 100 || a->sc.park_ms <= 0)
      return td__store_get(&a->sc, "sd/go", NULL, NULL, go);
    *waited = true;
    td_status st = td__store_wait_key(&a->sc, "sd/go", td__now_ns() + (uint64_t)wait_ms * 1000000ull,
                                      NULL, NULL, NULL);
    *go = st == TD_OK;
    return st == TD_ERR_TIMEOUT ? TD_OK : st;
  }
  snprintf(key, sizeof key, "sd/status/%d", a->rank);
  TD_TRY(td__store_set_watch(&a->sc, key, val, (size_t)n, "sd/go", go));
  snprintf(last, ln, "%s", val);
  return TD_OK;
}

/* Rank 0 reads every status in a few range requests: *all when every worker has published. */
static td_status barrier_read(td_rpc_agent *a, int members, char **vals, size_t *lens,
                              bool *all) {
  int got = 0;
  *all = false;
  while (got < members) {
    int n = 0;
    TD_TRY(td__store_range(&a->sc, "sd/status/", got, members - got, (uint8_t **)vals + got,
                           lens + got, &n));
    if (n == 0) break;
    got += n;
  }
  *all = got == members;
  for (int r = got; r < members; r++) vals[r] = NULL;
  return TD_OK;
}

static void judge_free(judge *j) {
  td__free(j->prev);
  td__free(j->cur);
  td__free(j->vals);
  td__free(j->lens);
}

/* Rank 0: *done when the group may stop (sd/go is then set); *settled when every worker has
 * published and is idle (the backoff restarts). */
static td_status barrier_judge(td_rpc_agent *a, judge *j, bool *done, bool *settled) {
  bool all;
  int64_t sent = 0, served = 0;
  j->members_prev = j->members;
  TD_TRY(td__agent_members(a, &j->members));
  if (j->members != j->members_prev) j->have_prev = false; /* a worker joined meanwhile */
  int m = j->members;
  TD_TRY(barrier_read(a, m, j->vals, j->lens, &all));
  for (int r = 0; r < m && all; r++) {
    int i = 0;
    long long s = 0, d = 0;
    sscanf(j->vals[r], "%d:%lld:%lld", &i, &s, &d);
    all = i == 1;
    j->cur[2 * r] = s;
    j->cur[2 * r + 1] = d;
    sent += s;
    served += d;
  }
  for (int r = 0; r < m; r++) {
    td__free(j->vals[r]);
    j->vals[r] = NULL;
  }
  size_t bytes = (size_t)m * 2 * sizeof(int64_t);
  *done = all && sent == served && j->have_prev && memcmp(j->prev, j->cur, bytes) == 0;
  *settled = all;
  if (*done) return td__store_set(&a->sc, "sd/go", "1", 1);
  if (all) memcpy(j->prev, j->cur, bytes);
  j->have_prev = all;
  return TD_OK;
}

/* After a timeout: names the workers that never arrived (rank 0 keeps the store up briefly until
 * the others have read the same). */
static td_status barrier_timed_out(td_rpc_agent *a, uint64_t hard) {
  char missing[900] = "";
  size_t used = 0;
  int arrived = 0, members = a->world0;
  td__agent_members(a, &members);
  for (int r = 0; r < members; r++) {
    char key[64];
    bool found = true;
    snprintf(key, sizeof key, "sd/arrived/%d", r);
    if (td__store_get(&a->sc, key, NULL, NULL, &found) != TD_OK) continue; /* store gone */
    arrived += found;
    if (!found) td__agent_learn_rank(a, r); /* (a joiner's name, for the message) */
    if (!found && used < sizeof missing - 1)
      used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%s (rank %d)",
                               used ? ", " : "", td__agent_peer_name(a, r), r);
  }
  td__store_add(&a->sc, "sd/timedout", 1, NULL);
  if (a->rank == 0) {
    uint64_t dl = td__now_ns() + 1000000000ull, until = hard - TD__SHUTDOWN_GRACE_MS * 500000ull;
    td__store_wait_ge(&a->sc, "sd/timedout", arrived, dl < until ? dl : until, NULL);
  }
  return td_set_error(TD_ERR_TIMEOUT, "rpc shutdown: graceful shutdown timed out; %s%s",
                      used ? "workers that never called shutdown: "
                           : "every worker arrived but work was still outstanding",
                      missing);
}

/* The graceful barrier. Returns TD_OK, or TD_ERR_TIMEOUT with the missing workers named. */
static td_status barrier(td_rpc_agent *a, uint64_t deadline, uint64_t hard) {
  char key[64];
  snprintf(key, sizeof key, "sd/arrived/%d", a->rank);
  TD_TRY(td__store_set(&a->sc, key, "1", 1));
  judge j = {0};
  if (a->rank == 0) {
    j.prev = td__calloc((size_t)a->world * 2, sizeof(int64_t));
    j.cur = td__calloc((size_t)a->world * 2, sizeof(int64_t));
    j.vals = td__calloc((size_t)a->world, sizeof *j.vals);
    j.lens = td__calloc((size_t)a->world, sizeof *j.lens);
    if (!j.prev || !j.cur || !j.vals || !j.lens) {
      judge_free(&j);
      return td_set_error(TD_ERR_NOMEM, "rpc shutdown: out of memory");
    }
  }
  int64_t backoff = 1;
  td_status st;
  char last[128] = "";
  for (;;) {
    bool go = false, done = false, settled = false, waited = false;
    /* (rank 0 reads every status each round: it never waits at the store) */
    uint64_t now = td__now_ns();
    int64_t left_ms = deadline > now ? (int64_t)((deadline - now) / 1000000u) : 0;
    int64_t wait_ms = a->rank == 0 ? 0 : backoff < left_ms ? backoff : left_ms;
    st = barrier_publish(a, last, sizeof last, wait_ms, &go, &waited);
    if (st == TD_OK && go) break;
    if (st == TD_OK && a->rank == 0) {
      st = barrier_judge(a, &j, &done, &settled);
      if (st == TD_OK && done) break;
      if (st == TD_OK && settled) backoff = 1;
    }
    if (st == TD_ERR_TIMEOUT && td__now_ns() < deadline) {
      /* one store call outlived its own timeout (10 s) while the barrier has time left: rank 0
       * starved on a crowded host (256 workers on 2 CPUs), not gone (that is UNAVAILABLE). Every
       * step of a round can be repeated, so the next round asks again. */
      td_log(TD_LOG_DEBUG, "rpc: %s: shutdown barrier: %s; asking again", a->name,
             td_last_error());
      st = TD_OK;
    }
    if (st != TD_OK) break;
    if (td__now_ns() >= deadline) {
      st = TD_ERR_TIMEOUT;
      break;
    }
    td__progress_pump_if_owner(a); /* host mode, on the progress thread: what is queued */
    if (!waited) sleep_ms(backoff);
    int64_t most = a->world > 20 ? a->world : 20;
    backoff = backoff * 2 > most ? most : backoff * 2;
  }
  judge_free(&j);
  if (st == TD_ERR_TIMEOUT) return barrier_timed_out(a, hard);
  if (st != TD_OK) return td__error_prefix(st, "rpc shutdown: lost the rendezvous store");
  return TD_OK;
}

/* The handlers still running when the pool did not drain by the hard deadline are abandoned: the
 * agent stays allocated for them (td_rpc_destroy then frees nothing) and the message names them. */
static td_status abandon_handlers(td_rpc_agent *a, char *msg, size_t n) {
  char held[700];
  int k = td__serve_running(a, held, sizeof held);
  size_t running, queued;
  td__threadpool_load(a->pool, &running, &queued, NULL);
  a->abandoned = true;
  snprintf(msg, n, "rpc shutdown: %s: the deadline passed with %zu handler%s still running "
           "(abandoned: they finish on their own and their replies are dropped)%s%s%s", a->name,
           running, running == 1 ? "" : "s", k ? ": " : "", held,
           queued ? "; tasks still queued behind them" : "");
  td_log(TD_LOG_WARN, "%s", msg);
  return TD_ERR_TIMEOUT;
}

/* With TD_SUMMARY_DIR set (tdistrun --summary), the agent's totals go to DIR/<rank>.txt as
 * "key value" lines (written to a temporary name, then renamed) for the launcher's table. */
static void write_summary(td_rpc_agent *a) {
  const char *dir = getenv("TD_SUMMARY_DIR");
  if (!dir || !*dir) return;
  td_rpc_stats s;
  if (td_rpc_get_stats(a, &s) != TD_OK) return;
  char tmp[4096], path[4096];
  snprintf(tmp, sizeof tmp, "%s/.%d.tmp", dir, a->rank);
  snprintf(path, sizeof path, "%s/%d.txt", dir, a->rank);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  fprintf(f, "name %s\nrank %d\ncalls %llu\ncalls_failed %llu\ncalls_timed_out %llu\n"
          "requests %llu\nrequests_failed %llu\nbytes_sent %llu\nbytes_received %llu\n"
          "direct_bytes_sent %llu\ndirect_bytes_received %llu\nhandler_s %.3f\nsync_wait_s %.3f\n",
          a->name, a->rank, (unsigned long long)s.calls_started,
          (unsigned long long)s.calls_failed, (unsigned long long)s.calls_timed_out,
          (unsigned long long)s.requests_received, (unsigned long long)s.requests_failed,
          /* frames move over the gRPC stream or the same-host lane: both are "sent" */
          (unsigned long long)(s.traffic.bytes_sent + s.traffic.lane_bytes_sent),
          (unsigned long long)(s.traffic.bytes_received + s.traffic.lane_bytes_received),
          (unsigned long long)s.traffic.direct_bytes_sent,
          (unsigned long long)s.traffic.direct_bytes_received, (double)s.handler_ns * 1e-9,
          (double)s.sync_wait_ns * 1e-9);
  /* every blocking wait of the process (futures, RRef fetches, distributed backward, collectives
   * on the caller's thread), and its time inside collectives (straggler scores) */
  td__wait_totals w;
  td__flight_wait_totals(&w);
  fprintf(f, "wait_s %.3f\ncoll_s %.3f\ncoll_ops %llu\n", (double)w.wait_ns * 1e-9,
          (double)w.coll_ns * 1e-9, (unsigned long long)w.coll_n);
  if (fclose(f) == 0) rename(tmp, path);
  else unlink(tmp);
}

td_status td_rpc_shutdown(td_rpc_agent *a, bool graceful, td_timeout_ms timeout_ms) {
  TD_CHECK_ARG(a, "rpc_shutdown: NULL agent");
  TD_CHECK_ARG(td__timeout_valid(timeout_ms), "rpc_shutdown: invalid timeout %lld",
               (long long)timeout_ms);
  pthread_mutex_lock(&a->mu);
  bool already = a->shut;
  a->shut = true;
  pthread_mutex_unlock(&a->mu);
  if (already) return TD_OK;
  uint64_t deadline =
      td__deadline_ns(td__timeout_resolve(timeout_ms, td_rpc_get_default_timeout(a)));
  /* everything after the barrier - the store kept up for the others, running handlers, the
   * transport - gets until `hard`, so shutdown returns within its deadline + 1 s */
  uint64_t hard = deadline == TD__NO_DEADLINE ? TD__NO_DEADLINE
                                              : deadline + TD__SHUTDOWN_GRACE_MS * 1000000ull;
  td__store_set_deadline(&a->sc, hard); /* a dead or slow rank 0 cannot stretch it either */
  /* every worker tears its connections down at once after the barrier, and rank 0, one process
   * among them, serves the store meanwhile: 256 workers on 2 CPUs left rank 0 answering nothing
   * for over 10 s, 39 workers' 'sd/exited' were lost, rank 0 left before the last worker saw
   * "go", and that worker's shutdown failed */
  __atomic_store_n(&a->sc.call_timeout_ms, td__rdv_store_call_ms(a), __ATOMIC_RELAXED);
  td_status st = TD_OK;
  char msg[1024] = "";
  if (graceful) {
    /* a blocking wait on the whole group: open in the flight recorder (why-hung follows this
     * worker's outstanding calls from it), dumped while open when it times out */
    td__flight_ev fl = {.kind = TD__FL_SCOPE_BEGIN, .peer = -1,
                        .c = td__flight_timeout_field(td__timeout_resolve(
                            timeout_ms, td_rpc_get_default_timeout(a)))};
    td__flight_push(&fl, "rpc_shutdown");
    st = barrier(a, deadline, hard);
    if (st != TD_OK) snprintf(msg, sizeof msg, "%s", td_last_error());
    if (st == TD_ERR_TIMEOUT) td__flight_deadline("deadline of the graceful rpc_shutdown");
    fl.kind = TD__FL_SCOPE_END;
    fl.x = (uint8_t)st;
    td__flight_pop(&fl, "rpc_shutdown");
  }
  td_log(TD_LOG_DEBUG, "rpc: %s: streams opened %llu, peers reached on their streams %llu",
         a->name, (unsigned long long)__atomic_load_n(&a->cnt.streams_opened, __ATOMIC_RELAXED),
         (unsigned long long)__atomic_load_n(&a->cnt.streams_shared, __ATOMIC_RELAXED));
  td__agent_hooks hs[TD__MAX_AGENT_HOOKS];
  int nh = td__agent_hooks_get(hs);
  td_status hook_st = TD_OK;
  char hook_msg[1024] = "";
  for (int i = 0; i < nh; i++) {
    if (!hs[i].on_shutdown) continue;
    td_status s = hs[i].on_shutdown(a, graceful && st == TD_OK);
    if (s != TD_OK && hook_st == TD_OK) {
      hook_st = s;
      snprintf(hook_msg, sizeof hook_msg, "%s", td_last_error());
    }
  }
  __atomic_store_n(&a->closing, true, __ATOMIC_RELEASE);
  td__call_fail_all(a, TD_ERR_CANCELLED, graceful && st == TD_OK
                                    ? "rpc: the agent shut down"
                                    : "rpc: the agent shut down before the call finished");
  if (graceful && st == TD_OK) {
    /* rank 0 serves the store: keep it up until everybody has seen "go" */
    if (td__store_add(&a->sc, "sd/exited", 1, NULL) != TD_OK)
      td_log(TD_LOG_DEBUG, "rpc: %s: shutdown: 'sd/exited' not counted: %s", a->name,
             td_last_error());
    if (a->rank == 0) {
      /* (256 workers on 2 CPUs: a worker starved past 5 s after "go" found the store gone and
       * its shutdown failed) */
      uint64_t dl = td__now_ns() + (uint64_t)td__rdv_exit_wait_ms(a) * 1000000ull;
      uint64_t t0 = td__now_ns();
      int members = a->world0;
      td__agent_members(a, &members);
      if (td__store_wait_ge(&a->sc, "sd/exited", members, dl < hard ? dl : hard, NULL) != TD_OK)
        td_log(TD_LOG_DEBUG, "rpc: %s: shutdown: not every worker reported 'sd/exited' within "
               "%.1f s: %s", a->name, (double)(td__now_ns() - t0) / 1e9, td_last_error());
    }
  }
  /* rank 0: no worker may still need the store for its init (a graceful barrier that passed
   * proves it already) */
  if (!(graceful && st == TD_OK)) td__rdv_passed_wait(a, hard);
  td__rdv_passed_join(a); /* (our own, before the transport goes) */
  td__store_park_end(a); /* rank 0: the waits its store holds end before its server */
  td__transport_shutdown(a->tr);
  td_status pool_st = td__threadpool_shutdown_until(a->pool, hard);
  char pool_msg[1024] = "";
  if (pool_st != TD_OK) pool_st = abandon_handlers(a, pool_msg, sizeof pool_msg);
  td__progress_pump(a); /* host mode: what was queued before the pool stopped */
  if (a->trace_owned && td_trace_stop() != TD_OK)
    td_log(TD_LOG_WARN, "rpc: %s: the trace was not written: %s", a->name, td_last_error());
  td__call_fail_all(a, TD_ERR_CANCELLED, "rpc: the agent shut down");
  write_summary(a);
  if (st != TD_OK && pool_st != TD_OK)
    return td_set_error(st, "%s; %s", msg, pool_msg + strlen("rpc shutdown: "));
  if (st != TD_OK) return td_set_error(st, "%s", msg);
  if (pool_st != TD_OK) return td_set_error(pool_st, "%s", pool_msg);
  if (hook_st != TD_OK) return td_set_error(hook_st, "%s", hook_msg);
  return TD_OK;
}

void td_rpc_destroy(td_rpc_agent *a) {
  if (!a) return;
  td_rpc_shutdown(a, false, TD_TIMEOUT_ZERO);
  if (a->abandoned) {
    /* handlers still run on the pool and use the agent: stop the network, detach the pool's
     * threads and leave the memory to the process */
    td__transport_stop(a->tr);
    if (td__threadpool_destroy(a->pool)) a->pool = NULL;
    td_log(TD_LOG_DEBUG, "rpc: %s: not freed: handlers were abandoned at shutdown", a->name);
    return;
  }
  td__threadpool_destroy(a->pool);
  a->pool = NULL;
  td__transport_destroy(a->tr);
  a->tr = NULL;
  td__agent_free(a);
}
