/* example_util.c - argument parsing, progress bar, JSON output, clocks (see example_util.h).
 *
 * Lock order: an ex_reports' mu and an ex_handout's mu are leaves (held only to update or read
 * their own fields).
 */
#define _GNU_SOURCE
#include "example_util.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "watchdog.h"

/* OpenBLAS thread control (cblas.h declares these; the library links OpenBLAS). */
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);

static const char *g_prog = "example";

/* ---- errors ---- */

void ex_check(td_status s, const char *what, const char *file, int line) {
  if (s == TD_OK) return;
  const char *msg = td_last_error();
  fprintf(stderr, "%s: %s\n", g_prog, *msg ? msg : td_status_str(s));
  if (td_log_get_level() <= TD_LOG_DEBUG) /* where, for whoever debugs the example */
    fprintf(stderr, "%s: (%s:%d: %s returned %s)\n", g_prog, file, line, what,
            td_status_name(s));
  exit(1);
}

_Noreturn void ex_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", g_prog);
  vfprintf(stderr, fmt, ap);
  char where[96]; /* which step failed, for a job that stopped on a lost worker */
  const char *rank = getenv("RANK");
  if (ex_watchdog_where(where, sizeof where))
    fprintf(stderr, " (this worker%s%s%s was %s)", rank ? ", rank " : "", rank ? rank : "",
            rank ? "," : "", where);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* ---- command-line arguments ---- */

void ex_args_init(ex_args *a) {
  memset(a, 0, sizeof *a);
  a->epochs = 1;
  a->batch_size = 64;
  a->lr = 0.1;
  a->model = "mlp";
  a->device = "cpu";
}

static const char *type_meta(ex_opt_type t) {
  switch (t) {
  case EX_OPT_INT:
  case EX_OPT_I64:
  case EX_OPT_U64: return "N";
  case EX_OPT_DOUBLE: return "X";
  case EX_OPT_STRING: return "TEXT";
  case EX_OPT_FLAG: return "";
  }
  return "";
}

/* format_default writes o's current value (the default, before parsing) into buf; "" when it
 * has none to show (a flag, a NULL string). */
static void format_default(const ex_opt *o, char *buf, size_t n) {
  buf[0] = '\0';
  switch (o->type) {
  case EX_OPT_INT: snprintf(buf, n, "%d", *(const int *)o->dst); break;
  case EX_OPT_I64: snprintf(buf, n, "%lld", (long long)*(const int64_t *)o->dst); break;
  case EX_OPT_U64: snprintf(buf, n, "%llu", (unsigned long long)*(const uint64_t *)o->dst); break;
  case EX_OPT_DOUBLE: snprintf(buf, n, "%g", *(const double *)o->dst); break;
  case EX_OPT_STRING: {
    const char *v = *(const char *const *)o->dst;
    if (v) snprintf(buf, n, "%s", v);
    break;
  }
  case EX_OPT_FLAG: break;
  }
}

/* omitted says whether the example left the common option name out (ex_args.omit). */
static bool omitted(const char *omit, const char *name) {
  size_t len = strlen(name);
  for (const char *p = omit; p && (p = strstr(p, name)) != NULL; p += len)
    if ((p == omit || p[-1] == ' ') && (p[len] == ' ' || p[len] == '\0')) return true;
  return false;
}

/* usage prints the options of both tables with the defaults captured before parsing (defs). */
static void usage(const char *about, const ex_opt *const tab[2], const int ntab[2],
                  char (*const defs[2])[48], const char *omit, FILE *f) {
  fprintf(f, "%s\nusage: %s [options]\n", about ? about : "", g_prog);
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < ntab[k]; i++) {
      const ex_opt *o = &tab[k][i];
      if (k == 0 && omitted(omit, o->name)) continue;
      char left[64];
      snprintf(left, sizeof left, "--%s %s", o->name, type_meta(o->type));
      fprintf(f, "  %-24s %s", left, o->help ? o->help : "");
      if (defs[k][i][0]) fprintf(f, " (default: %s)", defs[k][i]);
      fputc('\n', f);
    }
  }
  fprintf(f, "  %-24s %s\n", "--help", "print this help");
}

