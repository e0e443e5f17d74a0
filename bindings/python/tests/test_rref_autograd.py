"""test_rref_autograd.py - RRefs from Python (remote() on Python and C owners, Python objects that
stay on their owner, proxies, RRefs passed to third workers, owner queries, creation errors),
and tdist's distributed autograd and optimizer driven from Python through a C worker."""
import numpy as np
import pytest

import tdist
from conftest import poll


def test_rrefs_on_python_and_c_owners(group):
    g = group(3)
    g.spawn_py(1, "--tensor-type", "numpy")
    g.spawn_c(2)
    g.init(tensor_type="numpy")
    # a Python object that lives on py1, used through proxies
    counter = tdist.remote("py1", "Counter", (5,))
    assert counter.owner_name() == "py1" and counter.owner().id == 1 and not counter.is_owner()
    assert counter.rpc_sync().incr(2) == 7
    assert counter.rpc_async().incr(3).wait() == 10
    assert counter.remote().get().to_here() == 10
    with pytest.raises(tdist.RemoteError):
        counter.to_here()  # the object cannot leave py1
    # data on a C owner
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    on_c = tdist.remote("c2", "c_scale", (x, 0.5))
    assert np.array_equal(on_c.to_here(), x * 0.5)
    assert on_c.rpc_sync().c_describe() == ["float64", [3, 4], float((x * 0.5).sum())]
    assert poll(on_c.confirmed_by_owner, 10)
    # an RRef handed to a third worker, which fetches the value from the owner itself
    assert np.array_equal(tdist.rpc_sync("py1", "py_to_here", (on_c,)), x * 0.5)
    assert tdist.rpc_sync("c2", "c_echo", (counter,)).owner_name() == "py1"
    # a local owner RRef
    mine = tdist.RRef({"k": [1, 2]})
    assert mine.is_owner() and mine.local_value() == {"k": [1, 2]}
    assert tdist.rpc_sync("py1", "py_to_here", (mine,)) == {"k": [1, 2]}
    assert "owner=py0" in repr(mine)
    # a creation that fails is reported by the RRef
    bad = tdist.remote("c2", "c_fail", ())
    with pytest.raises(tdist.RemoteError, match="c_fail"):
        bad.to_here()
    with pytest.raises(tdist.InvalidArgumentError):
        bad.creation_future().wait()
    del counter, on_c, mine, bad
    g.finish()


def test_distributed_autograd_and_optimizer_through_a_c_worker(group):
    g = group(2)
    g.spawn_c(1)
    g.init(tensor_type="numpy")
    w0 = np.array([1.0, -2.0, 3.0])
    w = tdist.tensor(w0, requires_grad=True)
    opt = tdist.optim.DistributedOptimizer("sgd", [tdist.RRef(w)], lr=0.1)
    with tdist.autograd.context() as ctx:
        assert ctx.id > 0
        loss = tdist.rpc_sync("c1", "c_square_loss", (w,))  # sum(w * w), computed on c1
        assert isinstance(loss, tdist.Tensor) and loss.requires_grad
        assert loss.item() == pytest.approx(14.0)
        tdist.autograd.backward(ctx, [loss])
        grads = tdist.autograd.get_gradients(ctx)
        assert list(grads) == [w]
        np.testing.assert_allclose(grads[w], 2 * w0)
        opt.step(ctx)
    np.testing.assert_allclose(w.numpy(), w0 - 0.1 * 2 * w0)
    opt.set_lr(0.0)
    with tdist.autograd.context() as ctx:
        tdist.autograd.backward(ctx, [tdist.rpc_sync("c1", "c_square_loss", (w,))])
        opt.step(ctx)
    np.testing.assert_allclose(w.numpy(), w0 * 0.8)  # lr 0: unchanged
    with pytest.raises(TypeError):
        tdist.autograd.backward(ctx, [np.ones(1)])
    with pytest.raises(ValueError):
        tdist.optim.DistributedOptimizer("nope", [])
    del opt
    g.finish()
