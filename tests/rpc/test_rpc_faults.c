/* test_rpc_faults.c - multi-process fault tests of the RPC agent: a worker killed with SIGKILL
 * (from outside, or by itself inside a handler) fails the calls to it, in flight and new, with
 * TD_ERR_UNAVAILABLE naming it, promptly; the survivors' graceful shutdown times out naming it; a
 * hung (SIGSTOPped) peer fails an in-flight call through keepalive and is usable again after
 * SIGCONT; a raw gRPC client that sends a bad frame magic gets INVALID_ARGUMENT ("corrupt"), one
 * that sends a frame with a garbage header gets an error frame for that id and may go on using the
 * stream, an unknown method gets UNIMPLEMENTED; oversized requests and replies get a clear
 * TD_ERR_INVALID naming the limit and the connection keeps working; a member whose new stream the
 * server refuses before answering its HELLO (its handshake slots full) opens it again, and its
 * call succeeds.
 *
 * INTERNAL: the raw-client tests build and parse frames with rpc/wire.h.
 */
#include <dirent.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <sys/types.h>

/* (grpc_security.h has its own struct peer_info: the agent's is renamed here) */
#define peer_info td_agent_peer_info
#include "rpc/agent_state.h"
#undef peer_info
#include "rpc/auth.h"
#include "rpc/wire.h"
#include "rpc_test_fns.h"
#include "test_util.h"

/* ---- helpers ---- */

static int64_t as_int(td_value *v) {
  int64_t x = -999;
  MP_CHECK_OK(td_value_as_int(v, &x));
  return x;
}

static int released; /* set by "release" */

static td_status fn_pid(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  *res = td_value_int((int64_t)getpid());
  return TD_OK;
}

static td_status fn_die(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                        td_future **fut) {
  raise(SIGKILL);
  return TD_OK;
}

static td_status fn_release(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                            td_future **fut) {
  __atomic_store_n(&released, 1, __ATOMIC_RELEASE);
  *res = td_value_none();
  return TD_OK;
}

/* zeros(n): a float32 tensor of n zeros */
static td_status fn_zeros(td_rpc_ctx *c, td_value *const *args, int n, td_value **res,
                          td_future **fut) {
  int64_t numel;
  td_status st = td_value_as_int(args[0], &numel);
  if (st != TD_OK) return st;
  td_tensor *t;
  st = td_tensor_zeros(&numel, 1, TD_DTYPE_F32, td_device_cpu(), &t);
  if (st != TD_OK) return st;
  *res = td_value_tensor(t);
  td_tensor_unref(t);
  return TD_OK;
}

static void register_fault_fns(void) {
  register_test_fns();
  MP_CHECK_OK(td_rpc_register("pid", fn_pid, NULL));
  MP_CHECK_OK(td_rpc_register("die", fn_die, NULL));
  MP_CHECK_OK(td_rpc_register("release", fn_release, NULL));
  MP_CHECK_OK(td_rpc_register("zeros", fn_zeros, NULL));
}

/* Waits until "release" ran here (bounded). */
static void wait_released(double timeout_s) {
  double end = td_test_now_s() + td_test_s(timeout_s);
  while (!__atomic_load_n(&released, __ATOMIC_ACQUIRE)) {
    MP_CHECK(td_test_now_s() < end);
    td_test_sleep_ms(5);
  }
}

static pid_t remote_pid(td_rpc_agent *a, const char *to) {
  td_value *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, to, "pid", NULL, 0, NULL, &r));
  pid_t p = (pid_t)as_int(r);
  td_value_unref(r);
  MP_CHECK(p > 1 && p != getpid());
  return p;
}

static void call_ok(td_rpc_agent *a, const char *to) {
  td_value *two[2] = {td_value_int(20), td_value_int(22)}, *r = NULL;
  MP_CHECK_OK(td_rpc_sync(a, to, "add", two, 2, NULL, &r));
  MP_CHECK(as_int(r) == 42);
  td_value_unref(r);
  td_value_unref(two[0]);
  td_value_unref(two[1]);
}

/* A failed call to worker1 must say UNAVAILABLE and name it. */
static void check_unavailable(td_status st, const char *msg) {
  if (st != TD_ERR_UNAVAILABLE || !strstr(msg, "worker1 (rank 1)"))
    fprintf(stderr, "[pid %d] got %s: %s\n", (int)getpid(), td_status_name(st), msg);
  MP_CHECK(st == TD_ERR_UNAVAILABLE);
  MP_CHECK(strstr(msg, "worker1 (rank 1)") != NULL);
}

/* ---- a worker killed with SIGKILL ---- */

