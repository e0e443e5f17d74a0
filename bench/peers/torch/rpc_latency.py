#!/usr/bin/python3
"""rpc_latency.py - PyTorch peer of bench/rpc_latency.c.

Round-trip latency of torch.distributed.rpc.rpc_sync between two workers on 127.0.0.1 (TensorPipe):
rank 0 calls a registered top-level function (rpc_common.echo) on rank 1 with a Python int and
waits, one call at a time; warm-up calls, then timed calls, each timed on its own. Prints one JSON
line with the same keys as the C benchmark:
{"bench": "rpc_latency", "config": {...}, "results": {"p50_us", "p90_us", "p99_us", "calls_per_s"}}

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    rpc_common.add_common_args(ap)
    args = ap.parse_args()

    import torch.distributed.rpc as rpc

    pair = rpc_common.Pair(args.threads, args.transports)
    echo = rpc_common.echo
    for i in range(args.warmup):
        if rpc.rpc_sync("worker1", echo, args=(i,)) != i:
            raise SystemExit("rpc_latency.py: wrong answer")
    us = []
    clock = time.perf_counter_ns
    t0 = clock()
    for i in range(args.warmup, args.warmup + args.calls):
        s = clock()
        r = rpc.rpc_sync("worker1", echo, args=(i,))
        us.append((clock() - s) * 1e-3)
        if r != i:
            raise SystemExit("rpc_latency.py: wrong answer")
    wall = (clock() - t0) * 1e-9
    config = pair.config()
    rc = pair.finish()

    xs = sorted(us)
    config.update({"warmup_calls": args.warmup, "calls": args.calls, "payload": "int64"})
    out = {
        "bench": "rpc_latency",
        "config": config,
        "results": {
            "p50_us": rpc_common.quantile(xs, 0.50),
            "p90_us": rpc_common.quantile(xs, 0.90),
            "p99_us": rpc_common.quantile(xs, 0.99),
            "min_us": xs[0],
            "max_us": xs[-1],
            "mean_us": sum(xs) / len(xs),
            "calls_per_s": args.calls / wall,
            "wall_s": wall,
        },
    }
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
