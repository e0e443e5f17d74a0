/* tcache.c - per-thread caches of small blocks (tcache.h).
 *
 * Each thread has, per size class, a singly linked list of free blocks (the link sits in the
 * block's first word) and its length. A pthread key's destructor frees the lists when the thread
 * exits; the key is set on the thread's first td__tc_free that keeps a block. The main thread's
 * lists stay reachable from its thread-local storage until the process ends.
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

typedef struct tc_lists {
  tc_block *head[NCLASS];
  int len[NCLASS];
  int keyed; /* the key's destructor will run for this thread */
} tc_lists;

static _Thread_local tc_lists tl;
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

/* The key's value is &tl of the exiting thread (still valid while destructors run). A block
 * freed by a destructor that runs after this one sets the key again, and the thread's exit runs
 * this again for it. */
static void tc_destroy(void *arg) {
  tc_lists *l = arg;
  drain_lists(l);
  l->keyed = 0;
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

/* depot_take moves a full list from the depot to this thread's empty list c; false when none. */
static bool depot_take(int c) {
  pthread_once(&tc_once, tc_key_init);
  if (!tc_key_ok) return false;
  pthread_mutex_lock(&depot_mu);
  tc_block *b = depot_len[c] ? depot[c][--depot_len[c]] : NULL;
  pthread_mutex_unlock(&depot_mu);
  if (!b) return false;
  tl.head[c] = b;
  tl.len[c] = TD__TC_KEEP;
  return true;
}

/* depot_give hands this thread's full list c to the depot (or frees it when the depot is full)
 * and leaves the list empty. */
static void depot_give(int c) {
  tc_block *b = tl.head[c];
  tl.head[c] = NULL;
  tl.len[c] = 0;
  pthread_mutex_lock(&depot_mu);
  bool kept = depot_len[c] < DEPOT_MAX;
  if (kept) depot[c][depot_len[c]++] = b;
  pthread_mutex_unlock(&depot_mu);
  if (!kept) free_list(b, c);
}

void *td__tc_calloc(size_t n) {
  int c = class_of(n);
  if (c < 0) return calloc(1, n ? n : 1);
  if (!tl.head[c] && !depot_take(c)) return calloc(1, class_size(c));
  tc_block *b = tl.head[c];
  TC_UNPOISON(b, class_size(c));
  tl.head[c] = b->next;
  tl.len[c]--;
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
  if (!tl.keyed) {
    pthread_once(&tc_once, tc_key_init);
    if (!tc_key_ok || pthread_setspecific(tc_key, &tl) != 0) {
      free(p);
      return;
    }
    tl.keyed = 1;
  }
  if (tl.len[c] >= TD__TC_KEEP) depot_give(c);
  tc_block *b = p;
  b->next = tl.head[c];
  tl.head[c] = b;
  tl.len[c]++;
  TC_POISON(b, class_size(c));
}

int td__tc_cached(size_t n) {
  int c = class_of(n);
  return c < 0 ? 0 : tl.len[c];
}
