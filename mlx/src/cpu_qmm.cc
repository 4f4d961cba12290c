// CPU decode kernel for affine-quantized matmul.
//
// Why: MLX's CPU quantized_matmul is compute-bound (about as slow as the
// float32 product it replaces), so 4-bit weights bought no decode speed on
// CPU. Decode is a memory-bound matrix-vector product; this kernel reads each
// quantized row once, expands codes to float in registers, and multiplies
// them against the activation rows, split over all cores. With a few rows it
// streams codes straight into FMAs; with more (batched decode, draft
// verification) it expands a tile of weight rows once and runs a
// register-blocked micro-kernel over all rows (rows_avx512_tiled). CPUs
// with AVX2 but not AVX-512 run one kernel for any number of rows
// (rows_avx2); others the portable rows_scalar.
//
// Math per output (m, n): sum_g [ s_ng * sum_j q_nj x_mj + b_ng * sum_j x_mj ]
// with j over group g. The scale is folded into the codes before the FMA, and
// the bias term uses per-group sums of x computed once per call.
//
// Prefetches may reach past the end of the weights: a prefetch never faults.
// Invariants: weights, scales and biases are row-contiguous (made so before
// the primitive is built); x is read through row_major_f32; the output buffer is allocated in eval_cpu and filled by the dispatched task,
// which holds copies of the input arrays so their buffers outlive it.
#include "tether-mlx/src/cpu_qmm.h"
#include "tether-mlx/src/cpu_isa.h"

#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <vector>

#include <immintrin.h>

#include "mlx/backend/cpu/encoder.h"
#include "tether-mlx/src/cpu_dequantize.h"
#include "tether-mlx/src/simd_exp.h"
#include "tether-mlx/src/cpu_eval.h"
#include "mlx/primitives.h"
#include "tether-mlx/src/row_pool.h"

namespace mx = mlx::core;

namespace tether_mlx {
namespace {

struct Problem {
  const float* x;        // [M, K]
  const uint8_t* w;      // [N, K * bits / 8] bytes
  const float* scales;   // [N, G]
  const float* biases;   // [N, G]
  const float* xsum;     // [M, G]: sum of x over each group
  const float* xeven;    // 4-bit only: [M, K / 2], x at even positions of each group
  const float* xodd;     // 4-bit only: [M, K / 2]
  float* out;            // [M, N]
  int M, N, K, G, bits;
};

// How far ahead of the codes being read a one-row kernel asks for more. A
// model's weights do not fit in cache, and the hardware prefetchers alone
// (which stop at every 4 KB page and ramp up again) kept a decode-sized
// product at about half this CPU's streaming read rate: 11-14 against
// 22 GB/s on a 2-core Xeon, model-sized 4- and 8-bit weights read from
// memory (examples/qmm_dram_bench). Asking 2 KB ahead took it to 18-20.
constexpr int kPrefetchBytes = 2048;

inline void prefetch_ahead(const uint8_t* codes) {
  _mm_prefetch(reinterpret_cast<const char*>(codes + kPrefetchBytes), _MM_HINT_T0);
}

// From this many activation rows on, the tiled path (rows_avx512_tiled)
// beats streaming codes through the per-row kernels.
constexpr int kTiledMinRows = 4;

// Portable version; also the reference the vector one is checked against.
void rows_scalar(const Problem& p, int n0, int n1) {
  const int gs = p.K / p.G;
  const int row_bytes = p.K * p.bits / 8;
  std::vector<float> q(gs);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = p.w + static_cast<size_t>(n) * row_bytes;
    for (int m = 0; m < p.M; ++m) p.out[static_cast<size_t>(m) * p.N + n] = 0.f;
    for (int g = 0; g < p.G; ++g) {
      for (int j = 0; j < gs; ++j) {
        int e = g * gs + j;
        q[j] = static_cast<float>(affine_code(wr, p.bits, e));
      }
      float s = p.scales[static_cast<size_t>(n) * p.G + g], b = p.biases[static_cast<size_t>(n) * p.G + g];
      for (int m = 0; m < p.M; ++m) {
        const float* xm = p.x + static_cast<size_t>(m) * p.K + g * gs;
        float d = 0.f;
        for (int j = 0; j < gs; ++j) d += q[j] * xm[j];
        p.out[static_cast<size_t>(m) * p.N + n] += s * d + b * p.xsum[m * p.G + g];
      }
    }
  }
}

// AVX-512 version for group size 32 (GGUF's block size, the only one the
// loader produces for 4/8-bit blocks). Activation rows go in blocks of 4 with
// four accumulators each (two groups per iteration, two halves per group):
// independent FMA chains hide the FMA latency that bounds a single
// accumulator, and 16 accumulators leave registers for the codes.
template <int BITS>
__attribute__((target("avx512f,avx512bw")))
inline void expand_group(const uint8_t* wr, int g, __m512 s, __m512& qa, __m512& qb) {
  if constexpr (BITS == 8) {
    const uint8_t* src = wr + g * 32;
    qa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))), s);
    qb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)))), s);
  } else {
    // 16 bytes hold 32 codes: byte i is element 2i (low nibble) and 2i+1 (high).
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16)));
    qa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF))), s);
    qb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s);
  }
}

// Adds sum_g b[g] * xs[g] (the bias term of one output) to the lanes of
// `acc`, 16 groups per FMA. Scalar per-group code here cost more than the
// products themselves once several activation rows share a weight row.
__attribute__((target("avx512f,avx512bw")))
inline __m512 add_bias_term(__m512 acc, const float* b, const float* xs, int G) {
  int g = 0;
  for (; g + 16 <= G; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(b + g), _mm512_loadu_ps(xs + g), acc);
  if (g < G) {
    const __mmask16 m = static_cast<__mmask16>((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, b + g), _mm512_maskz_loadu_ps(m, xs + g), acc);
  }
  return acc;
}

