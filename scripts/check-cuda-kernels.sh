#!/usr/bin/env bash
# Compiles the GPU decode kernels (server/src/models/gpu/*.cu) with NVRTC for
# sm_90a, as MLX's cuda_kernel wraps them, for every variant the engine can
# launch: a compile check on any machine, no GPU needed. A kernel that does
# not compile otherwise shows only on a GPU machine, at the server's start.
# NVRTC and CUDA's headers come from NVIDIA's wheels, cached in
# ~/.cache/tether/nvrtc (about 100 MB). MLX's own device header, which NVRTC
# gets from libmlx on the GPU, is stood in for by the parts the kernels use.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${TETHER_CACHE:-$HOME/.cache/tether}/nvrtc
if [ ! -f "$root/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  mkdir -p "$root/dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$root/dl" nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.5.37 nvidia-cuda-cccl==13.3.5.0.6
  for w in "$root"/dl/*.whl; do python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$root"; done
fi
LD_LIBRARY_PATH="$root/nvidia/cu13/lib" python3 - "$root" <<'PY'
import ctypes, itertools, os, sys, tempfile
root = sys.argv[1]
inc = os.path.join(root, "nvidia/cu13/include")
nvrtc = ctypes.CDLL(os.path.join(root, "nvidia/cu13/lib/libnvrtc.so.13"))
stand_in = tempfile.mkdtemp()
os.makedirs(os.path.join(stand_in, "mlx/backend/cuda/device"))
with open(os.path.join(stand_in, "mlx/backend/cuda/device/utils.cuh"), "w") as f:
    f.write("#pragma once\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/array>\n#include <cuda/std/limits>\n"
            "namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 10>; }\n")

def compact(text):  # as mlx::cuda::CudaKernel stores a source
    return "\n".join(l.split("//")[0].strip() for l in text.splitlines() if l.split("//")[0].strip())

src = "server/src/models/gpu/"
common = compact(open(src + "common.cuh").read())

def wrap(body, inputs, outputs, consts):
    s = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n' + common
    s += "\nnamespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n__global__ void kernel(\n"
    params = []
    for name, t in inputs:
        params.append(f"const {t}* {name}")
        if name + "_shape" in body:
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += [f"{t}* {name}" for name, t in outputs]
    s += ",\n".join(params) + ") {\n"
    for k, v in consts.items():
        s += f"constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower() if isinstance(v, bool) else v};\n"
    return s + body + "\n}\n}\n"

def compile_ok(label, source):
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--device-as-default-execution-space", b"--gpu-architecture=compute_90a",
            f"--include-path={stand_in}".encode(), f"--include-path={inc}".encode(), f"--include-path={inc}/cccl".encode()]
    result = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    if result != 0:
        print(f"FAILED {label}\n{log.value.decode()}")
    return result == 0

bf = "__nv_bfloat16"
ok = total = 0
matvec = compact(open(src + "matvec.cu").read())
# (norm, bias, residual, glu, out): the q/k/v, output, gate/up and down projections and the head.
uses = [(True, True, False, 0, bf), (True, False, False, 0, bf), (False, False, True, 0, bf), (True, False, False, 1, bf),
        (True, False, False, 2, bf), (True, False, False, 0, "float")]
for rows, (k, split), (norm, bias, res, glu, out) in itertools.product([1, 8], [(576, 1), (3584, 2), (8960, 8)], uses):
    total += 1
    ok += compile_ok(f"matvec rows={rows} K={k} split={split} norm={norm} bias={bias} res={res} glu={glu} out={out}",
                     wrap(matvec, [("x", bf), ("w", bf), ("norm_w", bf), ("bias", bf), ("res", bf)], [("y", out)],
                          dict(MAX_ROWS=rows, K=k, KSPLIT=split, NORM=norm, BIAS=bias, RESIDUAL=res, GLU=glu, EPS_E12=1000000)))
attention = compact(open(src + "attention.cu").read())
# (bits, group): bfloat16 slots, then 8- and 4-bit codes.
for (hd, hq, hkv), trad, qk_norm, (bits, group) in itertools.product([(64, 9, 3), (128, 12, 2), (256, 8, 4)], [False, True], [False, True],
                                                                    [(0, 8), (8, 64), (8, 32), (4, 64)]):
    total += 1
    cache = bf if bits == 0 else "uint8_t"
    ok += compile_ok(f"attention HD={hd} HQ={hq} HKV={hkv} TRAD={trad} QK_NORM={qk_norm} BITS={bits} CODE_GROUP={group}",
                     wrap(attention, [("qkv", bf), ("k_cache", cache), ("v_cache", cache), ("rows", "int32_t"), ("inv_freq", "float"), ("q_norm", bf), ("k_norm", bf)],
                          [("out", bf)], dict(HD=hd, HQ=hq, HKV=hkv, TRAD=trad, QK_NORM=qk_norm, EPS_E12=1000000, BITS=bits, CODE_GROUP=group)))
print(f"{ok} of {total} kernel variants compile")
sys.exit(0 if ok == total else 1)
PY
