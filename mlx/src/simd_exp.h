// Vectorised exponential shared by Tether's CPU kernels.
#pragma once

#include <immintrin.h>

namespace tether_mlx {

// e^x for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to degree 6 (relative error under 2e-7 there), scaled by 2^n.
// Below e^-87 the result is exactly zero, so no denormals reach the FMAs.
__attribute__((target("avx512f")))
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts: the first has few enough bits that n * part is exact.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 e = _mm512_set1_ps(1.f / 720);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(e, n));
}

}  // namespace tether_mlx