template <int BITS>
__attribute__((target("avx512f,avx512bw")))
void rows_avx512_g32(const Problem& p, int n0, int n1) {
  constexpr int MB = 4;
  const int row_bytes = p.K * BITS / 8;
  // Where group g's two halves of x start for row m: 8-bit codes are in
  // element order; 4-bit ones pair with the de-interleaved even/odd copies.
  const float* xa0 = BITS == 8 ? p.x : p.xeven;
  const float* xb0 = BITS == 8 ? p.x + 16 : p.xodd;
  const size_t x_stride = BITS == 8 ? p.K : p.K / 2;
  const int g_step = BITS == 8 ? 32 : 16;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = p.w + static_cast<size_t>(n) * row_bytes;
    const float* sr = p.scales + static_cast<size_t>(n) * p.G;
    const float* br = p.biases + static_cast<size_t>(n) * p.G;
    for (int m0 = 0; m0 < p.M; m0 += MB) {
      const int mc = std::min(MB, p.M - m0);
      __m512 acc[MB][4];
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
      int g = 0;
      for (; g + 1 < p.G; g += 2) {
        if (m0 == 0) prefetch_ahead(wr + g * BITS * 4);
        __m512 qa0, qb0, qa1, qb1;
        expand_group<BITS>(wr, g, _mm512_set1_ps(sr[g]), qa0, qb0);
        expand_group<BITS>(wr, g + 1, _mm512_set1_ps(sr[g + 1]), qa1, qb1);
        for (int m = 0; m < mc; ++m) {
          const size_t xo = (m0 + m) * x_stride + static_cast<size_t>(g) * g_step;
          acc[m][0] = _mm512_fmadd_ps(qa0, _mm512_loadu_ps(xa0 + xo), acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(qb0, _mm512_loadu_ps(xb0 + xo), acc[m][1]);
          acc[m][2] = _mm512_fmadd_ps(qa1, _mm512_loadu_ps(xa0 + xo + g_step), acc[m][2]);
          acc[m][3] = _mm512_fmadd_ps(qb1, _mm512_loadu_ps(xb0 + xo + g_step), acc[m][3]);
        }
      }
      for (; g < p.G; ++g) {
        __m512 qa, qb;
        expand_group<BITS>(wr, g, _mm512_set1_ps(sr[g]), qa, qb);
        for (int m = 0; m < mc; ++m) {
          const size_t xo = (m0 + m) * x_stride + static_cast<size_t>(g) * g_step;
          acc[m][0] = _mm512_fmadd_ps(qa, _mm512_loadu_ps(xa0 + xo), acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(qb, _mm512_loadu_ps(xb0 + xo), acc[m][1]);
        }
      }
      for (int m = 0; m < mc; ++m) {
        __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
        sum = add_bias_term(sum, br, p.xsum + static_cast<size_t>(m0 + m) * p.G, p.G);
        p.out[static_cast<size_t>(m0 + m) * p.N + n] = _mm512_reduce_add_ps(sum);
      }
    }
  }
}

// AVX-512 version for 8-bit codes in groups of 16 (GGUF Q6_K's exact form).
__attribute__((target("avx512f,avx512bw")))
void rows_avx512_8bit_g16(const Problem& p, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = p.w + static_cast<size_t>(n) * p.K;
    const float* sr = p.scales + static_cast<size_t>(n) * p.G;
    const float* br = p.biases + static_cast<size_t>(n) * p.G;
    __m512 acc[kTiledMinRows];  // fewer rows than this only: more go tiled
    for (int m = 0; m < p.M; ++m) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < p.G; ++g) {
      __m512 q = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16)))),
                               _mm512_set1_ps(sr[g]));
      for (int m = 0; m < p.M; ++m) acc[m] = _mm512_fmadd_ps(q, _mm512_loadu_ps(p.x + static_cast<size_t>(m) * p.K + g * 16), acc[m]);
    }
    for (int m = 0; m < p.M; ++m)
      p.out[static_cast<size_t>(m) * p.N + n] = _mm512_reduce_add_ps(add_bias_term(acc[m], br, p.xsum + static_cast<size_t>(m) * p.G, p.G));
  }
}

// Many activation rows (batched decode, draft verification, small
// prefill chunks): the product turns compute-bound, and re-expanding codes
// for every block of rows (as rows_avx512_g32 does) wastes most of the
// instructions. Here each tile of kTileN weight rows is expanded ONCE into a
// float buffer (scales applied, in the same element order as the permuted x
// below), then a register-blocked micro-kernel multiplies it against the rows
// of x, kTileN x MB dot products at a time: per 16-wide step it loads kTileN
// weight vectors and MB activation vectors for kTileN * MB FMAs.
constexpr int kTileN = 4;  // tile_dots spells out its four weight rows
constexpr int kTileMaxM = 6;  // 4 x 6 accumulators + 4 weights + 1 x = 29 of 32 zmm

// Row n of W as floats (code * scale), group by group. 4- and 5-bit groups
// come out as [even elements | odd elements], matching the nibble layout; x
// is permuted the same way (see permute_x_for_4bit), so dot products agree.
__attribute__((target("avx512f,avx512bw")))
void expand_row(const Problem& p, int n, float* dst) {
  const int gs = p.K / p.G;
  const float* sr = p.scales + static_cast<size_t>(n) * p.G;
  if (p.bits == 5) {
    // A step's `even` words are the even elements of its two groups, 16 each.
    const uint8_t* wr = p.w + static_cast<size_t>(n) * (p.K / kFiveBitStepElements) * kFiveBitStepBytes;
    for (int st = 0; st < p.G / 2; ++st) {
      __m512i even, odd;
      unpack_5bit_step(wr + st * kFiveBitStepBytes, even, odd);
      for (int h = 0; h < 2; ++h) {
        const int g = 2 * st + h;
        const __m512 s = _mm512_set1_ps(sr[g]);
        const __m256i e = h == 0 ? _mm512_castsi512_si256(even) : _mm512_extracti64x4_epi64(even, 1);
        const __m256i o = h == 0 ? _mm512_castsi512_si256(odd) : _mm512_extracti64x4_epi64(odd, 1);
        _mm512_storeu_ps(dst + g * 32, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(e)), s));
        _mm512_storeu_ps(dst + g * 32 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(o)), s));
      }
    }
  } else if (p.bits == 4) {
    const uint8_t* wr = p.w + static_cast<size_t>(n) * p.K / 2;
    for (int g = 0; g < p.G; ++g) {
      __m512 qa, qb;
      expand_group<4>(wr, g, _mm512_set1_ps(sr[g]), qa, qb);
      _mm512_storeu_ps(dst + g * 32, qa);
      _mm512_storeu_ps(dst + g * 32 + 16, qb);
    }
  } else if (gs == 32) {
    const uint8_t* wr = p.w + static_cast<size_t>(n) * p.K;
    for (int g = 0; g < p.G; ++g) {
      __m512 qa, qb;
      expand_group<8>(wr, g, _mm512_set1_ps(sr[g]), qa, qb);
      _mm512_storeu_ps(dst + g * 32, qa);
      _mm512_storeu_ps(dst + g * 32 + 16, qb);
    }
  } else {  // 8-bit, groups of 16
    const uint8_t* wr = p.w + static_cast<size_t>(n) * p.K;
    for (int g = 0; g < p.G; ++g) {
      __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + g * 16))));
      _mm512_storeu_ps(dst + g * 16, _mm512_mul_ps(q, _mm512_set1_ps(sr[g])));
    }
  }
}

