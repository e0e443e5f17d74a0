/* example_util.h - small helpers shared by the example programs (not part of the library).
 *
 *   ex_args / ex_args_parse  the common command-line options (--epochs, --max-batches,
 *                            --batch-size, --lr, --seed, --model, --data-dir, --threads,
 *                            --device, --metrics) plus an example's own options from a table;
 *                            ex_opts_parse for an example's own table alone (--help shows the
 *                            defaults).
 *   ex_progress              a progress bar on standard error: redrawn in place when standard
 *                            error is a terminal, otherwise one line about every 10%.
 *   ex_json                  a tiny JSON builder for the final output line (docs/BENCH.md:
 *                            {"bench": name, "config": {...}, "results": {...}}).
 *   ex_now_s, ex_peak_rss_mb a monotonic wall clock and the peak resident set size.
 *
 * Everything here is for single-threaded use by an example's main thread.
 */
#ifndef TD_EXAMPLE_UTIL_H
#define TD_EXAMPLE_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <pthread.h>

#include "tdist/rpc.h"
#include "tdist/status.h"

/* ---- errors ---- */

/* EX_CHECK exits the program unless expr is TD_OK, printing "prog: " and td_last_error() (the
 * library's message says what failed and where: which worker, which call, which shape); with
 * TD_LOG_LEVEL=debug also the source line and the expression. */
#define EX_CHECK(expr) ex_check((expr), #expr, __FILE__, __LINE__)
void ex_check(td_status s, const char *what, const char *file, int line);

/* ex_die prints "name: message" to standard error and exits with status 1. */
_Noreturn void ex_die(const char *fmt, ...) TD_PRINTF(1, 2);

/* ---- command-line arguments ---- */

typedef enum ex_opt_type {
  EX_OPT_INT,    /* int */
  EX_OPT_I64,    /* int64_t */
  EX_OPT_U64,    /* uint64_t */
  EX_OPT_DOUBLE, /* double */
  EX_OPT_STRING, /* const char * (points into argv) */
  EX_OPT_FLAG,   /* bool, set to true by its presence; takes no value */
} ex_opt_type;

/* One option of an example: "--name VALUE" or "--name=VALUE" stores VALUE in *dst. */
typedef struct ex_opt {
  const char *name; /* without the leading dashes, e.g. "world-size" */
  ex_opt_type type;
  void *dst;        /* where the value goes; must point to the type above */
  const char *help; /* one line for --help */
} ex_opt;

/* The options every example understands. */
typedef struct ex_args {
  int epochs;           /* --epochs N: passes over the training set. Default 1. */
  int64_t max_batches;  /* --max-batches N: stop each epoch after N batches; 0 = all. Default 0. */
  int64_t batch_size;   /* --batch-size N. Default 64. */
  double lr;            /* --lr X: learning rate. Default 0.1. */
  uint64_t seed;        /* --seed N: initialisation and shuffling seed. Default 0. */
  const char *model;    /* --model NAME: "mlp" or "cnn" (the example decides). Default "mlp". */
  const char *data_dir; /* --data-dir DIR: data set directory; NULL = $TD_DATA_DIR or the
                           default. Default NULL. */
  int threads;          /* --threads N: BLAS threads; 0 keeps the BLAS default. Default 0. */
  const char *device;   /* --device cpu|cuda|cuda:N. Default "cpu". */
  const char *metrics;  /* --metrics FILE: JSON lines of every step and evaluation (metrics.h).
                           Default NULL (none). */
  const char *omit;     /* common options this example does not take, space-separated names
                           ("model device"): --help leaves them out, parsing rejects them.
                           Default NULL (takes all). */
} ex_args;

/* ex_args_init fills *a with the defaults above. */
void ex_args_init(ex_args *a);

/* ex_args_parse parses argv into *a (which should hold defaults, see ex_args_init) and the
 * example's own options extra[0..n_extra). --help prints the usage, with `about` as the first
 * line, and exits 0; each option's default shown there is the value its variable holds when
 * ex_args_parse is called (one table gives both, so they cannot disagree). An unknown option or a
 * bad value prints a message and exits 2. When threads > 0, also sets the BLAS thread count. */
void ex_args_parse(int argc, char **argv, ex_args *a, const ex_opt *extra, int n_extra,
                   const char *about);

/* ex_opts_parse parses argv against opts[0..n) only (no common options), for examples with
 * their own option set. --help prints `about` and every option with its help text and its
 * default: the value the option's destination holds when ex_opts_parse is called, so the table
 * the parser fills is the one the help reports. Bad input exits 2, --help exits 0. */
