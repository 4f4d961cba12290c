// Which x86 instruction sets the CPU kernels may use: what the CPU has,
// lowered by the environment variable TETHER_CPU_ISA (`avx512vnni`,
// `avx512`, `avx2` or `portable`), so the lower paths run, are tested and
// are measured on any machine (an AVX-512 server standing in for the
// AVX2-only laptops users run). A level never rises above what the CPU has.
#pragma once

namespace tether_mlx {

// Ordered: each level has every instruction of the ones below it.
enum class Isa : int {
  // Plain C++ (whatever the compiler's baseline gives).
  Portable = 0,
  // AVX2 + FMA.
  Avx2 = 1,
  // AVX-512 F + BW.
  Avx512 = 2,
  // AVX-512 F + BW + VNNI (integer dot products).
  Avx512Vnni = 3,
};

// The level the kernels use (decided once, at first call).
Isa cpu_isa();

inline bool isa_at_least(Isa level) { return static_cast<int>(cpu_isa()) >= static_cast<int>(level); }

// The level's name, as TETHER_CPU_ISA spells it.
const char* isa_name(Isa level);

}  // namespace tether_mlx
