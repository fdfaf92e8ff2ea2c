#!/usr/bin/env bash
# Embedding and reranking, llmrun against llama-server, in one run; prints the markdown that
# docs/benchmarks.md keeps ("Embeddings and reranking against llama-server"):
#   scripts/bench_retrieval.sh [-- extra `llmrun bench` options]
# Starts an llmrun daemon (a scratch LLMRUN_HOME) and, for each section, llama-server in the
# matching mode (`--embedding --pooling mean`, `--rerank`) on the same GGUF with the same
# thread count and 4 slots, runs `llmrun bench MODEL --embedding|--rerank --against`, stops it.
# Sections:
#   SmolLM2 embeddings (mean pooling)            llmrun, llama-server, the raw loop
#   SmolLM2 as an LLM reranker (rerank true)     llmrun and the raw loop; llama-server's
#       --rerank scores a different prompt (query and document only, rank pooling), so it
#       would not be the same work
#   a BERT encoder's embeddings, and a BERT cross-encoder's reranking (bge-small's shape:
#       12 layers, 384 wide; synthetic weights), llmrun, llama-server and the raw loop,
#       when BERT and BERT_RANK name GGUFs or tests/fakes/encodermodel.py can write them
# About 5 minutes on an idle 2-core machine (10 beside a load average of 5); run it on an
# otherwise idle one.
# Environment: LLAMA_SERVER (a built llama-server; default: scripts/build_llama_server.sh),
# THREADS (default: all cores), ROUNDS (turns per level, default 2), LEVELS (1,4),
# INPUTS / BATCH (embedding inputs per level, per request: 32 / 8), DOCS (rerank documents
# per request: 12), SMOLLM2, BERT, BERT_RANK (GGUF paths), LS_PORT, LR_PORT.
set -euo pipefail
# (the whole script in one block: bash reads a block before it runs any of it, so editing the
# file during a run does not change what the run does)
{
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
SMOLLM2=${SMOLLM2:-$HOME/.cache/llmrun/test-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ "${1:-}" = "--" ]; then shift; fi
THREADS=${THREADS:-$(nproc)}
ROUNDS=${ROUNDS:-2}
LEVELS=${LEVELS:-1,4}
INPUTS=${INPUTS:-32}
BATCH=${BATCH:-8}
DOCS=${DOCS:-12}
LS_PORT=${LS_PORT:-18081}
LR_PORT=${LR_PORT:-18435}
SERVER=${LLAMA_SERVER:-$("$ROOT/scripts/build_llama_server.sh")}
. "$ROOT/scripts/bench-lib.sh"

# The BERT models: synthetic weights in bge-small's shape (what is timed is the shape, not
# what the weights know), written by the test fakes where the caller names none.
if [ -z "${BERT:-}" ] && [ -f "$ROOT/tests/fakes/encodermodel.py" ]; then
  BERT=$WORK/bert-mean.gguf BERT_RANK=$WORK/bert-rank.gguf
  (cd "$ROOT" && "$PY" - "$BERT" "$BERT_RANK" <<'EOF'
import sys
from pathlib import Path
from tests.fakes.encodermodel import write_tiny_bert
write_tiny_bert(Path(sys.argv[1]), n_layer=12, n_embd=384)  # mean pooling
write_tiny_bert(Path(sys.argv[2]), rank_head=True, n_layer=12, n_embd=384)
EOF
  )
fi

create_model smollm2 "$SMOLLM2"
create_model smollm2-rerank "$SMOLLM2" "PARAMETER rerank true"
[ -n "${BERT:-}" ] && create_model bert "$BERT"
[ -n "${BERT_RANK:-}" ] && create_model bert-rank "$BERT_RANK"
start_llmrun

bench() {  # bench KIND MODEL GGUF [llama-server mode flags]; no flags: llmrun alone
  local kind=$1 model=$2 gguf=$3; shift 3
  local against=() ls=""
  if [ $# -gt 0 ]; then
    start_llama_server "$SERVER" "$gguf" "$@"
    ls=$LS_PID
    against=(--against "http://127.0.0.1:$LS_PORT")
  fi
  "$PY" -m llmrun bench "$model" "--$kind" --gguf "$gguf" --threads "$THREADS" \
    --levels "$LEVELS" --rounds "$ROUNDS" --inputs "$INPUTS" --batch "$BATCH" --docs "$DOCS" \
    "${against[@]}" "${EXTRA[@]}"
  if [ -n "$ls" ]; then stop "$ls"; fi
}
EXTRA=("$@")

avx512=$(grep -qw avx512f /proc/cpuinfo && echo " (AVX-512)" || true)
echo "$(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p')$avx512, $(nproc) vCPUs," \
  "$THREADS threads, llmrun $(git -C "$ROOT" rev-parse --short HEAD)," \
  "llama-server $("$SERVER" --version 2>&1 | sed -n 's/^version: //p') at 127.0.0.1:$LS_PORT," \
  "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "### SmolLM2 embeddings (mean pooling)"
echo
bench embedding smollm2 "$SMOLLM2" --embedding --pooling mean
echo
echo "### SmolLM2 as an LLM reranker (PARAMETER rerank true)"
echo
bench rerank smollm2-rerank "$SMOLLM2"
if [ -n "${BERT:-}" ]; then
  echo
  echo "### A BERT encoder's embeddings (bge-small's shape, synthetic weights)"
  echo
  bench embedding bert "$BERT" --embedding --pooling mean
fi
if [ -n "${BERT_RANK:-}" ]; then
  echo
  echo "### A BERT cross-encoder's reranking (bge-small's shape, a rank head)"
  echo
  bench rerank bert-rank "$BERT_RANK" --rerank
fi
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
exit
}
