/* core.c - allocation wrappers, panic, clocks and the library's version. */
#include "core.h"
#include "tdist/version.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void td__panic(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "tdist: fatal internal error at %s:%d: ", file, line);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  abort();
}

void *td__malloc(size_t n) { return malloc(n ? n : 1); }
void *td__calloc(size_t count, size_t size) { return calloc(count ? count : 1, size ? size : 1); }
void *td__realloc(void *p, size_t n) { return realloc(p, n ? n : 1); }
void td__free(void *p) { free(p); }

char *td__strdup(const char *s) {
  if (!s) return NULL;
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

void td__strcpy_trunc(char *dst, size_t n, const char *src) {
  size_t k = strnlen(src, n - 1);
  memcpy(dst, src, k);
  dst[k] = 0;
}

uint64_t td__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t td__deadline_ns(td_timeout_ms t) {
  if (t < 0) return TD__NO_DEADLINE;
  uint64_t now = td__now_ns(), span = (uint64_t)t * 1000000ull;
  if ((uint64_t)t > UINT64_MAX / 2000000ull || now > TD__NO_DEADLINE - span) return TD__NO_DEADLINE;
  return now + span;
}

td_timeout_ms td__remaining_ms(uint64_t deadline_ns) {
  if (deadline_ns == TD__NO_DEADLINE) return TD_TIMEOUT_INFINITE;
  uint64_t now = td__now_ns();
  if (now >= deadline_ns) return TD_TIMEOUT_ZERO;
  return (td_timeout_ms)((deadline_ns - now + 999999ull) / 1000000ull);
}

unsigned td_version(void) { return TD_VERSION_HEX; }
const char *td_version_string(void) { return TD_VERSION_STRING; }
