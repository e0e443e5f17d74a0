/* wire.c - what the encoder and the decoder share: releasing messages and frames. The format is
 * described in wire.h; encoding is in wire_encode.c, decoding in wire_decode.c, and direct-copy
 * descriptors in direct.c. */
#include "wire.h"

#include <string.h>

void td__msg_clear(td__msg *m) {
  if (!m) return;
  td__free(m->fn);
  td__free(m->message);
  for (int i = 0; i < m->nvalues; i++) td_value_unref(m->values[i]);
  td__free(m->values);
  td__free(m->aux);
  memset(m, 0, sizeof *m);
}

void td__frame_clear(td__frame *f) {
  if (!f) return;
  td__free(f->head);
  for (int i = 0; i < f->ntensors; i++) td_tensor_unref(f->tensors[i]);
  td__free(f->tensors);
  memset(f, 0, sizeof *f);
}
