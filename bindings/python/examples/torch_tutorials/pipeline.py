"""pipeline.py - PyTorch's RRef pipeline tutorial ("Distributed Pipeline Parallelism Using RPC",
pytorch/examples distributed/rpc/pipeline), as a PyTorch program.

A ResNet split in two shards on worker1 and worker2 (rpc.remote of each shard class); the
master splits every batch into micro-batches, wraps each in an RRef, sends it through
shard 1 with rref.remote().forward(x_rref) and shard 2 with rref.rpc_async().forward(y_rref),
and concatenates torch.futures.wait_all of the results; backward with distributed autograd, a
DistributedOptimizer over both shards' parameters. Differences from the original: a narrow
ResNet (its own Bottleneck, 16x16 images, 10 classes: no torchvision) on the CPU, fewer
batches. The import block is the only difference between a PyTorch run and a tdist run
(TUTORIAL_RPC=torch|tdist). Prints one "RESULT {json}" line (the losses). The original loops
over split sizes, spawning the workers again for each; this one takes one (--split).

Micro-batches finish in any order, so their gradients are summed in any order (in either
library). --split is the rows per micro-batch. This narrow ResNet is chaotic at small
micro-batches: in one process, without RPC, summing the same micro-batch gradients in different
orders moves the third loss from 0.3886 to 0.4389 (split 4 of a batch of 16), and at split 4 of
32 (8 micro-batches) runs of either library differed by up to 9% at the third loss. So the runs
compared use split 16: two micro-batches, whose sum is the same in either order (floating-point
addition commutes), and every run of either library gives the same losses bit for bit.

    python3 pipeline.py --split 16
"""
import argparse
import os
import threading

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim

from results import report

if os.environ.get("TUTORIAL_RPC") == "torch":
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
else:
    import tdist.torch_autograd as dist_autograd
    import tdist.torch_rpc as rpc
    from tdist.torch_optim import DistributedOptimizer
    from tdist.torch_rpc import RRef

num_classes = 10


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (expansion 4)."""

    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNetBase(nn.Module):
    def __init__(self, block, inplanes):
        super().__init__()
        self._lock = threading.Lock()
        self._block = block
        self.inplanes = inplanes

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * self._block.expansion,
                                               stride),
                                       nn.BatchNorm2d(planes * self._block.expansion))
        layers = [self._block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * self._block.expansion
        for _ in range(1, blocks):
            layers.append(self._block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super().__init__(Bottleneck, 8, *args, **kwargs)
        torch.manual_seed(1)
        self.device = device
        self.seq = nn.Sequential(
            nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(self.inplanes), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            self._make_layer(8, 2),
            self._make_layer(16, 2, stride=2)).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super().__init__(Bottleneck, 64, *args, **kwargs)
        torch.manual_seed(2)
        self.device = device
        self.seq = nn.Sequential(self._make_layer(32, 2, stride=2),
                                 nn.AdaptiveAvgPool2d((1, 1))).to(self.device)
        self.fc = nn.Linear(32 * self._block.expansion, num_classes).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


class DistResNet(nn.Module):
    def __init__(self, split_size, workers, *args, **kwargs):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], ResNetShard1, args=("cpu",) + args,
                                  kwargs=kwargs)
        self.p2_rref = rpc.remote(workers[1], ResNetShard2, args=("cpu",) + args,
                                  kwargs=kwargs)

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


num_batches = 3
batch_size = 32
image_w = 16
image_h = 16


def run_master(split_size):
    model = DistResNet(split_size, ["worker1", "worker2"])
    loss_fn = nn.MSELoss()
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    one_hot_indices = torch.randint(0, num_classes, (batch_size, 1), generator=g)
    losses = []
    for i in range(num_batches):
        inputs = torch.randn(batch_size, 3, image_w, image_h, generator=g)
        labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)
        with dist_autograd.context() as context_id:
            outputs = model(inputs)
            loss = loss_fn(outputs, labels)
            losses.append(loss.item())
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    return losses


def run_worker(rank, world_size, num_split):
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=300)
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)
        losses = run_master(num_split)
        report({"split": num_split, "losses": losses})
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", type=int, default=16)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.spawn(run_worker, args=(3, a.split), nprocs=3, join=True)
