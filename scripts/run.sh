#!/usr/bin/env bash
# Sets up Tether and runs it on the default model (SmolLM2-135M-Instruct).
# With no arguments it serves protocol v1 on ws://127.0.0.1:8080/v1/ws; any
# arguments go to `tether` instead (e.g. `scripts/run.sh generate --chat --prompt ...`).
set -euo pipefail
cd "$(dirname "$0")/.."
TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"

scripts/setup.sh
cargo build --release --locked -p tether
"$TETHER_BIN" fetch-model smollm2-135m >/dev/null
if [ "$#" -eq 0 ]; then
  set -- serve --port "${PORT:-8080}"
fi
exec "$TETHER_BIN" "$@"
