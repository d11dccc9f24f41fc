#!/usr/bin/env bash
# Horovod 0.28.1 asks CMake for C++14 in two places; PyTorch >= 2.1 headers need
# C++17. Patching only the torch one links with duplicate Gloo symbols, so both
# are switched. Usage: patch_horovod.sh HOROVOD_SOURCE_DIR
set -euo pipefail
src=${1:?usage: patch_horovod.sh HOROVOD_SOURCE_DIR}
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
  [[ -f $f ]] || { echo "missing $f" >&2; exit 1; }
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f" || { echo "no C++ standard line to patch in $f" >&2; exit 1; }
  ! grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "C++14 still set in $f" >&2; exit 1; }
  echo "patched $f to C++17"
done
