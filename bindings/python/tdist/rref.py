"""rref.py - tdist.RRef: a reference to a value that lives on one worker (its owner).

Made by tdist.remote(to, func, args) (the value is func's result on `to`), by RRef(value) (an
owner RRef here), or received inside a call's arguments or result. The owner frees the value as
soon as the last RRef to it anywhere is gone (reference counting across processes, no garbage
collector). A Python object that a registered function returns stays that object on its owner:
`ps = tdist.remote("ps", ParameterServer)` keeps a ParameterServer on worker "ps".

Proxies run a registered function on the owner with the value as first argument:
`rref.rpc_sync().get_params()` calls the function registered as "get_params" there - for a
Python owner, register the class's methods (tdist.register(ParameterServer.get_params) or
@tdist.register on the method) and they are called as methods of the object.
"""
from . import _convert, _timeouts, errors
from ._lib import NULL, check, cstr, ffi, lib, pystr
from ._state import agent as _agent
from .futures import Future, wait_ptr


class RRef:
    """A remote reference (torch.distributed.rpc.RRef's shape)."""

    __slots__ = ("_r", "__weakref__")

    def __init__(self, value=None, *, _ptr=None):
        """RRef(value): an RRef owned by this worker around value (data or any Python
        object)."""
        if _ptr is None:
            v = _convert.to_value(value, strict=False)
            out = ffi.new("td_rref **")
            try:
                st = lib.td_rref_create_local(_agent(), v, out)
            finally:
                lib.td_value_unref(v)
            check(st)
            _ptr = out[0]
        self._r = ffi.gc(_ptr, lib.td_rref_unref)

    def to_here(self, timeout=_timeouts.UNSET):
        """The value, copied here (on the owner: the value itself). Blocks until it exists
        (timeout seconds; default: the agent's; 0: none); Ctrl-C interrupts the wait."""
        out = ffi.new("td_future **")
        check(lib.td_rref_to_here_async(self._r, _timeouts.call_ms(timeout), out))
        f = Future(_ptr=out[0])
        wait_ptr(f._f, None)
        return f.value()

    def local_value(self):
        """The value on the owner (raises on a user RRef). An owner RRef whose value is still
        being made (remote() to this worker) is waited for, as in PyTorch."""
        out = ffi.new("td_value **")
        st = lib.td_rref_local_value(self._r, out)
        if st == errors.StateError.status and lib.td_rref_is_owner(self._r):
            f = self.creation_future()
            if not f.done():
                wait_ptr(f._f, None)
                st = lib.td_rref_local_value(self._r, out)
        check(st)
        try:
            return _convert.from_value(out[0])
        finally:
            lib.td_value_unref(out[0])

    def owner(self):
        """The owner's WorkerInfo."""
        from .rpc import get_worker_info
        return get_worker_info(lib.td_rref_owner(self._r))

    def owner_name(self):
        return pystr(lib.td_rref_owner_name(self._r))

    def is_owner(self):
        return bool(lib.td_rref_is_owner(self._r))

    def confirmed_by_owner(self):
        return bool(lib.td_rref_confirmed_by_owner(self._r))

    def creation_future(self):
        """A Future done once the value exists (or failed with the creation's error)."""
        out = ffi.new("td_future **")
        check(lib.td_rref_creation_future(self._r, out))
        return Future(_ptr=out[0])

    def rpc_sync(self, timeout=_timeouts.UNSET):
        """A proxy: rref.rpc_sync().fn(*args) runs registered fn(value, *args) on the owner and
        returns its result."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout=_timeouts.UNSET):
        """A proxy whose calls return a tdist.Future."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout=_timeouts.UNSET):
        """A proxy whose calls return an RRef (same owner) to the result."""
        return _Proxy(self, "remote", timeout)

    def __repr__(self):
        buf = ffi.new("char[160]")
        return ffi.string(lib.td_rref_to_string(self._r, buf, 160)).decode()


class _Proxy:
    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref, mode, timeout):
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.call(name, *args, **kwargs)

    def call(self, name, *args, **kwargs):
        """Calls the registered function `name` (any spelling, e.g. with dots)."""
        if kwargs:
            raise TypeError("tdist passes positional arguments only")
        vals, argv = _convert.values_array(args)
        opts = NULL
        if self._timeout is not _timeouts.UNSET and self._timeout is not None:
            opts = ffi.new("td_rpc_call_opts *")
            lib.td_rpc_call_opts_init(opts)  # a zeroed struct is refused
            opts.timeout_ms = _timeouts.call_ms(self._timeout)
        try:
            if self._mode == "remote":
                out = ffi.new("td_rref **")
                st = lib.td_rref_remote(self._rref._r, cstr(name), argv, len(vals), opts, out)
            else:
                out = ffi.new("td_future **")
                st = lib.td_rref_rpc_async(self._rref._r, cstr(name), argv, len(vals), opts, out)
        finally:
            _convert.release_values(vals)
        check(st)
        if self._mode == "remote":
            return RRef(_ptr=out[0])
        f = Future(_ptr=out[0])
        if self._mode == "async":
            return f
        if not wait_ptr(f._f, None):
            raise errors.InternalError("wait ended early", 16)
        return f.value()


_convert.RREF_CLASS = RRef
