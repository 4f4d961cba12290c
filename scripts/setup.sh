#!/usr/bin/env bash
# Installs what Tether needs to build and run, outside the repository:
#   - MLX's C++ library and headers from the pinned wheel, into ~/.cache/tether/mlx
#     (mlx-cpu on Linux; set TETHER_MLX_WHEEL=mlx-cuda-13 for NVIDIA GPUs);
#   - on Linux CPU, OpenBLAS in place of the wheel's bundled reference BLAS
#     (measured 52x faster float32 matmul on a 2-core x86 CPU).
# Idempotent: a second run only checks.
set -euo pipefail

MLX_VERSION=0.32.4
CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
MLX_HOME="$CACHE/mlx"
WHEEL_PKG="${TETHER_MLX_WHEEL:-mlx-cpu}"

log() { printf '[setup] %s\n' "$*" >&2; }

install_openblas() {
  [ "$(uname -s)" = Linux ] || return 0
  local blas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
  if [ ! -e "$blas" ]; then
    log "installing OpenBLAS (Debian package libopenblas0-pthread)"
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null
  fi
}

# jemalloc (the server's allocator, tikv-jemalloc-sys) is built from source
# with make; Debian's Rust images have gcc but not always make.
install_build_tools() {
  command -v make >/dev/null && return 0
  [ "$(uname -s)" = Linux ] || return 0
  log "installing make (Debian package make)"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq make >/dev/null
}

install_mlx() {
  if [ -f "$MLX_HOME/mlx/include/mlx/mlx.h" ] && [ -f "$MLX_HOME/.version-$WHEEL_PKG-$MLX_VERSION" ]; then
    return 0
  fi
  log "installing $WHEEL_PKG==$MLX_VERSION into $MLX_HOME"
  local tmp; tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$WHEEL_PKG==$MLX_VERSION"
  rm -rf "$MLX_HOME" && mkdir -p "$MLX_HOME"
  python3 - "$tmp" "$MLX_HOME" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
zipfile.ZipFile(wheel).extractall(sys.argv[2])
PY
  rm -rf "$tmp"
  touch "$MLX_HOME/.version-$WHEEL_PKG-$MLX_VERSION"
}

# The CPU wheel links netlib's reference BLAS/LAPACK by file name; pointing
# those names at OpenBLAS swaps the implementation without relinking.
swap_blas() {
  local libs="$MLX_HOME/mlx_cpu.libs"
  [ -d "$libs" ] || return 0
  local ob=/usr/lib/x86_64-linux-gnu/openblas-pthread
  [ -e "$ob/libblas.so.3" ] || return 0
  for f in "$libs"/libblas-*.so.*; do ln -sf "$ob/libblas.so.3" "$f"; done
  for f in "$libs"/liblapack-*.so.*; do ln -sf "$ob/liblapack.so.3" "$f"; done
}

install_build_tools
install_openblas
install_mlx
swap_blas
log "MLX ready at $MLX_HOME/mlx"
