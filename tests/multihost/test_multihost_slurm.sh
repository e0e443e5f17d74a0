#!/usr/bin/env bash
# test_multihost_slurm.sh - examples/param_server under a private Slurm (scripts/slurm-local.sh):
# workers started by srun with no launcher, by srun + tdistrun, and by the README's batch script.
#
#   test_multihost_slurm.sh PARAM_SERVER TDISTRUN SLURM_LOCAL_SH [GPT_3D]
#
# 1. one node (localhost): `srun -n 3 param_server --epochs 1 --max-batches 300`, then
#    `srun -n 1 tdistrun --nproc-per-node 3 param_server ...` (tdistrun takes its options from
#    Slurm);
# 2. three nodes h1..h3 (the network namespaces of scripts/netns-hosts.sh, slurmctld on h1):
#    `srun -N 3 --ntasks-per-node=1 param_server --epochs 1`, a full epoch (938 batches per
#    trainer: 3-7 s of srun on 2 busy cores), run from inside host 1's namespace; every task must
#    listen on its own host's address; then examples/slurm/param_server.sbatch submitted with
#    sbatch (a short run, --max-batches 300; about 10 s with scheduling), which must also leave
#    its checkpoint file; then, given GPT_3D and Debian's fortunes corpus, examples/gpt_3d with
#    `srun -N 3 --ntasks-per-node=2` as pipeline 3 x tensor 2 (each host one stage, its tensor
#    pair on the host, activations between hosts): its float64 losses must equal one process's.
# Each run must exit 0 and print exactly one JSON line (one rank 0: the example must not fork
# copies of itself under srun) whose test_accuracy is above 0.7 (chance: 0.1) and whose
# last_loss is below 0.8 * first_loss. After each stop, every daemon the cluster had (pids read
# from its pid files beforehand) must have exited and its state directory be gone; after the
# three-node part, the namespaces and the blackhole route too.
#
# Exit codes: 0 pass, 1 fail, 77 skip (not root, no `ip netns`/nsenter/unshare/flock, Slurm and
# munge not installable, or a cluster of slurm-local.sh already running here). Every srun and
# batch job is bounded (120 s, scaled by TD_TEST_TIMEOUT_SCALE); both clusters are stopped on
# every exit (trap), and the lock file of the multihost tests keeps them apart. About 30 s here.
set -uo pipefail

PS=${1:?usage: $0 PARAM_SERVER TDISTRUN SLURM_LOCAL_SH}
TDISTRUN=${2:?usage: $0 PARAM_SERVER TDISTRUN SLURM_LOCAL_SH}
SL=${3:?usage: $0 PARAM_SERVER TDISTRUN SLURM_LOCAL_SH}
GPT3D=${4:-}
ROOT=$(cd "$(dirname "$SL")/.." && pwd)
SCALE=${TD_TEST_TIMEOUT_SCALE:-1}

skip() {
  echo "SKIP: $*"
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "needs root (Slurm daemons, network namespaces)"
for c in ip flock nsenter unshare timeout ss; do
  command -v "$c" > /dev/null || skip "needs $c"
done
ip netns list > /dev/null 2>&1 || skip "'ip netns' does not work here"
"$ROOT/scripts/install-deps.sh" --slurm > /dev/null 2>&1 ||
  skip "Slurm and munge cannot be installed (scripts/install-deps.sh --slurm failed)"
for c in slurmctld slurmd srun munged mungekey; do
  command -v "$c" > /dev/null || skip "$c missing after scripts/install-deps.sh --slurm"
done

exec 9> /tmp/td-netns-hosts.lock
flock -w $((120 * SCALE)) 9 || { echo "FAIL: another run holds /tmp/td-netns-hosts.lock"; exit 1; }

# Fixed state directories, so that a run killed before its trap ran (a ctest timeout) is
# cleaned up by the next one; slurm-local.sh removes only directories it marked.
ST1=/tmp/td_test_slurm_1node
ST3=/tmp/td_test_slurm_3node
WORK=$(mktemp -d /tmp/td_multihost_slurm_XXXXXX)

cleanup() {
  "$SL" stop --state "$ST1" 9>&- || echo "WARNING: slurm-local.sh stop (1 node) failed" >&2
  "$SL" stop --state "$ST3" 9>&- || echo "WARNING: slurm-local.sh stop (3 nodes) failed" >&2
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY grpc_proxy no_grpc_proxy
# srun passes the environment on: one job secret for the srun runs (the sbatch script makes its
# own, in a private file, as users do)
TD_RPC_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export TD_RPC_SECRET
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TD_SOCKET_IFNAME

"$SL" stop --state "$ST1" 9>&- > /dev/null 2>&1
"$SL" stop --state "$ST3" 9>&- > /dev/null 2>&1
if [ -f /tmp/tdist-slurm.current ] && [ -f "$(cat /tmp/tdist-slurm.current)/.tdist-slurm" ]; then
  skip "slurm-local.sh has a cluster running ($(cat /tmp/tdist-slurm.current)); stop it first"
fi

fail() {
  echo "FAIL: $*"
  exit 1
}
json_num() { # json_num FILE KEY
  grep -o "\"$2\": [-0-9.e+]*" "$1" | head -n 1 | awk '{print $2}'
}
exited() {
  local st
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2> /dev/null) || return 0
  [ "$st" = Z ] || [ "$st" = X ]
}
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }
show() { tr '\r' '\n' < "$WORK/$1.log" | grep -v 'epoch 1/1 \[' | tail -n 30; }

