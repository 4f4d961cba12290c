#!/usr/bin/env bash
# Edge overhead: one `tether serve`, driven by bench/load.py's decode workload
# over its WebSocket edge (/v1/ws, engine `tether`), its OpenAI HTTP edge
# (/v1/completions streamed as server-sent events, `tether-openai`) and its
# llama.cpp edge (/completion streamed, `tether-llamacpp`), in turn REPS
# times on the same server (so every edge sees the same machine state), then
# a table of TTFT and aggregate tok/s per edge at 1 and 32 streams with the
# ratio edge / ws. The same prompts reach the engine on every edge (raw
# counting prompts, see bench/load.py), so the difference is the edge: HTTP
# parsing, tenant lookup, SSE framing, one request per stream. The CPU
# seconds of the server and of the load generator are recorded per run: on
# a 2-core machine they share the cores, so a heavier client wire (larger
# SSE chunks to parse) slows the server too. (The
# Responses API takes chat input only, so its prompts differ: not here.)
#
# usage: bench/edges.sh
# env:   MODEL=smollm2-135m  TETHER_WEIGHTS=dense  TETHER_DEVICE=cpu
#        REPS=3              rounds (each: ws, openai, llamacpp)
#        STREAMS=1,32        LOAD_ARGS="..." extra bench/load.py arguments
#        TETHER_BIN=PATH     measure that binary (no build)
#        OUT=DIR             results.jsonl and the server log (default: a temp dir)
# About 2 minutes on a 2-core x86 CPU with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
REPS=${REPS:-3}
STREAMS=${STREAMS:-1,32}
PEER="${TETHER_CACHE:-$HOME/.cache/tether}/peer"
PY="$PEER/venv/bin/python"
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
read -r -a EXTRA <<<"${LOAD_ARGS:-}"

log() { printf '[edges.sh] %s\n' "$*" >&2; }
# shellcheck source=bench/lib.sh
. bench/lib.sh

if [ -z "${TETHER_BIN:-}" ]; then
  cargo build --release --locked -p tether
  TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"
fi
BUILD="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo +wt)"
bench/peer/setup.sh "$MODEL" >&2

start_tether "$TETHER_BIN" "$OUT/tether.log" --model "$MODEL" --device "${TETHER_DEVICE:-cpu}" --weights "${TETHER_WEIGHTS:-dense}"
log "tether ($MODEL) on :$port"
# Every run counts from its own numbers: no prompt is one the server has cached.
first=1000
for rep in $(seq "$REPS"); do
  for engine in tether tether-openai tether-llamacpp; do
    log "round $rep of $REPS: $engine"
    first=$((first + 100000))
    timeout 900 "$PY" bench/load.py --engine "$engine" --url "http://127.0.0.1:$port" --workloads decode --streams "$STREAMS" --first-number "$first" --server-pid "$SERVER_PID" \
      --model-dir "$PEER/models/$MODEL-f32" --label "$MODEL" --out "$RESULTS" --build "$BUILD" "${EXTRA[@]}"
  done
done
stop_server

echo "# edge overhead $(date -u +%FT%TZ): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; build $BUILD; load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" bench/load.py --report "$RESULTS"
echo "raw results: $RESULTS"
