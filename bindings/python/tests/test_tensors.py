"""test_tensors.py - numpy arrays and torch tensors through tdist: every dtype to Python and C
peers (the receiver sees the same dtype, shape and values), zero-copy in both directions (tdist
reads the array's own memory; arrays over tdist's memory), and lifetimes (tdist keeps a lent
object alive until it is done with the memory; an array keeps tdist's memory alive after tdist
dropped it)."""
import gc
import weakref

import numpy as np
import pytest

import tdist
from tdist import _service
from conftest import poll

NP_DTYPES = [np.float32, np.float64, np.int64, np.float16, np.int32, np.uint8, np.bool_]


@tdist.register
def t_ptr(a):
    """The address of the received array's memory."""
    return a.__array_interface__["data"][0]


@tdist.register
def t_keep(a):
    return tdist.RRef(a)


def sample(dt, shape=(3, 5)):
    a = (np.arange(int(np.prod(shape))) % 7).reshape(shape)
    return a.astype(dt)


class Owned(np.ndarray):
    """A numpy subclass: weak-referenceable, so the test can see when it is freed."""


def test_dtypes_round_trip_numpy(group):
    g = group(3)
    g.spawn_py(1, "--tensor-type", "numpy")
    g.spawn_c(2)
    g.init(tensor_type="numpy")
    for dt in NP_DTYPES:
        for a in (sample(dt), sample(dt).T, sample(dt, (1 << 16,))):  # small, strided, direct
            for to, fn in (("py1", "py_echo"), ("c2", "c_echo")):
                got = tdist.rpc_sync(to, fn, (a,))
                assert isinstance(got, np.ndarray) and got.dtype == a.dtype, (to, dt)
                assert got.shape == a.shape and np.array_equal(got, a), (to, dt)
            name, shape, total = tdist.rpc_sync("c2", "c_describe", (a,))
            assert name == np.dtype(dt).name
            assert shape == list(a.shape) and total == float(a.astype(np.float64).sum())
            name, shape, total = tdist.rpc_sync("py1", "py_describe", (a,))
            assert name == str(np.dtype(dt)) and shape == list(a.shape)
    g.finish()


def test_dtypes_round_trip_torch(group):
    torch = pytest.importorskip("torch")
    g = group(3)
    g.spawn_py(1, "--tensor-type", "torch")
    g.spawn_c(2)
    g.init(tensor_type="torch")
    for dt in (torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16,
               torch.int32, torch.uint8, torch.bool):
        t = (torch.arange(24) % 5).reshape(4, 6).to(dt)
        for x in (t, t.t(), t.expand(2, 4, 6)):  # contiguous, strided, expanded
            for to, fn in (("py1", "py_echo"), ("c2", "c_echo")):
                got = tdist.rpc_sync(to, fn, (x,))
                assert isinstance(got, torch.Tensor) and got.dtype == dt, (to, dt)
                assert torch.equal(got, x), (to, dt)
            name, shape, total = tdist.rpc_sync("c2", "c_describe", (x,))
            assert name == str(dt).replace("torch.", "") and shape == list(x.shape)
            assert total == float(x.double().sum())
    # requires_grad tensors are sent detached; CUDA tensors are refused
    w = torch.ones(3, requires_grad=True)
    assert torch.equal(tdist.rpc_sync("c2", "c_echo", (w,)), torch.ones(3))
    g.finish()


def test_numpy_arrives_without_copy_in_process(solo):
    a = np.arange(1 << 14, dtype=np.float32)
    # a call to this worker itself passes the tensor by reference: the handler sees a's memory
    assert tdist.rpc_sync("solo", t_ptr, (a,)) == a.__array_interface__["data"][0]
    rref = tdist.RRef(a)
    v = rref.local_value()  # an array over tdist's tensor, which is a's memory
    assert np.shares_memory(v, a)
    v[0] = 42
    assert a[0] == 42