// out[i][j] = dot(w row i, x row j) over K (a multiple of 16), for kTileN
// weight rows at w (stride K) and MB activation rows at x (stride K).
// The loops over i and j are fully unrolled (GCC otherwise interchanges
// them with the k loop and keeps the accumulators in memory).
template <int MB>
__attribute__((target("avx512f,avx512bw")))
void tile_dots(const float* w, const float* x, int K, float out[kTileN][kTileMaxM]) {
  __m512 acc[kTileN][MB];
#pragma GCC unroll 4
  for (int i = 0; i < kTileN; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* w0 = w;
  const float* w1 = w + K;
  const float* w2 = w + 2 * static_cast<size_t>(K);
  const float* w3 = w + 3 * static_cast<size_t>(K);
  for (int k = 0; k < K; k += 16) {
    const __m512 a = _mm512_loadu_ps(w0 + k), b = _mm512_loadu_ps(w1 + k), c = _mm512_loadu_ps(w2 + k), d = _mm512_loadu_ps(w3 + k);
#pragma GCC unroll 6
    for (int j = 0; j < MB; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + static_cast<size_t>(j) * K + k);
      acc[0][j] = _mm512_fmadd_ps(a, xv, acc[0][j]);
      acc[1][j] = _mm512_fmadd_ps(b, xv, acc[1][j]);
      acc[2][j] = _mm512_fmadd_ps(c, xv, acc[2][j]);
      acc[3][j] = _mm512_fmadd_ps(d, xv, acc[3][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kTileN; ++i)
#pragma GCC unroll 6
    for (int j = 0; j < MB; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

__attribute__((target("avx512f,avx512bw")))
void tile_dots_any(int mb, const float* w, const float* x, int K, float out[kTileN][kTileMaxM]) {
  switch (mb) {
    case 1: tile_dots<1>(w, x, K, out); break;
    case 2: tile_dots<2>(w, x, K, out); break;
    case 3: tile_dots<3>(w, x, K, out); break;
    case 4: tile_dots<4>(w, x, K, out); break;
    case 5: tile_dots<5>(w, x, K, out); break;
    default: tile_dots<6>(w, x, K, out); break;
  }
}

// Weight rows [n0, n1) (n1 - n0 a multiple of kTileN, or the tail of N) of
// the tiled product; `xp` is x in the expanded rows' element order.
__attribute__((target("avx512f,avx512bw")))
void rows_avx512_tiled(const Problem& p, const float* xp, int n0, int n1) {
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(kTileN) * p.K);
  float dots[kTileN][kTileMaxM];
  for (int n = n0; n < n1; n += kTileN) {
    const int nc = std::min(kTileN, n1 - n);
    for (int i = 0; i < kTileN; ++i) {
      float* dst = buf.data() + static_cast<size_t>(i) * p.K;
      if (i < nc) expand_row(p, n + i, dst);
      else std::fill(dst, dst + p.K, 0.f);  // tail rows: computed, never stored
    }
    for (int m0 = 0; m0 < p.M; m0 += kTileMaxM) {
      const int mb = std::min(kTileMaxM, p.M - m0);
      tile_dots_any(mb, buf.data(), xp + static_cast<size_t>(m0) * p.K, p.K, dots);
      for (int i = 0; i < nc; ++i) {
        const float* br = p.biases + static_cast<size_t>(n + i) * p.G;
        for (int j = 0; j < mb; ++j) {
          const float* xs = p.xsum + static_cast<size_t>(m0 + j) * p.G;
          const float bias = _mm512_reduce_add_ps(add_bias_term(_mm512_setzero_ps(), br, xs, p.G));
          p.out[static_cast<size_t>(m0 + j) * p.N + n + i] = dots[i][j] + bias;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Integer-dot path (AVX-512 VNNI; on AVX2, int_block_avx2 with VPMADDWD,
// for 4- and 8-bit codes). x is quantized once per call, per weight
// group, into two 16-bit words per element: x = scale * (high + low / 128)
// with |high| <= 8191 and |low| <= 64, so it keeps ~21 bits of each group's
// range (error <= max|x| * 5e-7 per element). Each step multiplies a weight
// row's codes against both words with VPDPWSSD (32 int16 products summed
// into int32 lanes per instruction), as 128 * code * high + code * low in
// one int32 sum (the codes shifted left by 7 for the high words), which is
// converted and scaled to float once per two groups.
//
// Why two words: one int16 word (and llama.cpp's int8 activations, coarser
// still) rounds every element of a group to max|x| / 32767; the groups that
// hold an outlier activation then lose the rest of their precision, and the
// reference tests' logits moved by up to 1e-3 (SmolLM2, Gemma 3; a greedy
// token flipped). Two words keep them within ~2e-6 of the float kernel.
// Overflow: per lane and step at most 4 products of |code << 7| <= 32640
// and |high| <= 8191, plus 4 of |code| <= 255 and |low| <= 64: < 1.1e9.
//
// Layout of one "step" of a weight row (two groups; lanes 0-7 of every int32
// accumulator belong to the first group, lanes 8-15 to the second):
//   4-bit, groups of 32: 32 code bytes; words a = even elements of both
//     groups (low nibbles), b = odd elements (high nibbles).
//   8-bit, groups of 32: 64 code bytes; a = elements 0-15 of both, b = 16-31.
//   5-bit, groups of 32: 40 bytes (cpu_dequantize.h's layout); a and b as
//     for 4 bits, the fifth bits added by a masked add.
//   8-bit, groups of 16: 32 code bytes; a = all 16 elements of both.
// x's words are stored in the same order (int_step_element), so every
// format runs the same multiply-accumulate.
//
// Every output is computed the same way whatever the number of rows in the
// call or where the row sits in it (the same per-step operations in the same
// order), so a row's result is bit-identical alone or batched.

enum class Format { kQ4G32, kQ5G32, kQ8G32, kQ8G16 };

constexpr int step_words(Format f) { return f == Format::kQ8G16 ? 32 : 64; }
constexpr int step_groups = 2;
constexpr float kHighMax = 8191.f;
constexpr float kLowScale = 128.f;  // = 1 << kCodeShift
constexpr int kCodeShift = 7;

// Element (within the row) of word w of step s.
int int_step_element(Format f, int s, int w) {
  switch (f) {
    case Format::kQ4G32:
    case Format::kQ5G32: {
      const int odd = w >= 32, half = (w % 32) / 16, j = w % 16;
      return (2 * s + half) * 32 + 2 * j + odd;
    }
    case Format::kQ8G32: {
      const int upper = w >= 32, half = (w % 32) / 16, j = w % 16;
      return (2 * s + half) * 32 + 16 * upper + j;
    }
    default:
      return (2 * s + w / 16) * 16 + w % 16;
  }
}

// x quantized for the integer path: per row and step, the high words then
// the low words in step order, and the step's lane scales (group g's scale
// in its 8 lanes). The bias term uses the float sums of x (Problem::xsum).
struct IntActivations {
  std::vector<int16_t> words;  // [M, steps, 2, step_words]
  std::vector<float> lane_scales;  // [M, steps, 16]
  int steps = 0;
};

void quantize_activations(const Problem& p, Format f, IntActivations& a) {
  const int gs = p.K / p.G;
  const int W = step_words(f);
  a.steps = p.G / step_groups;
  a.words.resize(static_cast<size_t>(p.M) * 2 * p.K);
  a.lane_scales.resize(static_cast<size_t>(p.M) * a.steps * 16);
  std::vector<float> scale(p.G), inv(p.G);
  for (int m = 0; m < p.M; ++m) {
    const float* xr = p.x + static_cast<size_t>(m) * p.K;
    for (int g = 0; g < p.G; ++g) {
      float amax = 0.f;
      for (int j = 0; j < gs; ++j) amax = std::max(amax, std::fabs(xr[g * gs + j]));
      scale[g] = amax / kHighMax;
      inv[g] = amax > 0.f ? kHighMax / amax : 0.f;
    }
    int16_t* wr = a.words.data() + static_cast<size_t>(m) * 2 * p.K;
    for (int s = 0; s < a.steps; ++s)
      for (int w = 0; w < W; ++w) {
        const int e = int_step_element(f, s, w);
        const float t = xr[e] * inv[e / gs];
        const float high = std::nearbyint(t);
        wr[s * 2 * W + w] = static_cast<int16_t>(high);
        wr[s * 2 * W + W + w] = static_cast<int16_t>(std::nearbyint((t - high) * kLowScale));
      }
    float* lr = a.lane_scales.data() + (static_cast<size_t>(m) * a.steps) * 16;
    for (int s = 0; s < a.steps; ++s)
      for (int l = 0; l < 16; ++l) lr[s * 16 + l] = scale[2 * s + l / 8] / kLowScale;
  }
}

// The int16 code words of step s of a weight row (b unused for kQ8G16).
template <Format F>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
inline void load_step_codes(const uint8_t* wr, int s, __m512i& a, __m512i& b) {
  if constexpr (F == Format::kQ5G32) {
    unpack_5bit_step(wr + s * kFiveBitStepBytes, a, b);
  } else if constexpr (F == Format::kQ4G32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + s * 32));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    a = _mm512_cvtepu8_epi16(_mm256_and_si256(v, nib));
    b = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
  } else if constexpr (F == Format::kQ8G32) {
    const __m256i g0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + s * 64));
    const __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + s * 64 + 32));
    a = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(g0, g1, 0x20));
    b = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(g0, g1, 0x31));
  } else {
    a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + s * 32)));
    b = _mm512_setzero_si512();
  }
}

