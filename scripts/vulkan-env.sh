#!/usr/bin/env bash
# An environment whose llama.cpp has the Vulkan backend, for the Vulkan tests
# (tests/integration/test_vulkan.py), which run it on Mesa's CPU Vulkan driver (lavapipe): the real
# offload path, on a machine without a GPU. The main environment keeps its own build.
#
# Needs Debian's libvulkan-dev, glslc and spirv-headers to build, and mesa-vulkan-drivers to
# run; installed here when this runs as root with apt-get (as in CI), else named. It never
# fails `make test`: when it cannot make the environment it says why, in the output and in
# VENV.why, which the tests' skip message repeats.
#   scripts/vulkan-env.sh PYTHON VENV
set -uo pipefail
PY=$1 VENV=$2
here=$(cd "$(dirname "$0")/.." && pwd)
why() { mkdir -p "$VENV"; echo "$*" > "$VENV.why"; echo "Vulkan tests: $*" >&2; exit 0; }

missing() {
  local m=()
  command -v glslc >/dev/null 2>&1 || m+=(glslc)
  [ -f /usr/include/vulkan/vulkan.h ] || m+=(libvulkan-dev)
  [ -d /usr/include/spirv ] || m+=(spirv-headers)
  ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || m+=(mesa-vulkan-drivers)
  echo "${m[*]:-}"
}
need=$(missing)
if [ -n "$need" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing for the Vulkan tests: $need"
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $need >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $need >/dev/null 2>&1; }
    need=$(missing)
  fi
  [ -z "$need" ] || why "not run: they need sudo apt-get install $need"
fi
rm -f "$VENV.why"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || why "not run: cannot make $VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
LLMRUN_BACKEND=vulkan "$here/scripts/llama-wheel.sh" "$VENV/bin/python" \
  || why "not run: building llama.cpp's Vulkan backend failed (see its log above)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$here" \
  || why "not run: cannot install llmrun into $VENV"
grep -q "backend=vulkan" "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.distribution("llama-cpp-python").locate_file("llama_cpp/.llmrun-safe-build"))')" \
  || why "not run: $VENV holds no Vulkan build of llama.cpp"
