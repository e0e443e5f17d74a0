"""torch_autograd.py - torch.distributed.autograd over tdist, for torch tensors.

    import tdist.torch_autograd as dist_autograd

    with dist_autograd.context() as context_id:
        loss = loss_fn(model(x), y)          # model may call other workers (torch_rpc)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: gradient} of this worker
        opt.step(context_id)                 # tdist.torch_optim.DistributedOptimizer

A context is a tdist distributed autograd context (its id is unique in the group) current on
the thread that entered it. Inside it, tensors that require grad and cross a call record send /
receive nodes on both sides (SendRpc / RecvRpc, torch autograd Functions); backward runs torch's
autograd on this worker from the roots and on every worker the forward pass reached, gradients
flowing back along the calls. Gradients accumulate in the context on each worker, never in
.grad. How, and what a pass does with hooks (DistributedDataParallel): tdist/_torch_compat.py.
"""
import torch

from . import errors, rpc as _rpc
from . import _torch_compat as _c
from ._lib import check, ffi, lib


class context:
    """A distributed autograd context: `with context() as context_id` (an int)."""

    def __init__(self):
        self._c = None
        self._ctx = None

    def __enter__(self):
        if _c.current_ctx() is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        out = ffi.new("td_dist_autograd_context **")
        try:
            check(lib.td_dist_autograd_context_begin(_rpc._agent(), out))
        except errors.Error as e:
            raise _c.runtime_error(e) from None
        self._c = out[0]
        cid = lib.td_dist_autograd_context_get_id(self._c).v
        self._ctx = _c.ctx_get(cid, create=True)
        _c.set_current(self._ctx)
        return cid

    def __exit__(self, typ, exc, tb):
        c, self._ctx = self._ctx, None
        _c.set_current(None)
        try:
            _c.release_ctx(c)
        finally:
            st = lib.td_dist_autograd_context_end(self._c)
            self._c = None
        if st != 0 and typ is None:
            check(st)
        return False


def _ctx(context_id):
    c = _c.ctx_get(int(context_id))
    if c is None or c.released:
        raise RuntimeError("Could not find autograd context with id: %d" % int(context_id))
    return c


def backward(context_id, roots, retain_graph=False):
    """Runs the backward pass of the scalar roots across every worker their graph reached, and
    returns when every part finished; gradients accumulate in the context (get_gradients).
    Graphs are kept until the context ends (retain_graph is accepted for PyTorch's signature:
    a second backward in the same context works either way)."""
    c = _ctx(context_id)
    roots = list(roots)
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError("backward: roots must be torch tensors, got %s" % type(r).__name__)
        if not r.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a "
                               "grad_fn")
        if r.numel() != 1:
            raise RuntimeError("backward: the roots must be scalars (got shape %s)"
                               % (tuple(r.shape),))
    futs = _c.run_pass(c, roots, [torch.ones_like(r) for r in roots], root=True)
    if futs:
        _c.wait_future(_c.all_of(futs))
    _ = retain_graph


def get_gradients(context_id):
    """{tensor: gradient} accumulated on this worker in the context (tensors are keys by
    identity, as in PyTorch)."""
    c = _ctx(context_id)
    with c.lock:
        return dict(c.grads)


def is_available():
    return True


def _current_context():
    """The context of this thread (its id), or None."""
    c = _c.current_ctx()
    return c.id if c is not None else None
