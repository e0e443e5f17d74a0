#!/usr/bin/python3
"""pipeline_split.py - PyTorch peer of examples/pipeline_split.c.

Same program with torch.distributed.rpc (TensorPipe on 127.0.0.1): rank 0 "master" holds the data
and drives; rank 1 "worker1" holds Linear(784, 1024) + ReLU and rank 2 "worker2" holds
Linear(1024, 512) + ReLU + Linear(512, 10), each a Stage object created with rpc.remote. A batch
goes through the stages as micro-batches, as in PyTorch's "distributed pipeline parallelism with
RPC" tutorial: for every chunk of x.chunk(m) the master issues, without waiting,

    y_rref = stage1.remote().forward(chunk)       # worker1's output stays on worker1
    z_fut  = stage2.rpc_async().forward(y_rref)   # worker2 fetches it by RRef (to_here)

and concatenates the futures' logits, so worker2 works on micro-batch i while worker1 works on
micro-batch i+1; activations never pass through the master. (Each Stage serialises its forward
with a lock, as the tutorial's shards do.)

First the master measures samples/s of a training pass (pipelined forward, loss,
dist_autograd.backward; no update) with 1, 2, 4 and 8 micro-batches on --bench-batches repeats of
one batch of --bench-batch-size (the first samples of the training set), in --bench-rounds rounds
that cycle through the four counts; then it trains for --epochs with a DistributedOptimizer (SGD,
momentum) over both stages' parameters using --micro-batches, the learning rate on a cosine from
--lr to 0 over the run, set every 25 batches on each owner's optimizer (the C example's
td_dist_optimizer_set_lr; DistributedOptimizer has no call for that, see param_server.set_lr), and evaluates
on the test set.

Prints one JSON line with the C example's keys: {"bench": "pipeline_split", "config": {...},
"results": {"test_accuracy", "samples_per_s", "wall_s", "runs": [{"micro_batches",
"samples_per_s"}], "speedup_4_vs_1", "first_train_loss" (= "first_loss"), "final_train_loss"
(= "last_loss"), "train_s"}}.
torch.set_num_threads(1) and OPENBLAS_NUM_THREADS=1 in every process. Run with /usr/bin/python3
(the interpreter with torch).
"""
import argparse
import json
import math
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rpc_common  # noqa: E402

if __name__ == "__main__":
    rpc_common.pin_environment()

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.optim import DistributedOptimizer  # noqa: E402

from param_server import load_split, set_lr  # noqa: E402  (same IDX reader, same rate change)

NAMES = ["master", "worker1", "worker2"]


class Stage:
    """One pipeline stage, living on its worker: "body" = Linear(784, 1024), ReLU; "head" =
    Linear(1024, 512), ReLU, Linear(512, 10): about the same cost in a training pass (1.61M and
    1.58M multiply-adds per sample, forward and backward)."""

    def __init__(self, part, seed):
        torch.manual_seed(seed)
        if part == "body":
            self.net = nn.Sequential(nn.Linear(784, 1024), nn.ReLU())
        else:
            self.net = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
        self.lock = threading.Lock()

    def forward(self, x):
        if not isinstance(x, torch.Tensor):  # an RRef to the previous stage's output
            x = x.to_here()
        with self.lock:
            return self.net(x)

    def train(self, mode):
        self.net.train(mode)

    def parameter_rrefs(self):
        return [rpc.RRef(p) for p in self.net.parameters()]


def pipeline_forward(stages, x, m):
    outs = []
    for xi in x.chunk(m):
        y_rref = stages[0].remote().forward(xi)
        outs.append(stages[1].rpc_async().forward(y_rref))
    return torch.cat(torch.futures.wait_all(outs))


def step(stages, opt, x, y, m):
    with dist_autograd.context() as ctx:
        loss = F.cross_entropy(pipeline_forward(stages, x, m), y)
        dist_autograd.backward(ctx, [loss])
        if opt is not None:
            opt.step(ctx)
    return loss.item()


def evaluate(stages, x, y, m):
    for s in stages:
        s.rpc_sync().train(False)
    correct = 0
    for i in range(0, len(x), 1000):
        correct += (pipeline_forward(stages, x[i:i + 1000], m).argmax(1) ==
                    y[i:i + 1000]).sum().item()
    for s in stages:
        s.rpc_sync().train(True)
    return correct / len(x)