/* set_value converts text for option o; false on a bad value. */
static bool set_value(const ex_opt *o, const char *text) {
  char *end = NULL;
  errno = 0;
  switch (o->type) {
  case EX_OPT_INT: {
    long v = strtol(text, &end, 0);
    if (errno || *end || end == text || v < -2147483647L || v > 2147483647L) return false;
    *(int *)o->dst = (int)v;
    return true;
  }
  case EX_OPT_I64: {
    long long v = strtoll(text, &end, 0);
    if (errno || *end || end == text) return false;
    *(int64_t *)o->dst = v;
    return true;
  }
  case EX_OPT_U64: {
    if (text[0] == '-') return false;
    unsigned long long v = strtoull(text, &end, 0);
    if (errno || *end || end == text) return false;
    *(uint64_t *)o->dst = v;
    return true;
  }
  case EX_OPT_DOUBLE: {
    double v = strtod(text, &end);
    if (errno || *end || end == text) return false;
    *(double *)o->dst = v;
    return true;
  }
  case EX_OPT_STRING: *(const char **)o->dst = text; return true;
  case EX_OPT_FLAG: *(bool *)o->dst = true; return true;
  }
  return false;
}

void ex_args_parse(int argc, char **argv, ex_args *a, const ex_opt *extra, int n_extra,
                   const char *about) {
  if (argc > 0 && argv[0]) {
    const char *slash = strrchr(argv[0], '/');
    g_prog = slash ? slash + 1 : argv[0];
  }
  const ex_opt common[] = {
      {"epochs", EX_OPT_INT, &a->epochs, "passes over the training data"},
      {"max-batches", EX_OPT_I64, &a->max_batches, "stop each epoch after N batches (0: all)"},
      {"batch-size", EX_OPT_I64, &a->batch_size, "samples per batch"},
      {"lr", EX_OPT_DOUBLE, &a->lr, "learning rate"},
      {"seed", EX_OPT_U64, &a->seed, "initialisation and shuffling seed"},
      {"model", EX_OPT_STRING, &a->model, "model: mlp or cnn"},
      {"data-dir", EX_OPT_STRING, &a->data_dir,
       "data directory (when not given: $TD_DATA_DIR, else /usr/share/datasets/fashion-mnist)"},
      {"threads", EX_OPT_INT, &a->threads, "BLAS threads (0: library default)"},
      {"device", EX_OPT_STRING, &a->device, "cpu, cuda or cuda:N"},
      {"metrics", EX_OPT_STRING, &a->metrics,
       "write JSON lines of every step and evaluation to FILE (rank r > 0: FILE with .rank<r> "
       "before its extension); scripts/plot.py draws them"},
  };
  const int n_common = (int)(sizeof common / sizeof common[0]);
  /* --help shows the defaults: the values before parsing (an example sets its own first) */
  char common_defs[sizeof common / sizeof common[0]][48], (*extra_defs)[48] = NULL;
  if (n_extra > 0 && !(extra_defs = calloc((size_t)n_extra, sizeof *extra_defs)))
    ex_die("out of memory");
  for (int i = 0; i < n_common; i++) format_default(&common[i], common_defs[i], 48);
  for (int i = 0; i < n_extra; i++) format_default(&extra[i], extra_defs[i], 48);
  const ex_opt *const tab[2] = {common, extra};
  const int ntab[2] = {n_common, n_extra};
  char (*const defs[2])[48] = {common_defs, extra_defs};
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
      usage(about, tab, ntab, defs, a->omit, stdout);
      exit(0);
    }
    if (strncmp(arg, "--", 2) != 0) {
      fprintf(stderr, "%s: unexpected argument '%s' (try --help)\n", g_prog, arg);
      exit(2);
    }
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    const ex_opt *o = NULL;
    for (int k = 0; k < 2 && !o; k++) {
      const ex_opt *tab = k ? extra : common;
      int m = k ? n_extra : n_common;
      for (int j = 0; j < m; j++)
        if (strlen(tab[j].name) == len && !strncmp(tab[j].name, name, len) &&
            !(k == 0 && omitted(a->omit, tab[j].name))) {
          o = &tab[j];
          break;
        }
    }
    if (!o) {
      fprintf(stderr, "%s: unknown option '%s' (try --help)\n", g_prog, arg);
      exit(2);
    }
    const char *value;
    if (o->type == EX_OPT_FLAG) {
      if (eq) {
        fprintf(stderr, "%s: option --%s takes no value\n", g_prog, o->name);
        exit(2);
      }
      value = "";
    } else if (eq) {
      value = eq + 1;
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      fprintf(stderr, "%s: option --%s needs a value\n", g_prog, o->name);
      exit(2);
    }
    if (!set_value(o, value)) {
      fprintf(stderr, "%s: bad value '%s' for --%s\n", g_prog, value, o->name);
      exit(2);
    }
  }
  if (a->epochs < 0 || a->batch_size <= 0 || a->max_batches < 0 || a->threads < 0) {
    fprintf(stderr, "%s: --epochs, --max-batches and --threads must be >= 0, --batch-size > 0\n",
            g_prog);
    exit(2);
  }
  if (a->threads > 0) openblas_set_num_threads(a->threads);
  free(extra_defs);
}

