#!/usr/bin/env bash
# Load benchmark: the real `tether serve` over WebSockets beside mlx-lm's server
# (mlx_lm.server, same MLX version, same weights in the same precision: Tether
# with --weights dense = float32 on CPU, mlx-lm on the float32 HF conversion of
# the same GGUF made by bench/peer/setup.sh) and llama.cpp's server on the GGUF
# itself (bench/peer/llamacpp.sh; its /completion, 32 slots), driven by
# bench/load.py, in one run, then a side-by-side table with ratios tether /
# mlx-lm and tether / llama.cpp. Compare Tether's quantized path
# (TETHER_WEIGHTS=quantized) with llama.cpp: both then read the same file.
#
#   decode   aggregate decode tok/s and TTFT at 1, 8 and 32 concurrent streams
#            (prompt ~32 tokens, 64 tokens each, every stream runs to max_tokens)
#   admit    ITL p50/p99 of 8 decoding streams while a 2,000-token prompt is
#            prefilled, and that prompt's TTFT; Tether with chunked prefill (the
#            server's default chunk) and "unchunked" (chunk_size 4096 on the long
#            request, capped by the server); mlx-lm with its default
#            --prefill-step-size 2048 (unchunked for this prompt) and, on a second
#            server, --prefill-step-size $MLX_CHUNK (chunked, like Tether's default).
#   agent    (WORKLOAD=agent, instead of the two above) one 12-turn agent
#            conversation whose history grows to ~4,300 tokens (each turn: ~310-340
#            new user tokens plus the previous reply; 32 greedy tokens), TTFT per
#            turn: Tether with its session prefix cache (one session) and without
#            (a fresh session per turn), mlx-lm with its prompt cache
#            (/v1/completions, default prefill step); ratios at turn 12.
#            About 4 minutes on a quiet 2-core x86 CPU (Tether without the
#            cache is most of it).
# See bench/load.py's header for the exact definitions.
#
# One server at a time (never two: the CPU is shared), each on 127.0.0.1 and a
# free port, killed when its part is over and on any exit. Every request loop is
# bounded in count and time. Defaults take about 5-6 minutes on a 2-core x86 CPU.
#
# usage: bench/load.sh
#        WORKLOAD=agent bench/load.sh
# env:   WORKLOAD=serving           serving (decode + admit) or agent
#        MODELS="smollm2-135m"      known model names (space-separated), or .gguf files
#                                   (e.g. a random one of tests/reference/qwen35.py
#                                   --size 0.8b): then TOKENIZER_DIR names the HF folder
#                                   of its tokenizer (prompt sizing), and mlx-lm is skipped
#        TETHER_WEIGHTS=dense       dense (float32 on CPU, mlx-lm's precision) or quantized
#        TETHER_DEVICE=cpu          --device for tether serve
#        TETHER_ARGS="..."          extra `tether serve` flags (e.g. "--min-prefill-chunk 8")
#        MLX_CHUNK=256              mlx-lm's chunked prefill step ("" skips that server)
#        LOAD_ARGS="..."            extra bench/load.py arguments, for both engines
#                                   (e.g. "--streams 1,8 --max-tokens 128 --long-prompt-tokens 1000")
#        REPS=1                     repeat everything (engines interleaved); the table shows medians
#        OUT=DIR                    where results.jsonl and the server logs go (default: a temp dir)
#        RESULTS=FILE               append the JSON lines here instead of $OUT/results.jsonl
#        WITH_MLX_LM=0              skip mlx-lm (e.g. a rerun of this build beside PREV_BIN)
#        WITH_LLAMACPP=0            skip llama.cpp's server (its
#                                   first build takes ~7 minutes, then it is cached)
#        PREV_BIN=PATH              a previous build's `tether` binary, run right after
#                                   this build with the same flags and script; the tables
#                                   get "prev" and "new/prev" columns. One way to build it:
#                                   git worktree add /tmp/prev REV && (cd /tmp/prev &&
#                                   cargo build --release -p tether); PREV_BIN=/tmp/prev/target/release/tether
set -euo pipefail
cd "$(dirname "$0")/.."
# TETHER_BIN=PATH measures that binary as it is (no build).
TETHER_BIN="${TETHER_BIN:-}"
REPO="$PWD"
MODELS=${MODELS:-smollm2-135m}
TETHER_WEIGHTS=${TETHER_WEIGHTS:-dense}
TETHER_DEVICE=${TETHER_DEVICE:-cpu}
MLX_CHUNK=${MLX_CHUNK-256}
REPS=${REPS:-1}
WORKLOAD=${WORKLOAD:-serving}
case "$WORKLOAD" in
  serving) TETHER_WORK=decode,admit; RUN_LIMIT=900 ;;
  agent) TETHER_WORK=agent; MLX_CHUNK=""; RUN_LIMIT=2400 ;;
  *) echo "WORKLOAD must be serving or agent, not '$WORKLOAD'" >&2; exit 2 ;;
esac
PEER="${TETHER_CACHE:-$HOME/.cache/tether}/peer"
PY="$PEER/venv/bin/python"
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
RESULTS=${RESULTS:-$OUT/results.jsonl}
read -r -a EXTRA <<<"${LOAD_ARGS:-}"
read -r -a SERVE_EXTRA <<<"${TETHER_ARGS:-}"

log() { printf '[load.sh] %s\n' "$*" >&2; }
# shellcheck source=bench/lib.sh
. bench/lib.sh

