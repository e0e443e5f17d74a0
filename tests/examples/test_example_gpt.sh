#!/usr/bin/env bash
# test_example_gpt.sh GPT - the character-level GPT example end to end, in one process:
#   1. --help lists each option's default (from the parser's table);
#   2. weights saved with --steps 0 --save and loaded with --init (under another seed) are saved
#      again byte for byte, and differ from that other seed's own initial weights;
#   3. 150 training steps (batch 16) must bring the validation loss below 3.0 nats: the uniform
#      guess is ln(vocab) = 4.57 and the best context-free (unigram) model of this corpus scores
#      3.36 on the validation split, so only a model that learned from context passes;
#      the --metrics file holds a record per step and per evaluation;
#   4. --load CHECKPOINT --generate 120 prints the prompt and 120 characters of the vocabulary,
#      the same text as results.sample;
#   5. the same 150 steps with --dtype bf16 and --dtype f16 (autocast, float32 weights): every
#      evaluation within 2% of the float32 run's, and the bf16 run's checkpoint holds float32
#      tensors.
# Skips (exit 77) when the corpus is missing (Debian's fortunes package,
# scripts/install-deps.sh). Bounded by `timeout` (TD_TEST_TIMEOUT_SCALE scales it).
set -euo pipefail
gpt="$1"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((240 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
run() { timeout "$limit" "$gpt" --corpus "$corpus" "$@"; }

"$gpt" --help >"$tmp/help"
grep -q -- "--steps N .*(default: 2000)" "$tmp/help" || fail "--help does not show --steps' default"
grep -q -- "--top-k N .*(default: 0)" "$tmp/help" || fail "--help does not show --top-k's default"

run --steps 0 --eval-iters 1 --seed 7 --save "$tmp/w7.safetensors" >/dev/null 2>&1
run --steps 0 --eval-iters 1 --seed 1337 --init "$tmp/w7.safetensors" \
    --save "$tmp/w7again.safetensors" >/dev/null 2>&1
run --steps 0 --eval-iters 1 --seed 1337 --save "$tmp/w1337.safetensors" >/dev/null 2>&1
cmp -s "$tmp/w7.safetensors" "$tmp/w7again.safetensors" ||
  fail "weights loaded with --init were not saved back unchanged"
! cmp -s "$tmp/w7.safetensors" "$tmp/w1337.safetensors" || fail "--seed does not change the init"
echo "checkpoint round trip: identical files"

run --steps 150 --batch-size 16 --eval-interval 50 --eval-iters 4 \
    --save "$tmp/ckpt.safetensors" --metrics "$tmp/m.jsonl" >"$tmp/train.out"
# the metrics file: a record per step (finite loss, tokens/s, phases) and one per evaluation
python3 - "$tmp/m.jsonl" <<'PY' || fail "metrics file"
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in recs if r["kind"] == "step"]
evals = [r for r in recs if r["kind"] == "eval"]
assert [r["step"] for r in steps] == list(range(150)), "one step record per step"
assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and "backward_s" in r["phases"]
           for r in steps)
assert [r["step"] for r in evals] == [0, 50, 100, 150] and all("val_loss" in r for r in evals)
print("metrics: 150 steps, 4 evaluations")
PY
run --load "$tmp/ckpt.safetensors" --generate 120 --prompt "The " --top-k 20 >"$tmp/gen.out"
run --steps 150 --batch-size 16 --eval-interval 50 --eval-iters 4 --dtype bf16 \
    --save "$tmp/bf16.safetensors" >"$tmp/bf16.out" 2>/dev/null
run --steps 150 --batch-size 16 --eval-interval 50 --eval-iters 4 --dtype f16 >"$tmp/f16.out" \
    2>/dev/null

python3 - "$tmp" <<'PY'
import json, math, sys
tmp = sys.argv[1]
def last_json(name):
    lines = [l for l in open(f"{tmp}/{name}", encoding="utf-8") if l.startswith("{")]
    if not lines:
        sys.exit(f"FAIL: {name}: no JSON line")
    return json.loads(lines[-1])
r = last_json("train.out")
res, cfg = r["results"], r["config"]
v, u = res["val_loss"], res["uniform_loss"]
print(f"after 150 steps: val loss {v:.4f} (uniform {u:.4f}), train loss {res['train_loss']:.4f}, "
      f"{res['tokens_per_s']:.0f} tokens/s")
for k in ("val_loss", "train_loss", "tokens_per_s", "samples_per_s", "wall_s"):
    if not (isinstance(res.get(k), (int, float)) and math.isfinite(res[k]) and res[k] > 0):
        sys.exit(f"FAIL: results.{k} missing or not positive")
if not abs(u - math.log(cfg["vocab_size"])) < 1e-4:
    sys.exit("FAIL: uniform_loss is not ln(vocab_size)")
if not v < 3.0:
    sys.exit(f"FAIL: validation loss {v:.4f} is not below 3.0 (the unigram model's 3.36)")
steps = [e["step"] for e in res["evals"]]
if steps != [0, 50, 100, 150]:
    sys.exit(f"FAIL: evaluations at steps {steps}")
g = last_json("gen.out")["results"]
text = open(f"{tmp}/gen.out", encoding="utf-8").read()
sample = g["sample"]
if g["generated_chars"] != 120 or len(sample) != 120:
    sys.exit(f"FAIL: asked for 120 characters, got {len(sample)}")
if not text.startswith("The " + sample):
    sys.exit("FAIL: the printed text is not the prompt followed by results.sample")
if any(not (c in "\n\t" or " " <= c <= "~") for c in sample):
    sys.exit("FAIL: the sample has characters outside the vocabulary")
print("sample:", repr(sample[:60]))
for d in ("bf16", "f16"):
    low = last_json(f"{d}.out")
    if low["config"]["dtype"] != d or low["config"]["param_dtype"] != "f32":
        sys.exit(f"FAIL: {d}: config says dtype {low['config']['dtype']}, params "
                 f"{low['config']['param_dtype']}")
    diff = 0.0
    for a, b in zip(low["results"]["evals"], res["evals"]):
        for k in ("train_loss", "val_loss"):
            diff = max(diff, abs(a[k] - b[k]))
            if not abs(a[k] - b[k]) <= 0.02 * b[k]:
                sys.exit(f"FAIL: {d} {k} at step {a['step']}: {a[k]:.4f} vs float32 {b[k]:.4f}")
    if diff < 1e-5:  # identical to float32: the 16-bit compute did not happen
        sys.exit(f"FAIL: {d} run equals the float32 run (largest difference {diff:.2g})")
    print(f"{d}: val loss {low['results']['val_loss']:.5f} (float32 {v:.5f}; largest eval "
          f"difference {diff:.2g}), {low['results']['tokens_per_s']:.0f} tokens/s")
raw = open(f"{tmp}/bf16.safetensors", "rb").read()
n = int.from_bytes(raw[:8], "little")
hdr = json.loads(raw[8:8 + n])
dts = {t["dtype"] for k, t in hdr.items() if k != "__metadata__"}
if dts != {"F32"}:
    sys.exit(f"FAIL: the bf16 run saved tensors of dtypes {dts}, expected float32 master weights")
print("bf16 checkpoint: float32 tensors")
PY
echo PASS
