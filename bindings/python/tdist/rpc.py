"""rpc.py - the agent from Python: init_rpc, register, rpc_sync, rpc_async, remote,
get_worker_info, progress, shutdown (torch.distributed.rpc's shape, over tdist's C API).

Functions are registered by name (tdist.register) in every process that serves them, C or
Python: a call names the function, and only the name and the arguments' data travel. A Python
function may be called from C workers and the reverse.

Threads. In the default mode (progress="threads") tdist's pool threads run registered Python
functions (cffi takes the GIL for each call) - never the network thread; blocking calls
(rpc_sync, Future.wait, RRef.to_here, init_rpc) release the GIL. With progress="host" nothing
of tdist calls into Python on its own: the program runs the queued handlers and callbacks on
its thread with tdist.progress() when tdist.progress_fd() becomes readable (tdist.asyncio does
this for an asyncio loop).

fork(). A process that runs tdist has threads that a fork() child would not have, so the child
could not use tdist (and could deadlock on locks held at the fork). Between init_rpc and
shutdown, os.fork and os.forkpty are replaced by functions that raise tdist.ForkError
(multiprocessing's "fork" start method goes through os.fork, so it is refused too; subprocess
and the "spawn" method are not affected). What cannot be enforced: a fork() made by C code, or
through a reference to os.fork taken before init_rpc; the child of such a fork has every tdist
call raise tdist.ForkError, and does not shut the parent's agent down at exit.
"""
import atexit
import collections
import os
import threading
import time

from . import _convert, _service, _timeouts, errors
from ._lib import NULL, check, cstr, ffi, lib, pystr
from ._state import agent as _agent, state
from .futures import Future, value_of, wait_ptr

WorkerInfo = collections.namedtuple("WorkerInfo", "name id address")
WorkerInfo.__doc__ = "A worker's name, rank (id) and the address its server listens on."
CallerInfo = collections.namedtuple("CallerInfo", "name rank")

_functions = {}   # name -> function
_by_key = {}      # key -> function (the user_data of its C registration)
_names = {}       # function -> name
_keys = {}        # name -> key
_next_key = [0]
_local = threading.local()  # .caller: the CallerInfo of the request this thread serves
_real_fork = {}
_name_cache = {}


# ---- registration ----

def register(fn=None, *, name=None):
    """Registers fn under name (default: fn.__name__) so that other workers can call it by that
    name; usable as a decorator (@tdist.register or @tdist.register(name="x")). Register in
    every process before init_rpc: workers publish their function lists at init, and a call
    naming a function the callee did not publish is refused at once. fn may also be a class
    (remote(to, Cls, args) makes an object on `to`) or an unbound method (RRef proxies call
    it with the RRef's value as first argument)."""
    if fn is None:
        return lambda f: register(f, name=name)
    if not callable(fn):
        raise TypeError("tdist.register: %r is not callable" % (fn,))
    n = name or getattr(fn, "__name__", None)
    if not n:
        raise ValueError("tdist.register: give a name for %r" % (fn,))
    _next_key[0] += 1
    key = _next_key[0]
    check(lib.td_rpc_register(cstr(n), lib.tdpy_dispatch, ffi.cast("void *", key)))
    _functions[n] = fn
    _by_key[key] = fn
    _keys[n] = key
    _names.setdefault(fn, n)
    return fn


def unregister(name):
    """Removes a registration; calls arriving afterwards fail with tdist.NotFoundError."""
    check(lib.td_rpc_unregister(cstr(name)))
    fn = _functions.pop(name, None)
    _by_key.pop(_keys.pop(name, None), None)
    if fn is not None and _names.get(fn) == name:
        del _names[fn]


def current_caller():
    """The (name, rank) of the worker whose request this thread is serving, or None."""
    c = getattr(_local, "caller", None)
    if c is None or type(c) is CallerInfo:
        return c
    c = _local.caller = CallerInfo(pystr(lib.td_rpc_ctx_caller_name(c)),
                                   lib.td_rpc_ctx_caller_rank(c))  # made when asked for
    return c


