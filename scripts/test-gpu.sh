#!/usr/bin/env bash
# test-gpu.sh - builds tdist with CUDA and runs the gpu-labelled tests on a machine with an NVIDIA
# GPU: every CUDA op against the CPU result (test_cuda_ops), NCCL all-reduce across processes on
# one GPU (test_collectives_nccl), CUDA tensors over RPC along device maps (test_rpc_devmap_gpu),
# then train_local on cuda:0 for a short run.
#
# usage: scripts/test-gpu.sh            (build dir: ${TD_BUILD_DIR:-build-gpu})
# Unlike scripts/test.sh, a gpu test that skips counts as a failure here: this script is for
# machines that have a GPU (nvidia-smi must list one), where skipping means something is wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${TD_BUILD_DIR:-build-gpu}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "test-gpu.sh: no NVIDIA GPU found (nvidia-smi -L lists none); nothing to test" >&2
  exit 2
fi
nvidia-smi -L

scripts/install-deps.sh
TD_BUILD_DIR="$dir" TD_WITH_CUDA=ON TD_CMAKE_ARGS="${TD_CMAKE_ARGS:-}" scripts/build.sh

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
ctest --test-dir "$dir" --output-on-failure -L gpu 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if grep -q 'Skipped' "$log"; then
  echo "test-gpu.sh: a gpu test skipped although a GPU is present (see above)" >&2
  rc=1
fi
if [[ $rc -ne 0 ]]; then exit "$rc"; fi

echo "== train_local on cuda:0 (short run) =="
"$dir"/examples/train_local --device cuda:0 --epochs 1 --max-batches 200 | tail -1
echo "test-gpu.sh: all gpu tests passed"
