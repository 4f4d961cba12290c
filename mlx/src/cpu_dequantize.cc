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
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
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
        else expand_rows<4>(w, s, b, K, gs, dst, n0, n1);
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
  if (bits != 4 && bits != 8) throw std::invalid_argument("cpu_affine_dequantize supports 4 and 8 bits");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("cpu_affine_dequantize: packed weights must be 2-D uint32");
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32)
    throw std::invalid_argument("cpu_affine_dequantize needs float32 scales and biases");
  const int N = w.shape(0), K = w.shape(1) * 32 / bits;
  if (group_size <= 0 || K % group_size != 0 || scales.ndim() != 2 || scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape())
    throw std::invalid_argument("cpu_affine_dequantize: shapes of weights, scales and biases disagree");
  auto cpu = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {contiguous_unless_ready(w, cpu), contiguous_unless_ready(scales, cpu), contiguous_unless_ready(biases, cpu)};
  return mx::array(mx::Shape{N, K}, mx::float32, std::make_shared<CpuAffineDequantize>(cpu, group_size, bits), std::move(inputs));
}

}  // namespace tether_mlx
