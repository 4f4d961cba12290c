#!/usr/bin/env bash
# Sets up Tether and runs it on the default model (SmolLM2-135M-Instruct).
# With no arguments it answers a chat prompt; any arguments go to `tether`
# (e.g. `scripts/run.sh generate --model qwen2.5-coder-0.5b --prompt ...`).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo build --release --locked -p tether
target/release/tether fetch-model smollm2-135m >/dev/null
if [ "$#" -eq 0 ]; then
  set -- generate --chat --prompt "Write a haiku about the sea." --max-tokens 64 --stats
fi
exec target/release/tether "$@"
