#!/usr/bin/env bash
# Decode speed of two llama.cpp builds, paired: the raw decode loop of `llmrun bench`
# (llmrun.bench.raw_batched: prefill outside the timed part) run alternately with each
# environment's llama-cpp-python, ROUNDS times at each sequence count, and the median of
# each with the ratio B/A. For a change to how llama.cpp is built that must leave its speed
# as it was (scripts/llama-wheel.sh).
#   scripts/decode_pair.sh PYTHON_A PYTHON_B [MODEL.gguf] [ROUNDS]
set -euo pipefail
A=$1 B=$2
MODEL=${3:-$HOME/.cache/llmrun/test-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${4:-5}
here=$(cd "$(dirname "$0")/.." && pwd)
one() {  # PYTHON N_SEQ -> decode tok/s
  PYTHONPATH="$here" "$1" -c "import sys; from pathlib import Path
from llmrun.bench import raw_batched
print(raw_batched(Path(sys.argv[1]), int(sys.argv[2]), 96, $(nproc))[1])" "$MODEL" "$2"
}
for n in 1 4; do
  a=() b=()
  for _ in $(seq "$ROUNDS"); do a+=("$(one "$A" "$n")"); b+=("$(one "$B" "$n")"); done
  python3 - "$n" "${a[*]}" "${b[*]}" <<'PY'
import statistics, sys
n, a, b = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
ma, mb = statistics.median(a), statistics.median(b)
print(f"{n} sequences: A {ma:.1f} tok/s, B {mb:.1f} tok/s, B/A {mb / ma:.3f}  "
      f"(A {min(a):.1f}-{max(a):.1f}, B {min(b):.1f}-{max(b):.1f}, {len(a)} runs each)")
PY
done
