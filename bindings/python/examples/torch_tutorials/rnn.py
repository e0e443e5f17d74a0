"""rnn.py - PyTorch's distributed RNN tutorial ("Getting Started with Distributed RPC Framework",
second part; pytorch/examples distributed/rpc/rnn), as a PyTorch program.

The embedding table and the decoder live on the parameter server "ps" (created with rpc.remote,
used through _remote_method), the LSTM on the trainer; a DistributedOptimizer steps the remote
and the local parameters from each distributed autograd context. Differences from the
original: random data from a seeded generator (the original reads uninitialised memory,
torch.LongTensor(batch, nindices) % ntoken), the server's weights drawn from generators of their
own (its two modules are made by concurrent remote() calls, in either order), and fewer epochs
by default. The import block is the
only difference between a PyTorch run and a tdist run (TUTORIAL_RPC=torch|tdist). Prints one
"RESULT {json}" line (the trainer's losses).

    python3 rnn.py --epochs 4
"""
import argparse
import os

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


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref] + list(args),
                        kwargs=kwargs)


def _parameter_rrefs(module):
    return [RRef(param) for param in module.parameters()]


def _uniform(w, seed):
    """nn.init.uniform_(w, -0.1, 0.1) from a generator of its own: the two remote() calls that
    build the server's modules run concurrently, so the global generator would serve them in
    either order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w.copy_(torch.rand(w.shape, generator=g) * 0.2 - 0.1)


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        _uniform(self.encoder.weight, seed=1)

    def forward(self, input):
        return self.drop(self.encoder(input)).cpu()


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.zeros_(self.decoder.bias)
        _uniform(self.decoder.weight, seed=2)

    def forward(self, output):
        return self.decoder(self.drop(output))


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


def _run_trainer(epochs):
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 7, 2, 3, 6, 4
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(nlayers, nindices, nhid, generator=g),
              torch.randn(nlayers, nindices, nhid, generator=g))
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch():
        for _ in range(5):
            data = torch.randint(0, ntoken, (batch, nindices), generator=g)
            target = torch.randint(0, nindices, (batch, ntoken), generator=g)
            yield data, target

    losses = []
    for epoch in range(epochs):
        for data, target in get_next_batch():
            with dist_autograd.context() as context_id:
                hidden[0].detach_()
                hidden[1].detach_()
                output, hidden = model(data, hidden)
                loss = criterion(output, target)
                losses.append(loss.item())
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        print("Training epoch {}".format(epoch), flush=True)
    report({"losses": losses})


def run_worker(rank, world_size, epochs):
    torch.manual_seed(rank)
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        _run_trainer(epochs)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=4)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.spawn(run_worker, args=(2, a.epochs), nprocs=2, join=True)