void ex_opts_parse(int argc, char **argv, const ex_opt *opts, int n, const char *about);

/* ex_blas_threads returns the thread count BLAS is using (from OpenBLAS), or 0 when unknown. */
int ex_blas_threads(void);
/* ex_blas_set_threads sets the BLAS thread count (n > 0; 0 keeps the current one). */
void ex_blas_set_threads(int n);

/* ---- progress bar ---- */

typedef struct ex_progress {
  char label[64];
  int64_t total;    /* steps in this run; 0 when unknown */
  int64_t done;     /* steps completed */
  bool tty;         /* standard error is a terminal */
  int last_decile;  /* non-terminal mode: last 10% mark printed */
  double t0;        /* start time (ex_now_s) */
  double last_draw; /* terminal mode: time of the last redraw */
  int drawn_width;  /* terminal mode: characters on the current line */
} ex_progress;

/* ex_progress_start begins a bar named label for total steps. */
void ex_progress_start(ex_progress *p, const char *label, int64_t total);
/* ex_progress_update records that done steps are complete; fmt (may be NULL) gives a suffix
 * such as "loss 0.4321". Cheap when nothing is drawn. */
void ex_progress_update(ex_progress *p, int64_t done, const char *fmt, ...) TD_PRINTF(3, 4);
/* ex_progress_finish draws the final state with the suffix fmt (may be NULL) and ends the line. */
void ex_progress_finish(ex_progress *p, const char *fmt, ...) TD_PRINTF(2, 3);

/* ---- JSON ---- */

/* An object or array under construction: a list of members whose values are already-serialised
 * JSON text. */
typedef struct ex_json {
  bool is_array;
  int n, cap;
  char **keys;   /* n entries (NULL in arrays) */
  char **values; /* n serialised values */
} ex_json;

/* ex_json_object / ex_json_array initialise an empty object / array. Release with
 * ex_json_fini(). */
void ex_json_object(ex_json *j);
void ex_json_array(ex_json *j);
void ex_json_fini(ex_json *j);

/* Setters add a member (objects: key; arrays: key is ignored and may be NULL). Setting a key that
 * exists replaces its value. Non-finite doubles become null. */
void ex_json_int(ex_json *j, const char *key, int64_t v);
void ex_json_num(ex_json *j, const char *key, double v);
void ex_json_str(ex_json *j, const char *key, const char *v); /* NULL gives null */
void ex_json_bool(ex_json *j, const char *key, bool v);
/* ex_json_child adds child (an object or array) serialised as it is now; child is not consumed. */
void ex_json_child(ex_json *j, const char *key, const ex_json *child);
/* ex_json_raw adds already-serialised JSON text. */
void ex_json_raw(ex_json *j, const char *key, const char *json);
/* ex_json_get returns the serialised value of key, or NULL. Borrowed; valid until j changes. */
const char *ex_json_get(const ex_json *j, const char *key);

/* ex_json_dump returns j as one line of JSON text. Release with free(). */
char *ex_json_dump(const ex_json *j);

/* ex_json_print_result prints the final line of a benchmark or example to standard output and
 * flushes it: {"bench": bench, "config": config, "results": results, ...} followed by each key of
 * results named in promote (a NULL-terminated list, may be NULL) copied to the top level, for
 * readers that look there. */
void ex_json_print_result(const char *bench, const ex_json *config, const ex_json *results,
                          const char *const *promote);

/* ---- clocks and memory ---- */

/* ex_now_s returns a monotonic clock in seconds. */
double ex_now_s(void);
/* ex_peak_rss_mb returns the peak resident set size of this process in MiB (VmHWM of
 * /proc/self/status, else getrusage). */
double ex_peak_rss_mb(void);
/* ex_rss_mb returns the resident set size now in MiB (VmRSS), or -1. */
double ex_rss_mb(void);
/* ex_reset_peak_rss starts the peak over from the resident set size now (Linux: "5" into
 * /proc/self/clear_refs); false when that is not possible. */
bool ex_reset_peak_rss(void);
/* ex_tensor_mb returns the CPU allocator's bytes in use (peak false) or its peak (true) in MiB
 * (td_cpu_memory_info). */
double ex_tensor_mb(bool peak);
/* ex_hash_double folds the 8 bytes of v's bits into the FNV-1a hash *h (start from
 * 0xcbf29ce484222325): two runs whose hashes of every loss agree computed the same bits. */
