#!/usr/bin/env bash
# Build (once) and install llama-cpp-python with flags that are safe on this CPU.
#
# Why this exists: a default build of llama.cpp uses -march=native, and on these machines the
# CPU advertises AMX while AMX instructions fault, so the first matmul dies with SIGILL.
# pip's wheel cache is keyed by version only, never by CMAKE_ARGS, so it would happily reuse
# an unsafe wheel. We keep our own cache keyed by version, flags, Python tag, CPU flags and
# llmrun's patches to llama.cpp (scripts/llama-sources.sh applies them).
#
# The backend (LLMRUN_BACKEND, part of the cache key): `cpu`; `cuda` (NVIDIA GPUs, built with
# the CUDA 13 toolkit from PyPI's wheels, installed in a build-only directory of the cache);
# `vulkan` (llama.cpp's Vulkan backend, built from Debian's packages: any GPU with a Vulkan
# driver, and Mesa's CPU driver lavapipe, which the tests use); `auto` (the default): CUDA
# where an NVIDIA driver new enough for CUDA 13 is present, else Vulkan where a GPU's Vulkan
# driver and the build packages are present, else the CPU, so a machine without a GPU builds
# exactly the CPU library. A backend that cannot be built here is not: the script says why
# (the apt-get line that installs Vulkan's packages; the driver CUDA 13 needs) and builds
# the next one.
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
# What is built (part of the cache key): llama-cpp-python turns on llama.cpp's `common`
# library (argument parsing, model downloads, an HTTP client), which nothing the Python
# package loads uses (it loads libllama, libggml* and libmtmd). Measured on a 2-core build:
# common and its cpp-httplib were 40% of the compile (300 of 746 compiler-seconds).
TRIM="no-common"
# Compiler-seconds of the trimmed compile on one core of the machine it was measured on (a
# 2-core AMD EPYC VM, 2026-12): the first estimate of how long the build takes here,
# refined from the build's own pace as it goes.
COMPILE_CPU_S=300

# -- the backend ------------------------------------------------------------------------
vulkan_build_missing() {  # the Debian packages a Vulkan build lacks here (none: ready)
  local missing=()
  command -v glslc >/dev/null 2>&1 || missing+=(glslc)
  [ -f /usr/include/vulkan/vulkan.h ] || missing+=(libvulkan-dev)
  [ -d /usr/include/spirv ] || [ -d /usr/include/spirv-headers ] || missing+=(spirv-headers)
  echo "${missing[*]:-}"
}
vulkan_gpu_present() {  # a GPU's Vulkan driver (not only lavapipe, the CPU driver) and a GPU
  ls /dev/dri/renderD* >/dev/null 2>&1 || return 1
  ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json 2>/dev/null \
    | grep -qv lvp_icd || return 1
}
# CUDA: the toolkit's major version (the runtime wheels installed beside llama-cpp-python
# match it), and what the NVIDIA driver here supports (nvidia-smi's "CUDA Version"; none: no
# driver). CUDA 13 needs driver 580 or newer.
CUDA_MAJOR=13
CUDA_TOOLKIT_SPEC="cuda-toolkit[nvcc,nvvm,crt,cudart,cccl,cublas]==13.0.*"
CUDA_RUNTIME_SPECS=("nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.*")
cuda_driver_version() {
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n1
}
cuda_driver_ok() {  # the driver here runs CUDA $CUDA_MAJOR code (else says why)
  local v
  v=$(cuda_driver_version)
  [ -n "$v" ] || return 1
  if [ "${v%%.*}" -lt "$CUDA_MAJOR" ]; then
    echo "The NVIDIA driver here supports CUDA $v; llmrun's CUDA build needs CUDA" \
      "$CUDA_MAJOR (driver 580 or newer): update the driver to use the GPU through CUDA" >&2
    return 1
  fi
}
# The one GPU architecture built (`-real`: machine code for it alone, the fastest build):
# LLMRUN_CUDA_ARCH (e.g. 90), else the first GPU's compute capability, else 90 (H100/H200).
cuda_arch() {
  local a=${LLMRUN_CUDA_ARCH:-}
  [ -n "$a" ] || a=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null \
    | head -n1 | tr -d ' .')
  echo "${a:-90}"
}

