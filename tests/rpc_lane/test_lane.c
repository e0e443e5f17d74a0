/* test_lane.c - the same-host lane (rpc/lane.c) inside one process, playing both ends and a
 * hostile peer: the ring's bounds (a peer's out-of-range positions, garbage bytes, huge declared
 * lengths), the hand-over refusing strangers (another process, a wrong secret, memory that is
 * not sealed or has the wrong size, garbage), and frames through an established lane (order,
 * frames larger than the ring) until a corrupt ring closes it.
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rpc/auth.h"
#include "rpc/lane.h"
#include "rpc/wire.h"
#include "test_util.h"

static const td__wire_ctx ctx = {NULL, 0, 1};

/* ---- a sink for decoded frames (filled on the lane thread) ---- */

typedef struct sink {
  pthread_mutex_t mu;
  uint64_t ids[4096];
  int n, bad;
  td_status bad_st;
  int64_t last_numel;
  float last_tail; /* the last element of the last tensor received */
} sink;

static void sink_on_msg(void *ud, td__msg *m) {
  sink *s = ud;
  pthread_mutex_lock(&s->mu);
  if (s->n < 4096) s->ids[s->n] = m->id;
  s->n++;
  td_tensor *t;
  if (m->nvalues == 1 && td_value_as_tensor(m->values[0], &t) == TD_OK) {
    s->last_numel = td_tensor_numel(t);
    s->last_tail = ((const float *)td_tensor_data(t))[s->last_numel - 1];
  }
  pthread_mutex_unlock(&s->mu);
  td__msg_clear(m);
}

static void sink_on_bad(void *ud, uint64_t id, td_status st, const char *why) {
  (void)id;
  (void)why;
  sink *s = ud;
  pthread_mutex_lock(&s->mu);
  s->bad++;
  s->bad_st = st;
  pthread_mutex_unlock(&s->mu);
}

static int sink_count(sink *s) {
  pthread_mutex_lock(&s->mu);
  int n = s->n;
  pthread_mutex_unlock(&s->mu);
  return n;
}

static td__decoder *new_decoder(sink *s, uint64_t max) {
  td__decoder *d = NULL;
  TD_ASSERT_OK(td__decoder_create(&ctx, max, sink_on_msg, sink_on_bad, s, &d));
  return d;
}

/* A request frame with id and, when numel > 0, one float tensor 0..numel-1. */
static void encode(uint64_t id, int64_t numel, td__frame *f) {
  td_value *v = NULL;
  if (numel > 0) {
    td_tensor *t;
    TD_ASSERT_OK(td_tensor_arange(0, (double)numel, 1, TD_DTYPE_F32, td_device_cpu(), &t));
    v = td_value_tensor(t);
    td_tensor_unref(t);
  } else {
    v = td_value_int((int64_t)id);
  }
  td__msg m = {.id = id, .kind = TD__MSG_REQUEST, .fn = "f", .values = &v, .nvalues = 1};
  td__wire_ctx c = ctx;
  TD_ASSERT_OK(td__wire_encode(&m, &c, f));
  td_value_unref(v);
}

/* The frame's bytes in one buffer (*n of them). */
static uint8_t *flatten(td__frame *f, size_t *n) {
  size_t len = f->head_len;
  for (int i = 0; i < f->ntensors; i++) len += td_tensor_nbytes(f->tensors[i]);
  uint8_t *b = malloc(len), *p = b;
  assert_non_null(b);
  memcpy(p, f->head, f->head_len);
  p += f->head_len;
  for (int i = 0; i < f->ntensors; i++) {
    memcpy(p, td_tensor_data(f->tensors[i]), td_tensor_nbytes(f->tensors[i]));
    p += td_tensor_nbytes(f->tensors[i]);
  }
  *n = len;
  return b;
}

/* ---- the ring against a hostile peer ---- */

