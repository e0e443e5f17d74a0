#!/usr/bin/env bash
# fuzz.sh - builds the libFuzzer targets with clang (ASan + UBSan) into build-fuzz and runs each
# for a bounded time. Exits non-zero when a target crashes, leaks, times out or runs out of memory;
# the input that did it is left in $dir/fuzz/artifacts/.
# Environment: TD_FUZZ_SECONDS (per target, default 60), TD_FUZZ_BUILD_DIR (default build-fuzz).
# Needs clang and libclang-rt-dev (scripts/install-deps.sh --fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${TD_FUZZ_SECONDS:-60}
dir=${TD_FUZZ_BUILD_DIR:-build-fuzz}
if ! command -v clang >/dev/null; then
  echo "fuzz.sh: clang not found; run scripts/install-deps.sh --fuzz" >&2
  exit 2
fi
CC=clang CXX=clang++ cmake -S . -B "$dir" -DTD_BUILD_FUZZERS=ON -DTD_WITH_CUDA=OFF \
  -DTD_BUILD_TESTS=OFF -DTD_BUILD_EXAMPLES=OFF -DTD_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$dir" -j"$(nproc)" --target fuzz_wire_decoder fuzz_auth fuzz_corpus

for target in wire_decoder auth; do
  work="$dir/fuzz/corpus/$target" # grows between runs; the committed and generated seeds stay
  art="$dir/fuzz/artifacts/$target/"
  mkdir -p "$work" "$art" "$dir/fuzz/seeds/$target" "fuzz/corpus/$target"
  echo "fuzz.sh: fuzz_$target for ${secs}s"
  "$dir/fuzz/fuzz_$target" -max_total_time="$secs" -timeout=5 -rss_limit_mb=2048 \
    -dict=fuzz/$target.dict -artifact_prefix="$art" -print_final_stats=1 \
    "$work" "$dir/fuzz/seeds/$target" "fuzz/corpus/$target" || {
    echo "fuzz.sh: fuzz_$target failed; reproducer in $art" >&2
    exit 1
  }
done
echo "fuzz.sh: no crashes"