int ex_blas_threads(void) { return openblas_get_num_threads(); }

void ex_blas_set_threads(int n) {
  if (n > 0) openblas_set_num_threads(n);
}

void ex_opts_parse(int argc, char **argv, const ex_opt *opts, int n, const char *about) {
  ex_args a; /* the common options, every one left out */
  ex_args_init(&a);
  a.omit = "epochs max-batches batch-size lr seed model data-dir threads device metrics";
  ex_args_parse(argc, argv, &a, opts, n, about);
}

/* ---- progress bar ---- */

#define BAR_WIDTH 30

void ex_progress_start(ex_progress *p, const char *label, int64_t total) {
  memset(p, 0, sizeof *p);
  snprintf(p->label, sizeof p->label, "%s", label ? label : "");
  p->total = total > 0 ? total : 0;
  p->tty = isatty(STDERR_FILENO) == 1;
  p->last_decile = 0;
  p->t0 = ex_now_s();
  p->last_draw = -1;
}

static void draw(ex_progress *p, const char *suffix, bool final) {
  double el = ex_now_s() - p->t0;
  double rate = el > 0 ? (double)p->done / el : 0;
  char line[512];
  int n;
  if (p->total > 0) {
    double frac = (double)p->done / (double)p->total;
    if (frac > 1) frac = 1;
    int fill = (int)(frac * BAR_WIDTH + 0.5);
    char bar[BAR_WIDTH + 1];
    for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < fill ? '#' : '.';
    bar[BAR_WIDTH] = 0;
    char eta[32] = "";
    if (!final && rate > 0) snprintf(eta, sizeof eta, " eta %.0fs", (double)(p->total - p->done) / rate);
    n = snprintf(line, sizeof line, "%s [%s] %3d%% %lld/%lld %.1fs%s %.1f it/s%s%s", p->label,
                 bar, (int)(frac * 100), (long long)p->done, (long long)p->total, el, eta, rate,
                 suffix && *suffix ? " " : "", suffix ? suffix : "");
  } else {
    n = snprintf(line, sizeof line, "%s %lld %.1fs %.1f it/s%s%s", p->label, (long long)p->done,
                 el, rate, suffix && *suffix ? " " : "", suffix ? suffix : "");
  }
  if (n < 0) return;
  if (n >= (int)sizeof line) n = (int)sizeof line - 1;
  if (p->tty) {
    int pad = p->drawn_width > n ? p->drawn_width - n : 0;
    fprintf(stderr, "\r%s%*s%s", line, pad, "", final ? "\n" : "");
    p->drawn_width = final ? 0 : n;
  } else {
    fprintf(stderr, "%s\n", line);
  }
  fflush(stderr);
}

void ex_progress_update(ex_progress *p, int64_t done, const char *fmt, ...) {
  p->done = done;
  bool due;
  if (p->tty) {
    double now = ex_now_s();
    due = p->last_draw < 0 || now - p->last_draw >= 0.1;
    if (due) p->last_draw = now;
  } else {
    int decile = p->total > 0 ? (int)(10 * done / p->total) : 0;
    due = decile > p->last_decile && decile < 10; /* 100% is left to finish */
    if (due) p->last_decile = decile;
  }
  if (!due) return;
  char suffix[256] = "";
  va_list ap;
  va_start(ap, fmt);
  if (fmt) vsnprintf(suffix, sizeof suffix, fmt, ap);
  va_end(ap);
  draw(p, suffix, false);
}

void ex_progress_finish(ex_progress *p, const char *fmt, ...) {
  char suffix[256] = "";
  va_list ap;
  va_start(ap, fmt);
  if (fmt) vsnprintf(suffix, sizeof suffix, fmt, ap);
  va_end(ap);
  draw(p, suffix, true);
}

