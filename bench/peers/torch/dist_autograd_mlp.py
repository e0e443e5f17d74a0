#!/usr/bin/python3
"""dist_autograd_mlp.py - PyTorch peer of bench/dist_autograd_mlp.c.

Two workers on 127.0.0.1 (TensorPipe). Rank 1 holds Linear(784, H) + ReLU behind an RRef
(created with rpc.remote); rank 0 holds Linear(H, 10) and computes the loss (H = --hidden, 512 by
default). One step: with dist_autograd.context() as ctx: h = mlp1.rpc_sync().forward(x);
logits = head(h); cross-entropy; dist_autograd.backward(ctx, [loss]);
DistributedOptimizer(SGD, lr 0.01).step(ctx). Batch 64 (--batch), float32, fixed random data. Prints one JSON line with the same keys as the C benchmark:
{"bench": "dist_autograd_mlp", "config": {...}, "results": {"steps_per_s", "ms_per_step", "final_loss"}}

Run with /usr/bin/python3 (the interpreter that has torch).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc_common  # noqa: E402

if __name__ == "__main__":
    rpc_common.pin_environment()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


class Mlp1(nn.Module):
    """The part that lives on rank 1."""

    def __init__(self, hidden=512):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(784, hidden), nn.ReLU())

    def forward(self, x):
        return self.net(x)

    def param_rrefs(self):
        import torch.distributed.rpc as rpc

        return [rpc.RRef(p) for p in self.parameters()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    rpc_common.add_common_args(ap)
    args = ap.parse_args()

    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer

    pair = rpc_common.Pair(args.threads, args.transports)
    torch.manual_seed(2)
    mlp1 = rpc.remote("worker1", Mlp1, args=(args.hidden,))
    head = nn.Linear(args.hidden, 10)
    params = mlp1.rpc_sync().param_rrefs() + [rpc.RRef(p) for p in head.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.01)
    x = torch.rand(args.batch, 784)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step():
        with dist_autograd.context() as ctx:
            h = mlp1.rpc_sync().forward(x)
            loss = loss_fn(head(h), y)
            dist_autograd.backward(ctx, [loss])
            opt.step(ctx)
        return loss.item()

    loss = 0.0
    for _ in range(args.warmup):
        loss = step()
    t0 = time.perf_counter_ns()
    for _ in range(args.steps):
        loss = step()
    secs = (time.perf_counter_ns() - t0) * 1e-9
    del opt, params, mlp1

    config = pair.config()
    rc = pair.finish()
    config.update({"batch": args.batch, "hidden": args.hidden, "warmup": args.warmup,
                   "steps": args.steps,
                   "model": f"Linear(784,{args.hidden})+ReLU on worker1, "
                            f"Linear({args.hidden},10) on worker0",
                   "optimizer": "SGD lr=0.01"})
    out = {
        "bench": "dist_autograd_mlp",
        "config": config,
        "results": {"steps_per_s": args.steps / secs, "ms_per_step": secs * 1e3 / args.steps,
                    "final_loss": loss},
    }
    print(json.dumps(out), flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
