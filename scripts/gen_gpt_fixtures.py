#!/usr/bin/python3
"""gen_gpt_fixtures.py - PyTorch reference fixtures for the GPT building blocks and its recipe.

Run with the interpreter that has torch 1.13:

    /usr/bin/python3 scripts/gen_gpt_fixtures.py [output-dir]    # default: tests/fixtures

A sibling of gen_fixtures.py (whose safetensors writer it uses): same conventions, every fixture
holds its inputs and initial parameters next to the expected outputs, float64 unless stated. The
GPT model is the one of the PyTorch peer, bench/peers/torch/gpt.py (nanoGPT's layout).

Files:
  optim_adamw_groups   AdamW over two parameter groups (weight decay 0.1 on the matrix, none on
                       the vectors; the second group with its own lr), 3 steps with stored grads
  optim_clip           clip_grad_norm_ of three gradients for norm types 2, inf, 1 and 3, clipped
                       and not clipped (max_norm above the total)
  optim_schedule       the learning rates nanoGPT's get_lr gives through LambdaLR, two configs
  attention            causal scaled-dot-product attention as nanoGPT computes it (q @ k^T *
                       scale, masked_fill(-inf), softmax, @ v) on [B, H, T, hd] in float64 and
                       float32: output and the gradients of sum(y * gy) wrt q, k, v
  gpt_block            one pre-LayerNorm Block (attention + GELU MLP): output and gradients wrt
                       the input and every parameter
  gpt_tiny             a whole tiny GPT (2 layers, tied embedding/head): logits, the
                       cross-entropy loss and the gradient of every parameter (the tied one
                       receives both contributions)
"""
import math
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "bench", "peers", "torch"))
from gen_fixtures import write_safetensors  # noqa: E402


def gen_adamw_groups(out):
    torch.manual_seed(200)
    w = torch.randn(3, 4, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(4, dtype=torch.float64).requires_grad_(True)
    g = torch.randn(4, dtype=torch.float64).requires_grad_(True)
    params = [w, b, g]
    d = {"p.0.%d" % i: t.detach().clone() for i, t in enumerate(params)}
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1},
                             {"params": [b, g], "weight_decay": 0.0, "lr": 0.02}],
                            lr=0.01, betas=(0.9, 0.99))
    for step in range(3):
        for i, t in enumerate(params):
            t.grad = torch.randn_like(t) * (1.0, 0.3, 2.0)[step]
            d["g.%d.%d" % (step, i)] = t.grad.clone()
        opt.step()
        for i, t in enumerate(params):
            d["p.%d.%d" % (step + 1, i)] = t.detach().clone()
    write_safetensors(os.path.join(out, "optim_adamw_groups.safetensors"), d, metadata={
        "lr": "0.01", "beta1": "0.9", "beta2": "0.99", "group0_weight_decay": "0.1",
        "group1_weight_decay": "0.0", "group1_lr": "0.02", "steps": "3"})


def gen_clip(out):
    torch.manual_seed(201)
    grads = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64) * 3,
             torch.randn(2, 2, 2, dtype=torch.float64)]
    d = {"g.%d" % i: g for i, g in enumerate(grads)}
    cases = [("2", 2.0, 1.0), ("inf", math.inf, 0.5), ("1", 1.0, 2.0), ("3", 3.0, 1.5),
             ("2big", 2.0, 1000.0)]
    for name, norm_type, max_norm in cases:
        ps = [torch.nn.Parameter(g.clone()) for g in grads]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
        d["total.%s" % name] = total.reshape(1)
        for i, p in enumerate(ps):
            d["clipped.%s.%d" % (name, i)] = p.grad
    write_safetensors(os.path.join(out, "optim_clip.safetensors"), d, metadata={
        "cases": ",".join(c[0] for c in cases),
        "norm_types": ",".join(repr(c[1]) for c in cases),
        "max_norms": ",".join(repr(c[2]) for c in cases)})


