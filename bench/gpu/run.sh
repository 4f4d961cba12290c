#!/usr/bin/env bash
# Decode/prefill benchmark on an NVIDIA GPU machine, Tether beside mlx-lm on
# the same random-weight Qwen2.5-0.5B/1.5B-shaped checkpoints (bf16 and MLX
# 4-bit), in one run. Needs, in $KEEP: the MLX CUDA wheel's two halves
# (part_aa, part_ab: see the device notes), the `mlx` and `mlx-lm` wheels for
# the machine's Python, and a Qwen tokenizer.json + tokenizer_config.json;
# and a `tether` binary built against MLX 0.32.4 (TETHER_BIN).
# Prints a table; full logs go to $OUT (or /tmp/tether-gpu-bench).
# MODE=decode (default): single-stream prefill/decode beside mlx-lm.
# MODE=streams: aggregate decode through Tether's engine at 1 and 32
# concurrent streams (continuous batching), with the decoding rows' KV
# batched and per row, one JSON line per measurement.
# MODE=serving: bench/load.py's decode (1, 8, 32 streams) and admit (ITL
# while a 2,000-token prompt joins) workloads against `tether serve` and
# mlx_lm.server on the 1.5B-shaped bf16 checkpoint.
# MODE=spec: the speculative-decoding benchmark (code-edit and FIM
# workloads, 1 and 8 streams, speculation off vs echo) on real weights, in
# bfloat16 and float32: Qwen2.5-Coder-0.5B's GGUF reassembled from
# $KEEP/qwen05_part_*, else SmolLM2-135M's from $KEEP/smol_part_* (edit
# only; random weights would make acceptance meaningless).
# SERVE_SWEEP (with MODE=serving or agent): Tether alone, one server per
# `;`-separated set of extra `serve` flags, e.g.
# SERVE_SWEEP="--max-itl-inflation 1 --prefill-chunk 32;--max-itl-inflation 1 --prefill-chunk 128".
# MODE=profile: engine step phases (host vs device) at 1 and 8 streams, and
# the plain decode loop, with CUDA graphs on and off (SmolLM2-135M GGUF).
# MODE=graphs: the engine at 1 and 32 streams on the 1.5B-shaped bf16
# checkpoint with MLX's CUDA graphs off (the server default) and on, cut every
# 20 operations (MLX's default), 60, 200 and 1000 (MLX_MAX_OPS_PER_BUFFER),
# interleaved, two rounds.
# MODE=structured: bench/structured.py (plain, JSON-Schema constrained,
# constrained with grammar-forced drafts; 1 and 32 streams; a fresh server
# per setting) against `tether serve` on the random Qwen2.5-0.5B-shaped bf16
# checkpoint: what the token masks cost when a step takes milliseconds.
# SAME_SERVER=1: plain and schema alternating on one server per build
# (TETHER_BINS="old new"), step traces compared (bench/structured.sh says more).
# Needs aiohttp's wheels (for the machine's Python) in $KEEP/aiohttp.
# MODE=sessions: bench/sessions.py (SESSIONS sessions of a shared prefix
# plus their own text, detached, then each one more turn in random order)
# on the random Qwen2.5-1.5B-shaped bf16 checkpoint: `tether serve` with its
# prefix cache holding every session (hot), with RAM_MIB of it and a disk
# tier (disk), and without the tier (dropped); `host`: HOT_MIB of device
# memory and a host tier of HOST_MIB behind it. Needs aiohttp's wheels.
# HOT_MIB: the hot server's prefix-cache budget in device memory (64 GiB;
# what it cannot hold a returning session computes again).
# MODE=admit: bench/load.py's admit workload (a 2,000-token prompt joining 8
# decoding streams; ADMIT_ROUNDS, default 3, prompts per setting, so later
# ones meet the prefill allowance the first taught; then a 2,000-token prompt
# alone, three times) against each build of
# TETHER_BINS ("old new", one server at a time; SERVE_SWEEP: once per set of
# extra `serve` flags), then mlx_lm.server (MLX_LM=0: not), on the random
# Qwen2.5-1.5B-shaped bf16 checkpoint. Needs aiohttp's wheels.
# TETHER_TRACE_STEPS=1: each server logs its steps (tether-serve-*.log).
# MODE=builds: builds side by side after a refactor, in-process through the
# engine on the random Qwen2.5-1.5B-shaped bf16 checkpoint: one stream and 32
# streams (decode tok/s), and the speculation benchmark at 1 and 8 streams,
# which checks that outputs with drafts equal those without; each build of
# TETHER_BINS ("old new") in turn, ROUNDS (2) times. Needs only the wheel's
# halves and a Qwen tokenizer in $KEEP.
# MODE=kvcodes: 8- and 4-bit KV in the batched slots (server/src/models/
# kv_batch.rs) beside bfloat16 on the random Qwen2.5-1.5B-shaped checkpoint:
# the fused attention's codes variant against MLX's ops on the same codes,
# both against float32 (`--gpu-kernels` with `--kv-bits`); decode through
# the engine at 1 and 8 streams after a HISTORY-token (3,900) prompt, each
# build of TETHER_BINS in bfloat16 and the newest in 8 bits, ROUNDS (2)
# rounds interleaved (the first also 4 bits, and bfloat16 and 8 bits at 32
# streams, past the fused kernels' 8 rows); and the quality bench
# (`--kv-quality`) in the slots.
# MODE=kernels: the fused decode step (models/gpu) beside MLX's ops on
# random checkpoints of MODELS' shapes (default: qwen2.5-1.5b qwen2.5-0.5b
# qwen3-0.6b llama-135m): `tether bench --gpu-kernels 1,2,4,8` (logits'
# distance, top-1 agreement, primitives and time per step); then, on the
# 1.5B shape, the engine at 1 and 32 streams for each build of TETHER_BINS
# ("old new"), the last build also with TETHER_GPU_KERNELS=0 and with MLX's
# CUDA graphs on (VARIANTS="mlx graphs"; sm2: two blocks a multiprocessor
# in the layer launches; nolook: with --lookahead off), ROUNDS (2) times; STREAMS (32: a list)
# instead of 32, KERNEL_ROWS (1,2,4,8) for the check, CHECK_MODELS (MODELS)
# to check fewer; one stream on the 7B shape (when in
# MODELS) per build; then one traced stream (primitives and host/device time
# per step).
# Needs only the wheel's halves and a Qwen tokenizer in $KEEP.
# MODE=peer: llama.cpp's server (built here by build-llamacpp.sh from
# $KEEP/llamacpp-src.tar.xz, CUDA, this GPU's architecture) beside `tether
# serve`, over the wire with bench/load.py's decode workload (STREAMS,
# default 1,1,32; 128-token prompts, MAX_TOKENS 256), one server at a time,
# on random checkpoints of MODELS' shapes (default qwen2.5-1.5b qwen2.5-7b):
# bf16 safetensors for Tether, the same tensors as an f16 GGUF for llama.cpp
# (hf_to_gguf.py, tokenizer metadata from $KEEP/tok.json.xz). stage-peer.sh
# stages both files here, in .gpu/lc. Each build of
# TETHER_BINS, the last also with each extra `serve` flag set of
# PEER_VARIANTS (`;`-separated; default "--lookahead off").
# MODE=agent: the 12-turn agent workload of bench/load.py (WORKLOAD=agent in
# bench/load.sh) on the random Qwen2.5-1.5B-shaped bf16 checkpoint: `tether
# serve` (session prefix cache on, and off) beside mlx_lm.server (its prompt
# cache), one server at a time, time to first token per turn.
set -euo pipefail
KEEP=${KEEP:-/root/keep}
TETHER_BIN=${TETHER_BIN:-./tether}
OUT=${OUT:-/tmp/tether-gpu-bench}
PY=${PY:-/opt/torch/.venv/bin/python}
NVIDIA=${NVIDIA:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia}
HBM_GB_S=${HBM_GB_S:-4800}   # H200 HBM3e peak
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" /opt/py /opt/models

