#!/usr/bin/env bash
# test_example_gpt_ckpt.sh GPT - activation checkpointing in the GPT example
# (--activation-checkpointing none|full|selective), a small model (4 blocks, width 64, context
# 64, batch 4, 3 steps), so each run takes a fraction of a second:
#   1. one process, float32 and float64: the three modes train the same bits (results.losses_hash
#      hashes every step's loss); bfloat16 autocast too (the recompute runs in the forward's
#      autocast scope);
#   2. memory (the CPU allocator's count, measured by the example's probes): with full
#      checkpointing the activation peak of a forward + backward is within 15% of the formula,
#      the blocks' stored inputs plus the larger of one block's peak and the head's peak (a
#      checkpointing that kept the blocks' activations would be ~3x over it); a forward keeps
#      less with full than with selective, and selective keeps the attention probabilities
#      (n_layer x B x H x T x T elements) less than none, within 15%;
#   3. two processes, DDP and ZeRO-3 with full checkpointing: the same bits as without.
# Skips (exit 77) without Debian's fortunes corpus. Bounded by `timeout`.
set -euo pipefail
gpt="$1"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((60 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
small=(--corpus "$corpus" --n-layer 4 --n-head 4 --n-embd 64 --block-size 64 --batch-size 4
       --steps 3 --eval-interval 100 --eval-iters 1)
run() {
  local name="$1"
  shift
  timeout "$limit" "$gpt" "${small[@]}" "$@" 2>"$tmp/$name.err" >"$tmp/$name.out" ||
    { tail -n 30 "$tmp/$name.err"; echo "FAIL: $name"; exit 1; }
}
for dt in f32 f64; do
  for mode in none full selective; do
    run "$dt-$mode" --dtype "$dt" --activation-checkpointing "$mode"
  done
done
for mode in none full selective; do
  run "bf16-$mode" --dtype bf16 --activation-checkpointing "$mode"
done
for dp in ddp zero3; do
  for mode in none full; do
    run "$dp-$mode" --dtype f64 --nproc 2 --dp "$dp" --activation-checkpointing "$mode"
  done
done
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
def res(name):
    lines = [l for l in open(f"{tmp}/{name}.out") if l.startswith("{")]
    assert len(lines) == 1, f"{name}: one JSON line (rank 0's), got {len(lines)}"
    return json.loads(lines[0])
for dt, e in (("f32", 4), ("f64", 8)):
    r = {m: res(f"{dt}-{m}") for m in ("none", "full", "selective")}
    h = {m: r[m]["results"]["losses_hash"] for m in r}
    assert h["full"] == h["none"] == h["selective"], (dt, h)
    f = r["full"]["results"]
    print(f"{dt} full: activation peak {f['activation_peak_mb']:.3f} MB, formula "
          f"{f['activation_formula_mb']:.3f} (stored inputs {f['stored_block_inputs_mb']:.3f} + "
          f"max(block {f['block_activation_peak_mb']:.3f}, head {f['head_activation_peak_mb']:.3f}))"
          f", ratio {f['activation_peak_over_formula']:.3f}; none's peak "
          f"{r['none']['results']['activation_peak_mb']:.3f}")
    assert 0.85 <= f["activation_peak_over_formula"] <= 1.15, f
    assert f["activation_peak_mb"] * 2 < r["none"]["results"]["activation_peak_mb"], r
    kept = {m: r[m]["results"]["activations_mb"] for m in r}
    assert kept["full"] < kept["selective"] < kept["none"], kept
    c = r["none"]["config"]
    probs = c["n_layer"] * c["batch_size"] * c["n_head"] * c["block_size"] ** 2 * e / 1048576
    dropped = kept["none"] - kept["selective"]
    print(f"{dt}: forward kept {kept}; selective dropped {dropped:.3f} MB, probabilities "
          f"{probs:.3f} MB")
    assert abs(dropped - probs) <= 0.15 * probs, (dropped, probs)
h = {m: res(f"bf16-{m}")["results"]["losses_hash"] for m in ("none", "full", "selective")}
assert h["full"] == h["none"] == h["selective"], ("bf16", h)
for dp in ("ddp", "zero3"):
    a, b = res(f"{dp}-none")["results"], res(f"{dp}-full")["results"]
    assert a["losses_hash"] == b["losses_hash"], (dp, a["losses_hash"], b["losses_hash"])
    assert max(b["activations_mb_per_rank"]) < max(a["activations_mb_per_rank"]) / 2, (a, b)
print("checkpointing: same bits in every layout; memory as the formula says")
PY
