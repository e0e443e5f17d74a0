"""asyncio.py - tdist inside an asyncio program, with no tdist thread entering Python.

    async def main():
        await tdist.asyncio.init_rpc("worker0", 0, 2)   # host mode, attached to this loop
        r = await tdist.rpc_async("worker1", "f", (1,))  # futures are awaitable
        await tdist.asyncio.shutdown()

init_rpc here runs tdist's init in the loop's executor (the loop keeps running), makes the
loop's thread the progress thread and watches tdist.progress_fd() with loop.add_reader: every
registered function and every callback of a call runs on the loop's thread, inside
tdist.progress(). A registered function may be a coroutine function: its coroutine runs as a
task of the loop and the reply goes when it finishes. A blocking call (rpc_sync) made on the
loop's thread keeps running the queue while it waits, so it cannot deadlock - but it stalls the
loop's other tasks meanwhile: prefer `await tdist.rpc_async(...)`.
"""
import asyncio
import functools

from . import rpc as _rpc
from ._state import state


def attach(loop=None):
    """Runs tdist's queued work on loop (default: the running one) whenever it is ready. The
    agent must be in host mode (init_rpc(progress="host")), and this must be its progress
    thread (the one that called init_rpc or tdist.progress)."""
    loop = loop or asyncio.get_running_loop()
    fd = _rpc.progress_fd()
    if fd < 0:
        raise RuntimeError("tdist.asyncio.attach needs init_rpc(progress='host')")
    loop.add_reader(fd, _rpc.progress)
    return fd


def detach(loop=None):
    loop = loop or asyncio.get_running_loop()
    if state.agent is not None:
        loop.remove_reader(_rpc.progress_fd())


async def init_rpc(name=None, rank=None, world_size=None, **kwargs):
    """tdist.init_rpc in host mode without blocking the loop, then attach() to it."""
    kwargs["progress"] = "host"
    loop = asyncio.get_running_loop()
    me = await loop.run_in_executor(
        None, functools.partial(_rpc.init_rpc, name, rank, world_size, **kwargs))
    _rpc.progress(0)  # the loop's thread becomes the progress thread
    attach(loop)
    return me


async def shutdown(graceful=True, timeout=None):
    """tdist.shutdown while the loop keeps running tdist's queue (the graceful wait runs in
    the executor), then detach and free the agent."""
    loop = asyncio.get_running_loop()
    st = await loop.run_in_executor(None, _rpc.stop_agent, graceful, timeout)
    msg = _rpc._lib_last_error() if st != 0 else ""
    detach(loop)
    _rpc.destroy_agent()
    if st != 0:
        from . import errors
        raise errors.from_status(st, msg)