BACKEND=${LLMRUN_BACKEND:-auto}
case "$BACKEND" in
  auto|cuda)
    want=$BACKEND
    BACKEND=cpu
    if cuda_driver_ok || { [ "$want" = cuda ] && [ -z "$(cuda_driver_version)" ]; }; then
      # (asked for on a machine without a driver: built for another machine, or to prove
      # the build; the runner then lists no CUDA device and runs on the CPU)
      BACKEND=cuda
    elif vulkan_gpu_present; then
      if [ -z "$(vulkan_build_missing)" ]; then BACKEND=vulkan; else
        echo "A GPU with a Vulkan driver is here, but building llama.cpp's Vulkan backend" \
          "needs: sudo apt-get install $(vulkan_build_missing) (then rerun); building the" \
          "CPU backend" >&2
      fi
    fi ;;
  vulkan)
    if [ -n "$(vulkan_build_missing)" ]; then
      echo "LLMRUN_BACKEND=vulkan needs: sudo apt-get install $(vulkan_build_missing)" \
        "(and a Vulkan driver to run, e.g. mesa-vulkan-drivers); building the CPU backend" >&2
      BACKEND=cpu
    fi ;;
  cpu) ;;
  *) echo "LLMRUN_BACKEND must be auto, cpu, cuda or vulkan, not '$BACKEND'" >&2; exit 2 ;;
