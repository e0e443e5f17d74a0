#!/usr/bin/env bash
# test_example_gpt_dp.sh GPT - the GPT example data parallel, 2 forked replicas on 127.0.0.1:
#   1. --dp ddp, zero1, zero2 and zero3 train a small float64 GPT for 30 steps to the same validation
#      loss as printed (6 significant digits; the three differ only in the summation order of
#      the reductions), which differs from one process's (so rank 1's batches took part);
#   2. DDP started at least half of the gradient bytes' all_reduces during backward;
#   3. ZeRO's shards cover the parameters (2 x shard >= numel) and every rank reports its RSS;
#   4. zero2 (reduce_scatter from gradient hooks, 1 KiB buckets) started at least half of its
#      bytes during backward and ends where zero2 --zero-after-backward does;
#   5. zero3 (the blocks as units) gathered the blocks with prefetch: per step 2 gathers per
#      block (forward, backward) plus the evaluations', at least half of them prefetched,
#      and never held more than one block's parameters at once;
#   6. memory (a 1.6M-parameter float64 model): every layout's tensor-memory peak in training is
#      within 15% of its model-state formula plus the activations and buffers it measured.
# Skips (exit 77) without Debian's fortunes corpus. Bounded by `timeout`.
set -euo pipefail
gpt="$1"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((120 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
small=(--corpus "$corpus" --dtype f64 --n-layer 2 --n-head 2 --n-embd 32 --block-size 16
       --batch-size 4 --steps 30 --warmup 5 --eval-interval 30 --eval-iters 2)
for dp in ddp zero1 zero2 zero3; do
  extra=()
  [[ $dp == zero2 ]] && extra=(--bucket-mb 0.001)
  timeout "$limit" "$gpt" "${small[@]}" --nproc 2 --dp "$dp" "${extra[@]}" 2>"$tmp/$dp.err" \
    >"$tmp/$dp.out" || { cat "$tmp/$dp.err"; echo "FAIL: --dp $dp"; exit 1; }
done
timeout "$limit" "$gpt" "${small[@]}" --nproc 2 --dp zero2 --zero-after-backward \
  2>"$tmp/zero2a.err" >"$tmp/zero2a.out" || { cat "$tmp/zero2a.err"; echo "FAIL: zero2a"; exit 1; }
timeout "$limit" "$gpt" "${small[@]}" 2>/dev/null >"$tmp/one.out"
# memory: a model big enough that page rounding does not count (1.6M parameters, float64)
mem=(--corpus "$corpus" --dtype f64 --n-layer 2 --n-head 4 --n-embd 256 --block-size 16
     --batch-size 4 --steps 2 --eval-interval 100 --eval-iters 1 --nproc 2)
for dp in ddp zero1 zero2 zero3; do
  timeout "$limit" "$gpt" "${mem[@]}" --dp "$dp" 2>"$tmp/mem_$dp.err" >"$tmp/mem_$dp.out" ||
    { cat "$tmp/mem_$dp.err"; echo "FAIL: memory run --dp $dp"; exit 1; }
done
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def res(name):
    lines = [l for l in open(f"{tmp}/{name}.out") if l.startswith("{")]
    assert len(lines) == 1, f"{name}: one JSON line (rank 0's), got {len(lines)}"
    return json.loads(lines[0])
r = {k: res(k) for k in ("ddp", "zero1", "zero2", "zero2a", "zero3", "one")}
v = {k: r[k]["results"]["val_loss"] for k in r}
print("val_loss:", v)
for k in ("zero1", "zero2", "zero2a", "zero3"):
    assert abs(v[k] - v["ddp"]) <= 1e-9 * abs(v["ddp"]), f"{k} ends at {v[k]}, ddp at {v['ddp']}"
assert abs(v["one"] - v["ddp"]) > 1e-6, "one process ends where two do: rank 1's data unused?"
share = r["ddp"]["results"]["ddp_bytes_started_in_backward_share"]
assert share >= 0.5, f"DDP started only {share:.2f} of its bytes during backward"
for k in ("zero1", "zero2", "zero3"):
    z = r[k]["results"]
    assert z["zero_stage"] == int(k[-1]) and 2 * z["zero_shard_numel"] >= z["zero_numel"]
for k in ("ddp", "zero1", "zero2"):
    assert r[k]["config"]["nproc"] == 2 and len(r[k]["results"]["peak_rss_mb_per_rank"]) == 2
zs = r["zero2"]["results"]
assert zs["zero_buckets"] > 1, "zero2 with 1 KiB buckets has one bucket"
assert zs["zero_bytes_started_in_backward_share"] >= 0.5, zs
assert r["zero2a"]["results"]["zero_buckets"] == 1
z3 = r["zero3"]["results"]
blocks = r["zero3"]["config"]["n_layer"]
assert z3["zero_units"] == blocks, z3
# 30 steps x 2 per block, 2 evaluations x 2 batches x 2 splits x 1 per block (the final
# gather for saving comes after the figures)
want = blocks * (30 * 2 + 2 * 2 * 2)
assert z3["zero_unit_gathers"] == want, (z3["zero_unit_gathers"], want)
assert z3["zero_unit_gathers_prefetched"] * 2 >= want, z3
one_block = 4 * r["zero3"]["config"]["n_embd"] ** 2 * 3 * 8  # about 12 n_embd^2 doubles
assert 0 < z3["zero_peak_unit_mb"] * 1048576 < 1.5 * one_block, z3
# 6. the tensor-memory peak in training is the model-state formula plus the activations and
#    buffers measured (within 15%)
for k in ("ddp", "zero1", "zero2", "zero3"):
    m = res(f"mem_{k}")["results"]
    print(f"{k}: tensor peak {max(m['train_tensor_peak_mb_per_rank']):.1f} MB, formula "
          f"{m['model_state_formula_mb']:.1f}, expected {m['expected_tensor_peak_mb']:.1f}")
    assert 0.9 <= m["tensor_peak_over_expected"] <= 1.15, (k, m)
print(f"ddp, zero1, zero2 (overlapped and not) agree; DDP share started in backward {share:.2f}, "
      f"ZeRO-2 {zs['zero_bytes_started_in_backward_share']:.2f} over {zs['zero_buckets']} buckets")
PY
