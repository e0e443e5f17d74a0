"""test_example.py - examples/param_server.py in short mode (one epoch of 40 batches per
trainer, a C server and 2 Python trainers): every process exits 0, the training loss fell and
the test accuracy is at least 0.6 (chance is 0.1; the C example reaches 0.75-0.79 after the same
40 batches). Skipped without PyTorch, the Fashion-MNIST files or the built server (examples off,
as in CI's sanitizer stage)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import scaled

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("TD_DATA_DIR") or "/usr/share/datasets/fashion-mnist"


def test_param_server_example_learns():
    pytest.importorskip("torch")
    server = os.environ.get("TD_PY_PS_SERVER")
    if not server:
        pytest.skip("c_param_server was not built (TD_BUILD_EXAMPLES=OFF)")
    if not any(os.path.exists(os.path.join(DATA, "train-images-idx3-ubyte" + ext))
               for ext in (".gz", "")):
        pytest.skip("no Fashion-MNIST in %s" % DATA)
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "..", "examples", "param_server.py"), "--epochs",
         "1", "--max-batches", "40", "--server", server],
        capture_output=True, text=True, timeout=scaled(240))
    assert out.returncode == 0, out.stdout + out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    r = json.loads(line)["results"]
    assert r["first_loss"] > r["last_loss"], r
    assert r["test_accuracy"] >= 0.6, r
    assert r["samples_per_s"] > 0
