#!/usr/bin/env bash
# test_multihost_ps.sh - examples/param_server across three fake hosts (network namespaces made by
# scripts/netns-hosts.sh): the server (rank 0) on host 1, trainers (ranks 1, 2) on hosts 2 and 3,
# one process per host, rendezvous on 10.77.0.1, addresses chosen from the route to the master.
#
#   test_multihost_ps.sh PARAM_SERVER NETNS_HOSTS_SH
#
# 1. train: a short run; every process exits 0 and the loss falls (JSON last_loss < first_loss).
# 2. cut:   a longer run with checkpoints every 50 steps and keepalive 500 ms / 2000 ms; once the
#           first checkpoint is written, host 3 is cut off (its veth leaves the bridge). The server
#           and the trainer on host 2 must both fail naming worker2 (rank 2) within the keepalive
#           bound; the trainer on host 3 is then killed by pid and the link healed.
# 3. restart: this script plays the launcher (tdistrun per host is awkward across namespaces):
#           the three processes start again with TD_RESTART_COUNT=1, resume from the last
#           checkpoint (the server's log and JSON name the saved global step) and finish.
#
# Exit codes: 0 pass, 1 fail, 77 skip (not root, no `ip netns`, no flock). Bounded: every wait has
# a deadline scaled by TD_TEST_TIMEOUT_SCALE, after which the processes are killed by pid. The
# hosts come down on every exit (trap), and the shared lock file keeps multihost tests apart.
set -uo pipefail

PS=${1:?usage: $0 PARAM_SERVER NETNS_HOSTS_SH}
HOSTS=${2:?usage: $0 PARAM_SERVER NETNS_HOSTS_SH}
SCALE=${TD_TEST_TIMEOUT_SCALE:-1}

skip() {
  echo "SKIP: $*"
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces)"
command -v ip > /dev/null || skip "needs iproute2 (ip)"
ip netns list > /dev/null 2>&1 || skip "'ip netns' does not work here"
command -v flock > /dev/null || skip "needs flock (util-linux)"

exec 9> /tmp/td-netns-hosts.lock
flock -w $((120 * SCALE)) 9 || { echo "FAIL: another run holds /tmp/td-netns-hosts.lock"; exit 1; }

WORK=$(mktemp -d /tmp/td_multihost_ps_XXXXXX)
PIDS=()

kill_all() {
  local p
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill -KILL "$p" 2> /dev/null; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2> /dev/null; done
  PIDS=()
}
cleanup() {
  kill_all
  "$HOSTS" down || echo "WARNING: netns-hosts.sh down failed" >&2
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY grpc_proxy no_grpc_proxy
# One job secret for every worker of this run (they authenticate each other with it).
TD_RPC_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export TD_RPC_SECRET

"$HOSTS" down > /dev/null 2>&1 || true
"$HOSTS" up || { echo "FAIL: netns-hosts.sh up"; exit 1; }
routes=$(ip route show 10.77.0.0/24)
[[ "$routes" == blackhole* ]] || { echo "FAIL: no blackhole route in the root namespace"; exit 1; }

exited() {
  local st
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2> /dev/null) || return 0
  [ "$st" = Z ] || [ "$st" = X ]
}

# start NAME PORT [ENV=VALUE...] -- ARGS...: one param_server per host, pids in PIDS[0..2].
start() {
  local name=$1 port=$2 i
  shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  PIDS=()
  for i in 1 2 3; do
    "$HOSTS" exec "$i" env "${envs[@]}" RANK=$((i - 1)) LOCAL_RANK=0 WORLD_SIZE=3 \
      MASTER_ADDR=10.77.0.1 MASTER_PORT="$port" TD_LOG_LEVEL=info OMP_NUM_THREADS=1 \
      "$PS" --threads 1 "$@" > "$WORK/$name.$i.log" 2>&1 &
    PIDS+=($!)
  done
}

# wait_pids LIMIT_S PID...: waits until they all exited; 1 after LIMIT_S seconds.
wait_pids() {
  local deadline=$((SECONDS + $1)) p running
  shift
  while :; do
    running=0
    for p in "$@"; do exited "$p" || running=1; done
    [ "$running" -eq 0 ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.05
  done
}

show() {
  local i
  for i in 1 2 3; do
    echo "---- [$1] host $i (10.77.0.$i) ----"
    tr '\r' '\n' < "$WORK/$1.$i.log" | grep -v '^trainer 1 epoch .*|' | tail -n 25
  done
}
fail() {
  echo "FAIL: $*"
  exit 1
}
json_num() { # json_num FILE KEY
  grep -o "\"$2\": [-0-9.e+]*" "$1" | head -n 1 | awk '{print $2}'
}

# ---- 1. train ----
ARGS=(--epochs 1 --max-batches 150 --lr 0.05)
start train 29510 -- "${ARGS[@]}"
wait_pids $((120 * SCALE)) "${PIDS[@]}" || { show train; fail "[train] still running after $((120 * SCALE)) s"; }
for i in 1 2 3; do
  wait "${PIDS[$((i - 1))]}" || { show train; fail "[train] process on host $i failed"; }
done
PIDS=()
show train
grep -q "rpc: listen address 10.77.0.2 (interface eth0" "$WORK/train.2.log" ||
  fail "[train] trainer on host 2 did not listen on 10.77.0.2"
first=$(json_num "$WORK/train.1.log" first_loss)
last=$(json_num "$WORK/train.1.log" last_loss)
[ -n "$first" ] && [ -n "$last" ] || fail "[train] no JSON line with first_loss/last_loss"
awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < 0.8 * f) }' ||
  fail "[train] loss did not fall: first $first, last $last"
