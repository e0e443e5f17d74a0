/* test_version.c - TD_VERSION_* macros, td_version() of the library actually loaded, CMake's
 * project version and the shared library's soname (DT_SONAME read from the ELF file) agree. */
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "tdist/version.h"

static void test_version_macros_agree(void **state) {
  char s[64];
  snprintf(s, sizeof s, "%d.%d.%d", TD_VERSION_MAJOR, TD_VERSION_MINOR, TD_VERSION_PATCH);
  assert_string_equal(TD_VERSION_STRING, s);
  assert_string_equal(TD_VERSION_STRING, TD_CMAKE_VERSION); /* what CMakeLists.txt read */
  assert_int_equal(TD_VERSION_HEX >> 16, TD_VERSION_MAJOR);
  assert_int_equal((TD_VERSION_HEX >> 8) & 0xff, TD_VERSION_MINOR);
  assert_int_equal(TD_VERSION_HEX & 0xff, TD_VERSION_PATCH);
}

static void test_version_of_loaded_library(void **state) {
  assert_int_equal(td_version(), TD_VERSION_HEX);
  assert_string_equal(td_version_string(), TD_VERSION_STRING);
}

/* DT_SONAME of the ELF file at path, into out; 0 on success */
static int read_soname(const char *path, char *out, size_t n) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return -1;
  struct stat sb;
  int rc = -1;
  const unsigned char *m = NULL;
  if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < sizeof(Elf64_Ehdr)) goto out;
  size_t size = (size_t)sb.st_size;
  m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (m == MAP_FAILED) {
    m = NULL;
    goto out;
  }
  const Elf64_Ehdr *eh = (const Elf64_Ehdr *)m;
  if (memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64 ||
      eh->e_shoff + (size_t)eh->e_shnum * sizeof(Elf64_Shdr) > size)
    goto out;
  const Elf64_Shdr *sh = (const Elf64_Shdr *)(m + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum && rc != 0; i++) {
    if (sh[i].sh_type != SHT_DYNAMIC || sh[i].sh_link >= eh->e_shnum) continue;
    const Elf64_Shdr *str = &sh[sh[i].sh_link];
    if (sh[i].sh_offset + sh[i].sh_size > size || str->sh_offset + str->sh_size > size) goto out;
    const Elf64_Dyn *d = (const Elf64_Dyn *)(m + sh[i].sh_offset);
    for (size_t k = 0; k < sh[i].sh_size / sizeof *d && d[k].d_tag != DT_NULL; k++) {
      if (d[k].d_tag != DT_SONAME || d[k].d_un.d_val >= str->sh_size) continue;
      const char *name = (const char *)m + str->sh_offset + d[k].d_un.d_val;
      snprintf(out, n, "%.*s", (int)strnlen(name, str->sh_size - d[k].d_un.d_val), name);
      rc = 0;
    }
  }
out:
  if (m) munmap((void *)m, size);
  close(fd);
  return rc;
}

static void test_version_matches_soname(void **state) {
  Dl_info info;
  assert_true(dladdr((void *)td_version, &info) != 0);
  assert_non_null(info.dli_fname);
  char soname[256] = "";
  if (read_soname(info.dli_fname, soname, sizeof soname) != 0)
    fail_msg("cannot read DT_SONAME of %s", info.dli_fname);
  assert_string_equal(soname, TD_SONAME);
  /* the program found the library by that name (its DT_NEEDED) */
  const char *base = strrchr(info.dli_fname, '/');
  assert_string_equal(base ? base + 1 : info.dli_fname, TD_SONAME);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_version_macros_agree),
      cmocka_unit_test(test_version_of_loaded_library),
      cmocka_unit_test(test_version_matches_soname),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
