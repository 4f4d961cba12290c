// See cpu_swiglu.h.
#include "tether-mlx/src/cpu_swiglu.h"
#include "tether-mlx/src/cpu_isa.h"

#include <cmath>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "tether-mlx/src/cpu_eval.h"
#include "mlx/primitives.h"
#include "tether-mlx/src/row_pool.h"
#include "tether-mlx/src/simd_exp.h"

namespace tether_mlx {
namespace {

namespace mx = mlx::core;

// Rows per pool task: enough work to be worth a hand-off.
constexpr int kRowsPerTask = 4;

void swiglu_row_scalar(const float* gate, const float* up, float* out, int ff) {
  for (int j = 0; j < ff; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

// sigmoid(x) from e = e^-|x| <= 1, so the exponential never overflows:
// 1 / (1 + e) for x >= 0, e / (1 + e) below.
__attribute__((target("avx512f")))
void swiglu_row_avx512(const float* gate, const float* up, float* out, int ff) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int j = 0; j < ff; j += 16) {
    const __m512 x = _mm512_loadu_ps(gate + j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(inv, negative, inv, e);
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(up + j)));
  }
}

class CpuSwiglu : public mx::UnaryPrimitive {
 public:
  explicit CpuSwiglu(mx::Stream s) : mx::UnaryPrimitive(s) {}

  // in: gate_up (read through row_major_f32).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = start_cpu_eval(stream(), in, out);
    enc.dispatch([in, dst = out.data<float>(), ff = out.shape(-1), rows = static_cast<int>(out.size() / out.shape(-1))]() {
      thread_local std::vector<float> copy;
      const float* src = row_major_f32(in[0], copy);
      auto row = isa_at_least(Isa::Avx512) && ff % 16 == 0 ? swiglu_row_avx512 : swiglu_row_scalar;
      RowPool::get().run(rows, kRowsPerTask, [&](int b, int e) {
        for (int t = b; t < e; ++t) {
          const float* g = src + static_cast<size_t>(t) * 2 * ff;
          row(g, g + ff, dst + static_cast<size_t>(t) * ff, ff);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_swiglu runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuSwiglu"; }

  bool is_equivalent(const mx::Primitive& other) const override { return dynamic_cast<const CpuSwiglu*>(&other) != nullptr; }
};

}  // namespace

mx::array swiglu_activation(const mx::array& gate_up) {
  if (gate_up.dtype() != mx::float32 || gate_up.ndim() < 1 || gate_up.shape(-1) % 2 != 0)
    throw std::invalid_argument("cpu_swiglu: gate_up must be float32 with an even last axis");
  auto cpu = mx::default_stream(mx::Device::cpu);
  auto shape = gate_up.shape();
  shape.back() /= 2;
  return mx::array(std::move(shape), mx::float32, std::make_shared<CpuSwiglu>(cpu), {gate_up});
}

}  // namespace tether_mlx