enum { KILL_EXTERNAL = 0, KILL_IN_HANDLER = 1 };

static int worker_killed(int rank, int world, const char *method, void *arg) {
  int mode = *(int *)arg;
  register_fault_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 1) {
    /* the victim: serves until it is killed, never reaches shutdown */
    td_test_sleep_ms(td_test_ms(60000));
    return 3;
  }
  if (rank == 2) {
    /* a survivor: once worker0 is done, its own first call to the dead worker fails too */
    wait_released(60);
    td_value *r = NULL;
    double t0 = td_test_now_s();
    td_status st = td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &r);
    check_unavailable(st, td_last_error());
    MP_CHECK(td_test_now_s() - t0 < td_test_s(5));
  } else {
    pid_t victim = remote_pid(a, "worker1");
    /* the calls below go through the same-host lane (on by default): its death must fail them
     * as promptly as the stream's */
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &r));
    td_value_unref(r);
    TD_TEST_POLL(td_rpc_shm_lanes(a) >= 1, 30);
    MP_CHECK(td_rpc_shm_lanes(a) >= 1);
    td_rpc_traffic tr0, tr1;
    MP_CHECK_OK(td_rpc_get_peer_traffic(a, 1, &tr0));
    /* in flight: a 20 s handler (delivered: the echo behind it on the same stream came back) */
    td_value *ms = td_value_int(20000);
    td_future *slow = NULL, *die = NULL;
    MP_CHECK_OK(td_rpc_async(a, "worker1", "slow", &ms, 1, NULL, &slow));
    td_value_unref(ms);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &r));
    td_value_unref(r);
    MP_CHECK_OK(td_rpc_get_peer_traffic(a, 1, &tr1));
    MP_CHECK(tr1.lane_frames_sent - tr0.lane_frames_sent == 2 && tr1.frames_sent == tr0.frames_sent);
    double t0 = td_test_now_s();
    if (mode == KILL_EXTERNAL) {
      MP_CHECK(kill(victim, SIGKILL) == 0);
    } else {
      MP_CHECK_OK(td_rpc_async(a, "worker1", "die", NULL, 0, NULL, &die));
    }
    /* the calls in flight fail promptly (default timeout 30 s, keepalive 2 s) */
    td_status st = td_future_wait(slow, td_test_ms(10000));
    MP_CHECK(td_future_done(slow));
    check_unavailable(st, td_future_message(slow));
    if (die) {
      st = td_future_wait(die, td_test_ms(10000));
      MP_CHECK(td_future_done(die));
      check_unavailable(st, td_future_message(die));
    }
    double el = td_test_now_s() - t0;
    fprintf(stderr, "killed peer (%s): calls in flight failed after %.3f s\n",
            mode == KILL_EXTERNAL ? "SIGKILL from a peer" : "raise(SIGKILL) in a handler", el);
    MP_CHECK(el < td_test_s(5));
    td_future_unref(slow);
    td_future_unref(die);
    /* new calls fail promptly as well, sync and async */
    for (int i = 0; i < 3; i++) {
      t0 = td_test_now_s();
      st = td_rpc_sync(a, "worker1", "echo", NULL, 0, NULL, &r);
      check_unavailable(st, td_last_error());
      MP_CHECK(td_test_now_s() - t0 < td_test_s(5));
    }
    td_future *f = NULL;
    t0 = td_test_now_s();
    MP_CHECK_OK(td_rpc_async(a, "worker1", "echo", NULL, 0, NULL, &f));
    st = td_future_wait(f, td_test_ms(10000));
    check_unavailable(st, td_future_message(f));
    MP_CHECK(td_test_now_s() - t0 < td_test_s(5));
    td_future_unref(f);
    /* the survivors still talk to each other */
    call_ok(a, "worker2");
    MP_CHECK_OK(td_rpc_sync(a, "worker2", "release", NULL, 0, NULL, &r));
    td_value_unref(r);
  }
  /* graceful shutdown cannot complete without worker1: it times out naming it (only it) */
  double t0 = td_test_now_s();
  td_status st = td_rpc_shutdown(a, true, 2000);
  double el = td_test_now_s() - t0;
  const char *why = td_last_error();
  if (st != TD_ERR_TIMEOUT) fprintf(stderr, "shutdown: %s: %s\n", td_status_name(st), why);
  MP_CHECK(st == TD_ERR_TIMEOUT);
  MP_CHECK(strstr(why, "worker1 (rank 1)") != NULL);
  MP_CHECK(strstr(why, "worker0") == NULL && strstr(why, "worker2") == NULL);
  MP_CHECK(el < td_test_s(6));
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void run_killed(int mode) {
  int codes[3];
  int fails = td_mp_run(3, worker_killed, &mode, 90, codes);
  if (codes[0] != 0 || codes[2] != 0 || codes[1] != 128 + SIGKILL)
    fail_msg("exit codes %d %d %d (want 0, %d, 0; %d failed)", codes[0], codes[1], codes[2],
             128 + SIGKILL, fails);
}

