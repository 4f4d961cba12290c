// The common start of our CPU primitives' eval_cpu.
#pragma once

#include <cstdint>
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

// The elements of a float32 input in row-major order, for use inside a
// dispatched task (once the input's data is ready): the array's own buffer
// when it is row-contiguous (activations nearly always are), else a copy
// gathered into `scratch`. Why not wrap inputs in mx::contiguous when the
// graph is built: that adds a node per input per call, hundreds per decode
// step, and the host time they cost exceeded the kernels' own.
inline const float* row_major_f32(const mlx::core::array& a, std::vector<float>& scratch) {
  if (a.flags().row_contiguous) return a.data<float>();
  scratch.resize(a.size());
  const float* base = a.data<float>();
  const int nd = static_cast<int>(a.ndim());
  std::vector<int64_t> index(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t at = 0;
    for (int d = 0; d < nd; ++d) at += index[d] * a.strides()[d];
    scratch[i] = base[at];
    for (int d = nd - 1; d >= 0 && ++index[d] == a.shape(d); --d) index[d] = 0;
  }
  return scratch.data();
}

// Whether `a` can be handed to a kernel as it is: evaluated (weights are)
// and row-contiguous. Anything else goes through mx::contiguous first.
inline bool ready_row_contiguous(const mlx::core::array& a) {
  return a.is_available() && a.flags().row_contiguous;
}

inline mlx::core::array contiguous_unless_ready(const mlx::core::array& a, mlx::core::Stream s) {
  return ready_row_contiguous(a) ? a : mlx::core::contiguous(a, false, s);
}

}  // namespace tether_mlx
