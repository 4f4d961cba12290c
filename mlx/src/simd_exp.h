// Vector helpers shared by Tether's CPU kernels: the exponential, and the
// horizontal sum of an AVX2 vector.
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

// The same on 8 lanes (AVX2): 2^n built in the exponent bits, as AVX2 has
// no scalef; n >= -126 wherever the result is kept (x >= -87).
__attribute__((target("avx2,fma")))
inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 e = _mm256_set1_ps(1.f / 720);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 120));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 24));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 6));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(e, _mm256_castsi256_ps(pow2)));
}

// The sum of v's 8 lanes, in a fixed order (halves, then pairs).
__attribute__((target("avx2,fma")))
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace tether_mlx