static void test_rpc_peer_killed_fails_calls(void **state) { run_killed(KILL_EXTERNAL); }
static void test_rpc_peer_dies_in_handler_fails_calls(void **state) { run_killed(KILL_IN_HANDLER); }

/* ---- a hung peer ---- */

/* Waits (bounded) until every thread of pid is stopped: SIGSTOP takes effect asynchronously. */
static void wait_stopped(pid_t pid) {
  double end = td_test_now_s() + td_test_s(10);
  for (;;) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    MP_CHECK(d != NULL);
    int running = 0, seen = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      if (e->d_name[0] == '.') continue;
      char sp[384], buf[512];
      snprintf(sp, sizeof sp, "%s/%s/stat", path, e->d_name);
      FILE *f = fopen(sp, "r");
      if (!f) continue; /* the thread just exited */
      size_t n = fread(buf, 1, sizeof buf - 1, f);
      fclose(f);
      buf[n] = 0;
      const char *paren = strrchr(buf, ')'); /* "tid (comm) S ..." */
      seen++;
      if (!paren || (paren[2] != 'T' && paren[2] != 't')) running++;
    }
    closedir(d);
    if (seen && !running) return;
    MP_CHECK(td_test_now_s() < end);
    td_test_sleep_ms(1);
  }
}

/* arg: "<TD_RPC_LANE_DIAL>,<TD_RPC_MAILBOX>": a mailbox lane's keepalive (the peer's beat,
 * "1,1"), a dialled lane's (its socket, "1,0"), or a gRPC stream's ("0,0") */
static int worker_hung(int rank, int world, const char *method, void *arg) {
  register_fault_fns();
  const char *mode = arg;
  setenv("TD_RPC_LANE_DIAL", mode[0] == '1' ? "1" : "0", 1);
  setenv("TD_RPC_MAILBOX", mode[2] == '1' ? "1" : "0", 1);
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.keepalive_ms = 500;
  o.keepalive_timeout_ms = 500;
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 1) {
    wait_released(120);
  } else {
    pid_t victim = remote_pid(a, "worker1");
    call_ok(a, "worker1");
    /* the path under test carries the calls (a mailbox lane wherever the kernel lets siblings
     * take each other's descriptors: no Yama, or its ptrace scope 0) */
    FILE *yf = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
    int scope = 0;
    if (yf && fscanf(yf, "%d", &scope) != 1) scope = 1;
    if (yf) fclose(yf);
    bool mbox = mode[0] == '1' && mode[2] == '1' && scope == 0;
    MP_CHECK(td_rpc_mailbox_lanes(a) == (mbox ? 1 : 0));
    MP_CHECK(kill(victim, SIGSTOP) == 0);
    wait_stopped(victim);
    double t0 = td_test_now_s();
    /* an in-flight call to the stopped peer: keepalive (500 ms ping, 500 ms timeout) fails it
     * long before the 30 s call timeout */
    td_future *f = NULL;
    MP_CHECK_OK(td_rpc_async(a, "worker1", "echo", NULL, 0, NULL, &f));
    td_status st = td_future_wait(f, td_test_ms(20000));
    double el = td_test_now_s() - t0;
    fprintf(stderr, "hung peer: in-flight call failed after %.3f s: %s: %s\n", el,
            td_status_name(st), td_future_message(f));
    MP_CHECK(td_future_done(f));
    check_unavailable(st, td_future_message(f));
    MP_CHECK(strstr(td_future_message(f), "keepalive") != NULL);
    if (mbox) MP_CHECK(strstr(td_future_message(f), "mailbox lane") != NULL);
    /* documented: within about twice keepalive_ms (measured 1.0-1.1 s here) */
    MP_CHECK(el < td_test_s(3));
    td_future_unref(f);
    MP_CHECK(kill(victim, SIGCONT) == 0);
    /* the peer is back: calls reach it again (the channel reconnects with backoff; a call made
     * while it is still in TRANSIENT_FAILURE fails fast with UNAVAILABLE) */
    t0 = td_test_now_s();
    int failed = 0;
    for (;;) {
      td_value *two[2] = {td_value_int(1), td_value_int(2)}, *r = NULL;
      st = td_rpc_sync(a, "worker1", "add", two, 2, NULL, &r);
      td_value_unref(two[0]);
      td_value_unref(two[1]);
      if (st == TD_OK) {
        MP_CHECK(as_int(r) == 3);
        td_value_unref(r);
        break;
      }
      check_unavailable(st, td_last_error());
      failed++;
      MP_CHECK(td_test_now_s() - t0 < td_test_s(10));
      td_test_sleep_ms(50);
    }
    fprintf(stderr, "hung peer: reachable again %.3f s after SIGCONT (%d calls failed first)\n",
            td_test_now_s() - t0, failed);
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "release", NULL, 0, NULL, &r));
    td_value_unref(r);
  }
  td_status st = td_rpc_shutdown(a, true, td_test_ms(20000));
  if (st != TD_OK) fprintf(stderr, "rank %d shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rpc_hung_peer_keepalive(void **state) {
  TD_MP_RUN(2, worker_hung, "1,1", 45);
  TD_MP_RUN(2, worker_hung, "1,0", 45);
  TD_MP_RUN(2, worker_hung, "0,0", 45);
}

