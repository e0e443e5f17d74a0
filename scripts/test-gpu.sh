#!/usr/bin/env bash
# test-gpu.sh - builds tdist with CUDA and runs everything about the GPU on a machine with an
# NVIDIA GPU, then prints a summary to paste into a note:
#   - every gpu-labelled test (ctest -L gpu): CUDA ops and NN ops against the CPU, numerics (large
#     logits, long float32 sums, NaN/inf, float->int64, overlapping copies, more than 2^31 and
#     2^32 rows), two devices, GPU ops from several threads, the caching allocator, determinism
#     notes for atomics, NCCL collectives (float32/float64/int64, NaN MAX, mismatched calls, a
#     member dying, two members on one GPU, subgroups, RPC traffic during collectives), CUDA
#     tensors over RPC (device maps, 512 MiB tensors);
#   - the CUDA tests that also run without a GPU (device counting, allocator bookkeeping, the
#     numerics on the CPU, NCCL setup failures);
#   - train_local, param_server and hybrid with --device cuda:0 (short runs);
#   - the GPT on the GPU: test_cuda_gpt (every kernel the GPT uses, bfloat16 / float16, flash
#     attention, multi-tensor AdamW, a small GPT trained on both devices) and
#     test_example_gpt_cuda (gpt --device cuda:0 against the CPU over 200 steps in float32 and
#     bfloat16, ZeRO-3 of one rank, a short benchmark run) are gpu-labelled tests above;
#   - bench/gpt_gpu at GPT-2 124M shapes in bfloat16, batch 16 and 32 (tokens/s, step time, peak
#     device memory, MFU) and a --phases run (forward / backward / clipping / AdamW split).
# Order: the benchmark first, alone on the device; then the tests (the GPT's first) while the
# three examples run beside them.
#
# usage: scripts/test-gpu.sh      (build dir ${TD_BUILD_DIR:-build-gpu}; the full output of every
#                                  test and example goes to <build dir>/test-gpu.log)
#        TD_PREBUILT=1 scripts/test-gpu.sh   uses the build dir as it is: no package install, no
#                                  build (for a GPU machine without the -dev packages or a network,
#                                  given a CUDA build made elsewhere and its libraries on
#                                  LD_LIBRARY_PATH)
#        TD_CTEST_ARGS="-j4"             extra ctest arguments (e.g. to run the gpu tests at once)
#        TD_GPU_OUT=DIR                  copies the log and the JSON lines to DIR as they come
#        TD_GPU_BENCH_TIMEOUT=S          each benchmark run's limit (300 s)
# Exit status 0 when everything passed. Unlike scripts/test.sh, a gpu test program that skips as a
# whole counts as a failure here: on a machine with a GPU that means something is wrong. (Parts
# that need a second GPU skip with a message inside a passing program; the summary lists them.)
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${TD_BUILD_DIR:-build-gpu}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "test-gpu.sh: no NVIDIA GPU found (nvidia-smi -L lists none); nothing to test" >&2
  exit 2
fi
ngpu=$(nvidia-smi -L | grep -c '^GPU ')

if [ "${TD_PREBUILT:-0}" != 1 ]; then
  scripts/install-deps.sh || exit 1
  TD_BUILD_DIR="$dir" TD_WITH_CUDA=ON TD_CMAKE_ARGS="${TD_CMAKE_ARGS:-}" scripts/build.sh || exit 1
elif [ ! -f "$dir/CTestTestfile.cmake" ]; then
  echo "test-gpu.sh: TD_PREBUILT=1 but $dir holds no build" >&2
  exit 1
fi
log="$dir/test-gpu.log"
: >"$log"
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

