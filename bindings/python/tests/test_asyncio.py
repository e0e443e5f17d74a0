"""test_asyncio.py - host-driven progress: an asyncio program (this process, rank 0, host mode)
awaits thousands of calls while C and Python peers call back into it; every registered function
and every callback runs on the loop's thread (no thread of tdist's enters Python), coroutine
functions serve calls, a blocking call made on the loop's thread keeps serving nested calls
back into it, and a Python worker in host mode (py_worker.py --host) serves calls too. Also the
default mode's futures are awaitable."""
import asyncio
import threading
import time

import pytest

import tdist
import tdist.asyncio
from conftest import free_port

RAN_ON = set()


@tdist.register
def t_where():
    RAN_ON.add(threading.get_ident())
    return threading.get_ident()


@tdist.register
async def t_coro(x):
    RAN_ON.add(threading.get_ident())
    await asyncio.sleep(0.01)
    return x * 2


def run(coro):
    return asyncio.run(coro)


def test_asyncio_host_mode(group):
    g = group(3)
    g.spawn_c(1)
    g.spawn_py(2, "--host")  # a Python peer in host mode as well

    async def main():
        loop_thread = threading.get_ident()
        await tdist.asyncio.init_rpc("py0", 0, 3, init_method="tcp://127.0.0.1:%d" % g.port,
                                     secret=g.secret, tensor_type="numpy")
        assert tdist.progress_fd() >= 0
        calls = [tdist.rpc_async("c1", "c_add", (i, 1)) for i in range(2000)]
        calls += [tdist.rpc_async("py2", "py_add", (i, 1)) for i in range(500)]
        assert await asyncio.gather(*calls) == [i + 1 for i in range(2000)] + \
            [i + 1 for i in range(500)]
        # callbacks of call futures run on the loop's thread too
        seen = []
        done = asyncio.Event()
        f = tdist.rpc_async("c1", "c_add", (1, 1))
        f.add_done_callback(lambda _f: (seen.append(threading.get_ident()), done.set()))
        await done.wait()
        assert seen == [loop_thread]
        # peers call into this process: the handler runs on the loop's thread
        for _ in range(50):
            assert await tdist.rpc_async("c1", "c_call", ("py0", "t_where", [])) == loop_thread
            assert await tdist.rpc_async("py2", "py_call", ("py0", "t_where", [])) == loop_thread
        assert await tdist.rpc_async("c1", "c_call", ("py0", "t_coro", [21])) == 42
        # a blocking call on the loop's thread keeps running the queue: py2 calls back into us
        assert tdist.rpc_sync("py2", "py_call", ("py0", "t_where", [])) == loop_thread
        # and py2's own handlers ran on its loop's thread, not on a tdist thread
        assert await tdist.rpc_async("py2", "py_thread") == "MainThread"
        await tdist.asyncio.shutdown()
        return loop_thread

    RAN_ON.clear()
    loop_thread = run(main())
    assert RAN_ON == {loop_thread}
    g.finish()


def test_coroutine_function_needs_a_loop(solo):
    with pytest.raises(tdist.RemoteError, match="needs an asyncio loop"):
        tdist.rpc_sync("solo", "t_coro", (1,))


def test_default_mode_futures_are_awaitable(solo):
    async def main():
        return await asyncio.gather(*[tdist.rpc_async("solo", "t_where") for _ in range(100)])

    idents = run(main())
    assert len(idents) == 100 and threading.get_ident() not in idents  # pool threads


def test_progress_needs_host_mode(solo):
    assert tdist.progress_fd() == -1
    with pytest.raises(tdist.StateError):
        tdist.progress()


def test_host_mode_without_asyncio():
    """progress() by hand: handlers run only when the host asks."""
    tdist.init_rpc("solo", 0, 1, init_method="tcp://127.0.0.1:%d" % free_port(), progress="host")
    try:
        RAN_ON.clear()
        f = tdist.rpc_async("solo", "t_where")
        time.sleep(0.2)  # nothing runs the handler until this thread does
        assert not f.done()
        ran = 0
        while not f.done():
            ran += tdist.progress()
        assert ran >= 1 and f.value() == threading.get_ident()
        assert RAN_ON == {threading.get_ident()}
    finally:
        tdist.shutdown()
