"""py_worker.py - the Python worker of the binding's tests: joins the group from the environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TD_RPC_SECRET) as "py<rank>", serves the functions
below until every worker called shutdown, and exits 0 (1 on any failure).

Options: --host (host-driven progress under an asyncio loop, tdist.asyncio), --tensor-type T,
--call-at-start WORKER:FN (the moment init returns, call FN() on WORKER and exit 1 unless it
returns this worker's name: handlers that run while their worker's init finishes),
--hold-rref WORKER:CLS (make an object there with remote() and still hold it at shutdown),
--register NAME (one more function only this worker serves).
"""
import argparse
import asyncio
import os
import sys
import threading
import time

import numpy as np

import tdist
import tdist.asyncio


@tdist.register
def py_echo(x):
    return x


@tdist.register
def py_add(a, b):
    return a + b


@tdist.register
def py_sleep(seconds):
    time.sleep(seconds)
    return seconds


@tdist.register
def py_fail(message):
    raise ValueError(message)


@tdist.register
def py_thread():
    """The name of the thread running this handler."""
    return threading.current_thread().name


@tdist.register
def py_call(to, fn, args):
    """A blocking nested call from inside a handler."""
    return tdist.rpc_sync(to, fn, tuple(args))


@tdist.register
def py_call_async(to, fn, args):
    """A nested call whose future becomes the reply (no thread waits)."""
    return tdist.rpc_async(to, fn, tuple(args)).then(lambda f: f.value())


@tdist.register
def py_describe(t):
    """[dtype name, shape, sum as float] of a received tensor (numpy or torch)."""
    name = str(t.dtype).replace("torch.", "")
    if isinstance(t, np.ndarray):
        return [name, list(t.shape), float(t.astype(np.float64).sum())]
    return [name, list(t.shape), float(t.double().sum())]


@tdist.register
def py_to_here(rref):
    return rref.to_here()


@tdist.register
def py_caller():
    c = tdist.current_caller()
    return [c.name, c.rank]


class Counter:
    """An object that stays on its owner (tests of remote() and RRef proxies)."""

    def __init__(self, start):
        self.n = start

    def incr(self, by):
        self.n += by
        return self.n

    def get(self):
        return self.n


tdist.register(Counter)
tdist.register(Counter.incr)
tdist.register(Counter.get)


async def run_host(name, tensor_type):
    await tdist.asyncio.init_rpc(name, tensor_type=tensor_type)
    await tdist.asyncio.shutdown()


@tdist.register
def py_whoami():
    """This worker's name, from the agent (tdist.get_worker_info() inside a handler)."""
    return tdist.get_worker_info().name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--tensor-type", default="auto")
    ap.add_argument("--call-at-start")
    ap.add_argument("--hold-rref")
    ap.add_argument("--register")
    a = ap.parse_args()
    if a.tensor_type == "torch":
        import torch  # noqa: F401
    if a.register:
        tdist.register(py_echo, name=a.register)
    # (RANK=-1: this worker joins a running elastic group; its default name carries the rank it
    # is given there, "worker<rank>")
    name = "py" + os.environ["RANK"] if os.environ["RANK"] != "-1" else None
    if a.host:
        asyncio.run(run_host(name, a.tensor_type))
        return 0
    tdist.init_rpc(name, tensor_type=a.tensor_type)
    held = None
    if a.call_at_start:
        to, fn = a.call_at_start.split(":")
        got = tdist.rpc_sync(to, fn, ())
        if got != to:
            print("call-at-start: %s returned %r" % (fn, got), flush=True)
            return 1
    if a.hold_rref:
        to, cls = a.hold_rref.split(":")
        held = tdist.remote(to, cls, (1,))
        held.rpc_sync().get()
    tdist.shutdown()
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
