/* store.h - the rendezvous key-value store (like PyTorch's TCPStore), served by rank 0 through
 * the transport's unary method /tdist.Store/Op, and its client operations.
 *
 * Keys are strings, values are bytes; `add` treats a value as a decimal int64 counter. Clients
 * wait by polling with exponential backoff (1 ms doubling to 50 ms, or max_backoff_ms), which keeps the server free
 * of parked calls; a poll asks about the abort key in the same request. Used for worker discovery, barriers and graceful shutdown.
 *
 * Deleting a key (td__store_delete, PyTorch's Store.delete_key) makes it absent as if never set:
 * a get finds nothing, an add starts again from 0, a wait that had not yet seen the key goes on
 * waiting until it is set again or its deadline passes (waits poll, so a key set and deleted
 * between two polls is never seen), and td__store_wait_ge on a deleted counter waits for the
 * counter rebuilt from 0 (its poll, an add of 0, recreates the key with "0").
 */
#ifndef TD_RPC_STORE_H
#define TD_RPC_STORE_H

#include "transport.h"

#define TD__STORE_METHOD "/tdist.Store/Op"

typedef struct td__store td__store;

/* Limits of the store (it is reachable by members only, but bounded all the same): a key of at most
 * TD__STORE_MAX_KEY bytes, a value of at most TD__STORE_MAX_VALUE bytes, at most
 * TD__STORE_MAX_KEYS keys and TD__STORE_MAX_BYTES bytes of keys and values in all. */
#define TD__STORE_MAX_KEY 512
#define TD__STORE_MAX_VALUE (4u << 20)
#define TD__STORE_MAX_KEYS 1000000
#define TD__STORE_MAX_BYTES (256ull << 20)
/* One range reply carries at most this many values and, past its first value, this many bytes
 * of them (far below a message's limit). */
#define TD__STORE_RANGE_MAX 4096
#define TD__STORE_RANGE_BYTES (1u << 20)

td_status td__store_create(td__store **out);
/* td__store_destroy answers the waits still parked (td__store_unpark_all), then frees s. */
void td__store_destroy(td__store *s);
/* Serves one serialized StoreRequest (thread-safe). A wait (op 8) is answered at once. */
td_status td__store_handle(td__store *s, const uint8_t *req, size_t len, uint8_t **reply,
                           size_t *reply_len);

/* Parked waits. A wait (op 8: until a counter reaches a target or a key exists, or the abort key
 * named in watch_key is set) that is not over when it arrives is held by the server instead of
 * polled by the client: park(ud) gives a token for the request being served (NULL: it cannot be
 * held; it is answered at once), and answer(token, reply, len) sends its reply later (reply
 * td__malloc'd, taken; NULL when out of memory), once: when a set, add or delete ends it, when
 * its time passes (td__store_expire) or when td__store_unpark_all runs. answer runs with no store
 * lock held, on the thread that ended the wait. A group of N workers waiting at a barrier then
 * costs N requests, answered the moment the last one arrives, instead of N polls per backoff. */
#define TD__STORE_PARK_MAX_MS 2000 /* the longest a wait is held (then answered: not yet) */
#define TD__STORE_MAX_PARKED 8192  /* waits held at once; beyond, answered at once */
typedef struct td__store_parker {
  void *(*park)(void *ud);
  void (*answer)(void *token, uint8_t *reply, size_t len);
  void *ud;
} td__store_parker;
/* td__store_handle_park is td__store_handle with waits parked through pk (*parked true: no reply
 * now, pk->answer gives it later; pk borrowed until then). */
td_status td__store_handle_park(td__store *s, const uint8_t *req, size_t len, uint8_t **reply,
                                size_t *reply_len, const td__store_parker *pk, bool *parked);
/* td__store_expire answers the parked waits whose time passed (the server's tick). */
void td__store_expire(td__store *s, uint64_t now_ns);
/* td__store_unpark_all answers every parked wait now (before the server stops). */
void td__store_unpark_all(td__store *s);
/* td__store_parked: waits parked now (tests). */
size_t td__store_parked(td__store *s);

