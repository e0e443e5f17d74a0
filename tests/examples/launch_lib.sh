# launch_lib.sh - how the example tests start a 3-process example (sourced).
#
#   launch_cmd METHOD TDISTRUN EXAMPLE ARGS...   sets the array LAUNCH_CMD to the command line:
#     tdistrun  tdistrun --standalone --nproc-per-node 3 --no-prefix EXAMPLE ARGS
#     self      EXAMPLE ARGS [--nproc 3]: the example forks its own workers (pipeline_split always
#               runs 3; the others take --nproc)
#     mpirun    Open MPI's mpirun -np 3 on this host, the job secret and the test's variables passed
#               on with -x; exits 77 (skip) when mpirun is missing. With LAUNCH_FT=1 also
#               --enable-recovery: a process that dies no longer aborts the job, the survivors
#               run on (for the --ft examples)
#     srun      Slurm's srun -N 1 -n 3 --kill-on-bad-exit=0 (nothing stops the survivors but
#               themselves), the job secret in the environment srun passes on; exits 77 (skip)
#               without srun or a cluster sinfo reaches (scripts/slurm-local.sh start, then
#               eval "$(scripts/slurm-local.sh env)")
#   LAUNCH_NPROC (default 3) sets the number of processes of every method but self.
#   rank_pid METHOD ROOT_PID RANK               prints the pid of that rank's process under ROOT_PID
#                                               (srun: of the job's task; empty while it does not
#                                               exist yet)
#   job_pids METHOD ROOT_PID                    prints the pids of the job's processes
#   descendants PID                             prints PID's descendants, one per line
#   kill_bare EXAMPLE LIMIT SCALE ARGS...       the bare method of test_example_kill.sh (below)
launch_cmd() {
  local method="$1" tdistrun="$2" example="$3" n="${LAUNCH_NPROC:-3}"
  shift 3
  case "$method" in
    tdistrun)
      LAUNCH_CMD=("$tdistrun" --standalone --nproc-per-node "$n" --no-prefix "$example" "$@") ;;
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
      [[ "${LAUNCH_FT:-0}" == 1 ]] && root+=(--enable-recovery)
      LAUNCH_CMD=(mpirun "${root[@]}" --oversubscribe --bind-to none -np "$n" "${pass[@]}"
                  "$example" "$@")
      ;;
    srun)
      if ! command -v srun >/dev/null || ! timeout 10 sinfo >/dev/null 2>&1; then
        echo "SKIP: no srun, or no Slurm cluster it reaches (scripts/slurm-local.sh)"
        exit 77
      fi
      : "${TD_RPC_SECRET:=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
      export TD_RPC_SECRET
      # the tasks are slurmstepd's children, not srun's: a tag in their environment finds them
      TD_LAUNCH_TAG="$$-$RANDOM$RANDOM"
      export TD_LAUNCH_TAG
      LAUNCH_CMD=(srun -N 1 -n "$n" --kill-on-bad-exit=0 "$example" "$@")
      ;;
    *) echo "launch_lib: unknown launch method '$method'" >&2; exit 2 ;;
  esac
}

# free_port prints a port on 127.0.0.1 free a moment ago, below the ephemeral range
# (tests/common/free_port.py: a port-0 bind beside could take one from that range first).
LAUNCH_LIB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
free_port() { python3 "$LAUNCH_LIB_DIR/../common/free_port.py"; }

descendants() {
  local p
  for p in $(pgrep -P "$1" || true); do
    echo "$p"
    descendants "$p"
  done
}

