"""optim.py - tdist's distributed optimizer from Python
(torch.distributed.optim.DistributedOptimizer's shape).

    opt = tdist.optim.DistributedOptimizer("sgd", param_rrefs, lr=0.05, momentum=0.9)
    with tdist.autograd.context() as ctx:
        ...; tdist.autograd.backward(ctx, [loss]); opt.step(ctx)

Parameters are RRefs whose value on the owner is a parameter tensor (a C worker's module
parameters, or tdist.RRef(tdist.tensor(..., requires_grad=True)) here). Each owner steps its
parameters with the gradients its part of the context accumulated, with torch.optim's rules
(tdist's optim.h): "sgd" (momentum, dampening, nesterov), "adam", "adamw", "adagrad",
"rmsprop"; torch.optim classes are accepted by name too.
"""
from ._lib import check, ffi, lib
from ._state import agent as _agent
from .rref import RRef

_KINDS = {"sgd": lib.TD_OPTIM_SGD, "adam": lib.TD_OPTIM_ADAM, "adamw": lib.TD_OPTIM_ADAMW,
          "adagrad": lib.TD_OPTIM_ADAGRAD, "rmsprop": lib.TD_OPTIM_RMSPROP}
_FIELDS = ("lr", "weight_decay", "maximize", "momentum", "dampening", "nesterov", "eps",
           "amsgrad", "lr_decay", "initial_accumulator_value", "alpha", "centered")


class DistributedOptimizer:
    def __init__(self, optimizer, params, **hyper):
        name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "")
        kind = _KINDS.get(name.lower())
        if kind is None:
            raise ValueError("optimizer: one of %s, got %r" % (sorted(_KINDS), optimizer))
        o = ffi.new("td_optim_options *")
        lib.td_optim_options_init(o, kind)
        for k, v in hyper.items():
            if k == "betas":
                o.beta1, o.beta2 = v
            elif k in _FIELDS:
                setattr(o, k, v)
            else:
                raise TypeError("unknown hyper-parameter %r" % k)
        params = list(params)
        for p in params:
            if not isinstance(p, RRef):
                raise TypeError("params must be tdist.RRef objects, got %s" % type(p).__name__)
        arr = ffi.new("td_rref *[]", [p._r for p in params] or [ffi.NULL])
        out = ffi.new("td_dist_optimizer **")
        check(lib.td_dist_optimizer_create(_agent(), o, arr, len(params), out))
        self._o = ffi.gc(out[0], lib.td_dist_optimizer_destroy)

    def step(self, context):
        """Steps every owner's parameters with the gradients of context (blocks)."""
        check(lib.td_dist_optimizer_step(self._o, context._live()))

    def set_lr(self, lr):
        check(lib.td_dist_optimizer_set_lr(self._o, float(lr)))
