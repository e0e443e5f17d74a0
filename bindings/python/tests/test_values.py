"""test_values.py - Python values through tdist (calls to this worker itself and to a Python and a
C peer), the refusal of what is not data, Python objects that stay in their process, and the
exceptions every status maps to."""
import builtins
import math

import numpy as np
import pytest

import tdist
from tdist import errors
from tdist._lib import ffi, lib

SAMPLES = [
    None, True, False, 0, -1, 2**63 - 1, -2**63, 1.5, -0.0, float("inf"), "", "héllo \x00 w",
    b"", b"\x00\xff", [], [1, [2, [3]]], {}, {"a": 1, "": None, "nested": {"x": [b"y"]}},
    [None, True, 3, 4.0, "five", b"six", {"seven": [8]}],
]


@tdist.register
def t_echo(x):
    return x


@tdist.register
def t_args(*args):
    return list(args)


@tdist.register
def t_object():
    return object()


@tdist.register
def t_raise(kind):
    raise {"value": ValueError("bad value"), "key": KeyError("k"), "timeout": TimeoutError("t"),
           "runtime": RuntimeError("r"), "notimpl": NotImplementedError("n")}[kind]


@pytest.mark.parametrize("value", SAMPLES, ids=repr)
def test_values_round_trip_self(solo, value):
    got = tdist.rpc_sync("solo", t_echo, (value,))
    assert got == value and type(got) is type(value)


def test_values_nan_and_tuples(solo):
    assert math.isnan(tdist.rpc_sync("solo", "t_echo", (float("nan"),)))
    assert tdist.rpc_sync("solo", "t_echo", ((1, (2, 3)),)) == [1, [2, 3]]  # tuples: lists
    assert tdist.rpc_sync("solo", "t_echo", (bytearray(b"ab"),)) == b"ab"
    assert tdist.rpc_sync("solo", "t_echo", (np.int32(7),)) == 7
    assert tdist.rpc_sync("solo", "t_echo", (np.float32(0.5),)) == 0.5
    assert tdist.rpc_sync("solo", "t_args", (1, "a", None)) == [1, "a", None]
    assert tdist.rpc_sync("solo", "t_args") == []


def test_values_refused(solo):
    with pytest.raises(TypeError, match="cannot send a set"):
        tdist.rpc_sync("solo", t_echo, ({1, 2},))
    with pytest.raises(TypeError, match="cannot send a object"):
        tdist.rpc_async("solo", t_echo, ([object()],))
    with pytest.raises(OverflowError):
        tdist.rpc_sync("solo", t_echo, (2**63,))
    with pytest.raises(TypeError, match="keys must be str"):
        tdist.rpc_sync("solo", t_echo, ({1: 2},))
    with pytest.raises(TypeError, match="positional"):
        tdist.rpc_sync("solo", t_echo, (), {"x": 1})

    def unregistered(x):
        return x
    with pytest.raises(TypeError, match="not registered"):
        tdist.rpc_sync("solo", unregistered, (1,))
    with pytest.raises(tdist.NotFoundError) as e:
        tdist.rpc_sync("solo", "no_such_function", ())
    assert e.value.worker == "solo"


class Thing:
    pass


THING = Thing()


@tdist.register
def t_thing():
    return THING


def test_python_object_stays_in_its_process(solo):
    # a call to this very worker hands back the same object ...
    assert tdist.rpc_sync("solo", "t_thing") is THING
    rref = tdist.RRef(THING)
    assert rref.local_value() is THING and rref.to_here() is THING


def test_python_object_cannot_travel(group):
    g = group(2)
    g.spawn_py(1)
    g.init()
    with pytest.raises(tdist.RemoteError) as e:  # a result that is no data cannot leave py1
        tdist.rpc_sync("py1", "Counter", (5,))
    assert e.value.worker == "py1"
    rref = tdist.RRef(object())  # the RRef travels; its value cannot be copied to py1
    assert tdist.rpc_sync("py1", "py_echo", (rref,)).owner_name() == "py0"
    with pytest.raises(tdist.RemoteError) as e:
        tdist.rpc_sync("py1", "py_to_here", (rref,))
    assert e.value.worker == "py1" and "py0" in str(e.value)
    del rref
    g.finish()


