#!/usr/bin/env bash
# gpu-quick-run.sh - copied by `scripts/gpu-bundle.sh --quick BUILD_DIR DIR` to DIR/quick.sh: on a
# GPU machine, from the checkout's root, `bash DIR/quick.sh` unpacks DIR/libs.tar.xz and the
# DIR/*.xz programs to /tmp/td-quick, runs the test programs among them at once (each one's output
# in test_NAME.txt), then bench/gpt_gpu at GPT-2 124M shapes, batch 16, and its --phases split
# (b16.json, phases.json); TD_NCU=1 adds Nsight Compute's per-kernel times of a one-layer step
# (ncu.csv). Files go to $OUT when set (the device tool's folder), else to /tmp/td-quick/out.
# Prints a line per test program, the benchmark's figures and the phases.
set -u
dir=$(cd "$(dirname "$0")" && pwd)
root=$(pwd)
t=/tmp/td-quick
out=${OUT:-$t/out}
mkdir -p "$t" "$out"
tar -xJf "$dir/libs.tar.xz" -C "$t"
progs=()
for f in "$dir"/*.xz; do
  name=$(basename "$f" .xz)
  [ "$name" = libs.tar ] && continue
  xz -dc "$f" >"$t/$name" && chmod +x "$t/$name" && progs+=("$name")
done
libs="$t/gpu-bundle/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TD_GPT_CORPUS="$t/gpu-bundle/fortunes" TD_SOURCE_DIR="$root" OPENBLAS_NUM_THREADS=1
for p in "${progs[@]}"; do
  case "$p" in
    test_*) (cd "$t" && timeout 300 "./$p" >"$out/$p.txt" 2>&1; echo "exit $?" >>"$out/$p.txt") & ;;
  esac
done
wait
for p in "${progs[@]}"; do
  case "$p" in
    test_*) echo "$p: $(grep -c '^\[       OK' "$out/$p.txt") passed, $(grep -c '^\[  FAILED  \] [a-z]' "$out/$p.txt") failed, $(grep -c 'skipped' "$out/$p.txt") skipped notes, $(tail -n 1 "$out/$p.txt")"
      grep -B8 '^\[  FAILED  \] [a-z]\|^\[  ERROR' "$out/$p.txt" | head -40 ;;
  esac
done
if [ -x "$t/gpt_gpu" ]; then
  "$t/gpt_gpu" --batch-size 16 --warmup 2 --steps 5 >"$out/b16.json" 2>"$out/b16.err"
  echo "gpt_gpu batch 16 (exit $?): $(grep -o '"tokens_per_s[^,]*, "step_s[^,]*' "$out/b16.json") $(grep -o '"mfu[^,]*' "$out/b16.json")"
  "$t/gpt_gpu" --batch-size 16 --warmup 2 --steps 3 --phases >"$out/phases.json" 2>/dev/null
  echo "phases: $(grep -o '"phase_ms[^}]*}' "$out/phases.json")"
  if [ "${TD_NCU:-0}" = 1 ]; then
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    timeout 120 "$ncu" --metrics gpu__time_duration.sum --csv "$t/gpt_gpu" --n-layer 1 \
      --batch-size 16 --warmup 0 --steps 1 >"$out/ncu.csv" 2>"$out/ncu.err"
    echo "ncu exit $?: $(grep -c gpu__time_duration "$out/ncu.csv") kernels timed (ncu.csv)"
  fi
fi
