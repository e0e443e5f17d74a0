#!/usr/bin/env bash
# test_example_gpt_3d.sh GPT_3D TDISTRUN - the GPT trained with data x pipeline x tensor
# parallelism (float64, 20 steps, each run's reporting rank also trains the whole model in one
# process on the same batches):
#   1. 2 x 2 x 2 = 8 forked processes, 1F1B with 4 micro-batches: the losses of all 20 steps equal
#      the one-process losses to 1e-9 (the issue asks 1e-5), and each stage held at most pp - s
#      micro-batches (1F1B's bound);
#   2. the same layout with GPipe: the same losses, and every stage held all 4;
#   3. pipeline 4 with 2 micro-batches (fewer than stages) under tdistrun: the same losses;
#   4. tensor-parallel 4 with pipeline 2 (8 processes, 8 micro-batches);
#   5. 2 x 2 x 2 with sequence parallelism: the same losses;
#   6. 2 x 2 x 2 for 10 steps saving its checkpoint, then resumed with dp 1 (4 processes) to step
#      20: the resumed steps' losses equal the uninterrupted one-process run's (the reference
#      replays the first 10 steps), and the final loss is the uninterrupted 3D run's;
#   7. 2 x 2 x 2 with --dtype bf16 (autocast; float32 weights): --check passes its bf16 tolerance
#      (the run exits 0) and the losses stay within 2% of the float64 run's.
#   8. 2 x 2 x 2 1F1B with activation checkpointing, every block (full) or every attention core
#      (selective): the same bits as 1F1B without it (results.losses_hash), and a micro-batch's
#      forward keeps less on every stage (full: at most half).
# Every run clips the gradient norm at 1.0 (the default) by the whole model's norm, as the
# one-process reference does.
# Skips (exit 77) without Debian's fortunes corpus. Bounded by `timeout`.
set -euo pipefail
gpt3d="$1"
tdistrun="$2"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((180 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
small=(--corpus "$corpus" --dtype f64 --n-layer 4 --n-head 4 --n-embd 32 --block-size 16
       --batch-size 16 --steps 20 --check)
run() {
  local name="$1"
  shift
  timeout "$limit" "$@" 2>"$tmp/$name.err" >"$tmp/$name.out" ||
    { tail -n 30 "$tmp/$name.err"; echo "FAIL: $name"; exit 1; }
}
run 1f1b "$gpt3d" "${small[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b
run gpipe "$gpt3d" "${small[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --schedule gpipe
run pp4 "$tdistrun" --standalone --nproc-per-node 4 "$gpt3d" "${small[@]}" --dp 1 --pp 4 \
  --tp 1 --micro-batches 2
run tp4 "$gpt3d" "${small[@]}" --dp 1 --pp 2 --tp 4 --micro-batches 8
run sp "$gpt3d" "${small[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --sequence-parallel
run ckfull "$gpt3d" "${small[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b \
  --activation-checkpointing full
run cksel "$gpt3d" "${small[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --schedule 1f1b \
  --activation-checkpointing selective
small10=("${small[@]}")
small10[${#small10[@]}-2]=10 # --steps 10
run save "$gpt3d" "${small10[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4 --save "$tmp/ck"
run resume "$gpt3d" "${small[@]}" --dp 1 --pp 2 --tp 2 --micro-batches 4 --resume "$tmp/ck"
bf16=("${small[@]}")
bf16[3]=bf16 # --dtype bf16
run bf16 "$gpt3d" "${bf16[@]}" --dp 2 --pp 2 --tp 2 --micro-batches 4
grep -q -- "--check passed" "$tmp/bf16.err" || { tail -n 5 "$tmp/bf16.err"; echo "FAIL: bf16 verdict"; exit 1; }
python3 - "$tmp" <<'PY'
import json, re, sys
tmp = sys.argv[1]
def res(name):
    # tdistrun prefixes each line with "[rank]: "
    lines = [re.sub(r"^\[\d+\]: ", "", l) for l in open(f"{tmp}/{name}.out")]
    lines = [l for l in lines if l.startswith("{")]
    assert len(lines) == 1, f"{name}: one JSON line (the reporting rank's), got {len(lines)}"
    return json.loads(lines[0])["results"]
r = {k: res(k) for k in ("1f1b", "gpipe", "pp4", "tp4", "sp", "ckfull", "cksel")}
b16 = res("bf16")
for a, b in zip(b16["losses"], r["1f1b"]["losses"]):
    assert abs(a - b) <= 0.02 * b, f"bf16 loss {a} vs float64 {b}: more than 2% apart"
print(f"bf16: losses {b16['losses'][0]:.5f} -> {b16['losses'][-1]:.5f}, "
      f"max |diff| vs one process {b16['max_abs_loss_diff_vs_one_process']:.3g}")
sv, rs = res("save"), res("resume")
assert len(sv["losses"]) == 10 and sv["first_step"] == 0, sv
assert rs["first_step"] == 10 and len(rs["losses"]) == 10, rs
assert rs["max_abs_loss_diff_vs_one_process"] <= 1e-9, rs
for a, b in zip(sv["losses"] + rs["losses"], r["1f1b"]["losses"]):
    assert abs(a - b) <= 1e-9, f"saved + resumed {a} vs uninterrupted {b}"
print(f"resume: steps 10..20 from a dp 2 checkpoint at dp 1, final {rs['final_loss']:.6f}")
for k, v in r.items():
    d = v["max_abs_loss_diff_vs_one_process"]
    assert len(v["losses"]) == 20, f"{k}: {len(v['losses'])} losses"
    assert d <= 1e-9, f"{k}: the losses differ from one process's by up to {d}"
    assert v["losses"][-1] < v["losses"][0], f"{k}: the loss did not fall: {v['losses']}"
    print(f"{k}: losses {v['losses'][0]:.5f} -> {v['losses'][-1]:.5f}, "
          f"max |diff| vs one process {d:.3g}, peaks {v['peak_live_microbatches_per_stage']}")
assert r["1f1b"]["peak_live_microbatches_per_stage"] == [2, 1], r["1f1b"]
assert r["gpipe"]["peak_live_microbatches_per_stage"] == [4, 4], r["gpipe"]
assert r["pp4"]["peak_live_microbatches_per_stage"] == [2, 2, 2, 1], r["pp4"]
assert r["tp4"]["peak_live_microbatches_per_stage"] == [2, 1], r["tp4"]
for k in ("gpipe", "pp4", "tp4", "sp"):
    for a, b in zip(r[k]["losses"], r["1f1b"]["losses"]):
        assert abs(a - b) <= 1e-9, f"{k} differs from 1f1b: {a} vs {b}"
base = r["1f1b"]
for k, most in (("ckfull", 0.5), ("cksel", 1.0)):
    assert r[k]["losses_hash"] == base["losses_hash"], (k, r[k]["losses_hash"], base["losses_hash"])
    kept, was = r[k]["forward_kept_mb_per_stage"], base["forward_kept_mb_per_stage"]
    print(f"{k}: the same bits as 1f1b; a micro-batch's forward keeps {kept} MB per stage "
          f"(without checkpointing {was})")
    assert all(a < most * b for a, b in zip(kept, was)), (k, kept, was)
PY
