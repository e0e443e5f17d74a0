#!/usr/bin/python3
"""pipeline_schedules.py - PyTorch peer of bench/pipeline_schedules.sh: the GPT of gpt.py cut into
2 pipeline stages and trained with PyTorch 1.13's pipeline, torch.distributed.pipeline.sync.Pipe.

Pipe (torchgpipe) is the only pipeline PyTorch 1.13 ships: it runs GPipe (every micro-batch
forward, then backward) inside one process, a worker thread per device; it has no 1F1B or
interleaved schedule, so only "gpipe" is reported. Both stages are on the CPU here (Pipe needs
the RPC framework initialised, with one worker). Stage 0: the embeddings and the first half of
the blocks; stage 1: the other blocks, ln_f and the head (tied to the token table, as in gpt.py).
Batches: --batch-size windows of the fortunes corpus (gpt.py's loader and generator, seed + 1),
cut into --micro-batches chunks; AdamW lr 1e-3 (betas 0.9, 0.99), clipping at 1.0.

Prints {"bench": "pipeline_schedules", "config": {...}, "results": {"schedules": [{"schedule":
"gpipe", "samples_per_s", "tokens_per_s", "wall_s", "final_loss"}], "peer": "torch.Pipe"}}.
samples_per_s counts sequences over the steps after the first (warm-up).
"""
import argparse
import json
import os
import socket
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
from torch.distributed.pipeline.sync import Pipe  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt as g  # noqa: E402


class Stage0(nn.Module):
    def __init__(self, m, k):
        super().__init__()
        self.wte, self.wpe, self.h = m.transformer.wte, m.transformer.wpe, m.transformer.h[:k]

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.h:
            x = b(x)
        return x


class Stage1(nn.Module):
    def __init__(self, m, k):
        super().__init__()
        self.h, self.ln_f, self.lm_head = m.transformer.h[k:], m.transformer.ln_f, m.lm_head

    def forward(self, x):
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--corpus", default=g.DEFAULT_CORPUS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    text = g.load_corpus(a.corpus)
    vocab = sorted(set(text))
    stoi = {b: i for i, b in enumerate(vocab)}
    data = torch.tensor([stoi[b] for b in text], dtype=torch.long)
    train = data[: int(len(data) * 0.9)]
    model = g.GPT(g.Config(len(vocab), a.block_size, a.n_layer, a.n_head, a.n_embd))
    k = a.n_layer // 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("worker0", rank=0, world_size=1)
    pipe = Pipe(nn.Sequential(Stage0(model, k), Stage1(model, k)), chunks=a.micro_batches,
                checkpoint="never")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
    gen = g.Pcg(a.seed + 1)
    t0, loss = None, None
    for it in range(a.steps):
        if it == 1:
            t0 = time.perf_counter()
        x, y, _ = g.get_batch(train, gen, a.batch_size, a.block_size)
        opt.zero_grad(set_to_none=True)
        logits = pipe(x).local_value()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    wall = time.perf_counter() - t0 if t0 is not None else 0.0
    n = max(a.steps - 1, 0)
    sps = n * a.batch_size / wall if wall > 0 else 0.0
    rpc.shutdown()
    print(json.dumps({
        "bench": "pipeline_schedules",
        "config": {"steps": a.steps, "micro_batches": a.micro_batches, "batch_size": a.batch_size,
                   "block_size": a.block_size, "n_layer": a.n_layer, "n_head": a.n_head,
                   "n_embd": a.n_embd, "stages": 2, "processes": 1},
        "results": {"peer": "torch.Pipe", "schedules": [{
            "schedule": "gpipe", "samples_per_s": sps, "tokens_per_s": sps * a.block_size,
            "wall_s": wall, "final_loss": float(loss) if loss is not None else None}]},
    }), flush=True)


if __name__ == "__main__":
    main()
