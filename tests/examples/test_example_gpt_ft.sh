#!/usr/bin/env bash
# test_example_gpt_ft.sh TDISTRUN GPT [DP [tdistrun|mpirun|srun|accum|scale|spares|join]] - gpt --dp DP --ft (DP: ddp, td_ft_ddp,
# the default; zero1, zero2 or zero3, td_ft_zero) under tdistrun with 4 workers, float64: a run without failure, then the same run with rank 2's process SIGKILLed from
# outside once training is under way (at whatever step and phase it is in). The second run must
# finish (tdistrun --tolerate-failures 1: exit status 0, no restart), print one line naming the
# lost worker and the step, and end with the same parameters, bit for bit (results.params_hash),
# and the same validation loss. Then once more started bare (4 unsupervised processes, as srun
# without --kill-on-bad-exit leaves them): every survivor exits 0 by itself, same parameters.
# With ZeRO the line also names the optimizer blocks that moved. zero3 first checks that its
# failure-free parameters are zero2's bit for bit and that a kill in the middle of a forward
# (rank 2 injected after its first block gather of step 5) ends with them too. A fourth argument "tdistrun"
# leaves out the bare start; "mpirun" or "srun" replaces both kill runs by one under that launcher
# (launch_lib.sh: mpirun --enable-recovery, srun --kill-on-bad-exit=0; srun skips (77) without a
# Slurm cluster), where the survivors must finish by themselves with the same line and the same
# parameters. "accum" instead: gradient accumulation, --grad-accum 2 (each member's shard of a
# step is 2 micro-batches, reduced once), 12 steps, rank 2 killed by the fault injector
# (--ft-inject 2:5:before:kill, after computing its shard of step 5, before the reduction) under
# tdistrun: the survivors recompute its shard, both micro-batches, and end with the failure-free
# run's parameters bit for bit; that run's parameters differ from --grad-accum 1's (the option
# is in force). "scale": loss scaling, float16 compute from a scale of 2^24 (the first steps
# overflow and are skipped while the scale backs off), 12 steps, with rank 2's group closed
# after the reduction (ddp: it is healed from a member that committed, scaler state included)
# or after the vote (zero: rolled forward) of skipped step 3, and rank 3 killed before the
# reduction of step 9: the same parameters, skipped steps and final scale as the failure-free
# run; and float32 --loss-scale dynamic trains the parameters of --loss-scale none (the step
# unscales exactly). "spares" (ddp, zero1, zero2, zero3): --spares, workers waiting outside the
# group: with none lost the spare is released and the result is unchanged; under tdistrun (5
# workers, 1 spare) rank 2 killed before the reduction of step 5, and started bare (4 + 2
# spares) with rank 1 killed during step 3 and rank 2 after step 7's reduction: each lost
# member is replaced by a spare healed from the survivors (the line names both; 4 members at the
# end), parameters bit for bit the failure-free run's. "join" (ddp, zero2): an elastic job,
# tdistrun --nnodes 1:2: node 0 starts the group with 4 workers (--wait-spares 1), node 1 is
# started after it with one worker, which joins the running group (rank 4) and stands by as a
# spare; rank 2 killed before the reduction of step 5 is replaced by it, healed from the
# survivors: both nodes' tdistrun exit 0, the lines name the lost worker and the joiner, 4
# members at the end, parameters bit for bit the failure-free run's. Skips (77) without the
# corpus. Ends only the processes it started, by pid.
set -euo pipefail
tdistrun="$1"
gpt="$2"
dp="${3:-ddp}"
mode="${4:-all}"
corpus=/usr/share/games/fortunes
if [[ ! -e "$corpus" ]]; then
  echo "SKIP: no $corpus"
  exit 77
fi
# shellcheck source=launch_lib.sh
source "$(dirname "$0")/launch_lib.sh"
scale="${TD_TEST_TIMEOUT_SCALE:-1}"
args=(--dp "$dp" --ft --dtype f64 --n-layer 2 --n-head 2 --n-embd 32 --block-size 16
      --batch-size 4 --steps 250 --eval-interval 1000 --eval-iters 2 --bucket-mb 0.05)