static void test_lane_ring_bounds(void **state) {
  (void)state;
  td__ring_ctl *r = aligned_alloc(64, (td__ring_ctl_size() + 63) / 64 * 64);
  uint8_t *data = calloc(1, TD__LANE_RING);
  assert_non_null(r);
  assert_non_null(data);
  memset(r, 0, td__ring_ctl_size());
  uint64_t *tail = td__ring_tail_word(r), *headw = td__ring_head_word(r);

  /* what a consumer accepts from the producer: 0..RING bytes ahead of its own head */
  *tail = TD__LANE_RING;
  assert_int_equal(td__ring_readable(r, 0), TD__LANE_RING);
  *tail = TD__LANE_RING + 1;
  assert_int_equal(td__ring_readable(r, 0), -1);
  *tail = 999; /* behind the consumer */
  assert_int_equal(td__ring_readable(r, 1000), -1);
  *tail = UINT64_MAX;
  assert_int_equal(td__ring_readable(r, 0), -1);
  /* what a producer accepts from the consumer: a head within the last RING bytes it wrote */
  *headw = 200;
  assert_int_equal(td__ring_writable(r, 100), -1); /* ahead of the producer */
  *headw = 100 + 1 - TD__LANE_RING - 1;             /* more than a ring behind: wraps */
  assert_int_equal(td__ring_writable(r, 100), -1);
  *headw = 100;
  assert_int_equal(td__ring_writable(r, 100), TD__LANE_RING);

  /* a corrupt tail: nothing consumed, the shared head not moved, an error for the stream */
  sink s = {.mu = PTHREAD_MUTEX_INITIALIZER};
  td__decoder *d = new_decoder(&s, 1u << 20);
  uint64_t head = 1000;
  *headw = 1000;
  *tail = 1000 + TD__LANE_RING + 7;
  assert_int_equal(td__ring_consume(r, data, &head, d, UINT64_MAX), -1);
  assert_int_equal(head, 1000);
  assert_int_equal(*headw, 1000);
  assert_non_null(strstr(td_last_error(), "out of range"));

  /* two frames written across the end of the ring arrive whole, in order */
  td__frame f1 = {0}, f2 = {0};
  encode(41, 0, &f1);
  encode(42, 300, &f2);
  size_t n1, n2;
  uint8_t *b1 = flatten(&f1, &n1), *b2 = flatten(&f2, &n2);
  head = 5ull * TD__LANE_RING - 7; /* positions run free: any multiple of the ring, minus 7 */
  *headw = head;
  uint64_t pos = head;
  for (size_t i = 0; i < n1; i++, pos++) data[pos % TD__LANE_RING] = b1[i];
  for (size_t i = 0; i < n2; i++, pos++) data[pos % TD__LANE_RING] = b2[i];
  *tail = pos;
  /* at most max bytes a pass: a peer that keeps writing cannot hold the reader */
  assert_int_equal(td__ring_consume(r, data, &head, d, 10), 10);
  assert_int_equal(td__ring_consume(r, data, &head, d, UINT64_MAX), (int64_t)(n1 + n2 - 10));
  assert_int_equal(head, pos);
  assert_int_equal(*headw, pos);
  assert_int_equal(s.n, 2);
  assert_int_equal(s.ids[0], 41);
  assert_int_equal(s.ids[1], 42);
  assert_int_equal(s.last_numel, 300);
  assert_true(s.last_tail == 299.0f);
  assert_int_equal(td__ring_consume(r, data, &head, d, UINT64_MAX), 0); /* empty */

  /* a frame declaring 2^40 bytes: skipped by id (nothing allocated), the ring goes on */
  uint8_t pre[TD__FRAME_PREFIX];
  td__put_u32(pre, TD__FRAME_MAGIC);
  td__put_u32(pre + 4, 16);
  td__put_u64(pre + 8, 1ull << 40);
  td__put_u64(pre + 16, 77);
  for (size_t i = 0; i < sizeof pre; i++, pos++) data[pos % TD__LANE_RING] = pre[i];
  *tail = pos;
  assert_int_equal(td__ring_consume(r, data, &head, d, UINT64_MAX), (int64_t)sizeof pre);
  assert_int_equal(s.bad, 1);
  assert_int_equal(s.bad_st, TD_ERR_INVALID);
  td__decoder_destroy(d);

  /* garbage: the stream is corrupt (the lane closes) */
  d = new_decoder(&s, 1u << 20);
  for (int i = 0; i < 24; i++, pos++) data[pos % TD__LANE_RING] = 0xab;
  *tail = pos;
  assert_int_equal(td__ring_consume(r, data, &head, d, UINT64_MAX), -1);
  assert_non_null(strstr(td_last_error(), "corrupt"));
  td__decoder_destroy(d);
  td__frame_clear(&f1);
  td__frame_clear(&f2);
  free(b1);
  free(b2);
  free(data);
  free(r);
}

/* ---- the hand-over ---- */

typedef struct watch {
  pthread_mutex_t mu;
  int refused;
  char why[256];
  int failed;
  char failed_why[256];
} watch;

static void on_refused(void *ud, const char *why) {
  watch *w = ud;
  pthread_mutex_lock(&w->mu);
  w->refused++;
  snprintf(w->why, sizeof w->why, "%s", why);
  pthread_mutex_unlock(&w->mu);
}

static void on_failed(void *ud, const char *why) {
  watch *w = ud;
  pthread_mutex_lock(&w->mu);
  w->failed++;
  snprintf(w->failed_why, sizeof w->failed_why, "%s", why);
  pthread_mutex_unlock(&w->mu);
}

/* A process's lanes where rank `rank` is the process pid. */
static int failed_count(watch *w) {
  pthread_mutex_lock(&w->mu);
  int n = w->failed;
  pthread_mutex_unlock(&w->mu);
  return n;
}

static td__lanes *make_lanes(watch *w, int rank, int pid) {
  td__lanes_opts o = {on_refused, on_failed, NULL, NULL, w};
  td__lanes *ls = NULL;
  TD_ASSERT_OK(td__lanes_create(&o, &ls));
  int pids[2] = {0, 0};
  pids[rank] = pid;
  TD_ASSERT_OK(td__lanes_set_pids(ls, pids, 2));
  return ls;
}

/* The hand-over as lane.c's client sends it (rpc/lane.c: "TDLJ", secret, 2 descriptors). */
#define JOIN_MAGIC 0x4a4c4454u
#define MAP_BYTES ((size_t)4096 + 2u * TD__LANE_RING)

static int connect_offer(const uint8_t *body, size_t len) {
  size_t nl = body[TD__LANE_SECRET];
  assert_int_equal(len, TD__LANE_SECRET + 1 + nl);
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  memcpy(a.sun_path + 1, body + TD__LANE_SECRET + 1, nl);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(connect(fd, (struct sockaddr *)&a,
                           (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + nl)), 0);
  return fd;
}

/* A memfd of n bytes, sealed against resizing or not. */
static int memfd(size_t n, bool sealed) {
  int fd = memfd_create("test-lane", MFD_ALLOW_SEALING);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, (off_t)n), 0);
  if (sealed) assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

static void send_join(int fd, const uint8_t *secret, int lane_fd, int bell_fd, bool with_fds) {
  uint8_t buf[4 + TD__LANE_SECRET];
  td__put_u32(buf, JOIN_MAGIC);
  memcpy(buf + 4, secret, TD__LANE_SECRET);
  struct iovec iov = {buf, sizeof buf};
  union {
    struct cmsghdr h;
    char b[CMSG_SPACE(2 * sizeof(int))];
  } cm;
  memset(&cm, 0, sizeof cm);
  struct msghdr mh = {0};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (with_fds) {
    mh.msg_control = cm.b;
    mh.msg_controllen = sizeof cm.b;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    int fds[2] = {lane_fd, bell_fd};
    memcpy(CMSG_DATA(c), fds, sizeof fds);
  }
  assert_int_equal(sendmsg(fd, &mh, 0), (ssize_t)sizeof buf);
}

