#!/usr/bin/env bash
# compare.sh - run a tdist benchmark and its PyTorch peer interleaved and compare medians.
#
# usage: bench/compare.sh NAME [RUNS] [-- ARGS...]
#   NAME  benchmark name: build/bench/NAME (ours) and bench/peers/torch/NAME.py (peer)
#   RUNS  runs of each, interleaved ours, peer, ours, peer, ... (default 5)
#   ARGS  passed to both programs
# environment:
#   TD_BUILD_DIR          build directory holding bench/NAME (default: <repo>/build)
#   TD_PEER_PYTHON        interpreter for the peer (default /usr/bin/python3, which has torch)
#   OPENBLAS_NUM_THREADS  BLAS threads for both (default 1)
#
# Prints every run's JSON line as it comes, then one summary JSON line:
#   {"bench": "compare", "config": {"name", "runs", "key", ...},
#    "results": {"ours_median", "peer_median", "ratio", "ours", "peer", "higher_is_better"}}
# where ratio = ours_median / peer_median of the benchmark's main key (table below). Exit status
# 1 when a run fails or prints no JSON line. The script measures; it never asserts a speed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  [[ $# -lt 1 ]] && exit 2 || exit 0
fi
name="$1"
shift
runs=5
if [[ $# -gt 0 && "$1" != "--" ]]; then
  runs="$1"
  shift
fi
[[ $# -gt 0 && "$1" == "--" ]] && shift
args=("$@")

# Main key of each benchmark (a dotted path into "results") and whether higher is better.
# Add a line per new benchmark.
main_key() {
  case "$1" in
    train_step) echo "steps_per_s higher" ;;
    rpc_latency) echo "p50_us lower" ;;
    rpc_throughput) echo "calls_per_s higher" ;;
    rpc_bandwidth) echo "memcpy_GBps higher" ;;
    rref_ops) echo "remote_to_here.ops_per_s higher" ;;
    dist_autograd_mlp) echo "steps_per_s higher" ;;
    *) return 1 ;;
  esac
}
if ! spec="$(main_key "$name")"; then
  echo "compare.sh: no main key known for benchmark '$name' (add it to main_key)" >&2
  exit 2
fi
key="${spec% *}"
direction="${spec#* }"

build="${TD_BUILD_DIR:-$root/build}"
ours="$build/bench/$name"
peer="$root/bench/peers/torch/$name.py"
py="${TD_PEER_PYTHON:-/usr/bin/python3}"
[[ -x "$ours" ]] || { echo "compare.sh: $ours not found (build first, or set TD_BUILD_DIR)" >&2; exit 1; }
[[ -f "$peer" ]] || { echo "compare.sh: peer $peer not found" >&2; exit 1; }
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# run_one LABEL OUTFILE CMD... runs CMD, echoes its last stdout line and appends it to OUTFILE.
run_one() {
  local label="$1" out="$2"
  shift 2
  local log="$tmp/run.out"
  if ! "$@" >"$log"; then
    echo "compare.sh: $label run failed: $*" >&2
    exit 1
  fi
  local line
  line="$(grep -E '^\{' "$log" | tail -n 1 || true)"
  if [[ -z "$line" ]]; then
    echo "compare.sh: $label run printed no JSON line: $*" >&2
    exit 1
  fi
  echo "$line"
  echo "$line" >>"$out"
}

for ((i = 0; i < runs; i++)); do
  run_one ours "$tmp/ours.jsonl" "$ours" ${args[@]+"${args[@]}"}
  run_one peer "$tmp/peer.jsonl" "$py" "$peer" ${args[@]+"${args[@]}"}
done

python3 - "$name" "$key" "$direction" "$runs" "$tmp/ours.jsonl" "$tmp/peer.jsonl" "$OPENBLAS_NUM_THREADS" <<'EOF'
import json, statistics, sys
name, key, direction, runs, ours_f, peer_f, blas = sys.argv[1:8]

def values(path):
    out = []
    for line in open(path):
        v = json.loads(line)["results"]
        for part in key.split("."):
            v = v[part]
        out.append(float(v))
    return out

ours, peer = values(ours_f), values(peer_f)
mo, mp = statistics.median(ours), statistics.median(peer)
print(json.dumps({
    "bench": "compare",
    "config": {"name": name, "runs": int(runs), "key": key, "openblas_num_threads": blas},
    "results": {
        "ours_median": mo, "peer_median": mp,
        "ratio": mo / mp if mp else None,
        "higher_is_better": direction == "higher",
        "ours": ours, "peer": peer,
    },
}), flush=True)
EOF