[[ "$mode" == accum ]] && args+=(--steps 12 --grad-accum 2)
[[ "$mode" == spares || "$mode" == join ]] && args+=(--steps 12)
[[ "$mode" == scale ]] && args+=(--steps 12 --dtype f16 --loss-scale dynamic --loss-scale-init 16777216)
base="$(mktemp)"
out="$(mktemp)"
root=""
cleanup() {
  local p
  if [[ -n "$root" ]]; then
    for p in $(descendants "$root") "$root"; do kill -9 "$p" 2>/dev/null || true; done
  fi
  rm -f "$base" "$out"
}
trap cleanup EXIT
hash_of() { grep -o '"params_hash": "[0-9a-f]*"' "$1" | head -n 1; }
val_of() { grep -o '"val_loss": [0-9.e+-]*' "$1" | head -n 1; }

if [[ "$mode" == mpirun || "$mode" == srun ]]; then
  # before the failure-free run: skips (77) without the launcher or its cluster
  LAUNCH_NPROC=4 LAUNCH_FT=1 launch_cmd "$mode" "$tdistrun" "$gpt" "${args[@]}"
fi
timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 "$gpt" "${args[@]}" >"$base" 2>&1
h0="$(hash_of "$base")"
[[ -n "$h0" ]] || { cat "$base"; echo "FAIL: no params_hash in the failure-free run"; exit 1; }

# check_line FILE: the lowest survivor's line naming the lost worker, its step, what moved
check_line() {
  local ok=0
  if ! grep -qE "gpt: step [0-9]+, generation 0: .*worker2 \(rank 2\).*lost: worker2 \(rank 2\); generation 1 formed with 3 of 4 members.*re-sharded: shard 2 -> .*committed" "$1"; then
    echo "FAIL: no line naming the lost worker, the step and the re-sharded shard"
    ok=1
  fi
  if [[ "$dp" != ddp ]] && ! grep -qE "gpt: step [0-9]+, .*optimizer blocks: block [0-9]+ -> .*committed" "$1"; then
    echo "FAIL: no line naming the optimizer blocks that moved"
    ok=1
  fi
  return $ok
}

if [[ "$dp" == zero3 ]]; then
  # stage 3 (the blocks' parameters sharded too) trains zero2's parameters, bit for bit; and a
  # kill in the middle of a forward (rank 2 dies after its first block gather of step 5, the
  # others' gathers fail) ends with them too
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 "$gpt" "${args[@]}" \
    --dp zero2 >"$out" 2>&1 || { tail -n 20 "$out"; echo "FAIL: the zero2 run"; exit 1; }
  h2="$(hash_of "$out")"
  [[ "$h2" == "$h0" ]] || { echo "FAIL: zero3's parameters ($h0) are not zero2's ($h2)"; exit 1; }
  rc=0
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 --tolerate-failures 1 \
    "$gpt" "${args[@]}" --ft-inject 2:5:unit_gather:kill >"$out" 2>&1 || rc=$?
  grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" || true
  fail=0
  [[ $rc -eq 0 ]] || { echo "FAIL: the job ended with status $rc"; fail=1; }
  check_line "$out" || fail=1
  grep -qE "gpt: step 5, .*ft_zero stage 3: gathering units" "$out" ||
    { echo "FAIL: the failure at step 5 is not seen in a block's gather"; fail=1; }
  h1="$(hash_of "$out")"
  [[ "$h1" == "$h0" ]] || { echo "FAIL: mid-forward kill: $h1, not $h0"; fail=1; }
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: zero3 = zero2 ($h0), and with rank 2 killed mid-forward"
fi

