#!/usr/bin/env bash
# Unpack llama-cpp-python's sdist and apply llmrun's patches to the llama.cpp it vendors
# (scripts/llama-patches/*.patch, in name order), so the engine (llama-wheel.sh) and the
# benchmark's llama-server (build_llama_server.sh) compile the same C++.
#
# Why patches at all: a few hot paths of llama.cpp's CPU kernels cost llmrun's defaults more
# than they cost llama.cpp's own server; each patch says what it changes and what it measured,
# and is small enough to carry to the next version (as Ollama carries its llama.cpp patches).
# A patch leaves results unchanged to the last bit unless its caller asks for a change it
# names (0003: a lower row count for flash attention's tiled path, around chosen decodes).
#
# Usage: scripts/llama-sources.sh PYTHON VERSION DEST   (unpacks DEST/llama_cpp_python-VERSION)
#        scripts/llama-sources.sh --digest                (what the patches are, for cache keys)
# LLAMA_STOCK=1 unpacks the sources as released, without the patches (a benchmark's stock
# llama-server, build_llama_server.sh --stock).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
patches=("$here"/llama-patches/*.patch)
[ -e "${patches[0]}" ] && [ "${LLAMA_STOCK:-0}" != 1 ] || patches=()
if [ "${1:-}" = "--digest" ]; then
  { for p in "${patches[@]}"; do basename "$p"; cat "$p"; done; } | sha256sum | cut -c1-16
  exit 0
fi
PY=$1 VERSION=$2 DEST=$3
# pip checks the file against the sha256 its index gives for it
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
  -d "$DEST/sdist" "llama-cpp-python==$VERSION"
tar -xzf "$DEST/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
for p in "${patches[@]}"; do
  # --fuzz=0: a patch that no longer applies exactly fails the build instead of landing
  # somewhere near its place
  patch -p1 --forward --fuzz=0 --quiet -d "$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp" < "$p"
done