enum { H_STRANGER, H_WRONG_SECRET, H_UNSEALED, H_WRONG_SIZE, H_GARBAGE };

/* One offer answered by a forged hand-over of kind h: refused, counted, and the lane closed. */
static void forged(td__lanes *srv, watch *w, int h, const char *want) {
  sink s = {.mu = PTHREAD_MUTEX_INITIALIZER};
  uint8_t body[TD__LANE_CTRL_MAX];
  size_t len = 0;
  td__lane *l = NULL;
  TD_ASSERT_OK(td__lane_offer(srv, 1, new_decoder(&s, 0), NULL, body, &len, &l));
  assert_non_null(l);
  uint8_t secret[TD__LANE_SECRET];
  memcpy(secret, body, sizeof secret);
  if (h == H_WRONG_SECRET) secret[5] ^= 1;
  int lane_fd = memfd(h == H_WRONG_SIZE ? MAP_BYTES - 4096 : MAP_BYTES, h != H_UNSEALED);
  int bell_fd = memfd(4096, true);
  if (h == H_STRANGER) { /* another process, with everything else right */
    pid_t c = fork();
    assert_true(c >= 0);
    if (c == 0) {
      int fd = connect_offer(body, len);
      send_join(fd, secret, lane_fd, bell_fd, true);
      _exit(0);
    }
    int status;
    assert_int_equal(waitpid(c, &status, 0), c);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  } else {
    int fd = connect_offer(body, len);
    if (h == H_GARBAGE) assert_int_equal(write(fd, "0123456789abcdef0123456789abcdef0123", 36), 36);
    else send_join(fd, secret, lane_fd, bell_fd, true);
    close(fd);
  }
  close(lane_fd);
  close(bell_fd);
  int before = w->refused;
  TD_ASSERT_STATUS(td__lane_accept(l), TD_ERR_UNAVAILABLE);
  pthread_mutex_lock(&w->mu);
  assert_int_equal(w->refused, before + 1);
  if (!strstr(w->why, want)) fail_msg("refusal '%s' lacks '%s'", w->why, want);
  pthread_mutex_unlock(&w->mu);
  td__lane_unref(l);
}

static void test_lane_handover_refuses_strangers(void **state) {
  (void)state;
  watch w = {.mu = PTHREAD_MUTEX_INITIALIZER};
  td__lanes *srv = make_lanes(&w, 1, (int)getpid());
  forged(srv, &w, H_STRANGER, "offered no lane");
  forged(srv, &w, H_WRONG_SECRET, "wrong lane secret");
  forged(srv, &w, H_UNSEALED, "not sealed");
  forged(srv, &w, H_WRONG_SIZE, "wrong kind or size");
  forged(srv, &w, H_GARBAGE, "malformed");
  /* a client whose rank is not known on this host gets no lane from an offer */
  watch wc = {.mu = PTHREAD_MUTEX_INITIALIZER};
  td__lanes *cli = make_lanes(&wc, 0, 0);
  sink s = {.mu = PTHREAD_MUTEX_INITIALIZER};
  uint8_t body[TD__LANE_CTRL_MAX];
  size_t len = 0;
  td__lane *l = NULL, *c = NULL;
  TD_ASSERT_OK(td__lane_offer(srv, 1, new_decoder(&s, 0), NULL, body, &len, &l));
  TD_ASSERT_STATUS(td__lane_join(cli, 0, body, len, new_decoder(&s, 0), NULL, &c),
                   TD_ERR_UNAVAILABLE);
  assert_null(c);
  td__lane_close(l);
  td__lane_unref(l);
  td__lanes_destroy(cli);
  td__lanes_destroy(srv);
}

/* ---- dialled lanes: no stream under them ---- */

/* What a process's dial side reported: the server's lanes (dialed), the ends (ended). */
typedef struct dial_watch {
  watch w;
  sink s;                /* frames of the lanes this side accepted */
  td__lane *accepted[8]; /* references */
  int naccepted;
  int ended;
  char ended_why[256];
  /* direct copy settled in the handshake: what probe answers, the ranks it was asked about and
   * the ranks that said they read this side (bit masks) */
  bool reads_peers;
  int probed, proven, read_by; /* proven: probed with the access proven (a mailbox lane) */
} dial_watch;

static bool on_probe(void *ud, int rank, bool proven) {
  dial_watch *d = ud;
  pthread_mutex_lock(&d->w.mu);
  d->probed |= 1 << rank;
  if (proven) d->proven |= 1 << rank;
  bool r = d->reads_peers;
  pthread_mutex_unlock(&d->w.mu);
  return r;
}

static void on_peer_reads(void *ud, int rank) {
  dial_watch *d = ud;
  pthread_mutex_lock(&d->w.mu);
  d->read_by |= 1 << rank;
  pthread_mutex_unlock(&d->w.mu);
}

static td_status on_dialed(void *ud, td__lane *l, int peer, td__decoder **dec, void **owner) {
  dial_watch *d = ud;
  (void)peer;
  pthread_mutex_lock(&d->w.mu);
  if (d->naccepted < 8) d->accepted[d->naccepted++] = td__lane_ref(l);
  pthread_mutex_unlock(&d->w.mu);
  *dec = new_decoder(&d->s, 1u << 24);
  *owner = d;
  return TD_OK;
}

static void on_ended(void *ud, const char *why) {
  dial_watch *d = ud;
  pthread_mutex_lock(&d->w.mu);
  d->ended++;
  snprintf(d->ended_why, sizeof d->ended_why, "%s", why);
  pthread_mutex_unlock(&d->w.mu);
}

static int dw_get(dial_watch *d, int *field) {
  pthread_mutex_lock(&d->w.mu);
  int v = *field;
  pthread_mutex_unlock(&d->w.mu);
  return v;
}

/* Ranks 0 and 1 both this process; nonces 0x1111 and 0x2222 name their dial sockets (a second
 * process's rank 0 in one process: self_nonce names its own). */
