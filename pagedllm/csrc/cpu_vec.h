// AVX-512 helpers shared by the CPU ops (compiled only where the build machine has AVX-512F).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_vec {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x): Cody-Waite range reduction x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for exp(r) (relative error ~2e-7, about one ulp), then scaling by 2^n with
// VSCALEFPS. Inputs below -87 give exactly 0 rather than a denormal (denormal operands would
// slow every later FMA by ~100x; their weight is below 1e-38); inputs above 88 give +inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

}  // namespace pagedllm_vec

#endif  // __AVX512F__
