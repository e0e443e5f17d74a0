#!/usr/bin/env bash
# test_example_loss.sh TDISTRUN EXAMPLE ARGS... - runs EXAMPLE under TDISTRUN with 3 processes
# and checks that every process exited 0, that rank 0 printed the JSON line, and that its
# results.first_loss is above results.last_loss (the loss fell) with a finite test_accuracy (or
# the metric named by $TD_EXAMPLE_METRIC, e.g. perplexity, which must also be below the untrained
# model's results.first_perplexity). With TD_EXAMPLE_RUNS=1 (pipeline_split) results.runs must
# hold a positive samples_per_s for micro_batches 1, 2, 4 and 8. Skips (exit 77) when the Fashion-MNIST files are missing,
# unless TD_EXAMPLE_NO_MNIST=1 (examples with their own data). Time is bounded by ctest's TIMEOUT
# and by `timeout` here (TD_TEST_TIMEOUT_SCALE scales it).
set -euo pipefail
tdistrun="$1"
example="$2"
shift 2
data_dir="${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [[ "${TD_EXAMPLE_NO_MNIST:-0}" != 1 && ! -e "$data_dir/train-images-idx3-ubyte.gz" && ! -e "$data_dir/train-images-idx3-ubyte" ]]; then
  echo "SKIP: no Fashion-MNIST in $data_dir"
  exit 77
fi
limit=$((100 * ${TD_TEST_TIMEOUT_SCALE:-1}))
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
rc=0
timeout "$limit" "$tdistrun" --standalone --nproc-per-node 3 --no-prefix "$example" "$@" >"$out" || rc=$?
cat "$out"
if [[ $rc -ne 0 ]]; then
  echo "FAIL: $(basename "$example") exited with status $rc"
  exit 1
fi
line="$(grep -E '^\{' "$out" | tail -n 1 || true)"
if [[ -z "$line" ]]; then
  echo "FAIL: no JSON line on standard output"
  exit 1
fi
python3 - "$line" "${TD_EXAMPLE_METRIC:-test_accuracy}" <<'PY'
import json, math, os, sys
r = json.loads(sys.argv[1])["results"]
metric = sys.argv[2]
first, last, acc = r["first_loss"], r["last_loss"], r[metric]
print(f"first_loss {first:.4f} last_loss {last:.4f} {metric} {acc:.4f}")
ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (first, last, acc))
if not ok or not last < first:
    print("FAIL: the loss did not fall")
    sys.exit(1)
if metric == "perplexity" and not acc < r["first_perplexity"]:
    print("FAIL: the perplexity did not fall")
    sys.exit(1)
if os.environ.get("TD_EXAMPLE_RUNS") == "1":
    runs = r.get("runs", [])
    print("runs:", [(x.get("micro_batches"), x.get("samples_per_s")) for x in runs])
    if (sorted(x.get("micro_batches") for x in runs) != [1, 2, 4, 8] or
            not all(x.get("samples_per_s", 0) > 0 for x in runs)):
        print("FAIL: results.runs should hold samples_per_s > 0 for 1, 2, 4 and 8 micro-batches")
        sys.exit(1)
for k in ("samples_per_s", "wall_s"):
    if not r.get(k, 0) > 0:
        print(f"FAIL: results.{k} missing or not positive")
        sys.exit(1)
PY
echo PASS
