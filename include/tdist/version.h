/* version.h - tdist's version: the macros a program was compiled with, and the version of the
 * library it runs with.
 *
 * Semantic versioning. While the major version is 0 every minor version may change the ABI, so
 * the shared library's soname carries major.minor (libtdist.so.0.1); from 1.0 on it carries the
 * major version only (libtdist.so.1). TD_SONAME spells it, e.g. for dlopen().
 *
 * This file is the one place the version is written: CMakeLists.txt reads the three numbers from
 * it for the CMake package, pkg-config and the soname (tests/version checks that they agree).
 *
 * THREAD SAFETY: every function may be called from any thread, before or after td_rpc_init.
 */
#ifndef TDIST_VERSION_H
#define TDIST_VERSION_H

#include "tdist/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TD_VERSION_MAJOR 0
#define TD_VERSION_MINOR 2
#define TD_VERSION_PATCH 0

#define TD__VERSION_STR_(x) #x
#define TD__VERSION_STR(x) TD__VERSION_STR_(x)
/* "MAJOR.MINOR.PATCH" */
#define TD_VERSION_STRING                                                  \
  TD__VERSION_STR(TD_VERSION_MAJOR) "." TD__VERSION_STR(TD_VERSION_MINOR) "." \
  TD__VERSION_STR(TD_VERSION_PATCH)
/* One number that orders versions: 0xMMmmpp. */
#define TD_VERSION_HEX ((TD_VERSION_MAJOR << 16) | (TD_VERSION_MINOR << 8) | TD_VERSION_PATCH)
#if TD_VERSION_MAJOR == 0
#define TD_SONAME "libtdist.so.0." TD__VERSION_STR(TD_VERSION_MINOR)
#else
#define TD_SONAME "libtdist.so." TD__VERSION_STR(TD_VERSION_MAJOR)
#endif

/* td_version returns the version of the library the program runs with, as TD_VERSION_HEX (compare
 * it with the TD_VERSION_HEX the program was compiled with). */
TD_API unsigned td_version(void);
/* td_version_string returns that version as "MAJOR.MINOR.PATCH". Static storage. */
TD_API const char *td_version_string(void);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_VERSION_H */