def _dispatch_onerror(exc, value, tb):
    return errors.InternalError.status


@ffi.def_extern(onerror=_dispatch_onerror)
def tdpy_dispatch(ctx, args, nargs, result, async_result):
    """Runs a registered Python function for a request (GIL held by cffi)."""
    prev = getattr(_local, "caller", None)
    try:
        if state.agent is None and state.starting:
            _publish(lib.td_rpc_ctx_agent(ctx))
        if lib.tdpy_release_pending():
            _service.maybe_drain()
        fn = _by_key[int(ffi.cast("uintptr_t", lib.td_rpc_ctx_user_data(ctx)))]
        _local.caller = ctx  # current_caller() makes the CallerInfo if it is asked for
        out = fn(*[_convert.from_value(args[i]) for i in range(nargs)])
        t = type(out)
        if t is Future:
            async_result[0] = lib.td_future_ref(out._f)
        elif t not in _convert.PLAIN and hasattr(out, "__await__") and hasattr(out, "send"):
            async_result[0] = lib.td_future_ref(_from_coroutine(out)._f)
        else:
            result[0] = _convert.to_value(out, strict=False)
        return 0
    except BaseException as e:  # noqa: B902 - every failure becomes the reply's error
        if isinstance(e, KeyboardInterrupt):
            state.pending_interrupt = e  # re-raised by progress() on the host's thread
        return lib.tdpy_set_error(errors.status_of(e), cstr(errors.describe(e)))
    finally:
        _local.caller = prev


def _from_coroutine(coro):
    """A Future completed by coroutine coro, run as a task of the running asyncio loop (host
    mode under tdist.asyncio, where handlers run inside the loop)."""
    import asyncio
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        coro.close()
        raise errors.StateError("a coroutine function needs an asyncio loop running the "
                                "handlers: init_rpc(progress='host') and tdist.asyncio.attach()",
                                2) from None
    fut = Future()
    task = loop.create_task(coro)

    def done(t):
        if t.cancelled():
            fut.set_exception(errors.CancelledError("the handler's task was cancelled", 13))
        elif t.exception() is not None:
            fut.set_exception(t.exception())
        else:
            fut.set_result(t.result())

    task.add_done_callback(done)
    return fut


# ---- init and shutdown ----

def _options(opts, keep, *, init_method, secret, rpc_timeout, init_timeout, num_worker_threads,
             listen_addr, insecure, progress, max_world_size=None):
    lib.td_rpc_options_init(opts)
    if max_world_size is not None:
        opts.max_world_size = int(max_world_size)
    if init_method is not None:
        keep.append(ffi.new("char[]", cstr(init_method)))
        opts.init_method = keep[-1]
    if secret is not None:
        keep.append(ffi.new("char[]", cstr(secret)))
        opts.secret = keep[-1]
    if listen_addr is not None:
        keep.append(ffi.new("char[]", cstr(listen_addr)))
        opts.listen_addr = keep[-1]
    if rpc_timeout is not None:
        opts.rpc_timeout_ms = _timeouts.call_ms(rpc_timeout)
    if init_timeout is not None:
        opts.init_timeout_ms = max(1, int(init_timeout * 1000))
    if num_worker_threads is not None:
        opts.num_worker_threads = int(num_worker_threads)
    if insecure:
        opts.insecure = 1
    if progress not in ("threads", "host"):
        raise ValueError("progress must be 'threads' or 'host', got %r" % (progress,))
    opts.progress = lib.TD_RPC_PROGRESS_HOST if progress == "host" else lib.TD_RPC_PROGRESS_THREADS


