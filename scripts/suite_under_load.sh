#!/usr/bin/env bash
# The suite's dependability check: `.ci/run` five times in a row on a fresh clone,
# with a one-core busy loop beside it the whole time. Stops at the first failure.
#   scripts/suite_under_load.sh [COMMIT] [RUNS]     results in /tmp/suite-under-load/summary
set -u
COMMIT=${1:-HEAD}
RUNS=${2:-5}
SRC=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
COMMIT=$(git -C "$SRC" rev-parse "$COMMIT")
OUT=/tmp/suite-under-load
rm -rf "$OUT" && mkdir -p "$OUT/clone"
git clone -q "$SRC" "$OUT/clone" && cd "$OUT/clone" && git checkout -q "$COMMIT"
echo "commit $COMMIT" > "$OUT/summary"
python3 -c "while True: pass" &
HOG=$!
trap 'kill $HOG 2>/dev/null' EXIT
for i in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  if .ci/run > "$OUT/run$i.log" 2>&1; then rc=0; else rc=$?; fi
  echo "run $i rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$OUT/run$i.log")" >> "$OUT/summary"
  [ "$rc" -ne 0 ] && break
done
echo finished >> "$OUT/summary"
