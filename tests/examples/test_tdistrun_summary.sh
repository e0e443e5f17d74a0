#!/usr/bin/env bash
# test_tdistrun_summary.sh TDISTRUN EXAMPLE - `tdistrun --summary` prints one row per worker with
# the totals its agent wrote at shutdown: pipeline_split's master makes the calls, its two stage
# workers serve them, every worker moved bytes. Skips (77) without Fashion-MNIST.
set -euo pipefail
tdistrun="$1"
example="$2"
data_dir="${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [[ ! -e "$data_dir/train-images-idx3-ubyte.gz" && ! -e "$data_dir/train-images-idx3-ubyte" ]]; then
  echo "SKIP: no Fashion-MNIST in $data_dir"
  exit 77
fi
err="$(mktemp)"
trap 'rm -f "$err"' EXIT
"$tdistrun" --summary --standalone --nproc-per-node 3 --no-prefix "$example" --epochs 1 \
  --max-batches 10 --bench-batches 0 >/dev/null 2>"$err"
sed -n '/summary of node/,$p' "$err"
python3 - "$err" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
start = next(i for i, l in enumerate(lines) if "summary of node 0 (0 restarts" in l)
rows = {}
for l in lines[start + 2:start + 5]:
    f = l.split()
    rows[int(f[0])] = dict(zip(["rank", "worker", "calls", "failed", "served", "sent", "recv",
                                "handlers", "waiting", "coll", "straggler"], f))
assert sorted(rows) == [0, 1, 2], rows
assert rows[0]["worker"] == "master" and int(rows[0]["calls"]) > 10, rows[0]
for r in (1, 2):
    assert int(rows[r]["served"]) > 10, rows[r]
    assert float(rows[r]["handlers"]) > 0, rows[r]
assert all(float(rows[r]["sent"]) > 0 and float(rows[r]["recv"]) > 0 for r in rows), rows
assert all(int(rows[r]["failed"]) == 0 for r in rows), rows
print("PASS")
PY
