#!/usr/bin/env bash
# Sets up the benchmark peer, mlx-lm (Apple's Python LLM package on the same
# MLX), on the same weights Tether serves. Benchmarks and tests only; the
# product never depends on any of this. Everything lands outside the repo:
#
#   $PEER/venv                   pinned mlx-lm + mlx + converter dependencies
#                                (on Linux CPU with OpenBLAS in place of the
#                                mlx-cpu wheel's reference BLAS)
#   $PEER/models/<name>-f32      HF dir (config.json, model.safetensors,
#                                tokenizer.json) converted from the GGUF
#                                by bench/peer/gguf_to_hf.py, float32
#   $PEER/models/smollm2-135m-mlx4
#                                MLX-community-style 4-bit (group 64) SmolLM2,
#                                made by mlx_lm.convert from the f32 dir
#
# PEER is $TETHER_CACHE/peer (default ~/.cache/tether/peer); the models folder
# can be moved with TETHER_PEER_MODELS.
#
# usage: bench/peer/setup.sh [MODEL...]      (default: smollm2-135m qwen2.5-coder-0.5b)
#
# Environment:
#   TETHER_PEER_SKIP_MLX_CPU=1   don't install mlx[cpu] (macOS, or a CUDA box where
#                                mlx comes some other way); no BLAS swap either
#   TETHER_BIN                   the tether binary used to fetch missing GGUFs
#                                (default target/release/tether, built if absent)
#
# Idempotent: a second run only checks (stamp files record what was built from what).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$PWD"

MLX_VERSION=0.32.4
# mlx-lm 0.32.2 is the newest release (needs mlx>=0.32.2, transformers>=5.7).
PINS=(
  "mlx-lm==0.32.2"
  "gguf==0.19.0"
  "safetensors==0.8.0"
  "transformers==5.24.0"
  "tokenizers==0.23.3"
  "aiohttp==3.14.5"
)
# Transitive dependencies (pip freeze of a working setup), pinned too so a fresh
# setup resolves the same set; mlx is pinned here for platforms that skip mlx[cpu].
CONSTRAINTS="
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
Jinja2==3.1.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mlx==0.32.4
multidict==7.2.1
numpy==2.4.6
packaging==26.4
propcache==0.5.4
protobuf==7.36.2
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
rich==15.0.0
sentencepiece==0.2.3
shellingham==1.5.4
tqdm==4.70.1
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
yarl==1.25.1
"

CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
PEER="$CACHE/peer"
VENV="$PEER/venv"
MODELS="${TETHER_PEER_MODELS:-$PEER/models}"
PY="$VENV/bin/python"

log() { printf '[peer-setup] %s\n' "$*" >&2; }

# MLX + OpenBLAS for Tether itself; also installs the Debian OpenBLAS package
# the swap below points at.
scripts/setup.sh

if [ "${TETHER_PEER_SKIP_MLX_CPU:-0}" != 1 ] && [ "$(uname -s)" = Linux ]; then
  PINS+=("mlx[cpu]==$MLX_VERSION")
  WANT_CPU_MLX=1
else
  WANT_CPU_MLX=0
fi

install_venv() {
  local stamp="$VENV/.tether-pins"
  local want; want="$(printf '%s\n' "${PINS[@]}" "$CONSTRAINTS")"
  if [ -x "$PY" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "creating $VENV with ${PINS[*]}"
  rm -rf "$VENV"
  mkdir -p "$PEER"
  python3 -m venv "$VENV"
  local cons="$PEER/.constraints.txt"
  printf '%s\n' "$CONSTRAINTS" >"$cons"
  "$PY" -m pip install --quiet --disable-pip-version-check --only-binary=:all: -c "$cons" "${PINS[@]}"
  printf '%s' "$want" >"$stamp"
}

# Same swap as scripts/setup.sh: the mlx-cpu wheel links netlib's reference
# BLAS/LAPACK by file name; pointing those names at OpenBLAS swaps them.
swap_blas() {
  [ "$WANT_CPU_MLX" = 1 ] || return 0
  local ob=/usr/lib/x86_64-linux-gnu/openblas-pthread
  if [ ! -e "$ob/libblas.so.3" ]; then
    log "warning: $ob/libblas.so.3 missing; mlx-lm keeps the slow reference BLAS"
    return 0
  fi
  local libs
  libs="$("$PY" -c 'import glob, site; print(" ".join(glob.glob(site.getsitepackages()[0] + "/mlx_cpu.libs")))')"
  [ -n "$libs" ] || { log "warning: no mlx_cpu.libs in the venv; BLAS not swapped"; return 0; }
  local f
  for f in "$libs"/libblas-*.so.*; do
    if [ -e "$f" ] || [ -L "$f" ]; then ln -sf "$ob/libblas.so.3" "$f"; fi
  done
  for f in "$libs"/liblapack-*.so.*; do
    if [ -e "$f" ] || [ -L "$f" ]; then ln -sf "$ob/liblapack.so.3" "$f"; fi
  done
}

tether_bin() {
  local bin="${TETHER_BIN:-$REPO/target/release/tether}"
  if [ ! -x "$bin" ]; then
    log "building $bin to fetch models"
    cargo build --release --locked -p tether >&2
  fi
  printf '%s' "$bin"
}

# convert NAME: GGUF (fetched if missing) -> $MODELS/NAME-f32
convert() {
  local name="$1" out="$MODELS/$1-f32"
  local conv="$REPO/bench/peer/gguf_to_hf.py"
  local sum; sum="$(sha256sum "$conv" | cut -c1-16)"
  local stamp="$out/.tether-converted"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "float32 $sum" ]; then
    return 0
  fi
  local gguf; gguf="$("$(tether_bin)" fetch-model "$name")"
  log "converting $gguf -> $out"
  rm -rf "$out" "$out.partial"
  "$PY" "$conv" "$gguf" "$out.partial" --dtype float32 >&2
  printf '%s' "float32 $sum" >"$out.partial/.tether-converted"
  mv "$out.partial" "$out"
}

# quantize4 NAME: $MODELS/NAME-f32 -> $MODELS/NAME-mlx4 (affine, 4 bits, group 64)
quantize4() {
  local src="$MODELS/$1-f32" out="$MODELS/$1-mlx4"
  local stamp="$out/.tether-converted"
  local want; want="mlx4 g64 from $(cat "$src/.tether-converted")"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  log "quantizing $src -> $out"
  rm -rf "$out" "$out.partial"
  # mlx_lm.convert refuses an existing --mlx-path, so it writes a fresh one.
  "$VENV/bin/mlx_lm.convert" --hf-path "$src" --mlx-path "$out.partial" -q --q-bits 4 --q-group-size 64 >&2
  printf '%s' "$want" >"$out.partial/.tether-converted"
  mv "$out.partial" "$out"
}

install_venv
swap_blas
mkdir -p "$MODELS"
if [ $# -eq 0 ]; then set -- smollm2-135m qwen2.5-coder-0.5b; fi
for name in "$@"; do
  convert "$name"
  if [ "$name" = smollm2-135m ]; then quantize4 "$name"; fi
done
log "peer ready: $VENV (mlx-lm), models in $MODELS"
