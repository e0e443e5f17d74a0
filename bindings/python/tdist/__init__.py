"""tdist - the Python binding of tdist: torch.distributed.rpc's API over tdist's C library.

    import tdist

    @tdist.register
    def add(x, y):
        return x + y

    tdist.init_rpc("worker0", rank=0, world_size=2)        # secret from TD_RPC_SECRET
    print(tdist.rpc_sync("worker1", add, (1, 2)))           # 3, computed on worker1
    fut = tdist.rpc_async("worker1", "c_function", (np.ones(4),))
    print(fut.wait())
    tdist.shutdown()

Workers may be C programs or Python programs in any mix: functions are called by name, only
data travels (None, bool, int, float, str, bytes, list, dict, numpy arrays and torch CPU tensors
without copies, RRefs), never pickles. PyTorch RPC programs use tdist.torch_rpc,
tdist.torch_autograd, tdist.torch_optim and tdist.torch_nn instead (torch.distributed.rpc's API,
distributed autograd through torch tensors); `import tdist` itself never imports torch. See
the README's Python section and docs/ARCHITECTURE.md ("Python binding") for threads, the GIL,
host-driven progress and lifetimes.
"""
from . import autograd, errors, optim  # noqa: F401
from ._lib import ffi as _ffi, lib as _lib
from ._timeouts import UNSET as UNSET_RPC_TIMEOUT  # noqa: F401
from .errors import (AlreadyExistsError, AuthError, CancelledError, DeviceError,  # noqa: F401
                     DtypeError, Error, ForkError, FormatError, InputOutputError, InternalError,
                     InvalidArgumentError, NotFoundError, OutOfMemoryError, RemoteError,
                     ShapeError, StateError, TimeoutError, UnavailableError, UnsupportedError)
from .futures import Future, wait_all  # noqa: F401
from .rpc import (CallerInfo, WorkerInfo, current_caller, generate_secret,  # noqa: F401
                  get_default_timeout, get_rank, get_rpc_timeout, get_stats, get_worker_info,
                  get_world_size, init_rpc, progress, progress_fd, register, remote, rpc_async,
                  rpc_sync, set_default_timeout, shutdown, unregister)
from .rref import RRef  # noqa: F401
from ._convert import OpaqueValue  # noqa: F401
from ._tensor import Tensor, from_numpy, tensor  # noqa: F401
from . import asyncio  # noqa: F401,E402  (tdist.asyncio after `import tdist`, as documented)


def version():
    """The version of the tdist library this binding runs with ("0.1.0")."""
    return _ffi.string(_lib.td_version_string()).decode()


__version__ = version()
