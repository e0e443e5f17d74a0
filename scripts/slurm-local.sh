#!/usr/bin/env bash
# slurm-local.sh - a private Slurm cluster on this machine, for trying tdist under srun and for the
# multihost tests. Debian's slurmctld/slurmd/munge, run as root with every file under one state
# directory in /tmp; nothing in /etc is changed and no system service is touched.
#
#   scripts/slurm-local.sh start [--nodes 1|3] [--state DIR]   start a cluster (default 1 node)
#   scripts/slurm-local.sh stop [--state DIR]                  stop it and remove its state
#   scripts/slurm-local.sh status [--state DIR]                daemons and sinfo
#   scripts/slurm-local.sh env [--state DIR]                   prints the environment plain srun
#                                                              needs: `export SLURM_CONF=...` and
#                                                              a new job secret, TD_RPC_SECRET
#                                                              (use: eval "$(... env)")
#   scripts/slurm-local.sh run [--state DIR] CMD [ARGS...]     runs a client (srun, sinfo, ...)
#                                                              where it can reach the cluster
#                                                              (in this environment: srun needs
#                                                              TD_RPC_SECRET from env's output;
#                                                              sbatch scripts make their own)
# Example:
#   scripts/slurm-local.sh start --nodes 3
#   eval "$(scripts/slurm-local.sh env)"
#   scripts/slurm-local.sh run srun -N 3 --ntasks-per-node=1 build/examples/param_server --epochs 1
#   scripts/slurm-local.sh stop
#
# Layout. --nodes 1: node "localhost" (127.0.0.1) runs slurmctld and slurmd. --nodes 3: the hosts
# of scripts/netns-hosts.sh (network namespaces; their names and addresses are read from its
# `status`) become nodes h1..h3; slurmctld runs in host 1's namespace and one slurmd in each.
# Daemons enter a namespace with `nsenter --net` plus `unshare --mount --uts` (own hostname hI,
# the host's /etc/hosts bind-mounted); `ip netns exec` would remount /sys, and slurmd cannot
# initialise its cgroup plugin without /sys/fs/cgroup. Clients must run inside host 1's
# namespace too (the root namespace blackholes the hosts' subnet): use `run`. One munged serves
# every node (a unix socket crosses network namespaces). Each node claims 8 CPUs
# (SlurmdParameters=config_overrides), so `srun -n 8` fits on a 2-core machine.
# See docs/MULTIHOST.md for the measured facts behind these choices.
#
# State. start makes DIR (default: a new /tmp/tdist-slurm.XXXXXX; a given DIR must not exist or
# be empty) holding slurm.conf, the munge key and socket, pid files, logs and spool, marks it with
# a .tdist-slurm file and records it in /tmp/tdist-slurm.current, which stop, status, env and run
# use when --state is not given. Only one cluster at a time per machine is supported.
#
# stop ends only what start started: it cancels the cluster's jobs and waits for them, ends the
# slurmstepd processes serving its spool directory, then slurmd, slurmctld and munged by the pids
# in their pid files (checking each pid's command name; SIGTERM, SIGKILL after 5 s; a zombie
# counts as exited), brings the namespaces down when start brought them up, and removes DIR (only
# when it carries the marker). It is idempotent, and a failed start runs it before exiting.
# Packages come from scripts/install-deps.sh --slurm (installed only when missing).
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NETNS_HOSTS=$ROOT/scripts/netns-hosts.sh
CURRENT=/tmp/tdist-slurm.current
LOCK=/tmp/tdist-slurm.lock
MARK=.tdist-slurm

die() {
  echo "slurm-local: $*" >&2
  exit 1
}
log() { echo "slurm-local: $*" >&2; }

usage() {
  sed -n '/^#   scripts/p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2
  exit 2
}

# gone PID: the process has exited (absent, or a zombie: state Z/X in /proc/PID/stat).
gone() {
  local st
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2> /dev/null) || return 0
  [ "$st" = Z ] || [ "$st" = X ]
}

