"""test_torch_rpc.py - tdist.torch_rpc, torch_autograd and torch_optim: PyTorch's RPC API over
tdist, in groups of this process (rank 0) and torch_worker.py children. Values that pickling
would carry (tuples, dicts with tensor keys, sets, dtypes, functions by name, kwargs),
exceptions that keep their type (built-in and the program's own, with the remote traceback;
tdist's failures as RuntimeError), RRefs whose values stay objects on their owner, futures that
are torch.futures.Future; distributed autograd through torch tensors against one process, with
a parameter used by two workers' calls, and DistributedOptimizer stepping the owners'
parameters."""
import os
import time

import pytest

torch = pytest.importorskip("torch")

import tdist  # noqa: E402
import tdist.torch_autograd as dist_autograd  # noqa: E402
import tdist.torch_rpc as rpc  # noqa: E402
import torch_fns as fns  # noqa: E402
from conftest import HERE, scaled  # noqa: E402
from tdist.torch_optim import DistributedOptimizer  # noqa: E402


@pytest.fixture
def torch_group(group, monkeypatch):
    """torch_group(world) -> Group with ranks 1.. as torch_worker.py and this process joined as
    w0 through tdist.torch_rpc.init_rpc."""
    def make(world, env=None):
        g = group(world)
        for r in range(1, world):
            g._spawn(r, [os.sys.executable, os.path.join(HERE, "torch_worker.py")], env)
        monkeypatch.setenv("TD_RPC_SECRET", g.secret)
        opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:%d" % g.port,
                                               rpc_timeout=scaled(30))
        rpc.init_rpc("w0", rank=0, world_size=world, rpc_backend_options=opts)
        return g
    return make


def finish(g):
    rpc.shutdown()
    g.finish()


def test_values_functions_and_futures(torch_group):
    g = torch_group(3)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(rpc.rpc_sync("w1", fns.add, args=(x, 1)), x + 1)
    assert torch.equal(rpc.rpc_sync("w1", torch.add, args=(x, x)), x + x)  # a builtin by name
    assert rpc.rpc_sync(1, fns.two_args, args=((1, (2, 3)), {"k": (4,)})) == \
        ((1, (2, 3)), {"k": (4,)})  # tuples stay tuples; `to` as a rank
    keyed = {torch.ones(1): "t", 3: "int", ("a", 1): {1, 2}, "s": frozenset([1])}
    assert rpc.rpc_sync("w2", fns.describe, args=(keyed,)) == {
        "Tensor tensor([1.])": "str", "int 3": "str", "tuple ('a', 1)": ("set", ["int", "int"]),
        "str 's'": ("frozenset", ["int"])}
    assert rpc.rpc_sync("w1", fns.echo, args=([torch.float64, torch.device("cpu"),
                                               torch.Size([2, 3]), slice(1, 5, 2), 1 + 2j],)) == \
        [torch.float64, torch.device("cpu"), torch.Size([2, 3]), slice(1, 5, 2), 1 + 2j]
    assert rpc.rpc_sync("w1", fns.kwargs_echo, args=(1,), kwargs={"c": 5}) == \
        {"a": 1, "b": 2, "c": 5}
    # a function and a class travel by name, and come back as themselves
    assert rpc.rpc_sync("w2", fns.echo, args=([fns.add, fns.Holder, torch.nn.Linear],)) == \
        [fns.add, fns.Holder, torch.nn.Linear]
    me = rpc.get_worker_info()
    assert (me.name, me.id) == ("w0", 0) and repr(rpc.get_worker_info("w2")) == \
        "WorkerInfo(id=2, name=w2)"
    assert rpc.rpc_sync(rpc.get_worker_info("w1"), fns.worker_name) == "w1"
    # nested calls, and an async_execution reply that follows a future
    assert rpc.rpc_sync("w1", fns.call_back, args=("w2", 4)) == 5
    assert rpc.rpc_sync("w1", fns.async_add, args=("w2", 1)) == 22
    # rpc_async gives torch futures: torch.futures.wait_all, then() work as in PyTorch
    futs = [rpc.rpc_async("w%d" % (1 + i % 2), fns.add, args=(i, i)) for i in range(20)]
    assert all(isinstance(f, torch.futures.Future) for f in futs)
    assert torch.futures.wait_all(futs) == [2 * i for i in range(20)]
    assert futs[3].then(lambda f: f.value() + 1).wait() == 7
    assert rpc.get_rpc_timeout() == pytest.approx(scaled(30))
    finish(g)


def test_what_cannot_be_sent_says_why(torch_group):
    g = torch_group(2)
    with pytest.raises(TypeError, match="lambda or a function defined inside another"):
        rpc.rpc_sync("w1", lambda: 1)
    with pytest.raises(TypeError, match="bound method"):
        rpc.rpc_sync("w1", fns.Holder(1).get)
    with pytest.raises(TypeError, match="cannot send a torch_fns.Holder: only data travels"):
        rpc.rpc_sync("w1", fns.echo, args=(fns.Holder(1),))
    with pytest.raises(TypeError, match="never pickled objects"):
        rpc.rpc_sync("w1", fns.echo, args=(torch.nn.Linear(2, 2),))
    # a result that cannot travel fails on the callee, and says so here as a TypeError
    with pytest.raises(TypeError, match="lambda"):
        rpc.rpc_sync("w1", fns.make_lambda)
    finish(g)


