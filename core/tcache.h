/* tcache.h - per-thread caches of small fixed-size blocks for the per-call objects (values,
 * futures, pending calls), so a call's allocations skip malloc's general path (internal).
 *
 * td__tc_calloc(n) returns n zeroed bytes, like td__calloc(1, n); td__tc_free(p, n) gives them
 * back and must be passed the same n. Blocks of up to TD__TC_MAX bytes come from a list of the
 * calling thread's (one per size class: 64, 128, 256 and 512 bytes), refilled by the blocks that
 * thread frees, at most TD__TC_KEEP per class. A block may be freed by another thread than the one
 * that allocated it: it then joins the freeing thread's list. A thread whose list is full hands
 * the whole list to a process-wide depot (a mutex, a few full lists per class; beyond them the
 * blocks go back to free()), and a thread whose list is empty takes a full one from there before
 * it calls calloc: blocks that flow from one thread to another come back in batches, one lock per
 * TD__TC_KEEP blocks. A thread's own lists are freed when it exits. Bigger blocks go to
 * calloc/free directly.
 *
 * Under AddressSanitizer a cached block is poisoned until it is handed out again (all but its
 * first word, which links the list), so a use after td__tc_free is still reported. THREAD SAFETY: any thread; the lists are the thread's own.
 */
#ifndef TD_CORE_TCACHE_H
#define TD_CORE_TCACHE_H

#include <stddef.h>

#define TD__TC_MAX 512
#define TD__TC_KEEP 64

void *td__tc_calloc(size_t n);
void td__tc_free(void *p, size_t n);

/* td__tc_cached(n) counts the blocks this thread holds for size n (tests). */
int td__tc_cached(size_t n);

#endif
