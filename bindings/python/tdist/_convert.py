"""_convert.py - Python objects <-> tdist values (td_value trees). Only data travels, never
pickled code or objects:

    None, bool, int (int64), float, str, bytes (bytearray, memoryview), list (tuple), dict with
    str keys, numpy arrays and torch CPU tensors (zero-copy, see _tensor.py), tdist.Tensor,
    tdist.RRef.

numpy scalars count as the Python number they hold. Anything else is refused in arguments
(TypeError naming the type) - but a registered function may return any Python object, and a
local RRef may hold one: such objects become "python.object" values, which stay in their
process (the RRef's owner keeps the object; sending one is an error) and come back as the very
same object. Tuples arrive as lists; strings are UTF-8 (invalid bytes from C arrive as
surrogate escapes).
"""
import sys

import numpy as np

from . import _service, _tensor
from ._lib import NULL, check, cstr, ffi, lib
from ._state import state

PYOBJ = b"python.object"
OBJECT_DESTROY = ffi.addressof(lib, "tdpy_object_destroy")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
RREF_CLASS = None  # set by rref.py


class OpaqueValue:
    """A tdist value this binding has no Python type for (an object of a C type, e.g. an
    nn.Module held by an RRef's owner): it can only be passed back to tdist."""

    __slots__ = ("_v",)

    def __init__(self, v):
        self._v = ffi.gc(lib.td_value_ref(v), lib.td_value_unref)

    @property
    def kind(self):
        return ffi.string(lib.td_value_kind_name(self._v)).decode()

    def __repr__(self):
        buf = ffi.new("char[200]")
        return "tdist.OpaqueValue(%s)" % ffi.string(lib.td_value_to_string(self._v, buf, 200))\
            .decode("utf-8", "replace")


def _new(v):
    if v == NULL:
        raise MemoryError("tdist: out of memory building a value")
    return v


def _object(obj):
    key = _service.hold(obj)
    out = ffi.new("td_value **")
    st = lib.td_value_object(PYOBJ, ffi.cast("void *", key), out)
    if st != 0:
        _service.forget(key)
        check(st)
    return out[0]


def _tensor_value(t):
    """td_value for a new td_tensor* reference t (which it consumes)."""
    v = lib.td_value_tensor(t)
    lib.td_tensor_unref(t)
    return _new(v)


def to_value(obj, strict=True):
    """A new td_value* (caller releases it with td_value_unref) for obj. strict: refuse objects
    that are not data (arguments); otherwise wrap them as python.object values (results)."""
    if obj is None:
        return lib.td_value_none()
    t = type(obj)
    if t is bool:
        return lib.td_value_bool(obj)
    if t is int:
        if not INT64_MIN <= obj <= INT64_MAX:
            raise OverflowError("tdist: int %d does not fit in int64" % obj)
        return _new(lib.td_value_int(obj))
    if t is float:
        return _new(lib.td_value_double(obj))
    if t is str:
        b = obj.encode("utf-8", "surrogateescape")
        return _new(lib.td_value_string_n(b, len(b)))
    if t is bytes:
        return _new(lib.td_value_bytes(obj, len(obj)))
    if t is list or t is tuple:
        return _list(obj, strict)
    if t is dict:
        return _dict(obj, strict)
    if t is np.ndarray:
        return _tensor_value(_tensor.borrow_numpy(obj))
    if _tensor.is_torch_tensor(obj):
        return _tensor_value(_tensor.borrow_torch(obj))
    if t is _tensor.Tensor:
        return _new(lib.td_value_tensor(obj._t))
    if RREF_CLASS is not None and t is RREF_CLASS:
        return _new(lib.td_value_rref(obj._r))
    if t is OpaqueValue:
        return lib.td_value_ref(obj._v)
    # subclasses and other spellings of the same data
    if isinstance(obj, bool) or isinstance(obj, np.bool_):
        return lib.td_value_bool(bool(obj))
    if isinstance(obj, (int, np.integer)):
        return to_value(int(obj))
    if isinstance(obj, (float, np.floating)):
        return _new(lib.td_value_double(float(obj)))
    if isinstance(obj, str):
        return to_value(str(obj))
    if isinstance(obj, (bytearray, memoryview)) or isinstance(obj, bytes):
        return to_value(bytes(obj))
    if isinstance(obj, (list, tuple)):
        return _list(obj, strict)
    if isinstance(obj, dict):
        return _dict(obj, strict)
    if isinstance(obj, np.ndarray):  # a subclass: its own memory, the object kept alive
        return _tensor_value(_tensor.borrow_numpy(obj))
    if RREF_CLASS is not None and isinstance(obj, RREF_CLASS):  # tdist.torch_rpc.RRef
        return _new(lib.td_value_rref(obj._r))
    if strict:
        raise TypeError(
            "tdist cannot send a %s: only None, bool, int, float, str, bytes, list, tuple, "
            "dict (str keys), numpy arrays, torch CPU tensors, tdist.Tensor and tdist.RRef "
            "travel (no pickle)" % type(obj).__name__)
    return _object(obj)