static td__lanes *dial_lanes(dial_watch *d, int rank, const char *secret, int64_t hs_ms,
                             uint64_t self_nonce) {
  td__lanes_opts o = {on_refused, on_failed, NULL,      NULL,     &d->w,
                      NULL,       on_dialed, on_ended, on_probe, on_peer_reads};
  td__lanes *ls = NULL;
  TD_ASSERT_OK(td__lanes_create(&o, &ls));
  o.refused_ud = &d->w;
  int pids[2] = {(int)getpid(), (int)getpid()};
  TD_ASSERT_OK(td__lanes_set_pids(ls, pids, 2));
  /* (on_dialed gets refused_ud: the watch is the first member of dial_watch) */
  td__auth a;
  TD_ASSERT_OK(td__auth_init(&a, secret, strlen(secret)));
  uint64_t nonces[2] = {0x1111, 0x2222};
  TD_ASSERT_OK(td__lanes_listen_dial(ls, rank, &a, self_nonce ? self_nonce : nonces[rank], nonces,
                                     2, hs_ms, 200, 30000));
  return ls;
}

static td__lane *dial_send(td__lanes *cli, dial_watch *dc, int first, int n) {
  td__lane *cl = NULL;
  TD_ASSERT_OK(td__lane_dial(cli, 1, new_decoder(&dc->s, 1u << 24), dc, &cl));
  for (int i = 0; i < n; i++) {
    td__frame f = {0};
    encode((uint64_t)(first + i), 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len};
    TD_ASSERT_OK(td__lane_send(cl, &m));
  }
  return cl;
}

#define POLL(cond) for (int k_ = 0; k_ < 5000 && !(cond); k_++) usleep(1000)

/* The server's side of a lane sends frame 7: the client (which has read nothing yet) gets it. */
static void reply_back(td__lane *sl, dial_watch *dc) {
  td__frame f = {0};
  encode(7, 0, &f);
  td__lane_msg m = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_OK(td__lane_send(sl, &m));
  POLL(sink_count(&dc->s) == 1);
  assert_int_equal(sink_count(&dc->s), 1);
  assert_int_equal(dc->s.ids[0], 7);
}

/* The client's lane cl sends frames 101-105 (after 100 the server read) and closes: the server
 * reads them, then sees the end once; the client's end names its reason; sends are refused. */
static void close_after_five(td__lane *cl, dial_watch *ds, dial_watch *dc) {
  td__frame f = {0};
  for (int i = 0; i < 5; i++) {
    encode(101 + (uint64_t)i, 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len};
    TD_ASSERT_OK(td__lane_send(cl, &m));
  }
  td__lane_close_why(cl, "bye");
  POLL(dw_get(ds, &ds->ended) == 1);
  assert_int_equal(dw_get(ds, &ds->ended), 1);
  assert_int_equal(sink_count(&ds->s), 105);
  assert_non_null(strstr(ds->ended_why, "closed the lane"));
  POLL(dw_get(dc, &dc->ended) == 1);
  assert_non_null(strstr(dc->ended_why, "bye"));
  encode(106, 0, &f);
  td__lane_msg m = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_STATUS(td__lane_send(cl, &m), TD_ERR_UNAVAILABLE);
}

