"""futures.py - tdist.Future: a td_future seen from Python (torch.futures.Future's shape).

wait() blocks in short slices of td_future_wait (GIL released, tdist/_timeouts.py), so Ctrl-C
raises KeyboardInterrupt within a slice and other Python threads run meanwhile; on the progress
thread of an agent in host mode each slice also runs the queued handlers and callbacks. value()
never blocks. then() and add_done_callback() run their callback once the future is done: on a
tdist pool thread in the default mode (completions are queued, and one thread at a time runs the
queued callbacks, so pool threads do not convoy on the GIL), on the progress thread in host mode,
or at once on the caller's thread when it is done already. `await fut` works in any
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
        if not lib.td_future_done(self._f):
            raise errors.StateError("tdist: the future is not done yet", 2)
        self._value = value_of(self._f)
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
        if lib.td_future_done(self._f):
            _run_callback(self, callback)
            return
        key = next(_next)
        _callbacks[key] = (self, callback)
        st = lib.td_future_on_done(self._f, _DONE, ffi.cast("void *", key))
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


_DONE = ffi.addressof(lib, "tdpy_future_done")  # C: queues the callback (build_ffi.py)


def _run_callback(fut, cb):
    try:
        cb(fut)
    except Exception:  # noqa: BLE001 - a callback's failure has nobody else to go to
        logger.exception("tdist: a future's done-callback raised")


@ffi.def_extern(onerror=lambda *exc: logger.error("tdist: error in a future callback",
                                                  exc_info=exc))
def tdpy_run_callback_now(key):
    """One callback, on this thread (the queue could not grow)."""
    fut, cb = _callbacks.pop(int(key))
    _run_callback(fut, cb)


@ffi.def_extern(onerror=lambda *exc: logger.error("tdist: error in a future callback",
                                                  exc_info=exc))
def tdpy_drain_callbacks():
    """Runs the queued callbacks of done futures (one thread at a time takes this role; see
    build_ffi.py, "Python future callbacks, combined")."""
    fp = ffi.new("td_future **")
    kp = ffi.new("uintptr_t *")
    while True:
        while lib.tdpy_cb_next(fp, kp):
            lib.td_future_unref(fp[0])  # the queue's reference; the Future holds its own
            fut, cb = _callbacks.pop(int(kp[0]))
            _run_callback(fut, cb)
            if not lib.tdpy_cb_reacquire():
                return
        if not lib.tdpy_cb_reacquire():
            return


def value_of(f):
    """The value of done td_future* f (raises its failure)."""
    v = ffi.new("td_value **")
    st = lib.tdpy_future_outcome(f, v)
    if st != 0:
        raise errors.from_status(st, ffi.string(lib.td_future_message(f)).decode(
            "utf-8", "replace"))
    return from_value(v[0]) if v[0] != NULL else None


_TIMEOUT = errors.TimeoutError.status


def wait_ptr(f, timeout):
    """Waits for td_future* f (timeout in seconds, None: no limit) in interruptible slices;
    returns whether it is done."""
    if timeout is None:
        while True:  # td_future_wait returns the future's status once done, else TIMEOUT
            if lib.td_future_wait(f, _timeouts.SLICE_MS) != _TIMEOUT or lib.td_future_done(f):
                return True
    for ms in _timeouts.slices(timeout):
        lib.td_future_wait(f, ms)
        if lib.td_future_done(f):
            return True
    return bool(lib.td_future_done(f))


def wait_all(futures, timeout=None):
    """Waits for every future and returns their values in order. Returns early with the first
    failure it sees (the failed future with the lowest index among those done: its exception),
    as torch.futures.wait_all does, instead of waiting for the others; tdist.TimeoutError when
    timeout seconds (None: no limit) pass first. Interruptible (Ctrl-C) like Future.wait."""
    futures = list(futures)
    if not futures:
        return []
    arr = ffi.new("td_future *[]", [f._f for f in futures])
    n = len(futures)
    for ms in _timeouts.slices(timeout):
        st = lib.td_future_wait_all(arr, n, ms)
        if st != errors.TimeoutError.status or all(lib.td_future_done(f._f) for f in futures):
            break
    for f in futures:  # a failure (lowest index first), else every value
        if lib.td_future_done(f._f) and lib.td_future_status(f._f) != 0:
            f.value()  # raises its exception
    if not all(lib.td_future_done(f._f) for f in futures):
        raise errors.TimeoutError("wait_all: %d of %d futures not done after %.3f s" % (
            sum(1 for f in futures if not lib.td_future_done(f._f)), n, timeout), 9)
    return [f.value() for f in futures]
