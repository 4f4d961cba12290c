#!/usr/bin/env bash
# Structured outputs: what a JSON-Schema constraint costs per token and what
# grammar-forced drafts buy, on Tether and on llama.cpp's server (its
# json_schema -> GBNF grammar), same GGUF, same raw ChatML prompts, greedy,
# 1 and 32 concurrent requests (bench/structured.py says exactly what is
# measured). One server at a time; about 40 minutes on a 2-core x86 CPU
# (STREAMS=1: about 6).
#
# usage: bench/structured.sh
# env:   MODELS="qwen2.5-coder-0.5b"   known model names (space-separated)
#        STREAMS=1,32                  concurrent requests per measurement
#        REPS=1                        repeat everything (engines interleaved); medians
#        ROUNDS=1                      requests of new prompts per setting on one server; medians
#        WITH_LLAMACPP=0               skip llama.cpp's server
#        SAME_SERVER=1                 instead: what the constraint alone costs: plain and
#                                      schema requests alternating round by round on one
#                                      server (no drafts), with the median step time of
#                                      constrained and plain decode steps from its step trace
#        OUT=DIR                       results.jsonl and server logs (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[structured] $*" >&2; }
source bench/lib.sh
MODELS=${MODELS:-qwen2.5-coder-0.5b}
STREAMS=${STREAMS:-1,32}
REPS=${REPS:-1}
OUT=${OUT:-$(mktemp -d /tmp/tether-structured.XXXXXX)}
PEER="${TETHER_CACHE:-$HOME/.cache/tether}/peer"
bench/peer/setup.sh >/dev/null
PY="$PEER/venv/bin/python"
TETHER_BIN="${TETHER_BIN:-}"
if [ -z "$TETHER_BIN" ]; then
  cargo build --release --locked -p tether
  TETHER_BIN=target/release/tether
fi
mkdir -p "$OUT"
if [ "${SAME_SERVER:-0}" = 1 ]; then
  for m in $MODELS; do
    TETHER_TRACE_STEPS=1 start_tether "$TETHER_BIN" "$OUT/tether-$m-steps.log" --model "$m" --device cpu --speculation off
    "$PY" bench/structured.py --engine tether --url "http://127.0.0.1:$port" --label "$m" --streams "$STREAMS" --settings plain,schema \
      --rounds "${ROUNDS:-4}" --interleave --out "$OUT/results.jsonl"
    stop_server
    "$PY" bench/structured.py --steps "$OUT/tether-$m-steps.log"
  done
  "$PY" bench/structured.py --report "$OUT/results.jsonl"
  log "results: $OUT/results.jsonl"
  exit 0
fi
# A fresh server for every setting: what one run's scheduler learns (the
# prefill allowance, the draft bar) must not carry into the next.
for rep in $(seq "$REPS"); do
  for m in $MODELS; do
    for setting in plain schema schema+ff; do
      # --speculation off: a constrained request's only drafts are then its
      # grammar's forced tokens (schema+ff); plain and schema ask for none.
      start_tether "$TETHER_BIN" "$OUT/tether-$m.log" --model "$m" --device cpu --speculation off
      "$PY" bench/structured.py --engine tether --url "http://127.0.0.1:$port" --label "$m" --streams "$STREAMS" --settings "$setting" --rounds "${ROUNDS:-1}" \
        --out "$OUT/results.jsonl"
      stop_server
    done
    if [ "${WITH_LLAMACPP:-1}" != 0 ]; then
      llama_server=$(bench/peer/llamacpp.sh)
      gguf=$("$TETHER_BIN" fetch-model "$m" 2>/dev/null | tail -1)
      for setting in plain schema; do
        port=$(free_port)
        "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$(nproc)" -tb "$(nproc)" -np 32 -c 32768 --no-webui >"$OUT/llamacpp-$m.log" 2>&1 &
        SERVER_PID=$!
        wait_http "http://127.0.0.1:$port/health" "$OUT/llamacpp-$m.log" 180
        "$PY" bench/structured.py --engine llama.cpp --url "http://127.0.0.1:$port" --label "$m" --streams "$STREAMS" --settings "$setting" --rounds "${ROUNDS:-1}" \
          --out "$OUT/results.jsonl"
        stop_server
      done
    fi
  done
done
"$PY" bench/structured.py --report "$OUT/results.jsonl"
log "results: $OUT/results.jsonl"
