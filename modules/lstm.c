/* lstm.c - LSTMCell and the multi-layer LSTM, built from differentiable tensor ops.
 *
 * One step (PyTorch's gate order i, f, g, o):
 *   gates = x W_ih^T + b_ih + h W_hh^T + b_hh            [B, 4H]
 *   i = sigmoid(gates[:, 0:H])   f = sigmoid(gates[:, H:2H])
 *   g = tanh(gates[:, 2H:3H])    o = sigmoid(gates[:, 3H:4H])
 *   c' = f * c + i * g           h' = o * tanh(c')
 * The LSTM computes x W_ih^T + b_ih for every time step of a layer with one matmul, then runs the
 * recurrence step by step; autograd records every op, so backward (through time, into the inputs,
 * the initial state and the parameters) comes from the ops' own backward rules.
 *
 * Parameters are read by registration index: the cell has weight_ih, weight_hh[, bias_ih,
 * bias_hh]; the LSTM has those four (or two) per layer, layer after layer, as PyTorch names them.
 *
 * Lock order: an LSTM's mu guards its dropout generator and is held only around
 * td_tensor_dropout, which takes no lock but the tensor layer's leaf locks.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "modules_impl.h"

#define CK(expr)                 \
  do {                           \
    st = (expr);                 \
    if (st != TD_OK) goto out;   \
  } while (0)

/* cell_step computes (h1, c1) from the input projection gx = x W_ih^T (+ b_ih) [B, 4H], the state
 * h, c [B, H], whh_t = W_hh^T [H, 4H] and bhh [4H] (or NULL). */
static td_status cell_step(const td_tensor *gx, const td_tensor *h, const td_tensor *c,
                           const td_tensor *whh_t, const td_tensor *bhh, int64_t H,
                           td_tensor **h1, td_tensor **c1) {
  td_status st = TD_OK;
  td_tensor *hw = NULL, *g0 = NULL, *g = NULL, *part[4] = {0}, *act[4] = {0};
  td_tensor *fc = NULL, *ig = NULL, *cn = NULL, *tc = NULL, *hn = NULL;
  CK(td_tensor_matmul(h, whh_t, &hw));
  CK(td_tensor_add(gx, hw, &g0));
  if (bhh) CK(td_tensor_add(g0, bhh, &g));
  else g = td_tensor_ref(g0);
  for (int k = 0; k < 4; k++) CK(td_tensor_narrow(g, 1, k * H, H, &part[k]));
  CK(td_tensor_sigmoid(part[0], &act[0]));
  CK(td_tensor_sigmoid(part[1], &act[1]));
  CK(td_tensor_tanh(part[2], &act[2]));
  CK(td_tensor_sigmoid(part[3], &act[3]));
  CK(td_tensor_mul(act[1], c, &fc));
  CK(td_tensor_mul(act[0], act[2], &ig));
  CK(td_tensor_add(fc, ig, &cn));
  CK(td_tensor_tanh(cn, &tc));
  CK(td_tensor_mul(act[3], tc, &hn));
  *h1 = hn;
  *c1 = cn;
  hn = cn = NULL;
out:
  td_tensor_unref(hw);
  td_tensor_unref(g0);
  td_tensor_unref(g);
  for (int k = 0; k < 4; k++) {
    td_tensor_unref(part[k]);
    td_tensor_unref(act[k]);
  }
  td_tensor_unref(fc);
  td_tensor_unref(ig);
  td_tensor_unref(cn);
  td_tensor_unref(tc);
  td_tensor_unref(hn);
  return st;
}

/* check_state validates an initial state tensor against the expected shape. */
static td_status check_state(const char *module, const char *what, const td_tensor *s,
                             const td_tensor *ref, const int64_t *shape, int ndim) {
  TD_TRY(td__nn_check_input(module, s, ref));
  bool ok = td_tensor_ndim(s) == ndim;
  for (int i = 0; ok && i < ndim; i++) ok = td_tensor_shape(s)[i] == shape[i];
  if (ok) return TD_OK;
  char a[96], b[96];
  return td_set_error(TD_ERR_SHAPE, "%s.forward: %s has shape %s, expected %s", module, what,
                      td_tensor_shape_str(s, a, sizeof a), td__nn_shape_str(shape, ndim, b, sizeof b));
}

