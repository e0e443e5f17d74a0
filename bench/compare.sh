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
#    "results": {"ours_median", "peer_median", "ratio", "ours", "peer", "higher_is_better",
#                "target", "meets_target", "extra": {KEY: {"ours_median", ...}}}}
# where ratio = ours_median / peer_median of the benchmark's main key (table below), target the
# ratio the project aims at (null when none) and extra the same figures for secondary keys. Keys
# are dotted paths into "results"; a list element is chosen by a field, as in
# echo[bytes=67108864].GBps_both_dirs. Exit status 1 when a run fails or prints no JSON line, or
# when a key that identifies the workload differs between the programs (gpt: batch_hash; the
# summary then has "same_batch_hash": false).
# A key a program does not report (a list element it lacks: PyTorch 1.13's pipeline has no 1F1B)
# gives that side null and no ratio. The script measures; it never asserts a speed (meets_target
# is informational).
#
# For rpc_latency the same invocation also measures the floors under a same-host call, each RUNS
# times interleaved with the others: a unix socket and a shared page bounced by two processes
# (bench/peers/floor/pingpong, spinning reads) and UCX's ucx_perftest (shared memory, when
# installed); results.floors = {NAME: {"p50_us_median", "runs", "ours_over_floor"}}. For
# rpc_bandwidth, UCX's round trip of 1 MiB and 64 MiB messages (ucx_perftest tag_lat) gives the
# same figure as the echo (GBps_both_dirs = 2 x bytes / round trip): results.floors.ucx =
# {"median", "runs", "ours_over_floor"} at the main key, and "extra": the same at 1 MiB.
#
# bench/compare.sh collectives [RUNS] [-- ARGS...] is a mode of its own with three peers run in
# the same invocation, interleaved (ours, gloo, MPI shm, MPI tcp, ours, ...): torch.distributed
# gloo (bench/peers/torch/collectives.py) and Open MPI over shared memory and over TCP
# (bench/peers/mpi/collectives.sh, skipped with a note when the MPI peer was not built). It prints
# every run's line, a table on standard error (per operation, process count and size: median
# time_us and busbw_GBps of each, and ours/peer busbw ratios), then one summary JSON line
#   {"bench": "compare", "config": {"name": "collectives", "runs", "peers"},
#    "results": {"points": [{"op", "nprocs", "bytes", "ours": {"time_us", "busbw_GBps", "algo"},
#                 "gloo": {...}, "mpi_shm": {...}, "mpi_tcp": {...},
#                 "ratio_busbw": {PEER: ours/peer}}, ...],
#                "target": {"peer": "mpi_shm", "ratio_min": 1}, "meets_target": bool,
#                "below_target": [points where ours/mpi_shm < 1]}}
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,41p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
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

if [[ "$name" == collectives ]]; then
  exec "$here/compare_collectives.sh" "$runs" ${args[@]+"${args[@]}"}
fi