# stop_pid PID COMM [SIG]: SIG (default TERM) to PID if it is alive and named COMM, SIGKILL
# after 5 s.
stop_pid() {
  local pid=$1 comm=$2 sig=${3:-TERM} i
  [[ "$pid" =~ ^[0-9]+$ ]] || return 0
  gone "$pid" && return 0
  [ "$(cat "/proc/$pid/comm" 2> /dev/null)" = "$comm" ] || return 0
  kill -"$sig" "$pid" 2> /dev/null || true
  if [ "$sig" != KILL ]; then
    for i in $(seq 1 50); do
      gone "$pid" && return 0
      sleep 0.1
    done
    log "$comm ($pid) ignored SIG$sig; SIGKILL"
    kill -KILL "$pid" 2> /dev/null || true
  fi
  for i in $(seq 1 20); do
    gone "$pid" && return 0
    sleep 0.1
  done
  log "WARNING: $comm ($pid) still there after SIGKILL"
}

# descendants PID: the pids of every process below PID (by parent links).
descendants() {
  ps -e -o pid= -o ppid= | awk -v root="$1" '
    { parent[$1] = $2 }
    END {
      for (p in parent) {
        q = parent[p]
        while (q != root && q in parent && q > 1) q = parent[q]
        if (q == root) print p
      }
    }'
}

pidfile_pid() { { tr -dc '0-9' < "$1"; } 2> /dev/null || true; }

# daemon CMD...: starts a daemon (it forks itself into the background) with no file descriptor of
# ours but /dev/null for stdin and stdout and its start-up log for stderr, so it holds no lock of
# this script's or of its callers' and no pipe a caller waits on.
daemon() {
  (
    for fd in "/proc/$BASHPID/fd"/*; do
      fd=${fd##*/}
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    "$@" < /dev/null > /dev/null 2>> "$S/log/start.log"
  )
}

# ---- state directory ----

S=""       # the state directory
NODES=""   # 1 or 3
STATE_ARG=""

resolve_state() { # sets S from --state or the record; returns 1 when there is none
  if [ -n "$STATE_ARG" ]; then
    S=$STATE_ARG
  elif [ -f "$CURRENT" ]; then
    S=$(cat "$CURRENT")
  else
    return 1
  fi
  [ -d "$S" ] && [ -f "$S/$MARK" ] || return 1
  NODES=$(sed -n 's/^nodes=//p' "$S/$MARK")
  return 0
}

# ---- namespaces (--nodes 3) ----

NS=()    # namespace of host I at NS[I-1]
ADDR=()  # its address

read_hosts() { # fills NS and ADDR from `netns-hosts.sh status` ("td-h1: up 10.77.0.1/24")
  NS=()
  ADDR=()
  local name state addr
  while read -r name state addr; do
    if [ "$state" != up ] || [ -z "$addr" ]; then continue; fi
    NS+=("${name%:}")
    ADDR+=("${addr%/*}")
  done < <("$NETNS_HOSTS" status 2> /dev/null | grep -v '^root route')
  [ "${#NS[@]}" -eq 3 ] || return 1
}

# in_host I CMD...: runs CMD in host I's network namespace with its own mount and UTS namespaces:
# hostname hI and the host's /etc/hosts (see the header for why not `ip netns exec`).
in_host() {
  local i=$1
  shift
  local ns=${NS[$((i - 1))]}
  # shellcheck disable=SC2016 # the inner shell expands $1, $2 and $@
  nsenter --net="/run/netns/$ns" unshare --mount --uts -- /bin/sh -c \
    'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    sh "/etc/netns/$ns/hosts" "h$i" "$@"
}

# client CMD...: runs a Slurm client where it reaches the controller.
client() {
  if [ "$NODES" = 3 ]; then
    read_hosts || {
      log "the namespaces of the 3-node cluster are gone"
      return 1
    }
    SLURM_CONF=$S/slurm.conf in_host 1 "$@"
  else
    SLURM_CONF=$S/slurm.conf "$@"
  fi
}

# ---- start ----

free_port() { # free_port FIRST: the first TCP port from FIRST on that nothing listens on
  local p=$1
  while [ -n "$(ss -Htln "sport = :$p" 2> /dev/null)" ]; do p=$((p + 1)); done
  echo "$p"
}

write_conf() { # write_conf CTLD_NAME CTLD_ADDR CTLD_PORT SLURMD_PORT NODE_LINES NODE_LIST
  cat > "$S/slurm.conf" << EOF
# written by scripts/slurm-local.sh; removed by its stop
ClusterName=tdist
SlurmctldHost=$1($2)
SlurmctldPort=$3
SlurmdPort=$4
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$S/munge/munge.sock
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
KillWait=5
StateSaveLocation=$S/spool/ctld
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdSpoolDir=$S/spool/%n
SlurmdPidFile=$S/run/slurmd-%n.pid
SlurmdLogFile=$S/log/slurmd-%n.log
$5
PartitionName=debug Nodes=$6 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
}

