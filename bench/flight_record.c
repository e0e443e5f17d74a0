/* flight_record.c - what the always-on flight recorder costs (core/flight.c): nanoseconds per
 * recorded event on one thread and on several threads at once (they share the ring's claim
 * counter), per push + pop of an open record (what a blocking wait adds), per event carrying an
 * RRef id as its subject (set on the thread, recorded, restored: what an RRef request adds), and
 * per push + annotate + pop (a handler that names its RRef or context). No PyTorch peer:
 * PyTorch's flight recorder covers NCCL collectives only and has no CPU-side counterpart to time.
 *
 *   build/bench/flight_record [--events N] [--threads T]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "core/flight_impl.h"

#define BENCH_PROG "flight_record"
#include "bench_util.h"

static long events = 2000000;

static void *record_loop(void *arg) {
  (void)arg;
  for (long i = 0; i < events; i++)
    td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_SEND, .peer = 1, .a = (uint64_t)i},
                      "bench_fn");
  return NULL;
}

/* ns per event with t threads recording at once (each records `events`). */
static double run_threads(int t) {
  pthread_t th[64];
  double t0 = bench_now_s();
  for (int i = 0; i < t; i++) pthread_create(&th[i], NULL, record_loop, NULL);
  for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
  return (bench_now_s() - t0) * 1e9 / (double)events; /* wall time per event of one thread */
}

/* ns per td__now_ns(), the clock read every record makes (for scale). */
static double run_clock(void) {
  volatile uint64_t sink = 0;
  double t0 = bench_now_s();
  for (long i = 0; i < events; i++) sink += td__now_ns();
  (void)sink;
  return (bench_now_s() - t0) * 1e9 / (double)events;
}

static double run_push_pop(void) {
  td__flight_ev e = {.kind = TD__FL_WAIT_BEGIN, .peer = 1};
  double t0 = bench_now_s();
  for (long i = 0; i < events; i++) {
    e.kind = TD__FL_WAIT_BEGIN;
    e.a = (uint64_t)i;
    td__flight_push(&e, "bench_fn");
    e.kind = TD__FL_WAIT_END;
    td__flight_pop(&e, "bench_fn");
  }
  return (bench_now_s() - t0) * 1e9 / (double)events;
}

/* ns per call's worth of recording about an RRef (what an RRef request or a backward hop adds):
 * the thread's subject set, a send record carrying it, the subject restored. */
static double run_subject(void) {
  double t0 = bench_now_s();
  for (long i = 0; i < events; i++) {
    td__flight_subj prev =
        td__flight_subject_set((td__flight_subj){TD__FL_SUBJ_RREF, ((uint64_t)1 << 48) | (uint64_t)i});
    td__flight_subj s = td__flight_subject();
    td__flight_record(&(td__flight_ev){.kind = TD__FL_RPC_SEND, .peer = 1, .a = (uint64_t)i,
                                       .b = s.id, .y = s.kind, .c = 1000},
                      "__rref_fetch");
    td__flight_subject_set(prev);
  }
  return (bench_now_s() - t0) * 1e9 / (double)events;
}

/* ns per handler record annotated with its subject: push, annotate, pop (a handler's two events
 * and the slot's stack, plus the annotation). */
static double run_annotated(void) {
  td__flight_ev e = {.kind = TD__FL_HANDLER_START, .peer = 1};
  double t0 = bench_now_s();
  for (long i = 0; i < events; i++) {
    e.kind = TD__FL_HANDLER_START;
    e.a = (uint64_t)i;
    td__flight_push(&e, "__rref_fork");
    td__flight_annotate((td__flight_subj){TD__FL_SUBJ_RREF, (uint64_t)i});
    e.kind = TD__FL_HANDLER_END;
    td__flight_pop(&e, "__rref_fork");
  }
  return (bench_now_s() - t0) * 1e9 / (double)events;
}

int main(int argc, char **argv) {
  int threads = 2;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--events") == 0 && i + 1 < argc) events = atol(argv[++i]);
    else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: flight_record [--events N] [--threads T]\n");
      return 2;
    }
  }
  if (events < 1 || threads < 1 || threads > 64) {
    fprintf(stderr, "flight_record: --events >= 1 and --threads 1..64\n");
    return 2;
  }
  run_threads(1); /* warm-up: the ring's pages, the thread's slot */
  double one = run_threads(1), many = run_threads(threads), pp = run_push_pop();
  double subj = run_subject(), ann = run_annotated(), clk = run_clock();
  printf("{\"bench\": \"flight_record\", \"config\": {\"impl\": \"tdist\", \"events\": %ld, "
         "\"threads\": %d, \"ring_records\": %u}, \"results\": {\"ns_per_event_1_thread\": %.1f, "
         "\"ns_per_event_n_threads\": %.1f, \"ns_per_push_pop\": %.1f, "
         "\"ns_per_event_with_subject\": %.1f, \"ns_per_annotated_push_pop\": %.1f, "
         "\"ns_per_clock_read\": %.1f}}\n",
         events, threads, TD__FLIGHT_RING, one, many, pp, subj, ann, clk);
  return 0;
}
