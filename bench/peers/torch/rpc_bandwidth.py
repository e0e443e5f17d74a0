#!/usr/bin/python3
"""rpc_bandwidth.py - PyTorch peer of bench/rpc_bandwidth.c.

torch.distributed.rpc.rpc_sync echoes of a float32 tensor of each size (1 KiB ... 64 MiB) between
two workers on 127.0.0.1 (TensorPipe), one call at a time; per size warm-up calls, then timed ones
(same counts as the C benchmark). The figure is 2 * bytes / (median round-trip time), counting both
directions; memcpy_GBps is the single-thread copy rate (ctypes.memmove of 64 MiB between two
preallocated, pre-touched buffers, median of several), measured in the same run. GB = 1e9 bytes.
Prints one JSON line with the same keys as the C benchmark:
{"bench": "rpc_bandwidth", "config": {...},
 "results": {"echo": [{"bytes": N, "GBps_both_dirs": x}, ...], "memcpy_GBps": y}}

Run with /usr/bin/python3 (the interpreter that has torch).
"""
import argparse
import ctypes
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc_common  # noqa: E402

if __name__ == "__main__":
    rpc_common.pin_environment()

# (bytes, warm-up calls, timed calls), as in bench/rpc_bandwidth.c
SIZES = [(1 << 10, 200, 2000), (64 << 10, 50, 500), (1 << 20, 10, 100), (16 << 20, 2, 16),
         (64 << 20, 1, 8)]


def run_size(nbytes, warmup, reps):
    import torch
    import torch.distributed.rpc as rpc

    t = (torch.arange(nbytes // 4, dtype=torch.float32) % 1000) * 0.5
    for i in range(warmup):
        back = rpc.rpc_sync("worker1", rpc_common.echo, args=(t,))
        if back.numel() != t.numel() or (i == 0 and not torch.equal(back, t)):
            raise SystemExit("rpc_bandwidth.py: wrong answer")
    xs = []
    clock = time.perf_counter_ns
    for _ in range(reps):
        s = clock()
        back = rpc.rpc_sync("worker1", rpc_common.echo, args=(t,))
        xs.append((clock() - s) * 1e-9)
        if back.numel() != t.numel() or back[0] != t[0] or back[-1] != t[-1]:
            raise SystemExit("rpc_bandwidth.py: wrong answer")
    xs.sort()
    return rpc_common.quantile(xs, 0.5), xs[0], sum(xs) / len(xs)


def memcpy_gbps(reps):
    n = 64 << 20
    a = (ctypes.c_char * n)()
    b = (ctypes.c_char * n)()
    ctypes.memset(a, 1, n)
    ctypes.memset(b, 2, n)
    ctypes.memmove(b, a, n)  # warm-up
    xs = []
    for i in range(reps):
        a[i * 4096 % n] = bytes([i % 256])
        s = time.perf_counter_ns()
        ctypes.memmove(b, a, n)
        xs.append((time.perf_counter_ns() - s) * 1e-9)
    xs.sort()
    return n / rpc_common.quantile(xs, 0.5) * 1e-9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps-scale", type=float, default=1.0)
    ap.add_argument("--memcpy-reps", type=int, default=10)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated subset of the sizes, in bytes (default: all)")
    rpc_common.add_common_args(ap)
    args = ap.parse_args()
    sizes = SIZES
    if args.sizes:
        want = [int(x) for x in args.sizes.split(",")]
        bad = [w for w in want if w not in [s[0] for s in SIZES]]
        if bad:
            ap.error("--sizes: %s is not one of the benchmark's sizes" % bad[0])
        sizes = [s for s in SIZES if s[0] in want]

    pair = rpc_common.Pair(args.threads, args.transports)
    echo, reps_used = [], []
    for nbytes, warmup, reps in sizes:
        reps = max(1, int(reps * args.reps_scale + 0.5))
        reps_used.append(reps)
        med, best, mean = run_size(nbytes, warmup, reps)
        print("rpc_bandwidth.py: %d bytes: median round trip %.1f us" % (nbytes, med * 1e6),
              file=sys.stderr, flush=True)
        echo.append({"bytes": nbytes, "GBps_both_dirs": 2 * nbytes / med * 1e-9,
                     "GBps_both_dirs_mean": 2 * nbytes / mean * 1e-9,
                     "GBps_both_dirs_best": 2 * nbytes / best * 1e-9, "median_us": med * 1e6})
    mc = memcpy_gbps(args.memcpy_reps)
    config = pair.config()
    rc = pair.finish()

    config.update({
        "dtype": "float32",
        "sizes": [s[0] for s in sizes],
        "warmup": [s[1] for s in sizes],
        "reps": reps_used,
        "memcpy_bytes": 64 << 20,
        "memcpy_reps": args.memcpy_reps,
    })
    out = {"bench": "rpc_bandwidth", "config": config,
           "results": {"echo": echo, "memcpy_GBps": mc}}
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
