#!/usr/bin/env bash
# Build llama.cpp's own C++ server (llama-server) from the sources vendored in the
# llama-cpp-python sdist llmrun installs, with the same AMX-safe flags as
# scripts/llama-wheel.sh, so `llmrun bench --against` compares like with like.
# A benchmark step, not an install step.
#   scripts/build_llama_server.sh [OUT_DIR]      prints the path of the built binary
set -euo pipefail
VERSION=0.3.36
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
OUT=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/llmrun/llama-server-$VERSION}
BIN="$OUT/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  # The sdist from PyPI's simple index, checked against the sha256 the index gives (pip
  # download would build the package's metadata, and its build backends, first).
  INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
  link=$(curl -fsSL "$INDEX/llama-cpp-python/" | grep -o "href=\"[^\"]*llama_cpp_python-$VERSION.tar.gz#sha256=[0-9a-f]*" | head -n1)
  [ -n "$link" ] || { echo "no sdist of llama-cpp-python $VERSION in $INDEX" >&2; exit 1; }
  url=${link#href=\"}; sha=${url##*#sha256=}; url=${url%%#*}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  curl -fsSL -o "$tmp/sdist.tar.gz" "$url"
  echo "$sha  $tmp/sdist.tar.gz" | sha256sum -c --quiet >&2
  tar -xzf "$tmp/sdist.tar.gz" -C "$tmp"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$OUT/src"
fi
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$OUT/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