// Weight scales of step s's two groups, each in its 8 lanes.
__attribute__((target("avx512f,avx512bw,avx512vnni")))
inline __m512 step_weight_scales(const float* sr, int s) {
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sr + 2 * s)));
  return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(two));
}

// NR weight rows from n against MR activation rows from m0.
template <Format F, int NR, int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void int_block(const Problem& p, const IntActivations& xa, int n, int m0) {
  constexpr int W = step_words(F);
  constexpr bool kTwoVectors = F != Format::kQ8G16;
  constexpr int kBits = F == Format::kQ4G32 ? 4 : F == Format::kQ5G32 ? 5 : 8;
  const int row_bytes = p.K * kBits / 8;
  __m512 acc[NR][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int16_t* xw = xa.words.data() + static_cast<size_t>(m0) * 2 * p.K;
  const float* xl = xa.lane_scales.data() + static_cast<size_t>(m0) * xa.steps * 16;
  constexpr int step_bytes = F == Format::kQ8G32 ? 64 : F == Format::kQ5G32 ? kFiveBitStepBytes : 32;
  for (int s = 0; s < xa.steps; ++s) {
    __m512i ca[NR], cb[NR], ha[NR], hb[NR];  // codes, and codes << kCodeShift for the high words
    __m512 ws[NR];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      prefetch_ahead(p.w + static_cast<size_t>(n + i) * row_bytes + s * step_bytes);
      load_step_codes<F>(p.w + static_cast<size_t>(n + i) * row_bytes, s, ca[i], cb[i]);
      ha[i] = _mm512_slli_epi16(ca[i], kCodeShift);
      if constexpr (kTwoVectors) hb[i] = _mm512_slli_epi16(cb[i], kCodeShift);
      ws[i] = step_weight_scales(p.scales + static_cast<size_t>(n + i) * p.G, s);
    }
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      const int16_t* xr = xw + static_cast<size_t>(j) * 2 * p.K + s * 2 * W;
      const __m512i xha = _mm512_loadu_si512(xr), xla = _mm512_loadu_si512(xr + W);
      __m512i xhb = _mm512_setzero_si512(), xlb = _mm512_setzero_si512();
      if constexpr (kTwoVectors) {
        xhb = _mm512_loadu_si512(xr + 32);
        xlb = _mm512_loadu_si512(xr + W + 32);
      }
      const __m512 xs = _mm512_loadu_ps(xl + (static_cast<size_t>(j) * xa.steps + s) * 16);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), ha[i], xha);
        d = _mm512_dpwssd_epi32(d, ca[i], xla);
        if constexpr (kTwoVectors) {
          d = _mm512_dpwssd_epi32(d, hb[i], xhb);
          d = _mm512_dpwssd_epi32(d, cb[i], xlb);
        }
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[i], xs), acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      const float* br = p.biases + static_cast<size_t>(n + i) * p.G;
      const float* xs = p.xsum + static_cast<size_t>(m0 + j) * p.G;
      p.out[static_cast<size_t>(m0 + j) * p.N + n + i] = _mm512_reduce_add_ps(add_bias_term(acc[i][j], br, xs, p.G));
    }
}