def init_rpc(name=None, rank=None, world_size=None, *, rpc_backend_options=None,
             init_method=None, secret=None, rpc_timeout=None, init_timeout=None,
             num_worker_threads=None, listen_addr=None, insecure=False, progress="threads",
             tensor_type="auto", backend=None, max_world_size=None):
    """Joins the group as worker `name` (None: "worker<rank>") and returns its WorkerInfo.

    rank and world_size: both given, or both None to read RANK / WORLD_SIZE (as tdistrun and
    torchrun set them; Slurm and Open MPI variables as fallbacks).
    max_world_size: an elastic group's places (default: TD_RPC_MAX_WORLD_SIZE, else world_size);
    rank -1 (RANK=-1, as tdistrun --nnodes MIN:MAX gives the workers of a node past MIN) joins
    the running group in its next free place (README, "Running workers").
    init_method: "tcp://host:port" of rank 0's store; None or "env://" (default) read
    MASTER_ADDR / MASTER_PORT from the environment, whether or not rank is given.
    secret: the group's shared secret (default: TD_RPC_SECRET / TD_RPC_SECRET_FILE from the
    environment; docs/SECURITY.md). rpc_timeout: default per-call timeout in seconds (0: none;
    default 60). init_timeout: seconds to wait for every worker (default 120).
    num_worker_threads: threads running registered functions (default 16). progress: "threads"
    (tdist's pool runs handlers) or "host" (the program runs them with tdist.progress()).
    tensor_type: what tensors arrive as - "auto" (torch when torch is imported, else numpy),
    "numpy", "torch" or "tdist". rpc_backend_options: an object with init_method,
    num_worker_threads and rpc_timeout attributes (e.g. torch's TensorPipeRpcBackendOptions),
    read for the fields not given directly. backend is accepted for torch compatibility and
    ignored. Blocks until every worker joined; Ctrl-C interrupts the wait."""
    _agent_free()
    if tensor_type not in ("auto", "numpy", "torch", "tdist"):
        raise ValueError("tensor_type must be 'auto', 'numpy', 'torch' or 'tdist'")
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither (to read the environment)")
    o = rpc_backend_options
    if o is not None:
        init_method = init_method if init_method is not None else getattr(o, "init_method", None)
        if num_worker_threads is None:
            num_worker_threads = getattr(o, "num_worker_threads", None)
        if rpc_timeout is None:
            rpc_timeout = getattr(o, "rpc_timeout", None)
    keep = []
    opts = ffi.new("td_rpc_options *")
    _options(opts, keep, init_method=init_method, secret=secret, rpc_timeout=rpc_timeout,
             init_timeout=init_timeout, num_worker_threads=num_worker_threads,
             listen_addr=listen_addr, insecure=insecure, progress=progress,
             max_world_size=max_world_size)
    _setup_logging()
    _convert.register_object_type()
    state.host_progress = progress == "host"
    state.tensor_type = tensor_type
    a = _init_interruptibly(name, rank, world_size, opts, keep)
    if state.host_progress:
        lib.td_rpc_progress(a, 0)  # this thread becomes the progress thread (runs nothing yet)
    return get_worker_info()


def _publish(a):
    """Makes td_rpc_agent* a the process's agent (GIL held; idempotent). Called by the init
    thread as soon as td_rpc_init returns, or earlier by the first handler: other workers may
    call this one as soon as they have joined, and tdist runs their requests once this worker's
    init is complete in C - possibly before td_rpc_init has returned here - so a handler must
    find the agent in place (tdist.get_worker_info(), nested calls, RRefs)."""
    if state.agent is not None or not state.starting:
        return
    wi = ffi.new("td_worker_info *")
    check(lib.td_rpc_self(a, wi))
    state.name, state.rank = ffi.string(wi.name).decode(), wi.id
    state.world_size = lib.td_rpc_world_size(a)
    state.agent = a
    state.starting = False
    _guard_fork(True)


def _agent_free():
    if state.forked:
        _agent()  # raises ForkError
    if state.agent is not None:
        raise errors.StateError("tdist: init_rpc was already called in this process (call "
                                "shutdown first)", 2)


# inits the caller gave up on (their threads' "done" events): _at_exit waits for them (the process must not exit while a
# thread is inside tdist: libcrypto's exit-time cleanup would pull its state away from under it)
_abandoned_inits = []


