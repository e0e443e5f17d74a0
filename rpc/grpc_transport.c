/* grpc_transport.c - the gRPC transport's channels, server, poller thread and lifecycle (see
 * grpc_impl.h for the design; streams are in grpc_stream.c, unary calls in grpc_unary.c).
 *
 * Lock order: t->mu, then c->mu. No lock is held while calling the agent's callbacks.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "grpc_impl.h"
#include "../core/samehost.h"
#include "tdist/rpc.h"

/* ---- helpers ---- */

gpr_timespec td__grpc_deadline_ms(int64_t ms) {
  if (ms <= 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
  return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(ms, GPR_TIMESPAN));
}

void td__grpc_tags_inc(td__transport *t) { __atomic_add_fetch(&t->live_tags, 1, __ATOMIC_ACQ_REL); }

void td__grpc_tags_dec(td__transport *t) {
  if (__atomic_sub_fetch(&t->live_tags, 1, __ATOMIC_ACQ_REL) == 0) {
    pthread_mutex_lock(&t->mu);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
  }
}

/* Whether address (host:port) names this host's listen address. */
static bool same_host(const td__transport *t, const char *address) {
  size_t hl = strlen(t->host);
  if (address[0] == '[') /* [v6]:port */
    return strncmp(address + 1, t->host, hl) == 0 && address[1 + hl] == ']';
  return strncmp(address, t->host, hl) == 0 && address[hl] == ':';
}

/* The keepalive interval and timeout (ms) of a connection, and the interval before any stretch:
 * the options, stretched on an oversubscribed host for connections within it (stretch). */
static void keepalive_times(const td__transport *t, bool stretch, int *ka, int *kt, int *ka_base) {
  const td__transport_opts *o = &t->opts;
  *ka = *ka_base = (int)(o->keepalive_ms > 0 ? o->keepalive_ms : 2000);
  /* how long a ping may stay unanswered: longer than the interval, so a live peer that is merely
   * busy (many processes on few cores, sanitizer builds) is not declared dead */
  *kt = (int)(o->keepalive_timeout_ms > 0 ? o->keepalive_timeout_ms : 20000);
  /* ... and on an oversubscribed host, longer with the load: 256 workers on 2 CPUs starved
   * rank 0 past 20 s and its peers declared it dead (a dead peer's connection closes anyway) */
  int load = __atomic_load_n(&t->host_load_x100, __ATOMIC_RELAXED);
  if (o->keepalive_auto && load > 200 && stretch) {
    int64_t s = (int64_t)*kt * load / 200;
    *kt = (int)(s < TD__KEEPALIVE_MAX_MS ? s : TD__KEEPALIVE_MAX_MS);
    if (*ka < *kt / 4) *ka = *kt / 4; /* fewer pings too: they cost the starved host most */
  }
}

static grpc_channel_args *make_args(grpc_arg *buf, int *n, const td__transport *t,
                                    bool server, const char *address) {
  const td__transport_opts *o = &t->opts;
  int k = 0;
  /* everything gRPC buffers for this process's connections, both directions, counts against one
   * quota: beyond it gRPC resets streams instead of growing (an unauthenticated peer announcing
   * a huge message would otherwise make it buffer whatever it sends) */
  buf[k].type = GRPC_ARG_POINTER;
  buf[k].key = (char *)GRPC_ARG_RESOURCE_QUOTA;
  buf[k].value.pointer.p = t->quota;
  buf[k].value.pointer.vtable = grpc_resource_quota_arg_vtable();
  k++;
  /* no gRPC message of ours is longer than CHUNK (tensors stream in pieces): gRPC buffers a
   * message whole before handing it over, so this bounds what a peer can make it hold */
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                        {.integer = (int)(CHUNK + (64u << 10))}};
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                        {.integer = (int)(CHUNK + (64u << 10))}};
  int ka, kt, ka_base;
  keepalive_times(t, server || same_host(t, address), &ka, &kt, &ka_base);
  if (server) {
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, {.integer = 1}};
    /* (of the interval before any stretch: a channel made when the load was known to be lower
     * pings more often, and must not be sent away for it) */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                          {.integer = ka_base / 2 > 0 ? ka_base / 2 : 1}};
    /* a client pinging more often than that (without data) twice is sent away */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PING_STRIKES, {.integer = 2}};
    /* tdist needs one stream per peer pair plus a few concurrent store calls per connection */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS, {.integer = 16}};
    /* a TCP connection must complete its HTTP/2 handshake within the time it has for tdist's
     * own (TD_RPC_HANDSHAKE_TIMEOUT_MS, 20 s): one knob for how long a connection may take to
     * prove itself, which busy machines (64 workers on 2 cores, sanitizers) stretch */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                          {.integer = (int)(o->handshake_timeout_ms > 0 ? o->handshake_timeout_ms
                                                                       : 20000)}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = ka}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = kt}};
  } else {
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = ka}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = kt}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, {.integer = 1}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, {.integer = 0}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, {.integer = 100}};
    /* gRPC reads this one as the least time a connection attempt (TCP + HTTP/2 handshake) may
     * take, not as a backoff: at 100 ms, attempts to a busy peer (64 workers on 2 cores) failed
     * "timed out before receiving SETTINGS frame" and so did the calls. It is the client's half
     * of the handshake knob above (TD_RPC_HANDSHAKE_TIMEOUT_MS, 20 s like gRPC's default): with
     * a fixed 20 s, 64 sanitizer-built workers on 2 cores still lost connection attempts that
     * the servers, given longer, would have finished. */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                          {.integer = (int)(o->handshake_timeout_ms > 0 ? o->handshake_timeout_ms
                                                                       : 20000)}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, {.integer = 1000}};
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_RETRIES, {.integer = 0}};
    /* each peer gets its own TCP connection even when addresses repeat across channels */
    buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, {.integer = 1}};
  }
  if (!server && t->tls) /* peers are verified for the job's name, not their addresses */
    buf[k++] = (grpc_arg){GRPC_ARG_STRING, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                          {.string = (char *)t->tls_name}};
  /* A fixed 16 MiB HTTP/2 stream window instead of BDP probing: with probing the window stayed
   * small and tensor transfers stalled on flow control (1 MiB echoes on loopback went from about
   * 1.5 to 2.3 GB/s, 16-64 MiB ones gained about 10%; small calls did not change). A stream then
   * buffers at most 16 MiB that the poller has not taken yet. */
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_BDP_PROBE, {.integer = 0}};
  buf[k++] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                        {.integer = 16 << 20}};
  *n = k;
  static _Thread_local grpc_channel_args args;
  args.num_args = (size_t)k;
  args.args = buf;
  return &args;
}