def _fill(container, pairs, add, strict):
    """Adds to_value(x) for each (key, x) of pairs to container with add(container, key, v),
    which takes v on success; on any failure releases container and raises."""
    try:
        for k, x in pairs:
            v = to_value(x, strict)
            st = add(container, k, v)
            if st != 0:
                lib.td_value_unref(v)
                check(st)
    except BaseException:
        lib.td_value_unref(container)
        raise
    return container


def _str_key(k):
    if not isinstance(k, str):
        raise TypeError("tdist: dict keys must be str, got %s" % type(k).__name__)
    return cstr(k)


def _list(items, strict):
    return _fill(_new(lib.td_value_list()), ((None, x) for x in items),
                 lambda c, _k, v: lib.td_value_list_append(c, v), strict)


def _dict(d, strict):
    return _fill(_new(lib.td_value_dict()), ((_str_key(k), x) for k, x in d.items()),
                 lib.td_value_dict_set, strict)


def tensor_out(t):
    """A Python tensor for td_tensor* t (borrowed), per init_rpc(tensor_type=...)."""
    if lib.td_tensor_requires_grad(t):
        return _tensor.Tensor(lib.td_tensor_ref(t))
    kind = state.tensor_type
    if kind == "auto":
        kind = "torch" if sys.modules.get("torch") is not None else "numpy"
    if kind == "torch":
        return _tensor.torch_view(t)
    if kind == "tdist" or lib.td_tensor_dtype(t) == lib.TD_DTYPE_BF16:
        return _tensor.Tensor(lib.td_tensor_ref(t))  # numpy has no bfloat16
    return _tensor.numpy_view(t)


_K_INT, _K_NONE, _K_BOOL, _K_DOUBLE = (lib.TD_VALUE_INT, lib.TD_VALUE_NONE, lib.TD_VALUE_BOOL,
                                       lib.TD_VALUE_DOUBLE)
PLAIN = frozenset((type(None), bool, int, float, str, bytes, list, dict))  # never awaitable


def from_value(v):
    """The Python object for td_value* v (borrowed)."""
    s = lib.tdpy_scalar(v)
    k = s.kind
    if k == _K_INT:
        return s.i
    if k == _K_NONE:
        return None
    if k == _K_BOOL:
        return bool(s.i)
    if k == _K_DOUBLE:
        return s.d
    if k == lib.TD_VALUE_STRING:
        s, n = ffi.new("char **"), ffi.new("size_t *")
        lib.td_value_as_string(v, s, n)
        return ffi.unpack(s[0], n[0]).decode("utf-8", "surrogateescape")
    if k == lib.TD_VALUE_BYTES:
        d, n = ffi.new("void **"), ffi.new("size_t *")
        lib.td_value_as_bytes(v, d, n)
        return ffi.unpack(ffi.cast("char *", d[0]), n[0]) if n[0] else b""
    if k == lib.TD_VALUE_TENSOR:
        t = ffi.new("td_tensor **")
        check(lib.td_value_as_tensor(v, t))
        return tensor_out(t[0])
    if k == lib.TD_VALUE_LIST:
        return [from_value(lib.td_value_list_get(v, i)) for i in range(lib.td_value_list_len(v))]
    if k == lib.TD_VALUE_DICT:
        out = {}
        key, item = ffi.new("char **"), ffi.new("td_value **")
        for i in range(lib.td_value_dict_len(v)):
            check(lib.td_value_dict_entry(v, i, key, item))
            out[ffi.string(key[0]).decode("utf-8", "surrogateescape")] = from_value(item[0])
        return out
    return _ext(v)


def _ext(v):
    typ = lib.td_value_object_type(v)
    if typ != NULL and ffi.string(typ) == PYOBJ:
        p = ffi.new("void **")
        check(lib.td_value_as_object(v, PYOBJ, p))
        return _service.get(int(ffi.cast("uintptr_t", p[0])))
    r = ffi.new("td_rref **")
    if RREF_CLASS is not None and lib.td_value_as_rref(v, r) == 0:
        return RREF_CLASS(_ptr=lib.td_rref_ref(r[0]))
    lib.td_clear_error()
    return OpaqueValue(v)


def register_object_type():
    """Registers "python.object" with tdist (at init_rpc; idempotent)."""
    check(lib.td_object_type_register(PYOBJ, OBJECT_DESTROY))


def values_list(args, strict=True):
    """[new td_value*] for a call's arguments (released on failure)."""
    vals = []
    try:
        for a in args:
            vals.append(to_value(a, strict))
    except BaseException:
        release_values(vals)
        raise
    return vals


def values_array(args, strict=True):
    """(list of new td_value*, ffi array of them) for a call's arguments; release the list with
    release_values."""
    vals = []
    try:
        for a in args:
            vals.append(to_value(a, strict))
    except BaseException:
        release_values(vals)
        raise
    return vals, (ffi.new("td_value *[]", vals) if vals else NULL)


def release_values(vals):
    for v in vals:
        lib.td_value_unref(v)
