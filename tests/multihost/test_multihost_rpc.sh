#!/usr/bin/env bash
# test_multihost_rpc.sh - three RPC workers on three fake hosts (network namespaces made by
# scripts/netns-hosts.sh), one worker per host, rendezvous on host 1 (10.77.0.1).
#
#   test_multihost_rpc.sh MH_WORKER NETNS_HOSTS_SH
#
# Two rounds: the listen address chosen from the route toward MASTER_ADDR, then from
# TD_SOCKET_IFNAME=eth0. Each worker must listen on its own host's address (10.77.0.I), see
# non-loopback addresses for its peers, call add on both, and shut down gracefully.
#
# Exit codes: 0 pass, 1 fail, 77 skip (not root, no `ip netns`, no flock) - ctest's
# SKIP_RETURN_CODE. Bounded: each round waits at most 60 s times TD_TEST_TIMEOUT_SCALE, then
# kills its workers by pid. The hosts come down on every exit (trap), and a lock file keeps two
# runs of this test (or of anything else taking the same lock) from sharing the hosts.
set -uo pipefail

WORKER=${1:?usage: $0 MH_WORKER NETNS_HOSTS_SH}
HOSTS=${2:?usage: $0 MH_WORKER NETNS_HOSTS_SH}
SCALE=${TD_TEST_TIMEOUT_SCALE:-1}
LIMIT_S=$((60 * SCALE))

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

LOGDIR=$(mktemp -d /tmp/td_multihost_XXXXXX)
PIDS=()

cleanup() {
  local p
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && kill -KILL "$p" 2> /dev/null
  done
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && wait "$p" 2> /dev/null
  done
  PIDS=()
  "$HOSTS" down || echo "WARNING: netns-hosts.sh down failed" >&2
  rm -rf "$LOGDIR"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# No proxy may redirect the workers' connections.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY grpc_proxy no_grpc_proxy
# One job secret for every worker of this run (they authenticate each other with it).
TD_RPC_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export TD_RPC_SECRET

"$HOSTS" down > /dev/null 2>&1 || true # a run killed earlier may have left hosts behind
"$HOSTS" up || { echo "FAIL: netns-hosts.sh up"; exit 1; }
routes=$(ip route show 10.77.0.0/24)
[[ "$routes" == blackhole* ]] || { echo "FAIL: no blackhole route in the root namespace"; exit 1; }

# exited PID: the process is gone or a zombie (it is our child: wait collects it after).
exited() {
  local st
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2> /dev/null) || return 0
  [ "$st" = Z ] || [ "$st" = X ]
}

# round NAME [ENV=VALUE...]: runs the three workers and checks they all succeed.
round() {
  local name=$1
  shift
  local i p rc fail=0
  PIDS=()
  for i in 1 2 3; do
    "$HOSTS" exec "$i" env "$@" RANK=$((i - 1)) WORLD_SIZE=3 MASTER_ADDR=10.77.0.1 \
      MASTER_PORT=29500 MH_EXPECT_ADDR=10.77.0.$i MH_TIMEOUT_S=$((30 * SCALE)) \
      TD_LOG_LEVEL=info "$WORKER" > "$LOGDIR/$name.$i.log" 2>&1 &
    PIDS+=($!)
  done
  local deadline=$((SECONDS + LIMIT_S))
  while :; do
    local running=0
    for p in "${PIDS[@]}"; do exited "$p" || running=$((running + 1)); done
    [ "$running" -eq 0 ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "FAIL[$name]: workers still running after ${LIMIT_S} s; killing them"
      for p in "${PIDS[@]}"; do kill -KILL "$p" 2> /dev/null; done
      fail=1
      break
    fi
    sleep 0.1
  done
  for i in 1 2 3; do
    wait "${PIDS[$((i - 1))]}"
    rc=$?
    if [ "$rc" -ne 0 ] || ! grep -q "mh_worker rank $((i - 1)): OK (listened on 10.77.0.$i:" \
      "$LOGDIR/$name.$i.log"; then
      echo "FAIL[$name]: worker on host $i exited $rc"
      fail=1
    fi
  done
  PIDS=()
  for i in 1 2 3; do
    echo "---- [$name] host $i (10.77.0.$i) ----"
    cat "$LOGDIR/$name.$i.log"
  done
  [ "$fail" -eq 0 ] || exit 1
  # the choice was logged at INFO with its reason
  grep -q "rpc: listen address 10.77.0.2 (interface eth0" "$LOGDIR/$name.2.log" || {
    echo "FAIL[$name]: the listen address choice was not logged"
    exit 1
  }
  echo "PASS[$name]"
}

round route MH_ROUND=route
round ifname TD_SOCKET_IFNAME=eth0
echo "PASS: 3 workers on 3 hosts"