def _init_interruptibly(name, rank, world_size, opts, keep):
    """td_rpc_init on a helper thread while this one waits in slices (Ctrl-C works); when the
    caller gives up, td_rpc_init_interrupt makes the init return within about 0.3 s, and an agent
    whose init finished meanwhile is shut down at once."""
    res = {"gave_up": False}
    lock = threading.Lock()
    done = threading.Event()
    cname = ffi.new("char[]", cstr(name)) if name is not None else NULL

    def dispose(a):
        lib.td_rpc_shutdown(a, False, 0)
        lib.td_rpc_destroy(a)

    def run():
        try:
            out = ffi.new("td_rpc_agent **")
            if rank is None:
                st = lib.td_rpc_init_from_env(cname, opts, out)
            else:
                st = lib.td_rpc_init(cname, int(rank), int(world_size), opts, out)
            with lock:
                res["st"], res["msg"], res["agent"] = st, _lib_last_error(), out[0]
                if res["gave_up"] and st == 0:
                    dispose(out[0])
                elif st == 0:
                    _publish(out[0])  # at once, not when the waiting thread next wakes
            del keep[:]  # the options' strings were needed until here
        finally:
            done.set()

    state.starting = True
    th = threading.Thread(target=run, name="tdist-init", daemon=True)
    th.start()
    try:
        while not done.wait(_timeouts.SLICE_MS / 1000.0):
            pass
    except BaseException:
        with lock:
            res["gave_up"] = True
            state.starting = False
            if res.get("st") == 0:
                if state.agent == res["agent"]:
                    _unpublish()
                dispose(res["agent"])
        lib.td_rpc_init_interrupt()
        _abandoned_inits.append(done)
        raise
    if res["st"] != 0:
        state.starting = False
        raise errors.from_status(res["st"], res["msg"])
    _publish(res["agent"])  # done by the init thread already, unless its publication failed
    state.starting = False
    return res["agent"]


def _unpublish():
    state.agent = None
    _guard_fork(False)
    state.name, state.rank, state.world_size = None, -1, 0


def _lib_last_error():
    return ffi.string(lib.td_last_error()).decode("utf-8", "replace")


def _setup_logging():
    """tdist's log goes to the `tdist` logger; unless TD_LOG_LEVEL says otherwise, tdist logs
    what that logger's level lets through."""
    if "TD_LOG_LEVEL" not in os.environ:
        lib.td_log_set_level(_service.python_level_to_td(_service.logger.getEffectiveLevel()))
    _service.capture_logs(True)


def shutdown(graceful=True, timeout=None):
    """Leaves the group. graceful (default): waits until every worker has called shutdown and
    no work is outstanding anywhere (timeout seconds, default 60, 0: no limit), then tears down;
    otherwise fails everything outstanding at once. The graceful wait is not interruptible by
    Ctrl-C (it is bounded by the timeout)."""
    _agent()
    try:
        st = stop_agent(graceful, timeout)
    finally:
        destroy_agent()
    if st != 0:
        raise errors.from_status(st, _lib_last_error())


def stop_agent(graceful, timeout):
    """td_rpc_shutdown of the agent (timeout seconds; None: 60; 0: no limit); returns its status
    (the message in td_last_error)."""
    a = _agent()
    if timeout is None:
        ms = _timeouts.SHUTDOWN_DEFAULT_MS
    elif timeout == 0:
        ms = _timeouts.NO_TIMEOUT_MS
    else:
        ms = max(1, int(timeout * 1000))
    return lib.td_rpc_shutdown(a, bool(graceful), ms)


def destroy_agent():
    a = state.agent
    _unpublish()
    if a is not None:
        lib.td_rpc_destroy(a)
    _service.drain()


