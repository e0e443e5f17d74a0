"""_torch_compat.py - the machinery behind tdist.torch_rpc, tdist.torch_autograd, tdist.torch_optim
and tdist.torch_nn (PyTorch's RPC API over tdist): how a torch program's values travel, functions
by name, exceptions as data, and distributed autograd through torch tensors.

Calls. A PyTorch program passes functions (rpc_sync(to, fn, args, kwargs)); tdist sends their
module-qualified names ("module:Qual.name"), never code. Every Python worker that imports
tdist.torch_rpc registers a few dispatchers (names starting "tdist.torch."): "tdist.torch.call"
receives [name, args, kwargs, context id], imports the module if needed (as unpickling would),
looks the function up and runs it. What cannot be sent, and why: lambdas, nested functions and
bound methods (no name another process can look up: define them at module level, or pass the
object as an RRef), and objects that are not data - an nn.Module, an optimizer, an instance of a
user class - because rebuilding them on the receiver is what pickle does by running code the
sender chose. Send their data (state_dict()) or keep them where they are behind an RRef.

Values (the codec, encode/decode). tdist's values carry None, bool, int, float, str, bytes,
lists, dicts with str keys, tensors (zero-copy) and RRefs. Everything else a torch program sends
rides on dicts tagged with the key "__tdist__": tuples, torch.Size, named tuples (by class
name), sets, dicts with other keys, WorkerInfo, functions and classes (by name), torch dtypes and
devices, slices, complex numbers, exceptions, RemoteModules (their worker and module RRef, as
PyTorch pickles them), and tensors that require grad (below).

Exceptions. A function that raises returns an exception record ({"__tdist__": "exc"}: the
type's qualified name, and "On WorkerInfo(id=1, name=w1):\\n<repr>\\n<traceback>"), in an
ordinary reply (so no message size limit cuts the traceback). The caller raises the same type
when it exists there (built-ins always; user classes whose module it can import), as
torch.distributed.rpc does, else tdist.RemoteError. tdist's own failures (timeouts, unknown
workers, dead peers) become classes that are also RuntimeError, which is what PyTorch raises.

Distributed autograd. Inside `with torch_autograd.context() as cid` (a tdist distributed
autograd context: its id is unique in the group), every call carries cid. A tensor that requires
grad and crosses a call, in either direction, leaves a send record on the sender (a SendRpc
node over the tensor, kept by the context under a send id) and arrives as the output of a
RecvRpc node (grad_fn RecvRpcBackward) over a fresh leaf that the receiver's context maps to
(sender, send id). backward(cid, roots) runs torch's autograd locally from the roots to every
leaf reachable (parameters and received leaves); gradients of parameters accumulate in the
context (never in .grad), those of received leaves go back to their senders
("tdist.torch.backward", grouped per sender), which run the same pass from their send records,
and so on; backward returns when every worker's part has finished. Graphs are retained until the
context ends (a tensor sent twice is reached by two passes). The pass on the root worker runs
torch.autograd.backward with inputs=the leaves, using .grad as scratch under a process lock (the
previous .grad values are put back), so that hooks on parameters fire - DistributedDataParallel
averages its gradients there, as it does under PyTorch's distributed autograd; passes started by
gradients from other workers use torch.autograd.grad and touch no .grad. When the context ends
here, its records are released on every worker it reached ("tdist.torch.release").

THREAD SAFETY: any thread; per-context state under the context's lock, the registries under
_lock (a leaf).
"""
import collections
import importlib
import itertools
import os
import sys
import threading
import traceback
import types

import torch

from . import _convert, errors, rpc as _rpc
from ._lib import lib
from ._state import state
from .futures import Future as _TdFuture, wait_ptr
from .rref import RRef as _BaseRRef

TAG = "__tdist__"
_MAIN = ("__main__", "__mp_main__")
_lock = threading.Lock()
_local = threading.local()  # .ctx: the distributed autograd context of this thread


# ---------------------------------------------------------------------------------------------
# functions and classes by name
# ---------------------------------------------------------------------------------------------

_names = {}      # callable -> "module:qualname"
_resolved = {}   # "module:qualname" -> object


