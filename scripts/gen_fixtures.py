#!/usr/bin/python3
"""gen_fixtures.py - PyTorch reference fixtures for the module, loss and optimizer tests.

Run with the interpreter that has torch 1.13:

    /usr/bin/python3 scripts/gen_fixtures.py [output-dir]    # default: tests/fixtures

Every fixture is a safetensors file written with plain json + struct (the safetensors package is
not needed). A fixture stores the inputs AND the initial parameters next to the expected outputs
and gradients, so the C tests load everything and never depend on matching random generators.
Float64 is used wherever PyTorch supports it, so the C side can compare at 1e-5 relative with a
tiny absolute slack; one optimizer fixture is float32 on purpose.

The output is deterministic: the same torch version on the same machine writes byte-identical
files (fixed seeds, insertion-ordered JSON).

Files:
  nn_linear            Linear(5, 3) on a [2, 3, 5] input: y and the gradients of sum(y * gy)
  nn_conv2d            Conv2d(3, 4, (3, 2), stride (2, 1), padding (1, 1)) forward and backward
  nn_lstm              2-layer LSTM(3, 4), seq-first, with (h0, c0); gradients of the outputs
                       weighted by gy_out, gy_hn, gy_cn wrt x, h0, c0 and every parameter
  nn_lstm_bf           1-layer LSTM(3, 5, batch_first=True) with zero initial state
  nn_lstm_cell         LSTMCell(3, 4) one step with (h, c)
  nn_losses            cross_entropy (mean / sum / none / ignore_index), nll_loss, mse_loss
  optim_<config>       3 steps of an optimizer on two parameters with stored gradients; step 1
                       has no gradient for parameter 1 (it is skipped, as PyTorch does);
                       metadata holds the hyper-parameters
  py_written           a hand-made file for the safetensors reader (dtypes, scalar, empty
                       tensor, metadata, header padding, data order differing from header order)
"""
import json
import os
import struct
import sys

import torch

DTYPES = {torch.float32: ("F32", "f"), torch.float64: ("F64", "d"), torch.int64: ("I64", "q")}


def tensor_bytes(t):
    t = t.detach().contiguous().cpu()
    code, fmt = DTYPES[t.dtype]
    values = t.reshape(-1).tolist()
    return code, struct.pack("<%d%s" % (len(values), fmt), *values)


def write_safetensors(path, tensors, metadata=None, data_order=None):
    """Write tensors (dict name -> tensor, header in insertion order). data_order optionally lists
    the names in the order their bytes are laid out."""
    header = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blobs = {}
    for name, t in tensors.items():
        blobs[name] = tensor_bytes(t)
    order = data_order or list(tensors)
    offsets, off = {}, 0
    for name in order:
        n = len(blobs[name][1])
        offsets[name] = [off, off + n]
        off += n
    for name, t in tensors.items():
        header[name] = {"dtype": blobs[name][0], "shape": list(t.shape),
                        "data_offsets": offsets[name]}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name in order:
            f.write(blobs[name][1])


def grads_of(outputs, upstream, inputs):
    loss = sum((o * g).sum() for o, g in zip(outputs, upstream))
    return torch.autograd.grad(loss, inputs)


def gen_linear(out):
    torch.manual_seed(1)
    m = torch.nn.Linear(5, 3).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    y = m(x)
    gy = torch.randn_like(y)
    gx, gw, gb = grads_of([y], [gy], [x, m.weight, m.bias])
    write_safetensors(os.path.join(out, "nn_linear.safetensors"), {
        "x": x, "weight": m.weight, "bias": m.bias, "gy": gy,
        "y": y, "grad.x": gx, "grad.weight": gw, "grad.bias": gb})


def gen_conv2d(out):
    torch.manual_seed(2)
    m = torch.nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 1)).double()
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)
    y = m(x)
    gy = torch.randn_like(y)
    gx, gw, gb = grads_of([y], [gy], [x, m.weight, m.bias])
    write_safetensors(os.path.join(out, "nn_conv2d.safetensors"), {
        "x": x, "weight": m.weight, "bias": m.bias, "gy": gy,
        "y": y, "grad.x": gx, "grad.weight": gw, "grad.bias": gb},
        metadata={"kernel": "3,2", "stride": "2,1", "padding": "1,1"})