constexpr int kIntRowsN = 2;  // weight rows per block

// The integer path's block kernels, by instruction set: `Kernel::block<F,
// NR, MR>` runs NR weight rows from n against MR activation rows from m0.
struct VnniKernel {
  template <Format F, int NR, int MR>
  static void block(const Problem& p, const IntActivations& xa, int n, int m0) { int_block<F, NR, MR>(p, xa, n, m0); }
};

// All of the call's activation rows (1 to kTiledMinRows - 1) in one block.
template <class Kernel, Format F, int NR>
void int_block_rows(const Problem& p, const IntActivations& xa, int n) {
  static_assert(kTiledMinRows - 1 == 3, "int_block_rows spells out 1 to 3 rows");
  switch (p.M) {
    case 3: Kernel::template block<F, NR, 3>(p, xa, n, 0); break;
    case 2: Kernel::template block<F, NR, 2>(p, xa, n, 0); break;
    default: Kernel::template block<F, NR, 1>(p, xa, n, 0); break;
  }
}

template <class Kernel, Format F>
void rows_int(const Problem& p, const IntActivations& xa, int n0, int n1) {
  int n = n0;
  for (; n + kIntRowsN <= n1; n += kIntRowsN) int_block_rows<Kernel, F, kIntRowsN>(p, xa, n);
  for (; n < n1; ++n) int_block_rows<Kernel, F, 1>(p, xa, n);
}


// ---------------------------------------------------------------------------
// AVX2 + FMA path, for CPUs without AVX-512 (AMD Zen 2 and 3, older Intel).
// One kernel for any number of activation rows, with each output computed
// by the same operations in the same order whatever the rows around it, so
// a row's result is bit-identical alone or batched: per group, the dot
// product of the unscaled codes with x (one FMA chain over the group's
// 8-wide chunks), then acc += dot * scale; at the end the 8 lanes are summed
// in a fixed order and the bias term sum_g b_g * xsum_g added. Rows go in
// blocks of up to kAvx2Rows that share each group's code expansion; 4-bit x
// is read in the [even | odd] order of each group (permute_x_for_4bit), the
// order the nibbles unpack in.

constexpr int kAvx2Rows = 4;

// Group sizes the AVX2 kernel takes: it unpacks 8 bytes (16 4-bit codes,
// 8 8-bit codes) at a time.
bool avx2_supports(const Problem& p) {
  const int gs = p.K / p.G;
  return isa_at_least(Isa::Avx2) && p.bits != 5 && gs % (p.bits == 4 ? 16 : 8) == 0;
}

// The bias term of one output: sum over groups of b_g * xsum_g.
inline float bias_term(const float* b, const float* xs, int G) {
  float bias = 0.f;
  for (int g = 0; g < G; ++g) bias += b[g] * xs[g];
  return bias;
}

// Weight row n against activation rows [m0, m0 + MB).
template <int BITS, int MB>
__attribute__((target("avx2,fma")))
void avx2_block(const Problem& p, const float* xp, int n, int m0) {
  const int gs = p.K / p.G;
  const uint8_t* wr = p.w + static_cast<size_t>(n) * p.K * BITS / 8;
  const float* sr = p.scales + static_cast<size_t>(n) * p.G;
  const float* x0 = xp + static_cast<size_t>(m0) * p.K;
  __m256 acc[MB];
  #pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int g = 0; g < p.G; ++g) {
    __m256 dot[MB];
    #pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) dot[m] = _mm256_setzero_ps();
    const size_t xg = static_cast<size_t>(g) * gs;
    if constexpr (BITS == 4) {
      // Byte i holds element 2i (low nibble) and 2i + 1 (high); x holds the
      // group's even elements, then its odd ones. 8 bytes at a time.
      const __m256i nib = _mm256_set1_epi32(0x0F);
      for (int b = 0; b < gs / 2; b += 8) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + xg / 2 + b)));
        const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(v, nib)), odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        #pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) {
          const float* xm = x0 + static_cast<size_t>(m) * p.K + xg + b;
          dot[m] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xm), dot[m]);
          dot[m] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xm + gs / 2), dot[m]);
        }
      }
    } else {
      for (int e = 0; e < gs; e += 8) {
        const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + xg + e))));
        #pragma GCC unroll 4
        for (int m = 0; m < MB; ++m) dot[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x0 + static_cast<size_t>(m) * p.K + xg + e), dot[m]);
      }
    }
    const __m256 s = _mm256_set1_ps(sr[g]);
    #pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(dot[m], s, acc[m]);
  }
  const float* br = p.biases + static_cast<size_t>(n) * p.G;
  #pragma GCC unroll 4
  for (int m = 0; m < MB; ++m) {
    const float* xs = p.xsum + static_cast<size_t>(m0 + m) * p.G;
    p.out[static_cast<size_t>(m0 + m) * p.N + n] = sum_lanes(acc[m]) + bias_term(br, xs, p.G);
  }
}

