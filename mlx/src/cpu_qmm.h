// A CPU kernel for x @ W^T with W in MLX's affine quantized form (4 or 8
// bits, groups along the input axis), for the products of decode, batched
// decode and draft verification (1 to kCpuQmmMaxRows rows).
#pragma once

#include "mlx/mlx.h"

namespace tether_mlx {

// The most rows of x one call handles; prefill-sized products are better
// served by dequantizing once and calling BLAS.
constexpr int kCpuQmmMaxRows = 128;

// x: [..., K] float32; w: [N, K * bits / 32] uint32; scales, biases: [N, K / group]
// float32. Returns [..., N] float32, evaluated on the CPU stream.
mlx::core::array cpu_affine_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits);

}  // namespace tether_mlx