def _unsendable(fn, why):
    return TypeError("tdist.torch_rpc cannot send %r: %s. tdist sends functions by their "
                     "module-qualified names, never code (the receiver imports the module and "
                     "looks the name up)" % (fn, why))


def fn_name(fn):
    """The 'module:qualname' under which other workers find fn (a function, class, builtin or
    unbound method defined at module level). Raises TypeError saying why for what has none."""
    try:
        n = _names.get(fn)
    except TypeError:  # unhashable callable
        n = None
    if n is not None:
        return n
    target = fn
    if isinstance(fn, (staticmethod, classmethod)):
        target = fn.__func__
    if isinstance(target, types.MethodType) and not isinstance(target.__self__, type):
        raise _unsendable(fn, "a bound method carries its object, which does not travel; pass "
                          "the unbound function (Class.method) and the object as an RRef")
    mod = getattr(target, "__module__", None)
    qn = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if not mod or not qn:
        raise _unsendable(fn, "it has no module-qualified name")
    if "<lambda>" in qn or "<locals>" in qn:
        raise _unsendable(fn, "a lambda or a function defined inside another function has no "
                          "name another process can look up; define it at module level")
    if mod == "__mp_main__":
        mod = "__main__"
    for cand in (qn, getattr(target, "__name__", None)):
        if not cand:
            continue
        name = "%s:%s" % (mod, cand)
        try:
            if _same(resolve(name), target):
                try:
                    _names[fn] = name
                except TypeError:
                    pass
                return name
        except Exception:  # noqa: BLE001 - try the next spelling
            pass
    raise _unsendable(fn, "the name %s.%s does not lead back to it in this process" % (mod, qn))


def _same(a, b):
    if a is b:
        return True
    fa, fb = getattr(a, "__func__", a), getattr(b, "__func__", b)
    return fa is fb


def resolve(name):
    """The object called name ("module:qualname"), importing the module if needed; the main
    module of a program started by multiprocessing's spawn is found as "__main__" too."""
    obj = _resolved.get(name)
    if obj is not None:
        return obj
    mod, sep, qn = name.partition(":")
    if not sep or not qn:
        raise ValueError("tdist.torch_rpc: bad function name %r (want 'module:qualname')" % name)
    if mod in _MAIN:
        m = sys.modules.get("__main__") or sys.modules.get("__mp_main__")
    else:
        m = sys.modules.get(mod) or importlib.import_module(mod)
    obj = m
    for part in qn.split("."):
        obj = getattr(obj, part)
    _resolved[name] = obj
    return obj


# ---------------------------------------------------------------------------------------------
# WorkerInfo
# ---------------------------------------------------------------------------------------------

class WorkerInfo:
    """A worker's name and rank (torch.distributed.rpc.WorkerInfo)."""

    __slots__ = ("name", "id")

    def __init__(self, name, id):  # noqa: A002 - PyTorch's field name
        self.name, self.id = name, id

    def __eq__(self, other):
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self):
        return hash((self.name, self.id))

    def __repr__(self):
        return "WorkerInfo(id=%d, name=%s)" % (self.id, self.name)


def worker_info(name_or_rank=None):
    w = _rpc.get_worker_info(name_or_rank)
    return WorkerInfo(w.name, w.id)


