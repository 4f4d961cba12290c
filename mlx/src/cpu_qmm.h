// A CPU kernel for x @ W^T with W in MLX's affine quantized form (4 or 8
// bits, groups along the input axis), for the products of decode, batched
// decode and draft verification (1 to kCpuQmmMaxRows rows).
#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace tether_mlx {

// The most rows of x one call handles; prefill-sized products are better
// served by dequantizing once and calling BLAS.
constexpr int kCpuQmmMaxRows = 128;

// x: [..., K] float32; w: [N, K * bits / 32] uint32; scales, biases: [N, K / group]
// float32. Returns [..., N] float32, evaluated on the CPU stream. With
// `norm_weight` ([K]) x is first RMS-normed (eps) as fast::rms_norm would;
// `bias` ([N]) and then `residual` ([..., N]) are added to the product: one
// graph node for what would be up to four.
// Whether this CPU reads 5-bit codes (cpu_dequantize.h's layout) as fast as
// 4- and 8-bit ones: the integer path (AVX-512 VNNI) unpacks them. Elsewhere
// the kernel takes them on its portable path only, so loaders keep 8 bits.
bool cpu_affine_five_bit_fast();

mlx::core::array cpu_affine_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits,
    const std::optional<mlx::core::array>& norm_weight = std::nullopt,
    float eps = 0.f,
    const std::optional<mlx::core::array>& bias = std::nullopt,
    const std::optional<mlx::core::array>& residual = std::nullopt);

}  // namespace tether_mlx
