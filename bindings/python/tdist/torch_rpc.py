"""torch_rpc.py - torch.distributed.rpc over tdist: a PyTorch RPC program runs by changing its
imports.

    import tdist.torch_rpc as rpc                      # was: import torch.distributed.rpc as rpc
    import tdist.torch_autograd as dist_autograd       # torch.distributed.autograd
    from tdist.torch_optim import DistributedOptimizer # torch.distributed.optim
    from tdist.torch_nn import RemoteModule            # torch.distributed.nn

The names, signatures, defaults and exceptions are PyTorch 1.13's: init_rpc(name, backend=None,
rank=-1, world_size=None, rpc_backend_options=None) (rank and world size from RANK / WORLD_SIZE
when not given, rank 0's store from MASTER_ADDR / MASTER_PORT or the options' init_method),
rpc_sync / rpc_async / remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT),
RRef (to_here, local_value, owner, proxies rpc_sync() / rpc_async() / remote() calling the
value's methods by name), get_worker_info, get_rpc_timeout, shutdown(graceful=True, timeout=0),
functions.async_execution, TensorPipeRpcBackendOptions, BackendType. rpc_async returns a
torch.futures.Future, so torch.futures.wait_all / collect_all and then() work as in PyTorch.

What differs, and why (tdist/_torch_compat.py has the details):
- Only data travels, never pickles: functions and classes go by their module-qualified names
  (the receiver imports the module, as unpickling would); lambdas, nested functions, bound
  methods and objects that are not data (an nn.Module, an optimizer, a user class's instance)
  cannot be sent - send their data (state_dict()) or keep them behind an RRef. The TypeError
  says which object and why.
- Only CPU tensors travel in this module (device maps are refused at init_rpc).
- Workers authenticate with a job secret: a program that spawns its workers gets one made at
  import (inherited by its children); workers started separately need the same TD_RPC_SECRET
  (tdistrun gives one), or TD_RPC_INSECURE=1.
- A function may also be given by its registered name (a string): that calls tdist's registered
  functions, C workers' included, with positional arguments.
Remote exceptions keep their type where the caller has it (user classes too), with the remote
worker and traceback in the message; what PyTorch raises as RuntimeError (timeouts, unknown
workers, dead peers) derives from RuntimeError here.
"""
import enum
import os

import torch

from . import _timeouts, errors, rpc as _rpc
from . import _torch_compat as _c
from ._lib import check, ffi, lib
from .futures import wait_ptr
from .rref import RRef as _BaseRRef

UNSET_RPC_TIMEOUT = -1.0  # torch.distributed.rpc.constants.UNSET_RPC_TIMEOUT
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
DEFAULT_RPC_TIMEOUT_SEC = 60.0
WorkerInfo = _c.WorkerInfo
RemoteError = errors.RemoteError


class BackendType(enum.Enum):
    """torch.distributed.rpc.BackendType: tdist has one backend; TENSORPIPE names it."""

    TENSORPIPE = "TENSORPIPE"


class TensorPipeRpcBackendOptions:
    """torch.distributed.rpc.TensorPipeRpcBackendOptions: num_worker_threads (tdist's handler
    threads), rpc_timeout (seconds, the default of every call), init_method ("env://" or
    "tcp://host:port"). Device maps and devices are refused at init_rpc (CPU tensors only)."""

    def __init__(self, *, num_worker_threads=16, rpc_timeout=DEFAULT_RPC_TIMEOUT_SEC,
                 init_method="env://", device_maps=None, devices=None, _transports=None,
                 _channels=None):
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.device_maps = dict(device_maps or {})
        self.devices = list(devices or [])

    def set_device_map(self, to, device_map):
        self.device_maps[to] = dict(device_map)

    def set_devices(self, devices):
        self.devices = list(devices)


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def init_rpc(name, backend=None, rank=-1, world_size=None, rpc_backend_options=None):
    """Joins the group as worker `name` (PyTorch's signature). rank -1 / world_size None: from
    RANK / WORLD_SIZE. Rank 0's store: the options' init_method, default "env://"
    (MASTER_ADDR / MASTER_PORT)."""
    if backend is not None and getattr(backend, "name", str(backend)) not in (
            "TENSORPIPE", "BackendType.TENSORPIPE"):
        raise ValueError("tdist.torch_rpc: backend %r is not supported (tdist has one backend; "
                         "leave backend=None or BackendType.TENSORPIPE)" % (backend,))
    o = rpc_backend_options
    if o is not None and (getattr(o, "device_maps", None) or getattr(o, "devices", None)):
        raise ValueError("tdist.torch_rpc: device maps and devices are not supported: only CPU "
                         "tensors travel through this module (move tensors with .cpu())")
    if rank is None or rank < 0:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        raise ValueError("tdist.torch_rpc.init_rpc: give rank and world_size, or set RANK and "
                         "WORLD_SIZE in the environment")
    timeout = getattr(o, "rpc_timeout", DEFAULT_RPC_TIMEOUT_SEC) if o is not None else \
        DEFAULT_RPC_TIMEOUT_SEC
    threads = getattr(o, "num_worker_threads", 16) if o is not None else 16
    method = getattr(o, "init_method", None) if o is not None else None
    try:
        _rpc.init_rpc(name, rank, world_size, init_method=method, rpc_timeout=timeout,
                      num_worker_threads=threads, tensor_type="torch")
    except errors.Error as e:
        if os.environ.get("TD_RPC_SECRET_MADE_BY") and isinstance(
                e, (errors.AuthError, errors.TimeoutError)):
            e = type(e)(e.message + " (this process made its own job secret at import: workers "
                        "started separately need one shared secret - start them with tdistrun, "
                        "or set the same TD_RPC_SECRET for all)", e.status)
        raise _c.runtime_error(e) from None