# start NODES STATE: starts a cluster, prints its start time.
start() {
  local t0=$EPOCHREALTIME
  "$SL" start --nodes "$1" --state "$2" 9>&- > "$WORK/start$1.log" 2>&1 || {
    cat "$WORK/start$1.log"
    fail "slurm-local.sh start --nodes $1"
  }
  echo "cluster of $1 node(s) up in $(since "$t0") s"
}

# stop STATE: stops a cluster and checks that its daemons exited and its state is gone.
stop() {
  local st=$1 f pids="" p t0=$EPOCHREALTIME
  for f in "$st/munge/munged.pid" "$st"/run/*.pid; do
    [ -f "$f" ] && pids+=" $(tr -dc '0-9' < "$f")"
  done
  [ -n "$pids" ] || fail "no pid files in $st"
  "$SL" stop --state "$st" 9>&- || fail "slurm-local.sh stop --state $st"
  echo "stopped in $(since "$t0") s"
  for p in $pids; do
    exited "$p" || fail "pid $p ($(cat "/proc/$p/comm")) still running after stop"
  done
  [ ! -e "$st" ] || fail "$st still exists after stop"
}

# sbatch_wait NAME STATE ARGS...: submits a batch job (output in NAME.log) and polls its state
# (`sbatch --wait` polls at growing intervals, up to 30 s late); returns 0 when it COMPLETED with
# exit code 0:0.
sbatch_wait() {
  local name=$1 st=$2 jid info state deadline=$((SECONDS + 120 * SCALE))
  shift 2
  jid=$(env -u TD_RPC_SECRET "$SL" run --state "$st" sbatch --parsable -o "$WORK/$name.log" "$@" 9>&-) || return 1
  jid=${jid%%;*}
  echo "submitted batch job $jid"
  while :; do
    info=$("$SL" run --state "$st" scontrol show job "$jid" 9>&- 2> /dev/null)
    state=$(grep -o 'JobState=[A-Z_]*' <<< "$info" | cut -d= -f2)
    case "$state" in
      PENDING | CONFIGURING | RUNNING | COMPLETING | "") ;;
      *) break ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
      "$SL" run --state "$st" scancel "$jid" 9>&-
      echo "batch job $jid still $state after $((120 * SCALE)) s"
      return 1
    fi
    sleep 0.2
  done
  echo "batch job $jid: $(grep -o 'JobState=[A-Z_]*\|ExitCode=[0-9:]*' <<< "$info" | tr '\n' ' ')"
  [ "$state" = COMPLETED ] && grep -q 'ExitCode=0:0' <<< "$info"
}

# run_ps NAME STATE srun|sbatch ARGS...: runs srun (or a batch job, see sbatch_wait) through
# slurm-local.sh and checks its JSON line.
run_ps() {
  local name=$1 st=$2 cmd=$3 t0=$EPOCHREALTIME rc=0
  shift 3
  if [ "$cmd" = sbatch ]; then
    sbatch_wait "$name" "$st" "$@" || rc=1
  else
    "$SL" run --state "$st" timeout -k 10 $((120 * SCALE)) srun "$@" 9>&- \
      > "$WORK/$name.log" 2>&1 || rc=$?
  fi
  local wall
  wall=$(since "$t0")
  show "$name"
  [ "$rc" -eq 0 ] || fail "[$name] $cmd exited with $rc"
  local n
  n=$(grep -c '"bench": "param_server"' "$WORK/$name.log")
  [ "$n" -eq 1 ] || fail "[$name] $n JSON lines (expected exactly one, from rank 0)"
  local acc first last
  acc=$(json_num "$WORK/$name.log" test_accuracy)
  first=$(json_num "$WORK/$name.log" first_loss)
  last=$(json_num "$WORK/$name.log" last_loss)
  if [ -z "$acc" ] || [ -z "$first" ] || [ -z "$last" ]; then
    fail "[$name] JSON line without test_accuracy/first_loss/last_loss"
  fi
  awk -v a="$acc" 'BEGIN { exit !(a > 0.7) }' || fail "[$name] test accuracy $acc (expected > 0.7)"
  awk -v f="$first" -v l="$last" 'BEGIN { exit !(l < 0.8 * f) }' ||
    fail "[$name] loss did not fall: first $first, last $last"
  echo "PASS[$name]: test accuracy $acc, loss $first -> $last, $cmd wall $wall s"
}

PSARGS=(env OMP_NUM_THREADS=1 TD_LOG_LEVEL=info "$PS" --threads 1 --epochs 1)

# ---- 1. one node ----
start 1 "$ST1"
run_ps srun1 "$ST1" srun -n 3 "${PSARGS[@]}" --max-batches 300
grep -q 'rank 2 of 3' "$WORK/srun1.log" || fail "[srun1] no worker saw world size 3 from Slurm"
run_ps tdistrun1 "$ST1" srun -n 1 env OMP_NUM_THREADS=1 TD_LOG_LEVEL=info \
  "$TDISTRUN" --nproc-per-node 3 "$PS" --threads 1 --epochs 1 --max-batches 300
grep -q 'tdistrun: under Slurm: node 0 of 1, MASTER_ADDR localhost, MASTER_PORT 2[0-9]*' \
  "$WORK/tdistrun1.log" || fail "[tdistrun1] tdistrun did not take its options from Slurm"
stop "$ST1"

# ---- 2. three nodes in network namespaces ----
start 3 "$ST3"
routes=$(ip route show 10.77.0.0/24)
[[ "$routes" == blackhole* ]] || fail "no blackhole route in the root namespace"
run_ps srun3 "$ST3" srun -l -N 3 --ntasks-per-node=1 "${PSARGS[@]}"
for i in 1 2 3; do
  grep -q "^$((i - 1)): .*rpc: listen address 10.77.0.$i (interface eth0)" "$WORK/srun3.log" ||
    fail "[srun3] task $((i - 1)) did not listen on host $i's address 10.77.0.$i"
done
# the GPT with pipeline 3 x tensor 2 over the three hosts (the tensor pairs on one host each)
if [ -n "$GPT3D" ] && [ -e /usr/share/games/fortunes ]; then
  t0=$EPOCHREALTIME
  "$SL" run --state "$ST3" timeout -k 10 $((120 * SCALE)) srun -l -N 3 --ntasks-per-node=2 \
    env OMP_NUM_THREADS=1 "$GPT3D" --dp 1 --pp 3 --tp 2 --n-layer 3 --n-head 2 --n-embd 32 \
    --block-size 16 --batch-size 6 --micro-batches 3 --steps 10 --dtype f64 --check 9>&- \
    > "$WORK/gpt3d.log" 2>&1 || { show gpt3d; fail "[gpt3d] srun exited non-zero"; }
  n=$(grep -c '"bench": "gpt_3d"' "$WORK/gpt3d.log")
  [ "$n" -eq 1 ] || { show gpt3d; fail "[gpt3d] $n JSON lines (expected one)"; }
  d=$(json_num "$WORK/gpt3d.log" max_abs_loss_diff_vs_one_process)
  awk -v d="$d" 'BEGIN { exit !(d != "" && d <= 1e-9) }' ||
    fail "[gpt3d] losses differ from one process's by $d"
  echo "PASS[gpt3d]: pp 3 x tp 2 on 3 hosts, max |loss - one process| $d, wall $(since "$t0") s"
fi
# the batch script of the README, as submitted on a real cluster (3 nodes, one task each)
PS="$PS" CKPT="$WORK/ckpt" run_ps sbatch3 "$ST3" sbatch --chdir "$WORK" --cpus-per-task=1 \
  "$ROOT/examples/slurm/param_server.sbatch" --epochs 1 --max-batches 300
[ -f "$WORK/ckpt/param_server.safetensors" ] || fail "[sbatch3] no checkpoint in $WORK/ckpt"
stop "$ST3"
ip netns list 2> /dev/null | grep -qE '^td-(h[123]|br)( |$)' && fail "namespaces left after stop"
[ -z "$(ip route show 10.77.0.0/24)" ] || fail "route for 10.77.0.0/24 left after stop"
echo "PASS: param_server under Slurm (1 node: srun, srun + tdistrun; 3 nodes: srun, sbatch${GPT3D:+, gpt_3d})"
