#!/usr/bin/env bash
# collectives.sh - Open MPI peer of bench/collectives: runs build/bench/peers/mpi/collectives under
# mpirun once per process count and prints one JSON line with every run (the C benchmark's keys).
#
# usage: bench/peers/mpi/collectives.sh [--mpi-transport shm|tcp] [--nprocs LIST] [OPTIONS...]
#   --mpi-transport  shm (default): Open MPI's shared-memory path (--mca btl self,vader);
#                    tcp: loopback TCP (--mca btl self,tcp, btl_tcp_if_include lo)
#   --nprocs LIST    process counts (default 2,4)
#   OPTIONS          passed to the program (--sizes, --ops, --min-time-ms, --max-iters, --warmup)
# Both use the ob1 messaging layer (so the btl choice applies) and Open MPI's default collective
# algorithms (coll/tuned); --oversubscribe lets 4 ranks run on a 2-CPU host.
# environment: TD_BUILD_DIR (default <repo>/build), MPIRUN (default mpirun).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
prog="${TD_BUILD_DIR:-$root/build}/bench/peers/mpi/collectives"
[[ -x "$prog" ]] || { echo "collectives.sh: $prog not found (needs libopenmpi-dev at configure)" >&2; exit 1; }

transport=shm
nprocs=2,4
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --mpi-transport) transport="$2"; shift 2 ;;
    --nprocs) nprocs="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$transport" in
  shm) mca=(--mca pml ob1 --mca btl self,vader) ;;
  tcp) mca=(--mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include lo) ;;
  *) echo "collectives.sh: --mpi-transport shm|tcp" >&2; exit 2 ;;
esac

tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
IFS=, read -r -a counts <<<"$nprocs"
for p in "${counts[@]}"; do
  echo "collectives.sh: $p processes over $transport" >&2
  "${MPIRUN:-mpirun}" --oversubscribe --allow-run-as-root -np "$p" "${mca[@]}" \
    "$prog" --transport "$transport" ${args[@]+"${args[@]}"} | grep -E '^\{' | tail -n 1 >>"$tmp"
done
python3 - "$tmp" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if not lines:
    sys.exit("collectives.sh: no JSON line from mpirun")
config = dict(lines[0]["config"])
config["nprocs"] = [c for l in lines for c in l["config"]["nprocs"]]
runs = [r for l in lines for r in l["results"]["runs"]]
print(json.dumps({"bench": "collectives", "config": config, "results": {"runs": runs}}))
EOF