template <int BITS>
void rows_avx2(const Problem& p, const float* xp, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    int m0 = 0;
    for (; m0 + kAvx2Rows <= p.M; m0 += kAvx2Rows) avx2_block<BITS, kAvx2Rows>(p, xp, n, m0);
    switch (p.M - m0) {
      case 3: avx2_block<BITS, 3>(p, xp, n, m0); break;
      case 2: avx2_block<BITS, 2>(p, xp, n, m0); break;
      case 1: avx2_block<BITS, 1>(p, xp, n, m0); break;
      default: break;
    }
  }
}

// The integer path's format for this problem, if it has one: with AVX-512
// VNNI every format; on a CPU whose best is AVX2 (int_block_avx2) the 4- and
// 8-bit ones. (AVX-512 without VNNI keeps its float kernels.)
std::optional<Format> int_format(const Problem& p) {
  const int gs = p.K / p.G;
  const bool vnni = isa_at_least(Isa::Avx512Vnni), avx2_only = isa_at_least(Isa::Avx2) && !isa_at_least(Isa::Avx512);
  if (!(vnni || avx2_only) || p.G % step_groups != 0) return std::nullopt;
  if (p.bits == 4 && gs == 32) return Format::kQ4G32;
  if (p.bits == 5 && gs == 32 && vnni) return Format::kQ5G32;
  if (p.bits == 8 && gs == 32) return Format::kQ8G32;
  if (p.bits == 8 && gs == 16) return Format::kQ8G16;
  return std::nullopt;
}

// The integer path on AVX2: the same quantized activations and the same
// integer sums as int_block, with VPMADDWD (16 int16 products summed in
// pairs into 8 int32 lanes) on each half of a step's 512-bit vectors: the
// first half is the step's first group, the second half its second. The
// codes are not shifted: a half's high-word products are summed, then
// shifted left by kCodeShift in int32 (< 8.4e6 << 7, no overflow), which
// gives int_block's exact integers with half the code registers.

// The int16 codes of one half (0: the step's first group, 1: its second)
// of step s: words a and b as load_step_codes gives them (b zero for kQ8G16).
template <Format F>
__attribute__((target("avx2,fma")))
inline void load_half_codes(const uint8_t* wr, int s, int half, __m256i& a, __m256i& b) {
  if constexpr (F == Format::kQ4G32) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + s * 32 + half * 16));
    const __m128i nib = _mm_set1_epi8(0x0F);
    a = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
    b = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
  } else if constexpr (F == Format::kQ8G32) {
    // Group 2s + half's 32 bytes: a = its elements 0-15, b = 16-31.
    const uint8_t* g = wr + s * 64 + half * 32;
    a = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
    b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
  } else {
    static_assert(F == Format::kQ8G16, "5-bit codes take the VNNI kernel only");
    a = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + s * 32 + half * 16)));
    b = _mm256_setzero_si256();
  }
}

// NR weight rows from n against MR activation rows from m0 (int_block's
// contract: bit-identical whatever the rows around it).
template <Format F, int NR, int MR>
__attribute__((target("avx2,fma")))
void int_block_avx2(const Problem& p, const IntActivations& xa, int n, int m0) {
  constexpr int W = step_words(F);
  constexpr bool kTwoVectors = F != Format::kQ8G16;
  constexpr int kBits = F == Format::kQ4G32 ? 4 : 8;
  constexpr int step_bytes = F == Format::kQ8G32 ? 64 : 32;
  const int row_bytes = p.K * kBits / 8;
  __m256 acc[NR][MR];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int16_t* xw = xa.words.data() + static_cast<size_t>(m0) * 2 * p.K;
  const float* xl = xa.lane_scales.data() + static_cast<size_t>(m0) * xa.steps * 16;
  for (int s = 0; s < xa.steps; ++s) {
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) prefetch_ahead(p.w + static_cast<size_t>(n + i) * row_bytes + s * step_bytes);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m256i ca[NR], cb[NR];
      __m256 ws[NR];
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) {
        load_half_codes<F>(p.w + static_cast<size_t>(n + i) * row_bytes, s, half, ca[i], cb[i]);
        ws[i] = _mm256_set1_ps(p.scales[static_cast<size_t>(n + i) * p.G + 2 * s + half]);
      }
#pragma GCC unroll 4
      for (int j = 0; j < MR; ++j) {
        const int16_t* xr = xw + static_cast<size_t>(j) * 2 * p.K + s * 2 * W + half * 16;
        const __m256i xha = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i xla = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + W));
        __m256i xhb = _mm256_setzero_si256(), xlb = _mm256_setzero_si256();
        if constexpr (kTwoVectors) {
          xhb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
          xlb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + W + 32));
        }
        const __m256 xs = _mm256_set1_ps(xl[(static_cast<size_t>(j) * xa.steps + s) * 16 + half * 8]);
