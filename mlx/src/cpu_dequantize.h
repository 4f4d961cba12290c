// Expands MLX's affine quantized weights to float32 on the CPU, split over
// the row pool, for prefill-sized products (dequantize once, then BLAS).
#pragma once

#include <cstdint>

#include "mlx/mlx.h"

namespace tether_mlx {

// Code e of a packed row: a byte for 8 bits; for 4 bits element 2i is the low
// nibble of byte i and 2i + 1 its high nibble (MLX's packing).
inline uint32_t affine_code(const uint8_t* row, int bits, int e) {
  return bits == 8 ? row[e] : (row[e / 2] >> ((e & 1) * 4)) & 0xF;
}

// w: [N, K * bits / 32] uint32 (4 or 8 bits); scales, biases: [N, K / group]
// float32. Returns [N, K] float32 with element (n, k) = code * scale + bias
// of its group, the same operations in the same order as mx::dequantize, so
// the two agree bit for bit.
mlx::core::array cpu_affine_dequantize(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, int group_size, int bits);

}  // namespace tether_mlx