def to_name(to):
    """A destination (name, rank, WorkerInfo of either binding) as a worker name."""
    if isinstance(to, str):
        return to
    name = getattr(to, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(to, int):
        return _rpc.get_worker_info(to).name
    raise TypeError("to: a worker name, rank or WorkerInfo, got %r" % (to,))


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

_RUNTIME = {}


def runtime_error(e):
    """tdist's exception e as a class that is also a RuntimeError (PyTorch raises RuntimeError
    for timeouts, unknown workers and dead peers)."""
    cls = type(e)
    if isinstance(e, RuntimeError) or not isinstance(e, errors.Error):
        return e
    rc = _RUNTIME.get(cls)
    if rc is None:
        try:
            rc = type(cls.__name__, (cls, RuntimeError), {"__module__": "tdist.torch_rpc"})
        except TypeError:
            rc = None
        _RUNTIME[cls] = rc
    if rc is None:
        return errors.RemoteError(e.message, e.status)
    out = rc(e.message, e.status)
    out.__cause__ = e.__cause__
    return out


def _worker_repr():
    return "WorkerInfo(id=%d, name=%s)" % (state.rank, state.name)


def exc_record(e):
    """An exception raised here as data: type name, and PyTorch's message (worker, repr,
    traceback)."""
    t = type(e)
    mod = t.__module__ if t.__module__ != "__mp_main__" else "__main__"
    tb = "".join(traceback.format_exception(t, e, e.__traceback__))
    return {TAG: "exc", "t": "%s:%s" % (mod, t.__qualname__),
            "m": "On %s:\n%r\n%s" % (_worker_repr(), e, tb)}


def exc_from_record(rec):
    """The exception a record describes: its own type when this process has it (PyTorch builds
    exception_type(message)), else tdist.RemoteError."""
    msg = rec.get("m", "")
    cls = None
    try:
        mod = rec["t"].partition(":")[0]
        if mod == "builtins" or mod in _MAIN or mod in sys.modules:
            cls = resolve(rec["t"])
    except Exception:  # noqa: BLE001 - the type does not exist here
        cls = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            return cls(msg)
        except Exception:  # noqa: BLE001 - a constructor that wants more than a message
            pass
    e = errors.RemoteError(msg, errors.RemoteError.status)
    e.remote_type = rec.get("t")
    return e


class _Failure:
    """The value of an RRef whose function raised (remote()): raised again by to_here(),
    local_value() and proxies."""

    __slots__ = ("record",)

    def __init__(self, record):
        self.record = record


# ---------------------------------------------------------------------------------------------
# distributed autograd contexts
# ---------------------------------------------------------------------------------------------

class SendRpc(torch.autograd.Function):
    """The sender's end of a tensor that crossed a call: the context keeps this node's output
    under a send id; gradients for it arrive from the receiver."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g


class RecvRpc(torch.autograd.Function):
    """The receiver's end: its input is a fresh leaf that the context maps to (sender, send id);
    the gradient that reaches that leaf goes back to the sender."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g


class Ctx:
    """This worker's part of a distributed autograd context."""

    def __init__(self, cid):
        self.id = cid
        self.lock = threading.Lock()
        self.sends = {}   # send id -> SendRpc output
        self.recvs = {}   # id(leaf) -> (leaf, sender name, send id)
        self.grads = {}   # leaf tensor -> accumulated gradient
        self.known = set()  # workers it exchanged tensors or calls with
        self.released = False


_ctxs = {}
_send_ids = itertools.count(1)


def current_ctx():
    return getattr(_local, "ctx", None)


def set_current(ctx):
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    return prev


def ctx_get(cid, create=False):
    with _lock:
        c = _ctxs.get(cid)
        if c is None and create:
            c = _ctxs[cid] = Ctx(cid)
        return c


def ctx_drop(cid):
    with _lock:
        return _ctxs.pop(cid, None)


def ctx_for_request(cid, caller):
    """The context a request carries (created here on first sight), with the caller known."""
    if not cid:
        return None
    c = ctx_get(cid, create=True)
    if caller:
        with c.lock:
            c.known.add(caller)
    return c


def release_ctx(c, skip=None):
    """Drops c here and tells every worker it reached (except skip) to do the same; the calls
    go without waiting (a graceful shutdown waits for them)."""
    with c.lock:
        if c.released:
            return
        c.released = True
        known = sorted(c.known - {skip, state.name})
        c.sends.clear()
        c.recvs.clear()
    ctx_drop(c.id)
    for w in known:
        try:
            _rpc.rpc_async(w, "tdist.torch.release", (c.id,))
        except errors.Error:
            pass  # that worker is gone or shutting down: nothing to release there


def _walk(outputs):
    """Every leaf tensor that requires grad reachable from outputs' graphs, in a stable order."""
    leaves, seen = [], set()
    stack = []
    for o in outputs:
        if o.grad_fn is not None:
            stack.append(o.grad_fn)
        elif o.requires_grad:
            leaves.append(o)
    seen_leaf = set(id(x) for x in leaves)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        v = getattr(fn, "variable", None)
        if v is not None:
            if id(v) not in seen_leaf:
                seen_leaf.add(id(v))
                leaves.append(v)
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return leaves


_root_lock = threading.Lock()


def _root_grads(outputs, grad_outputs, leaves):
    """Gradients of leaves through .grad (hooks on parameters fire: DistributedDataParallel),
    each leaf's previous .grad put back."""
    with _root_lock:
        saved = [x.grad for x in leaves]
        for x in leaves:
            x.grad = None
        try:
            torch.autograd.backward(outputs, grad_outputs, retain_graph=True, inputs=leaves)
            got = [x.grad for x in leaves]
        finally:
            for x, g in zip(leaves, saved):
                x.grad = g
    # a gradient that is a view (DDP's gradient_as_bucket_view) is copied: the bucket changes
    return [g.clone() if g is not None and g._base is not None else g for g in got]


def run_pass(c, outputs, grad_outputs, root):
    """One local backward pass of context c: gradients of this worker's leaves accumulate in c;
    returns the tdist futures of the calls that hand received leaves' gradients to their
    senders."""
    leaves = _walk(outputs)
    if not leaves:
        return []
    if root:
        grads = _root_grads(outputs, grad_outputs, leaves)
    else:
        grads = torch.autograd.grad(outputs, leaves, grad_outputs, retain_graph=True,
                                    allow_unused=True)
    out = collections.OrderedDict()  # sender -> ([send ids], [gradients])
    with c.lock:
        for leaf, g in zip(leaves, grads):
            if g is None:
                continue
            r = c.recvs.get(id(leaf))
            if r is not None and r[0] is leaf:
                ids, gs = out.setdefault(r[1], ([], []))
                ids.append(r[2])
                gs.append(g)
            else:
                prev = c.grads.get(leaf)
                c.grads[leaf] = g if prev is None else prev + g
    return [_rpc.rpc_async(w, "tdist.torch.backward", (c.id, ids, gs))
            for w, (ids, gs) in out.items()]


def all_of(futs):
    """A tdist Future done when every future in futs is done, failed with the first failure."""
    out = _TdFuture()
    if not futs:
        out.set_result(None)
        return out
    left = [len(futs)]
    lk = threading.Lock()

    def one(f):
        e = f.exception()
        with lk:
            left[0] -= 1
            last = left[0] == 0
            if out.done():
                return
            if e is not None:
                out.set_exception(e)
            elif last:
                out.set_result(None)

    for f in futs:
        f.add_done_callback(one)
    return out


def wait_future(f):
    """Waits for tdist future f (interruptible) and returns its value; tdist failures as
    RuntimeError classes."""
    wait_ptr(f._f, None)
    try:
        return f.value()
    except errors.Error as e:
        raise runtime_error(e) from None


# ---------------------------------------------------------------------------------------------
# the codec
# ---------------------------------------------------------------------------------------------

_SCALARS = (type(None), bool, int, float, str, bytes)


def encode(obj, ctx, peer):
    """obj as tdist data (see the module's notes). ctx: the context of the call (tensors that
    require grad leave send records in it), peer: the worker it goes to."""
    t = type(obj)
    if t in _SCALARS:
        return obj
    if t is list:
        return [encode(x, ctx, peer) for x in obj]
    if isinstance(obj, torch.Tensor):
        return _enc_tensor(obj, ctx, peer)
    if t is dict:
        if TAG not in obj and all(type(k) is str for k in obj):
            return {k: encode(v, ctx, peer) for k, v in obj.items()}
        return {TAG: "dict", "k": [encode(k, ctx, peer) for k in obj],
                "v": [encode(v, ctx, peer) for v in obj.values()]}
    if t is tuple:
        return {TAG: "tuple", "v": [encode(x, ctx, peer) for x in obj]}
    if t is torch.Size:
        return {TAG: "size", "v": list(obj)}
    if isinstance(obj, _BaseRRef):
        return obj
    if getattr(t, "_tdist_remote_module", False):  # a RemoteModule: its worker and module RRef
        return {TAG: "rmod", "on": obj.on, "r": obj.module_rref}
    if t is WorkerInfo or type(obj).__name__ == "WorkerInfo" and hasattr(obj, "id"):
        return {TAG: "wi", "n": obj.name, "i": int(obj.id)}
    if t is torch.dtype:
        return {TAG: "dtype", "n": str(obj).replace("torch.", "")}
    if t is torch.device:
        return {TAG: "device", "n": str(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple, by its class
        return {TAG: "ntuple", "c": fn_name(t), "v": [encode(x, ctx, peer) for x in obj]}
    if t in (set, frozenset):
        return {TAG: t.__name__, "v": [encode(x, ctx, peer) for x in obj]}
    if t is slice:
        return {TAG: "slice", "v": [encode(x, ctx, peer) for x in (obj.start, obj.stop, obj.step)]}
    if t is complex:
        return {TAG: "complex", "v": [obj.real, obj.imag]}
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type, staticmethod,
                        classmethod, types.MethodType)) or callable(obj) and hasattr(
                            obj, "__qualname__") and not hasattr(obj, "__dict__"):
        return {TAG: "fn", "n": fn_name(obj)}
    if isinstance(obj, dict):  # OrderedDict (a state_dict) and other dict subclasses
        return encode(dict(obj), ctx, peer)
    if isinstance(obj, list):
        return encode(list(obj), ctx, peer)
    if isinstance(obj, (_convert.np.ndarray, _convert.np.generic)):
        return obj
    raise TypeError(
        "tdist.torch_rpc cannot send a %s.%s: only data travels between workers (tensors, "
        "numbers, strings, bytes, lists, tuples, dicts, sets, RRefs, and functions and classes "
        "by name), never pickled objects, which would let the sender run code on the receiver. "
        "Send the object's data (for a module, its state_dict()), or keep the object where it "
        "is and pass an RRef to it (rpc.remote, rpc.RRef)" % (t.__module__, t.__qualname__))


def _enc_tensor(t, ctx, peer):
    if not t.requires_grad:
        return t
    if ctx is None:
        return {TAG: "r", "t": t.detach()}
    s = SendRpc.apply(t)
    sid = next(_send_ids)
    with ctx.lock:
        ctx.sends[sid] = s
        if peer:
            ctx.known.add(peer)
    return {TAG: "g", "t": t.detach(), "s": sid}


def decode(x, ctx, origin):
    """The Python value of received data x (from worker origin, in context ctx)."""
    t = type(x)
    if t is list:
        return [decode(v, ctx, origin) for v in x]
    if t is dict:
        tag = x.get(TAG)
        if tag is None:
            return {k: decode(v, ctx, origin) for k, v in x.items()}
        return _DECODE[tag](x, ctx, origin)
    if t is _BaseRRef:
        from .torch_rpc import RRef
        return RRef(_ptr=lib.td_rref_ref(x._r))
    return x


def _dec_grad(x, ctx, origin):
    leaf = _as_torch(x["t"]).requires_grad_(True)
    if ctx is None:
        return leaf
    r = RecvRpc.apply(leaf)
    with ctx.lock:
        ctx.recvs[id(leaf)] = (leaf, origin, x["s"])
        ctx.known.add(origin)
    return r


def _as_torch(t):
    if isinstance(t, torch.Tensor):
        return t
    return torch.from_numpy(t) if isinstance(t, _convert.np.ndarray) else torch.as_tensor(t)


def _dec_ntuple(x, ctx, origin):
    cls = resolve(x["c"])
    return cls(*decode(x["v"], ctx, origin))


def _dec_dict(x, ctx, origin):
    return dict(zip(decode(x["k"], ctx, origin), decode(x["v"], ctx, origin)))


_DECODE = {
    "tuple": lambda x, c, o: tuple(decode(x["v"], c, o)),
    "size": lambda x, c, o: torch.Size(x["v"]),
    "dict": _dec_dict,
    "set": lambda x, c, o: set(decode(x["v"], c, o)),
    "frozenset": lambda x, c, o: frozenset(decode(x["v"], c, o)),
    "wi": lambda x, c, o: WorkerInfo(x["n"], x["i"]),
    "dtype": lambda x, c, o: getattr(torch, x["n"]),
    "device": lambda x, c, o: torch.device(x["n"]),
    "ntuple": _dec_ntuple,
    "slice": lambda x, c, o: slice(*decode(x["v"], c, o)),
    "complex": lambda x, c, o: complex(*x["v"]),
    "fn": lambda x, c, o: resolve(x["n"]),
    "g": _dec_grad,
    "r": lambda x, c, o: _as_torch(x["t"]).requires_grad_(True),
    "exc": lambda x, c, o: _Raise(x),
    "rmod": lambda x, c, o: _remote_module(x["on"], decode(x["r"], c, o)),
}


def _remote_module(on, rref):
    from .torch_nn import RemoteModule
    return RemoteModule._rebuild(on, rref)


class _Raise:
    """A decoded exception record (raised by the caller when it is the call's result)."""

    __slots__ = ("record",)

    def __init__(self, record):
        self.record = record


def result_of(v):
    """A call's decoded result: an exception record is raised."""
    if type(v) is _Raise:
        raise exc_from_record(v.record)
    return v


def encode_result(out, ctx, peer):
    try:
        return encode(out, ctx, peer)
    except Exception as e:  # noqa: BLE001 - e.g. an object that cannot travel
        return exc_record(e)


# ---------------------------------------------------------------------------------------------
# the dispatchers every Python worker registers
# ---------------------------------------------------------------------------------------------

def _caller():
    c = _rpc.current_caller()
    return c.name if c else None


def _is_async(fn):
    return getattr(fn, "_wrapped_async_rpc_function", None) is not None


def _run(fn, args, kwargs, cid, keep):
    """Runs fn for a request: its result encoded for the caller (keep=False), or kept here as
    an object (keep=True: an RRef's value); exceptions as records."""
    caller = _caller()
    ctx = ctx_for_request(cid, caller)
    prev = set_current(ctx)
    try:
        a = decode(args, ctx, caller)
        kw = decode(kwargs, ctx, caller) if kwargs else {}
        out = fn(*a, **kw)
        if _is_async(fn):
            return _follow(out, ctx, caller, keep)
    except Exception as e:  # noqa: BLE001 - every failure goes back as data
        return _kept(_Failure(exc_record(e))) if keep else exc_record(e)
    finally:
        set_current(prev)
    return _kept(out) if keep else encode_result(out, ctx, caller)


def _kept(obj):
    """A value that stays in this process as the very object (an RRef's value)."""
    v = _convert._object(obj)
    try:
        return _convert.OpaqueValue(v)
    finally:
        lib.td_value_unref(v)


def _follow(fut, ctx, caller, keep):
    """The reply of an async_execution function: a tdist Future completed from the future it
    returned (torch.futures.Future or tdist.Future)."""
    out = _TdFuture()

    def done(f):
        try:
            v = f.wait() if isinstance(f, torch.futures.Future) else f.value()
        except Exception as e:  # noqa: BLE001
            out.set_result(_kept(_Failure(exc_record(e))) if keep else exc_record(e))
            return
        out.set_result(_kept(v) if keep else encode_result(v, ctx, caller))

    if not hasattr(fut, "add_done_callback"):
        raise TypeError("an @async_execution function must return a Future (torch.futures.Future "
                        "or tdist.Future), got %s" % type(fut).__name__)
    fut.add_done_callback(done)
    return out


def _h_call(name, args, kwargs, cid):
    try:
        fn = resolve(name)
    except Exception as e:  # noqa: BLE001
        return exc_record(e)
    return _run(fn, args, kwargs, cid, False)


def _h_remote(name, args, kwargs, cid):
    try:
        fn = resolve(name)
    except Exception as e:  # noqa: BLE001
        return _kept(_Failure(exc_record(e)))
    return _run(fn, args, kwargs, cid, True)


def _h_fetch(value, cid):
    if isinstance(value, _Failure):
        return value.record
    caller = _caller()
    return encode_result(value, ctx_for_request(cid, caller), caller)


def _method(value, name):
    if isinstance(value, _Failure):
        raise exc_from_record(value.record)
    return getattr(value, name)


def _h_method(value, name, args, kwargs, cid):
    try:
        fn = _method(value, name)
    except Exception as e:  # noqa: BLE001 - AttributeError, as PyTorch raises
        return exc_record(e)
    return _run(fn, args, kwargs, cid, False)


def _h_method_remote(value, name, args, kwargs, cid):
    try:
        fn = _method(value, name)
    except Exception as e:  # noqa: BLE001
        return _kept(_Failure(exc_record(e)))
    return _run(fn, args, kwargs, cid, True)


def _h_backward(cid, send_ids, grads):
    c = ctx_get(cid)
    if c is None:
        raise errors.StateError("distributed autograd context %d is not known on %s (it ended, "
                                "or the gradient outlived it)" % (cid, state.name), 2)
    with c.lock:
        outs = [c.sends[s] for s in send_ids]
    futs = run_pass(c, outs, [_as_torch(g) for g in grads], root=False)
    return all_of(futs) if futs else None


def _h_release(cid):
    c = ctx_get(cid)
    if c is not None:
        release_ctx(c, skip=_caller())


for _n, _f in (("call", _h_call), ("remote", _h_remote), ("fetch", _h_fetch),
               ("method", _h_method), ("method_remote", _h_method_remote),
               ("backward", _h_backward), ("release", _h_release)):
    if ("tdist.torch." + _n) not in _rpc._functions:
        _rpc.register(_f, name="tdist.torch." + _n)


# ---------------------------------------------------------------------------------------------
# making calls
# ---------------------------------------------------------------------------------------------

def call_args(func, args, kwargs, peer, ctx):
    """(registered function name, tdist argument list) of a call of func(*args, **kwargs)."""
    a = encode(list(args) if args else [], ctx, peer)
    kw = encode(dict(kwargs), ctx, peer) if kwargs else {}
    cid = ctx.id if ctx is not None else 0
    if ctx is not None:
        with ctx.lock:
            ctx.known.add(peer)
    return a, kw, cid


def start(to, kind, func, args, kwargs, timeout):
    """Starts a call ("call" or "remote"); returns (tdist future or RRef pointer, peer, ctx)."""
    peer = to_name(to)
    ctx = current_ctx()
    name = func if isinstance(func, str) else fn_name(func)
    a, kw, cid = call_args(func, args, kwargs, peer, ctx)
    try:
        if kind == "remote":
            return _rpc.remote(peer, "tdist.torch.remote", (name, a, kw, cid), timeout=timeout), \
                peer, ctx
        return _rpc.rpc_async(peer, "tdist.torch.call", (name, a, kw, cid), timeout=timeout), \
            peer, ctx
    except errors.Error as e:
        raise runtime_error(e) from None


def plain_call(to, func, args, kwargs, timeout):
    """A call of a registered function by name (a C worker's, say): tdist's own values, no
    envelope."""
    if kwargs:
        raise TypeError("a function called by its registered name (%r) takes positional "
                        "arguments only" % func)
    try:
        return _rpc.rpc_async(to_name(to), func, tuple(encode(list(args or ()), None, None)),
                              timeout=timeout)
    except errors.Error as e:
        raise runtime_error(e) from None


def settle(f, ctx, peer):
    """The decoded value of done tdist future f (raises what the callee raised)."""
    try:
        v = f.value()
    except errors.Error as e:
        raise runtime_error(e) from None
    return result_of(decode(v, ctx, peer))


def torch_future(f, ctx, peer, plain=False):
    """A torch.futures.Future completed from tdist future f (what torch.futures functions and
    PyTorch programs expect of rpc_async)."""
    tf = torch.futures.Future()

    def done(src):
        try:
            v = settle(src, ctx, peer) if not plain else _plain_value(src)
        except BaseException as e:  # noqa: B902 - the future carries it
            tf.set_exception(e)
            return
        tf.set_result(v)

    f.add_done_callback(done)
    return tf


def _plain_value(f):
    try:
        return decode(f.value(), None, None)
    except errors.Error as e:
        raise runtime_error(e) from None


def ensure_secret():
    """A program that starts its workers itself (torch.multiprocessing.spawn, Process) gives
    them one job secret: made here in the parent, inherited through the environment, unless
    one is set (TD_RPC_SECRET, TD_RPC_SECRET_FILE) or authentication is off (TD_RPC_INSECURE)."""
    if not any(os.environ.get(k) for k in ("TD_RPC_SECRET", "TD_RPC_SECRET_FILE",
                                           "TD_RPC_INSECURE")):
        os.environ["TD_RPC_SECRET"] = _rpc.generate_secret()
        os.environ["TD_RPC_SECRET_MADE_BY"] = str(os.getpid())


ensure_secret()