def test_exceptions_keep_their_type(torch_group):
    g = torch_group(3)
    with pytest.raises(TypeError, match="On WorkerInfo\\(id=1, name=w1\\)") as ei:
        rpc.rpc_sync("w1", fns.add, args=(1,))  # wrong arity
    assert "Traceback" in str(ei.value) and "add()" in str(ei.value)
    with pytest.raises(fns.UserError, match="(?s)w2.*mine"):
        rpc.rpc_sync("w2", fns.raise_user, args=("mine",))
    with pytest.raises(fns.UserError):
        rpc.rpc_async("w2", fns.raise_user, args=("async",)).wait()
    r = rpc.remote("w1", fns.raise_key, args=("gone",))
    with pytest.raises(KeyError, match="gone"):
        r.to_here()
    # tdist's failures are RuntimeError, as PyTorch raises them
    with pytest.raises(RuntimeError, match="nobody"):
        rpc.rpc_sync("nobody", fns.add, args=(1, 2))
    with pytest.raises(RuntimeError) as ei:
        rpc.rpc_sync("w1", fns.sleep, args=(scaled(2),), timeout=0.2)
    assert isinstance(ei.value, tdist.TimeoutError)
    with pytest.raises(RuntimeError):
        rpc.rpc_async("w1", fns.sleep, args=(scaled(2),), timeout=0.2).wait()
    h = rpc.remote("w1", fns.Holder, args=(3,))
    with pytest.raises(AttributeError, match="nope"):
        h.rpc_sync().nope()
    # an exception in a then() callback is torch's: wrapped in the chained future's error
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        rpc.rpc_async("w1", fns.add, args=(1, 1)).then(lambda f: 1 / 0).wait()
    # torch.futures.wait_all raises the failure (it is torch's own: it waits for every future)
    with pytest.raises(fns.UserError):
        torch.futures.wait_all([rpc.rpc_async("w2", fns.sleep, args=(0.1,)),
                                rpc.rpc_async("w1", fns.raise_user, args=("x",))])
    del r, h
    finish(g)


def test_rrefs_keep_objects_on_their_owner(torch_group):
    g = torch_group(3)
    h = rpc.remote("w1", fns.Holder, args=(torch.ones(2),))
    assert h.owner() == rpc.get_worker_info("w1") and h.owner_name() == "w1"
    assert not h.is_owner()
    assert torch.equal(h.rpc_sync().mul(3), torch.full((2,), 3.0))
    assert torch.equal(h.rpc_async().get().wait(), torch.ones(2))
    assert torch.equal(h.remote().get().to_here(), torch.ones(2))
    with pytest.raises(TypeError, match="only data travels"):
        h.to_here()  # the object itself cannot leave w1
    # an RRef passed to a third worker, used there by the helpers of PyTorch's tutorials
    assert torch.equal(rpc.rpc_sync("w2", fns.echo, args=(h,)).rpc_sync().get(), torch.ones(2))
    mine = rpc.RRef({"k": (1, 2)})
    assert mine.is_owner() and mine.local_value() == {"k": (1, 2)}
    assert rpc.rpc_sync("w2", fns.echo, args=(mine,)).to_here() == {"k": (1, 2)}
    t = torch.zeros(3)
    assert rpc.RRef(t).local_value() is t  # the object itself, not a copy
    # local_value right after remote() to oneself waits for the value
    own = rpc.remote("w0", fns.Holder, args=(7,))
    assert own.local_value().get() == 7
    del h, mine, own
    finish(g)


def _reference(x, seeds):
    """One process: the same forward as test_distributed_autograd_matches_one_process."""
    p1 = fns.Params(seeds[0], (3, 4))
    p2 = fns.Params(seeds[1], (4, 2))
    shared = torch.nn.Parameter(torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(4, 2))
    h = p1.forward(x)                       # on w1
    a = fns.lin(h, shared)                  # on w2, with the shared parameter
    b = fns.scaled_tanh(p2.forward(h), shared)  # on w2 (p2 lives there) and w1 (shared again)
    loss = (a * b).sum() + (h ** 2).sum()
    loss.backward()
    return loss.item(), p1.w.grad, p2.w.grad, shared.grad, (p1, p2, shared)


