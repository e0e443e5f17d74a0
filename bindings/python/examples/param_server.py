#!/usr/bin/python3
"""param_server.py - a C parameter server and Python trainers in one tdist group.

    PYTHONPATH=build/python bindings/python/examples/param_server.py --epochs 3

starts build/bindings/python/examples/c_param_server (rank 0, worker "ps": the model of
examples/param_server - MLP 784-256-10 with the same seeded initialisation - its SGD and the
test-set evaluation, all in C) and --nproc - 1 trainers (ranks 1..): this script in Python. A
trainer runs over its shard of Fashion-MNIST (batch 32 per trainer, as the C example's,
shuffled per epoch); for every batch it
pulls the parameters (rpc_sync "ps_get_params": tensors arrive as torch tensors without a copy),
computes the loss and its gradients with PyTorch autograd locally, and pushes the gradients
(rpc_sync "ps_push"), which the server applies with SGD, Nesterov momentum 0.9 (one set of
momentum buffers per trainer, as the C example's distributed optimizers have) and a learning
rate on a cosine from --lr (0.02) to 0 over the run. The trainers start and end every epoch
together ("ps_barrier", as the C example's trainers do), and after every epoch trainer 1 asks
the server for the test accuracy. Same recipe as the C example, whose 3 epochs with 2 trainers reach
0.881-0.886.

Output: progress on standard error; trainer 1 prints one JSON line (docs/BENCH.md):
{"bench": "param_server_py", "config": {...}, "results": {"test_accuracy", "samples_per_s",
"wall_s", "first_loss", "last_loss", "epoch_test_accuracy"}}.

Needs PyTorch (python3-torch), numpy and the Fashion-MNIST files (/usr/share/datasets/
fashion-mnist, or --data-dir / TD_DATA_DIR).
"""
import argparse
import gzip
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training pixels in [0, 1] (tdist/data.h)


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=3, help="server + trainers (default 3)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-batches", type=int, default=0, help="per trainer and epoch (0: all)")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="per trainer (default 32: with 2 trainers the server sees 64 samples "
                    "per step, as in the C example)")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--lr-every", type=int, default=50, help="batches between lr updates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--server", default=None, help="the c_param_server program")
    ap.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def data_dir(a):
    return a.data_dir or os.environ.get("TD_DATA_DIR") or "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    for p in (path + ".gz", path):
        if os.path.exists(p):
            with (gzip.open(p) if p.endswith(".gz") else open(p, "rb")) as f:
                raw = f.read()
            ndim = raw[3]
            dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
            return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)
    sys.exit("param_server.py: %s(.gz) not found (--data-dir or TD_DATA_DIR)" % path)


def find_server(a):
    if a.server:
        return a.server
    build = os.environ.get("TD_BUILD_DIR", os.path.join(HERE, "..", "..", "..", "build"))
    return os.path.join(build, "bindings", "python", "examples", "c_param_server")


def cosine_lr(a, epoch, b, nb):
    """The rate at the middle of the stretch of --lr-every batches holding batch b (cut at the
    epoch's end), on a cosine from --lr to 0 over the run (examples/param_server.c)."""
    s0 = b - b % a.lr_every
    s1 = min(s0 + a.lr_every, nb)
    mid = epoch * nb + 0.5 * (s0 + s1)
    return a.lr * 0.5 * (1 + math.cos(math.pi * mid / (a.epochs * nb)))