def run_master(args, t_start):
    x, y = load_split(args.data_dir, True, True)
    xt, yt = load_split(args.data_dir, False, True)
    stages = [rpc.remote("worker1", Stage, args=("body", args.seed)),
              rpc.remote("worker2", Stage, args=("head", args.seed + 1))]
    print(f"pipeline_split (torch): stage 0 on worker1, stage 1 on worker2, {len(x)} train / "
          f"{len(xt)} test", file=sys.stderr, flush=True)

    runs = []
    load_at_start = os.getloadavg()[0]
    if args.bench_batches > 0:
        bx, by = x[:args.bench_batch_size], y[:args.bench_batch_size]
        step(stages, None, bx, by, 1)  # warm-up
        counts, secs = (1, 2, 4, 8), [0.0] * 4
        for r in range(args.bench_rounds):
            nr = (args.bench_batches * (r + 1) // args.bench_rounds -
                  args.bench_batches * r // args.bench_rounds)
            for i, m in enumerate(counts):
                t0 = time.perf_counter()
                for _ in range(nr):
                    step(stages, None, bx, by, m)
                secs[i] += time.perf_counter() - t0
        for m, t in zip(counts, secs):
            sps = args.bench_batches * len(bx) / t
            print(f"micro-batches {m}: {sps:.0f} samples/s", file=sys.stderr, flush=True)
            runs.append({"micro_batches": m, "samples_per_s": sps})

    prefs = stages[0].rpc_sync().parameter_rrefs() + stages[1].rpc_sync().parameter_rrefs()
    opt = DistributedOptimizer(torch.optim.SGD, prefs, lr=args.lr, momentum=args.momentum)
    nb = (len(x) + args.batch_size - 1) // args.batch_size
    if 0 < args.max_batches < nb:
        nb = args.max_batches
    w = (nb + 1) // 2 if nb < 20 else 10
    train_s, acc, samples = 0.0, 0.0, 0
    first_loss, last_loss = float("nan"), float("nan")
    for epoch in range(args.epochs):
        g = torch.Generator()
        g.manual_seed(args.seed * 1000003 + epoch)
        order = torch.randperm(len(x), generator=g)
        losses = []
        t0 = time.perf_counter()
        for b in range(nb):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            if b % 25 == 0:  # cosine decay of the learning rate over the whole run
                prog = (epoch * nb + b) / (args.epochs * nb)
                set_lr(opt, args.lr * 0.5 * (1 + math.cos(math.pi * prog)))
            lv = step(stages, opt, x[idx], y[idx], args.micro_batches)
            if not math.isfinite(lv):
                sys.exit(f"loss became {lv} at batch {b}")
            losses.append(lv)
            samples += len(idx)
            if b % 100 == 0 or b + 1 == nb:
                print(f"epoch {epoch + 1}/{args.epochs} batch {b + 1}/{nb} loss "
                      f"{sum(losses) / len(losses):.4f}", file=sys.stderr, flush=True)
        train_s += time.perf_counter() - t0
        if epoch == 0:
            first_loss = sum(losses[:w]) / len(losses[:w]) if losses else float("nan")
        last_loss = sum(losses[-w:]) / len(losses[-w:]) if losses else float("nan")
        acc = evaluate(stages, xt, yt, args.micro_batches)
        print(f"epoch {epoch + 1}: test accuracy {acc:.4f}", file=sys.stderr, flush=True)

    config = {"world_size": 3, "epochs": args.epochs, "batch_size": args.batch_size,
              "micro_batches": args.micro_batches, "lr": args.lr, "momentum": args.momentum,
              "max_batches": args.max_batches, "bench_batches": args.bench_batches,
              "bench_batch_size": args.bench_batch_size, "bench_rounds": args.bench_rounds,
              "threads": rpc_common.blas_threads(),
              "torch_num_threads": torch.get_num_threads(), "torch": torch.__version__,
              "cpus": os.cpu_count(), "load_avg_1m_at_start": load_at_start,
              "transport": "tensorpipe", "tensorpipe_transports": args.transports}
    results = {"test_accuracy": acc,
               "samples_per_s": samples / train_s if train_s > 0 else 0.0,
               "wall_s": time.perf_counter() - t_start,
               "runs": runs,
               "speedup_4_vs_1": runs[2]["samples_per_s"] / runs[0]["samples_per_s"] if runs
               else None,
               "first_train_loss": first_loss,
               "final_train_loss": last_loss,
               "first_loss": first_loss,
               "last_loss": last_loss,
               "train_s": train_s}
    del opt, prefs, stages
    return {"bench": "pipeline_split", "config": config, "results": results}


def worker(rank, port, args, t_start, q):
    torch.set_num_threads(1)
    kw = {"_transports": args.transports.split(",")} if args.transports else {}
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=16, rpc_timeout=600, **kw)
    rpc.init_rpc(NAMES[rank], rank=rank, world_size=3, rpc_backend_options=opts)
    out = run_master(args, t_start) if rank == 0 else None
    rpc.shutdown()  # workers wait here until the master is done
    if out is not None:
        q.put(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-batches", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--bench-batches", type=int, default=20)
    ap.add_argument("--bench-batch-size", type=int, default=1024)
    ap.add_argument("--bench-rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transports", default=None,
                    help="comma-separated TensorPipe transports, e.g. uv for TCP only (default: "
                         "PyTorch's choice; only the peer has this option)")
    ap.add_argument("--data-dir", default=os.environ.get("TD_DATA_DIR") or
                    "/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()
    if args.micro_batches < 1:
        ap.error("--micro-batches must be >= 1")
    if args.bench_rounds < 1:
        ap.error("--bench-rounds must be >= 1")
    args.bench_rounds = min(args.bench_rounds, max(1, args.bench_batches))
    t_start = time.perf_counter()
    port = rpc_common.free_port()
    out = rpc_common.run_spawned(worker, [(r, port, args, t_start) for r in range(3)])
    out["results"]["wall_s"] = time.perf_counter() - t_start
    for k in ("test_accuracy", "samples_per_s", "wall_s", "runs"):
        out[k] = out["results"][k]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
