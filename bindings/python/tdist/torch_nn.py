"""torch_nn.py - torch.distributed.nn.RemoteModule over tdist.

    from tdist.torch_nn import RemoteModule
    emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
    out = emb(indices, offsets)                 # forward runs on "ps"
    params = emb.remote_parameters()            # RRefs for a DistributedOptimizer

The module is made on the remote worker from its class and arguments (by name: only data
travels) and stays there; forward goes through an RRef proxy, so inside a distributed autograd
context it is recorded like any call. remote_device is "worker" or "worker/cpu" (only CPU
devices here).
"""
import torch

from . import torch_rpc as _rpc


def _param_rrefs(module_rref, recurse):
    return [_rpc.RRef(p) for p in module_rref.local_value().parameters(recurse)]


class RemoteModule(torch.nn.Module):
    """torch.distributed.nn.RemoteModule(remote_device, module_cls, args=None, kwargs=None).
    It may be passed in calls: it travels as its worker's name and its module's RRef."""

    _tdist_remote_module = True

    def __init__(self, remote_device, module_cls, args=None, kwargs=None):
        super().__init__()
        worker, _, device = str(remote_device).partition("/")
        if device not in ("", "cpu"):
            raise ValueError("RemoteModule: only CPU devices are supported here (got %r)"
                             % remote_device)
        if worker.startswith("rank:"):
            worker = _rpc.get_worker_info(int(worker[5:])).name
        self.on = worker
        self.device = "cpu"
        self.module_rref = _rpc.remote(worker, module_cls, args=tuple(args or ()),
                                       kwargs=dict(kwargs or {}))

    @classmethod
    def _rebuild(cls, on, module_rref):
        """The RemoteModule of module_rref on worker `on` (what a call delivers)."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        self.on, self.device, self.module_rref = on, "cpu", module_rref
        return self

    def forward(self, *args, **kwargs):
        return self.module_rref.rpc_sync().forward(*args, **kwargs)

    def forward_async(self, *args, **kwargs):
        return self.module_rref.rpc_async().forward(*args, **kwargs)

    def remote_parameters(self, recurse=True):
        """RRefs to the remote module's parameters (for DistributedOptimizer)."""
        return _rpc.rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self):
        return self.module_rref