/* Sets key directly in the server's map (rank 0's own setup). */
td_status td__store_local_set(td__store *s, const char *key, const void *v, size_t n);

/* The server's table (for tests): keys held, slots allocated, bytes of keys and values, the work
 * done moving entries to other slots in all (a growth moves every entry, a delete the few of its
 * probe run), and counts of requests. */
typedef struct td__store_stats {
  size_t keys, slots;
  uint64_t bytes, moves;
  uint64_t requests;     /* served */
  uint64_t gets_found;   /* gets that found their key */
  uint64_t ranges_found; /* range requests that returned values */
  uint64_t ranges_remembered; /* range requests served from a remembered range (store.c) */
  uint64_t wait_checks;  /* parked waits that changes looked at (only those about the key) */
  uint64_t ranges_packed; /* ranges requests answered with the last reply kept packed */
} td__store_stats;
void td__store_stats_get(td__store *s, td__store_stats *out);

typedef struct td__store_client {
  td__transport *tr;
  struct td__auth_client *auth; /* the session with the store (auth.h); NULL: unauthenticated */
  char address[300]; /* host:port of rank 0 */
  /* who serves it, for messages: "worker0 (rank 0)" (NULL: "rank 0"). Calls on other threads
   * (an elastic joiner learnt on the pool) read it while init finishes: set it once with
   * td__store_set_owner, which fills owner_buf and then publishes the pointer. */
  const char *owner;
  char owner_buf[160];
  int64_t call_timeout_ms;
  /* no call outlives it (td__now_ns clock; 0: none): a call gets min(call_timeout_ms, what is
   * left), none at all once it passed. Read and written atomically (td__store_set_deadline). */
  uint64_t deadline_ns;
  /* keep trying to reach a server that is not up yet (rendezvous); read and written atomically
   * (init turns it off while other threads may call) */
  bool wait_for_ready;
  /* the longest sleep between two polls of a wait (0: 50 ms); large groups set it longer, so
   * the polls of N waiting workers stay a bounded load on the server */
  int64_t max_backoff_ms;
  /* how long a wait may be parked at the server (ms; 0: waits poll): op 8 instead of polls */
  int64_t park_ms;
  /* Simulations (store_sim.h): when set, each request goes to unary_fn(unary_ctx, ...) instead
   * of the transport. */
  td_status (*unary_fn)(void *ctx, const uint8_t *req, size_t len, uint8_t **reply,
                        size_t *reply_len);
  void *unary_ctx;
} td__store_client;

/* td__store_set_owner names who serves the store in the client's messages (once: the name is
 * published to other threads' calls). */
void td__store_set_owner(td__store_client *c, const char *name);
/* td__store_set_deadline bounds every later call of c (any thread) by deadline_ns (0: none). */
void td__store_set_deadline(td__store_client *c, uint64_t deadline_ns);

td_status td__store_set(const td__store_client *c, const char *key, const void *v, size_t n);
/* td__store_set_watch sets key and says in the same request whether watch_key exists. */
td_status td__store_set_watch(const td__store_client *c, const char *key, const void *v,
                              size_t n, const char *watch_key, bool *watched);
/* *v is malloc'd (NUL-terminated for convenience) when *found. */
td_status td__store_get(const td__store_client *c, const char *key, uint8_t **v, size_t *n,
                        bool *found);
/* td__store_get2 reads key (as td__store_get) and, in the same request, key2 (NULL: none; *v2
 * as *v, when *found2). */
td_status td__store_get2(const td__store_client *c, const char *key, uint8_t **v, size_t *n,
                         bool *found, const char *key2, uint8_t **v2, bool *found2);