if [ ! -f /opt/py/mlx/lib/libmlx.so ]; then
  cat "$KEEP"/part_aa "$KEEP"/part_ab > /tmp/mlx_cuda.whl
  cp /tmp/mlx_cuda.whl /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  # The Python mlx / mlx-lm wheels only for the modes with the mlx-lm peer.
  # shellcheck disable=SC2046
  "$PY" -m pip install -q --no-deps --target /opt/py /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl $(ls "$KEEP"/mlx-0.32.4-*.whl "$KEEP"/mlx_lm-*.whl 2>/dev/null)
  ln -sfn "$NVIDIA" /opt/py/nvidia
fi
export LD_LIBRARY_PATH=/opt/py/mlx/lib PYTHONPATH=/opt/py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "${MODE:-decode}" = profile ]; then
  # Where a step's time goes (host graph building vs device), through the
  # engine at 1 and 8 streams and through the plain decode loop, with and
  # without MLX's CUDA graphs, on SmolLM2-135M's GGUF.
  smol=/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$smol" ] || cat "$KEEP"/smol_part_* > "$smol"
  for graphs in 1 0; do
    MLX_USE_CUDA_GRAPHS=$graphs "$TETHER_BIN" bench --model "$smol" --device gpu --prompt-tokens 512 --gen-tokens 256 2>>"$OUT/tether.log" \
      | sed "s/^{/{\"cuda_graphs\":$graphs,/" | tee -a "$OUT/results.jsonl"
    MLX_USE_CUDA_GRAPHS=$graphs "$TETHER_BIN" bench --model "$smol" --device gpu --streams 8 --prompt-tokens 512 --gen-tokens 256 2>>"$OUT/tether.log" \
      | sed "s/^{/{\"cuda_graphs\":$graphs,/" | tee -a "$OUT/results.jsonl"
  done
  exit 0
