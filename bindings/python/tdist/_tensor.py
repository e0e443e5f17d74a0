"""_tensor.py - tensors between numpy / PyTorch and tdist, without copies.

Into tdist (arguments, results, RRef values): a C-contiguous CPU numpy array or torch tensor is
wrapped with td_tensor_from_borrowed - tdist reads and sends the object's own memory - and the
object is kept alive (tdist._service) until tdist's last reference to that memory is gone, on
whatever thread that happens. Non-contiguous inputs are made contiguous first (one copy), and
read-only numpy arrays are copied (tdist may hand the memory to code that writes in place).

Out of tdist: a CPU td_tensor becomes a numpy array over tdist's memory (np.ndarray over an
ffi.buffer); the array holds a tdist reference that it drops when it is collected. A torch
tensor is torch.from_numpy of that array (bfloat16 through an int16 view), so it shares the
memory too. What callers get is chosen by init_rpc(tensor_type=...): "numpy", "torch", or
"auto" (torch when the program has imported torch, else numpy). Tensors that require grad
(distributed autograd) come back as tdist.Tensor, which keeps their autograd history.

Dtypes: float32, float64, int64, float16 and bfloat16 (tdist computes with these; bfloat16 reaches
Python as torch tensors or tdist.Tensor: numpy has none), int32, uint8, bool (transported as they
are; tdist's ops refuse them).
"""
import sys

import numpy as np

from . import _service
from ._lib import NULL, check, ffi, lib

_NP = {
    np.dtype(np.float32): lib.TD_DTYPE_F32, np.dtype(np.float64): lib.TD_DTYPE_F64,
    np.dtype(np.int64): lib.TD_DTYPE_I64, np.dtype(np.float16): lib.TD_DTYPE_F16,
    np.dtype(np.int32): lib.TD_DTYPE_I32, np.dtype(np.uint8): lib.TD_DTYPE_U8,
    np.dtype(np.bool_): lib.TD_DTYPE_BOOL,
}
_TD_NP = {v: k for k, v in _NP.items()}
_TD_NP[lib.TD_DTYPE_BF16] = np.dtype(np.int16)  # bit pattern only (torch views it as bfloat16)
_TORCH = None  # torch dtype -> td dtype, filled on first use
_TD_TORCH = None
RELEASE = ffi.addressof(lib, "tdpy_release")
DTYPE_NAMES = {d: ffi.string(lib.td_dtype_name(d)).decode() for d in range(lib.TD_DTYPE_COUNT)}


def _torch_tables():
    global _TORCH, _TD_TORCH
    if _TORCH is None:
        import torch
        _TORCH = {
            torch.float32: lib.TD_DTYPE_F32, torch.float64: lib.TD_DTYPE_F64,
            torch.int64: lib.TD_DTYPE_I64, torch.float16: lib.TD_DTYPE_F16,
            torch.bfloat16: lib.TD_DTYPE_BF16, torch.int32: lib.TD_DTYPE_I32,
            torch.uint8: lib.TD_DTYPE_U8, torch.bool: lib.TD_DTYPE_BOOL,
        }
        _TD_TORCH = {v: k for k, v in _TORCH.items()}
    return _TORCH, _TD_TORCH


def is_torch_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _borrow(obj, data, shape, dt):
    """Wraps memory at address data (owned by obj) as a new td_tensor* (caller owns it)."""
    key = _service.hold(obj)
    out = ffi.new("td_tensor **")
    st = lib.td_tensor_from_borrowed(ffi.cast("void *", data), shape, len(shape), dt, RELEASE,
                                     ffi.cast("void *", key), out)
    if st != 0:
        _service.forget(key)
        check(st)
    return out[0]


def borrow_numpy(a):
    """A new td_tensor* over numpy array a's memory (a copy first when a is not C-contiguous
    or read-only)."""
    dt = _NP.get(a.dtype)
    if dt is None:
        raise TypeError("numpy dtype %s has no tdist dtype (float32, float64, int64, float16, "
                        "int32, uint8, bool)" % a.dtype)
    if not a.flags.c_contiguous or not a.flags.writeable:
        a = np.array(a, order="C", copy=True)
    return _borrow(a, a.__array_interface__["data"][0], a.shape, dt)


def borrow_torch(t):
    """A new td_tensor* over a CPU torch tensor's memory (detached; made contiguous first)."""
    table, _ = _torch_tables()
    if t.device.type != "cpu":
        raise TypeError("only CPU torch tensors can be sent (got one on %s): move it with "
                        ".cpu() first" % t.device)
    dt = table.get(t.dtype)
    if dt is None:
        raise TypeError("torch dtype %s has no tdist dtype" % t.dtype)
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return _borrow(t, t.data_ptr(), tuple(t.shape), dt)


