/* fixture.h - loading the PyTorch reference fixtures (tests/fixtures/NAME.safetensors) in tests.
 *
 * Header-only (static functions) so that tests/modules and tests/optim can both include it.
 * Include after test_util.h.
 */
#ifndef TD_TEST_FIXTURE_H
#define TD_TEST_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tdist/nn.h"
#include "test_util.h"

/* fixture_load reads tests/fixtures/<name>.safetensors into *l (and *meta when not NULL). */
static inline void fixture_load(const char *name, td_tensor_list *l, td_safetensors_meta *meta) {
  char rel[256], path[1024];
  snprintf(rel, sizeof rel, "tests/fixtures/%s.safetensors", name);
  td_test_source_path(rel, path, sizeof path);
  td_tensor_list_init(l);
  if (meta) td_safetensors_meta_init(meta);
  TD_ASSERT_OK(td_safetensors_read(path, l, meta));
}

/* fixture_get returns the tensor named key (borrowed) and fails the test when it is missing. */
static inline td_tensor *fixture_get(const td_tensor_list *l, const char *key) {
  td_tensor *t = td_tensor_list_find(l, key);
  if (!t) fail_msg("fixture has no tensor \"%s\"", key);
  return t;
}

/* fixture_leaf returns a new leaf copy of l[key] that requires grad when requires_grad. */
static inline td_tensor *fixture_leaf(const td_tensor_list *l, const char *key,
                                      bool requires_grad) {
  td_tensor *t = NULL;
  TD_ASSERT_OK(td_tensor_clone(fixture_get(l, key), &t));
  if (requires_grad) TD_ASSERT_OK(td_tensor_set_requires_grad(t, true));
  return t;
}

/* fixture_meta_double returns metadata key as a double, or dflt when absent. */
static inline double fixture_meta_double(const td_safetensors_meta *m, const char *key,
                                         double dflt) {
  const char *v = td_safetensors_meta_get(m, key);
  return v ? strtod(v, NULL) : dflt;
}

/* fixture_check_grad compares t's accumulated gradient with l[key]. */
static inline void fixture_check_grad(const char *what, const td_tensor *t,
                                      const td_tensor_list *l, const char *key, double rtol,
                                      double atol) {
  td_tensor *g = td_tensor_grad(t);
  if (!g) fail_msg("%s: no gradient", what);
  td_test_assert_close(what, g, fixture_get(l, key), rtol, atol);
  td_tensor_unref(g);
}

#endif
