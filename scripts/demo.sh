#!/usr/bin/env bash
# demo.sh - the one command that sets up a fresh machine and runs the main example on real data
# (Fashion-MNIST from Debian's dataset-fashion-mnist): parameter-server training with 3 processes
# (rank 0 holds the model, ranks 1 and 2 train it through RRefs, distributed autograd and the
# distributed optimizer), started by tdistrun. Extra arguments go to the example, for example
# `scripts/demo.sh --epochs 3` or `scripts/demo.sh --model cnn`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# only what the demo runs: the library, the launcher and the example (not the tests and benches)
TD_BUILD_TYPE=Release TD_TARGETS="tdistrun param_server" scripts/build.sh
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
exec build/tools/tdistrun --standalone --nproc-per-node 3 build/examples/param_server "$@"
