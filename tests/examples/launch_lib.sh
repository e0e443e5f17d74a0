# launch_lib.sh - how the example tests start a 3-process example (sourced).
#
#   launch_cmd METHOD TDISTRUN EXAMPLE ARGS...   sets the array LAUNCH_CMD to the command line:
#     tdistrun  tdistrun --standalone --nproc-per-node 3 --no-prefix EXAMPLE ARGS
#     self      EXAMPLE ARGS [--nproc 3]: the example forks its own workers (pipeline_split always
#               runs 3; the others take --nproc)
#     mpirun    Open MPI's mpirun -np 3 on this host, the job secret and the test's variables passed
#               on with -x; exits 77 (skip) when mpirun is missing
#   rank_pid METHOD ROOT_PID RANK               prints the pid of that rank's process under ROOT_PID
#                                               (empty while it does not exist yet)
#   descendants PID                             prints PID's descendants, one per line
launch_cmd() {
  local method="$1" tdistrun="$2" example="$3"
  shift 3
  case "$method" in
    tdistrun) LAUNCH_CMD=("$tdistrun" --standalone --nproc-per-node 3 --no-prefix "$example" "$@") ;;
    self)
      LAUNCH_CMD=("$example" "$@")
      [[ "$(basename "$example")" == pipeline_split ]] || LAUNCH_CMD+=(--nproc 3)
      ;;
    mpirun)
      if ! command -v mpirun >/dev/null; then
        echo "SKIP: no mpirun (install openmpi-bin)"
        exit 77
      fi
      : "${TD_RPC_SECRET:=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
      export TD_RPC_SECRET
      local pass=(-x TD_RPC_SECRET -x OPENBLAS_NUM_THREADS=1)
      local v
      for v in TD_DATA_DIR TD_TEST_TIMEOUT_SCALE TD_LOG_LEVEL; do
        [[ -n "${!v:-}" ]] && pass+=(-x "$v")
      done
      local root=()
      [[ "$(id -u)" == 0 ]] && root=(--allow-run-as-root)
      LAUNCH_CMD=(mpirun "${root[@]}" --oversubscribe --bind-to none -np 3 "${pass[@]}"
                  "$example" "$@")
      ;;
    *) echo "launch_lib: unknown launch method '$method'" >&2; exit 2 ;;
  esac
}

descendants() {
  local p
  for p in $(pgrep -P "$1" || true); do
    echo "$p"
    descendants "$p"
  done
}

# The rank of a worker process: RANK (tdistrun) or OMPI_COMM_WORLD_RANK in its initial
# environment; for self-forked workers (no such variable) the order of the fork: the root is
# rank 0, its children ranks 1, 2, ... by pid.
rank_pid() {
  local method="$1" root="$2" want="$3" p
  if [[ "$method" == self ]]; then
    if [[ "$want" == 0 ]]; then echo "$root"; return; fi
    { pgrep -P "$root" || true; } | sort -n | sed -n "${want}p"
    return
  fi
  for p in $(descendants "$root"); do
    if tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxE "(RANK|OMPI_COMM_WORLD_RANK)=$want"; then
      echo "$p"
      return
    fi
  done
}
