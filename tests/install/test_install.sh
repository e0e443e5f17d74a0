#!/usr/bin/env bash
# test_install.sh BUILD_DIR CONSUMER_SRC SCRATCH [SANITIZERS]: installs tdist from BUILD_DIR into
# SCRATCH/prefix and builds + runs the consumer with CMake's find_package and with pkg-config,
# each against the shared and the static library (a plain C program: the static library must
# bring everything it needs, the CUDA objects' libstdc++ included).
set -euo pipefail
build=$1 src=$2 scratch=$3 sanitize=${4:-}
san_flags=""
if [ -n "$sanitize" ]; then san_flags="-fsanitize=$sanitize"; fi
rm -rf "$scratch"
mkdir -p "$scratch"
cmake --install "$build" --prefix "$scratch/prefix" > "$scratch/install.log"
test -f "$scratch/prefix/include/tdist/tensor.h"
pc=$(find "$scratch/prefix" -name tdist.pc | head -n1)
test -n "$pc"
# 1. CMake package
version=$(sed -n 's/^Version: //p' "$pc")
cmake -S "$src" -B "$scratch/cmake-build" -DCMAKE_PREFIX_PATH="$scratch/prefix" \
  -DTD_EXPECT_VERSION="$version" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$san_flags" \
  > "$scratch/cmake.log"
cmake --build "$scratch/cmake-build" > "$scratch/cmake-build.log"
LD_LIBRARY_PATH="$scratch/prefix/lib:$scratch/prefix/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}" \
  "$scratch/cmake-build/consumer" | grep -q "consumer ok"
"$scratch/cmake-build/consumer_static" | grep -q "consumer ok"
! ldd "$scratch/cmake-build/consumer_static" | grep -q libtdist ||
  { echo "consumer_static links libtdist.so"; exit 1; }
# 2. pkg-config, the README's recipe: an rpath tells the program where libtdist.so is
export PKG_CONFIG_PATH="$(dirname "$pc")"
cc -std=c11 -Wall -Wextra -Werror $san_flags "$src/main.c" -o "$scratch/consumer-pc" \
  $(pkg-config --cflags --libs tdist) -Wl,-rpath,"$(pkg-config --variable=libdir tdist)"
"$scratch/consumer-pc" | grep -q "consumer ok"
# 3. pkg-config --static: the archive, with everything it needs after it
libs=$(pkg-config --static --libs tdist)
cc -std=c11 -Wall -Wextra -Werror $san_flags "$src/main.c" -o "$scratch/consumer-pc-static" \
  $(pkg-config --cflags tdist) ${libs/-ltdist/-Wl,-Bstatic -ltdist -Wl,-Bdynamic}
"$scratch/consumer-pc-static" | grep -q "consumer ok"
echo "install test passed"
