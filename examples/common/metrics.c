/* metrics.c - the examples' metrics files (see metrics.h). */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "watchdog.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;
static int m_rank;
static char m_worker[64];
static double t0;
static const char *rate_name = "samples_per_s";

void ex_metrics_rate_name(const char *name) { rate_name = name; }

/* run.jsonl -> run.rank1.jsonl; run -> run.rank1 */
static void rank_path(const char *path, int rank, char *buf, size_t n) {
  if (rank == 0) {
    snprintf(buf, n, "%s", path);
    return;
  }
  const char *slash = strrchr(path, '/'), *dot = strrchr(path, '.');
  if (dot && (!slash || dot > slash + 1))
    snprintf(buf, n, "%.*s.rank%d%s", (int)(dot - path), path, rank, dot);
  else
    snprintf(buf, n, "%s.rank%d", path, rank);
}

/* Writes one record: the common fields, then body's members (a JSON object's inside, may be ""). */
static void emit(const char *kind, const char *body) {
  pthread_mutex_lock(&mu);
  if (out) {
    int k = fprintf(out, "{\"kind\":\"%s\",\"rank\":%d,\"worker\":\"%s\",\"time_s\":%.6f%s%s}\n",
                    kind, m_rank, m_worker, ex_now_s() - t0, *body ? "," : "", body);
    if (k < 0 || fflush(out) != 0) {
      fprintf(stderr, "metrics: cannot write the metrics file; no more records\n");
      fclose(out);
      out = NULL;
    }
  }
  pthread_mutex_unlock(&mu);
}

void ex_metrics_open(const char *path, int rank, int world_size, const char *worker,
                     const char *example, const ex_json *config) {
  if (!path || !*path) return;
  char p[4096];
  rank_path(path, rank, p, sizeof p);
  pthread_mutex_lock(&mu);
  out = fopen(p, "w");
  m_rank = rank;
  snprintf(m_worker, sizeof m_worker, "%s", worker ? worker : "");
  t0 = ex_now_s();
  pthread_mutex_unlock(&mu);
  if (!out) ex_die("--metrics: cannot create %s", p);
  ex_json b;
  ex_json_object(&b);
  ex_json_str(&b, "example", example);
  ex_json_int(&b, "world_size", world_size);
  if (config) ex_json_child(&b, "config", config);
  char *s = ex_json_dump(&b);
  size_t n = strlen(s); /* "{...}" -> its inside */
  s[n - 1] = 0;
  emit("start", s + 1);
  free(s);
  ex_json_fini(&b);
}

bool ex_metrics_on(void) {
  pthread_mutex_lock(&mu);
  bool on = out != NULL;
  pthread_mutex_unlock(&mu);
  return on;
}

void ex_phases_add(ex_phases *p, const char *name, double seconds) {
  if (p->n >= 8) return;
  p->name[p->n] = name;
  p->s[p->n++] = seconds;
}

/* Appends ,"key":value (null for non-finite values) to buf. */
static size_t num(char *buf, size_t used, size_t n, const char *key, double v) {
  if (used >= n) return used;
  int k = isfinite(v) ? snprintf(buf + used, n - used, ",\"%s\":%.9g", key, v)
                      : snprintf(buf + used, n - used, ",\"%s\":null", key);
  return k < 0 ? used : used + (size_t)k;
}

void ex_metrics_step(int epoch, int64_t step, double loss, double lr, double samples_per_s,
                     const ex_phases *phases) {
  ex_watchdog_note_step(epoch, step); /* for the line a lost worker makes it print */
  if (!ex_metrics_on()) return;
  char b[1024];
  size_t u = (size_t)snprintf(b, sizeof b, "\"epoch\":%d,\"step\":%lld", epoch, (long long)step);
  u = num(b, u, sizeof b, "loss", loss);
  if (!isnan(lr)) u = num(b, u, sizeof b, "lr", lr);
  if (!isnan(samples_per_s)) u = num(b, u, sizeof b, rate_name, samples_per_s);
  for (int i = 0; phases && i < phases->n && u < sizeof b; i++) {
    double v = phases->s[i];
    u += (size_t)snprintf(b + u, sizeof b - u, isfinite(v) ? "%s\"%s\":%.9g" : "%s\"%s\":null",
                          i ? "," : ",\"phases\":{", phases->name[i], v);
    if (i + 1 == phases->n && u < sizeof b) u += (size_t)snprintf(b + u, sizeof b - u, "}");
  }
  if (u >= sizeof b) return; /* cannot happen with 8 short phase names */
  emit("step", b);
}

void ex_metrics_eval(int epoch, const char *metric, double value) {
  if (!ex_metrics_on()) return;
  char b[256];
  size_t u = (size_t)snprintf(b, sizeof b, "\"epoch\":%d", epoch);
  num(b, u, sizeof b, metric, value);
  emit("eval", b);
}

void ex_metrics_eval_step(int64_t step, const char *metric, double value) {
  if (!ex_metrics_on()) return;
  char b[256];
  size_t u = (size_t)snprintf(b, sizeof b, "\"step\":%lld", (long long)step);
  num(b, u, sizeof b, metric, value);
  emit("eval", b);
}

void ex_metrics_counters(td_rpc_agent *a) {
  td_rpc_stats s;
  if (!ex_metrics_on() || !a || td_rpc_get_stats(a, &s) != TD_OK) return;
  char b[1536];
  snprintf(b, sizeof b,
           "\"rpc\":{\"calls_started\":%llu,\"calls_succeeded\":%llu,\"calls_failed\":%llu,"
           "\"calls_timed_out\":%llu,\"requests_received\":%llu,\"requests_failed\":%llu,"
           "\"requests_rejected\":%llu,\"requests_expired\":%llu,\"pool_saturated\":%llu,"
           "\"refused_connections\":%llu,\"frames_sent\":%llu,\"bytes_sent\":%llu,"
           "\"frames_received\":%llu,\"bytes_received\":%llu,\"direct_bytes_sent\":%llu,"
           "\"direct_bytes_received\":%llu,\"lane_frames_sent\":%llu,\"lane_bytes_sent\":%llu,"
           "\"lane_frames_received\":%llu,\"lane_bytes_received\":%llu}",
           (unsigned long long)s.calls_started, (unsigned long long)s.calls_succeeded,
           (unsigned long long)s.calls_failed, (unsigned long long)s.calls_timed_out,
           (unsigned long long)s.requests_received, (unsigned long long)s.requests_failed,
           (unsigned long long)s.requests_rejected, (unsigned long long)s.requests_expired,
           (unsigned long long)s.pool_saturated, (unsigned long long)s.refused_connections,
           (unsigned long long)s.traffic.frames_sent, (unsigned long long)s.traffic.bytes_sent,
           (unsigned long long)s.traffic.frames_received,
           (unsigned long long)s.traffic.bytes_received,
           (unsigned long long)s.traffic.direct_bytes_sent,
           (unsigned long long)s.traffic.direct_bytes_received,
           (unsigned long long)s.traffic.lane_frames_sent,
           (unsigned long long)s.traffic.lane_bytes_sent,
           (unsigned long long)s.traffic.lane_frames_received,
           (unsigned long long)s.traffic.lane_bytes_received);
  emit("counters", b);
}

void ex_metrics_close(void) {
  pthread_mutex_lock(&mu);
  if (out) fclose(out);
  out = NULL;
  pthread_mutex_unlock(&mu);
}