echo "PASS[train]: loss $first -> $last"

# ---- 2. cut host 3 mid-training ----
CK=$WORK/ckpt
KA_MS=500
KT_MS=2000
ARGS=(--epochs 3 --max-batches 600 --lr 0.05 --checkpoint-dir "$CK" --checkpoint-every 50
  --keepalive-ms $KA_MS --keepalive-timeout-ms $KT_MS)
start cut 29520 -- "${ARGS[@]}"
deadline=$((SECONDS + 90 * SCALE))
until grep -q "param_server: checkpoint at" "$WORK/cut.1.log" 2> /dev/null; do
  exited "${PIDS[0]}" && { show cut; fail "[cut] the server exited before its first checkpoint"; }
  [ "$SECONDS" -ge "$deadline" ] && { show cut; fail "[cut] no checkpoint within 90 s"; }
  sleep 0.02
done
ip -n td-br link set p3 nomaster
t_cut=$(date +%s.%N)
echo "cut host 3 at $t_cut"
# the server and the trainer on host 2 fail by themselves: interval + timeout + the server's
# 1 s grace, with margin
LIMIT=$((((KA_MS + KT_MS) / 1000 + 8) * SCALE))
wait_pids "$LIMIT" "${PIDS[0]}" "${PIDS[1]}" || {
  show cut
  fail "[cut] host 1/2 still running ${LIMIT} s after the cut"
}
t_fail=$(date +%s.%N)
kill -KILL "${PIDS[2]}" 2> /dev/null
rc1=0 rc2=0
wait "${PIDS[0]}" || rc1=$?
wait "${PIDS[1]}" || rc2=$?
wait "${PIDS[2]}" 2> /dev/null
PIDS=()
ip -n td-br link set p3 master br0
show cut
[ "$rc1" -ne 0 ] && [ "$rc2" -ne 0 ] || fail "[cut] expected failures, got exit codes $rc1 and $rc2"
grep -q "param_server: worker2 (rank 2) failed" "$WORK/cut.1.log" || fail "[cut] the server's error does not name worker2"
grep -q "failed: .*worker2 (rank 2)" "$WORK/cut.2.log" ||
  fail "[cut] the error of the trainer on host 2 does not name worker2"
grep -q '"bench": "param_server"' "$WORK/cut.1.log" && fail "[cut] the run finished before the cut"
echo "PASS[cut]: hosts 1 and 2 failed naming worker2 after $(awk -v a="$t_cut" -v b="$t_fail" 'BEGIN { printf "%.2f", b - a }') s"

# ---- 3. restart from the checkpoint ----
saved=$(tr '\r' '\n' < "$WORK/cut.1.log" | grep -o 'param_server: checkpoint at epoch [0-9]* step [0-9]* (global step [0-9]*)' |
  tail -n 1 | sed -E 's/.*global step ([0-9]+)\)/\1/')
[ -n "$saved" ] && [ "$saved" -gt 0 ] || fail "[restart] no checkpoint step in the server's log"
[ -f "$CK/param_server.safetensors" ] || fail "[restart] no checkpoint file"
start restart 29530 TD_RESTART_COUNT=1 -- "${ARGS[@]}"
wait_pids $((120 * SCALE)) "${PIDS[@]}" || { show restart; fail "[restart] still running after $((120 * SCALE)) s"; }
for i in 1 2 3; do
  wait "${PIDS[$((i - 1))]}" || { show restart; fail "[restart] process on host $i failed"; }
done
PIDS=()
show restart
grep -q "resuming from checkpoint .*(global step $saved), restart 1" "$WORK/restart.1.log" ||
  fail "[restart] the server did not resume from global step $saved"
resumed=$(json_num "$WORK/restart.1.log" resumed_from_global_step)
[ "$resumed" = "$saved" ] || fail "[restart] JSON resumed_from_global_step '$resumed', expected $saved"
grep -q "trainer 2: resuming at epoch" "$WORK/restart.3.log" || fail "[restart] trainer on host 3 did not resume"
acc=$(json_num "$WORK/restart.1.log" test_accuracy)
awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }' || fail "[restart] test accuracy $acc after the resumed run"
echo "PASS[restart]: resumed from global step $saved, test accuracy $acc"
echo "PASS: param_server on 3 hosts, host failure and restart from the checkpoint"
