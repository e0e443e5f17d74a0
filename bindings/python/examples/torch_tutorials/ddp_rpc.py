"""ddp_rpc.py - PyTorch's RPC + DDP tutorial ("Combining Distributed DataParallel with
Distributed RPC Framework", pytorch/examples distributed/rpc/ddp_rpc), as a PyTorch program.

Four workers: the master (rank 2) creates a RemoteModule holding an nn.EmbeddingBag on the
parameter server "ps" (rank 3) and starts the training loop on the two trainers (ranks 0, 1)
with rpc_async, passing them the RemoteModule. Each trainer's model is that remote embedding
plus a local nn.Linear wrapped in DistributedDataParallel (gloo, a process group of the two
trainers); backward with distributed autograd (DDP averages the Linear's gradients across the
trainers inside it), one DistributedOptimizer over the remote embedding's parameters and the
local Linear's. Differences from the original: the CPU (no .cuda), gloo on a second port,
fewer epochs. The import block is the only difference between a PyTorch run and a tdist run
(TUTORIAL_RPC=torch|tdist). Each trainer prints one "RESULT {json}" line: its losses and its
Linear's weights, which DDP keeps equal on both trainers. The trainers update the embedding on
the server without waiting for each other, so runs differ in the order of those updates.
"""
import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

from results import report

if os.environ.get("TUTORIAL_RPC") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.distributed.rpc import TensorPipeRpcBackendOptions
else:
    import tdist.torch_autograd as dist_autograd
    import tdist.torch_rpc as rpc
    from tdist.torch_nn import RemoteModule
    from tdist.torch_optim import DistributedOptimizer
    from tdist.torch_rpc import RRef
    from tdist.torch_rpc import TensorPipeRpcBackendOptions

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16


class HybridModel(torch.nn.Module):
    def __init__(self, remote_emb_module):
        super(HybridModel, self).__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(16, 8))

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)


def _run_trainer(remote_emb_module, rank, epochs):
    model = HybridModel(remote_emb_module)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch(rank):
        rnd = random.Random(rank)
        g = torch.Generator().manual_seed(rank)
        for _ in range(10):
            num_indices = rnd.randint(20, 50)
            indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=g)
            offsets = []
            start = 0
            batch_size = 0
            while start < num_indices:
                offsets.append(start)
                start += rnd.randint(1, 10)
                batch_size += 1
            offsets_tensor = torch.LongTensor(offsets)
            target = torch.randint(0, 8, (batch_size,), generator=g)
            yield indices, offsets_tensor, target

    losses = []
    for epoch in range(epochs):
        for indices, offsets, target in get_next_batch(rank):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                losses.append(loss.item())
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        print("Training done for epoch {}".format(epoch), flush=True)
    weights = [p.detach().flatten().tolist() for p in model.fc.parameters()]
    report({"rank": rank, "losses": losses, "fc": weights})


def run_worker(rank, world_size, epochs):
    rpc_backend_options = TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = "tcp://localhost:%s" % os.environ["RPC_PORT"]
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
        remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag,
                                         args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                                         kwargs={"mode": "sum"})
        futs = []
        for trainer_rank in [0, 1]:
            trainer_name = "trainer{}".format(trainer_rank)
            futs.append(rpc.rpc_async(trainer_name, _run_trainer,
                                      args=(remote_emb_module, trainer_rank, epochs)))
        for fut in futs:
            fut.wait()
    elif rank <= 1:
        dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                init_method="tcp://localhost:%s" % os.environ["MASTER_PORT"])
        rpc.init_rpc("trainer{}".format(rank), rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    else:
        torch.manual_seed(3)
        rpc.init_rpc("ps", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RPC_PORT", "29501")
    mp.spawn(run_worker, args=(4, a.epochs), nprocs=4, join=True)