/* ---- LSTMCell ---- */

typedef struct cell_state {
  int64_t in, hidden;
  bool bias;
} cell_state;

static td_status cell_run(td_module *self, const td_tensor *x_in, const td_tensor *h_in,
                          const td_tensor *c_in, td_tensor **h_out, td_tensor **c_out) {
  const cell_state *s = td_module_state(self);
  td_tensor *wih = td__module_param_at(self, 0), *whh = td__module_param_at(self, 1);
  td_tensor *bih = s->bias ? td__module_param_at(self, 2) : NULL;
  td_tensor *bhh = s->bias ? td__module_param_at(self, 3) : NULL;
  TD_TRY(td__nn_check_input("LSTMCell", x_in, wih));
  int nd = td_tensor_ndim(x_in);
  if ((nd != 1 && nd != 2) || td_tensor_size(x_in, -1) != s->in) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "LSTMCell(%lld, %lld).forward: input %s, expected [B, %lld] "
                        "or [%lld]", (long long)s->in, (long long)s->hidden,
                        td_tensor_shape_str(x_in, buf, sizeof buf), (long long)s->in,
                        (long long)s->in);
  }
  bool batched = nd == 2;
  int64_t B = batched ? td_tensor_size(x_in, 0) : 1;
  int64_t sshape[2] = {B, s->hidden};
  const int64_t *want = batched ? sshape : &sshape[1];
  if (h_in) TD_TRY(check_state("LSTMCell", "h", h_in, wih, want, batched ? 2 : 1));
  if (c_in) TD_TRY(check_state("LSTMCell", "c", c_in, wih, want, batched ? 2 : 1));

  td_status st = TD_OK;
  td_tensor *x = NULL, *h = NULL, *c = NULL, *wih_t = NULL, *whh_t = NULL, *gx0 = NULL;
  td_tensor *gx = NULL, *h1 = NULL, *c1 = NULL, *h1o = NULL, *c1o = NULL;
  td_dtype dt = td_tensor_dtype(wih);
  td_device dev = td_tensor_device(wih);
  if (batched) x = td_tensor_ref((td_tensor *)x_in);
  else CK(td_tensor_unsqueeze(x_in, 0, &x));
  if (!h_in) CK(td_tensor_zeros(sshape, 2, dt, dev, &h));
  else if (batched) h = td_tensor_ref((td_tensor *)h_in);
  else CK(td_tensor_unsqueeze(h_in, 0, &h));
  if (!c_in) CK(td_tensor_zeros(sshape, 2, dt, dev, &c));
  else if (batched) c = td_tensor_ref((td_tensor *)c_in);
  else CK(td_tensor_unsqueeze(c_in, 0, &c));
  CK(td_tensor_transpose(wih, 0, 1, &wih_t));
  CK(td_tensor_transpose(whh, 0, 1, &whh_t));
  CK(td_tensor_matmul(x, wih_t, &gx0));
  if (bih) CK(td_tensor_add(gx0, bih, &gx));
  else gx = td_tensor_ref(gx0);
  CK(cell_step(gx, h, c, whh_t, bhh, s->hidden, &h1, &c1));
  if (batched) {
    h1o = td_tensor_ref(h1);
    c1o = td_tensor_ref(c1);
  } else {
    CK(td_tensor_squeeze(h1, 0, &h1o));
    CK(td_tensor_squeeze(c1, 0, &c1o));
  }
  *h_out = h1o;
  h1o = NULL;
  if (c_out) {
    *c_out = c1o;
    c1o = NULL;
  }
out:
  td_tensor_unref(x);
  td_tensor_unref(h);
  td_tensor_unref(c);
  td_tensor_unref(wih_t);
  td_tensor_unref(whh_t);
  td_tensor_unref(gx0);
  td_tensor_unref(gx);
  td_tensor_unref(h1);
  td_tensor_unref(c1);
  td_tensor_unref(h1o);
  td_tensor_unref(c1o);
  return st;
}

