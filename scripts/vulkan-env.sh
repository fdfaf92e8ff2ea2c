#!/usr/bin/env bash
# An environment whose llama.cpp has the Vulkan backend, for the Vulkan tests
# (tests/integration/test_vulkan.py), which run it on Mesa's CPU Vulkan driver (lavapipe): the real
# offload path, on a machine without a GPU. The main environment keeps its own build.
#
# Needs Debian's libvulkan-dev, glslc and spirv-headers to build, and mesa-vulkan-drivers to
# run; installed here when this runs as root with apt-get (as in CI), else named. When it
# cannot make the environment it says why, in the output and in VENV.why, and exits 0:
# `make test` goes on, and the Vulkan tests then FAIL with that reason (tests/ci_groups.py),
# so the run is red but still reports the rest of the suite. On a machine that cannot have
# it, LLMRUN_TEST_SKIP=vulkan skips them on purpose (and this builds nothing).
#   scripts/vulkan-env.sh PYTHON VENV
set -uo pipefail
PY=$1 VENV=$2
here=$(cd "$(dirname "$0")/.." && pwd)
why() {
  mkdir -p "$VENV"
  echo "$*" > "$VENV.why"
  echo "Vulkan tests: cannot run: $*" >&2
  echo "Vulkan tests: they will fail (skip them on purpose: LLMRUN_TEST_SKIP=vulkan)" >&2
  exit 0
}

skip=${LLMRUN_TEST_SKIP:-}
case ",${skip// /}," in
  *,vulkan,*) echo "Vulkan tests: skipped on purpose (LLMRUN_TEST_SKIP=$skip)"
              exit 0 ;;
esac

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
  [ -z "$need" ] || why "missing Debian packages: sudo apt-get install $need"
fi
rm -f "$VENV.why"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" || why "cannot make the environment $VENV with $PY"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
LLMRUN_BACKEND=vulkan "$here/scripts/llama-wheel.sh" "$VENV/bin/python" \
  || why "building llama.cpp's Vulkan backend failed (see its log above)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$here" \
  || why "cannot install llmrun into $VENV"
grep -q "backend=vulkan" "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.distribution("llama-cpp-python").locate_file("llama_cpp/.llmrun-safe-build"))')" \
  || why "$VENV holds no Vulkan build of llama.cpp"
