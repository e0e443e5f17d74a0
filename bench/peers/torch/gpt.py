#!/usr/bin/python3
"""gpt.py - PyTorch peer of examples/gpt.c: a character-level GPT trained on the fortunes corpus.

The same model, data, batches, initial weights and recipe as the C example, so that both reach
the same validation loss at the same step and their tokens/s compare like for like:

  model    nanoGPT's GPT (GPT-2 layout, biases on, no dropout, lm_head tied to wte): --n-layer 4,
           --n-head 4, --n-embd 128, --block-size 64; the attention is nanoGPT's non-flash path
           (q @ k^T * scale, masked_fill(-inf), softmax, @ v), the only one PyTorch 1.13 has.
  data     every regular file of --corpus (default /usr/share/games/fortunes), names ending in
           .dat skipped, symlinks skipped, in byte order of their names; cleaned byte by byte: a
           "%" separator line becomes an empty line, a backspace deletes itself and the character
           before it (overstrike), and only "\\n", "\\t" and printable ASCII are kept; each file ends
           with a newline. Vocabulary = the sorted distinct bytes; the first 90% is train, the rest
           validation.
  batches  --batch-size windows of --block-size tokens; window b starts at next_u64() % (len -
           block_size) of tdist's generator (PCG-XSL-RR 128/64, reimplemented below: Pcg), seeded
           with --seed + 1 for training (one stream for the whole run) and reseeded with --seed + 2
           at every evaluation (the same eval batches each time: train split first, then val).
  init     --init FILE loads a safetensors state dict (what `examples/gpt --steps 0 --save FILE`
           writes); without it nanoGPT's own initialisation is used.
  recipe   AdamW (lr --lr 1e-3, betas (0.9, --beta2 0.99), eps 1e-8, weight decay --weight-decay
           0.1 on parameters with >= 2 dims, 0 on the others), nanoGPT's get_lr (linear warmup
           --warmup 100 steps, cosine to --min-lr 1e-4 at the last step), clip_grad_norm_ 1.0,
           --steps 2000; the mean loss of --eval-iters 20 batches on each split at step 0, every
           --eval-interval 250 steps and after the last step.

Data parallel, as the C example's --nproc N --dp ddp|zero1: N processes forked here (torch.
multiprocessing, gloo over 127.0.0.1, rendezvous through a file in a temporary directory), each
drawing its own batches (generator seeded with --seed + 1 + rank, as the C example), the model in
torch's DistributedDataParallel (25 MiB buckets, gradient_as_bucket_view=True as the C example's
DDP), and for zero1 torch's ZeroRedundancyOptimizer over AdamW. Rank 0 evaluates (on the module
under DDP, so the others do not wait for it in a collective) and prints; tokens_per_s counts every
rank's training tokens over rank 0's training time, and batch_hash is rank 0's batches'.

Prints one JSON line with the C example's keys: {"bench": "gpt", "config": {...}, "results":
{"val_loss", "train_loss", "tokens_per_s", "wall_s", "evals", "batch_hash", ...}}; tokens_per_s
counts training tokens over the time of the training steps (evaluation excluded), tokens_per_cpu_s
over the CPU time they took (all threads). Run with
/usr/bin/python3 (the interpreter with torch); OPENBLAS_NUM_THREADS is set to --threads when
missing (Debian's torch uses OpenBLAS, which ignores torch.set_num_threads).
"""
import argparse
import json
import math
import os
import resource
import sys
import time

if __name__ == "__main__" and os.environ.get("OPENBLAS_NUM_THREADS") is None:
    threads = "1"
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            threads = sys.argv[i + 1]
        elif a.startswith("--threads="):
            threads = a.split("=", 1)[1]
    os.environ["OPENBLAS_NUM_THREADS"] = threads
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_CORPUS = "/usr/share/games/fortunes"
MASK64 = (1 << 64) - 1
MASK128 = (1 << 128) - 1


class Pcg:
    """tdist's td_generator (tensor/tensor.c): PCG-XSL-RR 128/64 with its seeding."""
    MULT = (2549297995355413924 << 64) | 4865540595714422341
    INC = ((0xDA3E39CB94B95BDB << 64) | 0x5851F42D4C957F2D) | 1

    def __init__(self, seed):
        self.state = 0
        self.next_u64()
        self.state = (self.state + ((seed << 64) | ((seed * 0x9E3779B97F4A7C15) & MASK64))) & MASK128
        self.next_u64()

    def next_u64(self):
        self.state = (self.state * Pcg.MULT + Pcg.INC) & MASK128
        x = ((self.state >> 64) ^ self.state) & MASK64
        rot = self.state >> 122
        return ((x >> rot) | (x << ((-rot) & 63))) & MASK64


def clean(raw):
    """The cleaning rule of examples/gpt.c (see the module docstring)."""
    out = bytearray()
    for line in raw.split(b"\n"):
        if line == b"%":
            out += b"\n"
            continue
        for c in line:
            if c == 8:
                if out and out[-1] != 10:
                    del out[-1]
            elif c == 9 or 32 <= c <= 126:
                out.append(c)
        out.append(10)
    if raw.endswith(b"\n"):
        del out[-1]  # split() gave an empty last piece
    if out and out[-1] != 10:
        out.append(10)
    return bytes(out)


