#!/usr/bin/env bash
# test_example_kill.sh TDISTRUN EXAMPLE ARGS... - starts EXAMPLE with 3 processes as
# TD_EXAMPLE_LAUNCH says (launch_lib.sh: tdistrun, self, mpirun, srun or bare), kills rank 1's process
# with SIGKILL once training is under way, and checks that the whole job ends non-zero within
# TD_EXAMPLE_KILL_LIMIT seconds (default 22: the agent's 20 s keepalive timeout + 2 s; scaled by
# TD_TEST_TIMEOUT_SCALE), that its output names rank 1, and that no process of the job is left.
# srun (with --kill-on-bad-exit=0) and bare (3 separate processes that nothing supervises) leave
# the survivors running: there each must end by itself (the examples' watchdog, no flag), and
# bare checks each one's exit status and its own output.
# Skips (77) without Fashion-MNIST unless TD_EXAMPLE_NO_MNIST=1, and without the file
# TD_EXAMPLE_NEEDS when that is set (gpt's corpus). Ends only processes it started
# (rank 1 by pid; leftovers, which fail the test, by pid).
set -euo pipefail
tdistrun="$1"
example="$2"
shift 2
data_dir="${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [[ "${TD_EXAMPLE_NO_MNIST:-0}" != 1 && ! -e "$data_dir/train-images-idx3-ubyte.gz" && ! -e "$data_dir/train-images-idx3-ubyte" ]]; then
  echo "SKIP: no Fashion-MNIST in $data_dir"
  exit 77
fi
if [[ -n "${TD_EXAMPLE_NEEDS:-}" && ! -e "$TD_EXAMPLE_NEEDS" ]]; then
  echo "SKIP: no $TD_EXAMPLE_NEEDS"
  exit 77
fi
# shellcheck source=launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"
method="${TD_EXAMPLE_LAUNCH:-tdistrun}"
scale="${TD_TEST_TIMEOUT_SCALE:-1}"
limit=$(( ${TD_EXAMPLE_KILL_LIMIT:-22} * scale ))
if [[ "$method" == bare ]]; then
  kill_bare "$example" "$limit" "$scale" "$@"
  exit $?
fi
out="$(mktemp)"
launch_cmd "$method" "$tdistrun" "$example" "$@"
"${LAUNCH_CMD[@]}" >"$out" 2>&1 &
root=$!
all=()
cleanup() {
  local p
  for p in "${all[@]}" "$root"; do kill -9 "$p" 2>/dev/null || true; done
  rm -f "$out"
}
trap cleanup EXIT

# wait until rank 1 runs and training has produced output for a second
victim=""
for _ in $(seq 1 $((600 * scale))); do
  kill -0 "$root" 2>/dev/null || break
  [[ -z "$victim" ]] && victim="$(rank_pid "$method" "$root" 1 || true)"
  if [[ -n "$victim" ]] && grep -qE "epoch|loss" "$out"; then break; fi
  sleep 0.1
done
if [[ -z "$victim" ]] || ! kill -0 "$root" 2>/dev/null; then
  cat "$out"
  echo "FAIL: rank 1 never ran, or the job ended before it could be killed"
  exit 1
fi
sleep 1
mapfile -t all < <(job_pids "$method" "$root")
echo "killing rank 1 (pid $victim) of $(basename "$example") under $method"
start=$(date +%s.%N)
kill -9 "$victim"
rc=0
for _ in $(seq 1 $((limit * 20))); do
  kill -0 "$root" 2>/dev/null || break
  sleep 0.05
done
if kill -0 "$root" 2>/dev/null; then
  tail -n 20 "$out"
  echo "FAIL: the job still runs ${limit} s after rank 1 was killed"
  exit 1
fi
wait "$root" || rc=$?
took=$(python3 -c "import time; print(f'{time.time() - $start:.2f}')")
tail -n 8 "$out"
echo "the job ended with status $rc ${took} s after the kill"
if [[ $rc -eq 0 ]]; then
  echo "FAIL: the job exited 0 although rank 1 was killed"
  exit 1
fi
if ! grep -qE "rank 1([^0-9]|$)" "$out"; then
  echo "FAIL: nothing in the output names rank 1"
  exit 1
fi
left=()
for _ in $(seq 1 100); do
  left=()
  for p in "${all[@]}"; do
    if kill -0 "$p" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]]; then
      left+=("$p")
    fi
  done
  [[ ${#left[@]} -eq 0 ]] && break
  sleep 0.05
done
if [[ ${#left[@]} -ne 0 ]]; then
  echo "FAIL: processes of the job outlived it: ${left[*]}"
  exit 1
fi
echo PASS
