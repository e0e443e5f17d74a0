"""test_install.py - the two ways the README installs the binding, each checked from a clean
interpreter that does not see the build tree: the wheel of build/python/dist pip-installed
(offline) into a virtualenv, which then runs with its own copy of libtdist; and
`cmake --install` into a prefix, used through PYTHONPATH, which runs with the prefix's libtdist.
"""
import glob
import os
import subprocess
import sys

import pytest

from conftest import scaled

BUILD = os.environ.get("TD_PY_BUILD_DIR")
PROBE = r"""
import sys, tdist
@tdist.register
def add(a, b):
    return a + b
tdist.init_rpc("solo", 0, 1, init_method="tcp://127.0.0.1:0")
assert tdist.rpc_sync("solo", add, (2, 3)) == 5
tdist.shutdown()
lib = [l.split()[-1] for l in open("/proc/self/maps") if "libtdist" in l][0]
print(tdist.__file__)
print(lib)
"""


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LD_LIBRARY_PATH", "TD_RPC_SECRET")}
    return env


@pytest.fixture
def build_dir():
    if not BUILD:
        pytest.skip("TD_PY_BUILD_DIR is not set (run through ctest)")
    if os.environ.get("TD_PY_ASAN") == "1":
        pytest.skip("installs are checked in the plain build (the ASan build's libraries need "
                    "the sanitizer runtime preloaded)")
    return BUILD


def run_probe(python, cwd, env):
    out = subprocess.run([python, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stdout + out.stderr
    module, lib = out.stdout.split()[-2:]
    return module, lib


def test_wheel_installs_into_a_virtualenv(build_dir, tmp_path):
    wheels = glob.glob(os.path.join(build_dir, "python", "dist", "tdist-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=scaled(120))
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-index", "--no-deps",
                          wheels[0]], capture_output=True, text=True, timeout=scaled(300))
    assert pip.returncode == 0, pip.stdout + pip.stderr
    module, lib = run_probe(str(venv / "bin" / "python"), str(tmp_path), clean_env())
    assert module.startswith(str(venv)), module
    assert lib.startswith(str(venv)), lib  # the wheel's own libtdist, not the build tree's


def test_cmake_install_with_pythonpath(build_dir, tmp_path):
    prefix = tmp_path / "prefix"
    out = subprocess.run(["cmake", "--install", build_dir, "--prefix", str(prefix)],
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr
    site = glob.glob(str(prefix / "lib*" / "python3" / "dist-packages"))
    assert len(site) == 1, site
    env = clean_env()
    env["PYTHONPATH"] = site[0]
    module, lib = run_probe(sys.executable, str(tmp_path), env)
    assert module.startswith(site[0]), module
    assert lib.startswith(str(prefix)), lib
