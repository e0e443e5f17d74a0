#!/usr/bin/env bash
# test_example_ps_ft.sh TDISTRUN PARAM_SERVER - param_server --ft (a server and 2 trainers, 2
# epochs of at most 400 batches per trainer): trainer 2 (rank 2) SIGKILLed from outside once
# training is under way. Under tdistrun --tolerate-failures 1, then started bare (3 processes
# that nothing supervises, as srun without --kill-on-bad-exit leaves them), the job must go on
# and finish by itself: exit status 0 (tdistrun's, or the server's and the other trainer's), one
# line from the server naming the lost worker, the epoch and step and what it recomputes, one
# trainer lost in the JSON, every epoch's batches applied equal to what its sharding holds (the
# lost trainer's remaining batches recomputed, the next epoch re-sharded over the survivor), and
# a test accuracy that chance cannot reach. A third argument "mpirun" or "srun" replaces both by
# one run under that launcher (launch_lib.sh: mpirun --enable-recovery, srun
# --kill-on-bad-exit=0; srun skips (77) without a Slurm cluster) with the same checks. Skips (77)
# without Fashion-MNIST. Ends only the processes it started, by pid.
set -euo pipefail
tdistrun="$1"
ps="$2"
mode="${3:-all}"
data_dir="${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}"
if [[ ! -e "$data_dir/train-images-idx3-ubyte.gz" && ! -e "$data_dir/train-images-idx3-ubyte" ]]; then
  echo "SKIP: no Fashion-MNIST in $data_dir"
  exit 77
fi
# shellcheck source=launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"
scale="${TD_TEST_TIMEOUT_SCALE:-1}"
args=(--ft --epochs 2 --max-batches 400 --keepalive-ms 500)
out="$(mktemp)"
dir="$(mktemp -d)"
root=""
pids=()
cleanup() {
  local p
  if [[ -n "$root" ]]; then
    for p in $(descendants "$root") "$root"; do kill -9 "$p" 2>/dev/null || true; done
  fi
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$out" "$dir"
}
trap cleanup EXIT

# check FILE WHAT [TRAINER_FILE]: the server's line and JSON in FILE, the surviving trainer's
# re-sharded epoch in TRAINER_FILE (default FILE)
check() {
  local f="$1" what="$2" fail=0
  if ! grep -qE "param_server: worker2 \(rank 2\) lost (at epoch [0-9]+ step [0-9]+: the server recomputes batches [0-9]+\.\. of its shard 1 of 2|between epochs).*sharded over 1 trainer " "$f"; then
    echo "FAIL ($what): no line naming the lost trainer, its step and what is recomputed"
    fail=1
  fi
  if ! grep -qE "trainer 1: epoch 2 on shard 0 of 1 " "${3:-$f}"; then
    echo "FAIL ($what): the surviving trainer did not train epoch 2 on the one shard left"
    fail=1
  fi
  python3 - "$f" "$what" <<'PY' || fail=1
import json, sys
text = open(sys.argv[1]).read()
line = [l[l.find('{"bench"'):] for l in text.splitlines() if '{"bench"' in l]
if not line:
    sys.exit(f"FAIL ({sys.argv[2]}): no JSON line")
r = json.loads(line[-1])["results"]
bad = []
if r.get("ft_trainers_lost") != 1: bad.append(f"ft_trainers_lost {r.get('ft_trainers_lost')}")
if r.get("ft_trainers_at_end") != 1: bad.append(f"ft_trainers_at_end {r.get('ft_trainers_at_end')}")
if r.get("epoch_batches_applied") != r.get("epoch_batches_expected"):
    bad.append(f"batches applied {r.get('epoch_batches_applied')} vs expected {r.get('epoch_batches_expected')}")
if not r.get("test_accuracy", 0) > 0.7: bad.append(f"test_accuracy {r.get('test_accuracy')}")
if bad:
    sys.exit(f"FAIL ({sys.argv[2]}): " + "; ".join(bad))
print(f"{sys.argv[2]}: applied {r['epoch_batches_applied']} of {r['epoch_batches_expected']}, "
      f"{r['ft_batches_recomputed']} recomputed by the server, test accuracy {r['test_accuracy']:.4f}")
PY
  return $fail
}

# wait_training FILE PID: until a trainer prints progress in epoch 1 (or PID ends). The kill
# follows at once: an epoch of 400 batches lasts 0.2-0.3 s on a fast machine, and a kill that
# lands in epoch 2 leaves nothing to re-shard (a fixed 0.3 s wait after the first progress line
# did that on every run on a fast VM, epochs of 0.23 s).
wait_training() {
  for _ in $(seq 1 $((600 * scale))); do
    kill -0 "$2" 2>/dev/null || return 1
    grep -qE "epoch 1/2 \\[" "$1" && return 0
    sleep 0.02
  done
  return 1
}