# Main key of each benchmark (a dotted path into "results"), whether higher is better, and the
# target ratio ours/peer ("-" for none; the ratio should be >= it when higher is better, <= it
# otherwise). Add a line per new benchmark.
main_key() {
  case "$1" in
    train_step) echo "steps_per_s higher -" ;;
    rpc_latency) echo "p50_us lower 0.3333" ;;
    rpc_throughput) echo "calls_per_s higher 3" ;;
    rpc_bandwidth) echo "echo[bytes=67108864].GBps_both_dirs higher 1" ;;
    rref_ops) echo "remote_to_here.ops_per_s higher 3" ;;
    dist_autograd_mlp) echo "steps_per_s higher 2" ;;
    param_server) echo "epoch_wall_s lower 0.5" ;;
    pipeline_split) echo "runs[micro_batches=4].samples_per_s higher -" ;;
    gpt) echo "tokens_per_s higher 1" ;;
    pipeline_schedules) echo "schedules[schedule=gpipe].samples_per_s higher -" ;;
    # start-up + all-to-all + shutdown of 64 workers: bench/compare.sh rpc_scale 3 -- --worlds 64 --sim ""
    rpc_scale) echo "processes[world=64].wall_s lower -" ;;
    *) return 1 ;;
  esac
}
# Secondary keys reported beside the main one: "key:direction" words (may be empty).
extra_keys() {
  case "$1" in
    rpc_latency) echo "calls_per_s:higher p90_us:lower p99_us:lower" ;;
    param_server) echo "test_accuracy:higher samples_per_s:higher" ;;
    pipeline_split)
      echo "runs[micro_batches=1].samples_per_s:higher runs[micro_batches=2].samples_per_s:higher" \
        "runs[micro_batches=8].samples_per_s:higher samples_per_s:higher test_accuracy:higher" ;;
    rpc_throughput) echo "us_per_call:lower" ;;
    gpt) echo "val_loss:lower train_loss:lower tokens_per_cpu_s:higher" ;;
    pipeline_schedules) echo "schedules[schedule=1f1b].samples_per_s:higher" ;;
    rpc_scale)
      echo "processes[world=64].init_s:lower processes[world=64].all_to_all_s:lower" \
        "processes[world=64].shutdown_s:lower" ;;
    rref_ops) echo "proxy_rpc_sync.ops_per_s:higher remote_to_here.us_per_op:lower" ;;
    rpc_bandwidth)
      local k out=""
      for k in 1024 65536 1048576 16777216; do out+="echo[bytes=$k].GBps_both_dirs:higher "; done
      echo "${out}memcpy_GBps:higher" ;;
    *) echo "" ;;
  esac
}
if ! spec="$(main_key "$name")"; then
  echo "compare.sh: no main key known for benchmark '$name' (add it to main_key)" >&2
  exit 2
fi
read -r key direction target <<<"$spec"
extras="$(extra_keys "$name")"

build="${TD_BUILD_DIR:-$root/build}"
ours="$build/bench/$name"
ours_cmd=("$ours")
# Examples measured as benchmarks: ours is build/examples/NAME under tdistrun (3 processes).
case "$name" in
  param_server | pipeline_split)
    ours="$build/examples/$name"
    ours_cmd=("$build/tools/tdistrun" --standalone --nproc-per-node 3 --no-prefix "$ours") ;;
esac
# gpt: the example in one process; both programs start from the same weights, written once by
# ours (--steps 0 --save) and loaded by both (--init), and run with --threads equal to
# OPENBLAS_NUM_THREADS unless ARGS set it. Their results.batch_hash must agree (same batches).
case "$name" in
  gpt)
    ours="$build/examples/gpt"
    ours_cmd=("$ours") ;;
  # pipeline_schedules: gpt_3d in 2 stages with each schedule (bench/pipeline_schedules.sh); the
  # peer (PyTorch 1.13's Pipe) has GPipe only, so 1F1B's line has no peer figure.
  pipeline_schedules)
    ours="$build/examples/gpt_3d"
    ours_cmd=("$here/pipeline_schedules.sh" "$build") ;;
esac
peer="$root/bench/peers/torch/$name.py"
py="${TD_PEER_PYTHON:-/usr/bin/python3}"
[[ -x "$ours" ]] || { echo "compare.sh: $ours not found (build first, or set TD_BUILD_DIR)" >&2; exit 1; }
[[ -f "$peer" ]] || { echo "compare.sh: peer $peer not found" >&2; exit 1; }
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [[ "$name" == gpt ]]; then
  [[ " ${args[*]-} " == *" --threads"* ]] || args+=(--threads "$OPENBLAS_NUM_THREADS")
  if ! "$ours" ${args[@]+"${args[@]}"} --steps 0 --eval-iters 1 --save "$tmp/init.safetensors" \
       >"$tmp/init.out" 2>&1; then
    echo "compare.sh: could not write the initial weights:" >&2
    cat "$tmp/init.out" >&2
    exit 1
  fi
  args+=(--init "$tmp/init.safetensors")
fi

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

