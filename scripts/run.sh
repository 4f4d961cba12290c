#!/usr/bin/env bash
# Sets up Tether and runs it on the default model (SmolLM2-135M-Instruct).
# With no arguments it serves protocol v1 on ws://127.0.0.1:8080/v1/ws and the
# browser playground on http://127.0.0.1:8080/ (built from client-ts/ with npm);
# any arguments go to `tether` instead (e.g. `scripts/run.sh generate --chat --prompt ...`).
set -euo pipefail
cd "$(dirname "$0")/.."
TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"

scripts/setup.sh
cargo build --release --locked -p tether
"$TETHER_BIN" fetch-model smollm2-135m >/dev/null
if [ "$#" -eq 0 ]; then
  # The browser playground (client-ts/), served at http://127.0.0.1:PORT/.
  ui=()
  if command -v npm >/dev/null; then
    (
      cd client-ts
      if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
        npm ci --no-audit --no-fund --silent
      fi
      npm run --silent build >/dev/null
    )
    ui=(--ui-dir client-ts/dist/playground)
  else
    echo "[run] npm not found: serving without the playground (client-ts/)" >&2
  fi
  set -- serve --port "${PORT:-8080}" "${ui[@]}"
fi
exec "$TETHER_BIN" "$@"