if [[ "$mode" == accum ]]; then
  one="$(mktemp)"
  if ! timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 "$gpt" "${args[@]}" \
      --grad-accum 1 >"$one" 2>&1; then
    tail -n 20 "$one"
    rm -f "$one"
    echo "FAIL: --grad-accum 1"
    exit 1
  fi
  h_one="$(hash_of "$one")"
  rm -f "$one"
  rc=0
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 --tolerate-failures 1 \
    "$gpt" "${args[@]}" --ft-inject 2:5:before:kill >"$out" 2>&1 || rc=$?
  grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" || true
  fail=0
  [[ $rc -eq 0 ]] || { echo "FAIL: the job ended with status $rc"; fail=1; }
  check_line "$out" || fail=1
  grep -qE "gpt: step 5, " "$out" || { echo "FAIL: the failure is not at step 5"; fail=1; }
  h1="$(hash_of "$out")"
  if [[ "$h1" != "$h0" ]]; then
    echo "FAIL: --grad-accum 2: parameters differ from the failure-free run ($h1 vs $h0)"
    fail=1
  fi
  if [[ -z "$h_one" || "$h_one" == "$h0" ]]; then
    echo "FAIL: --grad-accum 1 gives no hash, or the hash of --grad-accum 2 ($h_one)"
    fail=1
  fi
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: --grad-accum 2: $h1 with and without the kill (--grad-accum 1: $h_one)"
  exit 0
fi

if [[ "$mode" == spares ]]; then
  # spares (--spares S: the last S workers wait outside the group): one joins in place of each
  # lost member, healed from the survivors, and the run ends with the failure-free parameters
  fail=0
  joined_of() { grep -o '"ft_joined_workers": [0-9]*, .*"ft_members_at_end": [0-9]*' "$1" |
                sed 's/"ft_steps_with_failure.*"ft_members_at_end"/"ft_members_at_end"/'; }
  # no failure: the spare is released, everybody shuts down gracefully
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 5 "$gpt" "${args[@]}" \
    --spares 1 >"$out" 2>&1 || { tail -n 20 "$out"; echo "FAIL: --spares 1 without failure"; exit 1; }
  [[ "$(hash_of "$out")" == "$h0" ]] || { echo "FAIL: a spare standing by changed the result"; fail=1; }
  # tdistrun, rank 2 killed before the reduction of step 5: worker4 joins
  rc=0
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 5 --tolerate-failures 1 \
    "$gpt" "${args[@]}" --spares 1 --ft-inject 2:5:before:kill >"$out" 2>&1 || rc=$?
  grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" || true
  [[ $rc -eq 0 ]] || { echo "FAIL: the job ended with status $rc"; fail=1; }
  grep -qE "gpt: step 5, .*lost: worker2 \(rank 2\); joined \(a spare\): worker4 \(rank 4\); generation 1 formed with 4 of 4 members" "$out" ||
    { echo "FAIL: no line naming the lost worker and the spare that joined"; fail=1; }
  [[ "$(joined_of "$out")" == '"ft_joined_workers": 1, "ft_members_at_end": 4' ]] ||
    { echo "FAIL: spares joined / members at the end: $(joined_of "$out")"; fail=1; }
  h1="$(hash_of "$out")"
  [[ "$h1" == "$h0" ]] || { echo "FAIL: with a spare healed in: $h1, not $h0"; fail=1; }
  # started bare with two spares: rank 1 killed during step 3, rank 2 after step 7's reduction
  rc=0
  timeout $((120 * scale)) "$gpt" "${args[@]}" --nproc 4 --spares 2 \
    --ft-inject 1:3:during:kill,2:7:after:kill >"$out" 2>&1 || rc=$?
  grep -E "^gpt: step" "$out" | cut -c1-200 || true
  [[ $rc -eq 0 ]] || { echo "FAIL: the bare job ended with status $rc"; fail=1; }
  [[ "$(joined_of "$out")" == '"ft_joined_workers": 2, "ft_members_at_end": 4' ]] ||
    { echo "FAIL: bare: spares joined / members at the end: $(joined_of "$out")"; fail=1; }
  h2="$(hash_of "$out")"
  [[ "$h2" == "$h0" ]] || { echo "FAIL: bare, two spares healed in: $h2, not $h0"; fail=1; }
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: spares: $h0 without failure, with one spare and with two healed in"
  exit 0
