#!/usr/bin/python3
"""param_server.py - PyTorch peer of examples/param_server.c.

Same training as the C example: rank 0 is the parameter server holding the model (MLP 784-256-10,
or --model cnn) behind an RRef and evaluating it on the test set after every epoch; ranks 1..N-1
(--nproc, default 3) are trainers, each on its own shard of Fashion-MNIST (shuffled per epoch,
even shards, batch 32 per trainer as in the C example), running concurrently:

    with dist_autograd.context() as ctx:
        logits = rpc_sync(server, forward, (model_rref, x))  # on the server (see forward())
        loss = cross_entropy(logits, y)               # on the trainer
        dist_autograd.backward(ctx, [loss])
        opt.step(ctx)                     # DistributedOptimizer(SGD, Nesterov momentum 0.9)

with the learning rate (--lr 0.02) on a cosine to 0 over the run, changed every --lr-every batches
(at the middle of that stretch) on the trainer's one optimizer, as the C example does with
td_dist_optimizer_set_lr: DistributedOptimizer has no call for that, so set_lr() below asks each
owner to put a copy of its TorchScript functional SGD with the new rate in place (the copy shares
the momentum buffers; making a new DistributedOptimizer instead would restart the momentum).
Trainers meet at the start and the end of every epoch in an @rpc.functions.async_execution
barrier on the server, which evaluates before answering.
TensorPipe on 127.0.0.1, torch.set_num_threads(1) and OPENBLAS_NUM_THREADS=1 in every process.

Prints one JSON line with the C example's keys: {"bench": "param_server", "config": {...},
"results": {"test_accuracy", "samples_per_s", "wall_s", "epochs", "epoch_wall_s", "first_loss",
"last_loss", "epoch_test_accuracy", ...}}. Run with /usr/bin/python3 (the interpreter with torch).
"""
import argparse
import gzip
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.optim import DistributedOptimizer  # noqa: E402

MEAN, STD = 0.2860, 0.3530
LOSS_WINDOW = 5


def load_idx(path):
    if not os.path.exists(path):
        path = path[:-3]
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_split(data_dir, train, flatten):
    p = "train" if train else "t10k"
    x = load_idx(os.path.join(data_dir, f"{p}-images-idx3-ubyte.gz"))
    y = load_idx(os.path.join(data_dir, f"{p}-labels-idx1-ubyte.gz"))
    x = (torch.from_numpy(x.astype(np.float32)) / 255.0 - MEAN) / STD
    x = x.reshape(len(x), 784) if flatten else x.reshape(len(x), 1, 28, 28)
    return x, torch.from_numpy(y.astype(np.int64))


def make_model(kind, seed):
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 10))


# ---- the server (rank 0) ----

class Server:
    def __init__(self, args, trainers):
        self.args = args
        self.trainers = trainers
        self.model = make_model(args.model, args.seed)
        self.lock = threading.Lock()
        self.slots = {}  # slot -> dict(arrived, stats..., fut)
        self.cv = threading.Condition(self.lock)


SERVER = None


def get_model_rref():
    return rpc.RRef(SERVER.model)


def param_rrefs(model_rref):
    return [rpc.RRef(p) for p in model_rref.local_value().parameters()]


def _set_lr(local_optim_rref, lr):
    """On the owner: DistributedOptimizer's local optimizer is a TorchScript module around a
    functional SGD whose Python view (.optim) is a copy; the copy with the new rate is put back
    with setattr. The copy shares the momentum buffers (tensors), so momentum carries on."""
    m = local_optim_rref.local_value()
    o = m.optim
    o.defaults["lr"] = lr
    m.setattr("optim", o)


def set_lr(opt, lr):
    """Sets the rate of every owner's optimizer of opt; returns once all have it."""
    torch.futures.wait_all([rpc.rpc_async(r.owner(), _set_lr, args=(r, lr))
                            for r in opt.remote_optimizers])


def forward(model_rref, x):
    """model(x) on the server with the parameters cloned inside the graph: concurrent trainers
    step the parameters in place, and autograd's version check would otherwise fail a backward
    whose forward saved a parameter that another trainer's step has changed since ("modified by
    an inplace operation"). The clones carry the gradients back to the parameters."""
    p = [v.clone() for v in model_rref.local_value().parameters()]
    if len(p) == 4:  # the MLP (functional: swapping module parameters is not thread-safe)
        return F.linear(F.relu(F.linear(x, p[0], p[1])), p[2], p[3])
    h = F.max_pool2d(F.relu(F.conv2d(x, p[0], p[1], padding=1)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, p[2], p[3], padding=1)), 2)
    return F.linear(h.flatten(1), p[4], p[5])


@rpc.functions.async_execution
def sync(slot, loss_sum, batches, samples, train_s, first, last):
    s = SERVER
    with s.cv:
        e = s.slots.setdefault(slot, dict(arrived=0, loss_sum=0.0, batches=0, samples=0,
                                          max_train_s=0.0, first=0.0, last=0.0,
                                          fut=torch.futures.Future()))
        e["arrived"] += 1
        e["loss_sum"] += loss_sum
        e["batches"] += batches
        e["samples"] += samples
        e["first"] += first
        e["last"] += last
        e["max_train_s"] = max(e["max_train_s"], train_s)
        s.cv.notify_all()
        return e["fut"]


def evaluate(model, x, y):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 500):
            correct += (model(x[i:i + 500]).argmax(1) == y[i:i + 500]).sum().item()
    model.train()
    return correct / len(x)


