// Kernels of our own on a CUDA device, through MLX's `fast::cuda_kernel`:
// MLX wraps the source in a `__global__` function whose parameters are the
// named inputs (`const T*`), their shapes where the source names
// `<input>_shape`, and the outputs (`T*`), compiles it with NVRTC at its
// first launch on the device (cached on disk by MLX), and runs it as one
// graph node. On a machine without CUDA, creating a kernel works and
// launching one fails with MLX's error; nothing is compiled.
#pragma once

#include <memory>

#include "mlx/mlx.h"
#include "rust/cxx.h"
#include "tether-mlx/src/shim.h"

namespace tether_mlx {

struct CudaKernel {
  mlx::core::fast::CustomKernelFunction launch;
};

// `inputs` and `outputs`: the parameters' names, comma-separated.
std::unique_ptr<CudaKernel> cuda_kernel_new(rust::Str name, rust::Str inputs, rust::Str outputs, rust::Str source, rust::Str header);

// One launch. `shapes` holds every output's dimensions in turn, `ndims` how
// many each has; `dtypes` their dtype codes. `grid` counts threads (not
// blocks) per axis, as MLX's custom kernels do; `block` is the threads of
// one block. Template arguments become constants of the kernel body:
// `names`, `kinds` (0 int, 1 bool, 2 dtype) and `values` (a dtype's code).
std::unique_ptr<ArrayList> cuda_kernel_launch(
    const CudaKernel& kernel,
    const ArrayList& inputs,
    rust::Slice<const int32_t> shapes,
    rust::Slice<const int32_t> ndims,
    rust::Slice<const uint8_t> dtypes,
    rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> block,
    rust::Slice<const rust::Str> names,
    rust::Slice<const uint8_t> kinds,
    rust::Slice<const int32_t> values);

// Whether MLX runs on CUDA here (a CUDA build with a device).
bool cuda_available();

// Whether `a` alone holds its buffer, as a dense row-major array:
// evaluated, its buffer owned, and no other handle or graph node refers to
// it. A kernel may then write into the buffer in place (MLX passes it to the
// kernel as is, not a copy) without any other reader seeing the change.
bool sole_holder(const Array& a);

// The primitives evaluating `outputs` would run: "<count> <name>" per
// primitive kind, most frequent first, then "total <n>", one per line.
rust::String graph_census(const ArrayList& outputs);

}  // namespace tether_mlx
