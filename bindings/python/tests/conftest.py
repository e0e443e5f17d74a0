"""conftest.py - support for the binding's tests: worker groups on 127.0.0.1 with a free port
and one secret, made of this pytest process (rank 0, in-process tdist) and child processes -
C workers (c_worker, built with the tests) and Python workers (py_worker.py) - which are killed
by pid when a test ends.

Timing windows for things that should happen scale with TD_TEST_TIMEOUT_SCALE (scaled());
the interpreter is the one running pytest (TD_PYTHON).
"""
import os
import socket
import subprocess
import sys
import time

import pytest

import tdist

HERE = os.path.dirname(os.path.abspath(__file__))
C_WORKER = os.environ.get("TD_PY_C_WORKER")
SCALE = float(os.environ.get("TD_TEST_TIMEOUT_SCALE", "1") or 1)
ASAN = os.environ.get("TD_PY_ASAN") == "1"


def scaled(seconds):
    return seconds * SCALE * (3 if ASAN else 1)


def poll(cond, seconds):
    """Evaluates cond every 10 ms until it is true or the scaled time passed; returns it."""
    end = time.monotonic() + scaled(seconds)
    while not cond():
        if time.monotonic() > end:
            return cond()
        time.sleep(0.01)
    return True


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """A group of `world` workers: rank 0 is this process, the others are children."""

    def __init__(self, world, tmp_path):
        self.world = world
        self.port = free_port()
        self.secret = tdist.generate_secret()
        self.children = {}  # rank -> Popen
        self.logs = {}
        self.tmp = tmp_path

    def env(self, rank):
        e = dict(os.environ)
        e.update(RANK=str(rank), WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(self.port), TD_RPC_SECRET=self.secret, LOCAL_RANK=str(rank))
        return e

    def _spawn(self, rank, argv, extra_env=None):
        log = open(os.path.join(self.tmp, "rank%d.log" % rank), "wb")
        self.logs[rank] = log.name
        env = self.env(rank)
        env.update(extra_env or {})
        self.children[rank] = subprocess.Popen(argv, env=env, stdout=log,
                                               stderr=subprocess.STDOUT)
        log.close()
        return self.children[rank]

    def spawn_c(self, rank, name=None):
        if not C_WORKER:
            pytest.skip("TD_PY_C_WORKER is not set (run through ctest)")
        env = None
        if ASAN:  # the C worker is all instrumented: check it for leaks too
            env = {"ASAN_OPTIONS": "detect_leaks=1", "LD_PRELOAD": ""}
        return self._spawn(rank, [C_WORKER] + ([name] if name else []), env)

    def spawn_py(self, rank, *args):
        return self._spawn(rank, [sys.executable, os.path.join(HERE, "py_worker.py")] +
                           list(args))

    def init(self, name="py0", **kwargs):
        kwargs.setdefault("init_timeout", scaled(30))
        return tdist.init_rpc(name, 0, self.world, init_method="tcp://127.0.0.1:%d" % self.port,
                              secret=self.secret, **kwargs)

    def log(self, rank):
        with open(self.logs[rank], "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait(self, rank, seconds=60):
        """Waits for child rank to exit and returns its exit code (None when it did not)."""
        try:
            return self.children[rank].wait(scaled(seconds))
        except subprocess.TimeoutExpired:
            return None

    def kill(self, rank):
        p = self.children[rank]
        if p.poll() is None:
            p.kill()
        p.wait()

    def finish(self, graceful=True):
        """Shuts rank 0 down (gracefully: with everyone), then waits for the children; fails
        the test, with their logs, unless every child exited 0."""
        from tdist._state import state
        if state.agent is not None:
            tdist.shutdown(graceful=graceful)
        bad = []
        for rank in sorted(self.children):
            code = self.wait(rank)
            if code != 0:
                bad.append("rank %d exited %r:\n%s" % (rank, code, self.log(rank)))
        assert not bad, "\n".join(bad)

    def cleanup(self):
        for p in self.children.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def group(tmp_path):
    """group(world) -> Group; at the end the children are killed and a running agent is
    stopped (non-gracefully)."""
    made = []

    def make(world):
        g = Group(world, str(tmp_path))
        made.append(g)
        return g

    yield make
    from tdist._state import state
    if state.agent is not None:
        tdist.shutdown(graceful=False)
    for g in made:
        g.cleanup()


def _solo(tensor_type):
    tdist.init_rpc("solo", 0, 1, init_method="tcp://127.0.0.1:0", tensor_type=tensor_type)
    yield
    from tdist._state import state
    if state.agent is not None:
        tdist.shutdown()


@pytest.fixture
def solo():
    """A world of one worker ("solo") in this process, tensors as numpy arrays."""
    yield from _solo("numpy")


@pytest.fixture
def solo_torch():
    """The same, tensors as torch tensors (skipped without PyTorch)."""
    pytest.importorskip("torch")
    yield from _solo("torch")