void ex_hash_double(uint64_t *h, double v);

/* ---- training loss at the start and at the end ---- */

/* ex_losses keeps the training loss of the first and of the latest EX_LOSS_WINDOW batches of a
 * run: every example reports their means as first_loss / last_loss, and its test checks that the
 * loss fell. */
#define EX_LOSS_WINDOW 5
typedef struct ex_losses {
  double first[EX_LOSS_WINDOW], last[EX_LOSS_WINDOW]; /* last: a ring */
  int64_t n;                                          /* losses added */
} ex_losses;
/* ex_losses_add records the loss of the next batch (zero-initialise an ex_losses first). */
void ex_losses_add(ex_losses *l, double loss);
/* ex_losses_first / _last return the mean of the first / latest (up to) EX_LOSS_WINDOW losses;
 * NAN when none was added. */
double ex_losses_first(const ex_losses *l);
double ex_losses_last(const ex_losses *l);

/* ---- a value the server hands out once it exists ---- */

/* An ex_handout answers a registered function with a value the server's main thread makes after
 * the agent started (a model's RRef). A request that arrives before it exists gets a future that
 * completes when the value is published: no pool thread waits (a handler blocked on the main
 * thread is the deadlock pattern handlers must avoid). */
typedef struct ex_handout {
  pthread_mutex_t mu;
  td_future *ready; /* completed with the value by ex_handout_publish; NULL after fini */
} ex_handout;
/* ex_handout_init prepares h; call it before td_rpc_init, so early requests find it. */
void ex_handout_init(ex_handout *h);
/* ex_handout_get is the body of the registered function: *fut gets a future of the value. */
td_status ex_handout_get(ex_handout *h, td_future **fut);
/* ex_handout_publish completes every request, past and future, with v (takes v). */
void ex_handout_publish(ex_handout *h, td_value *v);
/* ex_handout_fini drops the value (before td_rpc_shutdown, so no RRef outlives the agent);
 * later requests fail with TD_ERR_STATE. */
void ex_handout_fini(ex_handout *h);

/* ---- per-epoch reports from trainers to the server ---- */

/* Each trainer calls a registered function with (slot, [nfields doubles]) (ex_report_send); the
 * server adds them up per slot (field max_field takes the maximum instead, e.g. a wall time) and
 * its main thread waits until every trainer reported a slot (ex_reports_wait). A report may also
 * be a meeting point: the function then answers with the slot's future, which the server
 * completes once it has processed the slot (ex_reports_answer), so the trainers wait for the
 * server without any handler waiting. */
#define EX_REPORT_FIELDS 8
typedef struct ex_report_slot {
  int arrived;
  double v[EX_REPORT_FIELDS];
  td_future *answer; /* the meeting point's future (NULL until a trainer asks for it) */
} ex_report_slot;
typedef struct ex_reports {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ex_report_slot *slots; /* caller's storage, nslots entries, zeroed */
  int nslots, nfields, max_field;
  bool failed; /* ex_reports_fail was called */
} ex_reports;
void ex_reports_init(ex_reports *r, ex_report_slot *slots, int nslots, int nfields, int max_field);
/* ex_reports_add is the body of the registered report function (args: slot >= min_slot, list).
 * With fut NULL the caller answers none at once; otherwise *fut gets the slot's future. */
td_status ex_reports_add(ex_reports *r, const char *fn, td_value *const *args, int n,
                         int min_slot, td_future **fut);
/* ex_reports_wait blocks the server's main thread until `trainers` reports for slot arrived;
 * NULL once ex_reports_fail was called (exits after an hour). */
const ex_report_slot *ex_reports_wait(ex_reports *r, int slot, int trainers);
/* ex_reports_answer completes the slot's future with v (takes v). */
void ex_reports_answer(ex_reports *r, int slot, td_value *v);
/* ex_reports_fail fails every pending future with msg (TD_ERR_UNAVAILABLE) and wakes the
 * waiting server. */
void ex_reports_fail(ex_reports *r, const char *msg);
/* ex_reports_fini releases the futures. */
void ex_reports_fini(ex_reports *r);
/* ex_report_send (a trainer) calls fn on worker0 with (slot, [v[0..n)]) without a deadline (the
 * server may be evaluating) and returns its answer (new reference). */
td_value *ex_report_send(td_rpc_agent *a, const char *fn, int slot, const double *v, int n);

#endif
