"""test_tutorials.py - PyTorch's RPC tutorials (examples/torch_tutorials: the parameter server
with a torch model, the distributed RNN, the RRef pipeline in ResNet's shape, the batch-updating
parameter server, RPC + DDP), each a PyTorch program run as a user runs it (it spawns its
workers) with tdist.torch_rpc in its import block, against the results of the same programs
under torch.distributed.rpc (examples/torch_tutorials/reference.json, written by compare.py
--write-reference with PyTorch 1.13; where ours differ from those, the same program is run under
PyTorch here and ours must agree with that run: the stored results come from another CPU, whose
BLAS rounds differently).

Where a program is deterministic (one trainer; the server updates in fixed order) the losses
must equal PyTorch's to float32 rounding; the pipeline sums micro-batches' gradients in any
order (either library): it runs two micro-batches, whose sum does not depend on the order, so
its losses too equal PyTorch's (with eight, runs of either library differed by up to 9%); in
RPC + DDP the two trainers update the server's embedding without waiting for each other, so only
the first step is fixed - there DDP must keep the trainers' Linear layers identical, and the
losses stay in PyTorch's range. Under ASan (CI's sanitizer stage) the two heaviest, the pipeline
and the batch-updating server, are left out: the five take 2.5 minutes there."""
import json
import os
import sys

import pytest

from conftest import ASAN, HERE, scaled

pytest.importorskip("torch")
TUT = os.path.join(HERE, "..", "examples", "torch_tutorials")
sys.path.insert(0, TUT)
import compare  # noqa: E402

with open(os.path.join(TUT, "reference.json")) as f:
    REF = json.load(f)


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def run(name, impl="tdist"):
    res, secs, out = compare.run(name, impl, timeout=scaled(240))
    assert res, out
    return res


def against_torch(name, got, agrees):
    """The PyTorch results got must agree with (agrees(got, ref)): the stored ones, or where
    those differ, PyTorch's run of the same program on this machine. The stored ones were written
    on another CPU, and BLAS kernels round differently by CPU: a few SGD steps carry that to
    ~1e-5 (the pipeline here: PyTorch and tdist equal to the last bit, the stored third loss
    1.2e-5 away). Returns the reference used."""
    ref = REF[name]
    if not agrees(got, ref):
        ref = run(name, "torch")
    assert agrees(got, ref), (got, ref)
    return ref


def test_parameter_server_tutorial():
    against_torch("ps", run("ps"), lambda got, ref: len(got) == len(ref) == 1 and all(
        close(a, b, 1e-5) for a, b in zip(got[0]["losses"], ref[0]["losses"]))
        and got[0]["accuracy"] == ref[0]["accuracy"])


def losses_agree(n, rel):
    """agrees(got, ref) for a one-result tutorial: n losses, each within rel of PyTorch's."""
    def agrees(got, ref):
        g, r = got[0]["losses"], ref[0]["losses"]
        return len(g) == len(r) == n and all(close(a, b, rel) for a, b in zip(g, r))
    return agrees


def test_distributed_rnn_tutorial():
    against_torch("rnn", run("rnn"), losses_agree(10, 1e-5))


heavy = pytest.mark.skipif(ASAN, reason="time: the sanitizer stage runs the lighter three")


@heavy
def test_rref_pipeline_tutorial():
    against_torch("pipeline", run("pipeline"), losses_agree(3, 1e-6))


@heavy
def test_batch_updating_parameter_server_tutorial():
    def agrees(got, ref):
        g, r = got[0], ref[0]
        return (len(g["losses"]) == len(r["losses"]) and
                all(len(a) == len(b) and all(close(x, y, 1e-5) for x, y in zip(a, b))
                    for a, b in zip(g["losses"], r["losses"])) and
                close(g["final_sum"], r["final_sum"], 1e-5))
    against_torch("batch_ps", run("batch_ps"), agrees)


def test_rpc_ddp_tutorial():
    got, ref = run("ddp_rpc"), REF["ddp_rpc"]
    assert [r["rank"] for r in got] == [0, 1]
    assert got[0]["fc"] == got[1]["fc"]  # DDP kept the replicas equal
    for g, r in zip(got, ref):
        assert close(g["losses"][0], r["losses"][0], 1e-5)
        mean_g = sum(g["losses"]) / len(g["losses"])
        mean_r = sum(r["losses"]) / len(r["losses"])
        assert close(mean_g, mean_r, 0.1), (g["losses"], r["losses"])
