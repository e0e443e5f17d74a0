/* tcache.c - per-thread caches of small blocks (tcache.h).
 *
 * Each thread has, per size class, a singly linked list of free blocks (the link sits in the
 * block's first word) and its length, in a struct made at the thread's first td__tc_free and
 * linked into a global list (so LeakSanitizer reaches every cached block from a global). A
 * pthread key's destructor frees the lists when the thread exits.
 */
#include "tcache.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define TC_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TC_ASAN 1
#endif
#endif
#ifdef TC_ASAN
#include <sanitizer/asan_interface.h>
/* Past the link word only: LeakSanitizer does not follow pointers kept in poisoned memory, and
 * would report every cached block behind the first as leaked. */
#define TC_LINK sizeof(void *)
#define TC_POISON(p, n) ASAN_POISON_MEMORY_REGION((char *)(p) + TC_LINK, (n) - TC_LINK)
#define TC_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((char *)(p) + TC_LINK, (n) - TC_LINK)
#else
#define TC_POISON(p, n) ((void)(p), (void)(n))
#define TC_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define NCLASS 4 /* 64, 128, 256, 512 */

typedef struct tc_block {
  struct tc_block *next;
} tc_block;

/* A thread's lists live on the heap, linked into `all`, so they stay reachable from a global while
 * the thread lives (LeakSanitizer does not see every thread's thread-local storage). */
typedef struct tc_lists {
  tc_block *head[NCLASS];
  int len[NCLASS];
  struct tc_lists *prev, *next; /* on `all`, under depot_mu */
} tc_lists;

static _Thread_local tc_lists *tl; /* NULL until the thread first keeps a block */
static pthread_key_t tc_key;
static pthread_once_t tc_once = PTHREAD_ONCE_INIT;
static int tc_key_ok;

/* The depot: full lists (TD__TC_KEEP blocks each) that threads handed over, per class, so blocks
 * that one thread allocates and another frees (a call's value, future and pending entry often
 * are) come back to the allocating thread in batches: one lock per TD__TC_KEEP blocks. */
#define DEPOT_MAX 8 /* full lists kept per class; more go back to free() */
static pthread_mutex_t depot_mu = PTHREAD_MUTEX_INITIALIZER;
static tc_block *depot[NCLASS][DEPOT_MAX];
static int depot_len[NCLASS];
static tc_lists *all; /* every live thread's lists */

static size_t class_size(int c) { return (size_t)64 << c; }

/* class_of returns the class of n bytes, or -1 above TD__TC_MAX. */
static int class_of(size_t n) {
  if (n <= 64) return 0;
  if (n <= 128) return 1;
  if (n <= 256) return 2;
  if (n <= 512) return 3;
  return -1;
}

static void free_list(tc_block *b, int c);

static void drain_lists(tc_lists *l) {
  for (int c = 0; c < NCLASS; c++) {
    free_list(l->head[c], c);
    l->head[c] = NULL;
    l->len[c] = 0;
  }
}

/* The key's value is the exiting thread's lists. A block freed by a destructor that runs after
 * this one makes new lists and sets the key again, and the thread's exit runs this again. */
static void tc_destroy(void *arg) {
  tc_lists *l = arg;
  drain_lists(l);
  pthread_mutex_lock(&depot_mu);
  if (l->prev) l->prev->next = l->next;
  else all = l->next;
  if (l->next) l->next->prev = l->prev;
  pthread_mutex_unlock(&depot_mu);
  free(l);
  tl = NULL;
}

/* fork(): the child gets the depot unlocked and consistent */
static void depot_lock(void) { pthread_mutex_lock(&depot_mu); }
static void depot_unlock(void) { pthread_mutex_unlock(&depot_mu); }

static void tc_key_init(void) {
  tc_key_ok = pthread_key_create(&tc_key, tc_destroy) == 0 &&
              pthread_atfork(depot_lock, depot_unlock, depot_unlock) == 0;
}

/* free_list frees a list of blocks of class c. */
static void free_list(tc_block *b, int c) {
  while (b) {
    TC_UNPOISON(b, class_size(c));
    tc_block *next = b->next;
    free(b);
    b = next;
  }
}

/* lists_create makes this thread's lists (NULL when out of memory or without a key). */
static tc_lists *lists_create(void) {
  pthread_once(&tc_once, tc_key_init);
  if (!tc_key_ok) return NULL;
  tc_lists *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  if (pthread_setspecific(tc_key, l) != 0) {
    free(l);
    return NULL;
  }
  pthread_mutex_lock(&depot_mu);
  l->next = all;
  if (all) all->prev = l;
  all = l;
  pthread_mutex_unlock(&depot_mu);
  tl = l;
  return l;
}

/* depot_take moves a full list from the depot to l's empty list c; false when none. */
static bool depot_take(tc_lists *l, int c) {
  pthread_mutex_lock(&depot_mu);
  tc_block *b = depot_len[c] ? depot[c][--depot_len[c]] : NULL;
  pthread_mutex_unlock(&depot_mu);
  if (!b) return false;
  l->head[c] = b;
  l->len[c] = TD__TC_KEEP;
  return true;
}

/* depot_give hands this thread's full list c to the depot (or frees it when the depot is full)
 * and leaves the list empty. */
static void depot_give(tc_lists *l, int c) {
  tc_block *b = l->head[c];
  l->head[c] = NULL;
  l->len[c] = 0;
  pthread_mutex_lock(&depot_mu);
  bool kept = depot_len[c] < DEPOT_MAX;
  if (kept) depot[c][depot_len[c]++] = b;
  pthread_mutex_unlock(&depot_mu);
  if (!kept) free_list(b, c);
}

void *td__tc_calloc(size_t n) {
  int c = class_of(n);
  if (c < 0) return calloc(1, n ? n : 1);
  tc_lists *l = tl;
  if (!l || (!l->head[c] && !depot_take(l, c))) return calloc(1, class_size(c));
  tc_block *b = l->head[c];
  TC_UNPOISON(b, class_size(c));
  l->head[c] = b->next;
  l->len[c]--;
  memset(b, 0, n); /* the bytes past n are never read by the owner */
  return b;
}

void td__tc_free(void *p, size_t n) {
  if (!p) return;
  int c = class_of(n);
  if (c < 0) {
    free(p);
    return;
  }
  tc_lists *l = tl;
  if (!l && !(l = lists_create())) {
    free(p);
    return;
  }
  if (l->len[c] >= TD__TC_KEEP) depot_give(l, c);
  tc_block *b = p;
  b->next = l->head[c];
  l->head[c] = b;
  l->len[c]++;
  TC_POISON(b, class_size(c));
}

int td__tc_cached(size_t n) {
  int c = class_of(n);
  return c < 0 || !tl ? 0 : tl->len[c];
}