@atexit.register
def _at_exit():
    """An agent still running at exit is stopped before the interpreter goes away (so no tdist
    thread calls into a finalizing interpreter), and an interrupted init has returned."""
    end = time.monotonic() + 5.0
    for done in _abandoned_inits:
        # again and again: an interrupt only reaches inits that had started when it was made.
        # (An Event, not Thread.is_alive: a join interrupted by Ctrl-C can leave the thread
        # marked stopped while it still runs, in Python 3.11.)
        while not done.is_set() and time.monotonic() < end:
            lib.td_rpc_init_interrupt()
            done.wait(0.05)
    if state.agent is not None and not state.forked:
        lib.td_rpc_shutdown(state.agent, False, 0)
        destroy_agent()
    if not state.forked:
        _service.capture_logs(False)
        _service.stop()


# ---- fork ----

def _refuse_fork(*args, **kwargs):
    raise errors.ForkError(
        "tdist: fork() is refused while tdist runs (between init_rpc and shutdown): the child "
        "would not have tdist's threads. Fork before init_rpc, or start processes with "
        "subprocess or multiprocessing's 'spawn' method", 2)


def _guard_fork(on):
    for fname in ("fork", "forkpty"):
        if on and fname not in _real_fork and hasattr(os, fname):
            _real_fork[fname] = getattr(os, fname)
            setattr(os, fname, _refuse_fork)
        elif not on and fname in _real_fork:
            setattr(os, fname, _real_fork.pop(fname))


def _after_fork_in_child():
    if state.agent is not None or state.forked:
        state.forked = True
        state.agent = None


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---- calls ----

def _bname(s):
    b = _name_cache.get(s)
    if b is None:
        b = _name_cache[s] = s.encode("utf-8")
    return b


def _to_name(to):
    if isinstance(to, str):
        return _bname(to)
    if isinstance(to, WorkerInfo):
        return _bname(to.name)
    if isinstance(to, int):
        return _bname(get_worker_info(to).name)
    raise TypeError("to: a worker name, rank or WorkerInfo, got %r" % (to,))


def _fn_name(func):
    if isinstance(func, str):
        return _bname(func)
    n = _names.get(func)
    if n is None:
        raise TypeError("%r is not registered: register it with @tdist.register in every "
                        "worker (only names travel), or pass the registered name" % (func,))
    return _bname(n)


def _call_opts(timeout):
    if timeout is _timeouts.UNSET or timeout is None:
        return NULL
    o = ffi.new("td_rpc_call_opts *")
    lib.td_rpc_call_opts_init(o)  # a zeroed struct is refused
    o.timeout_ms = _timeouts.call_ms(timeout)
    return o


def _no_kwargs(kwargs):
    if kwargs:
        raise TypeError("tdist passes positional arguments only (kwargs would need a "
                        "convention every worker, C included, understands)")


def _start(to, func, args, kwargs, timeout):
    """td_rpc_async: the new td_future* (owned by the caller)."""
    if kwargs:
        _no_kwargs(kwargs)
    a = state.agent
    if a is None:
        a = _agent()  # raises
    if lib.tdpy_release_pending():
        _service.maybe_drain()
    to_b = _name_cache.get(to) if type(to) is str else None
    if to_b is None:
        to_b = _to_name(to)
    fn_b = _name_cache.get(func) if type(func) is str else None
    if fn_b is None:
        fn_b = _fn_name(func)
    ms = _timeouts.AGENT_DEFAULT_MS if timeout is _timeouts.UNSET else _timeouts.call_ms(timeout)
    vals = _convert.values_list(args) if args else []
    out = ffi.new("td_future **")
    # tdpy_rpc_async releases the values, whatever happens
    check(lib.tdpy_rpc_async(a, to_b, fn_b, ffi.new("td_value *[]", vals) if vals else NULL,
                             len(vals), ms, out))
    return out[0]


def rpc_async(to, func, args=None, kwargs=None, timeout=_timeouts.UNSET):
    """Calls func (a registered function or its name) on worker `to` (name, rank or
    WorkerInfo) with args; returns a tdist.Future at once. timeout in seconds (0: none;
    default: the agent's)."""
    return Future(_ptr=_start(to, func, args, kwargs, timeout))