td_status td__store_add(const td__store_client *c, const char *key, int64_t delta, int64_t *out);
/* td__store_publish sets keys[i] to vals[i] (lens[i] bytes), i < n <= TD__STORE_PUBLISH_MAX, and
 * then, when add_key is not NULL, adds delta to its counter (*out, may be NULL: the result), in
 * one request, at once for every other client: a worker's records and its count at a barrier
 * (the rendezvous's "joined") cost one request instead of one each. The server checks the limits
 * of every pair before it sets any. */
#define TD__STORE_PUBLISH_MAX 64
td_status td__store_publish(const td__store_client *c, size_t n, char *const *keys,
                            const void *const *vals, const size_t *lens, const char *add_key,
                            int64_t delta, int64_t *out);
/* td__store_delete removes key; *existed (may be NULL) tells whether it was there. */
td_status td__store_delete(const td__store_client *c, const char *key, bool *existed);
/* td__store_now reads the store server's monotonic clock (ns). */
td_status td__store_now(const td__store_client *c, int64_t *server_ns);
/* td__store_wait_ge waits until the counter at key is >= target or deadline_ns (monotonic)
 * passes (TD_ERR_TIMEOUT). When abort_key is not NULL and becomes set, returns TD_ERR_REMOTE
 * with its value as the message. */
td_status td__store_wait_ge(const td__store_client *c, const char *key, int64_t target,
                            uint64_t deadline_ns, const char *abort_key);
/* td__store_wait_key waits until key exists; *v as for get. */
td_status td__store_wait_key(const td__store_client *c, const char *key, uint64_t deadline_ns,
                             const char *abort_key, uint8_t **v, size_t *n);
/* td__store_poll_ge and td__store_poll_key are td__store_wait_ge and td__store_wait_key whose
 * interval between polls (*backoff_ms: in and out, 0 = from 1 ms) carries over from one call to
 * the next: a wait cut into slices (the rendezvous checks for an interrupt every 250 ms) keeps
 * backing off instead of polling again from 1 ms in every slice (which made each waiting worker
 * of a large group send about 40 requests a second to rank 0). */
td_status td__store_poll_ge(const td__store_client *c, const char *key, int64_t target,
                            uint64_t deadline_ns, const char *abort_key, int64_t *backoff_ms);
td_status td__store_poll_key(const td__store_client *c, const char *key, uint64_t deadline_ns,
                             const char *abort_key, int64_t *backoff_ms, uint8_t **v, size_t *n);
/* td__store_range reads, in one request, the values of prefix+first, prefix+first+1, ... that
 * exist one after another (at most count, and the reply's limits): *got of them, as for
 * td__store_wait_range. */
td_status td__store_range(const td__store_client *c, const char *prefix, int first, int count,
                          uint8_t **vals, size_t *lens, int *got);
/* td__store_ranges is td__store_range for n <= TD__STORE_RANGES_MAX prefixes in one request:
 * got[i] values of prefixes[i] in vals[i][..] / lens[i][..] (each array of count). A prefix
 * after the first may get fewer than exist, or none, when the reply would pass
 * TD__STORE_RANGE_BYTES: ask for the rest with td__store_wait_range. */
#define TD__STORE_RANGES_MAX 8
td_status td__store_ranges(const td__store_client *c, int n, const char *const *prefixes,
                           int first, int count, uint8_t ***vals, size_t **lens, int *got);
/* td__store_wait_range waits until the keys prefix+first .. prefix+(first+count-1) (decimal
 * suffixes) all exist and gives their values: vals[i] malloc'd and NUL-terminated, lens[i] its
 * length (nothing is left allocated on failure). It reads many keys per request (op 7: up to
 * TD__STORE_RANGE_MAX values and TD__STORE_RANGE_BYTES bytes), so reading the records of N
 * workers costs about N / 4096 requests instead of N; a timeout names the first missing key. */
td_status td__store_wait_range(const td__store_client *c, const char *prefix, int first,
                               int count, uint64_t deadline_ns, const char *abort_key,
                               uint8_t **vals, size_t *lens);

#endif
