#!/usr/bin/env bash
# gpu-bundle.sh - packs a CUDA build for a bare GPU machine that has the NVIDIA driver, the CUDA
# toolkit (cuBLAS) and NCCL but none of tdist's other libraries, no -dev packages and no network.
#
# usage: scripts/gpu-bundle.sh BUILD_DIR OUT.tar.xz
#   BUILD_DIR: a build made with TD_WITH_CUDA=ON inside the checkout (e.g. build-gpu).
# The archive holds the build (executables, libtdist, CTest files; no object files), every shared
# library its programs need that is not part of glibc, the CUDA driver, cuBLAS / cuBLASLt, NCCL or
# libstdc++ (those come from the GPU machine, whose versions are the same or newer), the
# Fashion-MNIST files, the fortunes corpus of the GPT tests (TD_GPT_CORPUS in run.sh), and
# `run.sh`. No cuDNN: the attention kernels are tdist's own. On the GPU machine, from the checkout's root (same layout as here):
#   tar -xJf OUT.tar.xz && bash gpu-bundle/run.sh     (runs scripts/test-gpu.sh on the build)
# CTest files name absolute paths: run.sh links this checkout's path on the GPU machine to the
# path it had here when the two differ.
#
# usage: scripts/gpu-bundle.sh --quick BUILD_DIR DIR [PROGRAM ...]
#   for speed work with a few minutes of device time: DIR/libs.tar.xz (the libraries and the
#   corpus, as above; made once, kept while it exists), DIR/NAME.xz for each PROGRAM (a path in
#   the build; default: bench/gpt_gpu and the CUDA test programs of the GPT's kernels), and
#   DIR/quick.sh. On the GPU machine, from the checkout's root, `bash DIR/quick.sh` unpacks them
#   to /tmp/td-quick, runs the test programs at once, then gpt_gpu at batch 16 (and its
#   --phases split); TD_NCU=1 adds Nsight Compute's time of every kernel of a one-layer step,
#   and everything goes to $OUT when set. About 20 MB + 1.5 MB a program, 20-35 s to run.
#   Programs packed by an earlier call stay in DIR (and run) until removed.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi
build=${1:?usage: gpu-bundle.sh BUILD_DIR OUT.tar.xz | --quick BUILD_DIR DIR [PROGRAM ...]}
out=${2:?usage: gpu-bundle.sh BUILD_DIR OUT.tar.xz | --quick BUILD_DIR DIR [PROGRAM ...]}
shift 2
[ -f "$build/CTestTestfile.cmake" ] || { echo "gpu-bundle.sh: $build holds no build" >&2; exit 1; }
build=$(cd "$build" && pwd)
root=$(pwd)
case "$build" in "$root"/*) ;; *) echo "gpu-bundle.sh: $build is not inside $root" >&2; exit 1 ;; esac
rel=${build#"$root"/}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/gpu-bundle/lib" "$stage/gpu-bundle/data"

if [ "$quick" = 1 ]; then
  mkdir -p "$out"
  progs=("$@")
  [ ${#progs[@]} -gt 0 ] || progs=(bench/gpt_gpu tests/gpu/test_cuda_gpt tests/gpu/test_cuda_ops
    tests/tensor_nn/test_nn_cuda tests/tensor/test_numerics_cuda)
  for p in "${progs[@]}"; do
    [ -x "$build/$p" ] || { echo "gpu-bundle.sh: no program $build/$p" >&2; exit 1; }
    xz -T0 -6 -c "$build/$p" >"$out/$(basename "$p").xz"
  done
  cp "$root/scripts/gpu-quick-run.sh" "$out/quick.sh"
  [ -f "$out/libs.tar.xz" ] && { du -sh "$out"; exit 0; }
fi

# The build without object files and archives of objects, and of the test programs only those that
# scripts/test-gpu.sh runs (the gpu-labelled tests and the four CUDA tests that also run without a
# GPU): every program links libtdist statically, about 6 MB each, and the whole build would not fit
# the 64 MiB a device session carries.
[ "$quick" = 1 ] || {
keep=$(mktemp)
ctest --test-dir "$build" -N --show-only=json-v1 -L gpu >"$keep.1"
ctest --test-dir "$build" -N --show-only=json-v1 \
  -R '^(test_cuda_devices|test_cuda_host|test_numerics|test_collectives_nccl_setup)$' >"$keep.2"
python3 - "$keep.1" "$keep.2" >"$keep" <<'PY'
import json, sys
for f in sys.argv[1:]:
    for t in json.load(open(f))["tests"]:
        for a in t.get("command", []):
            print(a)
PY
rm -f "$keep.1" "$keep.2"
tar -C "$root" --exclude='*.o' --exclude='*.a' --exclude='CMakeFiles' -cf - "$rel" |
  tar -C "$stage" -xf -
find "$stage/$rel/tests" -type f -perm -u+x | while read -r f; do
  grep -qxF "$build/${f#"$stage/$rel/"}" "$keep" || rm -f "$f"
done
rm -f "$keep"
# of the examples and benchmarks, those it runs; no Python binding
find "$stage/$rel/examples" "$stage/$rel/bench" -type f -perm -u+x 2>/dev/null | while read -r f; do
  case "${f##*/}" in train_local | param_server | hybrid | gpt | gpt_gpu) ;; *) rm -f "$f" ;; esac