def gen_lstm(out):
    torch.manual_seed(3)
    m = torch.nn.LSTM(3, 4, num_layers=2).double()
    T, B = 5, 2
    x = torch.randn(T, B, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, B, 4, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, B, 4, dtype=torch.float64, requires_grad=True)
    y, (hn, cn) = m(x, (h0, c0))
    gys = [torch.randn_like(y), torch.randn_like(hn), torch.randn_like(cn)]
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    grads = grads_of([y, hn, cn], gys, [x, h0, c0] + params)
    d = {"x": x, "h0": h0, "c0": c0}
    d.update({"param." + n: p for n, p in zip(names, params)})
    d.update({"gy.output": gys[0], "gy.hn": gys[1], "gy.cn": gys[2],
              "output": y, "hn": hn, "cn": cn,
              "grad.x": grads[0], "grad.h0": grads[1], "grad.c0": grads[2]})
    d.update({"grad." + n: g for n, g in zip(names, grads[3:])})
    write_safetensors(os.path.join(out, "nn_lstm.safetensors"), d,
                      metadata={"num_layers": 2, "batch_first": 0})

    torch.manual_seed(4)
    m = torch.nn.LSTM(3, 5, num_layers=1, batch_first=True).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)  # [B, T, F]
    y, (hn, cn) = m(x)
    gys = [torch.randn_like(y), torch.randn_like(hn), torch.randn_like(cn)]
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    grads = grads_of([y, hn, cn], gys, [x] + params)
    d = {"x": x}
    d.update({"param." + n: p for n, p in zip(names, params)})
    d.update({"gy.output": gys[0], "gy.hn": gys[1], "gy.cn": gys[2],
              "output": y, "hn": hn, "cn": cn, "grad.x": grads[0]})
    d.update({"grad." + n: g for n, g in zip(names, grads[1:])})
    write_safetensors(os.path.join(out, "nn_lstm_bf.safetensors"), d,
                      metadata={"num_layers": 1, "batch_first": 1})


def gen_lstm_cell(out):
    torch.manual_seed(5)
    m = torch.nn.LSTMCell(3, 4).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    h1, c1 = m(x, (h, c))
    gys = [torch.randn_like(h1), torch.randn_like(c1)]
    names = [n for n, _ in m.named_parameters()]
    params = [p for _, p in m.named_parameters()]
    grads = grads_of([h1, c1], gys, [x, h, c] + params)
    d = {"x": x, "h": h, "c": c}
    d.update({"param." + n: p for n, p in zip(names, params)})
    d.update({"gy.h1": gys[0], "gy.c1": gys[1], "h1": h1, "c1": c1,
              "grad.x": grads[0], "grad.h": grads[1], "grad.c": grads[2]})
    d.update({"grad." + n: g for n, g in zip(names, grads[3:])})
    write_safetensors(os.path.join(out, "nn_lstm_cell.safetensors"), d)


def gen_losses(out):
    torch.manual_seed(6)
    F = torch.nn.functional
    N, C = 6, 4
    logits = torch.randn(N, C, dtype=torch.float64)
    target = torch.tensor([0, 3, 1, 1, 2, 3], dtype=torch.int64)
    d = {"logits": logits, "target": target}
    gy_none = torch.randn(N, dtype=torch.float64)
    d["gy.none"] = gy_none

    def case(prefix, fn, inputs, **kw):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        for red in ("mean", "sum", "none"):
            y = fn(*leaves, reduction=red, **kw)
            gy = gy_none if red == "none" else torch.ones((), dtype=torch.float64)
            gs = torch.autograd.grad((y * gy).sum(), leaves)
            d["%s.%s" % (prefix, red)] = y
            for i, g in enumerate(gs):
                d["%s.%s.grad%d" % (prefix, red, i)] = g

    case("ce", lambda a, reduction: F.cross_entropy(a, target, reduction=reduction), [logits])
    case("ce_ignore1",
         lambda a, reduction: F.cross_entropy(a, target, reduction=reduction, ignore_index=1),
         [logits])
    logp = F.log_softmax(logits, dim=1)
    d["logp"] = logp
    case("nll", lambda a, reduction: F.nll_loss(a, target, reduction=reduction), [logp])
    a = torch.randn(3, 4, dtype=torch.float64)
    b = torch.randn(3, 4, dtype=torch.float64)
    d["mse.a"], d["mse.b"] = a, b
    d["gy.mse_none"] = torch.randn(3, 4, dtype=torch.float64)
    for red in ("mean", "sum", "none"):
        la, lb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = F.mse_loss(la, lb, reduction=red)
        gy = d["gy.mse_none"] if red == "none" else torch.ones((), dtype=torch.float64)
        ga, gb = torch.autograd.grad((y * gy).sum(), [la, lb])
        d["mse.%s" % red], d["mse.%s.grad0" % red], d["mse.%s.grad1" % red] = y, ga, gb
    write_safetensors(os.path.join(out, "nn_losses.safetensors"), d)


