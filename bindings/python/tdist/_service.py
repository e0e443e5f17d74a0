"""_service.py - Python objects lent to tdist, and the service thread that gives them back.

When tdist borrows the memory of a numpy array or a torch tensor, or holds a Python object in a
value ("python.object", e.g. an RRef's value), the object is kept in `_held` under an integer
key, and the key travels through C as the release callback's context. tdist may drop its last
reference on any of its threads, the network thread included, where taking the GIL would stall
the transport: the C glue (build_ffi.py) only queues the key. The service thread - a Python
thread, started by init_rpc or by the first loan - waits for the queue with the GIL released
and drops the objects; it also forwards tdist's log lines, captured the same way, to the
`tdist` logger of Python's logging.

THREAD SAFETY: hold/get from any Python thread (dict operations under the GIL).
"""
import itertools
import logging
import threading

from ._lib import ffi, lib

logger = logging.getLogger("tdist")
# td_log_level -> logging level (TRACE is below DEBUG)
_LEVELS = {0: 5, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_held = {}
_next_key = itertools.count(1)
_thread = None
_thread_lock = threading.Lock()
_capturing = False


def hold(obj):
    """Keeps obj alive until tdist releases the returned key (an int, never 0)."""
    key = next(_next_key)
    _held[key] = obj
    if _thread is None:
        start()
    return key


def get(key):
    return _held[key]


def forget(key):
    """Drops a key that tdist never took (the call that would have taken it failed)."""
    _held.pop(key, None)


def held_count():
    return len(_held)


def _release():
    buf = ffi.new("uintptr_t[256]")  # per call: take_releases runs without the GIL
    while True:
        n = lib.tdpy_take_releases(buf, 256)
        for i in range(n):
            _held.pop(int(buf[i]), None)
        if n < 256:
            return


def maybe_drain():
    """Releases what tdist gave back, if anything: the hot paths call this (a call, a handler)
    so that the service thread need not wake for every tensor."""
    if lib.tdpy_release_pending():
        _release()


def drain():
    """Releases what tdist gave back and forwards queued log lines. Any Python thread."""
    _release()
    level = ffi.new("int *")
    dropped = ffi.new("uint64_t *")
    line = ffi.new("char[1100]")
    while lib.tdpy_take_log(level, line, 1100, dropped):
        if dropped[0]:
            logger.warning("%d tdist log lines were dropped (the service thread fell behind)",
                           dropped[0])
        logger.log(_LEVELS.get(level[0], logging.ERROR), "%s",
                   ffi.string(line).decode("utf-8", "replace"))


def _run():
    while True:
        stop = lib.tdpy_service_wait(1000)  # GIL released while waiting
        drain()
        if stop:
            return


def start():
    global _thread
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="tdist-service", daemon=True)
            _thread.start()


def stop():
    """Stops the service thread after a last drain (interpreter exit, or a test)."""
    global _thread
    with _thread_lock:
        t, _thread = _thread, None
    if t is not None and t.is_alive() and t is not threading.current_thread():
        lib.tdpy_service_stop()
        t.join(10)
    drain()


def capture_logs(on):
    """Sends tdist's log lines to Python's logging (on) or back to standard error (off)."""
    global _capturing
    if on:
        start()
    lib.tdpy_log_capture(1 if on else 0)
    _capturing = bool(on)
    if not on:
        drain()


def python_level_to_td(level):
    """A logging level as the td_log_level that lets the same lines through."""
    if level <= 5:
        return 0
    if level <= logging.DEBUG:
        return 1
    if level <= logging.INFO:
        return 2
    if level <= logging.WARNING:
        return 3
    if level <= logging.ERROR:
        return 4
    return 5
