#!/usr/bin/env bash
# test.sh - the one command that sets up a fresh machine and runs the whole test suite:
# installs dependencies, builds (scripts/build.sh, same environment knobs), runs ctest.
# Environment: TD_CTEST_ARGS (default: -LE slow, i.e. everything but the slow-labelled tests).
# PyTorch (python3-torch) is installed too: the binding's drop-in tests (test_torch_rpc,
# test_tutorials) run PyTorch's RPC programs on tdist, and without torch they cannot run at all
# (pytest then reports no test, which fails them: a missing dependency must not pass as a skip).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --torch
scripts/build.sh
dir=${TD_BUILD_DIR:-build}
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)" ${TD_CTEST_ARGS:--LE slow}
