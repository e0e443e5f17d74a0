#!/usr/bin/python3
"""rpc_bench.py - the Python binding against torch.distributed.rpc, side by side in one run.

Three measurements, each made the same way with tdist (this binding; both workers Python
processes on 127.0.0.1) and with torch.distributed.rpc (PyTorch 1.13, TensorPipe, as in
bench/peers/torch/rpc_common.py), in interleaved rounds (tdist, torch, tdist, torch, ...):

  latency     rpc_sync echo of a Python int, one call at a time: p50/p90/p99 in us
              (--calls after --warmup calls)
  throughput  rpc_async echo of an int with --inflight calls outstanding, each reply's
              done-callback issuing the next call (the scheme of bench/peers/torch/
              rpc_throughput.py): calls/s over --async-calls calls
  bandwidth   rpc_sync echo of a float32 tensor (numpy array for tdist, torch tensor for
              torch) from 1 KiB to 64 MiB: 2 * bytes / median round trip, GB/s (1e9)

and the C benchmark build/bench/rpc_latency once (default group with a secret, echo run on the
pool like a Python function, and TD_RPC_INLINE as C programs may run it): the binding's own
overhead is p50 of Python minus p50 of C. Prints one JSON line (docs/BENCH.md):

  {"bench": "python_rpc", "config": {...},
   "results": {"tdist": {"p50_us", "p90_us", "p99_us", "calls_per_s", "echo": [...]},
               "torch": {...}, "c": {"p50_us_pool", "p50_us_inline"},
               "ratios": {"p50_torch_over_tdist", "calls_per_s_tdist_over_torch",
                          "GBps_64MiB_tdist_over_torch"},
               "binding_overhead_p50_us": {"vs_pool_handler", "vs_inline_handler"}}}

Medians over rounds. A benchmark measures; it asserts nothing. Run with /usr/bin/python3 and
PYTHONPATH=build/python (or the binding installed): bindings/python/bench/rpc_bench.py.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench", "peers", "torch"))
import rpc_common  # noqa: E402  (free_port, quantile, Pair, echo: the PyTorch peers' setup)

SIZES = [(1 << 10, 200, 2000), (64 << 10, 50, 500), (1 << 20, 10, 100), (16 << 20, 2, 16),
         (64 << 20, 1, 8)]


def echo(x):
    return x


# ---- measurements shared by both frameworks (api: tdist or torch.distributed.rpc) ----

def latency(api, fn, warmup, calls):
    for i in range(warmup):
        if api.rpc_sync("worker1", fn, args=(i,)) != i:
            raise SystemExit("rpc_bench: wrong answer")
    us = []
    clock = time.perf_counter_ns
    for i in range(calls):
        s = clock()
        r = api.rpc_sync("worker1", fn, args=(i,))
        us.append((clock() - s) * 1e-3)
        if r != i:
            raise SystemExit("rpc_bench: wrong answer")
    us.sort()
    return {"p50_us": rpc_common.quantile(us, 0.5), "p90_us": rpc_common.quantile(us, 0.9),
            "p99_us": rpc_common.quantile(us, 0.99)}


def throughput(api, fn, calls, inflight):
    """calls/s with `inflight` outstanding; each reply's callback issues the next call (a
    callback that runs at once leaves a debt the outer issue() pays, as in the torch peer)."""
    lock = threading.Lock()
    st = {"issued": 0, "replied": 0, "error": None}
    done = threading.Event()
    tls = threading.local()

    def issue():
        tls.owed = getattr(tls, "owed", 0) + 1
        if getattr(tls, "active", False):
            return
        tls.active = True
        try:
            while tls.owed > 0:
                tls.owed -= 1
                with lock:
                    if st["issued"] >= calls:
                        continue
                    st["issued"] += 1
                api.rpc_async("worker1", fn, args=(7,)).add_done_callback(on_reply)
        finally:
            tls.active = False

    def on_reply(fut):
        try:
            err = None if fut.value() == 7 else "wrong answer"
        except Exception as e:  # noqa: BLE001
            err = str(e)
        if err is None:
            issue()
        with lock:
            st["replied"] += 1
            if err and st["error"] is None:
                st["error"] = err
            if st["replied"] == calls or err:
                done.set()

    t0 = time.perf_counter()
    for _ in range(min(inflight, calls)):
        issue()
    if not done.wait(600):
        raise SystemExit("rpc_bench: throughput round did not finish")
    if st["error"]:
        raise SystemExit("rpc_bench: a call failed: %s" % st["error"])
    return calls / (time.perf_counter() - t0)


def bandwidth(api, fn, make, sizes):
    out = []
    clock = time.perf_counter_ns
    for nbytes, warmup, reps in sizes:
        t = make(nbytes)
        for _ in range(warmup):
            api.rpc_sync("worker1", fn, args=(t,))
        xs = []
        for _ in range(reps):
            s = clock()
            back = api.rpc_sync("worker1", fn, args=(t,))
            xs.append((clock() - s) * 1e-9)
            if len(back) != len(t) or back[-1] != t[-1]:
                raise SystemExit("rpc_bench: wrong tensor")
        xs.sort()
        out.append({"bytes": nbytes, "GBps_both_dirs": 2 * nbytes / rpc_common.quantile(xs, 0.5)
                    / 1e9})
    return out


def measure(api, fn, make, a):
    r = latency(api, fn, a.warmup, a.calls)
    throughput(api, fn, min(2000, a.async_calls), a.inflight)  # warm-up
    r["calls_per_s"] = throughput(api, fn, a.async_calls, a.inflight)
    r["echo"] = bandwidth(api, fn, make, a.sizes)
    return r


# ---- tdist ----

def serve_tdist(port, secret, threads):
    import tdist
    tdist.register(echo)
    tdist.init_rpc("worker1", 1, 2, init_method="tcp://127.0.0.1:%d" % port, secret=secret,
                   num_worker_threads=threads, tensor_type="numpy")
    tdist.shutdown()


def round_tdist(a):
    import numpy as np
    import tdist
    if "echo" not in tdist.rpc._functions:
        tdist.register(echo)
    port, secret = rpc_common.free_port(), tdist.generate_secret()
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-tdist",
                             str(port), secret, str(a.threads)])
    tdist.init_rpc("worker0", 0, 2, init_method="tcp://127.0.0.1:%d" % port, secret=secret,
                   num_worker_threads=a.threads, tensor_type="numpy")
    try:
        r = measure(tdist, echo,
                    lambda n: (np.arange(n // 4, dtype=np.float32) % 1000) * np.float32(0.5), a)
    finally:
        tdist.shutdown()
        peer.wait(60)
    return r


# ---- torch.distributed.rpc ----

def round_torch_fresh():
    """One torch round in a new process: torch.distributed.rpc cannot be initialised twice in
    one process (a second init_rpc fails: "DistAutogradContainer is already initialized")."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-round"] +
                         sys.argv[1:], check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def round_torch(a):
    import torch
    import torch.distributed.rpc as rpc
    pair = rpc_common.Pair(a.threads, None)
    try:
        r = measure(rpc, rpc_common.echo,
                    lambda n: (torch.arange(n // 4, dtype=torch.float32) % 1000) * 0.5, a)
    finally:
        pair.finish()
    return r


# ---- C ----

def c_latency(bench_dir, calls, pool):
    exe = os.path.join(bench_dir, "rpc_latency")
    if not os.path.exists(exe):
        return None
    cmd = [exe, "--calls", str(calls), "--security", "secret"] + (["--pool-handler"] if pool
                                                                  else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["results"]["p50_us"]


def median_of(rounds):
    r = {k: statistics.median(x[k] for x in rounds) for k in ("p50_us", "p90_us", "p99_us",
                                                                 "calls_per_s")}
    r["echo"] = [{"bytes": e["bytes"],
                  "GBps_both_dirs": statistics.median(x["echo"][i]["GBps_both_dirs"]
                                                      for x in rounds)}
                 for i, e in enumerate(rounds[0]["echo"])]
    return r


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-tdist":
        serve_tdist(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return 0
    rpc_common.pin_environment()
    torch_round = len(sys.argv) > 1 and sys.argv[1] == "--torch-round"
    if torch_round:
        del sys.argv[1]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--async-calls", type=int, default=20000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--bench-dir", default=os.path.join(os.environ.get(
        "TD_BUILD_DIR", os.path.join(ROOT, "build")), "bench"))
    ap.add_argument("--no-torch", action="store_true", help="measure tdist only")
    a = ap.parse_args()
    a.sizes = [s for s in SIZES if s[0] <= a.max_bytes]
    if torch_round:
        print(json.dumps(round_torch(a)))
        return 0
    ours, theirs = [], []
    for i in range(a.rounds):
        ours.append(round_tdist(a))
        print("rpc_bench: round %d tdist: p50 %.1f us, %.0f calls/s" % (
            i, ours[-1]["p50_us"], ours[-1]["calls_per_s"]), file=sys.stderr)
        if not a.no_torch:
            theirs.append(round_torch_fresh())
            print("rpc_bench: round %d torch: p50 %.1f us, %.0f calls/s" % (
                i, theirs[-1]["p50_us"], theirs[-1]["calls_per_s"]), file=sys.stderr)
    res = {"tdist": median_of(ours)}
    c_pool = c_latency(a.bench_dir, a.calls, True)
    c_inline = c_latency(a.bench_dir, a.calls, False)
    res["c"] = {"p50_us_pool": c_pool, "p50_us_inline": c_inline}
    if c_pool is not None:
        res["binding_overhead_p50_us"] = {"vs_pool_handler": res["tdist"]["p50_us"] - c_pool,
                                          "vs_inline_handler": res["tdist"]["p50_us"] - c_inline}
    if theirs:
        res["torch"] = median_of(theirs)
        big = [i for i, e in enumerate(res["tdist"]["echo"]) if e["bytes"] == a.sizes[-1][0]][0]
        res["ratios"] = {
            "p50_torch_over_tdist": res["torch"]["p50_us"] / res["tdist"]["p50_us"],
            "calls_per_s_tdist_over_torch": res["tdist"]["calls_per_s"] /
            res["torch"]["calls_per_s"],
            "GBps_largest_tdist_over_torch": res["tdist"]["echo"][big]["GBps_both_dirs"] /
            res["torch"]["echo"][big]["GBps_both_dirs"],
        }
    import numpy
    config = {"rounds": a.rounds, "calls": a.calls, "warmup_calls": a.warmup,
              "async_calls": a.async_calls, "inflight": a.inflight, "threads": a.threads,
              "sizes": [s[0] for s in a.sizes], "python": sys.version.split()[0],
              "numpy": numpy.__version__, "openblas_num_threads": rpc_common.blas_threads(),
              "tdist_tensor_type": "numpy", "c_bench": a.bench_dir}
    if theirs:
        import torch
        config["torch"] = torch.__version__
    print(json.dumps({"bench": "python_rpc", "config": config, "results": res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
