"""test_mixed.py - groups that mix C and Python workers: Python calls C functions and C calls
Python functions (this process's and another Python worker's), nested and asynchronous; when a
worker is killed, every future waiting on it - in this process, and in a C worker that waited on
a killed Python worker for us - fails naming it."""
import threading

import numpy as np

import tdist
from conftest import poll, scaled

SEEN_THREADS = []


@tdist.register
def t_mul(a, b):
    SEEN_THREADS.append(threading.current_thread().name)
    return a * b


def test_python_calls_c_and_c_calls_python(group):
    g = group(3)
    g.spawn_c(1)
    g.spawn_py(2)
    g.init(tensor_type="numpy")
    # Python -> C
    assert tdist.rpc_sync("c1", "c_add", (1.5, 2)) == 3.5
    x = np.arange(6, dtype=np.float32)
    assert np.array_equal(tdist.rpc_sync("c1", "c_scale", (x, 3.0)), x * 3)
    # C -> Python: the C worker calls this process's t_mul, and py2's py_add
    assert tdist.rpc_sync("c1", "c_call", ("py0", "t_mul", [6, 7])) == 42
    assert SEEN_THREADS and SEEN_THREADS[-1] != threading.main_thread().name  # a pool thread
    assert tdist.rpc_sync("c1", "c_call", ("py2", "py_add", [[1], [2]])) == [1, 2]
    # Python -> Python -> C, blocking inside the handler and asynchronously
    assert tdist.rpc_sync("py2", "py_call", ("c1", "c_add", [2, 3])) == 5
    assert tdist.rpc_sync("py2", "py_call_async", ("c1", "c_add", [4, 3])) == 7
    # Python -> C -> Python -> C, with a tensor all the way
    r = tdist.rpc_sync("c1", "c_call", ("py2", "py_call", ["c1", "c_scale", [x, 2.0]]))
    assert np.array_equal(r, x * 2)
    # errors name the worker where they happened
    try:
        tdist.rpc_sync("c1", "c_call", ("py2", "py_fail", ["deep"]))
        raise AssertionError("no error")
    except tdist.RemoteError as e:
        assert e.worker == "c1" and "py2 (rank 2)" in str(e) and "ValueError: deep" in str(e)
        assert isinstance(e, ValueError)
    # many calls in flight both ways
    futs = [tdist.rpc_async("c1", "c_call", ("py0", "t_mul", [i, 2])) for i in range(200)]
    futs += [tdist.rpc_async("py2", "py_add", (i, i)) for i in range(200)]
    assert tdist.wait_all(futs) == [2 * i for i in range(200)] * 2
    g.finish()


def test_killed_worker_fails_every_waiting_future(group):
    g = group(4)
    c1 = g.spawn_c(1)
    g.spawn_py(2)
    g.spawn_py(3)
    g.init()
    on_c1 = [tdist.rpc_async("c1", "c_sleep", (60000,), timeout=0) for _ in range(4)]
    on_py2 = [tdist.rpc_async("py2", "py_sleep", (60,), timeout=0) for _ in range(4)]
    # c1 waits (for us) on py2; py3 waits (for us) on c1
    via_c1 = tdist.rpc_async("c1", "c_call", ("py2", "py_sleep", [60]), timeout=0)
    via_py3 = tdist.rpc_async("py3", "py_call", ("c1", "c_sleep", [60000]), timeout=0)
    # c1 runs 8 pool threads: 5 sleep, one answers c_stats
    assert poll(lambda: tdist.rpc_sync("c1", "c_stats", ())["requests_received"] >= 7, 20)
    assert not any(f.done() for f in on_c1 + on_py2 + [via_c1, via_py3])
    g.kill(2)  # a Python worker dies
    for f in on_py2:
        e = f.exception() if poll(f.done, 30) else None
        assert isinstance(e, tdist.UnavailableError) and e.worker == "py2", e
    assert poll(via_c1.done, 30)
    e = via_c1.exception()  # c1's own call to py2 failed, and c1 told us so
    assert isinstance(e, tdist.RemoteError) and e.worker == "c1" and "py2" in str(e), e
    assert not any(f.done() for f in on_c1)
    c1.kill()  # the C worker dies
    c1.wait()
    for f in on_c1:
        e = f.exception() if poll(f.done, 30) else None
        assert isinstance(e, tdist.UnavailableError) and e.worker == "c1", e
    assert poll(via_py3.done, 30)
    e = via_py3.exception()
    assert isinstance(e, tdist.RemoteError) and e.worker == "py3" and "c1" in str(e), e
    # the survivors still answer
    assert tdist.rpc_sync("py3", "py_add", (1, 2), timeout=scaled(10)) == 3
    tdist.shutdown(graceful=False)
