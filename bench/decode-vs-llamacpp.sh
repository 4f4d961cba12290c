#!/usr/bin/env bash
# One-stream decode of a GGUF on the CPU: Tether (`tether serve`, the GGUF as
# it is) beside llama.cpp's server (bench/peer/llamacpp.sh) on the same file,
# both driven by bench/completion_decode.py over llama.cpp's /completion.
# The servers run one at a time (2 cores), alternating ROUNDS times: a
# previous Tether build if PREV_BIN names one (plain decode), this build with
# speculation off (plain decode, as llama.cpp's server runs by default) and
# with its CPU default (prompt-lookup drafts), then llama.cpp. The table
# gives each one's median and the ratios to llama.cpp.
#
# usage: bench/decode-vs-llamacpp.sh
# The AVX2 comparison on any x86 CPU: TETHER_CPU_ISA=avx2 LLAMACPP_ISA=avx2 (both
# restricted to AVX2; see bench/peer/llamacpp.sh).
# env:   MODEL=gemma3-270m (any known model or .gguf)   ROUNDS=3   REQUESTS=3
#        N_PREDICT=128   TETHER_BIN=PATH (no build)   PREV_BIN=PATH (a previous
#        build, e.g. one built from an older commit)   OUT=DIR (default: a temp dir)
# About 3 minutes on a 2-core x86 CPU with the defaults (after the peer's build).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-gemma3-270m}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
log() { printf '[decode-vs-llamacpp.sh] %s\n' "$*" >&2; }
# shellcheck source=bench/lib.sh
. bench/lib.sh

if [ -z "${TETHER_BIN:-}" ]; then
  cargo build --release --locked -p tether
  TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"
fi
LLAMA_SERVER=$(bench/peer/llamacpp.sh)
GGUF=$("$TETHER_BIN" fetch-model "$MODEL" 2>/dev/null | tail -1)
BUILD="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo +wt)"
drive() {
  python3 bench/completion_decode.py --url "http://127.0.0.1:$port" --server "$1" --label "$MODEL" --out "$RESULTS" \
    --build "$BUILD" --requests "${REQUESTS:-3}" --n-predict "${N_PREDICT:-128}" --first "$2"
}
for round in $(seq "$ROUNDS"); do
  if [ -n "${PREV_BIN:-}" ]; then
    log "round $round of $ROUNDS: previous tether build, speculation off"
    start_tether "$PREV_BIN" "$OUT/tether-prev.log" --model "$GGUF" --device cpu --speculation off
    drive tether-prev $((round * 1000 + 700))
    stop_server
  fi
  for speculation in off auto; do
    log "round $round of $ROUNDS: tether, speculation $speculation"
    start_tether "$TETHER_BIN" "$OUT/tether.log" --model "$GGUF" --device cpu --speculation "$speculation"
    drive "tether-spec-$speculation" $((round * 1000 + ${#speculation} * 100))
    stop_server
  done
  log "round $round of $ROUNDS: llama.cpp"
  port=$(free_port)
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" -t 2 -tb 2 -c 8192 -np 1 --no-webui >"$OUT/llamacpp.log" 2>&1 &
  SERVER_PID=$!
  wait_http "http://127.0.0.1:$port/health" "$OUT/llamacpp.log" 120
  drive llama.cpp $((round * 1000 + 500))
  stop_server
done

echo "# one-stream decode, $MODEL, $(date -u +%FT%TZ): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; build $BUILD"
python3 - "$RESULTS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = {}
servers = [s for s in ("tether-prev", "tether-spec-off", "tether-spec-auto", "llama.cpp") if any(r["server"] == s for r in rows)]
for server in servers:
    mine = [r for r in rows if r["server"] == server]
    med[server] = {k: statistics.median(r[k] for r in mine) for k in ("decode_tok_s", "ttft_s")}
    print(f"{server:17s} decode {med[server]['decode_tok_s']:7.1f} tok/s   TTFT {med[server]['ttft_s'] * 1000:7.1f} ms   ({len(mine)} requests)")
for server in servers[:-1]:
    print(f"{server} / llama.cpp: decode {med[server]['decode_tok_s'] / med['llama.cpp']['decode_tok_s']:.2f}x, "
          f"TTFT {med[server]['ttft_s'] / med['llama.cpp']['ttft_s']:.2f}x (lower is faster)")
PY
echo "results: $RESULTS"
