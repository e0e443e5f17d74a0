#!/usr/bin/env bash
# compare_collectives.sh - the "collectives" mode of bench/compare.sh (see its usage): runs
# build/bench/collectives, the gloo peer and the Open MPI peer over shared memory and over TCP,
# interleaved, RUNS times each, then prints a table and one summary JSON line.
#
# usage: bench/compare_collectives.sh RUNS [ARGS...]   (normally through bench/compare.sh)
# environment: TD_BUILD_DIR, TD_PEER_PYTHON as for compare.sh; TD_COMPARE_PEERS (default
# "gloo mpi_shm mpi_tcp") picks the peers.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
runs="${1:-3}"
shift || true
args=("$@")

build="${TD_BUILD_DIR:-$root/build}"
py="${TD_PEER_PYTHON:-/usr/bin/python3}"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
ours="$build/bench/collectives"
[[ -x "$ours" ]] || { echo "compare.sh: $ours not found (build first, or set TD_BUILD_DIR)" >&2; exit 1; }

labels=(ours)
cmds=("$ours")
for peer in ${TD_COMPARE_PEERS:-gloo mpi_shm mpi_tcp}; do
  case "$peer" in
    gloo) labels+=(gloo); cmds+=("$py $root/bench/peers/torch/collectives.py") ;;
    mpi_shm | mpi_tcp)
      if [[ ! -x "$build/bench/peers/mpi/collectives" ]]; then
        echo "compare.sh: $peer skipped: the Open MPI peer was not built (libopenmpi-dev)" >&2
        continue
      fi
      labels+=("$peer")
      cmds+=("$root/bench/peers/mpi/collectives.sh --mpi-transport ${peer#mpi_}") ;;
    *) echo "compare.sh: unknown peer '$peer'" >&2; exit 2 ;;
  esac
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((i = 0; i < runs; i++)); do
  for k in "${!labels[@]}"; do
    log="$tmp/run.out"
    # shellcheck disable=SC2086 # cmds hold a program and its fixed words
    if ! ${cmds[$k]} ${args[@]+"${args[@]}"} >"$log"; then
      echo "compare.sh: ${labels[$k]} run failed: ${cmds[$k]}" >&2
      exit 1
    fi
    line="$(grep -E '^\{' "$log" | tail -n 1 || true)"
    [[ -n "$line" ]] || { echo "compare.sh: ${labels[$k]} printed no JSON line" >&2; exit 1; }
    echo "$line"
    echo "$line" >>"$tmp/${labels[$k]}.jsonl"
  done
done

python3 - "$tmp" "$runs" "${labels[@]}" <<'EOF'
import json, statistics, sys
tmp, runs, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
peers = labels[1:]

def load(label):
    pts = {}
    for line in open("%s/%s.jsonl" % (tmp, label)):
        for r in json.loads(line)["results"]["runs"]:
            pts.setdefault((r["op"], r["nprocs"], r["bytes"]), []).append(r)
    return pts

data = {l: load(l) for l in labels}

def med(rs, k):
    xs = [r[k] for r in rs if r.get(k) is not None]
    return statistics.median(xs) if xs else None

points, below = [], []
for key in sorted(data["ours"], key=lambda k: (["all_reduce", "broadcast", "all_gather",
                                                 "reduce_scatter"].index(k[0]), k[1], k[2])):
    op, p, nb = key
    pt = {"op": op, "nprocs": p, "bytes": nb, "ratio_busbw": {}}
    for l in labels:
        rs = data[l].get(key, [])
        algo = rs[0].get("algo") if rs else None
        pt[l] = {"time_us": med(rs, "time_us"), "busbw_GBps": med(rs, "busbw_GBps"), "algo": algo}
    for l in peers:
        a, b = pt["ours"]["busbw_GBps"], pt[l]["busbw_GBps"]
        pt["ratio_busbw"][l] = a / b if a and b else None
    r = pt["ratio_busbw"].get("mpi_shm")
    if r is not None and r < 1:
        below.append({"op": op, "nprocs": p, "bytes": nb, "ratio": r})
    points.append(pt)

def fmt(x, w, d):
    return ("%*.*f" % (w, d, x)) if x is not None else "%*s" % (w, "-")

hdr = "%-14s %2s %9s | %9s %9s" % ("op", "P", "bytes", "ours us", "GB/s")
for l in peers:
    hdr += " | %9s %8s %6s" % (l + " us", "GB/s", "ratio")
print(hdr, file=sys.stderr)
for pt in points:
    row = "%-14s %2d %9d | %s %s" % (pt["op"], pt["nprocs"], pt["bytes"],
                                     fmt(pt["ours"]["time_us"], 9, 1),
                                     fmt(pt["ours"]["busbw_GBps"], 9, 3))
    for l in peers:
        row += " | %s %s %s" % (fmt(pt[l]["time_us"], 9, 1), fmt(pt[l]["busbw_GBps"], 8, 3),
                                fmt(pt["ratio_busbw"][l], 6, 2))
    print(row, file=sys.stderr)
res = {"points": points}
if "mpi_shm" in peers:
    res["target"] = {"peer": "mpi_shm", "ratio_min": 1}
    res["meets_target"] = not below
    res["below_target"] = below
print(json.dumps({"bench": "compare", "config": {"name": "collectives", "runs": runs,
                                                 "peers": peers}, "results": res}), flush=True)
EOF
