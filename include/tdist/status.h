/* status.h - status codes, error text and logging shared by every tdist module.
 *
 * Every call that can fail returns a td_status (TD_OK == 0). A synchronous failure also leaves a
 * thread-local message with the detail, read with td_last_error(). One X-macro table,
 * TD_STATUS_MAP, gives each code its name and its generic message.
 */
#ifndef TDIST_STATUS_H
#define TDIST_STATUS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(TD_BUILDING_LIBRARY) && defined(__GNUC__)
#define TD_API __attribute__((visibility("default")))
#else
#define TD_API
#endif

#if defined(__GNUC__)
#define TD_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define TD_PRINTF(fmt, args)
#endif

/* X(name, value, message) */
#define TD_STATUS_MAP(X)                                                                        \
  X(OK, 0, "success")                                                                           \
  X(ERR_INVALID, 1, "invalid argument")                                                         \
  X(ERR_STATE, 2, "operation not allowed in the current state")                                 \
  X(ERR_NOMEM, 3, "out of memory")                                                              \
  X(ERR_SHAPE, 4, "shape mismatch")                                                             \
  X(ERR_DTYPE, 5, "unsupported or mismatched dtype")                                            \
  X(ERR_DEVICE, 6, "unsupported or mismatched device")                                          \
  X(ERR_IO, 7, "input/output error")                                                            \
  X(ERR_FORMAT, 8, "malformed data")                                                            \
  X(ERR_TIMEOUT, 9, "timed out")                                                                \
  X(ERR_NOT_FOUND, 10, "not found")                                                             \
  X(ERR_EXISTS, 11, "already exists")                                                           \
  X(ERR_REMOTE, 12, "remote failure")                                                           \
  X(ERR_CANCELLED, 13, "cancelled")                                                             \
  X(ERR_UNAVAILABLE, 14, "peer unavailable")                                                    \
  X(ERR_UNSUPPORTED, 15, "not supported in this build")                                         \
  X(ERR_INTERNAL, 16, "internal error")                                                         \
  X(ERR_AUTH, 17, "authentication failed")

typedef enum td_status {
#define TD_STATUS_ENUM_(name, value, msg) TD_##name = value,
  TD_STATUS_MAP(TD_STATUS_ENUM_)
#undef TD_STATUS_ENUM_
} td_status;

/* td_status_str returns the generic message of a status code ("shape mismatch"). Never NULL;
 * unknown codes give "unknown status". Static storage. THREAD SAFETY: any thread. */
TD_API const char *td_status_str(td_status s);

/* td_status_name returns the code's name ("TD_ERR_SHAPE"). Never NULL. Static storage. */
TD_API const char *td_status_name(td_status s);

/* td_last_error returns the detailed message of the last failure on this thread, or "" when the
 * last call succeeded without setting one. Borrowed; valid until the next tdist call on this
 * thread. THREAD SAFETY: thread-local. */
TD_API const char *td_last_error(void);

/* td_set_error records a detailed message for status s on this thread and returns s, so a caller
 * can write `return td_set_error(TD_ERR_SHAPE, "matmul: %lld vs %lld", a, b);`. Also used by
 * user-registered functions to report failures. */
TD_API td_status td_set_error(td_status s, const char *fmt, ...) TD_PRINTF(2, 3);

/* td_clear_error empties this thread's message. */
TD_API void td_clear_error(void);

typedef enum td_log_level {
  TD_LOG_TRACE = 0,
  TD_LOG_DEBUG = 1,
  TD_LOG_INFO = 2,
  TD_LOG_WARN = 3,
  TD_LOG_ERROR = 4,
  TD_LOG_OFF = 5,
} td_log_level;

/* td_log writes one line to standard error when level >= the current level. The initial level
 * comes from the TD_LOG_LEVEL environment variable (trace, debug, info, warn, error, off, or a
 * digit), default warn. THREAD SAFETY: any thread; lines are not interleaved. */
TD_API void td_log(td_log_level level, const char *fmt, ...) TD_PRINTF(2, 3);

/* td_log_fn receives one log line (without the "[tdist L hh:mm:ss.mmm] " prefix and without a
 * newline). It runs on the thread that logs, one line at a time (a lock is held: it must not call
 * td_log or td_log_set_handler). */
typedef void (*td_log_fn)(td_log_level level, const char *message, void *user_data);

/* td_log_set_handler sends every line that passes the level to fn instead of standard error
 * (NULL: standard error again). For embedding runtimes (a Python binding forwards lines to the
 * logging module). THREAD SAFETY: any thread. */
TD_API void td_log_set_handler(td_log_fn fn, void *user_data);

/* td_log_set_level changes the level for the whole process. */
TD_API void td_log_set_level(td_log_level level);

/* td_log_get_level returns the current level. */
TD_API td_log_level td_log_get_level(void);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_STATUS_H */