static void test_lane_dial(void **state) {
  (void)state;
  const char *secret = "a job secret of the group, long enough";
  dial_watch ds = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  dial_watch dc = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  td__lanes *srv = dial_lanes(&ds, 1, secret, 500, 0), *cli = dial_lanes(&dc, 0, secret, 500, 0);
  assert_true(td__lanes_can_dial(cli, 1));
  assert_false(td__lanes_can_dial(cli, 0)); /* itself */
  /* frames sent at once, before the handshake is done, arrive in order once it is */
  td__lane *cl = dial_send(cli, &dc, 1, 100);
  POLL(sink_count(&ds.s) == 100);
  assert_int_equal(sink_count(&ds.s), 100);
  for (int i = 0; i < 100; i++) assert_int_equal(ds.s.ids[i], (uint64_t)i + 1);
  POLL(td__lanes_dialed(cli) == 1 && td__lanes_dialed(srv) == 1);
  assert_int_equal(td__lanes_dialed(cli), 1);
  assert_int_equal(td__lanes_dialed(srv), 1);
  assert_int_equal(dw_get(&ds, &ds.naccepted), 1);
  /* and back, through the server's side of it */
  reply_back(ds.accepted[0], &dc);
  td__frame f = {0};
  /* the client closes: the server sees the socket end, reads what was written before it, and
   * reports the end once */
  td__lane *cl2 = dial_send(cli, &dc, 1000, 0);
  POLL(td__lanes_dialed(srv) == 2);
  close_after_five(cl, &ds, &dc);
  /* the other lane still works */
  encode(8, 0, &f);
  td__lane_msg m3 = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_OK(td__lane_send(ds.accepted[1], &m3));
  POLL(sink_count(&dc.s) == 2);
  assert_int_equal(dc.s.ids[1], 8);
  /* a client with another job's secret: the server's proof fails at the client, which gives up;
   * the server counts the abandoned handshake as refused */
  dial_watch dx = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  td__lanes *other = dial_lanes(&dx, 0, "another job's secret, long enough", 500, 0x3333);
  int refused0 = dw_get(&ds, &ds.w.refused);
  td__lane *xl = dial_send(other, &dx, 1, 0);
  for (int i = 0; i < 3; i++) { /* (the lane may already be closed: its handshake failed) */
    td__frame f = {0};
    encode((uint64_t)(1 + i), 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len};
    (void)td__lane_send(xl, &m);
  }
  POLL(dw_get(&dx, &dx.ended) == 1 && dw_get(&ds, &ds.w.refused) > refused0);
  assert_int_equal(dw_get(&dx, &dx.ended), 1);
  assert_int_equal(dw_get(&ds, &ds.w.refused), refused0 + 1);
  assert_int_equal(sink_count(&ds.s), 105); /* nothing of its frames was read */
  assert_int_equal(dw_get(&ds, &ds.naccepted), 2);
  /* strangers at the socket: another process (closed at once), garbage from a member's process,
   * a member's process that never sends its HELLO (timed out) */
  char name[64];
  snprintf(name, sizeof name, "tdist-dial-%d-%016llx", (int)getpid(), 0x2222ull);
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  memcpy(sa.sun_path + 1, name, strlen(name));
  socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
  pid_t c = fork();
  assert_true(c >= 0);
  if (c == 0) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, salen) != 0) _exit(1);
    char b[8];
    _exit(read(fd, b, sizeof b) == 0 ? 0 : 2); /* closed without a word */
  }
  int status;
  assert_int_equal(waitpid(c, &status, 0), c);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  POLL(dw_get(&ds, &ds.w.refused) == refused0 + 2);
  pthread_mutex_lock(&ds.w.mu);
  assert_int_equal(ds.w.refused, refused0 + 2);
  if (!strstr(ds.w.why, "no member")) fail_msg("refusal '%s'", ds.w.why);
  pthread_mutex_unlock(&ds.w.mu);
  int g = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_int_equal(connect(g, (struct sockaddr *)&sa, salen), 0);
  uint8_t junk[TD__HS_HELLO_LEN];
  memset(junk, 0x5a, sizeof junk);
  assert_int_equal(write(g, junk, sizeof junk), (ssize_t)sizeof junk);
  POLL(dw_get(&ds, &ds.w.refused) == refused0 + 3);
  assert_int_equal(dw_get(&ds, &ds.w.refused), refused0 + 3);
  char b[8];
  assert_int_equal(read(g, b, sizeof b), 0); /* closed */
  close(g);
  int q = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_int_equal(connect(q, (struct sockaddr *)&sa, salen), 0);
  POLL(dw_get(&ds, &ds.w.refused) == refused0 + 4);
  pthread_mutex_lock(&ds.w.mu);
  assert_int_equal(ds.w.refused, refused0 + 4);
  if (!strstr(ds.w.why, "in time")) fail_msg("refusal '%s'", ds.w.why);
  pthread_mutex_unlock(&ds.w.mu);
  close(q);
  assert_int_equal(dw_get(&ds, &ds.naccepted), 2);
  /* the server goes away: the client's open lane ends */
  td__lanes_destroy(srv);
  POLL(dw_get(&dc, &dc.ended) == 2);
  assert_int_equal(dw_get(&dc, &dc.ended), 2);
  for (int i = 0; i < ds.naccepted; i++) td__lane_unref(ds.accepted[i]);
  td__lane_unref(cl);
  td__lane_unref(cl2);
  td__lane_unref(xl);
  td__lanes_destroy(other);
  td__lanes_destroy(cli);
}

/* Mailbox lanes: no handshake between the two; each side reaches the other's arena through
 * pidfd_getfd (here both ranks are this process). A side that makes its lane knocks; the other
 * makes its own side from the knock and reads what waited in its slot, in order; the pair has one
 * lane, made once; closing it ends the other side after what was written before; an arena that
 * does not carry the nonce of the peer's record is refused. */
static void *grab_id(void *p) { return p; }

static void mbox_on(td__lanes *a, td__lanes *b, uint64_t nonce_a, uint64_t nonce_b) {
  int bell[2], arena[2];
  TD_ASSERT_OK(td__lanes_mbox_open(a, 2, nonce_a, &bell[0], &arena[0]));
  TD_ASSERT_OK(td__lanes_mbox_open(b, 2, nonce_b, &bell[1], &arena[1]));
  TD_ASSERT_OK(td__lanes_set_mbox(a, bell, arena, 2));
  TD_ASSERT_OK(td__lanes_set_mbox(b, bell, arena, 2));
}

