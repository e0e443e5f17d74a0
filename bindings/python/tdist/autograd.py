"""autograd.py - tdist's distributed autograd from Python (torch.distributed.autograd's shape).

    with tdist.autograd.context() as ctx:
        loss = tdist.rpc_sync("worker1", "forward_loss", (x,))   # a tdist.Tensor with history
        tdist.autograd.backward(ctx, [loss])
        grads = tdist.autograd.get_gradients(ctx)                # {tdist.Tensor: gradient}
        opt.step(ctx)                                            # tdist.optim.DistributedOptimizer

A context records, on the thread that entered it, every call whose values carry tensors that
require grad (tdist.Tensor with requires_grad, and results that came back with history);
backward runs tdist's autograd across every worker those tensors went through. The graph is
tdist's (C functions of tdist's modules and ops compute it); PyTorch's autograd is not involved:
a Python program uses this to drive models that live in tdist workers (C), and PyTorch autograd
locally for its own torch tensors.
"""
from . import _convert
from ._lib import check, ffi, lib
from ._state import agent as _agent
from ._tensor import Tensor


class context:
    """A distributed autograd context, current on this thread inside `with`."""

    def __init__(self):
        self._ctx = None

    def __enter__(self):
        out = ffi.new("td_dist_autograd_context **")
        check(lib.td_dist_autograd_context_begin(_agent(), out))
        self._ctx = out[0]
        return self

    def __exit__(self, typ, exc, tb):
        c, self._ctx = self._ctx, None
        st = lib.td_dist_autograd_context_end(c)  # frees it on every worker that took part
        if st != 0 and typ is None:
            check(st)
        return False

    @property
    def id(self):
        """The context's id (an int, unique in the group)."""
        return lib.td_dist_autograd_context_get_id(self._live()).v

    def _live(self):
        if self._ctx is None:
            raise RuntimeError("the distributed autograd context is not active")
        return self._ctx


def _tensors(roots):
    out = []
    for r in roots:
        if not isinstance(r, Tensor):
            raise TypeError("backward roots must be tdist.Tensor (results that came back with "
                            "autograd history), got %s" % type(r).__name__)
        out.append(r._t)
    return out


def backward(ctx, roots, retain_graph=False):
    """Differentiates the scalar roots within ctx across every worker their graph reaches;
    blocks until every part finished."""
    ts = _tensors(roots)
    arr = ffi.new("td_tensor *[]", ts)
    check(lib.td_dist_autograd_backward(ctx._live(), arr, len(ts), bool(retain_graph)))


def get_gradients(ctx):
    """{tdist.Tensor leaf of this worker: its gradient in ctx} (gradients as numpy/torch per
    init_rpc's tensor_type)."""
    m = ffi.new("td_grad_map **")
    check(lib.td_dist_autograd_get_gradients(ctx._live(), m))
    try:
        n = lib.td_grad_map_size(m[0])
        keys = ffi.new("td_tensor *[]", max(n, 1))
        grads = ffi.new("td_tensor *[]", max(n, 1))
        got = lib.tdpy_grad_map_items(m[0], keys, grads, n)
        out = {}
        for i in range(min(got, n)):
            out[Tensor(keys[i])] = _convert.tensor_out(grads[i])
            lib.td_tensor_unref(grads[i])
        return out
    finally:
        lib.td_grad_map_destroy(m[0])