fi
if [ "${MODE:-decode}" = spec ]; then
  # Qwen2.5-Coder-0.5B (the CPU runs' model, with FIM tokens: edit and FIM
  # workloads) when its parts are in $KEEP, else SmolLM2-135M (edit only).
  # bfloat16 (the GPU default: speed) and float32 (outputs must match).
  : > "$OUT/results.jsonl"
  if ls "$KEEP"/qwen05_part_* >/dev/null 2>&1; then
    model=/opt/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf
    [ -f "$model" ] || cat "$KEEP"/qwen05_part_* > "$model"
  else
    model=/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf
    [ -f "$model" ] || cat "$KEEP"/smol_part_* > "$model"
  fi
  for dtype in ${DTYPES:-bf16 f32}; do
    "$TETHER_BIN" bench --model "$model" --device gpu --dtype "$dtype" --speculation-streams 1,8 --max-draft "${MAX_DRAFT:-15}" 2>>"$OUT/tether.log" \
      | sed "s/^{/{\"model\":\"$(basename "$model" .gguf)\",\"dtype\":\"$dtype\",/" | tee -a "$OUT/results.jsonl"
  done
  exit 0
fi

# The agent workload needs only the 1.5B bf16 checkpoint; the other modes all four.
[ "${MODE:-decode}" = peer ] && MODELS=${MODELS:-qwen2.5-1.5b qwen2.5-7b}
[ "${MODE:-decode}" = kernels ] && MODELS=${MODELS:-qwen2.5-1.5b qwen2.5-0.5b qwen3-0.6b llama-135m qwen2.5-7b}
MODELS=${MODELS:-qwen2.5-0.5b qwen2.5-1.5b}
case "${MODE:-decode}" in admit|agent|serving|streams|graphs|builds) MODELS=qwen2.5-1.5b ;; esac
[ "${MODE:-decode}" = structured ] && MODELS=qwen2.5-0.5b
[ "${MODE:-decode}" = sessions ] && MODELS=qwen2.5-1.5b
[ "${MODE:-decode}" = kvcodes ] && MODELS=qwen2.5-1.5b
LOAD_ARGS=${LOAD_ARGS:-}
for m in $MODELS; do
  [ -f /opt/models/$m-bf16/model.safetensors ] || "$PY" "$here/make_random_model.py" /opt/models/$m-bf16 $m "$KEEP"
  case "${MODE:-decode}" in admit|agent|serving|graphs|structured|sessions|builds|kernels|peer|kvcodes) continue ;; esac
  [ -f /opt/models/$m-4bit/config.json ] || "$PY" -m mlx_lm convert --hf-path /opt/models/$m-bf16 --mlx-path /opt/models/$m-4bit -q --q-bits 4 --q-group-size 64 >"$OUT/convert-$m.log" 2>&1
done

