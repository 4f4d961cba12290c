// SwiGLU's activation on the CPU: silu(gate) * up in one pass.
#pragma once

#include "mlx/mlx.h"

namespace tether_mlx {

// gate_up: float32 [..., 2 * ff], gate in the first half of the last axis
// and up in the second (the fused gate/up projection's output). Returns
// [..., ff] = gate * sigmoid(gate) * up. MLX's CPU sigmoid runs a scalar exp
// (about 74 M/s here) in its own pass, then two more passes multiply; this is
// one pass with a vectorised exp, over both cores.
mlx::core::array swiglu_activation(const mlx::core::array& gate_up);

}  // namespace tether_mlx