# tagged_tasks [RANK]: the pids of the srun tasks (slurmstepd's children) carrying this test's
# TD_LAUNCH_TAG (of that SLURM_PROCID only, when given).
tagged_tasks() {
  local s p vars
  for s in $(pgrep -x slurmstepd || true); do
    for p in $(pgrep -P "$s" || true); do
      # read whole first: grep -q quitting early would fail a pipe under pipefail
      vars=$( { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null) || continue
      grep -qx "TD_LAUNCH_TAG=$TD_LAUNCH_TAG" <<<"$vars" || continue
      if grep -qx "SLURM_PROCID=${1:-[0-9]*}" <<<"$vars"; then echo "$p"; fi
    done
  done
}

job_pids() {
  if [[ "$1" == srun ]]; then tagged_tasks; else descendants "$2"; fi
}

# The rank of a worker process: RANK (tdistrun) or OMPI_COMM_WORLD_RANK in its initial
# environment; for self-forked workers (no such variable) the order of the fork: the root is
# rank 0, its children ranks 1, 2, ... by pid; for srun's tasks SLURM_PROCID.
rank_pid() {
  local method="$1" root="$2" want="$3" p
  if [[ "$method" == srun ]]; then
    tagged_tasks "$want" | head -n 1
    return
  fi
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

# kill_bare EXAMPLE LIMIT SCALE ARGS...: the bare case of test_example_kill.sh. Starts ranks 0..2
# of EXAMPLE as unsupervised processes (RANK, WORLD_SIZE, a free MASTER_PORT and a job secret in
# their environments, each output in a file of its own), SIGKILLs rank 1 once training is under
# way and checks each survivor: gone within LIMIT s, non-zero, its output naming rank 1.
# Returns 0 (PASS) or 1; ends only the processes it started, by pid.
kill_bare() {
  local example="$1" limit="$2" scale="$3"
  shift 3
  local port dir r
  port=$(free_port)
  dir=$(mktemp -d)
  local secret
  secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  local pids=()
  for r in 0 1 2; do
    env RANK=$r LOCAL_RANK=$r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
      TD_RPC_SECRET="$secret" "$example" "$@" >"$dir/rank$r.out" 2>&1 &
    pids+=($!)
  done
  # shellcheck disable=SC2064
  trap "for p in ${pids[*]}; do kill -9 \$p 2>/dev/null || true; done; rm -rf '$dir'" EXIT
  for _ in $(seq 1 $((600 * scale))); do
    grep -qE "epoch|loss" "$dir"/rank*.out && break
    kill -0 "${pids[1]}" 2>/dev/null || break
    sleep 0.1
  done
  sleep 1
  if ! kill -0 "${pids[1]}" 2>/dev/null; then
    tail -n 5 "$dir"/rank*.out
    echo "FAIL: rank 1 ended before it could be killed"
    return 1
  fi
  echo "killing rank 1 (pid ${pids[1]}) of $(basename "$example"), started bare"
  local start
  start=$(date +%s.%N)
  kill -9 "${pids[1]}"
  local fail=0 rc took
  for r in 0 2; do
    for _ in $(seq 1 $((limit * 20))); do
      kill -0 "${pids[$r]}" 2>/dev/null || break
      sleep 0.05
    done
    tail -n 4 "$dir/rank$r.out"
    if kill -0 "${pids[$r]}" 2>/dev/null; then
      echo "FAIL: rank $r still runs ${limit} s after rank 1 was killed"
      fail=1
      continue
    fi
    rc=0
    wait "${pids[$r]}" || rc=$?
    took=$(python3 -c "import time; print(f'{time.time() - $start:.2f}')")
    echo "rank $r ended with status $rc by ${took} s after the kill"
    if [[ $rc -eq 0 ]]; then
      echo "FAIL: rank $r exited 0 although rank 1 was killed"
      fail=1
    fi
    # rank 0 (the coordinator) must name rank 1; rank 2 names rank 1 too, or rank 0 when rank 0
    # stopped first and its exit reached rank 2 before rank 1's did (nothing supervises a bare
    # job, and which of the two news arrives first is a race)
    if grep -qE "rank 1([^0-9]|$)" "$dir/rank$r.out"; then
      continue
    elif [[ $r -ne 0 ]] && grep -qE "rank 1([^0-9]|$)" "$dir/rank0.out" &&
      grep -qE "rank 0([^0-9]|$)" "$dir/rank$r.out"; then
      echo "rank $r learned of the failure from rank 0's stop (rank 0 names rank 1)"
    else
      echo "FAIL: nothing in rank $r's output names rank 1"
      fail=1
    fi
  done
  [[ $fail -eq 0 ]] && echo PASS
  return $fail
}