def test_torch_arrives_without_copy_in_process(solo_torch):
    import torch
    t = torch.arange(100, dtype=torch.float64)
    rref = tdist.RRef(t)
    v = rref.local_value()
    assert isinstance(v, torch.Tensor) and v.data_ptr() == t.data_ptr()
    b = torch.ones(4, dtype=torch.bfloat16)
    vb = tdist.RRef(b).local_value()
    assert vb.dtype == torch.bfloat16 and vb.data_ptr() == b.data_ptr()


def test_tdist_keeps_a_lent_array_alive(solo):
    a = np.arange(1000, dtype=np.int64).view(Owned)
    alive = weakref.ref(a)
    held = _service.held_count()
    rref = tdist.RRef(a)  # tdist now holds a tensor over a's memory
    del a
    gc.collect()
    assert alive() is not None  # the C side keeps the Python object alive ...
    assert tdist.rpc_sync("solo", "t_ptr", (rref.local_value(),)) != 0
    assert int(rref.local_value()[999]) == 999
    del rref  # ... until its last reference to the memory is gone
    gc.collect()
    assert poll(lambda: alive() is None, 10)
    assert poll(lambda: _service.held_count() <= held, 10)


def test_array_keeps_tdist_memory_alive(group):
    g = group(2)
    g.spawn_c(1)
    g.init(tensor_type="numpy")
    big = np.arange(1 << 20, dtype=np.float32)
    got = tdist.rpc_sync("c1", "c_scale", (big, 2.0))  # memory tdist allocated for the reply
    view = got[::2]
    del got
    gc.collect()  # the view's base chain holds tdist's tensor, not a copy
    assert view[1] == 4.0 and view[-1] == (len(big) - 2) * 2.0
    rrefs = [tdist.remote("c1", "c_echo", (big,)) for _ in range(3)]
    arrays = [r.to_here() for r in rrefs]
    del rrefs
    gc.collect()
    for a in arrays:
        assert np.array_equal(a, big)
    g.finish()


def test_non_contiguous_and_readonly_arrays(solo):
    a = np.arange(24, dtype=np.float64).reshape(4, 6)
    for x in (a.T, a[:, ::2], a[1:3]):
        got = tdist.rpc_sync("solo", "t_echo_tensor", (x,))
        assert np.array_equal(got, x) and got.flags.c_contiguous
    ro = np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8)
    assert not ro.flags.writeable
    assert np.array_equal(tdist.rpc_sync("solo", "t_echo_tensor", (ro,)), ro)
    with pytest.raises(TypeError, match="complex64"):
        tdist.rpc_sync("solo", "t_echo_tensor", (np.zeros(2, np.complex64),))
    z = np.zeros((0, 3), np.float32)
    assert tdist.rpc_sync("solo", "t_echo_tensor", (z,)).shape == (0, 3)
    s = np.array(2.5)
    assert tdist.rpc_sync("solo", "t_echo_tensor", (s,)).shape == ()


@tdist.register
def t_echo_tensor(x):
    return x


def test_tdist_tensor_handles(solo):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = tdist.from_numpy(a)
    assert t.shape == (2, 3) and t.dtype == "float32" and t.numel() == 6
    assert np.shares_memory(t.numpy(), a)
    c = tdist.tensor([[1, 2], [3, 4]], dtype=np.float64, requires_grad=True)
    assert c.requires_grad and c.sum().item() == 10.0
    assert tdist.tensor(np.zeros(3, np.uint8)).dtype == "uint8"
    with pytest.raises(tdist.DtypeError, match="cannot require grad"):
        tdist.tensor(np.zeros(3, np.int32)).requires_grad_()
    with pytest.raises(tdist.DtypeError, match="transport-only"):
        tdist.tensor(np.zeros(3, np.int32)).sum()
    with pytest.raises(ValueError, match="C-contiguous"):
        tdist.from_numpy(a.T)
    assert {t: 1}[t] == 1 and t != c
