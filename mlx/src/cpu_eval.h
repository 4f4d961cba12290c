// The common start of our CPU primitives' eval_cpu.
#pragma once

#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace tether_mlx {

// Allocates `out` and registers every input and the output with the CPU
// stream's encoder, which orders the work dispatched next after the inputs'
// producers and keeps the arrays alive until it has run. Returns the encoder.
inline mlx::core::cpu::CommandEncoder& start_cpu_eval(mlx::core::Stream stream, const std::vector<mlx::core::array>& in, mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : in) enc.set_input_array(a);
  enc.set_output_array(out);
  return enc;
}

}  // namespace tether_mlx
