#!/usr/bin/env bash
# test_bench_gpt_gpu.sh GPT_GPU - bench/gpt_gpu's code path on the CPU (its GPU run is in
# test_example_gpt_cuda): a tiny GPT for 1 + 4 steps in float32 and bfloat16 prints its JSON line
# with every documented key, null device memory and MFU on a CPU, a falling loss, the model's
# parameter count, and flops per token by nanoGPT's formula (6 N + 12 L H Q T, N without the
# position embeddings).
set -euo pipefail
bench="$1"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for dt in f32 bf16; do
  timeout $((120 * ${TD_TEST_TIMEOUT_SCALE:-1})) "$bench" --device cpu --dtype "$dt" \
    --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --vocab 64 --batch-size 4 --warmup 1 \
    --steps 4 >"$tmp/$dt.out" 2>"$tmp/$dt.err" || { cat "$tmp/$dt.err"; echo "FAIL: $dt run"; exit 1; }
  python3 - "$tmp/$dt.out" "$dt" <<'PY'
import json, sys
j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
r, c = j["results"], j["config"]
assert j["bench"] == "gpt_gpu" and c["dtype"] == sys.argv[2], j
for k in ("tokens_per_s", "step_s", "peak_device_mb", "mfu", "flops_per_token", "peak_tflops",
          "first_loss", "last_loss", "device_name"):
    assert k in r, f"missing results.{k}"
assert r["tokens_per_s"] > 0 and r["step_s"] > 0, r
assert r["peak_device_mb"] is None and r["mfu"] is None and r["peak_tflops"] is None, r
assert r["last_loss"] < r["first_loss"], r
# 2 layers of width 32 (12 C^2 + 13 C per block), tied 64 x 32 embedding, 16 x 32 positions,
# final LayerNorm: 28032 parameters; N = 28032 - 512
C, L, V, T, H = 32, 2, 64, 16, 2
params = L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
assert c["params"] == params, (c["params"], params)
assert r["flops_per_token"] == 6 * (params - T * C) + 12 * L * H * (C // H) * T, r
print(sys.argv[2], "ok:", r["tokens_per_s"], "tokens/s, loss", r["first_loss"], "->", r["last_loss"])
PY
done
echo PASS
