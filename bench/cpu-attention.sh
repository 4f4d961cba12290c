#!/usr/bin/env bash
# CPU attention before/after: the same binary with the fused kernels on
# (default) and off (TETHER_CPU_ATTENTION=0, MLX's per-row sdpa path), runs
# interleaved, best of REPS, on a shared machine.
#   1. one layer's attention, kernel vs MLX sdpa (examples/attention_bench)
#   2. a 12-turn agent session, 300 new tokens a turn: turn-12 time to first token
#   3. 32 concurrent streams: aggregate tok/s (short prompts, so decode dominates)
# usage: bench/cpu-attention.sh [REPS]   (env: MODEL, STREAM_PROMPT, STREAM_GEN)
set -euo pipefail
cd "$(dirname "$0")/.."
T="${CARGO_TARGET_DIR:-target}"
REPS=${1:-3}
MODEL=${MODEL:-smollm2-135m}
SP=${STREAM_PROMPT:-64}
SG=${STREAM_GEN:-64}
OUT=$(mktemp -d)

cargo build --release --locked -p tether -p tether-mlx --example attention_bench >&2
"$T/release/examples/attention_bench"

for rep in $(seq "$REPS"); do
  for mode in 0 1; do
    TETHER_CPU_ATTENTION=$mode "$T/release/tether" bench --model "$MODEL" --device cpu \
      --turns 12 --prompt-tokens 300 --gen-tokens 32 --cached-only | sed "s/^{/{\"fused\":$mode,/" >> "$OUT/turns.jsonl"
    TETHER_CPU_ATTENTION=$mode "$T/release/tether" bench --model "$MODEL" --device cpu \
      --streams 32 --prompt-tokens "$SP" --gen-tokens "$SG" | sed "s/^{/{\"fused\":$mode,/" >> "$OUT/streams.jsonl"
  done
done

python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
turns = [json.loads(l) for l in open(f"{out}/turns.jsonl")]
streams = [json.loads(l) for l in open(f"{out}/streams.jsonl")]
def best(rows, key, pick):
    return {m: pick(r[key] for r in rows if r["fused"] == m) for m in (0, 1)}
print("\nturn  TTFT ms, MLX per-row (best)  fused (best)  speedup")
for t in sorted({r["turn"] for r in turns}):
    b = best([r for r in turns if r["turn"] == t], "ttft_ms", min)
    print(f"{t:>4}  {b[0]:>26.0f}  {b[1]:>12.0f}  x{b[0] / b[1]:.2f}")
for n in sorted({r["streams"] for r in streams}):
    b = best([r for r in streams if r["streams"] == n], "aggregate_tok_s", max)
    print(f"{n:>2} streams: aggregate tok/s (best)  MLX per-row {b[0]:.1f}  fused {b[1]:.1f}  x{b[1] / b[0]:.2f}")
print(f"raw results: {out}")
EOF