#pragma GCC unroll 4
        for (int i = 0; i < NR; ++i) {
          __m256i high = _mm256_madd_epi16(ca[i], xha), low = _mm256_madd_epi16(ca[i], xla);
          if constexpr (kTwoVectors) {
            high = _mm256_add_epi32(high, _mm256_madd_epi16(cb[i], xhb));
            low = _mm256_add_epi32(low, _mm256_madd_epi16(cb[i], xlb));
          }
          const __m256i d = _mm256_add_epi32(_mm256_slli_epi32(high, kCodeShift), low);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws[i], xs), acc[i][j]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < MR; ++j) {
      const float* br = p.biases + static_cast<size_t>(n + i) * p.G;
      const float* xs = p.xsum + static_cast<size_t>(m0 + j) * p.G;
      p.out[static_cast<size_t>(m0 + j) * p.N + n + i] = sum_lanes(acc[i][j]) + bias_term(br, xs, p.G);
    }
}

struct Avx2IntKernel {
  template <Format F, int NR, int MR>
  static void block(const Problem& p, const IntActivations& xa, int n, int m0) { int_block_avx2<F, NR, MR>(p, xa, n, m0); }
};

// x with each group as [its even elements | its odd elements]: the order
// 4-bit codes unpack in (low nibbles, then high ones).
const float* permute_x_for_4bit(const Problem& p, std::vector<float>& xperm) {
  const int gs = p.K / p.G;
  xperm.resize(static_cast<size_t>(p.M) * p.K);
  for (int m = 0; m < p.M; ++m)
    for (int g = 0; g < p.G; ++g)
      for (int j = 0; j < gs / 2; ++j) {
        const size_t src = static_cast<size_t>(m) * p.K + static_cast<size_t>(g) * gs;
        xperm[src + j] = p.x[src + 2 * j];
        xperm[src + gs / 2 + j] = p.x[src + 2 * j + 1];
      }
  return xperm.data();
}

void run_problem(Problem p) {
  const int gs = p.K / p.G;
  std::vector<float> xsum(static_cast<size_t>(p.M) * p.G), xeven, xodd, xperm;
  for (int m = 0; m < p.M; ++m)
    for (int g = 0; g < p.G; ++g) {
      float s = 0.f;
      for (int j = 0; j < gs; ++j) s += p.x[static_cast<size_t>(m) * p.K + g * gs + j];
      xsum[m * p.G + g] = s;
    }
  p.xsum = xsum.data();
  // The portable kernel on any CPU, to measure the vector paths against it.
  static const bool portable_only = std::getenv("TETHER_QMM_PORTABLE") != nullptr;
  if (portable_only) {
    RowPool::get().run(p.N, 64, [&](int a, int b) { rows_scalar(p, a, b); });
    return;
  }
  static const bool float_only = std::getenv("TETHER_QMM_FLOAT") != nullptr;  // for comparisons
  if (auto f = int_format(p); f && !float_only && p.M < kTiledMinRows) {
    // A reference the workers capture: a thread_local named inside the
    // lambda would be each worker's own (empty) instance.
    thread_local IntActivations calling_thread_acts;
    IntActivations& xa = calling_thread_acts;
    quantize_activations(p, *f, xa);
    const bool vnni = isa_at_least(Isa::Avx512Vnni);
    RowPool::get().run(p.N, 64, [&](int a, int b) {
      switch (*f) {
        case Format::kQ4G32: vnni ? rows_int<VnniKernel, Format::kQ4G32>(p, xa, a, b) : rows_int<Avx2IntKernel, Format::kQ4G32>(p, xa, a, b); break;
        case Format::kQ5G32: rows_int<VnniKernel, Format::kQ5G32>(p, xa, a, b); break;
        case Format::kQ8G32: vnni ? rows_int<VnniKernel, Format::kQ8G32>(p, xa, a, b) : rows_int<Avx2IntKernel, Format::kQ8G32>(p, xa, a, b); break;
        case Format::kQ8G16: vnni ? rows_int<VnniKernel, Format::kQ8G16>(p, xa, a, b) : rows_int<Avx2IntKernel, Format::kQ8G16>(p, xa, a, b); break;
      }
    });
    return;
  }
  if (!isa_at_least(Isa::Avx512) && avx2_supports(p)) {
    const float* xp = p.bits == 4 ? permute_x_for_4bit(p, xperm) : p.x;
    RowPool::get().run(p.N, 64, [&](int a, int b) {
      if (p.bits == 4) rows_avx2<4>(p, xp, a, b);
      else rows_avx2<8>(p, xp, a, b);
    });
    return;
  }
  enum { kScalar, kG32, kG16, kTiled } path = kScalar;
  if (isa_at_least(Isa::Avx512) && gs == 32) path = kG32;
  if (isa_at_least(Isa::Avx512) && gs == 16 && p.bits == 8) path = kG16;
  // 5-bit codes have no per-row float kernel: any number of rows goes tiled.
  if (path != kScalar && (p.M >= kTiledMinRows || p.bits == 5) && (p.bits == 8 || gs == 32)) path = kTiled;
  const float* xp = p.x;
  if (path == kTiled && (p.bits == 4 || p.bits == 5)) xp = permute_x_for_4bit(p, xperm);
  if (path == kG32 && p.bits == 4) {
    xeven.resize(static_cast<size_t>(p.M) * p.K / 2);
    xodd.resize(xeven.size());
    for (int m = 0; m < p.M; ++m)
      for (int i = 0; i < p.K / 2; ++i) {
        xeven[static_cast<size_t>(m) * p.K / 2 + i] = p.x[static_cast<size_t>(m) * p.K + 2 * i];
        xodd[static_cast<size_t>(m) * p.K / 2 + i] = p.x[static_cast<size_t>(m) * p.K + 2 * i + 1];
      }
    p.xeven = xeven.data();
    p.xodd = xodd.data();
  }
  // Chunks of weight rows: a multiple of the tile, large enough to amortise
  // the hand-off, small enough to balance two cores on small products.
  RowPool::get().run(p.N, 64, [&](int a, int b) {
    switch (path) {
      case kTiled: rows_avx512_tiled(p, xp, a, b); break;
      case kG32:
        if (p.bits == 8) rows_avx512_g32<8>(p, a, b);
        else rows_avx512_g32<4>(p, a, b);
        break;
      case kG16: rows_avx512_8bit_g16(p, a, b); break;
      default: rows_scalar(p, a, b);
    }
  });
}