: > "$OUT/results.jsonl"
if [ "${MODE:-decode}" = peer ]; then
  log() { echo "[peer] $*" >&2; }
  source "$here/../lib.sh"
  llama_server=$("$here/build-llamacpp.sh" "$KEEP/llamacpp-src.tar.xz")
  [ -f "$KEEP/tok.json" ] || "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$KEEP/tok.json.xz" "$KEEP/tok.json"
  bins=(${TETHER_BINS:-$TETHER_BIN})
  newest=${bins[${#bins[@]}-1]}
  IFS=';' read -ra variants <<< "${PEER_VARIANTS---lookahead off}"
  decode=(--workloads decode --streams "${STREAMS:-1,1,32}" --prompt-tokens 128 --max-tokens "${MAX_TOKENS:-256}" --out "$OUT/results.jsonl")
  for m in $MODELS; do
    dir=/opt/models/$m-bf16 gguf=/opt/models/$m-f16.gguf
    [ -f "$gguf" ] || "$PY" "$here/hf_to_gguf.py" "${LLAMACPP_ROOT:-/root/lc}/llama.cpp/gguf-py" "$dir" "$KEEP/tok.json" "$gguf" >>"$OUT/gguf.log" 2>&1
    port=$(free_port)
    "$llama_server" -m "$gguf" -ngl 999 -np 32 -c $((32 * 4608)) --host 127.0.0.1 --port "$port" --no-webui >"$OUT/llamacpp-$m.log" 2>&1 &
    SERVER_PID=$!
    wait_http "http://127.0.0.1:$port/health" "$OUT/llamacpp-$m.log" 300 &&
      "$PY" "$here/../load.py" --engine llama.cpp --url "http://127.0.0.1:$port" --label "$m" --build llama.cpp \
        --model-dir "$dir" "${decode[@]}" || echo "llama.cpp on $m failed" >&2
    stop_server
    runs=()
    for bin in "${bins[@]}"; do runs+=("$bin|"); done
    for flags in "${variants[@]}"; do [ -n "$flags" ] && runs+=("$newest|$flags"); done
    for run in "${runs[@]}"; do
      bin=${run%%|*} flags=${run#*|}
      engine=tether-prev
      [ "$bin" = "$newest" ] && engine=tether
      name="$(basename "$bin")$(echo "$flags" | tr -c 'a-z0-9.\n' _)"
      # shellcheck disable=SC2086
      start_tether "$bin" "$OUT/tether-serve-$m-$name.log" --model "$dir" --device gpu $flags &&
        "$PY" "$here/../load.py" --engine $engine --url "http://127.0.0.1:$port" --label "$m" \
          --build "$(basename "$bin")${flags:+ $flags}" --model-dir "$dir" "${decode[@]}" || echo "$name on $m failed" >&2
      curl -sf "http://127.0.0.1:$port/metrics" | grep -E '^tether_engine_lookahead' | sed "s/^/$m $name /" >>"$OUT/lookahead.txt" || true
      stop_server
    done
  done
  "$PY" "$here/../load.py" --report "$OUT/results.jsonl"
  cat "$OUT/lookahead.txt" 2>/dev/null || true
  exit 0
fi
if [ "${MODE:-decode}" = kvcodes ]; then
  bins=(${TETHER_BINS:-$TETHER_BIN})
  newest=${bins[${#bins[@]}-1]}
  model=/opt/models/qwen2.5-1.5b-bf16
  # The fused kernels' codes variant is off by default until measured here.
  export TETHER_GPU_KV_CODES=${TETHER_GPU_KV_CODES:-1}
  for bits in 8 4; do
    "$newest" bench --model "$model" --device gpu --kv-bits $bits --gpu-kernels 1,8 --prompt-tokens "${CHECK_PROMPT:-1000}" --gen-tokens "${CHECK_STEPS:-24}" 2>>"$OUT/tether.log" \
      | sed "s/^{/{\"check\":\"kernels\",\"kv_bits\":$bits,/" | tee -a "$OUT/results.jsonl" || echo "kernel check at $bits bits failed" >&2
  done
  # (build, bits, streams): 8 streams take the fused kernels, 32 MLX's ops.
  runs=()
  for bin in "${bins[@]}"; do runs+=("$bin|32|8"); done
  runs+=("$newest|8|8")
  for round in $(seq "${ROUNDS:-2}"); do
    extra=()
    [ "$round" = 1 ] && extra=("$newest|4|8" "$newest|32|32" "$newest|8|32")
    for run in "${runs[@]}" "${extra[@]}"; do
      IFS='|' read -r bin bits streams <<< "$run"
      "$bin" bench --model "$model" --device gpu --streams "$streams" --prompt-tokens "${HISTORY:-3900}" --gen-tokens 128 --kv-bits "$bits" 2>>"$OUT/tether.log" \
        | sed "s/^{/{\"build\":\"$(basename "$bin")\",\"kv_bits\":$bits,\"round\":$round,/" | tee -a "$OUT/results.jsonl" || echo "$run failed" >&2
    done
  done
  "$newest" bench --model "$model" --device gpu --kv-quality --kv-bits 8 --kv-text "$here/../../docs/architecture.md" --kv-text-tokens 1024 \
    --kv-prompts "$here/../../tests/fixtures/greedy/smollm2.json" 2>>"$OUT/tether.log" | tee -a "$OUT/results.jsonl" || echo "quality failed" >&2
  exit 0
fi
if [ "${MODE:-decode}" = kernels ]; then
  bins=(${TETHER_BINS:-$TETHER_BIN})
  newest=${bins[${#bins[@]}-1]}
  for m in ${CHECK_MODELS-$MODELS}; do
    "$newest" bench --model /opt/models/$m-bf16 --device gpu --gpu-kernels "${KERNEL_ROWS:-1,2,4,8}" --prompt-tokens "${CHECK_PROMPT:-300}" --gen-tokens "${CHECK_STEPS:-24}" 2>>"$OUT/tether.log" \
      | sed "s/^{/{\"model\":\"$m\",/" | tee -a "$OUT/results.jsonl" || echo "kernel check on $m failed" >&2
  done
  # A build as "{default,mlx,graphs}:path": mlx: without the fused step,
  # with it and MLX's CUDA graphs on.
  engine() {
    local spec=$1 model=$2 streams=$3 round=$4 kernels=1 graphs=0 per_sm=1 flags=()
    case "$spec" in mlx:*) kernels=0 ;; graphs:*) graphs=1 ;; sm2:*) per_sm=2 ;; nolook:*) flags=(--lookahead off) ;; esac
    local tag="\"build\":\"$(basename "$spec")\",\"variant\":\"${spec%%:*}\",\"round\":$round,"
    TETHER_GPU_KERNELS=$kernels MLX_USE_CUDA_GRAPHS=$graphs TETHER_GPU_BLOCKS_PER_SM=$per_sm "${spec#*:}" bench --model "$model" --device gpu --streams "$streams" --prompt-tokens 128 --gen-tokens 256 "${flags[@]}" 2>>"$OUT/tether.log" \
      | sed "s/^{/{$tag/" | tee -a "$OUT/results.jsonl"
  }
  for round in $(seq "${ROUNDS:-2}"); do
    for streams in ${STREAMS:-32}; do
      for bin in "${bins[@]/#/default:}" ${VARIANTS-mlx graphs}; do
        case "$bin" in mlx|graphs|sm2|nolook) bin=$bin:$newest ;; esac
        engine "$bin" /opt/models/qwen2.5-1.5b-bf16 "$streams" "$round"
      done
    done
  done
  if [ -d /opt/models/qwen2.5-7b-bf16 ]; then
    for bin in "${bins[@]/#/default:}" $(echo "${VARIANTS-}" | grep -oE 'sm2|nolook' || true); do
      case "$bin" in sm2|nolook) bin=$bin:$newest ;; esac
      engine "$bin" /opt/models/qwen2.5-7b-bf16 1 1
    done
  fi
  model=/opt/models/qwen2.5-1.5b-bf16
  grep -h "fused decode kernels" "$OUT/tether.log" || true
  for kernels in 1 0; do
    TETHER_TRACE_STEPS=1 TETHER_GPU_KERNELS=$kernels "$newest" bench --model "$model" --device gpu --streams 1 --prompt-tokens 128 --gen-tokens 128 2>"$OUT/trace-$kernels.log" >/dev/null
    grep -o 'decode_rows=1 .*' "$OUT/trace-$kernels.log" | "$PY" -c '
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=([\d.]+)", l)) for l in sys.stdin]
rows = [r for r in rows if r.get("prefill_tokens") == "0" and "primitives" in r]
med = lambda k: statistics.median(float(r[k]) for r in rows)
print("{\"trace\":\"one stream\",\"gpu_kernels\":'$kernels',\"steps\":%d,\"primitives\":%d,\"build_ms\":%.2f,\"eval_ms\":%.2f,\"ms\":%.2f}" % (len(rows), med("primitives"), med("build_ms"), med("eval_ms"), med("ms")))' | tee -a "$OUT/results.jsonl"
  done
  exit 0
fi
if [ "${MODE:-decode}" = builds ]; then
  model=/opt/models/qwen2.5-1.5b-bf16
  for round in $(seq "${ROUNDS:-2}"); do
    for bin in ${TETHER_BINS:-$TETHER_BIN}; do
      tag="\"build\":\"$(basename "$bin")\",\"round\":$round,"
      for streams in 1 32; do
        "$bin" bench --model "$model" --device gpu --streams "$streams" --prompt-tokens 128 --gen-tokens 256 "${flags[@]}" 2>>"$OUT/tether.log" \
          | sed "s/^{/{$tag/" | tee -a "$OUT/results.jsonl"
      done
      "$bin" bench --model "$model" --device gpu --speculation-streams 1,8 --max-draft 8 2>>"$OUT/tether.log" \
        | sed "s/^{/{$tag/" | tee -a "$OUT/results.jsonl"
    done
  done
  exit 0
fi
if [ "${MODE:-decode}" = structured ]; then
  [ -d /opt/py/aiohttp ] || "$PY" -m pip install -q --no-deps --target /opt/py "$KEEP"/aiohttp/*.whl
  log() { echo "[structured] $*" >&2; }
  source "$here/../lib.sh"
  if [ "${SAME_SERVER:-0}" = 1 ]; then
    # What the constraint alone costs: plain and schema rounds alternating on
    # one server per build, builds interleaved (TETHER_BINS="old new"), with
    # each server's step trace (constrained against plain decode steps).
    for rep in 1 2; do
      for bin in ${TETHER_BINS:-$TETHER_BIN}; do
        name=$(basename "$bin")-$rep
        TETHER_TRACE_STEPS=1 start_tether "$bin" "$OUT/tether-steps-$name.log" --model /opt/models/qwen2.5-0.5b-bf16 --device gpu --speculation off
        "$PY" "$here/../structured.py" --engine tether --url "http://127.0.0.1:$port" --label "$(basename "$bin")" \
          --streams "${STREAMS:-1,32}" --settings plain,schema --rounds "${ROUNDS:-3}" --interleave --out "$OUT/results.jsonl" || echo "structured $name failed" >&2
        stop_server
        echo "== $name" && "$PY" "$here/../structured.py" --steps "$OUT/tether-steps-$name.log"
      done
    done
    "$PY" "$here/../structured.py" --report "$OUT/results.jsonl"
    exit 0
  fi
  for setting in plain schema schema+ff; do
    # --speculation off: the constrained rows' only drafts are their forced tokens (schema+ff).
    start_tether "$TETHER_BIN" "$OUT/tether-serve-$setting.log" --model /opt/models/qwen2.5-0.5b-bf16 --device gpu --speculation off
    "$PY" "$here/../structured.py" --engine tether --url "http://127.0.0.1:$port" --label "${LABEL:-qwen2.5-0.5b-bf16 random (gpu)}" \
      --streams "${STREAMS:-1,32}" --settings "$setting" --out "$OUT/results.jsonl" || echo "structured $setting failed" >&2
    stop_server
  done
  "$PY" "$here/../structured.py" --report "$OUT/results.jsonl"
  exit 0
fi
if [ "${MODE:-decode}" = admit ]; then
  [ -d /opt/py/aiohttp ] || "$PY" -m pip install -q --no-deps --target /opt/py "$KEEP"/aiohttp/*.whl
  log() { echo "[admit] $*" >&2; }
  source "$here/../lib.sh"
  dir=/opt/models/qwen2.5-1.5b-bf16
  admit=(--workloads admit --admit-rounds "${ADMIT_ROUNDS:-3}" --model-dir "$dir" --out "$OUT/results.jsonl")
  # SERVE_SWEEP: one server per `;`-separated set of extra `serve` flags, per build.
  IFS=';' read -ra settings <<< "${SERVE_SWEEP:-}"
  [ ${#settings[@]} -gt 0 ] || settings=("")
  for flags in "${settings[@]}"; do
    engine=tether-prev
    label="qwen2.5-1.5b-bf16${flags:+ $flags}"
    for bin in ${TETHER_BINS:-$TETHER_BIN}; do
      # The last build listed is the one measured; the ones before it are earlier builds.
      [ "$bin" = "${TETHER_BINS##* }" ] || [ -z "${TETHER_BINS:-}" ] && engine=tether
      name="$(basename "$bin")$(echo "$flags" | tr -c 'a-z0-9.\n' _)"
      # shellcheck disable=SC2086
      start_tether "$bin" "$OUT/tether-serve-$name.log" --model "$dir" --device gpu $flags
      "$PY" "$here/../load.py" --engine $engine --url "http://127.0.0.1:$port" --label "$label" \
        --build "$(basename "$bin")" "${admit[@]}" || echo "$bin admit run failed" >&2
      # The same prompt length alone: its time to first token with nothing decoding (three times).
      "$PY" "$here/../load.py" --engine $engine --url "http://127.0.0.1:$port" --label "$label" \
        --build "$(basename "$bin")" --workloads decode --streams 1,1,1 --prompt-tokens 2000 --max-tokens 8 --model-dir "$dir" \
        --out "$OUT/results.jsonl" || echo "$bin long-prompt run failed" >&2
      stop_server
    done
  done
  if [ "${MLX_LM:-1}" = 1 ]; then
    "$PY" -m mlx_lm server --model "$dir" --host 127.0.0.1 --port 8181 >"$OUT/mlx-lm-serve.log" 2>&1 &
    SERVER_PID=$!
    wait_http http://127.0.0.1:8181/health "$OUT/mlx-lm-serve.log" 180 &&
      "$PY" "$here/../load.py" --engine mlx-lm --url http://127.0.0.1:8181 --label qwen2.5-1.5b-bf16 --build gpu "${admit[@]}" --admit-rounds 1 ||
      echo "mlx-lm admit run failed" >&2
    stop_server
  fi
  "$PY" "$here/../load.py" --report "$OUT/results.jsonl"
  exit 0
fi
if [ "${MODE:-decode}" = sessions ]; then
  [ -d /opt/py/aiohttp ] || "$PY" -m pip install -q --no-deps --target /opt/py "$KEEP"/aiohttp/*.whl
  log() { echo "[sessions] $*" >&2; }
  source "$here/../lib.sh"
  sessions=${SESSIONS:-128}
  for setting in ${SETTINGS:-hot disk dropped}; do
    case $setting in
      hot) flags=(--prefix-cache-mib "${HOT_MIB:-65536}") ;;
      disk) flags=(--prefix-cache-mib "${RAM_MIB:-2048}" --kv-disk-mib 40960 --kv-dir /tmp/tether-kv) ;;
      host) flags=(--prefix-cache-mib "${HOT_MIB:-65536}" --kv-host-mib "${HOST_MIB:-65536}") ;;
      dropped) flags=(--prefix-cache-mib "${RAM_MIB:-2048}") ;;
    esac
    start_tether "$TETHER_BIN" "$OUT/tether-serve-$setting.log" --model /opt/models/qwen2.5-1.5b-bf16 --device gpu \
      --session-ttl-secs 7200 --max-sessions $((sessions + 16)) "${flags[@]}"
    "$PY" "$here/../sessions.py" --url "http://127.0.0.1:$port" --server-pid "$SERVER_PID" --label "qwen2.5-1.5b-bf16 random (gpu)" \
      --setting "$setting" --sessions "$sessions" --shared-tokens "${SHARED_TOKENS:-3000}" --own-tokens "${OWN_TOKENS:-1000}" \
      --out "$OUT/results.jsonl" || echo "sessions $setting failed" >&2
    stop_server
  done
  "$PY" "$here/../sessions.py" --report "$OUT/results.jsonl"
  exit 0
fi
if [ "${MODE:-decode}" = agent ] || [ "${MODE:-decode}" = serving ]; then
  # Real servers over the wire, one at a time: `tether serve` then
  # mlx_lm.server on the same checkpoint, driven by bench/load.py.
  workloads=agent
  [ "$MODE" = serving ] && workloads=decode,admit
  dir=/opt/models/qwen2.5-1.5b-bf16
  port_of() { sed -n 's#.*listening on http://127\.0\.0\.1:\([0-9]*\).*#\1#p' "$1" | head -1; }
  # SERVE_SWEEP: one tether server per setting (extra `serve` flags, `;`-separated), tether only.
  IFS=';' read -ra settings <<< "${SERVE_SWEEP:-}"
  [ ${#settings[@]} -gt 0 ] || settings=("")
  for setting in "${settings[@]}"; do
    # shellcheck disable=SC2086
    "$TETHER_BIN" serve --model "$dir" --device gpu --host 127.0.0.1 --port 0 $setting >"$OUT/tether-serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do port=$(port_of "$OUT/tether-serve.log"); [ -n "$port" ] && break; sleep 0.5; done
    "$PY" "$here/../load.py" --engine tether --url "http://127.0.0.1:$port" --workloads $workloads --model-dir "$dir" \
      --label "qwen2.5-1.5b-bf16${setting:+ $setting}" --out "$OUT/results.jsonl" --build gpu $LOAD_ARGS || echo "tether $MODE run failed" >&2
    kill $pid; wait $pid 2>/dev/null || true
  done
  [ -z "${SERVE_SWEEP:-}" ] || { "$PY" "$here/../load.py" --report "$OUT/results.jsonl"; exit 0; }
  "$PY" -m mlx_lm server --model "$dir" --host 127.0.0.1 --port 8181 >"$OUT/mlx-lm-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 360); do curl -sf -m 2 -o /dev/null http://127.0.0.1:8181/health && break; sleep 0.5; done
  "$PY" "$here/../load.py" --engine mlx-lm --url http://127.0.0.1:8181 --workloads $workloads --model-dir "$dir" \
    --label qwen2.5-1.5b-bf16 --out "$OUT/results.jsonl" --build gpu $LOAD_ARGS || echo "mlx-lm $MODE run failed" >&2
  kill $pid; wait $pid 2>/dev/null || true
  "$PY" "$here/../load.py" --report "$OUT/results.jsonl"
  exit 0
fi
if [ "${MODE:-decode}" = graphs ]; then
  # CUDA graphs off (Tether's server default) and on, cut every 20 (MLX's
  # default), 60, 200 and 1,000 operations. MLX_MAX_OPS_PER_BUFFER only
  # matters with graphs on, so each setting names both.
  for round in 1 2; do
    for setting in "0 20" "1 20" "1 60" "1 200" "1 1000"; do
      read -r graphs ops <<< "$setting"
      for streams in 1 32; do
        MLX_USE_CUDA_GRAPHS=$graphs MLX_MAX_OPS_PER_BUFFER=$ops "$TETHER_BIN" bench --model /opt/models/qwen2.5-1.5b-bf16 --device gpu --streams $streams --prompt-tokens 128 --gen-tokens 256 2>>"$OUT/tether.log" \
          | sed "s/^{/{\"cuda_graphs\":$graphs,\"ops_per_graph\":$ops,\"round\":$round,/" | tee -a "$OUT/results.jsonl"
      done
    done
  done
  exit 0
fi
if [ "${MODE:-decode}" = streams ]; then
  # 1 then 32 streams, decoding rows' KV batched (the GPU default) and per
  # row (the previous layout), side by side.
  for m in $MODELS; do
    for fmt in bf16 4bit; do
      for layout in batched rows; do
        "$TETHER_BIN" bench --model /opt/models/$m-$fmt --device gpu --streams 32 --prompt-tokens 128 --gen-tokens 256 --kv-layout $layout 2>>"$OUT/tether.log" \
          | sed "s/\"model\":\"[^\"]*\"/\"model\":\"$m-$fmt\",\"kv_layout\":\"$layout\"/" | tee -a "$OUT/results.jsonl"
      done
    done
  done
  exit 0
fi
for m in qwen2.5-0.5b qwen2.5-1.5b; do
  for fmt in bf16 4bit; do
    dir=/opt/models/$m-$fmt
    for rep in 1 2; do
      "$TETHER_BIN" bench --model "$dir" --device gpu --prompt-tokens 512 --gen-tokens 256 2>>"$OUT/tether.log" \
        | sed "s/\"model\":\"[^\"]*\"/\"model\":\"$m-$fmt\"/" >> "$OUT/results.jsonl" || echo "tether failed on $m-$fmt" >&2
      "$PY" "$here/../peer/mlx_lm_decode.py" --model-dir "$dir" --device gpu --prompt-tokens 512 --gen-tokens 256 2>>"$OUT/mlx_lm.log" \
        | sed "s/\"model\":\"[^\"]*\"/\"model\":\"$m-$fmt\"/" >> "$OUT/results.jsonl" || echo "mlx-lm failed on $m-$fmt" >&2
    done
  done
done

"$PY" "$here/../report.py" "$OUT/results.jsonl" --hbm-gb-s "$HBM_GB_S"
