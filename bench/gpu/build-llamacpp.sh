#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` with CUDA for this GPU's architecture on
# the GPU machine (the peer of MODE=peer in run.sh; never part of Tether),
# from the tree bench/peer/llamacpp.sh builds on the CPU (llama-cpp-python
# 0.3.36's vendored llama.cpp), carried over as SRC_TAR (a tar.xz of that
# tree without its docs, vocab models and build folders). Prints the
# binary's path; a built one is reused. Logs in $ROOT.
# usage: build-llamacpp.sh SRC_TAR
set -euo pipefail
ROOT=${LLAMACPP_ROOT:-/root/lc}
BIN=$ROOT/llama.cpp/build/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
[ -d "$ROOT/llama.cpp" ] || tar xJf "$1" -C "$ROOT"
cd "$ROOT/llama.cpp"
# The machine's own architecture (sm_90 on an H100 or H200), not a fat binary.
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON >"$ROOT/cmake.log" 2>&1
cmake --build build --target llama-server -j"$(nproc)" >"$ROOT/build.log" 2>&1
echo "$BIN"
