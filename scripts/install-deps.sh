#!/usr/bin/env bash
# install-deps.sh - installs every Debian package tdist needs, idempotently.
#   scripts/install-deps.sh            build + test dependencies (libdnnl-dev: oneDNN, the bfloat16
#                                      GEMM of CPU autocast), the Fashion-MNIST data set and
#                                      the fortunes text corpus (examples/gpt; plain text files
#                                      under /usr/share/games/fortunes); iproute2: the multihost
#                                      tests' network namespaces; Open MPI: the examples' launch
#                                      matrix and the collectives' MPI peer; python3-matplotlib:
#                                      scripts/plot.py, tested on the examples' metrics files;
#                                      python3-cffi/-dev/-numpy/-pytest/-venv: the Python binding,
#                                      its tests and its wheel check
#   scripts/install-deps.sh --torch    also python3-torch (PyTorch peers of the benchmarks, the
#                                      fixture generator, the binding's torch tests and its
#                                      param_server example; the library never uses it) and
#                                      ucx-utils (ucx_perftest, a floor peer of rpc_latency)
#   scripts/install-deps.sh --fuzz     also clang and libFuzzer (libclang-rt-dev), for
#                                      scripts/fuzz.sh
#   scripts/install-deps.sh --slurm    also Slurm and munge (slurmctld slurmd slurm-client munge),
#                                      for scripts/slurm-local.sh; no daemon is started
#   scripts/install-deps.sh --mpi      accepted for old scripts (Open MPI is a test dependency now)
set -euo pipefail

pkgs=(build-essential g++ cmake pkg-config zlib1g-dev libopenblas-dev libdnnl-dev libcmocka-dev
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler libssl-dev dataset-fashion-mnist fortunes
      python3 python3-h2 openssl iproute2 openmpi-bin libopenmpi-dev python3-matplotlib
      python3-cffi python3-dev python3-numpy python3-pytest python3-venv)
for arg in "$@"; do
  case "$arg" in
    --torch) pkgs+=(python3-torch ucx-utils) ;;
    --fuzz) pkgs+=(clang libclang-rt-dev) ;;
    --slurm) pkgs+=(slurmctld slurmd slurm-client munge) ;;
    --mpi) ;;
    *) echo "install-deps.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
