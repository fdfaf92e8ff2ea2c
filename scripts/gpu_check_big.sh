# The 8B-class part of the GPU check (GPU_CHECK_STAGE=big scripts/gpu_check.sh), sourced by it
# after the build, with its WORK, OUTDIR, CARRY, PY, BACKEND, step, fail and pids.
# shellcheck shell=bash
step "the 8B-class model: Qwen2.5-7B's shape, random weights, Q4_K_M"
if [ ! -f "$WORK/qwen7b.gguf" ]; then
  "$PY" "$ROOT/scripts/gguf_skeleton.py" build "$CARRY/models/qwen7b.json.xz" \
    "$WORK/qwen7b-f16.gguf" || fail "building the 8B-class model"
  "$WORK/build/bin/llama-quantize" "$WORK/qwen7b-f16.gguf" "$WORK/qwen7b.gguf" Q4_K_M \
    "$(nproc)" > "$WORK/quantize-qwen7b.log" 2>&1 || fail "quantizing the 8B-class model"
  rm -f "$WORK/qwen7b-f16.gguf"
fi
ls -la "$WORK/qwen7b.gguf"
ngl=99; [ "$BACKEND" = cuda ] || ngl=0

export LLMRUN_HOME="$WORK/home-big" LLMRUN_HOST="127.0.0.1:18434" LLMRUN_NUM_PARALLEL=64 \
  LLMRUN_CONTEXT_LENGTH=2048
rm -rf "$LLMRUN_HOME"
printf 'FROM %s\n' "$WORK/qwen7b.gguf" > "$WORK/Modelfile.qwen7b"
printf 'FROM %s\nPARAMETER num_gpu 14\n' "$WORK/qwen7b.gguf" > "$WORK/Modelfile.qwen7b-half"
"$PY" -m llmrun create qwen7b -f "$WORK/Modelfile.qwen7b" > /dev/null || fail "create"
"$PY" -m llmrun create qwen7b-half -f "$WORK/Modelfile.qwen7b-half" > /dev/null || fail "create"
"$PY" -m llmrun serve > "$OUTDIR/llmrun-serve-big.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do curl -sf "http://$LLMRUN_HOST/api/version" > /dev/null && break; sleep 0.2; done

step "llama-server, the same build: 64 slots of 2048 tokens, all layers on the GPU"
"$WORK/build/bin/llama-server" -m "$WORK/qwen7b.gguf" -ngl "$ngl" -np 64 -c $((64 * 2048)) \
  -fa on --host 127.0.0.1 --port 18080 --no-webui > "$OUTDIR/llama-server-big.log" 2>&1 &
ls_pid=$!
pids+=("$ls_pid")
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:18080/health > /dev/null && break; sleep 0.2; done
"$PY" -m llmrun run qwen7b -o num_predict=4 "Hi" > /dev/null
"$PY" -m llmrun ps

step "llmrun bench --against llama-server: the 8B-class model at 1, 4, 16 and 64 streams"
"$PY" -m llmrun bench qwen7b --levels 1,4,16,64 --tokens 128 --rounds 2 --no-baselines \
  --no-prefix --constrained "" --against http://127.0.0.1:18080 --against-model qwen7b \
  | tee "$OUTDIR/bench-big.txt" || fail "bench"
kill "$ls_pid"; wait "$ls_pid" 2>/dev/null

step "a 16k-token prompt read alone, against llama-server (one slot of 32768 each)"
kill "${pids[0]}"; wait "${pids[0]}" 2>/dev/null
LLMRUN_NUM_PARALLEL=1 LLMRUN_CONTEXT_LENGTH=32768 "$PY" -m llmrun serve \
  > "$OUTDIR/llmrun-serve-16k.log" 2>&1 &
pids+=($!)
"$WORK/build/bin/llama-server" -m "$WORK/qwen7b.gguf" -ngl "$ngl" -np 1 -c 32768 \
  -fa on --host 127.0.0.1 --port 18080 --no-webui > "$OUTDIR/llama-server-16k.log" 2>&1 &
ls_pid=$!
pids+=("$ls_pid")
for _ in $(seq 1 600); do
  curl -sf http://127.0.0.1:18080/health > /dev/null \
    && curl -sf "http://$LLMRUN_HOST/api/version" > /dev/null && break
  sleep 0.2
done
"$PY" "$ROOT/scripts/prefill_vs.py" "http://$LLMRUN_HOST" qwen7b http://127.0.0.1:18080 \
  15500 2 | tee "$OUTDIR/prefill-big.txt" || echo "(the 16k read failed)"
kill "$ls_pid"; wait "$ls_pid" 2>/dev/null

step "half the layers on the GPU: num_gpu 14 against llama-server -ngl 14"
"$WORK/build/bin/llama-server" -m "$WORK/qwen7b.gguf" -ngl 14 -np 4 -c $((4 * 2048)) \
  -fa on --host 127.0.0.1 --port 18080 --no-webui > "$OUTDIR/llama-server-half.log" 2>&1 &
ls_pid=$!
pids+=("$ls_pid")
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:18080/health > /dev/null && break; sleep 0.2; done
"$PY" -m llmrun run qwen7b-half -o num_predict=4 "Hi" > /dev/null
"$PY" -m llmrun ps | tee "$OUTDIR/ps-half.txt"
"$PY" -m llmrun bench qwen7b-half --levels 1,4 --tokens 64 --rounds 2 --no-baselines \
  --no-prefix --constrained "" --against http://127.0.0.1:18080 --against-model qwen7b-half \
  | tee "$OUTDIR/bench-half.txt" || fail "bench (half on the GPU)"
step "the 8B-class part done in $SECONDS s"
