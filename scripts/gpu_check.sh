#!/usr/bin/env bash
# The GPU check: llmrun on an NVIDIA GPU against llama.cpp's own server, from one build.
#
#   scripts/gpu_check.sh --prepare   here (with a package index): fills .gpu/ with what the
#                                    GPU machine lacks, within the 64 MiB it may receive
#   scripts/gpu_check.sh [OUT]       there (no package index): the check, about 6 minutes;
#                                    its log and table go to OUT (default $OUT or /tmp/gpu-check)
#   GPU_CHECK_STAGE=build scripts/gpu_check.sh [OUT]   there: the build alone (285 s on an
#                                    H200 machine's 16 cores), for a first call within a
#                                    per-call limit; the check called next resumes from it
#   GPU_CHECK_STAGE=big scripts/gpu_check.sh [OUT]     there, after the build: the 8B-class
#                                    model alone (below), about 8 minutes on an H100 machine
#   GPU_CHECK_BACKEND=cpu scripts/gpu_check.sh [OUT]   the same steps on a CPU build, to
#                                    try the script on a machine without a GPU
#
# There it:
#   1. builds llama.cpp once from the pinned llama-cpp-python sources with llmrun's patches,
#      CUDA for that GPU's architecture alone (`-real`): llmrun loads these libraries through
#      LLAMA_CPP_LIB_PATH, and llama-server comes from the same build;
#   2. rebuilds SmolLM2 135M and Gemma 3 270M from their skeletons (scripts/gguf_skeleton.py:
#      the same architecture, shapes and tokenizer, random weights; the real files, 98 and 253
#      MB, cannot travel) and quantizes them as the real ones are (Q4_1, Q4_K_M);
#   3. loads both fully offloaded (the daemon's own fit) and compares greedy answers with the
#      same build's CPU path (num_gpu 0);
#   4. runs `llmrun bench --against` llama-server at concurrency 1, 4 and 16, and prints `ps`.
# GPU_CHECK_STAGE=big instead builds the 8B-class model (Qwen2.5-7B's shape on SmolLM2's
# tokenizer, scripts/gguf_skeleton.py reshape; Q4_K_M) and measures it: `llmrun bench
# --against` llama-server at 1, 4, 16 and 64 streams, a 16k-token prompt read by each, and
# half its layers on the GPU (num_gpu 14 against -ngl 14) with `ps`'s split.
#
# Its facts come from the machine it runs on: nvidia-smi (the architecture), nvcc on PATH or
# in /usr/local/cuda, python3 (3.12 there; the carried wheels are for it).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=0.3.36
CARRY="$ROOT/.gpu"
# llmrun's dependencies the GPU machine's Python lacks (its image has httpx, rich, typer,
# numpy, pillow, jinja2, uvloop... already): their versions are this checkout's environment's
WHEELS="fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
  llguidance jsonschema jsonschema-specifications referencing rpds-py orjson httptools
  platformdirs diskcache gguf opentelemetry-api"

prepare() {
  local py=${PYTHON:-$ROOT/.venv/bin/python}
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/models"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT  # (global: the trap runs after the function has returned)
  # the engine's sources (llama.cpp with llmrun's patches, and llama-cpp-python's bindings),
  # less what no build here reads (its model vocabularies, docs, examples: 110 of 217 MB)
  "$ROOT/scripts/llama-sources.sh" "$py" "$VERSION" "$tmp" >/dev/null
  tar -C "$tmp/llama_cpp_python-$VERSION" -cJf "$CARRY/llama-sources.tar.xz" \
    --exclude=vendor/llama.cpp/models --exclude=vendor/llama.cpp/docs \
    --exclude=vendor/llama.cpp/examples --exclude=vendor/llama.cpp/benches \
    --exclude=vendor/llama.cpp/tests --exclude=vendor/llama.cpp/gguf-py \
    --exclude=vendor/llama.cpp/conversion --exclude=vendor/llama.cpp/.github \
    llama_cpp vendor/llama.cpp
  local specs=() name
  for name in $WHEELS; do
    specs+=("$name==$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
  done
  # for the GPU machine's Python 3.12 on x86-64; pip matches a manylinux tag's glibc exactly
  local platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64) n
  for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$CARRY/wheels" \
    "${specs[@]}" || { echo "downloading the wheels failed" >&2; exit 1; }
  local models
  models=$("$py" "$ROOT/scripts/fetch_test_models.py" smollm2 gemma3) || exit 1
  "$py" "$ROOT/scripts/gguf_skeleton.py" describe "$(echo "$models" | sed -n 1p)" \
    "$CARRY/models/smollm2.json.xz" || exit 1
  "$py" "$ROOT/scripts/gguf_skeleton.py" describe "$(echo "$models" | sed -n 2p)" \
    "$CARRY/models/gemma3.json.xz" || exit 1
  "$py" "$ROOT/scripts/gguf_skeleton.py" reshape "$CARRY/models/smollm2.json.xz" qwen2.5-7b \
    "$CARRY/models/qwen7b.json.xz" || exit 1
  du -sh "$CARRY"
  echo "ready: run scripts/gpu_check.sh on the GPU machine with .gpu carried"
}

