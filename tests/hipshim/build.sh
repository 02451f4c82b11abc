#!/usr/bin/env bash
# Build the CUDA-backed libamdhip64.so into DIR (default: tests/hipshim/build), where it runs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/build}"
mkdir -p "$out"
gcc -shared -fPIC -O2 -Wall -Werror -o "$out/libamdhip64.so" "$here/hipshim.c" -ldl -lpthread
echo "$out/libamdhip64.so"
