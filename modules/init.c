/* init.c - parameter initialisation (PyTorch's torch.nn.init) and this layer's default generator.
 *
 * The default generator stands in for PyTorch's global RNG: constructors and initialisers given
 * g == NULL draw from it. It is created lazily with a fixed seed (so programs are reproducible
 * without calling td_nn_manual_seed) and every use holds gen_mu for the whole fill.
 *
 * Lock order: gen_mu is a leaf lock (nothing else is taken while it is held, except the tensor
 * layer's internal locks).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>

#include "modules_impl.h"

#define TD_NN_DEFAULT_SEED 0x7464697374ULL /* "tdist" */

static pthread_mutex_t gen_mu = PTHREAD_MUTEX_INITIALIZER;
static td_generator *default_gen;

td_generator *td__nn_gen_acquire(td_generator *g) {
  if (g) return g;
  pthread_mutex_lock(&gen_mu);
  if (!default_gen && td_generator_create(TD_NN_DEFAULT_SEED, &default_gen) != TD_OK) {
    pthread_mutex_unlock(&gen_mu);
    return NULL;
  }
  return default_gen;
}

void td__nn_gen_release(td_generator *g) {
  if (!g) pthread_mutex_unlock(&gen_mu);
}

td_status td_nn_manual_seed(uint64_t seed) {
  td_generator *fresh = NULL;
  TD_TRY(td_generator_create(seed, &fresh));
  pthread_mutex_lock(&gen_mu);
  td_generator *old = default_gen;
  default_gen = fresh;
  pthread_mutex_unlock(&gen_mu);
  td_generator_destroy(old);
  return TD_OK;
}

td_status td_nn_init_fans(const td_tensor *t, int64_t *fan_in, int64_t *fan_out) {
  TD_CHECK_ARG(t && fan_in && fan_out, "td_nn_init_fans: NULL argument");
  int nd = td_tensor_ndim(t);
  TD_CHECK_ARG(nd >= 2, "td_nn_init_fans: fan in and fan out need at least 2 dims (got %d)", nd);
  const int64_t *shape = td_tensor_shape(t);
  int64_t receptive = 1;
  for (int i = 2; i < nd; i++) receptive *= shape[i];
  *fan_in = shape[1] * receptive;
  *fan_out = shape[0] * receptive;
  return TD_OK;
}

td_status td_nn_init_uniform_(td_tensor *t, double lo, double hi, td_generator *g) {
  TD_CHECK_ARG(t, "td_nn_init_uniform_: NULL tensor");
  TD_CHECK_ARG(lo <= hi, "td_nn_init_uniform_: lo %g > hi %g", lo, hi);
  td_generator *gen = td__nn_gen_acquire(g);
  if (!gen) return td_set_error(TD_ERR_NOMEM, "td_nn_init_uniform_: no generator");
  td_status st = td_tensor_uniform_(t, lo, hi, gen);
  td__nn_gen_release(g);
  return st;
}

td_status td_nn_init_normal_(td_tensor *t, double mean, double std, td_generator *g) {
  TD_CHECK_ARG(t, "td_nn_init_normal_: NULL tensor");
  TD_CHECK_ARG(std >= 0, "td_nn_init_normal_: negative std %g", std);
  td_generator *gen = td__nn_gen_acquire(g);
  if (!gen) return td_set_error(TD_ERR_NOMEM, "td_nn_init_normal_: no generator");
  td_status st = td_tensor_normal_(t, mean, std, gen);
  td__nn_gen_release(g);
  return st;
}

td_status td_nn_init_kaiming_uniform_(td_tensor *t, double a, td_generator *g) {
  int64_t fan_in, fan_out;
  TD_TRY(td_nn_init_fans(t, &fan_in, &fan_out));
  if (fan_in == 0) return TD_OK; /* PyTorch warns and leaves a zero-element tensor alone */
  double gain = sqrt(2.0 / (1.0 + a * a));
  double bound = sqrt(3.0) * gain / sqrt((double)fan_in);
  return td_nn_init_uniform_(t, -bound, bound, g);
}

td_status td_nn_init_xavier_uniform_(td_tensor *t, double gain, td_generator *g) {
  int64_t fan_in, fan_out;
  TD_TRY(td_nn_init_fans(t, &fan_in, &fan_out));
  if (fan_in + fan_out == 0) return TD_OK;
  double bound = gain * sqrt(6.0 / (double)(fan_in + fan_out));
  return td_nn_init_uniform_(t, -bound, bound, g);
}

td_status td__nn_new_param(const int64_t *shape, int ndim, td_tensor **out) {
  return td_tensor_empty(shape, ndim, TD_DTYPE_F32, td_device_cpu(), out);
}

td_status td__nn_check_input(const char *module, const td_tensor *x, const td_tensor *ref) {
  TD_CHECK_ARG(x, "%s.forward: NULL input tensor", module);
  if (!ref) return TD_OK;
  /* under autocast the ops convert floating inputs themselves (tensor.h) */
  bool converted = td_autocast_dtype(NULL) && td_dtype_is_float(td_tensor_dtype(x)) &&
                   td_dtype_is_float(td_tensor_dtype(ref));
  if (td_tensor_dtype(x) != td_tensor_dtype(ref) && !converted)
    return td_set_error(TD_ERR_DTYPE, "%s.forward: input is %s but the parameters are %s",
                        module, td_dtype_name(td_tensor_dtype(x)),
                        td_dtype_name(td_tensor_dtype(ref)));
  if (!td_device_equal(td_tensor_device(x), td_tensor_device(ref))) {
    char a[32], b[32];
    return td_set_error(TD_ERR_DEVICE, "%s.forward: input is on %s but the parameters on %s",
                        module, td_device_str(td_tensor_device(x), a, sizeof a),
                        td_device_str(td_tensor_device(ref), b, sizeof b));
  }
  return TD_OK;
}

const char *td__nn_shape_str(const int64_t *shape, int ndim, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  size_t len = 0;
  int w = snprintf(buf, n, "[");
  len = w > 0 ? (size_t)w : 0;
  for (int i = 0; i < ndim && len < n; i++) {
    w = snprintf(buf + len, n - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (w < 0) break;
    len += (size_t)w;
  }
  if (len < n) snprintf(buf + len, n - len, "]");
  return buf;
}