/* ---- a raw gRPC client ---- */

typedef struct raw_call {
  grpc_channel *ch;
  grpc_completion_queue *cq;
  grpc_call *call;
  grpc_metadata_array imd, tmd;
  grpc_status_code status;
  grpc_slice details;
  int t_start, t_status, t_op; /* tags */
} raw_call;

static gpr_timespec in_ms(int64_t ms) {
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

/* Runs one batch and waits for it (bounded). Returns the event's success. */
static bool raw_batch(raw_call *rc, const grpc_op *ops, size_t n, void *tag) {
  MP_CHECK(grpc_call_start_batch(rc->call, ops, n, tag, NULL) == GRPC_CALL_OK);
  grpc_event ev = grpc_completion_queue_pluck(rc->cq, tag, in_ms(td_test_ms(10000)), NULL);
  MP_CHECK(ev.type == GRPC_OP_COMPLETE);
  return ev.success != 0;
}

/* Opens a call to method on address; the status batch is started at once. */
static void raw_open(raw_call *rc, const char *address, const char *method) {
  memset(rc, 0, sizeof *rc);
  grpc_init(); /* balanced in raw_destroy */
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  rc->ch = grpc_channel_create(address, creds, NULL);
  grpc_channel_credentials_release(creds);
  rc->cq = grpc_completion_queue_create_for_pluck(NULL);
  rc->call = grpc_channel_create_call(rc->ch, NULL, GRPC_PROPAGATE_DEFAULTS, rc->cq,
                                      grpc_slice_from_static_string(method), NULL,
                                      in_ms(td_test_ms(20000)), NULL);
  MP_CHECK(rc->call != NULL);
  grpc_metadata_array_init(&rc->imd);
  grpc_metadata_array_init(&rc->tmd);
  rc->details = grpc_empty_slice();
  rc->status = GRPC_STATUS_UNKNOWN;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[1].data.recv_initial_metadata.recv_initial_metadata = &rc->imd;
  MP_CHECK(raw_batch(rc, ops, 2, &rc->t_start));
  grpc_op st;
  memset(&st, 0, sizeof st);
  st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  st.data.recv_status_on_client.trailing_metadata = &rc->tmd;
  st.data.recv_status_on_client.status = &rc->status;
  st.data.recv_status_on_client.status_details = &rc->details;
  MP_CHECK(grpc_call_start_batch(rc->call, &st, 1, &rc->t_status, NULL) == GRPC_CALL_OK);
}

static bool raw_send(raw_call *rc, const void *p, size_t n) {
  grpc_slice s = grpc_slice_from_copied_buffer(p, n);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_MESSAGE;
  op.data.send_message.send_message = bb;
  bool ok = raw_batch(rc, &op, 1, &rc->t_op);
  grpc_byte_buffer_destroy(bb);
  return ok;
}

static void raw_close_send(raw_call *rc) {
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  raw_batch(rc, &op, 1, &rc->t_op);
}

/* Receives one message and feeds it to dec. Returns false at the end of the stream. */
static bool raw_recv_into(raw_call *rc, td__decoder *dec) {
  grpc_byte_buffer *bb = NULL;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &bb;
  if (!raw_batch(rc, &op, 1, &rc->t_op) || !bb) return false;
  grpc_byte_buffer_reader r;
  MP_CHECK(grpc_byte_buffer_reader_init(&r, bb));
  grpc_slice s;
  while (grpc_byte_buffer_reader_next(&r, &s)) {
    MP_CHECK_OK(td__decoder_feed(dec, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s)));
    grpc_slice_unref(s);
  }
  grpc_byte_buffer_reader_destroy(&r);
  grpc_byte_buffer_destroy(bb);
  return true;
}