static td_status cell_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  TD_CHECK_ARG((n_in == 1 || n_in == 3) && (n_out == 1 || n_out == 2),
               "LSTMCell.forward takes inputs (x[, h, c]) and outputs (h'[, c']), got %d inputs "
               "and %d outputs", n_in, n_out);
  TD_CHECK_ARG(in[0], "LSTMCell.forward: NULL input tensor");
  return cell_run(self, in[0], n_in == 3 ? in[1] : NULL, n_in == 3 ? in[2] : NULL, &out[0],
                  n_out == 2 ? &out[1] : NULL);
}

static void free_state(void *state) { td__free(state); }

static const td_module_type cell_type = {"LSTMCell", cell_forward, free_state};

/* add_lstm_param creates a U(-bound, bound) float32 parameter and registers it. */
static td_status add_lstm_param(td_module *m, const char *name, const int64_t *shape, int ndim,
                                double bound, td_generator *g) {
  td_tensor *t = NULL;
  td_status st = td__nn_new_param(shape, ndim, &t);
  if (st == TD_OK) st = td_nn_init_uniform_(t, -bound, bound, g);
  if (st == TD_OK) st = td_module_register_parameter(m, name, t);
  td_tensor_unref(t);
  return st;
}

/* add_layer_params registers weight_ih<sfx>, weight_hh<sfx>[, bias_ih<sfx>, bias_hh<sfx>]. */
static td_status add_layer_params(td_module *m, const char *sfx, int64_t in, int64_t H, bool bias,
                                  td_generator *g) {
  double bound = H > 0 ? 1.0 / sqrt((double)H) : 0.0;
  char name[48];
  int64_t wih[2] = {4 * H, in}, whh[2] = {4 * H, H}, b[1] = {4 * H};
  snprintf(name, sizeof name, "weight_ih%s", sfx);
  TD_TRY(add_lstm_param(m, name, wih, 2, bound, g));
  snprintf(name, sizeof name, "weight_hh%s", sfx);
  TD_TRY(add_lstm_param(m, name, whh, 2, bound, g));
  if (!bias) return TD_OK;
  snprintf(name, sizeof name, "bias_ih%s", sfx);
  TD_TRY(add_lstm_param(m, name, b, 1, bound, g));
  snprintf(name, sizeof name, "bias_hh%s", sfx);
  return add_lstm_param(m, name, b, 1, bound, g);
}

td_status td_lstm_cell_create(int64_t input_size, int64_t hidden_size, bool bias, td_generator *g,
                              td_module **out) {
  TD_CHECK_ARG(out, "td_lstm_cell_create: NULL out");
  TD_CHECK_ARG(input_size > 0 && hidden_size > 0,
               "td_lstm_cell_create: sizes must be > 0 (%lld, %lld)", (long long)input_size,
               (long long)hidden_size);
  cell_state *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "td_lstm_cell_create: out of memory");
  s->in = input_size;
  s->hidden = hidden_size;
  s->bias = bias;
  td_module *m = NULL;
  td_status st = td_module_create(&cell_type, s, &m);
  if (st != TD_OK) {
    td__free(s);
    return st;
  }
  st = add_layer_params(m, "", input_size, hidden_size, bias, g);
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_status td_lstm_cell_forward(td_module *cell, const td_tensor *x, const td_tensor *h0,
                               const td_tensor *c0, td_tensor **h1, td_tensor **c1) {
  TD_CHECK_ARG(cell && x && h1 && c1, "td_lstm_cell_forward: NULL argument");
  TD_CHECK_ARG(td_module_get_type(cell) == &cell_type,
               "td_lstm_cell_forward: module is a %s, not an LSTMCell", td_module_type_name(cell));
  return cell_run(cell, x, h0, c0, h1, c1);
}

/* ---- LSTM ---- */

typedef struct lstm_state {
  int64_t in, hidden;
  td_lstm_opts o;
  pthread_mutex_t mu; /* serialises use of gen (inter-layer dropout) */
  td_generator *gen;
} lstm_state;

void td_lstm_opts_init(td_lstm_opts *o) {
  if (!o) return;
  o->num_layers = 1;
  o->bias = true;
  o->batch_first = false;
  o->dropout = 0.0;
}

static void lstm_destroy(void *state) {
  lstm_state *s = state;
  td_generator_destroy(s->gen);
  pthread_mutex_destroy(&s->mu);
  td__free(s);
}