# rpc_latency: the floors under a same-host call, interleaved with the runs: two processes
# bouncing 8 bytes over a unix socket with spinning reads and over a shared page
# (bench/peers/floor/pingpong), and UCX's ucx_perftest (tag_lat, round trip = twice its one-way
# p50) when it is installed (Debian: ucx-utils). The summary gets results.floors.
floors=()
if [[ "$name" == rpc_latency ]]; then
  pp="$build/bench/peers/floor/pingpong"
  [[ -x "$pp" ]] && floors+=(unix_spin shm_spin)
  command -v ucx_perftest >/dev/null 2>&1 && floors+=(ucx)
  [[ ${#floors[@]} -eq 0 ]] && echo "compare.sh: no floor peer (build the pingpong target)" >&2
  command -v ucx_perftest >/dev/null 2>&1 ||
    echo "compare.sh: ucx_perftest not installed: no UCX floor (apt-get install ucx-utils)" >&2
fi
if [[ "$name" == rpc_bandwidth ]]; then
  if command -v ucx_perftest >/dev/null 2>&1; then floors+=(ucx_bw)
  else echo "compare.sh: ucx_perftest not installed: no UCX floor (apt-get install ucx-utils)" >&2
  fi
fi

# ucx_line prints one JSON line with ucx_perftest's shared-memory round trip.
ucx_line() {
  local port
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  ucx_perftest -t tag_lat -p "$port" -n 20000 -s 8 >"$tmp/ucx_srv.out" 2>&1 &
  local srv=$!
  sleep 0.3
  local out
  out="$(ucx_perftest 127.0.0.1 -t tag_lat -p "$port" -n 20000 -s 8 2>&1 | grep '^Final:' || true)"
  wait "$srv" || true
  [[ -n "$out" ]] || return 1
  awk '{printf "{\"bench\": \"ucx_perftest\", \"config\": {\"test\": \"tag_lat\", \"bytes\": 8}, \"results\": {\"p50_us\": %.3f, \"one_way_p50_us\": %s}}\n", 2 * $3, $3}' <<<"$out"
}

# ucx_rtt_us BYTES ITERS prints ucx_perftest's median one-way latency (us) of BYTES-byte messages
# bounced between two processes (tag_lat), or nothing.
ucx_rtt_us() {
  local port out
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  ucx_perftest -t tag_lat -p "$port" -n "$2" -s "$1" >"$tmp/ucx_srv.out" 2>&1 &
  local srv=$!
  sleep 0.3
  out="$(ucx_perftest 127.0.0.1 -t tag_lat -p "$port" -n "$2" -s "$1" 2>&1 | grep '^Final:' || true)"
  wait "$srv" || true
  awk '{print $3}' <<<"$out"
}

# ucx_bw_line prints one JSON line with UCX's echo rate at 1 MiB and 64 MiB (both directions).
ucx_bw_line() {
  local a b
  a="$(ucx_rtt_us 1048576 500)"
  b="$(ucx_rtt_us 67108864 20)"
  [[ -n "$a" && -n "$b" ]] || return 1
  awk -v a="$a" -v b="$b" 'BEGIN { printf "{\"bench\": \"ucx_perftest\", \"config\": {\"test\": \"tag_lat\"}, \"results\": {\"echo\": [{\"bytes\": 1048576, \"GBps_both_dirs\": %.3f, \"one_way_us\": %s}, {\"bytes\": 67108864, \"GBps_both_dirs\": %.3f, \"one_way_us\": %s}]}}\n", 1048576 / (a * 1e3), a, 67108864 / (b * 1e3), b }'
}

run_floors() {
  local f
  for f in ${floors[@]+"${floors[@]}"}; do
    case "$f" in
      unix_spin) run_one floor "$tmp/floor_$f.jsonl" "$pp" --mode unix ;;
      shm_spin) run_one floor "$tmp/floor_$f.jsonl" "$pp" --mode shm ;;
      ucx) run_one floor "$tmp/floor_$f.jsonl" ucx_line ;;
      ucx_bw) run_one floor "$tmp/floor_$f.jsonl" ucx_bw_line ;;
    esac
  done
}