def test_values_round_trip_python_and_c_peers(group):
    g = group(3)
    g.spawn_py(1)
    g.spawn_c(2)
    g.init()
    for v in SAMPLES:
        for to, fn in (("py1", "py_echo"), ("c2", "c_echo")):
            got = tdist.rpc_sync(to, fn, (v,))
            assert got == v and type(got) is type(v), (to, v, got)
    assert tdist.rpc_sync("c2", "c_add", (2, 40)) == 42
    assert tdist.rpc_sync("py1", "py_add", ("a", "b")) == "ab"
    assert tdist.rpc_sync("py1", "py_caller") == ["py0", 0]
    g.finish()


def test_status_classes_match_the_library():
    seen = set()
    for st, name in errors.STATUS_NAMES.items():
        assert ffi.string(lib.td_status_name(st)).decode() == name
        if st == 0:
            continue
        e = errors.from_status(st, "worker9 (rank 9): something")
        assert e.status == st and e.status_name == name
        assert isinstance(e, tdist.Error) and isinstance(e, tdist.RemoteError)
        assert e.worker == "worker9" and e.rank == 9
        local = errors.from_status(st, "rpc: call to 'f' on worker3 (rank 3) timed out")
        assert (st == 12) == isinstance(local, tdist.RemoteError)
        assert local.worker == "worker3" and local.rank == 3
        seen.add(type(local))
    assert len(seen) == len(errors.STATUS_NAMES) - 1  # one class per status
    assert issubclass(tdist.TimeoutError, builtins.TimeoutError)
    assert issubclass(tdist.InvalidArgumentError, ValueError)
    assert issubclass(tdist.UnavailableError, ConnectionError)
    assert errors.from_status(1, "no worker named").worker is None


@pytest.mark.parametrize("kind,cls,builtin", [
    ("value", tdist.InvalidArgumentError, ValueError),
    ("key", tdist.NotFoundError, LookupError),
    ("timeout", tdist.TimeoutError, builtins.TimeoutError),
    ("runtime", tdist.RemoteError, RuntimeError),
    ("notimpl", tdist.UnsupportedError, NotImplementedError),
])
def test_handler_exceptions_map_to_statuses(solo, kind, cls, builtin):
    with pytest.raises(cls) as e:
        tdist.rpc_sync("solo", t_raise, (kind,))
    err = e.value
    assert isinstance(err, tdist.RemoteError) and isinstance(err, builtin)
    assert err.worker == "solo" and err.rank == 0
    assert "'t_raise' failed" in str(err) and "test_values.py" in str(err)


def test_timeouts(group):
    g = group(2)
    g.spawn_c(1)
    g.init()
    with pytest.raises(tdist.TimeoutError) as e:
        tdist.rpc_sync("c1", "c_sleep", (2000,), timeout=0.2)
    assert e.value.worker == "c1"
    assert isinstance(e.value, builtins.TimeoutError)
    assert not isinstance(e.value, tdist.RemoteError)
    assert tdist.rpc_sync("c1", "c_sleep", (10,), timeout=0) == 10  # 0: no timeout
    tdist.set_default_timeout(0.2)
    assert tdist.get_default_timeout() == 0.2
    with pytest.raises(tdist.TimeoutError):
        tdist.rpc_async("c1", "c_sleep", (2000,)).wait()
    fut = tdist.rpc_async("c1", "c_sleep", (300,), timeout=5)
    with pytest.raises(tdist.TimeoutError, match="not done after"):
        fut.wait(timeout=0.05)  # the wait gives up, the call goes on
    assert fut.wait() == 300
    with pytest.raises(ValueError):
        tdist.rpc_async("c1", "c_sleep", (1,), timeout=-1)
    g.finish()


def test_worker_infos(group):
    g = group(2)
    g.spawn_c(1)
    me = g.init()
    assert me.name == "py0" and me.id == 0 and me.address.startswith("127.0.0.1:")
    assert tdist.get_worker_info("c1").id == 1
    assert tdist.get_worker_info(1).name == "c1"
    assert tdist.get_rank() == 0 and tdist.get_world_size() == 2
    assert tdist.rpc_sync(1, "c_add", (1, 1)) == 2  # by rank
    assert tdist.rpc_sync(tdist.get_worker_info("c1"), "c_add", (1, 2)) == 3
    with pytest.raises(tdist.NotFoundError):
        tdist.get_worker_info("nobody")
    with pytest.raises(tdist.StateError):
        g.init()  # twice
    stats = tdist.get_stats()
    assert stats["calls_succeeded"] >= 2
    assert stats["streams_opened"] + stats["streams_shared"] == 1  # c1 reached on one stream
    g.finish()
    with pytest.raises(tdist.StateError, match="init_rpc"):
        tdist.rpc_sync("c1", "c_add", (1, 1))