if [ "${1:-}" = "--prepare" ]; then prepare; exit 0; fi

OUTDIR=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/gpu_check.log") 2>&1
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check-work}
BACKEND=${GPU_CHECK_BACKEND:-cuda}
PY=${PYTHON:-python3}
step() { echo; echo "== [$SECONDS s] $*"; }
fail() { echo "GPU CHECK FAILED: $*"; exit 1; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT
[ -f "$CARRY/llama-sources.tar.xz" ] || fail "no .gpu/: run scripts/gpu_check.sh --prepare here first"

step "the machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1 | head -3
echo "cores: $(nproc); $("$PY" --version 2>&1); backend: $BACKEND"
mkdir -p "$WORK"

step "Python: llmrun's missing dependencies from the carried wheels"
if "$PY" -c "import fastapi, uvicorn, pydantic, llguidance, jsonschema, orjson, gguf" 2>/dev/null
then echo "all importable already"
else
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --upgrade --target "$WORK/site" "$CARRY"/wheels/*.whl || fail "installing the wheels"
fi
# A second call on the same (still warm) machine resumes: the same sources are not unpacked
# again, and ninja rebuilds only what an interrupted build had not finished.
stamp=$(sha256sum "$CARRY/llama-sources.tar.xz" | cut -c1-16)
if [ "$(cat "$WORK/src.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$WORK/src" "$WORK/build" && mkdir -p "$WORK/src"
  tar -C "$WORK/src" -xJf "$CARRY/llama-sources.tar.xz" || fail "unpacking the sources"
  echo "$stamp" > "$WORK/src.stamp"
fi
# the bindings' Python files from the sources, the libraries from the build (below)
export PYTHONPATH="$WORK/site:$WORK/src:$ROOT" LLAMA_CPP_LIB_PATH="$WORK/build/bin"
export PYTHONUNBUFFERED=1

step "build: llama.cpp ($BACKEND) for llmrun and llama-server, one CMake build"
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NOAMX"
       -DCMAKE_CXX_FLAGS="$NOAMX" -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
       -DLLAMA_BUILD_TOOLS=ON)
if [ "$BACKEND" = cuda ]; then
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null) \
    || fail "no nvcc (PATH, /usr/local/cuda/bin)"
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' .')
  [ -n "$arch" ] || fail "nvidia-smi names no GPU"
  flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch-real" "-DCMAKE_CUDA_COMPILER=$nvcc")
fi
cmake -S "$WORK/src/vendor/llama.cpp" -B "$WORK/build" "${flags[@]}" > "$WORK/cmake.log" 2>&1 \
  || { tail -30 "$WORK/cmake.log"; fail "cmake"; }
cmake --build "$WORK/build" -j "$(nproc)" --target llama llama-server llama-quantize \
  > "$WORK/build.log" 2>&1 || { grep -m 20 -E "error|FAILED" "$WORK/build.log"; fail "build"; }
echo "built in $SECONDS s"
"$PY" -m llmrun.engine.runner --list-devices || fail "the runner cannot list devices"
# GPU_CHECK_STAGE=build: stop here (a first call within the device's per-call limit)
[ "${GPU_CHECK_STAGE:-}" = build ] && { step "built; run again for the check"; exit 0; }

if [ "${GPU_CHECK_STAGE:-}" = big ]; then
  # shellcheck source=scripts/gpu_check_big.sh
  . "$ROOT/scripts/gpu_check_big.sh"
  exit 0
fi

step "models: SmolLM2 and Gemma 3 rebuilt from their skeletons, quantized as the real ones"
for m in smollm2 gemma3; do
  "$PY" "$ROOT/scripts/gguf_skeleton.py" build "$CARRY/models/$m.json.xz" "$WORK/$m-f16.gguf" \
    || fail "rebuilding $m"
  ftype=$("$PY" -c "import json, lzma, sys; print(json.load(lzma.open(sys.argv[1]))['file_type'])" \
    "$CARRY/models/$m.json.xz")
  "$WORK/build/bin/llama-quantize" "$WORK/$m-f16.gguf" "$WORK/$m.gguf" "$ftype" \
    > "$WORK/quantize-$m.log" 2>&1 || { tail -5 "$WORK/quantize-$m.log"; fail "quantizing $m"; }
  rm -f "$WORK/$m-f16.gguf"
  ls -la "$WORK/$m.gguf"
done

step "llmrun's daemon (16 slots of 2048 tokens)"
export LLMRUN_HOME="$WORK/home" LLMRUN_HOST="127.0.0.1:18434" LLMRUN_NUM_PARALLEL=16 \
  LLMRUN_CONTEXT_LENGTH=2048 LLMRUN_MAX_LOADED_MODELS=2
rm -rf "$LLMRUN_HOME"
for m in smollm2 gemma3; do
  printf 'FROM %s\n' "$WORK/$m.gguf" > "$WORK/Modelfile.$m"
  "$PY" -m llmrun create "$m" -f "$WORK/Modelfile.$m" > /dev/null || fail "llmrun create $m"
done
"$PY" -m llmrun serve > "$OUTDIR/llmrun-serve.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  curl -sf "http://$LLMRUN_HOST/api/version" > /dev/null && break
  kill -0 "${pids[-1]}" 2>/dev/null || { tail -5 "$OUTDIR/llmrun-serve.log"; fail "llmrun serve"; }
  sleep 0.2
done

step "greedy answers: fitted on the GPU against the same build's CPU path (num_gpu 0)"
"$PY" - <<'PYEOF' || fail "greedy comparison"
import os
import httpx
url = "http://" + os.environ["LLMRUN_HOST"]
prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a small village,"]
def gen(model, prompt, **opt):
    r = httpx.post(url + "/api/generate", timeout=600, json={
        "model": model, "prompt": prompt, "raw": True, "stream": False, "logprobs": True,
        "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 32, **opt}})
    r.raise_for_status()
    return r.json()["logprobs"]
for model in ("smollm2", "gemma3"):
    # all GPU answers, then all CPU ones: num_gpu 0 is another load of the model
    gpus = [gen(model, p) for p in prompts]
    (state,) = [m for m in httpx.get(url + "/api/ps").json()["models"]
                if m["name"].startswith(model + ":")]
    print(f"{model}: {state['size_vram']} of {state['size']} bytes on the GPU")
    cpus = [gen(model, p, num_gpu=0) for p in prompts]
    for p, gpu, cpu in zip(prompts, gpus, cpus):
        same = next((i for i, (a, b) in enumerate(zip(gpu, cpu)) if a["token"] != b["token"]),
                    len(gpu))
        gap = max((abs(a["logprob"] - b["logprob"]) for a, b in zip(gpu[:same], cpu[:same])),
                  default=0.0)
        print(f"{model:8} {p[:24]!r:28} tokens agreeing {same:2}/{len(gpu)}, "
              f"largest log-probability gap before that {gap:.4f}")
PYEOF
"$PY" -m llmrun run smollm2 -o num_predict=4 "Hi" > /dev/null
"$PY" -m llmrun run gemma3 -o num_predict=4 "Hi" > /dev/null
"$PY" -m llmrun ps

step "llama-server from the same build (16 slots of 2048 tokens, all layers on the GPU)"
ngl=99; [ "$BACKEND" = cuda ] || ngl=0
"$WORK/build/bin/llama-server" -m "$WORK/smollm2.gguf" -ngl "$ngl" -np 16 -c $((16 * 2048)) \
  -fa on --host 127.0.0.1 --port 18080 --no-webui > "$OUTDIR/llama-server.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -sf http://127.0.0.1:18080/health > /dev/null && break; sleep 0.2; done

step "llmrun bench --against llama-server: SmolLM2 at concurrency 1, 4, 16"
"$PY" -m llmrun bench smollm2 --levels 1,4,16 --tokens 128 --rounds 3 --no-baselines \
  --no-prefix --constrained "" --against http://127.0.0.1:18080 | tee "$OUTDIR/bench.txt" \
  || fail "bench"
"$PY" -m llmrun ps
step "done in $SECONDS s"
