/* storage.h - internals of tensor/tensor.c for the layers that shard parameters between uses
 * (ZeRO stage 3 in zero/zero3.c): free the memory behind a tensor while the tensor object
 * (its shape, autograd identity, hooks and the references other objects hold) lives on, and
 * allocate it again. Never installed.
 *
 * THREAD SAFETY: the caller makes sure nothing reads or writes t (or a view of it) while its
 * storage is released or being released/restored. Reading a released tensor is a caller bug
 * (its data pointer is NULL).
 */
#ifndef TD_TENSOR_STORAGE_H
#define TD_TENSOR_STORAGE_H

#include <stdbool.h>

#include "tdist/tensor.h"

/* td__tensor_storage_release frees t's storage memory. t must own it whole: contiguous, at
 * offset 0, spanning the storage, not borrowed (TD_ERR_INVALID otherwise). Releasing a released
 * tensor does nothing. */
td_status td__tensor_storage_release(td_tensor *t);
/* td__tensor_storage_restore allocates t's storage memory again (contents undefined; the caller
 * fills it). A live storage is left as it is. TD_ERR_NOMEM / the device's error on failure. */
td_status td__tensor_storage_restore(td_tensor *t);
/* td__tensor_storage_live returns false while t's storage is released. */
bool td__tensor_storage_live(const td_tensor *t);

#endif
