#!/usr/bin/env bash
# demo.sh - the one command that sets up a fresh machine and runs the main example on real data
# (Fashion-MNIST from Debian's dataset-fashion-mnist). Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
TD_BUILD_TYPE=Release scripts/build.sh
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec build/examples/train_local "$@"
