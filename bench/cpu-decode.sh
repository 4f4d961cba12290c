#!/usr/bin/env bash
# Single-stream prefill/decode on this machine's CPU: Tether beside mlx-lm on
# the same weights (the GGUF for Tether; its float32 HF conversion for mlx-lm,
# made by bench/peer/setup.sh), runs interleaved, best of REPS, then a table.
# usage: bench/cpu-decode.sh [REPS]   (env: PROMPT_TOKENS, GEN_TOKENS)
set -euo pipefail
cd "$(dirname "$0")/.."
TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"
REPS=${1:-2}
P=${PROMPT_TOKENS:-512}
G=${GEN_TOKENS:-128}
PEER="${TETHER_CACHE:-$HOME/.cache/tether}/peer"
OUT=$(mktemp -d)

scripts/setup.sh
cargo build --release --locked -p tether
bench/peer/setup.sh >&2

for rep in $(seq "$REPS"); do
  for m in smollm2-135m qwen2.5-coder-0.5b; do
    "$TETHER_BIN" bench --model "$m" --device cpu --prompt-tokens "$P" --gen-tokens "$G" >> "$OUT/results.jsonl"
    "$PEER/venv/bin/python" bench/peer/mlx_lm_decode.py --model-dir "$PEER/models/$m-f32" --device cpu \
      --prompt-tokens "$P" --gen-tokens "$G" | sed "s/\"model\": \"[^\"]*\"/\"model\": \"$m\"/" >> "$OUT/results.jsonl"
  done
done
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; prompt $P, generate $G tokens"
python3 bench/report.py "$OUT/results.jsonl"
echo "raw results: $OUT/results.jsonl"
