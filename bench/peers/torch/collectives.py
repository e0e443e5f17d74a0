#!/usr/bin/python3
"""collectives.py - PyTorch peer of bench/collectives.c: torch.distributed collectives (gloo).

For each process count P (--nprocs, default 2,4) this process spawns P workers that join one
gloo process group on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), and runs the same loop as the C
benchmark for each operation and size: warm-up calls; rank 0 times 3 calls and broadcasts an
iteration count that fills about --min-time-ms; barrier; the timed calls back to back; the
maximum over members of the mean time per call is time_us. `bytes` is the whole buffer as in
nccl-tests (all_gather: the output; reduce_scatter: the input); float32, sum, broadcast root 0.
algbw_GBps = bytes / time; busbw_GBps = algbw * (all_reduce 2(P-1)/P, all_gather and
reduce_scatter (P-1)/P, broadcast 1).

Gloo in PyTorch 1.13 has no all_gather_into_tensor (_allgather_base) and no reduce_scatter at
all: all_gather uses the list form (P output tensors), and reduce_scatter entries carry
"unsupported": true with null figures.

Prints one JSON line:
{"bench": "collectives", "config": {...}, "results": {"runs": [{"op", "nprocs", "bytes",
 "time_us", "algbw_GBps", "busbw_GBps", "iters", "algo"}, ...]}}

Run with /usr/bin/python3 (the interpreter that has torch).
"""
import argparse
import json
import multiprocessing
import os
import socket
import sys
import time

OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]


def pin_environment():
    changed = False
    for k, v in (("OPENBLAS_NUM_THREADS", "1"), ("GLOO_SOCKET_IFNAME", "lo")):
        if os.environ.get(k) is None:
            os.environ[k] = v
            changed = True
    if changed:
        os.execv(sys.executable, [sys.executable] + sys.argv)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bus_factor(op, p):
    if op == "all_reduce":
        return 2.0 * (p - 1) / p
    if op == "broadcast":
        return 1.0
    return (p - 1) / p


def measure(dist, torch, args, op, nbytes, p):
    count = nbytes // 4
    part = count // p if op in ("all_gather", "reduce_scatter") else count
    a = torch.ones(part, dtype=torch.float32)
    outs = [torch.ones(part, dtype=torch.float32) for _ in range(p)] if op == "all_gather" else None
    if op == "all_reduce":
        call = lambda: dist.all_reduce(a)  # noqa: E731
    elif op == "broadcast":
        call = lambda: dist.broadcast(a, 0)  # noqa: E731
    else:
        call = lambda: dist.all_gather(outs, a)  # noqa: E731
    for _ in range(args.warmup):
        call()
    dist.barrier()
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(3):
        call()
    est = max((clock() - t0) * 1e-9 / 3, 1e-9)
    it = torch.tensor([float(min(max(int(args.min_time_ms * 1e-3 / est), 3), args.max_iters))],
                      dtype=torch.float64)
    dist.broadcast(it, 0)
    iters = int(it.item())
    dist.barrier()
    t0 = clock()
    for _ in range(iters):
        call()
    mine = torch.tensor([(clock() - t0) * 1e-3 / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {"op": op, "nprocs": p, "bytes": part * (p if op == "all_gather" else 1) * 4,
            "time_us": mine.item(), "iters": iters, "algo": "gloo"}


def worker(rank, p, port, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=p)
    out = []
    for op in args.ops:
        for nbytes in args.sizes:
            if op == "reduce_scatter":
                out.append({"op": op, "nprocs": p, "bytes": nbytes // 4 // p * p * 4,
                            "time_us": None, "algbw_GBps": None, "busbw_GBps": None,
                            "iters": 0, "algo": "gloo", "unsupported": True})
                continue
            r = measure(dist, torch, args, op, nbytes, p)
            alg = r["bytes"] / (r["time_us"] * 1e3)
            r["algbw_GBps"] = alg
            r["busbw_GBps"] = alg * bus_factor(op, p)
            out.append(r)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def run_world(args, p):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, p, port, args, queue)) for r in range(p)]
    for pr in procs:
        pr.start()
    runs = queue.get(timeout=1800)
    bad = 0
    for pr in procs:
        pr.join(120)
        if pr.is_alive():
            pr.kill()
            pr.join()
        bad += pr.exitcode != 0
    return runs, bad


def int_list(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nprocs", type=int_list, default=[2, 4])
    ap.add_argument("--sizes", type=int_list, default=[4096, 1 << 20, 16 << 20, 64 << 20])
    ap.add_argument("--ops", type=lambda s: s.split(","), default=OPS)
    ap.add_argument("--min-time-ms", type=int, default=200)
    ap.add_argument("--max-iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if any(op not in OPS for op in args.ops):
        ap.error("ops: " + ",".join(OPS))

    import torch

    runs, bad = [], 0
    for p in args.nprocs:
        print("collectives.py: %d processes" % p, file=sys.stderr, flush=True)
        r, b = run_world(args, p)
        runs += r
        bad += b
    config = {"impl": "torch.distributed", "backend": "gloo", "torch": torch.__version__,
              "dtype": "float32", "reduce_op": "sum", "broadcast_root": 0,
              "nprocs": args.nprocs, "sizes": args.sizes, "min_time_ms": args.min_time_ms,
              "max_iters": args.max_iters, "warmup": args.warmup,
              "all_gather_form": "list", "host_cpus": os.cpu_count()}
    print(json.dumps({"bench": "collectives", "config": config, "results": {"runs": runs}}),
          flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    pin_environment()
    sys.exit(main())