def shutdown(graceful=True, timeout=DEFAULT_SHUTDOWN_TIMEOUT):
    """Leaves the group; graceful (default) waits for every worker and all outstanding work
    (timeout seconds; 0: no limit, as in PyTorch)."""
    try:
        _rpc.shutdown(graceful=graceful, timeout=timeout if timeout else 0)
    except errors.Error as e:
        raise _c.runtime_error(e) from None
    finally:
        # only now: a worker's main thread typically calls shutdown() right after init_rpc and
        # waits in it while it serves the others, whose autograd contexts live here meanwhile
        # (clearing them first lost a context created by a request that came in before this
        # call: a backward's gradients vanished, 1 run in 12)
        for c in list(_c._ctxs.values()):
            c.released = True
        _c._ctxs.clear()


def get_worker_info(worker_name=None):
    """The WorkerInfo (name, id) of a worker, or of this one."""
    try:
        return _c.worker_info(worker_name)
    except errors.Error as e:
        raise _c.runtime_error(e) from None


def get_rpc_timeout():
    """The default timeout of calls, in seconds (0: none)."""
    return _rpc.get_default_timeout()


def _timeout(timeout):
    return _timeouts.UNSET if timeout is None or timeout < 0 else timeout


def rpc_async(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs func(*args, **kwargs) on worker `to`; returns a torch.futures.Future of the result."""
    if isinstance(func, str):
        return _c.torch_future(_c.plain_call(to, func, args, kwargs, _timeout(timeout)), None,
                               None, plain=True)
    f, peer, ctx = _c.start(to, "call", func, args, kwargs, _timeout(timeout))
    return _c.torch_future(f, ctx, peer)


def rpc_sync(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs func(*args, **kwargs) on worker `to` and returns its result (blocks)."""
    if isinstance(func, str):
        f = _c.plain_call(to, func, args, kwargs, _timeout(timeout))
        wait_ptr(f._f, None)
        return _c._plain_value(f)
    f, peer, ctx = _c.start(to, "call", func, args, kwargs, _timeout(timeout))
    wait_ptr(f._f, None)
    return _c.settle(f, ctx, peer)


def remote(to, func, args=None, kwargs=None, timeout=UNSET_RPC_TIMEOUT):
    """Runs func(*args, **kwargs) on worker `to`; returns at once an RRef to the result, which
    stays there as the very object (a module, say)."""
    r, _peer, _ctx = _c.start(to, "remote", func, args, kwargs, _timeout(timeout))
    return RRef(_ptr=lib.td_rref_ref(r._r))


class RRef(_BaseRRef):
    """torch.distributed.rpc.RRef: a reference to a value that lives on its owner.

    RRef(value) makes one owned here around value (kept as the object itself: local_value()
    returns it, so RRef(param) lets the owner step that very parameter). to_here() copies the
    value here (data only, as rpc_sync's results); proxies call the value's methods by name on
    the owner: rref.rpc_sync().forward(x)."""

    __slots__ = ()

    def __init__(self, value=None, type_hint=None, *, _ptr=None):
        if _ptr is None:
            v = _c._convert._object(value)
            out = ffi.new("td_rref **")
            try:
                st = lib.td_rref_create_local(_rpc._agent(), v, out)
            finally:
                lib.td_value_unref(v)
            check(st)
            _ptr = out[0]
        super().__init__(_ptr=_ptr)

    def local_value(self):
        """The value on the owner (waits while remote() to this worker still makes it)."""
        try:
            v = super().local_value()
        except errors.Error as e:
            raise _c.runtime_error(e) from None
        if isinstance(v, _c._Failure):
            raise _c.exc_from_record(v.record)
        return v

    def to_here(self, timeout=UNSET_RPC_TIMEOUT):
        """The value: on the owner the object itself, elsewhere a copy fetched from the owner
        (recorded by distributed autograd inside a context)."""
        if self.is_owner():
            return self.local_value()
        ctx = _c.current_ctx()
        peer = self.owner_name()
        if ctx is not None:
            with ctx.lock:
                ctx.known.add(peer)
        f = self._proxy_call("fetch", (ctx.id if ctx else 0,), _timeout(timeout))
        wait_ptr(f._f, None)
        return _c.settle(f, ctx, peer)

    def owner(self):
        """The owner's WorkerInfo."""
        return get_worker_info(self.owner_name())

    def _proxy_call(self, fn, args, timeout, remote=False):
        vals, argv = _c._convert.values_array(args)
        opts = _rpc._call_opts(timeout)
        try:
            if remote:
                out = ffi.new("td_rref **")
                st = lib.td_rref_remote(self._r, ("tdist.torch." + fn).encode(), argv, len(vals),
                                        opts, out)
            else:
                out = ffi.new("td_future **")
                st = lib.td_rref_rpc_async(self._r, ("tdist.torch." + fn).encode(), argv,
                                           len(vals), opts, out)
        finally:
            _c._convert.release_values(vals)
        if st != 0:
            raise _c.runtime_error(errors.from_status(st, _rpc._lib_last_error()))
        if remote:
            return RRef(_ptr=out[0])
        return _c._TdFuture(_ptr=out[0])

    def _method(self, mode, name, args, kwargs, timeout):
        ctx = _c.current_ctx()
        peer = self.owner_name()
        a, kw, cid = _c.call_args(None, args, kwargs, peer, ctx)
        if mode == "remote":
            return self._proxy_call("method_remote", (name, a, kw, cid), _timeout(timeout),
                                    remote=True)
        f = self._proxy_call("method", (name, a, kw, cid), _timeout(timeout))
        if mode == "async":
            return _c.torch_future(f, ctx, peer)
        wait_ptr(f._f, None)
        return _c.settle(f, ctx, peer)

    def rpc_sync(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy: rref.rpc_sync().m(*args) runs value.m(*args) on the owner, returns it."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy whose calls return torch.futures.Future."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout=UNSET_RPC_TIMEOUT):
        """A proxy whose calls return an RRef (same owner) to the result."""
        return _Proxy(self, "remote", timeout)

    def _get_future(self):
        return self.creation_future()

    def backward(self, dist_autograd_ctx_id=-1, retain_graph=False):
        """Runs backward with the value as the root, on the owner: torch's local autograd
        (dist_autograd_ctx_id -1; the owner only) or a distributed backward in that context."""
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RuntimeError("RRef.backward without a distributed autograd context runs on "
                                   "the owner only")
            torch.autograd.backward(self.local_value(), retain_graph=retain_graph)
            return
        rpc_sync(self.owner_name(), _rref_backward, args=(self, dist_autograd_ctx_id,
                                                            retain_graph))


class _Proxy:
    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref, mode, timeout):
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            return self._rref._method(self._mode, name, args, kwargs, self._timeout)
        return call


class _Functions:
    """torch.distributed.rpc.functions."""

    @staticmethod
    def async_execution(fn):
        """Marks fn as returning a Future (torch.futures.Future or tdist.Future) whose value is
        the reply: the handler's thread is free while it waits."""
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        wrapper._wrapped_async_rpc_function = fn
        return wrapper


functions = _Functions()
RpcBackendOptions = TensorPipeRpcBackendOptions


def is_available():
    """True: this module works wherever tdist's binding is built."""
    return True


def _rref_backward(rref, context_id, retain_graph):
    from . import torch_autograd
    torch_autograd.backward(context_id, [rref.local_value()], retain_graph)