done
rm -rf "$stage/$rel/python" "$stage/$rel/bindings"
}

# Shared libraries of every ELF program and library in the build.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libresolv\.so|libutil\.so|libcuda\.so|libcublas|libcublasLt|libnccl|libstdc\+\+|libgcc_s)'
find "$build" -type f \( -perm -u+x -o -name '*.so*' \) ! -path '*/CMakeFiles/*' -print0 |
  while IFS= read -r -d '' f; do
    file -b "$f" | grep -q '^ELF' || continue
    ldd "$f" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
  done | sort -u | while read -r name path; do
    if ! [[ $name =~ $skip ]]; then cp -L "$path" "$stage/gpu-bundle/lib/$name"; fi
  done

data=${TD_DATA_DIR:-/usr/share/datasets/fashion-mnist}
[ "$quick" = 1 ] || cp "$data"/*-ubyte.gz "$stage/gpu-bundle/data/"
# the GPT tests' corpus (Debian's fortunes; the GPU machine may not have the package)
fortunes=${TD_GPT_CORPUS:-/usr/share/games/fortunes}
if [ -d "$fortunes" ]; then
  mkdir -p "$stage/gpu-bundle/fortunes"
  find "$fortunes" -maxdepth 1 -type f ! -name '*.dat' -exec cp {} "$stage/gpu-bundle/fortunes/" \;
fi
if [ "$quick" = 1 ]; then
  tar -C "$stage" -cf - gpu-bundle/lib gpu-bundle/fortunes | xz -T0 -6 >"$out/libs.tar.xz"
  du -sh "$out"
  exit 0
fi

cat >"$stage/gpu-bundle/run.sh" <<EOF
#!/usr/bin/env bash
# Written by scripts/gpu-bundle.sh: runs scripts/test-gpu.sh on the packed build.
set -uo pipefail
here=\$(pwd)
if [ "\$here" != "$root" ]; then
  mkdir -p "\$(dirname "$root")" && ln -sfn "\$here" "$root"
fi
libs="\$here/gpu-bundle/lib"
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "\$d" ] && libs="\$libs:\$d"
done
for n in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  if ! ldconfig -p | grep -q "\$n" && ! ls /usr/local/cuda/lib64/\$n >/dev/null 2>&1; then
    f=\$(find /usr /opt -name "\$n" -print -quit 2>/dev/null)
    [ -n "\$f" ] && libs="\$libs:\$(dirname "\$f")"
  fi
done
export LD_LIBRARY_PATH="\$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export TD_DATA_DIR="\$here/gpu-bundle/data"
[ -d "\$here/gpu-bundle/fortunes" ] && export TD_GPT_CORPUS="\$here/gpu-bundle/fortunes"
echo "LD_LIBRARY_PATH=\$LD_LIBRARY_PATH"
missing=\$(ldd "$rel/examples/train_local" | grep 'not found' || true)
[ -z "\$missing" ] || echo "gpu-bundle: libraries not found: \$missing"
TD_PREBUILT=1 TD_BUILD_DIR="$rel" scripts/test-gpu.sh
EOF
chmod +x "$stage/gpu-bundle/run.sh"
tar -C "$stage" -cJf "$out" "$rel" gpu-bundle
du -h "$out"
