"""batch_ps.py - PyTorch's batch-updating parameter server ("Implementing Batch RPC Processing
Using Asynchronous Executions", pytorch/examples distributed/rpc/batch/parameter_server.py), as
a PyTorch program.

The server (rank 0) keeps a model and a torch.futures.Future of the next one; each trainer sends
its gradients with rpc_sync to update_and_fetch_model, a static method marked
@rpc.functions.async_execution: it adds them, and returns the shared future, which the server
completes - after an SGD step - once batch_update_size trainers have reported; so no server
thread waits. Differences from the original: a small MLP (no torchvision), the CPU, 2 trainers
updating together, and the model's parameters travel, not the model: the original returns the
nn.Module itself, which PyTorch pickles; tdist sends data only (tdist.torch_rpc explains why),
so get_model / the future hand out [p.detach() for p in parameters] and each trainer copies them
into its own replica. The import block is the only difference between a PyTorch run and a
tdist run (TUTORIAL_RPC=torch|tdist). Prints one "RESULT {json}" line per trainer.
"""
import argparse
import os
import threading

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from torch import optim

from results import report

if os.environ.get("TUTORIAL_RPC") == "torch":
    import torch.distributed.rpc as rpc
else:
    import tdist.torch_rpc as rpc

batch_size = 20
in_features = 64
num_classes = 10
batch_update_size = 2
num_batches = 6


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_features, 128), nn.ReLU(), nn.Linear(128, num_classes))


class BatchUpdateParameterServer(object):

    def __init__(self, batch_update_size=batch_update_size):
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad()
                fut.set_result([p.detach().clone() for p in self.model.parameters()])
                self.future_model = torch.futures.Future()
        return fut


class Trainer(object):

    def __init__(self, ps_rref, rank):
        self.ps_rref = ps_rref
        self.loss_fn = nn.MSELoss()
        self.g = torch.Generator().manual_seed(rank)
        self.one_hot_indices = torch.randint(0, num_classes, (batch_size, 1), generator=self.g)

    def get_next_batch(self):
        for _ in range(num_batches):
            inputs = torch.randn(batch_size, in_features, generator=self.g)
            labels = torch.zeros(batch_size, num_classes).scatter_(1, self.one_hot_indices, 1)
            yield inputs, labels

    def train(self):
        m = make_model()
        params = self.ps_rref.rpc_sync().get_model()
        losses = []
        for inputs, labels in self.get_next_batch():
            with torch.no_grad():
                for p, v in zip(m.parameters(), params):
                    p.copy_(v)
            m.zero_grad()
            loss = self.loss_fn(m(inputs), labels)
            loss.backward()
            losses.append(loss.item())
            params = rpc.rpc_sync(self.ps_rref.owner(),
                                  BatchUpdateParameterServer.update_and_fetch_model,
                                  args=(self.ps_rref, [p.grad for p in m.parameters()]))
        return losses


def run_trainer(ps_rref, rank):
    return Trainer(ps_rref, rank).train()


def run_ps(trainers):
    ps_rref = rpc.RRef(BatchUpdateParameterServer())
    futs = [rpc.rpc_async(t, run_trainer, args=(ps_rref, i + 1)) for i, t in enumerate(trainers)]
    losses = torch.futures.wait_all(futs)
    final = ps_rref.local_value().get_model()
    report({"losses": losses,
            "final_sum": float(sum(p.double().sum() for p in final))})


def run(rank, world_size):
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=0)
    if rank != 0:
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=options)
        run_ps([f"trainer{r}" for r in range(1, world_size)])
    rpc.shutdown()


if __name__ == "__main__":
    argparse.ArgumentParser().parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    world_size = batch_update_size + 1
    mp.spawn(run, args=(world_size, ), nprocs=world_size, join=True)