grpc_channel *td__grpc_channel_for(td__transport *t, const char *address) {
  pthread_mutex_lock(&t->mu);
  for (int i = 0; i < t->nchans; i++) {
    if (strcmp(t->chans[i].address, address) == 0) {
      grpc_channel *ch = t->chans[i].ch;
      pthread_mutex_unlock(&t->mu);
      return ch;
    }
  }
  if (t->nchans == t->chancap) {
    int nc = t->chancap ? t->chancap * 2 : 8;
    chan_entry *ne = td__realloc(t->chans, (size_t)nc * sizeof *ne);
    if (!ne) {
      pthread_mutex_unlock(&t->mu);
      return NULL;
    }
    t->chans = ne;
    t->chancap = nc;
  }
  grpc_arg argbuf[24];
  int na;
  grpc_channel_args *args = make_args(argbuf, &na, t, false, address);
  grpc_channel_credentials *creds = t->chan_creds ? t->chan_creds
                                                  : grpc_insecure_credentials_create();
  grpc_channel *ch = grpc_channel_create(address, creds, args);
  if (!t->chan_creds) grpc_channel_credentials_release(creds);
  char *addr = td__strdup(address);
  if (!ch || !addr) {
    if (ch) grpc_channel_destroy(ch);
    td__free(addr);
    pthread_mutex_unlock(&t->mu);
    return NULL;
  }
  t->chans[t->nchans++] = (chan_entry){addr, ch};
  pthread_mutex_unlock(&t->mu);
  return ch;
}

/* Why gRPC could not listen on host:port: a plain bind() of the same address says (gRPC's own
 * error is a long tree, logged at DEBUG). */
static void listen_failure(const char *addr, int port, char *why, size_t n) {
  char host[320];
  snprintf(host, sizeof host, "%s", addr);
  char *colon = strrchr(host, ':');
  if (colon) *colon = 0;
  bool v6 = host[0] == '[';
  const char *h = v6 ? host + 1 : host;
  if (v6 && strchr(host, ']')) *strchr(host, ']') = 0;
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  socklen_t len;
  if (v6) {
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)port);
    len = inet_pton(AF_INET6, h, &a6->sin6_addr) == 1 ? sizeof *a6 : 0;
  } else {
    struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)port);
    len = inet_pton(AF_INET, h, &a4->sin_addr) == 1 ? sizeof *a4 : 0;
  }
  int fd = len ? socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
  int one = 1, err = 0;
  if (fd >= 0) {
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, len) != 0) err = errno;
    close(fd);
  }
  if (err == EADDRINUSE) snprintf(why, n, "port %d is in use", port);
  else if (err == EADDRNOTAVAIL) snprintf(why, n, "%.100s is not an address of this machine", h);
  else if (err == EACCES) snprintf(why, n, "port %d needs privileges", port);
  else if (err) snprintf(why, n, "%s", strerror(err));
  else snprintf(why, n, "gRPC refused the address (TD_LOG_LEVEL=debug shows its error)");
}

/* gRPC's own log lines (its internal error trees, 600 characters for a port in use) go to
 * td_log at DEBUG: tdist reports every failure itself, in one line. GRPC_VERBOSITY or GRPC_TRACE
 * in the environment keep gRPC's own logging. */
static void grpc_log_to_td(gpr_log_func_args *args) {
  td_log(TD_LOG_DEBUG, "grpc %s:%d: %s", args->file, args->line, args->message);
}

static void route_grpc_log(void) {
  const char *v = getenv("GRPC_VERBOSITY"), *tr = getenv("GRPC_TRACE");
  if ((v && *v) || (tr && *tr)) return;
  gpr_set_log_function(grpc_log_to_td);
}

/* gRPC's locks are Abseil mutexes. Abseil built without NDEBUG (Debian's packages) checks every
 * lock acquisition for deadlock cycles by keeping a graph of lock order across the process:
 * measured, 6.5% of all CPU in a 128-worker start-up and all-to-all round went to that graph
 * (GraphCycles::GetId, InsertEdge) and a few percent more to its bookkeeping. A library's users
 * do not debug gRPC's lock order, so it is switched off, as an NDEBUG build of Abseil has it, by
 * looking the switch up at run time (an Abseil without it, or with another inline namespace,
 * is left alone). TD_ABSL_DEADLOCK_DETECTION=1 keeps it. */