fi

if [[ "$mode" == join ]]; then
  # an elastic job over two "nodes" of this host: node 1's worker joins the running group
  fail=0
  export TD_RPC_SECRET="${TD_RPC_SECRET:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
  port="$(free_port)"
  id="gpt-join-$$"
  out1="$(mktemp)"
  rc0=0
  timeout $((120 * scale)) "$tdistrun" --nnodes 1:2 --node-rank 0 --nproc-per-node 4 \
    --master-port "$port" --rdzv-id "$id" --tolerate-failures 1 "$gpt" "${args[@]}" \
    --wait-spares 1 --ft-inject 2:5:before:kill >"$out" 2>&1 &
  root=$!
  rc1=0
  timeout $((120 * scale)) "$tdistrun" --nnodes 1:2 --node-rank 1 --nproc-per-node 1 \
    --master-port "$port" --rdzv-id "$id" "$gpt" "${args[@]}" >"$out1" 2>&1 || rc1=$?
  wait "$root" || rc0=$?
  root=""
  grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" | cut -c1-250 || true
  cut -c1-250 "$out1"
  [[ $rc0 -eq 0 && $rc1 -eq 0 ]] || { echo "FAIL: node 0 ended with $rc0, node 1 with $rc1"; fail=1; }
  grep -qE "gpt: step 5, .*lost: worker2 \(rank 2\); joined \(a spare\): worker4 \(rank 4\); generation 1 formed with 4 of 4 members" "$out" ||
    { echo "FAIL: no line naming the lost worker and the joiner"; fail=1; }
  grep -qE "^\[node1\.0\]: gpt: worker4 \(rank 4\) joined generation 1 as a spare before step 5" "$out1" ||
    { echo "FAIL: the joiner did not say it joined"; fail=1; }
  joined="$(grep -o '"ft_joined_workers": [0-9]*' "$out" | head -n 1), $(grep -o '"ft_members_at_end": [0-9]*' "$out" | head -n 1)"
  [[ "$joined" == '"ft_joined_workers": 1, "ft_members_at_end": 4' ]] ||
    { echo "FAIL: joined / members at the end: $joined"; fail=1; }
  h1="$(hash_of "$out")"
  [[ "$h1" == "$h0" ]] || { echo "FAIL: with a joiner healed in: $h1, not $h0"; fail=1; }
  rm -f "$out1"
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: join: $h0 without failure and with a worker of a node that joined the running job"
  exit 0
fi

