/* fuzz_common.h - pieces shared by the wire fuzzer and its seed-corpus generator.
 *
 * "fuzz.box" is an extension value type whose object is simply a plain value tree: to_wire hands
 * the tree out, from_wire keeps the tree it is given. Registering it in both programs lets the
 * seeds contain extension values and lets the fuzzer reach the decoder's extension path.
 * Header-only (static functions), included by exactly one .c file per program.
 */
#ifndef TD_FUZZ_COMMON_H
#define TD_FUZZ_COMMON_H

#include "rpc/value_impl.h"
#include "rpc/wire.h"

static void box_destroy(void *obj) { td_value_unref(obj); }

static td_status box_to_wire(void *obj, td__wire_ctx *ctx, td_value **out) {
  (void)ctx;
  *out = td_value_ref(obj);
  return TD_OK;
}

static td_status box_from_wire(const td_value *repr, td__wire_ctx *ctx, void **obj) {
  (void)ctx;
  /* A box refuses a bare string so that the fuzzer also reaches from_wire's failure path. */
  if (td_value_kind_of(repr) == TD_VALUE_STRING)
    return td_set_error(TD_ERR_FORMAT, "fuzz.box: a string cannot be boxed");
  *obj = td_value_ref((td_value *)repr);
  return TD_OK;
}

static bool box_equal(const void *a, const void *b) { return td_value_equal(a, b); }

static const td__value_ext_type fuzz_box_type = {
    .name = "fuzz.box",
    .destroy = box_destroy,
    .to_wire = box_to_wire,
    .from_wire = box_from_wire,
    .equal = box_equal,
};

#endif
