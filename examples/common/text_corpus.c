/* text_corpus.c - see text_corpus.h. */
#include <dirent.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "example_util.h"
#include "text_corpus.h"




/* clean_append appends raw[0..n) cleaned (see the file comment) to *buf (length *len). */
static void clean_append(const char *raw, size_t n, char **buf, int64_t *len, int64_t *cap) {
  if ((int64_t)n + 2 > *cap - *len) {
    *cap = (*len + (int64_t)n + 2) * 2;
    *buf = realloc(*buf, (size_t)*cap);
    if (!*buf) ex_die("out of memory reading the corpus");
  }
  char *out = *buf;
  const char *p = raw, *end = raw + n;
  while (p < end) {
    const char *e = memchr(p, '\n', (size_t)(end - p));
    if (!e) e = end;
    if (e - p == 1 && p[0] == '%') {
      out[(*len)++] = '\n';
    } else {
      for (const char *c = p; c < e; c++) {
        unsigned char ch = (unsigned char)*c;
        if (ch == 8) {
          if (*len > 0 && out[*len - 1] != '\n') (*len)--;
        } else if (ch == '\t' || (ch >= 32 && ch <= 126)) {
          out[(*len)++] = (char)ch;
        }
      }
      out[(*len)++] = '\n';
    }
    p = e + 1;
  }
}

static char *read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) ex_die("cannot open %s", path);
  size_t cap = 1 << 16, len = 0;
  char *b = malloc(cap);
  for (;;) {
    if (!b) ex_die("out of memory reading %s", path);
    len += fread(b + len, 1, cap - len, f);
    if (len < cap) break;
    cap *= 2;
    b = realloc(b, cap);
  }
  if (ferror(f)) ex_die("cannot read %s", path);
  fclose(f);
  *n = len;
  return b;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* corpus_files returns the sorted paths to read (count in *n); free each and the array. */
static char **corpus_files(const char *path, int *n) {
  struct stat st;
  if (stat(path, &st) != 0)
    ex_die("no corpus at %s (scripts/install-deps.sh installs Debian's fortunes package, or pass "
           "--corpus FILE)", path);
  char **names = NULL;
  int cnt = 0, cap = 0;
  if (!S_ISDIR(st.st_mode)) {
    names = malloc(sizeof *names);
    names[cnt++] = strdup(path);
    *n = cnt;
    return names;
  }
  DIR *d = opendir(path);
  if (!d) ex_die("cannot list %s", path);
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (e->d_name[0] == '.' || (l >= 4 && !strcmp(e->d_name + l - 4, ".dat"))) continue;
    char full[4096];
    snprintf(full, sizeof full, "%s/%s", path, e->d_name);
    struct stat fs;
    if (lstat(full, &fs) != 0 || !S_ISREG(fs.st_mode)) continue; /* symlinks, directories */
    if (cnt == cap) {
      cap = cap ? cap * 2 : 64;
      names = realloc(names, (size_t)cap * sizeof *names);
      if (!names) ex_die("out of memory");
    }
    names[cnt++] = strdup(full);
  }
  closedir(d);
  qsort(names, (size_t)cnt, sizeof *names, cmp_str);
  *n = cnt;
  return names;
}

void corpus_load(const char *path, corpus *c) {
  memset(c, 0, sizeof *c);
  int nf = 0;
  char **files = corpus_files(path, &nf);
  int64_t cap = 0;
  for (int i = 0; i < nf; i++) {
    size_t n;
    char *raw = read_file(files[i], &n);
    clean_append(raw, n, &c->text, &c->n, &cap);
    free(raw);
    free(files[i]);
  }
  free(files);
  if (c->n == 0) ex_die("the corpus at %s is empty", path);
  c->text[c->n] = '\0';
  bool seen[256] = {false};
  for (int64_t i = 0; i < c->n; i++) seen[(unsigned char)c->text[i]] = true;
  for (int b = 0; b < 256; b++) {
    c->stoi[b] = seen[b] ? c->nvocab : -1;
    if (seen[b]) c->vocab[c->nvocab++] = (char)b;
  }
  c->tok = malloc((size_t)c->n);
  if (!c->tok) ex_die("out of memory");
  for (int64_t i = 0; i < c->n; i++) c->tok[i] = (uint8_t)c->stoi[(unsigned char)c->text[i]];
  c->n_train = (int64_t)((double)c->n * 0.9);
}

void corpus_free(corpus *c) {
  free(c->text);
  free(c->tok);
}

/* ---- batches ---- */



/* batch_make draws B windows of T + 1 tokens from d[0..len) with g; *hash (may be NULL) folds in
 * every offset (FNV-1a style, as the peer does). */
void batch_make(const uint8_t *d, int64_t len, td_generator *g, int64_t B, int64_t T,
                       uint64_t *hash, batch *out) {
  int64_t shape[2] = {B, T};
  EX_CHECK(td_tensor_empty(shape, 2, TD_DTYPE_I64, td_device_cpu(), &out->x));
  EX_CHECK(td_tensor_empty(shape, 2, TD_DTYPE_I64, td_device_cpu(), &out->y));
  int64_t *x = td_tensor_data(out->x), *y = td_tensor_data(out->y);
  for (int64_t b = 0; b < B; b++) {
    uint64_t r = td_generator_next_u64(g) % (uint64_t)(len - T);
    if (hash) *hash = (*hash ^ r) * 0x100000001b3ull;
    for (int64_t t = 0; t < T; t++) {
      x[b * T + t] = d[r + t];
      y[b * T + t] = d[r + t + 1];
    }
  }
}

void batch_free(batch *b) {
  td_tensor_unref(b->x);
  td_tensor_unref(b->y);
}

