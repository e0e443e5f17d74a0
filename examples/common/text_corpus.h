/* text_corpus.h - the character-level text corpus and its batches, shared by the GPT examples
 * (gpt, gpt_3d; not part of the library).
 *
 * corpus_load reads every regular file of a path (a directory: names ending in .dat and symlinks
 * skipped, in byte order of the names; or one file), cleaned byte by byte: a "%" line (the
 * separator of the fortunes files) becomes an empty line, a backspace deletes itself and the
 * character before it, and only newline, tab and printable ASCII are kept. The vocabulary is the
 * set of remaining bytes (sorted); the first 90% of the text trains, the rest validates.
 * batch_make draws B windows of T + 1 tokens at td_generator_next_u64() % (len - T).
 * Everything dies with a message (ex_die) on failure.
 */
#ifndef TD_TEXT_CORPUS_H
#define TD_TEXT_CORPUS_H

#include <stdint.h>

#include "tdist/tensor.h"

typedef struct corpus {
  char *text;        /* cleaned text (NUL-terminated) */
  int64_t n;         /* its length */
  uint8_t *tok;      /* token ids */
  int64_t n_train;   /* tokens [0, n_train) train, the rest validate */
  char vocab[257];   /* id -> byte, NUL-terminated */
  int nvocab;
  int stoi[256];     /* byte -> id, -1 when absent */
} corpus;

/* corpus_load fills c from path (see above); corpus_free releases it. */
void corpus_load(const char *path, corpus *c);
void corpus_free(corpus *c);

typedef struct batch {
  td_tensor *x, *y; /* int64 [B, T] */
} batch;

/* batch_make draws B windows of T + 1 tokens from d[0..len) with g into out (x: the first T of
 * each window, y: the last T); *hash (may be NULL) folds in every offset (FNV-1a style, as the
 * PyTorch peer does). batch_free releases them. */
void batch_make(const uint8_t *d, int64_t len, td_generator *g, int64_t B, int64_t T,
                uint64_t *hash, batch *out);
void batch_free(batch *b);

#endif