static void absl_deadlock_detection_off(void) {
  const char *keep = getenv("TD_ABSL_DEADLOCK_DETECTION");
  if (keep && *keep && strcmp(keep, "0") != 0) return;
  static const char *const names[] = {
      "_ZN4absl7debian329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE",
      "_ZN4absl12lts_2022062329SetMutexDeadlockDetectionModeENS0_15OnDeadlockCycleE",
      "_ZN4absl29SetMutexDeadlockDetectionModeENS_15OnDeadlockCycleE",
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    void *sym = dlsym(RTLD_DEFAULT, names[i]);
    if (!sym) continue;
    void (*set_mode)(int) = NULL; /* absl::OnDeadlockCycle is an int enum: kIgnore is 0 */
    memcpy(&set_mode, &sym, sizeof set_mode);
    set_mode(0);
    td_log(TD_LOG_DEBUG, "rpc: Abseil's mutex deadlock detection switched off (%s)", names[i]);
    return;
  }
}

static void grpc_once(void) {
  route_grpc_log();
  absl_deadlock_detection_off();
}

td_status td__grpc_map_status(grpc_status_code c) {
  switch (c) {
    case GRPC_STATUS_OK: return TD_OK;
    case GRPC_STATUS_CANCELLED: return TD_ERR_CANCELLED;
    case GRPC_STATUS_DEADLINE_EXCEEDED: return TD_ERR_TIMEOUT;
    case GRPC_STATUS_INVALID_ARGUMENT: return TD_ERR_FORMAT;
    case GRPC_STATUS_NOT_FOUND:
    case GRPC_STATUS_UNIMPLEMENTED: return TD_ERR_NOT_FOUND;
    case GRPC_STATUS_UNAUTHENTICATED:
    case GRPC_STATUS_PERMISSION_DENIED: return TD_ERR_AUTH;
    default: return TD_ERR_UNAVAILABLE;
  }
}

void td__grpc_free_head(void *p) {
  TSAN_ACQUIRE(p);
  td__free(p);
}

grpc_slice td__grpc_owned_slice(void *data, size_t len, void (*destroy)(void *), void *p) {
  TSAN_RELEASE(p);
  return grpc_slice_new_with_user_data(data, len, destroy, p);
}

/* ---- refused attempts ---- */

void td__grpc_refused(td__transport *t, const char *addr, const char *why) {
  td__refusals *r = &t->refusals;
  char host[64];
  /* "ipv4:1.2.3.4:port" -> "ipv4:1.2.3.4": one entry per host, not per connection */
  snprintf(host, sizeof host, "%s", addr ? addr : "?");
  char *colon = strrchr(host, ':');
  if (colon && colon != strchr(host, ':')) *colon = 0;
  uint64_t now = td__now_ns();
  pthread_mutex_lock(&r->mu);
  r->count++;
  int slot = -1, oldest = 0;
  for (int i = 0; i < TD__REFUSAL_HOSTS; i++) {
    if (strcmp(r->hosts[i].host, host) == 0) {
      slot = i;
      break;
    }
    if (r->hosts[i].logged_ns < r->hosts[oldest].logged_ns) oldest = i;
  }
  bool log = false;
  uint64_t suppressed = 0;
  if (slot < 0) {
    slot = oldest;
    snprintf(r->hosts[slot].host, sizeof r->hosts[slot].host, "%s", host);
    r->hosts[slot].logged_ns = 0;
    r->hosts[slot].suppressed = 0;
  }
  if (!r->hosts[slot].logged_ns || now - r->hosts[slot].logged_ns >= 60000000000ull) {
    log = true;
    suppressed = r->hosts[slot].suppressed;
    r->hosts[slot].logged_ns = now ? now : 1;
    r->hosts[slot].suppressed = 0;
  } else {
    r->hosts[slot].suppressed++;
  }
  pthread_mutex_unlock(&r->mu);
  if (log)
    td_log(TD_LOG_WARN, "rpc: refused a connection from %s: %s%s", host, why,
           suppressed ? " (and earlier refusals from there not logged)" : "");
}

/* ---- abusive connections and memory given back ---- */

/* Parses gRPC's peer string ("ipv4:1.2.3.4:port", "ipv6:[::1]:port", "ipv6:%5B::1%5D:port"). */
static bool peer_sockaddr(const char *peer, struct sockaddr_storage *ss) {
  char h[80];
  const char *p = strncmp(peer, "ipv4:", 5) == 0 || strncmp(peer, "ipv6:", 5) == 0 ? peer + 5 : NULL;
  if (!p) return false;
  size_t k = 0;
  for (; *p && k + 1 < sizeof h; p++) { /* %5B / %5D: brackets */
    if (p[0] == '%' && p[1] == '5' && (p[2] == 'B' || p[2] == 'D')) {
      h[k++] = p[2] == 'B' ? '[' : ']';
      p += 2;
    } else {
      h[k++] = *p;
    }
  }
  h[k] = 0;
  char *colon = strrchr(h, ':');
  if (!colon) return false;
  *colon = 0;
  int port = atoi(colon + 1);
  memset(ss, 0, sizeof *ss);
  if (h[0] == '[') {
    char *end = strchr(h, ']');
    if (!end) return false;
    *end = 0;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)port);
    return inet_pton(AF_INET6, h + 1, &a6->sin6_addr) == 1;
  }
  struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
  a4->sin_family = AF_INET;
  a4->sin_port = htons((uint16_t)port);
  return inet_pton(AF_INET, h, &a4->sin_addr) == 1;
}

/* An IPv4-mapped IPv6 address as the IPv4 address it maps (gRPC listens on dual-stack sockets:
 * a connection from 127.0.0.1 has the remote address ::ffff:127.0.0.1 there). */