static void test_lane_mailbox(void **state) {
  (void)state;
  const char *secret = "a job secret of the group, long enough";
  dial_watch ds = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  dial_watch dc = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  td__lanes *srv = dial_lanes(&ds, 1, secret, 500, 0), *cli = dial_lanes(&dc, 0, secret, 500, 0);
  assert_false(td__lanes_can_mbox(cli, 1)); /* no arenas yet */
  mbox_on(cli, srv, 0x1111, 0x2222);
  assert_true(td__lanes_can_mbox(cli, 1));
  assert_false(td__lanes_can_mbox(cli, 0)); /* itself */
  void *owner = NULL;
  TD_ASSERT_OK(td__lanes_mbox(cli, 1, grab_id, &owner));
  assert_ptr_equal(owner, &dc);
  assert_int_equal(dw_get(&dc, &dc.naccepted), 1);
  td__lane *cl = dc.accepted[0];
  assert_true(td__lane_is_mbox(cl));
  for (int i = 0; i < 100; i++) {
    td__frame f = {0};
    encode((uint64_t)i + 1, i % 10 == 0 ? 70000 : 0, &f); /* some larger than the ring */
    td__lane_msg m = {.head = f.head, .head_len = f.head_len, .tensors = f.tensors,
                      .ntensors = f.ntensors};
    TD_ASSERT_OK(td__lane_send(cl, &m));
  }
  POLL(sink_count(&ds.s) == 100);
  assert_int_equal(sink_count(&ds.s), 100);
  for (int i = 0; i < 100; i++) assert_int_equal(ds.s.ids[i], (uint64_t)i + 1);
  assert_int_equal(dw_get(&ds, &ds.naccepted), 1);
  POLL(td__lanes_mboxes(srv) == 1);
  assert_int_equal(td__lanes_mboxes(cli), 1);
  assert_int_equal(td__lanes_mboxes(srv), 1);
  assert_int_equal(td__lanes_dialed(srv), 1);
  /* direct copy settled by the making: each side's probe is told the access is proven (no read
   * of the peer), and each learns from the other's knock that the other reads it */
  POLL(dw_get(&ds, &ds.read_by) == 1 << 0 && dw_get(&dc, &dc.read_by) == 1 << 1);
  assert_int_equal(dw_get(&dc, &dc.proven), 1 << 1);
  assert_int_equal(dw_get(&ds, &ds.proven), 1 << 0);
  assert_int_equal(dw_get(&ds, &ds.read_by), 1 << 0);
  assert_int_equal(dw_get(&dc, &dc.read_by), 1 << 1);
  /* and back through the server's side; asking again finds the one lane on either side */
  reply_back(ds.accepted[0], &dc);
  td__frame f = {0};
  TD_ASSERT_OK(td__lanes_mbox(srv, 0, grab_id, &owner));
  assert_ptr_equal(owner, &ds);
  TD_ASSERT_OK(td__lanes_mbox(cli, 1, grab_id, &owner));
  assert_int_equal(dw_get(&dc, &dc.naccepted), 1);
  assert_int_equal(dw_get(&ds, &ds.naccepted), 1);
  /* the client closes after five more frames: the server reads them, then ends once */
  close_after_five(cl, &ds, &dc);
  /* made once: the pair dials a lane from here on */
  TD_ASSERT_STATUS(td__lanes_mbox(cli, 1, grab_id, &owner), TD_ERR_UNAVAILABLE);
  TD_ASSERT_STATUS(td__lanes_mbox(srv, 0, grab_id, &owner), TD_ERR_UNAVAILABLE);
  for (int i = 0; i < ds.naccepted; i++) td__lane_unref(ds.accepted[i]);
  for (int i = 0; i < dc.naccepted; i++) td__lane_unref(dc.accepted[i]);
  td__lanes_destroy(srv);
  td__lanes_destroy(cli);

  /* rank 0's arena carries a nonce its record (0x1111) does not: rank 1 takes nothing from it,
   * and rank 0's knock finds rank 1 refusing to make its side: rank 0's lane sees it gone */
  dial_watch es = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  dial_watch ec = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  srv = dial_lanes(&es, 1, secret, 500, 0);
  cli = dial_lanes(&ec, 0, secret, 500, 0);
  mbox_on(cli, srv, 0x9999, 0x2222);
  TD_ASSERT_STATUS(td__lanes_mbox(srv, 0, grab_id, &owner), TD_ERR_UNAVAILABLE);
  assert_int_equal(dw_get(&es, &es.naccepted), 0);
  TD_ASSERT_OK(td__lanes_mbox(cli, 1, grab_id, &owner));
  encode(1, 0, &f);
  td__lane_msg m4 = {.head = f.head, .head_len = f.head_len};
  td_status st4 = td__lane_send(ec.accepted[0], &m4); /* (the lane may have ended already) */
  assert_true(st4 == TD_OK || st4 == TD_ERR_UNAVAILABLE);
  POLL(dw_get(&ec, &ec.ended) == 1);
  assert_int_equal(dw_get(&ec, &ec.ended), 1);
  assert_int_equal(sink_count(&es.s), 0);
  assert_int_equal(dw_get(&es, &es.naccepted), 0);
  for (int i = 0; i < ec.naccepted; i++) td__lane_unref(ec.accepted[i]);
  td__lanes_destroy(srv);
  td__lanes_destroy(cli);
}

/* Direct copy is settled in a dialled lane's handshake: once the peer proved itself each side
 * probes it and tells it the answer (the client with its PROOF, the server with its doorbell),
 * so each side learns whether the other reads its memory, and nothing else does. */
static void test_lane_dial_settles_direct_copy(void **state) {
  (void)state;
  const char *secret = "a job secret of the group, long enough";
  dial_watch ds = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  dial_watch dc = {.w = {.mu = PTHREAD_MUTEX_INITIALIZER}, .s = {.mu = PTHREAD_MUTEX_INITIALIZER}};
  for (int k = 0; k < 2; k++) { /* the server reads the client, or the client the server */
    ds.reads_peers = k == 0;
    dc.reads_peers = k == 1;
    ds.probed = ds.read_by = dc.probed = dc.read_by = 0;
    td__lanes *srv = dial_lanes(&ds, 1, secret, 5000, 0);
    td__lanes *cli = dial_lanes(&dc, 0, secret, 5000, 0);
    td__lane *cl = dial_send(cli, &dc, 1, 1);
    POLL(td__lanes_dialed(cli) == 1 && td__lanes_dialed(srv) == 1);
    assert_int_equal(td__lanes_dialed(cli), 1);
    assert_int_equal(td__lanes_dialed(srv), 1);
    assert_int_equal(dw_get(&dc, &dc.probed), 1 << 1); /* each probed the other once */
    assert_int_equal(dw_get(&ds, &ds.probed), 1 << 0);
    assert_int_equal(dw_get(&dc, &dc.proven) | dw_get(&ds, &ds.proven), 0); /* by reading it */
    if (k == 0) { /* the client learns that the server reads it, the server nothing */
      assert_int_equal(dw_get(&dc, &dc.read_by), 1 << 1);
      assert_int_equal(dw_get(&ds, &ds.read_by), 0);
    } else {
      assert_int_equal(dw_get(&ds, &ds.read_by), 1 << 0);
      assert_int_equal(dw_get(&dc, &dc.read_by), 0);
    }
    POLL(sink_count(&ds.s) == 1);
    assert_int_equal(sink_count(&ds.s), 1);
    for (int i = 0; i < ds.naccepted; i++) td__lane_unref(ds.accepted[i]);
    ds.naccepted = 0;
    pthread_mutex_lock(&ds.s.mu);
    ds.s.n = 0;
    pthread_mutex_unlock(&ds.s.mu);
    td__lane_unref(cl);
    td__lanes_destroy(cli);
    td__lanes_destroy(srv);
  }
}

enum { MANY = 72 }; /* more lanes than HINT_MIN (16): the lane threads read by hints */

