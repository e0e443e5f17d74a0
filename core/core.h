/* core.h - internal helpers shared by every tdist source file: checked allocation, abort on a
 * broken invariant, argument checks that set the thread-local error, clocks.
 */
#ifndef TD_CORE_CORE_H
#define TD_CORE_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"
#include "tdist/timeout.h"

/* td__panic aborts the process with file, line and message: only for broken internal
 * invariants, never for caller mistakes. */
#ifdef __cplusplus /* C++ (the CUDA files under tensor/cuda/) has no _Noreturn keyword */
#define TD_NORETURN [[noreturn]]
#else
#define TD_NORETURN _Noreturn
#endif
TD_NORETURN void td__panic(const char *file, int line, const char *fmt, ...) TD_PRINTF(3, 4);
#define TD_PANIC(...) td__panic(__FILE__, __LINE__, __VA_ARGS__)
#define TD_ASSERT(cond)                                        \
  do {                                                         \
    if (!(cond)) TD_PANIC("assertion failed: %s", #cond);      \
  } while (0)

/* TD_CHECK_ARG returns TD_ERR_INVALID with a message from the enclosing function when cond fails. */
#define TD_CHECK_ARG(cond, ...)                                \
  do {                                                         \
    if (!(cond)) return td_set_error(TD_ERR_INVALID, __VA_ARGS__); \
  } while (0)

/* TD_TRY evaluates a td_status expression and returns it from the enclosing function on failure. */
#define TD_TRY(expr)                        \
  do {                                      \
    td_status td__s_ = (expr);              \
    if (td__s_ != TD_OK) return td__s_;     \
  } while (0)

/* td__error_prefix puts "<fmt...>: " in front of this thread's current error message (the
 * message alone when there is none) and returns s, so a caller adds its context to a callee's
 * failure in one line: `return td__error_prefix(st, "rref: cannot fork %s", name);`. The
 * arguments may point into td_last_error(). */
td_status td__error_prefix(td_status s, const char *fmt, ...) TD_PRINTF(2, 3);

/* Allocation helpers: NULL on failure (callers turn it into TD_ERR_NOMEM). */
void *td__malloc(size_t n);
void *td__calloc(size_t count, size_t size);
void *td__realloc(void *p, size_t n);
char *td__strdup(const char *s);
void td__free(void *p);
/* td__strcpy_trunc copies src into dst (n > 0 bytes), cut at n - 1 bytes and NUL-terminated:
 * snprintf(dst, n, "%s", src) without its cost, for the per-call paths. */
void td__strcpy_trunc(char *dst, size_t n, const char *src);

/* Monotonic clock in nanoseconds. */
uint64_t td__now_ns(void);

/* Timeouts (tdist/timeout.h). td__timeout_valid: a duration >= 0 or a named negative value.
 * td__timeout_resolve gives dflt for TD_TIMEOUT_DEFAULT. td__deadline_ns is the monotonic
 * deadline of a resolved timeout starting now (UINT64_MAX for TD_TIMEOUT_INFINITE).
 * td__remaining_ms is what is left of a deadline, rounded up (TD_TIMEOUT_INFINITE for
 * UINT64_MAX, TD_TIMEOUT_ZERO once it passed). */
#define TD__NO_DEADLINE UINT64_MAX
static inline bool td__timeout_valid(td_timeout_ms t) { return t >= TD_TIMEOUT_DEFAULT; }
static inline td_timeout_ms td__timeout_resolve(td_timeout_ms t, td_timeout_ms dflt) {
  return t == TD_TIMEOUT_DEFAULT ? dflt : t;
}
uint64_t td__deadline_ns(td_timeout_ms t);
td_timeout_ms td__remaining_ms(uint64_t deadline_ns);

#endif