static void unmap_v4(struct sockaddr_storage *a) {
  const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)a;
  if (a->ss_family != AF_INET6 || !IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) return;
  struct sockaddr_in a4;
  memset(&a4, 0, sizeof a4);
  a4.sin_family = AF_INET;
  a4.sin_port = a6->sin6_port;
  memcpy(&a4.sin_addr, &a6->sin6_addr.s6_addr[12], 4);
  memset(a, 0, sizeof *a);
  memcpy(a, &a4, sizeof a4);
}

static bool same_addr(struct sockaddr_storage *a, struct sockaddr_storage *b) {
  unmap_v4(a);
  unmap_v4(b);
  if (a->ss_family != b->ss_family) return false;
  if (a->ss_family == AF_INET) {
    const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
    return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
  }
  const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
  return x->sin6_port == y->sin6_port && memcmp(&x->sin6_addr, &y->sin6_addr, 16) == 0;
}

static int sock_port(const struct sockaddr_storage *a) {
  return ntohs(a->ss_family == AF_INET ? ((const struct sockaddr_in *)a)->sin_port
                                       : ((const struct sockaddr_in6 *)a)->sin6_port);
}

/* Shuts down the TCP connection our server accepted from peer. gRPC's C API cannot close one
 * connection, so the socket is found among this process's descriptors (its remote end is peer,
 * its local port our server's) and shut down: gRPC then sees the connection end and tears it
 * down itself (the descriptor stays gRPC's to close). */
