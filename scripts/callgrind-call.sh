#!/usr/bin/env bash
# callgrind-call.sh [BUILD_DIR] - instructions per RPC, counted by valgrind's callgrind on both
# processes of bench/rpc_latency (an int64 echo to a TD_RPC_INLINE function, over the same-host
# lane unless TD_RPC_SHM_LANE=0 is set): a figure that does not depend on how loaded the machine
# is, unlike the benchmark's times.
#
# Method: the benchmark runs twice, with N and 2N timed calls (same warm-up); each run writes one
# callgrind profile per process (rank 0, the caller, and rank 1, the server forked by it). The
# instructions per call of a process are (total(2N) - total(N)) / N, so start-up, rendezvous and
# shutdown cancel out. Only the call's path is counted (callgrind's --toggle-collect): inside
# td_rpc_sync (the caller: encode, send, wait, the reply's decode when the caller takes it) and
# inside td__decoder_feed* on every thread (whoever reads a frame: its decode, the dispatch, the
# inline handler and the reply's send on the server; the reply on the caller's side). Periodic
# work - the pollers' ticks, keepalives, the lane threads' idle passes - is left out: under
# valgrind a run lasts ~50x longer, that work grows with the run's duration, and counted it made
# the same tree give 6.6k, 16.1k and 18.4k instructions a call (now 11.1-11.4k over four runs,
# the client's share within 0.3k). Busy polling is off (TD_RPC_BUSY_POLL_US=0) so no thread
# spins for a time that depends on the machine. Prints one JSON line:
#   {"bench": "callgrind_call", "config": {"calls", "path", ...},
#    "results": {"client_ir_per_call", "server_ir_per_call", "ir_per_call"}}
# Environment: TD_CG_CALLS (N, default 2000), TD_CG_KEEP=1 keeps the profiles (in a temporary
# directory it names) for callgrind_annotate.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
bin="$build/bench/rpc_latency"
[[ -x "$bin" ]] || { echo "callgrind-call.sh: $bin not found (build the rpc_latency target)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "callgrind-call.sh: valgrind not installed" >&2; exit 1; }
n=${TD_CG_CALLS:-2000}
tmp=$(mktemp -d)
[[ "${TD_CG_KEEP:-0}" == 1 ]] || trap 'rm -rf "$tmp"' EXIT

# run CALLS DIR: one benchmark run under callgrind, profiles in DIR; prints the JSON line's path
run() {
  mkdir -p "$2"
  TD_RPC_BUSY_POLL_US=0 valgrind --tool=callgrind --callgrind-out-file="$2/cg.%p" \
    --toggle-collect=td_rpc_sync '--toggle-collect=td__decoder_feed*' \
    "$bin" --security secret --calls "$1" --warmup 200 >"$2/out.json" 2>"$2/err.log" || {
    echo "callgrind-call.sh: the run with $1 calls failed:" >&2
    tail -n 20 "$2/err.log" >&2
    exit 1
  }
}

# totals DIR: "rank0_ir rank1_ir" (rank 0 is the lower pid: it forks rank 1). Short-lived
# children of either (a device probe: tensor/devices.c) leave profiles too (empty ones, with the
# call path's toggles): the two workers are the two largest.
totals() {
  local p pids ir=()
  mapfile -t pids < <(for p in $(ls "$1" | sed -n 's/^cg\.//p'); do
                        echo "$(awk '/^(summary|totals):/ {print $2; exit}' "$1/cg.$p") $p"
                      done | sort -rn | head -n 2 | awk '{print $2}' | sort -n)
  [[ ${#pids[@]} -eq 2 ]] || { echo "callgrind-call.sh: expected 2 profiles in $1" >&2; exit 1; }
  for p in "${pids[@]}"; do
    ir+=("$(awk '/^(summary|totals):/ {print $2; exit}' "$1/cg.$p")")
  done
  echo "${ir[0]} ${ir[1]}"
}

run "$n" "$tmp/n"
run "$((2 * n))" "$tmp/2n"
read -r c1 s1 < <(totals "$tmp/n")
read -r c2 s2 < <(totals "$tmp/2n")
path=$(grep -o '"transport": "[a-z]*"' "$tmp/2n/out.json" | sed 's/.*: "//; s/"//')
awk -v n="$n" -v c1="$c1" -v s1="$s1" -v c2="$c2" -v s2="$s2" -v path="$path" 'BEGIN {
  c = (c2 - c1) / n; s = (s2 - s1) / n
  printf "{\"bench\": \"callgrind_call\", \"config\": {\"calls\": %d, \"path\": \"%s\", " \
         "\"payload\": \"int64\", \"handler\": \"inline\", \"busy_poll_us\": 0}, " \
         "\"results\": {\"client_ir_per_call\": %.0f, \"server_ir_per_call\": %.0f, " \
         "\"ir_per_call\": %.0f}}\n", n, path, c, s, c + s
}'
[[ "${TD_CG_KEEP:-0}" == 1 ]] && echo "callgrind-call.sh: profiles kept in $tmp" >&2
exit 0