# wait_idle N: waits up to 30 s for N nodes in state idle.
wait_idle() {
  local want=$1 i n=0
  for i in $(seq 1 300); do
    n=$(client sinfo -h -N -o '%T' 2> /dev/null | grep -c '^idle$' || true)
    [ "$n" -eq "$want" ] && return 0
    sleep 0.1
  done
  client sinfo -N >&2 || true
  return 1
}

start_failed() {
  trap - ERR
  log "start failed; cleaning up (logs follow)"
  local f
  for f in "$S"/log/*.log; do
    [ -f "$f" ] || continue
    echo "---- $f" >&2
    tail -n 15 "$f" >&2
  done
  do_stop || true
}

cmd_start() {
  [ "$(id -u)" -eq 0 ] || die "needs root (daemons run as root; --nodes 3 makes namespaces)"
  case "$NODES" in 1 | 3) ;; *) die "--nodes must be 1 or 3" ;; esac
  if [ -f "$CURRENT" ] && [ -f "$(cat "$CURRENT")/$MARK" ]; then
    die "a cluster is already recorded in $CURRENT ($(cat "$CURRENT")); run '$0 stop' first"
  fi
  "$ROOT/scripts/install-deps.sh" --slurm > /dev/null || die "cannot install Slurm and munge"
  local cmd
  for cmd in slurmctld slurmd srun sinfo scancel squeue munged mungekey nsenter unshare ss; do
    command -v "$cmd" > /dev/null || die "$cmd not found"
  done
  if [ -n "$STATE_ARG" ]; then
    S=$STATE_ARG
    [ ! -e "$S" ] || [ -z "$(ls -A "$S")" ] || die "--state $S exists and is not empty"
    mkdir -p "$S"
  else
    S=$(mktemp -d /tmp/tdist-slurm.XXXXXX)
  fi
  S=$(cd "$S" && pwd)
  chmod 755 "$S"
  echo "nodes=$NODES" > "$S/$MARK"
  echo "$S" > "$CURRENT"
  trap 'start_failed; exit 1' ERR

  mkdir -p "$S/munge" "$S/keys" "$S/log" "$S/run" "$S/spool/ctld"
  chmod 755 "$S/munge" # munged: the socket's directory must be o+x
  chmod 700 "$S/keys"  # and the key's directory private, the key 0400
  mungekey --create --keyfile="$S/keys/munge.key"
  chmod 400 "$S/keys/munge.key"
  daemon munged --socket="$S/munge/munge.sock" --key-file="$S/keys/munge.key" \
    --log-file="$S/log/munged.log" --pid-file="$S/munge/munged.pid" \
    --seed-file="$S/keys/munged.seed"

  local i
  if [ "$NODES" = 1 ]; then
    local cport dport
    cport=$(free_port 6817)
    dport=$(free_port $((cport + 1)))
    write_conf localhost 127.0.0.1 "$cport" "$dport" \
      "NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN" localhost
    daemon slurmctld -f "$S/slurm.conf"
    daemon slurmd -f "$S/slurm.conf" -N localhost
  else
    "$NETNS_HOSTS" up
    touch "$S/netns"
    read_hosts || false
    local nodes=""
    for i in 1 2 3; do
      nodes+="NodeName=h$i NodeAddr=${ADDR[$((i - 1))]} CPUs=8 State=UNKNOWN"$'\n'
    done
    write_conf h1 "${ADDR[0]}" 6817 6818 "$nodes" "h[1-3]"
    daemon in_host 1 slurmctld -f "$S/slurm.conf"
    for i in 1 2 3; do daemon in_host "$i" slurmd -f "$S/slurm.conf" -N "h$i"; done
  fi
  wait_idle "$NODES"
  trap - ERR
  log "$NODES node(s) idle; state in $S"
  print_env
}

# new_secret prints a new random job secret (64 hex characters): srun starts no launcher that
# could make one, and tdist refuses a group without one (docs/SECURITY.md).
new_secret() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }

# print_env prints the environment a plain srun in this shell needs.
print_env() {
  echo "export SLURM_CONF=$S/slurm.conf"
  echo "export TD_RPC_SECRET=$(new_secret)"
}

# ---- stop ----

# stepd_pids: pids of the slurmstepd processes listening on unix sockets under our spool
# directory (ss lists the sockets of one network namespace: with 3 nodes, each host's).
stepd_pids() {
  local ns
  {
    if [ "$NODES" = 3 ]; then
      if read_hosts; then
        for ns in "${NS[@]}"; do nsenter --net="/run/netns/$ns" ss -Hxlp 2> /dev/null || true; done
      fi
    else
      ss -Hxlp 2> /dev/null || true
    fi
  } | awk -v d="$S/spool/" 'index($5, d) == 1' |
    grep -o 'slurmstepd",pid=[0-9]*' | sed 's/.*pid=//' | sort -u || true
}

do_stop() {
  local i p
  local ctld
  ctld=$(pidfile_pid "$S/run/slurmctld.pid")
  if [ -n "$ctld" ] && ! gone "$ctld"; then
    # cancel every job of this cluster and wait (up to 15 s) until none is left
    local jobs=""
    jobs=$(client squeue -h -o '%A' 2> /dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      client scancel $jobs 2> /dev/null || true
      for i in $(seq 1 150); do
        jobs=$(client squeue -h -o '%A' 2> /dev/null || true)
        [ -z "$jobs" ] && break
        sleep 0.1
      done
    fi
  fi
  # steps left over (the controller was gone, or a step would not end): their tasks, then them
  # (slurmstepd ignores SIGTERM)
  local q
  for p in $(stepd_pids); do
    for q in $(descendants "$p"); do kill -KILL "$q" 2> /dev/null || true; done
    stop_pid "$p" slurmstepd KILL
  done
  local f
  for f in "$S"/run/slurmd-*.pid; do
    [ -f "$f" ] && stop_pid "$(pidfile_pid "$f")" slurmd
  done
  stop_pid "$ctld" slurmctld
  stop_pid "$(pidfile_pid "$S/munge/munged.pid")" munged
  if [ -f "$S/netns" ]; then
    "$NETNS_HOSTS" down
    rm -f "$S/netns"
  fi
  [ -f "$S/$MARK" ] && rm -rf "$S"
  if [ -f "$CURRENT" ] && [ "$(cat "$CURRENT")" = "$S" ]; then rm -f "$CURRENT"; fi
  return 0
}

cmd_stop() {
  if ! resolve_state; then
    [ -f "$CURRENT" ] && [ -z "$STATE_ARG" ] && rm -f "$CURRENT"
    log "no cluster to stop"
    return 0
  fi
  do_stop
  log "stopped; removed $S"
}

# ---- status, env, run ----

cmd_status() {
  resolve_state || {
    echo "no cluster"
    return 0
  }
  echo "state: $S ($NODES node(s))"
  local f name pid
  for f in "$S/munge/munged.pid" "$S/run/slurmctld.pid" "$S"/run/slurmd-*.pid; do
    [ -f "$f" ] || continue
    name=$(basename "$f" .pid)
    pid=$(pidfile_pid "$f")
    if [ -n "$pid" ] && ! gone "$pid"; then echo "$name: running (pid $pid)"; else echo "$name: gone"; fi
  done
  client sinfo -N || true
}

cmd_env() {
  resolve_state || die "no cluster (run '$0 start')"
  print_env
  if [ "$NODES" = 3 ]; then
    echo "# 3 nodes: clients must run in host 1's namespace: $0 run srun ..."
  fi
}

cmd_run() {
  [ $# -ge 1 ] || die "usage: $0 run [--state DIR] CMD [ARGS...]"
  resolve_state || die "no cluster (run '$0 start')"
  client "$@"
}

# ---- main ----

[ $# -ge 1 ] || usage
CMD=$1
shift
NODES=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes)
      [ "$CMD" = start ] || usage
      NODES=${2:?--nodes needs a value}
      shift 2
      ;;
    --state)
      STATE_ARG=${2:?--state needs a directory}
      shift 2
      ;;
    -h | --help) usage ;;
    *) break ;;
  esac
done

case "$CMD" in
  start | stop)
    [ $# -eq 0 ] || usage
    [ "$(id -u)" -eq 0 ] || die "needs root (daemons run as root; --nodes 3 makes namespaces)"
    { exec 8> "$LOCK"; } 2> /dev/null || die "cannot open $LOCK"
    flock -w 60 8 || die "another slurm-local.sh holds $LOCK"
    "cmd_$CMD"
    ;;
  status)
    [ $# -eq 0 ] || usage
    cmd_status
    ;;
  env)
    [ $# -eq 0 ] || usage
    cmd_env
    ;;
  run) cmd_run "$@" ;;
  *) usage ;;
esac
