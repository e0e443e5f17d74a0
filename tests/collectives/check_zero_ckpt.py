"""check_zero_ckpt.py DIR - the consolidated ZeRO checkpoint that test_zero leaves in DIR
(TD_ZERO_CKPT_DIR) loads into PyTorch: every tensor of full.safetensors becomes a torch tensor
(torch.tensor over the file's bytes, no tdist code involved), "param.<i>" equals the model's
parameter saved beside it (model.safetensors, same names) exactly, the AdamW state has the
parameters' shapes and loads into torch.optim.AdamW through load_state_dict, and the step counts
are the metadata's. Exit 77 (skip) without PyTorch.

The file format is read by hand (8-byte little-endian header length, JSON header, data), as the
safetensors package may be missing."""
import json
import os
import struct
import sys

try:
    import torch
except ImportError:
    print("PyTorch is not installed; skipping")
    sys.exit(77)

DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "I64": (torch.int64, 8)}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        dt, size = DTYPES[info["dtype"]]
        a, b = info["data_offsets"]
        shape = info["shape"]
        count = (b - a) // size
        flat = torch.frombuffer(bytearray(data[a:b]), dtype=dt) if count else torch.empty(0, dtype=dt)
        out[name] = torch.tensor(flat.reshape(shape))
    return out, meta


def main():
    d = sys.argv[1]
    full, meta = read_safetensors(os.path.join(d, "full.safetensors"))
    model, _ = read_safetensors(os.path.join(d, "model.safetensors"))
    assert meta["format"] == "tdist.zero.full", meta
    assert meta["optimizer"] == "AdamW", meta
    n, steps = int(meta["params"]), int(meta["steps"])
    assert n == len(model) == 4 and steps == 4, (n, len(model), steps)
    assert int(meta["numel"]) == sum(t.numel() for t in model.values())
    params, state = [], {}
    for i in range(n):
        p = full[f"param.{i}"]
        shape = [int(s) for s in meta[f"param.{i}.shape"].split(",") if s]
        assert list(p.shape) == shape, (i, p.shape, shape)
        assert torch.equal(p, model[f"param.{i}"]), f"param.{i} differs from the model's"
        m, v = full[f"param.{i}.exp_avg"], full[f"param.{i}.exp_avg_sq"]
        assert m.shape == p.shape and v.shape == p.shape
        assert bool((v >= 0).all()) and float(v.abs().sum()) > 0 and float(m.abs().sum()) > 0
        assert full[f"param.{i}.step"].tolist() == [steps]
        params.append(torch.nn.Parameter(p.clone()))
        state[i] = {"step": torch.tensor(float(steps)), "exp_avg": m, "exp_avg_sq": v}
    opt = torch.optim.AdamW(params, lr=0.05)
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    for i, p in enumerate(params):
        s = opt.state[p]
        assert torch.equal(s["exp_avg"], full[f"param.{i}.exp_avg"])
        assert torch.equal(s["exp_avg_sq"], full[f"param.{i}.exp_avg_sq"])
        assert int(s["step"]) == steps
    print(f"ok: {n} parameters and their AdamW state (step {steps}) load into PyTorch")


if __name__ == "__main__":
    main()
