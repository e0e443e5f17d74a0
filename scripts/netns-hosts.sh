#!/usr/bin/env bash
# netns-hosts.sh - three fake hosts on this machine, as network namespaces, for multi-host tests.
#
#   scripts/netns-hosts.sh up              create hosts td-h1..td-h3
#   scripts/netns-hosts.sh down            remove everything it made (idempotent)
#   scripts/netns-hosts.sh exec HOST CMD.. run CMD inside HOST (1, 2, 3, h1, td-h1, ...)
#   scripts/netns-hosts.sh status          list what exists
#
# Layout (the facts behind it: docs/MULTIHOST.md):
#   - td-br: a namespace holding only the "switch", bridge br0, with one veth port pI per host;
#   - td-hI (I = 1..3): loopback up, eth0 = 10.77.0.I/24 (veth to pI), /etc/hosts naming the
#     hosts h1..h3 (ip netns exec bind-mounts /etc/netns/td-hI/hosts over /etc/hosts).
# The root namespace gets no bridge, veth or address, only a blackhole route for 10.77.0.0/24,
# added before anything else and removed last: a packet sent from the root namespace toward the
# fake hosts would otherwise follow the default route and leave the machine.
#
# Safety: traffic never leaves the machine (the hosts' only link is the bridge, which has no
# uplink; the root namespace blackholes the subnet). `down` ends the processes still inside the
# hosts' namespaces - processes that were started there through this script - by pid (SIGTERM,
# then SIGKILL after 2 s), and only then deletes the namespaces (deleting a namespace does not
# end its processes). Needs root and iproute2.
set -Eeuo pipefail

SUBNET=10.77.0.0/24
PREFIX=10.77.0
HOSTS=(td-h1 td-h2 td-h3)
BRNS=td-br

die() {
  echo "netns-hosts: $*" >&2
  exit 1
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root"
  command -v ip > /dev/null || die "needs iproute2 (ip)"
}

ns_exists() {
  local all
  all=$(ip netns list 2> /dev/null | awk '{print $1}')
  grep -qx -- "$1" <<< "$all"
}

# gone PID: the process has exited (absent, or a zombie: state Z in /proc/PID/stat).
gone() {
  local st
  st=$(sed -E 's/^.*\) (.).*$/\1/' "/proc/$1/stat" 2> /dev/null) || return 0
  [ "$st" = Z ] || [ "$st" = X ]
}

# stop_pids NS: ends the processes inside namespace NS, by pid.
stop_pids() {
  local pids p i
  pids=$(ip netns pids "$1" 2> /dev/null || true)
  [ -n "$pids" ] || return 0
  for p in $pids; do kill -TERM "$p" 2> /dev/null || true; done
  for i in $(seq 1 20); do
    local left=""
    for p in $pids; do gone "$p" || left="$left $p"; done
    [ -n "$left" ] || return 0
    sleep 0.1
  done
  for p in $pids; do gone "$p" || kill -KILL "$p" 2> /dev/null || true; done
}

cmd_down() {
  need_root
  local ns i
  for ns in "${HOSTS[@]}" "$BRNS"; do
    if ns_exists "$ns"; then
      stop_pids "$ns"
      ip netns del "$ns"
    fi
  done
  for ns in "${HOSTS[@]}"; do rm -rf "/etc/netns/$ns"; done
  # Our blackhole route last, once nothing can send into the subnet any more.
  local routes
  routes=$(ip route show "$SUBNET" 2> /dev/null || true)
  if grep -q '^blackhole' <<< "$routes"; then
    ip route del blackhole "$SUBNET"
  fi
  return 0
}

cmd_up() {
  need_root
  for ns in "${HOSTS[@]}" "$BRNS"; do
    ns_exists "$ns" && die "namespace $ns already exists: run '$0 down' first"
  done
  # Refuse to shadow a real network of the root namespace.
  local addrs routes
  addrs=$(ip -4 addr show)
  routes=$(ip route show "$SUBNET")
  if grep -q "inet $PREFIX\." <<< "$addrs"; then die "$SUBNET is in use on this machine"; fi
  if [ -n "$routes" ] && grep -qv '^blackhole' <<< "$routes"; then
    die "the root namespace already routes $SUBNET somewhere"
  fi
  ip route replace blackhole "$SUBNET"
  trap 'echo "netns-hosts: up failed; cleaning up" >&2; cmd_down' ERR

  ip netns add "$BRNS"
  ip -n "$BRNS" link set lo up
  ip -n "$BRNS" link add br0 type bridge
  ip -n "$BRNS" link set br0 up
  local i ns
  for i in 1 2 3; do
    ns=${HOSTS[$((i - 1))]}
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$BRNS"
    ip -n "$BRNS" link set "p$i" master br0
    ip -n "$BRNS" link set "p$i" up
    ip -n "$ns" addr add "$PREFIX.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    mkdir -p "/etc/netns/$ns"
    {
      echo "127.0.0.1 localhost"
      echo "::1 localhost ip6-localhost ip6-loopback"
      for j in 1 2 3; do echo "$PREFIX.$j h$j td-h$j"; done
    } > "/etc/netns/$ns/hosts"
  done
  trap - ERR
}

host_ns() {
  case "$1" in
    1 | h1 | td-h1) echo td-h1 ;;
    2 | h2 | td-h2) echo td-h2 ;;
    3 | h3 | td-h3) echo td-h3 ;;
    *) die "unknown host '$1' (use 1, 2 or 3)" ;;
  esac
}

cmd_exec() {
  need_root
  [ $# -ge 2 ] || die "usage: $0 exec HOST CMD [ARGS...]"
  local ns
  ns=$(host_ns "$1")
  shift
  ns_exists "$ns" || die "host $ns is not up"
  # exec: the caller's $! is CMD's pid (ip netns exec execs CMD in place).
  exec ip netns exec "$ns" "$@"
}

cmd_status() {
  local ns
  for ns in "$BRNS" "${HOSTS[@]}"; do
    if ns_exists "$ns"; then
      echo "$ns: up $(ip -n "$ns" -4 -br addr show dev eth0 2> /dev/null | awk '{print $3}')"
    else
      echo "$ns: absent"
    fi
  done
  ip route show "$SUBNET" | sed 's/^/root route: /'
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  exec)
    shift
    cmd_exec "$@"
    ;;
  status) cmd_status ;;
  *)
    echo "usage: $0 up|down|status|exec HOST CMD [ARGS...]" >&2
    exit 2
    ;;
esac
