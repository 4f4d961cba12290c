#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for this CPU (the peer of the side-by-side
# benchmarks, never part of Tether) under ~/.cache/tether/peer/llamacpp and
# prints its path; a built one is reused. About 7 minutes on 2 cores.
# The vector extensions are this CPU's (see below), or with LLAMACPP_ISA=avx2
# only up to AVX2 (no AVX-512 or AVX-VNNI: the peer of TETHER_CPU_ISA=avx2,
# as on CPUs without AVX-512), built apart (build-tether-avx2).
# Source: the llama.cpp tree vendored in the PyPI sdist of llama-cpp-python
# (0.3.36: llama.cpp of 2026-10-01); cmake and ninja from their PyPI wheels
# (not from source: `--no-binary=:all:` would compile cmake for half an hour).
set -euo pipefail
ROOT=${LLAMACPP_ROOT:-${TETHER_CACHE:-$HOME/.cache/tether}/peer/llamacpp}
VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
SRC=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
CAP=${LLAMACPP_ISA:-native}
case "$CAP" in native) BUILD=build-tether ;; avx2) BUILD=build-tether-avx2 ;; *) echo "LLAMACPP_ISA: native or avx2, not $CAP" >&2; exit 2 ;; esac
BIN=$SRC/$BUILD/bin/llama-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT/dl"
cd "$ROOT"
[ -f "dl/llama_cpp_python-$VERSION.tar.gz" ] ||
  python3 -m pip download -q --no-deps --no-binary=llama-cpp-python "llama-cpp-python==$VERSION" -d dl
[ -x tools/bin/cmake ] || { python3 -m venv tools && tools/bin/pip -q install cmake ninja; }
[ -d "$SRC" ] || tar xzf "dl/llama_cpp_python-$VERSION.tar.gz"
cd "$SRC"
# This CPU's vector extensions, named one by one: -march=native would also
# turn on AMX where the CPU lists it, and a process the kernel has not
# granted AMX state dies on its first tile instruction (SIGILL).
has() { [ "$CAP" = native ] && grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
has avx512f && ISA+=(-DGGML_AVX512=ON)
has avx512_vnni && ISA+=(-DGGML_AVX512_VNNI=ON)
has avx512_bf16 && ISA+=(-DGGML_AVX512_BF16=ON)
has avx512vbmi && ISA+=(-DGGML_AVX512_VBMI=ON)
has avx_vnni && ISA+=(-DGGML_AVX_VNNI=ON)
"$ROOT/tools/bin/cmake" -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$ROOT/tools/bin/ninja" -DCMAKE_BUILD_TYPE=Release \
  "${ISA[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON >"$ROOT/cmake-$CAP.log" 2>&1
"$ROOT/tools/bin/cmake" --build "$BUILD" --target llama-server -j"$(nproc)" >"$ROOT/build-$CAP.log" 2>&1
echo "$BIN"
