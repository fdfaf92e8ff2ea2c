#!/usr/bin/env bash
# Build (once) and install llama-cpp-python with flags that are safe on this CPU.
#
# Why this exists: a default build of llama.cpp uses -march=native, and on these machines the
# CPU advertises AMX while AMX instructions fault, so the first matmul dies with SIGILL.
# pip's wheel cache is keyed by version only, never by CMAKE_ARGS, so it would happily reuse
# an unsafe wheel. We keep our own cache keyed by version, flags, Python tag, CPU flags and
# llmrun's patches to llama.cpp (scripts/llama-sources.sh applies them).
#
# Usage: scripts/llama-wheel.sh PYTHON   (installs into that interpreter's environment)
set -euo pipefail

PY=${1:-python3}
VERSION=0.3.36
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# GGML_RPC: llama.cpp's RPC backend, for `llmrun rpc-worker` and LLMRUN_RPC_WORKERS (a model
# split over several hosts); it adds a small library and nothing to a local model's path.
SAFE_CMAKE_ARGS="-DCMAKE_C_FLAGS=\"$NOAMX\" -DCMAKE_CXX_FLAGS=\"$NOAMX\" -DGGML_RPC=ON"
CMAKE_ARGS_ALL="${SAFE_CMAKE_ARGS} ${LLMRUN_EXTRA_CMAKE_ARGS:-}"

here=$(cd "$(dirname "$0")" && pwd)
pytag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cpuflags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)
# llmrun's patches to the vendored llama.cpp (scripts/llama-patches) are part of the build
patches=$("$here/llama-sources.sh" --digest)
key=$(printf '%s\n%s\n%s\n%s\n%s\n' "$VERSION" "$CMAKE_ARGS_ALL" "$pytag" "$cpuflags" "$patches" \
  | sha256sum | cut -c1-16)
cache_root=${LLMRUN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmrun/wheels}
cache="$cache_root/llama-cpp-python-$VERSION-$pytag-$key"

# The marker records the hash of the CPU backend library this script installed and the key
# of the flags it was built with: a later `pip install --force-reinstall llama-cpp-python`
# (an unsafe default build) changes the library, and a change of flags here (GGML_RPC) the
# key, so the check fails and the right wheel is installed again.
if "$PY" - "$VERSION" "$key" <<'PYEOF' 2>/dev/null; then
import hashlib, importlib.metadata as md, pathlib, sys
d = md.distribution("llama-cpp-python")
lib = pathlib.Path(d.locate_file("llama_cpp/lib/libggml-cpu.so"))
marker = pathlib.Path(d.locate_file("llama_cpp/.llmrun-safe-build")).read_text().split()
ok = d.version == sys.argv[1] and marker[:1] == [hashlib.sha256(lib.read_bytes()).hexdigest()] \
    and sys.argv[2] in marker
sys.exit(0 if ok else 1)
PYEOF
  echo "llama-cpp-python $VERSION (safe build) already installed"
  exit 0
fi

if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "Building llama-cpp-python $VERSION without AMX (one time, ~7 min on 2 cores)..."
  tmp=$(mktemp -d "$cache_root.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$cache_root"; mktemp -d "$cache_root.tmp.XXXXXX"; })
  trap 'rm -rf "$tmp"' EXIT
  "$here/llama-sources.sh" "$PY" "$VERSION" "$tmp/src"
  CMAKE_ARGS="$CMAKE_ARGS_ALL" FORCE_CMAKE=1 "$PY" -m pip wheel --no-deps --no-cache-dir \
    -w "$tmp" "$tmp/src/llama_cpp_python-$VERSION"
  rm -rf "$tmp/src"
  mkdir -p "$cache_root"
  # Rename is atomic: a concurrent or interrupted build never leaves a half-written cache entry.
  mv -T "$tmp" "$cache" 2>/dev/null || rm -rf "$tmp"
  trap - EXIT
fi

wheel=$(ls "$cache"/llama_cpp_python-*.whl | head -n1)
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" - "$key" "$patches" <<'PYEOF'
import hashlib, importlib.metadata as md, pathlib, sys
d = md.distribution("llama-cpp-python")
lib = pathlib.Path(d.locate_file("llama_cpp/lib/libggml-cpu.so"))
digest = hashlib.sha256(lib.read_bytes()).hexdigest()
pathlib.Path(d.locate_file("llama_cpp/.llmrun-safe-build")).write_text(
    f"{digest} {sys.argv[1]} patches={sys.argv[2]} libggml-cpu.so built without AMX by"
    " scripts/llama-wheel.sh\n")
PYEOF
echo "installed $wheel"
