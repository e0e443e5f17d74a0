/* value.h - the values that travel in remote calls (part of the rpc layer).
 *
 * Values (td_value) are reference-counted tagged trees: none, bool, int64, double, string, bytes,
 * tensor, list, dict with string keys, and extension kinds of upper layers (RRefs, worker infos,
 * opaque objects). Tensors travel as raw bytes beside the envelope, never inside protobuf. A value
 * handed to a call must not be modified afterwards.
 *
 * THREAD SAFETY: reference counting from any thread; a value under construction belongs to one
 * thread until it is handed over.
 */
#ifndef TDIST_VALUE_H
#define TDIST_VALUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tdist/status.h"
#include "tdist/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum td_value_kind {
  TD_VALUE_NONE = 0,
  TD_VALUE_BOOL = 1,
  TD_VALUE_INT = 2,
  TD_VALUE_DOUBLE = 3,
  TD_VALUE_STRING = 4,
  TD_VALUE_BYTES = 5,
  TD_VALUE_TENSOR = 6,
  TD_VALUE_LIST = 7,
  TD_VALUE_DICT = 8,
  /* Values of kinds >= TD_VALUE_EXT carry an object of a type registered by an upper layer
   * (RRefs, worker infos). td_value_kind_of reports TD_VALUE_EXT for all of them;
   * td_value_kind_name gives the registered type's name. */
  TD_VALUE_EXT = 16,
} td_value_kind;

/* THREAD SAFETY (values): td_value_ref/unref and every read (accessors, list/dict getters,
 * equal, to_string) may run on any threads at once. td_value_list_append and td_value_dict_set
 * require that no other thread uses the container at the same time; once a value has been stored
 * in another value or handed to a call it must not be modified. Trees are acyclic: appending a
 * container into itself, directly or through its children, is refused (TD_ERR_INVALID). */
typedef struct td_value td_value;

/* Constructors return a new reference (release with td_value_unref()), or NULL when out of
 * memory (td_value_string(NULL), td_value_string_n(NULL, n > 0), td_value_bytes(NULL, n > 0) and
 * td_value_tensor(NULL) also give NULL). Strings and bytes are copied; string_n copies exactly n
 * bytes (embedded NULs kept) and adds a terminating NUL. td_value_none and td_value_bool return
 * shared immortal values and never fail; ref/unref on them is allowed and does nothing. */
TD_API td_value *td_value_none(void);
TD_API td_value *td_value_bool(bool v);
TD_API td_value *td_value_int(int64_t v);
TD_API td_value *td_value_double(double v);
TD_API td_value *td_value_string(const char *s);
TD_API td_value *td_value_string_n(const char *s, size_t n);
TD_API td_value *td_value_bytes(const void *data, size_t n);
/* td_value_tensor takes a new reference to t. */
TD_API td_value *td_value_tensor(td_tensor *t);
/* td_value_list makes an empty list; td_value_dict an empty dict. */
TD_API td_value *td_value_list(void);
TD_API td_value *td_value_dict(void);

TD_API td_value *td_value_ref(td_value *v);
/* td_value_unref drops a reference; the last one frees v and its children. NULL does nothing. */
TD_API void td_value_unref(td_value *v);

/* td_value_kind_of returns v's kind; NULL counts as TD_VALUE_NONE. */
TD_API td_value_kind td_value_kind_of(const td_value *v);
/* td_value_kind_name returns "none", "bool", "int", "double", "string", "bytes", "tensor",
 * "list", "dict", or the registered extension type's name. Never NULL; static storage. */
TD_API const char *td_value_kind_name(const td_value *v);

/* Accessors return TD_ERR_INVALID (message "value: expected int, got string") on a kind mismatch
 * or a NULL v, and leave *out untouched. as_int accepts bool; as_double accepts int. */
TD_API td_status td_value_as_bool(const td_value *v, bool *out);
TD_API td_status td_value_as_int(const td_value *v, int64_t *out);
TD_API td_status td_value_as_double(const td_value *v, double *out);
/* td_value_as_string: *out borrowed (NUL-terminated), valid while v lives; *len may be NULL. */
TD_API td_status td_value_as_string(const td_value *v, const char **out, size_t *len);
TD_API td_status td_value_as_bytes(const td_value *v, const void **data, size_t *len);
/* td_value_as_tensor: *out borrowed, valid while v lives (td_tensor_ref it to keep it). */
TD_API td_status td_value_as_tensor(const td_value *v, td_tensor **out);

/* Lists. td_value_list_append takes ownership of item on TD_OK (on failure the caller keeps it):
 * TD_ERR_INVALID when list is not a list, item is NULL or item contains list; TD_ERR_NOMEM.
 * td_value_list_len is 0 and td_value_list_get NULL for a value that is not a list. */
TD_API size_t td_value_list_len(const td_value *list);
TD_API td_value *td_value_list_get(const td_value *list, size_t i); /* borrowed, NULL if OOB */
TD_API td_status td_value_list_append(td_value *list, td_value *item);

/* Dicts have string keys (copied; any NUL-terminated string, "" included) and keep insertion
 * order; setting an existing key replaces its value in place (the old value is released, the
 * position is kept). td_value_dict_set takes ownership of item on TD_OK (on failure the caller
 * keeps it; errors as for td_value_list_append, plus a NULL key). Lookups are linear for small
 * dicts and hashed for larger ones. */
TD_API size_t td_value_dict_len(const td_value *dict);
TD_API td_value *td_value_dict_get(const td_value *dict, const char *key); /* borrowed or NULL */
TD_API td_status td_value_dict_set(td_value *dict, const char *key, td_value *item);
/* td_value_dict_entry returns the i-th key and value (borrowed) in insertion order; key or item
 * may be NULL when not wanted. TD_ERR_INVALID when i >= td_value_dict_len(dict). */
TD_API td_status td_value_dict_entry(const td_value *dict, size_t i, const char **key,
                                     td_value **item);

/* td_value_equal compares two trees structurally. Kinds must match exactly (int 1 differs from
 * double 1.0 and from true); NULL equals none; doubles are equal when == or both NaN; strings and
 * bytes by length and bytes; lists element by element; dicts by keys, values and insertion order;
 * tensors by dtype, shape and elements (same rule as doubles; device and strides do not matter,
 * and a tensor that cannot be read back counts as different); extension values need the same type
 * and then the type's equal function, or the same object when it has none. */
TD_API bool td_value_equal(const td_value *a, const td_value *b);

/* td_value_to_string writes a short Python-like form into buf and returns buf:
 * "[1, 'a', {'k': None}, True, 2.5, b'\x00', tensor(float32[2, 3])]" (non-CPU tensors add the
 * device: "tensor(float32[2], cuda:0)"; extension values print their describe() text or type
 * name; containers nested deeper than 32 print as [...] / {...}). Output that does not fit in n
 * bytes is cut and ends with "..." (never half a UTF-8 sequence); always NUL-terminated when
 * n > 0. */
TD_API const char *td_value_to_string(const td_value *v, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* TDIST_VALUE_H */