static bool close_connection(td__transport *t, const char *peer) {
  struct sockaddr_storage want;
  if (!peer_sockaddr(peer, &want)) return false;
  DIR *dir = opendir("/proc/self/fd");
  if (!dir) return false;
  bool done = false;
  struct dirent *e;
  while (!done && (e = readdir(dir)) != NULL) {
    char *end;
    long fd = strtol(e->d_name, &end, 10);
    if (*end || fd < 0 || fd == dirfd(dir)) continue;
    struct stat st;
    if (fstat((int)fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    struct sockaddr_storage rem, loc;
    socklen_t rl = sizeof rem, ll = sizeof loc;
    if (getpeername((int)fd, (struct sockaddr *)&rem, &rl) != 0 || !same_addr(&rem, &want) ||
        getsockname((int)fd, (struct sockaddr *)&loc, &ll) != 0 || sock_port(&loc) != t->port)
      continue;
    done = shutdown((int)fd, SHUT_RDWR) == 0;
  }
  closedir(dir);
  return done;
}

void td__grpc_abuse_note(td__transport *t, const char *peer) {
  if (!peer || !*peer) return;
  uint64_t now = td__now_ns();
  bool close = false;
  pthread_mutex_lock(&t->mu);
  td__abuse *slot = NULL, *oldest = &t->abuse[0];
  for (int i = 0; i < TD__ABUSE_CONNS && !slot; i++) {
    if (strcmp(t->abuse[i].peer, peer) == 0) slot = &t->abuse[i];
    else if (t->abuse[i].since_ns < oldest->since_ns) oldest = &t->abuse[i];
  }
  if (!slot) {
    slot = oldest;
    snprintf(slot->peer, sizeof slot->peer, "%s", peer);
    slot->since_ns = now;
    slot->count = 0;
  }
  if (now - slot->since_ns > TD__ABUSE_WINDOW_NS) {
    slot->since_ns = now;
    slot->count = 0;
  }
  close = ++slot->count == TD__ABUSE_STREAMS;
  pthread_mutex_unlock(&t->mu);
  if (!close) return;
  char why[160];
  snprintf(why, sizeof why, "%d streams ended without authenticating within %llu s: connection "
           "closed%s", TD__ABUSE_STREAMS, TD__ABUSE_WINDOW_NS / 1000000000ull,
           close_connection(t, peer) ? "" : " (not found)");
  td__grpc_refused(t, peer, why);
}

static void trim_task(void *arg) {
  (void)arg;
  malloc_trim(0);
}

void td__grpc_trim(td__transport *t) { __atomic_store_n(&t->trim_wanted, true, __ATOMIC_RELAXED); }

/* The poller's sweep: a trim asked for runs at most every 5 s (the last one late rather than
 * never), on the bulk thread: trimming a large heap takes milliseconds the poller does not have. */
static void trim_if_due(td__transport *t, uint64_t now) {
  if (!__atomic_load_n(&t->trim_wanted, __ATOMIC_RELAXED) || now - t->trim_ns < 5000000000ull)
    return;
  __atomic_store_n(&t->trim_wanted, false, __ATOMIC_RELAXED);
  t->trim_ns = now;
  td__threadpool_submit(t->bulk, trim_task, NULL);
}

void td__transport_traffic(td__transport *t, int rank, td_rpc_traffic *out) {
  memset(out, 0, sizeof *out);
  for (int r = 0; t->traffic && r < t->opts.world; r++) {
    if (rank >= 0 && r != rank) continue;
    const uint64_t *src = (const uint64_t *)&t->traffic[r];
    uint64_t *dst = (uint64_t *)out;
    for (size_t k = 0; k < sizeof *out / sizeof(uint64_t); k++)
      dst[k] += __atomic_load_n(&src[k], __ATOMIC_RELAXED);
  }
}

uint64_t td__transport_refused(td__transport *t) {
  pthread_mutex_lock(&t->refusals.mu);
  uint64_t n = t->refusals.count;
  pthread_mutex_unlock(&t->refusals.mu);
  return n;
}

/* ---- the poller ---- */

static void post_slot(td__transport *t, req_slot *s) {
  grpc_call_details_init(&s->details);
  grpc_metadata_array_init(&s->md);
  s->call = NULL;
  td__grpc_tags_inc(t);
  TSAN_RELEASE(&s->t);
  if (grpc_server_request_call(t->server, &s->call, &s->details, &s->md, t->cq, t->cq, &s->t) !=
      GRPC_CALL_OK) {
    td__grpc_tags_dec(t);
    grpc_call_details_destroy(&s->details);
    grpc_metadata_array_destroy(&s->md);
  }
}

static void handle_new_call(td__transport *t, req_slot *s, bool success) {
  if (success && s->call) {
    char *method = grpc_slice_to_c_string(s->details.method);
    if (strcmp(method, STREAM_METHOD) == 0) td__grpc_stream_accept(t, s->call);
    else td__grpc_unary_accept(t, s->call, method);
    gpr_free(method);
  }
  grpc_call_details_destroy(&s->details);
  grpc_metadata_array_destroy(&s->md);
  pthread_mutex_lock(&t->mu);
  bool down = t->shutting_down;
  pthread_mutex_unlock(&t->mu);
  if (success && !down) post_slot(t, s);
}

static void dispatch(td__transport *t, tag *tg, bool success) {
  switch (tg->kind) {
    case TAG_NEW_CALL: handle_new_call(t, (req_slot *)tg, success); return;
    case TAG_CONN_START:
    case TAG_CONN_RECV:
    case TAG_CONN_SEND:
    case TAG_CONN_STATUS:
    case TAG_CONN_FINISH: td__grpc_stream_event(tg, success); return;
    case TAG_UNARY_RECV:
    case TAG_UNARY_DONE: td__grpc_unary_event(tg, success); return;
    case TAG_SERVER_SHUTDOWN:
      pthread_mutex_lock(&t->mu);
      t->server_down = true;
      pthread_cond_broadcast(&t->cv);
      pthread_mutex_unlock(&t->mu);
      return;
  }
}

static void *poller_main(void *arg) {
  td__transport *t = arg;
  int tick = __atomic_load_n(&t->tick_ms, __ATOMIC_RELAXED);
  uint64_t next_tick = td__now_ns() + (uint64_t)tick * 1000000ull;
  uint64_t last_event = 0;
  for (;;) {
    tick = __atomic_load_n(&t->tick_ms, __ATOMIC_RELAXED);
    /* Busy polling: for a short window after an event, poll without blocking, so a reply or the
     * next request that follows closely is picked up by a running thread instead of waking a
     * sleeping one (on virtual machines an idle vCPU's wake-up costs tens of microseconds). */
    uint64_t spin = (uint64_t)__atomic_load_n(&t->busy_poll_ns, __ATOMIC_RELAXED);
    grpc_event ev;
    if (spin && td__now_ns() - last_event < spin) {
      ev = grpc_completion_queue_next(t->cq, gpr_inf_past(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.type == GRPC_QUEUE_TIMEOUT) {
        __atomic_store_n(&t->idle_ns, td__now_ns(), __ATOMIC_RELAXED);
        sched_yield(); /* a runnable thread on this CPU goes first */
        continue;
      }
    } else {
      ev = grpc_completion_queue_next(t->cq, td__grpc_deadline_ms(tick), NULL);
      if (ev.type == GRPC_QUEUE_TIMEOUT) __atomic_store_n(&t->idle_ns, td__now_ns(), __ATOMIC_RELAXED);
    }
    if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    if (ev.type == GRPC_OP_COMPLETE) {
      TSAN_ACQUIRE(ev.tag);
      last_event = td__now_ns();
      dispatch(t, ev.tag, ev.success != 0);
      td__grpc_tags_dec(t);
    }
    uint64_t now = td__now_ns();
    if (now >= next_tick) {
      next_tick = now + (uint64_t)tick * 1000000ull;
      if (t->cbs.on_tick) t->cbs.on_tick(t->cbs.ud);
      td__grpc_retry_due(t, now);
      if (now >= t->next_sweep_ns) {
        t->next_sweep_ns = now + 1000000000ull;
        td__grpc_sweep(t, now);
        td__lanes_sweep(t->lanes);
        trim_if_due(t, now);
      }
    }
  }
  return NULL;
}


/* ---- configuration set at init ---- */

static td_status publish_once(void **slot, void *p) {
  void *none = NULL;
  if (!__atomic_compare_exchange_n(slot, &none, p, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    td__free(p);
    return td_set_error(TD_ERR_STATE, "rpc transport: direct copy is already configured");
  }
  return TD_OK;
}

td_status td__transport_allow_direct(td__transport *t, const int *pid_of, int world) {
  direct_from *d = td__malloc(sizeof *d + (size_t)(world > 0 ? world : 1) * sizeof(int));
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  d->world = world;
  if (world > 0) memcpy(d->pid_of, pid_of, (size_t)world * sizeof(int));
  return publish_once((void **)&t->direct_from, d);
}

td_status td__transport_direct_to(td__transport *t, const bool *to, int world) {
  direct_to *d = td__malloc(sizeof *d + (size_t)(world > 0 ? world : 1) * sizeof(bool));
  if (!d) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  d->world = world;
  if (world > 0) memcpy(d->to, to, (size_t)world * sizeof(bool));
  int n = 0;
  for (int r = 0; r < world; r++) n += to[r];
  TD_TRY(publish_once((void **)&t->direct_to, d));
  __atomic_store_n(&t->direct_readers, n, __ATOMIC_RELAXED);
  return TD_OK;
}

td_status td__transport_direct_lazily(td__transport *t, const int *pid_of, const uint64_t *addr_of,
                                      const uint64_t *nonce_of, int world) {
  direct_lazy *z = td__calloc(1, sizeof *z + (size_t)(world > 0 ? world : 1) * sizeof z->rec[0]);
  int *none = td__calloc((size_t)(world > 0 ? world : 1), sizeof *none);
  bool *no = td__calloc((size_t)(world > 0 ? world : 1), sizeof *no);
  if (!z || !none || !no) {
    td__free(z);
    td__free(none);
    td__free(no);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  }
  z->world = world;
  for (int r = 0; r < world; r++) {
    z->rec[r].pid = pid_of[r];
    z->rec[r].addr = addr_of[r];
    z->rec[r].nonce = nonce_of[r];
  }
  td_status st = td__transport_allow_direct(t, none, world);
  if (st == TD_OK) st = td__transport_direct_to(t, no, world);
  if (st == TD_OK) st = publish_once((void **)&t->direct_lazy, z);
  else td__free(z);
  td__free(none);
  td__free(no);
  return st;
}

bool td__transport_dialing(td__transport *t) { return td__lanes_dialing(t->lanes); }

int td__transport_direct_readers(td__transport *t) {
  return t ? __atomic_load_n(&t->direct_readers, __ATOMIC_RELAXED) : 0;
}

/* A dialled lane's handshake or a mailbox lane's making (lane.h, probe): whether we read rank's
 * memory (proven: the mailbox showed it); when we do, its direct-copy frames are accepted from now
 * on (the pid is the one its record named, which the lane's socket or the arena's nonce was
 * checked against). */
static bool lane_probe(void *tp, int rank, bool proven) {
  td__transport *t = tp;
  direct_lazy *z = __atomic_load_n(&t->direct_lazy, __ATOMIC_ACQUIRE);
  direct_from *d = __atomic_load_n(&t->direct_from, __ATOMIC_ACQUIRE);
  if (!z || !d || rank < 0 || rank >= z->world || rank >= d->world || z->rec[rank].pid <= 0)
    return false;
  td__host_rec h = {.pid = z->rec[rank].pid, .addr = z->rec[rank].addr,
                    .nonce = z->rec[rank].nonce};
  if (!proven && !td__samehost_readable(&h)) return false;
  __atomic_store_n(&d->pid_of[rank], h.pid, __ATOMIC_RELEASE);
  return true;
}

/* ... and the peer says it reads ours: direct-copy frames may go to it. */
static void lane_peer_reads(void *tp, int rank) {
  td__transport *t = tp;
  direct_to *d = __atomic_load_n(&t->direct_to, __ATOMIC_ACQUIRE);
  if (!__atomic_load_n(&t->direct_lazy, __ATOMIC_ACQUIRE) || !d || rank < 0 || rank >= d->world)
    return;
  if (!__atomic_exchange_n(&d->to[rank], true, __ATOMIC_ACQ_REL))
    __atomic_add_fetch(&t->direct_readers, 1, __ATOMIC_RELAXED);
}

void td__transport_set_self_rank(td__transport *t, int rank) {
  __atomic_store_n(&t->opts.self_rank, rank, __ATOMIC_RELEASE);
}

td_status td__transport_set_world(td__transport *t, int world) {
  if (world == t->opts.world) return TD_OK;
  void *traffic = td__calloc((size_t)world, sizeof *t->traffic);
  void *held = td__calloc((size_t)world, sizeof *t->held);
  if (!traffic || !held) {
    td__free(traffic);
    td__free(held);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  }
  td__free(t->traffic); /* (no stream to a member yet: nothing counts in them) */
  td__free(t->held);
  t->traffic = traffic;
  t->held = held;
  t->opts.world = world;
  return TD_OK;
}

void td__transport_set_busy_poll(td__transport *t, int64_t us) {
  __atomic_store_n(&t->busy_poll_ns, us > 0 ? us * 1000 : 0, __ATOMIC_RELAXED);
  td__lanes_set_spin(t->lanes, us > 0 ? us * 1000 : 0);
}

void td__transport_test_refuse_hellos(td__transport *t, int n) {
  __atomic_store_n(&t->refuse_hellos, n, __ATOMIC_RELAXED);
}

void td__transport_set_host_load(td__transport *t, int load_x100) {
  __atomic_store_n(&t->host_load_x100, load_x100, __ATOMIC_RELAXED);
  /* every worker's poller wakes each tick (deadlines of calls): 256 of them on 2 CPUs made 25,600
   * wake-ups a second for nothing; on a host with more than twice as many workers as CPUs the
   * tick grows with the load, up to 100 ms (calls then time out that much late at most) */
  int base = t->opts.tick_ms > 0 ? t->opts.tick_ms : 10;
  int tick = load_x100 > 200 ? (int)((int64_t)base * load_x100 / 200) : base;
  __atomic_store_n(&t->tick_ms, tick > 100 && base <= 100 ? 100 : tick, __ATOMIC_RELAXED);
}

td_status td__transport_allow_lane(td__transport *t, const int *pid_of, const uint64_t *nonce_of,
                                   uint64_t self_nonce, const int *mb_bell_of,
                                   const int *mb_arena_of, int world) {
  int local = 0;
  for (int r = 0; r < world; r++) local += r != t->opts.self_rank && pid_of[r] > 0;
  __atomic_store_n(&t->lane_lazy, local > TD__LANE_MAX, __ATOMIC_RELAXED);
  if (!t->lanes) return TD_OK;
  TD_TRY(td__lanes_set_pids(t->lanes, pid_of, world));
  /* dialled lanes: not under TLS without a job secret (the TLS certificate would then be the
   * only proof of membership, and the dial socket has none) */
  if (!nonce_of || (t->tls && !(t->opts.auth && t->opts.auth->secure))) return TD_OK;
  /* the keepalive of a channel to this host */
  int ka, kt, ka_base;
  keepalive_times(t, true, &ka, &kt, &ka_base);
  if (td__lanes_listen_dial(t->lanes, t->opts.self_rank, t->opts.auth, self_nonce, nonce_of, world,
                            t->opts.handshake_timeout_ms, ka, kt) != TD_OK)
    td_log(TD_LOG_DEBUG, "rpc transport: no dialled lanes: %s", td_last_error());
  else if (mb_bell_of && mb_arena_of)
    return td__lanes_set_mbox(t->lanes, mb_bell_of, mb_arena_of, world);
  return TD_OK;
}

td_status td__transport_mbox_open(td__transport *t, int world, uint64_t nonce, int *bell_fd,
                                  int *arena_fd) {
  *bell_fd = *arena_fd = -1;
  if (!t->lanes) return td_set_error(TD_ERR_UNAVAILABLE, "rpc transport: no same-host lanes");
  return td__lanes_mbox_open(t->lanes, world, nonce, bell_fd, arena_fd);
}

int td__transport_lanes_mbox(td__transport *t) { return td__lanes_mboxes(t->lanes); }

int td__transport_lanes_dialed(td__transport *t) { return td__lanes_dialed(t->lanes); }

int td__transport_lanes_up(td__transport *t) { return td__lanes_up(t->lanes); }

static void lane_refused(void *ud, const char *why) { td__grpc_refused(ud, "unix:lane", why); }

static void lane_burst(void *ud, bool end) {
  td__transport *t = ud;
  if (t->cbs.on_burst) t->cbs.on_burst(t->cbs.ud, end);
}

/* ---- lifecycle ---- */

td_status td__transport_create(const td__transport_opts *o, const td__transport_cbs *cbs,
                               td__transport **out, int *bound_port) {
  td__transport *t = td__calloc(1, sizeof *t);
  if (!t) return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  t->opts = *o;
  t->host = td__strdup(o->host ? o->host : "127.0.0.1");
  t->opts.host = t->host;
  t->cbs = *cbs;
  t->self_pid = (int)getpid();
  if (!t->opts.lane_direct_min) t->opts.lane_direct_min = TD__LANE_DIRECT_MIN_BYTES;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  pthread_mutex_init(&t->refusals.mu, NULL);
  td__auth_init(&t->insecure, NULL, 0);
  t->traffic = td__calloc((size_t)(o->world > 0 ? o->world : 1), sizeof *t->traffic);
  t->held = td__calloc((size_t)(o->world > 0 ? o->world : 1), sizeof *t->held);
  t->held_max = o->member_held_max ? o->member_held_max
                : o->max_message ? o->max_message + (256ull << 20) : 0;
  if (!t->traffic || !t->held) {
    td__free(t->traffic);
    td__free(t->held);
    td__free(t->host);
    td__free(t);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: out of memory");
  }
  static pthread_once_t grpc_once_ctl = PTHREAD_ONCE_INIT;
  pthread_once(&grpc_once_ctl, grpc_once);
  grpc_init();
  t->cq = grpc_completion_queue_create_for_next(NULL);
  grpc_arg argbuf[24];
  int na;
  if (o->tls) {
    t->tls = true;
    snprintf(t->tls_name, sizeof t->tls_name, "%s", o->tls->name ? o->tls->name : "tdist");
    grpc_ssl_pem_key_cert_pair kc = {o->tls->key_pem, o->tls->cert_pem};
    t->chan_creds = grpc_ssl_credentials_create(o->tls->ca_pem, &kc, NULL, NULL);
  }
  if (td__threadpool_create(1, "td-bulk", &t->bulk) != TD_OK) {
    td__free(t->traffic);
    td__free(t->held);
    td__free(t->host);
    td__free(t);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: cannot start the bulk-copy thread");
  }
  t->quota = grpc_resource_quota_create("tdist");
  grpc_resource_quota_resize(t->quota, (size_t)(o->memory_quota ? o->memory_quota : (1ull << 30)));
  td__transport_set_host_load(t, o->host_load_x100); /* the estimate, until the group is known */
  grpc_channel_args *args = make_args(argbuf, &na, t, true, NULL);
  t->server = grpc_server_create(args, NULL);
  grpc_server_register_completion_queue(t->server, t->cq, NULL);
  char addr[300];
  bool v6 = strchr(t->host, ':') != NULL;
  snprintf(addr, sizeof addr, v6 ? "[%s]:%d" : "%s:%d", t->host, o->port);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  if (t->tls) {
    /* mutual TLS: a client must present a certificate of the job's CA */
    grpc_server_credentials_release(creds);
    grpc_ssl_pem_key_cert_pair kc = {o->tls->key_pem, o->tls->cert_pem};
    creds = grpc_ssl_server_credentials_create_ex(
        o->tls->ca_pem, &kc, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
  }
  int port = creds ? grpc_server_add_http2_port(t->server, addr, creds) : 0;
  if (creds) grpc_server_credentials_release(creds);
  if (port == 0) {
    grpc_server_destroy(t->server);
    grpc_completion_queue_shutdown(t->cq);
    while (grpc_completion_queue_next(t->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(t->cq);
    grpc_resource_quota_unref(t->quota);
    if (t->chan_creds) grpc_channel_credentials_release(t->chan_creds);
    td__threadpool_destroy(t->bulk);
    grpc_shutdown();
    td__free(t->host);
    td__free(t->traffic);
    td__free(t->held);
    pthread_mutex_destroy(&t->refusals.mu);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    td__free(t);
    char why[200];
    listen_failure(addr, o->port, why, sizeof why);
    return td_set_error(TD_ERR_UNAVAILABLE, "rpc: cannot listen on %s: %s%s", addr, why,
                        o->tls ? " (or the TLS certificate or key is not valid PEM)" : "");
  }
  grpc_server_start(t->server);
  t->t_server_shutdown = (tag){TAG_SERVER_SHUTDOWN, t};
  for (int i = 0; i < N_REQUEST_SLOTS; i++) {
    t->slots[i].t = (tag){TAG_NEW_CALL, &t->slots[i]};
    post_slot(t, &t->slots[i]);
  }
  if (o->lane) {
    td__lanes_opts lo = {lane_refused, td__grpc_lane_failed, td__grpc_lane_release,
                         td__grpc_lane_offload, t, lane_burst, td__grpc_lane_dialed,
                         td__grpc_lane_ended, lane_probe, lane_peer_reads};
    if (td__lanes_create(&lo, &t->lanes) != TD_OK) {
      td_log(TD_LOG_DEBUG, "rpc transport: no same-host lanes: %s", td_last_error());
      t->lanes = NULL;
    }
  }
  if (pthread_create(&t->poller, NULL, poller_main, t) != 0) {
    t->poller_started = false;
    td__transport_shutdown(t);
    td__transport_destroy(t);
    return td_set_error(TD_ERR_NOMEM, "rpc transport: cannot start the poller thread");
  }
  pthread_setname_np(t->poller, "td-poller");
  t->poller_started = true;
  t->port = port;
  *bound_port = port;
  *out = t;
  return TD_OK;
}

void td__transport_shutdown(td__transport *t) {
  if (!t) return;
  pthread_mutex_lock(&t->mu);
  if (t->shutting_down) {
    pthread_mutex_unlock(&t->mu);
    return;
  }
  t->shutting_down = true;
  pthread_mutex_unlock(&t->mu);
  td__grpc_tags_inc(t);
  TSAN_RELEASE(&t->t_server_shutdown);
  grpc_server_shutdown_and_notify(t->server, t->cq, &t->t_server_shutdown);
  grpc_server_cancel_all_calls(t->server);
  td__grpc_unary_answer_all(t); /* held unary calls (parked store waits) end now */
  /* close every stream we know of */
  pthread_mutex_lock(&t->mu);
  size_t n = 0;
  for (td__conn *c = t->live; c; c = c->next_live) n++;
  td__conn **list = td__calloc(n ? n : 1, sizeof *list);
  size_t k = 0;
  for (td__conn *c = t->live; c && list; c = c->next_live) list[k++] = td__conn_ref(c);
  pthread_mutex_unlock(&t->mu);
  for (size_t i = 0; i < k; i++) {
    pthread_mutex_lock(&list[i]->mu);
    if (list[i]->direct && list[i]->lane)
      td__lane_close_why(list[i]->lane, "this worker is shutting down");
    td__grpc_conn_mark_closed(list[i]);
    if (list[i]->call) grpc_call_cancel(list[i]->call, NULL);
    pthread_mutex_unlock(&list[i]->mu);
    td__conn_unref(list[i]);
  }
  td__free(list);
  /* the lane thread stops delivering (every lane's stream is closed now) */
  td__lanes_stop(t->lanes);
  /* copies already handed to the bulk thread finish (their streams are closed: nothing new
   * starts) */
  td__threadpool_shutdown(t->bulk);
  if (t->poller_started) {
    uint64_t give_up = td__now_ns() + 10ull * 1000000000ull;
    pthread_mutex_lock(&t->mu);
    while (__atomic_load_n(&t->live_tags, __ATOMIC_ACQUIRE) > 0 && td__now_ns() < give_up) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += 20 * 1000000;
      if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
      }
      pthread_cond_timedwait(&t->cv, &t->mu, &ts);
    }
    pthread_mutex_unlock(&t->mu);
    if (__atomic_load_n(&t->live_tags, __ATOMIC_ACQUIRE) > 0)
      td_log(TD_LOG_WARN, "rpc transport: %lld gRPC operations still pending at shutdown",
             (long long)t->live_tags);
  }
  /* client streams waiting to retry a refused handshake have no call whose status would report
   * their end: reported now (on_closed runs for them too) */
  while (td__grpc_retry_due(t, UINT64_MAX) > 0) {
  }
}

void td__transport_stop(td__transport *t) {
  if (!t) return;
  td__transport_shutdown(t);
  grpc_completion_queue_shutdown(t->cq);
  if (t->poller_started) pthread_join(t->poller, NULL);
  t->poller_started = false;
  if (td__threadpool_destroy(t->bulk)) t->bulk = NULL;
}

void td__transport_destroy(td__transport *t) {
  if (!t) return;
  td__transport_shutdown(t);
  grpc_completion_queue_shutdown(t->cq);
  if (t->poller_started) pthread_join(t->poller, NULL);
  td__threadpool_destroy(t->bulk);
  t->bulk = NULL;
  if (!t->poller_started)
    while (grpc_completion_queue_next(t->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
  while (t->live) {
    td__conn *c = t->live;
    t->live = c->next_live;
    c->in_live = false;
    td__conn_unref(c);
  }
  grpc_server_destroy(t->server);
  for (int i = 0; i < t->nchans; i++) {
    grpc_channel_destroy(t->chans[i].ch);
    td__free(t->chans[i].address);
  }
  td__free(t->chans);
  grpc_completion_queue_destroy(t->cq);
  grpc_resource_quota_unref(t->quota);
  if (t->chan_creds) grpc_channel_credentials_release(t->chan_creds);
  grpc_shutdown();
  td__free(t->host);
  td__free(t->direct_from);
  td__free(t->direct_to);
  td__free(t->direct_lazy);
  td__free(t->rev_idx);
  td__free(t->rev_cnt);
  td__lanes_destroy(t->lanes);
  pthread_mutex_destroy(&t->refusals.mu);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  td__free(t->traffic);
  td__free(t->held);
  td__free(t);
}