/* Waits for the call's status; returns it, details copied into buf. */
static grpc_status_code raw_finish(raw_call *rc, char *buf, size_t n) {
  grpc_event ev =
      grpc_completion_queue_pluck(rc->cq, &rc->t_status, in_ms(td_test_ms(10000)), NULL);
  MP_CHECK(ev.type == GRPC_OP_COMPLETE);
  char *d = grpc_slice_to_c_string(rc->details);
  snprintf(buf, n, "%s", d);
  gpr_free(d);
  return rc->status;
}

static void raw_destroy(raw_call *rc) {
  grpc_call_unref(rc->call);
  grpc_metadata_array_destroy(&rc->imd);
  grpc_metadata_array_destroy(&rc->tmd);
  grpc_slice_unref(rc->details);
  grpc_completion_queue_shutdown(rc->cq);
  while (grpc_completion_queue_pluck(rc->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(rc->cq);
  grpc_channel_destroy(rc->ch);
  grpc_shutdown();
}

/* Receives one whole message into buf (at most n bytes); returns its length, or -1 at the end. */
static long raw_recv_bytes(raw_call *rc, uint8_t *buf, size_t n) {
  grpc_byte_buffer *bb = NULL;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &bb;
  if (!raw_batch(rc, &op, 1, &rc->t_op) || !bb) return -1;
  size_t off = 0;
  grpc_byte_buffer_reader r;
  MP_CHECK(grpc_byte_buffer_reader_init(&r, bb));
  grpc_slice s;
  while (grpc_byte_buffer_reader_next(&r, &s)) {
    size_t l = GRPC_SLICE_LENGTH(s);
    MP_CHECK(off + l <= n);
    memcpy(buf + off, GRPC_SLICE_START_PTR(s), l);
    off += l;
    grpc_slice_unref(s);
  }
  grpc_byte_buffer_reader_destroy(&r);
  grpc_byte_buffer_destroy(bb);
  return (long)off;
}

/* Authenticates the raw stream as a member of rank self_rank (the group's secret is in
 * TD_RPC_SECRET, set by td_mp_run) toward rank peer_rank. */
static void raw_handshake(raw_call *rc, int self_rank, int peer_rank) {
  const char *secret = getenv("TD_RPC_SECRET");
  MP_CHECK(secret != NULL);
  td__auth auth;
  MP_CHECK_OK(td__auth_init(&auth, secret, strlen(secret)));
  td__hs hs;
  uint8_t hello[TD__HS_HELLO_LEN], out[TD__HS_MAX_LEN], in[TD__HS_MAX_LEN];
  MP_CHECK_OK(td__hs_client_hello(&hs, &auth, self_rank, peer_rank, hello));
  MP_CHECK_OK(td__hs_client_ticket(&hs, hello, out)); /* RPC streams: the HELLO with its ticket */
  MP_CHECK(raw_send(rc, out, TD__HS_TICKET_LEN));
  long n = raw_recv_bytes(rc, in, sizeof in);
  MP_CHECK(n > 0);
  MP_CHECK_OK(td__hs_client_challenge(&hs, in, (size_t)n, out));
  MP_CHECK(raw_send(rc, out, TD__HS_PROOF_LEN));
}

/* Frames decoded by the raw client. */
static td__msg got[8];
static int ngot;
static uint64_t bad_ids[8];
static int nbad;

static void on_got(void *ud, td__msg *m) {
  MP_CHECK(ngot < 8);
  got[ngot++] = *m;
  memset(m, 0, sizeof *m);
}

static void on_got_bad(void *ud, uint64_t id, td_status st, const char *why) {
  MP_CHECK(nbad < 8);
  bad_ids[nbad++] = id;
}

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Sends the encoded frame m as two gRPC messages (head, then the tensor bytes if any). */
static void raw_send_msg(raw_call *rc, td_rpc_agent *a, const td__msg *m) {
  td__wire_ctx wctx = {a, 1, 0};
  td__frame f = {0};
  MP_CHECK_OK(td__wire_encode(m, &wctx, &f));
  MP_CHECK(raw_send(rc, f.head, f.head_len));
  for (int i = 0; i < f.ntensors; i++)
    MP_CHECK(raw_send(rc, td_tensor_data(f.tensors[i]), td_tensor_nbytes(f.tensors[i])));
  td__frame_clear(&f);
}

enum { RAW_BAD_MAGIC = 0, RAW_BAD_HEADER = 1, RAW_UNKNOWN_METHOD = 2 };

static int worker_raw(int rank, int world, const char *method, void *arg) {
  int mode = *(int *)arg;
  register_fault_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 1) {
    wait_released(60);
  } else {
    td_worker_info wi;
    MP_CHECK_OK(td_rpc_get_worker_info(a, "worker1", &wi));
    call_ok(a, "worker1");
    raw_call rc;
    char details[512];
    if (mode == RAW_BAD_MAGIC) {
      const char junk[40] = "GET / HTTP/1.1 this is not a tdist frame";
      /* before the handshake: refused as unauthenticated, nothing decoded */
      raw_open(&rc, wi.address, "/tdist.Rpc/Stream");
      raw_send(&rc, junk, sizeof junk);
      grpc_status_code code = raw_finish(&rc, details, sizeof details);
      fprintf(stderr, "junk before the handshake: status %d: %s\n", (int)code, details);
      MP_CHECK(code == GRPC_STATUS_UNAUTHENTICATED);
      MP_CHECK(strstr(details, "handshake") != NULL);
      raw_destroy(&rc);
      /* after it: a member's corrupt stream */
      raw_open(&rc, wi.address, "/tdist.Rpc/Stream");
      raw_handshake(&rc, 0, 1);
      raw_send(&rc, junk, sizeof junk);
      code = raw_finish(&rc, details, sizeof details);
      fprintf(stderr, "bad magic: status %d: %s\n", (int)code, details);
      MP_CHECK(code == GRPC_STATUS_INVALID_ARGUMENT);
      MP_CHECK(strstr(details, "corrupt") != NULL);
      raw_destroy(&rc);
    } else if (mode == RAW_BAD_HEADER) {
      raw_open(&rc, wi.address, "/tdist.Rpc/Stream");
      raw_handshake(&rc, 0, 1);
      td__wire_ctx wctx = {a, 1, 0};
      td__decoder *dec;
      MP_CHECK_OK(td__decoder_create(&wctx, 0, on_got, on_got_bad, NULL, &dec));
      /* a valid prefix, a header that is not protobuf, and 40 payload bytes to skip */
      uint8_t fr[TD__FRAME_PREFIX + 16 + 40];
      memset(fr, 0xff, sizeof fr);
      put_le(fr, TD__FRAME_MAGIC, 4);
      put_le(fr + 4, 16, 4);
      put_le(fr + 8, 40, 8);
      put_le(fr + 16, 777, 8);
      MP_CHECK(raw_send(&rc, fr, sizeof fr));
      while (ngot < 1) MP_CHECK(raw_recv_into(&rc, dec));
      MP_CHECK(ngot == 1 && nbad == 0);
      MP_CHECK(got[0].id == 777 && got[0].kind == TD__MSG_ERROR);
      MP_CHECK(got[0].status == TD_ERR_FORMAT);
      fprintf(stderr, "bad header: error reply: %s\n", got[0].message);
      MP_CHECK(strstr(got[0].message, "worker1 (rank 1)") != NULL);
      MP_CHECK(strstr(got[0].message, "protobuf") != NULL);
      /* the same stream still serves a valid request, with a tensor, sent in two messages */
      int64_t shape[2] = {3, 5};
      td_tensor *t;
      MP_CHECK_OK(td_tensor_full(shape, 2, 2.5, TD_DTYPE_F32, td_device_cpu(), &t));
      td_value *arg0 = td_value_tensor(t);
      td__msg req = {.id = 778, .kind = TD__MSG_REQUEST, .fn = "echo", .from_rank = 0,
                     .values = &arg0, .nvalues = 1};
      raw_send_msg(&rc, a, &req);
      td_value *two[2] = {td_value_int(40), td_value_int(2)};
      td__msg req2 = {.id = 779, .kind = TD__MSG_REQUEST, .fn = "add", .from_rank = 0,
                      .values = two, .nvalues = 2};
      raw_send_msg(&rc, a, &req2);
      while (ngot < 3) MP_CHECK(raw_recv_into(&rc, dec));
      MP_CHECK(ngot == 3 && nbad == 0);
      for (int i = 1; i < 3; i++) {
        MP_CHECK(got[i].kind == TD__MSG_RESPONSE && got[i].nvalues == 1);
        if (got[i].id == 778) MP_CHECK(td_value_equal(got[i].values[0], arg0));
        else MP_CHECK(got[i].id == 779 && as_int(got[i].values[0]) == 42);
      }
      MP_CHECK(got[1].id != got[2].id);
      td_value_unref(arg0);
      td_value_unref(two[0]);
      td_value_unref(two[1]);
      td_tensor_unref(t);
      for (int i = 0; i < ngot; i++) td__msg_clear(&got[i]);
      /* a half-close ends the stream cleanly */
      raw_close_send(&rc);
      grpc_status_code code = raw_finish(&rc, details, sizeof details);
      MP_CHECK(code == GRPC_STATUS_OK);
      td__decoder_destroy(dec);
      raw_destroy(&rc);
    } else {
      /* an unknown method, and the store's method on a worker that serves no store */
      const char *methods[2] = {"/tdist.Rpc/NoSuchMethod", "/tdist.Store/Op"};
      for (int i = 0; i < 2; i++) {
        raw_open(&rc, wi.address, methods[i]);
        raw_send(&rc, "x", 1);
        raw_close_send(&rc);
        grpc_status_code code = raw_finish(&rc, details, sizeof details);
        fprintf(stderr, "%s: status %d: %s\n", methods[i], (int)code, details);
        MP_CHECK(code == GRPC_STATUS_UNIMPLEMENTED);
        raw_destroy(&rc);
      }
      /* garbage to rank 0's store: refused, and the store keeps working (shutdown uses it) */
      td_worker_info me;
      MP_CHECK_OK(td_rpc_self(a, &me));
      raw_open(&rc, me.address, "/tdist.Store/Op");
      const uint8_t junk[6] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
      raw_send(&rc, junk, sizeof junk);
      raw_close_send(&rc);
      grpc_status_code code = raw_finish(&rc, details, sizeof details);
      fprintf(stderr, "store garbage: status %d: %s\n", (int)code, details);
      MP_CHECK(code == GRPC_STATUS_UNAUTHENTICATED);
      raw_destroy(&rc);
    }
    /* the agent keeps serving normal calls */
    call_ok(a, "worker1");
    td_value *r = NULL;
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "release", NULL, 0, NULL, &r));
    td_value_unref(r);
  }
  td_status st = td_rpc_shutdown(a, true, td_test_ms(20000));
  if (st != TD_OK) fprintf(stderr, "rank %d shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void run_raw(int mode) {
  TD_MP_RUN(2, worker_raw, &mode, 60);
}

