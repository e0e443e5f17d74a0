#!/usr/bin/python3
"""rpc_throughput.py - PyTorch peer of bench/rpc_throughput.c.

Asynchronous torch.distributed.rpc.rpc_async echoes of a Python int between two workers on
127.0.0.1 (TensorPipe) with a fixed number of calls in flight: each reply's future callback
(Future.add_done_callback) issues the next call, until `calls` replies have come back. Warm-up calls
(same scheme) first; when the timed calls took less than --min-seconds (0.5), one more timed round
sized to fill the rest follows and both count, as in the C benchmark. Prints one JSON line with the same keys as the C benchmark:
{"bench": "rpc_throughput", "config": {...}, "results": {"calls_per_s": x, ...}}

Run with /usr/bin/python3 (the interpreter that has torch).
"""
import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc_common  # noqa: E402

if __name__ == "__main__":
    rpc_common.pin_environment()


class Round:
    """`total` calls with at most `inflight` outstanding."""

    def __init__(self, total):
        self.total = total
        self.lock = threading.Lock()
        self.issued = 0
        self.replied = 0
        self.error = None
        self.done = threading.Event()
        self.tls = threading.local()

    def issue(self):
        """Starts one more call. A callback that add_done_callback runs at once (the reply beat
        the registration) would recurse; it leaves a debt that the outer call pays instead."""
        tl = self.tls
        tl.owed = getattr(tl, "owed", 0) + 1
        if getattr(tl, "active", False):
            return
        tl.active = True
        try:
            while tl.owed > 0:
                tl.owed -= 1
                self._issue_one()
        finally:
            tl.active = False

    def _issue_one(self):
        import torch.distributed.rpc as rpc

        with self.lock:
            if self.issued >= self.total:
                return
            self.issued += 1
        fut = rpc.rpc_async("worker1", rpc_common.echo, args=(7,))
        fut.add_done_callback(self.on_reply)

    def on_reply(self, fut):
        try:
            ok = fut.value() == 7
            err = None if ok else "wrong answer"
        except Exception as e:  # the call failed
            ok, err = False, str(e)
        if ok:
            self.issue()  # keep the window full
        with self.lock:
            self.replied += 1
            if err and self.error is None:
                self.error = err
            finished = self.replied == self.total or err is not None
        if finished:
            self.done.set()


def run_round(total, inflight):
    r = Round(total)
    t0 = time.perf_counter()
    for _ in range(min(inflight, total)):
        r.issue()
    if not r.done.wait(600):
        raise SystemExit("rpc_throughput.py: round of %d calls did not finish in 600 s" % total)
    wall = time.perf_counter() - t0
    if r.error:
        raise SystemExit("rpc_throughput.py: a call failed: %s" % r.error)
    return wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    rpc_common.add_common_args(ap)
    args = ap.parse_args()

    pair = rpc_common.Pair(args.threads, args.transports)
    if args.warmup > 0:
        run_round(args.warmup, args.inflight)
    wall = run_round(args.calls, args.inflight)
    calls = args.calls
    if wall < args.min_seconds:
        extra = min(50000000, int(args.calls * (args.min_seconds - wall) / max(wall, 1e-6)) + 1)
        wall += run_round(extra, args.inflight)
        calls += extra
    config = pair.config()
    rc = pair.finish()

    config.update({"warmup_calls": args.warmup, "calls": calls, "min_seconds": args.min_seconds,
                   "inflight": args.inflight, "payload": "int64"})
    out = {
        "bench": "rpc_throughput",
        "config": config,
        "results": {
            "calls_per_s": calls / wall,
            "us_per_call": wall / calls * 1e6,
            "wall_s": wall,
        },
    }
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
