#!/usr/bin/env bash
# Stages what MODE=peer of run.sh needs beside the MLX wheel, in .gpu/lc
# (git-ignored; carry it to the GPU machine and copy it to $KEEP there):
# llamacpp-src.tar.xz, the llama.cpp tree bench/peer/llamacpp.sh unpacks,
# without its docs, vocab models, tests' data and builds (under the 64 MiB a
# run may carry), and tok.json.xz, Qwen2's tokenizer metadata from
# Qwen2.5-Coder-0.5B's GGUF (the default model's cache).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${TETHER_CACHE:-$HOME/.cache/tether}
tree=$CACHE/peer/llamacpp/llama_cpp_python-${LLAMACPP_PY_VERSION:-0.3.36}/vendor
[ -d "$tree/llama.cpp" ] || bench/peer/llamacpp.sh >/dev/null
mkdir -p .gpu/lc
tar cf - -C "$tree" --exclude='llama.cpp/docs' --exclude='llama.cpp/models' --exclude='llama.cpp/build-*' \
  --exclude='llama.cpp/media' --exclude='llama.cpp/benches' --exclude='llama.cpp/tools/server/tests' \
  --exclude='llama.cpp/.git*' llama.cpp | xz -T0 -6 > .gpu/lc/llamacpp-src.tar.xz
[ -x "$CACHE/refenv/bin/python" ] || tests/reference/setup.sh
"$CACHE/refenv/bin/python" bench/gpu/tokenizer_meta.py "$CACHE/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf" /tmp/tok.json
xz -T0 -9 -c /tmp/tok.json > .gpu/lc/tok.json.xz
ls -la .gpu/lc
