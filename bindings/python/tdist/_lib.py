"""_lib.py - the compiled extension (ffi, lib) and the helpers every module uses to call it."""
from ._tdist_cffi import ffi, lib  # noqa: F401  (built by bindings/python/CMakeLists.txt)
from . import errors

NULL = ffi.NULL


def last_error():
    return ffi.string(lib.td_last_error()).decode("utf-8", "replace")


def check(status):
    """Raises the exception of a failed call (td_last_error of this thread holds the detail)."""
    if status != 0:
        raise errors.from_status(status, last_error())


def cstr(s):
    """A Python str as the bytes a C string argument takes."""
    if isinstance(s, bytes):
        return s
    return s.encode("utf-8")


def pystr(p):
    return ffi.string(p).decode("utf-8", "surrogateescape") if p != NULL else None
