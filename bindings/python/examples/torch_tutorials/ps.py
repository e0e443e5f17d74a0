"""ps.py - PyTorch's parameter-server tutorial ("Implementing a Parameter Server Using Distributed
RPC Framework", pytorch/examples distributed/rpc/parameter_server), as a PyTorch program.

The parameter server (rank 0) holds a convolutional model; each trainer gets it through
rpc.remote(get_parameter_server) (created once, under a lock, in the server's handler), runs
its forward through remote_method helpers, backward with distributed autograd, and steps the
server's parameters with a DistributedOptimizer; then it evaluates the model. Differences from
the original: a small synthetic 10-class image set instead of MNIST (no download), a smaller
net, no GPU, one trainer by default. Run with PyTorch's RPC or tdist's: the import block below
is the only difference (TUTORIAL_RPC=torch|tdist). Prints one "RESULT {json}" line per trainer.

With several trainers (--world_size 3) the original design races: a trainer's optimizer step
changes the server's parameters in place while another trainer's backward still needs their
saved values, and backward fails with "one of the variables needed for gradient computation has
been modified by an inplace operation" - under PyTorch's RPC as under tdist (seen here in both
on the first try). One trainer is deterministic, so the two runs can be compared value for value.

    python3 ps.py                    # 1 server, 1 trainer
"""
import argparse
import os
from threading import Lock

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

from results import report

if os.environ.get("TUTORIAL_RPC") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
else:
    import tdist.torch_autograd as dist_autograd
    import tdist.torch_rpc as rpc
    from tdist.torch_optim import DistributedOptimizer


# --------- the network, on the parameter server ---------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


# --------- helpers ---------

def call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), call_method, args=args, kwargs=kwargs)


# --------- parameter server ---------

class ParameterServer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()

    def forward(self, inp):
        return self.model(inp)

    def get_dist_gradients(self, cid):
        grads = dist_autograd.get_gradients(cid)
        return {k: v for k, v in grads.items()}

    def get_param_rrefs(self):
        return [rpc.RRef(param) for param in self.model.parameters()]


param_server = None
global_lock = Lock()


def get_parameter_server():
    global param_server
    with global_lock:
        if not param_server:
            param_server = ParameterServer()
        return param_server


def run_parameter_server(rank, world_size):
    rpc.init_rpc(name="parameter_server", rank=rank, world_size=world_size)
    rpc.shutdown()


# --------- trainers ---------

class TrainerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.param_server_rref = rpc.remote("parameter_server", get_parameter_server)

    def get_global_param_rrefs(self):
        return remote_method(ParameterServer.get_param_rrefs, self.param_server_rref)

    def forward(self, x):
        return remote_method(ParameterServer.forward, self.param_server_rref, x)


def synthetic(n, seed):
    """Images of 10 classes: a fixed random 14x14 prototype per class plus noise."""
    g = torch.Generator().manual_seed(1234)
    protos = torch.randn(10, 1, 14, 14, generator=g)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return protos[labels] + 0.8 * torch.randn(n, 1, 14, 14, generator=g), labels


def run_training_loop(rank, world_size, batches):
    net = TrainerNet()
    param_rrefs = net.get_global_param_rrefs()
    opt = DistributedOptimizer(optim.SGD, param_rrefs, lr=0.05)
    data, target = synthetic(32 * batches, seed=rank)
    losses = []
    for i in range(batches):
        x, y = data[32 * i:32 * (i + 1)], target[32 * i:32 * (i + 1)]
        with dist_autograd.context() as cid:
            model_output = net(x)
            loss = F.nll_loss(model_output, y)
            losses.append(loss.item())
            dist_autograd.backward(cid, [loss])
            assert remote_method(ParameterServer.get_dist_gradients, net.param_server_rref,
                                 cid) != {}
            opt.step(cid)
    test_x, test_y = synthetic(256, seed=99)
    with torch.no_grad():
        correct = net(test_x).argmax(dim=1).eq(test_y).sum().item()
    report({"rank": rank, "losses": losses,
            "accuracy": correct / len(test_y)})


def run_worker(rank, world_size, batches):
    torch.manual_seed(rank)
    rpc.init_rpc(name=f"trainer_{rank}", rank=rank, world_size=world_size)
    run_training_loop(rank, world_size, batches)
    rpc.shutdown()


def run(rank, world_size, batches):
    if rank == 0:
        run_parameter_server(rank, world_size)
    else:
        run_worker(rank, world_size, batches)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Parameter-Server RPC based training")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.spawn(run, args=(args.world_size, args.batches), nprocs=args.world_size, join=True)
