#!/usr/bin/env bash
# Build llama.cpp's own C++ server (llama-server) from the sources vendored in the
# llama-cpp-python sdist llmrun installs, with llmrun's patches and the same AMX-safe flags
# as scripts/llama-wheel.sh, so `llmrun bench --against` compares like with like.
# A benchmark step, not an install step. llama-quantize comes from the same build, beside it
# (scripts/make_big_model.sh quantizes with it).
#   scripts/build_llama_server.sh [--stock] [OUT_DIR]    prints the path of the built binary
# --stock: the vendored sources as released, without llmrun's patches (the llama-server a
# user would build; the default, patched, one is the stricter comparison).
set -euo pipefail
VERSION=0.3.36
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
here=$(cd "$(dirname "$0")" && pwd)
flavour=$("$here/llama-sources.sh" --digest)
if [ "${1:-}" = "--stock" ]; then export LLAMA_STOCK=1; flavour=stock; shift; fi
OUT=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/llmrun/llama-server-$VERSION-$flavour}
BIN="$OUT/build/bin/llama-server"
if [ -x "$BIN" ] && [ -x "${BIN%/*}/llama-quantize" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  # the same sources as the engine's, llmrun's patches applied (scripts/llama-sources.sh)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$here/llama-sources.sh" "${PYTHON:-python3}" "$VERSION" "$tmp" >&2
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$OUT/src"
fi
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$OUT/build" --target llama-server llama-quantize -j "$(nproc)" >&2
echo "$BIN"
