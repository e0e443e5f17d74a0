#!/usr/bin/python3
"""train_step.py - PyTorch peer of bench/train_step.c.

One training step of an MLP 784-256-10 (Linear, ReLU, Linear; cross-entropy; backward; plain SGD
without momentum) on a fixed random batch, one thread. Warm-up steps, then timed steps. Prints one
JSON line with the same keys as the C benchmark:
{"bench": "train_step", "config": {...}, "results": {"steps_per_s": x, "peak_rss_mb": y}}

Run with /usr/bin/python3 (the interpreter that has torch). OPENBLAS_NUM_THREADS must be set in the
environment before start (Debian's torch uses OpenBLAS, which ignores torch.set_num_threads);
bench/compare.sh does that, and so does this script by re-executing itself when it is missing.
"""
import argparse
import json
import os
import resource
import sys
import time

if os.environ.get("OPENBLAS_NUM_THREADS") is None:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402  (after the environment is fixed)


def blas_threads():
    v = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return int(v) if v.isdigit() else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    n_in, n_out = 784, 10
    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, n_out)
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    x = torch.randn(args.batch_size, n_in)
    y = torch.randint(0, n_out, (args.batch_size,))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    loss_value = float(loss.item())
    elapsed = time.perf_counter() - t0

    out = {
        "bench": "train_step",
        "config": {
            "impl": "torch " + torch.__version__,
            "model": "mlp 784-%d-10" % args.hidden,
            "batch_size": args.batch_size,
            "warmup_steps": args.warmup,
            "steps": args.steps,
            "lr": args.lr,
            "threads": args.threads,
            "torch_num_threads": torch.get_num_threads(),
            "openblas_num_threads": blas_threads(),
        },
        "results": {
            "steps_per_s": args.steps / elapsed,
            "step_us": elapsed / args.steps * 1e6,
            "wall_s": elapsed,
            "final_loss": loss_value,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        },
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