def test_distributed_autograd_matches_one_process(torch_group):
    g = torch_group(3)
    x = torch.linspace(-2, 2, 15, dtype=torch.float64).reshape(5, 3)
    ref_loss, g1, g2, gs, (rp1, rp2, rshared) = _reference(x, (1, 2))
    p1 = rpc.remote("w1", fns.Params, args=(1, (3, 4)))
    p2 = rpc.remote("w2", fns.Params, args=(2, (4, 2)))
    shared = torch.nn.Parameter(torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(4, 2))
    params = rpc.rpc_sync("w1", fns.param_rrefs, args=(p1,)) + \
        rpc.rpc_sync("w2", fns.param_rrefs, args=(p2,)) + [rpc.RRef(shared)]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    for step in range(2):
        with dist_autograd.context() as cid:
            h = p1.rpc_sync().forward(x)                          # w1's parameter
            a = rpc.rpc_sync("w2", fns.lin, args=(h, shared))     # shared, sent to w2
            hp = p2.rpc_sync().forward(h)                         # w2's parameter
            b = rpc.rpc_sync("w1", fns.scaled_tanh, args=(hp, shared))  # shared, sent to w1
            loss = (a * b).sum() + (h ** 2).sum()
            assert h.grad_fn is not None and "RecvRpc" in type(h.grad_fn).__name__
            dist_autograd.backward(cid, [loss])
            mine = dist_autograd.get_gradients(cid)
            got1 = rpc.rpc_sync("w1", fns.grads_of, args=(cid, p1))
            got2 = rpc.rpc_sync("w2", fns.grads_of, args=(cid, p2))
            assert shared.grad is None  # gradients live in the context, not in .grad
            if step == 0:
                assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
                torch.testing.assert_close(got1[0], g1, atol=1e-6, rtol=0)
                torch.testing.assert_close(got2[0], g2, atol=1e-6, rtol=0)
                torch.testing.assert_close(mine[shared], gs, atol=1e-6, rtol=0)
                assert list(mine) == [shared]
            opt.step(cid)
    # two SGD steps with momentum, the same in one process
    ropt = torch.optim.SGD([rp1.w, rp2.w, rshared], lr=0.1, momentum=0.9)
    ropt.step()
    ropt.zero_grad()
    _ref_step2(x, rp1, rp2, rshared)
    ropt.step()
    torch.testing.assert_close(shared.detach(), rshared.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(p1.rpc_sync().values()[0], rp1.w.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(p2.rpc_sync().values()[0], rp2.w.detach(), atol=1e-6, rtol=0)
    del p1, p2, params, opt
    finish(g)


def _ref_step2(x, p1, p2, shared):
    h = p1.forward(x)
    loss = (fns.lin(h, shared) * fns.scaled_tanh(p2.forward(h), shared)).sum() + (h ** 2).sum()
    loss.backward()


def test_autograd_errors_and_rref_backward(torch_group):
    g = torch_group(2)
    p = rpc.remote("w1", fns.Params, args=(3, (2, 2)))
    x = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    with dist_autograd.context() as cid:
        out = p.remote().forward(x)                       # tanh(x @ w), an RRef on w1
        rpc.remote("w1", fns.rref_sum, args=(out,)).backward(cid)
        got = rpc.rpc_sync("w1", fns.grads_of, args=(cid, p))[0]
    ref = fns.Params(3, (2, 2))
    torch.tanh(x @ ref.w).sum().backward()
    torch.testing.assert_close(got, ref.w.grad, atol=1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="owner only"):
        out.backward()
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        dist_autograd.backward(12345, [torch.ones(1, requires_grad=True).sum()])
    with dist_autograd.context() as cid:
        with pytest.raises(RuntimeError, match="does not require grad"):
            dist_autograd.backward(cid, [torch.ones(1).sum()])
        with pytest.raises(RuntimeError, match="Already have an autograd context"):
            with dist_autograd.context():
                pass
    assert rpc.is_available() and dist_autograd.is_available()
    del p, out
    finish(g)


def test_contexts_outlive_a_workers_shutdown_call(torch_group, tmp_path):
    """A worker's main thread calls shutdown() right after init_rpc, as PyTorch programs do, and
    serves the others from inside it: the autograd contexts their requests created there before
    (or after) that call live until they end. shutdown() used to drop them on entry: a request
    that arrived before it lost its context, and the backward's gradients vanished (1 run in 12
    of test_autograd_errors_and_rref_backward, where init and the first request race)."""
    gate = tmp_path / "go"
    g = torch_group(2, {"TORCH_WORKER_SHUTDOWN_AFTER": str(gate)})
    p = rpc.remote("w1", fns.Params, args=(3, (2, 2)))
    x = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    with dist_autograd.context() as cid:
        s = rpc.remote("w1", fns.rref_sum, args=(p.remote().forward(x),))
        s.backward(cid)  # the gradients are in the context on w1
        gate.write_text("go")
        end = time.monotonic() + scaled(30)
        while not (tmp_path / "go.entered").exists() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)  # w1's main thread is inside shutdown() now
        got = rpc.rpc_sync("w1", fns.grads_of, args=(cid, p))[0]
    ref = fns.Params(3, (2, 2))
    torch.tanh(x @ ref.w).sum().backward()
    torch.testing.assert_close(got, ref.w.grad, atol=1e-12, rtol=0)
    del p, s
    finish(g)
