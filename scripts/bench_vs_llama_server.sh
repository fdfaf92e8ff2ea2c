#!/usr/bin/env bash
# llmrun against llama.cpp's own server, in one run:
#   scripts/bench_vs_llama_server.sh [GGUF] [-- extra `llmrun bench` options]
# Builds llama-server from the pinned llama-cpp-python sdist (scripts/build_llama_server.sh,
# once), starts it and an llmrun daemon (a scratch LLMRUN_HOME holding GGUF) with the same
# thread count and 4 slots of 4096 tokens each, runs `llmrun bench --against`, and stops both.
# Run it on an otherwise idle machine; paste the table into docs/benchmarks.md.
# STOCK=1 measures a llama-server built without llmrun's llama.cpp patches
# (build_llama_server.sh --stock); by default it carries them, as the engine does.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
GGUF=$HOME/.cache/llmrun/test-models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ $# -gt 0 ] && [ "$1" != "--" ]; then GGUF=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
THREADS=${THREADS:-$(nproc)}
LS_PORT=${LS_PORT:-18080}
LR_PORT=${LR_PORT:-18434}
for port in "$LS_PORT" "$LR_PORT"; do  # a server left from an earlier run would be measured
  if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
    echo "port $port already answers: stop that server first (or set LS_PORT / LR_PORT)" >&2
    exit 1
  fi
done
SERVER=$("$ROOT/scripts/build_llama_server.sh" ${STOCK:+--stock})
WORK=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

"$SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np 4 -c $((4 * 4096)) -b 512 -fa on \
  --host 127.0.0.1 --port "$LS_PORT" --no-webui > "$WORK/llama-server.log" 2>&1 &
pids+=($!)
export LLMRUN_HOME="$WORK/home" LLMRUN_HOST="127.0.0.1:$LR_PORT" LLMRUN_NUM_THREADS="$THREADS" \
  LLMRUN_NUM_PARALLEL=4 LLMRUN_CONTEXT_LENGTH=4096
printf 'FROM %s\n' "$GGUF" > "$WORK/Modelfile"
"$PY" -m llmrun create bench -f "$WORK/Modelfile" > /dev/null
"$PY" -m llmrun serve > "$WORK/llmrun.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$LS_PORT/health" > /dev/null \
     && curl -sf "http://127.0.0.1:$LR_PORT/api/version" > /dev/null; then break; fi
  sleep 0.2
done
"$PY" -m llmrun bench bench --gguf "$GGUF" --threads "$THREADS" \
  --against "http://127.0.0.1:$LS_PORT" "$@"
