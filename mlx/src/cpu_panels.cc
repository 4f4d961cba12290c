// Panel GEMM for dense float32 weights; see cpu_panels.h for why.
//
// Invariants: x is read through row_major_f32; panels are checked to be
// [P, K, kPanelWidth] float32 (and made row-contiguous) before the primitive
// is built; the output
// buffer is allocated in eval_cpu and filled by the dispatched task, which
// holds copies of the input arrays so their buffers outlive it.
#include "tether-mlx/src/cpu_panels.h"
#include "tether-mlx/src/cpu_isa.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <immintrin.h>

#include "mlx/primitives.h"
#include "tether-mlx/src/cpu_eval.h"
#include "tether-mlx/src/row_pool.h"

namespace mx = mlx::core;

namespace tether_mlx {
namespace {

constexpr int kVectors = kPanelWidth / 16;  // zmm registers per panel row
static_assert(kPanelWidth % 16 == 0);

// Activation rows per micro-kernel call: 8 rows x 3 vectors = 24
// accumulators, plus 3 weight vectors and a broadcast, of 32 zmm registers.
constexpr int kRowBlock = 8;

// out[i][0..ncols) = sum_k x[i][k] * panel[k][0..ncols) for MR rows of x
// (stride ldx) into out (stride ldo). The loops over rows and vectors are
// fully unrolled so the accumulators stay in registers.
template <int MR>
__attribute__((target("avx512f")))
void micro_kernel(const float* panel, const float* x, int K, int ldx, float* out, int ldo, int ncols) {
  __m512 acc[MR][kVectors];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const float* wk = panel + static_cast<size_t>(k) * kPanelWidth;
    __m512 w[kVectors];
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) w[v] = _mm512_loadu_ps(wk + 16 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xi = _mm512_set1_ps(x[static_cast<size_t>(i) * ldx + k]);
#pragma GCC unroll 3
      for (int v = 0; v < kVectors; ++v) acc[i][v] = _mm512_fmadd_ps(w[v], xi, acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* o = out + static_cast<size_t>(i) * ldo;
    if (ncols == kPanelWidth) {
      for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(o + 16 * v, acc[i][v]);
    } else {  // the last panel: only its real outputs are stored
      alignas(64) float row[kPanelWidth];
      for (int v = 0; v < kVectors; ++v) _mm512_store_ps(row + 16 * v, acc[i][v]);
      std::memcpy(o, row, static_cast<size_t>(ncols) * sizeof(float));
    }
  }
}

// micro_kernel<rows> for 1 <= rows <= MR (the last block of rows).
template <int MR>
void micro_kernel_rows(int rows, const float* panel, const float* x, int K, int ldx, float* out, int ldo, int ncols) {
  if constexpr (MR > 0) {
    if (rows == MR) micro_kernel<MR>(panel, x, K, ldx, out, ldo, ncols);
    else micro_kernel_rows<MR - 1>(rows, panel, x, K, ldx, out, ldo, ncols);
  }
}

// Panels [p0, p1) against all M rows of x.
void panels_times_rows(const float* x, const float* panels, float* out, int M, int N, int K, int p0, int p1) {
  for (int p = p0; p < p1; ++p) {
    const float* panel = panels + static_cast<size_t>(p) * K * kPanelWidth;
    const int ncols = std::min(kPanelWidth, N - p * kPanelWidth);
    for (int m = 0; m < M; m += kRowBlock)
      micro_kernel_rows<kRowBlock>(std::min(kRowBlock, M - m), panel, x + static_cast<size_t>(m) * K, K, K,
                                   out + static_cast<size_t>(m) * N + static_cast<size_t>(p) * kPanelWidth, N, ncols);
  }
}

class CpuPanelMatmul : public mx::UnaryPrimitive {
 public:
  CpuPanelMatmul(mx::Stream s, int out_features) : mx::UnaryPrimitive(s), out_features_(out_features) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = start_cpu_eval(stream(), in, out);
    const int K = in[0].shape(-1);
    const int M = static_cast<int>(in[0].size() / K);
    const int N = out_features_;
    const int P = in[1].shape(0);
    float* out_ptr = out.data<float>();
    enc.dispatch([x = in[0], panels = in[1], out_ptr, M, N, K, P]() {
      thread_local std::vector<float> x_copy;
      const float* xp = row_major_f32(x, x_copy);
      const float* pp = panels.data<float>();
      // One panel per hand-off: a few dozen panels even for small products,
      // so both cores get an even share.
      RowPool::get().run(P, 1, [&](int a, int b) { panels_times_rows(xp, pp, out_ptr, M, N, K, a, b); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_panel_matmul runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuPanelMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuPanelMatmul*>(&other);
    return o && o->out_features_ == out_features_;
  }

 private:
  int out_features_;
};

}  // namespace

bool panel_kernel_supported() { return isa_at_least(Isa::Avx512); }

mx::array pack_panels(const mx::array& w) {
  if (w.dtype() != mx::float32 || w.ndim() != 2) throw std::invalid_argument("pack_panels needs a 2-D float32 weight");
  auto cpu = mx::default_stream(mx::Device::cpu);
  const int N = w.shape(0), K = w.shape(1);
  const int P = (N + kPanelWidth - 1) / kPanelWidth;
  mx::array rows = w;
  if (P * kPanelWidth != N) rows = mx::concatenate({w, mx::zeros({P * kPanelWidth - N, K}, mx::float32, cpu)}, 0, cpu);
  return mx::contiguous(mx::transpose(mx::reshape(rows, {P, kPanelWidth, K}, cpu), {0, 2, 1}, cpu), false, cpu);
}

mx::array panel_matmul(const mx::array& x, const mx::array& panels, int out_features) {
  if (!panel_kernel_supported()) throw std::invalid_argument("cpu_panel_matmul needs AVX-512");
  if (x.dtype() != mx::float32 || panels.dtype() != mx::float32) throw std::invalid_argument("cpu_panel_matmul needs float32 x and panels");
  if (panels.ndim() != 3 || panels.shape(2) != kPanelWidth || out_features <= 0 ||
      (out_features + kPanelWidth - 1) / kPanelWidth != panels.shape(0))
    throw std::invalid_argument("cpu_panel_matmul: panels are not W packed by pack_panels for this many outputs");
  if (x.ndim() == 0 || x.shape(-1) != panels.shape(1)) throw std::invalid_argument("cpu_panel_matmul: x and W disagree on the input size");
  auto cpu = mx::default_stream(mx::Device::cpu);
  auto out_shape = x.shape();
  out_shape.back() = out_features;
  std::vector<mx::array> inputs = {x, contiguous_unless_ready(panels, cpu)};
  return mx::array(out_shape, mx::float32, std::make_shared<CpuPanelMatmul>(cpu, out_features), std::move(inputs));
}

}  // namespace tether_mlx
