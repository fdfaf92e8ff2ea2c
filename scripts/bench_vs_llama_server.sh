#!/usr/bin/env bash
# llmrun against llama.cpp's own server, in one run:
#   scripts/bench_vs_llama_server.sh [GGUF] [-- extra `llmrun bench` options]
# Builds llama-server from the pinned llama-cpp-python sdist (scripts/build_llama_server.sh,
# once), starts it and an llmrun daemon (a scratch LLMRUN_HOME holding GGUF) with the same
# thread count and slots (SLOTS, default 4) of CTX tokens (default 4096) each, runs
# `llmrun bench --against`, and stops both.
# Run it on an otherwise idle machine; paste the table into docs/benchmarks.md.
# STOCK=1 measures a llama-server built without llmrun's llama.cpp patches
# (build_llama_server.sh --stock); by default it carries them, as the engine does.
# LLAMA_SERVER=path: a llama-server already built (no build step).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
GGUF=$HOME/.cache/llmrun/test-models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ $# -gt 0 ] && [ "$1" != "--" ]; then GGUF=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
THREADS=${THREADS:-$(nproc)}
LS_PORT=${LS_PORT:-18080}
LR_PORT=${LR_PORT:-18434}
SERVER=${LLAMA_SERVER:-$("$ROOT/scripts/build_llama_server.sh" ${STOCK:+--stock})}
. "$ROOT/scripts/bench-lib.sh"

start_llama_server "$SERVER" "$GGUF" -b 512 -fa on
create_model bench "$GGUF"
start_llmrun
"$PY" -m llmrun bench bench --gguf "$GGUF" --threads "$THREADS" \
  --against "http://127.0.0.1:$LS_PORT" "$@"
