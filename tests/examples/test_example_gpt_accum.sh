#!/usr/bin/env bash
# test_example_gpt_accum.sh GPT GPT_3D - gradient accumulation and loss scaling in the GPT
# examples, on a tiny model (2 layers, width 16, context 8) for a few steps:
#   1. gpt --grad-accum 3 --batch-size 2 trains the model of gpt --batch-size 6, float64: the
#      saved weights agree to 1e-10, the batch hashes are equal (the same windows), so are the
#      evaluations and the last gradient norm; tokens_per_s counts every micro-batch; the same with 2 forked replicas and
#      --dp ddp, zero1, zero2, zero3 (one reduction per step, after 3 micro-batches);
#   2. gpt_3d --grad-accum 2 --batch-size 4 (dp 2 x pp 2) against its one-process check on the
#      concatenated batch of 8 (1e-9) and against gpt_3d --batch-size 8 (the same losses);
#   3. loss scaling, float32: --loss-scale dynamic (65536) and a constant 1024 train exactly the
#      weights of --loss-scale none (powers of two scale and unscale exactly), in one process and
#      with ddp and zero2; no step skipped; the scale doubles every --loss-scale-growth-interval
#      good steps; auto means none for f32 and bf16, dynamic for f16; a bad value is refused;
#   4. float16 compute (autocast) from a scale of 2^24: gradients overflow, steps are skipped and
#      the scale backs off to 2^24 / 2^skipped (no growth in 30 steps), and the model still
#      learns; alone, with ddp and with zero2 (found_inf agreed across the replicas).
# Skips (exit 77) without Debian's fortunes corpus. Bounded by `timeout`.
set -euo pipefail
gpt="$1"
gpt3d="$2"
corpus="${TD_GPT_CORPUS:-/usr/share/games/fortunes}"
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no corpus at $corpus (install Debian's fortunes package)"
  exit 77
fi
limit=$((120 * ${TD_TEST_TIMEOUT_SCALE:-1}))
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tiny=(--corpus "$corpus" --n-layer 2 --n-head 2 --n-embd 16 --block-size 8)
run() {
  local name="$1"
  shift
  timeout "$limit" "$@" 2>"$tmp/$name.err" >"$tmp/$name.out" ||
    { tail -n 20 "$tmp/$name.err"; echo "FAIL: $name"; exit 1; }
}

# 1. gpt: 3 micro-batches of 2 against batches of 6, alone and data parallel
g64=("${tiny[@]}" --dtype f64 --steps 6 --eval-interval 3 --eval-iters 2 --warmup 2)
run accum "$gpt" "${g64[@]}" --batch-size 2 --grad-accum 3 --save "$tmp/accum.safetensors"
run big "$gpt" "${g64[@]}" --batch-size 6 --save "$tmp/big.safetensors"
for dp in ddp zero1 zero2 zero3; do
  run "accum_$dp" "$gpt" "${g64[@]}" --nproc 2 --dp "$dp" --batch-size 2 --grad-accum 3 \
    --save "$tmp/accum_$dp.safetensors"
  run "big_$dp" "$gpt" "${g64[@]}" --nproc 2 --dp "$dp" --batch-size 6 \
    --save "$tmp/big_$dp.safetensors"
done

# 2. gpt_3d: 2 global batches of 4 against one of 8
g3=("${tiny[@]}" --dtype f64 --steps 5 --check --dp 2 --pp 2 --tp 1 --micro-batches 2)
run accum3d "$gpt3d" "${g3[@]}" --batch-size 4 --grad-accum 2
run big3d "$gpt3d" "${g3[@]}" --batch-size 8

# 3. loss scaling in float32
g32=("${tiny[@]}" --steps 30 --eval-interval 30 --eval-iters 2 --warmup 2 --batch-size 4)
for ls in none dynamic 1024; do
  run "scale_$ls" "$gpt" "${g32[@]}" --loss-scale "$ls" --save "$tmp/scale_$ls.safetensors"
done
run scale_auto "$gpt" "${g32[@]}" --steps 2
run scale_growth "$gpt" "${g32[@]}" --loss-scale dynamic --loss-scale-growth-interval 5
for dp in ddp zero2; do
  for ls in none dynamic; do
    run "scale_${dp}_$ls" "$gpt" "${g32[@]}" --steps 10 --nproc 2 --dp "$dp" --loss-scale "$ls" \
      --save "$tmp/scale_${dp}_$ls.safetensors"
  done
done
run scale_auto_bf16 "$gpt" "${g32[@]}" --steps 2 --dtype bf16
run scale_auto_f16 "$gpt" "${g32[@]}" --steps 2 --dtype f16

# 4. float16 overflows from a scale of 2^24
for dp in one ddp zero2; do
  extra=()
  [[ $dp == one ]] || extra=(--nproc 2 --dp "$dp")
  run "f16_$dp" "$gpt" "${g32[@]}" --dtype f16 --loss-scale-init 16777216 "${extra[@]}"
done
if "$gpt" "${g32[@]}" --loss-scale sometimes >"$tmp/bad.out" 2>&1; then
  echo "FAIL: --loss-scale sometimes was accepted"
  exit 1
fi
grep -q -- "--loss-scale must be" "$tmp/bad.out" || { cat "$tmp/bad.out"; echo "FAIL: message"; exit 1; }

python3 - "$tmp" <<'PY'
import array, json, struct, sys
tmp = sys.argv[1]

def result(name):
    lines = [l for l in open(f"{tmp}/{name}.out") if l.startswith("{")]
    assert lines, f"{name}: no JSON line"
    return json.loads(lines[-1])

def weights(name):
    b = open(f"{tmp}/{name}.safetensors", "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head, out = json.loads(b[8:8 + n]), {}
    for k, v in head.items():
        if k != "__metadata__":
            s, e = v["data_offsets"]
            out[k] = (v["dtype"], b[8 + n + s:8 + n + e])
    return out

def max_diff(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys(), f"{a} and {b} hold other tensors"
    worst = 0.0
    for k in wa:
        assert wa[k][0] == wb[k][0] == "F64", k
        x, y = array.array("d"), array.array("d")
        x.frombytes(wa[k][1]), y.frombytes(wb[k][1])
        worst = max(worst, max(abs(p - q) for p, q in zip(x, y)))
    return worst

# 1. gpt
for sfx in ["", "_ddp", "_zero1", "_zero2", "_zero3"]:
    a, b = result("accum" + sfx), result("big" + sfx)
    ra, rb = a["results"], b["results"]
    assert a["config"]["grad_accum"] == 3 and b["config"]["grad_accum"] == 1, sfx
    assert ra["batch_hash"] == rb["batch_hash"], f"accum{sfx}: other windows than the big batch"
    assert [e["val_loss"] for e in ra["evals"]] == [e["val_loss"] for e in rb["evals"]], sfx
    na, nb = ra["last_grad_norm"], rb["last_grad_norm"]  # (AdamW and clipping hide a factor)
    assert abs(na - nb) <= 1e-5 * nb, f"accum{sfx}: last gradient norm {na}, the batch of 6's {nb}"
    d = max_diff("accum" + sfx, "big" + sfx)
    assert d <= 1e-10, f"accum{sfx}: weights differ from the batch of 6 by {d}"
    tokens = 6 * 3 * 2 * 8 * (2 if sfx else 1)  # steps x K x B x T x replicas
    assert abs(ra["tokens_per_s"] * ra["train_s"] - tokens) <= 1e-3 * tokens, (sfx, ra)
    print(f"gpt{sfx or ' (one process)'}: 3 x 2 = 6 windows a step, weights within {d:.2g}")
for dp in ["ddp", "zero2", "zero3"]:
    share = result("accum_" + dp)["results"].get(
        "ddp_bytes_started_in_backward_share" if dp == "ddp" else "zero_bytes_started_in_backward_share")
    assert share == 1.0, f"{dp}: the reduction of the last micro-batch did not start in its backward"

# 2. gpt_3d
a, b = result("accum3d"), result("big3d")
ra, rb = a["results"], b["results"]
assert a["config"]["grad_accum"] == 2
assert ra["max_abs_loss_diff_vs_one_process"] <= 1e-9, ra
assert ra["losses"] == rb["losses"] and len(ra["losses"]) == 5, (ra["losses"], rb["losses"])
print(f"gpt_3d: 2 x 4 = the batch of 8, one process within {ra['max_abs_loss_diff_vs_one_process']:.2g}")

# 3. loss scaling
def same_bytes(a, b):
    return weights(a) == weights(b)
for ls, scale in [("dynamic", 65536.0), ("1024", 1024.0)]:
    r = result(f"scale_{ls}")
    assert r["config"]["loss_scale"] == ls and r["results"]["loss_scale"] == scale, r["results"]
    assert r["results"]["skipped_steps"] == 0, r["results"]
    assert same_bytes(f"scale_{ls}", "scale_none"), f"--loss-scale {ls} changed the weights"
r = result("scale_none")["results"]
assert r["loss_scale"] is None and r["skipped_steps"] == 0
assert result("scale_auto")["config"]["loss_scale"] == "none"
g = result("scale_growth")["results"]
assert g["loss_scale"] == 65536.0 * 2 ** 6 and g["skipped_steps"] == 0, g  # 30 steps / 5
for dp in ["ddp", "zero2"]:
    assert result(f"scale_{dp}_dynamic")["results"]["loss_scale"] == 65536.0
    assert same_bytes(f"scale_{dp}_dynamic", f"scale_{dp}_none"), f"{dp}: scaling changed the weights"
print("loss scaling: dynamic and constant scales train the unscaled weights exactly; growth 2^6 in 30 steps")
assert result("scale_auto_bf16")["config"]["loss_scale"] == "none"
assert result("scale_auto_f16")["config"]["loss_scale"] == "dynamic"

# 4. float16
for dp in ["one", "ddp", "zero2"]:
    r = result(f"f16_{dp}")["results"]
    k, ev = r["skipped_steps"], [e["val_loss"] for e in r["evals"]]
    assert 1 <= k < 30, f"f16 {dp}: {k} steps skipped"
    assert r["loss_scale"] == 2.0 ** (24 - k), f"f16 {dp}: scale {r['loss_scale']} after {k} backoffs"
    assert ev[-1] < ev[0] - 0.05, f"f16 {dp}: did not learn: {ev}"
    print(f"f16 {dp}: {k} steps skipped, scale 2^24 -> 2^{24 - k}, val loss {ev[0]} -> {ev[-1]}")
PY
echo PASS