for ((i = 0; i < runs; i++)); do
  run_one ours "$tmp/ours.jsonl" "${ours_cmd[@]}" ${args[@]+"${args[@]}"}
  run_one peer "$tmp/peer.jsonl" "$py" "$peer" ${args[@]+"${args[@]}"}
  run_floors
done
floor_files=""
for f in ${floors[@]+"${floors[@]}"}; do floor_files+="$f=$tmp/floor_$f.jsonl "; done

# Keys whose values must be equal in every run of both programs (the comparison is void
# otherwise): gpt's hash of the training batches.
same_keys() {
  case "$1" in
    gpt) echo "batch_hash" ;;
    *) echo "" ;;
  esac
}

python3 - "$name" "$key" "$direction" "$runs" "$tmp/ours.jsonl" "$tmp/peer.jsonl" \
  "$OPENBLAS_NUM_THREADS" "$target" "$extras" "$(same_keys "$name")" "$floor_files" <<'EOF'
import json, re, statistics, sys
name, key, direction, runs, ours_f, peer_f, blas, target, extras, same, floor_files = sys.argv[1:12]

def lookup(results, path):
    """Follows a dotted path; 'list[field=value]' picks the list element whose field matches."""
    v = results
    for part in path.split("."):
        m = re.fullmatch(r"([^\[]+)\[([^=\]]+)=([^\]]+)\]", part)
        if not m:
            v = v[part]
            continue
        field, want = m.group(2), m.group(3)
        v = next((e for e in v[m.group(1)] if str(e[field]) == want), None)
        if v is None:
            return None  # the program has no such element (a peer without that schedule)
    return float(v)

def values(path, k):
    vs = [lookup(json.loads(line)["results"], k) for line in open(path)]
    return [v for v in vs if v is not None]

def summary(k, higher):
    ours, peer = values(ours_f, k), values(peer_f, k)
    mo = statistics.median(ours) if ours else None
    mp = statistics.median(peer) if peer else None
    return {"ours_median": mo, "peer_median": mp, "ratio": mo / mp if mp and mo else None,
            "higher_is_better": higher, "ours": ours, "peer": peer}

res = summary(key, direction == "higher")
if target == "-":
    res["target"], res["meets_target"] = None, None
else:
    t, r = float(target), res["ratio"]
    res["target"] = {("ratio_min" if res["higher_is_better"] else "ratio_max"): t}
    res["meets_target"] = None if r is None else (r >= t if res["higher_is_better"] else r <= t)
extra = {}
for word in extras.split():
    k, d = word.rsplit(":", 1)
    e = summary(k, d == "higher")
    extra[k] = e
if extra:
    res["extra"] = extra
floors = {}
def floor_at(path, k, ours):
    vs = values(path, k)
    m = statistics.median(vs) if vs else None
    return m, vs, ours / m if m and ours else None
for word in floor_files.split():
    fname, path = word.split("=", 1)
    m, vs, over = floor_at(path, key, res["ours_median"])
    label = "p50_us_median" if name == "rpc_latency" else "median"
    floors[fname] = {label: m, "runs": vs, "ours_over_floor": over}
    if name == "rpc_bandwidth":
        k = "echo[bytes=1048576].GBps_both_dirs"
        m, vs, over = floor_at(path, k, extra.get(k, {}).get("ours_median"))
        floors[fname]["extra"] = {k: {"median": m, "runs": vs, "ours_over_floor": over}}
if floors:
    res["floors"] = floors
mismatch = []
for k in same.split():
    seen = {json.loads(line)["results"].get(k) for f in (ours_f, peer_f) for line in open(f)}
    res["same_" + k] = len(seen) == 1
    if len(seen) != 1:
        mismatch.append("%s differs between runs: %s" % (k, sorted(map(str, seen))))
print(json.dumps({
    "bench": "compare",
    "config": {"name": name, "runs": int(runs), "key": key, "openblas_num_threads": blas},
    "results": res,
}), flush=True)
if mismatch:
    print("compare.sh: the two programs did not run the same workload: " + "; ".join(mismatch),
          file=sys.stderr)
    sys.exit(1)
EOF
