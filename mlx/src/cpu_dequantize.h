// Expands MLX's affine quantized weights to float32 on the CPU, split over
// the row pool, for prefill-sized products (dequantize once, then BLAS).
#pragma once

#include "mlx/mlx.h"

namespace tether_mlx {

// w: [N, K * bits / 32] uint32 (4 or 8 bits); scales, biases: [N, K / group]
// float32. Returns [N, K] float32 with element (n, k) = code * scale + bias
// of its group, the same operations in the same order as mx::dequantize, so
// the two agree bit for bit.
mlx::core::array cpu_affine_dequantize(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, int group_size, int bits);

}  // namespace tether_mlx