/* MANY lanes from a client (rank 0) to a server (rank 1), both in this process. */
typedef struct many_lanes {
  dial_watch ds, dc;
  td__lanes *srv, *cli;
  td__lane *cl[MANY];
} many_lanes;

/* Dials them (m zeroed) and waits until both lane threads read by hints. */
static void dial_many(many_lanes *m) {
  const char *secret = "a job secret of the group, long enough";
  dial_watch *ds = &m->ds, *dc = &m->dc;
  pthread_mutex_init(&ds->w.mu, NULL), pthread_mutex_init(&ds->s.mu, NULL);
  pthread_mutex_init(&dc->w.mu, NULL), pthread_mutex_init(&dc->s.mu, NULL);
  m->srv = dial_lanes(ds, 1, secret, 20000, 0);
  m->cli = dial_lanes(dc, 0, secret, 20000, 0);
  for (int i = 0; i < MANY; i++) m->cl[i] = dial_send(m->cli, dc, 0, 0);
  POLL(td__lanes_dialed(m->srv) == MANY && td__lanes_dialed(m->cli) == MANY);
  assert_int_equal(td__lanes_dialed(m->srv), MANY);
  assert_int_equal(td__lanes_dialed(m->cli), MANY);
  POLL(td__lanes_by_hints(m->srv) && td__lanes_by_hints(m->cli));
  assert_true(td__lanes_by_hints(m->srv));
  assert_true(td__lanes_by_hints(m->cli));
}

static void free_many(many_lanes *m) {
  for (int i = 0; i < MANY; i++) td__lane_unref(m->cl[i]);
  for (int i = 0; i < m->ds.naccepted; i++) td__lane_unref(m->ds.accepted[i]);
  td__lanes_destroy(m->cli);
  td__lanes_destroy(m->srv);
}

/* n round trips: a frame to the server on `to`, then one back on `back`, each waited for;
 * returns the seconds they took. */
static double round_trips(td__lane *to, td__lane *back, dial_watch *ds, dial_watch *dc, int n) {
  int s0 = sink_count(&ds->s), c0 = sink_count(&dc->s);
  double t0 = td_test_now_s();
  for (int i = 0; i < n; i++) {
    td__frame f = {0};
    encode(1000 + (uint64_t)i, 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len};
    TD_ASSERT_OK(td__lane_send(to, &m));
    for (int k = 0; k < 2000000 && sink_count(&ds->s) < s0 + 1 + i; k++) usleep(20);
    encode(5000 + (uint64_t)i, 0, &f);
    td__lane_msg b = {.head = f.head, .head_len = f.head_len};
    TD_ASSERT_OK(td__lane_send(back, &b));
    for (int k = 0; k < 2000000 && sink_count(&dc->s) < c0 + 1 + i; k++) usleep(20);
  }
  double el = td_test_now_s() - t0;
  assert_int_equal(sink_count(&ds->s), s0 + n);
  assert_int_equal(sink_count(&dc->s), c0 + n);
  return el;
}

/* Both lane threads read by hints (a bit per lane in their doorbell page, set by the peer that
 * wrote). Frames on every lane arrive, and 200 round trips on one lane take milliseconds: a
 * lost hint would leave each frame to the full pass that comes every 100 ms (20 s for these). */
static void test_lane_dial_many_by_hints(void **state) {
  (void)state;
  static many_lanes ml;
  memset(&ml, 0, sizeof ml);
  dial_many(&ml);
  for (int i = 0; i < MANY; i++) {
    td__frame f = {0};
    encode((uint64_t)i + 1, 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len};
    TD_ASSERT_OK(td__lane_send(ml.cl[i], &m));
  }
  POLL(sink_count(&ml.ds.s) == MANY);
  assert_int_equal(sink_count(&ml.ds.s), MANY);
  double el = round_trips(ml.cl[MANY / 2], ml.ds.accepted[0], &ml.ds, &ml.dc, 200);
  fprintf(stderr, "200 round trips by hints: %.3f s\n", el);
  assert_true(el < 5.0);
  /* a lane that closes is the only one the threads' sets look at again (each side: its close,
   * or its peer's end), not all MANY: a group's all-to-all makes and closes N lanes a process */
  uint64_t c0 = td__lanes_refresh_looked(ml.cli), s0 = td__lanes_refresh_looked(ml.srv);
  td__lane_close(ml.cl[0]);
  /* (the socket thread counts the lane gone; the lane thread's set drops it on its next pass) */
  POLL(td__lanes_dialed(ml.cli) == MANY - 1 && td__lanes_dialed(ml.srv) == MANY - 1 &&
       td__lanes_refresh_looked(ml.cli) > c0 && td__lanes_refresh_looked(ml.srv) > s0);
  assert_int_equal(td__lanes_dialed(ml.cli), MANY - 1);
  assert_int_equal(td__lanes_dialed(ml.srv), MANY - 1);
  assert_in_range(td__lanes_refresh_looked(ml.cli) - c0, 1, 3);
  assert_in_range(td__lanes_refresh_looked(ml.srv) - s0, 1, 3);
  free_many(&ml);
}

#if defined(__SANITIZE_THREAD__)
#define TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TEST_TSAN 1
#endif
#endif

/* An idle lane thread sleeps longer and longer, up to 1 s (an idle worker no longer wakes 10
 * times a second), and the next frame still wakes it at once. Frames whose hint bits are gone
 * (a peer may clear any) are not left to the next full pass: a ring of the bell that finds no
 * bit set makes the thread read every lane. Removing that makes each such frame wait a nap
 * (100 ms): 100 round trips then take 10 s. */
