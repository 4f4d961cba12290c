// A CPU kernel for x @ W^T with dense float32 W kept in panels: the layout a
// register-blocked GEMM micro-kernel reads in order, laid out once at load.
//
// Why: BLAS packs W afresh at every call (with a few dozen activation rows
// that copy costs as much as the product), and a dot-product kernel on W's
// rows as stored spends its time on horizontal sums. In panels, each step of
// the micro-kernel loads kPanelWidth consecutive outputs' weights for one
// input feature and broadcasts one input of each activation row against them.
// On a 2-core AVX-512 CPU this runs at 200-225 GFLOP/s from 32 rows up (BLAS:
// 90-180 on the same shapes), and is memory-bound like a GEMV for one row.
//
// Every output row is one fused multiply-add chain over the input features
// in order, whatever the number of rows in the call: a row's result is
// bit-identical alone or batched with others.
#pragma once

#include "mlx/mlx.h"

namespace tether_mlx {

// Output features per panel: three 16-float vectors.
constexpr int kPanelWidth = 48;

// Whether this CPU runs the panel kernel (AVX-512F).
bool panel_kernel_supported();

// W [N, K] float32 -> panels [ceil(N / kPanelWidth), K, kPanelWidth]: panel p
// holds rows p*kPanelWidth.. of W transposed (zeros past row N). Lazy; the
// caller evaluates it.
mlx::core::array pack_panels(const mlx::core::array& w);

// x [..., K] float32 @ W^T for W packed by pack_panels, out_features = N.
// Returns [..., N] float32 on the CPU stream.
mlx::core::array panel_matmul(const mlx::core::array& x, const mlx::core::array& panels, int out_features);

}  // namespace tether_mlx