# out_sync: copies the log and the JSON lines to $TD_GPU_OUT (when set) as they come, so a run cut
# short by a time limit still leaves what it did.
out_sync() {
  [ -n "${TD_GPU_OUT:-}" ] || return 0
  mkdir -p "$TD_GPU_OUT" && cp -f "$log"* "$dir"/*.json "$dir"/*.out "$TD_GPU_OUT"/ 2>/dev/null
  return 0
}

# run_bench TAG ARGS...: bench/gpt_gpu; its JSON line goes to $dir/gpt_gpu_TAG.json.
run_bench() {
  local tag=$1
  shift
  echo "== gpt_gpu $* =="
  echo "== bench: gpt_gpu_$tag $*" >>"$log"
  timeout "${TD_GPU_BENCH_TIMEOUT:-300}" "$dir/bench/gpt_gpu" "$@" >"$dir/gpt_gpu_$tag.out" 2>>"$log"
  local rc=$?
  cat "$dir/gpt_gpu_$tag.out" >>"$log"
  tail -n 1 "$dir/gpt_gpu_$tag.out" >"$dir/gpt_gpu_$tag.json"
  echo "== bench: gpt_gpu_$tag exit $rc" >>"$log"
  tail -n 1 "$dir/gpt_gpu_$tag.out"
  out_sync
}
# The benchmark first, alone on the device (the tests below share it).
run_bench b16 --device cuda:0 --dtype bf16 --batch-size 16 --warmup 3 --steps 10
run_bench b32 --device cuda:0 --dtype bf16 --batch-size 32 --warmup 3 --steps 10
# where a step's time goes (forward, backward, clipping, AdamW; waits between them)
run_bench phases --device cuda:0 --dtype bf16 --batch-size 16 --warmup 2 --steps 3 --phases

# run_example NAME ARGS...: a short run; its JSON result line goes to $dir/NAME.json.
run_example() {
  local name=$1
  shift
  echo "== $name $* =="
  timeout 900 "$dir/examples/$name" "$@" >"$dir/$name.out" 2>"$dir/$name.err"
  local rc=$?
  { echo "== example: $name $*"; cat "$dir/$name.err" "$dir/$name.out";
    echo "== example: $name exit $rc"; } >>"$log"
  tail -n 1 "$dir/$name.out" >"$dir/$name.json"
  out_sync
}
trainers=$((ngpu < 2 ? 1 : 2))
# The examples run beside the tests (they use little of the device).
(
  run_example train_local --device cuda:0 --epochs 1 --max-batches 300
  run_example param_server --device cuda:0 --epochs 1 --max-batches 100 --nproc 3
  run_example hybrid --device cuda:0 --epochs 1 --max-batches 100 --nproc $((trainers + 1))
) &
examples=$!
(while sleep 20; do out_sync; done) &
syncer=$!

echo "== gpu tests (ctest -L gpu) =="
# test_cuda_gpt and test_example_gpt_cuda first: the newest kernels.
ctest --test-dir "$dir" -V ${TD_CTEST_ARGS:-} -R '^(test_cuda_gpt|test_example_gpt_cuda)$' \
  >"$log.gpt" 2>&1
ctest --test-dir "$dir" -L gpu -V ${TD_CTEST_ARGS:-} -E '^(test_cuda_gpt|test_example_gpt_cuda)$' \
  >"$log.rest" 2>&1
echo "== CUDA tests that run without a GPU as well =="
ctest --test-dir "$dir" -V ${TD_CTEST_ARGS:-} \
  -R '^(test_cuda_devices|test_cuda_host|test_numerics|test_collectives_nccl_setup)$' \
  >"$log.cpu" 2>&1
wait "$examples"
kill "$syncer" 2>/dev/null
cat "$log.gpt" "$log.rest" "$log.cpu" >>"$log"
out_sync

nccl_h=$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include/nccl.h
python3 - "$log" "$dir" "$nccl_h" <<'EOF'
import json, os, re, subprocess, sys

log, build, nccl_h = sys.argv[1:4]
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""

names, results, lines = {}, {}, {}
example_rc = {}
for raw in open(log, errors="replace"):
    line = raw.rstrip("\n")
    m = re.match(r"\s*Start\s+(\d+): (\S+)", line)
    if m:
        names[m.group(1)] = m.group(2)
    m = re.match(r"\s*\d+/\d+ Test\s+#(\d+): (\S+) \.+\s*(?:\*+)?(\w[\w ]*?)\s+([\d.]+) sec", line)
    if m:
        names[m.group(1)] = m.group(2)
        results[m.group(2)] = (m.group(3).strip(), m.group(4))
    m = re.match(r"(\d+): (.*)", line)
    if m:
        lines.setdefault(m.group(1), []).append(m.group(2))
    m = re.match(r"== example: (\S+) exit (\d+)", line)
    if m:
        example_rc[m.group(1)] = int(m.group(2))

nccl = ".".join(re.findall(r"#define NCCL_(?:MAJOR|MINOR|PATCH) (\d+)",
                           open(nccl_h).read())) if os.path.exists(nccl_h) else "?"
print()
print("==== tdist GPU test summary (paste into a note) ====")
print("commit:  " + (sh("git rev-parse --short HEAD") or "?") +
      (" (with local changes)" if sh("git status --porcelain --untracked-files=no") else ""))
print("date:    " + sh("date -u +%Y-%m-%dT%H:%MZ") + "   host: " + sh("hostname"))
for g in sh("nvidia-smi --query-gpu=index,name,memory.total,driver_version "
            "--format=csv,noheader").splitlines():
    print("gpu:     " + g)
print("driver CUDA version: " + (re.search(r"CUDA Version: ([\d.]+)", sh("nvidia-smi")) or
                                 [None, "?"])[1] +
      "   nvcc: " + (sh("nvcc --version | tail -n 1") or "?") + "   NCCL (headers): " + nccl)
print()
failed = skipped_whole = 0
print("tests:")
for num in sorted(names, key=int):
    name = names[num]
    status, secs = results.get(name, ("Not run", "0"))
    word = {"Passed": "PASS", "Skipped": "SKIP", "Failed": "FAIL"}.get(status, status.upper())
    if word not in ("PASS", "SKIP"):
        failed += 1
    whole_skip_ok = name == "test_collectives_nccl_setup"  # needs a machine without a GPU
    if word == "SKIP" and not whole_skip_ok:
        skipped_whole += 1
    print(f"  {word:5} {name:32} {float(secs):8.1f} s")
    for l in lines.get(num, []):
        if re.search(r"skipped|determinism note|failed after|ERROR|check failed", l):
            print("        " + l.strip()[:160])
print()
print("examples (--device cuda:0):")
for ex in ("train_local", "param_server", "hybrid"):
    rc = example_rc.get(ex, -1)
    res = {}
    try:
        j = json.loads(open(os.path.join(build, ex + ".json")).read())
        res = j.get("results", j)
    except (OSError, ValueError):
        pass
    acc, sps = res.get("test_accuracy"), res.get("samples_per_s")
    print(f"  {'PASS' if rc == 0 else 'FAIL':5} {ex:14} exit {rc}"
          + (f"  test_accuracy {acc:.4f}" if isinstance(acc, (int, float)) else "")
          + (f"  samples/s {sps:.0f}" if isinstance(sps, (int, float)) else "")
          + (f"  wall {res['wall_s']:.1f} s" if isinstance(res.get("wall_s"), (int, float)) else ""))
    if rc != 0:
        failed += 1
print()
print("bench/gpt_gpu (GPT-2 124M shapes, bfloat16, no activation checkpointing):")
for raw in open(log, errors="replace"):
    m = re.match(r"== bench: (\S+) exit (\d+)", raw.strip())
    if m:
        example_rc[m.group(1)] = int(m.group(2))
for tag in ("b16", "b32"):
    name = "gpt_gpu_" + tag
    rc = example_rc.get(name, -1)
    res, cfg = {}, {}
    try:
        j = json.loads(open(os.path.join(build, name + ".json")).read())
        res, cfg = j.get("results", {}), j.get("config", {})
    except (OSError, ValueError):
        pass
    def f(k, fmt):
        v = res.get(k)
        return format(v, fmt) if isinstance(v, (int, float)) else "null"
    print(f"  {'PASS' if rc == 0 else 'FAIL':5} batch {cfg.get('batch_size', '?')}: "
          f"tokens/s {f('tokens_per_s', '.0f')}  step {f('step_s', '.4f')} s  "
          f"peak {f('peak_device_mb', '.0f')} MiB  MFU {f('mfu', '.3f')} "
          f"(peak {f('peak_tflops', '.0f')} TFLOP/s, {res.get('device_name', '?')})  "
          f"loss {f('first_loss', '.3f')} -> {f('last_loss', '.3f')}")
    if rc != 0:
        failed += 1
try:
    j = json.loads(open(os.path.join(build, "gpt_gpu_phases.json")).read())
    print("  phases (batch 16, ms per step):", json.dumps(j["results"].get("phase_ms")))
except (OSError, ValueError, KeyError):
    print("  phases: no result")
print()
ok = failed == 0 and skipped_whole == 0
print(f"result: {'ALL PASSED' if ok else 'FAILED'} ({failed} failed, {skipped_whole} gpu "
      f"programs skipped as a whole although a GPU is present); full log: {log}")
sys.exit(0 if ok else 1)
EOF