/* layer_state returns state[l] ([B, H]) of a [L, B, H] initial state, or zeros when s is NULL. */
static td_status layer_state(const td_tensor *s, int l, const int64_t *bh, td_dtype dt,
                             td_device dev, td_tensor **out) {
  if (!s) return td_tensor_zeros(bh, 2, dt, dev, out);
  td_tensor *n = NULL;
  TD_TRY(td_tensor_narrow(s, 0, l, 1, &n));
  td_status st = td_tensor_squeeze(n, 0, out);
  td_tensor_unref(n);
  return st;
}

/* run_layer runs one layer over x [T, B, in] from (h, c) (both consumed: their references are
 * taken over), giving the outputs [T, B, H] and the last state. */
static td_status run_layer(td_module *self, int l, const td_tensor *x, td_tensor *h, td_tensor *c,
                           td_tensor **y, td_tensor **h_last, td_tensor **c_last) {
  const lstm_state *s = td_module_state(self);
  int per = s->o.bias ? 4 : 2;
  td_tensor *wih = td__module_param_at(self, l * per), *whh = td__module_param_at(self, l * per + 1);
  td_tensor *bih = s->o.bias ? td__module_param_at(self, l * per + 2) : NULL;
  td_tensor *bhh = s->o.bias ? td__module_param_at(self, l * per + 3) : NULL;
  int64_t T = td_tensor_size(x, 0);
  td_status st = TD_OK;
  td_tensor *wih_t = NULL, *whh_t = NULL, *xw0 = NULL, *xw = NULL;
  td_tensor **hs = td__calloc((size_t)T, sizeof *hs);
  if (!hs) {
    st = td_set_error(TD_ERR_NOMEM, "LSTM.forward: out of memory");
    goto out;
  }
  CK(td_tensor_transpose(wih, 0, 1, &wih_t));
  CK(td_tensor_transpose(whh, 0, 1, &whh_t));
  CK(td_tensor_matmul(x, wih_t, &xw0));
  if (bih) CK(td_tensor_add(xw0, bih, &xw));
  else xw = td_tensor_ref(xw0);
  for (int64_t t = 0; t < T; t++) {
    td_tensor *n = NULL, *gx = NULL, *h1 = NULL, *c1 = NULL;
    st = td_tensor_narrow(xw, 0, t, 1, &n);
    if (st == TD_OK) st = td_tensor_squeeze(n, 0, &gx);
    if (st == TD_OK) st = cell_step(gx, h, c, whh_t, bhh, s->hidden, &h1, &c1);
    td_tensor_unref(n);
    td_tensor_unref(gx);
    if (st != TD_OK) goto out;
    td_tensor_unref(h);
    td_tensor_unref(c);
    h = h1;
    c = c1;
    hs[t] = td_tensor_ref(h1);
  }
  CK(td_tensor_stack(hs, (int)T, 0, y));
  *h_last = h;
  *c_last = c;
  h = c = NULL;
out:
  if (hs)
    for (int64_t t = 0; t < T; t++) td_tensor_unref(hs[t]);
  td__free(hs);
  td_tensor_unref(h);
  td_tensor_unref(c);
  td_tensor_unref(wih_t);
  td_tensor_unref(whh_t);
  td_tensor_unref(xw0);
  td_tensor_unref(xw);
  return st;
}

/* finish_state stacks the per-layer states into [L, B, H] ([L, H] when unbatched). */
static td_status finish_state(td_tensor **per_layer, int L, bool batched, td_tensor **out) {
  td_tensor *st3 = NULL;
  TD_TRY(td_tensor_stack(per_layer, L, 0, &st3));
  if (batched) {
    *out = st3;
    return TD_OK;
  }
  td_status st = td_tensor_squeeze(st3, 1, out);
  td_tensor_unref(st3);
  return st;
}