/* ---- JSON ---- */

static char *xstrdup(const char *s) {
  char *d = strdup(s);
  if (!d) ex_die("out of memory");
  return d;
}

void ex_json_object(ex_json *j) {
  memset(j, 0, sizeof *j);
  j->is_array = false;
}

void ex_json_array(ex_json *j) {
  memset(j, 0, sizeof *j);
  j->is_array = true;
}

void ex_json_fini(ex_json *j) {
  if (!j) return;
  for (int i = 0; i < j->n; i++) {
    free(j->keys[i]);
    free(j->values[i]);
  }
  free(j->keys);
  free(j->values);
  memset(j, 0, sizeof *j);
}

/* quote returns s as a JSON string literal in a malloc'd buffer. */
static char *quote(const char *s) {
  size_t n = strlen(s), cap = 2 * n + 3 + 6 * 8, len = 0;
  char *out = malloc(cap);
  if (!out) ex_die("out of memory");
  out[len++] = '"';
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (len + 8 >= cap) {
      cap *= 2;
      out = realloc(out, cap);
      if (!out) ex_die("out of memory");
    }
    switch (*c) {
    case '"': len += (size_t)sprintf(out + len, "\\\""); break;
    case '\\': len += (size_t)sprintf(out + len, "\\\\"); break;
    case '\n': len += (size_t)sprintf(out + len, "\\n"); break;
    case '\t': len += (size_t)sprintf(out + len, "\\t"); break;
    case '\r': len += (size_t)sprintf(out + len, "\\r"); break;
    default:
      if (*c < 0x20) len += (size_t)sprintf(out + len, "\\u%04x", *c);
      else out[len++] = (char)*c;
    }
  }
  out[len++] = '"';
  out[len] = 0;
  return out;
}

/* put stores value (taking ownership) under key, replacing an existing member of an object. */
static void put(ex_json *j, const char *key, char *value) {
  if (!j->is_array) {
    if (!key) ex_die("ex_json: object member without a key");
    for (int i = 0; i < j->n; i++)
      if (!strcmp(j->keys[i], key)) {
        free(j->values[i]);
        j->values[i] = value;
        return;
      }
  }
  if (j->n == j->cap) {
    int cap = j->cap ? 2 * j->cap : 8;
    char **k = realloc(j->keys, (size_t)cap * sizeof *k);
    if (!k) ex_die("out of memory");
    j->keys = k;
    char **v = realloc(j->values, (size_t)cap * sizeof *v);
    if (!v) ex_die("out of memory");
    j->values = v;
    j->cap = cap;
  }
  j->keys[j->n] = j->is_array ? NULL : xstrdup(key);
  j->values[j->n] = value;
  j->n++;
}

void ex_json_int(ex_json *j, const char *key, int64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%lld", (long long)v);
  put(j, key, xstrdup(buf));
}

void ex_json_num(ex_json *j, const char *key, double v) {
  char buf[64];
  if (!isfinite(v)) snprintf(buf, sizeof buf, "null");
  else if (v == floor(v) && fabs(v) < 1e15) snprintf(buf, sizeof buf, "%.1f", v);
  else snprintf(buf, sizeof buf, "%.6g", v);
  put(j, key, xstrdup(buf));
}

void ex_json_str(ex_json *j, const char *key, const char *v) {
  put(j, key, v ? quote(v) : xstrdup("null"));
}

void ex_json_bool(ex_json *j, const char *key, bool v) {
  put(j, key, xstrdup(v ? "true" : "false"));
}

void ex_json_child(ex_json *j, const char *key, const ex_json *child) {
  put(j, key, ex_json_dump(child));
}

void ex_json_raw(ex_json *j, const char *key, const char *json) { put(j, key, xstrdup(json)); }

const char *ex_json_get(const ex_json *j, const char *key) {
  if (j->is_array || !key) return NULL;
  for (int i = 0; i < j->n; i++)
    if (!strcmp(j->keys[i], key)) return j->values[i];
  return NULL;
}

