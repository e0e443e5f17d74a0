"""futures.py - tdist.Future: a td_future seen from Python (torch.futures.Future's shape).

wait() blocks in short slices of td_future_wait (GIL released, tdist/_timeouts.py), so Ctrl-C
raises KeyboardInterrupt within a slice and other Python threads run meanwhile; on the progress
thread of an agent in host mode each slice also runs the queued handlers and callbacks. value()
never blocks. then() and add_done_callback() run their callback once the future is done: on the
thread that completed it (a pool thread of tdist in the default mode, the progress thread in
host mode), or at once on the caller's thread when it is done already. `await fut` works in any
asyncio loop (the wake-up goes through loop.call_soon_threadsafe), in both modes.

A failed future raises the exception of its status (tdist.errors) from wait() and value().
"""
import itertools
import logging

from . import _timeouts, errors
from ._convert import from_value, to_value
from ._lib import NULL, check, cstr, ffi, lib

logger = logging.getLogger("tdist")
_callbacks = {}  # key -> (future, callback): alive until the callback ran
_next = itertools.count(1)
_MISSING = object()


class Future:
    """The outcome of an asynchronous call (or one made by set_result / set_exception)."""

    __slots__ = ("_f", "_value", "__weakref__")

    def __init__(self, _ptr=None):
        """A new pending future (complete it with set_result or set_exception)."""
        if _ptr is None:
            _ptr = lib.td_future_create()
            if _ptr == NULL:
                raise MemoryError("tdist: out of memory")
        self._f = ffi.gc(_ptr, lib.td_future_unref)
        self._value = _MISSING

    def done(self):
        return bool(lib.td_future_done(self._f))

    def wait(self, timeout=None):
        """Blocks until done (timeout: seconds, None = no limit) and returns the value, or
        raises the failure (tdist.TimeoutError when the wait itself runs out)."""
        if not wait_ptr(self._f, timeout):
            raise errors.TimeoutError("future not done after %.3f s" % timeout, 9)
        return self.value()

    def value(self):
        """The value of a done future (raises its failure; StateError while pending)."""
        if self._value is not _MISSING:
            return self._value
        f = self._f
        if not lib.td_future_done(f):
            raise errors.StateError("tdist: the future is not done yet", 2)
        st = lib.td_future_status(f)
        if st != 0:
            raise errors.from_status(st, ffi.string(lib.td_future_message(f)).decode(
                "utf-8", "replace"))
        v = lib.td_future_value(f)
        self._value = from_value(v)
        return self._value

    def exception(self):
        """The exception of a failed done future, else None."""
        try:
            self.value()
        except errors.Error as e:
            return e
        return None

    def add_done_callback(self, callback):
        """Runs callback(self) once the future is done (see the module's notes for where)."""
        key = next(_next)
        _callbacks[key] = (self, callback)
        st = lib.td_future_on_done(self._f, lib.tdpy_future_done, ffi.cast("void *", key))
        if st != 0:
            _callbacks.pop(key, None)
            check(st)

    def then(self, callback):
        """A new Future completed with callback(self)'s result (or failed with its exception);
        a Future returned by callback is followed."""
        nxt = Future()

        def settle(src):
            try:
                r = callback(src)
            except BaseException as e:  # noqa: B902 - reported through the future
                nxt.set_exception(e)
                return
            if isinstance(r, Future):
                r.add_done_callback(lambda done: _copy_outcome(done, nxt))
            else:
                nxt.set_result(r)

        self.add_done_callback(settle)
        return nxt

    def set_result(self, result):
        """Completes the future with result (data, or any object kept in this process)."""
        check(lib.td_future_complete(self._f, to_value(result, strict=False)))

    def set_exception(self, exc):
        """Fails the future with exc's status and text."""
        st = errors.status_of(exc)
        check(lib.tdpy_future_fail(self._f, st, cstr(errors.describe(exc))))

    def __await__(self):
        if not lib.td_future_done(self._f):
            import asyncio
            loop = asyncio.get_running_loop()
            woken = loop.create_future()

            def wake(_f):
                try:
                    loop.call_soon_threadsafe(_set_done, woken)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass

            self.add_done_callback(wake)
            yield from woken.__await__()
        return self.value()

    def __repr__(self):
        if not self.done():
            return "<tdist.Future pending>"
        st = lib.td_future_status(self._f)
        return "<tdist.Future %s>" % ("done" if st == 0 else errors.STATUS_NAMES.get(st))


def _set_done(af):
    if not af.done():
        af.set_result(None)


def _copy_outcome(src, dst):
    try:
        dst.set_result(src.value())
    except BaseException as e:  # noqa: B902
        dst.set_exception(e)


@ffi.def_extern(onerror=lambda *exc: logger.error("tdist: error in a future callback",
                                                  exc_info=exc))
def tdpy_future_done(f, ctx):
    fut, cb = _callbacks.pop(int(ffi.cast("uintptr_t", ctx)))
    try:
        cb(fut)
    except Exception:  # noqa: BLE001 - a callback's failure has nobody else to go to
        logger.exception("tdist: a future's done-callback raised")


def wait_ptr(f, timeout):
    """Waits for td_future* f (timeout in seconds, None: no limit) in interruptible slices;
    returns whether it is done."""
    for ms in _timeouts.slices(timeout):
        lib.td_future_wait(f, ms)
        if lib.td_future_done(f):
            return True
    return bool(lib.td_future_done(f))


def wait_all(futures, timeout=None):
    """Waits for every future and returns their values in order; raises the first failure."""
    return [f.wait(timeout) for f in futures]
