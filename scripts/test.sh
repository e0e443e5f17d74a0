#!/usr/bin/env bash
# test.sh - the one command that sets up a fresh machine and runs the whole test suite:
# installs dependencies, builds (scripts/build.sh, same environment knobs), runs ctest.
# Environment: TD_CTEST_ARGS (default: -LE slow, i.e. everything but the slow-labelled tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
dir=${TD_BUILD_DIR:-build}
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)" ${TD_CTEST_ARGS:--LE slow}
