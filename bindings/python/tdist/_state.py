"""_state.py - the process's agent and the settings init_rpc chose (one agent per process, as in
torch.distributed.rpc). Written by rpc.init_rpc / rpc.shutdown (and by the fork hooks), read
everywhere."""
from . import errors


class State:
    def __init__(self):
        self.agent = None          # td_rpc_agent*, between init_rpc and shutdown
        self.name = None
        self.rank = -1
        self.world_size = 0
        self.host_progress = False  # init_rpc(progress="host")
        self.tensor_type = "auto"   # "auto", "numpy" or "torch"
        self.forked = False         # this process is a fork() child of one that ran tdist
        self.pending_interrupt = None  # KeyboardInterrupt caught in a handler (host mode)
        # init_rpc is under way: the first handler (which may run before td_rpc_init has returned
        # to Python, see rpc.init_rpc) or the init thread, whichever comes first, publishes the
        # agent (rpc._publish)
        self.starting = False


state = State()


def agent():
    """The running agent (td_rpc_agent*); raises when there is none."""
    if state.forked:
        raise errors.ForkError(
            "tdist: this process was forked from one that had called tdist.init_rpc; tdist "
            "cannot run here (its threads were not copied): fork before init_rpc, or start "
            "workers with subprocess or multiprocessing's 'spawn' method")
    if state.agent is None:
        raise errors.StateError("tdist: RPC is not running (call tdist.init_rpc first)", 2)
    return state.agent
