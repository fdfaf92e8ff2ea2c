#!/usr/bin/env bash
# The 8B-class model of the benchmarks, which no package reachable here ships: SmolLM2's
# tokenizer and chat template on the architecture of a model of the size people run
# (scripts/gguf_skeleton.py reshape: Qwen2.5-7B's by default), with seeded random weights,
# quantized by llama-quantize from the stock llama.cpp build (scripts/build_llama_server.sh).
# Speed and memory depend on the shapes and types alone; the text it writes is noise.
#   scripts/make_big_model.sh [SHAPE [TYPE ...]]    prints the path of each file made
# Defaults: qwen2.5-7b; Q4_K_M and Q4_0. The files go to ~/.cache/llmrun/test-models/
# (synthetic-SHAPE-TYPE.gguf), never into the repository; one already there is kept. The F16
# intermediate (15 GB for Qwen2.5-7B) is removed once every type is made.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
SHAPE=${1:-qwen2.5-7b}
shift || true
TYPES=("$@")
[ ${#TYPES[@]} -gt 0 ] || TYPES=(Q4_K_M Q4_0)
MODELS=${XDG_CACHE_HOME:-$HOME/.cache}/llmrun/test-models
TOKENIZER=${TOKENIZER:-$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$TOKENIZER" ] || "$PY" "$ROOT/scripts/fetch_test_models.py" >&2
mkdir -p "$MODELS"
todo=()
for t in "${TYPES[@]}"; do
  [ -f "$MODELS/synthetic-$SHAPE-$t.gguf" ] || todo+=("$t")
done
if [ ${#todo[@]} -gt 0 ]; then
  SERVER=$("$ROOT/scripts/build_llama_server.sh" --stock)
  QUANTIZE=${SERVER%/*}/llama-quantize
  work=$(mktemp -d "$MODELS/.synthetic-XXXXXX")
  trap 'rm -rf "$work"' EXIT
  "$PY" "$ROOT/scripts/gguf_skeleton.py" describe "$TOKENIZER" "$work/tokenizer.json.xz"
  "$PY" "$ROOT/scripts/gguf_skeleton.py" reshape "$work/tokenizer.json.xz" "$SHAPE" \
    "$work/skeleton.json.xz"
  echo "writing $SHAPE in F16 with random weights..." >&2
  "$PY" "$ROOT/scripts/gguf_skeleton.py" build "$work/skeleton.json.xz" "$work/f16.gguf"
  for t in "${todo[@]}"; do
    echo "quantizing to $t..." >&2
    "$QUANTIZE" "$work/f16.gguf" "$work/$t.gguf" "$t" "$(nproc)" > "$work/quantize-$t.log" 2>&1 \
      || { tail -20 "$work/quantize-$t.log" >&2; exit 1; }
    mv "$work/$t.gguf" "$MODELS/synthetic-$SHAPE-$t.gguf"  # whole, or not at all
  done
fi
for t in "${TYPES[@]}"; do echo "$MODELS/synthetic-$SHAPE-$t.gguf"; done