def load_corpus(path):
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.endswith(".dat"))
        files = [os.path.join(path, n) for n in names
                 if not os.path.islink(os.path.join(path, n))
                 and os.path.isfile(os.path.join(path, n))]
    else:
        files = [path]
    text = b"".join(clean(open(f, "rb").read()) for f in files)
    if not text:
        sys.exit("gpt.py: empty corpus %s" % path)
    return text


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.register_buffer("bias", torch.tril(torch.ones(cfg.block_size, cfg.block_size))
                             .view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Config:
    def __init__(self, vocab_size, block_size=64, n_layer=4, n_head=4, n_embd=128):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def read_safetensors(path):
    """A minimal safetensors reader (F32/F64/I64), returning (dict name -> tensor, metadata)."""
    import struct
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + hlen])
    meta = header.pop("__metadata__", {})
    base = 8 + hlen
    dt = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        t = torch.frombuffer(bytearray(blob[base + b:base + e]), dtype=dt[h["dtype"]])
        out[name] = t.reshape(h["shape"]) if h["shape"] else t.reshape(())
    return out, meta


def nanogpt_get_lr(it, warmup, decay_iters, lr, min_lr):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters or decay_iters <= warmup:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def get_batch(data, gen, batch_size, block_size):
    ix = [gen.next_u64() % (len(data) - block_size) for _ in range(batch_size)]
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y, ix


def batch_hash(h, ix):
    """The running hash of batch offsets both programs print (FNV-style, 64 bits)."""
    for i in ix:
        h = ((h ^ i) * 0x100000001B3) & MASK64
    return h


def autocast(args):
    """The forward's precision scope: bf16 autocast, or nothing."""
    if args.dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext()


@torch.no_grad()
def estimate(model, splits, args):
    model.eval()
    gen = Pcg(args.seed + 2)
    out = []
    for data in splits:
        total = 0.0
        for _ in range(args.eval_iters):
            x, y, _ = get_batch(data, gen, args.batch_size, args.block_size)
            with autocast(args):
                total += model(x, y)[1].item()
        out.append(total / args.eval_iters)
    model.train()
    return out


def main():
    args = parse_args()
    if args.nproc == 1:
        train_rank(0, args, None)
        return
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(train_rank, args=(args, os.path.join(tmp, "rendezvous")),
                           nprocs=args.nproc, join=True, start_method="fork")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.99)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--eval-iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--corpus", default=DEFAULT_CORPUS)
    ap.add_argument("--init", default=None)
    ap.add_argument("--dtype", choices=["f32", "f64", "bf16"], default="f32",
                    help="bf16: torch.autocast('cpu', dtype=torch.bfloat16) around every forward "
                         "(float32 weights, as the C example's --dtype bf16); PyTorch 1.13's CPU "
                         "autocast has no float16")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--dp", choices=["ddp", "zero1"], default="ddp")
    return ap.parse_args()


def train_rank(rank, args, rendezvous):
    import torch.distributed as dist
    if rendezvous:
        dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank,
                                world_size=args.nproc)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    text = load_corpus(args.corpus)
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_train = int(len(data) * 0.9)
    train, val = data[:n_train], data[n_train:]
    cfg = Config(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = GPT(cfg)
    if args.dtype == "f64":
        model = model.double()
    if args.init:
        sd, meta = read_safetensors(args.init)
        if "vocab" in meta and meta["vocab"].encode("latin-1") != bytes(vocab):
            sys.exit("gpt.py: %s was made for another vocabulary" % args.init)
        model.load_state_dict(sd, strict=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    hyper = {"lr": args.lr, "betas": (0.9, args.beta2), "eps": 1e-8}
    module = model  # what evaluations run
    if rendezvous:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if rendezvous and args.dp == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      weight_decay=args.weight_decay, **hyper)
        opt.add_param_group(groups[1])
    else:
        opt = torch.optim.AdamW(groups, **hyper)
    gen = Pcg(args.seed + 1 + rank)
    evals, h, train_time, loss_value = [], 0xCBF29CE484222325, 0.0, float("nan")
    train_cpu = 0.0
    for it in range(args.steps + 1):
        if rank == 0 and (it % args.eval_interval == 0 or it == args.steps):
            tl, vl = estimate(module, [train, val], args)
            evals.append({"step": it, "train_loss": tl, "val_loss": vl})
            print("step %d: train loss %.4f, val loss %.4f" % (it, tl, vl), file=sys.stderr)
        if it == args.steps:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        lr = nanogpt_get_lr(it, args.warmup, args.steps, args.lr, args.min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, ix = get_batch(train, gen, args.batch_size, args.block_size)
        h = batch_hash(h, ix)
        with autocast(args):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        loss_value = loss.item()
        train_time += time.perf_counter() - t0
        train_cpu += time.process_time() - c0
    if rank != 0:
        dist.destroy_process_group()
        return
    tokens = args.steps * args.batch_size * args.block_size * args.nproc  # every rank's
    out = {
        "bench": "gpt",
        "config": {
            "impl": "torch " + torch.__version__, "steps": args.steps,
            "batch_size": args.batch_size, "block_size": args.block_size,
            "n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
            "vocab_size": len(vocab), "corpus_chars": len(text), "lr": args.lr,
            "min_lr": args.min_lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
            "beta2": args.beta2, "grad_clip": args.grad_clip, "eval_interval": args.eval_interval,
            "eval_iters": args.eval_iters, "seed": args.seed, "dtype": args.dtype,
            "threads": args.threads, "torch_num_threads": torch.get_num_threads(),
            "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
            "init": args.init is not None, "nproc": args.nproc,
            "dp": args.dp if rendezvous else None,
            "params": sum(p.numel() for p in model.parameters()),
        },
        "results": {
            "val_loss": evals[-1]["val_loss"], "train_loss": evals[-1]["train_loss"],
            "last_batch_loss": loss_value,
            "tokens_per_s": tokens / train_time if train_time > 0 else None,
            "tokens_per_cpu_s": tokens / train_cpu if train_cpu > 0 else None,
            "train_s": train_time, "wall_s": time.perf_counter() - t_start,
            "evals": evals, "batch_hash": "%016x" % h,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        },
    }
    print(json.dumps(out), flush=True)
    if rendezvous:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