esac
if [ "$BACKEND" = vulkan ]; then
  # ggml-vulkan compiles its shaders with glslc at build time (about 2.5x the CPU build's
  # compile here); the library links libvulkan.so.1, present wherever a driver is.
  CMAKE_ARGS_ALL="$CMAKE_ARGS_ALL -DGGML_VULKAN=ON"
  # patches for the Vulkan backend alone (a CPU build's sources stay as they are)
  vk_patches=$(cat "$(dirname "$0")"/llama-patches/vulkan/*.patch | sha256sum | cut -c1-16)
  TRIM="$TRIM backend=vulkan vulkan-patches=$vk_patches"
  COMPILE_CPU_S=$((COMPILE_CPU_S * 5 / 2))
fi
if [ "$BACKEND" = cuda ]; then
  CUDA_ARCH=$(cuda_arch)
  case "$CUDA_ARCH" in [0-9][0-9]|[0-9][0-9][0-9]|[0-9][0-9][0-9][af]) ;;
    *) echo "LLMRUN_CUDA_ARCH must be a compute capability without its dot (e.g. 90)," \
         "not '$CUDA_ARCH'" >&2; exit 2 ;;
  esac
  # GGML_CUDA_NO_VMM: the toolkit's wheels carry no libcuda stub to link the driver API
  # against (the runtime, libcudart, opens the driver itself). The path options are filled in
  # once the toolkit is installed (below): the cache key holds what is built, not where from.
  CMAKE_ARGS_ALL="$CMAKE_ARGS_ALL -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON"
  CMAKE_ARGS_ALL="$CMAKE_ARGS_ALL -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH-real"
  TRIM="$TRIM backend=cuda cuda=$CUDA_TOOLKIT_SPEC"
  # measured on a 2-core AMD EPYC VM (2026-12), one architecture
  COMPILE_CPU_S=$((COMPILE_CPU_S * 16))
fi
echo "llama.cpp backend: $BACKEND${CUDA_ARCH:+ (CUDA architecture sm_$CUDA_ARCH)}"

here=$(cd "$(dirname "$0")" && pwd)
pytag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cpuflags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)
# llmrun's patches to the vendored llama.cpp (scripts/llama-patches) are part of the build
patches=$("$here/llama-sources.sh" --digest)
key=$(printf '%s\n%s\n%s\n%s\n%s\n%s\n' "$VERSION" "$CMAKE_ARGS_ALL" "$pytag" "$cpuflags" \
  "$patches" "$TRIM" | sha256sum | cut -c1-16)
cache_root=${LLMRUN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmrun/wheels}
cache="$cache_root/llama-cpp-python-$VERSION-$pytag-$key"

# CUDA at run time: libggml-cuda needs libcudart and libcublas, from NVIDIA's runtime wheels
# (what PyTorch installs too), beside llama-cpp-python in site-packages/nvidia/cu13/lib,
# where the library's RPATH looks (set at build, below). The toolkit, a gigabyte with nvcc,
# stays in the build-only directory.
if [ "$BACKEND" = cuda ]; then
  "$PY" -m pip install -q --disable-pip-version-check "${CUDA_RUNTIME_SPECS[@]}" \
    || { echo "installing NVIDIA's CUDA $CUDA_MAJOR runtime wheels (${CUDA_RUNTIME_SPECS[*]})" \
           "failed" >&2; exit 1; }
fi

# The toolkit that builds the CUDA backend, installed once in the cache (not the user's
# environment): LLMRUN_CUDA_TOOLKIT names one already installed (a directory with bin/nvcc,
# e.g. /usr/local/cuda) for a machine that reaches no package index.
cuda_toolkit() {  # prints the toolkit's root
  if [ -n "${LLMRUN_CUDA_TOOLKIT:-}" ]; then
    [ -x "$LLMRUN_CUDA_TOOLKIT/bin/nvcc" ] \
      || { echo "LLMRUN_CUDA_TOOLKIT=$LLMRUN_CUDA_TOOLKIT has no bin/nvcc" >&2; return 1; }
    echo "$LLMRUN_CUDA_TOOLKIT"; return
  fi
  local dir
  dir="$(dirname "$cache_root")/cuda-toolkit-$(echo "$CUDA_TOOLKIT_SPEC" | sha256sum | cut -c1-8)"
  if [ ! -x "$dir/nvidia/cu$CUDA_MAJOR/bin/nvcc" ]; then
    echo "installing the CUDA $CUDA_MAJOR toolkit (about 1 GB, for the build only) in $dir" >&2
    local t
    t=$(mktemp -d "$dir.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$(dirname "$dir")"; mktemp -d "$dir.tmp.XXXXXX"; })
    "$PY" -m pip install -q --disable-pip-version-check --no-compile --target "$t" \
      "$CUDA_TOOLKIT_SPEC" >&2 || { rm -rf "$t"; return 1; }
    # The wheels lay the toolkit out as nvidia/cu13/{bin,lib,include}; nvcc looks for its
    # libraries in lib64, and CMake's FindCUDAToolkit for unversioned names.
    local lib="$t/nvidia/cu$CUDA_MAJOR/lib"
    ln -sfn lib "$t/nvidia/cu$CUDA_MAJOR/lib64"
    for so in "$lib"/lib*.so.[0-9]*; do
      ln -sf "$(basename "$so")" "${so%%.so.*}.so"
    done
    rm -rf "$dir"; mv -T "$t" "$dir"
  fi
  echo "$dir/nvidia/cu$CUDA_MAJOR"
}

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

# The compile's progress from ninja's own records: every 20 s, or at each tenth of the way,
# a line with the share done and the time left at the pace so far.
watch_build() {  # BUILD_DIR PID
  local dir=$1 pid=$2 start=$SECONDS total=0 done=0 shown=-1 last=0 left
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    [ -f "$dir/build.ninja" ] || continue
    [ "$total" -gt 0 ] || total=$(grep -c '^build [^:]*\.o:' "$dir/build.ninja" || true)
    [ "$total" -gt 0 ] || continue
    done=$(awk '$4 ~ /\.o$/' "$dir/.ninja_log" 2>/dev/null | wc -l)
    [ "$done" -gt 0 ] || continue  # (no pace to tell the time left from yet)
    local tenth=$((done * 10 / total)) spent=$((SECONDS - start))
    if [ "$tenth" -ne "$shown" ] || [ $((spent - last)) -ge 20 ]; then
      left=$(((total - done) * spent / done))
      printf '  compiling: %3d%% (%d of %d files), %dm%02ds so far, about %dm%02ds left\n' \
        $((done * 100 / total)) "$done" "$total" $((spent / 60)) $((spent % 60)) \
        $((left / 60)) $((left % 60))
      shown=$tenth last=$spent
    fi
  done
}

if ! ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  cores=$(nproc 2>/dev/null || echo 1)
  guess=$(( (COMPILE_CPU_S / cores + 90 + 59) / 60 ))  # + unpacking, linking, packing
  echo "Building llama-cpp-python $VERSION ($BACKEND) without AMX: one time, about $guess min on" \
    "$cores cores; later installs take seconds (cached in $cache_root)"
  tmp=$(mktemp -d "$cache_root.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$cache_root"; mktemp -d "$cache_root.tmp.XXXXXX"; })
  trap 'rm -rf "$tmp"' EXIT
  t0=$SECONDS
  echo "[1/3] sources: the llama-cpp-python $VERSION sdist and llmrun's patches"
  "$here/llama-sources.sh" "$PY" "$VERSION" "$tmp/src"
  src="$tmp/src/llama_cpp_python-$VERSION"
  sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' \
    "$src/CMakeLists.txt"
  grep -q 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL' "$src/CMakeLists.txt" \
    || { echo "llama-cpp-python's CMakeLists.txt changed: update TRIM in $0" >&2; exit 1; }
  if [ "$BACKEND" = cuda ]; then
    toolkit=$(cuda_toolkit) || { echo "the CUDA toolkit could not be installed" >&2; exit 1; }
    CMAKE_ARGS_ALL="$CMAKE_ARGS_ALL -DCUDAToolkit_ROOT=$toolkit"
    CMAKE_ARGS_ALL="$CMAKE_ARGS_ALL -DCMAKE_CUDA_COMPILER=$toolkit/bin/nvcc"
    # the libraries find the runtime wheels' libcudart and libcublas (installed above)
    sed -i 's|INSTALL_RPATH "\$ORIGIN"|INSTALL_RPATH "\$ORIGIN;\$ORIGIN/../../nvidia/cu'"$CUDA_MAJOR"'/lib"|' \
      "$src/CMakeLists.txt"
    grep -q "nvidia/cu$CUDA_MAJOR/lib" "$src/CMakeLists.txt" \
      || { echo "llama-cpp-python's CMakeLists.txt changed: update the RPATH in $0" >&2; exit 1; }
  fi
  if [ "$BACKEND" = vulkan ]; then
    for p in "$here"/llama-patches/vulkan/*.patch; do
      patch -p1 --forward --fuzz=0 --quiet -d "$src/vendor/llama.cpp" < "$p"
    done
  fi
  launcher=""
  if command -v ccache >/dev/null 2>&1; then  # a rebuild (new flags, patches) reuses objects
    launcher="-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
  fi
  echo "[2/3] compiling llama.cpp ($((SECONDS - t0)) s so far; the compiler's output goes to" \
    "$cache.log)"
  mkdir -p "$cache_root"
  SKBUILD_BUILD_DIR="$tmp/build" CMAKE_ARGS="$CMAKE_ARGS_ALL $launcher" FORCE_CMAKE=1 \
    "$PY" -m pip wheel --no-deps --no-cache-dir -v -w "$tmp" "$src" \
    > "$cache.log" 2>&1 &
  pid=$!
  watch_build "$tmp/build" "$pid" &
  watcher=$!
  if ! wait "$pid"; then
    kill "$watcher" 2>/dev/null || true
    grep -m 20 -E 'error:|Error [0-9]|FAILED:' "$cache.log" >&2 || tail -n 40 "$cache.log" >&2
    echo "building llama-cpp-python failed: the whole log is $cache.log" >&2
    exit 1
  fi
  wait "$watcher" 2>/dev/null || true
  echo "[3/3] built in $(((SECONDS - t0) / 60))m$(printf '%02d' $(((SECONDS - t0) % 60)))s;" \
    "installing the wheel"
  rm -rf "$tmp/src" "$tmp/build"
  mkdir -p "$cache_root"
  # Rename is atomic: a concurrent or interrupted build never leaves a half-written cache entry.
  mv -T "$tmp" "$cache" 2>/dev/null || rm -rf "$tmp"
  trap - EXIT
fi

wheel=$(ls "$cache"/llama_cpp_python-*.whl | head -n1)
"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" - "$key" "$patches" "$BACKEND" <<'PYEOF'
import hashlib, importlib.metadata as md, pathlib, sys
d = md.distribution("llama-cpp-python")
lib = pathlib.Path(d.locate_file("llama_cpp/lib/libggml-cpu.so"))
digest = hashlib.sha256(lib.read_bytes()).hexdigest()
pathlib.Path(d.locate_file("llama_cpp/.llmrun-safe-build")).write_text(
    f"{digest} {sys.argv[1]} patches={sys.argv[2]} backend={sys.argv[3]} libggml-cpu.so"
    " built without AMX by scripts/llama-wheel.sh\n")
PYEOF
echo "installed $wheel"
