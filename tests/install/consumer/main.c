/* A tiny program using an installed tdist: y = sum(x * x), dy/dx = 2x; the library it runs with
 * is the version it was compiled against. */
#include <stdio.h>
#include <tdist/tdist.h>

int main(void) {
  if (td_version() != TD_VERSION_HEX) {
    fprintf(stderr, "compiled against tdist %s, running with %s\n", TD_VERSION_STRING,
            td_version_string());
    return 1;
  }
  int64_t shape[1] = {3};
  double v[3] = {1, 2, 3};
  td_tensor *x, *sq, *y;
  if (td_tensor_from_buffer(v, shape, 1, TD_DTYPE_F64, &x) != TD_OK) return 1;
  td_tensor_set_requires_grad(x, true);
  if (td_tensor_mul(x, x, &sq) != TD_OK || td_tensor_sum_all(sq, &y) != TD_OK) return 1;
  if (td_tensor_backward(y) != TD_OK) return 1;
  td_tensor *g = td_tensor_grad(x);
  double g2;
  int64_t i = 2;
  if (!g || td_tensor_get(g, &i, &g2) != TD_OK || g2 != 6.0) return 1;
  td_tensor_unref(g);
  td_tensor_unref(y);
  td_tensor_unref(sq);
  td_tensor_unref(x);
  printf("consumer ok\n");
  return 0;
}