def rpc_sync(to, func, args=None, kwargs=None, timeout=_timeouts.UNSET):
    """rpc_async(...).wait(): blocks until the result arrives and returns it (raises the
    call's failure). Ctrl-C interrupts the wait (the call itself goes on and its result is
    dropped)."""
    f = _start(to, func, args, kwargs, timeout)
    try:
        wait_ptr(f, None)
        return value_of(f)
    finally:
        lib.td_future_unref(f)


def remote(to, func, args=None, kwargs=None, timeout=_timeouts.UNSET):
    """Runs func on worker `to` and returns at once a tdist.RRef to its result, which stays
    on `to` (a Python object stays a Python object there)."""
    from .rref import RRef
    _no_kwargs(kwargs)
    a = _agent()
    vals, argv = _convert.values_array(args or ())
    out = ffi.new("td_rref **")
    try:
        st = lib.td_remote(a, _to_name(to), _fn_name(func), argv, len(vals), _call_opts(timeout),
                           out)
    finally:
        _convert.release_values(vals)
    check(st)
    return RRef(_ptr=out[0])


# ---- workers, progress, counters ----

def get_worker_info(worker_name=None):
    """The WorkerInfo of a worker (by name or rank), or of this one."""
    a = _agent()
    wi = ffi.new("td_worker_info *")
    if worker_name is None:
        check(lib.td_rpc_self(a, wi))
    elif isinstance(worker_name, int):
        check(lib.td_rpc_get_worker_info_by_rank(a, worker_name, wi))
    else:
        check(lib.td_rpc_get_worker_info(a, cstr(worker_name), wi))
    return WorkerInfo(ffi.string(wi.name).decode(), wi.id, ffi.string(wi.address).decode())


def get_rank():
    _agent()
    return state.rank


def get_world_size():
    _agent()
    return state.world_size


def progress_fd():
    """The file descriptor that is readable while handlers or callbacks wait to run (host
    mode): give it to an event loop (loop.add_reader(fd, tdist.progress)). -1 in the default
    mode."""
    return lib.td_rpc_progress_fd(_agent())


def progress(max_items=-1):
    """Runs up to max_items (< 0: all) queued handlers and callbacks on this thread (host
    mode) and returns how many ran. A KeyboardInterrupt raised in one of them is re-raised
    here after the others ran."""
    n = lib.td_rpc_progress(_agent(), max_items)
    if n < 0:
        check(errors.StateError.status)
    e, state.pending_interrupt = state.pending_interrupt, None
    if e is not None:
        raise e
    return n


def get_stats():
    """The agent's counters (td_rpc_get_stats) as a dict."""
    s = ffi.new("td_rpc_stats *")
    check(lib.td_rpc_get_stats(_agent(), s))
    out = {k: getattr(s, k) for k in (
        "calls_started", "calls_succeeded", "calls_failed", "calls_timed_out",
        "requests_received", "requests_failed", "requests_rejected", "refused_connections",
        "calls_pending", "requests_active", "pool_pending", "streams_opened",
        "streams_shared")}
    out["traffic"] = {k: getattr(s.traffic, k) for k in (
        "frames_sent", "bytes_sent", "frames_received", "bytes_received", "direct_frames_sent",
        "direct_bytes_sent", "direct_frames_received", "direct_bytes_received",
        "lane_frames_sent", "lane_bytes_sent", "lane_frames_received", "lane_bytes_received")}
    return out


def set_default_timeout(timeout):
    """Changes the default per-call timeout (seconds, 0: none) for calls made from now on."""
    check(lib.td_rpc_set_default_timeout(_agent(), _timeouts.call_ms(timeout)))


def get_default_timeout():
    """The default per-call timeout in seconds (0.0: none)."""
    return _timeouts.seconds(lib.td_rpc_get_default_timeout(_agent()))


def get_rpc_timeout():
    """The default per-call timeout in seconds (0.0: none): torch.distributed.rpc's name for
    get_default_timeout."""
    return get_default_timeout()


def generate_secret():
    """A new random job secret (64 hex characters) to give every worker of a group."""
    buf = ffi.new("char[65]")
    check(lib.td_rpc_secret_generate(buf, 65))
    return ffi.string(buf).decode()