static void test_rpc_stream_bad_magic_closes_stream(void **state) { run_raw(RAW_BAD_MAGIC); }
static void test_rpc_stream_bad_header_gets_error_reply(void **state) { run_raw(RAW_BAD_HEADER); }
static void test_rpc_unknown_method_unimplemented(void **state) { run_raw(RAW_UNKNOWN_METHOD); }

/* ---- oversized messages ---- */

static int worker_oversized(int rank, int world, const char *method, void *arg) {
  register_fault_fns();
  td_rpc_options o = td_mp_rpc_options(method, 2);
  o.max_message_bytes = 1u << 20;
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  if (rank == 0) {
    call_ok(a, "worker1");
    /* a 4 MiB request */
    int64_t n = 1 << 20;
    td_tensor *big;
    MP_CHECK_OK(td_tensor_full(&n, 1, 1.0, TD_DTYPE_F32, td_device_cpu(), &big));
    td_value *v = td_value_tensor(big), *r = NULL;
    double t0 = td_test_now_s();
    td_status st = td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &r);
    fprintf(stderr, "oversized request: %s: %s\n", td_status_name(st), td_last_error());
    MP_CHECK(st == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    MP_CHECK(strstr(td_last_error(), "limit") != NULL);
    MP_CHECK(strstr(td_last_error(), "1048576") != NULL);
    MP_CHECK(td_test_now_s() - t0 < td_test_s(5));
    td_value_unref(v);
    td_tensor_unref(big);
    /* the next small call on the same connection works */
    call_ok(a, "worker1");
    /* a request just under the limit passes */
    n = 200 * 1024;
    MP_CHECK_OK(td_tensor_full(&n, 1, 3.0, TD_DTYPE_F32, td_device_cpu(), &big));
    v = td_value_tensor(big);
    MP_CHECK_OK(td_rpc_sync(a, "worker1", "echo", &v, 1, NULL, &r));
    MP_CHECK(td_value_equal(r, v));
    td_value_unref(r);
    td_value_unref(v);
    td_tensor_unref(big);
    /* a 4 MiB reply is refused by this side's limit, naming the sender */
    v = td_value_int(1 << 20);
    st = td_rpc_sync(a, "worker1", "zeros", &v, 1, NULL, &r);
    fprintf(stderr, "oversized reply: %s: %s\n", td_status_name(st), td_last_error());
    MP_CHECK(st == TD_ERR_INVALID);
    MP_CHECK(strstr(td_last_error(), "worker1 (rank 1)") != NULL);
    MP_CHECK(strstr(td_last_error(), "limit") != NULL);
    td_value_unref(v);
    call_ok(a, "worker1");
    /* several oversized requests interleaved with good ones, async */
    td_future *fs[6];
    n = 1 << 20;
    MP_CHECK_OK(td_tensor_zeros(&n, 1, TD_DTYPE_F32, td_device_cpu(), &big));
    v = td_value_tensor(big);
    td_value *two[2] = {td_value_int(1), td_value_int(2)};
    for (int i = 0; i < 6; i++) {
      if (i % 2) MP_CHECK_OK(td_rpc_async(a, "worker1", "echo", &v, 1, NULL, &fs[i]));
      else MP_CHECK_OK(td_rpc_async(a, "worker1", "add", two, 2, NULL, &fs[i]));
    }
    for (int i = 0; i < 6; i++) {
      st = td_future_wait(fs[i], td_test_ms(10000));
      if (i % 2) {
        MP_CHECK(st == TD_ERR_INVALID && strstr(td_future_message(fs[i]), "limit"));
      } else {
        MP_CHECK(st == TD_OK && as_int(td_future_value(fs[i])) == 3);
      }
      td_future_unref(fs[i]);
    }
    td_value_unref(two[0]);
    td_value_unref(two[1]);
    td_value_unref(v);
    td_tensor_unref(big);
  }
  /* every call was answered: the graceful shutdown completes */
  td_status st = td_rpc_shutdown(a, true, td_test_ms(20000));
  if (st != TD_OK) fprintf(stderr, "rank %d shutdown: %s\n", rank, td_last_error());
  MP_CHECK_OK(st);
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rpc_oversized_request_rejected(void **state) {
  TD_MP_RUN(2, worker_oversized, NULL, 60);
}

/* Rank 1 refuses the next 3 valid HELLOs as if its members' handshake slots were full; rank 0's
 * first call to it opens a stream that is refused 3 times before the server answered (nothing but
 * the HELLO went out), so the transport opens it again with the call's frame: the call succeeds
 * and nothing fails. */
static int worker_refused(int rank, int world, const char *method, void *arg) {
  (void)arg;
  register_fault_fns();
  setenv("TD_RPC_LANE_DIAL", "0", 1); /* (the gRPC stream's handshake is under test) */
  td_rpc_options o = td_mp_rpc_options(method, 2);
  td_rpc_agent *a;
  MP_CHECK_OK(td_rpc_init(NULL, rank, world, &o, &a));
  uint64_t dl = td__now_ns() + (uint64_t)td_test_ms(30000) * 1000000ull;
  if (rank == 1) {
    td__transport_test_refuse_hellos(a->tr, 3);
    MP_CHECK_OK(td__store_set(&a->sc, "armed", "1", 1));
  } else {
    MP_CHECK_OK(td__store_wait_key(&a->sc, "armed", dl, NULL, NULL, NULL));
    call_ok(a, "worker1");
    call_ok(a, "worker1");
    td_rpc_stats s;
    MP_CHECK_OK(td_rpc_get_stats(a, &s));
    MP_CHECK(s.calls_failed == 0 && s.calls_succeeded == 2);
  }
  MP_CHECK_OK(td_rpc_shutdown(a, true, td_test_ms(20000)));
  if (rank == 1) {
    td_rpc_stats s;
    MP_CHECK_OK(td_rpc_get_stats(a, &s));
    fprintf(stderr, "refused handshakes at rank 1: %llu\n",
            (unsigned long long)s.refused_connections);
    MP_CHECK(s.refused_connections >= 3);
  }
  td_rpc_destroy(a);
  MP_CHECK_NO_LEAKS();
  return 0;
}

static void test_rpc_refused_handshake_retries(void **state) {
  (void)state;
  TD_MP_RUN(2, worker_refused, NULL, 60);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_rpc_peer_killed_fails_calls),
      cmocka_unit_test(test_rpc_peer_dies_in_handler_fails_calls),
      cmocka_unit_test(test_rpc_hung_peer_keepalive),
      cmocka_unit_test(test_rpc_stream_bad_magic_closes_stream),
      cmocka_unit_test(test_rpc_stream_bad_header_gets_error_reply),
      cmocka_unit_test(test_rpc_unknown_method_unimplemented),
      cmocka_unit_test(test_rpc_oversized_request_rejected),
      cmocka_unit_test(test_rpc_refused_handshake_retries),
  };
  return cmocka_run_group_tests_name("rpc_faults", tests, NULL, NULL);
}
