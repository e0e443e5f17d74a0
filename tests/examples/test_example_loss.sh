#!/usr/bin/env bash
# test_example_loss.sh TDISTRUN EXAMPLE ARGS... - runs EXAMPLE with 3 processes, started as
# TD_EXAMPLE_LAUNCH says (launch_lib.sh: tdistrun, the default; self, the example forking its own
# workers; mpirun, Open MPI), or alone with TD_EXAMPLE_NPROC=1, and checks that every process exited 0, that rank 0 printed
# the JSON line, and that the example learned:
#   - results.first_loss is above results.last_loss (the training loss fell), and
#   - the metric ($TD_EXAMPLE_METRIC, default test_accuracy) passes $TD_EXAMPLE_THRESHOLD
#     (required): at least it for an accuracy, at most it for a perplexity. The threshold is set
#     where chance cannot reach after the short run: a model stuck at 10% accuracy on
#     Fashion-MNIST, or at the unigram perplexity of the corpus, fails.
# With TD_EXAMPLE_RUNS=1 (pipeline_split) results.runs must hold a positive samples_per_s for
# micro_batches 1, 2, 4 and 8. Skips (exit 77) when the Fashion-MNIST files are missing, unless
# TD_EXAMPLE_NO_MNIST=1 (examples with their own data). Time is bounded by ctest's TIMEOUT and by
# `timeout` here (TD_TEST_TIMEOUT_SCALE scales it).
set -euo pipefail
tdistrun="$1"
example="$2"
shift 2
: "${TD_EXAMPLE_THRESHOLD:?set the metric threshold the example must reach}"
data_dir="${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [[ "${TD_EXAMPLE_NO_MNIST:-0}" != 1 && ! -e "$data_dir/train-images-idx3-ubyte.gz" && ! -e "$data_dir/train-images-idx3-ubyte" ]]; then
  echo "SKIP: no Fashion-MNIST in $data_dir"
  exit 77
fi
limit=$((100 * ${TD_TEST_TIMEOUT_SCALE:-1}))
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
rc=0
launch="${TD_EXAMPLE_LAUNCH:-tdistrun}"
if [[ "${TD_EXAMPLE_NPROC:-3}" == 1 ]]; then
  timeout "$limit" "$example" "$@" >"$out" || rc=$?
else
  # shellcheck source=launch_lib.sh
  source "$(dirname "$0")/launch_lib.sh"
  launch_cmd "$launch" "$tdistrun" "$example" "$@"
  timeout "$limit" "${LAUNCH_CMD[@]}" >"$out" || rc=$?
fi
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
python3 - "$line" "${TD_EXAMPLE_METRIC:-test_accuracy}" "$TD_EXAMPLE_THRESHOLD" <<'PY'
import json, math, os, sys
r = json.loads(sys.argv[1])["results"]
metric, threshold = sys.argv[2], float(sys.argv[3])
first, last, value = r["first_loss"], r["last_loss"], r[metric]
print(f"first_loss {first:.4f} last_loss {last:.4f} {metric} {value:.4f} (threshold {threshold})")
ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (first, last, value))
if not ok or not last < first:
    print("FAIL: the loss did not fall")
    sys.exit(1)
lower_is_better = metric == "perplexity"
if (value > threshold) if lower_is_better else (value < threshold):
    print(f"FAIL: {metric} {value:.4f} is {'above' if lower_is_better else 'below'} {threshold}: "
          "the example did not learn")
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