// x RMS-normed by `weight` as MLX's fast::rms_norm computes it in float32
// (x * (1 / sqrt(mean(x^2) + eps)) * weight), rows of K into `dst`.
void rms_norm_rows(const float* x, const float* weight, float eps, int M, int K, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + static_cast<size_t>(m) * K;
    float ss = 0.f;
    for (int k = 0; k < K; ++k) ss += xr[k] * xr[k];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
    float* d = dst.data() + static_cast<size_t>(m) * K;
    for (int k = 0; k < K; ++k) d[k] = xr[k] * inv * weight[k];
  }
}

// What a product folds in around it, so a decoder layer's decode needs fewer
// graph nodes: the RMS norm in front of it (the layer's input norms) and the
// residual added after it (the layer's two residual adds). Each node costs
// ~6 us of host time on a 2-core CPU, and a decode step had ~620.
struct Fusion {
  bool norm = false;  // inputs then hold the norm's weight [K] after the biases,
  float eps = 0.f;
  bool bias = false;  // then the projection's bias [N],
  bool residual = false;  // and the residual [.., N] last
};

class CpuAffineMatmul : public mx::UnaryPrimitive {
 public:
  CpuAffineMatmul(mx::Stream s, int group_size, int bits, Fusion fusion)
      : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits), fusion_(fusion) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = start_cpu_eval(stream(), in, out);
    Problem p{};
    p.M = static_cast<int>(in[0].size() / in[0].shape(-1));
    p.K = in[0].shape(-1);
    p.N = in[1].shape(0);
    p.G = p.K / group_size_;
    p.bits = bits_;
    float* out_ptr = out.data<float>();
    enc.dispatch([in, out_ptr, p, f = fusion_]() mutable {
      thread_local std::vector<float> x_copy, x_normed, residual_copy;
      p.x = row_major_f32(in[0], x_copy);
      if (f.norm) {
        rms_norm_rows(p.x, in[4].data<float>(), f.eps, p.M, p.K, x_normed);
        p.x = x_normed.data();
      }
      p.w = reinterpret_cast<const uint8_t*>(in[1].data<uint32_t>());
      p.scales = in[2].data<float>();
      p.biases = in[3].data<float>();
      p.out = out_ptr;
      run_problem(p);
      // (product + bias) + residual, as MLX's adds of the three would give.
      if (f.bias) {
        const float* b = in[f.norm ? 5 : 4].data<float>();
        for (int m = 0; m < p.M; ++m)
          for (int n = 0; n < p.N; ++n) out_ptr[static_cast<size_t>(m) * p.N + n] += b[n];
      }
      if (f.residual) {
        const float* r = row_major_f32(in.back(), residual_copy);
        const size_t n = static_cast<size_t>(p.M) * p.N;
        for (size_t i = 0; i < n; ++i) out_ptr[i] += r[i];
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_affine_matmul runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuAffineMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuAffineMatmul*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->fusion_.norm == fusion_.norm && o->fusion_.eps == fusion_.eps &&
           o->fusion_.bias == fusion_.bias && o->fusion_.residual == fusion_.residual;
  }

 private:
  int group_size_, bits_;
  Fusion fusion_;
};

}  // namespace

bool cpu_affine_five_bit_fast() { return isa_at_least(Isa::Avx512Vnni); }

mx::array cpu_affine_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                            const std::optional<mx::array>& norm_weight, float eps, const std::optional<mx::array>& bias,
                            const std::optional<mx::array>& residual) {
  if (bits != 4 && bits != 5 && bits != 8) throw std::invalid_argument("cpu_affine_matmul supports 4, 5 and 8 bits");
  if (x.dtype() != mx::float32 || scales.dtype() != mx::float32 || biases.dtype() != mx::float32)
    throw std::invalid_argument("cpu_affine_matmul needs float32 activations, scales and biases");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("cpu_affine_matmul: packed weights must be 2-D uint32");
  int K = x.shape(-1);
  int N = w.shape(0);
  if (group_size <= 0 || K % group_size != 0 || w.shape(1) * 32 != K * bits || scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("cpu_affine_matmul: shapes of x, weights, scales and biases disagree");
  if (bits == 5 && (group_size != 32 || K % kFiveBitStepElements != 0))
    throw std::invalid_argument("cpu_affine_matmul: 5-bit rows come in groups of 32, a multiple of 64 wide");
  if (static_cast<int>(x.size() / K) > kCpuQmmMaxRows)
    throw std::invalid_argument("cpu_affine_matmul: too many rows (use dequantize + matmul)");
  auto cpu = mx::default_stream(mx::Device::cpu);
  auto out_shape = x.shape();
  out_shape.back() = N;
  std::vector<mx::array> inputs = {x, contiguous_unless_ready(w, cpu), contiguous_unless_ready(scales, cpu), contiguous_unless_ready(biases, cpu)};
  Fusion fusion;
  if (norm_weight) {
    if (norm_weight->dtype() != mx::float32 || norm_weight->size() != static_cast<size_t>(K))
      throw std::invalid_argument("cpu_affine_matmul: the norm's weight must be float32 of the input size");
    fusion.norm = true;
    fusion.eps = eps;
    inputs.push_back(contiguous_unless_ready(*norm_weight, cpu));
  }
  if (bias) {
    if (bias->dtype() != mx::float32 || bias->size() != static_cast<size_t>(N))
      throw std::invalid_argument("cpu_affine_matmul: the bias must be float32 of the output size");
    fusion.bias = true;
    inputs.push_back(contiguous_unless_ready(*bias, cpu));
  }
  if (residual) {
    if (residual->dtype() != mx::float32 || residual->shape() != out_shape)
      throw std::invalid_argument("cpu_affine_matmul: the residual must be float32 of the output's shape");
    fusion.residual = true;
    inputs.push_back(*residual);
  }
  return mx::array(out_shape, mx::float32, std::make_shared<CpuAffineMatmul>(cpu, group_size, bits, fusion), std::move(inputs));
}

}  // namespace tether_mlx
