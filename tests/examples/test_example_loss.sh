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
mdir="$(mktemp -d)"
trap 'rm -rf "$out" "$mdir"' EXIT
rc=0
launch="${TD_EXAMPLE_LAUNCH:-tdistrun}" # the plot is drawn in this launch's test only
if [[ "${TD_EXAMPLE_NPROC:-3}" == 1 ]]; then
  timeout "$limit" "$example" "$@" --metrics "$mdir/m.jsonl" >"$out" || rc=$?
else
  # shellcheck source=launch_lib.sh
  source "$(dirname "$0")/launch_lib.sh"
  launch_cmd "$launch" "$tdistrun" "$example" "$@" --metrics "$mdir/m.jsonl"
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
# the metrics files (--metrics): every file parses; each worker that trains wrote one step record
# per batch it ran (distinct, finite losses; the same count on every trainer, at most
# --max-batches per epoch), the evaluations are there, and plot.py draws them (Debian's python3
# has matplotlib; the plot is skipped where no python3 has it)
python3 - "$mdir" "$*" <<'PY'
import glob, json, math, sys
files = sorted(glob.glob(sys.argv[1] + "/m*.jsonl"))
args = sys.argv[2].split()
maxb = int(args[args.index("--max-batches") + 1]) if "--max-batches" in args else None
epochs = int(args[args.index("--epochs") + 1]) if "--epochs" in args else 1
steps_by_file, evals, counters = {}, 0, 0
for f in files:
    recs = [json.loads(l) for l in open(f) if l.strip()]
    if not recs or recs[0]["kind"] != "start":
        sys.exit(f"FAIL: {f} does not start with a start record")
    st = [r for r in recs if r["kind"] == "step"]
    if st:
        if len({r["step"] for r in st}) != len(st) or not all(math.isfinite(r["loss"]) for r in st):
            sys.exit(f"FAIL: {f}: step records repeat a step or hold a non-finite loss")
        steps_by_file[f] = len(st)
    evals += sum(r["kind"] == "eval" for r in recs)
    counters += sum(r["kind"] == "counters" for r in recs)
print("metrics:", {f.rsplit("/", 1)[1]: n for f, n in steps_by_file.items()}, "steps;", evals,
      "evaluations;", counters, "counter records")
if not steps_by_file:
    sys.exit("FAIL: no step records in the metrics files")
counts = set(steps_by_file.values())
if len(counts) != 1 or (maxb and max(counts) > maxb * epochs):
    sys.exit(f"FAIL: the workers wrote different step counts, or more than {maxb} per epoch")
if evals < epochs:
    sys.exit(f"FAIL: {evals} evaluation records for {epochs} epochs")
PY
plotpy=python3
[[ -x /usr/bin/python3 ]] && plotpy=/usr/bin/python3
if [[ "$launch" == tdistrun ]] && "$plotpy" -c "import matplotlib" 2>/dev/null; then
  "$plotpy" "$(dirname "$0")/../../scripts/plot.py" "$mdir/m.jsonl" -o "$mdir/m.png"
  [[ -s "$mdir/m.png" ]] || { echo "FAIL: plot.py wrote no image"; exit 1; }
fi
echo PASS
