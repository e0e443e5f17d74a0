"""torch_fns.py - functions and classes the tdist.torch_rpc tests call on other workers by
module-qualified name (every worker imports this module: the test process, and torch_worker.py
through its own import or on first call)."""
import threading
import time

import torch

import tdist
import tdist.torch_rpc as rpc


class UserError(Exception):
    """An exception class of the program's own: it crosses as itself."""


def add(a, b):
    return a + b


def two_args(a, b):
    return a, b


def describe(x):
    """What arrived: type names of nested values."""
    if isinstance(x, dict):
        return {type(k).__name__ + " " + repr(k): describe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return (type(x).__name__, [describe(v) for v in x])
    return type(x).__name__


def echo(x):
    return x


def kwargs_echo(a, b=2, *, c=3):
    return {"a": a, "b": b, "c": c}


def raise_user(msg):
    raise UserError(msg)


def raise_key(k):
    raise KeyError(k)


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def worker_name():
    return rpc.get_worker_info().name


def call_back(to, x):
    """A nested call from inside a handler, back to `to`."""
    return rpc.rpc_sync(to, add, args=(x, 1))


def make_lambda():
    return lambda x: x


def lin(x, w):
    """x @ w (autograd tests)."""
    return x @ w


def scaled_tanh(h, p):
    return torch.tanh(h) * p.sum(0)


class Holder:
    """An object that stays on its owner."""

    def __init__(self, value):
        self.value = value
        self.lock = threading.Lock()

    def get(self):
        return self.value

    def mul(self, x):
        return self.value * x


def param_rrefs(holder_rref):
    return [rpc.RRef(p) for p in holder_rref.local_value().params]


class Params:
    """Parameters owned by a worker (distributed autograd and optimizer tests)."""

    def __init__(self, seed, shape):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64))
        self.params = [self.w]

    def forward(self, x):
        return torch.tanh(x @ self.w)

    def values(self):
        return [p.detach().clone() for p in self.params]


def grads_of(cid, holder_rref):
    """This worker's gradients in context cid of the holder's parameters, in order."""
    import tdist.torch_autograd as dist_autograd
    g = dist_autograd.get_gradients(cid)
    return [g.get(p) for p in holder_rref.local_value().params]


@rpc.functions.async_execution
def async_add(to, x):
    """A reply that follows a nested call's future (no thread waits)."""
    return rpc.rpc_async(to, add, args=(x, 10)).then(lambda f: f.wait() * 2)


def base_worker_info():
    """tdist.get_worker_info() from a handler (the init race)."""
    return tdist.get_worker_info().name


def rref_sum(rref):
    """The sum of an RRef's tensor value, on its owner (RRef.backward tests)."""
    return rref.local_value().sum()
