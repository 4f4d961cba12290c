// See cpu_isa.h.
#include "tether-mlx/src/cpu_isa.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace tether_mlx {
namespace {

Isa detected() {
#if defined(__x86_64__)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (avx512 && __builtin_cpu_supports("avx512vnni")) return Isa::Avx512Vnni;
  if (avx512) return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
#endif
  return Isa::Portable;
}

Isa decide() {
  const Isa has = detected();
  const char* asked = std::getenv("TETHER_CPU_ISA");
  if (asked == nullptr || *asked == '\0') return has;
  for (Isa level : {Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni}) {
    if (std::strcmp(asked, isa_name(level)) == 0) {
      return static_cast<int>(level) < static_cast<int>(has) ? level : has;
    }
  }
  std::fprintf(stderr, "TETHER_CPU_ISA=%s is not one of portable, avx2, avx512, avx512vnni; using %s\n", asked, isa_name(has));
  return has;
}

}  // namespace

Isa cpu_isa() {
  static const Isa level = decide();
  return level;
}

const char* isa_name(Isa level) {
  switch (level) {
    case Isa::Portable: return "portable";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Vnni: return "avx512vnni";
  }
  return "portable";
}

}  // namespace tether_mlx
