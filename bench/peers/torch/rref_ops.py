#!/usr/bin/python3
"""rref_ops.py - PyTorch peer of bench/rref_ops.c.

Two workers on 127.0.0.1 (TensorPipe). remote_to_here: rank 0 creates an RRef on rank 1 with
rpc.remote(echo, (i,)) and fetches it with to_here(), one at a time (the RRef is dropped each
iteration, so the owner also processes the user's delete). proxy_rpc_sync: rank 0 creates one
Counter object on rank 1 with rpc.remote and calls rref.rpc_sync().add(1) on it, one at a time.
Prints one JSON line with the same keys as the C benchmark:
{"bench": "rref_ops", "config": {...},
 "results": {"remote_to_here": {"ops_per_s", "us_per_op"}, "proxy_rpc_sync": {"ops_per_s", "us_per_op"}}}

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


class Counter:
    """The remote object of proxy_rpc_sync (lives on rank 1)."""

    def __init__(self, start):
        self.v = start

    def add(self, d):
        self.v += d
        return self.v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    rpc_common.add_common_args(ap)
    args = ap.parse_args()

    import torch.distributed.rpc as rpc

    pair = rpc_common.Pair(args.threads, args.transports)
    echo = rpc_common.echo
    clock = time.perf_counter_ns

    def remote_to_here(n, base):
        for i in range(base, base + n):
            if rpc.remote("worker1", echo, args=(i,)).to_here() != i:
                raise SystemExit("rref_ops.py: wrong answer")

    remote_to_here(args.warmup, 0)
    t0 = clock()
    remote_to_here(args.iters, args.warmup)
    rt_s = (clock() - t0) * 1e-9

    counter = rpc.remote("worker1", Counter, args=(0,))
    for _ in range(args.warmup):
        counter.rpc_sync().add(1)
    t0 = clock()
    for _ in range(args.iters):
        v = counter.rpc_sync().add(1)
    px_s = (clock() - t0) * 1e-9
    if v != args.warmup + args.iters:
        raise SystemExit("rref_ops.py: wrong counter %r" % v)
    del counter

    config = pair.config()
    rc = pair.finish()
    config.update({"warmup": args.warmup, "iters": args.iters})
    out = {
        "bench": "rref_ops",
        "config": config,
        "results": {
            "remote_to_here": {"ops_per_s": args.iters / rt_s, "us_per_op": rt_s * 1e6 / args.iters},
            "proxy_rpc_sync": {"ops_per_s": args.iters / px_s, "us_per_op": px_s * 1e6 / args.iters},
        },
    }
    print(json.dumps(out), flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
