"""errors.py - tdist's status codes as Python exceptions, both ways.

Every failure of a tdist call raises a subclass of tdist.Error carrying `status` (the td_status
number), `status_name` ("TD_ERR_TIMEOUT"), `message` (tdist's text) and, when the message names
a worker ("worker1 (rank 1)"), `worker` and `rank`. Each status has its own class, which also
derives from the closest built-in exception (tdist.TimeoutError is a TimeoutError,
tdist.InvalidArgumentError a ValueError, ...), so code can catch either.

A failure that happened on another worker - the remote function raised, or refused the call -
has a message with that worker's prefix ("worker1 (rank 1): ..."); it raises a class deriving from both
tdist.RemoteError and the status's class (a ValueError raised remotely is caught by
`except tdist.RemoteError` and by `except ValueError`). When a Python function raised a built-in
exception, the class also derives from that built-in (a remote TypeError is a TypeError, a remote
KeyError a KeyError). Only the exception's type name and text cross (never a pickled exception):
"worker1 (rank 1): 'fn' failed: ValueError: bad input". tdist.torch_rpc keeps user exception
classes too, with the remote traceback (it sends exceptions as data).

The other way round, an exception raised by a registered Python function becomes the status of
the reply (status_of) and the text "<Type>: <message> (at file:line in function)".
"""
import builtins
import re
import traceback

# td_status numbers (include/tdist/status.h, TD_STATUS_MAP); tests check them against the
# library's td_status_name.
OK = 0
STATUS_NAMES = {
    0: "TD_OK", 1: "TD_ERR_INVALID", 2: "TD_ERR_STATE", 3: "TD_ERR_NOMEM", 4: "TD_ERR_SHAPE",
    5: "TD_ERR_DTYPE", 6: "TD_ERR_DEVICE", 7: "TD_ERR_IO", 8: "TD_ERR_FORMAT", 9: "TD_ERR_TIMEOUT",
    10: "TD_ERR_NOT_FOUND", 11: "TD_ERR_EXISTS", 12: "TD_ERR_REMOTE", 13: "TD_ERR_CANCELLED",
    14: "TD_ERR_UNAVAILABLE", 15: "TD_ERR_UNSUPPORTED", 16: "TD_ERR_INTERNAL", 17: "TD_ERR_AUTH",
}
_WORKER_RE = re.compile(r"([^\s()'\",:]+) \(rank (-?\d+)\)")
# tdist prefixes what a worker reports with "<name> (rank r): "
_REMOTE_RE = re.compile(r"([^\s()'\",:]+) \(rank (-?\d+)\): ")


class Error(Exception):
    """Base class of tdist's exceptions."""

    status = 16  # TD_ERR_INTERNAL unless a subclass says otherwise

    def __init__(self, message, status=None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message
        m = _REMOTE_RE.search(message) or _WORKER_RE.search(message)
        self.worker = m.group(1) if m else None
        self.rank = int(m.group(2)) if m else None

    @property
    def status_name(self):
        return STATUS_NAMES.get(self.status, "TD_UNKNOWN")

    def __str__(self):
        return self.message  # also for classes that mix in KeyError (whose str() quotes)


class InvalidArgumentError(Error, ValueError):
    status = 1


class StateError(Error, RuntimeError):
    status = 2


class OutOfMemoryError(Error, MemoryError):
    status = 3


class ShapeError(Error, ValueError):
    status = 4


class DtypeError(Error, TypeError):
    status = 5


class DeviceError(Error, ValueError):
    status = 6


class InputOutputError(Error, OSError):
    status = 7


class FormatError(Error, ValueError):
    status = 8


class TimeoutError(Error, builtins.TimeoutError):
    status = 9


class NotFoundError(Error, LookupError):
    status = 10


class AlreadyExistsError(Error, ValueError):
    status = 11


class RemoteError(Error, RuntimeError):
    """A failure on another worker (also the base of every remote failure's class)."""

    status = 12


class CancelledError(Error, RuntimeError):
    status = 13


class UnavailableError(Error, ConnectionError):
    """The peer is gone or cannot be reached (its name is in .worker)."""

    status = 14


class UnsupportedError(Error, NotImplementedError):
    status = 15


class InternalError(Error, RuntimeError):
    status = 16


class AuthError(Error, PermissionError):
    status = 17


class ForkError(Error, RuntimeError):
    """fork() while tdist runs (see tdist.rpc: what is refused and what cannot be)."""

    status = 2


_BY_STATUS = {c.status: c for c in (
    InvalidArgumentError, StateError, OutOfMemoryError, ShapeError, DtypeError, DeviceError,
    InputOutputError, FormatError, TimeoutError, NotFoundError, AlreadyExistsError, RemoteError,
    CancelledError, UnavailableError, UnsupportedError, InternalError, AuthError)}
_REMOTE = {}


def _remote_class(cls):
    if cls is RemoteError:
        return RemoteError
    rc = _REMOTE.get(cls)
    if rc is None:
        rc = type("Remote" + cls.__name__, (RemoteError, cls), {"status": cls.status,
                                                               "__module__": __name__})
        _REMOTE[cls] = rc
    return rc


# "... 'fn' failed: KeyError: ..." - what a Python handler's exception looks like (describe())
_RAISED_RE = re.compile(r"failed: ([A-Za-z_][A-Za-z0-9_]*): ")
_KEEP = {}  # (tdist class, built-in) -> the class deriving from both


def _with_builtin(cls, message):
    """cls, also deriving from the built-in exception a Python handler raised (named in the
    message), when there is one and the two can be combined."""
    m = _RAISED_RE.search(message)
    b = getattr(builtins, m.group(1), None) if m else None
    if not (isinstance(b, type) and issubclass(b, Exception)) or issubclass(cls, b):
        return cls
    key = (cls, b)
    if key not in _KEEP:
        try:
            _KEEP[key] = type(cls.__name__.replace("Error", "") + b.__name__, (cls, b),
                              {"status": cls.status, "__module__": __name__})
        except TypeError:  # incompatible layouts (e.g. UnicodeError's): the tdist class alone
            _KEEP[key] = cls
    return _KEEP[key]


def from_status(status, message):
    """The exception for a failed td_status and its message."""
    cls = _BY_STATUS.get(int(status), Error)
    if _REMOTE_RE.search(message):  # "<worker> (rank r): ..." came from there
        cls = _with_builtin(_remote_class(cls), message)
    try:
        return cls(message, int(status))
    except TypeError:  # a built-in whose constructor wants more (rare): the tdist class alone
        return _remote_class(_BY_STATUS.get(int(status), Error))(message, int(status))


def status_of(exc):
    """The td_status a registered function's exception turns into."""
    if isinstance(exc, Error):
        return exc.status
    for typ, st in ((builtins.TimeoutError, 9), (KeyboardInterrupt, 13), (MemoryError, 3),
                    (NotImplementedError, 15), (LookupError, 10), (ConnectionError, 14),
                    (PermissionError, 17), (OSError, 7), (ValueError, 1), (TypeError, 1)):
        if isinstance(exc, typ):
            return st
    return RemoteError.status


def describe(exc):
    """'<Type>: <message> (at file:line in function)' for a handler's exception."""
    text = "%s: %s" % (type(exc).__name__, exc)
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        f = tb[-1]
        text += " (at %s:%d in %s)" % (f.filename.rsplit("/", 1)[-1], f.lineno, f.name)
    return text