OPTIM_CONFIGS = [
    ("sgd", torch.optim.SGD, dict(lr=0.1), torch.float64),
    ("sgd_momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1), torch.float64),
    ("sgd_nesterov_wd", torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), torch.float64),
    ("sgd_maximize", torch.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True), torch.float64),
    ("adam", torch.optim.Adam, dict(lr=0.01), torch.float64),
    ("adam_f32", torch.optim.Adam, dict(lr=0.01), torch.float32),
    ("adam_amsgrad_wd", torch.optim.Adam,
     dict(lr=0.01, betas=(0.8, 0.99), amsgrad=True, weight_decay=0.1), torch.float64),
    ("adamw", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), torch.float64),
    ("adamw_amsgrad", torch.optim.AdamW, dict(lr=0.02, amsgrad=True, eps=1e-6), torch.float64),
    ("adagrad", torch.optim.Adagrad,
     dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
     torch.float64),
    ("rmsprop", torch.optim.RMSprop, dict(lr=0.01), torch.float64),
    ("rmsprop_centered_momentum", torch.optim.RMSprop,
     dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1), torch.float64),
]

KIND = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw",
        torch.optim.Adagrad: "adagrad", torch.optim.RMSprop: "rmsprop"}


def gen_optim(out):
    for idx, (name, cls, kw, dtype) in enumerate(OPTIM_CONFIGS):
        torch.manual_seed(100 + idx)
        p = [torch.randn(3, 4, dtype=dtype).requires_grad_(True),
             torch.randn(5, dtype=dtype).requires_grad_(True)]
        d = {"p.0.%d" % i: t.detach().clone() for i, t in enumerate(p)}
        opt = cls(p, **kw)
        scales = [1.0, 0.1, 0.5]  # shrinking gradients make amsgrad's maximum matter
        for step in range(3):
            for i, t in enumerate(p):
                if step == 1 and i == 1:
                    t.grad = None  # skipped: no update, no state change
                    continue
                g = torch.randn_like(t) * scales[step]
                t.grad = g
                d["g.%d.%d" % (step, i)] = g
            opt.step()
            for i, t in enumerate(p):
                d["p.%d.%d" % (step + 1, i)] = t.detach().clone()
        meta = {"kind": KIND[cls], "steps": 3}
        for k, v in kw.items():
            if k == "betas":
                meta["beta1"], meta["beta2"] = repr(v[0]), repr(v[1])
            elif isinstance(v, bool):
                meta[k] = "1" if v else "0"
            else:
                meta[k] = repr(v)
        write_safetensors(os.path.join(out, "optim_%s.safetensors" % name), d, metadata=meta)


def gen_py_written(out):
    tensors = {
        "b": torch.tensor([0.5, -1.25, 3.0, 1e-300], dtype=torch.float64),
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
        "c": torch.tensor([-1, 0, 1 << 40], dtype=torch.int64),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
        "name with \"quotes\" and \u00e9": torch.tensor([7.0], dtype=torch.float32),
    }
    write_safetensors(os.path.join(out, "py_written.safetensors"), tensors,
                      metadata={"format": "pt", "creator": "gen_fixtures.py"},
                      data_order=["c", "scalar", "a", "empty",
                                  "name with \"quotes\" and \u00e9", "b"])


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
    os.makedirs(out, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen_linear(out)
    gen_conv2d(out)
    gen_lstm(out)
    gen_lstm_cell(out)
    gen_losses(out)
    gen_optim(out)
    gen_py_written(out)
    print("fixtures written to", os.path.normpath(out))


if __name__ == "__main__":
    main()