if [ -z "$TETHER_BIN" ]; then
  cargo build --release --locked -p tether
  TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"
fi
# The code measured: the commit, "+wt" when the working tree differs from it.
BUILD="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo +wt)"
# A given binary is labelled by its file name (name it after its commit).
[ "$TETHER_BIN" = "${CARGO_TARGET_DIR:-target}/release/tether" ] || BUILD="$(basename "$TETHER_BIN")"
# Known names get their peer folders; .gguf files bring their own (TOKENIZER_DIR).
read -r -a NAMED <<<"$(printf '%s\n' $MODELS | grep -v '\.gguf$' | xargs)"
[ "${#NAMED[@]}" = 0 ] || bench/peer/setup.sh "${NAMED[@]}" >&2

echo "# load benchmark ($WORKLOAD) $(date -u +%FT%TZ): $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)" >"$OUT/header.txt"
[ -n "${PREV_BIN:-}" ] && echo "# previous build (prev): $PREV_BIN ($(git -C "$(dirname "$PREV_BIN")" rev-parse --short HEAD 2>/dev/null || echo unknown))" >>"$OUT/header.txt"

for m in $MODELS; do
 for rep in $(seq "$REPS"); do
  log "$m: run $rep of $REPS"
  dir="$PEER/models/$m-f32" label="$m"
  case "$m" in *.gguf) dir="${TOKENIZER_DIR:?a .gguf model needs TOKENIZER_DIR}" label=$(basename "$m" .gguf) ;; esac
  common=(--model-dir "$dir" --label "$label" --out "$RESULTS" --build "$BUILD" "${EXTRA[@]}")

  # Tether: this build, then the previous one when PREV_BIN names it.
  engines=("tether:$TETHER_BIN")
  [ -n "${PREV_BIN:-}" ] && engines+=("tether-prev:$PREV_BIN")
  for engine_bin in "${engines[@]}"; do
    engine="${engine_bin%%:*}" bin="${engine_bin#*:}"
    tlog="$OUT/$engine-$label.log"
    start_tether "$bin" "$tlog" --model "$m" --device "$TETHER_DEVICE" --weights "$TETHER_WEIGHTS" "${SERVE_EXTRA[@]}"
    log "$engine ($m, $TETHER_WEIGHTS weights) on :$port"
    timeout "$RUN_LIMIT" "$PY" bench/load.py --engine "$engine" --url "http://127.0.0.1:$port" --workloads "$TETHER_WORK" \
      "${common[@]}" || log "$engine run failed (rc $?)"
    stop_server
  done

  # llama.cpp's server on the GGUF Tether serves: decode + admission, or the agent.
  if [ "${WITH_LLAMACPP:-1}" != 0 ]; then
    llama_server=$(bench/peer/llamacpp.sh)
    case "$m" in *.gguf) gguf="$m" ;; *) gguf=$("$TETHER_BIN" fetch-model "$m" 2>/dev/null | tail -1) ;; esac
    llog="$OUT/llamacpp-$label.log"
    port=$(free_port)
    # Serving: 32 slots of 4,608 tokens (the 32-stream decode and the
    # 2,000-token admission fit). The agent: one slot of 8,192 (its prompt
    # cache as llama.cpp's defaults keep it).
    slots=(-np 32 -c 147456) work=decode,admit
    [ "$WORKLOAD" = agent ] && slots=(-np 1 -c 8192) work=agent
    "$llama_server" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$(nproc)" -tb "$(nproc)" "${slots[@]}" --no-webui >"$llog" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$port/health" "$llog" 180
    log "llama.cpp ($m, $(basename "$gguf")) on :$port"
    timeout "$RUN_LIMIT" "$PY" bench/load.py --engine llama.cpp --url "http://127.0.0.1:$port" --workloads "$work" \
      "${common[@]}" || log "llama.cpp run failed (rc $?)"
    stop_server
  fi

  # mlx-lm, default prefill step (2048): decode + unchunked admission (or the agent)
  steps=(2048)
  [ -n "$MLX_CHUNK" ] && steps+=("$MLX_CHUNK")
  [ "${WITH_MLX_LM:-1}" = 0 ] && steps=()
  case "$m" in *.gguf) steps=() ;; esac
  for step in "${steps[@]}"; do
    mlog="$OUT/mlx-lm-$label-step$step.log"
    port=$(free_port)
    "$PEER/venv/bin/mlx_lm.server" --model "$dir" --host 127.0.0.1 --port "$port" --prefill-step-size "$step" >"$mlog" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$port/health" "$mlog" 180
    log "mlx-lm ($m, float32, prefill step $step) on :$port"
    if [ "$WORKLOAD" = agent ]; then work=agent; elif [ "$step" = 2048 ]; then work=decode,admit; else work=admit; fi
    timeout "$RUN_LIMIT" "$PY" bench/load.py --engine mlx-lm --url "http://127.0.0.1:$port" --workloads "$work" \
      --mlx-prefill-step "$step" "${common[@]}" || log "mlx-lm run failed (rc $?)"
    stop_server
  done
 done
done

echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/header.txt"
cat "$OUT/header.txt"
echo "# tether: --weights $TETHER_WEIGHTS --device $TETHER_DEVICE ${TETHER_ARGS:-}; mlx-lm $("$PY" -c 'import importlib.metadata as m; print(m.version("mlx-lm"), "on mlx", m.version("mlx"))') float32"
"$PY" bench/load.py --report "$RESULTS"
echo "raw results: $RESULTS"