char *ex_json_dump(const ex_json *j) {
  size_t cap = 64, len = 0;
  char *out = malloc(cap);
  if (!out) ex_die("out of memory");
  out[len++] = j->is_array ? '[' : '{';
  for (int i = 0; i < j->n; i++) {
    char *k = j->is_array ? NULL : quote(j->keys[i]);
    size_t need = (k ? strlen(k) + 2 : 0) + strlen(j->values[i]) + 4;
    if (len + need + 2 > cap) {
      while (len + need + 2 > cap) cap *= 2;
      out = realloc(out, cap);
      if (!out) ex_die("out of memory");
    }
    if (i) {
      out[len++] = ',';
      out[len++] = ' ';
    }
    if (k) len += (size_t)sprintf(out + len, "%s: ", k);
    len += (size_t)sprintf(out + len, "%s", j->values[i]);
    free(k);
  }
  out[len++] = j->is_array ? ']' : '}';
  out[len] = 0;
  return out;
}

void ex_json_print_result(const char *bench, const ex_json *config, const ex_json *results,
                          const char *const *promote) {
  ex_json top;
  ex_json_object(&top);
  ex_json_str(&top, "bench", bench);
  if (config) ex_json_child(&top, "config", config);
  else ex_json_raw(&top, "config", "{}");
  if (results) ex_json_child(&top, "results", results);
  else ex_json_raw(&top, "results", "{}");
  for (int i = 0; promote && promote[i]; i++) {
    const char *v = results ? ex_json_get(results, promote[i]) : NULL;
    if (v) ex_json_raw(&top, promote[i], v);
  }
  char *line = ex_json_dump(&top);
  fflush(stderr);
  printf("%s\n", line);
  fflush(stdout);
  free(line);
  ex_json_fini(&top);
}

/* ---- clocks and memory ---- */

double ex_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A "Vm...:  <n> kB" line of /proc/self/status in MiB, or -1. */
static double status_mb(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  double v = -1;
  size_t n = strlen(key);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, key, n) == 0 && line[n] == ':') {
      v = strtod(line + n + 1, NULL) / 1024.0;
      break;
    }
  fclose(f);
  return v;
}

double ex_peak_rss_mb(void) {
  double hwm = status_mb("VmHWM"); /* follows ex_reset_peak_rss, unlike getrusage */
  if (hwm >= 0) return hwm;
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (double)ru.ru_maxrss / 1024.0; /* Linux reports KiB */
}

double ex_rss_mb(void) { return status_mb("VmRSS"); }

double ex_tensor_mb(bool peak) {
  size_t in_use, max;
  td_cpu_memory_info(&in_use, &max, NULL);
  return (double)(peak ? max : in_use) / 1048576.0;
}

void ex_hash_double(uint64_t *h, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  for (int k = 0; k < 8; k++) *h = (*h ^ ((bits >> (8 * k)) & 0xff)) * 0x100000001b3ull;
}

bool ex_reset_peak_rss(void) {
  FILE *f = fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  bool ok = fputs("5", f) >= 0;
  return fclose(f) == 0 && ok;
}

/* ---- loss windows ---- */

void ex_losses_add(ex_losses *l, double loss) {
  if (l->n < EX_LOSS_WINDOW) l->first[l->n] = loss;
  l->last[l->n % EX_LOSS_WINDOW] = loss;
  l->n++;
}

static double mean(const double *v, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += v[i];
  return n ? s / (double)n : NAN;
}

double ex_losses_first(const ex_losses *l) {
  return mean(l->first, l->n < EX_LOSS_WINDOW ? l->n : EX_LOSS_WINDOW);
}

double ex_losses_last(const ex_losses *l) {
  return mean(l->last, l->n < EX_LOSS_WINDOW ? l->n : EX_LOSS_WINDOW);
}

/* ---- handouts ---- */

void ex_handout_init(ex_handout *h) {
  pthread_mutex_init(&h->mu, NULL);
  h->ready = td_future_create();
  if (!h->ready) ex_die("out of memory");
}

td_status ex_handout_get(ex_handout *h, td_future **fut) {
  pthread_mutex_lock(&h->mu);
  td_future *f = td_future_ref(h->ready);
  pthread_mutex_unlock(&h->mu);
  if (!f) return td_set_error(TD_ERR_STATE, "the server is shutting down");
  *fut = f;
  return TD_OK;
}

void ex_handout_publish(ex_handout *h, td_value *v) { EX_CHECK(td_future_complete(h->ready, v)); }