if [[ "$mode" == mpirun || "$mode" == srun ]]; then
  LAUNCH_FT=1 launch_cmd "$mode" "$tdistrun" "$ps" "${args[@]}"
  "${LAUNCH_CMD[@]}" >"$out" 2>&1 &
  root=$!
  victim=""
  for _ in $(seq 1 $((600 * scale))); do
    [[ -n "$victim" ]] && break
    kill -0 "$root" 2>/dev/null || break
    victim="$(rank_pid "$mode" "$root" 2 || true)"
    sleep 0.05
  done
  mapfile -t pids < <(job_pids "$mode" "$root")
  wait_training "$out" "$root" || { cat "$out"; echo "FAIL: training never started under $mode"; exit 1; }
  [[ -n "$victim" ]] && kill -0 "$victim" 2>/dev/null || { cat "$out"; echo "FAIL: rank 2 is not running"; exit 1; }
  echo "killing rank 2 (pid $victim) under $mode"
  kill -9 "$victim"
  timeout $((180 * scale)) tail --pid="$root" -f /dev/null || true
  if kill -0 "$root" 2>/dev/null; then tail -n 20 "$out"; echo "FAIL: the job still runs"; exit 1; fi
  rc=0
  wait "$root" || rc=$?
  root=""
  grep -E "param_server: (worker|recomputed)" "$out" || true
  fail=0
  # mpirun --enable-recovery ends 0 when the survivors do; srun reports the killed task (137)
  if [[ "$mode" == mpirun && $rc -ne 0 ]]; then echo "FAIL: mpirun ended with status $rc"; fail=1; fi
  check "$out" "$mode" || fail=1
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: a lost trainer cost the server its remaining batches, under $mode (status $rc)"
  exit 0
fi

"$tdistrun" --standalone --nproc-per-node 3 --tolerate-failures 1 "$ps" "${args[@]}" >"$out" 2>&1 &
root=$!
victim=""
for _ in $(seq 1 $((600 * scale))); do
  [[ -n "$victim" ]] && break
  victim="$(rank_pid tdistrun "$root" 2 || true)"
  sleep 0.05
done
wait_training "$out" "$root" || { cat "$out"; echo "FAIL: training never started"; exit 1; }
[[ -n "$victim" ]] && kill -0 "$victim" 2>/dev/null || { cat "$out"; echo "FAIL: rank 2 is not running"; exit 1; }
echo "killing rank 2 (pid $victim) under tdistrun"
kill -9 "$victim"
rc=0
timeout $((180 * scale)) tail --pid="$root" -f /dev/null || true
if kill -0 "$root" 2>/dev/null; then tail -n 20 "$out"; echo "FAIL: the job still runs"; exit 1; fi
wait "$root" || rc=$?
root=""
grep -E "param_server: (worker|recomputed)" "$out" || true
fail=0
[[ $rc -eq 0 ]] || { echo "FAIL: tdistrun ended with status $rc"; fail=1; }
grep -q "restarting" "$out" && { echo "FAIL: the group was restarted"; fail=1; }
check "$out" tdistrun || fail=1
if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi

# started bare: three processes nothing supervises
port=$(free_port)
secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
for r in 0 1 2; do
  env RANK=$r LOCAL_RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    TD_RPC_SECRET="$secret" "$ps" "${args[@]}" >"$dir/rank$r.out" 2>&1 &
  pids+=($!)
done
wait_training "$dir/rank1.out" "${pids[1]}" || { tail -n 5 "$dir"/rank*.out; echo "FAIL: bare: training never started"; exit 1; }
kill -0 "${pids[2]}" 2>/dev/null || { tail -n 5 "$dir"/rank*.out; echo "FAIL: bare: rank 2 ended first"; exit 1; }
echo "killing rank 2 (pid ${pids[2]}), started bare"
kill -9 "${pids[2]}"
for r in 0 1; do
  rc=0
  timeout $((180 * scale)) tail --pid="${pids[$r]}" -f /dev/null || true
  if kill -0 "${pids[$r]}" 2>/dev/null; then echo "FAIL: bare: rank $r still runs"; fail=1; continue; fi
  wait "${pids[$r]}" || rc=$?
  [[ $rc -eq 0 ]] || { tail -n 5 "$dir/rank$r.out"; echo "FAIL: bare: rank $r exited $rc"; fail=1; }
done
check "$dir/rank0.out" bare "$dir/rank1.out" || fail=1
if [[ $fail -ne 0 ]]; then tail -n 20 "$dir/rank0.out"; exit 1; fi
echo "PASS: a lost trainer cost the server its remaining batches, under tdistrun and bare"