if [[ "$mode" == scale ]]; then
  skipped_of() { grep -o '"skipped_steps": [0-9]*, "loss_scale": [0-9.e+]*' "$1" | head -n 1; }
  if [[ "$dp" == ddp ]]; then inject=2:3:after:close,3:9:before:kill
  else inject=2:3:after_vote:close,3:9:before:kill; fi
  rc=0
  timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 --tolerate-failures 1 \
    "$gpt" "${args[@]}" --ft-inject "$inject" >"$out" 2>&1 || rc=$?
  grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" || true
  fail=0
  [[ $rc -eq 0 ]] || { echo "FAIL: the job ended with status $rc"; fail=1; }
  # the close is seen at step 3 (zero) or 4 (ddp: the others committed 3 and fail the next)
  [[ "$(grep -cE "gpt: step (3|4|9), " "$out")" -eq 2 ]] ||
    { echo "FAIL: not one failure line at step 3 or 4 and one at step 9"; fail=1; }
  h1="$(hash_of "$out")"
  s0="$(skipped_of "$base")"
  if [[ "$h1" != "$h0" || "$(skipped_of "$out")" != "$s0" ]]; then
    echo "FAIL: parameters or skips differ ($h1, $(skipped_of "$out") vs $h0, $s0)"
    fail=1
  fi
  [[ "$s0" =~ \"skipped_steps\":\ [1-9] ]] || { echo "FAIL: no step skipped ($s0)"; fail=1; }
  for ls in none dynamic; do
    timeout $((120 * scale)) "$tdistrun" --standalone --nproc-per-node 4 "$gpt" "${args[@]}" \
      --dtype f32 --loss-scale "$ls" >"$out" 2>&1 || { tail -n 20 "$out"; echo "FAIL: f32 $ls"; exit 1; }
    eval "h_$ls=\"\$(hash_of \"\$out\")\""
  done
  # shellcheck disable=SC2154
  if [[ -z "$h_none" || "$h_none" != "$h_dynamic" ]]; then
    echo "FAIL: float32: --loss-scale dynamic gives $h_dynamic, none $h_none"
    fail=1
  fi
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: loss scaling: $h1, $s0 with and without the faults; f32 dynamic = none"
  exit 0
fi

if [[ "$mode" == mpirun || "$mode" == srun ]]; then
  # gpt started by Open MPI's mpirun or Slurm's srun, 4 processes, rank 2 SIGKILLed mid-training
  "${LAUNCH_CMD[@]}" >"$out" 2>&1 &
  root=$!
  tasks=()
  # shellcheck disable=SC2317
  cleanup_launch() {
    local p
    if [[ -n "$root" ]]; then
      for p in $(descendants "$root") "$root"; do kill -9 "$p" 2>/dev/null || true; done
    fi
    for p in "${tasks[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    rm -f "$base" "$out"
  }
  trap cleanup_launch EXIT
  victim=""
  for _ in $(seq 1 $((600 * scale))); do
    kill -0 "$root" 2>/dev/null || break
    [[ -z "$victim" ]] && victim="$(rank_pid "$mode" "$root" 2 || true)"
    if [[ -n "$victim" ]] && grep -q "loss" "$out"; then break; fi
    sleep 0.05
  done
  if [[ -z "$victim" ]] || ! kill -0 "$root" 2>/dev/null; then
    cat "$out"
    echo "FAIL: rank 2 never ran under $mode, or the job ended before it could be killed"
    exit 1
  fi
  mapfile -t tasks < <(job_pids "$mode" "$root")
  sleep 0.3
  echo "killing rank 2 (pid $victim) under $mode"
  kill -9 "$victim"
  timeout $((120 * scale)) tail --pid="$root" -f /dev/null || true
  if kill -0 "$root" 2>/dev/null; then
    tail -n 20 "$out"
    echo "FAIL: the job still runs 120 s after the kill"
    exit 1
  fi
  rc=0
  wait "$root" || rc=$?
  root=""
  grep -E "gpt: step" "$out" || true
  fail=0
  # mpirun --enable-recovery ends 0 when the survivors do; srun reports the killed task (137)
  if [[ "$mode" == mpirun && $rc -ne 0 ]]; then echo "FAIL: mpirun ended with status $rc"; fail=1; fi
  check_line "$out" || fail=1
  h1="$(hash_of "$out")"
  if [[ "$h1" != "$h0" ]]; then
    echo "FAIL: $mode: parameters differ from the failure-free run ($h1 vs $h0)"
    fail=1
  fi
  if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
  echo "PASS: $h1 with and without the kill, under $mode (status $rc)"
  exit 0
fi

"$tdistrun" --standalone --nproc-per-node 4 --tolerate-failures 1 "$gpt" "${args[@]}" >"$out" 2>&1 &
root=$!
victim=""
for _ in $(seq 1 $((600 * scale))); do
  kill -0 "$root" 2>/dev/null || break
  [[ -z "$victim" ]] && victim="$(rank_pid tdistrun "$root" 2 || true)"
  if [[ -n "$victim" ]] && grep -q "loss" "$out"; then break; fi
  sleep 0.05
done
if [[ -z "$victim" ]] || ! kill -0 "$root" 2>/dev/null; then
  cat "$out"
  echo "FAIL: rank 2 never ran, or the job ended before it could be killed"
  exit 1
fi
sleep 0.3
echo "killing rank 2 (pid $victim)"
kill -9 "$victim"
rc=0
for _ in $(seq 1 $((120 * scale * 20))); do
  kill -0 "$root" 2>/dev/null || break
  sleep 0.05
done
if kill -0 "$root" 2>/dev/null; then
  tail -n 20 "$out"
  echo "FAIL: the job still runs 120 s after the kill"
  exit 1
fi
wait "$root" || rc=$?
root=""
grep -E "^\[[0-9]+\]: gpt: step|tdistrun:" "$out" || true
fail=0
[[ $rc -eq 0 ]] || { echo "FAIL: the job ended with status $rc"; fail=1; }
check_line "$out" || fail=1
if grep -q "restarting" "$out"; then echo "FAIL: the group was restarted"; fail=1; fi
h1="$(hash_of "$out")"
if [[ "$h1" != "$h0" ]]; then
  echo "FAIL: parameters differ from the failure-free run ($h1 vs $h0)"
  fail=1
fi
if [[ "$(val_of "$out")" != "$(val_of "$base")" ]]; then
  echo "FAIL: validation loss differs ($(val_of "$out") vs $(val_of "$base"))"
  fail=1
fi
if [[ $fail -ne 0 ]]; then tail -n 30 "$out"; exit 1; fi
echo "tdistrun: $h1 with and without the kill"
if [[ "$mode" == tdistrun ]]; then
  echo "PASS: $h1 with and without the kill, under tdistrun"
  exit 0
fi

# The same started bare (4 processes that nothing supervises, as srun without
# --kill-on-bad-exit leaves them): the survivors finish by themselves, exit 0, same parameters.
port=$(free_port)
dir=$(mktemp -d)
secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
pids=()
for r in 0 1 2 3; do
  env RANK=$r LOCAL_RANK=$r WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    TD_RPC_SECRET="$secret" "$gpt" "${args[@]}" >"$dir/rank$r.out" 2>&1 &
  pids+=($!)
done
# shellcheck disable=SC2064
trap "for p in ${pids[*]}; do kill -9 \$p 2>/dev/null || true; done; rm -rf '$dir' '$base' '$out'" EXIT
for _ in $(seq 1 $((600 * scale))); do
  grep -q "loss" "$dir/rank0.out" && break
  kill -0 "${pids[2]}" 2>/dev/null || break
  sleep 0.05
done
sleep 0.3
kill -0 "${pids[2]}" 2>/dev/null || { tail -n 5 "$dir"/rank*.out; echo "FAIL: rank 2 ended first"; exit 1; }
echo "killing rank 2 (pid ${pids[2]}), started bare"
kill -9 "${pids[2]}"
for r in 0 1 3; do
  rc=0
  timeout $((120 * scale)) tail --pid="${pids[$r]}" -f /dev/null || true
  if kill -0 "${pids[$r]}" 2>/dev/null; then echo "FAIL: rank $r still runs"; fail=1; continue; fi
  wait "${pids[$r]}" || rc=$?
  [[ $rc -eq 0 ]] || { tail -n 5 "$dir/rank$r.out"; echo "FAIL: rank $r exited $rc"; fail=1; }
done
grep -E "gpt: step" "$dir"/rank*.out || true
h2="$(hash_of "$dir/rank0.out")"
if [[ "$h2" != "$h0" ]]; then
  echo "FAIL: bare: parameters differ from the failure-free run ($h2 vs $h0)"
  fail=1
fi
if [[ $fail -ne 0 ]]; then tail -n 20 "$dir/rank0.out"; exit 1; fi
echo "PASS: $h2 with and without the kill, under tdistrun and bare"