void ex_handout_fini(ex_handout *h) {
  pthread_mutex_lock(&h->mu);
  td_future *f = h->ready;
  h->ready = NULL;
  pthread_mutex_unlock(&h->mu);
  td_future_unref(f);
}

/* ---- per-epoch reports ---- */

void ex_reports_init(ex_reports *r, ex_report_slot *slots, int nslots, int nfields,
                     int max_field) {
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  r->slots = slots;
  r->nslots = nslots;
  r->nfields = nfields < EX_REPORT_FIELDS ? nfields : EX_REPORT_FIELDS;
  r->max_field = max_field;
  r->failed = false;
}

td_status ex_reports_add(ex_reports *r, const char *fn, td_value *const *args, int n,
                         int min_slot, td_future **fut) {
  int64_t slot;
  double v[EX_REPORT_FIELDS];
  if (n != 2 || td_value_list_len(args[1]) != (size_t)r->nfields)
    return td_set_error(TD_ERR_INVALID, "%s: expected (slot, [%d numbers])", fn, r->nfields);
  td_status st = td_value_as_int(args[0], &slot);
  for (int i = 0; i < r->nfields && st == TD_OK; i++)
    st = td_value_as_double(td_value_list_get(args[1], (size_t)i), &v[i]);
  if (st != TD_OK) return st;
  if (slot < min_slot || slot >= r->nslots)
    return td_set_error(TD_ERR_INVALID, "%s: bad slot %lld", fn, (long long)slot);
  pthread_mutex_lock(&r->mu);
  ex_report_slot *s = &r->slots[slot];
  if (fut && !s->answer) s->answer = td_future_create();
  if (fut && !s->answer) st = td_set_error(TD_ERR_NOMEM, "%s: out of memory", fn);
  if (st == TD_OK) {
    s->arrived++;
    for (int i = 0; i < r->nfields; i++)
      s->v[i] = i == r->max_field ? fmax(s->v[i], v[i]) : s->v[i] + v[i];
    if (fut) *fut = td_future_ref(s->answer);
    pthread_cond_broadcast(&r->cv);
  }
  pthread_mutex_unlock(&r->mu);
  return st;
}

const ex_report_slot *ex_reports_wait(ex_reports *r, int slot, int trainers) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 3600;
  pthread_mutex_lock(&r->mu);
  while (r->slots[slot].arrived < trainers && !r->failed)
    if (pthread_cond_timedwait(&r->cv, &r->mu, &dl) != 0) ex_die("trainers never reported");
  bool failed = r->failed;
  pthread_mutex_unlock(&r->mu);
  return failed ? NULL : &r->slots[slot];
}

void ex_reports_answer(ex_reports *r, int slot, td_value *v) {
  pthread_mutex_lock(&r->mu);
  td_future *f = td_future_ref(r->slots[slot].answer);
  pthread_mutex_unlock(&r->mu);
  if (f) EX_CHECK(td_future_complete(f, v));
  else td_value_unref(v);
  td_future_unref(f);
}

void ex_reports_fail(ex_reports *r, const char *msg) {
  pthread_mutex_lock(&r->mu);
  r->failed = true;
  for (int i = 0; i < r->nslots; i++)
    if (r->slots[i].answer && !td_future_done(r->slots[i].answer))
      td_future_fail(r->slots[i].answer, TD_ERR_UNAVAILABLE, "%s", msg);
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

void ex_reports_fini(ex_reports *r) {
  for (int i = 0; i < r->nslots; i++) {
    td_future_unref(r->slots[i].answer);
    r->slots[i].answer = NULL;
  }
}

td_value *ex_report_send(td_rpc_agent *a, const char *fn, int slot, const double *v, int n) {
  td_value *args[2] = {td_value_int(slot), td_value_list()};
  if (!args[0] || !args[1]) ex_die("out of memory");
  for (int i = 0; i < n; i++) {
    td_value *x = td_value_double(v[i]);
    if (!x || td_value_list_append(args[1], x) != TD_OK) ex_die("out of memory");
  }
  td_rpc_call_opts co = TD_RPC_CALL_OPTS_INIT;
  co.timeout_ms = TD_TIMEOUT_INFINITE;
  td_value *res = NULL;
  EX_CHECK(td_rpc_sync(a, "worker0", fn, args, 2, &co, &res));
  td_value_unref(args[0]);
  td_value_unref(args[1]);
  return res;
}
