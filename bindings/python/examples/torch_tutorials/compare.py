#!/usr/bin/python3
"""compare.py - runs PyTorch's RPC tutorials (this folder) under tdist.torch_rpc and under
torch.distributed.rpc, and prints their results side by side with the wall time of each run.

    PYTHONPATH=build/python /usr/bin/python3 bindings/python/examples/torch_tutorials/compare.py \\
        [--runs 3] [--only ps rnn] [--write-reference reference.json]

Each program is started the way a user starts it (python3 prog.py ...: it spawns its workers
with torch.multiprocessing) with TUTORIAL_RPC=tdist or torch, which picks its import block, and
free ports in MASTER_PORT / RPC_PORT. Runs alternate between the two libraries. The time is
the whole program's, from start to exit (spawning, imports, init, training, shutdown).
--write-reference stores PyTorch's results (the last run's) of the tutorials run (the file's
other entries stay), which tests/test_tutorials.py compares tdist's with.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (program, arguments): the sizes CI runs (a few seconds of work each)
TUTORIALS = {
    "ps": ("ps.py", ["--batches", "10"]),
    "rnn": ("rnn.py", ["--epochs", "2"]),
    "pipeline": ("pipeline.py", ["--split", "16"]),
    "batch_ps": ("batch_ps.py", []),
    "ddp_rpc": ("ddp_rpc.py", ["--epochs", "1"]),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name, impl, timeout=300, python=None):
    """Runs tutorial name under impl ("tdist" or "torch"); returns (results, seconds, output).
    results: the RESULT lines' objects (sorted by rank when they have one)."""
    prog, args = TUTORIALS[name]
    env = dict(os.environ, TUTORIAL_RPC=impl, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RPC_PORT=str(free_port()),
               OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tdist-tutorial-") as rdir:
        # each worker writes its result whole to a file here (results.py): RESULT lines of
        # several workers on one stdout pipe can cut into each other
        env["TUTORIAL_RESULTS"] = rdir
        p = subprocess.run([python or sys.executable, os.path.join(HERE, prog)] + args,
                           env=env, capture_output=True, text=True, timeout=timeout)
        secs = time.monotonic() - t0
        out = p.stdout + p.stderr
        if p.returncode != 0:
            raise RuntimeError("%s under %s exited %d:\n%s" % (name, impl, p.returncode,
                                                               out[-4000:]))
        res = []
        for fn in sorted(os.listdir(rdir)):
            if fn.endswith(".json"):
                with open(os.path.join(rdir, fn)) as f:
                    res.append(json.load(f))
    res.sort(key=lambda r: r.get("rank", 0))
    return res, secs, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=list(TUTORIALS))
    ap.add_argument("--write-reference")
    a = ap.parse_args()
    ref = {}
    for name in a.only:
        times = {"tdist": [], "torch": []}
        for _ in range(a.runs):
            for impl in ("tdist", "torch"):
                res, secs, _out = run(name, impl)
                times[impl].append(secs)
                print("%-9s %-5s %6.2f s  %s" % (name, impl, secs, json.dumps(res)[:150]),
                      flush=True)
                if impl == "torch":
                    ref[name] = res
        print("%-9s median wall time: tdist %.2f s, torch %.2f s (%.2fx)" % (
            name, statistics.median(times["tdist"]), statistics.median(times["torch"]),
            statistics.median(times["torch"]) / statistics.median(times["tdist"])), flush=True)
    if a.write_reference:
        if os.path.exists(a.write_reference):  # the tutorials not run keep their entries
            with open(a.write_reference) as f:
                ref = dict(json.load(f), **ref)
        with open(a.write_reference, "w") as f:
            json.dump(ref, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
