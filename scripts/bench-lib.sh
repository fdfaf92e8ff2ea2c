# What the scripts that run llmrun beside llama-server share (sourced, after ROOT, PY,
# THREADS, LS_PORT and LR_PORT are set): the ports checked free, a work folder and the
# processes started, both gone on exit, a scratch llmrun daemon, llama-server, waiting for
# either to answer.
# shellcheck shell=bash

for port in "$LS_PORT" "$LR_PORT"; do  # a server left from an earlier run would be measured
  if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
    echo "port $port already answers: stop that server first (or set LS_PORT / LR_PORT)" >&2
    exit 1
  fi
done
WORK=$(mktemp -d)
pids=()
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
cleanup() { for p in "${pids[@]}"; do stop "$p"; done; rm -rf "$WORK"; }
trap cleanup EXIT

wait_for() {  # wait_for URL: until it answers (a minute at most)
  for _ in $(seq 1 300); do
    curl -sf "$1" > /dev/null && return 0
    sleep 0.2
  done
}

# The daemon's settings: its own store, the same threads as llama-server, SLOTS slots (4 unless
# set) of CTX tokens (4096 unless set) each, in both servers.
SLOTS=${SLOTS:-4}
CTX=${CTX:-4096}
export LLMRUN_HOME="$WORK/home" LLMRUN_HOST="127.0.0.1:$LR_PORT" LLMRUN_NUM_THREADS="$THREADS" \
  LLMRUN_NUM_PARALLEL="$SLOTS" LLMRUN_CONTEXT_LENGTH="$CTX"

create_model() {  # create_model NAME GGUF [Modelfile lines]
  local name=$1 gguf=$2; shift 2
  { printf 'FROM %s\n' "$gguf"; for line in "$@"; do printf '%s\n' "$line"; done; } \
    > "$WORK/Modelfile.$name"
  "$PY" -m llmrun create "$name" -f "$WORK/Modelfile.$name" > /dev/null
}

start_llmrun() {  # the daemon, in the background until the script ends
  "$PY" -m llmrun serve > "$WORK/llmrun.log" 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$LR_PORT/api/version"
}

start_llama_server() {  # start_llama_server SERVER GGUF [flags]: its pid in LS_PID
  local server=$1 gguf=$2; shift 2
  "$server" -m "$gguf" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * CTX)) "$@" \
    --host 127.0.0.1 --port "$LS_PORT" --no-webui > "$WORK/llama-server.log" 2>&1 &
  LS_PID=$!
  pids+=("$LS_PID")
  wait_for "http://127.0.0.1:$LS_PORT/health"
}