static void test_lane_idle_naps_and_lost_hints(void **state) {
  (void)state;
  static many_lanes ml;
  memset(&ml, 0, sizeof ml);
  dial_many(&ml);
  dial_watch *ds = &ml.ds, *dc = &ml.dc;
#ifdef TEST_TSAN
  assert_int_equal(td__lanes_nap_ms(ml.srv), 100); /* (a lost wake-up costs a nap there) */
#else
  POLL(td__lanes_nap_ms(ml.srv) == 1000);
  assert_int_equal(td__lanes_nap_ms(ml.srv), 1000);
#endif
  td__frame f = {0};
  encode(1, 0, &f);
  td__lane_msg m = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_OK(td__lane_send(ml.cl[MANY / 2], &m));
  POLL(sink_count(&ds->s) == 1);
  assert_int_equal(sink_count(&ds->s), 1);
  td__lanes_test_withhold_hints(ml.cli, true);
  double el = round_trips(ml.cl[MANY / 2], ds->accepted[0], ds, dc, 100);
  td__lanes_test_withhold_hints(ml.cli, false);
  fprintf(stderr, "100 round trips with the client's hints withheld: %.3f s\n", el);
  assert_true(el < 5.0); /* (a frame published just before the server sleeps waits a nap) */
  free_many(&ml);
}

/* ---- an established lane ---- */

static void test_lane_frames_then_corrupt_ring(void **state) {
  (void)state;
  watch ws = {.mu = PTHREAD_MUTEX_INITIALIZER}, wc = {.mu = PTHREAD_MUTEX_INITIALIZER};
  td__lanes *srv = make_lanes(&ws, 1, (int)getpid()), *cli = make_lanes(&wc, 0, (int)getpid());
  td__lanes_set_spin(srv, 20000);
  sink ss = {.mu = PTHREAD_MUTEX_INITIALIZER}, sc = {.mu = PTHREAD_MUTEX_INITIALIZER};
  uint8_t body[TD__LANE_CTRL_MAX];
  size_t len = 0;
  td__lane *sl = NULL, *cl = NULL;
  TD_ASSERT_OK(td__lane_offer(srv, 1, new_decoder(&ss, 1u << 24), &ws, body, &len, &sl));
  TD_ASSERT_OK(td__lane_join(cli, 0, body, len, new_decoder(&sc, 1u << 24), &wc, &cl));
  TD_ASSERT_OK(td__lane_accept(sl));
  td__lane_start_tx(sl);
  TD_ASSERT_OK(td__lane_ready(cl));
  td__lane_start_tx(cl);
  td__lane_start_rx(cl);
  td__lane_start_rx(sl);
  assert_int_equal(td__lanes_up(srv), 1);
  assert_int_equal(td__lanes_up(cli), 1);
  /* 2000 small frames and one of 4 MiB (16 rings' worth), in order */
  enum { N = 2000 };
  for (int i = 0; i < N; i++) {
    td__frame f = {0};
    encode((uint64_t)i + 1, i == N / 2 ? (1 << 20) : 0, &f);
    td__lane_msg m = {.head = f.head, .head_len = f.head_len, .tensors = f.tensors,
                      .ntensors = f.ntensors};
    f.head = NULL;
    f.tensors = NULL;
    f.ntensors = 0;
    TD_ASSERT_OK(td__lane_send(cl, &m));
  }
  for (int k = 0; k < 5000 && sink_count(&ss) < N; k++) usleep(1000);
  assert_int_equal(sink_count(&ss), N);
  for (int i = 0; i < N; i++) assert_int_equal(ss.ids[i], (uint64_t)i + 1);
  assert_int_equal(ss.last_numel, 1 << 20);
  assert_true(ss.last_tail == (float)((1 << 20) - 1));
  assert_int_equal(ss.bad, 0);
  /* and back */
  td__frame f = {0};
  encode(9, 0, &f);
  td__lane_msg m = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_OK(td__lane_send(sl, &m));
  for (int k = 0; k < 5000 && sink_count(&sc) < 1; k++) usleep(1000);
  assert_int_equal(sink_count(&sc), 1);
  assert_int_equal(sc.ids[0], 9);
  /* the client scribbles a write position out of range: the server closes the lane (and would
   * close its stream) instead of reading past the ring */
  td__ring_ctl *tx, *rx;
  td__lane_rings(cl, &tx, &rx);
  __atomic_store_n(td__ring_tail_word(tx), *td__ring_tail_word(tx) + TD__LANE_RING + 1,
                   __ATOMIC_RELEASE);
  for (int k = 0; k < 5000 && !failed_count(&ws); k++) usleep(1000);
  pthread_mutex_lock(&ws.mu);
  assert_int_equal(ws.failed, 1);
  assert_non_null(strstr(ws.failed_why, "out of range"));
  pthread_mutex_unlock(&ws.mu);
  TD_ASSERT_STATUS(td__lane_send(sl, &m), TD_ERR_UNAVAILABLE); /* closed */
  /* a consumer scribbling its read position makes the producer's next send fail */
  td__lane_rings(sl, &tx, &rx);
  __atomic_store_n(td__ring_head_word(rx), *td__ring_head_word(rx) + 8, __ATOMIC_RELEASE);
  encode(10, 0, &f);
  td__lane_msg m2 = {.head = f.head, .head_len = f.head_len};
  TD_ASSERT_STATUS(td__lane_send(cl, &m2), TD_ERR_FORMAT);
  td__lane_close(cl);
  td__lane_close(sl);
  td__lane_unref(cl);
  td__lane_unref(sl);
  td__lanes_destroy(cli);
  td__lanes_destroy(srv);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lane_ring_bounds),
      cmocka_unit_test(test_lane_handover_refuses_strangers),
      cmocka_unit_test(test_lane_frames_then_corrupt_ring),
      cmocka_unit_test(test_lane_dial),
      cmocka_unit_test(test_lane_dial_settles_direct_copy),
      cmocka_unit_test(test_lane_mailbox),
      cmocka_unit_test(test_lane_dial_many_by_hints),
      cmocka_unit_test(test_lane_idle_naps_and_lost_hints),
  };
  return cmocka_run_group_tests_name("lane", tests, NULL, NULL);
}
