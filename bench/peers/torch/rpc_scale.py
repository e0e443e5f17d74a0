#!/usr/bin/python3
"""rpc_scale.py - PyTorch peer of bench/rpc_scale.c (its "processes" part).

N worker processes on 127.0.0.1 (forked before torch.distributed.rpc starts), each:
init_rpc (TensorPipe, --threads num_worker_threads), rpc_async(add, (rank * 1000, peer)) to every
other worker (with --peers K, to the K ranks after its own), wait for all,
shutdown(graceful=True). The figures are the slowest worker's time in each phase and the time
from the first fork to the last exit. Prints one JSON line with the keys
of the C benchmark: {"bench": "rpc_scale", "config": {...}, "results": {"processes": [{"world",
"ok", "init_s", "all_to_all_s", "shutdown_s", "wall_s", "failed_workers"}], "store_sim": []}}
(the store simulation has no peer).

Run with /usr/bin/python3 (the interpreter that has torch).
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc_common  # noqa: E402

if __name__ == "__main__":
    rpc_common.pin_environment()


def add(x, y):
    return x + y


def worker(rank, world, port, threads, peers, times):
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:%d" % port,
                                           num_worker_threads=threads, rpc_timeout=300)
    t0 = time.monotonic()
    rpc.init_rpc("worker%d" % rank, rank=rank, world_size=world, rpc_backend_options=opts)
    t1 = time.monotonic()
    k = peers if 0 < peers < world - 1 else world - 1
    futs = [(p, rpc.rpc_async("worker%d" % p, add, args=(rank * 1000, p)))
            for p in ((rank + i) % world for i in range(1, k + 1))]
    for p, f in futs:
        if f.wait() != rank * 1000 + p:
            raise SystemExit("rpc_scale.py: wrong answer")
    t2 = time.monotonic()
    rpc.shutdown(graceful=True)
    t3 = time.monotonic()
    times[3 * rank:3 * rank + 3] = [t1 - t0, t2 - t1, t3 - t2]


def run_group(world, threads, peers):
    ctx = multiprocessing.get_context("fork")
    times = ctx.Array("d", 3 * world, lock=False)
    port = rpc_common.free_port()
    t0 = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, world, port, threads, peers, times))
             for r in range(world)]
    for p in procs:
        p.start()
    failed = 0
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            failed += 1
            if p.exitcode is None:
                p.kill()
                p.join()
    wall = time.monotonic() - t0
    worst = [max(times[3 * r + k] for r in range(world)) for k in range(3)]
    return {"world": world, "ok": failed == 0, "init_s": worst[0], "all_to_all_s": worst[1],
            "shutdown_s": worst[2], "wall_s": wall, "failed_workers": failed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="64,128,256")
    ap.add_argument("--sim", default="", help="ignored (the C benchmark's store simulation)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stagger-ms", type=int, default=0, help="ignored")
    ap.add_argument("--peers", type=int, default=0,
                    help="calls per worker: the K ranks after its own (0: every other worker)")
    ap.add_argument("--inline", action="store_true",
                    help="ignored (tdist's TD_RPC_INLINE; PyTorch runs every handler on its pool)")
    args = ap.parse_args()
    results = []
    for w in [int(x) for x in args.worlds.split(",") if x]:
        r = run_group(w, args.threads, args.peers)
        print("rpc_scale.py: %d processes: init %.2f s, round %.2f s, shutdown %.2f s, "
              "%.2f s from the first fork to the last exit%s" % (
                  w, r["init_s"], r["all_to_all_s"], r["shutdown_s"], r["wall_s"],
                  "" if r["ok"] else " (FAILED)"), file=sys.stderr, flush=True)
        results.append(r)
    print(json.dumps({"bench": "rpc_scale",
                      "config": {"threads": args.threads, "cpus": os.cpu_count(),
                                 "peers": args.peers, "inline": False,
                                 "peer": "torch.distributed.rpc (TensorPipe)"},
                      "results": {"processes": results, "store_sim": []}}))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
