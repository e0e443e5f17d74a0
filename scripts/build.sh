#!/usr/bin/env bash
# build.sh - configures and builds tdist into ${TD_BUILD_DIR:-build}.
# Environment: TD_BUILD_TYPE (Release), TD_SANITIZE (e.g. address,undefined), TD_WERROR (ON/OFF),
# TD_WITH_CUDA (AUTO/ON/OFF), TD_CMAKE_ARGS (extra arguments), TD_TARGETS (space-separated
# targets to build; default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${TD_BUILD_DIR:-build}
cmake -S . -B "$dir" \
  -DCMAKE_BUILD_TYPE="${TD_BUILD_TYPE:-Release}" \
  -DTD_SANITIZE="${TD_SANITIZE:-}" \
  -DTD_WERROR="${TD_WERROR:-OFF}" \
  -DTD_WITH_CUDA="${TD_WITH_CUDA:-AUTO}" \
  ${TD_CMAKE_ARGS:-}
targets=()
for t in ${TD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$dir" -j"$(nproc)" "${targets[@]}"
