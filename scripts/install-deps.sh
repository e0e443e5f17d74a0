#!/usr/bin/env bash
# install-deps.sh - installs every Debian package tdist needs, idempotently.
#   scripts/install-deps.sh            build + test dependencies, the Fashion-MNIST data set and
#                                      the fortunes text corpus (examples/gpt; plain text files
#                                      under /usr/share/games/fortunes); iproute2: the multihost
#                                      tests' network namespaces
#   scripts/install-deps.sh --torch    also python3-torch (PyTorch peers of the benchmarks and the
#                                      fixture generator; the library never uses it)
#   scripts/install-deps.sh --fuzz     also clang and libFuzzer (libclang-rt-dev), for
#                                      scripts/fuzz.sh
#   scripts/install-deps.sh --slurm    also Slurm and munge (slurmctld slurmd slurm-client munge),
#                                      for scripts/slurm-local.sh; no daemon is started
set -euo pipefail

pkgs=(build-essential g++ cmake pkg-config zlib1g-dev libopenblas-dev libcmocka-dev
      libgrpc-dev libprotobuf-c-dev protobuf-c-compiler dataset-fashion-mnist fortunes python3
      iproute2)
for arg in "$@"; do
  case "$arg" in
    --torch) pkgs+=(python3-torch) ;;
    --fuzz) pkgs+=(clang libclang-rt-dev) ;;
    --slurm) pkgs+=(slurmctld slurmd slurm-client munge) ;;
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
