// Expands MLX's affine quantized weights to float32 on the CPU, split over
// the row pool, for prefill-sized products (dequantize once, then BLAS).
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "mlx/mlx.h"

namespace tether_mlx {

// Tether's 5-bit layout (CPU only; MLX has no 5-bit kernels of this form):
// a row is steps of 64 elements (two groups of 32), kFiveBitStepBytes each:
// 32 bytes of low nibbles packed as 4-bit codes are (element 2i of the step
// in the low nibble of byte i, 2i + 1 in the high one), then 64 fifth bits,
// bit i for element 2i and bit 32 + i for element 2i + 1. So a step unpacks
// with the 4-bit path's loads plus one masked add per half (unpack_5bit_step),
// and its codes come out in that path's order. Rows hold a multiple of 64.
constexpr int kFiveBitStepElements = 64;
constexpr int kFiveBitStepBytes = 40;

// Code e of a packed row: a byte for 8 bits; for 4 bits element 2i is the low
// nibble of byte i and 2i + 1 its high nibble (MLX's packing); 5 bits as above.
inline uint32_t affine_code(const uint8_t* row, int bits, int e) {
  if (bits == 8) return row[e];
  if (bits == 4) return (row[e / 2] >> ((e & 1) * 4)) & 0xF;
  const uint8_t* step = row + (e / kFiveBitStepElements) * kFiveBitStepBytes;
  const int r = e % kFiveBitStepElements, fifth = (r & 1) * 32 + r / 2;
  return ((step[r / 2] >> ((r & 1) * 4)) & 0xF) | (((step[32 + fifth / 8] >> (fifth % 8)) & 1u) << 4);
}

// One 5-bit step's codes as int16 words: `even` holds elements 0, 2, .., 62
// of the step, `odd` elements 1, 3, .., 63 (the 4-bit path's two vectors).
__attribute__((target("avx512f,avx512bw")))
inline void unpack_5bit_step(const uint8_t* step, __m512i& even, __m512i& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  uint64_t fifth;
  std::memcpy(&fifth, step + 32, sizeof fifth);
  const __m512i sixteen = _mm512_set1_epi16(16);
  even = _mm512_cvtepu8_epi16(_mm256_and_si256(v, nib));
  odd = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
  even = _mm512_mask_add_epi16(even, static_cast<__mmask32>(fifth), even, sixteen);
  odd = _mm512_mask_add_epi16(odd, static_cast<__mmask32>(fifth >> 32), odd, sixteen);
}

// w: [N, K * bits / 32] uint32 (4, 5 or 8 bits; 5 in groups of 32 only); scales, biases: [N, K / group]
// float32. Returns [N, K] float32 with element (n, k) = code * scale + bias
// of its group, the same operations in the same order as mx::dequantize, so
// the two agree bit for bit.
mlx::core::array cpu_affine_dequantize(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, int group_size, int bits);

}  // namespace tether_mlx