static td_status lstm_run(td_module *self, const td_tensor *x_in, const td_tensor *h0_in,
                          const td_tensor *c0_in, td_tensor **output, td_tensor **hn,
                          td_tensor **cn) {
  lstm_state *s = td_module_state(self);
  int L = s->o.num_layers;
  td_tensor *w0 = td__module_param_at(self, 0);
  TD_TRY(td__nn_check_input("LSTM", x_in, w0));
  int nd = td_tensor_ndim(x_in);
  if ((nd != 2 && nd != 3) || td_tensor_size(x_in, -1) != s->in || td_tensor_size(x_in, 0) == 0 ||
      (nd == 3 && td_tensor_size(x_in, 1) == 0)) {
    char buf[96];
    return td_set_error(TD_ERR_SHAPE, "LSTM(%lld, %lld).forward: input %s, expected %s with "
                        "non-empty time and batch dims", (long long)s->in, (long long)s->hidden,
                        td_tensor_shape_str(x_in, buf, sizeof buf),
                        s->o.batch_first ? "[B, T, input_size] or [T, input_size]"
                                         : "[T, B, input_size] or [T, input_size]");
  }
  bool batched = nd == 3;
  int64_t B = batched ? td_tensor_size(x_in, s->o.batch_first ? 0 : 1) : 1;
  int64_t want[3] = {L, B, s->hidden}, want_unb[2] = {L, s->hidden};
  if (h0_in)
    TD_TRY(check_state("LSTM", "h0", h0_in, w0, batched ? want : want_unb, batched ? 3 : 2));
  if (c0_in)
    TD_TRY(check_state("LSTM", "c0", c0_in, w0, batched ? want : want_unb, batched ? 3 : 2));

  td_status st = TD_OK;
  td_dtype dt = td_tensor_dtype(w0);
  td_device dev = td_tensor_device(w0);
  int64_t bh[2] = {B, s->hidden};
  td_tensor *x = NULL, *h0 = NULL, *c0 = NULL, *y = NULL, *out_f = NULL, *layer_in = NULL;
  td_tensor *hn_t = NULL, *cn_t = NULL;
  td_tensor **hl = td__calloc((size_t)L, sizeof *hl), **cl = td__calloc((size_t)L, sizeof *cl);
  if (!hl || !cl) {
    st = td_set_error(TD_ERR_NOMEM, "LSTM.forward: out of memory");
    goto out;
  }
  /* x as [T, B, in]; states as [L, B, H] */
  if (!batched) CK(td_tensor_unsqueeze(x_in, 1, &x));
  else if (s->o.batch_first) CK(td_tensor_transpose(x_in, 0, 1, &x));
  else x = td_tensor_ref((td_tensor *)x_in);
  if (h0_in && !batched) CK(td_tensor_unsqueeze(h0_in, 1, &h0));
  else if (h0_in) h0 = td_tensor_ref((td_tensor *)h0_in);
  if (c0_in && !batched) CK(td_tensor_unsqueeze(c0_in, 1, &c0));
  else if (c0_in) c0 = td_tensor_ref((td_tensor *)c0_in);

  layer_in = td_tensor_ref(x);
  for (int l = 0; l < L; l++) {
    td_tensor *h = NULL, *c = NULL, *ly = NULL;
    st = layer_state(h0, l, bh, dt, dev, &h);
    if (st == TD_OK) st = layer_state(c0, l, bh, dt, dev, &c);
    if (st == TD_OK) {
      st = run_layer(self, l, layer_in, h, c, &ly, &hl[l], &cl[l]); /* consumes h, c */
      h = c = NULL;
    }
    td_tensor_unref(h);
    td_tensor_unref(c);
    td_tensor_unref(layer_in);
    layer_in = NULL;
    if (st != TD_OK) goto out;
    if (l < L - 1 && s->o.dropout > 0 && td_module_is_training(self)) {
      td_tensor *d = NULL;
      pthread_mutex_lock(&s->mu);
      st = td_tensor_dropout(ly, s->o.dropout, true, s->gen, &d);
      pthread_mutex_unlock(&s->mu);
      td_tensor_unref(ly);
      if (st != TD_OK) goto out;
      ly = d;
    }
    layer_in = ly;
  }
  y = layer_in;
  layer_in = NULL;
  if (!batched) CK(td_tensor_squeeze(y, 1, &out_f));
  else if (s->o.batch_first) CK(td_tensor_transpose(y, 0, 1, &out_f));
  else out_f = td_tensor_ref(y);
  if (hn) CK(finish_state(hl, L, batched, &hn_t));
  if (cn) CK(finish_state(cl, L, batched, &cn_t));
  *output = out_f;
  out_f = NULL;
  if (hn) *hn = hn_t;
  if (cn) *cn = cn_t;
  hn_t = cn_t = NULL;
out:
  for (int l = 0; hl && l < L; l++) td_tensor_unref(hl[l]);
  for (int l = 0; cl && l < L; l++) td_tensor_unref(cl[l]);
  td__free(hl);
  td__free(cl);
  td_tensor_unref(x);
  td_tensor_unref(h0);
  td_tensor_unref(c0);
  td_tensor_unref(y);
  td_tensor_unref(layer_in);
  td_tensor_unref(out_f);
  td_tensor_unref(hn_t);
  td_tensor_unref(cn_t);
  return st;
}