def numpy_view(t):
    """A numpy array over td_tensor* t's memory (t borrowed; the array takes its own reference).
    bfloat16 tensors come as int16 arrays of their bits."""
    dev = lib.td_tensor_device(t)
    ref = NULL
    if dev.type != lib.TD_DEVICE_CPU:  # a CUDA tensor: one copy to the host
        out = ffi.new("td_tensor **")
        check(lib.td_tensor_to(t, lib.td_device_cpu(), out))
        ref = out[0]
    else:
        ref = lib.td_tensor_ref(t)
    dt = lib.td_tensor_dtype(ref)
    npdt = _TD_NP[dt]
    nd = lib.td_tensor_ndim(ref)
    shp, strd = lib.td_tensor_shape(ref), lib.td_tensor_strides(ref)
    shape = tuple(shp[i] for i in range(nd))
    es = npdt.itemsize
    if lib.td_tensor_numel(ref) == 0:
        lib.td_tensor_unref(ref)
        return np.empty(shape, npdt)
    extent = 1 + sum((shape[i] - 1) * strd[i] for i in range(nd))
    keep = ffi.gc(ffi.cast("char *", lib.td_tensor_data(ref)),
                  lambda _p, r=ref: lib.td_tensor_unref(r))
    return np.ndarray(shape, npdt, buffer=ffi.buffer(keep, extent * es),
                      strides=tuple(strd[i] * es for i in range(nd)))


def torch_view(t):
    """A torch tensor sharing td_tensor* t's memory (t borrowed)."""
    import torch
    a = numpy_view(t)
    r = torch.from_numpy(a)
    if lib.td_tensor_dtype(t) == lib.TD_DTYPE_BF16:
        r = r.view(torch.bfloat16)
    return r


class Tensor:
    """A tdist tensor held by Python: what distributed autograd works with (results that
    require grad come back as tdist.Tensor), and a zero-copy handle on tdist's memory.

    Make one with tdist.tensor(data) (a copy) or tdist.from_numpy(array) (shares the array's
    memory). Equality and hashing are by identity of the underlying C tensor, so tdist.Tensor
    objects work as dictionary keys (tdist.autograd.get_gradients)."""

    __slots__ = ("_t", "__weakref__")

    def __init__(self, ptr):
        """Takes ownership of a td_tensor* reference (internal: use tdist.tensor)."""
        self._t = ffi.gc(ptr, lib.td_tensor_unref)

    @property
    def shape(self):
        nd = lib.td_tensor_ndim(self._t)
        s = lib.td_tensor_shape(self._t)
        return tuple(s[i] for i in range(nd))

    @property
    def ndim(self):
        return lib.td_tensor_ndim(self._t)

    @property
    def dtype(self):
        """The dtype's name, as PyTorch spells it ("float32", "bfloat16", ...)."""
        return DTYPE_NAMES[lib.td_tensor_dtype(self._t)]

    @property
    def requires_grad(self):
        return bool(lib.td_tensor_requires_grad(self._t))

    def requires_grad_(self, flag=True):
        check(lib.td_tensor_set_requires_grad(self._t, bool(flag)))
        return self

    def numel(self):
        return lib.td_tensor_numel(self._t)

    def numpy(self):
        """A numpy array sharing this tensor's memory (bfloat16: its bits as int16)."""
        return numpy_view(self._t)

    def torch(self):
        """A torch tensor sharing this tensor's memory."""
        return torch_view(self._t)

    def item(self):
        v = ffi.new("double *")
        check(lib.td_tensor_item(self._t, v))
        return v[0]

    def sum(self):
        """The sum of the elements as a 0-d tdist.Tensor (differentiable: a loss)."""
        out = ffi.new("td_tensor **")
        check(lib.td_tensor_sum_all(self._t, out))
        return Tensor(out[0])

    def _key(self):
        return int(ffi.cast("uintptr_t", self._t))

    def __eq__(self, other):
        return isinstance(other, Tensor) and other._key() == self._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return "tdist.Tensor(shape=%s, dtype=%s%s)" % (
            list(self.shape), self.dtype, ", requires_grad=True" if self.requires_grad else "")


def tensor(data, dtype=None, requires_grad=False):
    """A new tdist.Tensor holding a copy of data (a numpy array, a torch tensor, or anything
    np.asarray accepts; dtype: a numpy dtype to convert to)."""
    if is_torch_tensor(data):
        import torch
        t = data.detach().cpu().contiguous()
        dt = _torch_tables()[0].get(t.dtype)
        if dt is None:
            raise TypeError("torch dtype %s has no tdist dtype" % t.dtype)
        bits = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        return _copy_bits(bits, dt, requires_grad)
    a = np.ascontiguousarray(np.asarray(data, dtype=dtype))
    dt = _NP.get(a.dtype)
    if dt is None:
        raise TypeError("numpy dtype %s has no tdist dtype" % a.dtype)
    return _copy_bits(a, dt, requires_grad)


def _copy_bits(a, dt, requires_grad):
    out = ffi.new("td_tensor **")
    check(lib.td_tensor_from_buffer(ffi.cast("void *", a.__array_interface__["data"][0]),
                                    a.shape, a.ndim, dt, out))
    t = Tensor(out[0])
    if requires_grad:
        t.requires_grad_(True)
    return t


def from_numpy(a):
    """A tdist.Tensor sharing numpy array a's memory (C-contiguous and writable; a is kept
    alive as long as tdist uses the memory)."""
    if not isinstance(a, np.ndarray):
        raise TypeError("from_numpy: expected a numpy array, got %s" % type(a).__name__)
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError("from_numpy: the array must be C-contiguous and writable (use "
                         "tdist.tensor for a copy)")
    return Tensor(borrow_numpy(a))
