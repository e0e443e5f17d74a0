#!/usr/bin/env bash
# test_example_gpt_cuda.sh GPT GPT_GPU - the GPT example on cuda:0 against the CPU, on the fortunes
# corpus with a small model (2 layers, width 128, 2 heads of 64, context 64, batch 8):
#   1. float32, 200 steps: every step's loss (--metrics) within 1e-4 (relative) of the CPU run's,
#      the same batch hash, and the final validation loss within 1e-4;
#   2. bfloat16 autocast, 200 steps: every step's loss within 2% of the CPU's bfloat16 run;
#   3. --nproc 1 --dp zero3 --device cuda:0 (a ZeRO-3 group of one, NCCL): 20 steps, losses within
#      1e-4 of the plain float32 run's first 20 (ZeRO's AdamW is the same update);
#   4. the benchmark program (bench/gpt_gpu) for 2 + 3 steps at GPT-2 124M shapes, batch 4: runs,
#      prints tokens_per_s, mfu (null for a device missing from its table) and a falling loss.
# Skips (exit 77) without an NVIDIA GPU (nvidia-smi -L lists none) or without the corpus.
set -euo pipefail
gpt="$1"
bench="$2"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "SKIP: no NVIDIA GPU (nvidia-smi -L lists none)"
  exit 77
fi
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((600 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
small=(--corpus "$corpus" --n-layer 2 --n-head 2 --n-embd 128 --block-size 64 --batch-size 8
       --eval-interval 100 --eval-iters 4 --threads 4)
run() {
  local name="$1"
  shift
  echo "== $name: $*"
  # a failed run is reported and the others still run (the comparisons below name what is missing)
  if ! timeout "$limit" "$@" 2>"$tmp/$name.err" >"$tmp/$name.out"; then
    tail -n 30 "$tmp/$name.err"
    echo "FAIL: $name"
    return 1
  fi
  tail -n 1 "$tmp/$name.out" >"$tmp/$name.json"
}
# The two CPU references run beside the GPU runs (each waits for nothing but its own process).
(run cpu_f32 "$gpt" "${small[@]}" --steps 200 --metrics "$tmp/cpu_f32.jsonl") &
cpu_f32=$!
(run cpu_bf16 "$gpt" "${small[@]}" --steps 200 --dtype bf16 --metrics "$tmp/cpu_bf16.jsonl") &
cpu_bf16=$!
runs_ok=1
run gpu_f32 "$gpt" "${small[@]}" --steps 200 --device cuda:0 --metrics "$tmp/gpu_f32.jsonl" || runs_ok=0
run gpu_bf16 "$gpt" "${small[@]}" --steps 200 --dtype bf16 --device cuda:0 \
  --metrics "$tmp/gpu_bf16.jsonl" || runs_ok=0
run gpu_zero3 "$gpt" "${small[@]}" --steps 20 --nproc 1 --dp zero3 --device cuda:0 \
  --metrics "$tmp/gpu_zero3.jsonl" || runs_ok=0
run bench "$bench" --device cuda:0 --batch-size 4 --warmup 2 --steps 3 || runs_ok=0
wait "$cpu_f32" || runs_ok=0
wait "$cpu_bf16" || runs_ok=0
status=0
python3 - "$tmp" <<'PY' || status=1
import json, math, sys
tmp = sys.argv[1]
def losses(name):
    out = {}
    for line in open(f"{tmp}/{name}.jsonl"):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "step" and "loss" in r:
            out[r["step"]] = r["loss"]
    return [out[k] for k in sorted(out)]
def result(name):
    return json.loads(open(f"{tmp}/{name}.json").read())
bad = []
def agree(a, b, tol, what, n=None):
    try:
        la, lb = losses(a), losses(b)
    except OSError as e:
        bad.append(f"{what}: {e}"); return
    if n: la, lb = la[:n], lb[:n]
    if len(la) != len(lb) or not la:
        bad.append(f"{what}: {len(la)} and {len(lb)} steps"); return
    worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    print(f"{what}: {len(la)} steps, worst relative difference {worst:.3g} (limit {tol})")
    if not worst <= tol:
        bad.append(f"{what}: worst relative loss difference {worst:.3g} > {tol}")
agree("gpu_f32", "cpu_f32", 1e-4, "float32 cuda:0 vs CPU")
agree("gpu_bf16", "cpu_bf16", 2e-2, "bfloat16 cuda:0 vs CPU")
agree("gpu_zero3", "gpu_f32", 1e-4, "zero3 (one rank) cuda:0 vs plain cuda:0", n=20)
try:
    c, g = result("cpu_f32")["results"], result("gpu_f32")["results"]
except (OSError, ValueError, KeyError) as e:
    c = g = None
    bad.append(f"float32 results: {e}")
if c and c["batch_hash"] != g["batch_hash"]:
    bad.append("the CUDA run saw other batches than the CPU run")
if c and not abs(c["val_loss"] - g["val_loss"]) <= 1e-4 * abs(c["val_loss"]):
    bad.append(f"val_loss {g['val_loss']} on cuda:0, {c['val_loss']} on the CPU")
if c:
    print(f"float32 val_loss: CPU {c['val_loss']:.6f}, cuda:0 {g['val_loss']:.6f}; "
          f"device_peak_mb {g.get('device_peak_mb')}")
try:
    b = result("bench")["results"]
except (OSError, ValueError, KeyError) as e:
    b = {"first_loss": 0, "last_loss": 0}
    bad.append(f"bench: {e}")
print("bench (batch 4):", json.dumps(b))
if not (b.get("tokens_per_s") or 0) > 0 or not b["last_loss"] < b["first_loss"]:
    bad.append(f"bench: tokens_per_s {b.get('tokens_per_s')}, loss {b.get('first_loss')} -> "
               f"{b.get('last_loss')}")
if bad:
    print("FAIL:\n  " + "\n  ".join(bad))
    sys.exit(1)
print("PASS")
PY
[ "$runs_ok" = 1 ] || { echo "FAIL: a run above failed"; exit 1; }
exit "$status"
