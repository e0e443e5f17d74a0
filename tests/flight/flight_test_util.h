/* flight_test_util.h - what the flight recorder's tests share: a fresh directory for dumps under
 * $TMPDIR, and its removal with whatever the test left in it. */
#ifndef TD_FLIGHT_TEST_UTIL_H
#define TD_FLIGHT_TEST_UTIL_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Creates a new directory named after prefix in $TMPDIR (or /tmp) into dir; 0 or -1. */
static inline int flight_test_mkdir(char *dir, size_t n, const char *prefix) {
  const char *t = getenv("TMPDIR");
  snprintf(dir, n, "%s/%s-XXXXXX", t && *t ? t : "/tmp", prefix);
  return mkdtemp(dir) ? 0 : -1;
}

/* Removes dir and the files in it (dumps, progress files: no subdirectories). */
static inline void flight_test_rmdir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    char p[600];
    if (e->d_name[0] == '.' && (!e->d_name[1] || e->d_name[1] == '.')) continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    unlink(p);
  }
  if (d) closedir(d);
  rmdir(dir);
}

#endif