def nanogpt_get_lr(it, warmup_iters, lr_decay_iters, learning_rate, min_lr):
    """nanoGPT's train.py get_lr, verbatim."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def gen_schedule(out):
    d, meta = {}, {}
    configs = [("a", 10, 50, 1e-3, 1e-4, 60), ("b", 100, 2000, 6e-4, 6e-5, 2100)]
    for name, warmup, decay, lr, min_lr, steps in configs:
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.AdamW([p], lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda it: nanogpt_get_lr(it, warmup, decay, lr, min_lr) / lr)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            p.grad = torch.zeros_like(p)
            opt.step()
            sched.step()
        d["lr.%s" % name] = torch.tensor(lrs, dtype=torch.float64)
        meta["config.%s" % name] = "%d,%d,%r,%r" % (warmup, decay, lr, min_lr)
    write_safetensors(os.path.join(out, "optim_schedule.safetensors"), d, metadata=meta)


def nanogpt_attention(q, k, v, causal=True):
    """The attention core of nanoGPT's CausalSelfAttention (the non-flash branch)."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    if causal:
        L, S = att.shape[-2:]
        mask = torch.tril(torch.ones(L, S, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf"))
    att = torch.nn.functional.softmax(att, dim=-1)
    return att @ v


def gen_attention(out):
    torch.manual_seed(202)
    d = {}
    cases = [("causal", (2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4), True),
             ("full", (2, 3, 4), (2, 6, 4), (2, 6, 5), False),
             ("causal_wide", (1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 3), True)]
    for dtype, sfx in ((torch.float64, ""), (torch.float32, ".f32")):
        for name, qs, ks, vs, causal in cases:
            q = torch.randn(*qs, dtype=dtype, requires_grad=True)
            k = torch.randn(*ks, dtype=dtype, requires_grad=True)
            v = torch.randn(*vs, dtype=dtype, requires_grad=True)
            y = nanogpt_attention(q, k, v, causal)
            gy = torch.randn_like(y)
            gq, gk, gv = torch.autograd.grad((y * gy).sum(), [q, k, v])
            p = name + sfx + "."
            d.update({p + "q": q, p + "k": k, p + "v": v, p + "gy": gy, p + "y": y,
                      p + "grad.q": gq, p + "grad.k": gk, p + "grad.v": gv})
    write_safetensors(os.path.join(out, "attention.safetensors"), d, metadata={
        "cases": ",".join(c[0] for c in cases),
        "causal": ",".join("1" if c[4] else "0" for c in cases)})


def gen_gpt_block(out):
    import gpt as peer
    torch.manual_seed(203)
    cfg = peer.Config(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=8)
    d = {}
    for dtype, sfx in ((torch.float64, ""), (torch.float32, ".f32")):
        block = peer.Block(cfg).to(dtype)
        for p in block.parameters():  # random values everywhere (not just nanoGPT's init)
            torch.nn.init.normal_(p, 0.0, 0.3)
        x = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
        y = block(x)
        gy = torch.randn_like(y)
        names = [n for n, _ in block.named_parameters()]
        params = [p for _, p in block.named_parameters()]
        grads = torch.autograd.grad((y * gy).sum(), [x] + params)
        d.update({"x" + sfx: x, "gy" + sfx: gy, "y" + sfx: y, "grad.x" + sfx: grads[0]})
        for n, p, g in zip(names, params, grads[1:]):
            d["param%s.%s" % (sfx.replace(".", "_"), n)] = p
            d["grad%s.%s" % (sfx.replace(".", "_"), n)] = g
    write_safetensors(os.path.join(out, "gpt_block.safetensors"), d, metadata={
        "n_embd": "8", "n_head": "2", "n_layer": "2", "block_size": "6"})


def gen_gpt_tiny(out):
    import gpt as peer
    torch.manual_seed(204)
    cfg = peer.Config(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    d = {}
    for dtype, sfx in ((torch.float64, ""), (torch.float32, ".f32")):
        model = peer.GPT(cfg).to(dtype)
        for p in model.parameters():
            torch.nn.init.normal_(p, 0.0, 0.3)
        idx = torch.randint(0, cfg.vocab_size, (3, 6))
        tgt = torch.randint(0, cfg.vocab_size, (3, 6))
        tgt[1, 2] = -1  # ignored
        logits, loss = model(idx, tgt)
        loss.backward()
        d.update({"idx" + sfx: idx, "targets" + sfx: tgt, "logits" + sfx: logits,
                  "loss" + sfx: loss.reshape(1)})
        for n, t in model.state_dict().items():
            d["param%s.%s" % (sfx.replace(".", "_"), n)] = t
        for n, p in model.named_parameters():
            d["grad%s.%s" % (sfx.replace(".", "_"), n)] = p.grad
    write_safetensors(os.path.join(out, "gpt_tiny.safetensors"), d, metadata={
        "vocab_size": "11", "block_size": "8", "n_layer": "2", "n_head": "2", "n_embd": "8"})


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "tests", "fixtures")
    os.makedirs(out, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen_adamw_groups(out)
    gen_clip(out)
    gen_schedule(out)
    gen_attention(out)
    gen_gpt_block(out)
    gen_gpt_tiny(out)
    print("fixtures written to", os.path.normpath(out))


if __name__ == "__main__":
    main()