def train(a):
    import torch
    import torch.nn.functional as F
    import tdist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers, tid = world - 1, rank - 1
    tdist.init_rpc("trainer%d" % rank, tensor_type="torch")
    d = data_dir(a)
    images = read_idx(os.path.join(d, "train-images-idx3-ubyte"))
    labels = read_idx(os.path.join(d, "train-labels-idx1-ubyte")).astype(np.int64)
    x_all = torch.from_numpy(((images.reshape(len(images), -1) / 255.0 - MEAN) / STD)
                             .astype(np.float32))
    y_all = torch.from_numpy(labels)
    per = len(images) // trainers  # even shards: every trainer takes the same number of steps
    nb = per // a.batch_size + (per % a.batch_size > 0)
    if a.max_batches:
        nb = min(nb, a.max_batches)
    losses, accs = [], []
    t0, seen = time.perf_counter(), 0
    for epoch in range(a.epochs):
        tdist.rpc_sync("ps", "ps_barrier", timeout=0)  # every trainer starts the epoch together
        order = np.random.default_rng(a.seed * 1000 + epoch).permutation(len(images))
        mine = order[:per * trainers][tid::trainers]
        for b in range(nb):
            idx = torch.from_numpy(mine[b * a.batch_size:(b + 1) * a.batch_size])
            x, y = x_all[idx], y_all[idx]
            params = tdist.rpc_sync("ps", "ps_get_params")  # torch tensors over tdist memory
            for p in params:
                p.requires_grad_()
            w1, b1, w2, b2 = params
            loss = F.cross_entropy(F.linear(F.relu(F.linear(x, w1, b1)), w2, b2), y)
            loss.backward()
            lr = cosine_lr(a, epoch, b, nb)
            tdist.rpc_sync("ps", "ps_push", ([p.grad for p in params], lr))
            losses.append(loss.item())
            seen += len(idx)
            if rank == 1 and (b % 50 == 0 or b == nb - 1):
                print("\repoch %d: batch %d/%d loss %.4f" % (epoch, b + 1, nb, loss.item()),
                      end="", file=sys.stderr, flush=True)
        tdist.rpc_sync("ps", "ps_barrier", timeout=0)  # every trainer finished the epoch
        if rank == 1:
            accs.append(tdist.rpc_sync("ps", "ps_evaluate"))
            print("\nepoch %d: test accuracy %.4f" % (epoch, accs[-1]), file=sys.stderr)
    wall = time.perf_counter() - t0
    tdist.shutdown()
    if rank == 1:
        w = min(5, len(losses))
        print(json.dumps({
            "bench": "param_server_py",
            "config": {"trainers": trainers, "epochs": a.epochs, "batch_size": a.batch_size,
                       "lr": a.lr, "schedule": "cosine", "lr_every": a.lr_every,
                       "momentum": 0.9, "nesterov": True, "max_batches": a.max_batches,
                       "seed": a.seed, "model": "mlp", "server": "c", "trainer": "python",
                       "torch": torch.__version__},
            "results": {"test_accuracy": accs[-1] if accs else None,
                        "samples_per_s": seen * trainers / wall, "wall_s": wall,
                        "first_loss": sum(losses[:w]) / w, "last_loss": sum(losses[-w:]) / w,
                        "epoch_test_accuracy": accs}}), flush=True)
    return 0


def launch(a):
    """Starts the server and the trainers 2.., and runs trainer 1 here (after its children:
    tdist refuses fork after init_rpc, and subprocess does not fork the interpreter's state)."""
    import socket

    import tdist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(a.nproc), TD_RPC_SECRET=os.environ.get("TD_RPC_SECRET") or
               tdist.generate_secret(), OPENBLAS_NUM_THREADS=os.environ.get(
                   "OPENBLAS_NUM_THREADS", "1"))
    server = find_server(a)
    if not os.path.exists(server):
        sys.exit("param_server.py: %s not found (build the examples, or --server)" % server)
    procs = [subprocess.Popen([server, "--seed", str(a.seed)] +
                              (["--data-dir", a.data_dir] if a.data_dir else []),
                              env=dict(env, RANK="0"))]
    argv = [sys.executable, os.path.abspath(__file__), "--trainer"] + sys.argv[1:]
    for r in range(2, a.nproc):
        procs.append(subprocess.Popen(argv, env=dict(env, RANK=str(r))))
    os.environ.update(env, RANK="1")
    try:
        rc = train(a)
    finally:
        codes = [p.wait(600) for p in procs]
    return rc or max(abs(c) for c in codes)


def main():
    a = parse()
    if a.nproc < 2:
        sys.exit("param_server.py: --nproc must be >= 2 (a server and a trainer)")
    return train(a) if a.trainer else launch(a)


if __name__ == "__main__":
    sys.exit(main())