static td_status lstm_forward(td_module *self, td_tensor *const *in, int n_in, td_tensor **out,
                              int n_out) {
  TD_CHECK_ARG((n_in == 1 || n_in == 3) && (n_out == 1 || n_out == 3),
               "LSTM.forward takes inputs (x[, h0, c0]) and outputs (output[, h_n, c_n]), got %d "
               "inputs and %d outputs", n_in, n_out);
  TD_CHECK_ARG(in[0], "LSTM.forward: NULL input tensor");
  return lstm_run(self, in[0], n_in == 3 ? in[1] : NULL, n_in == 3 ? in[2] : NULL, &out[0],
                  n_out == 3 ? &out[1] : NULL, n_out == 3 ? &out[2] : NULL);
}

static const td_module_type lstm_type = {"LSTM", lstm_forward, lstm_destroy};

td_status td_lstm_create(int64_t input_size, int64_t hidden_size, const td_lstm_opts *opts,
                         td_generator *g, td_module **out) {
  TD_CHECK_ARG(out, "td_lstm_create: NULL out");
  td_lstm_opts o;
  if (opts) o = *opts;
  else td_lstm_opts_init(&o);
  TD_CHECK_ARG(input_size > 0 && hidden_size > 0, "td_lstm_create: sizes must be > 0 (%lld, %lld)",
               (long long)input_size, (long long)hidden_size);
  TD_CHECK_ARG(o.num_layers >= 1, "td_lstm_create: num_layers = %d must be >= 1", o.num_layers);
  TD_CHECK_ARG(o.dropout >= 0 && o.dropout <= 1, "td_lstm_create: dropout = %g must be in [0, 1]",
               o.dropout);
  lstm_state *s = td__calloc(1, sizeof *s);
  if (!s) return td_set_error(TD_ERR_NOMEM, "td_lstm_create: out of memory");
  s->in = input_size;
  s->hidden = hidden_size;
  s->o = o;
  pthread_mutex_init(&s->mu, NULL);
  td_module *m = NULL;
  td_status st = td_module_create(&lstm_type, s, &m);
  if (st != TD_OK) {
    lstm_destroy(s);
    return st;
  }
  for (int l = 0; l < o.num_layers && st == TD_OK; l++) {
    char sfx[24];
    snprintf(sfx, sizeof sfx, "_l%d", l);
    st = add_layer_params(m, sfx, l == 0 ? input_size : hidden_size, hidden_size, o.bias, g);
  }
  if (st == TD_OK) {
    /* the dropout generator is seeded after the parameters, from the same source */
    td_generator *src = td__nn_gen_acquire(g);
    uint64_t seed = src ? td_generator_next_u64(src) : 0;
    td__nn_gen_release(g);
    st = src ? td_generator_create(seed, &s->gen)
             : td_set_error(TD_ERR_NOMEM, "td_lstm_create: no generator");
  }
  if (st != TD_OK) {
    td_module_unref(m);
    return st;
  }
  *out = m;
  return TD_OK;
}

td_status td_lstm_forward(td_module *lstm, const td_tensor *x, const td_tensor *h0,
                          const td_tensor *c0, td_tensor **output, td_tensor **hn,
                          td_tensor **cn) {
  TD_CHECK_ARG(lstm && x && output, "td_lstm_forward: NULL module, input or output");
  TD_CHECK_ARG(td_module_get_type(lstm) == &lstm_type,
               "td_lstm_forward: module is a %s, not an LSTM", td_module_type_name(lstm));
  return lstm_run(lstm, x, h0, c0, output, hn, cn);
}
