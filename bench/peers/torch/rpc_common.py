"""rpc_common.py - shared parts of the PyTorch RPC peers (rpc_latency, rpc_throughput,
rpc_bandwidth): two workers on 127.0.0.1 with torch.distributed.rpc over TensorPipe.

start() picks a free port (binding 127.0.0.1:0), spawns rank 1 (which joins and then waits in
rpc.shutdown() until rank 0 is done, as PyTorch programs do) and joins as rank 0 in this process;
finish() shuts rank 0 down gracefully and joins rank 1. Both ranks call torch.set_num_threads(1);
OPENBLAS_NUM_THREADS is pinned to 1 by re-executing the script when it is unset. TensorPipe's
socket transport is bound to the loopback interface (TP_SOCKET_IFNAME=lo unless already set).

Common options: --threads N (num_worker_threads, default 16 = TensorPipe's default) and
--transports LIST (TensorPipe transports, e.g. "uv" for TCP only; default: PyTorch's choice).
"""
import multiprocessing
import os
import socket
import sys


def pin_environment():
    """Re-executes the script with OPENBLAS_NUM_THREADS=1 when it is unset (BLAS ignores
    torch.set_num_threads in Debian's build) and binds TensorPipe to the loopback interface."""
    changed = False
    if os.environ.get("OPENBLAS_NUM_THREADS") is None:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        changed = True
    if os.environ.get("TP_SOCKET_IFNAME") is None:
        os.environ["TP_SOCKET_IFNAME"] = "lo"
        changed = True
    if changed:
        os.execv(sys.executable, [sys.executable] + sys.argv)


def add_common_args(ap):
    ap.add_argument("--threads", type=int, default=16,
                    help="num_worker_threads of both agents (default 16)")
    ap.add_argument("--transports", default=None,
                    help="comma-separated TensorPipe transports (default: PyTorch's choice)")


def blas_threads():
    v = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return int(v) if v.isdigit() else None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def echo(x):
    """The function every peer calls remotely: returns its argument."""
    return x


def quantile(sorted_xs, q):
    """Linear interpolation between closest ranks (numpy's default, as in the C benchmarks)."""
    n = len(sorted_xs)
    if n == 0:
        return 0.0
    pos = q * (n - 1)
    i = int(pos)
    if i + 1 >= n:
        return sorted_xs[-1]
    return sorted_xs[i] + (sorted_xs[i + 1] - sorted_xs[i]) * (pos - i)


def _options(port, threads, transports):
    import torch.distributed.rpc as rpc

    kw = {}
    if transports:
        kw["_transports"] = transports.split(",")
    return rpc.TensorPipeRpcBackendOptions(
        init_method="tcp://127.0.0.1:%d" % port, num_worker_threads=threads, **kw
    )


def _init(rank, port, threads, transports):
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    rpc.init_rpc("worker%d" % rank, rank=rank, world_size=2,
                 rpc_backend_options=_options(port, threads, transports))


def _rank1_main(port, threads, transports):
    import torch.distributed.rpc as rpc

    _init(1, port, threads, transports)
    rpc.shutdown()  # graceful: returns once rank 0 has finished and shut down too


class Pair:
    """Rank 0 in this process, rank 1 in a spawned child."""

    def __init__(self, threads, transports):
        self.threads = threads
        self.transports = transports
        self.port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self.child = ctx.Process(target=_rank1_main, args=(self.port, threads, transports),
                                 daemon=True)
        self.child.start()
        _init(0, self.port, threads, transports)

    def finish(self):
        import torch.distributed.rpc as rpc

        rpc.shutdown()
        self.child.join(60)
        if self.child.is_alive():
            self.child.kill()
            self.child.join()
            return 1
        return 0 if self.child.exitcode == 0 else 1

    def config(self):
        import torch

        return {
            "impl": "torch " + torch.__version__,
            "transport": "tensorpipe",
            "tensorpipe_transports": self.transports.split(",") if self.transports else None,
            "tp_socket_ifname": os.environ.get("TP_SOCKET_IFNAME"),
            "world_size": 2,
            "threads": self.threads,
            "torch_num_threads": torch.get_num_threads(),
            "openblas_num_threads": blas_threads(),
        }


def run_spawned(target, args_per_rank):
    """Starts one spawned process per entry of args_per_rank running target(*args, q), where q
    is a queue rank 0 puts its result dict into; returns that dict once every process exited
    cleanly, or exits with status 1 as soon as one failed (killing the others)."""
    import time
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=tuple(a) + (q,)) for a in args_per_rank]
    for p in procs:
        p.start()
    out = None
    while out is None:
        try:
            out = q.get(timeout=1)
        except Exception:  # queue.Empty: give up when a process died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(1)
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(1)
    return out
