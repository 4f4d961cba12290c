// Why: MLX's CPU dequantize is a chain of generic element-wise ops (shift,
// mask, convert, multiply, add) on one thread; before each prefill-sized
// product it took a sixth of a 1,024-token prefill on a 2-core CPU while
// the other core waited. This expands each weight row once, rows split
// over the pool, in a loop the compiler vectorises.
//
// Invariants: w, scales and biases are row-contiguous (made so before the
// primitive is built); the output is allocated in eval_cpu and filled by the
// dispatched task, which holds copies of the input arrays.
#include "tether-mlx/src/cpu_dequantize.h"
#include "tether-mlx/src/cpu_isa.h"

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/primitives.h"
#include "tether-mlx/src/cpu_eval.h"
#include "tether-mlx/src/row_pool.h"

namespace mx = mlx::core;

namespace tether_mlx {
namespace {

// Row n of the weight, groups of `gs` codes (`bits` wide, packed little-end
// first within each byte) times their scale plus their bias. Multiply then
// add, not a fused multiply-add: mx::dequantize rounds after each.
template <int BITS>
void expand_rows(const uint8_t* w, const float* scales, const float* biases, int K, int gs, float* out, int n0, int n1) {
  const int G = K / gs;
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;  // 5 bits: 40 bytes per 64
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* dst = out + static_cast<size_t>(n) * K;
    for (int g = 0; g < G; ++g) {
      const float s = scales[static_cast<size_t>(n) * G + g], b = biases[static_cast<size_t>(n) * G + g];
      const int e0 = g * gs;
      for (int j = 0; j < gs; ++j) {
        const int e = e0 + j;
        const float code = static_cast<float>(affine_code(wr, BITS, e));
        const float scaled = code * s;
        dst[e] = scaled + b;
      }
    }
  }
}

// 5-bit rows (groups of 32), a step of two groups at a time: the codes are
// unpacked as the decode kernel unpacks them, put back in element order
// (even and odd words interleaved), then scaled as expand_rows does.
__attribute__((target("avx512f,avx512bw")))
void expand_rows_5bit(const uint8_t* w, const float* scales, const float* biases, int K, float* out, int n0, int n1) {
  const int G = K / 32, steps = K / kFiveBitStepElements;
  const size_t row_bytes = static_cast<size_t>(steps) * kFiveBitStepBytes;
  // Word i of the first interleave is element i of the step: even i from
  // `even` (index i / 2), odd i from `odd` (32 + i / 2); the second, element 32 + i.
  alignas(64) int16_t first[32], second[32];
  for (int i = 0; i < 32; ++i) {
    first[i] = static_cast<int16_t>((i & 1) * 32 + i / 2);
    second[i] = static_cast<int16_t>((i & 1) * 32 + 16 + i / 2);
  }
  const __m512i lo_idx = _mm512_load_si512(first), hi_idx = _mm512_load_si512(second);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * row_bytes;
    float* dst = out + static_cast<size_t>(n) * K;
    for (int st = 0; st < steps; ++st) {
      __m512i even, odd;
      unpack_5bit_step(wr + st * kFiveBitStepBytes, even, odd);
      const __m512i halves[2] = {_mm512_permutex2var_epi16(even, lo_idx, odd), _mm512_permutex2var_epi16(even, hi_idx, odd)};
      for (int h = 0; h < 2; ++h) {
        const int g = 2 * st + h;
        const __m512 s = _mm512_set1_ps(scales[static_cast<size_t>(n) * G + g]), b = _mm512_set1_ps(biases[static_cast<size_t>(n) * G + g]);
        for (int q = 0; q < 2; ++q) {
          const __m256i words = q == 0 ? _mm512_castsi512_si256(halves[h]) : _mm512_extracti64x4_epi64(halves[h], 1);
          const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(words));
          // The explicitly rounded forms: GCC would contract a plain multiply
          // and add into one FMA, and round differently from expand_rows.
          constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
          _mm512_storeu_ps(dst + g * 32 + q * 16, _mm512_add_round_ps(_mm512_mul_round_ps(code, s, kNearest), b, kNearest));
        }
      }
    }
  }
}

class CpuAffineDequantize : public mx::UnaryPrimitive {
 public:
  CpuAffineDequantize(mx::Stream s, int group_size, int bits) : mx::UnaryPrimitive(s), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = start_cpu_eval(stream(), in, out);
    const int N = out.shape(0), K = out.shape(1), gs = group_size_, bits = bits_;
    float* dst = out.data<float>();
    enc.dispatch([in, dst, N, K, gs, bits]() {
      const auto* w = reinterpret_cast<const uint8_t*>(in[0].data<uint32_t>());
      const float* s = in[1].data<float>();
      const float* b = in[2].data<float>();
      RowPool::get().run(N, 16, [&](int n0, int n1) {
        if (bits == 8) expand_rows<8>(w, s, b, K, gs, dst, n0, n1);
        else if (bits == 4) expand_rows<4>(w, s, b, K, gs, dst, n0, n1);
        else if (isa_at_least(Isa::Avx512)) expand_rows_5bit(w, s, b, K, dst, n0, n1);
        else expand_rows<5>(w, s, b, K, gs, dst, n0, n1);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_affine_dequantize runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuAffineDequantize"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuAffineDequantize*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_;
  }

 private:
  int group_size_, bits_;
};

}  // namespace

mx::array cpu_affine_dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  if (bits != 4 && bits != 5 && bits != 8) throw std::invalid_argument("cpu_affine_dequantize supports 4, 5 and 8 bits");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("cpu_affine_dequantize: packed weights must be 2-D uint32");
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32)
    throw std::invalid_argument("cpu_affine_dequantize needs float32 scales and biases");
  if (w.shape(1) * 32 % bits != 0) throw std::invalid_argument("cpu_affine_dequantize: packed rows hold a fraction of a code");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (group_size <= 0 || K % group_size != 0 || scales.ndim() != 2 || scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("cpu_affine_dequantize: shapes of weights, scales and biases disagree");
  if (bits == 5 && (group_size != 32 || K % kFiveBitStepElements != 0))
    throw std::invalid_argument("cpu_affine_dequantize: 5-bit rows come in groups of 32, a multiple of 64 wide");
  auto cpu = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {contiguous_unless_ready(w, cpu), contiguous_unless_ready(scales, cpu), contiguous_unless_ready(biases, cpu)};
  return mx::array(mx::Shape{N, K}, mx::float32, std::make_shared<CpuAffineDequantize>(cpu, group_size, bits), std::move(inputs));
}

}  // namespace tether_mlx