def run_server(args, trainers, t_start):
    s = SERVER
    xt, yt = load_split(args.data_dir, False, args.model == "mlp")

    def wait(slot):
        with s.cv:
            s.cv.wait_for(lambda: slot in s.slots and s.slots[slot]["arrived"] == trainers)
            return s.slots[slot]

    wait(0)["fut"].set_result(0.0)
    accs, times, losses = [], [], []
    acc, train_s, samples, first, last = 0.0, 0.0, 0, float("nan"), float("nan")
    for e in range(args.epochs):
        st = wait(e + 1)
        if e == 0:
            first = st["first"] / trainers
        last = st["last"] / trainers
        train_s += st["max_train_s"]
        samples += st["samples"]
        acc = evaluate(s.model, xt, yt)
        mean_loss = st["loss_sum"] / max(1, st["batches"])
        print(f"epoch {e + 1}: train loss {mean_loss:.4f}, test accuracy {acc:.4f} "
              f"(epoch {st['max_train_s']:.2f}s)", file=sys.stderr, flush=True)
        accs.append(acc)
        times.append(st["max_train_s"])
        losses.append(mean_loss)
        st["fut"].set_result(acc)
    if args.epochs == 0:
        acc = evaluate(s.model, xt, yt)
    results = {
        "test_accuracy": acc,
        "samples_per_s": samples / train_s if train_s > 0 else 0.0,
        "wall_s": time.perf_counter() - t_start,
        "epochs": args.epochs,
        "epoch_wall_s": train_s / args.epochs if args.epochs else 0.0,
        "train_s": train_s,
        "first_loss": first,
        "last_loss": last,
        "epoch_test_accuracy": accs,
        "epoch_train_loss": losses,
        "epoch_wall_s_list": times,
    }
    config = {"model": args.model, "trainers": trainers, "epochs": args.epochs,
              "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
              "nesterov": bool(args.nesterov),
              "schedule": args.schedule, "lr_every": args.lr_every, "seed": args.seed,
              "max_batches": args.max_batches, "threads": rpc_common.blas_threads(),
              "torch": torch.__version__}
    out = {"bench": "param_server", "config": config, "results": results}
    for k in ("test_accuracy", "samples_per_s", "epochs", "wall_s", "epoch_wall_s"):
        out[k] = results[k]
    return out


# ---- trainers ----

def run_trainer(args, rank, trainers):
    tid = rank - 1
    x, y = load_split(args.data_dir, True, args.model == "mlp")
    model_rref = rpc.rpc_sync("worker0", get_model_rref)
    prefs = rpc.rpc_sync("worker0", param_rrefs, args=(model_rref,))
    n = len(x) - len(x) % trainers
    shard = n // trainers
    nb = (shard + args.batch_size - 1) // args.batch_size
    if 0 < args.max_batches < nb:
        nb = args.max_batches
    # one optimizer for the whole run (momentum buffers on the server); set_lr changes its rate
    opt = DistributedOptimizer(torch.optim.SGD, prefs, lr=args.lr, momentum=args.momentum,
                               nesterov=bool(args.nesterov))
    rpc.rpc_sync("worker0", sync, args=(0, 0.0, 0, 0, 0.0, 0.0, 0.0), timeout=0)
    first = float("nan")
    for epoch in range(args.epochs):
        g = torch.Generator()
        g.manual_seed(args.seed * 1000003 + epoch)
        order = torch.randperm(len(x), generator=g)[:n][tid::trainers]
        losses = []
        samples = 0
        t0 = time.perf_counter()
        for b in range(nb):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            if args.schedule == "cosine" and b % args.lr_every == 0:
                # the rate at the middle of this stretch of lr_every batches (cut at the epoch's end)
                mid = epoch * nb + 0.5 * (b + min(b + args.lr_every, nb))
                set_lr(opt, args.lr * 0.5 * (1 + math.cos(math.pi * mid / (args.epochs * nb))))
            with dist_autograd.context() as ctx:
                logits = rpc.rpc_sync("worker0", forward, args=(model_rref, x[idx]))
                loss = F.cross_entropy(logits, y[idx])
                dist_autograd.backward(ctx, [loss])
                opt.step(ctx)
            losses.append(loss.item())
            samples += len(idx)
        et = time.perf_counter() - t0
        w = min(LOSS_WINDOW, len(losses))
        if epoch == 0:
            first = sum(losses[:w]) / w if w else float("nan")
        last = sum(losses[-w:]) / w if w else float("nan")
        acc = rpc.rpc_sync("worker0", sync, args=(epoch + 1, sum(losses), len(losses),
                                                  samples, et, first,
                                                  last), timeout=0)
        if tid == 0:
            print(f"trainer 1: epoch {epoch + 1} done in {et:.2f}s, test accuracy {acc:.4f}",
                  file=sys.stderr, flush=True)


def worker(rank, world, port, args, t_start, q):
    global SERVER
    torch.set_num_threads(1)
    if rank == 0:
        SERVER = Server(args, world - 1)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           num_worker_threads=16, rpc_timeout=600)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out = None
    if rank == 0:
        out = run_server(args, world - 1, t_start)
    else:
        run_trainer(args, rank, world - 1)
    rpc.shutdown()
    if out is not None:
        q.put(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-batches", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32, help="per trainer (default 32)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", type=int, default=1, choices=[0, 1])
    ap.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    ap.add_argument("--lr-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--data-dir", default=os.environ.get("TD_DATA_DIR") or
                    "/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()
    t_start = time.perf_counter()
    port = rpc_common.free_port()
    out = rpc_common.run_spawned(worker, [(r, args.nproc, port, args, t_start)
                                          for r in range(args.nproc)])
    out["results"]["wall_s"] = time.perf_counter() - t_start
    out["wall_s"] = out["results"]["wall_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
