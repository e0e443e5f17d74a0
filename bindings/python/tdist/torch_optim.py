"""torch_optim.py - torch.distributed.optim.DistributedOptimizer over tdist, for torch parameters.

    from tdist.torch_optim import DistributedOptimizer
    opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    with dist_autograd.context() as cid:
        ...; dist_autograd.backward(cid, [loss]); opt.step(cid)

param_rrefs are RRefs (tdist.torch_rpc.RRef) to torch parameters, each on its owner (made there
with RRef(param)). On every owner the constructor creates one optimizer_class(params, *args,
**kwargs) over that owner's parameters; step(context_id) makes every owner step at once with
the gradients the context accumulated there, and returns when all have. As PyTorch 1.13's
functional optimizers do, a parameter without a gradient in the context is left alone, and
.grad is not changed (it is set only for the step, then put back). Steps of different
contexts on one owner run one at a time.
"""
import threading

from . import _torch_compat as _c
from . import torch_rpc as _rpc

_global_lock = threading.Lock()


class _LocalOptimizer:
    """The optimizer over one owner's parameters (lives on that owner, behind an RRef)."""

    def __init__(self, optimizer_class, param_rrefs, *args, **kwargs):
        self.params = [r.local_value() for r in param_rrefs]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id):
        c = _c.ctx_get(int(context_id))
        grads = {}
        if c is not None:
            with c.lock:
                grads = dict(c.grads)
        with _global_lock:
            saved = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self.params, saved):
                    p.grad = g


def _new_local_optimizer(optimizer_class, param_rrefs, args, kwargs):
    return _LocalOptimizer(optimizer_class, param_rrefs, *args, **kwargs)


def _local_optimizer_step(opt_rref, context_id):
    opt_rref.local_value().step(context_id)


class DistributedOptimizer:
    """torch.distributed.optim.DistributedOptimizer(optimizer_class, params_rref, *args,
    **kwargs)."""

    def __init__(self, optimizer_class, params_rref, *args, **kwargs):
        per_owner = {}
        for r in params_rref:
            per_owner.setdefault(r.owner_name(), []).append(r)
        self.remote_optimizers = [
            _rpc.remote(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in per_owner.items()]

    def step(self, context_id):
        """Steps every owner's parameters with the gradients of context_id there (blocks until
        all have)."""
        futs = [_rpc.rpc_async(o.owner_name(), _local_optimizer_step, args=(o, context_id))
                for o in self.remote_optimizers]
        errors = []
        for f in futs:
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001 - wait for all, raise the first
                errors.append(e)
        if errors:
            raise errors[0]
